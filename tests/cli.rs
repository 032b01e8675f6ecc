//! The `mpipe` command-line tool, end to end: every test runs the real binary.
//!
//! Sizes are kept small (the `encoder-heavy` profile on 4 ranks x 8 micro-batches)
//! so that the debug build runs them quickly.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

const RANKS: &str = "4";
const MBS: &str = "8";

fn profile(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("profiles")
        .join(name)
        .display()
        .to_string()
}

fn heavy() -> String {
    profile("encoder-heavy.toml")
}

/// A fresh, empty directory for one test (removed when dropped).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mpipe-cli-{}-{}-{tag}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a temporary directory");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run `mpipe args...`, feeding `stdin` when given.
fn mpipe_with(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpipe"));
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run the mpipe binary");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        // mpipe may exit without reading its input (a refused argument is checked
        // first): a closed pipe is then its answer, not the test's failure.
        match pipe.write_all(text.as_bytes()) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                panic!("write to mpipe's stdin: {e}")
            }
            _ => {}
        }
    }
    child.wait_with_output().expect("wait for mpipe")
}

fn mpipe(args: &[&str]) -> Output {
    mpipe_with(args, None)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status, with both streams shown when it is not the expected one.
#[track_caller]
fn assert_status(o: &Output, code: i32) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "unexpected exit status\n--- stdout\n{}\n--- stderr\n{}",
        stdout(o),
        stderr(o)
    );
}

/// The derived program of `expr` on the encoder-heavy profile, as text.
fn derive(expr: &str) -> String {
    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        expr,
    ]);
    assert_status(&o, 0);
    stdout(&o)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
}

#[test]
fn derive_prints_a_program_that_check_accepts_from_a_file() {
    let text = derive("transpose(vision, 1f1b)");
    let doc = json(&text);
    assert_eq!(doc["format"], "mpipe-program/1");
    assert_eq!(doc["ranks"], 4);
    assert_eq!(doc["microbatches"], 8);
    assert_eq!(doc["programs"].as_array().map(Vec::len), Some(4));

    let dir = TempDir::new("derive-check");
    let file = dir.path("program.json");
    std::fs::write(&file, &text).unwrap();
    let o = mpipe(&["check", file.to_str().unwrap()]);
    assert_status(&o, 0);
    let out = stdout(&o);
    assert!(out.contains("valid"), "{out}");
    assert!(out.contains("rendezvous"), "the mode is named: {out}");

    // derive -o writes the same document.
    let written = dir.path("written.json");
    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "-o",
        written.to_str().unwrap(),
        "transpose(vision, 1f1b)",
    ]);
    assert_status(&o, 0);
    assert_eq!(
        json(&std::fs::read_to_string(&written).unwrap()),
        doc,
        "-o writes what stdout shows"
    );
}

#[test]
fn check_reads_standard_input() {
    let text = derive("1f1b");
    let o = mpipe_with(&["check", "-"], Some(&text));
    assert_status(&o, 0);
    assert!(stdout(&o).contains("valid"), "{}", stdout(&o));

    let o = mpipe_with(&["check", "--mode", "eager", "--json", "-"], Some(&text));
    assert_status(&o, 0);
    assert_eq!(json(&stdout(&o))["valid"], true);
}

/// The derived program with rank 0's last action removed.
fn mutated() -> String {
    let mut doc = json(&derive("1f1b"));
    let list = doc["programs"][0].as_array_mut().unwrap();
    let dropped = list.pop().expect("rank 0 has actions");
    assert!(
        ["B", "W", "BW"].contains(&dropped["op"].as_str().unwrap()),
        "rank 0 ends with a backward: {dropped}"
    );
    serde_json::to_string_pretty(&doc).unwrap()
}

#[test]
fn check_rejects_a_mutated_program_naming_the_rule() {
    let dir = TempDir::new("mutated");
    let file = dir.path("mutated.json");
    std::fs::write(&file, mutated()).unwrap();
    let o = mpipe(&["check", file.to_str().unwrap()]);
    assert_status(&o, 1);
    let err = stderr(&o);
    assert!(err.contains("invalid"), "{err}");
    assert!(err.contains("rule 1 (coverage)"), "{err}");
    assert!(
        err.contains(file.to_str().unwrap()),
        "names the file: {err}"
    );
    // The rules are cited by a path that exists in the project.
    let spec = mpipe_core::verify::SPEC;
    assert!(err.contains(spec), "cites the spec: {err}");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(spec)).expect("the cited spec exists");
    assert!(text.contains("Validity rules"), "{spec} has the rules");
}

