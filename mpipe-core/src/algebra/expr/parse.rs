//! The parser: tokens ([`super::lex`]) in, [`Expr`] or every error found out.
//!
//! ```text
//! expr  := NAME | NAME '(' arg (',' arg)* ','? ')'
//! arg   := expr | KEY '=' VALUE        VALUE := integer | NAME
//! ```
//!
//! `NAME` is an identifier (`zbv`, `transpose`) or an integer literal whose text is
//! identifier-like and contains a letter (`1f1b`, `2bp`: the Rust tokenizer reads
//! these as an integer with a suffix).
//!
//! Recovery: the arguments of an operator are separated by commas, so an error in
//! one argument does not hide an error in the next; each argument reports at most
//! one error, at the token at fault.

use super::lex::{lex, Delimiter, TokenTree};
use super::span::Span;

/// How deep operators may nest (`a(b(c(...)))`). Real schedules nest a handful of
/// levels; the limit keeps the recursive passes over an expression (parsing, planning,
/// printing) far from the end of the stack.
pub const MAX_DEPTH: usize = 64;

/// The longest schedule expression [`parse_str`] reads, in bytes. Real ones are a
/// line (`transpose(vision, zbv)`); even eight encoders each with an operator stay
/// far below.
pub const MAX_EXPR_LEN: usize = 4096;

/// The longest name (schedule, operator, encoder, key or value) an expression may
/// use, in characters: the same limit as a profile's unit names
/// ([`crate::algebra::profile::MAX_NAME_LEN`]).
pub const MAX_NAME_LEN: usize = crate::algebra::profile::MAX_NAME_LEN;

use super::ast::{Arg, Expr, Ident, Value};
use super::ExprError;

/// Parse one schedule expression from tokens ([`lex`]ed text, or tokens a caller
/// made with spans into a text of its own).
///
/// # Errors
/// Every error it can find, each with the span of the offending token.
pub fn parse(toks: &[TokenTree]) -> Result<Expr, Vec<ExprError>> {
    let mut p = Parser {
        errors: Vec::new(),
        depth: 0,
    };
    if toks.is_empty() {
        return Err(vec![ExprError::new(
            "expected a schedule expression such as `1f1b` or `transpose(vision, zbv)`, \
             found nothing",
            Span::NONE,
        )]);
    }
    let mut i = 0;
    let expr = p.expr(toks, &mut i, Ctx::Top);
    if let (Some(e), Some(t)) = (&expr, toks.get(i)) {
        let message = if is_punct(t, '=') {
            format!(
                "unexpected `=` after `{e}`; `key = value` arguments go inside an \
                 operator's parentheses, such as `interleaved(v = 2)`"
            )
        } else {
            format!(
                "unexpected `{}` after `{e}`; expected the end of the schedule expression",
                describe(t)
            )
        };
        p.error(message, t.span());
    }
    match expr {
        Some(e) if p.errors.is_empty() => Ok(e),
        _ => Err(p.errors),
    }
}

