//! Resuming a simulation: the finishing times of a lowering that differs from one
//! already simulated only past some point of each rank's list, computed from that
//! run's times with only what differs simulated.
//!
//! A search's trial (a task moved, then the plan lowered again) keeps most of
//! its base's program: on each rank the steps before the first that differs are
//! the same. Those steps run at the same times as in the base exactly when
//! nothing they wait for differs, so the trial is simulated from there:
//!
//! 1. on each rank `r`, the common prefix `p[r]`: the steps before the first that
//!    differs from the base's (cut back to the start of a batch it ends inside);
//! 2. the valid prefix `v[r] <= p[r]`: cut back further, to the start of the
//!    first operation that waits (in the base's run) for a step at or past
//!    `v[q]` on some rank `q`: a transfer's partner, or a collective's occurrence
//!    on another member of its group; until no cut moves (a fixed point). An
//!    operation of a valid prefix waits for the same steps in the trial (the
//!    `k`-th `SEND` of a channel and key pairs with the `k`-th `RECV`, the
//!    `k`-th occurrence of a collective on a rank with the `k`-th on every other
//!    member, and the ranks' lists agree up to all of them), and by induction
//!    over the base's run every operation of the valid prefixes reaches and
//!    completes at the base's times;
//! 3. the transfers past the valid prefixes pair among themselves only (the
//!    pairing is one to one, and the prefixes' transfers are paired with each
//!    other), the `k`-th of a channel and key past the prefix with the `k`-th
//!    past the peer's; a collective past the prefix waits for its occurrences on
//!    the other members, past their prefixes or in them (reached there at the
//!    base's times, the end of the step before); from each rank's time at the
//!    end of its valid prefix, the rest runs as [`crate::judge::simulate`]'s
//!    engine runs it: compute back to back, a transfer (or batch, or collective)
//!    reached when its rank gets there and complete once its partners are
//!    reached (under eager semantics a `SEND` does not wait), at the same
//!    expressions of the same numbers.
//!
//! The answer is [`finish_times_within`]'s: the same finishing times, bit for bit,
//! when that runs to the end, and `None` only for a program that provably
//! finishes later than the cutoff (a rank's time plus its compute left, checked
//! after every operation past the prefix). Whatever this does not handle is
//! handed to [`finish_times_within`] whole: a trial whose collectives
//! ([`Lowered::colls`]) are not its base's (resumed, with a collective step that
//! differs cutting the common prefix, such trials of `auto` took longer than the
//! engine's runs of them), a collective on a unit or rank that does not exist, a
//! different number of ranks, a step naming no unit, rank or collective, a
//! transfer with no partner, a run that does not end (deadlock) or a time that
//! is not finite, so every error is the engine's own.

use crate::algebra::lower::{Collective, Lowered, Step};
use crate::ir::compare::less;
use crate::ir::model::{Mode, SimOptions};
use crate::ir::program::{Dir, Op, Unit};
use crate::judge::coll_ids::CollIds;
use crate::judge::simulate::{
    finish_times_within, joins_batch, op_index, tensor_index, transfer_times, unit_costs, SimError,
};
use crate::judge::timeline::Timeline;

/// No partner (in a per-action table).
const NONE: u32 = u32::MAX;

/// A lowering with its simulated run, kept to resume trials from
/// ([`Resumable::finish_times`]).
pub(crate) struct Resumable {
    lowered: Lowered,
    /// Per rank, per step: when it ended, as the engine's timeline has it.
    end: Vec<Vec<f64>>,
    /// Per rank `r`, per peer `q` it has transfers or collectives with: one entry
    /// `(i, m)` per step `i` of `r` that waits for a step of `q` (a transfer's
    /// partner, a collective's occurrence), in step order, `m` one more than the
    /// largest index on `q` that any of `r`'s steps up to `i` waits for (so both
    /// rise): the first operation of `r` that waits for a step past some point of
    /// `q` is found by a binary search. One entry a dependency, not one a step: a
    /// rank in a collective of every rank has every rank as a peer.
    reach: Vec<Vec<(usize, Vec<Waits>)>>,
    /// The collectives' identities and the base's occurrences of each.
    colls: Colls,
}

/// `(i, m)` of [`Resumable::reach`]: step `i` of a rank waits for a step of a peer,
/// and the rank's steps up to `i` wait for none past index `m - 1` there.
type Waits = (u32, u32);

/// The collectives of a lowering as the engine matches them: by identity (kind,
/// unit, root, distinct members), the `k`-th occurrence of one on a rank with the
/// `k`-th on every other member of its group.
struct Colls {
    /// Per entry of [`Lowered::colls`], its identity's index.
    id: Vec<u32>,
    /// Per identity: its unit and its distinct members, ascending.
    ids: Vec<(usize, Vec<u32>)>,
    /// Per identity, per rank: the indices of its occurrences in the base's lists.
    occ: Vec<Vec<Vec<u32>>>,
}

