//! Issue 37, "Done when": killing any rank of a job launched as processes by
//! `mpipe-run` (rank 0, a middle rank, the last rank) stops every other rank within
//! 10 s, of their own accord (none is left for the launcher to kill), and the
//! launcher names the killed rank as the one that failed first; a rank stopped with
//! `SIGSTOP` is named too (the others time out on it). On the host TCP backend, and
//! with the `ascend` feature on the Ascend backend (HCCL on the ascend-sys emulator,
//! whose rank 0 also serves the communicator to the other processes: stopping it,
//! the others stop within 10 s too, by the hub's heartbeat, at HCCL's default
//! timeout).
//!
//! The ranks are `comm-selftest spin`: batch after batch around a ring, so every
//! rank is communicating when the signal arrives. Each rank prints its pid once its
//! world is formed; the signal goes to that pid (the launcher has not reaped it).
#![cfg(unix)]

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/pids.rs"]
mod pids;

const SELFTEST: &str = env!("CARGO_BIN_EXE_comm-selftest");
const MPIPE_RUN: &str = env!("CARGO_BIN_EXE_mpipe-run");

/// The bound: every other rank stops within this time of the kill.
const STOP_BOUND: Duration = Duration::from_secs(10);

/// How long the ranks may take to form their world (a loaded machine).
const SETUP: Duration = Duration::from_secs(60);

/// A launched job: the launcher, its ranks' pids, its standard error.
struct Job {
    launcher: Child,
    pids: Vec<i32>,
    stderr: std::thread::JoinHandle<String>,
}

impl Drop for Job {
    /// A failing assertion leaves nothing running: the launcher's death sends its
    /// ranks their parent-death signal, and stopped ranks are killed outright.
    fn drop(&mut self) {
        for &pid in &self.pids {
            if self.launcher.try_wait().ok().flatten().is_none() {
                signal(pid, libc::SIGKILL);
            }
        }
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
    }
}

/// Sends `sig` to `pid` with `kill(1)`.
fn signal(pid: i32, sig: i32) -> bool {
    Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts `mpipe-run -n N --grace G -- comm-selftest ARGS` and waits until every rank
/// has printed its pid.
fn launch(n: usize, grace_s: u64, args: &[&str], env: &[(&str, &str)]) -> Job {
    let mut cmd = Command::new(MPIPE_RUN);
    // Its own process group, as a shell job: were the test's group orphaned (a CI
    // runner without job control), a member's exit would send a stopped rank SIGHUP
    // (POSIX: a newly orphaned group with a stopped member), which is not the
    // stop the test is about.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.args(["-n", &n.to_string(), "--grace", &grace_s.to_string(), "--"])
        .arg(SELFTEST)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut launcher = cmd.spawn().expect("start mpipe-run");
    let rx = pids::read_pids(launcher.stdout.take().expect("piped"));
    let mut err = launcher.stderr.take().expect("piped");
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut job = Job {
        launcher,
        pids: vec![0; n],
        stderr,
    };
    let until = Instant::now() + SETUP;
    for _ in 0..n {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok((rank, pid)) => job.pids[rank] = pid,
            Err(e) => {
                drop(job);
                panic!("the ranks did not all start within {SETUP:?}: {e}");
            }
        }
    }
    job
}

