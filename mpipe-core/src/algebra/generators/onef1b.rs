//! 1F1B (PipeDream-flush): rank `r` runs `p - 1 - r` warm-up forwards, then alternates
//! one forward and one fused backward, then drains the remaining backwards.
//! Under uniform costs the makespan is `(m + p - 1)(F + B + W)` and rank `r` holds at
//! most `p - r` activations.

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    (0..p)
        .map(|r| {
            let warm = (p - 1 - r).min(m);
            let mut list = Vec::with_capacity(2 * m);
            list.extend((0..warm).map(|i| ctx.task(Op::F, r, i)));
            for i in 0..m - warm {
                list.push(ctx.task(Op::F, r, warm + i));
                list.push(ctx.task(Op::BW, r, i));
            }
            list.extend((m - warm..m).map(|i| ctx.task(Op::BW, r, i)));
            list
        })
        .collect()
}
