//! Issue 37, item 8: the emulator's hub (the listener through which ranks in other
//! processes reach a communicator) admits only hellos that carry the job's secret
//! (`MPIPE_RDZV_SECRET`), and bounds every request before allocating for it: a forged
//! hello that guessed the group id was accepted, and a 13-byte receive request for
//! 2^40 bytes aborted the serving process.
#![cfg(ascend_emulator)]

use ascend_sys::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const SECRET: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// The root info's group id and the hub's address (this process serves the group).
fn root() -> (u64, SocketAddr) {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    // Before the hub reads it (on first use).
    ONCE.get_or_init(|| std::env::set_var("MPIPE_RDZV_SECRET", SECRET));
    let mut info = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut info) },
        HcclResult::HCCL_SUCCESS
    );
    let b: Vec<u8> = info.internal.iter().map(|&c| c as u8).collect();
    let id = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let end = b[16..].iter().position(|&x| x == 0).unwrap();
    let addr = std::str::from_utf8(&b[16..16 + end])
        .unwrap()
        .parse()
        .unwrap();
    (id, addr)
}

fn secret_bytes() -> Vec<u8> {
    (0..32)
        .map(|i| u8::from_str_radix(&SECRET[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// The hello of a lane joining group `id` as rank 1 of 2, with `secret`.
fn hello(id: u64, secret: &[u8]) -> Vec<u8> {
    let mut h = b"MPIPEEMU".to_vec();
    h.extend_from_slice(secret);
    h.extend_from_slice(&id.to_le_bytes());
    h.push(0);
    h.extend_from_slice(&2u32.to_le_bytes());
    h.extend_from_slice(&1u32.to_le_bytes());
    h
}

/// The connection is closed without a success status.
fn refused(s: &mut TcpStream) -> bool {
    let mut status = [0u8; 4];
    match s.read_exact(&mut status) {
        Err(_) => true,
        Ok(()) => u32::from_le_bytes(status) != 0,
    }
}

#[test]
fn hellos_without_the_secret_are_refused() {
    let (id, addr) = root();
    // The 25-byte hello of the report (the group id guessed right, no secret).
    let mut old = connect(addr);
    let mut h = b"MPIPEEMU".to_vec();
    h.extend_from_slice(&id.to_le_bytes());
    h.push(0);
    h.extend_from_slice(&2u32.to_le_bytes());
    h.extend_from_slice(&1u32.to_le_bytes());
    old.write_all(&h).unwrap();
    assert!(refused(&mut old), "a hello without the secret joined");
    // The right format, a wrong secret.
    let mut forged = connect(addr);
    forged.write_all(&hello(id, &[0x5a; 32])).unwrap();
    assert!(refused(&mut forged), "a hello with a wrong secret joined");
    // Idle strangers hold up nobody; the real lane is admitted.
    let _idle: Vec<TcpStream> = (0..8).map(|_| connect(addr)).collect();
    let mut real = connect(addr);
    real.write_all(&hello(id, &secret_bytes())).unwrap();
    assert!(!refused(&mut real), "the real lane is admitted");
}

#[test]
fn oversized_requests_fail_their_lane_not_the_process() {
    let (id, addr) = root();
    let lane = |addr| {
        let mut s = connect(addr);
        s.write_all(&hello(id, &secret_bytes())).unwrap();
        assert!(!refused(&mut s));
        s
    };
    // The report's 13 bytes: receive from rank 0, 2^40 bytes.
    let mut s = lane(addr);
    let mut req = vec![2u8];
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&req).unwrap();
    assert!(
        refused(&mut s),
        "the lane of an oversized request is closed"
    );
    // A batch whose receives add up past the limit, each under it.
    let mut s = lane(addr);
    let mut req = vec![3u8];
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(&4u32.to_le_bytes());
    for _ in 0..4 {
        req.extend_from_slice(&0u32.to_le_bytes());
        req.extend_from_slice(&(1u64 << 29).to_le_bytes());
    }
    s.write_all(&req).unwrap();
    assert!(refused(&mut s));
    // This process is alive and still serves: a receive naming itself as the peer is
    // refused with HCCL_E_PARA, and its (empty) data follows.
    let mut s = lane(addr);
    let mut req = vec![2u8];
    req.extend_from_slice(&1u32.to_le_bytes());
    req.extend_from_slice(&8u64.to_le_bytes());
    s.write_all(&req).unwrap();
    let mut reply = [0u8; 12];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(
        u32::from_le_bytes(reply[..4].try_into().unwrap()),
        HcclResult::HCCL_E_PARA.0
    );
}
