//! The plan: the level at which schedules are designed.
//!
//! A [`Plan`] says, for each rank, the ordered list of *compute* tasks it runs, over a
//! fixed set of units whose homes are decided. It has no communication: transfers,
//! broadcasts and reductions are derived from it in one place ([`crate::algebra::lower`]).
//! Generators build plans, operators map plans to plans.
//!
//! Invariant kept by every generator and operator: each `(op, unit, mb)` the program
//! needs appears exactly once (rule 1 of docs/spec/program-format.md) and the per-rank orders
//! together with the data dependencies form an acyclic graph.

use crate::ir::program::{Op, Unit};

/// Index of a unit in [`Plan::units`].
pub type UnitId = usize;

/// One compute task: `op` of `unit` on micro-batch `mb`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Task {
    pub op: Op,
    pub unit: UnitId,
    pub mb: usize,
}

impl Task {
    pub fn new(op: Op, unit: UnitId, mb: usize) -> Task {
        Task { op, unit, mb }
    }
}

/// How the LLM's stages are laid over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Stage `k` on rank `k mod p` (1F1B, interleaved).
    Looped,
    /// Two chunks per rank in a V: stage `k` on rank `k` for `k < p`, else `2p-1-k`.
    VShape,
}

/// A raw-input transfer the lowering must emit: the `input` of `(unit, mb)` goes from
/// rank `from` to rank `to` (MPipe's central recompute ships the encoder's input to
/// the rank that recomputes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct InputShip {
    pub unit: UnitId,
    pub mb: usize,
    pub from: usize,
    pub to: usize,
}

/// Per-rank compute orders over a set of placed units.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub ranks: usize,
    pub microbatches: usize,
    /// Units in topological order; encoders first, then `llm.0 ..` in pipeline order.
    pub units: Vec<Unit>,
    /// Indices of the LLM stage units, in pipeline order.
    pub stages: Vec<UnitId>,
    /// Indices of the encoder units.
    pub encoders: Vec<UnitId>,
    /// `order[r]`: rank `r`'s compute tasks in execution order.
    pub order: Vec<Vec<Task>>,
    /// Raw-input transfers to emit (kept sorted).
    pub input_ships: Vec<InputShip>,
    /// Forwards `(unit, mb)` whose task in this plan computes the next step's
    /// micro-batch (`prefetch`; kept sorted): this step's readers use the copy the
    /// previous step left, so they do not depend on the task, except a reader that is
    /// prefetched too (a frozen encoder's next layer), which computes the next step's
    /// as well and so reads this step's copy.
    pub prefetch: Vec<(UnitId, usize)>,
    /// The profile's per-rank memory limit, for operators choosing between
    /// placements (the derivation checks the final program exactly).
    pub memory_limit: Option<f64>,
}

impl Plan {
    /// Whether unit `u` needs a backward (it is trainable or reads, transitively, a
    /// trainable unit). Units are in topological order, so one pass suffices.
    pub fn needs_backward(&self) -> Vec<bool> {
        self.unit_names().needs_backward().to_vec()
    }

    /// The units by name ([`UnitNames`]): where a unit's name becomes its index.
    pub fn unit_names(&self) -> UnitNames<'_> {
        UnitNames::new(&self.units)
    }

    /// Index of the unit named `name` ([`UnitNames::id`]; to look up many names,
    /// build [`Plan::unit_names`] once).
    pub fn unit_id(&self, name: &str) -> Option<UnitId> {
        self.unit_names().id(name)
    }

    /// Units that read `u`'s output ([`UnitNames::successors`]).
    pub fn successors(&self, u: UnitId) -> Vec<UnitId> {
        self.unit_names().successors(u).to_vec()
    }

    /// Position `(rank, index)` of each task, in a dense table.
    pub fn locate(&self) -> TaskIndex {
        TaskIndex::new(self)
    }

    /// A 64-bit hash of everything `==` compares: equal plans have equal
    /// fingerprints (so unequal fingerprints mean unequal plans; equal ones must
    /// still be compared). `auto` keeps this, not the plan, for each candidate.
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        // `0.0 == -0.0`: both hash as `0.0` (`-0.0 + 0.0` is `0.0`).
        let num =
            |h: &mut std::collections::hash_map::DefaultHasher, x: f64| (x + 0.0).to_bits().hash(h);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.ranks, self.microbatches).hash(&mut h);
        self.units.len().hash(&mut h);
        for u in &self.units {
            (&u.name, &u.inputs, u.home, u.trainable).hash(&mut h);
            for x in [u.cost.f, u.cost.b, u.cost.w, u.act, u.bytes, u.params] {
                num(&mut h, x);
            }
        }
        (&self.stages, &self.encoders, &self.order).hash(&mut h);
        for s in &self.input_ships {
            (s.unit, s.mb, s.from, s.to).hash(&mut h);
        }
        self.input_ships.len().hash(&mut h);
        self.prefetch.hash(&mut h);
        self.memory_limit.is_some().hash(&mut h);
        if let Some(limit) = self.memory_limit {
            num(&mut h, limit);
        }
        h.finish()
    }
}

