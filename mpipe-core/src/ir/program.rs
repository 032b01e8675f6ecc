//! The derived program: the `mpipe-program/1` interchange format
//! (`docs/spec/program-format.md`), as plain data.
//!
//! This module only defines the types and their JSON mapping; the passes that read
//! them live elsewhere ([`crate::judge::verify`], [`crate::judge::simulate`]). Unit names are kept
//! as strings, exactly as a file spells them, so a hand-written program with an
//! unknown name still loads and the verifier can say what is wrong with it.

pub use crate::ir::role::Role;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A unit name inside actions: shared, so a million actions naming a dozen units
/// cost a dozen allocations, not a million; and behind one thin pointer (8 bytes,
/// where an `Arc<str>` is 16 with its length), so an [`Action`] is 24 bytes: a step
/// at the largest size holds millions of actions, and the derivation's and `mpipe
/// trace`'s peaks hold a named program. Reads as the `str` it names.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(Arc<Box<str>>);

impl Name {
    /// The address of the shared text: equal for a name and its clones, so a cache
    /// of look-ups can key by it while the names it has seen are alive (names
    /// built apart from equal text have different addresses).
    pub fn addr(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }
}

/// Unit names as a pass looks them up, by the address of their shared text
/// ([`Name::addr`]): a program's actions share their unit's name, so a look-up is
/// mostly one comparison. A direct-mapped table indexed by that address: heap
/// blocks are 16-byte aligned, so the bits above the lowest four tell names apart.
/// Equal address is the same text (the names are borrowed while this is used); a
/// name elsewhere, or pushed out, is looked up again.
pub(crate) struct NameCache {
    /// Address (0: none) and the unit it names.
    slots: [(usize, Option<u32>); NameCache::SLOTS],
}

impl NameCache {
    /// How many names are remembered (a power of two): a rank names a few units
    /// (its stages' and their neighbours').
    const SLOTS: usize = 16;
    /// The address bits below a heap block's alignment.
    const ALIGN_BITS: u32 = 4;

    /// Nothing looked up yet (no name's address is null).
    pub(crate) fn new() -> NameCache {
        NameCache {
            slots: [(0, None); NameCache::SLOTS],
        }
    }

    /// The unit `look` finds for `name`'s text, remembered for the next calls.
    #[inline(always)]
    pub(crate) fn get(
        &mut self,
        name: &Name,
        look: impl FnOnce(&str) -> Option<u32>,
    ) -> Option<u32> {
        let addr = name.addr();
        let slot = &mut self.slots[(addr >> NameCache::ALIGN_BITS) & (NameCache::SLOTS - 1)];
        if slot.0 == addr {
            return slot.1;
        }
        *slot = (addr, look(name));
        slot.1
    }
}

impl std::ops::Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Name {
    fn from(s: &str) -> Name {
        Name(Arc::new(Box::from(s)))
    }
}

impl From<String> for Name {
    fn from(s: String) -> Name {
        Name(Arc::new(s.into_boxed_str()))
    }
}

impl From<&String> for Name {
    fn from(s: &String) -> Name {
        Name::from(s.as_str())
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Name, D::Error> {
        String::deserialize(d).map(Name::from)
    }
}

/// The value of the `format` key of every program document.
pub const FORMAT: &str = "mpipe-program/1";

/// The most micro-batches per step mpipe derives, simulates or re-derives (a step's
/// program holds every action of every micro-batch; training steps have hundreds,
/// not tens of thousands).
pub const MAX_MICROBATCHES: usize = 65_536;

/// The most (rank, micro-batch) pairs mpipe derives, simulates or re-derives:
/// `ranks x microbatches` bounds a program's size, and so its time and memory to
/// derive (`1f1b` at 8 x 65536: 34 s and 1.2 GB on a 2-core test machine; twice that
/// size took twice both).
pub const MAX_RANK_MICROBATCHES: usize = 1 << 19;

/// The largest time or size a program's unit may give (`cost.F`, `act`, `params`,
/// ...). A derived unit holds at most a profile's figure (`profile::MAX_FIGURE`, 1e9)
/// times its layers (`profile::MAX_LAYERS`), about 1e12; the limit leaves room for
/// hand-written programs while every sum over a step stays finite (1e308 made `refine`
/// fail with an internal error).
pub const MAX_UNIT_FIGURE: f64 = 1e15;

/// Which of the size limits a step of `ranks x microbatches` is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverLimit {
    /// More than [`MAX_MICROBATCHES`] micro-batches.
    Microbatches,
    /// More than [`MAX_RANK_MICROBATCHES`] (rank, micro-batch) pairs.
    Pairs,
}

