//! Profiler-style counts of what a program asked of a device, the figures a device
//! profiler (msprof on CANN) would show: HCCL calls and items, host<->device copies,
//! host waits, allocations, kernels, hazards, issuing threads.
//!
//! The emulator keeps them per device (`emulator::counters`); a build linked against
//! CANN has none here, so [`snapshot`] returns `None` there and a caller says to use
//! the profiler instead. The type exists in both builds, so code that reports
//! counters compiles against either.

/// What the program asked of one device (or, summed, of several).
///
/// Field by field, the calls that count (each only when accepted):
/// - `batch_send_recv`, `batch_items`: `HcclBatchSendRecv` calls and their items
///   (sends plus receives);
/// - `send`, `recv`: `HcclSend`, `HcclRecv`;
/// - `collectives`: `HcclBroadcast`, `HcclReduce`, `HcclAllReduce`, `HcclBarrier`;
/// - `copies`, `copy_bytes`: `aclrtMemcpy` and `aclrtMemcpyAsync` of kind
///   host-to-device or device-to-host, and their bytes; `sync_copies`: the
///   `aclrtMemcpy` ones among them;
/// - `device_copies`: device-to-device copies (either function; not in `copies`);
/// - `host_waits`: `aclrtSynchronizeStream` and `aclrtSynchronizeEvent` (the subset
///   has no `aclrtSynchronizeDevice`);
/// - `mallocs`, `frees`: `aclrtMalloc`, `aclrtFree` (not the host-memory pair);
/// - `kernels`: kernel launches: aclnn operators queued on a stream (the second
///   phase, `aclnnXxx(workspace, size, executor, stream)`, when accepted);
/// - `hazards`: unordered accesses the happens-before checker found
///   (the emulator's `hazards` module), charged to the device of the thread whose call found them;
/// - `threads`: distinct OS threads that made at least one counted call since the
///   last [`reset`].
///
/// Host-to-host copies, `aclrtMemset`, `aclrtMallocHost`/`aclrtFreeHost` and the
/// set-up calls (devices, streams, events, communicators) are not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub batch_send_recv: u64,
    pub batch_items: u64,
    pub send: u64,
    pub recv: u64,
    pub collectives: u64,
    pub copies: u64,
    pub copy_bytes: u64,
    pub sync_copies: u64,
    pub device_copies: u64,
    pub host_waits: u64,
    pub mallocs: u64,
    pub frees: u64,
    pub kernels: u64,
    pub hazards: u64,
    pub threads: u64,
}

impl std::ops::AddAssign for Counters {
    /// Field by field (`threads` too: a thread that used two devices counts twice).
    fn add_assign(&mut self, o: Counters) {
        self.batch_send_recv += o.batch_send_recv;
        self.batch_items += o.batch_items;
        self.send += o.send;
        self.recv += o.recv;
        self.collectives += o.collectives;
        self.copies += o.copies;
        self.copy_bytes += o.copy_bytes;
        self.sync_copies += o.sync_copies;
        self.device_copies += o.device_copies;
        self.host_waits += o.host_waits;
        self.mallocs += o.mallocs;
        self.frees += o.frees;
        self.kernels += o.kernels;
        self.hazards += o.hazards;
        self.threads += o.threads;
    }
}

/// `batches=N items=N send=N recv=N copies=N copy_bytes=N host_waits=N mallocs=N
/// frees=N kernels=N hazards=N threads=N`: the figures a pipeline runtime is judged
/// by, in one line (`batches` are `HcclBatchSendRecv` calls, `items` their items).
impl std::fmt::Display for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "batches={} items={} send={} recv={} copies={} copy_bytes={} host_waits={} \
             mallocs={} frees={} kernels={} hazards={} threads={}",
            self.batch_send_recv,
            self.batch_items,
            self.send,
            self.recv,
            self.copies,
            self.copy_bytes,
            self.host_waits,
            self.mallocs,
            self.frees,
            self.kernels,
            self.hazards,
            self.threads
        )
    }
}

/// The counters of `device` now; `None` when this build links CANN (no counters).
pub fn snapshot(device: i32) -> Option<Counters> {
    #[cfg(ascend_emulator)]
    {
        Some(crate::emulator::counters::snapshot(device))
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = device;
        None
    }
}

