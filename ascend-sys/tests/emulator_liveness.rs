//! Issue 37, item 9: a rank whose process dies is noticed by the others at once. Its
//! connection to the communicator closes without `HcclCommDestroy`, so the process
//! serving the group marks it gone: every operation with it, pending or later, fails
//! with `HCCL_E_REMOTE` naming it (`departed_rank`), long before the HCCL timeout
//! (which blamed a deadlock between two live ranks after 20-40 s).
//!
//! This process is rank 0 (it makes the root info, so it serves the group); ranks 1
//! and 2 are processes of this test binary (`child`, selected by `MPIPE_EMU_LIVENESS`).
#![cfg(ascend_emulator)]

use ascend_sys::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const CHILD: &str = "MPIPE_EMU_LIVENESS";

/// The HCCL timeout: far longer than the bound asserted, so only liveness can pass.
const TIMEOUT_MS: &str = "30000";

/// How soon the others must fail after the kill (the bound).
const BOUND: Duration = Duration::from_secs(10);

const F32: HcclDataType = HcclDataType::HCCL_DATA_TYPE_FP32;

fn hex(info: &HcclRootInfo) -> String {
    info.internal
        .iter()
        .map(|&c| format!("{:02x}", c as u8))
        .collect()
}

fn unhex(s: &str) -> HcclRootInfo {
    let mut info = HcclRootInfo::default();
    for (i, d) in info.internal.iter_mut().enumerate() {
        *d = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex") as std::ffi::c_char;
    }
    info
}

/// Starts rank `rank` of 3 as a process; returns it and its stdout's lines.
fn spawn(rank: u32, root: &HcclRootInfo) -> (Child, mpsc::Receiver<String>) {
    let (lines, rx) = mpsc::channel();
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{rank} {}", hex(root)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn a rank");
    let out = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    (child, rx)
}

/// Waits for rank `rank` to print a line with `prefix`; returns the line from there.
fn expect_line(lines: &mpsc::Receiver<String>, rank: u32, prefix: &str) -> String {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            // (libtest may print the test's name before it on the same line)
            Ok(l) if l.contains(prefix) => {
                return l[l.find(prefix).expect("contains")..].to_string()
            }
            Ok(_) => {}
            Err(e) => panic!("rank {rank} never printed {prefix:?}: {e}"),
        }
    }
}

unsafe fn stream_for(device: i32) -> aclrtStream {
    unsafe {
        let rc = aclInit(std::ptr::null());
        assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(aclrtSetDevice(device), ACL_SUCCESS);
        let mut st = null_mut();
        assert_eq!(aclrtCreateStream(&mut st), ACL_SUCCESS);
        st
    }
}

/// Synchronizes `st` and returns `comm`'s asynchronous error.
unsafe fn settle(st: aclrtStream, comm: HcclComm) -> HcclResult {
    unsafe {
        let _ = aclrtSynchronizeStream(st);
        let mut e = HcclResult::HCCL_SUCCESS;
        assert_eq!(
            HcclGetCommAsyncError(comm, &mut e),
            HcclResult::HCCL_SUCCESS
        );
        e
    }
}

