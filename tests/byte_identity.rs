//! Byte identity of derived programs: the safety net of a restructuring.
//!
//! Every case derives one program (a profile, a size, a semantics and a schedule
//! expression) and hashes its program-file JSON (`Program::to_json`, the bytes
//! `mpipe derive` writes) with SHA-256. The hashes are compared with the committed
//! list `tests/golden/programs.sha256`, one line per case: `HASH  CASE`. A case whose
//! derivation fails is hashed as the text `error` (its messages may be reworded; a
//! case that starts or stops failing still shows).
//!
//! The cases: every profile shipped in `profiles/` and `docs/guide/examples/`, at
//! one small size and at its intended size, with every generator and operator (and
//! `refine`, `layers`, `prefetch` where the profile has a frozen encoder, `auto` on
//! the small profiles), under rendezvous and eager semantics; then a fixed, seeded
//! random suite of profiles and expressions (`auto` on a few small ones).
//!
//! A change of the list means the derivation now writes other programs. Where that
//! is meant (a new generator, a better search), regenerate the list and review the
//! diff of the cases it names:
//!
//! ```sh
//! MPIPE_BLESS=1 cargo test --release --test byte_identity
//! ```
//!
//! Blessing also writes each case's makespan (`tests/golden/makespans.txt`), and a
//! changed case is reported with its makespan before and after, so the review can
//! start from whether it got faster.
//!
//! A restructuring that changes no behaviour must leave the list as it is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::simulate::Mode;
use sha2::{Digest, Sha256};

/// One derivation to pin.
struct Case {
    /// Unique name: `suite/profile/RANKSxMICROBATCHES/mode/expression`.
    name: String,
    /// Index into the profiles list.
    profile: usize,
    ranks: usize,
    microbatches: usize,
    mode: Mode,
    expr: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Rendezvous => "rendezvous",
        Mode::Eager => "eager",
    }
}

/// The shipped profiles' sizes: a small one first, then the intended one. Every
/// profile under `profiles/` must be listed here (a new one needs its sizes).
fn shipped_sizes(file: &str) -> Option<&'static [(usize, usize)]> {
    Some(match file {
        "profiles/encoder-heavy.toml" => &[(4, 4), (4, 8)],
        "profiles/eval-a-internvit6b.toml" => &[(2, 4), (4, 4)],
        "profiles/eval-b-qwen2vl72b-frozen.toml" => &[(4, 8), (8, 32)],
        "profiles/eval-b-qwen2vl72b.toml" => &[(4, 8), (8, 32)],
        "profiles/eval-c-omni.toml" => &[(4, 8), (8, 16)],
        "profiles/qwen2vl-7b.toml" => &[(4, 8), (8, 32)],
        "docs/guide/examples/small-mllm.toml" => &[(4, 8)],
        "docs/guide/examples/frozen-mllm.toml" => &[(4, 8)],
        "docs/guide/examples/llm-only.toml" => &[(4, 8)],
        "docs/guide/examples/megatron-layout.toml" => &[(4, 8)],
        _ => return None,
    })
}

/// Where `auto` runs on a shipped profile (kept small: the search is the slow part).
fn shipped_auto(file: &str, ranks: usize, microbatches: usize) -> bool {
    matches!(
        (file, ranks, microbatches),
        ("profiles/encoder-heavy.toml", 4, 4) | ("docs/guide/examples/small-mllm.toml", 4, 8)
    )
}

/// The `.toml` files of `dir` (relative to the root), sorted.
fn toml_files(dir: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(root().join(dir))
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    out.sort();
    out
}

