//! A self-test of the host TCP backend, to run under a launcher:
//! `mpipe-run -n 4 -- comm-selftest [ring | fail RANK CODE]`.
//!
//! - `ring` (the default): every rank sends a tensor to the next rank and receives
//!   one from the previous in one batch (three rounds), then checks an all-reduce, a
//!   broadcast, a reduce and a barrier; prints `rank R: ok` and exits 0.
//! - `fail RANK CODE`: rank RANK exits with CODE right after connecting, without a
//!   goodbye (like a crash); the others run `ring`, fail naming it, and exit 1.
//! - `hang RANK CODE`: rank RANK exits with CODE right after connecting; the others
//!   sleep for a minute without communicating (hung ranks, for the launcher to
//!   kill).
//! - `late RANK MS`: rank RANK waits MS milliseconds before connecting; then all
//!   run `ring` (a window for strangers to knock at the rendezvous).
//! - `sleep`: every rank prints `rank R pid P` after connecting, then sleeps for a
//!   minute (for signals to the launcher).
//! - `stall MS`: every rank prints `rank R pid P` after connecting, waits MS
//!   milliseconds, then runs `ring` (a window to stop a rank with `SIGSTOP`).
//! - `spin`: every rank prints `rank R pid P` after connecting, then sends to the next
//!   rank and receives from the previous, batch after batch, until a call fails
//!   (prints the error, aborts, exits 1) or for two minutes (exits 0): ranks busy
//!   communicating, for a test to kill or stop one of them.
//!
//! With `--ascend` first (a build with the `ascend` feature), the ranks join an
//! HCCL world instead ([`mpipe_runtime::ascend::AscendComm::from_env`], one emulated
//! device per rank); offered there: `spin`, and `late RANK MS`: every rank prints
//! `rank R pid P` before joining, rank RANK waits MS milliseconds before joining
//! (a window for strangers to knock at the root-info store and at the emulator's
//! hub in rank 0's process; with `MPIPE_SELFTEST_GO` naming a file, it waits until
//! that file exists instead, for at most MS milliseconds), then every rank runs 100
//! batches of `spin` and prints `rank R: ok`. HCCL's timeout is the emulator's `MPIPE_ASCEND_EMU_TIMEOUT_MS`.
//!
//! The timeout is `MPIPE_COMM_TIMEOUT` seconds (default 10); the transfers' mode is
//! `MPIPE_COMM_MODE` (`rendezvous`, the default, or `eager`; `ok (eager)` then).

use std::process::ExitCode;

use mpipe_runtime::comm::{Comm, Error, Tag};
use mpipe_runtime::host::{default_timeout, tcp, HostComm};
// A closed standard output ends the rank quietly (status 0), never with a panic.
use mpipe_runtime::{errln as eprintln, outln as println};

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

fn ring(c: &mut impl HostComm) -> Result<(), String> {
    let (r, n) = (c.rank(), c.world());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let e = |e: Error| e.to_string();
    for round in 0..3u32 {
        let mine: Vec<f32> = (0..1000)
            .map(|i| (r * 1000 + i) as f32 + round as f32)
            .collect();
        let tag = Tag::act(7, round);
        let got = c
            .batch(&[(next, tag, &mine)], &[(prev, tag, 1000)])
            .map_err(e)?;
        let want: Vec<f32> = (0..1000)
            .map(|i| (prev * 1000 + i) as f32 + round as f32)
            .collect();
        check(got[0] == want, || {
            format!("round {round}: wrong data from rank {prev}")
        })?;
    }
    let mut buf = vec![r as f32, 1.0];
    let group: Vec<usize> = (0..n).collect();
    c.all_reduce(&group, Tag::grads(1), &mut buf).map_err(e)?;
    let sum = (n * (n - 1) / 2) as f32;
    check(buf == [sum, n as f32], || {
        format!("all_reduce gave {buf:?}")
    })?;
    let mut p = if r == n - 1 {
        vec![42.0; 5]
    } else {
        vec![0.0; 5]
    };
    c.broadcast(n - 1, &group, Tag::params(2), &mut p)
        .map_err(e)?;
    check(p == [42.0; 5], || format!("broadcast gave {p:?}"))?;
    let mut g = vec![1.0f32; 3];
    c.reduce(0, &group, Tag::grads(3), &mut g).map_err(e)?;
    check(r != 0 || g == vec![n as f32; 3], || {
        format!("reduce gave {g:?}")
    })?;
    c.barrier().map_err(e)?;
    Ok(())
}

const USAGE: &str = "usage: comm-selftest [--ascend] [ring | fail RANK CODE | hang RANK CODE | \
                     late RANK MS | sleep | stall MS | spin]";

