//! The device-resident step on the emulator: a small model that computes through the
//! aclnn kernels, activations and gradients in the planned arena, transfers by
//! `HcclBatchSendRecv` from and to it, no host wait inside the step.
//!
//! Checked, for several schedules at 4 ranks x 8 micro-batches:
//! - losses and reduced gradients equal an unpipelined host computation;
//! - a step after the first: one `HcclBatchSendRecv` per program batch with a remote
//!   item, no host<->device copy, one host wait per rank, no allocation, no hazard, one
//!   issuing thread per rank;
//! - with every stream paused, every rank issues its whole step and returns; resumed,
//!   the step completes with the same result;
//! - leaving out any one event wait the step issues makes the emulator report a hazard.
//!
//! One binary of its own: the emulator's counters, hazard reports and stream gate are
//! process-wide. `cargo test --release --features ascend -p mpipe-runtime --test ascend_device`
#![cfg(feature = "ascend")]

#[path = "support/toy.rs"]
mod toy;

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{ActionRef, CollKind, Program};
use mpipe_runtime::ascend::device::DeviceRank;
use mpipe_runtime::ascend::{counters, AscendComm};
use mpipe_runtime::comm::Comm;
use mpipe_runtime::interpret;
use std::sync::{Barrier, Mutex};
use toy::{update, values, Toy, LEN, LR, MBS};

const RANKS: usize = 4;

const PROFILE: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 2.0\nbackward = 2.0\n\
weight = 1.0\nactivation = 0.5\nparams = 0.5\ntrainable = true\n\
[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\n";

fn program(expr: &str) -> Program {
    let prof = Profile::from_toml_str(PROFILE).expect("profile");
    derive_str(&Request::new(&prof, RANKS, MBS), expr)
        .expect("derive")
        .program
}

/// The unpipelined step on the host: per-micro-batch losses and every unit's
/// gradient summed over micro-batches.
fn reference(prog: &Program, params: &[Vec<f32>]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let n = prog.units.len();
    let inputs: Vec<Vec<usize>> = prog
        .units
        .iter()
        .map(|u| {
            u.inputs
                .iter()
                .map(|x| prog.unit_index(x).expect("unit"))
                .collect()
        })
        .collect();
    let batch = values(7, LEN * MBS);
    // Units in an order where inputs come first.
    let mut order: Vec<usize> = Vec::new();
    while order.len() < n {
        for (u, ins) in inputs.iter().enumerate() {
            if !order.contains(&u) && ins.iter().all(|i| order.contains(i)) {
                order.push(u);
            }
        }
    }
    let last = *order.last().expect("units");
    let mut losses = Vec::new();
    let mut grads = vec![vec![0f32; LEN]; n];
    for mb in 0..MBS {
        let mut x = vec![vec![0f32; LEN]; n];
        let mut out = vec![vec![0f32; LEN]; n];
        for &u in &order {
            x[u] = if inputs[u].is_empty() {
                batch[mb * LEN..(mb + 1) * LEN].to_vec()
            } else {
                let mut s = out[inputs[u][0]].clone();
                for &i in &inputs[u][1..] {
                    s.iter_mut().zip(&out[i]).for_each(|(a, b)| *a += b);
                }
                s
            };
            out[u] = x[u].iter().zip(&params[u]).map(|(a, b)| a * b).collect();
        }
        losses.push(out[last].iter().sum());
        let mut gout = vec![vec![0f32; LEN]; n];
        gout[last] = vec![1.0; LEN];
        for &u in order.iter().rev() {
            for j in 0..LEN {
                grads[u][j] += gout[u][j] * x[u][j];
            }
            let gi: Vec<f32> = gout[u].iter().zip(&params[u]).map(|(a, b)| a * b).collect();
            for &i in &inputs[u] {
                gout[i].iter_mut().zip(&gi).for_each(|(a, b)| *a += b);
            }
        }
    }
    (losses, grads)
}

/// What the second step must give: the reference step from the parameters the first
/// step's update left.
fn expected_second_step(prog: &Program) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut params: Vec<Vec<f32>> = (0..prog.units.len())
        .map(|u| values(100 + u as u64, LEN))
        .collect();
    let (_, g1) = reference(prog, &params);
    for (p, g) in params.iter_mut().zip(&g1) {
        p.iter_mut().zip(g).for_each(|(p, g)| *p -= LR * g);
    }
    reference(prog, &params)
}

