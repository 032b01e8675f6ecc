mpipe::schedule! {
    mod plan {
        model_toml = r#"
            [llm]
            layers = 8
            fowrard = 1.0
            backward = -1.0
            weight = 1.0
            activation = 1.0
        "#;
        ranks = 4;
        microbatches = 8;
        schedule = 1f1b;
    }
}

fn main() {}
