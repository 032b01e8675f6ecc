//! Issue 37: fuzzing the six readers (profiles in TOML and JSON, schedule
//! expressions, program files, torch CSVs, traces, the command line's numbers) with
//! deterministic inputs: seeded mutations of valid inputs and generated structure
//! (huge and non-finite numbers, deep nesting, very long names, many unknown keys and
//! tables, truncation, invalid UTF-8 where a file is read as bytes).
//!
//! Every case asserts:
//! - no panic (`catch_unwind` around the library calls; the binary must exit with a
//!   status, not a signal or a panic message);
//! - no internal error: no message says "internal error", "a bug in mpipe" or
//!   "please report" (the wording of mpipe's own bugs, see `lower.rs`, `replan.rs`,
//!   `finish.rs`); bad input is the user's error, said as such;
//! - a wall-clock bound ([`HANG_GUARD`]): a guard against hangs and super-linear
//!   blow-ups on inputs up to about a megabyte, not a speed test;
//! - a memory bound: the peak of the bytes allocated during the case (counted by this
//!   binary's global allocator, so deterministic) is at most
//!   [`BYTES_PER_INPUT_BYTE`] times the input's size plus [`BASE_BYTES`]. The design
//!   goal is "every reader linear in its input": a parsed document costs tens of
//!   bytes per byte of text, and a quadratic reader exceeds the bound by orders of
//!   magnitude on the large generated cases. For the command line, the binary runs
//!   under an address-space limit ([`CLI_ADDRESS_SPACE_KB`]).
//!
//! The cases are the same on every run (a fixed seed per reader); a failure names
//! the reader and the case's index, and prints the start of its input.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mpipe::core::calibrate::measure;
use mpipe::core::derive::{derive_str, Request};
use mpipe::core::expr::parse_str;
use mpipe::core::profile::Profile;
use mpipe::core::program::Program;
use mpipe::core::render::trace::{
    chrome_trace, embedded_program, timeline_from_trace, TraceOptions,
};
use mpipe::core::search::auto::candidates;
use mpipe::core::simulate::{simulate, Mode, SimOptions};
use mpipe::core::torch_csv::import;
use mpipe::core::verify::verify;
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// The hang guard per case (generous: a loaded 2-core machine must not fail it; a
/// quadratic reader on the megabyte-sized cases takes minutes).
const HANG_GUARD: Duration = Duration::from_secs(5);
/// The hang guard per run of the binary (it may derive a program at the largest
/// sizes given: `transpose` at 3 x 65536 took 20.6 s on the 2-core VM at load
/// average 10; a hang or a quadratic derivation at that size takes hours).
const CLI_HANG_GUARD: Duration = Duration::from_secs(90);
/// Linear memory: bytes allocated at the peak per byte of input...
const BYTES_PER_INPUT_BYTE: usize = 64;
/// ...plus this much (a derived program at the small sizes used, tables, messages).
const BASE_BYTES: usize = 16 << 20;
/// The binary's address space (`ulimit -v`, KiB): far above what a refusal or a
/// small derivation needs, far below the gigabytes of the issue's blow-ups.
const CLI_ADDRESS_SPACE_KB: u64 = 2 << 20;

/// Words that say an error is mpipe's own bug, not the input's.
const INTERNAL: [&str; 4] = [
    "internal error",
    "a bug in mpipe",
    "please report",
    "internal inconsistency",
];

/// The allocator's peak is process-wide: one case at a time in this binary.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

// ---------------------------------------------------------------------------------
// Deterministic inputs.

/// SplitMix64: small, seeded, the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Numbers a reader must take or refuse cleanly.
const NUMBERS: [&str; 30] = [
    "0",
    "-0",
    "1",
    "-1",
    "-2",
    "1e308",
    "-1e308",
    "1e309",
    "1.7976931348623157e308",
    "5e-324",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "+inf",
    "255",
    "65535",
    "65536",
    "65537",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999999",
    "0.5",
    "1e-300",
    "0x10",
    "1_000",
    "1e3",
];

/// Tokens spliced into inputs: structure of every format, odd characters.
const TOKENS: [&str; 34] = [
    "[",
    "]",
    "{",
    "}",
    "(",
    ")",
    ",",
    "=",
    ":",
    "\"",
    "'",
    "\n",
    "\r\n",
    "#",
    "\\",
    "\0",
    "é",
    "漢",
    "\u{202e}",
    "\u{feff}",
    "\t",
    "[llm]\n",
    "[[encoder]]\n",
    "transpose(",
    "refine(",
    "layers(",
    "interleaved(",
    "order = ",
    "vision",
    "llm.0",
    "null",
    "true",
    "[]",
    "{}",
];

