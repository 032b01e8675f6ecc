//! From a model profile to the program's units: encoders, then the LLM split into
//! `ranks x chunks` stages named `llm.0 ..` in pipeline order.
//!
//! Splitting rule: `layers / stages` layers each, the remainder going one layer each
//! to stages `1, 2, ..` (the first stage already carries the encoders' output and the
//! embedding, the last the LM head). Per-stage extras are added to the first and last
//! stage. Every encoder feeds `llm.0` and lives (has its home) where `llm.0` does.
//!
//! A profile with `llm.layout` (a Megatron-LM layout string, [`crate::algebra::megatron`])
//! replaces that rule: stage `k` is the layout's stage `k` (Megatron lists chunk 0 of
//! every rank, then chunk 1, .., which is the pipeline order), with its `t` layers plus
//! one layer's cost per `m` (MTP) layer, the first-stage extra on the stage holding
//! `E` and the last-stage extra on the stage holding `L`. Stages may then be empty.

use crate::algebra::megatron::{LayoutError, MegatronLayout};
use crate::algebra::profile::{EncoderProfile, Profile, Split};
use crate::ir::plan::Layout;
use crate::ir::program::{Cost, Role, Unit};

/// Why the profile cannot be split as asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum UnitsError {
    #[error(
        "llm.layers = {layers} cannot be split into {stages} stages ({ranks} ranks x {chunks} chunks): \
         every stage needs at least one layer; use fewer ranks or chunks, or a profile with more layers"
    )]
    TooFewLayers {
        layers: u32,
        stages: usize,
        ranks: usize,
        chunks: usize,
    },
    #[error("ranks must be at least 1")]
    NoRanks,
    #[error("the V-shaped layout needs exactly 2 chunks per rank, got {0}")]
    VShapeChunks(usize),
    /// `llm.layout` is not a valid Megatron layout string.
    #[error("llm.layout is not a valid Megatron pipeline layout: {0}")]
    Layout(LayoutError),
    /// `llm.layout` has a different number of stages than the schedule.
    #[error(
        "llm.layout has {layout} stages but the schedule needs {ranks} ranks x {chunks} chunks = \
         {stages} stages; {hint}"
    )]
    LayoutStages {
        layout: usize,
        stages: usize,
        ranks: usize,
        chunks: usize,
        /// How to make them agree.
        hint: String,
    },
    /// `llm.layout` has a different number of transformer layers than `llm.layers`.
    #[error(
        "llm.layout has {layout} transformer layers (`t`) but llm.layers = {layers}; \
         change the layout or llm.layers so they agree"
    )]
    LayoutLayers { layout: usize, layers: u32 },
}

/// What one LLM stage holds.
#[derive(Clone, Copy, Debug, PartialEq)]
struct StageShare {
    /// Layers costed at the per-layer LLM costs (transformer and MTP layers).
    layers: usize,
    /// Whether the first-stage extra (embedding) is on this stage.
    first: bool,
    /// Whether the last-stage extra (LM head and loss) is on this stage.
    last: bool,
}

/// How to make a layout of `layout` stages fit `ranks x chunks`.
fn stages_hint(layout: usize, ranks: usize, chunks: usize) -> String {
    let stages = ranks * chunks;
    let mut hint = format!(
        "write the layout with {stages} `|`-separated stages (chunk 0 of ranks 0..{}, then chunk 1, ..)",
        ranks - 1
    );
    if layout > 0 && layout.is_multiple_of(chunks) && layout / chunks != ranks {
        hint += &format!(", or run it on {} ranks", layout / chunks);
    }
    if layout > 0 && layout.is_multiple_of(ranks) && layout / ranks != chunks {
        let v = layout / ranks;
        let schedule = if v == 1 {
            "a one-chunk schedule (such as `1f1b`)".to_string()
        } else if v == 2 {
            "a schedule with 2 chunks per rank (such as `interleaved(v = 2)` or `zbv`)".to_string()
        } else {
            format!("a schedule with {v} chunks per rank (`interleaved(v = {v})`)")
        };
        hint += &format!(", or use {schedule} on {ranks} ranks");
    }
    hint
}

