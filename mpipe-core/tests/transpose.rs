//! MPipe's transpose against the encoder-inline baseline.

use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::operators::transpose::{transpose, Backward, Owners};
use mpipe_core::profile::Profile;
use proptest::prelude::*;

fn makespan(profile: &Profile, p: usize, m: usize, expr: &str) -> f64 {
    let req = Request::new(profile, p, m);
    derive_str(&req, expr)
        .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
        .report
        .makespan
}

/// The encoder-heavy case: 4 ranks, 4 micro-batches, the encoder's forward
/// 9x one stage's F + B + W. Transpose spreads the encoder over the warm-up.
#[test]
fn encoder_heavy_transpose_is_more_than_twice_as_fast() {
    let profile =
        Profile::from_toml_str(include_str!("../../profiles/encoder-heavy.toml")).unwrap();
    let base = makespan(&profile, 4, 4, "1f1b");
    for expr in [
        "transpose(vision, 1f1b)",
        "transpose(vision, 1f1b, owners = min)",
        "transpose(vision, zbv)",
    ] {
        let t = makespan(&profile, 4, 4, expr);
        assert!(
            base / t > 2.0,
            "{expr}: {t} vs 1f1b {base}: speedup {:.2}",
            base / t
        );
    }
}

/// One encoder `vision` (layers, F, B, W per layer, trainable) before a 16-layer
/// LLM with per-layer (F, B, W).
fn profile(enc: (u32, f64, f64, f64, bool), llm: (f64, f64, f64)) -> Profile {
    Profile::from_toml_str(&profile_toml(enc, llm)).unwrap()
}

fn profile_toml(enc: (u32, f64, f64, f64, bool), llm: (f64, f64, f64)) -> String {
    let (layers, ef, eb, ew, trainable) = enc;
    let (lf, lb, lw) = llm;
    format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {layers}\nforward = {ef}\nbackward = {eb}\nweight = {ew}\n\
         activation = 0.1\ntrainable = {trainable}\n\n[llm]\nlayers = 16\nforward = {lf}\nbackward = {lb}\n\
         weight = {lw}\nactivation = 1.0\n"
    )
}

/// The plan's ideal timing: communication free and asynchronous.
fn ideal(profile: &Profile, p: usize, m: usize, owners: Owners) -> (f64, f64) {
    let base = generate(BodyKind::OneFOneB, profile, p, m).unwrap();
    let t = transpose(base.clone(), 0, owners, Backward::Local).unwrap();
    let span = |plan: &mpipe_core::plan::Plan| {
        timing(plan, &dependencies(plan).unwrap())
            .unwrap()
            .makespan()
    };
    (span(&base), span(&t))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Transpose against the encoder-inline 1F1B: where it can be slower, and why.
    ///
    /// Over 4000 random cases (1-40 encoder layers, frozen or trainable, 2-8 ranks,
    /// 1-32 micro-batches), the ratio transpose / inline was:
    ///
    /// | regime | owners | slower in | worst |
    /// | --- | --- | --- | --- |
    /// | micro-batches <= ranks | either (same) | 5 of 633 | 1.009 |
    /// | micro-batches > ranks | `min` | 92 of 3368 | 1.046 |
    /// | micro-batches > ranks | `round_robin` | 413 of 3368 | 1.150 |
    ///
    /// - With micro-batches <= ranks every encoder forward lands in a warm-up, and
    ///   with asynchronous communication (the plan's ideal timing) transpose is
    ///   **never** slower. The few rendezvous losses come from the lowering: a
    ///   sender must wait for a busy receiver, which the inline baseline happened
    ///   to avoid (its rank 0 is slowed by the encoder in just the right way).
    /// - With more micro-batches than ranks, round robin puts the extra encoder
    ///   forwards into the owners' steady state, where 1F1B keeps every rank busy in
    ///   lock-step, so each one stalls the whole pipeline, while inline they only
    ///   lengthen rank 0's warm-up. `owners = min` keeps them inline; its losses
    ///   come from the trainable encoder's gradient reduction and rendezvous.
    #[test]
    fn transpose_vs_inline(
        enc_layers in 1u32..40, ef in 0.05f64..2.0, eb in 0.05f64..2.0, ew in 0.0f64..1.0, trainable: bool,
        lf in 0.2f64..2.0, lb in 0.2f64..2.0, lw in 0.0f64..1.5,
        p in 2usize..9, m in 1usize..33,
    ) {
        let prof = profile((enc_layers, ef, eb, ew, trainable), (lf, lb, lw));
        let base = makespan(&prof, p, m, "1f1b");
        let rr = makespan(&prof, p, m, "transpose(vision, 1f1b)");
        let min = makespan(&prof, p, m, "transpose(vision, 1f1b, owners = min)");
        if m <= p {
            for owners in [Owners::RoundRobin, Owners::Min] {
                let (b, t) = ideal(&prof, p, m, owners);
                prop_assert!(t <= b + 1e-9, "{owners:?} slower with async communication: {t} > {b}");
            }
            prop_assert!(rr <= base * 1.05, "warm-up regime more than 5% slower: {rr} vs {base}");
        } else {
            prop_assert!(min <= base * 1.10, "owners = min more than 10% slower: {min} vs {base}");
            prop_assert!(rr <= base * 1.20, "round_robin more than 20% slower: {rr} vs {base}");
        }
    }
}

