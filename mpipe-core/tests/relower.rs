//! `relower`: deriving a program's transfers again from its compute order gives a
//! valid program that terminates under rendezvous (even when the input hangs), keeps
//! every rank's forwards and backwards in order, is never slower than the input, and
//! never needs more memory than the input or the limit given. With an order budget
//! (`relower_ordered`, `mpipe refine --order N`) it may reorder each rank's compute,
//! and is then never slower than without one.

use mpipe_core::derive::{derive_str, resident_params, Request};
use mpipe_core::lower::{lower_with, Placement};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, ActionRef, Op, Program};
use mpipe_core::relower::{relower, relower_ordered, RelowerError};
use mpipe_core::simulate::{simulate, CommModel, Mode, SimOptions, SimReport};
use mpipe_core::verify::verify;
use proptest::prelude::*;

fn profile(f: f64, b: f64, w: f64, ef: f64, trainable: bool) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = 4\nforward = {ef}\nbackward = {ef}\nweight = {ef}\n\
         activation = 0.1\ntrainable = {trainable}\noutput = 0.5\n\n\
         [llm]\nlayers = 16\nforward = {f}\nbackward = {b}\nweight = {w}\nactivation = 1.0\noutput = 1.0\n\
         [link]\nlatency = 0.05\nbandwidth = 10.0\n"
    ))
    .unwrap()
}

fn rdv() -> SimOptions {
    SimOptions {
        mode: Mode::Rendezvous,
        comm: Some(CommModel {
            latency: 0.05,
            bandwidth: 10.0,
        }),
    }
}

