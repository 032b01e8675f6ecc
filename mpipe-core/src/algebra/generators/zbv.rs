//! Zero Bubble's ZB-V: two chunks per rank in a V (rank `r` holds stage `r` and stage
//! `2p - 1 - r`), backward split into `B` and `W`, and the same activation budget as
//! 1F1B: rank `r` keeps at most `p` micro-batches' worth of its two chunks'
//! activations (weighted by each chunk's `act`, so a heavy chunk such as the LM head
//! counts for what it holds).
//!
//! Like the Zero Bubble paper's own construction, the order comes from a greedy list
//! scheduler run on the profile's costs: whenever a rank is free it runs a ready `B`
//! (oldest micro-batch first: `B` is on the critical path), else a ready `F` if the
//! budget allows (the deeper chunk first, so micro-batches turn round sooner), else a
//! pending `W` (oldest first), else it waits for the next event. Orders are per stage
//! in micro-batch order, so the decision per step is O(1).

use super::Ctx;
use crate::ir::compare::at_most;
use crate::ir::plan::Task;
use crate::ir::program::Op;
use std::cmp::Ordering;
use std::collections::binary_heap::PeekMut;
use std::collections::{BinaryHeap, VecDeque};

/// Rank `r` free at time `t` (the bits of a non-negative time, which order as the
/// times do), pushed `n`-th: the heap's earliest first, then the first pushed (push
/// numbers are unique, so the rank is never compared). An entry whose push number
/// is not the rank's latest is stale and skipped.
#[derive(Clone, Copy)]
struct Free {
    /// `t << 64 | n`: one comparison orders by time, then by push.
    at: u128,
    r: usize,
}

impl Free {
    fn new(t: u64, n: u64, r: usize) -> Free {
        Free {
            at: u128::from(t) << u64::BITS | u128::from(n),
            r,
        }
    }

    /// The time's bits, the push number and the rank.
    fn parts(self) -> (u64, u64, usize) {
        ((self.at >> u64::BITS) as u64, self.at as u64, self.r)
    }
}

impl PartialEq for Free {
    fn eq(&self, other: &Free) -> bool {
        self.at == other.at
    }
}

impl Eq for Free {}

