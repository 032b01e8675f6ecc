//! The best lowering of one plan: every placement rule of the lowering, re-placement
//! against the simulated times, then transfer and weight-gradient refinement
//! ([`crate::search::refine`]), keeping the fastest program. A small search of its
//! own (it simulates every candidate), just above `refine` in the search floor.

use crate::algebra::analysis::Timing;
use crate::algebra::lower::{
    assemble_lowered, meet_times_and_critical, meeting_times, placement_at, placement_at_times,
    prepare, total_order, Compact, Lowered, Placed, Placement, Prepared, Step,
};
use crate::ir::compare::{at_most, Score};
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{narrow, Action, NameCache, Program};
use crate::judge::simulate::{
    finish_times_taken_or_run, simulate_taken, Kept, Mode, SimOptions, SimReport,
};
use crate::judge::timeline::Slot;
use crate::search::refine::{refine, settle_w};
use rustc_hash::FxHashMap;
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
    // against, `None` for the ideal one, and the rule) with its makespan. Candidates
    // are lowered by unit index and judged by their finishing times alone (no
    // timeline, no memory walk): the makespan is all that ranks them. Only the
    // winner is named and simulated in full, at the end (lowering is deterministic,
    // so it is the program judged). At 8 x 65536, a named program and a full report
    // per candidate, beside the best's report, set the derivation's peak.
    let mut best: Option<Best> = None;
    let done = |best: &Option<Best>| best.as_ref().is_some_and(|b| at_most(b.makespan, target));
    // Placements already lowered and simulated. Rules often agree (on every transfer,
    // or again after re-timing); a placement seen before gives the same program and
    // the same simulation, which can never beat the best kept (ties keep the first),
    // so it is skipped without lowering or simulating it again.
    let mut seen = Seen::default();
    // Only a program faster than the best can be kept: its makespan is the cutoff
    // of a candidate's run (judged by finishing times alone, so the best is held as
    // what places it again, not as its lowering and report: at 8 x 65536 those
    // beside a candidate's run set the derivation's peak).
    let cutoff = |best: &Option<Best>| best.as_ref().map_or(f64::INFINITY, |b| b.makespan);
    // The winner's lowering, kept only when it reaches the plan's ideal makespan:
    // then no other candidate is lowered or simulated beside it, and it is not
    // placed and assembled again at the end. It is kept as its run kept it, taken
    // apart ([`Kept`]: the simulator's reading of it, and 8 bytes an operation of
    // the run): its report is measured from it at the end, when the placements are
    // gone, without running it again, and its steps written again.
    let mut reached: Option<Kept<'_>> = None;
    // The winner's lowering and report where the first candidate, run in full
    // ([`FirstRun`]), reaches the ideal makespan: then nothing else is lowered.
    let mut whole: Option<(Lowered, SimReport)> = None;
    // Whether a run whose ranks finish at `finish` would be kept and reach the
    // ideal: then it is kept.
    let wanted = |best: &Option<Best>, finish: &[f64]| {
        let makespan = makespan_of(finish);
        best.as_ref().is_none_or(|b| b.beaten_by(makespan)) && at_most(makespan, target)
    };
    // Under rendezvous, `Critical`'s times against the ideal timing come first, with
    // whether they are `Meet`'s (then so is its placement, which places both alike
    // by their times alone: its times serve at `Meet`'s turn, and `Critical` is
    // skipped at its own). Where they are not, `Critical` is lowered and run first
    // ([`probe_critical`]): where ranks differ in slack (an encoder's, a loss
    // layer's), it is the rule that most often reaches the ideal makespan, and then
    // no rule can beat it, so it is kept and nothing else is lowered. (A rule before
    // it in [`PLACEMENTS`] that reaches the ideal too would have won that tie: the
    // same makespan, another program.) Where it does not reach the ideal, the rules
    // run in order as ever, and at its turn its placement's signature and makespan
    // answer for it (the same placement runs the same). Under eager semantics
    // `Ready` runs exactly as the ideal timing, so the rules before `Critical`
    // settle the search in at most two runs: no probe, and each rule's pass comes
    // at its turn (`Meet`'s telling of `Critical`'s, [`meetings`]).
    let mut critical = None;
    let mut meet = None;
    let mut probed = None;
    let rule = Placement::Critical;
    let first =
        (opts.mode != Mode::Eager).then(|| meeting_times(&prepared.time, &prepared, rule, policy));
    if let Some((times, alike)) = first {
        critical = Some(alike);
        if alike {
            meet = Some(times);
        } else {
            match probe_critical(plan, &prepared, opts, policy, times, target) {
                Some(Probe::Reached(sig, makespan, run)) => {
                    seen.first(sig);
                    best = Some(Best {
                        time: None,
                        placement: Placement::Critical,
                        makespan,
                        ran: None,
                    });
                    reached = Some(*run);
                }
                Some(Probe::Ran(sig, makespan)) => probed = Some((sig, makespan)),
                None => {}
            }
        }
    }
    for placement in PLACEMENTS {
        if done(&best) {
            break;
        }
        if let (Placement::Critical, Some((sig, makespan))) = (placement, probed) {
            if seen.first(sig) && best.as_ref().is_none_or(|b| b.beaten_by(makespan)) {
                best = Some(Best {
                    time: None,
                    placement,
                    makespan,
                    ran: None,
                });
            }
            continue;
        }
        let held = meet.take().filter(|_| placement == Placement::Meet);
        let Some(taus) =
            held.or_else(|| meetings(&prepared, &prepared.time, placement, policy, &mut critical))
        else {
            continue;
        };
        let at = placement_at_times(plan, &prepared, &prepared.time, placement, &taus, policy)
            .map_err(|e| e.to_string())?;
        drop(taus);
        if !seen.first(Seen::sign(&at)) {
            continue;
        }
        if best.is_none() && replace_rounds > 0 {
            // The first candidate run is the best when it ends: run in full (the
            // same makespan as its finishing times give), it reaches the ideal
            // (then it is the winner, lowered and reported) or serves the first
            // re-placement round as it is ([`FirstRun`]).
            let compact = Compact::of(&at);
            let lowered = assemble_lowered(plan, at).map_err(|e| e.to_string())?;
            let (lowered, report) = simulate_taken(&plan.units, lowered, opts)
                .map_err(|e| format!("derived program does not run: {e}"))?;
            let makespan = report.makespan;
            if at_most(makespan, target) {
                best = Some(Best {
                    time: None,
                    placement,
                    makespan,
                    ran: None,
                });
                whole = Some((lowered, report));
                break;
            }
            let time = simulated_timing(
                plan,
                &lowered.programs,
                &report.timeline.ranks,
                &prepared.time,
            );
            drop(lowered);
            best = Some(Best {
                time: None,
                placement,
                makespan,
                ran: Some((time, report, compact)),
            });
            continue;
        }
        let lowered = assemble_lowered(plan, at).map_err(|e| e.to_string())?;
        // A run that provably cannot beat the best is cut short (`None`).
        // Taken by the simulator: its steps are freed as they are read.
        let Some((finish, run)) =
            finish_times_taken_or_run(&plan.units, lowered, opts, cutoff(&best), |finish| {
                wanted(&best, finish)
            })
            .map_err(|e| format!("derived program does not run: {e}"))?
        else {
            continue;
        };
        let makespan = makespan_of(&finish);
        if best.as_ref().is_none_or(|b| b.beaten_by(makespan)) {
            best = Some(Best {
                time: None,
                placement,
                makespan,
                ran: None,
            });
            if let Some(run) = run.filter(|_| done(&best)) {
                // Nothing is lowered after it: the winner's lowering is kept,
                // and its run.
                reached = Some(run);
            }
        }
    }
    // Re-place the transfers against the times the best program actually ran at:
    // waiting shifts the timeline, and meeting points chosen on the shifted one
    // fit it better. A few rounds, keeping the fastest program.
    // The report of the best's full run in the last re-placement round, while the
    // best is the program it ran: the winner's report at the end, if no later
    // candidate beats it (its lowering is not held: 20 bytes a step beside the
    // placements; it is assembled again), with its placement as that run judged it
    // (in a few bytes an end, [`Compact`]: placing it again from its rule and
    // timing, its meeting times' passes and the sort of its ends, costs about as
    // much as assembling and simulating it). Only the best of a round's start is
    // held so (beside the report, a few bytes an end more): the candidates'
    // placements are not, as two of them beside a candidate's run raise the
    // derivation's peak (`zbv` at 8 x 4096, from 55 bytes an action to 58).
    let mut ran: Option<(SimReport, Compact)> = None;
    for _ in 0..replace_rounds {
        let Some(b) = &mut best else {
            break;
        };
        if reached.is_some() || whole.is_some() {
            break;
        }
        let (time, report, at) = match b.ran.take() {
            Some(first) => first,
            None => b.simulated_timing(plan, &prepared, opts, policy)?,
        };
        ran = Some((report, at));
        let Some(time) = time.map(Rc::new) else {
            break;
        };
        let mut improved = false;
        let mut critical = None;
        for placement in PLACEMENTS {
            let Some(taus) = meetings(&prepared, &time, placement, policy, &mut critical) else {
                continue;
            };
            let Ok(at) = placement_at_times(plan, &prepared, &time, placement, &taus, policy)
            else {
                continue;
            };
            drop(taus);
            if !seen.first(Seen::sign(&at)) {
                continue;
            }
            let Ok(lowered) = assemble_lowered(plan, at) else {
                continue;
            };
            let Ok(Some((finish, run))) =
                finish_times_taken_or_run(&plan.units, lowered, opts, cutoff(&best), |finish| {
                    wanted(&best, finish)
                })
            else {
                continue;
            };
            let makespan = makespan_of(&finish);
            if best.as_ref().is_none_or(|b| b.beaten_by(makespan)) {
                best = Some(Best {
                    time: Some(Rc::clone(&time)),
                    placement,
                    makespan,
                    ran: None,
                });
                ran = None;
                improved = true;
                if let Some(run) = run.filter(|_| done(&best)) {
                    reached = Some(run);
                    break;
                }
            }
        }
        if !improved {
            break;
        }
    }
    drop(seen);
    let best = best.ok_or_else(|| "no lowering".to_string())?;
    // The winner, lowered by unit index and simulated there (the report `simulate`
    // gives for its named program), then named rank by rank, each rank's steps freed
    // as its actions are written: the placement, the named program and the
    // simulator's working set are never alive together.
    // (A best whose full run is held is not simulated again: the same lowering runs
    // the same way; nor one whose run kept what its report needs.)
    let (ran, ran_at) = ran.unzip();
    let winner = match (reached, whole) {
        (Some(kept), _) => Err(kept),
        (None, Some((lowered, report))) => Ok((lowered, Some(report))),
        (None, None) => {
            let at = match &ran_at {
                Some(at) => at.placement(plan, &prepared),
                None => best.placement(plan, &prepared, policy)?,
            };
            let lowered = assemble_lowered(plan, at).map_err(|e| e.to_string())?;
            Ok((lowered, ran))
        }
    };
    // Without refinement nothing places the winner again: the timings it was placed
    // against go before it is simulated (at 8 x 65536, ~100 MB off the peak).
    let again = refine_too.then_some((prepared, best, ran_at));
    // Simulated taken apart (its steps freed as they are read, written again after
    // the run).
    let (lowered, report) = match winner {
        Err(kept) => kept.report(),
        Ok((lowered, Some(report))) => Ok((lowered, report)),
        Ok((lowered, None)) => simulate_taken(&plan.units, lowered, opts),
    }
    .map_err(|e| format!("derived program does not run: {e}"))?;
    let actions: usize = lowered.programs.iter().map(Vec::len).sum();
    let done = at_most(report.makespan, target) || !refine_too;
    let budget = refine_budget.min(refine_actions / actions.max(1));
    // What refinement needs to place the winner again, kept only if it runs.
    let again = again.filter(|_| !done && budget > 0);
    if done {
        return Ok((lowered.into_program(&plan.units, text), report));
    }
    // Refinement works on the lowering by unit index; only its result is named.
    let moved = match again {
        // Refinement moves the placement's ends: placed again (the same placement).
        Some((prepared, best, ran_at)) => {
            let at = match ran_at {
                Some(at) => at.placement(plan, &prepared),
                None => best.placement(plan, &prepared, policy)?,
            };
            drop((prepared, best));
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

/// The best lowering so far, as what lowers it again: the timing its transfers were
/// placed against (`None`: the prepared, ideal one) and the rule, with its makespan.
struct Best {
    time: Option<Rc<Timing>>,
    placement: Placement,
    makespan: f64,
    /// This best's full run, where it was the first candidate run ([`FirstRun`]).
    ran: Option<FirstRun>,
}

/// The first candidate run of a plan (while no best is kept), run in full rather
/// than judged by its finishing times: its simulated timing, its report and its
/// placement ([`Compact`]), what the first re-placement round would otherwise place,
/// assemble and simulate again for it. Held as long as it is the best: beside the
/// later candidates' runs, the same as the round holds beside its own (the report,
/// the placement and the timing re-placed against).
type FirstRun = (Option<Timing>, SimReport, Compact);

impl Best {
    /// Whether a candidate of this makespan is faster (ties keep the first).
    fn beaten_by(&self, makespan: f64) -> bool {
        Score::span(makespan).beats(&Score::span(self.makespan))
    }

    /// The placement this best was judged from (the same: lowering is deterministic).
    fn placement(
        &self,
        plan: &Plan,
        prepared: &Prepared,
        policy: &SearchPolicy,
    ) -> Result<Vec<Vec<Placed>>, String> {
        let time = self.time.as_deref().unwrap_or(&prepared.time);
        placement_at(plan, prepared, time, self.placement, policy).map_err(|e| e.to_string())
    }

    /// The compute tasks' times in a simulation of this best, lowered by unit index
    /// again ([`simulated_timing`]; `None` when they cannot serve as a timing), with
    /// the simulation's report and the placement simulated.
    fn simulated_timing(
        &self,
        plan: &Plan,
        prepared: &Prepared,
        opts: &SimOptions,
        policy: &SearchPolicy,
    ) -> Result<(Option<Timing>, SimReport, Compact), String> {
        let at = self.placement(plan, prepared, policy)?;
        let compact = Compact::of(&at);
        let lowered = assemble_lowered(plan, at).map_err(|e| e.to_string())?;
        let (lowered, report) = simulate_taken(&plan.units, lowered, opts)
            .map_err(|e| format!("derived program does not run: {e}"))?;
        let time = simulated_timing(
            plan,
            &lowered.programs,
            &report.timeline.ranks,
            &prepared.time,
        );
        Ok((time, report, compact))
    }
}

/// The meeting times `placement` gives the transfers against `time`
/// ([`meeting_times`]); `None` for `Critical` or `Join` where they are `Meet`'s: then
/// so is the placement, and `Meet`'s against the same timing comes first in
/// [`PLACEMENTS`] (already seen, or failed as this one would), so it is skipped
/// without being placed. `critical` holds what `Meet`'s pass against `time` told of
/// `Critical` ([`meet_times_and_critical`]; written by `Meet`, read by `Critical`):
/// where it is `Meet`'s, it is skipped without a pass of its own.
fn meetings(
    prepared: &Prepared,
    time: &Timing,
    placement: Placement,
    policy: &SearchPolicy,
    critical: &mut Option<bool>,
) -> Option<Vec<(f64, f64)>> {
    match placement {
        Placement::Meet => {
            let (taus, alike) = meet_times_and_critical(time, prepared, policy);
            *critical = Some(alike);
            return Some(taus);
        }
        Placement::Critical if *critical == Some(true) => return None,
        _ => {}
    }
    let (taus, as_meet) = meeting_times(time, prepared, placement, policy);
    (!as_meet).then_some(taus)
}

/// The makespan of a simulation whose ranks finished at `finish` (as
/// [`SimReport::makespan`] is: the latest, 0 without ranks).
fn makespan_of(finish: &[f64]) -> f64 {
    finish.iter().copied().fold(0.0, f64::max)
}

/// The placements lowered so far, each as a 64-bit hash (SipHash-1-3, fixed keys)
/// of its ends' slots and transfers, rank by rank, in order, with each rank's
/// number of ends (the program `assemble` builds from a placement is a function of
/// exactly these: each end's action follows from its transfer and rank). Equal
/// placements have equal hashes, so a placement seen before is always known; a
/// new one is taken for one seen only if their hashes collide (about 2^-64 for a
/// pair, with a handful of placements a plan). 8 bytes a placement, where its
/// numbers took about 3 MB at 8 x 65536 (as variable-length differences), and
/// that beside a candidate's run.
#[derive(Default)]
struct Seen(Vec<u64>);

impl Seen {
    /// The signature of placement `at`.
    ///
    /// A hasher's writes are one stream of bytes, so a rank's numbers (its count,
    /// then each end's, as `write_usize` and `write_u64` give them) are written at
    /// once: the same hash, the hasher's bookkeeping of a write paid once a rank,
    /// not once an end (a rank's bytes held meanwhile, 8 an end, in one buffer for
    /// all ranks, filled in place: no room checked an end).
    fn sign(at: &[Vec<Placed>]) -> u64 {
        use std::hash::Hasher;
        const COUNT: usize = std::mem::size_of::<usize>();
        const END: usize = std::mem::size_of::<u64>();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let mut bytes = Vec::new();
        for list in at {
            // Grown (zeroed) only past the longest rank so far: every byte of a
            // rank's part is written before it is read.
            let size = COUNT + END * list.len();
            if bytes.len() < size {
                bytes.resize(size, 0);
            }
            let (count, ends) = bytes[..size].split_at_mut(COUNT);
            count.copy_from_slice(&list.len().to_ne_bytes());
            for (out, x) in ends.chunks_exact_mut(END).zip(list) {
                let word = u64::from(x.slot) << u32::BITS | u64::from(x.id);
                out.copy_from_slice(&word.to_ne_bytes());
            }
            h.write(&bytes[..size]);
        }
        h.finish()
    }

    /// Record the placement of signature `sig` and say whether it is new.
    fn first(&mut self, sig: u64) -> bool {
        if self.0.contains(&sig) {
            return false;
        }
        self.0.push(sig);
        true
    }
}

/// What [`probe_critical`] found: `Critical`'s placement (its signature) reached
/// the ideal makespan, and its run is kept; or it ran to this makespan.
enum Probe<'p> {
    Reached(u64, f64, Box<Kept<'p>>),
    Ran(u64, f64),
}

/// `Critical`'s placement against the prepared (ideal) timing (its meeting times
/// `taus`), lowered and run to the end: whether it reaches the ideal makespan
/// `target`, with its signature ([`Seen::sign`]) and makespan. `None` where it fails to place, assemble or run:
/// its turn in [`PLACEMENTS`] then fails as it always did, in order.
fn probe_critical<'p>(
    plan: &'p Plan,
    prepared: &Prepared,
    opts: &SimOptions,
    policy: &SearchPolicy,
    taus: Vec<(f64, f64)>,
    target: f64,
) -> Option<Probe<'p>> {
    let rule = Placement::Critical;
    let at = placement_at_times(plan, prepared, &prepared.time, rule, &taus, policy).ok()?;
    drop(taus);
    let sig = Seen::sign(&at);
    let lowered = assemble_lowered(plan, at).ok()?;
    let reaches = |finish: &[f64]| at_most(makespan_of(finish), target);
    let (finish, run) =
        finish_times_taken_or_run(&plan.units, lowered, opts, f64::INFINITY, reaches).ok()??;
    let makespan = makespan_of(&finish);
    Some(match run {
        Some(run) => Probe::Reached(sig, makespan, Box::new(run)),
        None => Probe::Ran(sig, makespan),
    })
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
        // As long as the rank's order: its compute steps, if the lowering is whole.
        let n = plan.order.get(r).map_or(0, Vec::len);
        let (mut s, mut e) = (Vec::with_capacity(n), Vec::with_capacity(n));
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
    let seq = settle_order(&start, &end, &ideal.seq)?;
    Some(Timing { start, end, seq })
}

