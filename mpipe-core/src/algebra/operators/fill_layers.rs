//! `fill`'s placement layer by layer: the encoder cut into its layers
//! ([`super::layers::cut_encoder`]), each micro-batch's layers on one rank.
//!
//! A whole forward is one task, and a long one may fit no idle gap of the body: the
//! ramps of a pipeline schedule leave many gaps shorter than an encoder's forward. The
//! same encoder as a chain of layers fits where each layer does. For each
//! micro-batch, in order:
//!
//! 1. **Forward.** On each rank, the layers in order, each into the earliest gap
//!    after the layer before it that holds it and ends by the deadline (the first
//!    reader's start in the plan's ideal timing, less the transfer time away from the
//!    reader's rank). Of the ranks that hold the whole chain, the one whose chain
//!    starts latest wins (its activations are held the shortest), lower rank first.
//!    Gaps shrink as they fill; the timing is not recomputed.
//! 2. **No rank holds the chain:** the layers go together, on each rank in turn, as
//!    late in the rank's order as still ends before the deadline, the plan is timed
//!    once per rank, and the rank giving the shortest step wins (among those within
//!    the memory limit, when any is). The timing is then recomputed.
//! 3. **Backward** (trainable encoder): on the forward's rank, last layer first,
//!    after the gradient arrives. Three placements are timed and the fastest within
//!    the memory limit wins: each layer into the first gap after the one before it
//!    that holds it, the rest at the end ("gaps"); all as soon as the gradient is
//!    ready ("eager"); after the rank's other work ("deferred").
//!
//! The caller ([`super::fill::fill`]) keeps this placement only when its ideal step
//! is shorter than the whole encoder's (and within the memory limit when that one is).

use super::fill::{
    charge, fastest, fastest_backward, first_reader, flush, Chain, FillCap, Gaps, Link,
};
use super::insert_all;
use crate::algebra::analysis::{dependencies_lenient, timing, PlanError};
use crate::ir::plan::{Plan, Task, UnitId};
use crate::ir::program::Op;

/// Re-place the work of the encoder cut into `pieces` (first layer first) in `plan`,
/// layer by layer (see the module documentation).
pub(super) fn place_layers(
    mut plan: Plan,
    pieces: &[UnitId],
    link: Link,
    cap: Option<&FillCap>,
) -> Result<Plan, PlanError> {
    let Some(&last) = pieces.last() else {
        return Ok(plan);
    };
    let m = plan.microbatches;
    for list in &mut plan.order {
        list.retain(|t| !pieces.contains(&t.unit));
    }
    plan.input_ships.retain(|s| !pieces.contains(&s.unit));
    let consumers = plan.successors(last);
    let costs: Vec<f64> = pieces.iter().map(|&u| plan.units[u].cost.f).collect();
    let send = link.map_or(0.0, |(lat, bw)| lat + plan.units[last].bytes / bw);
    let chain_tasks = |mb: usize| pieces.iter().map(move |&u| Task::new(Op::F, u, mb));

    let mut time = timing(&plan, &dependencies_lenient(&plan)?)?;
    let mut gaps = Gaps::of(&plan, &time);
    let mut pending: Vec<Vec<(usize, Task)>> = vec![Vec::new(); plan.ranks];
    // The readers never move; the index changes only when a fallback does.
    let mut index = plan.locate();
    let mut spent = 0;
    for mb in 0..m {
        let Some((deadline, home)) = first_reader(&index, &time, &consumers, mb) else {
            // Nobody reads it (cannot happen for an encoder): keep it at its home.
            let r = plan.units[pieces[0]].home;
            pending[r].extend(chain_tasks(mb).map(|t| (0, t)));
            continue;
        };
        // Of the ranks whose gaps hold the whole chain, the one where it starts latest.
        let mut best: Option<Chain> = None;
        for r in 0..plan.ranks {
            let due = if r == home { deadline } else { deadline - send };
            let chain = gaps.try_chain(r, &costs, due);
            if chain.at.len() == costs.len() && best.as_ref().is_none_or(|b| chain.start > b.start)
            {
                best = Some(chain);
            }
        }
        if let Some(chain) = best {
            let r = chain.rank();
            let at = gaps.commit(chain);
            pending[r].extend(at.into_iter().zip(chain_tasks(mb)));
            continue;
        }
        flush(&mut plan, &mut pending);
        charge(&mut spent, &plan, cap)?;
        plan = fallback(plan, pieces, mb, deadline, home, send)?;
        time = timing(&plan, &dependencies_lenient(&plan)?)?;
        index = plan.locate();
        gaps = Gaps::of(&plan, &time);
    }
    flush(&mut plan, &mut pending);
    if !plan.units[last].trainable {
        return Ok(plan);
    }
    place_backward(plan, pieces)
}

