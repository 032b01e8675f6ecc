//! Loops, not a flat listing: for the regular schedules the emitted code has the same
//! size for 64 and 4096 micro-batches (only loop bounds differ). Schedules whose
//! orders come from the cost model (`zbv`'s list scheduler, `transpose`'s deadline
//! placement) are not periodic in general; their sizes are reported by the
//! `expand` benchmark, not asserted.

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
/// [`small_mllm_48`]).
#[derive(Clone, Copy, Debug)]
enum Growth {
    /// At most 1.1x from 32 to `at` micro-batches (4096, or 1024 where the
    /// derivation itself is slow at 4096).
    Flat { at: usize },
    /// The program repeats with a period longer than 32 micro-batches hold (the
    /// lowering's transfer placement, or the operator's placement, cycles through a
    /// few variants of the plan's period because the ranks run at different rates),
    /// so the code is larger than at 32 but stops growing: at most 1.1x from `from`
    /// to `to` micro-batches.
    Bounded { from: usize, to: usize },
    /// Grows with the micro-batch count: `zb2p(encoders = spread)`'s list scheduler
    /// hands each encoder micro-batch to whichever rank has quota and time left, by
    /// timing, so the compute order itself has no period. Bounded only by the flat
    /// program: at most `1.1 * to / from` times the size at `from`.
    Linear { from: usize, to: usize },
}

const FLAT: Growth = Growth::Flat { at: 4096 };
const LONG_PERIOD: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
};
/// `fill` derives slowly at thousands of micro-batches (35 s to 1000 s at 4096).
const FILL_LONG_PERIOD: Growth = Growth::Bounded { from: 256, to: 512 };

/// Every body generator of `auto`'s search space (mpipe-core/src/search/auto.rs; the
/// `encoders = chains` forms need two encoders), then `transpose` and `fill` of the
/// encoder over every body that does not place the encoder itself.
fn schedules() -> Vec<(String, Growth)> {
    let mut v: Vec<(String, Growth)> = [
        ("1f1b", FLAT),
        ("gpipe", LONG_PERIOD),
        ("interleaved(v = 2)", LONG_PERIOD),
        ("interleaved(v = 3)", FLAT),
        ("interleaved(v = 4)", FLAT),
        ("zbh1", FLAT),
        ("zbv", FLAT),
        ("dualpipev", FLAT),
        ("zb2p", FLAT),
        ("zb2p(costs = unit)", FLAT),
        ("zb2p(v = 2)", FLAT),
        ("zb2p(layout = v)", FLAT),
        (
            "zb2p(encoders = spread)",
            Growth::Linear { from: 32, to: 256 },
        ),
        (
            "zb2p(encoders = spread, costs = unit)",
            Growth::Linear { from: 32, to: 256 },
        ),
        (
            "zb2p(encoders = spread, layout = v)",
            Growth::Linear { from: 32, to: 256 },
        ),
        ("zb2p(encoders = chain)", LONG_PERIOD),
        ("zb2p(encoders = chain, costs = unit)", LONG_PERIOD),
        ("zb2p(encoders = ramp)", LONG_PERIOD),
        ("zb2p(encoders = ramp, costs = unit)", LONG_PERIOD),
        ("zb2p(v = 2, encoders = ramp)", LONG_PERIOD),
    ]
    .into_iter()
    .map(|(e, g)| (e.to_string(), g))
    .collect();
    let wrapped: [(&str, Growth, Growth); 12] = [
        ("1f1b", LONG_PERIOD, FILL_LONG_PERIOD),
        ("gpipe", LONG_PERIOD, FILL_LONG_PERIOD),
        ("interleaved(v = 2)", FLAT, FILL_LONG_PERIOD),
        (
            "interleaved(v = 3)",
            Growth::Flat { at: 1024 },
            FILL_LONG_PERIOD,
        ),
        (
            "interleaved(v = 4)",
            Growth::Flat { at: 1024 },
            FILL_LONG_PERIOD,
        ),
        ("zbh1", LONG_PERIOD, FILL_LONG_PERIOD),
        ("zbv", Growth::Flat { at: 1024 }, Growth::Flat { at: 1024 }),
        ("dualpipev", LONG_PERIOD, FILL_LONG_PERIOD),
        ("zb2p", LONG_PERIOD, FILL_LONG_PERIOD),
        ("zb2p(costs = unit)", LONG_PERIOD, FILL_LONG_PERIOD),
        ("zb2p(v = 2)", LONG_PERIOD, Growth::Flat { at: 1024 }),
        ("zb2p(layout = v)", LONG_PERIOD, Growth::Flat { at: 1024 }),
    ];
    for (body, transposed, filled) in wrapped {
        v.push((format!("transpose(vision, {body})"), transposed));
        v.push((format!("fill(vision, {body})"), filled));
    }
    v
}

/// The emitted code of every generator, and of `transpose` and `fill` over them,
/// grows at most 1.1x from 32 to 4096 micro-batches, or stops growing past a few
/// hundred, or (the woven `spread` encoders only) grows at most linearly: see
/// [`Growth`] for which and why. Runs on two threads; about two minutes in release.
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
                    Growth::Bounded { from, to } | Growth::Linear { from, to } => (from, to),
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
            Growth::Linear { from, to } => b as f64 <= 1.1 * (to / from) as f64 * a as f64,
        };
        if !ok {
            failures.push(format!(
                "{expr} ({growth:?}): {small} lines at 32, {a} and {b} at the two sizes"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