/// Lex `text` and parse it as a schedule expression. Text that does not lex (an
/// unclosed parenthesis, an unterminated string...) gives one error.
///
/// # Errors
/// As [`parse`], or the one lexing error.
pub fn parse_str(text: &str) -> Result<Expr, Vec<ExprError>> {
    // Checked before lexing: the lexer itself recurses into every group.
    let deepest = text
        .chars()
        .scan(0usize, |depth, c| {
            match c {
                '(' | '[' | '{' => *depth += 1,
                ')' | ']' | '}' => *depth = depth.saturating_sub(1),
                _ => {}
            }
            Some(*depth)
        })
        .max()
        .unwrap_or(0);
    if deepest > MAX_DEPTH {
        return Err(vec![too_deep(deepest, Span::NONE)]);
    }
    if text.len() > MAX_EXPR_LEN {
        return Err(vec![ExprError::new(
            format!(
                "the expression is {} bytes long; mpipe accepts at most {MAX_EXPR_LEN} \
                 (MAX_EXPR_LEN): write a shorter schedule expression",
                text.len()
            ),
            Span::NONE,
        )]);
    }
    parse(&lex(text).map_err(|e| vec![e])?)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Ctx {
    /// The whole expression.
    Top,
    /// An operator's argument.
    Arg,
}

struct Parser {
    errors: Vec<ExprError>,
    /// Operators entered and not yet left.
    depth: usize,
}

fn too_deep(depth: usize, span: Span) -> ExprError {
    ExprError::new(
        format!(
            "the expression nests operators {depth} levels deep; mpipe accepts at most \
             {MAX_DEPTH}: write the schedule with fewer nested operators"
        ),
        span,
    )
}

impl Parser {
    fn error(&mut self, message: String, span: Span) {
        self.errors.push(ExprError::new(message, span));
    }

    /// Report a name longer than [`MAX_NAME_LEN`] (the parse then fails).
    fn check_length(&mut self, name: &Ident) {
        let n = name.name.chars().count();
        if n > MAX_NAME_LEN {
            self.error(
                format!(
                    "the name `{}` is {n} characters long; mpipe accepts names of at most \
                     {MAX_NAME_LEN} characters (MAX_NAME_LEN): use a shorter name",
                    shorten(&name.name)
                ),
                name.span,
            );
        }
    }

    /// `NAME` or `NAME(...)` starting at `toks[*i]`; advances `i` past it. On a bad
    /// head, reports it and returns `None`; on bad arguments, reports them and
    /// returns the expression with the good ones.
    fn expr(&mut self, toks: &[TokenTree], i: &mut usize, ctx: Ctx) -> Option<Expr> {
        let tok = toks.get(*i)?;
        let Some(head) = name_of(tok) else {
            let expected = match ctx {
                Ctx::Top => "a schedule name such as `1f1b`",
                Ctx::Arg => {
                    "an argument: a schedule such as `1f1b`, an encoder such as `vision`, \
                     or `key = value`"
                }
            };
            self.error(
                format!("expected {expected}, found `{}`", describe(tok)),
                tok.span(),
            );
            return None;
        };
        self.check_length(&head);
        *i += 1;
        match toks.get(*i) {
            Some(
                group @ TokenTree::Group {
                    delimiter: Delimiter::Parenthesis,
                    span: group_span,
                    ..
                },
            ) => {
                *i += 1;
                if self.depth >= MAX_DEPTH {
                    self.errors.push(too_deep(self.depth + 1, head.span));
                    return None;
                }
                self.depth += 1;
                let args = self.args(group, &head);
                self.depth -= 1;
                let span = head.span.join(*group_span);
                Some(Expr { head, args, span })
            }
            _ => {
                let span = head.span;
                Some(Expr {
                    head,
                    args: Vec::new(),
                    span,
                })
            }
        }
    }

    /// The comma-separated arguments inside `head(...)`.
    fn args(&mut self, group: &TokenTree, head: &Ident) -> Vec<Arg> {
        let TokenTree::Group {
            tokens: toks,
            span: group_span,
            close,
            ..
        } = group
        else {
            return Vec::new();
        };
        if toks.is_empty() {
            self.error(
                format!(
                    "expected at least one argument inside `{head}(...)`; \
                     write `{head}` alone if it takes none"
                ),
                *group_span,
            );
            return Vec::new();
        }
        // Split at top-level commas; remember each segment's terminating comma.
        let mut segments: Vec<(&[TokenTree], Option<Span>)> = Vec::new();
        let mut start = 0;
        for (k, t) in toks.iter().enumerate() {
            if is_punct(t, ',') {
                segments.push((&toks[start..k], Some(t.span())));
                start = k + 1;
            }
        }
        segments.push((&toks[start..], None));

        let last = segments.len() - 1;
        let mut args: Vec<Arg> = Vec::new();
        for (k, (seg, comma)) in segments.into_iter().enumerate() {
            if seg.is_empty() {
                // `f(a,)` is fine; `f(,a)`, `f(a,,b)` are not.
                if k == last && k > 0 {
                    continue;
                }
                let span = comma.unwrap_or(*close);
                self.error("expected an argument before `,`".to_string(), span);
                continue;
            }
            if let Some(arg) = self.arg(seg) {
                if let Arg::Key { key, .. } = &arg {
                    if args
                        .iter()
                        .any(|a| matches!(a, Arg::Key { key: k, .. } if k == key))
                    {
                        self.error(
                            format!("duplicate key `{key}` in `{head}(...)`; give each key once"),
                            key.span,
                        );
                        continue;
                    }
                }
                args.push(arg);
            }
        }
        args
    }

    /// One argument: `KEY = VALUE` or an expression, filling all of `seg`.
    fn arg(&mut self, seg: &[TokenTree]) -> Option<Arg> {
        if let (Some(key), Some(eq)) = (seg.first().and_then(name_of), seg.get(1)) {
            if is_punct(eq, '=') {
                self.check_length(&key);
                return self.key_arg(key, eq, &seg[2..]);
            }
        }
        let mut i = 0;
        let e = self.expr(seg, &mut i, Ctx::Arg)?;
        if let Some(t) = seg.get(i) {
            let hint = if is_punct(t, ':') {
                " (write `key = value`)"
            } else {
                ""
            };
            self.error(
                format!(
                    "unexpected `{}` after `{e}`; expected `,` or `)`{hint}",
                    describe(t)
                ),
                t.span(),
            );
            return None;
        }
        Some(Arg::Expr(e))
    }

    /// `KEY = VALUE`, where `rest` is what follows the `=`.
    fn key_arg(&mut self, key: Ident, eq: &TokenTree, rest: &[TokenTree]) -> Option<Arg> {
        let expected = "an integer such as `2` or a name such as `min`";
        let Some(t) = rest.first() else {
            self.error(
                format!("expected a value after `{key} =`: {expected}"),
                eq.span(),
            );
            return None;
        };
        let value = match t {
            TokenTree::Literal { text: lit, .. } if is_integer_text(lit) => {
                let text: String = lit.chars().filter(|&c| c != '_').collect();
                match text.parse::<u64>() {
                    Ok(v) => Value::Int {
                        value: v,
                        span: t.span(),
                    },
                    Err(_) => {
                        self.error(
                            format!(
                                "the integer `{lit}` for `{key}` is too large; expected at most {}",
                                u64::MAX
                            ),
                            t.span(),
                        );
                        return None;
                    }
                }
            }
            _ => match name_of(t) {
                Some(name) => {
                    self.check_length(&name);
                    Value::Name(name)
                }
                None => {
                    self.error(
                        format!(
                            "expected a value for `{key}`: {expected}, found `{}`",
                            describe(t)
                        ),
                        t.span(),
                    );
                    return None;
                }
            },
        };
        if let Some(extra) = rest.get(1) {
            self.error(
                format!(
                    "unexpected `{}` after `{key} = {value}`; expected `,` or `)`",
                    describe(extra)
                ),
                extra.span(),
            );
            return None;
        }
        let span = key.span.join(value.span());
        Some(Arg::Key { key, value, span })
    }
}

fn is_punct(t: &TokenTree, c: char) -> bool {
    matches!(t, TokenTree::Punct { ch, .. } if *ch == c)
}

/// `t` as a NAME: an identifier, or an identifier-like integer literal (`1f1b`).
fn name_of(t: &TokenTree) -> Option<Ident> {
    match t {
        TokenTree::Ident { text, span } => {
            let name = text.strip_prefix("r#").unwrap_or(text);
            Some(Ident::new(name, *span))
        }
        TokenTree::Literal { text, span } => {
            is_name_literal(text).then(|| Ident::new(text.clone(), *span))
        }
        _ => None,
    }
}

/// A literal that reads as a name: a digit, then ASCII letters, digits and `_`,
/// with at least one letter (`1f1b`, `2bp`, but not `2`, `2.5` or `"x"`).
fn is_name_literal(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_digit())
        && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && text.chars().any(|c| c.is_ascii_alphabetic())
}