/// Every generator and operator over `profile`'s encoders.
fn expressions(profile: &Profile) -> Vec<String> {
    let mut out: Vec<String> = [
        "gpipe",
        "1f1b",
        "interleaved(v = 2)",
        "interleaved(v = 3)",
        "zbh1",
        "zbv",
        "dualpipev",
        "zb2p",
        "zb2p(v = 2)",
        "zb2p(layout = v)",
        "zb2p(costs = unit)",
        "split_w(1f1b)",
        "split_w(zbh1)",
        "balance(zbh1)",
        "balance(zb2p(costs = unit))",
        "refine(zbh1)",
        "refine(1f1b, order = 200)",
        "layers(zbh1)",
        "refine(layers(zbh1))",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let encoders: Vec<&str> = profile.encoders.iter().map(|e| e.name.as_str()).collect();
    if encoders.is_empty() {
        return out;
    }
    out.extend(
        [
            "zb2p(encoders = spread)",
            "zb2p(encoders = chain)",
            "zb2p(encoders = ramp)",
            "zb2p(v = 2, encoders = ramp)",
            "zb2p(costs = unit, encoders = chain)",
            "zb2p(costs = unit, encoders = spread)",
            "balance(zb2p(encoders = chain))",
            "layers(zb2p(costs = unit, encoders = chain))",
            "refine(layers(zb2p(costs = unit, encoders = ramp)))",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    if encoders.len() >= 2 {
        out.push("zb2p(encoders = chains)".into());
        out.push("balance(zb2p(encoders = chains))".into());
    }
    for e in &encoders {
        out.extend([
            format!("transpose({e}, 1f1b)"),
            format!("transpose({e}, zbh1)"),
            format!("transpose({e}, zbv)"),
            format!("transpose({e}, dualpipev)"),
            format!("transpose({e}, interleaved(v = 2))"),
            format!("transpose({e}, 1f1b, owners = min)"),
            format!("transpose({e}, zbh1, owners = spare)"),
            format!("transpose({e}, 1f1b, backward = central)"),
            format!("split_w(transpose({e}, 1f1b))"),
            format!("fill({e}, zbv)"),
            format!("fill({e}, 1f1b)"),
            format!("chain({e}, 1f1b)"),
            format!("chain({e}, zbh1)"),
            format!("host({e}, zbv)"),
            format!("host({e}, 1f1b, rank = 1)"),
            format!("balance(transpose({e}, zbv))"),
            format!("refine(transpose({e}, zbh1))"),
            format!("refine(transpose({e}, zbv), order = 200)"),
            format!("refine(layers(transpose({e}, zbh1)))"),
        ]);
    }
    if encoders.len() >= 2 {
        let (a, b) = (encoders[0], encoders[1]);
        out.extend([
            format!("transpose({b}, transpose({a}, zbv))"),
            format!("transpose({a}, transpose({b}, 1f1b))"),
            format!("fill({b}, fill({a}, zbv))"),
            format!("host({b}, host({a}, zbv))"),
            format!("chain({a}, transpose({b}, zbh1))"),
        ]);
    }
    for enc in profile.encoders.iter().filter(|e| !e.trainable) {
        let e = &enc.name;
        out.extend([
            format!("prefetch({e}, zbh1)"),
            format!("prefetch({e}, transpose({e}, 1f1b))"),
            format!("balance(prefetch({e}, zb2p(costs = unit)))"),
        ]);
    }
    out
}

/// A small deterministic generator (SplitMix64), so the random suite is the same on
/// every machine and with every version of every dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// A multiple of `step` in `lo..=hi` (exact in decimal, so the TOML is exact).
    fn quantum(&mut self, lo: u64, hi: u64, step: f64) -> f64 {
        self.range(lo, hi) as f64 * step
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next() as usize % items.len()]
    }
}

/// A random profile as TOML text: zero to three encoders (trainable or frozen), an
/// LLM with optional extras, and sometimes a memory limit and a link.
fn random_profile(rng: &mut Rng) -> String {
    let mut t = String::new();
    let n_enc = *rng.pick(&[0u64, 1, 1, 1, 2, 2, 3]);
    for (i, name) in ["vision", "audio", "video"]
        .iter()
        .take(n_enc as usize)
        .enumerate()
    {
        let trainable = i == 0 || rng.chance(60);
        t += "[[encoder]]\n";
        t += &format!("name = \"{name}\"\n");
        t += &format!("layers = {}\n", rng.range(1, 24));
        t += &format!("forward = {}\n", rng.quantum(1, 16, 0.125));
        t += &format!("backward = {}\n", rng.quantum(1, 24, 0.125));
        if trainable {
            t += &format!("weight = {}\n", rng.quantum(1, 16, 0.125));
        }
        t += &format!("activation = {}\n", rng.quantum(0, 8, 0.125));
        t += &format!("params = {}\n", rng.quantum(0, 16, 0.25));
        t += &format!("trainable = {trainable}\n");
        if rng.chance(50) {
            t += &format!("output = {}\n", rng.quantum(1, 8, 0.125));
        }
        t += "\n";
    }
    t += "[llm]\n";
    t += &format!("layers = {}\n", rng.range(8, 32));
    t += &format!("forward = {}\n", rng.quantum(2, 16, 0.25));
    t += &format!("backward = {}\n", rng.quantum(2, 24, 0.25));
    t += &format!("weight = {}\n", rng.quantum(1, 16, 0.25));
    t += &format!("activation = {}\n", rng.quantum(1, 8, 0.25));
    t += &format!("params = {}\n", rng.quantum(0, 8, 0.25));
    if rng.chance(50) {
        t += &format!("output = {}\n", rng.quantum(1, 8, 0.125));
    }
    if rng.chance(40) {
        t += &format!(
            "first_stage_extra = {{ forward = {}, backward = 0.0, weight = {}, params = {} }}\n",
            rng.quantum(0, 8, 0.25),
            rng.quantum(0, 8, 0.25),
            rng.quantum(0, 8, 0.25)
        );
    }
    if rng.chance(40) {
        let c = rng.quantum(1, 32, 0.5);
        t += &format!(
            "last_stage_extra = {{ forward = {c}, backward = {c}, weight = {c}, activation = {} }}\n",
            rng.quantum(0, 8, 0.25)
        );
    }
    if rng.chance(30) {
        t += &format!("\n[memory]\nlimit = {}\n", rng.range(40, 400));
    }
    if rng.chance(50) {
        t += &format!(
            "\n[link]\nlatency = {}\nbandwidth = {}\n",
            rng.quantum(0, 4, 0.25),
            rng.quantum(1, 16, 0.5)
        );
    }
    t
}

/// A random body: a generator, with random keys where it has some.
fn random_body(rng: &mut Rng, encoders: &[String]) -> String {
    let mut bodies = vec![
        "gpipe".to_string(),
        "1f1b".into(),
        "interleaved(v = 2)".into(),
        "zbh1".into(),
        "zbv".into(),
        "dualpipev".into(),
        "zb2p".into(),
        "zb2p(v = 2)".into(),
        "zb2p(layout = v)".into(),
        "zb2p(costs = unit)".into(),
        "split_w(1f1b)".into(),
    ];
    if !encoders.is_empty() {
        bodies.extend([
            "zb2p(encoders = spread)".into(),
            "zb2p(encoders = chain)".into(),
            "zb2p(costs = unit, encoders = chain)".into(),
            "zb2p(encoders = ramp)".into(),
            "zb2p(v = 2, encoders = ramp)".into(),
        ]);
    }
    if encoders.len() >= 2 {
        bodies.push("zb2p(encoders = chains)".into());
        bodies.push("zb2p(costs = unit, encoders = chains)".into());
    }
    rng.pick(&bodies).clone()
}

/// A random expression: a body under zero to two encoder operators, maybe balanced,
/// laid out layer by layer or refined.
fn random_expr(rng: &mut Rng, profile: &Profile) -> String {
    let encoders: Vec<String> = profile.encoders.iter().map(|e| e.name.clone()).collect();
    let mut e = random_body(rng, &encoders);
    for _ in 0..rng.range(0, 2) {
        if encoders.is_empty() {
            break;
        }
        let enc = rng.pick(&encoders).clone();
        e = match rng.range(0, 6) {
            0 => format!("transpose({enc}, {e})"),
            1 => format!(
                "transpose({enc}, {e}, owners = {})",
                rng.pick(&["round_robin", "min", "spare"])
            ),
            2 => format!("transpose({enc}, {e}, backward = central)"),
            3 => format!("fill({enc}, {e})"),
            4 => format!("chain({enc}, {e})"),
            5 => format!("host({enc}, {e})"),
            _ => format!("split_w({e})"),
        };
    }
    if let Some(frozen) = profile.encoders.iter().find(|x| !x.trainable) {
        if rng.chance(30) {
            e = format!("prefetch({}, {e})", frozen.name);
        }
    }
    if rng.chance(25) {
        e = format!("balance({e})");
    }
    match rng.range(0, 9) {
        0 => format!("layers({e})"),
        1 => format!("refine({e})"),
        2 => format!("refine(layers({e}))"),
        3 => format!("refine({e}, order = {})", rng.range(1, 300)),
        _ => e,
    }
}

/// The profiles (name and parsed profile) and the cases over them.
fn cases() -> (Vec<(String, Profile)>, Vec<Case>) {
    let mut profiles = Vec::new();
    let mut cases = Vec::new();
    let mut shipped = toml_files("profiles");
    shipped.extend(toml_files("docs/guide/examples"));
    for file in shipped {
        let text = std::fs::read_to_string(root().join(&file)).unwrap();
        let profile = Profile::from_toml_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        let sizes = shipped_sizes(&file).unwrap_or_else(|| {
            panic!("{file} is shipped but has no sizes in tests/byte_identity.rs's shipped_sizes")
        });
        let index = profiles.len();
        for &(ranks, microbatches) in sizes {
            for mode in [Mode::Rendezvous, Mode::Eager] {
                let mut exprs = expressions(&profile);
                if shipped_auto(&file, ranks, microbatches) {
                    exprs.push("auto".into());
                }
                for expr in exprs {
                    cases.push(Case {
                        name: format!(
                            "shipped/{file}/{ranks}x{microbatches}/{}/{expr}",
                            mode_name(mode)
                        ),
                        profile: index,
                        ranks,
                        microbatches,
                        mode,
                        expr,
                    });
                }
            }
        }
        profiles.push((file, profile));
    }

    let mut rng = Rng(0x6d70_6970_6535);
    for i in 0..60 {
        let text = random_profile(&mut rng);
        let profile = Profile::from_toml_str(&text)
            .unwrap_or_else(|e| panic!("random profile {i} does not parse: {e}\n{text}"));
        let index = profiles.len();
        let small = i % 12 == 0;
        let ranks = if small {
            rng.range(2, 3)
        } else {
            rng.range(2, 8)
        } as usize;
        let microbatches = if small {
            ranks * rng.range(1, 2) as usize
        } else {
            rng.range(1, 4 * ranks as u64) as usize
        };
        let mode = if rng.chance(50) {
            Mode::Rendezvous
        } else {
            Mode::Eager
        };
        let mut exprs: Vec<String> = (0..6).map(|_| random_expr(&mut rng, &profile)).collect();
        if small {
            exprs.push("auto".into());
        }
        for expr in exprs {
            let name = format!(
                "random/{i}/{ranks}x{microbatches}/{}/{expr}",
                mode_name(mode)
            );
            if cases.iter().any(|c: &Case| c.name == name) {
                continue;
            }
            cases.push(Case {
                name,
                profile: index,
                ranks,
                microbatches,
                mode,
                expr,
            });
        }
        profiles.push((format!("random/{i}"), profile));
    }
    (profiles, cases)
}

/// The SHA-256 of one case's program JSON (or of `error`), as lower-case hex, and
/// the program's simulated makespan (`None`: the derivation fails).
fn hash_case(profile: &Profile, case: &Case) -> Outcome {
    let mut req = Request::new(profile, case.ranks, case.microbatches);
    req.mode = case.mode;
    let (bytes, makespan) = match derive_str(&req, &case.expr) {
        Ok(d) => (d.program.to_json().into_bytes(), Some(d.report.makespan)),
        Err(_) => (b"error".to_vec(), None),
    };
    let hash = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    (hash, makespan)
}

/// A case's program hash and makespan (`None`: the derivation fails).
type Outcome = (String, Option<f64>);

/// Every case's hash and makespan, in the cases' order, computed on all cores.
fn hash_all(profiles: &[(String, Profile)], cases: &[Case]) -> Vec<Outcome> {
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<Outcome>>> = Mutex::new(vec![None; cases.len()]);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = cases.get(i) else { break };
                let h = hash_case(&profiles[case.profile].1, case);
                out.lock().unwrap()[i] = Some(h);
            });
        }
    });
    out.into_inner()
        .unwrap()
        .into_iter()
        .map(|h| h.expect("every case hashed"))
        .collect()
}

