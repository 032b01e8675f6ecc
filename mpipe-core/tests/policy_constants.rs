//! Every tuning constant of the search, the derivation, the lowering and the
//! generators lives in `SearchPolicy` (`src/ir/policy.rs`): this test reads the sources
//! of those passes and fails on a numeric literal that is neither structural (the
//! short list below, each with its reason) nor allowed for one file with a reason.
//! A new budget, percentage or threshold belongs in `SearchPolicy`, documented with
//! what it trades.

use mpipe_core::policy::SearchPolicy;

/// The passes whose tuning `SearchPolicy` holds (their non-test code is scanned).
const SCANNED: [&str; 15] = [
    "src/algebra/generators/zblist.rs",
    "src/search/auto.rs",
    "src/search/derive.rs",
    "src/search/finish.rs",
    "src/search/periodic.rs",
    "src/search/place.rs",
    "src/search/reorder.rs",
    "src/search/refine.rs",
    "src/algebra/eval.rs",
    "src/algebra/lower.rs",
    "src/algebra/generators/chain.rs",
    "src/algebra/generators/zb2p.rs",
    "src/algebra/generators/stage_set.rs",
    "src/algebra/generators/weave.rs",
    "src/algebra/ramp.rs",
];

/// Literals allowed anywhere, and why.
const STRUCTURAL: [(&str, &str); 6] = [
    ("0", "empty, none, the first index"),
    ("1", "one, the next index, the unit of a ratio"),
    (
        "2",
        "halves and pairs (the middle of a wait, two ends of a transfer)",
    ),
    ("0.0", "no time, no cost"),
    ("1.0", "the unit of a ratio or a cost"),
    ("2.0", "halves (the middle of a wait)"),
];

/// Literals allowed in one file, and why.
const ALLOWED: [(&str, &str, &str); 7] = [
    (
        "src/algebra/generators/zblist.rs",
        "3",
        "three tasks (F, B, W) per micro-batch and stage",
    ),
    (
        "src/search/auto.rs",
        "4",
        "LISTED_V: the most chunks an `interleaved` body of FUSED names",
    ),
    (
        "src/search/auto.rs",
        "100.0",
        "PERCENT: a factor shown as a percentage",
    ),
    (
        "src/search/auto.rs",
        "3",
        "`interleaved(v = 3)`: a body of FUSED, named as the user writes it",
    ),
    (
        "src/algebra/eval.rs",
        "100_000",
        "MAX_ORDER: the range of the user's `order = N` (refine's signature)",
    ),
    (
        "src/algebra/ramp.rs",
        "1e-9",
        "keeps a division away from zero",
    ),
    (
        "src/algebra/generators/zb2p.rs",
        "3",
        "three tasks (F, B, W) per micro-batch and stage",
    ),
];

/// `src` without comments, string and character literals, and its test module.
fn code_of(src: &str) -> String {
    let src = match src.find("#[cfg(test)]\nmod tests") {
        Some(at) => &src[..at],
        None => src,
    };
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A character literal (not a lifetime): skip to its closing quote.
            i += if b[i + 1] == b'\\' { 3 } else { 2 };
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Every numeric literal of `code` with its line, skipping array lengths
/// (`[T; N]`).
fn literals(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let starts = b[i].is_ascii_digit()
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
                // not a tuple field (`x.3`); a range's end (`..3`) is a literal
                && !(i > 0 && b[i - 1] == b'.' && (i < 2 || b[i - 2] != b'.'));
            if !starts {
                i += 1;
                continue;
            }
            let from = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'_') {
                i += 1;
            }
            // A fraction (not a range `..` or a method call `.min`).
            if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
                i += 1;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
            }
            if i < b.len() && b[i] == b'e' {
                let mut k = i + 1;
                if k < b.len() && b[k] == b'-' {
                    k += 1;
                }
                if k < b.len() && b[k].is_ascii_digit() {
                    i = k;
                    while i < b.len() && b[i].is_ascii_digit() {
                        i += 1;
                    }
                }
            }
            let lit = &line[from..i];
            // A type suffix (`0.0f64`, `1usize`) is part of the literal, not another.
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            let array_len = line[..from].trim_end().ends_with(';') && line[i..].starts_with(']');
            if !array_len {
                out.push((n + 1, lit.to_string()));
            }
        }
    }
    out
}

#[test]
fn no_tuning_constant_outside_the_search_policy() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for file in SCANNED {
        let src =
            std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        for (line, lit) in literals(&code_of(&src)) {
            let structural = STRUCTURAL.iter().any(|(s, _)| *s == lit);
            let allowed = ALLOWED.iter().any(|(f, s, _)| *f == file && *s == lit);
            if !structural && !allowed {
                found.push(format!("{file}:{line}: {lit}"));
            }
        }
    }
    assert!(
        found.is_empty(),
        "numeric literals outside mpipe-core/src/ir/policy.rs: make each a documented field of \
         SearchPolicy (or, if it is structural, allow it in this test with a reason):\n{}",
        found.join("\n")
    );
}

/// The scanner sees a constant where one would be added, and not in comments,
/// strings or array lengths.
#[test]
fn the_scanner_finds_a_new_constant() {
    let code = code_of(
        "const X: usize = 300; // 17 in a comment\nlet s = \"42\"; let a: [u8; 9] = f(0.5, 1e-3, 3..=7, x.4, ..6, 2);\n#[cfg(test)]\nmod tests { const Y: usize = 5; }",
    );
    let lits: Vec<String> = literals(&code).into_iter().map(|(_, l)| l).collect();
    assert_eq!(lits, ["300", "0.5", "1e-3", "3", "7", "6", "2"]);
}

/// The defaults are today's values (the byte-identity test pins their programs),
/// and a caller can change one on the request.
#[test]
fn the_policy_is_carried_by_the_request() {
    assert_eq!(SearchPolicy::default(), SearchPolicy::DEFAULT);
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../profiles/qwen2vl-7b.toml"),
    )
    .unwrap();
    let profile = mpipe_core::profile::Profile::from_toml_str(&text).unwrap();
    let req = mpipe_core::derive::Request::new(&profile, 4, 8);
    assert_eq!(req.policy, SearchPolicy::DEFAULT);
    // No refinement budget: `refine` then keeps the plain lowering's transfers.
    let none = mpipe_core::derive::Request {
        policy: SearchPolicy {
            refine_budget: 0,
            w_budget: 0,
            ..SearchPolicy::DEFAULT
        },
        ..req
    };
    let expr = "refine(1f1b)";
    let tuned = mpipe_core::derive::derive_str(&req, expr).unwrap();
    let plain = mpipe_core::derive::derive_str(&none, expr).unwrap();
    assert!(tuned.report.makespan <= plain.report.makespan);
}
