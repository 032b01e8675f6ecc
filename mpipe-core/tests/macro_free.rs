//! The core knows nothing of procedural macros (ARCHITECTURE.md, "What each floor
//! must not know"): it depends on no crate of the macro world, and its source names
//! none. An expression's places are its own `Span`s (byte ranges), which
//! `mpipe-codegen` maps to the compiler's.

use std::path::Path;

const MACRO_CRATES: [&str; 4] = ["proc-macro2", "proc_macro", "syn", "quote"];

#[test]
fn the_manifest_depends_on_no_macro_crate() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .expect("mpipe-core/Cargo.toml");
    for line in manifest.lines() {
        let name = line.split(['=', '.', ' ']).next().unwrap_or("").trim();
        assert!(
            !MACRO_CRATES.contains(&name),
            "mpipe-core/Cargo.toml depends on `{name}`: the core must not know of \
             procedural macros; map spans in mpipe-codegen instead"
        );
    }
}

#[test]
fn the_source_names_no_macro_crate() {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).expect("readable source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("readable source");
                for (n, line) in text.lines().enumerate() {
                    if line.contains("proc_macro") || line.contains("syn::") {
                        found.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                    }
                }
            }
        }
    }
    let mut found = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
    );
    assert!(
        found.is_empty(),
        "mpipe-core's source names the macro world (map spans in mpipe-codegen):\n{}",
        found.join("\n")
    );
}