/// The size limit a step of `ranks x microbatches` breaks, if any (the micro-batch
/// count first). Every reader and writer of programs asks this one question, each
/// answering in its own words.
pub fn over_limit(ranks: usize, microbatches: usize) -> Option<OverLimit> {
    if microbatches > MAX_MICROBATCHES {
        Some(OverLimit::Microbatches)
    } else if ranks.saturating_mul(microbatches.max(1)) > MAX_RANK_MICROBATCHES {
        Some(OverLimit::Pairs)
    } else {
        None
    }
}

/// A whole program: every rank's action list for one training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// Always [`FORMAT`].
    pub format: String,
    /// Number of pipeline ranks; `programs.len()` must equal it.
    pub ranks: usize,
    /// Number of micro-batches in one step.
    pub microbatches: usize,
    /// The model's units in topological order.
    pub units: Vec<Unit>,
    /// `programs[r]` is rank `r`'s action list, in execution order.
    #[serde(deserialize_with = "lists_sharing_names")]
    pub programs: Vec<Vec<Action>>,
    /// Where the program came from (written by the derivation, ignored by readers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,
    /// Extension: forwards that run one step ahead. For each entry, the `F` of
    /// `(unit, mb)` in this program, and the transfers of its activation, compute the
    /// *next* step's micro-batch `mb`; this step's readers of that activation use the
    /// copy the previous step left (on the rank that computed it or received it),
    /// except readers that are themselves prefetched for `mb` (the next layer of a
    /// frozen encoder cut into layers): they compute the next step's too, so they read
    /// this step's copy, as any reader in the base format. Only frozen units qualify
    /// (the next step's forward must not read parameters this step updates), and a
    /// prefetched unit's inputs are all prefetched for the same `mb` (a forward for
    /// the next step cannot read this step's data). Absent or empty: every action belongs to this step, as in
    /// the base format.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefetch: Vec<Prefetch>,
}

/// One forward computed for the next step (see [`Program::prefetch`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Prefetch {
    pub unit: Name,
    pub mb: usize,
}

/// Provenance of a derived program: an extension key, ignored by other readers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Source {
    /// The schedule expression, as written.
    pub expr: String,
}

/// One unit of the model: an encoder, a pipeline stage or a virtual-stage chunk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "UnitFile", into = "UnitFile")]
pub struct Unit {
    pub name: String,
    /// Units whose forward output this unit consumes (empty: reads the raw micro-batch).
    pub inputs: Vec<String>,
    /// Rank that owns the parameters and applies the optimizer step.
    pub home: usize,
    /// `false` marks frozen parameters.
    pub trainable: bool,
    pub cost: Cost,
    /// Activation memory one micro-batch's forward keeps for its backward.
    pub act: f64,
    /// Extension: size of one micro-batch's output activation (and of its gradient),
    /// for the communication cost model. Absent means 0.
    pub bytes: f64,
    /// Extension: size of the unit's parameters, for broadcasts and reductions
    /// under the communication cost model, and for the memory limit. Absent means 0.
    pub params: f64,
    /// Extension: what the unit is in the model ([`Role`]). Absent in a file means
    /// what the name says by mpipe's convention ([`Role::of_name`]); written only
    /// where it differs.
    pub role: Role,
}

/// A [`Unit`] as a program file spells it.
#[derive(Clone, Serialize, Deserialize)]
struct UnitFile {
    name: String,
    inputs: Vec<String>,
    home: usize,
    trainable: bool,
    cost: Cost,
    act: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    bytes: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    params: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    role: Option<Role>,
}