/// Apply one to four mutations to `seed` (a splice partner may donate bytes).
fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let n = v.len();
        let at = rng.below(n + 1);
        match rng.below(9) {
            0 if n > 0 => v[at.min(n - 1)] = rng.next() as u8,
            1 => {
                let end = (at + 1 + rng.below(16)).min(n);
                v.drain(at..end);
            }
            2 => {
                let end = (at + 1 + rng.below(64)).min(n);
                let piece = v[at..end].to_vec();
                let to = rng.below(n + 1);
                v.splice(to..to, piece);
            }
            3 => {
                let t = rng.pick(&TOKENS).as_bytes();
                v.splice(at..at, t.iter().copied());
            }
            4 => {
                // Replace the number at (or after) `at` with an interesting one.
                let start = v[at..].iter().position(u8::is_ascii_digit).map(|p| at + p);
                if let Some(s) = start {
                    let mut e = s;
                    while e < v.len() && (v[e].is_ascii_digit() || v[e] == b'.') {
                        e += 1;
                    }
                    let num = rng.pick(&NUMBERS).as_bytes();
                    v.splice(s..e, num.iter().copied());
                }
            }
            5 => v.truncate(at),
            6 => {
                // Repeat a short piece many times (growth, many keys or tables).
                let end = (at + 1 + rng.below(40)).min(n);
                let piece = v[at..end].to_vec();
                let times = 1 + rng.below(2_000);
                let rep = piece.repeat(times);
                v.splice(end..end, rep);
            }
            7 if !other.is_empty() => {
                let s = rng.below(other.len());
                let e = (s + 1 + rng.below(200)).min(other.len());
                v.splice(at..at, other[s..e].iter().copied());
            }
            _ => {
                let num = rng.pick(&NUMBERS).as_bytes();
                v.splice(at..at, num.iter().copied());
            }
        }
    }
    v
}

/// `count` mutations of the seeds, each case a different seed in turn.
fn mutations(seed: u64, seeds: &[String], count: usize) -> Vec<String> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|i| {
            let s = seeds[i % seeds.len()].as_bytes();
            let o = seeds[rng.below(seeds.len())].as_bytes();
            // The library readers take text: invalid UTF-8 becomes U+FFFD, itself a
            // multi-byte character that spans and columns must survive.
            String::from_utf8_lossy(&mutate(&mut rng, s, o)).into_owned()
        })
        .collect()
}

/// Mutate a JSON document at the value level, so that it stays JSON and the reader
/// gets past the syntax: a leaf becomes an interesting number, a long or odd string,
/// null; a key is removed, renamed or added; an array element is repeated or dropped.
fn mutate_json(rng: &mut Rng, v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(m) if !m.is_empty() && rng.below(4) != 0 => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = rng.pick(&keys).clone();
            match rng.below(8) {
                0 => {
                    m.remove(&k);
                }
                1 => {
                    let x = m.remove(&k).unwrap();
                    m.insert(format!("{k}{}", rng.pick(&TOKENS)), x);
                }
                2 => {
                    m.insert(format!("unknown{}", rng.next() % 100), 1.into());
                }
                _ => mutate_json(rng, m.get_mut(&k).unwrap()),
            }
        }
        Value::Array(a) if !a.is_empty() && rng.below(4) != 0 => {
            let i = rng.below(a.len());
            match rng.below(8) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let x = a[i].clone();
                    let times = 1 + rng.below(50);
                    for _ in 0..times {
                        a.insert(i, x.clone());
                    }
                }
                _ => mutate_json(rng, &mut a[i]),
            }
        }
        _ => {
            *v = match rng.below(6) {
                0..=2 => {
                    let n = *rng.pick(&NUMBERS);
                    serde_json::from_str(n).unwrap_or_else(|_| n.into())
                }
                3 => "v".repeat(1 + rng.below(300)).into(),
                4 => Value::Null,
                _ => rng.pick(&TOKENS).to_string().into(),
            }
        }
    }
}

/// `count` value-level mutations of JSON seeds (one to three each).
fn json_mutations(seed: u64, seeds: &[String], count: usize) -> Vec<String> {
    let mut rng = Rng(seed);
    let values: Vec<serde_json::Value> = seeds
        .iter()
        .map(|s| serde_json::from_str(s).unwrap())
        .collect();
    (0..count)
        .map(|i| {
            let mut v = values[i % values.len()].clone();
            for _ in 0..1 + rng.below(3) {
                mutate_json(&mut rng, &mut v);
            }
            if rng.below(2) == 0 {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                v.to_string()
            }
        })
        .collect()
}

