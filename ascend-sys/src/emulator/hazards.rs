//! A happens-before checker over streams, events and host waits: it finds accesses to
//! device memory that a real NPU could run in either order.
//!
//! Ordering is computed at *issue* time, from the order of the API calls and the
//! synchronisation they state, never from when the emulator's worker threads happen to
//! run, so a hazard is found even when this run's timing hid it.
//!
//! The model (vector clocks, one entry per *actor*: each stream and each host thread):
//! - work issued on stream `s` by host thread `h` is ordered after everything `h` knew
//!   at the call (`s` joins `h`'s clock) and after earlier work on `s` (stream order);
//!   it is one step of `s` (`s` ticks);
//! - `aclrtRecordEvent(e, s)` captures `s`'s clock (the event's latest recording wins);
//!   `aclrtStreamWaitEvent(s2, e)` joins it into `s2`;
//! - `aclrtSynchronizeStream(s)` joins `s`'s clock into the calling host thread,
//!   `aclrtSynchronizeEvent(e)` joins `e`'s captured clock;
//! - synchronous calls (`aclrtMemcpy`, `aclrtMemset`) are accesses by the host thread
//!   itself (it ticks).
//!
//! Every access to device memory (copy sources and destinations, memset, HCCL send
//! buffers and collective inputs = reads, receive buffers and collective outputs =
//! writes) is checked and recorded *per byte range* of its allocation: each range keeps
//! its last write and the reads since (the latest per actor). An access that is not
//! ordered after the last conflicting one (write-after-write, read-after-write,
//! write-after-read) is a [`Hazard`]; so is `aclrtFree` of a buffer whose last accesses
//! are not ordered before the freeing host thread ("free while in use"). Each hazard is
//! counted in `hazards` of [`super::counters`] and kept as a report ([`reports`],
//! [`hazards`]) for the device of the calling thread (or, if it has none, the device
//! the buffer was allocated on).
//!
//! Not modelled (documented limits): host memory is not tracked (only `aclrtMalloc`
//! memory); HCCL matching creates no edges, so ordering that only holds through a peer
//! (my send taken by a rank that then sends back to another of my streams) is not seen
//! and may be reported; `aclrtDestroyStream` orders nothing (the reference asks for a
//! synchronisation first); two host threads issuing to one stream at the same instant
//! are ordered as the checker saw them.
//!
//! `MPIPE_ASCEND_EMU_HAZARDS=0` turns the checker off, `=print` also prints each hazard
//! on stderr as it is found. State is one process-wide mutex; per access the cost is a
//! clock join (one entry per actor) and a range-map update.

use super::memory::{Allocation, Span};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Reports kept per device (the `hazards` counter keeps counting past it).
pub const MAX_REPORTS: usize = 1000;

type Actor = u32;

/// How an access conflicts with the earlier one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HazardKind {
    WriteAfterWrite,
    ReadAfterWrite,
    WriteAfterRead,
    /// `aclrtFree` while an access is not ordered before the freeing host thread.
    FreeWhileInUse,
}

impl fmt::Display for HazardKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HazardKind::WriteAfterWrite => "write-after-write",
            HazardKind::ReadAfterWrite => "read-after-write",
            HazardKind::WriteAfterRead => "write-after-read",
            HazardKind::FreeWhileInUse => "free while in use",
        })
    }
}

/// One unordered pair of accesses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hazard {
    /// The device it is charged to.
    pub device: i32,
    pub kind: HazardKind,
    /// The buffer: allocation number, its device address and size.
    pub allocation: u64,
    pub address: usize,
    pub size: usize,
    /// The conflicting bytes: `offset .. offset + len` of the allocation.
    pub offset: usize,
    pub len: usize,
    /// Who made the later access (e.g. `stream 0x5581.. (device 1)`,
    /// `host thread 'rank-1'`) and what it was (e.g.
    /// `HcclBatchSendRecv item 2 RECV from rank 1`, `aclrtFree`).
    pub by: String,
    pub action: String,
    /// The earlier access it is not ordered after.
    pub earlier_by: String,
    pub earlier_action: String,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {}: {} on allocation #{} ({:#x}, {} bytes), bytes {}..{}: {} on {} is not \
             ordered after {} on {} (record an event after the earlier work and wait for it, \
             or synchronize)",
            self.device,
            self.kind,
            self.allocation,
            self.address,
            self.size,
            self.offset,
            self.offset + self.len,
            self.action,
            self.by,
            self.earlier_action,
            self.earlier_by
        )
    }
}

