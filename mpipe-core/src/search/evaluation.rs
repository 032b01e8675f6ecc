//! The evaluation: a profile's peer schedules, the best mpipe schedule (`auto`) and
//! the lower bound, side by side.
//!
//! The peers are the schedules a practitioner would try without mpipe: every body
//! with the encoders inline (`1f1b` is the baseline), and every body with every
//! encoder moved by MPipe's `transpose` (both nesting orders for two encoders).
//! Every peer is in `auto`'s search space, so `auto` is never slower than any.

use crate::algebra::expr::Expr;
use crate::algebra::profile::Profile;
use crate::ir::compare::order;
use crate::ir::progress::Stage;
use crate::judge::bound::{profile_bound, Bound};
use crate::judge::simulate::Mode;
use crate::search::derive::{derive_str, DeriveError, Derived, Request};

pub use crate::search::auto::peers;

/// One schedule of an evaluation.
#[derive(Debug)]
pub struct Row {
    /// The expression as written (`auto` for the best).
    pub expr: String,
    /// The derivation, or why it failed (memory over the limit, too few
    /// micro-batches for the body, ...).
    pub outcome: Result<Derived, Vec<DeriveError>>,
}

impl Row {
    /// The simulated step time, if the schedule derives.
    pub fn makespan(&self) -> Option<f64> {
        self.outcome.as_ref().ok().map(|d| d.report.makespan)
    }
}

/// A profile's evaluation at one size.
#[derive(Debug)]
pub struct Evaluation {
    pub ranks: usize,
    pub microbatches: usize,
    /// The peers, in [`peers`] order (the baseline `1f1b` first).
    pub peers: Vec<Row>,
    /// `auto`.
    pub best: Row,
    /// The profile's lower bound (over the algebra's stage splits).
    pub bound: Option<Bound>,
}

impl Evaluation {
    /// The baseline's step time (`1f1b` with the encoders inline).
    pub fn baseline(&self) -> Option<f64> {
        self.peers.first().and_then(Row::makespan)
    }

    /// The fastest peer that derives.
    pub fn best_peer(&self) -> Option<&Row> {
        self.peers
            .iter()
            .filter(|r| r.makespan().is_some())
            .min_by(|a, b| {
                order(
                    a.makespan().unwrap_or(f64::INFINITY),
                    b.makespan().unwrap_or(f64::INFINITY),
                )
            })
    }
}

/// Evaluate `profile` on `ranks` x `microbatches`, every program derived for and
/// timed under `mode`.
pub fn evaluate(profile: &Profile, ranks: usize, microbatches: usize, mode: Mode) -> Evaluation {
    let req = Request {
        mode,
        ..Request::new(profile, ranks, microbatches)
    };
    let names = peers(profile);
    let stage = Stage::begin("evaluating the schedules", names.len() + 1);
    // Derived from their text, so that errors point into the text a row shows.
    let row = |expr: Expr| {
        let expr = expr.to_string();
        let outcome = derive_str(&req, &expr);
        stage.step();
        Row { outcome, expr }
    };
    Evaluation {
        ranks,
        microbatches,
        peers: names.into_iter().map(row).collect(),
        best: row(Expr::leaf("auto")),
        bound: profile_bound(
            profile,
            ranks,
            microbatches,
            req.sim_options(mode).held_link(),
        ),
    }
}

/// The size a profile is meant to be evaluated at: its line
/// `# evaluate: ranks = R, microbatches = M`.
pub fn intended_size(profile_text: &str) -> Option<(usize, usize)> {
    profile_text.lines().find_map(|line| {
        let rest = line
            .trim()
            .strip_prefix('#')?
            .trim()
            .strip_prefix("evaluate:")?;
        let (mut ranks, mut mbs) = (None, None);
        for part in rest.split(',') {
            let (k, v) = part.split_once('=')?;
            let v: usize = v.trim().parse().ok()?;
            match k.trim() {
                "ranks" => ranks = Some(v),
                "microbatches" => mbs = Some(v),
                _ => return None,
            }
        }
        Some((ranks?, mbs?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intended_size_reads_the_comment() {
        let t = "# a profile\n# evaluate: ranks = 8, microbatches = 32\n[llm]\n";
        assert_eq!(intended_size(t), Some((8, 32)));
        assert_eq!(intended_size("# evaluate: ranks = 8\n"), None);
        assert_eq!(intended_size("[llm]\nlayers = 2\n"), None);
    }
}
