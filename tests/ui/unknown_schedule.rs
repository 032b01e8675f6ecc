mpipe::schedule! {
    pub mod plan {
        model_toml = r#"
        [[encoder]]
        name = "vision"
        layers = 4
        forward = 1.0
        backward = 1.0
        weight = 0.5
        activation = 0.1
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
        schedule = onef1b;
    }
}

fn main() {
    // The fallback module keeps this compiling: only the error above is reported.
    let _ = plan::RANKS + plan::MICROBATCHES;
}
