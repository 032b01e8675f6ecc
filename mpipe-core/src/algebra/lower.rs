//! Lowering: from a [`Plan`] (compute only) to a [`Program`] (compute + communication).
//!
//! All communication is derived here, once, from the plan's data dependencies:
//! a `SEND`/`RECV` pair for every tensor a task reads from another rank, an `input`
//! pair for every [`InputShip`](crate::ir::plan::InputShip), a `BCAST` of every trainable
//! unit to the ranks that compute it away from its home, and a `REDUCE` of its weight
//! gradients from the ranks that run its `W`/`BW` there.
//!
//! ## Why the result cannot deadlock under rendezvous
//! Every transfer gets a key, and **every rank posts its communication in increasing
//! key order** (broadcasts first, reductions last). Then no execution can get stuck:
//! take the transfer `x` of smallest key that still has an end not reached; the rank
//! holding that end is blocked at some earlier batch, all of whose members have
//! smaller keys, so one of them has an end not reached — contradicting minimality.
//! (Compute never blocks; a batch completes once all its partners are reached.)
//!
//! The key of a transfer is the ideal completion time of the task producing the
//! tensor (then that task's position in the ideal run, a topological order; then the
//! tensor's identity). Placement needs `SEND`s after their producer and `RECV`s before
//! their consumer, in key order: if a rank receives `y` before a task that comes no
//! later than the producer of a tensor `x` it sends, then `y`'s producer precedes
//! `x`'s in the dependency graph, so `key(y) < key(x)` — the constraints are always
//! satisfiable, and each action is placed at the earliest slot that respects them
//! (a `RECV` no earlier than the point where its rank's ideal timeline reaches the
//! tensor's ready time, so receivers do not wait needlessly).
//!
//! Actions that land between the same two compute tasks are posted together as
//! batches (at most one `SEND` to and one `RECV` from each peer per batch).

use crate::algebra::analysis::{dependencies_named, timing, PlanError, Timing};
use crate::algebra::runs::{sort_runs, sorted_runs};
use crate::ir::plan::{Plan, UnitNames};
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{
    Action, CollKind, Dir, Name, Op, Prefetch, Program, Source, Tensor, Unit, FORMAT,
};
use std::cell::Cell;
use std::cmp::Ordering;
use std::num::NonZeroU32;
use std::sync::Arc;

/// The lowering failed: the plan is not executable, or (a bug) the placement
/// constraints proved satisfiable were not.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LowerError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("internal error: cannot place {action} on rank {rank} (slot {slot} > {limit}); please report this with the expression")]
    Placement {
        rank: usize,
        action: String,
        slot: usize,
        limit: usize,
    },
    #[error("cannot lower {action}: its unit, micro-batch or peer is over 2^32; derive fewer micro-batches, units or ranks per step")]
    TooLarge { action: String },
}

/// One end of a transfer as placed on its rank: posted just before compute task
/// `slot` (at the end for `slot == len`); `min..=max` are the slots its
/// dependencies allow, `id` names the transfer (both ends share it). The end's
/// action ([`Placed::action`]) is kept as numbers, not as an [`Action`]: a placement
/// holds one end per transfer end of the program (millions at the largest sizes),
/// and a search holds several placements: its numbers are 32-bit (32 bytes an end;
/// 48 with the slots and the id as `usize`), and a placement whose numbers do not
/// fit is refused ([`LowerError::TooLarge`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Placed {
    pub slot: u32,
    pub min: u32,
    pub max: u32,
    /// The transfer's index in the plan's transfers.
    pub id: u32,
    pub dir: Dir,
    pub tensor: Tensor,
    /// The unit, as its index in the plan's units.
    pub unit: u32,
    pub mb: u32,
    /// The rank at the other end.
    pub peer: u32,
}

impl Placed {
    /// The end's action (no batch), `names` being the plan's unit names in order.
    pub(crate) fn action(&self, names: &[Name]) -> Action {
        Action::p2p(
            self.dir,
            self.tensor,
            names[self.unit as usize].clone(),
            self.mb as usize,
            self.peer as usize,
            None,
        )
    }
}

/// The plan's unit names, shared by the actions that name them.
pub(crate) fn unit_names(plan: &Plan) -> Vec<Name> {
    plan.units
        .iter()
        .map(|u| Name::from(u.name.as_str()))
        .collect()
}

/// An integer ordered as `f64::total_cmp` orders `x`.
pub(crate) fn total_order(x: f64) -> i64 {
    let bits = x.to_bits() as i64;
    // Negative numbers (sign bit set) have their other bits flipped.
    let sign = bits >> (i64::BITS - 1);
    bits ^ ((sign as u64) >> 1) as i64
}

/// `t` as an unsigned integer ordered as `f64::total_cmp` orders `t`.
fn time_key(t: f64) -> u64 {
    (total_order(t) as u64) ^ (1 << (u64::BITS - 1))
}

/// `ends.partition_point(|&e| e <= t)` for non-decreasing `ends` (a rank's end
/// times), found by galloping outward from index `near`: a few steps when the answer
/// is close to it.
fn partition_near(ends: &[f64], t: f64, near: usize) -> usize {
    let n = ends.len();
    let near = near.min(n);
    // The answer lies in `lo..=hi`.
    let (lo, hi) = if near > 0 && ends[near - 1] > t {
        // Below `near`.
        let (mut hi, mut step) = (near - 1, 1);
        loop {
            let lo = hi.saturating_sub(step);
            if lo == 0 || ends[lo - 1] <= t {
                break (lo, hi);
            }
            hi = lo - 1;
            step *= 2;
        }
    } else {
        // At `near` or above.
        let (mut lo, mut step) = (near, 1);
        loop {
            let hi = (lo + step).min(n);
            if hi == n || ends[hi] > t {
                break (lo, hi);
            }
            lo = hi + 1;
            step *= 2;
        }
    };
    lo + ends[lo..hi].partition_point(|&e| e <= t)
}

/// A transfer: `(tensor, unit, mb, destination rank)`.
pub(crate) type TransferId = (Tensor, usize, usize, usize);
/// Its ends: `(source rank, producer index there, first consumer index at the destination)`.
pub(crate) type Ends = (usize, usize, usize);

/// A transfer of [`Prepared`] (its [`TransferId`] and [`Ends`]) with 32-bit numbers:
/// 28 bytes, where the two as machine words took 56. Every lowering of a plan holds
/// one per transfer of the plan beside its candidates (at 8 x 65536, about 1.8 M).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Transfer {
    tensor: Tensor,
    unit: u32,
    mb: u32,
    to: u32,
    from: u32,
    j: u32,
    i: u32,
}

impl Transfer {
    /// `id` and `ends` in 32 bits; `None` when a number is over.
    fn new((tensor, unit, mb, to): TransferId, (from, j, i): Ends) -> Option<Transfer> {
        let n = |x: usize| u32::try_from(x).ok();
        Some(Transfer {
            tensor,
            unit: n(unit)?,
            mb: n(mb)?,
            to: n(to)?,
            from: n(from)?,
            j: n(j)?,
            i: n(i)?,
        })
    }

    /// The transfer's identity and its ends, as machine words.
    fn parts(self) -> (TransferId, Ends) {
        let w = |x: u32| x as usize;
        (
            (self.tensor, w(self.unit), w(self.mb), w(self.to)),
            (w(self.from), w(self.j), w(self.i)),
        )
    }

    /// The transfer's identity, `(tensor, unit, mb, to)`, in [`Transfer::order`].
    fn id(&self) -> (Tensor, u32, u32, u32) {
        (self.tensor, self.unit, self.mb, self.to)
    }

    /// The order of [`Prepared::transfers`]: by identity, then by first consumer.
    fn order(&self) -> (Tensor, u32, u32, u32, u32) {
        (self.tensor, self.unit, self.mb, self.to, self.i)
    }
}

/// Lower `plan` to a program with [`Placement::Meet`] (falling back to
/// [`Placement::Ready`] where it cannot apply). `expr` is recorded as the source.
pub fn lower(plan: &Plan, expr: Option<&str>) -> Result<Program, LowerError> {
    lower_with(plan, expr, Placement::Meet)
}

/// Lower `plan` with the given placement rule.
pub fn lower_with(
    plan: &Plan,
    expr: Option<&str>,
    placement: Placement,
) -> Result<Program, LowerError> {
    lower_prepared(plan, &prepare(plan)?, expr, placement)
}

/// What every lowering of one plan shares: its dependencies' ideal timing and the
/// transfers they imply. Prepare once to lower a plan several ways.
pub struct Prepared {
    /// The plan's ideal (communication-free) timing.
    pub time: Timing,
    transfers: Vec<Transfer>,
    /// Per rank, the transfers with an end there, grouped by the other end and
    /// direction, each group in the transfers' order ([`ends_by_peer`]): each group
    /// of one tensor and unit about in the order every placement gives it, so
    /// sorting their keys is quick (a merge of long runs). Empty when a transfer's
    /// index is over 32 bits. Shared by the preparations that have the same
    /// transfers at the same places from the same sources ([`prepare_patched`]).
    ends: Arc<Vec<Vec<u32>>>,
}

/// [`Prepared::ends`] of these transfers of a plan of `p` ranks: per rank grouped by the other
/// end and direction, and within a group in the transfers' order (by tensor, unit,
/// micro-batch, then the rest of [`Transfer::order`]).
///
/// Within a group (one peer, one direction), the ends of one tensor of one unit
/// follow one another by micro-batch, and their meeting times mostly rise with it:
/// the keys come in long sorted runs, which the placements' sort finds and merges.
/// The ends are counted into their groups (a stable counting sort, each end a
/// group of its rank: `2 peer + 1` for a SEND, `2 peer` for a RECV), linear in the
/// ends and the groups: where every rank's groups (`2 ranks^2`) are no more than
/// the ends, the transfers are read twice (counted, then written to their places);
/// else each rank's ends are listed first and counted rank by rank
/// ([`ends_by_peer_listed`]), so that the counts stay linear in the ranks.
fn ends_by_peer(p: usize, transfers: &[Transfer]) -> Vec<Vec<u32>> {
    if u32::try_from(transfers.len()).is_err() {
        return Vec::new();
    }
    let groups = 2 * p;
    let ends = 2 * transfers.len();
    if p.checked_mul(groups).is_none_or(|cells| cells > ends) {
        return ends_by_peer_listed(p, transfers);
    }
    // The group of each end: its rank's groups are `rank * groups..(rank + 1) * groups`.
    let send = |t: &Transfer| t.from as usize * groups + 2 * t.to as usize + 1;
    let recv = |t: &Transfer| t.to as usize * groups + 2 * t.from as usize;
    let mut at = vec![0usize; p * groups];
    for t in transfers {
        at[send(t)] += 1;
        at[recv(t)] += 1;
    }
    // Each group's first place in its rank's list (counts to offsets, rank by rank).
    let mut lists = Vec::with_capacity(p);
    for rank in at.chunks_mut(groups) {
        let mut next = 0;
        for c in rank {
            let n = *c;
            *c = next;
            next += n;
        }
        lists.push(vec![0u32; next]);
    }
    for (id, t) in transfers.iter().enumerate() {
        for (rank, g) in [(t.from as usize, send(t)), (t.to as usize, recv(t))] {
            lists[rank][at[g]] = id as u32;
            at[g] += 1;
        }
    }
    lists
}

/// [`ends_by_peer`] through each rank's list of its ends (in the transfers' order,
/// with their groups), counted into the groups rank by rank: linear in the ends and
/// the ranks, for many ranks with few transfers.
fn ends_by_peer_listed(p: usize, transfers: &[Transfer]) -> Vec<Vec<u32>> {
    let mut sizes = vec![0usize; p];
    for t in transfers {
        sizes[t.from as usize] += 1;
        sizes[t.to as usize] += 1;
    }
    // Each end's group (`2 peer + 1` for a SEND, `2 peer` for a RECV) and transfer.
    let mut grouped: Vec<Vec<(usize, u32)>> =
        sizes.iter().map(|&n| Vec::with_capacity(n)).collect();
    for (id, t) in transfers.iter().enumerate() {
        let (from, to) = (t.from as usize, t.to as usize);
        grouped[from].push((2 * to + 1, id as u32));
        grouped[to].push((2 * from, id as u32));
    }
    let mut count = vec![0usize; 2 * p + 1];
    grouped
        .into_iter()
        .map(|ends| {
            count.fill(0);
            for &(g, _) in &ends {
                count[g + 1] += 1;
            }
            for g in 1..count.len() {
                count[g] += count[g - 1];
            }
            let mut list = vec![0u32; ends.len()];
            for (g, id) in ends {
                list[count[g]] = id;
                count[g] += 1;
            }
            list
        })
        .collect()
}

/// `list` sorted stably by `key` (each below `buckets`) by counting, through the
/// scratch `buffer` and `count`.
fn counting_sort<T: Copy>(
    list: &mut Vec<T>,
    buffer: &mut Vec<T>,
    count: &mut Vec<usize>,
    buckets: usize,
    key: impl Fn(T) -> usize,
) {
    count.clear();
    count.resize(buckets + 1, 0);
    for &x in list.iter() {
        count[key(x) + 1] += 1;
    }
    for b in 1..=buckets {
        count[b] += count[b - 1];
    }
    buffer.clear();
    buffer.extend_from_slice(list);
    for &x in list.iter() {
        let at = &mut count[key(x)];
        buffer[*at] = x;
        *at += 1;
    }
    std::mem::swap(list, buffer);
}

