//! The happens-before checker: unordered accesses to device memory are counted and
//! reported, ordered ones are not. Tests run in parallel in this binary, so each one
//! uses a device of its own (hazards are charged to the calling thread's device).
#![cfg(ascend_emulator)]

use ascend_sys::emulator::counters::{reset, snapshot};
use ascend_sys::emulator::hazards::{hazards, reports, HazardKind};
use ascend_sys::*;
use std::ffi::c_void;
use std::process::Command;
use std::ptr::null_mut;

const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const F32: HcclDataType = HcclDataType::HCCL_DATA_TYPE_FP32;
const CHILD: &str = "MPIPE_EMU_HAZARDS_CHILD";
const N: usize = 256;

fn on_device(d: i32) {
    let rc = unsafe { aclInit(std::ptr::null()) };
    assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
    assert_eq!(unsafe { aclrtSetDevice(d) }, ACL_SUCCESS);
    reset(d);
}

fn stream() -> aclrtStream {
    let mut s = null_mut();
    assert_eq!(unsafe { aclrtCreateStream(&mut s) }, ACL_SUCCESS);
    s
}

fn event() -> aclrtEvent {
    let mut e = null_mut();
    assert_eq!(unsafe { aclrtCreateEvent(&mut e) }, ACL_SUCCESS);
    e
}

fn alloc(bytes: usize) -> *mut c_void {
    let mut p = null_mut();
    let policy = aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST;
    assert_eq!(unsafe { aclrtMalloc(&mut p, bytes, policy) }, ACL_SUCCESS);
    p
}

fn at(p: *mut c_void, offset: usize) -> *mut c_void {
    p.cast::<u8>().wrapping_add(offset).cast()
}

fn sync(s: aclrtStream) {
    assert_eq!(unsafe { aclrtSynchronizeStream(s) }, ACL_SUCCESS);
}

fn free(p: *mut c_void) {
    assert_eq!(unsafe { aclrtFree(p) }, ACL_SUCCESS);
}

/// `x` written on stream `a` (host to device), then read on `b` (device to host);
/// with `ordered`, `b` waits for an event recorded on `a` after the write.
fn write_on_a_read_on_b(device: i32, ordered: bool) -> (aclrtStream, aclrtStream, usize) {
    on_device(device);
    let (a, b) = (stream(), stream());
    let x = alloc(N);
    let src = vec![1u8; N];
    let mut out = vec![0u8; N];
    unsafe {
        assert_eq!(
            aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a),
            ACL_SUCCESS
        );
        if ordered {
            let e = event();
            assert_eq!(aclrtRecordEvent(e, a), ACL_SUCCESS);
            assert_eq!(aclrtStreamWaitEvent(b, e), ACL_SUCCESS);
        }
        assert_eq!(
            aclrtMemcpyAsync(out.as_mut_ptr().cast(), N, x, N, D2H, b),
            ACL_SUCCESS
        );
    }
    sync(a);
    sync(b);
    free(x);
    (a, b, x as usize)
}

