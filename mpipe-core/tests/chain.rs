//! Encoder chains: an encoder cut into per-rank layer chunks that pipe into the
//! first stage (`units::encoder_chunks`, `zb2p(encoders = chain)`,
//! `chain(ENCODER, BODY)`, every encoder at once with `zb2p(encoders = chains)`),
//! and the `Join` placement that batches their transfers
//! with the LLM's.

mod common;

use common::BODIES;
use mpipe_core::derive::{derive_str, Derived, ErrorKind, Request};
use mpipe_core::generators::{generate, ramp_split, BodyKind, RampSplit, Weave};
use mpipe_core::lower::{lower_with, Placement};
use mpipe_core::profile::{EncoderProfile, Profile, Split};
use mpipe_core::program::{ActionRef, Dir};
use mpipe_core::units::encoder_chunks;
use mpipe_core::verify::verify;
use proptest::prelude::*;

fn encoder(layers: u32, f: f64, b: f64, w: f64, trainable: bool) -> EncoderProfile {
    EncoderProfile {
        name: "vision".into(),
        layers,
        forward: f,
        backward: b,
        weight: Some(w),
        activation: 0.1,
        params: 2.0,
        trainable,
        output: 0.01,
    }
}

/// A vision encoder of `layers` layers (each `heavy` per pass) before a 16-layer LLM.
fn mllm(layers: u32, heavy: f64, trainable: bool) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {layers}\nforward = {heavy}\n\
         backward = {heavy}\nweight = {heavy}\nactivation = 0.2\nparams = 1.0\n\
         trainable = {trainable}\noutput = 0.01\n\n\
         [llm]\nlayers = 16\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n\
         params = 0.25\noutput = 0.02\n\
         last_stage_extra = {{ forward = 1.0, backward = 1.0, weight = 1.0 }}\n\n\
         [link]\nlatency = 0.01\nbandwidth = 1.0\n"
    ))
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The chunks add up to the encoder, form one chain in data order that walks
    /// down the ranks (cyclically) to the first stage's rank, and the water-filling
    /// leaves no rank that took a layer more than one layer above the least loaded.
    #[test]
    fn chunks_add_up_and_walk_down_to_the_first_stage(
        layers in 1u32..40, f in 0.1f64..2.0, b in 0.1f64..2.0, w in 0.1f64..2.0,
        trainable: bool,
        load in prop::collection::vec(0.0f64..50.0, 1..9),
        first in 0usize..8,
    ) {
        let p = load.len();
        let first = first % p;
        let spec = encoder(layers, f, b, w, trainable);
        let chunks = encoder_chunks(&spec, &load, first);
        prop_assert!(!chunks.is_empty() && chunks.len() <= p);
        let sum = |g: &dyn Fn(&mpipe_core::program::Unit) -> f64| chunks.iter().map(g).sum::<f64>();
        let close = |a: f64, e: f64| (a - e).abs() <= 1e-9 * e.abs().max(1.0);
        prop_assert!(close(sum(&|u| u.cost.f), f * f64::from(layers)));
        prop_assert!(close(sum(&|u| u.cost.b), b * f64::from(layers)));
        prop_assert!(close(sum(&|u| u.params), 2.0));
        // One chain: chunk j reads chunk j - 1, and the ranks' distances below the
        // first stage's (cyclically) strictly decrease.
        let down = |r: usize| (r + p - first) % p;
        for (j, u) in chunks.iter().enumerate() {
            prop_assert_eq!(&u.name, &format!("vision.{j}"));
            if j == 0 {
                prop_assert!(u.inputs.is_empty());
            } else {
                prop_assert_eq!(&u.inputs, &vec![format!("vision.{}", j - 1)]);
                prop_assert!(down(u.home) < down(chunks[j - 1].home));
            }
        }
        // Every rank took a layer: the chain is one neighbour hop at a time and
        // ends on the first stage's rank.
        if chunks.len() == p {
            prop_assert_eq!(chunks[p - 1].home, first);
            for pair in chunks.windows(2) {
                prop_assert_eq!(down(pair[0].home), down(pair[1].home) + 1);
            }
        }
        let per_layer = f + if trainable { b + w } else { 0.0 };
        let mut total = load.clone();
        for u in &chunks {
            total[u.home] += per_layer * (u.cost.f / f);
        }
        let least = total.iter().copied().fold(f64::INFINITY, f64::min);
        for u in &chunks {
            prop_assert!(total[u.home] - per_layer <= least + 1e-9, "{total:?}");
        }
    }

    /// `chain` over every body generator derives a valid program (the derivation
    /// verifies it) in which every chunk computes on its home rank: nothing of the
    /// encoder is broadcast or reduced.
    #[test]
    fn chain_composes_with_every_body(
        layers in 1u32..12, heavy in 0.1f64..3.0, trainable: bool,
        p in prop::sample::select(vec![2usize, 4]), k in 1usize..4,
    ) {
        let prof = mllm(layers, heavy, trainable);
        let m = 2 * p * k;
        let req = Request::new(&prof, p, m);
        for body in BODIES {
            let text = format!("chain(vision, {})", body.expr());
            let d = derive_str(&req, &text).map_err(|e| TestCaseError::fail(format!("{text}: {e:?}")))?;
            prop_assert!(d.program.units.iter().any(|u| u.name == "vision.0"), "{}", text);
            prop_assert!(d.program.units.iter().all(|u| u.name != "vision"), "{}", text);
            for list in &d.program.programs {
                for a in list {
                    if let ActionRef::Coll(c) = a.view() {
                        prop_assert!(!c.unit.starts_with("vision"), "{text}: {a}");
                    }
                    if let ActionRef::Compute(c) = a.view() {
                        let unit = d.program.units.iter().find(|u| u.name == c.unit).unwrap();
                        let rank = d.program.programs.iter().position(|l| std::ptr::eq(l, list)).unwrap();
                        if c.unit.starts_with("vision") {
                            prop_assert_eq!(unit.home, rank, "{}: {}", text, a);
                        }
                    }
                }
            }
        }
    }
}

