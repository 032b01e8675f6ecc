//! The syntax tree of a schedule expression, and its canonical text form.
//!
//! Every node keeps the [`Span`] it was parsed from so that later passes (the
//! derivation, the macro) can point their errors at the sub-expression at fault.
//! Equality ignores spans: two trees are equal when they have the same text form.

use std::fmt;

use super::span::Span;

/// A name as written: a schedule, operator, encoder, key or value name.
#[derive(Clone, Debug)]
pub struct Ident {
    /// The name, without any `r#` prefix (`1f1b`, `zbv`, `vision`, `owners`).
    pub name: String,
    /// Where it was written.
    pub span: Span,
}

/// `NAME` or `NAME(arg, ...)`.
#[derive(Clone, Debug)]
pub struct Expr {
    /// The schedule or operator name.
    pub head: Ident,
    /// The arguments, in order (empty for a bare name).
    pub args: Vec<Arg>,
    /// The whole expression, from the name to the closing parenthesis.
    pub span: Span,
}

/// One argument of an operator: a sub-expression or `KEY = VALUE`.
#[derive(Clone, Debug)]
pub enum Arg {
    Expr(Expr),
    Key {
        key: Ident,
        value: Value,
        /// From the key to the value.
        span: Span,
    },
}

/// The value of a `KEY = VALUE` argument.
#[derive(Clone, Debug)]
pub enum Value {
    Int { value: u64, span: Span },
    Name(Ident),
}

impl Ident {
    pub fn new(name: impl Into<String>, span: Span) -> Ident {
        Ident {
            name: name.into(),
            span,
        }
    }
}

impl Expr {
    /// The value of the first `key = ...` argument, if any (the parser rejects a
    /// key given twice).
    pub fn find_key(&self, key: &str) -> Option<&Value> {
        self.args.iter().find_map(|a| match a {
            Arg::Key { key: k, value, .. } if k.name == key => Some(value),
            _ => None,
        })
    }

    /// The positional (sub-expression) arguments, in order.
    pub fn positional(&self) -> impl Iterator<Item = &Expr> {
        self.args.iter().filter_map(|a| match a {
            Arg::Expr(e) => Some(e),
            Arg::Key { .. } => None,
        })
    }

    /// The `key = value` arguments, in order.
    pub fn keys(&self) -> impl Iterator<Item = (&Ident, &Value)> {
        self.args.iter().filter_map(|a| match a {
            Arg::Key { key, value, .. } => Some((key, value)),
            Arg::Expr(_) => None,
        })
    }

    /// The head's name.
    pub fn name(&self) -> &str {
        &self.head.name
    }

    /// `name`, with no arguments and no place in any text (an expression built by
    /// a program, not parsed).
    pub fn leaf(name: impl Into<String>) -> Expr {
        Expr {
            head: Ident::new(name, Span::NONE),
            args: Vec::new(),
            span: Span::NONE,
        }
    }

    /// `op(first, self)`: the operator `op` over `self` as its body, with `first`
    /// (an encoder's name) before it when given (`transpose(vision, zbv)`,
    /// `balance(zbv)`).
    pub fn under(self, op: &str, first: Option<&str>) -> Expr {
        let mut args: Vec<Arg> = first
            .map(|n| Arg::Expr(Expr::leaf(n)))
            .into_iter()
            .collect();
        args.push(Arg::Expr(self));
        Expr {
            args,
            ..Expr::leaf(op)
        }
    }

    /// `self` with `key = value` appended to its arguments.
    pub fn with(mut self, key: &str, value: Value) -> Expr {
        self.args.push(Arg::Key {
            key: Ident::new(key, Span::NONE),
            value,
            span: Span::NONE,
        });
        self
    }

    /// `self` with `key = name` appended to its arguments.
    pub fn with_name(self, key: &str, name: &str) -> Expr {
        self.with(key, Value::Name(Ident::new(name, Span::NONE)))
    }

    /// `self` with `key = value` (an integer) appended to its arguments.
    pub fn with_int(self, key: &str, value: u64) -> Expr {
        self.with(
            key,
            Value::Int {
                value,
                span: Span::NONE,
            },
        )
    }
}

impl Arg {
    /// Where the argument was written.
    pub fn span(&self) -> Span {
        match self {
            Arg::Expr(e) => e.span,
            Arg::Key { span, .. } => *span,
        }
    }
}

impl Value {
    /// Where the value was written.
    pub fn span(&self) -> Span {
        match self {
            Value::Int { span, .. } => *span,
            Value::Name(id) => id.span,
        }
    }

    /// The integer, if the value is one.
    pub fn as_int(&self) -> Option<u64> {
        match self {
            Value::Int { value, .. } => Some(*value),
            Value::Name(_) => None,
        }
    }

    /// The name, if the value is one.
    pub fn as_name(&self) -> Option<&str> {
        match self {
            Value::Name(id) => Some(&id.name),
            Value::Int { .. } => None,
        }
    }
}

impl PartialEq for Ident {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}
impl Eq for Ident {}

impl PartialEq for Expr {
    fn eq(&self, other: &Self) -> bool {
        self.head == other.head && self.args == other.args
    }
}
impl Eq for Expr {}

impl PartialEq for Arg {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Arg::Expr(a), Arg::Expr(b)) => a == b,
            (
                Arg::Key {
                    key: ka, value: va, ..
                },
                Arg::Key {
                    key: kb, value: vb, ..
                },
            ) => ka == kb && va == vb,
            _ => false,
        }
    }
}
impl Eq for Arg {}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Value::Int { value: a, .. }, Value::Int { value: b, .. }) => a == b,
            (Value::Name(a), Value::Name(b)) => a == b,
            _ => false,
        }
    }
}
impl Eq for Value {}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int { value, .. } => write!(f, "{value}"),
            Value::Name(id) => write!(f, "{id}"),
        }
    }
}

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::Expr(e) => write!(f, "{e}"),
            Arg::Key { key, value, .. } => write!(f, "{key} = {value}"),
        }
    }
}

/// The canonical text form: `zbv`, `interleaved(v = 2)`, `transpose(vision, zbv)`.
/// It parses back to an equal expression.
impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.head)?;
        if !self.args.is_empty() {
            f.write_str("(")?;
            for (i, a) in self.args.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{a}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}
