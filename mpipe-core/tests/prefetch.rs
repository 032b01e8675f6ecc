//! `prefetch(ENCODER, BODY)` and the program format's `prefetch` extension: derived
//! programs verify and run under both semantics, the ideal step never grows, and the
//! verifier rejects what would read data the previous step did not leave.

mod common;

use common::BODIES;
use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::derive::{derive_str, ErrorKind, Request};
use mpipe_core::generators::generate;
use mpipe_core::operators::prefetch::prefetch;
use mpipe_core::plan::Plan;
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, Dir, Prefetch, Program, Tensor};
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use mpipe_core::verify::{verify, Rule};
use proptest::prelude::*;

fn frozen(layers: u32, ef: f64, f: f64, b: f64, w: f64) -> Profile {
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"vision\"\nlayers = {layers}\nforward = {ef}\nbackward = {ef}\n\
         activation = 0.1\ntrainable = false\n\n\
         [llm]\nlayers = 16\nforward = {f}\nbackward = {b}\nweight = {w}\nactivation = 1.0\n"
    ))
    .unwrap()
}

fn span(p: &Plan) -> f64 {
    timing(p, &dependencies(p).unwrap()).unwrap().makespan()
}

fn runs(p: &Program) -> Result<(), TestCaseError> {
    for mode in [Mode::Rendezvous, Mode::Eager] {
        let opts = SimOptions { mode, comm: None };
        prop_assert!(
            simulate(p, &opts).is_ok(),
            "{mode:?}: {:?}",
            simulate(p, &opts).err()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn prefetch_derives_valid_programs_never_slower_ideally(
        layers in 1u32..32, ef in 0.05f64..2.0,
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.0f64..1.5,
        p in prop::sample::select(vec![2usize, 4, 8]), k in 1usize..4,
    ) {
        let m = 2 * p * k;
        let prof = frozen(layers, ef, f, b, w);
        let req = Request::new(&prof, p, m);
        for kind in BODIES {
            let name = &kind.expr();
            let body = generate(kind, &prof, p, m).unwrap();
            let pre = prefetch(body.clone(), 0, &prof).unwrap();
            prop_assert!(span(&pre) <= span(&body) * (1.0 + 1e-12));
            for expr in [
                format!("prefetch(vision, {name})"),
                format!("prefetch(vision, transpose(vision, {name}))"),
                format!("prefetch(vision, fill(vision, {name}))"),
            ] {
                let d = derive_str(&req, &expr).map_err(|e| TestCaseError::fail(format!("{expr}: {}", e[0].message)))?;
                let vs = verify(&d.program);
                prop_assert!(vs.is_empty(), "{expr}: {vs:?}");
                runs(&d.program)?;
                prop_assert!(d.report.makespan >= d.bound.value() * (1.0 - 1e-9));
                // The JSON keeps the extension.
                let back = Program::from_json(&d.program.to_json()).unwrap();
                prop_assert_eq!(&back, &d.program);
            }
        }
    }
}

/// A frozen encoder as heavy as the LLM's stages, inline under ZB-H1: prefetching
/// its first forwards into the step's idle time takes them out of the ramp-up
/// (224 -> 134 under rendezvous, within 5% of the bound).
fn heavy() -> (Profile, Program) {
    let prof = frozen(8, 1.0, 0.5, 0.5, 0.5);
    let req = Request::new(&prof, 4, 16);
    let base = derive_str(&req, "zbh1").unwrap();
    let d = derive_str(&req, "prefetch(vision, zbh1)").unwrap();
    assert!(!d.program.prefetch.is_empty());
    assert!(d.report.makespan < 0.7 * base.report.makespan);
    assert!(d.report.makespan <= 1.05 * d.bound.value());
    (prof, d.program)
}

#[test]
fn the_verifier_wants_the_previous_steps_copy_on_the_reading_rank() {
    let (_, p) = heavy();
    assert!(verify(&p).is_empty());
    // Take away the receive that leaves a prefetched activation on its reader's rank
    // (the encoder's last layer's, when `prefetch` cut it into layers).
    let crosses = |e: &Prefetch| {
        p.programs.iter().flatten().any(|a| {
            matches!(a, Action::RECV { tensor: Tensor::Act, unit, mb, .. } if *unit == e.unit && *mb as usize == e.mb)
        })
    };
    let Prefetch { unit, mb } = p
        .prefetch
        .iter()
        .find(|e| crosses(e))
        .cloned()
        .expect("a prefetched activation crosses ranks here");
    let mut q = p.clone();
    let mut removed = false;
    for list in &mut q.programs {
        if let Some(i) = list.iter().position(|a| {
            matches!(a, Action::RECV { tensor: Tensor::Act, unit: u, mb: x, .. } if *u == unit && *x as usize == mb)
        }) {
            list.remove(i);
            removed = true;
        }
    }
    assert!(removed, "the prefetched activation crosses ranks here");
    // Its sender's SEND goes too, so only rule 2 can object.
    for list in &mut q.programs {
        list.retain(|a| {
            !matches!(a, Action::SEND { tensor: Tensor::Act, unit: u, mb: x, .. } if *u == unit && *x as usize == mb)
        });
    }
    let vs = verify(&q);
    assert!(
        vs.iter()
            .any(|v| v.rule == Rule::LocalData && v.message.contains(&format!("act({unit},{mb})"))),
        "{vs:?}"
    );
    // Without the extension, the same program reads data produced later.
    let mut r = p.clone();
    r.prefetch.clear();
    assert!(verify(&r).iter().any(|v| v.rule == Rule::LocalData));
}

#[test]
fn only_frozen_units_can_be_prefetched() {
    let (_, p) = heavy();
    let mut q = p.clone();
    q.units[0].trainable = true;
    assert!(verify(&q)
        .iter()
        .any(|v| v.rule == Rule::LocalData && v.message.contains("only a frozen unit")));
    let mut q = p.clone();
    q.prefetch.push(Prefetch {
        unit: "nope".into(),
        mb: 0,
    });
    assert!(verify(&q)
        .iter()
        .any(|v| v.message.contains("unknown unit `nope`")));
    // The operator refuses a trainable encoder, saying why.
    let prof = Profile::from_toml_str(
        "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 1.0\nbackward = 1.0\nweight = 1.0\n\
         activation = 0.1\ntrainable = true\n\n[llm]\nlayers = 4\nforward = 1.0\nbackward = 1.0\n\
         weight = 1.0\nactivation = 1.0\n",
    )
    .unwrap();
    let req = Request::new(&prof, 2, 4);
    let e = derive_str(&req, "prefetch(vision, 1f1b)").unwrap_err();
    assert_eq!(e[0].kind, ErrorKind::BadArgument);
    assert!(
        e[0].message.contains("needs a frozen encoder"),
        "{}",
        e[0].message
    );
}

#[test]
fn prefetch_transfers_come_last_one_at_a_time() {
    let (_, p) = heavy();
    let mut checked = 0;
    for list in &p.programs {
        let first = list.iter().position(|a| {
            matches!(a, Action::SEND { tensor: Tensor::Act, unit, .. } | Action::RECV { tensor: Tensor::Act, unit, .. } if unit.starts_with("vision"))
                && p.prefetch.iter().any(|e| matches!(a, Action::SEND { mb, .. } | Action::RECV { mb, .. } if *mb as usize == e.mb))
        });
        if let Some(i) = first {
            checked += 1;
            for a in &list[i..] {
                assert!(
                    matches!(
                        a,
                        Action::SEND { batch: None, .. } | Action::RECV { batch: None, .. }
                    ),
                    "{a}"
                );
            }
        }
    }
    assert!(checked > 0, "some prefetched activation crosses ranks");
    let _ = Dir::Send;
}

/// The worst random profile of the README's report, simplified: a frozen encoder
/// whose forward (13 layers, 24 ms) is longer than any idle gap of `zbv`'s ramps.
/// Whole forwards only go to the ranks' ends; layer by layer, the gaps that hold a
/// layer take one, and the ideal step is shorter than with the same encoder as one
/// layer (same costs, so only whole forwards).
#[test]
fn layer_by_layer_fills_gaps_a_whole_forward_cannot() {
    let layered = frozen(13, 1.87, 1.19, 1.81, 0.97);
    let whole = frozen(1, 13.0 * 1.87, 1.19, 1.81, 0.97);
    let ideal = |prof: &Profile| {
        let body = generate(BODIES[4], prof, 8, 8).unwrap(); // zbv
        span(&prefetch(body, 0, prof).unwrap())
    };
    let (cut, one) = (ideal(&layered), ideal(&whole));
    assert!(cut < one * 0.995, "layer by layer {cut}, whole {one}");
    // The program names the layers, prefetches each of them, and verifies.
    let req = Request::new(&layered, 8, 8);
    let d = derive_str(&req, "prefetch(vision, zbv)").unwrap();
    assert!(d.program.units.iter().any(|u| &*u.name == "vision/12"));
    assert!(d.program.prefetch.iter().any(|e| &*e.unit == "vision/0"));
    assert!(verify(&d.program).is_empty());
}

/// A prefetched layer reads the layer before it from this step: the verifier wants
/// that layer earlier on the rank, and wants a prefetched unit's inputs prefetched.
#[test]
fn prefetched_layers_read_each_other_in_the_same_step() {
    let prof = frozen(13, 1.87, 1.19, 1.81, 0.97);
    let req = Request::new(&prof, 8, 8);
    let d = derive_str(&req, "prefetch(vision, zbv)").unwrap();
    let p = d.program;
    assert!(verify(&p).is_empty());
    // Swap the first two layers of one prefetched micro-batch on their rank.
    let is = |a: &Action, name: &str, m: usize| matches!(a, Action::F { unit, mb } if &**unit == name && *mb as usize == m);
    let mut q = p.clone();
    let (r, i) = q
        .programs
        .iter()
        .enumerate()
        .find_map(|(r, l)| l.iter().position(|a| is(a, "vision/0", 0)).map(|i| (r, i)))
        .expect("vision/0 of micro-batch 0");
    let j = q.programs[r]
        .iter()
        .position(|a| is(a, "vision/1", 0))
        .expect("the next layer on the same rank");
    q.programs[r].swap(i, j);
    let vs = verify(&q);
    assert!(
        vs.iter()
            .any(|v| v.rule == Rule::LocalData && v.message.contains("act(vision/0,0)")),
        "{vs:?}"
    );
    // Prefetching a layer but not the one it reads is refused.
    let mut q = p.clone();
    q.prefetch
        .retain(|e| !(&*e.unit == "vision/0" && e.mb == 0));
    let vs = verify(&q);
    assert!(
        vs.iter().any(
            |v| v.rule == Rule::LocalData && v.message.contains("but not its input `vision/0`")
        ),
        "{vs:?}"
    );
}
