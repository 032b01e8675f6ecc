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
use crate::algebra::units::{
    chunks_of, encoder_layer_work, even_layers, replace_with_chunks, water_fill, water_fill_on,
};
use crate::ir::plan::UnitId;
use crate::ir::policy::SearchPolicy;
use crate::ir::program::Unit;

/// The units with one encoder cut into chunks (and, for `encoders = chains`, the
/// other encoders feeding the first stage too, riding along).
pub struct Chained {
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
pub fn cut(
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
pub fn cut_all(profile: &Profile, units: &[Unit], ranks: usize) -> Option<Chained> {
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

/// The encoder a chain cuts: the heaviest one feeding the first stage (`units[n_enc]`),
/// the earlier on ties.
fn chained_encoder(units: &[Unit], n_enc: usize) -> Option<usize> {
    heaviest_feeding(units, n_enc, |_| true)
}

/// The heaviest encoder feeding the first stage (`units[n_enc]`) among those `keep`
/// accepts, the earlier on ties.
fn heaviest_feeding(units: &[Unit], n_enc: usize, keep: impl Fn(&Unit) -> bool) -> Option<usize> {
    let first = units.get(n_enc)?;
    (0..n_enc)
        .filter(|&i| first.inputs.contains(&units[i].name) && keep(&units[i]))
        .max_by(|&a, &b| units[a].work().total_cmp(&units[b].work()).then(b.cmp(&a)))
}

/// Each rank's work per micro-batch before encoder `e`'s chunks: its stages, and the
/// other encoders on the first stage's rank.
fn load_before_chunks(units: &[Unit], n_enc: usize, e: usize, ranks: usize) -> Vec<f64> {
    let first_home = units[n_enc].home;
    let mut load = vec![0.0f64; ranks];
    for (i, u) in units.iter().enumerate() {
        if i >= n_enc {
            load[u.home] += u.work();
        } else if i != e {
            load[first_home] += u.work();
        }
    }
    load
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
pub fn chains_split(profile: &Profile, units: &[Unit], ranks: usize) -> Option<Vec<usize>> {
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
    let better = |a: (f64, f64), b: (f64, f64)| {
        a.0 < b.0 * (1.0 - 1e-12) || (a.0 <= b.0 * (1.0 + 1e-12) && a.1 < b.1 * (1.0 - 1e-12))
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

/// A stage split of the LLM and chunk sizes of its chained encoder chosen together
/// (`zb2p(encoders = ramp)`), with the step time the model below predicts for them.
#[derive(Clone, Debug, PartialEq)]
pub struct RampSplit {
    /// Transformer layers of each stage (one stage per rank, in pipeline order).
    pub llm: Vec<usize>,
    /// Encoder layers of each rank's chunk.
    pub chunks: Vec<u32>,
    /// The predicted step time.
    pub floor: f64,
    /// The prediction for where the search started: the units' own split with
    /// water-filled chunks (what `encoders = chain` runs). Never below `floor`.
    pub start: f64,
}

impl RampSplit {
    /// The split as an `llm.layout` string (`E` on the first stage, `L` on the last)
    /// for `v` chunks per rank (1 or 2): with two, each rank's layers are halved
    /// between its chunks (the first gets the odd one), chunk 0 of every rank first,
    /// so the LM head ends the last rank's second chunk.
    pub fn layout(&self, v: usize) -> String {
        if v == 2 {
            let first = self.llm.iter().map(|&l| l.div_ceil(2));
            let second = self.llm.iter().map(|&l| l / 2);
            stage_layout(first.chain(second))
        } else {
            stage_layout(self.llm.iter().copied())
        }
    }

    /// `profile` with its LLM split fixed to this one for `v` chunks per rank (its
    /// `llm.layout` set to [`RampSplit::layout`]).
    pub fn applied(&self, profile: &Profile, v: usize) -> Profile {
        let mut own = profile.clone();
        own.llm.layout = Some(self.layout(v));
        own
    }
}

/// The Megatron layout string of stages with these layer counts, in pipeline order:
/// the embedding on the first, the loss on the last.
pub fn stage_layout(stages: impl Iterator<Item = usize>) -> String {
    let stages: Vec<String> = stages.map(|l| "t".repeat(l)).collect();
    format!("E{}L", stages.join("|"))
}

/// What the ramp model reads from a profile, per micro-batch.
struct RampCosts {
    ranks: usize,
    /// Chunks of the LLM per rank (1, or 2 looped): the first micro-batch's forward
    /// reaches rank `r` through the first chunks of ranks `0..r` only.
    v: usize,
    microbatches: f64,
    /// An LLM layer's `F` and `F + B + W`.
    layer_f: f64,
    layer_work: f64,
    /// A chained-encoder layer's `F` and its work ([`encoder_layer_work`]).
    enc_f: f64,
    enc_work: f64,
    /// Extra `F` and work on the first rank (embedding, other encoders inline) and
    /// on the last (LM head).
    first_f: f64,
    first_work: f64,
    last_f: f64,
    last_work: f64,
    /// One hop of the LLM's hidden state and of a chunk's output.
    hop: f64,
    enc_hop: f64,
}

impl RampCosts {
    /// The step time a chained split would take if nothing but the warm-up ramp
    /// idled: rank `r`'s first LLM forward can start no earlier than `R_r` (micro-batch
    /// 0 through every chunk, then through stages `0..r`); before it, the rank can
    /// only run its chunk's forwards, of the micro-batches the chunks upstream have
    /// passed on by then (they flow at the pace of the slowest upstream chunk). It
    /// predicts rank `r` to end at `R_r - fill_r + work_r`, and the step at the
    /// latest. The cool-down is left out: the `W`s deferred there fill it. This is a
    /// model, not a bound: `zb2p`'s list schedule with asynchronous sends comes within
    /// a few milliseconds of it on Qwen2-VL-7B (`profiles/qwen2vl-7b.toml`).
    fn floor(&self, llm: &[usize], chunks: &[u32]) -> f64 {
        let p = self.ranks;
        let m = self.microbatches;
        let mut ramp = chunks
            .iter()
            .map(|&n| f64::from(n) * self.enc_f)
            .sum::<f64>()
            + chunks.iter().filter(|&&n| n > 0).count().saturating_sub(1) as f64 * self.enc_hop;
        let mut end = 0.0f64;
        for r in 0..p {
            let n = f64::from(chunks[r]);
            let upstream = chunks[r + 1..]
                .iter()
                .map(|&q| f64::from(q) * self.enc_f)
                .fold(0.0, f64::max);
            let ready = if upstream > 0.0 {
                (ramp / upstream).min(m)
            } else {
                m
            };
            let fill = (n * self.enc_f * ready).min(ramp);
            let mut work = llm[r] as f64 * self.layer_work + n * self.enc_work;
            let mut f = llm[r].div_ceil(self.v) as f64 * self.layer_f;
            if r == 0 {
                work += self.first_work;
                f += self.first_f;
            }
            if r + 1 == p {
                work += self.last_work;
                if self.v == 1 {
                    f += self.last_f;
                }
            }
            end = end.max(ramp - fill + m * work);
            ramp += f + self.hop;
        }
        end
    }
}

/// The stage split and chunk sizes for `zb2p(encoders = ramp)`, one stage per rank.
///
/// With the balanced split and water-filled chunks every rank's total work is even,
/// but the middle ranks, whose chunks are small, idle through most of their warm-up
/// ramp: on Qwen2-VL-7B (8 x 32) that idling is what keeps the step 4.8% above the
/// bound even with asynchronous sends. Here the split and the chunks are chosen
/// together to minimise the ramp model's predicted step (`RampCosts::floor`): a
/// local search from the balanced split with water-filled chunks, whose moves shift
/// one LLM layer from one rank to another together with up to a stage's worth of
/// encoder layers back, or one to three encoder layers alone; it takes the best
/// move while one improves the prediction by more than a microsecond. Every stage
/// keeps at least one layer. With `v = 2` (two looped chunks per rank, see
/// [`RampSplit::layout`]) the model counts the first chunks' forwards only on the
/// way to each rank, and every rank but the last keeps two layers. `units` are the
/// one-chunk units either way.
/// Deterministic (the first best move in rank order). `None` when the units have
/// no encoder to chain or the LLM has fewer layers than ranks.
pub fn ramp_split(
    profile: &Profile,
    units: &[Unit],
    ranks: usize,
    microbatches: usize,
    v: usize,
) -> Option<RampSplit> {
    ramp_split_by(
        profile,
        units,
        ranks,
        microbatches,
        v,
        &SearchPolicy::DEFAULT,
    )
}

/// [`ramp_split`] under `policy` (its `ramp_*` knobs).
pub fn ramp_split_by(
    profile: &Profile,
    units: &[Unit],
    ranks: usize,
    microbatches: usize,
    v: usize,
    policy: &SearchPolicy,
) -> Option<RampSplit> {
    let SearchPolicy {
        ramp_trade_slack,
        ramp_max_shift,
        ramp_min_gain,
        ..
    } = *policy;
    let n_enc = profile.encoders.len();
    let e = chained_encoder(units, n_enc)?;
    let llm = &profile.llm;
    if ranks < 2 || (llm.layers as usize) < ranks || units.len() != n_enc + ranks {
        return None;
    }
    let spec = &profile.encoders[e];
    let extra = |x: &Option<crate::algebra::profile::Extra>| {
        x.as_ref().map_or((0.0, 0.0), |x| {
            (x.forward, x.forward + x.backward + x.weight)
        })
    };
    let (ef, ew) = extra(&llm.first_stage_extra);
    let (lf, lw) = extra(&llm.last_stage_extra);
    let others = (0..n_enc).filter(|&i| i != e).map(|i| &units[i]);
    let (of, ow) = others.fold((0.0, 0.0), |(f, w), u| (f + u.cost.f, w + u.work()));
    // The simulator's cost of one transfer (the profile checks the bandwidth > 0).
    let link = profile.comm_model();
    let hop = |bytes: f64| link.map_or(0.0, |c| c.transfer_time(bytes));
    let costs = RampCosts {
        ranks,
        v,
        microbatches: microbatches as f64,
        layer_f: llm.forward,
        layer_work: llm.forward + llm.backward + llm.weight,
        enc_f: spec.forward,
        enc_work: encoder_layer_work(spec),
        first_f: ef + of,
        first_work: ew + ow,
        last_f: lf,
        last_work: lw,
        hop: hop(llm.output),
        enc_hop: hop(spec.output),
    };
    // Start: the stages' layers as built (read back from their work), the chunks
    // water-filled.
    let per_layer = costs.layer_work;
    if per_layer <= 0.0 {
        return None;
    }
    let mut split: Vec<usize> = units[n_enc..]
        .iter()
        .enumerate()
        .map(|(k, u)| {
            let first = if k == 0 { ew } else { 0.0 };
            let last = if k + 1 == ranks { lw } else { 0.0 };
            ((u.work() - first - last) / per_layer).round().max(0.0) as usize
        })
        .collect();
    // Every chunk keeps a layer (the last rank's second may hold the LM head alone).
    let least = |r: usize| if v == 2 && r + 1 < ranks { 2 } else { 1 };
    if split.iter().sum::<usize>() != llm.layers as usize
        || split.iter().enumerate().any(|(r, &l)| l < least(r))
    {
        return None;
    }
    let mut chunks = water_fill(spec, &load_before_chunks(units, n_enc, e, ranks));
    let start = costs.floor(&split, &chunks);
    let mut best = start;
    // Encoder layers worth one LLM layer, and a few more.
    let trade = (per_layer / costs.enc_work.max(1e-9)).ceil() as u32 + ramp_trade_slack;
    loop {
        let mut step: Option<(f64, Vec<usize>, Vec<u32>)> = None;
        let mut consider = |l: Vec<usize>, c: Vec<u32>| {
            let f = costs.floor(&l, &c);
            if f < best - ramp_min_gain && step.as_ref().is_none_or(|s| f < s.0) {
                step = Some((f, l, c));
            }
        };
        for a in 0..ranks {
            for b in (0..ranks).filter(|&b| b != a) {
                if split[a] > least(a) {
                    for k in 0..=trade.min(chunks[b]) {
                        let (mut l, mut c) = (split.clone(), chunks.clone());
                        l[a] -= 1;
                        l[b] += 1;
                        c[b] -= k;
                        c[a] += k;
                        consider(l, c);
                    }
                }
                for k in 1..=ramp_max_shift.min(chunks[a]) {
                    let mut c = chunks.clone();
                    c[a] -= k;
                    c[b] += k;
                    consider(split.clone(), c);
                }
            }
        }
        let Some((f, l, c)) = step else { break };
        (best, split, chunks) = (f, l, c);
    }
    Some(RampSplit {
        llm: split,
        chunks,
        floor: best,
        start,
    })
}
