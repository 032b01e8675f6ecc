//! `transpose(ENCODER, BODY)`: MPipe's schedule.
//!
//! The encoder's per-micro-batch forward leaves the first stage's rank: micro-batch
//! `m` runs on rank `m mod n` with `n = min(ranks, microbatches)`
//! ([`Owners::RoundRobin`]), or only the first `n` are spread and the rest stay
//! inline on the first stage's rank ([`Owners::Min`], the authors' reference
//! implementation). That turns the stage x micro-batch placement grid on its side:
//! placement becomes a function of the micro-batch.
//!
//! Where in a rank's order the work goes:
//! - the first `n` micro-batches' forwards open their owners' lists: the warm-up
//!   time in which those ranks would otherwise wait for the first activation;
//! - later forwards (round robin) go as late in the owner's order as still lets them
//!   finish before the first stage needs them, by the plan's ideal timing;
//! - a trainable encoder's backward either runs where its forward ran, as early as
//!   the first stage's gradient allows ([`Backward::Local`]; the lowering then adds
//!   the parameter broadcast and gradient reduction), or is recomputed from the
//!   shipped input and run on the first stage's rank right after that stage's
//!   backward ([`Backward::Central`]). A frozen encoder has no backward.

use super::{insert_all, inserted};
use crate::algebra::analysis::{
    dependencies, dependencies_inserted, dependencies_lenient_located, peak_memory, timing,
    timing_extended_located, timing_within, Deps, PlanError, Timing,
};
use crate::ir::compare::{at_most, less};
use crate::ir::plan::{InputShip, Plan, Task, TaskIndex, UnitId};
use crate::ir::program::Op;

/// Which ranks own which micro-batches' encoder work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Owners {
    #[default]
    RoundRobin,
    Min,
    /// Round robin over the ranks with spare time: all but those whose stages carry
    /// the most work (the step's bottleneck, which encoder work would lengthen).
    Spare,
}

/// Where a trainable encoder's backward runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backward {
    #[default]
    Local,
    Central,
}

/// Where the encoder's forwards go in their owners' orders.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Place {
    /// The fastest of [`Place::Prefix`], [`Place::Idle`] and [`Place::Late`] by the
    /// plan's ideal timing, among those within the memory limit (earlier in that list
    /// on a tie: the authors' placement first). With [`Owners::Min`] (the reference implementation's owners) only
    /// `Late`, which is then the reference placement itself.
    #[default]
    Best,
    /// The first `n` forwards open their owners' lists; later ones go as late as
    /// still lets them finish before the first stage needs them, by the plan's ideal
    /// timing.
    Late,
    /// The authors' placement: every owner runs all of its forwards, in micro-batch
    /// order, before its first other work.
    Prefix,
    /// Warm-up idle first: each owner's forwards run before its first other work, as
    /// many on each rank as its predicted idle (the ideal start of its first task)
    /// holds, micro-batches assigned earliest deadline first to the earliest free
    /// slot; the pipeline's start is delayed by the least multiple of the encoder's
    /// forward for which every micro-batch fits before its deadline.
    Idle,
}

/// Re-place encoder `enc`'s work in `plan` ([`Place::Best`]).
pub fn transpose(
    plan: Plan,
    enc: UnitId,
    owners: Owners,
    backward: Backward,
) -> Result<Plan, PlanError> {
    transpose_with(plan, enc, owners, backward, Place::Best)
}

/// Re-place encoder `enc`'s work in `plan`, its forwards placed by `place`.
pub fn transpose_with(
    plan: Plan,
    enc: UnitId,
    owners: Owners,
    backward: Backward,
    place: Place,
) -> Result<Plan, PlanError> {
    transpose_recorded(plan, enc, owners, backward, place, None)
}

/// What a `transpose` choosing its placement ([`Place::Best`], owners other than
/// [`Owners::Min`]) learnt of the placements [`Place::Prefix`] and [`Place::Late`],
/// for a caller that would evaluate them again: the derivation compares their
/// programs with the chosen plan's (`search::derive`). Each one's plan, as
/// `transpose` with that placement gives it, is among the candidates it compared
/// (the fastest of that placement's own, by the same rule). Per placement, the
/// verdict: its plan is the plan chosen, or another, with the figure `judge` gives
/// it. Figures only: no plan is held.
#[derive(Debug)]
pub struct PlaceRecord {
    judge: fn(&Plan) -> Option<f64>,
    /// The calls that chose their placement, and the last one's verdicts on
    /// `Prefix` and `Late`.
    seen: std::sync::Mutex<(usize, Option<[Verdict; 2]>)>,
}

/// [`PlaceRecord`]'s verdict on one placement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// The placement's plan is the plan chosen.
    Chosen,
    /// Another plan, with the record's `judge` figure for it.
    Other(Option<f64>),
}

