//! Issue 37's reproducers for the readers (profiles, expressions, program files):
//! sizes and values that used to cost minutes, gigabytes or an internal error are
//! refused quickly, with an error that names the limit and where it was broken.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::expr::{parse_str, MAX_EXPR_LEN};
use mpipe_core::profile::{Profile, MAX_ENCODERS, MAX_LAYOUT_LEN, MAX_NAME_LEN};
use mpipe_core::program::{Program, MAX_UNIT_FIGURE};
use mpipe_core::relower::{relower, relower_ordered, RelowerError};
use mpipe_core::simulate::{simulate, Mode, SimError, SimOptions};

const LLM: &str =
    "[llm]\nlayers = 4\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";

const ENCODER: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 1.0\nbackward = 2.0\n\
                       weight = 1.0\nactivation = 1.0\ntrainable = true\n";

/// Every unknown key of a large table is reported once, on its own line (the
/// linear-time decoding that finds those lines is measured by `benches/profile.rs`).
#[test]
fn every_one_of_20000_unknown_keys_is_reported_on_its_line() {
    let n = 20_000;
    let mut text = LLM.to_string();
    for i in 0..n {
        text.push_str(&format!("k{i} = {i}\n"));
    }
    let e = Profile::from_toml_str(&text).expect_err("unknown keys are errors");
    let issues = e.issues();
    assert_eq!(issues.len(), n);
    let first_line = LLM.lines().count() + 1;
    for (i, issue) in issues.iter().enumerate() {
        assert_eq!(issue.path, format!("llm.k{i}"));
        assert_eq!(issue.line, Some(first_line + i), "{issue}");
        assert!(issue.message.contains("unknown key"), "{issue}");
    }
}

/// Lines are right after multi-byte characters, blank lines and on the last line
/// without a newline.
#[test]
fn lines_are_right_around_multibyte_text_and_at_the_end() {
    let text = format!("# é ü 漢字\n\n{LLM}\n# ✓\nzzz = \"ü\"");
    let e = Profile::from_toml_str(&text).unwrap_err();
    let issue = &e.issues()[0];
    assert_eq!(issue.path, "llm.zzz");
    assert_eq!(issue.line, Some(text.lines().count()));

    let syntax = Profile::from_toml_str("# é\n[llm]\nlayers = é\n").unwrap_err();
    assert!(
        syntax.to_string().contains("at line 3, column 10"),
        "{syntax}"
    );
}

