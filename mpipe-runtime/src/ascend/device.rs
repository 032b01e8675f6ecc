//! Device-resident execution: a [`DeviceModel`] computes on the NPU through
//! [`Kernels`], activations and gradients live in one arena per rank planned ahead
//! of time ([`crate::arena`]), transfers go from and to that arena by
//! `HcclBatchSendRecv`, and the host never waits inside a step.
//!
//! ## One rank, three kinds of streams
//! - the **compute stream** ([`Kernels::stream`]): every kernel of the model;
//! - the **point-to-point stream**: one `HcclBatchSendRecv` per batch of the program;
//! - the **collective streams** (world and sub-communicators): `BCAST` and `REDUCE`
//!   of a unit's parameters and gradients, in place in the model's device buffers.
//!
//! Ordering is by events only, and only where two streams touch the same bytes (so
//! that every wait issued is needed: leaving any one out lets the emulator's
//! happens-before check report a hazard, which a mutation test checks):
//! - before a batch, the point-to-point stream waits for an event recorded on the
//!   compute stream if the batch sends a buffer a kernel wrote, or receives into bytes
//!   a kernel touched ([`arena::Buffer::reuses`]), since its last such wait;
//! - after each batch an event is recorded on the point-to-point stream; the compute
//!   stream waits for it before the first kernel that reads a buffer a batch received,
//!   or writes bytes a batch touched, since its last such wait. Kernels that touch
//!   nothing transferred run on, overlapping the transfers;
//! - a collective's stream waits for the compute stream if kernels ran since its last
//!   wait (work queued before the step, such as the optimizer's, counts); the compute
//!   stream waits for a broadcast this rank receives before the unit's first kernel,
//!   and for every other collective at the end of the step.
//!
//! The host waits once, in [`DeviceStep::finish`]: one synchronisation of the
//! compute stream (after which everything the step queued has run), then one read of
//! the losses. With every stream paused the whole step is issued and returns (a test
//! checks it), so nothing in it waits on the device.
//!
//! Semantics: the point-to-point stream runs the batches in program order and each
//! completes when its partner posts, as the program format's rendezvous semantics
//! require; what the host backend runs in lockstep, here overlaps as far as the
//! events allow, so a step's device time approaches the simulator's eager figure.
//!
//! ## Device time (the emulator's virtual clock)
//! While the emulator's clock runs (`counters::clock_start`), the step charges the
//! program's costs on it (`charge_compute`, and the batch and collective paths):
//! each compute action's [`Op::cost`] on the compute stream, after the action's event
//! waits and before its kernels; each batch item's and each collective's transfer
//! time under [`DeviceRank::set_comm_model`] (`latency + bytes / bandwidth` of the
//! unit's `bytes`, or `params` for a collective, as the simulator's `CommModel`). A
//! transfer to the rank itself is an alias and costs nothing. On CANN, and with the
//! clock off, charging does nothing.

use super::kernels::Kernels;
use super::safe::{read_device, DataType, DeviceBuffer, Direction, Event, Stream};
use super::tensor::{DType, DevTensor};
use super::{AscendComm, AscendError};
use crate::arena::{self, Kind as Buf, Plan};
use crate::batches::{self, Entry, OwnedBatch};
use crate::cursor::{Cursor, Held, Units};
use crate::exec::ExecError;
use crate::{Dir, P2p, Step, Tensor as Kind, UnitId};
use mpipe_core::program::{CollKind, Op, Program};
use mpipe_core::simulate::CommModel;
use mpipe_core::timeline::Slot;
use std::collections::BTreeMap;
use std::time::Instant;

/// A model that computes on the device: the device twin of [`crate::model::Model`],
/// with the same contract action by action, except that tensors are device views and
/// results are written, not returned.
///
/// - `forward` writes the unit's output into `out` (`output_len` f32s, contiguous:
///   it is the send buffer too) from `inputs` (one per input unit, in `inputs`
///   order), and returns what its backward needs. Memory the stash holds should come
///   from a pool reused across steps (nothing should be allocated after the first).
/// - `backward_input` writes the gradient of each input into `grad_in` (one view per
///   input, each `output_len` of that input), from `grad_out` (the gradient of the
///   unit's output, `None` for the unit whose output is the loss).
/// - `backward_weight` adds the unit's weight gradients into its gradient buffer.
///
/// Every call only queues work on `k`'s stream; none may wait on the host.
pub trait DeviceModel {
    /// What a unit keeps from its forward for its backward.
    type Stash: Send;

