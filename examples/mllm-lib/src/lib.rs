//! # mpipe-mllm
//!
//! A real, small multimodal LLM in pure Rust (f32, CPU; every matrix product through
//! `matrixmultiply`'s sgemm), split into the pipeline units mpipe schedules:
//!
//! - unit 0, `vision`: image patches -> patch embedding + positions -> pre-norm
//!   transformer blocks (bidirectional attention, GELU MLP, LayerNorm) -> final norm
//!   -> projector to the LLM's width: the image tokens. No input units.
//! - units `1 ..= S`, `llm.0 .. llm.{S-1}`: a decoder-only LLM. `llm.0` embeds the
//!   caption tokens after the image tokens (plus learned positions); every stage
//!   runs its share of causal blocks (mpipe-core's split: `layers / S` each, the
//!   remainder one each to stages 1, 2, ..); the last adds the final norm, the LM
//!   head and the next-token cross-entropy on the caption (mean per micro-batch).
//!
//! The units are written once ([`Net`]) against the few tensor operations they need
//! ([`Ops`]): [`Host`] implements them on the CPU, and with the `ascend` feature,
//! `device::Device` through aclnn kernels on an Ascend NPU (or its emulator).
//!
//! [`Mllm`] implements [`mpipe_runtime::model::Model`]: hand-derived backward passes,
//! split into `backward_input` (input gradients, keeping what the weight gradients
//! need in the [`Stash`]) and `backward_weight`; [`Mllm::backward`] is the fused
//! pass, and [`Mllm::reference_step`] the unpipelined step a pipelined run must
//! reproduce. [`Dataset`] makes a synthetic image-caption task; [`Adam`] trains.
//!
//! ```
//! use mpipe_mllm::{Adam, AdamConfig, Config, Dataset, Mllm};
//! let cfg = Config::default();
//! let data = Dataset::new(&cfg, 7);
//! let mut model = Mllm::new(cfg);
//! let mut adam = Adam::new(AdamConfig::default());
//! for step in 0..3 {
//!     let (loss, _grads) = model.reference_step(&data.batch(step, 4));
//!     adam.step(&mut model, 1.0 / 4.0);
//!     assert!(loss.is_finite());
//! }
//! ```

pub mod block;
pub mod config;
pub mod data;
#[cfg(feature = "ascend")]
pub mod device;
// matrixmultiply's `sgemm`/`dgemm` are `unsafe fn`s (raw pointers and strides):
// these two modules wrap them; the rest of the crate has no `unsafe`.
#[allow(unsafe_code)]
pub mod float;
#[allow(unsafe_code)]
pub mod gemm;
pub mod model;
pub mod net;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod rng;
pub mod tensor_ops;

pub use config::Config;
pub use data::{Dataset, Sample};
pub use float::Float;
pub use model::{Mllm, Stash};
pub use net::Net;
pub use optim::{Adam, AdamConfig};
pub use tensor_ops::{Host, Ops};
