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

use device_time::{measure, measure_with};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{ActionRef, Dir, Op, Program, Tensor};
use mpipe_core::simulate::{simulate, CommModel, Mode, SimOptions};
use mpipe_runtime::ascend::counters::Trace;
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

/// The action index a span's label ends with (`... at action N`).
fn action_of(label: &str) -> Option<usize> {
    label.rsplit_once(" at action ")?.1.parse().ok()
}

/// On every rank, each compute span that reads a tensor the rank received (a forward
/// its inputs' activations, a backward its consumers' gradients) starts no earlier than
/// the span of the batch that received it ends: virtual time respects the data
/// dependencies, whatever the simulator says. A kernel the step failed to order after
/// its transfer breaks it whenever the transfer ended later.
fn dependencies_hold(prog: &Program, trace: &Trace, devices: &[i32]) -> Result<(), String> {
    for (r, &d) in devices.iter().enumerate() {
        let spans: Vec<_> = trace
            .streams
            .iter()
            .filter(|s| s.device == d)
            .flat_map(|s| &s.spans)
            .collect();
        // The batch spans by their first action, in order.
        let mut batches: Vec<(usize, f64)> = spans
            .iter()
            .filter(|s| s.label.starts_with("batch"))
            .filter_map(|s| Some((action_of(&s.label)?, s.end)))
            .collect();
        batches.sort_by_key(|b| b.0);
        let list = &prog.programs[r];
        for s in spans.iter().filter(|s| is_compute(&s.label)) {
            let i = action_of(&s.label).ok_or(format!("no action in {:?}", s.label))?;
            let ActionRef::Compute(c) = list[i].view() else {
                return Err(format!("rank {r}: action {i} is not {:?}", s.label));
            };
            let unit = &prog.units[prog.unit_index(c.unit).expect("unit")];
            let needs: Vec<(Tensor, &str)> = match c.op {
                Op::F | Op::RF => unit
                    .inputs
                    .iter()
                    .map(|p| (Tensor::Act, p.as_str()))
                    .collect(),
                Op::B | Op::BW => prog
                    .units
                    .iter()
                    .filter(|v| v.inputs.contains(&unit.name))
                    .map(|v| (Tensor::Grad, v.name.as_str()))
                    .collect(),
                Op::W => Vec::new(),
            };
            for (tensor, from) in needs {
                let recv = (0..i).rev().find(|&j| {
                    matches!(list[j].view(), ActionRef::P2p(x) if x.dir == Dir::Recv
                        && x.peer != r && x.tensor == tensor && x.unit == from && x.mb == c.mb)
                });
                let Some(j) = recv else { continue };
                let Some(&(first, end)) = batches.iter().rev().find(|b| b.0 <= j) else {
                    return Err(format!("rank {r}: no batch span for action {j}"));
                };
                if !le(end, s.start) {
                    return Err(format!(
                        "rank {r}: {:?} starts at {} before the batch at action {first}, which \
                         receives what it reads (action {j}), ends at {end}",
                        s.label, s.start
                    ));
                }
            }
        }
    }
    Ok(())
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
        dependencies_hold(&prog, &trace, &devices).unwrap_or_else(|e| panic!("{expr}: {e}"));
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

/// The dependency check can fail: leaving out event waits of rank 0's step one at a
/// time, some kernel starts before the batch that received its input ends (the
/// emulator's hazard check, `tests/ascend_device.rs`, catches every one of them; the
/// clock sees those whose transfer ended later than the kernel would start), while the
/// unmutated step keeps every dependency.
#[test]
fn a_missing_event_wait_shows_in_the_trace() {
    let (prog, link) = setup("1f1b");
    let plain = measure_with(&prog, link, None);
    dependencies_hold(&prog, &plain.trace, &plain.devices).expect("the step keeps them");
    let waits = plain.waits[0];
    assert!(waits > 0);
    let caught = (0..waits)
        .filter(|&k| {
            let m = measure_with(&prog, link, Some((0, k)));
            dependencies_hold(&prog, &m.trace, &m.devices).is_err()
        })
        .count();
    assert!(
        caught > 0,
        "none of rank 0's {waits} event waits, left out, let a kernel start before its data"
    );
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
