//! The stage set a body schedules, prepared before any generator runs: the LLM's
//! stages and, where `zb2p(encoders = ..)` asks for it, an encoder's layer chunks as
//! extra stages in front of them.
//!
//! The preparation steps, each one function of the profile and the units:
//!
//! - **inline** (every body's default): the LLM's stages alone; the encoders are
//!   placed on the first stage's rank once the body is scheduled.
//! - **chain** ([`Weave::Chain`]): the heaviest encoder feeding the first stage cut
//!   into per-rank layer chunks ([`chain::cut`]), scheduled as stages before the
//!   LLM's.
//! - **ramp** ([`Weave::Ramp`]): the stage boundaries moved first, the LLM's split
//!   and the chunk sizes chosen together ([`crate::algebra::ramp::ramp_split_by`]),
//!   then chained as `chain` does on that split.
//! - **chains** ([`Weave::Chains`]): every encoder feeding the first stage chained
//!   along the same ranks ([`chain::cut_all`]), the others riding with the heaviest;
//!   under `balance` the split chosen with them ([`chain::chains_split`]).
//!
//! For a Qwen2-VL-7B-class model whose trainable ViT weighs about one stage, the
//! chained encoder under `zb2p` is within 5% of the bound with asynchronous sends
//! (1.048; 1.037 with the ramp split, and 1.027 with `v = 2, encoders = ramp`, two
//! looped chunks per rank); under rendezvous the lockstep form of the ramp,
//! computed layer by layer ([`crate::algebra::operators::layers`]) and refined, is
//! the fastest (1.066; 1.0515 with its compute order searched too,
//! [`crate::search::reorder`]; the rendezvous bound also counts the time transfers
//! hold the ranks, see [`crate::judge::bound`]).
//!
//! `spread` keeps the stages as they are: its encoders are woven in by the list
//! scheduler ([`super::weave`]). [`weigh`] then states, per scheduled stage, what a
//! list scheduler weighs: its rank, its costs and activations with its riders'.

use super::{chain, Ctx, GenError, Weave};
use crate::algebra::profile::{Profile, Split};
use crate::algebra::units::build_units;
use crate::ir::plan::{Layout, UnitId};
use crate::ir::policy::SearchPolicy;
use crate::ir::program::{Cost, Unit};

/// The units of a body and the stages it schedules.
pub(super) struct StageSet {
    pub units: Vec<Unit>,
    /// The LLM's stages, in pipeline order.
    pub stages: Vec<UnitId>,
    /// The encoders left to place once the body is scheduled.
    pub encoders: Vec<UnitId>,
    /// What the body schedules, in pipeline order: a chained encoder's chunks, then
    /// the LLM's stages.
    pub scheduled: Vec<UnitId>,
    /// `(rider, carrier)` chunks of `encoders = chains` (see [`chain::cut_all`]).
    pub riders: Vec<(UnitId, UnitId)>,
}

impl StageSet {
    /// Where the LLM starts among the scheduled stages (the chunks before it).
    pub(super) fn entry(&self) -> usize {
        self.scheduled.len() - self.stages.len()
    }

    /// The stages of `units` ([`build_units`]'s: the encoders, then the stages),
    /// nothing chained.
    fn inline(units: Vec<Unit>, n_enc: usize) -> StageSet {
        let stages: Vec<UnitId> = (n_enc..units.len()).collect();
        StageSet {
            units,
            encoders: (0..n_enc).collect(),
            scheduled: stages.clone(),
            stages,
            riders: Vec::new(),
        }
    }

    /// The stages of a chained encoder: its chunks, then the LLM's.
    fn chained(c: chain::Chained) -> StageSet {
        let scheduled: Vec<UnitId> = c.chunks.iter().chain(&c.stages).copied().collect();
        StageSet {
            units: c.units,
            stages: c.stages,
            encoders: c.encoders,
            scheduled,
            riders: c.riders,
        }
    }
}

/// The stage set for `weave`, over `units` (built for `v` chunks per rank in
/// `layout`); errors say which arguments the preparation cannot take.
pub(super) fn prepare(
    weave: Weave,
    profile: &Profile,
    units: Vec<Unit>,
    (ranks, microbatches): (usize, usize),
    (v, layout): (usize, Layout),
    policy: &SearchPolicy,
) -> Result<StageSet, GenError> {
    let n_enc = profile.encoders.len();
    let chained = match weave {
        Weave::Inline | Weave::Spread => None,
        Weave::Chain => chain::cut(profile, &units, ranks, None),
        Weave::Chains => Some(chains(profile, &units, ranks, (v, layout))?),
        Weave::Ramp => ramp(profile, &units, (ranks, microbatches), (v, layout), policy)?,
    };
    Ok(match chained {
        Some(c) => StageSet::chained(c),
        None => StageSet::inline(units, n_enc),
    })
}

