//! Execute a [`Program`] under the execution semantics of `mpipe-program/1`
//! (`docs/spec/program-format.md`, "Execution semantics") and measure it.
//!
//! [`simulate`] runs every rank's list in order from time 0 and returns the
//! per-action [`Timeline`], the makespan, the bubble ratio, each rank's busy compute
//! time and each rank's peak activation memory. It promises:
//!
//! - **total**: any [`Program`] value, however nonsensical, gives a report or a typed
//!   [`SimError`]; nothing panics. Structural problems the engine cannot run
//!   (unknown unit, rank out of range, micro-batch out of range, negative or
//!   non-finite numbers) are errors; a transfer with no partner is simply a
//!   [`SimError::Deadlock`] (every stuck rank is listed, with what it waits for);
//! - **deterministic**: the same program and options give identical reports;
//! - **fast**: `O(N log N)` in the number of actions `N` (sorting only where matching
//!   needs it), no allocation per action in the event loop.
//!
//! [`simulate_lowered`] runs a lowering by unit index
//! ([`crate::algebra::lower::Lowered`]) through the same engine, and
//! [`finish_times_lowered`] stops before the memory walk: a search judges its trials
//! without naming their programs, and names and measures in full only the one it
//! keeps. Only the reading of the actions differs (names looked up, or indices
//! taken); `tests/lowered.rs` checks that the reports and errors are equal.
//!
//! # Semantics (normative text in the spec; choices where it is silent marked *)
//!
//! - A compute action takes [`Op::cost`] of its unit.
//! - Communication is organised in *operations*: a single `SEND`/`RECV`, a *batch*
//!   (maximal run of consecutive `SEND`/`RECV` actions of one rank with the same
//!   `batch` integer), or a collective. An operation starts when its rank *reaches*
//!   it; the rank is blocked until it completes.
//! - Point-to-point matching: the k-th `SEND(t,u,m)` from rank `a` to rank `b` pairs
//!   with the k-th `RECV(t,u,m)` from `a` on rank `b`.
//! - **Rendezvous**: an operation completes once every partner of every member has
//!   been *reached* (not completed), at `max` over members of
//!   `max(own reach, partner reach) + transfer(member)`.
//! - **Eager**: a `SEND` member completes at its reach time; a `RECV` member completes
//!   at `max(own reach, partner SEND reach + transfer)`; a batch completes when all
//!   its members have.
//! - Collectives: *matching is by identity `(kind, unit, root, set of group members)`
//!   and occurrence: the k-th occurrence of that identity on a rank waits for the k-th
//!   occurrence of the same identity on every other member of the group (this equals
//!   "k-th collective of that kind on that unit" whenever every such collective has
//!   the same group, and does not deadlock disjoint groups on one unit). It completes
//!   at the latest reach time `+ latency + params / bandwidth` under a comm model.
//! - `transfer(member) = latency + bytes(unit) / bandwidth` under a [`CommModel`],
//!   else 0; `bytes` is [`Unit::bytes`](crate::ir::program::Unit::bytes).
//! - *A `SEND`/`RECV` whose peer is its own rank runs like any other transfer (its
//!   partner is on the same rank, so it completes only within one batch under
//!   rendezvous).
//! - *In the timeline, every member of a batch gets the batch's interval, from reach
//!   to completion of the whole batch.
//!
//! # Memory
//!
//! `F(u,m)`/`RF(u,m)` holds `act(u)` on its rank over the half-open interval
//! `[start of the forward, end of the consumer)`, where the consumer is the last
//! `W(u,m)` on that rank if there is one, else the last `B(u,m)`/`BW(u,m)` there.
//! *Only the last forward (`F` or `RF`) before the consumer holds; other forwards, and
//! forwards with no consumer on their rank, hold nothing. Half-open intervals mean
//! that at equal times releases happen before acquisitions; an interval of length
//! zero holds nothing. The peak is the maximum over time of the sum held.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use crate::algebra::lower::{Batch, Lowered, Step};
use crate::ir::program::{
    over_limit, Action, ActionRef, CollKind, Dir, Op, OverLimit, Program, Tensor, Unit,
    MAX_MICROBATCHES, MAX_RANK_MICROBATCHES, MAX_UNIT_FIGURE,
};
use crate::judge::coll_ids::{CollId, CollIds};
use crate::judge::timeline::{Slot, Timeline};

pub use crate::ir::model::{CommModel, Mode, SimOptions};

/// What a simulation measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// Largest completion time over all actions (0 for an empty program).
    pub makespan: f64,
    /// `1 - total compute / (ranks * makespan)`, 0 when the makespan is 0.
    pub bubble: f64,
    /// Peak activation memory held by each rank.
    pub peak_memory: Vec<f64>,
    /// Busy compute time of each rank.
    pub compute: Vec<f64>,
    /// When every action ran.
    pub timeline: Timeline,
}

/// One rank that can never proceed in a deadlocked program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    pub rank: usize,
    /// Index in the rank's list of the action that waits.
    pub index: usize,
    /// The waiting action, as [`Action`]'s `Display` writes it.
    pub action: String,
    /// What it waits for, in words.
    pub waiting_for: String,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {}, action {} `{}`: waits for {}",
            self.rank, self.index, self.action, self.waiting_for
        )
    }
}

/// Why a program could not be simulated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SimError {
    #[error(
        "the program declares {ranks} ranks but has {lists} action lists: \
         make `ranks` equal to the number of lists in `programs`"
    )]
    RankCount { ranks: usize, lists: usize },
    #[error(
        "unit `{name}` is defined twice (units {first} and {second}): \
         give every unit a distinct name"
    )]
    DuplicateUnit {
        name: String,
        first: usize,
        second: usize,
    },
    #[error(
        "unit `{unit}`: `{field}` is {value}, but it must be a finite number >= 0: \
         fix the unit's entry in `units`"
    )]
    BadUnitNumber {
        unit: String,
        field: &'static str,
        value: f64,
    },
    #[error(
        "unit `{unit}`: `{field}` is {value:e}, above the {max:e} a program may give \
         (sums over a step of such figures are not finite or not precise): scale the \
         program's times and sizes to larger units"
    )]
    FigureTooLarge {
        unit: String,
        field: &'static str,
        value: f64,
        max: f64,
    },
    #[error(
        "rank {rank}, action {index} `{action}`: no unit is called `{unit}`: \
         use a name listed in `units`, or add the unit"
    )]
    UnknownUnit {
        rank: usize,
        index: usize,
        action: String,
        unit: String,
    },
    #[error(
        "rank {rank}, action {index} `{action}`: micro-batch {mb} does not exist \
         (the program has {microbatches}): fix `mb` or raise `microbatches`"
    )]
    MicrobatchOutOfRange {
        rank: usize,
        index: usize,
        action: String,
        mb: usize,
        microbatches: usize,
    },
    #[error(
        "rank {rank}, action {index} `{action}`: rank {peer} does not exist \
         (the program has {ranks} ranks): name an existing rank"
    )]
    NoSuchRank {
        rank: usize,
        index: usize,
        action: String,
        peer: usize,
        ranks: usize,
    },
    #[error(
        "communication model with latency {latency} and bandwidth {bandwidth}: \
         latency must be finite and >= 0 and bandwidth > 0"
    )]
    BadCommModel { latency: f64, bandwidth: f64 },
    #[error(
        "the timeline has {slots} intervals for rank {rank}, whose list has {actions} \
         actions: pass the timeline of this program (one interval per action)"
    )]
    TimelineShape {
        rank: usize,
        actions: usize,
        slots: usize,
    },
    #[error("the program is too large to simulate: {what}")]
    TooLarge { what: String },
    #[error(
        "unit `{unit}`: `home` is rank {home}, but the program has {ranks} ranks: \
         name an existing rank"
    )]
    HomeOutOfRange {
        unit: String,
        home: usize,
        ranks: usize,
    },
    #[error(
        "prefetch entry {index} (`{unit}`, micro-batch {mb}): {problem}: fix the entry \
         or remove it"
    )]
    BadPrefetch {
        index: usize,
        unit: String,
        mb: usize,
        problem: String,
    },
    #[error(
        "{what} is not a finite number (the costs, sizes or link figures are too large, \
         or the bandwidth too small): scale them to smaller units"
    )]
    NotFinite { what: String },
    #[error("{}", deadlock_text(.blocked))]
    Deadlock { blocked: Vec<Blocked> },
}

fn deadlock_text(blocked: &[Blocked]) -> String {
    let mut s = format!(
        "deadlock: {} rank{} can never proceed:",
        blocked.len(),
        if blocked.len() == 1 { "" } else { "s" }
    );
    for b in blocked {
        s.push_str("\n  ");
        s.push_str(&b.to_string());
    }
    s.push_str(
        "\nfix: add the missing partner actions, reorder the lists so that each \
         transfer's two sides (and each collective's members) can meet, or post \
         crossing SEND/RECV pairs together in one batch (same `batch` number)",
    );
    s
}

/// Run `p` under `opts` and measure it.
pub fn simulate(p: &Program, opts: &SimOptions) -> Result<SimReport, SimError> {
    measure(Setup::new(p, opts, true)?)
}

/// [`simulate`] of a lowering by unit index (`units` are the plan's): the report,
/// or the error, that [`simulate`] gives for [`Lowered::program`] of it, without
/// naming the program. One engine runs both; only the reading of the actions
/// differs (names looked up there, indices taken here).
pub fn simulate_lowered(
    units: &[Unit],
    lowered: &Lowered,
    opts: &SimOptions,
) -> Result<SimReport, SimError> {
    measure(Setup::lowered(units, lowered, opts)?)
}

/// Each rank's finishing time under [`simulate_lowered`] (the end of the last
/// interval of its timeline, 0 for an empty list), without measuring the memory:
/// an error exactly when [`simulate_lowered`] gives one, the same error. What a
/// search needs to rank a trial ([`crate::judge::compare::timed`] takes the
/// makespan, the latest of these, then their sum).
pub fn finish_times_lowered(
    units: &[Unit],
    lowered: &Lowered,
    opts: &SimOptions,
) -> Result<Vec<f64>, SimError> {
    let finish = finish_times_within(units, lowered, opts, f64::INFINITY)?;
    // Nothing is over an infinite cutoff: the run went to the end.
    Ok(finish.unwrap_or_default())
}

/// [`finish_times_lowered`] for a search that keeps only a program faster than
/// `cutoff`: `Ok(None)` as soon as some rank provably finishes later than `cutoff`
/// by more than the tolerance ([`crate::ir::compare::less`]), so that the makespan
/// cannot beat it ([`crate::ir::compare::Score::beats`]); the rest of the run is
/// not simulated (nor checked: an error it would meet later is not reported). The
/// proof: a rank at time `t` with compute `c` left to run finishes no earlier than
/// `t + c` (waiting only adds). An infinite `cutoff` runs to the end.
pub fn finish_times_within(
    units: &[Unit],
    lowered: &Lowered,
    opts: &SimOptions,
    cutoff: f64,
) -> Result<Option<Vec<f64>>, SimError> {
    let mut setup = Setup::lowered(units, lowered, opts)?;
    let Some((_, _, finish, _)) = Engine::new(&mut setup)?.execute::<false>(cutoff)? else {
        return Ok(None);
    };
    finite(finish.iter().copied().fold(0.0, f64::max))?;
    Ok(Some(finish))
}

/// What a run of [`finish_times_taken_or_run`] kept of itself: every operation's
/// time reached, every rank's busy compute and finishing time (8 bytes an operation:
/// the intervals follow from them, [`Kept::report`]).
#[derive(Debug)]
struct Ran {
    reach: Vec<f64>,
    busy: Vec<f64>,
    finish: Vec<f64>,
}

/// A run [`finish_times_taken_or_run`] kept, with the lowering it ran, still taken
/// apart: its report and the lowering again ([`Kept::report`]), without running it
/// again, nor resolving it or building the engine's tables again (`wiring`, the
/// run's own).
pub struct Kept<'p> {
    setup: Setup<'p>,
    wiring: Wiring,
    ran: Ran,
}

/// Every rank's finishing time, and the run where it was kept.
pub type FinishOrRun<'p> = (Vec<f64>, Option<Kept<'p>>);

/// [`finish_times_within`] of `lowered`, taken (its steps freed rank by rank as the
/// simulator reads them, so a search's candidate is not held twice while it runs),
/// and where `keep` wants the run, told its finishing times, the run kept with what
/// gives the lowering back ([`Kept`]). Holds no more than [`finish_times_within`]
/// while it runs, less the steps.
pub fn finish_times_taken_or_run<'p>(
    units: &'p [Unit],
    lowered: Lowered,
    opts: &SimOptions,
    cutoff: f64,
    keep: impl FnOnce(&[f64]) -> bool,
) -> Result<Option<FinishOrRun<'p>>, SimError> {
    let mut setup = Setup::taken(units, lowered, opts)?;
    let mut engine = Engine::new(&mut setup)?;
    let run = engine.execute::<false>(cutoff)?;
    let Some((_, busy, finish, reach)) = run else {
        return Ok(None);
    };
    finite(finish.iter().copied().fold(0.0, f64::max))?;
    if !keep(&finish) {
        return Ok(Some((finish, None)));
    }
    let Engine { w: wiring, .. } = engine;
    let kept = Kept {
        setup,
        wiring,
        ran: Ran {
            reach,
            busy,
            finish: finish.clone(),
        },
    };
    Ok(Some((finish, Some(kept))))
}

impl Kept<'_> {
    /// The lowering this run ran, and the report [`simulate_lowered`] gives for it
    /// (its intervals found from the times each operation was reached: the run is
    /// not repeated, each operation's completion follows from those times alone;
    /// read through the run's own resolution and engine tables).
    pub fn report(self) -> Result<(Lowered, SimReport), SimError> {
        let Kept { setup, wiring, ran } = self;
        let report = {
            let engine = Engine {
                s: &setup,
                w: wiring,
            };
            let slots = engine.replay(&ran.reach);
            drop(ran.reach);
            engine.report(slots, ran.busy, &ran.finish)
        };
        Ok((given_back(setup), report))
    }
}

/// [`simulate_lowered`] of `lowered`, taken (see [`finish_times_taken_or_run`]):
/// the report, with the lowering given back after the run, step for step.
pub fn simulate_taken(
    units: &[Unit],
    lowered: Lowered,
    opts: &SimOptions,
) -> Result<(Lowered, SimReport), SimError> {
    let mut setup = Setup::taken(units, lowered, opts)?;
    let report = measure_in(&mut setup)?;
    Ok((given_back(setup), report))
}

/// The lowering a setup of [`Setup::taken`] took apart.
fn given_back(setup: Setup<'_>) -> Lowered {
    setup
        .into_lowered()
        .expect("a setup taken apart gives its lowering back")
}

