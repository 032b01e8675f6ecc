//! `auto`: the fastest expression of the algebra for a profile, found by search.
//!
//! The search space ([`candidates`]) is every body generator (`1f1b`, `gpipe`, `zbh1`,
//! `zbv`, `dualpipev`, `interleaved(v = 2..4)` and `v = 5..8` where the chunks split
//! the layers evenly, `zb2p` with one chunk (also in lockstep, `costs = unit`), two
//! looped and two in a V, and `zb2p(encoders = spread | chain | ramp)`, which place
//! the encoders themselves, in seven forms, `ramp` never under `balance` as it
//! chooses the split itself), the
//! fused-backward bodies also under `split_w`, and for each encoder of the profile every placement the operators offer:
//! inline (the body's own), `transpose` with each owner mode (`spare` too) and, for a trainable
//! encoder, each backward mode (modes that cannot differ, such as owners when
//! micro-batches <= ranks, are enumerated once), `fill`, and for a frozen encoder
//! `prefetch`; every candidate also
//! under `balance` (unless the profile fixes the split with `llm.layout`). Every peer schedule the evaluation
//! compares against is in it, so `auto` is never slower than any of them.
//!
//! The search is exact over that space and cheap: each candidate's plan is evaluated
//! and timed ideally (no communication, asynchronous transfers), which no program of
//! the plan can beat; candidates are then derived in full (lowered, verified,
//! simulated, checked against the memory limit) in order of that ideal time, and the
//! search stops at the first candidate whose ideal time is no better than the best
//! simulated time found. Ties go to the lower peak memory, then to the earlier
//! candidate, so the answer is deterministic.

use crate::analysis::{dependencies, timing};
use crate::derive::{finish, plan_of, DeriveError, Derived, ErrorKind, Request};
use crate::expr::{parse_str, Expr};
use crate::operators::layers::layers;
use crate::plan::Plan;
use crate::profile::Profile;
use crate::progress::Stage;
use crate::simulate::Mode;
use std::cell::Cell;

/// Candidates whose transfers `auto` refines by simulation (the fastest before
/// refinement).
const FINALISTS: usize = 3;

/// Bodies whose backward is fused (`BW`), which `split_w` can split.
const FUSED: [&str; 5] = [
    "1f1b",
    "gpipe",
    "interleaved(v = 2)",
    "interleaved(v = 3)",
    "interleaved(v = 4)",
];
/// Chunks per rank `auto` goes up to beyond `interleaved(v = 4)`, where they divide
/// the layers evenly.
const MAX_CHUNKS: usize = 8;

/// Bodies that already split `B` from `W`.
const SPLIT: [&str; 7] = [
    "zbh1",
    "zbv",
    "dualpipev",
    "zb2p",
    "zb2p(costs = unit)",
    "zb2p(v = 2)",
    "zb2p(layout = v)",
];

/// Bodies that place the encoders themselves (on every rank), tried with no
/// operator moving an encoder.
const WOVEN: [&str; 5] = [
    "zb2p(encoders = spread)",
    "zb2p(encoders = spread, costs = unit)",
    "zb2p(encoders = spread, layout = v)",
    "zb2p(encoders = chain)",
    "zb2p(encoders = chain, costs = unit)",
];

/// Woven bodies that choose the stage split themselves: not under `balance`, and
/// not when the profile fixes the split.
const RAMP: [&str; 2] = [
    "zb2p(encoders = ramp)",
    "zb2p(encoders = ramp, costs = unit)",
];

