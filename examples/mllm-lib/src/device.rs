//! The model's tensor operations on an Ascend NPU (or its emulator): [`Device`]
//! implements [`Ops`] over `mpipe_runtime::ascend::kernels::Kernels`, each operation
//! one to four aclnn calls queued on the kernels' compute stream (none waits on the
//! host). [`DeviceMllm`] is the model on the device: its parameters and gradient
//! accumulators in device memory, its units' passes [`Net`]'s, as on the host.
//!
//! Memory: every tensor an operation makes ([`DevBuf`]) is a device buffer taken from
//! a [`Pool`] and given back when the tensor is dropped; buffers are kept by size and
//! reused, so once a step has run, the same step allocates nothing. A buffer given
//! back while kernels that use it are still queued is safe to reuse: every kernel of
//! the model runs on the one compute stream, in issue order.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use mpipe_runtime::ascend::device::DeviceModel;
use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::DeviceBuffer;
use mpipe_runtime::ascend::tensor::{DType, DevTensor};
use mpipe_runtime::ascend::AscendError;
use mpipe_runtime::UnitId;

use crate::block::Wgrad;
use crate::data::Sample;
use crate::net::{Net, UnitStash};
use crate::ops::{LayerNorm, Linear, Slot, LN_EPS};
use crate::tensor_ops::{Bmm, Family, Ops};
use crate::Config;

/// Device buffers by size in bytes, reused: [`Pool::take`] allocates only when no
/// buffer of that size is free.
#[derive(Clone, Default)]
pub struct Pool(Arc<Mutex<PoolState>>);

#[derive(Default)]
struct PoolState {
    free: HashMap<usize, Vec<DeviceBuffer>>,
    allocations: usize,
    bytes: usize,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state();
        f.debug_struct("Pool")
            .field("allocations", &s.allocations)
            .field("bytes", &s.bytes)
            .finish()
    }
}

impl Pool {
    pub fn new() -> Pool {
        Pool::default()
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        // A panic while the lock was held cannot leave the free lists inconsistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of `bytes` bytes: a free one, else a new allocation.
    pub fn take(&self, bytes: usize) -> Result<DeviceBuffer, AscendError> {
        let mut s = self.state();
        if let Some(b) = s.free.get_mut(&bytes).and_then(Vec::pop) {
            return Ok(b);
        }
        let b = DeviceBuffer::new(bytes)?;
        s.allocations += 1;
        s.bytes += bytes;
        Ok(b)
    }

    fn give(&self, buf: DeviceBuffer, bytes: usize) {
        self.state().free.entry(bytes).or_default().push(buf);
    }

    /// Buffers allocated so far (never freed while the pool lives).
    pub fn allocations(&self) -> usize {
        self.state().allocations
    }

    /// Bytes allocated so far.
    pub fn bytes(&self) -> usize {
        self.state().bytes
    }
}

/// A device tensor the model owns: a pooled buffer and its flat, contiguous view
/// (`len` elements). Given back to its pool when dropped.
pub struct DevBuf {
    view: DevTensor,
    bytes: usize,
    buf: Option<DeviceBuffer>,
    pool: Pool,
}

impl fmt::Debug for DevBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevBuf")
            .field("dtype", &self.view.dtype())
            .field("len", &self.view.numel())
            .finish()
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give(b, self.bytes);
        }
    }
}

