//! One process per emulated device: ranks in separate processes join one communicator
//! through the root info (which carries the serving process's address) and exchange
//! data with the same semantics as threads.
//!
//! The test re-runs this test binary once per rank (`child` below, selected by the
//! `MPIPE_EMU_CHILD` variable); the parent makes the root info, so it serves the group,
//! and passes its bytes to the children in hex.
#![cfg(ascend_emulator)]

use ascend_sys::*;
use std::process::{Command, Output};
use std::ptr::null_mut;

const CHILD: &str = "MPIPE_EMU_CHILD";

/// The emulator's HCCL timeout for this binary (inherited by the children): short
/// enough for the deadlock case, long enough for four processes to start. Set once,
/// before either test calls the emulator.
fn setup() {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| std::env::set_var("MPIPE_ASCEND_EMU_TIMEOUT_MS", "3000"));
}

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

/// Runs `scenario` as `n` processes of this binary and returns their outputs.
fn spawn_ranks(scenario: &str, n: u32) -> Vec<Output> {
    setup();
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "child", "--nocapture", "--test-threads=1"])
                .env(CHILD, format!("{scenario} {r} {n} {}", hex(&root)))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().expect("rank output"))
        .collect()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn four_processes_exchange_reduce_and_broadcast() {
    let outs = spawn_ranks("collectives", 4);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", text(o));
        assert!(text(o).contains(&format!("rank {r}: all checks passed")));
    }
}

#[test]
fn a_send_send_cycle_across_processes_times_out() {
    let outs = spawn_ranks("cycle", 2);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", text(o));
        assert!(
            text(o).contains(&format!("rank {r}: HCCL_E_TIMEOUT")),
            "rank {r}:\n{}",
            text(o)
        );
    }
}

/// The rank side (a no-op unless started by [`spawn_ranks`]).
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let mut parts = spec.split(' ');
    let scenario = parts.next().expect("scenario").to_string();
    let rank: u32 = parts.next().expect("rank").parse().expect("rank");
    let n: u32 = parts.next().expect("n").parse().expect("n");
    let root = unhex(parts.next().expect("root info"));
    unsafe {
        let rc = aclInit(std::ptr::null());
        assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(aclrtSetDevice(rank as i32), ACL_SUCCESS);
        let mut st = null_mut();
        assert_eq!(aclrtCreateStream(&mut st), ACL_SUCCESS);
        let mut comm = null_mut();
        assert_eq!(
            HcclCommInitRootInfo(n, &root, rank, &mut comm),
            HcclResult::HCCL_SUCCESS
        );
        let mut size = 0;
        assert_eq!(HcclGetRankSize(comm, &mut size), HcclResult::HCCL_SUCCESS);
        assert_eq!(size, n);
        match scenario.as_str() {
            "collectives" => collectives(rank, n, comm, st),
            "cycle" => cycle(rank, comm, st),
            other => panic!("unknown scenario {other}"),
        }
        assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
        assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
    }
}

const F32: HcclDataType = HcclDataType::HCCL_DATA_TYPE_FP32;

unsafe fn sync(st: aclrtStream, comm: HcclComm) {
    unsafe {
        let rc = aclrtSynchronizeStream(st);
        let mut e = HcclResult::HCCL_SUCCESS;
        HcclGetCommAsyncError(comm, &mut e);
        assert_eq!((rc, e), (ACL_SUCCESS, HcclResult::HCCL_SUCCESS));
    }
}

