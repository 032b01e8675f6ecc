//! The aclnn subset on CPUs, behind the same two-phase API as CANN's `libopapi.so`
//! (the table of [`crate::aclnn`] points here in an emulator build).
//!
//! Strict where a real NPU would misbehave silently or fail later:
//! - `aclCreateTensor` rejects (returns null) negative dims, strides or offsets and
//!   unknown dtypes; the `GetWorkspaceSize` phase checks, for every tensor, that its
//!   device address is **32-byte aligned**, that the view fits its storage dims, that the
//!   storage lies **in bounds** of one live `aclrtMalloc` allocation (host memory is
//!   refused), that **shapes and dtypes agree** as the operator documents (numpy
//!   broadcasting where it allows it), and fails with `ACLNN_ERR_PARAM_NULLPTR` /
//!   `ACLNN_ERR_PARAM_INVALID` and a message for `aclGetRecentErrMsg`;
//! - the workspace size it returns is what the kernel needs (a contiguous copy of each
//!   strided input, plus per-row scratch for reductions); the second phase refuses a
//!   smaller `workspaceSize`, or a workspace that is not device memory of that size;
//! - an executor runs **once** and is released, unless `aclSetAclOpExecutorRepeatable`
//!   made it repeatable (then it stays until `aclDestroyAclOpExecutor`); running a
//!   released executor, or one made for another operator, is `ACLNN_ERR_PARAM_INVALID`;
//! - kernels read every tensor **through its strides** (gathered into a contiguous host
//!   vector), compute, and scatter the outputs through theirs.
//!
//! A kernel runs on the stream's worker in stream order (never on the calling thread);
//! at issue time its reads (inputs), writes (outputs, the workspace) are recorded on the
//! stream by the happens-before checker ([`super::hazards`], action `aclnnXxx <role>`)
//! and, once queued, it counts as one of the calling device's `kernels`. A failure
//! found while running (an index out of range) is reported on stderr and by the
//! stream's next synchronisation (`ACL_ERROR_RT_PARAM_INVALID`).
//!
//! Arithmetic is in f64, stored in the tensors' dtype (f32 results round once).

mod ops;

pub use ops::*;

use super::hazards::{self, Use};
use super::memory::{self, Span};
use super::{counters, lock, stream_of};
use crate::aclnn::*;
use crate::bindings::{aclrtStream, ACL_ERROR_RT_PARAM_INVALID, ACL_SUCCESS};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Every device address a kernel touches must be aligned to this (CANN's rule for
/// `aclCreateTensor`'s `tensorData` and the workspace).
pub const ADDRESS_ALIGN: usize = 32;

// ------------------------------------------------------------------ dtypes

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dt {
    F32,
    I32,
    I64,
    Bool,
}

impl Dt {
    fn from_acl(d: aclDataType) -> Option<Dt> {
        match d {
            ACL_FLOAT => Some(Dt::F32),
            ACL_INT32 => Some(Dt::I32),
            ACL_INT64 => Some(Dt::I64),
            ACL_BOOL => Some(Dt::Bool),
            _ => None,
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Dt::F32 | Dt::I32 => 4,
            Dt::I64 => 8,
            Dt::Bool => 1,
        }
    }
}

// ------------------------------------------------------------------ handles

/// A tensor as `aclCreateTensor` described it.
#[derive(Clone, Debug)]
pub(crate) struct Desc {
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    /// Element offset of the first element from `addr`.
    pub(crate) offset: usize,
    pub(crate) dtype: Dt,
    /// Elements of storage (the product of the storage dims).
    pub(crate) storage: usize,
    pub(crate) addr: usize,
}

impl Desc {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements from the first to one past the last this view reaches.
    fn extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        1 + self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum::<usize>()
    }

    pub(crate) fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    pub(crate) fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

enum Obj {
    Tensor(Desc),
    Scalar(f64),
    Ints(Vec<i64>),
    Bools(Vec<bool>),
    Executor(Arc<Mutex<Exec>>),
}

fn objects() -> &'static Mutex<HashMap<usize, Obj>> {
    static O: OnceLock<Mutex<HashMap<usize, Obj>>> = OnceLock::new();
    O.get_or_init(Default::default)
}

/// Handles are opaque, never dereferenced: distinct addresses from a counter.
fn new_handle(o: Obj) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0x7a00_0000);
    let h = NEXT.fetch_add(64, Ordering::Relaxed);
    lock(objects()).insert(h, o);
    h
}

