//! Lower bounds on the makespan of a step: what every figure can be read against.
//!
//! A step runs, for each of `m` micro-batches, every unit's forward `F`, the
//! input-gradient backward `B` of every unit that needs one, and the weight-gradient
//! `W` of every trainable unit (a fused `BW` is a `B` then a `W`). The data
//! dependencies are those of docs/spec/program-format.md: a unit's `F` after its inputs' `F`s,
//! its `B` after its own `F` and its successors' `B`s, its `W` after its `B`. A rank
//! runs one task at a time. Costs are the units' (recomputation only adds work and
//! communication only adds time, so ignoring both keeps every bound valid; the
//! ramp bound counts, under rendezvous with a link, the transfers no
//! pipeline-parallel program can do without).
//!
//! From the unit graph: the **release** of a task type, the least time from the
//! step's start before any such task can start (`rF(u)` = the longest chain of
//! forwards into `u`; `rB(u)` = after `F(u)` and after every successor's `B`;
//! `rW(u) = rB(u) + B(u)`), and its **tail**, the least time from its end to the
//! step's end (the longest chain of tasks that must follow it: the successors'
//! forwards, the unit's own backward, the predecessors' backwards, a final `W`).
//! A frozen encoder's forward may be prefetched (computed in the previous step, see
//! `Program::prefetch`), so it counts in neither: its readers are released at 0 and
//! its own forward has no tail. The same holds for each layer of a frozen encoder
//! cut into layers (a frozen non-stage unit whose inputs are all such units).
//!
//! Four bounds, each a theorem:
//!
//! - **work**: `T >= (total work) / p`. The ranks run one task at a time.
//! - **chain**: `T >= max_u rF(u) + F(u) + tail(F(u))`. One micro-batch's tasks on
//!   that path depend on each other.
//!
//! The other two hold for every *pipeline-parallel* program: one in which each LLM
//! stage unit (`llm.N`, as docs/spec/model-format.md names them, or a layer of one, `llm/N`, as
//! `layers` cuts them) computes only on its home rank, while encoders may compute
//! anywhere. Every program mpipe derives is one.
//!
//! - **rank** (a one-machine relaxation): each rank `r` runs its stages' tasks
//!   one at a time, and each task type `j` of them (a unit's `F`, `B` or `W`) has a
//!   release `rho_j`, a total work `m * cost_j` over the micro-batches and a tail
//!   `tau_j`. For any release `a` and tail `b`, let `J(a, b)` be the types with
//!   `rho_j >= a` and `tau_j >= b`; then `T >= a + sum_{j in J(a, b)} m cost_j + b`
//!   (the largest over `a`, `b` and ranks, for non-empty `J`). *Proof:* no task of
//!   `J(a, b)` starts before `a`, and only rank `r` runs them (pipeline-parallel),
//!   one at a time, so the last of them ends at `a + sum` or later; it has a tail of
//!   at least `b`, so the step lasts at least `b` more. With `a` and `b` the least
//!   release and tail this is the rank's whole stage work from its first possible
//!   start; a larger `a` sees what the whole-work form cannot: in a V, the rank
//!   holding the first and the last stage can do little but the first stage's
//!   forwards until a micro-batch has passed every stage, and the last stage's work
//!   (with an LM head, the heaviest) is all still ahead of it then.
//!   **With a link, under rendezvous**, the rank's transfers between stages add
//!   `H_r(a, b)`, the largest total over its classes (rank, direction, peer) of
//!   those that start at or after `a` and have tails of at least `b` (the transfers,
//!   their starts and tails and why one class holds its rank over disjoint
//!   intervals are the ramp bound's, below): each holds rank `r` within
//!   `[a, T - b]`, where the tasks of `J(a, b)` also run, and a rank held by an
//!   operation does not compute, so `T >= a + sum + H_r(a, b) + b`.
//! - **ramp**: with `S_r` the stages of rank `r` and `R_r` the least release of
//!   their forwards, `p T >= work + I_start + I_end` where
//!   `I_start = max(0, sum_r R_r - E_F)` and
//!   `I_end = max(0, sum_r max(0, Q'_r - W_r) - E_B)`, where `W_r` is the
//!   weight-gradient work of `S_r`, `Q'_r` the least tail of the `F`s and `B`s of
//!   `S_r`, `E_F` the encoder (non-stage) work released before `max_r R_r`, and `E_B`
//!   the encoder work whose tail is shorter than `max_r Q'_r`.
//!   *Proof:* before `R_r`, rank `r` can run no task of its own stages, and no other
//!   rank's (pipeline-parallel), so only encoder tasks released by then; the windows
//!   `[0, R_r)` therefore hold at least `sum_r R_r - E_F` of idle time. In the last
//!   `Q'_r` of the step, rank `r` can run no `F` or `B` of its stages (their tails
//!   are at least `Q'_r`), only its own `W`s and encoder tasks with a shorter tail;
//!   so those windows hold at least `sum_r max(0, Q'_r - W_r) - E_B` of idle time.
//!   The two windows of a rank do not overlap: some `F` or `B` of `S_r` starts at or
//!   after `R_r` and ends at or before `T - Q'_r`. Busy plus idle time is `p T`.
//!
//!   **With a link, under rendezvous** (`link`: every transfer of a unit's output
//!   takes `latency + bytes / bandwidth`, and a `SEND`/`RECV` holds its rank from
//!   when it is reached until it completes), the ramp bound also counts the time
//!   the transfers between stages must hold the ranks: `p T >= work + I_start +
//!   I_end + sum_r H_r`. In a pipeline-parallel program, for each stage `s` reading
//!   a stage `q` homed on another rank, and each micro-batch, `home(s)` receives
//!   `act(q)` from `home(q)` (only `home(q)` computes `F(q)`, and a `SEND` follows
//!   the action producing its tensor on its rank), and, when both need a backward,
//!   `home(q)` receives `grad(s)` from `home(s)`. Each such transfer `i` of time
//!   `d_i` meets at `x_i`, when both ranks have reached it, and completes no
//!   earlier than `x_i + d_i` on both (a batch completes at the latest of its
//!   members' completions); so both ranks are held, not computing, over
//!   `[x_i, x_i + d_i]`. It starts no earlier than its producer ends
//!   (`rho_i = rF(q) + F(q)` for `act(q)`, `rB(s) + B(s)` for `grad(s)`), and its
//!   consumer (`F(s)`, `B(q)`) starts after it, so it ends at least
//!   `tau_i = F(s) + tail(F(s))` (`B(q) + tail(B(q))`) before the step does. A
//!   rank's operations do not overlap, and one operation holds at most one `SEND`
//!   to and one `RECV` from each peer (rule 3), so the transfers of one class
//!   (rank, direction, peer) hold the rank over disjoint intervals: with `H_r` the
//!   largest class total, counting only the transfers with `rho_i >= R_r` and
//!   `tau_i >= Q'_r` (they lie outside both windows of `r`), rank `r` idles
//!   `H_r` more outside its windows. Under eager semantics a sender is not held,
//!   and a receiver that comes late is not either, so nothing is added.
//!
//! The bound is the largest of the four. A schedule at the bound is optimal among
//! pipeline-parallel programs for these units; `tests/bound.rs` checks every bound
//! against the optimum found by exhaustive search on small cases. The units depend
//! on how the LLM is split into stages (one per rank, several in a loop, two in a
//! V), so [`profile_bound`] takes the least bound over the splits the algebra uses
//! (even and balanced layers, 1-4 looped chunks or a V, and the splits
//! `zb2p(encoders = ramp)` chooses), each also with every encoder cut layer by
//! layer (which bounds every program that cuts an encoder into chunks): the figure
//! every schedule of a profile is compared with (`tests/bound_splits.rs` checks it
//! against the own-split bound of derived programs).