fn golden_path() -> PathBuf {
    root().join("tests/golden/programs.sha256")
}

/// Each case's makespan when the list was last written: a changed case's review
/// starts from whether it got faster.
fn makespans_path() -> PathBuf {
    root().join("tests/golden/makespans.txt")
}

/// The committed makespans: case name to makespan (`None`: the derivation failed).
fn read_makespans(path: &Path) -> BTreeMap<String, Option<f64>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once("  "))
        .map(|(m, n)| (n.to_string(), m.parse().ok()))
        .collect()
}

fn show(makespan: Option<f64>) -> String {
    makespan.map_or("error".into(), |m| format!("{m}"))
}

/// The committed list: case name to hash.
fn read_golden(path: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once("  "))
        .map(|(h, n)| (n.to_string(), h.to_string()))
        .collect()
}

#[test]
fn every_pinned_program_is_byte_identical() {
    let (profiles, cases) = cases();
    let results = hash_all(&profiles, &cases);
    let path = golden_path();
    if std::env::var_os("MPIPE_BLESS").is_some() {
        let mut text = String::from(
            "# SHA-256 of each case's program JSON (`error`: the derivation fails).\n\
             # Written by `MPIPE_BLESS=1 cargo test --release --test byte_identity`.\n",
        );
        let mut spans = String::from(
            "# Each case's simulated makespan (`error`: the derivation fails).\n\
             # Written with tests/golden/programs.sha256.\n",
        );
        for (case, (hash, makespan)) in cases.iter().zip(&results) {
            text += &format!("{hash}  {}\n", case.name);
            spans += &format!("{}  {}\n", show(*makespan), case.name);
        }
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        std::fs::write(makespans_path(), spans).unwrap();
        return;
    }
    let golden = read_golden(&path);
    let before = read_makespans(&makespans_path());
    let error_hash = format!("{:x}", Sha256::digest(b"error"));
    let mut changed = Vec::new();
    let mut new = Vec::new();
    let mut derived = 0;
    for (case, (hash, makespan)) in cases.iter().zip(&results) {
        if *hash != error_hash {
            derived += 1;
        }
        match golden.get(&case.name) {
            Some(h) if h == hash => {}
            Some(h) => changed.push(format!(
                "{}: {} now {} (makespan {} now {})",
                case.name,
                describe(h, &error_hash),
                describe(hash, &error_hash),
                before
                    .get(&case.name)
                    .map_or("unknown".into(), |m| show(*m)),
                show(*makespan),
            )),
            None => new.push(case.name.clone()),
        }
    }
    let gone: Vec<&String> = golden
        .keys()
        .filter(|n| !cases.iter().any(|c| &c.name == *n))
        .collect();
    assert!(
        changed.is_empty() && new.is_empty() && gone.is_empty(),
        "derived programs differ from tests/golden/programs.sha256 ({} changed, {} new, {} gone).\n\
         A restructuring must keep every program's bytes; if the change is meant, regenerate \
         with `MPIPE_BLESS=1 cargo test --release --test byte_identity` and review the diff.\n\
         changed:\n  {}\nnew:\n  {}\ngone:\n  {}",
        changed.len(),
        new.len(),
        gone.len(),
        changed.join("\n  "),
        new.join("\n  "),
        gone.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  "),
    );
    // The net is worth something only if most cases derive a program.
    assert!(
        derived * 4 >= cases.len() * 3,
        "only {derived} of {} cases derive a program",
        cases.len()
    );
}

fn describe(hash: &str, error_hash: &str) -> String {
    if hash == error_hash {
        "fails".into()
    } else {
        format!("hash {}", &hash[..12])
    }
}
