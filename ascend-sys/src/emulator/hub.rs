//! HCCL across processes: the process that made a root info serves its groups over TCP,
//! and ranks in other processes reach them through it.
//!
//! `HcclGetRootInfo` starts (once per process) a listener on `MPIPE_ASCEND_EMU_HOST`
//! (default `127.0.0.1`), port chosen by the system, and writes its address into the
//! root info after the group id. A rank in the same process joins the group directly
//! (threads, [`super::hccl`]); a rank in another process connects to that address and
//! the serving process runs each of its operations on the group on its behalf, on a
//! thread of its own, with the data carried in the messages. The rendezvous semantics
//! are therefore the same for both: a remote `HcclSend` returns only when the matching
//! receive has taken the data, an unbatched send-send cycle times out with the same
//! report, and collectives reduce in rank order.
//!
//! Who may connect: the listener is reachable by every process of the machine, so a
//! lane's hello carries the job's rendezvous secret, the 64 hex digits of
//! `MPIPE_RDZV_SECRET` that the launcher (`mpipe-run`) gives every rank, and the
//! serving process compares it (in constant time) with its own before it reads
//! anything else; a wrong one is reported on standard error and the connection
//! closed. Without the variable the secret is empty (zeros), and any local process
//! that knows a group id can join. A hello must arrive within [`HELLO_TIMEOUT`], and
//! at most [`MAX_GREETING`] connections may be saying hello at once. Every length in a
//! request is checked against [`max_message`] before anything is allocated, and
//! buffers are allocated fallibly: a request the process cannot hold fails its lane,
//! never the process.
//!
//! Wire format (little-endian; one request, one reply, on one connection at a time):
//! - hello: `MAGIC`, the secret (32 bytes), group id `u64`, kind `u8` (0 join, 1
//!   attach another lane, 2 heartbeat lane), ranks `u32`, rank `u32` -> status `u32`;
//! - on a heartbeat lane, after the status, the serving process writes one byte
//!   ([`BEAT`]) every [`HEARTBEAT_INTERVAL`] until the lane closes; nothing else;
//! - send: `1`, peer `u32`, length `u64`, data -> status;
//! - receive: `2`, peer `u32`, length `u64` -> status, data;
//! - batch: `3`, sends `u32` x (peer `u32`, length `u64`, data), receives `u32` x
//!   (peer `u32`, length `u64`) -> status, each receive's data;
//! - collective: `4`, [`CollOp`], input length `u64`, input -> status, output length
//!   `u64`, output;
//! - goodbye: `5` (no reply; the lane closes): the rank destroyed its communicator;
//! - gone: `6` -> status, count `u32`, the ranks found gone (`u32` each);
//! - stalled: `7` -> status, known `u32` (0 or 1), peer `u32`: the peer the rank's
//!   first timed-out operation waited for.
//!
//! **Liveness.** A lane that closes without its goodbye means the rank's process ended
//! or was killed: the serving process marks the rank gone in the group, and every
//! operation with it, pending or later, fails at once with `HCCL_E_REMOTE` (see
//! [`super::hccl`]); a rank that learns that asks which rank is gone (`6`).
//!
//! The other way round, a serving process that stops (`SIGSTOP`) or hangs closes
//! nothing: its listener even accepts connections. So each remote rank keeps a
//! heartbeat lane, read by a thread of its own: the serving process beats on it
//! every [`HEARTBEAT_INTERVAL`], and when no beat arrives within [`liveness`]
//! (`MPIPE_ASCEND_EMU_LIVENESS_MS`, default 4000) the serving process is declared
//! lost: the rank's pending operations are cut off and they and every later one
//! fail at once with `HCCL_E_TCP_TRANSFER`, as when its connection closes. This is
//! the emulator's counterpart of HCCL's own heartbeat between ranks; it does not
//! shorten HCCL's operation timeout (`MPIPE_ASCEND_EMU_TIMEOUT_MS`), which a live
//! but slow peer is still given in full. Without it a stopped serving process was
//! noticed only when a reply's read timed out (HCCL's timeout plus 10 s).
//!
//! A rank keeps a pool of connections (lanes), so operations on several streams of one
//! communicator proceed independently, as on a device. The serving process keeps its
//! groups until every remote lane has closed (`HcclCommDestroy` of a rank in the serving
//! process waits for that, up to the timeout, and so does its `abandon` after a
//! failure), so it does not exit under a reply, nor before the others have learnt
//! which rank failed first.