/// Expressions mutated by words: a name or number becomes another of the seeds'
/// words or an interesting number, or the whole is wrapped in an operator, so that
/// most cases still parse and reach the derivation.
fn expr_word_mutations(seed: u64, seeds: &[String], count: usize) -> Vec<String> {
    let mut rng = Rng(seed);
    let mut words: Vec<String> = seeds
        .iter()
        .flat_map(|s| {
            s.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
                .filter(|w| !w.is_empty())
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect();
    words.sort();
    words.dedup();
    (0..count)
        .map(|i| {
            let mut e = seeds[i % seeds.len()].clone();
            for _ in 0..1 + rng.below(2) {
                match rng.below(5) {
                    0 => {
                        e = format!(
                            "{}({e})",
                            rng.pick(&["refine", "layers", "fill", "transpose"])
                        )
                    }
                    1 => e = format!("refine({e}, order = {})", rng.pick(&NUMBERS)),
                    _ => {
                        let spans: Vec<(usize, usize)> = e
                            .match_indices(|c: char| c.is_alphanumeric() || c == '_' || c == '.')
                            .map(|(at, m)| (at, at + m.len()))
                            .collect();
                        if spans.is_empty() {
                            continue;
                        }
                        // Grow the character at a random place to its whole word.
                        let (mut a, mut b) = *rng.pick(&spans);
                        let bytes = e.as_bytes();
                        let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'.';
                        while a > 0 && word(bytes[a - 1]) {
                            a -= 1;
                        }
                        while b < bytes.len() && word(bytes[b]) {
                            b += 1;
                        }
                        let by = if rng.below(3) == 0 {
                            rng.pick(&NUMBERS).to_string()
                        } else {
                            rng.pick(&words).clone()
                        };
                        e.replace_range(a..b, &by);
                    }
                }
            }
            e
        })
        .collect()
}

// ---------------------------------------------------------------------------------
// The per-case checks.

/// Run one case: `f` returns the text of every error and message it produced.
fn case(reader: &str, index: usize, input: &str, f: impl FnOnce() -> String) {
    ALLOC.reset_peak_usage();
    let base = ALLOC.current_usage();
    let started = Instant::now();
    let outcome = catch_unwind(AssertUnwindSafe(f));
    let elapsed = started.elapsed();
    let peak = ALLOC.peak_usage().saturating_sub(base);
    let head: String = input.chars().take(300).collect();
    let what = format!(
        "{reader} case {index} ({} bytes, starting {head:?})",
        input.len()
    );
    let text = match outcome {
        Ok(t) => t,
        Err(_) => panic!("{what}: the reader panicked"),
    };
    for word in INTERNAL {
        assert!(
            !text.to_lowercase().contains(word),
            "{what}: an internal error reached the user: {}",
            text.chars().take(2_000).collect::<String>()
        );
    }
    assert!(
        elapsed <= HANG_GUARD,
        "{what}: took {elapsed:?} (hang guard {HANG_GUARD:?})"
    );
    let bound = BYTES_PER_INPUT_BYTE * input.len() + BASE_BYTES;
    assert!(
        peak <= bound,
        "{what}: {peak} bytes allocated at the peak, over the linear bound {bound}"
    );
}

fn shipped(dir: &Path, ext: &str) -> Vec<String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect()
}

fn toml_seeds() -> Vec<String> {
    let mut s = shipped(&root().join("profiles"), "toml");
    s.extend(shipped(&root().join("docs/guide/examples"), "toml"));
    s
}

fn toml_to_json(text: &str) -> String {
    let v: toml::Value = toml::from_str(text).unwrap();
    serde_json::to_string_pretty(&v).unwrap()
}

fn small_profile() -> &'static Profile {
    static P: OnceLock<Profile> = OnceLock::new();
    P.get_or_init(|| {
        Profile::from_toml_str(
            &std::fs::read_to_string(root().join("docs/guide/examples/small-mllm.toml")).unwrap(),
        )
        .unwrap()
    })
}

fn program(expr: &str, ranks: usize, mbs: usize) -> Program {
    derive_str(&Request::new(small_profile(), ranks, mbs), expr)
        .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
        .program
}

const LLM: &str =
    "[llm]\nlayers = 4\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";
const ENCODER: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 1.0\nbackward = 2.0\n\
                       weight = 1.0\nactivation = 1.0\ntrainable = true\n";

fn profile_text(r: Result<Profile, mpipe::core::profile::ProfileError>) -> String {
    match r {
        Ok(p) => format!("{} encoders", p.encoders.len()),
        Err(e) => e.to_string(),
    }
}

// ---------------------------------------------------------------------------------
// 1. Profiles.

