//! The device implementation of the model's tensor operations against the host's:
//! every operation on small random inputs, then whole units (forward, split and
//! fused backward) of the model, on the emulated device, within 1e-5.
#![cfg(feature = "ascend")]

use mpipe_mllm::device::{Consts, DevBuf, Device, DeviceMllm, Pool};
use mpipe_mllm::ops::{Init, LayerNorm, Linear, ParamLayout};
use mpipe_mllm::pipeline::rel_diff;
use mpipe_mllm::rng::Rng;
use mpipe_mllm::tensor_ops::{Bmm, Host, Ops};
use mpipe_mllm::{Config, Dataset, Mllm};
use mpipe_runtime::ascend::counters;
use mpipe_runtime::ascend::kernels::Kernels;
use mpipe_runtime::ascend::safe::{self, DeviceBuffer};
use mpipe_runtime::ascend::tensor::{DType, DevTensor};

const TOL: f32 = 1e-5;

struct Env {
    _dev: safe::Device,
    k: Kernels,
    pool: Pool,
    consts: Consts,
    /// Device buffers the test made (kept alive until the end).
    keep: Vec<DeviceBuffer>,
}

impl Env {
    fn new() -> Env {
        safe::init().expect("acl init");
        let dev = safe::Device::set(0).expect("device 0");
        Env {
            _dev: dev,
            k: Kernels::new().expect("kernels"),
            pool: Pool::new(),
            consts: Consts::default(),
            keep: Vec::new(),
        }
    }
    fn ops(&mut self) -> Device<'_> {
        Device {
            k: &mut self.k,
            pool: self.pool.clone(),
            consts: &mut self.consts,
        }
    }
    /// A device copy of `x`, as a flat view.
    fn put(&mut self, x: &[f32]) -> DevTensor {
        let b = DeviceBuffer::new(x.len() * 4).expect("alloc");
        let t = DevTensor::of(&b, DType::F32, &[x.len()]).expect("view");
        self.k.upload_f32(x, &t).expect("upload");
        self.keep.push(b);
        t
    }
    fn get(&mut self, t: &DevTensor) -> Vec<f32> {
        self.k.download_f32(t).expect("download")
    }
    /// Asserts that the device tensor `d` equals `h` within `TOL` (relative to the
    /// magnitude, at least 1).
    fn same(&mut self, what: &str, d: &DevTensor, h: &[f32]) {
        let got = self.get(d);
        assert_eq!(got.len(), h.len(), "{what}: length");
        for (i, (a, b)) in got.iter().zip(h).enumerate() {
            assert!(
                (a - b).abs() <= TOL * b.abs().max(1.0),
                "{what}[{i}]: device {a} vs host {b}"
            );
        }
    }
    /// Asserts that the device tensor `d` equals `h` by the measure `--check` uses:
    /// `max |d - h| / max |h|` within `TOL`.
    fn close(&mut self, what: &str, d: &DevTensor, h: &[f32]) {
        let got = self.get(d);
        let r = rel_diff(&got, h);
        assert!(r <= f64::from(TOL), "{what}: relative difference {r:e}");
    }
    fn same_buf(&mut self, what: &str, d: &DevBuf, h: &[f32]) {
        let v = d.view().clone();
        self.same(what, &v, h);
    }
}

fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

