//! MPipe's transpose against the encoder-inline baseline.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use proptest::prelude::*;

fn makespan(profile: &Profile, p: usize, m: usize, expr: &str) -> f64 {
    let req = Request {
        profile,
        ranks: p,
        microbatches: m,
    };
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

fn profile(
    enc_layers: u32,
    ef: f64,
    eb: f64,
    ew: f64,
    trainable: bool,
    llm_layers: u32,
    lf: f64,
    lb: f64,
    lw: f64,
) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {enc_layers}\nforward = {ef}\nbackward = {eb}\nweight = {ew}\n\
         activation = 0.1\ntrainable = {trainable}\n\n[llm]\nlayers = {llm_layers}\nforward = {lf}\nbackward = {lb}\n\
         weight = {lw}\nactivation = 1.0\n"
    ))
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Transpose against the encoder-inline 1F1B, communication free, rendezvous.
    ///
    /// - With at most as many micro-batches as ranks (the warm-up regime MPipe
    ///   targets) every micro-batch's encoder work lands in a warm-up, and
    ///   transpose is never slower, in either owner mode.
    /// - With more micro-batches than ranks, `owners = round_robin` can be slower
    ///   (up to ~10% seen): the extra encoder forwards land in the owners' steady
    ///   state, where 1F1B keeps every rank busy in lock-step, so each one stalls the
    ///   whole pipeline, while inline they only lengthen rank 0's warm-up. There
    ///   `owners = min` (the authors' choice) keeps them inline and stays within a
    ///   few percent of the baseline (worst seen 1.5%: the encoder output of the
    ///   spread micro-batches now meets rank 0 by rendezvous).
    #[test]
    fn transpose_vs_inline(
        enc_layers in 1u32..40, ef in 0.05f64..2.0, eb in 0.05f64..2.0, ew in 0.0f64..1.0, trainable: bool,
        lf in 0.2f64..2.0, lb in 0.2f64..2.0, lw in 0.0f64..1.5,
        p in 2usize..9, m in 1usize..33,
    ) {
        let prof = profile(enc_layers, ef, eb, ew, trainable, 16, lf, lb, lw);
        let base = makespan(&prof, p, m, "1f1b");
        let rr = makespan(&prof, p, m, "transpose(vision, 1f1b)");
        let min = makespan(&prof, p, m, "transpose(vision, 1f1b, owners = min)");
        if m <= p {
            prop_assert!(rr <= base + 1e-9, "round_robin slower in the warm-up regime: {rr} > {base}");
            prop_assert!(min <= base + 1e-9, "min slower in the warm-up regime: {min} > {base}");
        } else {
            prop_assert!(min <= base * 1.05, "owners = min more than 5% slower: {min} vs {base}");
        }
    }
}
