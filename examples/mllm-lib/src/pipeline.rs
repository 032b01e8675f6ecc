//! Training the model through a compiled pipeline schedule.
//!
//! [`train_rank`] is one rank's training loop over any [`Comm`]: each rank has its
//! own [`Mllm`] (a full copy of the parameters, of which it uses its units). One
//! step: set the micro-batches, clear gradients, run the rank's generated code on an
//! [`Executor`], then update the units whose home is this rank. Parameters of a unit
//! computed away from home reach the other ranks by the program's `BCAST`, their
//! gradients come back by its `REDUCE`.
//!
//! The same loop runs with ranks as threads ([`train`], [`train_with`]: the host
//! thread communicator), as threads over loopback TCP (`host::tcp::run_ranks`), or
//! as separate processes (`examples/mllm.rs --processes`: each process calls
//! [`train_rank`] with `host::tcp::from_env`).
//!
//! **Checkpoints** ([`Checkpointing`]): every `n` steps each rank saves its home
//! units' parameters and Adam state, the step and the data position with
//! [`mpipe_runtime::checkpoint::save_set`]; a resumed run loads them and continues
//! with the next step's batch (the data stream is a pure function of the seed and
//! the step, so the position is the step). Copies of a unit on other ranks need no
//! saving: the program broadcasts a unit's parameters from its home before any
//! other rank computes with them, every step. A run resumed this way ends with
//! parameters bitwise equal to an uninterrupted run's (`tests/mllm_checkpoint.rs`).
//!
//! **Traces** of real runs: each rank's last step, as its [`Executor`] timed it
//! (seconds since the executor started, whose wall-clock time is
//! [`RankOutcome::origin_ns`]). [`real_timeline`] puts every rank on one clock,
//! [`gather_timeline`] collects the ranks' parts on rank 0 over the communicator (for
//! ranks in separate processes), and [`real_trace`] renders a Chrome/Perfetto trace
//! to compare with [`simulated_trace`].

use crate::{Adam, AdamConfig, Config, Dataset, Mllm};
use mpipe_core::program::Program;
use mpipe_core::render::trace::{chrome_trace, TraceOptions};
use mpipe_core::simulate::{simulate, SimOptions};
use mpipe_core::timeline::{Slot, Timeline};
use mpipe_runtime::checkpoint::{
    self, CheckpointError, OptimState, Problem, RankState, SaveError, UnitState,
};
use mpipe_runtime::comm::{Comm, Tag};
use mpipe_runtime::exec::{ExecError, Executor};
use mpipe_runtime::host::threads::{run_ranks, ThreadComm};
use mpipe_runtime::host::{HostComm, Mode};
use mpipe_runtime::model::Model;
use std::fmt;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[cfg(feature = "ascend")]
pub mod device;

