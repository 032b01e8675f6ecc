//! `auto`: the fastest expression of the algebra for a profile, found by search.
//!
//! The search space ([`candidates`]) is every body generator (`1f1b`, `gpipe`, `zbh1`,
//! `zbv`, `dualpipev`, the list search of both (`zbv(list = search)`,
//! `zbh1(list = search)`), `interleaved(v = 2..4)` and `v = 5..8` where the chunks split
//! the layers evenly, `zb2p` with one chunk (also in lockstep, `costs = unit`), two
//! looped and two in a V, and `zb2p(encoders = spread | chain | ramp)`, which place
//! the encoders themselves, in eight forms, `ramp` (also over two looped chunks per
//! rank; it chooses the split itself, starting from the balanced one under
//! `balance`, so it comes under `balance` too, and with the frozen encoders
//! `prefetch`ed), the
//! fused-backward bodies also under `split_w`, and for each encoder of the profile every placement the operators offer:
//! inline (the body's own), `transpose` with each owner mode (`spare` too) and, for a trainable
//! encoder, each backward mode (modes that cannot differ, such as owners when
//! micro-batches <= ranks, are enumerated once), `fill`, and for a frozen encoder
//! `prefetch`; every candidate also
//! under `balance` (unless the profile fixes the split with `llm.layout`). Every peer schedule the evaluation
//! compares against is in it, so `auto` is never slower than any of them.
//!
//! The space multiplies with each encoder's placements (about twenty, in every
//! nesting order), so only the heaviest few ([`SearchPolicy::full_encoders`]) encoders are searched
//! that way. The others are placed alike, outside them: all inline, all
//! `transpose`d or all `fill`ed, so a third encoder or more triples the space once
//! (the peers, which may nest differently, are added). On a 2-core machine, Omni's
//! two encoders and a third took 9.3 s at 8 x 32 and 76 s at 16 x 128; with six
//! more small ones, 30 s at 8 x 32.
//!
//! The search is exact over that space and cheap: each candidate's plan is evaluated
//! and timed ideally (no communication, asynchronous transfers), which no program of
//! the plan can beat; candidates are then derived in full (lowered, verified,
//! simulated, checked against the memory limit) in order of that ideal time, each
//! as a derivation by name derives it (`named::derive_candidate`: with the
//! alternatives it chooses among, such as `transpose`'s other placements, under the
//! stop rule below), so `auto` is never behind a candidate as the user would derive
//! it; and the search stops at the first candidate whose ideal time is more than
//! [`SearchPolicy::derive_within`] behind the best simulated time found (refinement can beat a
//! plan's ideal time, since it changes the plan). Ties go to the lower peak memory,
//! then to the earlier candidate, so the answer is deterministic. The five fastest,
//! and the one whose
//! plan is fastest ideally (refinement works towards that time: under rendezvous a
//! plan well ahead there can come out behind in its first lowering and win once
//! refined), are then refined, and the compute order of the winner (and of that
//! one, when it is within [`SearchPolicy::ideal_within`] of it) searched. Where micro-batches are
//! at least twice the ranks and the result is still more than [`SearchPolicy::goal`] above the
//! lower bound, that order search runs again with a larger budget (the bound tells
//! the search where more effort may pay; elsewhere it costs nothing).
//!
//! Speed, with the same answer: candidates that share inner expressions (a body under
//! `split_w`, a placement of one encoder under several of the other's) are planned one
//! after another on one thread, which remembers the last few sub-expression plans
//! (`derive::with_plan_memo`); a candidate whose plan equals an earlier one's (about
//! half of them on the two-encoder profile: `balance` finding the even split, an
//! operator with nothing to move) shares its twin's derivation, which it could only
//! tie; phase 1 keeps no plan, only each candidate's ideal time, task count and a
//! fingerprint of its plan (at 1 x 65536 the plans of every candidate took 3.6 GB),
//! and a candidate is planned again where it is derived (planning is
//! deterministic; twins with equal fingerprints are confirmed by comparing the
//! plans, on the core that would derive the candidate); full derivations run on every core, a few candidates at a time in ideal
//! order, their results taken in that order (so the stop and the winner are the
//! sequential search's). Inside `schedule!` too: nothing the search holds is tied to a
//! thread.

use crate::algebra::analysis::{dependencies, timing};
use crate::algebra::eval::{plan_of, with_plan_memo, DeriveError, ErrorKind, Request};
use crate::algebra::expr::{Expr, Span};
use crate::algebra::operators::fill::FillCap;
use crate::algebra::operators::layers::layers;
use crate::algebra::profile::Profile;
use crate::ir::compare::{less, sort_best_first, Score};
use crate::ir::plan::Plan;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::Op;
use crate::ir::progress::Stage;
use crate::judge::compare::span;
use crate::judge::simulate::Mode;
use crate::search::finish::{finish, finish_replaying, Derived};
use crate::search::named::{alternatives, derive_candidate, within_limit, Chosen};
use crate::search::reorder::Trials;
use std::cell::Cell;

