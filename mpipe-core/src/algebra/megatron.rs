//! Megatron-LM `--pipeline-model-parallel-layout` strings: how layers map to
//! pipeline stages, stated the way Megatron-core users already write it.
//!
//! A profile may carry one as `llm.layout` (see [`crate::algebra::units::build_units`]); this
//! module only reads and checks the string.
//!
//! # Grammar (Megatron-core's)
//!
//! ```text
//! layout := item*                       every `,` is ignored, wherever it appears
//! item   := atom ( "*" count )?
//! atom   := "E" | "t" | "m" | "L" | "|" | group
//! group  := "(" item+ ")" "*" count     not nested; the count is required
//! count  := digit+                      0 allowed (the atom disappears)
//! ```
//!
//! Symbols: `E` the embedding, `t` a transformer (decoder) layer, `m` a
//! multi-token-prediction (MTP) layer, `L` the loss (LM head and loss). After
//! expanding every repetition, `|` separates stages; empty stages are allowed
//! (`E||t|L` has four stages, the second empty). No other character is accepted,
//! whitespace included.
//!
//! Rules on the expanded layout (Megatron's, independent of the rank count): exactly
//! one `E`, and it is the first layer; exactly one `L`, and it is the last layer; no
//! `t` after the first `m`.
//!
//! # Stages, ranks and chunks
//!
//! The stages are listed in layer (forward) order. With `p` pipeline ranks and `v`
//! virtual chunks per rank (`v = stages / p` in Megatron), stage `i` is chunk
//! `i / p` of rank `i % p`: first chunk 0 of ranks `0 .. p-1`, then chunk 1, and so
//! on ([`MegatronLayout::stage_index`]). That is exactly mpipe's pipeline order
//! `llm.0, llm.1, ..` under the looped placement; under a V-shaped placement the
//! string is still read in pipeline order (stage `k` is `llm.k`).
//!
//! Errors point into the string: [`LayoutError`] displays the message, the string
//! and a caret under the offending characters.

use std::fmt;
use std::str::FromStr;

/// One layer symbol of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerKind {
    /// `E`: the embedding.
    Embedding,
    /// `t`: a transformer (decoder) layer.
    Transformer,
    /// `m`: a multi-token-prediction layer.
    Mtp,
    /// `L`: the loss (LM head and loss).
    Loss,
}

impl LayerKind {
    /// The symbol Megatron uses for this layer.
    pub fn symbol(self) -> char {
        match self {
            LayerKind::Embedding => 'E',
            LayerKind::Transformer => 't',
            LayerKind::Mtp => 'm',
            LayerKind::Loss => 'L',
        }
    }

    /// The layer a symbol stands for, if any.
    pub fn from_symbol(c: char) -> Option<LayerKind> {
        match c {
            'E' => Some(LayerKind::Embedding),
            't' => Some(LayerKind::Transformer),
            'm' => Some(LayerKind::Mtp),
            'L' => Some(LayerKind::Loss),
            _ => None,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            LayerKind::Embedding => "the embedding `E`",
            LayerKind::Transformer => "a transformer layer `t`",
            LayerKind::Mtp => "an MTP layer `m`",
            LayerKind::Loss => "the loss `L`",
        }
    }
}

/// The layers of one pipeline stage, in order (possibly none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stage {
    pub layers: Vec<LayerKind>,
}

impl Stage {
    fn count(&self, kind: LayerKind) -> usize {
        self.layers.iter().filter(|&&k| k == kind).count()
    }

    /// Number of transformer layers (`t`).
    pub fn transformer(&self) -> usize {
        self.count(LayerKind::Transformer)
    }

    /// Number of MTP layers (`m`).
    pub fn mtp(&self) -> usize {
        self.count(LayerKind::Mtp)
    }

    /// Whether the stage holds the embedding (`E`).
    pub fn has_embedding(&self) -> bool {
        self.layers.contains(&LayerKind::Embedding)
    }

    /// Whether the stage holds the loss (`L`).
    pub fn has_loss(&self) -> bool {
        self.layers.contains(&LayerKind::Loss)
    }

    /// Whether the stage holds no layer at all.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

/// A parsed and checked Megatron layout: its stages in layer order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MegatronLayout {
    stages: Vec<Stage>,
}

