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
//! [`crate::lower`] depends only on that order, so every refined program terminates
//! under rendezvous, like the one it came from.

use crate::lower::{assemble, Placed};
use crate::plan::Plan;
use crate::program::{Action, ActionRef, P2pRef, Program};
use crate::simulate::{simulate, SimOptions, SimReport};

/// Improve `at` (a placement of `plan`'s transfers) for `opts` with at most `budget`
/// simulations; returns the best program found and its report. `start` is `at`'s
/// program and report.
pub(crate) fn refine(
    plan: &Plan,
    mut at: Vec<Vec<Placed>>,
    start: (Program, SimReport),
    expr: Option<&str>,
    opts: &SimOptions,
    budget: usize,
) -> (Program, SimReport) {
    let (mut program, mut report) = start;
    let mut spent = 0;
    let score = |r: &SimReport| (r.makespan, ends(r));
    let mut best = score(&report);
    while spent < budget {
        let waits = waits(&program, &report, &at);
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
                let candidate = assemble(plan, &at, expr);
                let kept = simulate(&candidate, opts).ok().filter(|rep| {
                    let sc = score(rep);
                    sc.0 < best.0 || (sc.0 == best.0 && sc.1 < best.1)
                });
                match kept {
                    Some(rep) => {
                        best = score(&rep);
                        program = candidate;
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
    (program, report)
}

#[derive(Clone, Copy)]
enum Move {
    Later,
    Earlier,
}

/// Sum of the ranks' finishing times: progress where the makespan does not move.
pub(crate) fn ends(r: &SimReport) -> f64 {
    r.timeline
        .ranks
        .iter()
        .map(|l| l.last().map_or(0.0, |s| s.end))
        .sum()
}

/// Every placed end `(rank, index in at[rank])` at which its rank waited, the
/// longest wait first (ties by rank and index, so the order is deterministic).
fn waits(program: &Program, report: &SimReport, at: &[Vec<Placed>]) -> Vec<(usize, usize)> {
    let mut out: Vec<(f64, usize, usize)> = Vec::new();
    for (r, list) in program.programs.iter().enumerate() {
        let Some(slots) = report.timeline.ranks.get(r) else {
            continue;
        };
        // Walk the list and the placement together: the k-th point-to-point action
        // of the rank's list is some end of at[r] (the prefetch transfers, at the
        // end, are not placed and not moved).
        let mut compute = 0usize;
        for (a, s) in list.iter().zip(slots) {
            match a.view() {
                ActionRef::Compute(_) => compute += 1,
                ActionRef::P2p(_) => {
                    // The end of this action: same slot (compute count) and action.
                    let from = at[r].partition_point(|x| x.slot < compute);
                    let here = at[r][from..]
                        .iter()
                        .take_while(|x| x.slot == compute)
                        .position(|x| same(&x.action, a))
                        .map(|i| from + i);
                    if let Some(q) = here {
                        let wait = s.end - s.start;
                        if wait > 0.0 {
                            out.push((wait, r, q));
                        }
                    }
                }
                ActionRef::Coll(_) => {}
            }
        }
    }
    out.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    out.into_iter().map(|(_, r, q)| (r, q)).collect()
}

/// Whether `a` (placed, no batch) and `b` (in a program, maybe batched) are the same
/// transfer end.
fn same(a: &Action, b: &Action) -> bool {
    match (a.view(), b.view()) {
        (ActionRef::P2p(x), ActionRef::P2p(y)) => {
            P2pRef { batch: None, ..x } == P2pRef { batch: None, ..y }
        }
        _ => false,
    }
}

/// The other end of the transfer placed at `at[r][q]`.
fn other_end(at: &[Vec<Placed>], r: usize, q: usize) -> Option<(usize, usize)> {
    let id = at[r][q].id;
    let peer = match &at[r][q].action {
        Action::SEND { peer, .. } | Action::RECV { peer, .. } => *peer,
        _ => return None,
    };
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
) -> Option<Vec<(usize, usize, usize)>> {
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
/// Of the `W`s that fit (at most twice the wait), the one closest to the wait is
/// tried. A move is kept when the makespan (then the sum of the ranks' finishing
/// times) goes down and every rank stays within `fits` (the memory limit: a `W`
/// moved later holds its activation longer). Transfers keep their order on every
/// rank, so the deadlock-freedom argument of [`crate::lower`] still holds.
pub(crate) fn settle_w(
    start: (Program, SimReport),
    opts: &SimOptions,
    fits: &dyn Fn(&SimReport) -> bool,
    budget: usize,
) -> (Program, SimReport) {
    let (mut program, mut report) = start;
    let score = |r: &SimReport| (r.makespan, ends(r));
    let mut best = score(&report);
    let mut spent = 0;
    // Moves never change the units: their costs, looked up by name once.
    let costs: std::collections::BTreeMap<String, crate::program::Cost> = program
        .units
        .iter()
        .map(|u| (u.name.clone(), u.cost))
        .collect();
    let cost = |a: &Action| match a.view() {
        ActionRef::Compute(c) => costs.get(c.unit).map_or(0.0, |x| c.op.cost(x)),
        _ => 0.0,
    };
    while spent < budget {
        let mut improved = false;
        let mut tried = 0;
        for (wait, r, i) in transfer_waits(&program, &report) {
            if tried >= MOVES_PER_ROUND || spent >= budget {
                break;
            }
            let candidates = [
                fill_move(&program, r, i, wait, &cost),
                make_way_move(&program, &report, r, i, &cost),
            ];
            for (rank, from, to) in candidates.into_iter().flatten() {
                if spent >= budget {
                    break;
                }
                tried += 1;
                spent += 1;
                let mut next = program.clone();
                let w = next.programs[rank].remove(from);
                next.programs[rank].insert(to, w);
                let kept = simulate(&next, opts).ok().filter(|rep| {
                    let sc = score(rep);
                    (sc.0 < best.0 || (sc.0 == best.0 && sc.1 < best.1)) && fits(rep)
                });
                if let Some(rep) = kept {
                    best = score(&rep);
                    program = next;
                    report = rep;
                    improved = true;
                    break;
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
    (program, report)
}

/// Candidate moves tried per round before `settle_w` gives up.
const MOVES_PER_ROUND: usize = 800;

/// Every point-to-point action a rank spent time in, `(time, rank, index)`, the
/// longest first (ties by rank and index).
fn transfer_waits(program: &Program, report: &SimReport) -> Vec<(f64, usize, usize)> {
    let mut out = Vec::new();
    for (r, list) in program.programs.iter().enumerate() {
        let Some(slots) = report.timeline.ranks.get(r) else {
            continue;
        };
        for (i, (a, s)) in list.iter().zip(slots).enumerate() {
            if matches!(a.view(), ActionRef::P2p(_)) && s.end > s.start {
                out.push((s.end - s.start, r, i));
            }
        }
    }
    out.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    out
}

/// The first and last index of the batch (or single transfer) at `list[i]`.
fn batch_bounds(list: &[Action], i: usize) -> (usize, usize) {
    let batch = |a: &Action| match a {
        Action::SEND { batch, .. } | Action::RECV { batch, .. } => *batch,
        _ => None,
    };
    let Some(b) = batch(&list[i]) else {
        return (i, i);
    };
    let mut lo = i;
    while lo > 0 && batch(&list[lo - 1]) == Some(b) {
        lo -= 1;
    }
    let mut hi = i;
    while hi + 1 < list.len() && batch(&list[hi + 1]) == Some(b) {
        hi += 1;
    }
    (lo, hi)
}

/// Of the `W`s in `range` of `list` whose cost is at most twice `wait`, the one
/// closest to `wait` (the earliest on ties) that `ok` accepts.
fn closest_w(
    list: &[Action],
    range: std::ops::Range<usize>,
    wait: f64,
    ok: &dyn Fn(usize) -> bool,
    cost: &dyn Fn(&Action) -> f64,
) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for j in range {
        let is_w = matches!(list[j].view(), ActionRef::Compute(c) if c.op == crate::program::Op::W);
        if !is_w {
            continue;
        }
        let c = cost(&list[j]);
        if c > 2.0 * wait || !ok(j) {
            continue;
        }
        let gap = (c - wait).abs();
        if best.is_none_or(|(g, _)| gap < g) {
            best = Some((gap, j));
        }
    }
    best.map(|(_, j)| j)
}

/// Fill: a `W` of rank `r` after the batch at `i`, whose `B` is before the batch,
/// to just before the batch: `(rank, from, to)`.
fn fill_move(
    program: &Program,
    r: usize,
    i: usize,
    wait: f64,
    cost: &dyn Fn(&Action) -> f64,
) -> Option<(usize, usize, usize)> {
    let list = &program.programs[r];
    let (lo, hi) = batch_bounds(list, i);
    let b_before = |j: usize| {
        let ActionRef::Compute(w) = list[j].view() else {
            return false;
        };
        list[..lo].iter().any(|a| {
            matches!(a.view(), ActionRef::Compute(b) if b.op == crate::program::Op::B && b.unit == w.unit && b.mb == w.mb)
        })
    };
    let j = closest_w(list, hi + 1..list.len(), wait, &b_before, cost)?;
    Some((r, j, lo))
}

/// Make way: the partner of the transfer at `program.programs[r][i]`, if it arrived
/// later than `r`, moves a `W` it runs before the transfer (within the tasks since
/// its previous transfer) to just after the batch: `(rank, from, to)`.
fn make_way_move(
    program: &Program,
    report: &SimReport,
    r: usize,
    i: usize,
    cost: &dyn Fn(&Action) -> f64,
) -> Option<(usize, usize, usize)> {
    let ActionRef::P2p(me) = program.programs[r][i].view() else {
        return None;
    };
    let list = program.programs.get(me.peer)?;
    let k = list.iter().position(|a| {
        matches!(a.view(), ActionRef::P2p(x) if x.peer == r && x.dir != me.dir
            && x.tensor == me.tensor && x.unit == me.unit && x.mb == me.mb)
    })?;
    let late = report.timeline.ranks[me.peer][k].start - report.timeline.ranks[r][i].start;
    if late <= 0.0 {
        return None;
    }
    let (lo, hi) = batch_bounds(list, k);
    let since = list[..lo]
        .iter()
        .rposition(|a| !matches!(a.view(), ActionRef::Compute(_)))
        .map_or(0, |x| x + 1);
    let j = closest_w(list, since..lo, late, &|_| true, cost)?;
    // After removing `j` (before the batch), the batch ends at `hi - 1`.
    Some((me.peer, j, hi))
}
