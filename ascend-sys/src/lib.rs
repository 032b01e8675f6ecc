//! # ascend-sys
//!
//! Raw FFI bindings to the subset of AscendCL and HCCL that mpipe's pipeline runtime
//! needs (devices, streams, events, memory, HCCL communicators, point-to-point and
//! collectives), in the manner of libsqlite3-sys and openssl-sys:
//!
//! - the declarations come from the project's own header `include/mpipe_ascend.h`,
//!   written from the public AscendCL/HCCL reference and checked against the real CANN
//!   headers by `tests/abi.rs`;
//! - `src/bindings.rs` is generated from it by bindgen and committed (no CANN and no
//!   libclang needed to build); `tests/bindings.rs` fails when it is stale;
//! - C enums are newtypes (`HcclResult(u32)`), never Rust enums, since C may return any
//!   value;
//! - `build.rs` links CANN's `ascendcl` and `hccl` when it finds a toolkit, otherwise the
//!   host emulator (feature `emulator`, on by default), otherwise fails with what to
//!   install. [`BACKEND`] says which one this build uses;
//! - the aclnn operators ([`aclnn`]) are not linked: their function-pointer types are
//!   written from CANN's public operator documentation and resolved at run time from
//!   `libopapi.so`/`libnnopbase.so` (the emulator's CPU kernels otherwise), as
//!   torch_npu resolves them.
//!
//! Everything here is `unsafe` and raw; the safe layer (typed errors, RAII) belongs to
//! `mpipe-runtime`'s Ascend backend.

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]
#![allow(
    clippy::missing_safety_doc,
    clippy::useless_transmute,
    clippy::ptr_offset_with_cast
)]

mod bindings {
    #![allow(
        non_camel_case_types,
        non_upper_case_globals,
        non_snake_case,
        dead_code
    )]
    #![allow(clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
}
pub use bindings::*;

pub mod aclnn;
#[cfg(ascend_emulator)]
pub mod emulator;
pub mod profile;

/// Leaves `comm` as a rank that failed: on the emulator, its rank becomes *gone* for
/// the others (every operation with it, pending or later, fails at once with
/// `HCCL_E_REMOTE`, as when its process dies) and `comm` is released; returns `true`.
/// With CANN, which has no such call, does nothing and returns `false` (destroy
/// `comm` as usual).
pub fn abandon(comm: HcclComm) -> bool {
    #[cfg(ascend_emulator)]
    {
        emulator::abandon(comm)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = comm;
        false
    }
}

/// The rank of `comm` that the first operation queued on `comm` to time out
/// (`HCCL_E_TIMEOUT`) was waiting for, on the emulator; always `None` with CANN,
/// which reports only the code.
pub fn stalled_peer(comm: HcclComm) -> Option<u32> {
    #[cfg(ascend_emulator)]
    {
        emulator::stalled_peer(comm)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = comm;
        None
    }
}

/// The rank of `comm` whose process the emulator found gone (ended or killed) when work
/// queued on `comm` failed with `HCCL_E_REMOTE`, if any; always `None` with CANN,
/// which reports only the code.
pub fn departed_rank(comm: HcclComm) -> Option<u32> {
    #[cfg(ascend_emulator)]
    {
        emulator::departed_rank(comm)
    }
    #[cfg(not(ascend_emulator))]
    {
        let _ = comm;
        None
    }
}

/// Which implementation this build links: `"cann"` (the real libraries) or `"emulator"`.
#[cfg(ascend_cann)]
pub const BACKEND: &str = "cann";
/// Which implementation this build links: `"cann"` (the real libraries) or `"emulator"`.
#[cfg(ascend_emulator)]
pub const BACKEND: &str = "emulator";
