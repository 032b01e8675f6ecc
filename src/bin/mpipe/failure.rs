//! A command's failure: every problem found, rendered once for the terminal and once
//! as JSON (for `--json`).

use mpipe_core::advice::for_written;
use mpipe_core::derive::DeriveError;
use mpipe_core::expr::{render_error, ExprError};
use serde_json::{json, Value};

/// One problem: its terminal text (without the `error: ` prefix, possibly several
/// lines, such as an expression with a caret under the fault) and its JSON objects
/// (`{"kind", "message", ...}`; several when one block lists several problems).
pub(crate) struct Problem {
    pub text: String,
    pub json: Vec<Value>,
}

impl Problem {
    /// A problem with no location: `kind` names its class (`usage`, `io`, ...).
    pub(crate) fn plain(kind: &str, message: impl Into<String>) -> Problem {
        let message = message.into();
        Problem {
            json: vec![json!({"kind": kind, "message": message})],
            text: message,
        }
    }
}

/// At most this many problems are written out in full on the terminal.
pub(crate) const MAX_SHOWN: usize = 30;

/// Everything that went wrong, and the exit status it implies.
pub(crate) struct Failure {
    /// 1: an invalid program (or one that does not run); 2: bad input.
    pub code: u8,
    pub problems: Vec<Problem>,
}

impl Failure {
    /// A failure of one problem with no location.
    pub(crate) fn plain(code: u8, kind: &str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            problems: vec![Problem::plain(kind, message)],
        }
    }

    /// Bad input (exit status 2), one problem.
    pub(crate) fn input(kind: &str, message: impl Into<String>) -> Failure {
        Failure::plain(2, kind, message)
    }

    /// Add `other`'s problems; the exit status becomes the larger of the two.
    pub(crate) fn absorb(&mut self, other: Failure) {
        self.code = self.code.max(other.code);
        self.problems.extend(other.problems);
    }

    /// Each problem as `error: ...`, separated by blank lines, and a count when there
    /// are several (past [`MAX_SHOWN`], the rest are only counted; `--json` lists all).
    pub(crate) fn terminal(&self) -> String {
        let mut blocks: Vec<String> = self
            .problems
            .iter()
            .take(MAX_SHOWN)
            .map(|p| format!("error: {}", p.text))
            .collect();
        let count: usize = self.problems.iter().map(|p| p.json.len().max(1)).sum();
        if self.problems.len() > MAX_SHOWN {
            blocks.push(format!("... and {} more", self.problems.len() - MAX_SHOWN));
        }
        if self.problems.len() > 1 {
            blocks.push(format!("{count} errors"));
        }
        blocks.join("\n\n")
    }

    /// The problems as a JSON array of objects.
    pub(crate) fn json_errors(&self) -> Vec<Value> {
        self.problems
            .iter()
            .flat_map(|p| p.json.iter().cloned())
            .collect()
    }

    /// `{"errors": [...]}`, what a `--json` command prints when it fails as a whole.
    pub(crate) fn to_json(&self) -> Value {
        json!({ "errors": self.json_errors() })
    }
}

/// Collect the failures of several independent steps: `Ok` when there were none.
#[derive(Default)]
pub(crate) struct Collect(Option<Failure>);

impl Collect {
    /// Record `r`'s failure, if any, and give back its value.
    pub(crate) fn take<T>(&mut self, r: Result<T, Failure>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(f) => {
                self.add(f);
                None
            }
        }
    }

    pub(crate) fn add(&mut self, f: Failure) {
        match &mut self.0 {
            Some(all) => all.absorb(f),
            None => self.0 = Some(f),
        }
    }

    pub(crate) fn finish(self) -> Result<(), Failure> {
        self.0.map_or(Ok(()), Err)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::input("io", format!("{e:#}"))
    }
}

/// `UnknownName` -> `unknown_name`: the JSON spelling of a derivation error's kind.
fn snake(kind: impl std::fmt::Debug) -> String {
    let mut out = String::new();
    for (i, c) in format!("{kind:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Derivation errors of expression `expr`, each rendered with a caret under the
/// sub-expression at fault.
pub(crate) fn expr_failure(expr: &str, errors: &[DeriveError]) -> Failure {
    let problems = errors
        .iter()
        .map(|e| {
            let message = for_written(expr, &e.message);
            let shown = ExprError {
                message: message.clone(),
                span: e.span,
            };
            let mut obj = json!({
                "kind": snake(e.kind),
                "message": message,
                "expr": expr,
            });
            let (start, end) = (e.span.start(expr), e.span.end(expr));
            // 1-based, as editors count; `length` in characters on that line.
            obj["line"] = json!(start.line);
            obj["column"] = json!(start.column + 1);
            if end.line == start.line && end.column > start.column {
                obj["length"] = json!(end.column - start.column);
            }
            Problem {
                text: render_error(expr, &shown),
                json: vec![obj],
            }
        })
        .collect();
    Failure { code: 2, problems }
}

/// Line `line` (1-based) of `text` with a gutter, and a caret under 1-based
/// `column` when given; long lines are cut to a window around the column.
pub(crate) fn snippet(text: &str, line: usize, column: Option<usize>) -> Option<String> {
    let src = text.lines().nth(line.checked_sub(1)?)?;
    snippet_of_line(src, line, column)
}

/// [`snippet`] of `src`, the text of line `line`: for many problems in one file,
/// with its lines split once (finding each line from the start of the text made
/// thousands of problems quadratic). Reads no more of the line than it shows.
pub(crate) fn snippet_of_line(src: &str, line: usize, column: Option<usize>) -> Option<String> {
    const WINDOW: usize = 72;
    let needed = column.unwrap_or(0) + 2 * WINDOW;
    let chars: Vec<char> = src.chars().take(needed).collect();
    let col = column.map(|c| c.saturating_sub(1).min(chars.len()));
    let start = match col {
        Some(c) if chars.len() > WINDOW && c > WINDOW / 2 => c - WINDOW / 2,
        _ => 0,
    };
    let end = (start + WINDOW).min(chars.len());
    let mut shown: String = chars[start..end].iter().collect();
    if start > 0 {
        shown.insert_str(0, "...");
    }
    if end < chars.len() {
        shown.push_str("...");
    }
    let number = line.to_string();
    let gutter = " ".repeat(number.len());
    let mut out = format!("{gutter} |\n{number} | {}", shown.trim_end());
    if let Some(c) = col {
        let offset = c - start + if start > 0 { 3 } else { 0 };
        let pad: String = shown
            .chars()
            .take(offset)
            .map(|ch| if ch == '\t' { '\t' } else { ' ' })
            .collect();
        out.push_str(&format!("\n{gutter} | {pad}^"));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snake_case_kinds() {
        #[derive(Debug)]
        struct UnknownName;
        assert_eq!(snake(UnknownName), "unknown_name");
    }

    #[test]
    fn snippet_windows_long_lines() {
        let long = format!("{}X{}", "a".repeat(200), "b".repeat(200));
        let s = snippet(&long, 1, Some(201)).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        let caret = lines[2].find('^').unwrap();
        assert_eq!(lines[1].chars().nth(caret), Some('X'));
        assert!(snippet("a", 3, None).is_none());
        assert!(snippet("", 1, Some(5)).is_none());
    }
}
