//! The periodic transfer placement (`search/periodic.rs`, issue 36 item 5) a
//! derivation applies to its final program: against the same derivation with it
//! turned off (`SearchPolicy::periodic_probes = 0`), the program it keeps is never
//! slower, never peaks higher on any rank, and no rank's code (rolled as
//! `schedule!` rolls it) is larger; and on `gpipe` with a trainable encoder, whose
//! meeting points drift, it makes the code flat in the micro-batch count.
//!
//! Run with `cargo test --release -p mpipe-core --test periodic`.

use mpipe_core::derive::{derive_str, Derived, Request};
use mpipe_core::profile::Profile;
use mpipe_core::rolled::roll;

/// `docs/guide/examples/small-mllm.toml` (a trainable vision encoder) with 48 LLM
/// layers, as `mpipe-codegen/tests/code_size.rs` uses it.
fn small_mllm_48() -> Profile {
    let text = include_str!("../../docs/guide/examples/small-mllm.toml")
        .replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 48\n");
    assert!(text.contains("layers = 48"), "profile text changed");
    Profile::from_toml_str(&text).unwrap()
}

fn derive(profile: &Profile, m: usize, expr: &str, periodic: bool) -> Derived {
    let mut req = Request::new(profile, 4, m);
    if !periodic {
        req.policy.periodic_probes = 0;
    }
    derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr} (4 x {m}): {e:?}"))
}

fn code_sizes(d: &Derived) -> Vec<usize> {
    let r = roll(&d.program).unwrap();
    (0..r.ranks.len()).map(|k| r.code_size(k)).collect()
}

/// Bodies and operators whose transfers drift (and some that do not), at sizes where
/// the drift shows and where it does not yet.
#[test]
fn periodic_placement_is_never_slower_higher_or_larger() {
    let profile = small_mllm_48();
    let mut changed = Vec::new();
    for expr in [
        "1f1b",
        "gpipe",
        "interleaved(v = 2)",
        "interleaved(v = 4)",
        "zbh1",
        "zb2p(layout = v)",
        "zb2p(v = 2)",
        "transpose(vision, 1f1b)",
        "transpose(vision, interleaved(v = 3))",
        "transpose(vision, interleaved(v = 4))",
        "transpose(vision, zb2p(layout = v))",
    ] {
        for m in [16, 32, 160] {
            let off = derive(&profile, m, expr, false);
            let on = derive(&profile, m, expr, true);
            if on.program != off.program {
                changed.push(format!("{expr} x {m}"));
            }
            let what = format!("{expr} (4 x {m})");
            assert!(
                on.report.makespan <= off.report.makespan,
                "{what}: makespan {} with the periodic placement, {} without",
                on.report.makespan,
                off.report.makespan
            );
            for (r, (a, b)) in on
                .report
                .peak_memory
                .iter()
                .zip(&off.report.peak_memory)
                .enumerate()
            {
                assert!(a <= b, "{what}: rank {r} peaks at {a}, {b} without");
            }
            let (a, b) = (code_sizes(&on), code_sizes(&off));
            for (r, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(x <= y, "{what}: rank {r}'s code {x} steps, {y} without");
            }
        }
    }
    // The pass is not idle: it changes the ones whose meeting points drift here.
    for name in ["gpipe x 32", "gpipe x 160", "zb2p(layout = v) x 32"] {
        assert!(
            changed.iter().any(|c| c == name),
            "{name} unchanged; changed: {changed:?}"
        );
    }
}

/// `gpipe` with the trainable encoder: rank 0's backward (`BW(llm.0)` + `BW(vision)`)
/// is slower than rank 1's, so the meeting points the lowering chooses slide along
/// rank 0's list every few micro-batches (without the periodic placement its code
/// grows from 39 steps at 32 micro-batches to 159 at 1024); with it the code grows
/// at most 1.1x from 32 to 1024 micro-batches.
#[test]
fn gpipe_trainable_encoder_is_flat() {
    let profile = small_mllm_48();
    let total = |m| -> usize { code_sizes(&derive(&profile, m, "gpipe", true)).iter().sum() };
    let (small, large) = (total(32), total(1024));
    assert!(
        large as f64 <= 1.1 * small as f64,
        "code size {small} steps at 32 micro-batches, {large} at 1024"
    );
}
