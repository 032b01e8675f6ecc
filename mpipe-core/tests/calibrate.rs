//! Calibration against the simulator's own timelines: a trace written with the
//! program embedded reads back as that program and its timeline; a timeline the
//! simulator produced is measured back exactly (every compute cost, a fused `BW`
//! split in the program's proportion, `RF` counted as `F`, the link from transfers
//! and collectives) under both semantics, so the calibrated program simulates to
//! the same step; the profile scaled by the measurements derives the measured
//! program; and every timeline or trace that does not belong to the program is a
//! typed error.

use std::collections::{BTreeMap, BTreeSet};

use mpipe_core::calibrate::{
    family, measure, CalibrateError, Calibration, Family, Scale, MAX_BANDWIDTH,
};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, ActionRef, Cost, Dir, Op, Program, Tensor, Unit, FORMAT};
use mpipe_core::render::{
    chrome_trace, embedded_program, timeline_from_trace, TraceOptions, TraceReadError,
};
use mpipe_core::simulate::{simulate, CommModel, Mode, SimOptions, SimReport};
use mpipe_core::timeline::{Slot, Timeline};
use proptest::prelude::*;
use serde_json::{json, Value};

/// A trainable encoder whose output (0.01) is smaller than the LLM's hidden state
/// (0.03), so transfers have two sizes, and whose parameters (2.0) size the
/// collectives; both extras; a link.
const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 4
forward = 0.5
backward = 0.7
weight = 0.3
activation = 0.1
params = 2.0
trainable = true
output = 0.01

[llm]
layers = 8
forward = 1.0
backward = 1.1
weight = 0.9
activation = 0.5
params = 0.5
output = 0.03
first_stage_extra = { forward = 0.05, backward = 0.0, weight = 0.05, params = 1.0 }
last_stage_extra = { forward = 2.0, backward = 2.0, weight = 2.0, activation = 0.5, params = 1.0 }

[link]
latency = 0.01
bandwidth = 0.2
"#;

const LATENCY: f64 = 0.01;
const BANDWIDTH: f64 = 0.2;
const RANKS: usize = 4;
const MICROBATCHES: usize = 8;

fn profile() -> Profile {
    Profile::from_toml_str(PROFILE).unwrap()
}

/// `PROFILE` without its link: communication is free.
fn free_profile() -> Profile {
    let (head, _) = PROFILE.split_once("[link]").unwrap();
    let p = Profile::from_toml_str(head).unwrap();
    assert!(p.link.is_none());
    p
}

/// `expr` derived for 4 ranks and 8 micro-batches, chosen for `mode`.
fn derive(profile: &Profile, expr: &str, mode: Mode) -> Program {
    let req = Request {
        mode,
        ..Request::new(profile, RANKS, MICROBATCHES)
    };
    derive_str(&req, expr)
        .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
        .program
}

fn sim(p: &Program, mode: Mode, comm: Option<CommModel>) -> SimReport {
    simulate(p, &SimOptions { mode, comm }).unwrap_or_else(|e| panic!("{e}"))
}

/// `p` with unit `u`'s costs multiplied by `by(u)` = `(F, B, W)` factors.
fn scaled(p: &Program, by: impl Fn(&str) -> (f64, f64, f64)) -> Program {
    let mut out = p.clone();
    for u in &mut out.units {
        let (f, b, w) = by(&u.name);
        u.cost = Cost {
            f: u.cost.f * f,
            b: u.cost.b * b,
            w: u.cost.w * w,
        };
    }
    out
}

/// `a` and `b` agree within `rel` relative (and 1e-12 absolute, for zeros).
fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()) + 1e-12
}

fn assert_close(a: f64, b: f64, rel: f64, what: &str) {
    assert!(close(a, b, rel), "{what}: {a} vs {b} (rel {rel})");
}

/// `b`'s stage extras are `a`'s scaled: the embedding's `F` and `W` by `first`
/// (its `B` stays 0), the LM head's `F`, `B` and `W` by `last`; activations kept.
fn assert_extras_scaled(a: &Profile, b: &Profile, first: (f64, f64), last: (f64, f64, f64)) {
    let (fa, fb) = (
        a.llm.first_stage_extra.as_ref().unwrap(),
        b.llm.first_stage_extra.as_ref().unwrap(),
    );
    assert_close(fb.forward, fa.forward * first.0, 1e-9, "first F");
    assert_eq!(fb.backward, 0.0);
    assert_close(fb.weight, fa.weight * first.1, 1e-9, "first W");
    let (la, lb) = (
        a.llm.last_stage_extra.as_ref().unwrap(),
        b.llm.last_stage_extra.as_ref().unwrap(),
    );
    assert_close(lb.forward, la.forward * last.0, 1e-9, "last F");
    assert_close(lb.backward, la.backward * last.1, 1e-9, "last B");
    assert_close(lb.weight, la.weight * last.2, 1e-9, "last W");
    assert_eq!(lb.activation, la.activation);
}

fn assert_cost_close(a: &Cost, b: &Cost, rel: f64, what: &str) {
    assert_close(a.f, b.f, rel, &format!("{what} F"));
    assert_close(a.b, b.b, rel, &format!("{what} B"));
    assert_close(a.w, b.w, rel, &format!("{what} W"));
}

/// Every unit of `got` costs what the same unit of `want` costs.
fn assert_costs_eq(got: &Program, want: &Program, rel: f64) {
    assert_eq!(got.units.len(), want.units.len());
    for (g, w) in got.units.iter().zip(&want.units) {
        assert_eq!(g.name, w.name);
        assert_cost_close(&g.cost, &w.cost, rel, &g.name);
    }
}

/// Every slot of `a` within `tol` of the same slot of `b`.
fn assert_timelines_close(a: &Timeline, b: &Timeline, tol: f64) {
    assert_eq!(a.ranks.len(), b.ranks.len());
    for (r, (x, y)) in a.ranks.iter().zip(&b.ranks).enumerate() {
        assert_eq!(x.len(), y.len(), "rank {r}");
        for (i, (s, t)) in x.iter().zip(y).enumerate() {
            assert!(
                (s.start - t.start).abs() <= tol && (s.end - t.end).abs() <= tol,
                "rank {r}, action {i}: {s:?} vs {t:?} (tol {tol})"
            );
        }
    }
}

/// How many actions of each (unit, op) the program has, `RF` counted as `F`.
fn op_counts(p: &Program) -> BTreeMap<(String, Op), usize> {
    let mut out = BTreeMap::new();
    for a in p.programs.iter().flatten() {
        if let ActionRef::Compute(c) = a.view() {
            let op = if c.op == Op::RF { Op::F } else { c.op };
            *out.entry((c.unit.to_string(), op)).or_insert(0) += 1;
        }
    }
    out
}

/// The sizes the program's transfers carry.
fn transfer_sizes(p: &Program) -> BTreeSet<u64> {
    p.programs
        .iter()
        .flatten()
        .filter_map(|a| match a.view() {
            ActionRef::P2p(x) => Some(p.units[p.unit_index(x.unit).unwrap()].bytes.to_bits()),
            _ => None,
        })
        .collect()
}

