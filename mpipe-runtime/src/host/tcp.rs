//! Ranks as separate processes on one machine, over loopback TCP.
//!
//! **Setup** ([`from_env`], [`connect`]), from the variables torchrun and the usual
//! Slurm wrappers set (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; the
//! `mpipe-run` launcher sets them too):
//! 1. every rank opens its own listener on an ephemeral port of `MASTER_ADDR`'s
//!    (loopback) address;
//! 2. rank 0 listens on `MASTER_PORT`; every other rank registers there (rank, world
//!    size, its listener's port), retrying until rank 0 is up;
//! 3. once all have registered, rank 0 sends every rank the table of ports;
//! 4. each rank connects to every higher rank and accepts a connection from every
//!    lower one: one connection per pair.
//!
//! Everything is bounded by the timeout given; a rank that does not show up makes
//! the others fail with [`Error::Timeout`] naming what was missing.
//!
//! **Who may join.** Every hello (a registration, a peer's greeting) and rank 0's
//! table carry the job's *rendezvous secret*: 32 random bytes that the launcher
//! (`mpipe-run`, [`crate::host::launch`]) makes for each launch and hands to its
//! ranks in the environment variable [`SECRET_VAR`] (64 hex digits; never on the
//! command line, which every user of the machine can read). A connection is read
//! for its hello only, and what it says is believed only if it carries the secret
//! (compared in constant time); otherwise it is dropped, and a hello with the right
//! magic but the wrong secret is reported on standard error. Connections that say
//! nothing within [`HELLO_TIMEOUT`], or say something else, are dropped without
//! holding up the set-up: strangers on the machine can neither join a job nor make
//! it fail. Without [`SECRET_VAR`] (ranks started by another launcher) the secret is
//! empty and anyone on the machine who speaks the protocol can join: set it to the
//! same random value for every rank of a job ([`new_secret`]).
//!
//! **Wire format.** Every message is a frame: its length in bytes (`u64`, little
//! endian, not counting itself), a type byte, then the body — `READY` (1): a channel;
//! `DATA` (2): a channel then the `f32` values, little-endian; `ABORT` (3): the
//! failed rank (`u64`) then what it was doing (UTF-8); `BYE` (4): nothing. A channel
//! is the operation (`u8`: point-to-point or a collective's phase), the tag's kind
//! (`u8`), unit and micro-batch (`u32` each). One reader thread per connection turns
//! frames into the rank's inbox (see [`crate::host`] for the protocol).
//!
//! **Failures.** A connection that ends without a `BYE` (the process exited, was
//! killed, or [`TcpComm::close_abruptly`]) makes every call of the other ranks fail
//! with [`Error::PeerFailed`] naming that rank.