/// Each rank's forwards and backwards, in order (what `relower` promises to keep).
fn spine(p: &Program) -> Vec<Vec<(Op, String, usize)>> {
    p.programs
        .iter()
        .map(|list| {
            list.iter()
                .filter_map(|a| match a.view() {
                    ActionRef::Compute(c) if c.op != Op::W => {
                        Some((c.op, c.unit.to_string(), c.mb))
                    }
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// Every compute action of each rank, as a sorted multiset.
fn work(p: &Program) -> Vec<Vec<(Op, String, usize)>> {
    p.programs
        .iter()
        .map(|list| {
            let mut v: Vec<_> = list
                .iter()
                .filter_map(|a| match a.view() {
                    ActionRef::Compute(c) => Some((c.op, c.unit.to_string(), c.mb)),
                    _ => None,
                })
                .collect();
            v.sort();
            v
        })
        .collect()
}

fn peak(p: &Program, r: &SimReport) -> f64 {
    r.peak_memory
        .iter()
        .zip(resident_params(p))
        .map(|(a, b)| a + b)
        .fold(0.0, f64::max)
}

fn compute_only(p: &Program) -> Program {
    let mut q = p.clone();
    for list in &mut q.programs {
        list.retain(|a| matches!(a.view(), ActionRef::Compute(_)));
    }
    q
}

const BODIES: [&str; 5] = [
    "1f1b",
    "zbh1",
    "zb2p",
    "transpose(vision, zbv)",
    "fill(vision, split_w(1f1b))",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    #[test]
    fn relowered_programs_are_valid_never_slower_and_keep_the_order(
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.05f64..2.0, ef in 0.1f64..3.0,
        trainable: bool, p in prop::sample::select(vec![2usize, 4]), k in 1usize..3,
    ) {
        let prof = profile(f, b, w, ef, trainable);
        let req = Request::new(&prof, p, 2 * p * k);
        for body in BODIES {
            let derived = derive_str(&req, body).unwrap().program;
            // The same compute order, with transfers as PyTorch's import places them,
            // and with none at all.
            let plan_input = mpipe_core::relower::plan_of_program(&derived).unwrap();
            let ready = lower_with(&plan_input, None, Placement::Ready).unwrap();
            for input in [derived.clone(), ready, compute_only(&derived)] {
                let r = relower(&input, &rdv(), None).unwrap();
                prop_assert!(verify(&r.program).is_empty(), "{body}: invalid: {:?}", verify(&r.program));
                prop_assert_eq!(spine(&r.program), spine(&input), "{}: order changed", body);
                prop_assert_eq!(work(&r.program), work(&input), "{}: work changed", body);
                let again = simulate(&r.program, &rdv()).unwrap();
                prop_assert_eq!(again.makespan, r.report.makespan);
                let valid = verify(&input).is_empty();
                prop_assert_eq!(r.input_problem.is_none(), valid, "{}: {:?}", body, r.input_problem);
                if valid {
                    let before = simulate(&input, &rdv()).unwrap();
                    prop_assert!(r.report.makespan <= before.makespan * (1.0 + 1e-12),
                        "{body}: {} > {}", r.report.makespan, before.makespan);
                    prop_assert_eq!(r.before, Some(before.makespan));
                    prop_assert!(peak(&r.program, &r.report) <= peak(&input, &before) + 1e-9,
                        "{body}: memory grew");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    #[test]
    fn ordered_relowering_keeps_the_work_and_is_never_slower(
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.05f64..2.0, ef in 0.1f64..3.0,
        trainable: bool, p in prop::sample::select(vec![2usize, 4]), k in 1usize..3,
        limited: bool,
    ) {
        let prof = profile(f, b, w, ef, trainable);
        let req = Request::new(&prof, p, 2 * p * k);
        for body in BODIES {
            let input = derive_str(&req, body).unwrap().program;
            let before = simulate(&input, &rdv()).unwrap();
            // A limit at the input's own peak: the search may not spend memory.
            let limit = limited.then(|| peak(&input, &before));
            let plain = relower(&input, &rdv(), limit).unwrap();
            let ordered = relower_ordered(&input, &rdv(), limit, 200).unwrap();
            prop_assert!(verify(&ordered.program).is_empty(), "{body}: invalid");
            prop_assert_eq!(work(&ordered.program), work(&input), "{}: work changed", body);
            prop_assert!(ordered.report.makespan <= plain.report.makespan * (1.0 + 1e-12),
                "{body}: {} > {}", ordered.report.makespan, plain.report.makespan);
            let again = simulate(&ordered.program, &rdv()).unwrap();
            prop_assert_eq!(again.makespan, ordered.report.makespan);
            let cap = limit.unwrap_or_else(|| peak(&input, &before));
            prop_assert!(peak(&ordered.program, &ordered.report) <= cap * (1.0 + 1e-9),
                "{body}: memory over {cap}");
            // An order budget of 0 is `relower` itself; the search is deterministic.
            let zero = relower_ordered(&input, &rdv(), limit, 0).unwrap();
            prop_assert_eq!(&zero.program, &plain.program);
            let twice = relower_ordered(&input, &rdv(), limit, 200).unwrap();
            prop_assert_eq!(&twice.program, &ordered.program);
        }
    }
}

/// On qwen2vl-7b, a derivation's compute order left as its plan made it waits under
/// rendezvous; the order search moves tasks into the waits and gains over keeping
/// the order, with the same work on every rank.
#[test]
fn ordered_relowering_gains_on_qwen2vl() {
    let prof = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let req = Request::new(&prof, 8, 32);
    let d = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
    let opts = req.sim_options(Mode::Rendezvous);
    let limit = prof.memory.as_ref().map(|m| m.limit);
    let plain = relower(&d.program, &opts, limit).unwrap();
    let ordered = relower_ordered(&d.program, &opts, limit, 300).unwrap();
    assert!(!ordered.kept_input);
    assert_eq!(work(&ordered.program), work(&d.program));
    assert_ne!(
        spine(&ordered.program),
        spine(&d.program),
        "the order moved"
    );
    assert!(
        ordered.report.makespan < plain.report.makespan * 0.997,
        "{} vs {}",
        ordered.report.makespan,
        plain.report.makespan
    );
    assert!(peak(&ordered.program, &ordered.report) <= limit.unwrap());
}

/// The hang PyTorch users report: each of two ranks sends before it receives, in
/// separate calls. Derived again, the same compute order runs.
#[test]
fn a_program_that_hangs_runs_after_relowering() {
    let text = r#"{"format": "mpipe-program/1", "ranks": 2, "microbatches": 2,
      "units": [
        {"name": "a", "inputs": [], "home": 0, "trainable": true, "cost": {"F": 1, "B": 1, "W": 1}, "act": 1},
        {"name": "b", "inputs": ["a"], "home": 1, "trainable": true, "cost": {"F": 1, "B": 1, "W": 1}, "act": 1}],
      "programs": [
        [{"op": "F", "unit": "a", "mb": 0}, {"op": "SEND", "tensor": "act", "unit": "a", "mb": 0, "peer": 1},
         {"op": "F", "unit": "a", "mb": 1}, {"op": "SEND", "tensor": "act", "unit": "a", "mb": 1, "peer": 1},
         {"op": "RECV", "tensor": "grad", "unit": "b", "mb": 0, "peer": 1},
         {"op": "BW", "unit": "a", "mb": 0},
         {"op": "RECV", "tensor": "grad", "unit": "b", "mb": 1, "peer": 1},
         {"op": "BW", "unit": "a", "mb": 1}],
        [{"op": "RECV", "tensor": "act", "unit": "a", "mb": 0, "peer": 0},
         {"op": "F", "unit": "b", "mb": 0}, {"op": "BW", "unit": "b", "mb": 0},
         {"op": "SEND", "tensor": "grad", "unit": "b", "mb": 0, "peer": 0},
         {"op": "RECV", "tensor": "act", "unit": "a", "mb": 1, "peer": 0},
         {"op": "F", "unit": "b", "mb": 1}, {"op": "BW", "unit": "b", "mb": 1},
         {"op": "SEND", "tensor": "grad", "unit": "b", "mb": 1, "peer": 0}]]}"#;
    let input: Program = serde_json::from_str(text).unwrap();
    let opts = SimOptions {
        mode: Mode::Rendezvous,
        comm: None,
    };
    assert!(simulate(&input, &opts).is_err(), "the input must hang");
    let r = relower(&input, &opts, None).unwrap();
    assert_eq!(r.before, None);
    let why = r.input_problem.as_deref().unwrap_or_default();
    assert!(why.contains("does not run to completion"), "{why}");
    assert!(!r.kept_input);
    assert!(verify(&r.program).is_empty());
    assert_eq!(spine(&r.program), spine(&input));
    // The order's own critical path: rank 1 runs F b0 at 1, BW b0 until 4, F b1 until
    // 5, BW b1 until 7; rank 0's BW a1 then ends at 9. No transfer adds a wait.
    assert_eq!(r.report.makespan, 9.0);
}

/// A program already placed by mpipe's own derivation and refinement comes back
/// unchanged.
#[test]
fn a_refined_program_is_kept() {
    let prof = profile(1.0, 1.0, 0.5, 1.5, true);
    let req = Request::new(&prof, 4, 8);
    let d = derive_str(&req, "refine(zbh1)").unwrap();
    let r = relower(&d.program, &rdv(), None).unwrap();
    assert!(r.kept_input);
    assert_eq!(r.program, d.program);
    assert_eq!(r.before, Some(d.report.makespan));
}

/// An order no placement of transfers can run is refused, naming the task.
#[test]
fn an_impossible_order_is_refused() {
    let prof = profile(1.0, 1.0, 0.5, 1.5, true);
    let req = Request::new(&prof, 2, 4);
    let mut p = derive_str(&req, "1f1b").unwrap().program;
    // Rank 1 runs its first backward before the forward it needs.
    let list = &mut p.programs[1];
    let f = list
        .iter()
        .position(|a| matches!(a, Action::F { .. }))
        .unwrap();
    let bw = list
        .iter()
        .position(|a| matches!(a, Action::BW { .. }))
        .unwrap();
    list.swap(f, bw);
    let e = relower(&p, &rdv(), None).unwrap_err();
    assert!(matches!(e, RelowerError::Order(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("rank 1") && text.contains("reorder"),
        "{text}"
    );
}

#[test]
fn unknown_units_and_microbatches_are_named() {
    let prof = profile(1.0, 1.0, 0.5, 1.5, true);
    let req = Request::new(&prof, 2, 4);
    let good = derive_str(&req, "1f1b").unwrap().program;
    let mut p = good.clone();
    p.programs[0].insert(0, Action::compute(Op::F, "nope", 0));
    let e = relower(&p, &rdv(), None).unwrap_err();
    assert_eq!(
        e,
        RelowerError::UnknownUnit {
            rank: 0,
            index: 0,
            unit: "nope".into()
        }
    );
    let mut p = good;
    let unit = p.units[0].name.clone();
    p.programs[1].push(Action::compute(Op::F, unit.as_str(), 9));
    let e = relower(&p, &rdv(), None).unwrap_err();
    assert!(
        matches!(
            e,
            RelowerError::Microbatch {
                rank: 1,
                mb: 9,
                microbatches: 4,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("raise `microbatches`"));
}

/// With a memory limit, the result stays within it; one the re-derived program cannot
/// meet, without a valid input to fall back on, is an error that says so.
#[test]
fn the_memory_limit_is_kept() {
    let prof = profile(1.0, 1.0, 1.0, 2.0, true);
    let req = Request::new(&prof, 4, 16);
    let d = derive_str(&req, "zb2p").unwrap().program;
    let before = simulate(&d, &rdv()).unwrap();
    let limit = peak(&d, &before);
    let r = relower(&d, &rdv(), Some(limit)).unwrap();
    assert!(peak(&r.program, &r.report) <= limit * (1.0 + 1e-12));
    let e = relower(&compute_only(&d), &rdv(), Some(limit / 4.0)).unwrap_err();
    assert!(matches!(e, RelowerError::Memory { .. }), "{e:?}");
    assert!(e.to_string().contains("raise the limit"), "{e}");
}
