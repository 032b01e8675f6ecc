//! The model: a vision encoder unit and the LLM's stage units, all parameters in one
//! object, driven unit by unit through [`mpipe_runtime::model::Model`].

use std::ops::Range;

use mpipe_runtime::model::{Model, Tensor};
use mpipe_runtime::UnitId;

use crate::block::{Block, BlockCache, Wgrad};
use crate::config::Config;
use crate::data::Sample;
use crate::float::Float;
use crate::ops::{cross_entropy, Init, LayerNorm, Linear, LnCache, ParamLayout, Slot};
use crate::rng::Rng;

/// The vision encoder: patch embedding + positions, non-causal blocks, final norm,
/// projector to the LLM's width.
#[derive(Clone, Debug)]
struct Vision {
    patch: Linear,
    pos: Slot,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    proj: Linear,
}

/// Token and position embeddings of the first LLM stage.
#[derive(Clone, Debug)]
struct Embed {
    tok: Slot,
    pos: Slot,
}

/// Final norm and LM head of the last LLM stage.
#[derive(Clone, Debug)]
struct Head {
    ln_f: LayerNorm,
    out: Linear,
}

/// One LLM stage: the embedding if first, its blocks, the head if last.
#[derive(Clone, Debug)]
struct Stage {
    embed: Option<Embed>,
    blocks: Vec<Block>,
    head: Option<Head>,
}

/// What a unit keeps from its forward for its backward (and, after a split
/// `backward_input`, the gradients its `backward_weight` needs).
#[derive(Debug)]
pub enum Stash<F = f32> {
    Vision(VisionStash<F>),
    Llm(LlmStash<F>),
}

/// The vision encoder's stash.
#[derive(Debug)]
pub struct VisionStash<F> {
    patches: Vec<F>,
    blocks: Vec<BlockCache<F>>,
    ln_f: LnCache<F>,
    hf: Vec<F>,
    /// After a split backward: gradients of the embedding output, of the final
    /// norm's output and of the projector's output.
    dys: Option<[Vec<F>; 3]>,
}

/// An LLM stage's stash.
#[derive(Debug)]
pub struct LlmStash<F> {
    /// First stage: the micro-batch's caption tokens.
    tokens: Option<Vec<u32>>,
    blocks: Vec<BlockCache<F>>,
    /// Last stage: the final norm, its output, and the loss's logit gradient.
    head: Option<(LnCache<F>, Vec<F>, Vec<F>)>,
    /// After a split backward: the gradients of the embedding output (first
    /// stage) and of the final norm's output (last stage).
    dx0: Option<Vec<F>>,
    dh: Option<Vec<F>>,
}

/// A multimodal LLM split into units `vision, llm.0, .., llm.{S-1}` (unit ids `0 ..
/// S`), with the parameters and gradient accumulators of every unit, the current
/// step's micro-batches and their losses.
///
/// The element type `F` is `f32` (the [`Model`] the runtime drives) or `f64` (the
/// same code, for gradient checks; see [`Mllm::new_as`]). The inherent `*_unit`
/// methods are the precision-generic versions of the [`Model`] methods.
#[derive(Clone, Debug)]
pub struct Mllm<F = f32> {
    cfg: Config,
    /// Per unit: the named parameter tensors and their ranges in the flat vector.
    tensors: Vec<Vec<(String, Range<usize>)>>,
    vision: Vision,
    stages: Vec<Stage>,
    params: Vec<Vec<F>>,
    grads: Vec<Vec<F>>,
    batch: Vec<Sample>,
    losses: Vec<Option<F>>,
    accuracies: Vec<Option<f32>>,
}

fn reborrow<'a, F>(w: &'a mut Wgrad<'_, F>) -> Wgrad<'a, F> {
    match w {
        Wgrad::Now(g) => Wgrad::Now(g),
        Wgrad::Later => Wgrad::Later,
    }
}

/// Add the rows of `dx` (sequences of `len` rows of width `d`) into `pos` by
/// position.
fn add_positions<F: Float>(pos: &mut [F], dx: &[F], len: usize, d: usize) {
    for seq in dx.chunks_exact(len * d) {
        for (a, &g) in pos.iter_mut().zip(seq) {
            *a += g;
        }
    }
}

