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
use crate::ir::plan::{Plan, Task};
use crate::ir::program::Op;

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
        let mut room: Vec<f64> = (0..list.len())
            .map(|k| time.start[r][k] - if k == 0 { 0.0 } else { time.end[r][k - 1] })
            .collect();
        let b_pos = |t: &Task| {
            list.iter()
                .position(|x| x.op == Op::B && x.unit == t.unit && x.mb == t.mb)
        };
        let mut inserts = Vec::with_capacity(ws.len());
        let mut from = 0;
        for w in ws {
            let cost = w.op.cost(&moved.units[w.unit].cost);
            let after = b_pos(&w).map_or(list.len(), |i| i + 1).max(from);
            let slot = (after..list.len()).find(|&k| room[k] >= cost);
            let pos = match slot {
                Some(k) => {
                    room[k] -= cost;
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
    debug_assert!(span(&best)? <= before + 1e-9 * before.max(1.0));
    Ok(best)
}
