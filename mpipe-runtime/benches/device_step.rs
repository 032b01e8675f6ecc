//! Host time of a device-resident step on the emulator (issue 34's benchmark): how
//! long the host spends *issuing* one training step (every kernel, batch and
//! collective queued, nothing waited for), against the whole step (issue, then the one
//! host wait at its end, the device work included).
//!
//! Run: `cargo bench -p mpipe-runtime --features ascend --bench device_step`.
//! 4 ranks as threads, 8 micro-batches, the small model of `tests/support/toy.rs`;
//! the figure is rank 0's. The emulator runs kernels on CPU threads, so the whole
//! step's time is the emulator's, not an NPU's; the issuing time is what the runtime
//! itself costs the host per step, and it is the same code on CANN.
//!
//! It also prints, per schedule, the step's device time on the emulator's virtual clock
//! (the program's costs charged as the step issues them, transfers under the profile's
//! link; see `tests/ascend_device_time.rs`) against the simulator's eager and
//! rendezvous makespans of the same program, and the ratio device / eager:
//! `device time <expr>: device D, simulator eager E, rendezvous R, device/eager X`.

#[path = "../tests/support/device_time.rs"]
#[allow(dead_code)]
mod device_time;
#[path = "../tests/support/toy.rs"]
#[allow(dead_code)]
mod toy;

use criterion::{criterion_group, criterion_main, Criterion};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::Program;
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use mpipe_runtime::ascend::device::DeviceRank;
use mpipe_runtime::ascend::AscendComm;
use mpipe_runtime::comm::Comm;
use mpipe_runtime::interpret;
use std::sync::Barrier;
use std::time::{Duration, Instant};
use toy::{update, Toy, LEN};

const RANKS: usize = 4;

const PROFILE: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 2.0\nbackward = 2.0\n\
weight = 1.0\nactivation = 0.5\nparams = 0.5\ntrainable = true\n\
[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\n";

/// The profile with message sizes and a link (for the device-time figures).
const LINKED: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 2.0\nbackward = 2.0\n\
weight = 1.0\nactivation = 0.5\nparams = 0.5\ntrainable = true\noutput = 0.6\n\
[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\n\
output = 0.8\n[link]\nlatency = 0.15\nbandwidth = 2.0\n";

/// Prints one step's device time on the virtual clock against the simulator's
/// prediction for the same program.
fn device_time_report(expr: &str) {
    let profile = Profile::from_toml_str(LINKED).expect("linked profile parses");
    let prog = derive_str(&Request::new(&profile, RANKS, toy::MBS), expr)
        .expect("derives")
        .program;
    let link = profile.comm_model();
    let (trace, _) = device_time::measure(&prog, link);
    let sim = |mode| {
        simulate(&prog, &SimOptions { mode, comm: link })
            .expect("simulates")
            .makespan
    };
    let (device, eager, rendezvous) =
        (trace.device_time(), sim(Mode::Eager), sim(Mode::Rendezvous));
    println!(
        "device time {expr}: device {device:.3}, simulator eager {eager:.3}, rendezvous \
         {rendezvous:.3}, device/eager {:.4}",
        device / eager
    );
}

/// Runs `iters` steps (after one warm-up step) on every rank; returns rank 0's total
/// time issuing (`whole = false`) or issuing and finishing (`whole = true`).
fn steps(prog: &Program, iters: u64, whole: bool) -> Duration {
    let comms = AscendComm::world_in_process(RANKS).expect("world");
    let start = Barrier::new(RANKS);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (prog, start) = (prog, &start);
                s.spawn(move || {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let mut dev = DeviceRank::new(comm, prog, &lens).expect("device rank");
                    let mut model = Toy::new(prog, dev.kernels()).expect("model");
                    let mut total = Duration::ZERO;
                    for i in 0..=iters {
                        start.wait();
                        let t0 = Instant::now();
                        let mut step = dev.step(prog, &mut model);
                        interpret::run(prog, r, &mut step).expect("issues");
                        let issued = t0.elapsed();
                        step.finish().expect("finishes");
                        let done = t0.elapsed();
                        update(&mut dev, &model).expect("optimizer");
                        if i > 0 {
                            total += if whole { done } else { issued };
                        }
                    }
                    total
                })
            })
            .collect();
        let mut out = Duration::ZERO;
        for (r, h) in handles.into_iter().enumerate() {
            let t = h.join().expect("rank thread");
            if r == 0 {
                out = t;
            }
        }
        out
    })
}

fn bench(c: &mut Criterion) {
    let profile = Profile::from_toml_str(PROFILE).expect("bench profile parses");
    let req = Request::new(&profile, RANKS, toy::MBS);
    let mut g = c.benchmark_group("device step 4x8 (rank 0)");
    g.sample_size(10);
    for expr in ["1f1b", "transpose(vision, 1f1b)"] {
        device_time_report(expr);
        let prog = derive_str(&req, expr).expect("derives").program;
        g.bench_function(format!("{expr}: issue"), |b| {
            b.iter_custom(|iters| steps(&prog, iters, false))
        });
        g.bench_function(format!("{expr}: issue + finish"), |b| {
            b.iter_custom(|iters| steps(&prog, iters, true))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
