//! The host emulator: the AscendCL/HCCL subset implemented on CPUs, exported under the C
//! names (`#[no_mangle]`), so the `extern "C"` declarations of [`crate`] resolve to it
//! when no CANN toolkit is linked.
//!
//! Semantics kept (the ones a pipeline runtime's correctness depends on):
//! - a stream is a worker thread running its queued work in order;
//!   `aclrtSynchronizeStream` waits for everything queued before it and reports a failure
//!   of any of it; events are recorded in stream order and `aclrtStreamWaitEvent` makes a
//!   stream wait for the event's latest recording;
//! - device memory ([`memory`]) is address space the host cannot read (a host
//!   dereference faults, as on an NPU), backed by host storage that every entry point
//!   reaches through a bounds-checked translation: copies of each kind need device
//!   memory on their device sides and host memory on their host sides, and check
//!   `destMax`; out-of-bounds, freed or unallocated addresses are error codes;
//!   `aclrtMallocHost` memory is ordinary host memory;
//! - HCCL (`hccl.rs`): ranks joined through the root info, as threads of one process
//!   or across processes (`hub.rs`); send/receive complete only when the peer posts the
//!   matching call, with a deadlock report after a timeout; batches post their items
//!   together; collectives reduce. Device buffers are translated and checked; other
//!   addresses are taken as host memory (a leniency: real HCCL needs device memory).
//!
//! Observability, as a profiler on the device would give it:
//! - [`counters`]: per-device counts of the calls made (HCCL operations, copies, host
//!   waits, allocations, aclnn kernels, hazards), charged at the exported entry points to
//!   the calling thread's current device;
//! - [`aclnn`]: the aclnn operator subset on CPUs behind CANN's two-phase API, strict
//!   about workspaces, executors, alignment, bounds and shapes;
//! - [`hazards`]: a happens-before checker computed at issue time (vector clocks over
//!   streams and host threads; events and host synchronisations are the edges) that
//!   reports every access to device memory not ordered after a conflicting one, and
//!   frees of buffers still in use (on by default; `MPIPE_ASCEND_EMU_HAZARDS=0` turns
//!   it off);
//! - [`clock`]: a virtual device clock per stream (off until `clock::start`): kernel
//!   durations charged by the program (`clock::charge`, from a profile), event
//!   edges, HCCL operations completing at the matched sides' later start plus their
//!   charged cost; per stream a trace of spans, so a step's device time can be
//!   compared with a simulator's prediction.
//!
//! Devices: `MPIPE_ASCEND_EMU_DEVICES` (default 8). Errors use the documented codes.

pub mod aclnn;
pub mod clock;
pub mod counters;
pub mod hazards;
mod hccl;
mod hub;

pub use hccl::{abandon, departed_rank, stalled_peer};
pub mod memory;

use hazards::Use;

use crate::bindings::*;
use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

static INITIALIZED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static CURRENT_DEVICE: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

/// Locks, ignoring poisoning (a panicking task must not wedge the whole emulator).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The calling thread's current device (`aclrtSetDevice`), if any.
pub(crate) fn current_device() -> Option<i32> {
    CURRENT_DEVICE.with(|d| d.get())
}

