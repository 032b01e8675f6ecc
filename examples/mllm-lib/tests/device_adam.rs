//! The device Adam (`optim::device::DeviceAdam`, aclnnApplyAdamWV2 on the emulated
//! device) against the host `Adam`: several steps on two units of different sizes,
//! with and without weight decay, the gradient scaled as training scales it; every
//! parameter within 1e-5 (relative to its magnitude, at least 1), the gradients left
//! as they were, and no allocation after the first update.
#![cfg(feature = "ascend")]

use mpipe_mllm::optim::device::DeviceAdam;
use mpipe_mllm::rng::Rng;
use mpipe_mllm::{Adam, AdamConfig};
use mpipe_runtime::ascend::counters;
use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::{self, DeviceBuffer};
use mpipe_runtime::ascend::tensor::{DType, DevTensor};

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * scale).collect()
}

fn put(k: &mut Kernels, keep: &mut Vec<DeviceBuffer>, x: &[f32]) -> DevTensor {
    let b = DeviceBuffer::new(x.len() * 4).expect("alloc");
    let t = DevTensor::of(&b, DType::F32, &[x.len()]).expect("view");
    k.upload_f32(x, &t).expect("upload");
    keep.push(b);
    t
}

#[test]
fn device_adam_equals_the_host_adam() {
    safe::init().expect("acl init");
    let _dev = safe::Device::set(0).expect("device 0");
    let mut k = Kernels::new().expect("kernels");
    for weight_decay in [0.0, 0.1] {
        let cfg = AdamConfig {
            lr: 3e-3,
            weight_decay,
            ..AdamConfig::default()
        };
        let mut rng = Rng::new(11);
        let sizes = [37usize, 300];
        let scale = 1.0 / 8.0;
        let mut host = Adam::new(cfg);
        let mut dev = DeviceAdam::new(cfg);
        let mut keep = Vec::new();
        let mut hp: Vec<Vec<f32>> = sizes.iter().map(|&n| random(&mut rng, n, 0.5)).collect();
        let dp: Vec<DevTensor> = hp.iter().map(|p| put(&mut k, &mut keep, p)).collect();
        let dg: Vec<DevTensor> = sizes
            .iter()
            .map(|&n| put(&mut k, &mut keep, &vec![0.0; n]))
            .collect();
        let device = _dev.id();
        for step in 0..4 {
            // Gradients of very different magnitudes, some tiny (where eps matters).
            let gs: Vec<Vec<f32>> = sizes
                .iter()
                .map(|&n| random(&mut rng, n, if step % 2 == 0 { 1e-8 } else { 1.0 }))
                .collect();
            for (g, t) in gs.iter().zip(&dg) {
                k.upload_f32(g, t).expect("upload");
            }
            for (u, (p, g)) in hp.iter_mut().zip(&gs).enumerate() {
                host.step_unit(u, p, g, scale);
            }
            if step == 1 {
                k.synchronize().expect("sync");
                counters::reset(device);
            }
            let units: Vec<_> = (0..sizes.len())
                .map(|u| (u, dp[u].clone(), dg[u].clone()))
                .collect();
            dev.step(&mut k, &units, scale).expect("device adam");
            if step >= 1 {
                let c = counters::snapshot(device).expect("emulator counters");
                assert_eq!((c.mallocs, c.frees), (0, 0), "step {step} allocates");
            }
            for u in 0..sizes.len() {
                let got = k.download_f32(&dp[u]).expect("download");
                for (i, (a, b)) in got.iter().zip(&hp[u]).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "wd {weight_decay}, step {step}, unit {u}[{i}]: device {a} host {b}"
                    );
                }
                let g = k.download_f32(&dg[u]).expect("download");
                assert_eq!(g, gs[u], "the gradients are left as they were");
            }
        }
        assert_eq!(dev.steps(), 4);
    }
}
