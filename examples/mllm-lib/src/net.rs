//! The model's units, written once against [`Ops`]: the layout of each unit's
//! parameters ([`Net`]) and the forward, input-gradient and weight-gradient passes of
//! a unit, whatever the tensors are (host vectors for [`crate::Mllm`], device tensors
//! for the `ascend` feature's device model).

use std::fmt;

use crate::block::{Block, BlockCache, LnCache, Wgrad};
use crate::config::Config;
use crate::data::Sample;
use crate::ops::{Init, LayerNorm, Linear, ParamLayout, Slot};
use crate::tensor_ops::{Family, Ops};

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

/// The layers of every unit and where their parameters are in the unit's flat
/// parameter vector.
#[derive(Clone, Debug)]
pub struct Net {
    cfg: Config,
    vision: Vision,
    stages: Vec<Stage>,
}

/// What a unit keeps from its forward for its backward (and, after a split
/// `backward_input`, the gradients its `backward_weight` needs).
pub enum UnitStash<Y: Family> {
    Vision(VisionStash<Y>),
    Llm(LlmStash<Y>),
}

impl<Y: Family> fmt::Debug for UnitStash<Y> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnitStash::Vision(s) => f
                .debug_struct("VisionStash")
                .field("blocks", &s.blocks)
                .field("split", &s.dys.is_some())
                .finish_non_exhaustive(),
            UnitStash::Llm(s) => f
                .debug_struct("LlmStash")
                .field("blocks", &s.blocks)
                .field("head", &s.head.is_some())
                .finish_non_exhaustive(),
        }
    }
}

/// The vision encoder's stash.
pub struct VisionStash<Y: Family> {
    patches: Y::T,
    blocks: Vec<BlockCache<Y>>,
    ln_f: LnCache<Y>,
    hf: Y::T,
    /// After a split backward: gradients of the embedding output, of the final
    /// norm's output and of the projector's output.
    dys: Option<[Y::T; 3]>,
}

/// The last stage's head: its final norm, the norm's output, the loss's cache and
/// targets, and (after a split backward) the logits' and the norm output's gradients.
struct HeadStash<Y: Family> {
    ln: LnCache<Y>,
    hf: Y::T,
    ce: Y::CeCache,
    targets: Y::Idx,
    dlogits: Option<Y::T>,
    dh: Option<Y::T>,
}

/// An LLM stage's stash.
pub struct LlmStash<Y: Family> {
    /// The stage (`k` of `llm.k`).
    stage: usize,
    /// First stage: the micro-batch's caption tokens.
    tokens: Option<Y::Idx>,
    blocks: Vec<BlockCache<Y>>,
    head: Option<HeadStash<Y>>,
    /// After a split backward (first stage): the gradient of the embedding output
    /// and its caption rows.
    dx0: Option<(Y::T, Y::T)>,
}

/// What a unit's forward gives.
pub struct Forward<O: Ops + ?Sized> {
    /// The output: image tokens, hidden states, or (last unit) the loss, 1 element.
    pub out: O::T,
    pub stash: UnitStash<O::Fam>,
    /// Last unit, when the ops can tell without waiting: the teacher-forced
    /// next-token accuracy.
    pub accuracy: Option<f32>,
}

