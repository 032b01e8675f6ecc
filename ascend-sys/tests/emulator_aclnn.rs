//! The emulator's aclnn subset: every kernel against a naive host reference on small
//! random inputs (strided, transposed and permuted views, broadcasting; backward
//! kernels against central differences of the host forward), every strictness rule
//! refused with its documented status and a message, kernel counts, and the hazard a
//! kernel reading a buffer another stream writes without an event causes.
//!
//! Tests run in parallel, each on a device of its own (counters are per device).
#![cfg(ascend_emulator)]

use ascend_sys::aclnn::*;
use ascend_sys::emulator::aclnn::recent_error;
use ascend_sys::emulator::counters::{reset, snapshot};
use ascend_sys::emulator::hazards::hazards;
use ascend_sys::*;
use std::ffi::c_void;
use std::ptr::null_mut;

const H2D: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE;
const D2H: aclrtMemcpyKind = aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST;

// ------------------------------------------------------------------ harness

struct Dev {
    s: aclrtStream,
    t: &'static Aclnn,
    /// Allocations freed at the end.
    bufs: Vec<*mut c_void>,
}

impl Drop for Dev {
    fn drop(&mut self) {
        unsafe {
            aclrtSynchronizeStream(self.s);
            for &b in &self.bufs {
                aclrtFree(b);
            }
            aclrtDestroyStream(self.s);
        }
    }
}

fn dev(d: i32) -> Dev {
    // Devices 10.. are this binary's own (one per test).
    static DEVICES: std::sync::Once = std::sync::Once::new();
    DEVICES.call_once(|| std::env::set_var("MPIPE_ASCEND_EMU_DEVICES", "64"));
    let rc = unsafe { aclInit(std::ptr::null()) };
    assert!(rc == ACL_SUCCESS || rc == ACL_ERROR_REPEAT_INITIALIZE);
    assert_eq!(unsafe { aclrtSetDevice(d) }, ACL_SUCCESS);
    reset(d);
    let mut s = null_mut();
    assert_eq!(unsafe { aclrtCreateStream(&mut s) }, ACL_SUCCESS);
    Dev {
        s,
        t: aclnn().expect("emulator table"),
        bufs: Vec::new(),
    }
}

/// A tiny deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

#[derive(Clone, Copy)]
enum Ty {
    F32,
    I64,
    Bool,
}

impl Ty {
    fn acl(self) -> aclDataType {
        match self {
            Ty::F32 => ACL_FLOAT,
            Ty::I64 => ACL_INT64,
            Ty::Bool => ACL_BOOL,
        }
    }
}

/// A device buffer and a view of it (strides and offset in elements).
#[derive(Clone)]
struct View {
    addr: *mut c_void,
    ty: Ty,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    storage: usize,
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * shape[i + 1];
    }
    st
}

impl View {
    fn permute(&self, dims: &[usize]) -> View {
        View {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            ..self.clone()
        }
    }

    fn t(&self) -> View {
        let n = self.shape.len();
        let mut d: Vec<usize> = (0..n).collect();
        d.swap(n - 2, n - 1);
        self.permute(&d)
    }

    /// An `aclTensor` of this view.
    fn acl(&self, d: &Dev) -> *mut aclTensor {
        let dims: Vec<i64> = self.shape.iter().map(|&v| v as i64).collect();
        let st: Vec<i64> = self.strides.iter().map(|&v| v as i64).collect();
        let storage = [self.storage as i64];
        let t = unsafe {
            (d.t.aclCreateTensor)(
                dims.as_ptr(),
                dims.len() as u64,
                self.ty.acl(),
                st.as_ptr(),
                self.offset as i64,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                self.addr,
            )
        };
        assert!(!t.is_null(), "aclCreateTensor: {}", recent_error());
        t
    }
}

fn alloc(d: &mut Dev, bytes: usize) -> *mut c_void {
    let mut p = null_mut();
    let policy = aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST;
    assert_eq!(
        unsafe { aclrtMalloc(&mut p, bytes.max(1), policy) },
        ACL_SUCCESS
    );
    d.bufs.push(p);
    p
}

fn upload_bytes(d: &mut Dev, bytes: &[u8]) -> *mut c_void {
    let p = alloc(d, bytes.len());
    let rc = unsafe { aclrtMemcpy(p, bytes.len(), bytes.as_ptr().cast(), bytes.len(), H2D) };
    assert_eq!(rc, ACL_SUCCESS);
    p
}

fn f32s(d: &mut Dev, x: &[f32], shape: &[usize]) -> View {
    assert_eq!(x.len(), shape.iter().product::<usize>());
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
    View {
        addr: upload_bytes(d, &bytes),
        ty: Ty::F32,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
        storage: x.len(),
    }
}

fn i64s(d: &mut Dev, x: &[i64], shape: &[usize]) -> View {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_ne_bytes()).collect();
    View {
        addr: upload_bytes(d, &bytes),
        ty: Ty::I64,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
        storage: x.len(),
    }
}

fn bools(d: &mut Dev, x: &[bool], shape: &[usize]) -> View {
    let bytes: Vec<u8> = x.iter().map(|&b| u8::from(b)).collect();
    View {
        addr: upload_bytes(d, &bytes),
        ty: Ty::Bool,
        shape: shape.to_vec(),
        strides: contiguous_strides(shape),
        offset: 0,
        storage: x.len(),
    }
}

fn zeros(d: &mut Dev, shape: &[usize]) -> View {
    let n = shape.iter().product();
    f32s(d, &vec![0.0; n], shape)
}

fn zeros_i64(d: &mut Dev, shape: &[usize]) -> View {
    let n = shape.iter().product();
    i64s(d, &vec![0; n], shape)
}

fn sync(d: &Dev) {
    assert_eq!(unsafe { aclrtSynchronizeStream(d.s) }, ACL_SUCCESS);
}

/// The storage of `v` read back whole (synchronises first).
fn storage_bytes(d: &Dev, v: &View, elem: usize) -> Vec<u8> {
    sync(d);
    let n = v.storage * elem;
    let mut out = vec![0u8; n];
    let rc = unsafe { aclrtMemcpy(out.as_mut_ptr().cast(), n, v.addr, n, D2H) };
    assert_eq!(rc, ACL_SUCCESS);
    out
}

/// Element offsets of a view in row-major index order.
fn offsets(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut i| {
            let mut o = offset;
            for (&s, &st) in shape.iter().zip(strides).rev() {
                o += (i % s) * st;
                i /= s;
            }
            o
        })
        .collect()
}

