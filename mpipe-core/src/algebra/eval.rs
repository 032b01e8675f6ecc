//! The algebra's evaluation: an expression to its compute-only [`Plan`].
//!
//! `eval` maps each sub-expression to a plan: a body name runs its generator, an
//! operator evaluates its body argument and maps the plan. Every name of the
//! language is one row of [`TABLE`]: its [`Signature`] (arguments with their types
//! and defaults, checked by [`Signature::check`], which words every argument error)
//! and its evaluation. Errors carry the span of
//! the sub-expression at fault, and evaluation goes on past an error where it can, so
//! a user sees every mistake at once.
//!
//! It knows nothing of lowering choices, simulation or the search: `auto` and
//! `refine(...)` are resolved above it (`derive`), which calls down into [`plan_of`].

use crate::algebra::analysis::PlanError;
use crate::algebra::expr::Expr;
use crate::algebra::expr::Span;
use crate::algebra::generators::{generate_by, BodyKind, GenError, Weave};
use crate::algebra::operators::chain::{chain, ChainError};
use crate::algebra::operators::fill::{fill_with, FillCap, FillTies, Pieces};
use crate::algebra::operators::host::{host, Host};
use crate::algebra::operators::layers::layers;
use crate::algebra::operators::prefetch::prefetch;
use crate::algebra::operators::split_w::split_w;
use crate::algebra::operators::transpose::{
    transpose_recorded, Backward, Owners, Place, PlaceRecord,
};
use crate::algebra::profile::{Profile, Split};
use crate::algebra::signature::{Checked, Context, Param, Shape, Signature, Type};
use crate::ir::model::{Mode, SimOptions};
use crate::ir::plan::{Plan, UnitId};
use crate::ir::policy::SearchPolicy;
use crate::ir::text::did_you_mean;

/// One derivation error: what is wrong, where, and how to fix it.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct DeriveError {
    pub message: String,
    /// The sub-expression at fault, in the text the expression was read from
    /// ([`Span::NONE`] when the whole request is at fault).
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
    /// A rank's peak memory exceeds `memory.limit`.
    Memory,
    /// The derived program breaks a validity rule (a bug in mpipe: please report).
    Invalid,
}