/// Places micro-batch `mb`'s layers together (no rank's gaps hold them) on the rank
/// where they lengthen the step least.
fn fallback(
    plan: Plan,
    pieces: &[UnitId],
    mb: usize,
    deadline: f64,
    home: usize,
    send: f64,
) -> Result<Plan, PlanError> {
    let time = timing(&plan, &dependencies_lenient(&plan)?)?;
    let cost: f64 = pieces.iter().map(|&u| plan.units[u].cost.f).sum();
    let best = fastest((0..plan.ranks).map(|r| {
        let due = if r == home { deadline } else { deadline - send };
        let pos = time.end[r].partition_point(|&e| e <= due - cost);
        let mut candidate = plan.clone();
        let items = pieces
            .iter()
            .map(|&u| (pos, Task::new(Op::F, u, mb)))
            .collect();
        insert_all(&mut candidate.order[r], items);
        candidate
    }));
    match best {
        Some(p) => Ok(p),
        None => {
            // Every insertion cycles (cannot happen: the position ends before the
            // reader starts): first on the reader's rank.
            let mut p = plan;
            let items = pieces
                .iter()
                .map(|&u| (0, Task::new(Op::F, u, mb)))
                .collect();
            insert_all(&mut p.order[home], items);
            Ok(p)
        }
    }
}

/// How the backward chains are placed (see the module documentation, step 3).
#[derive(Clone, Copy)]
enum Rule {
    Gaps,
    Eager,
    Deferred,
}

/// A trainable encoder's backwards, layer by layer (a whole encoder: `pieces` of
/// one): the fastest of three placements within the memory limit.
pub(super) fn place_backward(plan: Plan, pieces: &[UnitId]) -> Result<Plan, PlanError> {
    let last = pieces[pieces.len() - 1];
    let time = timing(&plan, &dependencies_lenient(&plan)?)?;
    let index = plan.locate();
    let consumers = plan.successors(last);
    // Last layer first.
    let order: Vec<UnitId> = pieces.iter().rev().copied().collect();
    let costs: Vec<f64> = order
        .iter()
        .map(|&u| Op::BW.cost(&plan.units[u].cost))
        .collect();
    // (rank of the forwards, gradient ready time, the last forward's position + 1,
    // micro-batch), in ready order.
    let mut work: Vec<(usize, f64, usize, usize)> = (0..plan.microbatches)
        .filter_map(|mb| {
            let (r, j) = index.get(Op::F, last, mb)?;
            let ready = consumers
                .iter()
                .filter_map(|&c| index.get(Op::B, c, mb).or_else(|| index.get(Op::BW, c, mb)))
                .map(|(q, i)| time.end[q][i])
                .fold(0.0, f64::max);
            Some((r, ready, j + 1, mb))
        })
        .collect();
    work.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.3.cmp(&b.3)));

    let mut candidates = Vec::new();
    for rule in [Rule::Gaps, Rule::Eager, Rule::Deferred] {
        let mut p = plan.clone();
        let mut gaps = Gaps::of(&plan, &time);
        let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); plan.ranks];
        for &(r, ready, own_f, mb) in &work {
            let n = plan.order[r].len();
            let tasks = order.iter().map(|&u| Task::new(Op::BW, u, mb));
            match rule {
                Rule::Deferred => inserts[r].extend(tasks.map(|t| (n, t))),
                Rule::Eager => {
                    let pos = time.start[r].partition_point(|&s| s < ready).max(own_f);
                    inserts[r].extend(tasks.map(|t| (pos, t)));
                }
                Rule::Gaps => {
                    // The rank's last gap is open-ended: what no earlier gap holds
                    // goes after the rank's other work, in order.
                    let (mut at, mut after) = (ready, own_f);
                    for (t, &c) in tasks.zip(&costs) {
                        match gaps.take_earliest(r, c, at, f64::INFINITY, after) {
                            Some((pos, done)) => {
                                inserts[r].push((pos, t));
                                (at, after) = (done, pos);
                            }
                            None => inserts[r].push((n, t)),
                        }
                    }
                }
            }
        }
        for (r, items) in inserts.into_iter().enumerate() {
            insert_all(&mut p.order[r], items);
        }
        candidates.push(p);
    }
    Ok(fastest_backward(candidates)?.unwrap_or(plan))
}
