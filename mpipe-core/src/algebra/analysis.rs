//! What a plan implies: every task's data dependencies, and the ideal timing of the
//! plan (each task as early as its rank order and its inputs allow, communication
//! free). The lowering orders transfers by these times; operators that place work
//! into idle time read them.

use crate::ir::plan::{Plan, Task, TaskIndex, UnitId, UnitNames};
use crate::ir::program::{Op, Tensor};

/// A plan that cannot be executed: a generator or operator broke the plan invariant.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("rank {rank}, task {index} `{task}` reads {what}, which no rank produces")]
    Missing {
        rank: usize,
        index: usize,
        task: String,
        what: String,
    },
    #[error(
        "rank {rank}, task {index} `{task}` reads {what}, which the same rank produces only later"
    )]
    Backwards {
        rank: usize,
        index: usize,
        task: String,
        what: String,
    },
    #[error("the plan's orders and data dependencies form a cycle; stuck tasks: {0}")]
    Cycle(String),
    /// A `fill` placement inside `auto` would re-time the plan past its budget
    /// (`SearchPolicy::fill_work`); `auto` leaves that candidate out.
    #[error(
        "`fill`'s placement would re-time the plan for more than {cap} task visits at \
         this size (auto's budget, SearchPolicy::fill_work)"
    )]
    OverBudget { cap: u64 },
    /// More tasks than a 32-bit settle order numbers. The size limits keep every
    /// accepted plan far below it; this says so instead of wrapping.
    #[error(
        "the plan has more than 2^32 tasks, too many to time; use fewer ranks or \
         micro-batches"
    )]
    TooLarge,
}

/// One input of a task: the tensor it reads (of the task's own micro-batch) and the
/// task that produces it. 16 bytes (40 with machine words and the micro-batch): a
/// plan's dependencies are about one per task, millions at the largest sizes. Its
/// numbers are 32-bit: a unit and a task index each stand for a value held in
/// memory (a unit, a task of one rank's list), never 2^32 of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dep {
    pub tensor: Tensor,
    unit: u32,
    producer: (u32, u32),
}

impl Dep {
    fn new(tensor: Tensor, unit: UnitId, (rank, index): (usize, usize)) -> Dep {
        Dep {
            tensor,
            unit: unit as u32,
            producer: (rank as u32, index as u32),
        }
    }

    /// The unit the tensor belongs to (`act(unit)` or `grad(unit)`).
    pub fn unit(&self) -> UnitId {
        self.unit as UnitId
    }

    /// `(rank, index)` of the producing task.
    pub fn producer(&self) -> (usize, usize) {
        (self.producer.0 as usize, self.producer.1 as usize)
    }
}

/// Dependencies of every task, `deps(r, i)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Deps {
    offsets: Vec<Vec<usize>>,
    items: Vec<Dep>,
    /// Whether every tensor read has its producer (lenient resolution left none
    /// out).
    complete: bool,
}

impl Deps {
    #[inline]
    pub fn of(&self, rank: usize, index: usize) -> &[Dep] {
        let o = &self.offsets[rank];
        &self.items[o[index]..o[index + 1]]
    }
}

pub(crate) fn describe(plan: &Plan, t: &Task) -> String {
    format!("{}({},{})", t.op.as_str(), plan.units[t.unit].name, t.mb)
}

/// Resolve every task's inputs (docs/spec/program-format.md rule 2): a forward reads its input
/// units' activations, a backward its own forward and its successors' gradients, a
/// weight-gradient its own `B`. Local producers earlier on the rank win; otherwise
/// the unique producer elsewhere.
pub fn dependencies(plan: &Plan) -> Result<Deps, PlanError> {
    resolve(plan, &plan.locate(), &plan.unit_names(), false, &[])
}

/// [`dependencies`] with the plan's units found by name in `names`
/// ([`Plan::unit_names`] of this plan, or of another of the same units): a search
/// resolving many plans of the same units builds the index once.
pub(crate) fn dependencies_named(plan: &Plan, names: &UnitNames) -> Result<Deps, PlanError> {
    resolve(plan, &plan.locate(), names, false, &[])
}

