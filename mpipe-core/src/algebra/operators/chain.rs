//! `chain(ENCODER, BODY)`: the encoder cut into layer chunks, one per rank, whose
//! work goes into the body's idle time as its timing predicts it.
//!
//! The body's plan is taken as it is (its stages, their order, any other encoder's
//! placement); the encoder's own tasks are taken out and the encoder is replaced by
//! the chunks of [`crate::algebra::units::encoder_chunks`], shared out so that each rank's
//! work (the body's tasks on it plus its chunk) is as even as the layers allow. The
//! chunks form a pipeline into the first stage, each handing its output to a
//! neighbour; each computes on its home rank, so nothing is broadcast or reduced.
//!
//! Placement, in the body's ideal timing (retimed whenever a task had to push
//! others):
//!
//! 1. **Forwards**, micro-batch by micro-batch, chunk by chunk along the chain: each
//!    goes into the earliest idle gap of its rank that starts after its input is
//!    ready (the previous chunk's end plus a transfer) and ends by its deadline
//!    (the first stage's forward of that micro-batch, less what the later chunks
//!    and transfers need). A forward no gap holds goes where it is ready, pushing
//!    the rank's later tasks.
//! 2. **Backwards** (trainable encoder), in the order the first stage's backwards
//!    end, chunk by chunk back along the chain: the input-gradient `B` into the
//!    earliest gap after the gradient is ready, the weight-gradient `W` into the
//!    earliest gap after its `B` (the gap after a rank's last task always holds
//!    them).
//!
//! This is `fill` at a finer grain and without the collectives: with the body in
//! lockstep (`zb2p(costs = unit)`), whose transfers meet on time under rendezvous,
//! the chunks' small tasks fill the gaps that the ranks with less LLM work have
//! anyway, and their transfers ride along with the LLM's between the same
//! neighbours.

use super::fill::{flush, Gaps, Link};
use crate::algebra::analysis::{dependencies_lenient, timing, PlanError, Timing};
use crate::algebra::profile::EncoderProfile;
use crate::algebra::units::{encoder_chunks, replace_with_chunks};
use crate::ir::plan::{Plan, Task, UnitId};
use crate::ir::program::{Op, Unit};

/// Why `chain` cannot apply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChainError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(
        "`{0}` does not feed the first stage in this body (only the first stage may read it), \
         so it cannot be chained into it"
    )]
    NotFeeding(String),
}

