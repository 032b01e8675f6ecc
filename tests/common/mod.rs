//! Helpers shared by the integration tests that run the built `mllm` example.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `mllm` example next to this test's binary (`target/PROFILE/examples/mllm`),
/// brought up to date with `cargo build --example mllm` and `features` first (a no-op
/// when `cargo test` has built it with them).
pub(crate) fn example(features: &[&str]) -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let profile_dir = me.parent().and_then(Path::parent).unwrap().to_path_buf();
    let exe = profile_dir
        .join("examples")
        .join(format!("mllm{}", std::env::consts::EXE_SUFFIX));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--quiet", "--example", "mllm"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(p) => {
            cmd.args(["--profile", p]);
        }
        None => {}
    }
    if let Some(target) = profile_dir.parent() {
        cmd.arg("--target-dir").arg(target);
    }
    let built = cmd.status().map(|s| s.success()).unwrap_or(false);
    assert!(
        built || exe.exists(),
        "cannot build the mllm example ({})",
        exe.display()
    );
    exe
}
