//! Reading profiles whose size is all noise: decoding must stay linear in the text.
//!
//! Run: `cargo bench -p mpipe-core --bench profile`. Each iteration decodes an `[llm]`
//! table with N unknown keys (every one an error with its line) in TOML and in JSON,
//! for N = 5,000 and 20,000: the time per key should be about the same for both N
//! (it was quadratic in TOML: every value's line was found by scanning from the start
//! of the file, 3.7 s for 20,000 keys).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mpipe_core::profile::Profile;

const LLM: &str =
    "[llm]\nlayers = 4\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";

fn toml_with_unknown_keys(n: usize) -> String {
    let mut s = LLM.to_string();
    for i in 0..n {
        s.push_str(&format!("k{i} = {i}\n"));
    }
    s
}

fn json_with_unknown_keys(n: usize) -> String {
    let keys: Vec<String> = (0..n).map(|i| format!("\"k{i}\": {i}")).collect();
    format!(
        "{{\"llm\": {{\"layers\": 4, \"forward\": 1.0, \"backward\": 1.0, \"weight\": 1.0, \
         \"activation\": 1.0, {}}}}}",
        keys.join(", ")
    )
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("profile with unknown keys");
    g.sample_size(10);
    for n in [5_000usize, 20_000] {
        g.throughput(Throughput::Elements(n as u64));
        let toml = toml_with_unknown_keys(n);
        g.bench_with_input(BenchmarkId::new("toml", n), &toml, |b, text| {
            b.iter(|| {
                let e = Profile::from_toml_str(text).expect_err("unknown keys are errors");
                assert_eq!(e.issues().len(), n);
            });
        });
        let json = json_with_unknown_keys(n);
        g.bench_with_input(BenchmarkId::new("json", n), &json, |b, text| {
            b.iter(|| {
                let e = Profile::from_json_str(text).expect_err("unknown keys are errors");
                assert_eq!(e.issues().len(), n);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
