//! `split_w(BODY)`: decouple weight-gradient work from input-gradient work and move
//! it into idle time, Zero Bubble style, for any body.
//!
//! Every fused `BW(u, m)` of a trainable unit becomes `B(u, m)` followed by `W(u, m)`.
//! `B` is on the critical path (the previous stage waits for its gradient); `W`
//! only has to run before the step ends. So each rank's `W`s are taken out of its
//! order and put back, in their order, into the idle gaps the plan's ideal timing
//! shows (each after its own `B`, only where the gap is long enough), and the rest
//! at the end of the rank's order.
//!
//! Promise: the result's ideal (communication-free) step is never longer than the
//! body's; if re-placing makes it longer (gaps move once `W`s leave), `W`s stay
//! right after their `B`, which is never longer than the fused `BW`. Held activations
//! last until `W`, so peak memory can grow; the derivation's memory check applies.

use super::insert_all;
use crate::algebra::analysis::{dependencies, timing, PlanError};
use crate::ir::compare::at_most;
use crate::ir::plan::{Plan, Task};
use crate::ir::program::Op;
use std::collections::HashMap;

/// Split every trainable unit's `BW` and move the `W`s into idle time.
pub fn split_w(plan: Plan) -> Result<Plan, PlanError> {
    let span =
        |p: &Plan| -> Result<f64, PlanError> { Ok(timing(p, &dependencies(p)?)?.makespan()) };
    let before = span(&plan)?;
    // 1. Split in place: W right after its B.
    let mut adjacent = plan.clone();
    for list in &mut adjacent.order {
        let mut out = Vec::with_capacity(list.len() * 2);
        for t in list.drain(..) {
            if t.op == Op::BW && plan.units[t.unit].trainable {
                out.push(Task::new(Op::B, t.unit, t.mb));
                out.push(Task::new(Op::W, t.unit, t.mb));
            } else {
                out.push(t);
            }
        }
        *list = out;
    }
    // 2. Take the W's out, time what is left, and put each W into the first gap
    //    after its B that can hold it (or at the end).
    let mut moved = adjacent.clone();
    let mut pending: Vec<Vec<Task>> = Vec::with_capacity(moved.ranks);
    for list in &mut moved.order {
        pending.push(list.iter().copied().filter(|t| t.op == Op::W).collect());
        list.retain(|t| t.op != Op::W);
    }
    let time = timing(&moved, &dependencies(&moved)?)?;
    for (r, ws) in pending.into_iter().enumerate() {
        let list = &moved.order[r];
        // Idle before task k: start[k] - end[k-1] (from 0 for the first task).
        let mut room = Gaps::new(
            (0..list.len())
                .map(|k| time.start[r][k] - if k == 0 { 0.0 } else { time.end[r][k - 1] })
                .collect(),
        );
        // Each (unit, micro-batch)'s first B (one pass, not a search per W).
        let mut b_at: HashMap<(usize, usize), usize> = HashMap::with_capacity(ws.len());
        for (k, x) in list.iter().enumerate() {
            if x.op == Op::B {
                b_at.entry((x.unit, x.mb)).or_insert(k);
            }
        }
        let mut inserts = Vec::with_capacity(ws.len());
        let mut from = 0;
        for w in ws {
            let cost = w.op.cost(&moved.units[w.unit].cost);
            let after = b_at
                .get(&(w.unit, w.mb))
                .map_or(list.len(), |&i| i + 1)
                .max(from);
            let pos = match room.first_holding(after, cost) {
                Some(k) => {
                    room.take(k, cost);
                    k
                }
                None => list.len(),
            };
            from = pos; // keep the W's in their order
            inserts.push((pos, w));
        }
        insert_all(&mut moved.order[r], inserts);
    }
    // 3. Keep the better of the two, never worse than the body.
    let (a, m) = (span(&adjacent)?, span(&moved)?);
    let best = if m <= a { moved } else { adjacent };
    debug_assert!(at_most(span(&best)?, before));
    Ok(best)
}

/// The idle time before each task of a rank's order, as a tree of maxima: the first
/// gap at or after a position that holds a cost is found in logarithmic time, where
/// a scan was linear (at one rank, with no gap anywhere, every `W` scanned to the end
/// of the order: quadratic in the micro-batches). Finds the same gap a scan would.
struct Gaps {
    /// Leaves (from `half`) hold the gaps, padded with -inf; each inner node the
    /// larger of its two children.
    tree: Vec<f64>,
    half: usize,
    len: usize,
}

impl Gaps {
    fn new(room: Vec<f64>) -> Gaps {
        let len = room.len();
        let half = len.next_power_of_two().max(1);
        let mut tree = vec![f64::NEG_INFINITY; 2 * half];
        tree[half..half + len].copy_from_slice(&room);
        for i in (1..half).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        Gaps { tree, half, len }
    }

    /// The first position `k >= from` whose gap is at least `cost`.
    fn first_holding(&self, from: usize, cost: f64) -> Option<usize> {
        if from >= self.len {
            return None;
        }
        self.first_in(1, 0, self.half, from, cost)
    }

    fn first_in(&self, node: usize, lo: usize, hi: usize, from: usize, cost: f64) -> Option<usize> {
        // (A NaN gap holds nothing, as in the scan.)
        let holds = self.tree[node] >= cost;
        if hi <= from || !holds {
            return None;
        }
        if hi - lo == 1 {
            return (lo < self.len).then_some(lo);
        }
        let mid = (lo + hi) / 2;
        self.first_in(2 * node, lo, mid, from, cost)
            .or_else(|| self.first_in(2 * node + 1, mid, hi, from, cost))
    }

    /// Takes `cost` from the gap at `k`.
    fn take(&mut self, k: usize, cost: f64) {
        let mut i = self.half + k;
        self.tree[i] -= cost;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Gaps;

    /// The tree finds what a scan finds, through takes.
    #[test]
    fn gaps_find_what_a_scan_finds() {
        let mut room: Vec<f64> = (0..37).map(|i| ((i * 7919) % 13) as f64 * 0.5).collect();
        let mut gaps = Gaps::new(room.clone());
        for step in 0..200usize {
            let from = (step * 31) % 40;
            let cost = ((step * 17) % 9) as f64 * 0.5;
            let scan = (from..room.len()).find(|&k| room[k] >= cost);
            assert_eq!(gaps.first_holding(from, cost), scan, "step {step}");
            if let Some(k) = scan {
                room[k] -= cost;
                gaps.take(k, cost);
            }
        }
    }
}
