//! Issue 37, item 11 through the `mllm` example: training whose loss stops being a
//! finite number stops with an error naming the step (it printed `loss NaN` and
//! exited 0), and a resume from a checkpoint holding a NaN parameter is refused
//! naming the unit.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use mpipe::runtime::checkpoint::{encode, load, write_atomic, Manifest, MANIFEST};

fn example() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| common::example(&[]))
}

fn run(args: &[&str]) -> (Output, String) {
    let out = Command::new(example())
        .args(args)
        .env("MPIPE_COMM_TIMEOUT", "8")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stderr)
}

#[test]
fn a_diverging_run_stops_at_the_step_whose_loss_is_not_finite() {
    // A learning rate of 1e30 makes the second step's loss NaN.
    let (out, stderr) = run(&["--steps", "6", "--lr", "1e30"]);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("step 2/6: the loss is NaN, not a finite number"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("-> NaN"), "{stdout}");

    let (out, stderr) = run(&["--steps", "6", "--lr", "1e30", "--processes"]);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("mpipe-run: rank 3 failed first"),
        "{stderr}"
    );
    assert!(stderr.contains("step 2/6: the loss is NaN"), "{stderr}");
}

#[test]
fn resuming_from_a_forged_nan_parameter_is_refused_naming_the_unit() {
    let dir = std::env::temp_dir().join(format!("mpipe-mllm-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let (out, stderr) = run(&["--steps", "2", "--checkpoint", d, "--checkpoint-every", "2"]);
    assert_eq!(out.status.code(), Some(0), "{stderr}");

    // Rank 0's first parameter becomes NaN, with the file's and the manifest's
    // checksums recomputed.
    let mut m = Manifest::read(&dir).unwrap();
    let entry = &mut m.ranks[0];
    let file = dir.join(&entry.file);
    let mut state = load(&file).unwrap();
    state.units[0].params[0] = f32::NAN;
    let unit = state.units[0].name.clone();
    let bytes = encode(&state);
    write_atomic(&file, &bytes).unwrap();
    entry.size = bytes.len() as u64;
    entry.checksum = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap());
    write_atomic(&dir.join(MANIFEST), m.to_text().as_bytes()).unwrap();

    let (out, stderr) = run(&["--steps", "4", "--resume", d]);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("unit `{unit}`'s parameters holds NaN at index 0")),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
