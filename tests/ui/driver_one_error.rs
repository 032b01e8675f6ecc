// A schedule error in a driver whose code is sized by the module (`UNITS.len()` in
// array types, `N - 1`): the fallback module keeps the declared units, so the one
// error is the schedule's (too few micro-batches), with nothing cascading from it.
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
        ranks = 2;
        microbatches = 3;
        schedule = transpose(vision, dualpipev);
    }
}

const N: usize = plan::UNITS.len();
const LAST: usize = N - 1;
// `transpose(vision, dualpipev)` on 2 ranks has 5 units: vision, llm.0 .. llm.3.
const WEIGHTS: [f32; N] = [0.5, 1.5, -2.0, 0.25, 1.0];
const PEAKS: [f64; 2] = plan::PEAK_MEMORY;

fn main() {
    assert_eq!(plan::units::VISION, 0);
    assert_eq!(plan::units::LLM_3, LAST as u32);
    let _ = (WEIGHTS, PEAKS, plan::RANKS, plan::MICROBATCHES);
}