/// A value of a body's `key = value` argument.
#[derive(Clone, Copy)]
enum Val {
    Int(u64),
    Name(&'static str),
}
use Val::{Int, Name};

/// A body generator and its `key = value` arguments, as `auto` names it.
#[derive(Clone, Copy)]
struct Body(&'static str, &'static [(&'static str, Val)]);

impl Body {
    fn expr(self) -> Expr {
        self.1
            .iter()
            .fold(Expr::leaf(self.0), |e, &(k, v)| match v {
                Int(i) => e.with_int(k, i),
                Name(n) => e.with_name(k, n),
            })
    }
}

/// Bodies whose backward is fused (`BW`), which `split_w` can split.
const FUSED: [Body; 5] = [
    Body("1f1b", &[]),
    Body("gpipe", &[]),
    Body("interleaved", &[("v", Int(2))]),
    Body("interleaved", &[("v", Int(3))]),
    Body("interleaved", &[("v", Int(4))]),
];
/// The most chunks per rank an `interleaved` body of [`FUSED`] names.
const LISTED_V: usize = 4;

/// Bodies that already split `B` from `W`.
const SPLIT: [Body; 9] = [
    Body("zbh1", &[]),
    Body("zbv", &[]),
    Body("dualpipev", &[]),
    Body("zb2p", &[]),
    Body("zb2p", &[("costs", Name("unit"))]),
    Body("zb2p", &[("v", Int(2))]),
    Body("zb2p", &[("layout", Name("v"))]),
    Body("zbv", &[("list", Name("search"))]),
    Body("zbh1", &[("list", Name("search"))]),
];

/// Bodies that place the encoders themselves (on every rank), tried with no
/// operator moving an encoder.
const WOVEN: [Body; 5] = [
    Body("zb2p", &[("encoders", Name("spread"))]),
    Body(
        "zb2p",
        &[("encoders", Name("spread")), ("costs", Name("unit"))],
    ),
    Body(
        "zb2p",
        &[("encoders", Name("spread")), ("layout", Name("v"))],
    ),
    Body("zb2p", &[("encoders", Name("chain"))]),
    Body(
        "zb2p",
        &[("encoders", Name("chain")), ("costs", Name("unit"))],
    ),
];

/// Woven bodies for two encoders or more: all of them chained along the ranks.
const CHAINS: [Body; 2] = [
    Body("zb2p", &[("encoders", Name("chains"))]),
    Body(
        "zb2p",
        &[("encoders", Name("chains")), ("costs", Name("unit"))],
    ),
];

/// Woven bodies that choose the stage split themselves: not under `balance`, and
/// not when the profile fixes the split.
const RAMP: [Body; 3] = [
    Body("zb2p", &[("encoders", Name("ramp"))]),
    Body(
        "zb2p",
        &[("encoders", Name("ramp")), ("costs", Name("unit"))],
    ),
    Body("zb2p", &[("v", Int(2)), ("encoders", Name("ramp"))]),
];

/// How one encoder is placed: the operator that moves it and the `key = name`
/// arguments after the body (`transpose(vision, BODY, owners = spare)`).
#[derive(Clone, Debug)]
struct Placing {
    op: &'static str,
    keys: Vec<(&'static str, &'static str)>,
}

impl Placing {
    fn new(op: &'static str, keys: &[(&'static str, &'static str)]) -> Placing {
        Placing {
            op,
            keys: keys.to_vec(),
        }
    }

    /// `body` with `encoder` placed this way.
    fn around(&self, encoder: &str, body: Expr) -> Expr {
        let e = body.under(self.op, Some(encoder));
        self.keys.iter().fold(e, |e, &(k, v)| e.with_name(k, v))
    }
}

/// `balance(e)`.
fn balance(e: Expr) -> Expr {
    e.under("balance", None)
}

/// Every expression `auto` considers for `profile` on `ranks` x `microbatches`, in the
/// order that breaks ties, under the default policy.
pub fn candidates(profile: &Profile, ranks: usize, microbatches: usize) -> Vec<Expr> {
    candidates_for(profile, ranks, microbatches, &SearchPolicy::DEFAULT)
}

/// [`candidates`] under `policy` (its [`SearchPolicy::max_chunks`],
/// [`SearchPolicy::full_encoders`] and [`SearchPolicy::prefetch`]).
pub fn candidates_for(
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
    policy: &SearchPolicy,
) -> Vec<Expr> {
    // More chunks where they split the layers exactly: finer tasks wait less for
    // their neighbours under rendezvous, and equal chunks keep the loop even.
    let layers = profile.llm.layers as usize;
    let fused: Vec<Expr> = FUSED
        .iter()
        .map(|b| b.expr())
        .chain(
            (LISTED_V + 1..=policy.max_chunks)
                .filter(|v| ranks > 0 && layers.is_multiple_of(ranks * v))
                .map(|v| Expr::leaf("interleaved").with_int("v", v as u64)),
        )
        .collect();
    // Each body, and whether its backward is fused.
    let mut bodies: Vec<(Expr, bool)> = Vec::new();
    bodies.extend(fused.iter().map(|b| (b.clone(), true)));
    bodies.extend(SPLIT.iter().map(|b| (b.expr(), false)));
    bodies.extend(
        fused
            .iter()
            .map(|b| (b.clone().under("split_w", None), false)),
    );
    // Per encoder: `None` inline, else how it is placed. The heaviest encoders are
    // searched in full; the others are placed alike, below.
    let full = searched_in_full(profile, policy.full_encoders);
    let others: Vec<usize> = (0..profile.encoders.len())
        .filter(|i| !full.contains(i))
        .collect();
    let mut placements: Vec<Vec<Option<Placing>>> = Vec::new();
    for (i, enc) in profile.encoders.iter().enumerate() {
        if !full.contains(&i) {
            placements.push(vec![None]);
            continue;
        }
        let mut opts = vec![
            None,
            Some(Placing::new("transpose", &[])),
            Some(Placing::new("transpose", &[("owners", "spare")])),
        ];
        if microbatches > ranks {
            opts.push(Some(Placing::new("transpose", &[("owners", "min")])));
        }
        if enc.trainable {
            let more: Vec<_> = opts
                .iter()
                .flatten()
                .map(|p| {
                    let mut p = p.clone();
                    p.keys.push(("backward", "central"));
                    Some(p)
                })
                .collect();
            opts.extend(more);
        }
        // `fill` puts work into idle time; one rank has none (it only reorders, and
        // its placement re-times the plan for every micro-batch: quadratic).
        if ranks > 1 {
            opts.push(Some(Placing::new("fill", &[])));
        }
        if !enc.trainable && policy.prefetch {
            // A frozen encoder's forwards may also run a step ahead.
            opts.push(Some(Placing::new("prefetch", &[])));
        }
        placements.push(opts);
    }
    let mut combos: Vec<Vec<Option<Placing>>> = vec![Vec::new()];
    for opts in &placements {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                opts.iter().map(move |o| {
                    let mut c = c.clone();
                    c.push(o.clone());
                    c
                })
            })
            .collect();
    }
    // The encoders beyond the heaviest: all inline, all transposed or all filled.
    if !others.is_empty() {
        let alike: Vec<Option<Placing>> = [
            None,
            Some(Placing::new("transpose", &[])),
            Some(Placing::new("fill", &[])),
        ]
        .into_iter()
        .filter(|o| ranks > 1 || o.as_ref().is_none_or(|p| p.op != "fill"))
        .collect();
        let others = &others;
        combos = combos
            .into_iter()
            .flat_map(|c| {
                alike.clone().into_iter().map(move |g| {
                    let mut c = c.clone();
                    for &i in others {
                        c[i] = g.clone();
                    }
                    c
                })
            })
            .collect();
    }
    // The operators apply innermost first, and the order matters (the outer one
    // places its encoder around the inner one's work): every order of the encoders
    // searched in full is a candidate; the others come outermost, in profile order.
    let orders: Vec<Vec<usize>> = permutations(full.len())
        .into_iter()
        .map(|o| {
            o.iter()
                .map(|&k| full[k])
                .chain(others.iter().copied())
                .collect()
        })
        .collect();
    let wrap = |body: &Expr, combo: &[Option<Placing>], order: &[usize]| -> Expr {
        order.iter().fold(body.clone(), |e, &i| match &combo[i] {
            Some(p) => p.around(&profile.encoders[i].name, e),
            None => e,
        })
    };
    let mut space = Space::default();
    // Each with the stages' work balanced too, unless the profile fixes the split.
    let free_split = profile.llm.layout.is_none();
    for combo in &combos {
        let moved = combo.iter().filter(|o| o.is_some()).count();
        let moved_full = full.iter().filter(|&&i| combo[i].is_some()).count();
        for order in &orders {
            // With fewer than two placed encoders the order changes nothing.
            if moved_full < 2 && order != &orders[0] {
                continue;
            }
            for (body, fused) in &bodies {
                let e = wrap(body, combo, order);
                // split_w outside the encoders' placement too: it then also splits
                // a trainable encoder's backward.
                let outer = (*fused && moved > 0).then(|| e.clone().under("split_w", None));
                for x in std::iter::once(e).chain(outer) {
                    space.add_balanced(x, free_split);
                }
            }
        }
    }
    if !profile.encoders.is_empty() {
        let chains = (profile.encoders.len() >= 2)
            .then_some(CHAINS)
            .into_iter()
            .flatten();
        for body in WOVEN.into_iter().chain(chains) {
            space.add_balanced(body.expr(), free_split);
        }
        if free_split {
            // The ramp chains one encoder; the frozen ones may run a step ahead
            // (`prefetch`), which frees the warm-up the ramp fills. Under `balance`
            // the ramp starts from the balanced split and comes to another one.
            // (Only those searched in full: the others stay inline here too.)
            let frozen: Vec<&str> = full
                .iter()
                .map(|&i| &profile.encoders[i])
                .filter(|e| !e.trainable && policy.prefetch)
                .map(|e| e.name.as_str())
                .collect();
            for body in RAMP {
                let prefetched = (!frozen.is_empty()).then(|| {
                    frozen
                        .iter()
                        .fold(body.expr(), |e, name| e.under("prefetch", Some(name)))
                });
                for x in std::iter::once(body.expr()).chain(prefetched) {
                    space.add_balanced(x, true);
                }
            }
        }
    }
    // The evaluation's peers, so that `auto` is never slower than one; beyond
    // [`SearchPolicy::full_encoders`] encoders some nest outside the space above.
    for peer in peers(profile) {
        space.add(peer);
    }
    space.list
}

/// The candidates in the order first added, each once (by canonical text).
#[derive(Default)]
struct Space {
    list: Vec<Expr>,
    seen: std::collections::BTreeSet<String>,
}

impl Space {
    fn add(&mut self, e: Expr) {
        if self.seen.insert(e.to_string()) {
            self.list.push(e);
        }
    }

    /// `e`, then `balance(e)` when `balanced`.
    fn add_balanced(&mut self, e: Expr, balanced: bool) {
        let b = balanced.then(|| balance(e.clone()));
        self.add(e);
        if let Some(b) = b {
            self.add(b);
        }
    }
}

/// The `full` heaviest encoders of `profile` (by work per micro-batch, the earlier
/// on ties), in profile order: those whose placements `auto` searches in full
/// (every operator and mode, in every nesting order); the others are placed alike
/// (all inline, all `transpose`d or all `fill`ed) outside them, so more encoders
/// triple the space once.
fn searched_in_full(profile: &Profile, full: usize) -> Vec<usize> {
    let work = |i: usize| {
        let e = &profile.encoders[i];
        f64::from(e.layers) * crate::algebra::units::encoder_layer_work(e)
    };
    let mut by_work: Vec<usize> = (0..profile.encoders.len()).collect();
    by_work.sort_by(|&a, &b| work(b).total_cmp(&work(a)).then(a.cmp(&b)));
    by_work.truncate(full);
    by_work.sort_unstable();
    by_work
}

/// Every order of `0..n`, the identity first.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in permutations(n - 1) {
        for at in (0..=rest.len()).rev() {
            let mut p = rest.clone();
            p.insert(at, n - 1);
            out.push(p);
        }
    }
    out
}