#[test]
fn check_json_has_exactly_the_five_keys() {
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let five = ["bubble", "errors", "makespan", "peak_memory", "valid"];

    // Valid.
    let o = mpipe_with(&["check", "--json", "-"], Some(&derive("zbh1")));
    assert_status(&o, 0);
    let v = json(&stdout(&o));
    assert_eq!(keys(&v), five);
    assert_eq!(v["valid"], true);
    assert_eq!(v["errors"], Value::Array(vec![]));
    assert!(v["makespan"].as_f64().unwrap() > 0.0);
    let b = v["bubble"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&b), "{b}");
    assert_eq!(
        v["peak_memory"].as_array().unwrap().len(),
        4,
        "one per rank"
    );

    // Invalid.
    let o = mpipe_with(&["check", "--json", "-"], Some(&mutated()));
    assert_status(&o, 1);
    let v = json(&stdout(&o));
    assert_eq!(keys(&v), five);
    assert_eq!(v["valid"], false);
    let errors = v["errors"].as_array().unwrap();
    assert!(!errors.is_empty());
    assert!(errors
        .iter()
        .all(|e| e.as_str().unwrap().starts_with("rule ")));

    // Not a program at all: still the five keys, figures null, bad input.
    let o = mpipe_with(&["check", "--json", "-"], Some("this is not json"));
    assert_status(&o, 2);
    let v = json(&stdout(&o));
    assert_eq!(keys(&v), five);
    assert_eq!(v["valid"], false);
    assert_eq!(v["makespan"], Value::Null);
    assert_eq!(v["bubble"], Value::Null);
    assert_eq!(v["peak_memory"], Value::Null);
    assert!(v["errors"][0].as_str().unwrap().contains("not valid JSON"));
}

#[test]
fn check_explains_files_that_are_not_programs() {
    let dir = TempDir::new("not-programs");
    let garbage = dir.path("garbage.json");
    std::fs::write(&garbage, "{\n  \"ranks\": 4,,\n}\n").unwrap();
    let o = mpipe(&["check", garbage.to_str().unwrap()]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains(garbage.to_str().unwrap()), "{err}");
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains('^'), "{err}");

    // Well-formed JSON of the wrong shape: every problem, by key path.
    let mut doc = json(&derive("1f1b"));
    doc["ranks"] = Value::from("four");
    doc["programs"][1][0]["op"] = Value::from("FORWARD");
    let wrong = dir.path("wrong.json");
    std::fs::write(&wrong, serde_json::to_string(&doc).unwrap()).unwrap();
    let o = mpipe(&["check", wrong.to_str().unwrap()]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("ranks"), "{err}");
    assert!(err.contains("programs[1][0]"), "{err}");
    assert!(err.contains("\"FORWARD\""), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let o = mpipe_with(&["check", "-"], Some(""));
    assert_status(&o, 2);
    assert!(stderr(&o).contains("empty"), "{}", stderr(&o));

    let missing = dir.path("missing.json");
    let o = mpipe(&["check", missing.to_str().unwrap()]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains(missing.to_str().unwrap()));
}