/// Whether the checker is on (`MPIPE_ASCEND_EMU_HAZARDS` is not `0`), read once.
pub fn enabled() -> bool {
    mode() != Mode::Off
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
    Print,
}

fn mode() -> Mode {
    static M: OnceLock<Mode> = OnceLock::new();
    *M.get_or_init(
        || match std::env::var("MPIPE_ASCEND_EMU_HAZARDS").as_deref() {
            Ok("0") | Ok("off") => Mode::Off,
            Ok("print") => Mode::Print,
            _ => Mode::On,
        },
    )
}

/// The hazards found for `device` (at most [`MAX_REPORTS`], oldest first), cleared by
/// [`super::counters::reset`].
pub fn reports(device: i32) -> Vec<Hazard> {
    checker().reports.get(&device).cloned().unwrap_or_default()
}

/// [`reports`] as text, one line per hazard.
pub fn hazards(device: i32) -> Vec<String> {
    reports(device).iter().map(ToString::to_string).collect()
}

pub(crate) fn clear_reports(device: i32) {
    checker().reports.remove(&device);
}

// ------------------------------------------------------------------ clocks

#[derive(Clone, Default)]
struct Clock(Vec<u32>);

impl Clock {
    fn get(&self, a: Actor) -> u32 {
        self.0.get(a as usize).copied().unwrap_or(0)
    }

    fn tick(&mut self, a: Actor) -> u32 {
        let i = a as usize;
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] += 1;
        self.0[i]
    }

    fn join(&mut self, o: &Clock) {
        if self.0.len() < o.0.len() {
            self.0.resize(o.0.len(), 0);
        }
        for (x, &y) in self.0.iter_mut().zip(&o.0) {
            *x = (*x).max(y);
        }
    }
}

// ------------------------------------------------------------------ accesses

/// What an access was, formatted only when reported.
pub(crate) struct Action {
    pub(crate) call: &'static str,
    /// Index of a batch item.
    pub(crate) item: Option<u32>,
    /// `source`, `destination`, `SEND to`, `RECV from`, `input`, `output`, ...
    pub(crate) role: &'static str,
    pub(crate) peer: Option<u32>,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.call)?;
        if let Some(i) = self.item {
            write!(f, " item {i}")?;
        }
        if !self.role.is_empty() {
            write!(f, " {}", self.role)?;
        }
        if let Some(p) = self.peer {
            write!(f, " rank {p}")?;
        }
        Ok(())
    }
}

/// One use of memory by a call: the span, whether it writes, and what it is.
pub(crate) struct Use<'a> {
    pub(crate) span: &'a Span,
    pub(crate) write: bool,
    pub(crate) action: Action,
}

impl<'a> Use<'a> {
    pub(crate) fn read(span: &'a Span, call: &'static str, role: &'static str) -> Use<'a> {
        Use {
            span,
            write: false,
            action: Action {
                call,
                item: None,
                role,
                peer: None,
            },
        }
    }

    pub(crate) fn write(span: &'a Span, call: &'static str, role: &'static str) -> Use<'a> {
        Use {
            write: true,
            ..Use::read(span, call, role)
        }
    }

    pub(crate) fn peer(mut self, peer: u32) -> Use<'a> {
        self.action.peer = Some(peer);
        self
    }

    pub(crate) fn item(mut self, item: u32) -> Use<'a> {
        self.action.item = Some(item);
        self
    }
}

#[derive(Clone)]
struct Access {
    actor: Actor,
    clock: u32,
    action: Arc<Action>,
}

/// The history of one byte range `[start, end)` (start is the map key).
#[derive(Clone)]
struct Segment {
    end: usize,
    write: Option<Access>,
    /// Reads since `write`, the latest per actor.
    reads: Vec<Access>,
}

type Shadow = BTreeMap<usize, Segment>;

/// Splits the segment containing `at` (if any) so that one starts there.
fn split(map: &mut Shadow, at: usize) {
    let Some((&s, seg)) = map.range_mut(..at).next_back() else {
        return;
    };
    if seg.end > at {
        let tail = Segment {
            end: seg.end,
            ..seg.clone()
        };
        seg.end = at;
        debug_assert!(s < at);
        map.insert(at, tail);
    }
}

/// An earlier access found unordered, with the bytes where it conflicts.
struct Conflict {
    kind: HazardKind,
    earlier: Access,
    start: usize,
    end: usize,
}

fn note(
    conflicts: &mut Vec<Conflict>,
    kind: HazardKind,
    earlier: &Access,
    start: usize,
    end: usize,
) {
    match conflicts
        .iter_mut()
        .find(|c| c.earlier.actor == earlier.actor && c.earlier.clock == earlier.clock)
    {
        Some(c) => {
            c.start = c.start.min(start);
            c.end = c.end.max(end);
        }
        None => conflicts.push(Conflict {
            kind,
            earlier: earlier.clone(),
            start,
            end,
        }),
    }
}