/// `expr`'s plan as `auto` builds it: a `fill` in it may spend at most
/// [`SearchPolicy::fill_work`] (past it, no plan). The second value says whether a
/// `fill` went past it. Deterministic: phase 1 plans every candidate this way and
/// keeps no plan ([`Planned`]); the later phases plan again the few they derive.
fn plan_capped(req: &Request, expr: &Expr) -> (Result<Plan, Vec<DeriveError>>, bool) {
    let cap = FillCap::new(req.policy.fill_work);
    let capped = Request {
        fill_cap: Some(&cap),
        ..*req
    };
    let plan = plan_of(&capped, expr);
    (plan, cap.hit())
}

/// The plan of a candidate phase 1 planned ([`plan_capped`]), built again.
fn replan(req: &Request, expr: &Expr) -> Result<Plan, Vec<DeriveError>> {
    plan_capped(req, expr).0
}

/// What phase 1 keeps of each candidate, if its plan can be built and timed
/// ([`Planned`] but its index), and whether a `fill` in it went past
/// [`SearchPolicy::fill_work`] (then it has no plan); on every core, in candidate
/// order. No plan is kept: at 1 x 65536 those of every candidate took 3.6 GB.
fn plan_all(req: &Request, exprs: &[Expr]) -> Vec<(Option<Planned>, bool)> {
    let stage = Stage::begin("auto: planning the candidates", exprs.len());
    let one = |expr: &Expr| {
        let _step = StepOnDrop(&stage);
        let (plan, hit) = plan_capped(req, expr);
        let planned = plan.ok().and_then(|plan| {
            let deps = dependencies(&plan).ok()?;
            let ideal = timing(&plan, &deps).ok()?.makespan();
            Some(Planned {
                ideal,
                order: 0,
                tasks: tasks_of(&plan),
                print: plan.fingerprint(),
            })
        });
        (planned, hit)
    };
    // Candidates that share inner expressions are evaluated one after another, on
    // one thread, so that the plan memo (`derive::with_plan_memo`) holds the shared
    // part: sorted by their nests read from the innermost body out.
    let mut visit: Vec<usize> = (0..exprs.len()).collect();
    let nests: Vec<Vec<String>> = exprs.iter().map(nest).collect();
    visit.sort_by(|&a, &b| nests[a].cmp(&nests[b]).then(a.cmp(&b)));
    // Runs of `plan_run`: a run's shared inner plans are built once.
    on_threads(&req.policy, &visit, req.policy.plan_run, &stage, |i| {
        one(&exprs[i])
    })
}

/// `f(i)` for every index in `order` (a permutation of its indices), on every core
/// ([`workers`]), each thread taking the next `run` entries of `order` in turn, with
/// its own plan memo and reporting to `stage`'s observer; results by index. A panic
/// in `f` is the caller's, on one thread and on many ([`crate::ir::parallel`]).
fn on_threads<T: Send>(
    policy: &SearchPolicy,
    order: &[usize],
    run: usize,
    stage: &Stage,
    f: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let threads = workers(order.len(), policy.max_threads);
    let (memo, memo_tasks) = (policy.plan_memo, policy.plan_memo_tasks);
    let within = |body: &mut dyn FnMut()| {
        stage.within(|| with_plan_memo(memo, memo_tasks, body));
    };
    crate::ir::parallel::ordered_map(order, threads, run, within, f)
}

/// The nest of a candidate, innermost body first: the texts of its body, the body's
/// parent, and so on out to the whole expression (the body of an operator is its
/// last positional argument).
fn nest(expr: &Expr) -> Vec<String> {
    let mut chain = vec![expr.to_string()];
    let mut at = expr;
    while let Some(body) = at.positional().last() {
        chain.push(body.to_string());
        at = body;
    }
    chain.reverse();
    chain
}

/// Steps its stage when dropped: a candidate counts as done however it ends.
struct StepOnDrop<'a>(&'a Stage);

impl Drop for StepOnDrop<'_> {
    fn drop(&mut self) {
        self.0.step();
    }
}

/// One step of the search, for reports and tests.
#[derive(Clone, Debug)]
pub struct Tried {
    /// The candidate, in canonical form.
    pub expr: String,
    /// Its plan's ideal time, if the plan could be built.
    pub ideal: Option<f64>,
    /// Its simulated time, if it was derived in full and fits the memory limit.
    pub makespan: Option<f64>,
}

/// The result of a search: the winner and what was tried.
#[derive(Clone, Debug)]
pub struct Search {
    pub best: Derived,
    pub tried: Vec<Tried>,
    /// What the search left out to stay within [`SearchPolicy::work_budget`] (empty
    /// when it searched its whole space): `best` is then the best program found
    /// within the budget.
    pub notes: Vec<String>,
    /// The work the search spent, in [`SearchPolicy::work_budget`]'s task visits
    /// (estimated before each piece of work started).
    pub work: u64,
}

/// `auto`'s work meter ([`SearchPolicy::work_budget`]): each piece of work is
/// estimated, in task visits, from the step's size before it starts, and started
/// only when it keeps the search within the budget.
struct Meter {
    budget: u64,
    spent: Cell<u64>,
    /// About the tasks of one plan of this step: `F`, `B` and `W` of every
    /// micro-batch of each encoder and of each rank's stage.
    tasks: u64,
    per_task: u64,
    per_action: u64,
    notes: std::cell::RefCell<Vec<String>>,
}

impl Meter {
    fn new(req: &Request) -> Meter {
        let ops = [Op::F, Op::B, Op::W].len() as u64;
        let units = (req.profile.encoders.len() + req.ranks) as u64;
        Meter {
            budget: req.policy.work_budget,
            spent: Cell::new(0),
            tasks: ops
                .saturating_mul(req.microbatches as u64)
                .saturating_mul(units),
            per_task: req.policy.work_per_planned_task,
            per_action: req.policy.work_per_derived_action,
            notes: Default::default(),
        }
    }

