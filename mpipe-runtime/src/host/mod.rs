//! The host backend's communication: [`Comm`] for CPUs, with ranks as threads of one
//! process ([`threads`]) or as processes talking over loopback TCP ([`tcp`]), and the
//! process launcher behind `mpipe-run` ([`launch`]).
//!
//! Both transports share one engine, so they behave identically:
//!
//! - **Rendezvous by request.** A receive is posted by sending its peer a *ready*
//!   message for `(tag)`; a send waits until the matching *ready* has arrived and only
//!   then ships the data, so a send cannot complete before its receive is posted.
//!   Matching is first-in first-out per `(peer, channel)`, where a channel is a
//!   [`Tag`] together with the kind of operation (point-to-point, or one of the
//!   collectives' phases), so collectives and transfers never steal each other's
//!   messages.
//! - **Batches** post every receive's *ready* first, then ship each send as soon as
//!   its *ready* is there, and return when all are done.
//! - **Eager mode** ([`HostComm::set_mode`], or `MPIPE_COMM_MODE=eager` for
//!   [`tcp::from_env`]): point-to-point sends ship their data at once and complete
//!   (the receiver's inbox buffers it, as a communication stream with its own buffers
//!   would), and receives wait for the data only: docs/spec/program-format.md's *eager*
//!   semantics, which a program derived with `--mode eager` is timed under.
//!   Collectives stay rendezvous, as the spec says. Every rank of a world must use
//!   the same mode: a rendezvous send to an eager receiver waits for a *ready* that
//!   never comes, and fails with a timeout naming it.
//! - **Collectives** are built on the same transfers: `broadcast` is the root sending
//!   to every member; `reduce` is every member sending to the root, which sums in
//!   group order; `all_reduce` is a reduce onto the group's first rank followed by a
//!   broadcast from it; `barrier` is an empty all-reduce over the world.
//! - **Failures.** Every wait is bounded by the communicator's timeout
//!   ([`Error::Timeout`]). [`Aborter::abort`] records the failure locally and sends it
//!   to every peer; a peer that receives it wakes its waiting call at once and fails
//!   it, and every later call, with [`Error::PeerFailed`]. A rank that learnt of a
//!   failure and then aborts itself forwards the *original* failure, so every rank
//!   names the rank that failed first (the threads of [`run_comms`] abort their rank
//!   when it returns an error or panics). Dropping a communicator says goodbye to its
//!   peers (or, while panicking, aborts); a peer that has said goodbye and is still
//!   needed by a transfer fails that transfer, and a TCP peer whose connection closes
//!   without a goodbye (the process exited or was killed) fails every call.

use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use crate::comm::Error;
use crate::comm::{Comm, Tag, Tensor};
pub use mpipe_core::simulate::Mode;

pub mod launch;
pub mod output;
// The launcher's libc calls (signals, parent-death signal), each behind a safe function.
#[allow(unsafe_code)]
mod signals;
pub mod tcp;
pub mod threads;

/// The timeout used when none is given: 10 s, or `MPIPE_COMM_TIMEOUT` (seconds) if
/// set. It bounds each wait, which includes the time the peer spends computing before
/// it posts its side, so raise it for heavy models.
pub fn default_timeout() -> Duration {
    std::env::var("MPIPE_COMM_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(10))
}

/// What a host communicator offers beyond [`Comm`].
pub trait HostComm: Comm<Error = Error> + Send {
    /// A handle that can abort this rank from anywhere (another thread, a panic
    /// guard), also after the communicator has been moved or dropped.
    fn aborter(&self) -> Aborter;
    /// The bound on every blocking wait.
    fn timeout(&self) -> Duration;
    /// Changes the bound on every blocking wait.
    fn set_timeout(&mut self, timeout: Duration);
    /// The semantics of point-to-point transfers (rendezvous unless set).
    fn mode(&self) -> Mode;
    /// Sets the semantics of point-to-point transfers; every rank of the world must
    /// set the same (see the module doc).
    fn set_mode(&mut self, mode: Mode);
}

/// The point-to-point semantics a world runs under: `MPIPE_COMM_MODE` (`rendezvous`,
/// the default, or `eager`). An unknown value is an error, never a silent default.
pub fn default_mode() -> Result<Mode, Error> {
    match std::env::var("MPIPE_COMM_MODE") {
        Err(_) => Ok(Mode::Rendezvous),
        Ok(v) if v.trim().is_empty() => Ok(Mode::Rendezvous),
        Ok(v) => Mode::from_name(v.trim()).ok_or_else(|| {
            Error::Setup(format!(
                "MPIPE_COMM_MODE={:?}: expected `rendezvous` or `eager`",
                v.trim()
            ))
        }),
    }
}

/// The operation a message belongs to; part of the matching key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    P2p = 0,
    Bcast = 1,
    Reduce = 2,
    AllReduceUp = 3,
    AllReduceDown = 4,
    BarrierUp = 5,
    BarrierDown = 6,
}

