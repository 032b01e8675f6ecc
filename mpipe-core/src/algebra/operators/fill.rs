//! `fill(ENCODER, BODY)`: the encoder's work, micro-batch by micro-batch, into the idle
//! time of the body as the cost model predicts it, on any rank.
//!
//! The encoder's tasks are taken out of the body and put back one micro-batch at a
//! time, in micro-batch order:
//!
//! 1. **Forward of micro-batch `j`.** Its deadline is the start, in the plan's ideal
//!    timing, of the first task that reads its output (the first stage's forward),
//!    less the transfer time when it runs on another rank. Every rank's idle gaps in
//!    that timing are candidates; a forward that fits a gap before its deadline
//!    delays nothing (ideal timing is as-soon-as-possible and the forward reads only
//!    the raw micro-batch), so it goes into the fitting gap that starts latest (the
//!    shortest time its output is held), lower rank first on ties. Gaps shrink as
//!    they fill; the timing is not recomputed.
//! 2. **No gap fits** (the first micro-batch always; later ones when the body has no
//!    idle time left before the deadline): the forward goes, on each rank in turn,
//!    as late in the rank's order as still ends before the deadline, the plan is
//!    timed once per rank, and the rank giving the shortest step wins (among those
//!    within the profile's memory limit, when any is). The timing is then
//!    recomputed for the later micro-batches.
//! 3. **Backward** (trainable encoder): on the rank of its forward (whose activations
//!    it reads), after the gradient arrives. Three placements are timed and the
//!    fastest within the memory limit wins: into the first gap after the gradient
//!    that holds it, else at the end ("gaps"); as soon as the gradient is ready
//!    ("eager"); after the rank's other work ("deferred").
//!
//! The same placement is also made with the encoder cut into its layers, each
//! micro-batch's layers on one rank ([`super::fill_layers`]), and kept when its ideal
//! step is shorter (and within the memory limit, if the whole placement is): a long
//! forward fits no gap of a pipeline's ramps whole, and its layers may. Where the
//! ideal timing cannot tell the two apart (equal steps under
//! [`crate::ir::compare`]'s rule), the derivation above the algebra derives both
//! (`pieces = whole`, `pieces = layers`) and keeps the one that simulates faster.
//!
//! Promise: the result's ideal (communication-free) step is never longer than the
//! body's; if the placement comes out longer (the greedy choices are made one
//! micro-batch at a time), the body's own placement is kept.
//!
//! The lowering then adds the transfers of the encoder's outputs and gradients, and,
//! for forwards away from the encoder's home, the parameter broadcast and gradient
//! reduction. Composition is plain: the body may be any expression, including
//! `transpose` of the same encoder (whose placement `fill` replaces) or `fill` of
//! another encoder (whose placed tasks are then part of the body).

use super::fill_layers::{place_backward, place_layers};
use super::insert_all;
use super::layers::cut_encoder;
use crate::algebra::analysis::{
    dependencies, dependencies_lenient, peak_memory, timing, PlanError, Timing,
};
use crate::algebra::profile::Profile;
use crate::ir::compare::{at_most, close, less, Score};
use crate::ir::plan::{Plan, Task, TaskIndex, UnitId};
use crate::ir::program::Op;

/// The communication cost model the deadlines account for: `(latency, bandwidth)`.
pub type Link = Option<(f64, f64)>;

/// A cap on the work of `fill` placements, carried by the request
/// ([`crate::algebra::eval::Request::fill_cap`]): `auto` sets one (of
/// [`crate::ir::policy::SearchPolicy::fill_work`]) for each candidate it plans.
/// It bounds the task visits one placement may spend re-timing the plan after
/// micro-batches that no idle gap takes (each costs a timing per rank, and at one
/// rank every micro-batch is one); past it, the placement fails with
/// [`PlanError::OverBudget`], and the cap records that it was hit. Without a cap
/// (`fill` written by hand), a placement is never cut short.
#[derive(Debug)]
pub struct FillCap {
    most: u64,
    hit: std::sync::atomic::AtomicBool,
}

