//! Training the model through a compiled pipeline schedule.
//!
//! Each rank runs in its own thread with its own [`Mllm`] (a full copy of the
//! parameters, of which it uses its units) and the host backend's thread
//! communicator. One step: set the micro-batches, clear gradients, run the rank's
//! generated code on an [`Executor`], then update the units whose home is this rank.
//! Parameters of a unit computed away from home reach the other ranks by the
//! program's `BCAST`, their gradients come back by its `REDUCE`.

use crate::{Adam, AdamConfig, Config, Dataset, Mllm};
use mpipe_core::program::Program;
use mpipe_runtime::exec::{ExecError, Executor};
use mpipe_runtime::host::threads::{run_ranks, ThreadComm};
use mpipe_runtime::model::Model;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

/// The generated `run(rank, step)` of a compiled schedule, for this executor.
pub trait RunRank: Sync {
    fn run(&self, rank: usize, exec: &mut Executor<'_, ThreadComm, Mllm>) -> Result<(), ExecError>;
}

impl<F> RunRank for F
where
    F: Fn(usize, &mut Executor<'_, ThreadComm, Mllm>) -> Result<(), ExecError> + Sync,
{
    fn run(&self, rank: usize, exec: &mut Executor<'_, ThreadComm, Mllm>) -> Result<(), ExecError> {
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
    /// Parameters of the units whose home is this rank (after the last step).
    pub params: Vec<(usize, Vec<f32>)>,
    /// Per-micro-batch losses of the last step computed here.
    pub losses: Vec<f32>,
    /// Each step's peak activation memory.
    pub peaks: Vec<f64>,
    /// The last step's per-action wall-clock intervals (seconds).
    pub slots: Vec<mpipe_core::timeline::Slot>,
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
    let mbs = program.microbatches;
    let last = program.units.len().saturating_sub(1);
    run_ranks(
        program.ranks,
        t.timeout,
        |mut comm: ThreadComm| -> Result<RankOutcome, ExecError> {
            let rank = mpipe_runtime::comm::Comm::rank(&comm);
            let data = Dataset::new(&t.cfg, t.data_seed);
            let mut model = Mllm::new(t.cfg.clone());
            let mut adam = Adam::new(t.adam);
            let home: Vec<usize> = (0..program.units.len())
                .filter(|&u| program.units[u].home == rank && program.units[u].trainable)
                .collect();
            let computes_loss = program.programs[rank]
                .iter()
                .any(|a| a.unit() == program.units[last].name);
            let mut outcome = RankOutcome {
                rank,
                grads: vec![],
                params: vec![],
                losses: vec![],
                peaks: vec![],
                slots: vec![],
            };
            for step in 0..t.steps {
                let began = Instant::now();
                model.set_batch(&data.batch(step, mbs));
                model.zero_grads();
                let mut exec = Executor::new(program, &mut comm, &mut model);
                run.run(rank, &mut exec)?;
                let peak = exec.peak_memory();
                outcome.slots = exec.slots().to_vec();
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
                let loss = (!outcome.losses.is_empty())
                    .then(|| outcome.losses.iter().sum::<f32>() / outcome.losses.len() as f32);
                if let Some(tx) = &progress {
                    let _ = tx.send(StepReport {
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
        },
    )
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