/// `owners = spare` keeps the encoder off the rank whose stages carry the most work:
/// with an LM head on the last stage, no encoder task lands on the last rank, and
/// every other rank owns some.
#[test]
fn spare_owners_avoid_the_busiest_rank() {
    let profile = Profile::from_toml_str(
        "[[encoder]]\nname = \"vision\"\nlayers = 4\nforward = 1.0\nbackward = 1.0\nweight = 0.5\n\
         activation = 0.1\ntrainable = true\n\n[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\n\
         weight = 1.0\nactivation = 1.0\nlast_stage_extra = { forward = 2.0, backward = 2.0, weight = 2.0 }\n",
    )
    .unwrap();
    let (p, m) = (4, 16);
    let req = Request::new(&profile, p, m);
    let d = derive_str(&req, "transpose(vision, 1f1b, owners = spare)").unwrap();
    let owns = |r: usize| {
        d.program.programs[r].iter().any(|a| matches!(a, mpipe_core::program::Action::F { unit, .. } if unit.as_ref() == "vision"))
    };
    assert!(!owns(p - 1), "the last rank (LM head) got encoder work");
    for r in 0..p - 1 {
        assert!(owns(r), "rank {r} owns no encoder work");
    }
    // Round robin puts some on the last rank.
    let rr = derive_str(&req, "transpose(vision, 1f1b)").unwrap();
    assert!(rr.program.programs[p - 1].iter().any(
        |a| matches!(a, mpipe_core::program::Action::F { unit, .. } if unit.as_ref() == "vision")
    ));
}

/// A case random testing found (7 ranks, 5 micro-batches, backward 9x cheaper than
/// forward): transpose ran 6.6% behind inline 1F1B under rendezvous, because every
/// earlier placement rule had rank 1 receive a later micro-batch before computing
/// the current one, and wait for it. The `Late` rule (each receive just before its
/// reader) brings it within the warm-up regime's 5%.
#[test]
fn transpose_keeps_up_when_backward_is_cheap() {
    let prof = profile(
        (6, 0.13206573268823596, 0.05, 0.0, false),
        (1.7175418994092257, 0.2, 0.0),
    );
    let base = makespan(&prof, 7, 5, "1f1b");
    let rr = makespan(&prof, 7, 5, "transpose(vision, 1f1b)");
    assert!(rr <= base * 1.05, "{rr} vs {base}");
}

/// Issue 36's setting: a frozen encoder whose forward is `enc_f` per micro-batch
/// before an LLM of `layers` layers with F = B = W = 1 per layer, one layer per stage.
fn frozen(enc_f: f64, layers: usize) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = 1\nforward = {enc_f}\nbackward = 0\nweight = 0\n\
         activation = 0\ntrainable = false\n\n[llm]\nlayers = {layers}\nforward = 1\nbackward = 1\n\
         weight = 1\nactivation = 1\n"
    ))
    .unwrap()
}

fn eager(profile: &Profile, p: usize, m: usize, expr: &str) -> f64 {
    let mut req = Request::new(profile, p, m);
    req.mode = mpipe_core::simulate::Mode::Eager;
    derive_str(&req, expr)
        .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
        .report
        .makespan
}

