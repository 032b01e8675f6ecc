//! The dependencies and ideal timing of an order search's trials, patched and
//! resumed from their base's.
//!
//! A trial of the compute-order search ([`crate::search::reorder`]) is its base's plan
//! with a few tasks moved, within their ranks; its preparation for the lowering
//! resolves every task's inputs and times it ideally
//! ([`crate::algebra::analysis::timing`]: list scheduling in rank order). The
//! inputs are the base's but where the orders differ ([`View::of_trial`]). The list
//! scheduler is a sequence of steps: take the next rank from a
//! stack, settle as many of its tasks as their inputs allow, wake the ranks that
//! waited on it. [`Log`] records the base's run: every few steps the scheduler's
//! whole state (which tasks are settled, each rank's clock, the stack, who waits on
//! whom, the tasks counted), and for each task the step that first looked at it.
//!
//! When a trial's tasks all stay on their ranks and rank `q`'s list first differs
//! from the base's at index `lo`, every step before the one that first looked at
//! the base's task `lo` of `q` is the same step in the trial's run: those steps
//! look only at tasks before `lo` on `q` (the same tasks with the same inputs) and
//! at other ranks' tasks, whose inputs are the same tasks (a producer on `q` past
//! `lo` has another index, but it is unsettled in both runs, so both wait for it
//! on `q`). So [`timed_from`] starts from the last state recorded before that step
//! (of the earliest such step over the changed ranks), with the base's start, end
//! and settle number for the tasks settled by then, and runs the scheduler on from
//! there with the trial's plan and dependencies: the same timing as a full run, bit
//! for bit (its test compares them).
//!
//! The base's own preparation for the lowering (its transfers, for the meeting
//! times its trials take) reads the same record ([`Log::prepared`]) instead of
//! resolving and timing the plan again; the log keeps it, and a trial's is the
//! base's with the reads of the tasks in its windows put in place of the base's
//! there ([`View::prepared`], [`crate::algebra::lower::prepare_patched`]): the
//! full preparation, field for field (its tests compare them).
//!
//! Pure and deterministic. The scheduler is [`crate::algebra::analysis`]'s own
//! ([`settle`]): [`Log`] watches the base's run, and a trial's resumes from a
//! state it recorded.

use crate::algebra::analysis::{find, local, settle, Deps, PlanError, Settling, Timing, Watch};
use crate::algebra::lower::{prepare_patched, prepare_timed, LowerError, Prepared};
use crate::ir::plan::{Plan, Task, TaskIndex, UnitId, UnitNames};
use crate::ir::program::{Op, Tensor};

/// One input of a task, as [`crate::algebra::analysis::Dep`] has it: the tensor,
/// its unit, and the producing task's rank and index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub tensor: Tensor,
    pub unit: u32,
    pub rank: u32,
    pub index: u32,
}

/// Every task's inputs, `of(r, i)`: a plan's [`Deps`], which the trials of a base
/// patch ([`View::of_trial`]) instead of resolving every task again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Links {
    offsets: Vec<Vec<u32>>,
    items: Vec<Link>,
}

impl Links {
    /// `deps` of `plan`; `None` past 32-bit counts.
    fn new(plan: &Plan, deps: &Deps) -> Option<Links> {
        let mut out = Links {
            offsets: Vec::with_capacity(plan.ranks),
            items: Vec::new(),
        };
        for (r, list) in plan.order.iter().enumerate() {
            let mut off = Vec::with_capacity(list.len() + 1);
            for i in 0..list.len() {
                off.push(u32::try_from(out.items.len()).ok()?);
                for d in deps.of(r, i) {
                    let (q, j) = d.producer();
                    out.items.push(Link {
                        tensor: d.tensor,
                        unit: u32::try_from(d.unit()).ok()?,
                        rank: u32::try_from(q).ok()?,
                        index: u32::try_from(j).ok()?,
                    });
                }
            }
            off.push(u32::try_from(out.items.len()).ok()?);
            out.offsets.push(off);
        }
        Some(out)
    }

    /// The inputs of task `i` of rank `r`.
    #[inline]
    fn of(&self, r: usize, i: usize) -> &[Link] {
        let o = &self.offsets[r];
        &self.items[o[i] as usize..o[i + 1] as usize]
    }
}

/// The tasks of one rank where a trial's order differs from its base's: the
/// indices `lo..=hi`, the trial's index of each base task there, and those tasks'
/// inputs resolved again (`offsets` from `lo`).
#[derive(Clone, Debug)]
struct Window {
    lo: usize,
    hi: usize,
    new_of: Vec<u32>,
    offsets: Vec<u32>,
    items: Vec<Link>,
}