/// Every encoder feeding the first stage chained along the ranks (`encoders =
/// chains`); under `balance`, the LLM's split chosen with the chunks (one layer at a
/// time between stages, for the least busy busiest rank).
fn chains(
    profile: &Profile,
    units: &[Unit],
    ranks: usize,
    (v, layout): (usize, Layout),
) -> Result<chain::Chained, GenError> {
    if v > 1 || layout == Layout::VShape {
        return Err(GenError::Chains(
            "use one chunk per rank (no `v`, no `layout`)",
        ));
    }
    let balanced = (profile.llm.split == Split::Balanced && profile.llm.layout.is_none())
        .then(|| chain::chains_split(profile, units, ranks))
        .flatten();
    let cut = match balanced {
        Some(split) => {
            let mut own = profile.clone();
            own.llm.layout = Some(crate::algebra::ramp::stage_layout(split.into_iter()));
            let units = build_units(&own, ranks, 1, layout)?;
            chain::cut_all(&own, &units, ranks)
        }
        None => chain::cut_all(profile, units, ranks),
    };
    cut.ok_or(GenError::Chains(
        "it needs at least two encoders; use `encoders = chain`",
    ))
}

/// The ramp split of the stage boundaries (`encoders = ramp`), then the chain on it:
/// the split is chosen over one-chunk stages, then each rank's layers are halved
/// between its chunks for `v = 2`. Without a split (no encoder to chain), the
/// units' own split chained with water-filled chunks.
fn ramp(
    profile: &Profile,
    units: &[Unit],
    (ranks, microbatches): (usize, usize),
    (v, layout): (usize, Layout),
    policy: &SearchPolicy,
) -> Result<Option<chain::Chained>, GenError> {
    if v > 2 || layout == Layout::VShape {
        return Err(GenError::Ramp("use at most `v = 2`, and drop `layout`"));
    }
    if profile.llm.layout.is_some() {
        return Err(GenError::Ramp(
            "the profile fixes it with `llm.layout`; use `encoders = chain`",
        ));
    }
    let rebuilt;
    let single = if v == 1 {
        units
    } else {
        rebuilt = build_units(profile, ranks, 1, layout)?;
        &rebuilt
    };
    Ok(
        match crate::algebra::ramp::ramp_split_by(profile, single, ranks, microbatches, v, policy) {
            Some(split) => {
                let own = split.applied(profile, v);
                let units = build_units(&own, ranks, v, layout)?;
                chain::cut(&own, &units, ranks, Some(&split.chunks))
            }
            None => chain::cut(profile, units, ranks, None),
        },
    )
}

/// What a list scheduler weighs of one scheduled stage.
#[derive(Clone, Copy, Debug)]
pub(super) struct Weighed {
    /// The rank it runs on.
    pub home: usize,
    /// Its costs, its riders' included (they run with it).
    pub cost: Cost,
    /// The activations one micro-batch holds on its rank until its last task: its
    /// own and its trainable riders', and on the LLM's first stage those of the
    /// trainable encoders placed inline before it; nothing without a backward.
    pub act: f64,
    /// Whether it has a backward (a frozen chunk of a chained encoder has none).
    pub needs_b: bool,
    /// Whether it has a weight gradient (a `W` after its `B`).
    pub trainable: bool,
}

/// [`Weighed`] of each of `ctx`'s stages; the LLM starts at stage `entry`. With
/// `weaving` (`encoders = spread`), no encoder is counted inline.
pub(super) fn weigh(ctx: &Ctx, entry: usize, weaving: bool) -> Vec<Weighed> {
    let rider = |u: usize| ctx.riders.iter().any(|(r, _)| *r == u);
    // The encoders that start inline, just before the first stage, and are held
    // until their backward after its `B`.
    let inline: f64 = ctx
        .units
        .iter()
        .enumerate()
        .filter(|(u, x)| !weaving && !ctx.stages.contains(u) && !rider(*u) && x.trainable)
        .map(|(_, x)| x.act)
        .sum();
    let need = crate::ir::plan::needs_backward(ctx.units);
    (0..ctx.stages.len())
        .map(|k| {
            let u = ctx.stages[k];
            let unit = &ctx.units[u];
            let mut cost = unit.cost;
            for &(r, _) in ctx.riders.iter().filter(|(_, c)| *c == u) {
                let x = &ctx.units[r];
                cost.f += x.cost.f;
                if x.trainable {
                    cost.b += x.cost.b;
                    cost.w += x.cost.w;
                }
            }
            let act = if need[u] {
                let riding: f64 = ctx
                    .riders
                    .iter()
                    .filter(|(r, c)| *c == u && ctx.units[*r].trainable)
                    .map(|(r, _)| ctx.units[*r].act)
                    .sum();
                unit.act + riding + if k == entry { inline } else { 0.0 }
            } else {
                0.0
            };
            Weighed {
                home: unit.home,
                cost,
                act,
                needs_b: need[u],
                trainable: unit.trainable,
            }
        })
        .collect()
}