impl From<UnitFile> for Unit {
    fn from(u: UnitFile) -> Unit {
        let role = u.role.unwrap_or_else(|| Role::of_name(&u.name));
        Unit {
            name: u.name,
            inputs: u.inputs,
            home: u.home,
            trainable: u.trainable,
            cost: u.cost,
            act: u.act,
            bytes: u.bytes,
            params: u.params,
            role,
        }
    }
}

impl From<Unit> for UnitFile {
    fn from(u: Unit) -> UnitFile {
        let role = (u.role != Role::of_name(&u.name)).then_some(u.role);
        UnitFile {
            name: u.name,
            inputs: u.inputs,
            home: u.home,
            trainable: u.trainable,
            cost: u.cost,
            act: u.act,
            bytes: u.bytes,
            params: u.params,
            role,
        }
    }
}

impl Unit {
    /// One micro-batch's compute on this unit: `F`, plus `B + W` if it is trainable.
    /// That is all of it for an encoder (its backward runs only when it is trained)
    /// and for an LLM stage (always trained); a frozen unit downstream of a trained
    /// The unit's times and sizes by key (`cost.F`, `act`, ...), each of which must be
    /// finite and >= 0.
    pub fn numbers(&self) -> [(&'static str, f64); 6] {
        [
            ("cost.F", self.cost.f),
            ("cost.B", self.cost.b),
            ("cost.W", self.cost.w),
            ("act", self.act),
            ("bytes", self.bytes),
            ("params", self.params),
        ]
    }

    /// one would also run a `B`, which this leaves out.
    pub fn work(&self) -> f64 {
        self.cost.f
            + if self.trainable {
                self.cost.b + self.cost.w
            } else {
                0.0
            }
    }
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Time of one micro-batch's forward, input-gradient and weight-gradient backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    #[serde(rename = "F")]
    pub f: f64,
    #[serde(rename = "B")]
    pub b: f64,
    #[serde(rename = "W")]
    pub w: f64,
}

/// The compute operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Op {
    F,
    B,
    W,
    BW,
    RF,
}

impl Op {
    /// The op's name as the format spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::F => "F",
            Op::B => "B",
            Op::W => "W",
            Op::BW => "BW",
            Op::RF => "RF",
        }
    }

    /// Time this op takes on a unit of cost `c` (`BW` = `B + W`, `RF` = `F`).
    pub fn cost(self, c: &Cost) -> f64 {
        match self {
            Op::F | Op::RF => c.f,
            Op::B => c.b,
            Op::W => c.w,
            Op::BW => c.b + c.w,
        }
    }
}

/// The tensor a point-to-point transfer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tensor {
    /// Output of `F(unit, mb)` (or `RF`).
    Act,
    /// Gradient produced by `B(unit, mb)` (or `BW`) for the unit's inputs.
    Grad,
    /// Raw micro-batch `mb` of a unit with no inputs.
    Input,
}

impl Tensor {
    pub fn as_str(self) -> &'static str {
        match self {
            Tensor::Act => "act",
            Tensor::Grad => "grad",
            Tensor::Input => "input",
        }
    }
}

/// Direction of a point-to-point action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    Send,
    Recv,
}

impl Dir {
    /// A transfer's two ends, `(sender, receiver)`, for the end on `me` whose
    /// partner is `peer`.
    pub fn ends<T>(self, me: T, peer: T) -> (T, T) {
        match self {
            Dir::Send => (me, peer),
            Dir::Recv => (peer, me),
        }
    }

    /// The direction of the transfer's other end.
    pub fn facing(self) -> Dir {
        match self {
            Dir::Send => Dir::Recv,
            Dir::Recv => Dir::Send,
        }
    }
}