fn read_f32(d: &Dev, v: &View) -> Vec<f32> {
    let b = storage_bytes(d, v, 4);
    offsets(&v.shape, &v.strides, v.offset)
        .into_iter()
        .map(|o| f32::from_ne_bytes(b[o * 4..o * 4 + 4].try_into().unwrap()))
        .collect()
}

fn read_i64(d: &Dev, v: &View) -> Vec<i64> {
    let b = storage_bytes(d, v, 8);
    offsets(&v.shape, &v.strides, v.offset)
        .into_iter()
        .map(|o| i64::from_ne_bytes(b[o * 8..o * 8 + 8].try_into().unwrap()))
        .collect()
}

/// A host copy of what `v` shows, given the storage `data` it was made from.
fn host_view(data: &[f32], v: &View) -> Vec<f32> {
    offsets(&v.shape, &v.strides, v.offset)
        .into_iter()
        .map(|o| data[o])
        .collect()
}

fn scalar(d: &Dev, v: f32) -> *mut aclScalar {
    let mut v = v;
    let s = unsafe { (d.t.aclCreateScalar)((&mut v as *mut f32).cast(), ACL_FLOAT) };
    assert!(!s.is_null());
    s
}

fn ints(d: &Dev, v: &[i64]) -> *mut aclIntArray {
    unsafe { (d.t.aclCreateIntArray)(v.as_ptr(), v.len() as u64) }
}

