//! Device memory the host cannot read: opaque device addresses, their backing storage,
//! and the bounds checks every entry point makes before touching them.
//!
//! `aclrtMalloc` returns an address inside address space this module reserved with no
//! access rights (`mmap(PROT_NONE)` on Linux and macOS), so a host dereference of a
//! device pointer faults as it would on an NPU. The bytes live in a separate host
//! allocation (the *backing storage*); [`resolve`] translates a device address range
//! (any `base + offset` inside a live allocation) to it, and every emulator entry point
//! that touches device memory (copies of every kind, memset, HCCL send/receive/batch/
//! collectives, in process and, before the data goes on the wire, across processes)
//! resolves first and fails with an error code instead of touching memory it must not.
//!
//! Invariants:
//! - reserved ranges are never unmapped, so an address in them is never host memory;
//!   an address outside them is host memory, which the emulator accesses unchecked
//!   (the caller's promise, as before);
//! - allocation starts are [`ALIGN`]-aligned, and after each allocation at least
//!   [`ALIGN`] bytes stay unallocated, so `base + size` is never another allocation;
//! - an access must lie within one live allocation: past its end is
//!   [`MemError::OutOfBounds`], into a freed one [`MemError::Freed`], elsewhere
//!   [`MemError::Unknown`];
//! - a freed range is not handed out again until later frees have pushed it out of a
//!   quarantine ([`QUARANTINE_BYTES`] / [`QUARANTINE_ENTRIES`]), so a recent use after
//!   free is reported as such; after that the range is reused (as on a device, a very
//!   stale pointer may then alias a new allocation);
//! - work queued on a stream holds an `Arc` of each [`Allocation`] it touches, so its
//!   backing storage outlives `aclrtFree` until the work has run (the checker of
//!   [`super::hazards`] reports such a free; the emulator stays memory-safe).

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, RwLock};

/// Alignment of every allocation's start (the reference promises at least 32 bytes).
pub const ALIGN: usize = 512;
/// Address space reserved at a time.
const CHUNK: usize = 64 << 30;
/// Freed ranges kept out of reuse: at most this many bytes...
pub const QUARANTINE_BYTES: usize = 4 << 30;
/// ...and this many allocations.
pub const QUARANTINE_ENTRIES: usize = 16_384;

/// One `aclrtMalloc` allocation: its device address and its backing storage.
pub(crate) struct Allocation {
    /// Allocation number in this process (1, 2, ...), for reports.
    pub(crate) id: u64,
    /// The device address handed out.
    pub(crate) base: usize,
    /// Bytes requested.
    pub(crate) size: usize,
    /// The device the allocating thread was bound to, if any.
    pub(crate) device: Option<i32>,
    storage: *mut u8,
    layout: Layout,
}

// SAFETY: `storage` is owned by the allocation and only reached through it; the bytes
// are plain data copied with raw copies (racing copies are the program's hazard, which
// the checker reports, and at worst leave unspecified bytes).
unsafe impl Send for Allocation {}
// SAFETY: as above.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// The backing address of device address `base + offset`.
    pub(crate) fn backing(&self, offset: usize) -> usize {
        self.storage as usize + offset
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `malloc` with this layout, dropped once.
        unsafe { std::alloc::dealloc(self.storage, self.layout) };
    }
}

/// Why a device address range cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemError {
    /// In device address space but in no allocation (never allocated, a guard gap, or
    /// freed long ago).
    Unknown { addr: usize },
    /// Inside an allocation already freed.
    Freed { addr: usize, id: u64 },
    /// Starts in an allocation but ends past it.
    OutOfBounds {
        addr: usize,
        len: usize,
        id: u64,
        base: usize,
        size: usize,
    },
    /// A device address where the call needs host memory, or the reverse.
    WrongSide { addr: usize, device_expected: bool },
}

impl fmt::Display for MemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MemError::Unknown { addr } => {
                write!(f, "{addr:#x} is device address space but no allocation")
            }
            MemError::Freed { addr, id } => {
                write!(f, "{addr:#x} is in allocation #{id}, already freed")
            }
            MemError::OutOfBounds {
                addr,
                len,
                id,
                base,
                size,
            } => write!(
                f,
                "{len} bytes at {addr:#x} (offset {}) run past the end of allocation #{id} \
                 ({size} bytes at {base:#x})",
                addr - base
            ),
            MemError::WrongSide {
                addr,
                device_expected: true,
            } => write!(f, "{addr:#x} is not device memory (aclrtMalloc)"),
            MemError::WrongSide { addr, .. } => {
                write!(
                    f,
                    "{addr:#x} is device memory where host memory is expected"
                )
            }
        }
    }
}