impl Op {
    pub(crate) fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            0 => Op::P2p,
            1 => Op::Bcast,
            2 => Op::Reduce,
            3 => Op::AllReduceUp,
            4 => Op::AllReduceDown,
            5 => Op::BarrierUp,
            6 => Op::BarrierDown,
            _ => return None,
        })
    }
}

/// A matching key (besides the peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Chan {
    pub op: Op,
    pub tag: Tag,
}

/// A message between two endpoints; `D` is the payload (borrowed to send, owned once
/// received).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Msg<D> {
    /// The sender has posted a receive on this channel.
    Ready(Chan),
    /// The data of a send on this channel, shipped after the matching `Ready`.
    Data(Chan, D),
    /// Rank `origin` failed while doing `what`; `waited_for`: it failed by timing out
    /// waiting for that rank (which, if it is the receiver and itself waiting for a
    /// third rank, blames that one in its note for `mpipe-run`).
    Abort {
        origin: usize,
        what: String,
        waited_for: Option<usize>,
    },
    /// The sender closed its communicator normally.
    Bye,
}

impl Msg<&[f32]> {
    pub(crate) fn to_owned_msg(&self) -> Msg<Tensor> {
        match self {
            Msg::Ready(c) => Msg::Ready(*c),
            Msg::Data(c, d) => Msg::Data(*c, d.to_vec()),
            Msg::Abort {
                origin,
                what,
                waited_for,
            } => Msg::Abort {
                origin: *origin,
                what: what.clone(),
                waited_for: *waited_for,
            },
            Msg::Bye => Msg::Bye,
        }
    }
}

/// How an endpoint reaches its peers (never itself: the endpoint handles that).
pub(crate) trait Link: Send + Sync {
    fn deliver(&self, to: usize, msg: &Msg<&[f32]>) -> std::io::Result<()>;
    /// Closes the connections (after a goodbye or an abort, or abruptly: as if the
    /// process had died).
    fn close(&self, abrupt: bool);
}

#[derive(Default)]
struct InboxState {
    /// `Ready`s received and not yet used by a send, per (peer, channel).
    ready: HashMap<(usize, Chan), usize>,
    /// Data received and not yet taken by a receive, per (peer, channel), in order.
    data: HashMap<(usize, Chan), VecDeque<Tensor>>,
    /// The first failure heard of: (rank, what).
    failure: Option<(usize, String)>,
    /// The first failure's rank failed by timing out waiting for this rank.
    failure_waited_for: Option<usize>,
    /// This rank timed out waiting for this peer (before hearing of any failure).
    timed_out_on: Option<usize>,
    /// The peers of the transfers this rank's current call still waits for.
    waiting_on: Vec<usize>,
    /// Peers that said goodbye.
    departed: Vec<bool>,
    /// This endpoint is closed; connection losses no longer matter.
    closed: bool,
}

/// One rank's incoming side: what its peers have sent, and who failed. Shared by the
/// endpoint, its aborters and whatever delivers messages to it (peer threads, socket
/// reader threads).
pub(crate) struct Inbox {
    st: Mutex<InboxState>,
    cv: Condvar,
    /// A runner (`run_comms`) closes the rank when its function returns (goodbye,
    /// or abort with the error or panic message), so dropping the communicator does
    /// nothing.
    runner_guarded: AtomicBool,
    /// This rank.
    me: usize,
    /// Where to note which rank this one blames when it first learns of another
    /// rank's failure (`mpipe-run` reads it to tell the first failure from its
    /// consequences).
    blame_file: Option<std::path::PathBuf>,
}

impl Inbox {
    pub(crate) fn new(me: usize, world: usize, blame_file: Option<std::path::PathBuf>) -> Inbox {
        Inbox {
            st: Mutex::new(InboxState {
                departed: vec![false; world],
                ..InboxState::default()
            }),
            cv: Condvar::new(),
            runner_guarded: AtomicBool::new(false),
            me,
            blame_file,
        }
    }

