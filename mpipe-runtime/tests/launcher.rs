//! Issue 37, item 6: the binaries survive their output closing, and the launcher
//! cleans up after itself on every exit path: its signals are passed on to the ranks,
//! its temporary directory is removed, and no rank outlives it, even when it is
//! killed with SIGKILL.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/pids.rs"]
mod pids;

const SELFTEST: &str = env!("CARGO_BIN_EXE_comm-selftest");
const MPIPE_RUN: &str = env!("CARGO_BIN_EXE_mpipe-run");

/// A fresh directory for `TMPDIR`, so a test sees only its own launches' directories.
fn fresh_tmp(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("mpipe-launcher-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn launch_dirs(tmp: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("mpipe-run-"))
        .map(|e| e.path())
        .collect()
}

/// Whether process `pid` runs (a zombie does not: nothing may reap it in a container).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
}

fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A rank whose standard output is a pipe nobody reads any more (a launcher killed
/// with `kill -9`, `| head`) exits quietly: it panicked with "failed printing to
/// stdout: Broken pipe".
#[test]
fn a_rank_with_its_stdout_closed_exits_quietly() {
    let port = mpipe_runtime::host::tcp::free_port().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(SELFTEST)
        .arg("ring")
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

/// The launcher's own standard output and error closing stop neither it nor its
/// ranks: their output is drained and dropped, and the run succeeds.
#[test]
fn the_launcher_survives_its_output_closing() {
    let tmp = fresh_tmp("closed");
    let (r1, w1) = std::io::pipe().unwrap();
    let (r2, w2) = std::io::pipe().unwrap();
    drop((r1, r2));
    let status = Command::new(MPIPE_RUN)
        .args(["-n", "3", "--", SELFTEST, "ring"])
        .env("TMPDIR", &tmp)
        .env("MPIPE_COMM_TIMEOUT", "8")
        .stdout(w1)
        .stderr(w2)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(launch_dirs(&tmp).is_empty());
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Starts `mpipe-run -n N comm-selftest sleep` and returns it with its ranks' pids
/// (each rank prints its pid once connected).
fn start_sleepers(n: usize, tmp: &Path) -> (Child, Vec<u32>) {
    let mut child = Command::new(MPIPE_RUN)
        .args([
            "-n",
            &n.to_string(),
            "--grace",
            "2",
            "--",
            SELFTEST,
            "sleep",
        ])
        .env("TMPDIR", tmp)
        .env("MPIPE_COMM_TIMEOUT", "8")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = pids::read_pids(child.stdout.take().unwrap());
    let pids: Vec<u32> = (0..n)
        .map(|_| {
            let (_, pid) = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("every rank connects and prints its pid");
            pid as u32
        })
        .collect();
    (child, pids)
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut s);
    }
    s
}

/// SIGTERM or SIGINT to the launcher: passed on to every rank, which stop; the
/// launcher exits with 128 + the signal and leaves no directory behind.
#[test]
fn a_signal_to_the_launcher_stops_its_ranks_and_removes_its_directory() {
    for (name, sig) in [("term", libc::SIGTERM), ("int", libc::SIGINT)] {
        let tmp = fresh_tmp(name);
        let (mut child, pids) = start_sleepers(2, &tmp);
        assert_eq!(launch_dirs(&tmp).len(), 1);
        let sent = Command::new("kill")
            .args([format!("-{sig}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = wait_exit(&mut child, Duration::from_secs(10)).expect("the launcher exits");
        let stderr = stderr_of(&mut child);
        assert_eq!(status.code(), Some(128 + sig), "{stderr}");
        assert!(
            stderr.contains(&format!("mpipe-run: got signal {sig}")),
            "{stderr}"
        );
        assert!(
            wait_until(Duration::from_secs(5), || pids.iter().all(|&p| !running(p))),
            "ranks {pids:?} outlived the launcher"
        );
        assert!(launch_dirs(&tmp).is_empty(), "{:?}", launch_dirs(&tmp));
        let _ = std::fs::remove_dir_all(&tmp);
    }
}

/// SIGKILL cannot be caught: the ranks still stop (their parent-death signal), and
/// the directory left behind is removed by the next launch.
#[test]
fn after_a_sigkill_no_rank_outlives_the_launcher_and_the_next_launch_cleans_up() {
    let tmp = fresh_tmp("kill");
    let (mut child, pids) = start_sleepers(2, &tmp);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || pids.iter().all(|&p| !running(p))),
        "ranks {pids:?} outlived the launcher"
    );
    assert_eq!(launch_dirs(&tmp).len(), 1, "SIGKILL leaves the directory");
    let status = Command::new(MPIPE_RUN)
        .args(["-n", "1", "--", SELFTEST, "ring"])
        .env("TMPDIR", &tmp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(launch_dirs(&tmp).is_empty(), "{:?}", launch_dirs(&tmp));
    let _ = std::fs::remove_dir_all(&tmp);
}