#[test]
fn a_copy_on_one_stream_then_a_read_on_another_without_an_event() {
    let (a, b, x) = write_on_a_read_on_b(1, false);
    assert_eq!(snapshot(1).hazards, 1);
    let r = reports(1);
    assert_eq!(r.len(), 1);
    let h = &r[0];
    assert_eq!(h.kind, HazardKind::ReadAfterWrite);
    assert_eq!((h.address, h.size, h.offset, h.len), (x, N, 0, N));
    assert_eq!(h.by, format!("stream {:#x} (device 1)", b as usize));
    assert_eq!(h.earlier_by, format!("stream {:#x} (device 1)", a as usize));
    assert_eq!(h.action, "aclrtMemcpyAsync source");
    assert_eq!(h.earlier_action, "aclrtMemcpyAsync destination");
    let text = &hazards(1)[0];
    for part in [
        "read-after-write",
        &format!("allocation #{}", h.allocation),
        &format!("{:#x}", a as usize),
        &format!("{:#x}", b as usize),
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
}

#[test]
fn a_recorded_event_and_a_wait_order_the_streams() {
    write_on_a_read_on_b(2, true);
    assert_eq!(snapshot(2).hazards, 0, "{:?}", hazards(2));
}

#[test]
fn one_stream_is_ordered_by_stream_order() {
    on_device(3);
    let a = stream();
    let (x, y) = (alloc(N), alloc(N));
    let src = vec![1u8; N];
    let mut out = vec![0u8; N];
    unsafe {
        // write x, read x / write y, write x again, read y, memset-free host path later.
        assert_eq!(aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a), 0);
        assert_eq!(aclrtMemcpyAsync(y, N, x, N, D2D, a), 0);
        assert_eq!(aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a), 0);
        assert_eq!(
            aclrtMemcpyAsync(out.as_mut_ptr().cast(), N, y, N, D2H, a),
            0
        );
    }
    sync(a);
    // After the synchronisation the host may touch and free both.
    unsafe {
        assert_eq!(aclrtMemcpy(out.as_mut_ptr().cast(), N, x, N, D2H), 0);
        assert_eq!(aclrtMemset(y, N, 0, N), 0);
    }
    free(x);
    free(y);
    assert_eq!(snapshot(3).hazards, 0, "{:?}", hazards(3));
}

#[test]
fn a_host_copy_after_async_work_needs_a_synchronisation() {
    on_device(4);
    let a = stream();
    let x = alloc(N);
    let src = vec![1u8; N];
    let mut out = vec![0u8; N];
    unsafe {
        assert_eq!(aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a), 0);
        assert_eq!(aclrtMemcpy(out.as_mut_ptr().cast(), N, x, N, D2H), 0);
    }
    let r = reports(4);
    assert_eq!(r.len(), 1, "{:?}", hazards(4));
    assert_eq!(r[0].kind, HazardKind::ReadAfterWrite);
    assert_eq!(r[0].action, "aclrtMemcpy source");
    assert!(r[0].by.starts_with("host thread"), "{}", r[0].by);
    assert_eq!(
        r[0].earlier_by,
        format!("stream {:#x} (device 4)", a as usize)
    );
    // Ordered through an event the host waits for: no new hazard.
    let e = event();
    unsafe {
        assert_eq!(aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a), 0);
        assert_eq!(aclrtRecordEvent(e, a), 0);
        assert_eq!(aclrtSynchronizeEvent(e), 0);
        assert_eq!(aclrtMemcpy(out.as_mut_ptr().cast(), N, x, N, D2H), 0);
    }
    assert_eq!(snapshot(4).hazards, 1, "{:?}", hazards(4));
    // The host writes (memset) while the stream still reads: write-after-read.
    unsafe {
        assert_eq!(
            aclrtMemcpyAsync(out.as_mut_ptr().cast(), N, x, N, D2H, a),
            0
        );
        assert_eq!(aclrtMemset(x, N, 0, N), 0);
    }
    let r = reports(4);
    assert_eq!(r.len(), 2, "{:?}", hazards(4));
    assert_eq!(r[1].kind, HazardKind::WriteAfterRead);
    assert_eq!(
        (r[1].action.as_str(), r[1].earlier_action.as_str()),
        ("aclrtMemset", "aclrtMemcpyAsync source")
    );
    sync(a);
    free(x);
    assert_eq!(snapshot(4).hazards, 2);
}

#[test]
fn free_while_in_use() {
    on_device(5);
    let (a, b) = (stream(), stream());
    let x = alloc(N);
    let src = vec![1u8; N];
    unsafe {
        assert_eq!(aclrtMemcpyAsync(x, N, src.as_ptr().cast(), N, H2D, a), 0);
    }
    // Synchronising another stream orders nothing of `a`.
    sync(b);
    free(x);
    let r = reports(5);
    assert_eq!(r.len(), 1, "{:?}", hazards(5));
    assert_eq!(r[0].kind, HazardKind::FreeWhileInUse);
    assert_eq!(r[0].action, "aclrtFree");
    assert_eq!(r[0].earlier_action, "aclrtMemcpyAsync destination");
    assert!(hazards(5)[0].contains("free while in use"));
    sync(a);
}

