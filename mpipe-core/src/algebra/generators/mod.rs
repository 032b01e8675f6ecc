//! Body generators: the classic pipeline schedules of the LLM, as plans.
//!
//! Each generator is a short function from a [`Ctx`] (ranks, micro-batches, the
//! stage units) to per-rank compute orders over the LLM stages; [`generate`] builds
//! the units from the profile, prepares the stages the body schedules
//! (`stage_set`: the LLM's, with a chained encoder's chunks in front for
//! `zb2p(encoders = chain | chains | ramp)`), runs the generator and places every
//! other encoder inline on the first stage's rank (forward just before the
//! micro-batch's first LLM forward, backward just after the first stage's
//! backward), the usual placement that operators such as `transpose` then change;
//! `zb2p(encoders = spread)` weaves them into its list schedule instead
//! (`weave`).

mod chain;
mod dualpipev;
mod gpipe;
mod interleaved;
mod onef1b;
mod stage_set;
mod weave;
mod zb2p;
mod zbh1;
mod zblist;
mod zbv;

pub use crate::algebra::ramp::{ramp_split, ramp_split_by, RampSplit};

use crate::algebra::analysis::peak_memory;
use crate::algebra::profile::Profile;
use crate::algebra::units::{build_units, UnitsError};
use crate::ir::compare::{at_most, less};
use crate::ir::plan::{Layout, Plan, Task, UnitId};
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{Op, Unit};
use stage_set::StageSet;

/// The body schedules mpipe can generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// All forwards, then all backwards (GPipe).
    GPipe,
    /// One-forward-one-backward (PipeDream-flush / Megatron 1F1B).
    OneFOneB,
    /// Megatron's interleaved 1F1B with `v` chunks per rank.
    Interleaved { v: usize },
    /// Zero Bubble's ZB-H1: 1F1B with `W` deferred into the cool-down.
    ZbH1,
    /// Zero Bubble's ZB-V: two chunks per rank in a V, `B`/`W` split.
    ZbV,
    /// DeepSeek's DualPipeV (DualPipe folded into a V).
    DualPipeV,
    /// `zbv(list = search)` (`vshape`) or `zbh1(list = search)`: ZB-V's or ZB-H1's
    /// shape, each `F`, `B` and `W` placed by a list scheduler on the profile's costs
    /// under a family of rules and budgets up to the memory limit, the fastest kept
    /// (the fixed `zbv` / `zbh1` order among them).
    ZbList { vshape: bool },
    /// Zero Bubble's ZB-2p: greedy list scheduling of split `B`/`W` under twice
    /// 1F1B's activation budget, `v` chunks per rank looped, or two in a V;
    /// `lockstep` schedules as if every task took the same time; `encoders` says
    /// where the encoders' work goes.
    Zb2p {
        v: usize,
        vshape: bool,
        lockstep: bool,
        encoders: Weave,
    },
}

/// Where `zb2p` puts the encoders that feed the first stage (`encoders = ..`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Weave {
    /// Inline on the first stage's rank, as every other body does.
    #[default]
    Inline,
    /// Whole micro-batches of encoder work woven into the schedule on every rank.
    Spread,
    /// The heaviest encoder cut into layer chunks, one per rank, that run as a
    /// pipeline of their own into the first stage (see [`crate::algebra::units::encoder_chunks`]).
    Chain,
    /// Chained as `Chain`, with the LLM's stage split and the chunk sizes chosen
    /// together so that the chunks' forwards fill each rank's warm-up ramp
    /// ([`crate::algebra::ramp::ramp_split`]); one stage per rank.
    Ramp,
    /// Every encoder chained along the same ranks: the heaviest (trainable) one as
    /// `Chain`, the others' chunks riding along with its chunk on each rank
    /// ([`chain::cut_all`]); for profiles whose encoders together outweigh what
    /// one rank can take inline.
    Chains,
}

