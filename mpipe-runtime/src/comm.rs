//! The communication layer an executor drives: point-to-point transfers with
//! rendezvous semantics, posted in batches, and the collectives the program format
//! needs (`BCAST`, `REDUCE`), over flat `f32` tensors.
//!
//! [`Comm`] is what a backend implements: the host backends ([`crate::host::threads`],
//! ranks as threads; [`crate::host::tcp`], ranks as processes over loopback TCP) and,
//! later, an HCCL one. The semantics are those of program-format.md, "Execution
//! semantics", mode *rendezvous* (the host backends can also run mode *eager*, see
//! [`crate::host`]):
//!
//! - a send completes only once its receiver has posted the matching receive (it
//!   never completes "into a buffer"), so a program that deadlocks under rendezvous
//!   deadlocks here too — and then fails with a timeout instead of hanging;
//! - the transfers of one [`Comm::batch`] are all posted before the rank waits for any
//!   of them, so two ranks that send to each other in one batch do not deadlock;
//! - every blocking call is bounded by the communicator's timeout;
//! - a rank that fails calls [`Comm::abort`]; every other rank's pending and future
//!   calls then fail with [`Error::PeerFailed`] naming it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A flat host tensor (the same type as [`crate::model::Tensor`]).
pub type Tensor = Vec<f32>;

/// Identifies a transfer between two ranks: what is moved (`kind`), of which unit and
/// micro-batch.
///
/// Point-to-point transfers match by `(peer, tag)`, in posting order per pair of
/// ranks and direction; collectives use the tag only to describe themselves (and
/// to keep different collectives' messages apart). The kinds the runtime uses are
/// the associated constants ([`Tag::ACT`] ...); any other value is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    pub kind: u8,
    pub unit: u32,
    pub mb: u32,
}

impl Tag {
    /// The output of a unit's forward (`act`).
    pub const ACT: u8 = 0;
    /// The gradient a unit's backward produces for its inputs (`grad`).
    pub const GRAD: u8 = 1;
    /// A raw micro-batch (`input`).
    pub const INPUT: u8 = 2;
    /// A unit's parameters (`BCAST`).
    pub const PARAMS: u8 = 3;
    /// A unit's weight gradients (`REDUCE`).
    pub const GRADS: u8 = 4;

    pub const fn new(kind: u8, unit: u32, mb: u32) -> Tag {
        Tag { kind, unit, mb }
    }
    pub const fn act(unit: u32, mb: u32) -> Tag {
        Tag::new(Tag::ACT, unit, mb)
    }
    pub const fn grad(unit: u32, mb: u32) -> Tag {
        Tag::new(Tag::GRAD, unit, mb)
    }
    pub const fn input(unit: u32, mb: u32) -> Tag {
        Tag::new(Tag::INPUT, unit, mb)
    }
    /// `unit`'s parameters (micro-batch 0).
    pub const fn params(unit: u32) -> Tag {
        Tag::new(Tag::PARAMS, unit, 0)
    }
    /// `unit`'s weight gradients (micro-batch 0).
    pub const fn grads(unit: u32) -> Tag {
        Tag::new(Tag::GRADS, unit, 0)
    }

    /// The tag of a program transfer ([`crate::P2p`]'s `tensor`, `unit`, `mb`).
    pub fn transfer(tensor: crate::Tensor, unit: crate::UnitId, mb: usize) -> Tag {
        let kind = match tensor {
            crate::Tensor::Act => Tag::ACT,
            crate::Tensor::Grad => Tag::GRAD,
            crate::Tensor::Input => Tag::INPUT,
        };
        // Micro-batch indices are far below 2^32.
        Tag::new(kind, unit, mb as u32)
    }

    /// The kind's name: `act`, `grad`, `input`, `params`, `grads`, or `kind7`.
    pub fn kind_name(&self) -> String {
        match self.kind {
            Tag::ACT => "act".into(),
            Tag::GRAD => "grad".into(),
            Tag::INPUT => "input".into(),
            Tag::PARAMS => "params".into(),
            Tag::GRADS => "grads".into(),
            k => format!("kind{k}"),
        }
    }
}

impl From<&crate::P2p> for Tag {
    fn from(p: &crate::P2p) -> Tag {
        Tag::transfer(p.tensor, p.unit, p.mb)
    }
}

/// `act(unit 3, mb 5)`.
impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(unit {}, mb {})",
            self.kind_name(),
            self.unit,
            self.mb
        )
    }
}