type Plan<'a> = &'a mut dyn FnMut(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus;

/// Both phases with a workspace of the asked size; panics with the message on failure.
fn exec(d: &mut Dev, name: &str, plan: Plan<'_>, run: aclnnRun_t) {
    let (mut ws, mut ex) = (0u64, null_mut());
    let rc = plan(&mut ws, &mut ex);
    assert_eq!(
        rc,
        ACLNN_SUCCESS,
        "{name}GetWorkspaceSize: {}",
        recent_error()
    );
    let w = if ws > 0 {
        alloc(d, ws as usize)
    } else {
        null_mut()
    };
    let rc = unsafe { run(w, ws, ex, d.s) };
    assert_eq!(rc, ACLNN_SUCCESS, "{name}: {}", recent_error());
}

/// The first phase only: its status (and executor).
fn plan_only(plan: Plan<'_>) -> (aclnnStatus, u64, *mut aclOpExecutor) {
    let (mut ws, mut ex) = (0u64, null_mut());
    let rc = plan(&mut ws, &mut ex);
    (rc, ws, ex)
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// Central differences of `sum(dy * f(x))` with respect to `x`.
fn numeric_grad(x: &[f64], dy: &[f64], f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let h = 1e-6;
    (0..x.len())
        .map(|i| {
            let (mut a, mut b) = (x.to_vec(), x.to_vec());
            a[i] += h;
            b[i] -= h;
            let (fa, fb) = (f(&a), f(&b));
            fa.iter()
                .zip(&fb)
                .zip(dy)
                .map(|((p, q), g)| g * (p - q))
                .sum::<f64>()
                / (2.0 * h)
        })
        .collect()
}

fn matmul_ref(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut z = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            z[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
        }
    }
    z
}

// ------------------------------------------------------------------ kernels vs references

#[test]
fn matmul_of_transposed_and_broadcast_operands() {
    let mut d = dev(10);
    let mut r = Rng(1);
    let (m, k, n, bt) = (3, 5, 4, 2);
    // a is stored [k, m] and used transposed; b is contiguous [k, n].
    let at = r.vec(k * m);
    let bv = r.vec(k * n);
    let a = f32s(&mut d, &at, &[k, m]).t();
    let b = f32s(&mut d, &bv, &[k, n]);
    let o = zeros(&mut d, &[m, n]);
    let (ta, tb, to) = (a.acl(&d), b.acl(&d), o.acl(&d));
    let t = d.t;
    exec(
        &mut d,
        "aclnnMatmul",
        &mut |ws, ex| unsafe { (t.aclnnMatmulGetWorkspaceSize)(ta, tb, to, KEEP_DTYPE, ws, ex) },
        t.aclnnMatmul,
    );
    let want = matmul_ref(&f64s(&host_view(&at, &a)), &f64s(&bv), m, k, n);
    close(&read_f32(&d, &o), &want, 1e-6, "matmul");

    // Batched self [bt, m, k] (stored [m, bt, k], permuted) times a broadcast [k, n].
    let xs = r.vec(m * bt * k);
    let x = f32s(&mut d, &xs, &[m, bt, k]).permute(&[1, 0, 2]);
    let o3 = zeros(&mut d, &[bt, m, n]);
    let (tx, to3) = (x.acl(&d), o3.acl(&d));
    exec(
        &mut d,
        "aclnnMatmul",
        &mut |ws, ex| unsafe { (t.aclnnMatmulGetWorkspaceSize)(tx, tb, to3, KEEP_DTYPE, ws, ex) },
        t.aclnnMatmul,
    );
    let xh = f64s(&host_view(&xs, &x));
    let mut want = Vec::new();
    for p in 0..bt {
        want.extend(matmul_ref(
            &xh[p * m * k..(p + 1) * m * k],
            &f64s(&bv),
            m,
            k,
            n,
        ));
    }
    close(&read_f32(&d, &o3), &want, 1e-6, "broadcast matmul");

    // BatchMatMul with a transposed second operand: [bt, m, k] @ [bt, n, k]^T.
    let ys = r.vec(bt * n * k);
    let y = f32s(&mut d, &ys, &[bt, n, k]).t();
    let o4 = zeros(&mut d, &[bt, m, n]);
    let (ty, to4) = (y.acl(&d), o4.acl(&d));
    exec(
        &mut d,
        "aclnnBatchMatMul",
        &mut |ws, ex| unsafe {
            (t.aclnnBatchMatMulGetWorkspaceSize)(tx, ty, to4, KEEP_DTYPE, ws, ex)
        },
        t.aclnnBatchMatMul,
    );
    let yh = f64s(&host_view(&ys, &y));
    let mut want = Vec::new();
    for p in 0..bt {
        want.extend(matmul_ref(
            &xh[p * m * k..(p + 1) * m * k],
            &yh[p * k * n..(p + 1) * k * n],
            m,
            k,
            n,
        ));
    }
    close(&read_f32(&d, &o4), &want, 1e-6, "batch matmul");
}

#[test]
fn addmm_accumulates_in_place() {
    let mut d = dev(11);
    let mut r = Rng(2);
    let (m, k, n) = (4, 3, 5);
    let (cv, av, bv) = (r.vec(m * n), r.vec(m * k), r.vec(n * k));
    let c = f32s(&mut d, &cv, &[m, n]);
    let a = f32s(&mut d, &av, &[m, k]);
    let b = f32s(&mut d, &bv, &[n, k]).t();
    let (tc, ta, tb, tout) = (c.acl(&d), a.acl(&d), b.acl(&d), c.acl(&d));
    let (beta, alpha) = (scalar(&d, 0.5), scalar(&d, 2.0));
    let t = d.t;
    exec(
        &mut d,
        "aclnnAddmm",
        &mut |ws, ex| unsafe {
            (t.aclnnAddmmGetWorkspaceSize)(tc, ta, tb, beta, alpha, tout, KEEP_DTYPE, ws, ex)
        },
        t.aclnnAddmm,
    );
    let ab = matmul_ref(&f64s(&av), &f64s(&host_view(&bv, &b)), m, k, n);
    let want: Vec<f64> = cv
        .iter()
        .zip(&ab)
        .map(|(&c, p)| 0.5 * f64::from(c) + 2.0 * p)
        .collect();
    close(&read_f32(&d, &c), &want, 1e-6, "addmm");
}

#[test]
fn elementwise_with_broadcasting() {
    let mut d = dev(12);
    let mut r = Rng(3);
    let (rows, cols) = (3, 4);
    let (xv, bv, cv) = (r.vec(rows * cols), r.vec(cols), r.vec(rows));
    // x is a transposed view of [cols, rows] storage.
    let xs = r.vec(cols * rows);
    let x = f32s(&mut d, &xs, &[cols, rows]).t();
    let xh = host_view(&xs, &x);
    let a = f32s(&mut d, &xv, &[rows, cols]);
    let b = f32s(&mut d, &bv, &[cols]);
    let c = f32s(&mut d, &cv, &[rows, 1]);
    let out = zeros(&mut d, &[rows, cols]);
    let t = d.t;
    let (tx, ta, tb, tc, to) = (x.acl(&d), a.acl(&d), b.acl(&d), c.acl(&d), out.acl(&d));
    let half = scalar(&d, 0.5);
    // add: x + 0.5 * b (b broadcast over rows)
    exec(
        &mut d,
        "aclnnAdd",
        &mut |ws, ex| unsafe { (t.aclnnAddGetWorkspaceSize)(tx, tb, half, to, ws, ex) },
        t.aclnnAdd,
    );
    let want: Vec<f64> = (0..rows * cols)
        .map(|i| f64::from(xh[i]) + 0.5 * f64::from(bv[i % cols]))
        .collect();
    close(&read_f32(&d, &out), &want, 1e-6, "add");
    // mul: x * c (c [rows, 1] broadcast over columns)
    exec(
        &mut d,
        "aclnnMul",
        &mut |ws, ex| unsafe { (t.aclnnMulGetWorkspaceSize)(tx, tc, to, ws, ex) },
        t.aclnnMul,
    );
    let want: Vec<f64> = (0..rows * cols)
        .map(|i| f64::from(xh[i]) * f64::from(cv[i / cols]))
        .collect();
    close(&read_f32(&d, &out), &want, 1e-6, "mul");
    // muls: x * 3
    let three = scalar(&d, 3.0);
    exec(
        &mut d,
        "aclnnMuls",
        &mut |ws, ex| unsafe { (t.aclnnMulsGetWorkspaceSize)(tx, three, to, ws, ex) },
        t.aclnnMuls,
    );
    let want: Vec<f64> = xh.iter().map(|&v| 3.0 * f64::from(v)).collect();
    close(&read_f32(&d, &out), &want, 1e-6, "muls");
    // in place: a += 0.5 * b, then a *= 3
    exec(
        &mut d,
        "aclnnInplaceAdd",
        &mut |ws, ex| unsafe { (t.aclnnInplaceAddGetWorkspaceSize)(ta, tb, half, ws, ex) },
        t.aclnnInplaceAdd,
    );
    exec(
        &mut d,
        "aclnnInplaceMuls",
        &mut |ws, ex| unsafe { (t.aclnnInplaceMulsGetWorkspaceSize)(ta, three, ws, ex) },
        t.aclnnInplaceMuls,
    );
    let want: Vec<f64> = (0..rows * cols)
        .map(|i| 3.0 * (f64::from(xv[i]) + 0.5 * f64::from(bv[i % cols])))
        .collect();
    close(&read_f32(&d, &a), &want, 1e-6, "inplace add, muls");
    // masked fill with a [1, cols] mask broadcast over rows
    let maskv = [true, false, false, true];
    let mask = bools(&mut d, &maskv, &[1, cols]);
    let tm = mask.acl(&d);
    let fill = scalar(&d, -7.0);
    exec(
        &mut d,
        "aclnnInplaceMaskedFillScalar",
        &mut |ws, ex| unsafe {
            (t.aclnnInplaceMaskedFillScalarGetWorkspaceSize)(ta, tm, fill, ws, ex)
        },
        t.aclnnInplaceMaskedFillScalar,
    );
    let want2: Vec<f64> = (0..rows * cols)
        .map(|i| if maskv[i % cols] { -7.0 } else { want[i] })
        .collect();
    close(&read_f32(&d, &a), &want2, 1e-6, "masked fill");
}

#[test]
fn reduce_sum_over_dims() {
    let mut d = dev(13);
    let mut r = Rng(4);
    let (p, q) = (5, 3);
    let xs = r.vec(q * p);
    let x = f32s(&mut d, &xs, &[q, p]).t(); // [p, q], strided
    let xh = host_view(&xs, &x);
    let out = zeros(&mut d, &[q]);
    let keep = zeros(&mut d, &[p, 1]);
    let t = d.t;
    let (tx, to, tk) = (x.acl(&d), out.acl(&d), keep.acl(&d));
    let (d0, d1) = (ints(&d, &[0]), ints(&d, &[-1]));
    exec(
        &mut d,
        "aclnnReduceSum",
        &mut |ws, ex| unsafe {
            (t.aclnnReduceSumGetWorkspaceSize)(tx, d0, false, ACL_FLOAT, to, ws, ex)
        },
        t.aclnnReduceSum,
    );
    let want: Vec<f64> = (0..q)
        .map(|j| (0..p).map(|i| f64::from(xh[i * q + j])).sum())
        .collect();
    close(&read_f32(&d, &out), &want, 1e-6, "sum dim 0");
    exec(
        &mut d,
        "aclnnReduceSum",
        &mut |ws, ex| unsafe {
            (t.aclnnReduceSumGetWorkspaceSize)(tx, d1, true, ACL_FLOAT, tk, ws, ex)
        },
        t.aclnnReduceSum,
    );
    let want: Vec<f64> = (0..p)
        .map(|i| (0..q).map(|j| f64::from(xh[i * q + j])).sum())
        .collect();
    close(&read_f32(&d, &keep), &want, 1e-6, "sum dim -1 keepdim");
}

fn layer_norm_ref(x: &[f64], w: &[f64], b: &[f64], dd: usize, eps: f64) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for r in 0..x.len() / dd {
        let row = &x[r * dd..(r + 1) * dd];
        let mean = row.iter().sum::<f64>() / dd as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / dd as f64;
        for j in 0..dd {
            y[r * dd + j] = (row[j] - mean) / (var + eps).sqrt() * w[j] + b[j];
        }
    }
    y
}

