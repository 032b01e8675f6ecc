//! Refinement of a lowering by simulation: move transfers where ranks wait, then
//! weight gradients into the waits that are left (`settle_w`).
//!
//! Under rendezvous a transfer completes when both of its ends have been reached,
//! so the first rank to arrive waits. The lowering places each end from the plan's
//! ideal timing; once ranks wait the timeline shifts and some meetings land badly.
//! `refine` simulates the program, takes the ends where a rank waited longest,
//! and tries two moves for each: post it one compute task *later* on its own rank
//! (the rank computes instead of waiting), or post the other end one compute task
//! *earlier* (the partner arrives sooner). A move is kept when the program's
//! makespan (then the sum of the ranks' finishing times) goes down.
//!
//! Moves keep every rank's transfers in the lowering's key order (an end moves
//! together with the ends that share its slot and come after it, or before it), and
//! keep each end within the slots its dependencies allow (a `SEND` after its
//! producer, a `RECV` before its consumer). The deadlock-freedom argument of
//! [`crate::algebra::lower`] depends only on that order, so every refined program terminates
//! under rendezvous, like the one it came from.

use crate::algebra::lower::{assemble_lowered, rank_steps, Batch, Frame, Lowered, Placed, Step};
use crate::ir::compare::Score;
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{Op, Unit};
use crate::judge::compare::timed;
use crate::judge::resume::Resumable;
use crate::judge::simulate::{finish_times_within, simulate_lowered, SimOptions, SimReport};

/// A trial's [`timed`] score from its finishing times alone (no timeline kept, no
/// memory walked): the makespan, the latest of them, then their sum, as [`timed`]
/// reads them from the report [`simulate_lowered`] gives. `None` when it does not
/// run, or as soon as its simulation proves it ends later than `cutoff`
/// ([`finish_times_within`]): a trial has only to improve on a program of that
/// makespan, and such a one cannot. With `run` (the run of the program the trial
/// is a move of), the trial is simulated from it ([`Resumable`]: the same times).
fn score_of(
    units: &[Unit],
    lowered: &Lowered,
    opts: &SimOptions,
    cutoff: f64,
    run: Option<&Resumable>,
) -> Option<Score> {
    let finish = match run {
        Some(run) => run.finish_times(units, lowered, opts, cutoff),
        None => finish_times_within(units, lowered, opts, cutoff),
    };
    let finish = finish.ok()??;
    let makespan = finish.iter().copied().fold(0.0, f64::max);
    let ends: f64 = finish.iter().sum();
    Some(Score::span(makespan).with_ends(ends))
}

/// Improve `at` (a placement of `plan`'s transfers) for `opts` with at most `budget`
/// simulations; returns the best lowering found and its report. `start` is `at`'s
/// lowering ([`assemble_lowered`]) and report. Trials are judged by unit index and
/// by their finishing times; only a kept one is simulated in full.
pub(crate) fn refine(
    plan: &Plan,
    mut at: Vec<Vec<Placed>>,
    start: (Lowered, SimReport),
    opts: &SimOptions,
    budget: usize,
) -> (Lowered, SimReport) {
    let (mut lowered, mut report) = start;
    let mut spent = 0;
    let mut best = timed(&report);
    // The best's run, which trials are simulated from.
    let mut run = Resumable::new(lowered.clone(), &report.timeline);
    // The plan's collectives and units' name order, as every move keeps them.
    let frame = Frame::of(plan);
    while spent < budget {
        let waits = waits(&lowered, &report, &at);
        let mut improved = false;
        for (r, q) in waits {
            let partner = other_end(&at, r, q);
            let moves = [
                Some((r, q, Move::Later)),
                partner.map(|(s, k)| (s, k, Move::Earlier)),
            ];
            for (s, k, dir) in moves.into_iter().flatten() {
                if spent >= budget {
                    break;
                }
                let Some(undo) = shift(&mut at, s, k, dir) else {
                    continue;
                };
                spent += 1;
                let judge = |candidate: &Lowered| {
                    score_of(&plan.units, candidate, opts, best.makespan, run.as_ref())
                        .filter(|score| score.improves(&best))?;
                    simulate_lowered(&plan.units, candidate, opts).ok()
                };
                // A move shifts ends of rank `s` only: its list is assembled again
                // and swapped into the lowering (and back if the move is not kept),
                // the other ranks' lists are the lowering's.
                let kept = match rank_steps(plan, s, &at[s], &frame) {
                    Some(list) => list.ok().and_then(|list| {
                        let old = std::mem::replace(&mut lowered.programs[s], list);
                        let rep = judge(&lowered);
                        if rep.is_none() {
                            lowered.programs[s] = old;
                        }
                        rep.map(|rep| (None, rep))
                    }),
                    None => assemble_lowered(plan, &at)
                        .ok()
                        .and_then(|candidate| judge(&candidate).map(|rep| (Some(candidate), rep))),
                };
                match kept {
                    Some((candidate, rep)) => {
                        if let Some(candidate) = candidate {
                            lowered = candidate;
                        }
                        best = timed(&rep);
                        run = Resumable::new(lowered.clone(), &rep.timeline);
                        report = rep;
                        improved = true;
                        break;
                    }
                    None => {
                        for (r, i, slot) in undo {
                            at[r][i].slot = slot;
                        }
                    }
                }
            }
            if improved {
                break;
            }
        }
        if !improved {
            break;
        }
    }
    (lowered, report)
}