/// A plain decimal integer, `_` separators allowed (`2`, `1_000`).
fn is_integer_text(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_digit())
        && text.chars().all(|c| c.is_ascii_digit() || c == '_')
}

/// The token as the user wrote it, shortened for messages.
fn describe(t: &TokenTree) -> String {
    match t {
        TokenTree::Group { delimiter, .. } => match delimiter {
            Delimiter::Parenthesis => "(...)".to_string(),
            Delimiter::Bracket => "[...]".to_string(),
            Delimiter::Brace => "{...}".to_string(),
        },
        TokenTree::Ident { text, .. } | TokenTree::Literal { text, .. } => shorten(text),
        TokenTree::Punct { ch, .. } => ch.to_string(),
    }
}

fn shorten(text: &str) -> String {
    const MAX: usize = 40;
    if text.chars().count() <= MAX {
        text.to_string()
    } else {
        let head: String = text.chars().take(MAX).collect();
        format!("{head}...")
    }
}

/// A message for text the Rust tokenizer rejects, naming the likely cause.
pub(super) fn lex_message(text: &str) -> String {
    let mut open: Vec<char> = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                // A line comment: skip to the end of the line.
                for d in chars.by_ref() {
                    if d == '\n' {
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut depth = 1usize;
                while depth > 0 {
                    match chars.next() {
                        Some('*') if chars.peek() == Some(&'/') => {
                            chars.next();
                            depth -= 1;
                        }
                        Some('/') if chars.peek() == Some(&'*') => {
                            chars.next();
                            depth += 1;
                        }
                        Some(_) => {}
                        None => return "unterminated `/* ... */` comment".to_string(),
                    }
                }
            }
            '"' => {
                let mut closed = false;
                while let Some(d) = chars.next() {
                    if d == '\\' {
                        chars.next();
                    } else if d == '"' {
                        closed = true;
                        break;
                    }
                }
                if !closed {
                    return "unterminated string; schedule expressions take names such as \
                            `1f1b`, not strings"
                        .to_string();
                }
            }
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => match open.pop() {
                None => return format!("unexpected `{c}`: it closes nothing that is open"),
                Some(o) if closing(o) != c => {
                    return format!(
                        "mismatched `{c}`: the innermost open delimiter is `{o}`, \
                         expected `{}`",
                        closing(o)
                    )
                }
                Some(_) => {}
            },
            _ => {}
        }
    }
    if let Some(&c) = open.last() {
        return format!("unclosed `{c}`; expected a matching `{}`", closing(c));
    }
    "cannot read the schedule expression: it holds a character or literal that no \
     expression can (an expression is names such as `1f1b`, parentheses, commas and \
     `key = value` arguments)"
        .to_string()
}

