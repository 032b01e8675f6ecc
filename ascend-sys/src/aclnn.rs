//! The aclnn subset a small transformer needs: function-pointer types of CANN's
//! two-phase operator API, a table of them ([`Aclnn`]) and its loader ([`aclnn`]).
//!
//! Every operator is two calls: `aclnnXxxGetWorkspaceSize(args..., &workspace_size,
//! &executor)` checks the arguments and plans the kernel, then `aclnnXxx(workspace,
//! workspace_size, executor, stream)` queues it on a stream. Tensors are `aclTensor`
//! handles made by `aclCreateTensor` (view dims, strides, element offset, storage dims,
//! device address), scalars `aclScalar`, integer lists `aclIntArray`, masks
//! `aclBoolArray` (all from `libnnopbase.so`). An executor is single-use unless
//! `aclSetAclOpExecutorRepeatable` made it repeatable (then `aclDestroyAclOpExecutor`
//! releases it).
//!
//! The signatures are written from CANN's public operator documentation (the aclnn API
//! reference of the CANN "ops" repositories and hiascend.com); they are Rust types, not
//! part of the bindgen header. `tests/abi.rs` compares those the torch-npu wheel
//! declares (`aclGetRecentErrMsg`, the tensor/scalar/array calls, every second phase,
//! the `aclDataType`/`aclFormat` values); the first phases and the executor calls it
//! cannot (see README.md).
//!
//! Resolution happens at run time, as torch_npu does: with CANN, [`aclnn`] opens
//! `libopapi.so` and `libnnopbase.so` with `libloading` (from `$ASCEND_HOME_PATH/lib64`,
//! `$ASCEND_TOOLKIT_HOME/lib64`, then the dynamic loader's path) and `libascendcl.so` for
//! `aclGetRecentErrMsg`; with the emulator the table points at the emulator's CPU kernels
//! (`emulator::aclnn`), nothing is opened. [`load_cann`] is compiled in both builds.

use crate::aclrtStream;
use std::ffi::{c_char, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

/// An aclnn status (`ACLNN_SUCCESS` or an error code).
pub type aclnnStatus = i32;
pub const ACLNN_SUCCESS: aclnnStatus = 0;
/// A required pointer argument is null.
pub const ACLNN_ERR_PARAM_NULLPTR: aclnnStatus = 161001;
/// An argument is invalid (shapes, dtypes, sizes, a used executor, ...).
pub const ACLNN_ERR_PARAM_INVALID: aclnnStatus = 161002;
/// A runtime call the operator made failed (e.g. queueing on the stream).
pub const ACLNN_ERR_RUNTIME_ERROR: aclnnStatus = 361001;
/// An internal error.
pub const ACLNN_ERR_INNER: aclnnStatus = 561000;

/// The name of an aclnn status (`"ACLNN_ERR_UNKNOWN"` for others).
pub fn aclnn_status_name(code: aclnnStatus) -> &'static str {
    match code {
        ACLNN_SUCCESS => "ACLNN_SUCCESS",
        ACLNN_ERR_PARAM_NULLPTR => "ACLNN_ERR_PARAM_NULLPTR",
        ACLNN_ERR_PARAM_INVALID => "ACLNN_ERR_PARAM_INVALID",
        ACLNN_ERR_RUNTIME_ERROR => "ACLNN_ERR_RUNTIME_ERROR",
        ACLNN_ERR_INNER => "ACLNN_ERR_INNER",
        _ => "ACLNN_ERR_UNKNOWN",
    }
}

/// `aclDataType` (AscendCL's `acl_base.h`).
pub type aclDataType = i32;
pub const ACL_FLOAT: aclDataType = 0;
pub const ACL_FLOAT16: aclDataType = 1;
pub const ACL_INT8: aclDataType = 2;
pub const ACL_INT32: aclDataType = 3;
pub const ACL_UINT8: aclDataType = 4;
pub const ACL_INT64: aclDataType = 9;
pub const ACL_DOUBLE: aclDataType = 11;
pub const ACL_BOOL: aclDataType = 12;

