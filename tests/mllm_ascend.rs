//! The example model trained through generated schedules on the Ascend backend
//! (HCCL over ascend-sys; the host emulator here, 4 ranks on 4 devices): one step's
//! gradients equal the unpipelined step's and the host backend's, with the model on
//! the host (the executor over HCCL) and on the device (`DeviceRank` + `DeviceMllm`),
//! the ranks as threads and, through the built example, as one process per device;
//! the example's counters of a device step show the target.
//!
//! `cargo test --release --features ascend --test mllm_ascend`
#![cfg(feature = "ascend")]

use mpipe::core::program::Program;
use mpipe::core::program::{ActionRef, Op};
use mpipe::runtime::ascend::device::DeviceStep;
use mpipe::runtime::ascend::{run_ranks, AscendComm};
use mpipe::runtime::exec::Executor;
use mpipe::runtime::host::threads::ThreadComm;
use mpipe::runtime::host::Mode;
use mpipe_mllm::device::DeviceMllm;
use mpipe_mllm::pipeline::device::{train_rank_device, RunDevice};
use mpipe_mllm::pipeline::{
    rel_diff, train, train_rank, Checkpointing, RankOutcome, RunRank, Train,
};
use mpipe_mllm::{AdamConfig, Config, Dataset, Mllm};
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

mod common;