#[derive(Clone, Copy)]
enum Move {
    Later,
    Earlier,
}

/// Every placed end `(rank, index in at[rank])` at which its rank waited, the
/// longest wait first (ties by rank and index, so the order is deterministic).
fn waits(lowered: &Lowered, report: &SimReport, at: &[Vec<Placed>]) -> Vec<(usize, usize)> {
    let mut out: Vec<(f64, usize, usize)> = Vec::new();
    for (r, list) in lowered.programs.iter().enumerate() {
        let Some(slots) = report.timeline.ranks.get(r) else {
            continue;
        };
        // Walk the list and the placement together: the k-th point-to-point step
        // of the rank's list is some end of at[r] (the prefetch transfers, at the
        // end, are not placed and not moved).
        let mut compute = 0usize;
        for (a, s) in list.iter().zip(slots) {
            match *a {
                Step::Compute { .. } => compute += 1,
                Step::P2p {
                    dir,
                    tensor,
                    unit,
                    mb,
                    peer,
                    ..
                } => {
                    // The end of this step: same slot (compute count) and transfer.
                    let from = at[r].partition_point(|x| (x.slot as usize) < compute);
                    let here = at[r][from..]
                        .iter()
                        .take_while(|x| x.slot as usize == compute)
                        .position(|x| {
                            x.dir == dir
                                && x.tensor == tensor
                                && x.mb == mb
                                && x.peer == peer
                                && x.unit == unit
                        })
                        .map(|i| from + i);
                    if let Some(q) = here {
                        let wait = s.end - s.start;
                        if wait > 0.0 {
                            out.push((wait, r, q));
                        }
                    }
                }
                Step::Coll(_) => {}
            }
        }
    }
    out.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    out.into_iter().map(|(_, r, q)| (r, q)).collect()
}

/// The other end of the transfer placed at `at[r][q]`.
fn other_end(at: &[Vec<Placed>], r: usize, q: usize) -> Option<(usize, usize)> {
    let id = at[r][q].id;
    let peer = at[r][q].peer as usize;
    at.get(peer)?
        .iter()
        .position(|x| x.id == id)
        .map(|k| (peer, k))
}

/// Move end `at[r][q]` one slot in `dir`, together with the ends of its slot that
/// must move with it to keep the key order. Returns the old slots (to undo), or
/// `None` (and changes nothing) if a dependency forbids the move.
fn shift(
    at: &mut [Vec<Placed>],
    r: usize,
    q: usize,
    dir: Move,
) -> Option<Vec<(usize, usize, u32)>> {
    let list = &at[r];
    let slot = list[q].slot;
    let range = match dir {
        // q and the ends after it in the same slot.
        Move::Later => q..list[q..].iter().take_while(|x| x.slot == slot).count() + q,
        // The ends before q in the same slot, and q.
        Move::Earlier => {
            if slot == 0 {
                return None;
            }
            q - list[..q]
                .iter()
                .rev()
                .take_while(|x| x.slot == slot)
                .count()..q + 1
        }
    };
    let allowed = list[range.clone()].iter().all(|x| match dir {
        Move::Later => x.slot < x.max,
        Move::Earlier => x.slot > x.min,
    });
    if !allowed {
        return None;
    }
    let mut undo = Vec::with_capacity(range.len());
    for i in range {
        let x = &mut at[r][i];
        undo.push((r, i, x.slot));
        x.slot = match dir {
            Move::Later => x.slot + 1,
            Move::Earlier => x.slot - 1,
        };
    }
    Some(undo)
}

