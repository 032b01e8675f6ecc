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
//!
//! **Layer by layer.** A whole forward is one task, and a long one may fit no idle
//! gap: the ramps of a pipeline schedule leave many short gaps. So the search also
//! tries the encoder cut into its layers (`vision/0`, `vision/1`, ...; see
//! [`cut_encoder`]): each prefetched micro-batch's layers run on one rank, in order,
//! each into the earliest gap (after the layer before it) that holds it, and the
//! layers no gap holds at the end of that rank; the rank is the one that leaves the
//! least to its end (the one finishing first on ties). A prefetched layer reads the
//! layer before it from this step (both compute the next step's; see
//! [`Plan::prefetch`]), so no transfer is needed between them, and only the last
//! layer's activation is sent to the reader, as a whole forward's is. The cut wins
//! only when its ideal step is strictly shorter than every whole placement's.

use super::fill::{Chain, Gaps};
use super::insert_all;
use super::layers::cut_encoder;
use crate::algebra::analysis::{dependencies, timing, PlanError};
use crate::algebra::profile::Profile;
use crate::ir::compare::less;
use crate::ir::plan::{Plan, Task, UnitId};
use crate::ir::program::Op;

/// Prefetch frozen encoder `enc`'s first forwards where that shortens `plan`'s ideal
/// step, whole or layer by layer (layers from `profile`). The caller checks that
/// `enc` has no backward.
pub fn prefetch(plan: Plan, enc: UnitId, profile: &Profile) -> Result<Plan, PlanError> {
    let span =
        |p: &Plan| -> Result<f64, PlanError> { Ok(timing(p, &dependencies(p)?)?.makespan()) };
    let mut best = (span(&plan)?, plan.clone());
    let always = (2 * plan.ranks).min(plan.microbatches);
    let cut = cut_encoder(&plan, profile, enc);
    // Whole forwards, then layers; each its own run of `k`: every `k` up to
    // `always`, then, while the step keeps getting shorter, every `k` (whole) or
    // every `ranks`-th (layers, whose plans are many times larger to time).
    let mut search = |place: &dyn Fn(usize) -> Result<Plan, PlanError>,
                      stride: usize|
     -> Result<(), PlanError> {
        let mut run_best = f64::INFINITY;
        let ks = (1..=always).chain(
            (always + stride..plan.microbatches + stride)
                .step_by(stride)
                .map(|k| k.min(plan.microbatches)),
        );
        for k in ks {
            let cand = place(k)?;
            let s = span(&cand)?;
            let improved = less(s, run_best);
            run_best = run_best.min(s);
            if less(s, best.0) {
                best = (s, cand);
            }
            if k >= always && !improved {
                break;
            }
        }
        Ok(())
    };
    search(&|k| with_prefix(&plan, enc, k), 1)?;
    if let Some((cut, pieces)) = &cut {
        search(&|k| with_layers(cut, pieces, k), plan.ranks.max(1))?;
    }
    Ok(best.1)
}

/// `plan` (with the encoder cut into `pieces`, first layer first) with the layers of
/// micro-batches `0..k` prefetched and placed (see the module doc).
fn with_layers(plan: &Plan, pieces: &[UnitId], k: usize) -> Result<Plan, PlanError> {
    let mut cand = plan.clone();
    for list in &mut cand.order {
        list.retain(|t| !(t.op == Op::F && t.mb < k && pieces.contains(&t.unit)));
    }
    for mb in 0..k {
        for &u in pieces {
            if let Err(i) = cand.prefetch.binary_search(&(u, mb)) {
                cand.prefetch.insert(i, (u, mb));
            }
        }
    }
    let time = timing(&cand, &dependencies(&cand)?)?;
    let end = time.makespan();
    let costs: Vec<f64> = pieces.iter().map(|&u| cand.units[u].cost.f).collect();
    let mut gaps = Gaps::of(&cand, &time);
    let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); cand.ranks];
    let mut tails: Vec<f64> = (0..cand.ranks)
        .map(|r| time.end[r].last().copied().unwrap_or(0.0))
        .collect();
    for mb in 0..k {
        // On each rank: how many layers the gaps hold, and what the rest adds.
        let mut best: Option<(f64, f64, Chain)> = None;
        for (r, &rank_tail) in tails.iter().enumerate() {
            let chain = gaps.try_chain(r, &costs, end);
            let rest: f64 = costs[chain.at.len()..].iter().sum();
            let tail = if rest > 0.0 { rank_tail + rest } else { 0.0 };
            if best
                .as_ref()
                .is_none_or(|(b_rest, b_tail, _)| (rest, tail) < (*b_rest, *b_tail))
            {
                best = Some((rest, tail, chain));
            }
        }
        let Some((rest, _, chain)) = best else {
            break;
        };
        let r = chain.rank();
        let at = gaps.commit(chain);
        let n = cand.order[r].len();
        for (j, &u) in pieces.iter().enumerate() {
            let pos = at.get(j).copied().unwrap_or(n);
            inserts[r].push((pos, Task::new(Op::F, u, mb)));
        }
        if rest > 0.0 {
            // The rank's end is taken: later layers cannot go before these.
            tails[r] += rest;
            gaps.close_end(r);
        }
    }
    for (r, items) in inserts.into_iter().enumerate() {
        insert_all(&mut cand.order[r], items);
    }
    Ok(cand)
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
