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
use crate::ir::plan::{Plan, Task};
use crate::ir::program::{Cost, Op};

/// The schedule of the context's stages, each on its unit's home rank (looped or in
/// a V, as the units were built), weighed as `weighed` says (see
/// [`super::stage_set::weigh`]). The LLM starts at stage `entry`; the stages before it are
/// a chained encoder's chunks ([`super::stage_set::prepare`]). `enc` holds the encoders
/// woven into the schedule (none unless `encoders = spread`). With `lockstep`, every
/// task of the LLM's stages counts as one time unit.
pub(crate) fn order(
    ctx: &Ctx,
    weighed: &[Weighed],
    entry: usize,
    lockstep: bool,
    mut enc: Woven,
) -> Vec<Vec<Task>> {
    let (p, m) = (ctx.ranks, ctx.microbatches);
    let s = ctx.stages.len();
    let home = |k: usize| weighed[k].home;
    let mine: Vec<Vec<usize>> = (0..p)
        .map(|r| (0..s).filter(|&k| home(k) == r).collect())
        .collect();
    let unit = Cost {
        f: 1.0,
        b: 1.0,
        w: 1.0,
    };
    // In lockstep, a chunk of a chained encoder counts in units of a stage's forward.
    let scale = weighed[entry..].iter().map(|x| x.cost.f).sum::<f64>() / (s - entry).max(1) as f64;
    let cost = |k: usize| {
        let c = weighed[k].cost;
        match (lockstep, k < entry) {
            (false, _) => c,
            (true, false) => unit,
            (true, true) => Cost {
                f: c.f / scale,
                b: c.b / scale,
                w: c.w / scale,
            },
        }
    };
    let trainable = |k: usize| weighed[k].trainable;
    let needs_b = |k: usize| weighed[k].needs_b;
    let act = |k: usize| weighed[k].act;
    // Lockstep with a chained encoder (attaching): each LLM task takes one of its
    // rank's chunk tasks along, of the same kind where one is ready (a chunk's share
    // of F, B and W is close to its rank's stages'), in no time of the lockstep's,
    // so every rank's round is its stage task plus its chunk's: the chunks share
    // out the encoder so that these rounds come out even.
    let attach = lockstep && entry > 0;
    // Admission: a micro-batch enters a rank at its first stage there, reserving
    // the activations of all the rank's stages for it; at most `2 p` at a time and
    // within the room. The oldest micro-batch in flight is never refused (a rank
    // with nothing reserved admits), and the deeper stages of an admitted one
    // never wait for memory, so the schedule always completes.
    // A chained encoder lengthens each micro-batch's round trip by its chunks, and
    // the cap grows with it.
    let cap = 2 * p * s / (s - entry).max(1);
    // Memory left for activations on each rank: the limit less the parameters of
    // the units homed there (encoders included, as they start inline).
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
        .map(|ks| ks.iter().map(|&k| act(k)).sum())
        .collect();
    let mut reserved = vec![0.0f64; p];
    // Per rank: admitted micro-batches in flight, and each one's stages not done.
    let mut live = vec![0usize; p];
    let mut left: Vec<Vec<usize>> = vec![vec![0; m]; p];
    // Completion times (None: not yet scheduled).
    let mut f_end: Vec<Vec<Option<f64>>> = vec![vec![None; m]; s];
    let mut b_end: Vec<Vec<Option<f64>>> = vec![vec![None; m]; s];
    // Per rank: the next micro-batch of each of its stages to forward and to
    // backward (each stage runs its micro-batches in order), pending Ws, clock.
    let mut next_f = vec![0usize; s];
    let mut next_b = vec![0usize; s];
    let mut pending_w: Vec<std::collections::VecDeque<(usize, usize)>> =
        vec![Default::default(); p];
    let mut clock = vec![0.0f64; p];
    let mut out: Vec<Vec<Task>> = vec![Vec::with_capacity(3 * m * s / p.max(1)); p];
    let total: usize = (0..s)
        .map(|k| match (needs_b(k), trainable(k)) {
            (false, _) => m,
            (true, false) => 2 * m,
            (true, true) => 3 * m,
        })
        .sum::<usize>()
        + enc.tasks();
    let mut placed = 0;
    let f_ready = |f_end: &Vec<Vec<Option<f64>>>, k: usize, i: usize| -> Option<f64> {
        if k == 0 {
            Some(0.0)
        } else {
            f_end[k - 1][i]
        }
    };
    let enc_ready = |enc: &Woven, k: usize, i: usize| -> Option<f64> {
        if k == entry {
            enc.outputs(i)
        } else {
            Some(0.0)
        }
    };
    let b_ready = |f_end: &Vec<Vec<Option<f64>>>,
                   b_end: &Vec<Vec<Option<f64>>>,
                   k: usize,
                   i: usize|
     -> Option<f64> {
        let own = f_end[k][i]?;
        if k + 1 == s {
            Some(own)
        } else {
            b_end[k + 1][i].map(|t| t.max(own))
        }
    };
    // Stage `k` of micro-batch `i` is done on rank `r`: its activation is free.
    let release = |reserved: &mut Vec<f64>,
                   live: &mut Vec<usize>,
                   left: &mut Vec<Vec<usize>>,
                   r: usize,
                   k: usize,
                   i: usize| {
        reserved[r] -= act(k);
        left[r][i] -= 1;
        if left[r][i] == 0 {
            live[r] -= 1;
        }
    };
    // Attaching (see `attach` above): a chunk's `W`s wait apart from the stages'.
    let mut chunk_w: Vec<std::collections::VecDeque<(usize, usize)>> = vec![Default::default(); p];
    let admits = |live: &[usize], reserved: &[f64], r: usize, k: usize| {
        k != first[r] || (live[r] < cap && (live[r] == 0 || reserved[r] + footprint[r] <= room[r]))
    };
    // Attaching: the chunk task rank `r` takes along with an LLM task of kind `op`
    // starting at `start` (lockstep time): of the same kind where one is ready,
    // else a B, an F or a W. Ready means its input came from an earlier round (done
    // by `start`), so the chain advances one rank per round, as it does in real
    // time.
    #[allow(clippy::too_many_arguments)]
    let along_with = |r: usize,
                      op: Op,
                      start: f64,
                      next_f: &[usize],
                      next_b: &[usize],
                      f_end: &Vec<Vec<Option<f64>>>,
                      b_end: &Vec<Vec<Option<f64>>>,
                      cw: &std::collections::VecDeque<(usize, usize)>,
                      live: &[usize],
                      reserved: &[f64]|
     -> Option<Task> {
        let k = *mine[r].iter().find(|&&k| k < entry)?;
        let b = Some(next_b[k])
            .filter(|&i| i < m && needs_b(k))
            .filter(|&i| b_ready(f_end, b_end, k, i).is_some_and(|t| t <= start))
            .map(|i| Task::new(Op::B, ctx.stages[k], i));
        let f = Some(next_f[k])
            .filter(|&i| i < m && admits(live, reserved, r, k))
            .filter(|&i| f_ready(f_end, k, i).is_some_and(|t| t <= start))
            .map(|i| Task::new(Op::F, ctx.stages[k], i));
        let w = cw.front().map(|&(k, i)| Task::new(Op::W, ctx.stages[k], i));
        let same = match op {
            Op::F => f,
            Op::B => b,
            _ => w,
        };
        same.or(b).or(f).or(w)
    };
    while placed < total {
        // Each rank's choice: (start time, task); the earliest start wins.
        let mut best: Option<(f64, usize, Task)> = None;
        for r in 0..p {
            let t0 = clock[r];
            // Ready times of the candidates of each kind: the LLM's stages and the
            // chunks apart when attaching, all together otherwise.
            let cands = |chunks: bool| {
                let mut b_cand: Option<(f64, usize, usize)> = None; // (ready, mb, stage)
                let mut f_cand: Option<(f64, usize, usize)> = None; // (ready, mb, deeper)
                for &k in mine[r]
                    .iter()
                    .filter(|&&k| !attach || (k < entry) == chunks)
                {
                    let i = next_b[k];
                    if i < m && needs_b(k) {
                        if let Some(at) = b_ready(&f_end, &b_end, k, i) {
                            let key = (at.max(t0), i, k);
                            if b_cand.is_none_or(|c| key < c) {
                                b_cand = Some(key);
                            }
                        }
                    }
                    let i = next_f[k];
                    if i < m && admits(&live, &reserved, r, k) {
                        let ready = f_ready(&f_end, k, i)
                            .and_then(|a| enc_ready(&enc, k, i).map(|b| a.max(b)));
                        if let Some(at) = ready {
                            let key = (at.max(t0), i, s - k);
                            if f_cand.is_none_or(|c| key < c) {
                                f_cand = Some(key);
                            }
                        }
                    }
                }
                let b_task = b_cand.map(|(at, i, k)| (at, Task::new(Op::B, ctx.stages[k], i)));
                let f_task = f_cand.map(|(at, i, d)| (at, Task::new(Op::F, ctx.stages[s - d], i)));
                (b_task, f_task)
            };
            let now = |c: Option<(f64, Task)>| c.filter(|(at, _)| *at <= t0);
            if attach {
                // The LLM's tasks first (each then takes a chunk's task along),
                // a chunk's task alone only when the rank has no LLM task to run.
                let (b_task, f_task) = cands(false);
                let (cb_task, cf_task) = cands(true);
                let w_task = pending_w[r]
                    .front()
                    .map(|&(k, i)| (t0, Task::new(Op::W, ctx.stages[k], i)));
                let cw_task = chunk_w[r]
                    .front()
                    .map(|&(k, i)| (t0, Task::new(Op::W, ctx.stages[k], i)));
                let pick = now(b_task)
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
                    });
                if let Some(pick) = pick {
                    if best.as_ref().is_none_or(|(at, _, _)| pick.0 < *at) {
                        best = Some((pick.0, r, pick.1));
                    }
                }
                continue;
            }
            let (b_task, f_task) = cands(false);
            let w_cand = pending_w[r].front().copied();
            let enc_f = enc.next_forward(r, r == home(entry), next_f[entry], reserved[r], room[r]);
            let enc_bw = enc.next_backward(r, &b_end[entry]);
            // At the rank's clock: B, then an encoder forward the first stage is
            // about to read, then F, then any encoder forward, then an encoder
            // backward or a W; else the earliest arrival.
            let bw_task = enc_bw.map(|(at, t)| (at.max(t0), t));
            let urgent = enc_f.filter(|(_, u)| *u).map(|(t, _)| (t0, t));
            let filler = enc_f.map(|(t, _)| (t0, t));
            let w_task = w_cand.map(|(k, i)| (t0, Task::new(Op::W, ctx.stages[k], i)));
            let pick = now(b_task)
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
                });
            let Some(pick) = pick else {
                continue;
            };
            if best.as_ref().is_none_or(|(at, _, _)| pick.0 < *at) {
                best = Some((pick.0, r, pick.1));
            }
        }
        // Some rank can always move (the oldest micro-batch in flight is never
        // refused). Were none to, the plan would come out incomplete and the
        // verifier's coverage rule would name the missing work: never a hang.
        let Some((at, r, task)) = best else {
            break;
        };
        if let Some(end) = enc.run(r, task, at) {
            let act = enc.act(task.unit);
            match task.op {
                Op::F => reserved[r] += act,
                _ => reserved[r] -= act,
            }
            clock[r] = end;
            out[r].push(task);
            placed += 1;
            continue;
        }
        // The task, then (attaching) a chunk's task it takes along.
        let mut todo = Some((at, task, false));
        while let Some((at, task, along)) = todo.take() {
            let k = ctx.stages.iter().position(|&u| u == task.unit).unwrap_or(0);
            debug_assert_eq!(home(k), r);
            let end = if along {
                at
            } else {
                at + task.op.cost(&cost(k))
            };
            match task.op {
                Op::F => {
                    f_end[k][task.mb] = Some(end);
                    next_f[k] += 1;
                    if k == first[r] {
                        live[r] += 1;
                        reserved[r] += footprint[r];
                        left[r][task.mb] = mine[r].iter().filter(|&&k| needs_b(k)).count();
                        if left[r][task.mb] == 0 {
                            live[r] -= 1;
                        }
                    }
                }
                Op::B if trainable(k) => {
                    b_end[k][task.mb] = Some(end);
                    next_b[k] += 1;
                    if attach && k < entry {
                        chunk_w[r].push_back((k, task.mb));
                    } else {
                        pending_w[r].push_back((k, task.mb));
                    }
                }
                Op::B => {
                    b_end[k][task.mb] = Some(end);
                    next_b[k] += 1;
                    release(&mut reserved, &mut live, &mut left, r, k, task.mb);
                }
                _ => {
                    if attach && k < entry {
                        chunk_w[r].pop_front();
                    } else {
                        pending_w[r].pop_front();
                    }
                    release(&mut reserved, &mut live, &mut left, r, k, task.mb);
                }
            }
            clock[r] = end;
            out[r].push(task);
            placed += 1;
            if attach && !along && k >= entry {
                todo = along_with(
                    r,
                    task.op,
                    at,
                    &next_f,
                    &next_b,
                    &f_end,
                    &b_end,
                    &chunk_w[r],
                    &live,
                    &reserved,
                )
                .map(|t| (end, t, true));
            }
        }
    }
    out
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
    if span(&zbh1) < span(&plan) && fits(&zbh1) {
        zbh1
    } else {
        plan
    }
}
