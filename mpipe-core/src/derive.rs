//! The derivation: profile + expression -> verified, simulated program.
//!
//! ```text
//! Expr ──eval──► Plan ──lower──► Program ──verify──► ──simulate──► memory check
//! ```
//!
//! `eval` maps each sub-expression to a plan: a body name runs its generator, an
//! operator evaluates its body argument and maps the plan. Errors carry the span of
//! the sub-expression at fault, and evaluation goes on past an error where it can, so
//! a user sees every mistake at once.

use crate::analysis::{PlanError, Timing};
use crate::bound::{lower_bound, profile_bound, Bound};
use crate::expr::{Arg, Expr, Value};
use crate::generators::{generate_by, BodyKind, GenError, Weave, BODY_NAMES};
use crate::lower::{assemble, placement_of, prepare, Placed, Placement};
use crate::operators::chain::{chain, ChainError};
use crate::operators::fill::fill;
use crate::operators::host::{host, Host};
use crate::operators::layers::layers;
use crate::operators::prefetch::prefetch;
use crate::operators::split_w::split_w;
use crate::operators::transpose::{transpose, Backward, Owners};
use crate::plan::{Plan, UnitId};
use crate::policy::SearchPolicy;
use crate::profile::Profile;
use crate::program::{ActionRef, Program};
use crate::refine::{refine, settle_w};
use crate::simulate::{simulate, Mode, SimOptions, SimReport};
use crate::verify::verify_static;
use proc_macro2::Span;

/// Operator names the language reserves.
pub const OPERATOR_NAMES: [&str; 10] = [
    "transpose",
    "fill",
    "chain",
    "host",
    "split_w",
    "balance",
    "prefetch",
    "layers",
    "refine",
    "auto",
];

/// One derivation error: what is wrong, where, and how to fix it.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct DeriveError {
    pub message: String,
    /// The sub-expression at fault (call-site when the whole request is at fault).
    pub span: Span,
    /// What kind of problem it is.
    pub kind: ErrorKind,
}

/// The classes of derivation error (the macro's UI tests and the CLI's exit codes
/// tell them apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Unknown schedule, operator or encoder name.
    UnknownName,
    /// A bad argument: wrong count, unknown key, bad value.
    BadArgument,
    /// The body needs more (or differently many) micro-batches.
    Microbatches,
    /// The profile cannot be split over the ranks.
    Profile,
    /// Known, but not implemented yet.
    NotAvailable,
    /// A rank's peak memory exceeds `memory.limit`.
    Memory,
    /// The derived program breaks a validity rule (a bug in mpipe: please report).
    Invalid,
}

fn err(kind: ErrorKind, span: Span, message: impl Into<String>) -> DeriveError {
    DeriveError {
        message: message.into(),
        span,
        kind,
    }
}

/// A derived program with its predicted figures.
#[derive(Clone, Debug)]
pub struct Derived {
    pub program: Program,
    pub report: SimReport,
    pub bound: Bound,
    /// Per rank: parameter memory resident during the step (home units plus units
    /// broadcast to or replicated on the rank).
    pub params: Vec<f64>,
    /// The expression derived, in canonical form: the one given, or the one `auto`
    /// chose (also the program's `source.expr`).
    pub expr: String,
}

impl Derived {
    /// The largest, over the ranks, of peak activations plus resident parameters:
    /// what `memory.limit` is compared with.
    pub fn peak_with_params(&self) -> f64 {
        self.report
            .peak_memory
            .iter()
            .zip(&self.params)
            .map(|(a, p)| a + p)
            .fold(0.0, f64::max)
    }
}

/// The inputs of one derivation.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub profile: &'a Profile,
    pub ranks: usize,
    pub microbatches: usize,
    /// The semantics the program is timed under, and so chosen for (its transfers'
    /// placement, `auto`'s choice): rendezvous (the default, what mpipe's runtime
    /// does) or eager (sends that never wait, as with asynchronous point-to-point
    /// on a communication stream). Every program derived terminates under both.
    pub mode: Mode,
    /// The tuning of `auto`, `refine` and the lowering: [`SearchPolicy::DEFAULT`]
    /// unless the caller changes it.
    pub policy: SearchPolicy,
}