    /// Records a failure heard from outside if it is the first; then wakes waiters.
    /// `waited_for`: `origin` failed by timing out waiting for that rank.
    fn record_failure(
        &self,
        mut st: MutexGuard<'_, InboxState>,
        origin: usize,
        what: String,
        waited_for: Option<usize>,
    ) {
        if st.failure.is_none() {
            // The launcher reads this note to tell the first failure from its echoes.
            // Write it before the failure is visible to this rank's calls, under the
            // lock they read it with: any of them may fail on it at once (woken by
            // another message, not only by us) and end the process, and a note not
            // yet written then never is, which made this rank look like the origin.
            // A rank that timed out on its own keeps that note: the abort heard now
            // (from a peer that timed out waiting for this rank, say) arrived after
            // this rank's wait ended and before its own abort, and the chain of waits
            // goes through the peer this rank timed out on, not through `origin`.
            // (Replacing it made two ranks blame each other and the launcher name
            // one of them instead of the rank they all waited for.)
            let own_note = st.timed_out_on.is_some();
            if let (true, false, Some(path)) = (origin != self.me, own_note, &self.blame_file) {
                // `origin` timed out waiting for this rank, which is itself waiting
                // for a peer: the chain of waits leads there (to a rank that stopped
                // making progress), not back to `origin`.
                let waiting = st
                    .waiting_on
                    .iter()
                    .copied()
                    .find(|&p| p != self.me && p != origin);
                let note = match (waited_for == Some(self.me), waiting) {
                    (true, Some(p)) => format!(
                        "{p}\nrank {origin} timed out waiting for this rank, which was waiting \
                         for rank {p} ({what})\n"
                    ),
                    _ => format!("{origin}\n{what}\n"),
                };
                let _ = std::fs::write(path, note);
            }
            st.failure = Some((origin, what));
            st.failure_waited_for = waited_for;
        }
        drop(st);
        self.cv.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.st.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notes for `mpipe-run` that this rank timed out waiting for `peer` (`what`),
    /// unless it already learnt of a failure: a rank that stopped making progress
    /// (stopped, hung) is the one its peers time out on, so the launcher can follow
    /// the notes to it instead of blaming the first rank to time out.
    fn note_timeout(&self, st: &mut InboxState, peer: usize, what: &str) {
        if st.failure.is_some() || peer == self.me {
            return;
        }
        st.timed_out_on.get_or_insert(peer);
        if let Some(path) = &self.blame_file {
            let _ = std::fs::write(path, format!("{peer}\ntimed out waiting for {what}\n"));
        }
    }

    /// A message from rank `from` arrived.
    pub(crate) fn handle(&self, from: usize, msg: Msg<Tensor>) {
        let mut st = self.lock();
        match msg {
            Msg::Ready(chan) => *st.ready.entry((from, chan)).or_default() += 1,
            Msg::Data(chan, data) => st.data.entry((from, chan)).or_default().push_back(data),
            Msg::Abort {
                origin,
                what,
                waited_for,
            } => return self.record_failure(st, origin, what, waited_for),
            Msg::Bye => {
                if let Some(d) = st.departed.get_mut(from) {
                    *d = true;
                }
            }
        }
        drop(st);
        self.cv.notify_all();
    }

    /// The connection to `from` ended. Unless `from` said goodbye first (or this
    /// endpoint is closed), that is `from` failing.
    pub(crate) fn lost(&self, from: usize, what: String) {
        let st = self.lock();
        if st.closed || st.departed.get(from).copied().unwrap_or(true) {
            return;
        }
        self.record_failure(st, from, what, None);
    }

    pub(crate) fn set_closed(&self) {
        self.lock().closed = true;
    }

    fn failure(&self) -> Option<Error> {
        self.lock()
            .failure
            .as_ref()
            .map(|(rank, what)| Error::PeerFailed {
                rank: *rank,
                what: what.clone(),
            })
    }
}

fn take_ready(st: &mut InboxState, key: (usize, Chan)) -> bool {
    match st.ready.get_mut(&key) {
        Some(n) if *n > 1 => {
            *n -= 1;
            true
        }
        Some(_) => {
            st.ready.remove(&key);
            true
        }
        None => false,
    }
}

fn take_data(st: &mut InboxState, key: (usize, Chan)) -> Option<Tensor> {
    let q = st.data.get_mut(&key)?;
    let t = q.pop_front();
    if q.is_empty() {
        st.data.remove(&key);
    }
    t
}

/// A cloneable handle that aborts one rank of a communicator (see [`Comm::abort`]).
#[derive(Clone)]
pub struct Aborter {
    rank: usize,
    world: usize,
    inbox: Arc<Inbox>,
    link: Arc<dyn Link>,
}

impl Aborter {
    /// The rank this handle aborts.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Records that this rank failed while doing `what` and tells every other rank,
    /// whose pending and future calls then fail with [`Error::PeerFailed`]. If this
    /// rank already knows of a failure (its own earlier abort, or a peer's), that
    /// first failure is what is sent. Also fails this rank's own pending and future
    /// calls. Does not block beyond writing a small message to each peer.
    pub fn abort(&self, what: &str) {
        let (origin, what, waited_for) = {
            let mut st = self.inbox.lock();
            match &st.failure {
                Some((rank, what)) => (*rank, what.clone(), st.failure_waited_for),
                None => {
                    // A failure of this rank's own: a timeout's peer goes with it.
                    let waited_for = st.timed_out_on;
                    st.failure = Some((self.rank, what.to_string()));
                    st.failure_waited_for = waited_for;
                    (self.rank, what.to_string(), waited_for)
                }
            }
        };
        self.inbox.cv.notify_all();
        let msg = Msg::Abort {
            origin,
            what,
            waited_for,
        };
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            // A peer we cannot reach has failed already; nothing more to do.
            let _ = self.link.deliver(peer, &msg);
        }
    }

