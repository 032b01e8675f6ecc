//! Compile-fail tests of `schedule!`: each error class is a compile error with a span
//! on the token at fault, all errors are reported, and the fallback module keeps the
//! rest of the crate compiling (no secondary errors). Refresh the expected output
//! with `TRYBUILD=overwrite cargo test --test ui`, then read the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
