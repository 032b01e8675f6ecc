//! Per-device call counters, as a profiler on the device would report them.
//!
//! Every exported `extern "C"` entry point of the emulator that does work a profiler
//! would see (HCCL operations, host<->device and device-to-device copies, host waits,
//! allocations, aclnn kernel launches) adds to the [`Counters`] of the device bound to the *calling* thread
//! (`aclrtSetDevice`'s thread-local current device). The emulator's own worker threads
//! (stream workers, the cross-process hub) never count, so a figure is the number of
//! API calls the program made, not what the emulator did to serve them.
//!
//! Invariants:
//! - only calls the emulator *accepted* count (an entry point that returns an error
//!   code counts nothing), so a counter equals the number of calls that took effect;
//! - a thread with no current device counts nothing (there is no device to charge);
//! - devices `0..MAX_DEVICES` are counted; others are ignored (`aclrtSetDevice`
//!   rejects ids past `MPIPE_ASCEND_EMU_DEVICES` anyway);
//! - [`reset`] zeroes one device's counters and forgets the threads it has seen, so
//!   `threads` counts distinct OS threads since the last reset.
//!
//! Each device has its own mutex, so ranks on different devices never contend.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;

/// How many devices are counted (ids `0..MAX_DEVICES`).
pub const MAX_DEVICES: i32 = 256;

pub use crate::profile::Counters;

#[derive(Default)]
struct Slot {
    counters: Counters,
    /// The threads that made a counted call since the last reset.
    seen: HashSet<ThreadId>,
}

fn slots() -> &'static [Mutex<Slot>] {
    static S: OnceLock<Vec<Mutex<Slot>>> = OnceLock::new();
    S.get_or_init(|| (0..MAX_DEVICES).map(|_| Mutex::default()).collect())
}

fn slot(device: i32) -> Option<&'static Mutex<Slot>> {
    usize::try_from(device).ok().and_then(|d| slots().get(d))
}

/// Applies `f` to the counters of `device` on behalf of the calling thread.
pub(crate) fn count_on(device: i32, f: impl FnOnce(&mut Counters)) {
    let Some(m) = slot(device) else {
        return;
    };
    let mut s = super::lock(m);
    f(&mut s.counters);
    if s.seen.insert(std::thread::current().id()) {
        s.counters.threads += 1;
    }
}

/// Counts a hazard for `device` (without counting the calling thread: the call that
/// found it counts the thread if it is a counted call).
pub(crate) fn count_hazard(device: i32) {
    if let Some(m) = slot(device) {
        super::lock(m).counters.hazards += 1;
    }
}

/// Applies `f` to the counters of the calling thread's current device (if any).
pub(crate) fn count(f: impl FnOnce(&mut Counters)) {
    if let Some(d) = super::current_device() {
        count_on(d, f);
    }
}

/// The counters of `device` now (all zero for a device never counted or out of range).
pub fn snapshot(device: i32) -> Counters {
    slot(device).map_or_else(Counters::default, |m| super::lock(m).counters)
}

/// Zeroes `device`'s counters, forgets the threads it has seen and clears its hazard
/// reports ([`super::hazards::reports`]).
pub fn reset(device: i32) {
    if let Some(m) = slot(device) {
        *super::lock(m) = Slot::default();
    }
    super::hazards::clear_reports(device);
}

/// The sum of the counters of `devices` (`threads` summed too: a thread that used two
/// of them counts twice).
pub fn total(devices: impl IntoIterator<Item = i32>) -> Counters {
    let mut t = Counters::default();
    for d in devices {
        t += snapshot(d);
    }
    t
}