impl std::error::Error for MemError {}

/// A resolved range: device memory (with the allocation kept alive) or host memory.
#[derive(Clone)]
pub(crate) struct Span {
    /// The allocation, for device memory.
    pub(crate) alloc: Option<Arc<Allocation>>,
    /// Offset into the allocation (device) or 0 (host).
    pub(crate) offset: usize,
    /// Where the bytes are: backing storage (device) or the host address itself.
    pub(crate) ptr: usize,
    pub(crate) len: usize,
}

impl Span {
    /// An empty host span (no memory).
    pub(crate) fn none() -> Span {
        Span {
            alloc: None,
            offset: 0,
            ptr: 0,
            len: 0,
        }
    }
}

enum Entry {
    Live(Arc<Allocation>),
    Freed { id: u64, size: usize },
}

#[derive(Default)]
struct Space {
    /// Reserved ranges (start, length); never unmapped.
    chunks: Vec<(usize, usize)>,
    /// Unallocated ranges inside `chunks`: start -> length, coalesced.
    free: BTreeMap<usize, usize>,
    /// Allocations by base address: live, and freed ones still in quarantine.
    table: BTreeMap<usize, Entry>,
    /// Freed ranges (base, reserved length) in the order freed.
    quarantine: VecDeque<(usize, usize)>,
    quarantined: usize,
    next_id: u64,
}

fn space() -> &'static RwLock<Space> {
    static S: std::sync::OnceLock<RwLock<Space>> = std::sync::OnceLock::new();
    S.get_or_init(Default::default)
}

fn read() -> std::sync::RwLockReadGuard<'static, Space> {
    space().read().unwrap_or_else(|e| e.into_inner())
}

fn write() -> std::sync::RwLockWriteGuard<'static, Space> {
    space().write().unwrap_or_else(|e| e.into_inner())
}

impl Space {
    fn reserved(&self, addr: usize) -> bool {
        self.chunks.iter().any(|&(s, l)| addr >= s && addr - s < l)
    }

    /// First fit of `need` bytes; reserves another chunk when none fits.
    fn place(&mut self, need: usize) -> Option<usize> {
        let fit = self
            .free
            .iter()
            .find(|&(_, &len)| len >= need)
            .map(|(&s, &l)| (s, l));
        let (start, len) = match fit {
            Some(f) => f,
            None => {
                let (start, len) = os::reserve(need.max(CHUNK).next_multiple_of(2 << 20))
                    .or_else(|| os::reserve(need))?;
                self.chunks.push((start, len));
                (start, len)
            }
        };
        self.free.remove(&start);
        if len > need {
            self.free.insert(start + need, len - need);
        }
        Some(start)
    }