use crate::algebra::profile::{Profile, Split};
use crate::algebra::units::{build_units, layer_chunks, replace_with_chunks};
use crate::ir::model::CommModel;
use crate::ir::plan::{needs_backward, Layout, Plan};
use crate::ir::program::Op;
use crate::ir::program::Unit;
use serde::Serialize;
use std::collections::BTreeMap;

/// The splits of the LLM into stages that the algebra's bodies use: 1-4 chunks per
/// rank in a loop (`1f1b` .. `interleaved(v = 4)`), 2 in a V (`zbv`, `dualpipev`);
/// each with the same layers per stage or the same work per stage (`balance`).
const SPLITS: [(usize, Layout); 5] = [
    (1, Layout::Looped),
    (2, Layout::Looped),
    (3, Layout::Looped),
    (4, Layout::Looped),
    (2, Layout::VShape),
];

/// A bound for `profile` on `ranks` x `microbatches` that holds whichever of the
/// algebra's stage splits a program uses: the least of the splits' bounds. `link`
/// as for [`lower_bound`]. `None` when the profile cannot be split over the ranks
/// at all.
pub fn profile_bound(
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
    link: Option<CommModel>,
) -> Option<Bound> {
    // Both ways of splitting layers (`balance` chooses the other one), unless the
    // profile fixes the split with a layout.
    let mut profiles = vec![profile.clone()];
    if profile.llm.layout.is_none() {
        let mut balanced = profile.clone();
        balanced.llm.split = match profile.llm.split {
            Split::Even => Split::Balanced,
            Split::Balanced => Split::Even,
        };
        profiles.push(balanced);
    }
    let ramps: Vec<Vec<Unit>> = profiles
        .iter()
        .flat_map(|p| ramp_splits(p, ranks, microbatches))
        .collect();
    profiles
        .iter()
        .flat_map(|p| {
            SPLITS
                .iter()
                .filter_map(move |&(chunks, layout)| build_units(p, ranks, chunks, layout).ok())
        })
        .chain(ramps)
        .flat_map(|units| [layer_by_layer(profile, &units), units])
        .map(|units| lower_bound(&units, ranks, microbatches, link))
        .min_by(|a, b| a.value().total_cmp(&b.value()))
}

