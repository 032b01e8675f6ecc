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

/// How deep a compiled table's loops may nest (as deep as the generated code's,
/// `mpipe_core::rolled::MAX_DEPTH`).
pub const MAX_DEPTH: usize = mpipe_core::rolled::MAX_DEPTH;

/// One transfer of a compiled batch, its micro-batch `base + strides[0] * i0 +
/// strides[1] * i1 + ...` in the counters of the loops around it, innermost first
/// (every stride 0 outside loops).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub dir: Dir,
    pub tensor: Tensor,
    pub unit: UnitId,
    pub base: i64,
    /// Per enclosing loop, innermost first.
    pub strides: [i64; MAX_DEPTH],
    pub peer: usize,
}

impl Transfer {
    /// A transfer whose micro-batch is `base + stride * i` in its innermost loop's
    /// counter `i` (the same in every iteration of the loops further out).
    pub const fn new(
        dir: Dir,
        tensor: Tensor,
        unit: UnitId,
        base: i64,
        stride: i64,
        peer: usize,
    ) -> Transfer {
        Transfer::nested(dir, tensor, unit, base, [stride], peer)
    }

    /// A transfer inside nested loops: `strides` has one stride per enclosing loop,
    /// innermost first (at most [`MAX_DEPTH`]; more fails to compile in a constant).
    pub const fn nested<const K: usize>(
        dir: Dir,
        tensor: Tensor,
        unit: UnitId,
        base: i64,
        strides: [i64; K],
        peer: usize,
    ) -> Transfer {
        assert!(K <= MAX_DEPTH, "loops nested deeper than MAX_DEPTH");
        let mut all = [0; MAX_DEPTH];
        let mut k = 0;
        while k < K {
            all[k] = strides[k];
            k += 1;
        }
        Transfer {
            dir,
            tensor,
            unit,
            base,
            strides: all,
            peer,
        }
    }

    /// The micro-batch in the loops whose counters are `counters` (outermost first),
    /// `None` on overflow.
    pub fn mb(&self, counters: &[i64]) -> Option<i64> {
        let mut v = self.base;
        for (s, c) in self.strides.iter().zip(counters.iter().rev()) {
            v = s.checked_mul(*c)?.checked_add(v)?;
        }
        Some(v)
    }
}

/// One entry of a rank's compiled table, rolled like the generated code (so its size
/// does not grow with the micro-batch count): `Skip(n)` stands for `n` actions that
/// are not transfers, `Batch` for one batch, `Loop` for `count` iterations of a body
/// (which may hold loops, at most [`MAX_DEPTH`] levels in all).
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
    /// `entries` inside loops whose counters are `counters` (outermost first).
    fn walk(
        entries: &[Entry],
        counters: &mut Vec<i64>,
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
                            let mb = t.mb(counters);
                            let mb = mb.and_then(|m| usize::try_from(m).ok()).ok_or_else(|| {
                                TableError::Malformed(format!(
                                    "{t:?} has micro-batch {mb:?} at loop counters {counters:?}"
                                ))
                            })?;
                            Ok(Item::new(t.dir, t.tensor, t.unit, mb, t.peer))
                        })
                        .collect::<Result<Vec<_>, TableError>>()?;
                    out.push(OwnedBatch { first: *at, items });
                    *at += out.last().map_or(0, |b| b.items.len());
                }
                Entry::Loop { count, body } => {
                    if counters.len() == MAX_DEPTH {
                        return Err(TableError::Malformed(format!(
                            "loops nested deeper than {MAX_DEPTH}"
                        )));
                    }
                    for k in 0..count {
                        counters.push(k as i64);
                        walk(body, counters, at, out)?;
                        counters.pop();
                    }
                }
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(table, &mut Vec::with_capacity(MAX_DEPTH), &mut 0, &mut out)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const A: UnitId = 2;

    /// A batch of one send of an activation of `A` at `mb` to rank 1.
    fn send(mb: usize) -> Vec<Item> {
        vec![Item::new(Dir::Send, Tensor::Act, A, mb, 1)]
    }

    /// Loops inside loops: each transfer's micro-batch is affine in every enclosing
    /// counter (innermost first), action indices advance through `Skip`s and batches
    /// in program order.
    #[test]
    fn nested_loops_unroll_in_program_order() {
        const INNER: &[Entry] = &[
            Entry::Batch(&[Transfer::nested(Dir::Send, Tensor::Act, A, 5, [1, 10], 1)]),
            Entry::Skip(1),
        ];
        const TABLE: &[Entry] = &[
            Entry::Batch(&[Transfer::new(Dir::Send, Tensor::Act, A, 0, 0, 1)]),
            Entry::Loop {
                count: 3,
                body: &[
                    Entry::Skip(2),
                    Entry::Loop {
                        count: 2,
                        body: INNER,
                    },
                    Entry::Batch(&[Transfer::new(Dir::Send, Tensor::Act, A, 7, 10, 1)]),
                ],
            },
        ];
        let mut want = vec![OwnedBatch {
            first: 0,
            items: send(0),
        }];
        let mut at = 1;
        for i in 0..3 {
            at += 2;
            for j in 0..2 {
                want.push(OwnedBatch {
                    first: at,
                    items: send(5 + j + 10 * i),
                });
                at += 2;
            }
            want.push(OwnedBatch {
                first: at,
                items: send(7 + 10 * i),
            });
            at += 1;
        }
        assert_eq!(unroll(TABLE).unwrap(), want);
        assert_eq!(
            Transfer::new(Dir::Recv, Tensor::Grad, A, 3, -1, 0),
            Transfer::nested(Dir::Recv, Tensor::Grad, A, 3, [-1], 0)
        );
    }

    /// Deeper than `MAX_DEPTH`, or a micro-batch below 0: malformed, not a panic.
    #[test]
    fn malformed_nesting_is_an_error() {
        const LEAF: &[Entry] = &[Entry::Batch(&[Transfer::new(
            Dir::Send,
            Tensor::Act,
            A,
            0,
            1,
            1,
        )])];
        fn nest(depth: usize) -> &'static [Entry] {
            let mut e = LEAF;
            for _ in 0..depth {
                e = Box::leak(Box::new([Entry::Loop { count: 2, body: e }]));
            }
            e
        }
        assert_eq!(unroll(nest(MAX_DEPTH)).unwrap().len(), 1 << MAX_DEPTH);
        assert!(matches!(
            unroll(nest(MAX_DEPTH + 1)),
            Err(TableError::Malformed(_))
        ));
        const NEGATIVE: &[Entry] = &[Entry::Loop {
            count: 2,
            body: &[Entry::Loop {
                count: 2,
                body: &[Entry::Batch(&[Transfer::nested(
                    Dir::Send,
                    Tensor::Act,
                    A,
                    0,
                    [0, -1],
                    1,
                )])],
            }],
        }];
        assert!(matches!(unroll(NEGATIVE), Err(TableError::Malformed(_))));
    }
}