/// Weight gradients moved where ranks wait: the second half of `refine`.
///
/// A `W` feeds nothing (only the step's end waits for it), so it may run anywhere
/// after its own `B` on its rank. Where a simulation shows a rank waiting in a
/// transfer, two moves can turn the wait into work:
///
/// - *fill*: a `W` the waiting rank runs after the transfer, whose `B` comes before
///   it, moves to just before the transfer (the rank computes while its partner is
///   still busy, and has that much less to do afterwards);
/// - *make way*: a `W` the partner runs shortly before the transfer moves to just
///   after it (the partner arrives sooner, and runs the `W` once both have moved on).
///
/// First, rank by rank, every wait of the rank is filled at once with as many `W`s
/// as fit in it ([`fill_rank`]); while that helps, the ranks are filled again (a
/// simulation per rank and round). Then wait by wait, the longest first: of the
/// `W`s that fit (at most twice the wait), the one closest to the wait is
/// tried. A move is kept when the makespan (then the sum of the ranks' finishing
/// times) goes down and every rank stays within `fits` (the memory limit: a `W`
/// moved later holds its activation longer). Transfers keep their order on every
/// rank, so the deadlock-freedom argument of [`crate::algebra::lower`] still holds.
///
/// It works on the lowering by unit index (`units` are the plan's): a trial changes
/// one rank's list in place (undone when it is not kept), is ranked by its
/// finishing times, and only one that is faster is simulated in full (its memory,
/// for `fits`, and its timeline, for the next moves).
pub(crate) fn settle_w(
    units: &[Unit],
    start: (Lowered, SimReport),
    opts: &SimOptions,
    fits: &dyn Fn(&SimReport) -> bool,
    budget: usize,
    policy: &SearchPolicy,
) -> (Lowered, SimReport) {
    let (moves_per_round, fit) = (policy.w_moves_per_round, policy.w_fit);
    let (mut lowered, mut report) = start;
    let mut best = timed(&report);
    let mut run = Resumable::new(lowered.clone(), &report.timeline);
    let mut spent = 0;
    let lengths = Lengths::of(units, opts);
    let cost = |a: &Step| lengths.compute(a);
    // A candidate's report when it beats `best` and fits (simulated from `run`,
    // the best's run).
    let accept = |next: &Lowered, best: Score, run: Option<&Resumable>| {
        score_of(units, next, opts, best.makespan, run).filter(|score| score.improves(&best))?;
        simulate_lowered(units, next, opts)
            .ok()
            .filter(|rep| fits(rep))
    };
    // First the waits of one rank at a time, each all at once, while that helps:
    // one simulation a try.
    loop {
        let mut improved = false;
        for r in 0..lowered.programs.len() {
            if spent >= budget {
                break;
            }
            let Some(filled) = fill_rank(&lowered, &report, &lengths, r) else {
                continue;
            };
            spent += 1;
            let old = std::mem::replace(&mut lowered.programs[r], filled);
            match accept(&lowered, best, run.as_ref()) {
                Some(rep) => {
                    best = timed(&rep);
                    run = Resumable::new(lowered.clone(), &rep.timeline);
                    report = rep;
                    improved = true;
                }
                None => lowered.programs[r] = old,
            }
        }
        if !improved || spent >= budget {
            break;
        }
    }
    // The moves tried and not kept since the program last changed: the waits of one
    // batch often propose the same move, and it would be judged the same again. It
    // still counts as a try (the budget runs down as it always has).
    let mut rejected: std::collections::HashSet<(usize, usize, usize)> = Default::default();
    // Each rank's first `B`s, read where a fill is first looked for on it since
    // the program last changed (a move not kept is undone: the lists are the
    // round's own until one is kept, and the round ends there).
    let mut firsts: Vec<Option<FirstBs>> = Vec::new();
    while spent < budget {
        let mut improved = false;
        let mut tried = 0;
        rejected.clear();
        firsts.clear();
        firsts.resize_with(lowered.programs.len(), || None);
        for (wait, r, i) in transfer_waits(&lowered, &report) {
            if tried >= moves_per_round || spent >= budget {
                break;
            }
            let first = firsts[r].get_or_insert_with(|| FirstBs::of(&lowered.programs[r]));
            let candidates = [
                fill_move(&lowered, r, i, (wait, fit), first, &cost),
                make_way_move(&lowered, &report, r, i, fit, &cost),
            ];
            for (rank, from, to) in candidates.into_iter().flatten() {
                if spent >= budget {
                    break;
                }
                tried += 1;
                spent += 1;
                if !rejected.insert((rank, from, to)) {
                    continue;
                }
                let list = &mut lowered.programs[rank];
                let w = list.remove(from);
                list.insert(to, w);
                if let Some(rep) = accept(&lowered, best, run.as_ref()) {
                    best = timed(&rep);
                    run = Resumable::new(lowered.clone(), &rep.timeline);
                    report = rep;
                    improved = true;
                    break;
                }
                let list = &mut lowered.programs[rank];
                let w = list.remove(to);
                list.insert(from, w);
            }
            if improved {
                break;
            }
        }
        if !improved {
            break;
        }
    }
    (lowered, report)
}

