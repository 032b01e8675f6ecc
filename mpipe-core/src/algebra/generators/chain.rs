//! An encoder cut into layer chunks, one per rank, scheduled by `zb2p` as stages
//! before the LLM's (`zb2p(encoders = chain)`; the chunks are
//! [`crate::algebra::units::encoder_chunks`]'s). Where the chunks' work goes then follows
//! from the list schedule, as the stages' does.
//!
//! What this buys over weaving whole micro-batches (`encoders = spread`): every
//! transfer is between neighbours that meet anyway for the LLM's stages, and every
//! chunk computes on its home rank, so a trainable encoder needs no broadcast of its
//! parameters and no reduction of their gradients.

use crate::algebra::profile::Profile;
use crate::algebra::ramp::{chained_encoder, heaviest_feeding, load_before_chunks};
use crate::algebra::units::{
    chunks_of, even_layers, replace_with_chunks, water_fill, water_fill_on,
};
use crate::ir::plan::UnitId;
use crate::ir::program::Unit;

/// The units with one encoder cut into chunks (and, for `encoders = chains`, the
/// other encoders feeding the first stage too, riding along).
pub(crate) struct Chained {
    /// Chunks in data order, then riding chunks, then the other encoders, then the
    /// LLM stages.
    pub units: Vec<Unit>,
    /// The chunks' ids, in data order (the last one feeds the first stage).
    pub chunks: Vec<UnitId>,
    /// The other encoders' ids.
    pub encoders: Vec<UnitId>,
    /// The LLM stages' ids, in pipeline order.
    pub stages: Vec<UnitId>,
    /// `(rider, carrier)`: a chunk of another encoder, on the rank of the scheduled
    /// chunk `carrier`, whose tasks run right after the carrier's (empty for
    /// [`cut`]).
    pub riders: Vec<(UnitId, UnitId)>,
}

/// Cut the heaviest encoder feeding the first stage into chunks over `ranks` ranks.
/// `units` are [`crate::algebra::units::build_units`]'s: the profile's encoders, in order, then
/// the stages. The chunk sizes are `layers` (per rank) if given, else water-filled on
/// each rank's work. `None` when no encoder feeds the first stage.
pub(crate) fn cut(
    profile: &Profile,
    units: &[Unit],
    ranks: usize,
    layers: Option<&[u32]>,
) -> Option<Chained> {
    let n_enc = profile.encoders.len();
    let first = units.get(n_enc)?;
    let e = chained_encoder(units, n_enc)?;
    let spec = &profile.encoders[e];
    let layers = match layers {
        Some(l) => l.to_vec(),
        None => water_fill(spec, &load_before_chunks(units, n_enc, e, ranks)),
    };
    let chunks = chunks_of(spec, &layers, first.home);
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
        riders: Vec::new(),
    })
}

/// Every encoder feeding the first stage cut into chunks along the same ranks
/// (`zb2p(encoders = chains)`). The *carrier*, the heaviest trainable one (the
/// heaviest if none trains), is chunked as [`cut`] does and scheduled; each other
/// one is water-filled over the carrier's ranks on top of the stages' and the
/// carrier's work, and its chunk on a rank rides along with the carrier's chunk
/// there: the same tasks, right after it. Every dependency of a rider holds by
/// the carrier's: its previous chunk rode with the carrier's previous chunk, on
/// the rank before in the same direction, and the gradients come back the same
/// way (a trainable rider needs a trainable carrier, which the choice above gives).
/// `None` when fewer than two encoders feed the first stage.
pub(crate) fn cut_all(profile: &Profile, units: &[Unit], ranks: usize) -> Option<Chained> {
    let n_enc = profile.encoders.len();
    let first = units.get(n_enc)?;
    let (carrier, riders) = carrier_and_riders(units, n_enc)?;
    let first_home = first.home;
    // The stages' work per rank, with any encoder not feeding the first stage
    // inline on its rank.
    let mut load = vec![0.0f64; ranks];
    for (i, u) in units.iter().enumerate() {
        if i >= n_enc {
            load[u.home] += u.work();
        } else if i != carrier && !riders.contains(&i) {
            load[first_home] += u.work();
        }
    }
    let (layers, rider_layers, _) = fill_chains(profile, carrier, &riders, load);
    let spec = &profile.encoders[carrier];
    let carried = chunks_of(spec, &layers, first_home);
    let riding: Vec<Vec<Unit>> = riders
        .iter()
        .zip(&rider_layers)
        .map(|(&e, n)| chunks_of(&profile.encoders[e], n, first_home))
        .collect();
    let feeding: Vec<usize> = std::iter::once(carrier)
        .chain(riders.iter().copied())
        .collect();
    // Units: the carrier's chunks, the riders' chunks, the other encoders, the
    // stages; readers of a chained encoder read its last chunk.
    let chained = &feeding;
    let renamed: Vec<(String, String)> = chained
        .iter()
        .zip(std::iter::once(&carried).chain(&riding))
        .filter_map(|(&e, c)| Some((units[e].name.clone(), c.last()?.name.clone())))
        .collect();
    let mut out: Vec<Unit> = carried.clone();
    out.extend(riding.iter().flatten().cloned());
    let n_chunks = out.len();
    for (i, u) in units.iter().enumerate() {
        if chained.contains(&i) {
            continue;
        }
        let mut u = u.clone();
        for input in &mut u.inputs {
            if let Some((_, last)) = renamed.iter().find(|(old, _)| old == input) {
                input.clone_from(last);
            }
        }
        out.push(u);
    }
    let others = n_enc - chained.len();
    let chunks: Vec<UnitId> = (0..carried.len()).collect();
    let encoders: Vec<UnitId> = (n_chunks..n_chunks + others).collect();
    let stages: Vec<UnitId> = (n_chunks + others..out.len()).collect();
    let riders: Vec<(UnitId, UnitId)> = (carried.len()..n_chunks)
        .filter_map(|r| {
            let c = chunks
                .iter()
                .copied()
                .find(|&c| out[c].home == out[r].home)?;
            Some((r, c))
        })
        .collect();
    Some(Chained {
        units: out,
        chunks,
        encoders,
        stages,
        riders,
    })
}

