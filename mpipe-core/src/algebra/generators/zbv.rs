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

/// The ranks' next free times: a loser tree over the ranks (each inner node holds
/// the rank that lost the comparison there, the root's slot the overall winner), so
/// the earliest is read in one step and the winner's new time replays one path, one
/// comparison a level. A key is `t << 64 | n`: the bits of a non-negative time `t`,
/// which order as the times do, then the number `n` of the update that set it, so
/// that equal times go first come, first served (update numbers are unique, so two
/// ranks' keys never tie).
struct Clock {
    /// Each rank's key (ranks past `p` stay at [`Clock::NONE`]).
    keys: Vec<u128>,
    /// `node[i]` for inner node `i` (node `i`'s children are `2i` and `2i + 1`,
    /// leaf `leaves + r` is rank `r`): the key and rank that lost there; `node[0]`:
    /// the winner's.
    node: Vec<(u128, usize)>,
    /// Scratch for [`Clock::rebuild`]: each node's winner.
    win: Vec<usize>,
    leaves: usize,
    /// The next update's number.
    updates: u64,
}

impl Clock {
    /// No time known: the rank waits for an event.
    const NONE: u128 = u128::MAX;

    /// Every rank free at time zero, in rank order.
    fn new(p: usize) -> Clock {
        let leaves = p.next_power_of_two();
        let mut clock = Clock {
            keys: vec![Clock::NONE; leaves],
            node: vec![(Clock::NONE, 0); leaves],
            win: vec![0; 2 * leaves],
            leaves,
            updates: 0,
        };
        for r in 0..p {
            clock.keys[r] = clock.key(Some(0.0));
        }
        clock.rebuild();
        clock
    }

    /// The rank with the earliest time, and the time; `None` when every rank waits.
    fn first(&self) -> Option<(usize, f64)> {
        let (key, r) = self.node[0];
        (key != Clock::NONE).then(|| (r, f64::from_bits((key >> u64::BITS) as u64)))
    }

    /// The key of time `t` (`None`: no time known) as the next update sets it.
    fn key(&mut self, t: Option<f64>) -> u128 {
        let n = self.updates;
        self.updates += 1;
        // `t` is a sum of non-negative costs from zero: never negative, never NaN
        // (`-0.0` made `+0.0` first).
        t.map_or(Clock::NONE, |t| {
            u128::from((t + 0.0).to_bits()) << u64::BITS | u128::from(n)
        })
    }

    /// The winner (the rank [`Clock::first`] gave) is next free at `t` (`None`: at
    /// no known time): it meets, on its path up, only the ranks it beat there.
    fn set_first(&mut self, t: Option<f64>) {
        let (_, r) = self.node[0];
        let key = self.key(t);
        self.keys[r] = key;
        let mut cand = (key, r);
        let mut i = (self.leaves + r) >> 1;
        while i > 0 {
            let lost = self.node[i];
            if lost.0 < cand.0 {
                self.node[i] = cand;
                cand = lost;
            }
            i >>= 1;
        }
        self.node[0] = cand;
    }

    /// Rank `r`, any rank, is next free at `t` (`None`: at no known time). Rare
    /// (a waiting rank woken, the budget relaxed): the tree is built again.
    fn set(&mut self, r: usize, t: Option<f64>) {
        self.keys[r] = self.key(t);
        self.rebuild();
    }

    /// Every node's loser and the winner, from the keys.
    fn rebuild(&mut self) {
        let leaves = self.leaves;
        for r in 0..leaves {
            self.win[leaves + r] = r;
        }
        for i in (1..leaves).rev() {
            let (a, b) = (self.win[2 * i], self.win[2 * i + 1]);
            let (w, l) = if self.keys[b] < self.keys[a] {
                (b, a)
            } else {
                (a, b)
            };
            self.win[i] = w;
            self.node[i] = (self.keys[l], l);
        }
        let w = self.win[1];
        self.node[0] = (self.keys[w], w);
    }
}

