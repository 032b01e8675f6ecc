//! The few tensor operations the model is written against ([`Ops`]), and their host
//! implementation ([`Host`], `f32` or `f64`, matrix products through
//! `matrixmultiply`).
//!
//! Tensors are flat, row-major buffers that know their length; every operation is
//! told the shapes it needs. Parameters and gradient accumulators are a unit's flat
//! vector ([`Ops::P`]) addressed by [`Slot`]s. Each operation is one or a few calls of
//! an aclnn-like kernel library (matmul, add, layer norm, GELU, softmax, log-softmax +
//! NLL, embedding, copy), so that a device implementation is a thin mapping (see
//! `crate::device` with the `ascend` feature).
//!
//! Weight-gradient operations **add** into the accumulators.

use std::fmt::Debug;
use std::marker::PhantomData;

use crate::float::Float;
use crate::gemm::{gemm, mm, mm_nt, mm_tn, View};
use crate::ops::{LayerNorm, Linear, Slot, LN_EPS};

/// A batched matrix product `out[i] = alpha * op(a[i]) op(b[i])` over `batch`
/// matrices, `op(a)` `m x k`, `op(b)` `k x n`, `out` `m x n`; `ta`/`tb`: the operand is
/// stored transposed (`k x m`, `n x k`). Operands and output are contiguous
/// row-major matrices one after the other, from an element offset into their buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bmm {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub ta: bool,
    pub tb: bool,
    pub alpha: f64,
}

/// The types an [`Ops`] implementation's tensors have, apart from the operations
/// (so that what a unit keeps between its passes does not borrow the operations'
/// context, e.g. a device's kernels).
pub trait Family: 'static {
    type T: Debug + Send;
    type Idx: Debug + Send;
    type CeCache: Debug + Send;
}

/// The tensor operations of the model. One implementation per place the model runs:
/// [`Host`] (CPU) and, with the `ascend` feature, the aclnn device.
pub trait Ops {
    /// The tensor types, as a [`Family`].
    type Fam: Family<T = Self::T, Idx = Self::Idx, CeCache = Self::CeCache>;
    /// An activation: a flat buffer of elements (its length is [`Ops::len`]).
    type T: Debug + Send;
    /// A unit's flat parameter or gradient vector.
    type P: ?Sized;
    /// Indices (token ids, targets; `-100` is "no target").
    type Idx: Debug + Send;
    /// What the cross-entropy keeps for its backward.
    type CeCache: Debug + Send;
    /// Why an operation failed.
    type Error: std::error::Error;

    /// Elements of `x`.
    fn len(&self, x: &Self::T) -> usize;
    /// A buffer of `len` elements, its content unspecified.
    fn alloc(&mut self, len: usize) -> Result<Self::T, Self::Error>;
    /// Host data as a tensor.
    fn upload(&mut self, x: &[f32]) -> Result<Self::T, Self::Error>;
    /// Host indices as an index tensor.
    fn indices(&mut self, x: &[i64]) -> Result<Self::Idx, Self::Error>;
    /// A copy of `x`.
    fn copy(&mut self, x: &Self::T) -> Result<Self::T, Self::Error>;

    /// `y = x W + b` for `n` rows.
    fn linear(
        &mut self,
        p: &Self::P,
        l: &Linear,
        x: &Self::T,
        n: usize,
    ) -> Result<Self::T, Self::Error>;
    /// `dx = dy W^T`.
    fn linear_backward_input(
        &mut self,
        p: &Self::P,
        l: &Linear,
        dy: &Self::T,
        n: usize,
    ) -> Result<Self::T, Self::Error>;
    /// `dW += x^T dy`, `db += sum of dy's rows`.
    fn linear_backward_weight(
        &mut self,
        g: &mut Self::P,
        l: &Linear,
        x: &Self::T,
        dy: &Self::T,
        n: usize,
    ) -> Result<(), Self::Error>;