impl Weave {
    /// The value's spelling in `encoders = ..`.
    pub const NAMES: [&'static str; 5] = ["inline", "spread", "chain", "ramp", "chains"];
    /// The values, in the order of [`Weave::NAMES`].
    pub const ALL: [Weave; 5] = [
        Weave::Inline,
        Weave::Spread,
        Weave::Chain,
        Weave::Ramp,
        Weave::Chains,
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl BodyKind {
    pub fn layout(self) -> Layout {
        match self {
            BodyKind::ZbV
            | BodyKind::DualPipeV
            | BodyKind::Zb2p { vshape: true, .. }
            | BodyKind::ZbList { vshape: true } => Layout::VShape,
            _ => Layout::Looped,
        }
    }

    /// Stages (chunks) per rank.
    pub fn chunks(self) -> usize {
        match self {
            BodyKind::Interleaved { v } | BodyKind::Zb2p { v, .. } => v,
            BodyKind::ZbV | BodyKind::DualPipeV | BodyKind::ZbList { vshape: true } => 2,
            _ => 1,
        }
    }

    /// Canonical expression text.
    pub fn expr(self) -> String {
        match self {
            BodyKind::GPipe => "gpipe".into(),
            BodyKind::OneFOneB => "1f1b".into(),
            BodyKind::Interleaved { v } => format!("interleaved(v = {v})"),
            BodyKind::ZbH1 => "zbh1".into(),
            BodyKind::ZbV => "zbv".into(),
            BodyKind::DualPipeV => "dualpipev".into(),
            BodyKind::ZbList { vshape: true } => "zbv(list = search)".into(),
            BodyKind::ZbList { vshape: false } => "zbh1(list = search)".into(),
            BodyKind::Zb2p {
                v,
                vshape,
                lockstep,
                encoders,
            } => {
                let mut args = Vec::new();
                if vshape {
                    args.push("layout = v".to_string());
                } else if v != 1 {
                    args.push(format!("v = {v}"));
                }
                if lockstep {
                    args.push("costs = unit".into());
                }
                if encoders != Weave::Inline {
                    args.push(format!("encoders = {}", encoders.name()));
                }
                if args.is_empty() {
                    "zb2p".into()
                } else {
                    format!("zb2p({})", args.join(", "))
                }
            }
        }
    }
}

/// Why a body cannot be generated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Units(#[from] UnitsError),
    #[error("{body} needs {need}; got {microbatches} micro-batches on {ranks} ranks")]
    Microbatches {
        body: String,
        need: String,
        microbatches: usize,
        ranks: usize,
    },
    #[error("interleaved needs v >= 2 chunks per rank (v = 1 is `1f1b`), got v = {0}")]
    Chunks(usize),
    #[error("at least one micro-batch is needed")]
    NoMicrobatches,
    #[error(
        "`zb2p(encoders = ramp)` chooses the stage split itself, with one or two looped stages per rank: {0}"
    )]
    Ramp(&'static str),
    #[error("`zb2p(encoders = chains)` chains every encoder along the ranks: {0}")]
    Chains(&'static str),
}

/// What a generator sees.
pub struct Ctx<'a> {
    pub ranks: usize,
    pub microbatches: usize,
    /// Stage `k`'s unit id, in pipeline order.
    pub stages: &'a [UnitId],
    pub units: &'a [Unit],
    /// The profile's `memory.limit` (activations plus resident parameters), if any.
    pub memory_limit: Option<f64>,
    /// `(rider, carrier)` chunks of `encoders = chains`: the rider's tasks follow
    /// the carrier stage's, so a body counts their costs and memory with it.
    pub riders: &'a [(UnitId, UnitId)],
}

impl Ctx<'_> {
    /// Task `op` of stage `k` on micro-batch `mb`.
    pub fn task(&self, op: Op, k: usize, mb: usize) -> Task {
        Task::new(op, self.stages[k], mb)
    }
}

/// Generate the plan of `kind` for `profile` on `ranks` ranks and `microbatches`
/// micro-batches, encoders inline.
pub fn generate(
    kind: BodyKind,
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
) -> Result<Plan, GenError> {
    generate_by(kind, profile, ranks, microbatches, &SearchPolicy::DEFAULT)
}