impl PlaceRecord {
    /// An empty record whose verdicts on other plans carry `judge`'s figure.
    pub fn new(judge: fn(&Plan) -> Option<f64>) -> Self {
        PlaceRecord {
            judge,
            seen: std::sync::Mutex::new((0, None)),
        }
    }

    /// The verdict on `place` (`Prefix` or `Late`) of the one call recorded; `None`
    /// for another placement, or unless exactly one call chose its placement under
    /// this record (and finished).
    pub fn verdict(&self, place: Place) -> Option<Verdict> {
        let k = match place {
            Place::Prefix => 0,
            Place::Late => 1,
            _ => return None,
        };
        let seen = self.seen.lock().ok()?;
        match *seen {
            (1, Some(v)) => Some(v[k]),
            _ => None,
        }
    }

    fn enter(&self) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.0 += 1;
        }
    }

    fn record(&self, verdicts: [Verdict; 2]) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.1 = Some(verdicts);
        }
    }
}

/// [`transpose_with`], recording what it learns of the placements it compares in
/// `record` (see [`PlaceRecord`]) when it chooses its placement.
pub fn transpose_recorded(
    plan: Plan,
    enc: UnitId,
    owners: Owners,
    backward: Backward,
    place: Place,
    record: Option<&PlaceRecord>,
) -> Result<Plan, PlanError> {
    compare_placements(plan, enc, owners, backward, place, record, Cut::Short)
}

/// How [`compare_placements`] compares its candidates: the result is the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// Each candidate timed only as far as it could still be chosen, peaks read only
    /// under a memory limit.
    Short,
    /// Each candidate timed in full, in order (what the tests hold `Short` to).
    #[cfg_attr(not(test), allow(dead_code))]
    Never,
}

