//! Starting the ranks of a host run as processes on this machine: what the
//! `mpipe-run` binary does.
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` and the launch's random rendezvous secret
//! in `MPIPE_RDZV_SECRET` (what [`crate::host::tcp::from_env`] reads; the secret keeps
//! other processes of the machine out of the job), and its output lines are copied to ours prefixed with `[rank R] ` (stdout
//! to stdout, stderr to stderr). When a rank exits unsuccessfully, the others get a
//! grace period to exit on their own (they should: the failed rank aborted them, or
//! its connections closed), then are killed; the launch's exit code is that of the
//! rank that failed first: a rank that failed of its own accord, never one that
//! failed because it learnt of another's failure (ranks set up by
//! [`crate::host::tcp::from_env`] note whom they blame before any of their calls
//! can fail on it), whatever order the exits are collected in; among several such,
//! the earliest to exit.
//!
//! The ranks stay in the launcher's process group, so Ctrl-C reaches them all; a
//! kill after the grace period reaches only each rank's own process, not processes
//! it started (run the rank's binary directly, not through a wrapper such as
//! `cargo run`).
//!
//! **Exits and signals.** The launcher's temporary directory (for the ranks' blame
//! notes) is removed on every exit path. With [`forward_signals`] installed (as
//! `mpipe-run` does), a `SIGINT`, `SIGTERM` or `SIGHUP` to the launcher is passed on
//! to every running rank; ranks still running after the grace period are killed,
//! the directory removed, and the launch ends with code 128 + the signal. `SIGKILL`
//! cannot be caught: on Linux every rank is started with `SIGTERM` as its
//! parent-death signal, so no rank outlives the launcher, and the directory it
//! leaves is removed by the next launch on the machine (a directory whose launcher
//! process no longer exists). The launcher's own standard output or error closing
//! does not stop it: the ranks' output is still drained (and dropped).

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::host::{signals, tcp};

/// What to launch.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The number of ranks (processes).
    pub ranks: usize,
    /// `MASTER_PORT`; `None` picks a free port outside the kernel's ephemeral range
    /// (so no socket bound to port 0 can take it before rank 0 listens on it).
    pub port: Option<u16>,
    /// How long the other ranks may take to exit after the first failure.
    pub grace: Duration,
    pub program: OsString,
    pub args: Vec<OsString>,
}

/// How one rank ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankExit {
    /// Exit code 0.
    Success,
    /// A non-zero exit code.
    Code(i32),
    /// Killed by a signal it did not get from us.
    Signal(i32),
    /// Still running after the grace period, so killed by the launcher.
    Killed,
    /// Its status could not be read.
    Unknown,
}

impl RankExit {
    fn from_status(st: ExitStatus) -> RankExit {
        if st.success() {
            return RankExit::Success;
        }
        if let Some(c) = st.code() {
            return RankExit::Code(c);
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(s) = st.signal() {
                return RankExit::Signal(s);
            }
        }
        RankExit::Unknown
    }

    /// A failure of the rank's own (not a kill after the grace period, not success).
    pub fn is_failure(self) -> bool {
        !matches!(self, RankExit::Success | RankExit::Killed)
    }

    /// The exit code a launcher should pass on for this exit.
    pub fn code(self) -> i32 {
        match self {
            RankExit::Success => 0,
            RankExit::Code(c) => c,
            RankExit::Signal(s) => 128 + s,
            RankExit::Killed => 137,
            RankExit::Unknown => 1,
        }
    }
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankExit::Success => write!(f, "exit code 0"),
            RankExit::Code(c) => write!(f, "exit code {c}"),
            RankExit::Signal(s) => write!(f, "signal {s}"),
            RankExit::Killed => write!(f, "killed by mpipe-run"),
            RankExit::Unknown => write!(f, "unknown status"),
        }
    }
}

/// How a launch ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Every rank's exit, in rank order.
    pub exits: Vec<RankExit>,
    /// The rank that failed first, if any.
    pub first_failure: Option<usize>,
    /// The launcher's exit code: 0, or the first failure's, or 128 + the signal
    /// that stopped the launch.
    pub code: i32,
    /// The signal (`SIGINT`, `SIGTERM`, `SIGHUP`) that stopped the launch, if one
    /// did (see [`forward_signals`]).
    pub signal: Option<i32>,
}

/// Makes `SIGINT`, `SIGTERM` and `SIGHUP` stop a [`launch`] in progress instead of
/// the process: the launch passes the signal on to every rank, gives them the grace
/// period, kills the rest, removes its temporary directory and returns with code
/// 128 + the signal. For a launcher binary's `main` (process-wide handlers).
pub fn forward_signals() {
    signals::note_signals();
}

/// Writes a line to standard error, ignoring a closed stream (the launcher must go
/// on draining and reaping its ranks whoever reads it).
fn say(text: &str) {
    let mut e = std::io::stderr().lock();
    let _ = e.write_all(text.as_bytes());
    let _ = e.write_all(b"\n");
}

/// Copies `src`'s lines to our stdout or stderr with a `[rank R] ` prefix, then
/// reports when `src` ended (the rank's exit, normally).
fn pump(rank: usize, src: impl Read, to_stderr: bool, done: mpsc::Sender<(usize, Instant)>) {
    let mut r = BufReader::new(src);
    let mut line = Vec::new();
    let prefix = format!("[rank {rank}] ");
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut out = Vec::with_capacity(prefix.len() + line.len());
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                // Our own stdout closing is no reason to stop draining the rank.
                if to_stderr {
                    let _ = std::io::stderr().lock().write_all(&out);
                } else {
                    let mut o = std::io::stdout().lock();
                    let _ = o.write_all(&out);
                    let _ = o.flush();
                }
            }
        }
    }
    let _ = done.send((rank, Instant::now()));
}

/// The rank whose failure came first, if any rank failed: `exits[r]` is how rank `r`
/// ended, `blamed[r]` the rank whose failure it learnt of before failing itself (its
/// blame note, see [`tcp::BLAME_DIR_VAR`]), `ended_at[r]` when it ended.
///
/// A failed rank that blames another rank that did not succeed is a consequence, never the
/// answer, however early its exit was seen: ranks learn of a failure and exit within
/// a millisecond, faster than a loaded machine lets the launcher tell exit times
/// apart. Among the others (the ranks that failed of their own accord), the earliest
/// to end is the answer.
///
/// A rank that timed out notes the peer it waited for, so when every failed rank
/// blames another, the answer is where the blame leads: each failed rank's chain of
/// notes is followed (through ranks that did not succeed) to its end, and the rank
/// most chains end at is the answer (ties: the earliest to end). That is a rank that
/// stopped making progress (stopped with `SIGSTOP`, hung), which its peers timed out
/// on and which the launcher killed after the grace period, never the first of them
/// to time out. Chains that end at a rank blaming nobody outrank chains that go round
/// a cycle (a rank that learnt of the failure of a rank that had timed out waiting for
/// it); a cycle answers only when every chain ends in one (a deadlock).
fn first_failure(
    exits: &[RankExit],
    blamed: &[Option<usize>],
    ended_at: &[Instant],
) -> Option<usize> {
    let failed = |r: usize| exits.get(r).is_some_and(|e| e.is_failure());
    // The rank blamed may also have been killed after the grace period (it aborted,
    // then hung): it still failed first.
    let consequence = |r: usize| {
        blamed
            .get(r)
            .copied()
            .flatten()
            .is_some_and(|q| q != r && exits.get(q).is_some_and(|&e| e != RankExit::Success))
    };
    let earliest =
        |candidates: &mut dyn Iterator<Item = usize>| candidates.min_by_key(|&r| (ended_at[r], r));
    let all = 0..exits.len();
    if let Some(r) = earliest(&mut all.clone().filter(|&r| failed(r) && !consequence(r))) {
        return Some(r);
    }
    // Every failed rank blames another: follow the notes to where they end, and
    // whether they end in a cycle.
    let end_of = |r: usize| {
        let mut path = vec![r];
        let mut at = r;
        while consequence(at) {
            let next = blamed[at].expect("a consequence blames a rank");
            if path.contains(&next) {
                return (at, true); // a cycle: its last rank reached stands for it
            }
            path.push(next);
            at = next;
        }
        (at, false)
    };
    let mut ends = vec![0usize; exits.len()];
    let mut cycle_ends = vec![0usize; exits.len()];
    for r in all.clone().filter(|&r| failed(r)) {
        match end_of(r) {
            (e, false) => ends[e] += 1,
            (e, true) => cycle_ends[e] += 1,
        }
    }
    // A chain that reaches a rank blaming nobody (one that stopped making progress)
    // outranks chains that go round in a cycle: two ranks blame each other when one
    // timed out on the other and the other learnt of that failure first, though it
    // was itself waiting for a third. Only a deadlock among failed ranks (cycles
    // alone) is answered by a cycle.
    if ends.iter().all(|&c| c == 0) {
        ends = cycle_ends;
    }
    all.filter(|&r| ends[r] > 0)
        .max_by_key(|&r| (ends[r], std::cmp::Reverse((ended_at[r], r))))
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Starts the ranks, waits for them, and reports. The rank that failed first is
/// the earliest to exit unsuccessfully among those that do not blame another failed
/// rank: ranks using [`tcp::from_env`] note in a file (in a temporary directory named
/// by [`tcp::BLAME_DIR_VAR`]) which rank's failure they learnt of, before their calls
/// can fail on it. Progress and the verdict go to stderr, prefixed `mpipe-run: `.
/// Fails only if the ranks cannot be started.
pub fn launch(cfg: &Launch) -> Result<Report, String> {
    let n = cfg.ranks;
    if n == 0 {
        return Err("the number of ranks must be at least 1".into());
    }
    let port = match cfg.port {
        Some(p) => p,
        None => master_port()?,
    };
    // Where ranks note whom they blame (see tcp::BLAME_DIR_VAR).
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    remove_stale_dirs(&std::env::temp_dir());
    let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{nonce}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    // Removed however `run` ends, a panic included.
    struct RemoveOnDrop<'p>(&'p std::path::Path);
    impl Drop for RemoveOnDrop<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0);
        }
    }
    let _remove = RemoveOnDrop(&dir);
    run(cfg, port, &dir)
}

/// The start of a launch's temporary directory's name; the launcher's pid and a
/// nonce follow.
const DIR_PREFIX: &str = "mpipe-run-";

/// Removes the temporary directories of launches whose launcher no longer runs (one
/// killed with `SIGKILL` cannot remove its own): those in `tmp` named by
/// [`DIR_PREFIX`], owned by this user, whose pid is not a live process.
fn remove_stale_dirs(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    let me = signals::user_id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest
            .split_once('-')
            .and_then(|(p, _)| p.parse::<u32>().ok())
            .filter(|&p| p > 0)
        else {
            continue;
        };
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            if meta.uid() != me {
                continue;
            }
        }
        let _ = me;
        if meta.is_dir() && signals::is_gone(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A free loopback port for `MASTER_PORT`, outside the kernel's range of ephemeral
/// ports. Between choosing the port and rank 0 listening on it, any socket bound to
/// port 0 (another launch's ranks' listeners, any outgoing connection) could take a
/// port of that range: rank 0 then fails with "address already in use", or another
/// world's ranks register with it. Falls back to any free port.
fn master_port() -> Result<u16, String> {
    let (lo, hi) = ephemeral_ports().unwrap_or((32768, 60999));
    let outside: Vec<u16> = (1024..lo).chain(hi.saturating_add(1)..=u16::MAX).collect();
    if !outside.is_empty() {
        // Start somewhere different for each launch, so concurrent launches rarely
        // try the same port.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize)
            ^ (std::process::id() as usize).wrapping_mul(2_654_435_761);
        for k in 0..outside.len().min(256) {
            let port = outside[(seed.wrapping_add(k.wrapping_mul(7919))) % outside.len()];
            if std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    tcp::free_port().map_err(|e| e.to_string())
}

/// The kernel's ephemeral port range (Linux), if it can be read.
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|w| w.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some((lo, hi))
}

fn run(cfg: &Launch, port: u16, dir: &std::path::Path) -> Result<Report, String> {
    let n = cfg.ranks;
    // This launch's rendezvous secret: only its own ranks can join (tcp, "Who may
    // join"). Passed in the environment, which other users cannot read.
    let secret = tcp::new_secret()
        .map_err(|e| format!("cannot make a rendezvous secret (reading /dev/urandom): {e}"))?;
    let (eof_tx, eof_rx) = mpsc::channel();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    let mut pumps = 0;
    for rank in 0..n {
        let mut command = Command::new(&cfg.program);
        // No rank outlives the launcher, even one killed with SIGKILL.
        signals::terminate_with_parent(&mut command);
        let spawned = command
            .args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(tcp::BLAME_DIR_VAR, dir)
            .env(tcp::SECRET_VAR, &secret)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(format!(
                    "cannot start {} for rank {rank}: {e}",
                    cfg.program.to_string_lossy()
                ));
            }
        };
        if let Some(out) = child.stdout.take() {
            let tx = eof_tx.clone();
            std::thread::spawn(move || pump(rank, out, false, tx));
            pumps += 1;
        }
        if let Some(err) = child.stderr.take() {
            let tx = eof_tx.clone();
            std::thread::spawn(move || pump(rank, err, true, tx));
            pumps += 1;
        }
        children.push(child);
    }
    drop(eof_tx);

    let mut exits: Vec<Option<RankExit>> = vec![None; n];
    let mut seen_at: Vec<Option<Instant>> = vec![None; n];
    let mut first_failure_at: Option<Instant> = None;
    let mut signal: Option<i32> = None;
    loop {
        if let Some(sig) = signals::take_noted() {
            signal = Some(sig);
            say(&format!(
                "mpipe-run: got signal {sig}; passing it on to the ranks (killed after {:?})",
                cfg.grace
            ));
            for (r, child) in children.iter().enumerate() {
                // Not yet reaped (its exit is not recorded), so the pid is still its.
                if exits[r].is_none() {
                    signals::send(child.id(), sig);
                }
            }
            first_failure_at.get_or_insert_with(Instant::now);
        }
        for (r, child) in children.iter_mut().enumerate() {
            if exits[r].is_some() {
                continue;
            }
            let exit = match child.try_wait() {
                Ok(None) => continue,
                Ok(Some(st)) => RankExit::from_status(st),
                Err(_) => RankExit::Unknown,
            };
            exits[r] = Some(exit);
            seen_at[r] = Some(Instant::now());
            if exit.is_failure() && first_failure_at.is_none() {
                first_failure_at = Some(Instant::now());
                if exits.iter().any(Option::is_none) {
                    say(&format!(
                        "mpipe-run: rank {r} exited with {exit}; waiting up to {:?} for the other ranks to exit",
                        cfg.grace
                    ));
                }
            }
        }
        if exits.iter().all(Option::is_some) {
            break;
        }
        if first_failure_at.is_some_and(|t| t.elapsed() >= cfg.grace) {
            for (r, child) in children.iter_mut().enumerate() {
                if exits[r].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    exits[r] = Some(RankExit::Killed);
                    say(&format!(
                        "mpipe-run: killed rank {r}: still running {:?} after the first failure",
                        cfg.grace
                    ));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let exits: Vec<RankExit> = exits
        .into_iter()
        .map(|e| e.unwrap_or(RankExit::Unknown))
        .collect();

    // A rank's output pipes close the moment it exits, and their readers wake at
    // once: a finer clock for "who failed first" than polling the exit statuses.
    let mut eofs: Vec<Vec<Instant>> = vec![Vec::new(); n];
    // (A rank's children that outlive it may hold its pipes open: wait briefly.)
    let until = Instant::now() + Duration::from_millis(500);
    for _ in 0..pumps {
        let left = until.saturating_duration_since(Instant::now());
        match eof_rx.recv_timeout(left) {
            Ok((r, t)) => eofs[r].push(t),
            Err(_) => break,
        }
    }
    let ended_at: Vec<Instant> = (0..n)
        .map(|r| {
            let seen = seen_at[r].unwrap_or_else(Instant::now);
            match eofs[r].iter().max() {
                Some(&t) if eofs[r].len() == 2 => t.min(seen),
                _ => seen,
            }
        })
        .collect();
    let blamed: Vec<Option<usize>> = (0..n)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(tcp::blame_file_name(r))).ok()?;
            text.lines().next()?.trim().parse().ok()
        })
        .collect();
    if let Some(sig) = signal {
        let exits_shown: Vec<String> = (0..n).map(|q| format!("rank {q}: {}", exits[q])).collect();
        say(&format!(
            "mpipe-run: stopped by signal {sig} ({})",
            exits_shown.join(", ")
        ));
        return Ok(Report {
            exits,
            first_failure: None,
            code: 128 + sig,
            signal,
        });
    }
    let first_failure = first_failure(&exits, &blamed, &ended_at);
    let code = first_failure.map_or(0, |r| exits[r].code());
    if let Some(r) = first_failure {
        let others: Vec<String> = (0..n)
            .filter(|&q| q != r && exits[q] != RankExit::Success)
            .map(|q| format!("rank {q}: {}", exits[q]))
            .collect();
        let stalled = if exits[r] == RankExit::Killed {
            " and had stopped making progress: the others timed out waiting for it"
        } else {
            ""
        };
        say(&format!(
            "mpipe-run: rank {r} failed first ({}{stalled}){}",
            exits[r],
            if others.is_empty() {
                String::new()
            } else {
                format!("; then {}", others.join(", "))
            }
        ));
    }
    Ok(Report {
        exits,
        first_failure,
        code,
        signal: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 1 crashed (exit 3); rank 2 saw it and exited 1, and its exit was seen
    /// first (a loaded machine, or its pipes' readers woke first).
    #[test]
    fn a_rank_that_blames_a_failed_rank_is_never_first() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let exits = [
            RankExit::Code(1),
            RankExit::Code(3),
            RankExit::Code(1),
            RankExit::Code(1),
        ];
        let blamed = [Some(1), None, Some(1), Some(1)];
        let ended = [at(9), at(8), at(1), at(7)];
        assert_eq!(first_failure(&exits, &blamed, &ended), Some(1));
        // Without its note, rank 2 would have been taken for the first failure.
        let unnoted = [Some(1), None, None, Some(1)];
        assert_eq!(first_failure(&exits, &unnoted, &ended), Some(2));
    }

    /// Rank 2 was stopped (SIGSTOP): ranks 1 and 3 timed out waiting for it (their
    /// notes name it), rank 0 timed out waiting for rank 1, and rank 3's exit was
    /// seen first; rank 2 was killed after the grace period. Issue 37, item 10: the
    /// launcher said "rank 3 failed first".
    #[test]
    fn a_stalled_rank_that_the_others_timed_out_on_failed_first() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let exits = [
            RankExit::Code(1),
            RankExit::Code(1),
            RankExit::Killed,
            RankExit::Code(1),
        ];
        let blamed = [Some(1), Some(2), None, Some(2)];
        let ended = [at(5), at(4), at(9000), at(1)];
        assert_eq!(first_failure(&exits, &blamed, &ended), Some(2));
        // Rank 1 stopped: rank 0 timed out on it; rank 3 timed out on rank 2, which
        // was waiting for rank 1 but learnt of rank 3's failure first (2 and 3 blame
        // each other, and ended first).
        let exits = [
            RankExit::Code(1),
            RankExit::Killed,
            RankExit::Code(1),
            RankExit::Code(1),
        ];
        let blamed = [Some(1), None, Some(3), Some(2)];
        let ended = [at(9), at(9000), at(2), at(1)];
        assert_eq!(first_failure(&exits, &blamed, &ended), Some(1));
        // A deadlock between two failed ranks (each timed out on the other): one of
        // them, not a bystander.
        let exits = [RankExit::Code(1), RankExit::Code(1), RankExit::Success];
        let r = first_failure(&exits, &[Some(1), Some(0), None], &[at(2), at(1), at(0)]);
        assert!(matches!(r, Some(0 | 1)), "{r:?}");
        // A rank that timed out on a rank that succeeded failed of its own accord.
        let exits = [RankExit::Success, RankExit::Code(1)];
        assert_eq!(
            first_failure(&exits, &[None, Some(0)], &[at(0), at(1)]),
            Some(1)
        );
    }

    #[test]
    fn the_master_port_is_free_and_not_ephemeral() {
        let port = master_port().unwrap();
        if let Some((lo, hi)) = ephemeral_ports() {
            assert!(!(lo..=hi).contains(&port), "{port} in {lo}..={hi}");
        }
        std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)).unwrap();
    }

    #[test]
    fn the_earliest_of_independent_failures_is_first() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let exits = [RankExit::Success, RankExit::Code(3), RankExit::Signal(9)];
        let ended = [at(1), at(5), at(4)];
        assert_eq!(first_failure(&exits, &[None; 3], &ended), Some(2));
        // Blaming a rank that succeeded (it said goodbye) does not excuse a failure.
        assert_eq!(
            first_failure(&exits, &[None, None, Some(0)], &ended),
            Some(2)
        );
        assert_eq!(
            first_failure(&[RankExit::Success; 3], &[None; 3], &ended),
            None
        );
    }
}
