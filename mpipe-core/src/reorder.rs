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
//!    of the ranks' finishing times) and fits the memory, and go back to 2;
//! 5. when no candidate of any wait does, and the caller allows it
//!    ([`Moves::AcrossRanks`]), move encoder work instead: from the ranks that set
//!    the pace (the most compute plus the time the other ranks waited for them, as
//!    [`crate::waits`] attributes it), then the busiest by compute, to the least
//!    busy, one micro-batch of an encoder (all its layers or chunks on that rank
//!    together, else one layer), each task put where the target was at the time it
//!    ran; keep the first that shortens the step as in 4 and go
//!    back to 2. LLM stage tasks never move (the plan stays pipeline-parallel, as
//!    the bounds assume); the lowering adds the parameter broadcast and gradient
//!    reduction a rank computing away from a unit's home needs. Stop when nothing
//!    helps, or after `budget` simulations.
//!
//! The caller then derives the new plan in full (every rule, re-placement, transfer
//! refinement) and keeps it only if it beats what it had; when the search moved
//! work between ranks, the plan before the first such move is derived too, since
//! one rule's ranking and the full derivation's can differ.
//!
//! Invariants: a move within a rank never puts a task before a producer on its own
//! rank, so the plan stays a valid order; a move between ranks may, or may close a
//! cycle between ranks, and the lowering refuses such a plan (every candidate that
//! does not lower is skipped), so the plan found is always a valid order; the programs are lowerings of plans, so the lowering's
//! deadlock-freedom argument covers them; deterministic (no clocks, no threads:
//! ties go to the lower rank, then the earlier task); the budget counts simulations,
//! so the result does not depend on the machine. Progress is reported as a stage of
//! `budget` simulations ([`crate::progress`]), which ends early when no move is left.

use crate::analysis::dependencies;
use crate::derive::PLACEMENTS;
use crate::lower::{lower_prepared, lower_with, prepare, Placement};
use crate::plan::{Plan, Task};
use crate::program::{ActionRef, Op, Program};
use crate::progress::Stage;
use crate::refine::ends;
use crate::simulate::{simulate, SimOptions, SimReport};
use std::collections::{BTreeMap, BTreeSet};

/// How far down a rank's list a task may come from to fill a wait.
pub const LOOKAHEAD: usize = 20;

/// Waits shorter than this (in the profile's time unit, relative to the step) are
/// not worth a simulation.
const MIN_WAIT: f64 = 1e-6;

/// Better plans than `plan`, if the search finds any within `budget` simulations
/// (see the module documentation); empty when no move helped. The last is where
/// the search ended; when it moved work between ranks after improving the order
/// within them, the plan before the first such move comes first (each is judged
/// under one placement rule here, and the caller's full derivation can rank them
/// otherwise). `fits` says whether a program's memory is acceptable.
pub(crate) fn reorder(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
    fits: &dyn Fn(&Program, &SimReport) -> bool,
    budget: usize,
    moves: Moves,
) -> Vec<Plan> {
    let stage = Stage::begin("ordering the compute (simulations)", budget);
    let Some((rule, mut best)) = first_lowering(plan, text, opts) else {
        return Vec::new();
    };
    // The plan as it was before the first move between ranks, if it had improved.
    let mut within: Option<Plan> = None;
    let mut plan = plan.clone();
    let mut spent = PLACEMENTS.len();
    for _ in 0..spent.min(budget) {
        stage.step();
    }
    let mut improved = false;
    let mut tried: BTreeSet<(usize, Task, Task)> = BTreeSet::new();
    let mut tried_moves: BTreeSet<Migration> = BTreeSet::new();
    // Moves change where tasks run, never the units: their families are fixed.
    let family = families(&plan);
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
        // No task of any wait helps: move encoder work between ranks.
        if moves == Moves::AcrossRanks {
            for m in migrations(&plan, &family, &best.0, &best.1) {
                if !tried_moves.insert(m) {
                    continue;
                }
                if spent >= budget {
                    break 'search;
                }
                spent += 1;
                stage.step();
                let Some(next) = migrate(&plan, &family, &times, m) else {
                    continue;
                };
                let Some((p, rep)) = lower_one(&next, text, opts, rule) else {
                    continue;
                };
                if better(&rep, &best.1) && fits(&p, &rep) {
                    if improved && within.is_none() {
                        within = Some(plan.clone());
                    }
                    plan = next;
                    best = (p, rep);
                    improved = true;
                    continue 'search;
                }
            }
        }
        break;
    }
    let mut found: Vec<Plan> = within.into_iter().collect();
    if improved {
        found.push(plan);
    }
    found
}