/// Like [`dependencies`], but a tensor nobody produces is taken as available from the
/// start instead of an error: operators use it to time a plan whose work they are
/// about to re-place.
pub fn dependencies_lenient(plan: &Plan) -> Result<Deps, PlanError> {
    resolve(plan, &plan.locate(), &plan.unit_names(), true, &[])
}

/// [`dependencies_lenient`] with the tasks located by `index`, [`Plan::locate`] of
/// this very plan: an operator that reads the index too builds it once.
pub(crate) fn dependencies_lenient_located(
    plan: &Plan,
    index: &TaskIndex,
) -> Result<Deps, PlanError> {
    resolve(plan, index, &plan.unit_names(), true, &[])
}

/// The dependencies of `plan`'s tasks (located by `index`, [`Plan::locate`] of
/// `plan`), resolved only from index `from[r]` on on rank `r` (every task where
/// `from` is empty or shorter than the ranks): the tasks before it are given none.
fn resolve(
    plan: &Plan,
    index: &TaskIndex,
    names: &UnitNames,
    lenient: bool,
    from: &[usize],
) -> Result<Deps, PlanError> {
    let need = names.needs_backward();
    let locate = |op, u, mb| index.get(op, u, mb);
    let mut offsets = Vec::with_capacity(plan.ranks);
    // About one input a task: room for that many at once, not grown by doubling.
    let tasks: usize = plan
        .order
        .iter()
        .zip(0..)
        .map(|(l, r)| l.len() - from.get(r).copied().unwrap_or(0).min(l.len()))
        .sum();
    let mut items = Vec::with_capacity(tasks);
    let mut complete = true;
    for (r, list) in plan.order.iter().enumerate() {
        let mut off = Vec::with_capacity(list.len() + 1);
        let skip = from.get(r).copied().unwrap_or(0).min(list.len());
        off.resize(skip, items.len());
        for (i, t) in list.iter().enumerate().skip(skip) {
            off.push(items.len());
            complete &= resolve_task(plan, names, need, lenient, &locate, (r, i, t), &mut items)?;
        }
        off.push(items.len());
        offsets.push(off);
    }
    Ok(Deps {
        offsets,
        items,
        complete,
    })
}

/// The inputs of task `t`, task `i` of rank `r` of `plan` (`at = (r, i, t)`), appended to
/// `items`, its producers located by `locate` (a plan's [`TaskIndex`], or a view of
/// one, as in [`local`]); `need`: [`UnitNames::needs_backward`] of `names`.
/// Lenient, a tensor nobody produces is left out (then `Ok(false)`); else it is an
/// error, as a producer only later on the rank always is.
#[inline(always)]
fn resolve_task(
    plan: &Plan,
    names: &UnitNames,
    need: &[bool],
    lenient: bool,
    locate: &impl Fn(Op, UnitId, usize) -> Option<(usize, usize)>,
    (r, i, t): (usize, usize, &Task),
    items: &mut Vec<Dep>,
) -> Result<bool, PlanError> {
    let mut complete = true;
    let err = |what: String, backwards: bool| {
        let (rank, index, task) = (r, i, describe(plan, t));
        if backwards {
            PlanError::Backwards {
                rank,
                index,
                task,
                what,
            }
        } else {
            PlanError::Missing {
                rank,
                index,
                task,
                what,
            }
        }
    };
    match t.op {
        Op::F | Op::RF => {
            let ahead = |u: UnitId| {
                !plan.prefetch.is_empty() && plan.prefetch.binary_search(&(u, t.mb)).is_ok()
            };
            let reader_ahead = ahead(t.unit);
            for &p in names.inputs(t.unit) {
                // Left by the previous step (see `Plan::prefetch`), unless the
                // reader runs a step ahead too.
                if ahead(p) && !reader_ahead {
                    continue;
                }
                let dep = match find(locate, r, i, &[Op::F, Op::RF], p, t.mb) {
                    Ok(dep) => dep,
                    Err(false) if lenient => {
                        complete = false;
                        continue;
                    }
                    Err(b) => return Err(err(format!("act({},{})", plan.units[p].name, t.mb), b)),
                };
                items.push(Dep::new(Tensor::Act, p, dep));
            }
        }
        Op::B | Op::BW => {
            local(locate, r, i, &[Op::F, Op::RF], t.unit, t.mb).ok_or_else(|| {
                err(
                    format!(
                        "its own forward F/RF({},{}) on this rank",
                        plan.units[t.unit].name, t.mb
                    ),
                    false,
                )
            })?;
            for &s in names.successors(t.unit) {
                if !need[s] {
                    continue;
                }
                let dep = match find(locate, r, i, &[Op::B, Op::BW], s, t.mb) {
                    Ok(dep) => dep,
                    Err(false) if lenient => {
                        complete = false;
                        continue;
                    }
                    Err(b) => return Err(err(format!("grad({},{})", plan.units[s].name, t.mb), b)),
                };
                items.push(Dep::new(Tensor::Grad, s, dep));
            }
        }
        Op::W => {
            local(locate, r, i, &[Op::B], t.unit, t.mb).ok_or_else(|| {
                err(
                    format!("B({},{}) on this rank", plan.units[t.unit].name, t.mb),
                    false,
                )
            })?;
        }
    }
    Ok(complete)
}

