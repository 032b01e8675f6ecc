//! Megatron-LM's interleaved 1F1B: rank `r` holds chunks `c = 0..v`, stage `c*p + r`.
//! Micro-batches advance in groups of `p`: virtual forward step `k` runs chunk
//! `(k / p) mod v` on micro-batch `(k / (p v)) p + k mod p`; backwards visit chunks in
//! reverse. Warm-up is `(p - r - 1) * 2 + (v - 1) * p` virtual steps (all of them
//! when `m == p`), as in Megatron. Under uniform costs the bubble is
//! `(p - 1)(F + B + W) / v` and rank `r` holds at most `warm-up + 1` chunk activations.

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;

/// Warm-up length (in virtual steps) of rank `r`.
pub(crate) fn warmup(p: usize, m: usize, v: usize, r: usize) -> usize {
    let total = m * v;
    if m == p {
        total
    } else {
        ((p - r - 1) * 2 + (v - 1) * p).min(total)
    }
}

pub(crate) fn order(ctx: &Ctx, v: usize) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    let total = m * v;
    let mb = |k: usize| (k / (p * v)) * p + k % p;
    (0..p)
        .map(|r| {
            let fwd = |k: usize| ctx.task(Op::F, ((k / p) % v) * p + r, mb(k));
            let bwd = |k: usize| ctx.task(Op::BW, (v - 1 - (k / p) % v) * p + r, mb(k));
            let warm = warmup(p, m, v, r);
            let mut list = Vec::with_capacity(2 * total);
            list.extend((0..warm).map(fwd));
            for i in 0..total - warm {
                list.push(fwd(warm + i));
                list.push(bwd(i));
            }
            list.extend((total - warm..total).map(bwd));
            list
        })
        .collect()
}