#[test]
fn compare_prints_every_schedule_with_speedups() {
    let exprs = ["1f1b", "gpipe", "transpose(vision, 1f1b)", "zbv"];
    let model = heavy();
    let mut args = vec![
        "compare",
        "--model",
        model.as_str(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
    ];
    args.extend(exprs);
    let o = mpipe(&args);
    assert_status(&o, 0);
    let out = stdout(&o);
    for h in [
        "schedule",
        "makespan",
        "speedup",
        "bubble",
        "peak memory",
        "bound",
    ] {
        assert!(out.contains(h), "column {h}: {out}");
    }
    for e in exprs {
        assert!(
            out.lines().any(|l| l.starts_with(e)),
            "a row for {e}: {out}"
        );
    }
    let first = out.lines().find(|l| l.starts_with("1f1b ")).unwrap();
    assert!(
        first.contains("1.00x"),
        "the first is the baseline: {first}"
    );

    args.push("--json");
    let o = mpipe(&args);
    assert_status(&o, 0);
    let v = json(&stdout(&o));
    let schedules = v["schedules"].as_array().unwrap();
    assert_eq!(schedules.len(), exprs.len());
    for (s, e) in schedules.iter().zip(exprs) {
        assert_eq!(s["schedule"], e);
        assert!(s["makespan"].as_f64().unwrap() > 0.0);
        assert!(s["speedup"].as_f64().unwrap() > 0.0);
        assert!(s["lower_bound"].as_f64().unwrap() > 0.0);
        assert_eq!(s["peak_memory"].as_array().unwrap().len(), 4);
    }
    assert_eq!(schedules[0]["speedup"], 1.0);
    assert_eq!(v["errors"], Value::Array(vec![]));
}

#[test]
fn compare_reports_each_failing_expression_under_its_own_header() {
    let o = mpipe(&[
        "compare",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
        "zbvv",
        "transpose(visoin, 1f1bb)",
    ]);
    assert_status(&o, 2);
    let out = stdout(&o);
    assert!(
        out.lines()
            .any(|l| l.starts_with("zbvv") && l.contains("failed")),
        "{out}"
    );
    let err = stderr(&o);
    assert!(err.contains("error in `zbvv`:"), "{err}");
    assert!(
        err.contains("error in `transpose(visoin, 1f1bb)` (2 errors):"),
        "{err}"
    );
    // No caret line runs into the next message.
    for line in err.lines().filter(|l| l.contains('^')) {
        assert!(
            line.trim_start().starts_with('|'),
            "a caret line holds only the caret: {line:?}\n{err}"
        );
    }
    assert!(
        err.contains("\n\nerror in `transpose"),
        "blank line between blocks: {err}"
    );

    let o = mpipe(&[
        "compare",
        "--json",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
        "zbvv",
    ]);
    assert_status(&o, 2);
    let v = json(&stdout(&o));
    assert_eq!(v["schedules"].as_array().unwrap().len(), 1);
    assert_eq!(v["errors"][0]["schedule"], "zbvv");
    assert_eq!(v["errors"][0]["kind"], "unknown_name");
}

#[test]
fn simulate_prints_a_table_from_a_derivation_or_a_program() {
    let o = mpipe(&[
        "simulate",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "transpose(vision, 1f1b)",
    ]);
    assert_status(&o, 0);
    let out = stdout(&o);
    assert!(out.contains("makespan"), "{out}");
    assert!(out.contains("bubble"), "{out}");
    assert!(out.contains("rendezvous semantics"), "{out}");
    assert!(out.contains("peak memory"), "{out}");
    for r in 0..4 {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{r} "))),
            "{out}"
        );
    }

    let o = mpipe_with(
        &["simulate", "--mode", "eager", "--program", "-"],
        Some(&derive("transpose(vision, 1f1b)")),
    );
    assert_status(&o, 0);
    let out = stdout(&o);
    assert!(out.contains("makespan") && out.contains("bubble"), "{out}");
    assert!(out.contains("eager semantics"), "{out}");

    let o = mpipe_with(
        &["simulate", "--json", "--program", "-"],
        Some(&derive("1f1b")),
    );
    assert_status(&o, 0);
    let v = json(&stdout(&o));
    let makespan = v["makespan"].as_f64().unwrap();
    assert!(makespan > 0.0);
    assert_eq!(v["peak_memory"].as_array().unwrap().len(), 4);
    // Each rank's idle time by cause adds up to the step less its compute. With the
    // encoder inline, rank 0 paces the pipeline: it never waits, and every other
    // rank waits mostly for the rank before it.
    let waits = v["waits"].as_array().unwrap();
    assert_eq!(waits.len(), 4);
    for (rank, w) in waits.iter().enumerate() {
        let by_peer = w["by_peer"].as_object().unwrap();
        let waiting: f64 = by_peer.values().map(|t| t.as_f64().unwrap()).sum();
        let total = waiting + w["transfer"].as_f64().unwrap() + w["done_early"].as_f64().unwrap();
        let idle = makespan - v["compute"][rank].as_f64().unwrap();
        assert!(
            (total - idle).abs() < 1e-9,
            "rank {rank}: {w} against idle {idle}"
        );
        assert!(!by_peer.contains_key(&rank.to_string()), "{w}");
        for peer in by_peer.keys() {
            let peer: usize = peer.parse().unwrap();
            assert_eq!(
                peer.abs_diff(rank),
                1,
                "1F1B ranks meet their neighbours only: {w}"
            );
        }
        if rank == 0 {
            assert_eq!(waiting, 0.0, "{w}");
        } else {
            let before = by_peer[&(rank - 1).to_string()].as_f64().unwrap();
            assert!(before > waiting / 2.0, "rank {rank}: {w}");
        }
    }
}

/// Under rendezvous with a link, transfers between stages hold both ranks, and the
/// bound counts that time; under eager semantics or without a link it does not. The
/// bound follows the link the program is timed with (`--latency`), and the step is
/// never below it.
#[test]
fn the_bound_counts_transfers_only_when_they_hold_the_ranks() {
    let program = derive("1f1b");
    let bound = |extra: &[&str]| {
        let mut args = vec!["simulate", "--json", "--program", "-"];
        args.extend_from_slice(extra);
        let o = mpipe_with(&args, Some(&program));
        assert_status(&o, 0);
        let v = json(&stdout(&o));
        let (b, t) = (
            v["lower_bound"].as_f64().unwrap(),
            v["makespan"].as_f64().unwrap(),
        );
        assert!(t >= b - 1e-9, "{extra:?}: makespan {t} below the bound {b}");
        b
    };
    let free = bound(&[]);
    let linked = bound(&["--latency", "1"]);
    let eager = bound(&["--latency", "1", "--mode", "eager"]);
    // 4 ranks: each sends 8 activations or gradients to a neighbour, 1 each.
    assert!(linked >= free + 8.0 * 4.0 / 4.0 - 1e-9, "{free} {linked}");
    assert_eq!(eager, free);
    let o = mpipe_with(
        &["simulate", "--latency", "1", "--program", "-"],
        Some(&program),
    );
    assert_status(&o, 0);
    assert!(stdout(&o).contains("with transfers 8"), "{}", stdout(&o));
}