/// Which moves the search may make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moves {
    /// Tasks move within their rank's list only: each rank keeps its work.
    WithinRanks,
    /// Also an encoder unit's whole micro-batch (its `F`, `B`, `W`) from a busy rank
    /// to a less busy one (the lowering broadcasts the parameters and reduces the
    /// gradients it then needs).
    AcrossRanks,
}

/// How many ranks encoder work may move from (of those that set the pace, and of
/// the busiest), and how many of the least busy it may move to.
const SOURCES: usize = 3;
const TARGETS: usize = 3;

/// A move of encoder work: from rank `from` to rank `to`, micro-batch `mb` of one
/// unit (`whole` false) or of all the units of that unit's family on `from`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Migration {
    from: usize,
    to: usize,
    unit: usize,
    mb: usize,
    whole: bool,
}

/// Candidate moves of encoder work: from each of the [`SOURCES`] ranks that set the
/// pace of `program` (compute plus the time the others waited for them, largest
/// first), then each of the [`SOURCES`] busiest by compute not among them, to each
/// of the [`TARGETS`] with the least compute that have less, each movable encoder
/// micro-batch: first whole families (an encoder's units
/// on the rank, its chunks `ENC.k` or layers `ENC/N`, so that a chain of layers stays
/// together), largest first, then single units of a family cut into several.
/// A unit's micro-batch is movable when the unit is not an LLM stage's (those stay
/// home: the plan is pipeline-parallel), all its tasks for that micro-batch are on
/// that rank, none is a recomputation, and neither a raw-input transfer nor
/// `prefetch` names it; a family's when each of its units' is.
fn migrations(
    plan: &Plan,
    family: &[usize],
    program: &Program,
    report: &SimReport,
) -> Vec<Migration> {
    let load = |r: usize| report.compute.get(r).copied().unwrap_or(0.0);
    // How long the other ranks waited for each rank: a rank others wait for paces
    // them, whatever its own compute.
    let waits = crate::waits::waits(program, &report.timeline, report.makespan);
    let waited_for = crate::waits::waited_for(&waits, plan.ranks);
    let mut busy: Vec<usize> = (0..plan.ranks).collect();
    busy.sort_by(|&a, &b| load(b).total_cmp(&load(a)).then(a.cmp(&b)));
    // Sources: the ranks that set the pace (their compute plus the time the others
    // waited for them), then the busiest by compute alone.
    let pace = |r: usize| load(r) + waited_for[r];
    let mut paced: Vec<usize> = (0..plan.ranks).collect();
    paced.sort_by(|&a, &b| pace(b).total_cmp(&pace(a)).then(a.cmp(&b)));
    let mut sources: Vec<usize> = paced.iter().take(SOURCES).copied().collect();
    for &r in busy.iter().take(SOURCES) {
        if !sources.contains(&r) {
            sources.push(r);
        }
    }
    let index = plan.locate();
    let ops = [Op::F, Op::B, Op::W, Op::BW, Op::RF];
    let mut out = Vec::new();
    for &from in &sources {
        let targets: Vec<usize> = busy
            .iter()
            .rev()
            .copied()
            .filter(|&r| load(r) < load(from))
            .take(TARGETS)
            .collect();
        let movable = |u: usize, mb: usize| {
            !crate::bound::is_stage(&plan.units[u])
                && ops.iter().all(|&op| {
                    index
                        .get(op, u, mb)
                        .is_none_or(|(r, _)| r == from && op != Op::RF)
                })
                && !plan.prefetch.contains(&(u, mb))
                && !plan.input_ships.iter().any(|s| s.unit == u && s.mb == mb)
        };
        // (family, mb) -> (work, units, every unit movable)
        let mut groups: BTreeMap<(usize, usize), (f64, Vec<usize>, bool)> = BTreeMap::new();
        let mut seen: BTreeSet<(usize, usize)> = BTreeSet::new();
        for t in &plan.order[from] {
            if crate::bound::is_stage(&plan.units[t.unit]) || !seen.insert((t.unit, t.mb)) {
                continue;
            }
            let g = groups
                .entry((family[t.unit], t.mb))
                .or_insert((0.0, Vec::new(), true));
            g.0 += plan.units[t.unit].work();
            g.1.push(t.unit);
            g.2 &= movable(t.unit, t.mb);
        }
        let mut whole: Vec<(f64, usize, usize)> = Vec::new();
        let mut single: Vec<(f64, usize, usize)> = Vec::new();
        for ((_, mb), (work, units, ok)) in groups {
            if ok {
                whole.push((work, units[0], mb));
            }
            if units.len() > 1 {
                for u in units.into_iter().filter(|&u| movable(u, mb)) {
                    single.push((plan.units[u].work(), u, mb));
                }
            }
        }
        for (list, is_whole) in [(whole, true), (single, false)] {
            let mut list = list;
            list.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            for (_, unit, mb) in list {
                for &to in &targets {
                    out.push(Migration {
                        from,
                        to,
                        unit,
                        mb,
                        whole: is_whole,
                    });
                }
            }
        }
    }
    out
}

