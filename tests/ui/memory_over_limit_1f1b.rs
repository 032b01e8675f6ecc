// `1f1b` over the memory limit: one error for all the ranks over it, and advice that
// does not suggest the schedule already written.
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
            limit = 2.5
        "#;
        ranks = 4;
        microbatches = 16;
        schedule = 1f1b;
    }
}

fn main() {}
