//! When each action of a program ran: the simulator's output and the renderers' input.
//!
//! `ranks[r][i]` is the interval of `programs[r][i]`. For a compute action it is the
//! time the rank spent computing; for a transfer or collective it runs from the moment
//! the rank reached the action to the moment it completed (so waiting shows).
//! [`Timeline::idle`] splits each rank's idle time into warm-up, steady state and
//! cool-down, to show where a schedule loses time.

use crate::ir::program::{ActionRef, Op, Program};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

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

/// Where one rank sat idle (not computing: waiting in transfers and collectives, or
/// with nothing to do) in a simulated step, split at its LLM stage forwards, as the
/// phases of a pipeline are: before its first stage forward starts (the warm-up),
/// after its last stage forward ends (the cool-down, when only backwards and weight
/// gradients are left), and in between (the steady state). A rank with no stage
/// forward counts all its idle time as steady. The three add up to the makespan
/// minus the rank's compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Idle {
    pub warm_up: f64,
    pub steady: f64,
    pub cool_down: f64,
}

impl Idle {
    /// All the rank's idle time.
    pub fn total(&self) -> f64 {
        self.warm_up + self.steady + self.cool_down
    }
}

impl Timeline {
    /// Per rank, where it sat idle within `[0, makespan)` (see [`Idle`]); `program`
    /// is the program this timeline ran (the same shape), `makespan` the step's.
    pub fn idle(&self, program: &Program, makespan: f64) -> Vec<Idle> {
        let stages: BTreeSet<&str> = program
            .units
            .iter()
            .filter(|u| u.role.is_stage())
            .map(|u| u.name.as_str())
            .collect();
        program
            .programs
            .iter()
            .zip(&self.ranks)
            .map(|(list, slots)| {
                let mut busy: Vec<Slot> = Vec::new();
                let (mut first, mut last) = (None::<f64>, None::<f64>);
                for (action, slot) in list.iter().zip(slots) {
                    let ActionRef::Compute(c) = action.view() else {
                        continue;
                    };
                    busy.push(*slot);
                    if !stages.contains(c.unit) {
                        continue;
                    }
                    if matches!(c.op, Op::F | Op::RF) {
                        first = Some(first.map_or(slot.start, |f: f64| f.min(slot.start)));
                        last = Some(last.map_or(slot.end, |l: f64| l.max(slot.end)));
                    }
                }
                // Idle time within [a, b): its length less the compute inside it.
                let idle = |a: f64, b: f64| {
                    let inside: f64 = busy
                        .iter()
                        .map(|s| (s.end.min(b) - s.start.max(a)).max(0.0))
                        .sum();
                    (b - a - inside).max(0.0)
                };
                match (first, last) {
                    (Some(f), Some(l)) if f <= l => Idle {
                        warm_up: idle(0.0, f),
                        steady: idle(f, l),
                        cool_down: idle(l, makespan.max(l)),
                    },
                    _ => Idle {
                        warm_up: 0.0,
                        steady: idle(0.0, makespan),
                        cool_down: 0.0,
                    },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(start: f64, end: f64) -> Slot {
        Slot { start, end }
    }

    /// Rank 0 runs an encoder then stage 0; rank 1 runs stage 1; rank 2 only an
    /// encoder. Times are set by hand (transfers shown as their waits).
    #[test]
    fn idle_splits_at_the_first_and_the_last_stage_forward() {
        let program = Program::from_json(
            r#"{"format": "mpipe-program/1", "ranks": 3, "microbatches": 1,
              "units": [
                {"name": "vision", "inputs": [], "home": 0, "trainable": true, "cost": {"F": 1, "B": 1, "W": 1}, "act": 1},
                {"name": "llm.0", "inputs": ["vision"], "home": 0, "trainable": true, "cost": {"F": 1, "B": 1, "W": 1}, "act": 1},
                {"name": "llm.1", "inputs": ["llm.0"], "home": 1, "trainable": true, "cost": {"F": 2, "B": 2, "W": 1}, "act": 1},
                {"name": "audio", "inputs": [], "home": 2, "trainable": false, "cost": {"F": 1, "B": 0, "W": 0}, "act": 0}],
              "programs": [
                [{"op": "F", "unit": "vision", "mb": 0}, {"op": "F", "unit": "llm.0", "mb": 0},
                 {"op": "SEND", "tensor": "act", "unit": "llm.0", "mb": 0, "peer": 1},
                 {"op": "RECV", "tensor": "grad", "unit": "llm.1", "mb": 0, "peer": 1},
                 {"op": "B", "unit": "llm.0", "mb": 0}, {"op": "W", "unit": "llm.0", "mb": 0},
                 {"op": "B", "unit": "vision", "mb": 0}, {"op": "W", "unit": "vision", "mb": 0}],
                [{"op": "RECV", "tensor": "act", "unit": "llm.0", "mb": 0, "peer": 0},
                 {"op": "F", "unit": "llm.1", "mb": 0}, {"op": "B", "unit": "llm.1", "mb": 0},
                 {"op": "SEND", "tensor": "grad", "unit": "llm.1", "mb": 0, "peer": 0},
                 {"op": "W", "unit": "llm.1", "mb": 0}],
                [{"op": "F", "unit": "audio", "mb": 0}]]}"#,
        )
        .unwrap();
        let t = Timeline {
            ranks: vec![
                vec![
                    slot(0.0, 1.0),
                    slot(1.0, 2.0),
                    slot(2.0, 2.0),
                    slot(2.0, 6.0),
                    slot(6.0, 7.0),
                    slot(7.0, 8.0),
                    slot(8.0, 9.0),
                    slot(9.0, 10.0),
                ],
                vec![
                    slot(0.0, 2.0),
                    slot(2.0, 4.0),
                    slot(4.0, 6.0),
                    slot(6.0, 6.0),
                    slot(6.0, 7.0),
                ],
                vec![slot(3.0, 4.0)],
            ],
        };
        let idle = t.idle(&program, 12.0);
        // Rank 0: its only stage forward runs in [1, 2); after it, it waits 4 in
        // [2, 6) for the gradient and sits idle after 10.
        assert_eq!(
            idle[0],
            Idle {
                warm_up: 0.0,
                steady: 0.0,
                cool_down: 6.0
            }
        );
        // Rank 1: waits 2 for its input; after its forward (ends 4), a B and a W,
        // then idle from 7.
        assert_eq!(
            idle[1],
            Idle {
                warm_up: 2.0,
                steady: 0.0,
                cool_down: 5.0
            }
        );
        // Rank 2 has no stage work: all of its idle time is steady.
        assert_eq!(
            idle[2],
            Idle {
                warm_up: 0.0,
                steady: 11.0,
                cool_down: 0.0
            }
        );
        for (r, i) in idle.iter().enumerate() {
            let compute: f64 = [6.0, 5.0, 1.0][r];
            assert_eq!(i.total(), 12.0 - compute);
        }
    }
}
