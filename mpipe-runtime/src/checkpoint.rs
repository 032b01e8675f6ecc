//! Checkpoints: one rank's training state in a file, and a checkpoint *set* (every
//! rank's file plus a manifest) that a run writes collectively and resumes from.
//!
//! # What is saved
//!
//! A [`RankState`]: the rank's *home* units (each unit's flat parameters and, for a
//! trained unit, its optimizer state: a step count and named tensors such as Adam's
//! `m` and `v`), the number of completed steps, the position in the data stream and
//! a caller-chosen fingerprint of what was being trained (program, model, optimizer
//! and data settings), so that a checkpoint is never resumed into something else.
//! Copies of a unit on other ranks (a transposed encoder computed everywhere) are
//! not saved: the program's `BCAST` refreshes them from the home rank before each
//! step uses them.
//!
//! # Layout of a set
//!
//! ```text
//! DIR/manifest                    the last complete set (written last, by rank 0)
//! DIR/step-00000010/rank-0.ckpt   rank 0's state after 10 steps
//! DIR/step-00000010/rank-1.ckpt   ...
//! ```
//!
//! [`save_set`] is collective: every rank writes its own file atomically, all meet at
//! a barrier, then rank 0 reads every file back (checking it), writes the manifest
//! atomically, and removes the step directories older than the new one. A set is
//! complete exactly when the manifest names it, so a run killed while saving resumes
//! from the previous complete set, and a half-written set is never taken for one.
//! [`load_set`] reads the manifest and the rank's file and checks them against each
//! other (step, world, size, checksum).
//!
//! # File format (version 1)
//!
//! Little-endian throughout:
//!
//! | offset | size | field |
//! | ---: | ---: | --- |
//! | 0 | 8 | magic `MPIPECKP` |
//! | 8 | 4 | format version (`u32`, 1) |
//! | 12 | 4 | reserved (`u32`, 0) |
//! | 16 | 8 | body length `N` in bytes (`u64`) |
//! | 24 | N | body |
//! | 24 + N | 8 | checksum: 64-bit FNV-1a of bytes `0 .. 24 + N` |
//!
//! The body: `rank` (`u32`), `world` (`u32`), `step` (`u64`), `data_position`
//! (`u64`), `fingerprint` (`u64`), the number of units (`u32`), then per unit: its
//! id (`u32`), its name (a *string*: `u32` byte length, UTF-8), its parameters (a
//! *vector*: `u64` count, then that many `f32`), and an optimizer flag (`u8`: 0
//! for none, or 1 followed by the optimizer's step (`u64`), its number of tensors
//! (`u32`) and each tensor's name (string) and values (vector)). Parameters are
//! stored as their exact bits, so a restored run continues bit for bit. Every
//! parameter and optimizer value must be finite: [`save`] refuses and [`decode`]
//! rejects a `NaN` or an infinity, naming the unit and the tensor
//! ([`Problem::NonFinite`]).
//!
//! # Manifest format
//!
//! A text file:
//!
//! ```text
//! mpipe-checkpoint-manifest 1
//! step 10
//! world 4
//! fingerprint 0123456789abcdef
//! rank 0 step-00000010/rank-0.ckpt 1234 89abcdef01234567
//! ...
//! ```
//!
//! one `rank` line per rank: the file (relative to the directory), its size in bytes
//! and its checksum (hex).
//!
//! Every write goes to a temporary file in the same directory, is flushed to disk
//! (`fsync`), then renamed over the target, and the directory is synced: a reader
//! sees the old file or the new one, never a part.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::comm::Comm;
use crate::UnitId;

/// The first 8 bytes of a checkpoint file.
pub const MAGIC: [u8; 8] = *b"MPIPECKP";
/// The file format version this build writes and reads.
pub const VERSION: u32 = 1;
/// The first line of a manifest (followed by a space and the version).
pub const MANIFEST_MAGIC: &str = "mpipe-checkpoint-manifest";
/// The manifest's file name in a checkpoint directory.
pub const MANIFEST: &str = "manifest";

const HEADER: usize = 24;
const TRAILER: usize = 8;