/// Batches of rank `r` with an item to another rank (what becomes one
/// `HcclBatchSendRecv`), and their items.
fn remote_batches(prog: &Program, r: usize) -> (u64, u64) {
    let (mut batches, mut items) = (0, 0);
    let mut prev: Option<Option<u64>> = None;
    let mut remote_in_run = false;
    for a in &prog.programs[r] {
        match a.view() {
            ActionRef::P2p(x) => {
                if prev != Some(x.batch) || x.batch.is_none() {
                    batches += u64::from(remote_in_run);
                    remote_in_run = false;
                }
                prev = Some(x.batch);
                if x.peer != r {
                    remote_in_run = true;
                    items += 1;
                }
            }
            _ => {
                batches += u64::from(remote_in_run);
                remote_in_run = false;
                prev = None;
            }
        }
    }
    (batches + u64::from(remote_in_run), items)
}

/// Where each unit's complete gradient is after a step: the root of its reduction,
/// or the one rank that runs its backward.
fn gradient_home(prog: &Program, unit: &str) -> usize {
    for (r, list) in prog.programs.iter().enumerate() {
        for a in list {
            if let ActionRef::Coll(c) = a.view() {
                if c.kind == CollKind::Reduce && c.unit == unit {
                    return c.root;
                }
            }
        }
        let _ = r;
    }
    prog.programs
        .iter()
        .position(|l| {
            l.iter()
                .any(|a| matches!(a.view(), ActionRef::Compute(c) if c.unit == unit))
        })
        .expect("some rank computes the unit")
}

/// How a test drives the steps after the first.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    /// Every stream paused while the second step is issued.
    Paused,
    /// The second step leaves out its `k`-th event wait on rank 0.
    Skip(u64),
}

struct Outcome {
    losses: Vec<f32>,
    /// Per unit, from its gradient's home rank (second step's gradients, zeroed
    /// after the first).
    grads: Vec<Vec<f32>>,
    counters: counters::Counters,
    waits_rank0: u64,
    hazards: u64,
}

static DEVICES: Mutex<()> = Mutex::new(());

