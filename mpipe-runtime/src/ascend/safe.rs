//! The safe layer over `ascend-sys`: status codes as a typed [`AscendError`] naming the
//! failed call and the ACL/HCCL error, and RAII owners of the device binding
//! ([`Device`]), streams ([`Stream`]), events ([`Event`]), device memory
//! ([`DeviceBuffer`]) and communicators ([`HcclComm`]). Every `unsafe` FFI call of the
//! backend is in this file, except the aclnn kernels' (in [`super::kernels`]); the rest of
//! `ascend/` is safe code (`unsafe_code` is denied there). Host memory of an
//! asynchronous upload is owned by its stream until a host wait proves the copy ran
//! ([`Stream::upload_async`]), so no caller has to promise a lifetime.

use ascend_sys as sys;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Why an Ascend call failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AscendError {
    /// An AscendCL call returned `code` (`name`, e.g. `ACL_ERROR_RT_INVALID_DEVICEID`).
    #[error("{call} failed: {name} ({code})")]
    Acl {
        call: &'static str,
        code: i32,
        name: &'static str,
    },
    /// An HCCL call (or work it queued on a stream) failed with `code` (`name`, e.g.
    /// `HCCL_E_TIMEOUT`; `message` is `HcclGetErrorString`'s text). `during` says
    /// what the backend was doing (`RECV act(unit 3, mb 5) from rank 1`), when known.
    #[error("{call} failed: {name} ({code}: {message}){}", during_suffix(.during))]
    Hccl {
        call: &'static str,
        code: u32,
        name: &'static str,
        message: String,
        during: Option<String>,
    },
    /// Rank `rank` failed while doing `what`: it called `abort` (on this rank, or on a
    /// rank of the same in-process world). Every later call returns this again.
    #[error("rank {rank} failed: {what}")]
    PeerFailed { rank: usize, what: String },
    /// The call itself is wrong (a rank out of range, a group without this rank, point-
    /// to-point messages posted in orders HCCL cannot match, ...).
    #[error("invalid communication call: {0}")]
    Invalid(String),
    /// Setting the communicator up failed.
    #[error("communicator setup failed: {0}")]
    Setup(String),
    /// A device tensor view does not fit its buffer or its kernel (shapes, dtypes).
    #[error("invalid device tensor: {0}")]
    Tensor(String),
    /// An aclnn call (`aclnnMatmulGetWorkspaceSize`, `aclnnMatmul`, `aclCreateTensor`, ...)
    /// returned `code` (`name`, e.g. `ACLNN_ERR_PARAM_INVALID`), or its library or symbol
    /// could not be loaded (`code` 0, `name` `"load"`, `detail` saying which).
    #[error("{call} failed: {name} ({code}){}", detail_suffix(.detail))]
    Aclnn {
        call: &'static str,
        code: i32,
        name: &'static str,
        detail: String,
    },
    /// The rank's batch table does not fit the program (a compiled table from another
    /// derivation: rebuild) or the model's sizes.
    #[error(transparent)]
    Table(#[from] crate::batches::TableError),
}

fn detail_suffix(d: &str) -> String {
    if d.is_empty() {
        String::new()
    } else {
        format!(": {d}")
    }
}

fn during_suffix(d: &Option<String>) -> String {
    d.as_ref()
        .map_or(String::new(), |d| format!(" while doing {d}"))
}

impl AscendError {
    /// The HCCL result code, for [`AscendError::Hccl`].
    pub fn hccl_code(&self) -> Option<u32> {
        match self {
            AscendError::Hccl { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The error's ACL or HCCL name (`HCCL_E_PARA`, `ACL_ERROR_INVALID_PARAM`, ...).
    pub fn code_name(&self) -> Option<&'static str> {
        match self {
            AscendError::Acl { name, .. } | AscendError::Hccl { name, .. } => Some(name),
            _ => None,
        }
    }

    /// Adds what the backend was doing to an HCCL error.
    pub(crate) fn during(mut self, what: impl FnOnce() -> String) -> AscendError {
        if let AscendError::Hccl { during, .. } = &mut self {
            if during.is_none() {
                *during = Some(what());
            }
        }
        self
    }
}

/// The name of an AscendCL error code (`"ACL_ERROR_UNKNOWN"` for codes outside the
/// subset `ascend-sys` declares).
pub fn acl_error_name(code: sys::aclError) -> &'static str {
    match code {
        sys::ACL_SUCCESS => "ACL_SUCCESS",
        sys::ACL_ERROR_INVALID_PARAM => "ACL_ERROR_INVALID_PARAM",
        sys::ACL_ERROR_UNINITIALIZE => "ACL_ERROR_UNINITIALIZE",
        sys::ACL_ERROR_REPEAT_INITIALIZE => "ACL_ERROR_REPEAT_INITIALIZE",
        sys::ACL_ERROR_REPEAT_FINALIZE => "ACL_ERROR_REPEAT_FINALIZE",
        sys::ACL_ERROR_BAD_ALLOC => "ACL_ERROR_BAD_ALLOC",
        sys::ACL_ERROR_API_NOT_SUPPORT => "ACL_ERROR_API_NOT_SUPPORT",
        sys::ACL_ERROR_INVALID_DEVICE => "ACL_ERROR_INVALID_DEVICE",
        sys::ACL_ERROR_INVALID_RESOURCE_HANDLE => "ACL_ERROR_INVALID_RESOURCE_HANDLE",
        sys::ACL_ERROR_RT_PARAM_INVALID => "ACL_ERROR_RT_PARAM_INVALID",
        sys::ACL_ERROR_RT_INVALID_DEVICEID => "ACL_ERROR_RT_INVALID_DEVICEID",
        sys::ACL_ERROR_RT_CONTEXT_NULL => "ACL_ERROR_RT_CONTEXT_NULL",
        sys::ACL_ERROR_RT_STREAM_CONTEXT => "ACL_ERROR_RT_STREAM_CONTEXT",
        sys::ACL_ERROR_RT_INVALID_HANDLE => "ACL_ERROR_RT_INVALID_HANDLE",
        sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT => "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
        sys::ACL_ERROR_RT_MEMORY_ALLOCATION => "ACL_ERROR_RT_MEMORY_ALLOCATION",
        sys::ACL_ERROR_RT_NO_DEVICE => "ACL_ERROR_RT_NO_DEVICE",
        sys::ACL_ERROR_RT_INTERNAL_ERROR => "ACL_ERROR_RT_INTERNAL_ERROR",
        _ => "ACL_ERROR_UNKNOWN",
    }
}

/// The name of an HCCL result code (`"HCCL_E_UNKNOWN"` outside the declared enum).
pub fn hccl_error_name(code: sys::HcclResult) -> &'static str {
    use sys::HcclResult as R;
    match code {
        R::HCCL_SUCCESS => "HCCL_SUCCESS",
        R::HCCL_E_PARA => "HCCL_E_PARA",
        R::HCCL_E_PTR => "HCCL_E_PTR",
        R::HCCL_E_MEMORY => "HCCL_E_MEMORY",
        R::HCCL_E_INTERNAL => "HCCL_E_INTERNAL",
        R::HCCL_E_NOT_SUPPORT => "HCCL_E_NOT_SUPPORT",
        R::HCCL_E_NOT_FOUND => "HCCL_E_NOT_FOUND",
        R::HCCL_E_UNAVAIL => "HCCL_E_UNAVAIL",
        R::HCCL_E_SYSCALL => "HCCL_E_SYSCALL",
        R::HCCL_E_TIMEOUT => "HCCL_E_TIMEOUT",
        R::HCCL_E_OPEN_FILE_FAILURE => "HCCL_E_OPEN_FILE_FAILURE",
        R::HCCL_E_TCP_CONNECT => "HCCL_E_TCP_CONNECT",
        R::HCCL_E_ROCE_CONNECT => "HCCL_E_ROCE_CONNECT",
        R::HCCL_E_TCP_TRANSFER => "HCCL_E_TCP_TRANSFER",
        R::HCCL_E_ROCE_TRANSFER => "HCCL_E_ROCE_TRANSFER",
        R::HCCL_E_RUNTIME => "HCCL_E_RUNTIME",
        R::HCCL_E_DRV => "HCCL_E_DRV",
        R::HCCL_E_PROFILING => "HCCL_E_PROFILING",
        R::HCCL_E_CCE => "HCCL_E_CCE",
        R::HCCL_E_NETWORK => "HCCL_E_NETWORK",
        R::HCCL_E_AGAIN => "HCCL_E_AGAIN",
        R::HCCL_E_REMOTE => "HCCL_E_REMOTE",
        _ => "HCCL_E_UNKNOWN",
    }
}

/// An AscendCL status as a result.
pub fn acl(call: &'static str, code: sys::aclError) -> Result<(), AscendError> {
    if code == sys::ACL_SUCCESS {
        Ok(())
    } else {
        Err(AscendError::Acl {
            call,
            code,
            name: acl_error_name(code),
        })
    }
}

/// An HCCL status as a result (with `HcclGetErrorString`'s message).
pub fn hccl(call: &'static str, code: sys::HcclResult) -> Result<(), AscendError> {
    if code == sys::HcclResult::HCCL_SUCCESS {
        return Ok(());
    }
    // SAFETY: HcclGetErrorString takes any code and returns a static C string (or null).
    let p = unsafe { sys::HcclGetErrorString(code) };
    let message = if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated and static by the API's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    };
    Err(AscendError::Hccl {
        call,
        code: code.0,
        name: hccl_error_name(code),
        message,
        during: None,
    })
}

/// `aclInit` once per process (a repeated initialisation, e.g. by another library, is
/// fine). AscendCL is never finalized: `aclFinalize` is process-wide and other users
/// of the process may still need it.
pub fn init() -> Result<(), AscendError> {
    static INIT: OnceLock<Result<(), AscendError>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: a null config path is allowed ("no configuration").
        let rc = unsafe { sys::aclInit(std::ptr::null()) };
        if rc == sys::ACL_ERROR_REPEAT_INITIALIZE {
            Ok(())
        } else {
            acl("aclInit", rc)
        }
    })
    .clone()
}