    /// Has this rank heard of a failure (its own abort included)?
    pub fn failed(&self) -> Option<Error> {
        self.inbox.failure()
    }

    /// Closes the rank's side: a goodbye to every peer (or, for `Err(what)`, an
    /// abort), then the connections.
    /// A rank that heard of a failure aborts even on `Ok`: it passes the first
    /// failure on, so a peer waiting for it blames that failure's rank, not this one
    /// for leaving.
    fn finish(&self, outcome: Result<(), &str>) {
        let heard = self.inbox.lock().failure.is_some();
        match outcome {
            Ok(()) if heard => self.abort("finished after hearing of a failure"),
            Ok(()) => {
                for peer in (0..self.world).filter(|&p| p != self.rank) {
                    let _ = self.link.deliver(peer, &Msg::Bye);
                }
            }
            Err(what) => self.abort(what),
        }
        self.inbox.set_closed();
        self.link.close(false);
    }
}

/// The engine shared by the host communicators: one rank's endpoint.
pub(crate) struct Endpoint {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Point-to-point semantics: rendezvous, or eager (sends never wait).
    mode: Mode,
    inbox: Arc<Inbox>,
    link: Arc<dyn Link>,
    /// Closed already (abruptly).
    finished: bool,
}

/// Dropping says goodbye to every peer, or, while panicking, aborts (unless a runner
/// guards the rank: it then says goodbye or aborts with the outcome).
impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.finished || self.inbox.runner_guarded.load(Ordering::SeqCst) {
            return;
        }
        if std::thread::panicking() {
            self.aborter().finish(Err(
                "panicked (its communicator was dropped while unwinding)",
            ));
        } else {
            self.aborter().finish(Ok(()));
        }
    }
}

/// One send of an exchange: (peer, channel, data).
type SendOf<'a> = (usize, Chan, &'a [f32]);

