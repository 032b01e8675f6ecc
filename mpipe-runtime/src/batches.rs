//! Per-rank tables of the program's transfer batches (issue 34, "static message
//! sizes, compiled in").
//!
//! `schedule!` emits, for every rank, the list of its batches (`BATCHES[rank]`, rolled
//! into loops as the generated code is, [`Entry`]; [`unroll`] writes it out): each
//! batch's action index and its items, with direction, peer, the tensor `(kind, unit,
//! micro-batch)`, where the element count comes from ([`Count`]) and the element type.
//! The profile's sizes are abstract units, so counts are not compiled in: the runtime
//! fills them once at start-up from the model's output lengths ([`sizes`]), after
//! checking the table against the program it runs ([`check`]: a table from another
//! derivation is an error, not a silent mismatch).
//!
//! [`derive`] makes the same table from a [`Program`] at run time (for programs not
//! compiled by the macro, and to check a compiled one).

use crate::{Dir, Tensor, UnitId};
use mpipe_core::program::{self as prog, ActionRef, Program};

/// Where an item's element count comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Count {
    /// The unit's output: `output_len(unit)` elements (an activation).
    Output(UnitId),
    /// The gradients of the unit's inputs, one after the other at fixed offsets: the
    /// sum of `output_len` over the unit's inputs.
    InputGrads(UnitId),
    /// Nothing travels (a raw micro-batch, which the receiver reads itself).
    Zero,
}

/// Element type of an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
        }
    }
}

/// One item of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Item {
    pub dir: Dir,
    /// The rank at the other end (this rank itself for an alias).
    pub peer: usize,
    pub tensor: Tensor,
    pub unit: UnitId,
    pub mb: usize,
    pub count: Count,
    pub dtype: DType,
}

impl Item {
    /// An item of `f32` elements whose count source follows from `tensor`: an
    /// activation is the unit's output, a gradient its inputs' gradients, an input
    /// nothing. (What the generated tables are written with.)
    pub const fn new(dir: Dir, tensor: Tensor, unit: UnitId, mb: usize, peer: usize) -> Item {
        Item {
            dir,
            peer,
            tensor,
            unit,
            mb,
            count: match tensor {
                Tensor::Act => Count::Output(unit),
                Tensor::Grad => Count::InputGrads(unit),
                Tensor::Input => Count::Zero,
            },
            dtype: DType::F32,
        }
    }
}

/// One transfer of a compiled batch, its micro-batch `base + stride * i` in a loop
/// over `i` (stride 0 outside loops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub dir: Dir,
    pub tensor: Tensor,
    pub unit: UnitId,
    pub base: i64,
    pub stride: i64,
    pub peer: usize,
}

impl Transfer {
    pub const fn new(
        dir: Dir,
        tensor: Tensor,
        unit: UnitId,
        base: i64,
        stride: i64,
        peer: usize,
    ) -> Transfer {
        Transfer {
            dir,
            tensor,
            unit,
            base,
            stride,
            peer,
        }
    }
}

/// One entry of a rank's compiled table, rolled like the generated code (so its size
/// does not grow with the micro-batch count): `Skip(n)` stands for `n` actions that
/// are not transfers, `Batch` for one batch, `Loop` for `count` iterations of a body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Skip(usize),
    Batch(&'static [Transfer]),
    Loop {
        count: usize,
        body: &'static [Entry],
    },
}

/// One batch: `first` is the index of its first item in the rank's action list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedBatch {
    pub first: usize,
    pub items: Vec<Item>,
}

/// A rank's compiled table written out: its batches with their action indices.
pub fn unroll(table: &[Entry]) -> Result<Vec<OwnedBatch>, TableError> {
    fn walk(
        entries: &[Entry],
        i: i64,
        at: &mut usize,
        out: &mut Vec<OwnedBatch>,
    ) -> Result<(), TableError> {
        for e in entries {
            match *e {
                Entry::Skip(n) => *at += n,
                Entry::Batch(items) => {
                    let items = items
                        .iter()
                        .map(|t| {
                            let mb = t.base + t.stride * i;
                            let mb = usize::try_from(mb).map_err(|_| {
                                TableError::Malformed(format!(
                                    "{t:?} has micro-batch {mb} in iteration {i}"
                                ))
                            })?;
                            Ok(Item::new(t.dir, t.tensor, t.unit, mb, t.peer))
                        })
                        .collect::<Result<Vec<_>, TableError>>()?;
                    out.push(OwnedBatch { first: *at, items });
                    *at += out.last().map_or(0, |b| b.items.len());
                }
                Entry::Loop { count, body } => {
                    if body.iter().any(|b| matches!(b, Entry::Loop { .. })) {
                        return Err(TableError::Malformed("a loop inside a loop".into()));
                    }
                    for k in 0..count {
                        walk(body, k as i64, at, out)?;
                    }
                }
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(table, 0, &mut 0, &mut out)?;
    Ok(out)
}

/// Why a table cannot be used.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    #[error("rank {rank} does not exist: the program has {ranks} ranks")]
    NoSuchRank { rank: usize, ranks: usize },
    #[error("unit `{0}` of the rank's actions is not in the program's unit list")]
    UnknownUnit(String),
    #[error(
        "the compiled batch table of rank {rank} is not the program's ({what}): the table \
         and the program come from different derivations; rebuild, or pass the program \
         the same `schedule!` emitted (its PROGRAM_JSON)"
    )]
    Stale { rank: usize, what: String },
    #[error("output lengths have {got} entries; the program has {want} units")]
    Lengths { got: usize, want: usize },
    #[error("unit {0} of the batch table is not in the program's unit list")]
    NoSuchUnit(UnitId),
    #[error(
        "the compiled batch table is malformed ({0}); it is generated by `schedule!`, rebuild"
    )]
    Malformed(String),
}