/// Run the resolved program of `setup` and measure it.
fn measure(mut setup: Setup<'_>) -> Result<SimReport, SimError> {
    measure_in(&mut setup)
}

/// [`measure`], the setup kept.
fn measure_in(setup: &mut Setup<'_>) -> Result<SimReport, SimError> {
    let report = Engine::new(setup)?.run()?;
    finite(report.makespan)?;
    Ok(report)
}

/// A makespan the report can give.
fn finite(makespan: f64) -> Result<(), SimError> {
    if makespan.is_finite() {
        Ok(())
    } else {
        Err(SimError::NotFinite {
            what: format!("the makespan ({makespan})"),
        })
    }
}

/// The activation memory each rank holds over the step whose timeline is `t` (the
/// simulator's, or one measured on a runtime), counted as `peak_memory` counts it:
/// per rank, `(time, level)` steps, each level held from its time until the next
/// step's, 0 before the first; the largest level is the rank's peak memory.
/// Fails when the program cannot be simulated or `t` is not a timeline of it (one
/// interval per action).
pub fn memory_over_time(p: &Program, t: &Timeline) -> Result<Vec<Vec<(f64, f64)>>, SimError> {
    Ok(memory_curves(p, t)?.collect())
}

/// [`memory_over_time`] one rank at a time, in rank order: each rank's steps are
/// found when the iterator reaches it, so a writer that streams them holds one
/// rank's at a time, not all.
pub fn memory_curves<'a>(
    p: &'a Program,
    t: &'a Timeline,
) -> Result<impl Iterator<Item = Vec<(f64, f64)>> + 'a, SimError> {
    // No engine runs it: its transfers are not paired.
    let setup = Setup::new(p, &SimOptions::default(), false)?;
    for (rank, list) in p.programs.iter().enumerate() {
        let slots = t.ranks.get(rank).map_or(0, Vec::len);
        if slots != list.len() {
            return Err(SimError::TimelineShape {
                rank,
                actions: list.len(),
                slots,
            });
        }
    }
    let mut table = Vec::new();
    Ok((0..p.programs.len()).map(move |r| setup.memory_steps(r, &t.ranks[r], &mut table)))
}

/// Check what every reader of a program relies on before it indexes anything: one
/// action list per rank, sizes within [`MAX_MICROBATCHES`] and
/// [`MAX_RANK_MICROBATCHES`], distinct unit names, finite non-negative unit numbers
/// no larger than [`MAX_UNIT_FIGURE`],
/// homes that are ranks, and prefetch entries that name a unit and a micro-batch of
/// the program. Cheap (one pass over the units); the simulator, the verifier and
/// re-derivation run it first.
pub fn check_shape(p: &Program) -> Result<(), SimError> {
    shape(p).map(|_| ())
}

/// [`check_shape`], giving the unit-name map it builds on success.
fn shape(p: &Program) -> Result<NameMap<'_>, SimError> {
    let names = shape_of_units(&p.units, p.ranks, p.programs.len(), p.microbatches)?;
    for (index, f) in p.prefetch.iter().enumerate() {
        let problem = if !names.contains_key(&*f.unit) {
            "no unit has that name".to_string()
        } else if f.mb >= p.microbatches {
            format!("the program has {} micro-batches", p.microbatches)
        } else {
            continue;
        };
        return Err(SimError::BadPrefetch {
            index,
            unit: f.unit.to_string(),
            mb: f.mb,
            problem,
        });
    }
    Ok(names)
}

/// [`shape`] but for the prefetch entries: a program declaring `ranks` ranks, with
/// `lists` action lists, `microbatches` micro-batches and these units.
fn shape_of_units(
    units: &[Unit],
    ranks: usize,
    lists: usize,
    microbatches: usize,
) -> Result<NameMap<'_>, SimError> {
    let nr = lists;
    if ranks != nr {
        return Err(SimError::RankCount { ranks, lists: nr });
    }
    if let Some(over) = over_limit(nr, microbatches) {
        let what = match over {
            OverLimit::Microbatches => format!(
                "{microbatches} micro-batches, over the {MAX_MICROBATCHES} mpipe handles in one step"
            ),
            OverLimit::Pairs => format!(
                "{nr} ranks x {microbatches} micro-batches, over the {MAX_RANK_MICROBATCHES} \
                 (rank, micro-batch) pairs mpipe handles in one step"
            ),
        };
        return Err(SimError::TooLarge { what });
    }
    let (names, dups) = names_of(units);
    if let Some(&(first, second)) = dups.first() {
        return Err(SimError::DuplicateUnit {
            name: units[second].name.clone(),
            first,
            second,
        });
    }
    for u in units {
        for (field, value) in u.numbers() {
            if !(value.is_finite() && value >= 0.0) {
                return Err(SimError::BadUnitNumber {
                    unit: u.name.clone(),
                    field,
                    value,
                });
            }
            if value > MAX_UNIT_FIGURE {
                return Err(SimError::FigureTooLarge {
                    unit: u.name.clone(),
                    field,
                    value,
                    max: MAX_UNIT_FIGURE,
                });
            }
        }
        if u.home >= nr {
            return Err(SimError::HomeOutOfRange {
                unit: u.name.clone(),
                home: u.home,
                ranks: nr,
            });
        }
    }
    Ok(names)
}

// ---------------------------------------------------------------------------
// Shared helpers (also used by the verifier).

/// FNV-1a: a fast hasher for short unit names. Only used for look-ups, never
/// iterated, so no order can leak from it.
pub(crate) struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// A look-up-only map keyed by unit name.
pub(crate) type NameMap<'a> = HashMap<&'a str, u32, BuildHasherDefault<Fnv>>;

/// The last unit names looked up ([`RecentNames::N`] of them, the most recent
/// first) and what each look-up gave, keyed by the name's address and length: a
/// program's actions share their unit's name, and a rank's actions name few units
/// (its stages' and their neighbours'), so a run of actions over them costs one
/// look-up each. Equal address and length is the same text (the names are
/// borrowed for as long as this is used); a name elsewhere is looked up.
pub(crate) struct RecentNames {
    last: [(*const u8, usize, Option<u32>); RecentNames::N],
}

impl RecentNames {
    /// How many names are remembered: a rank of a V-shaped schedule names six
    /// units (two stages and their four neighbours), with room to spare.
    const N: usize = 8;

    /// Nothing looked up yet (no name's address is null).
    pub(crate) fn new() -> RecentNames {
        RecentNames {
            last: [(std::ptr::null(), 0, None); RecentNames::N],
        }
    }

    /// What `lookup` gives for `name`, remembered for the next calls.
    #[inline(always)]
    pub(crate) fn get(
        &mut self,
        name: &str,
        lookup: impl FnOnce(&str) -> Option<u32>,
    ) -> Option<u32> {
        let key = (name.as_ptr(), name.len());
        let last = &mut self.last;
        if key == (last[0].0, last[0].1) {
            return last[0].2;
        }
        // Moved to the front when found, the least recent dropped when not.
        let hit = (1..RecentNames::N).find(|&k| key == (last[k].0, last[k].1));
        let (k, entry) = match hit {
            Some(k) => (k, last[k]),
            None => (RecentNames::N - 1, (key.0, key.1, lookup(name))),
        };
        last.copy_within(0..k, 1);
        last[0] = entry;
        entry.2
    }
}

/// Map every unit name to its index (the first definition wins) and list the
/// duplicates as `(first index, duplicate index)`.
pub(crate) fn unit_names(p: &Program) -> (NameMap<'_>, Vec<(usize, usize)>) {
    names_of(&p.units)
}

/// [`unit_names`] of a list of units.
fn names_of(units: &[Unit]) -> (NameMap<'_>, Vec<(usize, usize)>) {
    let mut map = NameMap::default();
    let mut dups = Vec::new();
    for (i, u) in units.iter().enumerate() {
        match map.get(u.name.as_str()) {
            Some(&first) => dups.push((first as usize, i)),
            None => {
                map.insert(u.name.as_str(), i as u32);
            }
        }
    }
    (map, dups)
}

/// The `batch` integer of a `SEND`/`RECV`, if any.
pub(crate) fn p2p_batch(a: &Action) -> Option<u64> {
    a.batch()
}

/// The batch rule: a transfer with batch number `batch` is posted in one batch
/// with the action before it (whose batch number is `prev`, `None` for anything
/// but a numbered transfer) when both carry the same number.
pub(crate) fn joins_batch<B: PartialEq>(prev: Option<B>, batch: Option<B>) -> bool {
    batch.is_some() && batch == prev
}

/// Split a rank's list into operations: `[lo, hi)` ranges that are one compute
/// action, one collective, one unbatched transfer, or one batch.
pub(crate) fn split_ops(list: &[Action], mut push: impl FnMut(usize, usize)) {
    let mut i = 0;
    while i < list.len() {
        let lo = i;
        i += 1;
        if let Some(b) = p2p_batch(&list[lo]) {
            while i < list.len() && joins_batch(Some(b), p2p_batch(&list[i])) {
                i += 1;
            }
        }
        push(lo, i);
    }
}

pub(crate) const fn op_index(op: Op) -> usize {
    match op {
        Op::F => 0,
        Op::B => 1,
        Op::W => 2,
        Op::BW => 3,
        Op::RF => 4,
    }
}

/// Per unit, the cost of each op, indexed by [`op_index`]: what a run reads per
/// compute action.
pub(crate) fn unit_costs(units: &[Unit]) -> Vec<[f64; 5]> {
    units
        .iter()
        .map(|u| {
            let mut c = [0.0; 5];
            for op in RAct::OPS {
                c[op_index(op)] = op.cost(&u.cost);
            }
            c
        })
        .collect()
}

/// Per unit, the time a transfer of its activation or gradient takes under
/// `opts` (0 without a comm model): what a run reads per transfer.
pub(crate) fn transfer_times(units: &[Unit], opts: &SimOptions) -> Vec<f64> {
    units
        .iter()
        .map(|u| opts.comm.map_or(0.0, |c| c.transfer_time(u.bytes)))
        .collect()
}

pub(crate) fn tensor_index(t: Tensor) -> u64 {
    match t {
        Tensor::Act => 0,
        Tensor::Grad => 1,
        Tensor::Input => 2,
    }
}

// ---------------------------------------------------------------------------
// Resolution: names to indices, once.

const NONE: u32 = u32::MAX;

/// A resolved action in 8 bytes, no strings: its unit (bits 0-31), its micro-batch
/// (bits 32-47: a program has at most [`MAX_MICROBATCHES`]) and what it is (bits 48
/// and up: a compute action's [`op_index`]; [`RAct::COLL`]; or a transfer, from
/// [`RAct::P2P`] up, its direction, tensor and whether it joins the batch of the
/// action before it). A transfer's peer is not kept: only matching and the words
/// of errors read it, from the source ([`Src::peer`]).
#[derive(Clone, Copy, Debug)]
struct RAct(u64);

const _: () = assert!(MAX_MICROBATCHES <= 1 << 16);

/// What a [`RAct`] is, unpacked.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Compute(Op),
    P2p {
        dir: Dir,
        tensor: Tensor,
        /// Posted in one batch with the action before it (see [`split_ops`]).
        joins: bool,
    },
    Coll,
}

impl RAct {
    const COLL: u64 = 5;
    const P2P: u64 = 8;
    const OPS: [Op; 5] = [Op::F, Op::B, Op::W, Op::BW, Op::RF];
    const TENSORS: [Tensor; 3] = [Tensor::Act, Tensor::Grad, Tensor::Input];

    fn new(tag: u64, unit: u32, mb: u32) -> RAct {
        debug_assert!(mb < 1 << 16);
        RAct(tag << 48 | u64::from(mb) << 32 | u64::from(unit))
    }

    fn compute(op: Op, unit: u32, mb: u32) -> RAct {
        RAct::new(op_index(op) as u64, unit, mb)
    }

    fn p2p(dir: Dir, tensor: Tensor, unit: u32, mb: u32, joins: bool) -> RAct {
        let dir = u64::from(dir == Dir::Recv);
        let tag = RAct::P2P | u64::from(joins) << 4 | dir << 2 | tensor_index(tensor);
        RAct::new(tag, unit, mb)
    }

    fn coll(unit: u32) -> RAct {
        RAct::new(RAct::COLL, unit, 0)
    }

    fn tag(self) -> u64 {
        self.0 >> 48
    }

    fn unit(self) -> u32 {
        self.0 as u32
    }

    fn mb(self) -> u32 {
        (self.0 >> 32) as u32 & 0xffff
    }

    /// A compute action's [`op_index`].
    fn compute_op(self) -> Option<usize> {
        let tag = self.tag();
        (tag < RAct::COLL).then_some(tag as usize)
    }

    fn is_compute(self) -> bool {
        self.tag() < RAct::COLL
    }

    fn is_coll(self) -> bool {
        self.tag() == RAct::COLL
    }

    /// A transfer's direction and [`tensor_index`] (what [`RAct::kind`] gives of
    /// it, read from the tag's bits without building the rest).
    fn p2p_dir(self) -> Option<(Dir, u64)> {
        let tag = self.tag();
        let dir = if tag & 4 == 0 { Dir::Send } else { Dir::Recv };
        (tag >= RAct::P2P).then_some((dir, tag & 3))
    }

    fn is_recv(self) -> bool {
        let tag = self.tag();
        tag >= RAct::P2P && tag & 4 != 0
    }

    /// A transfer posted in one batch with the action before it.
    fn joins(self) -> bool {
        self.tag() >= RAct::P2P | 1 << 4
    }

    fn kind(self) -> Kind {
        let tag = self.tag();
        if tag < RAct::COLL {
            Kind::Compute(RAct::OPS[tag as usize])
        } else if tag == RAct::COLL {
            Kind::Coll
        } else {
            Kind::P2p {
                dir: if tag & 4 == 0 { Dir::Send } else { Dir::Recv },
                tensor: RAct::TENSORS[(tag & 3) as usize],
                joins: tag & 16 != 0,
            }
        }
    }
}

/// One action as [`Resolver::push`] reads it, its unit already an index.
enum View<'a> {
    Compute {
        op: Op,
        mb: usize,
    },
    P2p {
        dir: Dir,
        tensor: Tensor,
        mb: usize,
        peer: usize,
        batch: Option<u64>,
    },
    Coll {
        kind: CollKind,
        root: usize,
        group: &'a [usize],
    },
}

