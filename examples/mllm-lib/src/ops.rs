//! The layers the model is made of, each with a forward, an input-gradient backward
//! and a weight-gradient backward, over row-major `rows x features` activations.
//!
//! Parameters live in one flat vector per unit; a layer knows its [`Slot`]s in it.
//! Weight-gradient functions **add** into the matching slots of a gradient vector
//! laid out like the parameters.

use crate::float::Float;
use crate::gemm::{gemm, mm, mm_nt, mm_tn, View};
use crate::rng::Rng;

/// A range of a unit's flat parameter (and gradient) vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub off: usize,
    pub len: usize,
}

impl Slot {
    pub fn of<'a, F>(&self, v: &'a [F]) -> &'a [F] {
        &v[self.off..self.off + self.len]
    }
    pub fn of_mut<'a, F>(&self, v: &'a mut [F]) -> &'a mut [F] {
        &mut v[self.off..self.off + self.len]
    }
}

/// How a slot is initialised.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Normal(f32),
    Const(f32),
}

/// Hands out the slots of one unit's flat parameter vector, and initialises it.
#[derive(Clone, Debug, Default)]
pub struct ParamLayout {
    len: usize,
    inits: Vec<(String, Slot, Init)>,
}

impl ParamLayout {
    /// A new tensor of `len` values named `name`.
    pub fn alloc(&mut self, name: String, len: usize, init: Init) -> Slot {
        let s = Slot { off: self.len, len };
        self.len += len;
        self.inits.push((name, s, init));
        s
    }
    /// The named tensors, in order.
    pub fn tensors(&self) -> Vec<(String, Slot)> {
        self.inits.iter().map(|(n, s, _)| (n.clone(), *s)).collect()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The initial parameters, drawn (as `f32`, whatever `F`) from `rng` slot by
    /// slot.
    pub fn init<F: Float>(&self, rng: &mut Rng) -> Vec<F> {
        let mut p = vec![F::ZERO; self.len];
        for (_, s, init) in &self.inits {
            for x in s.of_mut(&mut p) {
                let v: f32 = match *init {
                    Init::Normal(std) => std * rng.normal(),
                    Init::Const(c) => c,
                };
                *x = F::of(v as f64);
            }
        }
        p
    }
}

/// `y = x W + b`, `W` stored `din x dout`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub w: Slot,
    pub b: Slot,
    pub din: usize,
    pub dout: usize,
}

impl Linear {
    /// A layer with `N(0, std^2)` weights (default `1/sqrt(din)`) and zero bias.
    pub fn new(
        pl: &mut ParamLayout,
        name: &str,
        din: usize,
        dout: usize,
        std: Option<f32>,
    ) -> Linear {
        let std = std.unwrap_or(1.0 / (din as f32).sqrt());
        Linear {
            w: pl.alloc(format!("{name}.w"), din * dout, Init::Normal(std)),
            b: pl.alloc(format!("{name}.b"), dout, Init::Const(0.0)),
            din,
            dout,
        }
    }
    pub fn forward<F: Float>(&self, p: &[F], x: &[F]) -> Vec<F> {
        let n = x.len() / self.din;
        let b = self.b.of(p);
        let mut y = Vec::with_capacity(n * self.dout);
        for _ in 0..n {
            y.extend_from_slice(b);
        }
        mm(x, self.w.of(p), &mut y, n, self.din, self.dout, F::ONE);
        y
    }
    /// `dx = dy W^T`.
    pub fn backward_input<F: Float>(&self, p: &[F], dy: &[F]) -> Vec<F> {
        let n = dy.len() / self.dout;
        let mut dx = vec![F::ZERO; n * self.din];
        mm_nt(dy, self.w.of(p), &mut dx, n, self.dout, self.din, F::ZERO);
        dx
    }
    /// `dW += x^T dy`, `db += sum of dy's rows`.
    pub fn backward_weight<F: Float>(&self, g: &mut [F], x: &[F], dy: &[F]) {
        let n = dy.len() / self.dout;
        mm_tn(x, dy, self.w.of_mut(g), self.din, n, self.dout, F::ONE);
        let gb = self.b.of_mut(g);
        for row in dy.chunks_exact(self.dout) {
            for (a, d) in gb.iter_mut().zip(row) {
                *a += *d;
            }
        }
    }
}

/// LayerNorm over the last dimension, with gain and bias.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub g: Slot,
    pub b: Slot,
    pub d: usize,
}

/// What a LayerNorm keeps for its backward.
#[derive(Clone, Debug, Default)]
pub struct LnCache<F> {
    pub xhat: Vec<F>,
    pub rstd: Vec<F>,
}

const LN_EPS: f64 = 1e-5;