/// Replace encoder `enc` of `plan` (described by `spec`) by its chunks and place
/// their work (see the module documentation).
pub fn chain(
    plan: Plan,
    enc: UnitId,
    spec: &EncoderProfile,
    link: Link,
) -> Result<Plan, ChainError> {
    let first = plan.stages.first().copied().unwrap_or(0);
    if plan.successors(enc) != [first] {
        return Err(ChainError::NotFeeding(plan.units[enc].name.clone()));
    }
    // Each rank's work per micro-batch, the encoder's left out.
    let m = plan.microbatches.max(1) as f64;
    let mut load = vec![0.0f64; plan.ranks];
    for (r, list) in plan.order.iter().enumerate() {
        for t in list.iter().filter(|t| t.unit != enc) {
            load[r] += t.op.cost(&plan.units[t.unit].cost) / m;
        }
    }
    let first_home = plan.units[first].home;
    let chunks = encoder_chunks(spec, &load, first_home);
    let n = chunks.len();
    let mut plan = replace_unit(plan, enc, chunks);
    let first = plan.stages[0];
    let trainable = plan.units[0].trainable;
    let send = |u: UnitId| link.map_or(0.0, |(lat, bw)| lat + plan.units[u].bytes / bw);
    let sends: Vec<f64> = (0..n).map(send).collect();
    let home: Vec<usize> = (0..n).map(|c| plan.units[c].home).collect();
    let hop = |c: usize, to: usize| if home[c] == to { 0.0 } else { sends[c] };
    let costs: Vec<crate::ir::program::Cost> = (0..n).map(|c| plan.units[c].cost).collect();
    let cost = |c: usize, op: Op| op.cost(&costs[c]);

    let mut time = retime(&plan)?;
    let mut gaps = Gaps::of(&plan, &time);
    let mut pending: Vec<Vec<(usize, Task)>> = vec![Vec::new(); plan.ranks];
    for mb in 0..plan.microbatches {
        // Latest end of each chunk that leaves the later ones (and the transfers)
        // their time before the first stage reads the output, in `time`.
        let dues = |plan: &Plan, time: &Timing| {
            let reader = plan
                .locate()
                .get(Op::F, first, mb)
                .map_or(f64::INFINITY, |(q, j)| time.start[q][j] - hop(n - 1, q));
            let mut due = vec![reader; n];
            for c in (0..n - 1).rev() {
                due[c] = due[c + 1] - cost(c + 1, Op::F) - hop(c, home[c + 1]);
            }
            due
        };
        // 1. Every chunk into a gap, in chain order.
        let due = dues(&plan, &time);
        let mut trial = gaps.clone();
        let mut items = Vec::with_capacity(n);
        let mut ready = 0.0;
        for c in 0..n {
            let Some((pos, end)) = trial.take_earliest(home[c], cost(c, Op::F), ready, due[c], 0)
            else {
                break;
            };
            items.push((home[c], pos, Task::new(Op::F, c, mb)));
            ready = end + if c + 1 < n { hop(c, home[c + 1]) } else { 0.0 };
        }
        if items.len() == n {
            gaps = trial;
            for (r, pos, task) in items {
                pending[r].push((pos, task));
            }
            continue;
        }
        // 2. Else each chunk as late as its deadline allows, pushing what follows.
        flush(&mut plan, &mut pending);
        time = retime(&plan)?;
        let due = dues(&plan, &time);
        let reader = plan.locate().get(Op::F, first, mb);
        let before = plan.order.clone();
        for c in 0..n {
            let r = home[c];
            let mut pos = time.end[r].partition_point(|&e| e <= due[c] - cost(c, Op::F));
            if let Some((q, j)) = reader.filter(|&(q, _)| q == r) {
                debug_assert_eq!(q, r);
                pos = pos.min(j);
            }
            pending[r].push((pos, Task::new(Op::F, c, mb)));
        }
        flush(&mut plan, &mut pending);
        time = match retime(&plan) {
            Ok(t) => t,
            Err(_) => {
                // 3. Else (a cycle through the pushed tasks) ahead of everything but
                // the chunks' earlier forwards: the chain's forwards never wait for
                // anything else.
                plan.order = before;
                for (c, &r) in home.iter().enumerate() {
                    let lead = plan.order[r]
                        .iter()
                        .take_while(|t| t.op == Op::F && t.unit < n)
                        .count();
                    plan.order[r].insert(lead, Task::new(Op::F, c, mb));
                }
                retime(&plan)?
            }
        };
        gaps = Gaps::of(&plan, &time);
    }
    flush(&mut plan, &mut pending);
    if !trainable {
        return Ok(plan);
    }
    time = retime(&plan)?;
    gaps = Gaps::of(&plan, &time);
    let index = plan.locate();
    let mut order: Vec<(f64, usize)> = (0..plan.microbatches)
        .map(|mb| {
            let at = index
                .get(Op::B, first, mb)
                .or_else(|| index.get(Op::BW, first, mb))
                .map_or(f64::INFINITY, |(q, j)| time.end[q][j] + hop(n - 1, q));
            (at, mb)
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    for (mut ready, mb) in order {
        for c in (0..n).rev() {
            let r = home[c];
            let after = index.get(Op::F, c, mb).map_or(0, |(_, j)| j + 1);
            let (pos, end) = gaps
                .take_earliest(r, cost(c, Op::B), ready, f64::INFINITY, after)
                .unwrap_or((plan.order[r].len(), ready));
            pending[r].push((pos, Task::new(Op::B, c, mb)));
            let (w_pos, _) = gaps
                .take_earliest(r, cost(c, Op::W), end, f64::INFINITY, pos)
                .unwrap_or((plan.order[r].len(), end));
            pending[r].push((w_pos, Task::new(Op::W, c, mb)));
            if c > 0 {
                ready = end + hop(c, home[c - 1]);
            }
        }
    }
    flush(&mut plan, &mut pending);
    Ok(plan)
}

/// `plan` with unit `enc` replaced by `chunks` (first, in data order): ids remapped,
/// the readers of `enc` reading the last chunk, `enc`'s tasks, input transfers and
/// prefetched forwards dropped.
fn replace_unit(plan: Plan, enc: UnitId, chunks: Vec<Unit>) -> Plan {
    let n = chunks.len();
    let id = |u: UnitId| if u < enc { u + n } else { u + n - 1 };
    let units = replace_with_chunks(&plan.units, enc, chunks);
    let order = plan
        .order
        .iter()
        .map(|list| {
            list.iter()
                .filter(|t| t.unit != enc)
                .map(|t| Task::new(t.op, id(t.unit), t.mb))
                .collect()
        })
        .collect();
    let mut input_ships: Vec<_> = plan
        .input_ships
        .iter()
        .filter(|s| s.unit != enc)
        .map(|s| crate::ir::plan::InputShip {
            unit: id(s.unit),
            ..*s
        })
        .collect();
    input_ships.sort();
    let prefetch = plan
        .prefetch
        .iter()
        .filter(|&&(u, _)| u != enc)
        .map(|&(u, mb)| (id(u), mb))
        .collect();
    Plan {
        units,
        stages: plan.stages.iter().map(|&u| id(u)).collect(),
        encoders: (0..n)
            .chain(plan.encoders.iter().filter(|&&u| u != enc).map(|&u| id(u)))
            .collect(),
        order,
        input_ships,
        prefetch,
        ..plan
    }
}

fn retime(plan: &Plan) -> Result<Timing, PlanError> {
    timing(plan, &dependencies_lenient(plan)?)
}