#[test]
fn every_op_equals_the_host() {
    let mut env = Env::new();
    let mut rng = Rng::new(42);
    let mut h = Host::<f32>::new();
    let (n, din, dout, d, v) = (6, 5, 7, 8, 9);
    let mut pl = ParamLayout::default();
    let lin = Linear::new(&mut pl, "lin", din, dout, None);
    let ln = LayerNorm::new(&mut pl, "ln", d);
    let tok = pl.alloc("tok".into(), v * d, Init::Const(0.0));
    let pos = pl.alloc("pos".into(), 3 * d, Init::Const(0.0));
    let hp = random(&mut rng, pl.len());
    let dp = env.put(&hp);
    let mut hg = random(&mut rng, pl.len());
    let mut dg = env.put(&hg);

    // Linear.
    let hx = random(&mut rng, n * din);
    let hdy = random(&mut rng, n * dout);
    let mut o = env.ops();
    let (dx, ddy) = (o.upload(&hx).unwrap(), o.upload(&hdy).unwrap());
    let dy_lin = o.linear(&dp, &lin, &dx, n).unwrap();
    let dx_lin = o.linear_backward_input(&dp, &lin, &ddy, n).unwrap();
    o.linear_backward_weight(&mut dg, &lin, &dx, &ddy, n)
        .unwrap();
    let hx_ = hx.clone();
    let hdy_ = hdy.clone();
    let y = h.linear(&hp, &lin, &hx_, n).unwrap();
    let gx = h.linear_backward_input(&hp, &lin, &hdy_, n).unwrap();
    h.linear_backward_weight(&mut hg, &lin, &hx_, &hdy_, n)
        .unwrap();
    env.same_buf("linear", &dy_lin, &y);
    env.same_buf("linear_backward_input", &dx_lin, &gx);
    env.same("linear_backward_weight", &dg, &hg);

    // Layer norm.
    let hx = random(&mut rng, n * d)
        .iter()
        .map(|x| 3.0 * x + 1.0)
        .collect::<Vec<_>>();
    let hdy = random(&mut rng, n * d);
    let mut o = env.ops();
    let (dx, ddy) = (o.upload(&hx).unwrap(), o.upload(&hdy).unwrap());
    let (y, m, r) = o.layer_norm(&dp, &ln, &dx, n).unwrap();
    let gx = o
        .layer_norm_backward(&dp, Some(&mut dg), &ln, &dx, &m, &r, &ddy, n)
        .unwrap();
    o.layer_norm_backward_weight(&dp, &mut dg, &ln, &dx, &m, &r, &ddy, n)
        .unwrap();
    let (hy, hm, hr) = h.layer_norm(&hp, &ln, &hx, n).unwrap();
    let hgx = h
        .layer_norm_backward(&hp, Some(&mut hg), &ln, &hx, &hm, &hr, &hdy, n)
        .unwrap();
    h.layer_norm_backward_weight(&hp, &mut hg, &ln, &hx, &hm, &hr, &hdy, n)
        .unwrap();
    env.same_buf("layer_norm", &y, &hy);
    env.same_buf("layer_norm mean", &m, &hm);
    env.same_buf("layer_norm rstd", &r, &hr);
    env.same_buf("layer_norm_backward", &gx, &hgx);
    env.same("layer_norm weight gradients", &dg, &hg);

    // GELU, add, rows.
    let hu = random(&mut rng, 3 * d)
        .iter()
        .map(|x| 2.0 * x)
        .collect::<Vec<_>>();
    let hdg = random(&mut rng, 3 * d);
    let mut o = env.ops();
    let (du, ddg) = (o.upload(&hu).unwrap(), o.upload(&hdg).unwrap());
    let g = o.gelu(&du).unwrap();
    let gb = o.gelu_backward(&du, &ddg).unwrap();
    let mut sum = o.copy(&du).unwrap();
    o.add_(&mut sum, &ddg).unwrap();
    let mut rows = o.copy(&du).unwrap();
    o.add_rows_(&mut rows, &dp, ln.g).unwrap();
    o.sum_rows_acc(&mut dg, pos, &ddg).unwrap();
    let hgl = h.gelu(&hu).unwrap();
    let hgb = h.gelu_backward(&hu, &hdg).unwrap();
    let mut hsum = hu.clone();
    h.add_(&mut hsum, &hdg).unwrap();
    let mut hrows = hu.clone();
    h.add_rows_(&mut hrows, &hp, ln.g).unwrap();
    h.sum_rows_acc(&mut hg, pos, &hdg).unwrap();
    env.same_buf("gelu", &g, &hgl);
    env.same_buf("gelu_backward", &gb, &hgb);
    env.same_buf("add_", &sum, &hsum);
    env.same_buf("add_rows_", &rows, &hrows);
    env.same("sum_rows_acc", &dg, &hg);

    // Attention pieces: heads, batched products, softmax.
    let (b, l, heads, dh) = (2, 5, 3, 4);
    let hqkv = random(&mut rng, b * l * 3 * heads * dh);
    let mut o = env.ops();
    let dqkv = o.upload(&hqkv).unwrap();
    let split = o.split_heads(&dqkv, b, l, 3, heads, dh).unwrap();
    let merged = o.merge_heads(&split, b, l, 3, heads, dh).unwrap();
    let hsplit = h.split_heads(&hqkv, b, l, 3, heads, dh).unwrap();
    let hmerged = h.merge_heads(&hsplit, b, l, 3, heads, dh).unwrap();
    assert_eq!(hmerged, hqkv, "merge_heads inverts split_heads on the host");
    env.same_buf("split_heads", &split, &hsplit);
    env.same_buf("merge_heads", &merged, &hmerged);
    let bh = b * heads;
    let nq = bh * l * dh;
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let s = Bmm {
            batch: bh,
            m: l,
            k: dh,
            n: l,
            ta,
            tb,
            alpha: 0.5,
        };
        let mut o = env.ops();
        let mut out = o.alloc(bh * l * l + 3).unwrap();
        o.bmm((&split, 0), (&split, nq), (&mut out, 3), s).unwrap();
        let mut hout = vec![0.0; bh * l * l + 3];
        h.bmm((&hsplit, 0), (&hsplit, nq), (&mut hout, 3), s)
            .unwrap();
        let dv = out.view().narrow(0, 3, bh * l * l);
        env.same(&format!("bmm ta={ta} tb={tb}"), &dv, &hout[3..]);
    }
    for causal in [false, true] {
        let hs = random(&mut rng, bh * l * l);
        let hdy = random(&mut rng, bh * l * l);
        let mut o = env.ops();
        let (ds, ddy) = (o.upload(&hs).unwrap(), o.upload(&hdy).unwrap());
        let p = o.softmax(ds, bh, l, causal).unwrap();
        let dsb = o.softmax_backward(&ddy, &p, l).unwrap();
        let hp_ = h.softmax(hs, bh, l, causal).unwrap();
        let hdsb = h.softmax_backward(&hdy, &hp_, l).unwrap();
        env.same_buf(&format!("softmax causal={causal}"), &p, &hp_);
        env.same_buf(&format!("softmax_backward causal={causal}"), &dsb, &hdsb);
    }

    // Embedding, sequences.
    let ids: Vec<i64> = (0..n).map(|_| rng.below(v) as i64).collect();
    let hdx = random(&mut rng, n * d);
    let hadd = random(&mut rng, 2 * 2 * d);
    let mut o = env.ops();
    let dids = o.indices(&ids).unwrap();
    let ddx = o.upload(&hdx).unwrap();
    let dadd = o.upload(&hadd).unwrap();
    let e = o.embedding(&dp, tok, d, &dids).unwrap();
    o.embedding_backward(&mut dg, tok, d, &ddx, &dids).unwrap();
    // 2 sequences of 2 rows of `dadd` then 3 rows of the embedding.
    let cat = o.concat_seq(&dadd, 2, &e, 3, 2, d).unwrap();
    let (sa, sb) = o.split_seq(&cat, 2, 3, 2, d).unwrap();
    let hids = h.indices(&ids).unwrap();
    let he = h.embedding(&hp, tok, d, &hids).unwrap();
    h.embedding_backward(&mut hg, tok, d, &hdx, &hids).unwrap();
    let hcat = h.concat_seq(&hadd, 2, &he, 3, 2, d).unwrap();
    let (hsa, hsb) = h.split_seq(&hcat, 2, 3, 2, d).unwrap();
    assert_eq!((&hsa, &hsb), (&hadd, &he), "split_seq inverts concat_seq");
    env.same_buf("embedding", &e, &he);
    env.same("embedding_backward", &dg, &hg);
    env.same_buf("concat_seq", &cat, &hcat);
    env.same_buf("split_seq a", &sa, &hsa);
    env.same_buf("split_seq b", &sb, &hsb);

    // Cross-entropy, with rows without a target.
    let hl = random(&mut rng, n * v);
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i % 3 == 0 {
                -100
            } else {
                rng.below(v) as i64
            }
        })
        .collect();
    let mut o = env.ops();
    let dl = o.upload(&hl).unwrap();
    let dt = o.indices(&targets).unwrap();
    let dscale = o.upload(&[0.75]).unwrap();
    let (loss, ce) = o.cross_entropy(dl, &dt, v).unwrap();
    let d1 = o.cross_entropy_backward(&ce, &dt, None, v).unwrap();
    let d2 = o
        .cross_entropy_backward(&ce, &dt, Some(&dscale), v)
        .unwrap();
    let ht = h.indices(&targets).unwrap();
    let (hloss, hce) = h.cross_entropy(hl, &ht, v).unwrap();
    let hd1 = h.cross_entropy_backward(&hce, &ht, None, v).unwrap();
    let hd2 = h
        .cross_entropy_backward(&hce, &ht, Some(&vec![0.75]), v)
        .unwrap();
    env.same_buf("cross_entropy", &loss, &hloss);
    env.same_buf("cross_entropy_backward", &d1, &hd1);
    env.same_buf("cross_entropy_backward scaled", &d2, &hd2);

    // Every result differs from its input (the checks above are not vacuous).
    assert!(hloss[0] > 0.0 && hd1.iter().any(|&x| x != 0.0));
}

