//! The split backward (`backward_input` then `backward_weight`) against the fused
//! one, and hand-run pipelines (one model copy per rank, activations and gradients
//! passed between them) against the reference step.

mod common;

use common::{forward_all, rel_diff};
use mpipe_mllm::{Config, Dataset, Mllm, Sample, Stash};
use mpipe_runtime::model::{Model, Tensor};

/// For every unit: `backward_input` + `backward_weight` give the same input
/// gradients and weight gradients as the fused `backward`, including when the
/// weight gradients of several micro-batches are deferred and run in another order.
#[test]
fn split_backward_equals_fused() {
    for stages in [1, 2, 3] {
        let cfg = Config {
            stages,
            ..Config::tiny()
        };
        let mbs = 3;
        let batch = Dataset::new(&cfg, 21).batch(0, mbs);
        let mut fused = Mllm::new(cfg.clone());
        let mut split = fused.clone();
        fused.set_batch(&batch);
        split.set_batch(&batch);
        let n = fused.units();
        let mut deferred: Vec<(usize, usize, Stash)> = Vec::new();
        for mb in 0..mbs {
            let (out_f, mut st_f) = forward_all(&mut fused, mb);
            let (out_s, mut st_s) = forward_all(&mut split, mb);
            assert_eq!(out_f, out_s, "forward is deterministic");
            assert_eq!(fused.loss(mb), split.loss(mb));
            assert_eq!(
                out_f[n - 1],
                vec![fused.loss(mb).unwrap()],
                "the last unit outputs the loss"
            );
            let (mut g_f, mut g_s): (Option<Tensor>, Option<Tensor>) = (None, None);
            for u in (0..n).rev() {
                let a = fused.backward(u, mb, &mut st_f[u], g_f.as_deref());
                let b = split.backward_input(u as u32, mb, &mut st_s[u], g_s.as_ref());
                assert_eq!(a.len(), b.len());
                for (x, y) in a.iter().zip(&b) {
                    assert!(
                        rel_diff(x, y) < 1e-6,
                        "{stages} stages, unit {u}: input gradient"
                    );
                }
                g_f = a.into_iter().next();
                g_s = b.into_iter().next();
            }
            // Weight gradients later: keep the stashes.
            for (u, st) in st_s.into_iter().enumerate() {
                deferred.push((u, mb, st));
            }
        }
        // Nothing has been added by backward_input alone.
        assert!(split
            .all_grads()
            .iter()
            .all(|g| g.iter().all(|&x| x == 0.0)));
        // W in an order unlike B's: interleave units and micro-batches backwards.
        deferred.sort_by_key(|&(u, mb, _)| (mb % 2, u, std::cmp::Reverse(mb)));
        for (u, mb, st) in deferred {
            split.backward_weight(u as u32, mb, st);
        }
        for u in 0..n {
            let d = rel_diff(fused.grads(u as u32), split.grads(u as u32));
            assert!(
                d < 1e-6,
                "{stages} stages, unit {u}: weight gradients differ by {d:e}"
            );
        }
    }
}

/// One model copy per rank; unit `u` lives on `home[u]`. Runs a zero-bubble-like
/// order by hand: forwards stage by stage (each micro-batch's activation "sent" to
/// the next unit's rank), input-gradient backwards in reverse (gradients sent
/// back), weight-gradient backwards all deferred to the end and run in an order
/// unlike the B order and the reference's. Returns the mean loss and each unit's gradients from its
/// home rank.
fn pipelined(cfg: &Config, home: &[usize], batch: &[Sample]) -> (f32, Vec<Vec<f32>>) {
    let ranks = home.iter().max().unwrap() + 1;
    let proto = Mllm::new(cfg.clone());
    let mut rank: Vec<Mllm> = (0..ranks).map(|_| proto.clone()).collect();
    for r in &mut rank {
        r.set_batch(batch);
        r.zero_grads();
    }
    let (n, mbs) = (proto.units(), batch.len());
    // acts[u][mb]: the output of unit u for mb, as received by its consumer.
    let mut acts: Vec<Vec<Option<Tensor>>> = vec![vec![None; mbs]; n];
    let mut stashes: Vec<Vec<Option<Stash>>> =
        (0..n).map(|_| (0..mbs).map(|_| None).collect()).collect();
    // Forward, unit-major with micro-batches interleaved the 1F1B way round:
    // (unit u, mb) runs once (u-1, mb) has.
    for step in 0..n + mbs - 1 {
        for u in 0..n {
            let Some(mb) = step.checked_sub(u).filter(|&m| m < mbs) else {
                continue;
            };
            let input: Vec<&Tensor> = if u == 0 {
                vec![]
            } else {
                vec![acts[u - 1][mb].as_ref().unwrap()]
            };
            let (out, st) = rank[home[u]].forward(u as u32, mb, &input);
            acts[u][mb] = Some(out.clone());
            stashes[u][mb] = Some(st);
        }
    }
    let last = home[n - 1];
    let loss = (0..mbs)
        .map(|mb| rank[last].loss(mb).unwrap() as f64)
        .sum::<f64>()
        / mbs as f64;
    // Input-gradient backward, reverse unit order, micro-batches in reverse.
    let mut grads_in: Vec<Vec<Option<Tensor>>> = vec![vec![None; mbs]; n];
    for u in (0..n).rev() {
        if u == 0 && !cfg.trainable_encoder {
            break;
        }
        for mb in (0..mbs).rev() {
            let g_out = if u + 1 == n {
                None
            } else {
                grads_in[u + 1][mb].clone()
            };
            let st = stashes[u][mb].as_mut().unwrap();
            let g = rank[home[u]].backward_input(u as u32, mb, st, g_out.as_ref());
            assert_eq!(g.len(), usize::from(u > 0));
            grads_in[u][mb] = g.into_iter().next();
        }
    }
    // Weight-gradient backward: micro-batches last-to-first (the reference adds them
    // first-to-last), units first-to-last.
    for mb in (0..mbs).rev() {
        for u in 0..n {
            if u == 0 && !cfg.trainable_encoder {
                continue;
            }
            let st = stashes[u][mb].take().unwrap();
            rank[home[u]].backward_weight(u as u32, mb, st);
        }
    }
    // Only a unit's home rank touched its gradients.
    for (u, &h) in home.iter().enumerate() {
        for (r, m) in rank.iter().enumerate() {
            if r != h {
                assert!(m.grads(u as u32).iter().all(|&x| x == 0.0));
            }
        }
    }
    let grads = (0..n)
        .map(|u| rank[home[u]].grads(u as u32).to_vec())
        .collect();
    (loss as f32, grads)
}