/// The stage splits `zb2p(encoders = ramp)` chooses for the profile (one and two
/// looped chunks per rank, see [`crate::algebra::generators::ramp_split`]; from the even and
/// the balanced split, as `balance` wraps it or not), as units: they need not be
/// among [`SPLITS`]' even or balanced ones, and a program using one is bounded by
/// its own split.
fn ramp_splits(profile: &Profile, ranks: usize, microbatches: usize) -> Vec<Vec<Unit>> {
    if profile.llm.layout.is_some() {
        return Vec::new();
    }
    let Ok(single) = build_units(profile, ranks, 1, Layout::Looped) else {
        return Vec::new();
    };
    [1, 2]
        .into_iter()
        .filter_map(|v| {
            let split = crate::algebra::ramp::ramp_split(profile, &single, ranks, microbatches, v)?;
            build_units(&split.applied(profile, v), ranks, v, Layout::Looped).ok()
        })
        .collect()
}

/// `units` with every encoder cut into one unit per layer, chained in data order,
/// the last feeding the encoder's readers. A program that cuts an encoder into
/// chunks of several layers (`chain`, `zb2p(encoders = chain)`) runs each chunk's
/// layers back to back, which a per-layer program may also do, so a bound on every
/// per-layer program holds for every chunking (and for the whole encoder): the
/// finer units only relax the order (a layer's `W` may follow its own `B` rather
/// than the whole encoder's).
fn layer_by_layer(profile: &Profile, units: &[Unit]) -> Vec<Unit> {
    let mut out = units.to_vec();
    for spec in &profile.encoders {
        if let Some(e) = out.iter().position(|u| u.name == spec.name) {
            let home = out[e].home;
            out = replace_with_chunks(&out, e, layer_chunks(spec, home));
        }
    }
    out
}

/// The lower bounds of one step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bound {
    /// Total minimal compute divided by the number of ranks.
    pub work: f64,
    /// The longest single micro-batch dependency chain.
    pub chain: f64,
    /// The busiest rank's own stage work released after some point, from that point
    /// to the least tail of that work (pipeline-parallel programs).
    pub rank: f64,
    /// Total work plus the idle time the pipeline's ramp-up and ramp-down force,
    /// and the transfers between stages hold the ranks under rendezvous with a
    /// link, over the ranks (pipeline-parallel programs).
    pub ramp: f64,
    /// The part of `ramp` the transfers between stages force (0 without a link or
    /// under eager semantics).
    pub transfers: f64,
}

impl Bound {
    /// The sharpest of the bounds.
    pub fn value(&self) -> f64 {
        self.work.max(self.chain).max(self.rank).max(self.ramp)
    }
}

/// Release times and tails of every unit's task types.
struct Chains {
    need: Vec<bool>,
    trainable: Vec<bool>,
    inputs: Vec<Vec<usize>>,
    f: Vec<f64>,
    b: Vec<f64>,
    w: Vec<f64>,
    r_f: Vec<f64>,
    r_b: Vec<f64>,
    q_f: Vec<f64>,
    q_b: Vec<f64>,
}