/// Zeroes `device`'s counters (and forgets its issuing threads); nothing on CANN.
pub fn reset(device: i32) {
    #[cfg(ascend_emulator)]
    crate::emulator::counters::reset(device);
    #[cfg(not(ascend_emulator))]
    let _ = device;
}

/// The emulator's reports of unordered device-buffer accesses charged to `device`
/// since its last [`reset`], each naming both accesses, their streams or threads and
/// the buffer; empty on CANN (which does not check).
pub fn hazard_reports(device: i32) -> Vec<String> {
    #[cfg(ascend_emulator)]
    {
        crate::emulator::hazards::hazards(device)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = device;
        Vec::new()
    }
}

/// One span of virtual device time on a stream: a charged kernel duration or an HCCL
/// operation (from its start on this stream to its completion).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub start: f64,
    pub end: f64,
    pub label: String,
}

/// One stream's virtual-clock record since [`clock_start`].
#[derive(Clone, Debug, PartialEq)]
pub struct StreamTrace {
    /// The device the stream was created on.
    pub device: i32,
    /// The stream's handle (an identity only).
    pub stream: usize,
    /// Its spans in stream order.
    pub spans: Vec<Span>,
    /// Its virtual time after its last work (event waits included).
    pub end: f64,
}

/// The emulator's device-time trace: per stream its spans and end time (see
/// `emulator::clock` for what is modelled).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub streams: Vec<StreamTrace>,
}

impl Trace {
    /// The step's device time: the latest end over every stream.
    pub fn device_time(&self) -> f64 {
        self.streams.iter().map(|s| s.end).fold(0.0, f64::max)
    }

    /// The latest end over `device`'s streams (0 if it has none).
    pub fn device_end(&self, device: i32) -> f64 {
        self.streams
            .iter()
            .filter(|s| s.device == device)
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }

    /// The first pair of spans of one stream that overlap (a later span starting
    /// before the earlier one ended), as `(stream index, earlier, later)`.
    pub fn overlap(&self) -> Option<(usize, &Span, &Span)> {
        self.streams.iter().enumerate().find_map(|(i, s)| {
            s.spans
                .windows(2)
                .find(|w| w[1].start < w[0].end || w[0].end < w[0].start)
                .map(|w| (i, &w[0], &w[1]))
        })
    }
}

/// Starts the emulator's virtual device clock (every stream at time 0, traces empty);
/// call it with the devices idle. Nothing on CANN (use the profiler).
pub fn clock_start() {
    #[cfg(ascend_emulator)]
    crate::emulator::clock::start();
}

/// Stops the virtual clock; nothing on CANN.
pub fn clock_stop() {
    #[cfg(ascend_emulator)]
    crate::emulator::clock::stop();
}

/// Whether the virtual clock runs (never on CANN): callers skip building labels when not.
pub fn clock_enabled() -> bool {
    #[cfg(ascend_emulator)]
    {
        crate::emulator::clock::enabled()
    }
    #[cfg(not(ascend_emulator))]
    {
        false
    }
}

/// The virtual clock's trace since [`clock_start`] (read it with the devices idle);
/// `None` on CANN.
pub fn clock_trace() -> Option<Trace> {
    #[cfg(ascend_emulator)]
    {
        Some(crate::emulator::clock::trace())
    }
    #[cfg(not(ascend_emulator))]
    {
        None
    }
}

/// Queues on `stream` a span of `duration` of virtual device time labelled `label()`
/// (a kernel's duration taken from a profile); a no-op on CANN and while the clock is
/// off. Errors as the emulator's `clock::charge`: an unknown stream or a bad duration.
pub fn charge(
    stream: crate::aclrtStream,
    duration: f64,
    label: impl FnOnce() -> String,
) -> crate::aclError {
    #[cfg(ascend_emulator)]
    {
        crate::emulator::clock::charge(stream, duration, label)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = (stream, duration, label);
        0
    }
}

/// States the transfer costs of the next HCCL operation queued on `stream` (per item of
/// a `HcclBatchSendRecv`, one value for the others) and its span's label; a no-op on
/// CANN and while the clock is off.
pub fn charge_transfers(
    stream: crate::aclrtStream,
    costs: &[f64],
    label: impl FnOnce() -> String,
) -> crate::aclError {
    #[cfg(ascend_emulator)]
    {
        crate::emulator::clock::charge_transfers(stream, costs, label)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = (stream, costs, label);
        0
    }
}
