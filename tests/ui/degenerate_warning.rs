// A valid but degenerate schedule compiles with a warning (not an error): with 2
// micro-batches on 4 ranks, `transpose` leaves ranks 2-3 without encoder work.
mpipe::schedule! {
    mod plan {
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
        microbatches = 2;
        schedule = transpose(vision, 1f1b);
    }
}

fn main() {
    let _ = plan::RANKS;
    // trybuild records a case's output only when it fails to compile: this ends it.
    compile_error!("end of the case");
}