/// Generated TOML profiles: sizes and values that broke readers before.
fn toml_structure() -> Vec<String> {
    let mut out = Vec::new();
    let mut keys = LLM.to_string();
    for i in 0..30_000 {
        keys.push_str(&format!("k{i} = {i}\n"));
    }
    out.push(keys);
    out.push(format!("{}{LLM}", ENCODER.repeat(3_000)));
    let mut tables = LLM.to_string();
    for i in 0..5_000 {
        tables.push_str(&format!("[t{i}]\nx = 1\n"));
    }
    out.push(tables);
    out.push(format!(
        "{}{LLM}",
        ENCODER.replace("vision", &"v".repeat(200_000))
    ));
    out.push(format!("{LLM}{} = 1\n", "forward".repeat(30_000)));
    out.push(format!(
        "{LLM}x = {}1{}\n",
        "[".repeat(50_000),
        "]".repeat(50_000)
    ));
    out.push(format!(
        "{LLM}x = {}1{}\n",
        "{a = ".repeat(20_000),
        "}".repeat(20_000)
    ));
    out.push(format!("{LLM}layout = \"{}\"\n", "t|".repeat(100_000)));
    out.push(format!(
        "{LLM}[link]\nlatency = \"{}\"\n",
        "9".repeat(100_000)
    ));
    out.push("[".repeat(100_000));
    out.push(format!("{LLM}{}", "# comment\n".repeat(50_000)));
    for field in ["layers", "forward", "backward", "weight", "activation"] {
        for n in NUMBERS {
            let text = format!("{ENCODER}{LLM}");
            let at = text.rfind(&format!("{field} = ")).unwrap();
            let end = at + text[at..].find('\n').unwrap();
            out.push(format!("{}{field} = {n}{}", &text[..at], &text[end..]));
        }
    }
    out
}

