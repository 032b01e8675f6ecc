//! The Ascend backend: [`AscendComm`], a [`Comm`] over HCCL and AscendCL (through
//! `ascend-sys`: the real CANN libraries when a toolkit is installed, otherwise its
//! host emulator, whose HCCL ranks are threads or processes, one device each).
//!
//! [`safe`] is the safe layer: status codes become an [`AscendError`] naming the call
//! and the ACL/HCCL error (`HcclSend failed: HCCL_E_PARA (1: parameter error)`), and
//! devices, streams, events, device buffers and communicators are RAII owners.
//!
//! ## One rank
//! Each rank is bound to one device, holds the world's HCCL communicator, and issues
//! every call from the one thread that runs it (HCCL forbids concurrent calls on a
//! communicator). Its streams:
//! - the **compute stream**, where host-to-device copies of outgoing tensors are
//!   queued (the model computes on the host; this is where device kernels would go),
//!   with an **event** recorded after them that the point-to-point stream waits on, so
//!   no transfer reads a buffer before its copy has landed;
//! - the **point-to-point stream**, where each batch is one `HcclBatchSendRecv`;
//! - the **collective stream** for `HcclBroadcast`, `HcclReduce`, `HcclAllReduce` and
//!   `HcclBarrier` on the world communicator, and one stream per sub-communicator (see
//!   below).
//!
//! Device buffers come from a per-rank **pool** keyed by size: message sizes are
//! static, so after the first step every buffer a step needs is already there and
//! nothing is allocated or freed (`aclrtMalloc`/`aclrtFree`) while training.
//!
//! ## Point-to-point: one `HcclBatchSendRecv` per batch
//! [`Comm::batch`] receives with the element count of each receive stated (message
//! sizes are static: [`crate::model::Model::output_len`]), so every batch of the
//! program is exactly one `HcclBatchSendRecv` of its remote items, nothing else on
//! the wire: no headers, no helper threads. HCCL matches items by order per pair of
//! ranks and direction and allows one send to and one receive from each peer per call,
//! which is the program format's batch rule (rule 3), so a valid program's batches map
//! one to one. Rendezvous is kept: a batch completes when every item has met its
//! partner, and the rank posts nothing more until then, exactly as the lowering's
//! deadlock-freedom argument assumes. The host waits once per batch (the point-to-point
//! stream, which also orders the outgoing copies before it), then reads the received
//! tensors back. A transfer to this rank itself never reaches HCCL (which rejects it):
//! the executor aliases it, and a direct caller's is matched on the host by tag.
//! A receive whose sender sent another count fails with HCCL's parameter error.
//!
//! //! ## Collectives over groups
//! A collective over the whole world uses the world communicator. Over a smaller
//! group, the backend makes a sub-communicator the first time the group is used: the
//! group's first rank calls `HcclGetRootInfo` and sends the bytes to the other members
//! over the world communicator (as a point-to-point message), and every member calls
//! `HcclCommInitRootInfo` with its index in the group. Sub-communicators are kept
//! (one per group) with a stream each. Sums are f32 `HCCL_REDUCE_SUM`; the emulator
//! sums in group order, so results are deterministic and all-reduce results are
//! bit-identical on every member (real HCCL's order depends on its algorithm).
//!
//! ## Failures
//! HCCL has no abort. [`Comm::abort`] records the failure on this rank, and every
//! later call fails with [`AscendError::PeerFailed`]. Ranks created together by
//! [`AscendComm::world_in_process`] (or [`run_ranks`]) share that record, so their
//! *later* calls fail at once too; a call already waiting inside HCCL ends only at
//! HCCL's own timeout (the emulator's `MPIPE_ASCEND_EMU_TIMEOUT_MS`, default 20 s;
//! on CANN, `HCCL_EXEC_TIMEOUT`). Ranks in other processes learn nothing (they time
//! out), unless the failed rank's process ends: on the emulator its connection
//! closes, every call with it fails at once (`HCCL_E_REMOTE`), and the error is
//! [`AscendError::PeerFailed`] naming that rank; if the process that ended is the one
//! serving the communicator (the emulator's hub, in the process of its rank 0), the
//! others lose their connection to it (`HCCL_E_TCP_TRANSFER`) and the error names that
//! rank. The same when that process is stopped (`SIGSTOP`) or hangs: the hub beats on
//! a heartbeat lane to each remote rank, and a rank that hears no beat within the
//! emulator's `MPIPE_ASCEND_EMU_LIVENESS_MS` (default 4 s) fails its pending and
//! later calls with `HCCL_E_TCP_TRANSFER`, whatever HCCL's timeout. A rank that failed (it aborted, a call of its failed on HCCL, or its thread
//! panics) leaves its communicators as a failed rank when dropped: on the emulator its
//! peers' pending and later operations with it fail at once naming it, whether it is a
//! thread or a process (CANN has no such call: destroyed as usual). After an HCCL
//! error the buffers of the failed call are leaked rather than freed under a transfer
//! that may still be queued.
//!
//! Under `mpipe-run` ([`AscendComm::from_env`] with the launcher's
//! [`tcp::BLAME_DIR_VAR`]), a rank notes the rank it blames before its call returns
//! the error, as the host backend does: the rank named by
//! [`AscendError::PeerFailed`], or, after HCCL's timeout, the peer the timed-out
//! operation waited for (the emulator says which), so the launcher names the rank that
//! failed or stopped first, not the first to notice.
//!
//! ## Start-up
//! [`AscendComm::world_in_process`] makes `n` ranks as threads of this process (rank
//! `r` on device `r`). [`AscendComm::from_env`] joins a multi-process world from the
//! launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
//! `LOCAL_RANK`): rank 0 creates the root info and serves its bytes over TCP on
//! `MASTER_ADDR:MASTER_PORT`, the others fetch them. Both work on the emulator (its
//! root info carries the address of the process that serves the group).