/// Most layers (and separators) a layout may expand to; guards against `t*99999999`.
pub const MAX_EXPANDED: usize = 1 << 20;

impl MegatronLayout {
    /// Parse `text` and check Megatron's rules (one `E` first, one `L` last, no `t`
    /// after an `m`).
    ///
    /// # Errors
    /// The first problem found, with its position in `text`.
    pub fn parse(text: &str) -> Result<MegatronLayout, LayoutError> {
        let tokens = Parser::new(text).run()?;
        let mut stages = vec![Stage::default()];
        let mut symbols: Vec<(LayerKind, usize)> = Vec::new();
        for tok in &tokens {
            match tok.piece {
                Piece::Bar => stages.push(Stage::default()),
                Piece::Layer(kind) => {
                    if let Some(last) = stages.last_mut() {
                        last.layers.push(kind);
                    }
                    symbols.push((kind, tok.at));
                }
            }
        }
        check_rules(text, &symbols)?;
        Ok(MegatronLayout { stages })
    }

    /// The stages, in layer (pipeline) order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Number of stages (`ranks x chunks`).
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// Total number of transformer layers (`t`); Megatron's `--num-layers`.
    pub fn transformer_layers(&self) -> usize {
        self.stages.iter().map(Stage::transformer).sum()
    }

    /// Total number of MTP layers (`m`); Megatron's `--mtp-num-layers`.
    pub fn mtp_layers(&self) -> usize {
        self.stages.iter().map(Stage::mtp).sum()
    }

    /// The stage holding the embedding.
    pub fn embedding_stage(&self) -> usize {
        self.stages
            .iter()
            .position(Stage::has_embedding)
            .unwrap_or(0)
    }

    /// The stage holding the loss.
    pub fn loss_stage(&self) -> usize {
        self.stages
            .iter()
            .rposition(Stage::has_loss)
            .unwrap_or(self.stages.len() - 1)
    }

    /// Virtual chunks per rank with `ranks` pipeline ranks (Megatron's VPP size), if
    /// the stage count is a multiple of `ranks`.
    pub fn chunks(&self, ranks: usize) -> Option<usize> {
        (ranks > 0 && self.stages.len().is_multiple_of(ranks)).then(|| self.stages.len() / ranks)
    }

    /// Index in the stage list of chunk `chunk` of rank `rank` with `ranks` ranks:
    /// `chunk * ranks + rank` (Megatron lists chunk 0 of every rank first).
    pub fn stage_index(ranks: usize, rank: usize, chunk: usize) -> usize {
        chunk * ranks + rank
    }

    /// The stage of chunk `chunk` on rank `rank` with `ranks` ranks.
    pub fn stage(&self, ranks: usize, rank: usize, chunk: usize) -> Option<&Stage> {
        if rank >= ranks {
            return None;
        }
        self.stages.get(Self::stage_index(ranks, rank, chunk))
    }
}

impl FromStr for MegatronLayout {
    type Err = LayoutError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MegatronLayout::parse(s)
    }
}

/// The canonical text: stages joined by `|`, runs of two or more equal layers written
/// `x*N`. Parsing it gives back the same layout.
impl fmt::Display for MegatronLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, stage) in self.stages.iter().enumerate() {
            if i > 0 {
                f.write_str("|")?;
            }
            let mut j = 0;
            while j < stage.layers.len() {
                let kind = stage.layers[j];
                let run = stage.layers[j..].iter().take_while(|&&k| k == kind).count();
                if run == 1 {
                    write!(f, "{}", kind.symbol())?;
                } else {
                    write!(f, "{}*{run}", kind.symbol())?;
                }
                j += run;
            }
        }
        Ok(())
    }
}

/// Why a layout string was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutError {
    /// The layout string.
    pub text: String,
    /// 0-based character index of the offending part, when there is one.
    pub at: Option<usize>,
    /// Width of the offending part, in characters (at least 1).
    pub width: usize,
    /// What is wrong and what is expected.
    pub message: String,
}

impl LayoutError {
    fn new(text: &str, at: Option<usize>, width: usize, message: String) -> LayoutError {
        LayoutError {
            text: text.to_string(),
            at,
            width: width.max(1),
            message,
        }
    }

