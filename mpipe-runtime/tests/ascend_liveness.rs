//! Issue 37, item 9, through the runtime: ranks of an Ascend world in separate
//! processes (`AscendComm::from_env`, one emulated device each); when a non-root
//! rank's process is killed, the others' pending call fails within seconds with
//! `AscendError::PeerFailed` naming it, not after the HCCL timeout with a deadlock
//! between two live ranks, and not blaming rank 0, whose process serves the
//! emulator's communicator and has failed first (a race seen under load before
//! the serving process waited for the others to leave).
//!
//! `cargo test --release --features ascend -p mpipe-runtime --test ascend_liveness`
#![cfg(feature = "ascend")]

use mpipe_runtime::ascend::{AscendComm, AscendError};
use mpipe_runtime::comm::{Comm, Tag};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const CHILD: &str = "MPIPE_ASCEND_LIVENESS_CHILD";

/// The HCCL timeout: far longer than the bound asserted.
const TIMEOUT_MS: &str = "30000";

/// How soon the others must fail after the kill (the bound).
const BOUND: Duration = Duration::from_secs(10);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(rank: usize, port: u16) -> (Child, mpsc::Receiver<String>) {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("MPIPE_ASCEND_EMU_TIMEOUT_MS", TIMEOUT_MS)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a rank");
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// Waits for a line with `what` (libtest may print the test's name before it on the
/// same line); returns the line from there.
fn expect_line(lines: &mpsc::Receiver<String>, rank: usize, what: &str) -> String {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        match lines.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok(l) if l.contains(what) => return l[l.find(what).expect("found")..].to_string(),
            Ok(_) => {}
            Err(e) => panic!("rank {rank} never printed {what:?}: {e}"),
        }
    }
}

#[test]
fn killing_a_rank_process_fails_the_others_naming_it() {
    let port = free_port();
    let mut ranks: Vec<_> = (0..3).map(|r| spawn(r, port)).collect();
    for (r, (_, lines)) in ranks.iter().enumerate() {
        expect_line(lines, r, "ready");
    }
    // Ranks 0 and 1 are waiting on rank 2 (or about to).
    std::thread::sleep(Duration::from_millis(300));
    ranks[2].0.kill().expect("kill rank 2");
    let killed = Instant::now();
    let _ = ranks[2].0.wait();
    for (r, (child, lines)) in ranks.iter_mut().enumerate().take(2) {
        let said = expect_line(lines, r, "result:");
        assert_eq!(said, "result: PeerFailed 2", "rank {r} should blame rank 2");
        let status = child.wait().expect("exits");
        assert!(status.success(), "rank {r}: {status}");
    }
    assert!(
        killed.elapsed() < BOUND,
        "the others took {:?} to fail",
        killed.elapsed()
    );
}

/// The rank side (a no-op unless started by [`spawn`]).
#[test]
fn child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let mut c = AscendComm::from_env(Duration::from_secs(30)).expect("join the world");
    println!("ready");
    if c.rank() == 2 {
        std::thread::sleep(Duration::from_secs(120));
        return;
    }
    // Rank 1 posts its receive well after the kill, when rank 0, which serves the
    // emulator's communicator, has long failed: its process must still be serving,
    // so that rank 1 learns that rank 2 is gone and does not blame rank 0.
    if c.rank() == 1 {
        std::thread::sleep(Duration::from_millis(1500));
    }
    // Waits for rank 2, which never sends.
    let got = c.batch(&[], &[(2, Tag::act(1, 0), 4)]);
    match got {
        Err(AscendError::PeerFailed { rank, what }) => {
            eprintln!("rank {}: rank {rank} failed: {what}", c.rank());
            println!("result: PeerFailed {rank}");
        }
        Err(e) => println!("result: other error: {e}"),
        Ok(_) => println!("result: received"),
    }
}
