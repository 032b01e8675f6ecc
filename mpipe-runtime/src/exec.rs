//! The executor: a [`Step`] that runs one rank's share of a derived program on a
//! [`Comm`] backend and a [`Model`].
//!
//! It owns every per-(unit, micro-batch) buffer: activations produced or received,
//! the stashes forwards keep for their backwards, gradients produced or received.
//! Each is freed as soon as the program says it is no longer needed (its last local
//! reader and its last send have run), and the activation memory the program format
//! counts (a forward's `act` from the forward to the backward that consumes it) is
//! tracked so a run can be compared with the simulator's prediction.
//!
//! Every call is checked against the rank's action list: generated code and program
//! must agree action for action, and an error names the rank, the action index and
//! the action. Each action's wall-clock interval is recorded for a trace.

use crate::comm::{Comm, Tag};
use crate::cursor::{unit_index, Cursor, Held, Units};
use crate::model::{Model, Tensor};
use crate::{Dir, P2p, Step, Tensor as Kind, UnitId};
use mpipe_core::program::{ActionRef, CollKind, Op, Program};
use mpipe_core::timeline::{Slot, Timeline};
use std::collections::BTreeMap;
use std::time::Instant;

/// Why a rank's step failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("rank {rank}, action {index} `{action}`: {source}")]
    Comm {
        rank: usize,
        index: usize,
        action: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("rank {rank}, action {index}: generated code called `{called}` but the program says `{expected}`; regenerate the code from this program")]
    OutOfStep {
        rank: usize,
        index: usize,
        called: String,
        expected: String,
    },
    #[error("rank {rank}, action {index} `{action}`: {what} is missing; the program is not executable as written")]
    Missing {
        rank: usize,
        index: usize,
        action: String,
        what: String,
    },
    /// The model produced a tensor of another size than it declared
    /// ([`Model::output_len`]): message sizes are static, so this is a model bug.
    #[error("rank {rank}, action {index} `{action}`: {what}")]
    Shape {
        rank: usize,
        index: usize,
        action: String,
        what: String,
    },
    #[error("rank {rank} does not exist: the schedule has {ranks} ranks")]
    NoSuchRank { rank: usize, ranks: usize },
}

/// One rank's executor for one step.
pub struct Executor<'a, C: Comm, M: Model> {
    at: Cursor<'a>,
    comm: &'a mut C,
    model: &'a mut M,
    units: Units,
    acts: BTreeMap<(UnitId, usize), Tensor>,
    stashes: BTreeMap<(UnitId, usize), M::Stash>,
    /// Input gradients produced by `B(unit, mb)` (one per input), local or received.
    grads: BTreeMap<(UnitId, usize), Vec<Tensor>>,
    /// Remaining local uses of each buffer (readers and sends still to come).
    act_uses: BTreeMap<(UnitId, usize), usize>,
    grad_uses: BTreeMap<(UnitId, usize), usize>,
    held: Held,
    start: Instant,
    slots: Vec<Slot>,
}

impl<'a, C: Comm, M: Model> Executor<'a, C, M> {
    /// An executor for `comm.rank()`'s actions of `program`.
    pub fn new(program: &'a Program, comm: &'a mut C, model: &'a mut M) -> Self {
        let rank = comm.rank();
        let units = Units::new(program, |u| model.output_len(u));
        // Count how often this rank reads or sends each buffer, to free it after
        // its last use.
        let mut act_uses = BTreeMap::new();
        let mut grad_uses = BTreeMap::new();
        let list = program.programs.get(rank).map_or(&[][..], Vec::as_slice);
        for a in list {
            match a.view() {
                ActionRef::Compute(c) => {
                    let u = unit_index(program, c.unit);
                    let Some(info) = units.0.get(u as usize) else {
                        continue;
                    };
                    match c.op {
                        Op::F | Op::RF => {
                            for &p in &info.inputs {
                                *act_uses.entry((p, c.mb)).or_insert(0) += 1;
                            }
                        }
                        Op::B | Op::BW => {
                            for &s in &info.grad_from {
                                *grad_uses.entry((s, c.mb)).or_insert(0) += 1;
                            }
                        }
                        Op::W => {}
                    }
                }
                ActionRef::P2p(x) if x.dir == mpipe_core::program::Dir::Send => {
                    let key = (unit_index(program, x.unit), x.mb);
                    match x.tensor {
                        mpipe_core::program::Tensor::Act => *act_uses.entry(key).or_insert(0) += 1,
                        mpipe_core::program::Tensor::Grad => {
                            *grad_uses.entry(key).or_insert(0) += 1
                        }
                        mpipe_core::program::Tensor::Input => {}
                    }
                }
                _ => {}
            }
        }
        Executor {
            at: Cursor::new(program, rank),
            comm,
            model,
            units,
            acts: BTreeMap::new(),
            stashes: BTreeMap::new(),
            grads: BTreeMap::new(),
            act_uses,
            grad_uses,
            held: Held::default(),
            start: Instant::now(),
            slots: Vec::with_capacity(list.len()),
        }
    }

