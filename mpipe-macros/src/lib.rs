//! # mpipe-macros: `schedule!`
//!
//! Derives a pipeline schedule at compile time with `mpipe-core` and emits a module of
//! per-rank functions calling the `mpipe-runtime` [`Step`] API; nothing is
//! interpreted at run time. The crate is a thin shell: [`input`] parses the macro's
//! input, [`expand`] runs the derivation and collects errors, [`emit`] turns a derived
//! program into tokens. Every error is a compile error with a span on the token at
//! fault; all of them are reported, and a fallback module is still emitted so the
//! rest of the crate type-checks.
//!
//! [`Step`]: https://docs.rs/mpipe-runtime

mod emit;
mod expand;
mod input;
#[cfg(test)]
mod snapshots;

/// Derive a pipeline schedule at compile time and emit one function per rank.
///
/// ```ignore
/// mpipe::schedule! {
///     /// Qwen2-VL-7B on 8 pipeline ranks
///     pub mod plan {
///         model = "profiles/qwen2vl-7b.toml";  // relative to the crate's Cargo.toml
///         ranks = 8;
///         microbatches = 32;
///         schedule = transpose(vision, zbv);
///     }
/// }
/// // plan::RANKS, plan::MICROBATCHES, plan::run(rank, &mut step), plan::rank_3(&mut step), ...
/// ```
#[proc_macro]
pub fn schedule(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    expand::schedule(input.into()).into()
}
