//! The synthetic image-caption task.
//!
//! An image is a `grid x grid` array of patches, each patch 2x2 RGB pixels (12
//! values, pixel-major then channel). The grid is cut into `objects` horizontal
//! bands; each band holds one object at a random patch: a shape (a 2x2 pixel mask)
//! painted in a colour. Every pixel gets Gaussian noise. The caption is
//! `BOS colour shape .. EOS`, one `(colour, shape)` per band, top band first: the
//! model can only predict it by looking at the image.

use crate::config::Config;
use crate::rng::Rng;

/// Values per patch: 2x2 pixels x RGB.
pub const PATCH_DIM: usize = 12;
/// Number of colours, and of shapes.
pub const COLOURS: usize = 4;
pub const SHAPES: usize = 4;
/// BOS and EOS.
pub const SPECIAL_TOKENS: usize = 2;
pub const BOS: u32 = 0;
pub const EOS: u32 = 1;

const COLOUR_NAMES: [&str; COLOURS] = ["red", "green", "blue", "yellow"];
const COLOUR_RGB: [[f32; 3]; COLOURS] = [
    [1.0, 0.0, 0.0],
    [0.0, 1.0, 0.0],
    [0.0, 0.0, 1.0],
    [1.0, 1.0, 0.0],
];
const SHAPE_NAMES: [&str; SHAPES] = ["bar", "pole", "slash", "square"];
/// Masks over the pixels top-left, top-right, bottom-left, bottom-right.
const SHAPE_MASK: [[f32; 4]; SHAPES] = [
    [1.0, 1.0, 0.0, 0.0],
    [1.0, 0.0, 1.0, 0.0],
    [0.0, 1.0, 1.0, 0.0],
    [1.0, 1.0, 1.0, 1.0],
];

/// Token of colour `c`.
pub fn colour_token(c: usize) -> u32 {
    (SPECIAL_TOKENS + c) as u32
}
/// Token of shape `s`.
pub fn shape_token(s: usize) -> u32 {
    (SPECIAL_TOKENS + COLOURS + s) as u32
}

/// One micro-batch: `size` images and their captions.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Examples in the micro-batch.
    pub size: usize,
    /// `size x patches x PATCH_DIM` values.
    pub images: Vec<f32>,
    /// `size x caption_len` tokens.
    pub tokens: Vec<u32>,
}

/// The synthetic task, deterministic from a seed.
#[derive(Clone, Debug)]
pub struct Dataset {
    grid: usize,
    objects: usize,
    noise: f32,
    size: usize,
    seed: u64,
}

impl Dataset {
    /// The task of `cfg`'s image and caption sizes, micro-batches of
    /// `cfg.microbatch_size` examples.
    pub fn new(cfg: &Config, seed: u64) -> Dataset {
        cfg.validate();
        Dataset {
            grid: cfg.grid,
            objects: cfg.objects,
            noise: cfg.noise,
            size: cfg.microbatch_size,
            seed,
        }
    }

    /// The micro-batches of training step `step`: a pure function of the seed,
    /// `step` and the micro-batch index.
    pub fn batch(&self, step: u64, microbatches: usize) -> Vec<Sample> {
        (0..microbatches).map(|mb| self.sample(step, mb)).collect()
    }

    /// Micro-batch `mb` of step `step`.
    pub fn sample(&self, step: u64, mb: usize) -> Sample {
        let mut rng = Rng::derive(self.seed, &[step, mb as u64]);
        let p = self.grid * self.grid;
        let t = 2 + 2 * self.objects;
        let mut images = Vec::with_capacity(self.size * p * PATCH_DIM);
        let mut tokens = Vec::with_capacity(self.size * t);
        for _ in 0..self.size {
            let mut img: Vec<f32> = (0..p * PATCH_DIM)
                .map(|_| self.noise * rng.normal())
                .collect();
            tokens.push(BOS);
            for k in 0..self.objects {
                let (r0, r1) = (
                    k * self.grid / self.objects,
                    (k + 1) * self.grid / self.objects,
                );
                let row = r0 + rng.below(r1 - r0);
                let col = rng.below(self.grid);
                let (c, s) = (rng.below(COLOURS), rng.below(SHAPES));
                let patch = &mut img[(row * self.grid + col) * PATCH_DIM..][..PATCH_DIM];
                for (px, m) in SHAPE_MASK[s].iter().enumerate() {
                    for (ch, v) in COLOUR_RGB[c].iter().enumerate() {
                        patch[px * 3 + ch] += m * v;
                    }
                }
                tokens.push(colour_token(c));
                tokens.push(shape_token(s));
            }
            tokens.push(EOS);
            images.extend(img);
        }
        Sample {
            size: self.size,
            images,
            tokens,
        }
    }

    /// A caption in words.
    pub fn describe(tokens: &[u32]) -> String {
        tokens
            .iter()
            .map(|&t| match t as usize {
                0 => "<bos>",
                1 => "<eos>",
                x if x < SPECIAL_TOKENS + COLOURS => COLOUR_NAMES[x - SPECIAL_TOKENS],
                x => SHAPE_NAMES
                    .get(x - SPECIAL_TOKENS - COLOURS)
                    .copied()
                    .unwrap_or("?"),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}