use super::hccl::{element_size, join_group, timeout, CollOp, Group, MAGIC};
use crate::bindings::*;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable holding the job's rendezvous secret (64 hex digits; set
/// by `mpipe-run` for every rank, as `mpipe_runtime::host::tcp::SECRET_VAR`).
pub(super) const SECRET_VAR: &str = "MPIPE_RDZV_SECRET";

const SECRET_LEN: usize = 32;

/// How long a new connection may take to send its hello.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the serving process beats on each heartbeat lane.
pub(super) const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// The byte of a beat.
pub(super) const BEAT: u8 = 0xBE;

/// The default of [`liveness`], in milliseconds.
const DEFAULT_LIVENESS_MS: u64 = 4000;

/// How long a remote rank waits for a beat before it declares the process serving
/// its communicator lost (stopped or hung): `MPIPE_ASCEND_EMU_LIVENESS_MS`, default
/// 4000, at least two [`HEARTBEAT_INTERVAL`]s. Read when a rank joins.
pub(super) fn liveness() -> Duration {
    let ms = std::env::var("MPIPE_ASCEND_EMU_LIVENESS_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(DEFAULT_LIVENESS_MS);
    Duration::from_millis(ms).max(2 * HEARTBEAT_INTERVAL)
}

/// The most connections saying hello at once; more are closed at once.
pub(super) const MAX_GREETING: usize = 256;

/// The most sends or receives in one batch request.
const MAX_BATCH_ITEMS: u32 = 1 << 16;

/// The default of [`max_message`]: 1 GiB.
const DEFAULT_MAX_MESSAGE: usize = 1 << 30;

/// The largest transfer or collective input one request may carry, in bytes (all of
/// a batch's together): `MPIPE_ASCEND_EMU_MAX_MESSAGE` or 1 GiB.
pub(super) fn max_message() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("MPIPE_ASCEND_EMU_MAX_MESSAGE")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_MESSAGE)
    })
}

/// This process's rendezvous secret ([`SECRET_VAR`]; zeros without it).
fn secret() -> &'static [u8; SECRET_LEN] {
    static SECRET: OnceLock<[u8; SECRET_LEN]> = OnceLock::new();
    SECRET.get_or_init(|| {
        let mut out = [0u8; SECRET_LEN];
        let Ok(text) = std::env::var(SECRET_VAR) else {
            return out;
        };
        let t = text.trim();
        let parsed = t.len() == 2 * SECRET_LEN
            && t.is_ascii()
            && out.iter_mut().enumerate().all(|(i, x)| {
                u8::from_str_radix(&t[2 * i..2 * i + 2], 16)
                    .map(|v| *x = v)
                    .is_ok()
            });
        if !parsed {
            eprintln!(
                "ascend-sys emulator: {SECRET_VAR} is not {} hex digits; ignored (any local \
                 process that knows a group id can join this process's communicators)",
                2 * SECRET_LEN
            );
            return [0; SECRET_LEN];
        }
        out
    })
}

/// Whether `a` and `b` are equal, in a time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

const JOIN: u8 = 0;
const ATTACH: u8 = 1;
const HEARTBEAT: u8 = 2;
const SEND: u8 = 1;
const RECV: u8 = 2;
const BATCH: u8 = 3;
const COLLECTIVE: u8 = 4;
const GOODBYE: u8 = 5;
const GONE: u8 = 6;
const STALLED: u8 = 7;

/// This process's listener address, started on first use; `None` when it cannot listen
/// (then root infos made here name no address and only threads can join).
pub(super) fn address() -> Option<SocketAddr> {
    static ADDR: OnceLock<Option<SocketAddr>> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let host = std::env::var("MPIPE_ASCEND_EMU_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let listener = match TcpListener::bind((host.as_str(), 0)) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "ascend-sys emulator: cannot listen on {host} ({e}); only ranks of this \
                     process can join its communicators (set MPIPE_ASCEND_EMU_HOST)"
                );
                return None;
            }
        };
        let addr = listener.local_addr().ok()?;
        std::thread::Builder::new()
            .name("ascend-emu-hub".into())
            .spawn(move || {
                static GREETING: AtomicUsize = AtomicUsize::new(0);
                for conn in listener.incoming().flatten() {
                    // A flood of connections that say nothing costs at most
                    // MAX_GREETING threads for HELLO_TIMEOUT each.
                    if GREETING.fetch_add(1, Ordering::SeqCst) >= MAX_GREETING {
                        GREETING.fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    let spawned = std::thread::Builder::new()
                        .name("ascend-emu-lane".into())
                        .spawn(move || serve(conn, &GREETING));
                    if spawned.is_err() {
                        GREETING.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .ok()?;
        Some(addr)
    })
}

// ------------------------------------------------------------------ wire helpers

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn get_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut x = [0u8; 1];
    r.read_exact(&mut x)?;
    Ok(x[0])
}

fn get_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut x = [0u8; 4];
    r.read_exact(&mut x)?;
    Ok(u32::from_le_bytes(x))
}