/// One rank's two chunks (`0`: stage `r`, `1`: stage `2p - 1 - r`) and where it is
/// in each.
struct Lane {
    stage: [usize; 2],
    f: [f64; 2],
    b: [f64; 2],
    act: [f64; 2],
    budget: f64,
    next_f: [usize; 2],
    next_b: [usize; 2],
    /// Activations held (`F` run, its `W` not yet).
    inflight: f64,
    /// `(chunk, micro-batch)` of every `B` run, in order: the `W`s pending are those
    /// from `w_next` on.
    done_b: Vec<(usize, usize)>,
    w_next: usize,
    relaxed: bool,
    parked: bool,
}

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    let s = 2 * p;
    let unit = |k: usize| &ctx.units[ctx.stages[k]];
    let rank_of = |k: usize| if k < p { k } else { s - 1 - k };
    // End times by stage and micro-batch (`k * m + mb`), INFINITY while unscheduled.
    let mut fend = vec![f64::INFINITY; s * m];
    let mut bend = vec![f64::INFINITY; s * m];
    let mut lanes: Vec<Lane> = (0..p)
        .map(|r| {
            let stage = [r, s - 1 - r];
            let [u0, u1] = stage.map(unit);
            Lane {
                stage,
                f: [u0.cost.f, u1.cost.f],
                b: [u0.cost.b, u1.cost.b],
                act: [u0.act, u1.act],
                budget: p as f64 * (u0.act + u1.act),
                next_f: [0; 2],
                next_b: [0; 2],
                inflight: 0.0,
                done_b: Vec::with_capacity(2 * m),
                w_next: 0,
                relaxed: false,
                parked: false,
            }
        })
        .collect();
    // Ready time of the next F / B of chunk `c` (INFINITY: not yet known; `None`:
    // every micro-batch's is scheduled).
    let f_ready = |lane: &Lane, c: usize, fend: &[f64]| {
        let (k, mb) = (lane.stage[c], lane.next_f[c]);
        if mb >= m {
            None
        } else if k == 0 {
            Some(0.0)
        } else {
            Some(fend[(k - 1) * m + mb])
        }
    };
    let b_ready = |lane: &Lane, c: usize, fend: &[f64], bend: &[f64]| {
        let (k, mb) = (lane.stage[c], lane.next_b[c]);
        if mb >= m {
            return None;
        }
        let own = fend[k * m + mb];
        let down = if k + 1 < s {
            bend[(k + 1) * m + mb]
        } else {
            0.0
        };
        // Times here are never NaN: the larger, without `max`'s NaN handling.
        Some(if own < down { down } else { own })
    };
    let mut order: Vec<Vec<Task>> = (0..p).map(|_| Vec::with_capacity(6 * m)).collect();
    let mut clock = Clock::new(p);
    // Idle ranks, with the time of the next event they know of (INFINITY: none).
    let mut parked: Vec<(usize, f64)> = Vec::new();
    let mut last = 0.0f64;
    let mut remaining = 6 * m * p;
    loop {
        let Some((r, t)) = clock.first() else {
            // Everyone waits on work nobody can start: the budget is too tight for
            // this profile. Relax it rather than stall (the memory check still applies).
            if parked.is_empty() || parked.iter().all(|&(r, _)| lanes[r].relaxed) {
                break;
            }
            for (r, _) in parked.drain(..) {
                lanes[r].parked = false;
                lanes[r].relaxed = true;
                clock.set(r, Some(last));
            }
            continue;
        };
        let lane = &mut lanes[r];
        if lane.parked {
            parked.retain(|&(q, _)| q != r);
            lane.parked = false;
        }
        // B first, oldest micro-batch, deeper chunk on ties.
        let mut choice: Option<(Op, usize)> = None;
        for c in [1, 0] {
            if b_ready(lane, c, &fend, &bend).is_some_and(|ready| ready <= t)
                && choice.is_none_or(|(_, d)| lane.next_b[c] < lane.next_b[d])
            {
                choice = Some((Op::B, c));
            }
        }
        if choice.is_none() {
            for c in [1, 0] {
                // An F fits if the budget allows it, or if nothing at all is in flight.
                let room = lane.relaxed
                    || lane.inflight == 0.0
                    || at_most(lane.inflight + lane.act[c], lane.budget);
                if room && f_ready(lane, c, &fend).is_some_and(|ready| ready <= t) {
                    choice = Some((Op::F, c));
                    break;
                }
            }
        }
        if choice.is_none() && lane.w_next < lane.done_b.len() {
            choice = Some((Op::W, 0));
        }
        let Some((op, c)) = choice else {
            // Wait for the earliest known event that could make something ready,
            // or, if none is known yet, until some rank schedules a task.
            let mut next = f64::INFINITY;
            for c in [0, 1] {
                let heads = [f_ready(lane, c, &fend), b_ready(lane, c, &fend, &bend)];
                for ready in heads.into_iter().flatten() {
                    if ready > t {
                        next = next.min(ready);
                    }
                }
            }
            clock.set_first(next.is_finite().then_some(next));
            parked.push((r, next));
            lane.parked = true;
            continue;
        };
        let (k, mb, dur) = match op {
            Op::B => {
                let mb = lane.next_b[c];
                lane.next_b[c] += 1;
                lane.done_b.push((c, mb));
                (lane.stage[c], mb, lane.b[c])
            }
            Op::F => {
                let mb = lane.next_f[c];
                lane.next_f[c] += 1;
                lane.inflight += lane.act[c];
                (lane.stage[c], mb, lane.f[c])
            }
            _ => {
                let (c, mb) = lane.done_b[lane.w_next];
                lane.w_next += 1;
                let held = lane.inflight - lane.act[c];
                lane.inflight = if held < 0.0 { 0.0 } else { held };
                let k = lane.stage[c];
                (k, mb, unit(k).cost.w)
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
        if end > last {
            last = end;
        }
        clock.set_first(Some(end));
        // Only the rank of the next stage (after an F) or of the previous stage
        // (after a B) can have been waiting for this task.
        let woken = match op {
            Op::F if k + 1 < s => Some(rank_of(k + 1)),
            Op::B if k > 0 => Some(rank_of(k - 1)),
            _ => None,
        };
        if let Some(q) = woken.filter(|&q| lanes[q].parked) {
            if let Some(pos) = parked.iter().position(|&(x, _)| x == q) {
                let (_, next) = parked.swap_remove(pos);
                lanes[q].parked = false;
                clock.set(q, Some(end.min(next)));
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::Clock;
    use proptest::prelude::*;

    proptest! {
        /// After any sequence of updates (the winner's, or any rank's), the clock's
        /// first is the rank of the least key, its time that key's: a scan of every
        /// rank's key, by time, then by update (first come, first served).
        #[test]
        fn the_first_is_the_earliest_then_the_first_set(
            p in 1usize..20,
            updates in prop::collection::vec((any::<bool>(), 0usize..20, prop::option::weighted(0.9, 0u32..8)), 0..200),
        ) {
            let mut clock = Clock::new(p);
            // Per rank: (time, update number), `None` while the rank waits.
            let mut want: Vec<Option<(f64, u64)>> = (0..p as u64).map(|r| Some((0.0, r))).collect();
            for (n, (winner, r, t)) in (p as u64..).zip(updates) {
                let t = t.map(f64::from);
                match clock.first() {
                    Some((q, _)) if winner => {
                        clock.set_first(t);
                        want[q] = t.map(|t| (t, n));
                    }
                    _ => {
                        let r = r % p;
                        clock.set(r, t);
                        want[r] = t.map(|t| (t, n));
                    }
                }
                let least = (0..p)
                    .filter_map(|r| want[r].map(|(t, n)| (t, n, r)))
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                prop_assert_eq!(clock.first(), least.map(|(t, _, r)| (r, t)));
            }
        }
    }
}