pub(crate) fn err(kind: ErrorKind, span: Span, message: impl Into<String>) -> DeriveError {
    DeriveError {
        message: message.into(),
        span,
        kind,
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
    /// A cap on the work of `fill` (and `host`) placements: `auto` sets one for
    /// each candidate it plans ([`FillCap`]); `None` (the default) never cuts a
    /// placement short.
    pub fill_cap: Option<&'a FillCap>,
    /// Where a `fill` that chooses its pieces records that the ideal timing could
    /// not tell them apart ([`FillTies`]): the derivation sets one (or uses the
    /// caller's, who can then read it), to derive both placements then; `None` (the
    /// default) records nothing here.
    pub fill_ties: Option<&'a FillTies>,
    /// Where a `transpose` choosing its placement records what it learnt of the
    /// placements it compared ([`PlaceRecord`]): the derivation sets one, to skip
    /// evaluating again an alternative placement it can judge from the record;
    /// `None` (the default) records nothing.
    pub place_record: Option<&'a PlaceRecord>,
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
            fill_cap: None,
            fill_ties: None,
            place_record: None,
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

/// Evaluate `expr` to its plan (every error found, with its span).
pub(crate) fn plan_of(req: &Request, expr: &Expr) -> Result<Plan, Vec<DeriveError>> {
    let mut errors = Vec::new();
    match eval(req, expr, &mut errors) {
        Some(plan) if errors.is_empty() => Ok(plan),
        _ => Err(errors),
    }
}

pub(crate) fn eval(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let key = MEMO.with(|m| m.borrow().is_some()).then(|| {
        let split = req.profile.llm.split == Split::Balanced;
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
    /// Tasks kept, in all ([`SearchPolicy::plan_memo_tasks`]).
    most_tasks: usize,
    /// Tasks of the plans kept.
    tasks: usize,
    entries: std::collections::VecDeque<((bool, String), Plan)>,
}

/// The tasks of `plan`, on every rank.
fn tasks_in(plan: &Plan) -> usize {
    plan.order.iter().map(Vec::len).sum()
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
        let tasks = tasks_in(&plan);
        if tasks > self.most_tasks {
            return;
        }
        while self.entries.len() >= self.capacity.max(1) || self.tasks + tasks > self.most_tasks {
            let Some((_, old)) = self.entries.pop_front() else {
                break;
            };
            self.tasks -= tasks_in(&old);
        }
        self.tasks += tasks;
        self.entries.push_back((key, plan));
    }
}

/// Runs `f` with the plans of sub-expressions remembered on this thread for one
/// request (the search evaluates thousands of candidates that share inner
/// expressions), at most `capacity` of them holding at most `most_tasks` tasks in
/// all. Results are the same with or without it.
pub(crate) fn with_plan_memo<T>(capacity: usize, most_tasks: usize, f: impl FnOnce() -> T) -> T {
    let before = MEMO.with(|m| {
        m.replace(Some(PlanMemo {
            capacity,
            most_tasks,
            tasks: 0,
            entries: Default::default(),
        }))
    });
    let out = f();
    MEMO.with(|m| *m.borrow_mut() = before);
    out
}

/// One name of the language: what it takes and how it evaluates. Adding an operator
/// is its plan map (a file under `operators/`) and one row here.
pub(crate) struct Row {
    pub sig: Signature,
    eval: Eval,
}

/// A row's evaluation, given its arguments checked ([`Checked::ok`] holds).
type Eval = fn(&Request, &Expr, &Checked, &mut Vec<DeriveError>) -> Option<Plan>;

/// `list = fixed | search` of `zbv` and `zbh1`.
const LIST: Param = Param {
    key: "list",
    ty: Type::Choice(&["fixed", "search"]),
    doc: "the fixed order of the layout, or one searched by the profile's costs",
};

/// The most simulations `refine(X, order = N)` may spend searching the compute order.
pub const MAX_ORDER: u64 = 100_000;

/// Every name of the expression language, bodies first, with its signature and its
/// evaluation.
pub(crate) static TABLE: [Row; 17] = [
    Row {
        sig: Signature {
            name: "gpipe",
            shape: Shape::Body,
            params: &[],
            example: "gpipe",
            doc: "every forward, then every backward",
        },
        eval: |req, e, _, errors| generated(req, e, BodyKind::GPipe, errors),
    },
    Row {
        sig: Signature {
            name: "1f1b",
            shape: Shape::Body,
            params: &[],
            example: "1f1b",
            doc: "one forward, one backward, after a warm-up",
        },
        eval: |req, e, _, errors| generated(req, e, BodyKind::OneFOneB, errors),
    },
    Row {
        sig: Signature {
            name: "interleaved",
            shape: Shape::Body,
            params: &[Param {
                key: "v",
                ty: Type::Int {
                    min: 2,
                    max: u64::MAX,
                },
                doc: "the number of chunks per rank (v = 1 is `1f1b`)",
            }],
            example: "interleaved(v = 2)",
            doc: "1F1B over v looped chunks per rank",
        },
        eval: |req, e, c, errors| {
            let v = c.int("v").map_or(2, |(v, _)| v as usize);
            generated(req, e, BodyKind::Interleaved { v }, errors)
        },
    },
    Row {
        sig: Signature {
            name: "zbh1",
            shape: Shape::Body,
            params: &[LIST],
            example: "zbh1",
            doc: "zero bubble, 1F1B's memory (B and W apart)",
        },
        eval: |req, e, c, errors| {
            let kind = match c.choice("list") {
                1 => BodyKind::ZbList { vshape: false },
                _ => BodyKind::ZbH1,
            };
            generated(req, e, kind, errors)
        },
    },
    Row {
        sig: Signature {
            name: "zbv",
            shape: Shape::Body,
            params: &[LIST],
            example: "zbv",
            doc: "zero bubble over two chunks per rank in a V",
        },
        eval: |req, e, c, errors| {
            let kind = match c.choice("list") {
                1 => BodyKind::ZbList { vshape: true },
                _ => BodyKind::ZbV,
            };
            generated(req, e, kind, errors)
        },
    },
    Row {
        sig: Signature {
            name: "dualpipev",
            shape: Shape::Body,
            params: &[],
            example: "dualpipev",
            doc: "DualPipe's V: two chunks per rank, forward and backward overlapped",
        },
        eval: |req, e, _, errors| generated(req, e, BodyKind::DualPipeV, errors),
    },
    Row {
        sig: Signature {
            name: "zb2p",
            shape: Shape::Body,
            params: &[
                Param {
                    key: "v",
                    ty: Type::Int {
                        min: 1,
                        max: u64::MAX,
                    },
                    doc: "the number of chunks per rank",
                },
                Param {
                    key: "layout",
                    ty: Type::Choice(&["looped", "v"]),
                    doc: "how the chunks go round the ranks",
                },
                Param {
                    key: "costs",
                    ty: Type::Choice(&["profile", "unit"]),
                    doc: "the costs the list scheduler weighs",
                },
                Param {
                    key: "encoders",
                    ty: Type::Choice(&Weave::NAMES),
                    doc: "where the encoders run",
                },
            ],
            example: "zb2p(encoders = ramp)",
            doc: "a zero-bubble list schedule by the profile's costs",
        },
        eval: |req, e, c, errors| {
            let vshape = c.choice("layout") == 1;
            let v = match (c.int("v"), vshape) {
                (None, false) => 1,
                (None, true) | (Some((2, _)), true) => 2,
                (Some((n, _)), false) => n as usize,
                (Some((n, span)), true) => {
                    errors.push(err(
                        ErrorKind::BadArgument,
                        span,
                        format!("`layout = v` has 2 chunks per rank; drop `v = {n}`"),
                    ));
                    return None;
                }
            };
            let kind = BodyKind::Zb2p {
                v,
                vshape,
                lockstep: c.choice("costs") == 1,
                encoders: Weave::ALL[c.choice("encoders")],
            };
            generated(req, e, kind, errors)
        },
    },
    Row {
        sig: Signature {
            name: "transpose",
            shape: Shape::EncoderOver,
            params: &[
                Param {
                    key: "owners",
                    ty: Type::Choice(&["round_robin", "min", "spare"]),
                    doc: "which ranks run the encoder's micro-batches",
                },
                Param {
                    key: "backward",
                    ty: Type::Choice(&["local", "central"]),
                    doc: "where a trainable encoder's backward runs",
                },
                Param {
                    key: "place",
                    ty: Type::Choice(&["best", "late", "prefix", "idle"]),
                    doc: "when each owner runs its encoder forwards",
                },
            ],
            example: "transpose(vision, 1f1b)",
            doc: "the encoder's micro-batches spread over the ranks' idle warm-up",
        },
        eval: |req, e, c, errors| {
            let owners = [Owners::RoundRobin, Owners::Min, Owners::Spare][c.choice("owners")];
            let backward = [Backward::Local, Backward::Central][c.choice("backward")];
            let place = [Place::Best, Place::Late, Place::Prefix, Place::Idle][c.choice("place")];
            let (id, plan) = encoder_and_plan(req, c, errors)?;
            let record = req.place_record;
            applied(
                e,
                transpose_recorded(plan, id, owners, backward, place, record),
                errors,
            )
        },
    },
    Row {
        sig: Signature {
            name: "fill",
            shape: Shape::EncoderOver,
            params: &[Param {
                key: "pieces",
                ty: Type::Choice(&["best", "whole", "layers"]),
                doc: "the encoder placed whole or layer by layer",
            }],
            example: "fill(vision, zbv)",
            doc: "the encoder's work put into the body's idle time",
        },
        eval: |req, e, c, errors| {
            let pieces = [Pieces::Best, Pieces::Whole, Pieces::Layers][c.choice("pieces")];
            let (id, plan) = encoder_and_plan(req, c, errors)?;
            applied(
                e,
                fill_with(
                    plan,
                    id,
                    link(req),
                    req.profile,
                    pieces,
                    req.fill_cap,
                    req.fill_ties,
                ),
                errors,
            )
        },
    },
    Row {
        sig: Signature {
            name: "chain",
            shape: Shape::EncoderOver,
            params: &[],
            example: "chain(vision, zb2p(costs = unit))",
            doc: "the encoder cut into per-rank layer chunks in the body's idle time",
        },
        eval: |req, e, c, errors| {
            let (id, plan) = encoder_and_plan(req, c, errors)?;
            let enc = c.encoder?;
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
        },
    },
    Row {
        sig: Signature {
            name: "host",
            shape: Shape::EncoderOver,
            params: &[Param {
                key: "rank",
                ty: Type::RankOr("spare"),
                doc: "a rank number",
            }],
            example: "host(audio, zbv, rank = 2)",
            doc: "the encoder run on one rank (the least busy: `spare`)",
        },
        eval: |req, e, c, errors| {
            let to = c
                .int("rank")
                .map_or(Host::Spare, |(n, _)| Host::Rank(n as usize));
            let (id, plan) = encoder_and_plan(req, c, errors)?;
            applied(e, host(plan, id, to, link(req), req.fill_cap), errors)
        },
    },
    Row {
        sig: Signature {
            name: "split_w",
            shape: Shape::Over,
            params: &[],
            example: "split_w(1f1b)",
            doc: "every fused backward split into B and W, W deferred into idle time",
        },
        eval: |req, e, c, errors| {
            let plan = eval(req, c.body?, errors)?;
            applied(e, split_w(plan), errors)
        },
    },
    Row {
        sig: Signature {
            name: "balance",
            shape: Shape::Over,
            params: &[],
            example: "balance(zbv)",
            doc: "the LLM's layers split so that every stage's work is even",
        },
        eval: |req, e, c, errors| {
            if req.profile.llm.layout.is_some() {
                errors.push(err(
                    ErrorKind::BadArgument,
                    e.head.span,
                    "`balance` chooses the stage split, but the profile fixes it with \
                     `llm.layout`; drop one of the two",
                ));
                return None;
            }
            let mut profile = req.profile.clone();
            profile.llm.split = Split::Balanced;
            let inner = Request {
                profile: &profile,
                ..*req
            };
            eval(&inner, c.body?, errors)
        },
    },
    Row {
        sig: Signature {
            name: "prefetch",
            shape: Shape::EncoderOver,
            params: &[],
            example: "prefetch(vision, zbv)",
            doc: "a frozen encoder's forwards run a step ahead",
        },
        eval: |req, e, c, errors| {
            let (id, plan) = encoder_and_plan(req, c, errors)?;
            let enc = c.encoder?;
            if plan.needs_backward()[id] {
                errors.push(err(
                    ErrorKind::BadArgument,
                    enc.span,
                    format!(
                        "`prefetch` needs a frozen encoder, and `{}` is trainable: its forward \
                         for the next step would read parameters this step updates; use `fill` \
                         or `transpose`",
                        enc.name()
                    ),
                ));
                return None;
            }
            applied(e, prefetch(plan, id, req.profile), errors)
        },
    },
    Row {
        sig: Signature {
            name: "layers",
            shape: Shape::Over,
            params: &[],
            example: "layers(zbh1)",
            doc: "every unit computed layer by layer (outermost, or under `refine`)",
        },
        eval: |req, _, c, errors| {
            let plan = eval(req, c.body?, errors)?;
            Some(layers(plan, req.profile))
        },
    },
    Row {
        sig: Signature {
            name: "refine",
            shape: Shape::Whole,
            params: &[Param {
                key: "order",
                ty: Type::Int {
                    min: 1,
                    max: MAX_ORDER,
                },
                doc: "how many simulations `refine` may spend moving compute tasks into waits",
            }],
            example: "refine(zbh1, order = 500)",
            doc: "transfers (and, with `order`, compute) moved to where the ranks wait",
        },
        eval: whole,
    },
    Row {
        sig: Signature {
            name: "auto",
            shape: Shape::Whole,
            params: &[],
            example: "auto",
            doc: "the fastest expression found by search",
        },
        eval: whole,
    },
];

/// The row of `name`, if the language has it.
pub(crate) fn row(name: &str) -> Option<&'static Row> {
    TABLE.iter().find(|r| r.sig.name == name)
}

/// The signature of `name`, if the language has it.
pub fn signature(name: &str) -> Option<&'static Signature> {
    row(name).map(|r| &r.sig)
}

/// Names of the body generators, as the expression language spells them.
pub fn body_names() -> impl Iterator<Item = &'static str> {
    TABLE
        .iter()
        .filter(|r| r.sig.shape == Shape::Body)
        .map(|r| r.sig.name)
}