fn device_count() -> u32 {
    std::env::var("MPIPE_ASCEND_EMU_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

// ------------------------------------------------------------------ streams

type Task = Box<dyn FnOnce() -> aclError + Send>;

struct StreamState {
    queued: u64,
    done: u64,
    /// The first failure since the last synchronisation.
    error: aclError,
}

pub(crate) struct Stream {
    tx: Mutex<Option<mpsc::Sender<Task>>>,
    /// Its virtual clock ([`clock`]).
    pub(crate) clock: Arc<clock::StreamClock>,
    state: Arc<(Mutex<StreamState>, Condvar)>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Stream {
    fn new(device: i32) -> Stream {
        let (tx, rx) = mpsc::channel::<Task>();
        let clock = clock::StreamClock::new(device);
        let worker_clock = Arc::clone(&clock);
        let state = Arc::new((
            Mutex::new(StreamState {
                queued: 0,
                done: 0,
                error: 0,
            }),
            Condvar::new(),
        ));
        let st = Arc::clone(&state);
        let worker = std::thread::Builder::new()
            .name("ascend-emu-stream".into())
            .spawn(move || {
                clock::bind_worker(worker_clock);
                for task in rx {
                    gate().wait_open();
                    let rc = task();
                    let mut s = lock(&st.0);
                    s.done += 1;
                    if rc != ACL_SUCCESS && s.error == ACL_SUCCESS {
                        s.error = rc;
                    }
                    st.1.notify_all();
                }
            })
            .expect("spawn stream worker");
        Stream {
            tx: Mutex::new(Some(tx)),
            clock,
            state,
            worker: Mutex::new(Some(worker)),
        }
    }

    /// Queues `task` behind the stream's earlier work.
    pub(crate) fn enqueue(&self, task: Task) -> aclError {
        let tx = lock(&self.tx);
        let Some(tx) = tx.as_ref() else {
            return ACL_ERROR_INVALID_RESOURCE_HANDLE;
        };
        lock(&self.state.0).queued += 1;
        if tx.send(task).is_err() {
            return ACL_ERROR_RT_INTERNAL_ERROR;
        }
        ACL_SUCCESS
    }

    fn synchronize(&self) -> aclError {
        let (m, cv) = &*self.state;
        let mut s = lock(m);
        let target = s.queued;
        while s.done < target {
            s = cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        std::mem::replace(&mut s.error, ACL_SUCCESS)
    }
}

/// Whether stream workers may run their queued work: closed by [`pause_streams`],
/// opened by [`resume_streams`]. Shared by every stream of the process.
struct Gate {
    paused: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn wait_open(&self) {
        let mut p = lock(&self.paused);
        while *p {
            p = self.opened.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn gate() -> &'static Gate {
    static G: OnceLock<Gate> = OnceLock::new();
    G.get_or_init(|| Gate {
        paused: Mutex::new(false),
        opened: Condvar::new(),
    })
}

/// Pauses every stream of this process: work already running finishes, nothing
/// queued starts until [`resume_streams`]. Calls keep being accepted and queued, so
/// a program that never waits on the host can issue a whole step while paused (a
/// test of exactly that); a host wait (`aclrtSynchronizeStream`, a synchronous copy)
/// blocks until the streams are resumed.
pub fn pause_streams() {
    *lock(&gate().paused) = true;
}

/// Lets every stream of this process run its queued work again.
pub fn resume_streams() {
    *lock(&gate().paused) = false;
    gate().opened.notify_all();
}

/// Live handles, so that stale or foreign pointers are rejected instead of dereferenced.
fn streams() -> &'static Mutex<HashMap<usize, Arc<Stream>>> {
    static S: OnceLock<Mutex<HashMap<usize, Arc<Stream>>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

pub(crate) fn stream_of(handle: aclrtStream) -> Option<Arc<Stream>> {
    lock(streams()).get(&(handle as usize)).cloned()
}

// ------------------------------------------------------------------ events

#[derive(Default)]
struct EventState {
    /// How many recordings were queued, and how many have happened.
    queued: u64,
    done: u64,
    at: Option<Instant>,
    /// The virtual time of the latest queued recording ([`clock`]), while the clock runs.
    stamp: Option<Arc<clock::Stamp>>,
}

struct Event(Mutex<EventState>, Condvar);

fn events() -> &'static Mutex<HashMap<usize, Arc<Event>>> {
    static E: OnceLock<Mutex<HashMap<usize, Arc<Event>>>> = OnceLock::new();
    E.get_or_init(Default::default)
}

fn event_of(handle: aclrtEvent) -> Option<Arc<Event>> {
    lock(events()).get(&(handle as usize)).cloned()
}

impl Event {
    fn wait_for(&self, generation: u64) {
        let mut s = lock(&self.0);
        while s.done < generation {
            s = self.1.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

// ------------------------------------------------------------------ memory

/// `aclrtMallocHost` allocations: ordinary host memory, by address.
fn host_allocations() -> &'static Mutex<HashMap<usize, Layout>> {
    static A: OnceLock<Mutex<HashMap<usize, Layout>>> = OnceLock::new();
    A.get_or_init(Default::default)
}

fn allocate_host(ptr: *mut *mut c_void, size: usize) -> aclError {
    if ptr.is_null() || size == 0 {
        return ACL_ERROR_INVALID_PARAM;
    }
    let Ok(layout) = Layout::from_size_align(size, 64) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return ACL_ERROR_BAD_ALLOC;
    }
    lock(host_allocations()).insert(p as usize, layout);
    // SAFETY: checked non-null above; the caller passes a writable pointer.
    unsafe { *ptr = p.cast() };
    ACL_SUCCESS
}

fn release_host(ptr: *mut c_void) -> aclError {
    match lock(host_allocations()).remove(&(ptr as usize)) {
        // SAFETY: allocated by `allocate_host` with this layout, removed from the table once.
        Some(layout) => unsafe {
            std::alloc::dealloc(ptr.cast(), layout);
            ACL_SUCCESS
        },
        None => ACL_ERROR_INVALID_PARAM,
    }
}

/// Reports a rejected memory access on stderr (the code alone says too little).
pub(crate) fn report_memory(call: &str, e: &memory::MemError, code: &str) {
    eprintln!("ascend-sys emulator: {call}: {e} ({code})");
}

/// Checks a copy's arguments and resolves its destination and source for its kind
/// (device sides must be device memory, host sides must not be).
fn copy_spans(
    call: &str,
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> Result<(memory::Span, memory::Span), aclError> {
    if dst.is_null() || src.is_null() || count > dest_max {
        return Err(ACL_ERROR_INVALID_PARAM);
    }
    let (dst_device, src_device) = match kind {
        aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST => (false, false),
        aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE => (true, false),
        aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST => (false, true),
        aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE => (true, true),
        _ => return Err(ACL_ERROR_INVALID_PARAM),
    };
    let side = |addr: usize, device: bool| {
        if device {
            memory::resolve_device(addr, count)
        } else {
            memory::resolve_host(addr, count)
        }
    };
    side(dst as usize, dst_device)
        .and_then(|d| Ok((d, side(src as usize, src_device)?)))
        .map_err(|e| {
            report_memory(call, &e, "ACL_ERROR_INVALID_PARAM");
            ACL_ERROR_INVALID_PARAM
        })
}

/// Counts an accepted copy of `count` bytes (host-to-host copies are not counted).
fn count_copy(kind: aclrtMemcpyKind, count: usize, sync: bool) {
    match kind {
        aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE | aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST => {
            counters::count(|c| {
                c.copies += 1;
                c.copy_bytes += count as u64;
                c.sync_copies += u64::from(sync);
            })
        }
        aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE => counters::count(|c| c.device_copies += 1),
        _ => {}
    }
}

// ------------------------------------------------------------------ exported functions

#[no_mangle]
pub extern "C" fn aclInit(_config_path: *const c_char) -> aclError {
    if INITIALIZED.swap(true, Ordering::SeqCst) {
        return ACL_ERROR_REPEAT_INITIALIZE;
    }
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclFinalize() -> aclError {
    if !INITIALIZED.swap(false, Ordering::SeqCst) {
        return ACL_ERROR_REPEAT_FINALIZE;
    }
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtSetDevice(device_id: i32) -> aclError {
    if !INITIALIZED.load(Ordering::SeqCst) {
        return ACL_ERROR_UNINITIALIZE;
    }
    if device_id < 0 || device_id as u32 >= device_count() {
        return ACL_ERROR_RT_INVALID_DEVICEID;
    }
    CURRENT_DEVICE.with(|d| d.set(Some(device_id)));
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtResetDevice(device_id: i32) -> aclError {
    if device_id < 0 || device_id as u32 >= device_count() {
        return ACL_ERROR_RT_INVALID_DEVICEID;
    }
    CURRENT_DEVICE.with(|d| {
        if d.get() == Some(device_id) {
            d.set(None)
        }
    });
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> aclError {
    if count.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    // SAFETY: non-null, and the caller passes a writable u32.
    unsafe { *count = device_count() };
    ACL_SUCCESS
}

fn require_device() -> aclError {
    if CURRENT_DEVICE.with(|d| d.get()).is_none() {
        ACL_ERROR_RT_CONTEXT_NULL
    } else {
        ACL_SUCCESS
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError {
    if stream.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let rc = require_device();
    if rc != ACL_SUCCESS {
        return rc;
    }
    let s = Arc::new(Stream::new(current_device().unwrap_or(-1)));
    let handle = Arc::as_ptr(&s) as usize;
    s.clock.set_handle(handle);
    lock(streams()).insert(handle, s);
    hazards::stream_created(handle);
    // SAFETY: non-null, and the caller passes a writable handle.
    unsafe { *stream = handle as aclrtStream };
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: aclrtStream) -> aclError {
    let Some(s) = lock(streams()).remove(&(stream as usize)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    hazards::stream_destroyed(stream as usize);
    clock::stream_destroyed(&s.clock);
    // Queued work still runs (as on the device), then the worker ends.
    lock(&s.tx).take();
    if let Some(w) = lock(&s.worker).take() {
        let _ = w.join();
    }
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError {
    match stream_of(stream) {
        Some(s) => {
            counters::count(|c| c.host_waits += 1);
            hazards::host_syncs_stream(stream as usize);
            s.synchronize()
        }
        None => ACL_ERROR_INVALID_PARAM,
    }
}

#[no_mangle]
pub extern "C" fn aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent) -> aclError {
    let (Some(s), Some(e)) = (stream_of(stream), event_of(event)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    let (generation, stamp) = {
        let st = lock(&e.0);
        (st.queued, st.stamp.clone())
    };
    let rc = s.enqueue(Box::new(move || {
        e.wait_for(generation);
        if let Some(stamp) = stamp {
            stamp.apply();
        }
        ACL_SUCCESS
    }));
    if rc == ACL_SUCCESS {
        hazards::wait(stream as usize, event as usize);
    }
    rc
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut aclrtEvent) -> aclError {
    if event.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let e = Arc::new(Event(Mutex::new(EventState::default()), Condvar::new()));
    let handle = Arc::as_ptr(&e) as usize;
    lock(events()).insert(handle, e);
    // SAFETY: non-null, and the caller passes a writable handle.
    unsafe { *event = handle as aclrtEvent };
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream) -> aclError {
    let (Some(s), Some(e)) = (stream_of(stream), event_of(event)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    let stamp = clock::Stamp::issue();
    let generation = {
        let mut st = lock(&e.0);
        st.queued += 1;
        st.stamp = stamp.clone();
        st.queued
    };
    let rc = s.enqueue(Box::new(move || {
        if let Some(stamp) = stamp {
            stamp.capture();
        }
        let mut st = lock(&e.0);
        st.done = st.done.max(generation);
        st.at = Some(Instant::now());
        e.1.notify_all();
        ACL_SUCCESS
    }));
    if rc == ACL_SUCCESS {
        hazards::record(event as usize, stream as usize);
    }
    rc
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeEvent(event: aclrtEvent) -> aclError {
    let Some(e) = event_of(event) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    counters::count(|c| c.host_waits += 1);
    hazards::host_syncs_event(event as usize);
    let generation = lock(&e.0).queued;
    e.wait_for(generation);
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclrtEventElapsedTime(
    ms: *mut f32,
    start: aclrtEvent,
    end: aclrtEvent,
) -> aclError {
    let (Some(a), Some(b)) = (event_of(start), event_of(end)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    if ms.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    // One lock at a time: `start` and `end` may be the same event.
    let ta = lock(&a.0).at;
    let tb = lock(&b.0).at;
    let (Some(ta), Some(tb)) = (ta, tb) else {
        return ACL_ERROR_RT_PARAM_INVALID;
    };
    let d = if tb >= ta {
        (tb - ta).as_secs_f32()
    } else {
        -(ta - tb).as_secs_f32()
    };
    // SAFETY: non-null, and the caller passes a writable f32.
    unsafe { *ms = d * 1000.0 };
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtDestroyEvent(event: aclrtEvent) -> aclError {
    match lock(events()).remove(&(event as usize)) {
        Some(_) => {
            hazards::event_destroyed(event as usize);
            ACL_SUCCESS
        }
        None => ACL_ERROR_INVALID_PARAM,
    }
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(
    dev_ptr: *mut *mut c_void,
    size: usize,
    _policy: aclrtMemMallocPolicy,
) -> aclError {
    if dev_ptr.is_null() || size == 0 {
        return ACL_ERROR_INVALID_PARAM;
    }
    let Some(a) = memory::malloc(size, current_device()) else {
        return ACL_ERROR_BAD_ALLOC;
    };
    // SAFETY: non-null, and the caller passes a writable pointer.
    unsafe { *dev_ptr = a.base as *mut c_void };
    counters::count(|c| c.mallocs += 1);
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> aclError {
    match memory::free(dev_ptr as usize) {
        Ok(a) => {
            counters::count(|c| c.frees += 1);
            hazards::freed(&a);
            ACL_SUCCESS
        }
        Err(e) => {
            report_memory("aclrtFree", &e, "ACL_ERROR_INVALID_PARAM");
            ACL_ERROR_INVALID_PARAM
        }
    }
}

#[no_mangle]
pub extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> aclError {
    allocate_host(host_ptr, size)
}

#[no_mangle]
pub extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> aclError {
    release_host(host_ptr)
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> aclError {
    let (d, s) = match copy_spans("aclrtMemcpy", dst, dest_max, src, count, kind) {
        Ok(x) => x,
        Err(rc) => return rc,
    };
    // SAFETY: device sides are backing storage checked to hold `count` bytes; host
    // sides hold them by the caller's promise; `copy` allows overlap.
    unsafe { std::ptr::copy(s.ptr as *const u8, d.ptr as *mut u8, count) };
    count_copy(kind, count, true);
    hazards::on_host(vec![
        Use::read(&s, "aclrtMemcpy", "source"),
        Use::write(&d, "aclrtMemcpy", "destination"),
    ]);
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
    stream: aclrtStream,
) -> aclError {
    let (d, s) = match copy_spans("aclrtMemcpyAsync", dst, dest_max, src, count, kind) {
        Ok(x) => x,
        Err(rc) => return rc,
    };
    // As documented: no asynchronous copy within the host.
    if kind == aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_HOST {
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    let Some(st) = stream_of(stream) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    hazards::on_stream(
        stream as usize,
        vec![
            Use::read(&s, "aclrtMemcpyAsync", "source"),
            Use::write(&d, "aclrtMemcpyAsync", "destination"),
        ],
    );
    let rc = st.enqueue(Box::new(move || {
        // The whole spans (not just their addresses): they keep device storage alive.
        let (s, d) = (s, d);
        // SAFETY: the spans keep device storage alive; host buffers stay alive until
        // the stream reaches this copy by the caller's promise.
        unsafe { std::ptr::copy(s.ptr as *const u8, d.ptr as *mut u8, count) };
        ACL_SUCCESS
    }));
    if rc == ACL_SUCCESS {
        count_copy(kind, count, false);
    }
    rc
}

/// Device memory is checked against its allocation; other (host) memory is written
/// as the caller promises.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemset(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
) -> aclError {
    if dev_ptr.is_null() || count > max_count {
        return ACL_ERROR_INVALID_PARAM;
    }
    let span = match memory::resolve(dev_ptr as usize, count) {
        Ok(s) => s,
        Err(e) => {
            report_memory("aclrtMemset", &e, "ACL_ERROR_INVALID_PARAM");
            return ACL_ERROR_INVALID_PARAM;
        }
    };
    // SAFETY: `count` writable bytes (checked for device memory, promised for host).
    unsafe { std::ptr::write_bytes(span.ptr as *mut u8, value as u8, count) };
    hazards::on_host(vec![Use::write(&span, "aclrtMemset", "")]);
    ACL_SUCCESS
}