    /// Elements of `unit`'s forward output (static).
    fn output_len(&self, unit: UnitId) -> usize;
    fn forward(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        mb: usize,
        inputs: &[DevTensor],
        out: &DevTensor,
    ) -> Result<Self::Stash, AscendError>;
    fn backward_input(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        mb: usize,
        stash: &mut Self::Stash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
    ) -> Result<(), AscendError>;
    fn backward_weight(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        mb: usize,
        stash: Self::Stash,
    ) -> Result<(), AscendError>;
    /// `unit`'s parameters (flat, contiguous f32), broadcast in place.
    fn params(&self, unit: UnitId) -> DevTensor;
    /// `unit`'s gradient accumulators (flat, contiguous f32), reduced in place.
    fn grads(&self, unit: UnitId) -> DevTensor;
    /// The per-micro-batch losses this rank computed (f32, one per micro-batch), read
    /// back once at the end of the step; `None` if this rank computes no loss.
    fn losses(&self) -> Option<DevTensor>;
}

/// One rank's device state that lasts across steps: the communicator, the kernels
/// (and compute stream), the arena and its plan, and the ordering events.
pub struct DeviceRank {
    comm: AscendComm,
    kernels: Kernels,
    plan: Plan,
    arena: DeviceBuffer,
    /// Recorded on the compute stream before each batch and collective.
    computed: Event,
    /// Recorded on the point-to-point stream after each batch.
    moved: Event,
    /// Recorded on a collective group's stream after each of its collectives.
    collected: BTreeMap<Vec<usize>, Event>,
    /// Root-side receive buffers of reductions, by unit (allocated on first use).
    scratch: BTreeMap<UnitId, DeviceBuffer>,
    /// The transfer cost model charged on the emulator's virtual clock.
    comm_model: Option<CommModel>,
    /// This rank's batches (compiled by `schedule!` and checked, or derived from the
    /// program) and each item's element count: every `HcclBatchSendRecv` is issued
    /// from them.
    table: Vec<OwnedBatch>,
    counts: Vec<Vec<usize>>,
}

impl DeviceRank {
    /// The device state of `comm`'s rank for `program`, whose units' outputs have
    /// `out_len[u]` elements (the model's `output_len`): binds the calling thread to
    /// the rank's device, makes the kernels (and compute stream), plans the arena and
    /// allocates it (the one allocation of activations and gradients of the run).
    ///
    /// The rank's batch table is derived from `program` ([`batches::derive`]); with a
    /// table `schedule!` compiled, use [`DeviceRank::with_table`]. Both then run the
    /// same code.
    pub fn new(
        comm: AscendComm,
        program: &Program,
        out_len: &[usize],
    ) -> Result<DeviceRank, AscendError> {
        let table = batches::derive(program, comm.rank)?;
        DeviceRank::build(comm, program, out_len, table)
    }

    /// As [`DeviceRank::new`], with the batch table `schedule!` emitted for this rank
    /// (`BATCHES[rank]`): checked once against `program` ([`batches::check`]; a table
    /// from another derivation is [`AscendError::Table`] naming the first difference),
    /// its element counts filled once from `out_len` ([`batches::sizes`]); each batch's
    /// `HcclBatchSendRecv` is then issued from the table's items, in their order.
    pub fn with_table(
        comm: AscendComm,
        program: &Program,
        out_len: &[usize],
        table: &[Entry],
    ) -> Result<DeviceRank, AscendError> {
        let table = batches::check(table, program, comm.rank)?;
        DeviceRank::build(comm, program, out_len, table)
    }

    fn build(
        mut comm: AscendComm,
        program: &Program,
        out_len: &[usize],
        table: Vec<OwnedBatch>,
    ) -> Result<DeviceRank, AscendError> {
        let counts = batches::sizes(&table, program, out_len)?;
        comm.enter()?;
        let kernels = Kernels::new()?;
        let plan = arena::plan(program, comm.rank, out_len)
            .map_err(|e| AscendError::Setup(format!("planning the arena: {e}")))?;
        let arena = DeviceBuffer::new(plan.size)?;
        Ok(DeviceRank {
            computed: Event::new()?,
            moved: Event::new()?,
            collected: BTreeMap::new(),
            scratch: BTreeMap::new(),
            comm_model: None,
            comm,
            kernels,
            plan,
            arena,
            table,
            counts,
        })
    }