/// A plan's dependencies read as a base's [`Links`] with windows patched in: the
/// base's own ([`View::whole`]), or a trial's ([`View::of_trial`]), nothing copied
/// but the windows.
pub(crate) struct View<'a> {
    base: &'a Links,
    /// Per rank, where the plan differs from the base (`None`: nowhere).
    window: Vec<Option<Window>>,
}

/// The inputs of one task ([`View::of`]).
pub(crate) struct Inputs<'a> {
    items: std::slice::Iter<'a, Link>,
    /// The windows to move producers' indices by (none for inputs resolved in a
    /// window, which have the trial's indices).
    moved: Option<&'a [Option<Window>]>,
}

impl Iterator for Inputs<'_> {
    type Item = Link;

    #[inline]
    fn next(&mut self) -> Option<Link> {
        let mut l = *self.items.next()?;
        if let Some(window) = self.moved {
            l.index = moved(window, l.rank as usize, l.index as usize) as u32;
        }
        Some(l)
    }
}

/// Where task `j` of rank `q` of the base is in a plan of these windows.
#[inline]
fn moved(window: &[Option<Window>], q: usize, j: usize) -> usize {
    match &window[q] {
        Some(w) if (w.lo..=w.hi).contains(&j) => w.new_of[j - w.lo] as usize,
        _ => j,
    }
}

impl<'a> View<'a> {
    /// The base's own dependencies.
    fn whole(base: &'a Links) -> View<'a> {
        View {
            base,
            window: vec![None; base.offsets.len()],
        }
    }

    /// The inputs of task `i` of rank `r` (read per task by the scheduler and the
    /// lowering's preparation: inlined there).
    #[inline]
    pub(crate) fn of(&self, r: usize, i: usize) -> Inputs<'_> {
        match &self.window[r] {
            Some(w) if (w.lo..=w.hi).contains(&i) => {
                let k = i - w.lo;
                Inputs {
                    items: w.items[w.offsets[k] as usize..w.offsets[k + 1] as usize].iter(),
                    moved: None,
                }
            }
            _ => Inputs {
                items: self.base.of(r, i).iter(),
                moved: Some(&self.window),
            },
        }
    }

    /// [`prepare_timed`] of `plan`, timed `time`, its dependencies read from this
    /// view: the whole preparation, nothing taken from a base's.
    fn prepared_whole(&self, plan: &Plan, time: Timing) -> Result<Prepared, LowerError> {
        let of = |r: usize, i: usize| {
            self.of(r, i).map(|l| {
                let producer = (l.rank as usize, l.index as usize);
                (l.tensor, l.unit as usize, producer)
            })
        };
        prepare_timed(plan, of, time)
    }

    /// [`crate::algebra::lower::prepare_timed`] of `plan` timed `time`, whose
    /// dependencies these are: a trial of the base `log` recorded
    /// ([`View::of_trial`]), its transfers patched from the base's
    /// ([`prepare_patched`]: the reads of the tasks in the windows, which these
    /// resolved again, in place of the base's there), or resolved from these
    /// where the log has no preparation.
    pub(crate) fn prepared(
        &self,
        plan: &Plan,
        time: Timing,
        log: &Log,
    ) -> Result<Prepared, LowerError> {
        let Some(base) = &log.prepared else {
            return self.prepared_whole(plan, time);
        };
        let window = &self.window;
        let reads = window.iter().enumerate().flat_map(|(r, w)| {
            w.iter().flat_map(move |w| {
                (w.lo..=w.hi).flat_map(move |i| {
                    let k = i - w.lo;
                    let mb = plan.order[r][i].mb;
                    let items = &w.items[w.offsets[k] as usize..w.offsets[k + 1] as usize];
                    items
                        .iter()
                        .filter(move |l| l.rank as usize != r)
                        .map(move |l| {
                            let (q, j) = (l.rank as usize, l.index as usize);
                            ((l.tensor, l.unit as usize, mb, r), (q, j, i))
                        })
                })
            })
        });
        let within =
            |r: usize, i: usize| matches!(&window[r], Some(w) if (w.lo..=w.hi).contains(&i));
        prepare_patched(
            base,
            plan.ranks,
            time,
            within,
            |q, j| moved(window, q, j),
            reads,
        )
    }

