//! One device step on the emulator's virtual clock (issue 34's device-time trace), for
//! `tests/ascend_device_time.rs` and `benches/device_step.rs` (included with `#[path]`,
//! next to `toy.rs`, which the includer declares as `mod toy`).

use super::toy::{update, Toy, LEN};
use mpipe_core::program::Program;
use mpipe_core::simulate::CommModel;
use mpipe_runtime::ascend::counters::{self, Trace};
use mpipe_runtime::ascend::device::DeviceRank;
use mpipe_runtime::ascend::AscendComm;
use mpipe_runtime::comm::Comm;
use mpipe_runtime::interpret;
use std::sync::{Barrier, Mutex};

/// The emulator's clock and devices are process-wide: one measurement at a time.
static DEVICES: Mutex<()> = Mutex::new(());

/// One step of `prog` (the toy model, ranks as threads) after a warm-up step, on the
/// virtual clock with transfers costed by `link`: the trace and each rank's device id.
pub(crate) fn measure(prog: &Program, link: Option<CommModel>) -> (Trace, Vec<i32>) {
    let m = measure_with(prog, link, None);
    (m.trace, m.devices)
}

/// What [`measure_with`] found.
pub(crate) struct Measured {
    pub trace: Trace,
    /// Each rank's device id.
    pub devices: Vec<i32>,
    /// The event waits each rank's measured step issued (or would have).
    pub waits: Vec<u64>,
}

/// [`measure`], where with `skip = Some((rank, k))` that rank's measured step leaves out
/// its `k`-th event wait (the mutation of `AscendComm::mutate_skip_event_wait`).
pub(crate) fn measure_with(
    prog: &Program,
    link: Option<CommModel>,
    skip: Option<(usize, u64)>,
) -> Measured {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let ranks = prog.ranks;
    let comms = AscendComm::world_in_process(ranks).expect("world");
    let idle = Barrier::new(ranks);
    let done = Barrier::new(ranks);
    let trace = Mutex::new(None);
    let (devices, waits) = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (idle, done, trace) = (&idle, &done, &trace);
                s.spawn(move || -> Result<(usize, i32, u64), String> {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let mut dev = DeviceRank::new(comm, prog, &lens).map_err(|e| e.to_string())?;
                    dev.set_comm_model(link);
                    let mut model = Toy::new(prog, dev.kernels()).map_err(|e| e.to_string())?;
                    // The first step (set-up, not timed), the optimizer, and a host wait:
                    // every stream is idle when the clock starts.
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    step.finish().map_err(|e| e.to_string())?;
                    update(&mut dev, &model).map_err(|e| e.to_string())?;
                    dev.kernels().synchronize().map_err(|e| e.to_string())?;
                    let before = dev.comm().event_waits();
                    if let Some((_, k)) = skip.filter(|s| s.0 == r) {
                        dev.comm().mutate_skip_event_wait(before + k);
                    }
                    idle.wait();
                    if r == 0 {
                        counters::clock_start();
                    }
                    idle.wait();
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    step.finish().map_err(|e| e.to_string())?;
                    // The step's end waited for everything it queued on every stream.
                    done.wait();
                    if r == 0 {
                        *trace.lock().unwrap_or_else(|e| e.into_inner()) = counters::clock_trace();
                        counters::clock_stop();
                    }
                    done.wait();
                    let waits = dev.comm().event_waits() - before;
                    Ok((r, dev.comm().device(), waits))
                })
            })
            .collect();
        let mut devices = vec![-1; ranks];
        let mut waits = vec![0; ranks];
        for h in handles {
            let (r, d, w) = h
                .join()
                .expect("rank thread")
                .unwrap_or_else(|e| panic!("{e}"));
            devices[r] = d;
            waits[r] = w;
        }
        (devices, waits)
    });
    let trace = trace
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .expect("the emulator keeps a trace");
    Measured {
        trace,
        devices,
        waits,
    }
}
