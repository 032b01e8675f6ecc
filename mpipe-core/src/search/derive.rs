//! The derivation: profile + expression -> verified, simulated program, and the
//! entry every caller uses (`mpipe_core::derive::derive`).
//!
//! ```text
//! Expr ──eval──► Plan ──lower──► Program ──verify──► ──simulate──► memory check
//! ```
//!
//! [`derive()`] checks the request, then resolves what only the search can answer
//! here, above the algebra: `auto` ([`crate::search::auto`]) and
//! `refine(X, order = N)`. Everything else it hands down: the algebra's evaluation
//! (`algebra::eval`) gives the plan, with every mistake of the expression
//! at its span, and `search::finish` the checked, simulated program.

pub use crate::algebra::eval::{
    body_names, operator_names, signature, DeriveError, ErrorKind, Request, MAX_ORDER,
};
use crate::algebra::eval::{err, eval, one_body, plan_of};
use crate::algebra::expr::Expr;
pub use crate::ir::text::did_you_mean;
use crate::search::finish::finish;
pub use crate::search::finish::{bound_for, Derived};
use crate::search::named::{choose_placement, with_records};
pub use crate::search::place::resident_params;

use crate::ir::program::OverLimit;
pub use crate::ir::program::{MAX_MICROBATCHES, MAX_RANK_MICROBATCHES};

/// `auto` (`expr`, the `auto` node) as [`derive`] derives it, with the work its
/// search spent ([`crate::search::Search::work`], in task visits): a measure of the
/// search's cost that, unlike its time, is the same on every machine and under any
/// load (the `schedule!` macro notes a long search by it).
pub fn derive_auto(req: &Request, expr: &Expr) -> Result<(Derived, u64), Vec<DeriveError>> {
    sizes_fit(req, expr)?;
    crate::search::auto::auto(req, expr)
}

/// The request's sizes are ones a step can have (errors at `expr`'s span).
fn sizes_fit(req: &Request, expr: &Expr) -> Result<(), Vec<DeriveError>> {
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
    let over = crate::ir::program::over_limit(req.ranks, req.microbatches);
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
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Derive, verify and simulate `expr` for `req`. All errors found are returned.
pub fn derive(req: &Request, expr: &Expr) -> Result<Derived, Vec<DeriveError>> {
    sizes_fit(req, expr)?;
    if expr.name() == "auto" {
        return crate::search::auto::auto(req, expr).map(|(d, _)| d);
    }
    with_records(req, |req| match expr.name() {
        "refine" => {
            let mut errors = Vec::new();
            let (checked, inner) = one_body(req, expr, &mut errors);
            let order = checked
                .and_then(|c| c.int("order"))
                .map_or(0, |(n, _)| n as usize);
            match inner {
                Some(x) if matches!(x.name(), "auto" | "refine") => errors.push(err(
                    ErrorKind::BadArgument,
                    x.span,
                    format!("`refine` takes a schedule expression, not `{}` (`auto` refines its choice already)", x.name()),
                )),
                _ => {}
            }
            let plan = inner.and_then(|x| eval(req, x, &mut errors));
            match (plan, inner) {
                (Some(plan), Some(inner)) if errors.is_empty() => {
                    // The placement chosen as for the body alone, then refined (the
                    // order search runs once, on the winner).
                    let chosen = choose_placement(req, plan, inner, true, f64::INFINITY);
                    let plan = chosen.plan.expect("kept when asked for");
                    finish(req, &plan, &expr.to_string(), expr.span, Some(order))
                }
                _ => Err(errors),
            }
        }
        _ => {
            let plan = plan_of(req, expr)?;
            choose_placement(req, plan, expr, false, f64::INFINITY).derived
        }
    })
}

/// Parse `text` and derive it. Parse errors come back as [`ErrorKind::BadArgument`].
pub fn derive_str(req: &Request, text: &str) -> Result<Derived, Vec<DeriveError>> {
    let expr = crate::algebra::expr::parse_str(text).map_err(|es| {
        es.into_iter()
            .map(|e| err(ErrorKind::BadArgument, e.span, e.message))
            .collect::<Vec<_>>()
    })?;
    derive(req, &expr)
}
