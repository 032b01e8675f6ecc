//! From a model profile to the program's units: encoders, then the LLM split into
//! `ranks x chunks` stages named `llm.0 ..` in pipeline order.
//!
//! Splitting rule: `layers / stages` layers each, the remainder going one layer each
//! to stages `1, 2, ..` (the first stage already carries the encoders' output and the
//! embedding, the last the LM head). Per-stage extras are added to the first and last
//! stage. Every encoder feeds `llm.0` and lives (has its home) where `llm.0` does.

use crate::plan::Layout;
use crate::profile::Profile;
use crate::program::{Cost, Unit};

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
    if (llm.layers as usize) < stages {
        return Err(UnitsError::TooFewLayers {
            layers: llm.layers,
            stages,
            ranks,
            chunks,
        });
    }
    let first_home = stage_rank(layout, ranks, 0);
    let mut units = Vec::with_capacity(profile.encoders.len() + stages);
    for e in &profile.encoders {
        let l = e.layers as f64;
        units.push(Unit {
            name: e.name.clone(),
            inputs: vec![],
            home: first_home,
            trainable: e.trainable,
            cost: Cost {
                f: l * e.forward,
                b: l * e.backward,
                w: l * e.weight.unwrap_or(0.0),
            },
            act: l * e.activation,
            bytes: e.output,
            params: e.params,
        });
    }
    let base = llm.layers as usize / stages;
    let rem = llm.layers as usize % stages;
    for k in 0..stages {
        let layers = (base + usize::from(k >= 1 && k <= rem)) as f64;
        let mut cost = Cost {
            f: layers * llm.forward,
            b: layers * llm.backward,
            w: layers * llm.weight,
        };
        let mut act = layers * llm.activation;
        let mut params = layers * llm.params;
        let extras = [
            (k == 0).then_some(&llm.first_stage_extra),
            (k + 1 == stages).then_some(&llm.last_stage_extra),
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
        });
    }
    Ok(units)
}
