//! [`Kernels`]: the model's compute on the device, through aclnn (resolved at run time
//! by `ascend_sys::aclnn::aclnn()`: CANN's `libopapi.so` with a toolkit, the emulator's
//! kernels otherwise).
//!
//! This file is one of the two of the backend allowed `unsafe` (with `safe.rs`): it
//! calls the aclnn entry points through their function pointers, and queues host-to-
//! device copies from host memory it keeps alive. Every call is checked and returns an
//! [`AscendError`] naming the aclnn call (with `aclGetRecentErrMsg`'s text).
//!
//! One `Kernels` per rank thread. Every method queues on the compute stream it owns
//! ([`Kernels::stream`]) and returns without waiting, except [`Kernels::download_f32`]
//! and [`Kernels::synchronize`] (host waits). Each operator is one two-phase aclnn
//! call (`aclnnXxxGetWorkspaceSize`, then `aclnnXxx` on the stream) with fresh
//! `aclTensor`s describing the [`DevTensor`] views (strides and offsets included), so
//! strided views (transposes, permutations, narrows) go to the kernels as they are.
//!
//! Memory: one device workspace, grown on demand (a grown-out workspace is kept until
//! the next [`Kernels::synchronize`], since queued kernels may still use it), the ones
//! vector `aclnnNLLLoss` needs as its class weights (one per class count), and the
//! AdamW step counter. All of these are allocated the first time they are needed, so
//! a training loop allocates nothing after its first step. The step counter is an f32
//! device tensor advanced by a kernel when the step number advances by one, so a
//! steady loop copies nothing for it either.

use super::safe::{acl, DeviceBuffer, Stream};
use super::tensor::{DType, DevTensor};
use super::AscendError;
use ascend_sys as sys;
use ascend_sys::aclnn::*;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

/// The aclnn device-address alignment (`aclCreateTensor`'s `tensorData`).
const ALIGN: usize = 32;

fn acl_dtype(d: DType) -> aclDataType {
    match d {
        DType::F32 => ACL_FLOAT,
        DType::I64 => ACL_INT64,
        DType::Bool => ACL_BOOL,
    }
}

/// An aclnn object (`aclTensor`, `aclScalar`, `aclIntArray`, `aclBoolArray`) owned
/// by the host: made by its `aclCreate*` call, destroyed once by its `aclDestroy*`
/// on drop.
struct Handle<P> {
    raw: *mut P,
    destroy: unsafe extern "C" fn(*const P) -> aclnnStatus,
}

impl<P> Handle<P> {
    /// Takes `raw`, fresh from `call`, or reports the call's failure (null).
    fn new(
        t: &Aclnn,
        call: &'static str,
        raw: *mut P,
        destroy: unsafe extern "C" fn(*const P) -> aclnnStatus,
    ) -> Result<Handle<P>, AscendError> {
        Ok(Handle {
            raw: created(t, call, raw)?,
            destroy,
        })
    }
}

impl<P> Drop for Handle<P> {
    fn drop(&mut self) {
        // SAFETY: made by the matching create call (never null here), destroyed once.
        let _ = unsafe { (self.destroy)(self.raw) };
    }
}

fn status(t: &Aclnn, call: &'static str, code: aclnnStatus) -> Result<(), AscendError> {
    if code == ACLNN_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns the thread's latest message (a NUL-terminated string) or null.
    let p = unsafe { (t.aclGetRecentErrMsg)() };
    let detail = if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated by the API's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(AscendError::Aclnn {
        call,
        code,
        name: aclnn_status_name(code),
        detail,
    })
}

fn created<P>(t: &Aclnn, call: &'static str, p: *mut P) -> Result<*mut P, AscendError> {
    if p.is_null() {
        status(t, call, ACLNN_ERR_PARAM_INVALID)?;
    }
    Ok(p)
}

/// Plans and runs the aclnn operator `$op` on the kernels' stream
/// ([`Kernels::launch`]): its first phase `$plan` is called with the arguments given,
/// then the workspace-size and executor out-parameters.
macro_rules! aclnn {
    ($k:expr, $op:ident / $plan:ident ( $($arg:expr),* $(,)? )) => {{
        let t = $k.t;
        $k.launch((stringify!($plan), stringify!($op)), t.$op, |ws, ex| {
            // SAFETY: the handles passed are alive for the call (the caller holds
            // them until it returns), optional ones may be null, and both
            // out-parameters are writable.
            unsafe { (t.$plan)($($arg,)* ws, ex) }
        })
    }};
}

