//! Units must not matter (issue 35 item 8, the one tolerance rule): a profile whose
//! times and sizes are all a millionth of another's (costs in seconds instead of
//! microseconds, memory in terabytes instead of megabytes) derives the same
//! schedule: the same actions in the same order on every rank, every time scaled by
//! the same factor. A slack that is an absolute time or size in the profile's unit
//! (`x + 1e-9`, `1e-9 * x.max(1.0)`, a least gain of `1e-3`) breaks this: below 1 it
//! is a large share of the figures it compares.

use mpipe_core::derive::{derive_str, Derived, Request};
use mpipe_core::profile::{Extra, Profile};
use mpipe_core::program::{Action, ActionRef, Program};
use mpipe_core::simulate::Mode;

/// `p` with every time (costs, latency) and every size (activations, parameters,
/// outputs, the memory limit) multiplied by `s`; the bandwidth, a size per time,
/// is unchanged, so every transfer's time scales by `s` too.
fn scaled(p: &Profile, s: f64) -> Profile {
    let mut q = p.clone();
    let extra = |x: &mut Option<Extra>| {
        if let Some(x) = x {
            x.forward *= s;
            x.backward *= s;
            x.weight *= s;
            x.activation *= s;
            x.params *= s;
        }
    };
    for e in &mut q.encoders {
        e.forward *= s;
        e.backward *= s;
        e.weight = e.weight.map(|w| w * s);
        e.activation *= s;
        e.params *= s;
        e.output *= s;
    }
    let l = &mut q.llm;
    l.forward *= s;
    l.backward *= s;
    l.weight *= s;
    l.activation *= s;
    l.params *= s;
    l.output *= s;
    extra(&mut l.first_stage_extra);
    extra(&mut l.last_stage_extra);
    if let Some(m) = &mut q.memory {
        m.limit *= s;
    }
    if let Some(link) = &mut q.link {
        link.latency *= s;
    }
    q
}

fn derived(p: &Profile, ranks: usize, mbs: usize, mode: Mode, expr: &str) -> Derived {
    let mut req = Request::new(p, ranks, mbs);
    req.mode = mode;
    derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr}: {e:?}"))
}

/// Rank `r`'s compute actions, in order (transfers left out).
fn computes(program: &Program, r: usize) -> Vec<&Action> {
    program.programs[r]
        .iter()
        .filter(|a| matches!(a.view(), ActionRef::Compute(_)))
        .collect()
}

/// Derives every expression on `profile` and on it scaled by each factor, and
/// checks that the schedules are the same with every time scaled (to rounding).
///
/// Scaled by a power of two, every sum is scaled exactly, so any difference at all
/// is a slack in the profile's unit: the programs must be identical, transfers
/// included. Scaled by a millionth (or a million), sums round differently; the one
/// tolerance rule absorbs that in every choice between programs, so the compute
/// order must be the same on every rank. Where transfers sit may differ between
/// equally fast programs: the transfer moves of a local search take any exact
/// gain (`Score::improves`, on purpose), and a gain of one rounding error is
/// not the same gain in another unit. For the same reason `refine`'s weight
/// gradient moves may climb another way: expressions written with `refine` are
/// checked at exact scales only (`2^-20`, `2^20`).
fn same_schedules(name: &str, profile: &Profile, ranks: usize, mbs: usize, exprs: &[&str]) {
    let mut failures = Vec::new();
    for mode in [Mode::Rendezvous, Mode::Eager] {
        for expr in exprs {
            let a = derived(profile, ranks, mbs, mode, expr);
            let scales: &[(f64, bool)] = if expr.contains("refine(") {
                &[(2f64.powi(-20), true), (2f64.powi(20), true)]
            } else {
                &[(2f64.powi(-20), true), (1e-6, false), (1e6, false)]
            };
            for &(s, exact) in scales {
                let q = scaled(profile, s);
                let b = derived(&q, ranks, mbs, mode, expr);
                let what = format!("{name} {ranks}x{mbs} {mode:?} {expr} scaled by {s:e}");
                let (ta, tb) = (a.report.makespan, b.report.makespan);
                if b.expr != a.expr {
                    failures.push(format!("{what}: another expression {}", b.expr));
                }
                for r in 0..ranks {
                    let (x, y) = if exact {
                        (
                            a.program.programs[r].iter().collect(),
                            b.program.programs[r].iter().collect(),
                        )
                    } else {
                        (computes(&a.program, r), computes(&b.program, r))
                    };
                    if x != y {
                        let at = x.iter().zip(&y).position(|(u, v)| u != v);
                        failures.push(format!(
                            "{what}: rank {r}'s actions differ (lengths {} and {}, first at \
                             {at:?}: {:?} / {:?}; makespans {ta} and {} / {s:e})",
                            x.len(),
                            y.len(),
                            at.map(|i| x[i]),
                            at.map(|i| y[i]),
                            tb / s
                        ));
                        break;
                    }
                }
                if b.program.prefetch != a.program.prefetch {
                    failures.push(format!("{what}: prefetch differs"));
                }
                if ((tb / s - ta) / ta).abs() >= 1e-9 {
                    failures.push(format!("{what}: makespan {tb} is not {s:e} x {ta}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn shipped(file: &str) -> Profile {
    let text = std::fs::read_to_string(format!("{}/../{file}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    Profile::from_toml_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Qwen2-VL-7B (ms and GB, with a link and a memory limit): the bodies, the
/// encoder operators (transpose, fill, chain, host), layers, the ramp split, zbv's
/// memory budget, split_w, balance and refine, including the order search.
#[test]
fn a_millionth_of_qwen2vl_derives_the_same_schedules() {
    let p = shipped("profiles/qwen2vl-7b.toml");
    same_schedules(
        "qwen2vl-7b",
        &p,
        4,
        8,
        &[
            "1f1b",
            "zbh1",
            "zbv",
            "zb2p",
            "zb2p(encoders = ramp)",
            "zb2p(v = 2, encoders = ramp)",
            "split_w(1f1b)",
            "balance(zbh1)",
            "transpose(vision, zbv)",
            "transpose(vision, zbh1, owners = spare)",
            "transpose(vision, 1f1b, owners = min)",
            "fill(vision, zbv)",
            "fill(vision, 1f1b)",
            "chain(vision, 1f1b)",
            "host(vision, zbv)",
            "layers(zbh1)",
            "layers(transpose(vision, zbh1))",
            "refine(zbh1)",
            "refine(transpose(vision, zbv), order = 100)",
        ],
    );
}

/// The encoder-heavy profile (no link, no memory limit), and it with a memory
/// limit that binds zbv's in-flight budget and a link.
#[test]
fn a_millionth_of_encoder_heavy_derives_the_same_schedules() {
    let mut p = shipped("profiles/encoder-heavy.toml");
    let exprs = [
        "zbv",
        "transpose(vision, zbv)",
        "transpose(vision, 1f1b, owners = spare)",
        "fill(vision, zbv)",
        "fill(vision, 1f1b)",
        "layers(zbh1)",
        "refine(layers(zb2p(costs = unit, encoders = ramp)))",
        "auto",
    ];
    same_schedules("encoder-heavy", &p, 4, 4, &exprs);
    p.link = Some(mpipe_core::profile::LinkProfile {
        latency: 0.25,
        bandwidth: 2.0,
    });
    p.llm.output = 0.5;
    p.encoders[0].output = 0.25;
    same_schedules("encoder-heavy with a link", &p, 4, 8, &exprs[..7]);
}
