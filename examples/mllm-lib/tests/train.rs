//! Training with the reference step and Adam: the loss falls far below its start,
//! and the model learns to read the images.

use std::time::Instant;

use mpipe_mllm::{Adam, AdamConfig, Config, Dataset, Mllm};

const STEPS: u64 = 300;
const MICROBATCHES: usize = 4;

fn mean(v: &[f32]) -> f32 {
    v.iter().sum::<f32>() / v.len() as f32
}

fn train(cfg: Config, adam: AdamConfig) -> (f32, f32, f32, f32) {
    let data = Dataset::new(&cfg, 42);
    let mut model = Mllm::new(cfg);
    let mut opt = Adam::new(adam);
    let start = Instant::now();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (loss, _) = model.reference_step(&data.batch(step, MICROBATCHES));
        opt.step(&mut model, 1.0 / MICROBATCHES as f32);
        losses.push(loss);
        if step % 25 == 0 || step + 1 == STEPS {
            eprintln!("step {step:4}: loss {loss:.4}");
        }
    }
    let secs = start.elapsed().as_secs_f32();
    // Held-out micro-batches (steps never trained on).
    let held: Vec<_> = (0..8).flat_map(|i| data.batch(1_000_000 + i, 1)).collect();
    let eval = model.eval_loss(&held);
    let acc = mean(
        &(0..held.len())
            .map(|mb| model.accuracy(mb).unwrap())
            .collect::<Vec<_>>(),
    );
    let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
    eprintln!(
        "{STEPS} steps in {secs:.2} s ({:.2} ms/step): loss {first:.3} (first 10) -> {last:.3} (last 10); \
         held-out loss {eval:.3}, next-token accuracy {:.1}%",
        1e3 * secs / STEPS as f32,
        100.0 * acc
    );
    (first, last, eval, acc)
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "slow in debug; run with --release (or --include-ignored)"
)]
fn training_lowers_the_loss() {
    let (first, last, eval, _) = train(Config::default(), AdamConfig::default());
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(eval < 0.5 * first, "held-out loss {eval}");
}
