//! The operators: each `aclnnXxxGetWorkspaceSize` checks its arguments as CANN's
//! documentation states them and plans a [`Kernel`] (its tensors and a body computing
//! on gathered host vectors); each `aclnnXxx` queues it ([`run`]).

use super::{
    bool_array, broadcast_strides, int_array, offsets, opt_tensor, plan, run, scalar, tensor, Arg,
    Body, Desc, Dt, Fail, Kernel, Mem,
};
use crate::aclnn::*;
use crate::bindings::aclrtStream;
use std::ffi::c_void;

type Ws = *mut u64;
type Ex = *mut *mut aclOpExecutor;
type T = *const aclTensor;
type TMut = *mut aclTensor;

macro_rules! runners {
    ($($name:ident),* $(,)?) => {$(
        /// The second phase: queues the planned kernel on `stream`.
        pub unsafe extern "C" fn $name(
            workspace: *mut c_void,
            workspace_size: u64,
            executor: *mut aclOpExecutor,
            stream: aclrtStream,
        ) -> aclnnStatus {
            run(stringify!($name), workspace, workspace_size, executor, stream)
        }
    )*};
}

runners!(
    aclnnMatmul,
    aclnnBatchMatMul,
    aclnnAddmm,
    aclnnAdd,
    aclnnInplaceAdd,
    aclnnMul,
    aclnnMuls,
    aclnnInplaceMuls,
    aclnnReduceSum,
    aclnnLayerNorm,
    aclnnLayerNormBackward,
    aclnnGelu,
    aclnnGeluBackward,
    aclnnSoftmax,
    aclnnSoftmaxBackward,
    aclnnInplaceMaskedFillScalar,
    aclnnLogSoftmax,
    aclnnLogSoftmaxBackward,
    aclnnNLLLoss,
    aclnnNLLLossBackward,
    aclnnEmbedding,
    aclnnEmbeddingDenseBackward,
    aclnnInplaceCopy,
    aclnnInplaceZero,
    aclnnCast,
    aclnnApplyAdamWV2,
);

// ------------------------------------------------------------------ helpers

fn input(desc: Desc, role: &'static str) -> Arg {
    Arg {
        desc,
        role,
        read: true,
        write: false,
    }
}

fn output(desc: Desc, role: &'static str) -> Arg {
    Arg {
        desc,
        role,
        read: false,
        write: true,
    }
}

fn inout(desc: Desc, role: &'static str) -> Arg {
    Arg {
        desc,
        role,
        read: true,
        write: true,
    }
}

fn kernel(args: Vec<Arg>, scratch: usize, body: Body) -> Result<Kernel, Fail> {
    Ok(Kernel {
        args,
        scratch: scratch as u64,
        body,
    })
}

fn bad(msg: String) -> Fail {
    Fail::invalid(msg)
}

fn dtype(d: &Desc, want: Dt, role: &str) -> Result<(), Fail> {
    if d.dtype == want {
        Ok(())
    } else {
        Err(bad(format!("{role} is {:?}, expected {want:?}", d.dtype)))
    }
}

fn f32s(ds: &[(&Desc, &str)]) -> Result<(), Fail> {
    ds.iter().try_for_each(|(d, r)| dtype(d, Dt::F32, r))
}

fn index_dtype(d: &Desc, role: &str) -> Result<(), Fail> {
    match d.dtype {
        Dt::I64 | Dt::I32 => Ok(()),
        other => Err(bad(format!("{role} is {other:?}, expected I64 (or I32)"))),
    }
}

fn shape_is(d: &Desc, want: &[usize], role: &str) -> Result<(), Fail> {
    if d.shape == want {
        Ok(())
    } else {
        Err(bad(format!(
            "{role} has shape {:?}, expected {want:?}",
            d.shape
        )))
    }
}

fn broadcasts_to(d: &Desc, target: &[usize], role: &str) -> Result<(), Fail> {
    broadcast_strides(d, target).map(|_| ()).ok_or_else(|| {
        bad(format!(
            "{role} of shape {:?} does not broadcast to {target:?}",
            d.shape
        ))
    })
}

/// The numpy broadcast of two shapes.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|j| {
            let x = (j + a.len()).checked_sub(n).map_or(1, |i| a[i]);
            let y = (j + b.len()).checked_sub(n).map_or(1, |i| b[i]);
            match (x, y) {
                (x, y) if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            }
        })
        .collect()
}

fn dim_index(dim: i64, rank: usize) -> Result<usize, Fail> {
    let r = rank as i64;
    let d = if dim < 0 { dim + r } else { dim };
    if (0..r.max(1)).contains(&d) {
        Ok(d as usize)
    } else {
        Err(bad(format!("dim {dim} out of range for a {rank}-D tensor")))
    }
}

/// (outer, n, inner) of `shape` around `dim`.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    if shape.is_empty() {
        return (1, 1, 1);
    }
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

fn gelu(x: f64) -> f64 {
    let c = 2.0 * (2.0 / std::f64::consts::PI).sqrt();
    x / (1.0 + (-c * (x + 0.044715 * x * x * x)).exp())
}

