//! A plan to a verified, simulated program: the best lowering ([`crate::search::place`]),
//! with `refine(X, order = N)` the compute-order search ([`crate::search::reorder`]) on top,
//! then the checks every derived program passes (termination under rendezvous, the
//! static rules, the memory limit) and its lower bound.

use crate::algebra::eval::{err, DeriveError, ErrorKind, Request};
use crate::algebra::expr::Span;
use crate::algebra::profile::Profile;
use crate::ir::compare::at_most;
use crate::ir::plan::Plan;
use crate::ir::program::Program;
use crate::judge::bound::{lower_bound, profile_bound, Bound};
use crate::judge::compare::span;
use crate::judge::simulate::{simulate, Mode, SimOptions, SimReport};
use crate::judge::verify::verify_static;
use crate::search::periodic::periodic_if_no_slower;
use crate::search::place::{best_lowering_with, peak_memory_with_params, resident_params};
use std::borrow::Cow;

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

/// Lower, verify and simulate the plan of expression `text` (errors point at `span`),
/// and check it against the memory limit.
/// `refine`: also refine the transfers' placement by simulation (`refine`),
/// and, given `Some(n)` with `n > 0`, the compute order with at most `n` simulations
/// (`reorder`).
pub(crate) fn finish(
    req: &Request,
    plan: &Plan,
    text: &str,
    span: Span,
    refine: Option<usize>,
) -> Result<Derived, Vec<DeriveError>> {
    finish_checked(req, plan, text, span, refine).map(|c| c.bounded(req))
}

/// [`finish`] with the compute-order search of at most `order` simulations reading
/// back the trials `trials` recorded of an earlier search of the same plan under
/// the same request, and recording its own there (see
/// [`crate::search::reorder::Trials`]): the same derivation, with fewer
/// simulations when the earlier search went some way.
pub(crate) fn finish_replaying(
    req: &Request,
    plan: &Plan,
    text: &str,
    order: usize,
    trials: &crate::search::reorder::Trials,
) -> Result<Derived, Vec<DeriveError>> {
    check(req, Cow::Borrowed(plan), text, Some(order), Some(trials))
        .map_err(|es| {
            es.into_iter()
                .map(|(kind, message)| err(kind, Span::NONE, message))
                .collect()
        })
        .map(|c| c.bounded(req))
}

/// A derivation checked as [`finish`] checks it, without its lower bound yet: a
/// caller comparing several derivations bounds only the one it keeps.
pub(crate) struct Checked {
    program: Program,
    pub report: SimReport,
    params: Vec<f64>,
    expr: String,
}

impl Checked {
    /// The derivation, with the lower bound its program is read against.
    pub(crate) fn bounded(self, req: &Request) -> Derived {
        let bound = bound_for(req.profile, &self.program, &req.sim_options(req.mode));
        Derived {
            program: self.program,
            report: self.report,
            bound,
            params: self.params,
            expr: self.expr,
        }
    }
}

/// [`finish`] up to the lower bound (see [`Checked`]).
pub(crate) fn finish_checked(
    req: &Request,
    plan: &Plan,
    text: &str,
    span: Span,
    refine: Option<usize>,
) -> Result<Checked, Vec<DeriveError>> {
    check(req, Cow::Borrowed(plan), text, refine, None).map_err(|es| {
        es.into_iter()
            .map(|(kind, message)| err(kind, span, message))
            .collect()
    })
}

/// [`finish_checked`] of a plan the caller no longer needs: without `refine`, the
/// plan goes once its best lowering is named, before the periodic placement and the
/// checks run beside the named program (at 8 x 65536 a plan is tens of MB, a task
/// 24 bytes).
pub(crate) fn finish_checked_taking(
    req: &Request,
    plan: Plan,
    text: &str,
    span: Span,
) -> Result<Checked, Vec<DeriveError>> {
    check(req, Cow::Owned(plan), text, None, None).map_err(|es| {
        es.into_iter()
            .map(|(kind, message)| err(kind, span, message))
            .collect()
    })
}