/// How long a lowering's steps take: a compute step its unit's cost, a
/// point-to-point step its transfer under the link model (0 without one).
struct Lengths<'a> {
    units: &'a [Unit],
    comm: Option<crate::judge::simulate::CommModel>,
}

impl<'a> Lengths<'a> {
    /// Moves never change the units: their figures are read by index.
    fn of(units: &'a [Unit], opts: &SimOptions) -> Lengths<'a> {
        Lengths {
            units,
            comm: opts.comm,
        }
    }

    fn compute(&self, a: &Step) -> f64 {
        match *a {
            Step::Compute { op, unit, .. } => self
                .units
                .get(unit as usize)
                .map_or(0.0, |u| op.cost(&u.cost)),
            _ => 0.0,
        }
    }

    fn transfer(&self, a: &Step) -> f64 {
        match (*a, self.comm) {
            (Step::P2p { unit, .. }, Some(c)) => {
                c.transfer_time(self.units.get(unit as usize).map_or(0.0, |u| u.bytes))
            }
            _ => 0.0,
        }
    }
}

/// Every point-to-point step a rank spent time in, `(time, rank, index)`, the
/// longest first (ties by rank and index).
fn transfer_waits(lowered: &Lowered, report: &SimReport) -> Vec<(f64, usize, usize)> {
    let mut out = Vec::new();
    for (r, list) in lowered.programs.iter().enumerate() {
        let Some(slots) = report.timeline.ranks.get(r) else {
            continue;
        };
        for (i, (a, s)) in list.iter().zip(slots).enumerate() {
            if matches!(a, Step::P2p { .. }) && s.end > s.start {
                out.push((s.end - s.start, r, i));
            }
        }
    }
    out.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    out
}

/// The batch of a point-to-point step (`None` for a single transfer or another step).
fn batch_of(a: &Step) -> Option<Batch> {
    match *a {
        Step::P2p { batch, .. } => batch,
        _ => None,
    }
}

/// Whether `a` is a `W`.
fn is_w(a: &Step) -> bool {
    matches!(a, Step::Compute { op: Op::W, .. })
}

/// The first and last index of the batch (or single transfer) at `list[i]`.
fn batch_bounds(list: &[Step], i: usize) -> (usize, usize) {
    let Some(b) = batch_of(&list[i]) else {
        return (i, i);
    };
    let mut lo = i;
    while lo > 0 && batch_of(&list[lo - 1]) == Some(b) {
        lo -= 1;
    }
    let mut hi = i;
    while hi + 1 < list.len() && batch_of(&list[hi + 1]) == Some(b) {
        hi += 1;
    }
    (lo, hi)
}

/// Of the `W`s in `range` of `list` whose cost is at most `fit` times `wait`
/// ([`SearchPolicy::w_fit`]), the one closest to `wait` (the earliest on ties) that
/// `ok` accepts.
fn closest_w(
    list: &[Step],
    range: std::ops::Range<usize>,
    wait: f64,
    fit: f64,
    ok: &dyn Fn(usize) -> bool,
    cost: &dyn Fn(&Step) -> f64,
) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for j in range {
        if !is_w(&list[j]) {
            continue;
        }
        let c = cost(&list[j]);
        if c > fit * wait || !ok(j) {
            continue;
        }
        let gap = (c - wait).abs();
        if best.is_none_or(|(g, _)| gap < g) {
            best = Some((gap, j));
        }
    }
    best.map(|(_, j)| j)
}

/// Where each `(unit, micro-batch)`'s first `B` is in one rank's list: whether a
/// `B` is among the steps before an index is whether its first one is.
struct FirstBs(Vec<((u32, u32), usize)>);

impl FirstBs {
    /// The first `B`s of `list`, sorted by `(unit, micro-batch)`.
    fn of(list: &[Step]) -> FirstBs {
        let mut at: Vec<((u32, u32), usize)> = list
            .iter()
            .enumerate()
            .filter_map(|(j, a)| match *a {
                Step::Compute {
                    op: Op::B,
                    unit,
                    mb,
                } => Some(((unit, mb), j)),
                _ => None,
            })
            .collect();
        // Stable: the first of equal keys stays first, and is the one kept.
        at.sort_by_key(|&(key, _)| key);
        at.dedup_by_key(|&mut (key, _)| key);
        FirstBs(at)
    }