    /// Layer norm of `n` rows: the output, each row's mean and `1/sqrt(var + eps)`.
    #[allow(clippy::type_complexity)]
    fn layer_norm(
        &mut self,
        p: &Self::P,
        ln: &LayerNorm,
        x: &Self::T,
        n: usize,
    ) -> Result<(Self::T, Self::T, Self::T), Self::Error>;
    /// The input gradient of a layer norm (its forward's input, mean and rstd given);
    /// with `g`, also adds the gain and bias gradients into `g`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &mut self,
        p: &Self::P,
        g: Option<&mut Self::P>,
        ln: &LayerNorm,
        x: &Self::T,
        mean: &Self::T,
        rstd: &Self::T,
        dy: &Self::T,
        n: usize,
    ) -> Result<Self::T, Self::Error>;
    /// Adds a layer norm's gain and bias gradients into `g`.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward_weight(
        &mut self,
        p: &Self::P,
        g: &mut Self::P,
        ln: &LayerNorm,
        x: &Self::T,
        mean: &Self::T,
        rstd: &Self::T,
        dy: &Self::T,
        n: usize,
    ) -> Result<(), Self::Error>;

    /// GELU (tanh approximation), elementwise.
    fn gelu(&mut self, u: &Self::T) -> Result<Self::T, Self::Error>;
    /// `du = dg * gelu'(u)`.
    fn gelu_backward(&mut self, u: &Self::T, dg: &Self::T) -> Result<Self::T, Self::Error>;

    /// `a += b`, elementwise.
    fn add_(&mut self, a: &mut Self::T, b: &Self::T) -> Result<(), Self::Error>;
    /// `x[r] += p[s]` for every row `r` of `x` (rows of `s.len` elements).
    fn add_rows_(&mut self, x: &mut Self::T, p: &Self::P, s: Slot) -> Result<(), Self::Error>;
    /// `g[s] += sum of the rows of x` (rows of `s.len` elements).
    fn sum_rows_acc(&mut self, g: &mut Self::P, s: Slot, x: &Self::T) -> Result<(), Self::Error>;

    /// Attention heads out of row-major activations: `x` (`b*l` rows of `parts` blocks
    /// of `h` heads of `dh` values) as `parts x b x h x l x dh`.
    fn split_heads(
        &mut self,
        x: &Self::T,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<Self::T, Self::Error>;
    /// The inverse of [`Ops::split_heads`].
    fn merge_heads(
        &mut self,
        x: &Self::T,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<Self::T, Self::Error>;
    /// A batched matrix product into `out` from its offset (see [`Bmm`]).
    fn bmm(
        &mut self,
        a: (&Self::T, usize),
        b: (&Self::T, usize),
        out: (&mut Self::T, usize),
        s: Bmm,
    ) -> Result<(), Self::Error>;
    /// Softmax over the last dim of `batch` square `l x l` score matrices; `causal`:
    /// column `j > i` of row `i` is masked out (probability 0).
    fn softmax(
        &mut self,
        scores: Self::T,
        batch: usize,
        l: usize,
        causal: bool,
    ) -> Result<Self::T, Self::Error>;
    /// The gradient of the softmax's input: `y * (dy - rowsum(dy * y))`, rows of `cols`.
    fn softmax_backward(
        &mut self,
        dy: &Self::T,
        y: &Self::T,
        cols: usize,
    ) -> Result<Self::T, Self::Error>;

    /// Rows `idx` of the table `p[s]` (rows of `d`).
    fn embedding(
        &mut self,
        p: &Self::P,
        s: Slot,
        d: usize,
        idx: &Self::Idx,
    ) -> Result<Self::T, Self::Error>;
    /// `g[s][idx[i]] += dx[i]` (rows of `d`).
    fn embedding_backward(
        &mut self,
        g: &mut Self::P,
        s: Slot,
        d: usize,
        dx: &Self::T,
        idx: &Self::Idx,
    ) -> Result<(), Self::Error>;
    /// `batch` sequences of `la` rows of `a` then `lb` rows of `b` (rows of `d`).
    fn concat_seq(
        &mut self,
        a: &Self::T,
        la: usize,
        b: &Self::T,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<Self::T, Self::Error>;
    /// The inverse of [`Ops::concat_seq`].
    fn split_seq(
        &mut self,
        x: &Self::T,
        la: usize,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<(Self::T, Self::T), Self::Error>;

    /// Mean cross-entropy (log-softmax + NLL) of the rows of `logits` (`vocab` wide)
    /// over those with a target (`-100`: none): the loss (1 element) and the cache.
    fn cross_entropy(
        &mut self,
        logits: Self::T,
        targets: &Self::Idx,
        vocab: usize,
    ) -> Result<(Self::T, Self::CeCache), Self::Error>;
    /// The logits' gradient, times `dloss` (1 element) when given.
    fn cross_entropy_backward(
        &mut self,
        c: &Self::CeCache,
        targets: &Self::Idx,
        dloss: Option<&Self::T>,
        vocab: usize,
    ) -> Result<Self::T, Self::Error>;
    /// The share of rows with a target whose largest logit is the target, when the
    /// implementation can tell without waiting (the host can; a device cannot).
    fn accuracy(&mut self, c: &Self::CeCache, targets: &Self::Idx, vocab: usize) -> Option<f32>;
}

/// The host implementation of [`Ops`], in `F` (`f32` as the runtime moves, or `f64`
/// for gradient checks).
#[derive(Clone, Copy, Debug, Default)]
pub struct Host<F>(PhantomData<F>);

impl<F> Host<F> {
    pub fn new() -> Host<F> {
        Host(PhantomData)
    }
}

/// Unwraps a host result (host operations cannot fail).
pub fn infallible<X>(r: Result<X, std::convert::Infallible>) -> X {
    match r {
        Ok(x) => x,
        Err(e) => match e {},
    }
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const GELU_A: f64 = 0.044_715;

/// `sigmoid(2y)` and `dy/dx` at `x`, `y = c (x + a x^3)`: GELU's tanh approximation
/// `0.5 x (1 + tanh(y))` is `x sigmoid(2y)` (one `exp`, much cheaper than `tanh`).
fn gelu_sigmoid<F: Float>(x: F) -> (F, F) {
    let (c, a) = (F::of(GELU_C), F::of(GELU_A));
    let y = c * (x + a * x * x * x);
    let s = F::ONE / (F::ONE + (-(y + y)).exp());
    (s, c * (F::ONE + F::of(3.0) * a * x * x))
}

/// `xhat = (x - mean) * rstd` of row `i` (of `d`), as the forward computed it.
fn xhat_row<F: Float>(x: &[F], mean: &[F], rstd: &[F], i: usize, d: usize) -> Vec<F> {
    x[i * d..(i + 1) * d]
        .iter()
        .map(|&v| (v - mean[i]) * rstd[i])
        .collect()
}

/// Host cross-entropy cache: the logits.
#[derive(Debug)]
pub struct HostCe<F> {
    logits: Vec<F>,
}

/// `log(sum(exp(row)))`, in `f64`.
fn logsumexp<F: Float>(row: &[F]) -> f64 {
    let max = row.iter().fold(F::NEG_INFINITY, |m, &x| m.max(x)).f64();
    let sum: f64 = row.iter().map(|x| (x.f64() - max).exp()).sum();
    max + sum.ln()
}

fn target_of(t: i64) -> Option<usize> {
    usize::try_from(t).ok()
}

/// The host's tensor types.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostFam<F>(PhantomData<F>);

impl<F: Float> Family for HostFam<F> {
    type T = Vec<F>;
    type Idx = Vec<i64>;
    type CeCache = HostCe<F>;
}

impl<F: Float> Ops for Host<F> {
    type Fam = HostFam<F>;
    type T = Vec<F>;
    type P = [F];
    type Idx = Vec<i64>;
    type CeCache = HostCe<F>;
    type Error = std::convert::Infallible;

    fn len(&self, x: &Vec<F>) -> usize {
        x.len()
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<F>, Self::Error> {
        Ok(vec![F::ZERO; len])
    }

    fn upload(&mut self, x: &[f32]) -> Result<Vec<F>, Self::Error> {
        Ok(x.iter().map(|&v| F::of(v as f64)).collect())
    }

    fn indices(&mut self, x: &[i64]) -> Result<Vec<i64>, Self::Error> {
        Ok(x.to_vec())
    }

    fn copy(&mut self, x: &Vec<F>) -> Result<Vec<F>, Self::Error> {
        Ok(x.clone())
    }

    fn linear(&mut self, p: &[F], l: &Linear, x: &Vec<F>, n: usize) -> Result<Vec<F>, Self::Error> {
        let b = l.b.of(p);
        let mut y = Vec::with_capacity(n * l.dout);
        for _ in 0..n {
            y.extend_from_slice(b);
        }
        mm(x, l.w.of(p), &mut y, n, l.din, l.dout, F::ONE);
        Ok(y)
    }

    fn linear_backward_input(
        &mut self,
        p: &[F],
        l: &Linear,
        dy: &Vec<F>,
        n: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let mut dx = vec![F::ZERO; n * l.din];
        mm_nt(dy, l.w.of(p), &mut dx, n, l.dout, l.din, F::ZERO);
        Ok(dx)
    }

    fn linear_backward_weight(
        &mut self,
        g: &mut [F],
        l: &Linear,
        x: &Vec<F>,
        dy: &Vec<F>,
        n: usize,
    ) -> Result<(), Self::Error> {
        mm_tn(x, dy, l.w.of_mut(g), l.din, n, l.dout, F::ONE);
        self.sum_rows_acc(g, l.b, dy)
    }

    fn layer_norm(
        &mut self,
        p: &[F],
        ln: &LayerNorm,
        x: &Vec<F>,
        n: usize,
    ) -> Result<(Vec<F>, Vec<F>, Vec<F>), Self::Error> {
        let d = ln.d;
        let (g, b) = (ln.g.of(p), ln.b.of(p));
        let mut y = vec![F::ZERO; n * d];
        let mut means = vec![F::ZERO; n];
        let mut rstd = vec![F::ZERO; n];
        for i in 0..n {
            let row = &x[i * d..(i + 1) * d];
            let mean = row.iter().map(|v| v.f64()).sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v.f64() - mean).powi(2)).sum::<f64>() / d as f64;
            let r = F::of(1.0 / (var + LN_EPS).sqrt());
            rstd[i] = r;
            let mean = F::of(mean);
            means[i] = mean;
            for j in 0..d {
                let h = (row[j] - mean) * r;
                y[i * d + j] = h * g[j] + b[j];
            }
        }
        Ok((y, means, rstd))
    }

    fn layer_norm_backward(
        &mut self,
        p: &[F],
        g: Option<&mut [F]>,
        ln: &LayerNorm,
        x: &Vec<F>,
        mean: &Vec<F>,
        rstd: &Vec<F>,
        dy: &Vec<F>,
        n: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let d = ln.d;
        let gain = ln.g.of(p);
        let mut dx = vec![F::ZERO; n * d];
        let mut dxhat = vec![F::ZERO; d];
        for i in 0..n {
            let r = rstd[i];
            let xh = xhat_row(x, mean, rstd, i, d);
            let dyr = &dy[i * d..(i + 1) * d];
            let (mut s1, mut s2) = (0.0f64, 0.0f64);
            for j in 0..d {
                dxhat[j] = dyr[j] * gain[j];
                s1 += dxhat[j].f64();
                s2 += (dxhat[j] * xh[j]).f64();
            }
            let (m1, m2) = (F::of(s1 / d as f64), F::of(s2 / d as f64));
            for j in 0..d {
                dx[i * d + j] = r * (dxhat[j] - m1 - xh[j] * m2);
            }
        }
        if let Some(g) = g {
            self.layer_norm_backward_weight(p, g, ln, x, mean, rstd, dy, n)?;
        }
        Ok(dx)
    }

    fn layer_norm_backward_weight(
        &mut self,
        _p: &[F],
        gr: &mut [F],
        ln: &LayerNorm,
        x: &Vec<F>,
        mean: &Vec<F>,
        rstd: &Vec<F>,
        dy: &Vec<F>,
        n: usize,
    ) -> Result<(), Self::Error> {
        let d = ln.d;
        for i in 0..n {
            let xh = xhat_row(x, mean, rstd, i, d);
            let row = &dy[i * d..(i + 1) * d];
            for (a, (dv, h)) in ln.g.of_mut(gr).iter_mut().zip(row.iter().zip(&xh)) {
                *a += *dv * *h;
            }
            for (a, dv) in ln.b.of_mut(gr).iter_mut().zip(row) {
                *a += *dv;
            }
        }
        Ok(())
    }

    fn gelu(&mut self, u: &Vec<F>) -> Result<Vec<F>, Self::Error> {
        Ok(u.iter().map(|&x| x * gelu_sigmoid(x).0).collect())
    }

    fn gelu_backward(&mut self, u: &Vec<F>, dg: &Vec<F>) -> Result<Vec<F>, Self::Error> {
        // gelu'(x) = s + 2 x s (1 - s) dy/dx, s = sigmoid(2y).
        Ok(u.iter()
            .zip(dg)
            .map(|(&x, &d)| {
                let (s, dy) = gelu_sigmoid(x);
                d * (s + F::of(2.0) * x * s * (F::ONE - s) * dy)
            })
            .collect())
    }

    fn add_(&mut self, a: &mut Vec<F>, b: &Vec<F>) -> Result<(), Self::Error> {
        for (x, &y) in a.iter_mut().zip(b) {
            *x += y;
        }
        Ok(())
    }

    fn add_rows_(&mut self, x: &mut Vec<F>, p: &[F], s: Slot) -> Result<(), Self::Error> {
        let src = s.of(p);
        for row in x.chunks_exact_mut(s.len) {
            for (a, &b) in row.iter_mut().zip(src) {
                *a += b;
            }
        }
        Ok(())
    }

    fn sum_rows_acc(&mut self, g: &mut [F], s: Slot, x: &Vec<F>) -> Result<(), Self::Error> {
        let dst = s.of_mut(g);
        for row in x.chunks_exact(s.len) {
            for (a, &v) in dst.iter_mut().zip(row) {
                *a += v;
            }
        }
        Ok(())
    }

    fn split_heads(
        &mut self,
        x: &Vec<F>,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let mut out = vec![F::ZERO; x.len()];
        heads_copy(x, &mut out, b, l, parts, h, dh, true);
        Ok(out)
    }

    fn merge_heads(
        &mut self,
        x: &Vec<F>,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let mut out = vec![F::ZERO; x.len()];
        heads_copy(x, &mut out, b, l, parts, h, dh, false);
        Ok(out)
    }

    fn bmm(
        &mut self,
        a: (&Vec<F>, usize),
        b: (&Vec<F>, usize),
        out: (&mut Vec<F>, usize),
        s: Bmm,
    ) -> Result<(), Self::Error> {
        let Bmm {
            batch,
            m,
            k,
            n,
            ta,
            tb,
            alpha,
        } = s;
        for i in 0..batch {
            let am = &a.0[a.1 + i * m * k..][..m * k];
            let bm = &b.0[b.1 + i * k * n..][..k * n];
            let av = if ta {
                View::rm_t(am, m)
            } else {
                View::rm(am, k)
            };
            let bv = if tb {
                View::rm_t(bm, k)
            } else {
                View::rm(bm, n)
            };
            let c = &mut out.0[out.1 + i * m * n..][..m * n];
            gemm(m, k, n, F::of(alpha), av, bv, F::ZERO, c, n, 1);
        }
        Ok(())
    }

    fn softmax(
        &mut self,
        mut s: Vec<F>,
        batch: usize,
        l: usize,
        causal: bool,
    ) -> Result<Vec<F>, Self::Error> {
        debug_assert_eq!(s.len(), batch * l * l);
        for (r, row) in s.chunks_exact_mut(l).enumerate() {
            let visible = if causal { r % l + 1 } else { l };
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
        Ok(s)
    }

    fn softmax_backward(
        &mut self,
        dy: &Vec<F>,
        y: &Vec<F>,
        cols: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let mut dx = dy.clone();
        for (drow, prow) in dx.chunks_exact_mut(cols).zip(y.chunks_exact(cols)) {
            let dot: F = drow.iter().zip(prow).map(|(&a, &p)| a * p).sum();
            for (x, &p) in drow.iter_mut().zip(prow) {
                *x = p * (*x - dot);
            }
        }
        Ok(dx)
    }

    fn embedding(
        &mut self,
        p: &[F],
        s: Slot,
        d: usize,
        idx: &Vec<i64>,
    ) -> Result<Vec<F>, Self::Error> {
        let table = s.of(p);
        let mut out = Vec::with_capacity(idx.len() * d);
        for &w in idx {
            let w = w as usize;
            out.extend_from_slice(&table[w * d..(w + 1) * d]);
        }
        Ok(out)
    }

    fn embedding_backward(
        &mut self,
        g: &mut [F],
        s: Slot,
        d: usize,
        dx: &Vec<F>,
        idx: &Vec<i64>,
    ) -> Result<(), Self::Error> {
        let gt = s.of_mut(g);
        for (row, &w) in dx.chunks_exact(d).zip(idx) {
            let w = w as usize;
            for (a, &x) in gt[w * d..(w + 1) * d].iter_mut().zip(row) {
                *a += x;
            }
        }
        Ok(())
    }

    fn concat_seq(
        &mut self,
        a: &Vec<F>,
        la: usize,
        b: &Vec<F>,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let mut out = Vec::with_capacity(batch * (la + lb) * d);
        for i in 0..batch {
            out.extend_from_slice(&a[i * la * d..(i + 1) * la * d]);
            out.extend_from_slice(&b[i * lb * d..(i + 1) * lb * d]);
        }
        Ok(out)
    }

    fn split_seq(
        &mut self,
        x: &Vec<F>,
        la: usize,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<(Vec<F>, Vec<F>), Self::Error> {
        let (mut a, mut b) = (
            Vec::with_capacity(batch * la * d),
            Vec::with_capacity(batch * lb * d),
        );
        for seq in x.chunks_exact((la + lb) * d).take(batch) {
            a.extend_from_slice(&seq[..la * d]);
            b.extend_from_slice(&seq[la * d..]);
        }
        Ok((a, b))
    }

    fn cross_entropy(
        &mut self,
        logits: Vec<F>,
        targets: &Vec<i64>,
        vocab: usize,
    ) -> Result<(Vec<F>, HostCe<F>), Self::Error> {
        let count = targets.iter().filter(|t| target_of(**t).is_some()).count();
        let mut loss = 0.0f64;
        for (row, &t) in logits.chunks_exact(vocab).zip(targets) {
            let Some(t) = target_of(t) else { continue };
            loss += logsumexp(row) - row[t].f64();
        }
        let loss = loss / count.max(1) as f64;
        Ok((vec![F::of(loss)], HostCe { logits }))
    }

    fn cross_entropy_backward(
        &mut self,
        c: &HostCe<F>,
        targets: &Vec<i64>,
        dloss: Option<&Vec<F>>,
        vocab: usize,
    ) -> Result<Vec<F>, Self::Error> {
        let count = targets.iter().filter(|t| target_of(**t).is_some()).count();
        let count = count.max(1) as f64;
        let mut d = vec![F::ZERO; c.logits.len()];
        for ((row, dr), &t) in c
            .logits
            .chunks_exact(vocab)
            .zip(d.chunks_exact_mut(vocab))
            .zip(targets)
        {
            let Some(t) = target_of(t) else { continue };
            let lse = logsumexp(row);
            for (j, (g, &x)) in dr.iter_mut().zip(row).enumerate() {
                let p = (x.f64() - lse).exp();
                let y = if j == t { 1.0 } else { 0.0 };
                *g = F::of((p - y) / count);
            }
        }
        if let Some(s) = dloss {
            let s = s[0];
            d.iter_mut().for_each(|x| *x *= s);
        }
        Ok(d)
    }

    fn accuracy(&mut self, c: &HostCe<F>, targets: &Vec<i64>, vocab: usize) -> Option<f32> {
        let (mut hit, mut count) = (0usize, 0usize);
        for (row, &t) in c.logits.chunks_exact(vocab).zip(targets) {
            let Some(t) = target_of(t) else { continue };
            let best = (0..vocab).fold(0, |a, j| if row[j] > row[a] { j } else { a });
            hit += usize::from(best == t);
            count += 1;
        }
        Some(hit as f32 / count.max(1) as f32)
    }
}

/// `split_heads` (`fwd`) or `merge_heads` between `b*l x parts*h*dh` rows and
/// `parts x b x h x l x dh`.
#[allow(clippy::too_many_arguments)]
fn heads_copy<F: Float>(
    x: &[F],
    out: &mut [F],
    b: usize,
    l: usize,
    parts: usize,
    h: usize,
    dh: usize,
    fwd: bool,
) {
    let width = parts * h * dh;
    for part in 0..parts {
        for bi in 0..b {
            for hi in 0..h {
                for li in 0..l {
                    let rows = (bi * l + li) * width + (part * h + hi) * dh;
                    let heads = (((part * b + bi) * h + hi) * l + li) * dh;
                    let (src, dst) = if fwd { (rows, heads) } else { (heads, rows) };
                    out[dst..dst + dh].copy_from_slice(&x[src..src + dh]);
                }
            }
        }
    }
}