fn destroy(h: usize, what: fn(&Obj) -> bool) -> aclnnStatus {
    if h == 0 {
        return fail_status(ACLNN_ERR_PARAM_NULLPTR, "null handle".into());
    }
    let mut o = lock(objects());
    match o.get(&h) {
        Some(x) if what(x) => {
            o.remove(&h);
            ACLNN_SUCCESS
        }
        _ => {
            drop(o);
            fail_status(
                ACLNN_ERR_PARAM_INVALID,
                format!("{h:#x} is not a live handle of this kind (destroyed twice?)"),
            )
        }
    }
}

pub(crate) fn tensor(h: *const aclTensor, role: &str) -> Result<Desc, Fail> {
    if h.is_null() {
        return Err(Fail::null(role));
    }
    match lock(objects()).get(&(h as usize)) {
        Some(Obj::Tensor(d)) => Ok(d.clone()),
        _ => Err(Fail::invalid(format!(
            "{role}: {:#x} is not a live aclTensor (aclCreateTensor, not yet destroyed)",
            h as usize
        ))),
    }
}

pub(crate) fn opt_tensor(h: *const aclTensor, role: &str) -> Result<Option<Desc>, Fail> {
    if h.is_null() {
        Ok(None)
    } else {
        tensor(h, role).map(Some)
    }
}

pub(crate) fn scalar(h: *const aclScalar, role: &str) -> Result<f64, Fail> {
    if h.is_null() {
        return Err(Fail::null(role));
    }
    match lock(objects()).get(&(h as usize)) {
        Some(Obj::Scalar(v)) => Ok(*v),
        _ => Err(Fail::invalid(format!("{role}: not a live aclScalar"))),
    }
}

pub(crate) fn int_array(h: *const aclIntArray, role: &str) -> Result<Vec<i64>, Fail> {
    if h.is_null() {
        return Err(Fail::null(role));
    }
    match lock(objects()).get(&(h as usize)) {
        Some(Obj::Ints(v)) => Ok(v.clone()),
        _ => Err(Fail::invalid(format!("{role}: not a live aclIntArray"))),
    }
}

pub(crate) fn bool_array(h: *const aclBoolArray, role: &str) -> Result<Vec<bool>, Fail> {
    if h.is_null() {
        return Err(Fail::null(role));
    }
    match lock(objects()).get(&(h as usize)) {
        Some(Obj::Bools(v)) => Ok(v.clone()),
        _ => Err(Fail::invalid(format!("{role}: not a live aclBoolArray"))),
    }
}

// ------------------------------------------------------------------ errors

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A refused call: its status and why.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) status: aclnnStatus,
    pub(crate) message: String,
}

impl Fail {
    pub(crate) fn invalid(message: String) -> Fail {
        Fail {
            status: ACLNN_ERR_PARAM_INVALID,
            message,
        }
    }

    pub(crate) fn null(role: &str) -> Fail {
        Fail {
            status: ACLNN_ERR_PARAM_NULLPTR,
            message: format!("{role} is null"),
        }
    }
}

fn fail_status(status: aclnnStatus, message: String) -> aclnnStatus {
    LAST_ERROR
        .with(|e| *e.borrow_mut() = CString::new(message.replace('\0', " ")).unwrap_or_default());
    status
}

fn fail(call: &str, f: Fail) -> aclnnStatus {
    fail_status(f.status, format!("{call}: {}", f.message))
}

/// The calling thread's latest aclnn error message (what `aclGetRecentErrMsg` returns).
pub fn recent_error() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}

/// `aclGetRecentErrMsg`: the calling thread's latest message, valid until its next
/// failing call.
pub unsafe extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

// ------------------------------------------------------------------ nnopbase

