//! Loops, not a flat listing: for the regular schedules the emitted code has the same
//! size for 64 (`interleaved`: 128) and 4096 micro-batches (only loop bounds differ),
//! loops nest where a period holds repetitions, and every generator
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
    for expr in [quote!(1f1b), quote!(zbh1), quote!(gpipe)] {
        let (small, large) = (size(64, &expr), size(4096, &expr));
        assert_eq!(
            small, large,
            "{expr}: {small} tokens for 64 micro-batches, {large} for 4096"
        );
    }
    // `interleaved(v = 2)`: one period repeats at every size, but at 64 micro-batches
    // the periodic transfer placement leaves rank 5's period more regular (three
    // equal forward-backward pairs, which nested loops roll: 65 steps against 73 from
    // 128 micro-batches on). From 128 on only loop bounds differ; from 64 the code
    // grows at most 1.1x (issue 36's goal).
    let expr = quote!(interleaved(v = 2));
    let (small, mid, large) = (size(64, &expr), size(128, &expr), size(4096, &expr));
    assert_eq!(
        mid, large,
        "{expr}: {mid} tokens for 128 micro-batches, {large} for 4096"
    );
    assert!(
        large as f64 <= 1.1 * small as f64,
        "{expr}: {small} tokens for 64 micro-batches, {large} for 4096"
    );
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

/// `transpose`'s `Place::Idle` placement
/// (`mpipe-core/src/algebra/operators/transpose.rs`; the fastest here by the plan's
/// ideal timing), whose owners come in phases, not drift: every owner runs its encoder
/// forwards before its first other work, rank `r` in a window of its warm-up idle `s_r`
/// plus the delay `D`, one slot a forward, micro-batches earliest deadline first into
/// the earliest free slot. Rank `r` has `(s_r - s_0) / c_f` more slots than rank 0 (6
/// more per rank here: a stage's forward is 12, the encoder's 2), so the owners go
/// round robin over all `p` ranks, then over the `p - 1` with slots left, and so on:
/// `p` phases, each with its own owner stride, and every rank's steady state (the
/// gradient sent to each micro-batch's owner, the owner's backward) follows them. The
/// tail phases have a constant length (6 levels each: strides 3, 2 and 1 over 36
/// micro-batches); the round-robin phase holds the rest, and at 32 micro-batches there
/// is none (`D` is one forward, rank 0 owns micro-batch 0 only), so the code gains one
/// phase's loop per rank (`1f1b`: 1086 lines at 32, 1551 at 512, 1563 at 4096, as this
/// test counts them; rank 0's round-robin loop body is 16 steps). The phases differ in
/// stride and length, so they are not repetitions of one another: nested loops do
/// not merge them. Any assignment of the
/// same slots has phases of different strides somewhere (the slot counts per rank
/// differ by the warm-up, and a placement that left the warm-up's extra slots unused
/// would start the pipeline later); the size is the same at every micro-batch count
/// from a few hundred on, asserted from 512 to 4096. Nor can the code at 32 hold the
/// round-robin loop at equal speed: `D` is already the least it can be (rank 0 runs
/// micro-batch 0's encoder forward before its first LLM forward, so `D` is at least
/// one forward), and with it rank 0 has one slot (`transpose(vision, 1f1b)` at 32:
/// rank 0 owns micro-batch 0 only, ranks 1 to 3 the rest in strides 3 and 2); a
/// round-robin loop of three or more levels there would need a larger `D`, a later
/// start. So 1.1x from 32 is out of reach for the fastest owners, not for want of a
/// roller: the regimes at 4096 are a strict superset of those at 32.
const IDLE_PHASES: Growth = Growth::Bounded {
    from: 512,
    to: 4096,
    why: "transpose's idle placement: p owner phases (round robin, then p - 1 of constant \
          length); at 32 micro-batches the round-robin one is missing",
};

/// `transpose(vision, dualpipev)` places later encoder forwards in the steady state
/// (one every `p` micro-batches on each owner, `Place::Late`: as late in the owner's
/// order as still meets the first stage's need, by the plan's ideal timing), and
/// that timing settles slowly: the forwards' places in their owners' orders move
/// about one task every dozen micro-batches until micro-batch 55 (rank 3's forward
/// of `mb` follows `BW(llm.3, mb - 7)` up to 15, `F(llm.3, mb - 2)` from 19,
/// `BW(llm.4, mb - 6)` from 43, `F(llm.4, mb - 2)` from 55; the same at 128 and 512),
/// so the compute order itself has a transient of about 55 micro-batches (timing the
/// plan with the forwards placed gives the same places: they are a fixed point). The
/// transfers drift with it; the periodic placement's candidates do not verify (the
/// encoder activations' transfers then meet in different orders on the two ranks,
/// or deadlock) or run slower (24826 against 22042 at 512), so the derivation keeps
/// the drifting one.
const SETTLING_TRANSFERS: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
    why: "transfers drift for ~25 micro-batches before settling; periodic candidates \
          fail verification or are slower",
};