fn gelu_grad(x: f64) -> f64 {
    let c = 2.0 * (2.0 / std::f64::consts::PI).sqrt();
    let u = c * (x + 0.044715 * x * x * x);
    let s = 1.0 / (1.0 + (-u).exp());
    s + x * s * (1.0 - s) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

// ------------------------------------------------------------------ matmul family

/// `z = alpha * x y + beta * z` for row-major `x` (m x k), `y` (k x n) and `z`
/// (m x n), in f64 (the emulator computes in f64 and rounds once, on writing).
fn gemm(
    (m, k, n): (usize, usize, usize),
    alpha: f64,
    x: &[f64],
    y: &[f64],
    beta: f64,
    z: &mut [f64],
) {
    assert!(x.len() == m * k && y.len() == k * n && z.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    let s = |c: usize| isize::try_from(c).expect("a checked tensor's extent fits isize");
    // SAFETY: the three slices hold m x k, k x n and m x n elements (asserted),
    // row-major: row strides k, n and n, column stride 1, so every index the product
    // forms is inside its slice, and `z` is borrowed mutably (no aliasing).
    unsafe {
        matrixmultiply::dgemm(
            m,
            k,
            n,
            alpha,
            x.as_ptr(),
            s(k),
            1,
            y.as_ptr(),
            s(n),
            1,
            beta,
            z.as_mut_ptr(),
            s(n),
            1,
        );
    }
}

fn matmul_plan(a: Desc, b: Desc, o: Desc, batched: bool) -> Result<Kernel, Fail> {
    f32s(&[(&a, "self"), (&b, "mat2"), (&o, "out")])?;
    let (ar, br) = (a.shape.len(), b.shape.len());
    if batched && (ar != 3 || br != 3) {
        return Err(bad(format!(
            "aclnnBatchMatMul needs 3-D self and mat2, got {:?} and {:?}",
            a.shape, b.shape
        )));
    }
    if ar < 2 || br < 2 {
        return Err(bad(format!(
            "self {:?} and mat2 {:?} must have at least 2 dims (the emulator has no 1-D matmul)",
            a.shape, b.shape
        )));
    }
    let (m, k) = (a.shape[ar - 2], a.shape[ar - 1]);
    let (k2, n) = (b.shape[br - 2], b.shape[br - 1]);
    if k != k2 {
        return Err(bad(format!(
            "inner dims differ: self {:?}, mat2 {:?}",
            a.shape, b.shape
        )));
    }
    let batch = if batched {
        if a.shape[0] != b.shape[0] {
            return Err(bad(format!(
                "batch sizes differ: {} and {}",
                a.shape[0], b.shape[0]
            )));
        }
        vec![a.shape[0]]
    } else {
        broadcast(&a.shape[..ar - 2], &b.shape[..br - 2]).ok_or_else(|| {
            bad(format!(
                "batch dims of {:?} and {:?} do not broadcast",
                a.shape, b.shape
            ))
        })?
    };
    let mut want = batch.clone();
    want.extend([m, n]);
    shape_is(&o, &want, "out")?;
    let bn: usize = batch.iter().product();
    let body: Body = Box::new(move |mem: &Mem<'_>| {
        let mut sa = batch.clone();
        sa.extend([m, k]);
        let mut sb = batch.clone();
        sb.extend([k, n]);
        let x = mem.read_as(0, &sa);
        let y = mem.read_as(1, &sb);
        let mut z = vec![0.0; bn * m * n];
        for p in 0..bn {
            let (x, y) = (&x[p * m * k..][..m * k], &y[p * k * n..][..k * n]);
            gemm((m, k, n), 1.0, x, y, 0.0, &mut z[p * m * n..][..m * n]);
        }
        mem.write(2, &z);
        Ok(())
    });
    kernel(
        vec![input(a, "self"), input(b, "mat2"), output(o, "out")],
        0,
        body,
    )
}

pub unsafe extern "C" fn aclnnMatmulGetWorkspaceSize(
    self_: T,
    mat2: T,
    out: TMut,
    _cube_math_type: i8,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnMatmul", ws, ex, || {
        matmul_plan(
            tensor(self_, "self")?,
            tensor(mat2, "mat2")?,
            tensor(out, "out")?,
            false,
        )
    })
}

pub unsafe extern "C" fn aclnnBatchMatMulGetWorkspaceSize(
    self_: T,
    mat2: T,
    out: TMut,
    _cube_math_type: i8,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnBatchMatMul", ws, ex, || {
        matmul_plan(
            tensor(self_, "self")?,
            tensor(mat2, "mat2")?,
            tensor(out, "out")?,
            true,
        )
    })
}

pub unsafe extern "C" fn aclnnAddmmGetWorkspaceSize(
    self_: T,
    mat1: T,
    mat2: T,
    beta: *const aclScalar,
    alpha: *const aclScalar,
    out: TMut,
    _cube_math_type: i8,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnAddmm", ws, ex, || {
        let (c, a, b, o) = (
            tensor(self_, "self")?,
            tensor(mat1, "mat1")?,
            tensor(mat2, "mat2")?,
            tensor(out, "out")?,
        );
        let (beta, alpha) = (scalar(beta, "beta")?, scalar(alpha, "alpha")?);
        f32s(&[(&c, "self"), (&a, "mat1"), (&b, "mat2"), (&o, "out")])?;
        if a.shape.len() != 2 || b.shape.len() != 2 || a.shape[1] != b.shape[0] {
            return Err(bad(format!(
                "mat1 {:?} and mat2 {:?} must be [m, k] and [k, n]",
                a.shape, b.shape
            )));
        }
        let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
        shape_is(&o, &[m, n], "out")?;
        broadcasts_to(&c, &[m, n], "self")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let mut z = if beta == 0.0 {
                vec![0.0; m * n]
            } else {
                mem.read_as(0, &[m, n]).iter().map(|v| beta * v).collect()
            };
            let (x, y) = (mem.read(1), mem.read(2));
            gemm((m, k, n), alpha, &x, &y, 1.0, &mut z);
            mem.write(3, &z);
            Ok(())
        });
        kernel(
            vec![
                input(c, "self"),
                input(a, "mat1"),
                input(b, "mat2"),
                output(o, "out"),
            ],
            0,
            body,
        )
    })
}

// ------------------------------------------------------------------ elementwise

