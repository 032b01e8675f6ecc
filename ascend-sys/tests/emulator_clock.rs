//! The emulator's virtual device clock (`emulator::clock`) through the FFI and the
//! `profile` facade: charged spans in stream order, event waits raising a stream to
//! the recording it waits for (not a later one), host waits moving nothing, HCCL items
//! completing at the later side's start plus the cost, collectives at the last
//! member's start plus the cost; nothing happens while the clock is off.
//!
//! One binary of its own: the clock is process-wide (tests take [`CLOCK`]).
#![cfg(ascend_emulator)]

use ascend_sys::profile::{self, Span, Trace};
use ascend_sys::*;
use std::ptr::null_mut;
use std::sync::Mutex;

static CLOCK: Mutex<()> = Mutex::new(());

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

fn charge(s: aclrtStream, d: f64, label: &str) {
    assert_eq!(profile::charge(s, d, || label.to_string()), ACL_SUCCESS);
}

fn sync(s: aclrtStream) {
    assert_eq!(unsafe { aclrtSynchronizeStream(s) }, ACL_SUCCESS);
}

/// `(start, end, label)` of `s`'s spans, and its end time.
fn spans_of(t: &Trace, s: aclrtStream) -> (Vec<(f64, f64, String)>, f64) {
    let st = t
        .streams
        .iter()
        .find(|x| x.stream == s as usize)
        .expect("the stream is traced");
    let spans = st
        .spans
        .iter()
        .map(|Span { start, end, label }| (*start, *end, label.clone()))
        .collect();
    (spans, st.end)
}

fn span(a: f64, b: f64, l: &str) -> (f64, f64, String) {
    (a, b, l.to_string())
}

#[test]
fn charges_run_in_stream_order_and_events_carry_the_recording_time() {
    let _c = CLOCK.lock().unwrap_or_else(|e| e.into_inner());
    init();
    let (a, b) = (stream(), stream());
    let mut ev = null_mut();
    assert_eq!(unsafe { aclrtCreateEvent(&mut ev) }, ACL_SUCCESS);
    profile::clock_start();
    charge(a, 2.0, "a1");
    assert_eq!(unsafe { aclrtRecordEvent(ev, a) }, ACL_SUCCESS);
    charge(b, 1.0, "b1");
    // Waits for the recording after a1 (time 2), not the later one (time 5).
    assert_eq!(unsafe { aclrtStreamWaitEvent(b, ev) }, ACL_SUCCESS);
    charge(a, 3.0, "a2");
    assert_eq!(unsafe { aclrtRecordEvent(ev, a) }, ACL_SUCCESS);
    charge(b, 0.5, "b2");
    // A host wait in the middle moves no device time.
    sync(a);
    std::thread::sleep(std::time::Duration::from_millis(20));
    charge(a, 1.0, "a3");
    sync(a);
    sync(b);
    let t = profile::clock_trace().expect("emulator");
    profile::clock_stop();
    let (sa, ea) = spans_of(&t, a);
    let (sb, eb) = spans_of(&t, b);
    assert_eq!(
        sa,
        vec![
            span(0.0, 2.0, "a1"),
            span(2.0, 5.0, "a2"),
            span(5.0, 6.0, "a3")
        ]
    );
    assert_eq!(ea, 6.0);
    assert_eq!(sb, vec![span(0.0, 1.0, "b1"), span(2.0, 2.5, "b2")]);
    assert_eq!(eb, 2.5);
    assert_eq!(t.device_time(), 6.0);
    assert_eq!(t.device_end(0), 6.0);
    assert!(t.overlap().is_none());
    unsafe {
        assert_eq!(aclrtDestroyEvent(ev), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(a), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(b), ACL_SUCCESS);
    }
}

