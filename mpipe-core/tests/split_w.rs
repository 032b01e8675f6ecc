//! `split_w(BODY)`: every body's split program is valid and its ideal step is never
//! longer than the body's; on 1F1B it recovers ZB-H1's gain.

mod common;

use common::BODIES;
use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::derive::{derive_str, ErrorKind, Request};
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::operators::split_w::split_w;
use mpipe_core::plan::Plan;
use mpipe_core::profile::Profile;
use proptest::prelude::*;

fn span(p: &Plan) -> f64 {
    timing(p, &dependencies(p).unwrap()).unwrap().makespan()
}

fn profile(f: f64, b: f64, w: f64, enc: bool) -> Profile {
    let encoder = if enc {
        "[[encoder]]\nname = \"vision\"\nlayers = 4\nforward = 0.5\nbackward = 0.5\nweight = 0.25\nactivation = 0.1\ntrainable = true\n\n"
    } else {
        ""
    };
    Profile::from_toml_str(&format!(
        "{encoder}[llm]\nlayers = 16\nforward = {f}\nbackward = {b}\nweight = {w}\nactivation = 1.0\n"
    ))
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn split_is_valid_and_never_slower(
        f in 0.2f64..2.0, b in 0.2f64..2.0, w in 0.05f64..2.0, enc: bool,
        p in prop::sample::select(vec![2usize, 4]), k in 1usize..4,
    ) {
        let m = 2 * p * k;
        let prof = profile(f, b, w, enc);
        for kind in BODIES {
            let name = &kind.expr();
            let body = generate(kind, &prof, p, m).unwrap();
            let split = split_w(body.clone()).unwrap();
            prop_assert!(span(&split) <= span(&body) * (1.0 + 1e-12), "{name}: {} > {}", span(&split), span(&body));
            let req = Request::new(&prof, p, m);
            let d = derive_str(&req, &format!("split_w({name})"));
            prop_assert!(d.is_ok(), "split_w({name}) p={p} m={m}: {:?}", d.err().map(|e| e[0].message.clone()));
        }
    }
}

/// Under uniform costs, splitting 1F1B's fused backward and moving W into the
/// cool-down reaches ZB-H1's closed form `m(F+B+W) + (p-1)(F+B-W)` (ideal timing).
#[test]
fn split_1f1b_reaches_zbh1() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 32)] {
        let prof = Profile::from_toml_str(&format!(
            "[llm]\nlayers = {p}\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n"
        ))
        .unwrap();
        let split = split_w(generate(BodyKind::OneFOneB, &prof, p, m).unwrap()).unwrap();
        let want = 3.0 * m as f64 + (p - 1) as f64;
        assert!(
            span(&split) <= want + 1e-9,
            "p={p} m={m}: {} > {want}",
            span(&split)
        );
    }
}

#[test]
fn bad_arguments_are_reported() {
    let prof = profile(1.0, 1.0, 1.0, false);
    let req = Request::new(&prof, 2, 4);
    for expr in ["split_w", "split_w(1f1b, zbv)", "split_w(1f1b, v = 2)"] {
        let errs = derive_str(&req, expr).unwrap_err();
        assert!(
            errs.iter().any(|e| e.kind == ErrorKind::BadArgument),
            "{expr}: {:?}",
            errs.iter().map(|e| &e.message).collect::<Vec<_>>()
        );
    }
}
