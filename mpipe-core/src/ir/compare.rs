//! The one order of programs and the one tolerance rule.
//!
//! A program is better than another when it is *shorter* (smaller makespan); as
//! long, when the ranks finish earlier in sum (where that is measured: progress
//! where the makespan does not move); as long and finishing as early, when it holds
//! less peak memory. Every comparison of programs, of their reports and of the
//! figures a search keeps for them goes through [`Score`] (or [`order`] for one
//! figure), so the search, the refinement passes and the generators agree on what
//! "faster" means.
//!
//! Two figures are equal when they differ by at most [`RELATIVE_TOLERANCE`] times
//! the larger of their magnitudes. The rule is relative on purpose: times and
//! memory are in whatever unit the user's profile chose (milliseconds, seconds,
//! microseconds; bytes or gigabytes), so an absolute slack would be too coarse in
//! one unit and meaningless in another. Two makespans of `1e-12` and `2e-12` are
//! different; `1e6` and `1e6 * (1 + 1e-13)` are equal.

use std::cmp::Ordering;

/// The relative tolerance of every comparison of programs: two figures `a`, `b`
/// are equal when `|a - b| <= RELATIVE_TOLERANCE * max(|a|, |b|)`.
///
/// It absorbs the rounding of sums of floating-point costs taken in different
/// orders (a few ulps per task, far below `1e-9` relative for any program the
/// simulator runs) and nothing more: a gain of one part in a billion is not worth
/// a longer expression or another round of search. It is a fixed property of the
/// arithmetic, not a knob of the search, so it is not in
/// [`crate::ir::policy::SearchPolicy`].
pub const RELATIVE_TOLERANCE: f64 = 1e-9;

/// `a` against `b` under the tolerance rule: `Equal` when they are within
/// [`RELATIVE_TOLERANCE`] of the larger magnitude, otherwise as [`f64::total_cmp`]
/// orders them (infinities and NaNs included, so the order is never undecided).
pub fn order(a: f64, b: f64) -> Ordering {
    if a == b {
        return Ordering::Equal;
    }
    if a.is_finite() && b.is_finite() && (a - b).abs() <= RELATIVE_TOLERANCE * a.abs().max(b.abs())
    {
        return Ordering::Equal;
    }
    a.total_cmp(&b)
}

/// `a` and `b` are equal under the tolerance rule (within [`RELATIVE_TOLERANCE`] of
/// the larger magnitude; exactly equal when both are zero).
pub fn close(a: f64, b: f64) -> bool {
    order(a, b).is_eq()
}

/// `a` is no more than `b` under the tolerance rule (a figure within a limit).
pub fn at_most(a: f64, b: f64) -> bool {
    order(a, b) != Ordering::Greater
}

/// `a` is less than `b` by more than the tolerance.
pub fn less(a: f64, b: f64) -> bool {
    order(a, b) == Ordering::Less
}

/// What programs are compared on, most important first. A figure a comparison does
/// not use is left at `0.0` on both sides (and so never decides).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Score {
    /// The makespan (the step time): shorter is better.
    pub makespan: f64,
    /// The sum of the ranks' finishing times: smaller is better when the makespans
    /// are equal.
    pub ends: f64,
    /// Peak memory: less is better when the times are equal.
    pub peak: f64,
}

impl Score {
    /// A score on the makespan alone.
    pub fn span(makespan: f64) -> Self {
        Score {
            makespan,
            ..Score::default()
        }
    }

    /// This score with the sum of the ranks' finishing times as its second figure.
    pub fn with_ends(self, ends: f64) -> Self {
        Score { ends, ..self }
    }

    /// This score with peak memory as its last figure.
    pub fn with_peak(self, peak: f64) -> Self {
        Score { peak, ..self }
    }

    fn figures(&self) -> [f64; 3] {
        [self.makespan, self.ends, self.peak]
    }

    /// The order of programs: shorter, then earlier ends, then less memory, each
    /// under the tolerance rule. `Less` means `self` is better.
    pub fn order(&self, other: &Score) -> Ordering {
        self.figures()
            .iter()
            .zip(other.figures())
            .map(|(&a, b)| order(a, b))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    }

    /// `self` is strictly better than `other` (beyond the tolerance).
    pub fn beats(&self, other: &Score) -> bool {
        self.order(other) == Ordering::Less
    }

    /// One step of a local search (`refine`'s transfer moves, its weight-gradient
    /// moves) improves on `other`: any gain at all, in the same order but without
    /// the tolerance. A step whose gain is below the tolerance leads on to
    /// further moves, and refusing it stops the climb early: with [`Score::beats`]
    /// here, two shipped cases ended 0.03% and 0.9% slower. Choices *between*
    /// programs (placements, candidates, finalists, the search's winner) use
    /// [`Score::beats`] and [`Score::order`].
    pub fn improves(&self, other: &Score) -> bool {
        self.figures()
            .iter()
            .zip(other.figures())
            .map(|(a, b)| a.total_cmp(&b))
            .find(|o| o.is_ne())
            .is_some_and(Ordering::is_lt)
    }
}