impl Chains {
    fn of(units: &[Unit]) -> Chains {
        let n = units.len();
        let need = needs_backward(units);
        let f: Vec<f64> = units.iter().map(|u| u.cost.f).collect();
        let b: Vec<f64> = (0..n)
            .map(|u| if need[u] { units[u].cost.b } else { 0.0 })
            .collect();
        let w: Vec<f64> = (0..n)
            .map(|u| {
                if units[u].trainable {
                    units[u].cost.w
                } else {
                    0.0
                }
            })
            .collect();
        let index = |name: &str| units.iter().position(|u| u.name == name);
        let inputs: Vec<Vec<usize>> = units
            .iter()
            .map(|u| u.inputs.iter().filter_map(|x| index(x)).collect())
            .collect();
        let succs: Vec<Vec<usize>> = (0..n)
            .map(|u| (0..n).filter(|&s| inputs[s].contains(&u)).collect())
            .collect();
        // A frozen encoder (no backward, not a stage, and reading only the raw
        // micro-batch or units that are free themselves, as the layers of one cut by
        // `prefetch` do) may be prefetched: its output for this step can come from
        // the previous one, so it delays nothing and nothing in this step has to
        // follow it. Topological order: inputs are decided first.
        let mut free = vec![false; n];
        for u in 0..n {
            free[u] = !need[u] && !units[u].role.is_stage() && inputs[u].iter().all(|&p| free[p]);
        }
        // Units are in topological order: forwards forwards, backwards backwards.
        let mut r_f = vec![0.0f64; n];
        for u in 0..n {
            r_f[u] = inputs[u]
                .iter()
                .filter(|&&p| !free[p])
                .map(|&p| r_f[p] + f[p])
                .fold(0.0, f64::max);
        }
        let mut r_b = vec![0.0f64; n];
        let mut q_f = vec![0.0f64; n];
        for u in (0..n).rev() {
            r_b[u] = succs[u]
                .iter()
                .filter(|&&s| need[s])
                .map(|&s| r_b[s] + b[s])
                .fold(r_f[u] + f[u], f64::max);
        }
        let mut q_b = vec![0.0f64; n];
        for u in 0..n {
            // After B(u): W(u), and the inputs' backwards.
            q_b[u] = inputs[u]
                .iter()
                .filter(|&&p| need[p])
                .map(|&p| b[p] + q_b[p])
                .fold(w[u], f64::max);
        }
        for u in (0..n).rev() {
            // After F(u): the successors' forwards, and the unit's own backward.
            if free[u] {
                continue;
            }
            let own = if need[u] { b[u] + q_b[u] } else { 0.0 };
            q_f[u] = succs[u].iter().map(|&s| f[s] + q_f[s]).fold(own, f64::max);
        }
        Chains {
            need,
            inputs,
            trainable: units.iter().map(|u| u.trainable).collect(),
            f,
            b,
            w,
            r_f,
            r_b,
            q_f,
            q_b,
        }
    }

    /// The task types of `units` (F; B if needed; W if trainable) as `(release,
    /// work of all `m` micro-batches, tail)`.
    fn task_types(&self, units: &[usize], m: f64) -> Vec<(f64, f64, f64)> {
        let mut jobs = Vec::with_capacity(3 * units.len());
        for &u in units {
            jobs.push((self.r_f[u], self.f[u] * m, self.q_f[u]));
            if self.need[u] {
                jobs.push((self.r_b[u], self.b[u] * m, self.q_b[u]));
            }
            if self.trainable[u] {
                jobs.push((self.r_b[u] + self.b[u], self.w[u] * m, 0.0));
            }
        }
        jobs
    }

    fn work(&self, u: usize) -> f64 {
        self.f[u] + self.b[u] + self.w[u]
    }
}

/// The one-machine bound of a rank's task types `(release, work, tail)`: the
/// largest `a + (work of the types released at or after a, with tails of at least
/// b) + H + b` over the releases `a` and tails `b` of the types (0 for none), `H`
/// the largest total, over the rank's classes of transfers (`held`: per class, the
/// transfers' `Held`, their time over all micro-batches), of those that start at or
/// after `a` and have tails of at least `b` (none without a link).
fn window_bound(jobs: &[(f64, f64, f64)], held: &[Vec<Held>]) -> f64 {
    let mut best = 0.0f64;
    for &(a, ..) in jobs {
        for &(.., b) in jobs {
            let mut chosen = jobs.iter().filter(|j| j.0 >= a && j.2 >= b).peekable();
            if chosen.peek().is_none() {
                continue;
            }
            let hold = held_within(held, a, b);
            best = best.max(a + chosen.map(|j| j.1).sum::<f64>() + hold + b);
        }
    }
    best
}