/// [`generate`] under `policy` (the ramp's split search, [`ramp_split_by`]).
pub fn generate_by(
    kind: BodyKind,
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
    policy: &SearchPolicy,
) -> Result<Plan, GenError> {
    if microbatches == 0 {
        return Err(GenError::NoMicrobatches);
    }
    let need = |need: String| GenError::Microbatches {
        body: kind.expr(),
        need,
        microbatches,
        ranks,
    };
    match kind {
        BodyKind::Interleaved { v } if v < 2 => return Err(GenError::Chunks(v)),
        BodyKind::Interleaved { .. } if !microbatches.is_multiple_of(ranks) => {
            return Err(need(format!(
                "a multiple of {ranks} micro-batches (one group per rank)"
            )))
        }
        BodyKind::DualPipeV if microbatches < 2 * ranks => {
            return Err(need(format!(
                "at least {} micro-batches (2 x ranks)",
                2 * ranks
            )))
        }
        _ => {}
    }
    let units = build_units(profile, ranks, kind.chunks(), kind.layout())?;
    // The stages the body schedules: the LLM's, with a chained encoder's chunks in
    // front for `zb2p(encoders = chain | chains | ramp)`.
    let weave = match kind {
        BodyKind::Zb2p { encoders, .. } => encoders,
        _ => Weave::Inline,
    };
    let set = stage_set::prepare(
        weave,
        profile,
        units,
        (ranks, microbatches),
        (kind.chunks(), kind.layout()),
        policy,
    )?;
    let entry = set.entry();
    let StageSet {
        units,
        stages,
        encoders,
        scheduled,
        riders,
    } = set;
    let ctx = Ctx {
        ranks,
        microbatches,
        stages: &scheduled,
        units: &units,
        memory_limit: profile.memory.as_ref().map(|m| m.limit),
        riders: &riders,
    };
    let body = match kind {
        BodyKind::GPipe => gpipe::order(&ctx),
        BodyKind::OneFOneB => onef1b::order(&ctx),
        BodyKind::Interleaved { v } => interleaved::order(&ctx, v),
        BodyKind::ZbH1 => zbh1::order(&ctx),
        BodyKind::ZbV => zbv::order(&ctx),
        BodyKind::DualPipeV => dualpipev::order(&ctx),
        BodyKind::ZbList { vshape: true } => zbv::order(&ctx),
        BodyKind::ZbList { vshape: false } => zbh1::order(&ctx),
        BodyKind::Zb2p { lockstep, .. } => {
            let weaving = weave == Weave::Spread;
            let weighed = stage_set::weigh(&ctx, entry, weaving);
            let woven = weave::Woven::new(&ctx, weaving, lockstep);
            zb2p::order(&ctx, &weighed, entry, lockstep, woven)
        }
    };
    let woven = match weave {
        Weave::Spread => weave::feeding(&ctx),
        _ => Vec::new(),
    };
    // ZB-2p with one chunk is never behind ZB-H1 (see below).
    let zbh1_order = matches!(
        kind,
        BodyKind::Zb2p {
            v: 1,
            vshape: false,
            lockstep: false,
            encoders: Weave::Inline,
        }
    )
    .then(|| zbh1::order(&ctx));
    // The list search's other orders, tried once the plan is finished (below).
    let alternatives = match kind {
        BodyKind::ZbList { vshape } => list_search(&ctx, if vshape { 2 } else { 1 }, policy),
        _ => Vec::new(),
    };
    let body = ride_along(body, &riders, &units);
    let mut plan = Plan {
        ranks,
        microbatches,
        units,
        stages,
        encoders: scheduled[..entry]
            .iter()
            .chain(riders.iter().map(|(r, _)| r))
            .chain(&encoders)
            .copied()
            .collect(),
        order: body,
        input_ships: vec![],
        prefetch: vec![],
        memory_limit: profile.memory.as_ref().map(|m| m.limit),
    };
    if let Some(order) = zbh1_order {
        plan = zb2p::no_worse_than_zbh1(plan, order);
    }
    let encs: Vec<UnitId> = plan
        .encoders
        .iter()
        .copied()
        .filter(|e| {
            !woven.contains(e) && !scheduled.contains(e) && !riders.iter().any(|(r, _)| r == e)
        })
        .collect();
    for &e in &encs {
        inline_encoder(&mut plan, e);
    }
    if !alternatives.is_empty() {
        // The fastest finished plan that fits the memory limit; the fixed order
        // (`plan`) on ties and when none fits.
        let fixed_fits = fits(&plan);
        let mut best = (zblist_span(&plan), plan);
        let mut best_fits = fixed_fits;
        for order in alternatives {
            let mut alt = Plan {
                order: ride_along(order, &riders, &best.1.units),
                ..best.1.clone()
            };
            for &e in &encs {
                inline_encoder(&mut alt, e);
            }
            let span = zblist_span(&alt);
            if (less(span, best.0) || !best_fits) && fits(&alt) {
                best = (span, alt);
                best_fits = true;
            }
        }
        plan = best.1;
    }
    Ok(plan)
}

