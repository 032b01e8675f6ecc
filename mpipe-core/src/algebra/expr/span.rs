//! Places in a schedule expression's text.
//!
//! A [`Span`] is a byte range into the text an expression was read from: the
//! command line's argument, a profile's field, or the text a caller built from
//! tokens of its own (the `schedule!` macro maps its compiler tokens to a text and
//! back, in `mpipe-codegen`). It is plain data: `Copy`, `Send` and `Sync`, valid on
//! any thread; only the text it points into gives it a line and a column.

/// The bytes `lo..hi` of the expression's text.
///
/// [`Span::NONE`] (`0..0`) stands for no place of its own: an error about the
/// whole input (empty text, too long) or about an expression `auto` built. It reads
/// as the start of the text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Span {
    /// The first byte.
    pub lo: usize,
    /// One past the last byte.
    pub hi: usize,
}

/// A position in a text: `line` counted from 1, `column` in characters from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LineColumn {
    pub line: usize,
    pub column: usize,
}

impl Span {
    /// No place of its own (see [`Span`]).
    pub const NONE: Span = Span { lo: 0, hi: 0 };

    /// The bytes `lo..hi`.
    pub const fn new(lo: usize, hi: usize) -> Span {
        Span { lo, hi }
    }

    /// From the start of the earlier span to the end of the later one.
    #[must_use]
    pub fn join(self, other: Span) -> Span {
        Span {
            lo: self.lo.min(other.lo),
            hi: self.hi.max(other.hi),
        }
    }

    /// Whether it covers no byte.
    pub fn is_empty(self) -> bool {
        self.hi <= self.lo
    }

    /// Where it starts in `text` (the text it was read from).
    pub fn start(self, text: &str) -> LineColumn {
        position(text, self.lo)
    }

    /// Where it ends in `text` (just past its last character).
    pub fn end(self, text: &str) -> LineColumn {
        position(text, self.hi)
    }
}

/// Line and column of byte `offset` in `text` (an offset past the end or inside a
/// character counts as far as the characters before it).
fn position(text: &str, offset: usize) -> LineColumn {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    LineColumn {
        line: 1 + before.bytes().filter(|&b| b == b'\n').count(),
        column: before[line_start..].chars().count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_columns_count_characters() {
        let text = "fill(vïsion,\n  zbv)";
        let at = |lo: usize, hi: usize| {
            let s = Span::new(lo, hi);
            (s.start(text), s.end(text))
        };
        let lc = |line, column| LineColumn { line, column };
        // `vïsion` is 7 bytes, 6 characters.
        assert_eq!(at(5, 12), (lc(1, 5), lc(1, 11)));
        // Just past the newline: the next line's first column.
        assert_eq!(at(14, 15), (lc(2, 0), lc(2, 1)));
        assert_eq!(at(16, 19), (lc(2, 2), lc(2, 5)));
        // Past the end: as far as the text goes; inside a character: before it.
        assert_eq!(Span::new(99, 99).start(text), lc(2, 6));
        assert_eq!(Span::new(7, 7).start(text), lc(1, 6));
        assert_eq!(Span::NONE.start(""), lc(1, 0));
    }

    #[test]
    fn join_covers_both() {
        assert_eq!(Span::new(4, 6).join(Span::new(0, 2)), Span::new(0, 6));
        assert!(Span::NONE.is_empty());
        fn sendable<T: Send + Sync + Copy>() {}
        sendable::<Span>();
    }
}