    /// Whether the list has a `B` of `unit` and `mb` before index `lo`.
    fn before(&self, (unit, mb): (u32, u32), lo: usize) -> bool {
        self.0
            .binary_search_by_key(&(unit, mb), |&(key, _)| key)
            .is_ok_and(|k| self.0[k].1 < lo)
    }
}

/// Fill: a `W` of rank `r` after the batch at `i`, whose `B` is before the batch,
/// to just before the batch: `(rank, from, to)`. `first` is [`FirstBs::of`] the
/// rank's list; a `W` fits within `fit` times `wait` ([`closest_w`]).
fn fill_move(
    lowered: &Lowered,
    r: usize,
    i: usize,
    (wait, fit): (f64, f64),
    first: &FirstBs,
    cost: &dyn Fn(&Step) -> f64,
) -> Option<(usize, usize, usize)> {
    let list = &lowered.programs[r];
    let (lo, hi) = batch_bounds(list, i);
    let b_before = |j: usize| match list[j] {
        Step::Compute { unit, mb, .. } => first.before((unit, mb), lo),
        _ => false,
    };
    let j = closest_w(list, hi + 1..list.len(), wait, fit, &b_before, cost)?;
    Some((r, j, lo))
}

/// Every wait of rank `r` filled at once: each transfer (or batch) it waited in, in
/// its order, takes `W`s from later on the rank whose `B` came before it, largest
/// first while their total stays within the wait (the time blocked less the
/// transfer's own). On its own such a fill delays nothing (the rank still arrives
/// no later than its partner did) and leaves the rank less to do; all at once, a
/// partner that now arrives earlier (the rank sends sooner) can make a filled wait
/// too short, so the caller simulates the result (on qwen2vl-7b's rendezvous
/// program, all ranks at once made the step longer, one at a time shorter).
/// Returns rank `r`'s new list; `None` when nothing moves.
fn fill_rank(
    lowered: &Lowered,
    report: &SimReport,
    lengths: &Lengths<'_>,
    r: usize,
) -> Option<Vec<Step>> {
    let list = lowered.programs.get(r)?;
    let slots = report.timeline.ranks.get(r)?;
    // The indices of each (unit, micro-batch)'s `W`s on the rank.
    let mut w_at: std::collections::HashMap<(u32, u32), Vec<usize>> = Default::default();
    for (j, a) in list.iter().enumerate() {
        if let Step::Compute {
            op: Op::W,
            unit,
            mb,
        } = *a
        {
            w_at.entry((unit, mb)).or_default().push(j);
        }
    }
    // The `W`s whose `B` has been seen (each `B` adds its `W`s once), by index: a
    // transfer's candidates are those of them after it.
    let mut pending: std::collections::BTreeSet<usize> = Default::default();
    let mut used = vec![false; list.len()];
    // (index of the batch's first step, the W indices put before it)
    let mut fills: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut i = 0;
    while i < list.len() {
        match list[i] {
            Step::Compute { op, unit, mb } => {
                if op == Op::B {
                    if let Some(ws) = w_at.remove(&(unit, mb)) {
                        pending.extend(ws);
                    }
                }
                i += 1;
            }
            Step::P2p { .. } => {
                let (lo, hi) = batch_bounds(list, i);
                let own = list[lo..=hi]
                    .iter()
                    .map(|a| lengths.transfer(a))
                    .fold(0.0, f64::max);
                let mut left = slots[lo].end - slots[lo].start - own;
                // Those at or before the batch are never candidates again.
                pending = pending.split_off(&(hi + 1));
                let mut ws: Vec<(f64, usize)> = pending
                    .iter()
                    .filter(|&&j| !used[j])
                    .map(|&j| (lengths.compute(&list[j]), j))
                    .collect();
                ws.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut taken = Vec::new();
                for (c, j) in ws {
                    if c > 0.0 && c <= left {
                        left -= c;
                        used[j] = true;
                        taken.push(j);
                    }
                }
                if !taken.is_empty() {
                    taken.sort_unstable();
                    fills.push((lo, taken));
                }
                i = hi + 1;
            }
            Step::Coll(_) => i += 1,
        }
    }
    if fills.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(list.len());
    let mut f = fills.iter().peekable();
    for (k, a) in list.iter().enumerate() {
        if let Some((_, taken)) = f.next_if(|(lo, _)| *lo == k) {
            out.extend(taken.iter().map(|&j| list[j]));
        }
        if !used[k] {
            out.push(*a);
        }
    }
    Some(out)
}

