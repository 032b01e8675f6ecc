//! The model on the host: a vision encoder unit and the LLM's stage units, all
//! parameters in one object, driven unit by unit through
//! [`mpipe_runtime::model::Model`]. The units' passes are [`Net`]'s, over the
//! [`Host`] tensor operations.

use std::ops::Range;

use mpipe_runtime::model::{Model, Tensor};
use mpipe_runtime::UnitId;

use crate::block::Wgrad;
use crate::config::Config;
use crate::data::Sample;
use crate::float::Float;
use crate::net::{Net, UnitStash};
use crate::rng::Rng;
use crate::tensor_ops::{infallible, Host, HostFam};

/// What a unit keeps from its forward for its backward, on the host.
pub type Stash<F = f32> = UnitStash<HostFam<F>>;

/// A multimodal LLM split into units `vision, llm.0, .., llm.{S-1}` (unit ids `0 ..
/// S`), with the parameters and gradient accumulators of every unit, the current
/// step's micro-batches and their losses.
///
/// The element type `F` is `f32` (the [`Model`] the runtime drives) or `f64` (the
/// same code, for gradient checks; see [`Mllm::new_as`]). The inherent `*_unit`
/// methods are the precision-generic versions of the [`Model`] methods.
#[derive(Clone, Debug)]
pub struct Mllm<F = f32> {
    net: Net,
    /// Per unit: the named parameter tensors and their ranges in the flat vector.
    tensors: Vec<Vec<(String, Range<usize>)>>,
    params: Vec<Vec<F>>,
    grads: Vec<Vec<F>>,
    batch: Vec<Sample>,
    losses: Vec<Option<F>>,
    accuracies: Vec<Option<f32>>,
}

impl Mllm<f32> {
    /// A model with parameters drawn from `cfg.seed`.
    ///
    /// # Panics
    /// If `cfg` is inconsistent (e.g. fewer LLM layers than stages).
    pub fn new(cfg: Config) -> Mllm {
        Mllm::new_as(cfg)
    }
}