/// The number of devices (`aclrtGetDeviceCount`).
pub fn device_count() -> Result<u32, AscendError> {
    init()?;
    let mut n = 0u32;
    // SAFETY: a writable u32.
    acl("aclrtGetDeviceCount", unsafe {
        sys::aclrtGetDeviceCount(&mut n)
    })?;
    Ok(n)
}

/// The calling thread bound to a device (`aclrtSetDevice`); dropping it calls
/// `aclrtResetDevice`.
#[derive(Debug)]
pub struct Device {
    id: i32,
}

impl Device {
    /// Binds the calling thread to device `id` (initializing AscendCL first).
    pub fn set(id: i32) -> Result<Device, AscendError> {
        init()?;
        // SAFETY: plain value argument.
        acl("aclrtSetDevice", unsafe { sys::aclrtSetDevice(id) })?;
        Ok(Device { id })
    }

    /// Binds another thread (a helper of the rank) to this device too. AscendCL binds
    /// contexts per thread, so each thread that touches the device calls this.
    pub fn bind_thread(&self) -> Result<(), AscendError> {
        // SAFETY: plain value argument.
        acl("aclrtSetDevice", unsafe { sys::aclrtSetDevice(self.id) })
    }

    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: plain value argument; errors cannot be reported from drop.
        let _ = unsafe { sys::aclrtResetDevice(self.id) };
    }
}