/// Every stat counts every action of its op, and (the costs being the same for
/// every micro-batch) all its samples are equal.
fn assert_stats_complete(cal: &Calibration, p: &Program) {
    let counts = op_counts(p);
    for ((unit, op), n) in &counts {
        let m = cal
            .units
            .get(unit)
            .unwrap_or_else(|| panic!("{unit} not measured"));
        let s = match op {
            Op::F | Op::RF => m.f,
            Op::B => m.b,
            Op::W => m.w,
            Op::BW => m.bw,
        }
        .unwrap_or_else(|| panic!("{unit} {op:?} not measured"));
        assert_eq!(s.samples, *n, "{unit} {op:?}");
        assert!(
            close(s.min, s.max, 1e-9) && close(s.median, s.min, 1e-9) && close(s.mean, s.min, 1e-9),
            "{unit} {op:?}: {s:?}"
        );
    }
    // Nothing measured that the program does not have.
    for (unit, m) in &cal.units {
        for (op, s) in [(Op::F, m.f), (Op::B, m.b), (Op::W, m.w), (Op::BW, m.bw)] {
            assert_eq!(
                s.is_some(),
                counts.contains_key(&(unit.clone(), op)),
                "{unit} {op:?}"
            );
        }
    }
}

fn trace_opts(time_scale: f64) -> TraceOptions {
    TraceOptions {
        time_scale,
        embed_program: true,
        ..TraceOptions::default()
    }
}

// ---- 1. The trace format round trip ---------------------------------------------

#[test]
fn a_trace_reads_back_as_its_program_and_timeline() {
    let profile = profile();
    for mode in [Mode::Rendezvous, Mode::Eager] {
        let p = derive(&profile, "transpose(vision, 1f1b)", mode);
        assert_eq!(
            transfer_sizes(&p).len(),
            2,
            "the encoder's and the LLM's transfers"
        );
        let t = sim(&p, mode, profile.comm_model()).timeline;
        // Times are written rounded to 0.001 us: 1e-6 ms, 1e-9 s (start and end each
        // within half of that, the end from two rounded numbers).
        for (scale, tol) in [(1000.0, 1e-6), (1e6, 1e-9), (1.0, 1e-3)] {
            let text = chrome_trace(&p, &t, &trace_opts(scale));
            assert_eq!(embedded_program(&text).unwrap(), p);
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["mpipe"]["time_scale"].as_f64(), Some(scale));
            let back = timeline_from_trace(&p, &text, scale).unwrap();
            assert_timelines_close(&back, &t, tol + 1e-12);
            // Read at another scale, every time is scaled by the ratio.
            let other = timeline_from_trace(&p, &text, scale * 2.0).unwrap();
            let half = Timeline {
                ranks: back
                    .ranks
                    .iter()
                    .map(|r| {
                        r.iter()
                            .map(|s| Slot {
                                start: s.start / 2.0,
                                end: s.end / 2.0,
                            })
                            .collect()
                    })
                    .collect(),
            };
            assert_timelines_close(&other, &half, 1e-12 * t.makespan());

            // The events' order in the file does not matter: each name's events
            // are taken in order of time.
            let mut v = v;
            v["traceEvents"].as_array_mut().unwrap().reverse();
            let reversed = timeline_from_trace(&p, &v.to_string(), scale).unwrap();
            assert_eq!(reversed, back, "{mode:?}, scale {scale}: reversed events");
        }
        // Without flows, memory counters or the embedded program, the same timeline.
        let bare = TraceOptions {
            time_scale: 1000.0,
            flows: false,
            memory: false,
            embed_program: false,
            name: Some("run".into()),
        };
        let text = chrome_trace(&p, &t, &bare);
        let back = timeline_from_trace(&p, &text, 1000.0).unwrap();
        assert_timelines_close(&back, &t, 1e-6 + 1e-12);
        assert_eq!(embedded_program(&text), Err(TraceReadError::NoProgram));
    }
}

/// What `mpipe calibrate TRACE` does: the trace alone gives the program, the
/// timeline and so the measured costs, at the runtime's scale (seconds, 1e6 us).
#[test]
fn the_trace_alone_calibrates_its_run() {
    let profile = profile();
    let p = derive(&profile, "transpose(vision, 1f1b)", Mode::Rendezvous);
    // The run's true costs: slower LLM, faster encoder.
    let truth = scaled(&p, |u| {
        if u == "vision" {
            (0.7, 0.7, 0.7)
        } else {
            (1.3, 1.3, 1.3)
        }
    });
    let run = sim(&truth, Mode::Rendezvous, profile.comm_model());
    let text = chrome_trace(&p, &run.timeline, &trace_opts(1e6));
    let program = embedded_program(&text).unwrap();
    let t = timeline_from_trace(&program, &text, 1e6).unwrap();
    let cal = measure(&program, &t, Mode::Rendezvous, None).unwrap();
    // Each slot is within 1e-9 of the truth.
    assert_costs_eq(&cal.apply(&program), &truth, 1e-8);
    let link = cal.link.expect("the link is measured");
    assert_close(link.latency, LATENCY, 1e-6, "latency");
    assert_close(link.bandwidth, BANDWIDTH, 1e-6, "bandwidth");
    assert_close(cal.step, run.makespan, 1e-9, "step");
}

// ---- 2. and 3. Exact recovery -----------------------------------------------------

/// Measure the run of `expr` (true costs, the profile's link) against the program
/// with other costs; the measured costs are the true ones, the link is the
/// profile's, and the calibrated program simulates to the same timeline.
fn check_exact_recovery(expr: &str, mode: Mode) -> Calibration {
    let profile = profile();
    let p = derive(&profile, expr, mode);
    let run = sim(&p, mode, profile.comm_model());
    // Wrong costs, different per op and per family; a unit that only has fused
    // `BW` keeps its B : W proportion (the split is checked on its own below).
    let bw_only: BTreeSet<String> = op_counts(&p)
        .keys()
        .filter(|(_, op)| *op == Op::BW)
        .map(|(u, _)| u.clone())
        .filter(|u| !op_counts(&p).contains_key(&(u.clone(), Op::B)))
        .collect();
    let p2 = scaled(&p, |u| match (family(u), bw_only.contains(u)) {
        (Some(Family::Encoder(_)), true) => (0.3, 3.0, 3.0),
        (Some(Family::Encoder(_)), false) => (0.3, 3.0, 0.4),
        (_, true) => (0.5, 1.7, 1.7),
        (_, false) => (0.5, 2.0, 0.25),
    });
    let cal = measure(&p2, &run.timeline, mode, None).unwrap();
    assert_stats_complete(&cal, &p);
    let calibrated = cal.apply(&p2);
    assert_costs_eq(&calibrated, &p, 1e-9);
    let link = cal
        .link
        .unwrap_or_else(|| panic!("{expr} {mode:?}: no link"));
    assert!(link.sizes >= 2, "{expr} {mode:?}: {link:?}");
    // Fits are given to twelve significant digits: exactly the profile's figures.
    assert_eq!(
        (link.latency, link.bandwidth),
        (LATENCY, BANDWIDTH),
        "{expr} {mode:?}"
    );
    assert!(link.rms < 1e-12, "{link:?}");
    assert_eq!(link.model().latency, link.latency);
    assert_eq!(link.model().bandwidth, link.bandwidth);
    assert_close(cal.step, run.makespan, 1e-9, "step");
    // Per rank: its compute and its finish.
    assert_eq!(cal.ranks.len(), RANKS);
    for (r, m) in cal.ranks.iter().enumerate() {
        assert_close(m.compute, run.compute[r], 1e-9, "rank compute");
        let end = run.timeline.ranks[r]
            .iter()
            .map(|s| s.end)
            .fold(0.0, f64::max);
        assert_close(m.end, end, 1e-9, "rank end");
    }
    let again = sim(&calibrated, mode, Some(link.model()));
    assert_close(again.makespan, run.makespan, 1e-9, "makespan");
    assert_timelines_close(&again.timeline, &run.timeline, 1e-9 * run.makespan);
    cal
}

