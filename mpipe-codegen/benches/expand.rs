//! `schedule!` expansion time and the size of what it emits.
//!
//! Run: `cargo bench -p mpipe-codegen --bench expand`. Prints the code-size table
//! (lines of pretty-printed code, program JSON left out) for 32 and 4096
//! micro-batches, then times the expansion of 16 ranks x 256 micro-batches of
//! `transpose(vision, zbv)` (derive, verify, simulate, re-roll, emit).

use criterion::{criterion_group, criterion_main, Criterion};
use mpipe_codegen::schedule;
use mpipe_codegen::size::code_size;
use proc_macro2::TokenStream;
use quote::quote;

const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 32
forward = 0.2
backward = 0.4
weight = 0.2
activation = 0.05
trainable = true

[llm]
layers = 64
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

fn input(ranks: usize, mbs: usize, expr: TokenStream) -> TokenStream {
    quote! {
        pub mod plan {
            model_toml = #PROFILE;
            ranks = #ranks;
            microbatches = #mbs;
            schedule = #expr;
        }
    }
}

fn sizes() {
    println!("code size (lines, program JSON left out), 8 ranks:");
    println!("{:<22} {:>8} {:>8}", "schedule", "m = 32", "m = 4096");
    for (name, expr) in [
        ("1f1b", quote!(1f1b)),
        ("interleaved(v = 2)", quote!(interleaved(v = 2))),
        ("zbv", quote!(zbv)),
        ("transpose(vision, 1f1b)", quote!(transpose(vision, 1f1b))),
    ] {
        let size = |m: usize| code_size(schedule(input(8, m, expr.clone()))).map_or(0, |s| s.lines);
        println!("{name:<22} {:>8} {:>8}", size(32), size(4096));
    }
}

fn bench(c: &mut Criterion) {
    sizes();
    let tokens = input(16, 256, quote!(transpose(vision, zbv)));
    c.bench_function("expand 16x256 transpose(vision, zbv)", |b| {
        b.iter(|| schedule(tokens.clone()));
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
