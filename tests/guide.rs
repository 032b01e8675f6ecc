//! The user guide (`docs/guide/`) stays true to the code.
//!
//! - **Charts.** Every Gantt chart in `docs/guide/img/` is what `mpipe svg` draws
//!   today for its expression ([`CHARTS`]); no other SVG lies there, and each one is
//!   shown by some chapter. After a change to a generator, an operator or the
//!   renderer, regenerate them all with
//!
//!   ```sh
//!   MPIPE_BLESS=1 cargo test --release --test guide
//!   ```
//!
//!   and review the new charts before committing them.
//! - **Shell examples.** Every ```` ```console ```` block of the guide's chapters is
//!   run by `trycmd`: each `$ mpipe ...` line runs the built `mpipe` binary, and its
//!   standard output and error together must match the lines below it, up to a
//!   blank line (trycmd compares the final newline too, so each command's output
//!   ends with one blank line before the next `$` or the closing fence). A `? 1`
//!   line after the command gives the expected exit status; `...` on a line of its
//!   own skips any number of lines, `[..]` any text within a line. The commands run
//!   in a scratch copy of the files they read (`profiles/`, `docs/guide/examples/`),
//!   laid out as in the repository, so files they write land there.
//! - The Rust examples are doctests of the `mpipe` crate (`src/lib.rs` includes the
//!   chapters that have them), run by `cargo test --release --doc`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every chart of the guide: the expression, and the file under `docs/guide/img/`.
/// Drawn on `docs/guide/examples/small-mllm.toml`, 4 ranks x 8 micro-batches, except
/// `prefetch`, which needs a frozen encoder: on `frozen-mllm.toml`, 4 x 16.
const CHARTS: &[(&str, &str)] = &[
    ("gpipe", "gpipe.svg"),
    ("1f1b", "1f1b.svg"),
    ("interleaved(v = 2)", "interleaved.svg"),
    ("zbh1", "zbh1.svg"),
    ("zbv", "zbv.svg"),
    ("dualpipev", "dualpipev.svg"),
    ("zb2p", "zb2p.svg"),
    ("transpose(vision, 1f1b)", "transpose-1f1b.svg"),
    ("fill(vision, 1f1b)", "fill-1f1b.svg"),
    ("prefetch(vision, zbh1)", "prefetch-zbh1.svg"),
    (
        "transpose(vision, 1f1b, backward = central)",
        "transpose-1f1b-central.svg",
    ),
    ("transpose(vision, zbv)", "transpose-zbv.svg"),
    ("split_w(1f1b)", "split-w-1f1b.svg"),
    (
        "split_w(transpose(vision, 1f1b))",
        "split-w-transpose-1f1b.svg",
    ),
];

/// The profile, sizes and width every chart is drawn with.
const PROFILE: &str = "docs/guide/examples/small-mllm.toml";
const RANKS: &str = "4";
const MICROBATCHES: &str = "8";
const WIDTH: &str = "900";
/// The profile and micro-batches of the `prefetch` chart.
const FROZEN: (&str, &str) = ("docs/guide/examples/frozen-mllm.toml", "16");

const REGENERATE: &str = "regenerate the charts with `MPIPE_BLESS=1 cargo test --release \
                          --test guide`, look at them, and commit docs/guide/img/";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn guide() -> PathBuf {
    root().join("docs/guide")
}

fn bless() -> bool {
    std::env::var_os("MPIPE_BLESS").is_some_and(|v| v == "1")
}

