//! Train a small multimodal LLM (vision encoder + decoder-only LLM, pure Rust) on 4
//! pipeline ranks through schedules compiled by `mpipe::schedule!`.
//!
//! ```sh
//! cargo run --release --example mllm                          # transpose(vision, 1f1b)
//! cargo run --release --example mllm -- --schedule zbv-t      # transpose(vision, zbv)
//! cargo run --release --example mllm -- --check               # pipelined == unpipelined?
//! cargo run --release --example mllm -- --processes           # ranks as processes (TCP)
//! cargo run --release --example mllm -- --checkpoint ck --checkpoint-every 50
//! cargo run --release --example mllm -- --resume ck           # continue from ck
//! cargo run --release --example mllm -- --trace real.json --trace-sim sim.json
//! cargo run --release --features ascend --example mllm -- --backend ascend --check
//! ```
//!
//! **Ranks.** By default the ranks are threads of this process. With `--processes`
//! the example starts itself once per rank through `mpipe-run`'s launcher
//! (`mpipe_runtime::host::launch`), each child's output lines prefixed `[rank R]`,
//! and the ranks talk over loopback TCP. A process started with `RANK`,
//! `WORLD_SIZE` and `MASTER_PORT` in its environment (by that launcher, `mpipe-run`,
//! torchrun or a Slurm wrapper) runs that one rank (`host::tcp::from_env`); the rank
//! that computes the loss prints progress lines. `MPIPE_FAULT_RANK=R` (with
//! `MPIPE_FAULT_STEP=S`, counted from 0, default 1) makes rank R exit with code 3
//! halfway through step S, to see the others stop naming it.
//!
//! **Checkpoints.** `--checkpoint DIR` saves every `--checkpoint-every` steps (each
//! rank its home units' parameters and Adam state, see
//! `mpipe_runtime::checkpoint`); `--resume DIR` continues from the last complete
//! set, with the same data stream, up to `--steps`.
//!
//! **Traces.** `--trace FILE` writes the last step as every rank ran it (wall clock,
//! one track per rank; with `--processes` the ranks send their timings to rank 0,
//! which writes the file), `--trace-sim FILE` the simulator's prediction of the same
//! program, for side-by-side viewing in <https://ui.perfetto.dev>.
//!
//! **Backends.** `--backend host` (default) is the CPU communicator above;
//! `--backend ascend` (built with `--features ascend`) trains on the device through
//! `mpipe_runtime::ascend::device` (on the ascend-sys emulator when no CANN toolkit
//! is installed), one device per rank: the model computes through aclnn kernels
//! (`mpipe_mllm::device::DeviceMllm`), activations and gradients live in a planned
//! device arena and travel by one `HcclBatchSendRecv` per batch, the optimizer runs on
//! the device (`mpipe_mllm::optim::device::DeviceAdam`), and the host waits once per
//! step. The ranks run as threads, or with `--processes` one process per device as
//! on a cluster (each joins through `AscendComm::from_env`). With `--checkpoint` the
//! Ascend backend keeps the model on the host (the host executor over HCCL), which
//! saves checkpoints. With `--check` the Ascend backend always runs one process per
//! device, and every gradient is compared with the host backend's and the
//! unpipelined step's. `--counters` prints the emulator's counters of one step.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mpipe::core::program::Program;
use mpipe::runtime::checkpoint::Manifest;
use mpipe::runtime::comm::Comm;
use mpipe::runtime::exec::{ExecError, Executor};
use mpipe::runtime::host::launch::{launch, Launch};
use mpipe::runtime::host::tcp::{self, TcpComm};
use mpipe::runtime::host::threads::ThreadComm;
use mpipe::runtime::host::{default_timeout, Error, HostComm, Mode};
use mpipe::runtime::{P2p, Step, UnitId};
// A closed standard output or error ends a rank quietly, never with a panic.
use mpipe::runtime::{errln as eprintln, outln as println};
use mpipe_mllm::pipeline::{
    check, gather_timeline, outcomes_timeline, param_checksums, real_trace, simulated_trace,
    train_rank, train_with, Checkpointing, RankOutcome, StepReport, Train,
};
use mpipe_mllm::{AdamConfig, Config, Mllm};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The four schedules, compiled for one profile (trainable or frozen encoder).
macro_rules! schedules {
    ($m:ident, $profile:literal) => {
        mod $m {
            mpipe::schedule! { pub(crate) mod s_1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = 1f1b; } }
            mpipe::schedule! { pub(crate) mod s_t1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
            mpipe::schedule! { pub(crate) mod s_tzbv { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
            mpipe::schedule! { pub(crate) mod s_inter { model = $profile; ranks = 4; microbatches = 8; schedule = interleaved(v = 2); } }
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

    /// The generated code of `rank`, on any backend (an executor, or a wrapper).
    fn run<S: Step + ?Sized>(
        self,
        frozen: bool,
        rank: usize,
        exec: &mut S,
    ) -> Result<(), S::Error> {
        if frozen {
            pick!(self, frozen, |m| m::run(rank, exec))
        } else {
            pick!(self, trainable, |m| m::run(rank, exec))
        }
    }
}

/// The communication backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// CPU communicator (threads, or processes over loopback TCP)
    Host,
    /// HCCL/AscendCL (threads of this process, one device each; `--features ascend`)
    Ascend,
}

const ASCEND_HOW: &str = "--backend ascend needs the `ascend` feature: \
    cargo run --release --features ascend --example mllm -- --backend ascend";

/// `--comm`: the host backend's point-to-point semantics.
#[derive(Clone, Copy, ValueEnum)]
enum CommMode {
    Rendezvous,
    Eager,
}

impl From<CommMode> for Mode {
    fn from(m: CommMode) -> Mode {
        match m {
            CommMode::Rendezvous => Mode::Rendezvous,
            CommMode::Eager => Mode::Eager,
        }
    }
}

#[derive(Parser)]
#[command(about = "Train a small multimodal LLM through compiled pipeline schedules")]
struct Args {
    /// The compiled schedule to train with.
    #[arg(long, value_enum, default_value = "1f1b-t")]
    schedule: Schedule,
    /// Training steps (in all, counting those before a resumed checkpoint).
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
    /// Run the ranks as separate processes over loopback TCP (this example started
    /// once per rank by mpipe-run's launcher).
    #[arg(long)]
    processes: bool,
    /// Save a checkpoint set into DIR every --checkpoint-every steps.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, value_name = "N", default_value_t = 50)]
    checkpoint_every: u64,
    /// Resume from the last complete checkpoint set in DIR.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Write a Chrome/Perfetto trace of the last step as the ranks ran it.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Write the simulator's Chrome/Perfetto trace of the same program.
    #[arg(long, value_name = "FILE")]
    trace_sim: Option<PathBuf>,
    /// The communication backend.
    #[arg(long, value_enum, default_value = "host")]
    backend: Backend,
    /// Point-to-point semantics on the host backend: `eager` sends complete into the
    /// receiver's buffer (the semantics `mpipe derive --mode eager` times programs
    /// under); `rendezvous` sends wait for their receive, as HCCL's do.
    #[arg(long, value_enum, default_value = "rendezvous")]
    comm: CommMode,
    /// With `--backend ascend`: for each compiled schedule, run two steps (ranks as
    /// threads, rank r on device r) and print the emulator's counters of the second,
    /// summed over the ranks (one `counters <expression>: ...` line each).
    #[arg(long)]
    counters: bool,
    /// (internal) `--check` on the Ascend backend: this process is one rank of the
    /// check; it writes its gradients into DIR.
    #[arg(long, value_name = "DIR", hide = true)]
    check_out: Option<PathBuf>,
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

/// Everything a run needs, from the arguments.
struct Run {
    sched: Schedule,
    frozen: bool,
    expr: &'static str,
    program: Program,
    t: Train,
    ck: Checkpointing,
    /// The step the run starts at (after a resumed checkpoint).
    first: u64,
    predicted: Vec<f64>,
}

impl Run {
    /// The line a host run starts with; `how` says how the ranks run.
    fn banner(&self, how: &str) -> String {
        let transfers = match self.t.mode {
            Mode::Rendezvous => "",
            Mode::Eager => ", eager transfers",
        };
        format!(
            "training `{}` on {} ranks{how}, {} micro-batches per step, steps {}..{}{transfers}",
            self.expr, self.program.ranks, self.program.microbatches, self.first, self.t.steps
        )
    }

    fn new(args: &Args) -> Result<Run> {
        let (expr, json, chunks) = args.schedule.compiled(args.frozen);
        let program = Program::from_json(json).context("the compiled program")?;
        let t = Train {
            cfg: config(program.ranks * chunks, args.frozen),
            adam: AdamConfig {
                lr: args.lr,
                ..AdamConfig::default()
            },
            data_seed: 1,
            steps: args.steps,
            update: true,
            timeout: default_timeout(),
            mode: args.comm.into(),
        };
        let ck = Checkpointing {
            checkpoint: args.checkpoint.clone().map(|d| (d, args.checkpoint_every)),
            resume: args.resume.clone(),
        };
        // (A missing or bad set is reported by every rank when it loads its file.)
        let first = args
            .resume
            .as_deref()
            .and_then(|d| Manifest::read(d).ok())
            .map_or(0, |m| m.step);
        let predicted: Vec<f64> = if args.frozen {
            pick!(args.schedule, frozen, |m| m::PEAK_MEMORY.to_vec())
        } else {
            pick!(args.schedule, trainable, |m| m::PEAK_MEMORY.to_vec())
        };
        if let Some(dir) = &args.checkpoint {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the checkpoint directory {}", dir.display()))?;
        }
        Ok(Run {
            sched: args.schedule,
            frozen: args.frozen,
            expr,
            program,
            t,
            ck,
            first,
            predicted,
        })
    }

    /// The rank that computes the loss (the last unit).
    fn reporter(&self, rank: usize) -> bool {
        let last = self.program.units.last().map_or("", |u| u.name.as_str());
        self.program.programs[rank].iter().any(|a| a.unit() == last)
    }

    fn trace_name(&self) -> String {
        format!(
            "{}: step {} as run",
            self.expr,
            self.t.steps.saturating_sub(1)
        )
    }
}

fn write(path: &Path, text: &str, what: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {what} to {}", path.display()))?;
    println!("wrote {what} to {}", path.display());
    Ok(())
}

/// `parameter checksums: vision=0123456789abcdef llm.0=...`, to compare runs bit
/// for bit.
fn checksum_line(program: &Program, params: &[(usize, Vec<f32>)]) -> String {
    let sums: Vec<String> = param_checksums(params)
        .into_iter()
        .map(|(u, h)| format!("{}={h:016x}", program.units[u].name))
        .collect();
    format!("parameter checksums: {}", sums.join(" "))
}

fn main() -> Result<ExitCode> {
    let args = Args::parse();
    if args.backend == Backend::Ascend && !cfg!(feature = "ascend") {
        bail!(ASCEND_HOW);
    }
    if args.backend == Backend::Ascend && args.resume.is_some() {
        bail!("--backend ascend does not resume from checkpoints yet; leave out --resume");
    }
    if args.backend == Backend::Ascend && matches!(args.comm, CommMode::Eager) {
        bail!("--comm eager is a host-backend mode; HCCL's transfers are rendezvous: leave out --comm eager");
    }
    // A process started by a launcher runs one rank.
    let launched = ["RANK", "WORLD_SIZE", "MASTER_PORT"]
        .iter()
        .all(|v| std::env::var_os(v).is_some());
    if let Some(dir) = &args.check_out {
        return ascend::check_rank(args.schedule, args.frozen, dir).map(|()| ExitCode::SUCCESS);
    }
    if args.counters {
        if args.backend != Backend::Ascend {
            bail!("--counters reads the Ascend emulator's counters: add --backend ascend");
        }
        return ascend::counters(args.frozen).map(|()| ExitCode::SUCCESS);
    }
    if args.check {
        if args.processes {
            bail!(
                "--check chooses its ranks itself (threads on the host backend, processes on \
                 the Ascend backend); leave out --processes"
            );
        }
        return run_check(args.frozen, args.backend).map(|()| ExitCode::SUCCESS);
    }
    let run = Run::new(&args)?;
    if args.backend == Backend::Ascend {
        return match (launched && !args.processes, args.processes) {
            (true, _) => ascend::train_rank_process(&run),
            (false, true) => run_processes(&run),
            (false, false) => ascend::train(&run).map(|()| ExitCode::SUCCESS),
        };
    }
    if launched && !args.processes {
        return run_rank_process(&args, &run);
    }
    if let Some(path) = &args.trace_sim {
        let name = format!("{} (simulated)", run.expr);
        let text = simulated_trace(&run.program, &name).map_err(|e| anyhow!(e))?;
        write(path, &text, "the simulated trace")?;
    }
    if run.first >= run.t.steps && args.resume.is_some() {
        println!(
            "the checkpoint is at step {}, --steps is {}: nothing to do",
            run.first, run.t.steps
        );
        return Ok(ExitCode::SUCCESS);
    }
    if args.processes {
        run_processes(&run)
    } else {
        run_threads(&args, &run)
    }
}

/// `--processes`: this program again, once per rank, through the launcher.
fn run_processes(run: &Run) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("finding this program's executable")?;
    let args: Vec<OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--processes")
        .collect();
    println!("{}", run.banner(" as processes"));
    // SIGINT/SIGTERM/SIGHUP reach every rank, and the launcher cleans up.
    mpipe::runtime::host::launch::forward_signals();
    let report = launch(&Launch {
        ranks: run.program.ranks,
        port: None,
        grace: Duration::from_secs(10),
        program: exe.into_os_string(),
        args,
    })
    .map_err(|e| anyhow!(e))?;
    Ok(ExitCode::from(u8::try_from(report.code).unwrap_or(1)))
}

/// A [`Step`] that exits the process (code 3, without a goodbye to the peers, as a
/// crash would) after `left` more actions: `MPIPE_FAULT_RANK`'s fault.
struct Fault<'e, S: ?Sized> {
    inner: &'e mut S,
    left: usize,
    rank: usize,
    step: u64,
}

impl<S: Step + ?Sized> Fault<'_, S> {
    fn tick(&mut self) {
        if self.left == 0 {
            eprintln!(
                "rank {}: exiting with code 3 in the middle of step {} (counted from 0) on purpose (MPIPE_FAULT_RANK)",
                self.rank, self.step
            );
            std::process::exit(3);
        }
        self.left -= 1;
    }
}

impl<S: Step + ?Sized> Step for Fault<'_, S> {
    type Error = S::Error;
    fn forward(&mut self, unit: UnitId, mb: usize) -> Result<(), S::Error> {
        self.tick();
        self.inner.forward(unit, mb)
    }
    fn backward_input(&mut self, unit: UnitId, mb: usize) -> Result<(), S::Error> {
        self.tick();
        self.inner.backward_input(unit, mb)
    }
    fn backward_weight(&mut self, unit: UnitId, mb: usize) -> Result<(), S::Error> {
        self.tick();
        self.inner.backward_weight(unit, mb)
    }
    fn backward(&mut self, unit: UnitId, mb: usize) -> Result<(), S::Error> {
        self.tick();
        self.inner.backward(unit, mb)
    }
    fn recompute(&mut self, unit: UnitId, mb: usize) -> Result<(), S::Error> {
        self.tick();
        self.inner.recompute(unit, mb)
    }
    fn p2p(&mut self, batch: &[P2p]) -> Result<(), S::Error> {
        self.tick();
        self.inner.p2p(batch)
    }
    fn broadcast(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), S::Error> {
        self.tick();
        self.inner.broadcast(unit, root, group)
    }
    fn reduce(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), S::Error> {
        self.tick();
        self.inner.reduce(unit, root, group)
    }
    fn no_such_rank(&mut self, rank: usize, ranks: usize) -> S::Error {
        self.inner.no_such_rank(rank, ranks)
    }
}