    /// Peak activation memory of the run so far (program-format units).
    pub fn peak_memory(&self) -> f64 {
        self.held.peak
    }

    /// The rank's executed actions' wall-clock intervals, in seconds from the
    /// executor's creation (one per action, in program order).
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whether every action of the rank has run.
    pub fn finished(&self) -> bool {
        self.at.pc == self.at.list().len()
    }

    /// Elements of the message carrying `tensor` of `unit`: its output for an
    /// activation, its inputs' outputs one after the other for a gradient, nothing
    /// for an input transfer (the receiver reads the micro-batch itself).
    fn message_len(&self, tensor: Kind, unit: UnitId) -> usize {
        match tensor {
            Kind::Act => self.units.0.get(unit as usize).map_or(0, |x| x.out_len),
            Kind::Grad => self.units.grad_parts(unit).iter().sum(),
            Kind::Input => 0,
        }
    }

    /// The error for a send whose buffer this rank does not hold.
    fn nothing_to_send(&self, index: usize, x: &P2p) -> ExecError {
        self.at.missing(
            index,
            format!(
                "the {:?} of `{}` for micro-batch {} to send",
                x.tensor,
                self.at.name(x.unit),
                x.mb
            ),
        )
    }

    fn shape_error(&self, index: usize, what: String) -> ExecError {
        ExecError::Shape {
            rank: self.at.rank,
            index,
            action: self.at.action_at(index),
            what,
        }
    }

    fn compute(&mut self, op: Op, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        let index = self.at.expect_compute(op, unit, mb)?;
        match op {
            Op::F | Op::RF => self.forward(index, unit, mb, op == Op::RF)?,
            Op::B => {
                self.backward_input(index, unit, mb)?;
                // A unit without weights here (no W of it follows on this rank)
                // is done with its stash once its input gradient is out.
                if !self.at.later(Op::W, unit, mb, index) {
                    self.stashes.remove(&(unit, mb));
                    self.held.release(unit, mb);
                }
            }
            Op::W => self.backward_weight(index, unit, mb)?,
            Op::BW => {
                self.backward_input(index, unit, mb)?;
                self.backward_weight(index, unit, mb)?;
            }
        }
        self.slots.push(Slot {
            start: t0,
            end: self.start.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn forward(
        &mut self,
        index: usize,
        unit: UnitId,
        mb: usize,
        recompute: bool,
    ) -> Result<(), ExecError> {
        let inputs = self.units.get(unit).inputs.clone();
        for &p in &inputs {
            if !self.acts.contains_key(&(p, mb)) {
                return Err(self.at.missing(
                    index,
                    format!(
                        "the activation of `{}` for micro-batch {mb}",
                        self.at.name(p)
                    ),
                ));
            }
        }
        let (out, stash) = {
            let refs: Vec<&Tensor> = inputs
                .iter()
                .filter_map(|p| self.acts.get(&(*p, mb)))
                .collect();
            self.model.forward(unit, mb, &refs)
        };
        let want = self.units.get(unit).out_len;
        if out.len() != want {
            return Err(self.shape_error(
                index,
                format!(
                    "the model's forward of `{}` returned {} values; its output_len is {want}",
                    self.at.name(unit),
                    out.len()
                ),
            ));
        }
        for &p in &inputs {
            self.use_act(p, mb);
        }
        // Keep the stash only if this rank runs the backward; count it as held.
        if self.at.keeps_stash(unit, mb, index, recompute) {
            self.stashes.insert((unit, mb), stash);
            self.held.hold(unit, mb, self.units.get(unit).act);
        }
        if self.act_uses.get(&(unit, mb)).copied().unwrap_or(0) > 0 {
            self.acts.insert((unit, mb), out);
        }
        Ok(())
    }

    fn use_act(&mut self, unit: UnitId, mb: usize) {
        if let Some(n) = self.act_uses.get_mut(&(unit, mb)) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.act_uses.remove(&(unit, mb));
                self.acts.remove(&(unit, mb));
            }
        }
    }

    fn use_grad(&mut self, unit: UnitId, mb: usize) {
        if let Some(n) = self.grad_uses.get_mut(&(unit, mb)) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.grad_uses.remove(&(unit, mb));
                self.grads.remove(&(unit, mb));
            }
        }
    }

    fn backward_input(&mut self, index: usize, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        // The gradient of this unit's output: the sum of what each successor's
        // backward produced for it.
        let from = self.units.get(unit).grad_from.clone();
        let mut grad_out: Option<Tensor> = None;
        for &s in &from {
            let slot = self.units.get(s).inputs.iter().position(|&i| i == unit);
            let part = slot.and_then(|k| self.grads.get(&(s, mb)).and_then(|g| g.get(k)));
            let Some(part) = part else {
                return Err(self.at.missing(
                    index,
                    format!(
                        "the gradient from `{}` for micro-batch {mb}",
                        self.at.name(s)
                    ),
                ));
            };
            match &mut grad_out {
                None => grad_out = Some(part.clone()),
                Some(acc) => acc.iter_mut().zip(part).for_each(|(a, b)| *a += b),
            }
        }
        for &s in &from {
            self.use_grad(s, mb);
        }
        let Some(stash) = self.stashes.get_mut(&(unit, mb)) else {
            return Err(self.at.no_stash(index, unit, mb));
        };
        let produced = self
            .model
            .backward_input(unit, mb, stash, grad_out.as_ref());
        let inputs = &self.units.get(unit).inputs;
        let wrong = if produced.len() != inputs.len() {
            Some(format!(
                "the model's backward of `{}` returned {} input gradients for {} inputs",
                self.at.name(unit),
                produced.len(),
                inputs.len()
            ))
        } else {
            inputs.iter().zip(&produced).find_map(|(&i, g)| {
                let want = self.units.get(i).out_len;
                (g.len() != want).then(|| {
                    format!(
                        "the model's backward of `{}` returned {} values for the gradient of \
                         `{}`, whose output_len is {want}",
                        self.at.name(unit),
                        g.len(),
                        self.at.name(i)
                    )
                })
            })
        };
        if let Some(what) = wrong {
            return Err(self.shape_error(index, what));
        }
        if self.grad_uses.get(&(unit, mb)).copied().unwrap_or(0) > 0 {
            self.grads.insert((unit, mb), produced);
        }
        Ok(())
    }

    fn backward_weight(&mut self, index: usize, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        let Some(stash) = self.stashes.remove(&(unit, mb)) else {
            return Err(self.at.no_stash(index, unit, mb));
        };
        self.model.backward_weight(unit, mb, stash);
        self.held.release(unit, mb);
        Ok(())
    }
}