/// One action of a rank's list. Serialized with the `op` key as the tag, exactly as
/// docs/spec/program-format.md spells it.
///
/// Micro-batch and rank numbers are held in 32 bits and a collective's group behind
/// one pointer, its unit name behind one thin pointer ([`Name`]), so an action is 24 bytes (a step at the largest size holds millions
/// of them, and `mpipe trace` holds one beside its simulation). The builders
/// ([`Action::compute`], [`Action::p2p`], [`Action::coll`]) take `usize`; a number
/// over `u32::MAX` is kept as `u32::MAX`, which is out of range for every program
/// ([`MAX_RANK_MICROBATCHES`]), so the verifier still reports it; the views
/// ([`Action::view`]) give `usize` back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op")]
pub enum Action {
    F {
        unit: Name,
        mb: u32,
    },
    B {
        unit: Name,
        mb: u32,
    },
    W {
        unit: Name,
        mb: u32,
    },
    BW {
        unit: Name,
        mb: u32,
    },
    RF {
        unit: Name,
        mb: u32,
    },
    SEND {
        tensor: Tensor,
        unit: Name,
        mb: u32,
        peer: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        batch: Option<Batch>,
    },
    RECV {
        tensor: Tensor,
        unit: Name,
        mb: u32,
        peer: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        batch: Option<Batch>,
    },
    BCAST {
        unit: Name,
        root: u32,
        group: Group,
    },
    REDUCE {
        unit: Name,
        root: u32,
        group: Group,
    },
}

/// `n` in 32 bits; `u32::MAX` if it is larger (out of range for any program, so a
/// check still reports it).
pub fn narrow(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Batch `n`, or [`Batch::MAX`] if it is larger (no program numbers 4 billion
/// batches; a reader bounds its input before it builds actions).
fn batch_of(n: u64) -> Batch {
    Batch::new(n.min(Batch::MAX)).expect("at most Batch::MAX")
}

/// The batch number of a transfer (`batch` in the format): 0 to `u32::MAX - 1`, held
/// in 4 bytes with `None` free (`Option<Batch>` is 4 bytes).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Batch(std::num::NonZeroU32);

impl Batch {
    /// The largest batch number a program may hold.
    pub const MAX: u64 = u32::MAX as u64 - 1;

    /// Batch `n`, if it is at most [`Batch::MAX`].
    pub fn new(n: u64) -> Option<Batch> {
        let n = u32::try_from(n.checked_add(1)?).ok()?;
        std::num::NonZeroU32::new(n).map(Batch)
    }

    /// The batch number.
    pub fn get(self) -> u64 {
        u64::from(self.0.get()) - 1
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

impl Serialize for Batch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.get())
    }
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Batch, D::Error> {
        let n = u64::deserialize(d)?;
        Batch::new(n).ok_or_else(|| {
            serde::de::Error::custom(format_args!(
                "batch {n} is over the largest batch number, {}: number batches from 0",
                Batch::MAX
            ))
        })
    }
}

/// The ranks of a collective (`group` in the format), behind one pointer: cheap to
/// clone, and it keeps [`Action`] small.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Group(Arc<Vec<usize>>);

impl std::ops::Deref for Group {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        &self.0
    }
}

impl From<Vec<usize>> for Group {
    fn from(v: Vec<usize>) -> Group {
        Group(Arc::new(v))
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for Group {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Group {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Group, D::Error> {
        Vec::<usize>::deserialize(d).map(Group::from)
    }
}

/// A borrowed view of a compute action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeRef<'a> {
    pub op: Op,
    pub unit: &'a str,
    pub mb: usize,
}

/// A borrowed view of a point-to-point action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pRef<'a> {
    pub dir: Dir,
    pub tensor: Tensor,
    pub unit: &'a str,
    pub mb: usize,
    pub peer: usize,
    pub batch: Option<u64>,
}

/// A point-to-point action's fields as the action holds them (the unit's shared
/// [`Name`], the numbers in their 32 bits), for passes that read every action of a
/// large program and compare or copy these fields as they are: [`P2pRef`] widens
/// the numbers and borrows the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pFields<'a> {
    pub dir: Dir,
    pub tensor: Tensor,
    pub unit: &'a Name,
    pub mb: u32,
    pub peer: u32,
    pub batch: Option<Batch>,
}