pub mod device;
// The two modules whose top doc says they hold the backend's `unsafe` FFI calls.
#[allow(unsafe_code)]
pub mod kernels;
#[allow(unsafe_code)]
pub mod safe;
pub mod tensor;

use crate::comm::{Comm, Tag, Tensor};
use crate::host::tcp;
pub use safe::AscendError;
use safe::{
    f32_bytes, f32_bytes_mut, DataType, Device, DeviceBuffer, Direction, Event, HcclComm, RootInfo,
    Stream, ROOT_INFO_BYTES,
};
use std::collections::BTreeMap;
use std::fmt::Display;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Per-device counts of HCCL calls, copies, host waits, allocations, kernels, hazards
/// and issuing threads, as a profiler shows them: the emulator's
/// (`snapshot` is `None` when this build links CANN, whose profiler is msprof).
pub use ascend_sys::profile as counters;

/// What this build links: `"cann"` (the real libraries) or `"emulator"`.
pub const LINKED: &str = ascend_sys::BACKEND;

/// The first failure of a world: `(rank, what)`.
type Failure = Arc<Mutex<Option<(usize, String)>>>;

/// Where a rank started by `mpipe-run` notes the rank it blames for its failure (the
/// launcher's [`tcp::BLAME_DIR_VAR`] directory, [`tcp::blame_file_name`]); emptied
/// once the note is written, so the first rank blamed is the one noted.
type Blame = Arc<Mutex<Option<std::path::PathBuf>>>;

/// The tag of the root-info messages that form sub-communicators (a kind the runtime
/// does not use).
const ROOT_INFO_TAG: Tag = Tag::new(0xFE, 0, 0);

/// A collective sub-communicator and its stream.
struct Sub {
    stream: Stream,
    comm: HcclComm,
}

/// Where a collective's result is, on one rank.
enum ReadBack {
    Nothing,
    Send,
    Recv,
}

/// One rank of an HCCL world. See the [module docs](self).
pub struct AscendComm {
    rank: usize,
    world: usize,
    // Fields drop in order: streams and sub-communicators, then the communicator,
    // then the device binding.
    subs: BTreeMap<Vec<usize>, Sub>,
    /// Free device buffers by size in bytes, reused across batches and steps.
    pool: BTreeMap<usize, Vec<DeviceBuffer>>,
    p2p: Stream,
    coll: Stream,
    compute: Stream,
    copied: Event,
    comm: HcclComm,
    /// Event waits this rank has issued, and the one a mutation test leaves out.
    waits_issued: u64,
    skip_wait: Option<u64>,
    failure: Failure,
    blame: Blame,
    /// This rank failed (it aborted, or a call of its failed on HCCL): dropped, it
    /// leaves its communicators as a failed rank (see [`Drop`]).
    failed: bool,
    bound: ThreadId,
    device: Device,
}

impl std::fmt::Debug for AscendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AscendComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device.id())
            .finish()
    }
}

impl AscendComm {
    /// Binds this thread to `device` and joins the world described by `info` as
    /// `rank` of `world` (on real HCCL this blocks until every rank has joined).
    pub fn join(
        rank: usize,
        world: usize,
        device: i32,
        info: &RootInfo,
    ) -> Result<AscendComm, AscendError> {
        Self::join_with(rank, world, device, info, Failure::default())
    }

    fn join_with(
        rank: usize,
        world: usize,
        device: i32,
        info: &RootInfo,
        failure: Failure,
    ) -> Result<AscendComm, AscendError> {
        if rank >= world {
            return Err(AscendError::Setup(format!(
                "rank {rank} is not in a world of {world}"
            )));
        }
        let device = Device::set(device)?;
        let comm = HcclComm::init(world as u32, info, rank as u32)?;
        Ok(AscendComm {
            rank,
            world,
            subs: BTreeMap::new(),
            pool: BTreeMap::new(),
            p2p: Stream::new()?,
            coll: Stream::new()?,
            compute: Stream::new()?,
            copied: Event::new()?,
            comm,
            waits_issued: 0,
            skip_wait: None,
            failure,
            blame: Blame::default(),
            failed: false,
            bound: std::thread::current().id(),
            device,
        })
    }

