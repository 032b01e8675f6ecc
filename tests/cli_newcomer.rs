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