/// Kind of a collective action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CollKind {
    Bcast,
    Reduce,
}

/// A borrowed view of a collective action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollRef<'a> {
    pub kind: CollKind,
    pub unit: &'a str,
    pub root: usize,
    pub group: &'a [usize],
}

/// The three shapes an action can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionRef<'a> {
    Compute(ComputeRef<'a>),
    P2p(P2pRef<'a>),
    Coll(CollRef<'a>),
}

impl Action {
    /// Build a compute action.
    pub fn compute(op: Op, unit: impl Into<Name>, mb: usize) -> Action {
        let (unit, mb) = (unit.into(), narrow(mb));
        match op {
            Op::F => Action::F { unit, mb },
            Op::B => Action::B { unit, mb },
            Op::W => Action::W { unit, mb },
            Op::BW => Action::BW { unit, mb },
            Op::RF => Action::RF { unit, mb },
        }
    }

    /// Build a point-to-point action.
    pub fn p2p(
        dir: Dir,
        tensor: Tensor,
        unit: impl Into<Name>,
        mb: usize,
        peer: usize,
        batch: Option<u64>,
    ) -> Action {
        let (unit, mb, peer) = (unit.into(), narrow(mb), narrow(peer));
        let batch = batch.map(batch_of);
        match dir {
            Dir::Send => Action::SEND {
                tensor,
                unit,
                mb,
                peer,
                batch,
            },
            Dir::Recv => Action::RECV {
                tensor,
                unit,
                mb,
                peer,
                batch,
            },
        }
    }

    /// Build a collective action.
    pub fn coll(kind: CollKind, unit: impl Into<Name>, root: usize, group: Vec<usize>) -> Action {
        let (unit, root, group) = (unit.into(), narrow(root), Group::from(group));
        match kind {
            CollKind::Bcast => Action::BCAST { unit, root, group },
            CollKind::Reduce => Action::REDUCE { unit, root, group },
        }
    }

    /// The `batch` number of a `SEND` or `RECV` (`None` for other actions).
    pub fn batch(&self) -> Option<u64> {
        match self {
            Action::SEND { batch, .. } | Action::RECV { batch, .. } => batch.map(Batch::get),
            _ => None,
        }
    }

    /// Set the `batch` number of a `SEND` or `RECV` (other actions have none: no
    /// change); a number over [`Batch::MAX`] is kept as [`Batch::MAX`].
    pub fn set_batch(&mut self, to: Option<u64>) {
        if let Action::SEND { batch, .. } | Action::RECV { batch, .. } = self {
            *batch = to.map(batch_of);
        }
    }

    /// A borrowed, shape-oriented view, so passes match on three cases, not nine.
    pub fn view(&self) -> ActionRef<'_> {
        use Action::*;
        match self {
            F { unit, mb } => ActionRef::Compute(ComputeRef {
                op: Op::F,
                unit,
                mb: *mb as usize,
            }),
            B { unit, mb } => ActionRef::Compute(ComputeRef {
                op: Op::B,
                unit,
                mb: *mb as usize,
            }),
            W { unit, mb } => ActionRef::Compute(ComputeRef {
                op: Op::W,
                unit,
                mb: *mb as usize,
            }),
            BW { unit, mb } => ActionRef::Compute(ComputeRef {
                op: Op::BW,
                unit,
                mb: *mb as usize,
            }),
            RF { unit, mb } => ActionRef::Compute(ComputeRef {
                op: Op::RF,
                unit,
                mb: *mb as usize,
            }),
            SEND {
                tensor,
                unit,
                mb,
                peer,
                batch,
            } => ActionRef::P2p(P2pRef {
                dir: Dir::Send,
                tensor: *tensor,
                unit,
                mb: *mb as usize,
                peer: *peer as usize,
                batch: batch.map(Batch::get),
            }),
            RECV {
                tensor,
                unit,
                mb,
                peer,
                batch,
            } => ActionRef::P2p(P2pRef {
                dir: Dir::Recv,
                tensor: *tensor,
                unit,
                mb: *mb as usize,
                peer: *peer as usize,
                batch: batch.map(Batch::get),
            }),
            BCAST { unit, root, group } => ActionRef::Coll(CollRef {
                kind: CollKind::Bcast,
                unit,
                root: *root as usize,
                group,
            }),
            REDUCE { unit, root, group } => ActionRef::Coll(CollRef {
                kind: CollKind::Reduce,
                unit,
                root: *root as usize,
                group,
            }),
        }
    }

    /// This action's fields if it is a `SEND` or a `RECV` ([`P2pFields`]).
    #[inline]
    pub fn p2p_fields(&self) -> Option<P2pFields<'_>> {
        let (dir, tensor, unit, mb, peer, batch) = match self {
            Action::SEND {
                tensor,
                unit,
                mb,
                peer,
                batch,
            } => (Dir::Send, tensor, unit, mb, peer, batch),
            Action::RECV {
                tensor,
                unit,
                mb,
                peer,
                batch,
            } => (Dir::Recv, tensor, unit, mb, peer, batch),
            _ => return None,
        };
        Some(P2pFields {
            dir,
            tensor: *tensor,
            unit,
            mb: *mb,
            peer: *peer,
            batch: *batch,
        })
    }

    /// The unit this action is about.
    pub fn unit(&self) -> &str {
        match self.view() {
            ActionRef::Compute(c) => c.unit,
            ActionRef::P2p(p) => p.unit,
            ActionRef::Coll(c) => c.unit,
        }
    }

    /// The unit's name as the action holds it.
    fn unit_name_mut(&mut self) -> &mut Name {
        use Action::*;
        match self {
            F { unit, .. }
            | B { unit, .. }
            | W { unit, .. }
            | BW { unit, .. }
            | RF { unit, .. }
            | SEND { unit, .. }
            | RECV { unit, .. }
            | BCAST { unit, .. }
            | REDUCE { unit, .. } => unit,
        }
    }
}

