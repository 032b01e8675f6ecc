//! Tokens of a schedule expression, and the lexer that reads them from text.
//!
//! The tokens are Rust's (an expression is written in `schedule!` as Rust tokens
//! and on the command line as text that lexes the same way): identifiers (`zbv`,
//! `r#type`, `vïsion`), literals (`2`, `1f1b`, `2.5`, `"x"`, `'c'`), single
//! punctuation characters and delimited groups. The parser needs only names,
//! integers, `,`, `=` and parentheses; the lexer reads the rest of Rust's tokens so
//! that what a writer got wrong is named as written (`found "vision"`) rather than
//! as a character it could not read.

use super::span::Span;
use super::ExprError;

/// How a group is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delimiter {
    /// `( ... )`
    Parenthesis,
    /// `[ ... ]`
    Bracket,
    /// `{ ... }`
    Brace,
}

/// One token, or a delimited group of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenTree {
    /// An identifier as written, with any `r#` prefix.
    Ident { text: String, span: Span },
    /// A literal as written (`2`, `1_000`, `1f1b`, `2.5`, `"x"`).
    Literal { text: String, span: Span },
    /// One punctuation character.
    Punct { ch: char, span: Span },
    /// A delimited group: `span` from the opening delimiter to the closing one,
    /// `close` the closing one alone.
    Group {
        delimiter: Delimiter,
        tokens: Vec<TokenTree>,
        span: Span,
        close: Span,
    },
}

impl TokenTree {
    /// Where it was written.
    pub fn span(&self) -> Span {
        match self {
            TokenTree::Ident { span, .. }
            | TokenTree::Literal { span, .. }
            | TokenTree::Punct { span, .. }
            | TokenTree::Group { span, .. } => *span,
        }
    }
}

/// The tokens of `text`.
///
/// # Errors
/// Where the text stops lexing (an unclosed or unmatched delimiter, an unterminated
/// string or comment, a character no token starts with), with a message naming the
/// likely cause.
pub fn lex(text: &str) -> Result<Vec<TokenTree>, ExprError> {
    let fail = |at: usize| ExprError::new(super::parse::lex_message(text), Span::new(at, at));
    let mut at = if text.starts_with('\u{feff}') { 3 } else { 0 };
    // The groups open, each with where it opened, its delimiter and the tokens
    // before it.
    let mut open: Vec<(usize, Delimiter, Vec<TokenTree>)> = Vec::new();
    let mut tokens: Vec<TokenTree> = Vec::new();
    loop {
        at = skip_space(text, at);
        if let Some(end) = doc_comment(text, at, &mut tokens) {
            at = end;
            continue;
        }
        let rest = &text[at..];
        let Some(first) = rest.chars().next() else {
            return match open.last() {
                None => Ok(tokens),
                Some(&(lo, ..)) => Err(fail(lo)),
            };
        };
        if let Some(d) = opening(first) {
            open.push((at, d, std::mem::take(&mut tokens)));
            at += 1;
        } else if let Some(d) = closing(first) {
            match open.pop() {
                Some((lo, delimiter, outer)) if delimiter == d => {
                    let inner = std::mem::replace(&mut tokens, outer);
                    tokens.push(TokenTree::Group {
                        delimiter,
                        tokens: inner,
                        span: Span::new(lo, at + 1),
                        close: Span::new(at, at + 1),
                    });
                    at += 1;
                }
                _ => return Err(fail(at)),
            }
        } else {
            let Some((end, token)) = leaf(text, at) else {
                return Err(fail(at));
            };
            tokens.push(token);
            at = end;
        }
    }
}

fn opening(c: char) -> Option<Delimiter> {
    match c {
        '(' => Some(Delimiter::Parenthesis),
        '[' => Some(Delimiter::Bracket),
        '{' => Some(Delimiter::Brace),
        _ => None,
    }
}

fn closing(c: char) -> Option<Delimiter> {
    match c {
        ')' => Some(Delimiter::Parenthesis),
        ']' => Some(Delimiter::Bracket),
        '}' => Some(Delimiter::Brace),
        _ => None,
    }
}

fn is_space(c: char) -> bool {
    // Rust also reads the left-to-right and right-to-left marks as white space.
    c.is_whitespace() || c == '\u{200e}' || c == '\u{200f}'
}

fn is_ident_start(c: char) -> bool {
    c == '_' || unicode_ident::is_xid_start(c)
}