impl Colls {
    /// The identities of `colls` ([`CollIds`], the engine's) and their
    /// occurrences in `lists`; `None` for a collective step naming no entry of
    /// `colls`, or a unit or member past the engine's 32-bit indices.
    fn new(colls: &[Collective], lists: &[Vec<Step>]) -> Option<Colls> {
        // Each identity, as the engine keys it.
        let mut interned = CollIds::default();
        let mut id = Vec::with_capacity(colls.len());
        for c in colls {
            id.push(interned.intern(c.kind, u32::try_from(c.unit).ok()?, c.root, &c.group));
        }
        let ids: Vec<(usize, Vec<u32>)> = (interned.into_ids().into_iter())
            .map(|(_, unit, _, group)| {
                let group = group.into_iter().map(|g| u32::try_from(g).ok());
                Some((unit as usize, group.collect::<Option<_>>()?))
            })
            .collect::<Option<_>>()?;
        let mut occ = vec![vec![Vec::new(); lists.len()]; ids.len()];
        for (r, list) in lists.iter().enumerate() {
            for (i, step) in list.iter().enumerate() {
                if let Step::Coll(k) = *step {
                    occ[*id.get(k as usize)? as usize][r].push(i as u32);
                }
            }
        }
        Some(Colls { id, ids, occ })
    }
}

/// Whether step `i` of `list` joins the one before in a batch (the engine's
/// rule, [`joins_batch`]).
fn joins(list: &[Step], i: usize) -> bool {
    let batch = |s: &Step| match *s {
        Step::P2p { batch, .. } => batch,
        _ => None,
    };
    i > 0 && i < list.len() && joins_batch(batch(&list[i - 1]), batch(&list[i]))
}

/// A channel as one of its ranks sees it: the direction of its end there and
/// its peer, as one number.
fn link(dir: Dir, peer: u32) -> u64 {
    u64::from(peer) << 1 | u64::from(dir == Dir::Recv)
}

/// A transfer end past the prefixes, on one side of its channel: its key (unit,
/// micro-batch, tensor) and its index on its rank.
type End = ((u32, u32, u8), u32);

/// One channel's ends past the prefixes, each side in list order: its `SEND`s (on
/// its source rank) and its `RECV`s (on its destination).
#[derive(Default)]
struct Ends {
    ends: (u32, u32),
    sends: Vec<End>,
    recvs: Vec<End>,
}

/// Pair the transfers at or past `from[r]` of each rank `r` of `lists`: the
/// `k`-th `SEND` of a channel and key with its `k`-th `RECV`. Per rank, per step
/// past `from[r]`, the partner's index on its rank ([`NONE`] for a compute step);
/// `None` when a transfer has no partner, or a step names a rank that does not
/// exist.
///
/// The ends are gathered by channel (source, destination), each side in list
/// order; the sides are paired in order while their keys agree (linear: the valid
/// case), and what follows is sorted by key, then index, on each side, so the
/// `k`-th of a key on one pairs with the `k`-th on the other (a side with an end
/// the other does not match leaves a transfer with no partner).
fn pair(lists: &[Vec<Step>], from: &[usize]) -> Option<Vec<Vec<u32>>> {
    let ranks = lists.len();
    let mut chans: Vec<Ends> = Vec::new();
    // Per rank, the channels it holds an end of so far, ascending by [`link`]:
    // (link, channel). A rank has few: a binary search of them costs less than
    // hashing.
    let mut links: Vec<Vec<(u64, u32)>> = vec![Vec::new(); ranks];
    for (r, list) in lists.iter().enumerate() {
        // The channel of the end before, on this rank.
        let mut last: Option<((u32, u32), usize)> = None;
        for (i, step) in list.iter().enumerate().skip(from[r]) {
            let Step::P2p {
                dir,
                tensor,
                unit,
                mb,
                peer,
                ..
            } = *step
            else {
                continue;
            };
            if peer as usize >= ranks {
                return None;
            }
            let ends = dir.ends(r as u32, peer);
            let c = match last {
                Some((e, c)) if e == ends => c,
                _ => {
                    let key = link(dir, peer);
                    let c = match links[r].binary_search_by_key(&key, |l| l.0) {
                        Ok(at) => links[r][at].1,
                        Err(at) => {
                            // A new channel: known from both its ends from now on.
                            let c = chans.len() as u32;
                            chans.push(Ends {
                                ends,
                                ..Ends::default()
                            });
                            links[r].insert(at, (key, c));
                            let theirs = &mut links[peer as usize];
                            let back = link(dir.facing(), r as u32);
                            if let Err(at) = theirs.binary_search_by_key(&back, |l| l.0) {
                                theirs.insert(at, (back, c));
                            }
                            c
                        }
                    } as usize;
                    last = Some((ends, c));
                    c
                }
            };
            let end = ((unit, mb, tensor_index(tensor) as u8), i as u32);
            let Ends { sends, recvs, .. } = &mut chans[c];
            let (side, other) = match dir {
                Dir::Send => (sends, recvs),
                Dir::Recv => (recvs, sends),
            };
            // Only this rank adds to this side (its source's sends, its
            // destination's receives). Where the other side's rank came first, that
            // side is complete, and a valid program has as many ends on both: room
            // for them at this side's first end, so that it does not grow (and no
            // more than the other side holds, whatever the program).
            if side.capacity() == 0 {
                side.reserve_exact(other.len());
            }
            side.push(end);
        }
    }
    let mut partner: Vec<Vec<u32>> = lists
        .iter()
        .zip(from)
        .map(|(l, &f)| vec![NONE; l.len().saturating_sub(f)])
        .collect();
    for chan in &mut chans {
        let (a, b) = (chan.ends.0 as usize, chan.ends.1 as usize);
        let (fa, fb) = (from[a], from[b]);
        let mut set = |i: u32, j: u32| {
            partner[a][i as usize - fa] = j;
            partner[b][j as usize - fb] = i;
        };
        let (sends, recvs) = (&mut chan.sends, &mut chan.recvs);
        let n = sends.len().min(recvs.len());
        let mut k = 0;
        while k < n && sends[k].0 == recvs[k].0 {
            set(sends[k].1, recvs[k].1);
            k += 1;
        }
        if sends.len() != recvs.len() {
            return None;
        }
        if k < n {
            // The ends paired so far hold each key equally often on both sides,
            // so the rest still pair `k`-th with `k`-th.
            let (sends, recvs) = (&mut sends[k..], &mut recvs[k..]);
            sends.sort_unstable();
            recvs.sort_unstable();
            for (s, r) in sends.iter().zip(recvs.iter()) {
                if s.0 != r.0 {
                    return None;
                }
                set(s.1, r.1);
            }
        }
    }
    Some(partner)
}