    /// The dependencies of `plan`, a trial of the base of order `base` (its tasks
    /// located by `index`, its links in `log`) that keeps every task on its rank:
    /// [`crate::algebra::analysis::dependencies`] of `plan`. Where the two orders
    /// differ, from the first to the last differing index of a rank, each task's
    /// inputs are resolved again as `dependencies` resolves them (a local producer
    /// earlier on the rank, else the one elsewhere); every other task reads what it
    /// read in the base (its inputs are the same tasks, on ranks where they kept
    /// their order relative to it), at the producers' new indices. `Some(Err(()))`
    /// where `dependencies` fails; `None` where `plan` is not such a trial.
    pub(crate) fn of_trial(
        plan: &Plan,
        names: &UnitNames,
        base: &[Vec<Task>],
        index: &TaskIndex,
        log: &'a Log,
    ) -> Option<Result<View<'a>, ()>> {
        let links = log.links.as_ref()?;
        if plan.order.len() != base.len() {
            return None;
        }
        let mut window: Vec<Option<Window>> = Vec::with_capacity(base.len());
        for (r, (a, b)) in plan.order.iter().zip(base).enumerate() {
            if a.len() != b.len() {
                return None;
            }
            let Some(lo) = a.iter().zip(b).position(|(x, y)| x != y) else {
                window.push(None);
                continue;
            };
            let hi = a.iter().zip(b).rposition(|(x, y)| x != y).unwrap_or(lo);
            let mut new_of = vec![u32::MAX; hi + 1 - lo];
            for (i, t) in a.iter().enumerate().take(hi + 1).skip(lo) {
                match index.get(t.op, t.unit, t.mb) {
                    Some((q, j)) if q == r && (lo..=hi).contains(&j) => {
                        new_of[j - lo] = u32::try_from(i).ok()?;
                    }
                    _ => return None,
                }
            }
            if new_of.contains(&u32::MAX) {
                return None;
            }
            window.push(Some(Window {
                lo,
                hi,
                new_of,
                offsets: Vec::with_capacity(hi + 2 - lo),
                items: Vec::new(),
            }));
        }
        let need = names.needs_backward();
        let link = |tensor: Tensor, unit: UnitId, (q, j): (usize, usize)| Link {
            tensor,
            unit: unit as u32,
            rank: q as u32,
            index: j as u32,
        };
        for r in 0..window.len() {
            let Some((lo, hi)) = window[r].as_ref().map(|w| (w.lo, w.hi)) else {
                continue;
            };
            let mut offsets = Vec::with_capacity(hi + 2 - lo);
            let mut items = Vec::new();
            {
                let locate = |op: Op, unit: UnitId, mb: usize| {
                    index
                        .get(op, unit, mb)
                        .map(|(q, j)| (q, moved(&window, q, j)))
                };
                for (i, t) in plan.order[r].iter().enumerate().take(hi + 1).skip(lo) {
                    offsets.push(u32::try_from(items.len()).ok()?);
                    match t.op {
                        Op::F | Op::RF => {
                            let ahead = |u: UnitId| {
                                !plan.prefetch.is_empty()
                                    && plan.prefetch.binary_search(&(u, t.mb)).is_ok()
                            };
                            let reader_ahead = ahead(t.unit);
                            for &p in names.inputs(t.unit) {
                                if ahead(p) && !reader_ahead {
                                    continue;
                                }
                                let Ok(dep) = find(&locate, r, i, &[Op::F, Op::RF], p, t.mb) else {
                                    return Some(Err(()));
                                };
                                items.push(link(Tensor::Act, p, dep));
                            }
                        }
                        Op::B | Op::BW => {
                            if local(&locate, r, i, &[Op::F, Op::RF], t.unit, t.mb).is_none() {
                                return Some(Err(()));
                            }
                            for &s in names.successors(t.unit) {
                                if !need[s] {
                                    continue;
                                }
                                let Ok(dep) = find(&locate, r, i, &[Op::B, Op::BW], s, t.mb) else {
                                    return Some(Err(()));
                                };
                                items.push(link(Tensor::Grad, s, dep));
                            }
                        }
                        Op::W => {
                            if local(&locate, r, i, &[Op::B], t.unit, t.mb).is_none() {
                                return Some(Err(()));
                            }
                        }
                    }
                }
                offsets.push(u32::try_from(items.len()).ok()?);
            }
            if let Some(w) = window[r].as_mut() {
                w.offsets = offsets;
                w.items = items;
            }
        }
        Some(Ok(View {
            base: links,
            window,
        }))
    }
}