/// One rank's training state.
#[derive(Clone, Debug, PartialEq)]
pub struct RankState {
    pub rank: usize,
    pub world: usize,
    /// Completed training steps: a resumed run continues with step `step`.
    pub step: u64,
    /// Position in the data stream: the index of the next batch to read.
    pub data_position: u64,
    /// What was trained (see [`fingerprint`]); a resume checks it.
    pub fingerprint: u64,
    /// The rank's home units, in any order (by convention, increasing ids).
    pub units: Vec<UnitState>,
}

/// One unit's state.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitState {
    pub unit: UnitId,
    /// The unit's name in the program (checked on resume).
    pub name: String,
    pub params: Vec<f32>,
    /// The optimizer's state for the unit (`None` for a frozen unit, or one the
    /// optimizer has not stepped yet).
    pub optim: Option<OptimState>,
}

/// An optimizer's state for one unit.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimState {
    /// Updates applied so far (Adam's `t`).
    pub step: u64,
    /// Named state tensors (Adam: `m`, `v`).
    pub tensors: Vec<(String, Vec<f32>)>,
}

/// A checkpoint error: which file, and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {}: {problem}", path.display())]
pub struct CheckpointError {
    pub path: PathBuf,
    pub problem: Problem,
}

/// What is wrong with a checkpoint file or set.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    /// The file does not exist.
    #[error("does not exist{0}")]
    Missing(String),
    /// Reading or writing failed.
    #[error("cannot {action}: {source}")]
    Io {
        action: String,
        #[source]
        source: io::Error,
    },
    /// The file does not start with [`MAGIC`] (or the manifest line).
    #[error("not an mpipe checkpoint file (it starts with {found}, expected {expected})")]
    NotACheckpoint { found: String, expected: String },
    /// Written by an incompatible version of the format.
    #[error("format version {found}; this build reads version {VERSION}")]
    Version { found: u32 },
    /// Shorter than its header says (a write was cut short).
    #[error("truncated: the file has {len} bytes, its header announces {expected}")]
    Truncated { len: u64, expected: u64 },
    /// Longer than its header says.
    #[error("{extra} unexpected bytes after the end the header announces")]
    Trailing { extra: u64 },
    /// The contents do not match the stored checksum.
    #[error("corrupt: the checksum stored is {stored:016x}, the contents give {computed:016x}")]
    Checksum { stored: u64, computed: u64 },
    /// The contents cannot be decoded.
    #[error("malformed at byte {offset}: {what}")]
    Malformed { offset: usize, what: String },
    /// A parameter or optimizer value that is not a finite number: training from it
    /// gives `NaN` at every step.
    #[error(
        "{tensor} holds {value} at index {index}: not a finite number, so training \
         from it cannot work (it diverged before the checkpoint was saved, or the file \
         was altered); resume from an earlier checkpoint set or start again"
    )]
    NonFinite {
        /// Which tensor: "unit `vision`'s parameters", "unit `vision`'s optimizer
        /// tensor `m`".
        tensor: String,
        index: usize,
        value: f32,
    },
    /// A well-formed file that does not belong where it is used (another rank,
    /// another world size, another program or model).
    #[error("{0}")]
    Mismatch(String),
    /// The set is not complete (no manifest, or files the manifest does not vouch
    /// for).
    #[error("{0}")]
    Incomplete(String),
}

impl CheckpointError {
    pub fn new(path: impl Into<PathBuf>, problem: Problem) -> CheckpointError {
        CheckpointError {
            path: path.into(),
            problem,
        }
    }

    fn io(path: &Path, action: impl Into<String>, source: io::Error) -> CheckpointError {
        let problem = if source.kind() == io::ErrorKind::NotFound {
            Problem::Missing(String::new())
        } else {
            Problem::Io {
                action: action.into(),
                source,
            }
        };
        CheckpointError::new(path, problem)
    }
}

/// 64-bit FNV-1a of `bytes`, continuing from `state` (start with [`FNV_OFFSET`]).
pub fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    let mut h = state;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a's initial state.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A fingerprint of whatever identifies a run (e.g. the program's JSON and the
/// model and optimizer settings): FNV-1a over each part, with the part lengths.
pub fn fingerprint<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = FNV_OFFSET;
    for p in parts {
        h = fnv1a(h, &(p.len() as u64).to_le_bytes());
        h = fnv1a(h, p);
    }
    h
}

// ---------------------------------------------------------------------------
// Encoding.

