//! Floor 1, the algebra: profiles ([`profile`]), expressions ([`expr`]), units
//! ([`units`], [`megatron`], the ramp split in [`ramp`]), the bodies ([`generators`])
//! and plan-to-plan maps
//! ([`operators`]) over a plan's dependencies ([`analysis`]), an expression's
//! evaluation to a plan (`eval`), and the lowering of a plan to a program
//! ([`lower`], its lists sorted by merging their runs: [`runs`]); for an expression that does not derive, what its writer most likely
//! meant ([`repair`]). It knows nothing of simulation or the search.

pub mod analysis;
pub(crate) mod eval;
pub mod expr;
pub mod generators;
pub mod lower;
pub mod megatron;
pub mod operators;
pub mod profile;
pub mod ramp;
pub mod repair;
pub(crate) mod runs;
pub mod signature;
pub mod units;