fn closing(open: char) -> char {
    match open {
        '(' => ')',
        '[' => ']',
        _ => '}',
    }
}

#[cfg(test)]
mod tests {
    use super::super::render_error;
    use super::*;

    fn ok(text: &str) -> Expr {
        parse_str(text).unwrap_or_else(|errs| {
            let shown: Vec<String> = errs.iter().map(|e| render_error(text, e)).collect();
            panic!("`{text}` failed:\n{}", shown.join("\n"))
        })
    }

    fn errs(text: &str) -> Vec<ExprError> {
        match parse_str(text) {
            Ok(e) => panic!("`{text}` parsed as `{e}`"),
            Err(errs) => errs,
        }
    }

    /// The one error for `text`, rendered.
    fn rendered(text: &str) -> String {
        let errs = errs(text);
        assert_eq!(errs.len(), 1, "{errs:?}");
        render_error(text, &errs[0])
    }

    #[test]
    fn round_trips_every_form() {
        for text in [
            "gpipe",
            "1f1b",
            "2bp",
            "zbh1",
            "zbv",
            "dualpipev",
            "interleaved(v = 2)",
            "split_w(zbv)",
            "transpose(vision, zbv)",
            "fill(audio, 1f1b)",
            "transpose(vision, fill(audio, zbv))",
            "transpose(vision, interleaved(v = 2), owners = min, backward = central)",
            "fill(audio, split_w(zbh1), chunks = 4)",
        ] {
            let e = ok(text);
            assert_eq!(e.to_string(), text);
            assert_eq!(ok(&e.to_string()), e);
        }
    }