/// The paper's own placement (each owner runs all of its encoder forwards before
/// its first LLM forward, owners round robin) is reachable as `place = prefix`, and
/// the default placement is never behind it on the three settings; the
/// prefix figures are the authors' (120.6, 220.2, 243.0 by their placement).
#[test]
fn transpose_at_least_matches_the_authors_placement() {
    for (enc_f, layers, p, m, authors) in [
        (0.9, 8, 8, 32, 120.6),
        (0.9, 8, 8, 64, 220.2),
        (1.5, 16, 16, 64, 243.0),
    ] {
        let prof = frozen(enc_f, layers);
        let prefix = eager(&prof, p, m, "transpose(vision, 1f1b, place = prefix)");
        assert!(
            (prefix - authors).abs() <= 1e-9 * authors,
            "{p} x {m}: place = prefix gives {prefix}, the authors' placement {authors}"
        );
        let ours = eager(&prof, p, m, "transpose(vision, 1f1b)");
        assert!(
            ours <= prefix * (1.0 + 1e-9),
            "{p} x {m}: transpose {ours} behind the authors' placement {prefix}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// `transpose(vision, 1f1b)` is never slower than the authors' prefix placement
    /// (`place = prefix`), frozen or trainable, local or central backward, under
    /// either semantics, with or without a link cost: the derivation keeps the faster
    /// of its own placement and the authors' by simulating both programs.
    #[test]
    fn transpose_never_behind_the_prefix_placement(
        enc_layers in 1u32..12, ef in 0.05f64..2.0, eb in 0.05f64..2.0, ew in 0.0f64..1.0, trainable: bool,
        lf in 0.2f64..2.0, lb in 0.2f64..2.0, lw in 0.0f64..1.5,
        p in prop::sample::select(vec![2usize, 4, 8]), m in 1usize..49,
        central: bool, rendezvous: bool, latency in prop::option::of(0.01f64..0.5),
    ) {
        let mut prof = profile((enc_layers, ef, eb, ew, trainable), (lf, lb, lw));
        if let Some(latency) = latency {
            prof = Profile::from_toml_str(&format!(
                "{}\n[link]\nlatency = {latency}\nbandwidth = 4.0\n",
                profile_toml((enc_layers, ef, eb, ew, trainable), (lf, lb, lw))
            ))
            .unwrap();
        }
        let mut req = Request::new(&prof, p, m);
        if !rendezvous {
            req.mode = mpipe_core::simulate::Mode::Eager;
        }
        let bw = if central && trainable { ", backward = central" } else { "" };
        let span = |expr: &str| {
            derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr}: {e:?}")).report.makespan
        };
        let ours = span(&format!("transpose(vision, 1f1b{bw})"));
        let prefix = span(&format!("transpose(vision, 1f1b, place = prefix{bw})"));
        prop_assert!(ours <= prefix * (1.0 + 1e-9), "transpose {ours} behind the prefix placement {prefix}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// `timing_extended` (what `transpose` times its deferred-backward candidates
    /// with): a plan timed from the ideal timing of a shorter plan, each rank's list
    /// cut where the ideal timing passes a time `cut` (no task before it reads one
    /// after it), gets every task's start and end as the plan timed whole.
    #[test]
    fn a_plan_timed_from_its_prefix_is_timed_as_a_whole(
        ef in 0.1f64..3.0,
        eb in 0.1f64..3.0,
        trainable in any::<bool>(),
        zbv in any::<bool>(),
        transposed in any::<bool>(),
        share in 0.0f64..1.05,
    ) {
        use mpipe_core::analysis::timing_extended;
        let prof = profile((2, ef, eb, 0.3, trainable), (1.0, 1.5, 0.5));
        let kind = if zbv { BodyKind::ZbV } else { BodyKind::OneFOneB };
        let mut plan = generate(kind, &prof, 4, 8).unwrap();
        if transposed {
            plan = transpose(plan, 0, Owners::RoundRobin, Backward::Local).unwrap();
        }
        let whole = timing(&plan, &dependencies(&plan).unwrap()).unwrap();
        let cut = whole.makespan() * share;
        let mut short = plan.clone();
        for (list, start) in short.order.iter_mut().zip(&whole.start) {
            list.truncate(start.partition_point(|&s| s < cut));
        }
        let base = timing(&short, &dependencies(&short).unwrap()).unwrap();
        let extended = timing_extended(&plan, &base).unwrap();
        prop_assert_eq!(&extended.start, &whole.start);
        prop_assert_eq!(&extended.end, &whole.end);
    }
}
