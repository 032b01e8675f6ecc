//! Adam on the device: the same update as [`crate::Adam`], queued on the compute
//! stream with `aclnnApplyAdamWV2` ([`Kernels::adam_`]), the moments in device memory.
//!
//! The host computes, per element, with `g = grad * grad_scale`:
//! `m = b1 m + (1 - b1) g`; `v = b2 v + (1 - b2) g^2`;
//! `p -= (lr / (1 - b1^t)) m / (sqrt(v / (1 - b2^t)) + eps) + lr wd p`.
//! `adam_` documents `p *= 1 - lr wd` then the same moments and
//! `p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`: the same update (the
//! decay uses the old `p` in both), bias corrections included, so the arguments are
//! the host's own (`lr`, `beta1`, `beta2`, `eps`, `weight_decay`) and the host's results
//! are unchanged. The one difference is where the rounding falls (the emulator
//! computes in f64 from f32 inputs): within 1e-5 (`tests/device_adam.rs` checks it).
//! The gradient's scale (the mean over micro-batches) is applied by one `aclnnMuls`
//! into a scratch buffer, so the accumulated gradients stay as the step left them.

use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::DeviceBuffer;
use mpipe_runtime::ascend::tensor::{DType, DevTensor};
use mpipe_runtime::ascend::AscendError;

use crate::AdamConfig;

/// A unit's moments on the device.
struct Moments {
    m: DeviceBuffer,
    v: DeviceBuffer,
    len: usize,
}

/// Adam with its moments on the device, one step count for all units (every unit a
/// rank updates is updated every step, as [`crate::pipeline`] does; the kernels keep
/// the count on the device, advanced by a kernel, so no copy is needed per step).
pub struct DeviceAdam {
    pub cfg: AdamConfig,
    units: Vec<Option<Moments>>,
    /// Steps taken (the next update is step `t + 1`).
    t: u64,
    scratch: Option<(DeviceBuffer, usize)>,
}

fn flat(b: &DeviceBuffer, len: usize) -> DevTensor {
    DevTensor::new(b.as_ptr() as usize, DType::F32, &[len])
}

impl DeviceAdam {
    pub fn new(cfg: AdamConfig) -> DeviceAdam {
        DeviceAdam {
            cfg,
            units: Vec::new(),
            t: 0,
            scratch: None,
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// Queue one update of every unit in `units` (`(unit, params, grads)`, flat
    /// contiguous f32 views of equal length) from `grads * grad_scale`. Moments and
    /// the scratch buffer are allocated on the first update only. No host wait.
    pub fn step(
        &mut self,
        k: &mut Kernels,
        units: &[(usize, DevTensor, DevTensor)],
        grad_scale: f32,
    ) -> Result<(), AscendError> {
        if units.is_empty() {
            return Ok(());
        }
        for (u, p, g) in units {
            if p.numel() != g.numel() || !p.is_contiguous() || !g.is_contiguous() {
                return Err(AscendError::Tensor(format!(
                    "device Adam: unit {u}'s parameters ({:?}) and gradients ({:?}) must be \
                     contiguous of one length",
                    p.shape(),
                    g.shape()
                )));
            }
        }
        let most = units.iter().map(|(_, p, _)| p.numel()).max().unwrap_or(0);
        if self.scratch.as_ref().is_none_or(|s| s.1 < most) {
            self.scratch = Some((DeviceBuffer::new(most.max(1) * 4)?, most));
        }
        self.t += 1;
        let c = self.cfg;
        for (u, p, g) in units {
            let n = p.numel();
            if self.units.len() <= *u {
                self.units.resize_with(u + 1, || None);
            }
            if self.units[*u].as_ref().is_none_or(|s| s.len != n) {
                let (m, v) = (DeviceBuffer::new(n * 4)?, DeviceBuffer::new(n * 4)?);
                k.zero_(&flat(&m, n))?;
                k.zero_(&flat(&v, n))?;
                self.units[*u] = Some(Moments { m, v, len: n });
            }
            let s = self.units[*u].as_ref().expect("made above");
            let scratch = self.scratch.as_ref().expect("made above");
            let sg = flat(&scratch.0, n);
            let (Some(p), Some(g)) = (p.flat(), g.flat()) else {
                return Err(AscendError::Tensor(format!(
                    "device Adam: unit {u}'s views are not contiguous"
                )));
            };
            k.muls(&g, grad_scale, &sg)?;
            k.adam_(
                &p,
                &flat(&s.m, n),
                &flat(&s.v, n),
                &sg,
                self.t,
                c.lr,
                c.beta1,
                c.beta2,
                c.eps,
                c.weight_decay,
            )?;
        }
        Ok(())
    }
}