    /// The message with its 1-based character position, on one line.
    pub fn summary(&self) -> String {
        match self.at {
            Some(at) => format!("{} (at character {})", self.message, at + 1),
            None => self.message.clone(),
        }
    }
}

/// `message (at character N)`, then the string and a caret line under the offending
/// characters (indented by four spaces).
impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())?;
        if let Some(at) = self.at {
            let shown: String = self
                .text
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            write!(
                f,
                "\n    {shown}\n    {}{}",
                " ".repeat(at),
                "^".repeat(self.width)
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for LayoutError {}

// ---------------------------------------------------------------------------
// Parsing: expand repetitions into a flat list of layers and separators
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Piece {
    Layer(LayerKind),
    Bar,
}

/// An expanded layer or separator and the character it came from.
#[derive(Clone, Copy, Debug)]
struct Tok {
    piece: Piece,
    at: usize,
}

const EXPECTED: &str = "expected `E` (embedding), `t` (transformer layer), `m` (MTP layer), \
                        `L` (loss), `|` (stage separator), `(...)*N`, `*N` or `,`";

struct Parser<'a> {
    text: &'a str,
    /// The characters other than `,`, with their character index in `text`.
    chars: Vec<(usize, char)>,
    pos: usize,
    /// Characters in `text` (for an error at the end).
    len: usize,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        let chars: Vec<(usize, char)> = text
            .chars()
            .enumerate()
            .filter(|&(_, c)| c != ',')
            .collect();
        Parser {
            text,
            chars,
            pos: 0,
            len: text.chars().count(),
        }
    }

    fn err(&self, at: usize, width: usize, message: impl Into<String>) -> LayoutError {
        LayoutError::new(self.text, Some(at), width, message.into())
    }

    fn peek(&self) -> Option<(usize, char)> {
        self.chars.get(self.pos).copied()
    }

    fn run(mut self) -> Result<Vec<Tok>, LayoutError> {
        self.seq(None)
    }

    /// Items up to the end (`open` = None) or up to and including the `)` closing the
    /// group opened at character `open`.
    fn seq(&mut self, open: Option<usize>) -> Result<Vec<Tok>, LayoutError> {
        let mut out: Vec<Tok> = Vec::new();
        loop {
            let Some((at, c)) = self.peek() else {
                return match open {
                    None => Ok(out),
                    Some(o) => Err(self.err(o, 1, "this `(` is never closed; expected `(...)*N`")),
                };
            };
            self.pos += 1;
            let atom: Vec<Tok> =
                if let Some(kind) = LayerKind::from_symbol(c) {
                    vec![Tok {
                        piece: Piece::Layer(kind),
                        at,
                    }]
                } else {
                    match c {
                        '|' => vec![Tok {
                            piece: Piece::Bar,
                            at,
                        }],
                        '(' => {
                            if open.is_some() {
                                return Err(self.err(
                                at,
                                1,
                                "groups cannot be nested: Megatron expands one level of `(...)*N`; \
                                 write the inner group out",
                            ));
                            }
                            let inner = self.seq(Some(at))?;
                            let close = self.chars[self.pos - 1].0;
                            if inner.is_empty() {
                                return Err(self.err(
                                    at,
                                    close - at + 1,
                                    "empty group; expected layers or `|` inside `(...)`",
                                ));
                            }
                            if !matches!(self.peek(), Some((_, '*'))) {
                                return Err(self.err(
                                    close,
                                    1,
                                    "a group must be followed by a repeat count, as in `(tt|)*3`",
                                ));
                            }
                            inner
                        }
                        ')' => {
                            if open.is_some() {
                                return Ok(out);
                            }
                            return Err(self.err(at, 1, "this `)` closes no `(`"));
                        }
                        '*' => return Err(self.err(
                            at,
                            1,
                            "`*` must follow a layer symbol, `|` or a `(...)` group, as in `t*4`",
                        )),
                        c if c.is_ascii_digit() => {
                            return Err(self.err(
                                at,
                                1,
                                format!(
                                "unexpected digit `{c}`; a repeat count follows `*`, as in `t*{c}`"
                            ),
                            ))
                        }
                        c if c.is_whitespace() => {
                            return Err(self.err(
                                at,
                                1,
                                "whitespace is not allowed in a layout (Megatron rejects it); \
                             use `,` to space it out",
                            ))
                        }
                        c => {
                            return Err(self.err(
                                at,
                                1,
                                format!("unknown symbol `{}`; {EXPECTED}", c.escape_debug()),
                            ))
                        }
                    }
                };
            match self.repeat()? {
                None => out.extend(atom),
                Some((count, star, end)) => {
                    let total = atom
                        .len()
                        .checked_mul(count)
                        .and_then(|n| n.checked_add(out.len()));
                    if total.is_none_or(|n| n > MAX_EXPANDED) {
                        return Err(self.err(
                            star,
                            end - star,
                            format!(
                                "this repetition expands the layout past {MAX_EXPANDED} layers"
                            ),
                        ));
                    }
                    for _ in 0..count {
                        out.extend_from_slice(&atom);
                    }
                    if let Some((at2, '*')) = self.peek() {
                        return Err(self.err(
                            at2,
                            1,
                            "a repetition cannot be repeated again (Megatron would repeat only \
                             the last layer); write a single count",
                        ));
                    }
                }
            }
        }
    }

    /// A `*N` at the cursor: the count and the character span of `*N`.
    fn repeat(&mut self) -> Result<Option<(usize, usize, usize)>, LayoutError> {
        let Some((star, '*')) = self.peek() else {
            return Ok(None);
        };
        self.pos += 1;
        let mut count: usize = 0;
        let mut digits = 0;
        let mut end = star + 1;
        while let Some((at, c)) = self.peek() {
            let Some(d) = c.to_digit(10) else { break };
            count = count
                .checked_mul(10)
                .and_then(|n| n.checked_add(d as usize))
                .ok_or_else(|| self.err(star, at - star + 1, "repeat count too large"))?;
            digits += 1;
            end = at + 1;
            self.pos += 1;
        }
        if digits == 0 {
            let at = self.peek().map_or(self.len, |(a, _)| a);
            return Err(self.err(
                at.min(self.len),
                1,
                "expected a repeat count (digits) after `*`, as in `t*3`",
            ));
        }
        Ok(Some((count, star, end)))
    }
}