/// [`transpose_recorded`], comparing its candidates as `cut` says.
fn compare_placements(
    mut plan: Plan,
    enc: UnitId,
    owners: Owners,
    backward: Backward,
    place: Place,
    record: Option<&PlaceRecord>,
    cut: Cut,
) -> Result<Plan, PlanError> {
    let p = plan.ranks;
    let first = plan.stages[0];
    let r0 = plan.units[first].home;
    // The ranks that own micro-batches, in turn from the first stage's.
    let ring: Vec<usize> = match owners {
        Owners::Spare => {
            let work: Vec<f64> = (0..p)
                .map(|r| {
                    plan.stages
                        .iter()
                        .filter(|&&u| plan.units[u].home == r)
                        .map(|&u| {
                            plan.units[u].cost.f + plan.units[u].cost.b + plan.units[u].cost.w
                        })
                        .sum()
                })
                .collect();
            let most = work.iter().copied().fold(0.0, f64::max);
            let spare: Vec<usize> = (0..p)
                .map(|i| (r0 + i) % p)
                .filter(|&r| less(work[r], most))
                .collect();
            if spare.is_empty() {
                (0..p).map(|i| (r0 + i) % p).collect()
            } else {
                spare
            }
        }
        _ => (0..p).map(|i| (r0 + i) % p).collect(),
    };
    for list in &mut plan.order {
        list.retain(|t| t.unit != enc);
    }
    plan.input_ships.retain(|s| s.unit != enc);

    let places: &[Place] = match (place, owners) {
        (Place::Best, Owners::Min) => &[Place::Late],
        (Place::Best, _) => &[Place::Prefix, Place::Idle, Place::Late],
        (Place::Late, _) => &[Place::Late],
        (Place::Prefix, _) => &[Place::Prefix],
        (Place::Idle, _) => &[Place::Idle],
    };
    let trainable = plan.units[enc].trainable;
    // Recorded: the fastest candidate of `Prefix` and of `Late` too (the first and
    // last of `places`).
    let record = record.filter(|_| places.len() == 3);
    if let Some(record) = record {
        record.enter();
    }
    // Nothing reads the encoder's gradient when it has no inputs: its backwards,
    // appended at the ends of the lists, change no other task's ideal time.
    let no_readers = plan.units[enc].inputs.is_empty();
    // Every cost finite and not negative: each task ends no earlier than it starts.
    let sound = plan.units.iter().all(|u| {
        [Op::F, Op::B, Op::W, Op::BW, Op::RF]
            .iter()
            .all(|op| op.cost(&u.cost).is_finite() && op.cost(&u.cost) >= 0.0)
    });
    // The candidates: for a trainable encoder two a placement, the backward eager
    // (candidate `2k` of placement `k`) and deferred (`2k + 1`); one a placement
    // (`k`) for a frozen encoder.
    //
    // The fastest candidate among those within the profile's memory limit (so
    // without a limit a trainable encoder may hold all its activations to the end of
    // the step); on a tie the earlier candidate. Compared in any order, the earlier
    // candidate winning a tie, the fastest is the same: each candidate is compared
    // as soon as it is built, and kept only while it is the fastest so far (or, when
    // recorded, its placement's). A deferred candidate whose makespan is known goes
    // before its placement's eager one, so that the eager one can be timed only as
    // far as it could still win (its timing, when it is `ordered`, stops at the
    // first task ending past the makespan it must beat). The others are resolved
    // and timed as built, in the same order whatever the cut, so a failure is the
    // same failure.
    let mut contest = Contest {
        memory_limit: plan.memory_limit,
        cut,
        tracked: std::array::from_fn(|k| {
            record.is_some() && k < places.len() && (k == 0 || k + 1 == places.len())
        }),
        single: places.len() == 1 && !trainable,
        best: None,
        own: [None; 3],
        kept: Vec::new(),
    };
    for (k, &pl) in places.iter().enumerate() {
        let (placed, owner) = place_forwards(&plan, enc, &ring, owners, pl)?;
        if !trainable {
            contest.compare(k, k, placed, None, None, false)?;
            continue;
        }
        // The backward: two placements. Eager: each encoder backward as soon as its
        // gradient is ready. Deferred: after the rank's other work, so the first
        // stage's backwards (which other ranks wait for) are not held up by encoder
        // work nobody waits for; but every encoder activation is then held to the end.
        // Both read the ideal timing of the plan with the forwards placed: timed once,
        // the eager placement reads its gradients' ready times from it, and the
        // deferred one (the same lists, each extended at its end) is timed only past
        // it. The eager one's dependencies are the placed plan's, moved past the
        // backwards inserted, and the backwards' own. The placed plan's index then
        // becomes the deferred one's (its lists extended).
        let mut index = placed.locate();
        let placed_deps = dependencies_lenient_located(&placed, &index)?;
        let placed_time = timing(&placed, &placed_deps)?;
        let owner = |mb: usize| owner[mb];
        let eager = place_backward(&placed, enc, &owner, backward, Some(&index), &placed_time)?;
        let deferred = place_backward(&placed, enc, &owner, backward, None, &placed_time)?;
        let lengths: Vec<usize> = placed.order.iter().map(Vec::len).collect();
        drop(placed);
        let eager_deps = dependencies_inserted(&eager.plan, &index, &placed_deps, &eager.at)?;
        drop(placed_deps);
        // (The placed plan's timing grows into the deferred one's.)
        let span = if no_readers {
            index.extend(&deferred.plan, &lengths);
            let time = timing_extended_located(&deferred.plan, placed_time, &index)?;
            Some(time.makespan())
        } else {
            drop(placed_time);
            None
        };
        drop(index);
        let ordered = eager.ordered && no_readers && sound;
        let (i, j) = (2 * k, 2 * k + 1);
        if span.is_some() && cut == Cut::Short {
            contest.compare(j, k, deferred.plan, span, None, false)?;
            contest.compare(i, k, eager.plan, None, Some(eager_deps), ordered)?;
        } else {
            contest.compare(i, k, eager.plan, None, Some(eager_deps), ordered)?;
            contest.compare(j, k, deferred.plan, span, None, false)?;
        }
    }
    let Some(mut chosen) = contest.take(contest.best) else {
        return Ok(plan);
    };
    chosen.input_ships.sort();
    if let Some(record) = record {
        let mut verdict = |k: usize| {
            let Some(mut other) = contest.take(contest.own[k]) else {
                return Verdict::Chosen;
            };
            other.input_ships.sort();
            if other == chosen {
                Verdict::Chosen
            } else {
                Verdict::Other((record.judge)(&other))
            }
        };
        let verdicts = [verdict(0), verdict(places.len() - 1)];
        record.record(verdicts);
    }
    Ok(chosen)
}

/// `(makespan, peak, candidate)` of the fastest candidate of [`compare_placements`]
/// so far (of those it compared), if any.
type Fastest = Option<(f64, f64, usize)>;

/// [`compare_placements`]' comparison of its candidates, each as it is built.
struct Contest {
    memory_limit: Option<f64>,
    cut: Cut,
    /// Whether the fastest of placement `k`'s own candidates is kept as well.
    tracked: [bool; 3],
    /// Only one candidate: it is chosen, neither timed nor its peak read.
    single: bool,
    /// The fastest so far, and the fastest of each tracked placement's own.
    best: Fastest,
    own: [Fastest; 3],
    /// The plans of those (candidate, plan), each once.
    kept: Vec<(usize, Plan)>,
}

impl Contest {
    /// Whether a peak is within the memory limit.
    fn fits(&self, peak: f64) -> bool {
        self.memory_limit.is_none_or(|limit| at_most(peak, limit))
    }