fn compare_with_reference(cfg: Config, microbatches: usize) {
    let stages = cfg.stages;
    let batch = Dataset::new(&cfg, 8).batch(3, microbatches);
    // The encoder lives with llm.0; stage k on rank k.
    let home: Vec<usize> = std::iter::once(0).chain(0..stages).collect();
    let (loss_p, grads_p) = pipelined(&cfg, &home, &batch);
    let mut reference = Mllm::new(cfg.clone());
    let (loss_r, grads_r) = reference.reference_step(&batch);
    let dl = ((loss_p - loss_r) / loss_r).abs();
    assert!(dl < 1e-5, "loss: pipelined {loss_p} vs reference {loss_r}");
    for (u, (gp, gr)) in grads_p.iter().zip(&grads_r).enumerate() {
        let d = rel_diff(gp, gr);
        eprintln!(
            "{} stages, {}: rel diff {d:.1e}",
            stages,
            cfg.unit_names()[u]
        );
        assert!(
            d < 1e-5,
            "{stages} stages, unit {u}: gradients differ by {d:e}"
        );
        if u == 0 && !cfg.trainable_encoder {
            assert!(
                gr.iter().all(|&x| x == 0.0),
                "a frozen encoder gets no gradient"
            );
        } else {
            assert!(gr.iter().any(|&x| x != 0.0), "unit {u} has a gradient");
        }
    }
}

#[test]
fn pipelined_two_stages_matches_reference() {
    compare_with_reference(Config::default(), 4);
}

#[test]
fn pipelined_three_stages_matches_reference() {
    // 4 layers over 3 stages: 1, 2, 1.
    let cfg = Config {
        stages: 3,
        ..Config::default()
    };
    assert_eq!(cfg.stage_layers(), vec![1, 2, 1]);
    compare_with_reference(cfg, 5);
}

#[test]
fn pipelined_frozen_encoder_matches_reference() {
    compare_with_reference(
        Config {
            stages: 3,
            trainable_encoder: false,
            ..Config::default()
        },
        4,
    );
}

/// The reference step is repeatable and zeroes the previous step's gradients.
#[test]
fn reference_step_is_deterministic() {
    let cfg = Config::default();
    let data = Dataset::new(&cfg, 1);
    assert_eq!(data.batch(5, 4), Dataset::new(&cfg, 1).batch(5, 4));
    assert_ne!(data.batch(5, 4), data.batch(6, 4));
    let mut a = Mllm::new(cfg.clone());
    let b = a.reference_step(&data.batch(0, 4));
    let c = a.reference_step(&data.batch(0, 4));
    assert_eq!(b, c);
    let d = Mllm::new(cfg).reference_step(&data.batch(0, 4));
    assert_eq!(b, d);
}

/// With a frozen encoder, the optimizer leaves it alone and trains the rest.
#[test]
fn frozen_encoder_is_not_updated() {
    use mpipe_mllm::{Adam, AdamConfig};
    let cfg = Config {
        trainable_encoder: false,
        ..Config::tiny()
    };
    let data = Dataset::new(&cfg, 2);
    let mut model = Mllm::new(cfg);
    let before: Vec<Vec<f32>> = (0..model.units())
        .map(|u| model.unit_params(u).to_vec())
        .collect();
    let mut adam = Adam::new(AdamConfig::default());
    for step in 0..3 {
        model.reference_step(&data.batch(step, 2));
        adam.step(&mut model, 0.5);
    }
    assert_eq!(model.unit_params(0), &before[0][..]);
    for (u, b) in before.iter().enumerate().skip(1) {
        assert_ne!(model.unit_params(u), &b[..], "unit {u} trains");
    }
}