/// `rank`'s batches in `program`: maximal runs of consecutive transfers with one batch
/// id (a transfer without one is a batch of its own), as the generated code posts them.
pub fn derive(program: &Program, rank: usize) -> Result<Vec<OwnedBatch>, TableError> {
    let ranks = program.programs.len();
    let list = program
        .programs
        .get(rank)
        .ok_or(TableError::NoSuchRank { rank, ranks })?;
    let mut out: Vec<OwnedBatch> = Vec::new();
    let mut open: Option<u64> = None;
    for (i, a) in list.iter().enumerate() {
        let ActionRef::P2p(x) = a.view() else {
            open = None;
            continue;
        };
        let unit = program
            .unit_index(x.unit)
            .ok_or_else(|| TableError::UnknownUnit(x.unit.to_string()))?
            as UnitId;
        let (tensor, count) = match x.tensor {
            prog::Tensor::Act => (Tensor::Act, Count::Output(unit)),
            prog::Tensor::Grad => (Tensor::Grad, Count::InputGrads(unit)),
            prog::Tensor::Input => (Tensor::Input, Count::Zero),
        };
        // Written out field by field (not with `Item::new`), so that a test comparing
        // the two checks the constructor the generated code uses.
        let item = Item {
            dir: match x.dir {
                prog::Dir::Send => Dir::Send,
                prog::Dir::Recv => Dir::Recv,
            },
            peer: x.peer,
            tensor,
            unit,
            mb: x.mb,
            count,
            dtype: DType::F32,
        };
        match (out.last_mut(), open, x.batch) {
            (Some(b), Some(o), Some(id)) if o == id && b.first + b.items.len() == i => {
                b.items.push(item)
            }
            _ => out.push(OwnedBatch {
                first: i,
                items: vec![item],
            }),
        }
        open = x.batch;
    }
    Ok(out)
}

/// `table` written out ([`unroll`]), checked to be `rank`'s batches of `program`
/// (naming the first difference).
pub fn check(
    table: &[Entry],
    program: &Program,
    rank: usize,
) -> Result<Vec<OwnedBatch>, TableError> {
    let want = derive(program, rank)?;
    let got = unroll(table)?;
    let stale = |what: String| TableError::Stale { rank, what };
    for (k, (t, w)) in got.iter().zip(&want).enumerate() {
        if t != w {
            return Err(stale(format!(
                "batch {k}: compiled at action {} with {:?}, the program's at action {} with {:?}",
                t.first, t.items, w.first, w.items
            )));
        }
    }
    if got.len() != want.len() {
        return Err(stale(format!(
            "{} batches compiled, {} in the program",
            got.len(),
            want.len()
        )));
    }
    Ok(got)
}

/// The element count of each item of each batch, from the units' output lengths
/// (`out_len[u]`, the model's `output_len`) and the program's unit inputs.
pub fn sizes(
    table: &[OwnedBatch],
    program: &Program,
    out_len: &[usize],
) -> Result<Vec<Vec<usize>>, TableError> {
    if out_len.len() != program.units.len() {
        return Err(TableError::Lengths {
            got: out_len.len(),
            want: program.units.len(),
        });
    }
    let output = |u: UnitId| {
        out_len
            .get(u as usize)
            .copied()
            .ok_or(TableError::NoSuchUnit(u))
    };
    let count = |c: Count| -> Result<usize, TableError> {
        match c {
            Count::Output(u) => output(u),
            Count::InputGrads(u) => {
                let unit = program
                    .units
                    .get(u as usize)
                    .ok_or(TableError::NoSuchUnit(u))?;
                unit.inputs.iter().try_fold(0, |n, name| {
                    let i = program
                        .unit_index(name)
                        .ok_or_else(|| TableError::UnknownUnit(name.to_string()))?;
                    Ok(n + output(i as UnitId)?)
                })
            }
            Count::Zero => Ok(0),
        }
    };
    table
        .iter()
        .map(|b| b.items.iter().map(|x| count(x.count)).collect())
        .collect()
}
