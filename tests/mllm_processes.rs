//! The example model's training loop ([`train_rank`]) over other transports than
//! the thread communicator, and traces of real runs:
//!
//! - over loopback TCP (ranks as threads of this test): bitwise the same
//!   parameters, gradients and losses as with ranks as threads, and the trace
//!   gathered over the wire equals the one built from the ranks' outcomes;
//! - the trace of a real step is valid trace JSON with one track per rank, whose
//!   events per rank are the derived program's actions, in its order and in time
//!   order;
//! - as separate OS processes (the built `mllm` example with `--processes`):
//!   training gives bitwise the parameters of the threads run, writes the trace;
//!   a rank that exits mid-step makes every other rank exit within 10 s naming it;
//!   a multi-process run killed that way resumes from its checkpoint to the same
//!   parameters as an uninterrupted run.

use mpipe::core::program::{ActionRef, CollKind, Dir, Program};
use mpipe::runtime::exec::Executor;
use mpipe::runtime::host::tcp::{self, TcpComm};
use mpipe::runtime::host::threads::ThreadComm;
use mpipe::runtime::host::Mode;
use mpipe_mllm::pipeline::{
    gather_timeline, outcomes_timeline, param_checksums, real_trace, train, train_rank,
    Checkpointing, RankOutcome, Train,
};
use mpipe_mllm::{AdamConfig, Config, Mllm};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;

