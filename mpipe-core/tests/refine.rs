//! `refine(SCHEDULE)`: moving transfers where ranks wait never makes a program
//! slower, keeps it valid and deadlock-free under rendezvous, is deterministic,
//! and is what `auto` names when it gains.

use mpipe_core::derive::{derive_str, ErrorKind, Request};
use mpipe_core::evaluation::intended_size;
use mpipe_core::profile::Profile;
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use mpipe_core::verify::verify;
use proptest::prelude::*;

fn profile(f: f64, b: f64, w: f64, last: f64, enc: Option<(f64, bool)>, link: bool) -> Profile {
    let encoder = enc.map_or(String::new(), |(ef, trainable)| {
        format!(
            "[[encoder]]\nname = \"vision\"\nlayers = 4\nforward = {ef}\nbackward = {ef}\nweight = {ef}\n\
             activation = 0.1\ntrainable = {trainable}\noutput = 0.5\n\n"
        )
    });
    let link = if link {
        "\n[link]\nlatency = 0.05\nbandwidth = 10.0\n"
    } else {
        ""
    };
    Profile::from_toml_str(&format!(
        "{encoder}[llm]\nlayers = 16\nforward = {f}\nbackward = {b}\nweight = {w}\nactivation = 1.0\noutput = 1.0\n\
         last_stage_extra = {{ forward = {last}, backward = {last}, weight = {last} }}\n{link}"
    ))
    .unwrap()
}

const BODIES: [&str; 6] = [
    "1f1b",
    "split_w(interleaved(v = 2))",
    "zbh1",
    "zbv",
    "zb2p",
    "transpose(vision, split_w(1f1b))",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn refine_is_valid_and_never_slower(
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.05f64..2.0, last in 0.0f64..4.0,
        ef in 0.1f64..3.0, trainable: bool, link: bool,
        p in prop::sample::select(vec![2usize, 4]), k in 1usize..4,
    ) {
        let m = 2 * p * k;
        let prof = profile(f, b, w, last, Some((ef, trainable)), link);
        let req = Request::new(&prof, p, m);
        for body in BODIES {
            let plain = derive_str(&req, body).unwrap();
            let text = format!("refine({body})");
            let refined = derive_str(&req, &text).unwrap();
            prop_assert!(
                refined.report.makespan <= plain.report.makespan * (1.0 + 1e-12),
                "{text}: {} > {}", refined.report.makespan, plain.report.makespan
            );
            prop_assert!(verify(&refined.program).is_empty(), "{text}: invalid");
            for mode in [Mode::Rendezvous, Mode::Eager] {
                let opts = SimOptions { mode, comm: None };
                let runs = simulate(&refined.program, &opts).is_ok();
                prop_assert!(runs, "{text} does not run under {mode:?}");
            }
            // Deterministic.
            let again = derive_str(&req, &text).unwrap();
            prop_assert_eq!(&again.program, &refined.program);
            prop_assert_eq!(&refined.program.source.as_ref().unwrap().expr, &text);
        }
    }
}

/// On the evaluation's profile (b), refinement gains (the figure the README
/// reports comes from it), and `auto`'s `refine(X)` is reproducible as written.
#[test]
fn refine_gains_on_profile_b_and_auto_names_it() {
    let text = include_str!("../../profiles/eval-b-qwen2vl72b-frozen.toml");
    let prof = Profile::from_toml_str(text).unwrap();
    let (p, m) = intended_size(text).unwrap();
    let req = Request::new(&prof, p, m);
    let auto = derive_str(&req, "auto").unwrap();
    // `refine(X)`, or `refine(X, order = N)` when ordering the compute gained too.
    let inner = auto
        .expr
        .strip_prefix("refine(")
        .and_then(|x| x.strip_suffix(')'))
        .map(|x| x.rsplit_once(", order = ").map_or(x, |(x, _)| x))
        .unwrap_or_else(|| panic!("auto chose {}", auto.expr));
    let plain = derive_str(&req, inner).unwrap();
    assert!(auto.report.makespan < plain.report.makespan);
    let again = derive_str(&req, &auto.expr).unwrap();
    assert_eq!(again.report.makespan, auto.report.makespan);
}

#[test]
fn refine_takes_one_schedule_at_the_top() {
    let prof = profile(1.0, 1.0, 1.0, 0.0, None, false);
    let req = Request::new(&prof, 2, 4);
    for (text, says) in [
        ("refine(auto)", "not `auto`"),
        ("refine(refine(1f1b))", "not `refine`"),
        ("split_w(refine(1f1b))", "outermost"),
        ("refine(1f1b, zbh1)", "takes one body"),
        ("refine(1f1b, x = 1)", "unknown argument `x` of `refine`"),
    ] {
        let e = derive_str(&req, text).unwrap_err();
        assert!(
            e.iter()
                .any(|e| e.kind == ErrorKind::BadArgument && e.message.contains(says)),
            "{text}: {:?}",
            e.iter().map(|e| &e.message).collect::<Vec<_>>()
        );
    }
}

/// Evaluation profile (a) layer by layer: after the transfers, `refine` moves weight
/// gradients into the waits left (and out of the way of late partners), 3% off the
/// step; every moved `W` still follows its `B` (the derivation verifies the program).
#[test]
fn refine_moves_weight_gradients_into_waits() {
    let text = include_str!("../../profiles/eval-a-internvit6b.toml");
    let prof = Profile::from_toml_str(text).unwrap();
    let req = Request::new(&prof, 4, 4);
    let plain = derive_str(&req, "layers(balance(zb2p(encoders = chain)))").unwrap();
    let refined = derive_str(&req, "refine(layers(balance(zb2p(encoders = chain))))").unwrap();
    assert!(
        refined.report.makespan < 0.97 * plain.report.makespan,
        "{} against {}",
        refined.report.makespan,
        plain.report.makespan
    );
    let compute = |p: &mpipe_core::program::Program| -> Vec<Vec<String>> {
        p.programs
            .iter()
            .map(|l| {
                l.iter()
                    .filter(|a| matches!(a.view(), mpipe_core::program::ActionRef::Compute(_)))
                    .map(|a| a.to_string())
                    .collect()
            })
            .collect()
    };
    assert_ne!(
        compute(&plain.program),
        compute(&refined.program),
        "no W moved"
    );
    assert!(verify(&refined.program).is_empty());
}