#[test]
fn layer_norm_and_its_backward() {
    let mut d = dev(14);
    let mut r = Rng(5);
    let (rows, dd, eps) = (3, 6, 1e-5);
    let xs = r.vec(rows * dd);
    let (wv, bv, dyv) = (r.vec(dd), r.vec(dd), r.vec(rows * dd));
    let x = f32s(&mut d, &xs, &[rows, dd]);
    let w = f32s(&mut d, &wv, &[dd]);
    let b = f32s(&mut d, &bv, &[dd]);
    let dy = f32s(&mut d, &dyv, &[rows, dd]);
    let (y, mean, rstd) = (
        zeros(&mut d, &[rows, dd]),
        zeros(&mut d, &[rows, 1]),
        zeros(&mut d, &[rows, 1]),
    );
    let (dx, dw, db) = (
        zeros(&mut d, &[rows, dd]),
        zeros(&mut d, &[dd]),
        zeros(&mut d, &[dd]),
    );
    let t = d.t;
    let ns = ints(&d, &[dd as i64]);
    let [tx, tw, tb, ty, tm, tr, tdy, tdx, tdw, tdb] =
        [&x, &w, &b, &y, &mean, &rstd, &dy, &dx, &dw, &db].map(|v| v.acl(&d));
    exec(
        &mut d,
        "aclnnLayerNorm",
        &mut |ws, ex| unsafe {
            (t.aclnnLayerNormGetWorkspaceSize)(tx, ns, tw, tb, eps, ty, tm, tr, ws, ex)
        },
        t.aclnnLayerNorm,
    );
    let (xh, wh, bh) = (f64s(&xs), f64s(&wv), f64s(&bv));
    close(
        &read_f32(&d, &y),
        &layer_norm_ref(&xh, &wh, &bh, dd, eps),
        1e-5,
        "layer norm",
    );
    let mask = [true, true, true];
    let m = unsafe { (t.aclCreateBoolArray)(mask.as_ptr(), 3) };
    exec(
        &mut d,
        "aclnnLayerNormBackward",
        &mut |ws, ex| unsafe {
            (t.aclnnLayerNormBackwardGetWorkspaceSize)(
                tdy, tx, ns, tm, tr, tw, tb, m, tdx, tdw, tdb, ws, ex,
            )
        },
        t.aclnnLayerNormBackward,
    );
    let dyh = f64s(&dyv);
    let want_dx = numeric_grad(&xh, &dyh, |x| layer_norm_ref(x, &wh, &bh, dd, eps));
    let want_dw = numeric_grad(&wh, &dyh, |w| layer_norm_ref(&xh, w, &bh, dd, eps));
    let want_db = numeric_grad(&bh, &dyh, |b| layer_norm_ref(&xh, &wh, b, dd, eps));
    close(&read_f32(&d, &dx), &want_dx, 1e-4, "layer norm dx");
    close(&read_f32(&d, &dw), &want_dw, 1e-4, "layer norm dw");
    close(&read_f32(&d, &db), &want_db, 1e-4, "layer norm db");
}

fn gelu_ref(x: f64) -> f64 {
    x / (1.0 + (-2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).exp())
}

#[test]
fn gelu_and_its_backward_on_a_strided_view() {
    let mut d = dev(15);
    let mut r = Rng(6);
    let xs: Vec<f32> = r.vec(4 * 6).iter().map(|v| 3.0 * v).collect();
    let x = f32s(&mut d, &xs, &[4, 6]).t(); // [6, 4]
    let dyv = r.vec(24);
    let dy = f32s(&mut d, &dyv, &[6, 4]);
    let (y, dx) = (zeros(&mut d, &[6, 4]), zeros(&mut d, &[6, 4]));
    let t = d.t;
    let [tx, tdy, ty, tdx] = [&x, &dy, &y, &dx].map(|v| v.acl(&d));
    exec(
        &mut d,
        "aclnnGelu",
        &mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(tx, ty, ws, ex) },
        t.aclnnGelu,
    );
    let xh = f64s(&host_view(&xs, &x));
    let want: Vec<f64> = xh.iter().map(|&v| gelu_ref(v)).collect();
    close(&read_f32(&d, &y), &want, 1e-6, "gelu");
    exec(
        &mut d,
        "aclnnGeluBackward",
        &mut |ws, ex| unsafe { (t.aclnnGeluBackwardGetWorkspaceSize)(tdy, tx, tdx, ws, ex) },
        t.aclnnGeluBackward,
    );
    let want = numeric_grad(&xh, &f64s(&dyv), |x| {
        x.iter().map(|&v| gelu_ref(v)).collect()
    });
    close(&read_f32(&d, &dx), &want, 1e-5, "gelu backward");
}

fn softmax_rows(x: &[f64], n: usize, log: bool) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        y.extend(row.iter().map(|v| {
            if log {
                v - mx - s.ln()
            } else {
                (v - mx).exp() / s
            }
        }));
    }
    y
}