impl Mllm<f32> {
    /// A model with parameters drawn from `cfg.seed`.
    ///
    /// # Panics
    /// If `cfg` is inconsistent (e.g. fewer LLM layers than stages).
    pub fn new(cfg: Config) -> Mllm {
        Mllm::new_as(cfg)
    }
}

impl<F: Float> Mllm<F> {
    /// A model of element type `F` with parameters drawn from `cfg.seed`: the same
    /// initial values whatever `F` (they are drawn as `f32`).
    ///
    /// # Panics
    /// If `cfg` is inconsistent (e.g. fewer LLM layers than stages).
    pub fn new_as(cfg: Config) -> Mllm<F> {
        cfg.validate();
        let mut layouts = Vec::new();

        let mut pl = ParamLayout::default();
        let dv = cfg.vision_dim;
        let vision = Vision {
            patch: Linear::new(&mut pl, "patch", cfg.patch_dim(), dv, None),
            pos: pl.alloc("pos".into(), cfg.patches() * dv, Init::Normal(0.2)),
            blocks: (0..cfg.vision_layers)
                .map(|i| {
                    let name = format!("block{i}");
                    Block::new(
                        &mut pl,
                        &name,
                        dv,
                        cfg.vision_mlp,
                        cfg.vision_heads,
                        false,
                        cfg.vision_layers,
                    )
                })
                .collect(),
            ln_f: LayerNorm::new(&mut pl, "ln_f", dv),
            proj: Linear::new(&mut pl, "proj", dv, cfg.dim, None),
        };
        layouts.push(pl);

        let per_stage = cfg.stage_layers();
        let mut stages = Vec::new();
        for (k, &n) in per_stage.iter().enumerate() {
            let mut pl = ParamLayout::default();
            let d = cfg.dim;
            let embed = (k == 0).then(|| Embed {
                tok: pl.alloc("tok".into(), cfg.vocab() * d, Init::Normal(1.0)),
                pos: pl.alloc("pos".into(), cfg.seq_len() * d, Init::Normal(0.2)),
            });
            // Blocks are named by their layer index in the whole LLM.
            let first: usize = per_stage[..k].iter().sum();
            let blocks = (first..first + n)
                .map(|i| {
                    Block::new(
                        &mut pl,
                        &format!("block{i}"),
                        d,
                        cfg.mlp,
                        cfg.heads,
                        true,
                        cfg.layers,
                    )
                })
                .collect();
            let head = (k + 1 == cfg.stages).then(|| Head {
                ln_f: LayerNorm::new(&mut pl, "ln_f", d),
                out: Linear::new(&mut pl, "head", d, cfg.vocab(), Some(0.02)),
            });
            stages.push(Stage {
                embed,
                blocks,
                head,
            });
            layouts.push(pl);
        }

        let params: Vec<Vec<F>> = layouts
            .iter()
            .enumerate()
            .map(|(u, pl)| pl.init(&mut Rng::derive(cfg.seed, &[u as u64])))
            .collect();
        let grads = params.iter().map(|p| vec![F::ZERO; p.len()]).collect();
        let tensors = layouts
            .iter()
            .map(|pl| {
                pl.tensors()
                    .into_iter()
                    .map(|(n, s)| (n, s.off..s.off + s.len))
                    .collect()
            })
            .collect();
        Mllm {
            cfg,
            tensors,
            vision,
            stages,
            params,
            grads,
            batch: Vec::new(),
            losses: Vec::new(),
            accuracies: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Number of units (the encoder and the LLM stages).
    pub fn units(&self) -> usize {
        self.params.len()
    }

    /// Whether `unit`'s parameters are trained.
    pub fn is_trainable(&self, unit: usize) -> bool {
        unit != 0 || self.cfg.trainable_encoder
    }

    /// `unit`'s parameter tensors (e.g. `block2.fc1.w`, `tok`, `head.b`) and their
    /// ranges in its flat parameter vector.
    pub fn tensors(&self, unit: usize) -> &[(String, Range<usize>)] {
        &self.tensors[unit]
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.params.iter().map(Vec::len).sum()
    }

    /// Set the current step's micro-batches (and forget the previous losses).
    pub fn set_batch(&mut self, samples: &[Sample]) {
        self.batch = samples.to_vec();
        self.losses = vec![None; samples.len()];
        self.accuracies = vec![None; samples.len()];
    }

    /// Zero every unit's gradient accumulators.
    pub fn zero_grads(&mut self) {
        for g in &mut self.grads {
            g.fill(F::ZERO);
        }
    }

    /// Every unit's accumulated gradients.
    pub fn all_grads(&self) -> &[Vec<F>] {
        &self.grads
    }

    /// `unit`'s parameters.
    pub fn unit_params(&self, unit: usize) -> &[F] {
        &self.params[unit]
    }

    /// `unit`'s parameters, to change.
    pub fn unit_params_mut(&mut self, unit: usize) -> &mut [F] {
        &mut self.params[unit]
    }

    /// `unit`'s accumulated gradients.
    pub fn unit_grads(&self, unit: usize) -> &[F] {
        &self.grads[unit]
    }

    /// `unit`'s gradient accumulators, to change.
    pub fn unit_grads_mut(&mut self, unit: usize) -> &mut [F] {
        &mut self.grads[unit]
    }

    /// The loss of micro-batch `mb`, known after the last unit's forward.
    pub fn microbatch_loss(&self, mb: usize) -> Option<F> {
        self.losses.get(mb).copied().flatten()
    }

    /// [`Model::forward`], in `F`.
    pub fn forward_unit(&mut self, unit: usize, mb: usize, inputs: &[&[F]]) -> (Vec<F>, Stash<F>) {
        match unit {
            0 => {
                assert!(inputs.is_empty(), "the vision encoder has no input units");
                self.vision_forward(mb)
            }
            u => self.stage_forward(u - 1, mb, inputs),
        }
    }

    /// [`Model::backward_input`], in `F`.
    pub fn backward_input_unit(
        &mut self,
        unit: usize,
        mb: usize,
        stash: &mut Stash<F>,
        grad_out: Option<&[F]>,
    ) -> Vec<Vec<F>> {
        let _ = mb;
        let p = &self.params[unit];
        match stash {
            Stash::Vision(s) => {
                let dy = grad_out.expect("vision needs its output's gradient");
                vision_backward_input(&self.vision, p, s, dy, Wgrad::Later);
                Vec::new()
            }
            Stash::Llm(s) => stage_backward_input(
                &self.stages[unit - 1],
                &self.cfg,
                p,
                s,
                grad_out,
                Wgrad::Later,
            ),
        }
    }

    /// [`Model::backward_weight`], in `F`.
    pub fn backward_weight_unit(&mut self, unit: usize, mb: usize, stash: Stash<F>) {
        let _ = mb;
        let g = &mut self.grads[unit];
        match &stash {
            Stash::Vision(s) => vision_backward_weight(&self.vision, g, s),
            Stash::Llm(s) => stage_backward_weight(&self.stages[unit - 1], &self.cfg, g, s),
        }
    }

    /// Teacher-forced next-token accuracy on micro-batch `mb`'s caption, known
    /// after the last unit's forward.
    pub fn accuracy(&self, mb: usize) -> Option<f32> {
        self.accuracies.get(mb).copied().flatten()
    }

    /// Fused backward: `backward_input` and `backward_weight` in one pass, each
    /// layer's weight gradients added as soon as its output gradient is known.
    pub fn backward(
        &mut self,
        unit: usize,
        mb: usize,
        stash: &mut Stash<F>,
        grad_out: Option<&[F]>,
    ) -> Vec<Vec<F>> {
        let _ = mb;
        let u = unit;
        let (p, g) = (&self.params[u], &mut self.grads[u]);
        match stash {
            Stash::Vision(s) => {
                let dy = grad_out.expect("vision needs its output's gradient");
                vision_backward_input(&self.vision, p, s, dy, Wgrad::Now(g));
                Vec::new()
            }
            Stash::Llm(s) => stage_backward_input(
                &self.stages[u - 1],
                &self.cfg,
                p,
                s,
                grad_out,
                Wgrad::Now(g),
            ),
        }
    }

    /// The reference, unpipelined step: for every micro-batch, the forward of all
    /// units in order, then the fused backward of all in reverse (the encoder's
    /// only when trainable). Zeroes the gradients first. Returns the mean loss over
    /// the micro-batches and every unit's gradients: those of the **sum** of the
    /// micro-batches' losses, as a pipelined run accumulates them.
    pub fn reference_step(&mut self, samples: &[Sample]) -> (F, Vec<Vec<F>>) {
        self.set_batch(samples);
        self.zero_grads();
        let n = self.units();
        let mut total = 0.0f64;
        for mb in 0..samples.len() {
            let mut stashes = Vec::with_capacity(n);
            let mut act: Option<Vec<F>> = None;
            for u in 0..n {
                let inputs: Vec<&[F]> = act.iter().map(Vec::as_slice).collect();
                let (out, st) = self.forward_unit(u, mb, &inputs);
                stashes.push(st);
                act = Some(out);
            }
            total += self.losses[mb].expect("the last unit sets the loss").f64();
            let mut grad: Option<Vec<F>> = None;
            for u in (0..n).rev() {
                let mut st = stashes.pop().expect("one stash per unit");
                if !self.is_trainable(u) {
                    break;
                }
                grad = self.backward(u, mb, &mut st, grad.as_deref()).pop();
            }
        }
        (
            F::of(total / samples.len().max(1) as f64),
            self.grads.clone(),
        )
    }

    /// Forward only: the mean loss over `samples` (and their accuracies, see
    /// [`Mllm::accuracy`]).
    pub fn eval_loss(&mut self, samples: &[Sample]) -> F {
        self.set_batch(samples);
        let mut total = 0.0f64;
        for mb in 0..samples.len() {
            let mut act: Option<Vec<F>> = None;
            for u in 0..self.units() {
                let inputs: Vec<&[F]> = act.iter().map(Vec::as_slice).collect();
                act = Some(self.forward_unit(u, mb, &inputs).0);
            }
            total += self.losses[mb].expect("the last unit sets the loss").f64();
        }
        F::of(total / samples.len().max(1) as f64)
    }

    /// Elements of `unit`'s forward output for every micro-batch: image tokens
    /// (`microbatch_size x patches x dim`) for the vision encoder, hidden states
    /// (`microbatch_size x seq_len x dim`) for a stage, the loss (1) for the last.
    pub fn output_len_of(&self, unit: usize) -> usize {
        let cfg = &self.cfg;
        let nb = cfg.microbatch_size;
        if unit == 0 {
            nb * cfg.patches() * cfg.dim
        } else if unit == cfg.units() - 1 {
            1
        } else {
            nb * cfg.seq_len() * cfg.dim
        }
    }

    fn vision_forward(&self, mb: usize) -> (Vec<F>, Stash<F>) {
        let (cfg, v, p) = (&self.cfg, &self.vision, &self.params[0]);
        let sample = &self.batch[mb];
        let (nb, np, dv) = (sample.size, cfg.patches(), cfg.vision_dim);
        let patches: Vec<F> = sample.images.iter().map(|&x| F::of(x as f64)).collect();
        let mut x = v.patch.forward(p, &patches);
        for seq in x.chunks_exact_mut(np * dv) {
            for (a, &b) in seq.iter_mut().zip(v.pos.of(p)) {
                *a += b;
            }
        }
        let mut blocks = Vec::with_capacity(v.blocks.len());
        for b in &v.blocks {
            let (y, c) = b.forward(p, &x, nb, np);
            x = y;
            blocks.push(c);
        }
        let (hf, ln_f) = v.ln_f.forward(p, &x);
        let out = v.proj.forward(p, &hf);
        let stash = VisionStash {
            patches,
            blocks,
            ln_f,
            hf,
            dys: None,
        };
        (out, Stash::Vision(stash))
    }

    fn stage_forward(&mut self, k: usize, mb: usize, inputs: &[&[F]]) -> (Vec<F>, Stash<F>) {
        let (cfg, st, p) = (&self.cfg, &self.stages[k], &self.params[k + 1]);
        let sample = &self.batch[mb];
        let (nb, d, np, t, l) = (
            sample.size,
            cfg.dim,
            cfg.patches(),
            cfg.caption_len(),
            cfg.seq_len(),
        );
        assert_eq!(inputs.len(), 1, "llm.{k} takes one input");
        let input = inputs[0];
        let mut tokens = None;
        let mut x = if let Some(e) = &st.embed {
            assert_eq!(
                input.len(),
                nb * np * d,
                "llm.0: image tokens of the wrong size"
            );
            let (tok, pos) = (e.tok.of(p), e.pos.of(p));
            let mut x = Vec::with_capacity(nb * l * d);
            for b in 0..nb {
                x.extend_from_slice(&input[b * np * d..(b + 1) * np * d]);
                for &w in &sample.tokens[b * t..(b + 1) * t] {
                    x.extend_from_slice(&tok[w as usize * d..(w as usize + 1) * d]);
                }
                let seq = &mut x[b * l * d..];
                for (a, &q) in seq.iter_mut().zip(pos) {
                    *a += q;
                }
            }
            tokens = Some(sample.tokens.clone());
            x
        } else {
            assert_eq!(input.len(), nb * l * d, "llm.{k}: input of the wrong size");
            input.to_vec()
        };
        let mut blocks = Vec::with_capacity(st.blocks.len());
        for b in &st.blocks {
            let (y, c) = b.forward(p, &x, nb, l);
            x = y;
            blocks.push(c);
        }
        let mut head = None;
        if let Some(h) = &st.head {
            let (hf, ln) = h.ln_f.forward(p, &x);
            let logits = h.out.forward(p, &hf);
            let vocab = cfg.vocab();
            // Position `np + i` (caption token i) predicts caption token i + 1.
            let targets: Vec<Option<u32>> = (0..nb * l)
                .map(|r| {
                    let (b, j) = (r / l, r % l);
                    (j >= np && j + 1 < l).then(|| sample.tokens[b * t + j - np + 1])
                })
                .collect();
            let (loss, dlogits) = cross_entropy(&logits, vocab, &targets);
            let (mut hit, mut count) = (0usize, 0usize);
            for (row, tg) in logits.chunks_exact(vocab).zip(&targets) {
                if let Some(tg) = tg {
                    let best = (0..vocab).fold(0, |a, j| if row[j] > row[a] { j } else { a });
                    hit += usize::from(best == *tg as usize);
                    count += 1;
                }
            }
            self.losses[mb] = Some(F::of(loss));
            self.accuracies[mb] = Some(hit as f32 / count.max(1) as f32);
            head = Some((ln, hf, dlogits));
            x = vec![F::of(loss)];
        }
        let stash = LlmStash {
            tokens,
            blocks,
            head,
            dx0: None,
            dh: None,
        };
        (x, Stash::Llm(stash))
    }
}

fn vision_backward_input<F: Float>(
    v: &Vision,
    p: &[F],
    s: &mut VisionStash<F>,
    dy: &[F],
    mut w: Wgrad<'_, F>,
) {
    let dhf = v.proj.backward_input(p, dy);
    if let Some(g) = w.now() {
        v.proj.backward_weight(g, &s.hf, dy);
    }
    let mut dx = v.ln_f.backward_input(p, &s.ln_f, &dhf);
    if let Some(g) = w.now() {
        v.ln_f.backward_weight(g, &s.ln_f, &dhf);
    }
    for (b, c) in v.blocks.iter().zip(&mut s.blocks).rev() {
        dx = b.backward_input(p, c, &dx, reborrow(&mut w));
    }
    match w {
        Wgrad::Now(g) => vision_embed_weight(v, g, &s.patches, &dx),
        Wgrad::Later => s.dys = Some([dx, dhf, dy.to_vec()]),
    }
}

fn vision_embed_weight<F: Float>(v: &Vision, g: &mut [F], patches: &[F], dx0: &[F]) {
    v.patch.backward_weight(g, patches, dx0);
    add_positions(v.pos.of_mut(g), dx0, v.pos.len / v.patch.dout, v.patch.dout);
}

fn vision_backward_weight<F: Float>(v: &Vision, g: &mut [F], s: &VisionStash<F>) {
    let [dx0, dhf, dy] = s
        .dys
        .as_ref()
        .expect("backward_weight before backward_input");
    v.proj.backward_weight(g, &s.hf, dy);
    v.ln_f.backward_weight(g, &s.ln_f, dhf);
    for (b, c) in v.blocks.iter().zip(&s.blocks).rev() {
        b.backward_weight(g, c);
    }
    vision_embed_weight(v, g, &s.patches, dx0);
}

fn stage_backward_input<F: Float>(
    st: &Stage,
    cfg: &Config,
    p: &[F],
    s: &mut LlmStash<F>,
    grad_out: Option<&[F]>,
    mut w: Wgrad<'_, F>,
) -> Vec<Vec<F>> {
    let mut dx = if let (Some(h), Some((ln, hf, dlogits))) = (&st.head, &mut s.head) {
        // The output is the loss itself: its gradient is 1 unless one is given.
        if let Some(g) = grad_out {
            let scale = g[0];
            dlogits.iter_mut().for_each(|x| *x *= scale);
        }
        let dh = h.out.backward_input(p, dlogits);
        if let Some(g) = w.now() {
            h.out.backward_weight(g, hf, dlogits);
        }
        let dx = h.ln_f.backward_input(p, ln, &dh);
        match w.now() {
            Some(g) => h.ln_f.backward_weight(g, ln, &dh),
            None => s.dh = Some(dh),
        }
        dx
    } else {
        grad_out
            .expect("a non-last stage needs its output's gradient")
            .to_vec()
    };
    for (b, c) in st.blocks.iter().zip(&mut s.blocks).rev() {
        dx = b.backward_input(p, c, &dx, reborrow(&mut w));
    }
    if st.embed.is_none() {
        return vec![dx];
    }
    let (d, np, l) = (cfg.dim, cfg.patches(), cfg.seq_len());
    let dimg: Vec<F> = dx
        .chunks_exact(l * d)
        .flat_map(|seq| seq[..np * d].iter().copied())
        .collect();
    match w {
        Wgrad::Now(g) => embed_weight(st, cfg, g, s, &dx),
        Wgrad::Later => s.dx0 = Some(dx),
    }
    vec![dimg]
}

fn embed_weight<F: Float>(st: &Stage, cfg: &Config, g: &mut [F], s: &LlmStash<F>, dx0: &[F]) {
    let e = st.embed.as_ref().expect("first stage");
    let (d, np, t, l) = (cfg.dim, cfg.patches(), cfg.caption_len(), cfg.seq_len());
    add_positions(e.pos.of_mut(g), dx0, l, d);
    let tokens = s.tokens.as_ref().expect("first stage keeps its tokens");
    let gt = e.tok.of_mut(g);
    for (seq, toks) in dx0.chunks_exact(l * d).zip(tokens.chunks_exact(t)) {
        for (i, &w) in toks.iter().enumerate() {
            let row = &seq[(np + i) * d..(np + i + 1) * d];
            for (a, &x) in gt[w as usize * d..(w as usize + 1) * d].iter_mut().zip(row) {
                *a += x;
            }
        }
    }
}

fn stage_backward_weight<F: Float>(st: &Stage, cfg: &Config, g: &mut [F], s: &LlmStash<F>) {
    if let (Some(h), Some((ln, hf, dlogits))) = (&st.head, &s.head) {
        h.out.backward_weight(g, hf, dlogits);
        let dh =
            s.dh.as_ref()
                .expect("backward_weight before backward_input");
        h.ln_f.backward_weight(g, ln, dh);
    }
    for (b, c) in st.blocks.iter().zip(&s.blocks).rev() {
        b.backward_weight(g, c);
    }
    if st.embed.is_some() {
        let dx0 = s
            .dx0
            .as_ref()
            .expect("backward_weight before backward_input");
        embed_weight(st, cfg, g, s, dx0);
    }
}

impl Model for Mllm<f32> {
    type Stash = Stash<f32>;

    fn output_len(&self, unit: UnitId) -> usize {
        self.output_len_of(unit as usize)
    }

    fn forward(&mut self, unit: UnitId, mb: usize, inputs: &[&Tensor]) -> (Tensor, Stash) {
        let inputs: Vec<&[f32]> = inputs.iter().map(|t| t.as_slice()).collect();
        self.forward_unit(unit as usize, mb, &inputs)
    }

    fn backward_input(
        &mut self,
        unit: UnitId,
        mb: usize,
        stash: &mut Stash,
        grad_out: Option<&Tensor>,
    ) -> Vec<Tensor> {
        self.backward_input_unit(unit as usize, mb, stash, grad_out.map(Vec::as_slice))
    }

    fn backward_weight(&mut self, unit: UnitId, mb: usize, stash: Stash) {
        self.backward_weight_unit(unit as usize, mb, stash);
    }

    fn loss(&self, mb: usize) -> Option<f32> {
        self.microbatch_loss(mb)
    }

    fn params(&self, unit: UnitId) -> &[f32] {
        &self.params[unit as usize]
    }

    fn params_mut(&mut self, unit: UnitId) -> &mut [f32] {
        &mut self.params[unit as usize]
    }

    fn grads(&self, unit: UnitId) -> &[f32] {
        &self.grads[unit as usize]
    }

    fn grads_mut(&mut self, unit: UnitId) -> &mut [f32] {
        &mut self.grads[unit as usize]
    }
}
