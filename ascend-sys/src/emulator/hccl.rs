//! HCCL's rendezvous engine: communicators joined through the root info, send and
//! receive as rendezvous (the sender's stream waits until the receiver takes the data),
//! batches, collectives with real reductions, and a deadlock report on timeout
//! (`MPIPE_ASCEND_EMU_TIMEOUT_MS`, default 20000).
//!
//! **Dead ranks.** A rank in another process whose connection to the group closes
//! without `HcclCommDestroy` (its process ended or was killed), or that [`abandon`]s
//! its communicator, is *gone*: the communicator is broken, every operation of it
//! pending or later (with the gone rank or not: live ranks usually wait for work the
//! failure cut short) fails at once with `HCCL_E_REMOTE`, instead of waiting for the
//! timeout; standard error says which rank is gone, and [`departed_rank`] names the
//! first gone to the communicator's owners.
//!
//! A group lives in the process that made its root info. Ranks that are threads of
//! that process operate on it directly; ranks in other processes reach it through
//! [`super::hub`], whose serving threads call the same [`Group`] methods for them.

use super::clock;
use super::counters;
use super::hazards::{self, Use};
use super::hub::{self, Aligned, Remote};
use super::memory::{self, MemError, Span};
use super::{lock, stream_of};
use crate::bindings::*;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_void};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub(super) const MAGIC: &[u8; 8] = b"MPIPEEMU";

/// Root info layout: `MAGIC`, group id (`u64`, the making process's id in the high
/// half), then the serving address as a NUL-terminated string (empty: threads only).
const ADDR_AT: usize = 16;

pub(super) fn timeout() -> Duration {
    let ms = std::env::var("MPIPE_ASCEND_EMU_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    Duration::from_millis(ms.unwrap_or(20_000))
}

/// The slot a receiver fills for a posted send: its result, and (as `f64` bits) the
/// virtual time the transfer completed at ([`super::clock`]), written before the result.
type Taken = Arc<(Mutex<Option<HcclResult>>, Condvar, AtomicU64)>;

/// A posted send, waiting for its receiver.
struct Post {
    src: usize,
    bytes: usize,
    /// Set by the receiver once it has copied the data.
    taken: Taken,
    /// The sender's virtual start time and the transfer cost it charged.
    at: f64,
    cost: f64,
}

/// An operation's virtual timing on one rank ([`super::clock`]): its start (its
/// stream's time), and the transfer cost of each send and each receive (for a
/// collective, `sends[0]`); missing costs are 0. All zero while the clock is off.
#[derive(Default)]
pub(super) struct OpTime {
    pub(super) start: f64,
    pub(super) sends: Vec<f64>,
    pub(super) recvs: Vec<f64>,
}

impl OpTime {
    fn send(&self, i: usize) -> f64 {
        self.sends.get(i).copied().unwrap_or(0.0)
    }

    fn recv(&self, i: usize) -> f64 {
        self.recvs.get(i).copied().unwrap_or(0.0)
    }

    /// Without the peers' clocks (a rank in another process): this side's start plus
    /// its largest cost.
    fn alone(&self) -> f64 {
        self.sends
            .iter()
            .chain(&self.recvs)
            .fold(self.start, |t, &c| t.max(self.start + c))
    }
}

#[derive(Default)]
struct Collective {
    generation: u64,
    arrived: Vec<Option<(usize, usize)>>,
    /// Virtual clock ([`super::clock`]): the latest start and largest cost of this
    /// generation's arrivals, and the last completed generation's completion.
    latest: f64,
    cost: f64,
    done: f64,
}

pub(super) struct Group {
    pub(super) size: u32,
    joined: Mutex<u32>,
    /// Open connections of ranks in other processes.
    remote_lanes: Mutex<u32>,
    remote_closed: Condvar,
    /// (src, dst) -> sends posted in order.
    posts: Mutex<HashMap<(u32, u32), VecDeque<Post>>>,
    posted: Condvar,
    collective: Mutex<Collective>,
    collective_done: Condvar,
    /// Ranks found gone (their process's connection closed), in the order found.
    gone: Mutex<Vec<u32>>,
    /// rank -> the peer its first timed-out operation waited for ([`stalled_peer`]).
    stalled: Mutex<HashMap<u32, u32>>,
}

/// How a rank reaches its group.
enum Link {
    /// The group is in this process.
    Local(Arc<Group>),
    /// The group is served by another process.
    Remote(Remote),
}

struct Comm {
    link: Link,
    size: u32,
    rank: u32,
    async_error: Mutex<HcclResult>,
    /// The first rank this communicator's work found gone ([`departed_rank`]).
    departed: Mutex<Option<u32>>,
    /// The peer this communicator's first timed-out operation waited for
    /// ([`stalled_peer`]).
    stalled: Mutex<Option<u32>>,
}

/// Each returns the result and the operation's virtual completion time.
impl Comm {
    fn send(&self, peer: u32, addr: usize, bytes: usize, t: &OpTime) -> (HcclResult, f64) {
        match &self.link {
            Link::Local(g) => g.send_timed(self.rank, peer, addr, bytes, t),
            Link::Remote(r) => (r.send(peer, addr, bytes), t.alone()),
        }
    }

    fn receive(&self, peer: u32, addr: usize, bytes: usize, t: &OpTime) -> (HcclResult, f64) {
        match &self.link {
            Link::Local(g) => g.receive_timed(peer, self.rank, addr, bytes, t),
            Link::Remote(r) => (r.receive(peer, addr, bytes), t.alone()),
        }
    }

    fn batch(
        &self,
        sends: &[(u32, usize, usize)],
        recvs: &[(u32, usize, usize)],
        t: &OpTime,
    ) -> (HcclResult, f64) {
        match &self.link {
            Link::Local(g) => g.batch_timed(self.rank, sends, recvs, t),
            Link::Remote(r) => (r.batch(sends, recvs), t.alone()),
        }
    }

    fn collective(
        &self,
        coll: CollOp,
        input: usize,
        output: usize,
        t: &OpTime,
    ) -> (HcclResult, f64) {
        match &self.link {
            Link::Local(g) => coll.run_timed(g, self.rank, input, output, t),
            Link::Remote(r) => (r.collective(coll, input, output), t.alone()),
        }
    }
}

/// The group `id`, made with `n_ranks` ranks by the first rank to join (`join`), or
/// only looked up (another lane of a rank already joined).
pub(super) fn join_group(id: u64, n_ranks: u32, join: bool) -> Result<Arc<Group>, HcclResult> {
    let mut g = lock(groups());
    if !join {
        return g.get(&id).cloned().ok_or(HcclResult::HCCL_E_PARA);
    }
    let group = g.entry(id).or_insert_with(|| {
        Arc::new(Group {
            size: n_ranks,
            joined: Mutex::new(0),
            remote_lanes: Mutex::new(0),
            remote_closed: Condvar::new(),
            posts: Mutex::default(),
            posted: Condvar::new(),
            collective: Mutex::default(),
            collective_done: Condvar::new(),
            gone: Mutex::default(),
            stalled: Mutex::default(),
        })
    });
    if group.size != n_ranks {
        return Err(HcclResult::HCCL_E_PARA);
    }
    *lock(&group.joined) += 1;
    Ok(Arc::clone(group))
}

/// A collective operation, as both the in-process ranks and the wire describe it.
#[derive(Clone, Copy, Debug)]
pub(super) enum CollOp {
    AllReduce {
        t: HcclDataType,
        op: HcclReduceOp,
        count: usize,
    },
    Reduce {
        t: HcclDataType,
        op: HcclReduceOp,
        count: usize,
        root: u32,
    },
    Broadcast {
        t: HcclDataType,
        count: usize,
        root: u32,
    },
    Barrier,
}

impl CollOp {
    fn elements(&self) -> usize {
        match *self {
            CollOp::AllReduce { t, count, .. }
            | CollOp::Reduce { t, count, .. }
            | CollOp::Broadcast { t, count, .. } => count * element_size(t).unwrap_or(0),
            CollOp::Barrier => 0,
        }
    }

    /// Bytes of one rank's input.
    pub(super) fn input_bytes(&self) -> usize {
        self.elements()
    }

    /// Bytes of one rank's output.
    pub(super) fn output_bytes(&self) -> usize {
        self.elements()
    }

    /// Whether input and output are the same buffer.
    pub(super) fn in_place(&self) -> bool {
        matches!(self, CollOp::Broadcast { .. })
    }

    pub(super) fn root(&self) -> u32 {
        match *self {
            CollOp::Reduce { root, .. } | CollOp::Broadcast { root, .. } => root,
            _ => 0,
        }
    }

    /// Whether the operation writes `rank`'s output.
    pub(super) fn writes(&self, rank: u32) -> bool {
        match *self {
            CollOp::AllReduce { .. } => true,
            CollOp::Reduce { root, .. } => rank == root,
            CollOp::Broadcast { root, .. } => rank != root,
            CollOp::Barrier => false,
        }
    }

    /// Runs the operation for `rank` of `group` (blocking until every rank arrives).
    pub(super) fn run(&self, group: &Group, rank: u32, input: usize, output: usize) -> HcclResult {
        self.run_timed(group, rank, input, output, &OpTime::default())
            .0
    }

    /// [`CollOp::run`] with this rank's virtual timing; also returns the completion time.
    fn run_timed(
        &self,
        group: &Group,
        rank: u32,
        input: usize,
        output: usize,
        time: &OpTime,
    ) -> (HcclResult, f64) {
        let at = (time.start, time.send(0));
        match *self {
            CollOp::AllReduce { t, op, count } => {
                group.collective(rank, (input, output), at, reduce_op(t, op, count, None))
            }
            CollOp::Reduce { t, op, count, root } => group.collective(
                rank,
                (input, output),
                at,
                reduce_op(t, op, count, Some(root)),
            ),
            CollOp::Broadcast { root, .. } => {
                let bytes = self.elements();
                group.collective(rank, (input, input), at, move |all| {
                    let src = all[root as usize].0;
                    for (r, &(_, dst)) in all.iter().enumerate() {
                        if r != root as usize {
                            // SAFETY: every rank's buffer holds `bytes` and its rank is
                            // blocked in this collective.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    src as *const u8,
                                    dst as *mut u8,
                                    bytes,
                                )
                            };
                        }
                    }
                })
            }
            CollOp::Barrier => group.collective(rank, (0, 0), at, |_| {}),
        }
    }
}

