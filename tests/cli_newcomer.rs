//! `mpipe` as a newcomer meets it (issue 38 items 6-9): one error per cause with
//! advice that fits the schedule, one meaning of peak memory with units, warnings
//! for degenerate schedules, progress on a pipe. Every test runs the real binary.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A profile file written for one test (removed when dropped).
struct Written(PathBuf);

impl Written {
    fn new(text: &str) -> Written {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "mpipe-newcomer-{}-{}.toml",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text).expect("write a temporary profile");
        Written(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Written {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn mpipe(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpipe"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run mpipe")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const SMALL_LLM: &str =
    "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";

/// A memory-limit failure is one error naming every rank it affects, and the
/// advice does not suggest the schedule written.
#[test]
fn memory_failure_is_one_error_over_the_ranks() {
    let p = Written::new(&format!("{SMALL_LLM}\n[memory]\nlimit = 2.5\n"));
    for (expr, advised) in [("gpipe", true), ("1f1b", false), ("zbh1", false)] {
        let o = mpipe(
            &[
                "simulate",
                "--model",
                p.path(),
                "--ranks",
                "4",
                "--microbatches",
                "16",
                expr,
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(2), "{expr}: {}", stderr(&o));
        let err = stderr(&o);
        assert_eq!(err.matches("error:").count(), 1, "{expr}: {err}");
        assert!(err.contains("ranks 0-"), "{expr}: {err}");
        assert!(!err.contains("on rank 1 "), "{expr}: {err}");
        if advised {
            assert!(err.contains("`1f1b`, `zbh1`"), "{expr}: {err}");
        } else {
            assert!(
                !err.contains("(`1f1b`") && !err.contains("`zbh1`)"),
                "{expr}: {err}"
            );
            assert!(err.contains("already keeps the fewest"), "{expr}: {err}");
        }
    }
    // `auto` tried 1f1b and zbh1 itself: it does not send the user back to them.
    let p = Written::new(&format!("{SMALL_LLM}\n[memory]\nlimit = 1.0\n"));
    let o = mpipe(
        &[
            "simulate",
            "--model",
            p.path(),
            "--ranks",
            "4",
            "--microbatches",
            "16",
            "auto",
        ],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(err.matches("error:").count(), 1, "{err}");
    assert!(!err.contains("(`1f1b`, `zbh1`)"), "{err}");
    assert!(err.contains("more ranks"), "{err}");
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The cell of column `header` in the row starting with `row` of a text table.
fn cell(table: &str, header: &str, row: &str) -> String {
    let lines: Vec<&str> = table.lines().collect();
    let h = lines
        .iter()
        .position(|l| l.starts_with("schedule") && l.contains(header))
        .unwrap_or_else(|| panic!("no header with {header}: {table}"));
    // Columns are right-aligned: a cell ends where its header ends.
    let end = lines[h].find(header).unwrap() + header.len();
    let line = lines[h + 2..]
        .iter()
        .find(|l| l.starts_with(row))
        .unwrap_or_else(|| panic!("no row {row}: {table}"));
    let before = &line[..end.min(line.len())];
    before.split_whitespace().last().unwrap().to_string()
}

/// `compare` and `evaluate` mean the same by peak memory (activations plus resident
/// parameters, as the limit), say so, and print the profile's `[units]` in headers;
/// a profile without `[units]` still works, with no unit in its headers.
#[test]
fn peak_memory_means_one_thing_with_units() {
    let with = Written::new(&format!(
        "{SMALL_LLM}params = 0.25\n\n[units]\ntime = \"ms\"\nmemory = \"GiB\"\n"
    ));
    let args = ["--ranks", "4", "--microbatches", "8"];
    let mut c = vec!["compare", "--model", with.path()];
    c.extend(args);
    c.extend(["1f1b", "zbv"]);
    let compare = mpipe(&c, &[]);
    assert!(compare.status.success(), "{}", stderr(&compare));
    let mut e = vec!["evaluate", with.path()];
    e.extend(args);
    let evaluate = mpipe(&e, &[]);
    assert!(evaluate.status.success(), "{}", stderr(&evaluate));
    let (ct, et) = (stdout(&compare), stdout(&evaluate));
    for t in [&ct, &et] {
        assert!(
            t.contains("makespan (ms)") && t.contains("peak memory (GiB)"),
            "{t}"
        );
        assert!(
            t.contains("peak memory: activations plus resident parameters"),
            "{t}"
        );
    }
    for expr in ["1f1b", "zbv"] {
        let a = cell(&ct, "peak memory (GiB)", expr);
        let b = cell(&et, "peak memory (GiB)", expr);
        assert_eq!(a, b, "{expr}:\n{ct}\n{et}");
    }
    // 1f1b on 4 ranks, 2 layers each: rank 0 holds 4 micro-batches x 2 layers of
    // activations plus 2 x 0.25 of parameters.
    assert_eq!(cell(&ct, "peak memory (GiB)", "1f1b"), "8.5", "{ct}");
    let mut s = vec!["simulate", "--model", with.path()];
    s.extend(args);
    s.push("1f1b");
    let sim = stdout(&mpipe(&s, &[]));
    assert!(
        sim.contains("compute (ms)") && sim.contains("activations (GiB)"),
        "{sim}"
    );

    let without = Written::new(SMALL_LLM);
    let mut c = vec!["compare", "--model", without.path()];
    c.extend(args);
    c.push("1f1b");
    let o = mpipe(&c, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains('('), "{}", stdout(&o));
    assert_eq!(cell(&stdout(&o), "peak memory", "1f1b"), "8");
}

/// On a pipe (not a terminal), a long `auto` reports progress on standard error, one
/// line per interval (`MPIPE_PROGRESS_INTERVAL`, shortened here so that the run
/// outlasts several intervals); standard output keeps only the result.
#[test]
fn auto_reports_progress_on_a_pipe() {
    let heavy = concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/encoder-heavy.toml");
    let args = [
        "simulate",
        "--model",
        heavy,
        "--ranks",
        "4",
        "--microbatches",
        "8",
        "auto",
    ];
    let started = std::time::Instant::now();
    let o = mpipe(&args, &[("MPIPE_PROGRESS_INTERVAL", "0.01")]);
    let took = started.elapsed();
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("mpipe: auto"))
        .collect();
    assert!(
        took.as_secs_f64() > 0.05,
        "the run is shorter than the test needs"
    );
    assert!(!lines.is_empty(), "no progress line in {took:?}: {err}");
    assert!(
        lines.iter().all(|l| l.contains('/') && l.ends_with("s)")),
        "{err}"
    );
    assert!(
        !stdout(&o).contains("mpipe: auto"),
        "progress went to stdout"
    );
}

/// `transpose(vision, 1f1b)` with fewer micro-batches than ranks is valid but leaves
/// ranks with no encoder work: it derives (exit 0) with a `warning:` naming them.
#[test]
fn degenerate_transpose_warns() {
    let heavy = concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/encoder-heavy.toml");
    let run = |mbs: &str| {
        mpipe(
            &[
                "simulate",
                "--model",
                heavy,
                "--ranks",
                "4",
                "--microbatches",
                mbs,
                "transpose(vision, 1f1b)",
            ],
            &[],
        )
    };
    let o = run("2");
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let warning = err
        .lines()
        .find(|l| l.starts_with("warning:"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        warning.contains("ranks 2-3") && warning.contains("no encoder work"),
        "{warning}"
    );
    assert!(!err.contains("error"), "{err}");
    let o = run("8");
    assert!(
        o.status.success() && !stderr(&o).contains("warning:"),
        "{}",
        stderr(&o)
    );
}