/// The Qwen2-VL-7B-class profile at its intended size, the plan of the chained
/// encoder woven into ZB-2p: lowered with `Join`, the program is valid and some of
/// its batches carry a chunk's transfer together with a stage's, between the same
/// two neighbours.
#[test]
fn join_batches_chunk_transfers_with_the_stages() {
    let mut prof = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    prof.llm.split = Split::Balanced;
    let kind = BodyKind::Zb2p {
        v: 1,
        vshape: false,
        lockstep: false,
        encoders: Weave::Chain,
    };
    let plan = generate(kind, &prof, 8, 32).unwrap();
    let program = lower_with(&plan, None, Placement::Join).unwrap();
    assert!(verify(&program).is_empty(), "{:?}", verify(&program));
    let mut mixed = 0;
    for list in &program.programs {
        let mut batch: Vec<(Option<u64>, bool, Dir, usize)> = Vec::new();
        for a in list {
            if let ActionRef::P2p(x) = a.view() {
                batch.push((x.batch, x.unit.starts_with("vision"), x.dir, x.peer));
            }
        }
        for w in batch.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0.is_some() && a.0 == b.0 && a.1 != b.1 && a.3 == b.3 {
                mixed += 1;
            }
        }
    }
    assert!(
        mixed > 0,
        "no batch mixes a chunk's transfer with a stage's"
    );
}

/// An operator that needs the encoder whole, over a body that cut it into chunks,
/// says so at the encoder argument.
#[test]
fn an_encoder_cut_into_chunks_cannot_be_placed_again() {
    let prof = mllm(8, 1.0, true);
    let req = Request::new(&prof, 4, 8);
    for text in [
        "chain(vision, chain(vision, zbh1))",
        "transpose(vision, zb2p(encoders = chain))",
        "fill(vision, zb2p(encoders = chain, costs = unit))",
    ] {
        let e = derive_str(&req, text).unwrap_err();
        assert_eq!(e[0].kind, ErrorKind::BadArgument, "{text}");
        assert!(
            e[0].message.contains("no longer one unit"),
            "{text}: {}",
            e[0].message
        );
        assert_eq!(
            e[0].span.start(text).column,
            text.find("vision").unwrap(),
            "{text}"
        );
    }
}