/// Where a [`Setup`]'s actions come from: a named program, or a lowering by unit
/// index with the units it refers to, borrowed or taken apart ([`Taken`]). Only the
/// words of errors read it again, and matching a lowering's transfers (their
/// peers).
enum Src<'p> {
    Program(&'p Program),
    Lowered(&'p Lowered, &'p [Unit]),
    Taken(Box<Taken>, &'p [Unit]),
}

/// What a lowering's steps hold that their resolved actions do not: a transfer's
/// peer, a collective's index, a batch's number where it is not the canonical one
/// the resolved actions' joins give ([`steps_of`]). With the resolved actions, the steps
/// again ([`steps_of`]): 4 bytes a transfer or collective, where the steps are 20
/// bytes an action.
struct Taken {
    /// The lowering without its lists.
    shell: Lowered,
    /// Per rank, every member's peer ([`NONE`] for a collective), in list order.
    peers: Vec<Vec<u32>>,
    /// Per rank, the number of members on the ranks before it.
    first_member: Vec<usize>,
    /// Per rank, the index in [`Lowered::colls`] of each collective, in list order.
    colls: Vec<Vec<u32>>,
    /// Per rank, `(index, batch)` of each transfer whose batch is not the canonical
    /// one ([`steps_of`]).
    batches: Vec<Vec<(u32, Option<Batch>)>>,
}

/// A rank's steps again, from its resolved actions `acts` and what [`Taken`] kept
/// of them: its members' `peers`, its collectives' indices and the batches that
/// are not canonical. A transfer's canonical batch is the one
/// [`crate::algebra::lower::assemble_lowered`] gives it: the members of a batch of
/// two or more (a transfer and the ones joining it) numbered from 0 in list order,
/// a transfer alone in none.
fn steps_of(
    acts: &[RAct],
    peers: &[u32],
    colls: &[u32],
    odd: &[(u32, Option<Batch>)],
) -> Vec<Step> {
    // The members' peers and the collectives' indices left to read, the batches
    // counted, and the next transfer whose batch is not canonical.
    let (mut peers, mut colls) = (peers.iter(), colls.iter());
    let mut n = 0u64;
    let mut odd = odd.iter();
    let mut next_odd = odd.next();
    // One step per action, in order (an exact-size iterator: no growth checks).
    acts.iter()
        .enumerate()
        .map(|(i, &a)| {
            let (tag, unit, mb) = (a.tag(), a.unit(), a.mb());
            if tag < RAct::COLL {
                return Step::Compute {
                    op: RAct::OPS[tag as usize],
                    unit,
                    mb,
                };
            }
            let peer = peers.next().copied().unwrap_or(NONE);
            if tag == RAct::COLL {
                return Step::Coll(colls.next().copied().unwrap_or(NONE));
            }
            let joins = a.joins();
            let joined = acts.get(i + 1).is_some_and(|b| b.joins());
            let mut batch = if joins || joined {
                let b = Batch::new(n);
                n += u64::from(!joined);
                b
            } else {
                None
            };
            if let Some(&(_, b)) = next_odd.filter(|x| x.0 as usize == i) {
                batch = b;
                next_odd = odd.next();
            }
            Step::P2p {
                dir: if tag & 4 == 0 { Dir::Send } else { Dir::Recv },
                tensor: RAct::TENSORS[(tag & 3) as usize],
                unit,
                mb,
                peer,
                batch,
            }
        })
        .collect()
}

/// Step `i` of rank `r` of `l` as [`Resolver::push`] reads it, with its unit's
/// index; an error for a collective or unit `l` (with `units`) does not have.
#[inline(always)]
fn step_view<'l>(
    units: &[Unit],
    l: &'l Lowered,
    r: usize,
    i: usize,
    step: &Step,
) -> Result<(u32, View<'l>), SimError> {
    let (unit, view) = match *step {
        Step::Compute { op, unit, mb } => (
            unit as usize,
            View::Compute {
                op,
                mb: mb as usize,
            },
        ),
        Step::P2p {
            dir,
            tensor,
            unit,
            mb,
            peer,
            batch,
        } => (
            unit as usize,
            View::P2p {
                dir,
                tensor,
                mb: mb as usize,
                peer: peer as usize,
                batch: batch.map(|b| u64::from(b.get())),
            },
        ),
        Step::Coll(k) => {
            let Some(c) = l.colls.get(k as usize) else {
                return Err(SimError::UnknownUnit {
                    rank: r,
                    index: i,
                    action: format!("collective #{k}"),
                    unit: format!("(no collective #{k})"),
                });
            };
            let view = View::Coll {
                kind: c.kind,
                root: c.root,
                group: &c.group,
            };
            (c.unit, view)
        }
    };
    if unit >= units.len() {
        return Err(SimError::UnknownUnit {
            rank: r,
            index: i,
            action: format!("{step:?}"),
            unit: format!("#{unit}"),
        });
    }
    Ok((unit as u32, view))
}

/// `step` of `l` as text, for an error (`?` if it names what `l` does not have).
fn describe(units: &[Unit], l: &Lowered, step: &Step) -> String {
    l.describe(units, step)
        .map_or_else(|| "?".to_string(), |a| a.to_string())
}

/// What [`Setup::lowered`] checks of `l` before reading its steps.
fn check_lowered(units: &[Unit], l: &Lowered, opts: &SimOptions) -> Result<(), SimError> {
    check_comm(opts)?;
    shape_of_units(units, l.ranks, l.programs.len(), l.microbatches)?;
    for (index, &(u, mb)) in l.prefetch.iter().enumerate() {
        let problem = if u >= units.len() {
            "no unit has that name".to_string()
        } else if mb >= l.microbatches {
            format!("the program has {} micro-batches", l.microbatches)
        } else {
            continue;
        };
        return Err(SimError::BadPrefetch {
            index,
            unit: units
                .get(u)
                .map_or_else(|| format!("#{u}"), |x| x.name.clone()),
            mb,
            problem,
        });
    }
    Ok(())
}

struct Setup<'p> {
    src: Src<'p>,
    /// How many units and micro-batches the program has.
    units: usize,
    microbatches: usize,
    mode: Mode,
    comm: Option<CommModel>,
    /// Per unit, the cost of each op (indexed by [`op_index`]).
    cost: Vec<[f64; 5]>,
    /// Per unit, the time a transfer of its activation or gradient takes (0 without
    /// a comm model).
    transfer: Vec<f64>,
    params: Vec<f64>,
    act: Vec<f64>,
    /// Number of actions in the program.
    actions: usize,
    acts: Vec<Vec<RAct>>,
    /// Distinct collective identities, in first-seen order.
    coll_ids: Vec<CollId>,
    /// For each collective action `(rank, index)`: its identity and occurrence.
    coll_of: BTreeMap<(u32, u32), (u32, u32)>,
    /// Its operations and members, counted as it was resolved.
    ops: Ops,
    /// For every member that is a `SEND`/`RECV`: the operation of its partner on
    /// the peer rank; [`NONE`] if it has none, and for a collective (paired as it
    /// was resolved).
    partner_op: Vec<u32>,
    /// Per operation, its transfers that wait for a partner in another operation or
    /// for none (under eager semantics its `RECV`s only): what [`Wiring::pending`]
    /// starts from, taken by the engine ([`Engine::new`]).
    pending: Vec<u32>,
}

impl<'p> Setup<'p> {
    /// The setup of `p`, its transfers paired for an engine where `paired`.
    fn new(p: &'p Program, opts: &SimOptions, paired: bool) -> Result<Setup<'p>, SimError> {
        check_comm(opts)?;
        let names = shape(p)?;
        let total: usize = p.programs.iter().map(Vec::len).sum();
        let mut res = Resolver::new(&p.units, p.programs.len(), p.microbatches, total, opts.mode)?;
        res.paired = paired;
        let mut recent = RecentNames::new();
        for (r, list) in p.programs.iter().enumerate() {
            res.rank(list.len());
            for (i, a) in list.iter().enumerate() {
                let view = a.view();
                let unit_name = match view {
                    ActionRef::Compute(c) => c.unit,
                    ActionRef::P2p(t) => t.unit,
                    ActionRef::Coll(c) => c.unit,
                };
                let Some(unit) = recent.get(unit_name, |n| names.get(n).copied()) else {
                    return Err(SimError::UnknownUnit {
                        rank: r,
                        index: i,
                        action: a.to_string(),
                        unit: unit_name.to_string(),
                    });
                };
                match view {
                    ActionRef::Compute(c) if c.mb < res.microbatches => {
                        res.prev = None;
                        res.acts[r].push(RAct::compute(c.op, unit, c.mb as u32));
                    }
                    ActionRef::P2p(t) if t.mb < res.microbatches && t.peer < res.nr => {
                        res.p2p(
                            r,
                            t.dir,
                            t.tensor,
                            unit,
                            t.mb as u32,
                            t.peer as u32,
                            t.batch,
                        );
                    }
                    _ => {
                        // Through the checks, for their errors (and a collective).
                        let view = match view {
                            ActionRef::Compute(c) => View::Compute { op: c.op, mb: c.mb },
                            ActionRef::P2p(t) => View::P2p {
                                dir: t.dir,
                                tensor: t.tensor,
                                mb: t.mb,
                                peer: t.peer,
                                batch: t.batch,
                            },
                            ActionRef::Coll(c) => View::Coll {
                                kind: c.kind,
                                root: c.root,
                                group: c.group,
                            },
                        };
                        res.push(r, i, unit, view, || a.to_string())?;
                    }
                }
            }
        }
        Ok(res.finish(Src::Program(p), &p.units, opts))
    }

    /// The setup of [`Lowered::program`] of `l` (`units` the plan's), read from `l`:
    /// the same checks in the same order, the same resolved actions.
    fn lowered(
        units: &'p [Unit],
        l: &'p Lowered,
        opts: &SimOptions,
    ) -> Result<Setup<'p>, SimError> {
        check_lowered(units, l, opts)?;
        let total: usize = l.programs.iter().map(Vec::len).sum();
        let mut res = Resolver::new(units, l.programs.len(), l.microbatches, total, opts.mode)?;
        for (r, list) in l.programs.iter().enumerate() {
            res.rank(list.len());
            for (i, step) in list.iter().enumerate() {
                res.push_step(units, l, r, i, step)?;
            }
        }
        Ok(res.finish(Src::Lowered(l, units), units, opts))
    }

    /// [`Setup::lowered`] taking `l` apart: each rank's steps are freed once they
    /// are resolved, what the resolved actions do not hold of them kept beside
    /// ([`Taken`]), so the steps and the resolved actions are not both held in
    /// full. [`Setup::into_lowered`] gives `l` back, step for step.
    fn taken(units: &'p [Unit], mut l: Lowered, opts: &SimOptions) -> Result<Setup<'p>, SimError> {
        check_lowered(units, &l, opts)?;
        let total: usize = l.programs.iter().map(Vec::len).sum();
        let mut res = Resolver::new(units, l.programs.len(), l.microbatches, total, opts.mode)?;
        let lists = std::mem::take(&mut l.programs);
        let mut taken = Taken {
            peers: Vec::with_capacity(lists.len()),
            first_member: Vec::with_capacity(lists.len()),
            colls: Vec::with_capacity(lists.len()),
            batches: Vec::with_capacity(lists.len()),
            shell: l,
        };
        for (r, list) in lists.into_iter().enumerate() {
            res.rank(list.len());
            let first = taken.first_member.last().copied().unwrap_or(0)
                + taken.peers.last().map_or(0, Vec::len);
            taken.first_member.push(first);
            // Room for every step (no counting pass), cut to the members after.
            let (mut peers, mut colls, mut odd) =
                (Vec::with_capacity(list.len()), Vec::new(), Vec::new());
            // The batch of the step before (if a transfer), and the canonical
            // batches counted.
            let (mut prev, mut n) = (None, 0u64);
            // The rank's resolved actions, held here while its steps are read
            // (what `Resolver::push_step` does, each step matched once).
            let mut acts = std::mem::take(&mut res.acts[r]);
            let (nr, microbatches) = (res.nr, res.microbatches);
            let fits =
                |unit: u32, mb: u32| (unit as usize) < units.len() && (mb as usize) < microbatches;
            for (i, step) in list.iter().enumerate() {
                match *step {
                    Step::Compute { op, unit, mb } => {
                        if fits(unit, mb) {
                            res.prev = None;
                            acts.push(RAct::compute(op, unit, mb));
                        } else {
                            res.through(&mut acts, units, &taken.shell, r, i, step)?;
                        }
                        prev = None;
                    }
                    Step::P2p {
                        dir,
                        tensor,
                        unit,
                        mb,
                        peer,
                        batch,
                    } => {
                        if fits(unit, mb) && (peer as usize) < nr {
                            let b = batch.map(|b| u64::from(b.get()));
                            acts.push(res.p2p_act(r, dir, tensor, unit, mb, peer, b));
                        } else {
                            res.through(&mut acts, units, &taken.shell, r, i, step)?;
                        }
                        peers.push(peer);
                        // The canonical batch, as `steps_of` reads it from the
                        // resolved actions: one that is not is kept (none for a
                        // lowering `assemble_lowered` wrote).
                        let joins = batch.is_some() && batch == prev;
                        let joined = batch.is_some()
                            && matches!(list.get(i + 1), Some(Step::P2p { batch: b, .. }) if *b == batch);
                        let canonical = if joins || joined {
                            let b = Batch::new(n);
                            n += u64::from(!joined);
                            b
                        } else {
                            None
                        };
                        if canonical != batch {
                            odd.push((i as u32, batch));
                        }
                        prev = batch;
                    }
                    Step::Coll(k) => {
                        res.through(&mut acts, units, &taken.shell, r, i, step)?;
                        peers.push(NONE);
                        colls.push(k);
                        prev = None;
                    }
                }
            }
            res.acts[r] = acts;
            peers.shrink_to_fit();
            taken.peers.push(peers);
            taken.colls.push(colls);
            taken.batches.push(odd);
        }
        let names = Src::Taken(Box::new(taken), units);
        Ok(res.finish(names, units, opts))
    }

    /// The lowering a [`Setup::taken`] took apart, step for step as it was, its
    /// resolved actions freed rank by rank as its steps are written again. `None`
    /// for a setup of another reading.
    fn into_lowered(self) -> Option<Lowered> {
        let Src::Taken(taken, _) = self.src else {
            return None;
        };
        let Taken {
            mut shell,
            peers,
            colls,
            batches,
            ..
        } = *taken;
        let mut programs = Vec::with_capacity(self.acts.len());
        let lists = self
            .acts
            .into_iter()
            .zip(peers)
            .zip(colls.iter().zip(&batches));
        for ((acts, peers), (colls, odd)) in lists {
            programs.push(steps_of(&acts, &peers, colls, odd));
        }
        shell.programs = programs;
        Some(shell)
    }

    /// Action `i` of rank `r`, as its source names it.
    fn action(&self, r: usize, i: usize) -> Option<Action> {
        match &self.src {
            Src::Program(p) => p.programs.get(r)?.get(i).cloned(),
            Src::Lowered(l, units) => l.action(units, r, i),
            Src::Taken(t, units) => {
                let acts = self.acts.get(r)?;
                let step = *steps_of(acts, &t.peers[r], &t.colls[r], &t.batches[r]).get(i)?;
                t.shell.describe(units, &step)
            }
        }
    }

    /// [`Setup::action`] as text (`?` if there is none, which resolution rules out).
    fn text(&self, r: usize, i: usize) -> String {
        self.action(r, i)
            .map_or_else(|| "?".to_string(), |a| a.to_string())
    }

    /// The peer of transfer `i` of rank `r`, member `m` (resolution has checked it
    /// is a rank), [`NONE`] for another action.
    #[inline(always)]
    fn peer(&self, r: usize, i: usize, m: usize) -> u32 {
        match &self.src {
            Src::Program(p) => match p.programs[r][i].view() {
                ActionRef::P2p(t) => t.peer as u32,
                _ => NONE,
            },
            Src::Lowered(l, _) => match l.programs[r][i] {
                Step::P2p { peer, .. } => peer,
                _ => NONE,
            },
            Src::Taken(t, _) => t.peers[r][m - t.first_member[r]],
        }
    }

    /// The activation memory rank `r` holds over time, given its timeline: `(time,
    /// level)` steps, each level held from its time until the next step's (0 before
    /// the first). All changes at one time count together, releases with
    /// acquisitions (half-open intervals), so a peak is the largest level.
    /// `table` is scratch space kept across calls (its entries empty between them).
    fn memory_steps(&self, r: usize, slots: &[Slot], table: &mut Vec<[u32; 3]>) -> Vec<(f64, f64)> {
        let mut steps: Vec<(f64, f64)> = Vec::new();
        self.memory_changes(
            r,
            slots,
            table,
            &mut Scratch::default(),
            |t, cur| match steps.last_mut() {
                Some(last) if last.0 == t => last.1 = cur,
                _ => steps.push((t, cur)),
            },
        );
        steps
    }

    /// Every change of rank `r`'s activation memory in time order, as `(time, level
    /// after it)`; changes at one time come one after another (the level held from
    /// that time is the last one's). `scratch` is reused across ranks.
    fn memory_changes(
        &self,
        r: usize,
        slots: &[Slot],
        table: &mut Vec<[u32; 3]>,
        scratch: &mut Scratch,
        change: impl FnMut(f64, f64),
    ) {
        let s = self;
        let acts = &s.acts[r];
        // With a table of every (unit, mb) no larger than the program, two passes in
        // list order find what each holds; otherwise a sort groups them.
        let keys = (s.units as u64).saturating_mul(s.microbatches as u64);
        if keys <= s.actions as u64 {
            s.changes_by_table(acts, slots, table, change);
            return;
        }
        let Scratch { delta, at_start } = scratch;
        delta.clear();
        delta.resize(acts.len(), 0.0);
        at_start.clear();
        at_start.resize(acts.len(), false);
        s.hold_by_sort(acts, delta, at_start);
        changes_in_order(delta, at_start, slots, change);
    }

    /// The activation each (unit, mb) of `acts` holds, as `+act` at its holding
    /// forward (marked in `at_start`) and `-act` at its consumer: the consumer is the
    /// last `W(unit, mb)`, else the last `B`/`BW`; the holder the last `F`/`RF` before
    /// it. Found by sorting the compute actions by (unit, mb).
    fn hold_by_sort(&self, acts: &[RAct], delta: &mut [f64], at_start: &mut [bool]) {
        let s = self;
        let mut entries: Vec<(u64, u32, Op, u32)> = acts
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a.kind() {
                Kind::Compute(op) => Some((s.key(a.unit(), a.mb()), i as u32, op, a.unit())),
                _ => None,
            })
            .collect();
        entries.sort_unstable_by_key(|e| (e.0, e.1));
        for group in entries.chunk_by(|a, b| a.0 == b.0) {
            let last = |pred: fn(Op) -> bool| group.iter().rev().find(|e| pred(e.2)).map(|e| e.1);
            let consumer =
                last(|op| op == Op::W).or_else(|| last(|op| matches!(op, Op::B | Op::BW)));
            let Some(c) = consumer else { continue };
            let holder = group
                .iter()
                .rev()
                .find(|e| matches!(e.2, Op::F | Op::RF) && e.1 < c)
                .map(|e| e.1);
            let Some(h) = holder else { continue };
            let a = s.act[group[0].3 as usize];
            delta[h as usize] += a;
            at_start[h as usize] = true;
            delta[c as usize] -= a;
        }
    }

