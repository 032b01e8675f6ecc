//! `auto`'s search time: the whole search (every candidate's plan timed, the
//! promising ones derived in full) for 8 ranks x 64 micro-batches and 16 ranks x 128
//! micro-batches, on the shipped Qwen2-VL-72B-class profile (one trainable encoder)
//! and the audio+vision profile (two encoders, so every nesting order too); and, at
//! 16 x 128, as `schedule!` runs it (`SearchPolicy::prefetch` false).
//!
//! Run: `cargo bench -p mpipe-core --bench auto`.

use criterion::{criterion_group, criterion_main, Criterion};
use mpipe_core::derive::Request;
use mpipe_core::policy::SearchPolicy;
use mpipe_core::profile::Profile;
use mpipe_core::search::search;

const PROFILES: [(&str, &str); 2] = [
    (
        "qwen2vl72b",
        include_str!("../../profiles/eval-b-qwen2vl72b.toml"),
    ),
    ("omni", include_str!("../../profiles/eval-c-omni.toml")),
];

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("auto search");
    g.sample_size(10);
    for (name, text) in PROFILES {
        let profile = Profile::from_toml_str(text).expect("profile parses");
        for (ranks, microbatches) in [(8, 64), (16, 128)] {
            let req = Request::new(&profile, ranks, microbatches);
            g.bench_function(format!("{name} {ranks}x{microbatches}"), |b| {
                b.iter(|| search(&req).map(|s| s.best.report.makespan))
            });
        }
    }
    g.finish();
    let mut g = c.benchmark_group("auto search in schedule!");
    g.sample_size(10);
    for (name, text) in PROFILES {
        let profile = Profile::from_toml_str(text).expect("profile parses");
        let req = Request {
            policy: SearchPolicy {
                prefetch: false,
                ..SearchPolicy::DEFAULT
            },
            ..Request::new(&profile, 16, 128)
        };
        g.bench_function(format!("{name} 16x128"), |b| {
            b.iter(|| search(&req).map(|s| s.best.report.makespan))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
