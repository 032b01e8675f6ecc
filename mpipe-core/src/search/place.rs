//! The best lowering of one plan: every placement rule of the lowering, re-placement
//! against the simulated times, then transfer and weight-gradient refinement
//! ([`crate::search::refine`]), keeping the fastest program. A small search of its
//! own (it simulates every candidate), just above `refine` in the search floor.

use crate::algebra::analysis::Timing;
use crate::algebra::lower::{
    assemble, placement_at, placement_of, prepare, total_order, Placed, Placement, Prepared,
};
use crate::ir::compare::at_most;
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{ActionRef, Program};
use crate::judge::compare::span;
use crate::judge::simulate::{simulate, SimOptions, SimReport};
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
    // The best so far, as what lowers it again (the timing its transfers were placed
    // against, `None` for the ideal one, and the rule) with its simulation. Neither
    // its placement nor its program is kept: a candidate's program and simulation
    // are the largest things alive, one candidate at a time is enough, and lowering
    // is deterministic, so the winner is lowered again at the end (at 8 x 65536,
    // holding the best's placement and program beside the candidate's doubled the
    // peak).
    let mut best: Option<Best> = None;
    let done = |best: &Option<Best>| {
        best.as_ref()
            .is_some_and(|b| at_most(b.report.makespan, target))
    };
    // Placements already lowered and simulated. Rules often agree (on every transfer,
    // or again after re-timing); a placement seen before gives the same program and
    // the same simulation, which can never beat the best kept (ties keep the first),
    // so it is skipped without lowering or simulating it again.
    let mut seen = Seen::default();
    for placement in PLACEMENTS {
        if done(&best) {
            break;
        }
        let at = placement_of(plan, &prepared, placement, policy).map_err(|e| e.to_string())?;
        if !seen.first_sight(&at) {
            continue;
        }
        let program = assemble(plan, &at, text);
        drop(at);
        let report =
            simulate(&program, opts).map_err(|e| format!("derived program does not run: {e}"))?;
        drop(program);
        if best
            .as_ref()
            .is_none_or(|b| span(&report).beats(&span(&b.report)))
        {
            best = Some(Best {
                time: None,
                placement,
                report,
            });
        }
    }
    // Re-place the transfers against the times the best program actually ran at:
    // waiting shifts the timeline, and meeting points chosen on the shifted one
    // fit it better. A few rounds, keeping the fastest program.
    for _ in 0..replace_rounds {
        let Some(b) = &best else {
            break;
        };
        if done(&best) {
            break;
        }
        let (_, program) = b.lower(plan, &prepared, text, policy)?;
        let time = simulated_timing(plan, &program, &b.report, &prepared.time);
        drop(program);
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
            let program = assemble(plan, &at, text);
            drop(at);
            let Ok(report) = simulate(&program, opts) else {
                continue;
            };
            drop(program);
            if best
                .as_ref()
                .is_none_or(|b| span(&report).beats(&span(&b.report)))
            {
                best = Some(Best {
                    time: Some(Rc::clone(&time)),
                    placement,
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
    let (at, program) = best.lower(plan, &prepared, text, policy)?;
    let report = best.report;
    drop(prepared);
    if at_most(report.makespan, target) || !refine_too {
        return Ok((program, report));
    }
    let budget = refine_budget
        .min(refine_actions / program.programs.iter().map(Vec::len).sum::<usize>().max(1));
    let moved = refine(plan, at, (program, report), text, opts, budget);
    if at_most(moved.1.makespan, target) {
        return Ok(moved);
    }
    // Then weight gradients into the waits left, within the memory limit (moving
    // parameters nowhere: the resident parameters stay the program's).
    let params = resident_params(&moved.0);
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
        return Ok(moved);
    }
    Ok(settle_w(moved, opts, &fits, budget, policy))
}

/// The best lowering so far, as what lowers it again: the timing its transfers were
/// placed against (`None`: the prepared, ideal one) and the rule, with its simulation.
struct Best {
    time: Option<Rc<Timing>>,
    placement: Placement,
    report: SimReport,
}

impl Best {
    /// The placement and program this best was simulated from (the same: lowering is
    /// deterministic).
    fn lower(
        &self,
        plan: &Plan,
        prepared: &Prepared,
        text: Option<&str>,
        policy: &SearchPolicy,
    ) -> Result<(Vec<Vec<Placed>>, Program), String> {
        let time = self.time.as_deref().unwrap_or(&prepared.time);
        let at = placement_at(plan, prepared, time, self.placement, policy)
            .map_err(|e| e.to_string())?;
        let program = assemble(plan, &at, text);
        Ok((at, program))
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

/// The compute tasks' times in a simulation of `program` (a lowering of `plan`), as a
/// [`Timing`] of the plan: settle order by end, then start, then the ideal order.
fn simulated_timing(
    plan: &Plan,
    program: &Program,
    report: &SimReport,
    ideal: &Timing,
) -> Option<Timing> {
    let mut start: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    let mut end: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    for (r, list) in program.programs.iter().enumerate() {
        let slots = report.timeline.ranks.get(r)?;
        let (mut s, mut e) = (Vec::new(), Vec::new());
        for (a, slot) in list.iter().zip(slots) {
            if matches!(a.view(), ActionRef::Compute(_)) {
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