/// The start of the operation step `i` of `list` belongs to (a batch's first
/// member).
fn op_start(list: &[Step], mut i: usize) -> usize {
    while joins(list, i) {
        i -= 1;
    }
    i
}

impl Resumable {
    /// `lowered` and its run's `timeline` (its report's, from
    /// [`crate::judge::simulate::simulate_lowered`]); `None` when they do not
    /// fit each other or the run cannot be resumed from (a transfer with no
    /// partner, a collective with no occurrence to meet): trials are then
    /// simulated whole.
    pub(crate) fn new(lowered: Lowered, timeline: &Timeline) -> Option<Resumable> {
        let fits = timeline.ranks.len() == lowered.programs.len()
            && timeline
                .ranks
                .iter()
                .zip(&lowered.programs)
                .all(|(t, l)| t.len() == l.len());
        if !fits {
            return None;
        }
        let partner = pair(&lowered.programs, &vec![0; lowered.programs.len()])?;
        let colls = Colls::new(&lowered.colls, &lowered.programs)?;
        let mut reach = Vec::with_capacity(lowered.programs.len());
        for (r, (list, partner)) in lowered.programs.iter().zip(&partner).enumerate() {
            let mut peers: Vec<(usize, Vec<Waits>)> = Vec::new();
            // Per identity, the rank's occurrences so far.
            let mut seen = vec![0usize; colls.ids.len()];
            for (i, step) in list.iter().enumerate() {
                let i = u32::try_from(i).ok()?;
                let mut depend = |q: usize, j: u32| {
                    let at = match peers.iter().position(|p| p.0 == q) {
                        Some(at) => at,
                        None => {
                            peers.push((q, Vec::new()));
                            peers.len() - 1
                        }
                    };
                    let entries = &mut peers[at].1;
                    let m = entries.last().map_or(0, |e| e.1).max(j + 1);
                    match entries.last_mut() {
                        Some(last) if last.0 == i => last.1 = m,
                        _ => entries.push((i, m)),
                    }
                };
                match *step {
                    Step::P2p { peer, .. } => depend(peer as usize, partner[i as usize]),
                    Step::Coll(k) => {
                        // The same occurrence on every other member.
                        let id = colls.id[k as usize] as usize;
                        let n = seen[id];
                        seen[id] += 1;
                        for &g in &colls.ids[id].1 {
                            if g as usize != r {
                                depend(g as usize, *colls.occ[id].get(g as usize)?.get(n)?);
                            }
                        }
                    }
                    Step::Compute { .. } => {}
                }
            }
            reach.push(peers);
        }
        let end = timeline
            .ranks
            .iter()
            .map(|t| t.iter().map(|s| s.end).collect())
            .collect();
        Some(Resumable {
            lowered,
            end,
            reach,
            colls,
        })
    }