#[test]
fn rendezvous_runs_are_measured_back_exactly() {
    for expr in [
        "transpose(vision, 1f1b)",
        "transpose(vision, zbh1)",
        "transpose(vision, 1f1b, backward = central)",
    ] {
        let cal = check_exact_recovery(expr, Mode::Rendezvous);
        // Under rendezvous every point-to-point operation of one size is a sample.
        assert!(cal.link.unwrap().samples > 20, "{expr}: {:?}", cal.link);
    }
}

#[test]
fn eager_runs_are_measured_back_exactly() {
    for expr in [
        "transpose(vision, 1f1b)",
        "transpose(vision, zbh1)",
        "transpose(vision, 1f1b, backward = central)",
    ] {
        check_exact_recovery(expr, Mode::Eager);
    }
}

/// With one transfer size (the encoder on the first stage's rank, so only the
/// LLM's hidden state travels), latency and bandwidth cannot be told apart: without
/// a prior the time per transfer is all latency beside the largest bandwidth; with
/// a prior its bandwidth is kept and the latency is exact.
#[test]
fn one_transfer_size_gives_latency_beside_the_prior_bandwidth() {
    let profile = profile();
    for mode in [Mode::Rendezvous, Mode::Eager] {
        let p = derive(&profile, "1f1b", mode);
        assert_eq!(transfer_sizes(&p).len(), 1);
        let run = sim(&p, mode, profile.comm_model());
        let per_transfer = LATENCY + 0.03 / BANDWIDTH;

        let cal = measure(&p, &run.timeline, mode, None).unwrap();
        assert_costs_eq(&cal.apply(&p), &p, 1e-9);
        let link = cal.link.unwrap();
        assert_eq!(link.sizes, 1, "{mode:?}: {link:?}");
        assert_close(link.latency, per_transfer, 1e-9, "latency");
        assert_eq!(link.bandwidth, MAX_BANDWIDTH);

        // The prior's latency is not used, its bandwidth is.
        let prior = CommModel {
            latency: 7.0,
            bandwidth: BANDWIDTH,
        };
        let cal = measure(&p, &run.timeline, mode, Some(prior)).unwrap();
        let link = cal.link.unwrap();
        assert_eq!(link.sizes, 1);
        assert_close(link.latency, LATENCY, 1e-9, "latency with the prior");
        assert_eq!(link.bandwidth, BANDWIDTH);
        let again = sim(&cal.apply(&p), mode, Some(link.model()));
        assert_close(again.makespan, run.makespan, 1e-9, "makespan");

        // A prior whose bandwidth alone exceeds the transfer time gives latency 0.
        let slow = CommModel {
            latency: 0.0,
            bandwidth: 0.01,
        };
        let link = measure(&p, &run.timeline, mode, Some(slow))
            .unwrap()
            .link
            .unwrap();
        assert_eq!((link.latency, link.bandwidth), (0.0, 0.01));
    }
}

/// Transfers that take no time give no link.
#[test]
fn free_communication_gives_no_link() {
    let profile = free_profile();
    for mode in [Mode::Rendezvous, Mode::Eager] {
        let p = derive(&profile, "transpose(vision, 1f1b)", mode);
        let run = sim(&p, mode, None);
        let cal = measure(&p, &run.timeline, mode, None).unwrap();
        assert_eq!(cal.link, None, "{mode:?}");
        assert_costs_eq(&cal.apply(&p), &p, 1e-9);
        assert_close(cal.step, run.makespan, 1e-9, "step");
        // The profile keeps its (absent) link.
        assert_eq!(cal.scale_profile(&p, &profile).link, None);
    }
}

// ---- 4. Fused BW and RF ------------------------------------------------------------

#[test]
fn a_fused_bw_splits_in_the_programs_proportion() {
    let profile = profile();
    let p = derive(&profile, "1f1b", Mode::Rendezvous);
    let counts = op_counts(&p);
    for u in &p.units {
        assert!(counts.contains_key(&(u.name.clone(), Op::BW)), "{}", u.name);
        assert!(!counts.contains_key(&(u.name.clone(), Op::B)), "{}", u.name);
        assert!(!counts.contains_key(&(u.name.clone(), Op::W)), "{}", u.name);
    }
    let run = sim(&p, Mode::Rendezvous, profile.comm_model());
    // The program believes B is 4x W on every unit, and F twice what it is.
    let p2 = {
        let mut q = p.clone();
        for u in &mut q.units {
            u.cost = Cost {
                f: u.cost.f * 2.0,
                b: 0.8,
                w: 0.2,
            };
        }
        q
    };
    let cal = measure(&p2, &run.timeline, Mode::Rendezvous, None).unwrap();
    assert_stats_complete(&cal, &p);
    let got = cal.apply(&p2);
    for (g, want) in got.units.iter().zip(&p.units) {
        let m = cal.units[&g.name];
        assert!(m.b.is_none() && m.w.is_none());
        let bw = m.bw.unwrap();
        assert_eq!(bw.samples, MICROBATCHES);
        assert_close(bw.mean, want.cost.b + want.cost.w, 1e-9, "BW mean");
        assert_close(g.cost.f, want.cost.f, 1e-9, "F");
        assert_close(g.cost.b + g.cost.w, bw.mean, 1e-9, "B + W");
        assert_close(g.cost.b, 4.0 * g.cost.w, 1e-9, "B : W = 4 : 1");
    }
    // The step needs only B + W, so it is reproduced.
    let again = sim(&got, Mode::Rendezvous, Some(cal.link.unwrap().model()));
    assert_close(again.makespan, run.makespan, 1e-9, "makespan");

    // A unit whose program costs B = W = 0 splits its BW in half.
    let mut p3 = p2.clone();
    p3.units[1].cost.b = 0.0;
    p3.units[1].cost.w = 0.0;
    let got = cal.apply(&p3);
    let c = got.units[1].cost;
    assert_close(c.b, c.w, 1e-12, "half");
    assert_close(
        c.b + c.w,
        p.units[1].cost.b + p.units[1].cost.w,
        1e-9,
        "sum",
    );
}

/// A unit measured with separate B and W keeps them as measured, whatever the
/// program's proportion.
#[test]
fn separate_b_and_w_are_measured_as_they_are() {
    let profile = profile();
    let p = derive(&profile, "zbh1", Mode::Rendezvous);
    let run = sim(&p, Mode::Rendezvous, profile.comm_model());
    let p2 = scaled(&p, |_| (1.0, 0.1, 9.0));
    let cal = measure(&p2, &run.timeline, Mode::Rendezvous, None).unwrap();
    let got = cal.apply(&p2);
    let counts = op_counts(&p);
    let mut separate = 0;
    for (g, want) in got.units.iter().zip(&p.units) {
        if counts.contains_key(&(g.name.clone(), Op::B)) {
            separate += 1;
            assert_cost_close(&g.cost, &want.cost, 1e-9, &g.name);
        }
    }
    assert_eq!(
        separate, RANKS,
        "every LLM stage runs B and W apart in zbh1"
    );
}

