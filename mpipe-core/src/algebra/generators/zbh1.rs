//! Zero Bubble's ZB-H1: 1F1B with each backward split into `B` (input gradient, on
//! the critical path) and `W` (weight gradient, deferred). Rank `r` delays its `W`s by
//! `r` backwards, so the last ranks fill their cool-down with weight gradients. Under
//! uniform costs the makespan is `m (F + B + W) + (p - 1)(F + B - W)` and the peak
//! memory stays 1F1B's (`p` activations on the worst rank).

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    (0..p)
        .map(|r| {
            let warm = (p - 1 - r).min(m);
            let mut list = Vec::with_capacity(3 * m);
            let mut next_w = 0;
            let backward = |list: &mut Vec<Task>, i: usize, next_w: &mut usize| {
                list.push(ctx.task(Op::B, r, i));
                if i >= r {
                    list.push(ctx.task(Op::W, r, *next_w));
                    *next_w += 1;
                }
            };
            list.extend((0..warm).map(|i| ctx.task(Op::F, r, i)));
            for i in 0..m - warm {
                list.push(ctx.task(Op::F, r, warm + i));
                backward(&mut list, i, &mut next_w);
            }
            for i in m - warm..m {
                backward(&mut list, i, &mut next_w);
            }
            list.extend((next_w..m).map(|i| ctx.task(Op::W, r, i)));
            list
        })
        .collect()
}
