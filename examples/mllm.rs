//! Train a small multimodal LLM (vision encoder + decoder-only LLM, pure Rust) on 4
//! pipeline ranks through schedules compiled by `mpipe::schedule!`.
//!
//! ```sh
//! cargo run --release --example mllm                          # transpose(vision, 1f1b)
//! cargo run --release --example mllm -- --schedule zbv-t      # transpose(vision, zbv)
//! cargo run --release --example mllm -- --check               # pipelined == unpipelined?
//! ```

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mpipe::core::program::Program;
use mpipe::runtime::exec::{ExecError, Executor};
use mpipe::runtime::host::threads::ThreadComm;
use mpipe_mllm::pipeline::{check, train, StepReport, Train};
use mpipe_mllm::{AdamConfig, Config, Mllm};
use std::time::Duration;

/// The four schedules, compiled for one profile (trainable or frozen encoder).
macro_rules! schedules {
    ($m:ident, $profile:literal) => {
        mod $m {
            mpipe::schedule! { pub mod s_1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = 1f1b; } }
            mpipe::schedule! { pub mod s_t1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
            mpipe::schedule! { pub mod s_tzbv { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
            mpipe::schedule! { pub mod s_inter { model = $profile; ranks = 4; microbatches = 8; schedule = interleaved(v = 2); } }
        }
    };
}
schedules!(trainable, "examples/mllm.toml");
schedules!(frozen, "examples/mllm-frozen.toml");

/// Pick the module of `$s` from `$set`, then apply `$f` to it.
macro_rules! pick {
    ($s:expr, $set:ident, |$m:ident| $body:expr) => {
        match $s {
            Schedule::OneFOneB => {
                use $set::s_1f1b as $m;
                $body
            }
            Schedule::Transpose1f1b => {
                use $set::s_t1f1b as $m;
                $body
            }
            Schedule::TransposeZbv => {
                use $set::s_tzbv as $m;
                $body
            }
            Schedule::Interleaved => {
                use $set::s_inter as $m;
                $body
            }
        }
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Schedule {
    /// 1f1b, encoder inline on rank 0
    #[value(name = "1f1b")]
    OneFOneB,
    /// transpose(vision, 1f1b)
    #[value(name = "1f1b-t")]
    Transpose1f1b,
    /// transpose(vision, zbv)
    #[value(name = "zbv-t")]
    TransposeZbv,
    /// interleaved(v = 2)
    #[value(name = "interleaved")]
    Interleaved,
}

const ALL: [Schedule; 4] = [
    Schedule::OneFOneB,
    Schedule::Transpose1f1b,
    Schedule::TransposeZbv,
    Schedule::Interleaved,
];

impl Schedule {
    /// The expression, the program, and stages per rank.
    fn compiled(self, frozen: bool) -> (&'static str, &'static str, usize) {
        let chunks = match self {
            Schedule::OneFOneB | Schedule::Transpose1f1b => 1,
            Schedule::TransposeZbv | Schedule::Interleaved => 2,
        };
        if frozen {
            pick!(self, frozen, |m| (m::EXPR, m::PROGRAM_JSON, chunks))
        } else {
            pick!(self, trainable, |m| (m::EXPR, m::PROGRAM_JSON, chunks))
        }
    }

    fn run(
        self,
        frozen: bool,
        rank: usize,
        exec: &mut Executor<'_, ThreadComm, Mllm>,
    ) -> Result<(), ExecError> {
        if frozen {
            pick!(self, frozen, |m| m::run(rank, exec))
        } else {
            pick!(self, trainable, |m| m::run(rank, exec))
        }
    }
}

#[derive(Parser)]
#[command(about = "Train a small multimodal LLM through compiled pipeline schedules")]
struct Args {
    /// The compiled schedule to train with.
    #[arg(long, value_enum, default_value = "1f1b-t")]
    schedule: Schedule,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Freeze the vision encoder.
    #[arg(long)]
    frozen: bool,
    /// Run one step with every schedule and without a pipeline, and compare.
    #[arg(long)]
    check: bool,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
}

fn config(stages: usize, frozen: bool) -> Config {
    Config {
        layers: 8,
        vision_layers: 2,
        stages,
        trainable_encoder: !frozen,
        ..Config::default()
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.check {
        return run_check(args.frozen);
    }
    let (expr, json, chunks) = args.schedule.compiled(args.frozen);
    let frozen = args.frozen;
    let program = Program::from_json(json).context("the compiled program")?;
    let sched = args.schedule;
    let t = Train {
        cfg: config(program.ranks * chunks, args.frozen),
        adam: AdamConfig {
            lr: args.lr,
            ..AdamConfig::default()
        },
        data_seed: 1,
        steps: args.steps,
        update: true,
        timeout: Duration::from_secs(10),
    };
    println!(
        "training `{expr}` on {} ranks, {} micro-batches per step, {} steps",
        program.ranks, program.microbatches, args.steps
    );
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} step  {msg}")
            .context("progress style")?,
    );
    let (tx, rx) = std::sync::mpsc::channel::<StepReport>();
    let outcomes = std::thread::scope(|s| {
        let handle = s.spawn(|| {
            train(
                &program,
                &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| sched.run(frozen, r, e),
                &t,
                Some(tx),
            )
        });
        let (mut first, mut last) = (None, 0.0f32);
        for report in rx {
            if let Some(loss) = report.loss {
                first.get_or_insert(loss);
                last = loss;
                bar.set_position(report.step + 1);
                bar.set_message(format!(
                    "loss {loss:.3}  step {:.1} ms",
                    report.seconds * 1e3
                ));
            }
        }
        bar.finish();
        (handle.join(), first, last)
    });
    let (joined, first, last) = outcomes;
    let results = joined.map_err(|_| anyhow::anyhow!("the training thread panicked"))?;
    let mut peaks = Vec::new();
    for r in results {
        match r {
            Ok(o) => peaks.push(o.peaks.iter().copied().fold(0.0, f64::max)),
            Err(e) => bail!("{e}"),
        }
    }
    let predicted: Vec<f64> = if frozen {
        pick!(sched, frozen, |m| m::PEAK_MEMORY.to_vec())
    } else {
        pick!(sched, trainable, |m| m::PEAK_MEMORY.to_vec())
    };
    println!("loss {:.3} -> {last:.3}", first.unwrap_or(f32::NAN));
    println!("peak live activations per rank: measured {peaks:?}, predicted by the simulator {predicted:?}");
    Ok(())
}

fn run_check(frozen: bool) -> Result<()> {
    println!(
        "one step per schedule vs. the unpipelined step ({} encoder): largest relative difference",
        if frozen { "frozen" } else { "trainable" }
    );
    let mut worst = 0.0f64;
    for sched in ALL {
        let (expr, json, chunks) = sched.compiled(frozen);
        let program = Program::from_json(json)?;
        let cfg = config(program.ranks * chunks, frozen);
        let diffs = check(
            &program,
            &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| sched.run(frozen, r, e),
            &cfg,
            1,
        )
        .map_err(|e| anyhow::anyhow!("{expr}: {e}"))?;
        let shown: Vec<String> = diffs.iter().map(|(u, d)| format!("{u} {d:.1e}")).collect();
        println!("  {expr:<24} {}", shown.join("  "));
        worst = diffs.iter().map(|(_, d)| *d).fold(worst, f64::max);
    }
    println!(
        "worst: {worst:.2e} ({})",
        if worst <= 1e-5 {
            "within 1e-5"
        } else {
            "OVER 1e-5"
        }
    );
    if worst > 1e-5 {
        bail!("a pipelined gradient differs from the unpipelined one by more than 1e-5");
    }
    Ok(())
}
