//! The evaluation the README shows: `mpipe evaluate profiles/eval-*.toml --svg-dir
//! docs/eval --markdown` must print the README's summary table and draw its charts as
//! committed, so neither can go stale; the same under `--mode eager` must print the
//! table of `docs/guide/results.md`. After a change to the algebra, regenerate with
//!
//! ```sh
//! MPIPE_BLESS=1 cargo test --release --test evaluation
//! ```
//!
//! (it rewrites `docs/eval/` and prints the tables to paste into the README and into
//! `docs/guide/results.md`, which also shows the first one), and review the new
//! figures.
//!
//! (`mpipe-core/tests/search.rs` checks that the best schedule is never slower than
//! any peer on these profiles, and that its distance to the bound does not grow.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn eval_profiles() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("profiles"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("eval-") && n.ends_with(".toml"))
        })
        .collect();
    v.sort();
    v
}

fn evaluate(svg_dir: Option<&Path>, mode: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpipe"));
    cmd.arg("evaluate").args(eval_profiles());
    if let Some(dir) = svg_dir {
        cmd.arg("--svg-dir").arg(dir);
    }
    cmd.args(["--markdown", "--mode", mode]).current_dir(root());
    let out = cmd.output().expect("mpipe evaluate runs");
    assert!(
        out.status.success(),
        "mpipe evaluate failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The summary table: the Markdown lines after the last blank line.
fn summary(markdown: &str) -> Vec<String> {
    let lines: Vec<&str> = markdown.lines().collect();
    let start = lines
        .iter()
        .rposition(|l| l.trim().is_empty())
        .map_or(0, |i| i + 1);
    lines[start..].iter().map(|l| l.to_string()).collect()
}

#[test]
fn the_readme_shows_what_mpipe_evaluate_prints_and_draws() {
    let bless = std::env::var_os("MPIPE_BLESS").is_some();
    let dir = std::env::temp_dir().join(format!("mpipe-eval-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let markdown = evaluate(Some(&dir), "rendezvous");
    let committed = root().join("docs/eval");
    let mut stale = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        let new = std::fs::read(&path).unwrap();
        let old_path = committed.join(&name);
        if bless {
            std::fs::create_dir_all(&committed).unwrap();
            std::fs::write(&old_path, &new).unwrap();
        } else if std::fs::read(&old_path).ok().as_deref() != Some(&new[..]) {
            stale.push(old_path.display().to_string());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let table = summary(&markdown);
    // The whole table, as one block: every row, in order, under its header, in the
    // README and in the measured results.
    let block = table.join("\n");
    let missing: Vec<&str> = ["README.md", "docs/guide/results.md"]
        .into_iter()
        .filter(|file| {
            let text = std::fs::read_to_string(root().join(file)).unwrap();
            !text.contains(&block)
        })
        .collect();
    if bless {
        println!("the README's evaluation table:\n{}", table.join("\n"));
        return;
    }
    assert!(
        stale.is_empty() && missing.is_empty(),
        "the evaluation changed; regenerate with `MPIPE_BLESS=1 cargo test --release --test \
         evaluation -- --nocapture`, paste the printed table into README.md and \
         docs/guide/results.md and review.\n\
         stale charts: {stale:?}\nthe table is not current in: {missing:?}\n{}",
        table.join("\n")
    );
}

/// The measured results' eager table (`docs/guide/results.md`): the same evaluation
/// with every program derived for and timed under eager semantics (sends that never
/// wait).
#[test]
fn the_measured_results_show_the_evaluation_under_eager_semantics() {
    let table = summary(&evaluate(None, "eager"));
    if std::env::var_os("MPIPE_BLESS").is_some() {
        println!(
            "docs/guide/results.md's eager evaluation table:\n{}",
            table.join("\n")
        );
        return;
    }
    let results = std::fs::read_to_string(root().join("docs/guide/results.md")).unwrap();
    let block = table.join("\n");
    let missing: Vec<&String> = if results.contains(&block) {
        Vec::new()
    } else {
        table.iter().collect()
    };
    assert!(
        missing.is_empty(),
        "the eager evaluation changed; regenerate with `MPIPE_BLESS=1 cargo test --release \
         --test evaluation -- --nocapture`, paste the printed table into \
         docs/guide/results.md and review.\ndocs/guide/results.md lacks: {missing:#?}"
    );
}