fn put_u32(b: &mut Vec<u8>, x: u32) {
    b.extend_from_slice(&x.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, x: u64) {
    b.extend_from_slice(&x.to_le_bytes());
}
fn put_str(b: &mut Vec<u8>, s: &str) {
    put_u32(b, s.len() as u32);
    b.extend_from_slice(s.as_bytes());
}
fn put_vec(b: &mut Vec<u8>, v: &[f32]) {
    put_u64(b, v.len() as u64);
    b.reserve(4 * v.len());
    for x in v {
        b.extend_from_slice(&x.to_bits().to_le_bytes());
    }
}

/// The bytes of `state`'s checkpoint file (header, body, checksum).
pub fn encode(state: &RankState) -> Vec<u8> {
    let mut b = Vec::with_capacity(
        HEADER
            + 64
            + state
                .units
                .iter()
                .map(|u| {
                    64 + 4 * u.params.len()
                        + u.optim
                            .as_ref()
                            .map_or(0, |o| o.tensors.iter().map(|(_, t)| 32 + 4 * t.len()).sum())
                })
                .sum::<usize>()
            + TRAILER,
    );
    b.extend_from_slice(&MAGIC);
    put_u32(&mut b, VERSION);
    put_u32(&mut b, 0);
    put_u64(&mut b, 0); // body length, filled in below
    put_u32(&mut b, state.rank as u32);
    put_u32(&mut b, state.world as u32);
    put_u64(&mut b, state.step);
    put_u64(&mut b, state.data_position);
    put_u64(&mut b, state.fingerprint);
    put_u32(&mut b, state.units.len() as u32);
    for u in &state.units {
        put_u32(&mut b, u.unit);
        put_str(&mut b, &u.name);
        put_vec(&mut b, &u.params);
        match &u.optim {
            None => b.push(0),
            Some(o) => {
                b.push(1);
                put_u64(&mut b, o.step);
                put_u32(&mut b, o.tensors.len() as u32);
                for (name, t) in &o.tensors {
                    put_str(&mut b, name);
                    put_vec(&mut b, t);
                }
            }
        }
    }
    let body = (b.len() - HEADER) as u64;
    b[16..24].copy_from_slice(&body.to_le_bytes());
    let sum = fnv1a(FNV_OFFSET, &b);
    put_u64(&mut b, sum);
    b
}

/// A cursor over a body, with errors that say where.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    /// Offset of `b[0]` in the file.
    base: usize,
}

impl Reader<'_> {
    fn err(&self, what: impl Into<String>) -> Problem {
        Problem::Malformed {
            offset: self.base + self.at,
            what: what.into(),
        }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], Problem> {
        if self.b.len() - self.at < n {
            return Err(self.err(format!(
                "{what} needs {n} bytes, {} are left",
                self.b.len() - self.at
            )));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, Problem> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, Problem> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, Problem> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<String, Problem> {
        let n = self.u32(what)? as usize;
        let at = self.at;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| Problem::Malformed {
            offset: self.base + at,
            what: format!("{what} is not UTF-8"),
        })
    }
    fn vector(&mut self, what: &str) -> Result<Vec<f32>, Problem> {
        let n = self.u64(what)?;
        let left = (self.b.len() - self.at) as u64;
        if n > left / 4 {
            return Err(self.err(format!(
                "{what} announces {n} values, only {left} bytes are left"
            )));
        }
        let s = self.take(4 * n as usize, what)?;
        Ok(s.chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect())
    }
}

