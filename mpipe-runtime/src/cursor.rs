//! What every executor of a rank's program shares, whatever holds its tensors (host
//! vectors in [`crate::exec`], device views in `ascend::device`): the unit facts
//! ([`Units`]), the position in the rank's action list and the check that each call
//! is the action the program says next ([`Cursor`]), and the bookkeeping of the
//! activation memory forwards keep for their backwards ([`Held`]).

use crate::exec::ExecError;
use crate::{Dir, P2p, Tensor as Kind, UnitId};
use mpipe_core::plan::needs_backward;
use mpipe_core::program::{Action, ActionRef, CollKind, Op, Program};
use std::collections::BTreeMap;

/// Facts about one unit, by unit id.
pub(crate) struct UnitInfo {
    pub inputs: Vec<UnitId>,
    /// Successors that need a backward (their gradients flow into this unit).
    pub grad_from: Vec<UnitId>,
    /// Activation memory one micro-batch's forward keeps (program-format units).
    pub act: f64,
    /// Elements of the unit's forward output (the model's `output_len`).
    pub out_len: usize,
}

/// Every unit's facts.
pub(crate) struct Units(pub Vec<UnitInfo>);

pub(crate) fn unit_index(p: &Program, name: &str) -> UnitId {
    p.unit_index(name).map_or(UnitId::MAX, |i| i as UnitId)
}

impl Units {
    /// The units of `program`, with `out_len(u)` elements of output each.
    pub(crate) fn new(program: &Program, out_len: impl Fn(UnitId) -> usize) -> Units {
        let need = needs_backward(&program.units);
        Units(
            program
                .units
                .iter()
                .enumerate()
                .map(|(i, u)| UnitInfo {
                    inputs: u.inputs.iter().map(|n| unit_index(program, n)).collect(),
                    grad_from: program
                        .units
                        .iter()
                        .enumerate()
                        .filter(|(s, su)| need[*s] && su.inputs.contains(&u.name))
                        .map(|(s, _)| s as UnitId)
                        .collect(),
                    act: u.act,
                    out_len: out_len(i as UnitId),
                })
                .collect(),
        )
    }

    pub(crate) fn get(&self, u: UnitId) -> &UnitInfo {
        &self.0[u as usize]
    }

    /// The lengths of a gradient message's parts: `unit`'s inputs' outputs, in order.
    pub(crate) fn grad_parts(&self, unit: UnitId) -> Vec<usize> {
        self.0.get(unit as usize).map_or_else(Vec::new, |info| {
            info.inputs
                .iter()
                .map(|&i| self.0.get(i as usize).map_or(0, |x| x.out_len))
                .collect()
        })
    }
}

