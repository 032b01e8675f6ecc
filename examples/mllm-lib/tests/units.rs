//! The model's units agree with mpipe-core's: names, inputs, order, and the LLM
//! layers each stage owns.

use mpipe_core::plan::Layout;
use mpipe_core::profile::Profile;
use mpipe_core::units::build_units;
use mpipe_mllm::{Config, Mllm};

fn profile(layers: usize) -> Profile {
    // forward = 1 per layer and no extras: a stage's F cost is its layer count.
    Profile::from_toml_str(&format!(
        r#"
[[encoder]]
name = "vision"
layers = 2
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
trainable = true

[llm]
layers = {layers}
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#
    ))
    .expect("valid profile")
}

#[test]
fn units_match_mpipe_core() {
    for layers in 1..=9 {
        for stages in 1..=layers {
            let cfg = Config {
                layers,
                stages,
                ..Config::tiny()
            };
            let units = build_units(&profile(layers), stages, 1, Layout::Looped).unwrap();
            let names: Vec<String> = units.iter().map(|u| u.name.clone()).collect();
            assert_eq!(names, cfg.unit_names());
            for (u, inputs) in cfg.unit_inputs().iter().enumerate() {
                let want: Vec<String> = inputs.iter().map(|&i| names[i].clone()).collect();
                assert_eq!(units[u].inputs, want, "inputs of {}", names[u]);
            }
            let per_stage: Vec<usize> = units[1..].iter().map(|u| u.cost.f as usize).collect();
            assert_eq!(
                cfg.stage_layers(),
                per_stage,
                "{layers} layers over {stages} stages"
            );

            // The model's stages own exactly those layers, numbered in order.
            let model = Mllm::new(cfg.clone());
            let mut next = 0;
            for (k, &n) in per_stage.iter().enumerate() {
                let blocks: Vec<String> = model
                    .tensors(k + 1)
                    .iter()
                    .filter_map(|(name, _)| name.strip_suffix(".ln1.g").map(str::to_string))
                    .collect();
                let want: Vec<String> = (next..next + n).map(|i| format!("block{i}")).collect();
                assert_eq!(blocks, want, "llm.{k}");
                next += n;
                let has = |t: &str| model.tensors(k + 1).iter().any(|(name, _)| name == t);
                assert_eq!(
                    has("tok"),
                    k == 0,
                    "llm.{k}: embedding only on the first stage"
                );
                assert_eq!(
                    has("head.w"),
                    k + 1 == stages,
                    "llm.{k}: head only on the last"
                );
            }
        }
    }
}

#[test]
fn default_config_sizes() {
    let cfg = Config::default();
    assert_eq!(cfg.unit_names(), ["vision", "llm.0", "llm.1"]);
    assert_eq!(
        (
            cfg.patches(),
            cfg.patch_dim(),
            cfg.caption_len(),
            cfg.seq_len()
        ),
        (16, 12, 6, 22)
    );
    assert_eq!(cfg.vocab(), 10);
    assert_eq!(cfg.stage_layers(), [2, 2]);
    let model = Mllm::new(cfg);
    assert_eq!(model.param_count(), 46186);
}