/// Make way: the partner of the transfer at `lowered.programs[r][i]`, if it arrived
/// later than `r`, moves a `W` it runs before the transfer (within the tasks since
/// its previous transfer) to just after the batch: `(rank, from, to)`.
fn make_way_move(
    lowered: &Lowered,
    report: &SimReport,
    r: usize,
    i: usize,
    fit: f64,
    cost: &dyn Fn(&Step) -> f64,
) -> Option<(usize, usize, usize)> {
    let Step::P2p {
        dir,
        tensor,
        unit,
        mb,
        peer,
        ..
    } = lowered.programs[r][i]
    else {
        return None;
    };
    let peer = peer as usize;
    let list = lowered.programs.get(peer)?;
    let k = list.iter().position(|a| {
        matches!(*a, Step::P2p { dir: d, tensor: t, unit: u, mb: m, peer: p, .. }
            if p as usize == r && d != dir && t == tensor && u == unit && m == mb)
    })?;
    let late = report.timeline.ranks[peer][k].start - report.timeline.ranks[r][i].start;
    if late <= 0.0 {
        return None;
    }
    let (lo, hi) = batch_bounds(list, k);
    let since = list[..lo]
        .iter()
        .rposition(|a| !matches!(a, Step::Compute { .. }))
        .map_or(0, |x| x + 1);
    let j = closest_w(list, since..lo, late, fit, &|_| true, cost)?;
    // After removing `j` (before the batch), the batch ends at `hi - 1`.
    Some((peer, j, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::lower::Collective;
    use crate::algebra::profile::Profile;
    use crate::ir::program::{Action, ActionRef, Program};
    use crate::judge::simulate::simulate;
    use crate::judge::verify::verify_static;
    use crate::search::derive::{derive_str, Request};

    /// A move's rank assembled alone ([`rank_steps`] in the plan's frame) is that
    /// rank's list in the whole lowering of the moved placement, for every move
    /// [`shift`] makes on a few plans and placements; a plan that prefetches has no
    /// rank assembled alone.
    #[test]
    fn a_moved_rank_assembled_alone_is_its_list_in_the_whole_lowering() {
        use crate::algebra::lower::{placement_at, prepare};
        use crate::ir::policy::SearchPolicy;
        use crate::search::place::PLACEMENTS;
        use crate::search::replan::derived_plan;
        let small = include_str!("../../../docs/guide/examples/small-mllm.toml");
        let heavy = include_str!("../../../profiles/encoder-heavy.toml");
        let plans = [
            derived_plan(small, (4, 8), "transpose(vision, 1f1b)"),
            derived_plan(heavy, (4, 6), "zb2p(v = 2)"),
            derived_plan(small, (3, 6), "interleaved(v = 2)"),
        ];
        let policy = SearchPolicy::DEFAULT;
        let mut moves = 0;
        for plan in &plans {
            let frame = Frame::of(plan);
            let prepared = prepare(plan).unwrap();
            for rule in PLACEMENTS {
                let mut at = placement_at(plan, &prepared, &prepared.time, rule, &policy).unwrap();
                let whole = assemble_lowered(plan, &at).unwrap();
                for (r, list) in whole.programs.iter().enumerate() {
                    assert_eq!(&rank_steps(plan, r, &at[r], &frame).unwrap().unwrap(), list);
                }
                for r in 0..at.len() {
                    for q in 0..at[r].len() {
                        for dir in [Move::Later, Move::Earlier] {
                            let Some(undo) = shift(&mut at, r, q, dir) else {
                                continue;
                            };
                            moves += 1;
                            let whole = assemble_lowered(plan, &at).unwrap();
                            let alone = rank_steps(plan, r, &at[r], &frame).unwrap().unwrap();
                            assert_eq!(alone, whole.programs[r], "{rule:?}, rank {r}, end {q}");
                            for (r, i, slot) in undo {
                                at[r][i].slot = slot;
                            }
                        }
                    }
                }
            }
        }
        assert!(moves > 100, "only {moves} moves tried");
        let mut prefetching = plans[0].clone();
        prefetching.prefetch = vec![(0, 0)];
        assert!(rank_steps(&prefetching, 0, &[], &Frame::of(&prefetching)).is_none());
    }

    /// `program` by unit index (its units looked up by name).
    fn lowered_of(program: &Program) -> Lowered {
        let index = |name: &str| {
            program
                .units
                .iter()
                .position(|u| u.name == name)
                .expect("a unit of the program") as u32
        };
        let mut colls = Vec::new();
        let programs = program
            .programs
            .iter()
            .map(|list| {
                list.iter()
                    .map(|a| match a.view() {
                        ActionRef::Compute(c) => Step::Compute {
                            op: c.op,
                            unit: index(c.unit),
                            mb: c.mb as u32,
                        },
                        ActionRef::P2p(p) => Step::P2p {
                            dir: p.dir,
                            tensor: p.tensor,
                            unit: index(p.unit),
                            mb: p.mb as u32,
                            peer: p.peer as u32,
                            batch: p.batch.and_then(Batch::new),
                        },
                        ActionRef::Coll(c) => {
                            colls.push(Collective {
                                kind: c.kind,
                                unit: index(c.unit) as usize,
                                root: c.root,
                                group: c.group.to_vec(),
                            });
                            Step::Coll(colls.len() as u32 - 1)
                        }
                    })
                    .collect()
            })
            .collect();
        Lowered {
            ranks: program.ranks,
            microbatches: program.microbatches,
            programs,
            colls,
            prefetch: program
                .prefetch
                .iter()
                .map(|p| (index(&p.unit) as usize, p.mb))
                .collect(),
        }
    }

    /// The compute actions of a rank, as text, with or without its `W`s.
    fn computes(list: &[Action], with_w: bool) -> Vec<String> {
        list.iter()
            .filter(|a| match a.view() {
                ActionRef::Compute(c) => with_w || c.op != Op::W,
                _ => false,
            })
            .map(|a| a.to_string())
            .collect()
    }

    /// Filling a rank's waits (Qwen2-VL-7B at 4 x 8 under rendezvous, the ramp layer
    /// by layer, before any refinement) moves only that rank's `W`s, only earlier,
    /// each still after its `B`, and leaves a valid program that runs; some rank
    /// has waits to fill, and a fill shortens the step there.
    #[test]
    fn filling_a_rank_moves_only_its_weight_gradients_earlier() {
        let text = include_str!("../../../profiles/qwen2vl-7b.toml");
        let profile = Profile::from_toml_str(text).unwrap();
        let req = Request::new(&profile, 4, 8);
        let derived = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
        let (program, report) = (derived.program, derived.report);
        let units = program.units.clone();
        let lowered = lowered_of(&program);
        assert_eq!(lowered.program(&units, None).programs, program.programs);
        let opts = req.sim_options(req.mode);
        let lengths = Lengths::of(&units, &opts);
        let (mut filled, mut shorter) = (0, 0);
        for r in 0..program.programs.len() {
            let Some(list) = fill_rank(&lowered, &report, &lengths, r) else {
                continue;
            };
            filled += 1;
            let mut next = lowered.clone();
            next.programs[r] = list;
            let next = next.program(&units, None);
            assert_eq!(verify_static(&next), vec![], "rank {r}");
            for (q, (old, new)) in program.programs.iter().zip(&next.programs).enumerate() {
                if q != r {
                    assert_eq!(old, new, "rank {q} changed filling rank {r}");
                    continue;
                }
                assert_eq!(computes(old, false), computes(new, false), "rank {r}");
                let mut a = computes(old, true);
                let mut b = computes(new, true);
                // Every W sits no later among the compute tasks than before.
                for (k, w) in b.iter().enumerate().filter(|(_, w)| w.starts_with("W ")) {
                    let was = a.iter().position(|x| x == w).unwrap();
                    assert!(k <= was, "rank {r}: {w} moved later ({was} -> {k})");
                }
                a.sort();
                b.sort();
                assert_eq!(a, b, "rank {r}: not the same tasks");
            }
            let rep = simulate(&next, &opts).unwrap();
            if crate::ir::compare::less(rep.makespan, report.makespan) {
                shorter += 1;
            }
        }
        assert!(
            filled > 0 && shorter > 0,
            "{filled} filled, {shorter} shorter"
        );
    }

    /// A fill looked up in a rank's first `B`s ([`FirstBs`], read once a round) is
    /// the one read from the `B`s before the wait's batch themselves: at every
    /// transfer of every rank, for waits short and long, on the program and on the
    /// program with `W`s moved (as `settle_w` moves them); and some fill is found.
    #[test]
    fn a_fill_from_the_first_backwards_is_the_fill_from_the_list() {
        let text = include_str!("../../../profiles/qwen2vl-7b.toml");
        let profile = Profile::from_toml_str(text).unwrap();
        let req = Request::new(&profile, 4, 8);
        let derived = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
        let units = derived.program.units.clone();
        let opts = req.sim_options(req.mode);
        let lengths = Lengths::of(&units, &opts);
        let cost = |a: &Step| lengths.compute(a);
        let fit = req.policy.w_fit;
        let base = lowered_of(&derived.program);
        // The program, and it with each rank's last `W` moved to the front of its
        // first half (before some transfers: `B`s and `W`s out of their order).
        let mut moved = base.clone();
        for list in &mut moved.programs {
            if let Some(j) = list.iter().rposition(is_w) {
                let w = list.remove(j);
                list.insert(list.len() / 2, w);
            }
        }
        let (mut compared, mut found) = (0, 0);
        for lowered in [&base, &moved] {
            for (r, list) in lowered.programs.iter().enumerate() {
                let first = FirstBs::of(list);
                for i in (0..list.len()).filter(|&i| matches!(list[i], Step::P2p { .. })) {
                    let (lo, hi) = batch_bounds(list, i);
                    let before: std::collections::HashSet<(u32, u32)> = list[..lo]
                        .iter()
                        .filter_map(|a| match *a {
                            Step::Compute {
                                op: Op::B,
                                unit,
                                mb,
                            } => Some((unit, mb)),
                            _ => None,
                        })
                        .collect();
                    let ok = |j: usize| match list[j] {
                        Step::Compute { unit, mb, .. } => before.contains(&(unit, mb)),
                        _ => false,
                    };
                    for wait in [0.1, 0.5, 1.0, 2.0, 8.0, 1e9] {
                        let full = closest_w(list, hi + 1..list.len(), wait, fit, &ok, &cost)
                            .map(|j| (r, j, lo));
                        let read = fill_move(lowered, r, i, (wait, fit), &first, &cost);
                        assert_eq!(read, full, "rank {r}, transfer {i}, wait {wait}");
                        compared += 1;
                        found += usize::from(full.is_some());
                    }
                }
            }
        }
        assert!(
            compared > 100 && found > 10,
            "{compared} compared, {found} found"
        );
    }

    /// A trial's score from its finishing times is the score of its full report.
    #[test]
    fn a_score_from_finishing_times_is_the_reports() {
        let text = include_str!("../../../profiles/qwen2vl-7b.toml");
        let profile = Profile::from_toml_str(text).unwrap();
        let req = Request::new(&profile, 4, 8);
        let derived = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
        let lowered = lowered_of(&derived.program);
        let opts = req.sim_options(req.mode);
        let units = &derived.program.units;
        let rep = simulate_lowered(units, &lowered, &opts).unwrap();
        assert_eq!(rep, derived.report);
        let score = score_of(units, &lowered, &opts, f64::INFINITY, None).unwrap();
        assert_eq!(score, timed(&rep));
    }

    /// A trial of the moves here (a step of the lowering moved a few places on its
    /// rank: a transfer or a weight gradient, as `refine` and `settle_w` move
    /// them) scores the same simulated from its base's run as simulated whole,
    /// for every such move of one rank's first steps.
    #[test]
    fn a_trial_simulated_from_its_bases_run_scores_the_same() {
        let text = include_str!("../../../profiles/qwen2vl-7b.toml");
        let profile = Profile::from_toml_str(text).unwrap();
        let req = Request::new(&profile, 4, 8);
        let derived = derive_str(&req, "layers(zb2p(encoders = ramp, costs = unit))").unwrap();
        let base = lowered_of(&derived.program);
        let opts = req.sim_options(req.mode);
        let units = &derived.program.units;
        let run = Resumable::new(base.clone(), &derived.report.timeline).unwrap();
        let mut compared = 0;
        for r in 0..base.programs.len() {
            let n = base.programs[r].len();
            for from in (0..n).step_by(7) {
                for to in [from.saturating_sub(2), (from + 3).min(n - 1)] {
                    let mut next = base.clone();
                    let step = next.programs[r].remove(from);
                    next.programs[r].insert(to, step);
                    for cutoff in [f64::INFINITY, derived.report.makespan] {
                        let whole = score_of(units, &next, &opts, cutoff, None);
                        let resumed = score_of(units, &next, &opts, cutoff, Some(&run));
                        match (whole, resumed) {
                            (Some(a), Some(b)) => {
                                assert_eq!(a.makespan.to_bits(), b.makespan.to_bits());
                                assert_eq!(a.ends.to_bits(), b.ends.to_bits());
                                compared += 1;
                            }
                            (None, None) => {}
                            // Cut short on one side only: the other ends later.
                            (Some(a), None) | (None, Some(a)) => assert!(
                                cutoff.is_finite() && crate::ir::compare::less(cutoff, a.makespan)
                            ),
                        }
                    }
                }
            }
        }
        assert!(compared > 20, "{compared}");
    }
}