/// The carrier of `encoders = chains` (the heaviest trainable encoder feeding the
/// first stage, else the heaviest; the earlier on ties) and the riders (the other
/// encoders feeding it, in profile order). `None` with fewer than two.
fn carrier_and_riders(units: &[Unit], n_enc: usize) -> Option<(usize, Vec<usize>)> {
    let first = units.get(n_enc)?;
    let feeding: Vec<usize> = (0..n_enc)
        .filter(|&i| first.inputs.contains(&units[i].name))
        .collect();
    if feeding.len() < 2 {
        return None;
    }
    let carrier = heaviest_feeding(units, n_enc, |u| u.trainable)
        .or_else(|| chained_encoder(units, n_enc))?;
    let riders = feeding.into_iter().filter(|&e| e != carrier).collect();
    Some((carrier, riders))
}

/// Water-fill the carrier's layers over the ranks on top of `load` (each rank's
/// stage work per micro-batch), then each rider's over the ranks the carrier got
/// layers on. Returns the carrier's layers per rank, each rider's, and the load.
fn fill_chains(
    profile: &Profile,
    carrier: usize,
    riders: &[usize],
    mut load: Vec<f64>,
) -> (Vec<u32>, Vec<Vec<u32>>, Vec<f64>) {
    let every = vec![true; load.len()];
    let layers = water_fill_on(&profile.encoders[carrier], &mut load, &every);
    let carried: Vec<bool> = layers.iter().map(|&n| n > 0).collect();
    let out = riders
        .iter()
        .map(|&e| water_fill_on(&profile.encoders[e], &mut load, &carried))
        .collect();
    (layers, out, load)
}

/// The LLM's layers per stage for `balance(zb2p(encoders = chains))`: the split that,
/// with the chunks water-filled on it ([`cut_all`]), leaves the busiest rank least
/// busy (then the ranks' loads most even), found by moving one layer at a time
/// between any two stages from the even split. One stage per rank, rank `r` holding
/// stage `r`; at least one layer each. `None` when [`cut_all`] would not chain.
pub(crate) fn chains_split(profile: &Profile, units: &[Unit], ranks: usize) -> Option<Vec<usize>> {
    let n_enc = profile.encoders.len();
    let (carrier, riders) = carrier_and_riders(units, n_enc)?;
    let llm = &profile.llm;
    let layers = llm.layers as usize;
    if ranks == 0 || layers < ranks {
        return None;
    }
    let layer_work = llm.forward + llm.backward + llm.weight;
    let extra = |e: &Option<crate::algebra::profile::Extra>| {
        e.as_ref()
            .map_or(0.0, |x| x.forward + x.backward + x.weight)
    };
    let (first, last) = (extra(&llm.first_stage_extra), extra(&llm.last_stage_extra));
    let score = |split: &[usize]| {
        let mut load: Vec<f64> = split.iter().map(|&n| n as f64 * layer_work).collect();
        load[0] += first;
        load[ranks - 1] += last;
        let (_, _, load) = fill_chains(profile, carrier, &riders, load);
        let max = load.iter().copied().fold(0.0, f64::max);
        let squares: f64 = load.iter().map(|x| x * x).sum();
        (max, squares)
    };
    // The most loaded rank, then the sum of squares, under the one tolerance rule.
    let better = |a: (f64, f64), b: (f64, f64)| {
        crate::ir::compare::Score::span(a.0)
            .with_ends(a.1)
            .beats(&crate::ir::compare::Score::span(b.0).with_ends(b.1))
    };
    let mut split = even_layers(layers, ranks);
    let mut best = score(&split);
    loop {
        let mut improved = false;
        for from in 0..ranks {
            for to in 0..ranks {
                if from == to || split[from] <= 1 {
                    continue;
                }
                split[from] -= 1;
                split[to] += 1;
                let s = score(&split);
                if better(s, best) {
                    best = s;
                    improved = true;
                } else {
                    split[from] += 1;
                    split[to] -= 1;
                }
            }
        }
        if !improved {
            return Some(split);
        }
    }
}
