//! Loops, not a flat listing: for the regular schedules the emitted code has the same
//! size for 64 and 4096 micro-batches (only loop bounds differ). Schedules whose
//! orders come from the cost model (`zbv`'s list scheduler, `transpose`'s deadline
//! placement) are not periodic in general; their sizes are reported by the
//! `expand` benchmark, not asserted.

use mpipe_codegen::schedule;
use mpipe_codegen::size::code_size;
use proc_macro2::TokenStream;
use quote::quote;

const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 8
forward = 0.5
backward = 0.5
weight = 0.25
activation = 0.05
trainable = false

[llm]
layers = 16
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

fn size(mbs: usize, expr: &TokenStream) -> usize {
    let tokens = schedule(quote! {
        pub mod plan { model_toml = #PROFILE; ranks = 8; microbatches = #mbs; schedule = #expr; }
    });
    let text = tokens.to_string();
    assert!(
        !text.contains("compile_error"),
        "{expr} with {mbs} micro-batches failed: {text}"
    );
    code_size(tokens).expect("parses").tokens
}

#[test]
fn regular_schedules_do_not_grow_with_microbatches() {
    for expr in [
        quote!(1f1b),
        quote!(zbh1),
        quote!(interleaved(v = 2)),
        quote!(gpipe),
    ] {
        let (small, large) = (size(64, &expr), size(4096, &expr));
        assert_eq!(
            small, large,
            "{expr}: {small} tokens for 64 micro-batches, {large} for 4096"
        );
    }
}