    /// Whether `(span, peak, i)` is ahead of `than`.
    fn ahead(&self, (span, peak, i): (f64, f64, usize), than: &Fastest) -> bool {
        match than {
            None => true,
            Some((b_span, b_peak, j)) => match (self.fits(peak), self.fits(*b_peak)) {
                (true, false) => true,
                (false, true) => false,
                // (Makespans are never NaN: each is a maximum from 0.)
                _ => span < *b_span || (span == *b_span && i < *j),
            },
        }
    }

    /// The makespan a candidate of this peak must not pass to still be ahead of
    /// `than` (ahead at any makespan: infinite; at none: minus infinity).
    fn cap(&self, peak: f64, than: &Fastest) -> f64 {
        match than {
            None => f64::INFINITY,
            Some((b_span, b_peak, _)) => match (self.fits(peak), self.fits(*b_peak)) {
                (true, false) => f64::INFINITY,
                (false, true) => f64::NEG_INFINITY,
                _ => *b_span,
            },
        }
    }

    /// Compare candidate `i` of placement `k`, `plan`, whose makespan is `known`, or
    /// else found from its dependencies `deps` (resolved here if `None`), timed
    /// only as far as it can still be ahead where `ordered` (see
    /// [`place_backward`]) and the cut allows. Its peak is read only through
    /// `fits`: without a memory limit, not at all (cut short).
    fn compare(
        &mut self,
        i: usize,
        k: usize,
        plan: Plan,
        known: Option<f64>,
        deps: Option<Deps>,
        ordered: bool,
    ) -> Result<(), PlanError> {
        if self.single {
            self.best = Some((0.0, 0.0, i));
            self.kept.push((i, plan));
            return Ok(());
        }
        let peak = match (self.memory_limit, self.cut) {
            (None, Cut::Short) => 0.0,
            _ => peak_memory(&plan).into_iter().fold(0.0, f64::max),
        };
        let span = match known {
            Some(span) => Some(span),
            None => {
                let deps = match deps {
                    Some(deps) => deps,
                    None => dependencies(&plan)?,
                };
                let mut limit = f64::INFINITY;
                if self.cut == Cut::Short && ordered && within_u32(&plan) {
                    limit = self.cap(peak, &self.best);
                    if self.tracked[k] {
                        limit = limit.max(self.cap(peak, &self.own[k]));
                    }
                }
                timing_within(&plan, &deps, limit)?.map(|t| t.makespan())
            }
        };
        if let Some(span) = span {
            if self.ahead((span, peak, i), &self.best) {
                self.best = Some((span, peak, i));
            }
            if self.tracked[k] && self.ahead((span, peak, i), &self.own[k]) {
                self.own[k] = Some((span, peak, i));
            }
        }
        // Candidates no longer needed go now.
        let fastest = [self.best, self.own[0], self.own[1], self.own[2]];
        let held = |j: usize| fastest.iter().any(|f| f.is_some_and(|(_, _, x)| x == j));
        self.kept.retain(|(j, _)| held(*j));
        if held(i) {
            self.kept.push((i, plan));
        }
        Ok(())
    }

    /// The plan of `fastest`, taken (`None` once taken).
    fn take(&mut self, fastest: Fastest) -> Option<Plan> {
        let i = fastest?.2;
        let at = self.kept.iter().position(|(j, _)| *j == i)?;
        Some(self.kept.swap_remove(at).1)
    }
}