pub unsafe extern "C" fn aclnnAddGetWorkspaceSize(
    self_: T,
    other: T,
    alpha: *const aclScalar,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnAdd", ws, ex, || {
        let (a, b, o) = (
            tensor(self_, "self")?,
            tensor(other, "other")?,
            tensor(out, "out")?,
        );
        let alpha = scalar(alpha, "alpha")?;
        f32s(&[(&a, "self"), (&b, "other"), (&o, "out")])?;
        let shape = broadcast(&a.shape, &b.shape).ok_or_else(|| {
            bad(format!(
                "self {:?} and other {:?} do not broadcast",
                a.shape, b.shape
            ))
        })?;
        shape_is(&o, &shape, "out")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (x, y) = (mem.read_as(0, &shape), mem.read_as(1, &shape));
            let z: Vec<f64> = x.iter().zip(&y).map(|(x, y)| x + alpha * y).collect();
            mem.write(2, &z);
            Ok(())
        });
        kernel(
            vec![input(a, "self"), input(b, "other"), output(o, "out")],
            0,
            body,
        )
    })
}

pub unsafe extern "C" fn aclnnInplaceAddGetWorkspaceSize(
    self_ref: TMut,
    other: T,
    alpha: *const aclScalar,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnInplaceAdd", ws, ex, || {
        let (a, b) = (tensor(self_ref, "selfRef")?, tensor(other, "other")?);
        let alpha = scalar(alpha, "alpha")?;
        f32s(&[(&a, "selfRef"), (&b, "other")])?;
        broadcasts_to(&b, &a.shape, "other")?;
        let shape = a.shape.clone();
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (x, y) = (mem.read(0), mem.read_as(1, &shape));
            let z: Vec<f64> = x.iter().zip(&y).map(|(x, y)| x + alpha * y).collect();
            mem.write(0, &z);
            Ok(())
        });
        kernel(vec![inout(a, "selfRef"), input(b, "other")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnMulGetWorkspaceSize(
    self_: T,
    other: T,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnMul", ws, ex, || {
        let (a, b, o) = (
            tensor(self_, "self")?,
            tensor(other, "other")?,
            tensor(out, "out")?,
        );
        f32s(&[(&a, "self"), (&b, "other"), (&o, "out")])?;
        let shape = broadcast(&a.shape, &b.shape).ok_or_else(|| {
            bad(format!(
                "self {:?} and other {:?} do not broadcast",
                a.shape, b.shape
            ))
        })?;
        shape_is(&o, &shape, "out")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (x, y) = (mem.read_as(0, &shape), mem.read_as(1, &shape));
            let z: Vec<f64> = x.iter().zip(&y).map(|(x, y)| x * y).collect();
            mem.write(2, &z);
            Ok(())
        });
        kernel(
            vec![input(a, "self"), input(b, "other"), output(o, "out")],
            0,
            body,
        )
    })
}

pub unsafe extern "C" fn aclnnMulsGetWorkspaceSize(
    self_: T,
    other: *const aclScalar,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnMuls", ws, ex, || {
        let (a, o) = (tensor(self_, "self")?, tensor(out, "out")?);
        let s = scalar(other, "other")?;
        f32s(&[(&a, "self"), (&o, "out")])?;
        shape_is(&o, &a.shape, "out")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let z: Vec<f64> = mem.read(0).iter().map(|x| x * s).collect();
            mem.write(1, &z);
            Ok(())
        });
        kernel(vec![input(a, "self"), output(o, "out")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnInplaceMulsGetWorkspaceSize(
    self_ref: TMut,
    other: *const aclScalar,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnInplaceMuls", ws, ex, || {
        let a = tensor(self_ref, "selfRef")?;
        let s = scalar(other, "other")?;
        f32s(&[(&a, "selfRef")])?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let z: Vec<f64> = mem.read(0).iter().map(|x| x * s).collect();
            mem.write(0, &z);
            Ok(())
        });
        kernel(vec![inout(a, "selfRef")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnInplaceMaskedFillScalarGetWorkspaceSize(
    self_ref: TMut,
    mask: T,
    value: *const aclScalar,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnInplaceMaskedFillScalar", ws, ex, || {
        let (a, m) = (tensor(self_ref, "selfRef")?, tensor(mask, "mask")?);
        let v = scalar(value, "value")?;
        f32s(&[(&a, "selfRef")])?;
        dtype(&m, Dt::Bool, "mask")?;
        broadcasts_to(&m, &a.shape, "mask")?;
        let shape = a.shape.clone();
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (x, mk) = (mem.read(0), mem.read_as(1, &shape));
            let z: Vec<f64> = x
                .iter()
                .zip(&mk)
                .map(|(&x, &m)| if m != 0.0 { v } else { x })
                .collect();
            mem.write(0, &z);
            Ok(())
        });
        kernel(vec![inout(a, "selfRef"), input(m, "mask")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnGeluGetWorkspaceSize(
    self_: T,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnGelu", ws, ex, || {
        let (a, o) = (tensor(self_, "self")?, tensor(out, "out")?);
        f32s(&[(&a, "self"), (&o, "out")])?;
        shape_is(&o, &a.shape, "out")?;
        let body: Body = Box::new(|mem: &Mem<'_>| {
            let z: Vec<f64> = mem.read(0).into_iter().map(gelu).collect();
            mem.write(1, &z);
            Ok(())
        });
        kernel(vec![input(a, "self"), output(o, "out")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnGeluBackwardGetWorkspaceSize(
    grad_output: T,
    self_: T,
    grad_input: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnGeluBackward", ws, ex, || {
        let (g, x, o) = (
            tensor(grad_output, "gradOutput")?,
            tensor(self_, "self")?,
            tensor(grad_input, "gradInput")?,
        );
        f32s(&[(&g, "gradOutput"), (&x, "self"), (&o, "gradInput")])?;
        shape_is(&g, &x.shape, "gradOutput")?;
        shape_is(&o, &x.shape, "gradInput")?;
        let body: Body = Box::new(|mem: &Mem<'_>| {
            let (g, x) = (mem.read(0), mem.read(1));
            let z: Vec<f64> = g.iter().zip(&x).map(|(g, &x)| g * gelu_grad(x)).collect();
            mem.write(2, &z);
            Ok(())
        });
        kernel(
            vec![
                input(g, "gradOutput"),
                input(x, "self"),
                output(o, "gradInput"),
            ],
            0,
            body,
        )
    })
}

// ------------------------------------------------------------------ reductions

pub unsafe extern "C" fn aclnnReduceSumGetWorkspaceSize(
    self_: T,
    dim: *const aclIntArray,
    keep_dim: bool,
    out_dtype: aclDataType,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnReduceSum", ws, ex, || {
        let (a, o) = (tensor(self_, "self")?, tensor(out, "out")?);
        let dims = int_array(dim, "dim")?;
        f32s(&[(&a, "self"), (&o, "out")])?;
        if out_dtype != ACL_FLOAT {
            return Err(bad(format!(
                "dtype {out_dtype} must be the out's (ACL_FLOAT)"
            )));
        }
        let rank = a.shape.len();
        let mut reduced = vec![false; rank];
        for &d in &dims {
            let i = dim_index(d, rank)?;
            if std::mem::replace(&mut reduced[i], true) {
                return Err(bad(format!("dim {d} listed twice")));
            }
        }
        let keep: Vec<usize> = (0..rank)
            .map(|i| if reduced[i] { 1 } else { a.shape[i] })
            .collect();
        let want: Vec<usize> = if keep_dim {
            keep.clone()
        } else {
            (0..rank)
                .filter(|&i| !reduced[i])
                .map(|i| a.shape[i])
                .collect()
        };
        shape_is(&o, &want, "out")?;
        // Output index of each input element: strides of the kept shape, 0 on reduced dims.
        let mut kst = vec![0; rank];
        let mut s = 1;
        for i in (0..rank).rev() {
            if !reduced[i] {
                kst[i] = s;
            }
            s *= keep[i];
        }
        let shape = a.shape.clone();
        let n_out = o.numel();
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let x = mem.read(0);
            let mut z = vec![0.0; n_out];
            for (v, oi) in x.iter().zip(offsets(&shape, &kst)) {
                z[oi] += v;
            }
            mem.write(1, &z);
            Ok(())
        });
        kernel(vec![input(a, "self"), output(o, "out")], n_out * 8, body)
    })
}