    /// [`Setup::memory_changes`] of `acts` (timeline `slots`) from a table indexed by
    /// [`Setup::key`], what [`Setup::hold_by_sort`] and [`changes_in_order`] give, in
    /// two passes over `acts`. The first keeps per (unit, mb) its last `F`/`RF` so
    /// far, its consumer so far (the last `W`, else the last `B`/`BW`) and the last
    /// forward before that consumer (its holder); the second, in list order, emits
    /// `+act` at the holder's start and `-act` at the consumer's end, and empties
    /// the entry at its consumer (at its last forward, for one with no consumer),
    /// so every entry touched is empty again after it (an action of that (unit, mb)
    /// listed later finds it empty and changes nothing).
    fn changes_by_table(
        &self,
        acts: &[RAct],
        slots: &[Slot],
        table: &mut Vec<[u32; 3]>,
        mut change: impl FnMut(f64, f64),
    ) {
        let keys = self.units * self.microbatches;
        if table.len() < keys {
            table.resize(keys, [NONE; 3]);
        }
        const W: usize = op_index(Op::W);
        const B: usize = op_index(Op::B);
        const BW: usize = op_index(Op::BW);
        const F: usize = op_index(Op::F);
        const RF: usize = op_index(Op::RF);
        // Entry: [last forward, consumer, holder].
        for (i, a) in acts.iter().enumerate() {
            let Some(op) = a.compute_op() else { continue };
            let e = &mut table[self.key(a.unit(), a.mb()) as usize];
            let i = i as u32;
            match op {
                F | RF => e[0] = i,
                W => [e[1], e[2]] = [i, e[0]],
                B | BW => {
                    let c = e[1];
                    if c == NONE || acts[c as usize].compute_op() != Some(W) {
                        [e[1], e[2]] = [i, e[0]];
                    }
                }
                _ => {}
            }
        }
        // The sums and their order as `changes_in_order` takes them from `delta`.
        let mut cur = 0.0f64;
        for (i, a) in acts.iter().enumerate() {
            if !a.is_compute() {
                continue;
            }
            let unit = a.unit();
            let cell = &mut table[self.key(unit, a.mb()) as usize];
            let e = *cell;
            let i = i as u32;
            if e[1] == NONE {
                if e[0] == i {
                    *cell = [NONE; 3];
                }
                continue;
            }
            let (held, at) = if e[2] == i {
                (0.0 + self.act[unit as usize], slots[i as usize].start)
            } else if e[1] == i {
                *cell = [NONE; 3];
                if e[2] == NONE {
                    continue;
                }
                (0.0 - self.act[unit as usize], slots[i as usize].end)
            } else {
                continue;
            };
            if held == 0.0 {
                continue;
            }
            cur += held;
            change(at, cur);
        }
    }

    fn key(&self, unit: u32, mb: u32) -> u64 {
        u64::from(unit) * self.microbatches as u64 + u64::from(mb)
    }
}

/// Every change of a rank's activation memory in list order (its actions are
/// sequential, so in time order), as `(time, level after it)`: `delta` per action
/// (nothing where 0), at the action's start where `at_start`, else at its end, on
/// the timeline `slots`.
fn changes_in_order(
    delta: &[f64],
    at_start: &[bool],
    slots: &[Slot],
    mut change: impl FnMut(f64, f64),
) {
    let mut cur = 0.0f64;
    for (i, &d) in delta.iter().enumerate() {
        if d == 0.0 {
            continue;
        }
        let t = if at_start[i] {
            slots[i].start
        } else {
            slots[i].end
        };
        cur += d;
        change(t, cur);
    }
}

/// A communication model the simulator can use: finite latency >= 0, bandwidth > 0.
fn check_comm(opts: &SimOptions) -> Result<(), SimError> {
    if let Some(c) = opts.comm {
        let ok = c.latency.is_finite() && c.latency >= 0.0 && c.bandwidth > 0.0;
        if !ok {
            return Err(SimError::BadCommModel {
                latency: c.latency,
                bandwidth: c.bandwidth,
            });
        }
    }
    Ok(())
}

/// Resolution of a program's actions, one at a time in list order, into a [`Setup`]:
/// shared by both readings of a program ([`Setup::new`], [`Setup::lowered`]).
struct Resolver {
    nr: usize,
    microbatches: usize,
    total: usize,
    acts: Vec<Vec<RAct>>,
    coll_ids: CollIds,
    coll_of: BTreeMap<(u32, u32), (u32, u32)>,
    occ_count: BTreeMap<(u32, u32), u32>,
    /// The `batch` of the action before, on the rank being read.
    prev: Option<u64>,
    /// The operations and members so far, as [`Engine`] numbers them.
    ops: Ops,
    /// Whether transfers run under eager semantics (then a `SEND` waits for nothing).
    eager: bool,
    /// Per operation so far, its transfers that wait (see [`Setup::pending`]), before
    /// pairing.
    waits: Vec<u32>,
    /// The transfers read so far, by channel.
    channels: Channels,
    /// Whether the transfers are paired (for an engine: [`Setup::partner_op`],
    /// [`Setup::pending`]); where not, those are left empty.
    paired: bool,
}

/// The operations and members of a resolved program, counted as it is read (see
/// [`Engine`]), so the engine has no counting pass of its own.
#[derive(Debug, Default)]
struct Ops {
    /// Per rank, the id of its first operation; one more entry, their number.
    rank_ops: Vec<u32>,
    /// Per rank, the index of its first member; one more entry, their number.
    rank_members: Vec<u32>,
    /// (rank, index, operation) of every collective, in list order (as in
    /// [`Setup::coll_of`]).
    colls: Vec<(u32, u32, u32)>,
    /// The operations so far.
    ops: u32,
    /// The members so far.
    members: u32,
}

impl Resolver {
    /// Fails when the program is too large for the engine's indices.
    fn new(
        units: &[Unit],
        nr: usize,
        microbatches: usize,
        total: usize,
        mode: Mode,
    ) -> Result<Resolver, SimError> {
        if total >= NONE as usize || units.len() >= NONE as usize || nr >= NONE as usize {
            return Err(SimError::TooLarge {
                what: format!("{total} actions, {} units, {nr} ranks", units.len()),
            });
        }
        // Channel keys are ((unit * microbatches + mb) * 3 + tensor) in a u64.
        let cells = (units.len() as u64)
            .checked_mul(microbatches as u64)
            .and_then(|c| c.checked_mul(3));
        if cells.is_none() || microbatches > MAX_MICROBATCHES {
            return Err(SimError::TooLarge {
                what: format!(
                    "{} units x {} micro-batches overflows the matching keys",
                    units.len(),
                    microbatches
                ),
            });
        }
        Ok(Resolver {
            nr,
            microbatches,
            total,
            acts: Vec::with_capacity(nr),
            coll_ids: CollIds::default(),
            coll_of: BTreeMap::new(),
            occ_count: BTreeMap::new(),
            prev: None,
            ops: Ops::default(),
            eager: mode == Mode::Eager,
            waits: Vec::new(),
            channels: Channels::new(nr, total),
            paired: true,
        })
    }

    /// Start the next rank's list, of `len` actions.
    fn rank(&mut self, len: usize) {
        self.acts.push(Vec::with_capacity(len));
        self.prev = None;
        let ops = &mut self.ops;
        ops.rank_ops.push(ops.ops);
        ops.rank_members.push(ops.members);
    }

    /// Action `i` of rank `r` (the last rank started), on unit `unit`; `describe`
    /// writes it for an error.
    fn push(
        &mut self,
        r: usize,
        i: usize,
        unit: u32,
        view: View<'_>,
        describe: impl Fn() -> String,
    ) -> Result<(), SimError> {
        let (nr, microbatches) = (self.nr, self.microbatches);
        let check_mb = |mb: usize| {
            if mb < microbatches {
                Ok(mb as u32)
            } else {
                Err(SimError::MicrobatchOutOfRange {
                    rank: r,
                    index: i,
                    action: describe(),
                    mb,
                    microbatches,
                })
            }
        };
        let check_rank = |peer: usize| {
            if peer < nr {
                Ok(peer as u32)
            } else {
                Err(SimError::NoSuchRank {
                    rank: r,
                    index: i,
                    action: describe(),
                    peer,
                    ranks: nr,
                })
            }
        };
        let (ra, batch) = match view {
            View::Compute { op, mb } => (RAct::compute(op, unit, check_mb(mb)?), None),
            View::P2p {
                dir,
                tensor,
                mb,
                peer,
                batch,
            } => {
                let mb = check_mb(mb)?;
                let peer = check_rank(peer)?;
                self.p2p(r, dir, tensor, unit, mb, peer, batch);
                return Ok(());
            }
            View::Coll { kind, root, group } => {
                for &g in group {
                    check_rank(g)?;
                }
                let id = self.coll_ids.intern(kind, unit, root, group);
                let k = self.occ_count.entry((id, r as u32)).or_insert(0);
                self.coll_of.insert((r as u32, i as u32), (id, *k));
                *k += 1;
                (RAct::coll(unit), None)
            }
        };
        self.prev = batch;
        if ra.is_coll() {
            // Fewer than 2^32 actions (checked when reading began), so these fit.
            let ops = &mut self.ops;
            ops.members += 1;
            ops.colls.push((r as u32, i as u32, ops.ops));
            ops.ops += 1;
            if self.paired {
                self.waits.push(0);
            }
        }
        self.acts[r].push(ra);
        Ok(())
    }