/// Copies `out.len()` bytes from device address `addr` to the host (`aclrtMemcpy`,
/// device to host, synchronous: everything queued before it that writes there must be
/// ordered before the call, e.g. by a stream synchronisation).
pub fn read_device(addr: usize, out: &mut [u8]) -> Result<(), AscendError> {
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: `out` is writable for its length; `addr` is a device address, which the
    // host does not dereference (AscendCL validates it).
    acl("aclrtMemcpy", unsafe {
        sys::aclrtMemcpy(
            out.as_mut_ptr().cast(),
            out.len(),
            addr as *const c_void,
            out.len(),
            sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
        )
    })
}

/// Host bytes of host-to-device copies queued on one stream ([`Stream::upload_async`]),
/// each with its sequence number on that stream, kept (their heap storage does not
/// move) until a host wait proves the copy has run.
#[derive(Debug, Default)]
struct Staged {
    held: Vec<(u64, Box<[u8]>)>,
    next: u64,
}

type StagedRef = Arc<Mutex<Staged>>;

/// A point in a stream's uploads: every upload numbered below `seq` on `staged`'s
/// stream was queued before it.
#[derive(Clone, Debug)]
struct Mark {
    staged: StagedRef,
    seq: u64,
}

impl Mark {
    /// The uploads before this mark have run (a host wait ordered after it returned).
    fn release(&self) {
        lock(&self.staged).held.retain(|(seq, _)| *seq >= self.seq);
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // Copies that no host wait has proved run may still read these bytes: leak them
        // rather than free them under a queued copy.
        for (_, b) in self.held.drain(..) {
            std::mem::forget(b);
        }
    }
}

