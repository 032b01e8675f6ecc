//! [`Kernels`] on the emulated device: a tiny 2-layer MLP (linear, bias, GELU, linear,
//! bias, log-softmax, NLL; its backward with addmm-accumulated weight gradients; AdamW)
//! equals a host computation of the same formulas within 1e-5, and a loop of training
//! steps allocates nothing after the first, copies only its inputs and one loss, waits
//! once, and has no hazards.
//!
//! `cargo test --release -p mpipe-runtime --features ascend --test ascend_kernels`
#![cfg(feature = "ascend")]

use mpipe_runtime::ascend::counters;
use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::{self, Device, DeviceBuffer};
use mpipe_runtime::ascend::tensor::{DType, DevTensor};
use mpipe_runtime::ascend::AscendError;

const N: usize = 4;
const DIN: usize = 3;
const H: usize = 5;
const C: usize = 3;
const LR: f32 = 0.05;
const B1: f32 = 0.9;
const B2: f32 = 0.999;
const EPS: f32 = 1e-8;
const WD: f32 = 0.01;

fn rng(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// Device buffers of the model and its step, each with a view.
struct Mlp {
    _bufs: Vec<DeviceBuffer>,
    x: DevTensor,
    t: DevTensor,
    w1: DevTensor,
    b1: DevTensor,
    w2: DevTensor,
    b2: DevTensor,
    h1: DevTensor,
    a1: DevTensor,
    z: DevTensor,
    logp: DevTensor,
    loss: DevTensor,
    tw: DevTensor,
    dloss: DevTensor,
    dlogp: DevTensor,
    dz: DevTensor,
    gw2: DevTensor,
    gb2: DevTensor,
    da1: DevTensor,
    dh1: DevTensor,
    gw1: DevTensor,
    gb1: DevTensor,
    /// (m, v) per parameter, in the order w1, b1, w2, b2.
    adam: Vec<(DevTensor, DevTensor)>,
}

fn buf(bufs: &mut Vec<DeviceBuffer>, dtype: DType, shape: &[usize]) -> DevTensor {
    let n: usize = shape.iter().product();
    let b = DeviceBuffer::new(n.max(1) * dtype.size()).unwrap();
    let v = DevTensor::of(&b, dtype, shape).unwrap();
    bufs.push(b);
    v
}

struct Params {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

fn params() -> Params {
    Params {
        w1: rng(3, DIN * H),
        b1: rng(4, H),
        w2: rng(5, H * C),
        b2: rng(6, C),
    }
}

impl Mlp {
    fn new(k: &mut Kernels, p: &Params) -> Mlp {
        let mut b = Vec::new();
        let f = DType::F32;
        let mut m = Mlp {
            x: buf(&mut b, f, &[N, DIN]),
            t: buf(&mut b, DType::I64, &[N]),
            w1: buf(&mut b, f, &[DIN, H]),
            b1: buf(&mut b, f, &[H]),
            w2: buf(&mut b, f, &[H, C]),
            b2: buf(&mut b, f, &[C]),
            h1: buf(&mut b, f, &[N, H]),
            a1: buf(&mut b, f, &[N, H]),
            z: buf(&mut b, f, &[N, C]),
            logp: buf(&mut b, f, &[N, C]),
            loss: buf(&mut b, f, &[]),
            tw: buf(&mut b, f, &[]),
            dloss: buf(&mut b, f, &[]),
            dlogp: buf(&mut b, f, &[N, C]),
            dz: buf(&mut b, f, &[N, C]),
            gw2: buf(&mut b, f, &[H, C]),
            gb2: buf(&mut b, f, &[C]),
            da1: buf(&mut b, f, &[N, H]),
            dh1: buf(&mut b, f, &[N, H]),
            gw1: buf(&mut b, f, &[DIN, H]),
            gb1: buf(&mut b, f, &[H]),
            adam: Vec::new(),
            _bufs: Vec::new(),
        };
        for shape in [&[DIN, H][..], &[H], &[H, C], &[C]] {
            let (mm, vv) = (buf(&mut b, f, shape), buf(&mut b, f, shape));
            k.zero_(&mm).unwrap();
            k.zero_(&vv).unwrap();
            m.adam.push((mm, vv));
        }
        k.upload_f32(&p.w1, &m.w1).unwrap();
        k.upload_f32(&p.b1, &m.b1).unwrap();
        k.upload_f32(&p.w2, &m.w2).unwrap();
        k.upload_f32(&p.b2, &m.b2).unwrap();
        k.upload_f32(&[1.0], &m.dloss).unwrap();
        m._bufs = b;
        m
    }

    /// One training step, issued without waiting; returns nothing (read the loss after).
    fn step(&self, k: &mut Kernels, x: &[f32], t: &[i64], step: u64) -> Result<(), AscendError> {
        k.upload_f32(x, &self.x)?;
        k.upload_i64(t, &self.t)?;
        // forward
        k.matmul(&self.x, &self.w1, &self.h1)?;
        k.add_(&self.h1, &self.b1, 1.0)?;
        k.gelu(&self.h1, &self.a1)?;
        k.matmul(&self.a1, &self.w2, &self.z)?;
        k.add_(&self.z, &self.b2, 1.0)?;
        k.log_softmax(&self.z, &self.logp)?;
        k.nll_loss(&self.logp, &self.t, &self.loss, &self.tw)?;
        // backward
        k.nll_loss_backward(&self.dloss, &self.logp, &self.t, &self.tw, &self.dlogp)?;
        k.log_softmax_backward(&self.dlogp, &self.logp, &self.dz)?;
        k.zero_(&self.gw2)?;
        k.addmm_(&self.gw2, &self.a1.t(), &self.dz, 1.0, 1.0)?;
        k.sum_dim0(&self.dz, &self.gb2)?;
        k.matmul(&self.dz, &self.w2.t(), &self.da1)?;
        k.gelu_backward(&self.da1, &self.h1, &self.dh1)?;
        k.zero_(&self.gw1)?;
        k.addmm_(&self.gw1, &self.x.t(), &self.dh1, 1.0, 1.0)?;
        k.sum_dim0(&self.dh1, &self.gb1)?;
        // optimizer
        let pg = [
            (&self.w1, &self.gw1),
            (&self.b1, &self.gb1),
            (&self.w2, &self.gw2),
            (&self.b2, &self.gb2),
        ];
        for ((p, g), (m, v)) in pg.iter().zip(&self.adam) {
            k.adam_(p, m, v, g, step, LR, B1, B2, EPS, WD)?;
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ host reference

fn gelu(x: f64) -> f64 {
    x / (1.0 + (-2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).exp())
}

fn gelu_grad(x: f64) -> f64 {
    let c = 2.0 * (2.0 / std::f64::consts::PI).sqrt();
    let s = 1.0 / (1.0 + (-c * (x + 0.044715 * x.powi(3))).exp());
    s + x * s * (1.0 - s) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

fn mm(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut z = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            z[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
        }
    }
    z
}

fn tr(a: &[f64], m: usize, n: usize) -> Vec<f64> {
    (0..n * m).map(|i| a[(i % m) * n + i / m]).collect()
}

struct HostStep {
    loss: f64,
    grads: [Vec<f64>; 4],
}

fn host_step(p: &[Vec<f64>; 4], x: &[f64], t: &[i64]) -> HostStep {
    let [w1, b1, w2, b2] = p;
    let mut h1 = mm(x, w1, N, DIN, H);
    for (i, v) in h1.iter_mut().enumerate() {
        *v += b1[i % H];
    }
    let a1: Vec<f64> = h1.iter().map(|&v| gelu(v)).collect();
    let mut z = mm(&a1, w2, N, H, C);
    for (i, v) in z.iter_mut().enumerate() {
        *v += b2[i % C];
    }
    let mut logp = [0.0; N * C];
    for r in 0..N {
        let row = &z[r * C..(r + 1) * C];
        let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - mx).exp()).sum();
        for j in 0..C {
            logp[r * C + j] = row[j] - mx - s.ln();
        }
    }
    let counted: Vec<usize> = (0..N).filter(|&r| t[r] != -100).collect();
    let loss = -counted
        .iter()
        .map(|&r| logp[r * C + t[r] as usize])
        .sum::<f64>()
        / counted.len() as f64;
    let mut dz = vec![0.0; N * C];
    for &r in &counted {
        for j in 0..C {
            let onehot = if j == t[r] as usize { 1.0 } else { 0.0 };
            dz[r * C + j] = (logp[r * C + j].exp() - onehot) / counted.len() as f64;
        }
    }
    let gw2 = mm(&tr(&a1, N, H), &dz, H, N, C);
    let gb2: Vec<f64> = (0..C)
        .map(|j| (0..N).map(|r| dz[r * C + j]).sum())
        .collect();
    let da1 = mm(&dz, &tr(w2, H, C), N, C, H);
    let dh1: Vec<f64> = da1
        .iter()
        .zip(&h1)
        .map(|(d, &h)| d * gelu_grad(h))
        .collect();
    let gw1 = mm(&tr(x, N, DIN), &dh1, DIN, N, H);
    let gb1: Vec<f64> = (0..H)
        .map(|j| (0..N).map(|r| dh1[r * H + j]).sum())
        .collect();
    HostStep {
        loss,
        grads: [gw1, gb1, gw2, gb2],
    }
}

fn close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 1e-5,
            "{what}[{i}]: device {g}, host {w}"
        );
    }
}