/// Place encoder `enc`'s forwards in `plan` (which holds none of its tasks) by
/// `place` (not [`Place::Best`]); returns the plan and each micro-batch's owner.
fn place_forwards(
    plan: &Plan,
    enc: UnitId,
    ring: &[usize],
    owners: Owners,
    place: Place,
) -> Result<(Plan, Vec<usize>), PlanError> {
    let (p, m) = (plan.ranks, plan.microbatches);
    let first = plan.stages[0];
    let r0 = plan.units[first].home;
    let n = ring.len().min(m);
    let c_f = plan.units[enc].cost.f;
    let mut owner: Vec<usize> = (0..m)
        .map(|mb| match owners {
            Owners::RoundRobin | Owners::Spare => ring[mb % n],
            Owners::Min if mb < n => ring[mb],
            Owners::Min => r0,
        })
        .collect();

    // Idle and prefix: every owner's forwards open its list, in micro-batch order.
    if place == Place::Idle || (place == Place::Prefix && owners != Owners::Min) {
        if place == Place::Idle {
            owner = idle_owners(plan, ring, c_f)?;
        }
        let mut fronts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
        for (mb, &k) in owner.iter().enumerate() {
            fronts[k].push((0, Task::new(Op::F, enc, mb)));
        }
        let ships = plan.input_ships.clone();
        return Ok((with_inserted(plan, fronts, ships), owner));
    }

    // 1. The warm-up prefix (at most one forward a rank: the first `n` micro-batches
    // go to distinct ranks), and (owners = min) the inline rest, each just before
    // the first stage's forward it feeds.
    let mut items: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
    for (mb, &k) in owner.iter().enumerate().take(n) {
        items[k].push((0, Task::new(Op::F, enc, mb)));
    }
    for (i, t) in plan.order[r0].iter().enumerate() {
        if t.unit == first && t.op == Op::F && t.mb >= n && owner[t.mb] == r0 {
            items[r0].push((i, Task::new(Op::F, enc, t.mb)));
        }
    }
    let mut plan = with_inserted(plan, items, plan.input_ships.clone());

    // 2. Round robin: later forwards as late as still meets the first stage's need.
    if owners != Owners::Min && m > n {
        let index = plan.locate();
        let timed = timing(&plan, &dependencies_lenient_located(&plan, &index)?)?;
        let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
        for (mb, &k) in owner.iter().enumerate().skip(n) {
            if k == r0 {
                continue; // already inline before the first stage's forward
            }
            let Some((q, j)) = index.get(Op::F, first, mb) else {
                continue;
            };
            let deadline = timed.start[q][j] - c_f;
            let ends = &timed.end[k];
            // Positions are relative to the rank's own tasks: when the inserted work
            // slows the pipeline, it slows the first stage's need by as much, so the
            // encoder forward stays next to the work it feeds (no drift ahead, no
            // growth of held activations with the micro-batch count).
            let from = inserts[k].last().map_or(0, |&(pos, _)| pos);
            let mut pos = from;
            while pos < ends.len() && ends[pos] <= deadline {
                pos += 1;
            }
            inserts[k].push((pos, Task::new(Op::F, enc, mb)));
        }
        for (k, items) in inserts.into_iter().enumerate() {
            insert_all(&mut plan.order[k], items);
        }
    }
    Ok((plan, owner))
}

/// [`Place::Idle`]'s owners: micro-batch `mb`'s forward goes to a rank of `ring`.
///
/// From the ideal timing of `plan` without the encoder: rank `r`'s first task starts
/// at `s_r`, and the first stage's forward of micro-batch `mb` at `need_mb`. Delaying
/// the whole pipeline by `D`, rank `r` has the window `[0, s_r + D)` for encoder
/// forwards, back to back from time 0 (so its slots end at `c_f, 2 c_f, ..`), and
/// micro-batch `mb` must finish by `need_mb + D`. All forwards cost the same, so
/// which rank a slot is on does not matter for feasibility: taking micro-batches
/// earliest deadline first, each in the earliest free slot, fits them all whenever
/// any assignment does. Feasibility only grows with `D`; the smallest `D = j c_f`
/// (`1 <= j <= m`; at `j = m` one rank's window holds every forward) is found by
/// bisection.
fn idle_owners(plan: &Plan, ring: &[usize], c_f: f64) -> Result<Vec<usize>, PlanError> {
    let m = plan.microbatches;
    let first = plan.stages[0];
    let index = plan.locate();
    let timed = timing(plan, &dependencies_lenient_located(plan, &index)?)?;
    let end = timed.makespan();
    let start: Vec<f64> = ring
        .iter()
        .map(|&r| timed.start[r].first().copied().unwrap_or(end))
        .collect();
    let mut by_deadline: Vec<(f64, usize)> = (0..m)
        .map(|mb| {
            let need = index
                .get(Op::F, first, mb)
                .map_or(end, |(q, j)| timed.start[q][j]);
            (need, mb)
        })
        .collect();
    by_deadline.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let assign = |delay: f64| fit(&by_deadline, &start, ring, c_f, delay);
    if c_f <= 0.0 {
        return Ok(assign(0.0).unwrap_or_else(|| (0..m).map(|mb| ring[mb % ring.len()]).collect()));
    }
    let (mut lo, mut hi) = (1usize, m.max(1));
    let mut best = assign(hi as f64 * c_f);
    while lo < hi {
        let mid = (lo + hi) / 2;
        match assign(mid as f64 * c_f) {
            Some(owner) => {
                best = Some(owner);
                hi = mid;
            }
            None => lo = mid + 1,
        }
    }
    Ok(best.unwrap_or_else(|| (0..m).map(|mb| ring[mb % ring.len()]).collect()))
}