/// Megatron's rules on the expanded layers (with the character each came from).
fn check_rules(text: &str, symbols: &[(LayerKind, usize)]) -> Result<(), LayoutError> {
    let err = |at: Option<usize>, message: String| Err(LayoutError::new(text, at, 1, message));
    let Some(&(first, first_at)) = symbols.first() else {
        return err(
            None,
            format!("the layout `{text}` has no layers; expected at least the embedding and the loss, as in `Et*4|t*4L`"),
        );
    };
    for (kind, place) in [(LayerKind::Embedding, "first"), (LayerKind::Loss, "last")] {
        let s = kind.symbol();
        let mut at_of = symbols.iter().filter(|(k, _)| *k == kind).map(|&(_, a)| a);
        match (at_of.next(), at_of.next()) {
            (None, _) => {
                return err(
                    None,
                    format!(
                        "the layout has no `{s}`; Megatron needs exactly one, as the {place} layer \
                         (as in `Et*4|t*4L`)"
                    ),
                )
            }
            (Some(_), Some(second)) => {
                return err(
                    Some(second),
                    format!("a second `{s}`; Megatron needs exactly one, as the {place} layer"),
                )
            }
            _ => {}
        }
    }
    if first != LayerKind::Embedding {
        return err(
            Some(first_at),
            format!(
                "the first layer is {}; Megatron needs the embedding `E` first",
                first.describe()
            ),
        );
    }
    let &(last, last_at) = symbols.last().unwrap_or(&(first, first_at));
    if last != LayerKind::Loss {
        return err(
            Some(last_at),
            format!(
                "the last layer is {}; Megatron needs the loss `L` last",
                last.describe()
            ),
        );
    }
    if let Some(m) = symbols.iter().position(|(k, _)| *k == LayerKind::Mtp) {
        if let Some(&(_, at)) = symbols[m..]
            .iter()
            .find(|(k, _)| *k == LayerKind::Transformer)
        {
            return err(
                Some(at),
                "a transformer layer `t` after an MTP layer `m`; Megatron needs every `t` before the first `m`"
                    .to_string(),
            );
        }
    }
    Ok(())
}
