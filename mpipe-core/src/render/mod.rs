//! Rendering a timed program: pure functions from a [`Program`] and the
//! [`Timeline`] of its execution to text a person or a tool can look at.
//!
//! - [`gantt_svg`]: the Gantt chart pipeline-parallelism papers draw (ranks as rows,
//!   time on the x axis, one box per compute action, coloured by kind), as a
//!   standalone SVG document;
//! - [`chrome_trace`]: the Chrome / Perfetto trace-event JSON of the same timeline,
//!   one track per rank, for `chrome://tracing` or <https://ui.perfetto.dev>.
//!
//! Promises, for both renderers:
//! - pure: no I/O; the caller writes the returned string wherever it likes;
//! - deterministic: the same program and timeline give byte-identical output;
//! - total: they never panic. `t.ranks[r][i]` is read as the slot of
//!   `p.programs[r][i]` (as [`Timeline`] defines it); an action with no slot (a
//!   timeline shorter than the program) is not drawn, and extra slots are ignored.
//!
//! How units are classified, shared by both renderers:
//! - an *encoder* is a unit whose name does not start with `llm.` or `llm/` (a layer
//!   of the LLM, as `layers` names them) and whose
//!   `inputs` are all encoders (none, for a whole encoder; the previous chunk, for
//!   a chunk of an encoder cut by `chain`); every other unit (pipeline stages,
//!   chunks, projectors, and units the program does not declare) belongs to the
//!   LLM family;
//! - a *chunk*: when several units named `llm.K` share a home rank (virtual
//!   stages of an interleaved or V schedule), the one with the smallest `K` is
//!   chunk 0 on that rank, the next chunk 1, and so on.

use std::collections::BTreeMap;

use crate::program::{Action, Program, Unit};
use crate::timeline::{Slot, Timeline};

pub mod svg;
pub mod trace;

pub use svg::{gantt_svg, SvgOptions};
pub use trace::{
    chrome_trace, embedded_program, timeline_from_trace, TraceOptions, TraceReadError,
};

/// How the renderers see one unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UnitLook {
    /// An encoder: no inputs, not named `llm.*`.
    pub encoder: bool,
    /// Index of this unit among the `llm.*` units of its home rank (0 otherwise).
    pub chunk: usize,
    /// Number of `llm.*` units on its home rank (1 otherwise).
    pub chunks: usize,
}

impl UnitLook {
    /// The look of a unit the program does not declare.
    pub const UNKNOWN: UnitLook = UnitLook {
        encoder: false,
        chunk: 0,
        chunks: 1,
    };
}

/// Which units are encoders: not LLM stages, and reading only the raw micro-batch
/// or other encoders (declared before them).
pub(crate) fn encoders(units: &[Unit]) -> Vec<bool> {
    let mut out: Vec<bool> = Vec::with_capacity(units.len());
    for u in units {
        let upstream = u
            .inputs
            .iter()
            .all(|x| units.iter().zip(&out).any(|(v, &enc)| enc && v.name == *x));
        out.push(upstream && !u.name.starts_with("llm.") && !u.name.starts_with("llm/"));
    }
    out
}

/// The look of every declared unit, by name.
pub(crate) fn unit_looks(p: &Program) -> BTreeMap<&str, UnitLook> {
    // llm.* units grouped by home rank, ordered by their numeric suffix (then by
    // declaration order, for suffixes that are not numbers).
    let mut groups: BTreeMap<usize, Vec<(Option<u64>, usize)>> = BTreeMap::new();
    for (i, u) in p.units.iter().enumerate() {
        if let Some(k) = u.name.strip_prefix("llm.") {
            groups
                .entry(u.home)
                .or_default()
                .push((k.parse::<u64>().ok(), i));
        }
    }
    let mut chunk_of: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for members in groups.values_mut() {
        members.sort_by_key(|&(k, i)| (k.is_none(), k, i));
        let n = members.len();
        for (c, &(_, i)) in members.iter().enumerate() {
            chunk_of.insert(i, (c, n));
        }
    }
    let mut looks = BTreeMap::new();
    let encoder = encoders(&p.units);
    for (i, u) in p.units.iter().enumerate() {
        let (chunk, chunks) = chunk_of.get(&i).copied().unwrap_or((0, 1));
        looks.entry(u.name.as_str()).or_insert(UnitLook {
            encoder: encoder[i],
            chunk,
            chunks,
        });
    }
    looks
}

/// Every action that has a slot, with its rank, in rank order then list order.
pub(crate) fn placed<'a>(
    p: &'a Program,
    t: &'a Timeline,
) -> impl Iterator<Item = (usize, &'a Action, Slot)> + 'a {
    p.programs.iter().enumerate().flat_map(move |(r, list)| {
        let slots: &[Slot] = t.ranks.get(r).map(Vec::as_slice).unwrap_or(&[]);
        list.iter().zip(slots.iter()).map(move |(a, s)| (r, a, *s))
    })
}

/// `x` with at most `decimals` decimals, trailing zeros dropped (`1.50` -> `1.5`,
/// `2.000` -> `2`); non-finite numbers print as `0`.
pub(crate) fn fmt_num(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "0".to_string();
    }
    let mut s = format!("{x:.decimals$}");
    if s.contains('.') {
        while s.ends_with('0') {
            s.pop();
        }
        if s.ends_with('.') {
            s.pop();
        }
    }
    if s == "-0" {
        s = "0".to_string();
    }
    s
}

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_fmt_num_trims() {
        assert_eq!(fmt_num(1.5, 2), "1.5");
        assert_eq!(fmt_num(2.0, 3), "2");
        assert_eq!(fmt_num(1.23456, 2), "1.23");
        assert_eq!(fmt_num(-0.0001, 2), "0");
        assert_eq!(fmt_num(f64::NAN, 2), "0");
        assert_eq!(fmt_num(1200.0, 0), "1200");
    }

    #[test]
    fn render_unit_looks_find_encoders_and_chunks() {
        let p = testutil::small_program();
        let looks = unit_looks(&p);
        assert!(looks["vision"].encoder);
        assert!(!looks["llm.0"].encoder);
        assert_eq!(looks["llm.0"].chunks, 1);
        let v = testutil::big_example(4, 8, 2, false).0;
        let looks = unit_looks(&v);
        // V placement on 4 ranks: rank 0 holds llm.0 and llm.7.
        assert_eq!(
            looks["llm.0"],
            UnitLook {
                encoder: false,
                chunk: 0,
                chunks: 2
            }
        );
        assert_eq!(
            looks["llm.7"],
            UnitLook {
                encoder: false,
                chunk: 1,
                chunks: 2
            }
        );
    }
}