fn json_structure() -> Vec<String> {
    let llm = r#""llm": {"layers": 4, "forward": 1, "backward": 1, "weight": 1, "activation": 1"#;
    let enc = r#"{"name": "v", "layers": 1, "forward": 1, "backward": 1, "activation": 1}"#;
    let keys: Vec<String> = (0..30_000).map(|i| format!("\"k{i}\": {i}")).collect();
    let mut out = vec![
        format!("{{{llm}, {}}}}}", keys.join(", ")),
        format!("{{\"encoder\": [{}], {llm}}}}}", vec![enc; 3_000].join(",")),
        format!(
            "{{\"encoder\": [{}], {llm}}}}}",
            enc.replace("\"v\"", &format!("\"{}\"", "v".repeat(200_000)))
        ),
        format!(
            "{{{llm}, \"x\": {}1{}}}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        ),
        "{\"a\":".repeat(50_000),
        format!(
            "{{{llm}}}, {}}}",
            (0..5_000)
                .map(|i| format!("\"t{i}\": {{}}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!("{{{llm}, \"layout\": \"{}\"}}}}", "t|".repeat(100_000)),
    ];
    for n in NUMBERS {
        out.push(format!(
            "{{\"encoder\": [{}], {}}}}}",
            enc.replace("\"layers\": 1", &format!("\"layers\": {n}")),
            llm.replace("\"forward\": 1", &format!("\"forward\": {n}"))
        ));
    }
    out
}

#[test]
fn profiles_in_toml_and_json() {
    let _g = serial();
    let toml_seeds = toml_seeds();
    let json_seeds: Vec<String> = toml_seeds.iter().map(|t| toml_to_json(t)).collect();
    let mut n = 0;
    for (i, text) in mutations(0x70_31, &toml_seeds, 400)
        .iter()
        .chain(&toml_structure())
        .enumerate()
    {
        case("profile (TOML)", i, text, || {
            profile_text(Profile::from_toml_str(text))
        });
        n += 1;
    }
    for (i, text) in mutations(0x75_07, &json_seeds, 200)
        .iter()
        .chain(&json_mutations(0x75_08, &json_seeds, 300))
        .chain(&json_structure())
        .enumerate()
    {
        case("profile (JSON)", i, text, || {
            profile_text(Profile::from_json_str(text))
        });
        n += 1;
    }
    assert!(n >= 800);
}

// ---------------------------------------------------------------------------------
// 2. Schedule expressions.

fn expr_seeds() -> Vec<String> {
    let mut s: Vec<String> = candidates(small_profile(), 4, 8)
        .iter()
        .map(ToString::to_string)
        .collect();
    s.extend(
        [
            "1f1b",
            "refine(layers(1f1b))",
            "refine(transpose(vision, zbv), order = 20)",
            "layers(transpose(vision, 1f1b))",
            "interleaved(vision = 2)",
            "transpose(vision, dualpipev)",
        ]
        .map(String::from),
    );
    s
}

fn expr_structure() -> Vec<String> {
    let mut out = vec![
        format!("{}1f1b{}", "transpose(".repeat(20_000), ")".repeat(20_000)),
        format!("{}1f1b{}", "refine(".repeat(500), ")".repeat(500)),
        format!("{}1f1b{}", "layers(".repeat(500), ")".repeat(500)),
        "(".repeat(200_000),
        ")".repeat(200_000),
        format!("{}1f1b", "refine(".repeat(100_000)),
        "v".repeat(300_000),
        format!("transpose({}, zbv)", "v".repeat(300_000)),
        format!("interleaved({})", vec!["vision = 2"; 20_000].join(", ")),
        format!("transpose(vision, zbv){}", " ".repeat(300_000)),
        "1f1b, ".repeat(30_000),
        "é".repeat(100_000),
        String::new(),
    ];
    for n in NUMBERS {
        out.push(format!("refine(1f1b, order = {n})"));
        out.push(format!("interleaved(vision = {n})"));
        out.push(format!("transpose(vision, {n})"));
    }
    out
}

#[test]
fn schedule_expressions() {
    let _g = serial();
    let profile = small_profile();
    let cases: Vec<String> = mutations(0xe4_9e, &expr_seeds(), 200)
        .into_iter()
        .chain(expr_word_mutations(0xe4_9f, &expr_seeds(), 300))
        .chain(expr_structure())
        .collect();
    for (i, text) in cases.iter().enumerate() {
        case("expression", i, text, || match parse_str(text) {
            Err(errors) => format!("{errors:?}"),
            // What parses is also derived, at a small size.
            Ok(_) => match derive_str(&Request::new(profile, 2, 4), text) {
                Ok(d) => format!("{} ranks", d.program.ranks),
                Err(errors) => errors.iter().map(|e| format!("{e}\n")).collect(),
            },
        });
    }
    assert!(cases.len() >= 400);
}

// ---------------------------------------------------------------------------------
// 3. Program files.

fn program_seeds() -> Vec<String> {
    let mut s: Vec<String> = [
        ("1f1b", 2, 4),
        ("zbh1", 2, 3),
        ("transpose(vision, 1f1b)", 2, 4),
    ]
    .iter()
    .map(|&(e, r, m)| program(e, r, m).to_json())
    .collect();
    s.push(std::fs::read_to_string(root().join("tests/profiles/tiny-program.json")).unwrap());
    s.push(std::fs::read_to_string(root().join("docs/guide/examples/compute-only.json")).unwrap());
    s
}

fn program_structure() -> Vec<String> {
    let valid = program("1f1b", 2, 4).to_json();
    let v: serde_json::Value = serde_json::from_str(&valid).unwrap();
    let mut out = Vec::new();
    let set = |key: &str, value: serde_json::Value| {
        let mut w = v.clone();
        w[key] = value;
        w.to_string()
    };
    for n in NUMBERS {
        for key in ["ranks", "microbatches"] {
            out.push(valid.replacen(
                &format!("\"{key}\": "),
                &format!("\"{key}\": {n}, \"x\": "),
                1,
            ));
        }
        out.push(valid.replace("\"F\": ", &format!("\"F\": {n}, \"y\": ")));
        out.push(valid.replacen("\"act\": ", &format!("\"act\": {n}, \"z\": "), 1));
        out.push(valid.replacen("\"mb\": ", &format!("\"mb\": {n}, \"q\": "), 1));
        out.push(valid.replacen("\"home\": ", &format!("\"home\": {n}, \"q\": "), 1));
    }
    let mut units = v["units"].as_array().unwrap().clone();
    let first = units[0].clone();
    for i in 0..10_000 {
        let mut u = first.clone();
        u["name"] = format!("u{i}").into();
        units.push(u);
    }
    out.push(set("units", units.into()));
    let mut long = v.clone();
    long["units"][0]["name"] = "v".repeat(200_000).into();
    out.push(long.to_string());
    let action = v["programs"][0][0].clone();
    out.push(set(
        "programs",
        serde_json::json!([vec![action.clone(); 50_000], vec![action; 50_000]]),
    ));
    out.push(set(
        "programs",
        serde_json::json!(vec![Vec::<u8>::new(); 50_000]),
    ));
    out.push(set(
        "prefetch",
        serde_json::json!(vec![serde_json::json!({"unit": "llm.0", "mb": 3}); 20_000]),
    ));
    out.push(format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000)));
    out.push(format!("{{\"units\": {}", "[{\"a\": ".repeat(50_000)));
    let keys: Vec<String> = (0..30_000).map(|i| format!("\"k{i}\": {i}")).collect();
    out.push(valid.replacen('{', &format!("{{{}, ", keys.join(", ")), 1));
    out
}

fn program_outcome(text: &str) -> String {
    let p = match Program::from_json(text) {
        Ok(p) => p,
        Err(e) => return e.to_string(),
    };
    let mut out = String::new();
    for v in verify(&p).iter().take(50) {
        out.push_str(&format!("{v}\n"));
    }
    for mode in [Mode::Rendezvous, Mode::Eager] {
        match simulate(&p, &SimOptions { mode, comm: None }) {
            Ok(r) => out.push_str(&format!("makespan {}\n", r.makespan)),
            Err(e) => out.push_str(&format!("{e}\n")),
        }
    }
    out
}

#[test]
fn program_files() {
    let _g = serial();
    let cases: Vec<String> = mutations(0x9a_0f, &program_seeds(), 200)
        .into_iter()
        .chain(json_mutations(0x9a_10, &program_seeds(), 300))
        .chain(program_structure())
        .collect();
    for (i, text) in cases.iter().enumerate() {
        case("program", i, text, || program_outcome(text));
    }
    assert!(cases.len() >= 400);
}

// ---------------------------------------------------------------------------------
// 4. Torch CSVs.

fn csv_structure() -> Vec<String> {
    let row: Vec<String> = (0..4).map(|m| format!("0F{m}")).collect();
    let mut out = vec![
        format!(
            "{}\n",
            (0..100_000)
                .map(|m| format!("0F{m}"))
                .collect::<Vec<_>>()
                .join(",")
        ),
        "0F0\n".repeat(100_000),
        format!("{}\n", row.join(",")).repeat(20_000),
        format!("0F0,{}F0\n", "9".repeat(100_000)),
        format!("0F{},0B0\n", "9".repeat(100_000)),
        format!("{}\n", "\"".repeat(100_000)),
        ",".repeat(200_000),
        format!("0{}0\n", "F".repeat(200_000)),
        String::new(),
        "\n\n\n".into(),
    ];
    for n in NUMBERS {
        out.push(format!("{n}F0,0B{n}\n1F0,1B0\n"));
        out.push(format!("0F0,0SEND_F{n},0B0\n1RECV_F0,1F0,1B0\n"));
    }
    out
}

#[test]
fn torch_csvs() {
    let _g = serial();
    let seeds = shipped(&root().join("mpipe-core/tests/torch_csv"), "csv");
    let profile = small_profile();
    let cases: Vec<String> = mutations(0xc5_71, &seeds, 400)
        .into_iter()
        .chain(csv_structure())
        .collect();
    for (i, text) in cases.iter().enumerate() {
        case("torch CSV", i, text, || {
            let mut out = String::new();
            for profile in [None, Some(profile)] {
                match import(text, profile) {
                    Ok(p) => {
                        for v in verify(&p).iter().take(20) {
                            out.push_str(&format!("{v}\n"));
                        }
                    }
                    Err(e) => out.push_str(&format!("{e}\n")),
                }
            }
            out
        });
    }
    assert!(cases.len() >= 400);
}

// ---------------------------------------------------------------------------------
// 5. Traces (what `mpipe calibrate` reads).

fn trace_of(p: &Program) -> String {
    let r = simulate(
        p,
        &SimOptions {
            mode: Mode::Rendezvous,
            comm: None,
        },
    )
    .unwrap();
    chrome_trace(
        p,
        &r.timeline,
        &TraceOptions {
            embed_program: true,
            ..TraceOptions::default()
        },
    )
}

fn trace_structure(p: &Program) -> Vec<String> {
    let valid = trace_of(p);
    let v: serde_json::Value = serde_json::from_str(&valid).unwrap();
    let event = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["ph"] == "X")
        .unwrap()
        .clone();
    let mut out = Vec::new();
    let with_events = |events: Vec<serde_json::Value>| {
        let mut w = v.clone();
        w["traceEvents"] = events.into();
        w.to_string()
    };
    out.push(with_events(vec![event.clone(); 100_000]));
    for field in ["tid", "ts", "dur"] {
        for n in NUMBERS {
            let mut e = event.clone();
            e[field] = serde_json::from_str(n).unwrap_or_else(|_| n.into());
            let mut events = v["traceEvents"].as_array().unwrap().clone();
            events.push(e);
            out.push(with_events(events));
        }
    }
    let mut long = event.clone();
    long["name"] = "F".repeat(300_000).into();
    out.push(with_events(vec![long]));
    for key in ["ranks", "microbatches"] {
        let mut w = v.clone();
        w["mpipe"]["program"][key] = 4_000_000_000u64.into();
        out.push(w.to_string());
    }
    let mut w = v.clone();
    w["mpipe"] = serde_json::json!({"program": format!("{}", "[".repeat(1000))});
    out.push(w.to_string());
    out.push(format!("{{\"traceEvents\": {}", "[".repeat(100_000)));
    out.push(valid[..valid.len() / 2].to_string());
    out
}

#[test]
fn traces() {
    let _g = serial();
    let programs = [
        program("1f1b", 2, 4),
        program("transpose(vision, 1f1b)", 2, 4),
    ];
    let seeds: Vec<String> = programs.iter().map(trace_of).collect();
    let cases: Vec<String> = mutations(0x7a_ce, &seeds, 200)
        .into_iter()
        .chain(json_mutations(0x7a_cf, &seeds, 300))
        .chain(trace_structure(&programs[0]))
        .collect();
    for (i, text) in cases.iter().enumerate() {
        case("trace", i, text, || {
            let mut out = String::new();
            let embedded = embedded_program(text);
            if let Err(e) = &embedded {
                out.push_str(&format!("{e}\n"));
            }
            // The embedded program, else the one given with `--program`.
            for p in embedded.iter().chain(&programs) {
                match timeline_from_trace(p, text, 1000.0) {
                    Ok(t) => match measure(p, &t, Mode::Rendezvous, None) {
                        Ok(c) => out.push_str(&format!("{} units\n", c.units.len())),
                        Err(e) => out.push_str(&format!("{e}\n")),
                    },
                    Err(e) => out.push_str(&format!("{e}\n")),
                }
            }
            out
        });
    }
    assert!(cases.len() >= 400);
}

// ---------------------------------------------------------------------------------
// 6. The command line: its numbers, and files read as bytes.

/// Run the binary under the address-space limit; check its status and words.
fn cli(index: usize, args: &[String]) -> Output {
    let started = Instant::now();
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {CLI_ADDRESS_SPACE_KB} && exec \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_mpipe"))
        .args(args)
        .current_dir(root())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    let what = format!("command line case {index}: mpipe {}", args.join(" "));
    assert!(
        o.status.code().is_some(),
        "{what}: killed by a signal ({:?}): {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(!err.contains("memory allocation"), "{what}: {err}");
    for word in INTERNAL {
        assert!(!err.to_lowercase().contains(word), "{what}: {err}");
    }
    // 0: done; 1: the input is wrong; 2: usage. Nothing else.
    assert!(
        matches!(o.status.code(), Some(0..=2)),
        "{what}: status {:?}: {err}",
        o.status
    );
    if o.status.code() != Some(0) {
        assert!(!err.trim().is_empty(), "{what}: fails without a word");
    }
    assert!(
        elapsed <= CLI_HANG_GUARD,
        "{what}: took {elapsed:?} (hang guard {CLI_HANG_GUARD:?})"
    );
    o
}

/// Numbers as a person might type them, and worse.
const CLI_NUMBERS: [&str; 23] = [
    "0",
    "-1",
    "-0",
    "+3",
    " 3",
    "3 ",
    "3.0",
    "3e0",
    "0x3",
    "٣",
    "",
    "NaN",
    "inf",
    "1e308",
    "-1e308",
    "65536",
    "65537",
    "4294967296",
    "18446744073709551616",
    "99999999999999999999999999999",
    "1_0",
    "３",
    "2",
];

#[test]
fn command_line_numbers_and_files() {
    let _g = serial();
    let mut rng = Rng(0xc1_1e);
    let model = "docs/guide/examples/small-mllm.toml";
    let mut index = 0;
    let mut run = |args: Vec<String>| {
        cli(index, &args);
        index += 1;
    };
    let s = |x: &str| x.to_string();
    for _ in 0..60 {
        let (ranks, mbs) = if rng.below(2) == 0 {
            (*rng.pick(&CLI_NUMBERS), *rng.pick(&["2", "4", "1"]))
        } else {
            (*rng.pick(&["2", "1", "3"]), *rng.pick(&CLI_NUMBERS))
        };
        let cmd = *rng.pick(&["derive", "simulate", "compare"]);
        let mut args = vec![s(cmd), s("--model"), s(model)];
        args.extend([s("--ranks"), s(ranks), s("--microbatches"), s(mbs)]);
        let exprs = ["1f1b", "zbh1", "transpose(vision, 1f1b)"];
        let expr = *rng.pick(&exprs);
        args.push(s(expr));
        if cmd == "derive" {
            args.extend([s("-o"), s("/dev/null")]);
        }
        run(args);
    }
    for _ in 0..40 {
        let flag = *rng.pick(&["--latency", "--bandwidth", "--width", "--order"]);
        let n = *rng.pick(&CLI_NUMBERS);
        let mut args = match flag {
            "--width" => vec![s("svg"), s("-o"), s("/dev/null")],
            "--order" => vec![
                s("refine"),
                s("docs/guide/examples/compute-only.json"),
                s("-o"),
                s("/dev/null"),
            ],
            _ => vec![s("simulate")],
        };
        if flag != "--order" {
            args.extend([
                s("--model"),
                s(model),
                s("--ranks"),
                s("2"),
                s("--microbatches"),
                s("4"),
                s("1f1b"),
            ]);
        }
        args.extend([s(flag), s(n)]);
        run(args);
    }
    // Files the binary reads as bytes: mutated, invalid UTF-8 left in.
    let dir = std::env::temp_dir().join(format!("mpipe-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prog = program("1f1b", 2, 4);
    let inputs: [(&str, Vec<u8>); 4] = [
        ("profile.toml", std::fs::read(root().join(model)).unwrap()),
        ("program.json", prog.to_json().into_bytes()),
        ("trace.json", trace_of(&prog).into_bytes()),
        (
            "torch.csv",
            std::fs::read(root().join("docs/guide/examples/1f1b-2ranks.csv")).unwrap(),
        ),
    ];
    for i in 0..60 {
        let (name, seed) = &inputs[i % inputs.len()];
        let mut bytes = mutate(&mut rng, seed, b"\xff\xfe\xc3\x28\xed\xa0\x80");
        if rng.below(3) == 0 {
            // Invalid UTF-8 for certain.
            let at = rng.below(bytes.len() + 1);
            bytes.splice(at..at, [0xc3, 0x28, 0xff]);
        }
        let file = dir.join(name);
        std::fs::write(&file, &bytes).unwrap();
        let f = file.display().to_string();
        let args = match *name {
            "profile.toml" => vec![
                s("simulate"),
                s("--model"),
                f,
                s("--ranks"),
                s("2"),
                s("--microbatches"),
                s("4"),
                s("1f1b"),
            ],
            "program.json" => vec![s("check"), f],
            "trace.json" => vec![s("calibrate"), f],
            _ => vec![
                s("import"),
                s("--format"),
                s("torch-csv"),
                f,
                s("-o"),
                s("/dev/null"),
            ],
        };
        run(args);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(index >= 160);
}

/// Regression (found by this fuzz): a torch CSV naming a high micro-batch on many
/// stages sized the program's (stage, micro-batch) tables by it: 883 bytes (64 stages
/// over 8 ranks, each with micro-batches 0 and 65535) took 503 MB and 1.7 s, and 800
/// stages would have taken gigabytes. Refused up front, naming the cell.
#[test]
fn a_short_csv_naming_a_high_micro_batch_on_many_stages_is_refused() {
    let _g = serial();
    for stages in [2usize, 8, 64, 800] {
        let mut rows = vec![String::new(); 8.min(stages)];
        for k in 0..stages {
            rows[k % 8].push_str(&format!("{k}F0,{k}F65535,"));
        }
        let text = rows.join("\n");
        case("torch CSV (regression)", stages, &text, || {
            let e = import(&text, None).expect_err("an incomplete schedule");
            assert!(
                e.message
                    .contains("micro-batch 65535 means 65536 micro-batches"),
                "{e}"
            );
            assert!(e.message.contains("every stage runs a forward"), "{e}");
            assert_eq!(e.line, Some(1), "{e}");
            e.to_string()
        });
    }
}

/// Issue 37, item 2 (the writer): `mpipe trace` held the whole trace in memory (10.7
/// GB for 806 MB, at least the file's size). Written to a stream, the peak allocation
/// (the timeline's pairing of transfers) stays below the bytes written.
#[test]
fn the_trace_writer_streams() {
    let _g = serial();
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let p = program("1f1b", 4, 1024);
    let r = simulate(
        &p,
        &SimOptions {
            mode: Mode::Rendezvous,
            comm: None,
        },
    )
    .unwrap();
    let mut out = Count(0);
    ALLOC.reset_peak_usage();
    let base = ALLOC.current_usage();
    mpipe::core::render::trace::write_chrome_trace(
        &p,
        &r.timeline,
        &TraceOptions::default(),
        &mut out,
    )
    .unwrap();
    let peak = ALLOC.peak_usage().saturating_sub(base);
    assert!(out.0 > 1 << 20, "{} bytes", out.0);
    assert!(
        peak < out.0,
        "{peak} bytes allocated at the peak to write {} bytes",
        out.0
    );
}

/// Issue 37, item 2 (the reader): `mpipe calibrate` took 9.9 GB to say that a trace
/// embeds no program. The reader is held to the fuzz's linear bound on a large
/// trace without one, and says what to give instead.
#[test]
fn a_large_trace_without_a_program_is_refused_in_linear_memory() {
    let _g = serial();
    let p = program("1f1b", 2, 4);
    let mut v: serde_json::Value = serde_json::from_str(&trace_of(&p)).unwrap();
    v.as_object_mut().unwrap().remove("mpipe");
    let event = v["traceEvents"][0].clone();
    v["traceEvents"] = vec![event; 200_000].into();
    let text = v.to_string();
    case("trace (regression)", 0, &text, || {
        let e = embedded_program(&text).unwrap_err();
        assert!(e.to_string().contains("--program"), "{e}");
        e.to_string()
    });
}

/// Issue 37, item 5 through the binary: a program whose costs are all 1e308 is
/// refused by `refine`, `check` and `simulate` as input, never as "a bug in mpipe".
#[test]
fn a_program_of_1e308_costs_is_refused_as_input() {
    let _g = serial();
    let mut p = program("1f1b", 2, 4);
    for u in &mut p.units {
        u.cost.f = 1e308;
        u.cost.b = 1e308;
        u.cost.w = 1e308;
    }
    let dir = std::env::temp_dir().join(format!("mpipe-fuzz-1e308-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("p.json");
    std::fs::write(&f, p.to_json()).unwrap();
    let f = f.display().to_string();
    for args in [
        vec![
            "refine".to_string(),
            f.clone(),
            "-o".into(),
            "/dev/null".into(),
        ],
        vec!["check".into(), f.clone()],
        vec!["simulate".into(), "--program".into(), f.clone()],
    ] {
        let o = cli(0, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
