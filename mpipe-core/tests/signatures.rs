//! The operator table (`algebra/eval.rs`, `TABLE`): every name of the language has a
//! signature whose example derives, and every argument mistake is worded from the
//! signature (its valid choices, its range, how the name is written), whatever the
//! name.

use mpipe_core::algebra::signature::{Shape, Type};
use mpipe_core::derive::{body_names, derive_str, operator_names, signature, ErrorKind, Request};
use mpipe_core::profile::Profile;

fn profile() -> Profile {
    Profile::from_toml_str(include_str!("../../profiles/eval-c-omni.toml")).unwrap()
}

fn names() -> Vec<&'static str> {
    body_names().chain(operator_names()).collect()
}

/// Each name's example derives at 4 x 8 (the examples are what messages point to),
/// within the profile's memory limit or over it.
#[test]
fn every_example_derives() {
    let omni = profile();
    // `host(audio, ..)` and the other examples name encoders of this profile.
    let req = Request::new(&omni, 4, 8);
    for name in names() {
        let sig = signature(name).unwrap();
        assert_eq!(sig.name, name);
        assert!(!sig.doc.is_empty(), "{name} has no doc");
        let example = sig.example;
        // It evaluates and derives; only the profile's memory limit may refuse it.
        if let Err(es) = derive_str(&req, example) {
            assert!(
                es.iter().all(|e| e.kind == ErrorKind::Memory),
                "`{example}`: {es:?}"
            );
        }
    }
}

/// An unknown key is refused with the name's usage, and a bad value with the
/// signature's choices or range; every mistake of one expression is reported.
#[test]
fn argument_errors_come_from_the_signature() {
    let omni = profile();
    let req = Request::new(&omni, 4, 8);
    for name in names() {
        let sig = signature(name).unwrap();
        let body = |extra: &str| match sig.shape {
            Shape::Body => format!("{name}({extra})"),
            Shape::Over | Shape::Whole => format!("{name}(1f1b, {extra})"),
            Shape::EncoderOver => format!("{name}(vision, 1f1b, {extra})"),
        };
        if name == "auto" {
            continue; // `auto` takes nothing at all (tested in tests/search.rs)
        }
        // An unknown key, and every parameter given a value of the wrong kind.
        let mut extras = vec!["bogus = 1".to_string()];
        for p in sig.params {
            extras.push(match p.ty {
                Type::Choice(_) | Type::RankOr(_) => format!("{} = 7x", p.key),
                Type::Int { .. } => format!("{} = nope", p.key),
            });
        }
        let text = body(&extras.join(", "));
        let errors = derive_str(&req, &text).expect_err(&text);
        assert_eq!(errors.len(), extras.len(), "`{text}`: {errors:?}");
        assert!(errors.iter().all(|e| e.kind == ErrorKind::BadArgument));
        assert!(
            errors[0].message.contains("bogus") && errors[0].message.contains(&sig.usage()),
            "`{text}`: {}",
            errors[0].message
        );
        for (p, e) in sig.params.iter().zip(&errors[1..]) {
            assert!(e.message.contains(p.key), "`{text}`: {}", e.message);
            if let Type::Choice(choices) = p.ty {
                for c in choices {
                    assert!(e.message.contains(c), "`{text}`: {} lacks {c}", e.message);
                }
            }
        }
    }
}

/// The table is the one list of names: bodies and operators are disjoint, and the
/// usage of each names every parameter.
#[test]
fn the_table_is_the_one_list_of_names() {
    let bodies: Vec<_> = body_names().collect();
    for op in operator_names() {
        assert!(!bodies.contains(&op), "{op}");
    }
    for name in names() {
        let sig = signature(name).unwrap();
        for p in sig.params {
            assert!(sig.usage().contains(p.key), "{}", sig.usage());
        }
    }
    assert!(signature("nope").is_none());
}