/// Evaluation profile (a), an InternViT-6B-class encoder on 4 ranks: cutting the
/// encoder into a pipeline of its own takes the step from `transpose`'s best
/// (1835 ms on `zbv`) to 1154 ms, and `auto` finds it, layer by layer and refined 1054 ms (the
/// README's table).
#[test]
fn chaining_the_encoder_dominated_profile_beats_transpose() {
    let text = include_str!("../../profiles/eval-a-internvit6b.toml");
    let prof = Profile::from_toml_str(text).unwrap();
    let req = Request::new(&prof, 4, 4);
    let t = |e: &str| derive_str(&req, e).unwrap().report.makespan;
    let chained = t("zb2p(encoders = chain)");
    let transposed = t("transpose(vision, zbv)");
    assert!(
        chained < 0.65 * transposed,
        "{chained} against {transposed}"
    );
    let auto = derive_str(&req, "auto").unwrap();
    assert!(auto.expr.contains("encoders = chain"), "{}", auto.expr);
    assert!(auto.report.makespan <= 1053.5, "{}", auto.report.makespan);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// `zb2p(encoders = ramp)`: the chosen split keeps every LLM layer (at least one
    /// per stage) and every encoder layer, predicts no worse than the water-filled
    /// chain it starts from, and derives a valid program (the derivation verifies
    /// it) whose stages have exactly the chosen layers and whose chunks compute on
    /// their home ranks.
    #[test]
    fn ramp_split_keeps_every_layer_and_predicts_no_worse_than_the_chain(
        layers in 1u32..40, heavy in 0.05f64..3.0, trainable: bool,
        p in prop::sample::select(vec![2usize, 4, 8]), k in 1usize..4,
    ) {
        let prof = mllm(layers, heavy, trainable);
        let m = p * k;
        let units = mpipe_core::units::build_units(&prof, p, 1, mpipe_core::plan::Layout::Looped).unwrap();
        let split = ramp_split(&prof, &units, p, m, 1).expect("an encoder feeds the first stage");
        prop_assert_eq!(split.llm.iter().sum::<usize>(), 16);
        prop_assert!(split.llm.iter().all(|&l| l >= 1), "{:?}", split.llm);
        prop_assert_eq!(split.chunks.iter().sum::<u32>(), layers);
        prop_assert!(split.floor <= split.start + 1e-9, "{} > {}", split.floor, split.start);
        for costs in ["", ", costs = unit"] {
            let text = format!("zb2p(encoders = ramp{costs})");
            let d = derive_str(&Request::new(&prof, p, m), &text)
                .map_err(|e| TestCaseError::fail(format!("{text}: {e:?}")))?;
            for (r, &l) in split.llm.iter().enumerate() {
                let stage = d.program.units.iter().find(|u| u.name == format!("llm.{r}")).unwrap();
                let extra = if r + 1 == p { 1.0 } else { 0.0 };
                prop_assert!((stage.cost.f - (l as f64 + extra)).abs() < 1e-9, "{}: stage {}", text, r);
            }
            for list in &d.program.programs {
                let rank = d.program.programs.iter().position(|l| std::ptr::eq(l, list)).unwrap();
                for a in list {
                    if let ActionRef::Compute(c) = a.view() {
                        if c.unit.starts_with("vision") {
                            let unit = d.program.units.iter().find(|u| u.name == c.unit).unwrap();
                            prop_assert_eq!(unit.home, rank, "{}: {}", text, a);
                            prop_assert_eq!(
                                unit.cost.f, heavy * f64::from(split.chunks[rank]),
                                "{}: {}", text, a
                            );
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// `zb2p(v = 2, encoders = ramp)`: the split keeps every layer, two on every rank
    /// but the last (one per chunk), predicts no worse than where it started, and
    /// derives a valid program (the derivation verifies it), in lockstep too.
    #[test]
    fn the_ramp_over_two_chunks_keeps_every_layer_and_derives(
        layers in 1u32..40, heavy in 0.05f64..3.0, trainable: bool,
        p in prop::sample::select(vec![2usize, 4, 8]), k in 1usize..4,
    ) {
        let prof = mllm(layers, heavy, trainable);
        let m = p * k;
        let units = mpipe_core::units::build_units(&prof, p, 1, mpipe_core::plan::Layout::Looped).unwrap();
        let split = ramp_split(&prof, &units, p, m, 2).expect("an encoder feeds the first stage");
        prop_assert_eq!(split.llm.iter().sum::<usize>(), 16);
        prop_assert!(split.llm[..p - 1].iter().all(|&l| l >= 2), "{:?}", split.llm);
        prop_assert!(split.llm[p - 1] >= 1, "{:?}", split.llm);
        prop_assert_eq!(split.chunks.iter().sum::<u32>(), layers);
        prop_assert!(split.floor <= split.start + 1e-9, "{} > {}", split.floor, split.start);
        for costs in ["", ", costs = unit"] {
            let text = format!("zb2p(v = 2, encoders = ramp{costs})");
            let d = derive_str(&Request::new(&prof, p, m), &text)
                .map_err(|e| TestCaseError::fail(format!("{text}: {e:?}")))?;
            let stages = d.program.units.iter().filter(|u| u.name.starts_with("llm.")).count();
            prop_assert_eq!(stages, 2 * p, "{}", text);
        }
    }
}

/// `profiles/qwen2vl-7b.toml`.
fn qwen2vl_7b() -> Profile {
    Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap()
}

/// `req`'s ramp split over `v` chunks per rank and `expr` derived, checked to come
/// within 0.5% of the ramp model's prediction.
fn eager_ramp(req: &Request, v: usize, expr: &str) -> (RampSplit, Derived) {
    let (prof, p, m) = (req.profile, req.ranks, req.microbatches);
    let units =
        mpipe_core::units::build_units(prof, p, 1, mpipe_core::plan::Layout::Looped).unwrap();
    let split = ramp_split(prof, &units, p, m, v).unwrap();
    let d = derive_str(req, expr).unwrap();
    let got = d.report.makespan;
    assert!(
        (got - split.floor).abs() <= 0.005 * split.floor,
        "{expr}: simulated {got:.1}, predicted {:.1} ({:?} / {:?})",
        split.floor,
        split.llm,
        split.chunks
    );
    (split, d)
}

/// A request for `prof` at 8 x 32 with asynchronous sends.
fn eager_8x32(prof: &Profile) -> Request<'_> {
    let mut req = Request::new(prof, 8, 32);
    req.mode = mpipe_core::simulate::Mode::Eager;
    req
}

/// On Qwen2-VL-7B (8 x 32) the ramp model predicts the woven list schedule's step
/// with asynchronous sends to within 0.5%, and the split it chooses beats the
/// water-filled chain's (1.048 of the bound) by more than a point.
#[test]
fn the_ramp_model_predicts_the_eager_step_and_improves_on_the_chain() {
    let prof = qwen2vl_7b();
    let req = eager_8x32(&prof);
    let (_, ramp) = eager_ramp(&req, 1, "zb2p(encoders = ramp)");
    let chain = derive_str(&req, "balance(zb2p(encoders = chain))").unwrap();
    let got = ramp.report.makespan;
    let (r, c) = (
        got / ramp.bound.value(),
        chain.report.makespan / chain.bound.value(),
    );
    assert!(r + 0.01 < c, "ramp {r:.4}, chain {c:.4}");
    assert!(r <= 1.04, "ramp {r:.4}");
}

/// With two looped chunks per rank (`v = 2`) the first micro-batch reaches the last
/// ranks twice as soon, so less of their warm-up waits: on Qwen2-VL-7B (8 x 32) with
/// asynchronous sends the step is more than a point closer to the bound than with
/// one, the model still predicts it, and each rank's layers are halved between its
/// chunks (the LM head last).
#[test]
fn the_ramp_over_two_chunks_per_rank_shortens_the_warm_up() {
    let prof = qwen2vl_7b();
    let req = eager_8x32(&prof);
    let (split, two) = eager_ramp(&req, 2, "zb2p(v = 2, encoders = ramp)");
    let one = derive_str(&req, "zb2p(encoders = ramp)").unwrap();
    let (r1, r2) = (
        one.report.makespan / one.bound.value(),
        two.report.makespan / two.bound.value(),
    );
    assert!(
        r2 + 0.005 < r1 && r2 <= 1.03,
        "v = 2: {r2:.4}, v = 1: {r1:.4}"
    );
    // Stages: chunk 0 of ranks 0..8, then chunk 1; every rank but the last keeps a
    // layer in each, the last's second chunk holds the LM head.
    let layout = split.layout(2);
    let stages: Vec<&str> = layout.split('|').collect();
    assert_eq!(stages.len(), 16, "{layout}");
    for r in 0..8 {
        let layers = |s: &str| s.matches('t').count();
        assert_eq!(
            layers(stages[r]) + layers(stages[8 + r]),
            split.llm[r],
            "{layout}"
        );
        if r < 7 {
            assert!(layers(stages[8 + r]) >= 1, "{layout}");
        }
    }
    assert!(stages[15].ends_with('L'), "{layout}");
}

/// `encoders = ramp` chooses the split itself: with chunks per rank other than one
/// or two looped, or a profile that fixes the split, it is refused, saying why.
#[test]
fn ramp_refuses_what_it_cannot_split() {
    let prof = mllm(8, 1.0, true);
    let req = Request::new(&prof, 4, 8);
    for text in [
        "zb2p(encoders = ramp, v = 3)",
        "zb2p(encoders = ramp, layout = v)",
    ] {
        let e = derive_str(&req, text).unwrap_err();
        assert_eq!(e[0].kind, ErrorKind::BadArgument, "{text}: {e:?}");
        assert!(
            e[0].message.contains("one or two looped stages per rank"),
            "{}",
            e[0].message
        );
    }
    let mut fixed = prof.clone();
    fixed.llm.layout = Some("Etttt|tttt|tttt|ttttL".into());
    let e = derive_str(&Request::new(&fixed, 4, 8), "zb2p(encoders = ramp)").unwrap_err();
    assert!(e[0].message.contains("llm.layout"), "{}", e[0].message);
}

/// Two encoders before a 16-layer LLM: `vision` (`v_layers` layers of `v_heavy` per
/// pass, trainable or not) and `audio` (`a_layers` of `a_heavy`, trainable or not).
fn two_encoders(
    v_layers: u32,
    v_heavy: f64,
    v_train: bool,
    a_layers: u32,
    a_heavy: f64,
    a_train: bool,
) -> Profile {
    let enc = |name: &str, layers: u32, heavy: f64, train: bool| {
        format!(
            "[[encoder]]\nname = \"{name}\"\nlayers = {layers}\nforward = {heavy}\n\
             backward = {heavy}\nweight = {heavy}\nactivation = 0.2\nparams = 1.0\n\
             trainable = {train}\noutput = 0.01\n\n"
        )
    };
    Profile::from_toml_str(&format!(
        "{}{}[llm]\nlayers = 16\nforward = 1.0\nbackward = 1.0\nweight = 1.0\n\
         activation = 1.0\nparams = 0.25\noutput = 0.02\n\
         last_stage_extra = {{ forward = 1.0, backward = 1.0, weight = 1.0 }}\n",
        enc("vision", v_layers, v_heavy, v_train),
        enc("audio", a_layers, a_heavy, a_train)
    ))
    .unwrap()
}

/// The README's worst random profile before `encoders = chains` (1.190 of the bound,
/// `auto` = `layers(split_w(fill(audio, fill(vision, gpipe))))`): two trainable
/// encoders that together outweigh the LLM. Chaining only the heavier one leaves the
/// other inline on the first stage's rank, which then carries far more than its share;
/// chaining both spreads them.
#[test]
fn chaining_every_encoder_spreads_encoders_that_outweigh_the_llm() {
    let prof = Profile::from_toml_str(
        "[[encoder]]\nname = \"vision\"\nlayers = 24\nforward = 0.4863276666339552\n\
         backward = 1.52717807252238\nweight = 0.10158538562075986\nactivation = 0.1\n\
         trainable = true\n\n\
         [[encoder]]\nname = \"audio\"\nlayers = 7\nforward = 0.9461593554715834\n\
         backward = 0.9461593554715834\nweight = 0.4730796777357917\nactivation = 0.1\n\
         trainable = true\n\n\
         [llm]\nlayers = 16\nforward = 1.46339959373361\nbackward = 1.1302023709898175\n\
         weight = 1.1031553421230276\nactivation = 1.0\n",
    )
    .unwrap();
    let req = Request::new(&prof, 8, 24);
    let t = |e: &str| derive_str(&req, e).unwrap().report.makespan;
    let one = t("zb2p(encoders = chain)");
    let all = t("zb2p(encoders = chains)");
    assert!(all < 0.7 * one, "chains {all}, chain {one}");
    // `auto` finds chaining or something at least as fast, close to the bound.
    let auto = derive_str(&req, "auto").unwrap();
    let ratio = auto.report.makespan / auto.bound.value();
    assert!(
        auto.report.makespan <= all * (1.0 + 1e-9),
        "{}: {} behind zb2p(encoders = chains) {all}",
        auto.expr,
        auto.report.makespan
    );
    assert!(ratio < 1.08, "{}: {ratio}", auto.expr);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `zb2p(encoders = chains)`: every encoder is cut into chunks on its home ranks,
    /// all of them along the carrier's ranks (a rider's rank always holds a chunk of
    /// the carrier, the heaviest trainable encoder), every layer kept, and the
    /// program derives (the derivation verifies it), in lockstep too. A trainable
    /// rider runs its backward after the carrier's on the same rank.
    #[test]
    fn chains_keep_every_layer_on_the_carriers_ranks(
        v_layers in 1u32..30, v_heavy in 0.05f64..3.0, v_train: bool,
        a_layers in 1u32..30, a_heavy in 0.05f64..3.0, a_train: bool,
        p in prop::sample::select(vec![2usize, 4, 8]), k in 1usize..4,
    ) {
        let prof = two_encoders(v_layers, v_heavy, v_train, a_layers, a_heavy, a_train);
        let m = p * k;
        let work = |l: u32, h: f64, t: bool| f64::from(l) * h * if t { 3.0 } else { 1.0 };
        let (vw, aw) = (work(v_layers, v_heavy, v_train), work(a_layers, a_heavy, a_train));
        // The carrier: the heaviest trainable encoder, else the heaviest (vision on ties).
        let carrier = match (v_train, a_train) {
            (true, false) => "vision",
            (false, true) => "audio",
            _ => if aw > vw { "audio" } else { "vision" },
        };
        for costs in ["", ", costs = unit"] {
            let text = format!("zb2p(encoders = chains{costs})");
            let d = derive_str(&Request::new(&prof, p, m), &text)
                .map_err(|e| TestCaseError::fail(format!("{text}: {e:?}")))?;
            let units = &d.program.units;
            for (name, layers, heavy) in [("vision", v_layers, v_heavy), ("audio", a_layers, a_heavy)] {
                let chunks: Vec<_> = units.iter().filter(|u| u.name.starts_with(&format!("{name}."))).collect();
                let total: f64 = chunks.iter().map(|u| u.cost.f).sum();
                prop_assert!((total - f64::from(layers) * heavy).abs() < 1e-9, "{}: {} layers", text, name);
                for c in &chunks {
                    let on_carrier = units.iter().any(|u| u.name.starts_with(&format!("{carrier}.")) && u.home == c.home);
                    prop_assert!(on_carrier, "{}: {} on rank {} without a carrier chunk", text, c.name, c.home);
                }
            }
            // Every chunk computes on its home rank; a rider's task comes after the
            // carrier chunk's same task on its rank.
            for (rank, list) in d.program.programs.iter().enumerate() {
                for (i, a) in list.iter().enumerate() {
                    if let ActionRef::Compute(c) = a.view() {
                        if c.unit.starts_with("llm") {
                            continue;
                        }
                        let u = units.iter().find(|u| u.name == c.unit).unwrap();
                        prop_assert_eq!(u.home, rank, "{}: {}", text, a);
                        if !c.unit.starts_with(&format!("{carrier}.")) {
                            let carried = list[..i].iter().any(|b| matches!(b.view(),
                                ActionRef::Compute(x) if x.op == c.op && x.mb == c.mb
                                    && x.unit.starts_with(&format!("{carrier}."))));
                            prop_assert!(carried, "{}: rank {}: {} before its carrier's", text, rank, a);
                        }
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// `balance(zb2p(encoders = chains))` chooses the LLM's split with the chunks:
    /// every layer kept, at least one per stage, and its busiest rank computes no
    /// more than the even split's.
    #[test]
    fn balanced_chains_never_load_the_busiest_rank_more(
        v_layers in 1u32..30, v_heavy in 0.05f64..3.0, v_train: bool,
        a_layers in 1u32..30, a_heavy in 0.05f64..3.0, a_train: bool,
        p in prop::sample::select(vec![2usize, 4, 8]),
    ) {
        let prof = two_encoders(v_layers, v_heavy, v_train, a_layers, a_heavy, a_train);
        let req = Request::new(&prof, p, 2 * p);
        let busiest = |e: &str| -> Result<(f64, Derived), TestCaseError> {
            let d = derive_str(&req, e).map_err(|x| TestCaseError::fail(format!("{e}: {x:?}")))?;
            Ok((d.report.compute.iter().copied().fold(0.0, f64::max), d))
        };
        let (even, _) = busiest("zb2p(encoders = chains)")?;
        let (balanced, d) = busiest("balance(zb2p(encoders = chains))")?;
        prop_assert!(balanced <= even * (1.0 + 1e-9), "{} > {}", balanced, even);
        let stages: Vec<f64> = (0..p)
            .map(|r| d.program.units.iter().find(|u| u.name == format!("llm.{r}")).unwrap().cost.f)
            .collect();
        // Layers of 1.0 each, the LM head 1.0 more on the last stage.
        let total: f64 = stages.iter().sum::<f64>() - 1.0;
        prop_assert!((total - 16.0).abs() < 1e-9, "{:?}", stages);
        prop_assert!(stages.iter().all(|&f| f >= 1.0 - 1e-9), "{:?}", stages);
    }
}

/// `encoders = chains` needs two encoders and one chunk per rank, and says so.
#[test]
fn chains_refuse_what_they_cannot_chain() {
    let one = mllm(8, 1.0, true);
    let e = derive_str(&Request::new(&one, 4, 8), "zb2p(encoders = chains)").unwrap_err();
    assert_eq!(e[0].kind, ErrorKind::BadArgument, "{e:?}");
    assert!(
        e[0].message.contains("at least two encoders"),
        "{}",
        e[0].message
    );
    let two = two_encoders(8, 1.0, true, 4, 1.0, false);
    for text in [
        "zb2p(encoders = chains, v = 2)",
        "zb2p(encoders = chains, layout = v)",
    ] {
        let e = derive_str(&Request::new(&two, 4, 8), text).unwrap_err();
        assert!(
            e[0].message.contains("one chunk per rank"),
            "{text}: {}",
            e[0].message
        );
    }
    // And an encoder chained is no longer one unit for an operator to move.
    let e = derive_str(
        &Request::new(&two, 4, 8),
        "transpose(audio, zb2p(encoders = chains))",
    )
    .unwrap_err();
    assert!(
        e[0].message.contains("cut into layer chunks"),
        "{}",
        e[0].message
    );
}
