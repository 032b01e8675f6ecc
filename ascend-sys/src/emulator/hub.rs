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
//! Wire format (little-endian; one request, one reply, on one connection at a time):
//! - hello: `MAGIC`, group id `u64`, kind `u8` (0 join, 1 attach another lane),
//!   ranks `u32`, rank `u32` -> status `u32`;
//! - send: `1`, peer `u32`, length `u64`, data -> status;
//! - receive: `2`, peer `u32`, length `u64` -> status, data;
//! - batch: `3`, sends `u32` x (peer `u32`, length `u64`, data), receives `u32` x
//!   (peer `u32`, length `u64`) -> status, each receive's data;
//! - collective: `4`, [`CollOp`], input length `u64`, input -> status, output length
//!   `u64`, output.
//!
//! A rank keeps a pool of connections (lanes), so operations on several streams of one
//! communicator proceed independently, as on a device. The serving process keeps its
//! groups until every remote lane has closed (`HcclCommDestroy` of a rank in the serving
//! process waits for that, up to the timeout), so it does not exit under a reply.

use super::hccl::{element_size, join_group, timeout, CollOp, Group, MAGIC};
use crate::bindings::*;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const JOIN: u8 = 0;
const ATTACH: u8 = 1;
const SEND: u8 = 1;
const RECV: u8 = 2;
const BATCH: u8 = 3;
const COLLECTIVE: u8 = 4;

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
                for conn in listener.incoming().flatten() {
                    let _ = std::thread::Builder::new()
                        .name("ascend-emu-lane".into())
                        .spawn(move || serve(conn));
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

/// A length read from a peer, bounded so a corrupt message cannot exhaust memory.
fn get_len(r: &mut impl Read) -> io::Result<usize> {
    let n = get_u64(r)?;
    if n > 1 << 40 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "length too large",
        ));
    }
    Ok(n as usize)
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

    fn read(r: &mut impl Read, len: usize) -> io::Result<Aligned> {
        let mut a = Aligned::zeroed(len);
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

/// One lane of a remote rank: the hello, then its requests until it closes.
fn serve(mut conn: TcpStream) {
    let _ = conn.set_nodelay(true);
    let Ok((group, rank)) = hello(&mut conn) else {
        return;
    };
    group.remote_opened();
    while let Ok(op) = get_u8(&mut conn) {
        if handle(&group, rank, op, &mut conn).is_err() {
            break;
        }
    }
    group.remote_closed();
}

fn reply_status(conn: &mut TcpStream, rc: HcclResult) -> io::Result<()> {
    conn.write_all(&rc.0.to_le_bytes())
}

fn hello(conn: &mut TcpStream) -> io::Result<(Arc<Group>, u32)> {
    let mut magic = [0u8; 8];
    conn.read_exact(&mut magic)?;
    let id = get_u64(conn)?;
    let kind = get_u8(conn)?;
    let ranks = get_u32(conn)?;
    let rank = get_u32(conn)?;
    let joined = if &magic != MAGIC || rank >= ranks || kind > ATTACH {
        Err(HcclResult::HCCL_E_PARA)
    } else {
        join_group(id, ranks, kind == JOIN)
    };
    match joined {
        Ok(g) => {
            reply_status(conn, HcclResult::HCCL_SUCCESS)?;
            Ok((g, rank))
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
            let mut data = Aligned::zeroed(len);
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
            let n = get_u32(conn)?;
            let mut sends = Vec::new();
            for _ in 0..n {
                let peer = get_u32(conn)?;
                let len = get_len(conn)?;
                sends.push((peer, Aligned::read(conn, len)?));
            }
            let n = get_u32(conn)?;
            let mut recvs = Vec::new();
            for _ in 0..n {
                let peer = get_u32(conn)?;
                let len = get_len(conn)?;
                recvs.push((peer, Aligned::zeroed(len)));
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
            let (rc, output) = if len != coll.input_bytes() || coll.root() >= group.size {
                (HcclResult::HCCL_E_PARA, Vec::new())
            } else if coll.in_place() {
                let addr = input.addr();
                let rc = coll.run(group, rank, addr, addr);
                (rc, input.bytes().to_vec())
            } else {
                let mut output = Aligned::zeroed(coll.output_bytes());
                let rc = coll.run(group, rank, input.addr(), output.addr());
                (rc, output.bytes().to_vec())
            };
            let mut out = rc.0.to_le_bytes().to_vec();
            put_u64(&mut out, output.len() as u64);
            out.extend_from_slice(&output);
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
}

impl Remote {
    /// Joins group `id` served at `addr` as `rank` of `size`.
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
        };
        let lane = remote.open(JOIN)?;
        remote
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(lane);
        Ok(remote)
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
        let mut hello = MAGIC.to_vec();
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
    /// whatever the request returns). `waits` bounds the reply time in timeouts.
    fn call(
        &self,
        request: &[u8],
        waits: u32,
        read: impl FnOnce(&mut TcpStream, HcclResult) -> io::Result<()>,
    ) -> HcclResult {
        let lane = self.lanes.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut conn = match lane {
            Some(c) => c,
            None => match self.open(ATTACH) {
                Ok(c) => c,
                Err(rc) => return rc,
            },
        };
        let limit = timeout() * (waits + 1) + Duration::from_secs(10);
        let _ = conn.set_read_timeout(Some(limit));
        let outcome = conn.write_all(request).and_then(|()| {
            let rc = HcclResult(get_u32(&mut conn)?);
            read(&mut conn, rc)?;
            Ok(rc)
        });
        match outcome {
            Ok(rc) => {
                self.lanes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(conn);
                rc
            }
            Err(e) => self.broken(&e),
        }
    }

    pub(super) fn send(&self, peer: u32, addr: usize, len: usize) -> HcclResult {
        let mut req = vec![SEND];
        put_u32(&mut req, peer);
        put_u64(&mut req, len as u64);
        // SAFETY: the HcclSend caller's buffer holds `len` bytes until its stream moves on.
        req.extend_from_slice(unsafe { raw(addr, len) });
        self.call(&req, 1, |_, _| Ok(()))
    }

    pub(super) fn receive(&self, peer: u32, addr: usize, len: usize) -> HcclResult {
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