fn run(expr: &str, mode: Mode) -> Outcome {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let prog = program(expr);
    let issued = Barrier::new(RANKS);
    let resume = Barrier::new(RANKS);
    let comms = AscendComm::world_in_process(RANKS).expect("world");
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (prog, issued, resume) = (&prog, &issued, &resume);
                s.spawn(move || -> Result<_, String> {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let mut dev = DeviceRank::new(comm, prog, &lens).map_err(|e| e.to_string())?;
                    let mut model = Toy::new(prog, dev.kernels()).map_err(|e| e.to_string())?;
                    // The first step: sub-communicators, workspaces and the stash pool
                    // come into being.
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    step.finish().map_err(|e| e.to_string())?;
                    update(&mut dev, &model).map_err(|e| e.to_string())?;
                    let waits_before = dev.comm().event_waits();
                    if let (Mode::Skip(k), 0) = (mode, r) {
                        dev.comm().mutate_skip_event_wait(waits_before + k);
                    }
                    let device = dev.comm().device();
                    counters::reset(device);
                    // Every rank's first step is over before the streams pause.
                    issued.wait();
                    if mode == Mode::Paused && r == 0 {
                        ascend_sys::emulator::pause_streams();
                    }
                    issued.wait();
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    // Every rank has issued its step: resume (a rank that waited on the
                    // host inside the step would never get here while paused).
                    resume.wait();
                    if mode == Mode::Paused && r == 0 {
                        ascend_sys::emulator::resume_streams();
                    }
                    let report = step.finish().map_err(|e| e.to_string())?;
                    let waits = dev.comm().event_waits() - waits_before;
                    let c = counters::snapshot(device).expect("emulator counters");
                    let grads = model.read_grads();
                    // The optimizer on the device, then everything freed, as at the end
                    // of training: an access of the second step left unordered with the
                    // optimizer's, or still running when its memory is freed, is a
                    // hazard too (the step's end must cover everything it queued).
                    update(&mut dev, &model).map_err(|e| e.to_string())?;
                    dev.kernels().synchronize().map_err(|e| e.to_string())?;
                    drop(model);
                    drop(dev);
                    let hazards = counters::snapshot(device)
                        .expect("emulator counters")
                        .hazards;
                    Ok((r, report.losses, grads, c, waits, hazards))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let mut out = Outcome {
        losses: Vec::new(),
        grads: vec![Vec::new(); prog.units.len()],
        counters: counters::Counters::default(),
        waits_rank0: 0,
        hazards: 0,
    };
    let mut per_rank = Vec::new();
    for res in results {
        let (r, losses, grads, c, waits, hazards) = res.unwrap_or_else(|e| panic!("{expr}: {e}"));
        if !losses.is_empty() && losses.iter().any(|&l| l != 0.0) {
            out.losses = losses;
        }
        out.hazards += hazards;
        out.counters += c;
        if r == 0 {
            out.waits_rank0 = waits;
        }
        per_rank.push(grads);
    }
    for (u, unit) in prog.units.iter().enumerate() {
        out.grads[u] = per_rank[gradient_home(&prog, &unit.name)][u].clone();
    }
    out
}

const SCHEDULES: [&str; 4] = [
    "1f1b",
    "zbv",
    "interleaved(v = 2)",
    "transpose(vision, 1f1b)",
];

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
}

#[test]
fn device_steps_compute_the_unpipelined_step_with_the_target_counters() {
    for expr in SCHEDULES {
        let prog = program(expr);
        let (losses, grads) = expected_second_step(&prog);
        let o = run(expr, Mode::Plain);
        assert!(
            close(&o.losses, &losses),
            "{expr}: losses {:?} vs {:?}",
            o.losses,
            losses
        );
        for (u, g) in grads.iter().enumerate() {
            assert!(
                close(&o.grads[u], g),
                "{expr}: gradient of unit {u}: {:?} vs {:?}",
                &o.grads[u][..4],
                &g[..4]
            );
        }
        let (mut batches, mut items) = (0, 0);
        for r in 0..RANKS {
            let (b, i) = remote_batches(&prog, r);
            batches += b;
            items += i;
        }
        let c = o.counters;
        assert_eq!(
            (c.batch_send_recv, c.batch_items),
            (batches, items),
            "{expr}"
        );
        assert_eq!((c.send, c.recv), (0, 0), "{expr}");
        assert_eq!(
            (c.copies, c.copy_bytes),
            (1, MBS as u64 * 4),
            "{expr}: no host<->device copy but the one read of the losses"
        );
        assert_eq!(c.host_waits, RANKS as u64, "{expr}: one host wait per rank");
        assert_eq!(
            (c.mallocs, c.frees),
            (0, 0),
            "{expr}: nothing allocated after the first step"
        );
        assert_eq!(
            c.hazards,
            0,
            "{expr}: {:?}",
            ascend_sys::profile::hazard_reports(0)
        );
        assert_eq!(
            c.threads, RANKS as u64,
            "{expr}: one issuing thread per rank"
        );
        assert!(c.kernels > 0, "{expr}: the model computes on the device");
    }
}

#[test]
fn a_step_issues_whole_while_every_stream_is_paused() {
    let expr = "transpose(vision, 1f1b)";
    let plain = run(expr, Mode::Plain);
    let paused = run(expr, Mode::Paused);
    assert_eq!(plain.losses, paused.losses);
    assert_eq!(plain.grads, paused.grads);
    assert_eq!(paused.hazards, 0);
}

#[test]
fn every_event_wait_is_needed() {
    for expr in ["1f1b", "transpose(vision, 1f1b)"] {
        let plain = run(expr, Mode::Plain);
        assert_eq!(plain.hazards, 0);
        assert!(plain.waits_rank0 > 0);
        for k in 0..plain.waits_rank0 {
            let o = run(expr, Mode::Skip(k));
            assert!(
                o.hazards > 0,
                "{expr}: leaving out wait {k} of rank 0's step went unnoticed"
            );
        }
    }
}

/// A rank that fails records it ([`DeviceRank::abort`]); the other ranks of the world
/// stop at their next batch with an error naming it, instead of waiting for HCCL's
/// timeout.
#[test]
fn a_failed_rank_stops_the_others_at_their_next_batch() {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let prog = program("1f1b");
    let comms = AscendComm::world_in_process(RANKS).expect("world");
    let failed = Barrier::new(RANKS);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (prog, failed) = (&prog, &failed);
                s.spawn(move || {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let set_up = DeviceRank::new(comm, prog, &lens).and_then(|mut dev| {
                        let model = Toy::new(prog, dev.kernels())?;
                        Ok((dev, model))
                    });
                    // Every rank is set up before rank 2 fails.
                    failed.wait();
                    let (mut dev, mut model) = match set_up {
                        Ok(x) => x,
                        Err(e) => {
                            failed.wait();
                            return Err(format!("rank {r} set-up: {e}"));
                        }
                    };
                    if r == 2 {
                        dev.abort("the test's rank 2 gave up");
                        failed.wait();
                        return Ok(());
                    }
                    failed.wait();
                    let started = std::time::Instant::now();
                    let mut step = dev.step(prog, &mut model);
                    let out = interpret::run(prog, r, &mut step).map_err(|e| e.to_string());
                    assert!(started.elapsed() < std::time::Duration::from_secs(5));
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    for (r, res) in results.iter().enumerate() {
        if r != 2 {
            let e = res.as_ref().expect_err("the step fails");
            assert!(!e.contains("set-up"), "rank {r}: {e}");
            assert!(e.contains("rank 2 failed"), "rank {r}: {e}");
        }
    }
}
