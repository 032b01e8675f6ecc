//! The emulator's per-device counters move exactly as the calls made. Tests run in
//! parallel in this binary, so each one uses devices of its own.
#![cfg(ascend_emulator)]

use ascend_sys::emulator::counters::{reset, snapshot, total, Counters};
use ascend_sys::*;
use std::ffi::c_void;
use std::ptr::null_mut;

const F32: HcclDataType = HcclDataType::HCCL_DATA_TYPE_FP32;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const H2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST;
const HCCL_SEND: HcclSendRecvType = HcclSendRecvType::HCCL_SEND;
const HCCL_RECV: HcclSendRecvType = HcclSendRecvType::HCCL_RECV;

fn on_device(d: i32) {
    let rc = unsafe { aclInit(std::ptr::null()) };
    assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
    assert_eq!(unsafe { aclrtSetDevice(d) }, ACL_SUCCESS);
}

fn stream() -> aclrtStream {
    let mut s = null_mut();
    assert_eq!(unsafe { aclrtCreateStream(&mut s) }, ACL_SUCCESS);
    s
}

fn alloc(bytes: usize) -> *mut c_void {
    let mut p = null_mut();
    let policy = aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST;
    assert_eq!(unsafe { aclrtMalloc(&mut p, bytes, policy) }, ACL_SUCCESS);
    p
}

#[test]
fn two_threads_on_one_device_and_a_reset() {
    reset(1);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                on_device(1);
                let p = alloc(100);
                assert_eq!(unsafe { aclrtFree(p) }, ACL_SUCCESS);
            });
        }
    });
    let c = snapshot(1);
    assert_eq!(
        c,
        Counters {
            mallocs: 2,
            frees: 2,
            threads: 2,
            ..Counters::default()
        }
    );
    // Failed calls count nothing: a double free, a zero-byte allocation.
    std::thread::spawn(|| {
        on_device(1);
        let p = alloc(8);
        assert_eq!(unsafe { aclrtFree(p) }, ACL_SUCCESS);
        assert_eq!(unsafe { aclrtFree(p) }, ACL_ERROR_INVALID_PARAM);
        let mut q = null_mut();
        let policy = aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST;
        assert_eq!(
            unsafe { aclrtMalloc(&mut q, 0, policy) },
            ACL_ERROR_INVALID_PARAM
        );
    })
    .join()
    .unwrap();
    let c = snapshot(1);
    assert_eq!((c.mallocs, c.frees, c.threads), (3, 3, 3));
    reset(1);
    assert_eq!(snapshot(1), Counters::default());
    // After a reset the same thread counts again as a new one.
    std::thread::spawn(|| {
        on_device(1);
        let p = alloc(8);
        let p2 = alloc(8);
        unsafe {
            assert_eq!(aclrtFree(p), ACL_SUCCESS);
            assert_eq!(aclrtFree(p2), ACL_SUCCESS);
        }
    })
    .join()
    .unwrap();
    assert_eq!((snapshot(1).mallocs, snapshot(1).threads), (2, 1));
}