/// Every expression `auto` considers for `profile` on `ranks` x `microbatches`, in the
/// order that breaks ties.
pub fn candidates(profile: &Profile, ranks: usize, microbatches: usize) -> Vec<String> {
    // More chunks where they split the layers exactly: finer tasks wait less for
    // their neighbours under rendezvous, and equal chunks keep the loop even.
    let layers = profile.llm.layers as usize;
    let fused: Vec<String> = FUSED
        .iter()
        .map(|b| b.to_string())
        .chain(
            (5..=MAX_CHUNKS)
                .filter(|v| ranks > 0 && layers.is_multiple_of(ranks * v))
                .map(|v| format!("interleaved(v = {v})")),
        )
        .collect();
    let mut bodies: Vec<(String, bool)> = Vec::new();
    for b in &fused {
        bodies.push((b.clone(), true));
    }
    for b in SPLIT {
        bodies.push((b.to_string(), false));
    }
    for b in &fused {
        bodies.push((format!("split_w({b})"), false));
    }
    // Per encoder: `None` inline, else the operator placing it and the arguments
    // after the body.
    let mut placements: Vec<Vec<Option<(&str, String)>>> = Vec::new();
    for enc in &profile.encoders {
        let mut opts = vec![
            None,
            Some(("transpose", String::new())),
            Some(("transpose", ", owners = spare".into())),
        ];
        if microbatches > ranks {
            opts.push(Some(("transpose", ", owners = min".into())));
        }
        if enc.trainable {
            let more: Vec<_> = opts
                .iter()
                .flatten()
                .map(|(op, o)| Some((*op, format!("{o}, backward = central"))))
                .collect();
            opts.extend(more);
        }
        opts.push(Some(("fill", String::new())));
        if !enc.trainable && !FOR_MACRO.with(Cell::get) {
            // A frozen encoder's forwards may also run a step ahead.
            opts.push(Some(("prefetch", String::new())));
        }
        placements.push(opts);
    }
    let mut combos: Vec<Vec<Option<(&str, String)>>> = vec![Vec::new()];
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
    // The operators apply innermost first, and the order matters (the outer one
    // places its encoder around the inner one's work): every order is a candidate.
    let orders = permutations(profile.encoders.len());
    let wrap = |body: &str, combo: &[Option<(&str, String)>], order: &[usize]| -> String {
        let mut e = body.to_string();
        for &i in order {
            let name = &profile.encoders[i].name;
            if let Some((op, args)) = &combo[i] {
                e = format!("{op}({name}, {e}{args})");
            }
        }
        e
    };
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for combo in &combos {
        let moved = combo.iter().filter(|o| o.is_some()).count();
        for order in &orders {
            // With fewer than two placed encoders the order changes nothing.
            if moved < 2 && order != &orders[0] {
                continue;
            }
            for (body, fused) in &bodies {
                let e = wrap(body, combo, order);
                // split_w outside the encoders' placement too: it then also splits
                // a trainable encoder's backward.
                let outer = (*fused && moved > 0).then(|| format!("split_w({e})"));
                for x in std::iter::once(e).chain(outer) {
                    // And each with the stages' work balanced, unless the
                    // profile fixes the split.
                    let balanced = profile
                        .llm
                        .layout
                        .is_none()
                        .then(|| format!("balance({x})"));
                    for y in std::iter::once(x).chain(balanced) {
                        if seen.insert(y.clone()) {
                            out.push(y);
                        }
                    }
                }
            }
        }
    }
    if !profile.encoders.is_empty() {
        for body in WOVEN {
            let balanced = profile
                .llm
                .layout
                .is_none()
                .then(|| format!("balance({body})"));
            for y in std::iter::once(body.to_string()).chain(balanced) {
                if seen.insert(y.clone()) {
                    out.push(y);
                }
            }
        }
        if profile.llm.layout.is_none() {
            out.extend(RAMP.iter().map(|b| b.to_string()));
        }
    }
    out
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

thread_local! {
    /// Set by [`for_macro`]: search on this thread only, without `prefetch`.
    static FOR_MACRO: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the search as `schedule!` needs it: on this thread only (inside a
/// procedural macro, `proc_macro2`, which the expression parser uses, works only on
/// the thread the compiler called the macro on), and among the schedules the macro
/// can emit (not `prefetch`, whose next-step forwards the runtime cannot run yet).
pub fn for_macro<T>(f: impl FnOnce() -> T) -> T {
    let before = FOR_MACRO.with(|s| s.replace(true));
    let out = f();
    FOR_MACRO.with(|s| s.set(before));
    out
}

/// Each candidate's canonical text (`None` if it does not parse) and, if its plan can
/// be built, the plan and its ideal time; on every core, in candidate order.
#[allow(clippy::type_complexity)]
fn plan_all(req: &Request, texts: &[String]) -> Vec<(Option<String>, Option<(f64, Plan)>)> {
    let stage = Stage::begin("auto: planning the candidates", texts.len());
    let one = |text: &String| {
        let _step = StepOnDrop(&stage);
        let Ok(expr) = parse_str(text) else {
            return (None, None);
        };
        let ideal = plan_of(req, &expr).ok().and_then(|plan| {
            let deps = dependencies(&plan).ok()?;
            let span = timing(&plan, &deps).ok()?.makespan();
            Some((span, plan))
        });
        (Some(expr.to_string()), ideal)
    };
    let threads = if FOR_MACRO.with(Cell::get) {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8)
            .min(texts.len().max(1))
    };
    if threads == 1 {
        return texts.iter().map(one).collect();
    }
    let mut slots: Vec<Option<(Option<String>, Option<(f64, Plan)>)>> =
        (0..texts.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (one, stage) = (&one, &stage);
                s.spawn(move || {
                    stage.within(|| {
                        (t..texts.len())
                            .step_by(threads)
                            .map(|i| (i, one(&texts[i])))
                            .collect::<Vec<_>>()
                    })
                })
            })
            .collect();
        for h in handles {
            // A panicking worker leaves its candidates out (they count as failed).
            for (i, r) in h.join().unwrap_or_default() {
                slots[i] = Some(r);
            }
        }
    });
    slots
        .into_iter()
        .map(|r| r.unwrap_or((None, None)))
        .collect()
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
}