#[test]
fn trace_writes_one_track_per_rank() {
    let dir = TempDir::new("trace");
    let file = dir.path("trace.json");
    let o = mpipe(&[
        "trace",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "transpose(vision, 1f1b)",
        "-o",
        file.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let v = json(&std::fs::read_to_string(&file).unwrap());
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let mut names: Vec<(u64, String)> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    names.sort();
    let expected: Vec<(u64, String)> = (0..4).map(|r| (r, format!("rank {r}"))).collect();
    assert_eq!(names, expected);
    let complete: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(!complete.is_empty());
    assert!(complete.iter().all(|e| e["tid"].as_u64().unwrap() < 4));
    // And a memory track per rank.
    for r in 0..4 {
        let name = format!("memory rank {r}");
        let samples = events
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == name.as_str())
            .count();
        assert!(samples > 2, "{name}: {samples} samples");
    }
}

/// Write the simulated trace of `expr` on `model` (with its program embedded when
/// `embed`) to `file`.
fn write_trace(model: &str, expr: &str, file: &Path, embed: bool) {
    let mut args = vec![
        "trace",
        "--model",
        model,
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        expr,
        "-o",
        file.to_str().unwrap(),
    ];
    if embed {
        args.push("--embed-program");
    }
    assert_status(&mpipe(&args), 0);
}

#[test]
fn calibrate_measures_a_simulated_trace_back_exactly() {
    let dir = TempDir::new("calibrate");
    let trace = dir.path("trace.json");
    let model = profile("qwen2vl-7b.toml");
    write_trace(&model, "transpose(vision, zbv)", &trace, true);
    let scaled = dir.path("measured.toml");
    let calibrated = dir.path("calibrated.json");
    let o = mpipe(&[
        "calibrate",
        trace.to_str().unwrap(),
        "--model",
        &model,
        "--units",
        "--write-profile",
        scaled.to_str().unwrap(),
        "-o",
        calibrated.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let out = stdout(&o);
    // Every family's measured / program ratio is 1, the link is the profile's, and
    // the prediction is the measured step.
    for family in ["llm layers", "encoder vision"] {
        let line = out
            .lines()
            .find(|l| l.starts_with(family))
            .unwrap_or_else(|| panic!("no row for {family}:\n{out}"));
        assert_eq!(line.matches("1.000").count(), 3, "{line}");
    }
    assert!(out.contains("link: latency 0.01, bandwidth 0.2 ("), "{out}");
    assert!(out.contains("(+0.0%)") || out.contains("(-0.0%)"), "{out}");
    assert!(out.contains("llm.0"), "--units lists the units:\n{out}");
    // The scaled profile is the same model, and the calibrated program runs.
    let text = std::fs::read_to_string(&scaled).unwrap();
    let back = mpipe_core::profile::Profile::from_toml_str(&text).expect("a valid profile");
    let orig =
        mpipe_core::profile::Profile::from_toml_str(&std::fs::read_to_string(&model).unwrap())
            .unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    assert!(close(back.llm.forward, orig.llm.forward));
    assert!(close(back.llm.weight, orig.llm.weight));
    assert!(close(back.encoders[0].backward, orig.encoders[0].backward));
    assert_status(&mpipe(&["check", calibrated.to_str().unwrap()]), 0);
}

#[test]
fn calibrate_json_reports_every_unit() {
    let dir = TempDir::new("calibrate-json");
    let trace = dir.path("trace.json");
    write_trace(&heavy(), "1f1b", &trace, true);
    let o = mpipe(&["calibrate", trace.to_str().unwrap(), "--json"]);
    assert_status(&o, 0);
    let v = json(&stdout(&o));
    let units = v["calibration"]["units"].as_object().expect("units");
    assert_eq!(units.len(), 5, "vision and 4 stages: {units:?}");
    // 1f1b fuses the backward: BW measured, with its 8 micro-batches.
    assert_eq!(units["llm.0"]["bw"]["samples"], 8);
    assert!(
        v["calibration"]["link"].is_null(),
        "free transfers take no time"
    );
    let step = v["calibration"]["step"].as_f64().unwrap();
    let predicted = v["predicted_step"].as_f64().unwrap();
    assert!(
        (step - predicted).abs() <= 1e-9 * step,
        "{step} vs {predicted}"
    );
}

#[test]
fn calibrate_says_what_is_missing() {
    let dir = TempDir::new("calibrate-errors");
    let trace = dir.path("trace.json");
    write_trace(&heavy(), "1f1b", &trace, false);
    std::fs::write(dir.path("ran.json"), derive("1f1b")).unwrap();
    // No embedded program and none given.
    let o = mpipe(&["calibrate", trace.to_str().unwrap()]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("--program"), "{}", stderr(&o));
    // Another program than the one that ran.
    let other = dir.path("other.json");
    std::fs::write(&other, derive("zbv")).unwrap();
    let o = mpipe(&[
        "calibrate",
        trace.to_str().unwrap(),
        "--program",
        other.to_str().unwrap(),
    ]);
    assert_status(&o, 2);
    assert!(
        stderr(&o).contains("give the trace of this program's run"),
        "{}",
        stderr(&o)
    );
    // A profile without the run's encoder is not the one the program came from.
    let o = mpipe(&[
        "calibrate",
        trace.to_str().unwrap(),
        "--program",
        dir.path("ran.json").to_str().unwrap(),
        "--model",
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs/guide/examples/llm-only.toml")
            .display()
            .to_string(),
        "--write-profile",
        dir.path("p.toml").to_str().unwrap(),
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("(vision)"), "{}", stderr(&o));
    assert!(!dir.path("p.toml").exists());
    // --write-profile needs the profile to scale; every problem is reported.
    let o = mpipe(&[
        "calibrate",
        dir.path("missing.json").to_str().unwrap(),
        "--write-profile",
        dir.path("p.toml").to_str().unwrap(),
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("cannot read trace"), "{err}");
    assert!(err.contains("--model"), "{err}");
    assert!(err.contains("2 errors"), "{err}");
}

#[test]
fn svg_writes_a_gantt_chart() {
    let dir = TempDir::new("svg");
    let file = dir.path("chart.svg");
    let o = mpipe(&[
        "svg",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "transpose(vision, zbv)",
        "-o",
        file.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("<svg"), "{}", &text[..text.len().min(200)]);
    assert!(text.trim_end().ends_with("</svg>"));
    for r in 0..4 {
        assert!(text.contains(&format!("rank {r}")), "row label rank {r}");
    }
}

#[test]
fn a_misspelt_encoder_gets_a_caret_and_a_suggestion() {
    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "transpose(visoin, 1f1b)",
    ]);
    assert_status(&o, 2);
    assert!(stdout(&o).is_empty(), "no program on failure");
    let err = stderr(&o);
    assert!(err.contains("did you mean `vision`?"), "{err}");
    assert!(err.contains("transpose(visoin, 1f1b)"), "{err}");
    // The caret sits under `visoin`.
    let lines: Vec<&str> = err.lines().collect();
    let src = lines
        .iter()
        .position(|l| l.contains("transpose(visoin, 1f1b)"))
        .unwrap();
    let caret = lines[src + 1];
    let at = caret
        .find('^')
        .expect("a caret line follows the expression");
    assert_eq!(&lines[src][at..at + 6], "visoin", "{err}");
    assert_eq!(caret.matches('^').count(), 6, "{err}");
}

#[test]
fn an_unknown_schedule_lists_the_valid_names() {
    let o = mpipe(&[
        "simulate",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "pipedream",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("unknown schedule `pipedream`"), "{err}");
    for name in ["gpipe", "1f1b", "zbh1", "zbv", "transpose"] {
        assert!(err.contains(name), "lists {name}: {err}");
    }
}

#[test]
fn derive_json_reports_errors_as_json() {
    let o = mpipe(&[
        "derive",
        "--json",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "transpose(visoin, 1f1b)",
    ]);
    assert_status(&o, 2);
    let v = json(&stdout(&o));
    let e = &v["errors"][0];
    assert_eq!(e["kind"], "unknown_name");
    assert_eq!(e["line"], 1);
    assert_eq!(e["column"], 11, "1-based, under `visoin`");
    assert_eq!(e["length"], 6);
    assert!(e["message"].as_str().unwrap().contains("visoin"));
}

#[test]
fn a_missing_profile_is_named() {
    let dir = TempDir::new("missing-profile");
    let path = dir.path("no-such-profile.toml");
    let o = mpipe(&[
        "derive",
        "--model",
        path.to_str().unwrap(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains(path.to_str().unwrap()), "{err}");
    assert!(err.contains("cannot read profile"), "{err}");
}

#[test]
fn a_bad_profile_key_is_named_with_every_other_problem() {
    let dir = TempDir::new("bad-profile");
    let path = dir.path("typo.toml");
    let text = std::fs::read_to_string(heavy())
        .unwrap()
        .replace("\nforward = 1.0", "\nforwrd = 1.0");
    std::fs::write(&path, text).unwrap();
    let o = mpipe(&[
        "compare",
        "--model",
        path.to_str().unwrap(),
        "--ranks",
        "0",
        "--microbatches",
        MBS,
        "1f1b",
        "zbv(",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("llm.forwrd"), "the key: {err}");
    assert!(err.contains("did you mean `forward`"), "{err}");
    assert!(err.contains(path.to_str().unwrap()), "the file: {err}");
    // Reported together with the other mistakes of the same run.
    assert!(err.contains("--ranks must be at least 1"), "{err}");
    assert!(err.contains("zbv("), "the expression's syntax error: {err}");
}

#[test]
fn zero_ranks_or_micro_batches_are_clear_errors() {
    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        "0",
        "--microbatches",
        "0",
        "1f1b",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(err.contains("--ranks must be at least 1"), "{err}");
    assert!(err.contains("--microbatches must be at least 1"), "{err}");
    assert!(!err.contains('^'), "not blamed on the expression: {err}");

    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        "-2",
        "--microbatches",
        MBS,
        "1f1b",
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("--ranks"), "{}", stderr(&o));
}

#[test]
fn steps_too_large_to_derive_are_usage_errors_not_hangs() {
    let o = mpipe(&[
        "simulate",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        "10000000",
        "auto",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(
        err.contains("--microbatches 10000000 is over the 65536"),
        "{err}"
    );
    assert!(!err.contains('^'), "not blamed on the expression: {err}");
    let o = mpipe(&[
        "compare",
        "--model",
        &heavy(),
        "--ranks",
        "16",
        "--microbatches",
        "65536",
        "1f1b",
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("16 x 65536 is over"), "{}", stderr(&o));
}

#[test]
fn a_closed_stdout_is_not_a_panic() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mpipe"))
        .args([
            "derive",
            "--model",
            &heavy(),
            "--ranks",
            RANKS,
            "--microbatches",
            "64",
            "1f1b",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away at once
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert!(o.status.code().is_some(), "not killed by a signal");
}

/// Import `deadlock_2ranks.csv` (an order that hangs under rendezvous) into `dir`:
/// the program is written even though it is invalid, and import exits 1.
fn import_deadlock(dir: &TempDir) -> PathBuf {
    let csv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("mpipe-core/tests/torch_csv/deadlock_2ranks.csv");
    let out = dir.path("imported.json");
    let o = mpipe(&[
        "import",
        "--format",
        "torch-csv",
        csv.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_status(&o, 1);
    assert!(
        out.exists(),
        "the program is written even though it is invalid"
    );
    out
}

/// A torch schedule CSV whose order hangs under rendezvous (both ranks send first,
/// as users report in pytorch/pytorch#172668): import writes the program and exits 1
/// naming the deadlock, and `check` on the imported program says which rank and
/// action.
#[test]
fn imported_torch_csv_that_deadlocks_is_explained() {
    let dir = TempDir::new("torch-csv");
    let out = import_deadlock(&dir);
    let o = mpipe(&["check", out.to_str().unwrap()]);
    assert_status(&o, 1);
    let err = stderr(&o);
    assert!(
        err.contains("rule 5 (termination): rank 0, action 3 `SEND act(llm.0,1)->1`"),
        "{err}"
    );
    assert!(
        err.contains("rank 1, action 3 `SEND grad(llm.1,0)->0`"),
        "{err}"
    );
}

/// Each rank's actions whose op `keep` accepts, as `op unit mb` lines, in list order.
fn rank_actions(path: &Path, keep: impl Fn(&str) -> bool) -> Vec<Vec<String>> {
    let v = json(&std::fs::read_to_string(path).unwrap());
    v["programs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|list| {
            list.as_array()
                .unwrap()
                .iter()
                .filter(|a| keep(a["op"].as_str().unwrap_or("")))
                .map(|a| format!("{} {} {}", a["op"], a["unit"], a["mb"]))
                .collect()
        })
        .collect()
}

/// `refine` on the imported program that hangs: the same compute order, with its
/// transfers derived again, passes `check`; standard error says what happened.
#[test]
fn refine_fixes_an_imported_order_that_hangs() {
    let dir = TempDir::new("refine");
    let imported = import_deadlock(&dir);
    let fixed = dir.path("fixed.json");
    let o = mpipe(&[
        "refine",
        imported.to_str().unwrap(),
        "-o",
        fixed.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let err = stderr(&o);
    assert!(
        err.contains("the input cannot run as it is (it does not run to completion: deadlock"),
        "{err}"
    );
    assert!(
        err.contains("with its transfers derived again, makespan"),
        "{err}"
    );
    let o = mpipe(&["check", fixed.to_str().unwrap()]);
    assert_status(&o, 0);
    // Same compute, in the same order on every rank.
    let compute = |op: &str| !matches!(op, "SEND" | "RECV");
    assert_eq!(
        rank_actions(&imported, compute),
        rank_actions(&fixed, compute)
    );
}

/// `refine` on a program of compute tasks alone (a hand-written order): it says so,
/// places every transfer, and the result passes `check` with each rank's forwards and
/// backwards in the order written.
#[test]
fn refine_places_every_transfer_of_a_compute_only_program() {
    let dir = TempDir::new("refine-compute-only");
    let input = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/guide/examples/compute-only.json");
    let placed = dir.path("placed.json");
    let o = mpipe(&[
        "refine",
        input.to_str().unwrap(),
        "-o",
        placed.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let err = stderr(&o);
    assert!(
        err.contains(
            "compute only (no transfers in the input); with its transfers placed, makespan"
        ),
        "{err}"
    );
    let o = mpipe(&["check", placed.to_str().unwrap()]);
    assert_status(&o, 0);
    let stages = |op: &str| matches!(op, "F" | "B");
    let before = rank_actions(&input, stages);
    assert_eq!(before.len(), 2);
    assert_eq!(before, rank_actions(&placed, stages));
    let transfers: usize = rank_actions(&placed, |op| matches!(op, "SEND" | "RECV"))
        .iter()
        .map(Vec::len)
        .sum();
    // 3 micro-batches x (activation + gradient) x (send + receive).
    assert_eq!(transfers, 12);
}

/// `refine --order N` searches the compute order too: faster than `refine` alone
/// where the order left waits (a transposed ZB-V with the encoder's forwards placed
/// late, in the steady state, here), a valid program, and the budget checked (1 to
/// 100000).
#[test]
fn refine_order_searches_the_compute_order() {
    let plain = derive("transpose(vision, zbv, place = late)");
    let h = heavy();
    let dir = TempDir::new("refine-order");
    let (kept, moved) = (dir.path("kept.json"), dir.path("moved.json"));
    let o = mpipe_with(
        &["refine", "-", "--model", &h, "-o", kept.to_str().unwrap()],
        Some(&plain),
    );
    assert_status(&o, 0);
    let o = mpipe_with(
        &[
            "refine",
            "-",
            "--model",
            &h,
            "--order",
            "200",
            "-o",
            moved.to_str().unwrap(),
        ],
        Some(&plain),
    );
    assert_status(&o, 0);
    let err = stderr(&o);
    assert!(err.contains("makespan"), "{err}");
    assert_status(&mpipe(&["check", moved.to_str().unwrap()]), 0);
    let time = |f: &Path| {
        // The profile has no link: the program alone times the same.
        let o = mpipe(&["simulate", "--program", f.to_str().unwrap(), "--json"]);
        assert_status(&o, 0);
        json(&stdout(&o))["makespan"].as_f64().unwrap()
    };
    assert!(
        time(&moved) < time(&kept),
        "{} vs {}",
        time(&moved),
        time(&kept)
    );
    for bad in ["0", "100001", "many"] {
        let o = mpipe_with(&["refine", "-", "--order", bad], Some(&plain));
        assert_status(&o, 2);
        assert!(stderr(&o).contains("--order"), "{}", stderr(&o));
    }
}

/// `refine` reads standard input, writes the program to standard output, takes the
/// link and memory limit from `--model`, keeps a program that is already refined,
/// and reports every bad argument at once (status 2).
#[test]
fn refine_reads_stdin_keeps_refined_programs_and_reports_bad_input() {
    let text = derive("refine(zbh1)");
    let h = heavy();
    let o = mpipe_with(&["refine", "-", "--model", &h], Some(&text));
    assert_status(&o, 0);
    assert_eq!(json(&stdout(&o)), json(&text));
    assert!(stderr(&o).contains("written unchanged"), "{}", stderr(&o));

    let plain = derive("zbh1");
    let o = mpipe_with(&["refine", "-", "--model", &h], Some(&plain));
    assert_status(&o, 0);
    assert!(stderr(&o).contains("makespan"), "{}", stderr(&o));
    let dir = TempDir::new("refine-stdin");
    let out = dir.path("r.json");
    std::fs::write(&out, stdout(&o)).unwrap();
    assert_status(&mpipe(&["check", out.to_str().unwrap()]), 0);

    let o = mpipe(&[
        "refine",
        "no-such-file.json",
        "--model",
        "no-such-profile.toml",
        "--bandwidth",
        "0",
    ]);
    assert_status(&o, 2);
    let err = stderr(&o);
    assert!(
        err.contains("cannot read program no-such-file.json"),
        "{err}"
    );
    assert!(
        err.contains("cannot read profile no-such-profile.toml"),
        "{err}"
    );
    assert!(
        err.contains("--bandwidth must be a number >= 1e-9"),
        "{err}"
    );
}

/// `auto` in `compare`: the row names the choice, and the JSON gives it as `expr`.
#[test]
fn compare_names_what_auto_chose() {
    let h = heavy();
    let o = mpipe(&[
        "compare",
        "--model",
        &h,
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
        "auto",
    ]);
    assert_status(&o, 0);
    let row = stdout(&o)
        .lines()
        .find(|l| l.starts_with("auto = "))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no auto row:\n{}", stdout(&o)));
    let o = mpipe(&[
        "compare",
        "--model",
        &h,
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "auto",
        "--json",
    ]);
    assert_status(&o, 0);
    let v = json(&stdout(&o));
    let expr = v["schedules"][0]["expr"].as_str().unwrap().to_string();
    assert_ne!(expr, "auto");
    assert!(
        row.starts_with(&format!("auto = {expr} ")),
        "{row} vs {expr}"
    );
    // The choice derives on its own to the same step time.
    let o = mpipe(&[
        "simulate",
        "--model",
        &h,
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        &expr,
        "--json",
    ]);
    assert_status(&o, 0);
    assert_eq!(json(&stdout(&o))["makespan"], v["schedules"][0]["makespan"]);
}

/// `mpipe evaluate` on a profile without an `# evaluate:` line needs a size.
#[test]
fn evaluate_needs_a_size() {
    let o = mpipe(&["evaluate", &heavy()]);
    assert_status(&o, 2);
    assert!(
        stderr(&o).contains("--ranks and --microbatches"),
        "{}",
        stderr(&o)
    );
    let o = mpipe(&[
        "evaluate",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
    ]);
    assert_status(&o, 0);
    assert!(stdout(&o).contains("auto = "), "{}", stdout(&o));
}

/// Inputs found by fuzzing the tool: each is refused with a message and the usual
/// exit status, at once, where before it panicked, ran out of memory or ran for
/// minutes.
#[test]
fn oversized_and_malformed_inputs_are_refused_quickly() {
    let dir = TempDir::new("limits");
    let valid = derive("1f1b");
    let started = std::time::Instant::now();

    // A program whose prefetch names a micro-batch it does not have.
    let mut v = json(&valid);
    v["prefetch"] = serde_json::json!([{"unit": v["units"][0]["name"].clone(), "mb": 99}]);
    let bad = dir.path("prefetch.json");
    std::fs::write(&bad, v.to_string()).unwrap();
    let o = mpipe(&["refine", bad.to_str().unwrap(), "-o", "-"]);
    assert_status(&o, 1);
    assert!(stderr(&o).contains("prefetch entry 0"), "{}", stderr(&o));

    // A program that claims billions of ranks or micro-batches.
    for (key, value) in [("ranks", 4_000_000_000u64), ("microbatches", 1 << 40)] {
        let mut v = json(&valid);
        v[key] = value.into();
        let f = dir.path(&format!("{key}.json"));
        std::fs::write(&f, v.to_string()).unwrap();
        for cmd in ["simulate", "svg", "trace"] {
            let out = dir.path("out");
            let mut args = vec![cmd, "--program", f.to_str().unwrap()];
            if cmd != "simulate" {
                args.extend(["-o", out.to_str().unwrap()]);
            }
            let o = mpipe(&args);
            assert_status(&o, 1);
            assert!(stderr(&o).contains("cannot be simulated"), "{}", stderr(&o));
        }
        let o = mpipe(&["refine", f.to_str().unwrap(), "-o", "-"]);
        assert_status(&o, 1);
    }

    // A chart wider than any screen.
    let o = mpipe(&[
        "svg",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
        "-o",
        dir.path("w.svg").to_str().unwrap(),
        "--width",
        "4294967296",
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("--width must be"), "{}", stderr(&o));

    // A link so slow that every time is infinite.
    let o = mpipe(&[
        "simulate",
        "--model",
        &heavy(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
        "1f1b",
        "--latency",
        "1e308",
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("--latency must be"), "{}", stderr(&o));

    // A bad link argument is reported without deriving first: this size (the
    // largest allowed) takes about 5 s to derive on a 2-core VM, the refusal about
    // 10 ms, so the bound below tells them apart with room for a loaded machine.
    let quick = std::time::Instant::now();
    let o = mpipe(&[
        "simulate",
        "--model",
        &heavy(),
        "--ranks",
        "8",
        "--microbatches",
        "65536",
        "1f1b",
        "--bandwidth",
        "0",
    ]);
    assert_status(&o, 2);
    assert!(stderr(&o).contains("--bandwidth must be"), "{}", stderr(&o));
    assert!(quick.elapsed().as_secs() < 2, "{:?}", quick.elapsed());
    assert!(started.elapsed().as_secs() < 60);
}

/// `mpipe evaluate` fails (exit 1, with the reason) when `auto` has no row.
#[test]
fn evaluate_fails_when_auto_gives_no_schedule() {
    let dir = TempDir::new("evaluate");
    // A memory limit below the parameters alone: nothing fits.
    let text = std::fs::read_to_string(heavy()).unwrap() + "\n[memory]\nlimit = 1.0\n";
    let f = dir.path("tight.toml");
    std::fs::write(&f, text).unwrap();
    let o = mpipe(&[
        "evaluate",
        f.to_str().unwrap(),
        "--ranks",
        RANKS,
        "--microbatches",
        MBS,
    ]);
    assert_status(&o, 1);
    assert!(
        stderr(&o).contains("`auto` gave no schedule")
            && stderr(&o).contains("over memory.limit = 1"),
        "{}",
        stderr(&o)
    );
}

/// Issue 37 (item 5 and the bug behind it): with zero-cost LLM forwards (the
/// profile's `llm.forward = 0`, or a program whose LLM units have `F = 0`), the
/// lowering put a SEND after zero-length tasks that end when it is ready, past the
/// consumer of a RECV it must come before: `transpose` and `refine` failed with
/// "internal error: cannot place RECV". Each now gives a program that runs.
#[test]
fn zero_cost_forwards_lower_without_an_internal_error() {
    let dir = TempDir::new("zero-forward");
    let text = std::fs::read_to_string(heavy()).unwrap();
    let at = text.find("[llm]").unwrap();
    let (head, llm) = text.split_at(at);
    let llm = llm.replacen("forward = 1.0", "forward = 0.0", 1);
    assert!(llm.contains("forward = 0.0"), "{llm}");
    let model = dir.path("zero-forward.toml");
    std::fs::write(&model, format!("{head}{llm}")).unwrap();
    let model = model.to_str().unwrap();
    for (ranks, mbs) in [("2", "4"), ("2", "8"), ("4", "8")] {
        for expr in [
            "transpose(vision, 1f1b)",
            "transpose(vision, zbv)",
            "transpose(vision, dualpipev)",
            "refine(transpose(vision, 1f1b))",
        ] {
            let o = mpipe(&[
                "simulate",
                "--model",
                model,
                "--ranks",
                ranks,
                "--microbatches",
                mbs,
                expr,
            ]);
            assert_status(&o, 0);
            assert!(stdout(&o).contains("makespan"), "{expr}: {}", stdout(&o));
        }
    }
    // The same through `refine` of a program file whose LLM forwards cost nothing.
    let program = dir.path("p.json");
    let o = mpipe(&[
        "derive",
        "--model",
        &heavy(),
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "transpose(vision, 1f1b)",
        "-o",
        program.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    let mut v = json(&std::fs::read_to_string(&program).unwrap());
    for u in v["units"].as_array_mut().unwrap() {
        if u["name"].as_str().unwrap().starts_with("llm") {
            u["cost"]["F"] = 0.0.into();
        }
    }
    std::fs::write(&program, v.to_string()).unwrap();
    let refined = dir.path("r.json");
    let o = mpipe(&[
        "refine",
        program.to_str().unwrap(),
        "-o",
        refined.to_str().unwrap(),
    ]);
    assert_status(&o, 0);
    assert!(!stderr(&o).contains("internal error"), "{}", stderr(&o));
    assert_status(&mpipe(&["check", refined.to_str().unwrap()]), 0);
}