/// The aclnn kernels of one rank: entry points, compute stream, workspace.
pub struct Kernels {
    t: &'static Aclnn,
    stream: Stream,
    workspace: Option<DeviceBuffer>,
    /// Workspaces grown out of, kept until the next host synchronisation.
    retired: Vec<DeviceBuffer>,
    /// Host memory of queued uploads, kept until the next host synchronisation.
    uploads: Vec<Box<[u8]>>,
    /// `aclnnNLLLoss`'s class weights: ones, per class count.
    ones: HashMap<usize, DeviceBuffer>,
    /// The AdamW step counter (f32 `[1]`), the value it holds once queued work ran,
    /// and a device 1.0 to advance it.
    step: Option<(DeviceBuffer, u64, DeviceBuffer)>,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("stream", &self.stream)
            .field(
                "workspace",
                &self.workspace.as_ref().map_or(0, DeviceBuffer::len),
            )
            .finish_non_exhaustive()
    }
}

impl Kernels {
    /// Resolves aclnn and makes the compute stream (call after the thread's device is
    /// set).
    pub fn new() -> Result<Kernels, AscendError> {
        let t = aclnn().map_err(|e| AscendError::Aclnn {
            call: "aclnn()",
            code: 0,
            name: "load",
            detail: e.to_string(),
        })?;
        Ok(Kernels {
            t,
            stream: Stream::new()?,
            workspace: None,
            retired: Vec::new(),
            uploads: Vec::new(),
            ones: HashMap::new(),
            step: None,
        })
    }

    /// The compute stream every method queues on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Waits for everything queued on the compute stream (a host wait), then releases
    /// the host memory of uploads and the workspaces grown out of.
    pub fn synchronize(&mut self) -> Result<(), AscendError> {
        self.stream.synchronize()?;
        self.uploads.clear();
        self.retired.clear();
        Ok(())
    }

    /// An `aclTensor` of `v`. A base address off the 32-byte alignment is rounded down
    /// (allocations are aligned) and the difference moved into the element offset.
    fn tensor(&self, v: &DevTensor) -> Result<Handle<aclTensor>, AscendError> {
        let es = v.dtype().size();
        let mis = v.base_addr() % ALIGN;
        if !mis.is_multiple_of(es) {
            return Err(AscendError::Tensor(format!(
                "device address {:#x} is not a multiple of the {}-byte element size",
                v.base_addr(),
                es
            )));
        }
        let base = v.base_addr() - mis;
        let offset = v.offset() + mis / es;
        let storage = [(v.storage_len() + mis / es) as i64];
        let dims: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
        let strides: Vec<i64> = v.strides().iter().map(|&d| d as i64).collect();
        // SAFETY: the arrays hold the stated counts and outlive the call; the address is
        // a device address the host never dereferences.
        let raw = unsafe {
            (self.t.aclCreateTensor)(
                dims.as_ptr(),
                dims.len() as u64,
                acl_dtype(v.dtype()),
                strides.as_ptr(),
                offset as i64,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                base as *mut c_void,
            )
        };
        Handle::new(self.t, "aclCreateTensor", raw, self.t.aclDestroyTensor)
    }

    fn scalar(&self, v: f32) -> Result<Handle<aclScalar>, AscendError> {
        let mut v = v;
        // SAFETY: one f32 at the pointer, copied by the call.
        let raw = unsafe { (self.t.aclCreateScalar)((&mut v as *mut f32).cast(), ACL_FLOAT) };
        Handle::new(self.t, "aclCreateScalar", raw, self.t.aclDestroyScalar)
    }

    fn ints(&self, v: &[i64]) -> Result<Handle<aclIntArray>, AscendError> {
        // SAFETY: `v` holds `len` values, copied by the call.
        let raw = unsafe { (self.t.aclCreateIntArray)(v.as_ptr(), v.len() as u64) };
        Handle::new(self.t, "aclCreateIntArray", raw, self.t.aclDestroyIntArray)
    }

    fn bools(&self, v: &[bool]) -> Result<Handle<aclBoolArray>, AscendError> {
        // SAFETY: `v` holds `len` values, copied by the call.
        let raw = unsafe { (self.t.aclCreateBoolArray)(v.as_ptr(), v.len() as u64) };
        Handle::new(
            self.t,
            "aclCreateBoolArray",
            raw,
            self.t.aclDestroyBoolArray,
        )
    }

