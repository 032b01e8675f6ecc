//! Re-derive the communication of an existing program from its compute order.
//!
//! A program that did not come from mpipe's derivation (imported from PyTorch, edited
//! by hand, produced by another tool) carries its transfers where its author put
//! them. Under rendezvous semantics that placement decides how long ranks wait, and a
//! wrong one hangs. [`relower`] keeps what each rank computes and in which order,
//! drops the program's transfers and collectives, and derives them again as
//! [`crate::search::derive`] does for its own plans: every placement rule of
//! [`crate::algebra::lower`], re-placement against the simulated times, then refinement by
//! simulation ([`crate::search::refine`]), which may also move weight-gradient tasks (`W`)
//! into waits.
//!
//! [`relower_ordered`] may also change the compute order: with a budget of `order`
//! simulations it first searches the plan's order as `refine(X, order = N)` does
//! ([`crate::search::reorder`]), and keeps the search's result only when its derivation is
//! faster than the input order's.
//!
//! Guarantees:
//! - the result is valid (rules 1-5 of docs/spec/program-format.md) and deadlock-free under
//!   rendezvous, whatever the input's transfers were (the lowering's key order);
//! - every rank runs the same compute tasks, and (with [`relower`], or an `order` of
//!   0) its forwards and backwards (`F`, `B`, `BW`, `RF`) in the input's order; only
//!   `W`s may move;
//! - it is never slower than the input under the same semantics: when the input
//!   runs and is at least as fast, it is returned unchanged;
//! - memory: every rank's activations plus resident parameters stay within the
//!   limit given or, without one, within the largest such peak of a valid input
//!   (weight gradients move only within it; when the re-derived program would still
//!   exceed it, the input is kept, or without a valid input the call fails);
//! - deterministic.

use crate::algebra::lower::LowerError;
use crate::ir::compare::at_most;
use crate::ir::program::Program;
use crate::judge::compare::span;
use crate::judge::simulate::{simulate, Mode, SimOptions, SimReport};
use crate::judge::verify::verify_static;
use crate::search::place::{best_lowering_with, peak_memory_with_params};
pub use crate::search::replan::{plan_of_program, RelowerError};

/// The outcome of [`relower`].
#[derive(Clone, Debug)]
pub struct Relowered {
    /// The program to use: re-derived, or the input when it was already as fast.
    pub program: Program,
    /// Its simulation under the options given.
    pub report: SimReport,
    /// The input's makespan under the same options, `None` when it is not a valid
    /// program (see [`Relowered::input_problem`]).
    pub before: Option<f64>,
    /// Why the input could not be run as it is (broken rules, a deadlock), if so.
    pub input_problem: Option<String>,
    /// Whether [`Relowered::program`] is the input itself.
    pub kept_input: bool,
}

/// Derive `program`'s communication again for `opts` (see the module documentation).
/// `limit`: the memory limit (activations plus resident parameters per rank), if known.
pub fn relower(
    program: &Program,
    opts: &SimOptions,
    limit: Option<f64>,
) -> Result<Relowered, RelowerError> {
    relower_ordered(program, opts, limit, 0)
}

/// [`relower`], letting the compute order change too: up to `order` simulations of
/// [`crate::search::reorder`]'s search (none when 0). Each rank still runs the same compute
/// tasks; the order found is kept only when its derivation beats the input order's.
pub fn relower_ordered(
    program: &Program,
    opts: &SimOptions,
    limit: Option<f64>,
    order: usize,
) -> Result<Relowered, RelowerError> {
    let plan = plan_of_program(program)?;
    let expr = program.source.as_ref().map(|s| s.expr.clone());
    // Rule 5 asks for termination under rendezvous, whatever `opts` times.
    let rendezvous = SimOptions {
        mode: Mode::Rendezvous,
        comm: opts.comm,
    };
    let terminates =
        |p: &Program| opts.mode == Mode::Rendezvous || simulate(p, &rendezvous).is_ok();
    // The input as it is: valid (rules 1-4), and running to the end (rule 5).
    let input = match verify_static(program).first() {
        Some(v) => Err(format!("it breaks the validity rules ({v})")),
        None => match simulate(program, opts) {
            Ok(r) if terminates(program) => Ok(r),
            Ok(_) => Err("it does not run to completion under rendezvous semantics".to_string()),
            Err(e) => {
                let e = e.to_string();
                let first = e.lines().next().unwrap_or_default().trim_end_matches(':');
                Err(format!("it does not run to completion: {first}"))
            }
        },
    };
    let cap = limit.or_else(|| {
        input
            .as_ref()
            .ok()
            .map(|r| peak_memory_with_params(program, r))
    });
    // A program from elsewhere has no request: the default tuning.
    let policy = &crate::ir::policy::SearchPolicy::DEFAULT;
    let (mut derived, mut report) =
        best_lowering_with(&plan, expr.as_deref(), opts, cap, true, policy).map_err(|m| {
            match crate::algebra::lower::prepare(&plan) {
                Err(LowerError::Plan(p)) => RelowerError::Order(p),
                _ => RelowerError::Internal(m),
            }
        })?;
    if order > 0 {
        // Without a limit or a valid input, the order search keeps to the memory of
        // the input order's derivation.
        let within = cap.unwrap_or_else(|| peak_memory_with_params(&derived, &report));
        let fits = |p: &Program, r: &SimReport| at_most(peak_memory_with_params(p, r), within);
        let mut best = (derived, report);
        let search = crate::search::reorder::Search {
            text: expr.as_deref(),
            opts,
            fits: &fits,
            moves: crate::search::reorder::Moves::WithinRanks,
            policy,
            trials: None,
        };
        crate::search::reorder::reorder_rounds(&plan, &search, order, &mut best, &|o, best| {
            best_lowering_with(o, expr.as_deref(), opts, cap, true, policy)
                .ok()
                .filter(|(p, r)| span(r).beats(&span(best)) && fits(p, r) && terminates(p))
        });
        (derived, report) = best;
    }
    let violations = verify_static(&derived);
    if let Some(v) = violations.first() {
        return Err(RelowerError::Invalid(format!(
            "{v}{}",
            match violations.len() {
                1 => String::new(),
                n => format!(" (and {} more)", n - 1),
            }
        )));
    }
    if !terminates(&derived) {
        return Err(RelowerError::Internal(
            "the re-derived program deadlocks under rendezvous".to_string(),
        ));
    }
    let over = cap.is_some_and(|c| !at_most(peak_memory_with_params(&derived, &report), c));
    match input {
        Ok(r) if at_most(r.makespan, report.makespan) || over => Ok(Relowered {
            program: program.clone(),
            before: Some(r.makespan),
            report: r,
            input_problem: None,
            kept_input: true,
        }),
        _ if over => Err(RelowerError::Memory {
            peak: peak_memory_with_params(&derived, &report),
            limit: cap.unwrap_or(f64::INFINITY),
        }),
        input => Ok(Relowered {
            program: derived,
            report,
            before: input.as_ref().ok().map(|r| r.makespan),
            input_problem: input.err(),
            kept_input: false,
        }),
    }
}
