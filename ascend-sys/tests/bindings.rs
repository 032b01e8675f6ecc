//! `src/bindings.rs` is generated from `include/mpipe_ascend.h` and committed; this test
//! regenerates it and fails when the committed file is stale.
//!
//! Regenerate with `ASCEND_SYS_BLESS=1 cargo test -p ascend-sys --test bindings`.
//! bindgen needs libclang (`apt-get install -y libclang-dev`); without it the test prints
//! a skip reason to stderr (visible without `--nocapture`) and passes, except under CI
//! (`CI` set: GitHub Actions sets it, and `.ci/run` exports it), where it fails.

use std::path::Path;

include!("../bindgen_config.rs");

#[test]
fn committed_bindings_are_fresh() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let header = dir.join("include/mpipe_ascend.h");
    let committed_path = dir.join("src/bindings.rs");
    let generated = std::panic::catch_unwind(|| {
        ascend_bindgen_builder(header.to_str().expect("UTF-8 path")).generate()
    });
    let generated = match generated {
        Ok(Ok(b)) => b.to_string(),
        Ok(Err(e)) => panic!("bindgen failed on {}: {e}", header.display()),
        Err(_) if std::env::var_os("CI").is_none() => {
            // Straight to the process's stderr, not `eprintln!`: the test harness
            // captures the latter for a passing test, and the skip would be silent.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "committed_bindings_are_fresh SKIPPED: bindgen could not load libclang \
                 (apt-get install -y libclang-dev); the freshness of src/bindings.rs was not \
                 checked. Under CI (`CI` set, as .ci/run sets it) this fails instead."
            );
            return;
        }
        Err(_) => panic!(
            "bindgen could not load libclang, and `CI` is set: install libclang-dev \
             (.ci/run does) or unset CI to skip this check locally"
        ),
    };
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    if committed == generated {
        return;
    }
    if std::env::var_os("ASCEND_SYS_BLESS").is_some() {
        std::fs::write(&committed_path, &generated).expect("write src/bindings.rs");
        eprintln!("wrote {}", committed_path.display());
        return;
    }
    let first = committed
        .lines()
        .zip(generated.lines())
        .position(|(a, b)| a != b);
    panic!(
        "src/bindings.rs is stale (first difference at line {}); regenerate it with\n    \
         ASCEND_SYS_BLESS=1 cargo test -p ascend-sys --test bindings\nand commit the result",
        first.map_or_else(|| "end".to_string(), |i| (i + 1).to_string())
    );
}