/// A unit measured with a fused `BW` beside a separate `B` or `W` takes the other
/// from the difference; with both separate, the `BW` is not needed.
#[test]
fn a_fused_bw_beside_a_separate_b_or_w_gives_the_other_by_difference() {
    let profile = profile();
    let p = derive(&profile, "1f1b", Mode::Rendezvous);
    let truth = p.units[p.unit_index("llm.3").unwrap()].cost;
    // Rank 3's first four `BW(llm.3)` become `B` then `W`, `B` alone or `W` alone.
    let split = |ops: &[Op]| {
        let mut q = p.clone();
        let mut n = 0;
        q.programs[3] = p.programs[3]
            .iter()
            .flat_map(|a| match a {
                Action::BW { unit, mb } if &**unit == "llm.3" && n < 4 => {
                    n += 1;
                    ops.iter()
                        .map(|&op| Action::compute(op, unit.clone(), *mb as usize))
                        .collect()
                }
                other => vec![other.clone()],
            })
            .collect();
        assert_eq!(n, 4);
        q
    };
    for ops in [&[Op::B, Op::W][..], &[Op::B], &[Op::W]] {
        let q = split(ops);
        let run = sim(&q, Mode::Rendezvous, profile.comm_model());
        // The program believes B : W is 1 : 9.
        let mut q2 = q.clone();
        let i = q2.unit_index("llm.3").unwrap();
        q2.units[i].cost.b = 0.1;
        q2.units[i].cost.w = 0.9;
        let cal = measure(&q2, &run.timeline, Mode::Rendezvous, None).unwrap();
        let m = cal.units["llm.3"];
        assert_eq!(m.bw.unwrap().samples, MICROBATCHES - 4, "{ops:?}");
        assert_eq!(m.b.map(|s| s.samples), ops.contains(&Op::B).then_some(4));
        assert_eq!(m.w.map(|s| s.samples), ops.contains(&Op::W).then_some(4));
        let got = cal.apply(&q2).units[i].cost;
        assert_cost_close(&got, &truth, 1e-9, &format!("llm.3 with {ops:?}"));
    }
}

/// A run's trace keeps the clock it ran on: a timeline that starts late measures
/// the same costs, link and step.
#[test]
fn a_timeline_that_starts_late_measures_the_same() {
    let (p, t) = run_of("transpose(vision, 1f1b)");
    let cal = measure(&p, &t, Mode::Rendezvous, None).unwrap();
    let late = Timeline {
        ranks: t
            .ranks
            .iter()
            .map(|r| {
                r.iter()
                    .map(|s| Slot {
                        start: s.start + 1000.0,
                        end: s.end + 1000.0,
                    })
                    .collect()
            })
            .collect(),
    };
    let shifted = measure(&p, &late, Mode::Rendezvous, None).unwrap();
    assert_costs_eq(&shifted.apply(&p), &p, 1e-9);
    assert_close(shifted.step, cal.step, 1e-9, "step");
    let (a, b) = (cal.link.unwrap(), shifted.link.unwrap());
    assert_close(b.latency, a.latency, 1e-6, "latency");
    assert_close(b.bandwidth, a.bandwidth, 1e-6, "bandwidth");
    assert_eq!((a.samples, a.sizes), (b.samples, b.sizes));
}

/// A link without latency, and one whose bandwidth is the largest a fit reports.
#[test]
fn the_links_extremes_are_measured() {
    // At the largest bandwidth a transfer's size term is 1e-9 of its latency, so
    // the slope is known only to rounding over that: the bandwidth to 1e-5.
    for (latency, bandwidth, rel) in [
        (0.0, 0.2, 1e-9),
        (0.05, MAX_BANDWIDTH, 1e-5),
        (1e-6, 5.0, 1e-9),
    ] {
        let text = PROFILE
            .replace("latency = 0.01", &format!("latency = {latency:e}"))
            .replace("bandwidth = 0.2", &format!("bandwidth = {bandwidth:e}"));
        let profile = Profile::from_toml_str(&text).unwrap();
        for mode in [Mode::Rendezvous, Mode::Eager] {
            let p = derive(&profile, "transpose(vision, 1f1b)", mode);
            let run = sim(&p, mode, profile.comm_model());
            let cal = measure(&p, &run.timeline, mode, None).unwrap();
            let link = cal.link.unwrap();
            let what = format!("{latency} {bandwidth} {mode:?}: {link:?}");
            assert!(link.latency >= 0.0, "{what}");
            assert!((link.latency - latency).abs() <= 1e-9, "{what}");
            assert_close(link.bandwidth, bandwidth, rel, &what);
            assert!(link.bandwidth <= MAX_BANDWIDTH, "{what}");
            let model = CommModel { latency, bandwidth };
            for size in [0.01, 0.03, 2.0] {
                assert_close(
                    link.model().transfer_time(size),
                    model.transfer_time(size),
                    1e-9,
                    &what,
                );
            }
            let again = sim(&cal.apply(&p), mode, Some(link.model()));
            assert_close(again.makespan, run.makespan, 1e-9, &what);
        }
    }
}

/// Recomputed forwards (`RF`) are samples of the unit's `F`.
#[test]
fn a_recomputed_forward_is_measured_as_the_forward() {
    let profile = profile();
    let p = derive(
        &profile,
        "transpose(vision, 1f1b, backward = central)",
        Mode::Rendezvous,
    );
    let rf: Vec<(usize, usize)> = p
        .programs
        .iter()
        .enumerate()
        .flat_map(|(r, l)| {
            l.iter()
                .enumerate()
                .filter(|(_, a)| matches!(a, Action::RF { .. }))
                .map(move |(i, _)| (r, i))
        })
        .collect();
    let fs = p
        .programs
        .iter()
        .flatten()
        .filter(|a| matches!(a, Action::F { unit, .. } if &**unit == "vision"))
        .count();
    assert_eq!(fs, MICROBATCHES);
    assert!(!rf.is_empty());
    let run = sim(&p, Mode::Rendezvous, profile.comm_model());
    let cal = measure(&p, &run.timeline, Mode::Rendezvous, None).unwrap();
    let f = cal.units["vision"].f.unwrap();
    assert_eq!(f.samples, fs + rf.len());
    assert_close(f.mean, p.units[0].cost.f, 1e-9, "vision F");

    // Make every recompute take 1 longer: the extremes show they are F's samples,
    // and, being fewer than the forwards, they leave the median alone; the mean,
    // which the cost takes, counts them.
    assert!(rf.len() < fs);
    let mut t = run.timeline.clone();
    for &(r, i) in &rf {
        t.ranks[r][i].end += 1.0;
    }
    let cal = measure(&p, &t, Mode::Rendezvous, None).unwrap();
    let f = cal.units["vision"].f.unwrap();
    assert_eq!(f.samples, fs + rf.len());
    assert_close(f.min, p.units[0].cost.f, 1e-9, "min");
    assert_close(f.max, p.units[0].cost.f + 1.0, 1e-9, "max");
    assert_close(f.median, p.units[0].cost.f, 1e-9, "median");
    let n = (fs + rf.len()) as f64;
    let mean = p.units[0].cost.f + rf.len() as f64 / n;
    assert_close(f.mean, mean, 1e-9, "mean");
    assert_close(cal.apply(&p).units[0].cost.f, mean, 1e-9, "F applied");
}

