// Wrong expressions (a misspelt encoder, a misspelt schedule) in a driver whose code
// is sized by the module: the fallback module keeps the units of what the writer
// most likely meant (`transpose(vision, interleaved(v = 2))`, `zbv`), so the only
// errors are the two misspellings, with nothing cascading from them.
mpipe::schedule! {
    pub mod plan {
        model_toml = r#"
        [[encoder]]
        name = "vision"
        layers = 2
        forward = 1.0
        backward = 0.5
        weight = 0.25
        activation = 0.5
        trainable = true

        [llm]
        layers = 8
        forward = 1.0
        backward = 1.0
        weight = 1.0
        activation = 1.0
    "#;
        ranks = 4;
        microbatches = 8;
        schedule = transpose(visoin, interleaved(v = 2));
    }
}

mpipe::schedule! {
    pub mod other {
        model_toml = r#"
        [[encoder]]
        name = "vision"
        layers = 2
        forward = 1.0
        backward = 0.5
        weight = 0.25
        activation = 0.5
        trainable = true

        [llm]
        layers = 8
        forward = 1.0
        backward = 1.0
        weight = 1.0
        activation = 1.0
    "#;
        ranks = 2;
        microbatches = 8;
        schedule = zvb;
    }
}

// 9 units (vision, llm.0 .. llm.7: two chunks on each of 4 ranks) and 5 (vision,
// llm.0 .. llm.3: the V's two chunks on each of 2 ranks).
const WEIGHTS: [f32; plan::UNITS.len()] = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5];
const OTHER: [u8; other::UNITS.len()] = [1, 2, 3, 4, 5];

fn main() {
    assert_eq!(plan::units::LLM_7, plan::UNITS.len() as u32 - 1);
    assert_eq!(other::units::LLM_3, other::UNITS.len() as u32 - 1);
    let _ = (WEIGHTS, OTHER, plan::units::VISION, other::units::VISION);
}