fn get_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut x = [0u8; 8];
    r.read_exact(&mut x)?;
    Ok(u64::from_le_bytes(x))
}

/// A length read from a peer, at most [`max_message`] (checked before anything is
/// allocated for it).
fn get_len(r: &mut impl Read) -> io::Result<usize> {
    let n = get_u64(r)?;
    match usize::try_from(n) {
        Ok(n) if n <= max_message() => Ok(n),
        _ => Err(too_large(n)),
    }
}

fn too_large(n: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "a request of {n} bytes, over the {} a request may carry \
             (MPIPE_ASCEND_EMU_MAX_MESSAGE)",
            max_message()
        ),
    )
}

/// A byte buffer aligned for every HCCL data type (reductions read it as `f64`/`u64`).
pub(super) struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    pub(super) fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(8).max(1)],
            len,
        }
    }

    /// [`Aligned::zeroed`], failing instead of aborting the process when the memory
    /// cannot be had.
    fn try_zeroed(len: usize) -> io::Result<Aligned> {
        let n = len.div_ceil(8).max(1);
        let mut words = Vec::new();
        words.try_reserve_exact(n).map_err(|_| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("cannot allocate {len} bytes for a request"),
            )
        })?;
        words.resize(n, 0);
        Ok(Aligned { words, len })
    }

    fn read(r: &mut impl Read, len: usize) -> io::Result<Aligned> {
        let mut a = Aligned::try_zeroed(len)?;
        r.read_exact(a.bytes_mut())?;
        Ok(a)
    }

    pub(super) fn addr(&mut self) -> usize {
        self.words.as_mut_ptr() as usize
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

/// `len` bytes at a caller's address.
///
/// # Safety
/// `addr` is valid for reads of `len` bytes (or `len` is 0).
unsafe fn raw<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// Copies `data` to a caller's address.
///
/// # Safety
/// `addr` is valid for writes of `data.len()` bytes (or `data` is empty).
unsafe fn copy_out(data: &[u8], addr: usize) {
    if !data.is_empty() {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
    }
}

// ------------------------------------------------------------------ server side

/// One lane of a remote rank: the hello (within [`HELLO_TIMEOUT`]; `greeting`
/// counts the connections at that stage), then its requests until it closes.
fn serve(mut conn: TcpStream, greeting: &AtomicUsize) {
    let _ = conn.set_nodelay(true);
    let greeted = conn
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .and_then(|()| hello(&mut conn))
        .and_then(|g| conn.set_read_timeout(None).map(|()| g));
    greeting.fetch_sub(1, Ordering::SeqCst);
    let Ok((group, rank, kind)) = greeted else {
        return;
    };
    if kind == HEARTBEAT {
        // Not a lane of operations: its closing says nothing about the rank (the
        // rank's own lanes do), and the group does not wait for it.
        drop(group);
        beat(&mut conn);
        return;
    }
    group.remote_opened();
    let mut goodbye = false;
    while let Ok(op) = get_u8(&mut conn) {
        if op == GOODBYE {
            goodbye = true;
            break;
        }
        if handle(&group, rank, op, &mut conn).is_err() {
            break;
        }
    }
    if !goodbye {
        // Closed (or broken) without HcclCommDestroy: the rank's process is gone.
        group.mark_gone(
            rank,
            "its connection to the communicator closed without HcclCommDestroy (its \
             process ended or was killed, or it abandoned the communicator)",
        );
    }
    group.remote_closed();
}

/// Beats on a heartbeat lane until it closes (the rank destroyed or abandoned its
/// communicator, or its process ended). A beat the rank is too busy to read waits in
/// the socket's buffer, which holds days of them.
fn beat(conn: &mut TcpStream) {
    while conn.write_all(&[BEAT]).is_ok() {
        std::thread::sleep(HEARTBEAT_INTERVAL);
    }
}

fn reply_status(conn: &mut TcpStream, rc: HcclResult) -> io::Result<()> {
    conn.write_all(&rc.0.to_le_bytes())
}

fn hello(conn: &mut TcpStream) -> io::Result<(Arc<Group>, u32, u8)> {
    let mut magic = [0u8; 8];
    conn.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(io::Error::other("not a lane"));
    }
    let mut theirs = [0u8; SECRET_LEN];
    conn.read_exact(&mut theirs)?;
    if !same_secret(&theirs, secret()) {
        let from = conn
            .peer_addr()
            .map_or("an unknown address".to_string(), |a| a.to_string());
        eprintln!(
            "ascend-sys emulator: rejected a connection from {from}: its hello does not \
             carry this job's rendezvous secret ({SECRET_VAR}); not one of this job's ranks"
        );
        return Err(io::Error::other("wrong secret"));
    }
    let id = get_u64(conn)?;
    let kind = get_u8(conn)?;
    let ranks = get_u32(conn)?;
    let rank = get_u32(conn)?;
    let joined = if rank >= ranks || kind > HEARTBEAT {
        Err(HcclResult::HCCL_E_PARA)
    } else {
        join_group(id, ranks, kind == JOIN)
    };
    match joined {
        Ok(g) => {
            reply_status(conn, HcclResult::HCCL_SUCCESS)?;
            Ok((g, rank, kind))
        }
        Err(rc) => {
            reply_status(conn, rc)?;
            Err(io::Error::other("refused"))
        }
    }
}

