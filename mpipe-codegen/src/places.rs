//! The schedule expression between the compiler and mpipe-core: the macro's tokens
//! as mpipe-core's tokens, each placed at a byte range of a text made for them, and
//! those places mapped back to the compiler's spans for the errors.
//!
//! The text is the tokens as written, one space apart (a group: its delimiters
//! around its tokens); mpipe-core never reads it, only the ranges. Invisible groups
//! (what `macro_rules!` wraps around a substituted fragment) are looked through.

use mpipe_core::expr::{Delimiter as CoreDelimiter, Span as Place, TokenTree as CoreTree};
use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};

/// Where each token of an expression was placed, and its compiler span.
#[derive(Debug, Default)]
pub struct Places {
    /// Every token's place and span; for a group, also its closing delimiter's.
    spans: Vec<(Place, Span)>,
}

/// `tokens` as mpipe-core's tokens, and where each was placed.
pub fn tokens(tokens: TokenStream) -> (Vec<CoreTree>, Places) {
    let mut places = Places::default();
    let mut at = 0;
    let trees = walk(tokens, &mut at, &mut places.spans);
    (trees, places)
}

fn walk(tokens: TokenStream, at: &mut usize, spans: &mut Vec<(Place, Span)>) -> Vec<CoreTree> {
    let mut out = Vec::new();
    let place = |len: usize, span: Span, at: &mut usize, spans: &mut Vec<(Place, Span)>| {
        let p = Place::new(*at, *at + len);
        *at += len + 1;
        spans.push((p, span));
        p
    };
    for t in tokens {
        match t {
            TokenTree::Group(g) => {
                let delimiter = match g.delimiter() {
                    Delimiter::Parenthesis => CoreDelimiter::Parenthesis,
                    Delimiter::Bracket => CoreDelimiter::Bracket,
                    Delimiter::Brace => CoreDelimiter::Brace,
                    Delimiter::None => {
                        out.extend(walk(g.stream(), at, spans));
                        continue;
                    }
                };
                let lo = *at;
                *at += 2;
                let inner = walk(g.stream(), at, spans);
                let close = Place::new(*at, *at + 1);
                *at += 2;
                let span = Place::new(lo, close.hi);
                spans.push((span, g.span()));
                spans.push((close, g.span_close()));
                out.push(CoreTree::Group {
                    delimiter,
                    tokens: inner,
                    span,
                    close,
                });
            }
            TokenTree::Ident(id) => {
                let text = id.to_string();
                let span = place(text.len(), id.span(), at, spans);
                out.push(CoreTree::Ident { text, span });
            }
            TokenTree::Literal(lit) => {
                let text = lit.to_string();
                let span = place(text.len(), lit.span(), at, spans);
                out.push(CoreTree::Literal { text, span });
            }
            TokenTree::Punct(p) => {
                let ch = p.as_char();
                let span = place(ch.len_utf8(), p.span(), at, spans);
                out.push(CoreTree::Punct { ch, span });
            }
        }
    }
    out
}

impl Places {
    /// The compiler's span for `place`: the token's (or group's) placed there; for
    /// a place over several tokens (an operator with its arguments, `key = value`),
    /// the first token's joined to the last's where the compiler can join spans,
    /// else the first token's; for no place of its own ([`Place::NONE`]), the
    /// macro's call site.
    pub fn span(&self, place: Place) -> Span {
        if place.is_empty() {
            return Span::call_site();
        }
        if let Some((_, s)) = self.spans.iter().find(|(p, _)| *p == place) {
            return *s;
        }
        let widest = |hit: &dyn Fn(&Place) -> bool| {
            self.spans
                .iter()
                .filter(|(p, _)| hit(p))
                .max_by_key(|(p, _)| p.hi - p.lo)
                .map(|(_, s)| *s)
        };
        let first = widest(&|p| p.lo == place.lo);
        let last = widest(&|p| p.hi == place.hi);
        match (first, last) {
            (Some(a), Some(b)) => a.join(b).unwrap_or(a),
            (Some(a), None) => a,
            _ => Span::call_site(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpipe_core::expr::parse;
    use std::str::FromStr;

    /// Where `place` maps back to, as `line:column-line:column` of the lexed text
    /// (outside a procedural macro, spans carry their place in it).
    fn shown(places: &Places, place: Place) -> String {
        let span = places.span(place);
        let (s, e) = (span.start(), span.end());
        format!("{}:{}-{}:{}", s.line, s.column, e.line, e.column)
    }

    #[test]
    fn places_map_back_to_the_tokens_spans() {
        let text = "transpose(vision, interleaved(v = 2))";
        let ts = TokenStream::from_str(text).unwrap();
        let (trees, places) = tokens(ts);
        let e = parse(&trees).unwrap();
        assert_eq!(e.to_string(), text);
        // The whole expression: from the name to the closing parenthesis.
        assert_eq!(shown(&places, e.span), "1:0-1:37");
        assert_eq!(shown(&places, e.head.span), "1:0-1:9");
        let inner = e.positional().nth(1).unwrap();
        assert_eq!(shown(&places, inner.span), "1:18-1:36");
        let (key, value) = inner.keys().next().unwrap();
        assert_eq!(shown(&places, key.span), "1:30-1:31");
        assert_eq!(shown(&places, value.span()), "1:34-1:35");
        assert_eq!(shown(&places, Place::NONE), "1:0-1:0");
    }

    #[test]
    fn errors_point_at_the_token_and_the_closing_delimiter() {
        let ts = TokenStream::from_str("fill(, zbv) x").unwrap();
        let (trees, places) = tokens(ts);
        let errs = parse(&trees).unwrap_err();
        let at: Vec<String> = errs.iter().map(|e| shown(&places, e.span)).collect();
        assert_eq!(at, ["1:5-1:6", "1:12-1:13"]);
        let ts = TokenStream::from_str("split_w()").unwrap();
        let (trees, places) = tokens(ts);
        let errs = parse(&trees).unwrap_err();
        assert_eq!(shown(&places, errs[0].span), "1:7-1:9");
    }

    #[test]
    fn invisible_groups_are_transparent() {
        let inner = TokenStream::from_str("fill(audio, zbv)").unwrap();
        let outer = TokenStream::from_str("transpose(vision, )").unwrap();
        // Rebuild `transpose(vision, «fill(audio, zbv)»)` with a None-delimited group.
        let mut trees: Vec<TokenTree> = outer.into_iter().collect();
        if let Some(TokenTree::Group(g)) = trees.get_mut(1) {
            let mut args: Vec<TokenTree> = g.stream().into_iter().collect();
            args.push(TokenTree::Group(proc_macro2::Group::new(
                Delimiter::None,
                inner,
            )));
            *g = proc_macro2::Group::new(Delimiter::Parenthesis, args.into_iter().collect());
        }
        let (trees, _) = tokens(trees.into_iter().collect());
        assert_eq!(
            parse(&trees).unwrap().to_string(),
            "transpose(vision, fill(audio, zbv))"
        );
    }
}
