//! Every body generator reproduces its paper's closed form under uniform costs.
//!
//! GPipe, 1F1B and ZB-H1 reach it in the rendezvous simulation of the *derived*
//! program (communication included). The closed forms of interleaved 1F1B, ZB-V and
//! DualPipeV are stated, like in their papers, for asynchronous communication: they
//! hold exactly in the eager simulation of the program lowered with
//! [`Placement::Ready`]; strict rendezvous costs these schedules a little more
//! (neighbours are not in lock-step), which the last test bounds from below.
//!
//! Uniform costs: each full stage (all chunks of one rank) costs F = B = W = 1 and
//! keeps 1 unit of activation per micro-batch; a chunk of `v` costs `1/v` of that.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::expr::parse_str;
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::lower::{lower_with, Placement};
use mpipe_core::profile::Profile;
use mpipe_core::simulate::{simulate, Mode, SimOptions};

/// LLM with `p * v` layers, one per chunk, costs `1/v` each, activation `1/v`.
fn uniform(p: usize, v: usize, f: f64, b: f64, w: f64) -> Profile {
    let c = 1.0 / v as f64;
    Profile::from_toml_str(&format!(
        "[llm]\nlayers = {}\nforward = {}\nbackward = {}\nweight = {}\nactivation = {c}\n",
        p * v,
        f * c,
        b * c,
        w * c
    ))
    .unwrap()
}

struct Figures {
    makespan: f64,
    peaks: Vec<f64>,
}

fn run(profile: &Profile, p: usize, m: usize, expr: &str) -> Figures {
    let req = Request::new(profile, p, m);
    let d = derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr} p={p} m={m}: {e:?}"));
    Figures {
        makespan: d.report.makespan,
        peaks: d.report.peak_memory,
    }
}

/// Eager simulation of the plan lowered with ready-time placement.
fn run_eager(profile: &Profile, p: usize, m: usize, kind: BodyKind) -> Figures {
    let plan = generate(kind, profile, p, m).unwrap();
    let program = lower_with(&plan, None, Placement::Ready).unwrap();
    assert!(mpipe_core::verify::verify(&program).is_empty());
    let r = simulate(
        &program,
        &SimOptions {
            mode: Mode::Eager,
            comm: None,
        },
    )
    .unwrap();
    Figures {
        makespan: r.makespan,
        peaks: r.peak_memory,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * (1.0 + b.abs())
}

const SIZES: [(usize, usize); 6] = [(2, 4), (4, 4), (4, 8), (4, 16), (8, 32), (6, 12)];

#[test]
fn gpipe_makespan_and_memory() {
    for (p, m) in SIZES {
        let f = run(&uniform(p, 1, 1.0, 1.0, 1.0), p, m, "gpipe");
        assert!(
            close(f.makespan, ((m + p - 1) * 3) as f64),
            "p={p} m={m}: {}",
            f.makespan
        );
        for peak in &f.peaks {
            assert!(close(*peak, m as f64));
        }
    }
}

#[test]
fn one_f_one_b_makespan_and_memory() {
    for (p, m) in SIZES {
        for (fc, bc, wc) in [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (0.7, 1.3, 1.1)] {
            let f = run(&uniform(p, 1, fc, bc, wc), p, m, "1f1b");
            let want = (m + p - 1) as f64 * (fc + bc + wc);
            assert!(
                close(f.makespan, want),
                "p={p} m={m}: {} != {want}",
                f.makespan
            );
            for (r, peak) in f.peaks.iter().enumerate() {
                assert!(
                    close(*peak, (p - r).min(m) as f64),
                    "p={p} m={m} rank {r}: peak {peak}"
                );
            }
        }
    }
}

#[test]
fn interleaved_bubble_is_one_vth_of_1f1b() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 32), (4, 4)] {
        for v in [2, 3] {
            let f = run_eager(
                &uniform(p, v, 1.0, 1.0, 1.0),
                p,
                m,
                BodyKind::Interleaved { v },
            );
            let want = 3.0 * m as f64 + (p - 1) as f64 * 3.0 / v as f64;
            assert!(
                close(f.makespan, want),
                "p={p} m={m} v={v}: {} != {want}",
                f.makespan
            );
            for (r, peak) in f.peaks.iter().enumerate() {
                let warm = if m == p {
                    m * v
                } else {
                    ((p - r - 1) * 2 + (v - 1) * p).min(m * v)
                };
                let want = ((warm + 1).min(m * v)) as f64 / v as f64;
                assert!(
                    close(*peak, want),
                    "p={p} m={m} v={v} rank {r}: peak {peak} != {want}"
                );
            }
        }
    }
}