/// A stat's mean, median (of an even count: the mean of the two middle samples),
/// extremes and count; the cost is the mean (a step sums durations).
#[test]
fn the_cost_is_the_mean_of_the_samples() {
    let profile = free_profile();
    let p = derive(&profile, "1f1b", Mode::Rendezvous);
    let mut t = sim(&p, Mode::Rendezvous, None).timeline;
    // F(llm.1, mb) on rank 1, 8 samples: make them 1, 2, ..., 7 and 20 (in an
    // order that is not sorted).
    let durations = [3.0, 1.0, 20.0, 2.0, 7.0, 5.0, 4.0, 6.0];
    let mut k = 0;
    for (a, s) in p.programs[1].iter().zip(&mut t.ranks[1]) {
        if matches!(a, Action::F { unit, .. } if &**unit == "llm.1") {
            s.end = s.start + durations[k];
            k += 1;
        }
    }
    assert_eq!(k, MICROBATCHES);
    let cal = measure(&p, &t, Mode::Rendezvous, None).unwrap();
    let f = cal.units["llm.1"].f.unwrap();
    assert_eq!((f.samples, f.min, f.max), (8, 1.0, 20.0));
    assert_close(f.median, 4.5, 1e-12, "median");
    assert_close(f.mean, 6.0, 1e-12, "mean");
    let i = p.unit_index("llm.1").unwrap();
    assert_close(cal.apply(&p).units[i].cost.f, 6.0, 1e-12, "F applied");
    // The unit's other ops, and the other units, keep what they measured.
    assert_eq!(cal.apply(&p).units[i].cost.b, p.units[i].cost.b);
    assert_costs_eq(
        &Program {
            units: cal.apply(&p).units[..i].to_vec(),
            ..p.clone()
        },
        &Program {
            units: p.units[..i].to_vec(),
            ..p.clone()
        },
        1e-9,
    );
}

// ---- 5. Collectives -----------------------------------------------------------------

/// With the encoder's output the size of the LLM's hidden state, every transfer
/// has one size; the broadcasts and reductions of the encoder's parameters are the
/// second size that separates latency from bandwidth.
#[test]
fn collectives_are_samples_of_the_link() {
    let text = PROFILE.replace("output = 0.01", "output = 0.03");
    let profile = Profile::from_toml_str(&text).unwrap();
    for mode in [Mode::Rendezvous, Mode::Eager] {
        // Without collectives: one size.
        let p = derive(&profile, "1f1b", mode);
        let run = sim(&p, mode, profile.comm_model());
        let link = measure(&p, &run.timeline, mode, None)
            .unwrap()
            .link
            .unwrap();
        assert_eq!(link.sizes, 1, "{mode:?}");

        let p = derive(&profile, "transpose(vision, 1f1b)", mode);
        assert_eq!(transfer_sizes(&p).len(), 1);
        let colls = p
            .programs
            .iter()
            .flatten()
            .filter(|a| matches!(a.view(), ActionRef::Coll(_)))
            .count();
        assert!(colls > 0);
        let run = sim(&p, mode, profile.comm_model());
        let cal = measure(&p, &run.timeline, mode, None).unwrap();
        let link = cal.link.unwrap();
        assert_eq!(link.sizes, 2, "{mode:?}: {link:?}");
        assert_close(link.latency, LATENCY, 1e-9, "latency");
        assert_close(link.bandwidth, BANDWIDTH, 1e-9, "bandwidth");
        let again = sim(&cal.apply(&p), mode, Some(link.model()));
        assert_close(again.makespan, run.makespan, 1e-9, "makespan");
    }
}

// ---- 6. Scaling the profile ---------------------------------------------------------

/// The truth: LLM units (stages, layers, extras) 1.5x, encoder 0.8x the program's.
fn llm_and_encoder(u: &str) -> (f64, f64, f64) {
    match family(u) {
        Some(Family::Encoder(_)) => (0.8, 0.8, 0.8),
        _ => (1.5, 1.5, 1.5),
    }
}

fn check_scaled_profile(expr: &str, by: fn(&str) -> (f64, f64, f64)) -> (Calibration, Program) {
    let a = free_profile();
    let p = derive(&a, expr, Mode::Rendezvous);
    let truth = scaled(&p, by);
    let run = sim(&truth, Mode::Rendezvous, None);
    let cal = measure(&p, &run.timeline, Mode::Rendezvous, None).unwrap();
    assert_costs_eq(&cal.apply(&p), &truth, 1e-9);
    let b = cal.scale_profile(&p, &a);
    // Figures the scales do not touch stay.
    assert_eq!(b.llm.layers, a.llm.layers);
    assert_eq!(b.llm.activation, a.llm.activation);
    assert_eq!(b.llm.params, a.llm.params);
    assert_eq!(b.llm.output, a.llm.output);
    assert_eq!(b.encoders[0].activation, a.encoders[0].activation);
    assert_eq!(b.encoders[0].params, a.encoders[0].params);
    assert_eq!(b.encoders[0].output, a.encoders[0].output);
    assert_eq!(b.link, None);
    // The same expression derived from the scaled profile has the truth's costs
    // (its transfers may sit elsewhere: the lowering times them with the costs).
    let q = derive(&b, expr, Mode::Rendezvous);
    assert_costs_eq(&q, &truth, 1e-9);
    (cal, p)
}

#[test]
fn the_profile_scales_to_the_measured_costs() {
    let a = free_profile();
    for expr in [
        "1f1b",
        "transpose(vision, zbh1)",
        "transpose(vision, 1f1b, backward = central)",
    ] {
        let (cal, p) = check_scaled_profile(expr, llm_and_encoder);
        let b = cal.scale_profile(&p, &a);
        assert_close(b.llm.forward, a.llm.forward * 1.5, 1e-9, "llm F");
        assert_close(b.llm.backward, a.llm.backward * 1.5, 1e-9, "llm B");
        assert_close(b.llm.weight, a.llm.weight * 1.5, 1e-9, "llm W");
        // Scaled figures are rounded to twelve significant digits: exact here.
        assert_eq!(
            (b.llm.forward, b.llm.backward, b.llm.weight),
            (1.5, 1.65, 1.35),
            "{expr}"
        );
        assert_eq!(
            (b.encoders[0].forward, b.encoders[0].backward),
            (0.4, 0.56),
            "{expr}"
        );
        assert_eq!(b.encoders[0].weight, Some(0.24), "{expr}");
        // The extras are inside the stages: the LLM's scale.
        assert_extras_scaled(&a, &b, (1.5, 1.5), (1.5, 1.5, 1.5));
        let (ea, eb) = (&a.encoders[0], &b.encoders[0]);
        assert_close(eb.forward, ea.forward * 0.8, 1e-9, "encoder F");
        assert_close(eb.backward, ea.backward * 0.8, 1e-9, "encoder B");
        assert_close(
            eb.weight.unwrap(),
            ea.weight.unwrap() * 0.8,
            1e-9,
            "encoder W",
        );

        let scales = cal.scales(&p);
        assert_eq!(
            scales.keys().cloned().collect::<Vec<_>>(),
            vec![Family::Llm, Family::Encoder("vision".into())],
            "{expr}"
        );
        for (fam, want) in [(Family::Llm, 1.5), (Family::Encoder("vision".into()), 0.8)] {
            let s = scales[&fam];
            for (op, x) in [("F", s.f), ("B", s.b), ("W", s.w)] {
                assert_close(x.unwrap(), want, 1e-9, &format!("{expr}: {fam} {op}"));
            }
        }
    }
}

