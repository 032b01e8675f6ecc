//! ZB-2p: Zero Bubble's automatic schedule under a budget of twice 1F1B's activation
//! memory, built by greedy list scheduling on the stages' own costs.
//!
//! The stages (`v` chunks per rank, looped as in `interleaved`, or two in a V as in
//! `zbv` with `layout = v`) are scheduled as the cost model predicts them to run,
//! communication left out. Whenever a rank is free,
//! it runs, among the tasks whose inputs have arrived:
//!
//! 1. an input-gradient backward `B` (it is on the critical path: the previous stage
//!    waits for it), the one ready longest first;
//! 2. else a forward `F`, the lowest micro-batch first and, among its chunks, the
//!    deepest. A micro-batch is admitted to a rank by the forward of the rank's
//!    first stage, which reserves the activations of all the rank's stages for it:
//!    at most `2 p` micro-batches at a time (twice what 1F1B's first rank holds),
//!    and within `memory.limit` less the parameters homed on the rank;
//! 3. else a weight-gradient `W`, in the order of their `B`s (it frees an activation);
//! 4. else it waits for the next arrival.
//!
//! With the `W`s free to move, the first rank keeps computing forwards until the
//! first gradient comes back and the last ranks fill their cool-down with `W`s, so
//! the step comes close to the rank bound of `bound.rs` (the work of the busiest
//! rank after its first input arrives). The costs are the units', so the schedule
//! adapts to unequal stages (the LM head, `balance`). Deterministic: ties go to the
//! lower rank, then to the rules above. Greedy is not optimal: with one chunk and
//! `B` several times `F` its order can come out behind ZB-H1's, and then
//! [`generate`](super::generate) takes ZB-H1's order instead where it fits the
//! memory limit.
//!
//! **Lockstep** (`costs = unit`): the same rules run as if every task took one time
//! unit. Neighbouring ranks then finish their tasks together and hand over at
//! once, the order ZB-H2-style hand-made schedules have; on the real costs the
//! step can idle more in the ideal timing, but under rendezvous transfers (a send
//! blocks until its receiver posts the receive) an order that keeps neighbours in
//! step waits less than one tuned to exact costs that the waiting then upsets.
//! `auto` tries both; on profile (c) the lockstep order, with `balance` and the
//! vision encoder prefetched, is the fastest schedule under rendezvous.
//!
//! **Its stages** come prepared ([`super::stage_set`]): the LLM's, and for
//! `encoders = chain | chains | ramp` a chained encoder's per-rank layer chunks in
//! front of them (`entry` marks where the LLM starts), with their costs and
//! activations ([`super::stage_set::weigh`]). The scheduler runs every stage by the
//! rules above; the chunks only lengthen each micro-batch's round trip, and the cap
//! on micro-batches in flight grows with it. In lockstep the chunks are
//! *attached*: each LLM task takes one of its rank's chunk tasks along, in no
//! lockstep time, if that task's input came from an earlier round (else the chain
//! would cross every rank within one round, and in real time each rank would wait
//! for the one before); a chunk task runs alone only when its rank has no LLM task
//! to run.
//!
//! **Woven encoders** (`encoders = spread`) are offered to it by [`super::weave`]:
//! when a rank is free it may take an encoder forward the first stage is about to
//! read (before any `F`), another one (after its `F`s), or an encoder backward
//! (beside its `W`s).

use super::stage_set::Weighed;
use super::weave::Woven;
use super::{fits, homed_params, Ctx};
use crate::algebra::analysis::{dependencies, timing};
use crate::ir::compare::less;
use crate::ir::plan::{Plan, Task, UnitId};
use crate::ir::program::{Cost, Op};

