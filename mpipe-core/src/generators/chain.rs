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
use crate::units::encoder_chunks;

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
    let work = |u: &Unit| {
        u.cost.f
            + if u.trainable {
                u.cost.b + u.cost.w
            } else {
                0.0
            }
    };
    let e = (0..n_enc)
        .filter(|&i| first.inputs.contains(&units[i].name))
        .max_by(|&a, &b| work(&units[a]).total_cmp(&work(&units[b])).then(b.cmp(&a)))?;
    let spec = &profile.encoders[e];
    // Each rank's work per micro-batch before the chunks.
    let mut load = vec![0.0f64; ranks];
    for (i, u) in units.iter().enumerate() {
        if i >= n_enc {
            load[u.home] += u.cost.f + u.cost.b + u.cost.w;
        } else if i != e {
            load[first.home] += work(u);
        }
    }
    let mut out = encoder_chunks(spec, &load, first.home);
    let chunks: Vec<UnitId> = (0..out.len()).collect();
    let last = out.last().map(|u| u.name.clone())?;
    let encoders: Vec<UnitId> = (out.len()..out.len() + n_enc - 1).collect();
    out.extend(
        units[..n_enc]
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != e)
            .map(|(_, u)| u.clone()),
    );
    let stages: Vec<UnitId> = (out.len()..out.len() + units.len() - n_enc).collect();
    for u in &units[n_enc..] {
        let mut u = u.clone();
        for input in &mut u.inputs {
            if *input == spec.name {
                input.clone_from(&last);
            }
        }
        out.push(u);
    }
    Some(Chained {
        units: out,
        chunks,
        encoders,
        stages,
    })
}