#[test]
fn softmax_and_log_softmax_with_backward() {
    let mut d = dev(16);
    let mut r = Rng(7);
    let (rows, n) = (3, 5);
    for log in [false, true] {
        let xs = r.vec(rows * n);
        // x is [rows, n] seen through a transposed [n, rows] storage.
        let x = f32s(&mut d, &xs, &[n, rows]).t();
        let dyv = r.vec(rows * n);
        let dy = f32s(&mut d, &dyv, &[rows, n]);
        let (y, dx) = (zeros(&mut d, &[rows, n]), zeros(&mut d, &[rows, n]));
        let t = d.t;
        let [tx, tdy, ty, tdx] = [&x, &dy, &y, &dx].map(|v| v.acl(&d));
        let (fwd, fwd_run, bwd, bwd_run) = if log {
            (
                t.aclnnLogSoftmaxGetWorkspaceSize,
                t.aclnnLogSoftmax,
                t.aclnnLogSoftmaxBackwardGetWorkspaceSize,
                t.aclnnLogSoftmaxBackward,
            )
        } else {
            (
                t.aclnnSoftmaxGetWorkspaceSize,
                t.aclnnSoftmax,
                t.aclnnSoftmaxBackwardGetWorkspaceSize,
                t.aclnnSoftmaxBackward,
            )
        };
        exec(
            &mut d,
            "softmax",
            &mut |ws, ex| unsafe { fwd(tx, -1, ty, ws, ex) },
            fwd_run,
        );
        let xh = f64s(&host_view(&xs, &x));
        close(
            &read_f32(&d, &y),
            &softmax_rows(&xh, n, log),
            1e-6,
            "softmax",
        );
        exec(
            &mut d,
            "softmax bw",
            &mut |ws, ex| unsafe { bwd(tdy, ty, -1, tdx, ws, ex) },
            bwd_run,
        );
        let want = numeric_grad(&xh, &f64s(&dyv), |x| softmax_rows(x, n, log));
        close(&read_f32(&d, &dx), &want, 1e-5, "softmax backward");
    }
    // Over dim 0 of a [n, rows] tensor = over the rows of its transpose.
    let xs = r.vec(n * rows);
    let x = f32s(&mut d, &xs, &[n, rows]);
    let y = zeros(&mut d, &[n, rows]);
    let t = d.t;
    let (tx, ty) = (x.acl(&d), y.acl(&d));
    exec(
        &mut d,
        "aclnnSoftmax",
        &mut |ws, ex| unsafe { (t.aclnnSoftmaxGetWorkspaceSize)(tx, 0, ty, ws, ex) },
        t.aclnnSoftmax,
    );
    let xt = f64s(&host_view(&xs, &x.t()));
    let yt = softmax_rows(&xt, n, false);
    let got = read_f32(&d, &y.t());
    close(&got, &yt, 1e-6, "softmax dim 0");
}

fn nll_mean(x: &[f64], t: &[i64], c: usize, ignore: i64) -> f64 {
    let (mut s, mut w) = (0.0, 0.0);
    for (r, &k) in t.iter().enumerate() {
        if k != ignore {
            s -= x[r * c + k as usize];
            w += 1.0;
        }
    }
    s / w
}

#[test]
fn nll_loss_mean_with_ignored_target_and_backward() {
    let mut d = dev(17);
    let mut r = Rng(8);
    let (n, c) = (4, 5);
    let xs = r.vec(n * c);
    let targets = [2i64, -100, 4, 0];
    let x = f32s(&mut d, &xs, &[n, c]);
    let tg = i64s(&mut d, &targets, &[n]);
    let w = f32s(&mut d, &[1.0; 5], &[c]);
    let (loss, tw, g, dx) = (
        zeros(&mut d, &[]),
        zeros(&mut d, &[]),
        f32s(&mut d, &[0.5], &[]),
        zeros(&mut d, &[n, c]),
    );
    let t = d.t;
    let [tx, tt, tw8, tl, ttw, tg2, tdx] = [&x, &tg, &w, &loss, &tw, &g, &dx].map(|v| v.acl(&d));
    exec(
        &mut d,
        "aclnnNLLLoss",
        &mut |ws, ex| unsafe {
            (t.aclnnNLLLossGetWorkspaceSize)(tx, tt, tw8, 1, -100, tl, ttw, ws, ex)
        },
        t.aclnnNLLLoss,
    );
    let xh = f64s(&xs);
    close(
        &read_f32(&d, &loss),
        &[nll_mean(&xh, &targets, c, -100)],
        1e-6,
        "nll",
    );
    close(&read_f32(&d, &tw), &[3.0], 0.0, "total weight");
    exec(
        &mut d,
        "aclnnNLLLossBackward",
        &mut |ws, ex| unsafe {
            (t.aclnnNLLLossBackwardGetWorkspaceSize)(tg2, tx, tt, tw8, 1, -100, ttw, tdx, ws, ex)
        },
        t.aclnnNLLLossBackward,
    );
    let want = numeric_grad(&xh, &[0.5], |x| vec![nll_mean(x, &targets, c, -100)]);
    close(&read_f32(&d, &dx), &want, 1e-5, "nll backward");
}

#[test]
fn embedding_and_dense_backward_with_repeats() {
    let mut d = dev(18);
    let mut r = Rng(9);
    let (v, dd) = (5, 3);
    let wv = r.vec(v * dd);
    let idx = [3i64, 0, 3, 4];
    let w = f32s(&mut d, &wv, &[v, dd]);
    let ix = i64s(&mut d, &idx, &[2, 2]);
    let out = zeros(&mut d, &[2, 2, dd]);
    let gv = r.vec(4 * dd);
    let g = f32s(&mut d, &gv, &[4, dd]);
    let gw = zeros(&mut d, &[v, dd]);
    let t = d.t;
    let [tw, ti, to, tg, tgw] = [&w, &ix, &out, &g, &gw].map(|x| x.acl(&d));
    exec(
        &mut d,
        "aclnnEmbedding",
        &mut |ws, ex| unsafe { (t.aclnnEmbeddingGetWorkspaceSize)(tw, ti, to, ws, ex) },
        t.aclnnEmbedding,
    );
    let want: Vec<f64> = idx
        .iter()
        .flat_map(|&k| wv[k as usize * dd..(k as usize + 1) * dd].to_vec())
        .map(f64::from)
        .collect();
    close(&read_f32(&d, &out), &want, 0.0, "embedding");
    exec(
        &mut d,
        "aclnnEmbeddingDenseBackward",
        &mut |ws, ex| unsafe {
            (t.aclnnEmbeddingDenseBackwardGetWorkspaceSize)(
                tg,
                ti,
                v as u64,
                -1i64 as u64,
                false,
                tgw,
                ws,
                ex,
            )
        },
        t.aclnnEmbeddingDenseBackward,
    );
    let mut want = vec![0.0; v * dd];
    for (p, &k) in idx.iter().enumerate() {
        for j in 0..dd {
            want[k as usize * dd + j] += f64::from(gv[p * dd + j]);
        }
    }
    close(&read_f32(&d, &gw), &want, 1e-6, "embedding backward");
}

