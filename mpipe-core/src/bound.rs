//! Lower bounds on the makespan of any program for a set of units: what every figure
//! can be read against.
//!
//! - **work / ranks**: the least compute one step needs (every unit's `F`, plus `B`
//!   and `W` where the unit needs them; no recomputation), spread perfectly over the
//!   ranks. No schedule can finish earlier, since a rank computes one thing at a time.
//! - **chain**: one micro-batch's dependency chain — the slowest encoder's forward, every
//!   stage's forward, every stage's input-gradient backward in reverse, then the
//!   shortest closing step (an encoder's backward or the first stage's `W`). Its tasks
//!   depend on each other, so no schedule finishes before it does.
//!
//! The bound is the larger of the two; it holds for every schedule, so a schedule
//! at the bound is optimal.

use crate::plan::needs_backward;
use crate::program::Unit;
use serde::Serialize;

/// The lower bounds of one step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bound {
    /// Total minimal compute divided by the number of ranks.
    pub work: f64,
    /// The longest single micro-batch dependency chain.
    pub chain: f64,
}

impl Bound {
    /// The sharper of the two bounds.
    pub fn value(&self) -> f64 {
        self.work.max(self.chain)
    }
}

/// Bounds for `units` (topological order: units without inputs are encoders or the
/// pipeline's head, the rest a chain) run with `microbatches` on `ranks` ranks.
pub fn lower_bound(units: &[Unit], ranks: usize, microbatches: usize) -> Bound {
    let need = needs_backward(units);
    let mut work = 0.0;
    for (u, unit) in units.iter().enumerate() {
        work += unit.cost.f;
        if need[u] {
            work += unit.cost.b;
        }
        if unit.trainable {
            work += unit.cost.w;
        }
    }
    let work = work * microbatches as f64 / ranks.max(1) as f64;
    // Longest path through F's, then back through B's, computed over the unit DAG.
    let index = |name: &str| units.iter().position(|u| u.name == name);
    let mut fdone = vec![0.0f64; units.len()];
    for (u, unit) in units.iter().enumerate() {
        let ready = unit
            .inputs
            .iter()
            .filter_map(|n| index(n))
            .map(|p| fdone[p])
            .fold(0.0, f64::max);
        fdone[u] = ready + unit.cost.f;
    }
    let mut bdone = vec![0.0f64; units.len()];
    let mut chain = fdone.iter().copied().fold(0.0, f64::max);
    for u in (0..units.len()).rev() {
        if !need[u] {
            continue;
        }
        let succ = (0..units.len())
            .filter(|&s| need[s] && units[s].inputs.iter().any(|n| *n == units[u].name))
            .map(|s| bdone[s])
            .fold(fdone[u], f64::max);
        bdone[u] = succ + units[u].cost.b;
        let tail = if units[u].trainable {
            units[u].cost.w
        } else {
            0.0
        };
        chain = chain.max(bdone[u] + tail);
    }
    Bound { work, chain }
}
