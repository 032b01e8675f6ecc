//! The distribution of `auto`'s ratio to the lower bound over random profiles
//! (median, within 5%, worst), as the guide's results report it:
//!
//! `cargo run --release -p mpipe-core --example ratio_report -- [CASES]` (default 100;
//! a fixed seed, so the figures reproduce). `MPIPE_SEARCH_DUMP=FILE` also writes
//! every case there, worst first (ratio, sizes, `auto`'s expression, the profile).

#[path = "../tests/search_cases/mod.rs"]
#[allow(dead_code)]
mod search_cases;

use mpipe_core::profile::Profile;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use search_cases::{auto_and_peers, random_profile};

fn main() -> anyhow::Result<()> {
    let n: u32 = match std::env::args().nth(1) {
        Some(a) => a
            .parse()
            .map_err(|e| anyhow::anyhow!("CASES must be a count, got `{a}`: {e}"))?,
        None => 100,
    };
    // A fixed seed, so that the figures can be reproduced.
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: n,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let mut rows: Vec<(f64, f64, String, usize, usize)> = Vec::new();
    for _ in 0..n {
        let (text, p, m): (String, usize, usize) = random_profile()
            .new_tree(&mut runner)
            .map_err(|e| anyhow::anyhow!("cannot draw a case: {e}"))?
            .current();
        let profile = Profile::from_toml_str(&text)?;
        let (best, chosen, bound, _) = auto_and_peers(&profile, p, m);
        rows.push((
            best / bound,
            (m / p) as f64,
            format!("{chosen}\n{text}"),
            p,
            m,
        ));
    }
    // MPIPE_SEARCH_DUMP=FILE also writes every case, worst first (ratio, sizes,
    // `auto`'s expression and the profile), for a closer look.
    if let Ok(path) = std::env::var("MPIPE_SEARCH_DUMP") {
        let mut all: Vec<_> = rows.iter().collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0));
        let text: String = all
            .iter()
            .map(|(ratio, _, what, p, m)| format!("## {ratio:.4} {p} x {m}: {what}\n"))
            .collect();
        std::fs::write(&path, text)?;
    }
    for (label, keep) in [
        ("all", &(|_: f64| true) as &dyn Fn(f64) -> bool),
        ("micro-batches >= 2 x ranks", &|k: f64| k >= 2.0),
    ] {
        let mut r: Vec<_> = rows.iter().filter(|x| keep(x.1)).collect();
        r.sort_by(|a, b| a.0.total_cmp(&b.0));
        if r.is_empty() {
            continue;
        }
        let within = r.iter().filter(|x| x.0 <= 1.05).count();
        let worst = r.last().unwrap();
        println!(
            "{label}: {} cases, median {:.3}, within 5%: {within}, worst {:.3} ({} ranks, {} micro-batches, auto = {})",
            r.len(),
            r[r.len() / 2].0,
            worst.0,
            worst.3,
            worst.4,
            worst.2
        );
    }
    Ok(())
}