    /// The lowering this run is of.
    #[cfg(test)]
    pub(crate) fn lowered(&self) -> &Lowered {
        &self.lowered
    }

    /// The share of `trial`'s steps that resuming from this run does not simulate
    /// again (its valid prefixes).
    #[cfg(test)]
    pub(crate) fn kept_share(&self, trial: &Lowered) -> f64 {
        let total: usize = trial.programs.iter().map(Vec::len).sum();
        self.valid_prefix(trial).iter().sum::<usize>() as f64 / total.max(1) as f64
    }

    /// [`finish_times_within`] of `trial` (`units` the plan's): see the module
    /// documentation.
    pub(crate) fn finish_times(
        &self,
        units: &[Unit],
        trial: &Lowered,
        opts: &SimOptions,
        cutoff: f64,
    ) -> Result<Option<Vec<f64>>, SimError> {
        match self.resume(units, trial, opts, cutoff) {
            Some(answer) => Ok(answer),
            None => finish_times_within(units, trial, opts, cutoff),
        }
    }

    /// The start of rank `r`'s first operation that waits (in the base's run) for
    /// a step at or past index `from` of the peer `reach` is of (an entry of
    /// [`Resumable::reach`]); `None` when none does.
    fn first_waiting(&self, r: usize, reach: &[Waits], from: usize) -> Option<usize> {
        let first = reach.partition_point(|e| e.1 as usize <= from);
        let &(i, _) = reach.get(first)?;
        Some(op_start(&self.lowered.programs[r], i as usize))
    }

    /// Each rank's valid prefix for `trial` (step 2 of the module documentation).
    ///
    /// The ranks' common prefixes are found in rank order, each scan stopping at
    /// the rank's first operation that waits for a step at or past a prefix found
    /// before (its valid prefix ends there at the latest, and the steps past it
    /// are not compared): the prefixes start the same fixed point lower, or where
    /// they do not, at the same point, so it ends where the full scans' would.
    fn valid_prefix(&self, trial: &Lowered) -> Vec<usize> {
        let base = &self.lowered.programs;
        let mut v: Vec<usize> = Vec::with_capacity(base.len());
        for (r, (b, t)) in base.iter().zip(&trial.programs).enumerate() {
            // The bound from the ranks before: an operation's start on `r`.
            let cap = (self.reach[r].iter())
                .filter(|(q, _)| *q < r)
                .filter_map(|(q, reach)| self.first_waiting(r, reach, v[*q]))
                .min();
            // Up to and including the step at the bound: whether the trial's step
            // there is the base's, so that the bound is an operation's start in
            // the trial too.
            let n = b.len().min(t.len());
            let n = cap.map_or(n, |c| n.min(c + 1));
            let p = b[..n]
                .iter()
                .zip(&t[..n])
                .take_while(|(x, y)| x == y)
                .count();
            v.push(match cap {
                Some(c) if p > c => c,
                // A batch that the common steps end inside (in either list) is not
                // common: back to its first member.
                _ if joins(b, p) || joins(t, p) => op_start(b, p - 1),
                _ => p,
            });
        }
        loop {
            let mut moved = false;
            for r in 0..v.len() {
                for (q, reach) in &self.reach[r] {
                    // The first operation before `v[r]` waiting for a step at or past
                    // `v[q]`, if any (both of an entry's numbers rise).
                    let within = reach.partition_point(|e| (e.0 as usize) < v[r]);
                    if within > 0 && reach[within - 1].1 > v[*q] as u32 {
                        let first = reach.partition_point(|e| e.1 <= v[*q] as u32);
                        v[r] = op_start(&base[r], reach[first].0 as usize);
                        moved = true;
                    }
                }
            }
            if !moved {
                return v;
            }
        }
    }