impl<'a> Request<'a> {
    /// A request timed under the default (rendezvous) semantics.
    pub fn new(profile: &'a Profile, ranks: usize, microbatches: usize) -> Request<'a> {
        Request {
            profile,
            ranks,
            microbatches,
            mode: Mode::Rendezvous,
            policy: SearchPolicy::DEFAULT,
        }
    }

    /// Simulation options implied by the profile (its link, if any), under `mode`.
    pub fn sim_options(&self, mode: Mode) -> SimOptions {
        SimOptions {
            mode,
            comm: self.profile.comm_model(),
        }
    }
}

use crate::program::OverLimit;
pub use crate::program::{MAX_MICROBATCHES, MAX_RANK_MICROBATCHES};

/// Derive, verify and simulate `expr` for `req`. All errors found are returned.
pub fn derive(req: &Request, expr: &Expr) -> Result<Derived, Vec<DeriveError>> {
    let mut errors = Vec::new();
    if req.ranks == 0 {
        errors.push(err(
            ErrorKind::BadArgument,
            expr.span,
            "ranks must be at least 1",
        ));
    }
    if req.microbatches == 0 {
        errors.push(err(
            ErrorKind::BadArgument,
            expr.span,
            "microbatches must be at least 1",
        ));
    }
    let over = crate::program::over_limit(req.ranks, req.microbatches);
    if over == Some(OverLimit::Microbatches) {
        errors.push(err(
            ErrorKind::BadArgument,
            expr.span,
            format!(
                "microbatches = {} is over the {MAX_MICROBATCHES} a step can have: a program \
                 holds every action of one step, and one this long would take minutes and \
                 gigabytes to derive; accumulate gradients over several steps instead",
                req.microbatches
            ),
        ));
    } else if over == Some(OverLimit::Pairs) {
        errors.push(err(
            ErrorKind::BadArgument,
            expr.span,
            format!(
                "ranks x microbatches = {} x {} is over the {MAX_RANK_MICROBATCHES} a step can \
                 have (a program holds every action of one step); use fewer micro-batches per \
                 step and accumulate gradients over several steps",
                req.ranks, req.microbatches
            ),
        ));
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    match expr.name() {
        "auto" => crate::search::auto(req, expr),
        "refine" => {
            let mut errors = Vec::new();
            let order = refine_order(expr, &mut errors);
            let inner = one_body(req, expr, "refine(zbh1)", &mut errors);
            match inner {
                Some(x) if matches!(x.name(), "auto" | "refine") => errors.push(err(
                    ErrorKind::BadArgument,
                    x.span,
                    format!("`refine` takes a schedule expression, not `{}` (`auto` refines its choice already)", x.name()),
                )),
                _ => {}
            }
            let plan = inner.and_then(|x| eval(req, x, &mut errors));
            match plan {
                Some(plan) if errors.is_empty() => {
                    finish(req, &plan, &expr.to_string(), expr.span, Some(order))
                }
                _ => Err(errors),
            }
        }
        _ => {
            let plan = plan_of(req, expr)?;
            finish(req, &plan, &expr.to_string(), expr.span, None)
        }
    }
}

/// The most simulations `refine(X, order = N)` may spend searching the compute order.
pub const MAX_ORDER: u64 = 100_000;

/// `refine`'s `order = N` (0 when absent), every other key and a bad value reported.
fn refine_order(e: &Expr, errors: &mut Vec<DeriveError>) -> usize {
    let mut order = 0;
    for (key, value) in e.keys() {
        if key.name != "order" {
            errors.push(err(
                ErrorKind::BadArgument,
                key.span,
                format!(
                    "unknown argument `{}` of `refine`; it takes `order = N` (simulations to spend \
                     moving compute tasks into waits), as in `refine(zbh1, order = 500)`",
                    key.name
                ),
            ));
            continue;
        }
        match value.as_int() {
            Some(n) if (1..=MAX_ORDER).contains(&n) => order = n as usize,
            _ => errors.push(err(
                ErrorKind::BadArgument,
                value.span(),
                format!(
                    "`order` is how many simulations `refine` may spend moving compute tasks \
                     into waits, an integer from 1 to {MAX_ORDER}, got `{value}`"
                ),
            )),
        }
    }
    order
}

/// Evaluate `expr` to its plan (every error found, with its span).
pub(crate) fn plan_of(req: &Request, expr: &Expr) -> Result<Plan, Vec<DeriveError>> {
    let mut errors = Vec::new();
    match eval(req, expr, &mut errors) {
        Some(plan) if errors.is_empty() => Ok(plan),
        _ => Err(errors),
    }
}

/// Lower, verify and simulate the plan of expression `text` (errors point at `span`),
/// and check it against the memory limit.
/// `refine`: also refine the transfers' placement by simulation ([`crate::refine`]),
/// and, given `Some(n)` with `n > 0`, the compute order with at most `n` simulations
/// ([`crate::reorder`]).
pub(crate) fn finish(
    req: &Request,
    plan: &Plan,
    text: &str,
    span: Span,
    refine: Option<usize>,
) -> Result<Derived, Vec<DeriveError>> {
    finish_unspanned(req, plan, text, refine).map_err(|es| {
        es.into_iter()
            .map(|(kind, message)| err(kind, span, message))
            .collect()
    })
}

/// [`finish`] with errors as kind and message: it touches no `proc_macro2` value, so
/// any thread may run it, even inside a procedural macro (where `proc_macro2` works
/// only on the thread the compiler called the macro on).
pub(crate) fn finish_unspanned(
    req: &Request,
    plan: &Plan,
    text: &str,
    refine: Option<usize>,
) -> Result<Derived, Vec<(ErrorKind, String)>> {
    let mut errors = Vec::new();
    let (program, report) =
        best_lowering(req, plan, text, refine).map_err(|m| vec![(ErrorKind::Invalid, m)])?;
    // Rule 5 (termination under rendezvous) holds: `best_lowering` ran it to the end,
    // under rendezvous unless the request asked for eager semantics; then check it.
    if req.mode != Mode::Rendezvous {
        if let Err(e) = simulate(&program, &req.sim_options(Mode::Rendezvous)) {
            return Err(vec![(
                ErrorKind::Invalid,
                format!("derived program does not run under rendezvous (a bug in mpipe, please report it): {e}"),
            )]);
        }
    }
    let violations = verify_static(&program);
    if !violations.is_empty() {
        return Err(violations
            .iter()
            .map(|v| {
                (
                    ErrorKind::Invalid,
                    format!("derived program is invalid (a bug in mpipe, please report it): {v}"),
                )
            })
            .collect());
    }
    let params = resident_params(&program);
    if let Some(limit) = req.profile.memory.as_ref().map(|m| m.limit) {
        // One error for every rank over the limit (issue 38 item 6).
        if let Some(m) = crate::advice::memory_over_limit(text, &report.peak_memory, &params, limit)
        {
            errors.push((ErrorKind::Memory, m));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let bound = bound_for(req.profile, &program, &req.sim_options(req.mode));
    Ok(Derived {
        program,
        report,
        bound,
        params,
        expr: text.to_string(),
    })
}

/// The lower bound a `program` derived for `profile` is read against, timed with
/// `opts`: the least over the algebra's stage splits, so that every schedule of the
/// profile is read against the same figure, or the program's own units' bound where
/// that is lower.
pub fn bound_for(profile: &Profile, program: &Program, opts: &SimOptions) -> Bound {
    let link = opts.held_link();
    let own = lower_bound(&program.units, program.ranks, program.microbatches, link);
    match profile_bound(profile, program.ranks, program.microbatches, link) {
        Some(b) if b.value() < own.value() => b,
        _ => own,
    }
}

/// Lower `plan` with every placement rule and keep the program that runs faster
/// under the request's semantics (rendezvous unless asked otherwise). All are
/// correct; they differ in where each transfer meets. The best placement is then
/// re-placed against the times its simulation measured, and refined move by move
/// ([`crate::refine`]). Every step stops once a program reaches the plan's ideal
/// (communication-free) timing, which no program of the plan can beat.
///
/// `refine`: `None` lowers only; `Some(n)` also refines the transfers and, for
/// `n > 0`, searches the compute order with at most `n` simulations
/// ([`crate::reorder`]), keeping its plan only if its full derivation is faster and
/// within the memory limit (without one, within the larger peak of the plan's own
/// lowering and of its refinement).
fn best_lowering(
    req: &Request,
    plan: &Plan,
    text: &str,
    refine: Option<usize>,
) -> Result<(Program, SimReport), String> {
    let limit = req.profile.memory.as_ref().map(|m| m.limit);
    let opts = req.sim_options(req.mode);
    let policy = &req.policy;
    let first = best_lowering_with(plan, Some(text), &opts, limit, refine.is_some(), policy)?;
    let budget = refine.unwrap_or(0);
    if budget == 0 {
        return Ok(first);
    }
    // Without a limit, the search may use the memory of the plan's own lowering or
    // of its refinement, whichever is more: refinement moves weight gradients
    // earlier, which lowers the peak, and the search judges its moves on lowerings.
    let cap = match limit {
        Some(l) => l,
        None => {
            let plain = best_lowering_with(plan, Some(text), &opts, None, false, policy)?;
            peak_memory_with_params(&first.0, &first.1)
                .max(peak_memory_with_params(&plain.0, &plain.1))
        }
    } * (1.0 + 1e-12);
    let fits = |p: &Program, r: &SimReport| peak_memory_with_params(p, r) <= cap;
    let mut best = first;
    let search = crate::reorder::Search {
        text: Some(text),
        opts: &opts,
        fits: &fits,
        moves: crate::reorder::Moves::AcrossRanks,
        policy,
    };
    crate::reorder::reorder_rounds(plan, &search, budget, &mut best, &|order, best| {
        best_lowering_with(order, Some(text), &opts, limit, true, policy)
            .ok()
            .filter(|(p, r)| r.makespan < best.makespan && fits(p, r))
    });
    Ok(best)
}

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
    let target = prepared.time.makespan() * (1.0 + 1e-12);
    let mut best: Option<(Vec<Vec<Placed>>, Program, SimReport)> = None;
    let done = |best: &Option<(Vec<Vec<Placed>>, Program, SimReport)>| {
        best.as_ref().is_some_and(|(_, _, b)| b.makespan <= target)
    };
    for placement in PLACEMENTS {
        if done(&best) {
            break;
        }
        let at = placement_of(plan, &prepared, placement, policy).map_err(|e| e.to_string())?;
        let program = assemble(plan, &at, text);
        let report =
            simulate(&program, opts).map_err(|e| format!("derived program does not run: {e}"))?;
        if best
            .as_ref()
            .is_none_or(|(_, _, b)| report.makespan < b.makespan)
        {
            best = Some((at, program, report));
        }
    }
    // Re-place the transfers against the times the best program actually ran at:
    // waiting shifts the timeline, and meeting points chosen on the shifted one
    // fit it better. A few rounds, keeping the fastest program.
    for _ in 0..replace_rounds {
        let Some((_, program, report)) = &best else {
            break;
        };
        if done(&best) {
            break;
        }
        let Some(time) = simulated_timing(plan, program, report, &prepared.time) else {
            break;
        };
        let again = prepared.retimed(time);
        let mut improved = false;
        for placement in PLACEMENTS {
            let Ok(at) = placement_of(plan, &again, placement, policy) else {
                continue;
            };
            let program = assemble(plan, &at, text);
            let Ok(report) = simulate(&program, opts) else {
                continue;
            };
            if best
                .as_ref()
                .is_none_or(|(_, _, b)| report.makespan < b.makespan)
            {
                best = Some((at, program, report));
                improved = true;
            }
        }
        if !improved {
            break;
        }
    }
    let (at, program, report) = best.ok_or_else(|| "no lowering".to_string())?;
    if report.makespan <= target || !refine_too {
        return Ok((program, report));
    }
    let budget = refine_budget
        .min(refine_actions / program.programs.iter().map(Vec::len).sum::<usize>().max(1));
    let moved = refine(plan, at, (program, report), text, opts, budget);
    if moved.1.makespan <= target {
        return Ok(moved);
    }
    // Then weight gradients into the waits left, within the memory limit (moving
    // parameters nowhere: the resident parameters stay the program's).
    let params = resident_params(&moved.0);
    let fits = |rep: &SimReport| {
        limit.is_none_or(|l| {
            rep.peak_memory
                .iter()
                .zip(&params)
                .all(|(act, par)| act + par <= l)
        })
    };
    let budget =
        w_budget.min(w_actions / moved.0.programs.iter().map(Vec::len).sum::<usize>().max(1));
    if budget < w_min {
        return Ok(moved);
    }
    Ok(settle_w(moved, opts, &fits, budget, policy))
}

/// The placement rules tried, in order.
pub(crate) const PLACEMENTS: [Placement; 5] = [
    Placement::Meet,
    Placement::Ready,
    Placement::Critical,
    Placement::Late,
    Placement::Join,
];

/// The compute tasks' times in a simulation of `program` (a lowering of `plan`), as a
/// [`Timing`] of the plan: settle order by end, then start, then the ideal order.
fn simulated_timing(
    plan: &Plan,
    program: &Program,
    report: &SimReport,
    ideal: &Timing,
) -> Option<Timing> {
    let mut start: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    let mut end: Vec<Vec<f64>> = Vec::with_capacity(plan.ranks);
    for (r, list) in program.programs.iter().enumerate() {
        let slots = report.timeline.ranks.get(r)?;
        let (mut s, mut e) = (Vec::new(), Vec::new());
        for (a, slot) in list.iter().zip(slots) {
            if matches!(a.view(), ActionRef::Compute(_)) {
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
    let mut all: Vec<(usize, usize)> = (0..plan.ranks)
        .flat_map(|r| (0..plan.order[r].len()).map(move |i| (r, i)))
        .collect();
    all.sort_by(|&(a, i), &(b, j)| {
        end[a][i]
            .total_cmp(&end[b][j])
            .then(start[a][i].total_cmp(&start[b][j]))
            .then(ideal.seq[a][i].cmp(&ideal.seq[b][j]))
    });
    let mut seq: Vec<Vec<usize>> = plan.order.iter().map(|l| vec![0; l.len()]).collect();
    for (k, (r, i)) in all.into_iter().enumerate() {
        seq[r][i] = k;
    }
    Some(Timing { start, end, seq })
}

/// Parse `text` and derive it. Parse errors come back as [`ErrorKind::BadArgument`].
pub fn derive_str(req: &Request, text: &str) -> Result<Derived, Vec<DeriveError>> {
    let expr = crate::expr::parse_str(text).map_err(|es| {
        es.into_iter()
            .map(|e| err(ErrorKind::BadArgument, e.span, e.message))
            .collect::<Vec<_>>()
    })?;
    derive(req, &expr)
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

/// Parameter memory resident on each rank: every unit's parameters on its home, and
/// on every rank that computes it elsewhere (broadcast or replicated).
pub fn resident_params(program: &Program) -> Vec<f64> {
    let index: std::collections::BTreeMap<&str, usize> = program
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name.as_str(), i))
        .collect();
    let mut held = vec![std::collections::BTreeSet::new(); program.ranks];
    for (u, unit) in program.units.iter().enumerate() {
        if unit.home < program.ranks {
            held[unit.home].insert(u);
        }
    }
    for (r, list) in program.programs.iter().enumerate().take(program.ranks) {
        let mut last: Option<&str> = None;
        for a in list {
            if let ActionRef::Compute(c) = a.view() {
                // Runs of actions on one unit are common: skip the lookup for them.
                if last == Some(c.unit) {
                    continue;
                }
                last = Some(c.unit);
                if let Some(&u) = index.get(c.unit) {
                    held[r].insert(u);
                }
            }
        }
    }
    held.iter()
        .map(|set| set.iter().map(|&u| program.units[u].params).sum())
        .collect()
}

fn eval(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let key = MEMO.with(|m| m.borrow().is_some()).then(|| {
        let split = req.profile.llm.split == crate::profile::Split::Balanced;
        (split, e.to_string())
    });
    if let Some(key) = &key {
        if let Some(plan) = MEMO.with(|m| m.borrow_mut().as_mut().and_then(|m| m.get(key))) {
            return Some(plan);
        }
    }
    let before = errors.len();
    let plan = eval_uncached(req, e, errors);
    // Only clean results are kept: a failure is evaluated again, so that its errors
    // carry the spans of the expression at hand.
    if let (Some(key), Some(plan)) = (key, &plan) {
        if errors.len() == before {
            MEMO.with(|m| {
                if let Some(m) = m.borrow_mut().as_mut() {
                    m.put(key, plan.clone());
                }
            });
        }
    }
    plan
}

thread_local! {
    /// Plans of the sub-expressions evaluated lately on this thread, while
    /// [`with_plan_memo`] runs.
    static MEMO: std::cell::RefCell<Option<PlanMemo>> = const { std::cell::RefCell::new(None) };
}

/// The last few plans evaluated, by (balanced split, canonical expression text): a
/// plan depends on nothing else within one request.
struct PlanMemo {
    /// Plans kept ([`SearchPolicy::plan_memo`]).
    capacity: usize,
    entries: std::collections::VecDeque<((bool, String), Plan)>,
}

impl PlanMemo {
    fn get(&mut self, key: &(bool, String)) -> Option<Plan> {
        let at = self.entries.iter().position(|(k, _)| k == key)?;
        let hit = self.entries.remove(at)?;
        let plan = hit.1.clone();
        self.entries.push_back(hit);
        Some(plan)
    }

    fn put(&mut self, key: (bool, String), plan: Plan) {
        if self.entries.len() >= self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((key, plan));
    }
}

/// Runs `f` with the plans of sub-expressions remembered on this thread for one
/// request (the search evaluates thousands of candidates that share inner
/// expressions), at most `capacity` of them. Results are the same with or without it.
pub(crate) fn with_plan_memo<T>(capacity: usize, f: impl FnOnce() -> T) -> T {
    let before = MEMO.with(|m| {
        m.replace(Some(PlanMemo {
            capacity,
            entries: Default::default(),
        }))
    });
    let out = f();
    MEMO.with(|m| *m.borrow_mut() = before);
    out
}

fn eval_uncached(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let name = e.name();
    if let Some(kind) = body_kind(e, errors) {
        return match generate_by(kind, req.profile, req.ranks, req.microbatches, &req.policy) {
            Ok(plan) => Some(plan),
            Err(g) => {
                let kind = match g {
                    GenError::Microbatches { .. } | GenError::NoMicrobatches => {
                        ErrorKind::Microbatches
                    }
                    GenError::Chunks(_) | GenError::Ramp(_) | GenError::Chains(_) => {
                        ErrorKind::BadArgument
                    }
                    GenError::Units(_) => ErrorKind::Profile,
                };
                errors.push(err(kind, e.span, format!("`{e}`: {g}")));
                None
            }
        };
    }
    if BODY_NAMES.contains(&name) {
        return None; // body_kind reported the argument errors
    }
    match name {
        "transpose" => eval_transpose(req, e, errors),
        "split_w" => eval_split_w(req, e, errors),
        "layers" => eval_layers(req, e, errors),
        "auto" | "refine" => {
            errors.push(err(
                ErrorKind::BadArgument,
                e.span,
                format!(
                    "`{name}` stands for a whole schedule and cannot be an operator's argument; {}",
                    if name == "auto" {
                        "write `auto` alone"
                    } else {
                        "write it outermost, as in `refine(zbh1)`"
                    }
                ),
            ));
            None
        }
        "fill" => eval_fill(req, e, errors),
        "chain" => eval_chain(req, e, errors),
        "host" => eval_host(req, e, errors),
        "balance" => eval_balance(req, e, errors),
        "prefetch" => eval_prefetch(req, e, errors),
        _ => {
            let mut all: Vec<&str> = BODY_NAMES.to_vec();
            all.extend(OPERATOR_NAMES);
            let hint = did_you_mean(name, &all)
                .map(|s| format!(" (did you mean `{s}`?)"))
                .unwrap_or_default();
            errors.push(err(
                ErrorKind::UnknownName,
                e.head.span,
                format!(
                    "unknown schedule `{name}`{hint}; expected one of: {}",
                    all.join(", ")
                ),
            ));
            None
        }
    }
}

/// The body generator `e` names, with its arguments checked; `None` if `e` is not a
/// body or its arguments are bad (then errors says why).
fn body_kind(e: &Expr, errors: &mut Vec<DeriveError>) -> Option<BodyKind> {
    let kind = match e.name() {
        "gpipe" => BodyKind::GPipe,
        "1f1b" => BodyKind::OneFOneB,
        "zbh1" => BodyKind::ZbH1,
        "zbv" => BodyKind::ZbV,
        "dualpipev" => BodyKind::DualPipeV,
        "interleaved" => BodyKind::Interleaved { v: 2 },
        "zb2p" => BodyKind::Zb2p {
            v: 1,
            vshape: false,
            lockstep: false,
            encoders: Weave::Inline,
        },
        _ => return None,
    };
    let keys: &[&str] = match e.name() {
        "interleaved" => &["v"],
        "zb2p" => &["v", "layout", "costs", "encoders"],
        _ => &[],
    };
    let before = errors.len();
    for a in &e.args {
        match a {
            Arg::Expr(x) => errors.push(err(
                ErrorKind::BadArgument,
                x.span,
                format!(
                    "`{}` takes no schedule argument{}",
                    e.name(),
                    if keys.is_empty() {
                        "s"
                    } else {
                        "; it takes `v = N`"
                    }
                ),
            )),
            Arg::Key { key, .. } if !keys.contains(&key.name.as_str()) => errors.push(err(
                ErrorKind::BadArgument,
                key.span,
                if keys.is_empty() {
                    format!("`{}` takes no arguments", e.name())
                } else {
                    format!(
                        "unknown argument `{}` of `{}`; expected one of: {}",
                        key.name,
                        e.name(),
                        keys.join(", ")
                    )
                },
            )),
            Arg::Key { .. } => {}
        }
    }
    let kind = match (kind, e.find_key("v")) {
        (BodyKind::Interleaved { .. }, Some(v)) => match v.as_int() {
            Some(v) if v >= 2 => BodyKind::Interleaved { v: v as usize },
            _ => {
                errors.push(err(
                    ErrorKind::BadArgument,
                    v.span(),
                    format!("`v` is the number of chunks per rank, an integer >= 2 (v = 1 is `1f1b`), got `{v}`"),
                ));
                return None;
            }
        },
        (BodyKind::Zb2p { .. }, v) => {
            // All three are read (and their mistakes reported) before giving up.
            let keys = (
                one_of(e, "layout", &["looped", "v"], errors).map(|i| i == 1),
                one_of(e, "costs", &["profile", "unit"], errors).map(|i| i == 1),
                one_of(e, "encoders", &Weave::NAMES, errors),
            );
            let (Some(vshape), Some(lockstep), Some(weave)) = keys else {
                return None;
            };
            let chunks = match (v.map(|v| (v, v.as_int())), vshape) {
                (None, false) => Ok(1),
                (None, true) | (Some((_, Some(2))), true) => Ok(2),
                (Some((_, Some(n))), false) if n >= 1 => Ok(n as usize),
                (Some((v, _)), true) => Err((
                    v,
                    format!("`layout = v` has 2 chunks per rank; drop `v = {v}`"),
                )),
                (Some((v, _)), false) => Err((
                    v,
                    format!("`v` is the number of chunks per rank, an integer >= 1, got `{v}`"),
                )),
            };
            match chunks {
                Ok(chunks) => BodyKind::Zb2p {
                    v: chunks,
                    vshape,
                    lockstep,
                    encoders: Weave::ALL[weave],
                },
                Err((v, message)) => {
                    errors.push(err(ErrorKind::BadArgument, v.span(), message));
                    return None;
                }
            }
        }
        (k, _) => k,
    };
    (errors.len() == before).then_some(kind)
}

/// The value of `e`'s `key`, one of `names`: its index (0, the default, when the
/// key is absent); `None` (reported) for anything else.
fn one_of(e: &Expr, key: &str, names: &[&str], errors: &mut Vec<DeriveError>) -> Option<usize> {
    let Some(value) = e.find_key(key) else {
        return Some(0);
    };
    let found = value
        .as_name()
        .and_then(|n| names.iter().position(|x| *x == n));
    if found.is_none() {
        errors.push(err(
            ErrorKind::BadArgument,
            value.span(),
            format!(
                "bad value `{value}` for `{key}`; expected one of: {}",
                names.join(", ")
            ),
        ));
    }
    found
}

/// Reports every `key = value` argument of `e`, an operator written `usage`; whether
/// there were none.
fn no_keys(e: &Expr, usage: &str, errors: &mut Vec<DeriveError>) -> bool {
    let mut none = true;
    for (key, _) in e.keys() {
        errors.push(err(
            ErrorKind::BadArgument,
            key.span,
            format!(
                "`{}` takes no `{}` argument; write `{usage}`",
                e.name(),
                key.name
            ),
        ));
        none = false;
    }
    none
}

/// The one positional argument (a body) of an operator (`example` shows its use), or
/// an error; the arguments are still evaluated, so their mistakes show too.
fn one_body<'e>(
    req: &Request,
    e: &'e Expr,
    example: &str,
    errors: &mut Vec<DeriveError>,
) -> Option<&'e Expr> {
    let pos: Vec<&Expr> = e.positional().collect();
    if let [body] = pos[..] {
        return outermost_layers(e, body, errors).then_some(body);
    }
    errors.push(err(
        ErrorKind::BadArgument,
        e.span,
        format!(
            "`{}` takes one body, as in `{example}`; got {} positional argument(s)",
            e.name(),
            pos.len()
        ),
    ));
    for p in &pos {
        eval(req, p, errors);
    }
    None
}

fn eval_layers(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    no_keys(e, "layers(SCHEDULE)", errors);
    let body = one_body(req, e, "layers(zbh1)", errors)?;
    let plan = eval(req, body, errors)?;
    Some(layers(plan, req.profile))
}

fn eval_split_w(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    no_keys(e, "split_w(BODY)", errors);
    let body = one_body(req, e, "split_w(1f1b)", errors)?;
    let plan = eval(req, body, errors)?;
    applied(e, split_w(plan), errors)
}

fn eval_transpose(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let mut ok = true;
    let mut owners = Owners::default();
    let mut backward = Backward::default();
    for (key, value) in e.keys() {
        let choice = |choices: &[&str]| -> Result<usize, DeriveError> {
            value
                .as_name()
                .and_then(|n| choices.iter().position(|c| *c == n))
                .ok_or_else(|| {
                    err(
                        ErrorKind::BadArgument,
                        value.span(),
                        format!(
                            "bad value `{value}` for `{}`; expected one of: {}",
                            key.name,
                            choices.join(", ")
                        ),
                    )
                })
        };
        let r = match key.name.as_str() {
            "owners" => choice(&["round_robin", "min", "spare"])
                .map(|i| owners = [Owners::RoundRobin, Owners::Min, Owners::Spare][i]),
            "backward" => choice(&["local", "central"])
                .map(|i| backward = [Backward::Local, Backward::Central][i]),
            other => Err(err(
                ErrorKind::BadArgument,
                key.span,
                format!(
                    "unknown argument `{other}` of `transpose`; expected one of: owners, backward"
                ),
            )),
        };
        if let Err(x) = r {
            errors.push(x);
            ok = false;
        }
    }
    let (_, id, plan) = encoder_and_plan(req, e, "transpose(vision, 1f1b)", ok, errors)?;
    applied(e, transpose(plan, id, owners, backward), errors)
}

/// The two positional arguments of an encoder operator (`example` shows its use), or
/// an error; the extra arguments are still evaluated, so their mistakes show too.
fn encoder_and_body<'e>(
    req: &Request,
    e: &Expr,
    pos: &[&'e Expr],
    example: &str,
    errors: &mut Vec<DeriveError>,
) -> Option<(&'e Expr, &'e Expr)> {
    if let [enc, body] = pos {
        return outermost_layers(e, body, errors).then_some((enc, body));
    }
    errors.push(err(
        ErrorKind::BadArgument,
        e.span,
        format!(
            "`{}` takes an encoder and a body, as in `{example}`; got {} positional argument(s)",
            e.name(),
            pos.len()
        ),
    ));
    for p in pos.iter().skip(1) {
        eval(req, p, errors);
    }
    None
}

/// `layers` cuts units into layers, after which no operator finds the units it
/// names: it goes around a whole schedule (only `refine` may go around it). False,
/// with an error, when `body` (an argument of `e`) is a `layers`.
fn outermost_layers(e: &Expr, body: &Expr, errors: &mut Vec<DeriveError>) -> bool {
    if body.name() != "layers" || e.name() == "refine" {
        return true;
    }
    if e.name() == "layers" {
        errors.push(err(
            ErrorKind::BadArgument,
            body.span,
            "`layers` inside `layers`: one `layers` already computes every unit layer by \
             layer (only `refine` may go around it); write `layers(..)` once"
                .to_string(),
        ));
        return false;
    }
    errors.push(err(
        ErrorKind::BadArgument,
        body.span,
        format!(
            "`layers` must be outermost (only `refine` may go around it): write `layers({name}(..))`, not `{name}(.., layers(..))`",
            name = e.name()
        ),
    ));
    false
}

/// Whether `enc` names an encoder of the profile (else an error says which do).
fn check_encoder(req: &Request, enc: &Expr, errors: &mut Vec<DeriveError>) -> bool {
    let names: Vec<&str> = req
        .profile
        .encoders
        .iter()
        .map(|x| x.name.as_str())
        .collect();
    if enc.args.is_empty() && names.contains(&enc.name()) {
        return true;
    }
    let listing = if names.is_empty() {
        "the profile has no encoders ([[encoder]] tables)".to_string()
    } else {
        format!("the profile's encoders are: {}", names.join(", "))
    };
    let hint = did_you_mean(enc.name(), &names)
        .map(|s| format!(" (did you mean `{s}`?)"))
        .unwrap_or_default();
    errors.push(err(
        ErrorKind::UnknownName,
        enc.span,
        format!("unknown encoder `{enc}`{hint}; {listing}"),
    ));
    false
}

/// `balance(BODY)`: `BODY` with the LLM's layers split so that every stage's work is
/// as even as possible (see [`crate::units`]) instead of evenly per stage.
fn eval_balance(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    no_keys(e, "balance(BODY)", errors);
    let body = one_body(req, e, "balance(zbv)", errors)?;
    if req.profile.llm.layout.is_some() {
        errors.push(err(
            ErrorKind::BadArgument,
            e.head.span,
            "`balance` chooses the stage split, but the profile fixes it with `llm.layout`; \
             drop one of the two",
        ));
        return None;
    }
    let mut profile = req.profile.clone();
    profile.llm.split = crate::profile::Split::Balanced;
    let inner = Request {
        profile: &profile,
        ..*req
    };
    eval(&inner, body, errors)
}

fn eval_prefetch(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let (enc, id, plan) = encoder_operator(
        req,
        e,
        "prefetch(ENCODER, BODY)",
        "prefetch(vision, zbv)",
        errors,
    )?;
    if plan.needs_backward()[id] {
        errors.push(err(
            ErrorKind::BadArgument,
            enc.span,
            format!(
                "`prefetch` needs a frozen encoder, and `{}` is trainable: its forward for the \
                 next step would read parameters this step updates; use `fill` or `transpose`",
                enc.name()
            ),
        ));
        return None;
    }
    applied(e, prefetch(plan, id, req.profile), errors)
}

fn eval_fill(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let (_, id, plan) =
        encoder_operator(req, e, "fill(ENCODER, BODY)", "fill(vision, zbv)", errors)?;
    applied(e, fill(plan, id, link(req), req.profile), errors)
}

/// `chain(ENCODER, BODY)`: the encoder cut into per-rank layer chunks placed into
/// the body's idle time.
fn eval_chain(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let (enc, id, plan) = encoder_operator(
        req,
        e,
        "chain(ENCODER, BODY)",
        "chain(vision, zb2p(costs = unit))",
        errors,
    )?;
    let spec = req.profile.encoders.iter().find(|x| x.name == enc.name())?;
    chain(plan, id, spec, link(req))
        .map_err(|x| {
            let span = match x {
                ChainError::NotFeeding(_) => enc.span,
                ChainError::Plan(_) => e.span,
            };
            errors.push(err(ErrorKind::Invalid, span, format!("`{e}`: {x}")))
        })
        .ok()
}

/// `host(ENCODER, BODY, rank = N | spare)`; `rank` defaults to `spare`.
fn eval_host(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let mut ok = true;
    let mut to = Host::Spare;
    for (key, value) in e.keys() {
        let r = match (key.name.as_str(), value) {
            ("rank", Value::Int { value: n, span }) => match usize::try_from(*n) {
                Ok(n) if n < req.ranks => {
                    to = Host::Rank(n);
                    Ok(())
                }
                _ => Err(err(
                    ErrorKind::BadArgument,
                    *span,
                    format!(
                        "rank {n} does not exist: the request has {} ranks (0..{}); \
                         or write `rank = spare`",
                        req.ranks,
                        req.ranks.saturating_sub(1)
                    ),
                )),
            },
            ("rank", Value::Name(id)) if id.name == "spare" => Ok(()),
            ("rank", v) => Err(err(
                ErrorKind::BadArgument,
                v.span(),
                format!("bad value `{v}` for `rank`; expected a rank number or `spare`"),
            )),
            (other, _) => Err(err(
                ErrorKind::BadArgument,
                key.span,
                format!("unknown argument `{other}` of `host`; expected: rank"),
            )),
        };
        if let Err(x) = r {
            errors.push(x);
            ok = false;
        }
    }
    let (_, id, plan) = encoder_and_plan(req, e, "host(audio, zbv, rank = 2)", ok, errors)?;
    applied(e, host(plan, id, to, link(req)), errors)
}

/// The plan operator `e` produced, or its failure reported at `e` (a bug in mpipe:
/// operators keep plans valid).
fn applied(e: &Expr, r: Result<Plan, PlanError>, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    r.map_err(|x| errors.push(err(ErrorKind::Invalid, e.span, format!("`{e}`: {x}"))))
        .ok()
}

/// An encoder operator `e`, written `usage` (`example` shows its use), that takes no
/// keys: its encoder argument, the encoder's unit and the evaluated body; every
/// mistake is reported.
fn encoder_operator<'e>(
    req: &Request,
    e: &'e Expr,
    usage: &str,
    example: &str,
    errors: &mut Vec<DeriveError>,
) -> Option<(&'e Expr, UnitId, Plan)> {
    let keys_ok = no_keys(e, usage, errors);
    encoder_and_plan(req, e, example, keys_ok, errors)
}

/// An encoder operator's encoder argument, the encoder's unit and the evaluated
/// body (`example` shows its use), or `None` once every mistake is reported;
/// `keys_ok` says whether its `key = value` arguments were good.
fn encoder_and_plan<'e>(
    req: &Request,
    e: &'e Expr,
    example: &str,
    keys_ok: bool,
    errors: &mut Vec<DeriveError>,
) -> Option<(&'e Expr, UnitId, Plan)> {
    let pos: Vec<&Expr> = e.positional().collect();
    let (enc, body) = encoder_and_body(req, e, &pos, example, errors)?;
    let ok = check_encoder(req, enc, errors) && keys_ok;
    let plan = eval(req, body, errors)?;
    if !ok {
        return None;
    }
    if plan.unit_id(enc.name()).is_none() {
        // `fill` or `prefetch` in the body cut it into layers: join them again.
        if let Some((joined, id)) = crate::operators::layers::join_encoder(&plan, enc.name()) {
            return Some((enc, id, joined));
        }
    }
    let Some(id) = plan.unit_id(enc.name()) else {
        // The body cut the encoder into chunks (`chain`, `zb2p(encoders = chain)`).
        errors.push(err(
            ErrorKind::BadArgument,
            enc.span,
            format!(
                "`{enc}` is no longer one unit in this body: it was cut into layer chunks \
                 (`{enc}.0`, `{enc}.1`, ..) by `chain` or `zb2p(encoders = chain | ramp)`; apply \
                 `{}` to a body that keeps the encoder whole",
                e.name()
            ),
        ));
        return None;
    };
    Some((enc, id, plan))
}

/// The profile's link as operators take it: `(latency, bandwidth)`.
fn link(req: &Request) -> crate::operators::fill::Link {
    req.profile.link.as_ref().map(|l| (l.latency, l.bandwidth))
}

/// The closest candidate within edit distance 2, if any.
pub fn did_you_mean<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    // The nearest; on a tie, the first in `candidates` (their order is the caller's
    // preference, e.g. the order keys are documented in).
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (crate::profile::edit_distance(word, c), i, *c))
        .filter(|&(d, ..)| d <= 2)
        .min()
        .map(|(.., c)| c)
}

#[cfg(test)]
mod tests {
    use super::did_you_mean;

    #[test]
    fn did_you_mean_counts_a_swap_as_one_edit_and_breaks_ties_by_order() {
        let keys = ["model", "model_toml", "ranks", "mode"];
        // `modle` is one swap from `model` and one deletion from `mode`: the tie
        // goes to the key listed first.
        assert_eq!(did_you_mean("modle", &keys), Some("model"));
        assert_eq!(did_you_mean("modle", &["mode", "model"]), Some("mode"));
        assert_eq!(did_you_mean("rnaks", &keys), Some("ranks"));
        assert_eq!(did_you_mean("moed", &keys), Some("mode"));
        assert_eq!(did_you_mean("schedule", &keys), None);
    }
}
