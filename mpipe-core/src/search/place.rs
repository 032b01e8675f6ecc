//! The best lowering of one plan: every placement rule of the lowering, re-placement
//! against the simulated times, then transfer and weight-gradient refinement
//! ([`crate::search::refine`]), keeping the fastest program. A small search of its
//! own (it simulates every candidate), just above `refine` in the search floor.

use crate::algebra::analysis::Timing;
use crate::algebra::lower::{
    assemble_lowered, placement_at, placement_of, prepare, total_order, Lowered, Placed, Placement,
    Prepared, Step,
};
use crate::ir::compare::{at_most, Score};
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{ActionRef, Program};
use crate::judge::simulate::{simulate_lowered_within, SimOptions, SimReport};
use crate::judge::timeline::Slot;
use crate::search::refine::{refine, settle_w};
use std::rc::Rc;

/// [`best_lowering`] without a profile: simulate under `opts`, and let weight
/// gradients move only while every rank's activations plus resident parameters stay
/// within `limit` (anywhere when `None`). `expr` is recorded as the programs' source.
/// `policy` gives the rounds and budgets.
pub(crate) fn best_lowering_with(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
    limit: Option<f64>,
    refine_too: bool,
    policy: &SearchPolicy,
) -> Result<(Program, SimReport), String> {
    let SearchPolicy {
        replace_rounds,
        refine_budget,
        refine_actions,
        w_budget,
        w_actions,
        w_min,
        ..
    } = *policy;
    let prepared = prepare(plan).map_err(|e| e.to_string())?;
    let target = prepared.time.makespan();
    // The best so far: what lowers it again (the timing its transfers were placed
    // against, `None` for the ideal one, and the rule), its lowering by unit index,
    // its makespan and its full report. A candidate's run stops as soon as it
    // provably cannot beat the best (its cutoff); one that runs to the end is
    // measured in full, so the winner is neither placed, assembled nor simulated
    // again (at most the best's lowering and report and one candidate's are held);
    // only it is named, at the end.
    let mut best: Option<Best> = None;
    let done = |best: &Option<Best>| best.as_ref().is_some_and(|b| at_most(b.makespan, target));
    // Placements already lowered and simulated. Rules often agree (on every transfer,
    // or again after re-timing); a placement seen before gives the same program and
    // the same simulation, which can never beat the best kept (ties keep the first),
    // so it is skipped without lowering or simulating it again.
    let mut seen = Seen::default();
    // Only a program faster than the best can be kept: its makespan, the cutoff of
    // a candidate's run.
    let cutoff = |best: &Option<Best>| best.as_ref().map_or(f64::INFINITY, |b| b.makespan);
    for placement in PLACEMENTS {
        if done(&best) {
            break;
        }
        let at = placement_of(plan, &prepared, placement, policy).map_err(|e| e.to_string())?;
        if !seen.first_sight(&at) {
            continue;
        }
        let lowered = assemble_lowered(plan, &at).map_err(|e| e.to_string())?;
        drop(at);
        // A run that provably cannot beat the best is cut short (`None`).
        let Some(report) = simulate_lowered_within(&plan.units, &lowered, opts, cutoff(&best))
            .map_err(|e| format!("derived program does not run: {e}"))?
        else {
            continue;
        };
        if best.as_ref().is_none_or(|b| b.beaten_by(report.makespan)) {
            best = Some(Best {
                time: None,
                placement,
                makespan: report.makespan,
                lowered,
                report,
            });
        }
    }
    // Re-place the transfers against the times the best program actually ran at:
    // waiting shifts the timeline, and meeting points chosen on the shifted one
    // fit it better. A few rounds, keeping the fastest program.
    for _ in 0..replace_rounds {
        if done(&best) {
            break;
        }
        let Some(b) = &best else {
            break;
        };
        let time = simulated_timing(
            plan,
            &b.lowered.programs,
            &b.report.timeline.ranks,
            &prepared.time,
        );
        let Some(time) = time.map(Rc::new) else {
            break;
        };
        let mut improved = false;
        for placement in PLACEMENTS {
            let Ok(at) = placement_at(plan, &prepared, &time, placement, policy) else {
                continue;
            };
            if !seen.first_sight(&at) {
                continue;
            }
            let Ok(lowered) = assemble_lowered(plan, &at) else {
                continue;
            };
            drop(at);
            let Ok(Some(report)) =
                simulate_lowered_within(&plan.units, &lowered, opts, cutoff(&best))
            else {
                continue;
            };
            if best.as_ref().is_none_or(|b| b.beaten_by(report.makespan)) {
                best = Some(Best {
                    time: Some(Rc::clone(&time)),
                    placement,
                    makespan: report.makespan,
                    lowered,
                    report,
                });
                improved = true;
            }
        }
        if !improved {
            break;
        }
    }
    drop(seen);
    let best = best.ok_or_else(|| "no lowering".to_string())?;
    // The winner, with the report of its full simulation on its lowering by unit
    // index (the report `simulate` gives for its named program).
    let (placed, lowered, report) = best.into_parts();
    let actions: usize = lowered.programs.iter().map(Vec::len).sum();
    let done = at_most(report.makespan, target) || !refine_too;
    let budget = refine_budget.min(refine_actions / actions.max(1));
    // What refinement needs to place the winner again, kept only if it runs.
    let prepared = (!done && budget > 0).then_some(prepared);
    if done {
        return Ok((lowered.into_program(&plan.units, text), report));
    }
    // Refinement works on the lowering by unit index; only its result is named.
    let moved = match prepared {
        // Refinement moves the placement's ends: placed again (the same placement).
        Some(prepared) => {
            let at = placed.placement(plan, &prepared, policy)?;
            drop(prepared);
            refine(plan, at, (lowered, report), opts, budget)
        }
        None => (lowered, report),
    };
    if at_most(moved.1.makespan, target) {
        return Ok((moved.0.into_program(&plan.units, text), moved.1));
    }
    // Then weight gradients into the waits left, within the memory limit (moving
    // parameters nowhere: the resident parameters stay the program's).
    let params = resident_params_lowered(&plan.units, &moved.0);
    let fits = |rep: &SimReport| {
        limit.is_none_or(|l| {
            rep.peak_memory
                .iter()
                .zip(&params)
                .all(|(act, par)| at_most(act + par, l))
        })
    };
    let budget =
        w_budget.min(w_actions / moved.0.programs.iter().map(Vec::len).sum::<usize>().max(1));
    if budget < w_min {
        return Ok((moved.0.into_program(&plan.units, text), moved.1));
    }
    let (lowered, report) = settle_w(&plan.units, moved, opts, &fits, budget, policy);
    Ok((lowered.into_program(&plan.units, text), report))
}

