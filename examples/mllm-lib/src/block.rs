//! A pre-norm transformer block: `x + Attn(LN1(x))`, then `+ MLP(LN2(.))` with a
//! GELU MLP, written once against [`Ops`].
//!
//! Backward comes in two modes. Fused ([`Wgrad::Now`]): each layer's weight
//! gradients are added as soon as its output gradient is known, as ordinary
//! backprop does. Split ([`Wgrad::Later`]): [`Block::backward_input`] only computes
//! the input gradient and keeps each layer's output gradient in the cache, and
//! [`Block::backward_weight`] adds the weight gradients from them afterwards.

use crate::ops::{LayerNorm, Linear, ParamLayout};
use crate::tensor_ops::{Bmm, Family, Ops};

/// What to do with weight gradients during an input-gradient backward.
pub enum Wgrad<'a, P: ?Sized> {
    /// Add them into these gradient accumulators right away (fused backward).
    Now(&'a mut P),
    /// Keep what they need in the cache, for a later `backward_weight`.
    Later,
}

impl<P: ?Sized> Wgrad<'_, P> {
    /// The accumulators, when fused.
    pub fn now(&mut self) -> Option<&mut P> {
        match self {
            Wgrad::Now(g) => Some(g),
            Wgrad::Later => None,
        }
    }
    /// The same mode, for a shorter borrow.
    pub fn reborrow(&mut self) -> Wgrad<'_, P> {
        match self {
            Wgrad::Now(g) => Wgrad::Now(g),
            Wgrad::Later => Wgrad::Later,
        }
    }
}

/// What a layer norm keeps for its backward: its input, and each row's mean and
/// `1/sqrt(var + eps)`.
pub struct LnCache<Y: Family> {
    pub x: Y::T,
    pub mean: Y::T,
    pub rstd: Y::T,
}

impl<Y: Family> std::fmt::Debug for LnCache<Y> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LnCache")
            .field("x", &self.x)
            .field("mean", &self.mean)
            .field("rstd", &self.rstd)
            .finish()
    }
}

impl LayerNorm {
    /// Forward of `n` rows; the input is kept in the cache.
    #[allow(clippy::type_complexity)]
    pub fn forward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        x: O::T,
        n: usize,
    ) -> Result<(O::T, LnCache<O::Fam>), O::Error> {
        let (y, mean, rstd) = o.layer_norm(p, self, &x, n)?;
        Ok((y, LnCache { x, mean, rstd }))
    }
    /// Input gradient; with `g`, the weight gradients are added too.
    pub fn backward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        g: Option<&mut O::P>,
        c: &LnCache<O::Fam>,
        dy: &O::T,
        n: usize,
    ) -> Result<O::T, O::Error> {
        o.layer_norm_backward(p, g, self, &c.x, &c.mean, &c.rstd, dy, n)
    }
    /// Weight gradients only.
    pub fn backward_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        g: &mut O::P,
        c: &LnCache<O::Fam>,
        dy: &O::T,
        n: usize,
    ) -> Result<(), O::Error> {
        o.layer_norm_backward_weight(p, g, self, &c.x, &c.mean, &c.rstd, dy, n)
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
/// gradients of its layers. The attention's `q, k, v` are kept split by head.
pub struct BlockCache<Y: Family> {
    batch: usize,
    len: usize,
    ln1: LnCache<Y>,
    h1: Y::T,
    qkvh: Option<Y::T>,
    probs: Option<Y::T>,
    att: Y::T,
    ln2: LnCache<Y>,
    h2: Y::T,
    u: Option<Y::T>,
    g: Y::T,
    dys: Option<BlockDys<Y>>,
}

impl<Y: Family> std::fmt::Debug for BlockCache<Y> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("batch", &self.batch)
            .field("len", &self.len)
            .field("split", &self.dys.is_some())
            .finish_non_exhaustive()
    }
}

/// Output gradients of a block's layers, for its weight gradients.
struct BlockDys<Y: Family> {
    dh1: Y::T,
    dqkv: Y::T,
    dproj: Y::T,
    dh2: Y::T,
    du: Y::T,
    dfc2: Y::T,
}

