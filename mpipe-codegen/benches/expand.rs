//! `schedule!` expansion time and the size of what it emits.
//!
//! Run: `cargo bench -p mpipe-codegen --bench expand`. Prints the code-size table
//! (lines of pretty-printed code, program JSON left out) for 32 and 4096
//! micro-batches, then times the expansion of 16 ranks x 256 micro-batches of
//! `transpose(vision, zbv)` (derive, verify, simulate, re-roll, emit), and of
//! `auto` on the evaluation's profile (c) at 16 x 128 with its choice remembered
//! (`mpipe_codegen::cache`: a rebuild; the search itself, a first build, is timed
//! by `cargo bench -p mpipe-core --bench auto`).

use criterion::{criterion_group, criterion_main, Criterion};
use mpipe_codegen::cache::Cache;
use mpipe_codegen::size::code_size;
use mpipe_codegen::{schedule, schedule_with};
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
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../profiles/eval-c-omni.toml");
    let tokens = quote! {
        pub mod plan { model = #path; ranks = 16; microbatches = 128; schedule = auto; }
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let cache = Cache::at(dir.path());
    // The first expansion searches and remembers; the timed ones read the choice.
    let searched = schedule_with(tokens.clone(), Some(&cache)).to_string();
    assert!(!searched.contains("compile_error"), "{searched}");
    c.bench_function(
        "expand 16x128 auto on profile (c), choice remembered",
        |b| {
            b.iter(|| schedule_with(tokens.clone(), Some(&cache)));
        },
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