#[test]
fn hccl_completes_at_the_later_start_plus_the_cost() {
    let _c = CLOCK.lock().unwrap_or_else(|e| e.into_inner());
    let f32t = HcclDataType::HCCL_DATA_TYPE_FP32;
    let mut root = HcclRootInfo::default();
    assert_eq!(
        unsafe { HcclGetRootInfo(&mut root) },
        HcclResult::HCCL_SUCCESS
    );
    let root = &root;
    // The streams exist (and are idle) before the clock starts.
    let ready = std::sync::Barrier::new(2);
    let started = std::sync::Barrier::new(2);
    let done = std::sync::Barrier::new(2);
    let trace = Mutex::new(None);
    let streams: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                let (ready, started, done, trace) = (&ready, &started, &done, &trace);
                s.spawn(move || {
                    init();
                    let st = stream();
                    let mut comm = null_mut();
                    assert_eq!(
                        unsafe { HcclCommInitRootInfo(2, root, r, &mut comm) },
                        HcclResult::HCCL_SUCCESS
                    );
                    ready.wait();
                    if r == 0 {
                        profile::clock_start();
                    }
                    started.wait();
                    let mut buf = [r as f32; 4];
                    let mut sum = [1f32; 2];
                    // Rank 0 reaches the batch at 4, rank 1 at 1: the item completes at
                    // 4 + 1.5 on both sides (rank 1's charged cost is the larger).
                    charge(st, if r == 0 { 4.0 } else { 1.0 }, "compute");
                    let ty = if r == 0 {
                        HcclSendRecvType::HCCL_SEND
                    } else {
                        HcclSendRecvType::HCCL_RECV
                    };
                    let mut items = [HcclSendRecvItem {
                        sendRecvType: ty,
                        buf: buf.as_mut_ptr().cast(),
                        count: 4,
                        dataType: f32t,
                        remoteRank: 1 - r,
                    }];
                    let cost = if r == 0 { 1.0 } else { 1.5 };
                    assert_eq!(
                        profile::charge_transfers(st, &[cost], || "batch".into()),
                        ACL_SUCCESS
                    );
                    assert_eq!(
                        unsafe { HcclBatchSendRecv(items.as_mut_ptr(), 1, comm, st) },
                        HcclResult::HCCL_SUCCESS
                    );
                    // Rank 1 charges 0.5 more: the all-reduce starts at 5.5 and 6, and
                    // ends at 6 + 2 on both.
                    if r == 1 {
                        charge(st, 0.5, "more");
                    }
                    assert_eq!(
                        profile::charge_transfers(st, &[2.0], || "allreduce".into()),
                        ACL_SUCCESS
                    );
                    let p = sum.as_mut_ptr().cast();
                    let red = HcclReduceOp::HCCL_REDUCE_SUM;
                    assert_eq!(
                        unsafe { HcclAllReduce(p, p, 2, f32t, red, comm, st) },
                        HcclResult::HCCL_SUCCESS
                    );
                    sync(st);
                    assert_eq!(sum, [2.0; 2]);
                    if r == 1 {
                        assert_eq!(buf, [0.0; 4]);
                    }
                    done.wait();
                    if r == 0 {
                        *trace.lock().unwrap() = profile::clock_trace();
                        profile::clock_stop();
                    }
                    done.wait();
                    assert_eq!(unsafe { HcclCommDestroy(comm) }, HcclResult::HCCL_SUCCESS);
                    st as usize
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let t = trace.into_inner().unwrap().expect("emulator");
    let (s0, e0) = spans_of(&t, streams[0] as aclrtStream);
    let (s1, e1) = spans_of(&t, streams[1] as aclrtStream);
    assert_eq!(
        s0,
        vec![
            span(0.0, 4.0, "compute"),
            span(4.0, 5.5, "batch"),
            span(5.5, 8.0, "allreduce")
        ]
    );
    assert_eq!(
        s1,
        vec![
            span(0.0, 1.0, "compute"),
            span(1.0, 5.5, "batch"),
            span(5.5, 6.0, "more"),
            span(6.0, 8.0, "allreduce")
        ]
    );
    assert_eq!((e0, e1), (8.0, 8.0));
    assert_eq!(t.device_time(), 8.0);
}

#[test]
fn off_the_clock_does_nothing_and_bad_charges_are_refused() {
    let _c = CLOCK.lock().unwrap_or_else(|e| e.into_inner());
    init();
    let a = stream();
    profile::clock_start();
    profile::clock_stop();
    assert!(!profile::clock_enabled());
    charge(a, 5.0, "off");
    sync(a);
    let t = profile::clock_trace().expect("emulator");
    assert!(t.streams.iter().all(|s| s.stream != a as usize));
    profile::clock_start();
    assert!(profile::clock_enabled());
    assert_eq!(
        profile::charge(a, -1.0, || "negative".into()),
        ACL_ERROR_INVALID_PARAM
    );
    assert_eq!(
        profile::charge(a, f64::NAN, || "nan".into()),
        ACL_ERROR_INVALID_PARAM
    );
    assert_eq!(
        profile::charge(null_mut(), 1.0, || "no stream".into()),
        ACL_ERROR_INVALID_PARAM
    );
    assert_eq!(
        profile::charge_transfers(a, &[f64::INFINITY], || "inf".into()),
        ACL_ERROR_INVALID_PARAM
    );
    profile::clock_stop();
    assert_eq!(unsafe { aclrtDestroyStream(a) }, ACL_SUCCESS);
}