/// [`finish_checked`], its errors as kind and message (the caller gives them the
/// span). A plan given owned is dropped as soon as it is not needed.
fn check(
    req: &Request,
    plan: Cow<'_, Plan>,
    text: &str,
    refine: Option<usize>,
    trials: Option<&crate::search::reorder::Trials>,
) -> Result<Checked, Vec<(ErrorKind, String)>> {
    let mut errors = Vec::new();
    let (program, report) = best_lowering(req, plan, text, refine, trials)
        .map_err(|m| vec![(ErrorKind::Invalid, m)])?;
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
        if let Some(m) =
            crate::judge::advice::memory_over_limit(text, &report.peak_memory, &params, limit)
        {
            errors.push((ErrorKind::Memory, m));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(Checked {
        program,
        report,
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
/// (`refine`). Every step stops once a program reaches the plan's ideal
/// (communication-free) timing, which no program of the plan can beat.
///
/// `refine`: `None` lowers only; `Some(n)` also refines the transfers and, for
/// `n > 0`, searches the compute order with at most `n` simulations
/// (`reorder`, reading back and recording its trials in `trials` if given), keeping its plan only if its full derivation is faster and
/// within the memory limit (without one, within the larger peak of the plan's own
/// lowering and of its refinement). Last, the program kept gets its transfers placed
/// periodically where that is no slower ([`periodic_if_no_slower`]); with `refine`,
/// so does the plan's own lowering, which is kept instead if it is then faster (so
/// `refine(X)` is never slower than `X`).
fn best_lowering(
    req: &Request,
    plan: Cow<'_, Plan>,
    text: &str,
    refine: Option<usize>,
    trials: Option<&crate::search::reorder::Trials>,
) -> Result<(Program, SimReport), String> {
    let limit = req.profile.memory.as_ref().map(|m| m.limit);
    let opts = req.sim_options(req.mode);
    let policy = &req.policy;
    // With an order search whose trials an earlier derivation of the same plan
    // recorded, that derivation's two lowerings below are this one's: derived
    // again, they come out the same but for the expression they record.
    let kept = match refine {
        Some(n) if n > 0 => trials.and_then(|t| t.start()),
        _ => None,
    };
    let kept = kept.map(|(first, plain)| (named(first, text), named(plain, text)));
    let (first, kept_plain) = match kept {
        Some((first, plain)) => (first, Some(plain)),
        None => (
            best_lowering_with(&plan, Some(text), &opts, limit, refine.is_some(), policy)?,
            None,
        ),
    };
    let Some(budget) = refine else {
        // Not needed by the periodic placement (an owned plan goes here).
        drop(plan);
        return Ok(periodic_if_no_slower(first, &opts, policy));
    };
    let plan = &*plan;
    // The plan's own lowering, unrefined: with the periodic placement applied after
    // the searches, it can come out faster than the refinement does (the placement
    // may gain more on it), and `refine(X)` is never slower than `X`.
    let plain = || best_lowering_with(plan, Some(text), &opts, None, false, policy);
    let faster = |refined: (Program, SimReport), plain: (Program, SimReport)| {
        if span(&plain.1).beats(&span(&refined.1)) {
            plain
        } else {
            refined
        }
    };
    if budget == 0 {
        let refined = periodic_if_no_slower(first, &opts, policy);
        return Ok(faster(
            refined,
            periodic_if_no_slower(plain()?, &opts, policy),
        ));
    }
    let plain = match kept_plain {
        Some(plain) => plain,
        None => plain()?,
    };
    if let Some(t) = trials {
        t.keep(&(first.clone(), plain.clone()));
    }
    // What `refine(X)` and `X` give (as with no order search above): the periodic
    // placement applied after the search can gain more on the search's start than
    // on what it found, and `refine(X, order = N)` is never slower than
    // `refine(X)`.
    let plain = periodic_if_no_slower(plain, &opts, policy);
    let unordered = faster(
        periodic_if_no_slower(first.clone(), &opts, policy),
        plain.clone(),
    );
    // Without a limit, the search may use the memory of `X` or of `refine(X)`,
    // whichever is more (refinement moves weight gradients earlier, which lowers the
    // peak), not that of the refined lowering where `refine(X)` is the plain one:
    // the order is searched for speed, not bought with memory the user did not
    // spend.
    let cap = match limit {
        Some(l) => l,
        None => peak_memory_with_params(&unordered.0, &unordered.1)
            .max(peak_memory_with_params(&plain.0, &plain.1)),
    };
    drop(plain);
    let fits = |p: &Program, r: &SimReport| at_most(peak_memory_with_params(p, r), cap);
    let mut best = first;
    let search = crate::search::reorder::Search {
        text: Some(text),
        opts: &opts,
        fits: &fits,
        moves: crate::search::reorder::Moves::AcrossRanks,
        policy,
        trials,
    };
    let found =
        crate::search::reorder::reorder_rounds(plan, &search, budget, &mut best, &|order, best| {
            best_lowering_with(order, Some(text), &opts, limit, true, policy)
                .ok()
                .filter(|(p, r)| span(r).beats(&span(best)) && fits(p, r))
        });
    // What the search found fits (each plan kept was checked) and is kept where it
    // is faster; a search that kept nothing leaves `best` the start.
    if !found {
        return Ok(unordered);
    }
    Ok(faster(
        periodic_if_no_slower(best, &opts, policy),
        unordered,
    ))
}

/// `run`'s program recording `text` as its source expression.
fn named(mut run: (Program, SimReport), text: &str) -> (Program, SimReport) {
    run.0.source = Some(crate::ir::program::Source {
        expr: text.to_string(),
    });
    run
}