/// The `[rows, 1, ...]` shape of a layer norm's mean and rstd.
fn stat_shape(shape: &[usize], norm: usize) -> Vec<usize> {
    let mut s = shape[..shape.len() - norm].to_vec();
    s.extend(std::iter::repeat_n(1, norm));
    s
}

fn normalized(a: &Desc, ns: &[i64]) -> Result<Vec<usize>, Fail> {
    let r = a.shape.len();
    if ns.is_empty() || ns.len() > r || ns.iter().any(|&d| d < 0) {
        return Err(bad(format!(
            "normalizedShape {ns:?} must be 1..={r} trailing dims of input {:?}",
            a.shape
        )));
    }
    let ns: Vec<usize> = ns.iter().map(|&d| d as usize).collect();
    if a.shape[r - ns.len()..] != ns[..] {
        return Err(bad(format!(
            "normalizedShape {ns:?} is not the trailing dims of input {:?}",
            a.shape
        )));
    }
    Ok(ns)
}

pub unsafe extern "C" fn aclnnLayerNormGetWorkspaceSize(
    input_: T,
    normalized_shape: *const aclIntArray,
    weight: T,
    bias: T,
    eps: f64,
    out: TMut,
    mean_out: TMut,
    rstd_out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnLayerNorm", ws, ex, || {
        let (x, o) = (tensor(input_, "input")?, tensor(out, "out")?);
        let ns = normalized(&x, &int_array(normalized_shape, "normalizedShape")?)?;
        let (w, b) = (opt_tensor(weight, "weight")?, opt_tensor(bias, "bias")?);
        let (mo, ro) = (
            opt_tensor(mean_out, "meanOut")?,
            opt_tensor(rstd_out, "rstdOut")?,
        );
        f32s(&[(&x, "input"), (&o, "out")])?;
        shape_is(&o, &x.shape, "out")?;
        let stats = stat_shape(&x.shape, ns.len());
        for (t, role, want) in [
            (&w, "weight", &ns),
            (&b, "bias", &ns),
            (&mo, "meanOut", &stats),
            (&ro, "rstdOut", &stats),
        ] {
            if let Some(t) = t {
                dtype(t, Dt::F32, role)?;
                shape_is(t, want, role)?;
            }
        }
        let d: usize = ns.iter().product();
        let rows = x.numel().checked_div(d).unwrap_or(0);
        let mut args = vec![input(x, "input"), output(o, "out")];
        let mut slot = |t: Option<Desc>, arg: fn(Desc, &'static str) -> Arg, role| {
            t.map(|t| {
                args.push(arg(t, role));
                args.len() - 1
            })
        };
        let (wi, bi) = (slot(w, input, "weight"), slot(b, input, "bias"));
        let (mi, ri) = (slot(mo, output, "meanOut"), slot(ro, output, "rstdOut"));
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let x = mem.read(0);
            let w = wi.map(|i| mem.read(i));
            let b = bi.map(|i| mem.read(i));
            let mut y = vec![0.0; x.len()];
            let (mut means, mut rstds) = (vec![0.0; rows], vec![0.0; rows]);
            for r in 0..rows {
                let row = &x[r * d..(r + 1) * d];
                let mean = row.iter().sum::<f64>() / d as f64;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                let rstd = 1.0 / (var + eps).sqrt();
                for j in 0..d {
                    let mut v = (row[j] - mean) * rstd;
                    if let Some(w) = &w {
                        v *= w[j];
                    }
                    if let Some(b) = &b {
                        v += b[j];
                    }
                    y[r * d + j] = v;
                }
                means[r] = mean;
                rstds[r] = rstd;
            }
            mem.write(1, &y);
            if let Some(i) = mi {
                mem.write(i, &means);
            }
            if let Some(i) = ri {
                mem.write(i, &rstds);
            }
            Ok(())
        });
        kernel(args, rows * 8, body)
    })
}

