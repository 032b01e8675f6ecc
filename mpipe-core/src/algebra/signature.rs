//! What a name of the expression language takes: its [`Signature`] (the shape of its
//! positional arguments, its `key = value` parameters with their types and defaults)
//! and the one checker of an expression's arguments against it ([`Signature::check`]).
//!
//! Every message about an argument's kind or value comes from here, worded from the
//! signature (the valid choices, the range, how the name is written), so that every
//! operator and body speaks alike and a new one needs no messages of its own. What
//! only the evaluation can know (an encoder the profile lacks, a rank past the
//! request's, two arguments that contradict each other) is checked there.
//!
//! Promises: every mistake is reported (not just the first), each at the span of the
//! argument at fault; checking never evaluates anything.

use super::expr::{Arg, Expr, Span, Value};

/// How many sub-expressions a name takes, and what they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// A body generator: no sub-expression.
    Body,
    /// An operator over one body: `op(BODY)`.
    Over,
    /// An operator that places an encoder: `op(ENCODER, BODY)`.
    EncoderOver,
    /// A whole schedule, resolved above the algebra (`auto`, `refine`): `op(BODY)`
    /// where it takes one, and never an argument of another name.
    Whole,
}

/// The type of a `key = value` parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    /// One of these names; the first is the default.
    Choice(&'static [&'static str]),
    /// An integer from `min` to `max` (`u64::MAX`: no upper limit).
    Int { min: u64, max: u64 },
    /// A rank of the request (`0 .. ranks`, [`Context::ranks`]) or this name, the
    /// default.
    RankOr(&'static str),
}

/// What a check may read of the request besides the expression.
#[derive(Clone, Copy, Debug)]
pub struct Context {
    /// The request's ranks (the range of [`Type::RankOr`]).
    pub ranks: usize,
}

/// One `key = value` parameter.
#[derive(Clone, Copy, Debug)]
pub struct Param {
    pub key: &'static str,
    pub ty: Type,
    /// What the value means, as a message completes "`key` is ...".
    pub doc: &'static str,
}

/// What a name takes.
#[derive(Clone, Copy, Debug)]
pub struct Signature {
    pub name: &'static str,
    pub shape: Shape,
    pub params: &'static [Param],
    /// A use of it that derives (for messages).
    pub example: &'static str,
    /// What it does, in a line.
    pub doc: &'static str,
}

/// A parameter's value as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Given {
    /// The index of the name among [`Type::Choice`]'s (or 0 for [`Type::RankOr`]'s name).
    Choice(usize),
    Int(u64),
}

/// An expression's arguments, checked against its [`Signature`].
#[derive(Debug)]
pub struct Checked<'e> {
    /// The signature checked against.
    pub sig: &'static Signature,
    /// The encoder argument of an [`Shape::EncoderOver`] name, when the shape held.
    pub encoder: Option<&'e Expr>,
    /// The body argument, when the shape held.
    pub body: Option<&'e Expr>,
    /// The sub-expressions given where the shape did not hold (the caller still
    /// evaluates them, so their mistakes show too).
    pub stray: Vec<&'e Expr>,
    /// Each parameter's value and where it was written, in the signature's order;
    /// `None` when absent or bad.
    given: Vec<Option<(Given, Span)>>,
    /// Whether every `key = value` argument was good.
    pub keys_ok: bool,
}

impl Checked<'_> {
    fn slot(&self, key: &str) -> Option<(Given, Span)> {
        let at = self.sig.params.iter().position(|p| p.key == key)?;
        self.given[at]
    }

    /// The index of `key`'s choice (0, the default, when absent or bad).
    pub fn choice(&self, key: &str) -> usize {
        match self.slot(key) {
            Some((Given::Choice(i), _)) => i,
            _ => 0,
        }
    }

    /// `key`'s integer, if one was given, and where.
    pub fn int(&self, key: &str) -> Option<(u64, Span)> {
        match self.slot(key) {
            Some((Given::Int(n), span)) => Some((n, span)),
            _ => None,
        }
    }

    /// Whether the shape held and every key was good.
    pub fn ok(&self) -> bool {
        let shaped = match self.sig.shape {
            Shape::Body => self.stray.is_empty(),
            Shape::Over | Shape::Whole => self.body.is_some(),
            Shape::EncoderOver => self.encoder.is_some() && self.body.is_some(),
        };
        shaped && self.keys_ok
    }
}

impl Type {
    /// How a value is written: `fixed | search`, `N`, `N | spare`.
    fn written(self) -> String {
        match self {
            Type::Choice(names) => names.join(" | "),
            Type::Int { .. } => "N".into(),
            Type::RankOr(name) => format!("N | {name}"),
        }
    }
}