/// [`idle_owners`]' assignment at delay `delay`: the micro-batches of `by_deadline`
/// (`(deadline, micro-batch)`, earliest first) each in the earliest free slot (the
/// first rank on a tie) among the ranks `ring[i]` whose window `[0, start[i] +
/// delay)` still holds a slot of `c_f`; `None` where one misses its deadline (plus
/// `delay`) or finds no slot. Each micro-batch's owner.
fn fit(
    by_deadline: &[(f64, usize)],
    start: &[f64],
    ring: &[usize],
    c_f: f64,
    delay: f64,
) -> Option<Vec<usize>> {
    let m = by_deadline.len();
    // Where the `k`-th slot ends strictly later than the one before (a normal,
    // positive cost, no slot end overflowing), the earliest free slot is the least
    // used rank's, from a heap; else a scan of the ranks.
    if c_f > 0.0 && c_f.is_normal() && ((m + 1) as f64 * c_f).is_finite() {
        fit_by_heap(by_deadline, start, ring, c_f, delay)
    } else {
        fit_by_scan(by_deadline, start, ring, c_f, delay)
    }
}

/// [`fit`], every rank looked at for every micro-batch.
fn fit_by_scan(
    by_deadline: &[(f64, usize)],
    start: &[f64],
    ring: &[usize],
    c_f: f64,
    delay: f64,
) -> Option<Vec<usize>> {
    let mut used = vec![0usize; ring.len()];
    let mut owner = vec![0usize; by_deadline.len()];
    for &(need, mb) in by_deadline {
        // The earliest free slot among the ranks whose window still holds one.
        let mut pick: Option<(usize, f64)> = None;
        for (i, &s) in start.iter().enumerate() {
            let finish = (used[i] + 1) as f64 * c_f;
            if at_most(finish, s + delay) && pick.is_none_or(|(_, f)| finish < f) {
                pick = Some((i, finish));
            }
        }
        let (i, finish) = pick?;
        if !at_most(finish, need + delay) {
            return None;
        }
        used[i] += 1;
        owner[mb] = ring[i];
    }
    Some(owner)
}

/// [`fit`] where a rank's next slot ends strictly later the more slots it has used
/// (`c_f` positive and normal, `(m + 1) c_f` finite): the earliest free slot is
/// then the least used rank's (the first on a tie) among those whose window holds
/// its next slot, and a rank whose window does not hold it never will again (its
/// next slot only ends later). So the ranks wait in a heap by (slots used, rank),
/// and one found full leaves it: what [`fit_by_scan`] picks, in logarithmic time.
fn fit_by_heap(
    by_deadline: &[(f64, usize)],
    start: &[f64],
    ring: &[usize],
    c_f: f64,
    delay: f64,
) -> Option<Vec<usize>> {
    use std::cmp::Reverse;
    let mut open: std::collections::BinaryHeap<Reverse<(usize, usize)>> =
        (0..start.len()).map(|i| Reverse((0, i))).collect();
    let mut owner = vec![0usize; by_deadline.len()];
    for &(need, mb) in by_deadline {
        let (used, i, finish) = loop {
            let Reverse((used, i)) = open.pop()?;
            let finish = (used + 1) as f64 * c_f;
            if at_most(finish, start[i] + delay) {
                break (used, i, finish);
            }
        };
        if !at_most(finish, need + delay) {
            return None;
        }
        open.push(Reverse((used + 1, i)));
        owner[mb] = ring[i];
    }
    Some(owner)
}