#[test]
fn copies_by_kind_and_host_waits() {
    std::thread::spawn(|| unsafe {
        on_device(2);
        reset(2);
        let st = stream();
        let n = 256;
        let (x, y) = (alloc(n), alloc(n));
        let host = vec![3u8; n];
        let mut back = vec![0u8; n];
        let mut other = vec![0u8; n];
        assert_eq!(aclrtMemcpy(x, n, host.as_ptr().cast(), n, H2D), ACL_SUCCESS);
        assert_eq!(aclrtMemcpy(y, n, x, n, D2D), ACL_SUCCESS);
        assert_eq!(aclrtMemcpyAsync(x, n, y, 64, D2D, st), ACL_SUCCESS);
        assert_eq!(
            aclrtMemcpyAsync(back.as_mut_ptr().cast(), n, y, 100, D2H, st),
            ACL_SUCCESS
        );
        let mut ev = null_mut();
        assert_eq!(aclrtCreateEvent(&mut ev), ACL_SUCCESS);
        assert_eq!(aclrtRecordEvent(ev, st), ACL_SUCCESS);
        assert_eq!(aclrtSynchronizeEvent(ev), ACL_SUCCESS);
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        // Host to host is neither kind; a rejected copy (destMax) counts nothing.
        assert_eq!(
            aclrtMemcpy(other.as_mut_ptr().cast(), n, back.as_ptr().cast(), n, H2H),
            ACL_SUCCESS
        );
        assert_eq!(
            aclrtMemcpy(back.as_mut_ptr().cast(), 10, y, 11, D2H),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(back[..100], [3u8; 100]);
        let c = snapshot(2);
        assert_eq!(
            c,
            Counters {
                copies: 2,
                copy_bytes: (n + 100) as u64,
                sync_copies: 1,
                device_copies: 2,
                host_waits: 2,
                mallocs: 2,
                // Only this thread: the stream worker that ran the copies is not counted.
                threads: 1,
                ..Counters::default()
            }
        );
        assert_eq!(aclrtDestroyEvent(ev), ACL_SUCCESS);
        assert_eq!(aclrtFree(x), ACL_SUCCESS);
        assert_eq!(aclrtFree(y), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
    })
    .join()
    .unwrap();
    assert_eq!(snapshot(2).frees, 2);
}

fn item(t: HcclSendRecvType, buf: *mut c_void, count: u64, remote_rank: u32) -> HcclSendRecvItem {
    HcclSendRecvItem {
        sendRecvType: t,
        buf,
        count,
        dataType: F32,
        remoteRank: remote_rank,
    }
}

/// Three ranks on devices 3, 4, 5: a batch of 3, 2 and 1 items, a send/recv pair and
/// four collectives.
#[test]
fn hccl_calls_and_batch_items() {
    for d in 3..6 {
        reset(d);
    }
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    std::thread::scope(|s| {
        for r in 0..3u32 {
            s.spawn(move || unsafe {
                on_device(3 + r as i32);
                let st = stream();
                let mut comm = null_mut();
                assert_eq!(
                    HcclCommInitRootInfo(3, root, r, &mut comm),
                    HcclResult::HCCL_SUCCESS
                );
                let (a, b) = (alloc(16), alloc(16));
                let mut items = match r {
                    0 => vec![
                        item(HCCL_SEND, a, 4, 1),
                        item(HCCL_SEND, a, 4, 2),
                        item(HCCL_RECV, b, 4, 1),
                    ],
                    1 => vec![item(HCCL_RECV, b, 4, 0), item(HCCL_SEND, a, 4, 0)],
                    _ => vec![item(HCCL_RECV, b, 4, 0)],
                };
                let n = items.len() as u32;
                assert_eq!(
                    HcclBatchSendRecv(items.as_mut_ptr(), n, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                // Rejected (two sends to one peer): not counted.
                let mut bad = [item(HCCL_SEND, a, 4, (r + 1) % 3); 2];
                assert_eq!(
                    HcclBatchSendRecv(bad.as_mut_ptr(), 2, comm, st),
                    HcclResult::HCCL_E_PARA
                );
                match r {
                    0 => assert_eq!(HcclSend(a, 4, F32, 1, comm, st), HcclResult::HCCL_SUCCESS),
                    1 => assert_eq!(HcclRecv(b, 4, F32, 0, comm, st), HcclResult::HCCL_SUCCESS),
                    _ => {}
                }
                let sum = HcclReduceOp::HCCL_REDUCE_SUM;
                assert_eq!(
                    HcclAllReduce(a, b, 4, F32, sum, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                assert_eq!(
                    HcclReduce(a, b, 4, F32, sum, 0, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                assert_eq!(
                    HcclBroadcast(a, 4, F32, 2, comm, st),
                    HcclResult::HCCL_SUCCESS
                );
                assert_eq!(HcclBarrier(comm, st), HcclResult::HCCL_SUCCESS);
                assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
                assert_eq!(aclrtFree(a), ACL_SUCCESS);
                assert_eq!(aclrtFree(b), ACL_SUCCESS);
                assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
            });
        }
    });
    let expect = |batch_items, send, recv| Counters {
        batch_send_recv: 1,
        batch_items,
        send,
        recv,
        collectives: 4,
        host_waits: 1,
        mallocs: 2,
        frees: 2,
        threads: 1,
        ..Counters::default()
    };
    assert_eq!(snapshot(3), expect(3, 1, 0));
    assert_eq!(snapshot(4), expect(2, 0, 1));
    assert_eq!(snapshot(5), expect(1, 0, 0));
    let t = total(3..6);
    assert_eq!(
        (t.batch_send_recv, t.batch_items, t.collectives, t.threads),
        (3, 6, 12, 3)
    );
    assert_eq!(snapshot(-1), Counters::default());
    assert_eq!(snapshot(100_000), Counters::default());
}

/// A hazard counts in `hazards` of the finding thread's device; a thread whose only
/// call is uncounted (`aclrtMemset`) does not count in `threads`.
#[test]
fn hazards_count_without_counting_threads() {
    std::thread::spawn(|| unsafe {
        on_device(6);
        reset(6);
        let st = stream();
        let x = alloc(64);
        let src = [1u8; 64];
        assert_eq!(aclrtMemcpyAsync(x, 64, src.as_ptr().cast(), 64, H2D, st), 0);
        let xa = x as usize;
        std::thread::spawn(move || {
            on_device(6);
            // Unordered with the queued copy into x: write-after-write.
            assert_eq!(aclrtMemset(xa as *mut c_void, 64, 0, 64), ACL_SUCCESS);
        })
        .join()
        .unwrap();
        let c = snapshot(6);
        assert_eq!((c.hazards, c.threads, c.copies, c.mallocs), (1, 1, 1, 1));
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        assert_eq!(aclrtFree(x), ACL_SUCCESS);
        reset(6);
        assert_eq!(snapshot(6), Counters::default());
        assert!(ascend_sys::emulator::hazards::reports(6).is_empty());
    })
    .join()
    .unwrap();
}