pub unsafe extern "C" fn aclnnLayerNormBackwardGetWorkspaceSize(
    grad_out: T,
    input_: T,
    normalized_shape: *const aclIntArray,
    mean: T,
    rstd: T,
    weight: T,
    bias: T,
    output_mask: *const aclBoolArray,
    grad_input_out: TMut,
    grad_weight_out: TMut,
    grad_bias_out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnLayerNormBackward", ws, ex, || {
        let (dy, x) = (tensor(grad_out, "gradOut")?, tensor(input_, "input")?);
        let ns = normalized(&x, &int_array(normalized_shape, "normalizedShape")?)?;
        let (mean, rstd) = (tensor(mean, "mean")?, tensor(rstd, "rstd")?);
        let (w, b) = (opt_tensor(weight, "weight")?, opt_tensor(bias, "bias")?);
        let mask = bool_array(output_mask, "outputMask")?;
        if mask.len() != 3 {
            return Err(bad(format!(
                "outputMask has {} entries, expected 3",
                mask.len()
            )));
        }
        let outs = [
            (grad_input_out, "gradInputOut"),
            (grad_weight_out, "gradWeightOut"),
            (grad_bias_out, "gradBiasOut"),
        ];
        let mut o = Vec::new();
        for ((h, role), &on) in outs.iter().zip(&mask) {
            o.push(if on {
                Some(tensor(*h, role)?)
            } else {
                opt_tensor(*h, role)?
            });
        }
        f32s(&[
            (&dy, "gradOut"),
            (&x, "input"),
            (&mean, "mean"),
            (&rstd, "rstd"),
        ])?;
        shape_is(&dy, &x.shape, "gradOut")?;
        let stats = stat_shape(&x.shape, ns.len());
        shape_is(&mean, &stats, "mean")?;
        shape_is(&rstd, &stats, "rstd")?;
        for (t, role) in [
            (&w, "weight"),
            (&b, "bias"),
            (&o[1], "gradWeightOut"),
            (&o[2], "gradBiasOut"),
        ] {
            if let Some(t) = t {
                dtype(t, Dt::F32, role)?;
                shape_is(t, &ns, role)?;
            }
        }
        if let Some(t) = &o[0] {
            dtype(t, Dt::F32, "gradInputOut")?;
            shape_is(t, &x.shape, "gradInputOut")?;
        }
        let d: usize = ns.iter().product();
        let rows = x.numel().checked_div(d).unwrap_or(0);
        let mut args = vec![
            input(dy, "gradOut"),
            input(x, "input"),
            input(mean, "mean"),
            input(rstd, "rstd"),
        ];
        let wi = w.map(|w| {
            args.push(input(w, "weight"));
            args.len() - 1
        });
        if let Some(b) = b {
            // Read by nothing (the gradients do not depend on the bias); kept as CANN's
            // signature has it, not recorded as an access.
            let _ = b;
        }
        let mut outi = [None; 3];
        for (k, (t, role)) in o
            .into_iter()
            .zip(["gradInputOut", "gradWeightOut", "gradBiasOut"])
            .enumerate()
        {
            if let (Some(t), true) = (t, mask[k]) {
                args.push(output(t, role));
                outi[k] = Some(args.len() - 1);
            }
        }
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (dy, x, mean, rstd) = (mem.read(0), mem.read(1), mem.read(2), mem.read(3));
            let w = wi.map_or_else(|| vec![1.0; d], |i| mem.read(i));
            let mut dx = vec![0.0; x.len()];
            let (mut dw, mut db) = (vec![0.0; d], vec![0.0; d]);
            for r in 0..rows {
                let (m, s) = (mean[r], rstd[r]);
                let xh: Vec<f64> = (0..d).map(|j| (x[r * d + j] - m) * s).collect();
                let g: Vec<f64> = (0..d).map(|j| dy[r * d + j] * w[j]).collect();
                let mg = g.iter().sum::<f64>() / d as f64;
                let mgx = g.iter().zip(&xh).map(|(g, h)| g * h).sum::<f64>() / d as f64;
                for j in 0..d {
                    dx[r * d + j] = s * (g[j] - mg - xh[j] * mgx);
                    dw[j] += dy[r * d + j] * xh[j];
                    db[j] += dy[r * d + j];
                }
            }
            for (k, v) in [dx, dw, db].iter().enumerate() {
                if let Some(i) = outi[k] {
                    mem.write(i, v);
                }
            }
            Ok(())
        });
        kernel(args, rows * 8 + d * 8, body)
    })
}

fn softmax_plan(x: Desc, dim: i64, o: Desc, log: bool) -> Result<Kernel, Fail> {
    f32s(&[(&x, "self"), (&o, "out")])?;
    shape_is(&o, &x.shape, "out")?;
    let dim = dim_index(dim, x.shape.len())?;
    let (outer, n, inner) = around(&x.shape, dim);
    let body: Body = Box::new(move |mem: &Mem<'_>| {
        let x = mem.read(0);
        let mut y = vec![0.0; x.len()];
        for p in 0..outer {
            for q in 0..inner {
                let at = |i: usize| (p * n + i) * inner + q;
                let max = (0..n).map(|i| x[at(i)]).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = (0..n).map(|i| (x[at(i)] - max).exp()).sum();
                for i in 0..n {
                    y[at(i)] = if log {
                        x[at(i)] - max - sum.ln()
                    } else {
                        (x[at(i)] - max).exp() / sum
                    };
                }
            }
        }
        mem.write(1, &y);
        Ok(())
    });
    kernel(
        vec![input(x, "self"), output(o, "out")],
        outer * inner * 8,
        body,
    )
}

