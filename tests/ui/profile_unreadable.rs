mpipe::schedule! {
    mod plan {
        model = "profiles/no-such-model.toml";
        ranks = 4;
        microbatches = 8;
        schedule = 1f1b;
    }
}

fn main() {}