/// A batched product over `batch` matrices.
fn bmm(batch: usize, m: usize, k: usize, n: usize, ta: bool, tb: bool, alpha: f64) -> Bmm {
    Bmm {
        batch,
        m,
        k,
        n,
        ta,
        tb,
        alpha,
    }
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

    /// Heads' width and the attention's scale `1/sqrt(dh)`.
    fn head_dim(&self) -> (usize, f64) {
        let dh = self.ln1.d / self.heads;
        (dh, 1.0 / (dh as f64).sqrt())
    }

    /// Multi-head self-attention over `b` sequences of `l` rows from the fused
    /// `[q | k | v]` projection: the output (rows, heads side by side), `q, k, v` by
    /// head (`3 x b x heads x l x dh`) and the probabilities (`b x heads x l x l`).
    #[allow(clippy::type_complexity)]
    fn attention<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        qkv: &O::T,
        b: usize,
        l: usize,
    ) -> Result<(O::T, O::T, O::T), O::Error> {
        let (h, (dh, scale)) = (self.heads, self.head_dim());
        let (bh, n) = (b * h, b * h * l * dh);
        let qkvh = o.split_heads(qkv, b, l, 3, h, dh)?;
        // S = scale Q K^T
        let mut s = o.alloc(bh * l * l)?;
        let spec = bmm(bh, l, dh, l, false, true, scale);
        o.bmm((&qkvh, 0), (&qkvh, n), (&mut s, 0), spec)?;
        let probs = o.softmax(s, bh, l, self.causal)?;
        // O = P V
        let mut out = o.alloc(n)?;
        let spec = bmm(bh, l, l, dh, false, false, 1.0);
        o.bmm((&probs, 0), (&qkvh, 2 * n), (&mut out, 0), spec)?;
        let att = o.merge_heads(&out, b, l, 1, h, dh)?;
        Ok((att, qkvh, probs))
    }

    /// The gradient of the fused `qkv` from the attention output's.
    fn attention_backward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        qkvh: &O::T,
        probs: &O::T,
        datt: &O::T,
        b: usize,
        l: usize,
    ) -> Result<O::T, O::Error> {
        let (h, (dh, scale)) = (self.heads, self.head_dim());
        let (bh, n) = (b * h, b * h * l * dh);
        let dout = o.split_heads(datt, b, l, 1, h, dh)?;
        // dP = dO V^T
        let mut dp = o.alloc(bh * l * l)?;
        let spec = bmm(bh, l, dh, l, false, true, 1.0);
        o.bmm((&dout, 0), (qkvh, 2 * n), (&mut dp, 0), spec)?;
        // dV = P^T dO
        let mut dqkvh = o.alloc(3 * n)?;
        let spec = bmm(bh, l, l, dh, true, false, 1.0);
        o.bmm((probs, 0), (&dout, 0), (&mut dqkvh, 2 * n), spec)?;
        // dS = P * (dP - rowsum(dP * P))
        let ds = o.softmax_backward(&dp, probs, l)?;
        // dQ = scale dS K, dK = scale dS^T Q
        let spec = bmm(bh, l, l, dh, false, false, scale);
        o.bmm((&ds, 0), (qkvh, n), (&mut dqkvh, 0), spec)?;
        let spec = bmm(bh, l, l, dh, true, false, scale);
        o.bmm((&ds, 0), (qkvh, 0), (&mut dqkvh, n), spec)?;
        o.merge_heads(&dqkvh, b, l, 3, h, dh)
    }

    /// `x` holds `batch` sequences of `len` rows (kept in the cache).
    #[allow(clippy::type_complexity)]
    pub fn forward<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        x: O::T,
        batch: usize,
        len: usize,
    ) -> Result<(O::T, BlockCache<O::Fam>), O::Error> {
        let n = batch * len;
        let (h1, ln1) = self.ln1.forward(o, p, x, n)?;
        let qkv = o.linear(p, &self.qkv, &h1, n)?;
        let (att, qkvh, probs) = self.attention(o, &qkv, batch, len)?;
        drop(qkv);
        let mut x2 = o.linear(p, &self.proj, &att, n)?;
        o.add_(&mut x2, &ln1.x)?;
        let (h2, ln2) = self.ln2.forward(o, p, x2, n)?;
        let u = o.linear(p, &self.fc1, &h2, n)?;
        let g = o.gelu(&u)?;
        let mut y = o.linear(p, &self.fc2, &g, n)?;
        o.add_(&mut y, &ln2.x)?;
        let cache = BlockCache {
            batch,
            len,
            ln1,
            h1,
            qkvh: Some(qkvh),
            probs: Some(probs),
            att,
            ln2,
            h2,
            u: Some(u),
            g,
            dys: None,
        };
        Ok((y, cache))
    }

    /// The gradient of the block's input from that of its output.
    ///
    /// # Panics
    /// If `c` already went through a split backward.
    pub fn backward_input<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        c: &mut BlockCache<O::Fam>,
        dy: O::T,
        mut w: Wgrad<'_, O::P>,
    ) -> Result<O::T, O::Error> {
        let n = c.batch * c.len;
        let taken = "backward_input twice on one block cache";
        let dfc2 = dy;
        let dg = o.linear_backward_input(p, &self.fc2, &dfc2, n)?;
        if let Some(gr) = w.now() {
            o.linear_backward_weight(gr, &self.fc2, &c.g, &dfc2, n)?;
        }
        let du = o.gelu_backward(c.u.as_ref().expect(taken), &dg)?;
        drop(dg);
        let dh2 = o.linear_backward_input(p, &self.fc1, &du, n)?;
        if let Some(gr) = w.now() {
            o.linear_backward_weight(gr, &self.fc1, &c.h2, &du, n)?;
        }
        let mut dx2 = self.ln2.backward(o, p, w.now(), &c.ln2, &dh2, n)?;
        o.add_(&mut dx2, &dfc2)?;
        let dproj = dx2;
        let datt = o.linear_backward_input(p, &self.proj, &dproj, n)?;
        if let Some(gr) = w.now() {
            o.linear_backward_weight(gr, &self.proj, &c.att, &dproj, n)?;
        }
        let qkvh = c.qkvh.as_ref().expect(taken);
        let probs = c.probs.as_ref().expect(taken);
        let dqkv = self.attention_backward(o, qkvh, probs, &datt, c.batch, c.len)?;
        drop(datt);
        let dh1 = o.linear_backward_input(p, &self.qkv, &dqkv, n)?;
        if let Some(gr) = w.now() {
            o.linear_backward_weight(gr, &self.qkv, &c.h1, &dqkv, n)?;
        }
        let mut dx = self.ln1.backward(o, p, w.now(), &c.ln1, &dh1, n)?;
        o.add_(&mut dx, &dproj)?;
        if let Wgrad::Later = w {
            // Drop what only the input gradient needed; keep what W needs.
            c.probs = None;
            c.qkvh = None;
            c.u = None;
            c.dys = Some(BlockDys {
                dh1,
                dqkv,
                dproj,
                dh2,
                du,
                dfc2,
            });
        }
        Ok(dx)
    }

    /// Add the weight gradients kept by a split `backward_input`.
    ///
    /// # Panics
    /// If `backward_input` did not run on `c` with [`Wgrad::Later`].
    pub fn backward_weight<O: Ops + ?Sized>(
        &self,
        o: &mut O,
        p: &O::P,
        gr: &mut O::P,
        c: &BlockCache<O::Fam>,
    ) -> Result<(), O::Error> {
        let n = c.batch * c.len;
        let d = c
            .dys
            .as_ref()
            .expect("backward_weight before a split backward_input");
        o.linear_backward_weight(gr, &self.fc2, &c.g, &d.dfc2, n)?;
        o.linear_backward_weight(gr, &self.fc1, &c.h2, &d.du, n)?;
        self.ln2.backward_weight(o, p, gr, &c.ln2, &d.dh2, n)?;
        o.linear_backward_weight(gr, &self.proj, &c.att, &d.dproj, n)?;
        o.linear_backward_weight(gr, &self.qkv, &c.h1, &d.dqkv, n)?;
        self.ln1.backward_weight(o, p, gr, &c.ln1, &d.dh1, n)
    }
}