/// Decodes a checkpoint file's bytes (checking magic, version, length and checksum).
pub fn decode(bytes: &[u8]) -> Result<RankState, Problem> {
    if bytes.len() < 8 || bytes[..8] != MAGIC {
        let head = &bytes[..bytes.len().min(8)];
        return Err(Problem::NotACheckpoint {
            found: if head.is_empty() {
                "nothing (the file is empty)".to_string()
            } else {
                format!("{:?}", String::from_utf8_lossy(head))
            },
            expected: format!("{:?}", String::from_utf8_lossy(&MAGIC)),
        });
    }
    if bytes.len() < HEADER {
        return Err(Problem::Truncated {
            len: bytes.len() as u64,
            expected: HEADER as u64 + TRAILER as u64,
        });
    }
    let mut r = Reader {
        b: &bytes[..HEADER],
        at: 8,
        base: 0,
    };
    let version = r.u32("the version")?;
    if version != VERSION {
        return Err(Problem::Version { found: version });
    }
    let _reserved = r.u32("the reserved word")?;
    let body = r.u64("the body length")?;
    let expected = (HEADER as u64)
        .saturating_add(body)
        .saturating_add(TRAILER as u64);
    let len = bytes.len() as u64;
    if len < expected {
        return Err(Problem::Truncated { len, expected });
    }
    if len > expected {
        return Err(Problem::Trailing {
            extra: len - expected,
        });
    }
    let end = HEADER + body as usize;
    let mut s = [0u8; 8];
    s.copy_from_slice(&bytes[end..]);
    let stored = u64::from_le_bytes(s);
    let computed = fnv1a(FNV_OFFSET, &bytes[..end]);
    if stored != computed {
        return Err(Problem::Checksum { stored, computed });
    }
    let mut r = Reader {
        b: &bytes[HEADER..end],
        at: 0,
        base: HEADER,
    };
    let rank = r.u32("the rank")? as usize;
    let world = r.u32("the world size")? as usize;
    let step = r.u64("the step")?;
    let data_position = r.u64("the data position")?;
    let fingerprint = r.u64("the fingerprint")?;
    let n = r.u32("the unit count")?;
    let mut units = Vec::new();
    for i in 0..n {
        let unit = r.u32(&format!("unit {i}'s id"))?;
        let name = r.string(&format!("unit {i}'s name"))?;
        let params = r.vector(&format!("unit `{name}`'s parameters"))?;
        let optim = match r.u8(&format!("unit `{name}`'s optimizer flag"))? {
            0 => None,
            1 => {
                let step = r.u64(&format!("unit `{name}`'s optimizer step"))?;
                let k = r.u32(&format!("unit `{name}`'s optimizer tensor count"))?;
                let mut tensors = Vec::new();
                for j in 0..k {
                    let tn = r.string(&format!("unit `{name}`'s optimizer tensor {j} name"))?;
                    let t = r.vector(&format!("unit `{name}`'s optimizer tensor `{tn}`"))?;
                    tensors.push((tn, t));
                }
                Some(OptimState { step, tensors })
            }
            f => return Err(r.err(format!("unit `{name}`'s optimizer flag is {f}, not 0 or 1"))),
        };
        let unit_state = UnitState {
            unit,
            name,
            params,
            optim,
        };
        check_finite(&unit_state)?;
        units.push(unit_state);
    }
    if r.at != r.b.len() {
        return Err(r.err(format!(
            "{} bytes left after the last unit",
            r.b.len() - r.at
        )));
    }
    Ok(RankState {
        rank,
        world,
        step,
        data_position,
        fingerprint,
        units,
    })
}

/// Every parameter and optimizer value of `u` is finite ([`Problem::NonFinite`]
/// names the first that is not).
pub fn check_finite(u: &UnitState) -> Result<(), Problem> {
    let first_bad = |v: &[f32]| v.iter().position(|x| !x.is_finite());
    if let Some(index) = first_bad(&u.params) {
        return Err(Problem::NonFinite {
            tensor: format!("unit `{}`'s parameters", u.name),
            index,
            value: u.params[index],
        });
    }
    for (tn, t) in u.optim.iter().flat_map(|o| &o.tensors) {
        if let Some(index) = first_bad(t) {
            return Err(Problem::NonFinite {
                tensor: format!("unit `{}`'s optimizer tensor `{tn}`", u.name),
                index,
                value: t[index],
            });
        }
    }
    Ok(())
}

/// The checksum stored in a checkpoint file's bytes (its last 8), if long enough.
fn stored_checksum(bytes: &[u8]) -> Option<u64> {
    let tail = bytes.get(bytes.len().checked_sub(TRAILER)?..)?;
    let mut s = [0u8; 8];
    s.copy_from_slice(tail);
    Some(u64::from_le_bytes(s))
}

// ---------------------------------------------------------------------------
// Files.

/// Syncs a directory, so that a rename in it survives a crash (a no-op where
/// directories cannot be opened).
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory,
/// `fsync`, rename over `path`, sync the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let io_err = |action: &str, e| CheckpointError::io(path, action, e);
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(CheckpointError::new(
            path,
            Problem::Io {
                action: format!("write the temporary file {}", tmp.display()),
                source: e,
            },
        ));
    }
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("rename the temporary file over it", e));
    }
    sync_dir(&dir).map_err(|e| io_err("sync its directory", e))
}