/// [`dependencies`] of `plan`: a plan `base` (located by `index`, its dependencies
/// `deps`, resolved leniently or not) with tasks inserted into its rank lists,
/// `at[r]` the positions in `base`'s list of rank `r` before which they went,
/// ascending, one a task (where [`crate::algebra::operators::inserted`] put them:
/// each at most the list's length).
///
/// Where `deps` left no tensor out and every task inserted is a `BW` of a unit
/// without inputs, no task reads what a task inserted produces (a unit's gradient
/// is read by the backwards of its inputs), and a task inserted reads only tasks of
/// `base`: `base`'s tasks then read what they read in `base`, each producer at its
/// new place, and only the tasks inserted are resolved. Else every task is.
pub(crate) fn dependencies_inserted(
    plan: &Plan,
    index: &TaskIndex,
    deps: &Deps,
    at: &[Vec<usize>],
) -> Result<Deps, PlanError> {
    let names = plan.unit_names();
    // Task `k` inserted on rank `r` is task `at[r][k] + k` of its new list.
    let inserted = |r: usize| at[r].iter().enumerate().map(move |(k, &pos)| (pos + k, k));
    let derivable = deps.complete
        && at.len() == plan.ranks
        && (0..plan.ranks).all(|r| {
            let list = &plan.order[r];
            deps.offsets[r].len() - 1 + at[r].len() == list.len()
                && inserted(r).all(|(i, _)| {
                    let t = &list[i];
                    t.op == Op::BW && names.inputs(t.unit).is_empty()
                })
        });
    if !derivable {
        return resolve(plan, &plan.locate(), &names, false, &[]);
    }
    let need = names.needs_backward();
    // Where task `j` of rank `q` of `base` is in `plan`: `moved[q][j]` (32-bit, as
    // a dependency's producer is).
    let moved: Vec<Vec<u32>> = (0..plan.ranks)
        .map(|q| {
            let mut shift = 0;
            (0..deps.offsets[q].len() - 1)
                .map(|j| {
                    while at[q].get(shift).is_some_and(|&pos| pos <= j) {
                        shift += 1;
                    }
                    (j + shift) as u32
                })
                .collect()
        })
        .collect();
    let locate = |op, u, mb| index.get(op, u, mb).map(|(q, j)| (q, moved[q][j] as usize));
    let added: usize = at.iter().map(Vec::len).sum();
    let mut items = Vec::with_capacity(deps.items.len() + added);
    let mut offsets = Vec::with_capacity(plan.ranks);
    for (r, list) in plan.order.iter().enumerate() {
        let mut off = Vec::with_capacity(list.len() + 1);
        let from = &deps.offsets[r];
        // `base`'s tasks `run` (from one inserted to the next): their inputs at
        // once, each producer moved.
        let copy = |run: std::ops::Range<usize>, off: &mut Vec<usize>, items: &mut Vec<Dep>| {
            let (start, end) = (from[run.start], from[run.end]);
            let shift = items.len() - start;
            off.extend(from[run].iter().map(|&o| o + shift));
            items.extend(deps.items[start..end].iter().map(|d| Dep {
                producer: (
                    d.producer.0,
                    moved[d.producer.0 as usize][d.producer.1 as usize],
                ),
                ..*d
            }));
        };
        let mut j = 0;
        for (k, &pos) in at[r].iter().enumerate() {
            copy(j..pos, &mut off, &mut items);
            j = pos;
            off.push(items.len());
            let i = pos + k;
            resolve_task(
                plan,
                &names,
                need,
                false,
                &locate,
                (r, i, &list[i]),
                &mut items,
            )?;
        }
        copy(j..from.len() - 1, &mut off, &mut items);
        off.push(items.len());
        offsets.push(off);
    }
    Ok(Deps {
        offsets,
        items,
        complete: true,
    })
}

