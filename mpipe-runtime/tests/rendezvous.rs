//! Issue 37, item 7: only the job's own processes can join the host backend's
//! rendezvous. Strangers on the machine that connect during set-up (idle, garbage,
//! a forged hello without the job's secret) are dropped without failing the job,
//! and the real ranks join; the launcher hands each launch a new secret through the
//! environment.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use mpipe_runtime::comm::{Comm, Tag};
use mpipe_runtime::host::tcp::{self, TcpComm, SECRET_LEN, SECRET_VAR};

const MAGIC: u32 = 0x4d50_4950;
const PROTOCOL: u32 = 3;
/// Generous: the set-up must not wait for it (strangers are dropped after
/// HELLO_TIMEOUT, 2 s), and a loaded machine must not fail the test.
const T: Duration = Duration::from_secs(20);

fn words(ws: &[u32]) -> Vec<u8> {
    ws.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Connects to `addr`, retrying until it listens.
fn knock(addr: SocketAddr) -> TcpStream {
    let t = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return s,
            Err(e) if t.elapsed() < T => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("cannot reach {addr}: {e}"),
        }
    }
}

/// Every stranger of issue 37's report: an idle connection, 20 forged bytes (a
/// registration of protocol 1 claiming rank 1), a registration claiming rank 1
/// with a wrong secret, one claiming rank 0, and garbage.
fn strangers(master: SocketAddr, world: u32) -> Vec<TcpStream> {
    let mut out = Vec::new();
    out.push(knock(master)); // idle
    let mut s = knock(master);
    s.write_all(&words(&[MAGIC, 1, 1, world, 4242])).unwrap();
    out.push(s);
    for claimed in [1, 0] {
        let mut s = knock(master);
        let mut hello = words(&[MAGIC, PROTOCOL, claimed, world, 4242]);
        hello.extend_from_slice(&[0x5a; SECRET_LEN]);
        s.write_all(&hello).unwrap();
        out.push(s);
    }
    let mut s = knock(master);
    s.write_all(&[0xff; 200]).unwrap();
    out.push(s);
    out
}

fn ring(c: &mut TcpComm) -> Vec<f32> {
    let (r, n) = (c.rank(), c.world());
    let mine = vec![r as f32; 4];
    let got = c
        .batch(
            &[((r + 1) % n, Tag::act(1, 0), &mine)],
            &[((r + n - 1) % n, Tag::act(1, 0), 4)],
        )
        .unwrap();
    got.into_iter().next().unwrap()
}

/// Rank 0 is up, strangers knock at its port (idle, garbage, forged hellos), then
/// the real ranks join: the world forms and works.
#[test]
fn strangers_at_the_rendezvous_neither_join_nor_break_it() {
    let master = SocketAddr::from((Ipv4Addr::LOCALHOST, tcp::free_port().unwrap()));
    let world = 3;
    let secret = [0x11u8; SECRET_LEN];
    std::thread::scope(|s| {
        let zero = s.spawn(move || tcp::connect_with_secret(0, world, master, &secret, T));
        let _held = strangers(master, world as u32);
        let others: Vec<_> = (1..world)
            .map(|r| s.spawn(move || tcp::connect_with_secret(r, world, master, &secret, T)))
            .collect();
        let mut comms = vec![zero.join().unwrap().expect("rank 0 sets up")];
        for h in others {
            comms.push(h.join().unwrap().expect("the real rank joins"));
        }
        let got: Vec<Vec<f32>> = std::thread::scope(|s2| {
            let hs: Vec<_> = comms.iter_mut().map(|c| s2.spawn(|| ring(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, g) in got.iter().enumerate() {
            let prev = (r + world - 1) % world;
            assert_eq!(g, &vec![prev as f32; 4]);
        }
    });
}

/// A stranger that speaks the protocol but holds another secret is refused: a real
/// rank with the wrong secret (another job's) cannot join, and the world times out
/// naming the missing rank, rather than taking it in.
#[test]
fn a_rank_with_another_secret_is_not_taken_in() {
    let master = SocketAddr::from((Ipv4Addr::LOCALHOST, tcp::free_port().unwrap()));
    let short = Duration::from_millis(1500);
    std::thread::scope(|s| {
        let zero = s.spawn(move || tcp::connect_with_secret(0, 2, master, &[1; SECRET_LEN], short));
        let one = s.spawn(move || tcp::connect_with_secret(1, 2, master, &[2; SECRET_LEN], short));
        let e0 = zero.join().unwrap().err().expect("rank 0 is not joined");
        assert!(e0.to_string().contains("ranks [1] to register"), "{e0}");
        assert!(one.join().unwrap().is_err());
    });
}

/// Processes: `mpipe-run` hands the ranks a secret in the environment (a new one
/// for each launch, never on the command line), and a job whose rank 0 is knocked
/// at by strangers while rank 1 is late completes; rank 0 logs the forged hellos.
#[test]
fn a_launched_job_completes_with_strangers_knocking() {
    let run = env!("CARGO_BIN_EXE_mpipe-run");
    let selftest = env!("CARGO_BIN_EXE_comm-selftest");
    let port = tcp::free_port().unwrap();
    let master = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let child = Command::new(run)
        .args([
            "-n",
            "3",
            "--port",
            &port.to_string(),
            "--",
            selftest,
            "late",
            "1",
            "1500",
        ])
        .env("MPIPE_COMM_TIMEOUT", "20")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let held = strangers(master, 3);
    let out = child.wait_with_output().unwrap();
    drop(held);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[rank {r}] rank {r}: ok")),
            "{stdout}"
        );
    }
    assert!(
        stderr.contains("[rank 0] mpipe: rank 0 at 127.0.0.1:")
            && stderr.contains("does not carry this job's rendezvous secret"),
        "{stderr}"
    );

    // The secret is in the ranks' environment, 64 hex digits, new for each launch.
    let secret_of = || {
        let out = Command::new(run)
            .args(["-n", "1", "--", "/usr/bin/env"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("[rank 0] {SECRET_VAR}=")))
            .unwrap_or_else(|| panic!("no {SECRET_VAR} in {text}"))
            .to_string();
        assert_eq!(line.len(), 2 * SECRET_LEN, "{line}");
        assert!(line.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
        line
    };
    assert_ne!(secret_of(), secret_of());
}

/// Ranks read the secret from the environment; a malformed one is a set-up error
/// that names the variable.
#[test]
fn a_malformed_secret_is_refused() {
    let selftest = env!("CARGO_BIN_EXE_comm-selftest");
    let out = Command::new(selftest)
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("MASTER_PORT", tcp::free_port().unwrap().to_string())
        .env(SECRET_VAR, "not hex")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(SECRET_VAR), "{stderr}");
}