    /// Both phases: `plan` is the `GetWorkspaceSize` call, then `run` on the compute
    /// stream with the (grown if needed) workspace.
    fn launch(
        &mut self,
        names: (&'static str, &'static str),
        run: aclnnRun_t,
        plan: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
    ) -> Result<(), AscendError> {
        let (mut ws, mut ex) = (0u64, null_mut());
        status(self.t, names.0, plan(&mut ws, &mut ex))?;
        let need = ws as usize;
        let have = self.workspace.as_ref().map_or(0, DeviceBuffer::len);
        if need > have {
            let grown = DeviceBuffer::new(need.next_power_of_two().max(4096))?;
            if let Some(old) = self.workspace.replace(grown) {
                self.retired.push(old);
            }
        }
        let w = match (&self.workspace, need) {
            (Some(b), n) if n > 0 => b.as_ptr(),
            _ => null_mut(),
        };
        // SAFETY: the executor was just planned; the workspace holds `ws` bytes of
        // device memory that stays allocated until the stream has run the kernel (it
        // is only ever replaced into `retired`, freed after a host synchronisation).
        status(self.t, names.1, unsafe {
            run(w, ws, ex, self.stream.raw())
        })
    }

    /// `out = a @ b`: 2-D (`aclnnMatmul`) or 3-D batched (`aclnnBatchMatMul`); `a`/`b`
    /// may be transposed views.
    pub fn matmul(
        &mut self,
        a: &DevTensor,
        b: &DevTensor,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (ta, tb, to) = (self.tensor(a)?, self.tensor(b)?, self.tensor(out)?);
        if a.rank() == 3 && b.rank() == 3 {
            aclnn!(
                self,
                aclnnBatchMatMul
                    / aclnnBatchMatMulGetWorkspaceSize(ta.raw, tb.raw, to.raw, KEEP_DTYPE)
            )
        } else {
            aclnn!(
                self,
                aclnnMatmul / aclnnMatmulGetWorkspaceSize(ta.raw, tb.raw, to.raw, KEEP_DTYPE)
            )
        }
    }

    /// `c = beta * c + alpha * (a @ b)`, 2-D, in place (`aclnnAddmm` with out = c).
    pub fn addmm_(
        &mut self,
        c: &DevTensor,
        a: &DevTensor,
        b: &DevTensor,
        beta: f32,
        alpha: f32,
    ) -> Result<(), AscendError> {
        let (tc, ta, tb, to) = (
            self.tensor(c)?,
            self.tensor(a)?,
            self.tensor(b)?,
            self.tensor(c)?,
        );
        let (sb, sa) = (self.scalar(beta)?, self.scalar(alpha)?);
        aclnn!(
            self,
            aclnnAddmm
                / aclnnAddmmGetWorkspaceSize(
                    tc.raw, ta.raw, tb.raw, sb.raw, sa.raw, to.raw, KEEP_DTYPE
                )
        )
    }

    /// `out = a + alpha * b` (`aclnnAdd`; numpy broadcasting).
    pub fn add(
        &mut self,
        a: &DevTensor,
        b: &DevTensor,
        alpha: f32,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (ta, tb, to, s) = (
            self.tensor(a)?,
            self.tensor(b)?,
            self.tensor(out)?,
            self.scalar(alpha)?,
        );
        aclnn!(
            self,
            aclnnAdd / aclnnAddGetWorkspaceSize(ta.raw, tb.raw, s.raw, to.raw)
        )
    }

    /// `a += alpha * b` (`aclnnInplaceAdd`; `b` broadcast to `a`).
    pub fn add_(&mut self, a: &DevTensor, b: &DevTensor, alpha: f32) -> Result<(), AscendError> {
        let (ta, tb, s) = (self.tensor(a)?, self.tensor(b)?, self.scalar(alpha)?);
        aclnn!(
            self,
            aclnnInplaceAdd / aclnnInplaceAddGetWorkspaceSize(ta.raw, tb.raw, s.raw)
        )
    }

    /// `out = a * b` (`aclnnMul`; broadcasting).
    pub fn mul(
        &mut self,
        a: &DevTensor,
        b: &DevTensor,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (ta, tb, to) = (self.tensor(a)?, self.tensor(b)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnMul / aclnnMulGetWorkspaceSize(ta.raw, tb.raw, to.raw)
        )
    }

