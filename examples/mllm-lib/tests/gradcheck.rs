//! Finite-difference checks of the hand-derived gradients on a tiny model: the
//! weight gradients of every unit kind (encoder; first, middle and last LLM stage;
//! a single stage that is both) and the input gradients passed between units.
//!
//! The model runs in `f64` here (the very same generic code as the `f32` model the
//! runtime drives), so that central differences with `eps = 1e-3` are not drowned
//! in `f32` rounding; a last test checks that the `f32` model's gradients match the
//! `f64` ones.

mod common;

use common::{forward_all, forward_from, rel_diff};
use mpipe_mllm::rng::Rng;
use mpipe_mllm::{Config, Dataset, Mllm};

const EPS: f64 = 1e-3;
const TOL: f64 = 1e-2;

/// Central difference along coordinate `i` of `x`, where `loss` evaluates `x`.
fn central(x: &mut [f64], i: usize, mut loss: impl FnMut(&[f64]) -> f64) -> f64 {
    let x0 = x[i];
    x[i] = x0 + EPS;
    let lp = loss(x);
    x[i] = x0 - EPS;
    let lm = loss(x);
    x[i] = x0;
    (lp - lm) / (2.0 * EPS)
}

/// Coordinates to check: the `top` largest |analytic| ones and `random` others.
fn pick(grad: &[f64], top: usize, random: usize, rng: &mut Rng) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..grad.len()).collect();
    idx.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
    let mut out: Vec<usize> = idx[..top.min(idx.len())].to_vec();
    out.extend((0..random).map(|_| rng.below(grad.len())));
    out
}

