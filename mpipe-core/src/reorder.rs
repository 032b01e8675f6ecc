//! Refinement of a plan's compute order by simulation (`refine(X, order = N)`).
//!
//! [`crate::refine`] moves a program's transfers, and then weight gradients, to
//! where the ranks wait; every other compute task stays where the plan put it. But
//! a plan is designed against an ideal timing, and where the real one differs a rank
//! can sit blocked on a receive while a task further down its own list has had its
//! inputs for a while. `reorder` moves such tasks into the waits:
//!
//! 1. lower the plan with each placement rule of [`crate::lower`] and keep the rule
//!    whose program runs fastest; every candidate below is lowered with that rule;
//! 2. simulate, and list each rank's waits (the time it spends blocked in transfers
//!    right before a compute task), longest first;
//! 3. for a wait before task `j` on rank `r`, every task `k` up to [`LOOKAHEAD`]
//!    places later on `r` whose inputs were all ready by the middle of the wait
//!    (produced there, before `j`, or elsewhere, by then in the simulation) is a
//!    candidate: move `k` to just before `j`, lower, simulate;
//! 4. keep the first candidate that shortens the step (or, as long, lowers the sum
//!    of the ranks' finishing times) and fits the memory, and go back to 2; stop
//!    when no candidate of any wait does, or after `budget` simulations.
//!
//! The caller then derives the new plan in full (every rule, re-placement, transfer
//! refinement) and keeps it only if it beats what it had.
//!
//! Invariants: a move never puts a task before a producer on its own rank, so the
//! plan stays a valid order (the lowering checks it again, and a candidate that does
//! not lower is skipped); the programs are lowerings of plans, so the lowering's
//! deadlock-freedom argument covers them; deterministic (no clocks, no threads:
//! ties go to the lower rank, then the earlier task); the budget counts simulations,
//! so the result does not depend on the machine. Progress is reported as a stage of
//! `budget` simulations ([`crate::progress`]), which ends early when no move is left.

use crate::analysis::dependencies;
use crate::derive::PLACEMENTS;
use crate::lower::{lower_prepared, lower_with, prepare, Placement};
use crate::plan::{Plan, Task};
use crate::program::{ActionRef, Program};
use crate::progress::Stage;
use crate::refine::ends;
use crate::simulate::{simulate, SimOptions, SimReport};
use std::collections::BTreeSet;

/// How far down a rank's list a task may come from to fill a wait.
pub const LOOKAHEAD: usize = 20;

/// Waits shorter than this (in the profile's time unit, relative to the step) are
/// not worth a simulation.
const MIN_WAIT: f64 = 1e-6;

/// A better order for `plan`, if the search finds one within `budget` simulations
/// (see the module documentation); `None` when no move helped. `fits` says whether a
/// program's memory is acceptable.
pub(crate) fn reorder(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
    fits: &dyn Fn(&Program, &SimReport) -> bool,
    budget: usize,
) -> Option<Plan> {
    let stage = Stage::begin("ordering the compute (simulations)", budget);
    let (rule, mut best) = first_lowering(plan, text, opts)?;
    let mut plan = plan.clone();
    let mut spent = PLACEMENTS.len();
    for _ in 0..spent.min(budget) {
        stage.step();
    }
    let mut improved = false;
    let mut tried: BTreeSet<(usize, Task, Task)> = BTreeSet::new();
    'search: while spent < budget {
        // The plan lowered, so its dependencies resolve; were they not to, stop
        // with what was found.
        let Ok(deps) = dependencies(&plan) else {
            break;
        };
        let (program, report) = &best;
        let times = compute_times(program, report);
        let mut waits: Vec<(f64, usize, usize)> = Vec::new();
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                if slot.wait > MIN_WAIT * report.makespan.max(1.0) {
                    waits.push((slot.wait, r, j));
                }
            }
        }
        waits.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for &(wait, r, j) in &waits {
            let by = times[r][j].start - wait / 2.0;
            let list = &plan.order[r];
            for k in j + 1..list.len().min(j + 1 + LOOKAHEAD) {
                let ready = deps.of(r, k).iter().all(|d| {
                    let (q, i) = d.producer;
                    if q == r {
                        i < j
                    } else {
                        times[q][i].end <= by
                    }
                });
                if !ready || !tried.insert((r, list[k], list[j])) {
                    continue;
                }
                if spent >= budget {
                    break 'search;
                }
                spent += 1;
                stage.step();
                let mut next = plan.clone();
                let task = next.order[r].remove(k);
                next.order[r].insert(j, task);
                let Some((p, rep)) = lower_one(&next, text, opts, rule) else {
                    continue;
                };
                if better(&rep, &best.1) && fits(&p, &rep) {
                    plan = next;
                    best = (p, rep);
                    improved = true;
                    continue 'search;
                }
            }
        }
        break;
    }
    improved.then_some(plan)
}

/// The rule whose lowering of `plan` runs fastest, with that lowering.
fn first_lowering(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
) -> Option<(Placement, (Program, SimReport))> {
    // One preparation (dependencies, ideal timing, transfers) for every rule.
    let prepared = prepare(plan).ok()?;
    let mut best: Option<(Placement, (Program, SimReport))> = None;
    for rule in PLACEMENTS {
        let program = lower_prepared(plan, &prepared, text, rule).ok();
        let run = program.and_then(|p| simulate(&p, opts).ok().map(|r| (p, r)));
        if let Some(x) = run {
            if best
                .as_ref()
                .is_none_or(|(_, b)| x.1.makespan < b.1.makespan)
            {
                best = Some((rule, x));
            }
        }
    }
    best
}

/// `plan` lowered with `rule` and simulated; `None` if either fails.
fn lower_one(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
    rule: Placement,
) -> Option<(Program, SimReport)> {
    let program = lower_with(plan, text, rule).ok()?;
    let report = simulate(&program, opts).ok()?;
    Some((program, report))
}

/// Shorter step, or as long with less summed finishing time.
fn better(a: &SimReport, b: &SimReport) -> bool {
    let eps = 1e-9 * b.makespan.max(1.0);
    a.makespan < b.makespan - eps
        || (a.makespan <= b.makespan + eps
            && ends(a) < ends(b) - eps * a.timeline.ranks.len() as f64)
}

/// One compute task's simulated interval and the time its rank spent between the
/// end of its previous compute task and its start (blocked in transfers).
#[derive(Clone, Copy, Debug)]
struct Timed {
    start: f64,
    end: f64,
    wait: f64,
}

/// Per rank, per compute task (in the plan's order, which the program keeps).
fn compute_times(program: &Program, report: &SimReport) -> Vec<Vec<Timed>> {
    program
        .programs
        .iter()
        .zip(&report.timeline.ranks)
        .map(|(list, slots)| {
            let mut out = Vec::new();
            let mut free = 0.0;
            for (a, s) in list.iter().zip(slots) {
                if let ActionRef::Compute(_) = a.view() {
                    out.push(Timed {
                        start: s.start,
                        end: s.end,
                        wait: (s.start - free).max(0.0),
                    });
                    free = s.end;
                }
            }
            out
        })
        .collect()
}