/// Input gradients of one unit as one flat message: the parts one after the other,
/// each at a fixed offset (the sizes are static, so nothing else travels).
fn pack(parts: &[Tensor]) -> Tensor {
    parts.concat()
}

/// The parts of a gradient message, given their lengths; `None` when the message
/// has another total length.
fn unpack(msg: &[f32], lens: impl IntoIterator<Item = usize>) -> Option<Vec<Tensor>> {
    let mut at = 0;
    let mut parts = Vec::new();
    for len in lens {
        parts.push(msg.get(at..at + len)?.to_vec());
        at += len;
    }
    (at == msg.len()).then_some(parts)
}

impl<C: Comm, M: Model> Step for Executor<'_, C, M> {
    type Error = ExecError;

    fn forward(&mut self, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        self.compute(Op::F, unit, mb)
    }
    fn backward_input(&mut self, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        self.compute(Op::B, unit, mb)
    }
    fn backward_weight(&mut self, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        self.compute(Op::W, unit, mb)
    }
    fn backward(&mut self, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        self.compute(Op::BW, unit, mb)
    }
    fn recompute(&mut self, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        self.compute(Op::RF, unit, mb)
    }

    fn p2p(&mut self, batch: &[P2p]) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        // The batch is this many consecutive actions of the program.
        let first = self.at.expect_batch(batch)?;
        let rank = self.at.rank;
        // A transfer between this rank and itself is an alias: the received buffer
        // is the sent one, under the same (unit, micro-batch) key, so it never
        // reaches the backend. Each such receive needs its send in the batch.
        for x in batch
            .iter()
            .filter(|x| x.dir == Dir::Recv && x.peer == rank)
        {
            let paired = batch.iter().any(|s| {
                s.dir == Dir::Send
                    && s.peer == rank
                    && (s.tensor, s.unit, s.mb) == (x.tensor, x.unit, x.mb)
            });
            if !paired {
                return Err(self.at.missing(
                    first,
                    format!(
                        "a SEND to this rank of the {:?} of `{}` for micro-batch {} in the same \
                         batch (a transfer to the rank itself)",
                        x.tensor,
                        self.at.name(x.unit),
                        x.mb
                    ),
                ));
            }
        }
        let mut payloads: Vec<(usize, Tag, Tensor)> = Vec::new();
        let mut recvs: Vec<(usize, Tag, usize)> = Vec::new();
        for x in batch {
            let t = Tag::transfer(x.tensor, x.unit, x.mb);
            match x.dir {
                Dir::Send if x.peer == rank => {
                    let present = match x.tensor {
                        Kind::Act => self.acts.contains_key(&(x.unit, x.mb)),
                        Kind::Grad => self.grads.contains_key(&(x.unit, x.mb)),
                        Kind::Input => true,
                    };
                    if !present {
                        return Err(self.nothing_to_send(first, x));
                    }
                }
                Dir::Recv if x.peer == rank => {}
                Dir::Send => {
                    let data = match x.tensor {
                        Kind::Act => self.acts.get(&(x.unit, x.mb)).cloned(),
                        Kind::Grad => self.grads.get(&(x.unit, x.mb)).map(|g| pack(g)),
                        Kind::Input => Some(Vec::new()),
                    };
                    let Some(data) = data else {
                        return Err(self.nothing_to_send(first, x));
                    };
                    payloads.push((x.peer, t, data));
                }
                Dir::Recv => recvs.push((x.peer, t, self.message_len(x.tensor, x.unit))),
            }
        }
        let sends: Vec<(usize, Tag, &[f32])> = payloads
            .iter()
            .map(|(p, t, d)| (*p, *t, d.as_slice()))
            .collect();
        let got = match self.comm.batch(&sends, &recvs) {
            Ok(g) => g,
            Err(e) => return Err(self.at.comm_error(first, e)),
        };
        for x in batch.iter().filter(|x| x.dir == Dir::Send) {
            match x.tensor {
                Kind::Act => self.use_act(x.unit, x.mb),
                Kind::Grad => self.use_grad(x.unit, x.mb),
                Kind::Input => {}
            }
        }
        let remote = batch
            .iter()
            .filter(|x| x.dir == Dir::Recv && x.peer != rank);
        for (x, data) in remote.zip(got) {
            match x.tensor {
                Kind::Act => {
                    self.acts.insert((x.unit, x.mb), data);
                }
                Kind::Grad => {
                    let Some(parts) = unpack(&data, self.units.grad_parts(x.unit)) else {
                        return Err(self.at.missing(
                            first,
                            format!(
                                "a well-formed gradient message for `{}`",
                                self.at.name(x.unit)
                            ),
                        ));
                    };
                    self.grads.insert((x.unit, x.mb), parts);
                }
                Kind::Input => {}
            }
        }
        let t1 = self.start.elapsed().as_secs_f64();
        for _ in batch {
            self.slots.push(Slot { start: t0, end: t1 });
        }
        Ok(())
    }

    fn broadcast(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        let index = self.at.expect_collective(CollKind::Bcast, unit, root)?;
        let t = Tag::params(unit);
        let buf = self.model.params_mut(unit);
        if let Err(e) = self.comm.broadcast(root, group, t, buf) {
            return Err(self.at.comm_error(index, e));
        }
        self.slots.push(Slot {
            start: t0,
            end: self.start.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn reduce(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        let index = self.at.expect_collective(CollKind::Reduce, unit, root)?;
        let t = Tag::grads(unit);
        let buf = self.model.grads_mut(unit);
        if let Err(e) = self.comm.reduce(root, group, t, buf) {
            return Err(self.at.comm_error(index, e));
        }
        self.slots.push(Slot {
            start: t0,
            end: self.start.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn no_such_rank(&mut self, rank: usize, ranks: usize) -> ExecError {
        ExecError::NoSuchRank { rank, ranks }
    }
}

/// Per-rank wall-clock intervals gathered into a [`Timeline`] (for
/// `mpipe_core::render` traces and charts, side by side with the simulated one).
pub fn timeline(ranks: Vec<Vec<Slot>>) -> Timeline {
    Timeline { ranks }
}

#[cfg(test)]
mod tests {
    use super::{pack, unpack};

    /// Gradient parts travel at fixed offsets with no lengths on the wire, so a part
    /// of 2^24 + 1 elements (which an `f32` length field would read back as 2^24)
    /// comes back whole, and a message of another total length is refused.
    #[test]
    fn gradient_parts_round_trip_at_any_length() {
        let big = (1usize << 24) + 1;
        let parts = vec![vec![1.5f32; big], vec![], vec![-2.0; 3]];
        let msg = pack(&parts);
        assert_eq!(msg.len(), big + 3);
        let back = unpack(&msg, [big, 0, 3]).expect("the lengths add up");
        assert_eq!(back, parts);
        assert!(unpack(&msg, [big, 0, 2]).is_none());
        assert!(unpack(&msg, [big, 0, 4]).is_none());
    }
}