    /// Planning one candidate (a `fill` in it may spend up to
    /// [`SearchPolicy::fill_work`] besides, which bounds it separately).
    fn plan_cost(&self) -> u64 {
        self.tasks.saturating_mul(self.per_task)
    }

    /// A full derivation of a plan of `tasks` tasks, plus `simulated` actions
    /// simulated by its refinements.
    fn derive_cost(&self, tasks: usize, simulated: usize) -> u64 {
        (tasks as u64)
            .saturating_mul(self.per_action)
            .saturating_add(simulated as u64)
    }

    /// Takes `cost` if it keeps the search within the budget (or if `anyway`).
    fn take(&self, cost: u64, anyway: bool) -> bool {
        let after = self.spent.get().saturating_add(cost);
        let ok = anyway || after <= self.budget;
        if ok {
            self.spent.set(after);
        }
        ok
    }

    /// Whether `cost` would keep the search within the budget (nothing taken).
    fn fits(&self, cost: u64) -> bool {
        self.spent.get().saturating_add(cost) <= self.budget
    }

    fn note(&self, text: String) {
        self.notes.borrow_mut().push(text);
    }
}

/// The tasks of `plan`, on every rank.
fn tasks_of(plan: &Plan) -> usize {
    plan.order.iter().map(Vec::len).sum()
}

/// What phase 1 keeps of a candidate with a plan: not the plan (most are never
/// derived; the phases that derive one plan it again, [`replan`]), but what is asked
/// of it before.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Planned {
    /// Its plan's ideal time.
    ideal: f64,
    /// Its index in the candidates (and in [`Search::tried`]).
    order: usize,
    /// Its plan's tasks, for the work meter.
    tasks: usize,
    /// Its plan's [`Plan::fingerprint`], for [`Suspects`].
    print: u64,
}

/// A candidate derived in full: its makespan, peak memory, index, and whether it is
/// a twin (which shares an earlier candidate's derivation).
type Finalist = (f64, f64, usize, bool);

/// The best derivation so far: makespan, peak memory, candidate index, program.
type Best = (f64, f64, usize, Derived);

/// Run the search for `req`. Fails only when no candidate can be derived (then the
/// errors of the fastest-looking candidate say why, e.g. memory over the limit).
///
/// The phases, in order, each a function below:
/// 1. [`plan_phase`]: every candidate planned and timed ideally;
/// 2. [`derive_phase`]: candidates derived in full in ideal order, until none left
///    can win;
/// 3. [`refine_phase`]: the finalists' transfers refined (and, under rendezvous,
///    the same layer by layer); a refined program wins only with a strict gain;
/// 4. [`order_phase`]: the compute order of the winner (and of the finalist fastest
///    ideally, or else the runner-up) searched by simulation;
/// 5. [`further_phase`]: where the result is still far above the lower bound, the
///    same order search with a larger budget.
pub fn search(req: &Request) -> Result<Search, Vec<DeriveError>> {
    let meter = Meter::new(req);
    let space = candidates_for(req.profile, req.ranks, req.microbatches, &req.policy);
    let (exprs, mut tried, planned) = plan_phase(req, &meter, space);
    let derived = derive_phase(req, &meter, &exprs, &mut tried, planned);
    let refined = refine_phase(
        req,
        &meter,
        (&exprs, &derived.chosen),
        &tried,
        derived.finalists,
    );
    let mut ranked = refined.ranked;
    // Only a strict gain is worth the longer name.
    let winner = match (ranked.first(), derived.best) {
        (Some(r), Some(b)) if less(r.0, b.0) => {
            let (.., d, job) = ranked.remove(0);
            Some((d, refined.jobs[job].inner.clone()))
        }
        // Its jobs are its program's (an alternative's where it won).
        (_, b) => b.map(|(_, _, order, d)| {
            let inner = derived.chosen.get(&order).unwrap_or(&exprs[order]);
            (d, inner.clone())
        }),
    };
    let Some(winner) = winner else {
        // Why no candidate has a plan, from the first one.
        let plan_errors = || exprs.first().and_then(|e| plan_of(req, e).err());
        return Err(derived
            .first_errors
            .or_else(plan_errors)
            .unwrap_or_default());
    };
    let orderer = Orderer {
        req,
        meter: &meter,
        jobs: &refined.jobs,
        winner: &winner.0,
        trials: refined.jobs.iter().map(|_| Trials::default()).collect(),
    };
    let polished = order_phase(&orderer, &winner, &ranked, refined.ideal_finalist);
    let best = further_phase(&orderer, &winner, polished);
    let work = meter.spent.get();
    Ok(Search {
        best,
        tried,
        notes: meter.notes.into_inner(),
        work,
    })
}

/// Phase 1: the candidates planned, in candidate order, while the work budget holds
/// (the first always), and each planned one timed ideally. Returns the candidates
/// planned, what was tried, and those with a plan sorted by ideal time (then
/// candidate order).
fn plan_phase(
    req: &Request,
    meter: &Meter,
    space: Vec<Expr>,
) -> (Vec<Expr>, Vec<Tried>, Vec<Planned>) {
    let total = space.len();
    let mut exprs = Vec::with_capacity(total);
    for (i, e) in space.into_iter().enumerate() {
        if meter.take(meter.plan_cost(), i == 0) {
            exprs.push(e);
        }
    }
    if exprs.len() < total {
        meter.note(format!(
            "{} of the {total} candidates were not planned: at {} x {} they would take the \
             search past its work budget (SearchPolicy::work_budget)",
            total - exprs.len(),
            req.ranks,
            req.microbatches
        ));
    }
    let timed = plan_all(req, &exprs);
    let cut = timed
        .iter()
        .filter(|(ideal, hit)| *hit && ideal.is_none())
        .count();
    if cut > 0 {
        meter.note(format!(
            "{cut} candidates with `fill` were left out: at {} x {} its placement would \
             re-time the plan past its budget (SearchPolicy::fill_work)",
            req.ranks, req.microbatches
        ));
    }
    let mut tried = Vec::with_capacity(exprs.len());
    let mut planned = Vec::new();
    for (i, (expr, (p, _))) in exprs.iter().zip(timed).enumerate() {
        tried.push(Tried {
            expr: expr.to_string(),
            ideal: p.map(|p| p.ideal),
            makespan: None,
        });
        if let Some(p) = p {
            planned.push(Planned { order: i, ..p });
        }
    }
    planned.sort_by(|a, b| a.ideal.total_cmp(&b.ideal).then(a.order.cmp(&b.order)));
    (exprs, tried, planned)
}

/// What [`derive_phase`] found.
struct Derivation {
    /// The fastest candidate derived (then the least memory, then the earliest).
    best: Option<Best>,
    /// Every candidate derived, twins included.
    finalists: Vec<Finalist>,
    /// The errors of the first candidate that failed, if one did.
    first_errors: Option<Vec<DeriveError>>,
    /// The candidates whose program is an alternative's (`named::alternatives`:
    /// another placement, say), with that alternative: the later phases work on its
    /// plan, under its name.
    chosen: std::collections::BTreeMap<usize, Expr>,
}