/// Every unit of the model on the device and on the host: the output, the input
/// gradients and the weight gradients, split and fused, by `--check`'s measure (the
/// host runs in f32, the emulator's kernels in f64 rounded to f32 once per kernel,
/// so single elements of a whole unit's gradients differ by a few 1e-5 relative);
/// then the same again, which allocates nothing.
#[test]
fn units_on_the_device_equal_the_host() {
    let mut env = Env::new();
    let cfg = Config {
        stages: 3,
        ..Config::tiny()
    };
    let data = Dataset::new(&cfg, 3);
    let batch = data.batch(0, 2);
    let mut host = Mllm::new(cfg.clone());
    host.set_batch(&batch);
    let params: Vec<Vec<f32>> = (0..host.units())
        .map(|u| host.unit_params(u).to_vec())
        .collect();
    let refs: Vec<&[f32]> = params.iter().map(Vec::as_slice).collect();
    let mut dev = DeviceMllm::new(&mut env.k, &cfg, &refs).expect("device model");
    dev.set_batch(&batch).expect("batch");
    let mut rng = Rng::new(9);
    let units = host.units();
    let mut allocations = None;
    for round in 0..2 {
        for fused in [false, true] {
            host.zero_grads();
            dev.zero_grads(&mut env.k).unwrap();
            let mb = 1;
            let mut input: Option<Vec<f32>> = None;
            for u in 0..units {
                let ins: Vec<&[f32]> = input.iter().map(Vec::as_slice).collect();
                let (hout, mut hst) = host.forward_unit(u, mb, &ins);
                let dins: Vec<DevTensor> = input.iter().map(|x| env.put(x)).collect();
                let out = env.put(&vec![0.0; hout.len()]);
                let mut dst = dev
                    .forward(&mut env.k, u, mb, &dins, &out)
                    .expect("forward");
                env.close(&format!("unit {u} output"), &out, &hout);

                // Backward from a random output gradient (none for the loss).
                let last = u + 1 == units;
                let gout = (!last).then(|| random(&mut rng, hout.len()));
                let dgout = gout.as_ref().map(|g| env.put(g));
                let hin = if fused {
                    host.backward(u, mb, &mut hst, gout.as_deref())
                } else {
                    let g = host.backward_input_unit(u, mb, &mut hst, gout.as_deref());
                    host.backward_weight_unit(u, mb, hst);
                    g
                };
                let gin: Vec<DevTensor> =
                    hin.iter().map(|g| env.put(&vec![0.0; g.len()])).collect();
                if fused {
                    dev.backward(&mut env.k, u, &mut dst, dgout.as_ref(), &gin)
                } else {
                    dev.backward_input(&mut env.k, u, &mut dst, dgout.as_ref(), &gin)
                        .and_then(|()| dev.backward_weight(&mut env.k, u, dst))
                }
                .expect("backward");
                for (i, (d, h)) in gin.iter().zip(&hin).enumerate() {
                    env.close(
                        &format!("unit {u} input gradient {i} (fused {fused})"),
                        d,
                        h,
                    );
                }
                let g = dev.grads(u);
                let hg = host.unit_grads(u).to_vec();
                assert!(hg.iter().any(|&x| x != 0.0), "unit {u}: zero gradients");
                env.close(
                    &format!("unit {u} weight gradients (fused {fused})"),
                    &g,
                    &hg,
                );
                input = Some(hout);
            }
            let loss = env.get(&dev.losses().expect("losses"));
            let hl = host.microbatch_loss(1).expect("loss");
            assert!(
                (loss[1] - hl).abs() <= TOL * hl.abs().max(1.0),
                "loss {} vs {hl}",
                loss[1]
            );
        }
        let now = dev.pool().allocations();
        if round == 0 {
            allocations = Some(now);
        } else {
            assert_eq!(
                Some(now),
                allocations,
                "the second round allocated device memory"
            );
        }
    }
    // The emulator's happens-before check saw every access ordered (this binary's
    // tests all use device 0; none may report a hazard).
    let hazards = counters::hazard_reports(0);
    assert!(hazards.is_empty(), "hazards: {hazards:#?}");
}