impl<F: Float> Mllm<F> {
    /// A model of element type `F` with parameters drawn from `cfg.seed`: the same
    /// initial values whatever `F` (they are drawn as `f32`).
    ///
    /// # Panics
    /// If `cfg` is inconsistent (e.g. fewer LLM layers than stages).
    pub fn new_as(cfg: Config) -> Mllm<F> {
        let (net, layouts) = Net::new(&cfg);
        let params: Vec<Vec<F>> = layouts
            .iter()
            .enumerate()
            .map(|(u, pl)| pl.init(&mut Rng::derive(cfg.seed, &[u as u64])))
            .collect();
        let grads = params.iter().map(|p| vec![F::ZERO; p.len()]).collect();
        let tensors = layouts
            .iter()
            .map(|pl| {
                pl.tensors()
                    .into_iter()
                    .map(|(n, s)| (n, s.off..s.off + s.len))
                    .collect()
            })
            .collect();
        Mllm {
            net,
            tensors,
            params,
            grads,
            batch: Vec::new(),
            losses: Vec::new(),
            accuracies: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        self.net.config()
    }

    /// The units' layers and parameter layouts.
    pub fn net(&self) -> &Net {
        &self.net
    }

    /// Number of units (the encoder and the LLM stages).
    pub fn units(&self) -> usize {
        self.params.len()
    }

    /// Whether `unit`'s parameters are trained.
    pub fn is_trainable(&self, unit: usize) -> bool {
        unit != 0 || self.config().trainable_encoder
    }

    /// `unit`'s parameter tensors (e.g. `block2.fc1.w`, `tok`, `head.b`) and their
    /// ranges in its flat parameter vector.
    pub fn tensors(&self, unit: usize) -> &[(String, Range<usize>)] {
        &self.tensors[unit]
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.params.iter().map(Vec::len).sum()
    }

    /// Set the current step's micro-batches (and forget the previous losses).
    pub fn set_batch(&mut self, samples: &[Sample]) {
        self.batch = samples.to_vec();
        self.losses = vec![None; samples.len()];
        self.accuracies = vec![None; samples.len()];
    }

    /// Zero every unit's gradient accumulators.
    pub fn zero_grads(&mut self) {
        for g in &mut self.grads {
            g.fill(F::ZERO);
        }
    }

    /// Every unit's accumulated gradients.
    pub fn all_grads(&self) -> &[Vec<F>] {
        &self.grads
    }

    /// `unit`'s parameters.
    pub fn unit_params(&self, unit: usize) -> &[F] {
        &self.params[unit]
    }

    /// `unit`'s parameters, to change.
    pub fn unit_params_mut(&mut self, unit: usize) -> &mut [F] {
        &mut self.params[unit]
    }

    /// `unit`'s accumulated gradients.
    pub fn unit_grads(&self, unit: usize) -> &[F] {
        &self.grads[unit]
    }

    /// `unit`'s gradient accumulators, to change.
    pub fn unit_grads_mut(&mut self, unit: usize) -> &mut [F] {
        &mut self.grads[unit]
    }

    /// The loss of micro-batch `mb`, known after the last unit's forward.
    pub fn microbatch_loss(&self, mb: usize) -> Option<F> {
        self.losses.get(mb).copied().flatten()
    }

    /// [`Model::forward`], in `F`.
    pub fn forward_unit(&mut self, unit: usize, mb: usize, inputs: &[&[F]]) -> (Vec<F>, Stash<F>) {
        assert!(inputs.len() <= 1, "a unit takes at most one input");
        let input = inputs.first().map(|x| x.to_vec());
        let f = infallible(self.net.forward(
            &mut Host::new(),
            unit,
            &self.params[unit],
            &self.batch[mb],
            input,
        ));
        if unit + 1 == self.units() {
            self.losses[mb] = Some(f.out[0]);
            self.accuracies[mb] = f.accuracy;
        }
        (f.out, f.stash)
    }

    /// [`Model::backward_input`], in `F`.
    pub fn backward_input_unit(
        &mut self,
        unit: usize,
        mb: usize,
        stash: &mut Stash<F>,
        grad_out: Option<&[F]>,
    ) -> Vec<Vec<F>> {
        let _ = mb;
        let grad_out = grad_out.map(<[F]>::to_vec);
        infallible(self.net.backward_input(
            &mut Host::new(),
            &self.params[unit],
            stash,
            grad_out,
            Wgrad::Later,
        ))
    }

    /// [`Model::backward_weight`], in `F`.
    pub fn backward_weight_unit(&mut self, unit: usize, mb: usize, stash: Stash<F>) {
        let _ = mb;
        infallible(self.net.backward_weight(
            &mut Host::new(),
            &self.params[unit],
            &mut self.grads[unit],
            &stash,
        ));
    }

    /// Teacher-forced next-token accuracy on micro-batch `mb`'s caption, known
    /// after the last unit's forward.
    pub fn accuracy(&self, mb: usize) -> Option<f32> {
        self.accuracies.get(mb).copied().flatten()
    }

    /// Fused backward: `backward_input` and `backward_weight` in one pass, each
    /// layer's weight gradients added as soon as its output gradient is known.
    pub fn backward(
        &mut self,
        unit: usize,
        mb: usize,
        stash: &mut Stash<F>,
        grad_out: Option<&[F]>,
    ) -> Vec<Vec<F>> {
        let _ = mb;
        let grad_out = grad_out.map(<[F]>::to_vec);
        infallible(self.net.backward_input(
            &mut Host::new(),
            &self.params[unit],
            stash,
            grad_out,
            Wgrad::Now(&mut self.grads[unit]),
        ))
    }

    /// The reference, unpipelined step: for every micro-batch, the forward of all
    /// units in order, then the fused backward of all in reverse (the encoder's
    /// only when trainable). Zeroes the gradients first. Returns the mean loss over
    /// the micro-batches and every unit's gradients: those of the **sum** of the
    /// micro-batches' losses, as a pipelined run accumulates them.
    pub fn reference_step(&mut self, samples: &[Sample]) -> (F, Vec<Vec<F>>) {
        self.set_batch(samples);
        self.zero_grads();
        let n = self.units();
        let mut total = 0.0f64;
        for mb in 0..samples.len() {
            let mut stashes = Vec::with_capacity(n);
            let mut act: Option<Vec<F>> = None;
            for u in 0..n {
                let inputs: Vec<&[F]> = act.iter().map(Vec::as_slice).collect();
                let (out, st) = self.forward_unit(u, mb, &inputs);
                stashes.push(st);
                act = Some(out);
            }
            total += self.losses[mb].expect("the last unit sets the loss").f64();
            let mut grad: Option<Vec<F>> = None;
            for u in (0..n).rev() {
                let mut st = stashes.pop().expect("one stash per unit");
                if !self.is_trainable(u) {
                    break;
                }
                grad = self.backward(u, mb, &mut st, grad.as_deref()).pop();
            }
        }
        (
            F::of(total / samples.len().max(1) as f64),
            self.grads.clone(),
        )
    }

    /// Forward only: the mean loss over `samples` (and their accuracies, see
    /// [`Mllm::accuracy`]).
    pub fn eval_loss(&mut self, samples: &[Sample]) -> F {
        self.set_batch(samples);
        let mut total = 0.0f64;
        for mb in 0..samples.len() {
            let mut act: Option<Vec<F>> = None;
            for u in 0..self.units() {
                let inputs: Vec<&[F]> = act.iter().map(Vec::as_slice).collect();
                act = Some(self.forward_unit(u, mb, &inputs).0);
            }
            total += self.losses[mb].expect("the last unit sets the loss").f64();
        }
        F::of(total / samples.len().max(1) as f64)
    }

    /// Elements of `unit`'s forward output for every micro-batch: image tokens
    /// (`microbatch_size x patches x dim`) for the vision encoder, hidden states
    /// (`microbatch_size x seq_len x dim`) for a stage, the loss (1) for the last.
    pub fn output_len_of(&self, unit: usize) -> usize {
        self.net.output_len(unit, self.config().microbatch_size)
    }
}

impl Model for Mllm<f32> {
    type Stash = Stash<f32>;