/// [`Program::programs`] read action by action, each action's unit name replaced
/// as it is read by the first one read with the same text: the actions of a
/// program file or an embedded program share their names as a derived program's do
/// (a name read is an allocation of its own, freed at once), so a program read
/// holds 24 bytes an action, not an allocation more per action. A list expected is
/// "a sequence", serde's words for a `Vec`, so errors read as before.
fn lists_sharing_names<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Vec<Vec<Action>>, D::Error> {
    use serde::de::{DeserializeSeed, SeqAccess, Visitor};
    use std::collections::HashSet;

    struct Lists;
    struct List<'a>(&'a mut HashSet<Name>);

    impl<'de> Visitor<'de> for Lists {
        type Value = Vec<Vec<Action>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut names = HashSet::new();
            let mut lists = Vec::new();
            while let Some(list) = seq.next_element_seed(List(&mut names))? {
                lists.push(list);
            }
            Ok(lists)
        }
    }

    impl<'de> DeserializeSeed<'de> for List<'_> {
        type Value = Vec<Action>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<Action>, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for List<'_> {
        type Value = Vec<Action>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a sequence")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut list = Vec::new();
            while let Some(mut a) = seq.next_element::<Action>()? {
                let unit = a.unit_name_mut();
                match self.0.get(&**unit) {
                    Some(shared) => *unit = shared.clone(),
                    None => {
                        self.0.insert(unit.clone());
                    }
                }
                list.push(a);
            }
            Ok(list)
        }
    }

    d.deserialize_seq(Lists)
}

impl std::fmt::Display for Action {
    /// A compact human-readable form: `F(llm.0,3)`, `SEND act(vision,2)->1 [b4]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.view() {
            ActionRef::Compute(c) => write!(f, "{}({},{})", c.op.as_str(), c.unit, c.mb),
            ActionRef::P2p(p) => {
                let (name, arrow) = match p.dir {
                    Dir::Send => ("SEND", "->"),
                    Dir::Recv => ("RECV", "<-"),
                };
                write!(
                    f,
                    "{name} {}({},{}){arrow}{}",
                    p.tensor.as_str(),
                    p.unit,
                    p.mb,
                    p.peer
                )?;
                if let Some(b) = p.batch {
                    write!(f, " [batch {b}]")?;
                }
                Ok(())
            }
            ActionRef::Coll(c) => {
                let name = match c.kind {
                    CollKind::Bcast => "BCAST",
                    CollKind::Reduce => "REDUCE",
                };
                write!(
                    f,
                    "{name}({}, root {}, group {:?})",
                    c.unit, c.root, c.group
                )
            }
        }
    }
}