/// A rank's next task in [`settle_order`]'s merge: its key, the rank, its place
/// in the rank's order.
type Head = ((i64, i64, u32), usize, usize);

/// Each task's place (from 0) in the order of all tasks by end, then start, then
/// `ideal` seq (as `f64::total_cmp` orders the times; `ideal` numbers the tasks, so
/// the order is total). A rank runs its tasks one after another, so each rank's
/// tasks come in this order already: the ranks' lists are merged, in time
/// `n log p` for `n` tasks on `p` ranks, each task's key read once. (A rank whose
/// list is not in order, which no simulation gives, is sorted first.) `None` when
/// the count is over 2^32.
fn settle_order(start: &[Vec<f64>], end: &[Vec<f64>], ideal: &[Vec<u32>]) -> Option<Vec<Vec<u32>>> {
    use std::cmp::Reverse;
    let key = |r: usize, i: usize| {
        (
            total_order(end[r][i]),
            total_order(start[r][i]),
            ideal[r][i],
        )
    };
    // Per rank, its tasks in key order: in their own order, unless (never from a
    // simulation) that is not the key order.
    let lists: Vec<Option<Vec<u32>>> = (0..end.len())
        .map(|r| {
            let n = end[r].len();
            if (1..n).all(|i| key(r, i - 1) < key(r, i)) {
                return None;
            }
            let mut by: Vec<u32> = (0..n as u32).collect();
            by.sort_by_key(|&i| key(r, i as usize));
            Some(by)
        })
        .collect();
    let task = |r: usize, k: usize| lists[r].as_ref().map_or(k, |l| l[k] as usize);
    let mut seq: Vec<Vec<u32>> = end.iter().map(|l| vec![0; l.len()]).collect();
    // The next task of every rank with one left, as (key, rank, its place there).
    let mut heads: std::collections::BinaryHeap<Reverse<Head>> = (0..end.len())
        .filter(|&r| !end[r].is_empty())
        .map(|r| Reverse((key(r, task(r, 0)), r, 0)))
        .collect();
    let mut k: usize = 0;
    while let Some(mut top) = heads.peek_mut() {
        let Reverse((_, r, at)) = *top;
        seq[r][task(r, at)] = u32::try_from(k).ok()?;
        k += 1;
        if at + 1 < end[r].len() {
            *top = Reverse((key(r, task(r, at + 1)), r, at + 1));
        } else {
            std::collections::binary_heap::PeekMut::pop(top);
        }
    }
    Some(seq)
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
/// on every rank that computes it elsewhere (broadcast or replicated). One pass
/// over each rank's compute actions, their units found by name once per name
/// ([`NameCache`]) and marked in a flat rank-by-unit table.
pub fn resident_params(program: &Program) -> Vec<f64> {
    let (ranks, n) = (program.ranks, program.units.len());
    // Equal names: the last unit of that name, as a map collected from the list.
    let index: FxHashMap<&str, u32> = program
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name.as_str(), narrow(i)))
        .collect();
    let mut held = vec![false; ranks * n];
    for (u, unit) in program.units.iter().enumerate() {
        if unit.home < ranks {
            held[unit.home * n + u] = true;
        }
    }
    for (list, row) in program
        .programs
        .iter()
        .take(ranks)
        .zip(held.chunks_mut(n.max(1)))
    {
        let mut recent = NameCache::new();
        for a in list {
            let (Action::F { unit, .. }
            | Action::B { unit, .. }
            | Action::W { unit, .. }
            | Action::BW { unit, .. }
            | Action::RF { unit, .. }) = a
            else {
                continue;
            };
            if let Some(u) = recent.get(unit, |name| index.get(name).copied()) {
                row[u as usize] = true;
            }
        }
    }
    (0..ranks)
        .map(|r| {
            held[r * n..(r + 1) * n]
                .iter()
                .zip(&program.units)
                .filter(|(&h, _)| h)
                .map(|(_, u)| u.params)
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::lower::lower_with;
    use crate::ir::model::CommModel;
    use crate::judge::simulate::simulate;
    use crate::search::replan::derived_plan as plan_of;

    /// The placement search keeps the fastest lowering it tries, whichever rule it
    /// runs first: never slower than any of its rules' own lowering of the plan
    /// against the plan's ideal timing (so at the ideal makespan wherever one of
    /// them is), under rendezvous and eager semantics, with and without a link
    /// model; plans with unbalanced stages (encoders, trainable and frozen) and
    /// balanced ones.
    #[test]
    fn the_search_is_never_slower_than_one_of_its_rules() {
        let qwen = include_str!("../../../profiles/qwen2vl-7b.toml");
        let heavy = include_str!("../../../profiles/encoder-heavy.toml");
        let small = include_str!("../../../docs/guide/examples/small-mllm.toml");
        let frozen = include_str!("../../../docs/guide/examples/frozen-mllm.toml");
        let llm = include_str!("../../../docs/guide/examples/llm-only.toml");
        let plans = [
            plan_of(qwen, (4, 8), "zbv"),
            plan_of(qwen, (4, 8), "1f1b"),
            plan_of(heavy, (4, 6), "zb2p(v = 2)"),
            plan_of(heavy, (3, 6), "interleaved(v = 2)"),
            plan_of(small, (4, 8), "zb2p(v = 2)"),
            plan_of(small, (4, 8), "transpose(vision, 1f1b)"),
            plan_of(frozen, (4, 8), "transpose(vision, zbv)"),
            plan_of(llm, (4, 8), "zbh1"),
        ];
        let options = [
            SimOptions::default(),
            SimOptions {
                mode: Mode::Eager,
                ..SimOptions::default()
            },
            SimOptions {
                comm: Some(CommModel {
                    latency: 0.5,
                    bandwidth: 4.0,
                }),
                ..SimOptions::default()
            },
        ];
        let policy = SearchPolicy::DEFAULT;
        for (k, plan) in plans.iter().enumerate() {
            for opts in &options {
                let (_, found) =
                    best_lowering_with(plan, None, opts, None, false, &policy).unwrap();
                for rule in PLACEMENTS {
                    let Ok(own) = lower_with(plan, None, rule) else {
                        continue;
                    };
                    let Ok(ran) = simulate(&own, opts) else {
                        continue;
                    };
                    assert!(
                        at_most(found.makespan, ran.makespan),
                        "plan {k}, {:?}: the search's {} against {rule:?}'s {}",
                        opts.mode,
                        found.makespan,
                        ran.makespan
                    );
                }
            }
        }
    }

    /// A placement's signature is the hash of its numbers written one by one (each
    /// rank's count, then each end's slot and transfer): the same value, on every
    /// rule's placement of a few plans.
    #[test]
    fn a_signature_is_the_hash_of_the_numbers_one_by_one() {
        use std::hash::Hasher;
        let one_by_one = |at: &[Vec<Placed>]| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            for list in at {
                h.write_usize(list.len());
                for x in list {
                    h.write_u64(u64::from(x.slot) << u32::BITS | u64::from(x.id));
                }
            }
            h.finish()
        };
        let small = include_str!("../../../docs/guide/examples/small-mllm.toml");
        let heavy = include_str!("../../../profiles/encoder-heavy.toml");
        let plans = [
            plan_of(small, (4, 8), "transpose(vision, 1f1b)"),
            plan_of(heavy, (4, 6), "zb2p(v = 2)"),
        ];
        let policy = SearchPolicy::DEFAULT;
        for plan in &plans {
            let prepared = prepare(plan).unwrap();
            for rule in PLACEMENTS {
                let at = placement_at(plan, &prepared, &prepared.time, rule, &policy).unwrap();
                assert_eq!(Seen::sign(&at), one_by_one(&at), "{rule:?}");
            }
            assert_eq!(Seen::sign(&[]), one_by_one(&[]));
        }
    }

    /// The merge gives each task its place in the order of all tasks by end, then
    /// start, then ideal seq (`f64::total_cmp`), as sorting them all gives it: on
    /// rank counts around powers of two, ranks without tasks, equal and signed
    /// times, NaNs, and ranks whose tasks are not in that order.
    #[test]
    fn the_settle_order_is_the_sorted_order() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let times = [0.0, -0.0, 1.0, 1.5, 2.0, -1.0, f64::NAN, f64::INFINITY];
        for ranks in [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17] {
            for round in 0..4 {
                let mut start: Vec<Vec<f64>> = Vec::new();
                let mut end: Vec<Vec<f64>> = Vec::new();
                let mut ideal: Vec<Vec<u32>> = Vec::new();
                let mut number = 0u32;
                for r in 0..ranks {
                    let n = if (r + round) % 4 == 0 {
                        0
                    } else {
                        (next() % 9) as usize
                    };
                    let pick = |x: u64| times[(x % times.len() as u64) as usize];
                    let mut s: Vec<f64> = (0..n).map(|_| pick(next())).collect();
                    let mut e: Vec<f64> = (0..n).map(|_| pick(next())).collect();
                    if round % 2 == 0 {
                        // As a simulation gives them: in key order.
                        let mut both: Vec<(f64, f64)> = e.iter().copied().zip(s).collect();
                        both.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
                        (e, s) = both.into_iter().unzip();
                    }
                    start.push(s);
                    end.push(e);
                    ideal.push((0..n as u32).map(|k| number + k).collect());
                    number += n as u32;
                }
                let mut all: Vec<(usize, usize)> = (0..ranks)
                    .flat_map(|r| (0..end[r].len()).map(move |i| (r, i)))
                    .collect();
                all.sort_by(|&(r, i), &(q, j)| {
                    end[r][i]
                        .total_cmp(&end[q][j])
                        .then(start[r][i].total_cmp(&start[q][j]))
                        .then(ideal[r][i].cmp(&ideal[q][j]))
                });
                let mut want: Vec<Vec<u32>> = end.iter().map(|l| vec![0; l.len()]).collect();
                for (k, &(r, i)) in all.iter().enumerate() {
                    want[r][i] = k as u32;
                }
                let got = settle_order(&start, &end, &ideal).unwrap();
                assert_eq!(got, want, "{ranks} ranks, round {round}");
            }
        }
    }

    /// The resident parameters by definition: per rank, the set of units homed
    /// there or computed there (found by name, the last unit of a name), summed in
    /// unit order.
    fn resident_by_definition(program: &Program) -> Vec<f64> {
        let last = |name: &str| program.units.iter().rposition(|u| u.name.as_str() == name);
        (0..program.ranks)
            .map(|r| {
                let mut held = std::collections::BTreeSet::new();
                held.extend((0..program.units.len()).filter(|&u| program.units[u].home == r));
                for a in program.programs.get(r).into_iter().flatten() {
                    if let crate::ir::program::ActionRef::Compute(c) = a.view() {
                        held.extend(last(c.unit));
                    }
                }
                held.iter().map(|&u| program.units[u].params).sum()
            })
            .collect()
    }

    /// The one-pass reading of resident parameters (names found through a cache
    /// keyed by address) gives the definition's figures bit for bit: on derived
    /// programs (shared names), on the same programs read back from JSON (every
    /// name its own allocation), and with a compute action renamed to a unit the
    /// program does not have (ignored) or to another rank's unit (held there too).
    #[test]
    fn resident_parameters_are_those_of_the_definition() {
        let qwen = include_str!("../../../profiles/qwen2vl-7b.toml");
        let heavy = include_str!("../../../profiles/encoder-heavy.toml");
        let small = include_str!("../../../docs/guide/examples/small-mllm.toml");
        let cases = [
            (qwen, "zbv"),
            (heavy, "transpose(vision, 1f1b)"),
            (small, "zb2p(v = 2)"),
            (small, "gpipe"),
        ];
        for (text, expr) in cases {
            let profile = crate::algebra::profile::Profile::from_toml_str(text).unwrap();
            let req = crate::search::derive::Request::new(&profile, 4, 8);
            let program = crate::search::derive::derive_str(&req, expr)
                .unwrap()
                .program;
            let json = serde_json::to_string(&program).unwrap();
            let read: Program = serde_json::from_str(&json).unwrap();
            let mut renamed = read.clone();
            let units: Vec<String> = renamed.units.iter().map(|u| u.name.to_string()).collect();
            for (r, list) in renamed.programs.iter_mut().enumerate() {
                let mut k = 0;
                for a in list.iter_mut() {
                    if let Action::F { unit, .. } = a {
                        let to = if k % 2 == 0 {
                            "no such unit".to_string()
                        } else {
                            units[(r + k) % units.len()].clone()
                        };
                        *unit = serde_json::from_value(serde_json::Value::String(to)).unwrap();
                        k += 1;
                    }
                }
            }
            for p in [&program, &read, &renamed] {
                let fast = resident_params(p);
                let slow = resident_by_definition(p);
                assert_eq!(fast.len(), slow.len(), "{expr}");
                for (f, s) in fast.iter().zip(&slow) {
                    assert_eq!(
                        f.to_bits(),
                        s.to_bits(),
                        "{expr}: {fast:?} against {slow:?}"
                    );
                }
            }
        }
    }
}