/// With layer units the extras are units of their own, scaled by their own family.
#[test]
fn extras_measured_as_their_own_units_scale_by_their_own_ratio() {
    fn by(u: &str) -> (f64, f64, f64) {
        match family(u) {
            Some(Family::Encoder(_)) => (0.8, 0.6, 1.2),
            Some(Family::FirstExtra) => (2.0, 2.0, 3.0),
            Some(Family::LastExtra) => (0.7, 0.9, 0.9),
            _ => (1.5, 1.25, 1.25),
        }
    }
    let a = free_profile();
    // `layers(1f1b)` runs only fused `BW`s: a family whose B and W scale alike
    // (all but the encoder, in `by`) is measured exactly; the encoder's measured
    // split is the program's proportion.
    let p = derive(&a, "layers(1f1b)", Mode::Rendezvous);
    let truth = scaled(&p, by);
    let run = sim(&truth, Mode::Rendezvous, None);
    let cal = measure(&p, &run.timeline, Mode::Rendezvous, None).unwrap();
    let scales = cal.scales(&p);
    assert_eq!(
        scales.keys().cloned().collect::<Vec<_>>(),
        vec![
            Family::Llm,
            Family::FirstExtra,
            Family::LastExtra,
            Family::Encoder("vision".into())
        ]
    );
    let want = |f: Option<f64>, b: Option<f64>, w: Option<f64>| Scale { f, b, w };
    let got = |fam: Family| scales[&fam];
    let near = |s: Scale, t: Scale| {
        let eq = |x: Option<f64>, y: Option<f64>| match (x, y) {
            (Some(x), Some(y)) => close(x, y, 1e-9),
            (None, None) => true,
            _ => false,
        };
        eq(s.f, t.f) && eq(s.b, t.b) && eq(s.w, t.w)
    };
    for (fam, w) in [
        (Family::Llm, want(Some(1.5), Some(1.25), Some(1.25))),
        // The embedding has no B (so no B scale), and its BW is all W.
        (Family::FirstExtra, want(Some(2.0), None, Some(3.0))),
        (Family::LastExtra, want(Some(0.7), Some(0.9), Some(0.9))),
        // The encoder's B and W come from one BW: (0.6 B + 1.2 W) over (B + W),
        // split in the program's proportion.
        (Family::Encoder("vision".into()), {
            let e = &a.encoders[0];
            let (b, w) = (e.backward, e.weight.unwrap());
            let s = (0.6 * b + 1.2 * w) / (b + w);
            want(Some(0.8), Some(s), Some(s))
        }),
    ] {
        assert!(
            near(got(fam.clone()), w),
            "{fam}: {:?} vs {w:?}",
            got(fam.clone())
        );
    }
    let b = cal.scale_profile(&p, &a);
    assert_extras_scaled(&a, &b, (2.0, 3.0), (0.7, 0.9, 0.9));
    assert_close(b.llm.forward, a.llm.forward * 1.5, 1e-9, "llm F");
    assert_close(b.llm.backward, a.llm.backward * 1.25, 1e-9, "llm B");
    assert_close(b.llm.weight, a.llm.weight * 1.25, 1e-9, "llm W");
    // Derived again: the truth wherever the truth kept the program's B : W.
    let q = derive(&b, "layers(1f1b)", Mode::Rendezvous);
    for (u, t) in q.units.iter().zip(&truth.units) {
        assert_eq!(u.name, t.name);
        assert_close(u.cost.f, t.cost.f, 1e-9, &u.name);
        assert_close(u.cost.b + u.cost.w, t.cost.b + t.cost.w, 1e-9, &u.name);
        if family(&u.name) != Some(Family::Encoder("vision".into())) {
            assert_cost_close(&u.cost, &t.cost, 1e-9, &u.name);
        }
    }
}

/// A frozen encoder runs only forwards: only its forward scales.
#[test]
fn a_frozen_encoder_scales_only_its_forward() {
    let text = PROFILE.replace("trainable = true", "trainable = false");
    let (head, _) = text.split_once("[link]").unwrap();
    let a = Profile::from_toml_str(head).unwrap();
    let p = derive(&a, "1f1b", Mode::Rendezvous);
    // (Its backward never runs, so no run can tell it.)
    let truth = scaled(&p, |u| match family(u) {
        Some(Family::Encoder(_)) => (0.8, 1.0, 1.0),
        _ => (1.5, 1.5, 1.5),
    });
    let run = sim(&truth, Mode::Rendezvous, None);
    let cal = measure(&p, &run.timeline, Mode::Rendezvous, None).unwrap();
    let m = cal.units["vision"];
    assert!(m.f.is_some() && m.b.is_none() && m.w.is_none() && m.bw.is_none());
    let s = cal.scales(&p)[&Family::Encoder("vision".into())];
    assert_close(s.f.unwrap(), 0.8, 1e-9, "encoder F");
    assert_eq!((s.b, s.w), (None, None));
    let b = cal.scale_profile(&p, &a);
    let (ea, eb) = (&a.encoders[0], &b.encoders[0]);
    assert_close(eb.forward, ea.forward * 0.8, 1e-9, "encoder F");
    assert_eq!((eb.backward, eb.weight), (ea.backward, ea.weight));
    assert_close(b.llm.forward, a.llm.forward * 1.5, 1e-9, "llm F");
    assert_costs_eq(&derive(&b, "1f1b", Mode::Rendezvous), &truth, 1e-9);
}

/// The fitted link replaces the profile's.
#[test]
fn the_scaled_profile_carries_the_fitted_link() {
    let text = PROFILE
        .replace("latency = 0.01", "latency = 0.02")
        .replace("bandwidth = 0.2", "bandwidth = 0.5");
    let truth_profile = Profile::from_toml_str(&text).unwrap();
    let a = profile();
    let p = derive(&a, "transpose(vision, 1f1b)", Mode::Rendezvous);
    let run = sim(&p, Mode::Rendezvous, truth_profile.comm_model());
    let cal = measure(&p, &run.timeline, Mode::Rendezvous, a.comm_model()).unwrap();
    let b = cal.scale_profile(&p, &a);
    // Twelve significant digits: the figures read as written, not 0.49999999999999994.
    let link = b.link.clone().unwrap();
    assert_eq!((link.latency, link.bandwidth), (0.02, 0.5));
    // The costs were right: unchanged, to the last digit.
    assert_eq!(b.llm, a.llm);
    assert_eq!(b.encoders, a.encoders);
    assert_eq!(b.memory, a.memory);
}