/// Saves `state` to `path` atomically (see [`write_atomic`]); returns the file's
/// size and checksum. A state with a value that is not finite is refused
/// ([`Problem::NonFinite`]) and nothing is written.
pub fn save(path: &Path, state: &RankState) -> Result<(u64, u64), CheckpointError> {
    // A state no load would accept is not written (nor does it replace a good file).
    for u in &state.units {
        check_finite(u).map_err(|e| CheckpointError::new(path, e))?;
    }
    let bytes = encode(state);
    write_atomic(path, &bytes)?;
    Ok((bytes.len() as u64, stored_checksum(&bytes).unwrap_or(0)))
}

fn read_file(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let mut f = File::open(path).map_err(|e| CheckpointError::io(path, "open it", e))?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| CheckpointError::io(path, "read it", e))?;
    Ok(bytes)
}

/// Loads one checkpoint file.
pub fn load(path: &Path) -> Result<RankState, CheckpointError> {
    let bytes = read_file(path)?;
    decode(&bytes).map_err(|p| CheckpointError::new(path, p))
}

// ---------------------------------------------------------------------------
// Sets.

/// The directory of the set of step `step` in `dir`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// Rank `rank`'s file name in a step directory.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank}.ckpt")
}

/// One rank's entry in a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestEntry {
    /// The file, relative to the checkpoint directory.
    pub file: String,
    pub size: u64,
    pub checksum: u64,
}

/// The record of a complete set (see the module documentation for its format).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub step: u64,
    pub world: usize,
    pub fingerprint: u64,
    /// One entry per rank, in rank order.
    pub ranks: Vec<ManifestEntry>,
}