use std::io::{self, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{host_comm, run_comms, Chan, Endpoint, Inbox, Link, Msg, Op};
use crate::comm::{Error, Tag, Tensor};

const MAGIC: u32 = 0x4d50_4950; // "MPIP"
/// 2: hellos and the table carry the rendezvous secret; 3: an abort says whom its
/// origin timed out waiting for.
const PROTOCOL: u32 = 3;

/// The environment variable through which a launcher hands its ranks the job's
/// rendezvous secret: 64 hex digits ([`new_secret`]).
pub const SECRET_VAR: &str = "MPIPE_RDZV_SECRET";

/// The bytes of a rendezvous secret.
pub const SECRET_LEN: usize = 32;

/// A job's rendezvous secret (all zeros: none).
pub type Secret = [u8; SECRET_LEN];

/// How long a connection accepted during set-up may take to send its hello before
/// it is dropped (the set-up goes on meanwhile).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// The most connections waiting to send their hello at once; beyond it the oldest
/// is dropped (a flood of idle connections cannot exhaust the rank).
const MAX_PENDING: usize = 64;

/// A new random rendezvous secret, as [`SECRET_VAR`] holds it (64 hex digits, from
/// the system's random source).
///
/// # Errors
/// When the system's random source cannot be read.
pub fn new_secret() -> io::Result<String> {
    let mut b = [0u8; SECRET_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The secret [`SECRET_VAR`]'s text gives.
pub(crate) fn parse_secret(text: &str) -> Result<Secret, Error> {
    let t = text.trim();
    let bad = || {
        Error::Setup(format!(
            "{SECRET_VAR} is not {} hex digits (the launcher sets it; leave it alone)",
            2 * SECRET_LEN
        ))
    };
    if t.len() != 2 * SECRET_LEN || !t.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; SECRET_LEN];
    for (i, x) in out.iter_mut().enumerate() {
        *x = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// Whether `a` and `b` are equal, in a time that does not depend on where they
/// differ.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A line on standard error (ignoring a closed stream).
fn log(text: &str) {
    let mut e = io::stderr().lock();
    let _ = e.write_all(text.as_bytes());
    let _ = e.write_all(b"\n");
}

const READY: u8 = 1;
const DATA: u8 = 2;
const ABORT: u8 = 3;
const BYE: u8 = 4;
/// Frames longer than this are garbage (1 TiB).
const MAX_FRAME: u64 = 1 << 40;

/// One rank of a world of processes (or threads) connected over loopback TCP.
pub struct TcpComm {
    ep: Endpoint,
}

host_comm!(TcpComm);

impl TcpComm {
    /// Closes every connection at once, without a goodbye, as if this process had
    /// been killed: the other ranks' calls fail with [`Error::PeerFailed`] naming
    /// this rank. For tests of failure handling.
    pub fn close_abruptly(mut self) {
        self.ep.close_abruptly();
    }
}

struct TcpLink {
    writers: Vec<Option<Mutex<TcpStream>>>,
    closers: Vec<Option<TcpStream>>,
}

impl Link for TcpLink {
    fn deliver(&self, to: usize, msg: &Msg<&[f32]>) -> io::Result<()> {
        let Some(w) = self.writers.get(to).and_then(Option::as_ref) else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("no connection to rank {to}"),
            ));
        };
        let frame = encode(msg);
        w.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .write_all(&frame)
    }

    fn close(&self, abrupt: bool) {
        let how = if abrupt {
            Shutdown::Both
        } else {
            Shutdown::Write
        };
        for s in self.closers.iter().flatten() {
            let _ = s.shutdown(how);
        }
    }
}

fn put_chan(b: &mut Vec<u8>, c: &Chan) {
    b.push(c.op as u8);
    b.push(c.tag.kind);
    b.extend_from_slice(&c.tag.unit.to_le_bytes());
    b.extend_from_slice(&c.tag.mb.to_le_bytes());
}

fn encode(msg: &Msg<&[f32]>) -> Vec<u8> {
    let mut b = vec![0u8; 8];
    match msg {
        Msg::Ready(c) => {
            b.push(READY);
            put_chan(&mut b, c);
        }
        Msg::Data(c, d) => {
            b.reserve(11 + 4 * d.len());
            b.push(DATA);
            put_chan(&mut b, c);
            for x in d.iter() {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
        Msg::Abort {
            origin,
            what,
            waited_for,
        } => {
            b.push(ABORT);
            b.extend_from_slice(&(*origin as u64).to_le_bytes());
            b.extend_from_slice(&waited_for.map_or(u64::MAX, |w| w as u64).to_le_bytes());
            b.extend_from_slice(what.as_bytes());
        }
        Msg::Bye => b.push(BYE),
    }
    let len = (b.len() - 8) as u64;
    b[..8].copy_from_slice(&len.to_le_bytes());
    b
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn get_chan(b: &[u8]) -> io::Result<Chan> {
    if b.len() < 10 {
        return Err(bad("truncated channel"));
    }
    let op = Op::from_u8(b[0]).ok_or_else(|| bad(format!("unknown operation {}", b[0])))?;
    let unit = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let mb = u32::from_le_bytes([b[6], b[7], b[8], b[9]]);
    Ok(Chan {
        op,
        tag: Tag::new(b[1], unit, mb),
    })
}

fn decode(body: &[u8]) -> io::Result<Msg<Tensor>> {
    let (&ty, rest) = body.split_first().ok_or_else(|| bad("empty frame"))?;
    Ok(match ty {
        READY => Msg::Ready(get_chan(rest)?),
        DATA => {
            let chan = get_chan(rest)?;
            let data = &rest[10..];
            if data.len() % 4 != 0 {
                return Err(bad("data frame of a partial f32"));
            }
            let t = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Msg::Data(chan, t)
        }
        ABORT => {
            if rest.len() < 16 {
                return Err(bad("truncated abort"));
            }
            let word = |i: usize| {
                let mut o = [0u8; 8];
                o.copy_from_slice(&rest[i..i + 8]);
                u64::from_le_bytes(o)
            };
            let waited_for = word(8);
            Msg::Abort {
                origin: word(0) as usize,
                what: String::from_utf8_lossy(&rest[16..]).into_owned(),
                waited_for: (waited_for != u64::MAX).then_some(waited_for as usize),
            }
        }
        BYE => Msg::Bye,
        t => return Err(bad(format!("unknown frame type {t}"))),
    })
}

/// Fills `buf`; `Ok(false)` on end of stream before the first byte.
fn read_or_eof(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) if n == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// The next frame; `None` at a clean end of stream.
fn read_msg(r: &mut impl Read) -> io::Result<Option<Msg<Tensor>>> {
    let mut len = [0u8; 8];
    if !read_or_eof(r, &mut len)? {
        return Ok(None);
    }
    let len = u64::from_le_bytes(len);
    if len == 0 || len > MAX_FRAME {
        return Err(bad(format!("frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    decode(&body).map(Some)
}

fn read_loop(peer: usize, stream: TcpStream, inbox: Arc<Inbox>) {
    let mut r = BufReader::with_capacity(1 << 16, stream);
    loop {
        match read_msg(&mut r) {
            Ok(Some(msg)) => inbox.handle(peer, msg),
            Ok(None) => {
                inbox.lost(
                    peer,
                    "its connection closed without a goodbye (the process exited or was killed)"
                        .into(),
                );
                return;
            }
            Err(e) => {
                inbox.lost(peer, format!("its connection was lost ({e})"));
                return;
            }
        }
    }
}

/// Connects this process as rank `RANK` of `WORLD_SIZE`, meeting the others through
/// `MASTER_ADDR` (default `127.0.0.1`; must be a loopback address) and `MASTER_PORT`,
/// in the point-to-point mode `MPIPE_COMM_MODE` names ([`super::default_mode`]).
/// See [`connect`].
pub fn from_env(timeout: Duration) -> Result<TcpComm, Error> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| {
            Error::Setup(format!(
                "environment variable {name} is not set (start the ranks with mpipe-run, torchrun or a Slurm wrapper)"
            ))
        })
    };
    let num = |name: &str| -> Result<usize, Error> {
        let v = var(name)?;
        v.trim()
            .parse()
            .map_err(|_| Error::Setup(format!("{name}={v:?} is not a number")))
    };
    let rank = num("RANK")?;
    let world = num("WORLD_SIZE")?;
    let port = num("MASTER_PORT")?;
    let port = u16::try_from(port)
        .map_err(|_| Error::Setup(format!("MASTER_PORT={port} is not a port")))?;
    let host = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let master = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| Error::Setup(format!("MASTER_ADDR={host:?}: {e}")))?
        .find(|a| a.ip().is_loopback())
        .ok_or_else(|| {
            Error::Setup(format!(
                "MASTER_ADDR={host:?} is not a loopback address: the host TCP backend runs every rank on this machine"
            ))
        })?;
    // Under mpipe-run: note whom this rank blames if another rank fails first.
    let blame = std::env::var_os(BLAME_DIR_VAR)
        .map(|d| std::path::PathBuf::from(d).join(blame_file_name(rank)));
    let secret = match std::env::var(SECRET_VAR) {
        Ok(text) => parse_secret(&text)?,
        Err(_) => [0; SECRET_LEN],
    };
    let mode = super::default_mode()?;
    let mut comm = connect_noting_blame(rank, world, master, None, timeout, blame, &secret)?;
    comm.ep.set_mode(mode);
    Ok(comm)
}

/// The environment variable naming the directory where ranks started by `mpipe-run`
/// note which rank they blame for their failure.
pub const BLAME_DIR_VAR: &str = "MPIPE_RUN_DIR";

/// The file, in [`BLAME_DIR_VAR`]'s directory, where rank `rank` notes the rank whose
/// failure it learnt of first (its number, a newline, what that rank was doing).
pub fn blame_file_name(rank: usize) -> String {
    format!("rank-{rank}.blame")
}

/// Connects rank `rank` of `world`, meeting the others at `master` (a loopback
/// address; rank 0 listens there). Returns once this rank is connected to every
/// other; fails if that takes longer than `timeout`, which also bounds every later
/// blocking call.
pub fn connect(
    rank: usize,
    world: usize,
    master: SocketAddr,
    timeout: Duration,
) -> Result<TcpComm, Error> {
    connect_noting_blame(rank, world, master, None, timeout, None, &[0; SECRET_LEN])
}

/// [`connect`], proving `secret` to the other ranks and accepting only those that
/// prove it (see the module doc, "Who may join").
pub fn connect_with_secret(
    rank: usize,
    world: usize,
    master: SocketAddr,
    secret: &Secret,
    timeout: Duration,
) -> Result<TcpComm, Error> {
    connect_noting_blame(rank, world, master, None, timeout, None, secret)
}

/// [`connect`], with rank 0's master listener already bound (`bound`, by the
/// caller, at `master`) when given: then no other process can take the port
/// between choosing it and listening on it.
fn connect_noting_blame(
    rank: usize,
    world: usize,
    master: SocketAddr,
    bound: Option<TcpListener>,
    timeout: Duration,
    blame: Option<std::path::PathBuf>,
    secret: &Secret,
) -> Result<TcpComm, Error> {
    if rank >= world {
        return Err(Error::Setup(format!(
            "rank {rank} of a world of {world} ranks"
        )));
    }
    if !master.ip().is_loopback() {
        return Err(Error::Setup(format!(
            "master address {master} is not a loopback address: the host TCP backend runs every rank on this machine"
        )));
    }
    let deadline = Instant::now() + timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    if world > 1 {
        let ip = master.ip();
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("rank {rank}: cannot listen on {ip}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io(format!("rank {rank}: listener address"), e))?
            .port();
        let ports = if rank == 0 {
            serve_table(master, bound, world, port, deadline, timeout, secret)?
        } else {
            register(rank, world, master, port, deadline, timeout, secret)?
        };
        for (q, &port) in ports.iter().enumerate().skip(rank + 1) {
            let addr = SocketAddr::new(ip, port);
            let mut s = connect_retry(addr, deadline, timeout, &|| {
                format!("rank {rank}: connecting to rank {q} at {addr}")
            })?;
            s.write_all(&peer_hello(rank, world, secret))
                .map_err(|e| Error::io(format!("rank {rank}: greeting rank {q}"), e))?;
            streams[q] = Some(s);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("set_nonblocking", e))?;
        let mut door = Door::new(&listener, 4, secret, format!("rank {rank}"));
        while streams[..rank].iter().any(Option::is_none) {
            let missing: Vec<usize> = (0..rank).filter(|&q| streams[q].is_none()).collect();
            let (s, h) = door.next(deadline, timeout, &|| {
                format!("ranks {missing:?} to connect to rank {rank}")
            })?;
            let [_, _, q, w] = words(&h);
            let (q, w) = (q as usize, w as usize);
            if w != world {
                return Err(Error::Setup(format!(
                    "rank {q} runs with a world of {w} ranks, rank {rank} with {world}"
                )));
            }
            if q >= rank || streams[q].is_some() {
                return Err(Error::Setup(format!(
                    "rank {rank} got an unexpected connection from a process claiming to be rank {q}"
                )));
            }
            streams[q] = Some(s);
        }
    }
    build(rank, world, timeout, streams, blame)
}

fn words<const N: usize>(b: &[u8]) -> [u32; N] {
    let mut w = [0u32; N];
    for (i, x) in w.iter_mut().enumerate() {
        *x = u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    }
    w
}

fn peer_hello(rank: usize, world: usize, secret: &Secret) -> Vec<u8> {
    let mut h: Vec<u8> = [MAGIC, PROTOCOL, rank as u32, world as u32]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    h.extend_from_slice(secret);
    h
}

/// A connection accepted during set-up that has not sent its whole hello yet.
struct Pending {
    s: TcpStream,
    from: Option<SocketAddr>,
    got: Vec<u8>,
    since: Instant,
}

/// The set-up's door: accepts connections on a non-blocking listener and hands out
/// those whose hello (`words` `u32`s: the magic, the protocol, ...; then the secret)
/// proves the job's secret. Hellos are read from every waiting connection at once,
/// so a stranger that connects and says nothing (or too little) holds up nobody:
/// it is dropped after [`HELLO_TIMEOUT`].
struct Door<'l> {
    listener: &'l TcpListener,
    /// Bytes of a hello: the words, then the secret.
    len: usize,
    secret: &'l Secret,
    /// Who is listening (for the log).
    who: String,
    pending: Vec<Pending>,
}

impl<'l> Door<'l> {
    fn new(listener: &'l TcpListener, words: usize, secret: &'l Secret, who: String) -> Door<'l> {
        Door {
            listener,
            len: 4 * words + SECRET_LEN,
            secret,
            who,
            pending: Vec::new(),
        }
    }

    /// The next connection with a hello that proves the secret, and its hello
    /// (blocking again); a timeout naming `what` at `deadline`.
    fn next(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<(TcpStream, Vec<u8>), Error> {
        loop {
            let mut busy = false;
            // Everyone at the door comes in.
            loop {
                match self.listener.accept() {
                    Ok((s, from)) => {
                        busy = true;
                        if s.set_nonblocking(true).is_err() {
                            continue;
                        }
                        if self.pending.len() >= MAX_PENDING {
                            self.pending.remove(0);
                        }
                        self.pending.push(Pending {
                            s,
                            from: Some(from),
                            got: Vec::with_capacity(self.len),
                            since: Instant::now(),
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    // A connection that failed before it was accepted, or a
                    // transient shortage: try again on the next round.
                    Err(_) => break,
                }
            }
            // Read what each has said so far.
            let mut i = 0;
            while i < self.pending.len() {
                let p = &mut self.pending[i];
                let mut buf = [0u8; 128];
                let want = self.len - p.got.len();
                let keep = match p.s.read(&mut buf[..want.min(128)]) {
                    Ok(0) => false,
                    Ok(k) => {
                        busy = true;
                        p.got.extend_from_slice(&buf[..k]);
                        true
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        p.since.elapsed() < HELLO_TIMEOUT
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => true,
                    Err(_) => false,
                };
                if !keep {
                    self.pending.swap_remove(i);
                    continue;
                }
                if p.got.len() < self.len {
                    i += 1;
                    continue;
                }
                let p = self.pending.swap_remove(i);
                let [magic, proto] = words(&p.got);
                if magic != MAGIC || proto != PROTOCOL {
                    continue; // not one of ours
                }
                if !same_secret(&p.got[self.len - SECRET_LEN..], self.secret) {
                    let from = p
                        .from
                        .map_or("an unknown address".to_string(), |a| a.to_string());
                    log(&format!(
                        "mpipe: {}: rejected a connection from {from}: its hello does not \
                         carry this job's rendezvous secret ({SECRET_VAR}); not one of this \
                         job's ranks",
                        self.who
                    ));
                    continue;
                }
                if p.s.set_nonblocking(false).is_err() {
                    continue;
                }
                return Ok((p.s, p.got));
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    after: timeout,
                    waiting_for: what(),
                });
            }
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Rank 0: collects every rank's listener port at `master`, then sends everyone the
/// table.
fn serve_table(
    master: SocketAddr,
    bound: Option<TcpListener>,
    world: usize,
    my_port: u16,
    deadline: Instant,
    timeout: Duration,
    secret: &Secret,
) -> Result<Vec<u16>, Error> {
    let listener = match bound {
        Some(l) => l,
        None => TcpListener::bind(master).map_err(|e| {
            Error::io(
                format!("rank 0: cannot listen on {master} (MASTER_ADDR:MASTER_PORT)"),
                e,
            )
        })?,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    let mut ports = vec![0u16; world];
    ports[0] = my_port;
    let mut registered: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut door = Door::new(&listener, 5, secret, format!("rank 0 at {master}"));
    while registered[1..].iter().any(Option::is_none) {
        let missing: Vec<usize> = (1..world).filter(|&q| registered[q].is_none()).collect();
        let (s, h) = door.next(deadline, timeout, &|| {
            format!("ranks {missing:?} to register with rank 0 at {master}")
        })?;
        let [_, _, q, w, port] = words(&h);
        let (q, w) = (q as usize, w as usize);
        if w != world {
            return Err(Error::Setup(format!(
                "rank {q} registered with a world of {w} ranks, rank 0 has {world}"
            )));
        }
        if q == 0 || q >= world || registered[q].is_some() {
            return Err(Error::Setup(format!(
                "a second process registered as rank {q} (world of {world})"
            )));
        }
        ports[q] = port as u16;
        registered[q] = Some(s);
    }
    let mut table: Vec<u8> = [MAGIC, world as u32]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    table.extend_from_slice(secret);
    for p in &ports {
        table.extend_from_slice(&u32::from(*p).to_le_bytes());
    }
    for (q, s) in registered.iter_mut().enumerate() {
        if let Some(s) = s {
            s.write_all(&table).map_err(|e| {
                Error::io(format!("rank 0: sending the address table to rank {q}"), e)
            })?;
        }
    }
    Ok(ports)
}

/// Rank > 0: registers with rank 0 and waits for the table of ports.
fn register(
    rank: usize,
    world: usize,
    master: SocketAddr,
    my_port: u16,
    deadline: Instant,
    timeout: Duration,
    secret: &Secret,
) -> Result<Vec<u16>, Error> {
    let what =
        || format!("rank {rank}: registering with rank 0 at {master} (MASTER_ADDR:MASTER_PORT)");
    let mut s = connect_retry(master, deadline, timeout, &what)?;
    let mut hello: Vec<u8> = [
        MAGIC,
        PROTOCOL,
        rank as u32,
        world as u32,
        u32::from(my_port),
    ]
    .iter()
    .flat_map(|w| w.to_le_bytes())
    .collect();
    hello.extend_from_slice(secret);
    s.write_all(&hello).map_err(|e| Error::io(what(), e))?;
    let mut table = vec![0u8; 8 + SECRET_LEN + 4 * world];
    read_exact_until(&mut s, &mut table, deadline).map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::Timeout {
            after: timeout,
            waiting_for: format!("the address table from rank 0 at {master} (rank {rank} registered; some other rank did not)"),
        },
        _ => Error::io(format!("rank {rank}: reading the address table from rank 0"), e),
    })?;
    let [magic, w] = words(&table);
    if magic != MAGIC || w as usize != world || !same_secret(&table[8..8 + SECRET_LEN], secret) {
        return Err(Error::Setup(format!(
            "rank {rank}: bad address table from {master} (another program on MASTER_PORT, \
             or a rank 0 of another job: check {SECRET_VAR})"
        )));
    }
    Ok(table[8 + SECRET_LEN..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u16)
        .collect())
}

/// Connects to `addr`, retrying (rank 0 or the peer may not listen yet) until
/// `deadline`.
fn connect_retry(
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
    what: &dyn Fn() -> String,
) -> Result<TcpStream, Error> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
        ) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                after: timeout,
                waiting_for: format!("{} (last error: {last})", what()),
            });
        }
        std::thread::sleep(Duration::from_millis(10).min(left));
    }
}

fn read_exact_until(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    s.read_exact(buf)?;
    s.set_read_timeout(None)
}

fn build(
    rank: usize,
    world: usize,
    timeout: Duration,
    streams: Vec<Option<TcpStream>>,
    blame: Option<std::path::PathBuf>,
) -> Result<TcpComm, Error> {
    let inbox = Arc::new(Inbox::new(rank, world, blame));
    let mut writers = Vec::with_capacity(world);
    let mut closers = Vec::with_capacity(world);
    for (peer, s) in streams.into_iter().enumerate() {
        let Some(s) = s else {
            writers.push(None);
            closers.push(None);
            continue;
        };
        let io_err = |e| {
            Error::io(
                format!("rank {rank}: setting up the connection to rank {peer}"),
                e,
            )
        };
        s.set_nodelay(true).map_err(io_err)?;
        s.set_read_timeout(None).map_err(io_err)?;
        s.set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(io_err)?;
        let reader = s.try_clone().map_err(io_err)?;
        let closer = s.try_clone().map_err(io_err)?;
        let inbox = inbox.clone();
        std::thread::Builder::new()
            .name(format!("mpipe-comm {rank}<-{peer}"))
            .spawn(move || read_loop(peer, reader, inbox))
            .map_err(io_err)?;
        writers.push(Some(Mutex::new(s)));
        closers.push(Some(closer));
    }
    let link = Arc::new(TcpLink { writers, closers });
    Ok(TcpComm {
        ep: Endpoint::new(rank, world, timeout, inbox, link),
    })
}

/// A loopback port free at the time of the call (bound to port 0, then released).
pub fn free_port() -> Result<u16, Error> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::io("binding 127.0.0.1:0", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("listener address", e))
}

/// Connects `n` ranks as threads of this process, for tests and single-process runs
/// over real sockets. Rank 0's master listener is bound (to a free port) before
/// any rank starts, so concurrent worlds never share a master port.
pub fn world(n: usize, timeout: Duration) -> Result<Vec<TcpComm>, Error> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::io("binding 127.0.0.1:0", e))?;
    let master = listener
        .local_addr()
        .map_err(|e| Error::io("listener address", e))?;
    let mut bound = Some(listener);
    let secret = new_secret()
        .map_err(|e| Error::io("reading the system's random source for a secret", e))
        .and_then(|t| parse_secret(&t))?;
    let secret = &secret;
    let comms: Vec<Result<TcpComm, Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let mine = if r == 0 { bound.take() } else { None };
                s.spawn(move || connect_noting_blame(r, n, master, mine, timeout, None, secret))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Setup("a connecting thread panicked".into())))
            })
            .collect()
    });
    comms.into_iter().collect()
}

/// Runs `f` on each rank of a new loopback-TCP [`world`] of `n` ranks (threads of
/// this process), like [`crate::host::threads::run_ranks`]. If the world cannot be
/// set up, every rank's outcome is that error.
pub fn run_ranks<F, T, E>(n: usize, timeout: Duration, f: F) -> Vec<Result<T, String>>
where
    F: Fn(TcpComm) -> Result<T, E> + Sync,
    T: Send,
    E: std::fmt::Display,
{
    match world(n, timeout) {
        Ok(comms) => run_comms(comms, f),
        Err(e) => (0..n).map(|_| Err(e.to_string())).collect(),
    }
}
