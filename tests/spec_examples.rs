//! The examples in the format specs (`docs/spec/`) are what the specs say they are:
//! the program is a valid `mpipe-program/1` document with the figures its semantics
//! give, and the profile (with its commented-out layout, too) reads and derives.

use std::path::Path;

use mpipe::core::derive::{derive, Request};
use mpipe::core::expr::parse_str;
use mpipe::core::profile::Profile;
use mpipe::core::program::{Program, FORMAT};
use mpipe::core::simulate::{simulate, SimOptions};
use mpipe::core::verify::verify;

/// The first fenced block of `lang` in spec `name`.
fn first_block(name: &str, lang: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs/spec")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let fence = format!("```{lang}\n");
    let start = text
        .find(&fence)
        .unwrap_or_else(|| panic!("{name} has no {lang} block"))
        + fence.len();
    let len = text[start..].find("```").expect("the block ends");
    text[start..start + len].to_string()
}

#[test]
fn the_program_format_example_is_valid_and_runs_as_the_spec_says() {
    let program = Program::from_json(&first_block("program-format.md", "json")).unwrap();
    assert_eq!(program.format, FORMAT);
    let violations = verify(&program);
    assert!(violations.is_empty(), "{violations:?}");
    // Rank 0: F vision, F llm.0 (3), the send meets rank 1's receive at 3; rank 1
    // computes 3..6 and sends the gradient back; rank 0's BW ends at 8.
    let report = simulate(&program, &SimOptions::default()).unwrap();
    assert_eq!(report.makespan, 8.0);
    assert_eq!(report.peak_memory, vec![1.0, 1.0]);
    assert_eq!(program.source.map(|s| s.expr).as_deref(), Some("1f1b"));
}

#[test]
fn the_model_format_example_reads_and_derives_with_and_without_its_layout() {
    let text = first_block("model-format.md", "toml");
    let with_layout = text.replace("# layout =", "layout =");
    assert_ne!(text, with_layout, "the example shows a layout line");
    for text in [text, with_layout] {
        let profile = Profile::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let expr = parse_str("transpose(vision, 1f1b)").unwrap();
        let derived = derive(&Request::new(&profile, 8, 16), &expr)
            .unwrap_or_else(|e| panic!("{:?}", e.iter().map(|e| &e.message).collect::<Vec<_>>()));
        assert!(verify(&derived.program).is_empty());
    }
}
