//! # mpipe-codegen: what `schedule!` does, as an ordinary library
//!
//! The `mpipe-macros` crate is a one-function shell over [`schedule`]; keeping the
//! work here lets tests, snapshots and benchmarks call it directly. Pipeline:
//! [`input`] parses the macro's input, [`expand`] reads the profile, parses the
//! expression (its tokens handed to mpipe-core and its error places mapped back to
//! the compiler's spans by [`places`]), derives with `mpipe-core` and collects every error; [`emit`] turns a
//! derived program, re-rolled into loops, into the module's tokens; [`cache`]
//! remembers `auto`'s choices (the chosen programs) between builds, so that a
//! rebuild verifies and emits the chosen program instead of searching again.
//!
//! Promises: never panics on any input; every error becomes a `compile_error!` with
//! the span of the token at fault, all of them at once; on error a fallback module
//! with the same public names is still emitted, so the calling crate sees no
//! secondary errors; output is deterministic, and the same with or without the
//! `auto` cache.

pub mod cache;
pub mod emit;
pub mod expand;
pub mod input;
pub mod places;
pub mod size;
#[cfg(test)]
mod snapshots;

pub use expand::{schedule, schedule_noting, schedule_with};