/// A poisoned lock only means another thread panicked while holding it; the data (a
/// list of held buffers) is still consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An `aclrtStream`; dropping it waits for its queued work and destroys it.
///
/// It keeps the host memory of its [uploads](Stream::upload_async) until a host wait
/// proves them run: its own [`synchronize`](Stream::synchronize), or that of an event
/// recorded after them, or of a stream that [waited](Stream::wait_event) for such an
/// event.
#[derive(Debug)]
pub struct Stream {
    raw: sys::aclrtStream,
    staged: StagedRef,
    /// Marks of other streams' uploads this stream's later work is ordered after.
    after: Mutex<Vec<Mark>>,
}

// SAFETY: a stream handle may be used from any thread bound to its device (AscendCL's
// handles are thread-safe; the emulator's are looked up in a locked table).
unsafe impl Send for Stream {}
// SAFETY: as above; every operation takes `&self` and is internally synchronized.
unsafe impl Sync for Stream {}

impl Stream {
    /// A stream on the calling thread's device.
    pub fn new() -> Result<Stream, AscendError> {
        let mut raw = null_mut();
        // SAFETY: a writable handle.
        acl("aclrtCreateStream", unsafe {
            sys::aclrtCreateStream(&mut raw)
        })?;
        Ok(Stream {
            raw,
            staged: StagedRef::default(),
            after: Mutex::new(Vec::new()),
        })
    }

    /// The current end of this stream's uploads.
    fn mark(&self) -> Mark {
        Mark {
            staged: Arc::clone(&self.staged),
            seq: lock(&self.staged).next,
        }
    }

    pub fn raw(&self) -> sys::aclrtStream {
        self.raw
    }

    /// Waits for everything queued so far; reports the first failure among it. On
    /// success it releases the host memory of the uploads it has proved run (this
    /// stream's, and those of events this stream waited for).
    pub fn synchronize(&self) -> Result<(), AscendError> {
        let own = self.mark();
        let after = std::mem::take(&mut *lock(&self.after));
        // SAFETY: a live stream handle.
        let r = acl("aclrtSynchronizeStream", unsafe {
            sys::aclrtSynchronizeStream(self.raw)
        });
        if r.is_ok() {
            own.release();
            after.iter().for_each(Mark::release);
        }
        r
    }

    /// Makes this stream's later work wait for `event`'s latest recording.
    pub fn wait_event(&self, event: &Event) -> Result<(), AscendError> {
        // SAFETY: live handles.
        acl("aclrtStreamWaitEvent", unsafe {
            sys::aclrtStreamWaitEvent(self.raw, event.raw)
        })?;
        if let Some(m) = lock(&event.mark).clone() {
            lock(&self.after).push(m);
        }
        Ok(())
    }

    /// Queues a device-to-device copy of `bytes` bytes from `src` to `dst` (device
    /// addresses, which the host does not dereference; AscendCL checks them).
    pub fn copy_device_async(
        &self,
        dst: usize,
        src: usize,
        bytes: usize,
    ) -> Result<(), AscendError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: device addresses only; AscendCL validates them and `bytes` as destMax.
        acl("aclrtMemcpyAsync", unsafe {
            sys::aclrtMemcpyAsync(
                dst as *mut c_void,
                bytes,
                src as *const c_void,
                bytes,
                sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE,
                self.raw,
            )
        })
    }

    /// Queues a host-to-device copy of `src` into `dst` (from offset 0). The stream
    /// keeps `src` until a host wait proves the copy has run (see [`Stream`]); a copy no
    /// wait ever proves run leaks its bytes rather than free them under it.
    pub fn upload_async(&self, dst: &DeviceBuffer, src: Box<[u8]>) -> Result<(), AscendError> {
        if src.is_empty() {
            return Ok(());
        }
        let mut staged = lock(&self.staged);
        // SAFETY: `dst` holds `dst.bytes` bytes (checked as destMax); `src`'s heap
        // storage is kept in `self.staged` until a host wait ordered after this copy
        // returns (or leaked), so it outlives the copy.
        acl("aclrtMemcpyAsync", unsafe {
            sys::aclrtMemcpyAsync(
                dst.ptr,
                dst.bytes,
                src.as_ptr().cast(),
                src.len(),
                sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.raw,
            )
        })?;
        let seq = staged.next;
        staged.next += 1;
        staged.held.push((seq, src));
        Ok(())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Uploads no wait has proved run: wait for them so their host bytes are freed
        // (if the wait fails they are leaked, see `Staged`).
        if !lock(&self.staged).held.is_empty() {
            let _ = self.synchronize();
        }
        // SAFETY: a live handle, destroyed once.
        let _ = unsafe { sys::aclrtDestroyStream(self.raw) };
    }
}