/// `aclFormat`; aclnn tensors here are always `ACL_FORMAT_ND`.
pub type aclFormat = i32;
pub const ACL_FORMAT_ND: aclFormat = 2;

/// `cubeMathType` of the matmul family: 0 keeps the dtype (`KEEP_DTYPE`).
pub const KEEP_DTYPE: i8 = 0;

macro_rules! opaque {
    ($($name:ident),*) => {$(
        /// An opaque aclnn handle (only ever used behind a pointer).
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
        }
    )*};
}
opaque!(
    aclTensor,
    aclScalar,
    aclIntArray,
    aclBoolArray,
    aclOpExecutor
);

type Ws = *mut u64;
type Ex = *mut *mut aclOpExecutor;
type T = *const aclTensor;
type TMut = *mut aclTensor;

/// The second phase of every operator: `aclnnXxx(workspace, workspaceSize, executor, stream)`.
pub type aclnnRun_t = unsafe extern "C" fn(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus;

/// `aclCreateTensor(viewDims, viewDimsNum, dataType, stride, offset, format, storageDims,
/// storageDimsNum, tensorData)`; null on failure. `tensorData` must be 32-byte aligned.
pub type aclCreateTensor_t = unsafe extern "C" fn(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> *mut aclTensor;
pub type aclDestroyTensor_t = unsafe extern "C" fn(tensor: *const aclTensor) -> aclnnStatus;
/// `aclCreateScalar(value, dataType)`: reads one value of `dataType` at `value`.
pub type aclCreateScalar_t =
    unsafe extern "C" fn(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar;
pub type aclDestroyScalar_t = unsafe extern "C" fn(scalar: *const aclScalar) -> aclnnStatus;
pub type aclCreateIntArray_t =
    unsafe extern "C" fn(value: *const i64, size: u64) -> *mut aclIntArray;
pub type aclDestroyIntArray_t = unsafe extern "C" fn(array: *const aclIntArray) -> aclnnStatus;
pub type aclCreateBoolArray_t =
    unsafe extern "C" fn(value: *const bool, size: u64) -> *mut aclBoolArray;
pub type aclDestroyBoolArray_t = unsafe extern "C" fn(array: *const aclBoolArray) -> aclnnStatus;
pub type aclSetAclOpExecutorRepeatable_t =
    unsafe extern "C" fn(executor: *mut aclOpExecutor) -> aclnnStatus;
pub type aclDestroyAclOpExecutor_t =
    unsafe extern "C" fn(executor: *mut aclOpExecutor) -> aclnnStatus;
/// `aclGetRecentErrMsg()` (libascendcl): the calling thread's latest error message, or null.
pub type aclGetRecentErrMsg_t = unsafe extern "C" fn() -> *const c_char;

/// `aclnnMatmulGetWorkspaceSize(self, mat2, out, cubeMathType, ...)`; same for BatchMatMul.
pub type aclnnMatmulGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    mat2: T,
    out: TMut,
    cube_math_type: i8,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnAddmmGetWorkspaceSize(self, mat1, mat2, beta, alpha, out, cubeMathType, ...)`:
/// `out = beta * self + alpha * (mat1 @ mat2)`.
pub type aclnnAddmmGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    mat1: T,
    mat2: T,
    beta: *const aclScalar,
    alpha: *const aclScalar,
    out: TMut,
    cube_math_type: i8,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnAddGetWorkspaceSize(self, other, alpha, out, ...)`: `out = self + alpha * other`.
pub type aclnnAddGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    other: T,
    alpha: *const aclScalar,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnInplaceAddGetWorkspaceSize(selfRef, other, alpha, ...)`.
pub type aclnnInplaceAddGetWorkspaceSize_t = unsafe extern "C" fn(
    self_ref: TMut,
    other: T,
    alpha: *const aclScalar,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnMulGetWorkspaceSize(self, other, out, ...)`.
pub type aclnnMulGetWorkspaceSize_t =
    unsafe extern "C" fn(self_: T, other: T, out: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnMulsGetWorkspaceSize(self, other: scalar, out, ...)`.
pub type aclnnMulsGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    other: *const aclScalar,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnInplaceMulsGetWorkspaceSize(selfRef, other: scalar, ...)`.
pub type aclnnInplaceMulsGetWorkspaceSize_t =
    unsafe extern "C" fn(self_ref: TMut, other: *const aclScalar, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnReduceSumGetWorkspaceSize(self, dim, keepDim, dtype, out, ...)`.
pub type aclnnReduceSumGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    dim: *const aclIntArray,
    keep_dim: bool,
    dtype: aclDataType,
    out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnLayerNormGetWorkspaceSize(input, normalizedShape, weightOptional, biasOptional,
/// eps, out, meanOutOptional, rstdOutOptional, ...)`.
pub type aclnnLayerNormGetWorkspaceSize_t = unsafe extern "C" fn(
    input: T,
    normalized_shape: *const aclIntArray,
    weight: T,
    bias: T,
    eps: f64,
    out: TMut,
    mean_out: TMut,
    rstd_out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnLayerNormBackwardGetWorkspaceSize(gradOut, input, normalizedShape, mean, rstd,
/// weightOptional, biasOptional, outputMask, gradInputOut, gradWeightOut, gradBiasOut, ...)`.
pub type aclnnLayerNormBackwardGetWorkspaceSize_t = unsafe extern "C" fn(
    grad_out: T,
    input: T,
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
) -> aclnnStatus;
/// `aclnnGeluGetWorkspaceSize(self, out, ...)`.
pub type aclnnGeluGetWorkspaceSize_t =
    unsafe extern "C" fn(self_: T, out: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnGeluBackwardGetWorkspaceSize(gradOutput, self, gradInput, ...)`.
pub type aclnnGeluBackwardGetWorkspaceSize_t =
    unsafe extern "C" fn(grad_output: T, self_: T, grad_input: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnSoftmaxGetWorkspaceSize(self, dim, out, ...)`; same for LogSoftmax.
pub type aclnnSoftmaxGetWorkspaceSize_t =
    unsafe extern "C" fn(self_: T, dim: i64, out: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnSoftmaxBackwardGetWorkspaceSize(gradOutput, output, dim, gradInput, ...)`; same
/// for LogSoftmaxBackward.
pub type aclnnSoftmaxBackwardGetWorkspaceSize_t = unsafe extern "C" fn(
    grad_output: T,
    output: T,
    dim: i64,
    grad_input: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnInplaceMaskedFillScalarGetWorkspaceSize(selfRef, mask, value, ...)`.
pub type aclnnInplaceMaskedFillScalarGetWorkspaceSize_t = unsafe extern "C" fn(
    self_ref: TMut,
    mask: T,
    value: *const aclScalar,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnNLLLossGetWorkspaceSize(self, target, weight, reduction, ignoreIndex, out,
/// totalWeightOut, ...)`; `reduction` 0 none, 1 mean, 2 sum; `weight` (shape `[C]`) is
/// required.
pub type aclnnNLLLossGetWorkspaceSize_t = unsafe extern "C" fn(
    self_: T,
    target: T,
    weight: T,
    reduction: i64,
    ignore_index: i64,
    out: TMut,
    total_weight_out: TMut,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnNLLLossBackwardGetWorkspaceSize(gradOutput, self, target, weight, reduction,
/// ignoreIndex, totalWeight, out, ...)`.
pub type aclnnNLLLossBackwardGetWorkspaceSize_t = unsafe extern "C" fn(
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
) -> aclnnStatus;
/// `aclnnEmbeddingGetWorkspaceSize(weight, indices, out, ...)`.
pub type aclnnEmbeddingGetWorkspaceSize_t =
    unsafe extern "C" fn(weight: T, indices: T, out: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad, indices, numWeights, paddingIdx,
/// scaleGradByFreq, out, ...)`; `paddingIdx` as `u64`, a negative value (e.g. `-1i64 as
/// u64`) meaning none.
pub type aclnnEmbeddingDenseBackwardGetWorkspaceSize_t = unsafe extern "C" fn(
    grad: T,
    indices: T,
    num_weights: u64,
    padding_idx: u64,
    scale_grad_by_freq: bool,
    out: T,
    ws: Ws,
    ex: Ex,
) -> aclnnStatus;
/// `aclnnInplaceCopyGetWorkspaceSize(selfRef, src, ...)`: `src` broadcast and cast to `selfRef`.
pub type aclnnInplaceCopyGetWorkspaceSize_t =
    unsafe extern "C" fn(self_ref: TMut, src: T, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnInplaceZeroGetWorkspaceSize(selfRef, ...)`.
pub type aclnnInplaceZeroGetWorkspaceSize_t =
    unsafe extern "C" fn(self_ref: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnCastGetWorkspaceSize(self, dtype, out, ...)`.
pub type aclnnCastGetWorkspaceSize_t =
    unsafe extern "C" fn(self_: T, dtype: aclDataType, out: TMut, ws: Ws, ex: Ex) -> aclnnStatus;
/// `aclnnApplyAdamWV2GetWorkspaceSize(varRef, mRef, vRef, maxGradNormOptionalRef, grad,
/// step, lr, beta1, beta2, weightDecay, eps, amsgrad, maximize, ...)`.
pub type aclnnApplyAdamWV2GetWorkspaceSize_t = unsafe extern "C" fn(
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
) -> aclnnStatus;

macro_rules! table {
    (
        nnopbase { $($nb:ident: $nbt:ty),* $(,)? }
        acl { $($ac:ident: $act:ty),* $(,)? }
        ops { $($op:ident: $gws:ident: $gwst:ty),* $(,)? }
    ) => {
        /// The resolved entry points. Field names are the C symbol names.
        #[derive(Clone, Copy)]
        pub struct Aclnn {
            $(pub $nb: $nbt,)*
            $(pub $ac: $act,)*
            $(pub $gws: $gwst, pub $op: aclnnRun_t,)*
        }

        /// Every symbol of the table: (library, name).
        pub const SYMBOLS: &[(&str, &str)] = &[
            $(("libnnopbase.so", stringify!($nb)),)*
            $(("libascendcl.so", stringify!($ac)),)*
            $(("libopapi.so", stringify!($gws)), ("libopapi.so", stringify!($op)),)*
        ];

        impl Aclnn {
            /// Resolves every symbol from the three opened libraries.
            fn resolve(
                opapi: &'static libloading::Library,
                nnopbase: &'static libloading::Library,
                acl: &'static libloading::Library,
            ) -> Result<Aclnn, LoadError> {
                Ok(Aclnn {
                    $($nb: symbol(nnopbase, "libnnopbase.so", stringify!($nb))?,)*
                    $($ac: symbol(acl, "libascendcl.so", stringify!($ac))?,)*
                    $(
                        $gws: symbol(opapi, "libopapi.so", stringify!($gws))?,
                        $op: symbol(opapi, "libopapi.so", stringify!($op))?,
                    )*
                })
            }

            #[cfg(ascend_emulator)]
            fn emulated() -> Aclnn {
                use crate::emulator::aclnn as emu;
                Aclnn {
                    $($nb: emu::$nb,)*
                    $($ac: emu::$ac,)*
                    $($gws: emu::$gws, $op: emu::$op,)*
                }
            }
        }
    };
}

table! {
    nnopbase {
        aclCreateTensor: aclCreateTensor_t,
        aclDestroyTensor: aclDestroyTensor_t,
        aclCreateScalar: aclCreateScalar_t,
        aclDestroyScalar: aclDestroyScalar_t,
        aclCreateIntArray: aclCreateIntArray_t,
        aclDestroyIntArray: aclDestroyIntArray_t,
        aclCreateBoolArray: aclCreateBoolArray_t,
        aclDestroyBoolArray: aclDestroyBoolArray_t,
        aclSetAclOpExecutorRepeatable: aclSetAclOpExecutorRepeatable_t,
        aclDestroyAclOpExecutor: aclDestroyAclOpExecutor_t,
    }
    acl {
        aclGetRecentErrMsg: aclGetRecentErrMsg_t,
    }
    ops {
        aclnnMatmul: aclnnMatmulGetWorkspaceSize: aclnnMatmulGetWorkspaceSize_t,
        aclnnBatchMatMul: aclnnBatchMatMulGetWorkspaceSize: aclnnMatmulGetWorkspaceSize_t,
        aclnnAddmm: aclnnAddmmGetWorkspaceSize: aclnnAddmmGetWorkspaceSize_t,
        aclnnAdd: aclnnAddGetWorkspaceSize: aclnnAddGetWorkspaceSize_t,
        aclnnInplaceAdd: aclnnInplaceAddGetWorkspaceSize: aclnnInplaceAddGetWorkspaceSize_t,
        aclnnMul: aclnnMulGetWorkspaceSize: aclnnMulGetWorkspaceSize_t,
        aclnnMuls: aclnnMulsGetWorkspaceSize: aclnnMulsGetWorkspaceSize_t,
        aclnnInplaceMuls: aclnnInplaceMulsGetWorkspaceSize: aclnnInplaceMulsGetWorkspaceSize_t,
        aclnnReduceSum: aclnnReduceSumGetWorkspaceSize: aclnnReduceSumGetWorkspaceSize_t,
        aclnnLayerNorm: aclnnLayerNormGetWorkspaceSize: aclnnLayerNormGetWorkspaceSize_t,
        aclnnLayerNormBackward: aclnnLayerNormBackwardGetWorkspaceSize:
            aclnnLayerNormBackwardGetWorkspaceSize_t,
        aclnnGelu: aclnnGeluGetWorkspaceSize: aclnnGeluGetWorkspaceSize_t,
        aclnnGeluBackward: aclnnGeluBackwardGetWorkspaceSize: aclnnGeluBackwardGetWorkspaceSize_t,
        aclnnSoftmax: aclnnSoftmaxGetWorkspaceSize: aclnnSoftmaxGetWorkspaceSize_t,
        aclnnSoftmaxBackward: aclnnSoftmaxBackwardGetWorkspaceSize:
            aclnnSoftmaxBackwardGetWorkspaceSize_t,
        aclnnInplaceMaskedFillScalar: aclnnInplaceMaskedFillScalarGetWorkspaceSize:
            aclnnInplaceMaskedFillScalarGetWorkspaceSize_t,
        aclnnLogSoftmax: aclnnLogSoftmaxGetWorkspaceSize: aclnnSoftmaxGetWorkspaceSize_t,
        aclnnLogSoftmaxBackward: aclnnLogSoftmaxBackwardGetWorkspaceSize:
            aclnnSoftmaxBackwardGetWorkspaceSize_t,
        aclnnNLLLoss: aclnnNLLLossGetWorkspaceSize: aclnnNLLLossGetWorkspaceSize_t,
        aclnnNLLLossBackward: aclnnNLLLossBackwardGetWorkspaceSize:
            aclnnNLLLossBackwardGetWorkspaceSize_t,
        aclnnEmbedding: aclnnEmbeddingGetWorkspaceSize: aclnnEmbeddingGetWorkspaceSize_t,
        aclnnEmbeddingDenseBackward: aclnnEmbeddingDenseBackwardGetWorkspaceSize:
            aclnnEmbeddingDenseBackwardGetWorkspaceSize_t,
        aclnnInplaceCopy: aclnnInplaceCopyGetWorkspaceSize: aclnnInplaceCopyGetWorkspaceSize_t,
        aclnnInplaceZero: aclnnInplaceZeroGetWorkspaceSize: aclnnInplaceZeroGetWorkspaceSize_t,
        aclnnCast: aclnnCastGetWorkspaceSize: aclnnCastGetWorkspaceSize_t,
        aclnnApplyAdamWV2: aclnnApplyAdamWV2GetWorkspaceSize: aclnnApplyAdamWV2GetWorkspaceSize_t,
    }
}

/// Why the aclnn table could not be loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// A library was found nowhere (each place tried, with the loader's last error).
    Library {
        name: &'static str,
        tried: Vec<String>,
        error: String,
    },
    /// A library lacks a symbol (an older CANN than the operator needs).
    Symbol {
        library: &'static str,
        symbol: &'static str,
        error: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Library { name, tried, error } => write!(
                f,
                "cannot load {name} (tried {}): {error}; install the CANN toolkit and \
                 `source .../ascend-toolkit/set_env.sh` (sets ASCEND_HOME_PATH and \
                 LD_LIBRARY_PATH)",
                tried.join(", ")
            ),
            LoadError::Symbol {
                library,
                symbol,
                error,
            } => write!(
                f,
                "{library} has no symbol {symbol} ({error}); this CANN is older than the \
                 aclnn subset needs: install a newer toolkit (8.0 or later)"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

fn symbol<F: Copy>(
    lib: &'static libloading::Library,
    library: &'static str,
    name: &'static str,
) -> Result<F, LoadError> {
    // SAFETY: the symbol is declared with the C signature of CANN's documentation (the
    // table's type); the library stays loaded for the process (leaked).
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| LoadError::Symbol {
            library,
            symbol: name,
            error: e.to_string(),
        })
}

/// Where a CANN library is looked for: `$ASCEND_HOME_PATH/lib64`,
/// `$ASCEND_TOOLKIT_HOME/lib64` (and their `lib`), then the bare name (the dynamic
/// loader's path: `LD_LIBRARY_PATH`, the cache).
pub fn candidates(name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            for sub in ["lib64", "lib"] {
                out.push(Path::new(&root).join(sub).join(name));
            }
        }
    }
    out.push(PathBuf::from(name));
    out
}

fn open(name: &'static str, places: &[PathBuf]) -> Result<&'static libloading::Library, LoadError> {
    let mut error = String::from("not found");
    let mut tried = Vec::new();
    for p in places {
        if p.components().count() > 1 && !p.exists() {
            tried.push(format!("{} (absent)", p.display()));
            continue;
        }
        tried.push(p.display().to_string());
        // SAFETY: loading a CANN library runs its initialisers, which is what using it
        // requires; it is never unloaded.
        match unsafe { libloading::Library::new(p) } {
            Ok(l) => return Ok(Box::leak(Box::new(l))),
            Err(e) => error = e.to_string(),
        }
    }
    Err(LoadError::Library { name, tried, error })
}

/// Loads the table from CANN's libraries (`libopapi.so`, `libnnopbase.so`,
/// `libascendcl.so`), looked for by [`candidates`] unless `dir` names the one directory
/// to use. Compiled in every build (so its errors are testable without CANN).
pub fn load_cann(dir: Option<&Path>) -> Result<Aclnn, LoadError> {
    let places = |name: &'static str| match dir {
        Some(d) => vec![d.join(name)],
        None => candidates(name),
    };
    let opapi = open("libopapi.so", &places("libopapi.so"))?;
    let nnopbase = open("libnnopbase.so", &places("libnnopbase.so"))?;
    let acl = open("libascendcl.so", &places("libascendcl.so"))?;
    Aclnn::resolve(opapi, nnopbase, acl)
}

/// The process's aclnn table, resolved once: CANN's libraries in a CANN build, the
/// emulator's kernels in an emulator build.
pub fn aclnn() -> Result<&'static Aclnn, LoadError> {
    static TABLE: std::sync::OnceLock<Result<Aclnn, LoadError>> = std::sync::OnceLock::new();
    TABLE
        .get_or_init(|| {
            #[cfg(ascend_emulator)]
            {
                Ok(Aclnn::emulated())
            }
            #[cfg(not(ascend_emulator))]
            {
                load_cann(None)
            }
        })
        .as_ref()
        .map_err(Clone::clone)
}