fn softmax_backward_plan(g: Desc, y: Desc, dim: i64, o: Desc, log: bool) -> Result<Kernel, Fail> {
    f32s(&[(&g, "gradOutput"), (&y, "output"), (&o, "gradInput")])?;
    shape_is(&g, &y.shape, "gradOutput")?;
    shape_is(&o, &y.shape, "gradInput")?;
    let dim = dim_index(dim, y.shape.len())?;
    let (outer, n, inner) = around(&y.shape, dim);
    let body: Body = Box::new(move |mem: &Mem<'_>| {
        let (g, y) = (mem.read(0), mem.read(1));
        let mut dx = vec![0.0; y.len()];
        for p in 0..outer {
            for q in 0..inner {
                let at = |i: usize| (p * n + i) * inner + q;
                if log {
                    let s: f64 = (0..n).map(|i| g[at(i)]).sum();
                    for i in 0..n {
                        dx[at(i)] = g[at(i)] - y[at(i)].exp() * s;
                    }
                } else {
                    let s: f64 = (0..n).map(|i| g[at(i)] * y[at(i)]).sum();
                    for i in 0..n {
                        dx[at(i)] = y[at(i)] * (g[at(i)] - s);
                    }
                }
            }
        }
        mem.write(2, &dx);
        Ok(())
    });
    kernel(
        vec![
            input(g, "gradOutput"),
            input(y, "output"),
            output(o, "gradInput"),
        ],
        outer * inner * 8,
        body,
    )
}

pub unsafe extern "C" fn aclnnSoftmaxGetWorkspaceSize(
    self_: T,
    dim: i64,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnSoftmax", ws, ex, || {
        softmax_plan(tensor(self_, "self")?, dim, tensor(out, "out")?, false)
    })
}

pub unsafe extern "C" fn aclnnLogSoftmaxGetWorkspaceSize(
    self_: T,
    dim: i64,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnLogSoftmax", ws, ex, || {
        softmax_plan(tensor(self_, "self")?, dim, tensor(out, "out")?, true)
    })
}

pub unsafe extern "C" fn aclnnSoftmaxBackwardGetWorkspaceSize(
    grad_output: T,
    output_: T,
    dim: i64,
    grad_input: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnSoftmaxBackward", ws, ex, || {
        softmax_backward_plan(
            tensor(grad_output, "gradOutput")?,
            tensor(output_, "output")?,
            dim,
            tensor(grad_input, "gradInput")?,
            false,
        )
    })
}

pub unsafe extern "C" fn aclnnLogSoftmaxBackwardGetWorkspaceSize(
    grad_output: T,
    output_: T,
    dim: i64,
    grad_input: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnLogSoftmaxBackward", ws, ex, || {
        softmax_backward_plan(
            tensor(grad_output, "gradOutput")?,
            tensor(output_, "output")?,
            dim,
            tensor(grad_input, "gradInput")?,
            true,
        )
    })
}

// ------------------------------------------------------------------ loss

/// (N, C) of an NLL input of shape `[N, C]` or `[C]`, checking the target's shape.
fn nll_dims(x: &Desc, t: &Desc, w: &Desc) -> Result<(usize, usize, bool), Fail> {
    let (n, c, batched) = match x.shape[..] {
        [n, c] => (n, c, true),
        [c] => (1, c, false),
        _ => {
            return Err(bad(format!(
                "self has shape {:?}, expected [N, C] or [C]",
                x.shape
            )))
        }
    };
    dtype(x, Dt::F32, "self")?;
    index_dtype(t, "target")?;
    shape_is(t, &rows_shape(batched, n), "target")?;
    dtype(w, Dt::F32, "weight")?;
    shape_is(w, &[c], "weight")?;
    Ok((n, c, batched))
}

/// `[n]` for a batched NLL input, `[]` for a single row.
fn rows_shape(batched: bool, n: usize) -> Vec<usize> {
    if batched {
        vec![n]
    } else {
        Vec::new()
    }
}

fn one_element(d: &Desc, role: &str) -> Result<(), Fail> {
    if d.numel() == 1 && d.shape.len() <= 1 {
        Ok(())
    } else {
        Err(bad(format!(
            "{role} has shape {:?}, expected one element ([] or [1])",
            d.shape
        )))
    }
}

pub unsafe extern "C" fn aclnnNLLLossGetWorkspaceSize(
    self_: T,
    target: T,
    weight: T,
    reduction: i64,
    ignore_index: i64,
    out: TMut,
    total_weight_out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnNLLLoss", ws, ex, || {
        let (x, t, w) = (
            tensor(self_, "self")?,
            tensor(target, "target")?,
            tensor(weight, "weight")?,
        );
        let (o, tw) = (
            tensor(out, "out")?,
            tensor(total_weight_out, "totalWeightOut")?,
        );
        let (n, c, batched) = nll_dims(&x, &t, &w)?;
        if !(0..=2).contains(&reduction) {
            return Err(bad(format!(
                "reduction {reduction} (0 none, 1 mean, 2 sum)"
            )));
        }
        dtype(&o, Dt::F32, "out")?;
        dtype(&tw, Dt::F32, "totalWeightOut")?;
        if reduction == 0 {
            shape_is(&o, &rows_shape(batched, n), "out")?;
        } else {
            one_element(&o, "out")?;
        }
        one_element(&tw, "totalWeightOut")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (x, t, w) = (mem.read(0), mem.read_i64(1), mem.read(2));
            let mut losses = vec![0.0; n];
            let mut total = 0.0;
            for r in 0..n {
                let k = t[r];
                if k == ignore_index {
                    continue;
                }
                if k < 0 || k as usize >= c {
                    return Err(format!("target {k} at row {r} is outside [0, {c})"));
                }
                let wk = w[k as usize];
                losses[r] = -wk * x[r * c + k as usize];
                total += wk;
            }
            let out = match reduction {
                0 => losses,
                1 => vec![losses.iter().sum::<f64>() / total],
                _ => vec![losses.iter().sum::<f64>()],
            };
            mem.write(3, &out);
            mem.write(4, &[total]);
            Ok(())
        });
        kernel(
            vec![
                input(x, "self"),
                input(t, "target"),
                input(w, "weight"),
                output(o, "out"),
                output(tw, "totalWeightOut"),
            ],
            n * 8,
            body,
        )
    })
}