/// The schedule of the context's stages, each on its unit's home rank (looped or in
/// a V, as the units were built), weighed as `weighed` says (see
/// [`super::stage_set::weigh`]). The LLM starts at stage `entry`; the stages before
/// it are a chained encoder's chunks ([`super::stage_set::prepare`]). `enc` holds the
/// encoders woven into the schedule (none unless `encoders = spread`). With
/// `lockstep`, every task of the LLM's stages counts as one time unit.
pub(crate) fn order(
    ctx: &Ctx,
    weighed: &[Weighed],
    entry: usize,
    lockstep: bool,
    enc: Woven,
) -> Vec<Vec<Task>> {
    let mut run = Scheduler::new(ctx, weighed, entry, lockstep, enc);
    let total = run.tasks();
    let mut placed = 0;
    while placed < total {
        // Each rank's choice: (start time, task); the earliest start wins, the
        // lower rank on ties.
        let mut best: Option<(f64, usize, Task)> = None;
        for r in 0..run.p {
            if let Some((at, task)) = run.pick(r) {
                if best.as_ref().is_none_or(|(b, _, _)| at < *b) {
                    best = Some((at, r, task));
                }
            }
        }
        // Some rank can always move (the oldest micro-batch in flight is never
        // refused). Were none to, the plan would come out incomplete and the
        // verifier's coverage rule would name the missing work: never a hang.
        let Some((at, r, task)) = best else {
            break;
        };
        placed += run.place(r, task, at);
    }
    run.out
}

/// A task a rank may run, with when it can start.
type Pick = Option<(f64, Task)>;

/// Pending weight gradients `(stage, mb)`, in the order of their `B`s.
type Ws = std::collections::VecDeque<(usize, usize)>;

/// The list scheduler's view of the stages and where the schedule stands.
struct Scheduler<'a> {
    /// Stage `k`'s unit id, and what the scheduler weighs of it.
    stages: &'a [UnitId],
    weighed: &'a [Weighed],
    p: usize,
    m: usize,
    s: usize,
    /// Where the LLM starts (the stages before it are a chained encoder's chunks).
    entry: usize,
    lockstep: bool,
    /// In lockstep, a chunk of a chained encoder counts in units of a stage's
    /// forward: the LLM stages' mean forward.
    scale: f64,
    /// Lockstep with a chained encoder (attaching): each LLM task takes one of its
    /// rank's chunk tasks along, of the same kind where one is ready (a chunk's
    /// share of F, B and W is close to its rank's stages'), in no time of the
    /// lockstep's, so every rank's round is its stage task plus its chunk's: the
    /// chunks share out the encoder so that these rounds come out even.
    attach: bool,
    /// Per rank: its stages, the first of them (which admits micro-batches), the
    /// activations one micro-batch holds on all of them, and the memory left for
    /// activations (the limit less the parameters homed there, encoders included,
    /// as they start inline).
    mine: Vec<Vec<usize>>,
    first: Vec<usize>,
    footprint: Vec<f64>,
    room: Vec<f64>,
    /// The most micro-batches in flight on a rank.
    cap: usize,
    /// Per rank: activations reserved, admitted micro-batches in flight, and each
    /// one's stages not done.
    reserved: Vec<f64>,
    live: Vec<usize>,
    left: Vec<Vec<usize>>,
    /// Completion times (None: not yet scheduled).
    f_end: Vec<Vec<Option<f64>>>,
    b_end: Vec<Vec<Option<f64>>>,
    /// The next micro-batch of each stage to forward and to backward (each stage
    /// runs its micro-batches in order).
    next_f: Vec<usize>,
    next_b: Vec<usize>,
    /// Per rank: pending `W`s, and (attaching) a chunk's `W`s, which wait apart
    /// from the stages'.
    pending_w: Vec<Ws>,
    chunk_w: Vec<Ws>,
    /// Per rank: when it is next free, and its order so far.
    clock: Vec<f64>,
    out: Vec<Vec<Task>>,
    /// The woven encoders.
    enc: Woven,
}