/// Resolve `plan`'s dependencies, time it and collect its transfers.
pub fn prepare(plan: &Plan) -> Result<Prepared, LowerError> {
    prepare_named(plan, &plan.unit_names())
}

/// [`prepare`] with the plan's units found by name in `names` (see
/// [`dependencies_named`]).
pub(crate) fn prepare_named(plan: &Plan, names: &UnitNames) -> Result<Prepared, LowerError> {
    let deps = dependencies_named(plan, names)?;
    let time = timing(plan, &deps)?;
    prepare_timed(
        plan,
        |r, i| {
            deps.of(r, i)
                .iter()
                .map(|d| (d.tensor, d.unit(), d.producer()))
        },
        time,
    )
}

/// [`prepare_named`] of a plan whose dependencies and ideal timing `time` the
/// caller has (the order search patches its trials' from their base's,
/// `crate::search::ideal`): `deps(r, i)` lists task `i` of rank `r`'s inputs as
/// `(tensor, unit, (rank, index) of the producer)`, in the order
/// [`crate::algebra::analysis::Deps::of`] does.
pub(crate) fn prepare_timed<I: Iterator<Item = (Tensor, usize, (usize, usize))>>(
    plan: &Plan,
    deps: impl Fn(usize, usize) -> I,
    time: Timing,
) -> Result<Prepared, LowerError> {
    // Every cross-rank read, then one transfer per (tensor, unit, mb, destination):
    // the first consumer on the destination decides where the RECV must be.
    let mut reads: Vec<Transfer> = Vec::new();
    let mut read = |id: TransferId, ends: Ends| {
        reads.push(transfer(id, ends)?);
        Ok::<(), LowerError>(())
    };
    for (r, list) in plan.order.iter().enumerate() {
        for (i, task) in list.iter().enumerate() {
            let mb = task.mb;
            for (tensor, unit, (q, j)) in deps(r, i) {
                if q != r {
                    read((tensor, unit, mb, r), (q, j, i))?;
                }
            }
        }
    }
    // The task index only serves shipped inputs (most plans have none).
    let index = if plan.input_ships.is_empty() {
        None
    } else {
        Some(plan.locate())
    };
    for s in &plan.input_ships {
        let Some(index) = &index else { break };
        let (Some((q, j)), Some((r, i))) = (
            index.get(Op::F, s.unit, s.mb),
            index.get(Op::RF, s.unit, s.mb),
        ) else {
            continue;
        };
        if q == s.from && r == s.to && q != r {
            read((Tensor::Input, s.unit, s.mb, r), (q, j, i))?;
        }
    }
    sort_reads(&mut reads);
    reads.dedup_by_key(|t| t.parts().0);
    // Every lowering of the plan holds these: not the reads' capacity beside them.
    reads.shrink_to_fit();
    let ends = Arc::new(ends_by_peer(plan.ranks, &reads));
    Ok(Prepared {
        time,
        transfers: reads,
        ends,
    })
}

/// A read's transfer in 32-bit numbers, else [`LowerError::TooLarge`].
fn transfer(id: TransferId, ends: Ends) -> Result<Transfer, LowerError> {
    Transfer::new(id, ends).ok_or_else(|| {
        let (tensor, unit, mb, to) = id;
        LowerError::TooLarge {
            action: format!("the transfer of {tensor:?}(unit #{unit}, mb {mb}) to rank {to}"),
        }
    })
}

/// [`prepare_timed`] of a trial of the plan `base` prepares, timed `time`: the
/// base's order with tasks moved within their ranks, each rank's moved tasks in
/// a window of indices (`window(r, i)`: whether index `i` of rank `r` lies in its
/// window, where the trial's tasks are the base's in another order), the base's
/// task `j` of rank `q` at index `moved(q, j)` of the trial; `reads` are the
/// cross-rank reads of the trial's tasks in the windows (as [`prepare_timed`]
/// lists them: `(tensor, unit, mb, destination)` and `(source, producer index,
/// consumer index)`, the trial's indices), a plan of `ranks` ranks.
///
/// Equal to [`prepare_timed`] of the trial, field for field. A task outside the
/// windows reads what it read in the base (at its producers' new indices), so the
/// trial's reads are the base's outside the windows and `reads` inside. A
/// transfer is its first consumer's read, and a consumer reads a tensor from
/// another rank only where no producer comes earlier on its own rank (the one
/// elsewhere being the same for every consumer there, as
/// [`crate::algebra::analysis::find`] picks it): the consumers reading it are the
/// first on their rank. So a base transfer whose first consumer is outside its
/// window keeps it (a window's reads of it come later, or not at all: were one
/// to read it in the window, so would the first in the base, before it), with
/// its indices moved; one whose first consumer is in the window has its reads
/// there (a later consumer reads it only where no producer precedes it on the
/// rank, so neither does any in the window) and is dropped for them. The reads of
/// raw inputs name their two tasks only, and are moved whole. The patched
/// transfers come out in order (the base's, with `reads` sorted and merged in,
/// the first of each transfer kept); where they are the base's transfers at the
/// same places with the same sources, the base's ends are shared, else found again
/// ([`ends_by_peer`]).
pub(crate) fn prepare_patched(
    base: &Prepared,
    ranks: usize,
    time: Timing,
    window: impl Fn(usize, usize) -> bool,
    moved: impl Fn(usize, usize) -> usize,
    reads: impl IntoIterator<Item = (TransferId, Ends)>,
) -> Result<Prepared, LowerError> {
    let mut fresh = reads
        .into_iter()
        .map(|(id, ends)| transfer(id, ends))
        .collect::<Result<Vec<Transfer>, LowerError>>()?;
    // Reads equal in this order are equal (see `sort_reads`): each transfer's
    // first read.
    fresh.sort_unstable_by_key(Transfer::order);
    fresh.dedup_by_key(|t| t.id());
    // A base transfer in the trial, if it stays there.
    let patch = |t: &Transfer| {
        if t.tensor != Tensor::Input && window(t.to as usize, t.i as usize) {
            return None;
        }
        let n = |x: usize| u32::try_from(x).expect("a trial's index fits as its base's");
        Some(Transfer {
            j: n(moved(t.from as usize, t.j as usize)),
            i: n(moved(t.to as usize, t.i as usize)),
            ..*t
        })
    };
    // The base's transfers of `run` that stay, onto `out`: whether all do.
    let keep = |out: &mut Vec<Transfer>, run: &[Transfer]| {
        let before = out.len();
        out.extend(run.iter().filter_map(patch));
        out.len() - before == run.len()
    };
    // Whether the transfers are the base's at the same places, from the same ranks.
    let mut same = true;
    let mut out: Vec<Transfer> = Vec::with_capacity(base.transfers.len() + fresh.len());
    let mut rest = &base.transfers[..];
    for f in fresh {
        // The base's transfers before `f`'s, then `f` or the base's of its
        // identity, whichever is read first.
        let (run, next) = rest.split_at(rest.partition_point(|t| t.id() < f.id()));
        same &= keep(&mut out, run);
        rest = next;
        let base_of = rest.split_first().filter(|(t, _)| t.id() == f.id());
        if let Some((t, next)) = base_of {
            rest = next;
            if let Some(t) = patch(t).filter(|t| t.i <= f.i) {
                out.push(t);
                continue;
            }
            same &= t.from == f.from;
        } else {
            same = false;
        }
        out.push(f);
    }
    same &= keep(&mut out, rest);
    let ends = if same {
        Arc::clone(&base.ends)
    } else {
        Arc::new(ends_by_peer(ranks, &out))
    };
    Ok(Prepared {
        time,
        transfers: out,
        ends,
    })
}

/// `reads` sorted by [`Transfer::order`]: `reads` being a plan's reads of
/// activations and gradients in order of destination, then consumer (rank by
/// rank, task by task), then its reads of raw inputs. Those are sorted by
/// destination and consumer, then stable counting passes give the order: by
/// tensor, unit and micro-batch in one pass where their triples are no more than
/// the reads; else by unit and micro-batch in one pass where their pairs are no
/// more than the reads (else by micro-batch, then by unit), then by tensor; linear
/// in the reads, micro-batches and units.
/// Reads equal in that order are equal in every field (one consumer reads one
/// producer's tensor), so the order is the one any sort by it gives.
fn sort_reads(reads: &mut Vec<Transfer>) {
    let regular = reads
        .iter()
        .position(|t| t.tensor == Tensor::Input)
        .unwrap_or(reads.len());
    debug_assert!(reads[regular..].iter().all(|t| t.tensor == Tensor::Input));
    reads[regular..].sort_unstable_by_key(|t| (t.to, t.i, t.tensor, t.unit, t.mb));
    let mbs = reads.iter().map(|t| t.mb as usize + 1).max().unwrap_or(0);
    let units = reads.iter().map(|t| t.unit as usize + 1).max().unwrap_or(0);
    let tensors = Tensor::Input as usize + 1;
    let (mut buffer, mut count) = (Vec::with_capacity(reads.len()), Vec::new());
    let pairs = units.checked_mul(mbs).filter(|&pairs| pairs <= reads.len());
    match pairs.map(|pairs| (pairs, pairs.checked_mul(tensors))) {
        // One pass by tensor, unit and micro-batch where their triples are no
        // more than the reads (the order of the passes below, in one).
        Some((pairs, Some(triples))) if triples <= reads.len() => {
            counting_sort(reads, &mut buffer, &mut count, triples, |t| {
                t.tensor as usize * pairs + t.unit as usize * mbs + t.mb as usize
            });
            debug_assert!(reads.windows(2).all(|w| w[0].order() <= w[1].order()));
            return;
        }
        Some((pairs, _)) => counting_sort(reads, &mut buffer, &mut count, pairs, |t| {
            t.unit as usize * mbs + t.mb as usize
        }),
        None => {
            counting_sort(reads, &mut buffer, &mut count, mbs, |t| t.mb as usize);
            counting_sort(reads, &mut buffer, &mut count, units, |t| t.unit as usize);
        }
    }
    counting_sort(reads, &mut buffer, &mut count, tensors, |t| {
        t.tensor as usize
    });
    debug_assert!(reads.windows(2).all(|w| w[0].order() <= w[1].order()));
}

impl Prepared {
    /// The same transfers, placed against another timing of the plan's tasks (for
    /// example the one a simulation of a first lowering measured). `time` must
    /// respect the plan's dependencies: every consumer starts no earlier than its
    /// producers end, and `seq` is a topological order consistent with the times.
    pub fn retimed(&self, time: Timing) -> Prepared {
        Prepared {
            time,
            transfers: self.transfers.clone(),
            ends: Arc::clone(&self.ends),
        }
    }

    /// The transfers as `(identity, ends)` and each rank's ends (for tests).
    #[cfg(test)]
    pub(crate) fn parts(&self) -> (Vec<(TransferId, Ends)>, &[Vec<u32>]) {
        let t = self.transfers.iter().map(|t| t.parts()).collect();
        (t, &self.ends)
    }
}

/// Lower a prepared plan with the given placement rule.
pub fn lower_prepared(
    plan: &Plan,
    prepared: &Prepared,
    expr: Option<&str>,
    placement: Placement,
) -> Result<Program, LowerError> {
    lower_prepared_by(plan, prepared, expr, placement, &SearchPolicy::DEFAULT)
}

/// [`lower_prepared`] under `policy` (its meeting-point knobs).
pub(crate) fn lower_prepared_by(
    plan: &Plan,
    prepared: &Prepared,
    expr: Option<&str>,
    placement: Placement,
    policy: &SearchPolicy,
) -> Result<Program, LowerError> {
    let at = placement_of(plan, prepared, placement, policy)?;
    Ok(assemble(plan, &at, expr))
}

/// [`lower_prepared`] by unit index: the same program before its units are named
/// ([`Lowered::program`] names it; [`crate::judge::simulate::simulate_lowered`]
/// runs it as it is).
pub fn lower_prepared_indexed(
    plan: &Plan,
    prepared: &Prepared,
    placement: Placement,
) -> Result<Lowered, LowerError> {
    lower_indexed_by(plan, prepared, placement, &SearchPolicy::DEFAULT)
}

/// [`lower_prepared_indexed`] under `policy` (its meeting-point knobs).
pub(crate) fn lower_indexed_by(
    plan: &Plan,
    prepared: &Prepared,
    placement: Placement,
    policy: &SearchPolicy,
) -> Result<Lowered, LowerError> {
    let at = placement_of(plan, prepared, placement, policy)?;
    assemble_lowered(plan, at)
}

/// The placement of every transfer's ends under `placement`; `policy` gives the
/// meeting-point knobs ([`SearchPolicy::meet_candidates`],
/// [`SearchPolicy::meet_idle_parts`]).
pub(crate) fn placement_of(
    plan: &Plan,
    prepared: &Prepared,
    placement: Placement,
    policy: &SearchPolicy,
) -> Result<Vec<Vec<Placed>>, LowerError> {
    placement_at(plan, prepared, &prepared.time, placement, policy)
}