/// The generated `run(rank, step)` of a compiled schedule, for an executor over
/// communicator `C` (by default the host thread communicator).
pub trait RunRank<C: Comm = ThreadComm>: Sync {
    fn run(&self, rank: usize, exec: &mut Executor<'_, C, Mllm>) -> Result<(), ExecError>;
}

impl<C, F> RunRank<C> for F
where
    C: Comm,
    F: Fn(usize, &mut Executor<'_, C, Mllm>) -> Result<(), ExecError> + Sync,
{
    fn run(&self, rank: usize, exec: &mut Executor<'_, C, Mllm>) -> Result<(), ExecError> {
        self(rank, exec)
    }
}

/// What a rank reports after each step.
#[derive(Clone, Debug)]
pub struct StepReport {
    pub step: u64,
    pub rank: usize,
    /// Mean loss over the step's micro-batches (on the rank that computes it).
    pub loss: Option<f32>,
    /// Peak live activation memory of the step (program-format units).
    pub peak_memory: f64,
    pub seconds: f64,
}

/// The outcome of one rank's run.
#[derive(Clone, Debug)]
pub struct RankOutcome {
    pub rank: usize,
    /// Accumulated gradients of the units whose home is this rank (last step).
    pub grads: Vec<(usize, Vec<f32>)>,
    /// Parameters of the trainable units whose home is this rank (after the last
    /// step).
    pub params: Vec<(usize, Vec<f32>)>,
    /// Per-micro-batch losses of the last step computed here.
    pub losses: Vec<f32>,
    /// Each step's peak activation memory (the steps this run executed).
    pub peaks: Vec<f64>,
    /// The last step's per-action wall-clock intervals (seconds from
    /// [`origin_ns`](RankOutcome::origin_ns)).
    pub slots: Vec<Slot>,
    /// When the last step's executor started, in nanoseconds since the Unix epoch
    /// (the origin of `slots`; within microseconds of it). Comparable across the
    /// processes of one machine.
    pub origin_ns: u64,
    /// The first step this run executed (0, or the step a checkpoint resumed at).
    pub first_step: u64,
    /// The checkpoint files this rank wrote.
    pub checkpoints: Vec<PathBuf>,
}

/// Training options.
#[derive(Clone, Debug)]
pub struct Train {
    pub cfg: Config,
    pub adam: AdamConfig,
    pub data_seed: u64,
    pub steps: u64,
    /// Skip the optimizer (a gradient check wants the raw gradients).
    pub update: bool,
    pub timeout: Duration,
    /// Point-to-point semantics of the ranks' transfers: rendezvous, or eager
    /// (sends complete into the receiver's buffer, as a program derived with
    /// `--mode eager` is timed).
    pub mode: Mode,
}

/// Saving and resuming ([`train_with`], [`train_rank`]).
#[derive(Clone, Debug, Default)]
pub struct Checkpointing {
    /// Save a checkpoint set into this directory after every `n`-th step (steps
    /// `n`, `2n`, ..; `n = 0` never saves). See [`mpipe_runtime::checkpoint`] for the
    /// layout.
    pub checkpoint: Option<(PathBuf, u64)>,
    /// Resume from the last complete set in this directory: continue with the step
    /// after the saved one, up to [`Train::steps`].
    pub resume: Option<PathBuf>,
}

/// Why a rank's training stopped.
#[derive(Debug)]
pub enum TrainError {
    /// A step failed (the error names the rank, the action, and a failed peer).
    Exec(ExecError),
    /// Loading or saving a checkpoint failed (the error names the file).
    Checkpoint { rank: usize, error: CheckpointError },
    /// Communication outside a step failed (a checkpoint barrier, a trace gather).
    Comm {
        rank: usize,
        what: String,
        error: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The run is set up inconsistently (world size, model and program).
    Setup(String),
}

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainError::Exec(e) => write!(f, "{e}"),
            TrainError::Checkpoint { rank, error } => write!(f, "rank {rank}: {error}"),
            TrainError::Comm { rank, what, error } => write!(f, "rank {rank}, {what}: {error}"),
            TrainError::Setup(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for TrainError {}

impl From<ExecError> for TrainError {
    fn from(e: ExecError) -> TrainError {
        TrainError::Exec(e)
    }
}

/// What identifies a run for its checkpoints: the program, the model and optimizer
/// settings, the data seed and whether the optimizer runs. A checkpoint resumes only
/// into a run with the same fingerprint.
pub fn run_fingerprint(program: &Program, t: &Train) -> u64 {
    let json = program.to_json();
    let cfg = format!("{:?}", t.cfg);
    let adam = format!("{:?}", t.adam);
    checkpoint::fingerprint([
        json.as_bytes(),
        cfg.as_bytes(),
        adam.as_bytes(),
        &t.data_seed.to_le_bytes(),
        &[u8::from(t.update)],
    ])
}

/// The rank's training state after `step` completed steps.
fn snapshot(
    rank: usize,
    program: &Program,
    step: u64,
    fingerprint: u64,
    owned: &[usize],
    model: &Mllm,
    adam: &Adam,
) -> RankState {
    RankState {
        rank,
        world: program.ranks,
        step,
        data_position: step,
        fingerprint,
        units: owned
            .iter()
            .map(|&u| UnitState {
                unit: u as u32,
                name: program.units[u].name.clone(),
                params: model.params(u as u32).to_vec(),
                optim: adam.unit_state(u).map(|(t, m, v)| OptimState {
                    step: t,
                    tensors: vec![("m".into(), m.to_vec()), ("v".into(), v.to_vec())],
                }),
            })
            .collect(),
    }
}

/// Puts a loaded state into the model and the optimizer, checking that it holds
/// exactly this rank's home units, with the model's sizes.
fn restore(
    st: RankState,
    path: PathBuf,
    program: &Program,
    owned: &[usize],
    model: &mut Mllm,
    adam: &mut Adam,
) -> Result<u64, CheckpointError> {
    let bad = |what: String| Err(CheckpointError::new(path.clone(), Problem::Mismatch(what)));
    let mut saved: Vec<usize> = st.units.iter().map(|u| u.unit as usize).collect();
    saved.sort_unstable();
    if saved != owned {
        return bad(format!(
            "it holds units {saved:?}, but rank {} is home to units {owned:?}",
            st.rank
        ));
    }
    if st.data_position != st.step {
        return bad(format!(
            "data position {} after step {}: this run reads one batch per step",
            st.data_position, st.step
        ));
    }
    for u in st.units {
        let id = u.unit as usize;
        let want = &program.units[id].name;
        if &u.name != want {
            return bad(format!("unit {id} is `{}` in it, `{want}` here", u.name));
        }
        let p = model.params_mut(u.unit);
        if p.len() != u.params.len() {
            return bad(format!(
                "unit `{want}` has {} parameters in it, {} in this model",
                u.params.len(),
                p.len()
            ));
        }
        p.copy_from_slice(&u.params);
        if let Some(o) = u.optim {
            let get = |name: &str| {
                o.tensors
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, t)| t.clone())
            };
            match (get("m"), get("v")) {
                (Some(m), Some(v)) if m.len() == u.params.len() && v.len() == u.params.len() => {
                    adam.set_unit_state(id, o.step, m, v)
                }
                _ => {
                    return bad(format!(
                    "unit `{want}`'s optimizer state is not Adam's `m` and `v` of {} values each",
                    u.params.len()
                ))
                }
            }
        }
    }
    Ok(st.step)
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One rank's training run over `comm` (any communicator: threads, TCP in threads,
/// a process of a multi-process run): `t.steps` steps of `program` (whose generated
/// code is `run`), resuming and saving checkpoints as `ck` says, calling `progress`
/// after every step.
///
/// Every rank of the world calls it together. On an error the caller should abort
/// the communicator (the host runners do) so the other ranks stop promptly.
pub fn train_rank<C: Comm>(
    comm: &mut C,
    program: &Program,
    run: &dyn RunRank<C>,
    t: &Train,
    ck: &Checkpointing,
    progress: Option<&(dyn Fn(&StepReport) + Sync)>,
) -> Result<RankOutcome, TrainError> {
    let rank = comm.rank();
    if comm.world() != program.ranks {
        return Err(TrainError::Setup(format!(
            "rank {rank}: the world has {} ranks, the program {}",
            comm.world(),
            program.ranks
        )));
    }
    let mbs = program.microbatches;
    let last = program.units.len().saturating_sub(1);
    let data = Dataset::new(&t.cfg, t.data_seed);
    let mut model = Mllm::new(t.cfg.clone());
    if model.units() != program.units.len() {
        return Err(TrainError::Setup(format!(
            "rank {rank}: the model has {} units, the program {}",
            model.units(),
            program.units.len()
        )));
    }
    let mut adam = Adam::new(t.adam);
    let owned: Vec<usize> = (0..program.units.len())
        .filter(|&u| program.units[u].home == rank)
        .collect();
    let home: Vec<usize> = owned
        .iter()
        .copied()
        .filter(|&u| program.units[u].trainable)
        .collect();
    let computes_loss = program.programs[rank]
        .iter()
        .any(|a| a.unit() == program.units[last].name);
    let fingerprint = run_fingerprint(program, t);
    let ck_err = |error| TrainError::Checkpoint { rank, error };
    let mut first = 0;
    if let Some(dir) = &ck.resume {
        let st = checkpoint::load_set(dir, rank, program.ranks, fingerprint).map_err(ck_err)?;
        let path = checkpoint::step_dir(dir, st.step).join(checkpoint::rank_file_name(rank));
        first = restore(st, path, program, &owned, &mut model, &mut adam).map_err(ck_err)?;
    }
    let mut outcome = RankOutcome {
        rank,
        grads: vec![],
        params: vec![],
        losses: vec![],
        peaks: vec![],
        slots: vec![],
        origin_ns: 0,
        first_step: first,
        checkpoints: vec![],
    };
    for step in first..t.steps {
        let began = Instant::now();
        model.set_batch(&data.batch(step, mbs));
        model.zero_grads();
        let mut exec = Executor::new(program, comm, &mut model);
        let origin = now_ns();
        run.run(rank, &mut exec)?;
        let peak = exec.peak_memory();
        outcome.slots = exec.slots().to_vec();
        outcome.origin_ns = origin;
        drop(exec);
        outcome.peaks.push(peak);
        if t.update {
            for &u in &home {
                let grads = model.grads(u as u32).to_vec();
                adam.step_unit(u, model.params_mut(u as u32), &grads, 1.0 / mbs as f32);
            }
        }
        outcome.losses = if computes_loss {
            (0..mbs).filter_map(|m| model.loss(m)).collect()
        } else {
            vec![]
        };
        if let Some((dir, every)) = &ck.checkpoint {
            if (step + 1).checked_rem(*every) == Some(0) {
                let st = snapshot(rank, program, step + 1, fingerprint, &owned, &model, &adam);
                match checkpoint::save_set(dir, comm, &st) {
                    Ok(p) => outcome.checkpoints.push(p),
                    Err(SaveError::File(e)) => return Err(ck_err(e)),
                    Err(SaveError::Comm { step, source }) => {
                        return Err(TrainError::Comm {
                            rank,
                            what: format!("saving the checkpoint of step {step}"),
                            error: Box::new(source),
                        })
                    }
                }
            }
        }
        let loss = (!outcome.losses.is_empty())
            .then(|| outcome.losses.iter().sum::<f32>() / outcome.losses.len() as f32);
        if let Some(report) = progress {
            report(&StepReport {
                step,
                rank,
                loss,
                peak_memory: peak,
                seconds: began.elapsed().as_secs_f64(),
            });
        }
    }
    outcome.grads = home
        .iter()
        .map(|&u| (u, model.grads(u as u32).to_vec()))
        .collect();
    outcome.params = home
        .iter()
        .map(|&u| (u, model.params(u as u32).to_vec()))
        .collect();
    Ok(outcome)
}

/// Train `program` (whose generated code is `run`) for `t.steps` steps on one thread
/// per rank. Each rank's outcome, in rank order; a failing rank stops the others
/// promptly and every rank's error names the failing rank and action.
pub fn train(
    program: &Program,
    run: &dyn RunRank,
    t: &Train,
    progress: Option<Sender<StepReport>>,
) -> Vec<Result<RankOutcome, String>> {
    train_with(program, run, t, &Checkpointing::default(), progress)
}

/// [`train`] with checkpoints: saving every so many steps, or resuming.
pub fn train_with(
    program: &Program,
    run: &dyn RunRank,
    t: &Train,
    ck: &Checkpointing,
    progress: Option<Sender<StepReport>>,
) -> Vec<Result<RankOutcome, String>> {
    let report = progress.map(|tx| {
        move |r: &StepReport| {
            let _ = tx.send(r.clone());
        }
    });
    let report = report.as_ref().map(|f| f as &(dyn Fn(&StepReport) + Sync));
    run_ranks(program.ranks, t.timeout, |mut comm: ThreadComm| {
        comm.set_mode(t.mode);
        train_rank(&mut comm, program, run, t, ck, report)
    })
}

/// Largest relative difference of `a` from the reference `b`: `max |a - b| / max |b|`.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = b
        .iter()
        .map(|x| x.abs() as f64)
        .fold(0.0, f64::max)
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
        / scale
}

/// One step through the pipeline against the unpipelined reference step:
/// `(unit name, relative difference of its gradient)` for every trainable unit,
/// then `("loss", relative difference of the loss)`.
pub fn check(
    program: &Program,
    run: &dyn RunRank,
    cfg: &Config,
    data_seed: u64,
) -> Result<Vec<(String, f64)>, String> {
    let t = Train {
        cfg: cfg.clone(),
        adam: AdamConfig::default(),
        data_seed,
        steps: 1,
        update: false,
        timeout: Duration::from_secs(10),
        mode: Mode::Rendezvous,
    };
    let outcomes = train(program, run, &t, None);
    let mut reference = Mllm::new(cfg.clone());
    let data = Dataset::new(cfg, data_seed);
    let (ref_loss, ref_grads) = reference.reference_step(&data.batch(0, program.microbatches));
    let mut out = Vec::new();
    let mut losses = Vec::new();
    for o in outcomes {
        let o = o?;
        for (u, g) in &o.grads {
            out.push((program.units[*u].name.clone(), rel_diff(g, &ref_grads[*u])));
        }
        losses.extend(o.losses);
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    let loss = losses.iter().sum::<f32>() / losses.len().max(1) as f32;
    out.push(("loss".into(), rel_diff(&[loss], &[ref_loss])));
    Ok(out)
}

// ---------------------------------------------------------------------------
// Traces.

/// Every rank's last step on one clock: rank `r`'s part is `(origin_ns, slots)`
/// (see [`RankOutcome`]); times become seconds from the earliest origin.
pub fn real_timeline(parts: &[(u64, Vec<Slot>)]) -> Timeline {
    let t0 = parts.iter().map(|p| p.0).min().unwrap_or(0);
    Timeline {
        ranks: parts
            .iter()
            .map(|(origin, slots)| {
                let shift = (origin - t0) as f64 * 1e-9;
                slots
                    .iter()
                    .map(|s| Slot {
                        start: s.start + shift,
                        end: s.end + shift,
                    })
                    .collect()
            })
            .collect(),
    }
}

/// [`real_timeline`] of the outcomes of a run (in rank order).
pub fn outcomes_timeline(outcomes: &[RankOutcome]) -> Timeline {
    let parts: Vec<(u64, Vec<Slot>)> = outcomes
        .iter()
        .map(|o| (o.origin_ns, o.slots.clone()))
        .collect();
    real_timeline(&parts)
}

/// A Chrome/Perfetto trace of a real step (`timeline` in seconds; one track per
/// rank, one event per action in program order, flows from sends to receives), with
/// the program embedded, so that `mpipe calibrate TRACE` measures it.
pub fn real_trace(program: &Program, timeline: &Timeline, name: &str) -> String {
    chrome_trace(
        program,
        timeline,
        &TraceOptions {
            name: Some(name.to_string()),
            time_scale: 1e6,
            embed_program: true,
            ..TraceOptions::default()
        },
    )
}

/// A Chrome/Perfetto trace of the simulator's step of `program` (rendezvous, free
/// communication; one profile time unit shown as 1 ms).
pub fn simulated_trace(program: &Program, name: &str) -> Result<String, String> {
    let r = simulate(program, &SimOptions::default()).map_err(|e| e.to_string())?;
    Ok(chrome_trace(
        program,
        &r.timeline,
        &TraceOptions {
            name: Some(name.to_string()),
            ..TraceOptions::default()
        },
    ))
}

/// The tag of [`gather_timeline`]'s messages (a kind the runtime does not use).
const TRACE_TAG: Tag = Tag::new(0x10, 0, 0);

/// `u64`s as exactly representable `f32`s (four 16-bit pieces each), so they cross
/// any `f32` transport unchanged.
fn pack_u64s(xs: impl IntoIterator<Item = u64>) -> Vec<f32> {
    xs.into_iter()
        .flat_map(|x| (0..4).map(move |i| ((x >> (16 * i)) & 0xffff) as f32))
        .collect()
}

fn unpack_u64s(v: &[f32]) -> Vec<u64> {
    v.chunks_exact(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |acc, (i, &x)| acc | ((x as u64 & 0xffff) << (16 * i)))
        })
        .collect()
}

/// Collects every rank's last-step part (origin and slots, see [`RankOutcome`]) on
/// rank 0 over `comm` and returns the run's [`real_timeline`] there (`None` on the
/// other ranks). Collective: every rank calls it after training. The slots cross
/// the wire exactly (as the bits of their `f64`s).
pub fn gather_timeline<C: Comm>(
    comm: &mut C,
    outcome: &RankOutcome,
) -> Result<Option<Timeline>, TrainError> {
    let rank = comm.rank();
    let mine = pack_u64s(
        std::iter::once(outcome.origin_ns).chain(
            outcome
                .slots
                .iter()
                .flat_map(|s| [s.start.to_bits(), s.end.to_bits()]),
        ),
    );
    let err = |e: C::Error| TrainError::Comm {
        rank,
        what: "gathering the trace on rank 0".into(),
        error: Box::new(e),
    };
    // Message sizes are static on the wire (HCCL needs every receive's count), and a
    // rank's part varies with its action count: its length goes first, in a message
    // of fixed size, as systems that exchange variable-length tensors do.
    let len_msg = |n: usize| pack_u64s([n as u64]);
    if rank != 0 {
        comm.send(0, TRACE_TAG, &len_msg(mine.len())).map_err(err)?;
        comm.send(0, TRACE_TAG, &mine).map_err(err)?;
        return Ok(None);
    }
    let fixed = len_msg(0).len();
    let others: Vec<(usize, Tag, usize)> =
        (1..comm.world()).map(|r| (r, TRACE_TAG, fixed)).collect();
    let lens = comm.batch(&[], &others).map_err(err)?;
    let others: Vec<(usize, Tag, usize)> = (1..comm.world())
        .zip(&lens)
        .map(|(r, l)| {
            let n = unpack_u64s(l).first().copied().unwrap_or(0);
            (r, TRACE_TAG, n as usize)
        })
        .collect();
    let got = comm.batch(&[], &others).map_err(err)?;
    let parts: Vec<(u64, Vec<Slot>)> = std::iter::once(&mine)
        .chain(&got)
        .map(|m| {
            let w = unpack_u64s(m);
            let origin = w.first().copied().unwrap_or(0);
            let slots = w
                .get(1..)
                .unwrap_or(&[])
                .chunks_exact(2)
                .map(|p| Slot {
                    start: f64::from_bits(p[0]),
                    end: f64::from_bits(p[1]),
                })
                .collect();
            (origin, slots)
        })
        .collect();
    Ok(Some(real_timeline(&parts)))
}

/// A checksum of each unit's parameters (FNV-1a over their bits), to compare runs
/// bit for bit: `(unit, checksum)` for every `(unit, params)` given.
pub fn param_checksums(params: &[(usize, Vec<f32>)]) -> Vec<(usize, u64)> {
    params
        .iter()
        .map(|(u, p)| {
            let bytes: Vec<u8> = p.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
            (*u, checkpoint::fnv1a(checkpoint::FNV_OFFSET, &bytes))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u64s_survive_f32() {
        let xs = [0, 1, u64::MAX, 0x8000_0000_0000_0001, f64::NAN.to_bits()];
        assert_eq!(unpack_u64s(&pack_u64s(xs)), xs);
    }

    #[test]
    fn timelines_share_a_clock() {
        let s = |a: f64, b: f64| Slot { start: a, end: b };
        let t = real_timeline(&[
            (2_000_000_000, vec![s(0.0, 1.0)]),
            (1_000_000_000, vec![s(0.5, 0.75)]),
        ]);
        assert_eq!(t.ranks[0], vec![s(1.0, 2.0)]);
        assert_eq!(t.ranks[1], vec![s(0.5, 0.75)]);
    }
}