/// The balanced split (`balance`): every stage gets one layer, then each further
/// layer goes to the stage with the least work so far (`F + B + W`, counting the
/// first stage's embedding and the last stage's LM head), which minimises the
/// longest stage since the layers are alike; ties go to stages `1, 2, ..` before
/// stage 0, as in the even split. Equal stages keep the pipeline's steady state free
/// of stage-length bubbles, and give every rank (which holds `chunks` stages) an even
/// share.
fn balanced(profile: &Profile, ranks: usize, chunks: usize) -> Vec<StageShare> {
    let llm = &profile.llm;
    let stages = ranks * chunks;
    let per_layer = llm.forward + llm.backward + llm.weight;
    let extra = |x: &Option<crate::algebra::profile::Extra>| {
        x.as_ref()
            .map_or(0.0, |x| x.forward + x.backward + x.weight)
    };
    let mut layers = vec![1usize; stages];
    let mut time: Vec<f64> = (0..stages)
        .map(|k| {
            let mut t = per_layer;
            if k == 0 {
                t += extra(&llm.first_stage_extra);
            }
            if k + 1 == stages {
                t += extra(&llm.last_stage_extra);
            }
            t
        })
        .collect();
    // Ties: stages 1, 2, .. before stage 0 (as the even split).
    let preference: Vec<usize> = (1..stages).chain(std::iter::once(0)).collect();
    for _ in stages..llm.layers as usize {
        let k = preference
            .iter()
            .copied()
            .min_by(|&a, &b| time[a].total_cmp(&time[b]))
            .unwrap_or(0);
        layers[k] += 1;
        time[k] += per_layer;
    }
    layers
        .into_iter()
        .enumerate()
        .map(|(k, layers)| StageShare {
            layers,
            first: k == 0,
            last: k + 1 == stages,
        })
        .collect()
}

/// Each stage's share of the LLM: from `llm.layout` if present, else the even split
/// or [`balanced`], as `llm.split` says.
fn shares(profile: &Profile, ranks: usize, chunks: usize) -> Result<Vec<StageShare>, UnitsError> {
    let llm = &profile.llm;
    let stages = ranks * chunks;
    let Some(text) = &llm.layout else {
        if (llm.layers as usize) < stages {
            return Err(UnitsError::TooFewLayers {
                layers: llm.layers,
                stages,
                ranks,
                chunks,
            });
        }
        if llm.split == Split::Balanced {
            return Ok(balanced(profile, ranks, chunks));
        }
        return Ok(even_layers(llm.layers as usize, stages)
            .into_iter()
            .enumerate()
            .map(|(k, layers)| StageShare {
                layers,
                first: k == 0,
                last: k + 1 == stages,
            })
            .collect());
    };
    let layout = MegatronLayout::parse(text).map_err(UnitsError::Layout)?;
    if layout.num_stages() != stages {
        return Err(UnitsError::LayoutStages {
            layout: layout.num_stages(),
            stages,
            ranks,
            chunks,
            hint: stages_hint(layout.num_stages(), ranks, chunks),
        });
    }
    if layout.transformer_layers() != llm.layers as usize {
        return Err(UnitsError::LayoutLayers {
            layout: layout.transformer_layers(),
            layers: llm.layers,
        });
    }
    let (e, l) = (layout.embedding_stage(), layout.loss_stage());
    Ok(layout
        .stages()
        .iter()
        .enumerate()
        .map(|(k, s)| StageShare {
            layers: s.transformer() + s.mtp(),
            first: k == e,
            last: k == l,
        })
        .collect())
}

/// Home rank of pipeline stage `k` of `ranks * chunks` under `layout`.
pub fn stage_rank(layout: Layout, ranks: usize, k: usize) -> usize {
    match layout {
        Layout::Looped => k % ranks,
        Layout::VShape => {
            if k < ranks {
                k
            } else {
                2 * ranks - 1 - k
            }
        }
    }
}

/// The name of LLM stage `k`.
pub fn stage_name(k: usize) -> String {
    format!("llm.{k}")
}

