//! `mpipe`: derive, verify, simulate, compare and draw pipeline schedules.
//!
//! A thin shell over `mpipe-core`: argument parsing and file I/O live here, every
//! decision in the library. Exit status: 0 success, 1 an invalid program (`check`),
//! 2 bad input (unreadable file, bad profile or expression).

mod commands;
mod source;
mod table;

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "mpipe",
    version,
    about = "Pipeline-schedule compiler for multimodal LLM training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Derive the program of a schedule expression and print it as JSON.
    Derive {
        #[command(flatten)]
        schedule: ScheduleArgs,
        /// Write the program here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Verify a program file (rules 1-5 of program-format.md); exit 1 when invalid.
    Check {
        /// Program file, or `-` for standard input.
        file: String,
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// Print {"valid", "errors", "makespan", "bubble", "peak_memory"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Simulate one schedule (or a program file) and print its time and memory.
    Simulate {
        #[command(flatten)]
        source: SourceArgs,
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        #[arg(long)]
        json: bool,
    },
    /// Compare several schedules on one profile, side by side.
    Compare {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        ranks: usize,
        #[arg(long)]
        microbatches: usize,
        /// Schedule expressions; the first is the baseline of the speedups.
        #[arg(required = true)]
        exprs: Vec<String>,
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        #[arg(long)]
        json: bool,
    },
    /// Write a Chrome/Perfetto trace of the simulated step (one track per rank).
    Trace {
        #[command(flatten)]
        source: SourceArgs,
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Draw the simulated step as a Gantt chart (SVG).
    Svg {
        #[command(flatten)]
        source: SourceArgs,
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        #[arg(short, long)]
        output: PathBuf,
        /// Width of the chart in pixels.
        #[arg(long, default_value_t = 1400.0)]
        width: f64,
    },
}

/// A schedule to derive: profile, sizes and expression.
#[derive(Args, Clone)]
struct ScheduleArgs {
    /// Model profile (TOML or JSON).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    ranks: usize,
    #[arg(long)]
    microbatches: usize,
    /// Schedule expression, e.g. `transpose(vision, 1f1b)`.
    expr: String,
}

/// A schedule to derive, or a program file.
#[derive(Args, Clone)]
struct SourceArgs {
    /// Read this program file (or `-`) instead of deriving.
    #[arg(long, conflicts_with_all = ["model", "ranks", "microbatches", "expr"])]
    program: Option<String>,
    #[arg(long, required_unless_present = "program")]
    model: Option<PathBuf>,
    #[arg(long, required_unless_present = "program")]
    ranks: Option<usize>,
    #[arg(long, required_unless_present = "program")]
    microbatches: Option<usize>,
    #[arg(required_unless_present = "program")]
    expr: Option<String>,
    /// Communication latency per transfer (overrides the profile's [link]).
    #[arg(long)]
    latency: Option<f64>,
    /// Link bandwidth, in the profile's size unit per time unit (overrides [link]).
    #[arg(long)]
    bandwidth: Option<f64>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Rendezvous,
    Eager,
}

impl From<ModeArg> for mpipe_core::simulate::Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Rendezvous => mpipe_core::simulate::Mode::Rendezvous,
            ModeArg::Eager => mpipe_core::simulate::Mode::Eager,
        }
    }
}

/// A command's failure: its message is already formatted for the terminal.
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure {
            code: 2,
            message: format!("error: {e:#}"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Derive { schedule, output } => commands::derive(&schedule, output.as_deref()),
        Command::Check { file, mode, json } => commands::check(&file, mode.into(), json),
        Command::Simulate { source, mode, json } => commands::simulate(&source, mode.into(), json),
        Command::Compare {
            model,
            ranks,
            microbatches,
            exprs,
            mode,
            json,
        } => commands::compare(&model, ranks, microbatches, &exprs, mode.into(), json),
        Command::Trace {
            source,
            mode,
            output,
        } => commands::trace(&source, mode.into(), &output),
        Command::Svg {
            source,
            mode,
            output,
            width,
        } => commands::svg(&source, mode.into(), &output, width),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            eprintln!("{}", f.message);
            ExitCode::from(f.code)
        }
    }
}