/// Phase 2: the planned candidates derived in full (lowered, verified, simulated,
/// checked against the memory limit) in ideal order, [`workers`] at a time, their
/// results taken in that order (the same stop and the same winner as one at a time,
/// at most `workers - 1` derivations wasted past the stop); the search stops at the
/// first whose ideal time is more than [`SearchPolicy::derive_within`] behind the
/// best simulated time, or when the next would go past the work budget.
fn derive_phase(
    req: &Request,
    meter: &Meter,
    exprs: &[Expr],
    tried: &mut [Tried],
    planned: Vec<Planned>,
) -> Derivation {
    let derive_within = req.policy.derive_within;
    // A candidate whose plan equals an earlier one's (`balance` finding the even
    // split, an operator with nothing to move, ...) derives to the same program and
    // cannot win (ties go to the earlier candidate): it shares its twin's result.
    let mut suspects = Suspects::new();
    // Makespan and peak of each candidate derived so far, by index.
    let mut derived: std::collections::BTreeMap<usize, (f64, f64)> = Default::default();
    let mut best: Option<Best> = None;
    let mut first_errors = None;
    let mut finalists = Vec::new();
    let mut chosen = std::collections::BTreeMap::new();
    let workers = workers(planned.len(), req.policy.max_threads);
    // Left early when no candidate left can win: the stage then ends short.
    let stage = Stage::begin("auto: deriving the fastest-looking", planned.len());
    let mut rest = planned.into_iter().peekable();
    let stopped = |derived: usize| {
        meter.note(format!(
            "stopped deriving candidates in full after {derived} of them (the next would \
             take the search past its work budget, SearchPolicy::work_budget): the best \
             program so far"
        ));
    };
    'batches: while rest.peek().is_some() {
        let mut batch = Vec::new();
        // What the batch's candidates without suspects cost, derived (a candidate
        // with suspects is most likely a twin, which derives nothing): the batch ends
        // before a candidate that would not fit even after them alone (one at a time
        // would not derive it there either); the search stops there if it is the
        // batch's first. Whether one handed out fits is decided as its result is
        // taken, in order (below): the work counted is one at a time's.
        let mut pending = 0;
        while batch.len() < workers {
            let Some(&next) = rest.peek().filter(|p| {
                best.as_ref()
                    .is_none_or(|(span, ..)| p.ideal <= *span * derive_within)
            }) else {
                break;
            };
            // The first candidate is always derived.
            let first = best.is_none() && derived.is_empty() && batch.is_empty();
            if !suspects.any(&next) {
                pending += meter.derive_cost(next.tasks, 0);
                if !first && !meter.fits(pending) {
                    if batch.is_empty() {
                        stopped(derived.len());
                        break 'batches;
                    }
                    break;
                }
            }
            rest.next();
            // In ideal order, so its twin (if any) came before.
            batch.push((next, suspects.of(&next)));
        }
        if batch.is_empty() {
            break;
        }
        // Each planned again where it is derived, one plan per worker at a time;
        // its alternatives under the stop rule too (with the best at the batch's
        // start: no lower than the limit one at a time would give, see below).
        let within = best
            .as_ref()
            .map_or(f64::INFINITY, |(span, ..)| *span * derive_within);
        let jobs: Vec<(usize, Vec<usize>)> = batch
            .iter_mut()
            .map(|(p, suspects)| (p.order, std::mem::take(suspects)))
            .collect();
        let results = derive_named(req, exprs, &jobs, within, &stage);
        for ((Planned { ideal, tasks, .. }, _), ((i, _), result)) in
            batch.into_iter().zip(jobs.into_iter().zip(results))
        {
            if let Some((span, ..)) = &best {
                if ideal > *span * derive_within {
                    break 'batches;
                }
            }
            let mut result = match result {
                // Its twin came earlier in this order, so it has been taken already.
                Done::Twin(of) => {
                    if let Some(&(span, peak)) = derived.get(&of) {
                        finalists.push((span, peak, i, true));
                        tried[i].makespan = Some(span);
                    }
                    continue;
                }
                Done::Derived(result) => *result,
            };
            // Its derivation is work, counted as one at a time would: where it does not
            // fit, the search stops before it.
            let first = best.is_none() && derived.is_empty();
            if !meter.take(meter.derive_cost(tasks, 0), first) {
                stopped(derived.len());
                break 'batches;
            }
            // The limit one candidate at a time would have given it: the best so far
            // in this order. Its job had the best at its batch's start, no lower, so it
            // may have derived more alternatives; that changes nothing unless one of
            // them was kept on the way (then other plans might have been kept), and
            // then it is derived again here, under this limit (rare). So the answer
            // and the work counted are the same on any number of cores.
            let limit = best
                .as_ref()
                .map_or(f64::INFINITY, |(span, ..)| *span * derive_within);
            if result
                .kept_on_the_way
                .iter()
                .any(|&a| !within_limit(limit, a))
            {
                result = derive_capped(req, &exprs[i], limit);
            }
            // Its alternatives' derivations are work too (those under the limit).
            let derived_under = |&&a: &&Option<f64>| within_limit(limit, a);
            let others = result.others_derived.iter().filter(derived_under).count();
            meter.take(meter.derive_cost(tasks, 0) * others as u64, true);
            match result.derived {
                Ok(d) => {
                    if let Some(alternative) = result.alternative {
                        chosen.insert(i, alternative);
                    }
                    let (span, peak) = (d.report.makespan, d.peak_with_params());
                    derived.insert(i, (span, peak));
                    finalists.push((span, peak, i, false));
                    tried[i].makespan = Some(span);
                    keep_better(&mut best, d, i);
                }
                Err(es) => {
                    first_errors.get_or_insert(es);
                }
            }
        }
    }
    Derivation {
        best,
        finalists,
        first_errors,
        chosen,
    }
}

/// One full derivation of [`refine_phase`]: the candidate's index, the expression
/// derived, the expression under its `refine` (the candidate, or it `layers`d), the
/// plan, and whether the transfers are refined.
struct Job {
    order: usize,
    expr: Expr,
    inner: Expr,
    plan: Plan,
    refine: bool,
}

/// What [`refine_phase`] found.
struct Refinement {
    /// Every derivation it ran.
    jobs: Vec<Job>,
    /// Their programs, fastest first (then the least memory, then the candidate
    /// order, then the job order): makespan, peak, candidate index, program, job.
    ranked: Vec<(f64, f64, usize, Derived, usize)>,
    /// The finalist whose plan is fastest ideally.
    ideal_finalist: Option<usize>,
}

