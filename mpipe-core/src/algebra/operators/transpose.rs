//! `transpose(ENCODER, BODY)`: MPipe's schedule.
//!
//! The encoder's per-micro-batch forward leaves the first stage's rank: micro-batch
//! `m` runs on rank `m mod n` with `n = min(ranks, microbatches)`
//! ([`Owners::RoundRobin`]), or only the first `n` are spread and the rest stay
//! inline on the first stage's rank ([`Owners::Min`], the authors' reference
//! implementation). That turns the stage x micro-batch placement grid on its side:
//! placement becomes a function of the micro-batch.
//!
//! Where in a rank's order the work goes:
//! - the first `n` micro-batches' forwards open their owners' lists: the warm-up
//!   time in which those ranks would otherwise wait for the first activation;
//! - later forwards (round robin) go as late in the owner's order as still lets them
//!   finish before the first stage needs them, by the plan's ideal timing;
//! - a trainable encoder's backward either runs where its forward ran, as early as
//!   the first stage's gradient allows ([`Backward::Local`]; the lowering then adds
//!   the parameter broadcast and gradient reduction), or is recomputed from the
//!   shipped input and run on the first stage's rank right after that stage's
//!   backward ([`Backward::Central`]). A frozen encoder has no backward.

use super::insert_all;
use crate::algebra::analysis::{
    dependencies, dependencies_lenient, peak_memory, timing, PlanError,
};
use crate::ir::plan::{InputShip, Plan, Task, UnitId};
use crate::ir::program::Op;

/// Which ranks own which micro-batches' encoder work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Owners {
    #[default]
    RoundRobin,
    Min,
    /// Round robin over the ranks with spare time: all but those whose stages carry
    /// the most work (the step's bottleneck, which encoder work would lengthen).
    Spare,
}

/// Where a trainable encoder's backward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backward {
    #[default]
    Local,
    Central,
}

/// Re-place encoder `enc`'s work in `plan`.
pub fn transpose(
    mut plan: Plan,
    enc: UnitId,
    owners: Owners,
    backward: Backward,
) -> Result<Plan, PlanError> {
    let (p, m) = (plan.ranks, plan.microbatches);
    let first = plan.stages[0];
    let r0 = plan.units[first].home;
    // The ranks that own micro-batches, in turn from the first stage's.
    let ring: Vec<usize> = match owners {
        Owners::Spare => {
            let work: Vec<f64> = (0..p)
                .map(|r| {
                    plan.stages
                        .iter()
                        .filter(|&&u| plan.units[u].home == r)
                        .map(|&u| {
                            plan.units[u].cost.f + plan.units[u].cost.b + plan.units[u].cost.w
                        })
                        .sum()
                })
                .collect();
            let most = work.iter().copied().fold(0.0, f64::max);
            let spare: Vec<usize> = (0..p)
                .map(|i| (r0 + i) % p)
                .filter(|&r| work[r] < most * (1.0 - 1e-9))
                .collect();
            if spare.is_empty() {
                (0..p).map(|i| (r0 + i) % p).collect()
            } else {
                spare
            }
        }
        _ => (0..p).map(|i| (r0 + i) % p).collect(),
    };
    let n = ring.len().min(m);
    let owner = |mb: usize| match owners {
        Owners::RoundRobin | Owners::Spare => ring[mb % n],
        Owners::Min if mb < n => ring[mb],
        Owners::Min => r0,
    };
    let trainable = plan.units[enc].trainable;
    let c_f = plan.units[enc].cost.f;
    for list in &mut plan.order {
        list.retain(|t| t.unit != enc);
    }
    plan.input_ships.retain(|s| s.unit != enc);

    // 1. The warm-up prefix, and (owners = min) the inline rest.
    for mb in 0..n {
        plan.order[owner(mb)].insert(0, Task::new(Op::F, enc, mb));
    }
    let mut inline = Vec::new();
    for (i, t) in plan.order[r0].iter().enumerate() {
        if t.unit == first && t.op == Op::F && t.mb >= n && owner(t.mb) == r0 {
            inline.push((i, Task::new(Op::F, enc, t.mb)));
        }
    }
    insert_all(&mut plan.order[r0], inline);

    // 2. Round robin: later forwards as late as still meets the first stage's need.
    if owners != Owners::Min && m > n {
        let timed = timing(&plan, &dependencies_lenient(&plan)?)?;
        let index = plan.locate();
        let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
        for mb in n..m {
            let k = owner(mb);
            if k == r0 {
                continue; // already inline before the first stage's forward
            }
            let Some((q, j)) = index.get(Op::F, first, mb) else {
                continue;
            };
            let deadline = timed.start[q][j] - c_f;
            let ends = &timed.end[k];
            // Positions are relative to the rank's own tasks: when the inserted work
            // slows the pipeline, it slows the first stage's need by as much, so the
            // encoder forward stays next to the work it feeds (no drift ahead, no
            // growth of held activations with the micro-batch count).
            let from = inserts[k].last().map_or(0, |&(pos, _)| pos);
            let mut pos = from;
            while pos < ends.len() && ends[pos] <= deadline {
                pos += 1;
            }
            inserts[k].push((pos, Task::new(Op::F, enc, mb)));
        }
        for (k, items) in inserts.into_iter().enumerate() {
            insert_all(&mut plan.order[k], items);
        }
    }

    if !trainable {
        return Ok(plan);
    }

    // 3. The backward: two placements. Eager: each encoder backward as soon as its
    // gradient is ready. Deferred: after the rank's other work, so the first stage's
    // backwards (which other ranks wait for) are not held up by encoder work nobody
    // waits for; but every encoder activation is then held to the end. The faster
    // one wins among those within the profile's memory limit (so without a limit a
    // trainable encoder may hold all its activations to the end of the step).
    let mut candidates = Vec::new();
    for deferred in [false, true] {
        let candidate = place_backward(&plan, enc, &owner, backward, deferred)?;
        let span = timing(&candidate, &dependencies(&candidate)?)?.makespan();
        let peak = peak_memory(&candidate).into_iter().fold(0.0, f64::max);
        candidates.push((span, peak, candidate));
    }
    let fits = |peak: f64| plan.memory_limit.is_none_or(|limit| peak <= limit);
    let mut best: Option<(f64, f64, Plan)> = None;
    for (span, peak, candidate) in candidates {
        let better = match &best {
            None => true,
            Some((b_span, b_peak, _)) => match (fits(peak), fits(*b_peak)) {
                (true, false) => true,
                (false, true) => false,
                _ if span < *b_span => true,
                _ if span == *b_span => peak < *b_peak,
                _ => false,
            },
        };
        if better {
            best = Some((span, peak, candidate));
        }
    }
    let Some((_, _, mut plan)) = best else {
        return Ok(plan);
    };
    plan.input_ships.sort();
    Ok(plan)
}

