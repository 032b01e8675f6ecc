//! Training on Ascend NPUs (or the emulator) with the model on the device:
//! [`train_rank_device`] is [`super::train_rank`]'s loop with a
//! [`DeviceRank`] (kernels, arena, streams and events), the [`DeviceMllm`] and the
//! [`DeviceAdam`] in place of the host executor, model and optimizer.
//!
//! One step: set the micro-batches (host data, uploaded by the units that read them),
//! queue the zeroing of the gradients, issue the rank's generated code on a
//! [`mpipe_runtime::ascend::device::DeviceStep`], [`finish`](mpipe_runtime::ascend::device::DeviceStep::finish)
//! it (the one host wait, then the one read of the losses, on the rank that computes
//! them), then queue the optimizer's update of the rank's home units (no host wait:
//! the next step's work is ordered after it on the compute stream and by events).
//! Parameters and gradients are read back only at the end of the run (for the
//! outcome), or when a checkpoint is saved.

use super::{RankOutcome, StepReport, Train, TrainError};
use crate::device::DeviceMllm;
use crate::optim::device::DeviceAdam;
use crate::{Dataset, Mllm};
use mpipe_core::program::Program;
use mpipe_runtime::ascend::device::{DeviceRank, DeviceStep};
use mpipe_runtime::ascend::{AscendComm, AscendError};
use mpipe_runtime::comm::Comm;
use mpipe_runtime::exec::ExecError;
use std::time::Instant;

/// The generated `run(rank, step)` of a compiled schedule, driving a device step.
pub trait RunDevice: Sync {
    fn run(&self, rank: usize, step: &mut DeviceStep<'_, DeviceMllm>) -> Result<(), ExecError>;
}

impl<F> RunDevice for F
where
    F: Fn(usize, &mut DeviceStep<'_, DeviceMllm>) -> Result<(), ExecError> + Sync,
{
    fn run(&self, rank: usize, step: &mut DeviceStep<'_, DeviceMllm>) -> Result<(), ExecError> {
        self(rank, step)
    }
}

fn device_err(rank: usize, what: &str) -> impl FnOnce(AscendError) -> TrainError + '_ {
    move |e| TrainError::Comm {
        rank,
        what: what.to_string(),
        error: Box::new(e),
    }
}

/// One rank's training run on its device over `comm` (ranks as threads from
/// [`mpipe_runtime::ascend::run_ranks`], or one process per device from
/// `AscendComm::from_env`): `t.steps` steps of `program` (whose generated code is
/// `run`), calling `progress` after each step's optimizer is queued. Checkpoints are
/// not saved or resumed on this path (yet): the host path ([`super::train_rank`])
/// does that.
///
/// Every rank of the world calls it together.
pub fn train_rank_device(
    comm: AscendComm,
    program: &Program,
    run: &dyn RunDevice,
    t: &Train,
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
    let data = Dataset::new(&t.cfg, t.data_seed);
    // The host model gives the initial parameters (the same on every rank and on the
    // host backend) and the units' output lengths.
    let host = Mllm::new(t.cfg.clone());
    let n = host.units();
    if n != program.units.len() {
        return Err(TrainError::Setup(format!(
            "rank {rank}: the model has {n} units, the program {}",
            program.units.len()
        )));
    }
    let out_len: Vec<usize> = (0..n).map(|u| host.output_len_of(u)).collect();
    let mut dev = DeviceRank::new(comm, program, &out_len)
        .map_err(device_err(rank, "setting up the device"))?;
    // A failure on this rank is recorded, so ranks sharing the world fail their later
    // calls at once instead of waiting for this one.
    let result = (|| -> Result<RankOutcome, TrainError> {
        let params: Vec<&[f32]> = (0..n).map(|u| host.unit_params(u)).collect();
        let mut model = DeviceMllm::new(dev.kernels(), &t.cfg, &params)
            .map_err(device_err(rank, "putting the model on the device"))?;
        drop(params);
        drop(host);
        let mut adam = DeviceAdam::new(t.adam);
        let home: Vec<usize> = (0..n)
            .filter(|&u| program.units[u].home == rank && program.units[u].trainable)
            .collect();
        let mut outcome = RankOutcome {
            rank,
            grads: vec![],
            params: vec![],
            losses: vec![],
            peaks: vec![],
            slots: vec![],
            origin_ns: 0,
            first_step: 0,
            checkpoints: vec![],
        };
        for step in 0..t.steps {
            let began = Instant::now();
            model
                .set_batch(&data.batch(step, mbs))
                .map_err(device_err(rank, "setting the step's batch"))?;
            model
                .zero_grads(dev.kernels())
                .map_err(device_err(rank, "zeroing the gradients"))?;
            let origin = super::now_ns();
            let mut s = dev.step(program, &mut model);
            run.run(rank, &mut s)?;
            let report = s.finish()?;
            outcome.peaks.push(report.peak_memory);
            outcome.slots = report.slots;
            outcome.origin_ns = origin;
            outcome.losses = report.losses;
            if t.update {
                let units: Vec<_> = home
                    .iter()
                    .map(|&u| (u, model.params(u), model.grads(u)))
                    .collect();
                adam.step(dev.kernels(), &units, 1.0 / mbs as f32)
                    .map_err(device_err(rank, "the optimizer's update"))?;
            }
            let loss = (!outcome.losses.is_empty())
                .then(|| outcome.losses.iter().sum::<f32>() / outcome.losses.len() as f32);
            if let Some(report) = progress {
                report(&StepReport {
                    step,
                    rank,
                    loss,
                    peak_memory: outcome.peaks.last().copied().unwrap_or(0.0),
                    seconds: began.elapsed().as_secs_f64(),
                });
            }
        }
        // The end of the run: the home units' gradients (of the last step) and
        // parameters (after its update), read back.
        let k = dev.kernels();
        let read = |k: &mut mpipe_runtime::ascend::kernels::Kernels, t| {
            k.download_f32(&t)
                .map_err(device_err(rank, "reading the results back"))
        };
        for &u in &home {
            let g = read(k, model.grads(u))?;
            outcome.grads.push((u, g));
        }
        for &u in &home {
            let p = read(k, model.params(u))?;
            outcome.params.push((u, p));
        }
        Ok(outcome)
    })();
    if let Err(e) = &result {
        dev.abort(&e.to_string());
    }
    result
}