    /// A transfer of rank `r` (the last rank started) whose numbers are checked:
    /// its unit, micro-batch and peer in range.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn p2p(
        &mut self,
        r: usize,
        dir: Dir,
        tensor: Tensor,
        unit: u32,
        mb: u32,
        peer: u32,
        batch: Option<u64>,
    ) {
        let a = self.p2p_act(r, dir, tensor, unit, mb, peer, batch);
        self.acts[r].push(a);
    }

    /// [`Resolver::p2p`] but for the resolved action, which the caller appends to
    /// rank `r`'s list.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn p2p_act(
        &mut self,
        r: usize,
        dir: Dir,
        tensor: Tensor,
        unit: u32,
        mb: u32,
        peer: u32,
        batch: Option<u64>,
    ) -> RAct {
        let joins = joins_batch(self.prev, batch);
        self.prev = batch;
        // Fewer than 2^32 actions (checked when reading began), so these fit.
        let ops = &mut self.ops;
        ops.members += 1;
        if !joins {
            ops.ops += 1;
        }
        if self.paired {
            // A new operation's count of waiting transfers starts with this one's.
            let waits = u32::from(!(self.eager && dir == Dir::Send));
            if !joins {
                self.waits.push(waits);
            } else if let Some(w) = self.waits.last_mut() {
                *w += waits;
            }
            let key = (u64::from(unit) * self.microbatches as u64 + u64::from(mb)) * 3
                + tensor_index(tensor);
            let (m, x) = (ops.members - 1, ops.ops - 1);
            self.channels.add(r as u32, peer, dir, key, m, x);
        }
        RAct::p2p(dir, tensor, unit, mb, joins)
    }

    /// [`Resolver::push_step`] of a step of rank `r` while the rank's resolved
    /// actions so far are held in `acts` (by [`Setup::taken`]).
    fn through(
        &mut self,
        acts: &mut Vec<RAct>,
        units: &[Unit],
        l: &Lowered,
        r: usize,
        i: usize,
        step: &Step,
    ) -> Result<(), SimError> {
        self.acts[r] = std::mem::take(acts);
        let done = self.push_step(units, l, r, i, step);
        *acts = std::mem::take(&mut self.acts[r]);
        done
    }

    /// Step `i` of rank `r` of `l` (the last rank started; `units` the plan's): what
    /// [`step_view`] then [`Resolver::push`] make of it, read straight from the step
    /// where its numbers are in range (else, and for a collective, through them,
    /// for their checks and errors).
    #[inline(always)]
    fn push_step(
        &mut self,
        units: &[Unit],
        l: &Lowered,
        r: usize,
        i: usize,
        step: &Step,
    ) -> Result<(), SimError> {
        let fits =
            |unit: u32, mb: u32| (unit as usize) < units.len() && (mb as usize) < self.microbatches;
        match *step {
            Step::Compute { op, unit, mb } if fits(unit, mb) => {
                self.prev = None;
                self.acts[r].push(RAct::compute(op, unit, mb));
                Ok(())
            }
            Step::P2p {
                dir,
                tensor,
                unit,
                mb,
                peer,
                batch,
            } if fits(unit, mb) && (peer as usize) < self.nr => {
                let batch = batch.map(|b| u64::from(b.get()));
                self.p2p(r, dir, tensor, unit, mb, peer, batch);
                Ok(())
            }
            _ => {
                let (unit, view) = step_view(units, l, r, i, step)?;
                self.push(r, i, unit, view, || describe(units, l, step))
            }
        }
    }

    fn finish<'p>(self, src: Src<'p>, units: &[Unit], opts: &SimOptions) -> Setup<'p> {
        let cost = unit_costs(units);
        // Every transfer paired with its partner; a pair within one operation (a
        // batch sending to itself) waits for neither end.
        let mut partner_op = vec![
            NONE;
            if self.paired {
                self.ops.members as usize
            } else {
                0
            }
        ];
        let mut pending = self.waits;
        let eager = self.eager;
        self.channels.pair(|send, recv| {
            partner_op[send.0 as usize] = recv.1;
            partner_op[recv.0 as usize] = send.1;
            if send.1 == recv.1 {
                pending[send.1 as usize] -= if eager { 1 } else { 2 };
            }
        });
        Setup {
            src,
            units: units.len(),
            microbatches: self.microbatches,
            mode: opts.mode,
            comm: opts.comm,
            cost,
            transfer: transfer_times(units, opts),
            params: units.iter().map(|u| u.params).collect(),
            act: units.iter().map(|u| u.act).collect(),
            actions: self.total,
            acts: self.acts,
            coll_ids: self.coll_ids.into_ids(),
            coll_of: self.coll_of,
            ops: {
                let mut ops = self.ops;
                ops.rank_ops.push(ops.ops);
                ops.rank_members.push(ops.members);
                ops
            },
            partner_op,
            pending,
        }
    }
}

// ---------------------------------------------------------------------------
// The event engine.

/// Communication operations (single transfers, batches, collectives), what each
/// waits for, and the partner of every transfer. Compute actions are not
/// operations: a rank runs through them without synchronising.
///
/// Operations are numbered rank by rank in list order, and so are *members* (the
/// actions that are not compute actions: transfers, alone or in a batch, and
/// collectives), so that a rank running through its list finds its next operation
/// and member by counting: nothing is kept per action, 4 bytes a member and 13 an
/// operation while the engine runs. A transfer's dependencies are the operations
/// of its members' partners (under eager semantics, only its `RECV`s'), but its
/// own; they are read from [`Setup::partner_op`], and so are the operations that
/// wait for it (the same pairs seen from the other end: under eager semantics, its
/// `SEND`s' partners).
struct Engine<'s, 'p> {
    s: &'s Setup<'p>,
    w: Wiring,
}

impl std::ops::Deref for Engine<'_, '_> {
    type Target = Wiring;
    fn deref(&self) -> &Wiring {
        &self.w
    }
}

impl std::ops::DerefMut for Engine<'_, '_> {
    fn deref_mut(&mut self) -> &mut Wiring {
        &mut self.w
    }
}

/// The engine's tables of a resolved program ([`Engine`]), owning nothing of it:
/// a run kept for its report keeps them ([`Kept`]).
#[derive(Debug)]
struct Wiring {
    /// Per rank, the id of its first operation; one more entry, their number.
    rank_ops: Vec<u32>,
    /// Per rank, the index of its first member; one more entry, their number.
    rank_members: Vec<u32>,
    /// Number of dependencies not yet reached, plus one per dependency that does
    /// not exist at all (those never resolve).
    pending: Vec<u32>,
    /// A collective's dependencies (its occurrence on every other rank of its
    /// group), and the collectives that wait for each.
    coll_deps: BTreeMap<u32, Vec<u32>>,
    coll_waiters: BTreeMap<u32, Vec<u32>>,
    /// Operation ids of every occurrence of a collective identity on a rank.
    coll_occ: BTreeMap<(u32, u32), Vec<u32>>,
}

/// Per-action buffers of the memory walk, kept across ranks.
#[derive(Default)]
struct Scratch {
    delta: Vec<f64>,
    at_start: Vec<bool>,
}

/// The end of the operation that starts at action `lo` of `acts` (a member): the
/// batch's members follow it.
fn op_end(acts: &[RAct], lo: usize) -> usize {
    let mut hi = lo + 1;
    while hi < acts.len() && acts[hi].joins() {
        hi += 1;
    }
    hi
}

/// Completion time of a transfer operation reached at `rx`, its actions `acts`
/// and their partners' operations `partners`, all of whose dependencies are
/// reached (at `reach`); `transfer` per unit and `eager` as in [`Setup`]. Every
/// member of a batch is a transfer (a batch is a run of them).
#[inline(always)]
fn p2p_completion(
    acts: &[RAct],
    partners: &[u32],
    transfer: &[f64],
    eager: bool,
    rx: f64,
    reach: &[f64],
) -> f64 {
    let mut done = rx;
    for (a, &y) in acts.iter().zip(partners) {
        let tr = transfer[a.unit() as usize];
        let rp = if y == NONE { rx } else { reach[y as usize] };
        let end = if !eager {
            later(rx, rp) + tr
        } else if a.is_recv() {
            later(rx, rp + tr)
        } else {
            rx
        };
        done = later(done, end);
    }
    done
}

/// The transfer operation that starts at action `lo` of `acts` (a member), under
/// eager semantics where `EAGER`: its end ([`op_end`]) and its completion
/// ([`p2p_completion`], reached at `rx`), found in one walk of its members;
/// `partners` are the partners' operations of the members from `lo`'s on.
#[inline(always)]
fn p2p_op<const EAGER: bool>(
    acts: &[RAct],
    lo: usize,
    partners: &[u32],
    transfer: &[f64],
    rx: f64,
    reach: &[f64],
) -> (usize, f64) {
    let mut done = rx;
    let mut k = lo;
    loop {
        let (a, y) = (acts[k], partners[k - lo]);
        let tr = transfer[a.unit() as usize];
        let rp = if y == NONE { rx } else { reach[y as usize] };
        let end = if !EAGER {
            later(rx, rp) + tr
        } else if a.is_recv() {
            later(rx, rp + tr)
        } else {
            rx
        };
        done = later(done, end);
        k += 1;
        if !acts.get(k).is_some_and(|b| b.joins()) {
            break;
        }
    }
    (k, done)
}

/// The later of two times of a run: [`f64::max`] of them, without its care for a
/// NaN (a run's times are sums of finite costs and transfers, none negative, from
/// 0: never a NaN, nor `-0.0`, so the plain comparison gives the same bits).
#[inline(always)]
fn later(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Where every rank stopped in a deadlocked run, for [`Engine::explain`].
struct BlockedAt<'a> {
    pc: &'a [usize],
    member_at: &'a [u32],
    reached: &'a [bool],
    /// Every member's partner member, [`NONE`] if it has none.
    partner: &'a [u32],
}

/// One end of a matched transfer: its member index and operation (see [`Engine`]).
type End = (u32, u32);

/// What [`Engine::execute`] measured: every rank's intervals, busy compute time and
/// finishing time, and the time every operation was reached.
type Run = (Vec<Vec<Slot>>, Vec<f64>, Vec<f64>, Vec<f64>);

impl<'s, 'p> Engine<'s, 'p> {
    /// The engine of `s`, which it runs once (it takes `s`'s [`Setup::pending`]).
    fn new(s: &'s mut Setup<'p>) -> Result<Engine<'s, 'p>, SimError> {
        // A transfer waits for each of its members' partners to be reached (under
        // eager semantics, its `RECV`s'), but its own; forever for a member with no
        // partner: counted as resolution paired them.
        let mut pending = std::mem::take(&mut s.pending);
        let s: &'s Setup<'p> = s;
        let Ops {
            rank_ops,
            rank_members,
            colls,
            ..
        } = &s.ops;

        let mut coll_occ: BTreeMap<(u32, u32), Vec<u32>> = BTreeMap::new();
        for (&(r, _, x), (_, &(id, _))) in colls.iter().zip(&s.coll_of) {
            coll_occ.entry((id, r)).or_default().push(x);
        }
        let mut coll_deps: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut coll_waiters: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for &(r, i, x) in colls {
            let Some(&(id, k)) = s.coll_of.get(&(r, i)) else {
                continue;
            };
            let mut deps = Vec::new();
            for &g in &s.coll_ids[id as usize].3 {
                if g == r as usize {
                    continue;
                }
                let occ = coll_occ.get(&(id, g as u32));
                if let Some(&y) = occ.and_then(|v| v.get(k as usize)) {
                    deps.push(y);
                    coll_waiters.entry(y).or_default().push(x);
                }
                pending[x as usize] += 1;
            }
            coll_deps.insert(x, deps);
        }
        let w = Wiring {
            rank_ops: rank_ops.clone(),
            rank_members: rank_members.clone(),
            pending,
            coll_deps,
            coll_waiters,
            coll_occ,
        };
        Ok(Engine { s, w })
    }

    /// The rank of operation `x`.
    fn rank_of(&self, x: u32) -> usize {
        self.rank_ops.partition_point(|&first| first <= x) - 1
    }

    /// Run every rank and measure the step: time, compute and memory.
    fn run(mut self) -> Result<SimReport, SimError> {
        // Nothing is over an infinite cutoff: the run goes to the end.
        let Some((slots, busy, now, _)) = self.execute::<true>(f64::INFINITY)? else {
            return Ok(SimReport::default());
        };
        Ok(self.report(slots, busy, &now))
    }

    /// Every rank's intervals in a run that reached operation `x` at `reach[x]`
    /// (every operation reached): what [`Engine::execute`] records, found in one
    /// pass over the lists (a compute action runs from where the rank is; an
    /// operation from its time reached to its completion, which depends on the
    /// times reached alone).
    fn replay(&self, reach: &[f64]) -> Vec<Vec<Slot>> {
        if self.s.mode == Mode::Eager {
            self.replay_in::<true>(reach)
        } else {
            self.replay_in::<false>(reach)
        }
    }

    /// [`Engine::replay`] under eager semantics where `EAGER` (a constant: the
    /// transfers' loop has no test of it).
    fn replay_in<const EAGER: bool>(&self, reach: &[f64]) -> Vec<Vec<Slot>> {
        let s = self.s;
        let (cost, transfer) = (&s.cost[..], &s.transfer[..]);
        let mut slots = Vec::with_capacity(s.acts.len());
        for (r, acts) in s.acts.iter().enumerate() {
            // Written in list order, each action's interval pushed once.
            let mut rank_slots = Vec::with_capacity(acts.len());
            let mut t = 0.0f64;
            let (first, last) = (self.rank_members[r], self.rank_members[r + 1]);
            // The partners' operations of the rank's members.
            let partners = &s.partner_op[first as usize..last as usize];
            let (mut x, mut m) = (self.rank_ops[r] as usize, 0);
            let mut i = 0;
            while let Some(&a) = acts.get(i) {
                let tag = a.tag();
                if tag < RAct::COLL {
                    let d = cost[a.unit() as usize][tag as usize];
                    rank_slots.push(Slot {
                        start: t,
                        end: t + d,
                    });
                    t += d;
                    i += 1;
                    continue;
                }
                let rx = reach[x];
                // As `Engine::execute` completes it.
                let (hi, done) = if tag == RAct::COLL {
                    let hi = op_end(acts, i);
                    (hi, self.completion(r, x, i..hi, first as usize + m, reach))
                } else {
                    p2p_op::<EAGER>(acts, i, &partners[m..], transfer, rx, reach)
                };
                let slot = Slot {
                    start: rx,
                    end: done,
                };
                for _ in i..hi {
                    rank_slots.push(slot);
                }
                t = done;
                m += hi - i;
                i = hi;
                x += 1;
            }
            slots.push(rank_slots);
        }
        slots
    }

    /// The report of a run ([`Engine::execute`], recorded) whose ranks' intervals
    /// are `slots`, busy compute times `busy` and finishing times `now`: time,
    /// compute and memory.
    fn report(&self, slots: Vec<Vec<Slot>>, busy: Vec<f64>, now: &[f64]) -> SimReport {
        let nr = now.len();
        let makespan = now.iter().copied().fold(0.0, f64::max);
        let total: f64 = busy.iter().sum();
        let bubble = if makespan > 0.0 && nr > 0 {
            1.0 - total / (nr as f64 * makespan)
        } else {
            0.0
        };
        let (mut table, mut scratch) = (Vec::new(), Scratch::default());
        let peak_memory = (0..nr)
            .map(|r| self.peak(r, &slots[r], &mut table, &mut scratch))
            .collect();
        SimReport {
            makespan,
            bubble,
            peak_memory,
            compute: busy,
            timeline: Timeline { ranks: slots },
        }
    }