fn is_ident_continue(c: char) -> bool {
    unicode_ident::is_xid_continue(c)
}

/// Past white space and (non-doc) comments from `at`; an unterminated block
/// comment is left for the caller to fail on.
fn skip_space(text: &str, mut at: usize) -> usize {
    loop {
        let rest = &text[at..];
        if rest.starts_with("//") && !is_doc_line(rest) {
            at += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") && !is_doc_block(rest) {
            match block_comment(rest) {
                Some(len) => at += len,
                None => return at,
            }
        } else {
            match rest.chars().next() {
                Some(c) if is_space(c) => at += c.len_utf8(),
                _ => return at,
            }
        }
    }
}

/// `///` (not `////`) or `//!`.
fn is_doc_line(rest: &str) -> bool {
    (rest.starts_with("///") && !rest.starts_with("////")) || rest.starts_with("//!")
}

/// `/**` (not `/***` nor `/**/`) or `/*!`.
fn is_doc_block(rest: &str) -> bool {
    (rest.starts_with("/**") && !rest.starts_with("/***") && !rest.starts_with("/**/"))
        || rest.starts_with("/*!")
}

/// The length of the (nested) block comment `rest` starts with, if it ends.
fn block_comment(rest: &str) -> Option<usize> {
    let b = rest.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'/' && b[i + 1] == b'*' {
            depth += 1;
            i += 2;
        } else if b[i] == b'*' && b[i + 1] == b'/' {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return Some(i);
            }
        } else {
            i += 1;
        }
    }
    None
}

/// A doc comment at `at`, as Rust reads it: `#`, `!` for an inner one, and
/// `[doc = "..."]`, every token spanning the comment. Returns where it ends.
fn doc_comment(text: &str, at: usize, tokens: &mut Vec<TokenTree>) -> Option<usize> {
    let rest = &text[at..];
    let (len, body, inner) = if rest.starts_with("//!") || is_doc_line(rest) {
        let len = rest.find('\n').unwrap_or(rest.len());
        let body = rest[3..len].strip_suffix('\r').unwrap_or(&rest[3..len]);
        (len, body, rest.starts_with("//!"))
    } else if is_doc_block(rest) {
        let len = block_comment(rest)?;
        (len, &rest[3..len - 2], rest.starts_with("/*!"))
    } else {
        return None;
    };
    let span = Span::new(at, at + len);
    tokens.push(TokenTree::Punct { ch: '#', span });
    if inner {
        tokens.push(TokenTree::Punct { ch: '!', span });
    }
    tokens.push(TokenTree::Group {
        delimiter: Delimiter::Bracket,
        tokens: vec![
            TokenTree::Ident {
                text: "doc".into(),
                span,
            },
            TokenTree::Punct { ch: '=', span },
            TokenTree::Literal {
                text: format!("{body:?}"),
                span,
            },
        ],
        span,
        close: span,
    });
    Some(at + len)
}

/// The token at `at` (not a delimiter): a literal, a punctuation character or an
/// identifier, with where it ends.
fn leaf(text: &str, at: usize) -> Option<(usize, TokenTree)> {
    let rest = &text[at..];
    let make = |len: usize, f: fn(String, Span) -> TokenTree| {
        Some((
            at + len,
            f(rest[..len].to_string(), Span::new(at, at + len)),
        ))
    };
    if let Some(len) = literal(rest) {
        return make(len, |text, span| TokenTree::Literal { text, span });
    }
    if let Some(ch) = punct(rest) {
        let len = ch.len_utf8();
        return Some((
            at + len,
            TokenTree::Punct {
                ch,
                span: Span::new(at, at + len),
            },
        ));
    }
    let len = ident(rest)?;
    make(len, |text, span| TokenTree::Ident { text, span })
}

/// A punctuation character; `'` only where it starts a lifetime (`'a`).
fn punct(rest: &str) -> Option<char> {
    if rest.starts_with("//") || rest.starts_with("/*") {
        return None;
    }
    let c = rest.chars().next()?;
    if !"~!@#$%^&*-=+|;:,<.>/?'".contains(c) {
        return None;
    }
    if c == '\'' {
        let after = &rest[1..];
        let len = ident_any(after)?;
        let next = &after[len..];
        if next.starts_with('\'') || (next.starts_with('#') && !after.starts_with("r#")) {
            return None;
        }
    }
    Some(c)
}