impl Signature {
    /// How it is written: `fill(ENCODER, BODY)`, `interleaved(v = N)`.
    pub fn usage(&self) -> String {
        let mut parts: Vec<String> = match self.shape {
            Shape::Body => Vec::new(),
            Shape::Over | Shape::Whole => vec!["BODY".into()],
            Shape::EncoderOver => vec!["ENCODER".into(), "BODY".into()],
        };
        if self.shape == Shape::Whole && self.params.is_empty() {
            parts.clear();
        }
        parts.extend(
            self.params
                .iter()
                .map(|p| format!("{} = {}", p.key, p.ty.written())),
        );
        if parts.is_empty() {
            self.name.to_string()
        } else {
            format!("{}({})", self.name, parts.join(", "))
        }
    }

    /// Its parameters as a list for messages: `` `v = N`, `layout = looped | v` ``.
    fn params_written(&self) -> String {
        self.params
            .iter()
            .map(|p| format!("`{} = {}`", p.key, p.ty.written()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `e`'s arguments checked against this signature; each mistake is pushed to
    /// `errors` with its span.
    pub fn check<'e>(
        &'static self,
        e: &'e Expr,
        ctx: Context,
        errors: &mut Vec<(Span, String)>,
    ) -> Checked<'e> {
        let pos: Vec<&Expr> = e.positional().collect();
        let mut out = Checked {
            sig: self,
            encoder: None,
            body: None,
            stray: Vec::new(),
            given: vec![None; self.params.len()],
            keys_ok: true,
        };
        match (self.shape, &pos[..]) {
            (Shape::Body, []) => {}
            (Shape::Body, stray) => {
                let takes = if self.params.is_empty() {
                    "s".to_string()
                } else {
                    format!("; it takes {}", self.params_written())
                };
                for x in stray {
                    errors.push((
                        x.span,
                        format!("`{}` takes no schedule argument{takes}", self.name),
                    ));
                }
                out.stray = stray.to_vec();
            }
            (Shape::Over | Shape::Whole, [body]) => out.body = Some(body),
            (Shape::EncoderOver, [enc, body]) => {
                out.encoder = Some(enc);
                out.body = Some(body);
            }
            (shape, got) => {
                let what = if shape == Shape::EncoderOver {
                    "an encoder and a body"
                } else {
                    "one body"
                };
                errors.push((
                    e.span,
                    format!(
                        "`{}` takes {what}, as in `{}`; got {} positional argument(s)",
                        self.name,
                        self.example,
                        got.len()
                    ),
                ));
                // The first of an encoder operator's is its encoder, not a body.
                let skip = usize::from(shape == Shape::EncoderOver);
                out.stray = got.iter().skip(skip).copied().collect();
            }
        }
        for a in &e.args {
            let Arg::Key { key, value, .. } = a else {
                continue;
            };
            let Some(at) = self.params.iter().position(|p| p.key == key.name) else {
                out.keys_ok = false;
                errors.push((key.span, self.unknown_key(&key.name)));
                continue;
            };
            let param = &self.params[at];
            match param.value(value, ctx) {
                Ok(given) => out.given[at] = Some((given, value.span())),
                Err(message) => {
                    out.keys_ok = false;
                    errors.push((value.span(), message));
                }
            }
        }
        out
    }

    fn unknown_key(&self, key: &str) -> String {
        if self.params.is_empty() {
            format!(
                "`{}` takes no `{key}` argument; write `{}`",
                self.name,
                self.usage()
            )
        } else {
            let keys: Vec<&str> = self.params.iter().map(|p| p.key).collect();
            format!(
                "unknown argument `{key}` of `{}`; expected one of: {} (as in `{}`)",
                self.name,
                keys.join(", "),
                self.usage()
            )
        }
    }
}

impl Param {
    /// `value` read as this parameter's type, or what is wrong with it.
    fn value(&self, value: &Value, ctx: Context) -> Result<Given, String> {
        let key = self.key;
        match self.ty {
            Type::Choice(names) => value
                .as_name()
                .and_then(|n| names.iter().position(|x| *x == n))
                .map(Given::Choice)
                .ok_or_else(|| {
                    format!(
                        "bad value `{value}` for `{key}`; expected one of: {}",
                        names.join(", ")
                    )
                }),
            Type::Int { min, max } => match value.as_int() {
                Some(n) if (min..=max).contains(&n) => Ok(Given::Int(n)),
                _ if max == u64::MAX => Err(format!(
                    "`{key}` is {}, an integer >= {min}, got `{value}`",
                    self.doc
                )),
                _ => Err(format!(
                    "`{key}` is {}, an integer from {min} to {max}, got `{value}`",
                    self.doc
                )),
            },
            Type::RankOr(name) => match value {
                Value::Int { value: n, .. } if (*n as usize) < ctx.ranks => Ok(Given::Int(*n)),
                Value::Int { value: n, .. } => Err(format!(
                    "rank {n} does not exist: the request has {} ranks (0..{}); or write \
                     `{key} = {name}`",
                    ctx.ranks,
                    ctx.ranks.saturating_sub(1)
                )),
                Value::Name(id) if id.name == name => Ok(Given::Choice(0)),
                _ => Err(format!(
                    "bad value `{value}` for `{key}`; expected {} or `{name}`",
                    self.doc
                )),
            },
        }
    }
}