/// Checks and records an access to `[start, end)` by `acc` whose actor's clock is
/// `now`; returns the earlier accesses it is not ordered after.
fn access(
    map: &mut Shadow,
    start: usize,
    end: usize,
    acc: &Access,
    write: bool,
    now: &Clock,
) -> Vec<Conflict> {
    let ordered = |x: &Access| x.actor == acc.actor || now.get(x.actor) >= x.clock;
    let mut conflicts = Vec::new();
    split(map, start);
    split(map, end);
    let mut gaps = Vec::new();
    let mut pos = start;
    for (&s, seg) in map.range_mut(start..end) {
        if s > pos {
            gaps.push((pos, s));
        }
        if let Some(w) = &seg.write {
            if !ordered(w) {
                let kind = if write {
                    HazardKind::WriteAfterWrite
                } else {
                    HazardKind::ReadAfterWrite
                };
                note(&mut conflicts, kind, w, s, seg.end);
            }
        }
        if write {
            for r in seg.reads.iter().filter(|r| !ordered(r)) {
                note(&mut conflicts, HazardKind::WriteAfterRead, r, s, seg.end);
            }
        } else {
            seg.reads.retain(|r| r.actor != acc.actor);
            seg.reads.push(acc.clone());
        }
        pos = seg.end;
    }
    if pos < end {
        gaps.push((pos, end));
    }
    if write {
        let keys: Vec<usize> = map.range(start..end).map(|(&k, _)| k).collect();
        for k in keys {
            map.remove(&k);
        }
        map.insert(
            start,
            Segment {
                end,
                write: Some(acc.clone()),
                reads: Vec::new(),
            },
        );
    } else {
        for (s, e) in gaps {
            map.insert(
                s,
                Segment {
                    end: e,
                    write: None,
                    reads: vec![acc.clone()],
                },
            );
        }
    }
    conflicts
}

// ------------------------------------------------------------------ the checker

#[derive(Default)]
struct Checker {
    /// Per actor: its name and its clock.
    names: Vec<String>,
    clocks: Vec<Clock>,
    streams: HashMap<usize, Actor>,
    /// Per event: the clock its latest recording captured.
    events: HashMap<usize, Clock>,
    /// Per allocation id: its access history.
    shadows: HashMap<u64, Shadow>,
    reports: HashMap<i32, Vec<Hazard>>,
}

fn checker() -> MutexGuard<'static, Checker> {
    static C: OnceLock<Mutex<Checker>> = OnceLock::new();
    super::lock(C.get_or_init(Default::default))
}

thread_local! {
    static HOST_ACTOR: Cell<Option<Actor>> = const { Cell::new(None) };
}

impl Checker {
    fn new_actor(&mut self, name: String) -> Actor {
        let a = self.names.len() as Actor;
        self.names.push(name);
        self.clocks.push(Clock::default());
        a
    }

    /// The calling host thread's actor.
    fn host(&mut self) -> Actor {
        if let Some(a) = HOST_ACTOR.with(Cell::get) {
            return a;
        }
        let t = std::thread::current();
        let name = match t.name() {
            Some(n) => format!("host thread '{n}'"),
            None => format!("host thread {:?}", t.id()),
        };
        let a = self.new_actor(name);
        HOST_ACTOR.with(|c| c.set(Some(a)));
        a
    }

    fn stream(&mut self, handle: usize) -> Actor {
        if let Some(&a) = self.streams.get(&handle) {
            return a;
        }
        let a = self.new_actor(stream_name(handle, super::current_device()));
        self.streams.insert(handle, a);
        a
    }

    /// Records `uses` by `actor` at `clock`, whose current clock is the actor's.
    fn uses(&mut self, actor: Actor, clock: u32, uses: Vec<Use<'_>>) {
        for u in uses {
            let Some(alloc) = &u.span.alloc else {
                continue;
            };
            if u.span.len == 0 {
                continue;
            }
            let acc = Access {
                actor,
                clock,
                action: Arc::new(u.action),
            };
            let start = u.span.offset;
            let end = start + u.span.len;
            let now = &self.clocks[actor as usize];
            let map = self.shadows.entry(alloc.id).or_default();
            let conflicts = access(map, start, end, &acc, u.write, now);
            for c in conflicts {
                self.report(alloc, &acc, c);
            }
        }
    }

