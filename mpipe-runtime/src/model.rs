//! The user side of a pipeline run: what a model supplies, unit by unit.
//!
//! Units are the program's units (an encoder, a pipeline stage or chunk), by
//! [`UnitId`]. The runtime owns every activation, gradient and stash; the model only
//! computes. Data flows as flat `f32` tensors ([`Tensor`]) of static sizes: a model
//! knows the shapes of what its own units produce and consume, and tells the runtime
//! each unit's output length ([`Model::output_len`]), from which every message's
//! size follows (an activation is its unit's output; a gradient message is the
//! gradients of the unit's inputs, one after the other, each of its input's output
//! length). Backends post receives of exactly those sizes, as HCCL requires.

use crate::UnitId;

/// A flat host tensor. Its shape is the producing unit's business.
pub type Tensor = Vec<f32>;

/// Per-unit forward, input-gradient backward and weight-gradient backward.
///
/// Contract with the runtime, for each `(unit, mb)` of a step:
/// - `forward` (or `recompute`, which calls `forward` again) runs once the outputs of
///   all of `unit`'s input units for `mb` are present, in the order of the unit's
///   `inputs`; a unit without inputs reads micro-batch `mb` itself. It returns the
///   output activation and a stash of whatever its backward will need.
/// - `backward_input` runs with that stash and the gradient of the unit's output
///   (the sum over its successors; `None` for the last unit, whose output is the
///   loss) and returns one gradient per input unit, in `inputs` order (empty for a
///   unit without inputs). It may keep in the stash what `backward_weight` needs.
/// - `backward_weight` consumes the stash and **adds** the unit's weight gradients
///   for `mb` into the model's gradient accumulators.
/// - `backward` (fused) is `backward_input` then `backward_weight`.
pub trait Model {
    /// What a unit keeps from its forward for its backward.
    type Stash: Send;

    /// The number of elements of `unit`'s forward output, the same for every
    /// micro-batch (static shapes). The runtime sizes receive buffers from it and
    /// checks every forward's output, and every input gradient, against it.
    fn output_len(&self, unit: UnitId) -> usize;
    /// Forward of `unit` on micro-batch `mb`.
    fn forward(&mut self, unit: UnitId, mb: usize, inputs: &[&Tensor]) -> (Tensor, Self::Stash);
    /// Gradients of `unit`'s inputs on micro-batch `mb`.
    fn backward_input(
        &mut self,
        unit: UnitId,
        mb: usize,
        stash: &mut Self::Stash,
        grad_out: Option<&Tensor>,
    ) -> Vec<Tensor>;
    /// Accumulate `unit`'s weight gradients of micro-batch `mb`.
    fn backward_weight(&mut self, unit: UnitId, mb: usize, stash: Self::Stash);
    /// The loss of micro-batch `mb`, known after the last unit's forward.
    fn loss(&self, mb: usize) -> Option<f32>;
    /// `unit`'s parameters, flat (broadcast from the home rank).
    fn params(&self, unit: UnitId) -> &[f32];
    /// `unit`'s parameters, to overwrite with a broadcast.
    fn params_mut(&mut self, unit: UnitId) -> &mut [f32];
    /// `unit`'s accumulated weight gradients, flat (reduced onto the home rank).
    fn grads(&self, unit: UnitId) -> &[f32];
    /// `unit`'s gradient accumulators, to overwrite with a reduction's result.
    fn grads_mut(&mut self, unit: UnitId) -> &mut [f32];
}