impl Manifest {
    /// The manifest's text.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "{MANIFEST_MAGIC} {VERSION}\nstep {}\nworld {}\nfingerprint {:016x}\n",
            self.step, self.world, self.fingerprint
        );
        for (r, e) in self.ranks.iter().enumerate() {
            s.push_str(&format!(
                "rank {r} {} {} {:016x}\n",
                e.file, e.size, e.checksum
            ));
        }
        s
    }

    /// Parses a manifest's text.
    pub fn parse(text: &str) -> Result<Manifest, Problem> {
        let bad = |line: usize, what: String| Problem::Malformed {
            offset: line,
            what: format!("(line {}) {what}", line + 1),
        };
        let mut lines = text.lines().enumerate();
        let first = lines.next().map_or("", |(_, l)| l);
        let mut head = first.split_whitespace();
        if head.next() != Some(MANIFEST_MAGIC) {
            return Err(Problem::NotACheckpoint {
                found: format!("{:?}", first.chars().take(40).collect::<String>()),
                expected: format!("{MANIFEST_MAGIC:?}"),
            });
        }
        let version: u32 = head
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(0, "no version after the magic word".into()))?;
        if version != VERSION {
            return Err(Problem::Version { found: version });
        }
        let (mut step, mut world, mut fp) = (None, None, None);
        let mut ranks: Vec<Option<ManifestEntry>> = Vec::new();
        for (i, line) in lines {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                [] => {}
                ["step", s] => step = Some(s.parse().map_err(|_| bad(i, format!("step {s:?}")))?),
                ["world", s] => {
                    world = Some(s.parse().map_err(|_| bad(i, format!("world {s:?}")))?)
                }
                ["fingerprint", s] => {
                    fp = Some(
                        u64::from_str_radix(s, 16)
                            .map_err(|_| bad(i, format!("fingerprint {s:?}")))?,
                    )
                }
                ["rank", r, file, size, sum] => {
                    let r: usize = r.parse().map_err(|_| bad(i, format!("rank {r:?}")))?;
                    let size = size.parse().map_err(|_| bad(i, format!("size {size:?}")))?;
                    let checksum = u64::from_str_radix(sum, 16)
                        .map_err(|_| bad(i, format!("checksum {sum:?}")))?;
                    if r > 1 << 20 {
                        return Err(bad(i, format!("rank {r}")));
                    }
                    if ranks.len() <= r {
                        ranks.resize(r + 1, None);
                    }
                    ranks[r] = Some(ManifestEntry {
                        file: file.to_string(),
                        size,
                        checksum,
                    });
                }
                _ => return Err(bad(i, format!("unknown line {line:?}"))),
            }
        }
        let step = step.ok_or_else(|| bad(0, "no `step` line".into()))?;
        let world: usize = world.ok_or_else(|| bad(0, "no `world` line".into()))?;
        let fingerprint = fp.ok_or_else(|| bad(0, "no `fingerprint` line".into()))?;
        if ranks.len() != world || ranks.iter().any(Option::is_none) {
            let missing: Vec<usize> = (0..world)
                .filter(|&r| !matches!(ranks.get(r), Some(Some(_))))
                .collect();
            return Err(Problem::Incomplete(format!(
                "the manifest lists {} rank files for a world of {world} (missing ranks {missing:?})",
                ranks.iter().flatten().count()
            )));
        }
        Ok(Manifest {
            step,
            world,
            fingerprint,
            ranks: ranks.into_iter().flatten().collect(),
        })
    }

    /// Reads `dir`'s manifest.
    pub fn read(dir: &Path) -> Result<Manifest, CheckpointError> {
        let path = dir.join(MANIFEST);
        let text = match fs::read(&path) {
            Ok(b) => String::from_utf8(b).map_err(|_| {
                CheckpointError::new(
                    &path,
                    Problem::NotACheckpoint {
                        found: "bytes that are not UTF-8".into(),
                        expected: format!("{MANIFEST_MAGIC:?}"),
                    },
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(CheckpointError::new(
                    &path,
                    Problem::Missing(if dir.is_dir() {
                        ": the directory holds no complete checkpoint set (a save was never completed there)".into()
                    } else {
                        format!(": the directory {} does not exist", dir.display())
                    }),
                ))
            }
            Err(e) => return Err(CheckpointError::io(&path, "read it", e)),
        };
        Manifest::parse(&text).map_err(|p| CheckpointError::new(&path, p))
    }
}

/// Why a collective save failed: a file, or the communication between the ranks.
#[derive(Debug, thiserror::Error)]
pub enum SaveError<E: std::error::Error + 'static> {
    #[error(transparent)]
    File(#[from] CheckpointError),
    #[error("saving the checkpoint of step {step}: {source}")]
    Comm {
        step: u64,
        #[source]
        source: E,
    },
}

/// Saves every rank's state as the set of step `state.step` in `dir` (collective:
/// every rank of `comm` calls it with its own state). Returns this rank's file.
///
/// Each rank writes `dir/step-S/rank-R.ckpt` atomically; after a barrier, rank 0
/// checks every rank's file, writes `dir/manifest` atomically, and removes older
/// `step-*` directories; a second barrier makes the set complete for every rank
/// when the call returns. Ranks must share the file system (they do: the host
/// backends run on one machine).
pub fn save_set<C: Comm>(
    dir: &Path,
    comm: &mut C,
    state: &RankState,
) -> Result<PathBuf, SaveError<C::Error>> {
    let step = state.step;
    let sdir = step_dir(dir, step);
    fs::create_dir_all(&sdir).map_err(|e| CheckpointError::io(&sdir, "create it", e))?;
    let path = sdir.join(rank_file_name(state.rank));
    save(&path, state)?;
    comm.barrier()
        .map_err(|source| SaveError::Comm { step, source })?;
    if comm.rank() == 0 {
        let world = comm.world();
        let mut ranks = Vec::with_capacity(world);
        for r in 0..world {
            let p = sdir.join(rank_file_name(r));
            let bytes = read_file(&p)?;
            let st = decode(&bytes).map_err(|e| CheckpointError::new(&p, e))?;
            if st.rank != r || st.world != world || st.step != step {
                return Err(CheckpointError::new(
                    &p,
                    Problem::Mismatch(format!(
                        "holds rank {} of {} after step {}, expected rank {r} of {world} after step {step}",
                        st.rank, st.world, st.step
                    )),
                )
                .into());
            }
            ranks.push(ManifestEntry {
                file: format!(
                    "{}/{}",
                    sdir.file_name()
                        .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
                    rank_file_name(r)
                ),
                size: bytes.len() as u64,
                checksum: stored_checksum(&bytes).unwrap_or(0),
            });
        }
        let m = Manifest {
            step,
            world,
            fingerprint: state.fingerprint,
            ranks,
        };
        write_atomic(&dir.join(MANIFEST), m.to_text().as_bytes())?;
        // The new set is complete: older ones can go.
        let keep = sdir.file_name().map(|n| n.to_owned());
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name();
                let is_step = name.to_string_lossy().starts_with("step-");
                if is_step && Some(&name) != keep.as_ref() && e.path().is_dir() {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
    }
    comm.barrier()
        .map_err(|source| SaveError::Comm { step, source })?;
    Ok(path)
}

/// Loads rank `rank`'s state from the complete set in `dir`, checking it against
/// the manifest (world size, step, fingerprint, file size and checksum) and
/// against `rank`, `world` and `fingerprint`.
pub fn load_set(
    dir: &Path,
    rank: usize,
    world: usize,
    fingerprint: u64,
) -> Result<RankState, CheckpointError> {
    let m = Manifest::read(dir)?;
    let mpath = dir.join(MANIFEST);
    if m.world != world {
        return Err(CheckpointError::new(
            &mpath,
            Problem::Mismatch(format!(
                "the set was saved by {} ranks, this run has {world}",
                m.world
            )),
        ));
    }
    if m.fingerprint != fingerprint {
        return Err(CheckpointError::new(
            &mpath,
            Problem::Mismatch(format!(
                "the set was saved by a different run (fingerprint {:016x}, this run's is {fingerprint:016x}): another program, model, optimizer or data setting",
                m.fingerprint
            )),
        ));
    }
    let Some(e) = m.ranks.get(rank) else {
        return Err(CheckpointError::new(
            &mpath,
            Problem::Mismatch(format!("no rank {rank} in a set of {} ranks", m.world)),
        ));
    };
    let path = dir.join(&e.file);
    let bytes = match read_file(&path) {
        Err(CheckpointError {
            problem: Problem::Missing(_),
            ..
        }) => {
            return Err(CheckpointError::new(
                &path,
                Problem::Missing(format!(", though the manifest of step {} lists it", m.step)),
            ))
        }
        r => r?,
    };
    let st = decode(&bytes).map_err(|p| CheckpointError::new(&path, p))?;
    let sum = stored_checksum(&bytes).unwrap_or(0);
    if bytes.len() as u64 != e.size || sum != e.checksum {
        return Err(CheckpointError::new(
            &path,
            Problem::Incomplete(format!(
                "it is not the file the manifest of step {} vouches for ({} bytes, checksum {sum:016x}; the manifest says {} bytes, {:016x})",
                m.step,
                bytes.len(),
                e.size,
                e.checksum
            )),
        ));
    }
    let mismatch = |what: String| Err(CheckpointError::new(&path, Problem::Mismatch(what)));
    if st.rank != rank || st.world != world {
        return mismatch(format!(
            "it holds rank {} of {}, this is rank {rank} of {world}",
            st.rank, st.world
        ));
    }
    if st.step != m.step {
        return mismatch(format!(
            "it holds step {}, the manifest says {}",
            st.step, m.step
        ));
    }
    if st.fingerprint != fingerprint {
        return mismatch(format!(
            "it was saved by a different run (fingerprint {:016x}, this run's is {fingerprint:016x})",
            st.fingerprint
        ));
    }
    Ok(st)
}

impl fmt::Display for RankState {
    /// `rank 1 of 4 after step 10 (data position 10): units 2 (llm.1)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .units
            .iter()
            .map(|u| format!("{} ({})", u.unit, u.name))
            .collect();
        write!(
            f,
            "rank {} of {} after step {} (data position {}): units {}",
            self.rank,
            self.world,
            self.step,
            self.data_position,
            names.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> RankState {
        RankState {
            rank: 1,
            world: 4,
            step: 10,
            data_position: 10,
            fingerprint: 0xdead_beef,
            units: vec![
                UnitState {
                    unit: 0,
                    name: "vision".into(),
                    params: vec![1.0, -0.0, f32::MIN_POSITIVE, 3.5e-12],
                    optim: None,
                },
                UnitState {
                    unit: 2,
                    name: "llm.1".into(),
                    params: vec![0.25; 7],
                    optim: Some(OptimState {
                        step: 10,
                        tensors: vec![("m".into(), vec![0.5; 7]), ("v".into(), vec![1e-9; 7])],
                    }),
                },
            ],
        }
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "mpipe-ckpt-unit-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_is_bitwise() {
        let s = state();
        let b = encode(&s);
        let back = decode(&b).unwrap();
        assert_eq!(back, s);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.units[0].params), bits(&s.units[0].params));
    }

    #[test]
    fn every_damage_is_named() {
        let b = encode(&state());
        // Each single-byte flip in the body or trailer breaks the checksum; in the
        // header, the magic, version or length.
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x40;
            let e = decode(&c).expect_err("damage detected").to_string();
            assert!(!e.is_empty(), "byte {i}");
        }
        for cut in [0, 5, 8, 23, 24, b.len() / 2, b.len() - 1] {
            let e = decode(&b[..cut]).unwrap_err();
            assert!(
                matches!(
                    e,
                    Problem::Truncated { .. } | Problem::NotACheckpoint { .. }
                ),
                "cut at {cut}: {e}"
            );
        }
        let mut c = b.clone();
        c[8] = 2;
        assert!(matches!(decode(&c), Err(Problem::Version { found: 2 })));
        let mut c = b.clone();
        c[40] ^= 1;
        assert!(matches!(decode(&c), Err(Problem::Checksum { .. })));
        let mut c = b.clone();
        c.push(0);
        assert!(matches!(decode(&c), Err(Problem::Trailing { extra: 1 })));
    }

    #[test]
    fn atomic_save_and_load() {
        let d = tmpdir("file");
        let p = d.join("x.ckpt");
        save(&p, &state()).unwrap();
        assert_eq!(load(&p).unwrap(), state());
        let names: Vec<_> = fs::read_dir(&d).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "no temporary file left behind");
        let e = load(&d.join("nope.ckpt")).unwrap_err();
        assert!(matches!(e.problem, Problem::Missing(_)));
        assert!(e.to_string().contains("nope.ckpt"), "{e}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn manifest_round_trip() {
        let m = Manifest {
            step: 3,
            world: 2,
            fingerprint: 0x0123_4567_89ab_cdef,
            ranks: vec![
                ManifestEntry {
                    file: "step-00000003/rank-0.ckpt".into(),
                    size: 100,
                    checksum: 7,
                },
                ManifestEntry {
                    file: "step-00000003/rank-1.ckpt".into(),
                    size: 101,
                    checksum: u64::MAX,
                },
            ],
        };
        assert_eq!(Manifest::parse(&m.to_text()).unwrap(), m);
        let short = m.to_text().replace("rank 1 ", "# ");
        assert!(Manifest::parse(&short).is_err());
    }

    #[test]
    fn sets_over_threads() {
        use crate::host::threads::run_ranks;
        let d = tmpdir("set");
        let mk = |rank: usize, step: u64| RankState {
            rank,
            world: 3,
            step,
            data_position: step,
            fingerprint: 9,
            units: vec![UnitState {
                unit: rank as u32,
                name: format!("u{rank}"),
                params: vec![rank as f32 + step as f32; 5],
                optim: None,
            }],
        };
        for step in [2, 4] {
            let out = run_ranks(3, std::time::Duration::from_secs(10), |mut c| {
                let r = c.rank();
                save_set(&d, &mut c, &mk(r, step)).map(|_| ())
            });
            assert!(out.iter().all(Result::is_ok), "{out:?}");
        }
        for r in 0..3 {
            assert_eq!(load_set(&d, r, 3, 9).unwrap(), mk(r, 4));
        }
        assert!(!step_dir(&d, 2).exists(), "the older set is removed");
        let e = load_set(&d, 0, 4, 9).unwrap_err();
        assert!(matches!(e.problem, Problem::Mismatch(_)), "{e}");
        let e = load_set(&d, 0, 3, 8).unwrap_err();
        assert!(e.to_string().contains("fingerprint"), "{e}");
        // A file replaced behind the manifest's back is not part of the set.
        save(&step_dir(&d, 4).join(rank_file_name(1)), &mk(1, 5)).unwrap();
        let e = load_set(&d, 1, 3, 9).unwrap_err();
        assert!(matches!(e.problem, Problem::Incomplete(_)), "{e}");
        fs::remove_file(d.join(MANIFEST)).unwrap();
        let e = load_set(&d, 0, 3, 9).unwrap_err();
        assert!(e.to_string().contains("no complete checkpoint set"), "{e}");
        let _ = fs::remove_dir_all(&d);
    }
}