/// `spin`: batch after batch around the ring until a call fails, two minutes pass or
/// (if given) `rounds` batches are done.
fn spin<C: Comm>(c: &mut C, rounds: Option<u32>) -> Result<(), C::Error> {
    let (r, n) = (c.rank(), c.world());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mine = vec![r as f32; 256];
    let start = std::time::Instant::now();
    let mut round = 0u32;
    while start.elapsed() < std::time::Duration::from_secs(120) && rounds.is_none_or(|k| round < k)
    {
        let tag = Tag::act(7, round);
        c.batch(&[(next, tag, &mine)], &[(prev, tag, mine.len())])?;
        round = round.wrapping_add(1);
    }
    Ok(())
}

/// Runs `spin` on `c` (saying its pid first if `say_pid`), saying how it ended.
fn spin_and_report<C: Comm>(mut c: C, say_pid: bool, rounds: Option<u32>) -> ExitCode {
    let r = c.rank();
    if say_pid {
        println!("rank {r} pid {}", std::process::id());
    }
    match spin(&mut c, rounds) {
        Ok(()) => {
            println!("rank {r}: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {r}: {e}");
            c.abort(&e.to_string());
            ExitCode::from(1)
        }
    }
}

#[cfg(feature = "ascend")]
fn ascend(args: &[String]) -> ExitCode {
    let late = match args {
        [m] if m == "spin" => None,
        [m, r, ms] if m == "late" => match (r.parse::<usize>(), ms.parse::<u64>()) {
            (Ok(r), Ok(ms)) => Some((r, ms)),
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("comm-selftest --ascend offers `spin` and `late RANK MS`; {USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Some((late, ms)) = late {
        let me = std::env::var("RANK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok());
        if let Some(me) = me {
            println!("rank {me} pid {}", std::process::id());
        }
        if me == Some(late) {
            let limit = std::time::Duration::from_millis(ms);
            match std::env::var_os("MPIPE_SELFTEST_GO") {
                Some(go) => {
                    let t = std::time::Instant::now();
                    while !std::path::Path::new(&go).exists() && t.elapsed() < limit {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
                None => std::thread::sleep(limit),
            }
        }
    }
    match mpipe_runtime::ascend::AscendComm::from_env(default_timeout()) {
        Ok(c) => spin_and_report(c, late.is_none(), late.map(|_| 100)),
        Err(e) => {
            eprintln!("comm-selftest: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(not(feature = "ascend"))]
fn ascend(_: &[String]) -> ExitCode {
    eprintln!("comm-selftest: --ascend needs a build with the `ascend` feature");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--ascend") {
        return ascend(&args[1..]);
    }
    let mode = args.first().map(String::as_str).unwrap_or("ring");
    let fail: Option<(usize, u8)> = match mode {
        "ring" | "sleep" | "spin" => None,
        "stall" => {
            if args.get(1).and_then(|s| s.parse::<u64>().ok()).is_none() {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
            None
        }
        "late" => {
            let (r, ms) = (
                args.get(1).and_then(|s| s.parse::<usize>().ok()),
                args.get(2).and_then(|s| s.parse::<u64>().ok()),
            );
            let (Some(r), Some(ms)) = (r, ms) else {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            };
            if std::env::var("RANK").ok().and_then(|v| v.parse().ok()) == Some(r) {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            None
        }
        "fail" | "hang" => match (
            args.get(1).and_then(|s| s.parse().ok()),
            args.get(2).and_then(|s| s.parse().ok()),
        ) {
            (Some(r), Some(c)) => Some((r, c)),
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        },
        m => {
            eprintln!("comm-selftest: unknown mode {m:?}; {USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut c = match tcp::from_env(default_timeout()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("comm-selftest: {e}");
            return ExitCode::from(1);
        }
    };
    if mode == "spin" {
        return spin_and_report(c, true, None);
    }
    let r = c.rank();
    if mode == "sleep" {
        println!("rank {r} pid {}", std::process::id());
        std::thread::sleep(std::time::Duration::from_secs(60));
        return ExitCode::SUCCESS;
    }
    if mode == "stall" {
        println!("rank {r} pid {}", std::process::id());
        let ms = args.get(1).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    if let Some((bad, code)) = fail {
        if r == bad {
            eprintln!("rank {r}: exiting with code {code} on purpose");
            std::process::exit(code.into());
        }
        if mode == "hang" {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    }
    match ring(&mut c) {
        Ok(()) => {
            match c.mode() {
                mpipe_runtime::host::Mode::Rendezvous => println!("rank {r}: ok"),
                mpipe_runtime::host::Mode::Eager => println!("rank {r}: ok (eager)"),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {r}: {e}");
            c.abort(&e);
            ExitCode::from(1)
        }
    }
}