#[test]
fn copy_of_a_permuted_view_zero_and_cast() {
    let mut d = dev(19);
    let mut r = Rng(10);
    let xs = r.vec(2 * 3 * 4);
    let x = f32s(&mut d, &xs, &[2, 3, 4]).permute(&[2, 0, 1]); // [4, 2, 3]
    let y = zeros(&mut d, &[4, 2, 3]);
    let t = d.t;
    let (tx, ty) = (x.acl(&d), y.acl(&d));
    exec(
        &mut d,
        "aclnnInplaceCopy",
        &mut |ws, ex| unsafe { (t.aclnnInplaceCopyGetWorkspaceSize)(ty, tx, ws, ex) },
        t.aclnnInplaceCopy,
    );
    close(&read_f32(&d, &y), &f64s(&host_view(&xs, &x)), 0.0, "copy");
    // cast to i64 truncates toward zero; back to f32 exactly
    let scaled: Vec<f32> = xs.iter().map(|v| v * 10.0).collect();
    let s = f32s(&mut d, &scaled, &[24]);
    let i = zeros_i64(&mut d, &[24]);
    let back = zeros(&mut d, &[24]);
    let [ts, ti, tb] = [&s, &i, &back].map(|v| v.acl(&d));
    exec(
        &mut d,
        "aclnnCast",
        &mut |ws, ex| unsafe { (t.aclnnCastGetWorkspaceSize)(ts, ACL_INT64, ti, ws, ex) },
        t.aclnnCast,
    );
    let want: Vec<i64> = scaled.iter().map(|&v| v as i64).collect();
    assert_eq!(read_i64(&d, &i), want);
    exec(
        &mut d,
        "aclnnCast",
        &mut |ws, ex| unsafe { (t.aclnnCastGetWorkspaceSize)(ti, ACL_FLOAT, tb, ws, ex) },
        t.aclnnCast,
    );
    let wantf: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    close(&read_f32(&d, &back), &wantf, 0.0, "cast back");
    exec(
        &mut d,
        "aclnnInplaceZero",
        &mut |ws, ex| unsafe { (t.aclnnInplaceZeroGetWorkspaceSize)(ty, ws, ex) },
        t.aclnnInplaceZero,
    );
    assert!(read_f32(&d, &y).iter().all(|&v| v == 0.0));
}

#[test]
fn adamw_two_steps_match_the_documented_formula() {
    let mut d = dev(20);
    let mut r = Rng(11);
    let n = 7;
    let (pv, g1, g2) = (r.vec(n), r.vec(n), r.vec(n));
    let p = f32s(&mut d, &pv, &[n]);
    let (m, v) = (zeros(&mut d, &[n]), zeros(&mut d, &[n]));
    let g = f32s(&mut d, &g1, &[n]);
    let step = i64s(&mut d, &[1], &[1]);
    let (lr, b1, b2, wd, eps) = (0.01f32, 0.9f32, 0.999f32, 0.1f32, 1e-8f32);
    let t = d.t;
    let [tp, tm, tv, tg, tst] = [&p, &m, &v, &g, &step].map(|x| x.acl(&d));
    let (mut hp, mut hm, mut hv) = (f64s(&pv), vec![0.0; n], vec![0.0; n]);
    for (k, grad) in [g1, g2].iter().enumerate() {
        if k == 1 {
            let bytes: Vec<u8> = grad.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let two = 2i64.to_ne_bytes();
            sync(&d);
            unsafe {
                assert_eq!(
                    aclrtMemcpy(g.addr, bytes.len(), bytes.as_ptr().cast(), bytes.len(), H2D),
                    0
                );
                assert_eq!(aclrtMemcpy(step.addr, 8, two.as_ptr().cast(), 8, H2D), 0);
            }
        }
        exec(
            &mut d,
            "aclnnApplyAdamWV2",
            &mut |ws, ex| unsafe {
                (t.aclnnApplyAdamWV2GetWorkspaceSize)(
                    tp,
                    tm,
                    tv,
                    null_mut(),
                    tg,
                    tst,
                    lr,
                    b1,
                    b2,
                    wd,
                    eps,
                    false,
                    false,
                    ws,
                    ex,
                )
            },
            t.aclnnApplyAdamWV2,
        );
        let tt = (k + 1) as i32;
        let (lr, b1, b2, wd, eps) = (
            f64::from(lr),
            f64::from(b1),
            f64::from(b2),
            f64::from(wd),
            f64::from(eps),
        );
        for i in 0..n {
            let gi = f64::from(grad[i]);
            hp[i] *= 1.0 - lr * wd;
            hm[i] = b1 * hm[i] + (1.0 - b1) * gi;
            hv[i] = b2 * hv[i] + (1.0 - b2) * gi * gi;
            let mh = hm[i] / (1.0 - b1.powi(tt));
            let vh = hv[i] / (1.0 - b2.powi(tt));
            hp[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }
    close(&read_f32(&d, &p), &hp, 1e-6, "adamw param");
    close(&read_f32(&d, &m), &hm, 1e-6, "adamw m");
    close(&read_f32(&d, &v), &hv, 1e-6, "adamw v");
}

// ------------------------------------------------------------------ strictness

/// A softmax over [4, 8]: its workspace is not empty.
fn softmax_setup(d: &mut Dev) -> (*mut aclTensor, *mut aclTensor) {
    let x = f32s(d, &[0.5; 32], &[4, 8]);
    let y = zeros(d, &[4, 8]);
    (x.acl(d), y.acl(d))
}

#[test]
fn workspace_must_be_as_large_as_asked_and_device_memory() {
    let mut d = dev(21);
    let (tx, ty) = softmax_setup(&mut d);
    let t = d.t;
    let (rc, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnSoftmaxGetWorkspaceSize)(tx, -1, ty, ws, ex) });
    assert_eq!(rc, ACLNN_SUCCESS);
    assert!(ws > 0 && ws % 32 == 0, "workspace {ws}");
    let w = alloc(&mut d, ws as usize);
    let rc = unsafe { (t.aclnnSoftmax)(w, ws - 1, ex, d.s) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("smaller than"),
        "{}",
        recent_error()
    );
    // Host memory as workspace.
    let mut host = vec![0u8; ws as usize + 64];
    let hp = host
        .as_mut_ptr()
        .wrapping_add(64 - host.as_ptr() as usize % 32)
        .cast();
    let rc = unsafe { (t.aclnnSoftmax)(hp, ws, ex, d.s) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("not device memory"),
        "{}",
        recent_error()
    );
    // A workspace that runs past its allocation's end.
    let buf = alloc(&mut d, ws as usize);
    let small: *mut c_void = buf.cast::<u8>().wrapping_add(32).cast();
    let rc = unsafe { (t.aclnnSoftmax)(small, ws, ex, d.s) };
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("run past the end"),
        "{}",
        recent_error()
    );
    // Null workspace.
    assert_eq!(
        unsafe { (t.aclnnSoftmax)(null_mut(), ws, ex, d.s) },
        ACLNN_ERR_PARAM_NULLPTR
    );
    // A refused run left the executor usable: now it runs.
    assert_eq!(unsafe { (t.aclnnSoftmax)(w, ws, ex, d.s) }, ACLNN_SUCCESS);
    sync(&d);
}