/// Sort `items` best first by [`Score::order`], ties (within the tolerance) broken by
/// `tie`, then by their order in `items` (the sort is stable).
///
/// A comparison with a tolerance is not transitive (`a ~ b`, `b ~ c`, yet `a < c`),
/// so it cannot be handed to a sort as it is. Instead, figure by figure: the items
/// are sorted exactly on the figure, then cut into runs whose figure is within the
/// tolerance of the run's first; each run is sorted the same way on the next figure,
/// and the last runs by `tie`. That is a total order, equal to [`Score::order`]
/// wherever the latter is consistent.
pub fn sort_best_first<T>(
    items: &mut [T],
    score: impl Fn(&T) -> Score,
    tie: impl Fn(&T, &T) -> Ordering,
) {
    fn level<T>(
        items: &mut [T],
        figure: usize,
        score: &dyn Fn(&T) -> [f64; 3],
        tie: &dyn Fn(&T, &T) -> Ordering,
    ) {
        if figure == 3 {
            items.sort_by(tie);
            return;
        }
        items.sort_by(|a, b| score(a)[figure].total_cmp(&score(b)[figure]));
        let mut start = 0;
        while start < items.len() {
            let first = score(&items[start])[figure];
            let len = items[start..]
                .iter()
                .take_while(|x| order(score(x)[figure], first).is_eq())
                .count()
                .max(1);
            level(&mut items[start..start + len], figure + 1, score, tie);
            start += len;
        }
    }
    level(items, 0, &|x| score(x).figures(), &tie);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tolerance_is_relative() {
        // Tiny figures are told apart: no absolute slack swallows them.
        assert_eq!(order(1e-12, 2e-12), Ordering::Less);
        assert!(Score::span(1e-12).beats(&Score::span(2e-12)));
        // Large figures within one part in 1e13 are equal.
        let big = 1e6;
        assert_eq!(order(big, big * (1.0 + 1e-13)), Ordering::Equal);
        assert!(!Score::span(big).beats(&Score::span(big * (1.0 + 1e-13))));
        assert!(!Score::span(big * (1.0 + 1e-13)).beats(&Score::span(big)));
        // And told apart beyond the tolerance, whatever the unit.
        for unit in [1e-6, 1.0, 1e3, 1e9] {
            assert_eq!(order(unit, unit * (1.0 + 1e-8)), Ordering::Less);
            assert_eq!(order(unit, unit * (1.0 + 1e-10)), Ordering::Equal);
        }
        // Infinities and zero are ordered, never equal to a finite figure.
        assert_eq!(order(1e300, f64::INFINITY), Ordering::Less);
        assert_eq!(order(f64::INFINITY, f64::INFINITY), Ordering::Equal);
        assert_eq!(order(0.0, 1e-300), Ordering::Less);
        assert!(at_most(1.0, 1.0 + 1e-12) && at_most(1.0 + 1e-12, 1.0));
        assert!(less(1.0, 1.0 + 1e-6) && !less(1.0, 1.0 + 1e-12));
    }

    #[test]
    fn shorter_then_earlier_ends_then_less_memory() {
        let a = Score::span(10.0).with_ends(30.0).with_peak(5.0);
        // Shorter wins whatever the rest.
        assert!(Score::span(9.0).with_ends(99.0).with_peak(99.0).beats(&a));
        // As long within the tolerance: earlier ends win, then less memory.
        let same = 10.0 * (1.0 + 1e-12);
        assert!(Score::span(same).with_ends(29.0).with_peak(9.0).beats(&a));
        assert!(Score::span(same).with_ends(30.0).with_peak(4.0).beats(&a));
        assert_eq!(
            Score::span(same).with_ends(30.0).with_peak(5.0).order(&a),
            Ordering::Equal
        );
        // A local search step takes any exact gain.
        assert!(Score::span(10.0 - 1e-12).with_ends(99.0).improves(&a));
        assert!(!Score::span(10.0 - 1e-12).with_ends(99.0).beats(&a));
        assert!(!a.improves(&a));
    }

    #[test]
    fn sorting_is_total_and_follows_the_order() {
        // A chain of near-ties: 1, 1 + 0.6e-9, 1 + 1.2e-9 (the first and last differ).
        let mut xs = vec![
            (1.0 + 1.2e-9, 1.0, 0usize),
            (2.0, 0.0, 1),
            (1.0 + 0.6e-9, 3.0, 2),
            (1.0, 2.0, 3),
        ];
        sort_best_first(
            &mut xs,
            |x| Score::span(x.0).with_peak(x.1),
            |a, b| a.2.cmp(&b.2),
        );
        // 1 and 1 + 0.6e-9 are one run (by memory); 1 + 1.2e-9 starts the next.
        let ids: Vec<usize> = xs.iter().map(|x| x.2).collect();
        assert_eq!(ids, vec![3, 2, 0, 1]);
        // Full ties go to `tie`.
        let mut ys = vec![(1.0, 0.0, 5usize), (1.0 + 1e-12, 0.0, 4)];
        sort_best_first(&mut ys, |x| Score::span(x.0), |a, b| a.2.cmp(&b.2));
        assert_eq!(ys.iter().map(|y| y.2).collect::<Vec<_>>(), vec![4, 5]);
    }
}
