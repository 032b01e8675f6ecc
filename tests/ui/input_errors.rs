// Every problem with the input is reported at once.
mpipe::schedule! {
    mod plan {
        modle = "profiles/encoder-heavy.toml";
        ranks = 0;
        microbatches = eight;
        schedule = 1f1b(v = );
        mode = async;
    }
}

fn main() {}