/// Run the search for `req`. Fails only when no candidate can be derived (then the
/// errors of the fastest-looking candidate say why, e.g. memory over the limit).
pub fn search(req: &Request) -> Result<Search, Vec<DeriveError>> {
    let texts = candidates(req.profile, req.ranks, req.microbatches);
    let timed = plan_all(req, &texts);
    let mut tried: Vec<Tried> = Vec::new();
    let mut planned = Vec::new();
    for (i, (text, ideal)) in timed.into_iter().enumerate() {
        let Some(text) = text else {
            continue;
        };
        tried.push(Tried {
            expr: text,
            ideal: ideal.as_ref().map(|(s, _)| *s),
            makespan: None,
        });
        if let Some((span, plan)) = ideal {
            planned.push((span, i, tried.len() - 1, plan));
        }
    }
    // Why no candidate has a plan, from the first one (on this thread: errors carry
    // spans, which stay on the thread that made them).
    let plan_errors = || {
        texts
            .first()
            .and_then(|t| parse_str(t).ok())
            .and_then(|e| plan_of(req, &e).err())
    };
    planned.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut best: Option<(f64, f64, usize, Derived)> = None;
    let mut first_errors = None;
    let mut finalists = Vec::new();
    // Left early when no candidate left can win: the stage then ends short.
    let stage = Stage::begin("auto: deriving the fastest-looking", planned.len());
    for (ideal, order, slot, plan) in planned {
        let _step = StepOnDrop(&stage);
        if let Some((span, ..)) = &best {
            if ideal > *span * (1.0 + 1e-12) {
                break;
            }
        }
        let span = parse_str(&tried[slot].expr)
            .map_or_else(|_| proc_macro2::Span::call_site(), |e| e.span);
        match finish(req, &plan, &tried[slot].expr, span, false) {
            Ok(d) => {
                finalists.push((d.report.makespan, d.peak_with_params(), order, slot, plan));
                tried[slot].makespan = Some(d.report.makespan);
                keep_better(&mut best, d, order);
            }
            Err(es) => {
                first_errors.get_or_insert(es);
            }
        }
    }
    // Refine the transfers of the fastest few by simulation (never slower), and
    // keep the fastest refined program: `refine(EXPR)` names it.
    finalists.sort_by(|a, b| {
        a.0.total_cmp(&b.0)
            .then(a.1.total_cmp(&b.1))
            .then(a.2.cmp(&b.2))
    });
    let mut refined: Option<(f64, f64, usize, Derived)> = None;
    drop(stage);
    let span = proc_macro2::Span::call_site();
    let stage = Stage::begin(
        "auto: refining the finalists",
        finalists.len().min(FINALISTS),
    );
    for (_, _, order, slot, plan) in finalists.into_iter().take(FINALISTS) {
        let _step = StepOnDrop(&stage);
        let text = format!("refine({})", tried[slot].expr);
        if let Ok(d) = finish(req, &plan, &text, span, true) {
            keep_better(&mut refined, d, order);
        }
        // Under rendezvous, the same layer by layer (see `operators::layers`): its
        // ideal time is the plan's, but transfers find better meeting points.
        if req.mode == Mode::Rendezvous {
            let fine = layers(plan, req.profile);
            for refine in [false, true] {
                let inner = format!("layers({})", tried[slot].expr);
                let text = if refine {
                    format!("refine({inner})")
                } else {
                    inner
                };
                if let Ok(d) = finish(req, &fine, &text, span, refine) {
                    keep_better(&mut refined, d, order);
                }
            }
        }
    }
    // Only a strict gain is worth the longer name.
    let winner = match (refined, best) {
        (Some(r), Some(b)) if r.0 < b.0 => Some(r),
        (_, b) => b,
    };
    match winner {
        Some((.., d)) => Ok(Search { best: d, tried }),
        None => Err(first_errors.or_else(plan_errors).unwrap_or_default()),
    }
}

/// Keep `d` (the candidate at `order`) in `best` if it is faster, or as fast with
/// less peak memory, or as both with an earlier candidate.
fn keep_better(best: &mut Option<(f64, f64, usize, Derived)>, d: Derived, order: usize) {
    let key = (d.report.makespan, d.peak_with_params(), order);
    let better = best.as_ref().is_none_or(|(s, p, o, _)| {
        key.0
            .total_cmp(s)
            .then(key.1.total_cmp(p))
            .then(key.2.cmp(o))
            .is_lt()
    });
    if better {
        *best = Some((key.0, key.1, key.2, d));
    }
}

/// `auto` in an expression: the search's winner, with its expression in
/// [`Derived::expr`]. `expr` is the `auto` node (for error spans).
pub(crate) fn auto(req: &Request, expr: &Expr) -> Result<Derived, Vec<DeriveError>> {
    if !expr.args.is_empty() {
        return Err(vec![DeriveError {
            message: "`auto` takes no arguments; write `auto`".into(),
            span: expr.span,
            kind: ErrorKind::BadArgument,
        }]);
    }
    match search(req) {
        Ok(s) => Ok(s.best),
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
