//! Smoke tests of the host emulator through the FFI declarations (the same calls a
//! real CANN build makes). Only built when the emulator is what this build links.
#![cfg(ascend_emulator)]

use ascend_sys::*;
use std::ffi::c_void;
use std::ptr::null_mut;

fn init() {
    let rc = unsafe { aclInit(std::ptr::null()) };
    assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
    assert_eq!(unsafe { aclrtSetDevice(0) }, ACL_SUCCESS);
}

fn stream() -> aclrtStream {
    let mut s = null_mut();
    assert_eq!(unsafe { aclrtCreateStream(&mut s) }, ACL_SUCCESS);
    s
}

fn alloc(bytes: usize) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(
        unsafe {
            aclrtMalloc(
                &mut p,
                bytes,
                aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST,
            )
        },
        ACL_SUCCESS
    );
    p
}

#[test]
fn backend_and_devices() {
    assert_eq!(BACKEND, "emulator");
    init();
    let mut n = 0;
    assert_eq!(unsafe { aclrtGetDeviceCount(&mut n) }, ACL_SUCCESS);
    assert!(n >= 1);
    assert_eq!(
        unsafe { aclrtSetDevice(n as i32) },
        ACL_ERROR_RT_INVALID_DEVICEID
    );
}

#[test]
fn stream_runs_in_order_and_events_wait() {
    init();
    let (a, b) = (stream(), stream());
    let n = 1 << 20;
    let (x, y, z) = (alloc(n), alloc(n), alloc(n));
    let src = vec![7u8; n];
    let mut ev = null_mut();
    unsafe {
        assert_eq!(aclrtCreateEvent(&mut ev), ACL_SUCCESS);
        // a: host -> x, x -> y, record; b waits for the event, then y -> z.
        let h2d = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
        let d2d = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
        assert_eq!(
            aclrtMemcpyAsync(x, n, src.as_ptr().cast(), n, h2d, a),
            ACL_SUCCESS
        );
        assert_eq!(aclrtMemcpyAsync(y, n, x, n, d2d, a), ACL_SUCCESS);
        assert_eq!(aclrtRecordEvent(ev, a), ACL_SUCCESS);
        assert_eq!(aclrtStreamWaitEvent(b, ev), ACL_SUCCESS);
        assert_eq!(aclrtMemcpyAsync(z, n, y, n, d2d, b), ACL_SUCCESS);
        assert_eq!(aclrtSynchronizeStream(b), ACL_SUCCESS);
        let mut out = vec![0u8; n];
        let d2h = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
        assert_eq!(
            aclrtMemcpy(out.as_mut_ptr().cast(), n, z, n, d2h),
            ACL_SUCCESS
        );
        assert!(out.iter().all(|&v| v == 7));
        // destMax is enforced.
        assert_eq!(
            aclrtMemcpy(out.as_mut_ptr().cast(), n - 1, z, n, d2h),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(aclrtSynchronizeEvent(ev), ACL_SUCCESS);
        let mut ms = -1.0f32;
        assert_eq!(aclrtEventElapsedTime(&mut ms, ev, ev), ACL_SUCCESS);
        assert_eq!(ms, 0.0);
        assert_eq!(aclrtMemset(x, n, 1, n), ACL_SUCCESS);
        for p in [x, y, z] {
            assert_eq!(aclrtFree(p), ACL_SUCCESS);
        }
        assert_eq!(
            aclrtFree(x),
            ACL_ERROR_INVALID_PARAM,
            "double free is reported"
        );
        assert_eq!(aclrtDestroyEvent(ev), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(a), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(b), ACL_SUCCESS);
        assert_eq!(aclrtSynchronizeStream(a), ACL_ERROR_INVALID_PARAM);
    }
}

/// Runs `f(rank, comm, stream)` on `n` threads joined through one root info.
fn ranks<T: Send>(n: u32, f: impl Fn(u32, HcclComm, aclrtStream) -> T + Sync) -> Vec<T> {
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    init();
                    let st = stream();
                    let mut comm = null_mut();
                    assert_eq!(
                        unsafe { HcclCommInitRootInfo(n, root, r, &mut comm) },
                        HcclResult::HCCL_SUCCESS
                    );
                    let out = f(r, comm, st);
                    assert_eq!(unsafe { HcclCommDestroy(comm) }, HcclResult::HCCL_SUCCESS);
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn batch_ring_exchange_and_allreduce() {
    let f32t = HcclDataType::HCCL_DATA_TYPE_FP32;
    let out = ranks(4, |r, comm, st| unsafe {
        let mut size = 0;
        let mut id = 0;
        assert_eq!(HcclGetRankSize(comm, &mut size), HcclResult::HCCL_SUCCESS);
        assert_eq!(HcclGetRankId(comm, &mut id), HcclResult::HCCL_SUCCESS);
        assert_eq!((size, id), (4, r));
        let mut send = [r as f32; 3];
        let mut recv = [0f32; 3];
        let items = [
            HcclSendRecvItem {
                sendRecvType: HcclSendRecvType::HCCL_SEND,
                buf: send.as_mut_ptr().cast(),
                count: 3,
                dataType: f32t,
                remoteRank: (r + 1) % 4,
            },
            HcclSendRecvItem {
                sendRecvType: HcclSendRecvType::HCCL_RECV,
                buf: recv.as_mut_ptr().cast(),
                count: 3,
                dataType: f32t,
                remoteRank: (r + 3) % 4,
            },
        ];
        let mut items = items;
        assert_eq!(
            HcclBatchSendRecv(items.as_mut_ptr(), 2, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        let mut sum = [r as f32 + 1.0; 2];
        let red = HcclReduceOp::HCCL_REDUCE_SUM;
        let p = sum.as_mut_ptr().cast();
        assert_eq!(
            HcclAllReduce(p, p, 2, f32t, red, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(HcclBarrier(comm, st), HcclResult::HCCL_SUCCESS);
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        (recv, sum)
    });
    for (r, (recv, sum)) in out.iter().enumerate() {
        assert_eq!(*recv, [((r + 3) % 4) as f32; 3]);
        assert_eq!(*sum, [10.0; 2]);
    }
}

#[test]
fn misuse_returns_the_documented_codes() {
    let f32t = HcclDataType::HCCL_DATA_TYPE_FP32;
    ranks(2, |r, comm, st| unsafe {
        let mut b = [0f32; 4];
        let p = b.as_mut_ptr().cast();
        assert_eq!(
            HcclSend(p, 4, f32t, 1 - r, comm, null_mut()),
            HcclResult::HCCL_E_PTR,
            "null stream"
        );
        assert_eq!(
            HcclSend(p, 4, f32t, r, comm, st),
            HcclResult::HCCL_E_PARA,
            "send to oneself"
        );
        assert_eq!(
            HcclRecv(p, 4, f32t, 9, comm, st),
            HcclResult::HCCL_E_PARA,
            "unknown rank"
        );
        let item = HcclSendRecvItem {
            sendRecvType: HcclSendRecvType::HCCL_SEND,
            buf: p,
            count: 4,
            dataType: f32t,
            remoteRank: 1 - r,
        };
        let mut two = [item, item];
        assert_eq!(
            HcclBatchSendRecv(two.as_mut_ptr(), 2, comm, st),
            HcclResult::HCCL_E_PARA,
            "two sends, one peer"
        );
        let mut e = HcclResult::HCCL_E_INTERNAL;
        assert_eq!(
            HcclGetCommAsyncError(comm, &mut e),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(e, HcclResult::HCCL_SUCCESS);
        let msg = std::ffi::CStr::from_ptr(HcclGetErrorString(HcclResult::HCCL_E_PARA));
        assert!(!msg.to_bytes().is_empty());
    });
}