/// An `aclrtEvent`.
#[derive(Debug)]
pub struct Event {
    raw: sys::aclrtEvent,
    /// The uploads of the stream it was last recorded on that precede the recording.
    mark: Mutex<Option<Mark>>,
}

// SAFETY: as for `Stream`.
unsafe impl Send for Event {}
// SAFETY: as for `Stream`.
unsafe impl Sync for Event {}

impl Event {
    pub fn new() -> Result<Event, AscendError> {
        let mut raw = null_mut();
        // SAFETY: a writable handle.
        acl("aclrtCreateEvent", unsafe {
            sys::aclrtCreateEvent(&mut raw)
        })?;
        Ok(Event {
            raw,
            mark: Mutex::new(None),
        })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), AscendError> {
        let mark = stream.mark();
        // SAFETY: live handles.
        acl("aclrtRecordEvent", unsafe {
            sys::aclrtRecordEvent(self.raw, stream.raw)
        })?;
        *lock(&self.mark) = Some(mark);
        Ok(())
    }

    /// Waits for the latest recording (releasing the host memory of the uploads
    /// before it).
    pub fn synchronize(&self) -> Result<(), AscendError> {
        let mark = lock(&self.mark).clone();
        // SAFETY: a live handle.
        acl("aclrtSynchronizeEvent", unsafe {
            sys::aclrtSynchronizeEvent(self.raw)
        })?;
        if let Some(m) = mark {
            m.release();
        }
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: a live handle, destroyed once.
        let _ = unsafe { sys::aclrtDestroyEvent(self.raw) };
    }
}

/// Device memory (`aclrtMalloc`/`aclrtFree`) of a fixed size.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: device memory is not tied to a host thread.
unsafe impl Send for DeviceBuffer {}
// SAFETY: the safe methods copy through AscendCL, which synchronizes.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `bytes` bytes of device memory (at least one byte is allocated: AscendCL
    /// rejects empty allocations).
    pub fn new(bytes: usize) -> Result<DeviceBuffer, AscendError> {
        let mut ptr = null_mut();
        // SAFETY: a writable pointer; a non-zero size.
        acl("aclrtMalloc", unsafe {
            sys::aclrtMalloc(
                &mut ptr,
                bytes.max(1),
                sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST,
            )
        })?;
        Ok(DeviceBuffer { ptr, bytes })
    }

    /// A buffer holding a copy of `data` (synchronous copy).
    pub fn from_host(data: &[u8]) -> Result<DeviceBuffer, AscendError> {
        let b = DeviceBuffer::new(data.len())?;
        b.write(data)?;
        Ok(b)
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// Copies `data` to the start of the buffer (`aclrtMemcpy`, host to device).
    pub fn write(&self, data: &[u8]) -> Result<(), AscendError> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: the buffer holds `bytes` bytes (checked as destMax); `data` is alive.
        acl("aclrtMemcpy", unsafe {
            sys::aclrtMemcpy(
                self.ptr,
                self.bytes,
                data.as_ptr().cast(),
                data.len(),
                sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
            )
        })
    }

    /// Copies the start of the buffer into `out` (`aclrtMemcpy`, device to host).
    pub fn read(&self, out: &mut [u8]) -> Result<(), AscendError> {
        if out.is_empty() {
            return Ok(());
        }
        if out.len() > self.bytes {
            return Err(AscendError::Invalid(format!(
                "reading {} bytes from a device buffer of {}",
                out.len(),
                self.bytes
            )));
        }
        // SAFETY: `out` is writable for its length; the buffer holds at least as much.
        acl("aclrtMemcpy", unsafe {
            sys::aclrtMemcpy(
                out.as_mut_ptr().cast(),
                out.len(),
                self.ptr,
                out.len(),
                sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by aclrtMalloc, freed once.
        let _ = unsafe { sys::aclrtFree(self.ptr) };
    }
}

/// The opaque bytes ranks exchange to form a communicator (`HcclRootInfo`,
/// [`ROOT_INFO_BYTES`] bytes).
#[derive(Clone)]
pub struct RootInfo(pub Box<sys::HcclRootInfo>);

/// `HCCL_ROOT_INFO_BYTES`.
pub const ROOT_INFO_BYTES: usize = sys::HCCL_ROOT_INFO_BYTES as usize;

impl RootInfo {
    /// A new root info (`HcclGetRootInfo`), made by the communicator's rank 0.
    pub fn new() -> Result<RootInfo, AscendError> {
        let mut info = Box::<sys::HcclRootInfo>::default();
        // SAFETY: a writable HcclRootInfo.
        hccl("HcclGetRootInfo", unsafe {
            sys::HcclGetRootInfo(&mut *info)
        })?;
        Ok(RootInfo(info))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// From [`to_bytes`](RootInfo::to_bytes)'s output.
    pub fn from_bytes(bytes: &[u8]) -> Result<RootInfo, AscendError> {
        if bytes.len() != ROOT_INFO_BYTES {
            return Err(AscendError::Setup(format!(
                "a root info has {ROOT_INFO_BYTES} bytes, got {}",
                bytes.len()
            )));
        }
        let mut info = Box::<sys::HcclRootInfo>::default();
        for (d, &s) in info.internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        Ok(RootInfo(info))
    }
}

impl fmt::Debug for RootInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RootInfo({} bytes)", ROOT_INFO_BYTES)
    }
}

/// An HCCL communicator (`HcclCommInitRootInfo`/`HcclCommDestroy`, or
/// [`sys::abandon`] once [`HcclComm::leave_as_failed`] is called).
#[derive(Debug)]
pub struct HcclComm {
    raw: sys::HcclComm,
    rank: u32,
    size: u32,
    failed: bool,
}

// SAFETY: HCCL communicators are used from the rank's threads; the emulator's handles
// are looked up in a locked table.
unsafe impl Send for HcclComm {}
// SAFETY: as above.
unsafe impl Sync for HcclComm {}

/// The element types the backend moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    F32,
    U32,
    U8,
}