    #[test]
    fn canonical_form_normalises_spacing_and_trailing_commas() {
        let e = ok("  transpose (\n vision ,zbv , )  ");
        assert_eq!(e.to_string(), "transpose(vision, zbv)");
        assert_eq!(ok("interleaved(v=2,)").to_string(), "interleaved(v = 2)");
        assert_eq!(
            ok("interleaved(v = 1_0)").to_string(),
            "interleaved(v = 10)"
        );
        assert_eq!(ok("r#type").to_string(), "type");
    }

    #[test]
    fn one_f_one_b_is_a_name() {
        let e = ok("1f1b");
        assert_eq!(e.name(), "1f1b");
        assert!(e.args.is_empty());
        let e = ok("transpose(vision, 1f1b)");
        assert_eq!(e.positional().nth(1).map(Expr::name), Some("1f1b"));
    }

    #[test]
    fn nested_structure_and_accessors() {
        let e = ok("transpose(vision, fill(audio, zbv), owners = min)");
        assert_eq!(e.name(), "transpose");
        let pos: Vec<&Expr> = e.positional().collect();
        assert_eq!(pos.len(), 2);
        assert_eq!(pos[0].name(), "vision");
        assert_eq!(pos[1].name(), "fill");
        let inner: Vec<&str> = pos[1].positional().map(Expr::name).collect();
        assert_eq!(inner, ["audio", "zbv"]);
        assert_eq!(e.find_key("owners").and_then(Value::as_name), Some("min"));
        assert_eq!(e.find_key("v"), None);
    }

    #[test]
    fn keyword_args() {
        let e = ok("interleaved(v = 2)");
        assert_eq!(e.find_key("v").and_then(Value::as_int), Some(2));
        assert_eq!(e.positional().count(), 0);
        let e = ok("transpose(vision, zbv, backward = central, owners = round_robin)");
        let keys: Vec<String> = e.keys().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(keys, ["backward=central", "owners=round_robin"]);
        let e = ok("x(big = 18446744073709551615)");
        assert_eq!(e.find_key("big").and_then(Value::as_int), Some(u64::MAX));
    }

