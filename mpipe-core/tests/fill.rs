//! `fill(ENCODER, BODY)`: never a longer ideal step than the body (with the encoder
//! where the body put it), and where the body's warm-up leaves idle ranks it moves
//! the encoder's work there.

mod common;

use common::BODIES;
use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::ir::compare::at_most;
use mpipe_core::operators::fill::{fill, FillTies};
use mpipe_core::plan::Plan;
use mpipe_core::profile::Profile;
use mpipe_core::program::Op;
use mpipe_core::simulate::Mode;
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
            let filled = fill(body.clone(), 0, None, &prof, None).unwrap();
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
    let filled = fill(body.clone(), 0, None, &prof, None).unwrap();
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

/// A trainable encoder whose forward (13 layers of 1) is longer than the gaps of
/// ZB-H1 at 8 ranks: layer by layer, each micro-batch's layers go into one rank's
/// gaps, and the ideal step is shorter than with the same encoder as one layer (same
/// costs, so only whole forwards); the program names the layers and verifies.
#[test]
fn fill_places_a_long_forward_layer_by_layer() {
    let layered = profile(13, 1.0, true, 1.0, 1.0, 1.0);
    let whole = profile(1, 13.0, true, 1.0, 1.0, 1.0);
    let ideal = |prof: &Profile| {
        let body = generate(BodyKind::ZbH1, prof, 8, 16).unwrap();
        span(&fill(body, 0, None, prof, None).unwrap())
    };
    let (cut, one) = (ideal(&layered), ideal(&whole));
    assert!(cut < 0.9 * one, "layer by layer {cut}, whole {one}");
    let req = Request::new(&layered, 8, 16);
    let d = derive_str(&req, "fill(vision, zbh1)").unwrap();
    assert!(d.program.units.iter().any(|u| &*u.name == "vision/12"));
    assert!(mpipe_core::verify::verify(&d.program).is_empty());
    // Each micro-batch's layers, forward and backward, on one rank.
    for mb in 0..16 {
        let ranks: std::collections::BTreeSet<usize> = d
            .program
            .programs
            .iter()
            .enumerate()
            .filter(|(_, list)| {
                list.iter().any(|a| {
                    matches!(a, mpipe_core::program::Action::F { unit, mb: m }
                        | mpipe_core::program::Action::BW { unit, mb: m }
                        if unit.starts_with("vision/") && *m as usize == mb)
                })
            })
            .map(|(r, _)| r)
            .collect();
        assert_eq!(ranks.len(), 1, "micro-batch {mb}: {ranks:?}");
    }
}

/// Where `fill`'s ideal timing cannot tell the whole placement from the layered one
/// (their ideal steps equal under the tolerance rule), the derivation simulates both
/// and keeps the faster: the default is then never slower than `pieces = whole` nor
/// `pieces = layers`. Qwen2-VL-72B at 4 x 8 under rendezvous has such a tie for
/// `fill(vision, 1f1b)`, where the ideal choice (whole) simulates 7% slower.
#[test]
fn an_ideal_tie_between_pieces_is_broken_by_simulation() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../profiles/");
    let mut tied = Vec::new();
    for file in [
        "eval-b-qwen2vl72b.toml",
        "eval-b-qwen2vl72b-frozen.toml",
        "qwen2vl-7b.toml",
    ] {
        let text = std::fs::read_to_string(format!("{root}{file}")).unwrap();
        let prof = Profile::from_toml_str(&text).unwrap();
        for body in ["1f1b", "zbh1", "zbv"] {
            for mode in [Mode::Rendezvous, Mode::Eager] {
                let ties = FillTies::new();
                let req = Request {
                    mode,
                    fill_ties: Some(&ties),
                    ..Request::new(&prof, 4, 8)
                };
                let expr = format!("fill(vision, {body})");
                let Ok(chosen) = derive_str(&req, &expr) else {
                    continue;
                };
                if !ties.seen() {
                    continue;
                }
                tied.push(format!("{file} {mode:?} {expr}"));
                let req = Request {
                    mode,
                    ..Request::new(&prof, 4, 8)
                };
                for pieces in ["whole", "layers"] {
                    let alt = format!("fill(vision, {body}, pieces = {pieces})");
                    if let Ok(alt_d) = derive_str(&req, &alt) {
                        assert!(
                            at_most(chosen.report.makespan, alt_d.report.makespan),
                            "{file} {mode:?}: {expr} {} is slower than {alt} {}",
                            chosen.report.makespan,
                            alt_d.report.makespan
                        );
                    }
                }
            }
        }
    }
    assert!(
        tied.iter()
            .any(|c| c == "eval-b-qwen2vl72b.toml Rendezvous fill(vision, 1f1b)"),
        "{tied:?}"
    );
}