    fn report(&mut self, alloc: &Allocation, later: &Access, c: Conflict) {
        let device = super::current_device().or(alloc.device).unwrap_or(-1);
        let h = Hazard {
            device,
            kind: c.kind,
            allocation: alloc.id,
            address: alloc.base,
            size: alloc.size,
            offset: c.start,
            len: c.end - c.start,
            by: self.names[later.actor as usize].clone(),
            action: later.action.to_string(),
            earlier_by: self.names[c.earlier.actor as usize].clone(),
            earlier_action: c.earlier.action.to_string(),
        };
        if mode() == Mode::Print {
            eprintln!("ascend-sys emulator: hazard: {h}");
        }
        super::counters::count_hazard(device);
        let list = self.reports.entry(device).or_default();
        if list.len() < MAX_REPORTS {
            list.push(h);
        }
    }
}

fn stream_name(handle: usize, device: Option<i32>) -> String {
    match device {
        Some(d) => format!("stream {handle:#x} (device {d})"),
        None => format!("stream {handle:#x}"),
    }
}

// ------------------------------------------------------------------ hooks

/// `aclrtCreateStream`: a new actor (a handle reused after a destroy is a new stream).
pub(crate) fn stream_created(handle: usize) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let a = c.new_actor(stream_name(handle, super::current_device()));
    c.streams.insert(handle, a);
}

/// `aclrtDestroyStream`: forgets the handle (its actor's accesses stay recorded).
pub(crate) fn stream_destroyed(handle: usize) {
    if enabled() {
        checker().streams.remove(&handle);
    }
}

/// Work issued on `stream` by the calling host thread, using `uses`.
pub(crate) fn on_stream(stream: usize, uses: Vec<Use<'_>>) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let s = c.stream(stream);
    let host_clock = std::mem::take(&mut c.clocks[h as usize]);
    let clock = {
        let sc = &mut c.clocks[s as usize];
        sc.join(&host_clock);
        sc.tick(s)
    };
    c.clocks[h as usize] = host_clock;
    c.uses(s, clock, uses);
}

/// A synchronous access by the calling host thread.
pub(crate) fn on_host(uses: Vec<Use<'_>>) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let clock = c.clocks[h as usize].tick(h);
    c.uses(h, clock, uses);
}

/// `aclrtRecordEvent(event, stream)`.
pub(crate) fn record(event: usize, stream: usize) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let s = c.stream(stream);
    let host_clock = c.clocks[h as usize].clone();
    c.clocks[s as usize].join(&host_clock);
    let captured = c.clocks[s as usize].clone();
    c.events.insert(event, captured);
}

/// `aclrtStreamWaitEvent(stream, event)`.
pub(crate) fn wait(stream: usize, event: usize) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let s = c.stream(stream);
    let mut add = c.clocks[h as usize].clone();
    if let Some(e) = c.events.get(&event) {
        add.join(e);
    }
    c.clocks[s as usize].join(&add);
}

/// `aclrtSynchronizeStream(stream)`: the host thread now knows all of it.
pub(crate) fn host_syncs_stream(stream: usize) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let s = c.stream(stream);
    let sc = c.clocks[s as usize].clone();
    c.clocks[h as usize].join(&sc);
}

/// `aclrtSynchronizeEvent(event)`.
pub(crate) fn host_syncs_event(event: usize) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    if let Some(e) = c.events.get(&event).cloned() {
        c.clocks[h as usize].join(&e);
    }
}

/// `aclrtDestroyEvent`.
pub(crate) fn event_destroyed(event: usize) {
    if enabled() {
        checker().events.remove(&event);
    }
}

/// `aclrtFree(alloc)` by the calling host thread: every recorded access must be
/// ordered before it.
pub(crate) fn freed(alloc: &Allocation) {
    if !enabled() {
        return;
    }
    let mut c = checker();
    let h = c.host();
    let Some(map) = c.shadows.remove(&alloc.id) else {
        return;
    };
    let now = c.clocks[h as usize].clone();
    let ordered = |x: &Access| x.actor == h || now.get(x.actor) >= x.clock;
    let mut conflicts = Vec::new();
    for (&s, seg) in &map {
        for x in seg.write.iter().chain(&seg.reads) {
            if !ordered(x) {
                note(&mut conflicts, HazardKind::FreeWhileInUse, x, s, seg.end);
            }
        }
    }
    let acc = Access {
        actor: h,
        clock: now.get(h),
        action: Arc::new(Action {
            call: "aclrtFree",
            item: None,
            role: "",
            peer: None,
        }),
    };
    for k in conflicts {
        c.report(alloc, &acc, k);
    }
}