    /// Run every rank: each action's interval (when `RECORD`, else every rank's
    /// list of intervals is empty: 16 bytes an action a search judging trials by
    /// their finishing times does not need), each rank's busy compute time and its
    /// finishing time (the end of its last interval, 0 for an empty list). `None`
    /// once some rank provably finishes later than a finite `cutoff` by more than the
    /// tolerance ([`finish_times_within`]). `RECORD` is a constant, so the searches'
    /// runs, which record nothing, have a loop of their own without its tests.
    fn execute<const RECORD: bool>(&mut self, cutoff: f64) -> Result<Option<Run>, SimError> {
        if self.s.mode == Mode::Eager {
            self.execute_in::<RECORD, true>(cutoff)
        } else {
            self.execute_in::<RECORD, false>(cutoff)
        }
    }

    /// [`Engine::execute`] under eager semantics where `EAGER` (a constant, as
    /// `RECORD`: the transfers' loops have no test of it).
    ///
    /// A transfer operation is walked once where it is reached with nothing left
    /// to wait for (its own count is final then: only other operations' members
    /// lower it): that walk finds its end, releases those waiting for it and
    /// completes it ([`p2p_completion`]'s expressions, in its order). One that
    /// waits is walked to find its end and release, then again when its rank
    /// resumes ([`p2p_op`]).
    fn execute_in<const RECORD: bool, const EAGER: bool>(
        &mut self,
        cutoff: f64,
    ) -> Result<Option<Run>, SimError> {
        let s = self.s;
        let nr = s.acts.len();
        let nops = self.pending.len();
        // Each rank's compute not yet run, kept only against a finite cutoff: the
        // rank finishes no earlier than its time plus this.
        let bounded = cutoff.is_finite();
        let mut left: Vec<f64> = if bounded {
            s.acts
                .iter()
                .map(|acts| {
                    acts.iter()
                        .map(|a| {
                            a.compute_op()
                                .map_or(0.0, |op| s.cost[a.unit() as usize][op])
                        })
                        .sum()
                })
                .collect()
        } else {
            Vec::new()
        };

        let mut slots: Vec<Vec<Slot>> = s
            .acts
            .iter()
            .map(|l| vec![Slot::default(); if RECORD { l.len() } else { 0 }])
            .collect();
        let mut busy = vec![0.0f64; nr];
        let mut pc = vec![0usize; nr];
        let mut now = vec![0.0f64; nr];
        // Each rank's next operation and member.
        let mut op_at: Vec<u32> = self.rank_ops[..nr].to_vec();
        let mut member_at: Vec<u32> = self.rank_members[..nr].to_vec();
        let mut reached = vec![false; nops];
        let mut reach = vec![0.0f64; nops];
        let mut pending = std::mem::take(&mut self.pending);
        let mut stack: Vec<u32> = (0..nr as u32).rev().collect();
        // Every rank's members' peers and each rank's first member, where the source
        // keeps them (a lowering taken apart): a partner's rank is read there, not
        // searched for.
        let peers = match &s.src {
            Src::Taken(t, _) => Some((&t.peers, &t.first_member)),
            _ => None,
        };
        // The tables read per action, as slices held here.
        let (cost, partner_op, transfer) = (&s.cost[..], &s.partner_op[..], &s.transfer[..]);

        while let Some(r) = stack.pop() {
            let r = r as usize;
            let acts = &s.acts[r][..];
            let rank_slots = &mut slots[r];
            // The rank's members' peers, from its first member on (where kept).
            let rank_peers = peers.map(|(p, first)| (&p[r][..], first[r]));
            let (mut i, mut t) = (pc[r], now[r]);
            let (mut x, mut m) = (op_at[r] as usize, member_at[r] as usize);
            // The rank's busy time and compute left, held here while it runs (the
            // same sums in the same order).
            let mut busy_r = busy[r];
            let mut left_r = if bounded { left[r] } else { 0.0 };
            while let Some(&a) = acts.get(i) {
                let tag = a.tag();
                if tag < RAct::COLL {
                    let d = cost[a.unit() as usize][tag as usize];
                    if RECORD {
                        rank_slots[i] = Slot {
                            start: t,
                            end: t + d,
                        };
                    }
                    t += d;
                    busy_r += d;
                    if bounded {
                        left_r -= d;
                    }
                    i += 1;
                    continue;
                }
                let (hi, done) = if tag == RAct::COLL {
                    let hi = op_end(acts, i);
                    if !reached[x] {
                        reached[x] = true;
                        reach[x] = t;
                        // Those waiting for `x` to be reached: the collectives.
                        if let Some(waiters) = self.coll_waiters.get(&(x as u32)) {
                            for &y in waiters {
                                let y = y as usize;
                                pending[y] -= 1;
                                if pending[y] == 0 && reached[y] && y != x {
                                    stack.push(self.rank_of(y as u32) as u32);
                                }
                            }
                        }
                    }
                    if pending[x] > 0 {
                        break;
                    }
                    (hi, self.completion(r, x, i..hi, m, &reach))
                } else if !reached[x] {
                    reached[x] = true;
                    reach[x] = t;
                    // Those waiting for `x` to be reached: the partners' operations
                    // (under eager semantics, its `SEND`s'), pushed in list order;
                    // where `x` waits for none, completed in the same walk.
                    let ready = pending[x] == 0;
                    let rx = t;
                    let mut done = rx;
                    let mut k = i;
                    loop {
                        let (b, y) = (acts[k], partner_op[m + (k - i)]);
                        let recv = b.is_recv();
                        if y != NONE && y as usize != x && !(EAGER && recv) {
                            let yu = y as usize;
                            pending[yu] -= 1;
                            if pending[yu] == 0 && reached[yu] {
                                // A partner's operation is on the transfer's peer.
                                stack.push(match rank_peers {
                                    Some((p, first)) => p[m + (k - i) - first],
                                    None => self.rank_of(y) as u32,
                                });
                            }
                        }
                        if ready {
                            let tr = transfer[b.unit() as usize];
                            let rp = if y == NONE { rx } else { reach[y as usize] };
                            let end = if !EAGER {
                                later(rx, rp) + tr
                            } else if recv {
                                later(rx, rp + tr)
                            } else {
                                rx
                            };
                            done = later(done, end);
                        }
                        k += 1;
                        if !acts.get(k).is_some_and(|b| b.joins()) {
                            break;
                        }
                    }
                    if !ready {
                        break;
                    }
                    (k, done)
                } else {
                    if pending[x] > 0 {
                        break;
                    }
                    p2p_op::<EAGER>(acts, i, &partner_op[m..], transfer, reach[x], &reach)
                };
                if RECORD {
                    rank_slots[i..hi].fill(Slot {
                        start: reach[x],
                        end: done,
                    });
                }
                t = done;
                m += hi - i;
                i = hi;
                x += 1;
                // (Less by more than the tolerance is less, or a NaN: the plain
                // comparison first, the tolerance's only where it can hold.)
                let over = t + left_r;
                if bounded
                    && (cutoff < over || over.is_nan())
                    && crate::ir::compare::less(cutoff, over)
                {
                    return Ok(None);
                }
            }
            busy[r] = busy_r;
            if bounded {
                left[r] = left_r;
            }
            pc[r] = i;
            now[r] = t;
            op_at[r] = x as u32;
            member_at[r] = m as u32;
        }

        let blocked: Vec<usize> = (0..nr).filter(|&r| pc[r] < s.acts[r].len()).collect();
        if !blocked.is_empty() {
            // Only the words of the error need the partners by member.
            let mut partner = vec![NONE; s.partner_op.len()];
            match_p2p(s, |send, recv| {
                partner[send.0 as usize] = recv.0;
                partner[recv.0 as usize] = send.0;
            });
            let at = BlockedAt {
                pc: &pc,
                member_at: &member_at,
                reached: &reached,
                partner: &partner,
            };
            return Err(SimError::Deadlock {
                blocked: blocked.iter().map(|&r| self.explain(r, &at)).collect(),
            });
        }
        Ok(Some((slots, busy, now, reach)))
    }

    /// Completion time of operation `x` of rank `r`, its actions `ops` and its
    /// first member `m`, all of whose dependencies are reached.
    #[inline(always)]
    fn completion(
        &self,
        r: usize,
        x: usize,
        ops: std::ops::Range<usize>,
        m: usize,
        reach: &[f64],
    ) -> f64 {
        let s = self.s;
        let lo = ops.start;
        let rx = reach[x];
        let mut done = rx;
        let acts = &s.acts[r][ops];
        let first = acts[0];
        if first.p2p_dir().is_some() {
            let partners = &s.partner_op[m..m + acts.len()];
            let eager = s.mode == Mode::Eager;
            done = p2p_completion(acts, partners, &s.transfer, eager, rx, reach);
        } else if first.is_coll() {
            for &y in self.coll_deps.get(&(x as u32)).into_iter().flatten() {
                done = done.max(reach[y as usize]);
            }
            if let (Some(c), Some(&(id, _))) = (s.comm, s.coll_of.get(&(r as u32, lo as u32))) {
                let unit = s.coll_ids[id as usize].1;
                done += c.transfer_time(s.params[unit as usize]);
            }
        }
        done
    }

    /// The index in its rank's list of member `m` of rank `r`.
    fn member_index(&self, r: usize, m: u32) -> usize {
        let mut k = self.rank_members[r];
        for (i, a) in self.s.acts[r].iter().enumerate() {
            if !a.is_compute() {
                if k == m {
                    return i;
                }
                k += 1;
            }
        }
        self.s.acts[r].len()
    }

    /// The index in its rank's list of the first action of operation `x` of rank
    /// `r`.
    fn op_index_in(&self, r: usize, x: u32) -> usize {
        let mut k = self.rank_ops[r];
        for (i, a) in self.s.acts[r].iter().enumerate() {
            if !a.is_compute() && !a.joins() {
                if k == x {
                    return i;
                }
                k += 1;
            }
        }
        self.s.acts[r].len()
    }

    /// Describe what rank `r`, blocked at action `at.pc[r]`, waits for.
    fn explain(&self, r: usize, at: &BlockedAt<'_>) -> Blocked {
        let s = self.s;
        let pc = at.pc;
        let lo = pc[r];
        let hi = op_end(&s.acts[r], lo);
        let m = at.member_at[r] as usize;
        let mut index = lo;
        let mut waits: Vec<String> = Vec::new();
        // Where rank `q` is stuck, in words.
        let stuck = |q: usize| -> String {
            match s.action(q, pc[q]) {
                None => format!("rank {q} has finished its list"),
                Some(a) => format!("rank {q} is stuck at action {} `{a}`", pc[q]),
            }
        };
        match s.acts[r][lo].kind() {
            Kind::Compute(_) => {}
            Kind::P2p { .. } => {
                for i in lo..hi {
                    let a = s.acts[r][i];
                    let Kind::P2p { dir, tensor, .. } = a.kind() else {
                        continue;
                    };
                    if s.mode == Mode::Eager && dir == Dir::Send {
                        continue;
                    }
                    let mb = a.mb();
                    let member = m + (i - lo);
                    let q = s.peer(r, i, member) as usize;
                    let action = s.action(r, i);
                    let unit = action.as_ref().map_or("?", Action::unit);
                    let (other, arrow) = match dir {
                        Dir::Send => ("RECV", "<-"),
                        Dir::Recv => ("SEND", "->"),
                    };
                    let want = format!("{other} {}({unit},{mb}){arrow}{r}", tensor.as_str());
                    let text = if at.partner[member] == NONE {
                        Some(format!(
                            "{want} on rank {q}, but rank {q} has no such action left to \
                             pair with it (add it there, or remove this one)"
                        ))
                    } else {
                        let y = self.s.partner_op[member] as usize;
                        (!at.reached[y]).then(|| {
                            let j = self.member_index(q, at.partner[member]);
                            format!(
                                "{want} (rank {q}, action {j}), which is never reached: {}",
                                stuck(q)
                            )
                        })
                    };
                    if let Some(t) = text {
                        if waits.is_empty() {
                            index = i;
                        }
                        waits.push(t);
                    }
                }
            }
            Kind::Coll => {
                if let Some(&(id, k)) = s.coll_of.get(&(r as u32, lo as u32)) {
                    let what = s.text(r, lo);
                    for &g in &s.coll_ids[id as usize].3 {
                        if g == r {
                            continue;
                        }
                        let occ = self.coll_occ.get(&(id, g as u32));
                        match occ.and_then(|v| v.get(k as usize)) {
                            None => {
                                let have = occ.map_or(0, Vec::len);
                                waits.push(format!(
                                    "`{what}` on rank {g}, but rank {g} lists this collective \
                                     {have} time(s) and this is occurrence {} here (add it to \
                                     rank {g}'s list)",
                                    k + 1
                                ));
                            }
                            Some(&y) if !at.reached[y as usize] => {
                                let j = self.op_index_in(g, y);
                                waits.push(format!(
                                    "`{what}` on rank {g} (action {j}), which is never reached: {}",
                                    stuck(g)
                                ));
                            }
                            Some(_) => {}
                        }
                    }
                }
            }
        }
        if waits.is_empty() {
            waits.push("nothing (internal inconsistency; please report)".to_string());
        }
        Blocked {
            rank: r,
            index,
            action: s.text(r, index),
            waiting_for: waits.join("; and "),
        }
    }

    /// Peak activation memory of rank `r`, given its timeline.
    /// The largest level of [`Setup::memory_steps`], without building the steps:
    /// a level counts once no later change shares its time.
    fn peak(
        &self,
        r: usize,
        slots: &[Slot],
        table: &mut Vec<[u32; 3]>,
        scratch: &mut Scratch,
    ) -> f64 {
        let mut peak = 0.0f64;
        let mut pending: Option<(f64, f64)> = None;
        self.s.memory_changes(r, slots, table, scratch, |t, level| {
            if let Some((at, held)) = pending {
                if at != t {
                    peak = peak.max(held);
                }
            }
            pending = Some((t, level));
        });
        pending.map_or(peak, |(_, held)| peak.max(held))
    }
}

/// A transfer end: its channel key, member index and operation (see [`Engine`]).
type Entry = (u64, u32, u32);

/// One channel's ends, each side in list order.
#[derive(Default)]
struct Chan {
    sends: Vec<Entry>,
    recvs: Vec<Entry>,
}

/// Every `SEND` and `RECV` of a program by channel `(source, destination)`, added
/// as they are read in list order, rank by rank, then paired ([`Channels::pair`]).
struct Channels {
    /// Channels in first-seen order, found by a look-up-only hash map (each channel
    /// pairs its own actions, so the order they are paired in does not matter).
    chans: Vec<Chan>,
    chan_of: HashMap<(u32, u32), usize, BuildHasherDefault<Fnv>>,
    /// Where a table of ranks x ranks cells is no larger than the program, channels
    /// are found there by `(source, destination)` instead (no hashing per action).
    table: Vec<u32>,
    nr: usize,
}