/// # Safety
/// The pointers hold `view_dims_num` / `storage_dims_num` values (as in CANN).
pub unsafe extern "C" fn aclCreateTensor(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> *mut aclTensor {
    let n = view_dims_num as usize;
    let sn = storage_dims_num as usize;
    if (n > 0 && (view_dims.is_null() || stride.is_null())) || (sn > 0 && storage_dims.is_null()) {
        fail_status(
            ACLNN_ERR_PARAM_NULLPTR,
            "aclCreateTensor: null dims or strides".into(),
        );
        return std::ptr::null_mut();
    }
    if n > 8 || sn > 8 {
        fail_status(
            ACLNN_ERR_PARAM_INVALID,
            "aclCreateTensor: more than 8 dims".into(),
        );
        return std::ptr::null_mut();
    }
    // SAFETY: non-null (checked) and holding the stated counts by the caller's promise.
    let (dims, strides, storage) = unsafe {
        (
            if n > 0 {
                std::slice::from_raw_parts(view_dims, n)
            } else {
                &[]
            },
            if n > 0 {
                std::slice::from_raw_parts(stride, n)
            } else {
                &[]
            },
            if sn > 0 {
                std::slice::from_raw_parts(storage_dims, sn)
            } else {
                &[]
            },
        )
    };
    let Some(dtype) = Dt::from_acl(data_type) else {
        fail_status(
            ACLNN_ERR_PARAM_INVALID,
            format!("aclCreateTensor: dtype {data_type} is not supported by the emulator (float, int32, int64, bool)"),
        );
        return std::ptr::null_mut();
    };
    if format != ACL_FORMAT_ND
        || offset < 0
        || dims.iter().chain(strides).chain(storage).any(|&v| v < 0)
    {
        fail_status(
            ACLNN_ERR_PARAM_INVALID,
            "aclCreateTensor: negative dims, strides or offset, or a format other than ND".into(),
        );
        return std::ptr::null_mut();
    }
    let desc = Desc {
        shape: dims.iter().map(|&d| d as usize).collect(),
        strides: strides.iter().map(|&d| d as usize).collect(),
        offset: offset as usize,
        dtype,
        storage: storage.iter().map(|&d| d as usize).product(),
        addr: tensor_data as usize,
    };
    new_handle(Obj::Tensor(desc)) as *mut aclTensor
}

pub unsafe extern "C" fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus {
    destroy(tensor as usize, |o| matches!(o, Obj::Tensor(_)))
}

/// # Safety
/// `value` points at one value of `data_type`.
pub unsafe extern "C" fn aclCreateScalar(
    value: *mut c_void,
    data_type: aclDataType,
) -> *mut aclScalar {
    if value.is_null() {
        fail_status(
            ACLNN_ERR_PARAM_NULLPTR,
            "aclCreateScalar: null value".into(),
        );
        return std::ptr::null_mut();
    }
    // SAFETY: the caller promises a value of `data_type` at `value`.
    let v = unsafe {
        match data_type {
            ACL_FLOAT => f64::from(*(value as *const f32)),
            ACL_DOUBLE => *(value as *const f64),
            ACL_INT32 => f64::from(*(value as *const i32)),
            ACL_INT64 => *(value as *const i64) as f64,
            ACL_BOOL => f64::from(u8::from(*(value as *const bool))),
            _ => {
                fail_status(
                    ACLNN_ERR_PARAM_INVALID,
                    format!("aclCreateScalar: dtype {data_type} not supported by the emulator"),
                );
                return std::ptr::null_mut();
            }
        }
    };
    new_handle(Obj::Scalar(v)) as *mut aclScalar
}

pub unsafe extern "C" fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus {
    destroy(scalar as usize, |o| matches!(o, Obj::Scalar(_)))
}

/// # Safety
/// `value` holds `size` values.
pub unsafe extern "C" fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray {
    if value.is_null() && size > 0 {
        fail_status(
            ACLNN_ERR_PARAM_NULLPTR,
            "aclCreateIntArray: null value".into(),
        );
        return std::ptr::null_mut();
    }
    let v = if size == 0 {
        Vec::new()
    } else {
        // SAFETY: non-null, `size` values by the caller's promise.
        unsafe { std::slice::from_raw_parts(value, size as usize) }.to_vec()
    };
    new_handle(Obj::Ints(v)) as *mut aclIntArray
}

pub unsafe extern "C" fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus {
    destroy(array as usize, |o| matches!(o, Obj::Ints(_)))
}

/// # Safety
/// `value` holds `size` values.
pub unsafe extern "C" fn aclCreateBoolArray(value: *const bool, size: u64) -> *mut aclBoolArray {
    if value.is_null() && size > 0 {
        fail_status(
            ACLNN_ERR_PARAM_NULLPTR,
            "aclCreateBoolArray: null value".into(),
        );
        return std::ptr::null_mut();
    }
    let v = if size == 0 {
        Vec::new()
    } else {
        // SAFETY: non-null, `size` values by the caller's promise.
        unsafe { std::slice::from_raw_parts(value, size as usize) }.to_vec()
    };
    new_handle(Obj::Bools(v)) as *mut aclBoolArray
}

pub unsafe extern "C" fn aclDestroyBoolArray(array: *const aclBoolArray) -> aclnnStatus {
    destroy(array as usize, |o| matches!(o, Obj::Bools(_)))
}

fn executor(h: *mut aclOpExecutor) -> Option<Arc<Mutex<Exec>>> {
    match lock(objects()).get(&(h as usize)) {
        Some(Obj::Executor(e)) => Some(Arc::clone(e)),
        _ => None,
    }
}

pub unsafe extern "C" fn aclSetAclOpExecutorRepeatable(exec: *mut aclOpExecutor) -> aclnnStatus {
    match executor(exec) {
        Some(e) => {
            lock(&e).repeatable = true;
            ACLNN_SUCCESS
        }
        None => fail_status(
            ACLNN_ERR_PARAM_INVALID,
            "aclSetAclOpExecutorRepeatable: not a live executor (make it repeatable before its first run)".into(),
        ),
    }
}

pub unsafe extern "C" fn aclDestroyAclOpExecutor(exec: *mut aclOpExecutor) -> aclnnStatus {
    destroy(exec as usize, |o| matches!(o, Obj::Executor(_)))
}

// ------------------------------------------------------------------ kernels

/// One tensor a kernel uses.
pub(crate) struct Arg {
    pub(crate) desc: Desc,
    pub(crate) role: &'static str,
    pub(crate) read: bool,
    pub(crate) write: bool,
}

/// The function a kernel runs on the stream's worker.
pub(crate) type Body = Box<dyn Fn(&Mem<'_>) -> Result<(), String> + Send + Sync>;

/// What `GetWorkspaceSize` planned.
pub(crate) struct Kernel {
    pub(crate) args: Vec<Arg>,
    pub(crate) scratch: u64,
    pub(crate) body: Body,
}

pub(crate) struct Exec {
    op: &'static str,
    workspace: u64,
    repeatable: bool,
    kernel: Arc<Kernel>,
}

/// Checks a tensor's address, storage and bounds (the planning-time checks).
pub(crate) fn check_tensor(d: &Desc, role: &str) -> Result<(), Fail> {
    if d.addr == 0 {
        return Err(Fail::null(&format!("{role}'s device address")));
    }
    if !d.addr.is_multiple_of(ADDRESS_ALIGN) {
        return Err(Fail::invalid(format!(
            "{role}: device address {:#x} is not {ADDRESS_ALIGN}-byte aligned (views of an \
             allocation keep its address and set an element offset)",
            d.addr
        )));
    }
    if d.offset + d.extent() > d.storage {
        return Err(Fail::invalid(format!(
            "{role}: the view (offset {}, shape {:?}, strides {:?}) reaches element {} but \
             the storage dims hold {}",
            d.offset,
            d.shape,
            d.strides,
            d.offset + d.extent(),
            d.storage
        )));
    }
    memory::resolve_device(d.addr, d.storage * d.dtype.size())
        .map_err(|e| Fail::invalid(format!("{role}: {e}")))?;
    Ok(())
}

/// The first phase: checks by `plan`, then an executor and its workspace size.
pub(crate) fn plan(
    op: &'static str,
    ws: *mut u64,
    ex: *mut *mut aclOpExecutor,
    plan: impl FnOnce() -> Result<Kernel, Fail>,
) -> aclnnStatus {
    let call = format!("{op}GetWorkspaceSize");
    if ws.is_null() || ex.is_null() {
        return fail(&call, Fail::null("workspaceSize or executor"));
    }
    let k = match plan() {
        Ok(k) => k,
        Err(f) => return fail(&call, f),
    };
    for a in &k.args {
        if let Err(f) = check_tensor(&a.desc, a.role) {
            return fail(&call, f);
        }
    }
    // A contiguous copy of each strided input, then the kernel's own scratch.
    let copies: u64 = k
        .args
        .iter()
        .filter(|a| a.read && !a.desc.is_contiguous())
        .map(|a| a.desc.bytes().next_multiple_of(ADDRESS_ALIGN) as u64)
        .sum();
    let workspace = (copies + k.scratch).next_multiple_of(ADDRESS_ALIGN as u64);
    let e = Exec {
        op,
        workspace,
        repeatable: false,
        kernel: Arc::new(k),
    };
    let h = new_handle(Obj::Executor(Arc::new(Mutex::new(e))));
    // SAFETY: non-null (checked), writable by the caller's promise.
    unsafe {
        *ws = workspace;
        *ex = h as *mut aclOpExecutor;
    }
    ACLNN_SUCCESS
}

/// A kernel's tensors resolved to backing storage, for its body.
pub(crate) struct Mem<'a> {
    args: &'a [Arg],
    /// Backing address of each tensor's first element (0 for an empty one).
    ptrs: Vec<usize>,
}

/// Element offsets (from the first element) of a view of `shape` with `strides`, in
/// row-major index order.
pub(crate) fn offsets(shape: &[usize], strides: &[usize]) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx = vec![0usize; shape.len()];
    let mut off = 0usize;
    for _ in 0..n {
        out.push(off);
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < shape[k] {
                break;
            }
            off -= strides[k] * shape[k];
            idx[k] = 0;
        }
    }
    out
}