/// [`placement_of`] against `time` instead of the prepared (ideal) timing, as
/// [`Prepared::retimed`] would place them, without copying the transfers.
pub(crate) fn placement_at(
    plan: &Plan,
    prepared: &Prepared,
    time: &Timing,
    placement: Placement,
    policy: &SearchPolicy,
) -> Result<Vec<Vec<Placed>>, LowerError> {
    match place(plan, time, prepared, placement, policy) {
        Ok(at) => Ok(at),
        // The meeting-point heuristic may, with zero-cost tasks, ask for an order
        // the constraints forbid; the ready-time rule is always feasible.
        Err(_) => place(plan, time, prepared, Placement::Ready, policy),
    }
}

/// [`placement_at`] with each transfer's meeting time given: `taus` are
/// [`meeting_times`] of the same rule against the same `time`.
pub(crate) fn placement_at_times(
    plan: &Plan,
    prepared: &Prepared,
    time: &Timing,
    placement: Placement,
    taus: &[(f64, f64)],
    policy: &SearchPolicy,
) -> Result<Vec<Vec<Placed>>, LowerError> {
    match place_at_times(plan, time, prepared, placement, taus) {
        Ok(at) => Ok(at),
        // As in `placement_at`.
        Err(_) => place(plan, time, prepared, Placement::Ready, policy),
    }
}

/// The program of `plan` with its transfers placed as `at` says (per rank in key
/// order, slots non-decreasing): compute in the plan's order, transfers before the
/// compute task of their slot, those sharing a slot batched.
pub(crate) fn assemble(plan: &Plan, at: &[Vec<Placed>], expr: Option<&str>) -> Program {
    let (bcasts, reduces) = collectives(plan);
    let form = Named::new(plan, &bcasts, &reduces);
    let programs = assemble_in(
        plan,
        at,
        &form,
        (&bcasts, &reduces),
        |x| x.slot as usize,
        |x| x.action(&form.names),
    );
    form.program(plan, programs, expr)
}

/// [`assemble`] by unit index, from [`placement_of`]'s placement: the same program
/// before its units are named ([`Lowered::program`] names it). An error when a
/// number of the program is over what a [`Step`] holds (2^32). Given the placement
/// itself (not a reference), each rank's ends are freed once its steps are written,
/// so the placement and the lowering are not both held in full.
pub(crate) fn assemble_lowered<L: AsRef<[Placed]>>(
    plan: &Plan,
    at: impl IntoIterator<Item = L>,
) -> Result<Lowered, LowerError> {
    let frame = Frame::of(plan);
    let programs = steps_in(plan, at, &frame)?;
    Ok(frame.lowered(plan, programs))
}

/// What [`assemble_lowered`] takes from a plan's units and from which units each
/// rank computes and reduces, not from the order of its tasks: the plan's
/// collectives and its units' places among their names. Equal for two plans of the
/// same units whose every rank holds the same tasks in any order (a move within a
/// rank), so the order search finds it once for a base and its trials of such moves.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Frame {
    /// The broadcasts, then the reductions ([`collectives`]).
    colls: Vec<Collective>,
    /// How many of `colls` are broadcasts.
    bcasts: usize,
    /// Each unit's place in the order of the units' names ([`name_ranks`]).
    rank: Vec<usize>,
}

impl Frame {
    /// `plan`'s frame.
    pub(crate) fn of(plan: &Plan) -> Frame {
        let (mut colls, reduces) = collectives(plan);
        let bcasts = colls.len();
        colls.extend(reduces);
        Frame {
            colls,
            bcasts,
            rank: name_ranks(&plan.units),
        }
    }

    /// The lowering of `plan` whose ranks' lists are `programs`, with these
    /// collectives.
    fn lowered(self, plan: &Plan, programs: Vec<Vec<Step>>) -> Lowered {
        Lowered {
            ranks: plan.ranks,
            microbatches: plan.microbatches,
            programs,
            colls: self.colls,
            prefetch: plan.prefetch.clone(),
        }
    }
}

/// [`assemble_lowered`] with `frame` the frame of `plan` ([`Frame::of`], maybe of
/// another plan of the same units and the same tasks on every rank): the same
/// lowering.
pub(crate) fn assemble_framed<L: AsRef<[Placed]>>(
    plan: &Plan,
    at: impl IntoIterator<Item = L>,
    frame: &Frame,
) -> Result<Lowered, LowerError> {
    let programs = steps_in(plan, at, frame)?;
    Ok(frame.clone().lowered(plan, programs))
}

/// Every rank's list of steps of [`assemble_lowered`]'s lowering of `plan` in its
/// frame.
fn steps_in<L: AsRef<[Placed]>>(
    plan: &Plan,
    at: impl IntoIterator<Item = L>,
    frame: &Frame,
) -> Result<Vec<Vec<Step>>, LowerError> {
    in_frame(frame, |form, colls| {
        assemble_in(plan, at, form, colls, |x| x.slot as usize, p2p_step)
    })
}

/// What `write` gives with `frame`'s broadcasts and reductions and a form that
/// writes steps by unit index ([`Indexed`]); an error where it met a number over
/// what a [`Step`] holds.
fn in_frame<T>(
    frame: &Frame,
    write: impl FnOnce(&Indexed<'_>, (&[Collective], &[Collective])) -> T,
) -> Result<T, LowerError> {
    let form = Indexed {
        rank: &frame.rank,
        over: Cell::new(None),
    };
    let out = write(&form, frame.colls.split_at(frame.bcasts));
    match form.over.take() {
        Some(action) => Err(LowerError::TooLarge { action }),
        None => Ok(out),
    }
}

/// A placed end's step (its batch set where the slot's ends are batched).
fn p2p_step(x: &Placed) -> Step {
    Step::P2p {
        dir: x.dir,
        tensor: x.tensor,
        unit: x.unit,
        mb: x.mb,
        peer: x.peer,
        batch: None,
    }
}

/// Rank `r`'s list of [`assemble_framed`]'s lowering of `plan` in `frame`, whose
/// rank `r` has the ends `at`: the other ranks' ends do not enter it. `None` where
/// `plan` prefetches (the prefetched forwards' transfers are written after every
/// rank's list, [`prefetch_transfers`]). An error as [`assemble_lowered`]'s.
pub(crate) fn rank_steps(
    plan: &Plan,
    r: usize,
    at: &[Placed],
    frame: &Frame,
) -> Option<Result<Vec<Step>, LowerError>> {
    if !plan.prefetch.is_empty() {
        return None;
    }
    Some(in_frame(frame, |form, colls| {
        let slot = |x: &Placed| x.slot as usize;
        rank_in(
            plan,
            r,
            at,
            form,
            colls,
            (&slot, &p2p_step),
            &mut Vec::new(),
        )
    }))
}

/// A lowered program with its units by index: what [`assemble`] writes, action for
/// action, before the units are named. The simulator runs it as it runs the named
/// program ([`crate::judge::simulate::simulate_lowered`]), so a search can judge a
/// lowering without naming it, and name only the one it keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct Lowered {
    pub ranks: usize,
    pub microbatches: usize,
    /// `programs[r]` is rank `r`'s list, in execution order.
    pub programs: Vec<Vec<Step>>,
    /// The collectives [`Step::Coll`] refers to.
    pub colls: Vec<Collective>,
    /// [`Program::prefetch`], as `(unit, mb)`.
    pub prefetch: Vec<(usize, usize)>,
}

/// One action of a [`Lowered`] program: an [`Action`] naming its unit by index.
/// Its numbers are 32-bit and its unit an index (20 bytes a step, its batch in 4;
/// an [`Action`] is 24, with its unit's name shared): a search holds a lowering of
/// every candidate it judges, millions of steps at the largest sizes.
/// [`assemble_lowered`] refuses a program whose numbers do not fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    Compute {
        op: Op,
        unit: u32,
        mb: u32,
    },
    P2p {
        dir: Dir,
        tensor: Tensor,
        unit: u32,
        mb: u32,
        peer: u32,
        batch: Option<Batch>,
    },
    /// The collective of this index in [`Lowered::colls`].
    Coll(u32),
}

/// A transfer's batch number in a [`Step`], below `u32::MAX`: held as one more, so
/// that `Option<Batch>` takes 4 bytes (8 as `Option<u32>`, a step 24 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch(NonZeroU32);

impl Batch {
    /// Batch `n`; `None` when it does not fit.
    pub fn new(n: u64) -> Option<Batch> {
        let one_more = u32::try_from(n.checked_add(1)?).ok()?;
        NonZeroU32::new(one_more).map(Batch)
    }

    /// The batch's number.
    pub fn get(self) -> u32 {
        self.0.get() - 1
    }
}

/// A broadcast or reduction of a unit's parameters over a group of ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    pub kind: CollKind,
    pub unit: usize,
    pub root: usize,
    pub group: Vec<usize>,
}

impl Collective {
    fn action(&self, unit: Name) -> Action {
        Action::coll(self.kind, unit, self.root, self.group.clone())
    }
}

impl Lowered {
    /// The named program: exactly what [`assemble`] gives for the same placement.
    /// `units` are the plan's units; `expr` is recorded as the source.
    pub fn program(&self, units: &[Unit], expr: Option<&str>) -> Program {
        self.named(units, expr, self.programs.iter())
    }

    /// [`Lowered::program`], consuming the lowering: each rank's steps are freed
    /// once its actions are written, so the steps and the named program are not
    /// both held in full.
    pub fn into_program(mut self, units: &[Unit], expr: Option<&str>) -> Program {
        let lists = std::mem::take(&mut self.programs);
        self.named(units, expr, lists.into_iter())
    }

    /// The program of `lists` (this lowering's, borrowed or taken) with its units
    /// named, one rank at a time.
    fn named<L: AsRef<[Step]>>(
        &self,
        units: &[Unit],
        expr: Option<&str>,
        lists: impl Iterator<Item = L>,
    ) -> Program {
        let (names, colls) = self.names(units);
        let programs = lists
            .map(|list| {
                list.as_ref()
                    .iter()
                    .map(|s| step_action(s, &names, &colls))
                    .collect()
            })
            .collect();
        named_program(
            (self.ranks, self.microbatches, units.to_vec()),
            programs,
            expr,
            &self.prefetch,
            &names,
        )
    }

    /// The units' names, and the collectives' actions named with them.
    fn names(&self, units: &[Unit]) -> (Vec<Name>, Vec<Action>) {
        let names: Vec<Name> = units.iter().map(|u| Name::from(u.name.as_str())).collect();
        let colls = self
            .colls
            .iter()
            .map(|c| c.action(names[c.unit].clone()))
            .collect();
        (names, colls)
    }

    /// Action `i` of rank `r`, its unit named after `units` (for messages, one at
    /// a time); `None` when there is no such action or no such unit.
    pub fn action(&self, units: &[Unit], r: usize, i: usize) -> Option<Action> {
        self.describe(units, self.programs.get(r)?.get(i)?)
    }

    /// `step`, one of this lowering's or of its kind, named after `units` (for
    /// messages); `None` when it names a unit or collective there is not.
    pub fn describe(&self, units: &[Unit], step: &Step) -> Option<Action> {
        let unit = match *step {
            Step::Compute { unit, .. } | Step::P2p { unit, .. } => unit as usize,
            Step::Coll(k) => self.colls.get(k as usize)?.unit,
        };
        if unit >= units.len() || self.colls.iter().any(|c| c.unit >= units.len()) {
            return None;
        }
        let (names, colls) = self.names(units);
        Some(step_action(step, &names, &colls))
    }
}

/// `step` as an action, with the units' `names` and the collectives' actions.
fn step_action(step: &Step, names: &[Name], colls: &[Action]) -> Action {
    match *step {
        Step::Compute { op, unit, mb } => {
            Action::compute(op, names[unit as usize].clone(), mb as usize)
        }
        Step::P2p {
            dir,
            tensor,
            unit,
            mb,
            peer,
            batch,
        } => Action::p2p(
            dir,
            tensor,
            names[unit as usize].clone(),
            mb as usize,
            peer as usize,
            batch.map(|b| u64::from(b.get())),
        ),
        Step::Coll(k) => colls[k as usize].clone(),
    }
}

/// How [`assemble_in`] writes actions: named ([`Action`]) or by unit index ([`Step`]).
trait Form {
    type Act;
    fn compute(&self, op: Op, unit: usize, mb: usize) -> Self::Act;
    fn p2p(&self, dir: Dir, tensor: Tensor, unit: usize, mb: usize, peer: usize) -> Self::Act;
    /// The `k`-th collective: broadcasts, then reductions, as [`collectives`] lists them.
    fn coll(&self, k: usize) -> Self::Act;
    /// (is a send, peer) of a point-to-point action; `(true, usize::MAX)` otherwise.
    fn end(&self, a: &Self::Act) -> (bool, usize);
    /// The canonical order of a batch's members: sends first, then by peer, tensor
    /// and unit name ([`member_order`]).
    fn member_cmp(&self, a: &Self::Act, b: &Self::Act) -> Ordering;
    fn set_batch(&self, a: &mut Self::Act, batch: u64);
}

/// Actions with their units' names.
struct Named {
    names: Vec<Name>,
    /// Broadcasts, then reductions.
    colls: Vec<Action>,
}

impl Named {
    fn new(plan: &Plan, bcasts: &[Collective], reduces: &[Collective]) -> Named {
        let names = unit_names(plan);
        let colls = bcasts
            .iter()
            .chain(reduces)
            .map(|c| c.action(names[c.unit].clone()))
            .collect();
        Named { names, colls }
    }