/// Names of the operators (and of `auto` and `refine`), as the language spells them.
pub fn operator_names() -> impl Iterator<Item = &'static str> {
    TABLE
        .iter()
        .filter(|r| r.sig.shape != Shape::Body)
        .map(|r| r.sig.name)
}

/// `auto` or `refine` inside another name: they stand for whole schedules.
fn whole(_: &Request, e: &Expr, _: &Checked, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let name = e.name();
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

/// `e` checked against its row's signature (every mistake pushed to `errors` as a
/// [`ErrorKind::BadArgument`]).
pub(crate) fn checked<'e>(
    req: &Request,
    row: &'static Row,
    e: &'e Expr,
    errors: &mut Vec<DeriveError>,
) -> Checked<'e> {
    let mut found = Vec::new();
    let ctx = Context { ranks: req.ranks };
    let c = row.sig.check(e, ctx, &mut found);
    errors.extend(
        found
            .into_iter()
            .map(|(span, message)| err(ErrorKind::BadArgument, span, message)),
    );
    c
}

fn eval_uncached(req: &Request, e: &Expr, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    let name = e.name();
    let Some(row) = row(name) else {
        let all: Vec<&str> = body_names().chain(operator_names()).collect();
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
        return None;
    };
    if row.sig.shape == Shape::Whole {
        return whole(req, e, &checked(req, row, e, &mut Vec::new()), errors);
    }
    let c = checked(req, row, e, errors);
    // Where the arguments are wrong, what can be evaluated still is, so that every
    // mistake shows at once.
    let body_ok = c.body.is_none_or(|b| outermost_layers(e, b, errors));
    let encoder_ok = body_ok && c.encoder.is_none_or(|enc| check_encoder(req, enc, errors));
    if !(c.ok() && body_ok && encoder_ok) {
        // (A body generator's stray arguments are not schedules of their own.)
        let stray = if row.sig.shape == Shape::Body {
            &[][..]
        } else {
            &c.stray[..]
        };
        for x in stray.iter().chain(c.body.filter(|_| body_ok).as_ref()) {
            eval(req, x, errors);
        }
        return None;
    }
    (row.eval)(req, e, &c, errors)
}