    /// `out = a * s` (`aclnnMuls`).
    pub fn muls(&mut self, a: &DevTensor, s: f32, out: &DevTensor) -> Result<(), AscendError> {
        let (ta, to, sc) = (self.tensor(a)?, self.tensor(out)?, self.scalar(s)?);
        aclnn!(
            self,
            aclnnMuls / aclnnMulsGetWorkspaceSize(ta.raw, sc.raw, to.raw)
        )
    }

    /// `a *= s` (`aclnnInplaceMuls`).
    pub fn muls_(&mut self, a: &DevTensor, s: f32) -> Result<(), AscendError> {
        let (ta, sc) = (self.tensor(a)?, self.scalar(s)?);
        aclnn!(
            self,
            aclnnInplaceMuls / aclnnInplaceMulsGetWorkspaceSize(ta.raw, sc.raw)
        )
    }

    /// `out[j] = sum_i x[i, j]` of a 2-D `x` (`aclnnReduceSum`, dims `[0]`).
    pub fn sum_dim0(&mut self, x: &DevTensor, out: &DevTensor) -> Result<(), AscendError> {
        let (tx, to, dims) = (self.tensor(x)?, self.tensor(out)?, self.ints(&[0])?);
        aclnn!(
            self,
            aclnnReduceSum
                / aclnnReduceSumGetWorkspaceSize(tx.raw, dims.raw, false, ACL_FLOAT, to.raw)
        )
    }