/// Compare analytic and numeric values: the error is relative to the larger of
/// the two, with a floor at 1e-4 of the largest analytic magnitude (for entries
/// that are zero or nearly). Returns the worst error.
fn compare(what: &str, pairs: &[(usize, f64, f64)], scale: f64) -> f64 {
    let mut worst = 0.0f64;
    for &(i, a, n) in pairs {
        let err = (a - n).abs() / a.abs().max(n.abs()).max(1e-4 * scale);
        worst = worst.max(err);
        assert!(
            err < TOL,
            "{what}[{i}]: analytic {a:e} vs numeric {n:e} (rel err {err:e})"
        );
    }
    eprintln!(
        "{what}: {} coordinates, worst rel err {worst:.1e}",
        pairs.len()
    );
    worst
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn check_params(cfg: Config) {
    let data = Dataset::new(&cfg, 11);
    let batch = data.batch(0, 1);
    let mut model = Mllm::<f64>::new_as(cfg.clone());
    let (_, grads) = model.reference_step(&batch);
    let mut rng = Rng::new(5);
    for (u, g) in grads.iter().enumerate() {
        let name = &cfg.unit_names()[u];
        assert!(max_abs(g) > 0.0, "{name}: all-zero gradient");
        let mut p = model.unit_params(u).to_vec();
        let tensors = model.tensors(u).to_vec();
        let mut all = Vec::new();
        // Every parameter tensor: its 2 largest-gradient entries and 4 random ones.
        for (tname, r) in &tensors {
            let mut pairs = Vec::new();
            for i in pick(&g[r.clone()], 2, 4, &mut rng) {
                let i = r.start + i;
                let n = central(&mut p, i, |x| {
                    model.unit_params_mut(u).copy_from_slice(x);
                    model.eval_loss(&batch)
                });
                pairs.push((i, g[i], n));
            }
            // Relative to the unit's largest gradient: some tensors' gradients are
            // all tiny (e.g. positions no target depends on).
            for &(i, a, n) in &pairs {
                let err = (a - n).abs() / a.abs().max(n.abs()).max(1e-4 * max_abs(g));
                assert!(
                    err < TOL,
                    "{name}.{tname}[{i}]: analytic {a:e} vs numeric {n:e} (rel err {err:e})"
                );
            }
            all.extend(pairs);
        }
        model.unit_params_mut(u).copy_from_slice(&p);
        eprintln!("{name}: {} tensors", tensors.len());
        compare(&format!("{name} params"), &all, max_abs(g));

        // The directional derivative along the gradient: every coordinate at once.
        let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        let n = central(&mut [0.0], 0, |s| {
            let moved: Vec<f64> = p.iter().zip(g).map(|(a, d)| a + s[0] * d / norm).collect();
            model.unit_params_mut(u).copy_from_slice(&moved);
            model.eval_loss(&batch)
        });
        model.unit_params_mut(u).copy_from_slice(&p);
        let err = (norm - n).abs() / norm;
        eprintln!(
            "{name}: directional derivative |g| = {norm:.4e}, numeric {n:.4e}, rel err {err:.1e}"
        );
        assert!(
            err < TOL,
            "{name}: directional derivative {n:e} vs |g| {norm:e}"
        );
    }
}

#[test]
fn weight_gradients_two_stages() {
    // llm.0: embedding + 1 layer; llm.1: 2 layers + head.
    check_params(Config::tiny());
}

#[test]
fn weight_gradients_three_stages() {
    // 3 stages of one layer each: llm.1 has neither embedding nor head.
    check_params(Config {
        stages: 3,
        ..Config::tiny()
    });
}

#[test]
fn weight_gradients_one_stage() {
    // One stage with both the embedding and the head.
    check_params(Config {
        stages: 1,
        ..Config::tiny()
    });
}

/// The gradient each unit's `backward_input` returns for its input (the image
/// tokens into `llm.0`, the hidden states into `llm.k`) against finite
/// differences of the loss along that input.
#[test]
fn input_gradients_between_units() {
    let cfg = Config {
        stages: 3,
        ..Config::tiny()
    };
    let data = Dataset::new(&cfg, 3);
    let batch = data.batch(0, 1);
    let mut model = Mllm::<f64>::new_as(cfg.clone());
    model.set_batch(&batch);
    let (outs, mut stashes) = forward_all(&mut model, 0);
    let mut grad: Option<Vec<f64>> = None;
    let mut input_grads = vec![Vec::new(); model.units()];
    for u in (1..model.units()).rev() {
        let g = model.backward_input_unit(u, 0, &mut stashes[u], grad.as_deref());
        assert_eq!(g.len(), 1, "one gradient per input unit");
        assert_eq!(g[0].len(), outs[u - 1].len());
        input_grads[u] = g[0].clone();
        grad = Some(g[0].clone());
    }
    // The encoder has no input units: its backward_input returns nothing.
    assert!(model
        .backward_input_unit(0, 0, &mut stashes[0], grad.as_deref())
        .is_empty());

    let mut rng = Rng::new(9);
    for u in 1..model.units() {
        let g = &input_grads[u];
        let mut x = outs[u - 1].clone();
        let mut pairs = Vec::new();
        for i in pick(g, 16, 48, &mut rng) {
            let n = central(&mut x, i, |xi| {
                forward_from(&mut model, 0, u, Some(xi.to_vec()))
            });
            pairs.push((i, g[i], n));
        }
        compare(
            &format!("gradient of {}'s input", cfg.unit_names()[u]),
            &pairs,
            max_abs(g),
        );
    }
}

/// The `f32` model computes the same gradients as the checked `f64` one (up to
/// `f32` rounding): same initial parameters, same data.
#[test]
fn f32_gradients_match_f64() {
    for stages in [1, 2, 3] {
        let cfg = Config {
            stages,
            ..Config::tiny()
        };
        let batch = Dataset::new(&cfg, 4).batch(0, 2);
        let (l32, g32) = Mllm::new(cfg.clone()).reference_step(&batch);
        let (l64, g64) = Mllm::<f64>::new_as(cfg.clone()).reference_step(&batch);
        assert!((l32 as f64 - l64).abs() < 1e-5 * l64, "loss {l32} vs {l64}");
        for (u, (a, b)) in g32.iter().zip(&g64).enumerate() {
            let a: Vec<f64> = a.iter().map(|&x| x as f64).collect();
            let d = rel_diff(&a, b);
            eprintln!(
                "{stages} stages, {}: f32 vs f64 gradient rel diff {d:.1e}",
                cfg.unit_names()[u]
            );
            assert!(d < 1e-4, "unit {u}: {d:e}");
        }
    }
}
