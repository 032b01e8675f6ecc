//! `mpipe`: derive, verify, simulate, compare and draw pipeline schedules.
//!
//! A thin shell over `mpipe-core`: argument parsing and file I/O live here, every
//! decision in the library. Exit status: 0 success, 1 an invalid program (`check`) or
//! one that does not run to completion, 2 bad input (unreadable file, bad profile or
//! expression, bad arguments). Every problem found is reported, not just the first.

/// `print!` that ends the program quietly when standard output is closed (as when
/// piped into `head`) instead of panicking.
macro_rules! out {
    ($($t:tt)*) => { $crate::emit(&format!($($t)*), false) };
}

/// `println!`, with [`out!`]'s handling of a closed standard output.
macro_rules! outln {
    ($($t:tt)*) => { $crate::emit(&format!($($t)*), true) };
}

/// `eprintln!` that ignores a closed standard error instead of panicking.
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

mod alloc;
mod calibrate;
mod commands;
mod decode;
mod evaluate;
mod failure;
mod interop;
mod progress;
mod source;
mod table;

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;

/// The text after `mpipe --help`'s options. Every example line (`  mpipe ...`) of it
/// and of the subcommands' help is run by `tests/help_examples.rs` from the
/// repository's root: each must exit 0, or with the status its comment names.
const AFTER_HELP: &str = "\
Exit status: 0 success, 1 an invalid program (check) or one that does not run, 2 bad input.
Formats: docs/spec/program-format.md (programs), docs/spec/model-format.md (profiles and
expressions).

