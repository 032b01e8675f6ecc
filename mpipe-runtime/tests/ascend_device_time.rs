//! The device step's time on the emulator's virtual clock against the simulator's
//! prediction for the same program (issue 34: "the emulator's device-time trace
//! against the simulator's prediction").
//!
//! The step charges the program's compute cost of every action on the compute stream
//! and each transfer's cost under the profile's `[link]` on its stream; the emulator
//! moves each stream's virtual time through those charges, event waits and HCCL
//! matching (`ascend_sys::emulator::clock`). Checked, for every schedule the toy model
//! runs, at 4 ranks x 8 micro-batches:
//! - the step's device time lies between the simulator's eager and rendezvous
//!   makespans of the program (why it must, below);
//! - no two spans of one stream overlap;
//! - each rank's charged compute equals the simulator's busy compute of that rank (every
//!   action charged once, at its own cost).
//!
//! Why between the two: the device runs every point-to-point batch in program order on
//! one stream with rendezvous matching, and each kernel waits only for the transfers
//! whose bytes it touches; the simulator's rendezvous rank also waits for every
//! transfer before its next action, so the device can only be earlier (every start is
//! a max over a subset of the simulator's terms). A device later than rendezvous means
//! a serialising bug (a wait the step does not need, a stream that waits for the wrong
//! recording). Eager lets a sender go on at once and is the figure the device step
//! approaches ("so the step approaches the simulator's eager figure"); a device earlier
//! than eager would mean a kernel ran before a receive it needed completed, i.e. a
//! missing event wait. (That the lower bound holds for these schedules is this test's
//! claim, not a theorem: a kernel that needs none of a batch's receives may start
//! before the batch completes, which eager's rank may not.)
//!
//! `cargo test --release -p mpipe-runtime --features ascend --test ascend_device_time`
#![cfg(feature = "ascend")]

#[path = "support/device_time.rs"]
mod device_time;
#[path = "support/toy.rs"]
#[allow(dead_code)]
mod toy;

use device_time::measure;
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::Program;
use mpipe_core::simulate::{simulate, CommModel, Mode, SimOptions};
use toy::MBS;

const RANKS: usize = 4;

/// The device-step tests' profile, with message sizes and a link, so transfers cost
/// time.
const PROFILE: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 2.0\nbackward = 2.0\n\
weight = 1.0\nactivation = 0.5\nparams = 0.5\ntrainable = true\noutput = 0.6\n\
[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\n\
output = 0.8\n[link]\nlatency = 0.15\nbandwidth = 2.0\n";

/// Every schedule the toy model runs in `tests/ascend_device.rs`.
const SCHEDULES: [&str; 4] = [
    "1f1b",
    "transpose(vision, 1f1b)",
    "zbv",
    "interleaved(v = 2)",
];

fn setup(expr: &str) -> (Program, Option<CommModel>) {
    let prof = Profile::from_toml_str(PROFILE).expect("profile");
    let prog = derive_str(&Request::new(&prof, RANKS, MBS), expr)
        .expect("derive")
        .program;
    (prog, prof.comm_model())
}

fn is_compute(label: &str) -> bool {
    ["F ", "B ", "W ", "BW ", "RF "]
        .iter()
        .any(|p| label.starts_with(p))
}

/// `a <= b` up to a relative 1e-9 (sums of floats in different orders).
fn le(a: f64, b: f64) -> bool {
    a <= b + 1e-9 * b.abs().max(1.0)
}

#[test]
fn device_time_lies_between_the_eager_and_rendezvous_makespans() {
    for expr in SCHEDULES {
        let (prog, link) = setup(expr);
        assert!(link.is_some(), "the profile has a link");
        let sim = |mode| simulate(&prog, &SimOptions { mode, comm: link }).expect("simulates");
        let (eager, rendezvous) = (sim(Mode::Eager), sim(Mode::Rendezvous));
        let (trace, devices) = measure(&prog, link);
        let device = trace.device_time();
        eprintln!(
            "{expr}: device {device:.4}, simulator eager {:.4}, rendezvous {:.4} \
             (device / eager {:.4})",
            eager.makespan,
            rendezvous.makespan,
            device / eager.makespan
        );
        assert!(
            le(eager.makespan, device) && le(device, rendezvous.makespan),
            "{expr}: device time {device} outside [eager {}, rendezvous {}]",
            eager.makespan,
            rendezvous.makespan
        );
        if let Some((i, a, b)) = trace.overlap() {
            panic!("{expr}: stream {i}: span {a:?} overlaps {b:?}");
        }
        for (r, &d) in devices.iter().enumerate() {
            let charged: f64 = trace
                .streams
                .iter()
                .filter(|s| s.device == d)
                .flat_map(|s| &s.spans)
                .filter(|s| is_compute(&s.label))
                .map(|s| s.end - s.start)
                .sum();
            let busy = eager.compute[r];
            assert!(
                le(charged, busy) && le(busy, charged),
                "{expr}: rank {r} charged {charged} of compute, the simulator counts {busy}"
            );
            assert!(le(trace.device_end(d), device));
        }
    }
}

/// Without charges the clock stays at zero: device time comes only from what the
/// program charges, never from the emulator's own CPU time.
#[test]
fn free_transfers_take_the_compute_critical_path_only() {
    let (prog, _) = setup("1f1b");
    let (trace, _) = measure(&prog, None);
    let eager = simulate(
        &prog,
        &SimOptions {
            mode: Mode::Eager,
            comm: None,
        },
    )
    .expect("simulates");
    let rendezvous = simulate(&prog, &SimOptions::default()).expect("simulates");
    let device = trace.device_time();
    assert!(device > 0.0);
    assert!(
        le(eager.makespan, device) && le(device, rendezvous.makespan),
        "device time {device} outside [eager {}, rendezvous {}]",
        eager.makespan,
        rendezvous.makespan
    );
}
