//! The runtime's memory plan against the simulator's memory prediction (issue 34,
//! "peak device memory is reported and compared with the simulator's prediction").
//!
//! For every schedule the toy model runs, over several world sizes and micro-batch
//! counts, each rank's stash plan ([`arena::plan_stash`]: what each forward keeps for
//! its backward, sized by the unit's `act`) must have a live peak equal to the
//! simulator's `peak_memory` of that rank in the same units, whatever the timing
//! semantics (the peak is a property of each rank's order, not of its times), and an
//! arena that first fit lays out in exactly that many bytes when all stashes have one
//! size. The transfer buffers of [`arena::plan`] that hold a locally stashed unit's
//! output live inside that stash (they are not extra memory the simulator misses).

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::Program;
use mpipe_core::simulate::{simulate, CommModel, Mode, SimOptions};
use mpipe_runtime::arena::{self, Kind, Plan, ALIGN};

const SCHEDULES: [&str; 7] = [
    "1f1b",
    "gpipe",
    "zbh1",
    "zbv",
    "interleaved(v = 2)",
    "transpose(vision, 1f1b)",
    "transpose(vision, zbv)",
];

/// (ranks, micro-batches)
const SHAPES: [(usize, usize); 4] = [(2, 4), (4, 4), (4, 8), (4, 12)];

/// Elements of f32 in one [`ALIGN`] unit: one unit of the profile's `activation`.
const ELEMS_PER_UNIT: usize = ALIGN / 4;

fn program(expr: &str, ranks: usize, mbs: usize) -> Program {
    // Positive, unequal costs: the argument that the peak does not depend on timing
    // needs compute of positive duration, and unequal costs move the times around.
    let prof = Profile::from_toml_str(
        "[llm]\nlayers = 8\nforward = 1.0\nbackward = 2.0\nweight = 0.7\nactivation = 1.0\n\
         params = 0.1\n[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 1.3\n\
         backward = 2.1\nweight = 0.9\nactivation = 1.0\nparams = 0.1\ntrainable = true\n",
    )
    .expect("profile");
    derive_str(&Request::new(&prof, ranks, mbs), expr)
        .unwrap_or_else(|e| panic!("{expr} on {ranks} x {mbs}: {e:?}"))
        .program
}

fn options() -> [SimOptions; 3] {
    let link = CommModel {
        latency: 0.3,
        bandwidth: 2.0,
    };
    [
        SimOptions::default(),
        SimOptions {
            mode: Mode::Eager,
            comm: None,
        },
        SimOptions {
            mode: Mode::Rendezvous,
            comm: Some(link),
        },
    ]
}

/// Buffers live at once never share a byte, and every buffer is inside the arena.
fn assert_sound(p: &Plan, what: &str) {
    for (i, a) in p.buffers.iter().enumerate() {
        assert_eq!(a.offset % ALIGN, 0, "{what}");
        assert!(
            a.offset + a.bytes() <= p.size,
            "{what}: {a:?} outside the arena"
        );
        for b in &p.buffers[i + 1..] {
            if a.first <= b.last && b.first <= a.last {
                let apart = a.offset + a.bytes() <= b.offset || b.offset + b.bytes() <= a.offset;
                assert!(
                    apart,
                    "{what}: {a:?} and {b:?} are live together and share bytes"
                );
            }
        }
    }
}

/// `act(u)` whole units per unit; the stash of unit `u` is `act(u)` ALIGN-sized blocks.
fn check(expr: &str, ranks: usize, mbs: usize, act: impl Fn(usize) -> usize) {
    let mut prog = program(expr, ranks, mbs);
    for (u, unit) in prog.units.iter_mut().enumerate() {
        unit.act = act(u) as f64;
    }
    let lens: Vec<usize> = (0..prog.units.len())
        .map(|u| act(u) * ELEMS_PER_UNIT)
        .collect();
    let uniform = (0..prog.units.len()).all(|u| act(u) == act(0));
    for opts in options() {
        let sim = simulate(&prog, &opts).unwrap_or_else(|e| panic!("{expr}: {e}"));
        for r in 0..ranks {
            let what = format!("{expr} on {ranks} x {mbs}, rank {r}, {opts:?}");
            let p = arena::plan_stash(&prog, r, &lens).expect("plan");
            assert_sound(&p, &what);
            let predicted = sim.peak_memory[r] * ALIGN as f64;
            assert_eq!(
                p.peak_live as f64, predicted,
                "{what}: the stash's live peak (bytes) is the simulator's peak memory"
            );
            assert!(p.size >= p.peak_live, "{what}");
            if uniform {
                assert_eq!(
                    p.size, p.peak_live,
                    "{what}: first fit is optimal at one size"
                );
            }
        }
    }
}

#[test]
fn stash_peak_is_the_simulators_peak_with_one_size() {
    for expr in SCHEDULES {
        for (ranks, mbs) in SHAPES {
            check(expr, ranks, mbs, |_| 1);
        }
    }
}

#[test]
fn stash_peak_is_the_simulators_peak_with_mixed_sizes() {
    for expr in SCHEDULES {
        for (ranks, mbs) in SHAPES {
            check(expr, ranks, mbs, |u| 1 + (u * 7) % 5);
        }
    }
}

/// A unit's output computed on this rank and stashed there lives, as a transfer
/// buffer, inside the stash's lifetime; and every schedule has a rank with a stash.
#[test]
fn local_outputs_live_inside_their_stash() {
    for expr in SCHEDULES {
        for (ranks, mbs) in SHAPES {
            let prog = program(expr, ranks, mbs);
            let lens = vec![ELEMS_PER_UNIT; prog.units.len()];
            let mut stashes = 0;
            for r in 0..ranks {
                let what = format!("{expr} on {ranks} x {mbs}, rank {r}");
                let transfer = arena::plan(&prog, r, &lens).expect("plan");
                let stash = arena::plan_stash(&prog, r, &lens).expect("plan");
                assert_sound(&transfer, &what);
                stashes += stash.buffers.len();
                for s in &stash.buffers {
                    let Some(b) = transfer.defined_at(s.first, Kind::Act, s.unit, s.mb) else {
                        panic!("{what}: the forward that stashes {s:?} defines no output");
                    };
                    let out = &transfer.buffers[b];
                    assert!(
                        out.first == s.first && out.last <= s.last,
                        "{what}: output {out:?} outlives its stash {s:?}"
                    );
                }
            }
            assert!(
                stashes > 0,
                "{expr} on {ranks} x {mbs}: no rank stashes anything"
            );
        }
    }
}