/// `fill` puts encoder work into the body's idle time by timing: a stock of encoder
/// forwards goes into the warm-up's idle gaps of every rank (at 32 micro-batches
/// `fill(vision, 1f1b)` puts three there and the rest on rank 0 in one steady pattern),
/// and past the stock (about 70 to 110 micro-batches on this profile) a transition and
/// a steady insertion (one forward every `p` micro-batches per rank) follow, so the
/// program has one or two more regimes than at 32 (`fill(vision, 1f1b)`: 511 lines at
/// 32, 2001 at 256 and 512), then repeats; the regimes differ in shape, so nested
/// loops do not merge them. At 32 the stock is not spent (`fill(vision, 1f1b)`: 28
/// forwards in rank 0's warm-up gap, 3 in rank 1's), and a forward placed in the
/// steady state while a gap still holds it would lengthen the step, so the steady
/// insertion cannot appear at 32 at equal speed: 1.1x from 32 is out of reach, the
/// bound past the stock is the stated goal. The stock's owners also come in blocks
/// (each gap takes consecutive micro-batches, latest fitting gap first), so the
/// steady state of the first rank, which sends each encoder gradient to its owner,
/// has a loop per block. Sizes 256 and 512: `fill` derives slowly at
/// thousands of micro-batches.
const FILL_DRIFTS: Growth = Growth::Bounded {
    from: 256,
    to: 512,
    why: "fill's warm-up stock of encoder forwards, then a steady insertion past it",
};

/// `zb2p`'s list scheduler with cost-model costs places each weight gradient where the
/// costed timing leaves its rank idle; the ranks holding the encoder chain run at
/// another rate, so the places slide and the compute order repeats only every few
/// hundred micro-batches (2342 lines at 32, 23356 at 512 and 2048). Within that period
/// the places slide, so its stretches are not repetitions of one another either:
/// rolling the rolled list again (nested loops) finds nothing to merge. The compute
/// order itself drifts, not only the transfers (`zb2p(encoders = chain)` at 128,
/// rank 3's runs of weight gradients between forward-backward pairs: 6, 1, 3, 3, 3,
/// 3, 4, 1, 3, 3, 3, 3, 1, 4, 1, 3, 1, 3, 3, 3, 2, 5, ...), so the cause is the
/// greedy list scheduler (`mpipe-core/src/algebra/generators/zb2p.rs`): a steady
/// state scheduled once and repeated would be periodic where the greedy one slides.
/// Tried (not kept): the first period of the greedy orders in which every rank runs
/// each of its tasks once per micro-batch (7 micro-batches from 26 here), repeated to
/// the cool-down, kept when the scheduler's own costed makespan is no longer. The
/// code is then flat (rolled steps per rank at 512: 274, 522, 243, 182 against 243,
/// 278, 140, 107 at 32), and the scheduler's makespan equal, but the derived program
/// is slower (21153 -> 21659.75 at 512): the greedy slide absorbs the transfers the
/// scheduler leaves out.
const LIST_SCHEDULED: Growth = Growth::Bounded {
    from: 512,
    to: 2048,
    why: "zb2p's list scheduler places weight gradients by costed timing; compute order \
          settles late",
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
        // Flat since loops nest: the list scheduler with unit costs repeats a
        // 12-micro-batch period (12 forward-backward pairs, then their 12 weight
        // gradients), one loop over the periods holding a loop per repetition; before,
        // the period's body was written out (2214 lines at 4096 against 1816 at 32).
        ("zb2p(encoders = chain, costs = unit)", FLAT),
        ("zb2p(encoders = ramp)", LIST_SCHEDULED),
        ("zb2p(encoders = ramp, costs = unit)", FLAT),
        ("zb2p(v = 2, encoders = ramp)", LIST_SCHEDULED),
    ]
    .into_iter()
    .map(|(e, g)| (e.to_string(), g))
    .collect();
    let wrapped: [(&str, Growth, Growth); 12] = [
        ("1f1b", IDLE_PHASES, FILL_DRIFTS),
        ("gpipe", IDLE_PHASES, FILL_DRIFTS),
        ("interleaved(v = 2)", FLAT, FILL_DRIFTS),
        ("interleaved(v = 3)", Growth::Flat { at: 1024 }, FILL_DRIFTS),
        ("interleaved(v = 4)", Growth::Flat { at: 1024 }, FILL_DRIFTS),
        ("zbh1", IDLE_PHASES, FILL_DRIFTS),
        ("zbv", Growth::Flat { at: 1024 }, Growth::Flat { at: 1024 }),
        ("dualpipev", SETTLING_TRANSFERS, FILL_DRIFTS),
        ("zb2p", IDLE_PHASES, FILL_DRIFTS),
        ("zb2p(costs = unit)", IDLE_PHASES, FILL_DRIFTS),
        // Idle's owner phases too, after zb2p's ramp (about 17 micro-batches,
        // the same code at every size): at 32 micro-batches the round-robin phase
        // ends inside the ramp and no steady loop forms; from a few hundred on the
        // program is the ramp, one steady loop and the tail's phases.
        ("zb2p(v = 2)", IDLE_PHASES, Growth::Flat { at: 1024 }),
        ("zb2p(layout = v)", IDLE_PHASES, Growth::Flat { at: 1024 }),
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