impl DataType {
    fn raw(self) -> sys::HcclDataType {
        match self {
            DataType::F32 => sys::HcclDataType::HCCL_DATA_TYPE_FP32,
            DataType::U32 => sys::HcclDataType::HCCL_DATA_TYPE_UINT32,
            DataType::U8 => sys::HcclDataType::HCCL_DATA_TYPE_UINT8,
        }
    }
    pub fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::U32 => 4,
            DataType::U8 => 1,
        }
    }
}

/// Whether an item of [`HcclComm::batch_send_recv`] sends or receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Send,
    Recv,
}

impl HcclComm {
    /// Joins the communicator of `n_ranks` ranks described by `info` as `rank`
    /// (blocks, on real HCCL, until every rank has joined).
    pub fn init(n_ranks: u32, info: &RootInfo, rank: u32) -> Result<HcclComm, AscendError> {
        let mut raw = null_mut();
        // SAFETY: a readable root info and a writable handle.
        hccl("HcclCommInitRootInfo", unsafe {
            sys::HcclCommInitRootInfo(n_ranks, &*info.0, rank, &mut raw)
        })?;
        let c = HcclComm {
            raw,
            rank,
            size: n_ranks,
            failed: false,
        };
        let (mut r, mut s) = (0u32, 0u32);
        // SAFETY: a live handle and writable u32s.
        hccl("HcclGetRankId", unsafe {
            sys::HcclGetRankId(c.raw, &mut r)
        })?;
        hccl("HcclGetRankSize", unsafe {
            sys::HcclGetRankSize(c.raw, &mut s)
        })?;
        if (r, s) != (rank, n_ranks) {
            return Err(AscendError::Setup(format!(
                "HCCL says rank {r} of {s}, expected {rank} of {n_ranks}"
            )));
        }
        Ok(c)
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }
    pub fn size(&self) -> u32 {
        self.size
    }
    pub fn raw(&self) -> sys::HcclComm {
        self.raw
    }