impl Channels {
    /// For a program of `nr` ranks and `actions` actions.
    fn new(nr: usize, actions: usize) -> Channels {
        let table = if nr.checked_mul(nr).is_some_and(|c| c <= actions) {
            vec![NONE; nr * nr]
        } else {
            Vec::new()
        };
        Channels {
            chans: Vec::new(),
            chan_of: HashMap::default(),
            table,
            nr,
        }
    }

    /// A transfer end read on rank `rank`, to or from `peer`: `key` its channel
    /// key ((unit * microbatches + mb) * 3 + tensor), `member` and `op` its member
    /// index and operation.
    #[inline(always)]
    fn add(&mut self, rank: u32, peer: u32, dir: Dir, key: u64, member: u32, op: u32) {
        let ends = dir.ends(rank, peer);
        let c = if self.table.is_empty() {
            let chans = &mut self.chans;
            *self.chan_of.entry(ends).or_insert_with(|| {
                chans.push(Chan::default());
                chans.len() - 1
            })
        } else {
            let cell = &mut self.table[ends.0 as usize * self.nr + ends.1 as usize];
            if *cell == NONE {
                *cell = self.chans.len() as u32;
                self.chans.push(Chan::default());
            }
            *cell as usize
        };
        let chan = &mut self.chans[c];
        let entry = (key, member, op);
        match dir {
            Dir::Send => chan.sends.push(entry),
            Dir::Recv => chan.recvs.push(entry),
        }
    }

    /// Pair every `SEND` with its `RECV`: the k-th `SEND(t,u,m)` from `a` to `b`
    /// with the k-th `RECV(t,u,m)` from `a` on `b`, each pair given to `pair` as its
    /// two ends (`SEND`'s first). Linear when both sides list a channel's transfers
    /// in the same order (the valid case); sorting otherwise. Each channel's ends
    /// are freed once paired.
    fn pair(self, mut pair: impl FnMut(End, End)) {
        let Channels { mut chans, .. } = self;
        let end = |e: &Entry| (e.1, e.2);
        for chan in &mut chans {
            let n = chan.sends.len().min(chan.recvs.len());
            let mut k = 0;
            while k < n && chan.sends[k].0 == chan.recvs[k].0 {
                pair(end(&chan.sends[k]), end(&chan.recvs[k]));
                k += 1;
            }
            if k < chan.sends.len() && k < chan.recvs.len() {
                // The matched prefix holds each key equally often on both sides, so
                // the remaining occurrences still pair k-th with k-th (members follow
                // list order on a rank, as the sort needs).
                let sends = &mut chan.sends[k..];
                let recvs = &mut chan.recvs[k..];
                sends.sort_unstable();
                recvs.sort_unstable();
                let (mut i, mut j) = (0, 0);
                while i < sends.len() && j < recvs.len() {
                    match sends[i].0.cmp(&recvs[j].0) {
                        std::cmp::Ordering::Less => i += 1,
                        std::cmp::Ordering::Greater => j += 1,
                        std::cmp::Ordering::Equal => {
                            pair(end(&sends[i]), end(&recvs[j]));
                            i += 1;
                            j += 1;
                        }
                    }
                }
            }
            *chan = Chan::default();
        }
    }
}