fn groups() -> &'static Mutex<HashMap<u64, Arc<Group>>> {
    static G: OnceLock<Mutex<HashMap<u64, Arc<Group>>>> = OnceLock::new();
    G.get_or_init(Default::default)
}

fn comms() -> &'static Mutex<HashMap<usize, Arc<Comm>>> {
    static C: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn comm_of(handle: HcclComm) -> Option<Arc<Comm>> {
    lock(comms()).get(&(handle as usize)).cloned()
}

pub(super) fn element_size(t: HcclDataType) -> Option<usize> {
    Some(match t {
        HcclDataType::HCCL_DATA_TYPE_INT8 | HcclDataType::HCCL_DATA_TYPE_UINT8 => 1,
        HcclDataType::HCCL_DATA_TYPE_INT16
        | HcclDataType::HCCL_DATA_TYPE_UINT16
        | HcclDataType::HCCL_DATA_TYPE_FP16
        | HcclDataType::HCCL_DATA_TYPE_BFP16 => 2,
        HcclDataType::HCCL_DATA_TYPE_INT32
        | HcclDataType::HCCL_DATA_TYPE_UINT32
        | HcclDataType::HCCL_DATA_TYPE_FP32 => 4,
        HcclDataType::HCCL_DATA_TYPE_INT64
        | HcclDataType::HCCL_DATA_TYPE_UINT64
        | HcclDataType::HCCL_DATA_TYPE_FP64 => 8,
        _ => return None,
    })
}

fn record(comm: &Comm, rc: HcclResult) -> aclError {
    if rc == HcclResult::HCCL_SUCCESS {
        return ACL_SUCCESS;
    }
    if rc == HcclResult::HCCL_E_REMOTE && lock(&comm.departed).is_none() {
        let gone = match &comm.link {
            Link::Local(g) => g.first_gone(),
            Link::Remote(r) => r.first_gone(),
        };
        let mut d = lock(&comm.departed);
        if d.is_none() {
            *d = gone;
        }
    }
    if rc == HcclResult::HCCL_E_TIMEOUT && lock(&comm.stalled).is_none() {
        let peer = match &comm.link {
            Link::Local(g) => g.stalled_peer(comm.rank),
            Link::Remote(r) => r.stalled_peer(),
        };
        let mut s = lock(&comm.stalled);
        if s.is_none() {
            *s = peer;
        }
    }
    let mut e = lock(&comm.async_error);
    if *e == HcclResult::HCCL_SUCCESS {
        *e = rc;
    }
    ACL_ERROR_RT_INTERNAL_ERROR
}

impl Group {
    pub(super) fn remote_opened(&self) {
        *lock(&self.remote_lanes) += 1;
    }

    pub(super) fn remote_closed(&self) {
        *lock(&self.remote_lanes) -= 1;
        self.remote_closed.notify_all();
    }

