//! When each action of a program ran: the simulator's output and the renderers' input.
//!
//! `ranks[r][i]` is the interval of `programs[r][i]`. For a compute action it is the
//! time the rank spent computing; for a transfer or collective it runs from the moment
//! the rank reached the action to the moment it completed (so waiting shows).

use serde::{Deserialize, Serialize};

/// Start and end time of one action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    pub start: f64,
    pub end: f64,
}

/// Per-rank, per-action intervals, parallel to `Program::programs`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub ranks: Vec<Vec<Slot>>,
}

impl Timeline {
    /// Latest end time over all actions (0 for an empty program).
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }
}