/// A base plan's ideal timing with what its trials resume from (see the module
/// documentation).
pub(crate) struct Log {
    time: Timing,
    /// The base's dependencies, which its trials patch.
    links: Option<Links>,
    /// The base's preparation for the lowering, which its trials patch
    /// ([`View::prepared`]); `None` where it fails.
    prepared: Option<Prepared>,
    /// Per rank, per task: the step that first looked at it.
    reach: Vec<Vec<u32>>,
    /// The state before every `every`-th step (step `k * every` at `k`).
    states: Vec<Settling>,
    every: usize,
}

/// No step looked at the task (only in a plan that does not time).
const UNSEEN: u32 = u32::MAX;

impl Log {
    /// The ideal timing of `plan`, whose dependencies are `deps`, recorded for its
    /// trials; `None` where the plan does not time.
    pub(crate) fn new(plan: &Plan, deps: &Deps) -> Option<Log> {
        let links = Links::new(plan, deps)?;
        let mut log = Log {
            time: empty(plan),
            links: None,
            prepared: None,
            reach: plan.order.iter().map(|l| vec![UNSEEN; l.len()]).collect(),
            states: Vec::new(),
            // A state is a few numbers per rank: one every round of the ranks
            // keeps a trial's replay short and the log small.
            every: plan.ranks.max(1),
        };
        let whole = View::whole(&links);
        let time = timed(
            plan,
            &whole,
            empty(plan),
            Settling::start(plan.ranks),
            0,
            &mut log,
        )
        .ok()?;
        log.time = time;
        log.prepared = log_prepared(plan, &links, &log.time).ok();
        log.links = Some(links);
        Some(log)
    }

    /// [`crate::algebra::lower::prepare_named`] of the base `plan` this log
    /// recorded, from the dependencies and timing it holds (the same: its
    /// dependencies are the plan's, its timing the full one).
    pub(crate) fn prepared(&self, plan: &Plan) -> Result<Prepared, LowerError> {
        match &self.prepared {
            Some(p) => Ok(p.retimed(p.time.clone())),
            None => log_prepared(
                plan,
                self.links.as_ref().expect("a log holds its links"),
                &self.time,
            ),
        }
    }

    /// The base's ideal timing.
    #[cfg(test)]
    fn time(&self) -> &Timing {
        &self.time
    }
}

/// [`crate::algebra::lower::prepare_timed`] of `plan`, whose dependencies are
/// `links` and ideal timing `time`.
fn log_prepared(plan: &Plan, links: &Links, time: &Timing) -> Result<Prepared, LowerError> {
    View::whole(links).prepared_whole(plan, time.clone())
}

/// Start, end and settle number 0 for every task of `plan`.
fn empty(plan: &Plan) -> Timing {
    let start: Vec<Vec<f64>> = plan.order.iter().map(|l| vec![0.0; l.len()]).collect();
    Timing {
        end: start.clone(),
        start,
        seq: plan.order.iter().map(|l| vec![0; l.len()]).collect(),
    }
}

/// The ideal timing of `plan`, a trial of the base whose run `log` recorded, its
/// dependencies `deps` as [`View::of_trial`] gives them (whose windows say where
/// the two orders differ): [`crate::algebra::analysis::timing`] of `plan`, resumed
/// where the two first differ (see the module documentation).
pub(crate) fn timed_from(plan: &Plan, deps: &View, log: &Log) -> Result<Timing, PlanError> {
    // The first step that looked at a task of the base that the trial changed.
    let first = (deps.window.iter().zip(&log.reach))
        .filter_map(|(w, reach)| Some(reach.get(w.as_ref()?.lo).copied().unwrap_or(0)))
        .min();
    let Some(first) = first else {
        // The same order: the same timing.
        return Ok(log.time.clone());
    };
    let k = (first as usize / log.every).min(log.states.len() - 1);
    let state = log.states[k].clone();
    // The base's times of the tasks settled by then are the trial's; every other
    // task is settled again below.
    timed(plan, deps, log.time.clone(), state, k * log.every, &mut ())
}

/// The list scheduler of [`crate::algebra::analysis::timing`] ([`settle`]) from
/// `state` (before step `step`) over the inputs `deps`, `time` holding the times of
/// the tasks settled so far, `watch` seeing every step.
fn timed(
    plan: &Plan,
    deps: &View,
    time: Timing,
    state: Settling,
    step: usize,
    watch: &mut impl Watch,
) -> Result<Timing, PlanError> {
    let inputs = |r, i| deps.of(r, i).map(|l| (l.rank as usize, l.index as usize));
    settle(plan, inputs, time, state, step, watch).map(|t| t.expect("a log never gives up"))
}