#[test]
fn zbh1_bubble_is_f_plus_b_minus_w() {
    for (p, m) in SIZES {
        for (fc, bc, wc) in [(1.0, 1.0, 1.0), (1.0, 1.5, 0.8)] {
            let f = run(&uniform(p, 1, fc, bc, wc), p, m, "zbh1");
            let want = m as f64 * (fc + bc + wc) + (p - 1) as f64 * (fc + bc - wc);
            assert!(
                close(f.makespan, want),
                "p={p} m={m}: {} != {want}",
                f.makespan
            );
            let worst = f.peaks.iter().copied().fold(0.0, f64::max);
            assert!(
                close(worst, p.min(m) as f64),
                "p={p} m={m}: worst peak {worst}"
            );
        }
    }
}

/// In the V layout the middle rank cannot start before `p - 1` chunk forwards and
/// then has `m (F + B + W)` of work: `m (F+B+W) + (p-1) F/2` is the least makespan,
/// and ZB-V and DualPipeV reach it under uniform costs. ZB-V keeps 1F1B's memory
/// (`p` stages' activations); DualPipeV one chunk more (`2p + 1` chunks), as in
/// DeepSeek's DualPipe.
#[test]
fn v_schedules_reach_the_v_layout_optimum() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 32), (3, 6)] {
        for body in [BodyKind::ZbV, BodyKind::DualPipeV] {
            let f = run_eager(&uniform(p, 2, 1.0, 1.0, 1.0), p, m, body);
            let want = 3.0 * m as f64 + (p - 1) as f64 * 0.5;
            assert!(
                close(f.makespan, want),
                "{body:?} p={p} m={m}: {} != {want}",
                f.makespan
            );
            let worst = f.peaks.iter().copied().fold(0.0, f64::max);
            let limit = if body == BodyKind::ZbV {
                p as f64
            } else {
                p as f64 + 0.5
            };
            assert!(
                worst <= limit + 1e-9,
                "{body:?} p={p} m={m}: worst peak {worst}"
            );
        }
    }
}

/// Under rendezvous the derived program can only be slower than the asynchronous
/// closed form, never faster; and the derivation is never slower than the plain
/// ready-time lowering (it keeps the better of the two placements).
#[test]
fn rendezvous_is_bounded_by_the_closed_form() {
    for (p, m) in [(2, 4), (4, 8), (8, 32)] {
        for (expr, v) in [("interleaved(v = 2)", 2), ("zbv", 2), ("dualpipev", 2)] {
            let prof = uniform(p, v, 1.0, 1.0, 1.0);
            let derived = run(&prof, p, m, expr);
            let kind = match expr {
                "zbv" => BodyKind::ZbV,
                "dualpipev" => BodyKind::DualPipeV,
                _ => BodyKind::Interleaved { v: 2 },
            };
            let closed = run_eager(&prof, p, m, kind).makespan;
            assert!(derived.makespan >= closed - 1e-9, "{expr} p={p} m={m}");
            let plan = generate(kind, &prof, p, m).unwrap();
            let ready = lower_with(&plan, None, Placement::Ready).unwrap();
            let ready = simulate(&ready, &SimOptions::default()).unwrap().makespan;
            assert!(
                derived.makespan <= ready + 1e-9,
                "{expr} p={p} m={m}: {} > {ready}",
                derived.makespan
            );
            assert!(parse_str(expr).is_ok());
        }
    }
}
