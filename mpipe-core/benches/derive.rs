//! Derive + verify + simulate at scale: 64 ranks, 1024 micro-batches.
//!
//! Run: `cargo bench -p mpipe-core --bench derive`. Each iteration derives the program
//! (generate, lower), verifies rules 1-5 and simulates it under rendezvous.

use criterion::{criterion_group, criterion_main, Criterion};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;

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
layers = 128
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

fn bench(c: &mut Criterion) {
    let profile = Profile::from_toml_str(PROFILE).expect("bench profile parses");
    let req = Request::new(&profile, 64, 1024);
    let mut g = c.benchmark_group("derive+verify+simulate 64x1024");
    g.sample_size(10);
    for expr in ["zbv", "transpose(vision, zbv)", "1f1b"] {
        g.bench_function(expr, |b| {
            b.iter(|| derive_str(&req, expr).expect("derives"));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
