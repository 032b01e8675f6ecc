//! The ramp split (`zb2p(encoders = ramp)`): the LLM's stage split and its chained
//! encoder's chunk sizes chosen together against a model of the pipeline's ramp.
//! Its own module because two floors read it: the generators build the schedule
//! over it, and the bound (`judge::bound`) counts it among the splits every
//! schedule of a profile is read against.

use crate::algebra::profile::Profile;
use crate::algebra::units::{encoder_layer_work, water_fill};
use crate::ir::policy::SearchPolicy;
use crate::ir::program::Unit;

/// The encoder a chain cuts: the heaviest one feeding the first stage (`units[n_enc]`),
/// the earlier on ties.
pub(crate) fn chained_encoder(units: &[Unit], n_enc: usize) -> Option<usize> {
    heaviest_feeding(units, n_enc, |_| true)
}

/// The heaviest encoder feeding the first stage (`units[n_enc]`) among those `keep`
/// accepts, the earlier on ties.
pub(crate) fn heaviest_feeding(
    units: &[Unit],
    n_enc: usize,
    keep: impl Fn(&Unit) -> bool,
) -> Option<usize> {
    let first = units.get(n_enc)?;
    (0..n_enc)
        .filter(|&i| first.inputs.contains(&units[i].name) && keep(&units[i]))
        .max_by(|&a, &b| units[a].work().total_cmp(&units[b].work()).then(b.cmp(&a)))
}