/// Why a communication call failed. The host backends return this type; other
/// backends may too.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// A blocking wait reached the communicator's timeout. `waiting_for` names the
    /// first transfer that had not completed, e.g. `RECV act(unit 3, mb 5) from rank 1`.
    #[error("timed out after {after:?} waiting for {waiting_for}")]
    Timeout {
        after: Duration,
        waiting_for: String,
    },
    /// Rank `rank` failed while doing `what` (it called [`Comm::abort`], panicked,
    /// closed its communicator while this rank still needed it, or its connection was
    /// lost). Every later call on this communicator returns this error again.
    #[error("rank {rank} failed: {what}")]
    PeerFailed { rank: usize, what: String },
    /// The call itself is wrong (a rank out of range, a group that is not sorted or
    /// misses this rank or the root, buffers of different lengths on different
    /// members of a collective).
    #[error("invalid communication call: {0}")]
    Invalid(String),
    /// Setting the communicator up failed (bad environment, rendezvous with the other
    /// ranks not completed).
    #[error("communicator setup failed: {0}")]
    Setup(String),
    /// An operating-system error.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// The failed rank, for [`Error::PeerFailed`].
    pub fn failed_rank(&self) -> Option<usize> {
        match self {
            Error::PeerFailed { rank, .. } => Some(*rank),
            _ => None,
        }
    }
}

/// One rank's endpoint of a communicator over ranks `0..world()`.
///
/// Calls are blocking and bounded by the communicator's timeout. After any error
/// other than [`Error::Invalid`] the pairing state between ranks is unspecified: the
/// caller should [`abort`](Comm::abort) and stop using the communicator.
pub trait Comm {
    type Error: std::error::Error + Send + Sync + 'static;

    /// This rank, in `0..world()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world(&self) -> usize;

    /// Posts `sends` and `recvs` together (one batch, like HCCL's
    /// `HcclBatchSendRecv`) and returns when every one of them has met its partner.
    ///
    /// - Rendezvous: a send `(peer, tag, data)` completes only once `peer` has posted
    ///   the matching receive `(self, tag)`; a receive completes when the data has
    ///   arrived. Everything is posted before anything is waited for, so crossing
    ///   transfers inside one batch do not deadlock (two ranks that each *send* to the
    ///   other in separate batches before receiving do, and time out).
    /// - Matching is by `(peer, tag)`, in posting order per pair of ranks and
    ///   direction: the k-th send from `a` to `b` with tag `t` meets the k-th receive
    ///   on `b` from `a` with tag `t`.
    /// - Each receive `(peer, tag, len)` states the element count it expects: message
    ///   sizes are static (the model's shapes), as HCCL requires, so no length travels
    ///   with the data. A sender whose message has another length is a shape mismatch
    ///   between the two ranks' models: the receive fails (the host backends: with
    ///   [`Error::Invalid`] naming both lengths; HCCL: with a parameter error).
    /// - Returns the received tensors in `recvs` order. A rank may send to itself if
    ///   the receive is in the same batch.
    /// - Fails with a timeout naming the first transfer not completed, or with
    ///   [`Error::PeerFailed`] once any rank has aborted.
    fn batch(
        &mut self,
        sends: &[(usize, Tag, &[f32])],
        recvs: &[(usize, Tag, usize)],
    ) -> Result<Vec<Tensor>, Self::Error>;

    /// Sends `data` to `peer` (a batch of one send).
    fn send(&mut self, peer: usize, tag: Tag, data: &[f32]) -> Result<(), Self::Error> {
        self.batch(&[(peer, tag, data)], &[]).map(|_| ())
    }

    /// Receives a tensor of `len` elements from `peer` (a batch of one receive).
    fn recv(&mut self, peer: usize, tag: Tag, len: usize) -> Result<Tensor, Self::Error> {
        let mut got = self.batch(&[], &[(peer, tag, len)])?;
        Ok(got.pop().unwrap_or_default())
    }

    /// Copies `root`'s `buf` into every other member's `buf`.
    ///
    /// Collectives run over `group`: sorted, distinct ranks that include this rank
    /// and `root`. Every member calls the collective with the same `root`, `group`
    /// and `tag`, and a `buf` of the same length; collectives on one group complete
    /// in the order they are called. The call returns when this member's part is done
    /// (for the root, when every member has received).
    fn broadcast(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), Self::Error>;

    /// Sums the members' `buf` element-wise into `root`'s `buf` (group as in
    /// [`broadcast`](Comm::broadcast)). The other members' `buf` is unspecified
    /// afterwards. The summation order is the group's order, whatever the root, so
    /// the result is deterministic.
    fn reduce(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), Self::Error>;

    /// Sums the members' `buf` element-wise into every member's `buf` (group as in
    /// [`broadcast`](Comm::broadcast)); all members get bit-identical results.
    fn all_reduce(&mut self, group: &[usize], tag: Tag, buf: &mut [f32])
        -> Result<(), Self::Error>;

    /// Returns once every rank of the world has called `barrier` (as many times).
    fn barrier(&mut self) -> Result<(), Self::Error>;

    /// Tells every other rank that this rank failed while doing `what` (e.g.
    /// ``action 17 `SEND act(llm.0,3)->1` ``): their pending and future calls fail
    /// with an error naming this rank and `what` (for the host backends,
    /// [`Error::PeerFailed`]), within well under a second. Never blocks for long and
    /// never fails; calling it again, or after this rank learnt of another rank's
    /// failure, is harmless (the first failure is what every rank reports).
    fn abort(&mut self, what: &str);
}