/// An identifier (not the start of a prefixed literal such as `r"..."`).
fn ident(rest: &str) -> Option<usize> {
    const LITERAL_PREFIXES: [&str; 10] = [
        "r\"", "r#\"", "r##", "b\"", "b'", "br\"", "br#", "c\"", "cr\"", "cr#",
    ];
    if LITERAL_PREFIXES.iter().any(|p| rest.starts_with(p)) {
        return None;
    }
    ident_any(rest)
}

/// An identifier, raw (`r#type`) or not.
fn ident_any(rest: &str) -> Option<usize> {
    if let Some(after) = rest.strip_prefix("r#") {
        let len = bare_ident(after)?;
        let name = &after[..len];
        if matches!(name, "_" | "super" | "self" | "Self" | "crate") {
            return None;
        }
        return Some(2 + len);
    }
    bare_ident(rest)
}

/// An identifier without `r#`.
fn bare_ident(rest: &str) -> Option<usize> {
    let mut chars = rest.char_indices();
    match chars.next() {
        Some((_, c)) if is_ident_start(c) => {}
        _ => return None,
    }
    Some(
        chars
            .find(|&(_, c)| !is_ident_continue(c))
            .map_or(rest.len(), |(i, _)| i),
    )
}

/// `len` plus the literal suffix (an identifier) that follows, if any.
fn suffixed(rest: &str, len: usize) -> usize {
    len + bare_ident(&rest[len..]).unwrap_or(0)
}

/// The length of the literal `rest` starts with.
fn literal(rest: &str) -> Option<usize> {
    if let Some(after) = rest.strip_prefix('"') {
        return quoted(after, Quote::Str).map(|n| suffixed(rest, 1 + n));
    }
    for (prefix, quote) in [("b\"", Quote::Bytes), ("c\"", Quote::CStr)] {
        if let Some(after) = rest.strip_prefix(prefix) {
            return quoted(after, quote).map(|n| suffixed(rest, 2 + n));
        }
    }
    for prefix in ["r", "br", "cr"] {
        if let Some(after) = rest.strip_prefix(prefix) {
            if after.starts_with(['"', '#']) {
                return raw(after, prefix == "br").map(|n| suffixed(rest, prefix.len() + n));
            }
        }
    }
    if let Some(after) = rest.strip_prefix("b'") {
        return char_body(after, true).map(|n| suffixed(rest, 2 + n));
    }
    if let Some(after) = rest.strip_prefix('\'') {
        return char_body(after, false).map(|n| suffixed(rest, 1 + n));
    }
    number(rest)
}

#[derive(Clone, Copy, PartialEq)]
enum Quote {
    Str,
    Bytes,
    CStr,
}

/// The length of a quoted string's body and closing quote (`after` follows the
/// opening quote).
fn quoted(after: &str, quote: Quote) -> Option<usize> {
    let mut chars = after.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some(i + 1),
            '\r' if chars.peek().map(|&(_, d)| d) != Some('\n') => return None,
            '\\' => {
                let (_, e) = chars.next()?;
                match e {
                    'n' | 'r' | 't' | '\\' | '\'' | '"' => {}
                    '0' if quote != Quote::CStr => {}
                    'x' => {
                        let hi = chars.next()?.1;
                        let lo = chars.next()?.1;
                        let ok = match quote {
                            Quote::Str => ('0'..='7').contains(&hi) && lo.is_ascii_hexdigit(),
                            Quote::Bytes => hi.is_ascii_hexdigit() && lo.is_ascii_hexdigit(),
                            Quote::CStr => {
                                hi.is_ascii_hexdigit()
                                    && lo.is_ascii_hexdigit()
                                    && (hi, lo) != ('0', '0')
                            }
                        };
                        if !ok {
                            return None;
                        }
                    }
                    'u' if quote != Quote::Bytes => {
                        let value = unicode_escape(&mut chars)?;
                        if quote == Quote::CStr && value == '\0' {
                            return None;
                        }
                    }
                    '\n' | '\r' => {
                        // A line continuation: the white space after it is skipped.
                        if e == '\r' && chars.next().map(|(_, d)| d) != Some('\n') {
                            return None;
                        }
                        while chars
                            .peek()
                            .is_some_and(|&(_, d)| matches!(d, ' ' | '\t' | '\n' | '\r'))
                        {
                            chars.next();
                        }
                    }
                    _ => return None,
                }
            }
            '\0' if quote == Quote::CStr => return None,
            c if quote == Quote::Bytes && !c.is_ascii() => return None,
            _ => {}
        }
    }
    None
}

