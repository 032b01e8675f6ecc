//! A small device model for the device-step tests and benchmarks: unit `u` computes
//! `out = sum(inputs) * p_u` (elementwise) through the aclnn kernels; a unit without
//! inputs reads row `mb` of the batch; a micro-batch's loss is the sum of the last
//! unit's output. Included with `#[path]` by `tests/ascend_device.rs` and
//! `benches/device_step.rs`.

use mpipe_core::program::Program;
use mpipe_runtime::ascend::device::{DeviceModel, DeviceRank};
use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::{read_device, DeviceBuffer};
use mpipe_runtime::ascend::tensor::{DType, DevTensor};
use mpipe_runtime::ascend::AscendError;
use mpipe_runtime::UnitId;

/// Micro-batches per step.
pub(crate) const MBS: usize = 8;
/// Elements of every unit's output.
pub(crate) const LEN: usize = 96;
/// The learning rate of the test's optimizer (`p -= LR * g`, on the device between
/// steps, as training does).
pub(crate) const LR: f32 = 0.01;

/// Deterministic values in [-1, 1).
pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Unit `u` computes `out = sum(inputs) * p_u` (elementwise); a unit without inputs
/// reads row `mb` of the batch; the loss of a micro-batch is the sum of the last
/// unit's output. Parameters, gradients, the batch and the losses live on the device.
pub(crate) struct Toy {
    last: UnitId,
    params: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    batch: DeviceBuffer,
    ones: DeviceBuffer,
    losses: DeviceBuffer,
    /// Free stash buffers (each `LEN` f32s), reused across steps.
    pool: Vec<DeviceBuffer>,
    /// Whether this rank computes the loss (it runs the last unit's forward).
    has_loss: bool,
}

pub(crate) struct Stash {
    x: DeviceBuffer,
    g: DeviceBuffer,
}

pub(crate) fn t(b: &DeviceBuffer) -> DevTensor {
    DevTensor::new(b.as_ptr() as usize, DType::F32, &[LEN])
}

impl Toy {
    pub(crate) fn new(prog: &Program, k: &mut Kernels) -> Result<Toy, AscendError> {
        let n = prog.units.len();
        let last = (0..n)
            .find(|&u| {
                !prog
                    .units
                    .iter()
                    .any(|v| v.inputs.contains(&prog.units[u].name))
            })
            .expect("a last unit") as UnitId;
        let bytes = LEN * 4;
        let mut params = Vec::new();
        let mut grads = Vec::new();
        for u in 0..n {
            let p = DeviceBuffer::new(bytes)?;
            k.upload_f32(&values(100 + u as u64, LEN), &t(&p))?;
            params.push(p);
            let g = DeviceBuffer::new(bytes)?;
            k.zero_(&t(&g))?;
            grads.push(g);
        }
        let batch = DeviceBuffer::new(bytes * MBS)?;
        k.upload_f32(
            &values(7, LEN * MBS),
            &DevTensor::new(batch.as_ptr() as usize, DType::F32, &[MBS * LEN]),
        )?;
        let ones = DeviceBuffer::new(bytes)?;
        k.upload_f32(&vec![1.0; LEN], &t(&ones))?;
        let losses = DeviceBuffer::new(MBS * 4)?;
        Ok(Toy {
            last,
            params,
            grads,
            batch,
            ones,
            losses,
            pool: Vec::new(),
            has_loss: false,
        })
    }

    fn buffer(&mut self) -> Result<DeviceBuffer, AscendError> {
        match self.pool.pop() {
            Some(b) => Ok(b),
            None => DeviceBuffer::new(LEN * 4),
        }
    }

    /// Host copies of every unit's gradients (after the step; synchronous reads).
    pub(crate) fn read_grads(&self) -> Vec<Vec<f32>> {
        self.grads.iter().map(read).collect()
    }
}

pub(crate) fn read(b: &DeviceBuffer) -> Vec<f32> {
    let mut bytes = vec![0u8; b.len()];
    read_device(b.as_ptr() as usize, &mut bytes).expect("read");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl DeviceModel for Toy {
    type Stash = Stash;

    fn output_len(&self, _: UnitId) -> usize {
        LEN
    }

    fn forward(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        mb: usize,
        inputs: &[DevTensor],
        out: &DevTensor,
    ) -> Result<Stash, AscendError> {
        let x = self.buffer()?;
        let xv = t(&x);
        match inputs {
            [] => {
                let row = DevTensor::new(self.batch.as_ptr() as usize, DType::F32, &[MBS * LEN])
                    .narrow(0, mb * LEN, LEN);
                k.copy_(&xv, &row)?;
            }
            [first, rest @ ..] => {
                k.copy_(&xv, first)?;
                for r in rest {
                    k.add_(&xv, r, 1.0)?;
                }
            }
        }
        k.mul(&xv, &t(&self.params[unit as usize]), out)?;
        if unit == self.last {
            self.has_loss = true;
            let loss =
                DevTensor::new(self.losses.as_ptr() as usize, DType::F32, &[MBS]).narrow(0, mb, 1);
            k.sum_dim0(&out.reshape(&[LEN, 1]).expect("contiguous"), &loss)?;
        }
        Ok(Stash {
            x,
            g: self.buffer()?,
        })
    }

    fn backward_input(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        _mb: usize,
        stash: &mut Stash,
        grad_out: Option<&DevTensor>,
        grad_in: &[DevTensor],
    ) -> Result<(), AscendError> {
        let g = grad_out.cloned().unwrap_or_else(|| t(&self.ones));
        k.copy_(&t(&stash.g), &g)?;
        for gi in grad_in {
            k.mul(&g, &t(&self.params[unit as usize]), gi)?;
        }
        Ok(())
    }

    fn backward_weight(
        &mut self,
        k: &mut Kernels,
        unit: UnitId,
        _mb: usize,
        stash: Stash,
    ) -> Result<(), AscendError> {
        let (x, g) = (t(&stash.x), t(&stash.g));
        k.mul(&g, &x, &x)?;
        k.add_(&t(&self.grads[unit as usize]), &x, 1.0)?;
        self.pool.push(stash.x);
        self.pool.push(stash.g);
        Ok(())
    }

    fn params(&self, unit: UnitId) -> DevTensor {
        t(&self.params[unit as usize])
    }

    fn grads(&self, unit: UnitId) -> DevTensor {
        t(&self.grads[unit as usize])
    }

    fn losses(&self) -> Option<DevTensor> {
        self.has_loss
            .then(|| DevTensor::new(self.losses.as_ptr() as usize, DType::F32, &[MBS]))
    }
}

/// The optimizer, queued on the compute stream after a step (no host wait): every
/// unit's `p -= LR * g`, then its gradient zeroed. A rank whose gradient of a unit is
/// partial (a reduction's non-root) updates its copy wrongly, but the next step's
/// broadcast overwrites it, as in training with a home rank per unit.
pub(crate) fn update(dev: &mut DeviceRank, model: &Toy) -> Result<(), AscendError> {
    for (p, g) in model.params.iter().zip(&model.grads) {
        dev.kernels().add_(&t(p), &t(g), -LR)?;
        dev.kernels().zero_(&t(g))?;
    }
    Ok(())
}
