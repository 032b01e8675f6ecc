//! # mpipe-core: the schedule algebra
//!
//! From a model [`profile`] and a schedule [`expr`]ession, derive the complete program
//! every pipeline rank runs in one training step ([`program`]), prove it valid
//! ([`verify`]) and predict its time and memory ([`simulate`]).
//!
//! The pipeline, on one screen (see [`mod@derive`]): parse ([`expr`]) → build units
//! ([`units`]) → generate a compute-only [`plan`] ([`generators`]) → map it with
//! [`operators`] → derive all communication ([`lower`]; `refine(...)` then moves
//! transfers where a simulation shows ranks waiting, and weight gradients into the
//! waits left, [`refine`]; with `order = N` also ready compute tasks, then
//! encoder micro-batches from busy ranks to idle ones, then shifts along a rank,
//! in rounds until one finds nothing, [`reorder`])
//! → [`verify`] → [`simulate`] (its [`timeline`] also says where each rank idles, and
//! [`waits`] for whom).
//! `auto` searches the algebra for the fastest expression ([`search`]), and
//! [`evaluation`] sets it against the peer schedules and the lower bound.
//! Around it: lower bounds ([`bound`]), charts and traces ([`render`]), loops for code
//! generation ([`rolled`]), PyTorch schedule CSVs ([`torch_csv`]), Megatron layer
//! layouts ([`megatron`]), the same lowering and refinement for a program that
//! came from elsewhere ([`relower`]), and a run's measured costs read back from its
//! trace ([`calibrate`]).
//!
//! Invariants:
//! - pure: no I/O in any type or pass; callers read and write files;
//! - deterministic: the same inputs give byte-identical programs (ordered maps only);
//! - the verifier and simulator read only a [`program::Program`], so they judge
//!   hand-written programs exactly as derived ones;
//! - long work (the search, an evaluation) reports its progress only to an observer
//!   the caller installs ([`progress`]); results never depend on it;
//! - the search is the one place that runs threads (candidates' plans and their full
//!   derivations in parallel, with the sequential search's answer, inside a
//!   procedural macro too: [`search::for_macro`]).

/// This build of mpipe-core: its version and a hash of its source (`build.rs`). Two
/// builds with the same fingerprint derive the same programs and make the same
/// `auto` choices; a result remembered under one fingerprint (the `schedule!`
/// macro's `auto` cache) is stale under another.
pub const SOURCE_FINGERPRINT: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "+",
    env!("MPIPE_CORE_SOURCE_HASH")
);

pub mod advice;
pub mod analysis;
pub mod bound;
pub mod calibrate;
pub mod derive;
mod eval;
pub mod evaluation;
pub mod expr;
mod finish;
pub mod generators;
pub mod lower;
pub mod megatron;
pub mod model;
pub mod operators;
mod parallel;
mod place;
pub mod plan;
pub mod policy;
pub mod profile;
pub mod program;
pub mod progress;
pub mod refine;
pub mod relower;
pub mod render;
pub mod reorder;
mod replan;
pub mod role;
pub mod rolled;
pub mod search;
pub mod simulate;
mod text;
pub mod timeline;
pub mod torch_csv;
pub mod units;
pub mod verify;
pub mod waits;