/// Each rank's work per micro-batch before encoder `e`'s chunks: its stages, and the
/// other encoders on the first stage's rank.
pub(crate) fn load_before_chunks(units: &[Unit], n_enc: usize, e: usize, ranks: usize) -> Vec<f64> {
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
    /// Rank `r`'s chunk layers, its first forward's time and its work per
    /// micro-batch, under the split `llm` and chunks `chunks`.
    fn rank(&self, llm: &[usize], chunks: &[u32], r: usize) -> (f64, f64, f64) {
        let n = f64::from(chunks[r]);
        let mut work = llm[r] as f64 * self.layer_work + n * self.enc_work;
        let mut f = llm[r].div_ceil(self.v) as f64 * self.layer_f;
        if r == 0 {
            work += self.first_work;
            f += self.first_f;
        }
        if r + 1 == self.ranks {
            work += self.last_work;
            if self.v == 1 {
                f += self.last_f;
            }
        }
        (n, f, work)
    }

    /// Rank `r`'s work over the step, `m * work_r`: [`RampCosts::floor_in`]
    /// predicts rank `r` to end no earlier (its idle before the first forward is
    /// never negative), so the floor is at least the largest of them.
    fn busy(&self, llm: &[usize], chunks: &[u32], r: usize) -> f64 {
        self.microbatches * self.rank(llm, chunks, r).2
    }

    fn floor(&self, llm: &[usize], chunks: &[u32]) -> f64 {
        self.floor_in(llm, chunks, f64::INFINITY, &mut Vec::new())
    }

    /// [`RampCosts::floor`] where it is below `cutoff`; else some figure at least
    /// `cutoff` (a search comparing moves with its best needs no more). `ramps` is
    /// its scratch (its contents are overwritten): a search evaluating thousands of
    /// moves allocates nothing per move. The ranks are read last first, where the
    /// ramp is longest, so a move that cannot win is mostly dismissed after a few.
    fn floor_in(&self, llm: &[usize], chunks: &[u32], cutoff: f64, ramps: &mut Vec<f64>) -> f64 {
        let p = self.ranks;
        let m = self.microbatches;
        let mut ramp = chunks
            .iter()
            .map(|&n| f64::from(n) * self.enc_f)
            .sum::<f64>()
            + chunks.iter().filter(|&&n| n > 0).count().saturating_sub(1) as f64 * self.enc_hop;
        // Each rank's ramp (`R_r`, summed from the first rank on), and its first
        // forward's time and its work.
        let rank = |r: usize| self.rank(llm, chunks, r);
        ramps.clear();
        for r in 0..p {
            ramps.push(ramp);
            ramp += rank(r).1 + self.hop;
        }
        let mut end = 0.0f64;
        // `upstream`: the largest chunk time from rank `r + 1` on (0 if none).
        let mut upstream = 0.0f64;
        for r in (0..p).rev() {
            let (n, _, work) = rank(r);
            let ramp = ramps[r];
            let ready = if upstream > 0.0 {
                (ramp / upstream).min(m)
            } else {
                m
            };
            let fill = (n * self.enc_f * ready).min(ramp);
            end = end.max(ramp - fill + m * work);
            if end >= cutoff {
                return end;
            }
            upstream = upstream.max(n * self.enc_f);
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
    ramp_split_pruned(profile, units, ranks, microbatches, v, policy, true)
}

/// [`ramp_split_by`], dismissing the moves whose floor is provably too high
/// without evaluating them where `prune` (the same split either way: a test
/// compares the two).
fn ramp_split_pruned(
    profile: &Profile,
    units: &[Unit],
    ranks: usize,
    microbatches: usize,
    v: usize,
    policy: &SearchPolicy,
    prune: bool,
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
    // (An encoder whose layers cost nothing is worth any number of them.)
    let worth = if costs.enc_work > 0.0 {
        (per_layer / costs.enc_work).ceil() as u32
    } else {
        u32::MAX
    };
    let trade = worth.saturating_add(ramp_trade_slack);
    // Each move is made in place, evaluated and undone (no copy of the split per
    // move); the best move of a round is remembered as what it changes.
    let mut after = Vec::new();
    let mut busy = vec![0.0; ranks];
    loop {
        // (floor, from rank, to rank, LLM layers moved, encoder layers moved back).
        let mut step: Option<(f64, usize, usize, usize, u32)> = None;
        // Each rank's work over the step, and the three busiest ranks: a move
        // changes two ranks' work only, so the busiest of the others is among the
        // three, and a move whose floor is provably not below the cutoff
        // ([`RampCosts::busy`]) is dismissed without evaluating it (the same moves
        // are taken: such a move could not be).
        let mut top: [(f64, usize); 3] = [(f64::NEG_INFINITY, usize::MAX); 3];
        for (r, b) in busy.iter_mut().enumerate() {
            *b = costs.busy(&split, &chunks, r);
            if let Some(at) = top.iter().position(|t| *b > t.0) {
                top.copy_within(at..2, at + 1);
                top[at] = (*b, r);
            }
        }
        let busiest_but = |a: usize, b: usize| {
            top.iter()
                .find(|t| t.1 != a && t.1 != b)
                .map_or(f64::NEG_INFINITY, |t| t.0)
        };
        for a in 0..ranks {
            for b in (0..ranks).filter(|&b| b != a) {
                let others = busiest_but(a, b);
                let mut consider =
                    |split: &mut [usize], chunks: &mut [u32], layers: usize, k: u32| {
                        // One LLM layer from `a` to `b` with `k` encoder layers back,
                        // or (`layers == 0`) `k` encoder layers from `a` to `b`.
                        let (ka, kb) = if layers == 0 { (a, b) } else { (b, a) };
                        split[a] -= layers;
                        split[b] += layers;
                        chunks[ka] -= k;
                        chunks[kb] += k;
                        // Only a move below both figures can be taken.
                        let cutoff = step.as_ref().map_or(f64::INFINITY, |s| s.0);
                        let cutoff = cutoff.min(best * (1.0 - ramp_min_gain));
                        let at_least = others
                            .max(costs.busy(split, chunks, a))
                            .max(costs.busy(split, chunks, b));
                        let f = if prune && at_least >= cutoff {
                            at_least
                        } else {
                            costs.floor_in(split, chunks, cutoff, &mut after)
                        };
                        split[a] += layers;
                        split[b] -= layers;
                        chunks[ka] += k;
                        chunks[kb] -= k;
                        if f < best * (1.0 - ramp_min_gain) && step.as_ref().is_none_or(|s| f < s.0)
                        {
                            step = Some((f, a, b, layers, k));
                        }
                    };
                if split[a] > least(a) {
                    for k in 0..=trade.min(chunks[b]) {
                        consider(&mut split, &mut chunks, 1, k);
                    }
                }
                for k in 1..=ramp_max_shift.min(chunks[a]) {
                    consider(&mut split, &mut chunks, 0, k);
                }
            }
        }
        let Some((f, a, b, layers, k)) = step else {
            break;
        };
        let (ka, kb) = if layers == 0 { (a, b) } else { (b, a) };
        split[a] -= layers;
        split[b] += layers;
        chunks[ka] -= k;
        chunks[kb] += k;
        best = f;
    }
    Some(RampSplit {
        llm: split,
        chunks,
        floor: best,
        start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::units::build_units;
    use crate::ir::plan::Layout;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Dismissing the moves whose floor is provably too high chooses the same
        /// split, bit for bit, as evaluating every move.
        #[test]
        fn pruned_search_chooses_the_same_split(
            enc_layers in 1u32..48, heavy in 0.02f64..2.0, trainable: bool,
            llm_layers in 8u32..80, ranks in 2usize..12, per_rank in 1usize..6,
            v in 1usize..=2, extra in 0.0f64..3.0, link: bool,
        ) {
            let text = format!(
                "[[encoder]]\nname = \"vision\"\nlayers = {enc_layers}\nforward = {heavy}\n\
                 backward = {heavy}\nweight = {heavy}\nactivation = 0.2\nparams = 1.0\n\
                 trainable = {trainable}\noutput = 0.01\n\n\
                 [llm]\nlayers = {llm_layers}\nforward = 1.0\nbackward = 1.5\nweight = 0.5\n\
                 activation = 1.0\nparams = 0.25\noutput = 0.02\n\
                 first_stage_extra = {{ forward = {extra}, backward = {extra}, weight = 0.0 }}\n\
                 last_stage_extra = {{ forward = {extra}, backward = {extra}, weight = {extra} }}\n{}",
                if link { "\n[link]\nbandwidth = 50.0\nlatency = 0.01\n" } else { "" }
            );
            let profile = Profile::from_toml_str(&text).expect("profile parses");
            let Ok(units) = build_units(&profile, ranks, 1, Layout::Looped) else {
                return Ok(());
            };
            let m = ranks * per_rank;
            let policy = SearchPolicy::DEFAULT;
            let pruned = ramp_split_pruned(&profile, &units, ranks, m, v, &policy, true);
            let full = ramp_split_pruned(&profile, &units, ranks, m, v, &policy, false);
            prop_assert_eq!(pruned, full);
        }
    }
}
