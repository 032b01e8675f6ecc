//! A virtual device clock per emulated stream, and the trace it keeps: the device time
//! a program would take if its kernels and transfers took the durations it states,
//! independent of how fast the emulator's CPU threads happen to run.
//!
//! Off until [`start`]; while off every hook below is one relaxed atomic load and
//! nothing else (no allocation, no lock).
//!
//! The model (all times in the caller's unit, e.g. the profile's seconds):
//! - each stream has a virtual time, 0 at [`start`]; work runs in stream order and a
//!   task starts at the stream's time;
//! - a kernel, a copy or a memset takes no virtual time: durations come only from
//!   [`charge`], which queues a span of the given length in stream order (the stream's
//!   time advances by it and the span is traced with its label);
//! - `aclrtRecordEvent` captures the recording stream's time when the recording runs;
//!   `aclrtStreamWaitEvent` raises the waiting stream's time to the captured time of
//!   the recording it waits for (never lowers it);
//! - host waits (`aclrtSynchronizeStream`, `aclrtSynchronizeEvent`, synchronous copies)
//!   do not move device time: the host has no clock;
//! - HCCL: an operation starts on each rank at that rank's stream time. A
//!   `HcclBatchSendRecv` item, `HcclSend` or `HcclRecv` completes at the later of the
//!   two matched sides' start times plus the transfer's cost (the larger of what the two
//!   sides charged with [`charge_transfers`]; 0 if nothing was charged); the operation
//!   ends at its last item (its stream's time moves there, and the operation is one
//!   traced span). A collective completes on every member at the latest member's start
//!   plus the (largest) charged cost. This is rendezvous semantics: a send holds its
//!   stream until the receiver has reached the matching receive, as HCCL's do.
//!
//! Not modelled: contention (two transfers on one link, or a kernel and a transfer,
//! take their full costs side by side), launch overheads, and ranks in other processes
//! (`hub.rs`): their start times are not carried over the wire, so an operation matched
//! with a rank of another process takes this side's start plus its cost (it does not
//! wait for the peer's clock). Ranks that are threads of one process are exact.
//!
//! [`start`] and [`trace`] are meant for idle devices (after a host wait): they
//! reset or read every stream's clock, and work still running would race with them.

use super::lock;
use crate::bindings::{aclError, aclrtStream};
use crate::profile::{Span, StreamTrace, Trace};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

static ENABLED: AtomicBool = AtomicBool::new(false);
/// Bumped by [`start`]: event recordings captured before it read as time 0.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// Whether the clock runs (between [`start`] and [`stop`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// What [`charge_transfers`] left for the next HCCL operation queued on a stream.
pub(crate) struct OpCost {
    /// Per item in the caller's order (a batch's items; one entry for the others).
    pub(crate) costs: Vec<f64>,
    pub(crate) label: String,
}

#[derive(Default)]
struct State {
    now: f64,
    spans: Vec<Span>,
}

/// One stream's clock: its virtual time and its spans since [`start`].
pub(crate) struct StreamClock {
    device: i32,
    handle: AtomicU64,
    state: Mutex<State>,
    /// Costs for the next HCCL operation, set at issue by [`charge_transfers`].
    pending: Mutex<Option<OpCost>>,
}

impl StreamClock {
    pub(crate) fn new(device: i32) -> Arc<StreamClock> {
        let c = Arc::new(StreamClock {
            device,
            handle: AtomicU64::new(0),
            state: Mutex::default(),
            pending: Mutex::default(),
        });
        let mut reg = lock(registry());
        reg.retain(|w| w.strong_count() > 0);
        reg.push(Arc::downgrade(&c));
        c
    }

    pub(crate) fn set_handle(&self, handle: usize) {
        self.handle.store(handle as u64, Ordering::Relaxed);
    }

    /// Takes the costs [`charge_transfers`] left for the operation being issued.
    pub(crate) fn take_pending(&self) -> Option<OpCost> {
        if enabled() {
            lock(&self.pending).take()
        } else {
            None
        }
    }

    fn trace(&self) -> StreamTrace {
        let s = lock(&self.state);
        StreamTrace {
            device: self.device,
            stream: self.handle.load(Ordering::Relaxed) as usize,
            spans: s.spans.clone(),
            end: s.now,
        }
    }

    fn reset(&self) {
        *lock(&self.state) = State::default();
        lock(&self.pending).take();
    }
}

/// Every stream clock of the process (live streams; destroyed ones are moved to
/// [`retired`] while the clock runs).
fn registry() -> &'static Mutex<Vec<Weak<StreamClock>>> {
    static R: OnceLock<Mutex<Vec<Weak<StreamClock>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn retired() -> &'static Mutex<Vec<StreamTrace>> {
    static R: OnceLock<Mutex<Vec<StreamTrace>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

thread_local! {
    /// The clock of the stream whose worker this thread is (none on other threads).
    static WORKER: RefCell<Option<Arc<StreamClock>>> = const { RefCell::new(None) };
}

/// Makes the calling thread the worker of the stream with `clock`.
pub(crate) fn bind_worker(clock: Arc<StreamClock>) {
    WORKER.with(|w| *w.borrow_mut() = Some(clock));
}

