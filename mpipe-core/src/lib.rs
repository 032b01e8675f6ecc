//! # mpipe-core: the schedule algebra
//!
//! From a model [`profile`] and a schedule [`expr`]ession, derive the complete program
//! every pipeline rank runs in one training step ([`program`]), prove it valid
//! ([`verify`]) and predict its time and memory ([`simulate`]).
//!
//! The pipeline, on one screen (see [`mod@derive`]): parse ([`expr`]) → build units
//! ([`units`]) → generate a compute-only [`plan`] ([`generators`]) → map it with
//! [`operators`] → derive all communication ([`lower`], every placement rule, keeping
//! the fastest; `refine(...)` then moves transfers where a simulation shows ranks
//! waiting, and weight gradients into the waits left, [`refine`]; with `order = N`
//! also ready compute tasks, then encoder micro-batches from busy ranks to idle ones,
//! then shifts along a rank, in rounds until one finds nothing, [`reorder`])
//! → [`verify`] → [`simulate`] (its [`timeline`] also says where each rank idles, and
//! [`waits`] for whom). `auto` searches the algebra for the fastest expression
//! ([`search`]), and [`evaluation`] sets it against the peer schedules and the lower
//! bound. Around it: lower bounds ([`bound`]), charts and traces ([`render`]), loops
//! for code generation ([`rolled`]), PyTorch schedule CSVs ([`torch_csv`]), Megatron
//! layer layouts ([`megatron`]), the same lowering and refinement for a program that
//! came from elsewhere ([`relower`]), and a run's measured costs read back from its
//! trace ([`calibrate`]).
//!
//! ## Floors
//!
//! The source is laid out in folders, one per floor, lowest first. A module uses
//! only its own floor and the ones below, and no modules use one another in a cycle;
//! `tests/floors.rs` checks both on every test run (a module is a file directly in a
//! floor folder, or a whole folder below one, such as `algebra/generators/`; code
//! under `#[cfg(test)]` is not counted).
//!
//! | floor | folder | holds | must not know |
//! | --- | --- | --- | --- |
//! | 0 | [`ir`] | program, plan, timing model ([`model`]), a unit's role, re-rolled loops ([`rolled`]), search policy, progress, ordered parallel map, did-you-mean text | profiles, expressions, how a program was made |
//! | 1 | [`algebra`] | profile, expr, units, megatron, the ramp split, generators, operators, plan analysis, an expression's evaluation to a plan, lowering | simulation, verification, the search |
//! | 2 | [`judge`] | verify, simulate, timeline, waits, bound, advice | how a program was made (the bound and advice read the profile, the algebra's stage splits and body names) |
//! | 3 | [`search`] | refine, best lowering, reorder, relower, a plan to a checked program, `auto`, the `derive` entry, evaluation | who calls it (tool, macro, test) |
//! | 4 | [`interop`], [`render`] | PyTorch CSVs, calibration from a trace; SVG, Chrome traces | |
//!
//! The algebra's evaluation never calls the search: `derive` (floor 3) resolves
//! `auto` and `refine(X, order = N)` itself and calls down for the plan.
//!
//! ## The public surface
//!
//! Callers use the flat paths re-exported below (`mpipe_core::derive`,
//! `mpipe_core::simulate`, ...), which name the same modules as the floor paths;
//! code inside the crate uses the floor paths (`crate::judge::simulate`), and the
//! floor check rejects the flat ones there.
//!
//! ## Invariants
//!
//! - pure: no I/O in any type or pass; callers read and write files;
//! - deterministic: the same inputs give byte-identical programs (ordered maps only;
//!   work spread over threads is taken back in order), whatever the number of cores;
//! - the verifier and simulator read only a [`program::Program`], so they judge
//!   hand-written programs exactly as derived ones;
//! - long work (the search, an evaluation) reports its progress only to an observer
//!   the caller installs ([`progress`]); results never depend on it;
//! - threads run only in the search floor (`auto`'s candidates, the compute-order
//!   search's next candidates), through the IR's ordered parallel map; nothing
//!   the core holds is tied to a thread, so the same search runs inside a
//!   procedural macro;
//! - the core knows nothing of procedural macros: an expression's places are byte
//!   ranges into its text ([`expr::Span`]), which `mpipe-codegen` maps to the
//!   compiler's spans.

#![warn(unreachable_pub)]

/// This build of mpipe-core: its version and a hash of its source (`build.rs`). Two
/// builds with the same fingerprint derive the same programs and make the same
/// `auto` choices; a result remembered under one fingerprint (the `schedule!`
/// macro's `auto` cache) is stale under another.
pub const SOURCE_FINGERPRINT: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "+",
    env!("MPIPE_CORE_SOURCE_HASH")
);

pub mod algebra;
pub mod interop;
pub mod ir;
pub mod judge;
pub mod render;
pub mod search;

pub use algebra::{analysis, expr, generators, lower, megatron, operators, profile, units};
pub use interop::{calibrate, torch_csv};
pub use ir::rolled;
pub use ir::{model, plan, policy, program, progress, role};
pub use judge::{advice, bound, simulate, timeline, verify, waits};
pub use search::{derive, evaluation, refine, relower, reorder};