impl Net {
    /// The layers of `cfg`'s units and each unit's parameter layout.
    ///
    /// # Panics
    /// If `cfg` is inconsistent (e.g. fewer LLM layers than stages).
    pub fn new(cfg: &Config) -> (Net, Vec<ParamLayout>) {
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
        let net = Net {
            cfg: cfg.clone(),
            vision,
            stages,
        };
        (net, layouts)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Elements of `unit`'s forward output for a micro-batch of `nb` examples: image
    /// tokens (`nb x patches x dim`) for the vision encoder, hidden states (`nb x
    /// seq_len x dim`) for a stage, the loss (1) for the last.
    pub fn output_len(&self, unit: usize, nb: usize) -> usize {
        let cfg = &self.cfg;
        if unit == 0 {
            nb * cfg.patches() * cfg.dim
        } else if unit == cfg.units() - 1 {
            1
        } else {
            nb * cfg.seq_len() * cfg.dim
        }
    }

    /// Forward of `unit` on `sample`, from its input unit's output (none for the
    /// encoder), with the unit's parameters `p`.
    ///
    /// # Panics
    /// If the input is missing or of the wrong size.
    pub fn forward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        unit: usize,
        p: &O::P,
        sample: &Sample,
        input: Option<O::T>,
    ) -> Result<Forward<O>, O::Error> {
        match unit {
            0 => {
                assert!(input.is_none(), "the vision encoder has no input units");
                self.vision_forward(o, p, sample)
            }
            u => {
                let input = input.unwrap_or_else(|| panic!("llm.{} takes one input", u - 1));
                self.stage_forward(o, u - 1, p, sample, input)
            }
        }
    }