/// `MPIPE_FAULT_RANK` / `MPIPE_FAULT_STEP`: the step at which this rank fails.
fn fault_step(rank: usize) -> Result<Option<u64>> {
    let Ok(r) = std::env::var("MPIPE_FAULT_RANK") else {
        return Ok(None);
    };
    let r: usize = r
        .trim()
        .parse()
        .with_context(|| format!("MPIPE_FAULT_RANK={r:?} is not a rank"))?;
    let step = match std::env::var("MPIPE_FAULT_STEP") {
        Ok(s) => s
            .trim()
            .parse()
            .with_context(|| format!("MPIPE_FAULT_STEP={s:?} is not a step"))?,
        Err(_) => 1,
    };
    Ok((r == rank).then_some(step))
}

/// Under `mpipe-run`'s launcher: notes which rank this one's failure came from (the
/// file the launcher reads to tell the first failure from its consequences).
///
/// The communicator notes it too, from the thread that hears of the failure, but
/// only after waking the rank's waiting call, so a rank that exits at once can be
/// gone before the note is written; the launcher would then blame it. Writing the
/// same note here, before exiting, closes that race.
fn note_blame(comm: &TcpComm) {
    let (Some(dir), Some(Error::PeerFailed { rank: origin, what })) = (
        std::env::var_os(tcp::BLAME_DIR_VAR),
        comm.aborter().failed(),
    ) else {
        return;
    };
    if origin != comm.rank() {
        let path = Path::new(&dir).join(tcp::blame_file_name(comm.rank()));
        let _ = std::fs::write(path, format!("{origin}\n{what}\n"));
    }
}