/// [`Channels::pair`] of `s`'s transfers, read again from its resolved actions and
/// their source's peers (only the words of a deadlock need this: resolution paired
/// them already, by operation).
fn match_p2p(s: &Setup<'_>, pair: impl FnMut(End, End)) {
    let mut channels = Channels::new(s.acts.len(), s.actions);
    // The member and operation counts so far (see [`Engine`]).
    let (mut m, mut x) = (0u32, 0u32);
    for (r, list) in s.acts.iter().enumerate() {
        for (i, a) in list.iter().enumerate() {
            if a.is_compute() {
                continue;
            }
            if !a.joins() {
                x += 1;
            }
            m += 1;
            let Some((dir, tensor)) = a.p2p_dir() else {
                continue;
            };
            let key = s.key(a.unit(), a.mb()) * 3 + tensor;
            let peer = s.peer(r, i, m as usize - 1);
            channels.add(r as u32, peer, dir, key, m - 1, x - 1);
        }
    }
    channels.pair(pair);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ir::program::{Cost, Unit};

    /// `"F a 0; SEND act a 0 1 [batch]; BCAST a root g1,g2"` -> actions.
    pub(crate) fn acts(s: &str) -> Vec<Action> {
        s.split(';')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                let w: Vec<&str> = t.split_whitespace().collect();
                let n = |k: usize| w[k].parse::<usize>().unwrap();
                let op = match w[0] {
                    "F" => Some(Op::F),
                    "B" => Some(Op::B),
                    "W" => Some(Op::W),
                    "BW" => Some(Op::BW),
                    "RF" => Some(Op::RF),
                    _ => None,
                };
                if let Some(op) = op {
                    return Action::compute(op, w[1], n(2));
                }
                match w[0] {
                    "SEND" | "RECV" => {
                        let dir = if w[0] == "SEND" { Dir::Send } else { Dir::Recv };
                        let tensor = match w[1] {
                            "act" => Tensor::Act,
                            "grad" => Tensor::Grad,
                            _ => Tensor::Input,
                        };
                        let batch = w.get(5).map(|b| b.parse().unwrap());
                        Action::p2p(dir, tensor, w[2], n(3), n(4), batch)
                    }
                    "BCAST" | "REDUCE" => {
                        let group = w[3].split(',').map(|g| g.parse().unwrap()).collect();
                        let kind = if w[0] == "BCAST" {
                            CollKind::Bcast
                        } else {
                            CollKind::Reduce
                        };
                        Action::coll(kind, w[1], n(2), group)
                    }
                    other => panic!("bad test action {other}"),
                }
            })
            .collect()
    }

    pub(crate) fn unit(
        name: &str,
        inputs: &[&str],
        home: usize,
        f: f64,
        b: f64,
        w: f64,
        act: f64,
    ) -> Unit {
        Unit {
            role: crate::ir::program::Role::of_name(name),
            name: name.into(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            home,
            trainable: true,
            cost: Cost { f, b, w },
            act,
            bytes: 0.0,
            params: 0.0,
        }
    }

    pub(crate) fn prog(microbatches: usize, units: Vec<Unit>, lists: &[&str]) -> Program {
        Program {
            format: crate::ir::program::FORMAT.into(),
            ranks: lists.len(),
            microbatches,
            units,
            programs: lists.iter().map(|l| acts(l)).collect(),
            source: None,
            prefetch: Vec::new(),
        }
    }

    fn two_units() -> Vec<Unit> {
        vec![
            unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
            unit("b", &["a"], 1, 5.0, 1.0, 1.0, 1.0),
        ]
    }

    fn rdv() -> SimOptions {
        SimOptions::default()
    }

    fn eager() -> SimOptions {
        SimOptions {
            mode: Mode::Eager,
            comm: None,
        }
    }

    proptest::proptest! {
        /// `later` is `f64::max` bit for bit on a run's times (finite or infinite
        /// sums of non-negative figures, zero included).
        #[test]
        fn later_is_max_on_times(
            a in proptest::prop_oneof![0.0f64..1e12, proptest::strategy::Just(0.0), proptest::strategy::Just(f64::INFINITY)],
            b in proptest::prop_oneof![0.0f64..1e12, proptest::strategy::Just(0.0), proptest::strategy::Just(f64::INFINITY)],
        ) {
            proptest::prop_assert_eq!(later(a, b).to_bits(), a.max(b).to_bits());
            proptest::prop_assert_eq!(later(b, a).to_bits(), b.max(a).to_bits());
        }
    }

    #[test]
    fn compute_only() {
        let p = prog(2, two_units(), &["F a 0; F a 1; B a 1; W a 1", "F b 0"]);
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(r.makespan, 5.0);
        assert_eq!(r.compute, vec![4.0, 5.0]);
        assert!((r.bubble - (1.0 - 9.0 / 10.0)).abs() < 1e-12);
        assert_eq!(
            r.timeline.ranks[0][2],
            Slot {
                start: 2.0,
                end: 3.0
            }
        );
        assert_eq!(r.timeline.makespan(), 5.0);
    }

    #[test]
    fn empty_program() {
        let p = prog(1, vec![], &["", ""]);
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(r.makespan, 0.0);
        assert_eq!(r.bubble, 0.0);
        assert_eq!(r.peak_memory, vec![0.0, 0.0]);
    }

    /// Rank 0 posts a SEND long before rank 1 is ready to receive.
    #[test]
    fn rendezvous_waits_eager_does_not() {
        let p = prog(
            2,
            two_units(),
            &["F a 0; SEND act a 0 1; F a 1", "F b 1; RECV act a 0 0"],
        );
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(
            r.timeline.ranks[0][1],
            Slot {
                start: 1.0,
                end: 5.0
            }
        );
        assert_eq!(
            r.timeline.ranks[1][1],
            Slot {
                start: 5.0,
                end: 5.0
            }
        );
        assert_eq!(r.makespan, 6.0);
        let e = simulate(&p, &eager()).unwrap();
        assert_eq!(
            e.timeline.ranks[0][1],
            Slot {
                start: 1.0,
                end: 1.0
            }
        );
        assert_eq!(
            e.timeline.ranks[0][2],
            Slot {
                start: 1.0,
                end: 2.0
            }
        );
        assert_eq!(e.makespan, 5.0);
    }

    /// Eager RECV waits for its SEND to be reached.
    #[test]
    fn eager_recv_waits_for_send() {
        let p = prog(
            1,
            two_units(),
            &["F a 0; F a 0; SEND act a 0 1", "RECV act a 0 0"],
        );
        let e = simulate(&p, &eager()).unwrap();
        assert_eq!(
            e.timeline.ranks[1][0],
            Slot {
                start: 0.0,
                end: 2.0
            }
        );
        assert_eq!(
            e.timeline.ranks[0][2],
            Slot {
                start: 2.0,
                end: 2.0
            }
        );
    }

    #[test]
    fn crossing_sends_deadlock_unless_batched_or_eager() {
        let lists = [
            "SEND act a 0 1; RECV act b 0 1",
            "SEND act b 0 0; RECV act a 0 0",
        ];
        let p = prog(1, two_units(), &lists);
        let Err(SimError::Deadlock { blocked }) = simulate(&p, &rdv()) else {
            panic!("expected a deadlock");
        };
        assert_eq!(blocked.len(), 2);
        assert_eq!((blocked[0].rank, blocked[0].index), (0, 0));
        assert_eq!(blocked[0].action, "SEND act(a,0)->1");
        assert!(
            blocked[0].waiting_for.contains("RECV act(a,0)<-0")
                && blocked[0]
                    .waiting_for
                    .contains("stuck at action 0 `SEND act(b,0)->0`"),
            "{}",
            blocked[0].waiting_for
        );
        let text = SimError::Deadlock { blocked }.to_string();
        assert!(text.contains("2 ranks can never proceed") && text.contains("batch"));
        simulate(&p, &eager()).unwrap();
        let batched = prog(
            1,
            two_units(),
            &[
                "SEND act a 0 1 7; RECV act b 0 1 7",
                "SEND act b 0 0 3; RECV act a 0 0 3",
            ],
        );
        let r = simulate(&batched, &rdv()).unwrap();
        assert_eq!(r.makespan, 0.0);
    }

    /// A batch completes only when every member's partner is reached, and its
    /// members share the batch's interval.
    #[test]
    fn batch_waits_for_all_partners() {
        let units = vec![
            unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
            unit("b", &[], 1, 2.0, 1.0, 1.0, 1.0),
            unit("c", &[], 2, 7.0, 1.0, 1.0, 1.0),
        ];
        let p = prog(
            1,
            units,
            &[
                "F a 0; SEND act a 0 1 1; SEND act a 0 2 1",
                "F b 0; RECV act a 0 0",
                "F c 0; RECV act a 0 0",
            ],
        );
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(
            r.timeline.ranks[0][1],
            Slot {
                start: 1.0,
                end: 7.0
            }
        );
        assert_eq!(
            r.timeline.ranks[0][2],
            Slot {
                start: 1.0,
                end: 7.0
            }
        );
        // Rank 1's RECV needs only its own partner reached: that is the batch, at 1.
        assert_eq!(
            r.timeline.ranks[1][1],
            Slot {
                start: 2.0,
                end: 2.0
            }
        );
        assert_eq!(r.makespan, 7.0);
    }

    /// Equal batch numbers separated by another action are two batches.
    #[test]
    fn batch_is_consecutive_only() {
        let split = prog(
            1,
            two_units(),
            &[
                "SEND act a 0 1 1; F a 0; RECV act b 0 1 1",
                "SEND act b 0 0 1; F b 0; RECV act a 0 0 1",
            ],
        );
        assert!(matches!(
            simulate(&split, &rdv()),
            Err(SimError::Deadlock { .. })
        ));
        let joined = prog(
            1,
            two_units(),
            &[
                "F a 0; SEND act a 0 1 1; RECV act b 0 1 1",
                "F b 0; SEND act b 0 0 1; RECV act a 0 0 1",
            ],
        );
        assert_eq!(simulate(&joined, &rdv()).unwrap().makespan, 5.0);
    }

    #[test]
    fn comm_model_costs_transfers_and_collectives() {
        let mut units = two_units();
        units[0].bytes = 4.0;
        units[0].params = 8.0;
        let p = prog(
            1,
            units,
            &[
                "F a 0; SEND act a 0 1; BCAST a 0 0,1",
                "RECV act a 0 0; BCAST a 0 0,1",
            ],
        );
        let comm = Some(CommModel {
            latency: 1.0,
            bandwidth: 2.0,
        });
        let r = simulate(
            &p,
            &SimOptions {
                mode: Mode::Rendezvous,
                comm,
            },
        )
        .unwrap();
        // Transfer: max(1, 0) + 1 + 4/2 = 4; collective: 4 + 1 + 8/2 = 9.
        assert_eq!(
            r.timeline.ranks[1][0],
            Slot {
                start: 0.0,
                end: 4.0
            }
        );
        assert_eq!(
            r.timeline.ranks[0][1],
            Slot {
                start: 1.0,
                end: 4.0
            }
        );
        assert_eq!(
            r.timeline.ranks[0][2],
            Slot {
                start: 4.0,
                end: 9.0
            }
        );
        assert_eq!(r.makespan, 9.0);
        let e = simulate(
            &p,
            &SimOptions {
                mode: Mode::Eager,
                comm,
            },
        )
        .unwrap();
        assert_eq!(
            e.timeline.ranks[0][1],
            Slot {
                start: 1.0,
                end: 1.0
            }
        );
        assert_eq!(
            e.timeline.ranks[1][0],
            Slot {
                start: 0.0,
                end: 4.0
            }
        );
        assert_eq!(e.makespan, 9.0);
    }

    /// In a batch, each member's transfer starts when both of its sides are reached.
    #[test]
    fn comm_model_per_member_in_batch() {
        let mut units = vec![
            unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
            unit("b", &[], 1, 2.0, 1.0, 1.0, 1.0),
            unit("c", &[], 2, 3.0, 1.0, 1.0, 1.0),
        ];
        units[0].bytes = 10.0;
        let p = prog(
            1,
            units,
            &[
                "SEND act a 0 1 1; SEND act a 0 2 1",
                "F b 0; RECV act a 0 0",
                "F c 0; RECV act a 0 0",
            ],
        );
        let comm = Some(CommModel {
            latency: 0.0,
            bandwidth: 1.0,
        });
        let r = simulate(
            &p,
            &SimOptions {
                mode: Mode::Rendezvous,
                comm,
            },
        )
        .unwrap();
        // max(2 + 10, 3 + 10) = 13.
        assert_eq!(r.timeline.ranks[0][0].end, 13.0);
        assert_eq!(r.timeline.ranks[1][1].end, 12.0);
    }

    #[test]
    fn collective_waits_for_every_member() {
        let p = prog(
            1,
            two_units(),
            &["BCAST a 0 0,1; F a 0", "F b 0; BCAST a 0 0,1"],
        );
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(
            r.timeline.ranks[0][0],
            Slot {
                start: 0.0,
                end: 5.0
            }
        );
        assert_eq!(r.makespan, 6.0);
        // Same under eager.
        assert_eq!(simulate(&p, &eager()).unwrap().makespan, 6.0);
        // A member without the collective: deadlock, explained.
        let q = prog(1, two_units(), &["BCAST a 0 0,1", "F b 0"]);
        let Err(SimError::Deadlock { blocked }) = simulate(&q, &rdv()) else {
            panic!("expected a deadlock");
        };
        assert_eq!(blocked.len(), 1);
        assert!(blocked[0]
            .waiting_for
            .contains("lists this collective 0 time(s)"));
        // Disjoint groups on one unit do not wait for each other.
        let d = prog(
            1,
            two_units(),
            &[
                "BCAST a 0 0,1; BCAST a 0 0,2",
                "BCAST a 0 0,1",
                "BCAST a 0 0,2",
            ],
        );
        simulate(&d, &rdv()).unwrap();
    }

    #[test]
    fn kth_send_pairs_with_kth_recv() {
        let p = prog(
            1,
            two_units(),
            &[
                "SEND act a 0 1; F a 0; SEND act a 0 1",
                "F b 0; RECV act a 0 0; RECV act a 0 0",
            ],
        );
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(
            r.timeline.ranks[0][0],
            Slot {
                start: 0.0,
                end: 5.0
            }
        );
        assert_eq!(
            r.timeline.ranks[1][2],
            Slot {
                start: 5.0,
                end: 6.0
            }
        );
    }

    #[test]
    fn unmatched_recv_is_a_deadlock_in_both_modes() {
        let p = prog(1, two_units(), &["", "RECV grad b 0 0"]);
        for opts in [rdv(), eager()] {
            let Err(SimError::Deadlock { blocked }) = simulate(&p, &opts) else {
                panic!("expected a deadlock");
            };
            assert!(blocked[0].waiting_for.contains("no such action"));
        }
        // An unmatched SEND only deadlocks under rendezvous.
        let q = prog(1, two_units(), &["SEND act a 0 1", ""]);
        assert!(simulate(&q, &rdv()).is_err());
        simulate(&q, &eager()).unwrap();
    }

    #[test]
    fn self_transfer_in_one_batch_runs() {
        let p = prog(1, two_units(), &["SEND act a 0 0 1; RECV act a 0 0 1", ""]);
        simulate(&p, &rdv()).unwrap();
        let q = prog(1, two_units(), &["SEND act a 0 0; RECV act a 0 0", ""]);
        assert!(simulate(&q, &rdv()).is_err());
        simulate(&q, &eager()).unwrap();
    }

    proptest::proptest! {
        /// The table's two passes give every rank's memory changes exactly as the
        /// full path (the sort by (unit, mb), then the walk of the deltas), bit for
        /// bit, rank after rank with one table (emptied again between them).
        #[test]
        fn memory_changes_by_table_are_the_sorted_ones(
            lists in proptest::collection::vec(
                proptest::collection::vec((0usize..6, 0usize..3, 0usize..3, 0u8..3, 0u8..3), 0..40),
                1..4,
            ),
            acts in proptest::collection::vec(
                proptest::prop_oneof![proptest::strategy::Just(0.0f64), 0.5f64..4.0], 3,
            ),
        ) {
            const OPS: [&str; 5] = ["F", "B", "W", "BW", "RF"];
            let names = ["a", "b", "c"];
            let units: Vec<Unit> = names
                .iter()
                .zip(&acts)
                .map(|(n, &act)| unit(n, &[], 0, 1.0, 1.0, 1.0, act))
                .collect();
            let texts: Vec<String> = lists
                .iter()
                .map(|list| {
                    let each = list.iter().map(|&(op, u, mb, ..)| match OPS.get(op) {
                        Some(op) => format!("{op} {} {mb}", names[u]),
                        None => format!("SEND act {} {mb} 0", names[u]),
                    });
                    each.collect::<Vec<_>>().join("; ")
                })
                .collect();
            let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
            let p = prog(3, units, &texts);
            let setup = Setup::new(&p, &SimOptions::default(), false).unwrap();
            let mut table = Vec::new();
            for (r, list) in lists.iter().enumerate() {
                // Times that only grow, with ties and empty intervals.
                let mut t = 0.0;
                let slots: Vec<Slot> = list
                    .iter()
                    .map(|&(.., gap, len)| {
                        let start = t + f64::from(gap);
                        t = start + f64::from(len);
                        Slot { start, end: t }
                    })
                    .collect();
                let acts = &setup.acts[r];
                let mut by_table = Vec::new();
                setup.changes_by_table(acts, &slots, &mut table, |t, l| {
                    by_table.push((t.to_bits(), l.to_bits()))
                });
                let (mut delta, mut at_start) = (vec![0.0; acts.len()], vec![false; acts.len()]);
                setup.hold_by_sort(acts, &mut delta, &mut at_start);
                let mut sorted = Vec::new();
                changes_in_order(&delta, &at_start, &slots, |t, l| {
                    sorted.push((t.to_bits(), l.to_bits()))
                });
                proptest::prop_assert_eq!(by_table, sorted);
            }
            proptest::prop_assert!(table.iter().all(|e| *e == [NONE; 3]));
        }
    }

    #[test]
    fn memory_half_open_release_before_acquire() {
        let u = || vec![unit("a", &[], 0, 1.0, 1.0, 0.0, 3.0)];
        let seq = prog(2, u(), &["F a 0; B a 0; F a 1; B a 1"]);
        assert_eq!(simulate(&seq, &rdv()).unwrap().peak_memory, vec![3.0]);
        let nested = prog(2, u(), &["F a 0; F a 1; B a 1; B a 0"]);
        assert_eq!(simulate(&nested, &rdv()).unwrap().peak_memory, vec![6.0]);
        // With W, the forward holds until the end of W (W costs 0 here, still last).
        let with_w = prog(2, u(), &["F a 0; B a 0; W a 0; F a 1; B a 1; W a 1"]);
        assert_eq!(simulate(&with_w, &rdv()).unwrap().peak_memory, vec![3.0]);
    }

    /// An acquisition listed before a release at the same instant still counts after
    /// it: at time 1, `a` (released by a zero-time BW) and `z` never coexist.
    #[test]
    fn memory_tie_release_listed_after_acquire() {
        let u = vec![
            unit("a", &[], 0, 1.0, 0.0, 0.0, 1.0),
            unit("z", &[], 0, 0.0, 1.0, 0.0, 1.0),
        ];
        let p = prog(1, u, &["F a 0; F z 0; BW a 0; BW z 0"]);
        assert_eq!(simulate(&p, &rdv()).unwrap().peak_memory, vec![1.0]);
    }

    #[test]
    fn memory_held_until_w() {
        let u = vec![unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0)];
        // F0 [0,1) B0 [1,2) F1 [2,3) W0 [3,4): F0 holds to 4, so both overlap.
        let p = prog(2, u, &["F a 0; B a 0; F a 1; W a 0; B a 1; W a 1"]);
        assert_eq!(simulate(&p, &rdv()).unwrap().peak_memory, vec![2.0]);
    }

    #[test]
    fn memory_forward_without_local_backward_holds_nothing() {
        let p = prog(
            1,
            two_units(),
            &["F a 0; SEND act a 0 1", "RECV act a 0 0; B a 0"],
        );
        let r = simulate(&p, &rdv()).unwrap();
        assert_eq!(r.peak_memory, vec![0.0, 0.0]);
    }

    #[test]
    fn memory_zero_length_forward_holds_nothing() {
        let u = vec![
            unit("a", &[], 0, 0.0, 0.0, 0.0, 1.0),
            unit("c", &[], 0, 1.0, 1.0, 1.0, 1.0),
        ];
        // a's F and BW take no time: [0,0) holds nothing.
        let p = prog(1, u, &["F a 0; BW a 0; F c 0; BW c 0"]);
        assert_eq!(simulate(&p, &rdv()).unwrap().peak_memory, vec![1.0]);
    }

    /// If a rank has both F and RF of one (unit, mb), the later forward holds.
    #[test]
    fn memory_recompute_holds_from_rf() {
        let u = vec![
            unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
            unit("c", &[], 0, 1.0, 1.0, 1.0, 1.0),
        ];
        let p = prog(1, u, &["F a 0; F c 0; BW c 0; RF a 0; BW a 0"]);
        assert_eq!(simulate(&p, &rdv()).unwrap().peak_memory, vec![1.0]);
        let u = vec![
            unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
            unit("c", &[], 0, 1.0, 1.0, 1.0, 1.0),
        ];
        let q = prog(1, u, &["F a 0; F c 0; BW c 0; BW a 0"]);
        assert_eq!(simulate(&q, &rdv()).unwrap().peak_memory, vec![2.0]);
    }

    #[test]
    fn structural_errors() {
        let unknown = prog(1, two_units(), &["F zz 0", ""]);
        let e = simulate(&unknown, &rdv()).unwrap_err();
        assert!(
            matches!(
                e,
                SimError::UnknownUnit {
                    rank: 0,
                    index: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("no unit is called `zz`"));

        let peer = prog(1, two_units(), &["SEND act a 0 9", ""]);
        assert!(matches!(
            simulate(&peer, &rdv()),
            Err(SimError::NoSuchRank { peer: 9, .. })
        ));
        let group = prog(1, two_units(), &["BCAST a 0 0,4", ""]);
        assert!(matches!(
            simulate(&group, &rdv()),
            Err(SimError::NoSuchRank { peer: 4, .. })
        ));
        let mb = prog(1, two_units(), &["F a 3", ""]);
        assert!(matches!(
            simulate(&mb, &rdv()),
            Err(SimError::MicrobatchOutOfRange { mb: 3, .. })
        ));
        let mut ranks = prog(1, two_units(), &["", ""]);
        ranks.ranks = 3;
        assert!(matches!(
            simulate(&ranks, &rdv()),
            Err(SimError::RankCount { .. })
        ));
        let mut neg = prog(1, two_units(), &["", ""]);
        neg.units[1].cost.b = -1.0;
        assert!(matches!(
            simulate(&neg, &rdv()),
            Err(SimError::BadUnitNumber {
                field: "cost.B",
                ..
            })
        ));
        neg.units[1].cost.b = f64::NAN;
        assert!(simulate(&neg, &rdv()).is_err());
        let mut dup = prog(1, two_units(), &["", ""]);
        dup.units[1].name = "a".into();
        assert!(matches!(
            simulate(&dup, &rdv()),
            Err(SimError::DuplicateUnit { .. })
        ));
        let ok = prog(1, two_units(), &["", ""]);
        for (latency, bandwidth) in [(0.0, 0.0), (-1.0, 1.0), (f64::NAN, 1.0), (0.0, f64::NAN)] {
            let comm = Some(CommModel { latency, bandwidth });
            let opts = SimOptions {
                mode: Mode::Rendezvous,
                comm,
            };
            assert!(matches!(
                simulate(&ok, &opts),
                Err(SimError::BadCommModel { .. })
            ));
        }
        let huge = Program {
            microbatches: usize::MAX,
            ..ok.clone()
        };
        assert!(matches!(
            simulate(&huge, &rdv()),
            Err(SimError::TooLarge { .. })
        ));
    }

    /// Nonsense that still runs: empty groups, out-of-order sends, roots outside groups.
    #[test]
    fn odd_programs_do_not_panic() {
        let mut p = prog(
            2,
            two_units(),
            &[
                "SEND grad b 1 1; SEND act a 0 1; REDUCE b 7 1",
                "RECV act a 0 0; RECV grad b 1 0; REDUCE b 7 1",
            ],
        );
        p.programs[0].insert(0, Action::coll(CollKind::Bcast, "a", 5, vec![]));
        for opts in [rdv(), eager()] {
            let _ = simulate(&p, &opts);
        }
        let r = simulate(&p, &eager());
        assert!(r.is_err() || r.is_ok());
    }

    #[test]
    fn recent_names_look_up_once_per_name_remembered_and_answer_as_the_lookup() {
        let names: Vec<String> = (0..12).map(|k| format!("stage{k}")).collect();
        let answer = |n: &str| {
            n.strip_prefix("stage")
                .and_then(|k| k.parse::<u32>().ok())
                .filter(|&k| k < 10)
        };
        // Another string with `names[0]`'s text, at another address: looked up
        // again.
        let again = names[0].clone();
        let mut recent = RecentNames::new();
        let mut calls = 0;
        let mut seq: Vec<&String> = Vec::new();
        // Six names in turn, twice: each looked up once.
        for _ in 0..2 {
            seq.extend(&names[..6]);
        }
        // Unknown names are remembered too.
        seq.extend([&names[11], &names[11], &again]);
        // Ten other names since `names[1]` was last asked for: dropped, so looked
        // up again; six since `names[11]` was: kept.
        seq.extend(&names[6..10]);
        seq.extend([&names[1], &names[11]]);
        let mut got = Vec::new();
        for name in &seq {
            got.push(recent.get(name, |n| {
                calls += 1;
                answer(n)
            }));
        }
        let want: Vec<Option<u32>> = seq.iter().map(|n| answer(n)).collect();
        assert_eq!(got, want);
        assert_eq!(calls, 6 + 2 + 4 + 1);
    }
}
