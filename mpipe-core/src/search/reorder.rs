//! Refinement of a plan's compute order by simulation (`refine(X, order = N)`).
//!
//! [`crate::search::refine`] moves a program's transfers, and then weight gradients, to
//! where the ranks wait; every other compute task stays where the plan put it. But
//! a plan is designed against an ideal timing, and where the real one differs a rank
//! can sit blocked on a receive while a task further down its own list has had its
//! inputs for a while. `reorder` moves such tasks into the waits:
//!
//! 1. lower the plan with each placement rule of [`crate::algebra::lower`] and keep the rule
//!    whose program runs fastest; every candidate below is lowered with that rule;
//! 2. simulate, and list each rank's waits (the time it spends blocked in transfers
//!    right before a compute task), longest first;
//! 3. for a wait before task `j` on rank `r`, first the weight gradients later on
//!    `r` whose backward ran before `j`, the longest deferred first, as many as fit
//!    the wait (when two or more do: [`fill_with_w`]) are a candidate, moved
//!    together; then every task `k` up to [`lookahead`](crate::ir::policy::SearchPolicy::lookahead) places later on `r` whose
//!    inputs were all ready by the middle of the wait (produced there, before `j`,
//!    or elsewhere, by then in the simulation) is one: move `k` to just before `j`,
//!    lower, simulate;
//! 4. keep the first candidate that shortens the step (or, as long, lowers the sum
//!    of the ranks' finishing times) and fits the memory, and go back to 2;
//! 5. when no candidate of any wait does, and the caller allows it
//!    ([`Moves::AcrossRanks`]), move encoder work instead: from the ranks that set
//!    the pace (the most compute plus the time the other ranks waited for them, as
//!    [`crate::judge::waits`] attributes it), then the busiest by compute, to the least
//!    busy, one micro-batch of an encoder (all its layers or chunks on that rank
//!    together, else one layer), each task put where the target was at the time it
//!    ran; keep the first that shortens the step as in 4 and go
//!    back to 2. LLM stage tasks never move (the plan stays pipeline-parallel, as
//!    the bounds assume); the lowering adds the parameter broadcast and gradient
//!    reduction a rank computing away from a unit's home needs;
//! 6. when nothing of 3-5 helps, shift work along a rank instead: for each wait,
//!    an earlier weight gradient (up to [`lookahead`](crate::ir::policy::SearchPolicy::lookahead) places before it) moves into
//!    it, so that what ran between them, and the sends other ranks wait for among
//!    that, runs earlier; and the producer on another rank whose output arrived
//!    last moves earlier on its own rank (before the weight gradients right before
//!    it, or as early as its own inputs allow). Keep the first that helps as in 4
//!    and go back to 2. Stop when nothing helps, or after `budget` simulations.
//!
//! The caller then derives the new plan in full (every rule, re-placement, transfer
//! refinement) and keeps it only if it beats what it had; when the search moved
//! work between ranks, or came to step 6, after improving the order, the plan at
//! that point is derived too, since one rule's ranking and the full derivation's
//! can differ. [`reorder_rounds`] does this in rounds: the full derivation moves
//! weight gradients and transfers, which changes the waits, so the next round
//! searches from the kept program's order, with the simulations left, until a
//! round keeps nothing (the result is then a fixed point: searching it again finds
//! nothing, budget allowing).
//!
//! Invariants: a move within a rank never puts a task before a producer on its own
//! rank (nor a backward before its forward, a weight gradient before its backward),
//! so the plan stays a valid order; a move between ranks may, or may close a
//! cycle between ranks, and the lowering refuses such a plan (every candidate that
//! does not lower is skipped), so the plan found is always a valid order; the programs are lowerings of plans, so the lowering's
//! deadlock-freedom argument covers them; deterministic (no clocks; ties go to the
//! lower rank, then the earlier task; on a large plan the next few candidates are
//! lowered and simulated side by side on every core, then taken in order, counted
//! and remembered as one at a time would, so the cores change only the wall time);
//! the budget counts simulations, so the result does not depend on the machine.
//! Progress is reported as a stage of `budget` simulations ([`crate::ir::progress`]),
//! which ends early when no move is left.

use crate::algebra::analysis::dependencies;
use crate::algebra::lower::{
    lower_indexed_by, lower_indexed_from, lower_prepared_by, prepare, prepare_named, Frame,
    Lowered, Meetings, Placement,
};
use crate::ir::compare::{less, Score};
use crate::ir::plan::{Plan, Task, TaskIndex, UnitNames};
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{ActionRef, Op, Program};
use crate::ir::progress::Stage;
use crate::judge::compare::{span, timed};
use crate::judge::resume::Resumable;
use crate::judge::simulate::{
    finish_times_within, simulate, simulate_lowered, SimOptions, SimReport,
};
use crate::search::ideal::{timed_from, Log, View};
use crate::search::place::PLACEMENTS;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Better plans than `plan`, if the search finds any within `budget` simulations
/// (see the module documentation), and the simulations spent; no plan when no move
/// helped. The last is where the search ended; before it come the plan before the
/// first move between ranks and the plan when step 6 began, if the order had
/// improved by then (each is judged under one placement rule here, and the
/// caller's full derivation can rank them otherwise). `fits` says whether a
/// program's memory is acceptable.
fn reorder(plan: &Plan, search: &Search, budget: usize, replay: &mut Replay) -> (Vec<Plan>, usize) {
    let width = workers(plan.order.iter().map(Vec::len).sum(), search.policy);
    reorder_on(plan, search, budget, width, replay)
}

/// [`reorder`] lowering up to `width` candidates at a time: on this thread and
/// `width - 1` workers kept for the whole search ([`Pool`]).
fn reorder_on(
    plan: &Plan,
    search: &Search,
    budget: usize,
    width: usize,
    replay: &mut Replay,
) -> (Vec<Plan>, usize) {
    // Moves never change the units: every trial's plan has these names.
    let names = plan.unit_names();
    std::thread::scope(|s| {
        let pool = Pool::new(
            s,
            width.saturating_sub(1),
            plan,
            &names,
            search.opts,
            search.policy,
        );
        search_on(plan, search, budget, width, replay, &pool)
    })
}

