//! `host(ENCODER, BODY, rank = N | spare)`: the encoder moves, parameters and all, to
//! one rank, as a pipeline stage of its own in front of the first LLM stage.
//!
//! `transpose` and `fill` spread an encoder's micro-batches over ranks but leave its
//! parameters on its home, the first stage's rank, so a trainable encoder computed
//! elsewhere costs a parameter broadcast before its first forward and a gradient
//! reduction after its last weight gradient (docs/spec/program-format.md rule 4). When the
//! first stage's rank is the busiest (a V layout puts the first and the last stage,
//! with the LM head, on rank 0) and another rank has room for the encoder's whole
//! work, it is cheaper to move the encoder there for good: its home becomes that
//! rank, it computes only there, and what crosses ranks is one output (and one
//! gradient) per micro-batch, as between any two pipeline stages.
//!
//! Where on the rank: the encoder's tasks are placed as `fill` places them (its
//! forwards into the rank's idle gaps before the first stage reads them, else as late
//! as still in time; a trainable encoder's backwards by the fastest of three rules
//! within the memory limit), restricted to the host rank. `rank = spare` picks the
//! rank with the least compute in the body without this encoder (the lowest such
//! rank on ties), so `host(vision, host(audio, zbv, rank = spare), rank = spare)`
//! spreads two encoders over the two least busy ranks.

use super::fill::{place, FillCap, Link};
use crate::algebra::analysis::PlanError;
use crate::ir::plan::{Plan, UnitId};

/// Which rank hosts the encoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    /// This rank.
    Rank(usize),
    /// The rank with the least compute in the body without the encoder.
    Spare,
}

/// Move encoder `enc` of `plan`, home and tasks, to the rank `host` names (see the
/// module documentation). The caller checks that a `Host::Rank` exists.
pub fn host(
    mut plan: Plan,
    enc: UnitId,
    host: Host,
    link: Link,
    cap: Option<&FillCap>,
) -> Result<Plan, PlanError> {
    let rank = match host {
        Host::Rank(r) => r,
        Host::Spare => spare_rank(&plan, enc),
    };
    plan.units[enc].home = rank;
    place(plan, enc, link, Some(rank), cap)
}

/// The rank whose tasks, other than `enc`'s, take the least compute time.
pub fn spare_rank(plan: &Plan, enc: UnitId) -> usize {
    let load = |r: usize| -> f64 {
        plan.order[r]
            .iter()
            .filter(|t| t.unit != enc)
            .map(|t| t.op.cost(&plan.units[t.unit].cost))
            .sum()
    };
    (0..plan.ranks)
        .map(|r| (r, load(r)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .map_or(0, |(r, _)| r)
}
