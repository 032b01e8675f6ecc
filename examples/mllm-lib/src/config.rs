//! Model and task sizes.

use crate::data::{COLOURS, PATCH_DIM, SHAPES, SPECIAL_TOKENS};

/// Sizes of the model and of the synthetic task. [`Config::default`] is small enough
/// for a training step on 4 micro-batches to take about a millisecond in release.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Images are `grid x grid` patches of 2x2 RGB pixels ([`PATCH_DIM`] values each).
    pub grid: usize,
    /// Objects per image, one per horizontal band of the grid (at most `grid`); the
    /// caption names each object's colour and shape, top band first.
    pub objects: usize,
    /// Standard deviation of the Gaussian pixel noise.
    pub noise: f32,
    /// Vision encoder width, depth, heads and MLP width.
    pub vision_dim: usize,
    pub vision_layers: usize,
    pub vision_heads: usize,
    pub vision_mlp: usize,
    /// LLM width, depth (split over `stages`), heads and MLP width.
    pub dim: usize,
    pub layers: usize,
    pub heads: usize,
    pub mlp: usize,
    /// Number of LLM pipeline stages (units `llm.0 .. llm.{stages-1}`).
    pub stages: usize,
    /// Examples per micro-batch ([`crate::Sample`]).
    pub microbatch_size: usize,
    /// Whether the vision encoder is trained (when not, the runtime never runs its
    /// backward and the optimizer skips it).
    pub trainable_encoder: bool,
    /// Seed of the parameter initialisation.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            grid: 4,
            objects: 2,
            noise: 0.1,
            vision_dim: 32,
            vision_layers: 1,
            vision_heads: 2,
            vision_mlp: 64,
            dim: 32,
            layers: 4,
            heads: 2,
            mlp: 64,
            stages: 2,
            microbatch_size: 4,
            trainable_encoder: true,
            seed: 0,
        }
    }
}

impl Config {
    /// A very small model for gradient checks: 3 LLM layers (so 2 or 3 stages
    /// give stages of different depths), 2 vision layers.
    pub fn tiny() -> Config {
        Config {
            grid: 2,
            objects: 1,
            noise: 0.1,
            vision_dim: 8,
            vision_layers: 2,
            vision_heads: 2,
            vision_mlp: 12,
            dim: 8,
            layers: 3,
            heads: 2,
            mlp: 12,
            stages: 2,
            microbatch_size: 2,
            trainable_encoder: true,
            seed: 1,
        }
    }

    /// Patches per image.
    pub fn patches(&self) -> usize {
        self.grid * self.grid
    }
    /// Values per patch.
    pub fn patch_dim(&self) -> usize {
        PATCH_DIM
    }
    /// Vocabulary size: BOS, EOS, the colours and the shapes.
    pub fn vocab(&self) -> usize {
        SPECIAL_TOKENS + COLOURS + SHAPES
    }
    /// Caption tokens per example: BOS, (colour, shape) per object, EOS.
    pub fn caption_len(&self) -> usize {
        2 + 2 * self.objects
    }
    /// LLM sequence length: the image tokens, then the caption.
    pub fn seq_len(&self) -> usize {
        self.patches() + self.caption_len()
    }
    /// Number of units: the encoder and the LLM stages.
    pub fn units(&self) -> usize {
        1 + self.stages
    }

    /// LLM layers per stage, by mpipe-core's rule: `layers / stages` each, the
    /// remainder one each to stages `1, 2, ..`.
    ///
    /// # Panics
    /// If a stage would get no layer.
    pub fn stage_layers(&self) -> Vec<usize> {
        let (l, s) = (self.layers, self.stages);
        assert!(s >= 1 && l >= s, "{l} LLM layers cannot fill {s} stages");
        (0..s)
            .map(|k| l / s + usize::from(k >= 1 && k <= l % s))
            .collect()
    }

    /// Unit names in `UnitId` order: `vision`, `llm.0`, ..
    pub fn unit_names(&self) -> Vec<String> {
        std::iter::once("vision".to_string())
            .chain((0..self.stages).map(|k| format!("llm.{k}")))
            .collect()
    }

    /// Each unit's input units, in the order `forward` receives them.
    pub fn unit_inputs(&self) -> Vec<Vec<usize>> {
        (0..self.units())
            .map(|u| if u == 0 { vec![] } else { vec![u - 1] })
            .collect()
    }

    pub(crate) fn validate(&self) {
        assert!(self.grid >= 1 && self.objects >= 1 && self.objects <= self.grid);
        assert!(self.microbatch_size >= 1);
        assert!(self.vision_layers >= 1, "the vision encoder needs a block");
        let _ = self.stage_layers();
    }
}
