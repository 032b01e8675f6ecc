//! Ahead-of-time placement of one rank's transfer buffers in one arena.
//!
//! A rank's action list says exactly when each activation and gradient buffer comes
//! into being (the forward that writes it, or the receive that fills it) and when it
//! is read for the last time (the last forward or backward that consumes it, or its
//! last send). [`plan`] turns those lifetimes into offsets in one block of memory,
//! as a register allocator assigns registers: buffers whose lifetimes do not overlap
//! share bytes. The block is allocated once; nothing is allocated while a step runs.
//!
//! Invariants of a [`Plan`]:
//! - two buffers whose lifetimes overlap never share a byte;
//! - every offset is a multiple of [`ALIGN`] (aclnn needs 32-byte aligned addresses;
//!   CANN's own allocator hands out 512-byte aligned blocks);
//! - `size >= peak_live`, where `peak_live` is the largest total of (aligned) bytes
//!   live at one action, a lower bound for any placement; with buffers of one size the
//!   placement meets it exactly (first fit in order of first use colours an interval
//!   graph optimally);
//! - each buffer lists the earlier buffers it reuses bytes of ([`Buffer::reuses`]), so
//!   a backend with several streams can order its first access after their last one.
//!
//! The plan knows nothing of devices: it is computed from the program and the units'
//! output lengths, and is the same on every backend.

use crate::UnitId;
use mpipe_core::plan::needs_backward;
use mpipe_core::program::{ActionRef, Dir, Op, Program, Tensor};
use std::collections::BTreeMap;

/// Byte alignment of every buffer.
pub const ALIGN: usize = 512;

/// What a buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A unit's forward output for one micro-batch (also what travels as `act`).
    Act,
    /// The gradients of a unit's inputs for one micro-batch, one after the other at
    /// fixed offsets (also what travels as `grad`).
    Grad,
    /// The sum of a unit's output gradients from several successors, for one
    /// backward (lives for that one action).
    GradSum,
    /// What a unit's forward keeps for its backward, for one micro-batch
    /// ([`plan_stash`]; never in a [`plan`]).
    Stash,
}

/// One buffer: `(kind, unit, mb)` from action `first` to action `last` (indices in
/// the rank's list, inclusive; the actions of one batch all count at the index of the
/// batch's first), at `offset` in the arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub kind: Kind,
    pub unit: UnitId,
    pub mb: usize,
    /// Elements (f32).
    pub len: usize,
    pub first: usize,
    pub last: usize,
    pub offset: usize,
    /// Earlier buffers (indices into [`Plan::buffers`]) whose data occupied some of
    /// the bytes this buffer's data occupies.
    pub reuses: Vec<usize>,
}

impl Buffer {
    /// Bytes the buffer occupies (its elements, rounded up to [`ALIGN`]; at least one
    /// alignment unit, so every buffer has an address of its own).
    pub fn bytes(&self) -> usize {
        aligned(self.len * 4)
    }
}

fn aligned(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

/// The placement of one rank's buffers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// In order of first use.
    pub buffers: Vec<Buffer>,
    /// Bytes of the arena.
    pub size: usize,
    /// The most bytes live at any one action (a lower bound on `size`).
    pub peak_live: usize,
    by_def: BTreeMap<(usize, Kind, UnitId, usize), usize>,
}

impl Plan {
    /// The buffer that action `index` brings into being for `(kind, unit, mb)`.
    pub fn defined_at(&self, index: usize, kind: Kind, unit: UnitId, mb: usize) -> Option<usize> {
        self.by_def.get(&(index, kind, unit, mb)).copied()
    }
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("rank {rank} does not exist: the program has {ranks} ranks")]
    NoSuchRank { rank: usize, ranks: usize },
    #[error("unit `{0}` of the rank's actions is not in the program's unit list")]
    UnknownUnit(String),
    #[error("output_len has {got} entries; the program has {want} units")]
    Lengths { got: usize, want: usize },
}

