//! GPipe: every rank runs all its forwards, then all its backwards (fused `BW`).
//! Under uniform costs the makespan is `(m + p - 1)(F + B + W)`, peak memory `m`.

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    (0..ctx.ranks)
        .map(|r| {
            let f = (0..ctx.microbatches).map(|m| ctx.task(Op::F, r, m));
            let b = (0..ctx.microbatches).map(|m| ctx.task(Op::BW, r, m));
            f.chain(b).collect()
        })
        .collect()
}