/// An earlier task on rank `r` (before index `i`) among `ops` on `(unit, mb)`, the
/// tasks located by `locate` (a plan's [`crate::ir::plan::TaskIndex`], or a view of one).
pub(crate) fn local(
    locate: &impl Fn(Op, UnitId, usize) -> Option<(usize, usize)>,
    r: usize,
    i: usize,
    ops: &[Op],
    unit: UnitId,
    mb: usize,
) -> Option<(usize, usize)> {
    ops.iter()
        .filter_map(|&op| locate(op, unit, mb))
        .find(|&(q, j)| q == r && j < i)
}

/// The producer of `(unit, mb)` among `ops` for task `i` on rank `r`: a local earlier
/// one if any (the first in `ops`' order), else the first on another rank, the tasks
/// located by `locate` (as in [`local`]). `Err(true)`: only a later one on this rank;
/// `Err(false)`: none at all. Each op looked up once.
pub(crate) fn find(
    locate: &impl Fn(Op, UnitId, usize) -> Option<(usize, usize)>,
    r: usize,
    i: usize,
    ops: &[Op],
    unit: UnitId,
    mb: usize,
) -> Result<(usize, usize), bool> {
    let mut elsewhere = None;
    let mut later_here = false;
    for &op in ops {
        match locate(op, unit, mb) {
            Some((q, j)) if q == r && j < i => return Ok((q, j)),
            Some((q, j)) if q != r => {
                elsewhere = elsewhere.or(Some((q, j)));
            }
            Some(_) => later_here = true,
            None => {}
        }
    }
    elsewhere.ok_or(later_here)
}

/// Ideal timing of a plan: every task as early as possible, communication free.
#[derive(Clone, Debug)]
pub struct Timing {
    /// `start[r][i]`, `end[r][i]` of task `i` on rank `r`.
    pub start: Vec<Vec<f64>>,
    pub end: Vec<Vec<f64>>,
    /// The order in which tasks were settled: a topological order of the plan. 32-bit
    /// (4 bytes a task off a timing held through the placement search): a number
    /// per task held in memory, never 2^32 of them.
    pub seq: Vec<Vec<u32>>,
}

impl Timing {
    pub fn makespan(&self) -> f64 {
        self.end.iter().flatten().copied().fold(0.0, f64::max)
    }
}

/// Compute the ideal timing (list scheduling in rank order, O(tasks + deps)).
pub fn timing(plan: &Plan, deps: &Deps) -> Result<Timing, PlanError> {
    timed(plan, deps, &mut ()).map(|t| t.expect("nothing watched gives up"))
}

/// [`timing`], given up (`None`) at the first task it finds ending past `limit`:
/// the plan's makespan is then above `limit`. The tasks settled until then have
/// their times as in [`timing`]; the rest are not settled, so a cycle in the plan,
/// or too many tasks, is reported only if no task ends past `limit` first.
pub(crate) fn timing_within(
    plan: &Plan,
    deps: &Deps,
    limit: f64,
) -> Result<Option<Timing>, PlanError> {
    timed(plan, deps, &mut Within(limit))
}

/// The ideal timing of `plan` from nothing settled, `watch` seeing every step.
fn timed(plan: &Plan, deps: &Deps, watch: &mut impl Watch) -> Result<Option<Timing>, PlanError> {
    // Room for every task, nothing written: `settle` appends each time it settles.
    fn room<T>(plan: &Plan) -> Vec<Vec<T>> {
        plan.order
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect()
    }
    let (start, end, seq) = (room(plan), room(plan), room(plan));
    settle(
        plan,
        |r, i| deps.of(r, i).iter().map(Dep::producer),
        Timing { start, end, seq },
        Settling::start(plan.ranks),
        0,
        watch,
    )
}