    /// Layer norm over the last dim of `x[rows, d]` (`aclnnLayerNorm`): `out`, and the
    /// `mean`/`rstd` (`[rows, 1]`) its backward needs.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &mut self,
        x: &DevTensor,
        w: &DevTensor,
        b: &DevTensor,
        eps: f32,
        out: &DevTensor,
        mean: &DevTensor,
        rstd: &DevTensor,
    ) -> Result<(), AscendError> {
        let d = *x.shape().last().unwrap_or(&1) as i64;
        let (tx, tw, tb) = (self.tensor(x)?, self.tensor(w)?, self.tensor(b)?);
        let (to, tm, tr, ns) = (
            self.tensor(out)?,
            self.tensor(mean)?,
            self.tensor(rstd)?,
            self.ints(&[d])?,
        );
        aclnn!(
            self,
            aclnnLayerNorm
                / aclnnLayerNormGetWorkspaceSize(
                    tx.raw,
                    ns.raw,
                    tw.raw,
                    tb.raw,
                    f64::from(eps),
                    to.raw,
                    tm.raw,
                    tr.raw
                )
        )
    }

    /// The layer norm's backward (`aclnnLayerNormBackward`): `dx`, `dw`, `db`, all three
    /// fresh values (not accumulated).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &mut self,
        dy: &DevTensor,
        x: &DevTensor,
        mean: &DevTensor,
        rstd: &DevTensor,
        w: &DevTensor,
        b: &DevTensor,
        dx: &DevTensor,
        dw: &DevTensor,
        db: &DevTensor,
    ) -> Result<(), AscendError> {
        let d = *x.shape().last().unwrap_or(&1) as i64;
        let (tdy, tx, tm, tr) = (
            self.tensor(dy)?,
            self.tensor(x)?,
            self.tensor(mean)?,
            self.tensor(rstd)?,
        );
        let (tw, tb, tdx, tdw, tdb) = (
            self.tensor(w)?,
            self.tensor(b)?,
            self.tensor(dx)?,
            self.tensor(dw)?,
            self.tensor(db)?,
        );
        let (ns, mask) = (self.ints(&[d])?, self.bools(&[true, true, true])?);
        aclnn!(
            self,
            aclnnLayerNormBackward
                / aclnnLayerNormBackwardGetWorkspaceSize(
                    tdy.raw, tx.raw, ns.raw, tm.raw, tr.raw, tw.raw, tb.raw, mask.raw, tdx.raw,
                    tdw.raw, tdb.raw
                )
        )
    }

    /// GELU, tanh approximation `x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))` (`aclnnGelu`).
    pub fn gelu(&mut self, x: &DevTensor, out: &DevTensor) -> Result<(), AscendError> {
        let (tx, to) = (self.tensor(x)?, self.tensor(out)?);
        aclnn!(self, aclnnGelu / aclnnGeluGetWorkspaceSize(tx.raw, to.raw))
    }

    /// `dx = dy * gelu'(x)` (`aclnnGeluBackward`).
    pub fn gelu_backward(
        &mut self,
        dy: &DevTensor,
        x: &DevTensor,
        dx: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tdy, tx, tdx) = (self.tensor(dy)?, self.tensor(x)?, self.tensor(dx)?);
        aclnn!(
            self,
            aclnnGeluBackward / aclnnGeluBackwardGetWorkspaceSize(tdy.raw, tx.raw, tdx.raw)
        )
    }

    /// Softmax over the last dim (`aclnnSoftmax`, dim -1).
    pub fn softmax(&mut self, x: &DevTensor, out: &DevTensor) -> Result<(), AscendError> {
        let (tx, to) = (self.tensor(x)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnSoftmax / aclnnSoftmaxGetWorkspaceSize(tx.raw, -1, to.raw)
        )
    }

    /// `dx = y * (dy - sum(dy * y))` over the last dim (`aclnnSoftmaxBackward`).
    pub fn softmax_backward(
        &mut self,
        dy: &DevTensor,
        y: &DevTensor,
        dx: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tdy, ty, tdx) = (self.tensor(dy)?, self.tensor(y)?, self.tensor(dx)?);
        aclnn!(
            self,
            aclnnSoftmaxBackward
                / aclnnSoftmaxBackwardGetWorkspaceSize(tdy.raw, ty.raw, -1, tdx.raw)
        )
    }

    /// `x[mask] = value`, `mask` a Bool tensor broadcast to `x`
    /// (`aclnnInplaceMaskedFillScalar`).
    pub fn masked_fill_(
        &mut self,
        x: &DevTensor,
        mask: &DevTensor,
        value: f32,
    ) -> Result<(), AscendError> {
        let (tx, tm, s) = (self.tensor(x)?, self.tensor(mask)?, self.scalar(value)?);
        aclnn!(
            self,
            aclnnInplaceMaskedFillScalar
                / aclnnInplaceMaskedFillScalarGetWorkspaceSize(tx.raw, tm.raw, s.raw)
        )
    }

    /// Log-softmax over the last dim (`aclnnLogSoftmax`, dim -1).
    pub fn log_softmax(&mut self, x: &DevTensor, out: &DevTensor) -> Result<(), AscendError> {
        let (tx, to) = (self.tensor(x)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnLogSoftmax / aclnnLogSoftmaxGetWorkspaceSize(tx.raw, -1, to.raw)
        )
    }

    /// `dx = dy - exp(y) * sum(dy)` over the last dim (`aclnnLogSoftmaxBackward`).
    pub fn log_softmax_backward(
        &mut self,
        dy: &DevTensor,
        y: &DevTensor,
        dx: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tdy, ty, tdx) = (self.tensor(dy)?, self.tensor(y)?, self.tensor(dx)?);
        aclnn!(
            self,
            aclnnLogSoftmaxBackward
                / aclnnLogSoftmaxBackwardGetWorkspaceSize(tdy.raw, ty.raw, -1, tdx.raw)
        )
    }

    /// A device vector of `c` ones (aclnnNLLLoss's class weights), made once per `c`.
    fn ones(&mut self, c: usize) -> Result<DevTensor, AscendError> {
        if !self.ones.contains_key(&c) {
            let buf = DeviceBuffer::new(c * 4)?;
            let v = DevTensor::of(&buf, DType::F32, &[c])?;
            self.upload_f32(&vec![1.0; c], &v)?;
            self.ones.insert(c, buf);
        }
        DevTensor::of(&self.ones[&c], DType::F32, &[c])
    }

    /// Mean negative log-likelihood of `logp[n, c]` at `target` (I64 `[n]`), no class
    /// weights, ignore index -100 (`aclnnNLLLoss`); `out` and `total_weight` are 0-D
    /// (the loss and the count of targets not ignored).
    pub fn nll_loss(
        &mut self,
        logp: &DevTensor,
        target: &DevTensor,
        out: &DevTensor,
        total_weight: &DevTensor,
    ) -> Result<(), AscendError> {
        let c = *logp.shape().last().unwrap_or(&1);
        let w = self.ones(c)?;
        let (tx, tt, tw) = (self.tensor(logp)?, self.tensor(target)?, self.tensor(&w)?);
        let (to, ttw) = (self.tensor(out)?, self.tensor(total_weight)?);
        aclnn!(
            self,
            aclnnNLLLoss
                / aclnnNLLLossGetWorkspaceSize(tx.raw, tt.raw, tw.raw, 1, -100, to.raw, ttw.raw)
        )
    }

    /// The gradient of [`Self::nll_loss`] with respect to `logp`, scaled by `dloss`
    /// (0-D) (`aclnnNLLLossBackward`).
    pub fn nll_loss_backward(
        &mut self,
        dloss: &DevTensor,
        logp: &DevTensor,
        target: &DevTensor,
        total_weight: &DevTensor,
        dlogp: &DevTensor,
    ) -> Result<(), AscendError> {
        let c = *logp.shape().last().unwrap_or(&1);
        let w = self.ones(c)?;
        let (tg, tx, tt, tw) = (
            self.tensor(dloss)?,
            self.tensor(logp)?,
            self.tensor(target)?,
            self.tensor(&w)?,
        );
        let (ttw, to) = (self.tensor(total_weight)?, self.tensor(dlogp)?);
        aclnn!(
            self,
            aclnnNLLLossBackward
                / aclnnNLLLossBackwardGetWorkspaceSize(
                    tg.raw, tx.raw, tt.raw, tw.raw, 1, -100, ttw.raw, to.raw
                )
        )
    }

    /// `out[i] = weight[idx[i]]` (`aclnnEmbedding`).
    pub fn embedding(
        &mut self,
        weight: &DevTensor,
        idx: &DevTensor,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tw, ti, to) = (self.tensor(weight)?, self.tensor(idx)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnEmbedding / aclnnEmbeddingGetWorkspaceSize(tw.raw, ti.raw, to.raw)
        )
    }

    /// `out[v, d]` = the rows of `grad[n, d]` summed by index (`aclnnEmbeddingDenseBackward`,
    /// no padding index, no scaling by frequency); a fresh value.
    pub fn embedding_dense_backward(
        &mut self,
        grad: &DevTensor,
        idx: &DevTensor,
        v: usize,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tg, ti, to) = (self.tensor(grad)?, self.tensor(idx)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnEmbeddingDenseBackward
                / aclnnEmbeddingDenseBackwardGetWorkspaceSize(
                    tg.raw,
                    ti.raw,
                    v as u64,
                    -1i64 as u64,
                    false,
                    to.raw
                )
        )
    }

    /// `dst = src` (`aclnnInplaceCopy`); `src` may be a strided view (this is how a
    /// permuted view is made contiguous) and is broadcast and cast to `dst`.
    pub fn copy_(&mut self, dst: &DevTensor, src: &DevTensor) -> Result<(), AscendError> {
        let (td, ts) = (self.tensor(dst)?, self.tensor(src)?);
        aclnn!(
            self,
            aclnnInplaceCopy / aclnnInplaceCopyGetWorkspaceSize(td.raw, ts.raw)
        )
    }

    /// `x = 0` (`aclnnInplaceZero`).
    pub fn zero_(&mut self, x: &DevTensor) -> Result<(), AscendError> {
        let tx = self.tensor(x)?;
        aclnn!(
            self,
            aclnnInplaceZero / aclnnInplaceZeroGetWorkspaceSize(tx.raw)
        )
    }

    /// `out = x` converted to `dtype` (`aclnnCast`; float to integer truncates).
    pub fn cast(
        &mut self,
        x: &DevTensor,
        dtype: DType,
        out: &DevTensor,
    ) -> Result<(), AscendError> {
        let (tx, to) = (self.tensor(x)?, self.tensor(out)?);
        aclnn!(
            self,
            aclnnCast / aclnnCastGetWorkspaceSize(tx.raw, acl_dtype(dtype), to.raw)
        )
    }

    /// The device step counter holding `step` once the queued work runs: advanced by
    /// one with a kernel (no copy) when `step` is the next one, else uploaded.
    fn step_tensor(&mut self, step: u64) -> Result<DevTensor, AscendError> {
        if self.step.is_none() {
            let (counter, one) = (DeviceBuffer::new(4)?, DeviceBuffer::new(4)?);
            let (c, o) = (
                DevTensor::of(&counter, DType::F32, &[1])?,
                DevTensor::of(&one, DType::F32, &[1])?,
            );
            self.upload_f32(&[0.0], &c)?;
            self.upload_f32(&[1.0], &o)?;
            self.step = Some((counter, 0, one));
        }
        let (counter, held, one) = self.step.as_ref().expect("made above");
        let (c, o, held) = (
            DevTensor::of(counter, DType::F32, &[1])?,
            DevTensor::of(one, DType::F32, &[1])?,
            *held,
        );
        if step == held + 1 {
            self.add_(&c, &o, 1.0)?;
        } else if step != held {
            self.upload_f32(&[step as f32], &c)?;
        }
        if let Some(s) = &mut self.step {
            s.1 = step;
        }
        Ok(c)
    }

    /// One AdamW update of `param` in place (`aclnnApplyAdamWV2`, amsgrad and maximize
    /// off), `step` the 1-based step number (kept on the device). Formula, in f32
    /// inputs computed per element:
    /// `param *= 1 - lr * weight_decay`; `m = beta1 m + (1 - beta1) g`;
    /// `v = beta2 v + (1 - beta2) g^2`;
    /// `param -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)`.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_(
        &mut self,
        param: &DevTensor,
        m: &DevTensor,
        v: &DevTensor,
        grad: &DevTensor,
        step: u64,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    ) -> Result<(), AscendError> {
        let st = self.step_tensor(step)?;
        let (tp, tm, tv, tg, ts) = (
            self.tensor(param)?,
            self.tensor(m)?,
            self.tensor(v)?,
            self.tensor(grad)?,
            self.tensor(&st)?,
        );
        aclnn!(
            self,
            aclnnApplyAdamWV2
                / aclnnApplyAdamWV2GetWorkspaceSize(
                    tp.raw,
                    tm.raw,
                    tv.raw,
                    null_mut(),
                    tg.raw,
                    ts.raw,
                    lr,
                    beta1,
                    beta2,
                    weight_decay,
                    eps,
                    false,
                    false
                )
        )
    }

    /// Queues a host-to-device copy of `bytes` into the contiguous `dst`, from host
    /// memory kept until the next [`Self::synchronize`].
    fn upload(
        &mut self,
        bytes: Box<[u8]>,
        dst: &DevTensor,
        want: DType,
    ) -> Result<(), AscendError> {
        if dst.dtype() != want || !dst.is_contiguous() || dst.numel() * want.size() != bytes.len() {
            return Err(AscendError::Tensor(format!(
                "upload of {} bytes of {want:?} into a {:?} tensor of shape {:?}{}: the \
                 destination must be contiguous, of that dtype and size",
                bytes.len(),
                dst.dtype(),
                dst.shape(),
                if dst.is_contiguous() {
                    ""
                } else {
                    " (strided)"
                }
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: `bytes` is kept in `self.uploads` (its heap storage does not move)
        // until a host synchronisation of the stream has run the copy; the destination
        // is a device address AscendCL checks.
        acl("aclrtMemcpyAsync", unsafe {
            sys::aclrtMemcpyAsync(
                dst.data_addr() as *mut c_void,
                bytes.len(),
                bytes.as_ptr().cast(),
                bytes.len(),
                sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.stream.raw(),
            )
        })?;
        self.uploads.push(bytes);
        Ok(())
    }

    /// Queues the upload of `data` into the contiguous F32 tensor `dst`.
    pub fn upload_f32(&mut self, data: &[f32], dst: &DevTensor) -> Result<(), AscendError> {
        let bytes: Box<[u8]> = data.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.upload(bytes, dst, DType::F32)
    }

    /// Queues the upload of `data` into the contiguous I64 tensor `dst`.
    pub fn upload_i64(&mut self, data: &[i64], dst: &DevTensor) -> Result<(), AscendError> {
        let bytes: Box<[u8]> = data.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.upload(bytes, dst, DType::I64)
    }

    /// Waits for the compute stream ([`Self::synchronize`]: a host wait) and reads the
    /// contiguous F32 tensor `t` back. Use only at the end of a step.
    pub fn download_f32(&mut self, t: &DevTensor) -> Result<Vec<f32>, AscendError> {
        if t.dtype() != DType::F32 || !t.is_contiguous() {
            return Err(AscendError::Tensor(format!(
                "download of a {:?} tensor of shape {:?}: it must be contiguous F32 (copy_ \
                 a strided view into a contiguous buffer first)",
                t.dtype(),
                t.shape()
            )));
        }
        self.synchronize()?;
        let mut bytes = vec![0u8; t.numel() * 4];
        super::safe::read_device(t.data_addr(), &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