mpipe::schedule! { mod t1f1b { model = "examples/mllm.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
mpipe::schedule! { mod tzbv { model = "examples/mllm.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }

/// The example's training settings (examples/mllm.rs: `config`, lr 3e-3, data seed 1).
fn example_training(chunks: usize, steps: u64) -> Train {
    Train {
        cfg: Config {
            layers: 8,
            vision_layers: 2,
            stages: 4 * chunks,
            trainable_encoder: true,
            ..Config::default()
        },
        adam: AdamConfig {
            lr: 3e-3,
            ..AdamConfig::default()
        },
        data_seed: 1,
        steps,
        update: true,
        timeout: Duration::from_secs(10),
        mode: Mode::Rendezvous,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn ok<T>(outcomes: Vec<Result<T, String>>) -> Vec<T> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn tcp_ranks_train_bitwise_like_thread_ranks() {
    type Pair = (&'static str, &'static str, usize);
    let cases: [Pair; 2] = [
        (t1f1b::EXPR, t1f1b::PROGRAM_JSON, 1),
        (tzbv::EXPR, tzbv::PROGRAM_JSON, 2),
    ];
    for (expr, json, chunks) in cases {
        let program = Program::from_json(json).unwrap();
        let t = example_training(chunks, 3);
        let threads = ok(if chunks == 1 {
            train(
                &program,
                &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| t1f1b::run(r, e),
                &t,
                None,
            )
        } else {
            train(
                &program,
                &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| tzbv::run(r, e),
                &t,
                None,
            )
        });
        let ck = Checkpointing::default();
        let over_tcp = ok(tcp::run_ranks(4, t.timeout, |mut c: TcpComm| {
            let o = if chunks == 1 {
                train_rank(
                    &mut c,
                    &program,
                    &|r: usize, e: &mut Executor<'_, TcpComm, Mllm>| t1f1b::run(r, e),
                    &t,
                    &ck,
                    None,
                )?
            } else {
                train_rank(
                    &mut c,
                    &program,
                    &|r: usize, e: &mut Executor<'_, TcpComm, Mllm>| tzbv::run(r, e),
                    &t,
                    &ck,
                    None,
                )?
            };
            // The trace gathered on rank 0 over the wire.
            let gathered = gather_timeline(&mut c, &o)?;
            Ok::<_, mpipe_mllm::pipeline::TrainError>((o, gathered))
        }));
        let gathered = over_tcp[0].1.clone().expect("rank 0 gathers the trace");
        let over_tcp: Vec<RankOutcome> = over_tcp.into_iter().map(|p| p.0).collect();
        assert_eq!(
            gathered,
            outcomes_timeline(&over_tcp),
            "{expr}: the trace crossed the wire exactly"
        );
        for (a, b) in threads.iter().zip(&over_tcp) {
            let r = a.rank;
            assert_eq!(a.params.len(), b.params.len());
            for ((u, x), (_, y)) in a.params.iter().zip(&b.params) {
                assert_eq!(bits(x), bits(y), "{expr}: rank {r}, unit {u}'s parameters");
            }
            for ((u, x), (_, y)) in a.grads.iter().zip(&b.grads) {
                assert_eq!(bits(x), bits(y), "{expr}: rank {r}, unit {u}'s gradients");
            }
            assert_eq!(
                bits(&a.losses),
                bits(&b.losses),
                "{expr}: rank {r}'s losses"
            );
            assert_eq!(a.peaks, b.peaks, "{expr}: rank {r}'s memory");
        }
    }
}

/// The trace event name of an action (mpipe-core's `render::trace` format).
fn event_name(a: ActionRef) -> String {
    match a {
        ActionRef::Compute(c) => format!("{} {} mb{}", c.op.as_str(), c.unit, c.mb),
        ActionRef::P2p(x) => {
            let (op, arrow) = match x.dir {
                Dir::Send => ("SEND", "->"),
                Dir::Recv => ("RECV", "<-"),
            };
            format!(
                "{op} {} {} mb{} {arrow} {}",
                x.tensor.as_str(),
                x.unit,
                x.mb,
                x.peer
            )
        }
        ActionRef::Coll(c) => {
            let op = match c.kind {
                CollKind::Bcast => "BCAST",
                CollKind::Reduce => "REDUCE",
            };
            format!("{op} {} root {}", c.unit, c.root)
        }
    }
}

/// Checks a real trace of `program`: valid JSON, one named track per rank, and
/// per rank the program's actions, in program order and in time order.
fn check_trace(program: &Program, text: &str) {
    let v: Value = serde_json::from_str(text).expect("the trace is valid JSON");
    let events = v["traceEvents"].as_array().expect("traceEvents");
    let mut tracks: BTreeMap<u64, String> = BTreeMap::new();
    let mut per_rank: BTreeMap<u64, Vec<(f64, f64, String)>> = BTreeMap::new();
    for e in events {
        match e["ph"].as_str() {
            Some("M") if e["name"] == "thread_name" => {
                tracks.insert(
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                );
            }
            Some("X") => per_rank
                .entry(e["tid"].as_u64().unwrap())
                .or_default()
                .push((
                    e["ts"].as_f64().expect("ts"),
                    e["dur"].as_f64().expect("dur"),
                    e["name"].as_str().unwrap().to_string(),
                )),
            _ => {}
        }
    }
    let ranks: Vec<u64> = (0..program.ranks as u64).collect();
    assert_eq!(tracks.keys().copied().collect::<Vec<_>>(), ranks);
    assert_eq!(per_rank.keys().copied().collect::<Vec<_>>(), ranks);
    for (r, name) in &tracks {
        assert_eq!(name, &format!("rank {r}"));
    }
    for (r, evs) in &per_rank {
        let want: Vec<String> = program.programs[*r as usize]
            .iter()
            .map(|a| event_name(a.view()))
            .collect();
        let got: Vec<String> = evs.iter().map(|e| e.2.clone()).collect();
        assert_eq!(got, want, "rank {r}: the events are the program's actions");
        for w in evs.windows(2) {
            assert!(
                w[0].0 <= w[1].0,
                "rank {r}: `{}` at {} µs before `{}` at {} µs",
                w[1].2,
                w[1].0,
                w[0].2,
                w[0].0
            );
        }
        assert!(evs.iter().all(|e| e.0 >= 0.0 && e.1 >= 0.0));
    }
}

#[test]
fn the_trace_of_a_real_step_follows_the_program() {
    let program = Program::from_json(tzbv::PROGRAM_JSON).unwrap();
    let outcomes = ok(train(
        &program,
        &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| tzbv::run(r, e),
        &example_training(2, 2),
        None,
    ));
    let timeline = outcomes_timeline(&outcomes);
    let text = real_trace(&program, &timeline, "zbv-t as run");
    check_trace(&program, &text);
    // Seconds became microseconds: the step took more than 100 µs and less than 10 s.
    let end = timeline.makespan();
    assert!(end > 1e-4 && end < 10.0, "{end} s");
}

// ---------------------------------------------------------------------------
// Separate processes: the built example.

fn example() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| common::example(&[]))
}

/// Runs the example with `args` and extra environment; returns its output and
/// how long it took.
fn run_example(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let mut cmd = Command::new(example());
    cmd.args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_PORT")
        .env_remove("MPIPE_FAULT_RANK")
        .env_remove("MPIPE_FAULT_STEP");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let began = Instant::now();
    let out = cmd.output().expect("the example runs");
    (out, began.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `unit=checksum` pairs of every `parameter checksums:` line.
fn checksums(stdout: &str) -> BTreeMap<String, String> {
    stdout
        .lines()
        .filter_map(|l| l.split("parameter checksums: ").nth(1))
        .flat_map(|s| s.split_whitespace())
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The checksums of the example's default schedule trained on threads.
fn thread_checksums(steps: u64) -> BTreeMap<String, String> {
    let program = Program::from_json(t1f1b::PROGRAM_JSON).unwrap();
    let outcomes = ok(train(
        &program,
        &|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| t1f1b::run(r, e),
        &example_training(1, steps),
        None,
    ));
    let params: Vec<(usize, Vec<f32>)> = outcomes.into_iter().flat_map(|o| o.params).collect();
    param_checksums(&params)
        .into_iter()
        .map(|(u, h)| (program.units[u].name.clone(), format!("{h:016x}")))
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mpipe-test-procs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn processes_train_like_threads_and_write_the_trace() {
    let dir = scratch("train");
    let (trace, sim) = (dir.join("real.json"), dir.join("sim.json"));
    let (out, took) = run_example(
        &[
            "--processes",
            "--steps",
            "3",
            "--trace",
            trace.to_str().unwrap(),
            "--trace-sim",
            sim.to_str().unwrap(),
        ],
        &[],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("[rank 3] step 3/3  loss"), "{stdout}");
    for r in 0..4 {
        assert!(
            stdout.contains(&format!("[rank {r}] done: peak live activations")),
            "{stdout}"
        );
    }
    assert_eq!(
        checksums(&stdout),
        thread_checksums(3),
        "processes and threads train bitwise alike"
    );
    let program = Program::from_json(t1f1b::PROGRAM_JSON).unwrap();
    check_trace(&program, &std::fs::read_to_string(&trace).unwrap());
    let sim: Value = serde_json::from_str(&std::fs::read_to_string(&sim).unwrap()).unwrap();
    assert!(sim["traceEvents"].as_array().unwrap().len() > 100);
    eprintln!("3 steps on 4 processes: {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_process_exiting_mid_step_is_named_by_every_other_rank() {
    let (out, took) = run_example(
        &["--processes", "--steps", "3"],
        &[("MPIPE_FAULT_RANK", "2")],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        took < Duration::from_secs(10),
        "the ranks took {took:?} to stop\n{stderr}"
    );
    assert!(
        stderr.contains(
            "[rank 2] rank 2: exiting with code 3 in the middle of step 1 (counted from 0)"
        ),
        "{stderr}"
    );
    for r in [0, 1, 3] {
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&format!("[rank {r}] rank {r}")))
            .unwrap_or_else(|| panic!("rank {r} reports its error\n{stderr}"));
        // (Closed or reset, depending on what was left unread in its sockets.)
        assert!(line.contains("rank 2 failed: its connection"), "{line}");
        assert!(line.contains(", action "), "names its own action: {line}");
    }
    assert!(
        stderr.contains("mpipe-run: rank 2 failed first (exit code 3)"),
        "{stderr}"
    );
    assert!(!stderr.contains("killed by mpipe-run"), "{stderr}");
    eprintln!("fault to exit: {took:?}");
}

#[test]
fn a_killed_multi_process_run_resumes_bitwise() {
    let dir = scratch("resume");
    let ck = dir.join("ck");
    let ck = ck.to_str().unwrap();
    // Checkpoints after 2 and 4 steps; rank 1 dies halfway through step 5
    // (counted from 0: the sixth).
    let (out, _) = run_example(
        &[
            "--processes",
            "--steps",
            "8",
            "--checkpoint",
            ck,
            "--checkpoint-every",
            "2",
        ],
        &[("MPIPE_FAULT_RANK", "1"), ("MPIPE_FAULT_STEP", "5")],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let (out, _) = run_example(&["--processes", "--steps", "8", "--resume", ck], &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("steps 4..8"), "{stdout}");
    assert_eq!(checksums(&stdout), thread_checksums(8));
    let _ = std::fs::remove_dir_all(&dir);
}
