//! Device memory the host cannot read: `aclrtMalloc` hands out addresses the host
//! cannot dereference, every entry point translates and bounds-checks them, and misuse
//! is an error code. Some cases re-run this binary as child processes (`child` below,
//! selected by `MPIPE_EMU_MEMORY_CHILD`).
#![cfg(ascend_emulator)]

use ascend_sys::emulator::memory::{is_device, ALIGN};
use ascend_sys::*;
use std::ffi::c_void;
use std::process::{Command, Output};
use std::ptr::null_mut;

const CHILD: &str = "MPIPE_EMU_MEMORY_CHILD";
const F32: HcclDataType = HcclDataType::HCCL_DATA_TYPE_FP32;
const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;
const D2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE;
const H2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST;

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

fn at(p: *mut c_void, offset: usize) -> *mut c_void {
    p.cast::<u8>().wrapping_add(offset).cast()
}

fn f32s(x: &[f32]) -> *const c_void {
    x.as_ptr().cast()
}

#[test]
fn round_trips_at_offsets() {
    on_device(0);
    let st = stream();
    let (a, b) = (alloc(1000), alloc(777));
    assert!(is_device(a as usize) && is_device(b as usize));
    assert_eq!(a as usize % ALIGN, 0);
    assert_eq!(b as usize % ALIGN, 0);
    let host: Vec<u8> = (0..=255).collect();
    unsafe {
        // Host -> a[100..356], a[100..356] -> b[500..756] (async), memset b[0..10].
        assert_eq!(
            aclrtMemcpy(at(a, 100), 900, host.as_ptr().cast(), 256, H2D),
            ACL_SUCCESS
        );
        assert_eq!(
            aclrtMemcpyAsync(at(b, 500), 277, at(a, 100), 256, D2D, st),
            ACL_SUCCESS
        );
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        assert_eq!(aclrtMemset(b, 777, 9, 10), ACL_SUCCESS);
        let mut back = vec![0u8; 777];
        assert_eq!(
            aclrtMemcpyAsync(back.as_mut_ptr().cast(), 777, b, 777, D2H, st),
            ACL_SUCCESS
        );
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        assert_eq!(back[..10], [9u8; 10]);
        assert_eq!(back[10..500], vec![0u8; 490][..], "fresh memory is zero");
        assert_eq!(back[500..756], host[..]);
        // The last byte of an allocation is reachable; one more is not.
        let mut one = [0u8; 1];
        assert_eq!(
            aclrtMemcpy(one.as_mut_ptr().cast(), 1, at(b, 776), 1, D2H),
            ACL_SUCCESS
        );
        assert_eq!(
            aclrtMemcpy(one.as_mut_ptr().cast(), 2, at(b, 776), 2, D2H),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(aclrtFree(a), ACL_SUCCESS);
        assert_eq!(aclrtFree(b), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
    }
}

#[test]
fn out_of_bounds_use_after_free_and_wrong_sides_are_errors() {
    on_device(0);
    let st = stream();
    let a = alloc(64);
    let mut host = vec![0u8; 4096];
    let h = host.as_mut_ptr().cast::<c_void>();
    unsafe {
        // Past the end: synchronous and asynchronous copies, memset, an offset start.
        assert_eq!(aclrtMemcpy(a, 4096, h, 65, H2D), ACL_ERROR_INVALID_PARAM);
        assert_eq!(
            aclrtMemcpyAsync(h, 4096, at(a, 32), 33, D2H, st),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(aclrtMemset(at(a, 60), 8, 0, 8), ACL_ERROR_INVALID_PARAM);
        // Between allocations (the guard gap after `a`) is no allocation.
        assert_eq!(
            aclrtMemcpy(h, 4096, at(a, 64 + 8), 4, D2H),
            ACL_ERROR_INVALID_PARAM
        );
        // A kind whose device side is host memory, or whose host side is device memory.
        let mut other = vec![0u8; 64];
        let o = other.as_mut_ptr().cast::<c_void>();
        assert_eq!(aclrtMemcpy(o, 64, h, 64, H2D), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMemcpy(a, 64, a, 64, H2D), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMemcpy(o, 64, a, 64, H2H), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtMemcpy(o, 64, h, 64, H2H), ACL_SUCCESS);
        // Only an allocation's start can be freed, and only device memory.
        assert_eq!(aclrtFree(at(a, 8)), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtFree(h), ACL_ERROR_INVALID_PARAM);
        // Use after free: copies, memset, free again.
        assert_eq!(aclrtFree(a), ACL_SUCCESS);
        assert_eq!(aclrtMemcpy(a, 64, h, 64, H2D), ACL_ERROR_INVALID_PARAM);
        assert_eq!(
            aclrtMemcpyAsync(h, 64, at(a, 8), 8, D2H, st),
            ACL_ERROR_INVALID_PARAM
        );
        assert_eq!(aclrtMemset(a, 64, 0, 64), ACL_ERROR_INVALID_PARAM);
        assert_eq!(aclrtFree(a), ACL_ERROR_INVALID_PARAM);
        // Host memory from aclrtMallocHost stays ordinary host memory.
        let mut hp = null_mut();
        assert_eq!(aclrtMallocHost(&mut hp, 16), ACL_SUCCESS);
        assert!(!is_device(hp as usize));
        *hp.cast::<u8>() = 5;
        let b = alloc(16);
        assert_eq!(aclrtMemcpy(b, 16, hp, 16, H2D), ACL_SUCCESS);
        assert_eq!(aclrtMemcpy(o, 16, b, 16, D2H), ACL_SUCCESS);
        assert_eq!(other[0], 5);
        assert_eq!(aclrtFreeHost(hp), ACL_SUCCESS);
        assert_eq!(aclrtFree(b), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
    }
}

/// Freeing a buffer that queued work still uses is a program error, but it must not
/// make the emulator touch freed host memory: the queued copy still runs on storage
/// it keeps alive.
#[test]
fn free_under_queued_work_stays_memory_safe() {
    on_device(0);
    let st = stream();
    let n = 1 << 20;
    let (a, b) = (alloc(n), alloc(n));
    let src = vec![1u8; n];
    let mut out = vec![0u8; n];
    unsafe {
        for _ in 0..8 {
            assert_eq!(
                aclrtMemcpyAsync(a, n, src.as_ptr().cast(), n, H2D, st),
                ACL_SUCCESS
            );
            assert_eq!(aclrtMemcpyAsync(b, n, a, n, D2D, st), ACL_SUCCESS);
        }
        assert_eq!(
            aclrtMemcpyAsync(out.as_mut_ptr().cast(), n, b, n, D2H, st),
            ACL_SUCCESS
        );
        assert_eq!(aclrtFree(a), ACL_SUCCESS);
        assert_eq!(aclrtFree(b), ACL_SUCCESS);
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        assert!(out.iter().all(|&v| v == 1));
        assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
    }
}

fn item(t: HcclSendRecvType, buf: *mut c_void, count: u64, peer: u32) -> HcclSendRecvItem {
    HcclSendRecvItem {
        sendRecvType: t,
        buf,
        count,
        dataType: F32,
        remoteRank: peer,
    }
}

/// What one rank does with device memory: a ring batch at buffer offsets, a send and
/// receive, an all-reduce, a reduce and a broadcast; then the checks.
unsafe fn device_exchange(rank: u32, n: u32, comm: HcclComm, st: aclrtStream) {
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let buf = alloc(4096);
    let out = alloc(4096);
    let mine: Vec<f32> = (0..16).map(|i| (rank * 100 + i) as f32).collect();
    unsafe {
        // mine -> buf[64..128]; ring: buf[64..128] to next, out[256..320] from prev.
        assert_eq!(aclrtMemcpy(at(buf, 64), 64, f32s(&mine), 64, H2D), 0);
        let mut items = [
            item(HcclSendRecvType::HCCL_SEND, at(buf, 64), 16, next),
            item(HcclSendRecvType::HCCL_RECV, at(out, 256), 16, prev),
        ];
        assert_eq!(
            HcclBatchSendRecv(items.as_mut_ptr(), 2, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        // All-reduce of buf[64..128] into out[1024..1088].
        let sum = HcclReduceOp::HCCL_REDUCE_SUM;
        assert_eq!(
            HcclAllReduce(at(buf, 64), at(out, 1024), 16, F32, sum, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        // Broadcast of rank 0's buf[64..128] in place.
        assert_eq!(
            HcclBroadcast(at(buf, 64), 16, F32, 0, comm, st),
            HcclResult::HCCL_SUCCESS
        );
        assert_eq!(aclrtSynchronizeStream(st), ACL_SUCCESS);
        let mut got = vec![0f32; 16];
        let g = got.as_mut_ptr().cast::<c_void>();
        assert_eq!(aclrtMemcpy(g, 64, at(out, 256), 64, D2H), 0);
        let want: Vec<f32> = (0..16).map(|i| (prev * 100 + i) as f32).collect();
        assert_eq!(got, want, "ring");
        assert_eq!(aclrtMemcpy(g, 64, at(out, 1024), 64, D2H), 0);
        let total: u32 = (0..n).map(|r| r * 100).sum();
        let want: Vec<f32> = (0..16).map(|i| (total + n * i) as f32).collect();
        assert_eq!(got, want, "all-reduce");
        assert_eq!(aclrtMemcpy(g, 64, at(buf, 64), 64, D2H), 0);
        let want: Vec<f32> = (0..16).map(|i| i as f32).collect();
        assert_eq!(got, want, "broadcast");

        // Misuse: past the end (HCCL_E_PARA), freed (HCCL_E_PTR), misaligned reduction.
        assert_eq!(
            HcclSend(at(buf, 4000), 100, F32, next, comm, st),
            HcclResult::HCCL_E_PARA
        );
        let mut bad = [item(HcclSendRecvType::HCCL_RECV, at(out, 4092), 2, prev)];
        assert_eq!(
            HcclBatchSendRecv(bad.as_mut_ptr(), 1, comm, st),
            HcclResult::HCCL_E_PARA
        );
        assert_eq!(
            HcclAllReduce(at(buf, 2), out, 4, F32, sum, comm, st),
            HcclResult::HCCL_E_PARA
        );
        assert_eq!(aclrtFree(out), ACL_SUCCESS);
        assert_eq!(
            HcclRecv(out, 4, F32, prev, comm, st),
            HcclResult::HCCL_E_PTR
        );
        assert_eq!(
            HcclReduce(buf, at(out, 64), 4, F32, sum, rank, comm, st),
            HcclResult::HCCL_E_PTR
        );
        assert_eq!(aclrtFree(buf), ACL_SUCCESS);
    }
}

#[test]
fn hccl_between_threads_with_device_memory() {
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    std::thread::scope(|s| {
        for r in 0..3u32 {
            s.spawn(move || unsafe {
                on_device(r as i32);
                let st = stream();
                let mut comm = null_mut();
                assert_eq!(
                    HcclCommInitRootInfo(3, root, r, &mut comm),
                    HcclResult::HCCL_SUCCESS
                );
                device_exchange(r, 3, comm, st);
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
                assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
            });
        }
    });
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

fn run_child(spec: String) -> std::process::Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, spec)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn a child")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Ranks in two processes (this one serves the group) exchange device memory: the
/// addresses are translated in each rank's own process before the data goes on the
/// wire.
#[test]
fn hccl_between_processes_with_device_memory() {
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let children: Vec<_> = (0..2)
        .map(|r| run_child(format!("exchange {r} 2 {}", hex(&root))))
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().expect("rank output");
        assert!(o.status.success(), "rank {r} failed:\n{}", text(&o));
        assert!(text(&o).contains(&format!("rank {r}: device exchange passed")));
    }
}

/// The host dereferencing a device address faults, as on an NPU.
#[cfg(unix)]
#[test]
fn host_dereference_of_a_device_address_faults() {
    use std::os::unix::process::ExitStatusExt;
    let o = run_child("deref".into())
        .wait_with_output()
        .expect("child output");
    assert!(
        text(&o).contains("about to read"),
        "the child got as far as the read:\n{}",
        text(&o)
    );
    let signal = o.status.signal();
    assert!(
        matches!(signal, Some(11) | Some(7)),
        "the child died of SIGSEGV or SIGBUS, not {:?}:\n{}",
        o.status,
        text(&o)
    );
}

/// The child side (a no-op unless started by a test above).
#[test]
fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    match parts[0] {
        "deref" => {
            on_device(0);
            let p = alloc(64);
            println!("about to read {p:p}");
            // SAFETY: none: this is the fault under test.
            let v = unsafe { std::ptr::read_volatile(p.cast::<u8>()) };
            println!("read {v} from device memory: the emulator failed to fault");
        }
        "exchange" => {
            let rank: u32 = parts[1].parse().expect("rank");
            let n: u32 = parts[2].parse().expect("n");
            let root = unhex(parts[3]);
            on_device(rank as i32);
            let st = stream();
            let mut comm = null_mut();
            unsafe {
                assert_eq!(
                    HcclCommInitRootInfo(n, &root, rank, &mut comm),
                    HcclResult::HCCL_SUCCESS
                );
                device_exchange(rank, n, comm, st);
                assert_eq!(HcclCommDestroy(comm), HcclResult::HCCL_SUCCESS);
                assert_eq!(aclrtDestroyStream(st), ACL_SUCCESS);
            }
            println!("rank {rank}: device exchange passed");
        }
        other => panic!("unknown child {other}"),
    }
}