/// `needs backward` for units in topological order (see docs/spec/program-format.md).
pub fn needs_backward(units: &[Unit]) -> Vec<bool> {
    UnitNames::new(units).needs_backward().to_vec()
}

/// A plan's units found by name, once: the one place a unit's name becomes its
/// index, which looking a name up ([`Plan::unit_id`]), the readers of a unit
/// ([`Plan::successors`]) and dependency resolution all read. Built in time linear
/// in the units and their inputs. A name several units bear is the first's (a
/// program refuses such units; the plan's links are those of the first). It
/// depends on the units alone, so plans of the same units (the order search's
/// trials) share one.
#[derive(Clone, Debug)]
pub struct UnitNames<'a> {
    by_name: std::collections::HashMap<&'a str, UnitId>,
    /// Each unit's inputs by index, in the order it names them (a name of no unit
    /// left out).
    inputs: Vec<Vec<UnitId>>,
    /// Each unit's readers: the units with it among their inputs, each once, in
    /// unit order.
    readers: Vec<Vec<UnitId>>,
    /// Whether each unit needs a backward ([`UnitNames::needs_backward`]).
    need: Vec<bool>,
}

impl<'a> UnitNames<'a> {
    /// The index of `units`.
    pub fn new(units: &'a [Unit]) -> UnitNames<'a> {
        let n = units.len();
        let mut by_name = std::collections::HashMap::with_capacity(n);
        for (u, unit) in units.iter().enumerate() {
            by_name.entry(unit.name.as_str()).or_insert(u);
        }
        let inputs: Vec<Vec<UnitId>> = units
            .iter()
            .map(|u| {
                u.inputs
                    .iter()
                    .filter_map(|i| by_name.get(i.as_str()).copied())
                    .collect()
            })
            .collect();
        let mut readers: Vec<Vec<UnitId>> = vec![Vec::new(); n];
        for (s, ins) in inputs.iter().enumerate() {
            for &p in ins {
                // Once per reader, however many of its inputs name `p`.
                if readers[p].last() != Some(&s) {
                    readers[p].push(s);
                }
            }
        }
        // Units are in topological order: one pass. An input later in the order
        // does not count.
        let mut need = vec![false; n];
        for (i, u) in units.iter().enumerate() {
            need[i] = u.trainable || inputs[i].iter().any(|&p| p < i && need[p]);
        }
        UnitNames {
            by_name,
            inputs,
            readers,
            need,
        }
    }

    /// Index of the unit named `name`.
    pub fn id(&self, name: &str) -> Option<UnitId> {
        self.by_name.get(name).copied()
    }

    /// Unit `u`'s inputs by index.
    pub fn inputs(&self, u: UnitId) -> &[UnitId] {
        &self.inputs[u]
    }

    /// Units that read `u`'s output.
    pub fn successors(&self, u: UnitId) -> &[UnitId] {
        &self.readers[u]
    }

    /// Whether each unit needs a backward: it is trainable or reads, transitively,
    /// a unit that does (units are in topological order).
    pub fn needs_backward(&self) -> &[bool] {
        &self.need
    }
}

/// Dense `(op, unit, mb) -> (rank, index)` table of a plan.
#[derive(Clone, Debug)]
pub struct TaskIndex {
    microbatches: usize,
    units: usize,
    /// `(rank + 1, index)` packed in 32 bits each (rank `0` where no task is): a
    /// third of the memory of `Option<(usize, usize)>`, and the table is rebuilt
    /// for every plan the order search tries. Absence is all zero bits, so the
    /// table starts as zeroed memory (pages the allocator hands out zeroed, never
    /// written where no task is) instead of being filled.
    slots: Vec<[u32; 2]>,
}

const OPS: [Op; 5] = [Op::F, Op::B, Op::W, Op::BW, Op::RF];

/// `op`'s place in [`OPS`].
#[inline]
fn op_slot(op: Op) -> usize {
    match op {
        Op::F => 0,
        Op::B => 1,
        Op::W => 2,
        Op::BW => 3,
        Op::RF => 4,
    }
}

impl TaskIndex {
    fn new(plan: &Plan) -> TaskIndex {
        let (m, n) = (plan.microbatches, plan.units.len());
        let mut slots = vec![[0u32; 2]; OPS.len() * n * m];
        for (r, list) in plan.order.iter().enumerate() {
            // Plans are far below 2^32 - 1 ranks and 2^32 tasks per rank (the
            // program limits), so both fit.
            let rank = r as u32 + 1;
            for (i, t) in list.iter().enumerate() {
                slots[(op_slot(t.op) * n + t.unit) * m + t.mb] = [rank, i as u32];
            }
        }
        TaskIndex {
            microbatches: m,
            units: n,
            slots,
        }
    }