#[test]
fn a_killed_rank_fails_the_others_at_once_naming_it() {
    std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", TIMEOUT_MS);
    unsafe {
        let st = stream_for(0);
        let mut root = HcclRootInfo::default();
        assert_eq!(HcclGetRootInfo(&mut root), HcclResult::HCCL_SUCCESS);
        let mut comm = null_mut();
        assert_eq!(
            HcclCommInitRootInfo(3, &root, 0, &mut comm),
            HcclResult::HCCL_SUCCESS
        );
        let (mut victim, lines2) = spawn(2, &root);
        let (mut waiter, lines) = spawn(1, &root);
        expect_line(&lines2, 2, "joined");
        expect_line(&lines, 1, "joined");

        // A receive from rank 2 pending here, one in rank 1's process.
        let mut buf = [0f32; 4];
        assert_eq!(
            HcclRecv(buf.as_mut_ptr().cast(), 4, F32, 2, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        expect_line(&lines, 1, "waiting");
        std::thread::sleep(Duration::from_millis(200));
        victim.kill().expect("kill rank 2");
        let killed = Instant::now();
        let _ = victim.wait();

        let rc = settle(st, comm);
        let took = killed.elapsed();
        assert_eq!(rc, HcclResult::HCCL_E_REMOTE, "rank 0's pending receive");
        assert!(took < BOUND, "rank 0 noticed after {took:?}");
        assert_eq!(departed_rank(comm), Some(2));

        // Rank 1 (another process) learnt it too, and which rank is gone.
        let said = expect_line(&lines, 1, "rank 1:");
        assert!(
            said.starts_with("rank 1: recv 21 departed Some(2)"),
            "rank 1 said {said:?}"
        );
        let ms: u64 = said.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(
            Duration::from_millis(ms) < BOUND + Duration::from_secs(1),
            "{said}"
        );
        let later = expect_line(&lines, 1, "later:");
        assert_eq!(
            later, "later: send failed true barrier failed true fast true",
            "rank 1's later operations"
        );
        let st1 = waiter.wait().expect("rank 1 exits");
        assert!(st1.success(), "rank 1: {st1}");

        // Later operations here fail at once too: a send to rank 2, a barrier.
        let t = Instant::now();
        assert_eq!(
            HcclSend(buf.as_mut_ptr().cast(), 4, F32, 2, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_ne!(aclrtSynchronizeStream(st), ACL_SUCCESS, "a later send");
        assert_eq!(HcclBarrier(comm, st), HcclResult::HCCL_SUCCESS);
        assert_ne!(aclrtSynchronizeStream(st), ACL_SUCCESS, "a later barrier");
        assert!(
            t.elapsed() < BOUND,
            "later operations took {:?}",
            t.elapsed()
        );
        assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
    }
}

/// A rank that destroys its communicator and exits is not gone: the others' later
/// work with each other goes on.
#[test]
fn a_rank_that_says_goodbye_is_not_gone() {
    std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", TIMEOUT_MS);
    unsafe {
        let st = stream_for(0);
        let mut root = HcclRootInfo::default();
        assert_eq!(HcclGetRootInfo(&mut root), HcclResult::HCCL_SUCCESS);
        let mut comm = null_mut();
        assert_eq!(
            HcclCommInitRootInfo(2, &root, 0, &mut comm),
            HcclResult::HCCL_SUCCESS
        );
        let (mut polite, lines) = spawn(3, &root);
        expect_line(&lines, 3, "joined");
        let mut buf = [0f32; 4];
        assert_eq!(
            HcclRecv(buf.as_mut_ptr().cast(), 4, F32, 1, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(settle(st, comm), HcclResult::HCCL_SUCCESS);
        assert_eq!(buf, [7.0; 4]);
        assert!(polite.wait().expect("exits").success());
        assert_eq!(departed_rank(comm), None);
        assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
    }
}

/// The rank side (a no-op unless started by [`spawn`]). Ranks 1 and 2 are of a world
/// of 3; "rank 3" is rank 1 of a world of 2 that sends once and leaves politely.
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let (rank, root) = spec.split_once(' ').expect("rank and root info");
    let rank: u32 = rank.parse().expect("rank");
    let root = unhex(root);
    let (world, me) = if rank == 3 { (2, 1) } else { (3, rank) };
    unsafe {
        let st = stream_for(me as i32);
        let mut comm = null_mut();
        assert_eq!(
            HcclCommInitRootInfo(world, &root, me, &mut comm),
            HcclResult::HCCL_SUCCESS
        );
        println!("joined");
        let mut buf = [7f32; 4];
        match rank {
            1 => {
                assert_eq!(
                    HcclRecv(buf.as_mut_ptr().cast(), 4, F32, 2, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                println!("waiting");
                let t = Instant::now();
                let rc = settle(st, comm);
                println!(
                    "rank 1: recv {} departed {:?} after {}",
                    rc.0,
                    departed_rank(comm),
                    t.elapsed().as_millis()
                );
                // Later operations fail at once too (a synchronization reports a
                // failure of the work since the previous one).
                let t = Instant::now();
                assert_eq!(
                    HcclSend(buf.as_mut_ptr().cast(), 4, F32, 2, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                let send = aclrtSynchronizeStream(st) != ACL_SUCCESS;
                assert_eq!(HcclBarrier(comm, st), HcclResult::HCCL_SUCCESS);
                let barrier = aclrtSynchronizeStream(st) != ACL_SUCCESS;
                let fast = t.elapsed() < BOUND;
                println!("later: send failed {send} barrier failed {barrier} fast {fast}");
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
            }
            2 => std::thread::sleep(Duration::from_secs(120)),
            _ => {
                assert_eq!(
                    HcclSend(buf.as_mut_ptr().cast(), 4, F32, 0, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                assert_eq!(settle(st, comm), HcclResult::HCCL_SUCCESS);
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
            }
        }
    }
}