/// Runs one request of `rank` on `group` and replies.
fn handle(group: &Group, rank: u32, op: u8, conn: &mut TcpStream) -> io::Result<()> {
    let ok_peer = |p: u32| p < group.size && p != rank;
    match op {
        SEND => {
            let peer = get_u32(conn)?;
            let len = get_len(conn)?;
            let mut data = Aligned::read(conn, len)?;
            let rc = if ok_peer(peer) {
                group.send(rank, peer, data.addr(), len)
            } else {
                HcclResult::HCCL_E_PARA
            };
            reply_status(conn, rc)
        }
        RECV => {
            let peer = get_u32(conn)?;
            let len = get_len(conn)?;
            let mut data = Aligned::try_zeroed(len)?;
            let rc = if ok_peer(peer) {
                group.receive(peer, rank, data.addr(), len)
            } else {
                HcclResult::HCCL_E_PARA
            };
            let mut out = rc.0.to_le_bytes().to_vec();
            out.extend_from_slice(data.bytes());
            conn.write_all(&out)
        }
        BATCH => {
            // All of a batch's data together is bounded like one request's.
            let mut total = 0usize;
            let mut add = |len: usize| -> io::Result<()> {
                total = total.saturating_add(len);
                if total > max_message() {
                    return Err(too_large(total as u64));
                }
                Ok(())
            };
            let count = |n: u32| -> io::Result<u32> {
                if n > MAX_BATCH_ITEMS {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a batch of {n} items, over {MAX_BATCH_ITEMS}"),
                    ));
                }
                Ok(n)
            };
            let n = count(get_u32(conn)?)?;
            let mut sends = Vec::new();
            for _ in 0..n {
                let peer = get_u32(conn)?;
                let len = get_len(conn)?;
                add(len)?;
                sends.push((peer, Aligned::read(conn, len)?));
            }
            let n = count(get_u32(conn)?)?;
            let mut lens = Vec::new();
            for _ in 0..n {
                let peer = get_u32(conn)?;
                let len = get_len(conn)?;
                add(len)?;
                lens.push((peer, len));
            }
            // Allocated once every length has been checked.
            let mut recvs = Vec::new();
            for (peer, len) in lens {
                recvs.push((peer, Aligned::try_zeroed(len)?));
            }
            let all_ok = sends.iter().chain(&recvs).all(|(p, _)| ok_peer(*p));
            let rc = if all_ok {
                let s: Vec<_> = sends
                    .iter_mut()
                    .map(|(p, d)| (*p, d.addr(), d.len))
                    .collect();
                let r: Vec<_> = recvs
                    .iter_mut()
                    .map(|(p, d)| (*p, d.addr(), d.len))
                    .collect();
                group.batch(rank, &s, &r)
            } else {
                HcclResult::HCCL_E_PARA
            };
            let mut out = rc.0.to_le_bytes().to_vec();
            for (_, d) in &recvs {
                out.extend_from_slice(d.bytes());
            }
            conn.write_all(&out)
        }
        COLLECTIVE => {
            let coll = CollOp::decode(conn)?;
            let len = get_len(conn)?;
            let mut input = Aligned::read(conn, len)?;
            let (rc, output) = if len != coll.input_bytes()
                || coll.root() >= group.size
                || coll.output_bytes() > max_message()
            {
                (HcclResult::HCCL_E_PARA, Vec::new())
            } else if coll.in_place() {
                let addr = input.addr();
                let rc = coll.run(group, rank, addr, addr);
                (rc, input.bytes().to_vec())
            } else {
                let mut output = Aligned::try_zeroed(coll.output_bytes())?;
                let rc = coll.run(group, rank, input.addr(), output.addr());
                (rc, output.bytes().to_vec())
            };
            let mut out = rc.0.to_le_bytes().to_vec();
            put_u64(&mut out, output.len() as u64);
            out.extend_from_slice(&output);
            conn.write_all(&out)
        }
        GONE => {
            let gone = group.gone_ranks();
            let mut out = HcclResult::HCCL_SUCCESS.0.to_le_bytes().to_vec();
            put_u32(&mut out, gone.len() as u32);
            for r in gone {
                put_u32(&mut out, r);
            }
            conn.write_all(&out)
        }
        STALLED => {
            let peer = group.stalled_peer(rank);
            let mut out = HcclResult::HCCL_SUCCESS.0.to_le_bytes().to_vec();
            put_u32(&mut out, u32::from(peer.is_some()));
            put_u32(&mut out, peer.unwrap_or(0));
            conn.write_all(&out)
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unknown request",
        )),
    }
}