/// The plan body generator `kind` makes for `req`, or its error at `e`.
fn generated(
    req: &Request,
    e: &Expr,
    kind: BodyKind,
    errors: &mut Vec<DeriveError>,
) -> Option<Plan> {
    match generate_by(kind, req.profile, req.ranks, req.microbatches, &req.policy) {
        Ok(plan) => Some(plan),
        Err(g) => {
            let kind = match g {
                GenError::Microbatches { .. } | GenError::NoMicrobatches => ErrorKind::Microbatches,
                GenError::Chunks(_) | GenError::Ramp(_) | GenError::Chains(_) => {
                    ErrorKind::BadArgument
                }
                GenError::Units(_) => ErrorKind::Profile,
            };
            errors.push(err(kind, e.span, format!("`{e}`: {g}")));
            None
        }
    }
}

/// The one body of a [`Shape::Whole`] or [`Shape::Over`] name `e` (its arguments
/// checked against its signature, every mistake reported; the arguments are still
/// evaluated, so their mistakes show too), or `None`.
pub(crate) fn one_body<'e>(
    req: &Request,
    e: &'e Expr,
    errors: &mut Vec<DeriveError>,
) -> (Option<Checked<'e>>, Option<&'e Expr>) {
    let Some(row) = row(e.name()) else {
        return (None, None);
    };
    let c = checked(req, row, e, errors);
    if c.body.is_none() {
        for x in &c.stray {
            eval(req, x, errors);
        }
        return (Some(c), None);
    }
    let body = c.body.filter(|b| outermost_layers(e, b, errors));
    (Some(c), body)
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

/// The plan operator `e` produced, or its failure reported at `e` (a bug in mpipe:
/// operators keep plans valid).
fn applied(e: &Expr, r: Result<Plan, PlanError>, errors: &mut Vec<DeriveError>) -> Option<Plan> {
    r.map_err(|x| errors.push(err(ErrorKind::Invalid, e.span, format!("`{e}`: {x}"))))
        .ok()
}

/// An encoder operator's encoder unit and its evaluated body (the arguments checked
/// already), or `None` once every mistake is reported.
fn encoder_and_plan(
    req: &Request,
    c: &Checked,
    errors: &mut Vec<DeriveError>,
) -> Option<(UnitId, Plan)> {
    let (enc, body) = (c.encoder?, c.body?);
    let plan = eval(req, body, errors)?;
    if plan.unit_id(enc.name()).is_none() {
        // `fill` or `prefetch` in the body cut it into layers: join them again.
        if let Some((joined, id)) =
            crate::algebra::operators::layers::join_encoder(&plan, enc.name())
        {
            return Some((id, joined));
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
                c.sig.name
            ),
        ));
        return None;
    };
    Some((id, plan))
}

/// The profile's link as operators take it: `(latency, bandwidth)`.
fn link(req: &Request) -> crate::algebra::operators::fill::Link {
    req.profile.link.as_ref().map(|l| (l.latency, l.bandwidth))
}
