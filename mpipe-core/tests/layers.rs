//! `layers(SCHEDULE)`: every stage, chunk and encoder computed layer by layer
//! (`operators::layers`).

mod common;

use common::BODIES;
use mpipe_core::derive::{derive_str, ErrorKind, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{ActionRef, Program};
use mpipe_core::render::{gantt_svg, SvgOptions};
use mpipe_core::simulate::Mode;
use proptest::prelude::*;

/// A `layers`-encoder-layer vision encoder (each layer `heavy` per pass) before an
/// LLM of `llm` layers with an embedding and an LM head.
fn mllm(layers: u32, heavy: f64, trainable: bool, llm: u32) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {layers}\nforward = {heavy}\n\
         backward = {heavy}\nweight = {heavy}\nactivation = 0.2\nparams = 1.0\n\
         trainable = {trainable}\noutput = 0.01\n\n\
         [llm]\nlayers = {llm}\nforward = 1.0\nbackward = 1.1\nweight = 0.9\nactivation = 1.0\n\
         params = 0.25\noutput = 0.02\n\
         first_stage_extra = {{ forward = 0.05, backward = 0.0, weight = 0.05, params = 0.5 }}\n\
         last_stage_extra = {{ forward = 1.5, backward = 1.5, weight = 1.5, activation = 0.5 }}\n\n\
         [link]\nlatency = 0.01\nbandwidth = 1.0\n"
    ))
    .unwrap()
}

/// Each rank's compute time, and the whole program's.
fn compute(p: &Program) -> Vec<f64> {
    p.programs
        .iter()
        .map(|list| {
            list.iter()
                .filter_map(|a| match a.view() {
                    ActionRef::Compute(c) => {
                        let u = p.units.iter().find(|u| u.name == c.unit).unwrap();
                        Some(c.op.cost(&u.cost))
                    }
                    _ => None,
                })
                .sum()
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Over every body, with the encoder inline, transposed or chained: the layered
    /// program is valid (the derivation verifies it), computes exactly as much on
    /// every rank, has one LLM unit per layer plus the two extras, keeps the
    /// schedule's ideal step (which eager semantics reach with free communication)
    /// and is read against a bound no lower.
    #[test]
    fn layers_keeps_the_work_the_ranks_and_the_ideal_step(
        enc_layers in 1u32..10, heavy in 0.1f64..2.0, trainable: bool,
        p in prop::sample::select(vec![2usize, 4]), k in 1usize..3,
    ) {
        let linked = mllm(enc_layers, heavy, trainable, 16);
        let mut free = linked.clone();
        free.link = None;
        let m = 2 * p * k;
        let mut bodies: Vec<String> = BODIES.iter().map(|b| b.expr()).collect();
        // The placement pinned to the plan's own choice: by default the derivation
        // also tries other placements for the whole expression, so `X` and
        // `layers(X)` could keep different ones (and then different ranks own the
        // encoder's work), which is not what this property is about.
        bodies.push("transpose(vision, zbh1, place = best)".into());
        bodies.push("zb2p(encoders = chain)".into());
        bodies.push("balance(zb2p(encoders = ramp, costs = unit))".into());
        for body in bodies {
            let text = format!("layers({body})");
            for (prof, mode) in [(&linked, Mode::Rendezvous), (&free, Mode::Eager)] {
                let mut req = Request::new(prof, p, m);
                req.mode = mode;
                let whole = derive_str(&req, &body).map_err(|e| TestCaseError::fail(format!("{body}: {e:?}")))?;
                let cut = derive_str(&req, &text).map_err(|e| TestCaseError::fail(format!("{text}: {e:?}")))?;
                for (a, b) in compute(&whole.program).iter().zip(compute(&cut.program)) {
                    prop_assert!(close(*a, b), "{}: {} against {}", text, b, a);
                }
                let llm: Vec<&str> = cut.program.units.iter().map(|u| u.name.as_str()).filter(|n| n.starts_with("llm")).collect();
                prop_assert_eq!(llm.len(), 16 + 2, "{}: {:?}", text, llm);
                prop_assert!(llm.iter().all(|n| n.starts_with("llm/")), "{}: {:?}", text, llm);
                // A whole-stage program is a layer-by-layer one that runs each stage's
                // layers back to back, so a bound on the layered units holds for both;
                // the finer units can only let the release and tail bounds see more.
                prop_assert!(cut.bound.value() >= whole.bound.value() * (1.0 - 1e-12), "{}: bound {} against {}", text, cut.bound.value(), whole.bound.value());
                if mode == Mode::Eager {
                    // Eager semantics reach the ideal step of both plans, the same one.
                    prop_assert!(close(whole.report.makespan, cut.report.makespan), "{}: {} against {}", text, cut.report.makespan, whole.report.makespan);
                }
            }
        }
    }
}

/// Profile `qwen2vl-7b` at 8 x 32 under rendezvous: the lockstep ramp computed layer
/// by layer waits 2.7% less than whole stages (2245.7 ms against 2308.8 ms), with
/// the same peak memory, and `refine` goes around it.
#[test]
fn layer_by_layer_meets_better_under_rendezvous() {
    let prof = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let req = Request::new(&prof, 8, 32);
    let whole = derive_str(&req, "zb2p(encoders = ramp, costs = unit)").unwrap();
    let cut = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
    assert!(
        cut.report.makespan < 0.975 * whole.report.makespan,
        "{} against {}",
        cut.report.makespan,
        whole.report.makespan
    );
    let peak = |d: &mpipe_core::derive::Derived| d.peak_with_params();
    assert!(
        close(peak(&whole), peak(&cut)),
        "{} against {}",
        peak(&cut),
        peak(&whole)
    );
    let refined = derive_str(&req, "refine(layers(zb2p(encoders = ramp, costs = unit)))").unwrap();
    assert!(refined.report.makespan <= cut.report.makespan);
    // The vision chunks are cut too, into the encoder's 32 layers.
    let vision = cut
        .program
        .units
        .iter()
        .filter(|u| u.name.starts_with("vision/"))
        .count();
    assert_eq!(vision, 32);
}

/// `layers` goes around a whole schedule: inside an operator it is refused, with
/// the span on it; around `auto` too. A prefetched frozen encoder stays whole.
#[test]
fn layers_goes_outermost_and_keeps_prefetched_encoders_whole() {
    let prof = mllm(4, 0.5, true, 8);
    let req = Request::new(&prof, 4, 8);
    let errs = derive_str(&req, "transpose(vision, layers(zbh1))").unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].kind, ErrorKind::BadArgument);
    assert!(errs[0].message.contains("outermost"), "{}", errs[0].message);
    assert!(derive_str(&req, "layers(auto)").is_err());
    assert!(derive_str(&req, "layers(zbh1, v = 2)").is_err());

    let frozen = mllm(4, 0.5, false, 8);
    let req = Request::new(&frozen, 4, 8);
    let d = derive_str(&req, "layers(prefetch(vision, zbh1))").unwrap();
    let names: Vec<&str> = d.program.units.iter().map(|u| u.name.as_str()).collect();
    assert!(names.contains(&"vision"), "{names:?}");
    assert!(names.contains(&"llm/7"), "{names:?}");
}