impl FillCap {
    /// A cap of `most` task visits per placement, not yet hit.
    pub fn new(most: u64) -> Self {
        FillCap {
            most,
            hit: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a placement under this cap went past it.
    pub fn hit(&self) -> bool {
        self.hit.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A record, carried by the request ([`crate::algebra::eval::Request::fill_ties`]),
/// that a `fill` choosing its pieces ([`Pieces::Best`]) found the whole and the
/// layer-by-layer placements equally fast in the ideal timing (under
/// [`crate::ir::compare`]'s rule). The ideal timing then decided nothing of worth
/// (the choice falls to peak memory, or to rounding), so the derivation, which can
/// simulate, derives both and keeps the faster; without a tie it derives one.
#[derive(Debug, Default)]
pub struct FillTies {
    seen: std::sync::atomic::AtomicBool,
}

impl FillTies {
    /// A record of no tie yet.
    pub fn new() -> Self {
        FillTies::default()
    }

    /// Whether a `fill` under this record tied.
    pub fn seen(&self) -> bool {
        self.seen.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn record(&self) {
        self.seen.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Charges one fallback's re-timings of `plan` (a timing per rank, one of the
/// result, and its index) to `spent`; an error once past `cap`, if any.
pub(super) fn charge(spent: &mut u64, plan: &Plan, cap: Option<&FillCap>) -> Result<(), PlanError> {
    let Some(cap) = cap else {
        return Ok(());
    };
    let tasks: u64 = plan.order.iter().map(|l| l.len() as u64).sum();
    *spent = spent.saturating_add(tasks.saturating_mul(plan.ranks as u64 + 2));
    if *spent > cap.most {
        cap.hit.store(true, std::sync::atomic::Ordering::Relaxed);
        return Err(PlanError::OverBudget { cap: cap.most });
    }
    Ok(())
}

/// Whether `fill` places the encoder whole or layer by layer (`fill`'s `pieces`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pieces {
    /// The faster of the two by the plan's ideal timing (as fast: the one holding
    /// less memory, else whole).
    Best,
    /// The encoder whole, one task per micro-batch and pass.
    Whole,
    /// The encoder cut into its layers; whole when it cannot be cut (a single
    /// layer, or costs that are not its layers').
    Layers,
}

/// [`fill_with`] choosing the pieces by the ideal timing ([`Pieces::Best`]).
pub fn fill(
    plan: Plan,
    enc: UnitId,
    link: Link,
    profile: &Profile,
    cap: Option<&FillCap>,
) -> Result<Plan, PlanError> {
    fill_with(plan, enc, link, profile, Pieces::Best, cap, None)
}

/// Re-place encoder `enc`'s work in `plan` (see the module documentation), whole
/// or layer by layer (layers from `profile`; see [`super::fill_layers`]) as `pieces`
/// says. Never a longer ideal step than `plan`: if the placement comes out longer,
/// `plan` is kept. `cap` bounds the placement's work ([`FillCap`]; `None`:
/// unbounded); `ties`, if any, records a tie of the two placements ([`FillTies`]).
pub fn fill_with(
    plan: Plan,
    enc: UnitId,
    link: Link,
    profile: &Profile,
    pieces: Pieces,
    cap: Option<&FillCap>,
    ties: Option<&FillTies>,
) -> Result<Plan, PlanError> {
    let span =
        |p: &Plan| -> Result<f64, PlanError> { Ok(timing(p, &dependencies(p)?)?.makespan()) };
    let before = span(&plan)?;
    let mut cut = match pieces {
        Pieces::Whole => None,
        Pieces::Best | Pieces::Layers => cut_encoder(&plan, profile, enc),
    };
    if pieces == Pieces::Layers {
        if let Some((cut, layer_ids)) = cut.take() {
            let layered = place_layers(cut, &layer_ids, link, cap)?;
            return Ok(if at_most(span(&layered)?, before) {
                layered
            } else {
                plan
            });
        }
    }
    let mut filled = place(plan.clone(), enc, link, None, cap)?;
    let mut best = span(&filled)?;
    if let Some((cut, layer_ids)) = cut {
        let layered = place_layers(cut, &layer_ids, link, cap)?;
        let s = span(&layered)?;
        if let Some(ties) = ties.filter(|_| close(s, best)) {
            ties.record();
        }
        // Layer by layer only when faster (under the tolerance rule; as fast and
        // holding less memory counts too), and within the memory limit if the
        // whole placement is.
        if Score::span(s)
            .with_peak(peak(&layered))
            .beats(&Score::span(best).with_peak(peak(&filled)))
            && (within_limit(&layered) || !within_limit(&filled))
        {
            (filled, best) = (layered, s);
        }
    }
    Ok(if at_most(best, before) { filled } else { plan })
}

/// Takes `enc`'s tasks out of `plan` and puts them back one micro-batch at a time
/// (steps 1-3 of the module documentation), on any rank, or only on rank `only`.
pub(super) fn place(
    mut plan: Plan,
    enc: UnitId,
    link: Link,
    only: Option<usize>,
    cap: Option<&FillCap>,
) -> Result<Plan, PlanError> {
    let m = plan.microbatches;
    for list in &mut plan.order {
        list.retain(|t| t.unit != enc);
    }
    plan.input_ships.retain(|s| s.unit != enc);
    let consumers = plan.successors(enc);
    let c_f = plan.units[enc].cost.f;
    let send = link.map_or(0.0, |(lat, bw)| lat + plan.units[enc].bytes / bw);

    let mut time = timing(&plan, &dependencies_lenient(&plan)?)?;
    let mut gaps = Gaps::of(&plan, &time).only(only);
    let mut pending: Vec<Vec<(usize, Task)>> = vec![Vec::new(); plan.ranks];
    // The readers never move; the index changes only when a fallback does.
    let mut index = plan.locate();
    let mut spent = 0;
    for mb in 0..m {
        let task = Task::new(Op::F, enc, mb);
        let Some((deadline, home)) = first_reader(&index, &time, &consumers, mb) else {
            // Nobody reads it (cannot happen for an encoder): keep it at its home.
            let r = only.unwrap_or(plan.units[enc].home);
            pending[r].push((0, task));
            continue;
        };
        if let Some((r, pos)) = gaps.take(c_f, deadline, home, send) {
            pending[r].push((pos, task));
            continue;
        }
        flush(&mut plan, &mut pending);
        charge(&mut spent, &plan, cap)?;
        plan = fallback(plan, task, deadline, home, send, only)?;
        time = timing(&plan, &dependencies_lenient(&plan)?)?;
        index = plan.locate();
        gaps = Gaps::of(&plan, &time).only(only);
    }
    flush(&mut plan, &mut pending);
    if !plan.units[enc].trainable {
        return Ok(plan);
    }
    // A whole encoder's backward is a chain of one.
    place_backward(plan, &[enc])
}

/// Inserts every rank's pending `(position, task)` pairs into its order (positions
/// refer to the order as it was), leaving `pending` empty.
pub(super) fn flush(plan: &mut Plan, pending: &mut [Vec<(usize, Task)>]) {
    for (r, items) in pending.iter_mut().enumerate() {
        insert_all(&mut plan.order[r], std::mem::take(items));
    }
}

/// The earliest gap of `list` at insert position `after` or later that holds a task
/// of length `cost` starting at `ready` or later and ending by `due`: takes the room
/// and returns the position and the task's end.
fn take_earliest(
    list: &mut [(usize, f64, f64)],
    cost: f64,
    ready: f64,
    due: f64,
    after: usize,
) -> Option<(usize, f64)> {
    let gap = list
        .iter_mut()
        .find(|(k, from, until)| *k >= after && at_most(from.max(ready) + cost, until.min(due)))?;
    let end = gap.1.max(ready) + cost;
    gap.1 = end;
    Some((gap.0, end))
}

impl Chain {
    /// The rank it was tried on.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }
}

/// A chain of tasks tried on one rank's gaps ([`Gaps::try_chain`]).
pub(super) struct Chain {
    rank: usize,
    /// Insert positions of the tasks that fit, in chain order.
    pub(super) at: Vec<usize>,
    /// The first task's start (0 if none fits).
    pub(super) start: f64,
    gaps: Vec<(usize, f64, f64)>,
}

/// Idle gaps of every rank in a timing: `(insert position, free from, free until)`,
/// the last one (after the rank's last task) open-ended.
#[derive(Clone)]
pub(super) struct Gaps {
    gaps: Vec<Vec<(usize, f64, f64)>>,
}

impl Gaps {
    pub(super) fn of(plan: &Plan, time: &Timing) -> Gaps {
        let gaps = (0..plan.ranks)
            .map(|r| {
                let n = plan.order[r].len();
                let mut g = Vec::with_capacity(n + 1);
                for k in 0..=n {
                    let from = if k == 0 { 0.0 } else { time.end[r][k - 1] };
                    let until = if k == n {
                        f64::INFINITY
                    } else {
                        time.start[r][k]
                    };
                    if until > from {
                        g.push((k, from, until));
                    }
                }
                g
            })
            .collect();
        Gaps { gaps }
    }

    /// Keeps only rank `only`'s gaps (all of them for `None`).
    pub(super) fn only(mut self, only: Option<usize>) -> Gaps {
        if let Some(keep) = only {
            for (r, list) in self.gaps.iter_mut().enumerate() {
                if r != keep {
                    list.clear();
                }
            }
        }
        self
    }

    /// Takes room on rank `r` for a task of length `cost` that may start at `ready`
    /// and must end by `due`, at insert position `after` or later: the earliest such
    /// gap. Returns the insert position and the task's end; the gap keeps what is
    /// left after the task.
    pub(super) fn take_earliest(
        &mut self,
        r: usize,
        cost: f64,
        ready: f64,
        due: f64,
        after: usize,
    ) -> Option<(usize, f64)> {
        take_earliest(&mut self.gaps[r], cost, ready, due, after)
    }

    /// Tries a chain of tasks (`costs`, in order, each after the one before it, the
    /// first from time 0) on rank `r`, each into the earliest gap that holds it by
    /// `due` (see [`Gaps::take_earliest`]), on a copy of that rank's gaps alone.
    /// Returns the insert positions of the tasks that fit (a prefix of the chain),
    /// the first one's start, and the copy to [`Gaps::commit`] if the chain is taken.
    pub(super) fn try_chain(&self, r: usize, costs: &[f64], due: f64) -> Chain {
        let mut list = self.gaps[r].clone();
        let (mut ready, mut after) = (0.0, 0);
        let mut at = Vec::with_capacity(costs.len());
        let mut start = None;
        for &c in costs {
            let Some((pos, done)) = take_earliest(&mut list, c, ready, due, after) else {
                break;
            };
            start.get_or_insert(done - c);
            at.push(pos);
            (ready, after) = (done, pos);
        }
        Chain {
            rank: r,
            at,
            start: start.unwrap_or(0.0),
            gaps: list,
        }
    }

    /// Takes the room a [`Gaps::try_chain`] found.
    pub(super) fn commit(&mut self, chain: Chain) -> Vec<usize> {
        self.gaps[chain.rank] = chain.gaps;
        chain.at
    }

    /// Closes rank `r`'s last gap (after its last task): what is appended there from
    /// now on runs after anything placed in it so far.
    pub(super) fn close_end(&mut self, r: usize) {
        if let Some(last) = self.gaps[r].last_mut() {
            if last.2 == f64::INFINITY {
                last.1 = f64::INFINITY;
            }
        }
    }

    /// Takes room for a task of length `cost` that must end by `deadline` (by
    /// `deadline - send` away from rank `home`): the fitting gap that starts latest.
    pub(super) fn take(
        &mut self,
        cost: f64,
        deadline: f64,
        home: usize,
        send: f64,
    ) -> Option<(usize, usize)> {
        let mut best: Option<(f64, usize, usize)> = None;
        for (r, list) in self.gaps.iter().enumerate() {
            let due = if r == home { deadline } else { deadline - send };
            for (g, &(_, from, until)) in list.iter().enumerate() {
                if at_most(from + cost, until.min(due)) && best.is_none_or(|(f, ..)| from > f) {
                    best = Some((from, r, g));
                }
            }
        }
        let (_, r, g) = best?;
        let gap = &mut self.gaps[r][g];
        gap.1 += cost;
        Some((r, gap.0))
    }
}

/// Places `task` (no gap fits) on the rank where it lengthens the step least (on
/// rank `only`, if given).
fn fallback(
    plan: Plan,
    task: Task,
    deadline: f64,
    home: usize,
    send: f64,
    only: Option<usize>,
) -> Result<Plan, PlanError> {
    let time = timing(&plan, &dependencies_lenient(&plan)?)?;
    let cost = task.op.cost(&plan.units[task.unit].cost);
    let best = fastest(
        (0..plan.ranks)
            .filter(|&r| only.is_none_or(|o| o == r))
            .map(|r| {
                let due = if r == home { deadline } else { deadline - send };
                let pos = time.end[r].partition_point(|&e| at_most(e, due - cost));
                let mut candidate = plan.clone();
                candidate.order[r].insert(pos, task);
                candidate
            }),
    );
    match best {
        Some(p) => Ok(p),
        None => {
            // Every insertion cycles (cannot happen: the position ends before the
            // reader starts); put it right before its reader on the reader's rank, or
            // first on rank `only`.
            let mut p = plan;
            if let Some(r) = only {
                p.order[r].insert(0, task);
                return Ok(p);
            }
            let index = p.locate();
            let pos = p
                .successors(task.unit)
                .into_iter()
                .filter_map(|c| index.get(Op::F, c, task.mb))
                .find(|&(q, _)| q == home)
                .map_or(0, |(_, j)| j);
            p.order[home].insert(pos, task);
            Ok(p)
        }
    }
}

/// The first reader among `consumers` of micro-batch `mb`'s output, in `time`: its
/// start (the output's deadline) and rank.
pub(super) fn first_reader(
    index: &TaskIndex,
    time: &Timing,
    consumers: &[UnitId],
    mb: usize,
) -> Option<(f64, usize)> {
    consumers
        .iter()
        .filter_map(|&c| index.get(Op::F, c, mb))
        .map(|(q, j)| (time.start[q][j], q))
        .min_by(|a, b| a.0.total_cmp(&b.0))
}

/// `p`'s largest peak of activations over the ranks.
fn peak(p: &Plan) -> f64 {
    peak_memory(p).into_iter().fold(0.0, f64::max)
}

/// Whether `p`'s peak activations stay within its memory limit (none: yes).
pub(super) fn within_limit(p: &Plan) -> bool {
    p.memory_limit
        .is_none_or(|limit| peak_memory(p).into_iter().all(|x| at_most(x, limit)))
}

/// Of `candidates` (a plan with a task inserted, each), the one with the shortest
/// ideal step, those within the memory limit first, the earliest on ties; `None`
/// when none can be timed (each would cycle).
pub(super) fn fastest(candidates: impl IntoIterator<Item = Plan>) -> Option<Plan> {
    let mut best: Option<(bool, f64, Plan)> = None;
    for candidate in candidates {
        let Ok(deps) = dependencies_lenient(&candidate) else {
            continue;
        };
        let Ok(t) = timing(&candidate, &deps) else {
            continue;
        };
        let (ok, span) = (within_limit(&candidate), t.makespan());
        let better = best
            .as_ref()
            .is_none_or(|(b_ok, b_span, _)| (ok && !b_ok) || (ok == *b_ok && less(span, *b_span)));
        if better {
            best = Some((ok, span, candidate));
        }
    }
    best.map(|(.., p)| p)
}

/// Of complete `candidates` (the backwards placed three ways), the one within the
/// memory limit with the shortest ideal step, then the lowest peak, the earliest on
/// ties.
pub(super) fn fastest_backward(candidates: Vec<Plan>) -> Result<Option<Plan>, PlanError> {
    let mut scored = Vec::with_capacity(candidates.len());
    for p in candidates {
        let span = timing(&p, &dependencies(&p)?)?.makespan();
        let peak = peak_memory(&p).into_iter().fold(0.0, f64::max);
        scored.push((within_limit(&p), span, peak, p));
    }
    Ok(scored
        .into_iter()
        .min_by(|a, b| {
            b.0.cmp(&a.0).then(
                Score::span(a.1)
                    .with_peak(a.2)
                    .order(&Score::span(b.1).with_peak(b.2)),
            )
        })
        .map(|(.., p)| p))
}