fn on_device(id: i32) -> Device {
    safe::init().unwrap();
    let d = Device::set(id).unwrap();
    counters::reset(id);
    d
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn batch(s: u64) -> (Vec<f32>, Vec<i64>) {
    let x = rng(100 + s, N * DIN).iter().map(|v| 4.0 * v).collect();
    let t = vec![(s % 3) as i64, 2, -100, ((s + 1) % 3) as i64];
    (x, t)
}

#[test]
fn mlp_forward_backward_and_adamw_equal_the_host() {
    let _d = on_device(0);
    let mut k = Kernels::new().unwrap();
    let p = params();
    let mlp = Mlp::new(&mut k, &p);
    let mut hp = [f64s(&p.w1), f64s(&p.b1), f64s(&p.w2), f64s(&p.b2)];
    let mut hm = [
        vec![0.0; DIN * H],
        vec![0.0; H],
        vec![0.0; H * C],
        vec![0.0; C],
    ];
    let mut hv = hm.clone();
    for step in 1..=3u64 {
        let (x, t) = batch(step);
        mlp.step(&mut k, &x, &t, step).unwrap();
        let want = host_step(&hp, &f64s(&x), &t);
        close(&k.download_f32(&mlp.loss).unwrap(), &[want.loss], "loss");
        for (g, (w, name)) in [&mlp.gw1, &mlp.gb1, &mlp.gw2, &mlp.gb2]
            .iter()
            .zip(want.grads.iter().zip(["gw1", "gb1", "gw2", "gb2"]))
        {
            close(&k.download_f32(g).unwrap(), w, name);
        }
        // AdamW on the host, as Kernels::adam_ documents it.
        let (lr, b1, b2, eps, wd) = (
            f64::from(LR),
            f64::from(B1),
            f64::from(B2),
            f64::from(EPS),
            f64::from(WD),
        );
        for q in 0..4 {
            for i in 0..hp[q].len() {
                let g = want.grads[q][i];
                hp[q][i] *= 1.0 - lr * wd;
                hm[q][i] = b1 * hm[q][i] + (1.0 - b1) * g;
                hv[q][i] = b2 * hv[q][i] + (1.0 - b2) * g * g;
                let mh = hm[q][i] / (1.0 - b1.powi(step as i32));
                let vh = hv[q][i] / (1.0 - b2.powi(step as i32));
                hp[q][i] -= lr * mh / (vh.sqrt() + eps);
            }
        }
        for (dv, (w, name)) in [&mlp.w1, &mlp.b1, &mlp.w2, &mlp.b2]
            .iter()
            .zip(hp.iter().zip(["w1", "b1", "w2", "b2"]))
        {
            close(&k.download_f32(dv).unwrap(), w, name);
        }
    }
    assert!(
        counters::hazard_reports(0).is_empty(),
        "{:?}",
        counters::hazard_reports(0)
    );
}

#[test]
fn a_training_loop_allocates_nothing_after_its_first_step() {
    let _d = on_device(1);
    let mut k = Kernels::new().unwrap();
    let p = params();
    let mlp = Mlp::new(&mut k, &p);
    let mut losses = Vec::new();
    let steps = 4u64;
    for step in 1..=steps {
        let (x, t) = batch(step);
        mlp.step(&mut k, &x, &t, step).unwrap();
        losses.push(k.download_f32(&mlp.loss).unwrap()[0]);
        if step == 1 {
            counters::reset(1);
        }
    }
    let c = counters::snapshot(1).expect("the emulator counts");
    let later = steps - 1;
    assert_eq!((c.mallocs, c.frees), (0, 0), "{c}");
    // x and targets uploaded, the loss read back; one host wait per step.
    assert_eq!(c.copies, 3 * later, "{c}");
    assert_eq!(c.host_waits, later, "{c}");
    // 7 forward, 10 backward, 4 AdamW updates and the step counter's advance.
    assert_eq!(c.kernels, 22 * later, "{c}");
    assert_eq!(c.hazards, 0, "{:?}", counters::hazard_reports(1));
    assert_eq!(c.threads, 1, "{c}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

#[test]
fn errors_name_the_aclnn_call() {
    let _d = on_device(2);
    let mut k = Kernels::new().unwrap();
    let mut bufs = Vec::new();
    let a = buf(&mut bufs, DType::F32, &[2, 3]);
    let b = buf(&mut bufs, DType::F32, &[2, 3]);
    let o = buf(&mut bufs, DType::F32, &[2, 3]);
    let e = k.matmul(&a, &b, &o).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("aclnnMatmulGetWorkspaceSize"), "{msg}");
    assert!(msg.contains("ACLNN_ERR_PARAM_INVALID"), "{msg}");
    assert!(msg.contains("inner dims"), "{msg}");
    let e = k.upload_f32(&[1.0; 5], &a).unwrap_err();
    assert!(matches!(e, AscendError::Tensor(_)), "{e}");
    let e = k.download_f32(&a.t()).unwrap_err();
    assert!(e.to_string().contains("contiguous"), "{e}");
}