    fn output_len(&self, unit: UnitId) -> usize {
        self.output_len_of(unit as usize)
    }

    fn forward(&mut self, unit: UnitId, mb: usize, inputs: &[&Tensor]) -> (Tensor, Stash) {
        let inputs: Vec<&[f32]> = inputs.iter().map(|t| t.as_slice()).collect();
        self.forward_unit(unit as usize, mb, &inputs)
    }

    fn backward_input(
        &mut self,
        unit: UnitId,
        mb: usize,
        stash: &mut Stash,
        grad_out: Option<&Tensor>,
    ) -> Vec<Tensor> {
        self.backward_input_unit(unit as usize, mb, stash, grad_out.map(Vec::as_slice))
    }

    fn backward_weight(&mut self, unit: UnitId, mb: usize, stash: Stash) {
        self.backward_weight_unit(unit as usize, mb, stash);
    }

    fn loss(&self, mb: usize) -> Option<f32> {
        self.microbatch_loss(mb)
    }

    fn params(&self, unit: UnitId) -> &[f32] {
        &self.params[unit as usize]
    }

    fn params_mut(&mut self, unit: UnitId) -> &mut [f32] {
        &mut self.params[unit as usize]
    }

    fn grads(&self, unit: UnitId) -> &[f32] {
        &self.grads[unit as usize]
    }

    fn grads_mut(&mut self, unit: UnitId) -> &mut [f32] {
        &mut self.grads[unit as usize]
    }
}