/// Build the units of `profile` for `ranks` ranks with `chunks` stages per rank.
/// Returns the units, encoders first.
pub fn build_units(
    profile: &Profile,
    ranks: usize,
    chunks: usize,
    layout: Layout,
) -> Result<Vec<Unit>, UnitsError> {
    if ranks == 0 {
        return Err(UnitsError::NoRanks);
    }
    if layout == Layout::VShape && chunks != 2 {
        return Err(UnitsError::VShapeChunks(chunks));
    }
    let stages = ranks * chunks;
    let llm = &profile.llm;
    let shares = shares(profile, ranks, chunks)?;
    let first_home = stage_rank(layout, ranks, 0);
    let mut units = Vec::with_capacity(profile.encoders.len() + stages);
    for e in &profile.encoders {
        units.push(encoder_unit(
            e,
            e.layers,
            (e.name.clone(), Role::Encoder),
            vec![],
            first_home,
        ));
    }
    for (k, share) in shares.iter().enumerate() {
        let layers = share.layers as f64;
        let mut cost = Cost {
            f: layers * llm.forward,
            b: layers * llm.backward,
            w: layers * llm.weight,
        };
        let mut act = layers * llm.activation;
        let mut params = layers * llm.params;
        let extras = [
            share.first.then_some(&llm.first_stage_extra),
            share.last.then_some(&llm.last_stage_extra),
        ];
        for x in extras.into_iter().flatten().flatten() {
            cost.f += x.forward;
            cost.b += x.backward;
            cost.w += x.weight;
            act += x.activation;
            params += x.params;
        }
        let inputs = if k == 0 {
            profile.encoders.iter().map(|e| e.name.clone()).collect()
        } else {
            vec![stage_name(k - 1)]
        };
        units.push(Unit {
            name: stage_name(k),
            inputs,
            home: stage_rank(layout, ranks, k),
            trainable: true,
            cost,
            act,
            bytes: llm.output,
            params,
            role: Role::Stage(k),
        });
    }
    Ok(units)
}

/// An encoder cut into layer chunks, one per rank, chained into the first stage.
///
/// The layers are shared out by water-filling: layer by layer, to the rank whose work
/// per micro-batch (`load`, plus its chunk so far) is least, the lower rank on ties.
/// Each rank's layers form one chunk, a unit homed on that rank (`vision.0`,
/// `vision.1`, .. in data order) with the profile's per-layer costs and activations
/// times its layers, and its share of the parameters. The chunks run from the rank
/// after the first stage's (`first_home`; rank `p - 1` when that is rank 0) down to
/// the first stage's rank, so each hands its output to a neighbour, in the
/// direction the LLM's gradients flow, and the last one feeds the first stage on
/// its own rank; ranks given no layers are skipped. A chunk's output is costed at
/// the encoder's `output` size (the profile has no other figure for a layer's
/// output). The result is never empty (an encoder has at least one layer).
pub fn encoder_chunks(spec: &EncoderProfile, load: &[f64], first_home: usize) -> Vec<Unit> {
    chunks_of(spec, &water_fill(spec, load), first_home)
}

/// How many of encoder `spec`'s layers each rank takes, by water-filling on `load`
/// (see [`encoder_chunks`]).
pub(crate) fn water_fill(spec: &EncoderProfile, load: &[f64]) -> Vec<u32> {
    water_fill_on(spec, &mut load.to_vec(), &vec![true; load.len()])
}

/// [`water_fill`] over the ranks `allowed` marks only (none: rank 0 takes all),
/// adding the layers' work to `load`.
pub(crate) fn water_fill_on(spec: &EncoderProfile, load: &mut [f64], allowed: &[bool]) -> Vec<u32> {
    let per_layer = encoder_layer_work(spec);
    let mut layers = vec![0u32; load.len()];
    for _ in 0..spec.layers {
        let r = (0..load.len())
            .filter(|&r| allowed.get(r).copied().unwrap_or(false))
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .unwrap_or(0);
        if let Some(x) = load.get_mut(r) {
            *x += per_layer;
        }
        if let Some(n) = layers.get_mut(r) {
            *n += 1;
        }
    }
    layers
}

