mpipe::schedule! {
    mod plan {
        model_toml = r#"
            [llm]
            layers = 8
            forward = 1.0
            backward = 1.0
            weight = 1.0
            activation = 1.0

            [memory]
            limit = 10.0
        "#;
        ranks = 4;
        microbatches = 16;
        schedule = gpipe;
    }
}

fn main() {}