/// The strides reading `d` as if it had shape `target` (numpy broadcasting: trailing
/// dims aligned, size-1 and missing dims repeated).
pub(crate) fn broadcast_strides(d: &Desc, target: &[usize]) -> Option<Vec<usize>> {
    let (sn, tn) = (d.shape.len(), target.len());
    if sn > tn {
        return None;
    }
    let mut st = vec![0; tn];
    for j in 0..tn {
        if j < tn - sn {
            continue;
        }
        let i = j - (tn - sn);
        if d.shape[i] == target[j] {
            st[j] = d.strides[i];
        } else if d.shape[i] != 1 {
            return None;
        }
    }
    Some(st)
}

impl Mem<'_> {
    fn element(&self, i: usize, off: usize) -> f64 {
        let d = &self.args[i].desc;
        let p = self.ptrs[i] + off * d.dtype.size();
        // SAFETY: `p` lies in the span resolved for this tensor at issue time (its
        // extent), which holds the allocation alive.
        unsafe {
            match d.dtype {
                Dt::F32 => f64::from(std::ptr::read_unaligned(p as *const f32)),
                Dt::I32 => f64::from(std::ptr::read_unaligned(p as *const i32)),
                Dt::I64 => std::ptr::read_unaligned(p as *const i64) as f64,
                Dt::Bool => f64::from(u8::from(std::ptr::read_unaligned(p as *const u8) != 0)),
            }
        }
    }

    /// Tensor `i` gathered in row-major order.
    pub(crate) fn read(&self, i: usize) -> Vec<f64> {
        let d = &self.args[i].desc;
        offsets(&d.shape, &d.strides)
            .into_iter()
            .map(|o| self.element(i, o))
            .collect()
    }

    /// Tensor `i` broadcast to `shape` (checked when planned).
    pub(crate) fn read_as(&self, i: usize, shape: &[usize]) -> Vec<f64> {
        let st = broadcast_strides(&self.args[i].desc, shape).expect("checked when planned");
        offsets(shape, &st)
            .into_iter()
            .map(|o| self.element(i, o))
            .collect()
    }

    /// Integer tensor `i` (indices, targets) gathered exactly.
    pub(crate) fn read_i64(&self, i: usize) -> Vec<i64> {
        let d = &self.args[i].desc;
        offsets(&d.shape, &d.strides)
            .into_iter()
            .map(|o| {
                let p = self.ptrs[i] + o * d.dtype.size();
                // SAFETY: as in `element`.
                unsafe {
                    match d.dtype {
                        Dt::I64 => std::ptr::read_unaligned(p as *const i64),
                        Dt::I32 => i64::from(std::ptr::read_unaligned(p as *const i32)),
                        _ => self.element(i, o) as i64,
                    }
                }
            })
            .collect()
    }

    /// Scatters `vals` (row-major) into tensor `i`, converting to its dtype.
    pub(crate) fn write(&self, i: usize, vals: &[f64]) {
        let d = &self.args[i].desc;
        debug_assert!(self.args[i].write);
        for (o, &v) in offsets(&d.shape, &d.strides).into_iter().zip(vals) {
            let p = self.ptrs[i] + o * d.dtype.size();
            // SAFETY: as in `element`; written only by this kernel (its span is a
            // recorded write).
            unsafe {
                match d.dtype {
                    Dt::F32 => std::ptr::write_unaligned(p as *mut f32, v as f32),
                    Dt::I32 => std::ptr::write_unaligned(p as *mut i32, v as i32),
                    Dt::I64 => std::ptr::write_unaligned(p as *mut i64, v as i64),
                    Dt::Bool => std::ptr::write_unaligned(p as *mut u8, u8::from(v != 0.0)),
                }
            }
        }
    }
}