impl Endpoint {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        timeout: Duration,
        inbox: Arc<Inbox>,
        link: Arc<dyn Link>,
    ) -> Endpoint {
        Endpoint {
            rank,
            world,
            timeout,
            mode: Mode::Rendezvous,
            inbox,
            link,
            finished: false,
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }
    pub(crate) fn world(&self) -> usize {
        self.world
    }
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }
    pub(crate) fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    pub(crate) fn aborter(&self) -> Aborter {
        Aborter {
            rank: self.rank,
            world: self.world,
            inbox: self.inbox.clone(),
            link: self.link.clone(),
        }
    }

    /// Closes the connections at once, without a goodbye: peers see this rank die.
    pub(crate) fn close_abruptly(&mut self) {
        self.finished = true;
        self.inbox.set_closed();
        self.link.close(true);
    }

    fn deliver(&self, to: usize, msg: &Msg<&[f32]>) -> Result<(), Error> {
        if to == self.rank {
            self.inbox.handle(to, msg.to_owned_msg());
            return Ok(());
        }
        self.link.deliver(to, msg).map_err(|e| {
            if let Some(f) = self.inbox.failure() {
                return f;
            }
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                let waiting_for = format!("rank {to} to take a message (socket write)");
                self.inbox
                    .note_timeout(&mut self.inbox.lock(), to, &waiting_for);
                return Error::Timeout {
                    after: self.timeout,
                    waiting_for,
                };
            }
            let departed = self.inbox.lock().departed.get(to).copied().unwrap_or(false);
            if departed {
                return Error::PeerFailed {
                    rank: to,
                    what: "closed its communicator while still needed".to_string(),
                };
            }
            // Rank `to` is gone without a goodbye: its failure, which this write saw
            // before the connection's reader did. Record it as the reader would, so
            // this rank blames `to` (in mpipe-run's note too) and an abort of its own
            // forwards `to`'s failure instead of claiming to be the origin.
            let what = format!("connection lost: {e}");
            self.inbox.lost(to, what.clone());
            self.inbox
                .failure()
                .unwrap_or(Error::PeerFailed { rank: to, what })
        })
    }

    fn check_peer(&self, peer: usize) -> Result<(), Error> {
        if peer >= self.world {
            return Err(Error::Invalid(format!(
                "rank {peer} does not exist (world of {} ranks)",
                self.world
            )));
        }
        Ok(())
    }

    /// Posts every receive, ships every send once its receive is posted, and waits
    /// for all. `ctx` names the collective, if any, for error messages. Point-to-point
    /// transfers (no `ctx`) in eager mode ship every send at once and post no
    /// receive: only the data is waited for.
    fn exchange(
        &self,
        sends: &[SendOf<'_>],
        recvs: &[(usize, Chan)],
        ctx: Option<&str>,
    ) -> Result<Vec<Tensor>, Error> {
        let r = self.exchange_waiting(sends, recvs, ctx);
        self.inbox.lock().waiting_on.clear();
        r
    }

    /// [`Self::exchange`], noting in the inbox which peers it waits for.
    fn exchange_waiting(
        &self,
        sends: &[SendOf<'_>],
        recvs: &[(usize, Chan)],
        ctx: Option<&str>,
    ) -> Result<Vec<Tensor>, Error> {
        if let Some(f) = self.inbox.failure() {
            return Err(f);
        }
        for &(peer, _, _) in sends {
            self.check_peer(peer)?;
        }
        for &(peer, _) in recvs {
            self.check_peer(peer)?;
        }
        let describe = |send: bool, peer: usize, chan: Chan| {
            let (dir, prep) = if send {
                ("SEND", "to")
            } else {
                ("RECV", "from")
            };
            match ctx {
                None => format!("{dir} {} {prep} rank {peer}", chan.tag),
                Some(c) => format!("{c}: {dir} {prep} rank {peer}"),
            }
        };
        let deadline = Instant::now() + self.timeout;
        let eager = ctx.is_none() && self.mode == Mode::Eager;
        if eager {
            for &(peer, chan, data) in sends {
                self.deliver(peer, &Msg::Data(chan, data))?;
            }
        } else {
            for &(peer, chan) in recvs {
                self.deliver(peer, &Msg::Ready(chan))?;
            }
        }
        let mut sent = vec![eager; sends.len()];
        let mut got: Vec<Option<Tensor>> = vec![None; recvs.len()];
        let mut st = self.inbox.lock();
        loop {
            if let Some((rank, what)) = &st.failure {
                return Err(Error::PeerFailed {
                    rank: *rank,
                    what: what.clone(),
                });
            }
            let mut ship = Vec::new();
            for (i, &(peer, chan, _)) in sends.iter().enumerate() {
                if !sent[i] && take_ready(&mut st, (peer, chan)) {
                    sent[i] = true;
                    ship.push(i);
                }
            }
            for (j, &(peer, chan)) in recvs.iter().enumerate() {
                if got[j].is_none() {
                    got[j] = take_data(&mut st, (peer, chan));
                }
            }
            if !ship.is_empty() {
                drop(st);
                for i in ship {
                    let (peer, chan, data) = sends[i];
                    self.deliver(peer, &Msg::Data(chan, data))?;
                }
                st = self.inbox.lock();
                continue;
            }
            // What is still pending: (is send, peer, channel).
            let pending: Vec<(bool, usize, Chan)> = sends
                .iter()
                .zip(&sent)
                .filter(|(_, &done)| !done)
                .map(|(&(p, c, _), _)| (true, p, c))
                .chain(
                    recvs
                        .iter()
                        .zip(&got)
                        .filter(|(_, g)| g.is_none())
                        .map(|(&(p, c), _)| (false, p, c)),
                )
                .collect();
            let Some(&(send, peer, chan)) = pending.first() else {
                return Ok(got.into_iter().map(Option::unwrap_or_default).collect());
            };
            if let Some(&(s, p, c)) = pending
                .iter()
                .find(|&&(_, p, _)| st.departed.get(p).copied().unwrap_or(false))
            {
                return Err(Error::PeerFailed {
                    rank: p,
                    what: format!(
                        "closed its communicator while rank {} waited for {}",
                        self.rank,
                        describe(s, p, c)
                    ),
                });
            }
            st.waiting_on.clear();
            st.waiting_on.extend(pending.iter().map(|&(_, p, _)| p));
            let now = Instant::now();
            if now >= deadline {
                let mut waiting_for = describe(send, peer, chan);
                match pending.len() - 1 {
                    0 => {}
                    1 => waiting_for.push_str(" (and 1 more transfer of the batch)"),
                    n => waiting_for.push_str(&format!(" (and {n} more transfers of the batch)")),
                }
                self.inbox.note_timeout(&mut st, peer, &waiting_for);
                return Err(Error::Timeout {
                    after: self.timeout,
                    waiting_for,
                });
            }
            st = self
                .inbox
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    pub(crate) fn batch(
        &mut self,
        sends: &[(usize, Tag, &[f32])],
        recvs: &[(usize, Tag, usize)],
    ) -> Result<Vec<Tensor>, Error> {
        let p2p = |tag| Chan { op: Op::P2p, tag };
        let sends: Vec<SendOf<'_>> = sends.iter().map(|&(p, t, d)| (p, p2p(t), d)).collect();
        let chans: Vec<(usize, Chan)> = recvs.iter().map(|&(p, t, _)| (p, p2p(t))).collect();
        let got = self.exchange(&sends, &chans, None)?;
        for (&(p, t, len), data) in recvs.iter().zip(&got) {
            if data.len() != len {
                return Err(Error::Invalid(format!(
                    "RECV {t} from rank {p}: rank {p} sent {} values, rank {} expected {len}; \
                     the two ranks' models disagree on the tensor's shape",
                    data.len(),
                    self.rank
                )));
            }
        }
        Ok(got)
    }

    fn check_group(&self, what: &str, root: Option<usize>, group: &[usize]) -> Result<(), Error> {
        let bad = |why: String| {
            Err(Error::Invalid(format!(
                "{what} over ranks {group:?}: {why}"
            )))
        };
        if group.windows(2).any(|w| w[0] >= w[1]) {
            return bad("the group must be sorted, without repeats".into());
        }
        if let Some(&last) = group.last() {
            if last >= self.world {
                return bad(format!(
                    "rank {last} does not exist (world of {} ranks)",
                    self.world
                ));
            }
        }
        if group.binary_search(&self.rank).is_err() {
            return bad(format!("this rank ({}) is not a member", self.rank));
        }
        if let Some(root) = root {
            if group.binary_search(&root).is_err() {
                return bad(format!("the root ({root}) is not a member"));
            }
        }
        Ok(())
    }

    fn bcast_in(
        &self,
        root: usize,
        group: &[usize],
        chan: Chan,
        buf: &mut [f32],
        ctx: &str,
    ) -> Result<(), Error> {
        if group.len() <= 1 {
            return Ok(());
        }
        if self.rank == root {
            let sends: Vec<SendOf<'_>> = group
                .iter()
                .filter(|&&r| r != root)
                .map(|&r| (r, chan, &*buf))
                .collect();
            self.exchange(&sends, &[], Some(ctx))?;
        } else {
            let got = self
                .exchange(&[], &[(root, chan)], Some(ctx))?
                .pop()
                .unwrap_or_default();
            if got.len() != buf.len() {
                return Err(Error::Invalid(format!(
                    "{ctx}: rank {root} sent {} values, rank {}'s buffer holds {}",
                    got.len(),
                    self.rank,
                    buf.len()
                )));
            }
            buf.copy_from_slice(&got);
        }
        Ok(())
    }

    fn reduce_in(
        &self,
        root: usize,
        group: &[usize],
        chan: Chan,
        buf: &mut [f32],
        ctx: &str,
    ) -> Result<(), Error> {
        if group.len() <= 1 {
            return Ok(());
        }
        if self.rank != root {
            self.exchange(&[(root, chan, &*buf)], &[], Some(ctx))?;
            return Ok(());
        }
        let others: Vec<(usize, Chan)> = group
            .iter()
            .filter(|&&r| r != root)
            .map(|&r| (r, chan))
            .collect();
        let got = self.exchange(&[], &others, Some(ctx))?;
        for (&(r, _), g) in others.iter().zip(&got) {
            if g.len() != buf.len() {
                return Err(Error::Invalid(format!(
                    "{ctx}: rank {r} sent {} values, rank {root}'s buffer holds {}",
                    g.len(),
                    buf.len()
                )));
            }
        }
        // Sum in group order, whatever the root: deterministic results.
        let mut received = got.iter();
        let mut parts = group.iter().map(|&r| {
            if r == root {
                &*buf
            } else {
                received.next().map(Vec::as_slice).unwrap_or(&[])
            }
        });
        let mut acc: Vec<f32> = parts.next().unwrap_or(&[]).to_vec();
        for part in parts {
            for (a, x) in acc.iter_mut().zip(part) {
                *a += x;
            }
        }
        buf.copy_from_slice(&acc);
        Ok(())
    }

    pub(crate) fn broadcast(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), Error> {
        let ctx = format!("broadcast {tag} from rank {root} over ranks {group:?}");
        self.check_group(&ctx, Some(root), group)?;
        self.bcast_in(root, group, Chan { op: Op::Bcast, tag }, buf, &ctx)
    }

    pub(crate) fn reduce(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), Error> {
        let ctx = format!("reduce {tag} onto rank {root} over ranks {group:?}");
        self.check_group(&ctx, Some(root), group)?;
        self.reduce_in(
            root,
            group,
            Chan {
                op: Op::Reduce,
                tag,
            },
            buf,
            &ctx,
        )
    }

    pub(crate) fn all_reduce(
        &mut self,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), Error> {
        let ctx = format!("all-reduce {tag} over ranks {group:?}");
        self.check_group(&ctx, None, group)?;
        let Some(&root) = group.first() else {
            return Ok(());
        };
        self.reduce_in(
            root,
            group,
            Chan {
                op: Op::AllReduceUp,
                tag,
            },
            buf,
            &ctx,
        )?;
        self.bcast_in(
            root,
            group,
            Chan {
                op: Op::AllReduceDown,
                tag,
            },
            buf,
            &ctx,
        )
    }

    pub(crate) fn barrier(&mut self) -> Result<(), Error> {
        let group: Vec<usize> = (0..self.world).collect();
        let tag = Tag::new(0, 0, 0);
        self.reduce_in(
            0,
            &group,
            Chan {
                op: Op::BarrierUp,
                tag,
            },
            &mut [],
            "barrier",
        )?;
        self.bcast_in(
            0,
            &group,
            Chan {
                op: Op::BarrierDown,
                tag,
            },
            &mut [],
            "barrier",
        )
    }

    pub(crate) fn abort(&mut self, what: &str) {
        self.aborter().abort(what);
    }
}

/// Implements [`Comm`] and [`HostComm`] for a type with an `ep: Endpoint` field.
macro_rules! host_comm {
    ($t:ty) => {
        impl $crate::comm::Comm for $t {
            type Error = $crate::comm::Error;

            fn rank(&self) -> usize {
                self.ep.rank()
            }
            fn world(&self) -> usize {
                self.ep.world()
            }
            fn batch(
                &mut self,
                sends: &[(usize, $crate::comm::Tag, &[f32])],
                recvs: &[(usize, $crate::comm::Tag, usize)],
            ) -> Result<Vec<$crate::comm::Tensor>, $crate::comm::Error> {
                self.ep.batch(sends, recvs)
            }
            fn broadcast(
                &mut self,
                root: usize,
                group: &[usize],
                tag: $crate::comm::Tag,
                buf: &mut [f32],
            ) -> Result<(), $crate::comm::Error> {
                self.ep.broadcast(root, group, tag, buf)
            }
            fn reduce(
                &mut self,
                root: usize,
                group: &[usize],
                tag: $crate::comm::Tag,
                buf: &mut [f32],
            ) -> Result<(), $crate::comm::Error> {
                self.ep.reduce(root, group, tag, buf)
            }
            fn all_reduce(
                &mut self,
                group: &[usize],
                tag: $crate::comm::Tag,
                buf: &mut [f32],
            ) -> Result<(), $crate::comm::Error> {
                self.ep.all_reduce(group, tag, buf)
            }
            fn barrier(&mut self) -> Result<(), $crate::comm::Error> {
                self.ep.barrier()
            }
            fn abort(&mut self, what: &str) {
                self.ep.abort(what)
            }
        }

        impl $crate::host::HostComm for $t {
            fn aborter(&self) -> $crate::host::Aborter {
                self.ep.aborter()
            }
            fn timeout(&self) -> std::time::Duration {
                self.ep.timeout()
            }
            fn set_timeout(&mut self, timeout: std::time::Duration) {
                self.ep.set_timeout(timeout)
            }
            fn mode(&self) -> $crate::host::Mode {
                self.ep.mode()
            }
            fn set_mode(&mut self, mode: $crate::host::Mode) {
                self.ep.set_mode(mode)
            }
        }
    };
}
pub(crate) use host_comm;

/// Runs `f` once per communicator, each on its own thread (named `rank R`), and
/// returns every rank's outcome in rank order.
///
/// A rank whose `f` returns an error or panics is aborted with the error's text (or
/// `panicked: MESSAGE`), so that the other ranks stop promptly with
/// [`Error::PeerFailed`] naming it instead of waiting for their timeout; its outcome
/// is `Err` with that text. The other ranks' outcomes are whatever their `f` returned
/// (typically `Err("rank R failed: ...")`).
///
/// Each rank's communicator is closed when its `f` returns (a goodbye to the peers,
/// or the abort), whatever `f` did with it: dropping it inside `f` does nothing more.
pub fn run_comms<C, F, T, E>(comms: Vec<C>, f: F) -> Vec<Result<T, String>>
where
    C: HostComm,
    F: Fn(C) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let rank = comm.rank();
                std::thread::Builder::new()
                    .name(format!("rank {rank}"))
                    .spawn_scoped(s, move || run_one(comm, f))
                    .map_err(|e| format!("rank {rank}: cannot spawn its thread: {e}"))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.and_then(|h| {
                    h.join()
                        .unwrap_or_else(|p| Err(format!("panicked: {}", panic_message(&*p))))
                })
            })
            .collect()
    })
}