    /// `n` ranks as threads of this process, rank `r` on device `r`: rank 0's thread
    /// calls `HcclGetRootInfo`, and every rank's thread `aclrtSetDevice(r)` and
    /// `HcclCommInitRootInfo` with it. The ranks share their failure record (see
    /// "Failures"). Move each into its own thread; a communicator re-binds the
    /// device on whichever thread uses it.
    pub fn world_in_process(n: usize) -> Result<Vec<AscendComm>, AscendError> {
        if n == 0 {
            return Err(AscendError::Setup("a world needs at least one rank".into()));
        }
        let devices = safe::device_count()? as usize;
        if n > devices {
            return Err(AscendError::Setup(format!(
                "{n} ranks need {n} devices, this machine has {devices} \
                 (the emulator's count is MPIPE_ASCEND_EMU_DEVICES)"
            )));
        }
        let info = std::thread::scope(|s| {
            s.spawn(|| {
                let _device = Device::set(0)?;
                RootInfo::new()
            })
            .join()
            .unwrap_or_else(|_| Err(AscendError::Setup("rank 0 panicked".into())))
        })?;
        let failure = Failure::default();
        let results: Vec<Result<AscendComm, AscendError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let (info, failure) = (&info, failure.clone());
                    s.spawn(move || AscendComm::join_with(r, n, r as i32, info, failure))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(AscendError::Setup("a rank panicked".into())))
                })
                .collect()
        });
        results.into_iter().collect()
    }

    /// One rank of a multi-process world from the launcher's variables: `RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR` (default `127.0.0.1`), `MASTER_PORT`, and the device
    /// `LOCAL_RANK` (default `RANK`). Rank 0 creates the root info and serves it on
    /// `MASTER_ADDR:MASTER_PORT` until every other rank has fetched it; the others
    /// retry connecting for up to `timeout`.
    ///
    ///
    /// On the emulator this is one process per emulated device, as on a cluster.
    pub fn from_env(timeout: Duration) -> Result<AscendComm, AscendError> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| AscendError::Setup(format!("{name} is not set")))
        };
        let num = |name: &str, v: String| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| AscendError::Setup(format!("{name}={v:?} is not a number")))
        };
        let rank = num("RANK", var("RANK")?)?;
        let world = num("WORLD_SIZE", var("WORLD_SIZE")?)?;
        let port = var("MASTER_PORT")?;
        let host = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let device = match std::env::var("LOCAL_RANK") {
            Ok(v) => num("LOCAL_RANK", v)?,
            Err(_) => rank,
        };
        let addr = format!("{host}:{}", port.trim())
            .to_socket_addrs()
            .map_err(|e| AscendError::Setup(format!("MASTER_ADDR:MASTER_PORT: {e}")))?
            .next()
            .ok_or_else(|| AscendError::Setup("MASTER_ADDR resolves to nothing".into()))?;
        let secret = match std::env::var(tcp::SECRET_VAR) {
            Ok(text) => tcp::parse_secret(&text).map_err(|e| AscendError::Setup(e.to_string()))?,
            Err(_) => [0; tcp::SECRET_LEN],
        };
        let comm = Self::connect_with_secret(rank, world, device as i32, addr, timeout, &secret)?;
        // Under mpipe-run: note whom this rank blames if another rank fails first.
        if let Some(dir) = std::env::var_os(tcp::BLAME_DIR_VAR) {
            let path = std::path::PathBuf::from(dir).join(tcp::blame_file_name(rank));
            *comm.blame.lock().unwrap_or_else(PoisonError::into_inner) = Some(path);
        }
        Ok(comm)
    }

    /// [`from_env`](AscendComm::from_env) with explicit values: the root info crosses
    /// a TCP connection to `master` (rank 0 listens there), without a secret.
    pub fn connect(
        rank: usize,
        world: usize,
        device: i32,
        master: SocketAddr,
        timeout: Duration,
    ) -> Result<AscendComm, AscendError> {
        Self::connect_with_secret(rank, world, device, master, timeout, &[0; tcp::SECRET_LEN])
    }

    /// [`connect`](AscendComm::connect) proving `secret` (the launcher's
    /// `MPIPE_RDZV_SECRET`, as [`from_env`](AscendComm::from_env) reads it): rank 0
    /// hands the root info only to a connection that sends the same secret first
    /// (compared in constant time). A connection that sends another, or nothing
    /// within [`tcp::HELLO_TIMEOUT`], is dropped and logged, and set-up goes on, so a
    /// stranger on the machine can neither join the world nor break its set-up.
    pub fn connect_with_secret(
        rank: usize,
        world: usize,
        device: i32,
        master: SocketAddr,
        timeout: Duration,
        secret: &tcp::Secret,
    ) -> Result<AscendComm, AscendError> {
        if rank >= world {
            return Err(AscendError::Setup(format!(
                "RANK {rank} is not below WORLD_SIZE {world}"
            )));
        }
        let info = if rank == 0 {
            Device::set(device)?;
            let info = RootInfo::new()?;
            let listener = TcpListener::bind(master)
                .map_err(|e| AscendError::Setup(format!("listening on {master}: {e}")))?;
            serve_root_info(&listener, &info, world - 1, timeout, secret)?;
            info
        } else {
            fetch_root_info(master, timeout, secret)?
        };
        Self::join(rank, world, device, &info)
    }

    /// For mutation tests of the ordering: leave out the `k`-th stream wait on an
    /// event this rank would issue (counting from 0), so a checker (the emulator's
    /// happens-before check) can be shown to catch each one missing.
    #[doc(hidden)]
    pub fn mutate_skip_event_wait(&mut self, k: u64) {
        self.skip_wait = Some(k);
    }

    /// The stream waits on events this rank has issued so far.
    pub fn event_waits(&self) -> u64 {
        self.waits_issued
    }

    /// The device this rank uses.
    pub fn device(&self) -> i32 {
        self.device.id()
    }

    /// The rank's failure record, if any rank sharing it failed.
    fn check_failed(&self) -> Result<(), AscendError> {
        match &*self.failure.lock().unwrap_or_else(PoisonError::into_inner) {
            Some((rank, what)) => Err(AscendError::PeerFailed {
                rank: *rank,
                what: what.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Checks for a recorded failure and binds the calling thread to the device.
    fn enter(&mut self) -> Result<(), AscendError> {
        if let Err(e) = self.check_failed() {
            // A rank that learnt of a failure leaves as a failed rank too: its peers
            // may be waiting for it.
            self.failed = true;
            return Err(e);
        }
        let me = std::thread::current().id();
        if me != self.bound {
            self.device.bind_thread()?;
            self.bound = me;
        }
        Ok(())
    }

    /// An error of a synchronization: HCCL's asynchronous error if there is one; a
    /// peer whose process is gone (`HCCL_E_REMOTE`, named by the emulator) as
    /// [`AscendError::PeerFailed`] naming it (`group` maps the communicator's ranks to
    /// the world's; `None` for the world communicator); the process serving the
    /// communicator lost (`HCCL_E_TCP_TRANSFER`: the emulator's connection to it
    /// closed or stopped answering, so it ended, was killed or stopped) as
    /// [`AscendError::PeerFailed`] naming the rank of that process (the
    /// communicator's rank 0, whose process made its root info). A rank named is
    /// noted in `blame` (see [`Blame`]) before the error is returned.
    fn sync_error(
        comm: &HcclComm,
        group: Option<&[usize]>,
        blame: &Blame,
        e: AscendError,
        during: impl FnOnce() -> String,
    ) -> AscendError {
        let world_rank = |r: u32| {
            group
                .and_then(|g| g.get(r as usize).copied())
                .unwrap_or(r as usize)
        };
        let e = match comm.async_error() {
            Err(h) if h.hccl_code() == Some(ascend_sys::HcclResult::HCCL_E_REMOTE.0) => {
                match comm.departed_rank() {
                    Some(r) => AscendError::PeerFailed {
                        rank: world_rank(r),
                        what: format!(
                            "it died: its process ended or was killed, or it left after \
                             failing (HCCL_E_REMOTE while this rank was doing {})",
                            during()
                        ),
                    },
                    None => h.during(during),
                }
            }
            Err(h) if h.hccl_code() == Some(ascend_sys::HcclResult::HCCL_E_TCP_TRANSFER.0) => {
                AscendError::PeerFailed {
                    rank: world_rank(0),
                    what: format!(
                        "its process, which serves the communicator, ended, was killed or \
                         stopped answering (HCCL_E_TCP_TRANSFER while this rank was doing {})",
                        during()
                    ),
                }
            }
            Err(h) if h.hccl_code() == Some(ascend_sys::HcclResult::HCCL_E_TIMEOUT.0) => {
                let h = h.during(during);
                // A rank that stopped making progress (stopped, hung) is the one its
                // peers time out on: noted, the launcher follows the notes to it
                // rather than blaming the first rank to time out.
                if let Some(p) = comm.stalled_peer() {
                    note_blame(
                        blame,
                        world_rank(p),
                        &format!("timed out waiting for it: {h}"),
                    );
                }
                h
            }
            Err(h) => h.during(during),
            Ok(()) => e,
        };
        if let AscendError::PeerFailed { rank, what } = &e {
            note_blame(blame, *rank, what);
        }
        e
    }

    /// Notes that this rank failed if `r` is a failure of HCCL's or of a peer (not a
    /// wrong call, which the caller may recover from).
    fn track<T>(&mut self, r: Result<T, AscendError>) -> Result<T, AscendError> {
        if let Err(
            AscendError::Hccl { .. } | AscendError::Acl { .. } | AscendError::PeerFailed { .. },
        ) = &r
        {
            self.failed = true;
        }
        r
    }

    fn check_peer(&self, peer: usize, what: &str) -> Result<(), AscendError> {
        if peer >= self.world {
            return Err(AscendError::Invalid(format!(
                "{what} rank {peer}: the world has {} ranks",
                self.world
            )));
        }
        Ok(())
    }

    /// A device buffer of `bytes` bytes from the pool (allocated only when the pool
    /// has none of that size).
    fn take(&mut self, bytes: usize) -> Result<DeviceBuffer, AscendError> {
        match self.pool.get_mut(&bytes).and_then(Vec::pop) {
            Some(b) => Ok(b),
            None => DeviceBuffer::new(bytes),
        }
    }

    /// Returns buffers to the pool once no queued work uses them.
    fn give(&mut self, bufs: impl IntoIterator<Item = DeviceBuffer>) {
        for b in bufs {
            self.pool.entry(b.len()).or_default().push(b);
        }
    }

    /// The communicator and stream of a collective over `group`, and `root`'s index
    /// in it (validating the group).
    fn group_comm(
        &mut self,
        group: &[usize],
        root: usize,
    ) -> Result<(&HcclComm, &Stream, u32), AscendError> {
        let root_index = self.group_root(group, root)?;
        let (comm, stream) = self.group_refs(group);
        Ok((comm, stream, root_index))
    }

    /// The communicator and stream of `group`, made by [`group_root`](Self::group_root).
    fn group_refs(&self, group: &[usize]) -> (&HcclComm, &Stream) {
        match self.subs.get(group) {
            Some(sub) => (&sub.comm, &sub.stream),
            None => (&self.comm, &self.coll),
        }
    }

    /// Whether to issue the next stream wait on an event (false only for the one a
    /// mutation test leaves out); counts it.
    fn next_wait(&mut self) -> bool {
        let issue = self.skip_wait != Some(self.waits_issued);
        self.waits_issued += 1;
        issue
    }

    /// Validates `group`, makes its sub-communicator the first time, and returns
    /// `root`'s index in it.
    fn group_root(&mut self, group: &[usize], root: usize) -> Result<u32, AscendError> {
        if group.windows(2).any(|w| w[0] >= w[1]) {
            return Err(AscendError::Invalid(format!(
                "group {group:?} is not sorted and distinct"
            )));
        }
        if let Some(&p) = group.iter().find(|&&p| p >= self.world) {
            self.check_peer(p, "a group with")?;
        }
        let Some(me) = group.iter().position(|&p| p == self.rank) else {
            return Err(AscendError::Invalid(format!(
                "group {group:?} does not contain this rank ({})",
                self.rank
            )));
        };
        let Some(root_index) = group.iter().position(|&p| p == root) else {
            return Err(AscendError::Invalid(format!(
                "group {group:?} does not contain the root {root}"
            )));
        };
        if group.len() == self.world {
            return Ok(root_index as u32);
        }
        if !self.subs.contains_key(group) {
            let info = if me == 0 {
                let info = RootInfo::new()?;
                let words = bytes_to_words(&info.to_bytes());
                let sends: Vec<(usize, Tag, &[f32])> = group[1..]
                    .iter()
                    .map(|&p| (p, ROOT_INFO_TAG, words.as_slice()))
                    .collect();
                self.batch_inner(&sends, &[])?;
                info
            } else {
                let words = ROOT_INFO_BYTES.div_ceil(4);
                let got = self.batch_inner(&[], &[(group[0], ROOT_INFO_TAG, words)])?;
                RootInfo::from_bytes(&words_to_bytes(&got[0]))?
            };
            let comm = HcclComm::init(group.len() as u32, &info, me as u32)?;
            let stream = Stream::new()?;
            self.subs.insert(group.to_vec(), Sub { stream, comm });
        }
        Ok(root_index as u32)
    }

    /// Runs one collective over `group`: `buf` goes to the device, `queue` queues the
    /// HCCL call (given the communicator, the stream, the send and receive buffers and
    /// the root's index), and `read_back` says which buffer (if any) holds this rank's
    /// result.
    fn collective(
        &mut self,
        (name, tag): (&'static str, Tag),
        root: usize,
        group: &[usize],
        buf: &mut [f32],
        queue: impl FnOnce(
            &HcclComm,
            &Stream,
            &DeviceBuffer,
            &DeviceBuffer,
            u32,
        ) -> Result<(), AscendError>,
        read_back: impl FnOnce(usize) -> ReadBack,
    ) -> Result<(), AscendError> {
        self.enter()?;
        let rank = self.rank;
        let bytes = std::mem::size_of_val(buf);
        let send = self.take(bytes)?;
        let recv = self.take(bytes)?;
        let blame = self.blame.clone();
        let (comm, stream, root_index) = self.group_comm(group, root)?;
        send.write(f32_bytes(buf))?;
        let during = || format!("{name} {tag} over ranks {group:?} (root {root})");
        let result = queue(comm, stream, &send, &recv, root_index).and_then(|()| {
            stream
                .synchronize()
                .map_err(|e| Self::sync_error(comm, Some(group), &blame, e, during))
        });
        if let Err(e) = result {
            std::mem::forget(send);
            std::mem::forget(recv);
            return self.track(Err(e));
        }
        let read = match read_back(rank) {
            ReadBack::Nothing => Ok(()),
            ReadBack::Send => send.read(f32_bytes_mut(buf)),
            ReadBack::Recv => recv.read(f32_bytes_mut(buf)),
        };
        self.give([send, recv]);
        read
    }

    /// [`Comm::batch`] without the entry checks (also used to ship root infos).
    fn batch_inner(
        &mut self,
        sends: &[(usize, Tag, &[f32])],
        recvs: &[(usize, Tag, usize)],
    ) -> Result<Vec<Tensor>, AscendError> {
        for &(p, t, d) in sends {
            self.check_peer(p, "sending to")?;
            check_len(t, d.len())?;
        }
        for &(p, t, n) in recvs {
            self.check_peer(p, "receiving from")?;
            check_len(t, n)?;
        }
        let mut out: Vec<Option<Tensor>> = vec![None; recvs.len()];
        // Transfers to this rank itself: matched on the host, by tag in order.
        let mut own: Vec<(Tag, &[f32])> = sends
            .iter()
            .filter(|s| s.0 == self.rank)
            .map(|s| (s.1, s.2))
            .collect();
        for (i, &(p, t, n)) in recvs.iter().enumerate() {
            if p == self.rank {
                let Some(k) = own.iter().position(|o| o.0 == t) else {
                    return Err(AscendError::Invalid(format!(
                        "RECV {t} from this rank ({p}) without a matching SEND in the same batch"
                    )));
                };
                let data = own.remove(k).1;
                if data.len() != n {
                    return Err(AscendError::Invalid(format!(
                        "RECV {t} from this rank expects {n} values, the SEND has {}",
                        data.len()
                    )));
                }
                out[i] = Some(data.to_vec());
            }
        }
        if let Some((t, _)) = own.first() {
            return Err(AscendError::Invalid(format!(
                "SEND {t} to this rank ({}) without a matching RECV in the same batch",
                self.rank
            )));
        }
        let remote_sends: Vec<&(usize, Tag, &[f32])> =
            sends.iter().filter(|s| s.0 != self.rank).collect();
        let remote_recvs: Vec<(usize, &(usize, Tag, usize))> = recvs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.0 != self.rank)
            .collect();
        one_per_peer(remote_sends.iter().map(|s| (s.0, s.1)), "sends to")?;
        one_per_peer(
            remote_recvs.iter().map(|r| (r.1 .0, r.1 .1)),
            "receives from",
        )?;
        if remote_sends.is_empty() && remote_recvs.is_empty() {
            return Ok(out.into_iter().map(Option::unwrap_or_default).collect());
        }

        // Buffers from the pool; outgoing tensors copied on the compute stream, the
        // point-to-point stream ordered after the copies by an event.
        let mut send_bufs = Vec::with_capacity(remote_sends.len());
        let mut recv_bufs = Vec::with_capacity(remote_recvs.len());
        let posted = (|| -> Result<(), AscendError> {
            for &&(_, _, d) in &remote_sends {
                let buf = self.take(std::mem::size_of_val(d))?;
                // The stream keeps the staged bytes until the point-to-point stream,
                // which waits for the copies' event, is synchronized.
                self.compute.upload_async(&buf, f32_bytes(d).into())?;
                send_bufs.push(buf);
            }
            for &(_, &(_, _, n)) in &remote_recvs {
                recv_bufs.push(self.take(n * 4)?);
            }
            if !send_bufs.is_empty() {
                self.copied.record(&self.compute)?;
                if self.next_wait() {
                    self.p2p.wait_event(&self.copied)?;
                }
            }
            let mut items = Vec::with_capacity(send_bufs.len() + recv_bufs.len());
            for (&&(p, _, d), b) in remote_sends.iter().zip(&send_bufs) {
                items.push((Direction::Send, b, d.len(), p as u32));
            }
            for (&(_, &(p, _, n)), b) in remote_recvs.iter().zip(&recv_bufs) {
                items.push((Direction::Recv, b, n, p as u32));
            }
            self.comm
                .batch_send_recv(&items, DataType::F32, &self.p2p)?;
            self.p2p.synchronize().map_err(|e| {
                let what = describe_batch(&remote_sends, &remote_recvs);
                Self::sync_error(&self.comm, None, &self.blame, e, || {
                    format!("HcclBatchSendRecv of {what}")
                })
            })
        })();
        if let Err(e) = posted {
            // Queued work may still use them: leaked rather than freed under it.
            std::mem::forget(send_bufs);
            std::mem::forget(recv_bufs);
            return Err(e);
        }
        let mut read = Ok(());
        for ((i, &(_, _, n)), b) in remote_recvs.iter().zip(&recv_bufs) {
            let mut data = vec![0f32; n];
            read = read.and_then(|()| b.read(f32_bytes_mut(&mut data)));
            out[*i] = Some(data);
        }
        self.give(send_bufs);
        self.give(recv_bufs);
        read?;
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// Notes in `blame`'s file (if it still has one) that this rank blames `rank`, which
/// failed doing `what`: the launcher then never takes this rank's failure for the
/// first (see `host::launch`). Only the first note is written.
fn note_blame(blame: &Blame, rank: usize, what: &str) {
    let path = blame.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some(path) = path {
        let _ = std::fs::write(path, format!("{rank}\n{what}\n"));
    }
}

/// At most 2^32 - 1 elements per message (HCCL counts are 64-bit, but the program
/// format's tensors are far below; a larger count is a caller's bug).
fn check_len(t: Tag, len: usize) -> Result<(), AscendError> {
    if len > u32::MAX as usize {
        return Err(AscendError::Invalid(format!(
            "{t} has {len} elements; at most 2^32 - 1 per message"
        )));
    }
    Ok(())
}

/// HCCL's rule for one `HcclBatchSendRecv`: at most one send to, and one receive
/// from, each peer (the program format's rule 3 for a batch).
fn one_per_peer(items: impl Iterator<Item = (usize, Tag)>, what: &str) -> Result<(), AscendError> {
    let mut seen: BTreeMap<usize, Tag> = BTreeMap::new();
    for (p, t) in items {
        if let Some(first) = seen.insert(p, t) {
            return Err(AscendError::Invalid(format!(
                "a batch holds two {what} rank {p} ({first} and {t}); HCCL allows one send to \
                 and one receive from each peer per HcclBatchSendRecv (program-format rule 3): \
                 post them in separate batches"
            )));
        }
    }
    Ok(())
}

/// `SEND act(unit 1, mb 0) to 2, RECV grad(unit 1, mb 0) from 2`.
fn describe_batch(
    sends: &[&(usize, Tag, &[f32])],
    recvs: &[(usize, &(usize, Tag, usize))],
) -> String {
    let mut parts: Vec<String> = sends
        .iter()
        .map(|(p, t, _)| format!("SEND {t} to rank {p}"))
        .collect();
    parts.extend(
        recvs
            .iter()
            .map(|(_, (p, t, _))| format!("RECV {t} from rank {p}")),
    );
    parts.join(", ")
}

/// Bytes as f32 bit patterns (4 per word; the length is a multiple of 4 here).
fn bytes_to_words(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect()
}

fn words_to_bytes(w: &[f32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// Rank 0's side of the start-up: sends the root info to `clients` connections.
fn serve_root_info(
    listener: &TcpListener,
    info: &RootInfo,
    clients: usize,
    timeout: Duration,
    secret: &tcp::Secret,
) -> Result<(), AscendError> {
    /// The most connections proving (or failing to prove) the secret at once; more
    /// are closed at once (a flood of strangers costs bounded threads).
    const MAX_GREETING: usize = 256;
    let bytes: Arc<[u8]> = info.to_bytes().into();
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| AscendError::Setup(format!("root info store: {e}")))?;
    // Each connection is greeted on a thread of its own, so strangers that say
    // nothing (each dropped after HELLO_TIMEOUT) delay no rank.
    let (done, greeted) = std::sync::mpsc::channel::<Result<(), (SocketAddr, &'static str)>>();
    let greeting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut served = 0;
    while served < clients {
        while let Ok(outcome) = greeted.try_recv() {
            match outcome {
                Ok(()) => served += 1,
                Err((peer, why)) => crate::errln!(
                    "mpipe ascend: dropped a connection from {peer} to the root-info store \
                     that {why}"
                ),
            }
        }
        if served >= clients {
            break;
        }
        match listener.accept() {
            Ok((mut s, peer)) => {
                use std::sync::atomic::Ordering::SeqCst;
                if greeting.fetch_add(1, SeqCst) >= MAX_GREETING {
                    greeting.fetch_sub(1, SeqCst);
                    continue;
                }
                let (bytes, done, greeter, secret) = (
                    Arc::clone(&bytes),
                    done.clone(),
                    Arc::clone(&greeting),
                    *secret,
                );
                let spawned = std::thread::Builder::new()
                    .name("root-info-store".into())
                    .spawn(move || {
                        // The connection proves the secret before it gets anything.
                        let mut hello = [0u8; tcp::SECRET_LEN];
                        let proved = s
                            .set_nonblocking(false)
                            .and_then(|()| s.set_read_timeout(Some(tcp::HELLO_TIMEOUT)))
                            .and_then(|()| s.set_write_timeout(Some(tcp::HELLO_TIMEOUT)))
                            .and_then(|()| s.read_exact(&mut hello))
                            .is_ok_and(|()| tcp::same_secret(&hello, &secret));
                        let outcome = if !proved {
                            Err((peer, "did not prove the job's rendezvous secret"))
                        } else if s.write_all(&bytes).is_err() {
                            Err((peer, "proved the secret but did not take the root info"))
                        } else {
                            Ok(())
                        };
                        greeter.fetch_sub(1, SeqCst);
                        let _ = done.send(outcome);
                    });
                if spawned.is_err() {
                    greeting.fetch_sub(1, SeqCst);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(AscendError::Setup(format!(
                        "only {served} of {clients} ranks fetched the root info within {timeout:?}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(AscendError::Setup(format!("root info store: {e}"))),
        }
    }
    Ok(())
}

/// A non-zero rank's side: fetches the root info from rank 0 (retrying until
/// `timeout`, as rank 0 may not listen yet).
fn fetch_root_info(
    master: SocketAddr,
    timeout: Duration,
    secret: &tcp::Secret,
) -> Result<RootInfo, AscendError> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&master, Duration::from_millis(500)) {
            Ok(mut s) => {
                let mut bytes = vec![0u8; ROOT_INFO_BYTES];
                s.write_all(secret)
                    .and_then(|()| s.set_read_timeout(Some(timeout)))
                    .and_then(|()| s.read_exact(&mut bytes))
                    .map_err(|e| {
                        AscendError::Setup(format!("reading the root info from {master}: {e}"))
                    })?;
                return RootInfo::from_bytes(&bytes);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(AscendError::Setup(format!(
                    "no root info from rank 0 at {master} within {timeout:?}: {e}"
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

impl Comm for AscendComm {
    type Error = AscendError;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn batch(
        &mut self,
        sends: &[(usize, Tag, &[f32])],
        recvs: &[(usize, Tag, usize)],
    ) -> Result<Vec<Tensor>, AscendError> {
        self.enter()?;
        let r = self.batch_inner(sends, recvs);
        self.track(r)
    }

    fn broadcast(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), AscendError> {
        self.collective(
            ("BCAST", tag),
            root,
            group,
            buf,
            |c, s, send, _, r| c.broadcast(send, send.len() / 4, r, s),
            |me| {
                if me == root {
                    ReadBack::Nothing
                } else {
                    ReadBack::Send
                }
            },
        )
    }

    fn reduce(
        &mut self,
        root: usize,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), AscendError> {
        self.collective(
            ("REDUCE", tag),
            root,
            group,
            buf,
            |c, s, send, recv, r| c.reduce_sum(send, recv, send.len() / 4, r, s),
            |me| {
                if me == root {
                    ReadBack::Recv
                } else {
                    ReadBack::Nothing
                }
            },
        )
    }

    fn all_reduce(
        &mut self,
        group: &[usize],
        tag: Tag,
        buf: &mut [f32],
    ) -> Result<(), AscendError> {
        let root = group.first().copied().unwrap_or(self.rank);
        self.collective(
            ("ALL_REDUCE", tag),
            root,
            group,
            buf,
            |c, s, send, recv, _| c.all_reduce_sum(send, recv, send.len() / 4, s),
            |_| ReadBack::Recv,
        )
    }

    fn barrier(&mut self) -> Result<(), AscendError> {
        self.enter()?;
        let r = self.comm.barrier(&self.coll).and_then(|()| {
            self.coll.synchronize().map_err(|e| {
                Self::sync_error(&self.comm, None, &self.blame, e, || "BARRIER".into())
            })
        });
        self.track(r)
    }

    fn abort(&mut self, what: &str) {
        self.failed = true;
        let mut f = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        if f.is_none() {
            *f = Some((self.rank, what.to_string()));
        }
    }
}

/// A rank that failed (it aborted, a call of its failed on HCCL, or its thread is
/// panicking) leaves its communicators as a failed rank: on the emulator its peers'
/// operations with it, pending or later, fail at once naming it, as when a rank's
/// process dies, instead of waiting for HCCL's timeout (HCCL has no abort; with CANN
/// they are destroyed as usual).
impl Drop for AscendComm {
    fn drop(&mut self) {
        let heard = self
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        if self.failed || heard || std::thread::panicking() {
            for sub in self.subs.values_mut() {
                sub.comm.leave_as_failed();
            }
            self.comm.leave_as_failed();
        }
    }
}

/// Runs `f` on each rank of a new in-process world of `n` ranks (threads, rank `r` on
/// device `r`) and returns every rank's outcome in rank order. A rank whose `f`
/// fails or panics is aborted, so the other ranks' later calls fail naming it.
pub fn run_ranks<F, T, E>(n: usize, f: F) -> Vec<Result<T, String>>
where
    F: Fn(AscendComm) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    let comms = match AscendComm::world_in_process(n) {
        Ok(c) => c,
        Err(e) => return (0..n).map(|_| Err(e.to_string())).collect(),
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || {
                    let (rank, failure) = (c.rank, c.failure.clone());
                    let out = match catch_unwind(AssertUnwindSafe(|| f(c))) {
                        Ok(r) => r.map_err(|e| e.to_string()),
                        Err(p) => Err(format!(
                            "rank {rank} panicked: {}",
                            p.downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_default()
                        )),
                    };
                    if let Err(e) = &out {
                        let mut fl = failure.lock().unwrap_or_else(PoisonError::into_inner);
                        fl.get_or_insert((rank, e.clone()));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank thread panicked".into()))
            })
            .collect()
    })
}
