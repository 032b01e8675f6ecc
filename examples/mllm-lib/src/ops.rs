//! The layers the model is made of, as places in a unit's parameters: each knows its
//! [`Slot`]s in the unit's flat parameter (and gradient) vector. What they compute is
//! in [`crate::tensor_ops::Ops`].

use crate::float::Float;
use crate::rng::Rng;

/// A range of a unit's flat parameter (and gradient) vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub off: usize,
    pub len: usize,
}

impl Slot {
    pub fn of<'a, F>(&self, v: &'a [F]) -> &'a [F] {
        &v[self.off..self.off + self.len]
    }
    pub fn of_mut<'a, F>(&self, v: &'a mut [F]) -> &'a mut [F] {
        &mut v[self.off..self.off + self.len]
    }
}

/// How a slot is initialised.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Normal(f32),
    Const(f32),
}

/// Hands out the slots of one unit's flat parameter vector, and initialises it.
#[derive(Clone, Debug, Default)]
pub struct ParamLayout {
    len: usize,
    inits: Vec<(String, Slot, Init)>,
}

impl ParamLayout {
    /// A new tensor of `len` values named `name`.
    pub fn alloc(&mut self, name: String, len: usize, init: Init) -> Slot {
        let s = Slot { off: self.len, len };
        self.len += len;
        self.inits.push((name, s, init));
        s
    }
    /// The named tensors, in order.
    pub fn tensors(&self) -> Vec<(String, Slot)> {
        self.inits.iter().map(|(n, s, _)| (n.clone(), *s)).collect()
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The initial parameters, drawn (as `f32`, whatever `F`) from `rng` slot by
    /// slot.
    pub fn init<F: Float>(&self, rng: &mut Rng) -> Vec<F> {
        let mut p = vec![F::ZERO; self.len];
        for (_, s, init) in &self.inits {
            for x in s.of_mut(&mut p) {
                let v: f32 = match *init {
                    Init::Normal(std) => std * rng.normal(),
                    Init::Const(c) => c,
                };
                *x = F::of(v as f64);
            }
        }
        p
    }
}

/// `y = x W + b`, `W` stored `din x dout`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub w: Slot,
    pub b: Slot,
    pub din: usize,
    pub dout: usize,
}

impl Linear {
    /// A layer with `N(0, std^2)` weights (default `1/sqrt(din)`) and zero bias.
    pub fn new(
        pl: &mut ParamLayout,
        name: &str,
        din: usize,
        dout: usize,
        std: Option<f32>,
    ) -> Linear {
        let std = std.unwrap_or(1.0 / (din as f32).sqrt());
        Linear {
            w: pl.alloc(format!("{name}.w"), din * dout, Init::Normal(std)),
            b: pl.alloc(format!("{name}.b"), dout, Init::Const(0.0)),
            din,
            dout,
        }
    }
}

/// LayerNorm over the last dimension, with gain and bias.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub g: Slot,
    pub b: Slot,
    pub d: usize,
}

/// The layer norm's epsilon.
pub const LN_EPS: f64 = 1e-5;

impl LayerNorm {
    pub fn new(pl: &mut ParamLayout, name: &str, d: usize) -> LayerNorm {
        LayerNorm {
            g: pl.alloc(format!("{name}.g"), d, Init::Const(1.0)),
            b: pl.alloc(format!("{name}.b"), d, Init::Const(0.0)),
            d,
        }
    }
}
