//! Floor 0, the IR: the program every rank runs ([`program`]), the compute-only
//! [`plan`], the machine a program is timed on ([`model`]), a unit's role
//! ([`role`]), a program re-rolled into loops ([`rolled`]: the search weighs its
//! size, code generation writes it), and what every floor shares: the search's tuning ([`policy`]),
//! progress reporting ([`progress`]), ordered parallel map, did-you-mean text.
//! It knows nothing of profiles, expressions or how a program was made.

pub mod compare;
pub mod model;
pub(crate) mod parallel;
pub mod plan;
pub mod policy;
pub mod program;
pub mod progress;
pub mod role;
pub mod rolled;
pub(crate) mod text;