impl LayerNorm {
    pub fn new(pl: &mut ParamLayout, name: &str, d: usize) -> LayerNorm {
        LayerNorm {
            g: pl.alloc(format!("{name}.g"), d, Init::Const(1.0)),
            b: pl.alloc(format!("{name}.b"), d, Init::Const(0.0)),
            d,
        }
    }
    pub fn forward<F: Float>(&self, p: &[F], x: &[F]) -> (Vec<F>, LnCache<F>) {
        let d = self.d;
        let (g, b) = (self.g.of(p), self.b.of(p));
        let n = x.len() / d;
        let mut y = vec![F::ZERO; n * d];
        let mut xhat = vec![F::ZERO; n * d];
        let mut rstd = vec![F::ZERO; n];
        for i in 0..n {
            let row = &x[i * d..(i + 1) * d];
            let mean = row.iter().map(|v| v.f64()).sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v.f64() - mean).powi(2)).sum::<f64>() / d as f64;
            let r = F::of(1.0 / (var + LN_EPS).sqrt());
            rstd[i] = r;
            let mean = F::of(mean);
            for j in 0..d {
                let h = (row[j] - mean) * r;
                xhat[i * d + j] = h;
                y[i * d + j] = h * g[j] + b[j];
            }
        }
        (y, LnCache { xhat, rstd })
    }
    pub fn backward_input<F: Float>(&self, p: &[F], c: &LnCache<F>, dy: &[F]) -> Vec<F> {
        let d = self.d;
        let g = self.g.of(p);
        let mut dx = vec![F::ZERO; dy.len()];
        let mut dxhat = vec![F::ZERO; d];
        for (i, &r) in c.rstd.iter().enumerate() {
            let xh = &c.xhat[i * d..(i + 1) * d];
            let dyr = &dy[i * d..(i + 1) * d];
            let (mut s1, mut s2) = (0.0f64, 0.0f64);
            for j in 0..d {
                dxhat[j] = dyr[j] * g[j];
                s1 += dxhat[j].f64();
                s2 += (dxhat[j] * xh[j]).f64();
            }
            let (m1, m2) = (F::of(s1 / d as f64), F::of(s2 / d as f64));
            for j in 0..d {
                dx[i * d + j] = r * (dxhat[j] - m1 - xh[j] * m2);
            }
        }
        dx
    }
    pub fn backward_weight<F: Float>(&self, gr: &mut [F], c: &LnCache<F>, dy: &[F]) {
        let d = self.d;
        for (row, xh) in dy.chunks_exact(d).zip(c.xhat.chunks_exact(d)) {
            for (a, (dv, h)) in self.g.of_mut(gr).iter_mut().zip(row.iter().zip(xh)) {
                *a += *dv * *h;
            }
            for (a, dv) in self.b.of_mut(gr).iter_mut().zip(row) {
                *a += *dv;
            }
        }
    }
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

/// GELU, tanh approximation: `0.5 x (1 + tanh(y))` with `y = c (x + a x^3)`,
/// computed as `x sigmoid(2y)` (one `exp`, much cheaper than `tanh`).
pub fn gelu<F: Float>(u: &[F]) -> Vec<F> {
    u.iter().map(|&x| x * gelu_sigmoid(x).0).collect()
}

/// `sigmoid(2y)` and `dy/dx` at `x`.
fn gelu_sigmoid<F: Float>(x: F) -> (F, F) {
    let (c, a) = (F::of(GELU_C), F::of(GELU_A));
    let y = c * (x + a * x * x * x);
    let s = F::ONE / (F::ONE + (-(y + y)).exp());
    (s, c * (F::ONE + F::of(3.0) * a * x * x))
}

/// `du = dg * gelu'(u)`: `gelu'(x) = s + 2 x s (1 - s) dy/dx`, `s = sigmoid(2y)`.
pub fn gelu_backward<F: Float>(u: &[F], dg: &[F]) -> Vec<F> {
    u.iter()
        .zip(dg)
        .map(|(&x, &d)| {
            let (s, dy) = gelu_sigmoid(x);
            d * (s + F::of(2.0) * x * s * (F::ONE - s) * dy)
        })
        .collect()
}

/// Shape of a multi-head self-attention over `batch` sequences of `len` tokens of
/// width `d`, from a fused `[q | k | v]` projection of width `3d`.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub batch: usize,
    pub len: usize,
    pub d: usize,
    pub heads: usize,
    pub causal: bool,
}

impl AttnShape {
    fn dh(&self) -> usize {
        self.d / self.heads
    }
    fn scale<F: Float>(&self) -> F {
        F::of(1.0 / (self.dh() as f64).sqrt())
    }
    /// Offsets of head `h` of sequence `b`: q, k, v (in `qkv`) and out (in `out`).
    fn offsets(&self, b: usize, h: usize) -> (usize, usize, usize, usize) {
        let (l, d, dh) = (self.len, self.d, self.dh());
        let q = b * l * 3 * d + h * dh;
        (q, q + d, q + 2 * d, b * l * d + h * dh)
    }