// ------------------------------------------------------------------ client side

/// A rank whose group is served by another process.
pub(super) struct Remote {
    addr: SocketAddr,
    id: u64,
    size: u32,
    rank: u32,
    lanes: Mutex<Vec<TcpStream>>,
    /// Set by [`Remote::abandon`]: lanes close without a goodbye.
    abandoned: AtomicBool,
    /// What the heartbeat watchdog shares with the calls.
    watch: Arc<Watch>,
    /// The watchdog's thread, joined when the rank leaves.
    watchdog: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What a remote rank's heartbeat watchdog ([`watchdog`]) shares with its calls.
#[derive(Default)]
struct Watch {
    /// No beat came within [`liveness`]: the serving process is stopped or hung.
    lost: AtomicBool,
    /// The rank is leaving its communicator: the watchdog ends without a word.
    closing: AtomicBool,
    /// Clones of the lanes calls are waiting on, by call: cut off when lost.
    busy: Mutex<HashMap<u64, TcpStream>>,
    /// The next call's key in `busy`.
    calls: AtomicU64,
    /// A clone of the heartbeat lane, shut down to end the watchdog.
    heart: Mutex<Option<TcpStream>>,
}

/// Reads the beats of `heart` (a heartbeat lane whose read timeout is `deadline`);
/// when none comes within `deadline`, declares the serving process lost: every call
/// waiting on a lane is cut off, and later calls fail at once. A lane that closes
/// (the serving process ended: its operation lanes close too and say so) or a rank
/// that leaves ends it quietly.
fn watchdog(mut heart: TcpStream, watch: &Watch, rank: u32, addr: SocketAddr, deadline: Duration) {
    let mut beat = [0u8; 1];
    let mut last = Instant::now();
    loop {
        match heart.read(&mut beat) {
            Ok(0) => return,
            Ok(_) => last = Instant::now(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) && last.elapsed() >= deadline =>
            {
                if watch.closing.load(Ordering::SeqCst) {
                    return;
                }
                watch.lost.store(true, Ordering::SeqCst);
                eprintln!(
                    "ascend-sys emulator: rank {rank}: the process serving its communicator \
                     at {addr} sent no heartbeat for {:?} (MPIPE_ASCEND_EMU_LIVENESS_MS): it \
                     is stopped or hung; this rank's operations on the communicator fail \
                     (HCCL_E_TCP_TRANSFER)",
                    last.elapsed()
                );
                for conn in super::lock(&watch.busy).values() {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                }
                return;
            }
            // (Woken early: wait out the rest of the deadline.)
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

impl Remote {
    /// Joins group `id` served at `addr` as `rank` of `size`, and starts watching the
    /// serving process's heartbeat.
    pub(super) fn join(
        addr: SocketAddr,
        id: u64,
        size: u32,
        rank: u32,
    ) -> Result<Remote, HcclResult> {
        let remote = Remote {
            addr,
            id,
            size,
            rank,
            lanes: Mutex::new(Vec::new()),
            abandoned: AtomicBool::new(false),
            watch: Arc::default(),
            watchdog: Mutex::new(None),
        };
        let lane = remote.open(JOIN)?;
        super::lock(&remote.lanes).push(lane);
        let deadline = liveness();
        let heart = remote.open(HEARTBEAT)?;
        let started = heart
            .set_read_timeout(Some(deadline))
            .and_then(|()| heart.try_clone())
            .and_then(|clone| {
                *super::lock(&remote.watch.heart) = Some(clone);
                let watch = Arc::clone(&remote.watch);
                std::thread::Builder::new()
                    .name("ascend-emu-heartbeat".into())
                    .spawn(move || watchdog(heart, &watch, rank, addr, deadline))
            })
            .map_err(|e| remote.broken(&e))?;
        *super::lock(&remote.watchdog) = Some(started);
        Ok(remote)
    }

    /// Ends the watchdog (the rank is leaving its communicator).
    fn stop_watching(&self) {
        self.watch.closing.store(true, Ordering::SeqCst);
        if let Some(heart) = super::lock(&self.watch.heart).take() {
            let _ = heart.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = super::lock(&self.watchdog).take() {
            let _ = t.join();
        }
    }

    fn open(&self, kind: u8) -> Result<TcpStream, HcclResult> {
        let mut conn = TcpStream::connect_timeout(&self.addr, timeout()).map_err(|e| {
            eprintln!(
                "ascend-sys emulator: rank {} cannot reach the process serving its \
                 communicator at {}: {e} (HCCL_E_TCP_CONNECT)",
                self.rank, self.addr
            );
            HcclResult::HCCL_E_TCP_CONNECT
        })?;
        let _ = conn.set_nodelay(true);
        // A live serving process answers a hello at once; a stopped one accepts the
        // connection (the system does) but never answers.
        let _ = conn.set_read_timeout(Some(liveness()));
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(secret());
        put_u64(&mut hello, self.id);
        hello.push(kind);
        put_u32(&mut hello, self.size);
        put_u32(&mut hello, self.rank);
        let rc = conn
            .write_all(&hello)
            .and_then(|()| get_u32(&mut conn))
            .map_err(|e| self.broken(&e))?;
        match HcclResult(rc) {
            HcclResult::HCCL_SUCCESS => Ok(conn),
            bad => Err(bad),
        }
    }

    fn broken(&self, e: &io::Error) -> HcclResult {
        eprintln!(
            "ascend-sys emulator: rank {} lost the process serving its communicator at {}: \
             {e} (HCCL_E_TCP_TRANSFER)",
            self.rank, self.addr
        );
        HcclResult::HCCL_E_TCP_TRANSFER
    }

    /// Sends `request` on a free lane and reads the reply with `read` (the status, then
    /// whatever the request returns). `waits` bounds the reply time in timeouts (a
    /// backstop: a serving process that stops answering is found by the heartbeat).
    fn call(
        &self,
        request: &[u8],
        waits: u32,
        read: impl FnOnce(&mut TcpStream, HcclResult) -> io::Result<()>,
    ) -> HcclResult {
        // The watchdog said why.
        let lost = || self.watch.lost.load(Ordering::SeqCst);
        if lost() {
            return HcclResult::HCCL_E_TCP_TRANSFER;
        }
        let lane = super::lock(&self.lanes).pop();
        let mut conn = match lane {
            Some(c) => c,
            None => match self.open(ATTACH) {
                Ok(c) => c,
                Err(rc) => return rc,
            },
        };
        // Registered before `lost` is read again, so the watchdog either cuts this
        // lane off or is seen to have fired.
        let key = self.watch.calls.fetch_add(1, Ordering::SeqCst);
        if let Ok(clone) = conn.try_clone() {
            super::lock(&self.watch.busy).insert(key, clone);
        }
        if lost() {
            super::lock(&self.watch.busy).remove(&key);
            return HcclResult::HCCL_E_TCP_TRANSFER;
        }
        let limit = timeout() * (waits + 1) + Duration::from_secs(10);
        let _ = conn.set_read_timeout(Some(limit));
        let outcome = conn.write_all(request).and_then(|()| {
            let rc = HcclResult(get_u32(&mut conn)?);
            read(&mut conn, rc)?;
            Ok(rc)
        });
        super::lock(&self.watch.busy).remove(&key);
        match outcome {
            Ok(rc) => {
                super::lock(&self.lanes).push(conn);
                rc
            }
            Err(_) if lost() => HcclResult::HCCL_E_TCP_TRANSFER,
            Err(e) => self.broken(&e),
        }
    }

    /// The first rank the serving process found gone, if any (asked when an operation
    /// failed with `HCCL_E_REMOTE`).
    pub(super) fn first_gone(&self) -> Option<u32> {
        let mut first = None;
        let rc = self.call(&[GONE], 0, |conn, rc| {
            if rc == HcclResult::HCCL_SUCCESS {
                let n = get_u32(conn)?;
                for i in 0..n {
                    let r = get_u32(conn)?;
                    if i == 0 {
                        first = Some(r);
                    }
                }
            }
            Ok(())
        });
        first.filter(|_| rc == HcclResult::HCCL_SUCCESS)
    }

    /// The peer this rank's first timed-out operation waited for, as the serving
    /// process saw it (asked when an operation failed with `HCCL_E_TIMEOUT`).
    pub(super) fn stalled_peer(&self) -> Option<u32> {
        let mut peer = None;
        let rc = self.call(&[STALLED], 0, |conn, rc| {
            if rc == HcclResult::HCCL_SUCCESS {
                let known = get_u32(conn)?;
                let p = get_u32(conn)?;
                peer = (known != 0).then_some(p);
            }
            Ok(())
        });
        peer.filter(|_| rc == HcclResult::HCCL_SUCCESS)
    }

    /// `HCCL_E_PARA`, said on standard error, when `bytes` is over what one request
    /// may carry to the serving process.
    fn over_limit(&self, bytes: usize) -> Option<HcclResult> {
        (bytes > max_message()).then(|| {
            eprintln!(
                "ascend-sys emulator: rank {}: a transfer of {bytes} bytes to another \
                 process, over the {} one request may carry (raise \
                 MPIPE_ASCEND_EMU_MAX_MESSAGE) (HCCL_E_PARA)",
                self.rank,
                max_message()
            );
            HcclResult::HCCL_E_PARA
        })
    }

    pub(super) fn send(&self, peer: u32, addr: usize, len: usize) -> HcclResult {
        if let Some(rc) = self.over_limit(len) {
            return rc;
        }
        let mut req = vec![SEND];
        put_u32(&mut req, peer);
        put_u64(&mut req, len as u64);
        // SAFETY: the HcclSend caller's buffer holds `len` bytes until its stream moves on.
        req.extend_from_slice(unsafe { raw(addr, len) });
        self.call(&req, 1, |_, _| Ok(()))
    }

    pub(super) fn receive(&self, peer: u32, addr: usize, len: usize) -> HcclResult {
        if let Some(rc) = self.over_limit(len) {
            return rc;
        }
        let mut req = vec![RECV];
        put_u32(&mut req, peer);
        put_u64(&mut req, len as u64);
        self.call(&req, 1, |conn, rc| {
            let data = Aligned::read(conn, len)?;
            if rc == HcclResult::HCCL_SUCCESS {
                // SAFETY: the HcclRecv caller's buffer holds `len` bytes.
                unsafe { copy_out(data.bytes(), addr) };
            }
            Ok(())
        })
    }

    /// `sends` and `recvs` are (peer, address, length).
    pub(super) fn batch(
        &self,
        sends: &[(u32, usize, usize)],
        recvs: &[(u32, usize, usize)],
    ) -> HcclResult {
        let total = sends
            .iter()
            .chain(recvs)
            .fold(0usize, |t, &(_, _, len)| t.saturating_add(len));
        if let Some(rc) = self.over_limit(total) {
            return rc;
        }
        let mut req = vec![BATCH];
        put_u32(&mut req, sends.len() as u32);
        for &(peer, addr, len) in sends {
            put_u32(&mut req, peer);
            put_u64(&mut req, len as u64);
            // SAFETY: the batch caller's send buffers hold their lengths.
            req.extend_from_slice(unsafe { raw(addr, len) });
        }
        put_u32(&mut req, recvs.len() as u32);
        for &(peer, _, len) in recvs {
            put_u32(&mut req, peer);
            put_u64(&mut req, len as u64);
        }
        let waits = (sends.len() + recvs.len()) as u32;
        self.call(&req, waits, |conn, rc| {
            for &(_, addr, len) in recvs {
                let data = Aligned::read(conn, len)?;
                if rc == HcclResult::HCCL_SUCCESS {
                    // SAFETY: the batch caller's receive buffers hold their lengths.
                    unsafe { copy_out(data.bytes(), addr) };
                }
            }
            Ok(())
        })
    }

    /// Runs `coll` with this rank's input at `input` and output at `output` (the same
    /// address for in-place operations).
    pub(super) fn collective(&self, coll: CollOp, input: usize, output: usize) -> HcclResult {
        if let Some(rc) = self.over_limit(coll.input_bytes().max(coll.output_bytes())) {
            return rc;
        }
        let mut req = vec![COLLECTIVE];
        coll.encode(&mut req);
        let len = coll.input_bytes();
        put_u64(&mut req, len as u64);
        // SAFETY: the collective's caller's input buffer holds `len` bytes.
        req.extend_from_slice(unsafe { raw(input, len) });
        let writes = coll.writes(self.rank);
        self.call(&req, 1, |conn, rc| {
            let n = get_len(conn)?;
            let data = Aligned::read(conn, n)?;
            if rc == HcclResult::HCCL_SUCCESS && writes && n == coll.output_bytes() {
                // SAFETY: the caller's output buffer holds the operation's output.
                unsafe { copy_out(data.bytes(), output) };
            }
            Ok(())
        })
    }
}

impl Remote {
    /// Closes this rank's idle lanes without a goodbye: the serving process marks it
    /// gone (see [`super::hccl::abandon`]). A lane busy with an operation closes when
    /// the operation ends (this `Remote` is dropped without lanes to say goodbye on).
    pub(super) fn abandon(&self) {
        self.abandoned.store(true, Ordering::SeqCst);
        self.stop_watching();
        let lanes = std::mem::take(&mut *super::lock(&self.lanes));
        for lane in lanes {
            let _ = lane.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Closing a rank's lanes with a goodbye: it destroyed its communicator, it is not
/// gone (a lane closing without one marks the rank gone).
impl Drop for Remote {
    fn drop(&mut self) {
        self.stop_watching();
        if self.abandoned.load(Ordering::SeqCst) {
            return;
        }
        let lanes = std::mem::take(&mut *super::lock(&self.lanes));
        for mut lane in lanes {
            let _ = lane.write_all(&[GOODBYE]);
        }
    }
}

/// Wire form of a collective.
impl CollOp {
    fn encode(&self, b: &mut Vec<u8>) {
        let (kind, t, op, root, count) = match *self {
            CollOp::AllReduce { t, op, count } => (0u8, t, op, 0, count),
            CollOp::Reduce { t, op, count, root } => (1, t, op, root, count),
            CollOp::Broadcast { t, count, root } => (2, t, HcclReduceOp(0), root, count),
            CollOp::Barrier => (3, HcclDataType(0), HcclReduceOp(0), 0, 0),
        };
        b.push(kind);
        put_u32(b, t.0);
        put_u32(b, op.0);
        put_u32(b, root);
        put_u64(b, count as u64);
    }

    fn decode(r: &mut impl Read) -> io::Result<CollOp> {
        let kind = get_u8(r)?;
        let t = HcclDataType(get_u32(r)?);
        let op = HcclReduceOp(get_u32(r)?);
        let root = get_u32(r)?;
        let count = get_len(r)?;
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "bad collective");
        if kind < 3 && element_size(t).is_none() {
            return Err(bad());
        }
        Ok(match kind {
            0 => CollOp::AllReduce { t, op, count },
            1 => CollOp::Reduce { t, op, count, root },
            2 => CollOp::Broadcast { t, count, root },
            3 => CollOp::Barrier,
            _ => return Err(bad()),
        })
    }
}