    fn program(&self, plan: &Plan, programs: Vec<Vec<Action>>, expr: Option<&str>) -> Program {
        named_program(
            (plan.ranks, plan.microbatches, plan.units.clone()),
            programs,
            expr,
            &plan.prefetch,
            &self.names,
        )
    }
}

/// The program of `(ranks, microbatches, units)` with these action lists, `expr`
/// recorded as its source and the `(unit, micro-batch)` forwards of `prefetch` named
/// after `names`.
fn named_program(
    (ranks, microbatches, units): (usize, usize, Vec<Unit>),
    programs: Vec<Vec<Action>>,
    expr: Option<&str>,
    prefetch: &[(usize, usize)],
    names: &[Name],
) -> Program {
    Program {
        format: FORMAT.to_string(),
        ranks,
        microbatches,
        units,
        programs,
        source: expr.map(|e| Source {
            expr: e.to_string(),
        }),
        prefetch: prefetch
            .iter()
            .map(|&(u, mb)| Prefetch {
                unit: names[u].clone(),
                mb,
            })
            .collect(),
    }
}

impl Form for Named {
    type Act = Action;
    fn compute(&self, op: Op, unit: usize, mb: usize) -> Action {
        Action::compute(op, self.names[unit].clone(), mb)
    }
    fn p2p(&self, dir: Dir, tensor: Tensor, unit: usize, mb: usize, peer: usize) -> Action {
        Action::p2p(dir, tensor, self.names[unit].clone(), mb, peer, None)
    }
    fn coll(&self, k: usize) -> Action {
        self.colls[k].clone()
    }
    fn end(&self, a: &Action) -> (bool, usize) {
        match a {
            Action::SEND { peer, .. } => (true, *peer as usize),
            Action::RECV { peer, .. } => (false, *peer as usize),
            _ => (true, usize::MAX),
        }
    }
    fn member_cmp(&self, a: &Action, b: &Action) -> Ordering {
        member_order(a).cmp(&member_order(b))
    }
    fn set_batch(&self, a: &mut Action, batch: u64) {
        a.set_batch(Some(batch));
    }
}

/// Actions by unit index.
struct Indexed<'a> {
    /// Each unit's place in the order of the units' names ([`name_ranks`]).
    rank: &'a [usize],
    /// The first action whose numbers did not fit a [`Step`], in words.
    over: Cell<Option<String>>,
}

impl Indexed<'_> {
    /// `x` as a step's number, or 0 with `what` recorded as the first number over.
    fn narrow(&self, x: usize, what: impl FnOnce() -> String) -> u32 {
        u32::try_from(x).unwrap_or_else(|_| {
            let first = self.over.take().unwrap_or_else(what);
            self.over.set(Some(first));
            0
        })
    }
}

impl Form for Indexed<'_> {
    type Act = Step;
    fn compute(&self, op: Op, unit: usize, mb: usize) -> Step {
        let what = || format!("{op:?}(unit #{unit}, mb {mb})");
        Step::Compute {
            op,
            unit: self.narrow(unit, what),
            mb: self.narrow(mb, what),
        }
    }
    fn p2p(&self, dir: Dir, tensor: Tensor, unit: usize, mb: usize, peer: usize) -> Step {
        let what = || format!("{dir:?}(unit #{unit}, mb {mb}, peer {peer})");
        Step::P2p {
            dir,
            tensor,
            unit: self.narrow(unit, what),
            mb: self.narrow(mb, what),
            peer: self.narrow(peer, what),
            batch: None,
        }
    }
    fn coll(&self, k: usize) -> Step {
        Step::Coll(self.narrow(k, || format!("collective #{k}")))
    }
    fn end(&self, a: &Step) -> (bool, usize) {
        match *a {
            Step::P2p { dir, peer, .. } => (dir == Dir::Send, peer as usize),
            _ => (true, usize::MAX),
        }
    }
    fn member_cmp(&self, a: &Step, b: &Step) -> Ordering {
        // Two transfers: by direction and peer first (the unit's place looked up
        // only on a tie), as the key below orders them.
        if let (
            Step::P2p {
                dir: da,
                peer: pa,
                tensor: ta,
                unit: ua,
                ..
            },
            Step::P2p {
                dir: db,
                peer: pb,
                tensor: tb,
                unit: ub,
                ..
            },
        ) = (*a, *b)
        {
            return (da, pa)
                .cmp(&(db, pb))
                .then_with(|| (ta, self.rank[ua as usize]).cmp(&(tb, self.rank[ub as usize])));
        }
        // As `member_order`, with the unit's place among the names for its name
        // (the empty name, first of all, for an action that is not a transfer).
        let key = |s: &Step| match *s {
            Step::P2p {
                dir,
                tensor,
                unit,
                peer,
                ..
            } => (dir, peer as usize, tensor, Some(self.rank[unit as usize])),
            _ => (Dir::Recv, usize::MAX, Tensor::Input, None),
        };
        key(a).cmp(&key(b))
    }
    fn set_batch(&self, a: &mut Step, batch: u64) {
        if let Step::P2p { batch: b, .. } = a {
            let n = Batch::new(batch).unwrap_or_else(|| {
                let first = self.over.take().unwrap_or_else(|| format!("batch {batch}"));
                self.over.set(Some(first));
                Batch(NonZeroU32::MIN)
            });
            *b = Some(n);
        }
    }
}

/// Each unit's place in the sorted list of the distinct unit names: comparing two
/// units' places compares their names.
fn name_ranks(units: &[Unit]) -> Vec<usize> {
    let mut by: Vec<usize> = (0..units.len()).collect();
    by.sort_by(|&a, &b| units[a].name.cmp(&units[b].name));
    let mut rank = vec![0; units.len()];
    let mut k = 0;
    for (i, &u) in by.iter().enumerate() {
        if i > 0 && units[u].name != units[by[i - 1]].name {
            k += 1;
        }
        rank[u] = k;
    }
    rank
}

/// Every rank's list of `plan` with its transfers placed as `at` says, written in
/// `form`: the broadcasts the rank is a member of, then compute in the plan's order
/// with the transfers of each slot batched before the task of that slot, then its
/// reductions; then the transfers of prefetched forwards.
fn assemble_in<F: Form, P, L: AsRef<[P]>>(
    plan: &Plan,
    at: impl IntoIterator<Item = L>,
    form: &F,
    (bcasts, reduces): (&[Collective], &[Collective]),
    slot: impl Fn(&P) -> usize,
    act: impl Fn(&P) -> F::Act,
) -> Vec<Vec<F::Act>> {
    let mut programs = Vec::with_capacity(plan.ranks);
    // Scratch kept across slots and ranks: the ends of the batch being formed.
    let mut seen = Vec::new();
    // A rank's ends, if owned, go at the end of its turn.
    for (r, ends) in at.into_iter().enumerate() {
        let list = rank_in(
            plan,
            r,
            ends.as_ref(),
            form,
            (bcasts, reduces),
            (&slot, &act),
            &mut seen,
        );
        programs.push(list);
    }
    prefetch_transfers(plan, form, &mut programs);
    programs
}

/// Rank `r`'s list of [`assemble_in`] with its ends `at`, but for the transfers of
/// prefetched forwards (appended to every rank's list after all of them are
/// written); `seen` is scratch.
fn rank_in<F: Form, P>(
    plan: &Plan,
    r: usize,
    at: &[P],
    form: &F,
    (bcasts, reduces): (&[Collective], &[Collective]),
    (slot, act): (&impl Fn(&P) -> usize, &impl Fn(&P) -> F::Act),
    seen: &mut Vec<(bool, usize)>,
) -> Vec<F::Act> {
    let n = plan.order[r].len();
    let mut list = Vec::with_capacity(bcasts.len() + n + at.len() + reduces.len());
    for (k, c) in bcasts.iter().enumerate() {
        if c.group.contains(&r) {
            list.push(form.coll(k));
        }
    }
    let mut batch = 0u64;
    // The ends not written yet (slots non-decreasing).
    let mut rest = at;
    for (k, t) in plan.order[r].iter().map(Some).chain([None]).enumerate() {
        let here = rest.iter().take_while(|x| slot(x) == k).count();
        if here > 0 {
            // The slot's transfers, written in place, then batched there (one
            // alone is no batch).
            let from = list.len();
            list.extend(rest[..here].iter().map(act));
            rest = &rest[here..];
            if here > 1 {
                batch_members(form, &mut list[from..], &mut batch, seen);
            }
        }
        if let Some(t) = t {
            list.push(form.compute(t.op, t.unit, t.mb));
        }
    }
    for (k, c) in reduces.iter().enumerate() {
        if c.group.contains(&r) {
            list.push(form.coll(bcasts.len() + k));
        }
    }
    list
}

/// The transfers of prefetched forwards (see [`Plan::prefetch`]): the activation of
/// each goes from the rank that computes it to every rank that reads it in the next
/// step (not to readers prefetched too, which read it in this one). They come after everything else, one at a time, in one global order (the
/// plan's prefetch order, then the reader's rank): every rank finishes the rest of
/// the step (which terminates without them), and then the first unfinished transfer
/// in that order has both its ends next in their lists, so each one completes.
fn prefetch_transfers<F: Form>(plan: &Plan, form: &F, programs: &mut [Vec<F::Act>]) {
    if plan.prefetch.is_empty() {
        return;
    }
    let index = plan.locate();
    let names = plan.unit_names();
    for &(u, mb) in &plan.prefetch {
        let Some((q, _)) = index.get(Op::F, u, mb) else {
            continue;
        };
        // Readers prefetched too (the next layer of a cut encoder) read this step's
        // copy: the rest of the lowering moves it, as any dependency.
        let mut readers: Vec<usize> = names
            .successors(u)
            .iter()
            .copied()
            .filter(|&s| plan.prefetch.binary_search(&(s, mb)).is_err())
            .filter_map(|s| index.get(Op::F, s, mb).or_else(|| index.get(Op::RF, s, mb)))
            .map(|(r, _)| r)
            .filter(|&r| r != q)
            .collect();
        readers.sort_unstable();
        readers.dedup();
        for r in readers {
            programs[q].push(form.p2p(Dir::Send, Tensor::Act, u, mb, r));
            programs[r].push(form.p2p(Dir::Recv, Tensor::Act, u, mb, q));
        }
    }
}

/// How a transfer's key time (and so its place on both ranks) is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The producer's ideal completion time: always feasible (see the module doc).
    /// Under eager semantics the program then runs exactly as the plan's ideal
    /// timing; under rendezvous a sender may wait for a busy receiver.
    Ready,
    /// The point between the tensor's ready time and its consumer's ideal start at
    /// which both ranks lose the least time meeting (under rendezvous the first to
    /// arrive waits for the other).
    Meet,
    /// Like `Meet`, but a rank's lost time weighs by how critical the rank is: by
    /// `1 / (slack + makespan / 100)`, its slack being the makespan less its busy
    /// time. A rank with work to spare waits for a busy one, not the other way round.
    Critical,
    /// The consumer's ideal start: each receive right before the task that reads it,
    /// the sender waiting if it is early. Where the producer has time to spare, no
    /// receive can hold its consumer's rank up for a later tensor.
    Late,
    /// Like `Meet`, then a transfer whose meeting would cost time joins a meeting the
    /// same two ranks hold anyway for a transfer with less room to move (one whose
    /// window from ready time to need is narrower), if that meeting falls within its
    /// own window: they are posted as one batch, so the transfer costs no wait of
    /// its own. An encoder's transfers, with much room, ride along with the LLM's.
    Join,
}