impl PartialOrd for Free {
    fn partial_cmp(&self, other: &Free) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Free {
    /// Reversed, so that the max-heap gives the earliest first.
    fn cmp(&self, other: &Free) -> Ordering {
        other.at.cmp(&self.at)
    }
}

/// `t` (a sum of non-negative costs from zero: never negative, never NaN) as bits
/// that order as the times do (`-0.0` made `+0.0` first).
fn key(t: f64) -> u64 {
    (t + 0.0).to_bits()
}

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    let s = 2 * p;
    let cost = |k: usize| ctx.units[ctx.stages[k]].cost;
    let stage = |r: usize, c: usize| if c == 0 { r } else { s - 1 - r };
    let rank_of = |k: usize| if k < p { k } else { s - 1 - k };
    // End times by stage and micro-batch (`k * m + mb`), INFINITY while unscheduled.
    let mut fend = vec![f64::INFINITY; s * m];
    let mut bend = vec![f64::INFINITY; s * m];
    let mut next_f = vec![[0usize; 2]; p];
    let mut next_b = vec![[0usize; 2]; p];
    let mut wq: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); p];
    let act = |k: usize| ctx.units[ctx.stages[k]].act;
    let mut inflight = vec![0.0f64; p];
    let budget: Vec<f64> = (0..p)
        .map(|r| p as f64 * (act(stage(r, 0)) + act(stage(r, 1))))
        .collect();
    // An F fits if the budget allows it, or if nothing at all is in flight.
    let fits = |held: f64, k: usize, r: usize| held == 0.0 || at_most(held + act(k), budget[r]);
    let mut order: Vec<Vec<Task>> = (0..p).map(|_| Vec::with_capacity(6 * m)).collect();
    let mut heap: BinaryHeap<Free> = (0..p).map(|r| Free::new(key(0.0), r as u64, r)).collect();
    let mut pushes = p as u64;
    let mut latest: Vec<u64> = (0..p as u64).collect();
    // Idle ranks, with the time of the next event they know of (INFINITY: none).
    let mut parked: Vec<(usize, f64)> = Vec::new();
    // Whether a rank is in `parked` (at most once).
    let mut is_parked = vec![false; p];
    let mut relaxed = vec![false; p];
    let mut last = 0.0f64;
    let mut remaining = 6 * m * p;
    loop {
        if heap.is_empty() {
            // Everyone waits on work nobody can start: the budget is too tight for
            // this profile. Relax it rather than stall (the memory check still applies).
            if parked.is_empty() || parked.iter().all(|&(r, _)| relaxed[r]) {
                break;
            }
            for (r, _) in parked.drain(..) {
                is_parked[r] = false;
                relaxed[r] = true;
                latest[r] = pushes;
                heap.push(Free::new(key(last), pushes, r));
                pushes += 1;
            }
            continue;
        }
        // The earliest entry is replaced where it is (one sift down) when its rank
        // is free again, taken out when the rank waits for nothing known.
        let Some(mut top) = heap.peek_mut() else {
            continue;
        };
        let (t, n, r) = top.parts();
        if n != latest[r] {
            PeekMut::pop(top);
            continue;
        }
        let t = f64::from_bits(t);
        if is_parked[r] {
            parked.retain(|&(q, _)| q != r);
            is_parked[r] = false;
        }
        // Ready time of the next F / B of chunk c on rank r (INFINITY: not yet known).
        let f_ready = |c: usize, fend: &[f64], nf: &[usize; 2]| {
            let (k, mb) = (stage(r, c), nf[c]);
            if mb >= m {
                None
            } else if k == 0 {
                Some(0.0)
            } else {
                Some(fend[(k - 1) * m + mb])
            }
        };
        let b_ready = |c: usize, fend: &[f64], bend: &[f64], nb: &[usize; 2]| {
            let (k, mb) = (stage(r, c), nb[c]);
            if mb >= m {
                return None;
            }
            let own = fend[k * m + mb];
            let down = if k + 1 < s {
                bend[(k + 1) * m + mb]
            } else {
                0.0
            };
            Some(own.max(down))
        };
        let mut choice: Option<(Op, usize)> = None;
        // B first, oldest micro-batch, deeper chunk on ties.
        let mut best: Option<(usize, usize)> = None;
        for c in [1, 0] {
            if let Some(ready) = b_ready(c, &fend, &bend, &next_b[r]) {
                if ready <= t && best.is_none_or(|(_, mb)| next_b[r][c] < mb) {
                    best = Some((c, next_b[r][c]));
                }
            }
        }
        if let Some((c, _)) = best {
            choice = Some((Op::B, c));
        }
        if choice.is_none() {
            for c in [1, 0] {
                let room = relaxed[r] || fits(inflight[r], stage(r, c), r);
                if room && f_ready(c, &fend, &next_f[r]).is_some_and(|ready| ready <= t) {
                    choice = Some((Op::F, c));
                    break;
                }
            }
        }
        if choice.is_none() && !wq[r].is_empty() {
            choice = Some((Op::W, 0));
        }
        let Some((op, c)) = choice else {
            // Wait for the earliest known event that could make something ready,
            // or, if none is known yet, until some rank schedules a task.
            let mut next = f64::INFINITY;
            for c in [0, 1] {
                let heads = [
                    f_ready(c, &fend, &next_f[r]),
                    b_ready(c, &fend, &bend, &next_b[r]),
                ];
                for ready in heads.into_iter().flatten() {
                    if ready > t {
                        next = next.min(ready);
                    }
                }
            }
            latest[r] = pushes;
            if next.is_finite() {
                *top = Free::new(key(next), pushes, r);
            } else {
                PeekMut::pop(top);
            }
            pushes += 1;
            parked.push((r, next));
            is_parked[r] = true;
            continue;
        };
        let (k, mb, dur) = match op {
            Op::B => {
                let k = stage(r, c);
                let mb = next_b[r][c];
                next_b[r][c] += 1;
                wq[r].push_back((k, mb));
                (k, mb, cost(k).b)
            }
            Op::F => {
                let k = stage(r, c);
                let mb = next_f[r][c];
                next_f[r][c] += 1;
                inflight[r] += act(k);
                (k, mb, cost(k).f)
            }
            _ => {
                let (k, mb) = wq[r].pop_front().unwrap_or((0, 0));
                inflight[r] = (inflight[r] - act(k)).max(0.0);
                (k, mb, cost(k).w)
            }
        };
        let end = t + dur;
        match op {
            Op::F => fend[k * m + mb] = end,
            Op::B => bend[k * m + mb] = end,
            _ => {}
        }
        order[r].push(ctx.task(op, k, mb));
        remaining -= 1;
        if remaining == 0 {
            break;
        }
        last = last.max(end);
        latest[r] = pushes;
        *top = Free::new(key(end), pushes, r);
        drop(top);
        pushes += 1;
        // Only the rank of the next stage (after an F) or of the previous stage
        // (after a B) can have been waiting for this task.
        let woken = match op {
            Op::F if k + 1 < s => Some(rank_of(k + 1)),
            Op::B if k > 0 => Some(rank_of(k - 1)),
            _ => None,
        };
        if let Some(q) = woken {
            if let Some(pos) = parked.iter().position(|&(x, _)| x == q) {
                let (_, next) = parked.swap_remove(pos);
                is_parked[q] = false;
                latest[q] = pushes;
                heap.push(Free::new(key(end.min(next)), pushes, q));
                pushes += 1;
            }
        }
    }
    order
}