/// The Gantt chart draws a layered program a box per stage task: `layers(zbh1)` has
/// as many boxes as `zbh1`, but for the runs a transfer that waited cuts in two
/// (without merging it would have one per layer: several times as many).
#[test]
fn the_chart_draws_a_stage_task_as_one_box() {
    let mut prof = mllm(4, 0.5, true, 8);
    prof.link = None;
    let req = Request::new(&prof, 4, 8);
    let boxes = |e: &str| {
        let d = derive_str(&req, e).unwrap();
        let svg = gantt_svg(&d.program, &d.report.timeline, &SvgOptions::default());
        (
            svg.matches("class=\"op ").count(),
            svg.matches("class=\"wait\"").count(),
        )
    };
    let (whole, _) = boxes("zbh1");
    let (cut, waits) = boxes("layers(zbh1)");
    assert!(
        cut >= whole && cut <= whole + waits,
        "{cut} boxes against {whole}, {waits} waits"
    );
    assert!(cut < 2 * whole, "{cut} boxes against {whole}");
}

/// `cut_encoder` then `join_encoder` gives the plan back (the layers of each task
/// are consecutive on one rank there), for every body; and an operator over a body
/// whose `fill` cut the encoder into layers joins it first, so the composition
/// derives and verifies.
#[test]
fn an_encoder_cut_into_layers_joins_back() {
    use mpipe_core::generators::generate;
    use mpipe_core::operators::layers::{cut_encoder, join_encoder};
    let prof = mllm(6, 2.0, true, 8);
    for kind in BODIES {
        let plan = generate(kind, &prof, 4, 8).unwrap();
        let (cut, pieces) = cut_encoder(&plan, &prof, 0).expect("six layers");
        assert_eq!(pieces.len(), 6);
        assert_eq!(cut.units[pieces[5]].name, "vision/5");
        let (back, id) = join_encoder(&cut, "vision").expect("the layers join");
        assert_eq!(id, 0);
        for (a, b) in back.units.iter().zip(&plan.units) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.inputs, b.inputs);
            assert!((a.cost.f - b.cost.f).abs() < 1e-9 && (a.act - b.act).abs() < 1e-9);
        }
        assert_eq!(back.order, plan.order, "{kind:?}");
    }
    let req = Request::new(&prof, 4, 8);
    for expr in [
        "fill(vision, fill(vision, zbh1))",
        "transpose(vision, fill(vision, 1f1b))",
    ] {
        let d = derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr}: {}", e[0].message));
        assert!(mpipe_core::verify::verify(&d.program).is_empty(), "{expr}");
    }
}