#[test]
fn families_of_unit_names() {
    for (name, fam) in [
        ("llm", Some(Family::Llm)),
        ("llm.3", Some(Family::Llm)),
        ("llm/12", Some(Family::Llm)),
        ("llm/first_stage_extra", Some(Family::FirstExtra)),
        ("llm/last_stage_extra", Some(Family::LastExtra)),
        ("vision", Some(Family::Encoder("vision".into()))),
        ("vision.1", Some(Family::Encoder("vision".into()))),
        ("audio/7", Some(Family::Encoder("audio".into()))),
        ("", None),
        ("/x", None),
    ] {
        assert_eq!(family(name), fam, "{name:?}");
    }
}

// ---- 7. Errors ----------------------------------------------------------------------

fn run_of(expr: &str) -> (Program, Timeline) {
    let profile = profile();
    let p = derive(&profile, expr, Mode::Rendezvous);
    let t = sim(&p, Mode::Rendezvous, profile.comm_model()).timeline;
    (p, t)
}

#[test]
fn a_timeline_of_another_shape_is_a_typed_error() {
    let (p, t) = run_of("transpose(vision, 1f1b)");
    let m = |t: &Timeline| measure(&p, t, Mode::Rendezvous, None);

    let mut fewer = t.clone();
    fewer.ranks.pop();
    assert_eq!(
        m(&fewer),
        Err(CalibrateError::Ranks {
            timeline: 3,
            program: 4
        })
    );
    let mut more = t.clone();
    more.ranks.push(Vec::new());
    assert_eq!(
        m(&more),
        Err(CalibrateError::Ranks {
            timeline: 5,
            program: 4
        })
    );

    let mut short = t.clone();
    short.ranks[2].pop();
    assert_eq!(
        m(&short),
        Err(CalibrateError::Actions {
            rank: 2,
            timeline: p.programs[2].len() - 1,
            program: p.programs[2].len(),
        })
    );

    let mut nan = t.clone();
    nan.ranks[1][5].start = f64::NAN;
    match m(&nan) {
        Err(CalibrateError::BadSlot {
            rank: 1,
            index: 5,
            start,
            end,
        }) => {
            assert!(start.is_nan());
            assert_eq!(end, t.ranks[1][5].end);
        }
        other => panic!("{other:?}"),
    }
    let mut reversed = t.clone();
    reversed.ranks[3][2] = Slot {
        start: 5.0,
        end: 4.0,
    };
    assert_eq!(
        m(&reversed),
        Err(CalibrateError::BadSlot {
            rank: 3,
            index: 2,
            start: 5.0,
            end: 4.0
        })
    );
    let mut infinite = t.clone();
    infinite.ranks[0][0].end = f64::INFINITY;
    assert!(matches!(
        m(&infinite),
        Err(CalibrateError::BadSlot {
            rank: 0,
            index: 0,
            ..
        })
    ));

    // The timeline of another program of the same ranks.
    let (_, other) = run_of("transpose(vision, zbh1)");
    assert!(matches!(m(&other), Err(CalibrateError::Actions { .. })));
    // Messages say what to do.
    assert!(m(&fewer)
        .unwrap_err()
        .to_string()
        .contains("measure the trace of this program's run"));
}

#[test]
fn a_program_without_compute_is_a_typed_error() {
    let unit = Unit {
        role: mpipe_core::program::Role::of_name("a"),
        name: "a".into(),
        inputs: vec![],
        home: 0,
        trainable: false,
        cost: Cost {
            f: 1.0,
            b: 0.0,
            w: 0.0,
        },
        act: 0.0,
        bytes: 1.0,
        params: 0.0,
    };
    let p = Program {
        format: FORMAT.to_string(),
        ranks: 2,
        microbatches: 1,
        units: vec![unit],
        programs: vec![
            vec![Action::p2p(Dir::Send, Tensor::Input, "a", 0, 1, None)],
            vec![Action::p2p(Dir::Recv, Tensor::Input, "a", 0, 0, None)],
        ],
        source: None,
        prefetch: vec![],
    };
    let comm = Some(CommModel {
        latency: 0.5,
        bandwidth: 2.0,
    });
    for mode in [Mode::Rendezvous, Mode::Eager] {
        let t = sim(&p, mode, comm).timeline;
        assert_eq!(
            measure(&p, &t, mode, None),
            Err(CalibrateError::Empty),
            "{mode:?}"
        );
    }
    let empty = Program {
        ranks: 1,
        units: vec![],
        programs: vec![vec![]],
        ..p
    };
    let t = Timeline {
        ranks: vec![vec![]],
    };
    assert_eq!(
        measure(&empty, &t, Mode::Rendezvous, None),
        Err(CalibrateError::Empty)
    );
}

/// The trace's JSON, and the index and rank of the complete event named `name`.
fn find_event(v: &Value, name: &str) -> (usize, u64) {
    let ev = v["traceEvents"].as_array().unwrap();
    let i = ev
        .iter()
        .position(|e| e["ph"] == "X" && e["name"] == name)
        .unwrap_or_else(|| panic!("no event {name}"));
    (i, ev[i]["tid"].as_u64().unwrap())
}

