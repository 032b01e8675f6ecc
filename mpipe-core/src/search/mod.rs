//! Floor 3, the derivation and the search: everything that tries programs and keeps
//! one. Lowest first: transfer retiming ([`refine`]); the best lowering of a plan
//! (`place`); a program's plan read back (`replan`); the compute-order search
//! ([`reorder`]) and its trials' ideal timing resumed from their base's (`ideal`);
//! re-derivation of a given program ([`relower`]); a plan to a
//! checked, simulated program (`finish`); a derivation by name, an expression and
//! the alternatives it chooses among (`named`); `auto` ([`auto`]); the entry every
//! caller uses ([`mod@derive`]), which resolves `auto` and `refine(...)` above the
//! algebra; and the peers set against `auto` ([`evaluation`]).
//!
//! `mpipe_core::search` is also `auto`'s public surface (re-exported below).

pub mod auto;
pub mod derive;
pub mod evaluation;
pub(crate) mod finish;
pub(crate) mod ideal;
pub(crate) mod named;
pub(crate) mod periodic;
pub(crate) mod place;
pub mod refine;
pub mod relower;
pub mod reorder;
pub(crate) mod replan;

pub use auto::{candidates, candidates_for, peers, search, Search, Tried};