/// Place encoder `enc`'s backward (see [`transpose`]) in `plan`, whose ideal timing
/// (dependencies resolved leniently) is `timed`: given `eager` (`plan`'s
/// [`Plan::locate`]), each as early as its gradient allows; else (deferred) each
/// rank's share appended at the end of its order.
///
/// Returns the plan, the positions in `plan`'s lists before which it inserted
/// tasks, and whether it is `ordered`: the backward is eager and local,
/// and each backward placed comes, in `timed`'s order (by start time, then by
/// settle order `seq`), after every task holding what it reads (its own forward,
/// its successors' backwards) and before the task it was placed before. Where every
/// cost is finite and not negative, that order is a topological order of `plan`
/// (a task starts no earlier than its inputs end, and ends no earlier than it
/// starts; at equal starts the settle order decides). Then, if no task of `plan`
/// reads the encoder's gradient and the new plan's dependencies resolve in full (so
/// every other task's are as `timed` had them), that order with each backward set
/// just before the task it precedes is a topological order of the new plan: its
/// timing cannot fail on a cycle.
fn place_backward(
    plan: &Plan,
    enc: UnitId,
    owner: &dyn Fn(usize) -> usize,
    backward: Backward,
    eager: Option<&TaskIndex>,
    timed: &Timing,
) -> Result<WithBackward, PlanError> {
    let deferred = eager.is_none();
    let (p, m) = (plan.ranks, plan.microbatches);
    let first = plan.stages[0];
    let r0 = plan.units[first].home;
    // Just after the first stage's first backward of each micro-batch on `r0` (the
    // end of its list if there is none), from one pass over the list.
    let len = plan.order[r0].len();
    let mut first_backward = vec![len; m];
    if !deferred {
        for (i, t) in plan.order[r0].iter().enumerate().rev() {
            if t.unit == first && t.mb < m && matches!(t.op, Op::B | Op::BW) {
                first_backward[t.mb] = i + 1;
            }
        }
    }
    let index = eager;
    let mut ordered = !deferred && backward == Backward::Local;
    let successors = plan.unit_names().successors(enc).to_vec();
    // Whether encoder backward `mb`, placed before task `pos` of rank `k`, keeps
    // `timed`'s order (see above).
    let keeps_order = |index: &crate::ir::plan::TaskIndex, k: usize, pos: usize, mb: usize| {
        let Some(&next) = timed.seq[k].get(pos) else {
            return true;
        };
        let read = [(Op::F, enc), (Op::RF, enc)]
            .into_iter()
            .chain(successors.iter().flat_map(|&s| [(Op::B, s), (Op::BW, s)]));
        let at = timed.start[k][pos];
        read.filter_map(|(op, u)| index.get(op, u, mb))
            .all(|(q, j)| {
                let s = timed.start[q][j];
                s < at || (s == at && timed.seq[q][j] < next)
            })
    };
    let mut at_r0 = Vec::new();
    let mut remote: Vec<(usize, usize)> = Vec::new();
    let mut input_ships = plan.input_ships.clone();
    for (mb, &pos) in first_backward.iter().enumerate() {
        let k = owner(mb);
        if k == r0 {
            if ordered {
                ordered = index
                    .as_ref()
                    .is_some_and(|index| keeps_order(index, r0, pos, mb));
            }
            at_r0.push((pos, Task::new(Op::BW, enc, mb)));
        } else if backward == Backward::Central {
            at_r0.push((pos, Task::new(Op::RF, enc, mb)));
            at_r0.push((pos, Task::new(Op::BW, enc, mb)));
            input_ships.push(InputShip {
                unit: enc,
                mb,
                from: k,
                to: r0,
            });
        } else {
            remote.push((mb, k));
        }
    }
    let mut at: Vec<Vec<usize>> = vec![Vec::new(); p];
    let placed = match &index {
        // Deferred: every rank's share appended at its end, in micro-batch order
        // (each list of just its new length).
        None => {
            let mut appends: Vec<Vec<Task>> = vec![Vec::new(); p];
            for (mb, k) in remote {
                appends[k].push(Task::new(Op::BW, enc, mb));
            }
            appends[r0].extend(at_r0.into_iter().map(|(_, t)| t));
            for (r, items) in appends.iter().enumerate() {
                at[r] = vec![plan.order[r].len(); items.len()];
            }
            let order = plan
                .order
                .iter()
                .zip(appends)
                .map(|(list, items)| {
                    let mut out = Vec::with_capacity(list.len() + items.len());
                    out.extend_from_slice(list);
                    out.extend(items);
                    out
                })
                .collect();
            with_order(plan, order, input_ships)
        }
        Some(index) => {
            let mut inserts: Vec<Vec<(usize, Task)>> = vec![Vec::new(); p];
            for (mb, k) in remote {
                let ready = index
                    .get(Op::B, first, mb)
                    .or_else(|| index.get(Op::BW, first, mb))
                    .map_or(0.0, |(q, j)| timed.end[q][j]);
                let own_f = index.get(Op::F, enc, mb).map_or(0, |(_, j)| j + 1);
                let pos = timed.start[k].partition_point(|&s| s < ready).max(own_f);
                if ordered {
                    ordered = keeps_order(index, k, pos, mb);
                }
                inserts[k].push((pos, Task::new(Op::BW, enc, mb)));
            }
            // No remote backward is `r0`'s.
            inserts[r0] = at_r0;
            for (r, items) in inserts.iter().enumerate() {
                let len = plan.order[r].len();
                at[r] = items.iter().map(|&(pos, _)| pos.min(len)).collect();
                at[r].sort_unstable();
            }
            with_inserted(plan, inserts, input_ships)
        }
    };
    Ok(WithBackward {
        plan: placed,
        at,
        ordered,
    })
}

/// [`place_backward`]'s plan, the positions in the lists of the plan it was given
/// before which it put tasks (one a task, ascending; a list's length: at its
/// end), and whether it is `ordered`.
struct WithBackward {
    plan: Plan,
    at: Vec<Vec<usize>>,
    ordered: bool,
}

/// `plan` with `order` for its rank lists and `input_ships` for its input ships.
fn with_order(plan: &Plan, order: Vec<Vec<Task>>, input_ships: Vec<InputShip>) -> Plan {
    Plan {
        ranks: plan.ranks,
        microbatches: plan.microbatches,
        units: plan.units.clone(),
        stages: plan.stages.clone(),
        encoders: plan.encoders.clone(),
        order,
        input_ships,
        prefetch: plan.prefetch.clone(),
        memory_limit: plan.memory_limit,
    }
}

