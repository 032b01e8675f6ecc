//! Bad input of any size gives an error that says what to change, never a panic, an
//! exhausted memory or an hour-long run: the limits on profiles, programs, expressions
//! and imported schedules (found by fuzzing the `mpipe` tool).

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::expr::parse_str;
use mpipe_core::profile::{Profile, MAX_ENCODERS, MAX_FIGURE, MAX_LAYERS};
use mpipe_core::program::{Prefetch, Program, MAX_MICROBATCHES};
use mpipe_core::relower::{relower, RelowerError};
use mpipe_core::search::candidates;
use mpipe_core::simulate::{check_shape, simulate, CommModel, Mode, SimError, SimOptions};
use mpipe_core::torch_csv::import;

const SMALL: &str = r#"
[[encoder]]
name = "vision"
layers = 2
forward = 1.0
backward = 2.0
weight = 1.0
activation = 1.0
params = 1.0
trainable = true

[llm]
layers = 4
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
params = 1.0
"#;

/// `SMALL` with `n` copies of its encoder, named `e0`, `e1`, ...
fn with_encoders(n: usize) -> String {
    let (encoder, llm) = SMALL.split_once("[llm]").unwrap();
    let encoders: String = (0..n)
        .map(|i| encoder.replace("\"vision\"", &format!("\"e{i}\"")))
        .collect();
    format!("{encoders}[llm]{llm}")
}

fn small() -> Profile {
    Profile::from_toml_str(SMALL).unwrap()
}

/// A valid derived program to break in one place at a time.
fn program() -> Program {
    derive_str(&Request::new(&small(), 2, 4), "1f1b")
        .unwrap()
        .program
}

fn free() -> SimOptions {
    SimOptions {
        mode: Mode::Rendezvous,
        comm: None,
    }
}

#[test]
fn a_valid_program_has_a_valid_shape() {
    let p = program();
    assert_eq!(check_shape(&p), Ok(()));
    assert!(simulate(&p, &free()).is_ok());
}

/// One way to break a program.
type Breakage = Box<dyn Fn(&mut Program)>;

#[test]
fn shape_problems_are_errors_before_anything_is_sized_by_them() {
    let cases: Vec<(&str, Breakage)> = vec![
        ("ranks", Box::new(|p| p.ranks = 4_000_000_000)),
        ("micro-batches", Box::new(|p| p.microbatches = usize::MAX)),
        ("pairs", Box::new(|p| p.microbatches = MAX_MICROBATCHES)),
        ("home", Box::new(|p| p.units[0].home = 5)),
        (
            "prefetch",
            Box::new(|p| {
                p.prefetch = vec![Prefetch {
                    unit: p.units[0].name.clone().into(),
                    mb: p.microbatches,
                }]
            }),
        ),
        (
            "prefetch unit",
            Box::new(|p| {
                p.prefetch = vec![Prefetch {
                    unit: "nobody".into(),
                    mb: 0,
                }]
            }),
        ),
        ("cost", Box::new(|p| p.units[1].cost.f = -1.0)),
        (
            "duplicate",
            Box::new(|p| {
                let n = p.units[0].name.clone();
                p.units[1].name = n;
            }),
        ),
    ];
    for (what, break_it) in cases {
        let mut p = program();
        // `pairs` needs enough ranks to pass the micro-batch cap but not the pair cap.
        if what == "pairs" {
            let extra = p.programs[0].clone();
            p.programs.extend(std::iter::repeat_n(extra, 8));
            p.ranks = p.programs.len();
        }
        break_it(&mut p);
        let e = check_shape(&p).expect_err(what);
        assert!(simulate(&p, &free()).is_err(), "{what}");
        // Re-deriving refuses it as input, not as an internal error.
        match relower(&p, &free(), None) {
            Err(RelowerError::Shape(s)) => assert_eq!(s, e, "{what}"),
            Err(RelowerError::Ranks { .. }) => assert_eq!(what, "ranks"),
            other => panic!("{what}: {other:?}"),
        }
    }
}