/// The list search's candidate orders on `chunks` stages per rank (see
/// [`zblist`]): the [`SearchPolicy::zb_keep`] fastest distinct ones by the
/// scheduler's own times, over every rule of the family and both budgets (1F1B's,
/// and the memory limit less each rank's resident parameters).
fn list_search(ctx: &Ctx, chunks: usize, policy: &SearchPolicy) -> Vec<Vec<Vec<Task>>> {
    let mut budgets = vec![zblist::default_budget(ctx, chunks)];
    let own: Option<Vec<f64>> = ctx.memory_limit.map(|limit| {
        (0..ctx.ranks)
            .map(|r| limit - homed_params(ctx.units, r))
            .collect()
    });
    if let Some(own) = own.as_ref().filter(|own| **own != budgets[0]) {
        budgets.push(own.clone());
    }
    // Only runs within the limit (as far as the body's own stages go: the plan is
    // checked again once finished).
    let within = |run: &zblist::Run| {
        own.as_ref()
            .is_none_or(|own| run.peak.iter().zip(own).all(|(p, o)| *p <= *o))
    };
    let mut runs: Vec<zblist::Run> = zblist::family(&budgets, chunks, policy)
        .iter()
        .filter_map(|rule| zblist::run(ctx, chunks, rule))
        .filter(within)
        .collect();
    crate::ir::compare::sort_best_first(
        &mut runs,
        |r| crate::ir::compare::Score::span(r.makespan),
        |_, _| std::cmp::Ordering::Equal,
    );
    let mut out: Vec<Vec<Vec<Task>>> = Vec::new();
    for zblist::Run { order, .. } in runs {
        if out.len() >= policy.zb_keep {
            break;
        }
        if !out.contains(&order) {
            out.push(order);
        }
    }
    out
}

/// A plan's ideal makespan (infinite if it cannot be timed).
fn zblist_span(plan: &Plan) -> f64 {
    crate::algebra::analysis::dependencies(plan)
        .and_then(|d| crate::algebra::analysis::timing(plan, &d))
        .map_or(f64::INFINITY, |t| t.makespan())
}

/// `order` with every rider's task right after its carrier's (see
/// [`chain::cut_all`]): a frozen rider only its forward, a trainable one each of the
/// carrier's tasks.
fn ride_along(
    order: Vec<Vec<Task>>,
    riders: &[(UnitId, UnitId)],
    units: &[Unit],
) -> Vec<Vec<Task>> {
    if riders.is_empty() {
        return order;
    }
    order
        .into_iter()
        .map(|list| {
            let mut out = Vec::with_capacity(list.len() * 2);
            for t in list {
                out.push(t);
                for &(r, _) in riders.iter().filter(|(_, c)| *c == t.unit) {
                    if t.op == Op::F || units[r].trainable {
                        out.push(Task::new(t.op, r, t.mb));
                    }
                }
            }
            out
        })
        .collect()
}

/// Place encoder `e`'s work on the first stage's rank: `F(e,m)` just before the first
/// stage's forward of `m`, and (trainable) `BW(e,m)` just after its backward.
pub fn inline_encoder(plan: &mut Plan, e: UnitId) {
    let first = plan.stages[0];
    let trainable = plan.units[e].trainable;
    for list in &mut plan.order {
        if !list.iter().any(|t| t.unit == first) {
            continue;
        }
        let mut out = Vec::with_capacity(list.len() + 2 * plan.microbatches);
        for t in list.drain(..) {
            let is_first = t.unit == first;
            if is_first && t.op == Op::F {
                out.push(Task::new(Op::F, e, t.mb));
            }
            out.push(t);
            if is_first && trainable && matches!(t.op, Op::B | Op::BW) {
                out.push(Task::new(Op::BW, e, t.mb));
            }
        }
        *list = out;
    }
}

/// Whether every rank's peak activations plus resident parameters are within the
/// plan's memory limit (if any).
pub(crate) fn fits(p: &Plan) -> bool {
    let peaks = peak_memory(p);
    p.memory_limit.is_none_or(|limit| {
        peaks
            .iter()
            .enumerate()
            .all(|(r, peak)| at_most(peak + homed_params(&p.units, r), limit))
    })
}

/// The parameters of the units homed on rank `r`.
pub(crate) fn homed_params(units: &[Unit], r: usize) -> f64 {
    units.iter().filter(|u| u.home == r).map(|u| u.params).sum()
}