/// [`reorder_on`] with its workers.
fn search_on(
    plan: &Plan,
    search: &Search,
    budget: usize,
    width: usize,
    replay: &mut Replay,
    pool: &Pool,
) -> (Vec<Plan>, usize) {
    let Search {
        text,
        opts,
        fits,
        moves,
        policy,
        ..
    } = *search;
    // How far down a rank's list a task may come from to fill a wait, and the
    // shortest wait (relative to the step) worth a simulation.
    let (lookahead, min_wait) = (policy.lookahead, policy.min_wait);
    let (sources, targets) = (policy.migrate_sources, policy.migrate_targets);
    let stage = Stage::begin("ordering the compute (simulations)", budget);
    let Some((rule, mut best)) = first_lowering(plan, text, opts, policy) else {
        return (Vec::new(), PLACEMENTS.len().min(budget));
    };
    // The plan as it was before the first move between ranks, if it had improved,
    // and when the first two kinds of move ran out, if they had.
    let mut within: Option<Plan> = None;
    let mut exhausted: Option<Plan> = None;
    let mut plan = plan.clone();
    let mut spent = PLACEMENTS.len();
    for _ in 0..spent.min(budget) {
        stage.step();
    }
    let mut improved = false;
    let mut tried: BTreeSet<Move> = BTreeSet::new();
    // The best's lowering, which the trials are resumed from (the first lowered
    // again by unit index, the same placement).
    let mut lowered: Option<Lowered> = prepare(&plan)
        .ok()
        .and_then(|p| lower_indexed_by(&plan, &p, rule, policy).ok());
    // Moves change where tasks run, never the units: their families are fixed.
    let family = Arc::new(families(&plan));
    // Which base the trials are moves of (the scratch plans know which they hold).
    let mut rounds = 0;
    // The next base's parts, built as the move that made it was measured.
    let mut set_up: Option<Parts> = None;
    'search: while spent < budget {
        let (program, report) = &best;
        let (setup, run, times) = set_up.take().unwrap_or_else(|| {
            (
                Setup::of(&plan, pool.names, rule, policy),
                lowered
                    .take()
                    .and_then(|l| Resumable::new(l, &report.timeline)),
                compute_times(program, report),
            )
        });
        // The plan lowered, so its dependencies resolve; were they not to, stop
        // with what was found.
        let Some(Setup {
            deps,
            ideal,
            meetings,
            frame,
            index,
        }) = setup
        else {
            break;
        };
        // What the trials of this round are moves of (their plans are built where
        // they are lowered, from this order).
        rounds += 1;
        let base = Arc::new(Base {
            round: rounds,
            order: plan.order.clone(),
            times,
            index,
            family: Arc::clone(&family),
            run,
            meetings,
            ideal,
            frame,
        });
        let (times, index) = (&base.times, &base.index);
        let mut waits: Vec<(f64, usize, usize)> = Vec::new();
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                if slot.wait > min_wait * report.makespan {
                    waits.push((slot.wait, r, j));
                }
            }
        }
        waits.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        // The first move kept: the plan, its program and report, and whether it
        // moved work between ranks.
        let mut kept: Option<(Plan, (Program, SimReport), bool)> = None;
        // The round's tries, kind after kind (a kind only once no move of the kinds
        // before it helps), generated as they are issued: the first kept ends them.
        let (on, deps, family, run, waits) = (&plan, &deps, &*family, &best, &waits);
        let mut stream = KINDS.into_iter().flat_map(move |kind| {
            let tries: Box<dyn Iterator<Item = Try>> = match kind {
                Kind::Migrate if moves == Moves::AcrossRanks => Box::new(
                    migrations(on, family, &run.0, &run.1, (sources, targets))
                        .into_iter()
                        .map(Try::Migrate),
                ),
                Kind::Migrate => Box::new(std::iter::empty()),
                _ => Box::new(waits.iter().flat_map(move |&(wait, r, j)| {
                    // A wait is first filled with weight gradients, then single
                    // tasks move into it.
                    let fill = (kind == Kind::Advance)
                        .then(|| fill_with_w(on, index, r, j, wait))
                        .flatten();
                    fill.into_iter().chain(
                        candidates(on, deps, times, (r, j), wait, kind, lookahead)
                            .into_iter()
                            .map(|(q, from, to)| {
                                let list = &on.order[q];
                                let anchor = if to < from { list[to] } else { list[to + 1] };
                                Try::Within((q, list[from], anchor), from, to)
                            }),
                    )
                })),
            };
            tries.map(move |t| (kind, t))
        });
        // A trial only has to tell whether it beats the best: one that provably
        // ends later is cut short ([`Outcome::Slower`]).
        let against = Against {
            rule,
            cutoff: best.1.makespan,
            best: timed(&best.1),
        };
        // The tries issued and not yet taken, in order: lowered side by side as
        // the threads come free, then taken in order as one at a time would (each
        // counted and remembered as it is taken), so the search does not depend on
        // the threads.
        let mut ahead: std::collections::VecDeque<Ahead> = std::collections::VecDeque::new();
        let depth = (width * policy.order_window).max(1);
        let mut shifting = false;
        loop {
            // Fresh tries (a move may come up for several waits: it is tried
            // once), while the window and the simulations left allow.
            let room = budget.saturating_sub(spent).clamp(1, depth);
            while ahead.len() < room {
                let Some((kind, t)) = stream.next() else {
                    break;
                };
                let key = t.key();
                if tried.contains(&key) || ahead.iter().any(|a| a.key == key) {
                    continue;
                }
                // A trial an earlier search of the same plan took at this very
                // point is not lowered again: its finishing times are read back.
                let recorded = ahead
                    .iter()
                    .all(|a| a.recorded.is_some())
                    .then(|| replay.recorded(ahead.len(), key))
                    .flatten();
                let issued = match recorded {
                    Some(_) => None,
                    None => Some(pool.issue(&base, t, against)),
                };
                ahead.push_back(Ahead {
                    kind,
                    t,
                    key,
                    recorded,
                    issued,
                });
            }
            let Some(next) = ahead.pop_front() else {
                break;
            };
            if next.kind == Kind::Shift && !shifting {
                shifting = true;
                if improved && exhausted.is_none() {
                    exhausted = Some(plan.clone());
                }
            }
            tried.insert(next.key);
            if spent >= budget {
                pool.discard();
                break 'search;
            }
            spent += 1;
            stage.step();
            let t = next.t;
            let (low, outcome) = match (next.recorded, next.issued) {
                (Some(outcome), _) => {
                    replay.at += 1;
                    replay.replayed += 1;
                    (None, outcome)
                }
                (None, issued) => {
                    let (low, outcome) = match issued {
                        Some(n) => pool.take(n),
                        None => (None, Outcome::Fails),
                    };
                    replay.record(next.key, outcome.clone());
                    (low, outcome)
                }
            };
            let Outcome::Ran(finish) = outcome else {
                continue;
            };
            if !timed_finish(&finish).beats(&against.best) {
                continue;
            }
            // The plan of a move that helps is built here too.
            let mut next = plan.clone();
            if !base.apply(t, &mut next.order) {
                continue;
            }
            // A move that helps is nearly always kept, and then what is issued
            // behind it is of no use: it is dropped now, so that no worker starts
            // it, and the next base's set-up takes the other core while this
            // thread measures the move; issued again if the move is not kept.
            pool.discard();
            let cutoff = against.cutoff;
            let (keep, setup) = std::thread::scope(|s| {
                let beside = (width > 1).then(|| {
                    let (next, names) = (&next, pool.names);
                    s.spawn(move || Setup::of(next, names, rule, policy))
                });
                // A trial read back is lowered again only when it helps.
                let keep = low
                    .or_else(|| {
                        lower_one(&next, pool.names, opts, rule, policy, cutoff, (None, None)).0
                    })
                    .and_then(|low| {
                        // Only a move that helps is measured in full and named (for
                        // `fits`, and to keep).
                        let rep = simulate_lowered(&next.units, &low, opts).ok()?;
                        let p = low.program(&next.units, text);
                        (better(&rep, &best.1) && fits(&p, &rep)).then(|| {
                            let times = compute_times(&p, &rep);
                            let run = Resumable::new(low, &rep.timeline);
                            ((p, rep), (run, times))
                        })
                    });
                // A panic in the set-up of a plan that is not kept is one a single
                // thread would not have met: dropped with it.
                let setup = beside.map(|h| h.join());
                (keep, setup)
            });
            let Some(((p, rep), (run, times))) = keep else {
                for a in ahead.iter_mut().filter(|a| a.issued.is_some()) {
                    a.issued = Some(pool.issue(&base, a.t, against));
                }
                continue;
            };
            let setup = match setup {
                Some(Ok(setup)) => setup,
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                None => Setup::of(&next, pool.names, rule, policy),
            };
            set_up = Some((setup, run, times));
            kept = Some((next, (p, rep), matches!(t, Try::Migrate(_))));
            break;
        }
        // What is still issued is moves of this round's base: dropped.
        pool.discard();
        drop(stream);
        if kept.is_none() && !shifting && improved && exhausted.is_none() {
            // Every kind was tried (the last had nothing to try).
            exhausted = Some(plan.clone());
        }
        let Some((next, kept_run, between)) = kept else {
            break;
        };
        if between && improved && within.is_none() {
            within = Some(plan.clone());
        }
        plan = next;
        best = kept_run;
        improved = true;
    }
    let mut found: Vec<Plan> = within.into_iter().chain(exhausted).collect();
    if improved {
        found.push(plan);
    }
    (found, spent.min(budget))
}

/// What the searches of one plan share: the source text its programs record, the
/// simulation options, whether a program's memory is acceptable, and which moves
/// are allowed.
#[derive(Clone, Copy)]
pub(crate) struct Search<'a> {
    pub text: Option<&'a str>,
    pub opts: &'a SimOptions,
    pub fits: &'a dyn Fn(&Program, &SimReport) -> bool,
    pub moves: Moves,
    /// The tuning of the search and of the lowerings it tries.
    pub policy: &'a SearchPolicy,
    /// Where the trials of an earlier search of the same plan, under the same
    /// options, are kept and this one's are recorded (see [`Trials`]), if anywhere.
    pub trials: Option<&'a Trials>,
}

/// The trials a search of one plan took, in the order it took them: each move
/// and what its lowering gave ([`Outcome`]). The search is deterministic and its budget only cuts it short, so
/// a search of the same plan under the same options with a larger budget takes
/// the same trials first: it reads their times back instead of lowering and
/// simulating them again (`auto`'s further order search repeats its first one
/// that way). Each trial read back is checked to be the move recorded; from the
/// first that is not, the record is dropped and the search goes on alone.
#[derive(Default)]
pub(crate) struct Trials {
    taken: std::cell::RefCell<Vec<(Move, Outcome)>>,
    /// What the search started from, kept for the next derivation of the same plan
    /// under the same request (see [`Trials::start`]).
    start: std::cell::RefCell<Option<Box<Start>>>,
}

/// The lowerings a derivation of a plan with an order search starts from: its
/// best lowering with refinement (the search's start) and without (the plan's own),
/// each a program and its report ([`crate::search::finish`]).
pub(crate) type Start = ((Program, SimReport), (Program, SimReport));

impl Trials {
    /// The start an earlier derivation of the same plan kept ([`Trials::keep`]),
    /// if any: the same lowerings, as deterministic derivations of the same plan
    /// under the same request give them (the caller names them for its own
    /// expression).
    pub(crate) fn start(&self) -> Option<Start> {
        self.start.borrow().as_deref().cloned()
    }

    /// Keep `start` for the next derivation of the same plan.
    pub(crate) fn keep(&self, start: &Start) {
        *self.start.borrow_mut() = Some(Box::new(start.clone()));
    }
}

/// What a trial's lowering gave: each rank's finishing time, or the proof that it
/// ends later than the best of its time (its simulation cut short there), or
/// nothing (nothing to lower, or it does not lower or run). A search reading the
/// record back follows the same course, so it compares a trial with the same best:
/// one that was slower is still slower.
#[derive(Clone, Debug)]
enum Outcome {
    Ran(Vec<f64>),
    Slower,
    Fails,
}

