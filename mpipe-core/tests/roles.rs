//! Passes ask a unit's role, never its name (ARCHITECTURE.md, "Every unit carries its
//! role"): outside `ir/role.rs`, which reads the naming convention once for files
//! that state no roles, no source of the core takes a unit name apart to learn what
//! the unit is. Exceptions, each with its reason, are listed below.

use std::path::Path;

/// Ways of taking a name apart to learn what the unit is.
const PATTERNS: [&str; 6] = [
    "starts_with(\"llm",
    "strip_prefix(\"llm",
    "split(['.', '/'])",
    "split(['/', '.'])",
    "split_once(['.', '/'])",
    "rsplit_once('/')",
];

/// Files allowed to, and why.
const ALLOWED: [(&str, &str); 3] = [
    (
        "ir/role.rs",
        "the naming convention, read once for files without roles",
    ),
    (
        "algebra/profile/check.rs",
        "a profile's encoder names must not collide with the LLM's unit names",
    ),
    (
        "interop/calibrate.rs",
        "a trace names its events, not units: the prices are read by event name",
    ),
];

#[test]
fn no_pass_reads_a_role_from_a_name() {
    fn walk(dir: &Path, root: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).expect("readable source folder") {
            let path = entry.expect("a folder entry").path();
            if path.is_dir() {
                walk(&path, root, found);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            if ALLOWED.iter().any(|(f, _)| *f == rel) || rel.ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable source");
            // The unit tests at the end of a file may build names as they like.
            let code = text.split("#[cfg(test)]").next().unwrap_or(&text);
            for (n, line) in code.lines().enumerate() {
                if PATTERNS.iter().any(|p| line.contains(p)) {
                    found.push(format!("src/{rel}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    walk(&root, &root, &mut found);
    assert!(
        found.is_empty(),
        "a unit's role read from its name; ask `unit.role` (ir/role.rs) instead:\n{}",
        found.join("\n")
    );
}