/// Each unit's family: the index of the first unit with the same name before its
/// first `.` or `/` (an encoder's chunks and layers share one; a stage is its own).
fn families(plan: &Plan) -> Vec<usize> {
    let stem = |n: &str| n.split(['.', '/']).next().unwrap_or(n).to_string();
    let mut first: BTreeMap<String, usize> = BTreeMap::new();
    plan.units
        .iter()
        .enumerate()
        .map(|(i, u)| {
            if crate::bound::is_stage(u) {
                i
            } else {
                *first.entry(stem(&u.name)).or_insert(i)
            }
        })
        .collect()
}

/// `plan` with the tasks of `m` moved (`family`: [`families`] of the plan's units),
/// each put before the first task of the target that started no earlier than it did
/// (`times`, the simulated compute times), so the target runs them at about the
/// same time, in the same order. `None` when nothing moves.
fn migrate(plan: &Plan, family: &[usize], times: &[Vec<Timed>], m: Migration) -> Option<Plan> {
    // A stage is a family of its own, so a whole encoder family never takes one.
    let takes = |t: &Task| {
        t.mb == m.mb
            && if m.whole {
                family[t.unit] == family[m.unit]
            } else {
                t.unit == m.unit
            }
    };
    let mut next = plan.clone();
    let mut moved: Vec<(f64, Task)> = Vec::new();
    let mut k = 0;
    next.order[m.from].retain(|t| {
        let keep = !takes(t);
        if !keep {
            moved.push((times[m.from][k].start, *t));
        }
        k += 1;
        keep
    });
    if moved.is_empty() {
        return None;
    }
    // Positions in the target's list as it was; inserted from the last, so the
    // earlier positions stay valid, and a task before the one after it.
    let at: Vec<usize> = moved
        .iter()
        .map(|&(start, _)| times[m.to].partition_point(|x| x.start < start))
        .collect();
    for (i, &(_, task)) in moved.iter().enumerate().rev() {
        next.order[m.to].insert(at[i], task);
    }
    Some(next)
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