unsafe fn collectives(rank: u32, n: u32, comm: HcclComm, st: aclrtStream) {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    unsafe {
        // A ring in one batch: everyone sends to the next and receives from the previous.
        let mut out = vec![rank as f32; 1000];
        let mut inb = vec![-1f32; 1000];
        let mut items = [
            HcclSendRecvItem {
                sendRecvType: HcclSendRecvType::HCCL_SEND,
                remoteRank: next,
                buf: out.as_mut_ptr().cast(),
                count: 1000,
                dataType: F32,
            },
            HcclSendRecvItem {
                sendRecvType: HcclSendRecvType::HCCL_RECV,
                remoteRank: prev,
                buf: inb.as_mut_ptr().cast(),
                count: 1000,
                dataType: F32,
            },
        ];
        assert_eq!(
            HcclBatchSendRecv(items.as_mut_ptr(), 2, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        sync(st, comm);
        assert!(
            inb.iter().all(|&v| v == prev as f32),
            "ring: {:?}",
            &inb[..4]
        );

        // Unbatched pairs in an order that cannot deadlock: even ranks send first.
        let partner = rank ^ 1;
        let mut mine = [rank as f32 * 10.0; 3];
        let mut theirs = [0f32; 3];
        if rank.is_multiple_of(2) {
            assert_eq!(
                HcclSend(mine.as_mut_ptr().cast(), 3, F32, partner, comm, st),
                HcclResult::HCCL_SUCCESS
            );
            assert_eq!(
                HcclRecv(theirs.as_mut_ptr().cast(), 3, F32, partner, comm, st),
                HcclResult::HCCL_SUCCESS
            );
        } else {
            assert_eq!(
                HcclRecv(theirs.as_mut_ptr().cast(), 3, F32, partner, comm, st),
                HcclResult::HCCL_SUCCESS
            );
            assert_eq!(
                HcclSend(mine.as_mut_ptr().cast(), 3, F32, partner, comm, st),
                HcclResult::HCCL_SUCCESS
            );
        }
        sync(st, comm);
        assert_eq!(theirs, [partner as f32 * 10.0; 3]);

        // All-reduce (sum of rank + 1 = n(n+1)/2), reduce to rank 2, broadcast from rank 1.
        let mut x = [rank as f32 + 1.0; 5];
        let mut sum = [0f32; 5];
        assert_eq!(
            HcclAllReduce(
                x.as_mut_ptr().cast(),
                sum.as_mut_ptr().cast(),
                5,
                F32,
                HcclReduceOp::HCCL_REDUCE_SUM,
                comm,
                st
            ),
            HcclResult::HCCL_SUCCESS
        );
        let mut max = [-1f32; 5];
        assert_eq!(
            HcclReduce(
                x.as_mut_ptr().cast(),
                max.as_mut_ptr().cast(),
                5,
                F32,
                HcclReduceOp::HCCL_REDUCE_MAX,
                2,
                comm,
                st
            ),
            HcclResult::HCCL_SUCCESS
        );
        let mut b = [if rank == 1 { 42.0f32 } else { 0.0 }; 7];
        assert_eq!(
            HcclBroadcast(b.as_mut_ptr().cast(), 7, F32, 1, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(HcclBarrier(comm, st), HcclResult::HCCL_SUCCESS);
        sync(st, comm);
        let total = (n * (n + 1) / 2) as f32;
        assert_eq!(sum, [total; 5]);
        let expect_max = if rank == 2 { n as f32 } else { -1.0 };
        assert_eq!(max, [expect_max; 5], "only the root's output is written");
        assert_eq!(b, [42.0; 7]);
    }
    println!("rank {rank}: all checks passed");
}

unsafe fn cycle(rank: u32, comm: HcclComm, st: aclrtStream) {
    let mut b = [1f32; 8];
    unsafe {
        // Both ranks send first, unbatched: under rendezvous neither send completes.
        assert_eq!(
            HcclSend(b.as_mut_ptr().cast(), 8, F32, 1 - rank, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(
            HcclRecv(b.as_mut_ptr().cast(), 8, F32, 1 - rank, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_ne!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        let mut e = HcclResult::HCCL_SUCCESS;
        assert_eq!(
            HcclGetCommAsyncError(comm, &mut e),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(e, HcclResult::HCCL_E_TIMEOUT);
    }
    println!("rank {rank}: HCCL_E_TIMEOUT");
}