/// [`Placement::Join`]'s second pass over `taus` (each transfer's meeting time and
/// its cost there): narrowest windows first, each transfer that costs time moves to
/// the meeting time, within its window, of an already settled transfer between the
/// same two ranks (the nearest to its own), if there is one. Returns whether a
/// meeting time moved.
///
/// Every time settled is a first-pass time of a transfer of the same pair of ranks
/// (its own, or one settled before it), so each pair's times are sorted once into
/// positions (the transfers counted into their pairs, then each pair's sorted by
/// time: a merge of the few long runs the transfers' order leaves, as a pair's
/// times mostly rise with the micro-batch), and the settled ones are marked
/// there ([`Settled`]): the last settled time below a transfer's own and the first
/// at or above it are the marks nearest its own position.
fn join(time: &Timing, transfers: &[Transfer], taus: &mut [(f64, f64)]) -> bool {
    let window = |id: usize| {
        let ((_, _, _, to), (from, j, i)) = transfers[id].parts();
        (
            time.end[from][j],
            time.start[to][i],
            from.min(to),
            from.max(to),
        )
    };
    let n = transfers.len();
    // Each transfer's pair of ranks, numbered in order of first appearance; a pair's
    // found in a table of ranks x ranks cells where that is no larger than the
    // transfers, else by a map.
    let ranks = time.end.len();
    let mut table: Vec<u32> = if ranks
        .checked_mul(ranks)
        .is_some_and(|c| c <= n && c < u32::MAX as usize)
    {
        vec![u32::MAX; ranks * ranks]
    } else {
        Vec::new()
    };
    let mut map: std::collections::BTreeMap<(usize, usize), u32> = Default::default();
    let mut pairs = 0u32;
    let pair: Vec<u32> = (0..n)
        .map(|id| {
            let (.., lo, hi) = window(id);
            let cell = if table.is_empty() {
                map.entry((lo, hi)).or_insert(u32::MAX)
            } else {
                &mut table[lo * ranks + hi]
            };
            if *cell == u32::MAX {
                *cell = pairs;
                pairs += 1;
            }
            *cell
        })
        .collect();
    drop((table, map));
    // The transfers by pair, then by first-pass time (as `Settled::key` orders it),
    // then by index (both sorts stable; a pair's runs merged).
    let mut items: Vec<(u64, usize)> = (0..n).map(|id| (Settled::key(taus[id].0), id)).collect();
    let mut buffer = Vec::with_capacity(n);
    counting_sort(
        &mut items,
        &mut buffer,
        &mut Vec::new(),
        pairs as usize,
        |(_, id)| pair[id] as usize,
    );
    let mut bounds = Vec::new();
    for run in items.chunk_by_mut(|a, b| pair[a.1] == pair[b.1]) {
        sort_runs(run, &mut buffer, &mut bounds, |x| x.0);
    }
    drop((buffer, bounds));
    // Each pair's distinct times, in order, pair after pair: `pos[id]` is where the
    // transfer's own time is, `bounds[k]..bounds[k + 1]` pair `k`'s positions.
    let mut settled = Settled::default();
    let mut pos = vec![0usize; n];
    let mut bounds = vec![0usize; pairs as usize + 1];
    let mut last: Option<(u32, u64)> = None;
    for &(key, id) in &items {
        let k = pair[id];
        if last != Some((k, key)) {
            if last.is_none_or(|(q, _)| q != k) {
                bounds[k as usize] = settled.len();
            }
            settled.push(taus[id].0 + 0.0);
            last = Some((k, key));
        }
        pos[id] = settled.len() - 1;
    }
    bounds[pairs as usize] = settled.len();
    // The runs come in the pairs' order: pair `k`'s positions end where pair
    // `k + 1`'s begin.
    debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]));
    // Narrowest first, ties by index (a stable sort of the transfers in index order,
    // which finds the runs of windows alike that steady micro-batches give).
    for (id, x) in items.iter_mut().enumerate() {
        let (ready, need, ..) = window(id);
        *x = (time_key(need - ready), id);
    }
    items.sort_by_key(|x| x.0);
    // Whether a meeting moved.
    let mut moved = false;
    for &(_, id) in &items {
        let (ready, need, ..) = window(id);
        let own_at = pos[id];
        let k = pair[id] as usize;
        let range = bounds[k]..bounds[k + 1];
        let (own, cost) = taus[id];
        let mut at = own_at;
        if cost > 0.0 {
            let near = [
                settled.below(range.start, own_at),
                settled.from(own_at, range.end),
            ]
            .into_iter()
            .flatten()
            .filter(|&(_, t)| t >= ready && t <= need)
            .min_by(|a, b| (a.1 - own).abs().total_cmp(&(b.1 - own).abs()));
            if let Some((k, t)) = near {
                moved |= t != own;
                taus[id] = (t, 0.0);
                at = k;
            }
        }
        settled.insert(at, taus[id].0);
    }
    moved
}

/// The bits of a word of [`Settled`]'s marks.
const W: usize = u64::BITS as usize;

/// The meeting times of every pair of ranks, as [`join`] settles them: each pair's
/// possible times (its transfers' first-pass times, distinct as [`Settled::key`]
/// tells them apart) in order at positions of their own, and which are settled,
/// in a bit a position and a bit a word of them (so the nearest settled one is
/// found a word, or 64 words, at a time). Of each position settled, the time
/// settled there first and the one settled last: they differ only in the sign of
/// a zero, and [`Settled::below`] answers with the first, [`Settled::from`] with
/// the last, as a sorted list of every time settled would (each inserted before
/// its equals): bit for bit.
#[derive(Default)]
struct Settled {
    /// Each position's time (a zero as `+0.0`).
    times: Vec<f64>,
    /// Per position: whether its first time settled is `-0.0`, and its last.
    negative: Vec<(bool, bool)>,
    /// Settled positions, a bit each.
    bits: Vec<u64>,
    /// Words of `bits` with a bit set, a bit each.
    words: Vec<u64>,
}

impl Settled {
    /// Times ordered as `f64`'s `<` orders them (both zeros one key; a timing's
    /// times are never NaN).
    fn key(t: f64) -> u64 {
        debug_assert!(!t.is_nan());
        time_key(t + 0.0)
    }

    fn len(&self) -> usize {
        self.times.len()
    }

    /// A new position (after every other) of time `t`, not settled.
    fn push(&mut self, t: f64) {
        let k = self.times.len();
        self.times.push(t);
        self.negative.push((false, false));
        if k.is_multiple_of(W) {
            self.bits.push(0);
            if k.is_multiple_of(W * W) {
                self.words.push(0);
            }
        }
    }

    /// The time settled at position `k`, first or last.
    fn time(&self, k: usize, last: bool) -> f64 {
        let (first_negative, last_negative) = self.negative[k];
        let negative = if last { last_negative } else { first_negative };
        if negative {
            -0.0
        } else {
            self.times[k]
        }
    }

    /// The last settled position in `lo..hi`, with the time first settled there.
    fn below(&self, lo: usize, hi: usize) -> Option<(usize, f64)> {
        let k = self.last_set(lo, hi)?;
        Some((k, self.time(k, false)))
    }

    /// The first settled position in `lo..hi`, with the time last settled there.
    fn from(&self, lo: usize, hi: usize) -> Option<(usize, f64)> {
        let k = self.first_set(lo, hi)?;
        Some((k, self.time(k, true)))
    }

    /// Settle `t` at position `k` (its time, but for a zero's sign).
    fn insert(&mut self, k: usize, t: f64) {
        debug_assert_eq!(Settled::key(t), Settled::key(self.times[k]));
        let negative = t.to_bits() == (-0.0f64).to_bits();
        let word = &mut self.bits[k / W];
        if *word & (1 << (k % W)) == 0 {
            *word |= 1 << (k % W);
            self.words[k / (W * W)] |= 1 << (k / W % W);
            self.negative[k] = (negative, negative);
        } else {
            self.negative[k].1 = negative;
        }
    }

    /// The first set bit in `lo..hi` of `bits`.
    fn first_set(&self, lo: usize, hi: usize) -> Option<usize> {
        if lo >= hi {
            return None;
        }
        // Within `lo`'s word.
        let (w, b) = (lo / W, lo % W);
        let here = self.bits[w] & (u64::MAX << b);
        let found = if here != 0 {
            Some(w * W + here.trailing_zeros() as usize)
        } else {
            // The next word with a bit set, by the summary.
            let next = w + 1;
            let (s, sb) = (next / W, next % W);
            let mut found = None;
            for (i, &summary) in self.words.iter().enumerate().skip(s) {
                let m = if i == s {
                    summary & u64::MAX.checked_shl(sb as u32).unwrap_or(0)
                } else {
                    summary
                };
                if m != 0 {
                    let word = i * W + m.trailing_zeros() as usize;
                    found = Some(word * W + self.bits[word].trailing_zeros() as usize);
                    break;
                }
                if (i + 1) * (W * W) >= hi {
                    break;
                }
            }
            found
        };
        found.filter(|&k| k < hi)
    }

    /// The last set bit in `lo..hi` of `bits`.
    fn last_set(&self, lo: usize, hi: usize) -> Option<usize> {
        if lo >= hi {
            return None;
        }
        let top = hi - 1;
        let (w, b) = (top / W, top % W);
        let here = self.bits[w] & (u64::MAX >> ((W - 1) - b));
        let found = if here != 0 {
            Some(w * W + (W - 1) - here.leading_zeros() as usize)
        } else if w == 0 {
            None
        } else {
            let prev = w - 1;
            let (s, sb) = (prev / W, prev % W);
            let mut found = None;
            for i in (0..=s).rev() {
                let summary = self.words[i];
                let m = if i == s {
                    summary & (u64::MAX >> ((W - 1) - sb))
                } else {
                    summary
                };
                if m != 0 {
                    let word = i * W + (W - 1) - m.leading_zeros() as usize;
                    found = Some(word * W + (W - 1) - self.bits[word].leading_zeros() as usize);
                    break;
                }
                if i * (W * W) <= lo {
                    break;
                }
            }
            found
        };
        found.filter(|&k| k >= lo)
    }
}

/// Place every transfer's two ends: `result[rank]` lists them in key order, slots
/// non-decreasing.
fn place(
    plan: &Plan,
    time: &Timing,
    prepared: &Prepared,
    strategy: Placement,
    policy: &SearchPolicy,
) -> Result<Vec<Vec<Placed>>, LowerError> {
    let (taus, _) = meeting_times(time, prepared, strategy, policy);
    place_at_times(plan, time, prepared, strategy, &taus)
}

/// Each transfer's meeting time under `strategy` against `time`, with what meeting
/// there costs (Meet, Critical, Join; 0 otherwise), as [`Placement`] describes;
/// and whether every time is the one [`Placement::Meet`] gives (then the placement
/// is `Meet`'s: the three place a transfer's ends by its time alone). Told for
/// `Meet` itself, for `Critical` (its rule's choice and `Meet`'s are weighed at the
/// same candidate points) and `Join` (where its second pass moves no meeting);
/// `false` for the others.
pub(crate) fn meeting_times(
    time: &Timing,
    prepared: &Prepared,
    strategy: Placement,
    policy: &SearchPolicy,
) -> (Vec<(f64, f64)>, bool) {
    meeting_pass(time, prepared, strategy, strategy, policy)
}

/// [`Placement::Meet`]'s meeting times against `time` ([`meeting_times`]), with
/// whether `Critical`'s are `Meet`'s there (what [`meeting_times`] tells for it),
/// found in this one pass: `Critical` weighs its choice and `Meet`'s at the same
/// candidate points, so one pass under `Critical`'s weights gives both. A search
/// trying both rules places `Critical` only where it differs, without another pass
/// for it. (`Join`'s answer needs its second pass, which costs about as much as a
/// meeting pass where it runs: not run here, for a search that may stop first.)
pub(crate) fn meet_times_and_critical(
    time: &Timing,
    prepared: &Prepared,
    policy: &SearchPolicy,
) -> (Vec<(f64, f64)>, bool) {
    meeting_pass(time, prepared, Placement::Critical, Placement::Meet, policy)
}

/// [`meeting_times`] weighing lost time as `strategy` does and answering with
/// `answer`'s choice: `strategy`'s own, or (`strategy` `Critical`, `answer`
/// `Meet`) `Meet`'s choice at the same candidate points, which is exactly what
/// `Meet`'s own pass chooses (its weights are 1). The flag: whether every choice
/// of `strategy` is `Meet`'s, as [`meeting_times`] tells it.
fn meeting_pass(
    time: &Timing,
    prepared: &Prepared,
    strategy: Placement,
    answer: Placement,
    policy: &SearchPolicy,
) -> (Vec<(f64, f64)>, bool) {
    let (mut taus, mut as_meet, _) = first_pass(time, prepared, strategy, answer, policy, None);
    if strategy == Placement::Join {
        as_meet &= !join(time, &prepared.transfers, &mut taus);
    }
    (taus, as_meet)
}

/// The weight of each rank's lost time under `strategy` against `time`: by how
/// critical the rank is (`Critical`), else 1.
fn rank_weights(time: &Timing, strategy: Placement, idle_parts: f64) -> Vec<f64> {
    let p = time.start.len();
    match strategy {
        Placement::Critical => {
            let span = time.makespan();
            (0..p)
                .map(|r| {
                    let busy: f64 = time.start[r]
                        .iter()
                        .zip(&time.end[r])
                        .map(|(s, e)| e - s)
                        .sum();
                    1.0 / ((span - busy).max(0.0) + span / idle_parts + f64::MIN_POSITIVE)
                })
                .collect()
        }
        _ => vec![1.0; p],
    }
}

