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

#[cfg(doc)]
use crate::ir::program::Program;
#[cfg(doc)]
use crate::judge::timeline::Timeline;

pub(crate) mod look;
pub use crate::ir::rolled;
pub mod svg;
pub mod trace;
pub mod trace_read;

pub use svg::{gantt_svg, SvgOptions};
pub use trace::{
    chrome_trace, embedded_program, timeline_from_trace, TraceOptions, TraceReadError,
};

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::look::{fmt_num, unit_looks, UnitLook};
    use super::testutil;

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
