// `auto` finds no schedule under the memory limit: the error of the fastest-looking
// candidate points at `auto` (its derivations ran on worker threads, the span is
// the macro's own).
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
            limit = 1.0
        "#;
        ranks = 4;
        microbatches = 16;
        schedule = auto;
    }
}

fn main() {}
