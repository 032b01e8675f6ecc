//! A simulated program's [`Score`]: the figures of [`crate::ir::compare`]'s order
//! read from its report.

use crate::ir::compare::Score;
use crate::judge::simulate::SimReport;

/// Sum of the ranks' finishing times: progress where the makespan does not move.
pub fn ends(r: &SimReport) -> f64 {
    r.timeline
        .ranks
        .iter()
        .map(|l| l.last().map_or(0.0, |s| s.end))
        .sum()
}

/// The makespan alone.
pub fn span(r: &SimReport) -> Score {
    Score::span(r.makespan)
}

/// The makespan, then the sum of the ranks' finishing times.
pub fn timed(r: &SimReport) -> Score {
    span(r).with_ends(ends(r))
}
