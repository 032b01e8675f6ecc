//! Issue 37, "Done when": strangers on the machine connect to an Ascend job's
//! rendezvous (rank 0's root-info store on `MASTER_PORT`) and to the emulator's hub
//! (the listener in rank 0's process through which the other processes reach the
//! communicator), send the forged messages of the report, and the job completes.
//!
//! The job is `mpipe-run -n 3 -- comm-selftest --ascend late 1 MS`: every rank prints
//! its pid before joining, rank 1 joins only once the strangers are done (the test
//! creates the file `MPIPE_SELFTEST_GO` names), then the ranks exchange 100 batches
//! around a ring. A stranger finds the hub as an attacker would:
//! the listening sockets of rank 0's process (`/proc`).
//!
//! `cargo test --release --features ascend -p mpipe-runtime --test ascend_strangers`
#![cfg(all(feature = "ascend", target_os = "linux"))]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mpipe_runtime::host::tcp;

const SELFTEST: &str = env!("CARGO_BIN_EXE_comm-selftest");
const MPIPE_RUN: &str = env!("CARGO_BIN_EXE_mpipe-run");

/// Generous: strangers must not hold the job up, and a loaded machine must not fail
/// the test.
const T: Duration = Duration::from_secs(30);

/// The loopback ports process `pid` listens on (its sockets in LISTEN state).
fn listening_ports(pid: u32) -> BTreeSet<u16> {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(String::from)
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let f: Vec<&str> = row.split_whitespace().collect();
            // local_address rem_address st ... inode (the 10th field)
            let (local, st, inode) = (f.get(1)?, f.get(3)?, f.get(9)?);
            if *st != "0A" || !inodes.contains(*inode) {
                return None;
            }
            u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()
        })
        .collect()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// The connection ends without a success status (read until it closes).
fn refused(mut s: TcpStream) -> bool {
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got.len() < 4 || got[..4] != [0, 0, 0, 0]
}

#[test]
fn strangers_at_the_store_and_the_hub_do_not_stop_an_ascend_job() {
    let port = tcp::free_port().unwrap();
    let go = std::env::temp_dir().join(format!("mpipe-strangers-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let master = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut job = Command::new(MPIPE_RUN)
        .args(["-n", "3", "--port", &port.to_string(), "--"])
        .arg(SELFTEST)
        .args(["--ascend", "late", "1", "60000"])
        .env("MPIPE_SELFTEST_GO", &go)
        .env("MPIPE_COMM_TIMEOUT", "60")
        .env("MPIPE_ASCEND_EMU_TIMEOUT_MS", "30000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpipe-run");
    let out = job.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let mut err = job.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    // Rank 0's pid (printed before it sets up the store and the hub).
    let until = Instant::now() + T;
    let pid: u32 = loop {
        let line = lines
            .recv_timeout(until.saturating_duration_since(Instant::now()))
            .expect("rank 0 starts");
        if let Some(p) = line.strip_prefix("[rank 0] rank 0 pid ") {
            break p.trim().parse().unwrap();
        }
    };
    // The hub: a listening port of rank 0's process other than the store's.
    let hub = loop {
        let ports = listening_ports(pid);
        if ports.contains(&port) {
            if let Some(&p) = ports.iter().find(|&&p| p != port) {
                break SocketAddr::from((Ipv4Addr::LOCALHOST, p));
            }
        }
        assert!(Instant::now() < until, "rank 0 never listened: {ports:?}");
        std::thread::sleep(Duration::from_millis(10));
    };

    // At the store: an idle connection, 20 forged bytes, a wrong secret, garbage.
    let idle_store = connect(master);
    let mut forged = connect(master);
    forged.write_all(&[0x42; 20]).unwrap();
    let mut wrong = connect(master);
    wrong.write_all(&[0x5a; tcp::SECRET_LEN]).unwrap();
    let mut garbage = connect(master);
    garbage.write_all(&[0xff; 200]).unwrap();
    for (what, s) in [("20 bytes", forged), ("a wrong secret", wrong)] {
        assert!(refused(s), "the store answered {what}");
    }

    // At the hub: the report's 25-byte hello (the pid as the group id, no secret),
    // the 13-byte receive request for 2^40 bytes, a hello of the right form with
    // a wrong secret claiming rank 1, an idle connection, garbage.
    let mut old = b"MPIPEEMU".to_vec();
    old.extend_from_slice(&u64::from(pid).to_le_bytes());
    old.push(0);
    old.extend_from_slice(&3u32.to_le_bytes());
    old.extend_from_slice(&1u32.to_le_bytes());
    assert_eq!(old.len(), 25);
    let mut big = vec![2u8];
    big.extend_from_slice(&0u32.to_le_bytes());
    big.extend_from_slice(&(1u64 << 40).to_le_bytes());
    assert_eq!(big.len(), 13);
    let mut claim = b"MPIPEEMU".to_vec();
    claim.extend_from_slice(&[0x5a; 32]);
    claim.extend_from_slice(&u64::from(pid).to_le_bytes());
    claim.push(0);
    claim.extend_from_slice(&3u32.to_le_bytes());
    claim.extend_from_slice(&1u32.to_le_bytes());
    let idle_hub = connect(hub);
    for (what, bytes) in [
        ("the 25-byte hello", old),
        ("the 13-byte request", big),
        ("a hello with a wrong secret", claim),
        ("garbage", vec![0xff; 200]),
    ] {
        let mut s = connect(hub);
        s.write_all(&bytes).unwrap();
        assert!(refused(s), "the hub admitted {what}");
    }

    // Rank 1 may join now; the job completes (the idle strangers still connected).
    std::fs::write(&go, b"go").unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(st) = job.try_wait().unwrap() {
            break Some(st);
        }
        if t.elapsed() > Duration::from_secs(120) {
            let _ = job.kill();
            let _ = job.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drop((idle_store, idle_hub, garbage));
    let _ = std::fs::remove_file(&go);
    let stdout = reader.join().unwrap();
    let stderr = stderr.join().unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{stdout}\n{stderr}");
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r}: ok")),
            "{stdout}\n{stderr}"
        );
    }
    assert!(
        stderr.contains("[rank 0] ascend-sys emulator: rejected a connection from 127.0.0.1:"),
        "{stderr}"
    );
}