    /// Returns `[start, start + len)` to the free ranges, merging with neighbours.
    fn unplace(&mut self, mut start: usize, mut len: usize) {
        if let Some((&s, &l)) = self.free.range(..start).next_back() {
            if s + l == start {
                self.free.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(l) = self.free.remove(&(start + len)) {
            len += l;
        }
        self.free.insert(start, len);
    }
}

/// Bytes of address space an allocation of `size` takes (with its guard gap).
fn footprint(size: usize) -> Option<usize> {
    size.checked_next_multiple_of(ALIGN)?.checked_add(ALIGN)
}

/// A new zeroed allocation of `size` (> 0) bytes for `device`.
pub(crate) fn malloc(size: usize, device: Option<i32>) -> Option<Arc<Allocation>> {
    let need = footprint(size)?;
    let layout = Layout::from_size_align(size, 64).ok()?;
    // SAFETY: `size > 0` (checked by the caller).
    let storage = unsafe { std::alloc::alloc_zeroed(layout) };
    if storage.is_null() {
        return None;
    }
    let mut s = write();
    let Some(base) = s.place(need) else {
        drop(s);
        // SAFETY: just allocated with this layout.
        unsafe { std::alloc::dealloc(storage, layout) };
        return None;
    };
    s.next_id += 1;
    let a = Arc::new(Allocation {
        id: s.next_id,
        base,
        size,
        device,
        storage,
        layout,
    });
    s.table.insert(base, Entry::Live(Arc::clone(&a)));
    Some(a)
}

/// Frees the allocation starting at `addr`; returns it (its storage lives on while
/// queued work holds it).
pub(crate) fn free(addr: usize) -> Result<Arc<Allocation>, MemError> {
    let mut s = write();
    let a = match s.table.get(&addr) {
        Some(Entry::Live(a)) => Arc::clone(a),
        Some(Entry::Freed { id, .. }) => return Err(MemError::Freed { addr, id: *id }),
        None if s.reserved(addr) => return Err(MemError::Unknown { addr }),
        None => {
            return Err(MemError::WrongSide {
                addr,
                device_expected: true,
            })
        }
    };
    s.table.insert(
        addr,
        Entry::Freed {
            id: a.id,
            size: a.size,
        },
    );
    let len = footprint(a.size).expect("placed before");
    s.quarantine.push_back((addr, len));
    s.quarantined += len;
    while s.quarantined > QUARANTINE_BYTES || s.quarantine.len() > QUARANTINE_ENTRIES {
        let Some((base, len)) = s.quarantine.pop_front() else {
            break;
        };
        s.quarantined -= len;
        s.table.remove(&base);
        s.unplace(base, len);
    }
    Ok(a)
}

/// Whether `addr` is in the emulator's device address space (reserved, inaccessible to
/// the host), allocated or not.
pub fn is_device(addr: usize) -> bool {
    read().reserved(addr)
}

/// Translates `len` bytes at `addr`: device memory must lie within one live
/// allocation; any other address is host memory, taken as is.
pub(crate) fn resolve(addr: usize, len: usize) -> Result<Span, MemError> {
    let s = read();
    if !s.reserved(addr) {
        return Ok(Span {
            alloc: None,
            offset: 0,
            ptr: addr,
            len,
        });
    }
    match s.table.range(..=addr).next_back() {
        Some((&base, Entry::Live(a))) if addr - base <= a.size => {
            let offset = addr - base;
            if len > a.size - offset {
                return Err(MemError::OutOfBounds {
                    addr,
                    len,
                    id: a.id,
                    base,
                    size: a.size,
                });
            }
            Ok(Span {
                alloc: Some(Arc::clone(a)),
                offset,
                ptr: a.backing(offset),
                len,
            })
        }
        Some((&base, &Entry::Freed { id, size })) if addr - base <= size => {
            Err(MemError::Freed { addr, id })
        }
        _ => Err(MemError::Unknown { addr }),
    }
}

/// [`resolve`], requiring device memory.
pub(crate) fn resolve_device(addr: usize, len: usize) -> Result<Span, MemError> {
    let span = resolve(addr, len)?;
    if span.alloc.is_none() {
        return Err(MemError::WrongSide {
            addr,
            device_expected: true,
        });
    }
    Ok(span)
}

/// [`resolve`], requiring host memory.
pub(crate) fn resolve_host(addr: usize, len: usize) -> Result<Span, MemError> {
    if is_device(addr) {
        return Err(MemError::WrongSide {
            addr,
            device_expected: false,
        });
    }
    resolve(addr, len)
}

/// Reserving address space with no access rights.
#[cfg(all(
    any(target_os = "linux", target_os = "android", target_os = "macos"),
    target_pointer_width = "64"
))]
mod os {
    use std::ffi::{c_int, c_void};

    extern "C" {
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            offset: i64,
        ) -> *mut c_void;
    }

    const PROT_NONE: c_int = 0;
    const MAP_PRIVATE: c_int = 0x02;
    #[cfg(not(target_os = "macos"))]
    const MAP_ANONYMOUS: c_int = 0x20;
    #[cfg(target_os = "macos")]
    const MAP_ANONYMOUS: c_int = 0x1000;

    /// `len` bytes of inaccessible address space (not backed, not committed).
    pub(super) fn reserve(len: usize) -> Option<(usize, usize)> {
        // SAFETY: an anonymous mapping at an address of the kernel's choosing touches
        // no existing memory.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                PROT_NONE,
                MAP_PRIVATE | MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p as isize == -1 || p.is_null() {
            return None;
        }
        Some((p as usize, len))
    }
}

/// Elsewhere: leaked host memory never handed to anyone else, so addresses stay unique
/// and checked, but a host dereference does not fault.
#[cfg(not(all(
    any(target_os = "linux", target_os = "android", target_os = "macos"),
    target_pointer_width = "64"
)))]
mod os {
    pub(super) fn reserve(len: usize) -> Option<(usize, usize)> {
        if len > 1 << 30 {
            return None;
        }
        let layout = std::alloc::Layout::from_size_align(len, super::ALIGN).ok()?;
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        (!p.is_null()).then_some((p as usize, len))
    }
}