/// [`meeting_pass`] before `Join`'s second pass: each transfer's meeting time and its
/// cost there, found against `time` on its own (see [`Meetings`] for what one
/// reads). With `kept`, the first pass of another timing of a plan with as many tasks
/// per rank under the same rule, a transfer with the same ends there whose reads of
/// the timing are all equal in both takes `kept`'s answer instead of weighing its
/// candidates again (the same answer: it is a function of those reads). The flag
/// is [`meeting_pass`]'s, told only without `kept` (`false` with it); then how many
/// transfers took `kept`'s answer.
fn first_pass(
    time: &Timing,
    prepared: &Prepared,
    strategy: Placement,
    answer: Placement,
    policy: &SearchPolicy,
    kept: Option<&Meetings>,
) -> (Vec<(f64, f64)>, bool, usize) {
    let plain_answer = answer == Placement::Meet && strategy == Placement::Critical;
    // Whether ranks' lost times weigh other than 1 (`Critical`): else a meeting's
    // cost under the rule is its cost under `Meet`, bit for bit (a product by 1 is
    // exact), and one choice serves both.
    let weighed = strategy == Placement::Critical;
    let transfers = &prepared.transfers;
    // At most this many candidate meeting points per rank and transfer.
    let (candidates, idle_parts) = (policy.meet_candidates, policy.meet_idle_parts);

    // Slot of rank r at time t: after every task that ends by t.
    // Slot of rank r at time t, searched outward from slot `near` (where the
    // answer usually is, or close by).
    let slot_near = |r: usize, t: f64, near: usize| partition_near(&time.end[r], t, near);
    // The gap before slot `k` of a rank whose tasks start at `start` and end at
    // `end`: (when it opens, when it closes).
    let gap = |start: &[f64], end: &[f64], k: usize| {
        let e = if k == 0 { 0.0 } else { end[k - 1] };
        let g = start.get(k).copied().unwrap_or(f64::INFINITY);
        (e, g)
    };
    // How much each rank's lost time costs (Critical), else 1.
    let weight = rank_weights(time, strategy, idle_parts);
    // Per rank, how many of the first tasks `kept` has the same times for, when its
    // answers can be taken at all.
    let same = kept.and_then(|k| k.agreement(time, strategy, &weight, policy));
    // Each transfer's meeting time, and what meeting then costs (Meet, Critical, Join).
    let mut taus: Vec<(f64, f64)> = Vec::with_capacity(transfers.len());
    let mut as_meet = matches!(
        strategy,
        Placement::Meet | Placement::Critical | Placement::Join
    ) && kept.is_none();
    let mut taken = 0;
    for (id, t) in transfers.iter().enumerate() {
        let ((_, _, _, to), (from, j, i)) = t.parts();
        if let (Some(same), Some(k)) = (&same, kept) {
            // Read on the source up to slot `j + 1 + candidates` (the last gap of
            // its window), on the destination up to the consumer `i`.
            let n = time.end[from].len();
            let source = (j + 1 + candidates).min(n - 1) < same[from];
            if source && i < same[to] && k.transfers.get(id) == Some(t) {
                taus.push(k.taus[id]);
                taken += 1;
                continue;
            }
        }
        let ready = time.end[from][j];
        let need = time.start[to][i];
        taus.push(match strategy {
            Placement::Ready => (ready, 0.0),
            Placement::Late => (need.max(ready), 0.0),
            Placement::Meet | Placement::Critical | Placement::Join => {
                // Candidate slots on each side: those whose gap opens within
                // [ready, need], at most `candidates` of them.
                let window = |r: usize, first: usize| {
                    let ends = &time.end[r];
                    let mut last = first;
                    while last < ends.len() && last - first < candidates && ends[last] <= need {
                        last += 1;
                    }
                    (first, last) // slots first..=last
                };
                let (s0, s1) = window(from, j + 1);
                let r_first = slot_near(to, ready, i).min(i);
                let (r0, r1) = window(to, r_first);
                let r1 = r1.min(i);
                // The candidate points on each side (ends, non-decreasing): the
                // slot at time `t` is the window's first plus how many end by `t`.
                let (end_s, end_r) = (&time.end[from][..], &time.end[to][..]);
                let (start_s, start_r) = (&time.start[from][..], &time.start[to][..]);
                let (ends_s, ends_r) = (&end_s[s0..s1], &end_r[r0..r1]);
                let (wf, wt) = (weight[from], weight[to]);
                // What meeting costs at the gaps `s` (on the source) and `r`, under
                // this rule's weights and (for `Critical`) under `Meet`'s.
                let cost = |(es, gs): (f64, f64), (er, gr): (f64, f64)| {
                    let meet = es.max(er);
                    let (lost_s, lost_r) = ((meet - gs).max(0.0), (meet - gr).max(0.0));
                    (wf * lost_s + wt * lost_r, lost_s + lost_r)
                };
                // Each side's count of ends by the time considered, and the gap
                // before the slot it gives (the window's first plus the count),
                // found again only when the count moves.
                let by = |ends: &[f64], t: f64| ends.iter().take_while(|&&e| e <= t).count();
                let (mut ks, mut kr) = (by(ends_s, ready), by(ends_r, ready));
                let (mut gap_s, mut gap_r) =
                    (gap(start_s, end_s, s0 + ks), gap(start_r, end_r, r0 + kr));
                let first = cost(gap_s, gap_r);
                let (mut best, mut plain) = ((first.0, ready), (first.1, ready));
                // The candidates in time order (the choice is the least cost, then
                // the earliest time: the same in any order). Candidates before
                // `ready` (none where the rank's end times rise) are skipped, so
                // counting from `ready`'s counts counts as from nothing.
                let (mut a, mut b) = (0, 0);
                while a < ends_s.len() || b < ends_r.len() {
                    let t = match (ends_s.get(a), ends_r.get(b)) {
                        (Some(&x), Some(&y)) if y < x => {
                            b += 1;
                            y
                        }
                        (Some(&x), _) => {
                            a += 1;
                            x
                        }
                        (None, Some(&y)) => {
                            b += 1;
                            y
                        }
                        (None, None) => break,
                    };
                    if t < ready || t > need {
                        continue;
                    }
                    if ks < ends_s.len() && ends_s[ks] <= t {
                        while ks < ends_s.len() && ends_s[ks] <= t {
                            ks += 1;
                        }
                        gap_s = gap(start_s, end_s, s0 + ks);
                    }
                    if kr < ends_r.len() && ends_r[kr] <= t {
                        while kr < ends_r.len() && ends_r[kr] <= t {
                            kr += 1;
                        }
                        gap_r = gap(start_r, end_r, r0 + kr);
                    }
                    let (c, u) = cost(gap_s, gap_r);
                    if c < best.0 || (c == best.0 && t < best.1) {
                        best = (c, t);
                    }
                    if weighed && (u < plain.0 || (u == plain.0 && t < plain.1)) {
                        plain = (u, t);
                    }
                }
                // (Under `Meet` and `Join` the weights are 1: the same choice, and
                // `plain` is not followed.)
                if !weighed {
                    plain = best;
                }
                as_meet &= best.1 == plain.1;
                if plain_answer {
                    (plain.1, plain.0)
                } else {
                    (best.1, best.0)
                }
            }
        });
    }
    (taus, as_meet, taken)
}

/// The first pass of one plan's meeting times under one rule ([`first_pass`]),
/// kept with the timing and transfers it was found against, for lowerings of plans
/// that differ from that one in the order of some tasks: each of their transfers
/// whose meeting time reads only what is the same in both takes the kept one.
///
/// What a transfer's first-pass meeting time reads: its ends (source rank and
/// producer `j`, destination rank and first consumer `i`); on the source, the
/// times of tasks up to `j + 1 + meet_candidates` (its window of candidate slots
/// after the producer and the gaps there); on the destination, the times of tasks
/// up to `i` (the slot where the tensor is ready, found by a partition of the
/// rank's end times whose result, capped at `i`, the ends before `i` decide; the
/// candidate slots up to `i` and their gaps; the consumer's start); the ranks'
/// weights (`Critical`: their busy time and the makespan) and the policy's two
/// meeting knobs. Equal reads give the same answer, bit for bit.
pub(crate) struct Meetings {
    strategy: Placement,
    /// [`SearchPolicy::meet_candidates`] and [`SearchPolicy::meet_idle_parts`] it was
    /// found under.
    knobs: (usize, f64),
    time: Timing,
    transfers: Vec<Transfer>,
    weight: Vec<f64>,
    taus: Vec<(f64, f64)>,
}

impl Meetings {
    /// The first pass of `prepared` under `strategy`; `None` for a rule that does not
    /// search meeting points (`Ready`, `Late`: nothing to keep).
    pub(crate) fn new(
        prepared: &Prepared,
        strategy: Placement,
        policy: &SearchPolicy,
    ) -> Option<Meetings> {
        if !matches!(
            strategy,
            Placement::Meet | Placement::Critical | Placement::Join
        ) {
            return None;
        }
        let time = &prepared.time;
        let (taus, ..) = first_pass(time, prepared, strategy, strategy, policy, None);
        Some(Meetings {
            strategy,
            knobs: (policy.meet_candidates, policy.meet_idle_parts),
            time: time.clone(),
            transfers: prepared.transfers.clone(),
            weight: rank_weights(time, strategy, policy.meet_idle_parts),
            taus,
        })
    }

    /// The share of `prepared`'s transfers whose first-pass meeting time is taken
    /// from these under their rule (for tests).
    #[cfg(test)]
    pub(crate) fn kept_share(&self, prepared: &Prepared, policy: &SearchPolicy) -> f64 {
        let s = self.strategy;
        let (taus, _, taken) = first_pass(&prepared.time, prepared, s, s, policy, Some(self));
        taken as f64 / taus.len().max(1) as f64
    }

    /// Per rank, how many of its first tasks have the same start and end (bit for
    /// bit) in `time` as in the kept timing; `None` when no kept answer can be taken
    /// (another rule, other knobs or weights, other ranks or task counts).
    fn agreement(
        &self,
        time: &Timing,
        strategy: Placement,
        weight: &[f64],
        policy: &SearchPolicy,
    ) -> Option<Vec<usize>> {
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let knobs = (policy.meet_candidates, policy.meet_idle_parts);
        let alike = strategy == self.strategy
            && knobs.0 == self.knobs.0
            && knobs.1.to_bits() == self.knobs.1.to_bits()
            && bits(weight) == bits(&self.weight)
            && time.start.len() == self.time.start.len()
            && (0..time.start.len()).all(|r| time.start[r].len() == self.time.start[r].len());
        alike.then(|| {
            (0..time.start.len())
                .map(|r| {
                    let (s, e) = (&time.start[r], &time.end[r]);
                    let (ks, ke) = (&self.time.start[r], &self.time.end[r]);
                    (0..s.len())
                        .find(|&k| {
                            s[k].to_bits() != ks[k].to_bits() || e[k].to_bits() != ke[k].to_bits()
                        })
                        .unwrap_or(s.len())
                })
                .collect()
        })
    }
}

/// [`lower_indexed_by`] with the first pass of the meeting times taken from `kept`
/// where it holds ([`Meetings`]): the same lowering.
///
/// Without `kept` (or with another rule's), the meeting times are found anew; with
/// `frame`, the frame of a plan of the same units and the same tasks on every rank
/// as `plan` ([`Frame`]), the lowering is assembled in it.
pub(crate) fn lower_indexed_from(
    plan: &Plan,
    prepared: &Prepared,
    placement: Placement,
    policy: &SearchPolicy,
    (kept, frame): (Option<&Meetings>, Option<&Frame>),
) -> Result<Lowered, LowerError> {
    let at = match kept.filter(|k| k.strategy == placement) {
        Some(kept) => {
            let time = &prepared.time;
            let (mut taus, ..) =
                first_pass(time, prepared, placement, placement, policy, Some(kept));
            if placement == Placement::Join {
                join(time, &prepared.transfers, &mut taus);
            }
            placement_at_times(plan, prepared, time, placement, &taus, policy)?
        }
        None => placement_of(plan, prepared, placement, policy)?,
    };
    match frame {
        Some(frame) => assemble_framed(plan, at, frame),
        None => assemble_lowered(plan, at),
    }
}