/// The even split of `layers` over `stages`: `layers / stages` each, the remainder
/// one layer each to stages `1, 2, ..` (see the module doc).
pub(crate) fn even_layers(layers: usize, stages: usize) -> Vec<usize> {
    let (base, rem) = (layers / stages.max(1), layers % stages.max(1));
    (0..stages)
        .map(|k| base + usize::from(k >= 1 && k <= rem))
        .collect()
}

/// One layer of encoder `spec`'s work per micro-batch: `F`, and `B + W` if it trains.
pub(crate) fn encoder_layer_work(spec: &EncoderProfile) -> f64 {
    spec.forward
        + if spec.trainable {
            spec.backward + spec.weight.unwrap_or(0.0)
        } else {
            0.0
        }
}

/// Encoder `spec` cut into chunks of `layers[r]` layers on rank `r`, chained as
/// [`encoder_chunks`] says (ranks with no layers skipped).
pub fn chunks_of(spec: &EncoderProfile, layers: &[u32], first_home: usize) -> Vec<Unit> {
    let ranks = layers.len();
    let path = (0..ranks)
        .rev()
        .map(|d| (first_home + d) % ranks)
        .filter(|&r| layers[r] > 0);
    path.enumerate()
        .map(|(j, r)| chunk(spec, j, layers[r], r))
        .collect()
}

/// Encoder `spec` cut into one chunk per layer, all on rank `home` (what bounds
/// every way of chunking it, see [`crate::judge::bound`]).
pub(crate) fn layer_chunks(spec: &EncoderProfile, home: usize) -> Vec<Unit> {
    (0..spec.layers.max(1) as usize)
        .map(|j| chunk(spec, j, 1, home))
        .collect()
}

/// Chunk `j` of encoder `spec` (`vision.j`), of `layers` layers on rank `home`: it
/// reads the previous chunk, the first one the raw micro-batch.
fn chunk(spec: &EncoderProfile, j: usize, layers: u32, home: usize) -> Unit {
    let inputs = if j == 0 {
        vec![]
    } else {
        vec![format!("{}.{}", spec.name, j - 1)]
    };
    let role = Role::EncoderChunk(spec.name.clone());
    encoder_unit(
        spec,
        layers,
        (format!("{}.{j}", spec.name), role),
        inputs,
        home,
    )
}

/// `units` with unit `e` replaced by `chunks` (a chain in data order), which come
/// first; the other units keep their order, and the readers of `e` read the last
/// chunk instead. Topological order is kept (the chunks read nothing else).
pub fn replace_with_chunks(units: &[Unit], e: usize, chunks: Vec<Unit>) -> Vec<Unit> {
    let old = &units[e].name;
    let last = chunks.last().map(|c| c.name.clone());
    let mut out = chunks;
    for (i, u) in units.iter().enumerate() {
        if i == e {
            continue;
        }
        let mut u = u.clone();
        if let Some(last) = &last {
            for input in u.inputs.iter_mut().filter(|x| *x == old) {
                input.clone_from(last);
            }
        }
        out.push(u);
    }
    out
}

/// `layers` of encoder `spec` as one unit: the per-layer costs and activations
/// times the layers, their share of the parameters, the encoder's output size.
fn encoder_unit(
    spec: &EncoderProfile,
    layers: u32,
    (name, role): (String, Role),
    inputs: Vec<String>,
    home: usize,
) -> Unit {
    let n = f64::from(layers);
    Unit {
        name,
        inputs,
        home,
        trainable: spec.trainable,
        cost: Cost {
            f: n * spec.forward,
            b: n * spec.backward,
            w: n * spec.weight.unwrap_or(0.0),
        },
        act: n * spec.activation,
        bytes: spec.output,
        params: spec.params * n / f64::from(spec.layers.max(1)),
        role,
    }
}

/// The rank with the least `load`, the lowest on ties (0 when there is none): where
/// water-filling puts the next piece of work.
pub(crate) fn least_loaded(load: &[f64]) -> usize {
    (0..load.len())
        .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
        .unwrap_or(0)
}