#[test]
fn byte_ranges_conflict_only_where_they_overlap() {
    on_device(6);
    let (a, b) = (stream(), stream());
    let x = alloc(128);
    let src = [1u8; 128];
    let mut out = vec![0u8; 128];
    unsafe {
        // a writes x[0..64], b writes x[64..128]: disjoint, no hazard.
        assert_eq!(aclrtMemcpyAsync(x, 64, src.as_ptr().cast(), 64, H2D, a), 0);
        let hi = at(x, 64);
        assert_eq!(aclrtMemcpyAsync(hi, 64, src.as_ptr().cast(), 64, H2D, b), 0);
        assert_eq!(snapshot(6).hazards, 0, "{:?}", hazards(6));
        // b reads x[32..96]: unordered with a's write of x[32..64] only.
        let mid = at(x, 32);
        assert_eq!(
            aclrtMemcpyAsync(out.as_mut_ptr().cast(), 64, mid, 64, D2H, b),
            0
        );
    }
    let r = reports(6);
    assert_eq!(r.len(), 1, "{:?}", hazards(6));
    assert_eq!((r[0].offset, r[0].len), (32, 32));
    assert_eq!(
        r[0].earlier_by,
        format!("stream {:#x} (device 6)", a as usize)
    );
    sync(a);
    sync(b);
    free(x);
    assert_eq!(snapshot(6).hazards, 1);
}

/// HCCL buffers: a batch item sending a buffer another stream is still writing is a
/// hazard that names the item; waiting on an event fixes it.
#[test]
fn hccl_batch_items_are_accesses() {
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    std::thread::scope(|s| {
        for r in 0..2u32 {
            s.spawn(move || unsafe {
                // Devices 7 and 0 (0 is free of other tests' hazards here).
                let dev = if r == 0 { 7 } else { 0 };
                on_device(dev);
                let (fill, comm_stream) = (stream(), stream());
                let mut comm = null_mut();
                assert_eq!(
                    HcclCommInitRootInfo(2, root, r, &mut comm),
                    HcclResult::HCCL_SUCCESS
                );
                let (buf, other) = (alloc(64), alloc(64));
                let src = [1f32; 16];
                for ordered in [false, true] {
                    assert_eq!(
                        aclrtMemcpyAsync(buf, 64, src.as_ptr().cast(), 64, H2D, fill),
                        0
                    );
                    if ordered {
                        let e = event();
                        assert_eq!(aclrtRecordEvent(e, fill), 0);
                        assert_eq!(aclrtStreamWaitEvent(comm_stream, e), 0);
                    }
                    let mut items = [
                        HcclSendRecvItem {
                            sendRecvType: HcclSendRecvType::HCCL_RECV,
                            buf: other,
                            count: 16,
                            dataType: F32,
                            remoteRank: 1 - r,
                        },
                        HcclSendRecvItem {
                            sendRecvType: HcclSendRecvType::HCCL_SEND,
                            buf,
                            count: 16,
                            dataType: F32,
                            remoteRank: 1 - r,
                        },
                    ];
                    assert_eq!(
                        HcclBatchSendRecv(items.as_mut_ptr(), 2, comm, comm_stream),
                        HcclResult::HCCL_SUCCESS
                    );
                    sync(comm_stream);
                    sync(fill);
                }
                let r_ = reports(dev);
                assert_eq!(r_.len(), 1, "{:?}", hazards(dev));
                assert_eq!(r_[0].kind, HazardKind::ReadAfterWrite);
                assert_eq!(
                    r_[0].action,
                    format!("HcclBatchSendRecv item 1 SEND to rank {}", 1 - r)
                );
                assert_eq!(r_[0].earlier_action, "aclrtMemcpyAsync destination");
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
                free(buf);
                free(other);
            });
        }
    });
}

/// `MPIPE_ASCEND_EMU_HAZARDS=0` turns the checker off (in a child process: the
/// variable is read once).
#[test]
fn the_checker_can_be_turned_off() {
    let o = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("MPIPE_ASCEND_EMU_HAZARDS", "0")
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("hazards with the checker off: 0"), "{text}");
}

#[test]
fn child() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    write_on_a_read_on_b(1, false);
    println!("hazards with the checker off: {}", snapshot(1).hazards);
}