Examples (from the repository's root):
  mpipe compare --model profiles/qwen2vl-7b.toml --ranks 8 --microbatches 32 1f1b zbh1 'transpose(vision, zbv)'
  mpipe simulate --model docs/guide/examples/small-mllm.toml --ranks 4 --microbatches 8 'transpose(vision, zbv)'
  mpipe check docs/guide/examples/broken.json   # an invalid program: exit status 1, every broken rule named";

const DERIVE_EXAMPLES: &str = "\
Examples:
  mpipe derive --model docs/guide/examples/small-mllm.toml --ranks 4 --microbatches 8 1f1b
  mpipe derive --model profiles/qwen2vl-7b.toml --ranks 8 --microbatches 32 'transpose(vision, zbv)' --json";

const CHECK_EXAMPLES: &str = "\
Examples:
  mpipe check docs/guide/examples/broken.json          # invalid: exit status 1
  mpipe check --json docs/guide/examples/broken.json   # the same as JSON: exit status 1";

const SIMULATE_EXAMPLES: &str = "\
Examples:
  mpipe simulate --model profiles/qwen2vl-7b.toml --ranks 8 --microbatches 32 'transpose(vision, zbv)'
  mpipe simulate --model docs/guide/examples/small-mllm.toml --ranks 4 --microbatches 8 zbh1 --mode eager --json";

const COMPARE_EXAMPLES: &str = "\
Examples:
  mpipe compare --model docs/guide/examples/small-mllm.toml --ranks 4 --microbatches 8 1f1b zbh1 'transpose(vision, zbv)'";

const REFINE_EXAMPLES: &str = "\
Examples:
  mpipe refine docs/guide/examples/compute-only.json --order 200";

const IMPORT_EXAMPLES: &str = "\
Examples:
  mpipe import --format torch-csv docs/guide/examples/1f1b-2ranks.csv";

const EXPORT_EXAMPLES: &str = "\
Examples:
  mpipe export --format torch-csv --compute-only --model docs/guide/examples/small-mllm.toml --ranks 4 --microbatches 8 zbh1";

#[derive(Parser)]
#[command(
    name = "mpipe",
    version,
    about = "Pipeline-schedule compiler for multimodal LLM training",
    after_help = AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Derive the program of a schedule expression and print it as JSON.
    #[command(after_help = DERIVE_EXAMPLES)]
    Derive {
        #[command(flatten)]
        schedule: ScheduleArgs,
        /// Write the program here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// On failure, also print {"errors": [...]} as JSON on standard output (the
        /// program itself is always JSON).
        #[arg(long)]
        json: bool,
    },
    /// Verify a program file (rules 1-5 of docs/spec/program-format.md); exit 1 when
    /// invalid.
    #[command(after_help = CHECK_EXAMPLES)]
    Check {
        /// Program file, or `-` for standard input.
        file: String,
        /// Semantics under which termination (rule 5) and the figures are checked.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// Print {"valid", "errors", "makespan", "bubble", "peak_memory"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Simulate one schedule (or a program file) and print its time and memory.
    #[command(after_help = SIMULATE_EXAMPLES)]
    Simulate {
        #[command(flatten)]
        source: SourceArgs,
        /// Execution semantics of point-to-point transfers.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Compare several schedules on one profile, side by side.
    #[command(after_help = COMPARE_EXAMPLES)]
    Compare {
        /// Model profile (TOML or JSON).
        #[arg(long)]
        model: PathBuf,
        /// Number of pipeline ranks.
        #[arg(long, value_parser = count, allow_negative_numbers = true)]
        ranks: usize,
        /// Number of micro-batches per step.
        #[arg(long, value_parser = count, allow_negative_numbers = true)]
        microbatches: usize,
        /// Schedule expressions; the first is the baseline of the speedups.
        #[arg(required = true)]
        exprs: Vec<String>,
        /// Execution semantics of point-to-point transfers.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// Print the comparison as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evaluate profiles: every peer schedule (each body with the encoders inline,
    /// and transposed), the best mpipe schedule (`auto`), the lower bound, the
    /// speedups; optionally the Gantt charts of the baseline and the winner. Exit 1
    /// when `auto` gives no schedule for a profile.
    Evaluate {
        /// Model profiles; each is evaluated at the size its
        /// `# evaluate: ranks = R, microbatches = M` line gives.
        #[arg(required = true)]
        profiles: Vec<PathBuf>,
        /// Evaluate every profile on this many ranks instead (with --microbatches).
        #[arg(long, value_parser = count, allow_negative_numbers = true, requires = "microbatches")]
        ranks: Option<usize>,
        /// Micro-batches per step instead of each profile's own (with --ranks).
        #[arg(long, value_parser = count, allow_negative_numbers = true, requires = "ranks")]
        microbatches: Option<usize>,
        /// Write DIR/PROFILE-1f1b.svg and DIR/PROFILE-best.svg.
        #[arg(long, value_name = "DIR")]
        svg_dir: Option<PathBuf>,
        /// Print Markdown tables (for a README).
        #[arg(long)]
        markdown: bool,
        /// Execution semantics every program is derived for and timed under.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
    },
    /// Write a Chrome/Perfetto trace of the simulated step (one track per rank).
    Trace {
        #[command(flatten)]
        source: SourceArgs,
        /// Execution semantics of point-to-point transfers.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// File to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Embed the program in the trace, so that `mpipe calibrate` reads the trace
        /// alone.
        #[arg(long)]
        embed_program: bool,
    },
    /// Draw the simulated step as a Gantt chart (SVG).
    Svg {
        #[command(flatten)]
        source: SourceArgs,
        /// Execution semantics of point-to-point transfers.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// File to write.
        #[arg(short, long)]
        output: PathBuf,
        /// Width of the chart in pixels (at most 100000).
        #[arg(long, default_value_t = 1400.0, allow_negative_numbers = true)]
        width: f64,
        /// Also draw each rank's activation memory over the step, as a line in its row.
        #[arg(long)]
        memory: bool,
    },
    /// Derive a program's transfers again from its compute order (mpipe's placement
    /// and refinement): faster under rendezvous, and an order that hangs runs.
    #[command(after_help = REFINE_EXAMPLES)]
    Refine {
        /// Program file, or `-` for standard input.
        file: String,
        /// Take the link model and the memory limit from this profile.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Communication latency per transfer (overrides the profile's [link]).
        #[arg(long, allow_negative_numbers = true)]
        latency: Option<f64>,
        /// Link bandwidth, in the profile's size unit per time unit (overrides [link]).
        #[arg(long, allow_negative_numbers = true)]
        bandwidth: Option<f64>,
        /// Execution semantics the transfers are placed for and timed under.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// Also search the compute order, with up to N simulations (1 to 100000), as
        /// `refine(X, order = N)` does: tasks move into the waits before them (and
        /// weight gradients later, late producers earlier), in rounds until one
        /// finds nothing. Each rank keeps its compute tasks; without it, their order
        /// is kept too.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=mpipe_core::derive::MAX_ORDER))]
        order: Option<u64>,
        /// Write the program here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Read another tool's schedule (PyTorch's pipeline schedule CSV) as a program;
    /// exit 1 when it breaks a validity rule (a deadlock, most often).
    #[command(after_help = IMPORT_EXAMPLES)]
    Import {
        /// Format of the input.
        #[arg(long, value_enum)]
        format: interop::Format,
        /// The schedule file, or `-` for standard input.
        file: String,
        /// Model profile for the stages' costs (unit costs without one).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Post consecutive SEND/RECV actions together, in batches (torch posts each
        /// as its own call; this reads back what `mpipe export` wrote).
        #[arg(long)]
        batch_adjacent: bool,
        /// Write the program here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Measure a run from its trace: each unit's real costs and the link, against the
    /// program's; optionally the program and the profile with the measured costs.
    Calibrate {
        /// The run's trace (the JSON trace-event format, as the runtime or `mpipe trace`
        /// writes it: one complete event per action, named as mpipe names them).
        trace: String,
        /// The program that ran (default: the one the trace embeds).
        #[arg(long)]
        program: Option<String>,
        /// The profile the program was derived from: the prior link, and what
        /// --write-profile scales.
        #[arg(long)]
        model: Option<PathBuf>,
        /// The semantics the run's transfers had.
        #[arg(long, value_enum, default_value_t = ModeArg::Rendezvous)]
        mode: ModeArg,
        /// The time unit of the measured costs (the profile's).
        #[arg(long, value_enum, default_value_t = calibrate::TimeUnit::Ms)]
        time_unit: calibrate::TimeUnit,
        /// Also print every unit's measured means.
        #[arg(long)]
        units: bool,
        /// Write the program with the measured costs here.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Write the --model profile with its costs scaled to the measurements, and the
        /// fitted link, here (TOML, or JSON for a `.json` name).
        #[arg(long)]
        write_profile: Option<PathBuf>,
        /// Print the measurements as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a program (a file, or a derivation) in another tool's schedule format.
    #[command(after_help = EXPORT_EXAMPLES)]
    Export {
        /// Format of the output.
        #[arg(long, value_enum)]
        format: interop::Format,
        /// Compute actions only (torch derives the communication itself).
        #[arg(long)]
        compute_only: bool,
        /// A program file (`-` for standard input), or with --model a schedule expression.
        input: String,
        /// Derive the expression on this profile instead of reading a program file.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Number of pipeline ranks (with --model).
        #[arg(long, value_parser = count, allow_negative_numbers = true)]
        ranks: Option<usize>,
        /// Number of micro-batches per step (with --model).
        #[arg(long, value_parser = count, allow_negative_numbers = true)]
        microbatches: Option<usize>,
        /// Write the schedule here instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

/// A schedule to derive: profile, sizes and expression.
#[derive(Args, Clone)]
struct ScheduleArgs {
    /// Model profile (TOML or JSON).
    #[arg(long)]
    model: PathBuf,
    /// Number of pipeline ranks.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    ranks: usize,
    /// Number of micro-batches per step.
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
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
    /// Model profile (TOML or JSON).
    #[arg(long, required_unless_present = "program")]
    model: Option<PathBuf>,
    /// Number of pipeline ranks.
    #[arg(
        long,
        required_unless_present = "program",
        value_parser = count,
        allow_negative_numbers = true
    )]
    ranks: Option<usize>,
    /// Number of micro-batches per step.
    #[arg(
        long,
        required_unless_present = "program",
        value_parser = count,
        allow_negative_numbers = true
    )]
    microbatches: Option<usize>,
    /// Schedule expression, e.g. `transpose(vision, 1f1b)`.
    #[arg(required_unless_present = "program")]
    expr: Option<String>,
    /// Communication latency per transfer (overrides the profile's [link]).
    #[arg(long, allow_negative_numbers = true)]
    latency: Option<f64>,
    /// Link bandwidth, in the profile's size unit per time unit (overrides [link]).
    #[arg(long, allow_negative_numbers = true)]
    bandwidth: Option<f64>,
}

/// A count on the command line (`--ranks`, `--microbatches`). Zero parses, so that
/// it is reported with the other problems of the run.
fn count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("expected a whole number >= 1, such as 8; got `{s}`"))
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    /// A transfer completes when both sides have reached it (HCCL-like; the default).
    Rendezvous,
    /// A SEND completes when reached; a RECV waits for its SEND.
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

/// Write to standard output; a reader that went away ends the program (status 0),
/// any other write error is reported (status 2).
fn emit(text: &str, newline: bool) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out.write_all(text.as_bytes()).and_then(|()| {
        if newline {
            out.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    if let Err(e) = written {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        errln!("error: cannot write to standard output: {e}");
        std::process::exit(2);
    }
}

fn main() -> ExitCode {
    alloc::map_large_blocks();
    let cli = Cli::parse();
    // Commands whose `--json` output must stay JSON when they fail as a whole.
    let json_failures = matches!(
        cli.command,
        Command::Derive { json: true, .. }
            | Command::Simulate { json: true, .. }
            | Command::Compare { json: true, .. }
            | Command::Calibrate { json: true, .. }
    );
    // Long work (`auto`, `evaluate`) shows progress bars on a terminal, and a line
    // every few seconds (MPIPE_PROGRESS_INTERVAL) on a pipe or in a log.
    let observer: std::sync::Arc<dyn mpipe_core::progress::Progress> =
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            std::sync::Arc::new(progress::Bars::new())
        } else {
            std::sync::Arc::new(progress::Lines::new(progress::interval_from_env()))
        };
    let result = mpipe_core::progress::with_progress(observer, || run(cli.command));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            if json_failures {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&f.to_json()).unwrap_or_default()
                );
            }
            errln!("{}", f.terminal());
            ExitCode::from(f.code)
        }
    }
}