    /// The cost of transfers charged on the emulator's virtual clock (`None`, the
    /// default: transfers cost nothing but waiting for their partners). Compute costs
    /// are always the program's.
    pub fn set_comm_model(&mut self, model: Option<CommModel>) {
        self.comm_model = model;
    }

    /// This rank's batches, as the step issues them.
    pub fn batches(&self) -> &[OwnedBatch] {
        &self.table
    }

    /// The element count of each item of each batch (as [`DeviceRank::batches`]).
    pub fn counts(&self) -> &[Vec<usize>] {
        &self.counts
    }

    /// The arena's plan (sizes, lifetimes, offsets).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Bytes of device memory the arena holds.
    pub fn arena_bytes(&self) -> usize {
        self.arena.len()
    }

    /// Records that this rank failed doing `what`: every later call of the ranks that
    /// share this world's failure record (an in-process world) fails at once naming
    /// it, as [`Comm::abort`](crate::comm::Comm::abort) does for the communicator.
    pub fn abort(&mut self, what: &str) {
        crate::comm::Comm::abort(&mut self.comm, what);
    }

    pub fn comm(&mut self) -> &mut AscendComm {
        &mut self.comm
    }

    pub fn kernels(&mut self) -> &mut Kernels {
        &mut self.kernels
    }

    /// A step of `program` with `model`: drive it with the generated code (it is a
    /// [`Step`]), then call [`DeviceStep::finish`].
    pub fn step<'a, M: DeviceModel>(
        &'a mut self,
        program: &'a Program,
        model: &'a mut M,
    ) -> DeviceStep<'a, M> {
        DeviceStep::new(self, program, model)
    }
}

/// What a finished step reports.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// Per-micro-batch losses this rank computed (empty if none).
    pub losses: Vec<f32>,
    /// Peak activation memory held for backwards (program-format units), as
    /// [`crate::exec::Executor::peak_memory`] counts it.
    pub peak_memory: f64,
    /// Host-side intervals of issuing each action (seconds from the step's start):
    /// the host's issuing time, not the device's execution time.
    pub slots: Vec<Slot>,
}

/// One rank's step on the device. See the [module docs](self).
pub struct DeviceStep<'a, M: DeviceModel> {
    dev: &'a mut DeviceRank,
    at: Cursor<'a>,
    model: &'a mut M,
    rank: usize,
    units: Units,
    /// The live buffer of each `(kind, unit, mb)`.
    current: BTreeMap<(Buf, UnitId, usize), usize>,
    /// Per buffer, the last access of each kind this step: by batch number (sends
    /// read, receives write) and by compute number (from 1; 0: none).
    p2p_read: Vec<u64>,
    p2p_write: Vec<u64>,
    comp_read: Vec<u64>,
    comp_write: Vec<u64>,
    /// Batches and compute actions issued so far (`batches` counts those with a
    /// remote item); the next entry of the rank's batch table.
    batches: u64,
    next_batch: usize,
    computes_issued: u64,
    /// The last batch the compute stream is ordered after; the last compute action
    /// the point-to-point stream, and each collective group's stream, is ordered after.
    waited: u64,
    p2p_sees: u64,
    coll_sees: BTreeMap<Vec<usize>, u64>,
    /// Collectives the compute stream is not yet ordered after: the group, and the
    /// unit whose first kernel must wait (a broadcast this rank receives: the forward
    /// reads the parameters); `None`: at the end of the step (a reduction, or a
    /// broadcast this rank sends, whose buffers no kernel of the step touches again
    /// but the optimizer will).
    coll_pending: Vec<(Vec<usize>, Option<UnitId>)>,
    stashes: BTreeMap<(UnitId, usize), M::Stash>,
    /// The compute action whose cost is charged at its next kernel (after its waits).
    charge: Option<(Op, UnitId, usize)>,
    held: Held,
    start: Instant,
    slots: Vec<Slot>,
}

