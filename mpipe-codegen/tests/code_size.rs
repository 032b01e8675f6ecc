//! Loops, not a flat listing: for the regular schedules the emitted code has the same
//! size for 64 and 4096 micro-batches (only loop bounds differ), and every generator
//! and `transpose` and `fill` over them grows at most 1.1x from 32 to 4096
//! micro-batches, except the ones listed with the reason (issue 36, item 5).

use mpipe_codegen::schedule;
use mpipe_codegen::size::code_size;
use proc_macro2::TokenStream;
use quote::quote;

const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 8
forward = 0.5
backward = 0.5
weight = 0.25
activation = 0.05
trainable = false

[llm]
layers = 16
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

fn size(mbs: usize, expr: &TokenStream) -> usize {
    let tokens = schedule(quote! {
        pub mod plan { model_toml = #PROFILE; ranks = 8; microbatches = #mbs; schedule = #expr; }
    });
    let text = tokens.to_string();
    assert!(
        !text.contains("compile_error"),
        "{expr} with {mbs} micro-batches failed: {text}"
    );
    code_size(tokens).expect("parses").tokens
}

#[test]
fn regular_schedules_do_not_grow_with_microbatches() {
    for expr in [
        quote!(1f1b),
        quote!(zbh1),
        quote!(interleaved(v = 2)),
        quote!(gpipe),
    ] {
        let (small, large) = (size(64, &expr), size(4096, &expr));
        assert_eq!(
            small, large,
            "{expr}: {small} tokens for 64 micro-batches, {large} for 4096"
        );
    }
}

// ---------------------------------------------------------------------------
// Every generator, and `transpose` and `fill` over them: how the emitted code grows
// with the micro-batch count (issue 36, item 5).

/// `docs/guide/examples/small-mllm.toml` (a trainable vision encoder) with 48 LLM
/// layers, so that 4 ranks split them into 2, 3 or 4 chunks each (`interleaved`).
fn small_mllm_48() -> String {
    let text = include_str!("../../docs/guide/examples/small-mllm.toml")
        .replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 48\n");
    assert!(text.contains("layers = 48"), "profile text changed");
    text
}

/// Lines of the code `schedule!` emits for `expr` on 4 ranks (program JSON left out).
fn lines(profile: &str, mbs: usize, expr: &str) -> usize {
    let e: TokenStream = expr.parse().expect("an expression");
    let tokens = schedule(quote! {
        pub mod plan { model_toml = #profile; ranks = 4; microbatches = #mbs; schedule = #e; }
    });
    let text = tokens.to_string();
    assert!(
        !text.contains("compile_error"),
        "{expr} with {mbs} micro-batches failed: {text}"
    );
    code_size(tokens).expect("parses").lines
}

/// How a schedule's emitted code grows, as measured (lines, 4 ranks, the profile of
/// [`small_mllm_48`]). The goal (issue 36) is [`Growth::Flat`] for every schedule;
/// the others say why they miss it.
#[derive(Clone, Copy, Debug)]
enum Growth {
    /// At most 1.1x from 32 to `at` micro-batches (4096, or 1024 where the
    /// derivation itself is slow at 4096).
    Flat { at: usize },
    /// The program repeats with a period longer than 32 micro-batches hold, so the
    /// code is larger than at 32 but stops growing: at most 1.1x from `from` to `to`
    /// micro-batches. `why` says what drifts.
    Bounded {
        from: usize,
        to: usize,
        why: &'static str,
    },
    /// Grows with the micro-batch count, bounded only by the flat program: at most
    /// `1.1 * to / from` times the size at `from`. `why` says what has no period.
    Linear {
        from: usize,
        to: usize,
        why: &'static str,
    },
}

const FLAT: Growth = Growth::Flat { at: 4096 };

/// The plan's compute order is periodic (its compute actions alone roll to the same
/// size at 32 and 512 micro-batches), but the lowering's meeting points drift:
/// ranks run at different rates in the timeline the transfers are placed by, so a
/// receive slides one task along its rank's list every few micro-batches. The
/// periodic placement every derivation tries (`mpipe-core/src/search/periodic.rs`,
/// one period's placement in every period) runs slower on these, or does not verify
/// (a move at a stretch's end breaks the order two ranks meet in), so the derivation
/// keeps the drifting one.
const TRANSFERS_DRIFT: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
    why: "compute periodic; transfer placement drifts, the periodic one is slower",
};

/// `transpose`'s placement of the encoder work (by the plan's ideal timing) drifts
/// too: the compute order alone grows a little (26 steps at 32 micro-batches, 34 at
/// 512 for `1f1b`) before it settles, and the transfers drift as above.
const TRANSPOSE_DRIFTS: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
    why: "transpose's encoder placement and the transfers drift, then repeat",
};