/// Plans `rank`'s buffers of `program`, with `out_len[u]` the elements of unit `u`'s
/// output (the model's `output_len`).
pub fn plan(program: &Program, rank: usize, out_len: &[usize]) -> Result<Plan, PlanError> {
    let ranks = program.programs.len();
    let list = program
        .programs
        .get(rank)
        .ok_or(PlanError::NoSuchRank { rank, ranks })?;
    if out_len.len() != program.units.len() {
        return Err(PlanError::Lengths {
            got: out_len.len(),
            want: program.units.len(),
        });
    }
    let id = |name: &str| {
        program
            .unit_index(name)
            .map(|i| i as UnitId)
            .ok_or_else(|| PlanError::UnknownUnit(name.to_string()))
    };
    let inputs: Vec<Vec<UnitId>> = program
        .units
        .iter()
        .map(|u| u.inputs.iter().map(|n| id(n)).collect())
        .collect::<Result<_, _>>()?;
    let need = needs_backward(&program.units);
    let grad_from: Vec<Vec<UnitId>> = (0..program.units.len())
        .map(|u| {
            (0..program.units.len())
                .filter(|&s| need[s] && inputs[s].contains(&(u as UnitId)))
                .map(|s| s as UnitId)
                .collect()
        })
        .collect();
    let grad_len = |u: UnitId| -> usize {
        inputs[u as usize]
            .iter()
            .map(|&i| out_len[i as usize])
            .sum()
    };

    // A batch's transfers run together (one `HcclBatchSendRecv`): every action of a
    // batch takes place at the index of its first, so a buffer it sends and one it
    // receives are live at once and never share bytes.
    let mut at: Vec<usize> = (0..list.len()).collect();
    for i in 1..list.len() {
        if let (ActionRef::P2p(x), ActionRef::P2p(y)) = (list[i - 1].view(), list[i].view()) {
            if x.batch.is_some() && x.batch == y.batch {
                at[i] = at[i - 1];
            }
        }
    }
    let mut buffers: Vec<Buffer> = Vec::new();
    let mut current: BTreeMap<(Kind, UnitId, usize), usize> = BTreeMap::new();
    let mut by_def = BTreeMap::new();
    let mut define = |buffers: &mut Vec<Buffer>,
                      current: &mut BTreeMap<(Kind, UnitId, usize), usize>,
                      i: usize,
                      kind: Kind,
                      unit: UnitId,
                      mb: usize,
                      len: usize| {
        let b = buffers.len();
        buffers.push(Buffer {
            kind,
            unit,
            mb,
            len,
            first: at[i],
            last: at[i],
            offset: 0,
            reuses: Vec::new(),
        });
        current.insert((kind, unit, mb), b);
        by_def.insert((i, kind, unit, mb), b);
    };
    let touch = |buffers: &mut Vec<Buffer>,
                 current: &BTreeMap<(Kind, UnitId, usize), usize>,
                 i: usize,
                 key: (Kind, UnitId, usize)| {
        if let Some(&b) = current.get(&key) {
            buffers[b].last = at[i];
        }
    };
    for (i, a) in list.iter().enumerate() {
        match a.view() {
            ActionRef::Compute(c) => {
                let u = id(c.unit)?;
                let mb = c.mb;
                match c.op {
                    Op::F | Op::RF => {
                        for &p in &inputs[u as usize] {
                            touch(&mut buffers, &current, i, (Kind::Act, p, mb));
                        }
                        define(
                            &mut buffers,
                            &mut current,
                            i,
                            Kind::Act,
                            u,
                            mb,
                            out_len[u as usize],
                        );
                    }
                    Op::B | Op::BW => {
                        for &s in &grad_from[u as usize] {
                            touch(&mut buffers, &current, i, (Kind::Grad, s, mb));
                        }
                        if grad_from[u as usize].len() > 1 {
                            define(
                                &mut buffers,
                                &mut current,
                                i,
                                Kind::GradSum,
                                u,
                                mb,
                                out_len[u as usize],
                            );
                        }
                        if !inputs[u as usize].is_empty() {
                            define(
                                &mut buffers,
                                &mut current,
                                i,
                                Kind::Grad,
                                u,
                                mb,
                                grad_len(u),
                            );
                        }
                    }
                    Op::W => {}
                }
            }
            ActionRef::P2p(x) => {
                let u = id(x.unit)?;
                let kind = match x.tensor {
                    Tensor::Act => Kind::Act,
                    Tensor::Grad => Kind::Grad,
                    Tensor::Input => continue,
                };
                match x.dir {
                    Dir::Send => touch(&mut buffers, &current, i, (kind, u, x.mb)),
                    // A receive from the rank itself is the sent buffer (an alias).
                    Dir::Recv if x.peer == rank => {
                        touch(&mut buffers, &current, i, (kind, u, x.mb))
                    }
                    Dir::Recv => {
                        let len = match kind {
                            Kind::Act => out_len[u as usize],
                            _ => grad_len(u),
                        };
                        define(&mut buffers, &mut current, i, kind, u, x.mb, len);
                    }
                }
            }
            ActionRef::Coll(_) => {}
        }
    }
    let (size, peak_live) = place(&mut buffers);
    Ok(Plan {
        buffers,
        size,
        peak_live,
        by_def,
    })
}