/// Runs one command.
fn run(command: Command) -> Result<u8, failure::Failure> {
    match command {
        Command::Derive {
            schedule,
            output,
            json: _,
        } => commands::derive(&schedule, output.as_deref()),
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
        Command::Evaluate {
            profiles,
            ranks,
            microbatches,
            svg_dir,
            markdown,
            mode,
        } => evaluate::evaluate(&evaluate::Options {
            profiles: &profiles,
            size: ranks.zip(microbatches),
            svg_dir: svg_dir.as_deref(),
            markdown,
            mode: mode.into(),
        }),
        Command::Trace {
            source,
            mode,
            output,
            embed_program,
        } => commands::trace(&source, mode.into(), &output, embed_program),
        Command::Svg {
            source,
            mode,
            output,
            width,
            memory,
        } => commands::svg(&source, mode.into(), &output, width, memory),
        Command::Refine {
            file,
            model,
            latency,
            bandwidth,
            mode,
            order,
            output,
        } => commands::refine(
            &file,
            model.as_deref(),
            (latency, bandwidth),
            mode.into(),
            order.unwrap_or(0) as usize,
            output.as_deref(),
        ),
        Command::Calibrate {
            trace,
            program,
            model,
            mode,
            time_unit,
            units,
            output,
            write_profile,
            json,
        } => calibrate::calibrate(&calibrate::Options {
            trace: &trace,
            program: program.as_deref(),
            model: model.as_deref(),
            mode: mode.into(),
            unit: time_unit,
            units,
            output: output.as_deref(),
            write_profile: write_profile.as_deref(),
            json,
        }),
        Command::Import {
            format,
            file,
            model,
            batch_adjacent,
            output,
        } => interop::import(
            format,
            &file,
            model.as_deref(),
            batch_adjacent,
            output.as_deref(),
        ),
        Command::Export {
            format,
            compute_only,
            input,
            model,
            ranks,
            microbatches,
            output,
        } => interop::export_cmd(
            format,
            &interop::ExportSource {
                input: &input,
                model: model.as_ref(),
                ranks,
                microbatches,
            },
            compute_only,
            output.as_deref(),
        ),
    }
}