/// One search's reading of a [`Trials`] record: the trials, how many it has
/// taken, and how many of those it read back.
#[derive(Default)]
struct Replay {
    log: Vec<(Move, Outcome)>,
    at: usize,
    /// Whether the trials are recorded at all (for a caller that keeps them).
    on: bool,
    replayed: usize,
}

impl Replay {
    fn start(trials: Option<&Trials>) -> Replay {
        Replay {
            log: trials.map(|t| t.taken.take()).unwrap_or_default(),
            on: trials.is_some(),
            ..Replay::default()
        }
    }

    /// Back to `trials` for the next search (the longer record of the two: a
    /// shorter search took a prefix of the same trials).
    fn finish(self, trials: Option<&Trials>) {
        if let Some(t) = trials {
            *t.taken.borrow_mut() = self.log;
        }
    }

    /// The recorded outcome of the trial `k` places past the next to take, if the
    /// record has move `key` there (the caller asks only while every trial before
    /// it is read back too: a trial lowered here ends the record).
    fn recorded(&self, k: usize, key: Move) -> Option<Outcome> {
        self.log
            .get(self.at + k)
            .filter(|(m, _)| *m == key)
            .map(|(_, outcome)| outcome.clone())
    }

    /// A trial taken and lowered here: the record goes on with it (what was
    /// recorded past this point belongs to another course of the search).
    fn record(&mut self, key: Move, finish: Outcome) {
        if !self.on {
            return;
        }
        self.log.truncate(self.at);
        self.log.push((key, finish));
        self.at += 1;
    }
}

/// The caller's full derivation of a plan, given the best report so far: the
/// program and its report when it is to be kept, else `None`.
pub(crate) type Derive<'a> = dyn Fn(&Plan, &SimReport) -> Option<(Program, SimReport)> + 'a;

/// [`reorder`] in rounds: each round searches from the compute order of the best
/// program so far, since its full derivation (`derive`, which returns a program
/// only when it is to be kept: faster than `best` and within the limits) moves
/// weight gradients and transfers, and the waits it leaves differ from those the
/// search saw. Rounds go on while one improves `best` and simulations of `budget`
/// are left. Whether any round replaced `best` (else it is as given).
pub(crate) fn reorder_rounds(
    plan: &Plan,
    search: &Search,
    budget: usize,
    best: &mut (Program, SimReport),
    derive: &Derive,
) -> bool {
    let mut kept = false;
    let mut left = budget;
    let mut plan = plan.clone();
    let mut replay = Replay::start(search.trials);
    while left > 0 {
        let (found, spent) = reorder(&plan, search, left, &mut replay);
        left = left.saturating_sub(spent.max(1));
        let mut improved = false;
        for order in &found {
            if let Some(again) = derive(order, &best.1) {
                *best = again;
                improved = true;
            }
        }
        if !improved {
            break;
        }
        kept = true;
        // The next round starts from the kept program's compute order.
        match crate::search::replan::plan_of_program(&best.0) {
            Ok(p) if p.units == plan.units => plan.order = p.order,
            _ => break,
        }
    }
    replay.finish(search.trials);
    kept
}

/// The kinds of move in the order they are tried.
const KINDS: [Kind; 3] = [Kind::Advance, Kind::Migrate, Kind::Shift];

/// The kinds of move, tried in this order; a kind is tried only once no move of
/// the kinds before it helps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A later task whose inputs are ready moves into a wait.
    Advance,
    /// Encoder work moves between ranks ([`Moves::AcrossRanks`] only).
    Migrate,
    /// An earlier weight gradient moves into a wait (what ran between them, the
    /// sends others wait for among it, runs earlier), or the producer elsewhere
    /// that arrived last moves earlier on its rank.
    Shift,
}

/// One candidate: a move within a rank, `((rank, task, the task it goes before),
/// from, to)` (see [`candidates`]), or a move between ranks.
#[derive(Clone, Copy, Debug)]
enum Try {
    Within((usize, Task, Task), usize, usize),
    Migrate(Migration),
    /// `((rank, the task the wait is before, the first weight gradient moved),
    /// index of that task, how many move)`: see [`fill_with_w`].
    Fill((usize, Task, Task), usize, usize),
}

/// What makes a [`Try`] the move it is (the search tries each once).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Move {
    Within((usize, Task, Task)),
    Migrate(Migration),
    Fill((usize, Task, Task), usize),
}

impl Try {
    fn key(&self) -> Move {
        match *self {
            Try::Within(key, ..) => Move::Within(key),
            Try::Migrate(m) => Move::Migrate(m),
            Try::Fill(key, _, count) => Move::Fill(key, count),
        }
    }
}

/// Threads the search lowers candidates on: every core (at most
/// [`SearchPolicy::max_threads`]) for a plan of `tasks` tasks, when it has at least
/// [`SearchPolicy::parallel_tasks`] (smaller ones take less time than starting a
/// thread).
fn workers(tasks: usize, policy: &SearchPolicy) -> usize {
    if tasks < policy.parallel_tasks {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().min(policy.max_threads).max(1))
}

/// The moves of `kind` for the wait of `wait` before task `j` on rank `r`
/// (`at = (r, j)`), as `(rank, from, to)`: the task at `from` in that rank's list
/// moves to index `to` of the list without it. Every move keeps each task after
/// its producers on its own rank.
fn candidates(
    plan: &Plan,
    deps: &crate::algebra::analysis::Deps,
    times: &[Vec<Timed>],
    (r, j): (usize, usize),
    wait: f64,
    kind: Kind,
    lookahead: usize,
) -> Vec<(usize, usize, usize)> {
    let list = &plan.order[r];
    match kind {
        Kind::Migrate => Vec::new(),
        Kind::Advance => {
            // Ready by the middle of the wait: produced here before `j`, or
            // elsewhere by then in the simulation.
            let by = times[r][j].start - wait / 2.0;
            (j + 1..list.len().min(j + 1 + lookahead))
                .filter(|&k| {
                    deps.of(r, k).iter().all(|d| {
                        let (q, i) = d.producer();
                        if q == r {
                            i < j
                        } else {
                            times[q][i].end <= by
                        }
                    }) && !list[j..k].iter().any(|&t| needs_own(list[k], t))
                })
                .map(|k| (r, k, j))
                .collect()
        }
        Kind::Shift => {
            // A weight gradient has no consumer: it may go anywhere later (one
            // right before `j` is there already).
            let mut out: Vec<(usize, usize, usize)> = (j.saturating_sub(lookahead)
                ..j.saturating_sub(1))
                .filter(|&i| list[i].op == Op::W)
                .map(|i| (r, i, j - 1))
                .collect();
            // The producer elsewhere that ended last: before the weight gradients
            // right before it, or as early as its own producers allow.
            let late = deps
                .of(r, j)
                .iter()
                .map(|d| d.producer())
                .filter(|&(q, _)| q != r)
                .max_by(|&(q, i), &(p, k)| times[q][i].end.total_cmp(&times[p][k].end));
            if let Some((q, i)) = late {
                let own = &plan.order[q];
                let own_before = (0..i).rev().find(|&k| needs_own(own[i], own[k]));
                let lo = deps
                    .of(q, i)
                    .iter()
                    .filter(|d| d.producer().0 == q)
                    .map(|d| d.producer().1 + 1)
                    .chain(own_before.map(|k| k + 1))
                    .max()
                    .unwrap_or(0)
                    .max(i.saturating_sub(lookahead));
                let mut ws = i;
                while ws > lo && own[ws - 1].op == Op::W {
                    ws -= 1;
                }
                for to in [ws, lo] {
                    if to < i && !out.contains(&(q, i, to)) {
                        out.push((q, i, to));
                    }
                }
            }
            out
        }
    }
}

/// Indices after `j` in rank `r`'s list of the weight gradients whose backward ran
/// on `r` before `j` (ready during a wait before `j`), in list order; `index` is
/// the plan's [`Plan::locate`].
fn ready_ws<'a>(
    list: &'a [Task],
    index: &'a TaskIndex,
    r: usize,
    j: usize,
) -> impl Iterator<Item = usize> + 'a {
    (j + 1..list.len()).filter(move |&k| {
        let t = list[k];
        t.op == Op::W
            && index
                .get(Op::B, t.unit, t.mb)
                .is_some_and(|(q, i)| q == r && i < j)
    })
}

/// The move that fills the wait of `wait` before task `j` of rank `r` with weight
/// gradients at once: the first of [`ready_ws`] (the longest deferred first,
/// from anywhere later on the rank, not only within [`lookahead`](crate::ir::policy::SearchPolicy::lookahead)) while their
/// work fits the wait, when that is at least two (one is a move of
/// [`candidates`], or does not fit). A zero-bubble schedule defers weight
/// gradients to the cool-down; where a rank then waits in the steady state with
/// several ready, running them there shortens the cool-down's backlog, and a
/// move of one at a time does not see the gain until the last has moved.
fn fill_with_w(plan: &Plan, index: &TaskIndex, r: usize, j: usize, wait: f64) -> Option<Try> {
    let list = &plan.order[r];
    let mut total = 0.0;
    let mut count = 0;
    let mut first = None;
    for k in ready_ws(list, index, r, j) {
        total += plan.units[list[k].unit].cost.w;
        if total > wait {
            break;
        }
        first.get_or_insert(list[k]);
        count += 1;
    }
    let first = first?;
    (count >= 2).then_some(Try::Fill((r, list[j], first), j, count))
}