/// A floor under the makespan of every program lowered from `plan`, by any of the
/// lowerings and refinements of the derivation (`None` when the plan's
/// dependencies do not resolve).
///
/// A lowering keeps each rank's tasks and the order of its forwards and input
/// backwards (`F`, `RF`, `B`, `BW`); only weight gradients (`W`, which nothing
/// reads) move, and transfers, collectives and waiting only add time. So:
///
/// - each rank runs all its tasks one at a time: `T >= busy(r)`;
/// - each forward and input backward ends no sooner than in the ideal timing of
///   the plan with its `W`s taken out (every dependency is kept, the tasks before
///   it on its rank are the same or fewer, nothing takes less time): `T >=` that
///   timing's makespan.
///
/// Derivations compare candidates by it before deriving one in full: a candidate
/// whose floor is above a derived program's makespan cannot beat it.
pub(crate) fn lowering_floor(plan: &Plan) -> Option<f64> {
    use crate::algebra::analysis::{dependencies, timing};
    let busy = plan
        .order
        .iter()
        .map(|list| {
            list.iter()
                .map(|t| t.op.cost(&plan.units[t.unit].cost))
                .sum::<f64>()
        })
        .fold(0.0, f64::max);
    // The plan's other parts cloned, its lists copied without their `W`s (not
    // copied whole first).
    let without_w = Plan {
        order: plan
            .order
            .iter()
            .map(|list| {
                let mut kept = Vec::with_capacity(list.len());
                kept.extend(list.iter().filter(|t| t.op != Op::W));
                kept
            })
            .collect(),
        units: plan.units.clone(),
        stages: plan.stages.clone(),
        encoders: plan.encoders.clone(),
        input_ships: plan.input_ships.clone(),
        prefetch: plan.prefetch.clone(),
        ..*plan
    };
    let deps = dependencies(&without_w).ok()?;
    let ideal = timing(&without_w, &deps).ok()?.makespan();
    Some(busy.max(ideal))
}

/// Bounds for `units` (in topological order, with their homes) run with
/// `microbatches` on `ranks` ranks. `link`: the link model when transfers hold
/// their ranks ([`crate::judge::simulate::SimOptions::held_link`]: under rendezvous), else
/// `None`.
pub fn lower_bound(
    units: &[Unit],
    ranks: usize,
    microbatches: usize,
    link: Option<CommModel>,
) -> Bound {
    let c = Chains::of(units);
    let m = microbatches as f64;
    let p = ranks.max(1);
    let n = units.len();
    let total: f64 = (0..n).map(|u| c.work(u)).sum::<f64>() * m;
    let work = total / p as f64;
    let chain = (0..n)
        .map(|u| c.r_f[u] + c.f[u] + c.q_f[u])
        .fold(0.0, f64::max);

    let stages: Vec<usize> = (0..n).filter(|&u| units[u].role.is_stage()).collect();
    let transfers = link.map_or_else(BTreeMap::new, |link| {
        stage_transfers(units, &c, &stages, link)
    });
    let (mut rank, mut start_windows, mut end_windows) = (0.0f64, 0.0, 0.0);
    let (mut r_max, mut q_max) = (0.0f64, 0.0f64);
    // `H_r` of the module documentation, summed over the ranks.
    let mut held = 0.0;
    for r in 0..p {
        let own: Vec<usize> = stages
            .iter()
            .copied()
            .filter(|&u| units[u].home == r)
            .collect();
        if own.is_empty() {
            continue;
        }
        let w_r: f64 = own.iter().map(|&u| c.w[u]).sum::<f64>() * m;
        let r_r = own.iter().map(|&u| c.r_f[u]).fold(f64::INFINITY, f64::min);
        let q_fb_r = own
            .iter()
            .map(|&u| if c.need[u] { c.q_b[u] } else { c.q_f[u] })
            .fold(f64::INFINITY, f64::min);
        let classes = classes_of(&transfers, r, m);
        rank = rank.max(window_bound(&c.task_types(&own, m), &classes));
        // The transfers outside both of the rank's windows.
        held += held_within(&classes, r_r, q_fb_r);
        start_windows += r_r;
        end_windows += (q_fb_r - w_r).max(0.0);
        r_max = r_max.max(r_r);
        q_max = q_max.max(q_fb_r);
    }
    // Encoder (non-stage) work that could run in a start window (released before the
    // latest window ends) or an end window (tail shorter than the longest one).
    let (mut e_f, mut e_b) = (0.0, 0.0);
    for u in (0..n).filter(|u| !stages.contains(u)) {
        let in_start = [
            (c.r_f[u], c.f[u]),
            (c.r_b[u], c.b[u]),
            (c.r_b[u] + c.b[u], c.w[u]),
        ];
        e_f += in_start
            .iter()
            .filter(|(release, _)| *release < r_max)
            .map(|(_, x)| x)
            .sum::<f64>()
            * m;
        let in_end = [(c.q_f[u], c.f[u]), (c.q_b[u], c.b[u]), (0.0, c.w[u])];
        e_b += in_end
            .iter()
            .filter(|(tail, _)| *tail < q_max)
            .map(|(_, x)| x)
            .sum::<f64>()
            * m;
    }
    let idle = (start_windows - e_f).max(0.0) + (end_windows - e_b).max(0.0);
    let ramp = (total + idle + held) / p as f64;
    Bound {
        work,
        chain,
        rank,
        ramp,
        transfers: held / p as f64,
    }
}