/// The error for a step whose loss is NaN or infinite (the run stops there).
fn non_finite_loss(step: u64, steps: u64, loss: f32) -> String {
    format!(
        "step {}/{steps}: the loss is {loss}, not a finite number: training diverged \
         (or started from bad parameters); lower --lr, or resume from an earlier checkpoint",
        step + 1
    )
}

/// One rank of a multi-process run (started by a launcher).
fn run_rank_process(args: &Args, run: &Run) -> Result<ExitCode> {
    let mut comm = tcp::from_env(run.t.timeout).context("connecting to the other ranks")?;
    comm.set_mode(run.t.mode);
    let rank = comm.rank();
    let fault = fault_step(rank)?;
    let calls = AtomicU64::new(run.first);
    let half = run.program.programs.get(rank).map_or(0, Vec::len) / 2;
    let (sched, frozen) = (run.sched, run.frozen);
    let code = |r: usize, e: &mut Executor<'_, TcpComm, Mllm>| -> Result<(), ExecError> {
        let step = calls.fetch_add(1, Ordering::Relaxed);
        if fault == Some(step) {
            let mut f = Fault {
                inner: e,
                left: half,
                rank: r,
                step,
            };
            return sched.run(frozen, r, &mut f);
        }
        sched.run(frozen, r, e)
    };
    let steps = run.t.steps;
    let every = (steps / 20).max(1);
    let first = run.first;
    let aborter = comm.aborter();
    let print = |rep: &StepReport| {
        let Some(loss) = rep.loss else { return };
        if !loss.is_finite() {
            // Every rank's next call fails with this, and the run stops.
            aborter.abort(&non_finite_loss(rep.step, steps, loss));
            return;
        }
        if rep.step == first
            || (rep.step + 1).checked_rem(every) == Some(0)
            || rep.step + 1 == steps
        {
            println!(
                "step {}/{steps}  loss {loss:.3}  step time {:.1} ms",
                rep.step + 1,
                rep.seconds * 1e3
            );
        }
    };
    let progress = run
        .reporter(rank)
        .then_some(&print as &(dyn Fn(&StepReport) + Sync));
    let fail = |comm: &mut TcpComm, e: String| {
        eprintln!("{e}");
        comm.abort(&e);
        note_blame(comm);
        Ok(ExitCode::from(1))
    };
    let outcome = match train_rank(&mut comm, &run.program, &code, &run.t, &run.ck, progress) {
        Ok(o) => o,
        Err(e) => return fail(&mut comm, e.to_string()),
    };
    if let Some(path) = &args.trace {
        match gather_timeline(&mut comm, &outcome) {
            Ok(Some(timeline)) => {
                let text = real_trace(&run.program, &timeline, &run.trace_name());
                write(path, &text, "the trace of the last step")?;
            }
            Ok(None) => {}
            Err(e) => return fail(&mut comm, e.to_string()),
        }
    }
    let peak = outcome.peaks.iter().copied().fold(0.0, f64::max);
    println!(
        "done: peak live activations {peak} (predicted {}); {}",
        run.predicted.get(rank).copied().unwrap_or(f64::NAN),
        checksum_line(&run.program, &outcome.params)
    );
    Ok(ExitCode::SUCCESS)
}

