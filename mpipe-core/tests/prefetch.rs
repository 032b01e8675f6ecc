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
            let pre = prefetch(body.clone(), 0).unwrap();
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
    // Take away the receive that leaves a prefetched activation on its reader's rank.
    let Prefetch { unit, mb } = p.prefetch[0].clone();
    let mut q = p.clone();
    let mut removed = false;
    for list in &mut q.programs {
        if let Some(i) = list.iter().position(|a| {
            matches!(a, Action::RECV { tensor: Tensor::Act, unit: u, mb: x, .. } if *u == unit && *x == mb)
        }) {
            list.remove(i);
            removed = true;
        }
    }
    assert!(removed, "the prefetched activation crosses ranks here");
    // Its sender's SEND goes too, so only rule 2 can object.
    for list in &mut q.programs {
        list.retain(|a| {
            !matches!(a, Action::SEND { tensor: Tensor::Act, unit: u, mb: x, .. } if *u == unit && *x == mb)
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
    for list in &p.programs {
        let first = list.iter().position(|a| {
            matches!(a, Action::SEND { tensor: Tensor::Act, unit, .. } | Action::RECV { tensor: Tensor::Act, unit, .. } if &**unit == "vision")
                && p.prefetch.iter().any(|e| matches!(a, Action::SEND { mb, .. } | Action::RECV { mb, .. } if *mb == e.mb))
        });
        if let Some(i) = first {
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
    let _ = Dir::Send;
}