/// Queues `stream`'s wait for `event`, counted on `comm` so a mutation test can leave
/// out any one of them.
fn wait(comm: &mut AscendComm, stream: &Stream, event: &Event) -> Result<(), AscendError> {
    if comm.next_wait() {
        stream.wait_event(event)?;
    }
    Ok(())
}

impl<'a, M: DeviceModel> DeviceStep<'a, M> {
    fn new(dev: &'a mut DeviceRank, program: &'a Program, model: &'a mut M) -> Self {
        let rank = dev.comm.rank;
        let units = Units::new(program, |u| model.output_len(u));
        let list = program.programs.get(rank).map_or(&[][..], Vec::as_slice);
        let n = dev.plan.buffers.len();
        DeviceStep {
            dev,
            at: Cursor::new(program, rank),
            model,
            rank,
            units,
            current: BTreeMap::new(),
            p2p_read: vec![0; n],
            p2p_write: vec![0; n],
            comp_read: vec![0; n],
            comp_write: vec![0; n],
            batches: 0,
            next_batch: 0,
            // Work queued on the compute stream before the step (uploads, the
            // optimizer) counts as one compute action: the first collective on each
            // group waits for it.
            computes_issued: 1,
            waited: 0,
            p2p_sees: 0,
            coll_sees: BTreeMap::new(),
            coll_pending: Vec::new(),
            stashes: BTreeMap::new(),
            charge: None,
            held: Held::default(),
            start: Instant::now(),
            slots: Vec::with_capacity(list.len()),
        }
    }

    fn failed(&mut self, index: usize, e: AscendError) -> ExecError {
        // (Leaving the communicator as a failed rank when dropped, see AscendComm.)
        let e = self.dev.comm.track(Err::<(), _>(e)).expect_err("an error");
        self.at.comm_error(index, e)
    }

    /// The device view of buffer `b` (all of it, flat).
    fn view(&self, b: usize) -> DevTensor {
        let buf = &self.dev.plan.buffers[b];
        DevTensor::new(
            self.dev.arena.as_ptr() as usize + buf.offset,
            DType::F32,
            &[buf.len],
        )
    }

    /// The live buffer of `(kind, unit, mb)`, or the error naming what is missing.
    fn live_buffer(
        &self,
        index: usize,
        kind: Buf,
        unit: UnitId,
        mb: usize,
    ) -> Result<usize, ExecError> {
        self.current.get(&(kind, unit, mb)).copied().ok_or_else(|| {
            let what = match kind {
                Buf::Act | Buf::Stash => "activation",
                Buf::Grad | Buf::GradSum => "gradient",
            };
            self.at.missing(
                index,
                format!(
                    "the {what} of `{}` for micro-batch {mb}",
                    self.at.name(unit)
                ),
            )
        })
    }

    /// The buffer action `index` brings into being for `(kind, unit, mb)`.
    fn define(
        &mut self,
        index: usize,
        kind: Buf,
        unit: UnitId,
        mb: usize,
    ) -> Result<usize, ExecError> {
        let b = self
            .dev
            .plan
            .defined_at(index, kind, unit, mb)
            .ok_or_else(|| {
                self.at.missing(
                    index,
                    format!("an arena buffer for `{}`", self.at.name(unit)),
                )
            })?;
        self.current.insert((kind, unit, mb), b);
        Ok(b)
    }

    /// The latest of `f` over `bufs` and the buffers whose bytes they reuse.
    fn latest(&self, bufs: &[usize], with_reused: bool, f: impl Fn(usize) -> u64) -> u64 {
        bufs.iter()
            .flat_map(|&b| {
                let reused: &[usize] = if with_reused {
                    &self.dev.plan.buffers[b].reuses
                } else {
                    &[]
                };
                std::iter::once(b).chain(reused.iter().copied())
            })
            .map(f)
            .max()
            .unwrap_or(0)
    }