/// Plans `rank`'s stash: what each forward keeps for its backward, `stash_len[u]`
/// elements for unit `u` (f32), over exactly the lifetimes the simulator counts as
/// activation memory (`mpipe_core::simulate`, "Memory"): from the last `F`/`RF` of
/// `(u, mb)` before its consumer to the consumer, the last `W(u, mb)` on the rank if
/// there is one, else the last `B`/`BW`; a forward without a consumer on the rank keeps
/// nothing.
///
/// The two figures then agree: a rank's actions run one after another, so (with
/// compute actions of positive duration) two stashes overlap in time exactly when
/// their action ranges overlap, and [`Plan::peak_live`] is the simulator's
/// `peak_memory` of that rank with `act(u)` = the stash's bytes (exactly, when those
/// are multiples of [`ALIGN`]); [`Plan::size`] is the memory a placement needs, equal
/// to it when every stash has one size.
///
/// [`plan`]'s transfer buffers are not in the simulator's figure: a unit's output that
/// this rank computes and also stashes lives inside its stash's lifetime (it is sent or
/// consumed before the gradient can come back), but received activations and
/// gradients in flight are extra, bounded by [`plan`]'s own `size`.
pub fn plan_stash(program: &Program, rank: usize, stash_len: &[usize]) -> Result<Plan, PlanError> {
    let ranks = program.programs.len();
    let list = program
        .programs
        .get(rank)
        .ok_or(PlanError::NoSuchRank { rank, ranks })?;
    if stash_len.len() != program.units.len() {
        return Err(PlanError::Lengths {
            got: stash_len.len(),
            want: program.units.len(),
        });
    }
    // Per (unit, mb): the last consumer, and the last forward before it.
    let mut consumer: BTreeMap<(UnitId, usize), (usize, bool)> = BTreeMap::new();
    let mut computes: Vec<(usize, UnitId, usize, Op)> = Vec::new();
    for (i, a) in list.iter().enumerate() {
        if let ActionRef::Compute(c) = a.view() {
            let u = program
                .unit_index(c.unit)
                .ok_or_else(|| PlanError::UnknownUnit(c.unit.to_string()))?
                as UnitId;
            computes.push((i, u, c.mb, c.op));
            let is_w = c.op == Op::W;
            if is_w || matches!(c.op, Op::B | Op::BW) {
                let e = consumer.entry((u, c.mb)).or_insert((i, is_w));
                // A `W` wins over any `B`/`BW`; among equals, the last.
                if is_w || !e.1 {
                    *e = (i, is_w);
                }
            }
        }
    }
    let mut holder: BTreeMap<(UnitId, usize), usize> = BTreeMap::new();
    for &(i, u, mb, op) in &computes {
        if matches!(op, Op::F | Op::RF) && consumer.get(&(u, mb)).is_some_and(|&(c, _)| i < c) {
            holder.insert((u, mb), i);
        }
    }
    let mut buffers: Vec<Buffer> = holder
        .iter()
        .map(|(&(u, mb), &first)| Buffer {
            kind: Kind::Stash,
            unit: u,
            mb,
            len: stash_len[u as usize],
            first,
            last: consumer[&(u, mb)].0,
            offset: 0,
            reuses: Vec::new(),
        })
        .filter(|b| b.len > 0)
        .collect();
    buffers.sort_by_key(|b| (b.first, b.unit, b.mb));
    let by_def = buffers
        .iter()
        .enumerate()
        .map(|(b, x)| ((x.first, Kind::Stash, x.unit, x.mb), b))
        .collect();
    let (size, peak_live) = place(&mut buffers);
    Ok(Plan {
        buffers,
        size,
        peak_live,
        by_def,
    })
}