impl DevBuf {
    /// The flat view.
    pub fn view(&self) -> &DevTensor {
        &self.view
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.view.numel()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The whole buffer as a contiguous tensor of `shape`.
    pub fn shaped(&self, shape: &[usize]) -> Result<DevTensor, AscendError> {
        reshape(&self.view, shape)
    }
    /// Elements `off .. off + numel(shape)` as a contiguous tensor of `shape`.
    fn part(&self, off: usize, shape: &[usize]) -> Result<DevTensor, AscendError> {
        sub(&self.view, off, shape)
    }
}

/// `t` (contiguous) as `shape`.
fn reshape(t: &DevTensor, shape: &[usize]) -> Result<DevTensor, AscendError> {
    t.reshape(shape).ok_or_else(|| {
        AscendError::Tensor(format!(
            "mllm: cannot view a tensor of shape {:?} as {shape:?} (a bug in the device model)",
            t.shape()
        ))
    })
}

/// Elements `off ..` of the flat contiguous `t`, as `shape`.
fn sub(t: &DevTensor, off: usize, shape: &[usize]) -> Result<DevTensor, AscendError> {
    let n: usize = shape.iter().product();
    let flat = t.flat().ok_or_else(|| {
        AscendError::Tensor("mllm: a parameter or buffer view is not contiguous".into())
    })?;
    if off + n > flat.numel() {
        return Err(AscendError::Tensor(format!(
            "mllm: elements {off}..{} of a tensor of {} (a bug in the device model)",
            off + n,
            flat.numel()
        )));
    }
    reshape(&flat.narrow(0, off, n), shape)
}

/// A slot of a unit's flat parameter (or gradient) vector, as `shape`.
fn slot(p: &DevTensor, s: Slot, shape: &[usize]) -> Result<DevTensor, AscendError> {
    debug_assert_eq!(shape.iter().product::<usize>(), s.len);
    sub(p, s.off, shape)
}

/// What the device cross-entropy keeps: the log-probabilities and NLL's total weight.
#[derive(Debug)]
pub struct DevCe {
    logp: DevBuf,
    total_weight: DevBuf,
}

/// Tensors made once and kept: causal masks by length, the constant 1.
#[derive(Debug, Default)]
pub struct Consts {
    masks: HashMap<usize, DevBuf>,
    one: Option<DevBuf>,
}

/// [`Ops`] on the device: the kernels (and their compute stream), the pool the
/// tensors come from, and the constants.
pub struct Device<'a> {
    pub k: &'a mut Kernels,
    pub pool: Pool,
    pub consts: &'a mut Consts,
}

impl Device<'_> {
    fn buf(&mut self, dtype: DType, len: usize) -> Result<DevBuf, AscendError> {
        let bytes = (len * dtype.size()).max(1);
        let buf = self.pool.take(bytes)?;
        let view = DevTensor::new(buf.as_ptr() as usize, dtype, &[len]);
        Ok(DevBuf {
            view,
            bytes,
            buf: Some(buf),
            pool: self.pool.clone(),
        })
    }

    /// The `l x l` mask of the positions a causal row cannot see (`j > i`).
    fn causal_mask(&mut self, l: usize) -> Result<DevTensor, AscendError> {
        if !self.consts.masks.contains_key(&l) {
            let m: Vec<f32> = (0..l * l)
                .map(|x| if x % l > x / l { 1.0 } else { 0.0 })
                .collect();
            let f = self.upload(&m)?;
            let b = self.buf(DType::Bool, l * l)?;
            self.k.cast(f.view(), DType::Bool, b.view())?;
            self.consts.masks.insert(l, b);
        }
        self.consts.masks[&l].shaped(&[l, l])
    }

    /// The constant 1 (0-D).
    fn one(&mut self) -> Result<DevTensor, AscendError> {
        if self.consts.one.is_none() {
            let b = self.upload(&[1.0])?;
            self.consts.one = Some(b);
        }
        self.consts.one.as_ref().expect("just made").shaped(&[])
    }

    /// Adds `x` (any shape, `s.len` elements) into slot `s` of `g`.
    fn acc(&mut self, g: &DevTensor, s: Slot, x: &DevTensor) -> Result<(), AscendError> {
        let dst = slot(g, s, x.shape())?;
        self.k.add_(&dst, x, 1.0)
    }

    #[allow(clippy::too_many_arguments)]
    fn ln_backward(
        &mut self,
        p: &DevTensor,
        ln: &LayerNorm,
        x: &DevBuf,
        mean: &DevBuf,
        rstd: &DevBuf,
        dy: &DevBuf,
        n: usize,
    ) -> Result<(DevBuf, DevBuf, DevBuf), AscendError> {
        let d = ln.d;
        let (dx, dw, db) = (
            self.buf(DType::F32, n * d)?,
            self.buf(DType::F32, d)?,
            self.buf(DType::F32, d)?,
        );
        self.k.layer_norm_backward(
            &dy.shaped(&[n, d])?,
            &x.shaped(&[n, d])?,
            &mean.shaped(&[n, 1])?,
            &rstd.shaped(&[n, 1])?,
            &slot(p, ln.g, &[d])?,
            &slot(p, ln.b, &[d])?,
            &dx.shaped(&[n, d])?,
            dw.view(),
            db.view(),
        )?;
        Ok((dx, dw, db))
    }
}

