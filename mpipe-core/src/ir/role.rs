//! A unit's role, in the one place that reads it. Units carry only a name today, so
//! the role is read from the name the unit builder gives (`llm.N`, `llm/N`, ...);
//! every pass that needs a role asks here.

use crate::ir::program::Unit;

/// Whether `unit` is part of the LLM pinned to its home in a pipeline-parallel
/// program: a stage (`llm.N`) or, cut by `layers`, one of its layers (`llm/N`,
/// `llm/first_stage_extra`, `llm/last_stage_extra`).
pub fn is_stage(unit: &Unit) -> bool {
    let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    unit.name.strip_prefix("llm.").is_some_and(digits)
        || unit
            .name
            .strip_prefix("llm/")
            .is_some_and(|n| digits(n) || n == "first_stage_extra" || n == "last_stage_extra")
}