/// Too many encoders is one error, said before any encoder is decoded: no problem of
/// the encoders themselves is reported (each used to be checked, 23 s for 5,000).
#[test]
fn too_many_encoders_are_refused_before_they_are_decoded() {
    // Each encoder is also broken (an unknown key, a negative cost).
    let broken = ENCODER.replace("forward = 1.0", "forward = -1.0\nbogus = 1");
    let text = format!("{}{LLM}", broken.repeat(5_000));
    let e = Profile::from_toml_str(&text).unwrap_err();
    let issues = e.issues();
    assert_eq!(issues.len(), 1, "{e}");
    assert_eq!(issues[0].path, "encoder");
    assert!(
        issues[0].message.contains(&format!(
            "found 5000 encoders; expected at most {MAX_ENCODERS}"
        )),
        "{e}"
    );
    assert_eq!(issues[0].line, Some(1));

    // The same in JSON, and the LLM's own problems are still reported.
    let enc = r#"{"name": "v", "layers": 1, "forward": 1, "backward": 1, "activation": 1}"#;
    let encs = [enc; MAX_ENCODERS + 1].join(",");
    let json = format!(r#"{{"encoder": [{encs}], "llm": {{"layers": 0}}}}"#);
    let e = Profile::from_json_str(&json).unwrap_err();
    assert!(e.issues().iter().any(|i| i.path == "encoder"), "{e}");
    assert!(e.issues().iter().any(|i| i.path == "llm.forward"), "{e}");
    assert!(
        !e.issues().iter().any(|i| i.path.starts_with("encoder[")),
        "{e}"
    );

    // At the limit they are all decoded.
    let text = format!(
        "{}{LLM}",
        (0..MAX_ENCODERS)
            .map(|i| ENCODER.replace("\"vision\"", &format!("\"e{i}\"")))
            .collect::<String>()
    );
    assert_eq!(
        Profile::from_toml_str(&text).unwrap().encoders.len(),
        MAX_ENCODERS
    );
}

fn encoder_named(name: &str) -> String {
    ENCODER.replace("\"vision\"", &format!("\"{name}\""))
}

/// Two encoders with 80,000-character names (the same name twice) are one error
/// each, naming the limit, with messages that stay short (they took `simulate auto`
/// 57 s and 4 GB).
#[test]
fn unit_names_are_bounded_and_named_by_the_limit() {
    let long = "v".repeat(80_000);
    let text = format!("{}{}{LLM}", encoder_named(&long), encoder_named(&long));
    let e = Profile::from_toml_str(&text).unwrap_err();
    let issues = e.issues();
    assert_eq!(issues.len(), 2, "{e}");
    for (i, issue) in issues.iter().enumerate() {
        assert_eq!(issue.path, format!("encoder[{i}].name"));
        assert!(issue.message.contains("80000 characters long"), "{issue}");
        assert!(
            issue.message.contains(&format!("at most {MAX_NAME_LEN}")),
            "{issue}"
        );
        assert!(issue.message.contains("MAX_NAME_LEN"), "{issue}");
    }
    assert!(e.to_string().len() < 1_000, "messages quote the whole name");

    // At the limit: accepted; one over: refused.
    let ok = "v".repeat(MAX_NAME_LEN);
    assert!(Profile::from_toml_str(&format!("{}{LLM}", encoder_named(&ok))).is_ok());
    let over = "v".repeat(MAX_NAME_LEN + 1);
    assert!(Profile::from_toml_str(&format!("{}{LLM}", encoder_named(&over))).is_err());
}

/// An unknown key as long as the file is reported by its start, without a quadratic
/// did-you-mean against every valid key.
#[test]
fn a_huge_unknown_key_is_named_by_its_start() {
    let key = "forward".repeat(20_000);
    let text = format!("{LLM}{key} = 1\n");
    let e = Profile::from_toml_str(&text).unwrap_err();
    assert_eq!(e.issues().len(), 1);
    assert!(e.to_string().len() < 1_000, "{}", e.to_string().len());
    assert!(e.issues()[0].path.starts_with("llm.forwardforward"));
}

#[test]
fn layouts_are_bounded() {
    let layout = "t|".repeat(MAX_LAYOUT_LEN);
    let text = format!("{LLM}layout = \"{layout}\"\n");
    let e = Profile::from_toml_str(&text).unwrap_err();
    assert_eq!(e.issues().len(), 1, "{e}");
    assert_eq!(e.issues()[0].path, "llm.layout");
    assert!(e.issues()[0].message.contains("MAX_LAYOUT_LEN"), "{e}");
}

/// Expressions: the text and every name in it are bounded, with the limit named.
#[test]
fn expression_text_and_names_are_bounded() {
    let long_name = "v".repeat(MAX_NAME_LEN + 1);
    for text in [
        format!("transpose({long_name}, zbv)"),
        long_name.clone(),
        format!("interleaved(v = {long_name})"),
        format!("interleaved({long_name} = 2)"),
    ] {
        let errors = parse_str(&text).unwrap_err();
        assert_eq!(errors.len(), 1, "{text}");
        assert!(errors[0].message.contains("MAX_NAME_LEN"), "{}", errors[0]);
        assert!(errors[0].message.len() < 300, "{}", errors[0]);
    }
    let ok_name = "v".repeat(MAX_NAME_LEN);
    assert!(parse_str(&format!("transpose({ok_name}, zbv)")).is_ok());

    let huge = format!("transpose(vision, zbv){}", " ".repeat(MAX_EXPR_LEN));
    let errors = parse_str(&huge).unwrap_err();
    assert!(errors[0].message.contains("MAX_EXPR_LEN"), "{}", errors[0]);
}

fn derived(ranks: usize, microbatches: usize, expr: &str) -> Program {
    let text = format!("{ENCODER}{LLM}");
    let profile = Profile::from_toml_str(&text).unwrap();
    derive_str(&Request::new(&profile, ranks, microbatches), expr)
        .unwrap()
        .program
}

fn rendezvous() -> SimOptions {
    SimOptions {
        mode: Mode::Rendezvous,
        comm: None,
    }
}

/// A program whose costs are all 1e308 is refused up front by every reader of
/// programs, with a typed error that says what to do; `refine` gave an internal error
/// ("a bug in mpipe, please report it").
#[test]
fn absurd_program_figures_are_refused_up_front_not_an_internal_error() {
    let mut p = derived(2, 4, "1f1b");
    for u in &mut p.units {
        u.cost.f = 1e308;
        u.cost.b = 1e308;
        u.cost.w = 1e308;
    }
    match relower(&p, &rendezvous(), None) {
        Err(RelowerError::Shape(SimError::FigureTooLarge { value, max, .. })) => {
            assert_eq!(value, 1e308);
            assert_eq!(max, MAX_UNIT_FIGURE);
        }
        other => panic!("{other:?}"),
    }
    let e = simulate(&p, &rendezvous()).unwrap_err();
    assert!(matches!(e, SimError::FigureTooLarge { .. }), "{e}");
    assert!(e.to_string().contains("scale the program's times"), "{e}");
    for field in ["act", "bytes", "params"] {
        let mut q = derived(2, 4, "1f1b");
        match field {
            "act" => q.units[0].act = 1e300,
            "bytes" => q.units[0].bytes = 1e300,
            _ => q.units[0].params = 1e300,
        }
        let e = relower(&q, &rendezvous(), None).unwrap_err();
        assert!(
            matches!(&e, RelowerError::Shape(SimError::FigureTooLarge { field: f, .. }) if *f == field),
            "{field}: {e}"
        );
    }
}

/// Figures at the limit are timed and re-derived (no internal error, a finite
/// makespan); mixed with zero forwards too (below).
#[test]
fn figures_at_the_limit_refine_cleanly() {
    for expr in ["1f1b", "zbh1", "transpose(vision, 1f1b)"] {
        let mut p = derived(3, 6, expr);
        for (i, u) in p.units.iter_mut().enumerate() {
            let scale = MAX_UNIT_FIGURE / (1 + i) as f64;
            u.cost.f = scale;
            u.cost.b = MAX_UNIT_FIGURE;
            u.cost.w = scale / 2.0;
            u.act = MAX_UNIT_FIGURE;
            u.params = MAX_UNIT_FIGURE;
            u.bytes = MAX_UNIT_FIGURE;
        }
        let r = relower(&p, &rendezvous(), None).unwrap_or_else(|e| panic!("{expr}: {e}"));
        assert!(r.report.makespan.is_finite(), "{expr}");
        let r = relower_ordered(&p, &rendezvous(), None, 20).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.report.makespan.is_finite(), "{expr}");
    }
}