/// A rank's position in its action list, and the checks that generated code and
/// program agree call for call.
pub(crate) struct Cursor<'a> {
    pub rank: usize,
    pub program: &'a Program,
    /// Next action index in the rank's list.
    pub pc: usize,
    /// `(op, unit, mb)` of every compute action of this rank, with its index.
    compute_at: BTreeMap<(Op, UnitId, usize), usize>,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(program: &'a Program, rank: usize) -> Cursor<'a> {
        let list = program.programs.get(rank).map_or(&[][..], Vec::as_slice);
        let compute_at = list
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a.view() {
                ActionRef::Compute(c) => Some(((c.op, unit_index(program, c.unit), c.mb), i)),
                _ => None,
            })
            .collect();
        Cursor {
            rank,
            program,
            pc: 0,
            compute_at,
        }
    }

    pub(crate) fn list(&self) -> &'a [Action] {
        self.program
            .programs
            .get(self.rank)
            .map_or(&[][..], Vec::as_slice)
    }

    pub(crate) fn name(&self, u: UnitId) -> &'a str {
        self.program
            .units
            .get(u as usize)
            .map_or("?", |x| x.name.as_str())
    }

    /// The rank's action `index`, as the program format writes it.
    pub(crate) fn action_at(&self, index: usize) -> String {
        self.list()
            .get(index)
            .map_or_else(String::new, |a| a.to_string())
    }

    /// Whether `op` of `(unit, mb)` runs on this rank after action `index`.
    pub(crate) fn later(&self, op: Op, unit: UnitId, mb: usize, index: usize) -> bool {
        self.compute_at
            .get(&(op, unit, mb))
            .is_some_and(|&i| i > index)
    }

    /// Check that the next action is `called` (rendered by `matches`); advance.
    pub(crate) fn expect(
        &mut self,
        called: String,
        matches: impl Fn(ActionRef) -> bool,
    ) -> Result<usize, ExecError> {
        let index = self.pc;
        match self.list().get(index) {
            Some(a) if matches(a.view()) => {
                self.pc += 1;
                Ok(index)
            }
            other => Err(ExecError::OutOfStep {
                rank: self.rank,
                index,
                called,
                expected: other.map_or_else(
                    || "nothing (the rank's list is over)".to_string(),
                    |a| a.to_string(),
                ),
            }),
        }
    }

    /// The next action must be `op` of `(unit, mb)`; returns its index.
    pub(crate) fn expect_compute(
        &mut self,
        op: Op,
        unit: UnitId,
        mb: usize,
    ) -> Result<usize, ExecError> {
        let name = self.name(unit);
        self.expect(
            format!("{}({name},{mb})", op.as_str()),
            |a| matches!(a, ActionRef::Compute(c) if c.op == op && c.unit == name && c.mb == mb),
        )
    }

    /// The next actions must be `batch`, in order; returns the first's index.
    pub(crate) fn expect_batch(&mut self, batch: &[P2p]) -> Result<usize, ExecError> {
        let first = self.pc;
        for x in batch {
            let name = self.name(x.unit);
            let called = format!("{:?} {:?}({name},{})", x.dir, x.tensor, x.mb);
            let tensor = match x.tensor {
                Kind::Act => "act",
                Kind::Grad => "grad",
                Kind::Input => "input",
            };
            self.expect(called, |a| {
                matches!(a, ActionRef::P2p(p)
                    if (p.dir == mpipe_core::program::Dir::Send) == (x.dir == Dir::Send)
                    && p.unit == name && p.mb == x.mb && p.peer == x.peer
                    && p.tensor.as_str() == tensor)
            })?;
        }
        Ok(first)
    }

    /// The next action must be the collective `kind` of `unit` from `root`.
    pub(crate) fn expect_collective(
        &mut self,
        kind: CollKind,
        unit: UnitId,
        root: usize,
    ) -> Result<usize, ExecError> {
        let name = self.name(unit);
        let called = match kind {
            CollKind::Bcast => format!("BCAST({name})"),
            CollKind::Reduce => format!("REDUCE({name})"),
        };
        self.expect(called, |a| {
            matches!(a, ActionRef::Coll(c) if c.kind == kind && c.unit == name && c.root == root)
        })
    }

    pub(crate) fn missing(&self, index: usize, what: String) -> ExecError {
        ExecError::Missing {
            rank: self.rank,
            index,
            action: self.action_at(index),
            what,
        }
    }

    pub(crate) fn comm_error(
        &self,
        index: usize,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> ExecError {
        ExecError::Comm {
            rank: self.rank,
            index,
            action: self.action_at(index),
            source: Box::new(e),
        }
    }

    /// The error for a stash that is not there.
    pub(crate) fn no_stash(&self, index: usize, unit: UnitId, mb: usize) -> ExecError {
        self.missing(
            index,
            format!(
                "the forward's stash of `{}` for micro-batch {mb}",
                self.name(unit)
            ),
        )
    }

    /// Whether the forward at `index` (a recompute if `recompute`) keeps its stash:
    /// the backward of `(unit, mb)` runs here later, and no recompute comes first.
    pub(crate) fn keeps_stash(
        &self,
        unit: UnitId,
        mb: usize,
        index: usize,
        recompute: bool,
    ) -> bool {
        let backward_here =
            self.later(Op::B, unit, mb, index) || self.later(Op::BW, unit, mb, index);
        let recomputed_later = !recompute && self.later(Op::RF, unit, mb, index);
        backward_here && !recomputed_later
    }
}

/// Activation memory held from forwards to their backwards (program-format units):
/// what a run is compared with the simulator's prediction by.
#[derive(Default)]
pub(crate) struct Held {
    held: BTreeMap<(UnitId, usize), f64>,
    live: f64,
    pub peak: f64,
}

impl Held {
    pub(crate) fn hold(&mut self, unit: UnitId, mb: usize, act: f64) {
        self.held.insert((unit, mb), act);
        self.live += act;
        self.peak = self.peak.max(self.live);
    }

    pub(crate) fn release(&mut self, unit: UnitId, mb: usize) {
        if let Some(act) = self.held.remove(&(unit, mb)) {
            self.live -= act;
        }
    }
}