    /// Orders the next kernels, which read `reads` and write `writes`, after the
    /// transfers and collectives that touched the same bytes; records their accesses.
    fn order_compute(
        &mut self,
        index: usize,
        unit: UnitId,
        reads: &[usize],
        writes: &[usize],
    ) -> Result<(), ExecError> {
        let need = self
            .latest(reads, false, |b| self.p2p_write[b])
            .max(self.latest(writes, true, |b| self.p2p_read[b].max(self.p2p_write[b])));
        let dev = &mut *self.dev;
        let r = (|| {
            if need > self.waited {
                wait(&mut dev.comm, dev.kernels.stream(), &dev.moved)?;
                self.waited = self.batches;
            }
            let mut now = Vec::new();
            self.coll_pending.retain(|(g, u)| {
                let due = *u == Some(unit);
                if due && !now.contains(g) {
                    now.push(g.clone());
                }
                !due
            });
            for g in now {
                if let Some(e) = dev.collected.get(&g) {
                    wait(&mut dev.comm, dev.kernels.stream(), e)?;
                }
            }
            Ok(())
        })();
        r.map_err(|e| self.failed(index, e))?;
        self.charge_compute(index)?;
        self.computes_issued += 1;
        for &b in reads {
            self.comp_read[b] = self.computes_issued;
        }
        for &b in writes {
            self.comp_write[b] = self.computes_issued;
        }
        Ok(())
    }

    /// The part of `from`'s gradient message that is the gradient of `unit`'s output.
    fn grad_part(
        &self,
        index: usize,
        from: UnitId,
        unit: UnitId,
        mb: usize,
    ) -> Result<(usize, DevTensor), ExecError> {
        let b = self.live_buffer(index, Buf::Grad, from, mb)?;
        let inputs = &self.units.get(from).inputs;
        let k = inputs.iter().position(|&i| i == unit).unwrap_or(0);
        let at: usize = inputs[..k].iter().map(|&i| self.units.get(i).out_len).sum();
        let len = self.units.get(unit).out_len;
        Ok((b, self.view(b).narrow(0, at, len)))
    }

    /// Device time: the program's cost of the compute action being issued, charged on
    /// the compute stream once its waits are queued (a no-op unless the emulator's
    /// clock runs); and the transfer cost of a unit's message (`bytes`) or parameters
    /// (`params`) under the comm model.
    fn charge_compute(&mut self, index: usize) -> Result<(), ExecError> {
        let Some((op, unit, mb)) = self.charge.take() else {
            return Ok(());
        };
        if !ascend_sys::profile::clock_enabled() {
            return Ok(());
        }
        let name = self.at.name(unit);
        let cost = self
            .at
            .program
            .units
            .get(unit as usize)
            .map_or(0.0, |u| op.cost(&u.cost));
        let stream = self.dev.kernels.stream().raw();
        let rc = ascend_sys::profile::charge(stream, cost, || {
            format!("{} {name} mb {mb} at action {index}", op.as_str())
        });
        super::safe::acl("charging device time", rc).map_err(|e| self.failed(index, e))
    }

    fn transfer_cost(&self, unit: UnitId, params: bool) -> f64 {
        let u = self.at.program.units.get(unit as usize);
        match (self.dev.comm_model, u) {
            (Some(c), Some(u)) => c.transfer_time(if params { u.params } else { u.bytes }),
            _ => 0.0,
        }
    }

