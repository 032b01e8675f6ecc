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
//!    first transfer whose partner (in the base's run) lies at or past `v[q]` on
//!    its rank `q`, until no cut moves (a fixed point). A transfer of a valid
//!    prefix has the same partner in the trial (the `k`-th `SEND` of a channel
//!    and key pairs with the `k`-th `RECV`, and both ranks' lists agree up to
//!    both), and by induction over the base's run every operation of the valid
//!    prefixes reaches and completes at the base's times;
//! 3. the transfers past the valid prefixes pair among themselves only (the
//!    pairing is one to one, and the prefixes' transfers are paired with each
//!    other), the `k`-th of a channel and key past the prefix with the `k`-th
//!    past the peer's; from each rank's time at the end of its valid prefix, the
//!    rest runs as [`crate::judge::simulate`]'s engine runs it: compute back to
//!    back, a transfer (or batch) reached when its rank gets there and complete
//!    once its partners are reached (under eager semantics a `SEND` does not
//!    wait), at the same expressions of the same numbers.
//!
//! The answer is [`finish_times_within`]'s: the same finishing times, bit for bit,
//! when that runs to the end, and `None` only for a program that provably
//! finishes later than the cutoff (a rank's time plus its compute left, checked
//! after every transfer past the prefix). Whatever this does not handle is
//! handed to [`finish_times_within`] whole: collectives (in either program), a
//! different number of ranks, a step naming no unit or rank, a transfer with no
//! partner, a run that does not end (deadlock) or a time that is not finite, so
//! every error is the engine's own.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::algebra::lower::{Lowered, Step};
use crate::ir::compare::less;
use crate::ir::model::{Mode, SimOptions};
use crate::ir::program::{Dir, Op, Tensor, Unit};
use crate::judge::simulate::{
    finish_times_within, joins_batch, op_index, tensor_index, transfer_times, unit_costs, Fnv,
    SimError,
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
    /// Per rank `r`, per peer `q` it has transfers with: at `i`, one more than the
    /// largest index on `q` of a partner of one of `r`'s first `i` steps (0 for
    /// none): the first transfer of `r` whose partner is past some point of `q` is
    /// found by a binary search.
    reach: Vec<Vec<(usize, Vec<u32>)>>,
}

/// The channel and key a transfer pairs on: `(source, destination, unit, mb,
/// tensor)`.
type Chan = (u32, u32, u32, u32, Tensor);

/// The channel of `step` on rank `r`, if it is a transfer.
fn chan(r: usize, step: &Step) -> Option<(Chan, Dir, u32)> {
    match *step {
        Step::P2p {
            dir,
            tensor,
            unit,
            mb,
            peer,
            ..
        } => {
            let (src, dst) = dir.ends(r as u32, peer);
            Some(((src, dst, unit, mb, tensor), dir, peer))
        }
        _ => None,
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
    let mut chan_of: HashMap<(u32, u32), u32, BuildHasherDefault<Fnv>> = HashMap::default();
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
                    let c = *chan_of.entry(ends).or_insert_with(|| {
                        chans.push(Ends {
                            ends,
                            ..Ends::default()
                        });
                        chans.len() as u32 - 1
                    }) as usize;
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
    /// fit each other or the run cannot be resumed from (collectives, a transfer
    /// with no partner): trials are then simulated whole.
    pub(crate) fn new(lowered: Lowered, timeline: &Timeline) -> Option<Resumable> {
        let fits = lowered.colls.is_empty()
            && timeline.ranks.len() == lowered.programs.len()
            && timeline
                .ranks
                .iter()
                .zip(&lowered.programs)
                .all(|(t, l)| t.len() == l.len());
        if !fits {
            return None;
        }
        let partner = pair(&lowered.programs, &vec![0; lowered.programs.len()])?;
        let reach = lowered
            .programs
            .iter()
            .zip(&partner)
            .enumerate()
            .map(|(r, (list, partner))| {
                let mut peers: Vec<(usize, Vec<u32>)> = Vec::new();
                for (i, step) in list.iter().enumerate() {
                    let Some((_, _, q)) = chan(r, step) else {
                        continue;
                    };
                    let at = match peers.iter().position(|p| p.0 == q as usize) {
                        Some(at) => at,
                        None => {
                            peers.push((q as usize, vec![0; list.len() + 1]));
                            peers.len() - 1
                        }
                    };
                    let prefix = &mut peers[at].1;
                    prefix[i + 1] = partner[i] + 1;
                }
                // Running maxima.
                for (_, prefix) in &mut peers {
                    for i in 1..prefix.len() {
                        prefix[i] = prefix[i].max(prefix[i - 1]);
                    }
                }
                peers
            })
            .collect();
        let end = timeline
            .ranks
            .iter()
            .map(|t| t.iter().map(|s| s.end).collect())
            .collect();
        Some(Resumable {
            lowered,
            end,
            reach,
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

    /// Each rank's valid prefix for `trial` (step 2 of the module documentation).
    fn valid_prefix(&self, trial: &Lowered) -> Vec<usize> {
        let base = &self.lowered.programs;
        let mut v: Vec<usize> = base
            .iter()
            .zip(&trial.programs)
            .map(|(b, t)| {
                let p = b.iter().zip(t).take_while(|(x, y)| x == y).count();
                // A batch that the common steps end inside (in either list) is not
                // common: back to its first member.
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
                for (q, reach) in &self.reach[r] {
                    // The first transfer before `v[r]` whose partner is at or past
                    // `v[q]`, if any (`reach` is non-decreasing).
                    if reach[v[r]] > v[*q] as u32 {
                        let i = reach.partition_point(|&m| m <= v[*q] as u32) - 1;
                        v[r] = op_start(&base[r], i);
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
        if !trial.colls.is_empty() || nr != self.lowered.programs.len() || !same_shape {
            return None;
        }
        let v = self.valid_prefix(trial);
        // Every step past the prefixes names a unit and a micro-batch (the
        // prefixes are the base's, which ran).
        let named = lists.iter().zip(&v).all(|(l, &from)| {
            l[from..].iter().all(|s| match *s {
                Step::Compute { unit, mb, .. } | Step::P2p { unit, mb, .. } => {
                    (unit as usize) < units.len() && (mb as usize) < trial.microbatches
                }
                Step::Coll(_) => false,
            })
        });
        if !named {
            return None;
        }
        let partner = pair(lists, &v)?;
        // The engine's tables: per unit, each op's cost and a transfer's time.
        let (costs, transfer) = (unit_costs(units), transfer_times(units, opts));
        let cost = |unit: u32, op: Op| costs[unit as usize][op_index(op)];
        let eager = opts.mode == Mode::Eager;
        let bounded = cutoff.is_finite();
        // Each rank's position, time and compute left (against a finite cutoff).
        let mut pc: Vec<usize> = v.clone();
        let mut now: Vec<f64> = (0..nr)
            .map(|r| v[r].checked_sub(1).map_or(0.0, |i| self.end[r][i]))
            .collect();
        let mut left: Vec<f64> = if bounded {
            lists
                .iter()
                .zip(&v)
                .map(|(l, &from)| {
                    l[from..]
                        .iter()
                        .map(|s| match *s {
                            Step::Compute { op, unit, .. } => cost(unit, op),
                            _ => 0.0,
                        })
                        .sum()
                })
                .collect()
        } else {
            vec![0.0; nr]
        };
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
