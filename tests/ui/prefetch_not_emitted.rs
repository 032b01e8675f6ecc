// `prefetch` derives and simulates, but generated code cannot run a forward for the
// next step yet: the macro says so. `auto` inside the macro never picks it (on the
// second profile, `mpipe compare ... auto` picks `prefetch(vision, zbh1)`).
mpipe::schedule! {
    mod plan {
        model_toml = r#"
            [[encoder]]
            name = "vision"
            layers = 8
            forward = 1.0
            backward = 1.0
            activation = 0.1
            trainable = false

            [llm]
            layers = 8
            forward = 1.0
            backward = 1.0
            weight = 1.0
            activation = 1.0
        "#;
        ranks = 4;
        microbatches = 8;
        schedule = prefetch(vision, 1f1b);
    }
}

mpipe::schedule! {
    mod chosen {
        model_toml = r#"
            [[encoder]]
            name = "vision"
            layers = 8
            forward = 1.0
            backward = 1.0
            activation = 0.1
            trainable = false

            [llm]
            layers = 8
            forward = 1.0
            backward = 1.0
            weight = 1.0
            activation = 1.0
        "#;
        ranks = 4;
        microbatches = 16;
        schedule = auto;
    }
}

fn main() {
    // Compiles: `auto` chose a schedule the macro can emit.
    let _ = chosen::EXPR;
}