macro_rules! schedules {
    ($m:ident, $profile:literal) => {
        mod $m {
            mpipe::schedule! { pub(crate) mod s_1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = 1f1b; } }
            mpipe::schedule! { pub(crate) mod s_t1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
            mpipe::schedule! { pub(crate) mod s_tzbv { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
            mpipe::schedule! { pub(crate) mod s_inter { model = $profile; ranks = 4; microbatches = 8; schedule = interleaved(v = 2); } }
        }
    };
}
schedules!(trainable, "examples/mllm.toml");
schedules!(frozen, "examples/mllm-frozen.toml");

type Hccl = Box<dyn RunRank<AscendComm>>;
type Host = Box<dyn RunRank>;
type OnDevice = Box<dyn RunDevice>;

/// (expression, program JSON, run on HCCL, run on the host, stages per rank, run
/// on the device)
fn all(frozen: bool) -> Vec<(&'static str, &'static str, Hccl, Host, usize, OnDevice)> {
    macro_rules! one {
        ($set:ident :: $s:ident, $chunks:expr) => {
            (
                $set::$s::EXPR,
                $set::$s::PROGRAM_JSON,
                Box::new(|r: usize, e: &mut Executor<'_, AscendComm, Mllm>| $set::$s::run(r, e))
                    as Hccl,
                Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| $set::$s::run(r, e))
                    as Host,
                $chunks,
                Box::new(|r: usize, s: &mut DeviceStep<'_, DeviceMllm>| $set::$s::run(r, s))
                    as OnDevice,
            )
        };
    }
    macro_rules! list {
        ($set:ident) => {
            vec![
                one!($set::s_1f1b, 1),
                one!($set::s_t1f1b, 1),
                one!($set::s_tzbv, 2),
            ]
        };
    }
    if frozen {
        list!(frozen)
    } else {
        list!(trainable)
    }
}

fn config(stages: usize, frozen: bool) -> Config {
    Config {
        layers: 8,
        vision_layers: 2,
        stages,
        trainable_encoder: !frozen,
        ..Config::default()
    }
}

fn outcomes(o: Vec<Result<RankOutcome, String>>) -> Vec<RankOutcome> {
    o.into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

#[test]
fn gradients_on_hccl_equal_the_unpipelined_step_and_the_host_backend() {
    for frozen in [false, true] {
        for (expr, json, hccl, host, chunks, device) in all(frozen) {
            let program = Program::from_json(json).unwrap();
            let cfg = config(4 * chunks, frozen);
            let t = Train {
                cfg: cfg.clone(),
                adam: AdamConfig::default(),
                data_seed: 3,
                steps: 1,
                update: false,
                timeout: Duration::from_secs(10),
                mode: Mode::Rendezvous,
            };
            let batch = Dataset::new(&cfg, 3).batch(0, program.microbatches);
            let (ref_loss, ref_grads) = Mllm::new(cfg.clone()).reference_step(&batch);
            let on_hccl = outcomes(run_ranks(program.ranks, |mut c| {
                train_rank(
                    &mut c,
                    &program,
                    hccl.as_ref(),
                    &t,
                    &Checkpointing::default(),
                    None,
                )
            }));
            let on_host = outcomes(train(&program, host.as_ref(), &t, None));
            // The model on the device (ranks as threads): the same gradients.
            let on_device = outcomes(run_ranks(program.ranks, |c| {
                train_rank_device(c, &program, device.as_ref(), &t, None)
            }));
            for (d, h) in on_device.iter().zip(&on_host) {
                assert_eq!(d.grads.len(), h.grads.len(), "{expr}");
                for ((u, g), (hu, hg)) in d.grads.iter().zip(&h.grads) {
                    assert_eq!(u, hu);
                    let name = &program.units[*u].name;
                    let (dr, dh) = (rel_diff(g, &ref_grads[*u]), rel_diff(g, hg));
                    assert!(
                        dr <= 1e-5 && dh <= 1e-5,
                        "{expr} (frozen {frozen}) on the device: {name} differs by {dr:e} from \
                         the unpipelined step, by {dh:e} from the host backend"
                    );
                }
            }
            let device_losses: Vec<f32> = on_device.iter().flat_map(|o| o.losses.clone()).collect();
            let host_losses: Vec<f32> = on_host.iter().flat_map(|o| o.losses.clone()).collect();
            assert!(
                rel_diff(&device_losses, &host_losses) <= 1e-5,
                "{expr}: losses on the device {device_losses:?}, on the host {host_losses:?}"
            );
            let mut units = 0;
            let mut losses = Vec::new();
            for (a, h) in on_hccl.iter().zip(&on_host) {
                assert_eq!(a.grads.len(), h.grads.len());
                for ((u, g), (hu, hg)) in a.grads.iter().zip(&h.grads) {
                    assert_eq!(u, hu);
                    let name = &program.units[*u].name;
                    let d = rel_diff(g, &ref_grads[*u]);
                    assert!(
                        d <= 1e-5,
                        "{expr} (frozen {frozen}): {name} differs by {d:e}"
                    );
                    let dh = rel_diff(g, hg);
                    assert!(
                        dh <= 1e-5,
                        "{expr}: {name} differs from the host's by {dh:e}"
                    );
                    units += 1;
                }
                losses.extend(a.losses.iter().copied());
            }
            let trainable = program.units.iter().filter(|u| u.trainable).count();
            assert_eq!(units, trainable, "{expr}: every trainable unit checked");
            let loss = losses.iter().sum::<f32>() / losses.len() as f32;
            assert!(rel_diff(&[loss], &[ref_loss]) <= 1e-5, "{expr}: loss");
        }
    }
}

fn run_example(args: &[&str]) -> (bool, String) {
    let out = Command::new(common::example(&["ascend"]))
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_PORT")
        .output()
        .expect("the example runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `examples/mllm.rs --backend ascend --check`: 4 emulated devices as 4 processes, the
/// same gradients as the host backend and the unpipelined step, for every schedule.
#[test]
fn example_check_runs_one_process_per_device() {
    for frozen in [false, true] {
        let mut args = vec!["--backend", "ascend", "--check"];
        if frozen {
            args.push("--frozen");
        }
        let (ok, text) = run_example(&args);
        assert!(ok, "{text}");
        assert!(text.contains("one process per device"), "{text}");
        for expr in ["1f1b", "transpose(vision, 1f1b)", "transpose(vision, zbv)"] {
            let row = text
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{expr} ")))
                .unwrap_or_else(|| panic!("no row for {expr}:\n{text}"));
            let diffs: Vec<f64> = row
                .split_whitespace()
                .filter_map(|w| w.parse::<f64>().ok())
                .collect();
            assert!(diffs.len() >= 6, "{row}");
            assert!(diffs.iter().all(|d| *d <= 1e-5), "{row}");
        }
        assert!(text.contains("(within 1e-5)"), "{text}");
    }
}

/// Training as one process per device ends with the parameters of the thread run,
/// bit for bit, and each rank names its own device.
#[test]
fn example_trains_as_processes_like_threads() {
    let common = ["--backend", "ascend", "--steps", "5", "--schedule", "zbv-t"];
    let sums = |text: &str| -> BTreeSet<String> {
        text.lines()
            .filter_map(|l| l.split("parameter checksums: ").nth(1))
            .flat_map(|s| s.split_whitespace().map(String::from))
            .collect()
    };
    let (ok, threads) = run_example(&common);
    assert!(ok, "{threads}");
    let mut args = common.to_vec();
    args.push("--processes");
    let (ok, procs) = run_example(&args);
    assert!(ok, "{procs}");
    for r in 0..4 {
        assert!(
            procs.contains(&format!("rank {r} on device {r}")),
            "{procs}"
        );
    }
    assert_eq!(sums(&threads), sums(&procs));
    assert_eq!(sums(&threads).len(), 9, "vision and 8 LLM stages");
}

/// What a training step of `program` must cost on the device, from the program alone:
/// every batch with a transfer to another rank is exactly one `HcclBatchSendRecv`
/// carrying exactly its remote transfers.
fn expected_counters(program: &Program) -> BTreeMap<&'static str, u64> {
    let (mut batches, mut items) = (0u64, 0u64);
    for (rank, list) in program.programs.iter().enumerate() {
        let mut last_batch = None;
        let mut counted = false;
        for a in list {
            match a.view() {
                ActionRef::P2p(x) => {
                    if x.batch.is_none() || x.batch != last_batch {
                        counted = false;
                    }
                    last_batch = x.batch;
                    if x.peer != rank {
                        items += 1;
                        if !counted {
                            batches += 1;
                            counted = true;
                        }
                    }
                }
                ActionRef::Coll(_) | ActionRef::Compute(_) => last_batch = None,
            }
        }
    }
    BTreeMap::from([("batches", batches), ("items", items)])
}

/// The host<->device copies a training step of `program` makes on the device, and
/// their bytes: the forward of a unit that reads the micro-batch uploads it (the
/// vision encoder its images, f32; `llm.0` its caption tokens, i64; the last unit its
/// next-token targets, i64, one per position of the sequence), and each rank that
/// runs the last unit's forward reads its per-micro-batch losses back once (f32,
/// one per micro-batch). Nothing else crosses: activations, gradients, parameters
/// and the optimizer stay on the device.
fn expected_copies(program: &Program, frozen: bool) -> (u64, u64) {
    let cfg = config(4, frozen);
    let sample = &Dataset::new(&cfg, 1).batch(0, 1)[0];
    let last = program.units.len() - 1;
    let bytes = |u: usize| -> u64 {
        match u {
            0 => sample.images.len() as u64 * 4,
            1 => sample.tokens.len() as u64 * 8,
            _ => (sample.size * cfg.seq_len()) as u64 * 8,
        }
    };
    let (mut copies, mut copy_bytes) = (0u64, 0u64);
    for list in &program.programs {
        let mut has_loss = false;
        for a in list {
            if let ActionRef::Compute(c) = a.view() {
                let forward = matches!(c.op, Op::F | Op::RF);
                let u = program.unit_index(c.unit).expect("a unit of the program");
                if forward && (u <= 1 || u == last) {
                    copies += 1;
                    copy_bytes += bytes(u);
                }
                has_loss |= forward && u == last;
            }
        }
        if has_loss {
            copies += 1;
            copy_bytes += program.microbatches as u64 * 4;
        }
    }
    (copies, copy_bytes)
}

/// `examples/mllm.rs --backend ascend --counters`: for every schedule the example
/// compiles, the emulator's counters of a training step after the first (the step,
/// its end and the optimizer's update, over all ranks) show the target the Ascend
/// backend is built for (issue 34): one `HcclBatchSendRecv` per batch of the program
/// with a remote transfer, carrying exactly its remote items; no single
/// `HcclSend`/`HcclRecv`; host<->device copies only of the micro-batches' inputs and
/// one read of the losses per rank that computes them ([`expected_copies`]); one
/// host wait per rank; no device allocation or free once the pools are warm; the
/// model's kernels on the device; no unordered access to a device buffer; one
/// issuing thread per rank.
#[test]
fn example_counters_show_one_hccl_batch_per_program_batch() {
    for frozen in [false, true] {
        let programs: BTreeMap<&str, Program> = all(frozen)
            .into_iter()
            .map(|(expr, json, ..)| (expr, Program::from_json(json).unwrap()))
            .chain(std::iter::once(if frozen {
                (
                    frozen::s_inter::EXPR,
                    Program::from_json(frozen::s_inter::PROGRAM_JSON).unwrap(),
                )
            } else {
                (
                    trainable::s_inter::EXPR,
                    Program::from_json(trainable::s_inter::PROGRAM_JSON).unwrap(),
                )
            }))
            .collect();
        let mut args = vec!["--backend", "ascend", "--counters"];
        if frozen {
            args.push("--frozen");
        }
        let (ok, text) = run_example(&args);
        assert!(ok, "{text}");
        let mut seen = 0;
        for line in text.lines().filter(|l| l.starts_with("counters ")) {
            let (expr, values) = line["counters ".len()..]
                .split_once(": ")
                .unwrap_or_else(|| panic!("{line}"));
            let got: BTreeMap<&str, u64> = values
                .split_whitespace()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{line}"));
                    (k, v.parse().unwrap_or_else(|_| panic!("{line}")))
                })
                .collect();
            for key in [
                "batches",
                "items",
                "send",
                "recv",
                "copies",
                "copy_bytes",
                "host_waits",
                "mallocs",
                "frees",
                "kernels",
                "hazards",
                "threads",
            ] {
                assert!(got.contains_key(key), "{key} missing: {line}");
            }
            let program = programs
                .get(expr)
                .unwrap_or_else(|| panic!("the test compiles no `{expr}`"));
            let want = expected_counters(program);
            assert_eq!(got["batches"], want["batches"], "{line}");
            assert_eq!(got["items"], want["items"], "{line}");
            assert_eq!((got["send"], got["recv"]), (0, 0), "{line}");
            let (copies, copy_bytes) = expected_copies(program, frozen);
            assert_eq!(
                (got["copies"], got["copy_bytes"]),
                (copies, copy_bytes),
                "{line}: only the inputs' uploads and one loss read per loss rank"
            );
            assert_eq!(got["host_waits"], program.ranks as u64, "{line}");
            assert!(
                got["kernels"] > 0,
                "{line}: the model computes on the device"
            );
            assert_eq!((got["mallocs"], got["frees"]), (0, 0), "{line}");
            assert_eq!(got["threads"], program.ranks as u64, "{line}");
            assert_eq!(got["hazards"], 0, "{line}");
            seen += 1;
        }
        assert_eq!(
            seen,
            programs.len(),
            "one line per compiled schedule:\n{text}"
        );
    }
}