/// [`place`] with each transfer's meeting time given ([`meeting_times`]).
fn place_at_times(
    plan: &Plan,
    time: &Timing,
    prepared: &Prepared,
    strategy: Placement,
    taus: &[(f64, f64)],
) -> Result<Vec<Vec<Placed>>, LowerError> {
    let transfers = &prepared.transfers;
    let p = plan.ranks;
    let slot_near = |r: usize, t: f64, near: usize| partition_near(&time.end[r], t, near);
    // Each end's sort key, as one integer where every part fits 32 bits (always, but
    // at absurd sizes, where the transfers' indices do not): the time as
    // `f64::total_cmp` orders it, then the producer's `seq` (32-bit), then the
    // transfer's index, which stands for `(tensor, unit, mb, to)`: the prepared list
    // is sorted by exactly that and holds each transfer once. A rank holds at most
    // one end of a transfer (a transfer joins two ranks), so the index also says
    // which end: the `SEND` on its source.
    let packed = !prepared.ends.is_empty();
    let seq_of = |id: usize| {
        let (_, (from, j, _)) = transfers[id].parts();
        time.seq[from][j] as usize
    };
    let key_of = |id: usize| (total_order(taus[id].0) as u64) ^ (1 << (u64::BITS - 1));
    // A rank's keys (packed), made when its turn comes, in one buffer for all.
    let mut keys: Vec<u128> = Vec::new();
    let mut bounds = Vec::new();
    let mut wide: Vec<Vec<(u64, usize, usize)>> = Vec::new();
    if !packed {
        wide = vec![Vec::new(); p];
        for (id, t) in transfers.iter().enumerate() {
            let ((_, _, _, to), (from, _, _)) = t.parts();
            let k = (key_of(id), seq_of(id), id);
            wide[from].push(k);
            wide[to].push(k);
        }
    }
    let mut out = Vec::with_capacity(p);
    let mut order: Vec<usize> = Vec::new();
    let mut cap: Vec<usize> = Vec::new();
    for r in 0..p {
        // Keys are unique per rank (one end of each transfer), so unstable is exact.
        order.clear();
        if packed {
            // In the prepared order of the rank's ends, about the order sought: a
            // few runs (a group's ends rise with the micro-batch), merged. Unique
            // keys: any sort gives the same order.
            keys.clear();
            keys.extend(prepared.ends[r].iter().map(|&id| {
                let id = id as usize;
                (u128::from(key_of(id)) << u64::BITS)
                    | ((seq_of(id) as u128) << u32::BITS)
                    | id as u128
            }));
            // The merge's scratch, freed once the rank's order is read (not held
            // with the placement, which grows rank by rank).
            let mut merged = Vec::new();
            let sorted = sorted_runs(&mut keys, &mut merged, &mut bounds, |&x| x);
            order.extend(
                sorted
                    .iter()
                    .map(|&x| (x as u64 & u64::from(u32::MAX)) as usize),
            );
        } else {
            let mut k = wide.get_mut(r).map(std::mem::take).unwrap_or_default();
            k.sort_unstable();
            order.extend(k.iter().map(|x| x.2));
        }
        // The end of transfer `t` (index `id`) on rank `r`: (dir, peer, lo, hi,
        // min); `lo..=hi` is the rule's choice within the slots the dependencies
        // allow (`min..=hi`: a SEND after its producer, a RECV before its consumer).
        let n = plan.order[r].len();
        // The ends come in key order, so their times rise (but for NaNs, first or
        // last): where the rank's end (start) times rise too, the slot after every
        // task that ends by a time (before every task that starts from it) is found
        // by walking them on from the last end's, linear in the ends and the tasks,
        // instead of searched anew. The walks' places so far:
        let (ends, starts) = (&time.end[r][..], &time.start[r][..]);
        let rising = |v: &[f64]| v.windows(2).all(|w| w[0] <= w[1]);
        let (walk_ends, walk_starts) =
            (rising(ends), strategy == Placement::Ready && rising(starts));
        let (mut by_end, mut by_start) = (0, 0);
        let mut end = |t: &Transfer, id: usize| {
            let tau = taus[id].0;
            let mut slot_at = |near: usize| {
                if walk_ends && !tau.is_nan() {
                    while by_end < ends.len() && ends[by_end] <= tau {
                        by_end += 1;
                    }
                    by_end
                } else {
                    slot_near(r, tau, near)
                }
            };
            if t.from as usize == r {
                let j = t.j as usize;
                (Dir::Send, t.to, slot_at(j + 1).max(j + 1), n, j + 1)
            } else {
                let i = t.i as usize;
                let lo = match strategy {
                    Placement::Ready if walk_starts && !tau.is_nan() => {
                        while by_start < starts.len() && starts[by_start] < tau {
                            by_start += 1;
                        }
                        by_start
                    }
                    Placement::Ready => starts.partition_point(|&s| s < tau),
                    Placement::Meet | Placement::Critical | Placement::Join => slot_at(i),
                    Placement::Late => i,
                };
                (Dir::Recv, t.from, lo.min(i), i, 0)
            }
        };
        // Under the ready-time rule, the latest slot each item may take without
        // pushing a later one past its limit: `lo` is where the item would rather go
        // (a SEND after every task that ends by its ready time), and with zero-cost
        // tasks that ends with them, past the consumer of a later RECV of this rank.
        // The keys guarantee only `min` (a SEND right after its producer) fits, so
        // the preference gives way there. Where no preference overshoots (every
        // positive-cost plan) this changes nothing. (No cap under the other rules.)
        cap.clear();
        if strategy == Placement::Ready {
            cap.resize(order.len(), usize::MAX);
            let mut c = usize::MAX;
            for (k, &id) in order.iter().enumerate().rev() {
                let ((_, _, _, to), (from, _, i)) = transfers[id].parts();
                let hi = if from == r { n } else { i };
                debug_assert!(from == r || to == r);
                c = c.min(hi);
                cap[k] = c;
            }
        }
        // The slots and the id fit 32 bits when the rank's tasks and the transfers
        // do (the end's other numbers are the transfer's, 32-bit already).
        let fits = u32::try_from(n).is_ok() && u32::try_from(transfers.len()).is_ok();
        let mut at: Vec<Placed> = Vec::with_capacity(order.len());
        let mut slot = 0;
        for (k, &id) in order.iter().enumerate() {
            let t = &transfers[id];
            let (dir, peer, lo, hi, min) = end(t, id);
            let cap = cap.get(k).copied().unwrap_or(usize::MAX);
            slot = slot.max(lo.min(cap)).max(min);
            // Named only for an error (not for every lowering).
            let text = || {
                let name = Name::from(plan.units[t.unit as usize].name.as_str());
                Action::p2p(dir, t.tensor, name, t.mb as usize, peer as usize, None).to_string()
            };
            if slot > hi {
                return Err(LowerError::Placement {
                    rank: r,
                    action: text(),
                    slot,
                    limit: hi,
                });
            }
            let (slot, min, max, id) = if fits {
                (slot as u32, min as u32, hi as u32, id as u32)
            } else {
                let small = |x: usize| {
                    u32::try_from(x).map_err(|_| LowerError::TooLarge { action: text() })
                };
                (small(slot)?, small(min)?, small(hi)?, small(id)?)
            };
            at.push(Placed {
                slot,
                min,
                max,
                id,
                dir,
                tensor: t.tensor,
                unit: t.unit,
                mb: t.mb,
                peer,
            });
        }
        out.push(at);
    }
    Ok(out)
}

/// A placement ([`placement_at`]'s, of some plan) in a few bytes an end: per rank
/// its number of ends, then for each end one variable-length number (7 bits a byte,
/// the lowest first, the top bit set on all but the last) of its transfer index as
/// the zigzagged difference from the last end's, shifted left by [`STEP_BITS`], plus
/// its slot's difference from the last end's slot (the slots being non-decreasing)
/// where that is below [`STEP_OVER`]; else [`STEP_OVER`], and that difference as a
/// number of its own. The rest of a placed end follows from its transfer and rank
/// ([`Compact::placement`]), so a search can hold the placement it may lower again
/// (a few bytes an end, where [`Placed`] is 32) instead of placing it again;
/// equal placements have equal bytes, and unequal ones unequal bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Compact {
    /// Each rank's number of ends.
    counts: Vec<u32>,
    /// The ends' numbers, rank after rank.
    bytes: Vec<u8>,
}

/// The bits of a number a byte of [`Compact`] holds (the top bit says more follow).
const BYTE_BITS: u32 = u8::BITS - 1;
/// The top bit of a byte of [`Compact`]: more bytes of the number follow.
const MORE: u8 = 1 << BYTE_BITS;
/// The bits of an end's number of [`Compact`] that hold its slot's step (a larger
/// step takes a number of its own).
const STEP_BITS: u32 = 2;
/// The step of [`Compact`] written as a number of its own (and those above).
const STEP_OVER: u64 = (1 << STEP_BITS) - 1;

impl Compact {
    /// `at` (per rank in key order, slots non-decreasing, as [`placement_at`] gives
    /// it) in a few bytes an end.
    pub(crate) fn of(at: &[Vec<Placed>]) -> Compact {
        fn push(bytes: &mut Vec<u8>, mut x: u64) {
            while x >= u64::from(MORE) {
                bytes.push((x as u8) | MORE);
                x >>= BYTE_BITS;
            }
            bytes.push(x as u8);
        }
        let ends: usize = at.iter().map(Vec::len).sum();
        let mut bytes = Vec::with_capacity(2 * ends);
        let mut counts = Vec::with_capacity(at.len());
        for list in at {
            counts.push(u32::try_from(list.len()).unwrap_or(u32::MAX));
            let (mut slot, mut id) = (0u32, 0u32);
            for x in list {
                let step = u64::from(x.slot.wrapping_sub(slot));
                let d = x.id.wrapping_sub(id) as i32;
                let z = u64::from(((d << 1) ^ (d >> (i32::BITS - 1))) as u32);
                if step < STEP_OVER {
                    push(&mut bytes, z << STEP_BITS | step);
                } else {
                    push(&mut bytes, z << STEP_BITS | STEP_OVER);
                    push(&mut bytes, step);
                }
                (slot, id) = (x.slot, x.id);
            }
        }
        bytes.shrink_to_fit();
        Compact { counts, bytes }
    }