/// Rank `r`'s list `list` with the first `count` of [`ready_ws`] moved, in their
/// order, to just before task `j` (`index` locates the tasks of the plan).
fn fill(list: &[Task], index: &TaskIndex, r: usize, j: usize, count: usize) -> Vec<Task> {
    let take: BTreeSet<usize> = ready_ws(list, index, r, j).take(count).collect();
    list[..j]
        .iter()
        .chain(take.iter().map(|&k| &list[k]))
        .chain(
            (j..list.len())
                .filter(|k| !take.contains(k))
                .map(|k| &list[k]),
        )
        .copied()
        .collect()
}

/// Whether task `a` reads what `b` computed on its own rank for the same unit and
/// micro-batch: a backward its forward (or recomputed forward), a weight gradient
/// its backward. [`dependencies`] checks these but lists only what crosses units.
fn needs_own(a: Task, b: Task) -> bool {
    a.unit == b.unit
        && a.mb == b.mb
        && match a.op {
            Op::B | Op::BW => matches!(b.op, Op::F | Op::RF),
            Op::W => b.op == Op::B,
            Op::F | Op::RF => false,
        }
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

/// Candidate moves of encoder work: from each of the `SOURCES` ranks that set the
/// pace of `program` (compute plus the time the others waited for them, largest
/// first), then each of the `SOURCES` busiest by compute not among them, to each
/// of the `TARGETS` with the least compute that have less, each movable encoder
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
    (n_sources, n_targets): (usize, usize),
) -> Vec<Migration> {
    let load = |r: usize| report.compute.get(r).copied().unwrap_or(0.0);
    // How long the other ranks waited for each rank: a rank others wait for paces
    // them, whatever its own compute.
    let waits = crate::judge::waits::waits(program, &report.timeline, report.makespan);
    let waited_for = crate::judge::waits::waited_for(&waits, plan.ranks);
    let mut busy: Vec<usize> = (0..plan.ranks).collect();
    busy.sort_by(|&a, &b| load(b).total_cmp(&load(a)).then(a.cmp(&b)));
    // Sources: the ranks that set the pace (their compute plus the time the others
    // waited for them), then the busiest by compute alone.
    let pace = |r: usize| load(r) + waited_for[r];
    let mut paced: Vec<usize> = (0..plan.ranks).collect();
    paced.sort_by(|&a, &b| pace(b).total_cmp(&pace(a)).then(a.cmp(&b)));
    let mut sources: Vec<usize> = paced.iter().take(n_sources).copied().collect();
    for &r in busy.iter().take(n_sources) {
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
            .take(n_targets)
            .collect();
        let movable = |u: usize, mb: usize| {
            !plan.units[u].role.is_stage()
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
            if plan.units[t.unit].role.is_stage() || !seen.insert((t.unit, t.mb)) {
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

/// Each unit's family: the index of the first unit of the same encoder (an
/// encoder's chunks and layers share one, by their [`Role`](crate::ir::role::Role);
/// the LLM's units are each their own).
fn families(plan: &Plan) -> Vec<usize> {
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    plan.units
        .iter()
        .enumerate()
        .map(|(i, u)| match u.role.encoder(&u.name) {
            None => i,
            Some(of) => *first.entry(of).or_insert(i),
        })
        .collect()
}

/// The plan's `order` with the tasks of `m` moved (`family`: [`families`] of the
/// plan's units), each put before the first task of the target that started no
/// earlier than it did (`times`, the simulated compute times), so the target runs
/// them at about the same time, in the same order. `false` (and `order` changed
/// in no way that matters: the caller drops it) when nothing moves.
fn migrate(order: &mut [Vec<Task>], family: &[usize], times: &[Vec<Timed>], m: Migration) -> bool {
    // A stage is a family of its own, so a whole encoder family never takes one.
    let takes = |t: &Task| {
        t.mb == m.mb
            && if m.whole {
                family[t.unit] == family[m.unit]
            } else {
                t.unit == m.unit
            }
    };
    let mut moved: Vec<(f64, Task)> = Vec::new();
    let mut k = 0;
    order[m.from].retain(|t| {
        let keep = !takes(t);
        if !keep {
            moved.push((times[m.from][k].start, *t));
        }
        k += 1;
        keep
    });
    if moved.is_empty() {
        return false;
    }
    // Positions in the target's list as it was; inserted from the last, so the
    // earlier positions stay valid, and a task before the one after it.
    let at: Vec<usize> = moved
        .iter()
        .map(|&(start, _)| times[m.to].partition_point(|x| x.start < start))
        .collect();
    for (i, &(_, task)) in moved.iter().enumerate().rev() {
        order[m.to].insert(at[i], task);
    }
    true
}

/// A base's parts before it is one: its [`Setup`], its run to resume trials from
/// (see [`Base::run`]), and its compute times.
type Parts = (Option<Setup>, Option<Resumable>, Vec<Vec<Timed>>);

/// The parts of a base that depend on its plan alone: the plan's dependencies
/// (for the moves' candidates), its ideal timing, the first pass of its meeting
/// times under the search's rule, its frame, and where its tasks are (see
/// [`Base`]). `None` when the plan's dependencies do not resolve. Built beside
/// the measuring of the move that made the plan (when the search has other
/// threads), which needs its lowering instead.
struct Setup {
    deps: crate::algebra::analysis::Deps,
    ideal: Option<Log>,
    meetings: Option<Meetings>,
    frame: Frame,
    index: TaskIndex,
}

impl Setup {
    fn of(plan: &Plan, names: &UnitNames, rule: Placement, policy: &SearchPolicy) -> Option<Setup> {
        let deps = dependencies(plan).ok()?;
        let ideal = Log::new(plan, &deps);
        // The meetings' preparation is the log's dependencies and timing with
        // the transfers (the plan's own, resolved and timed again, where it has
        // no log).
        let prepared = match &ideal {
            Some(log) => log.prepared(plan),
            None => prepare_named(plan, names),
        };
        Some(Setup {
            meetings: prepared.ok().and_then(|p| Meetings::new(&p, rule, policy)),
            ideal,
            frame: Frame::of(plan),
            index: plan.locate(),
            deps,
        })
    }
}

/// What the trials of one round of the search are moves of: the plan's compute
/// order, its simulated compute times, where its tasks are, and its units'
/// families. Shared by the workers, which build each trial's plan from it
/// ([`Base::apply`]): the caller sends a move, not a plan.
struct Base {
    /// Which of the search's bases this is.
    round: usize,
    order: Vec<Vec<Task>>,
    times: Vec<Vec<Timed>>,
    index: TaskIndex,
    family: Arc<Vec<usize>>,
    /// The order's lowering and its run, which trials resume from (see
    /// [`crate::judge::resume`]), when it can be resumed from.
    run: Option<Resumable>,
    /// The first pass of the order's meeting times under the search's rule, which
    /// trials take where it holds for them ([`Meetings`]).
    meetings: Option<Meetings>,
    /// The order's ideal timing, which trials that keep every task on its rank
    /// resume ([`crate::search::ideal`]).
    ideal: Option<Log>,
    /// The order's frame (collectives, units' places among their names), which
    /// trials that keep every task on its rank are assembled in.
    frame: Frame,
}

impl Base {
    /// `order`, equal to this base's order, made the order of trial `t`; `false`
    /// when the move moves nothing (no plan to lower).
    fn apply(&self, t: Try, order: &mut [Vec<Task>]) -> bool {
        match t {
            Try::Within((q, ..), from, to) => {
                let task = order[q].remove(from);
                order[q].insert(to, task);
                true
            }
            Try::Migrate(m) => migrate(order, &self.family, &self.times, m),
            Try::Fill((q, ..), j, count) => {
                order[q] = fill(&self.order[q], &self.index, q, j, count);
                true
            }
        }
    }

    /// Trial `t` lowered and simulated ([`lower_one`]) on `scratch`, a plan of the
    /// same units (found by name in `names`) whose order is overwritten.
    #[allow(clippy::too_many_arguments)]
    fn trial(
        &self,
        t: Try,
        scratch: &mut Scratch,
        names: &UnitNames,
        opts: &SimOptions,
        rule: Placement,
        policy: &SearchPolicy,
        cutoff: f64,
    ) -> Trial {
        // The scratch plan made this base's order again: only the ranks the last
        // trial changed where it holds this base's.
        if scratch.round == Some(self.round) {
            for &q in &scratch.dirty {
                scratch.plan.order[q].clone_from(&self.order[q]);
            }
        } else {
            scratch.plan.order.clone_from(&self.order);
            scratch.round = Some(self.round);
        }
        scratch.dirty.clear();
        match t {
            Try::Within((q, ..), ..) | Try::Fill((q, ..), ..) => scratch.dirty.push(q),
            Try::Migrate(m) => scratch.dirty.extend([m.from, m.to]),
        }
        let scratch = &mut scratch.plan;
        if !self.apply(t, &mut scratch.order) {
            return (None, Outcome::Fails);
        }
        // A move within a rank keeps every task on its rank: its ideal timing
        // resumes the base's, and its lowering is assembled in the base's frame.
        let (ideal, frame) = match t {
            Try::Within(..) | Try::Fill(..) => (
                (self.ideal.as_ref()).map(|l| (&self.order[..], &self.index, l)),
                Some(&self.frame),
            ),
            Try::Migrate(_) => (None, None),
        };
        lower_one_from(
            scratch,
            names,
            opts,
            rule,
            policy,
            cutoff,
            (self.run.as_ref(), self.meetings.as_ref()),
            (ideal, frame),
        )
    }

    /// [`Base::trial`] with `against`'s rule and cutoff, its lowering kept only
    /// when its finishing times beat `against`'s best (the search needs no other:
    /// it lowers and names only the moves that help).
    fn judge(
        &self,
        t: Try,
        scratch: &mut Scratch,
        names: &UnitNames,
        opts: &SimOptions,
        policy: &SearchPolicy,
        against: Against,
    ) -> Trial {
        let (low, outcome) = self.trial(
            t,
            scratch,
            names,
            opts,
            against.rule,
            policy,
            against.cutoff,
        );
        let helps = matches!(&outcome, Outcome::Ran(f) if timed_finish(f).beats(&against.best));
        (low.filter(|_| helps), outcome)
    }
}

/// A plan trials are built in ([`Base::trial`]): which base's order it holds but
/// for the ranks of `dirty` (which the last trial changed), if any.
struct Scratch {
    plan: Plan,
    round: Option<usize>,
    dirty: Vec<usize>,
}

impl Scratch {
    /// A plan of `plan`'s units, its order not yet any base's.
    fn new(plan: &Plan) -> Scratch {
        Scratch {
            plan: plan.clone(),
            round: None,
            dirty: Vec::new(),
        }
    }
}

/// The rule whose lowering of `plan` runs fastest, with that lowering.
fn first_lowering(
    plan: &Plan,
    text: Option<&str>,
    opts: &SimOptions,
    policy: &SearchPolicy,
) -> Option<(Placement, (Program, SimReport))> {
    // One preparation (dependencies, ideal timing, transfers) for every rule.
    let prepared = prepare(plan).ok()?;
    let mut best: Option<(Placement, (Program, SimReport))> = None;
    for rule in PLACEMENTS {
        let program = lower_prepared_by(plan, &prepared, text, rule, policy).ok();
        let run = program.and_then(|p| simulate(&p, opts).ok().map(|r| (p, r)));
        if let Some(x) = run {
            if best
                .as_ref()
                .is_none_or(|(_, b)| span(&x.1).beats(&span(&b.1)))
            {
                best = Some((rule, x));
            }
        }
    }
    best
}

/// What every trial of a round is judged against: the rule it is lowered with,
/// the makespan beyond which its simulation is cut short, and the best's score,
/// which it must beat for its lowering to be worth keeping.
#[derive(Clone, Copy)]
struct Against {
    rule: Placement,
    cutoff: f64,
    best: Score,
}

/// A try issued and not yet taken: its kind, the move, what makes it that move,
/// and either the outcome an earlier search recorded for it (read back, not
/// lowered) or its number in the [`Pool`].
struct Ahead {
    kind: Kind,
    t: Try,
    key: Move,
    recorded: Option<Outcome>,
    issued: Option<usize>,
}

/// A trial for the [`Pool`]: its number, what it is a move of, the move, and what
/// it is judged against.
type Job = (usize, Arc<Base>, Try, Against);
/// A trial's lowering (if it has one and it beats the best) and what it gave.
type Trial = (Option<Lowered>, Outcome);
/// A trial's number and its [`Base::judge`] (or the panic it raised).
type Done = (usize, std::thread::Result<Trial>);

/// The jobs issued and not yet started, in order, and whether the pool is closing.
#[derive(Default)]
struct Queue {
    jobs: std::sync::Mutex<(std::collections::VecDeque<Job>, bool)>,
    more: std::sync::Condvar,
}

impl Queue {
    fn push(&self, job: Job) {
        self.lock().0.push_back(job);
        self.more.notify_one();
    }

    /// The first job not yet started, if any.
    fn pop(&self) -> Option<Job> {
        self.lock().0.pop_front()
    }

    /// The first job not yet started, waiting for one; `None` once the pool closes.
    fn wait(&self) -> Option<Job> {
        let mut q = self.lock();
        loop {
            if q.1 {
                return None;
            }
            if let Some(job) = q.0.pop_front() {
                return Some(job);
            }
            q = self.more.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn clear(&self) {
        self.lock().0.clear();
    }

    fn close(&self) {
        let mut q = self.lock();
        q.0.clear();
        q.1 = true;
        drop(q);
        self.more.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (std::collections::VecDeque<Job>, bool)> {
        // A worker's panic is caught around its trial, never while it holds the
        // lock; a poisoned lock still holds a consistent queue.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Threads that lower and simulate a search's trials beside the calling thread,
/// started once for the whole search (thread starts per batch of two trials cost
/// about a second of system time over a 12000-simulation search). The search
/// issues trials in order into one queue ([`Pool::issue`]); each worker takes the
/// next as soon as it is free, and the calling thread, while the trial it takes
/// next ([`Pool::take`]) is not done, runs the next queued one itself. Answers
/// are taken by number, so the search does not depend on the workers; what a
/// move that helps leaves issued is dropped ([`Pool::discard`]), and issued again
/// when the move is not kept after all. A job is a move: the
/// thread builds its plan in a plan of its own, kept for the whole search (a plan
/// copied per trial, its units with it, was work on the calling thread, which the
/// other threads waited for).
struct Pool<'a> {
    /// The units of every trial's plan, by name.
    names: &'a UnitNames<'a>,
    opts: &'a SimOptions,
    policy: &'a SearchPolicy,
    queue: Arc<Queue>,
    done: std::sync::mpsc::Receiver<Done>,
    /// The calling thread's plan to build trials in.
    scratch: std::cell::RefCell<Scratch>,
    /// The next trial's number.
    next: std::cell::Cell<usize>,
    /// Trials numbered below this were discarded: their answers are dropped.
    live: std::cell::Cell<usize>,
    /// Answers come back and not yet taken, by number.
    answers: std::cell::RefCell<BTreeMap<usize, std::thread::Result<Trial>>>,
}

impl<'a> Pool<'a> {
    /// `workers` threads in `scope`, which end when the pool is dropped.
    fn new<'scope>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        workers: usize,
        plan: &Plan,
        names: &'a UnitNames<'a>,
        opts: &'a SimOptions,
        policy: &'a SearchPolicy,
    ) -> Pool<'a>
    where
        'a: 'scope,
    {
        let (answer, done) = std::sync::mpsc::channel::<Done>();
        let queue = Arc::new(Queue::default());
        for _ in 0..workers {
            let answer = answer.clone();
            let queue = Arc::clone(&queue);
            let mut scratch = Scratch::new(plan);
            scope.spawn(move || {
                while let Some((n, base, t, against)) = queue.wait() {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        base.judge(t, &mut scratch, names, opts, policy, against)
                    }));
                    if answer.send((n, r)).is_err() {
                        break;
                    }
                }
            });
        }
        Pool {
            names,
            opts,
            policy,
            queue,
            done,
            scratch: std::cell::RefCell::new(Scratch::new(plan)),
            next: std::cell::Cell::new(0),
            live: std::cell::Cell::new(0),
            answers: std::cell::RefCell::new(BTreeMap::new()),
        }
    }

    /// Trial `t` of `base` issued: its number, to take it by.
    fn issue(&self, base: &Arc<Base>, t: Try, against: Against) -> usize {
        let n = self.next.get();
        self.next.set(n + 1);
        self.queue.push((n, Arc::clone(base), t, against));
        n
    }

    /// The answer of trial `n` (issued, not discarded, not yet taken), run here if
    /// no worker has started it; while it is running elsewhere, this thread runs
    /// the next queued trials. A panic in it is the caller's, as on one thread (a
    /// panic in a trial that is discarded, which one thread would not have run,
    /// is dropped with it).
    fn take(&self, n: usize) -> Trial {
        let answer = loop {
            // Answers already back first.
            while let Ok((k, r)) = self.done.try_recv() {
                self.answer(k, r);
            }
            if let Some(r) = self.answers.borrow_mut().remove(&n) {
                break r;
            }
            if let Some((k, base, t, against)) = self.queue.pop() {
                let mut scratch = self.scratch.borrow_mut();
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    base.judge(t, &mut scratch, self.names, self.opts, self.policy, against)
                }));
                if k == n {
                    break r;
                }
                self.answer(k, r);
                continue;
            }
            // Trial `n` runs on a worker, which answers it: the workers live as
            // long as the pool.
            match self.done.recv() {
                Ok((k, r)) => self.answer(k, r),
                Err(_) => unreachable!("the workers answer every trial they start"),
            }
        };
        answer.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// Keep the answer of trial `k`, unless it was discarded.
    fn answer(&self, k: usize, r: std::thread::Result<Trial>) {
        if k >= self.live.get() {
            self.answers.borrow_mut().insert(k, r);
        }
    }

    /// Every trial issued and not yet taken dropped: those not started are not
    /// run, the answers of those running are dropped when they come.
    fn discard(&self) {
        self.queue.clear();
        self.live.set(self.next.get());
        self.answers.borrow_mut().clear();
    }
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        // The workers stop at their next job.
        self.queue.close();
    }
}

/// `plan` (its units found by name in `names`) lowered with `rule` and
/// simulated: the lowering, and each rank's finishing time ([`Outcome::Ran`]), or [`Outcome::Slower`] as soon as the
/// simulation proves that it ends later than `cutoff`
/// ([`finish_times_within`]: then it cannot beat a program of that makespan), or
/// [`Outcome::Fails`] (no lowering when the lowering fails). The lowering is by
/// unit index: [`Lowered::program`] names it (the program [`lower_prepared_by`]
/// gives), and the times are those of [`simulate`]'s report of that program.
fn lower_one(
    plan: &Plan,
    names: &UnitNames,
    opts: &SimOptions,
    rule: Placement,
    policy: &SearchPolicy,
    cutoff: f64,
    kept: (Option<&Resumable>, Option<&Meetings>),
) -> Trial {
    lower_one_from(plan, names, opts, rule, policy, cutoff, kept, (None, None))
}

/// A base's order, where its tasks are, and the record of its dependencies and
/// ideal timing: what a trial keeping every task on its rank patches and resumes.
type Ideal<'a> = (&'a [Vec<Task>], &'a TaskIndex, &'a Log);

