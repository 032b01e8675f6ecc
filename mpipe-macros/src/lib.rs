//! # mpipe-macros: `schedule!`
//!
//! Derives a pipeline schedule at compile time and emits a module of per-rank
//! functions calling the `mpipe-runtime` `Step` API; nothing is interpreted at run
//! time. This crate is a shell: all the work is in `mpipe-codegen`.

/// Derive a pipeline schedule at compile time and emit one function per rank.
///
/// ```rs
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
///
/// Keys: `model = "path"` or `model_toml = "inline TOML"`, `ranks`, `microbatches`,
/// `schedule = EXPR`; or `program = "path.json"` / `program_json = "..."` to compile a
/// hand-written program instead (verified, rules 1-5). Optionally `mode = eager`
/// (default `rendezvous`): the transfer semantics the schedule is chosen for and
/// timed under (`MODE`, `MAKESPAN`); run the ranks' transfers with the same.
#[proc_macro]
pub fn schedule(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    mpipe_codegen::schedule(input.into()).into()
}
