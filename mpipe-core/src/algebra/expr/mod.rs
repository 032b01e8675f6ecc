//! Schedule expressions (`docs/spec/model-format.md`, "The schedule expression"): the
//! one parser the `schedule!` macro and the `mpipe` tool share.
//!
//! ```text
//! expr  := NAME | NAME '(' arg (',' arg)* ','? ')'
//! arg   := expr | KEY '=' VALUE        VALUE := integer | NAME
//! ```
//!
//! The command line's text is lexed ([`lex`]) and parsed ([`parse`]) in one step
//! ([`parse_str`]); a caller with tokens of its own (the `schedule!` macro, in
//! `mpipe-codegen`) makes [`TokenTree`]s whose [`Span`]s are byte ranges into a text
//! it keeps, and maps the spans of the errors back to its own places. The parser
//! knows the grammar only: which names are schedules, operators or encoders, and
//! which keys an operator takes, is decided by the derivation, which points its
//! errors at the spans kept in the tree.
//!
//! Promises:
//! - `1f1b`, `2bp` and the like are names, although Rust lexes them as integer
//!   literals with a suffix;
//! - every error carries the span of the offending token and says what was expected
//!   and what was found; [`parse`] reports every error it can find, not just the first;
//! - the [`Display`](std::fmt::Display) form of an [`Expr`] is canonical
//!   (`transpose(vision, zbv)`, `interleaved(v = 2)`) and parses back to an equal
//!   expression;
//! - no input makes the parser or [`render_error`] panic; the same input always gives
//!   the same result.
//! - a [`Span`] is a byte range into the text the expression was read from: plain
//!   data, valid on any thread; [`Span::start`] and [`Span::end`] give its line and
//!   column in that text.

mod ast;
mod lex;
mod parse;
mod span;

pub use ast::{Arg, Expr, Ident, Value};
pub use lex::{lex, Delimiter, TokenTree};
pub use parse::{parse, parse_str, MAX_DEPTH, MAX_EXPR_LEN, MAX_NAME_LEN};
pub use span::{LineColumn, Span};

/// A syntax error in a schedule expression, at the token at fault.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ExprError {
    /// What was expected and what was found.
    pub message: String,
    /// The offending token.
    pub span: Span,
}

impl ExprError {
    pub fn new(message: impl Into<String>, span: Span) -> ExprError {
        ExprError {
            message: message.into(),
            span,
        }
    }
}

/// A command-line diagnostic: the message, then the source line the error is on with
/// `^` under the offending columns:
///
/// ```text
/// expected a schedule name such as `1f1b`, found `"x"`
///   |
/// 1 | transpose(vision, "x")
///   |                   ^^^
/// ```
///
/// `source` must be the text the expression was lexed from ([`parse_str`]'s
/// argument). When the span points past the source's lines (an error about empty
/// input), this is just the message.
pub fn render_error(source: &str, err: &ExprError) -> String {
    let mut out = err.message.clone();
    let (start, end) = (err.span.start(source), err.span.end(source));
    let Some(text) = source.lines().nth(start.line - 1) else {
        return out;
    };
    let len = text.chars().count();
    if start.column >= len {
        return out;
    }
    let width = if end.line == start.line && end.column > start.column {
        end.column.min(len) - start.column
    } else if end.line > start.line {
        len - start.column
    } else {
        1
    };
    // Keep tabs so the carets line up under the same columns.
    let pad: String = text
        .chars()
        .take(start.column)
        .map(|c| if c == '\t' { '\t' } else { ' ' })
        .collect();
    let number = start.line.to_string();
    let gutter = " ".repeat(number.len());
    out.push_str(&format!(
        "\n{gutter} |\n{number} | {text}\n{gutter} | {pad}{}",
        "^".repeat(width.max(1))
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_falls_back_to_the_message() {
        let err = ExprError::new("boom", Span::NONE);
        assert_eq!(render_error("", &err), "boom");
        // A span past the end of the given source.
        let e = parse_str("\n\n   zbv zbv").unwrap_err();
        assert_eq!(render_error("zbv", &e[0]), e[0].message);
        assert_eq!(e[0].to_string(), e[0].message);
    }

    #[test]
    fn render_multi_line_span_underlines_to_the_end_of_its_first_line() {
        let text = "split_w(   \n)";
        let errs = parse_str(text).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(
            render_error(text, &errs[0]),
            "expected at least one argument inside `split_w(...)`; write `split_w` alone if \
             it takes none\n  |\n1 | split_w(   \n  |        ^^^^"
        );
    }
}
