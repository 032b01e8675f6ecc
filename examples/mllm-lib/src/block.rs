//! A pre-norm transformer block: `x + Attn(LN1(x))`, then `+ MLP(LN2(.))` with a
//! GELU MLP.
//!
//! Backward comes in two modes. Fused ([`Wgrad::Now`]): each layer's weight
//! gradients are added as soon as its output gradient is known, as ordinary
//! backprop does. Split ([`Wgrad::Later`]): [`Block::backward_input`] only computes
//! the input gradient and keeps each layer's output gradient in the cache, and
//! [`Block::backward_weight`] adds the weight gradients from them afterwards.

use crate::float::Float;
use crate::ops::{
    add_into, gelu, gelu_backward, AttnShape, LayerNorm, Linear, LnCache, ParamLayout,
};

/// What to do with weight gradients during an input-gradient backward.
pub enum Wgrad<'a, F> {
    /// Add them into these gradient accumulators right away (fused backward).
    Now(&'a mut [F]),
    /// Keep what they need in the cache, for a later `backward_weight`.
    Later,
}

impl<F> Wgrad<'_, F> {
    /// The accumulators, when fused.
    pub fn now(&mut self) -> Option<&mut [F]> {
        match self {
            Wgrad::Now(g) => Some(g),
            Wgrad::Later => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Block {
    pub ln1: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub ln2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
    pub heads: usize,
    pub causal: bool,
}

/// A block's forward state, plus (after a split `backward_input`) the output
/// gradients of its layers.
#[derive(Debug)]
pub struct BlockCache<F> {
    batch: usize,
    len: usize,
    ln1: LnCache<F>,
    h1: Vec<F>,
    qkv: Vec<F>,
    probs: Vec<F>,
    att: Vec<F>,
    ln2: LnCache<F>,
    h2: Vec<F>,
    u: Vec<F>,
    g: Vec<F>,
    dys: Option<BlockDys<F>>,
}

/// Output gradients of a block's layers, for its weight gradients.
#[derive(Debug)]
struct BlockDys<F> {
    dh1: Vec<F>,
    dqkv: Vec<F>,
    dproj: Vec<F>,
    dh2: Vec<F>,
    du: Vec<F>,
    dfc2: Vec<F>,
}

impl Block {
    /// `layers` is the depth of the stack the block is in (scales the init of the
    /// residual branches' output layers).
    pub fn new(
        pl: &mut ParamLayout,
        name: &str,
        d: usize,
        mlp: usize,
        heads: usize,
        causal: bool,
        layers: usize,
    ) -> Block {
        assert!(
            d.checked_rem(heads) == Some(0),
            "width {d} not divisible by {heads} heads"
        );
        let res_std = 1.0 / ((d as f32).sqrt() * (2.0 * layers as f32).sqrt());
        let res_std_mlp = 1.0 / ((mlp as f32).sqrt() * (2.0 * layers as f32).sqrt());
        Block {
            ln1: LayerNorm::new(pl, &format!("{name}.ln1"), d),
            qkv: Linear::new(pl, &format!("{name}.qkv"), d, 3 * d, None),
            proj: Linear::new(pl, &format!("{name}.proj"), d, d, Some(res_std)),
            ln2: LayerNorm::new(pl, &format!("{name}.ln2"), d),
            fc1: Linear::new(pl, &format!("{name}.fc1"), d, mlp, None),
            fc2: Linear::new(pl, &format!("{name}.fc2"), mlp, d, Some(res_std_mlp)),
            heads,
            causal,
        }
    }

    fn shape(&self, batch: usize, len: usize) -> AttnShape {
        AttnShape {
            batch,
            len,
            d: self.ln1.d,
            heads: self.heads,
            causal: self.causal,
        }
    }

    /// `x` holds `batch` sequences of `len` rows.
    pub fn forward<F: Float>(
        &self,
        p: &[F],
        x: &[F],
        batch: usize,
        len: usize,
    ) -> (Vec<F>, BlockCache<F>) {
        let (h1, ln1) = self.ln1.forward(p, x);
        let qkv = self.qkv.forward(p, &h1);
        let (att, probs) = self.shape(batch, len).forward(&qkv);
        let mut x2 = self.proj.forward(p, &att);
        add_into(&mut x2, x);
        let (h2, ln2) = self.ln2.forward(p, &x2);
        let u = self.fc1.forward(p, &h2);
        let g = gelu(&u);
        let mut y = self.fc2.forward(p, &g);
        add_into(&mut y, &x2);
        let cache = BlockCache {
            batch,
            len,
            ln1,
            h1,
            qkv,
            probs,
            att,
            ln2,
            h2,
            u,
            g,
            dys: None,
        };
        (y, cache)
    }

    /// The gradient of the block's input from that of its output.
    pub fn backward_input<F: Float>(
        &self,
        p: &[F],
        c: &mut BlockCache<F>,
        dy: &[F],
        mut w: Wgrad<'_, F>,
    ) -> Vec<F> {
        let dfc2 = dy.to_vec();
        let dg = self.fc2.backward_input(p, &dfc2);
        if let Some(gr) = w.now() {
            self.fc2.backward_weight(gr, &c.g, &dfc2);
        }
        let du = gelu_backward(&c.u, &dg);
        let dh2 = self.fc1.backward_input(p, &du);
        if let Some(gr) = w.now() {
            self.fc1.backward_weight(gr, &c.h2, &du);
        }
        let mut dx2 = self.ln2.backward_input(p, &c.ln2, &dh2);
        if let Some(gr) = w.now() {
            self.ln2.backward_weight(gr, &c.ln2, &dh2);
        }
        add_into(&mut dx2, dy);
        let dproj = dx2.clone();
        let datt = self.proj.backward_input(p, &dproj);
        if let Some(gr) = w.now() {
            self.proj.backward_weight(gr, &c.att, &dproj);
        }
        let dqkv = self.shape(c.batch, c.len).backward(&c.qkv, &c.probs, &datt);
        let dh1 = self.qkv.backward_input(p, &dqkv);
        if let Some(gr) = w.now() {
            self.qkv.backward_weight(gr, &c.h1, &dqkv);
        }
        let mut dx = self.ln1.backward_input(p, &c.ln1, &dh1);
        if let Some(gr) = w.now() {
            self.ln1.backward_weight(gr, &c.ln1, &dh1);
        }
        add_into(&mut dx, &dx2);
        if let Wgrad::Later = w {
            // Drop what only the input gradient needed; keep what W needs.
            c.probs = Vec::new();
            c.qkv = Vec::new();
            c.u = Vec::new();
            c.dys = Some(BlockDys {
                dh1,
                dqkv,
                dproj,
                dh2,
                du,
                dfc2,
            });
        }
        dx
    }

    /// Add the weight gradients kept by a split `backward_input`.
    ///
    /// # Panics
    /// If `backward_input` did not run on `c` with [`Wgrad::Later`].
    pub fn backward_weight<F: Float>(&self, gr: &mut [F], c: &BlockCache<F>) {
        let d = c
            .dys
            .as_ref()
            .expect("backward_weight before a split backward_input");
        self.fc2.backward_weight(gr, &c.g, &d.dfc2);
        self.fc1.backward_weight(gr, &c.h2, &d.du);
        self.ln2.backward_weight(gr, &c.ln2, &d.dh2);
        self.proj.backward_weight(gr, &c.att, &d.dproj);
        self.qkv.backward_weight(gr, &c.h1, &d.dqkv);
        self.ln1.backward_weight(gr, &c.ln1, &d.dh1);
    }
}