fn with_worker<T>(f: impl FnOnce(&StreamClock) -> T) -> Option<T> {
    WORKER.with(|w| w.borrow().as_deref().map(f))
}

/// The virtual time of the stream whose worker runs the caller (0 elsewhere or off).
pub(crate) fn now() -> f64 {
    if !enabled() {
        return 0.0;
    }
    with_worker(|c| lock(&c.state).now).unwrap_or(0.0)
}

/// Ends an operation of the calling worker's stream that started at `start` at `end`:
/// its time moves to `end` (never back) and the span is traced with `label`.
pub(crate) fn finish(start: f64, end: f64, label: String) {
    if !enabled() {
        return;
    }
    with_worker(|c| {
        let mut s = lock(&c.state);
        let end = end.max(s.now);
        s.spans.push(Span {
            start: start.min(end),
            end,
            label,
        });
        s.now = end;
    });
}

/// Raises the calling worker's stream time to `t` (an event wait).
fn raise_to(t: f64) {
    with_worker(|c| {
        let mut s = lock(&c.state);
        s.now = s.now.max(t);
    });
}

/// The virtual time an event recording captured, filled when the recording runs.
#[derive(Default)]
pub(crate) struct Stamp(Mutex<Option<(u64, f64)>>);

impl Stamp {
    /// A stamp for a recording being issued, if the clock runs.
    pub(crate) fn issue() -> Option<Arc<Stamp>> {
        enabled().then(Arc::default)
    }

    /// Run by the recording task: captures its stream's time.
    pub(crate) fn capture(&self) {
        if enabled() {
            *lock(&self.0) = Some((EPOCH.load(Ordering::Relaxed), now()));
        }
    }

    /// Run by a waiting task once the recording has happened: raises its stream's time.
    pub(crate) fn apply(&self) {
        if !enabled() {
            return;
        }
        if let Some((epoch, t)) = *lock(&self.0) {
            if epoch == EPOCH.load(Ordering::Relaxed) {
                raise_to(t);
            }
        }
    }
}

/// Called when a stream is destroyed: keeps its trace while the clock runs.
pub(crate) fn stream_destroyed(clock: &StreamClock) {
    if enabled() {
        let t = clock.trace();
        if !t.spans.is_empty() || t.end > 0.0 {
            lock(retired()).push(t);
        }
    }
}

/// Starts (or restarts) the clock: every stream's time is 0, traces are empty, event
/// recordings made before count as time 0. Call it with the devices idle.
pub fn start() {
    EPOCH.fetch_add(1, Ordering::Relaxed);
    lock(retired()).clear();
    for c in lock(registry()).iter().filter_map(Weak::upgrade) {
        c.reset();
    }
    ENABLED.store(true, Ordering::Relaxed);
}

/// Stops the clock (the hooks go back to doing nothing); the trace is kept until the
/// next [`start`].
pub fn stop() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Every stream's spans and end time since [`start`] (streams with neither left out),
/// ordered by device then stream. Read it with the devices idle.
pub fn trace() -> Trace {
    let mut streams: Vec<StreamTrace> = lock(retired()).clone();
    streams.extend(
        lock(registry())
            .iter()
            .filter_map(Weak::upgrade)
            .map(|c| c.trace())
            .filter(|t| !t.spans.is_empty() || t.end > 0.0),
    );
    streams.sort_by_key(|t| (t.device, t.stream));
    Trace { streams }
}

fn valid(d: f64) -> bool {
    d.is_finite() && d >= 0.0
}

/// Queues on `stream` a span of `duration` labelled `label`: when the stream reaches
/// it, its time advances by `duration`. Does nothing while the clock is off.
/// `ACL_ERROR_INVALID_PARAM` for an unknown stream or a duration that is negative or
/// not finite.
pub fn charge(stream: aclrtStream, duration: f64, label: impl FnOnce() -> String) -> aclError {
    use crate::bindings::*;
    if !enabled() {
        return ACL_SUCCESS;
    }
    let Some(s) = super::stream_of(stream) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    if !valid(duration) {
        return ACL_ERROR_INVALID_PARAM;
    }
    let label = label();
    s.enqueue(Box::new(move || {
        let t = now();
        finish(t, t + duration, label);
        ACL_SUCCESS
    }))
}

/// States the transfer costs of the next HCCL operation queued on `stream` (per item
/// of a `HcclBatchSendRecv`, in its item order; one value for the other operations)
/// and the label of its span. Does nothing while the clock is off.
/// `ACL_ERROR_INVALID_PARAM` for an unknown stream or a cost that is negative or not
/// finite.
pub fn charge_transfers(
    stream: aclrtStream,
    costs: &[f64],
    label: impl FnOnce() -> String,
) -> aclError {
    use crate::bindings::*;
    if !enabled() {
        return ACL_SUCCESS;
    }
    let Some(s) = super::stream_of(stream) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    if !costs.iter().all(|&c| valid(c)) {
        return ACL_ERROR_INVALID_PARAM;
    }
    *lock(&s.clock.pending) = Some(OpCost {
        costs: costs.to_vec(),
        label: label(),
    });
    ACL_SUCCESS
}