/// What places a lowering again: the timing its transfers were placed against
/// (`None`: the prepared, ideal one) and the rule.
struct Origin {
    time: Option<Rc<Timing>>,
    placement: Placement,
}

impl Origin {
    /// The placement this lowering was assembled from (the same: placement is
    /// deterministic).
    fn placement(
        &self,
        plan: &Plan,
        prepared: &Prepared,
        policy: &SearchPolicy,
    ) -> Result<Vec<Vec<Placed>>, String> {
        let time = self.time.as_deref().unwrap_or(&prepared.time);
        placement_at(plan, prepared, time, self.placement, policy).map_err(|e| e.to_string())
    }
}

/// The best lowering so far: what places it again, its makespan, the lowering
/// itself and the report of its full simulation.
struct Best {
    time: Option<Rc<Timing>>,
    placement: Placement,
    makespan: f64,
    lowered: Lowered,
    report: SimReport,
}

impl Best {
    /// Whether a candidate of this makespan is faster (ties keep the first).
    fn beaten_by(&self, makespan: f64) -> bool {
        Score::span(makespan).beats(&Score::span(self.makespan))
    }

    /// What places it again, its lowering and its report.
    fn into_parts(self) -> (Origin, Lowered, SimReport) {
        (
            Origin {
                time: self.time,
                placement: self.placement,
            },
            self.lowered,
            self.report,
        )
    }
}

/// The placements lowered so far, each as its signature: its ends' slots and
/// transfers, rank by rank, in order (the program `assemble` builds from a placement
/// is a function of exactly these: each end's action follows from its transfer and
/// rank). A signature is written as variable-length differences (LEB128, zigzag for
/// the transfers, whose numbers jump both ways), which read back to exactly these
/// numbers, so equal signatures are equal placements: at 8 x 65536 about 3 MB each,
/// where the numbers as machine words took 29 MB.
#[derive(Default)]
struct Seen(Vec<Vec<u8>>);

impl Seen {
    /// Record `at` and say whether it is new.
    fn first_sight(&mut self, at: &[Vec<Placed>]) -> bool {
        let mut sig = Vec::new();
        for list in at {
            put(&mut sig, list.len() as u64);
            let (mut slot, mut id) = (0u64, 0i64);
            for x in list {
                // Slots never decrease along a rank's list.
                put(&mut sig, (x.slot as u64).wrapping_sub(slot));
                let d = (x.id as i64).wrapping_sub(id);
                put(&mut sig, ((d << 1) ^ (d >> (i64::BITS - 1))) as u64);
                (slot, id) = (x.slot as u64, x.id as i64);
            }
        }
        if self.0.contains(&sig) {
            return false;
        }
        sig.shrink_to_fit();
        self.0.push(sig);
        true
    }
}