    /// The placement again, as [`placement_at`] gave it for `plan` and `prepared`.
    pub(crate) fn placement(&self, plan: &Plan, prepared: &Prepared) -> Vec<Vec<Placed>> {
        let mut at = self.bytes.iter();
        let mut next = || {
            let (mut x, mut shift) = (0u64, 0);
            for &b in at.by_ref() {
                x |= u64::from(b & !MORE) << shift;
                if b < MORE {
                    break;
                }
                shift += BYTE_BITS;
            }
            x
        };
        let transfers = &prepared.transfers;
        self.counts
            .iter()
            .enumerate()
            .map(|(r, &count)| {
                let n = plan.order[r].len() as u32;
                let (mut slot, mut id) = (0u32, 0u32);
                (0..count)
                    .map(|_| {
                        let v = next();
                        let step = match v & STEP_OVER {
                            STEP_OVER => next(),
                            step => step,
                        };
                        slot = slot.wrapping_add(step as u32);
                        let z = (v >> STEP_BITS) as u32;
                        id = id.wrapping_add(((z >> 1) as i32 ^ -((z & 1) as i32)) as u32);
                        let t = &transfers[id as usize];
                        let (dir, peer, min, max) = if t.from as usize == r {
                            (Dir::Send, t.to, t.j + 1, n)
                        } else {
                            (Dir::Recv, t.from, 0, t.i)
                        };
                        Placed {
                            slot,
                            min,
                            max,
                            id,
                            dir,
                            tensor: t.tensor,
                            unit: t.unit,
                            mb: t.mb,
                            peer,
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

/// Broadcasts and reductions of every trainable unit computed away from its home.
fn collectives(plan: &Plan) -> (Vec<Collective>, Vec<Collective>) {
    let n = plan.units.len();
    // Each unit's ranks, ascending (each rank pushed once, in rank order).
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut reducers: Vec<Vec<usize>> = vec![Vec::new(); n];
    // Per rank, which units it computes and which it reduces, then one push each.
    let (mut uses, mut reduced) = (vec![false; n], vec![false; n]);
    for (r, list) in plan.order.iter().enumerate() {
        for t in list {
            uses[t.unit] = true;
            if matches!(t.op, Op::W | Op::BW) {
                reduced[t.unit] = true;
            }
        }
        for (u, (used, red)) in uses.iter_mut().zip(&mut reduced).enumerate() {
            if std::mem::take(used) {
                users[u].push(r);
            }
            if std::mem::take(red) {
                reducers[u].push(r);
            }
        }
    }
    let mut bcasts = Vec::new();
    let mut reduces = Vec::new();
    for (u, unit) in plan.units.iter().enumerate() {
        if !unit.trainable {
            continue;
        }
        for (set, out, kind) in [
            (&mut users[u], &mut bcasts, CollKind::Bcast),
            (&mut reducers[u], &mut reduces, CollKind::Reduce),
        ] {
            if let Err(at) = set.binary_search(&unit.home) {
                set.insert(at, unit.home);
            }
            if set.len() > 1 {
                out.push(Collective {
                    kind,
                    unit: u,
                    root: unit.home,
                    group: std::mem::take(set),
                });
            }
        }
    }
    (bcasts, reduces)
}

/// The canonical order of a batch's members.
fn member_order(a: &Action) -> (Dir, usize, Tensor, &str) {
    match a.view() {
        crate::ir::program::ActionRef::P2p(p) => (p.dir, p.peer, p.tensor, p.unit),
        _ => (Dir::Recv, usize::MAX, Tensor::Input, ""),
    }
}

/// Batch `members` (actions placed between the same two compute tasks, in place
/// at the end of a rank's list): a new batch starts where one would hold two sends
/// to, or two receives from, one peer. `seen` is the caller's scratch.
fn batch_members<F: Form>(
    form: &F,
    members: &mut [F::Act],
    batch: &mut u64,
    seen: &mut Vec<(bool, usize)>,
) {
    // (is send, peer) of the current run's members; runs are short, a scan is enough.
    seen.clear();
    let mut run = 0;
    for i in 0..members.len() {
        let k = form.end(&members[i]);
        if seen.contains(&k) {
            close_batch(form, &mut members[run..i], batch);
            run = i;
            seen.clear();
        }
        seen.push(k);
    }
    close_batch(form, &mut members[run..], batch);
}

/// Make `run` one batch (numbered `batch`, then counted) if it holds more than one
/// action. Members of one batch are posted together, so their order carries no
/// meaning: they are written in one canonical order (sends first, then by peer,
/// tensor, unit), which keeps repeated steps identical for loop re-rolling. Sorted
/// by insertion, stable (runs are short: at most two ends a peer).
fn close_batch<F: Form>(form: &F, run: &mut [F::Act], batch: &mut u64) {
    if run.len() < 2 {
        return;
    }
    for i in 1..run.len() {
        let mut k = i;
        while k > 0 && form.member_cmp(&run[k - 1], &run[k]) == Ordering::Greater {
            run.swap(k - 1, k);
            k -= 1;
        }
    }
    for a in run.iter_mut() {
        form.set_batch(a, *batch);
    }
    *batch += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A placement's [`Compact`] gives it back, end for end, for every rule against
    /// the ideal timing and a skewed one, on the shipped profiles' schedules; and two
    /// placements have equal bytes exactly when they are equal.
    #[test]
    fn a_compact_placement_is_the_placement() {
        use crate::algebra::eval::{eval, Request};
        use crate::algebra::expr::parse_str;
        use crate::algebra::profile::Profile;
        let profiles = [
            include_str!("../../../profiles/encoder-heavy.toml"),
            include_str!("../../../profiles/qwen2vl-7b.toml"),
        ];
        let policy = SearchPolicy::DEFAULT;
        let rules = [
            Placement::Meet,
            Placement::Ready,
            Placement::Critical,
            Placement::Late,
            Placement::Join,
        ];
        let (mut checked, mut differ) = (0, 0);
        for text in profiles {
            let profile = Profile::from_toml_str(text).expect("shipped profile parses");
            for e in [
                "1f1b",
                "zbv",
                "transpose(vision, zbv)",
                "interleaved(v = 2)",
            ] {
                for (ranks, mbs) in [(4, 8), (8, 24)] {
                    let req = Request::new(&profile, ranks, mbs);
                    let Some(plan) = eval(&req, &parse_str(e).unwrap(), &mut Vec::new()) else {
                        continue;
                    };
                    let prepared = prepare(&plan).expect("prepares");
                    let mut skewed = prepared.time.clone();
                    for (r, (s, e)) in skewed.start.iter_mut().zip(&mut skewed.end).enumerate() {
                        let by = (r % 3) as f64 * 0.3;
                        s.iter_mut().chain(e.iter_mut()).for_each(|t| *t += by);
                    }
                    for time in [&prepared.time, &skewed] {
                        let mut all: Vec<(Vec<Vec<Placed>>, Compact)> = Vec::new();
                        for rule in rules {
                            let at = placement_at(&plan, &prepared, time, rule, &policy)
                                .expect("places");
                            let compact = Compact::of(&at);
                            assert_eq!(compact.placement(&plan, &prepared), at, "{e} {rule:?}");
                            checked += 1;
                            for (other, bytes) in &all {
                                assert_eq!(other == &at, bytes == &compact, "{e} {rule:?}");
                                differ += usize::from(other != &at);
                            }
                            all.push((at, compact));
                        }
                    }
                }
            }
        }
        assert!(
            checked > 50 && differ > 0,
            "{checked} placements, {differ} pairs differ"
        );
    }

    /// `Meet`'s pass that tells of `Critical` gives `Meet`'s own meeting times, and
    /// says of `Critical` what its own pass says, against the
    /// ideal timing and a skewed one (every task on odd ranks later), on the
    /// shipped profiles' schedules.
    #[test]
    fn one_meet_pass_tells_what_critical_would() {
        use crate::algebra::eval::{eval, Request};
        use crate::algebra::expr::parse_str;
        use crate::algebra::profile::Profile;
        let profiles = [
            include_str!("../../../profiles/encoder-heavy.toml"),
            include_str!("../../../profiles/qwen2vl-7b.toml"),
            include_str!("../../../profiles/eval-c-omni.toml"),
        ];
        let policy = SearchPolicy::DEFAULT;
        let (mut checked, mut differ) = (0, 0);
        for text in profiles {
            let profile = Profile::from_toml_str(text).expect("shipped profile parses");
            for e in [
                "1f1b",
                "zbv",
                "interleaved(v = 2)",
                "transpose(vision, 1f1b)",
            ] {
                for (ranks, mbs) in [(4, 8), (8, 16)] {
                    let req = Request::new(&profile, ranks, mbs);
                    let Some(plan) = eval(&req, &parse_str(e).unwrap(), &mut Vec::new()) else {
                        continue;
                    };
                    let prepared = prepare(&plan).expect("prepares");
                    let mut skewed = prepared.time.clone();
                    for (r, (s, e)) in skewed.start.iter_mut().zip(&mut skewed.end).enumerate() {
                        let by = (r % 2) as f64 * 0.25;
                        s.iter_mut().chain(e.iter_mut()).for_each(|t| *t += by);
                    }
                    for time in [&prepared.time, &skewed] {
                        let (taus, critical) = meet_times_and_critical(time, &prepared, &policy);
                        let own = |rule| meeting_times(time, &prepared, rule, &policy);
                        assert_eq!(taus, own(Placement::Meet).0, "{e} {ranks} x {mbs}");
                        assert_eq!(critical, own(Placement::Critical).1, "{e}");
                        differ += usize::from(!critical);
                        checked += 1;
                    }
                }
            }
        }
        assert!(
            checked > 20 && differ > 0,
            "{checked} checked, {differ} differ"
        );
    }

    /// [`join`] as first written: each pair's settled times in a sorted list,
    /// each inserted before its equals (linear time an insertion).
    fn join_by_lists(time: &Timing, transfers: &[Transfer], taus: &mut [(f64, f64)]) -> bool {
        let window = |id: usize| {
            let ((_, _, _, to), (from, j, i)) = transfers[id].parts();
            (
                time.end[from][j],
                time.start[to][i],
                from.min(to),
                from.max(to),
            )
        };
        let mut by_width: Vec<(i64, usize)> = (0..transfers.len())
            .map(|id| {
                let (ready, need, ..) = window(id);
                (total_order(need - ready), id)
            })
            .collect();
        by_width.sort_unstable();
        let mut lists: std::collections::BTreeMap<(usize, usize), Vec<f64>> = Default::default();
        let mut moved = false;
        for (_, id) in by_width {
            let (ready, need, lo, hi) = window(id);
            let list = lists.entry((lo, hi)).or_default();
            let (own, cost) = taus[id];
            if cost > 0.0 {
                let k = list.partition_point(|&x| x < own);
                let near = [k.checked_sub(1).map(|b| list[b]), list.get(k).copied()]
                    .into_iter()
                    .flatten()
                    .filter(|&t| t >= ready && t <= need)
                    .min_by(|a, b| (a - own).abs().total_cmp(&(b - own).abs()));
                if let Some(t) = near {
                    moved |= t != own;
                    taus[id] = (t, 0.0);
                }
            }
            let t = taus[id].0;
            let k = list.partition_point(|&x| x < t);
            list.insert(k, t);
        }
        moved
    }

    proptest! {
        /// `join` moves every meeting time as the sorted lists it replaced did, bit
        /// for bit (zeros of both signs, ties, windows that exclude the nearest),
        /// and says so alike.
        #[test]
        fn join_is_join_by_sorted_lists(
            ranks in 2usize..5,
            steps in proptest::collection::vec(0u8..3, 4 * 40),
            ends in proptest::collection::vec((0usize..4, 0usize..40, 1usize..4, 0usize..40), 0..200),
            picks in proptest::collection::vec((0usize..8, proptest::bool::ANY), 200),
        ) {
            // Rank `r`'s task `k` runs from `k` to `k + 1` steps of 0, 1 or 2 halves.
            let n = 40;
            let mut time = Timing { start: Vec::new(), end: Vec::new(), seq: Vec::new() };
            for r in 0..ranks {
                let mut t = 0.0;
                let (mut s, mut e) = (Vec::new(), Vec::new());
                for k in 0..n {
                    s.push(t);
                    t += f64::from(steps[r * n + k]) * 0.5;
                    e.push(t);
                }
                time.start.push(s);
                time.end.push(e);
                time.seq.push(vec![0; n]);
            }
            let values = [-0.0, 0.0, 0.5, 1.0, 1.0, 2.5, 7.0, 12.0];
            let mut transfers = Vec::new();
            let mut taus = Vec::new();
            for (k, &(from, j, step, i)) in ends.iter().enumerate() {
                let from = from % ranks;
                let to = (from + step) % ranks;
                if to == from {
                    continue;
                }
                let t = Transfer::new((Tensor::Act, k, 0, to), (from, j, i)).unwrap();
                transfers.push(t);
                let (v, costly) = picks[k];
                taus.push((values[v], if costly { 1.0 } else { 0.0 }));
            }
            let mut want = taus.clone();
            let moved_want = join_by_lists(&time, &transfers, &mut want);
            let mut got = taus;
            let moved_got = join(&time, &transfers, &mut got);
            let bits = |v: &[(f64, f64)]| v.iter().map(|&(a, b)| (a.to_bits(), b.to_bits())).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
            prop_assert_eq!(moved_got, moved_want);
        }

        /// `Settled`'s nearest settled positions, over a range wider than one
        /// summary word (4096 positions), are a scan's.
        #[test]
        fn settled_finds_the_nearest_marks(
            marks in proptest::collection::vec(0usize..20000, 0..40),
            probes in proptest::collection::vec((0usize..20001, 0usize..20001), 1..40),
        ) {
            let mut settled = Settled::default();
            for k in 0..20000 {
                settled.push(k as f64);
            }
            for &k in &marks {
                settled.insert(k, k as f64);
            }
            for &(a, b) in &probes {
                let (lo, hi) = (a.min(b), a.max(b));
                let set = |k: &usize| marks.contains(k);
                prop_assert_eq!(settled.first_set(lo, hi), (lo..hi).find(set));
                prop_assert_eq!(settled.last_set(lo, hi), (lo..hi).rev().find(set));
            }
        }

        /// `sort_reads` orders reads (in order of destination and consumer, raw
        /// inputs last) as a sort by [`Transfer::order`] does, whether its tensors,
        /// units and micro-batches take one counting pass (few triples), two (few
        /// pairs) or three (many).
        #[test]
        fn sort_reads_sorts_by_order(
            raw in proptest::collection::vec(
                (0usize..3, 0usize..40, 0usize..6, 0u8..3, 0usize..5, 0usize..8),
                0..120,
            ),
            (units, mbs) in (1usize..7, 1usize..9),
        ) {
            let tensors = [Tensor::Act, Tensor::Grad, Tensor::Input];
            let mut reads: Vec<Transfer> = raw
                .iter()
                .map(|&(to, i, unit, tensor, from, mb)| {
                    let (unit, mb) = (unit % units, mb % mbs);
                    let id = (tensors[tensor as usize], unit, mb, to);
                    Transfer::new(id, (from, unit + mb, i)).unwrap()
                })
                .collect();
            // One consumer reads one producer's tensor: reads equal in order are equal
            // (up to 48 pairs of unit and micro-batch, 144 triples with the tensor:
            // long lists of few units and micro-batches take one pass, others more).
            reads.sort_by_key(|t| t.order());
            reads.dedup_by_key(|t| t.order());
            let mut want = reads.clone();
            want.sort_by_key(|t| t.order());
            reads.sort_by_key(|t| (t.tensor == Tensor::Input, t.to, t.i));
            sort_reads(&mut reads);
            prop_assert_eq!(reads, want);
        }

        /// Each rank's ends, by either way of counting them into their groups (few
        /// ranks or many for the transfers), are a stable sort of the rank's ends in
        /// the transfers' order by group (`2 peer + 1` for a SEND, `2 peer` for a
        /// RECV).
        #[test]
        fn ends_by_peer_is_a_stable_sort_by_group(
            raw in proptest::collection::vec((0usize..9, 0usize..9), 0..150),
            p in 1usize..10,
        ) {
            let transfers: Vec<Transfer> = raw
                .iter()
                .map(|&(from, to)| (from % p, to % p))
                .filter(|(from, to)| from != to)
                .enumerate()
                .map(|(k, (from, to))| {
                    Transfer::new((Tensor::Act, k % 3, k, to), (from, k, k + 1)).unwrap()
                })
                .collect();
            let want: Vec<Vec<u32>> = (0..p)
                .map(|r| {
                    let mut ends: Vec<(usize, u32)> = transfers
                        .iter()
                        .enumerate()
                        .filter_map(|(id, t)| {
                            let (from, to) = (t.from as usize, t.to as usize);
                            let g = if from == r {
                                2 * to + 1
                            } else if to == r {
                                2 * from
                            } else {
                                return None;
                            };
                            Some((g, id as u32))
                        })
                        .collect();
                    ends.sort_by_key(|e| e.0);
                    ends.into_iter().map(|e| e.1).collect()
                })
                .collect();
            prop_assert_eq!(ends_by_peer(p, &transfers), want.clone());
            prop_assert_eq!(ends_by_peer_listed(p, &transfers), want);
        }

        /// Counting by a key orders a list as a stable sort by that key does.
        #[test]
        fn counting_sort_is_a_stable_sort(
            list in proptest::collection::vec(0u32..200, 0..300),
            buckets in 1usize..40,
        ) {
            let key = |x: u32| x as usize % buckets;
            let mut want = list.clone();
            want.sort_by_key(|&x| key(x));
            let mut got = list;
            counting_sort(&mut got, &mut Vec::new(), &mut vec![7; 3], buckets, key);
            prop_assert_eq!(got, want);
        }
    }

    /// A step is 20 bytes (its batch in 4): a lowering is held per candidate the
    /// placement search judges. Batches round-trip below `u32::MAX`.
    #[test]
    fn a_step_is_twenty_bytes_and_its_batch_round_trips() {
        assert_eq!(std::mem::size_of::<Step>(), 20);
        for n in [0, 1, 7, u64::from(u32::MAX) - 1] {
            assert_eq!(Batch::new(n).map(|b| u64::from(b.get())), Some(n));
        }
        assert_eq!(Batch::new(u64::from(u32::MAX)), None);
        assert_eq!(Batch::new(u64::MAX), None);
    }

    /// Galloping from any index finds what a binary search over the whole finds, on
    /// non-decreasing lists with repeats, for times below, between, on and above
    /// every entry.
    #[test]
    fn partition_near_is_partition_point() {
        let lists: [&[f64]; 5] = [
            &[],
            &[1.0],
            &[0.0, 0.0, 1.0, 1.0, 1.0, 2.5, 4.0, 4.0, 7.0],
            &[3.0; 6],
            &[
                0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5, 11.5, 12.5,
            ],
        ];
        let mut checked = 0;
        for ends in lists {
            for k in 0..30 {
                let t = f64::from(k) * 0.5 - 1.0;
                for near in 0..=ends.len() + 2 {
                    let want = ends.partition_point(|&e| e <= t);
                    assert_eq!(
                        partition_near(ends, t, near),
                        want,
                        "{ends:?} t={t} near={near}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 500);
    }
}