    /// The gradients of `unit`'s inputs (one per input unit) from that of its output
    /// (`None` for the last unit: the loss's gradient is 1). With [`Wgrad::Now`], the
    /// weight gradients are added too (fused backward); with [`Wgrad::Later`], what
    /// they need is kept in the stash for [`Net::backward_weight`].
    pub fn backward_input<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        stash: &mut UnitStash<O::Fam>,
        grad_out: Option<O::T>,
        w: Wgrad<'_, O::P>,
    ) -> Result<Vec<O::T>, O::Error> {
        match stash {
            UnitStash::Vision(s) => {
                let dy = grad_out.expect("vision needs its output's gradient");
                self.vision_backward_input(o, p, s, dy, w)?;
                Ok(Vec::new())
            }
            UnitStash::Llm(s) => self.stage_backward_input(o, s.stage, p, s, grad_out, w),
        }
    }

    /// Add the weight gradients a split [`Net::backward_input`] kept in `stash`.
    ///
    /// # Panics
    /// If `backward_input` did not run on `stash` with [`Wgrad::Later`].
    pub fn backward_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        g: &mut O::P,
        stash: &UnitStash<O::Fam>,
    ) -> Result<(), O::Error> {
        match stash {
            UnitStash::Vision(s) => self.vision_backward_weight(o, p, g, s),
            UnitStash::Llm(s) => self.stage_backward_weight(o, s.stage, p, g, s),
        }
    }

    fn vision_forward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        sample: &Sample,
    ) -> Result<Forward<O>, O::Error> {
        let (cfg, v) = (&self.cfg, &self.vision);
        let (nb, np) = (sample.size, cfg.patches());
        let patches = o.upload(&sample.images)?;
        let mut x = o.linear(p, &v.patch, &patches, nb * np)?;
        o.add_rows_(&mut x, p, v.pos)?;
        let mut blocks = Vec::with_capacity(v.blocks.len());
        for b in &v.blocks {
            let (y, c) = b.forward(o, p, x, nb, np)?;
            x = y;
            blocks.push(c);
        }
        let (hf, ln_f) = v.ln_f.forward(o, p, x, nb * np)?;
        let out = o.linear(p, &v.proj, &hf, nb * np)?;
        let stash = VisionStash {
            patches,
            blocks,
            ln_f,
            hf,
            dys: None,
        };
        Ok(Forward {
            out,
            stash: UnitStash::Vision(stash),
            accuracy: None,
        })
    }

    fn stage_forward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        k: usize,
        p: &O::P,
        sample: &Sample,
        input: O::T,
    ) -> Result<Forward<O>, O::Error> {
        let (cfg, st) = (&self.cfg, &self.stages[k]);
        let (nb, d, np, t, l) = (
            sample.size,
            cfg.dim,
            cfg.patches(),
            cfg.caption_len(),
            cfg.seq_len(),
        );
        let n = nb * l;
        let mut tokens = None;
        let mut x = if let Some(e) = &st.embed {
            assert_eq!(
                o.len(&input),
                nb * np * d,
                "llm.0: image tokens of the wrong size"
            );
            let ids: Vec<i64> = sample.tokens.iter().map(|&w| i64::from(w)).collect();
            let ids = o.indices(&ids)?;
            let emb = o.embedding(p, e.tok, d, &ids)?;
            let mut x = o.concat_seq(&input, np, &emb, t, nb, d)?;
            o.add_rows_(&mut x, p, e.pos)?;
            tokens = Some(ids);
            x
        } else {
            assert_eq!(o.len(&input), n * d, "llm.{k}: input of the wrong size");
            input
        };
        let mut blocks = Vec::with_capacity(st.blocks.len());
        for b in &st.blocks {
            let (y, c) = b.forward(o, p, x, nb, l)?;
            x = y;
            blocks.push(c);
        }
        let mut head = None;
        let mut accuracy = None;
        if let Some(h) = &st.head {
            let (hf, ln) = h.ln_f.forward(o, p, x, n)?;
            let logits = o.linear(p, &h.out, &hf, n)?;
            let vocab = cfg.vocab();
            // Position `np + i` (caption token i) predicts caption token i + 1.
            let targets: Vec<i64> = (0..n)
                .map(|r| {
                    let (b, j) = (r / l, r % l);
                    if j >= np && j + 1 < l {
                        i64::from(sample.tokens[b * t + j - np + 1])
                    } else {
                        -100
                    }
                })
                .collect();
            let targets = o.indices(&targets)?;
            let (loss, ce) = o.cross_entropy(logits, &targets, vocab)?;
            accuracy = o.accuracy(&ce, &targets, vocab);
            head = Some(HeadStash {
                ln,
                hf,
                ce,
                targets,
                dlogits: None,
                dh: None,
            });
            x = loss;
        }
        let stash = LlmStash {
            stage: k,
            tokens,
            blocks,
            head,
            dx0: None,
        };
        Ok(Forward {
            out: x,
            stash: UnitStash::Llm(stash),
            accuracy,
        })
    }

    fn vision_backward_input<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        s: &mut VisionStash<O::Fam>,
        dy: O::T,
        mut w: Wgrad<'_, O::P>,
    ) -> Result<(), O::Error> {
        let v = &self.vision;
        let n = o.len(&dy) / v.proj.dout;
        let dhf = o.linear_backward_input(p, &v.proj, &dy, n)?;
        if let Some(g) = w.now() {
            o.linear_backward_weight(g, &v.proj, &s.hf, &dy, n)?;
        }
        let mut dx = v.ln_f.backward(o, p, w.now(), &s.ln_f, &dhf, n)?;
        for (b, c) in v.blocks.iter().zip(&mut s.blocks).rev() {
            dx = b.backward_input(o, p, c, dx, w.reborrow())?;
        }
        match w {
            Wgrad::Now(g) => self.vision_embed_weight(o, g, &s.patches, &dx)?,
            Wgrad::Later => s.dys = Some([dx, dhf, dy]),
        }
        Ok(())
    }

    fn vision_embed_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        g: &mut O::P,
        patches: &O::T,
        dx0: &O::T,
    ) -> Result<(), O::Error> {
        let v = &self.vision;
        let n = o.len(dx0) / v.patch.dout;
        o.linear_backward_weight(g, &v.patch, patches, dx0, n)?;
        o.sum_rows_acc(g, v.pos, dx0)
    }

    fn vision_backward_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        g: &mut O::P,
        s: &VisionStash<O::Fam>,
    ) -> Result<(), O::Error> {
        let v = &self.vision;
        let [dx0, dhf, dy] = s
            .dys
            .as_ref()
            .expect("backward_weight before backward_input");
        let n = o.len(dy) / v.proj.dout;
        o.linear_backward_weight(g, &v.proj, &s.hf, dy, n)?;
        v.ln_f.backward_weight(o, p, g, &s.ln_f, dhf, n)?;
        for (b, c) in v.blocks.iter().zip(&s.blocks).rev() {
            b.backward_weight(o, p, g, c)?;
        }
        self.vision_embed_weight(o, g, &s.patches, dx0)
    }

    fn stage_backward_input<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        k: usize,
        p: &O::P,
        s: &mut LlmStash<O::Fam>,
        grad_out: Option<O::T>,
        mut w: Wgrad<'_, O::P>,
    ) -> Result<Vec<O::T>, O::Error> {
        let (cfg, st) = (&self.cfg, &self.stages[k]);
        let (d, np, t, l) = (cfg.dim, cfg.patches(), cfg.caption_len(), cfg.seq_len());
        let mut dx = if let (Some(h), Some(hs)) = (&st.head, &mut s.head) {
            // The output is the loss itself: its gradient is 1 unless one is given.
            let vocab = cfg.vocab();
            let dlogits =
                o.cross_entropy_backward(&hs.ce, &hs.targets, grad_out.as_ref(), vocab)?;
            let n = o.len(&dlogits) / vocab;
            let dh = o.linear_backward_input(p, &h.out, &dlogits, n)?;
            if let Some(g) = w.now() {
                o.linear_backward_weight(g, &h.out, &hs.hf, &dlogits, n)?;
            }
            let dx = h.ln_f.backward(o, p, w.now(), &hs.ln, &dh, n)?;
            if let Wgrad::Later = w {
                hs.dlogits = Some(dlogits);
                hs.dh = Some(dh);
            }
            dx
        } else {
            grad_out.expect("a non-last stage needs its output's gradient")
        };
        for (b, c) in st.blocks.iter().zip(&mut s.blocks).rev() {
            dx = b.backward_input(o, p, c, dx, w.reborrow())?;
        }
        let Some(e) = &st.embed else {
            return Ok(vec![dx]);
        };
        let nb = o.len(&dx) / (l * d);
        let (dimg, dtok) = o.split_seq(&dx, np, t, nb, d)?;
        match w {
            Wgrad::Now(g) => {
                let tokens = s.tokens.as_ref().expect("first stage keeps its tokens");
                embed_weight(o, e, d, g, tokens, &dx, &dtok)?;
            }
            Wgrad::Later => s.dx0 = Some((dx, dtok)),
        }
        Ok(vec![dimg])
    }

    fn stage_backward_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        k: usize,
        p: &O::P,
        g: &mut O::P,
        s: &LlmStash<O::Fam>,
    ) -> Result<(), O::Error> {
        let st = &self.stages[k];
        let before = "backward_weight before backward_input";
        if let (Some(h), Some(hs)) = (&st.head, &s.head) {
            let dlogits = hs.dlogits.as_ref().expect(before);
            let n = o.len(dlogits) / self.cfg.vocab();
            o.linear_backward_weight(g, &h.out, &hs.hf, dlogits, n)?;
            let dh = hs.dh.as_ref().expect(before);
            h.ln_f.backward_weight(o, p, g, &hs.ln, dh, n)?;
        }
        for (b, c) in st.blocks.iter().zip(&s.blocks).rev() {
            b.backward_weight(o, p, g, c)?;
        }
        if let Some(e) = &st.embed {
            let (dx0, dtok) = s.dx0.as_ref().expect(before);
            let tokens = s.tokens.as_ref().expect("first stage keeps its tokens");
            embed_weight(o, e, self.cfg.dim, g, tokens, dx0, dtok)?;
        }
        Ok(())
    }
}

/// The embeddings' gradients: positions from every row of `dx0`, tokens from the
/// caption rows `dtok`.
fn embed_weight<O: Ops + ?Sized>(
    o: &mut O,
    e: &Embed,
    d: usize,
    g: &mut O::P,
    tokens: &O::Idx,
    dx0: &O::T,
    dtok: &O::T,
) -> Result<(), O::Error> {
    o.sum_rows_acc(g, e.pos, dx0)?;
    o.embedding_backward(g, e.tok, d, dtok, tokens)
}