/// One transfer between stages (of one micro-batch): its time, the earliest its
/// ranks can meet (its producer's least end), and the least time from its end to
/// the step's (its consumer's and what must follow it).
#[derive(Clone, Copy)]
struct Held {
    time: f64,
    start: f64,
    tail: f64,
}

/// The transfers between stages a pipeline-parallel program must make, one per
/// micro-batch and `(gradient?, unit, from, to)` however many units on the
/// receiving rank read it: their time on `link`, their least start and their least
/// tail (see the module documentation).
fn stage_transfers(
    units: &[Unit],
    c: &Chains,
    stages: &[usize],
    link: CommModel,
) -> BTreeMap<(bool, usize, usize, usize), Held> {
    let mut is_stage = vec![false; units.len()];
    for &s in stages {
        is_stage[s] = true;
    }
    let mut transfers: BTreeMap<(bool, usize, usize, usize), Held> = BTreeMap::new();
    let mut add = |key, held: Held| {
        let e = transfers.entry(key).or_insert(held);
        e.tail = e.tail.min(held.tail);
    };
    for &s in stages {
        for &q in &c.inputs[s] {
            let (from, to) = (units[q].home, units[s].home);
            if !is_stage[q] || from == to {
                continue;
            }
            let act = Held {
                time: link.transfer_time(units[q].bytes),
                start: c.r_f[q] + c.f[q],
                tail: c.f[s] + c.q_f[s],
            };
            add((false, q, from, to), act);
            if c.need[s] && c.need[q] {
                let grad = Held {
                    time: link.transfer_time(units[s].bytes),
                    start: c.r_b[s] + c.b[s],
                    tail: c.b[q] + c.q_b[q],
                };
                add((true, s, to, from), grad);
            }
        }
    }
    transfers
}

/// Rank `r`'s transfers by class (`(sends?, peer)`, in order), each with its time
/// over all `m` micro-batches.
fn classes_of(
    transfers: &BTreeMap<(bool, usize, usize, usize), Held>,
    r: usize,
    m: f64,
) -> Vec<Vec<Held>> {
    let mut classes: BTreeMap<(bool, usize), Vec<Held>> = BTreeMap::new();
    for (&(_, _, from, to), x) in transfers {
        let all = Held {
            time: x.time * m,
            ..*x
        };
        if from == r {
            classes.entry((true, to)).or_default().push(all);
        }
        if to == r {
            classes.entry((false, from)).or_default().push(all);
        }
    }
    classes.into_values().collect()
}

/// The largest total, over a rank's classes of transfers ([`classes_of`]), of
/// those that start at or after `a` and have tails of at least `b`: the time they
/// hold the rank within `[a, T - b]`, one class's over disjoint intervals.
fn held_within(classes: &[Vec<Held>], a: f64, b: f64) -> f64 {
    classes
        .iter()
        .map(|class| {
            class
                .iter()
                .filter(|x| x.start >= a && x.tail >= b)
                .map(|x| x.time)
                .sum::<f64>()
        })
        .fold(0.0, f64::max)
}