/// `{XXXX}` after `\u`: one to six hex digits (`_` allowed after the first).
fn unicode_escape(chars: &mut impl Iterator<Item = (usize, char)>) -> Option<char> {
    if chars.next()?.1 != '{' {
        return None;
    }
    let mut value = 0u32;
    let mut digits = 0;
    for (_, c) in chars {
        match c {
            '_' if digits > 0 => {}
            '}' if digits > 0 => return char::from_u32(value),
            c if c.is_ascii_hexdigit() && digits < 6 => {
                value = value * 16 + c.to_digit(16)?;
                digits += 1;
            }
            _ => return None,
        }
    }
    None
}

/// The length of a raw string after its prefix (`after` starts at the `#`s or the
/// quote): `#"..."#`.
fn raw(after: &str, ascii: bool) -> Option<usize> {
    let hashes = after.bytes().take_while(|&b| b == b'#').count();
    if hashes > 255 || after.as_bytes().get(hashes) != Some(&b'"') {
        return None;
    }
    let body = &after[hashes + 1..];
    let close = format!("\"{}", "#".repeat(hashes));
    let bytes = body.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'"' && body[i..].starts_with(&close) {
            return Some(hashes + 1 + i + close.len());
        }
        if (b == b'\r' && bytes.get(i + 1) != Some(&b'\n')) || (ascii && !b.is_ascii()) {
            return None;
        }
    }
    None
}

/// The length of a character literal's body and closing quote (`after` follows
/// the opening quote).
fn char_body(after: &str, byte: bool) -> Option<usize> {
    let mut chars = after.char_indices();
    let (_, c) = chars.next()?;
    if c == '\\' {
        let (_, e) = chars.next()?;
        match e {
            'n' | 'r' | 't' | '\\' | '0' | '\'' | '"' => {}
            'x' => {
                let hi = chars.next()?.1;
                let lo = chars.next()?.1;
                let first_ok = if byte {
                    hi.is_ascii_hexdigit()
                } else {
                    ('0'..='7').contains(&hi)
                };
                if !first_ok || !lo.is_ascii_hexdigit() {
                    return None;
                }
            }
            'u' if !byte => {
                unicode_escape(&mut chars)?;
            }
            _ => return None,
        }
    } else if byte && !c.is_ascii() {
        return None;
    }
    let (i, q) = chars.next()?;
    (q == '\'').then_some(i + 1)
}

/// The length of the number `rest` starts with: a float (`2.5`, `1e3`) or an
/// integer (`2`, `0x1f`, `1_000`), either with a suffix (`1f1b` is the integer `1`
/// with the suffix `f1b`).
fn number(rest: &str) -> Option<usize> {
    let len = float_digits(rest).or_else(|| int_digits(rest))?;
    let len = match rest[len..].chars().next() {
        Some(c) if is_ident_start(c) => len + bare_ident(&rest[len..])?,
        _ => len,
    };
    // A number runs to the end of a word.
    match rest[len..].chars().next() {
        Some(c) if is_ident_continue(c) => None,
        _ => Some(len),
    }
}

/// The digits of a float: a fraction, an exponent or both.
fn float_digits(rest: &str) -> Option<usize> {
    let b = rest.as_bytes();
    if !b.first()?.is_ascii_digit() {
        return None;
    }
    let mut i = 1;
    let mut dot = false;
    let mut exp = false;
    while let Some(&c) = b.get(i) {
        match c {
            b'0'..=b'9' | b'_' => i += 1,
            b'.' if !dot => {
                // `1..2` is a range and `1.max` a method: not a fraction.
                let next = rest[i + 1..].chars().next();
                if next.is_some_and(|n| n == '.' || is_ident_start(n)) {
                    return None;
                }
                dot = true;
                i += 1;
            }
            b'e' | b'E' => {
                exp = true;
                i += 1;
                break;
            }
            _ => break,
        }
    }
    if !exp {
        return dot.then_some(i);
    }
    // Without a number after the `e`, the float ends before it (if it has a dot).
    let before = dot.then_some(i - 1);
    let mut sign = false;
    let mut value = false;
    while let Some(&c) = b.get(i) {
        match c {
            b'+' | b'-' if !value => {
                if sign {
                    return before;
                }
                sign = true;
                i += 1;
            }
            b'0'..=b'9' => {
                value = true;
                i += 1;
            }
            b'_' => i += 1,
            _ => break,
        }
    }
    if value {
        Some(i)
    } else {
        before
    }
}