/// Gives the list scheduler up at the first task ending past its limit.
struct Within(f64);

impl Watch for Within {
    #[inline]
    fn gives_up(&self, end: f64) -> bool {
        end > self.0
    }
}

/// The ideal timing of `plan` from `base`, the ideal timing of a plan whose rank
/// lists are the first `base.start[r].len()` tasks of `plan`'s on each rank `r`
/// (each rank's list extended at its end), the same units: only the tasks past those
/// are timed (their dependencies resolved as [`dependencies`] resolves them), the
/// others keep `base`'s times. Exactly [`timing`]'s start and end times where no
/// task of the shorter plan reads a task past it and the shorter plan's tasks read
/// the producers they read in `plan` (as when the tasks added produce what no
/// earlier task reads); `seq` numbers the added tasks after `base`'s (still a
/// topological order, not necessarily [`timing`]'s). An operator that appends work
/// to a timed plan times only what it appended.
pub fn timing_extended(plan: &Plan, base: &Timing) -> Result<Timing, PlanError> {
    timing_extended_located(plan, base.clone(), &plan.locate())
}

/// [`timing_extended`] with `plan`'s tasks located by `index` ([`Plan::locate`] of
/// `plan`), extending `base` itself: each rank's lists keep the base's times of its
/// first tasks and grow in place (not copied), for an operator that indexed the
/// shorter plan, extends its index and no longer needs the shorter plan's timing.
pub(crate) fn timing_extended_located(
    plan: &Plan,
    base: Timing,
    index: &TaskIndex,
) -> Result<Timing, PlanError> {
    let Timing {
        mut start,
        mut end,
        mut seq,
    } = base;
    let from: Vec<usize> = (0..plan.ranks)
        .map(|r| {
            let have = start.get(r).map_or(0, Vec::len);
            have.min(plan.order[r].len())
        })
        .collect();
    let deps = resolve(plan, index, &plan.unit_names(), false, &from)?;
    let counter = from.iter().sum();
    // Each rank's list: the base's times of its first `from[r]` tasks, room for the
    // rest (`settle` appends them).
    fn grown<T>(lists: &mut Vec<Vec<T>>, from: &[usize], order: &[Vec<Task>]) {
        lists.resize_with(order.len(), Vec::new);
        for ((v, &n), list) in lists.iter_mut().zip(from).zip(order) {
            v.truncate(n);
            v.reserve_exact(list.len() - v.len());
        }
    }
    grown(&mut start, &from, &plan.order);
    grown(&mut end, &from, &plan.order);
    grown(&mut seq, &from, &plan.order);
    let state = Settling::resumed(from, &end, counter);
    let inputs = |r, i| deps.of(r, i).iter().map(Dep::producer);
    let time = Timing { start, end, seq };
    settle(plan, inputs, time, state, 0, &mut ()).map(|t| t.expect("nothing watched gives up"))
}

/// The list scheduler's state between two steps ([`settle`]): a step takes the next
/// rank from the queue, settles as many of its tasks as their inputs allow, and
/// wakes the ranks that waited on it.
#[derive(Clone, Debug)]
pub(crate) struct Settling {
    /// Tasks settled on each rank (a prefix of its list).
    pub done: Vec<usize>,
    /// Each rank's clock: the end of its last settled task.
    pub clock: Vec<f64>,
    /// Per rank, the ranks that stopped on one of its unsettled tasks.
    pub waiters: Vec<Vec<usize>>,
    /// The ranks to visit, the next last.
    pub queue: Vec<usize>,
    pub queued: Vec<bool>,
    /// Tasks settled so far (the next task's settle number).
    pub counter: usize,
}

impl Settling {
    /// Before the first step: nothing settled, every rank queued, rank 0 next.
    pub(crate) fn start(ranks: usize) -> Settling {
        Settling::resumed(vec![0; ranks], &vec![Vec::new(); ranks], 0)
    }

