//! # mpipe-core: the schedule algebra
//!
//! From a model [`profile`] and a schedule [`expr`]ession, derive the complete program
//! every pipeline rank runs in one training step ([`program`]), prove it valid
//! ([`verify`]) and predict its time and memory ([`simulate`]).
//!
//! Invariants:
//! - pure: no I/O in any type or pass; callers read and write files;
//! - deterministic: the same inputs give byte-identical programs (ordered maps only);
//! - the verifier and simulator read only a [`program::Program`], so they judge
//!   hand-written programs exactly as derived ones.

pub mod program;
pub mod timeline;