impl Program {
    /// Parse a program document from JSON text.
    pub fn from_json(text: &str) -> Result<Program, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The program as pretty JSON text (deterministic: field order is fixed).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a program always serializes")
    }

    /// Index of the unit called `name`, if any.
    pub fn unit_index(&self, name: &str) -> Option<usize> {
        self.units.iter().position(|u| u.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_action_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Name>(), 8);
        assert_eq!(std::mem::size_of::<Action>(), 24);
        assert_eq!(std::mem::size_of::<Option<Batch>>(), 4);
    }

    #[test]
    fn numbers_too_large_stay_out_of_range() {
        let a = Action::p2p(
            Dir::Send,
            Tensor::Act,
            "x",
            usize::MAX,
            1 << 40,
            Some(u64::MAX),
        );
        let ActionRef::P2p(p) = a.view() else {
            panic!("a transfer")
        };
        assert_eq!((p.mb, p.peer), (u32::MAX as usize, u32::MAX as usize));
        assert_eq!(p.batch, Some(Batch::MAX));
        let e = Program::from_json(
            r#"{"format": "mpipe-program/1", "ranks": 1, "microbatches": 1, "units": [],
              "programs": [[{"op": "SEND", "tensor": "act", "unit": "x", "mb": 0, "peer": 0,
                             "batch": 4294967295}]]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("batch 4294967295 is over the largest"), "{e}");
    }

    #[test]
    fn spec_example_round_trips() {
        let text = r#"{
          "format": "mpipe-program/1", "ranks": 4, "microbatches": 8,
          "units": [
            {"name": "vision", "inputs": [], "home": 0, "trainable": true,
             "cost": {"F": 2.0, "B": 2.0, "W": 1.0}, "act": 1.0},
            {"name": "llm.0", "inputs": ["vision"], "home": 0, "trainable": true,
             "cost": {"F": 1.0, "B": 1.0, "W": 1.0}, "act": 1.0, "unknown": 3}
          ],
          "programs": [[ {"op": "F", "unit": "vision", "mb": 0},
                         {"op": "SEND", "tensor": "act", "unit": "vision", "mb": 0, "peer": 1, "batch": 2} ], [], [], []]
        }"#;
        let p = Program::from_json(text).unwrap();
        assert_eq!(p.units[1].cost.w, 1.0);
        assert_eq!(
            p.programs[0][1].to_string(),
            "SEND act(vision,0)->1 [batch 2]"
        );
        let again = Program::from_json(&p.to_json()).unwrap();
        assert_eq!(p, again);
        // The actions read share one name per unit text, across ranks too.
        let text = r#"{"format": "mpipe-program/1", "ranks": 2, "microbatches": 1, "units": [],
          "programs": [[{"op": "F", "unit": "a", "mb": 0}, {"op": "B", "unit": "b", "mb": 0},
                        {"op": "SEND", "tensor": "act", "unit": "a", "mb": 0, "peer": 1}],
                       [{"op": "RECV", "tensor": "act", "unit": "a", "mb": 0, "peer": 0},
                        {"op": "W", "unit": "b", "mb": 0}]]}"#;
        let p = Program::from_json(text).unwrap();
        let at = |r: usize, i: usize| p.programs[r][i].unit().as_ptr();
        assert_eq!(at(0, 0), at(0, 2));
        assert_eq!(at(0, 0), at(1, 0));
        assert_eq!(at(0, 1), at(1, 1));
        assert_ne!(at(0, 0), at(0, 1));
        assert_eq!(p.programs[1][1].unit(), "b");
    }
}