    /// `done[r]` tasks settled on each rank `r`, ending at `end[r]`, numbered below
    /// `counter`; every rank queued, rank 0 next.
    fn resumed(done: Vec<usize>, end: &[Vec<f64>], counter: usize) -> Settling {
        let ranks = done.len();
        Settling {
            clock: (0..ranks)
                .map(|r| done[r].checked_sub(1).map_or(0.0, |i| end[r][i]))
                .collect(),
            done,
            waiters: vec![Vec::new(); ranks],
            queue: (0..ranks).rev().collect(),
            queued: vec![true; ranks],
            counter,
        }
    }
}

/// What watches the list scheduler ([`settle`]) step by step; `()` watches nothing
/// (and costs nothing). The order search's resumed timings record a base's run so
/// ([`crate::search::ideal`]).
pub(crate) trait Watch {
    /// Before step `step`, in state `state` (also once after the last step).
    #[inline]
    fn before(&mut self, _step: usize, _state: &Settling) {}

    /// Step `step` looks at task `i` of rank `r` (its next unsettled task).
    #[inline]
    fn looks(&mut self, _r: usize, _i: usize, _step: usize) {}

    /// Whether to give the run up (`None`) as a task ends at `end`.
    #[inline]
    fn gives_up(&self, _end: f64) -> bool {
        false
    }
}

impl Watch for () {}

/// List scheduling in rank order from `state` (before step `step`; the times of the
/// tasks it has settled in `time`): every other task as early as its rank order and
/// its inputs allow, `inputs(r, i)` giving the producers (rank, index) of task `i`
/// of rank `r`. `watch` sees every step; `None` as soon as it gives up.
///
/// `time`'s lists hold at least the settled tasks (`state.done[r]` on rank `r`): a
/// task's times overwrite what a longer list holds at its index, or are appended,
/// so a caller timing from scratch passes empty lists (with room) and nothing is
/// written twice.
pub(crate) fn settle<I: Iterator<Item = (usize, usize)>>(
    plan: &Plan,
    inputs: impl Fn(usize, usize) -> I,
    time: Timing,
    state: Settling,
    mut step: usize,
    watch: &mut impl Watch,
) -> Result<Option<Timing>, PlanError> {
    let p = plan.ranks;
    let Timing {
        mut start,
        mut end,
        mut seq,
    } = time;
    let mut s = state;
    // The waiters being woken (swapped with a rank's list, so that neither
    // allocates again once grown).
    let mut woken: Vec<usize> = Vec::new();
    // Each unit's cost of each op, read per task without touching the units.
    let ops = [Op::F, Op::B, Op::W, Op::BW, Op::RF];
    let costs: Vec<[f64; 5]> = plan
        .units
        .iter()
        .map(|u| ops.map(|op| op.cost(&u.cost)))
        .collect();
    let slot = |op: Op| match op {
        Op::F => 0,
        Op::B => 1,
        Op::W => 2,
        Op::BW => 3,
        Op::RF => 4,
    };
    // Task `i`'s value into `v`, which holds at least the `i` before it.
    #[inline]
    fn put<T>(v: &mut Vec<T>, i: usize, x: T) {
        if let Some(slot) = v.get_mut(i) {
            *slot = x;
        } else {
            v.push(x);
        }
    }
    loop {
        watch.before(step, &s);
        let Some(r) = s.queue.pop() else { break };
        s.queued[r] = false;
        let list = &plan.order[r];
        let before = s.done[r];
        let mut now = s.clock[r];
        let mut i = before;
        'advance: while i < list.len() {
            watch.looks(r, i, step);
            let t = &list[i];
            let mut ready = now;
            for (q, j) in inputs(r, i) {
                // A task of this rank's is settled when it is before `i`.
                let settled = if q == r { i } else { s.done[q] };
                if j >= settled {
                    s.waiters[q].push(r);
                    break 'advance;
                }
                ready = ready.max(end[q][j]);
            }
            let c = costs[t.unit][slot(t.op)];
            now = ready + c;
            if watch.gives_up(now) {
                return Ok(None);
            }
            let number = u32::try_from(s.counter).map_err(|_| PlanError::TooLarge)?;
            put(&mut start[r], i, ready);
            put(&mut end[r], i, now);
            put(&mut seq[r], i, number);
            s.counter += 1;
            i += 1;
        }
        s.done[r] = i;
        step += 1;
        s.clock[r] = now;
        if i == before {
            continue;
        }
        std::mem::swap(&mut woken, &mut s.waiters[r]);
        for w in woken.drain(..) {
            if !s.queued[w] {
                s.queued[w] = true;
                s.queue.push(w);
            }
        }
    }
    let done = &s.done;
    if (0..p).any(|r| done[r] < plan.order[r].len()) {
        let stuck: Vec<String> = (0..p)
            .filter(|&r| done[r] < plan.order[r].len())
            .map(|r| format!("rank {r} at {}", describe(plan, &plan.order[r][done[r]])))
            .collect();
        return Err(PlanError::Cycle(stuck.join(", ")));
    }
    Ok(Some(Timing { start, end, seq }))
}