    /// The first asynchronous error of work this communicator queued
    /// (`HcclGetCommAsyncError`), `Ok` if none.
    pub fn async_error(&self) -> Result<(), AscendError> {
        let mut e = sys::HcclResult::HCCL_SUCCESS;
        // SAFETY: a live handle and a writable result.
        hccl("HcclGetCommAsyncError", unsafe {
            sys::HcclGetCommAsyncError(self.raw, &mut e)
        })?;
        hccl("HCCL work queued on a stream", e)
    }

    /// The rank of this communicator whose process the emulator found gone (ended or
    /// killed) when work queued here failed with `HCCL_E_REMOTE`; `None` on CANN,
    /// which reports only the code.
    pub fn departed_rank(&self) -> Option<u32> {
        sys::departed_rank(self.raw)
    }

    /// The rank of this communicator that the first of its operations to time out
    /// (`HCCL_E_TIMEOUT`) waited for; `None` on CANN, which reports only the code.
    pub fn stalled_peer(&self) -> Option<u32> {
        sys::stalled_peer(self.raw)
    }

    /// Queues sending `count` elements of `buf` to `peer` on `stream`.
    pub fn send(
        &self,
        buf: &DeviceBuffer,
        count: usize,
        t: DataType,
        peer: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        check_count(buf, count, t)?;
        // SAFETY: live handles; the buffer holds `count` elements and outlives the
        // queued work (the caller synchronizes before dropping it).
        hccl("HcclSend", unsafe {
            sys::HcclSend(buf.ptr, count as u64, t.raw(), peer, self.raw, stream.raw)
        })
    }

    /// Queues receiving `count` elements from `peer` into `buf` on `stream`.
    pub fn recv(
        &self,
        buf: &DeviceBuffer,
        count: usize,
        t: DataType,
        peer: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        check_count(buf, count, t)?;
        // SAFETY: as for `send`.
        hccl("HcclRecv", unsafe {
            sys::HcclRecv(buf.ptr, count as u64, t.raw(), peer, self.raw, stream.raw)
        })
    }

    /// Queues one `HcclBatchSendRecv` of `items` `(direction, buffer, count, peer)`.
    pub fn batch_send_recv(
        &self,
        items: &[(Direction, &DeviceBuffer, usize, u32)],
        t: DataType,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        let mut raw: Vec<sys::HcclSendRecvItem> = Vec::with_capacity(items.len());
        for &(dir, buf, count, peer) in items {
            check_count(buf, count, t)?;
            raw.push(sys::HcclSendRecvItem {
                sendRecvType: match dir {
                    Direction::Send => sys::HcclSendRecvType::HCCL_SEND,
                    Direction::Recv => sys::HcclSendRecvType::HCCL_RECV,
                },
                buf: buf.ptr,
                count: count as u64,
                dataType: t.raw(),
                remoteRank: peer,
            });
        }
        // SAFETY: `raw` holds `items.len()` items whose buffers outlive the queued work.
        hccl("HcclBatchSendRecv", unsafe {
            sys::HcclBatchSendRecv(raw.as_mut_ptr(), raw.len() as u32, self.raw, stream.raw)
        })
    }

    /// Queues one `HcclBatchSendRecv` of `items` `(direction, device address, count,
    /// peer)`: the device-resident form of [`batch_send_recv`](Self::batch_send_recv),
    /// for buffers that live in an arena rather than in [`DeviceBuffer`]s of their own.
    ///
    /// The addresses are device addresses: the host never dereferences them, HCCL
    /// checks them (the emulator rejects any outside a live allocation). The caller
    /// keeps the memory allocated until the queued work has run.
    pub fn batch_send_recv_at(
        &self,
        items: &[(Direction, usize, usize, u32)],
        t: DataType,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        let mut raw: Vec<sys::HcclSendRecvItem> = items
            .iter()
            .map(|&(dir, addr, count, peer)| sys::HcclSendRecvItem {
                sendRecvType: match dir {
                    Direction::Send => sys::HcclSendRecvType::HCCL_SEND,
                    Direction::Recv => sys::HcclSendRecvType::HCCL_RECV,
                },
                buf: addr as *mut c_void,
                count: count as u64,
                dataType: t.raw(),
                remoteRank: peer,
            })
            .collect();
        // SAFETY: `raw` holds `items.len()` initialised items; their buffers are device
        // addresses, which the host does not dereference (HCCL validates them).
        hccl("HcclBatchSendRecv", unsafe {
            sys::HcclBatchSendRecv(raw.as_mut_ptr(), raw.len() as u32, self.raw, stream.raw)
        })
    }

