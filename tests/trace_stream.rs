//! Issue 37, item 2: `mpipe trace` writes the trace event by event (memory bounded
//! by the program, not by the file: 10.7 GB for an 806 MB trace before). The bytes
//! must not change: `tests/golden/trace-encoder-heavy-4x8-1f1b.json` was written by
//! the previous, in-memory writer.
use std::process::Command;

#[test]
fn the_streamed_trace_equals_the_in_memory_one_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("mpipe-trace-stream-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("t.json");
    let root = env!("CARGO_MANIFEST_DIR");
    let status = Command::new(env!("CARGO_BIN_EXE_mpipe"))
        .current_dir(root)
        .args([
            "trace",
            "--model",
            "profiles/encoder-heavy.toml",
            "--ranks",
            "4",
            "--microbatches",
            "8",
            "--embed-program",
            "-o",
        ])
        .arg(&out)
        .arg("1f1b")
        .status()
        .unwrap();
    assert!(status.success());
    let got = std::fs::read(&out).unwrap();
    let want = std::fs::read(format!(
        "{root}/tests/golden/trace-encoder-heavy-4x8-1f1b.json"
    ))
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        got == want,
        "the streamed trace differs from the in-memory writer's"
    );
}
