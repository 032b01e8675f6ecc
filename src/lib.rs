//! # mpipe
//!
//! The facade: re-exports the schedule algebra ([`core`]) and, as later issues land,
//! the `schedule!` macro and the runtime. The `mpipe` binary is the command-line tool.

pub use mpipe_core as core;
