//! DeepSeek's DualPipeV: DualPipe folded into a V (rank `r` holds stage `r`, chunk 0,
//! and stage `2p - 1 - r`, chunk 1), in its eight phases: chunk-0 warm-up forwards,
//! paired forwards, zero-bubble `B1 W F1`, the main `F0 B1 F1 B0` loop (whose forward
//! and backward DualPipe overlaps on the device; here they run one after the other),
//! the drain with backwards switching to split `B`/`W` half way, and the trailing `W`s.
//! Needs at least `2p` micro-batches.

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;
use std::collections::VecDeque;

struct Rank<'a, 'c> {
    ctx: &'a Ctx<'c>,
    stage: [usize; 2],
    next_f: [usize; 2],
    next_b: [usize; 2],
    wq: VecDeque<Task>,
    list: Vec<Task>,
}

impl Rank<'_, '_> {
    fn f(&mut self, c: usize) {
        self.list
            .push(self.ctx.task(Op::F, self.stage[c], self.next_f[c]));
        self.next_f[c] += 1;
    }
    fn b(&mut self, c: usize, zero_bubble: bool) {
        let (k, mb) = (self.stage[c], self.next_b[c]);
        self.next_b[c] += 1;
        if zero_bubble {
            self.list.push(self.ctx.task(Op::B, k, mb));
            self.wq.push_back(self.ctx.task(Op::W, k, mb));
        } else {
            self.list.push(self.ctx.task(Op::BW, k, mb));
        }
    }
    fn w(&mut self) {
        if let Some(t) = self.wq.pop_front() {
            self.list.push(t);
        }
    }
}

pub(crate) fn order(ctx: &Ctx) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    (0..p)
        .map(|r| {
            let mut k = Rank {
                ctx,
                stage: [r, 2 * p - 1 - r],
                next_f: [0; 2],
                next_b: [0; 2],
                wq: VecDeque::new(),
                list: Vec::with_capacity(6 * m),
            };
            for _ in 0..2 * (p - r - 1) {
                k.f(0);
            }
            for _ in 0..r + 1 {
                k.f(0);
                k.f(1);
            }
            for _ in 0..p - r - 1 {
                k.b(1, true);
                k.w();
                k.f(1);
            }
            for _ in 0..(m + r + 1).saturating_sub(2 * p) {
                k.f(0);
                k.b(1, false);
                k.f(1);
                k.b(0, false);
            }
            for _ in 0..p - r - 1 {
                k.b(1, false);
                k.f(1);
                k.b(0, false);
            }
            let half = r.div_ceil(2);
            let mut zb = false;
            for i in 0..r + 1 {
                if i == half && r % 2 == 1 {
                    zb = true;
                }
                k.b(1, zb);
                if i == half && r % 2 == 0 {
                    zb = true;
                }
                k.b(0, zb);
            }
            for _ in 0..p - r - 1 {
                k.w();
                k.b(0, true);
            }
            while !k.wq.is_empty() {
                k.w();
            }
            k.list
        })
        .collect()
}