/// The second phase: checks the executor and workspace, records the accesses on the
/// stream, queues the kernel.
pub(crate) fn run(
    op: &'static str,
    workspace: *mut c_void,
    workspace_size: u64,
    exec: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    let Some(e) = executor(exec) else {
        return fail(
            op,
            Fail::invalid(format!(
                "executor {:#x} is not live: an executor runs once and is then released, \
                 unless aclSetAclOpExecutorRepeatable made it repeatable (call \
                 {op}GetWorkspaceSize again, or make it repeatable)",
                exec as usize
            )),
        );
    };
    let (kernel, needed, repeatable) = {
        let g = lock(&e);
        if g.op != op {
            return fail(
                op,
                Fail::invalid(format!(
                    "the executor was planned by {}GetWorkspaceSize, not {op}GetWorkspaceSize",
                    g.op
                )),
            );
        }
        (Arc::clone(&g.kernel), g.workspace, g.repeatable)
    };
    if workspace_size < needed {
        return fail(
            op,
            Fail::invalid(format!(
                "workspaceSize {workspace_size} is smaller than the {needed} bytes \
                 {op}GetWorkspaceSize asked for"
            )),
        );
    }
    let ws_span = if needed > 0 {
        if workspace.is_null() {
            return fail(op, Fail::null("workspace"));
        }
        if !(workspace as usize).is_multiple_of(ADDRESS_ALIGN) {
            return fail(
                op,
                Fail::invalid(format!(
                    "workspace {:#x} is not {ADDRESS_ALIGN}-byte aligned",
                    workspace as usize
                )),
            );
        }
        match memory::resolve_device(workspace as usize, needed as usize) {
            Ok(s) => Some(s),
            Err(err) => return fail(op, Fail::invalid(format!("workspace: {err}"))),
        }
    } else {
        None
    };
    let Some(st) = stream_of(stream) else {
        return fail_status(
            ACLNN_ERR_PARAM_INVALID,
            format!("{op}: {:#x} is not a live stream", stream as usize),
        );
    };
    // Resolve again: an allocation freed since the first phase is refused.
    let mut spans: Vec<Option<Span>> = Vec::with_capacity(kernel.args.len());
    for a in &kernel.args {
        let d = &a.desc;
        if d.numel() == 0 {
            spans.push(None);
            continue;
        }
        let first = d.addr + d.offset * d.dtype.size();
        match memory::resolve_device(first, d.extent() * d.dtype.size()) {
            Ok(s) => spans.push(Some(s)),
            Err(err) => return fail(op, Fail::invalid(format!("{}: {err}", a.role))),
        }
    }
    let mut uses = Vec::new();
    for (a, s) in kernel.args.iter().zip(&spans) {
        if let Some(s) = s {
            if a.read {
                uses.push(Use::read(s, op, a.role));
            }
            if a.write {
                uses.push(Use::write(s, op, a.role));
            }
        }
    }
    if let Some(s) = &ws_span {
        uses.push(Use::write(s, op, "workspace"));
    }
    hazards::on_stream(stream as usize, uses);
    let k = Arc::clone(&kernel);
    let rc = st.enqueue(Box::new(move || {
        // The spans keep the allocations' storage alive until the kernel has run.
        let (spans, _ws) = (spans, ws_span);
        let mem = Mem {
            args: &k.args,
            ptrs: spans
                .iter()
                .map(|s| s.as_ref().map_or(0, |s| s.ptr))
                .collect(),
        };
        match (k.body)(&mem) {
            Ok(()) => ACL_SUCCESS,
            Err(msg) => {
                eprintln!("ascend-sys emulator: {op} failed on the device: {msg}");
                ACL_ERROR_RT_PARAM_INVALID
            }
        }
    }));
    if rc != ACL_SUCCESS {
        return fail_status(
            ACLNN_ERR_RUNTIME_ERROR,
            format!("{op}: queueing on the stream failed ({rc})"),
        );
    }
    if !repeatable {
        lock(objects()).remove(&(exec as usize));
    }
    counters::count(|c| c.kernels += 1);
    ACLNN_SUCCESS
}
