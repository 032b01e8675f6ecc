//! The algebra's evaluation: an expression to its compute-only [`Plan`].
//!
//! `eval` maps each sub-expression to a plan: a body name runs its generator, an
//! operator evaluates its body argument and maps the plan. Errors carry the span of
//! the sub-expression at fault, and evaluation goes on past an error where it can, so
//! a user sees every mistake at once.
//!
//! It knows nothing of lowering choices, simulation or the search: `auto` and
//! `refine(...)` are resolved above it (`derive`), which calls down into [`plan_of`].

use crate::algebra::analysis::PlanError;
use crate::algebra::expr::Span;
use crate::algebra::expr::{Arg, Expr, Value};
use crate::algebra::generators::{generate_by, BodyKind, GenError, Weave, BODY_NAMES};
use crate::algebra::operators::chain::{chain, ChainError};
use crate::algebra::operators::fill::{fill, FillCap};
use crate::algebra::operators::host::{host, Host};
use crate::algebra::operators::layers::layers;
use crate::algebra::operators::prefetch::prefetch;
use crate::algebra::operators::split_w::split_w;
use crate::algebra::operators::transpose::{transpose_with, Backward, Owners, Place};
use crate::algebra::profile::{Profile, Split};
use crate::ir::model::{Mode, SimOptions};
use crate::ir::plan::{Plan, UnitId};
use crate::ir::policy::SearchPolicy;
use crate::ir::text::did_you_mean;

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
        "zbv" | "zbh1" => &["list"],
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
                    match keys {
                        [] => "s",
                        ["list"] => "; it takes `list = fixed | search`",
                        _ => "; it takes `v = N`",
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
        (BodyKind::ZbV | BodyKind::ZbH1, _) => {
            let vshape = kind == BodyKind::ZbV;
            match one_of(e, "list", &["fixed", "search"], errors)? {
                1 => BodyKind::ZbList { vshape },
                _ => kind,
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
pub(crate) fn one_body<'e>(
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
    let mut place = Place::default();
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
            "place" => choice(&["best", "late", "prefix", "idle"]).map(|i| {
                place = [Place::Best, Place::Late, Place::Prefix, Place::Idle][i];
            }),
            other => Err(err(
                ErrorKind::BadArgument,
                key.span,
                format!(
                    "unknown argument `{other}` of `transpose`; expected one of: owners, backward, place"
                ),
            )),
        };
        if let Err(x) = r {
            errors.push(x);
            ok = false;
        }
    }
    let (_, id, plan) = encoder_and_plan(req, e, "transpose(vision, 1f1b)", ok, errors)?;
    applied(e, transpose_with(plan, id, owners, backward, place), errors)
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
/// as even as possible (see [`crate::algebra::units`]) instead of evenly per stage.
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
    profile.llm.split = Split::Balanced;
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
    applied(
        e,
        fill(plan, id, link(req), req.profile, req.fill_cap),
        errors,
    )
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
    applied(e, host(plan, id, to, link(req), req.fill_cap), errors)
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
        if let Some((joined, id)) =
            crate::algebra::operators::layers::join_encoder(&plan, enc.name())
        {
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
fn link(req: &Request) -> crate::algebra::operators::fill::Link {
    req.profile.link.as_ref().map(|l| (l.latency, l.bandwidth))
}