/// A fresh, empty scratch directory under Cargo's per-target temporary directory.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("remove the old scratch directory");
    }
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// Draw `expr` with the guide's settings into `out`; the binary's exit status and
/// messages on failure.
fn draw(expr: &str, out: &Path) -> Result<(), String> {
    let (profile, microbatches) = if expr.starts_with("prefetch") {
        FROZEN
    } else {
        (PROFILE, MICROBATCHES)
    };
    let output = Command::new(env!("CARGO_BIN_EXE_mpipe"))
        .current_dir(root())
        .args(["svg", "--model", profile, "--ranks", RANKS])
        .args(["--microbatches", microbatches, "--width", WIDTH])
        .arg(expr)
        .arg("-o")
        .arg(out)
        .output()
        .map_err(|e| format!("cannot run mpipe: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`mpipe svg ... {expr}` failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[test]
fn charts_are_what_mpipe_svg_draws() {
    let img = guide().join("img");
    let tmp = scratch("guide-charts");
    let mut problems = Vec::new();
    for (expr, file) in CHARTS {
        let fresh = tmp.join(file);
        if let Err(e) = draw(expr, &fresh) {
            problems.push(e);
            continue;
        }
        let fresh = std::fs::read(&fresh).expect("mpipe wrote the chart");
        let committed = img.join(file);
        if bless() {
            std::fs::create_dir_all(&img).expect("create docs/guide/img");
            std::fs::write(&committed, &fresh).expect("write the chart");
        } else {
            match std::fs::read(&committed) {
                Ok(old) if old == fresh => {}
                Ok(_) => problems.push(format!(
                    "docs/guide/img/{file} is not what `mpipe svg` draws for `{expr}` now"
                )),
                Err(e) => problems.push(format!(
                    "docs/guide/img/{file} (the chart of `{expr}`) cannot be read: {e}"
                )),
            }
        }
    }
    // No stale chart: every SVG there is in the list.
    if let Ok(entries) = std::fs::read_dir(&img) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".svg") && !CHARTS.iter().any(|(_, f)| *f == name) {
                if bless() {
                    std::fs::remove_file(entry.path()).expect("remove a stale chart");
                } else {
                    problems.push(format!(
                        "docs/guide/img/{name} is not in tests/guide.rs's CHARTS: add it there \
                         or delete it"
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the guide's charts are out of date:\n  {}\n{REGENERATE}",
        problems.join("\n  ")
    );
}

/// The guide's chapters, as (file name, text).
fn chapters() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(guide())
        .expect("docs/guide exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).expect("read a chapter"))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn every_chart_is_shown_and_every_image_link_resolves() {
    let all = chapters();
    let mut problems = Vec::new();
    for (_, file) in CHARTS {
        let link = format!("(img/{file})");
        if !all.iter().any(|(_, text)| text.contains(&link)) {
            problems.push(format!("no chapter shows img/{file}"));
        }
    }
    for (name, text) in &all {
        for (i, _) in text.match_indices("](img/") {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')').unwrap_or(rest.len())];
            if !guide().join(target).is_file() {
                problems.push(format!("{name} links to {target}, which does not exist"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_fence_names_its_language() {
    // trycmd runs a fence without a language as a console block, and rustdoc
    // compiles it as Rust: every example must say what it is.
    let mut problems = Vec::new();
    for (name, text) in chapters() {
        let mut open = false;
        for (n, line) in text.lines().enumerate() {
            if let Some(info) = line.trim_start().strip_prefix("```") {
                if !open && info.trim().is_empty() {
                    problems.push(format!("{name}:{}: a code fence without a language", n + 1));
                }
                open = !open;
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Copy the directory `from` (files and subdirectories) to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create a directory in the scratch copy");
    for entry in std::fs::read_dir(from)
        .expect("read a directory to copy")
        .flatten()
    {
        let path = entry.path();
        let dest = to.join(entry.file_name());
        if path.is_dir() {
            copy_dir(&path, &dest);
        } else {
            std::fs::copy(&path, &dest).expect("copy a file into the scratch copy");
        }
    }
}

#[test]
fn console_examples_run() {
    // The commands read `profiles/...` and `docs/guide/examples/...` as a user does
    // from the repository's root, and may write files: run them in a scratch copy.
    let work = scratch("guide-console");
    copy_dir(&root().join("profiles"), &work.join("profiles"));
    copy_dir(&guide().join("examples"), &work.join("docs/guide/examples"));
    // trycmd runs its commands in this process's working directory. No other test
    // of this binary depends on it (they use absolute paths).
    std::env::set_current_dir(&work).expect("enter the scratch copy");
    let cases = trycmd::TestCases::new();
    cases
        .register_bin("mpipe", Path::new(env!("CARGO_BIN_EXE_mpipe")))
        // The outputs shown are a terminal's: no periodic progress lines, however
        // long a command takes on a loaded machine.
        .env("MPIPE_PROGRESS_INTERVAL", "1000000")
        .timeout(std::time::Duration::from_secs(120));
    for (name, text) in chapters() {
        if text.contains("```console") {
            cases.case(guide().join(name));
        }
    }
    cases.run();
}
