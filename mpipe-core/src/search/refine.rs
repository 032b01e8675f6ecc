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

use crate::algebra::lower::{assemble, Placed};
use crate::ir::compare::Score;
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{Action, ActionRef, P2pRef, Program};
use crate::judge::compare::timed;
use crate::judge::simulate::{simulate, SimOptions, SimReport};

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
    let mut best = timed(&report);
    while spent < budget {
        let waits = waits(plan, &program, &report, &at);
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
                let kept = simulate(&candidate, opts)
                    .ok()
                    .filter(|rep| timed(rep).improves(&best));
                match kept {
                    Some(rep) => {
                        best = timed(&rep);
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

/// Every placed end `(rank, index in at[rank])` at which its rank waited, the
/// longest wait first (ties by rank and index, so the order is deterministic).
fn waits(
    plan: &Plan,
    program: &Program,
    report: &SimReport,
    at: &[Vec<Placed>],
) -> Vec<(usize, usize)> {
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
                ActionRef::P2p(p) => {
                    // The end of this action: same slot (compute count) and action.
                    let from = at[r].partition_point(|x| x.slot < compute);
                    let here = at[r][from..]
                        .iter()
                        .take_while(|x| x.slot == compute)
                        .position(|x| same(plan, x, &p))
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

/// Whether `x` (placed, no batch) and `p` (in a program, maybe batched) are the same
/// transfer end.
fn same(plan: &Plan, x: &Placed, p: &P2pRef<'_>) -> bool {
    x.dir == p.dir
        && x.tensor == p.tensor
        && x.mb as usize == p.mb
        && x.peer as usize == p.peer
        && plan
            .units
            .get(x.unit as usize)
            .is_some_and(|u| u.name == p.unit)
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
/// First, rank by rank, every wait of the rank is filled at once with as many `W`s
/// as fit in it ([`fill_rank`]); while that helps, the ranks are filled again (a
/// simulation per rank and round). Then wait by wait, the longest first: of the
/// `W`s that fit (at most twice the wait), the one closest to the wait is
/// tried. A move is kept when the makespan (then the sum of the ranks' finishing
/// times) goes down and every rank stays within `fits` (the memory limit: a `W`
/// moved later holds its activation longer). Transfers keep their order on every
/// rank, so the deadlock-freedom argument of [`crate::algebra::lower`] still holds.
pub(crate) fn settle_w(
    start: (Program, SimReport),
    opts: &SimOptions,
    fits: &dyn Fn(&SimReport) -> bool,
    budget: usize,
    policy: &SearchPolicy,
) -> (Program, SimReport) {
    let (moves_per_round, fit) = (policy.w_moves_per_round, policy.w_fit);
    let (mut program, mut report) = start;
    let mut best = timed(&report);
    let mut spent = 0;
    let lengths = Lengths::of(&program, opts);
    let cost = |a: &Action| lengths.compute(a);
    // A candidate's report when it beats `best` and fits.
    let accept = |next: &Program, best: Score| {
        simulate(next, opts)
            .ok()
            .filter(|rep| timed(rep).improves(&best) && fits(rep))
    };
    // First the waits of one rank at a time, each all at once, while that helps:
    // one simulation a try.
    loop {
        let mut improved = false;
        for r in 0..program.programs.len() {
            if spent >= budget {
                break;
            }
            let Some(next) = fill_rank(&program, &report, &lengths, r) else {
                continue;
            };
            spent += 1;
            if let Some(rep) = accept(&next, best) {
                best = timed(&rep);
                program = next;
                report = rep;
                improved = true;
            }
        }
        if !improved || spent >= budget {
            break;
        }
    }
    while spent < budget {
        let mut improved = false;
        let mut tried = 0;
        for (wait, r, i) in transfer_waits(&program, &report) {
            if tried >= moves_per_round || spent >= budget {
                break;
            }
            let candidates = [
                fill_move(&program, r, i, wait, fit, &cost),
                make_way_move(&program, &report, r, i, fit, &cost),
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
                if let Some(rep) = accept(&next, best) {
                    best = timed(&rep);
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

/// How long a program's actions take: a compute action its unit's cost, a
/// point-to-point action its transfer under the link model (0 without one).
struct Lengths {
    costs: std::collections::BTreeMap<String, crate::ir::program::Cost>,
    bytes: std::collections::BTreeMap<String, f64>,
    comm: Option<crate::judge::simulate::CommModel>,
}

impl Lengths {
    /// Moves never change the units, so their figures are looked up by name once.
    fn of(program: &Program, opts: &SimOptions) -> Lengths {
        Lengths {
            costs: program
                .units
                .iter()
                .map(|u| (u.name.clone(), u.cost))
                .collect(),
            bytes: program
                .units
                .iter()
                .map(|u| (u.name.clone(), u.bytes))
                .collect(),
            comm: opts.comm,
        }
    }

    fn compute(&self, a: &Action) -> f64 {
        match a.view() {
            ActionRef::Compute(c) => self.costs.get(c.unit).map_or(0.0, |x| c.op.cost(x)),
            _ => 0.0,
        }
    }

    fn transfer(&self, a: &Action) -> f64 {
        match (a.view(), self.comm) {
            (ActionRef::P2p(x), Some(c)) => {
                c.transfer_time(self.bytes.get(x.unit).copied().unwrap_or(0.0))
            }
            _ => 0.0,
        }
    }
}

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

/// Of the `W`s in `range` of `list` whose cost is at most `fit` times `wait`
/// ([`SearchPolicy::w_fit`]), the one closest to `wait` (the earliest on ties) that
/// `ok` accepts.
fn closest_w(
    list: &[Action],
    range: std::ops::Range<usize>,
    wait: f64,
    fit: f64,
    ok: &dyn Fn(usize) -> bool,
    cost: &dyn Fn(&Action) -> f64,
) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for j in range {
        let is_w =
            matches!(list[j].view(), ActionRef::Compute(c) if c.op == crate::ir::program::Op::W);
        if !is_w {
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

/// Fill: a `W` of rank `r` after the batch at `i`, whose `B` is before the batch,
/// to just before the batch: `(rank, from, to)`.
fn fill_move(
    program: &Program,
    r: usize,
    i: usize,
    wait: f64,
    fit: f64,
    cost: &dyn Fn(&Action) -> f64,
) -> Option<(usize, usize, usize)> {
    let list = &program.programs[r];
    let (lo, hi) = batch_bounds(list, i);
    let b_before = |j: usize| {
        let ActionRef::Compute(w) = list[j].view() else {
            return false;
        };
        list[..lo].iter().any(|a| {
            matches!(a.view(), ActionRef::Compute(b) if b.op == crate::ir::program::Op::B && b.unit == w.unit && b.mb == w.mb)
        })
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
/// `None` when nothing moves.
fn fill_rank(
    program: &Program,
    report: &SimReport,
    lengths: &Lengths,
    r: usize,
) -> Option<Program> {
    let list = program.programs.get(r)?;
    let slots = report.timeline.ranks.get(r)?;
    let mut backward: std::collections::BTreeSet<(&str, usize)> = Default::default();
    let mut used = vec![false; list.len()];
    // (index of the batch's first action, the W indices put before it)
    let mut fills: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut i = 0;
    while i < list.len() {
        match list[i].view() {
            ActionRef::Compute(c) => {
                if c.op == crate::ir::program::Op::B {
                    backward.insert((c.unit, c.mb));
                }
                i += 1;
            }
            ActionRef::P2p(_) => {
                let (lo, hi) = batch_bounds(list, i);
                let own = list[lo..=hi]
                    .iter()
                    .map(|a| lengths.transfer(a))
                    .fold(0.0, f64::max);
                let mut left = slots[lo].end - slots[lo].start - own;
                let mut ws: Vec<(f64, usize)> = (hi + 1..list.len())
                    .filter(|&j| {
                        !used[j]
                            && matches!(list[j].view(), ActionRef::Compute(w)
                                if w.op == crate::ir::program::Op::W
                                    && backward.contains(&(w.unit, w.mb)))
                    })
                    .map(|j| (lengths.compute(&list[j]), j))
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
            _ => i += 1,
        }
    }
    if fills.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(list.len());
    let mut f = fills.iter().peekable();
    for (k, a) in list.iter().enumerate() {
        if let Some((_, taken)) = f.next_if(|(lo, _)| *lo == k) {
            out.extend(taken.iter().map(|&j| list[j].clone()));
        }
        if !used[k] {
            out.push(a.clone());
        }
    }
    let mut next = program.clone();
    next.programs[r] = out;
    Some(next)
}

/// Make way: the partner of the transfer at `program.programs[r][i]`, if it arrived
/// later than `r`, moves a `W` it runs before the transfer (within the tasks since
/// its previous transfer) to just after the batch: `(rank, from, to)`.
fn make_way_move(
    program: &Program,
    report: &SimReport,
    r: usize,
    i: usize,
    fit: f64,
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
    let j = closest_w(list, since..lo, late, fit, &|_| true, cost)?;
    // After removing `j` (before the batch), the batch ends at `hi - 1`.
    Some((me.peer, j, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::profile::Profile;
    use crate::judge::verify::verify_static;
    use crate::search::derive::{derive_str, Request};

    /// The compute actions of a rank, as text, with or without its `W`s.
    fn computes(list: &[Action], with_w: bool) -> Vec<String> {
        list.iter()
            .filter(|a| match a.view() {
                ActionRef::Compute(c) => with_w || c.op != crate::ir::program::Op::W,
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
        let opts = req.sim_options(req.mode);
        let lengths = Lengths::of(&program, &opts);
        let (mut filled, mut shorter) = (0, 0);
        for r in 0..program.programs.len() {
            let Some(next) = fill_rank(&program, &report, &lengths, r) else {
                continue;
            };
            filled += 1;
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
}