pub unsafe extern "C" fn aclnnNLLLossBackwardGetWorkspaceSize(
    grad_output: T,
    self_: T,
    target: T,
    weight: T,
    reduction: i64,
    ignore_index: i64,
    total_weight: T,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnNLLLossBackward", ws, ex, || {
        let g = tensor(grad_output, "gradOutput")?;
        let (x, t, w) = (
            tensor(self_, "self")?,
            tensor(target, "target")?,
            tensor(weight, "weight")?,
        );
        let (tw, o) = (tensor(total_weight, "totalWeight")?, tensor(out, "out")?);
        let (n, c, batched) = nll_dims(&x, &t, &w)?;
        if !(0..=2).contains(&reduction) {
            return Err(bad(format!(
                "reduction {reduction} (0 none, 1 mean, 2 sum)"
            )));
        }
        dtype(&g, Dt::F32, "gradOutput")?;
        if reduction == 0 {
            shape_is(&g, &rows_shape(batched, n), "gradOutput")?;
        } else {
            one_element(&g, "gradOutput")?;
        }
        dtype(&tw, Dt::F32, "totalWeight")?;
        one_element(&tw, "totalWeight")?;
        dtype(&o, Dt::F32, "out")?;
        shape_is(&o, &x.shape, "out")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (g, t, w, tw) = (mem.read(0), mem.read_i64(2), mem.read(3), mem.read(4));
            let mut dx = vec![0.0; n * c];
            for r in 0..n {
                let k = t[r];
                if k == ignore_index {
                    continue;
                }
                if k < 0 || k as usize >= c {
                    return Err(format!("target {k} at row {r} is outside [0, {c})"));
                }
                let gr = match reduction {
                    0 => g[r],
                    1 => g[0] / tw[0],
                    _ => g[0],
                };
                dx[r * c + k as usize] = -w[k as usize] * gr;
            }
            mem.write(5, &dx);
            Ok(())
        });
        kernel(
            vec![
                input(g, "gradOutput"),
                input(x, "self"),
                input(t, "target"),
                input(w, "weight"),
                input(tw, "totalWeight"),
                output(o, "out"),
            ],
            0,
            body,
        )
    })
}

// ------------------------------------------------------------------ embedding

pub unsafe extern "C" fn aclnnEmbeddingGetWorkspaceSize(
    weight: T,
    indices: T,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnEmbedding", ws, ex, || {
        let (w, idx, o) = (
            tensor(weight, "weight")?,
            tensor(indices, "indices")?,
            tensor(out, "out")?,
        );
        dtype(&w, Dt::F32, "weight")?;
        dtype(&o, Dt::F32, "out")?;
        index_dtype(&idx, "indices")?;
        let [v, d] = w.shape[..] else {
            return Err(bad(format!(
                "weight has shape {:?}, expected [V, D]",
                w.shape
            )));
        };
        let mut want = idx.shape.clone();
        want.push(d);
        shape_is(&o, &want, "out")?;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (w, idx) = (mem.read(0), mem.read_i64(1));
            let mut y = Vec::with_capacity(idx.len() * d);
            for (r, &k) in idx.iter().enumerate() {
                if k < 0 || k as usize >= v {
                    return Err(format!("index {k} at position {r} is outside [0, {v})"));
                }
                y.extend_from_slice(&w[k as usize * d..(k as usize + 1) * d]);
            }
            mem.write(2, &y);
            Ok(())
        });
        kernel(
            vec![input(w, "weight"), input(idx, "indices"), output(o, "out")],
            0,
            body,
        )
    })
}

pub unsafe extern "C" fn aclnnEmbeddingDenseBackwardGetWorkspaceSize(
    grad: T,
    indices: T,
    num_weights: u64,
    padding_idx: u64,
    scale_grad_by_freq: bool,
    out: T,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnEmbeddingDenseBackward", ws, ex, || {
        let (g, idx, o) = (
            tensor(grad, "grad")?,
            tensor(indices, "indices")?,
            tensor(out, "out")?,
        );
        dtype(&g, Dt::F32, "grad")?;
        dtype(&o, Dt::F32, "out")?;
        index_dtype(&idx, "indices")?;
        let Some(&d) = g.shape.last().filter(|_| g.shape.len() >= 2) else {
            return Err(bad(format!(
                "grad has shape {:?}, expected [..., D]",
                g.shape
            )));
        };
        if d == 0 || g.numel() / d != idx.numel() {
            return Err(bad(format!(
                "grad {:?} does not hold one row per index of indices {:?}",
                g.shape, idx.shape
            )));
        }
        let v = num_weights as usize;
        shape_is(&o, &[v, d], "out")?;
        let padding = padding_idx as i64;
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (g, idx) = (mem.read(0), mem.read_i64(1));
            let mut count = vec![0usize; v];
            for (r, &k) in idx.iter().enumerate() {
                if k < 0 || k as usize >= v {
                    return Err(format!("index {k} at position {r} is outside [0, {v})"));
                }
                count[k as usize] += 1;
            }
            let mut y = vec![0.0; v * d];
            for (r, &k) in idx.iter().enumerate() {
                if k == padding {
                    continue;
                }
                let k = k as usize;
                let scale = if scale_grad_by_freq {
                    1.0 / count[k] as f64
                } else {
                    1.0
                };
                for j in 0..d {
                    y[k * d + j] += g[r * d + j] * scale;
                }
            }
            mem.write(2, &y);
            Ok(())
        });
        kernel(
            vec![input(g, "grad"), input(idx, "indices"), output(o, "out")],
            0,
            body,
        )
    })
}