/// [`lower_one`], with `ideal` the order of a base whose tasks `plan` keeps on
/// their ranks, where its tasks are, and the record of its dependencies and
/// ideal timing ([`crate::search::ideal`]), which the trial's patches and resumes,
/// and with `frame` the frame of a plan of the same units and the same tasks on
/// every rank ([`Frame`]), which the trial's lowering is assembled in: the same
/// trial.
#[allow(clippy::too_many_arguments)]
fn lower_one_from(
    plan: &Plan,
    names: &UnitNames,
    opts: &SimOptions,
    rule: Placement,
    policy: &SearchPolicy,
    cutoff: f64,
    (run, kept): (Option<&Resumable>, Option<&Meetings>),
    (ideal, frame): (Option<Ideal<'_>>, Option<&Frame>),
) -> Trial {
    let links = ideal
        .and_then(|(base, index, log)| Some((View::of_trial(plan, names, base, index, log)?, log)));
    let prepared = match links {
        Some((Ok(links), log)) => timed_from(plan, &links, log)
            .ok()
            .and_then(|time| links.prepared(plan, time, log).ok()),
        // The plan does not resolve.
        Some((Err(()), ..)) => None,
        None => prepare_named(plan, names).ok(),
    };
    let Some(prepared) = prepared else {
        return (None, Outcome::Fails);
    };
    // The plan's ideal timing is a floor of every program of the plan (each of its
    // tasks starts there as soon as its rank and its inputs allow, a run of any
    // lowering no earlier): a trial whose floor is beyond the cutoff cannot beat
    // it, and is neither placed nor simulated.
    if less(cutoff, prepared.time.makespan()) {
        return (None, Outcome::Slower);
    }
    let lowered = lower_indexed_from(plan, &prepared, rule, policy, (kept, frame));
    let Ok(lowered) = lowered else {
        return (None, Outcome::Fails);
    };
    let finish = match run {
        Some(run) => run.finish_times(&plan.units, &lowered, opts, cutoff),
        None => finish_times_within(&plan.units, &lowered, opts, cutoff),
    };
    let outcome = match finish {
        Ok(Some(finish)) => Outcome::Ran(finish),
        Ok(None) => Outcome::Slower,
        Err(_) => Outcome::Fails,
    };
    (Some(lowered), outcome)
}

/// [`timed`] of the report whose ranks finish at `finish`: the makespan (the
/// latest, as the report takes it), then their sum in rank order (as
/// [`crate::judge::compare::ends`] adds them).
fn timed_finish(finish: &[f64]) -> Score {
    let makespan = finish.iter().copied().fold(0.0, f64::max);
    Score::span(makespan).with_ends(finish.iter().sum())
}

/// Shorter step, or as long with less summed finishing time
/// ([`crate::ir::compare`]'s order).
fn better(a: &SimReport, b: &SimReport) -> bool {
    timed(a).beats(&timed(b))
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

/// `plan` with a property test's random moves made (this module's tests and
/// [`crate::search::ideal`]'s): each `(q, from, to)` takes a task of rank `q`
/// (modulo the ranks; none from a rank of fewer than two) and puts it back within
/// `near` places (near moves lower far more often), else (`near` 0) anywhere; with
/// `across` (and not `near`), into the next rank instead (other task counts).
#[cfg(test)]
pub(crate) fn moved(plan: &Plan, moves: &[(u32, u32, u32)], near: usize, across: bool) -> Plan {
    let mut next = plan.clone();
    for &(q, from, to) in moves {
        let q = q as usize % next.ranks;
        let n = next.order[q].len();
        if n < 2 {
            continue;
        }
        let from = from as usize % n;
        let to = if near > 0 {
            (from + to as usize % (2 * near + 1))
                .saturating_sub(near)
                .min(n - 1)
        } else {
            to as usize % n
        };
        let t = next.order[q].remove(from);
        let q2 = if across && near == 0 {
            (q + 1) % next.ranks
        } else {
            q
        };
        let to = to.min(next.order[q2].len());
        next.order[q2].insert(to, t);
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The proptests' `near` (0..4) as [`moved`]'s window: a near move (`near > 0`,
    /// three draws in four) goes back within three places.
    fn window(near: usize) -> usize {
        if near > 0 {
            3
        } else {
            0
        }
    }
    use crate::algebra::profile::Profile;
    use crate::judge::verify::verify_static;
    use crate::search::derive::{derive_str, Request};

    /// Qwen2-VL-7B at 4 x 8, the lockstep ramp layer by layer (a rendezvous program
    /// with many waits), as the search sees it: its plan, the simulation options, the
    /// placement rule that did best and the simulated compute times.
    fn lockstep_ramp() -> (Plan, SimOptions, Placement, Vec<Vec<Timed>>) {
        let text = include_str!("../../../profiles/qwen2vl-7b.toml");
        let profile = Profile::from_toml_str(text).unwrap();
        let req = Request::new(&profile, 4, 8);
        let derived =
            derive_str(&req, "refine(layers(zb2p(encoders = ramp, costs = unit)))").unwrap();
        let plan = crate::search::replan::plan_of_program(&derived.program).unwrap();
        let opts = req.sim_options(req.mode);
        let (rule, (program, report)) =
            first_lowering(&plan, None, &opts, &SearchPolicy::DEFAULT).unwrap();
        let times = compute_times(&program, &report);
        (plan, opts, rule, times)
    }

    /// A base to resume trials from: `expr` derived from `profile` at `ranks` x
    /// `mbs`, its plan, the options (eager semantics when `eager`), the rule that
    /// did best, the run of its lowering and its makespan.
    struct Resumed {
        plan: Plan,
        opts: SimOptions,
        rule: Placement,
        run: Resumable,
        makespan: f64,
        /// The first pass of the plan's meeting times under `rule`.
        meetings: Option<Meetings>,
    }

    fn resumed(profile: &str, (ranks, mbs): (usize, usize), expr: &str, eager: bool) -> Resumed {
        let profile = Profile::from_toml_str(profile).unwrap();
        let req = Request::new(&profile, ranks, mbs);
        let derived = derive_str(&req, expr).unwrap();
        let plan = crate::search::replan::plan_of_program(&derived.program).unwrap();
        let mut opts = req.sim_options(req.mode);
        if eager {
            opts.mode = crate::ir::model::Mode::Eager;
        }
        let policy = &SearchPolicy::DEFAULT;
        let (rule, (_, report)) = first_lowering(&plan, None, &opts, policy).unwrap();
        let low = lower_indexed_by(&plan, &prepare(&plan).unwrap(), rule, policy).unwrap();
        let run = Resumable::new(low, &report.timeline).unwrap();
        let meetings = Meetings::new(&prepare(&plan).unwrap(), rule, policy);
        Resumed {
            plan,
            opts,
            rule,
            run,
            makespan: report.makespan,
            meetings,
        }
    }

    /// The bases of the property test below: rendezvous and eager, with and
    /// without a link model, several shapes.
    fn bases() -> &'static [Resumed] {
        static BASES: std::sync::OnceLock<Vec<Resumed>> = std::sync::OnceLock::new();
        BASES.get_or_init(|| {
            let qwen = include_str!("../../../profiles/qwen2vl-7b.toml");
            let heavy = include_str!("../../../profiles/encoder-heavy.toml");
            let ramp = "refine(layers(zb2p(encoders = ramp, costs = unit)))";
            let mut out = vec![
                resumed(qwen, (4, 8), ramp, false),
                resumed(qwen, (4, 8), ramp, true),
                resumed(qwen, (3, 6), "zbv", false),
                resumed(heavy, (4, 6), "1f1b", false),
                resumed(heavy, (4, 6), "zbv", true),
            ];
            // Free communication.
            let mut free = resumed(qwen, (4, 8), ramp, false);
            free.opts.comm = None;
            let report = crate::judge::simulate::simulate_lowered(
                &free.plan.units,
                free.run_lowered(),
                &free.opts,
            )
            .unwrap();
            let low = free.run_lowered().clone();
            free.run = Resumable::new(low, &report.timeline).unwrap();
            free.makespan = report.makespan;
            out.push(free);
            out
        })
    }

    impl Resumed {
        fn run_lowered(&self) -> &Lowered {
            self.run.lowered()
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]
        /// A trial resumed from its base's run ([`Resumable`]) gives the full
        /// trial's outcome: the same finishing times bit for bit, the same
        /// failure, and where one is cut short against the cutoff, the other is
        /// too or provably ends later (so every decision of the search is the
        /// same). Random moves (one or two tasks, most a few places, some anywhere on any rank;
        /// many plans they make do not lower, and are compared as such) of several bases.
        #[test]
        fn a_resumed_trial_is_the_full_trial(
            case in 0usize..6,
            moves in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>()),
                1..3,
            ),
            near in 0usize..4,
            cut in 0usize..3,
        ) {
            let b = &bases()[case];
            let next = moved(&b.plan, &moves, window(near), false);
            let cutoff = [f64::INFINITY, b.makespan, b.makespan * 0.995][cut];
            let policy = &SearchPolicy::DEFAULT;
            let full = lower_one(&next, &next.unit_names(), &b.opts, b.rule, policy, cutoff, (None, None)).1;
            let resumed = lower_one(&next, &next.unit_names(), &b.opts, b.rule, policy, cutoff, (Some(&b.run), b.meetings.as_ref())).1;
            let over = |f: &[f64]| crate::ir::compare::less(cutoff, f.iter().copied().fold(0.0, f64::max));
            // A trial found slower (cut short, or its plan's ideal floor beyond the
            // cutoff) does end later than the cutoff when run to the end.
            if matches!(full, Outcome::Slower) {
                let whole = lower_one(&next, &next.unit_names(), &b.opts, b.rule, policy, f64::INFINITY, (None, None)).1;
                if let Outcome::Ran(x) = &whole {
                    proptest::prop_assert!(over(x), "{:?} ran in {:?}", full, x);
                }
            }
            match (&full, &resumed) {
                (Outcome::Ran(x), Outcome::Ran(y)) => {
                    let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    proptest::prop_assert_eq!(bits(x), bits(y));
                }
                (Outcome::Fails, Outcome::Fails) | (Outcome::Slower, Outcome::Slower) => {}
                (Outcome::Ran(x), _) | (_, Outcome::Ran(x)) => {
                    proptest::prop_assert!(cutoff.is_finite() && over(x), "{:?} {:?}", full, resumed);
                }
                _ => proptest::prop_assert!(cutoff.is_finite(), "{:?} {:?}", full, resumed),
            }
        }

        /// A lowering that takes its base's meeting times where they hold
        /// ([`Meetings`]), and for a move within ranks is assembled in its base's
        /// [`Frame`], is the full lowering, step for step (or fails as it
        /// does), under every placement rule, for random moves of several bases
        /// (as above) and moves of encoder work between ranks (other task counts:
        /// nothing is taken; the frame is found anew). A move within ranks keeps
        /// its base's frame.
        #[test]
        fn a_lowering_taking_kept_meeting_times_is_the_full_lowering(
            case in 0usize..6,
            moves in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>()),
                1..3,
            ),
            near in 0usize..4,
            across in proptest::prelude::any::<bool>(),
        ) {
            let b = &bases()[case];
            let next = moved(&b.plan, &moves, window(near), across);
            let policy = &SearchPolicy::DEFAULT;
            // As the search takes it: for a move within ranks only.
            let within = !across || near > 0;
            let frame = within.then(|| Frame::of(&b.plan));
            if within {
                proptest::prop_assert!(frame == Some(Frame::of(&next)));
            }
            let (Ok(base), Ok(prepared)) = (prepare(&b.plan), prepare(&next)) else {
                return Ok(());
            };
            for rule in PLACEMENTS {
                let Some(kept) = Meetings::new(&base, rule, policy) else {
                    continue;
                };
                let full = lower_indexed_by(&next, &prepared, rule, policy);
                let taking =
                    lower_indexed_from(&next, &prepared, rule, policy, (Some(&kept), frame.as_ref()));
                proptest::prop_assert_eq!(full.is_ok(), taking.is_ok());
                if let (Ok(x), Ok(y)) = (full, taking) {
                    proptest::prop_assert!(x == y, "{:?}", rule);
                }
            }
        }
    }

    /// The frame is the plan's own: a plan whose collectives differ (a unit at
    /// another home) has another, and a lowering assembled in the one it had before
    /// is then not the full lowering (which the property test above would tell).
    #[test]
    fn a_stale_frame_is_told_from_the_plans() {
        let policy = &SearchPolicy::DEFAULT;
        let mut told = 0;
        for b in bases() {
            let stale = Frame::of(&b.plan);
            let Some(kept) = Meetings::new(&prepare(&b.plan).unwrap(), b.rule, policy) else {
                continue;
            };
            for u in 0..b.plan.units.len() {
                let mut next = b.plan.clone();
                next.units[u].home = (next.units[u].home + 1) % next.ranks;
                let Ok(prepared) = prepare(&next) else {
                    continue;
                };
                if Frame::of(&next) == stale {
                    continue;
                }
                let full = lower_indexed_by(&next, &prepared, b.rule, policy);
                let framed = lower_indexed_from(
                    &next,
                    &prepared,
                    b.rule,
                    policy,
                    (Some(&kept), Some(&stale)),
                );
                if let (Ok(x), Ok(y)) = (full, framed) {
                    assert!(x != y);
                    told += 1;
                }
            }
        }
        assert!(told > 0, "{told}");
    }

    /// The resumed trials of the search do resume: on the lockstep ramp, a
    /// move's trial keeps most of its base's run.
    #[test]
    fn trials_of_the_search_are_resumed() {
        let b = &bases()[0];
        let (plan, opts, rule, times) = lockstep_ramp();
        assert_eq!(plan.order, b.plan.order);
        let deps = dependencies(&plan).unwrap();
        let (mut share, mut ran) = (0.0, 0);
        let (mut meet, mut moves) = (0.0, 0);
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                for (q, from, to) in
                    candidates(&plan, &deps, &times, (r, j), slot.wait, Kind::Advance, 8)
                {
                    let mut next = plan.clone();
                    let t = next.order[q].remove(from);
                    next.order[q].insert(to, t);
                    let policy = &SearchPolicy::DEFAULT;
                    let full = lower_one(
                        &next,
                        &next.unit_names(),
                        &opts,
                        rule,
                        policy,
                        f64::INFINITY,
                        (None, None),
                    )
                    .1;
                    let again = lower_one(
                        &next,
                        &next.unit_names(),
                        &opts,
                        rule,
                        policy,
                        f64::INFINITY,
                        (Some(&b.run), b.meetings.as_ref()),
                    )
                    .1;
                    if let (Outcome::Ran(x), Outcome::Ran(y)) = (&full, &again) {
                        assert_eq!(x, y);
                        ran += 1;
                    }
                    let prepared = prepare(&next).unwrap();
                    let low = lower_indexed_by(&next, &prepared, rule, policy);
                    share += b.run.kept_share(&low.unwrap());
                    if let Some(m) = &b.meetings {
                        meet += m.kept_share(&prepared, policy);
                        moves += 1;
                    }
                }
            }
        }
        assert!(ran > 10, "{ran}");
        // A trial takes most of its base's meeting times (where its rule has them).
        if b.meetings.is_some() {
            let mean = meet / moves as f64;
            assert!(mean > 0.5, "{mean}");
        }
        // Over half of a trial's steps on average are not simulated again.
        let mean = share / ran as f64;
        assert!(mean > 0.5, "{mean}");
    }

    /// A trial is ranked on its lowering's finishing times alone; the score they
    /// give is the full report's, on candidates of every wait of the lockstep ramp.
    #[test]
    fn a_trial_is_ranked_as_its_full_report() {
        let (plan, opts, rule, times) = lockstep_ramp();
        let deps = dependencies(&plan).unwrap();
        let policy = &SearchPolicy::DEFAULT;
        let mut checked = 0;
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                let (wait, kind) = (slot.wait, Kind::Advance);
                let moves = candidates(&plan, &deps, &times, (r, j), wait, kind, policy.lookahead);
                for (q, from, to) in moves.into_iter().take(2) {
                    let mut next = plan.clone();
                    let t = next.order[q].remove(from);
                    next.order[q].insert(to, t);
                    let (Some(low), Outcome::Ran(finish)) = lower_one(
                        &next,
                        &next.unit_names(),
                        &opts,
                        rule,
                        policy,
                        f64::INFINITY,
                        (None, None),
                    ) else {
                        continue;
                    };
                    let report = simulate_lowered(&next.units, &low, &opts).unwrap();
                    assert_eq!(timed_finish(&finish), timed(&report));
                    checked += 1;
                }
            }
        }
        assert!(checked > 10, "{checked}");
    }

    /// Lowering several candidates at a time changes nothing but the wall time: the
    /// plans found and the simulations spent are those of one at a time, for every
    /// width, with budgets that end in the middle of a batch too, and when moves
    /// that help are refused for their memory (the trials issued behind such a
    /// move are issued again).
    #[test]
    fn the_search_finds_the_same_with_any_number_of_workers() {
        let (plan, opts, ..) = lockstep_ramp();
        let any = |_: &Program, _: &SimReport| true;
        // A limit refusing about a third of the programs, by their makespan.
        let some = |_: &Program, r: &SimReport| !r.makespan.to_bits().is_multiple_of(3);
        let refused = std::cell::Cell::new(0);
        let counted = |p: &Program, r: &SimReport| {
            let ok = some(p, r);
            refused.set(refused.get() + usize::from(!ok));
            ok
        };
        type Fits<'a> = &'a dyn Fn(&Program, &SimReport) -> bool;
        let fitting: [Fits; 2] = [&any, &counted];
        for fits in fitting {
            let search = Search {
                text: None,
                opts: &opts,
                fits,
                moves: Moves::AcrossRanks,
                policy: &SearchPolicy::DEFAULT,
                trials: None,
            };
            for budget in [7, 40, 151] {
                let one = reorder_on(&plan, &search, budget, 1, &mut Replay::default());
                assert!(
                    !one.0.is_empty(),
                    "budget {budget}: the search found nothing"
                );
                for width in [2, 3, 8] {
                    let many = reorder_on(&plan, &search, budget, width, &mut Replay::default());
                    assert_eq!(one.1, many.1, "budget {budget}, width {width}");
                    assert_eq!(one.0.len(), many.0.len(), "budget {budget}, width {width}");
                    for (a, b) in one.0.iter().zip(&many.0) {
                        assert_eq!(a.order, b.order, "budget {budget}, width {width}");
                    }
                }
            }
        }
        assert!(refused.get() > 0, "the limit refused no move that helped");
    }

    /// A search that reads back the trials of a shorter (or longer) search of the
    /// same plan finds what it finds alone, with the same simulations spent, and
    /// lowers none of the trials it reads back; a record of another plan's search
    /// is dropped at the first trial that differs, and changes nothing either.
    #[test]
    fn a_search_reading_back_another_ones_trials_finds_the_same() {
        let (plan, opts, ..) = lockstep_ramp();
        let fits = |_: &Program, _: &SimReport| true;
        let search = Search {
            text: None,
            opts: &opts,
            fits: &fits,
            moves: Moves::AcrossRanks,
            policy: &SearchPolicy::DEFAULT,
            trials: None,
        };
        let recorded = |budget: usize, from: &Plan| {
            let mut r = Replay {
                on: true,
                ..Replay::default()
            };
            reorder_on(from, &search, budget, 2, &mut r);
            r.log
        };
        for (first, then) in [(40, 151), (151, 40), (7, 7)] {
            let log = recorded(first, &plan);
            let alone = reorder_on(&plan, &search, then, 2, &mut Replay::default());
            for width in [1, 2, 3] {
                let mut r = Replay {
                    log: log.clone(),
                    on: true,
                    ..Replay::default()
                };
                let again = reorder_on(&plan, &search, then, width, &mut r);
                let what = format!("{first} then {then}, width {width}");
                assert_eq!(alone.1, again.1, "{what}");
                assert_eq!(alone.0.len(), again.0.len(), "{what}");
                for (a, b) in alone.0.iter().zip(&again.0) {
                    assert_eq!(a.order, b.order, "{what}");
                }
                // Every trial both searches take is read back.
                let common = (first.min(then)).saturating_sub(PLACEMENTS.len());
                assert_eq!(r.replayed, common.min(log.len()), "{what}");
                assert!(r.replayed > 0, "{what}");
                assert!(r.log.len() >= log.len().max(r.at), "{what}");
            }
        }
        // The record of another plan's search: the first move differs.
        let mut other = plan.clone();
        let last = other.order[0].len() - 1;
        let w = (0..last)
            .rev()
            .find(|&i| other.order[0][i].op == Op::W)
            .unwrap();
        let t = other.order[0].remove(w);
        other.order[0].push(t);
        let log = recorded(40, &other);
        let alone = reorder_on(&plan, &search, 40, 2, &mut Replay::default());
        let mut r = Replay {
            log,
            on: true,
            ..Replay::default()
        };
        let again = reorder_on(&plan, &search, 40, 2, &mut r);
        assert_eq!(alone.1, again.1);
        assert_eq!(
            alone.0.iter().map(|p| &p.order).collect::<Vec<_>>(),
            again.0.iter().map(|p| &p.order).collect::<Vec<_>>()
        );
    }

    /// Every candidate move of either kind, for every wait of a rendezvous program
    /// with many (Qwen2-VL-7B at 4 x 8, the ramp layer by layer), is of the shape
    /// its kind promises and lowers to a valid program; both kinds come up.
    #[test]
    fn every_candidate_is_of_its_kind_and_lowers_to_a_valid_program() {
        let (plan, opts, rule, times) = lockstep_ramp();
        let deps = dependencies(&plan).unwrap();
        let mut seen = [0usize; 3];
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                if slot.wait <= SearchPolicy::DEFAULT.min_wait {
                    continue;
                }
                for kind in [Kind::Advance, Kind::Shift] {
                    for (q, from, to) in candidates(
                        &plan,
                        &deps,
                        &times,
                        (r, j),
                        slot.wait,
                        kind,
                        SearchPolicy::DEFAULT.lookahead,
                    ) {
                        let task = plan.order[q][from];
                        match kind {
                            Kind::Advance => {
                                assert!(q == r && from > j && to == j, "{kind:?} {q} {from} {to}");
                                seen[0] += 1;
                            }
                            _ if q == r => {
                                assert!(task.op == Op::W && from + 1 < j && to == j - 1);
                                seen[1] += 1;
                            }
                            _ => {
                                let producer =
                                    deps.of(r, j).iter().any(|d| d.producer() == (q, from));
                                assert!(producer && to < from, "{kind:?} {q} {from} {to}");
                                seen[2] += 1;
                            }
                        }
                        let mut next = plan.clone();
                        let t = next.order[q].remove(from);
                        next.order[q].insert(to, t);
                        let lowered = crate::algebra::lower::lower_with(&next, None, rule)
                            .unwrap_or_else(|e| {
                                panic!(
                                    "{kind:?} {r} {j} {q} {from} {to} {:?} {:?}: {e}",
                                    plan.order[q][from], plan.order[r][j]
                                )
                            });
                        assert_eq!(verify_static(&lowered), vec![], "{kind:?} {q} {from} {to}");
                        simulate(&lowered, &opts).unwrap();
                    }
                }
            }
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }

    /// A fill moves weight gradients only, each after its own backward, to just
    /// before the task the wait is before, in the order the rank had them, at most
    /// as much work as the wait; the plan lowers to a valid program. Checked for
    /// every wait of Qwen2-VL-7B at 4 x 8 (the lockstep ramp, whose weight
    /// gradients wait for the cool-down), where fills come up.
    #[test]
    fn a_fill_moves_ready_weight_gradients_into_the_wait_in_their_order() {
        let (plan, opts, rule, times) = lockstep_ramp();
        let index = plan.locate();
        let mut fills = 0;
        for (r, rank) in times.iter().enumerate() {
            for (j, slot) in rank.iter().enumerate() {
                let Some(Try::Fill((q, before, first), at, count)) =
                    fill_with_w(&plan, &index, r, j, slot.wait)
                else {
                    continue;
                };
                assert_eq!((q, at, before), (r, j, plan.order[r][j]));
                assert!(count >= 2);
                fills += 1;
                let mut next = plan.clone();
                next.order[r] = fill(&plan.order[r], &index, r, j, count);
                let (old, new) = (&plan.order[r], &next.order[r]);
                assert_eq!(old[..j], new[..j]);
                let moved = &new[j..j + count];
                assert_eq!(moved[0], first);
                let work: f64 = moved.iter().map(|t| plan.units[t.unit].cost.w).sum();
                assert!(work <= slot.wait, "{work} > {}", slot.wait);
                for t in moved {
                    assert_eq!(t.op, Op::W);
                    let b = old
                        .iter()
                        .position(|o| o.op == Op::B && (o.unit, o.mb) == (t.unit, t.mb));
                    assert!(b.is_some_and(|b| b < j), "{t:?}");
                }
                // The moved tasks kept their relative order, and the rest theirs.
                let pos = |t: &Task| old.iter().position(|o| o == t).unwrap();
                assert!(moved.windows(2).all(|w| pos(&w[0]) < pos(&w[1])));
                let rest: Vec<Task> = old[j..]
                    .iter()
                    .filter(|t| !moved.contains(t))
                    .copied()
                    .collect();
                assert_eq!(new[j + count..], rest[..]);
                let lowered = crate::algebra::lower::lower_with(&next, None, rule).unwrap();
                assert_eq!(verify_static(&lowered), vec![]);
                simulate(&lowered, &opts).unwrap();
            }
        }
        assert!(fills > 0);
    }
}
