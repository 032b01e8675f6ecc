//! `prefetch(ENCODER, BODY)`: a frozen encoder's forwards for the next step, in this
//! step's idle time.
//!
//! A frozen encoder's forward does not depend on the step's parameter update, so the
//! forward of the next step's micro-batch `j` may run during this step (in its
//! cool-down, or any idle gap), and the next step's first stage then starts on it at
//! once instead of waiting for the encoder. In the steady state of a training loop
//! every step looks alike, so the program of one step holds, for each prefetched
//! micro-batch, the forward (and transfer) computing the *next* step's, while this
//! step's first stage reads what the previous step left (`Program::prefetch`; the
//! first step of a run needs a prologue that computes them once).
//!
//! Which forwards: the first `k` micro-batches' (the ones the ramp-up waits for),
//! for the `k` that gives the shortest ideal step; every `k` up to `2 x ranks` is
//! tried, and larger ones while the step keeps getting shorter. Where: the `k`
//! forwards are taken out of the step, and each goes into the idle gap (on any rank)
//! that starts latest and still ends within the step's ideal time, or else at the
//! end of the rank that finishes first. `k = 0` (the body unchanged) is a candidate,
//! so the result's ideal step is never longer than the body's. The transfers to the
//! reading ranks are added by the lowering, after the rest of the step.

use super::fill::Gaps;
use super::insert_all;
use crate::analysis::{dependencies, timing, PlanError};
use crate::plan::{Plan, Task, UnitId};
use crate::program::Op;

/// Prefetch frozen encoder `enc`'s first forwards where that shortens `plan`'s ideal
/// step. The caller checks that `enc` has no backward.
pub fn prefetch(plan: Plan, enc: UnitId) -> Result<Plan, PlanError> {
    let span =
        |p: &Plan| -> Result<f64, PlanError> { Ok(timing(p, &dependencies(p)?)?.makespan()) };
    let mut best = (span(&plan)?, plan.clone());
    let always = (2 * plan.ranks).min(plan.microbatches);
    for k in 1..=plan.microbatches {
        let cand = with_prefix(&plan, enc, k)?;
        let s = span(&cand)?;
        let improved = s < best.0;
        if improved {
            best = (s, cand);
        }
        if k >= always && !improved {
            break;
        }
    }
    Ok(best.1)
}

/// `plan` with the forwards of micro-batches `0..k` of `enc` prefetched and placed.
fn with_prefix(plan: &Plan, enc: UnitId, k: usize) -> Result<Plan, PlanError> {
    let mut cand = plan.clone();
    for list in &mut cand.order {
        list.retain(|t| !(t.unit == enc && t.op == Op::F && t.mb < k));
    }
    for mb in 0..k {
        if let Err(i) = cand.prefetch.binary_search(&(enc, mb)) {
            cand.prefetch.insert(i, (enc, mb));
        }
    }
    let time = timing(&cand, &dependencies(&cand)?)?;
    let end = time.makespan();
    let cost = cand.units[enc].cost.f;
    let mut gaps = Gaps::of(&cand, &time);
    let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); cand.ranks];
    let mut tails: Vec<f64> = (0..cand.ranks)
        .map(|r| time.end[r].last().copied().unwrap_or(0.0))
        .collect();
    for mb in 0..k {
        let task = Task::new(Op::F, enc, mb);
        match gaps.take(cost, end, 0, 0.0) {
            Some((r, pos)) => inserts[r].push((pos, task)),
            None => {
                let r = (0..cand.ranks)
                    .min_by(|&a, &b| tails[a].total_cmp(&tails[b]))
                    .unwrap_or(0);
                tails[r] += cost;
                inserts[r].push((cand.order[r].len(), task));
            }
        }
    }
    for (r, items) in inserts.into_iter().enumerate() {
        insert_all(&mut cand.order[r], items);
    }
    Ok(cand)
}