    fn compute(&mut self, op: Op, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        let index = self.at.expect_compute(op, unit, mb)?;
        self.charge = Some((op, unit, mb));
        match op {
            Op::F | Op::RF => self.forward(index, unit, mb, op == Op::RF)?,
            Op::B => {
                self.backward_input(index, unit, mb)?;
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
        let mut bufs = Vec::with_capacity(inputs.len());
        for &p in &inputs {
            bufs.push(self.live_buffer(index, Buf::Act, p, mb)?);
        }
        let views: Vec<DevTensor> = bufs.iter().map(|&b| self.view(b)).collect();
        let out = self.define(index, Buf::Act, unit, mb)?;
        self.order_compute(index, unit, &bufs, &[out])?;
        let out = self.view(out);
        let dev = &mut *self.dev;
        let stash = self
            .model
            .forward(&mut dev.kernels, unit, mb, &views, &out)
            .map_err(|e| self.failed(index, e))?;
        if self.at.keeps_stash(unit, mb, index, recompute) {
            self.stashes.insert((unit, mb), stash);
            self.held.hold(unit, mb, self.units.get(unit).act);
        }
        Ok(())
    }

    fn backward_input(&mut self, index: usize, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        let from = self.units.get(unit).grad_from.clone();
        let mut bufs = Vec::new();
        let mut writes = Vec::new();
        let mut parts = Vec::with_capacity(from.len());
        for &s in &from {
            let (b, v) = self.grad_part(index, s, unit, mb)?;
            bufs.push(b);
            parts.push(v);
        }
        let sum = if from.len() > 1 {
            let b = self.define(index, Buf::GradSum, unit, mb)?;
            writes.push(b);
            Some(self.view(b))
        } else {
            None
        };
        let has_inputs = !self.units.get(unit).inputs.is_empty();
        let grad_in: Vec<DevTensor> = if has_inputs {
            let b = self.define(index, Buf::Grad, unit, mb)?;
            writes.push(b);
            let whole = self.view(b);
            let mut at = 0;
            self.units
                .get(unit)
                .inputs
                .iter()
                .map(|&i| {
                    let len = self.units.get(i).out_len;
                    let v = whole.narrow(0, at, len);
                    at += len;
                    v
                })
                .collect()
        } else {
            Vec::new()
        };
        self.order_compute(index, unit, &bufs, &writes)?;
        if !self.stashes.contains_key(&(unit, mb)) {
            return Err(self.at.no_stash(index, unit, mb));
        }
        let dev = &mut *self.dev;
        let grad_out = match (&sum, parts.as_slice()) {
            (Some(sum), [first, second, rest @ ..]) => {
                let summed = dev
                    .kernels
                    .add(first, second, 1.0, sum)
                    .and_then(|()| rest.iter().try_for_each(|p| dev.kernels.add_(sum, p, 1.0)));
                if let Err(e) = summed {
                    return Err(self.failed(index, e));
                }
                Some(sum.clone())
            }
            (_, [one]) => Some(one.clone()),
            _ => None,
        };
        let Some(stash) = self.stashes.get_mut(&(unit, mb)) else {
            return Ok(());
        };
        let r = self.model.backward_input(
            &mut dev.kernels,
            unit,
            mb,
            stash,
            grad_out.as_ref(),
            &grad_in,
        );
        r.map_err(|e| self.failed(index, e))
    }

    fn backward_weight(&mut self, index: usize, unit: UnitId, mb: usize) -> Result<(), ExecError> {
        let Some(stash) = self.stashes.remove(&(unit, mb)) else {
            return Err(self.at.no_stash(index, unit, mb));
        };
        self.order_compute(index, unit, &[], &[])?;
        let dev = &mut *self.dev;
        self.model
            .backward_weight(&mut dev.kernels, unit, mb, stash)
            .map_err(|e| self.failed(index, e))?;
        self.held.release(unit, mb);
        Ok(())
    }

    /// Queues `queue` on the stream of the collective over `group`, ordered after the
    /// compute stream's work so far and before its later work.
    fn collective(
        &mut self,
        index: usize,
        root: usize,
        group: &[usize],
        before: Option<UnitId>,
        unit: UnitId,
        queue: impl FnOnce(
            &super::safe::HcclComm,
            &Stream,
            u32,
            &mut BTreeMap<UnitId, DeviceBuffer>,
        ) -> Result<(), AscendError>,
    ) -> Result<(), ExecError> {
        let cost = self.transfer_cost(unit, true);
        let label = || format!("{} at action {index}", self.at.action_at(index));
        let label = ascend_sys::profile::clock_enabled().then(label);
        let dev = &mut *self.dev;
        let seen = self.coll_sees.entry(group.to_vec()).or_insert(0);
        let r = (|| {
            dev.comm.check_failed()?;
            let root_index = dev.comm.group_root(group, root)?;
            let order = *seen < self.computes_issued;
            if order {
                dev.computed.record(dev.kernels.stream())?;
            }
            let issue = order && dev.comm.next_wait();
            let (comm, stream) = dev.comm.group_refs(group);
            if issue {
                stream.wait_event(&dev.computed)?;
            }
            *seen = self.computes_issued;
            if let Some(label) = label {
                let rc = ascend_sys::profile::charge_transfers(stream.raw(), &[cost], || label);
                super::safe::acl("charging device time", rc)?;
            }
            queue(comm, stream, root_index, &mut dev.scratch)?;
            let event = match dev.collected.entry(group.to_vec()) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => v.insert(Event::new()?),
            };
            event.record(stream)
        })();
        if r.is_ok() {
            self.coll_pending.push((group.to_vec(), before));
        }
        r.map_err(|e| self.failed(index, e))
    }

    /// Ends the step: the compute stream waits for the last batch, the host waits
    /// once for the compute stream, HCCL's asynchronous errors are checked, and the
    /// losses are read back.
    pub fn finish(mut self) -> Result<StepReport, ExecError> {
        let index = self.at.pc;
        let end = self.at.list().len();
        if index != end {
            return Err(ExecError::OutOfStep {
                rank: self.rank,
                index,
                called: "the end of the step".into(),
                expected: self.at.action_at(index),
            });
        }
        if self.batches > self.waited {
            let dev = &mut *self.dev;
            wait(&mut dev.comm, dev.kernels.stream(), &dev.moved)
                .map_err(|e| self.failed(index, e))?;
            self.waited = self.batches;
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (g, _) in std::mem::take(&mut self.coll_pending) {
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
        for g in groups {
            let dev = &mut *self.dev;
            if let Some(e) = dev.collected.get(&g) {
                wait(&mut dev.comm, dev.kernels.stream(), e).map_err(|e| self.failed(index, e))?;
            }
        }
        let dev = &mut *self.dev;
        // A failed transfer shows at the synchronisation or as HCCL's asynchronous
        // error; a rank that died is named (not HCCL's bare remote error).
        let synced = dev
            .kernels
            .synchronize()
            .and_then(|()| dev.comm.comm.async_error())
            .map_err(|e| {
                AscendComm::sync_error(&dev.comm.comm, None, &dev.comm.blame, e, || {
                    "a device step".into()
                })
            });
        synced.map_err(|e| self.failed(index.saturating_sub(1), e))?;
        let mut losses = Vec::new();
        if let Some(t) = self.model.losses() {
            let mut bytes = vec![0u8; t.numel() * 4];
            read_device(t.data_addr(), &mut bytes)
                .map_err(|e| self.failed(index.saturating_sub(1), e))?;
            losses = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
        }
        Ok(StepReport {
            losses,
            peak_memory: self.held.peak,
            slots: std::mem::take(&mut self.slots),
        })
    }
}

impl<M: DeviceModel> Step for DeviceStep<'_, M> {
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
        let first = self.at.expect_batch(batch)?;
        // The generated call is the program's batch (checked just now); the rank's
        // table, checked against the same program at start-up, has it as its next
        // entry unless the step runs another program than the rank was built for.
        let k = self.next_batch;
        let fits = self
            .dev
            .table
            .get(k)
            .is_some_and(|b| b.first == first && b.items.len() == batch.len());
        if !fits {
            return Err(ExecError::OutOfStep {
                rank: self.rank,
                index: first,
                called: format!(
                    "a batch of {} items at action {first} (the step's program)",
                    batch.len()
                ),
                expected: self.dev.table.get(k).map_or_else(
                    || "no further batch (the rank's batch table)".into(),
                    |b| {
                        format!(
                            "a batch of {} items at action {} (the rank's batch table); \
                             build the DeviceRank from the program the step runs",
                            b.items.len(),
                            b.first
                        )
                    },
                ),
            });
        }
        self.next_batch += 1;
        let kind = |t: Kind| match t {
            Kind::Act => Some(Buf::Act),
            Kind::Grad => Some(Buf::Grad),
            Kind::Input => None,
        };
        let base = self.dev.arena.as_ptr() as usize;
        let mut items: Vec<(Direction, usize, usize, u32)> = Vec::new();
        // Device time: each item's transfer cost, when the emulator's clock runs.
        let timed = ascend_sys::profile::clock_enabled();
        let mut costs = Vec::new();
        let (mut sent, mut received) = (Vec::new(), Vec::new());
        for j in 0..batch.len() {
            let x = self.dev.table[k].items[j];
            let count = self.dev.counts[k][j];
            let index = first + j;
            let key = kind(x.tensor);
            if x.peer == self.rank {
                // A transfer to this rank itself is an alias of the sent buffer; its
                // receive needs the send in the same batch.
                let paired = self.dev.table[k].items.iter().any(|s| {
                    s.dir != x.dir
                        && s.peer == self.rank
                        && (s.tensor, s.unit, s.mb) == (x.tensor, x.unit, x.mb)
                });
                let present = key.is_none_or(|b| self.current.contains_key(&(b, x.unit, x.mb)));
                if !paired || !present {
                    return Err(self.at.missing(
                        index,
                        format!(
                            "the {:?} of `{}` for micro-batch {} sent to this rank itself in the same batch",
                            x.tensor,
                            self.at.name(x.unit),
                            x.mb
                        ),
                    ));
                }
                continue;
            }
            let dir = match x.dir {
                Dir::Send => Direction::Send,
                Dir::Recv => Direction::Recv,
            };
            if timed {
                costs.push(self.transfer_cost(x.unit, false));
            }
            let buf = match (key, x.dir) {
                // An input transfer carries nothing (the receiver reads the
                // micro-batch itself): a zero-count item.
                (None, _) => {
                    items.push((dir, base, count, x.peer as u32));
                    continue;
                }
                (Some(b), Dir::Send) => {
                    let buf = self.live_buffer(index, b, x.unit, x.mb)?;
                    sent.push(buf);
                    buf
                }
                (Some(b), Dir::Recv) => {
                    let buf = self.define(index, b, x.unit, x.mb)?;
                    received.push(buf);
                    buf
                }
            };
            let v = &self.dev.plan.buffers[buf];
            if v.len != count {
                return Err(ExecError::Shape {
                    rank: self.rank,
                    index,
                    action: self.at.action_at(index),
                    what: format!(
                        "the batch table's count is {count} elements, the arena's buffer \
                         {} (both from the model's output lengths: a bug in the runtime)",
                        v.len
                    ),
                });
            }
            items.push((dir, base + v.offset, count, x.peer as u32));
        }
        if !items.is_empty() {
            let need = self
                .latest(&sent, false, |b| self.comp_write[b])
                .max(self.latest(&received, true, |b| {
                    self.comp_read[b].max(self.comp_write[b])
                }));
            let order = need > self.p2p_sees;
            let dev = &mut *self.dev;
            let r = (|| {
                // A rank of this world that failed stops the others at their next
                // batch, not at HCCL's timeout.
                dev.comm.check_failed()?;
                if order {
                    dev.computed.record(dev.kernels.stream())?;
                    if dev.comm.next_wait() {
                        dev.comm.p2p.wait_event(&dev.computed)?;
                    }
                }
                if timed {
                    let rc =
                        ascend_sys::profile::charge_transfers(dev.comm.p2p.raw(), &costs, || {
                            format!("batch at action {first}")
                        });
                    super::safe::acl("charging device time", rc)?;
                }
                dev.comm
                    .comm
                    .batch_send_recv_at(&items, DataType::F32, &dev.comm.p2p)?;
                dev.moved.record(&dev.comm.p2p)
            })();
            r.map_err(|e| self.failed(first, e))?;
            if order {
                self.p2p_sees = self.computes_issued;
            }
            self.batches += 1;
            for b in sent {
                self.p2p_read[b] = self.batches;
            }
            for b in received {
                self.p2p_write[b] = self.batches;
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
        let params = self.model.params(unit);
        // A rank that receives the parameters orders the unit's first kernel after
        // them; the root only reads them (ordered before the optimizer at the end).
        let before = (self.rank != root).then_some(unit);
        self.collective(index, root, group, before, unit, |comm, stream, r, _| {
            comm.broadcast_at(params.data_addr(), params.numel(), r, stream)
        })?;
        self.slots.push(Slot {
            start: t0,
            end: self.start.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn reduce(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), ExecError> {
        let t0 = self.start.elapsed().as_secs_f64();
        let index = self.at.expect_collective(CollKind::Reduce, unit, root)?;
        let grads = self.model.grads(unit);
        let me = self.rank;
        self.collective(
            index,
            root,
            group,
            None,
            unit,
            |comm, stream, r, scratch| {
                let bytes = grads.numel() * 4;
                let buf = match scratch.entry(unit) {
                    std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(DeviceBuffer::new(bytes)?)
                    }
                };
                let at = buf.as_ptr() as usize;
                comm.reduce_sum_at(grads.data_addr(), at, grads.numel(), r, stream)?;
                if me == root {
                    stream.copy_device_async(grads.data_addr(), at, bytes)?;
                }
                Ok(())
            },
        )?;
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