    /// The resumed run (steps 1-3), or `None` for what is handed to the engine.
    fn resume(
        &self,
        units: &[Unit],
        trial: &Lowered,
        opts: &SimOptions,
        cutoff: f64,
    ) -> Option<Option<Vec<f64>>> {
        let lists = &trial.programs;
        let nr = lists.len();
        let same_shape = trial.ranks == self.lowered.ranks
            && trial.microbatches == self.lowered.microbatches
            && trial.prefetch == self.lowered.prefetch;
        if nr != self.lowered.programs.len() || !same_shape {
            return None;
        }
        // The base's collectives (so that a step names the same one in both), on
        // units and ranks there are.
        let colls = &self.colls;
        let known = colls
            .ids
            .iter()
            .all(|(unit, group)| *unit < units.len() && group.iter().all(|&g| (g as usize) < nr));
        if trial.colls != self.lowered.colls || !known {
            return None;
        }
        let v = self.valid_prefix(trial);
        // The engine's tables: per unit, each op's cost and a transfer's time.
        let (costs, transfer) = (unit_costs(units), transfer_times(units, opts));
        let cost = |unit: u32, op: Op| costs[unit as usize][op_index(op)];
        let bounded = cutoff.is_finite();
        // Every step past the prefixes names a unit and a micro-batch (the
        // prefixes are the base's, which ran); and, against a finite cutoff,
        // each rank's compute left past its prefix, in list order.
        let mut named = true;
        let mut left: Vec<f64> = Vec::with_capacity(nr);
        for (l, &from) in lists.iter().zip(&v) {
            let steps = l[from..].iter().map(|s| match *s {
                Step::Compute { op, unit, mb } => {
                    let fits = (unit as usize) < units.len() && (mb as usize) < trial.microbatches;
                    named &= fits;
                    if fits && bounded {
                        cost(unit, op)
                    } else {
                        0.0
                    }
                }
                Step::P2p { unit, mb, .. } => {
                    named &= (unit as usize) < units.len() && (mb as usize) < trial.microbatches;
                    0.0
                }
                Step::Coll(k) => {
                    named &= (k as usize) < colls.id.len();
                    0.0
                }
            });
            left.push(steps.sum());
            if !named {
                return None;
            }
        }
        // Per identity and rank (at `id * nr + r`): the indices of its occurrences
        // past the prefix, and how many the prefix holds (the base's there).
        let mut past: Vec<Vec<u32>> = Vec::new();
        let mut before: Vec<usize> = Vec::new();
        if !colls.ids.is_empty() {
            past = vec![Vec::new(); colls.ids.len() * nr];
            for (r, list) in lists.iter().enumerate() {
                for (i, step) in list.iter().enumerate().skip(v[r]) {
                    if let Step::Coll(k) = *step {
                        past[colls.id[k as usize] as usize * nr + r].push(i as u32);
                    }
                }
            }
            before = (colls.occ.iter().flatten().enumerate())
                .map(|(at, occ)| occ.partition_point(|&j| (j as usize) < v[at % nr]))
                .collect();
        }
        // The time a collective's members take together, per identity.
        let together: Vec<Option<f64>> = (colls.ids.iter())
            .map(|(unit, _)| opts.comm.map(|c| c.transfer_time(units[*unit].params)))
            .collect();
        let partner = pair(lists, &v)?;
        let eager = opts.mode == Mode::Eager;
        // Each rank's position and time.
        let mut pc: Vec<usize> = v.clone();
        let mut now: Vec<f64> = (0..nr)
            .map(|r| v[r].checked_sub(1).map_or(0.0, |i| self.end[r][i]))
            .collect();
        // When each operation past the prefixes was reached (NaN: not yet), by
        // its first step's index past the prefix.
        let mut reach: Vec<Vec<f64>> = lists
            .iter()
            .zip(&v)
            .map(|(l, &from)| vec![f64::NAN; l.len() - from])
            .collect();
        let reached = |reach: &Vec<Vec<f64>>, q: usize, j: usize| -> f64 {
            let at = op_start(&lists[q], j);
            reach[q][at - v[q]]
        };
        let mut stack: Vec<usize> = (0..nr).rev().collect();
        while let Some(r) = stack.pop() {
            let list = &lists[r];
            let (mut i, mut t) = (pc[r], now[r]);
            while i < list.len() {
                if let Step::Compute { op, unit, .. } = list[i] {
                    let d = cost(unit, op);
                    t += d;
                    if bounded {
                        left[r] -= d;
                    }
                    i += 1;
                    continue;
                }
                if let Step::Coll(k) = list[i] {
                    let id = colls.id[k as usize] as usize;
                    let at = |g: usize| id * nr + g;
                    if reach[r][i - v[r]].is_nan() {
                        reach[r][i - v[r]] = t;
                        // Whoever lists it past the prefix may go on.
                        for g in (0..nr).filter(|&g| g != r && !past[at(g)].is_empty()) {
                            stack.push(g);
                        }
                    }
                    let rx = reach[r][i - v[r]];
                    // Its occurrence on this rank, and the same on every other
                    // member, reached (the prefix's at the base's times).
                    let n = before[at(r)] + past[at(r)].partition_point(|&j| (j as usize) < i);
                    let mut done = rx;
                    let mut ready = true;
                    for &g in &colls.ids[id].1 {
                        let g = g as usize;
                        if g == r {
                            continue;
                        }
                        let rg = match n.checked_sub(before[at(g)]) {
                            None => {
                                let j = colls.occ[id][g][n] as usize;
                                j.checked_sub(1).map_or(0.0, |j| self.end[g][j])
                            }
                            Some(m) => match past[at(g)].get(m) {
                                Some(&j) => reach[g][j as usize - v[g]],
                                None => f64::NAN,
                            },
                        };
                        if rg.is_nan() {
                            ready = false;
                            break;
                        }
                        done = done.max(rg);
                    }
                    if !ready {
                        break;
                    }
                    if let Some(d) = together[id] {
                        done += d;
                    }
                    t = done;
                    i += 1;
                    let over = t + left[r];
                    if bounded && (cutoff < over || over.is_nan()) && less(cutoff, over) {
                        return Some(None);
                    }
                    continue;
                }
                let mut hi = i + 1;
                while joins(list, hi) {
                    hi += 1;
                }
                if reach[r][i - v[r]].is_nan() {
                    reach[r][i - v[r]] = t;
                    // Whoever waits for this operation may go on.
                    for step in &list[i..hi] {
                        if let Step::P2p { peer, .. } = *step {
                            stack.push(peer as usize);
                        }
                    }
                }
                let rx = reach[r][i - v[r]];
                let mut done = rx;
                let mut ready = true;
                for k in i..hi {
                    let Step::P2p {
                        dir, unit, peer, ..
                    } = list[k]
                    else {
                        return None;
                    };
                    let (q, j) = (peer as usize, partner[r][k - v[r]] as usize);
                    let own = q == r && op_start(list, j) == i;
                    let rp = if own { rx } else { reached(&reach, q, j) };
                    if rp.is_nan() {
                        if !(eager && dir == Dir::Send) {
                            ready = false;
                            break;
                        }
                        // An eager SEND completes on its own.
                        continue;
                    }
                    let tr = transfer[unit as usize];
                    let end = match (opts.mode, dir) {
                        (Mode::Rendezvous, _) => rx.max(rp) + tr,
                        (Mode::Eager, Dir::Send) => rx,
                        (Mode::Eager, Dir::Recv) => rx.max(rp + tr),
                    };
                    done = done.max(end);
                }
                if !ready {
                    break;
                }
                t = done;
                i = hi;
                // (Less by more than the tolerance is less, or a NaN: the plain
                // comparison first, the tolerance's only where it can hold.)
                let over = t + left[r];
                if bounded && (cutoff < over || over.is_nan()) && less(cutoff, over) {
                    return Some(None);
                }
            }
            pc[r] = i;
            now[r] = t;
        }
        if (0..nr).any(|r| pc[r] < lists[r].len()) {
            // A deadlock: the engine says where.
            return None;
        }
        if !now.iter().copied().fold(0.0, f64::max).is_finite() {
            return None;
        }
        Some(Some(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::lower::Batch;
    use crate::ir::compare::less;
    use crate::ir::model::CommModel;
    use crate::ir::program::{CollKind, Cost, Role, Tensor};
    use crate::judge::simulate::simulate_lowered;

    /// Three units with costs from `costs`, activations and parameters to move.
    fn units(costs: &[(u8, u8, u8)]) -> Vec<Unit> {
        (costs.iter().enumerate())
            .map(|(u, &(f, b, w))| Unit {
                role: Role::of_name(&format!("u{u}")),
                name: format!("u{u}"),
                inputs: Vec::new(),
                home: 0,
                trainable: true,
                cost: Cost {
                    f: f64::from(f),
                    b: f64::from(b) * 0.5,
                    w: f64::from(w) * 0.25,
                },
                act: 1.0,
                bytes: 1.0 + u as f64,
                params: 3.0 * (u + 1) as f64,
            })
            .collect()
    }

    /// One event of a run in global order, projected on the ranks it touches.
    type Event = (u8, u8, u8, u8, u8);

    /// The lowering of `events` in this order on `nr` ranks with collectives
    /// `colls`: each rank lists its share of every event in turn, so the base
    /// runs (a transfer's ends and a collective's members meet in the same turn).
    /// An event is a compute step, a transfer, a crossing pair of transfers in
    /// one batch on both ranks, or a collective on its members (and, for some,
    /// one more rank that is not one: it waits for them, they not for it).
    fn lowering(nr: usize, colls: Vec<Collective>, events: &[Event]) -> Lowered {
        let mut programs: Vec<Vec<Step>> = vec![Vec::new(); nr];
        let mut batch = 0u64;
        for &(kind, a, b, unit, mb) in events {
            let (a, b) = (a as usize % nr, b as usize % nr);
            let (unit, mb) = (u32::from(unit % 3), u32::from(mb % 2));
            let p2p = |dir, peer: usize, batch| Step::P2p {
                dir,
                tensor: Tensor::Act,
                unit,
                mb,
                peer: peer as u32,
                batch,
            };
            match kind % 6 {
                2 | 3 if a != b => {
                    if kind % 6 == 3 {
                        batch += 1;
                        for (x, y) in [(a, b), (b, a)] {
                            let n = Batch::new(batch);
                            programs[x].push(p2p(Dir::Send, y, n));
                            programs[x].push(p2p(Dir::Recv, y, n));
                        }
                    } else {
                        programs[a].push(p2p(Dir::Send, b, None));
                        programs[b].push(p2p(Dir::Recv, a, None));
                    }
                }
                4 | 5 if !colls.is_empty() => {
                    let k = unit as usize % colls.len();
                    let mut on = colls[k].group.clone();
                    if kind % 6 == 5 && !on.contains(&a) {
                        on.push(a);
                    }
                    for g in on {
                        programs[g].push(Step::Coll(k as u32));
                    }
                }
                _ => {
                    let op = [Op::F, Op::B, Op::W][kind as usize % 3];
                    programs[a].push(Step::Compute { op, unit, mb });
                }
            }
        }
        Lowered {
            ranks: nr,
            microbatches: 2,
            programs,
            colls,
            prefetch: Vec::new(),
        }
    }

    /// [`pair`] by definition: every transfer at or past `from` keyed by its
    /// channel and (unit, micro-batch, tensor), the `k`-th `SEND` of a key with
    /// its `k`-th `RECV`.
    fn pair_by_definition(lists: &[Vec<Step>], from: &[usize]) -> Option<Vec<Vec<u32>>> {
        type Key = (u32, u32, u32, u32, u64);
        let mut sides: std::collections::BTreeMap<Key, [Vec<(usize, u32)>; 2]> =
            std::collections::BTreeMap::new();
        let mut partner: Vec<Vec<u32>> = (lists.iter().zip(from))
            .map(|(l, &f)| vec![NONE; l.len().saturating_sub(f)])
            .collect();
        for (r, list) in lists.iter().enumerate() {
            for (i, step) in list.iter().enumerate().skip(from[r]) {
                if let Step::P2p {
                    dir,
                    tensor,
                    unit,
                    mb,
                    peer,
                    ..
                } = *step
                {
                    if peer as usize >= lists.len() {
                        return None;
                    }
                    let (a, b) = dir.ends(r as u32, peer);
                    let key = (a, b, unit, mb, tensor_index(tensor));
                    let side = usize::from(dir == Dir::Recv);
                    sides.entry(key).or_default()[side].push((r, i as u32));
                }
            }
        }
        for [sends, recvs] in sides.values() {
            if sends.len() != recvs.len() {
                return None;
            }
            for (&(a, i), &(b, j)) in sends.iter().zip(recvs) {
                partner[a][i as usize - from[a]] = j;
                partner[b][j as usize - from[b]] = i;
            }
        }
        Some(partner)
    }

    /// [`Resumable::valid_prefix`] from the full common prefixes: every rank's
    /// steps compared with the base's up to the first that differs, then cut
    /// back (out of a batch, then to the fixed point).
    fn valid_prefix_of_full_scans(run: &Resumable, trial: &Lowered) -> Vec<usize> {
        let base = &run.lowered.programs;
        let mut v: Vec<usize> = (base.iter().zip(&trial.programs))
            .map(|(b, t)| {
                let p = b.iter().zip(t).take_while(|(x, y)| x == y).count();
                if joins(b, p) || joins(t, p) {
                    op_start(b, p - 1)
                } else {
                    p
                }
            })
            .collect();
        loop {
            let mut moved = false;
            for r in 0..v.len() {
                for (q, reach) in &run.reach[r] {
                    if let Some(first) = run.first_waiting(r, reach, v[*q]) {
                        if first < v[r] {
                            v[r] = first;
                            moved = true;
                        }
                    }
                }
            }
            if !moved {
                return v;
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(512))]
        /// [`pair`] pairs as its definition does ([`pair_by_definition`]): on
        /// lowerings whose transfers pair (steps moved on their ranks, so that
        /// ends cross), from any points of the lists, with a stray transfer
        /// added or not.
        #[test]
        fn pairing_is_by_channel_key_and_order(
            nr in 1usize..6,
            events in proptest::collection::vec((0u8..6, 0u8..6, 0u8..6, 0u8..3, 0u8..2), 0..60),
            moves in proptest::collection::vec((0u8..6, 0u16..64, 0u16..64), 0..4),
            cuts in proptest::collection::vec(0u16..64, 6),
            stray in (0u8..3, 0u8..6, 0u8..6, 0u16..64),
        ) {
            let mut l = lowering(nr, Vec::new(), &events);
            for &(r, from, to) in &moves {
                let list = &mut l.programs[r as usize % nr];
                if !list.is_empty() {
                    let n = list.len();
                    let step = list.remove(from as usize % n);
                    list.insert(to as usize % n, step);
                }
            }
            let (kind, r, peer, at) = stray;
            if kind > 0 {
                let list = &mut l.programs[r as usize % nr];
                let step = Step::P2p {
                    dir: [Dir::Send, Dir::Recv][kind as usize - 1],
                    tensor: Tensor::Grad,
                    unit: 0,
                    mb: 0,
                    peer: u32::from(peer) % (nr as u32 + 1),
                    batch: None,
                };
                list.insert(at as usize % (list.len() + 1), step);
            }
            let from: Vec<usize> = (l.programs.iter().zip(&cuts))
                .map(|(list, &c)| c as usize % (list.len() + 1) * usize::from(c % 3 > 0))
                .collect();
            proptest::prop_assert_eq!(pair(&l.programs, &from), pair_by_definition(&l.programs, &from));
        }

        /// A trial (some steps of a base moved on their ranks) resumed from the
        /// base's run gives [`finish_times_within`]'s answer: the same finishing
        /// times bit for bit, the same error, and where one is cut short against
        /// the cutoff, the other is too or provably ends later. Bases with
        /// collectives (groups of any members, identities listed twice, ranks
        /// outside a group listing it), transfers and batches, under both
        /// semantics, with and without a link model; trials with the base's
        /// collectives or others (handed to the engine). A trial with the base's
        /// collectives that the engine runs to the end is resumed, never handed
        /// to it.
        #[test]
        fn a_resumed_trial_with_collectives_is_the_full_trial(
            nr in 2usize..5,
            colls in proptest::collection::vec((0u8..2, 0usize..3, 0usize..4, 1u8..16), 0..4),
            events in proptest::collection::vec((0u8..6, 0u8..4, 0u8..4, 0u8..3, 0u8..2), 1..40),
            costs in proptest::collection::vec((0u8..3, 0u8..3, 0u8..3), 3),
            moves in proptest::collection::vec((0u8..4, 0u16..64, 0u16..64), 1..3),
            (eager, comm, cut, recoll) in (0u8..2, 0u8..2, 0usize..3, 0u8..3),
        ) {
            let colls: Vec<Collective> = colls
                .iter()
                .map(|&(kind, unit, root, set)| Collective {
                    kind: [CollKind::Bcast, CollKind::Reduce][kind as usize],
                    unit,
                    root: root % nr,
                    // At least one member; the set in a scrambled order.
                    group: (0..nr).rev().filter(|g| set >> g & 1 == 1 || *g == root % nr).collect(),
                })
                .collect();
            let units = units(&costs);
            let opts = SimOptions {
                mode: [Mode::Rendezvous, Mode::Eager][eager as usize],
                comm: (comm == 1).then_some(CommModel { latency: 0.5, bandwidth: 2.0 }),
            };
            let base = lowering(nr, colls, &events);
            let report = simulate_lowered(&units, &base, &opts).unwrap();
            let run = Resumable::new(base.clone(), &report.timeline).unwrap();
            let mut trial = base;
            for &(r, from, to) in &moves {
                let list = &mut trial.programs[r as usize % nr];
                if !list.is_empty() {
                    let n = list.len();
                    let step = list.remove(from as usize % n);
                    list.insert(to as usize % n, step);
                }
            }
            // Collectives that are not the base's: one more (on the first and last
            // ranks, at the start and the end of their lists, as a lowering places a
            // unit's broadcast and reduction), or the first's group changed.
            if recoll == 1 {
                let k = trial.colls.len() as u32;
                let group = vec![nr - 1, 0];
                for &g in &group {
                    trial.programs[g].insert(0, Step::Coll(k));
                    trial.programs[g].push(Step::Coll(k));
                }
                trial.colls.push(Collective { kind: CollKind::Reduce, unit: 1, root: 0, group });
            } else if recoll == 2 {
                if let Some(c) = trial.colls.first_mut() {
                    match c.group.iter().position(|&g| g == 1) {
                        Some(at) => {
                            c.group.remove(at);
                        }
                        None => c.group.push(1),
                    }
                }
            }
            let cutoff = [f64::INFINITY, report.makespan, report.makespan * 0.9][cut];
            // The scans stopped at the bounds from the ranks before find the valid
            // prefixes of the full scans.
            proptest::prop_assert_eq!(run.valid_prefix(&trial), valid_prefix_of_full_scans(&run, &trial));
            let full = finish_times_within(&units, &trial, &opts, cutoff);
            let resumed = run.finish_times(&units, &trial, &opts, cutoff);
            if trial.colls == run.lowered().colls && matches!(full, Ok(Some(_))) {
                proptest::prop_assert!(run.resume(&units, &trial, &opts, cutoff).is_some());
            }
            let over = |f: &[f64]| less(cutoff, f.iter().copied().fold(0.0, f64::max));
            let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            match (&full, &resumed) {
                (Ok(Some(x)), Ok(Some(y))) => proptest::prop_assert_eq!(bits(x), bits(y)),
                (Ok(Some(x)), _) | (_, Ok(Some(x))) => {
                    proptest::prop_assert!(over(x), "{:?} {:?}", full, resumed)
                }
                (Ok(None), Ok(None)) => {}
                (Err(a), Err(b)) => proptest::prop_assert_eq!(a, b),
                _ => proptest::prop_assert!(cutoff.is_finite(), "{:?} {:?}", full, resumed),
            }
        }
    }
}