/// The digits of an integer, with its base prefix.
fn int_digits(rest: &str) -> Option<usize> {
    let (base, start) = match rest.get(..2) {
        Some("0x") => (16, 2),
        Some("0o") => (8, 2),
        Some("0b") => (2, 2),
        _ => (10, 0),
    };
    let mut len = start;
    let mut empty = true;
    for &c in &rest.as_bytes()[start..] {
        let digit = match c {
            b'0'..=b'9' => u32::from(c - b'0'),
            b'a'..=b'f' => u32::from(c - b'a') + 10,
            b'A'..=b'F' => u32::from(c - b'A') + 10,
            b'_' => {
                if empty && base == 10 {
                    return None;
                }
                len += 1;
                continue;
            }
            _ => break,
        };
        if digit >= base {
            if c.is_ascii_digit() {
                return None;
            }
            break;
        }
        len += 1;
        empty = false;
    }
    (!empty).then_some(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each token's kind and text, groups as their delimiters around their tokens.
    fn shown(text: &str) -> String {
        fn walk(tokens: &[TokenTree], out: &mut Vec<String>) {
            for t in tokens {
                match t {
                    TokenTree::Ident { text, .. } => out.push(format!("i:{text}")),
                    TokenTree::Literal { text, .. } => out.push(format!("l:{text}")),
                    TokenTree::Punct { ch, .. } => out.push(format!("p:{ch}")),
                    TokenTree::Group {
                        delimiter, tokens, ..
                    } => {
                        out.push(format!("{delimiter:?}["));
                        walk(tokens, out);
                        out.push("]".into());
                    }
                }
            }
        }
        let mut out = Vec::new();
        walk(&lex(text).unwrap(), &mut out);
        out.join(" ")
    }

    #[test]
    fn reads_rust_tokens() {
        assert_eq!(
            shown("transpose(vision, 1f1b, v = 2)"),
            "i:transpose Parenthesis[ i:vision p:, l:1f1b p:, i:v p:= l:2 ]"
        );
        assert_eq!(
            shown("r#type 0x1f 1_000 2.5 1e3 1.0e-3f64"),
            "i:r#type l:0x1f l:1_000 l:2.5 l:1e3 l:1.0e-3f64"
        );
        assert_eq!(
            shown(r##""a\"b" r"x" r#"y"# b"z" 'c' b'd' "\u{20ac}""##),
            r##"l:"a\"b" l:r"x" l:r#"y"# l:b"z" l:'c' l:b'd' l:"\u{20ac}""##
        );
        assert_eq!(shown("'a x"), "p:' i:a i:x");
        assert_eq!(shown("1..2 1.max"), "l:1 p:. p:. l:2 l:1 p:. i:max");
        assert_eq!(shown("vïsion // c\n /* a /* b */ */ é"), "i:vïsion i:é");
        assert_eq!(shown("/// d\nx"), "p:# Bracket[ i:doc p:= l:\" d\" ] i:x");
    }

    #[test]
    fn spans_are_byte_ranges() {
        let toks = lex("f(vïsion, x)").unwrap();
        let TokenTree::Group {
            tokens,
            span,
            close,
            ..
        } = &toks[1]
        else {
            panic!("{toks:?}")
        };
        assert_eq!((*span, *close), (Span::new(1, 13), Span::new(12, 13)));
        assert_eq!(tokens[0].span(), Span::new(2, 9));
        assert_eq!(tokens[2].span(), Span::new(11, 12));
    }

    #[test]
    fn stops_where_the_text_stops_lexing() {
        let at = |text: &str| lex(text).unwrap_err().span.lo;
        assert_eq!(at("a(b, c"), 1);
        assert_eq!(at("a)"), 1);
        assert_eq!(at("a(b]"), 3);
        assert_eq!(at("x \"abc"), 2);
        assert_eq!(at("f(x, \u{20ac})"), 5);
        assert_eq!(at("zbv /* ("), 4);
    }
}