#[test]
fn a_trace_that_does_not_fit_the_program_is_a_typed_error() {
    let (p, t) = run_of("transpose(vision, 1f1b)");
    let text = chrome_trace(&p, &t, &trace_opts(1000.0));
    let read = |s: &str| timeline_from_trace(&p, s, 1000.0);
    assert!(read(&text).is_ok());

    assert!(matches!(read("not json"), Err(TraceReadError::Json(_))));
    assert!(matches!(read(""), Err(TraceReadError::Json(_))));
    assert!(matches!(
        embedded_program("{\"traceEvents\":"),
        Err(TraceReadError::Json(_))
    ));
    assert_eq!(read("{}"), Err(TraceReadError::NoEvents));
    assert_eq!(read("[]"), Err(TraceReadError::NoEvents));
    assert_eq!(read("{\"traceEvents\": 3}"), Err(TraceReadError::NoEvents));
    // No events at all: the first action of rank 0 is missing.
    assert_eq!(
        read("{\"traceEvents\": []}"),
        Err(TraceReadError::Missing {
            rank: 0,
            index: 0,
            action: p.programs[0][0].to_string(),
        })
    );

    let v: Value = serde_json::from_str(&text).unwrap();
    let with = |f: &dyn Fn(&mut Vec<Value>)| {
        let mut v = v.clone();
        f(v["traceEvents"].as_array_mut().unwrap());
        v.to_string()
    };

    // An event on a track that is no rank of the program.
    let n = v["traceEvents"].as_array().unwrap().len();
    let beyond = with(&|ev| {
        ev.push(json!({"ph": "X", "pid": 1, "tid": 4, "name": "F llm.0 mb0", "ts": 0, "dur": 1}))
    });
    assert!(
        matches!(read(&beyond), Err(TraceReadError::Event { index, ref what }) if index == n && what.contains("`tid` 4")),
        "{:?}",
        read(&beyond)
    );
    // Events of other phases on such a track are ignored.
    let counter = with(&|ev| ev.push(json!({"ph": "C", "pid": 1, "tid": 9, "name": "x", "ts": 0})));
    assert_eq!(read(&counter).unwrap(), read(&text).unwrap());
    // A complete event without a rank, a name or times; a negative duration.
    for (what, e) in [
        (
            "tid",
            json!({"ph": "X", "name": "F llm.0 mb0", "ts": 0, "dur": 1}),
        ),
        ("name", json!({"ph": "X", "tid": 0, "ts": 0, "dur": 1})),
        (
            "ts",
            json!({"ph": "X", "tid": 0, "name": "F llm.0 mb0", "dur": 1}),
        ),
        (
            "dur",
            json!({"ph": "X", "tid": 0, "name": "F llm.0 mb0", "ts": 0, "dur": -1}),
        ),
        (
            "dur",
            json!({"ph": "X", "tid": -1, "name": "F llm.0 mb0", "ts": 0, "dur": 1}),
        ),
    ] {
        let bad = with(&|ev| ev.insert(3, e.clone()));
        assert!(
            matches!(read(&bad), Err(TraceReadError::Event { index: 3, .. })),
            "{what}: {:?}",
            read(&bad)
        );
    }
    // The 4-rank trace read as a 2-rank program's.
    let two = derive_str(&Request::new(&profile(), 2, 4), "transpose(vision, 1f1b)")
        .unwrap()
        .program;
    assert!(matches!(
        timeline_from_trace(&two, &text, 1000.0),
        Err(TraceReadError::Event { .. })
    ));

    // One action's event missing: F(llm.1, 3), the only one of its name on rank 1.
    let name = "F llm.1 mb3";
    let (i, tid) = find_event(&v, name);
    assert_eq!(tid, 1);
    let index = p.programs[1]
        .iter()
        .position(|a| matches!(a, Action::F { unit, mb: 3 } if &**unit == "llm.1"))
        .unwrap();
    let missing = with(&|ev| {
        ev.remove(i);
    });
    assert_eq!(
        read(&missing),
        Err(TraceReadError::Missing {
            rank: 1,
            index,
            action: "F(llm.1,3)".to_string(),
        })
    );
    assert!(read(&missing)
        .unwrap_err()
        .to_string()
        .contains("give the trace of this program's run"));

    // One event too many.
    let (i, tid) = find_event(&v, "F llm.2 mb0");
    let extra = with(&|ev| {
        let e = ev[i].clone();
        ev.push(e);
    });
    assert_eq!(
        read(&extra),
        Err(TraceReadError::Extra {
            rank: tid as usize,
            count: 1,
            name: "F llm.2 mb0".to_string(),
        })
    );
    // An event of a name no action has.
    let stranger =
        with(&|ev| ev.push(json!({"ph": "X", "tid": 3, "name": "F audio mb0", "ts": 0, "dur": 1})));
    assert_eq!(
        read(&stranger),
        Err(TraceReadError::Extra {
            rank: 3,
            count: 1,
            name: "F audio mb0".to_string(),
        })
    );
    // The trace of another program with the same ranks.
    let (q, u) = run_of("transpose(vision, zbh1)");
    let other = chrome_trace(&q, &u, &trace_opts(1000.0));
    assert!(matches!(
        read(&other),
        Err(TraceReadError::Missing { .. } | TraceReadError::Extra { .. })
    ));
}

#[test]
fn a_trace_without_a_readable_program_is_a_typed_error() {
    let (p, t) = run_of("1f1b");
    let plain = chrome_trace(&p, &t, &TraceOptions::default());
    assert_eq!(embedded_program(&plain), Err(TraceReadError::NoProgram));
    assert_eq!(
        embedded_program("{\"traceEvents\": [], \"mpipe\": {}}"),
        Err(TraceReadError::NoProgram)
    );
    assert_eq!(embedded_program("[1, 2]"), Err(TraceReadError::NoProgram));
    for garbage in [
        "{\"traceEvents\": [], \"mpipe\": {\"program\": 42}}",
        "{\"traceEvents\": [], \"mpipe\": {\"program\": {\"format\": \"mpipe-program/1\"}}}",
        "{\"mpipe\": {\"program\": \"1f1b\"}}",
    ] {
        assert!(
            matches!(embedded_program(garbage), Err(TraceReadError::Program(_))),
            "{garbage}: {:?}",
            embedded_program(garbage)
        );
    }
    // A real embedded program with one field broken.
    let text = chrome_trace(&p, &t, &trace_opts(1000.0));
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["mpipe"]["program"]["ranks"] = json!("four");
    assert!(matches!(
        embedded_program(&v.to_string()),
        Err(TraceReadError::Program(_))
    ));
}

// ---- 8. Random costs ------------------------------------------------------------------

const EXPRS: [&str; 3] = [
    "transpose(vision, 1f1b)",
    "transpose(vision, zbh1)",
    "layers(1f1b)",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The run of a program whose true costs are its own times random factors, per
    /// family and op, is measured back as those costs (a fused `BW` as its sum, in
    /// the program's proportion), with the link, and the calibrated program
    /// simulates to the run's step.
    #[test]
    fn random_true_costs_are_measured_back(
        which in 0..EXPRS.len(),
        eager in any::<bool>(),
        llm in prop::array::uniform3(0.1f64..10.0),
        enc in prop::array::uniform3(0.1f64..10.0),
        extras in prop::array::uniform3(0.1f64..10.0),
    ) {
        let expr = EXPRS[which];
        let mode = if eager { Mode::Eager } else { Mode::Rendezvous };
        let profile = profile();
        let p = derive(&profile, expr, mode);
        let truth = scaled(&p, |u| {
            let k = match family(u) {
                Some(Family::Encoder(_)) => enc,
                Some(Family::FirstExtra | Family::LastExtra) => extras,
                _ => llm,
            };
            (k[0], k[1], k[2])
        });
        let run = sim(&truth, mode, profile.comm_model());
        // The prior's bandwidth is the true one, its latency is not: with one size
        // sampled, the latency is still measured.
        let prior = CommModel { latency: 3.0, bandwidth: BANDWIDTH };
        let cal = measure(&p, &run.timeline, mode, Some(prior)).unwrap();
        let got = cal.apply(&p);
        let counts = op_counts(&p);
        for ((g, t), orig) in got.units.iter().zip(&truth.units).zip(&p.units) {
            prop_assert!(close(g.cost.f, t.cost.f, 1e-9), "{expr} {}: F {} vs {}", g.name, g.cost.f, t.cost.f);
            if counts.contains_key(&(g.name.clone(), Op::B)) {
                prop_assert!(close(g.cost.b, t.cost.b, 1e-9), "{expr} {}: B", g.name);
                prop_assert!(close(g.cost.w, t.cost.w, 1e-9), "{expr} {}: W", g.name);
            } else {
                prop_assert!(
                    close(g.cost.b + g.cost.w, t.cost.b + t.cost.w, 1e-9),
                    "{expr} {}: B + W {} vs {}", g.name, g.cost.b + g.cost.w, t.cost.b + t.cost.w
                );
                prop_assert!(
                    close(g.cost.b * orig.cost.w, g.cost.w * orig.cost.b, 1e-9),
                    "{expr} {}: B : W", g.name
                );
            }
        }
        let link = cal.link.unwrap();
        prop_assert!(close(link.latency, LATENCY, 1e-9), "{expr} {mode:?}: {link:?}");
        prop_assert!(close(link.bandwidth, BANDWIDTH, 1e-9), "{expr} {mode:?}: {link:?}");
        prop_assert!(close(cal.step, run.makespan, 1e-9));
        let again = sim(&got, mode, Some(link.model()));
        prop_assert!(
            close(again.makespan, run.makespan, 1e-9),
            "{expr} {mode:?}: {} vs {}", again.makespan, run.makespan
        );
    }
}