/// Phase 3: the transfers of the fastest few finalists
/// ([`SearchPolicy::finalists`]), and of the one whose plan is fastest in the ideal
/// timing, refined by simulation (never slower): the refinements bring a program
/// towards its plan's ideal time, so a plan well ahead there may win once refined
/// although its first lowering waits more (under rendezvous, most of all). Under
/// rendezvous, also the same layer by layer (see `operators::layers`): its ideal
/// time is the plan's, but transfers find better meeting points.
fn refine_phase(
    req: &Request,
    meter: &Meter,
    (exprs, chosen): (&[Expr], &std::collections::BTreeMap<usize, Expr>),
    tried: &[Tried],
    mut finalists: Vec<Finalist>,
) -> Refinement {
    sort_best_first(
        &mut finalists,
        |f| Score::span(f.0).with_peak(f.1),
        |a, b| a.2.cmp(&b.2),
    );
    // A twin's refinements equal its twin's, which sorts before it and wins the tie:
    // twins take no finalist's place.
    let mut finalists: Vec<usize> = finalists
        .into_iter()
        .filter(|&(.., twin)| !twin)
        .map(|(_, _, i, _)| i)
        .collect();
    let ideal = |i: usize| tried[i].ideal.unwrap_or(f64::INFINITY);
    let ideal_finalist = finalists
        .iter()
        .min_by(|&&a, &&b| ideal(a).total_cmp(&ideal(b)).then(a.cmp(&b)))
        .copied();
    let mut at = 0;
    finalists.retain(|&f| {
        at += 1;
        at <= req.policy.finalists || Some(f) == ideal_finalist
    });
    // Each job within the budget, in this order (a refinement simulates at most its
    // budgets' actions besides its derivation); only those hold a plan.
    let refined = req.policy.refine_actions + req.policy.w_actions;
    let (mut wanted, mut unbuilt) = (0, 0);
    let mut jobs: Vec<Job> = Vec::new();
    let mut add = |job: Job| {
        wanted += 1;
        let simulated = if job.refine { refined } else { 0 };
        if meter.take(meter.derive_cost(tasks_of(&job.plan), simulated), false) {
            jobs.push(job);
        }
    };
    for i in finalists {
        // Derived in phase 2 from this very plan (an alternative's where it won:
        // the expression that gives it by name).
        let expr = chosen.get(&i).unwrap_or(&exprs[i]);
        let Ok(plan) = replan(req, expr) else {
            continue;
        };
        // Under rendezvous, also cut layer by layer: that plan has at least as many
        // tasks, so when not even its derivation fits now (nor, then, later) it is
        // not built (it is the largest plan of the search).
        let rendezvous = req.mode == Mode::Rendezvous;
        let cut_fits = meter.fits(meter.derive_cost(tasks_of(&plan), 0));
        let fine = (rendezvous && cut_fits).then(|| layers(plan.clone(), req.profile));
        if rendezvous && !cut_fits {
            unbuilt += 2;
        }
        add(Job {
            order: i,
            expr: expr.clone().under("refine", None),
            inner: expr.clone(),
            plan,
            refine: true,
        });
        if let Some(fine) = fine {
            let cut = expr.clone().under("layers", None);
            add(Job {
                order: i,
                expr: cut.clone(),
                inner: cut.clone(),
                plan: fine.clone(),
                refine: false,
            });
            add(Job {
                order: i,
                expr: cut.clone().under("refine", None),
                inner: cut,
                plan: fine,
                refine: true,
            });
        }
    }
    let wanted = wanted + unbuilt;
    if jobs.len() < wanted {
        meter.note(format!(
            "refined {} of the {wanted} finalists' programs (the others would take the \
             search past its work budget, SearchPolicy::work_budget)",
            jobs.len()
        ));
    }
    let stage = Stage::begin("auto: refining the finalists", jobs.len());
    let texts: Vec<String> = jobs.iter().map(|j| j.expr.to_string()).collect();
    let work: Vec<(&Plan, &str, bool)> = jobs
        .iter()
        .zip(&texts)
        .map(|(job, text)| (&job.plan, text.as_str(), job.refine))
        .collect();
    let results = finish_all(req, &work, &stage);
    drop(stage);
    let mut ranked: Vec<(f64, f64, usize, Derived, usize)> = jobs
        .iter()
        .zip(results)
        .enumerate()
        .filter_map(|(k, (job, result))| {
            let d = result.derived.ok()?;
            Some((d.report.makespan, d.peak_with_params(), job.order, d, k))
        })
        .collect();
    sort_best_first(
        &mut ranked,
        |r| Score::span(r.0).with_peak(r.1),
        |a, b| a.2.cmp(&b.2),
    );
    Refinement {
        jobs,
        ranked,
        ideal_finalist,
    }
}

/// What the order searches of phases 4 and 5 share: the request, the meter, the
/// refinement's jobs (whose plans they search), the winner to beat, and the
/// trials each job's order search took (phase 5 searches a plan phase 4 searched,
/// with a larger budget: it takes the same trials first, and reads them back).
struct Orderer<'a> {
    req: &'a Request<'a>,
    meter: &'a Meter,
    jobs: &'a [Job],
    winner: &'a Derived,
    trials: Vec<Trials>,
}

impl Orderer<'_> {
    /// `refine(inner, order = N)` derived from the plan of `refine(inner)`, with
    /// `N` the smaller of `most` and `actions_in_all` over the program's actions
    /// (`actions` of `d`, the program it starts from), if that is at least
    /// [`SearchPolicy::order_min`] and within the work budget; kept when it beats
    /// the winner.
    fn polish(
        &self,
        d: &Derived,
        inner: &Expr,
        what: &str,
        (most, actions_in_all): (usize, usize),
    ) -> Option<Derived> {
        let k = self
            .jobs
            .iter()
            .position(|j| j.refine && &j.inner == inner)?;
        let job = &self.jobs[k];
        let actions: usize = d.program.programs.iter().map(Vec::len).sum();
        let budget = most.min(actions_in_all / actions.max(1));
        if budget < self.req.policy.order_min {
            return None;
        }
        let simulated = budget.saturating_mul(actions);
        if !self
            .meter
            .take(self.meter.derive_cost(actions, simulated), false)
        {
            self.meter.note(format!(
                "did not search {what} order ({budget} simulations would take the \
                 search past its work budget, SearchPolicy::work_budget)"
            ));
            return None;
        }
        let text = inner
            .clone()
            .under("refine", None)
            .with_int("order", budget as u64)
            .to_string();
        let stage = Stage::begin(&format!("auto: ordering {what}"), 1);
        let _step = StepOnDrop(&stage);
        finish_replaying(self.req, &job.plan, &text, budget, &self.trials[k])
            .ok()
            .filter(|p| span(&p.report).beats(&span(&self.winner.report)))
    }
}

/// Phase 4: the winner's compute order searched by simulation (`refine(X, order =
/// N)`), with a budget that shrinks as programs grow ([`SearchPolicy::order_budget`],
/// [`SearchPolicy::order_actions`]), and that of the finalist fastest in the ideal
/// timing (its fastest refined program) when it is another expression within
/// [`SearchPolicy::ideal_within`] of the winner: its order has the most to gain.
/// The faster of the two is kept (the winner's on a tie). When neither gains, the
/// runner-up's (the fastest refined program of another expression, if within
/// [`SearchPolicy::runner_up_within`] of the winner): the search may gain on one
/// where it cannot on the other (on a schedule cut layer by layer, say, and not on
/// the same schedule uncut). Only a strict gain counts. Returns the program found and
/// the one it came from (with its inner expression).
fn order_phase<'a>(
    o: &Orderer<'a>,
    winner: &'a (Derived, Expr),
    ranked: &'a [(f64, f64, usize, Derived, usize)],
    ideal_finalist: Option<usize>,
) -> Option<(Derived, (&'a Derived, &'a Expr))> {
    let policy = &o.req.policy;
    let budgets = (policy.order_budget, policy.order_actions);
    let (win, win_inner) = (&winner.0, &winner.1);
    let inner_of = |job: usize| &o.jobs[job].inner;
    let ideal_pick = ranked
        .iter()
        .find(|r| Some(r.2) == ideal_finalist)
        .filter(|r| inner_of(r.4) != win_inner)
        .filter(|r| r.3.report.makespan <= win.report.makespan * policy.ideal_within)
        .map(|r| (&r.3, inner_of(r.4)));
    let runner_up = || {
        ranked
            .iter()
            .find(|r| inner_of(r.4) != win_inner)
            .filter(|r| r.3.report.makespan <= win.report.makespan * policy.runner_up_within)
            .map(|r| (&r.3, inner_of(r.4)))
    };
    [
        o.polish(win, win_inner, "the winner's compute", budgets)
            .map(|p| (p, (win, win_inner))),
        ideal_pick.and_then(|(d, inner)| {
            Some((
                o.polish(d, inner, "the ideal finalist's compute", budgets)?,
                (d, inner),
            ))
        }),
    ]
    .into_iter()
    .flatten()
    .min_by(|a, b| span(&a.0.report).order(&span(&b.0.report)))
    .or_else(|| {
        let (d, inner) = runner_up()?;
        Some((
            o.polish(d, inner, "the runner-up's compute", budgets)?,
            (d, inner),
        ))
    })
}