    /// Rank `rank` is gone (a connection of its process closed without
    /// `HcclCommDestroy`, or it [`abandon`]ed its communicator; `why` says which):
    /// every send posted to or by it is failed with `HCCL_E_REMOTE`, and every waiter
    /// is woken to find out.
    pub(super) fn mark_gone(&self, rank: u32, why: &str) {
        {
            let mut gone = lock(&self.gone);
            if gone.contains(&rank) {
                return;
            }
            gone.push(rank);
        }
        eprintln!(
            "ascend-sys emulator: rank {rank} is gone: {why}; every operation with rank \
             {rank} fails (HCCL_E_REMOTE)"
        );
        // Set before the locks below are taken: a waiter checks `gone` under the lock
        // it waits with, so it either sees the mark or is woken after it.
        // The whole communicator fails, not only the operations with `rank`: ranks
        // that talk only to each other are usually waiting for work the failure cut
        // short (a pipeline's later batches), and would otherwise wait for the
        // timeout. (As a communicator aborted on a member's death does.)
        let mut posts = lock(&self.posts);
        for q in posts.values_mut() {
            for p in q.drain(..) {
                *lock(&p.taken.0) = Some(HcclResult::HCCL_E_REMOTE);
                p.taken.1.notify_all();
            }
        }
        self.posted.notify_all();
        drop(posts);
        let _c = lock(&self.collective);
        self.collective_done.notify_all();
    }

    /// Notes that `rank`'s operation timed out waiting for `peer` (the first such
    /// note of `rank` is kept).
    fn note_stalled(&self, rank: u32, peer: u32) {
        lock(&self.stalled).entry(rank).or_insert(peer);
    }

    /// The peer `rank`'s first timed-out operation waited for, if one timed out.
    pub(super) fn stalled_peer(&self, rank: u32) -> Option<u32> {
        lock(&self.stalled).get(&rank).copied()
    }

    /// The first rank found gone, if any.
    pub(super) fn first_gone(&self) -> Option<u32> {
        lock(&self.gone).first().copied()
    }

    /// Every rank found gone, in the order found.
    pub(super) fn gone_ranks(&self) -> Vec<u32> {
        lock(&self.gone).clone()
    }

    /// The first of `ranks` that is gone.
    fn gone_among(&self, ranks: impl IntoIterator<Item = u32>) -> Option<u32> {
        let gone = lock(&self.gone);
        ranks.into_iter().find(|r| gone.contains(r))
    }

    /// Says on standard error that `rank`'s `what` failed because `gone` is gone,
    /// unless `rank` is the gone one itself; returns `HCCL_E_REMOTE`.
    fn gone_error(&self, rank: u32, what: &str, gone: u32) -> HcclResult {
        if self.gone_among([rank]).is_none() {
            eprintln!(
                "ascend-sys emulator: rank {rank}'s {what} failed: rank {gone} is gone (its \
                 process ended or was killed) (HCCL_E_REMOTE)"
            );
        }
        HcclResult::HCCL_E_REMOTE
    }