fn run_one<C, F, T, E>(comm: C, f: &F) -> Result<T, String>
where
    C: HostComm,
    F: Fn(C) -> Result<T, E>,
    E: Display,
{
    let aborter = comm.aborter();
    aborter.inbox.runner_guarded.store(true, Ordering::SeqCst);
    let outcome = match catch_unwind(AssertUnwindSafe(|| f(comm))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!("panicked: {}", panic_message(&*p))),
    };
    aborter.finish(outcome.as_ref().map(|_| ()).map_err(String::as_str));
    outcome
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link to ranks that are alive, except `dead`: writing to it fails as writing
    /// to the socket of a process that has exited does. Remembers every abort sent.
    struct DeadPeerLink {
        dead: usize,
        aborts: Mutex<Vec<(usize, usize)>>,
    }

    impl Link for DeadPeerLink {
        fn deliver(&self, to: usize, msg: &Msg<&[f32]>) -> std::io::Result<()> {
            if let Msg::Abort { origin, .. } = msg {
                self.aborts.lock().unwrap().push((to, *origin));
            }
            if to == self.dead {
                return Err(std::io::ErrorKind::ConnectionReset.into());
            }
            Ok(())
        }
        fn close(&self, _abrupt: bool) {}
    }

    /// The note must exist before any call of the rank can see the failure: a call
    /// that fails on it may end the process at once. The note goes to a FIFO here,
    /// so writing it blocks until the test reads it: meanwhile, the failure must not
    /// be visible.
    #[cfg(unix)]
    #[test]
    fn a_failure_is_visible_only_once_its_blame_note_is_written() {
        let dir = std::env::temp_dir().join(format!("mpipe-note-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let note = dir.join("rank-0.blame");
        let _ = std::fs::remove_file(&note);
        let made = std::process::Command::new("mkfifo")
            .arg(&note)
            .status()
            .expect("run mkfifo");
        assert!(made.success());
        let inbox = Arc::new(Inbox::new(0, 2, Some(note.clone())));
        let reader = {
            let inbox = inbox.clone();
            std::thread::spawn(move || inbox.lost(1, "its connection closed".into()))
        };
        // The reader thread is now blocked writing the note (no one reads the FIFO).
        std::thread::sleep(Duration::from_millis(200));
        let visible = match inbox.st.try_lock() {
            Ok(st) => st.failure.is_some(),
            Err(_) => false, // held while the note is written
        };
        assert!(
            !visible,
            "rank 0's calls see the failure before its note exists"
        );
        let text = std::fs::read_to_string(&note).unwrap();
        assert_eq!(text, "1\nits connection closed\n");
        reader.join().unwrap();
        assert!(matches!(
            inbox.failure(),
            Some(Error::PeerFailed { rank: 1, .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The stopped-rank launch test's race, made deterministic: rank 0 timed out
    /// waiting for rank 1 (stopped), and before its own abort it hears that rank 3
    /// timed out waiting for rank 0. Rank 0's note must still blame rank 1: blaming
    /// rank 3 closes a cycle 0 <-> 3 that the launcher may answer with rank 0.
    #[test]
    fn a_timeout_note_outlives_a_later_abort() {
        let dir = std::env::temp_dir().join(format!("mpipe-own-note-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let note = dir.join("rank-0.blame");
        let _ = std::fs::remove_file(&note);
        let inbox = Inbox::new(0, 4, Some(note.clone()));
        {
            let mut st = inbox.lock();
            st.waiting_on.push(1);
            inbox.note_timeout(&mut st, 1, "SEND act(unit 7, mb 5) to rank 1");
            // The call returned its timeout: it waits on no one any more.
            st.waiting_on.clear();
        }
        inbox.handle(
            3,
            Msg::Abort {
                origin: 3,
                what: "timed out waiting for rank 0".into(),
                waited_for: Some(0),
            },
        );
        let text = std::fs::read_to_string(&note).expect("rank 0 notes whom it blames");
        assert_eq!(text.lines().next(), Some("1"), "{text}");
        // A rank that did not time out still notes the failure it heard of.
        let other = dir.join("rank-2.blame");
        let _ = std::fs::remove_file(&other);
        let inbox = Inbox::new(2, 4, Some(other.clone()));
        inbox.handle(
            3,
            Msg::Abort {
                origin: 3,
                what: "timed out waiting for rank 0".into(),
                waited_for: Some(0),
            },
        );
        let text = std::fs::read_to_string(&other).expect("rank 2 notes whom it blames");
        assert_eq!(text.lines().next(), Some("3"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The launch test's race, made deterministic: rank 2 posts a receive to rank 1,
    /// which has exited, and its write sees the reset before its reader thread sees
    /// the connection end. Rank 2 must blame rank 1 (in its call's error, in
    /// mpipe-run's note, and in the abort it forwards), never claim the failure.
    #[test]
    fn a_write_to_a_dead_peer_blames_the_peer_not_the_writer() {
        let dir = std::env::temp_dir().join(format!("mpipe-blame-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let note = dir.join("rank-2.blame");
        let _ = std::fs::remove_file(&note);
        let inbox = Arc::new(Inbox::new(2, 4, Some(note.clone())));
        let link = Arc::new(DeadPeerLink {
            dead: 1,
            aborts: Mutex::new(Vec::new()),
        });
        let ep = Endpoint::new(2, 4, Duration::from_secs(5), inbox, link.clone());
        let chan = Chan {
            op: Op::P2p,
            tag: Tag::act(7, 0),
        };
        let e = ep.exchange(&[], &[(1, chan)], None).unwrap_err();
        assert!(
            matches!(&e, Error::PeerFailed { rank: 1, what } if what.contains("connection lost")),
            "{e}"
        );
        let text = std::fs::read_to_string(&note).expect("rank 2 notes whom it blames");
        assert_eq!(text.lines().next(), Some("1"), "{text}");
        // Rank 2 then aborts with its error (as every driver does on failure): the
        // others learn that rank 1 failed, not rank 2.
        ep.aborter().abort(&e.to_string());
        let aborts = link.aborts.lock().unwrap().clone();
        assert_eq!(aborts, vec![(0, 1), (1, 1), (3, 1)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