#[test]
fn executors_are_single_use_unless_repeatable() {
    let mut d = dev(22);
    let (tx, ty) = softmax_setup(&mut d);
    let t = d.t;
    let (_, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnSoftmaxGetWorkspaceSize)(tx, -1, ty, ws, ex) });
    let w = alloc(&mut d, ws as usize);
    assert_eq!(unsafe { (t.aclnnSoftmax)(w, ws, ex, d.s) }, ACLNN_SUCCESS);
    assert_eq!(
        unsafe { (t.aclnnSoftmax)(w, ws, ex, d.s) },
        ACLNN_ERR_PARAM_INVALID
    );
    assert!(recent_error().contains("runs once"), "{}", recent_error());
    // Repeatable: runs three times, until destroyed.
    let (_, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnSoftmaxGetWorkspaceSize)(tx, -1, ty, ws, ex) });
    assert_eq!(
        unsafe { (t.aclSetAclOpExecutorRepeatable)(ex) },
        ACLNN_SUCCESS
    );
    for _ in 0..3 {
        assert_eq!(unsafe { (t.aclnnSoftmax)(w, ws, ex, d.s) }, ACLNN_SUCCESS);
    }
    assert_eq!(unsafe { (t.aclDestroyAclOpExecutor)(ex) }, ACLNN_SUCCESS);
    assert_eq!(
        unsafe { (t.aclnnSoftmax)(w, ws, ex, d.s) },
        ACLNN_ERR_PARAM_INVALID
    );
    // An executor planned for another operator.
    let (_, _, gex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(tx, ty, ws, ex) });
    assert_eq!(
        unsafe { (t.aclnnSoftmax)(w, ws, gex, d.s) },
        ACLNN_ERR_PARAM_INVALID
    );
    assert!(
        recent_error().contains("aclnnGeluGetWorkspaceSize"),
        "{}",
        recent_error()
    );
    sync(&d);
    // 1 + 3 accepted runs are kernels; the refused ones are not.
    assert_eq!(snapshot(22).kernels, 4);
}

#[test]
fn tensors_must_be_aligned_in_bounds_device_memory() {
    let mut d = dev(23);
    let t = d.t;
    let x = f32s(&mut d, &[1.0; 16], &[16]);
    let y = zeros(&mut d, &[16]);
    let ty = y.acl(&d);
    let gelu = |tx: *mut aclTensor, ty: *mut aclTensor| {
        plan_only(&mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(tx, ty, ws, ex) }).0
    };
    // Misaligned base address (an offset belongs in the element offset).
    let mis = View {
        addr: x.addr.cast::<u8>().wrapping_add(4).cast(),
        storage: 15,
        shape: vec![15],
        strides: vec![1],
        ..x.clone()
    };
    let ty15 = zeros(&mut d, &[15]).acl(&d);
    assert_eq!(gelu(mis.acl(&d), ty15), ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("32-byte aligned"),
        "{}",
        recent_error()
    );
    // The same elements through an element offset are fine.
    let off = View {
        offset: 1,
        shape: vec![15],
        ..x.clone()
    };
    assert_eq!(gelu(off.acl(&d), ty15), ACLNN_SUCCESS);
    // Storage past the allocation.
    let big = View {
        storage: 17,
        ..x.clone()
    };
    assert_eq!(gelu(big.acl(&d), ty), ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("run past the end"),
        "{}",
        recent_error()
    );
    // A view past its storage dims.
    let past = View {
        offset: 2,
        ..x.clone()
    };
    assert_eq!(gelu(past.acl(&d), ty), ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("storage dims"),
        "{}",
        recent_error()
    );
    // Host memory.
    let mut host = vec![0f32; 40];
    let hp = host
        .as_mut_ptr()
        .wrapping_add((8 - (host.as_ptr() as usize / 4) % 8) % 8);
    let h = View {
        addr: hp.cast(),
        ..x.clone()
    };
    assert_eq!(gelu(h.acl(&d), ty), ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("not device memory"),
        "{}",
        recent_error()
    );
    // Null tensors, null outputs.
    assert_eq!(gelu(null_mut(), ty), ACLNN_ERR_PARAM_NULLPTR);
    assert_eq!(gelu(x.acl(&d), null_mut()), ACLNN_ERR_PARAM_NULLPTR);
    // Freed between the phases.
    let z = f32s(&mut d, &[1.0; 16], &[16]);
    let (rc, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(z.acl(&d), ty, ws, ex) });
    assert_eq!(rc, ACLNN_SUCCESS);
    assert_eq!(unsafe { aclrtFree(z.addr) }, ACL_SUCCESS);
    d.bufs.retain(|&b| b != z.addr);
    assert_eq!(
        unsafe { (t.aclnnGelu)(null_mut(), ws, ex, d.s) },
        ACLNN_ERR_PARAM_INVALID
    );
    assert!(recent_error().contains("freed"), "{}", recent_error());
    // A destroyed tensor handle.
    let tx = x.acl(&d);
    assert_eq!(unsafe { (t.aclDestroyTensor)(tx) }, ACLNN_SUCCESS);
    assert_eq!(gelu(tx, ty), ACLNN_ERR_PARAM_INVALID);
    assert_eq!(unsafe { (t.aclDestroyTensor)(tx) }, ACLNN_ERR_PARAM_INVALID);
    // aclCreateTensor refuses negative dims.
    let dims = [-1i64];
    let st = [1i64];
    let p = unsafe {
        (t.aclCreateTensor)(
            dims.as_ptr(),
            1,
            ACL_FLOAT,
            st.as_ptr(),
            0,
            ACL_FORMAT_ND,
            st.as_ptr(),
            1,
            x.addr,
        )
    };
    assert!(p.is_null());
}