    /// Attention outputs (`batch*len x d`, heads side by side) and the attention
    /// probabilities (`batch x heads x len x len`).
    pub fn forward<F: Float>(&self, qkv: &[F]) -> (Vec<F>, Vec<F>) {
        let (l, d, dh) = (self.len, self.d, self.dh());
        let mut out = vec![F::ZERO; self.batch * l * d];
        let mut probs = vec![F::ZERO; self.batch * self.heads * l * l];
        for b in 0..self.batch {
            for h in 0..self.heads {
                let (qo, ko, vo, oo) = self.offsets(b, h);
                let pb = &mut probs[(b * self.heads + h) * l * l..][..l * l];
                let q = View::strided(&qkv[qo..], 3 * d, 1);
                let kt = View::strided(&qkv[ko..], 1, 3 * d);
                gemm(l, dh, l, self.scale(), q, kt, F::ZERO, pb, l, 1);
                for (i, row) in pb.chunks_exact_mut(l).enumerate() {
                    let visible = if self.causal { i + 1 } else { l };
                    let max = row[..visible]
                        .iter()
                        .fold(F::NEG_INFINITY, |m, &x| m.max(x));
                    let mut sum = F::ZERO;
                    for x in &mut row[..visible] {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    for x in &mut row[..visible] {
                        *x /= sum;
                    }
                    row[visible..].fill(F::ZERO);
                }
                let v = View::strided(&qkv[vo..], 3 * d, 1);
                gemm(
                    l,
                    l,
                    dh,
                    F::ONE,
                    View::rm(pb, l),
                    v,
                    F::ZERO,
                    &mut out[oo..],
                    d,
                    1,
                );
            }
        }
        (out, probs)
    }

    /// Gradient of the fused `qkv` from the gradient of the outputs.
    pub fn backward<F: Float>(&self, qkv: &[F], probs: &[F], dout: &[F]) -> Vec<F> {
        let (l, d, dh) = (self.len, self.d, self.dh());
        let mut dqkv = vec![F::ZERO; qkv.len()];
        let mut ds = vec![F::ZERO; l * l];
        for b in 0..self.batch {
            for h in 0..self.heads {
                let (qo, ko, vo, oo) = self.offsets(b, h);
                let pb = &probs[(b * self.heads + h) * l * l..][..l * l];
                let dov = View::strided(&dout[oo..], d, 1);
                // dP = dO V^T
                let vt = View::strided(&qkv[vo..], 1, 3 * d);
                gemm(l, dh, l, F::ONE, dov, vt, F::ZERO, &mut ds, l, 1);
                // dV = P^T dO
                gemm(
                    l,
                    l,
                    dh,
                    F::ONE,
                    View::rm_t(pb, l),
                    dov,
                    F::ZERO,
                    &mut dqkv[vo..],
                    3 * d,
                    1,
                );
                // dS = P * (dP - rowsum(dP * P))
                for (drow, prow) in ds.chunks_exact_mut(l).zip(pb.chunks_exact(l)) {
                    let dot: F = drow.iter().zip(prow).map(|(&a, &p)| a * p).sum();
                    for (x, &p) in drow.iter_mut().zip(prow) {
                        *x = p * (*x - dot);
                    }
                }
                let s: F = self.scale();
                // dQ = s dS K, dK = s dS^T Q
                let k = View::strided(&qkv[ko..], 3 * d, 1);
                gemm(
                    l,
                    l,
                    dh,
                    s,
                    View::rm(&ds, l),
                    k,
                    F::ZERO,
                    &mut dqkv[qo..],
                    3 * d,
                    1,
                );
                let q = View::strided(&qkv[qo..], 3 * d, 1);
                gemm(
                    l,
                    l,
                    dh,
                    s,
                    View::rm_t(&ds, l),
                    q,
                    F::ZERO,
                    &mut dqkv[ko..],
                    3 * d,
                    1,
                );
            }
        }
        dqkv
    }
}

/// Mean cross-entropy of the rows of `logits` (`n x vocab`) that have a target, and
/// its gradient w.r.t. the logits (zero on rows without a target).
pub fn cross_entropy<F: Float>(
    logits: &[F],
    vocab: usize,
    targets: &[Option<u32>],
) -> (f64, Vec<F>) {
    let count = targets.iter().filter(|t| t.is_some()).count().max(1);
    let mut dlogits = vec![F::ZERO; logits.len()];
    let mut loss = 0.0f64;
    for (i, t) in targets.iter().enumerate() {
        let Some(t) = *t else { continue };
        let row = &logits[i * vocab..(i + 1) * vocab];
        let max = row.iter().fold(F::NEG_INFINITY, |m, &x| m.max(x)).f64();
        let sum: f64 = row.iter().map(|x| (x.f64() - max).exp()).sum();
        let lse = max + sum.ln();
        loss += lse - row[t as usize].f64();
        let dr = &mut dlogits[i * vocab..(i + 1) * vocab];
        for (j, (g, &x)) in dr.iter_mut().zip(row).enumerate() {
            let p = (x.f64() - lse).exp();
            let y = if j == t as usize { 1.0 } else { 0.0 };
            *g = F::of((p - y) / count as f64);
        }
    }
    (loss / count as f64, dlogits)
}

/// `a += b`, elementwise.
pub fn add_into<F: Float>(a: &mut [F], b: &[F]) {
    for (x, &y) in a.iter_mut().zip(b) {
        *x += y;
    }
}