/// Ranks as threads, with a progress bar.
fn run_threads(args: &Args, run: &Run) -> Result<ExitCode> {
    println!("{}", run.banner(""));
    let bar = ProgressBar::new(run.t.steps);
    bar.set_position(run.first);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} step  {msg}")
            .context("progress style")?,
    );
    let (sched, frozen) = (run.sched, run.frozen);
    let (tx, rx) = std::sync::mpsc::channel::<StepReport>();
    let outcomes = std::thread::scope(|s| {
        let handle = s.spawn(|| {
            train_with(
                &run.program,
                &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| sched.run(frozen, r, e),
                &run.t,
                &run.ck,
                Some(tx),
            )
        });
        let (mut first, mut last) = (None, 0.0f32);
        for report in rx {
            if let Some(loss) = report.loss {
                if !loss.is_finite() {
                    bar.abandon();
                    eprintln!("error: {}", non_finite_loss(report.step, run.t.steps, loss));
                    std::process::exit(1);
                }
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
    let results = joined.map_err(|_| anyhow!("the training thread panicked"))?;
    let mut done: Vec<RankOutcome> = Vec::new();
    for r in results {
        match r {
            Ok(o) => done.push(o),
            Err(e) => bail!("{e}"),
        }
    }
    let peaks: Vec<f64> = done
        .iter()
        .map(|o| o.peaks.iter().copied().fold(0.0, f64::max))
        .collect();
    println!("loss {:.3} -> {last:.3}", first.unwrap_or(f32::NAN));
    println!(
        "peak live activations per rank: measured {peaks:?}, predicted by the simulator {:?}",
        run.predicted
    );
    if let Some(path) = &args.trace {
        let text = real_trace(&run.program, &outcomes_timeline(&done), &run.trace_name());
        write(path, &text, "the trace of the last step")?;
    }
    let mut params: Vec<(usize, Vec<f32>)> = done.into_iter().flat_map(|o| o.params).collect();
    params.sort_by_key(|p| p.0);
    println!("{}", checksum_line(&run.program, &params));
    Ok(ExitCode::SUCCESS)
}

/// The data stream of `--check`'s step.
const CHECK_SEED: u64 = 1;

fn run_check(frozen: bool, backend: Backend) -> Result<()> {
    println!(
        "one step per schedule vs. the unpipelined step ({} encoder, {}): largest relative difference",
        if frozen { "frozen" } else { "trainable" },
        match backend {
            Backend::Host => "host backend, ranks as threads",
            Backend::Ascend => "Ascend backend, one process per device",
        }
    );
    let mut worst = 0.0f64;
    for sched in ALL {
        let (expr, json, chunks) = sched.compiled(frozen);
        let program = Program::from_json(json)?;
        let cfg = config(program.ranks * chunks, frozen);
        let diffs = match backend {
            Backend::Host => check(
                &program,
                &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| sched.run(frozen, r, e),
                &cfg,
                CHECK_SEED,
            ),
            Backend::Ascend => ascend::check(&program, sched, frozen, &cfg),
        }
        .map_err(|e| anyhow!("{expr}: {e}"))?;
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

/// `--backend ascend`: the same training loop over `mpipe_runtime::ascend::AscendComm`.
#[cfg(feature = "ascend")]
mod ascend {
    use super::*;
    // The closed-pipe-safe macros, not the prelude's (the glob above is ambiguous).
    use super::{eprintln, println};
    use mpipe::runtime::ascend::device::DeviceStep;
    use mpipe::runtime::ascend::{counters, run_ranks, AscendComm};
    use mpipe_mllm::device::DeviceMllm;
    use mpipe_mllm::pipeline::device::train_rank_device;
    use mpipe_mllm::pipeline::StepReport;
    use mpipe_mllm::pipeline::{rel_diff, train as train_host};
    use mpipe_mllm::Dataset;
    use serde::{Deserialize, Serialize};

    fn code(
        sched: Schedule,
        frozen: bool,
    ) -> impl Fn(usize, &mut Executor<'_, AscendComm, Mllm>) -> Result<(), ExecError> + Sync {
        move |r, e| sched.run(frozen, r, e)
    }

    /// The generated code driving a device step (the model on the device).
    fn device_code(
        sched: Schedule,
        frozen: bool,
    ) -> impl Fn(usize, &mut DeviceStep<'_, DeviceMllm>) -> Result<(), ExecError> + Sync {
        move |r, s| sched.run(frozen, r, s)
    }

    /// One step without an update (the check's training options).
    fn check_train(cfg: &Config) -> Train {
        Train {
            cfg: cfg.clone(),
            adam: AdamConfig::default(),
            data_seed: CHECK_SEED,
            steps: 1,
            update: false,
            timeout: Duration::from_secs(30),
            mode: Mode::Rendezvous,
        }
    }

    /// What one rank of the check reports to the process that compares.
    #[derive(Serialize, Deserialize)]
    struct RankGrads {
        rank: usize,
        grads: Vec<(usize, Vec<f32>)>,
        losses: Vec<f32>,
    }

    fn grads_file(dir: &Path, rank: usize) -> PathBuf {
        dir.join(format!("rank-{rank}.json"))
    }

    /// One rank of `--check` (a process started by [`check`]): joins the world from
    /// the launcher's variables, runs the step, writes its gradients into `dir`.
    pub(crate) fn check_rank(sched: Schedule, frozen: bool, dir: &Path) -> Result<()> {
        let (expr, json, chunks) = sched.compiled(frozen);
        let program = Program::from_json(json).context("the compiled program")?;
        let t = check_train(&config(program.ranks * chunks, frozen));
        let comm = AscendComm::from_env(t.timeout).context("joining the HCCL world")?;
        let o = train_rank_device(comm, &program, &device_code(sched, frozen), &t, None)
            .map_err(|e| anyhow!("{expr}: {e}"))?;
        let out = RankGrads {
            rank: o.rank,
            grads: o.grads,
            losses: o.losses,
        };
        let path = grads_file(dir, out.rank);
        std::fs::write(&path, serde_json::to_string(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Runs the step as one process per device (this program again, through the
    /// launcher) and collects every rank's gradients.
    fn check_processes(
        program: &Program,
        sched: Schedule,
        frozen: bool,
    ) -> Result<Vec<RankGrads>, String> {
        let dir = std::env::temp_dir().join(format!(
            "mpipe-ascend-check-{}-{}",
            std::process::id(),
            sched as u8
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
        let name = sched
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        let mut args: Vec<OsString> = ["--backend", "ascend", "--schedule", &name, "--check-out"]
            .iter()
            .map(OsString::from)
            .collect();
        args.push(dir.clone().into_os_string());
        if frozen {
            args.push("--frozen".into());
        }
        let report = launch(&Launch {
            ranks: program.ranks,
            port: None,
            grace: Duration::from_secs(10),
            program: exe.into_os_string(),
            args,
        });
        let read = |r: usize| -> Result<RankGrads, String> {
            let path = grads_file(&dir, r);
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("rank {r} wrote no gradients ({}: {e})", path.display()))?;
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
        };
        let out = match report {
            Err(e) => Err(e),
            Ok(rep) if rep.code != 0 => Err(format!(
                "rank {} failed (exits: {:?})",
                rep.first_failure.map_or("?".into(), |r| r.to_string()),
                rep.exits
            )),
            Ok(_) => (0..program.ranks).map(read).collect(),
        };
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    /// One step on HCCL, one process per device: `(unit, difference from the
    /// unpipelined step)` per trainable unit, then `("loss", ..)`, then `("host",
    /// largest difference from the host backend's gradients)`.
    pub(crate) fn check(
        program: &Program,
        sched: Schedule,
        frozen: bool,
        cfg: &Config,
    ) -> Result<Vec<(String, f64)>, String> {
        let t = check_train(cfg);
        let hccl = check_processes(program, sched, frozen)?;
        let host: Vec<RankOutcome> = train_host(
            program,
            &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| sched.run(frozen, r, e),
            &t,
            None,
        )
        .into_iter()
        .collect::<Result<_, _>>()?;
        let mut reference = Mllm::new(cfg.clone());
        let batch = Dataset::new(cfg, CHECK_SEED).batch(0, program.microbatches);
        let (ref_loss, ref_grads) = reference.reference_step(&batch);
        let mut out = Vec::new();
        let mut vs_host = 0.0f64;
        let mut losses = Vec::new();
        for (a, h) in hccl.iter().zip(&host) {
            if a.grads.len() != h.grads.len() {
                return Err(format!(
                    "rank {} reports {} gradients on HCCL and {} on the host",
                    a.rank,
                    a.grads.len(),
                    h.grads.len()
                ));
            }
            for ((u, g), (_, hg)) in a.grads.iter().zip(&h.grads) {
                let unit = program
                    .units
                    .get(*u)
                    .ok_or_else(|| format!("rank {} reports unknown unit {u}", a.rank))?;
                out.push((unit.name.to_string(), rel_diff(g, &ref_grads[*u])));
                vs_host = vs_host.max(rel_diff(g, hg));
            }
            losses.extend(a.losses.iter().copied());
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        let loss = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
        out.push(("loss".into(), rel_diff(&[loss], &[ref_loss])));
        out.push(("host".into(), vs_host));
        Ok(out)
    }

    /// Where the model runs: on the device, or on the host when checkpoints are
    /// saved (the device path does not save them yet).
    fn on_device(run: &Run) -> bool {
        run.ck.checkpoint.is_none()
    }

    fn where_(run: &Run) -> &'static str {
        if on_device(run) {
            "the model on the device"
        } else {
            "the model on the host (--checkpoint)"
        }
    }

    /// Trains on HCCL (ranks as threads, one device each).
    pub(crate) fn train(run: &Run) -> Result<()> {
        println!(
            "training `{}` on {} ranks over HCCL ({}), {}, {} micro-batches per step, {} steps",
            run.expr,
            run.program.ranks,
            ascend_backend(),
            where_(run),
            run.program.microbatches,
            run.t.steps
        );
        let code = code(run.sched, run.frozen);
        let dcode = device_code(run.sched, run.frozen);
        let outcomes = run_ranks(run.program.ranks, |mut c| {
            if on_device(run) {
                train_rank_device(c, &run.program, &dcode, &run.t, None)
            } else {
                train_rank(&mut c, &run.program, &code, &run.t, &run.ck, None)
            }
        });
        let mut params = Vec::new();
        for o in outcomes {
            let o = o.map_err(|e| anyhow!(e))?;
            if !o.losses.is_empty() {
                let loss = o.losses.iter().sum::<f32>() / o.losses.len() as f32;
                println!("loss after the last step {loss:.3}");
            }
            params.extend(o.params);
        }
        params.sort_by_key(|p| p.0);
        println!("{}", checksum_line(&run.program, &params));
        Ok(())
    }

    /// One rank of `--backend ascend --processes` (started by the launcher): one
    /// process, one device, joined through `MASTER_ADDR:MASTER_PORT`.
    pub(crate) fn train_rank_process(run: &Run) -> Result<ExitCode> {
        let mut comm = AscendComm::from_env(run.t.timeout).context("joining the HCCL world")?;
        let (rank, device) = (comm.rank(), comm.device());
        let result = if on_device(run) {
            let code = device_code(run.sched, run.frozen);
            train_rank_device(comm, &run.program, &code, &run.t, None)
        } else {
            let code = code(run.sched, run.frozen);
            let r = train_rank(&mut comm, &run.program, &code, &run.t, &run.ck, None);
            if let Err(e) = &r {
                comm.abort(&e.to_string());
            }
            r
        };
        let o = match result {
            Ok(o) => o,
            Err(e) => {
                eprintln!("{e}");
                return Ok(ExitCode::from(1));
            }
        };
        if !o.losses.is_empty() {
            let loss = o.losses.iter().sum::<f32>() / o.losses.len() as f32;
            println!("loss after the last step {loss:.3}");
        }
        println!(
            "rank {rank} on device {device} ({}, {}): {}",
            ascend_backend(),
            where_(run),
            checksum_line(&run.program, &o.params)
        );
        Ok(ExitCode::SUCCESS)
    }

    fn ascend_backend() -> &'static str {
        mpipe::runtime::ascend::LINKED
    }

    /// `--counters`: per compiled schedule, the device counters of one training step
    /// after a first one (which fills the buffer pools and the arena), summed over the
    /// ranks: the step as issued, its end (the host wait, the read of the losses) and
    /// the optimizer's update queued after it.
    pub(crate) fn counters(frozen: bool) -> Result<()> {
        for sched in ALL {
            let (expr, json, chunks) = sched.compiled(frozen);
            let program = Program::from_json(json)?;
            let t = Train {
                steps: 2,
                update: true,
                ..check_train(&config(program.ranks * chunks, frozen))
            };
            let code = device_code(sched, frozen);
            // Each rank resets its own device's counters once its first step is done
            // and reads them once its second is: what they hold is its second step
            // alone (the issuing threads too), before any teardown frees a buffer.
            let second: std::sync::Mutex<Vec<Option<counters::Counters>>> =
                std::sync::Mutex::new(vec![None; program.ranks]);
            let hook = |rep: &StepReport| match rep.step {
                0 => counters::reset(rep.rank as i32),
                _ => {
                    let c = counters::snapshot(rep.rank as i32);
                    if let Ok(mut all) = second.lock() {
                        all[rep.rank] = c;
                    }
                }
            };
            let outcomes = run_ranks(program.ranks, |c| {
                train_rank_device(c, &program, &code, &t, Some(&hook))
            });
            for o in outcomes {
                o.map_err(|e| anyhow!("{expr}: {e}"))?;
            }
            let second = second
                .into_inner()
                .map_err(|_| anyhow!("a rank panicked"))?;
            let mut total = counters::Counters::default();
            for c in second {
                total += c.ok_or_else(|| {
                    anyhow!(
                        "--counters needs the ascend-sys emulator, which counts calls; this \
                         build links CANN ({}), where msprof is the profiler",
                        ascend_backend()
                    )
                })?;
            }
            println!("counters {expr}: {total}");
        }
        Ok(())
    }
}

/// `--backend ascend` without the `ascend` feature: say how to build it.
#[cfg(not(feature = "ascend"))]
mod ascend {
    use super::*;

    pub(crate) fn check(
        _: &Program,
        _: Schedule,
        _: bool,
        _: &Config,
    ) -> Result<Vec<(String, f64)>, String> {
        Err(ASCEND_HOW.into())
    }

    pub(crate) fn check_rank(_: Schedule, _: bool, _: &Path) -> Result<()> {
        bail!(ASCEND_HOW)
    }

    pub(crate) fn train(_: &Run) -> Result<()> {
        bail!(ASCEND_HOW)
    }

    pub(crate) fn train_rank_process(_: &Run) -> Result<ExitCode> {
        bail!(ASCEND_HOW)
    }

    pub(crate) fn counters(_: bool) -> Result<()> {
        bail!(ASCEND_HOW)
    }
}