/// A base's run recorded: the state before every `every`-th step, and the step that
/// first looked at each task.
impl Watch for Log {
    fn before(&mut self, step: usize, state: &Settling) {
        if step.is_multiple_of(self.every) {
            self.states.push(state.clone());
        }
    }

    fn looks(&mut self, r: usize, i: usize, step: usize) {
        let at = &mut self.reach[r][i];
        if *at == UNSEEN {
            *at = u32::try_from(step).unwrap_or(UNSEEN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::analysis::{dependencies, timing};
    use crate::search::replan::derived_plan as plan_of;

    /// A timing's start and end times as bits, and its settle numbers.
    type Bits = (Vec<Vec<u64>>, Vec<Vec<u64>>, Vec<Vec<u32>>);

    fn bits(t: &Timing) -> Bits {
        let b = |v: &Vec<Vec<f64>>| {
            v.iter()
                .map(|l| l.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        (b(&t.start), b(&t.end), t.seq.clone())
    }

    fn plans() -> &'static [Plan] {
        static PLANS: std::sync::OnceLock<Vec<Plan>> = std::sync::OnceLock::new();
        PLANS.get_or_init(|| {
            let qwen = include_str!("../../../profiles/qwen2vl-7b.toml");
            let heavy = include_str!("../../../profiles/encoder-heavy.toml");
            let ramp = "refine(layers(zb2p(encoders = ramp, costs = unit)))";
            vec![
                plan_of(qwen, (4, 8), ramp),
                plan_of(qwen, (3, 6), "zbv"),
                plan_of(heavy, (4, 6), "1f1b"),
                plan_of(heavy, (4, 6), "zbv"),
                // Raw inputs shipped between ranks, an activation made on two.
                plan_of(qwen, (4, 8), "transpose(vision, 1f1b, backward = central)"),
            ]
        })
    }

    /// A base's preparation from its log is its full preparation: the same
    /// timing, bit for bit, and the same program under every placement rule.
    #[test]
    fn a_log_prepares_its_plan_as_the_full_preparation() {
        use crate::algebra::lower::{lower_prepared_by, prepare};
        use crate::ir::policy::SearchPolicy;
        for base in plans() {
            let log = Log::new(base, &dependencies(base).unwrap()).unwrap();
            let (ours, full) = (log.prepared(base).unwrap(), prepare(base).unwrap());
            assert_eq!(bits(&ours.time), bits(&full.time));
            for rule in crate::search::place::PLACEMENTS {
                let policy = &SearchPolicy::DEFAULT;
                assert_eq!(
                    lower_prepared_by(base, &ours, None, rule, policy).unwrap(),
                    lower_prepared_by(base, &full, None, rule, policy).unwrap(),
                );
            }
        }
    }

    /// A preparation's transfers, ends and timing, in bits.
    fn prepared_bits(
        p: &Prepared,
    ) -> (
        Vec<(
            crate::algebra::lower::TransferId,
            crate::algebra::lower::Ends,
        )>,
        Vec<Vec<u32>>,
        Bits,
    ) {
        let (transfers, ends) = p.parts();
        (transfers, ends.to_vec(), bits(&p.time))
    }

    /// Where a move puts a recomputed forward before a reader of its activation,
    /// which read it from the forward on another rank, the transfer goes (the
    /// patched preparation drops it as the full one does), and the raw input the
    /// recomputation reads is shipped to its new place: every recomputed forward
    /// of a base moved to the front of its rank.
    #[test]
    fn a_move_that_makes_a_read_local_drops_its_transfer() {
        let base = &plans()[4];
        let log = Log::new(base, &dependencies(base).unwrap()).unwrap();
        let (index, before) = (base.locate(), crate::algebra::lower::prepare(base).unwrap());
        let mut dropped = 0;
        for (r, list) in base.order.iter().enumerate() {
            for (i, _) in list.iter().enumerate().filter(|(_, t)| t.op == Op::RF) {
                let mut next = base.clone();
                let t = next.order[r].remove(i);
                next.order[r].insert(0, t);
                let names = next.unit_names();
                let view = View::of_trial(&next, &names, &base.order, &index, &log);
                let view = view.unwrap().unwrap();
                let time = timed_from(&next, &view, &log).unwrap();
                let patched = view.prepared(&next, time, &log).unwrap();
                let full = crate::algebra::lower::prepare(&next).unwrap();
                assert_eq!(prepared_bits(&patched), prepared_bits(&full));
                dropped += before.parts().0.len().saturating_sub(full.parts().0.len());
            }
        }
        assert!(dropped > 0, "no transfer dropped");
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(256))]
        /// A trial's preparation patched from its base's ([`View::prepared`]) is
        /// the full preparation of its plan ([`crate::algebra::lower::prepare`]),
        /// field for field (transfers, each rank's ends, timing bits), or fails
        /// where it fails: random moves (one to three tasks) within ranks (most
        /// a few places, some anywhere) and across ranks, of several bases (one
        /// shipping raw inputs). A move across ranks is not a trial the patch
        /// takes ([`View::of_trial`] declines it: the search prepares it whole).
        #[test]
        fn a_patched_preparation_is_the_full_preparation(
            case in 0usize..5,
            moves in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>()),
                1..4,
            ),
            near in 0usize..4,
            across in proptest::prelude::any::<bool>(),
        ) {
            let base = &plans()[case];
            let log = Log::new(base, &dependencies(base).unwrap()).unwrap();
            let near = near.min(1) * 3;
            let next = crate::search::reorder::moved(base, &moves, near, across);
            let names = next.unit_names();
            let full = crate::algebra::lower::prepare(&next);
            let view = match View::of_trial(&next, &names, &base.order, &base.locate(), &log) {
                None => {
                    proptest::prop_assert!(across && near == 0, "a move within ranks not patched");
                    return Ok(());
                }
                Some(Err(())) => {
                    proptest::prop_assert!(full.is_err());
                    return Ok(());
                }
                Some(Ok(view)) => view,
            };
            let patched = timed_from(&next, &view, &log)
                .map_err(LowerError::from)
                .and_then(|time| view.prepared(&next, time, &log));
            match (&full, &patched) {
                (Ok(a), Ok(b)) => proptest::prop_assert_eq!(prepared_bits(a), prepared_bits(b)),
                (Err(_), Err(_)) => {}
                _ => proptest::prop_assert!(false, "{:?} {:?}", full.is_ok(), patched.is_ok()),
            }
        }


        /// A trial's dependencies patched from its base's are the full resolution's
        /// (or fail where it fails), and its timing resumed from its base's log is
        /// the full timing, bit for bit (settle numbers too), or fails where the
        /// full one fails: random moves within ranks (one to three tasks, most a
        /// few places, some anywhere) of several bases; the base's own timing is
        /// the full one as well.
        #[test]
        fn a_resumed_timing_is_the_full_timing(
            case in 0usize..4,
            moves in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>(), proptest::prelude::any::<u32>()),
                1..4,
            ),
            near in 0usize..4,
        ) {
            let base = &plans()[case];
            let deps = dependencies(base).unwrap();
            let log = Log::new(base, &deps).unwrap();
            proptest::prop_assert_eq!(bits(log.time()), bits(&timing(base, &deps).unwrap()));
            let next = crate::search::reorder::moved(base, &moves, near.min(1) * 3, false);
            let names = next.unit_names();
            let patched = View::of_trial(&next, &names, &base.order, &base.locate(), &log);
            let Some(patched) = patched else {
                return Err(proptest::test_runner::TestCaseError::fail("not patched"));
            };
            let deps = match (dependencies(&next), patched) {
                (Ok(deps), Ok(view)) => {
                    let full = Links::new(&next, &deps).unwrap();
                    for (r, list) in next.order.iter().enumerate() {
                        for i in 0..list.len() {
                            let patched: Vec<Link> = view.of(r, i).collect();
                            proptest::prop_assert_eq!(full.of(r, i), &patched[..], "{} {}", r, i);
                        }
                    }
                    view
                }
                (Err(_), Err(())) => return Ok(()),
                (full, patched) => {
                    return Err(proptest::test_runner::TestCaseError::fail(format!(
                        "{:?} {:?}",
                        full.is_ok(),
                        patched.is_ok()
                    )))
                }
            };
            let full = timing(&next, &dependencies(&next).unwrap());
            let resumed = timed_from(&next, &deps, &log);
            match (&full, &resumed) {
                (Ok(a), Ok(b)) => proptest::prop_assert_eq!(bits(a), bits(b)),
                (Err(a), Err(b)) => proptest::prop_assert_eq!(a, b),
                _ => proptest::prop_assert!(false, "{:?} {:?}", full.is_ok(), resumed.is_ok()),
            }
        }
    }
}