/// Phase 5: where the goal applies (micro-batches at least
/// [`SearchPolicy::goal_microbatches_per_rank`] times the ranks) and the program is
/// still more than [`SearchPolicy::goal`] above the lower bound, the order search of
/// the program phase 4 started from again, with the larger budget
/// ([`SearchPolicy::far_budget`], [`SearchPolicy::far_actions`]): the bound tells
/// the search where more effort may pay; elsewhere it costs nothing. Kept when it
/// is faster. Returns the search's answer.
fn further_phase(
    o: &Orderer,
    winner: &(Derived, Expr),
    polished: Option<(Derived, (&Derived, &Expr))>,
) -> Derived {
    let policy = &o.req.policy;
    let (polished, (from, from_inner)) = match polished {
        Some((p, from)) => (Some(p), from),
        None => (None, (&winner.0, &winner.1)),
    };
    let current = polished.as_ref().unwrap_or(&winner.0);
    let short = o.req.microbatches >= policy.goal_microbatches_per_rank * o.req.ranks
        && current.report.makespan > policy.goal * current.bound.value();
    let further = short
        .then(|| {
            let what = format!(
                "its compute further (more than {:.0}% above the bound)",
                (policy.goal - 1.0) * PERCENT
            );
            o.polish(
                from,
                from_inner,
                &what,
                (policy.far_budget, policy.far_actions),
            )
        })
        .flatten()
        .filter(|p| span(&p.report).beats(&span(&current.report)));
    further.or(polished).unwrap_or_else(|| winner.0.clone())
}

/// A factor as a percentage, for messages.
const PERCENT: f64 = 100.0;

/// The twins of phase 2: a candidate's twin is the first earlier one (in ideal
/// order, then candidate order) with the same ideal time, an equal plan and
/// alternatives (`named::alternatives`) of the same kinds with equal plans, which
/// then derives to the same program. Plans with different fingerprints differ, so
/// the phase, reaching the candidates in that order, names each candidate's
/// suspects ([`Suspects::of`]: the earlier ones of its run of equal ideal times
/// with its fingerprint), and the worker that would derive it plans it and them
/// again and compares ([`twin_among`]): so no two plans are taken for equal that
/// are not, and the planning happens on every core, not on the thread that hands
/// the work out.
struct Suspects {
    /// The ideal time (its bits) of the current run of equal ideal times.
    run: Option<u64>,
    /// The candidates of the run reached so far: index and fingerprint.
    seen: Vec<(usize, u64)>,
}

impl Suspects {
    fn new() -> Suspects {
        Suspects {
            run: None,
            seen: Vec::new(),
        }
    }

    /// Whether `p`, the next candidate in ideal order, has suspects (nothing
    /// recorded).
    fn any(&self, p: &Planned) -> bool {
        self.run == Some(p.ideal.to_bits()) && self.seen.iter().any(|&(_, print)| print == p.print)
    }

    /// The suspects of `p`, the next candidate in ideal order (each is asked once),
    /// in that order.
    fn of(&mut self, p: &Planned) -> Vec<usize> {
        let bits = p.ideal.to_bits();
        if self.run != Some(bits) {
            self.run = Some(bits);
            self.seen.clear();
        }
        let suspects = self
            .seen
            .iter()
            .filter(|&&(_, print)| print == p.print)
            .map(|&(j, _)| j)
            .collect();
        self.seen.push((p.order, p.print));
        suspects
    }
}

/// The twin of candidate `i` among its `suspects` (earlier candidates of its run, in
/// order): the first whose plan equals `i`'s and whose alternatives are
/// [`same_alternatives`]. By that order the first such is no twin itself (a twin's
/// twin came before it and is equal too), so it is the one whose derivation `i`
/// shares. `None` when `i` cannot be planned.
fn twin_among(req: &Request, exprs: &[Expr], i: usize, suspects: &[usize]) -> Option<usize> {
    if suspects.is_empty() {
        return None;
    }
    let mine = replan(req, &exprs[i]).ok()?;
    suspects.iter().copied().find(|&j| {
        replan(req, &exprs[j]).is_ok_and(|theirs| theirs == mine)
            && same_alternatives(req, &exprs[i], &exprs[j])
    })
}

/// Whether two candidates (with equal plans) have alternatives
/// (`named::alternatives`, which their derivations choose among) of the same kinds
/// with equal plans, in the same order: then they derive to the same program.
fn same_alternatives(req: &Request, a: &Expr, b: &Expr) -> bool {
    let (a, b) = (
        alternatives(a).collect::<Vec<_>>(),
        alternatives(b).collect::<Vec<_>>(),
    );
    a.len() == b.len()
        && a.iter().zip(&b).all(|(x, y)| {
            x.kind() == y.kind()
                && match (replan(req, &x.expr), replan(req, &y.expr)) {
                    (Ok(p), Ok(q)) => p == q,
                    (Err(_), Err(_)) => true,
                    _ => false,
                }
        })
}

/// Threads for `jobs` independent pieces of work: every core, at most `most`.
fn workers(jobs: usize, most: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(most)
        .max(1)
        .min(jobs.max(1))
}

/// Each job `(plan, expression text, refine)` derived in full ([`finish`]), on every
/// core, results in job order; `stage` counts them.
fn finish_all(req: &Request, jobs: &[(&Plan, &str, bool)], stage: &Stage) -> Vec<Chosen> {
    // The longest first (those refined, then the larger plans), so that no core
    // is left with a long one at the end while the other idles; the results come
    // back in job order all the same.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| {
        let (plan, _, refine) = jobs[i];
        (std::cmp::Reverse(refine), std::cmp::Reverse(tasks_of(plan)))
    });
    on_threads(&req.policy, &order, 1, stage, |i| {
        let _step = StepOnDrop(stage);
        let (plan, text, refine) = jobs[i];
        // The errors are about an expression `auto` built: no place in the text.
        Chosen::kept(finish(req, plan, text, Span::NONE, refine.then_some(0)))
    })
}

/// What a job of [`derive_named`] gives: the candidate's derivation, or the
/// earlier candidate it is the twin of (derived by its own job).
enum Done {
    Derived(Box<Chosen>),
    Twin(usize),
}

/// Each job `(candidate, its suspects)` of phase 2 on every core, results in job
/// order (`stage` counts them): the twin among its suspects ([`twin_among`]) if
/// there is one, else the candidate derived as by name ([`derive_candidate`]:
/// planned again where the job runs, under the cap on `fill`'s work phase 1
/// planned it with, with the alternatives a derivation by name chooses among whose
/// ideal step is within `within`).
fn derive_named(
    req: &Request,
    exprs: &[Expr],
    jobs: &[(usize, Vec<usize>)],
    within: f64,
    stage: &Stage,
) -> Vec<Done> {
    let order: Vec<usize> = (0..jobs.len()).collect();
    on_threads(&req.policy, &order, 1, stage, |k| {
        let _step = StepOnDrop(stage);
        let (i, suspects) = &jobs[k];
        match twin_among(req, exprs, *i, suspects) {
            Some(twin) => Done::Twin(twin),
            None => Done::Derived(Box::new(derive_capped(req, &exprs[*i], within))),
        }
    })
}

/// `expr` derived as by name ([`derive_candidate`], with the alternatives whose
/// ideal step is within `within`), under the cap on `fill`'s work phase 1 planned
/// it with.
fn derive_capped(req: &Request, expr: &Expr, within: f64) -> Chosen {
    let cap = FillCap::new(req.policy.fill_work);
    let capped = Request {
        fill_cap: Some(&cap),
        ..*req
    };
    derive_candidate(&capped, expr, within)
}