/// Peak activation memory of each rank of a plan (docs/spec/program-format.md's rule: a
/// forward holds its unit's `act` until the backward that consumes it on that rank,
/// `W` if there is one, else `B`/`BW`; nothing if no backward there). A rank runs
/// one task at a time, so walking its order gives the same peak as timing it.
pub fn peak_memory(plan: &Plan) -> Vec<f64> {
    let index = plan.locate();
    plan.order
        .iter()
        .enumerate()
        .map(|(r, list)| {
            let here = |op: Op, t: &Task| index.get(op, t.unit, t.mb).is_some_and(|(q, _)| q == r);
            let (mut held, mut peak) = (0.0f64, 0.0f64);
            for t in list {
                let act = plan.units[t.unit].act;
                match t.op {
                    Op::F | Op::RF => {
                        let consumed = here(Op::B, t) || here(Op::BW, t);
                        // Only the forward the backward reads holds (an RF after an F).
                        let later_rf = t.op == Op::F && here(Op::RF, t);
                        if consumed && !later_rf {
                            held += act;
                            peak = peak.max(held);
                        }
                    }
                    Op::W => held -= act,
                    Op::B if !here(Op::W, t) => held -= act,
                    Op::BW => held -= act,
                    Op::B => {}
                }
            }
            peak
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::generators::{generate, BodyKind};
    use crate::algebra::profile::Profile;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// [`dependencies_inserted`] is [`dependencies`] of the plan with the tasks
        /// inserted (the same inputs, or the same failure): a generated plan, some
        /// of its tasks taken out for the base (its encoders' `BW`s, which it
        /// derives from the base's dependencies, or any, which it resolves in
        /// full), the encoder trainable or frozen.
        #[test]
        fn inserted_dependencies_are_the_plans(
            zbv: bool, p in 1usize..6, m in 1usize..12, trainable: bool,
            backwards_only: bool, pick in prop::collection::vec(any::<bool>(), 64),
        ) {
            let prof = Profile::from_toml_str(&format!(
                "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 0.5\nbackward = 0.7\n\
                 weight = 0.1\nactivation = 0.2\ntrainable = {trainable}\n\n\
                 [llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 0.5\n\
                 activation = 1.0\n"
            ))
            .unwrap();
            let kind = if zbv { BodyKind::ZbV } else { BodyKind::OneFOneB };
            let Ok(plan) = generate(kind, &prof, p, m) else {
                return Err(TestCaseError::reject("no such body"));
            };
            let encoders = plan.encoders.clone();
            let mut base = plan.clone();
            let mut at: Vec<Vec<usize>> = vec![Vec::new(); plan.ranks];
            let mut picks = pick.iter().cycle();
            for (r, list) in plan.order.iter().enumerate() {
                let mut kept = Vec::new();
                for t in list {
                    let out = if backwards_only {
                        t.op == Op::BW && encoders.contains(&t.unit) && *picks.next().unwrap()
                    } else {
                        *picks.next().unwrap() && *picks.next().unwrap()
                    };
                    if out {
                        at[r].push(kept.len());
                    } else {
                        kept.push(*t);
                    }
                }
                base.order[r] = kept;
            }
            let index = base.locate();
            let Ok(deps) = dependencies_lenient_located(&base, &index) else {
                return Err(TestCaseError::reject("the base does not resolve"));
            };
            prop_assert_eq!(
                dependencies_inserted(&plan, &index, &deps, &at),
                dependencies(&plan)
            );
        }
    }
}