/// `plan` with `items[r]` inserted into rank `r`'s list as [`insert_all`] inserts
/// them, each list built once (not copied, then rebuilt), and `input_ships` for
/// its input ships.
fn with_inserted(plan: &Plan, items: Vec<Vec<(usize, Task)>>, input_ships: Vec<InputShip>) -> Plan {
    let order = plan
        .order
        .iter()
        .zip(items)
        .map(|(list, items)| inserted(list, items))
        .collect();
    with_order(plan, order, input_ships)
}

/// Whether a timing can number all of `plan`'s tasks (32-bit, see
/// [`PlanError::TooLarge`]): a timing cut short then misses no such failure.
fn within_u32(plan: &Plan) -> bool {
    let tasks: usize = plan.order.iter().map(Vec::len).sum();
    u32::try_from(tasks.saturating_sub(1)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::generators::{generate, BodyKind};
    use crate::algebra::profile::Profile;
    use proptest::prelude::*;

    /// The figure the records below judge plans by: the ideal makespan.
    fn ideal(plan: &Plan) -> Option<f64> {
        let deps = dependencies(plan).ok()?;
        timing(plan, &deps).ok().map(|t| t.makespan())
    }

    proptest! {
        /// [`fit_by_heap`] assigns every micro-batch as [`fit_by_scan`] does (or
        /// fails as it does), where it applies: ties in windows and deadlines
        /// included (values on a coarse grid).
        #[test]
        fn heap_fit_assigns_as_the_scan(
            starts in prop::collection::vec(0u32..12, 1..9),
            needs in prop::collection::vec(0u32..40, 0..40),
            c_f in 0.25f64..3.0,
            delay in 0u32..20,
        ) {
            let start: Vec<f64> = starts.iter().map(|&s| f64::from(s) * 0.5).collect();
            let ring: Vec<usize> = (0..start.len()).map(|i| (i * 5 + 3) % 11).collect();
            let mut by_deadline: Vec<(f64, usize)> = needs
                .iter()
                .enumerate()
                .map(|(mb, &n)| (f64::from(n) * 0.5, mb))
                .collect();
            by_deadline.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let delay = f64::from(delay) * c_f;
            prop_assert_eq!(
                fit_by_heap(&by_deadline, &start, &ring, c_f, delay),
                fit_by_scan(&by_deadline, &start, &ring, c_f, delay)
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(160))]

        /// Comparing the candidates with cuts (timings given up past the makespan
        /// to beat, peaks unread without a memory limit, the candidates of known
        /// makespan first) chooses the very plan the full comparison chooses, and
        /// records the same verdicts, or fails the same way: frozen and trainable
        /// encoders, every owner rule, backward and placement, with and without
        /// a memory limit.
        #[test]
        fn cut_comparison_chooses_as_the_full_one(
            enc_layers in 1u32..12, ef in 0.05f64..2.0, eb in 0.0f64..2.0, ew in 0.0f64..1.0,
            trainable: bool, lf in 0.2f64..2.0, lb in 0.2f64..2.0, lw in 0.0f64..1.5,
            act in 0.0f64..1.0,
            zbv: bool, p in 1usize..9, m in 1usize..40,
            owners in prop::sample::select(vec![Owners::RoundRobin, Owners::Min, Owners::Spare]),
            central: bool,
            place in prop::sample::select(vec![Place::Best, Place::Late, Place::Prefix, Place::Idle]),
            limit in prop::option::of(0.0f64..12.0),
        ) {
            let prof = Profile::from_toml_str(&format!(
                "[[encoder]]\nname = \"vision\"\nlayers = {enc_layers}\nforward = {ef}\n\
                 backward = {eb}\nweight = {ew}\nactivation = {act}\ntrainable = {trainable}\n\n\
                 [llm]\nlayers = 16\nforward = {lf}\nbackward = {lb}\nweight = {lw}\n\
                 activation = 1.0\n"
            ))
            .unwrap();
            let kind = if zbv { BodyKind::ZbV } else { BodyKind::OneFOneB };
            let Ok(mut base) = generate(kind, &prof, p, m) else {
                return Err(TestCaseError::reject("no such body"));
            };
            base.memory_limit = limit;
            let backward = if central { Backward::Central } else { Backward::Local };
            let run = |cut: Cut| {
                let record = PlaceRecord::new(ideal);
                let plan = compare_placements(
                    base.clone(), 0, owners, backward, place, Some(&record), cut,
                );
                let verdicts = [record.verdict(Place::Prefix), record.verdict(Place::Late)];
                (plan, verdicts)
            };
            let (short, never) = (run(Cut::Short), run(Cut::Never));
            prop_assert_eq!(short, never);
        }
    }
}