/// Append `x` to `out` in LEB128: seven bits a byte, low first, the high bit set on
/// every byte but the last.
fn put(out: &mut Vec<u8>, mut x: u64) {
    const MORE: u8 = 0x80;
    while x >= u64::from(MORE) {
        out.push((x as u8) | MORE);
        x >>= u8::BITS - 1;
    }
    out.push(x as u8);
}

/// The placement rules tried, in order.
pub(crate) const PLACEMENTS: [Placement; 5] = [
    Placement::Meet,
    Placement::Ready,
    Placement::Critical,
    Placement::Late,
    Placement::Join,
];

/// The compute tasks' times in a simulation of `programs` (a lowering of `plan` by
/// unit index, whose timeline is `slots`), as a [`Timing`] of the plan: settle order
/// by end, then start, then the ideal order.
fn simulated_timing(
    plan: &Plan,
    programs: &[Vec<Step>],
    slots: &[Vec<Slot>],
    ideal: &Timing,
) -> Option<Timing> {
    let mut start: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    let mut end: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    for (r, list) in programs.iter().enumerate() {
        let slots = slots.get(r)?;
        let (mut s, mut e) = (Vec::new(), Vec::new());
        for (a, slot) in list.iter().zip(slots) {
            if matches!(a, Step::Compute { .. }) {
                s.push(slot.start);
                e.push(slot.end);
            }
        }
        if s.len() != plan.order[r].len() {
            return None;
        }
        start.push(s);
        end.push(e);
    }
    let mut all: Vec<(usize, usize)> = (0..plan.ranks)
        .flat_map(|r| (0..plan.order[r].len()).map(move |i| (r, i)))
        .collect();
    // `seq` numbers the tasks, so the order is total and an unstable sort exact.
    all.sort_unstable_by_key(|&(r, i)| {
        (
            total_order(end[r][i]),
            total_order(start[r][i]),
            ideal.seq[r][i],
        )
    });
    let mut seq: Vec<Vec<usize>> = plan.order.iter().map(|l| vec![0; l.len()]).collect();
    for (k, (r, i)) in all.into_iter().enumerate() {
        seq[r][i] = k;
    }
    Some(Timing { start, end, seq })
}

/// The largest, over the ranks, of `report`'s peak activations plus `program`'s
/// resident parameters: what `memory.limit` is compared with.
pub(crate) fn peak_memory_with_params(program: &Program, report: &SimReport) -> f64 {
    report
        .peak_memory
        .iter()
        .zip(resident_params(program))
        .map(|(a, b)| a + b)
        .fold(0.0, f64::max)
}

/// [`resident_params`] of a lowering by unit index (`units` are the plan's): the
/// same figures as for its named program.
fn resident_params_lowered(units: &[crate::ir::program::Unit], lowered: &Lowered) -> Vec<f64> {
    let mut held = vec![std::collections::BTreeSet::new(); lowered.ranks];
    for (u, unit) in units.iter().enumerate() {
        if unit.home < lowered.ranks {
            held[unit.home].insert(u);
        }
    }
    for (r, list) in lowered.programs.iter().enumerate().take(lowered.ranks) {
        for step in list {
            if let Step::Compute { unit, .. } = *step {
                if (unit as usize) < units.len() {
                    held[r].insert(unit as usize);
                }
            }
        }
    }
    held.iter()
        .map(|set| set.iter().map(|&u| units[u].params).sum())
        .collect()
}

/// Parameter memory resident on each rank: every unit's parameters on its home, and
/// on every rank that computes it elsewhere (broadcast or replicated).
pub fn resident_params(program: &Program) -> Vec<f64> {
    let index: std::collections::BTreeMap<&str, usize> = program
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name.as_str(), i))
        .collect();
    let mut held = vec![std::collections::BTreeSet::new(); program.ranks];
    for (u, unit) in program.units.iter().enumerate() {
        if unit.home < program.ranks {
            held[unit.home].insert(u);
        }
    }
    for (r, list) in program.programs.iter().enumerate().take(program.ranks) {
        let mut last: Option<&str> = None;
        for a in list {
            if let ActionRef::Compute(c) = a.view() {
                // Runs of actions on one unit are common: skip the lookup for them.
                if last == Some(c.unit) {
                    continue;
                }
                last = Some(c.unit);
                if let Some(&u) = index.get(c.unit) {
                    held[r].insert(u);
                }
            }
        }
    }
    held.iter()
        .map(|set| set.iter().map(|&u| program.units[u].params).sum())
        .collect()
}