#[test]
fn shapes_and_dtypes_must_agree() {
    let mut d = dev(24);
    let t = d.t;
    let a = zeros(&mut d, &[3, 4]);
    let b = zeros(&mut d, &[5, 2]);
    let o = zeros(&mut d, &[3, 2]);
    let [ta, tb, to] = [&a, &b, &o].map(|v| v.acl(&d));
    let rc =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnMatmulGetWorkspaceSize)(ta, tb, to, 0, ws, ex) })
            .0;
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(recent_error().contains("inner dims"), "{}", recent_error());
    // add: [3, 4] + [3] does not broadcast
    let c = zeros(&mut d, &[3]);
    let tc = c.acl(&d);
    let one = scalar(&d, 1.0);
    let rc =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnAddGetWorkspaceSize)(ta, tc, one, ta, ws, ex) }).0;
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("do not broadcast"),
        "{}",
        recent_error()
    );
    // wrong out shape
    let rc = plan_only(&mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(ta, to, ws, ex) }).0;
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(
        recent_error().contains("expected [3, 4]"),
        "{}",
        recent_error()
    );
    // an i64 tensor where f32 is required
    let i = zeros_i64(&mut d, &[3, 4]);
    let ti = i.acl(&d);
    let rc = plan_only(&mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(ti, ta, ws, ex) }).0;
    assert_eq!(rc, ACLNN_ERR_PARAM_INVALID);
    assert!(recent_error().contains("I64"), "{}", recent_error());
    // nll without its (required) weight
    let tg = zeros_i64(&mut d, &[3]).acl(&d);
    let (l, w) = (zeros(&mut d, &[]).acl(&d), zeros(&mut d, &[]).acl(&d));
    let rc = plan_only(&mut |ws, ex| unsafe {
        (t.aclnnNLLLossGetWorkspaceSize)(ta, tg, null_mut(), 1, -100, l, w, ws, ex)
    })
    .0;
    assert_eq!(rc, ACLNN_ERR_PARAM_NULLPTR);
}

#[test]
fn a_bad_index_fails_on_the_device_and_is_reported_by_the_sync() {
    let mut d = dev(25);
    let t = d.t;
    let w = zeros(&mut d, &[4, 2]);
    let ix = i64s(&mut d, &[1, 4], &[2]);
    let o = zeros(&mut d, &[2, 2]);
    let [tw, ti, to] = [&w, &ix, &o].map(|v| v.acl(&d));
    let (rc, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnEmbeddingGetWorkspaceSize)(tw, ti, to, ws, ex) });
    assert_eq!(rc, ACLNN_SUCCESS);
    assert_eq!(
        unsafe { (t.aclnnEmbedding)(null_mut(), ws, ex, d.s) },
        ACLNN_SUCCESS
    );
    assert_eq!(
        unsafe { aclrtSynchronizeStream(d.s) },
        ACL_ERROR_RT_PARAM_INVALID
    );
}

// ------------------------------------------------------------------ counters, hazards

#[test]
fn kernels_are_counted_per_accepted_launch() {
    let mut d = dev(26);
    let (tx, ty) = softmax_setup(&mut d);
    let t = d.t;
    reset(26);
    for _ in 0..3 {
        exec(
            &mut d,
            "aclnnGelu",
            &mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(tx, ty, ws, ex) },
            t.aclnnGelu,
        );
    }
    // A refused launch (wrong workspace size) is not counted.
    let (_, ws, ex) =
        plan_only(&mut |ws, ex| unsafe { (t.aclnnSoftmaxGetWorkspaceSize)(tx, -1, ty, ws, ex) });
    assert_eq!(
        unsafe { (t.aclnnSoftmax)(null_mut(), 0, ex, d.s) },
        ACLNN_ERR_PARAM_INVALID
    );
    assert!(ws > 0);
    sync(&d);
    let c = snapshot(26);
    assert_eq!(c.kernels, 3, "{c}");
    assert_eq!(c.mallocs, 0, "{c}");
    assert_eq!(c.hazards, 0, "{c}");
}

/// A copy on stream `a` writes `x`; a kernel on the compute stream reads it, with or
/// without an event between.
fn copy_then_kernel(device: i32, ordered: bool) -> Vec<String> {
    let mut d = dev(device);
    let t = d.t;
    let x = zeros(&mut d, &[64]);
    let y = zeros(&mut d, &[64]);
    let (tx, ty) = (x.acl(&d), y.acl(&d));
    reset(device);
    let mut a = null_mut();
    assert_eq!(unsafe { aclrtCreateStream(&mut a) }, ACL_SUCCESS);
    let src = vec![1.0f32; 64];
    unsafe {
        assert_eq!(
            aclrtMemcpyAsync(x.addr, 256, src.as_ptr().cast(), 256, H2D, a),
            ACL_SUCCESS
        );
        if ordered {
            let mut e = null_mut();
            assert_eq!(aclrtCreateEvent(&mut e), ACL_SUCCESS);
            assert_eq!(aclrtRecordEvent(e, a), ACL_SUCCESS);
            assert_eq!(aclrtStreamWaitEvent(d.s, e), ACL_SUCCESS);
        }
    }
    exec(
        &mut d,
        "aclnnGelu",
        &mut |ws, ex| unsafe { (t.aclnnGeluGetWorkspaceSize)(tx, ty, ws, ex) },
        t.aclnnGelu,
    );
    unsafe {
        assert_eq!(aclrtSynchronizeStream(a), ACL_SUCCESS);
        assert_eq!(aclrtDestroyStream(a), ACL_SUCCESS);
    }
    sync(&d);
    let h = hazards(device);
    assert_eq!(snapshot(device).hazards, h.len() as u64);
    h
}

#[test]
fn a_kernel_reading_an_unordered_copy_is_a_hazard() {
    let h = copy_then_kernel(27, false);
    assert_eq!(h.len(), 1, "{h:?}");
    assert!(h[0].contains("read-after-write"), "{}", h[0]);
    assert!(h[0].contains("aclnnGelu self"), "{}", h[0]);
    assert!(h[0].contains("aclrtMemcpyAsync destination"), "{}", h[0]);
    assert!(copy_then_kernel(28, true).is_empty());
}

// ------------------------------------------------------------------ loader

#[test]
fn the_cann_loader_names_the_missing_library() {
    let dir = std::env::temp_dir().join("mpipe-no-cann-here");
    let e = load_cann(Some(&dir))
        .err()
        .expect("no CANN in an empty directory");
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            LoadError::Library {
                name: "libopapi.so",
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("libopapi.so") && msg.contains("set_env.sh"),
        "{msg}"
    );
    // Every symbol the table resolves is listed with its library.
    assert!(SYMBOLS.contains(&("libopapi.so", "aclnnApplyAdamWV2GetWorkspaceSize")));
    assert!(SYMBOLS.contains(&("libnnopbase.so", "aclCreateTensor")));
    assert_eq!(
        SYMBOLS.iter().filter(|(l, _)| *l == "libopapi.so").count(),
        52
    );
}