// ------------------------------------------------------------------ copies

pub unsafe extern "C" fn aclnnInplaceCopyGetWorkspaceSize(
    self_ref: TMut,
    src: T,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnInplaceCopy", ws, ex, || {
        let (a, s) = (tensor(self_ref, "selfRef")?, tensor(src, "src")?);
        broadcasts_to(&s, &a.shape, "src")?;
        let shape = a.shape.clone();
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let v = mem.read_as(1, &shape);
            mem.write(0, &v);
            Ok(())
        });
        kernel(vec![output(a, "selfRef"), input(s, "src")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnInplaceZeroGetWorkspaceSize(
    self_ref: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnInplaceZero", ws, ex, || {
        let a = tensor(self_ref, "selfRef")?;
        let n = a.numel();
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            mem.write(0, &vec![0.0; n]);
            Ok(())
        });
        kernel(vec![output(a, "selfRef")], 0, body)
    })
}

pub unsafe extern "C" fn aclnnCastGetWorkspaceSize(
    self_: T,
    to: aclDataType,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnCast", ws, ex, || {
        let (a, o) = (tensor(self_, "self")?, tensor(out, "out")?);
        let want = Dt::from_acl(to).ok_or_else(|| bad(format!("dtype {to} is not supported")))?;
        dtype(&o, want, "out")?;
        shape_is(&o, &a.shape, "out")?;
        let body: Body = Box::new(|mem: &Mem<'_>| {
            let v = mem.read(0);
            // Float to integer truncates toward zero (as `as` does), to bool is `!= 0`.
            mem.write(1, &v);
            Ok(())
        });
        kernel(vec![input(a, "self"), output(o, "out")], 0, body)
    })
}

// ------------------------------------------------------------------ optimizer

/// AdamW, as CANN documents `aclnnApplyAdamWV2` (`step` is the current step `t`, read
/// from the device, not incremented):
/// `g = maximize ? -grad : grad`; `var *= 1 - lr * weightDecay`;
/// `m = beta1 * m + (1 - beta1) * g`; `v = beta2 * v + (1 - beta2) * g^2`;
/// with amsgrad `maxv = max(maxv, v)` and `v̂ = maxv / (1 - beta2^t)`, else
/// `v̂ = v / (1 - beta2^t)`; `m̂ = m / (1 - beta1^t)`; `var -= lr * m̂ / (sqrt(v̂) + eps)`.
pub unsafe extern "C" fn aclnnApplyAdamWV2GetWorkspaceSize(
    var_ref: TMut,
    m_ref: TMut,
    v_ref: TMut,
    max_grad_norm_ref: TMut,
    grad: T,
    step: T,
    lr: f32,
    beta1: f32,
    beta2: f32,
    weight_decay: f32,
    eps: f32,
    amsgrad: bool,
    maximize: bool,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus {
    plan("aclnnApplyAdamWV2", ws, ex, || {
        let (p, m, v) = (
            tensor(var_ref, "varRef")?,
            tensor(m_ref, "mRef")?,
            tensor(v_ref, "vRef")?,
        );
        let g = tensor(grad, "grad")?;
        let st = tensor(step, "step")?;
        let mx = if amsgrad {
            Some(tensor(max_grad_norm_ref, "maxGradNormOptionalRef")?)
        } else {
            opt_tensor(max_grad_norm_ref, "maxGradNormOptionalRef")?
        };
        f32s(&[(&p, "varRef"), (&m, "mRef"), (&v, "vRef"), (&g, "grad")])?;
        for (t, role) in [(&m, "mRef"), (&v, "vRef"), (&g, "grad")] {
            shape_is(t, &p.shape, role)?;
        }
        if let Some(t) = &mx {
            dtype(t, Dt::F32, "maxGradNormOptionalRef")?;
            shape_is(t, &p.shape, "maxGradNormOptionalRef")?;
        }
        one_element(&st, "step")?;
        if !matches!(st.dtype, Dt::I64 | Dt::F32) {
            return Err(bad(format!("step is {:?}, expected I64 or F32", st.dtype)));
        }
        let (lr, b1, b2, wd, eps) = (
            f64::from(lr),
            f64::from(beta1),
            f64::from(beta2),
            f64::from(weight_decay),
            f64::from(eps),
        );
        let mut args = vec![
            inout(p, "varRef"),
            inout(m, "mRef"),
            inout(v, "vRef"),
            input(g, "grad"),
            input(st, "step"),
        ];
        let mi = mx.filter(|_| amsgrad).map(|t| {
            args.push(inout(t, "maxGradNormOptionalRef"));
            args.len() - 1
        });
        let body: Body = Box::new(move |mem: &Mem<'_>| {
            let (mut p, mut m, mut v, g) = (mem.read(0), mem.read(1), mem.read(2), mem.read(3));
            let t = mem.read(4)[0];
            if t < 1.0 {
                return Err(format!("step {t} must be at least 1"));
            }
            let mut mx = mi.map(|i| mem.read(i));
            let (c1, c2) = (1.0 - b1.powf(t), 1.0 - b2.powf(t));
            for i in 0..p.len() {
                let gi = if maximize { -g[i] } else { g[i] };
                p[i] *= 1.0 - lr * wd;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let vv = match &mut mx {
                    Some(mx) => {
                        mx[i] = mx[i].max(v[i]);
                        mx[i]
                    }
                    None => v[i],
                };
                p[i] -= lr * (m[i] / c1) / ((vv / c2).sqrt() + eps);
            }
            mem.write(0, &p);
            mem.write(1, &m);
            mem.write(2, &v);
            if let (Some(i), Some(mx)) = (mi, &mx) {
                mem.write(i, mx);
            }
            Ok(())
        });
        kernel(args, 0, body)
    })
}