/// Waits for the launcher to exit (at most `limit`); its exit code and stderr.
fn finish(mut job: Job, limit: Duration) -> (Option<i32>, String, Duration) {
    let t = Instant::now();
    let mut code = None;
    while t.elapsed() < limit {
        if let Some(st) = job.launcher.try_wait().expect("wait") {
            code = Some(st.code().unwrap_or(-1));
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = t.elapsed();
    let launcher_pid = job.launcher.id();
    // (Kills whatever still runs; the stderr reader then ends.)
    let stderr_thread = std::mem::replace(&mut job.stderr, std::thread::spawn(String::new));
    drop(job);
    let stderr = stderr_thread.join().unwrap_or_default();
    assert!(
        code.is_some(),
        "mpipe-run ({launcher_pid}) still ran {limit:?} after the signal:\n{stderr}"
    );
    (code, stderr, took)
}

/// Kills `victim` of an `n`-rank job running `args` with SIGKILL: the launcher ends
/// within [`STOP_BOUND`] (its grace period is far longer, so no rank is left for it to
/// kill), naming the victim as the first failure.
fn kill_one(n: usize, victim: usize, args: &[&str], env: &[(&str, &str)]) {
    // Grace far beyond the bound: a rank that does not stop of its own accord shows
    // as "killed rank" and a launch longer than the bound.
    let job = launch(n, 60, args, env);
    // The ranks are in their loop of batches (each printed its pid after set-up).
    assert!(signal(job.pids[victim], libc::SIGKILL));
    let (code, stderr, took) = finish(job, STOP_BOUND + Duration::from_secs(20));
    assert!(
        stderr.contains(&format!(
            "mpipe-run: rank {victim} failed first (signal {})",
            libc::SIGKILL
        )),
        "rank {victim} was killed:\n{stderr}"
    );
    assert!(
        !stderr.contains("mpipe-run: killed rank"),
        "every other rank should stop on its own:\n{stderr}"
    );
    assert_eq!(code, Some(128 + libc::SIGKILL), "{stderr}");
    assert!(
        took < STOP_BOUND,
        "the others took {took:?} to stop after rank {victim} was killed:\n{stderr}"
    );
}

/// Stops `victim` with SIGSTOP: the others time out on it (after the backend's
/// timeout, set short by `env`) or lose it, the launcher kills it after the grace
/// period and names it, not the first rank to time out. Returns how long after the
/// signal the last of the others exited.
fn stop_one(n: usize, victim: usize, args: &[&str], env: &[(&str, &str)]) -> Duration {
    let job = launch(n, 3, args, env);
    assert!(signal(job.pids[victim], libc::SIGSTOP));
    let stopped = Instant::now();
    // Each other rank's exit, as its pid's end (the launcher reaps it within
    // milliseconds); the victim's does not count.
    let mut running: Vec<i32> = (0..n)
        .filter(|&r| r != victim)
        .map(|r| job.pids[r])
        .collect();
    while !running.is_empty() && stopped.elapsed() < Duration::from_secs(90) {
        running.retain(|&pid| signal(pid, 0));
        std::thread::sleep(Duration::from_millis(20));
    }
    let others_took = stopped.elapsed();
    let (code, stderr, _) = finish(job, Duration::from_secs(90));
    assert!(
        stderr.contains(&format!("mpipe-run: rank {victim} failed first")),
        "rank {victim} was stopped:\n{stderr}"
    );
    assert!(stderr.contains("stopped making progress"), "{stderr}");
    assert_eq!(code, Some(137), "{stderr}");
    assert!(
        !(0..n).any(|r| r != victim && stderr.contains(&format!("mpipe-run: killed rank {r}:"))),
        "only the stopped rank is left for the launcher to kill:\n{stderr}"
    );
    others_took
}

mod host {
    use super::*;

    const ENV: &[(&str, &str)] = &[("MPIPE_COMM_TIMEOUT", "2")];

    #[test]
    fn killing_rank_0_stops_the_others_naming_it() {
        kill_one(4, 0, &["spin"], ENV);
    }

    #[test]
    fn killing_a_middle_rank_stops_the_others_naming_it() {
        kill_one(4, 2, &["spin"], ENV);
    }

    #[test]
    fn killing_the_last_rank_stops_the_others_naming_it() {
        kill_one(4, 3, &["spin"], ENV);
    }

    #[test]
    fn a_stopped_rank_is_blamed() {
        let _ = stop_one(4, 1, &["spin"], ENV);
    }
}

#[cfg(feature = "ascend")]
mod ascend {
    use super::*;
    use mpipe_runtime::ascend::{run_ranks, AscendError};
    use mpipe_runtime::comm::{Comm, Tag};

    /// Ranks as threads of one process (one emulated device each): whichever rank's
    /// thread dies (panics) while every rank is busy exchanging batches around a
    /// ring, every other rank stops within [`STOP_BOUND`] (HCCL's timeout is 60 s
    /// here, so only liveness passes), its error naming the dead rank.
    #[test]
    fn a_dying_rank_thread_stops_the_others_naming_it() {
        // The only in-process HCCL of this binary; read when a wait starts.
        std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", "60000");
        let n = 4;
        for victim in [0, 2, n - 1] {
            let died = std::sync::OnceLock::new();
            let out = run_ranks(n, |mut c| -> Result<_, AscendError> {
                let (r, n) = (c.rank(), c.world());
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                for mb in 0..u32::MAX {
                    if r == victim && mb == 50 {
                        died.get_or_init(Instant::now);
                        panic!("killed on purpose");
                    }
                    if let Err(e) = c.batch(
                        &[(next, Tag::act(0, mb), &[r as f32; 64])],
                        &[(prev, Tag::act(0, mb), 64)],
                    ) {
                        return Ok((e, died.get().map(|t| t.elapsed())));
                    }
                }
                unreachable!("the ring ran to completion");
            });
            for (r, o) in out.iter().enumerate() {
                if r == victim {
                    let e = o.as_ref().unwrap_err();
                    assert!(e.contains("killed on purpose"), "{e}");
                    continue;
                }
                let (e, after) = o.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
                assert!(
                    matches!(e, AscendError::PeerFailed { rank, .. } if *rank == victim),
                    "rank {r} should name rank {victim}: {e}"
                );
                let after = after.expect("fails only after the victim died");
                assert!(
                    after < STOP_BOUND,
                    "rank {r} stopped {after:?} after rank {victim} died"
                );
            }
        }
    }

    /// HCCL's timeout: only a stopped rank's peers reach it.
    const ENV: &[(&str, &str)] = &[("MPIPE_ASCEND_EMU_TIMEOUT_MS", "2000")];

    /// Rank 0's process also serves the communicator (the emulator's hub): the
    /// others lose it and name rank 0.
    #[test]
    fn killing_rank_0_stops_the_others_naming_it() {
        kill_one(4, 0, &["--ascend", "spin"], ENV);
    }

    #[test]
    fn killing_a_middle_rank_stops_the_others_naming_it() {
        kill_one(4, 2, &["--ascend", "spin"], ENV);
    }

    #[test]
    fn killing_the_last_rank_stops_the_others_naming_it() {
        kill_one(4, 3, &["--ascend", "spin"], ENV);
    }

    #[test]
    fn a_stopped_rank_is_blamed() {
        let _ = stop_one(4, 2, &["--ascend", "spin"], ENV);
    }

    /// Rank 0's process serves the communicator: stopped, it answers nothing but
    /// closes nothing either. The others find it by its missing heartbeat and stop
    /// within [`STOP_BOUND`], with HCCL's timeout at its default (20 s, longer than
    /// the bound: only the heartbeat can pass), naming rank 0.
    #[test]
    fn a_stopped_rank_0_stops_the_others_within_the_bound_naming_it() {
        let default_timeout = [("MPIPE_ASCEND_EMU_TIMEOUT_MS", "20000")];
        let took = stop_one(4, 0, &["--ascend", "spin"], &default_timeout);
        assert!(
            took < STOP_BOUND,
            "the others took {took:?} to stop after rank 0 was stopped"
        );
    }
}
