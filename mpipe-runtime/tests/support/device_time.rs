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
pub fn measure(prog: &Program, link: Option<CommModel>) -> (Trace, Vec<i32>) {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let ranks = prog.ranks;
    let comms = AscendComm::world_in_process(ranks).expect("world");
    let idle = Barrier::new(ranks);
    let done = Barrier::new(ranks);
    let trace = Mutex::new(None);
    let devices: Vec<i32> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (idle, done, trace) = (&idle, &done, &trace);
                s.spawn(move || -> Result<(usize, i32), String> {
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
                    Ok((r, dev.comm().device()))
                })
            })
            .collect();
        let mut devices = vec![-1; ranks];
        for h in handles {
            let (r, d) = h
                .join()
                .expect("rank thread")
                .unwrap_or_else(|e| panic!("{e}"));
            devices[r] = d;
        }
        devices
    });
    let trace = trace
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .expect("the emulator keeps a trace");
    (trace, devices)
}
