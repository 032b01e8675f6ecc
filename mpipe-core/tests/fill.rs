//! `fill(ENCODER, BODY)`: never a longer ideal step than the body (with the encoder
//! where the body put it), and where the body's warm-up leaves idle ranks it moves
//! the encoder's work there.

mod common;

use common::BODIES;
use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::operators::fill::fill;
use mpipe_core::plan::Plan;
use mpipe_core::profile::Profile;
use mpipe_core::program::Op;
use proptest::prelude::*;

fn span(p: &Plan) -> f64 {
    timing(p, &dependencies(p).unwrap()).unwrap().makespan()
}

fn profile(layers: u32, ef: f64, trainable: bool, f: f64, b: f64, w: f64) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {layers}\nforward = {ef}\nbackward = {ef}\n\
         weight = {}\nactivation = 0.1\ntrainable = {trainable}\n\n\
         [llm]\nlayers = 16\nforward = {f}\nbackward = {b}\nweight = {w}\nactivation = 1.0\n",
        ef / 2.0
    ))
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn fill_is_never_slower_than_its_body(
        layers in 1u32..32, ef in 0.05f64..2.0, trainable: bool,
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.0f64..1.5,
        p in prop::sample::select(vec![2usize, 4, 8]), k in 1usize..4,
    ) {
        let m = 2 * p * k;
        let prof = profile(layers, ef, trainable, f, b, w);
        for kind in BODIES {
            let body = generate(kind, &prof, p, m).unwrap();
            let filled = fill(body.clone(), 0, None).unwrap();
            prop_assert!(
                span(&filled) <= span(&body) * (1.0 + 1e-12),
                "{kind:?}: {} > {}", span(&filled), span(&body)
            );
        }
    }
}

/// A heavy frozen encoder inline on rank 0 of 1F1B: `fill` spreads its forwards over
/// the ranks that wait in the warm-up, reaching the ideal step of a free encoder after
/// the first forward.
#[test]
fn fill_spreads_a_heavy_encoder_over_the_warm_up() {
    let prof = profile(24, 1.0, false, 0.5, 0.5, 0.5);
    let body = generate(BodyKind::OneFOneB, &prof, 4, 4).unwrap();
    let filled = fill(body.clone(), 0, None).unwrap();
    let ranks_with_encoder = filled
        .order
        .iter()
        .filter(|list| list.iter().any(|t| t.unit == 0 && t.op == Op::F))
        .count();
    assert_eq!(ranks_with_encoder, 4, "{:?}", filled.order);
    // Inline: 4 encoder forwards of 24 on rank 0 before the 1F1B of 7 x 6. Filled:
    // one encoder forward's time, then the 1F1B, as if the encoder were free.
    assert_eq!(span(&body), 4.0 * 24.0 + 30.0);
    assert_eq!(span(&filled), 24.0 + 7.0 * 6.0);
    // And the derivation agrees once communication is lowered.
    let req = Request::new(&prof, 4, 4);
    let inline = derive_str(&req, "1f1b").unwrap().report.makespan;
    let d = derive_str(&req, "fill(vision, 1f1b)").unwrap();
    assert!(
        d.report.makespan < 0.6 * inline,
        "{} vs {inline}",
        d.report.makespan
    );
}