/// Keep `d` (the candidate at `order`) in `best` if it is faster, or as fast with
/// less peak memory, or as both with an earlier candidate.
fn keep_better(best: &mut Option<(f64, f64, usize, Derived)>, d: Derived, order: usize) {
    let key = (d.report.makespan, d.peak_with_params(), order);
    let score = |s: f64, p: f64| Score::span(s).with_peak(p);
    let better = best.as_ref().is_none_or(|(s, p, o, _)| {
        score(key.0, key.1)
            .order(&score(*s, *p))
            .then(key.2.cmp(o))
            .is_lt()
    });
    if better {
        *best = Some((key.0, key.1, key.2, d));
    }
}

/// `auto` in an expression: the search's winner, with its expression in
/// [`Derived::expr`], and the work the search spent ([`Search::work`]). `expr` is
/// the `auto` node (for error spans).
pub(crate) fn auto(req: &Request, expr: &Expr) -> Result<(Derived, u64), Vec<DeriveError>> {
    if !expr.args.is_empty() {
        return Err(vec![DeriveError {
            message: "`auto` takes no arguments; write `auto`".into(),
            span: expr.span,
            kind: ErrorKind::BadArgument,
        }]);
    }
    match search(req) {
        Ok(s) => {
            for note in &s.notes {
                crate::ir::progress::note(&format!("auto: {note}"));
            }
            Ok((s.best, s.work))
        }
        Err(es) if es.is_empty() => Err(vec![DeriveError {
            message: "`auto` found no schedule for this profile, ranks and micro-batches".into(),
            span: expr.span,
            kind: ErrorKind::Profile,
        }]),
        Err(es) => Err(es
            .into_iter()
            .map(|e| DeriveError {
                message: format!(
                    "`auto` found no schedule that derives; the first failure: {}",
                    e.message
                ),
                span: expr.span,
                kind: e.kind,
            })
            .collect()),
    }
}

/// The bodies of the peer schedules, the baseline first.
const PEERS: [Body; 5] = [
    Body("1f1b", &[]),
    Body("interleaved", &[("v", Int(2))]),
    Body("zbh1", &[]),
    Body("zbv", &[]),
    Body("dualpipev", &[]),
];

/// The peer schedules of `profile` (what [`crate::search::evaluation`] sets `auto` against, and
/// where `auto` starts): each body with the encoders inline, then each body
/// with every encoder transposed (in each nesting order, for two encoders).
pub fn peers(profile: &Profile) -> Vec<Expr> {
    let mut out: Vec<Expr> = PEERS.iter().map(|b| b.expr()).collect();
    if profile.encoders.is_empty() {
        return out;
    }
    let names: Vec<&str> = profile.encoders.iter().map(|e| e.name.as_str()).collect();
    let mut orders = vec![names.clone()];
    if names.len() == 2 {
        orders.push(vec![names[1], names[0]]);
    }
    for b in PEERS {
        for order in &orders {
            out.push(
                order
                    .iter()
                    .fold(b.expr(), |e, n| e.under("transpose", Some(n))),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::expr::parse_str;

    /// The memo and the grouped, parallel evaluation change nothing: every
    /// candidate's plan and ideal time are those of a fresh, lone evaluation.
    #[test]
    fn planning_all_candidates_equals_planning_each_alone() {
        for (text, p, m) in [
            (include_str!("../../../profiles/eval-c-omni.toml"), 4, 8),
            (include_str!("../../../profiles/qwen2vl-7b.toml"), 4, 8),
        ] {
            let profile = Profile::from_toml_str(text).unwrap();
            let req = Request::new(&profile, p, m);
            let exprs = candidates(&profile, p, m);
            let all = plan_all(&req, &exprs);
            assert_eq!(all.len(), exprs.len());
            for (expr, (got, _)) in exprs.iter().zip(all) {
                // Built as values, each candidate is its own canonical text.
                let text = expr.to_string();
                assert_eq!(&parse_str(&text).unwrap(), expr);
                let alone = plan_of(&req, expr).ok().and_then(|plan| {
                    let deps = dependencies(&plan).ok()?;
                    Some(Planned {
                        ideal: timing(&plan, &deps).ok()?.makespan(),
                        order: 0,
                        tasks: tasks_of(&plan),
                        print: plan.fingerprint(),
                    })
                });
                assert_eq!(got, alone, "{text}");
                // Planned again as the later phases do: the same plan.
                if got.is_some() {
                    assert_eq!(replan(&req, expr).ok(), plan_of(&req, expr).ok(), "{text}");
                }
            }
        }
    }

    /// Twins are candidates with equal ideal times and equal plans, the first of
    /// each run of them standing for the others; equal fingerprints alone make no
    /// twins (the suspects are planned again and compared).
    #[test]
    fn twins_are_equal_plans_with_equal_ideal_times() {
        let profile =
            Profile::from_toml_str(include_str!("../../../profiles/qwen2vl-7b.toml")).unwrap();
        let req = Request::new(&profile, 4, 8);
        let exprs: Vec<Expr> = ["zbh1", "1f1b", "zbh1", "zbh1", "1f1b", "zbh1"]
            .iter()
            .map(|e| parse_str(e).unwrap())
            .collect();
        let print = |i: usize| replan(&req, &exprs[i]).unwrap().fingerprint();
        assert_ne!(print(0), print(1));
        let planned = |ideal: f64, order: usize, print: u64| Planned {
            ideal,
            order,
            tasks: 0,
            print,
        };
        let mut suspects = Suspects::new();
        let got: Vec<(Vec<usize>, Option<usize>)> = [
            planned(1.0, 0, print(0)),
            planned(1.0, 1, print(1)),
            planned(1.0, 2, print(2)),
            // Its suspects are the run's first and its twin: the first is the twin.
            planned(1.0, 5, print(5)),
            planned(2.0, 3, print(3)),
            // A forged fingerprint, zbh1's: the plans are compared, and differ.
            planned(2.0, 4, print(0)),
        ]
        .iter()
        .map(|p| {
            let of = suspects.of(p);
            let twin = twin_among(&req, &exprs, p.order, &of);
            (of, twin)
        })
        .collect();
        let none = Vec::new;
        assert_eq!(
            got,
            [
                (none(), None),
                (none(), None),
                (vec![0], Some(0)),
                (vec![0, 2], Some(0)),
                (none(), None),
                (vec![3], None)
            ]
        );
    }

    /// On one thread, on every core and as inside `schedule!` (without `prefetch`)
    /// the search gives the same answer.
    #[test]
    fn one_thread_every_core_and_the_macros_search_agree() {
        let profile =
            Profile::from_toml_str(include_str!("../../../profiles/qwen2vl-7b.toml")).unwrap();
        let req = Request::new(&profile, 4, 8);
        let all = search(&req).unwrap();
        let one = search(&Request {
            policy: SearchPolicy {
                max_threads: 1,
                ..req.policy
            },
            ..req
        });
        // A trainable encoder: nothing to prefetch, so the macro's space is the same.
        let in_macro = search(&Request {
            policy: SearchPolicy {
                prefetch: false,
                ..req.policy
            },
            ..req
        })
        .unwrap();
        let spans = |s: &Search| s.tried.iter().map(|t| t.makespan).collect::<Vec<_>>();
        for other in [one.unwrap(), in_macro] {
            assert_eq!(all.best.expr, other.best.expr);
            assert_eq!(all.best.program, other.best.program);
            assert_eq!(spans(&all), spans(&other));
        }
    }

    /// Candidates that share a body sort next to each other, innermost first.
    #[test]
    fn nests_read_from_the_innermost_body_out() {
        let nest = |t: &str| nest(&parse_str(t).unwrap());
        assert_eq!(
            nest("balance(transpose(vision, zbv, owners = spare))"),
            [
                "zbv",
                "transpose(vision, zbv, owners = spare)",
                "balance(transpose(vision, zbv, owners = spare))"
            ]
        );
        assert_eq!(nest("1f1b"), ["1f1b"]);
    }
}