    /// Make this the index of `plan`, whose rank lists extend at their ends those
    /// of the plan indexed (the same units and micro-batches): the first `from[r]`
    /// tasks of rank `r` are that plan's. Only the tasks past those are entered,
    /// each where [`Plan::locate`] puts it (the last occurrence wins).
    pub(crate) fn extend(&mut self, plan: &Plan, from: &[usize]) {
        let (m, n) = (self.microbatches, self.units);
        for (r, list) in plan.order.iter().enumerate() {
            let rank = r as u32 + 1;
            for (i, t) in list.iter().enumerate().skip(from[r]) {
                let slot = &mut self.slots[(op_slot(t.op) * n + t.unit) * m + t.mb];
                // Rank-major order, as `new` enters them: the later place wins.
                *slot = (*slot).max([rank, i as u32]);
            }
        }
    }

    /// Where `(op, unit, mb)` runs, if it does (the last occurrence if several).
    #[inline]
    pub fn get(&self, op: Op, unit: UnitId, mb: usize) -> Option<(usize, usize)> {
        let [r, i] = self.slots[(op_slot(op) * self.units + unit) * self.microbatches + mb];
        (r != 0).then(|| (r as usize - 1, i as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::UnitNames;
    use crate::ir::program::{Cost, Unit};
    use crate::ir::role::Role;
    use proptest::prelude::*;

    proptest! {
        /// A unit's readers are the units naming it among their inputs, each once
        /// and in unit order, with repeated names, repeated inputs and inputs
        /// naming no unit; a name is its first unit's.
        #[test]
        fn readers_are_the_units_whose_inputs_name_the_unit(
            units in proptest::collection::vec(
                (0usize..6, proptest::collection::vec(0usize..8, 0..4)),
                0..12,
            ),
        ) {
            let name = |k: usize| format!("u{k}");
            let units: Vec<Unit> = units
                .iter()
                .map(|(n, inputs)| Unit {
                    name: name(*n),
                    inputs: inputs.iter().map(|&k| name(k)).collect(),
                    home: 0,
                    trainable: true,
                    cost: Cost::default(),
                    act: 0.0,
                    bytes: 0.0,
                    params: 0.0,
                    role: Role::of_name(&name(*n)),
                })
                .collect();
            let names = UnitNames::new(&units);
            for k in 0..8 {
                let first = units.iter().position(|u| u.name == name(k));
                prop_assert_eq!(names.id(&name(k)), first);
            }
            for (u, unit) in units.iter().enumerate() {
                let ins: Vec<usize> = unit.inputs.iter().filter_map(|n| names.id(n)).collect();
                prop_assert_eq!(names.inputs(u), &ins[..]);
                let readers: Vec<usize> = (0..units.len())
                    .filter(|&s| names.inputs(s).contains(&u))
                    .collect();
                prop_assert_eq!(names.successors(u), &readers[..]);
            }
        }
    }
}