/// The device's tensor types.
#[derive(Clone, Copy, Debug, Default)]
pub struct DevFam;

impl Family for DevFam {
    type T = DevBuf;
    type Idx = DevBuf;
    type CeCache = DevCe;
}

impl Ops for Device<'_> {
    type Fam = DevFam;
    type T = DevBuf;
    type P = DevTensor;
    type Idx = DevBuf;
    type CeCache = DevCe;
    type Error = AscendError;

    fn len(&self, x: &DevBuf) -> usize {
        x.len()
    }

    fn alloc(&mut self, len: usize) -> Result<DevBuf, AscendError> {
        self.buf(DType::F32, len)
    }

    fn upload(&mut self, x: &[f32]) -> Result<DevBuf, AscendError> {
        let b = self.buf(DType::F32, x.len())?;
        self.k.upload_f32(x, b.view())?;
        Ok(b)
    }

    fn indices(&mut self, x: &[i64]) -> Result<DevBuf, AscendError> {
        let b = self.buf(DType::I64, x.len())?;
        self.k.upload_i64(x, b.view())?;
        Ok(b)
    }

    fn copy(&mut self, x: &DevBuf) -> Result<DevBuf, AscendError> {
        let b = self.buf(x.view().dtype(), x.len())?;
        self.k.copy_(b.view(), x.view())?;
        Ok(b)
    }

    fn linear(
        &mut self,
        p: &DevTensor,
        l: &Linear,
        x: &DevBuf,
        n: usize,
    ) -> Result<DevBuf, AscendError> {
        let y = self.buf(DType::F32, n * l.dout)?;
        let yv = y.shaped(&[n, l.dout])?;
        let w = slot(p, l.w, &[l.din, l.dout])?;
        self.k.matmul(&x.shaped(&[n, l.din])?, &w, &yv)?;
        self.k.add_(&yv, &slot(p, l.b, &[l.dout])?, 1.0)?;
        Ok(y)
    }

    fn linear_backward_input(
        &mut self,
        p: &DevTensor,
        l: &Linear,
        dy: &DevBuf,
        n: usize,
    ) -> Result<DevBuf, AscendError> {
        let dx = self.buf(DType::F32, n * l.din)?;
        let w = slot(p, l.w, &[l.din, l.dout])?;
        self.k
            .matmul(&dy.shaped(&[n, l.dout])?, &w.t(), &dx.shaped(&[n, l.din])?)?;
        Ok(dx)
    }

    fn linear_backward_weight(
        &mut self,
        g: &mut DevTensor,
        l: &Linear,
        x: &DevBuf,
        dy: &DevBuf,
        n: usize,
    ) -> Result<(), AscendError> {
        let gw = slot(g, l.w, &[l.din, l.dout])?;
        let (xv, dyv) = (x.shaped(&[n, l.din])?, dy.shaped(&[n, l.dout])?);
        self.k.addmm_(&gw, &xv.t(), &dyv, 1.0, 1.0)?;
        self.sum_rows_acc(g, l.b, dy)
    }

    fn layer_norm(
        &mut self,
        p: &DevTensor,
        ln: &LayerNorm,
        x: &DevBuf,
        n: usize,
    ) -> Result<(DevBuf, DevBuf, DevBuf), AscendError> {
        let d = ln.d;
        let (y, mean, rstd) = (
            self.buf(DType::F32, n * d)?,
            self.buf(DType::F32, n)?,
            self.buf(DType::F32, n)?,
        );
        self.k.layer_norm(
            &x.shaped(&[n, d])?,
            &slot(p, ln.g, &[d])?,
            &slot(p, ln.b, &[d])?,
            LN_EPS as f32,
            &y.shaped(&[n, d])?,
            &mean.shaped(&[n, 1])?,
            &rstd.shaped(&[n, 1])?,
        )?;
        Ok((y, mean, rstd))
    }

    fn layer_norm_backward(
        &mut self,
        p: &DevTensor,
        g: Option<&mut DevTensor>,
        ln: &LayerNorm,
        x: &DevBuf,
        mean: &DevBuf,
        rstd: &DevBuf,
        dy: &DevBuf,
        n: usize,
    ) -> Result<DevBuf, AscendError> {
        let (dx, dw, db) = self.ln_backward(p, ln, x, mean, rstd, dy, n)?;
        if let Some(g) = g {
            self.acc(g, ln.g, dw.view())?;
            self.acc(g, ln.b, db.view())?;
        }
        Ok(dx)
    }

    fn layer_norm_backward_weight(
        &mut self,
        p: &DevTensor,
        g: &mut DevTensor,
        ln: &LayerNorm,
        x: &DevBuf,
        mean: &DevBuf,
        rstd: &DevBuf,
        dy: &DevBuf,
        n: usize,
    ) -> Result<(), AscendError> {
        let (_, dw, db) = self.ln_backward(p, ln, x, mean, rstd, dy, n)?;
        self.acc(g, ln.g, dw.view())?;
        self.acc(g, ln.b, db.view())
    }

    fn gelu(&mut self, u: &DevBuf) -> Result<DevBuf, AscendError> {
        let y = self.buf(DType::F32, u.len())?;
        self.k.gelu(u.view(), y.view())?;
        Ok(y)
    }

    fn gelu_backward(&mut self, u: &DevBuf, dg: &DevBuf) -> Result<DevBuf, AscendError> {
        let du = self.buf(DType::F32, u.len())?;
        self.k.gelu_backward(dg.view(), u.view(), du.view())?;
        Ok(du)
    }

    fn add_(&mut self, a: &mut DevBuf, b: &DevBuf) -> Result<(), AscendError> {
        self.k.add_(a.view(), b.view(), 1.0)
    }

    fn add_rows_(&mut self, x: &mut DevBuf, p: &DevTensor, s: Slot) -> Result<(), AscendError> {
        let xv = x.shaped(&[x.len() / s.len, s.len])?;
        self.k.add_(&xv, &slot(p, s, &[s.len])?, 1.0)
    }

    fn sum_rows_acc(&mut self, g: &mut DevTensor, s: Slot, x: &DevBuf) -> Result<(), AscendError> {
        let sum = self.buf(DType::F32, s.len)?;
        self.k
            .sum_dim0(&x.shaped(&[x.len() / s.len, s.len])?, sum.view())?;
        self.acc(g, s, sum.view())
    }

    fn split_heads(
        &mut self,
        x: &DevBuf,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<DevBuf, AscendError> {
        let out = self.buf(DType::F32, x.len())?;
        let src = x.shaped(&[b, l, parts, h, dh])?.permute(&[2, 0, 3, 1, 4]);
        self.k.copy_(&out.shaped(&[parts, b, h, l, dh])?, &src)?;
        Ok(out)
    }

    fn merge_heads(
        &mut self,
        x: &DevBuf,
        b: usize,
        l: usize,
        parts: usize,
        h: usize,
        dh: usize,
    ) -> Result<DevBuf, AscendError> {
        let out = self.buf(DType::F32, x.len())?;
        let src = x.shaped(&[parts, b, h, l, dh])?.permute(&[1, 3, 0, 2, 4]);
        self.k.copy_(&out.shaped(&[b, l, parts, h, dh])?, &src)?;
        Ok(out)
    }

    fn bmm(
        &mut self,
        a: (&DevBuf, usize),
        b: (&DevBuf, usize),
        out: (&mut DevBuf, usize),
        s: Bmm,
    ) -> Result<(), AscendError> {
        let Bmm {
            batch,
            m,
            k,
            n,
            ta,
            tb,
            alpha,
        } = s;
        let av = if ta {
            a.0.part(a.1, &[batch, k, m])?.t()
        } else {
            a.0.part(a.1, &[batch, m, k])?
        };
        let bv = if tb {
            b.0.part(b.1, &[batch, n, k])?.t()
        } else {
            b.0.part(b.1, &[batch, k, n])?
        };
        let ov = out.0.part(out.1, &[batch, m, n])?;
        self.k.matmul(&av, &bv, &ov)?;
        if alpha != 1.0 {
            self.k.muls_(&ov, alpha as f32)?;
        }
        Ok(())
    }

    fn softmax(
        &mut self,
        scores: DevBuf,
        batch: usize,
        l: usize,
        causal: bool,
    ) -> Result<DevBuf, AscendError> {
        let sv = scores.shaped(&[batch, l, l])?;
        if causal {
            let mask = self.causal_mask(l)?;
            self.k.masked_fill_(&sv, &mask, f32::NEG_INFINITY)?;
        }
        let y = self.buf(DType::F32, scores.len())?;
        self.k.softmax(&sv, &y.shaped(&[batch, l, l])?)?;
        Ok(y)
    }

    fn softmax_backward(
        &mut self,
        dy: &DevBuf,
        y: &DevBuf,
        cols: usize,
    ) -> Result<DevBuf, AscendError> {
        let rows = y.len() / cols;
        let dx = self.buf(DType::F32, y.len())?;
        self.k.softmax_backward(
            &dy.shaped(&[rows, cols])?,
            &y.shaped(&[rows, cols])?,
            &dx.shaped(&[rows, cols])?,
        )?;
        Ok(dx)
    }

    fn embedding(
        &mut self,
        p: &DevTensor,
        s: Slot,
        d: usize,
        idx: &DevBuf,
    ) -> Result<DevBuf, AscendError> {
        let n = idx.len();
        let out = self.buf(DType::F32, n * d)?;
        let table = slot(p, s, &[s.len / d, d])?;
        self.k
            .embedding(&table, idx.view(), &out.shaped(&[n, d])?)?;
        Ok(out)
    }

    fn embedding_backward(
        &mut self,
        g: &mut DevTensor,
        s: Slot,
        d: usize,
        dx: &DevBuf,
        idx: &DevBuf,
    ) -> Result<(), AscendError> {
        let v = s.len / d;
        let dt = self.buf(DType::F32, s.len)?;
        self.k.embedding_dense_backward(
            &dx.shaped(&[idx.len(), d])?,
            idx.view(),
            v,
            &dt.shaped(&[v, d])?,
        )?;
        self.acc(g, s, dt.view())
    }

    fn concat_seq(
        &mut self,
        a: &DevBuf,
        la: usize,
        b: &DevBuf,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<DevBuf, AscendError> {
        let out = self.buf(DType::F32, batch * (la + lb) * d)?;
        let ov = out.shaped(&[batch, la + lb, d])?;
        self.k
            .copy_(&ov.narrow(1, 0, la), &a.shaped(&[batch, la, d])?)?;
        self.k
            .copy_(&ov.narrow(1, la, lb), &b.shaped(&[batch, lb, d])?)?;
        Ok(out)
    }

    fn split_seq(
        &mut self,
        x: &DevBuf,
        la: usize,
        lb: usize,
        batch: usize,
        d: usize,
    ) -> Result<(DevBuf, DevBuf), AscendError> {
        let xv = x.shaped(&[batch, la + lb, d])?;
        let (a, b) = (
            self.buf(DType::F32, batch * la * d)?,
            self.buf(DType::F32, batch * lb * d)?,
        );
        self.k
            .copy_(&a.shaped(&[batch, la, d])?, &xv.narrow(1, 0, la))?;
        self.k
            .copy_(&b.shaped(&[batch, lb, d])?, &xv.narrow(1, la, lb))?;
        Ok((a, b))
    }

    fn cross_entropy(
        &mut self,
        logits: DevBuf,
        targets: &DevBuf,
        vocab: usize,
    ) -> Result<(DevBuf, DevCe), AscendError> {
        let n = logits.len() / vocab;
        let logp = self.buf(DType::F32, n * vocab)?;
        self.k
            .log_softmax(&logits.shaped(&[n, vocab])?, &logp.shaped(&[n, vocab])?)?;
        let (loss, total_weight) = (self.buf(DType::F32, 1)?, self.buf(DType::F32, 1)?);
        self.k.nll_loss(
            &logp.shaped(&[n, vocab])?,
            targets.view(),
            &loss.shaped(&[])?,
            &total_weight.shaped(&[])?,
        )?;
        Ok((loss, DevCe { logp, total_weight }))
    }

    fn cross_entropy_backward(
        &mut self,
        c: &DevCe,
        targets: &DevBuf,
        dloss: Option<&DevBuf>,
        vocab: usize,
    ) -> Result<DevBuf, AscendError> {
        let n = c.logp.len() / vocab;
        let dl = match dloss {
            Some(d) => d.shaped(&[])?,
            None => self.one()?,
        };
        let logp = c.logp.shaped(&[n, vocab])?;
        let dlogp = self.buf(DType::F32, n * vocab)?;
        self.k.nll_loss_backward(
            &dl,
            &logp,
            targets.view(),
            &c.total_weight.shaped(&[])?,
            &dlogp.shaped(&[n, vocab])?,
        )?;
        let dlogits = self.buf(DType::F32, n * vocab)?;
        self.k.log_softmax_backward(
            &dlogp.shaped(&[n, vocab])?,
            &logp,
            &dlogits.shaped(&[n, vocab])?,
        )?;
        Ok(dlogits)
    }

    fn accuracy(&mut self, _c: &DevCe, _targets: &DevBuf, _vocab: usize) -> Option<f32> {
        // Reading the logits back would wait on the device inside the step.
        None
    }
}

/// What a unit keeps on the device from its forward for its backward.
pub type DeviceStash = UnitStash<DevFam>;

/// The model on the device: every unit's parameters and gradient accumulators in
/// device memory (one buffer each, laid out as on the host), the step's
/// micro-batches, one loss per micro-batch kept on the device, and the pool the
/// units' tensors come from.
pub struct DeviceMllm {
    net: Net,
    params: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    sizes: Vec<usize>,
    batch: Vec<Sample>,
    losses: Option<DeviceBuffer>,
    /// Whether this rank has run the last unit's forward (so writes losses).
    computes_loss: bool,
    pool: Pool,
    consts: Consts,
}

impl fmt::Debug for DeviceMllm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMllm")
            .field("sizes", &self.sizes)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl DeviceMllm {
    /// The model of `cfg` on the device of the calling thread, its parameters a copy
    /// of `params` (one flat vector per unit, as [`crate::Mllm::unit_params`]), its
    /// gradients zero.
    pub fn new(
        k: &mut Kernels,
        cfg: &Config,
        params: &[&[f32]],
    ) -> Result<DeviceMllm, AscendError> {
        let (net, layouts) = Net::new(cfg);
        if params.len() != layouts.len()
            || params.iter().zip(&layouts).any(|(p, l)| p.len() != l.len())
        {
            return Err(AscendError::Setup(format!(
                "mllm: {} parameter vectors of lengths {:?} given, the model has {:?} \
                 (pass the host model's unit_params)",
                params.len(),
                params.iter().map(|p| p.len()).collect::<Vec<_>>(),
                layouts.iter().map(|l| l.len()).collect::<Vec<_>>()
            )));
        }
        let sizes: Vec<usize> = layouts.iter().map(|l| l.len()).collect();
        let mut ps = Vec::new();
        let mut gs = Vec::new();
        for (p, &n) in params.iter().zip(&sizes) {
            let pb = DeviceBuffer::new(n * 4)?;
            k.upload_f32(p, &DevTensor::new(pb.as_ptr() as usize, DType::F32, &[n]))?;
            let gb = DeviceBuffer::new(n * 4)?;
            k.zero_(&DevTensor::new(gb.as_ptr() as usize, DType::F32, &[n]))?;
            ps.push(pb);
            gs.push(gb);
        }
        Ok(DeviceMllm {
            net,
            params: ps,
            grads: gs,
            sizes,
            batch: Vec::new(),
            losses: None,
            computes_loss: false,
            pool: Pool::new(),
            consts: Consts::default(),
        })
    }

    pub fn net(&self) -> &Net {
        &self.net
    }

    /// The pool the units' tensors come from (its allocation count stays put after
    /// the first step).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Number of units.
    pub fn units(&self) -> usize {
        self.params.len()
    }

    /// Set the current step's micro-batches (the device buffer of their losses is
    /// allocated for the first batch size only, and reused).
    pub fn set_batch(&mut self, samples: &[Sample]) -> Result<(), AscendError> {
        self.batch = samples.to_vec();
        let bytes = samples.len().max(1) * 4;
        if self.losses.as_ref().map(DeviceBuffer::len) != Some(bytes) {
            self.losses = Some(DeviceBuffer::new(bytes)?);
        }
        Ok(())
    }

    /// `unit`'s parameters (flat, contiguous).
    pub fn params(&self, unit: usize) -> DevTensor {
        DevTensor::new(
            self.params[unit].as_ptr() as usize,
            DType::F32,
            &[self.sizes[unit]],
        )
    }

    /// `unit`'s gradient accumulators (flat, contiguous).
    pub fn grads(&self, unit: usize) -> DevTensor {
        DevTensor::new(
            self.grads[unit].as_ptr() as usize,
            DType::F32,
            &[self.sizes[unit]],
        )
    }

    /// The losses of the step's micro-batches (one f32 each), written by the last
    /// unit's forward.
    pub fn losses(&self) -> Option<DevTensor> {
        let b = self.losses.as_ref()?;
        Some(DevTensor::new(
            b.as_ptr() as usize,
            DType::F32,
            &[self.batch.len()],
        ))
    }

    /// Queue the zeroing of every unit's gradient accumulators.
    pub fn zero_grads(&mut self, k: &mut Kernels) -> Result<(), AscendError> {
        for u in 0..self.units() {
            k.zero_(&self.grads(u))?;
        }
        Ok(())
    }

    fn ops<'a>(&'a mut self, k: &'a mut Kernels) -> Device<'a> {
        Device {
            k,
            pool: self.pool.clone(),
            consts: &mut self.consts,
        }
    }

    /// Copy a view the executor owns into a pooled tensor of the model's.
    fn own(o: &mut Device<'_>, x: &DevTensor) -> Result<DevBuf, AscendError> {
        let b = o.buf(DType::F32, x.numel())?;
        let src = if x.shape().len() == 1 {
            x.clone()
        } else {
            reshape(x, &[x.numel()])?
        };
        o.k.copy_(b.view(), &src)?;
        Ok(b)
    }

    /// Forward of `unit` on micro-batch `mb` from its inputs' outputs, writing its
    /// output into `out` (contiguous, `output_len` elements). The last unit also
    /// writes the loss into [`DeviceMllm::losses`].
    pub fn forward(
        &mut self,
        k: &mut Kernels,
        unit: usize,
        mb: usize,
        inputs: &[DevTensor],
        out: &DevTensor,
    ) -> Result<DeviceStash, AscendError> {
        let last = unit + 1 == self.units();
        let sample = self.batch.get(mb).cloned().ok_or_else(|| {
            AscendError::Setup(format!(
                "mllm: micro-batch {mb} of a step of {} (call set_batch first)",
                self.batch.len()
            ))
        })?;
        let p = self.params(unit);
        let losses = self.losses();
        self.computes_loss |= last;
        let net = self.net.clone();
        let mut o = self.ops(k);
        let input = match inputs {
            [] => None,
            [x] => Some(Self::own(&mut o, x)?),
            _ => {
                return Err(AscendError::Setup(format!(
                    "mllm: unit {unit} takes at most one input, got {}",
                    inputs.len()
                )))
            }
        };
        let f = net.forward(&mut o, unit, &p, &sample, input)?;
        o.k.copy_(&reshape(out, &[out.numel()])?, f.out.view())?;
        if last {
            let l = losses.expect("set_batch made the losses");
            o.k.copy_(&l.narrow(0, mb, 1), f.out.view())?;
        }
        Ok(f.stash)
    }

    /// The gradients of `unit`'s inputs, written into `grad_in` (one per input), from
    /// its output's (`None` for the last unit); what the weight gradients need stays
    /// in the stash.
    pub fn backward_input(
        &mut self,
        k: &mut Kernels,
        unit: usize,
        stash: &mut DeviceStash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
    ) -> Result<(), AscendError> {
        self.backward_with(k, unit, stash, grad_out, grad_in, false)
    }

    /// Fused backward: the input gradients and the weight gradients at once.
    pub fn backward(
        &mut self,
        k: &mut Kernels,
        unit: usize,
        stash: &mut DeviceStash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
    ) -> Result<(), AscendError> {
        self.backward_with(k, unit, stash, grad_out, grad_in, true)
    }

    fn backward_with(
        &mut self,
        k: &mut Kernels,
        unit: usize,
        stash: &mut DeviceStash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
        fused: bool,
    ) -> Result<(), AscendError> {
        let (p, mut g) = (self.params(unit), self.grads(unit));
        let net = self.net.clone();
        let mut o = self.ops(k);
        let dy = grad_out.map(|x| Self::own(&mut o, x)).transpose()?;
        let w = if fused {
            Wgrad::Now(&mut g)
        } else {
            Wgrad::Later
        };
        let dx = net.backward_input(&mut o, &p, stash, dy, w)?;
        if dx.len() != grad_in.len() {
            return Err(AscendError::Setup(format!(
                "mllm: unit {unit} has {} input gradients, {} views given",
                dx.len(),
                grad_in.len()
            )));
        }
        for (d, v) in dx.iter().zip(grad_in) {
            o.k.copy_(&reshape(v, &[v.numel()])?, d.view())?;
        }
        Ok(())
    }

    /// Add the weight gradients a split backward kept in `stash`.
    pub fn backward_weight(
        &mut self,
        k: &mut Kernels,
        unit: usize,
        stash: DeviceStash,
    ) -> Result<(), AscendError> {
        let (p, mut g) = (self.params(unit), self.grads(unit));
        let net = self.net.clone();
        let mut o = self.ops(k);
        net.backward_weight(&mut o, &p, &mut g, &stash)
    }
}

/// The model as the device step drives it ([`mpipe_runtime::ascend::device`]): the
/// same passes as [`DeviceMllm`]'s methods; `losses` only on the rank that runs the
/// last unit's forward (the others have none to read back).
impl DeviceModel for DeviceMllm {
    type Stash = DeviceStash;

    fn output_len(&self, unit: UnitId) -> usize {
        self.net
            .output_len(unit as usize, self.net.config().microbatch_size)
    }

    fn forward(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        mb: usize,
        inputs: &[DevTensor],
        out: &DevTensor,
    ) -> Result<DeviceStash, AscendError> {
        DeviceMllm::forward(self, k, unit as usize, mb, inputs, out)
    }

    fn backward_input(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        _mb: usize,
        stash: &mut DeviceStash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
    ) -> Result<(), AscendError> {
        DeviceMllm::backward_input(self, k, unit as usize, stash, grad_out, grad_in)
    }

    fn backward_weight(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        _mb: usize,
        stash: DeviceStash,
    ) -> Result<(), AscendError> {
        DeviceMllm::backward_weight(self, k, unit as usize, stash)
    }

    fn params(&self, unit: UnitId) -> DevTensor {
        DeviceMllm::params(self, unit as usize)
    }

    fn grads(&self, unit: UnitId) -> DevTensor {
        DeviceMllm::grads(self, unit as usize)
    }

    fn losses(&self) -> Option<DevTensor> {
        if self.computes_loss {
            DeviceMllm::losses(self)
        } else {
            None
        }
    }
}