#[test]
fn a_makespan_that_overflows_is_an_error_not_inf() {
    let mut p = program();
    p.units[0].cost.f = 1e308;
    p.units[1].cost.f = 1e308;
    // Refused before the step is timed: no unit may give more than MAX_UNIT_FIGURE.
    match simulate(&p, &free()) {
        Err(SimError::FigureTooLarge { field, .. }) => assert_eq!(field, "cost.F"),
        other => panic!("{other:?}"),
    }
    let p = program();
    let slow = SimOptions {
        mode: Mode::Rendezvous,
        comm: Some(CommModel {
            latency: 1e308,
            bandwidth: 1.0,
        }),
    };
    assert!(matches!(
        simulate(&p, &slow),
        Err(SimError::NotFinite { .. })
    ));
}

#[test]
fn profile_figures_layers_and_encoders_are_bounded() {
    let too_big = SMALL.replacen("forward = 1.0", "forward = 1e12", 1);
    let e = Profile::from_toml_str(&too_big).unwrap_err().to_string();
    assert!(
        e.contains("encoder[0].forward: found 1e12; expected at most 1e9"),
        "{e}"
    );
    let ok = SMALL.replacen("forward = 1.0", &format!("forward = {MAX_FIGURE:e}"), 1);
    assert!(Profile::from_toml_str(&ok).is_ok());

    let deep = SMALL.replacen("layers = 4", &format!("layers = {}", MAX_LAYERS + 1), 1);
    let e = Profile::from_toml_str(&deep).unwrap_err().to_string();
    assert!(
        e.contains("llm.layers: found 1025 layers; expected at most 1024"),
        "{e}"
    );

    let thin = SMALL.replace("[llm]", "[link]\nlatency = 0\nbandwidth = 1e-12\n\n[llm]");
    let e = Profile::from_toml_str(&thin).unwrap_err().to_string();
    assert!(e.contains("link.bandwidth: found 1e-12"), "{e}");

    let e = Profile::from_toml_str(&with_encoders(MAX_ENCODERS + 1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("found 9 encoders; expected at most 8"), "{e}");
}

#[test]
fn auto_places_as_many_encoders_as_a_profile_may_have() {
    let profile = Profile::from_toml_str(&with_encoders(MAX_ENCODERS)).unwrap();
    let req = Request::new(&profile, 2, 4);
    let started = std::time::Instant::now();
    let auto = derive_str(&req, "auto").unwrap_or_else(|e| panic!("{e:?}"));
    // Its space grows with the two heaviest encoders' placements, then threefold
    // for all the others together, not with each of them.
    let space = candidates(&profile, 2, 4).len();
    let two = Profile::from_toml_str(&with_encoders(2)).unwrap();
    assert!(
        space <= 3 * candidates(&two, 2, 4).len() + 10,
        "{space} candidates"
    );
    assert!(started.elapsed().as_secs() < 60);
    // And it is never slower than every encoder transposed, written out.
    let written = (0..MAX_ENCODERS).fold("1f1b".to_string(), |body, i| {
        format!("transpose(e{i}, {body})")
    });
    let peer = derive_str(&req, &written).unwrap();
    assert!(auto.report.makespan <= peer.report.makespan * (1.0 + 1e-9));
}

#[test]
fn deep_expressions_are_refused_before_they_reach_the_stack() {
    let nest = |n: usize| format!("{}1f1b{}", "split_w(".repeat(n), ")".repeat(n));
    let e = parse_str(&nest(5_000)).unwrap_err();
    assert!(e[0].message.contains("at most 64"), "{}", e[0].message);
    let es = derive_str(&Request::new(&small(), 2, 4), &nest(5_000)).unwrap_err();
    assert!(es[0].message.contains("at most 64"), "{}", es[0].message);
}

#[test]
fn imported_indices_are_checked_before_they_size_anything() {
    let e = import("1000000000F0\n", None).unwrap_err().to_string();
    assert!(e.contains("stage 1000000000 is out of range"), "{e}");
    let e = import("0F1000000000\n", None).unwrap_err().to_string();
    assert!(e.contains("micro-batch 1000000000 is out of range"), "{e}");
    let e = import("0F0,0B0,0F65536,0B65536\n", None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("micro-batch 65536 is out of range"), "{e}");
    assert!(import("0F0,0B0,0F1,0B1\n", None).is_ok());
}
