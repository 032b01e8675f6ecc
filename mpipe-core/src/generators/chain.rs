//! An encoder cut into layer chunks, one per rank, scheduled by `zb2p` as stages
//! before the LLM's (`zb2p(encoders = chain)`; the chunks are
//! [`crate::units::encoder_chunks`]'s). Where the chunks' work goes then follows
//! from the list schedule, as the stages' does.
//!
//! What this buys over weaving whole micro-batches (`encoders = spread`): every
//! transfer is between neighbours that meet anyway for the LLM's stages, and every
//! chunk computes on its home rank, so a trainable encoder needs no broadcast of its
//! parameters and no reduction of their gradients.

use crate::plan::UnitId;
use crate::profile::Profile;
use crate::program::Unit;
use crate::units::{encoder_chunks, replace_with_chunks};

/// The units with one encoder cut into chunks.
pub struct Chained {
    /// Chunks in data order, then the other encoders, then the LLM stages.
    pub units: Vec<Unit>,
    /// The chunks' ids, in data order (the last one feeds the first stage).
    pub chunks: Vec<UnitId>,
    /// The other encoders' ids.
    pub encoders: Vec<UnitId>,
    /// The LLM stages' ids, in pipeline order.
    pub stages: Vec<UnitId>,
}

/// Cut the heaviest encoder feeding the first stage into chunks over `ranks` ranks.
/// `units` are [`crate::units::build_units`]'s: the profile's encoders, in order, then
/// the stages. `None` when no encoder feeds the first stage.
pub fn cut(profile: &Profile, units: &[Unit], ranks: usize) -> Option<Chained> {
    let n_enc = profile.encoders.len();
    let first = units.get(n_enc)?;
    let e = (0..n_enc)
        .filter(|&i| first.inputs.contains(&units[i].name))
        .max_by(|&a, &b| units[a].work().total_cmp(&units[b].work()).then(b.cmp(&a)))?;
    let spec = &profile.encoders[e];
    // Each rank's work per micro-batch before the chunks.
    let mut load = vec![0.0f64; ranks];
    for (i, u) in units.iter().enumerate() {
        if i >= n_enc {
            load[u.home] += u.work();
        } else if i != e {
            load[first.home] += u.work();
        }
    }
    let chunks = encoder_chunks(spec, &load, first.home);
    let n = chunks.len();
    // Chunks first, then the other encoders, then the stages.
    let out = replace_with_chunks(units, e, chunks);
    let chunks: Vec<UnitId> = (0..n).collect();
    let encoders: Vec<UnitId> = (n..n + n_enc - 1).collect();
    let stages: Vec<UnitId> = (n + n_enc - 1..out.len()).collect();
    Some(Chained {
        units: out,
        chunks,
        encoders,
        stages,
    })
}
