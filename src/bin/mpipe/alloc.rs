//! How the allocator keeps large blocks. glibc's malloc raises its mmap threshold
//! each time a mapped block is freed, so that later blocks up to 32 MiB come from
//! the heap, where a freed block stays resident until everything above it is free
//! too. A derivation frees and allocates per-rank tables of that size phase after
//! phase (a placement, its lowering, the simulator's reading of it, the named
//! program), each a little larger than the one it replaces: at 8 ranks x 65536
//! micro-batches the heap's holes kept about 95 MB resident beyond the live bytes
//! (issue 37 item 2). With the threshold fixed, blocks of at least [`LARGE`] are
//! mapped on their own and returned to the system when freed: the resident memory
//! follows the live bytes.

/// Blocks this large or larger are mapped on their own. Smaller ones, all of a
/// small run's, stay on the heap (a mapping costs system calls and fresh pages).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const LARGE: libc::c_int = 4 << 20;

/// Fix the allocator's mmap threshold at [`LARGE`] (glibc; elsewhere nothing). Called
/// first in `main`, before any thread starts.
pub(crate) fn map_large_blocks() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets one of malloc's parameters; no thread runs yet.
    // Its answer (0 when refused) changes nothing: the default stays.
    #[allow(unsafe_code)]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, LARGE);
    }
}
