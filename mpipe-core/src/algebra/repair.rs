//! The expressions a writer most likely meant, for when the written one does not
//! derive: a tool that must still say something about what was declared (the
//! `schedule!` macro's fallback module keeps the declared units, so that only the
//! real error shows) derives these in turn and takes the first that works.
//!
//! Promises: the list is short (at most one entry per node of the expression, plus
//! one), deterministic, and never contains the written expression itself.

use super::eval::{body_names, operator_names};
use super::expr::{Arg, Expr};
use crate::ir::text::did_you_mean;

/// Closest first: `expr` with every unknown name replaced by its did-you-mean among
/// the schedules, operators and `encoders` (where it changes anything); then each
/// sub-expression, outermost first, likewise repaired; last the plainest body,
/// `1f1b`, whose units are the profile's encoders and one LLM stage per rank.
pub fn likely_meant(expr: &Expr, encoders: &[&str]) -> Vec<Expr> {
    let mut known: Vec<&str> = body_names().chain(operator_names()).collect();
    known.extend(encoders);
    let mut out = Vec::new();
    let fixed = repaired(expr, &known);
    if fixed != *expr {
        out.push(fixed);
    }
    let mut inner: Vec<&Expr> = expr.positional().collect();
    let mut i = 0;
    while i < inner.len() {
        let e = inner[i];
        let fixed = repaired(e, &known);
        if !encoders.contains(&fixed.name()) && !out.contains(&fixed) && fixed != *expr {
            out.push(fixed);
        }
        inner.extend(e.positional());
        i += 1;
    }
    let plain = Expr {
        head: super::expr::Ident::new("1f1b", expr.span),
        args: Vec::new(),
        span: expr.span,
    };
    if !out.contains(&plain) && plain != *expr {
        out.push(plain);
    }
    out
}

/// `expr` with each name that is not in `known` replaced by its did-you-mean (kept
/// as written where there is none).
fn repaired(expr: &Expr, known: &[&str]) -> Expr {
    let mut e = expr.clone();
    if !known.contains(&e.head.name.as_str()) {
        if let Some(s) = did_you_mean(&e.head.name, known) {
            e.head.name = s.to_string();
        }
    }
    for a in &mut e.args {
        if let Arg::Expr(sub) = a {
            *sub = repaired(sub, known);
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expr::parse_str;

    fn texts(written: &str) -> Vec<String> {
        let e = parse_str(written).expect("parses");
        likely_meant(&e, &["vision", "audio"])
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn misspelt_names_are_repaired_first_then_the_parts_then_the_plainest_body() {
        assert_eq!(
            texts("transpose(visoin, interleaved(v = 2))"),
            [
                "transpose(vision, interleaved(v = 2))",
                "interleaved(v = 2)",
                "1f1b"
            ]
        );
        assert_eq!(texts("zvb"), ["zbv", "1f1b"]);
        assert_eq!(
            texts("fill(audio, trnaspose(vision, zbv))"),
            [
                "fill(audio, transpose(vision, zbv))",
                "transpose(vision, zbv)",
                "zbv",
                "1f1b"
            ]
        );
    }

    #[test]
    fn a_name_with_no_near_match_is_kept_and_the_written_expression_never_listed() {
        assert_eq!(texts("qqqqqq"), ["1f1b"]);
        assert_eq!(texts("1f1b"), Vec::<String>::new());
        assert_eq!(texts("transpose(vision, 1f1b)"), ["1f1b"]);
    }
}