/// Zero-cost forwards (alone, or mixed with figures at the limit): the lowering put
/// a SEND after zero-length tasks ending when it was ready, past the consumer of a
/// RECV keyed after it, and failed with "internal error: cannot place RECV" (also
/// under the ready-time rule it falls back to). Every re-derivation now runs.
#[test]
fn zero_forwards_lower_and_refine_cleanly() {
    for (ranks, mbs) in [(2, 4), (3, 6), (4, 8)] {
        for expr in [
            "1f1b",
            "zbh1",
            "transpose(vision, 1f1b)",
            "transpose(vision, zbv)",
        ] {
            // (Two chunks per rank need more layers than the profile's four.)
            if expr.contains("zbv") && ranks > 2 {
                continue;
            }
            for mixed in [false, true] {
                let mut p = derived(ranks, mbs, expr);
                for (i, u) in p.units.iter_mut().enumerate() {
                    if mixed {
                        u.cost.f = if i % 2 == 1 {
                            0.0
                        } else {
                            MAX_UNIT_FIGURE / (1 + i) as f64
                        };
                        u.cost.b = MAX_UNIT_FIGURE;
                        u.cost.w = 0.0;
                    } else if u.name.starts_with("llm") {
                        u.cost.f = 0.0;
                    }
                }
                let what = format!("{expr} at {ranks} x {mbs}, mixed = {mixed}");
                let r = relower(&p, &rendezvous(), None).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(r.report.makespan.is_finite(), "{what}");
                let r = relower_ordered(&p, &rendezvous(), None, 20)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(r.report.makespan.is_finite(), "{what}");
            }
        }
    }
}

/// `layers` may be wrapped by `refine` only (the guide's rule): `layers(layers(..))`
/// was accepted; it is refused with an error under the inner `layers`.
#[test]
fn layers_inside_layers_is_refused_with_a_span_error() {
    let profile = Profile::from_toml_str(&format!("{ENCODER}{LLM}")).unwrap();
    let req = Request::new(&profile, 2, 4);
    for text in [
        "layers(layers(1f1b))",
        "refine(layers(layers(1f1b)))",
        "layers(layers(transpose(vision, 1f1b)))",
    ] {
        let errors = derive_str(&req, text).expect_err(text);
        assert_eq!(errors.len(), 1, "{text}: {errors:?}");
        let e = &errors[0];
        assert!(
            e.message.contains("`layers` inside `layers`"),
            "{text}: {e}"
        );
        // The span is the inner `layers(..)`.
        let inner = text.rfind("layers(").unwrap();
        let span = e.span.lo..e.span.hi;
        assert_eq!(span.start, inner, "{text}: {span:?}");
        assert_eq!(&text[span.end - 1..span.end], ")", "{text}: {span:?}");
    }
    for ok in [
        "layers(1f1b)",
        "refine(layers(1f1b))",
        "layers(transpose(vision, 1f1b))",
    ] {
        assert!(derive_str(&req, ok).is_ok(), "{ok}");
    }
}