    /// Queues broadcasting `count` f32s at device address `addr` from `root`, in place.
    pub fn broadcast_at(
        &self,
        addr: usize,
        count: usize,
        root: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        // SAFETY: a device address (not dereferenced by the host) and live handles.
        hccl("HcclBroadcast", unsafe {
            sys::HcclBroadcast(
                addr as *mut c_void,
                count as u64,
                DataType::F32.raw(),
                root,
                self.raw,
                stream.raw,
            )
        })
    }

    /// Queues summing every rank's `count` f32s at `send` into `root`'s `recv`
    /// (device addresses).
    pub fn reduce_sum_at(
        &self,
        send: usize,
        recv: usize,
        count: usize,
        root: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        // SAFETY: device addresses (not dereferenced by the host) and live handles.
        hccl("HcclReduce", unsafe {
            sys::HcclReduce(
                send as *mut c_void,
                recv as *mut c_void,
                count as u64,
                DataType::F32.raw(),
                sys::HcclReduceOp::HCCL_REDUCE_SUM,
                root,
                self.raw,
                stream.raw,
            )
        })
    }

    /// Queues broadcasting `count` f32s of `buf` from `root`.
    pub fn broadcast(
        &self,
        buf: &DeviceBuffer,
        count: usize,
        root: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        check_count(buf, count, DataType::F32)?;
        // SAFETY: as for `send`.
        hccl("HcclBroadcast", unsafe {
            sys::HcclBroadcast(
                buf.ptr,
                count as u64,
                DataType::F32.raw(),
                root,
                self.raw,
                stream.raw,
            )
        })
    }

    /// Queues summing every rank's `send` into `root`'s `recv` (f32).
    pub fn reduce_sum(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        root: u32,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        check_count(send, count, DataType::F32)?;
        check_count(recv, count, DataType::F32)?;
        // SAFETY: as for `send`.
        hccl("HcclReduce", unsafe {
            sys::HcclReduce(
                send.ptr,
                recv.ptr,
                count as u64,
                DataType::F32.raw(),
                sys::HcclReduceOp::HCCL_REDUCE_SUM,
                root,
                self.raw,
                stream.raw,
            )
        })
    }

    /// Queues summing every rank's `send` into every rank's `recv` (f32).
    pub fn all_reduce_sum(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        stream: &Stream,
    ) -> Result<(), AscendError> {
        check_count(send, count, DataType::F32)?;
        check_count(recv, count, DataType::F32)?;
        // SAFETY: as for `send`.
        hccl("HcclAllReduce", unsafe {
            sys::HcclAllReduce(
                send.ptr,
                recv.ptr,
                count as u64,
                DataType::F32.raw(),
                sys::HcclReduceOp::HCCL_REDUCE_SUM,
                self.raw,
                stream.raw,
            )
        })
    }

    /// Queues a barrier over the communicator.
    pub fn barrier(&self, stream: &Stream) -> Result<(), AscendError> {
        // SAFETY: live handles.
        hccl("HcclBarrier", unsafe {
            sys::HcclBarrier(self.raw, stream.raw)
        })
    }
}

fn check_count(buf: &DeviceBuffer, count: usize, t: DataType) -> Result<(), AscendError> {
    if count * t.size() > buf.bytes {
        return Err(AscendError::Invalid(format!(
            "{count} elements of {t:?} do not fit a device buffer of {} bytes",
            buf.bytes
        )));
    }
    Ok(())
}

impl HcclComm {
    /// When dropped, leave as a rank that failed: on the emulator its rank becomes
    /// gone for the others, whose operations with it fail at once
    /// (`HCCL_E_REMOTE`, [`HcclComm::departed_rank`] naming it) instead of waiting
    /// for HCCL's timeout; with CANN, destroyed as usual.
    pub fn leave_as_failed(&mut self) {
        self.failed = true;
    }
}

impl Drop for HcclComm {
    fn drop(&mut self) {
        if self.failed && sys::abandon(self.raw) {
            return;
        }
        // SAFETY: a live handle, destroyed once.
        let _ = unsafe { sys::HcclCommDestroy(self.raw) };
    }
}

/// The bytes of an `f32` slice (native byte order, as devices and HCCL see them).
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte is a valid u8; the length is exact.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

/// The bytes of an `f32` slice, writable (any bit pattern is a valid f32).
pub fn f32_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}
