//! Expansion snapshots: what `schedule!` emits for a few small schedules, pretty-
//! printed with prettyplease and pinned with insta. Review changes with
//! `cargo insta review` (or `INSTA_UPDATE=always cargo test -p mpipe-macros`).

use crate::expand::schedule;
use quote::quote;

const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 4
forward = 1.0
backward = 1.0
weight = 0.5
activation = 0.1
trainable = true

[llm]
layers = 8
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

/// Expand and pretty-print, leaving out the (long) program JSON constant.
fn expand(ranks: usize, mbs: usize, expr: proc_macro2::TokenStream) -> String {
    let tokens = schedule(quote! {
        /// A schedule.
        pub mod plan {
            model_toml = #PROFILE;
            ranks = #ranks;
            microbatches = #mbs;
            schedule = #expr;
        }
    });
    let mut file: syn::File = syn::parse2(tokens).expect("the expansion parses as Rust");
    // `compile_error!` invocations are checked by the tests themselves: how syn
    // delimits them is not ours to pin.
    file.items.retain(|i| !matches!(i, syn::Item::Macro(_)));
    let text = prettyplease::unparse(&file);
    text.lines()
        .filter(|l| !l.contains("pub const PROGRAM_JSON") && !l.contains("The derived program, as"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn one_f_one_b_2x6() {
    insta::assert_snapshot!(expand(2, 6, quote!(1f1b)));
}

#[test]
fn transpose_1f1b_2x4() {
    insta::assert_snapshot!(expand(2, 4, quote!(transpose(vision, 1f1b))));
}

#[test]
fn interleaved_2x4() {
    insta::assert_snapshot!(expand(2, 4, quote!(interleaved(v = 2))));
}

#[test]
fn errors_keep_a_fallback_module() {
    let tokens = schedule(quote! {
        pub mod plan { model_toml = #PROFILE; ranks = 2; microbatches = 4; schedule = transpose(nope, 1f1b); }
    });
    let text = tokens.to_string();
    assert!(text.contains("compile_error"), "{text}");
    assert!(
        text.contains("unknown encoder `nope`; the profile's encoders are: vision"),
        "{text}"
    );
    insta::assert_snapshot!(expand(2, 4, quote!(transpose(nope, 1f1b))));
}