impl<'a> Scheduler<'a> {
    fn new(
        ctx: &Ctx<'a>,
        weighed: &'a [Weighed],
        entry: usize,
        lockstep: bool,
        enc: Woven,
    ) -> Scheduler<'a> {
        let (p, m) = (ctx.ranks, ctx.microbatches);
        let s = ctx.stages.len();
        let mine: Vec<Vec<usize>> = (0..p)
            .map(|r| (0..s).filter(|&k| weighed[k].home == r).collect())
            .collect();
        let scale =
            weighed[entry..].iter().map(|x| x.cost.f).sum::<f64>() / (s - entry).max(1) as f64;
        // Admission: a micro-batch enters a rank at its first stage there,
        // reserving the activations of all the rank's stages for it; at most `2 p`
        // at a time and within the room. The oldest micro-batch in flight is never
        // refused (a rank with nothing reserved admits), and the deeper stages of an
        // admitted one never wait for memory, so the schedule always completes.
        // A chained encoder lengthens each micro-batch's round trip by its chunks,
        // and the cap grows with it.
        let cap = 2 * p * s / (s - entry).max(1);
        let room: Vec<f64> = (0..p)
            .map(|r| {
                ctx.memory_limit
                    .map_or(f64::INFINITY, |l| l - homed_params(ctx.units, r))
            })
            .collect();
        let first: Vec<usize> = mine
            .iter()
            .map(|ks| ks.iter().copied().min().unwrap_or(0))
            .collect();
        let footprint: Vec<f64> = mine
            .iter()
            .map(|ks| ks.iter().map(|&k| weighed[k].act).sum())
            .collect();
        Scheduler {
            stages: ctx.stages,
            weighed,
            p,
            m,
            s,
            entry,
            lockstep,
            scale,
            attach: lockstep && entry > 0,
            mine,
            first,
            footprint,
            room,
            cap,
            reserved: vec![0.0f64; p],
            live: vec![0usize; p],
            left: vec![vec![0; m]; p],
            f_end: vec![vec![None; m]; s],
            b_end: vec![vec![None; m]; s],
            next_f: vec![0usize; s],
            next_b: vec![0usize; s],
            pending_w: vec![Default::default(); p],
            chunk_w: vec![Default::default(); p],
            clock: vec![0.0f64; p],
            out: (0..p)
                .map(|_| Vec::with_capacity(3 * m * s / p.max(1)))
                .collect(),
            enc,
        }
    }

    /// How many tasks the schedule holds.
    fn tasks(&self) -> usize {
        let m = self.m;
        self.weighed
            .iter()
            .map(|x| match (x.needs_b, x.trainable) {
                (false, _) => m,
                (true, false) => 2 * m,
                (true, true) => 3 * m,
            })
            .sum::<usize>()
            + self.enc.tasks()
    }

    /// Stage `k`'s costs as the scheduler weighs them (`costs = unit`: the LLM's
    /// tasks one unit each, a chunk's in units of a stage's forward).
    fn cost(&self, k: usize) -> Cost {
        let c = self.weighed[k].cost;
        match (self.lockstep, k < self.entry) {
            (false, _) => c,
            (true, false) => Cost {
                f: 1.0,
                b: 1.0,
                w: 1.0,
            },
            (true, true) => Cost {
                f: c.f / self.scale,
                b: c.b / self.scale,
                w: c.w / self.scale,
            },
        }
    }

    /// When the input of stage `k`'s forward of micro-batch `i` is ready.
    fn f_ready(&self, k: usize, i: usize) -> Option<f64> {
        if k == 0 {
            Some(0.0)
        } else {
            self.f_end[k - 1][i]
        }
    }

    /// When the woven encoders' outputs stage `k` reads for micro-batch `i` are ready.
    fn enc_ready(&self, k: usize, i: usize) -> Option<f64> {
        if k == self.entry {
            self.enc.outputs(i)
        } else {
            Some(0.0)
        }
    }

    /// When the gradient stage `k`'s backward of micro-batch `i` reads is ready.
    fn b_ready(&self, k: usize, i: usize) -> Option<f64> {
        let own = self.f_end[k][i]?;
        if k + 1 == self.s {
            Some(own)
        } else {
            self.b_end[k + 1][i].map(|t| t.max(own))
        }
    }

    /// Whether rank `r` may run stage `k`'s next forward (admission, above).
    fn admits(&self, r: usize, k: usize) -> bool {
        let (live, reserved) = (&self.live, &self.reserved);
        k != self.first[r]
            || (live[r] < self.cap
                && (live[r] == 0 || reserved[r] + self.footprint[r] <= self.room[r]))
    }

    /// Stage `k` of micro-batch `i` is done on rank `r`: its activation is free.
    fn release(&mut self, r: usize, k: usize, i: usize) {
        self.reserved[r] -= self.weighed[k].act;
        self.left[r][i] -= 1;
        if self.left[r][i] == 0 {
            self.live[r] -= 1;
        }
    }

    /// Rank `r`'s next `B` and `F` with their ready times (from its clock `t0` on):
    /// the `B` ready longest first, the `F` of the lowest micro-batch and the
    /// deepest stage; attaching, among the chunks (`chunks`) or the LLM's stages.
    fn candidates(&self, r: usize, t0: f64, chunks: bool) -> (Pick, Pick) {
        let (m, s) = (self.m, self.s);
        let mut b_cand: Option<(f64, usize, usize)> = None; // (ready, mb, stage)
        let mut f_cand: Option<(f64, usize, usize)> = None; // (ready, mb, deeper)
        for &k in self.mine[r]
            .iter()
            .filter(|&&k| !self.attach || (k < self.entry) == chunks)
        {
            let i = self.next_b[k];
            if i < m && self.weighed[k].needs_b {
                if let Some(at) = self.b_ready(k, i) {
                    let key = (at.max(t0), i, k);
                    if b_cand.is_none_or(|c| key < c) {
                        b_cand = Some(key);
                    }
                }
            }
            let i = self.next_f[k];
            if i < m && self.admits(r, k) {
                let ready = self
                    .f_ready(k, i)
                    .and_then(|a| self.enc_ready(k, i).map(|b| a.max(b)));
                if let Some(at) = ready {
                    let key = (at.max(t0), i, s - k);
                    if f_cand.is_none_or(|c| key < c) {
                        f_cand = Some(key);
                    }
                }
            }
        }
        let b_task = b_cand.map(|(at, i, k)| (at, Task::new(Op::B, self.stages[k], i)));
        let f_task = f_cand.map(|(at, i, d)| (at, Task::new(Op::F, self.stages[s - d], i)));
        (b_task, f_task)
    }

    /// Rank `r`'s choice, with when it can start: at the rank's clock a `B`, then an
    /// encoder forward the first stage is about to read, then an `F`, then any
    /// encoder forward, then an encoder backward or a `W`; else the earliest
    /// arrival.
    fn pick(&self, r: usize) -> Pick {
        if self.attach {
            return self.pick_attached(r);
        }
        let t0 = self.clock[r];
        let now = |c: Pick| c.filter(|(at, _)| *at <= t0);
        let (b_task, f_task) = self.candidates(r, t0, false);
        let entry = self.entry;
        let enc_f = self.enc.next_forward(
            r,
            r == self.weighed[entry].home,
            self.next_f[entry],
            self.reserved[r],
            self.room[r],
        );
        let enc_bw = self.enc.next_backward(r, &self.b_end[entry]);
        let bw_task = enc_bw.map(|(at, t)| (at.max(t0), t));
        let urgent = enc_f.filter(|(_, u)| *u).map(|(t, _)| (t0, t));
        let filler = enc_f.map(|(t, _)| (t0, t));
        let w_task = self.pending_w[r]
            .front()
            .map(|&(k, i)| (t0, Task::new(Op::W, self.stages[k], i)));
        now(b_task)
            .or(urgent)
            .or(now(f_task))
            .or(filler)
            .or(now(bw_task))
            .or(w_task)
            .or_else(|| {
                [b_task, f_task, bw_task]
                    .into_iter()
                    .flatten()
                    .min_by(|a, b| a.0.total_cmp(&b.0))
            })
    }

    /// Attaching: the LLM's tasks first (each then takes a chunk's task along,
    /// [`Scheduler::along_with`]), a chunk's task alone only when the rank has no
    /// LLM task to run.
    fn pick_attached(&self, r: usize) -> Pick {
        let t0 = self.clock[r];
        let now = |c: Pick| c.filter(|(at, _)| *at <= t0);
        let (b_task, f_task) = self.candidates(r, t0, false);
        let (cb_task, cf_task) = self.candidates(r, t0, true);
        let w = |ws: &Ws| {
            ws.front()
                .map(|&(k, i)| (t0, Task::new(Op::W, self.stages[k], i)))
        };
        let (w_task, cw_task) = (w(&self.pending_w[r]), w(&self.chunk_w[r]));
        now(b_task)
            .or(now(f_task))
            .or(w_task)
            .or(now(cb_task))
            .or(now(cf_task))
            .or(cw_task)
            .or_else(|| {
                [b_task, f_task, cb_task, cf_task]
                    .into_iter()
                    .flatten()
                    .min_by(|a, b| a.0.total_cmp(&b.0))
            })
    }

    /// Attaching: the chunk task rank `r` takes along with an LLM task of kind `op`
    /// starting at `start` (lockstep time): of the same kind where one is ready,
    /// else a B, an F or a W. Ready means its input came from an earlier round
    /// (done by `start`), so the chain advances one rank per round, as it does in
    /// real time.
    fn along_with(&self, r: usize, op: Op, start: f64) -> Option<Task> {
        let m = self.m;
        let k = *self.mine[r].iter().find(|&&k| k < self.entry)?;
        let b = Some(self.next_b[k])
            .filter(|&i| i < m && self.weighed[k].needs_b)
            .filter(|&i| self.b_ready(k, i).is_some_and(|t| t <= start))
            .map(|i| Task::new(Op::B, self.stages[k], i));
        let f = Some(self.next_f[k])
            .filter(|&i| i < m && self.admits(r, k))
            .filter(|&i| self.f_ready(k, i).is_some_and(|t| t <= start))
            .map(|i| Task::new(Op::F, self.stages[k], i));
        let w = self.chunk_w[r]
            .front()
            .map(|&(k, i)| Task::new(Op::W, self.stages[k], i));
        let same = match op {
            Op::F => f,
            Op::B => b,
            _ => w,
        };
        same.or(b).or(f).or(w)
    }

    /// Runs `task` on rank `r` from `at`, then (attaching) the chunk's task it takes
    /// along: the number of tasks placed.
    fn place(&mut self, r: usize, task: Task, at: f64) -> usize {
        if let Some(end) = self.enc.run(r, task, at) {
            let act = self.enc.act(task.unit);
            match task.op {
                Op::F => self.reserved[r] += act,
                _ => self.reserved[r] -= act,
            }
            self.clock[r] = end;
            self.out[r].push(task);
            return 1;
        }
        let mut placed = 0;
        let mut todo = Some((at, task, false));
        while let Some((at, task, along)) = todo.take() {
            let k = self
                .stages
                .iter()
                .position(|&u| u == task.unit)
                .unwrap_or(0);
            debug_assert_eq!(self.weighed[k].home, r);
            let end = if along {
                at
            } else {
                at + task.op.cost(&self.cost(k))
            };
            let chunk_w = self.attach && k < self.entry;
            match task.op {
                Op::F => {
                    self.f_end[k][task.mb] = Some(end);
                    self.next_f[k] += 1;
                    if k == self.first[r] {
                        self.live[r] += 1;
                        self.reserved[r] += self.footprint[r];
                        let needing = self.mine[r]
                            .iter()
                            .filter(|&&k| self.weighed[k].needs_b)
                            .count();
                        self.left[r][task.mb] = needing;
                        if needing == 0 {
                            self.live[r] -= 1;
                        }
                    }
                }
                Op::B if self.weighed[k].trainable => {
                    self.b_end[k][task.mb] = Some(end);
                    self.next_b[k] += 1;
                    if chunk_w {
                        self.chunk_w[r].push_back((k, task.mb));
                    } else {
                        self.pending_w[r].push_back((k, task.mb));
                    }
                }
                Op::B => {
                    self.b_end[k][task.mb] = Some(end);
                    self.next_b[k] += 1;
                    self.release(r, k, task.mb);
                }
                _ => {
                    if chunk_w {
                        self.chunk_w[r].pop_front();
                    } else {
                        self.pending_w[r].pop_front();
                    }
                    self.release(r, k, task.mb);
                }
            }
            self.clock[r] = end;
            self.out[r].push(task);
            placed += 1;
            if self.attach && !along && k >= self.entry {
                todo = self.along_with(r, task.op, at).map(|t| (end, t, true));
            }
        }
        placed
    }
}

/// `plan` (ZB-2p with one chunk, encoders not yet inlined), or the same with ZB-H1's
/// `order` if that is shorter in the ideal timing and fits the memory limit. The
/// greedy order can come out behind ZB-H1's when `B` is several times `F`; ZB-2p's
/// admission follows the limit, while ZB-H1 holds its `p - r` micro-batches
/// regardless, hence the check.
pub(crate) fn no_worse_than_zbh1(plan: Plan, order: Vec<Vec<Task>>) -> Plan {
    let zbh1 = Plan {
        order,
        ..plan.clone()
    };
    let span = |p: &Plan| {
        dependencies(p)
            .and_then(|d| timing(p, &d))
            .map_or(f64::INFINITY, |t| t.makespan())
    };
    if less(span(&zbh1), span(&plan)) && fits(&zbh1) {
        zbh1
    } else {
        plan
    }
}