/// `fill` puts encoder work into the body's idle time by timing: its compute order
/// alone grows from 32 to 512 micro-batches (31 to 86 steps over `1f1b`), then
/// repeats. `fill` derives slowly at thousands of micro-batches (35 s to 1000 s at
/// 4096), hence the smaller sizes.
const FILL_DRIFTS: Growth = Growth::Bounded {
    from: 256,
    to: 512,
    why: "fill's encoder placement follows the idle time, settles after ~256",
};

/// `zb2p`'s list scheduler with cost-model costs orders the encoder chain by timing:
/// the compute order alone does not repeat before a few hundred micro-batches (393
/// compute steps at 32, 4340 at 512), then stops growing.
const LIST_SCHEDULED: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
    why: "zb2p's list scheduler orders the encoder by timing; compute order settles late",
};

/// `zb2p(encoders = spread)`'s list scheduler hands each encoder micro-batch to
/// whichever rank has quota and time left, by timing, so the compute order itself
/// has no period.
const SPREAD: Growth = Growth::Linear {
    from: 32,
    to: 256,
    why: "the woven encoder's compute order has no period",
};

/// Every body generator of `auto`'s search space (mpipe-core/src/search/auto.rs; the
/// `encoders = chains` forms need two encoders), then `transpose` and `fill` of the
/// encoder over every body that does not place the encoder itself.
fn schedules() -> Vec<(String, Growth)> {
    let mut v: Vec<(String, Growth)> = [
        ("1f1b", FLAT),
        // Flat since the periodic placement: rank 0's backward (`BW(llm.0)` +
        // `BW(vision)`) is slower than rank 1's, and the drifting meeting points
        // repeated only every 89 micro-batches.
        ("gpipe", FLAT),
        // Flat since the periodic placement also takes its template from a period
        // a few into the steady state, for that period and the later ones: from
        // the start, the middle's template made rank 0 (the encoder's) wait 110
        // ticks while ranks 1 and 2 settled into its phase.
        ("interleaved(v = 2)", FLAT),
        ("interleaved(v = 3)", FLAT),
        ("interleaved(v = 4)", FLAT),
        ("zbh1", FLAT),
        ("zbv", FLAT),
        ("dualpipev", FLAT),
        ("zb2p", FLAT),
        ("zb2p(costs = unit)", FLAT),
        ("zb2p(v = 2)", FLAT),
        ("zb2p(layout = v)", FLAT),
        ("zb2p(encoders = spread)", SPREAD),
        ("zb2p(encoders = spread, costs = unit)", SPREAD),
        ("zb2p(encoders = spread, layout = v)", SPREAD),
        ("zb2p(encoders = chain)", LIST_SCHEDULED),
        ("zb2p(encoders = chain, costs = unit)", LIST_SCHEDULED),
        ("zb2p(encoders = ramp)", LIST_SCHEDULED),
        ("zb2p(encoders = ramp, costs = unit)", LIST_SCHEDULED),
        ("zb2p(v = 2, encoders = ramp)", LIST_SCHEDULED),
    ]
    .into_iter()
    .map(|(e, g)| (e.to_string(), g))
    .collect();
    let wrapped: [(&str, Growth, Growth); 12] = [
        ("1f1b", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        ("gpipe", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        ("interleaved(v = 2)", FLAT, FILL_DRIFTS),
        ("interleaved(v = 3)", Growth::Flat { at: 1024 }, FILL_DRIFTS),
        ("interleaved(v = 4)", Growth::Flat { at: 1024 }, FILL_DRIFTS),
        ("zbh1", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        ("zbv", Growth::Flat { at: 1024 }, Growth::Flat { at: 1024 }),
        ("dualpipev", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        ("zb2p", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        ("zb2p(costs = unit)", TRANSPOSE_DRIFTS, FILL_DRIFTS),
        // The compute order of these is periodic; the transfers drift. Measured
        // (`zb2p(v = 2)`): in the steady stretch the transfers repeat already (at
        // 128 micro-batches at most 4 of its 27 periods break the template on a
        // rank); the growth is in the ~17 micro-batches before it (zb2p's ramp),
        // whose transfers do not repeat: at 32 that ramp is most of the program and
        // no steady loop forms (1428 steps), from 48 on it is the ramp, a loop and
        // the cool-down (1693).
        ("zb2p(v = 2)", TRANSFERS_DRIFT, Growth::Flat { at: 1024 }),
        (
            "zb2p(layout = v)",
            TRANSFERS_DRIFT,
            Growth::Flat { at: 1024 },
        ),
    ];
    for (body, transposed, filled) in wrapped {
        v.push((format!("transpose(vision, {body})"), transposed));
        v.push((format!("fill(vision, {body})"), filled));
    }
    v
}

/// The emitted code of every generator, and of `transpose` and `fill` over them,
/// grows at most 1.1x from 32 to 4096 micro-batches ([`Growth::Flat`]), or, for the
/// schedules listed otherwise with the reason, stops growing past a few hundred, or
/// (the woven `spread` encoders only) grows at most linearly. Runs on two threads; about two minutes in release.
#[test]
fn every_generator_and_operator_grows_as_stated() {
    let profile = small_mllm_48();
    let cases = schedules();
    assert_eq!(cases.len(), 44);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((expr, growth)) = cases.get(k) else {
                    break;
                };
                let (from, to) = match *growth {
                    Growth::Flat { at } => (32, at),
                    Growth::Bounded { from, to, .. } | Growth::Linear { from, to, .. } => {
                        (from, to)
                    }
                };
                let (a, b) = (lines(&profile, from, expr), lines(&profile, to, expr));
                let small = if from == 32 {
                    a
                } else {
                    lines(&profile, 32, expr)
                };
                eprintln!("{expr}: {small} {a} {b}");
                results
                    .lock()
                    .unwrap()
                    .push((expr.clone(), *growth, small, a, b));
            });
        }
    });
    let mut failures = Vec::new();
    for (expr, growth, small, a, b) in results.into_inner().unwrap() {
        let ok = match growth {
            Growth::Flat { .. } | Growth::Bounded { .. } => b as f64 <= 1.1 * a as f64,
            Growth::Linear { from, to, .. } => b as f64 <= 1.1 * (to / from) as f64 * a as f64,
        };
        if !ok {
            failures.push(format!(
                "{expr} ({growth:?}): {small} lines at 32, {a} and {b} at the two sizes"
            ));
        }
        // The list says which schedules miss the goal: one that meets it (at most
        // 1.1x from 32 to the larger size) is listed Flat, so the count is true.
        let flat_now = b as f64 <= 1.1 * small as f64;
        if flat_now && !matches!(growth, Growth::Flat { .. }) {
            failures.push(format!(
                "{expr} ({growth:?}): {small} lines at 32, {b} at the larger size: flat now, \
                 list it as Flat"
            ));
        }
    }
    let mut flat = 0;
    for (expr, growth) in &cases {
        match growth {
            Growth::Flat { .. } => flat += 1,
            Growth::Bounded { why, .. } | Growth::Linear { why, .. } => {
                eprintln!("not flat: {expr}: {why}")
            }
        }
    }
    eprintln!(
        "{flat} of {} schedules flat (at most 1.1x from 32 micro-batches)",
        cases.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