    /// Waits (up to the timeout) until no rank of another process is connected, so
    /// that this process does not exit under a reply the group still owes.
    fn await_remote_lanes(&self) {
        let deadline = Instant::now() + timeout();
        let mut open = lock(&self.remote_lanes);
        while *open > 0 {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            open = self
                .remote_closed
                .wait_timeout(open, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// An unbatched send: posts it and waits for the receiver.
    pub(super) fn send(&self, src: u32, dst: u32, ptr: usize, bytes: usize) -> HcclResult {
        self.send_timed(src, dst, ptr, bytes, &OpTime::default()).0
    }

    /// [`Group::send`] with the sender's virtual timing; also returns its completion.
    fn send_timed(
        &self,
        src: u32,
        dst: u32,
        ptr: usize,
        bytes: usize,
        t: &OpTime,
    ) -> (HcclResult, f64) {
        let taken = self.post(src, dst, ptr, bytes, t.start, t.send(0));
        let rc = self.await_taken(src, dst, &taken);
        let done = f64::from_bits(taken.2.load(Ordering::Acquire)).max(t.start);
        if rc == HcclResult::HCCL_E_REMOTE {
            let gone = self.first_gone().unwrap_or(dst);
            return (
                self.gone_error(src, &format!("HcclSend to rank {dst}"), gone),
                done,
            );
        }
        (rc, done)
    }

    /// A batch of `rank`: posts every send, then takes the receives in whatever order
    /// their senders post (all of them are posted together, as HCCL's are: a receive
    /// never waits behind another one of the batch), then waits for the sends to be
    /// taken. Items are (peer, address, length).
    pub(super) fn batch(
        &self,
        rank: u32,
        sends: &[(u32, usize, usize)],
        recvs: &[(u32, usize, usize)],
    ) -> HcclResult {
        self.batch_timed(rank, sends, recvs, &OpTime::default()).0
    }

    /// [`Group::batch`] with `rank`'s virtual timing; also returns the batch's
    /// completion (its last item's).
    fn batch_timed(
        &self,
        rank: u32,
        sends: &[(u32, usize, usize)],
        recvs: &[(u32, usize, usize)],
        t: &OpTime,
    ) -> (HcclResult, f64) {
        let posted: Vec<_> = sends
            .iter()
            .enumerate()
            .map(|(i, &(peer, ptr, bytes))| {
                (peer, self.post(rank, peer, ptr, bytes, t.start, t.send(i)))
            })
            .collect();
        let (mut rc, mut done) = self.receive_all(rank, recvs, t);
        if rc == HcclResult::HCCL_E_REMOTE {
            // A peer is gone: the batch cannot complete; withdraw the sends nobody
            // took rather than wait for them.
            for (peer, taken) in &posted {
                self.withdraw(rank, *peer, taken);
            }
        }
        for (peer, taken) in &posted {
            let r = self.await_taken(rank, *peer, taken);
            done = done.max(f64::from_bits(taken.2.load(Ordering::Acquire)));
            if rc == HcclResult::HCCL_SUCCESS {
                rc = r;
                if r == HcclResult::HCCL_E_REMOTE {
                    let gone = self.first_gone().unwrap_or(*peer);
                    let what = format!("HcclBatchSendRecv (sending to rank {peer})");
                    self.gone_error(rank, &what, gone);
                }
            }
        }
        (rc, done)
    }

    /// Takes every receive `(src, address, length)` of `dst`, each as soon as its
    /// sender has posted; the first failure is the result, with the latest virtual
    /// completion of the receives.
    fn receive_all(
        &self,
        dst: u32,
        recvs: &[(u32, usize, usize)],
        t: &OpTime,
    ) -> (HcclResult, f64) {
        let deadline = Instant::now() + timeout();
        let mut pending: Vec<(usize, (u32, usize, usize))> =
            recvs.iter().copied().enumerate().collect();
        let mut rc = HcclResult::HCCL_SUCCESS;
        let mut done = t.start;
        let mut posts = lock(&self.posts);
        while !pending.is_empty() {
            if let Some(gone) = self.first_gone() {
                let from: Vec<String> = pending.iter().map(|p| p.1 .0.to_string()).collect();
                let what = format!(
                    "HcclBatchSendRecv (receiving from rank {})",
                    from.join(", ")
                );
                return (self.gone_error(dst, &what, gone), done);
            }
            let ready = pending.iter().position(|&(_, (src, _, _))| {
                posts.get(&(src, dst)).is_some_and(|q| !q.is_empty())
            });
            if let Some(i) = ready {
                let (k, (src, ptr, bytes)) = pending.remove(i);
                let p = posts
                    .get_mut(&(src, dst))
                    .and_then(|q| q.pop_front())
                    .expect("checked non-empty under the lock");
                drop(posts);
                let (r, at) = deliver(p, src, dst, ptr, bytes, (t.start, t.recv(k)));
                done = done.max(at);
                if rc == HcclResult::HCCL_SUCCESS {
                    rc = r;
                }
                posts = lock(&self.posts);
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                if let Some(&(_, (src, _, _))) = pending.first() {
                    self.note_stalled(dst, src);
                }
                for &(_, (src, _, _)) in &pending {
                    eprintln!(
                        "ascend-sys emulator: deadlock: rank {dst}'s HcclRecv from rank {src} \
                         found no matching HcclSend within {:?} (HCCL_E_TIMEOUT)",
                        timeout()
                    );
                }
                return (HcclResult::HCCL_E_TIMEOUT, done);
            }
            posts = self
                .posted
                .wait_timeout(posts, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        (rc, done)
    }

    /// Posts a send; returns the slot the receiver fills.
    fn post(&self, src: u32, dst: u32, ptr: usize, bytes: usize, at: f64, cost: f64) -> Taken {
        let taken = Arc::new((Mutex::new(None), Condvar::new(), AtomicU64::new(0)));
        let mut posts = lock(&self.posts);
        if self.first_gone().is_some() {
            // Never posted: it fails as soon as it is awaited.
            *lock(&taken.0) = Some(HcclResult::HCCL_E_REMOTE);
            return taken;
        }
        posts.entry((src, dst)).or_default().push_back(Post {
            src: ptr,
            bytes,
            taken: Arc::clone(&taken),
            at,
            cost,
        });
        self.posted.notify_all();
        taken
    }

    /// Withdraws a posted send not yet taken, failing it with `HCCL_E_REMOTE` (one
    /// taken meanwhile is left to complete).
    fn withdraw(&self, src: u32, dst: u32, taken: &Taken) {
        let mut posts = lock(&self.posts);
        if let Some(q) = posts.get_mut(&(src, dst)) {
            if let Some(i) = q.iter().position(|p| Arc::ptr_eq(&p.taken, taken)) {
                q.remove(i);
                *lock(&taken.0) = Some(HcclResult::HCCL_E_REMOTE);
            }
        }
    }

    /// Waits for the receiver of a posted send; on timeout withdraws it and reports.
    fn await_taken(&self, src: u32, dst: u32, taken: &Taken) -> HcclResult {
        let deadline = Instant::now() + timeout();
        let mut slot = lock(&taken.0);
        while slot.is_none() {
            let now = Instant::now();
            if now >= deadline {
                drop(slot);
                let mut posts = lock(&self.posts);
                let q = posts.entry((src, dst)).or_default();
                if let Some(i) = q.iter().position(|p| Arc::ptr_eq(&p.taken, taken)) {
                    q.remove(i);
                    self.note_stalled(src, dst);
                    eprintln!(
                        "ascend-sys emulator: deadlock: rank {src}'s HcclSend to rank {dst} found no \
                         matching HcclRecv within {:?} (HCCL_E_TIMEOUT)",
                        timeout()
                    );
                    return HcclResult::HCCL_E_TIMEOUT;
                }
                // Taken meanwhile: wait for the receiver to finish copying.
                slot = lock(&taken.0);
                continue;
            }
            slot = taken
                .1
                .wait_timeout(slot, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        slot.expect("set")
    }

    /// Takes the oldest send from `src` to `dst` and copies it into `dst_ptr`.
    pub(super) fn receive(&self, src: u32, dst: u32, dst_ptr: usize, bytes: usize) -> HcclResult {
        self.receive_timed(src, dst, dst_ptr, bytes, &OpTime::default())
            .0
    }

    /// [`Group::receive`] with the receiver's virtual timing; also returns its
    /// completion.
    fn receive_timed(
        &self,
        src: u32,
        dst: u32,
        dst_ptr: usize,
        bytes: usize,
        t: &OpTime,
    ) -> (HcclResult, f64) {
        let deadline = Instant::now() + timeout();
        let mut posts = lock(&self.posts);
        loop {
            if let Some(gone) = self.first_gone() {
                let rc = self.gone_error(dst, &format!("HcclRecv from rank {src}"), gone);
                return (rc, t.start);
            }
            if let Some(p) = posts.get_mut(&(src, dst)).and_then(|q| q.pop_front()) {
                drop(posts);
                return deliver(p, src, dst, dst_ptr, bytes, (t.start, t.recv(0)));
            }
            let now = Instant::now();
            if now >= deadline {
                self.note_stalled(dst, src);
                eprintln!(
                    "ascend-sys emulator: deadlock: rank {dst}'s HcclRecv from rank {src} found no \
                     matching HcclSend within {:?} (HCCL_E_TIMEOUT)",
                    timeout()
                );
                return (HcclResult::HCCL_E_TIMEOUT, t.start);
            }
            posts = self
                .posted
                .wait_timeout(posts, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Every rank arrives with (send, recv) buffers and its virtual (start, cost); the
    /// last one runs `op` over all of them while the others wait, so every buffer is
    /// alive during `op`. Returns the result and the virtual completion: the latest
    /// start plus the largest cost.
    fn collective(
        &self,
        rank: u32,
        bufs: (usize, usize),
        (start, cost): (f64, f64),
        op: impl FnOnce(&[(usize, usize)]),
    ) -> (HcclResult, f64) {
        let deadline = Instant::now() + timeout();
        let mut c = lock(&self.collective);
        if c.arrived.len() != self.size as usize {
            c.arrived = vec![None; self.size as usize];
        }
        let generation = c.generation;
        if let Some(gone) = self.first_gone() {
            return (self.gone_error(rank, "collective", gone), start);
        }
        c.arrived[rank as usize] = Some(bufs);
        c.latest = c.latest.max(start);
        c.cost = c.cost.max(cost);
        if c.arrived.iter().all(Option::is_some) {
            let all: Vec<(usize, usize)> =
                c.arrived.iter().map(|b| b.expect("all arrived")).collect();
            op(&all);
            c.arrived = vec![None; self.size as usize];
            c.done = c.latest + c.cost;
            (c.latest, c.cost) = (0.0, 0.0);
            c.generation += 1;
            self.collective_done.notify_all();
            return (HcclResult::HCCL_SUCCESS, c.done);
        }
        while c.generation == generation {
            if let Some(gone) = self.first_gone() {
                c.arrived[rank as usize] = None;
                return (self.gone_error(rank, "collective", gone), start);
            }
            let now = Instant::now();
            if now >= deadline {
                if let Some(missing) = (0..self.size).find(|&r| c.arrived[r as usize].is_none()) {
                    self.note_stalled(rank, missing);
                }
                c.arrived[rank as usize] = None;
                eprintln!(
                    "ascend-sys emulator: deadlock: rank {rank} waited {:?} in a collective",
                    timeout()
                );
                return (HcclResult::HCCL_E_TIMEOUT, start);
            }
            c = self
                .collective_done
                .wait_timeout(c, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Read before this rank's next arrival: no later generation can complete
        // without it.
        (HcclResult::HCCL_SUCCESS, c.done)
    }
}

/// Validates the common arguments of an operation and returns the communicator.
fn prologue(
    comm: HcclComm,
    stream: aclrtStream,
) -> Result<(Arc<Comm>, Arc<super::Stream>), HcclResult> {
    if comm.is_null() || stream.is_null() {
        return Err(HcclResult::HCCL_E_PTR);
    }
    let c = comm_of(comm).ok_or(HcclResult::HCCL_E_PARA)?;
    let s = stream_of(stream).ok_or(HcclResult::HCCL_E_PARA)?;
    Ok((c, s))
}

/// Queues `work` on `stream` with its virtual timing `time` (`None` while the clock
/// is off): it starts at the stream's virtual time, and its completion becomes the
/// stream's time and one traced span.
fn enqueue(
    comm: Arc<Comm>,
    stream: &super::Stream,
    time: Option<(OpTime, String)>,
    work: impl FnOnce(&Comm, &OpTime) -> (HcclResult, f64) + Send + 'static,
) -> HcclResult {
    let task = move || {
        let rc = match time {
            None => work(&comm, &OpTime::default()).0,
            Some((mut t, label)) => {
                t.start = clock::now();
                let (rc, done) = work(&comm, &t);
                clock::finish(t.start, done, label);
                rc
            }
        };
        record(&comm, rc)
    };
    if stream.enqueue(Box::new(task)) == ACL_SUCCESS {
        HcclResult::HCCL_SUCCESS
    } else {
        HcclResult::HCCL_E_RUNTIME
    }
}

/// The virtual timing of an operation `call` being issued on `stream`: the costs
/// charged for it ([`clock::charge_transfers`]) split by `split` (item costs into
/// sends and receives), and its span's label; `None` while the clock is off.
fn timing(
    stream: &super::Stream,
    call: &str,
    split: impl FnOnce(Vec<f64>) -> OpTime,
) -> Option<(OpTime, String)> {
    if !clock::enabled() {
        return None;
    }
    let (costs, label) = match stream.clock.take_pending() {
        Some(c) => (c.costs, c.label),
        None => (Vec::new(), call.to_string()),
    };
    Some((split(costs), label))
}

/// Costs of a single-sided operation or a collective.
fn sends_only(costs: Vec<f64>) -> OpTime {
    OpTime {
        sends: costs,
        ..OpTime::default()
    }
}

/// Counts an operation for the calling thread's device if it was accepted.
fn counted(rc: HcclResult, f: impl FnOnce(&mut counters::Counters)) -> HcclResult {
    if rc == HcclResult::HCCL_SUCCESS {
        counters::count(f);
    }
    rc
}

fn peer_ok(comm: &Comm, peer: u32) -> bool {
    peer < comm.size && peer != comm.rank
}

/// Resolves an operation's buffer of `bytes` bytes: device memory must lie within one
/// live allocation (out of bounds: `HCCL_E_PARA`; freed or unallocated: `HCCL_E_PTR`);
/// other addresses are host memory, taken as is (the emulator's leniency: real HCCL
/// needs device memory). A null buffer of no bytes is allowed.
fn buffer(call: &str, buf: *mut c_void, bytes: usize) -> Result<Span, HcclResult> {
    if buf.is_null() {
        return if bytes == 0 {
            Ok(Span::none())
        } else {
            Err(HcclResult::HCCL_E_PTR)
        };
    }
    memory::resolve(buf as usize, bytes).map_err(|e| {
        let rc = match e {
            MemError::OutOfBounds { .. } => HcclResult::HCCL_E_PARA,
            _ => HcclResult::HCCL_E_PTR,
        };
        super::report_memory(
            call,
            &e,
            if rc == HcclResult::HCCL_E_PARA {
                "HCCL_E_PARA"
            } else {
                "HCCL_E_PTR"
            },
        );
        rc
    })
}

/// The checks `HcclSend` and `HcclRecv` share: communicator and stream, data type,
/// buffer, peer. Returns the resolved buffer.
fn p2p_args(
    call: &str,
    comm: HcclComm,
    stream: aclrtStream,
    buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    peer: u32,
) -> Result<(Arc<Comm>, Arc<super::Stream>, Span), HcclResult> {
    let (c, s) = prologue(comm, stream)?;
    let size = element_size(data_type).ok_or(HcclResult::HCCL_E_PARA)?;
    if !peer_ok(&c, peer) {
        return Err(HcclResult::HCCL_E_PARA);
    }
    let bytes = bytes_of(count, size)?;
    let span = buffer(call, buf, bytes)?;
    Ok((c, s, span))
}

/// `count` elements of `size` bytes, in bytes.
fn bytes_of(count: u64, size: usize) -> Result<usize, HcclResult> {
    usize::try_from(count)
        .ok()
        .and_then(|c| c.checked_mul(size))
        .ok_or(HcclResult::HCCL_E_PARA)
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> HcclResult {
    if root_info.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = (u64::from(std::process::id()) << 32) | NEXT.fetch_add(1, Ordering::SeqCst);
    let addr = hub::address().map(|a| a.to_string()).unwrap_or_default();
    let mut info = HcclRootInfo {
        internal: [0; HCCL_ROOT_INFO_BYTES as usize],
    };
    let id_bytes = id.to_le_bytes();
    let bytes = MAGIC.iter().chain(&id_bytes).chain(addr.as_bytes());
    for (d, s) in info.internal.iter_mut().zip(bytes) {
        *d = *s as c_char;
    }
    // SAFETY: non-null, and the caller passes a writable HcclRootInfo.
    unsafe { *root_info = info };
    HcclResult::HCCL_SUCCESS
}

/// The group id and serving address of a root info made by [`HcclGetRootInfo`].
fn parse_root_info(info: &HcclRootInfo) -> Option<(u64, Option<SocketAddr>)> {
    let bytes: Vec<u8> = info.internal.iter().map(|&c| c as u8).collect();
    if &bytes[..8] != MAGIC {
        return None;
    }
    let id = u64::from_le_bytes(bytes[8..ADDR_AT].try_into().ok()?);
    let rest = &bytes[ADDR_AT..];
    let end = rest.iter().position(|&b| b == 0)?;
    let addr = match end {
        0 => None,
        _ => Some(std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?),
    };
    Some((id, addr))
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const HcclRootInfo,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    if root_info.is_null() || comm.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    if n_ranks == 0 || rank >= n_ranks {
        return HcclResult::HCCL_E_PARA;
    }
    // SAFETY: non-null; the caller passes a readable HcclRootInfo.
    let Some((id, addr)) = parse_root_info(unsafe { &*root_info }) else {
        return HcclResult::HCCL_E_PARA;
    };
    let made_here = id >> 32 == u64::from(std::process::id());
    let link = match (made_here, addr) {
        (true, _) => match join_group(id, n_ranks, true) {
            Ok(g) => Link::Local(g),
            Err(rc) => return rc,
        },
        (false, Some(addr)) => match Remote::join(addr, id, n_ranks, rank) {
            Ok(r) => Link::Remote(r),
            Err(rc) => return rc,
        },
        (false, None) => {
            eprintln!(
                "ascend-sys emulator: the root info was made by another process that could                  not listen (see MPIPE_ASCEND_EMU_HOST)"
            );
            return HcclResult::HCCL_E_PARA;
        }
    };
    let c = Arc::new(Comm {
        link,
        size: n_ranks,
        rank,
        async_error: Mutex::new(HcclResult::HCCL_SUCCESS),
        departed: Mutex::new(None),
        stalled: Mutex::new(None),
    });
    let handle = Arc::as_ptr(&c) as usize;
    lock(comms()).insert(handle, c);
    // SAFETY: non-null, and the caller passes a writable handle.
    unsafe { *comm = handle as HcclComm };
    HcclResult::HCCL_SUCCESS
}

#[no_mangle]
pub(super) extern "C" fn HcclCommDestroy(comm: HcclComm) -> HcclResult {
    let Some(c) = lock(comms()).remove(&(comm as usize)) else {
        return HcclResult::HCCL_E_PARA;
    };
    if let Link::Local(g) = &c.link {
        g.await_remote_lanes();
    }
    HcclResult::HCCL_SUCCESS
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclGetRankSize(comm: HcclComm, rank_size: *mut u32) -> HcclResult {
    let Some(c) = comm_of(comm) else {
        return HcclResult::HCCL_E_PARA;
    };
    if rank_size.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    // SAFETY: non-null, writable by the caller's promise.
    unsafe { *rank_size = c.size };
    HcclResult::HCCL_SUCCESS
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclGetRankId(comm: HcclComm, rank: *mut u32) -> HcclResult {
    let Some(c) = comm_of(comm) else {
        return HcclResult::HCCL_E_PARA;
    };
    if rank.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    // SAFETY: non-null, writable by the caller's promise.
    unsafe { *rank = c.rank };
    HcclResult::HCCL_SUCCESS
}

#[no_mangle]
pub(super) extern "C" fn HcclSend(
    send_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    dest_rank: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s, span) = match p2p_args(
        "HcclSend", comm, stream, send_buf, count, data_type, dest_rank,
    ) {
        Ok(x) => x,
        Err(e) => return e,
    };
    hazards::on_stream(
        stream as usize,
        vec![Use::read(&span, "HcclSend", "to").peer(dest_rank)],
    );
    let time = timing(&s, "HcclSend", sends_only);
    counted(
        enqueue(c, &s, time, move |c, t| {
            let span = span; // the whole span: it keeps the allocation alive
            c.send(dest_rank, span.ptr, span.len, t)
        }),
        |k| k.send += 1,
    )
}

#[no_mangle]
pub(super) extern "C" fn HcclRecv(
    recv_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    src_rank: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s, span) = match p2p_args(
        "HcclRecv", comm, stream, recv_buf, count, data_type, src_rank,
    ) {
        Ok(x) => x,
        Err(e) => return e,
    };
    hazards::on_stream(
        stream as usize,
        vec![Use::write(&span, "HcclRecv", "from").peer(src_rank)],
    );
    let time = timing(&s, "HcclRecv", |costs| OpTime {
        recvs: costs,
        ..OpTime::default()
    });
    counted(
        enqueue(c, &s, time, move |c, t| {
            let span = span; // the whole span: it keeps the allocation alive
            c.receive(src_rank, span.ptr, span.len, t)
        }),
        |k| k.recv += 1,
    )
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclBatchSendRecv(
    items: *mut HcclSendRecvItem,
    item_num: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s) = match prologue(comm, stream) {
        Ok(x) => x,
        Err(e) => return e,
    };
    if items.is_null() && item_num > 0 {
        return HcclResult::HCCL_E_PTR;
    }
    // SAFETY: the caller passes `item_num` readable items.
    let items: Vec<HcclSendRecvItem> = if item_num == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(items, item_num as usize) }.to_vec()
    };
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    let mut spans = Vec::new();
    for it in &items {
        let Some(size) = element_size(it.dataType) else {
            return HcclResult::HCCL_E_PARA;
        };
        if !peer_ok(&c, it.remoteRank) || (it.buf.is_null() && it.count > 0) {
            return HcclResult::HCCL_E_PARA;
        }
        let span = match bytes_of(it.count, size)
            .and_then(|bytes| buffer("HcclBatchSendRecv", it.buf, bytes))
        {
            Ok(s) => s,
            Err(e) => return e,
        };
        let entry = (it.remoteRank, span.ptr, span.len);
        spans.push(span);
        let list = match it.sendRecvType {
            HcclSendRecvType::HCCL_SEND => &mut sends,
            HcclSendRecvType::HCCL_RECV => &mut recvs,
            _ => return HcclResult::HCCL_E_PARA,
        };
        // Documented rule: no two sends (or receives) with the same peer in one call.
        if list.iter().any(|&(peer, _, _)| peer == it.remoteRank) {
            return HcclResult::HCCL_E_PARA;
        }
        list.push(entry);
    }
    // Items numbered from 0, as in the caller's array.
    let uses = items
        .iter()
        .zip(&spans)
        .enumerate()
        .map(|(i, (it, span))| {
            let u = if it.sendRecvType == HcclSendRecvType::HCCL_SEND {
                Use::read(span, "HcclBatchSendRecv", "SEND to")
            } else {
                Use::write(span, "HcclBatchSendRecv", "RECV from")
            };
            u.item(i as u32).peer(it.remoteRank)
        })
        .collect();
    hazards::on_stream(stream as usize, uses);
    // Item costs in the caller's order, split as the items are.
    let time = timing(&s, "HcclBatchSendRecv", |costs| {
        let mut t = OpTime::default();
        for (i, it) in items.iter().enumerate() {
            let cost = costs.get(i).copied().unwrap_or(0.0);
            if it.sendRecvType == HcclSendRecvType::HCCL_SEND {
                t.sends.push(cost);
            } else {
                t.recvs.push(cost);
            }
        }
        t
    });
    counted(
        enqueue(c, &s, time, move |c, t| {
            let _alive = &spans;
            c.batch(&sends, &recvs, t)
        }),
        |k| {
            k.batch_send_recv += 1;
            k.batch_items += u64::from(item_num);
        },
    )
}

/// Completes a taken send `p` from `src` into `dst`'s buffer at `dst_ptr` of `bytes`
/// bytes (a length mismatch is HCCL's parameter error) and wakes its sender. `(at,
/// cost)` is the receiver's virtual start and charged cost; the transfer completes at
/// the later start plus the larger cost, which the sender learns too.
fn deliver(
    p: Post,
    src: u32,
    dst: u32,
    dst_ptr: usize,
    bytes: usize,
    (at, cost): (f64, f64),
) -> (HcclResult, f64) {
    let done = p.at.max(at) + p.cost.max(cost);
    p.taken.2.store(done.to_bits(), Ordering::Release);
    let rc = if p.bytes != bytes {
        eprintln!(
            "ascend-sys emulator: rank {dst} receives {bytes} bytes from rank {src}, \
             which sends {} (HCCL_E_PARA)",
            p.bytes
        );
        HcclResult::HCCL_E_PARA
    } else {
        // SAFETY: the sender's stream is blocked until `taken` is set, so its
        // buffer is alive; the receiver's buffer is the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, dst_ptr as *mut u8, bytes) };
        HcclResult::HCCL_SUCCESS
    };
    *lock(&p.taken.0) = Some(rc);
    p.taken.1.notify_all();
    (rc, done)
}

/// Element-wise `acc = op(acc, x)` over `count` elements of `t` at raw addresses.
///
/// # Safety
/// Both addresses hold `count` elements of `t`.
unsafe fn reduce_into(t: HcclDataType, op: HcclReduceOp, acc: usize, x: usize, count: usize) {
    macro_rules! go {
        ($ty:ty) => {{
            // SAFETY: the caller's promise.
            let (a, b) = unsafe {
                (
                    std::slice::from_raw_parts_mut(acc as *mut $ty, count),
                    std::slice::from_raw_parts(x as *const $ty, count),
                )
            };
            for (a, &b) in a.iter_mut().zip(b) {
                *a = match op {
                    HcclReduceOp::HCCL_REDUCE_SUM => *a + b,
                    HcclReduceOp::HCCL_REDUCE_PROD => *a * b,
                    HcclReduceOp::HCCL_REDUCE_MAX => {
                        if b > *a {
                            b
                        } else {
                            *a
                        }
                    }
                    _ => {
                        if b < *a {
                            b
                        } else {
                            *a
                        }
                    }
                };
            }
        }};
    }
    match t {
        HcclDataType::HCCL_DATA_TYPE_FP32 => go!(f32),
        HcclDataType::HCCL_DATA_TYPE_FP64 => go!(f64),
        HcclDataType::HCCL_DATA_TYPE_INT8 => go!(i8),
        HcclDataType::HCCL_DATA_TYPE_UINT8 => go!(u8),
        HcclDataType::HCCL_DATA_TYPE_INT16 => go!(i16),
        HcclDataType::HCCL_DATA_TYPE_UINT16 => go!(u16),
        HcclDataType::HCCL_DATA_TYPE_INT32 => go!(i32),
        HcclDataType::HCCL_DATA_TYPE_UINT32 => go!(u32),
        HcclDataType::HCCL_DATA_TYPE_INT64 => go!(i64),
        _ => go!(u64),
    }
}

/// Resolves a reduction's input and (when this rank writes it) output buffers of
/// `count` elements, which must be aligned to the element size.
fn reduction_buffers(
    call: &str,
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    t: HcclDataType,
    writes: bool,
) -> Result<(Span, Span), HcclResult> {
    let size = element_size(t).ok_or(HcclResult::HCCL_E_PARA)?;
    let bytes = bytes_of(count, size)?;
    let input = buffer(call, send_buf, bytes)?;
    let output = if writes {
        buffer(call, recv_buf, bytes)?
    } else {
        Span::none()
    };
    if input.ptr % size != 0 || output.ptr % size != 0 {
        eprintln!("ascend-sys emulator: {call}: a buffer is not aligned to its {size}-byte elements (HCCL_E_PARA)");
        return Err(HcclResult::HCCL_E_PARA);
    }
    Ok((input, output))
}

fn reducible(t: HcclDataType, op: HcclReduceOp) -> bool {
    element_size(t).is_some()
        && t != HcclDataType::HCCL_DATA_TYPE_FP16
        && t != HcclDataType::HCCL_DATA_TYPE_BFP16
        && op.0 <= HcclReduceOp::HCCL_REDUCE_MIN.0
}

/// Reduces every rank's send buffer into the receive buffers of `targets` (None = all).
fn reduce_op(
    t: HcclDataType,
    op: HcclReduceOp,
    count: usize,
    root: Option<u32>,
) -> impl FnOnce(&[(usize, usize)]) {
    move |all: &[(usize, usize)]| {
        let bytes = count * element_size(t).expect("checked");
        // Aligned for the element type (the reduction reads it as such).
        let mut acc = Aligned::zeroed(bytes);
        let at = acc.addr();
        // SAFETY: every send buffer holds `count` aligned elements (checked for device
        // memory, the callers' promise for host memory) and its rank is blocked in this
        // collective.
        unsafe {
            std::ptr::copy_nonoverlapping(all[0].0 as *const u8, at as *mut u8, bytes);
            for &(send, _) in &all[1..] {
                reduce_into(t, op, at, send, count);
            }
            for (r, &(_, recv)) in all.iter().enumerate() {
                if root.is_none() || root == Some(r as u32) {
                    std::ptr::copy(at as *const u8, recv as *mut u8, bytes);
                }
            }
        }
    }
}

#[no_mangle]
pub(super) extern "C" fn HcclAllReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    op: HcclReduceOp,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s) = match prologue(comm, stream) {
        Ok(x) => x,
        Err(e) => return e,
    };
    if !reducible(data_type, op) {
        return HcclResult::HCCL_E_NOT_SUPPORT;
    }
    if send_buf.is_null() || recv_buf.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    let (input, output) =
        match reduction_buffers("HcclAllReduce", send_buf, recv_buf, count, data_type, true) {
            Ok(x) => x,
            Err(e) => return e,
        };
    let coll = CollOp::AllReduce {
        t: data_type,
        op,
        count: input.len / element_size(data_type).unwrap_or(1),
    };
    hazards::on_stream(
        stream as usize,
        vec![
            Use::read(&input, "HcclAllReduce", "input"),
            Use::write(&output, "HcclAllReduce", "output"),
        ],
    );
    let time = timing(&s, "HcclAllReduce", sends_only);
    counted(
        enqueue(c, &s, time, move |c, t| {
            // The whole spans: they keep the allocations alive.
            let (input, output) = (input, output);
            c.collective(coll, input.ptr, output.ptr, t)
        }),
        |k| k.collectives += 1,
    )
}

#[no_mangle]
pub(super) extern "C" fn HcclReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    op: HcclReduceOp,
    root: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s) = match prologue(comm, stream) {
        Ok(x) => x,
        Err(e) => return e,
    };
    if !reducible(data_type, op) {
        return HcclResult::HCCL_E_NOT_SUPPORT;
    }
    if root >= c.size {
        return HcclResult::HCCL_E_PARA;
    }
    if send_buf.is_null() || (recv_buf.is_null() && c.rank == root) {
        return HcclResult::HCCL_E_PTR;
    }
    let (input, output) = match reduction_buffers(
        "HcclReduce",
        send_buf,
        recv_buf,
        count,
        data_type,
        c.rank == root,
    ) {
        Ok(x) => x,
        Err(e) => return e,
    };
    let coll = CollOp::Reduce {
        t: data_type,
        op,
        count: input.len / element_size(data_type).unwrap_or(1),
        root,
    };
    // `output` is empty (no memory) except at the root.
    hazards::on_stream(
        stream as usize,
        vec![
            Use::read(&input, "HcclReduce", "input"),
            Use::write(&output, "HcclReduce", "output"),
        ],
    );
    let time = timing(&s, "HcclReduce", sends_only);
    counted(
        enqueue(c, &s, time, move |c, t| {
            // The whole spans: they keep the allocations alive.
            let (input, output) = (input, output);
            c.collective(coll, input.ptr, output.ptr, t)
        }),
        |k| k.collectives += 1,
    )
}

#[no_mangle]
pub(super) extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    root: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let (c, s) = match prologue(comm, stream) {
        Ok(x) => x,
        Err(e) => return e,
    };
    if element_size(data_type).is_none() || root >= c.size {
        return HcclResult::HCCL_E_PARA;
    }
    if buf.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    let size = element_size(data_type).unwrap_or(1);
    let span = match bytes_of(count, size).and_then(|bytes| buffer("HcclBroadcast", buf, bytes)) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let coll = CollOp::Broadcast {
        t: data_type,
        count: span.len / size,
        root,
    };
    let role = if c.rank == root {
        Use::read(&span, "HcclBroadcast", "buffer (root)")
    } else {
        Use::write(&span, "HcclBroadcast", "buffer")
    };
    hazards::on_stream(stream as usize, vec![role]);
    let time = timing(&s, "HcclBroadcast", sends_only);
    counted(
        enqueue(c, &s, time, move |c, t| {
            let span = span; // the whole span: it keeps the allocation alive
            c.collective(coll, span.ptr, span.ptr, t)
        }),
        |k| k.collectives += 1,
    )
}

#[no_mangle]
pub(super) extern "C" fn HcclBarrier(comm: HcclComm, stream: aclrtStream) -> HcclResult {
    let (c, s) = match prologue(comm, stream) {
        Ok(x) => x,
        Err(e) => return e,
    };
    let time = timing(&s, "HcclBarrier", sends_only);
    counted(
        enqueue(c, &s, time, |c, t| c.collective(CollOp::Barrier, 0, 0, t)),
        |k| k.collectives += 1,
    )
}

#[no_mangle]
pub(super) unsafe extern "C" fn HcclGetCommAsyncError(
    comm: HcclComm,
    async_error: *mut HcclResult,
) -> HcclResult {
    let Some(c) = comm_of(comm) else {
        return HcclResult::HCCL_E_PARA;
    };
    if async_error.is_null() {
        return HcclResult::HCCL_E_PTR;
    }
    // SAFETY: non-null, writable by the caller's promise.
    unsafe { *async_error = *lock(&c.async_error) };
    HcclResult::HCCL_SUCCESS
}

#[no_mangle]
pub(super) extern "C" fn HcclGetErrorString(code: HcclResult) -> *const c_char {
    let s: &'static [u8] = match code {
        HcclResult::HCCL_SUCCESS => b"success\0",
        HcclResult::HCCL_E_PARA => b"parameter error\0",
        HcclResult::HCCL_E_PTR => b"empty pointer\0",
        HcclResult::HCCL_E_MEMORY => b"memory error\0",
        HcclResult::HCCL_E_INTERNAL => b"internal error\0",
        HcclResult::HCCL_E_NOT_SUPPORT => b"not supported\0",
        HcclResult::HCCL_E_NOT_FOUND => b"not found\0",
        HcclResult::HCCL_E_UNAVAIL => b"resource unavailable\0",
        HcclResult::HCCL_E_TIMEOUT => b"timeout\0",
        HcclResult::HCCL_E_RUNTIME => b"runtime error\0",
        HcclResult::HCCL_E_REMOTE => b"remote rank error\0",
        _ => b"unknown HCCL error\0",
    };
    s.as_ptr().cast()
}

/// Leaves `comm` as a failed rank: like `HcclCommDestroy`, but its rank is *gone*
/// for the others, as if its process had been killed: every operation with it,
/// pending or later, fails at once with `HCCL_E_REMOTE` naming it
/// ([`departed_rank`]), instead of waiting for HCCL's timeout. For a rank that fails
/// while its peers may be waiting for it (the emulator's stand-in for an abort,
/// which HCCL lacks). Returns whether `comm` was a communicator.
///
/// In the process serving the group (its ranks in other processes reach it through
/// [`super::hub`]), this waits, as `HcclCommDestroy` does, until those ranks have
/// left or HCCL's timeout has passed: the group is the emulator's stand-in for the
/// fabric, which on a device does not die with one rank's process. Their operations
/// with a gone rank fail at once, naming the rank that failed first; without the
/// wait, a rank whose next operation reached the group after this process ended
/// could only blame this rank (the process that served it), not the one whose death
/// failed it.
pub fn abandon(comm: HcclComm) -> bool {
    let Some(c) = lock(comms()).remove(&(comm as usize)) else {
        return false;
    };
    match &c.link {
        Link::Local(g) => {
            g.mark_gone(
                c.rank,
                "it left its communicator after failing (abandoned it without HcclCommDestroy)",
            );
            g.await_remote_lanes();
        }
        Link::Remote(r) => r.abandon(),
    }
    true
}

/// The peer that the first operation queued on `comm` to time out
/// (`HCCL_E_TIMEOUT`) was waiting for (the receive's sender, the send's receiver,
/// a collective's first member that had not arrived), if one timed out. An extension
/// of the emulator: HCCL reports only the code.
pub fn stalled_peer(comm: HcclComm) -> Option<u32> {
    comm_of(comm).and_then(|c| *lock(&c.stalled))
}

/// The first rank that work queued on `comm` found gone (its process ended or was
/// killed; the operation failed with `HCCL_E_REMOTE`), if any. An extension of the
/// emulator: HCCL reports only the code.
pub fn departed_rank(comm: HcclComm) -> Option<u32> {
    comm_of(comm).and_then(|c| *lock(&c.departed))
}
