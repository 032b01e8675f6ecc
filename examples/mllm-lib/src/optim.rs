//! Adam over each unit's flat parameter vector.

use crate::model::Mllm;
use mpipe_runtime::model::Model;

/// Adam's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay (AdamW); 0 for plain Adam.
    pub weight_decay: f32,
}

impl Default for AdamConfig {
    fn default() -> AdamConfig {
        AdamConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Moments {
    t: u64,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// Adam, with separate moments (and step counts) per unit, so that a rank can step
/// only the units it is home to.
#[derive(Clone, Debug)]
pub struct Adam {
    pub cfg: AdamConfig,
    units: Vec<Moments>,
}

impl Adam {
    pub fn new(cfg: AdamConfig) -> Adam {
        Adam {
            cfg,
            units: Vec::new(),
        }
    }

    /// One update of `unit`'s `params` from its gradient `grads * grad_scale`
    /// (e.g. `1 / microbatches`, for the mean over micro-batches).
    pub fn step_unit(&mut self, unit: usize, params: &mut [f32], grads: &[f32], grad_scale: f32) {
        assert_eq!(params.len(), grads.len());
        if self.units.len() <= unit {
            self.units.resize_with(unit + 1, Moments::default);
        }
        let s = &mut self.units[unit];
        if s.m.len() != params.len() {
            *s = Moments {
                t: 0,
                m: vec![0.0; params.len()],
                v: vec![0.0; params.len()],
            };
        }
        s.t += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(s.t as i32);
        let bc2 = 1.0 - c.beta2.powi(s.t as i32);
        let lr = c.lr / bc1;
        for ((p, &g), (m, v)) in params
            .iter_mut()
            .zip(grads)
            .zip(s.m.iter_mut().zip(s.v.iter_mut()))
        {
            let g = g * grad_scale;
            *m = c.beta1 * *m + (1.0 - c.beta1) * g;
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
            *p -= lr * *m / ((*v / bc2).sqrt() + c.eps) + c.lr * c.weight_decay * *p;
        }
    }

    /// `unit`'s state, for a checkpoint: its step count `t` and moments `m`, `v`
    /// (`None` before its first update).
    pub fn unit_state(&self, unit: usize) -> Option<(u64, &[f32], &[f32])> {
        self.units
            .get(unit)
            .filter(|s| s.t > 0 || !s.m.is_empty())
            .map(|s| (s.t, s.m.as_slice(), s.v.as_slice()))
    }

    /// Restores `unit`'s state from a checkpoint (see [`Adam::unit_state`]).
    ///
    /// # Panics
    /// If `m` and `v` differ in length.
    pub fn set_unit_state(&mut self, unit: usize, t: u64, m: Vec<f32>, v: Vec<f32>) {
        assert_eq!(m.len(), v.len(), "Adam moments of different lengths");
        if self.units.len() <= unit {
            self.units.resize_with(unit + 1, Moments::default);
        }
        self.units[unit] = Moments { t, m, v };
    }

    /// Step every trainable unit of `model` from its accumulated gradients.
    pub fn step(&mut self, model: &mut Mllm, grad_scale: f32) {
        for u in 0..model.units() {
            if !model.is_trainable(u) {
                continue;
            }
            let grads = model.grads(u as u32).to_vec();
            self.step_unit(u, model.params_mut(u as u32), &grads, grad_scale);
        }
    }
}

#[cfg(feature = "ascend")]
pub mod device;