    #[test]
    fn spans_cover_the_written_text() {
        let text = "transpose(vision, interleaved(v = 2))";
        let e = ok(text);
        let (s, t) = (e.span.start(text), e.span.end(text));
        assert_eq!((s.line, s.column, t.column), (1, 0, text.len()));
        let inner = e.positional().nth(1).unwrap();
        assert_eq!(inner.span.start(text).column, 18);
        assert_eq!(inner.head.span.end(text).column, 29);
        match &inner.args[0] {
            Arg::Key { span, value, .. } => {
                assert_eq!((span.start(text).column, span.end(text).column), (30, 35));
                assert_eq!(value.span().start(text).column, 34);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rejects_strings_with_span_on_the_string() {
        assert_eq!(
            rendered("\"x\""),
            "expected a schedule name such as `1f1b`, found `\"x\"`\n  |\n1 | \"x\"\n  | ^^^"
        );
        let r = rendered("transpose(\"vision\", zbv)");
        assert!(
            r.starts_with("expected an argument: a schedule such as `1f1b`"),
            "{r}"
        );
        assert!(r.contains("found `\"vision\"`"), "{r}");
        assert!(r.ends_with("\n  |           ^^^^^^^^"), "{r}");
    }

    #[test]
    fn rejects_floats() {
        let r = rendered("interleaved(v = 2.5)");
        assert!(
            r.starts_with("expected a value for `v`: an integer such as `2`"),
            "{r}"
        );
        assert!(r.contains("found `2.5`"), "{r}");
        assert!(r.ends_with("\n  |                 ^^^"), "{r}");
        let r = rendered("2.5");
        assert!(r.starts_with("expected a schedule name such as `1f1b`, found `2.5`"));
        let r = rendered("7");
        assert!(r.contains("found `7`"), "{r}");
    }

    #[test]
    fn rejects_trailing_junk() {
        let r = rendered("zbv extra");
        assert!(
            r.starts_with("unexpected `extra` after `zbv`; expected the end"),
            "{r}"
        );
        assert!(r.ends_with("\n  |     ^^^^^"), "{r}");
        let r = rendered("interleaved(v = 2) (x)");
        assert!(
            r.contains("unexpected `(...)` after `interleaved(v = 2)`"),
            "{r}"
        );
        let r = rendered("v = 2");
        assert!(r.contains("go inside an operator's parentheses"), "{r}");
        assert!(r.ends_with("\n  |   ^"), "{r}");
        let r = rendered("transpose(vision zbv)");
        assert!(r.starts_with("unexpected `zbv` after `vision`; expected `,` or `)`"));
        assert!(r.ends_with("\n  |                  ^^^"), "{r}");
        let r = rendered("interleaved(v = 2 3)");
        assert!(r.starts_with("unexpected `3` after `v = 2`; expected `,` or `)`"));
        let r = rendered("interleaved(v: 2)");
        assert!(r.contains("(write `key = value`)"), "{r}");
    }

    #[test]
    fn rejects_empty_input_and_empty_arguments() {
        for text in ["", "   ", "// just a comment"] {
            let e = errs(text);
            assert_eq!(e.len(), 1);
            assert!(e[0].message.contains("found nothing"), "{}", e[0]);
            // Rendering a span-less error does not panic.
            let _ = render_error(text, &e[0]);
        }
        let r = rendered("split_w()");
        assert!(r.starts_with("expected at least one argument inside `split_w(...)`"));
        assert!(r.ends_with("\n  |        ^^"), "{r}");
        let r = rendered("fill(, zbv)");
        assert!(r.starts_with("expected an argument before `,`"), "{r}");
        assert!(r.ends_with("\n  |      ^"), "{r}");
        let r = rendered("interleaved(v = )");
        assert!(r.starts_with("expected a value after `v =`"), "{r}");
        assert!(r.ends_with("\n  |               ^"), "{r}");
    }

    #[test]
    fn rejects_other_delimiters_and_duplicate_keys() {
        let r = rendered("transpose[vision, zbv]");
        assert!(
            r.contains("found `[...]`") || r.contains("unexpected `[...]`"),
            "{r}"
        );
        let r = rendered("interleaved(v = 2, v = 3)");
        assert!(
            r.starts_with("duplicate key `v` in `interleaved(...)`"),
            "{r}"
        );
        assert!(r.ends_with("\n  |                    ^"), "{r}");
        let r = rendered("x(v = -1)");
        assert!(r.contains("found `-`"), "{r}");
        let r = rendered("x(v = 99999999999999999999)");
        assert!(r.contains("is too large"), "{r}");
    }

    #[test]
    fn nesting_is_limited_with_an_error_not_a_stack_overflow() {
        let nest = |n: usize| format!("{}1f1b{}", "split_w(".repeat(n), ")".repeat(n));
        assert!(parse_str(&nest(MAX_DEPTH)).is_ok());
        for text in [nest(MAX_DEPTH + 1), nest(20_000)] {
            let e = errs(&text);
            assert_eq!(e.len(), 1, "{e:?}");
            assert!(e[0].message.contains("at most 64"), "{}", e[0].message);
        }
        // The token path (the macro's) has its own guard.
        let tokens = lex(&nest(MAX_DEPTH + 1)).unwrap();
        let e = parse(&tokens).unwrap_err();
        assert_eq!(e.len(), 1);
        assert!(e[0].message.contains("65 levels"), "{}", e[0].message);
    }

    #[test]
    fn reports_every_error() {
        let text = "transpose(\"vision\", fill(audio, 2.5), owners = 1.5, zbv zbv)";
        let errs = errs(text);
        let found: Vec<(usize, &str)> = errs
            .iter()
            .map(|e| (e.span.start(text).column, e.message.as_str()))
            .collect();
        assert_eq!(errs.len(), 4, "{found:?}");
        let cols: Vec<usize> = found.iter().map(|(c, _)| *c).collect();
        assert_eq!(cols, [10, 32, 47, 56]);
        assert!(found[1].1.contains("found `2.5`"));
        assert!(found[2].1.contains("for `owners`"));
    }

    #[test]
    fn lex_errors_become_one_error() {
        let r = rendered("transpose(vision, zbv");
        assert!(
            r.starts_with("unclosed `(`; expected a matching `)`"),
            "{r}"
        );
        let r = rendered("zbv)");
        assert!(r.starts_with("unexpected `)`"), "{r}");
        let r = rendered("x(\"abc");
        assert!(r.starts_with("unterminated string"), "{r}");
        let r = rendered("transpose(vision, zbv]");
        assert!(r.starts_with("mismatched `]`"), "{r}");
        assert!(r.contains("expected `)`"), "{r}");
        let r = rendered("zbv /* (");
        assert!(r.starts_with("unterminated `/* ... */` comment"), "{r}");
        let r = rendered("f(x, \u{20ac})");
        assert!(r.starts_with("cannot read the schedule expression"), "{r}");
        assert!(r.ends_with("\n  |      ^"), "{r}");
    }

    #[test]
    fn render_points_at_the_right_line_and_column() {
        let text = "transpose(\n    vision,\n    zbv 2\n)";
        let r = rendered(text);
        assert_eq!(
            r,
            "unexpected `2` after `zbv`; expected `,` or `)`\n  |\n3 |     zbv 2\n  |         ^"
        );
        // Non-ASCII text before the span: columns are in characters.
        let text = "fill(vïsion, é 1)";
        let r = rendered(text);
        assert!(r.ends_with("\n  |                ^"), "{r}");
        // Tabs are kept so the caret lines up.
        let r = rendered("\tzbv x");
        assert!(r.ends_with("\n  | \t    ^"), "{r:?}");
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z_][a-z0-9_]{0,6}",
            "[0-9][a-z][a-z0-9_]{0,4}",
            Just("1f1b".to_string()),
        ]
        .prop_filter("not a keyword that lexes oddly", |s| s != "_")
    }

    fn expr() -> impl Strategy<Value = String> {
        let leaf = name();
        leaf.prop_recursive(3, 24, 4, |inner| {
            (
                name(),
                prop::collection::vec(
                    prop_oneof![
                        inner,
                        (name(), any::<u64>()).prop_map(|(k, v)| format!("{k} = {v}")),
                        (name(), name()).prop_map(|(k, v)| format!("{k} = {v}")),
                    ],
                    1..4,
                ),
            )
                .prop_map(|(h, args)| format!("{h}({})", args.join(", ")))
        })
    }

    proptest! {
        #[test]
        fn canonical_text_round_trips(text in expr()) {
            // Generated keys may repeat; those are errors, not round-trip failures.
            if let Ok(e) = parse_str(&text) {
                prop_assert_eq!(e.to_string(), text.clone());
                prop_assert_eq!(parse_str(&e.to_string()).ok(), Some(e));
            }
        }

        #[test]
        fn never_panics(text in "\\PC{0,40}") {
            if let Err(errs) = parse_str(&text) {
                prop_assert!(!errs.is_empty());
                for e in &errs {
                    let _ = super::super::render_error(&text, e);
                }
            }
        }

        #[test]
        fn never_panics_on_token_soup(
            parts in prop::collection::vec(
                prop_oneof![
                    Just("("), Just(")"), Just(","), Just("="), Just("x"), Just("1f1b"),
                    Just("2"), Just("2.5"), Just("\"s\""), Just("["), Just("]"), Just("-"),
                ],
                0..16,
            )
        ) {
            let text = parts.join(" ");
            if let Err(errs) = parse_str(&text) {
                prop_assert!(!errs.is_empty());
                for e in &errs {
                    let _ = super::super::render_error(&text, e);
                }
            }
        }
    }
}