/// Place encoder `enc`'s backward (see [`transpose`]); `deferred` appends each rank's
/// share at the end of its order instead of as early as its gradient allows.
fn place_backward(
    plan: &Plan,
    enc: UnitId,
    owner: &dyn Fn(usize) -> usize,
    backward: Backward,
    deferred: bool,
) -> Result<Plan, PlanError> {
    let mut plan = plan.clone();
    let (p, m) = (plan.ranks, plan.microbatches);
    let first = plan.stages[0];
    let r0 = plan.units[first].home;
    let after_first_backward = |plan: &Plan, mb: usize| {
        if deferred {
            return plan.order[r0].len();
        }
        plan.order[r0]
            .iter()
            .position(|t| t.unit == first && t.mb == mb && matches!(t.op, Op::B | Op::BW))
            .map_or(plan.order[r0].len(), |i| i + 1)
    };
    let mut at_r0 = Vec::new();
    let mut remote: Vec<(usize, usize)> = Vec::new();
    for mb in 0..m {
        let k = owner(mb);
        if k == r0 {
            at_r0.push((after_first_backward(&plan, mb), Task::new(Op::BW, enc, mb)));
        } else if backward == Backward::Central {
            let pos = after_first_backward(&plan, mb);
            at_r0.push((pos, Task::new(Op::RF, enc, mb)));
            at_r0.push((pos, Task::new(Op::BW, enc, mb)));
            plan.input_ships.push(InputShip {
                unit: enc,
                mb,
                from: k,
                to: r0,
            });
        } else {
            remote.push((mb, k));
        }
    }
    if !remote.is_empty() {
        let timed = timing(&plan, &dependencies_lenient(&plan)?)?;
        let index = plan.locate();
        let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
        for (mb, k) in remote {
            let pos = if deferred {
                plan.order[k].len()
            } else {
                let ready = index
                    .get(Op::B, first, mb)
                    .or_else(|| index.get(Op::BW, first, mb))
                    .map_or(0.0, |(q, j)| timed.end[q][j]);
                let own_f = index.get(Op::F, enc, mb).map_or(0, |(_, j)| j + 1);
                timed.start[k].partition_point(|&s| s < ready).max(own_f)
            };
            inserts[k].push((pos, Task::new(Op::BW, enc, mb)));
        }
        for (k, items) in inserts.into_iter().enumerate() {
            insert_all(&mut plan.order[k], items);
        }
    }
    insert_all(&mut plan.order[r0], at_r0);
    Ok(plan)
}