/// First fit in order of first use; returns the arena size and the peak of live bytes.
fn place(buffers: &mut [Buffer]) -> (usize, usize) {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&b| (buffers[b].first, b));
    // Live buffers by offset; ended buffers per byte range, for `reuses`.
    let mut live: Vec<usize> = Vec::new();
    let mut ended: Vec<usize> = Vec::new();
    let (mut size, mut peak) = (0usize, 0usize);
    for &b in &order {
        let first = buffers[b].first;
        let (gone, stay): (Vec<usize>, Vec<usize>) =
            live.iter().partition(|&&x| buffers[x].last < first);
        ended.extend(gone);
        live = stay;
        live.sort_by_key(|&x| buffers[x].offset);
        let need = buffers[b].bytes();
        let mut at = 0;
        for &x in &live {
            if buffers[x].offset >= at + need {
                break;
            }
            at = at.max(buffers[x].offset + buffers[x].bytes());
        }
        buffers[b].offset = at;
        // Overlap of the bytes really used (not the alignment padding), so a buffer
        // names only the buffers whose data it overwrites.
        let used = buffers[b].len * 4;
        let reuses: Vec<usize> = ended
            .iter()
            .copied()
            .filter(|&x| {
                let (o, n) = (buffers[x].offset, buffers[x].len * 4);
                o < at + used && at < o + n
            })
            .collect();
        buffers[b].reuses = reuses;
        live.push(b);
        size = size.max(at + need);
        peak = peak.max(live.iter().map(|&x| buffers[x].bytes()).sum());
    }
    (size, peak)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpipe_core::derive::{derive_str, Request};
    use mpipe_core::profile::Profile;

    fn program(expr: &str, ranks: usize, mbs: usize) -> Program {
        let prof = Profile::from_toml_str(
            "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n\
             params = 0.1\n[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 1.0\n\
             backward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\ntrainable = true\n",
        )
        .expect("profile");
        derive_str(&Request::new(&prof, ranks, mbs), expr)
            .expect("derive")
            .program
    }

    fn overlap(a: &Buffer, b: &Buffer) -> bool {
        a.first <= b.last && b.first <= a.last
    }

    fn check(p: &Plan) {
        for (i, a) in p.buffers.iter().enumerate() {
            assert_eq!(a.offset % ALIGN, 0);
            assert!(a.offset + a.bytes() <= p.size);
            for b in &p.buffers[i + 1..] {
                if overlap(a, b) {
                    let apart =
                        a.offset + a.bytes() <= b.offset || b.offset + b.bytes() <= a.offset;
                    assert!(apart, "{a:?} and {b:?} are live together and share bytes");
                }
            }
        }
        assert!(p.size >= p.peak_live);
    }

    /// Every schedule's plan keeps live buffers apart; with one size for every buffer,
    /// first fit reaches the lower bound exactly.
    #[test]
    fn plans_are_sound_and_tight_when_sizes_agree() {
        for expr in [
            "1f1b",
            "zbv",
            "interleaved(v = 2)",
            "transpose(vision, 1f1b)",
            "gpipe",
        ] {
            let prog = program(expr, 4, 8);
            let lens = vec![1000; prog.units.len()];
            for rank in 0..4 {
                let p = plan(&prog, rank, &lens).expect("plan");
                check(&p);
                let uniform = p.buffers.iter().all(|b| b.bytes() == p.buffers[0].bytes());
                if uniform {
                    assert_eq!(p.size, p.peak_live, "{expr}, rank {rank}");
                }
                assert!(!p.buffers.is_empty(), "{expr}, rank {rank} has buffers");
            }
        }
    }

    /// With sizes that differ, buffers are still kept apart, and the arena is far
    /// smaller than giving every buffer bytes of its own.
    #[test]
    fn plans_reuse_memory_with_mixed_sizes() {
        let prog = program("transpose(vision, 1f1b)", 4, 16);
        let lens: Vec<usize> = (0..prog.units.len()).map(|u| 300 + 217 * u).collect();
        for rank in 0..4 {
            let p = plan(&prog, rank, &lens).expect("plan");
            check(&p);
            let total: usize = p.buffers.iter().map(Buffer::bytes).sum();
            assert!(p.size * 2 <= total, "rank {rank}: {} of {total}", p.size);
            for (b, buf) in p.buffers.iter().enumerate() {
                for &r in &buf.reuses {
                    assert!(r != b && p.buffers[r].last < buf.first);
                }
            }
        }
    }

    #[test]
    fn a_missing_rank_or_wrong_lengths_are_errors() {
        let prog = program("1f1b", 2, 2);
        assert_eq!(
            plan(&prog, 5, &vec![1; prog.units.len()]),
            Err(PlanError::NoSuchRank { rank: 5, ranks: 2 })
        );
        assert!(matches!(
            plan(&prog, 0, &[1]),
            Err(PlanError::Lengths { .. })
        ));
    }
}
