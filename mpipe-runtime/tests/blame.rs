//! Issue 37, item 10: after `SIGSTOP` of rank 2 (host backend, processes under
//! `mpipe-run`), the launcher said "rank 3 failed first" (the first rank to time out
//! waiting for rank 2). Ranks that time out now note the peer they waited for, and the
//! launcher follows the notes to the rank that stopped making progress.
#![cfg(unix)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "support/pids.rs"]
mod pids;

const SELFTEST: &str = env!("CARGO_BIN_EXE_comm-selftest");
const MPIPE_RUN: &str = env!("CARGO_BIN_EXE_mpipe-run");

#[test]
fn a_stopped_rank_is_blamed_not_the_first_to_time_out() {
    let n = 4;
    let stopped = 2;
    // Every rank waits 2 s after connecting, then runs the ring; rank 2 is stopped
    // by then, so its neighbours time out on it (after 2 s).
    let mut launcher = Command::new(MPIPE_RUN);
    // Its own process group, as a shell job: were the test's group orphaned (a CI
    // runner without job control), a member's exit would send the stopped rank
    // SIGHUP (POSIX: a newly orphaned group with a stopped member).
    std::os::unix::process::CommandExt::process_group(&mut launcher, 0);
    let mut launcher = launcher
        .args([
            "-n",
            &n.to_string(),
            "--grace",
            "1",
            "--",
            SELFTEST,
            "stall",
            "2000",
        ])
        .env("MPIPE_COMM_TIMEOUT", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rx = pids::read_pids(launcher.stdout.take().unwrap());
    let mut err = launcher.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let pid = loop {
        let (rank, pid) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("every rank connects and prints its pid");
        if rank == stopped {
            break pid;
        }
    };
    // The rank is still running, so the launcher has not reaped it: the pid is its.
    let sent = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("kill(1)");
    assert!(sent.success(), "kill -STOP {pid}");
    let status = launcher.wait().unwrap();
    let stderr = stderr.join().unwrap();
    assert!(
        stderr.contains(&format!("mpipe-run: rank {stopped} failed first")),
        "the launcher should blame the stopped rank:\n{stderr}"
    );
    assert!(stderr.contains("stopped making progress"), "{stderr}");
    assert_eq!(status.code(), Some(137), "{stderr}");
}
