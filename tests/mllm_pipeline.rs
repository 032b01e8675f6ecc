//! The example model trained through generated schedules on the host backend
//! (ranks as threads): gradients equal the unpipelined step, the loss falls, the
//! measured activation peak equals the simulator's, every action runs in program
//! order, and a failing rank stops the others with its name, never a hang.

use mpipe::core::program::Program;
use mpipe::runtime::exec::{ExecError, Executor};
use mpipe::runtime::host::threads::ThreadComm;
use mpipe::runtime::host::Mode;
use mpipe_mllm::pipeline::{check, train, RunRank, Train};
use mpipe_mllm::{AdamConfig, Config, Mllm};
use std::time::{Duration, Instant};

macro_rules! schedules {
    ($m:ident, $profile:literal) => {
        mod $m {
            mpipe::schedule! { pub(crate) mod s_1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = 1f1b; } }
            mpipe::schedule! { pub(crate) mod s_t1f1b { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
            mpipe::schedule! { pub(crate) mod s_central { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b, backward = central); } }
            mpipe::schedule! { pub(crate) mod s_tzbv { model = $profile; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
            mpipe::schedule! { pub(crate) mod s_inter { model = $profile; ranks = 4; microbatches = 8; schedule = interleaved(v = 2); } }
        }
    };
}
schedules!(trainable, "examples/mllm.toml");
schedules!(frozen, "examples/mllm-frozen.toml");

type Run = Box<dyn RunRank>;

/// (name, program JSON, run, stages per rank, predicted peak memory)
fn all(frozen: bool) -> Vec<(&'static str, &'static str, Run, usize, Vec<f64>)> {
    macro_rules! list {
        ($set:ident) => {
            vec![
                (
                    $set::s_1f1b::EXPR,
                    $set::s_1f1b::PROGRAM_JSON,
                    Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                        $set::s_1f1b::run(r, e)
                    }) as Run,
                    1,
                    $set::s_1f1b::PEAK_MEMORY.to_vec(),
                ),
                (
                    $set::s_t1f1b::EXPR,
                    $set::s_t1f1b::PROGRAM_JSON,
                    Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                        $set::s_t1f1b::run(r, e)
                    }) as Run,
                    1,
                    $set::s_t1f1b::PEAK_MEMORY.to_vec(),
                ),
                (
                    $set::s_central::EXPR,
                    $set::s_central::PROGRAM_JSON,
                    Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                        $set::s_central::run(r, e)
                    }) as Run,
                    1,
                    $set::s_central::PEAK_MEMORY.to_vec(),
                ),
                (
                    $set::s_tzbv::EXPR,
                    $set::s_tzbv::PROGRAM_JSON,
                    Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                        $set::s_tzbv::run(r, e)
                    }) as Run,
                    2,
                    $set::s_tzbv::PEAK_MEMORY.to_vec(),
                ),
                (
                    $set::s_inter::EXPR,
                    $set::s_inter::PROGRAM_JSON,
                    Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                        $set::s_inter::run(r, e)
                    }) as Run,
                    2,
                    $set::s_inter::PEAK_MEMORY.to_vec(),
                ),
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

#[test]
fn pipelined_gradients_equal_the_unpipelined_step() {
    for frozen in [false, true] {
        for (expr, json, run, chunks, _) in all(frozen) {
            let program = Program::from_json(json).unwrap();
            let diffs = check(&program, run.as_ref(), &config(4 * chunks, frozen), 3).unwrap();
            for (unit, d) in &diffs {
                assert!(
                    *d <= 1e-5,
                    "{expr} (frozen: {frozen}): {unit} differs by {d:e}"
                );
            }
            let units = diffs.iter().filter(|(u, _)| u != "loss").count();
            assert_eq!(
                units,
                4 * chunks + usize::from(!frozen),
                "{expr}: every trainable unit compared"
            );
        }
    }
}

/// Training `steps` steps with updates, transfers in `mode`.
fn training(chunks: usize, steps: u64, mode: Mode) -> Train {
    Train {
        cfg: config(4 * chunks, false),
        adam: AdamConfig {
            lr: 3e-3,
            ..AdamConfig::default()
        },
        data_seed: 1,
        steps,
        update: true,
        timeout: Duration::from_secs(10),
        mode,
    }
}

fn short_run(expr_index: usize, steps: u64) -> (Vec<f32>, Vec<Vec<f64>>, Vec<f64>, Program) {
    let (_, json, run, chunks, predicted) = all(false).swap_remove(expr_index);
    let program = Program::from_json(json).unwrap();
    let t = training(chunks, steps, Mode::Rendezvous);
    let (tx, rx) = std::sync::mpsc::channel();
    let outcomes = train(&program, run.as_ref(), &t, Some(tx));
    let losses: Vec<f32> = rx.try_iter().filter_map(|r| r.loss).collect();
    let peaks = outcomes.into_iter().map(|o| o.unwrap().peaks).collect();
    (losses, peaks, predicted, program)
}

#[test]
fn loss_falls_and_memory_matches_the_prediction() {
    let (losses, peaks, predicted, _) = short_run(1, 80);
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[losses.len() - 5..].iter().sum::<f32>() / 5.0;
    assert!(
        last < 0.75 * first,
        "loss {first} -> {last} did not fall enough"
    );
    for (rank, (p, want)) in peaks.iter().zip(&predicted).enumerate() {
        for got in p {
            assert_eq!(
                got, want,
                "rank {rank}: measured peak {got} != predicted {want}"
            );
        }
    }
}

#[test]
fn every_action_runs_in_program_order() {
    // The executor checks each call against the program and records one interval
    // per action; a finished step has exactly one per action, in non-decreasing order.
    for (expr, json, run, chunks, _) in all(false) {
        let program = Program::from_json(json).unwrap();
        let t = Train {
            cfg: config(4 * chunks, false),
            adam: AdamConfig::default(),
            data_seed: 1,
            steps: 1,
            update: false,
            timeout: Duration::from_secs(10),
            mode: Mode::Rendezvous,
        };
        for (rank, o) in train(&program, run.as_ref(), &t, None)
            .into_iter()
            .enumerate()
        {
            let o = o.unwrap();
            assert_eq!(
                o.slots.len(),
                program.programs[rank].len(),
                "{expr}: rank {rank}"
            );
            assert!(
                o.slots.windows(2).all(|w| w[0].start <= w[1].start),
                "{expr}: rank {rank} ran out of order"
            );
        }
    }
}

#[test]
fn a_failing_rank_stops_the_others_with_its_name() {
    let (_, json, _, chunks, _) = all(false).swap_remove(1);
    let program = Program::from_json(json).unwrap();
    let t = Train {
        cfg: config(4 * chunks, false),
        adam: AdamConfig::default(),
        data_seed: 1,
        steps: 3,
        update: true,
        timeout: Duration::from_secs(30),
        mode: Mode::Rendezvous,
    };
    let run = |rank: usize, exec: &mut Executor<'_, ThreadComm, Mllm>| -> Result<(), ExecError> {
        if rank == 2 {
            panic!("injected fault on rank 2");
        }
        trainable::s_t1f1b::run(rank, exec)
    };
    let began = Instant::now();
    let outcomes = train(&program, &run, &t, None);
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the others took {:?} to stop",
        began.elapsed()
    );
    for (rank, o) in outcomes.iter().enumerate() {
        let err = o.as_ref().expect_err("every rank fails");
        assert!(
            err.contains("rank 2") || err.contains("injected"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn eager_transfers_train_exactly_as_rendezvous_ones() {
    // The same program under both point-to-point semantics: only when transfers
    // complete changes, so two steps give bit-identical gradients, parameters and
    // losses, and every action still runs.
    for (expr, json, run, chunks, _) in all(false) {
        let program = Program::from_json(json).unwrap();
        let outcome = |mode: Mode| {
            let t = training(chunks, 2, mode);
            train(&program, run.as_ref(), &t, None)
                .into_iter()
                .map(|o| o.unwrap_or_else(|e| panic!("{expr} ({mode:?}): {e}")))
                .collect::<Vec<_>>()
        };
        let (a, b) = (outcome(Mode::Rendezvous), outcome(Mode::Eager));
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.grads, y.grads, "{expr}: rank {} gradients", x.rank);
            assert_eq!(x.params, y.params, "{expr}: rank {} parameters", x.rank);
            assert_eq!(x.losses, y.losses, "{expr}: rank {} losses", x.rank);
            assert_eq!(x.slots.len(), program.programs[x.rank].len(), "{expr}");
        }
        assert!(
            a.iter().any(|o| !o.grads.is_empty()),
            "{expr}: gradients compared"
        );
    }
}

#[test]
fn a_real_run_calibrates_from_its_trace() {
    use mpipe::core::calibrate::measure;
    use mpipe::core::program::ActionRef;
    use mpipe::core::render::trace::{embedded_program, timeline_from_trace};
    use mpipe::core::simulate::{simulate, Mode as SimMode, SimOptions};
    use mpipe_mllm::pipeline::{outcomes_timeline, real_trace};

    let (expr, json, run, chunks, _) = all(false).swap_remove(1);
    let program = Program::from_json(json).unwrap();
    let t = training(chunks, 3, Mode::Rendezvous);
    let outcomes: Vec<_> = train(&program, run.as_ref(), &t, None)
        .into_iter()
        .map(|o| o.unwrap())
        .collect();
    let timeline = outcomes_timeline(&outcomes);
    // The trace carries the program, and reads back as the run's timeline (in ms).
    let text = real_trace(&program, &timeline, expr);
    assert_eq!(embedded_program(&text).unwrap(), program);
    let back = timeline_from_trace(&program, &text, 1e3).unwrap();
    let cal = measure(&program, &back, SimMode::Rendezvous, None).unwrap();
    let first = timeline
        .ranks
        .iter()
        .flatten()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let step_ms = (timeline.makespan() - first) * 1e3;
    assert!(
        (cal.step - step_ms).abs() <= 1e-3,
        "{} vs {step_ms}",
        cal.step
    );
    // Every compute action of the step is one sample of its unit's op.
    for u in &program.units {
        let m = cal
            .units
            .get(&u.name)
            .unwrap_or_else(|| panic!("{} unmeasured", u.name));
        let counted: usize = [m.f, m.b, m.w, m.bw]
            .iter()
            .flatten()
            .map(|s| s.samples)
            .sum();
        let actions = program
            .programs
            .iter()
            .flatten()
            .filter(|a| matches!(a.view(), ActionRef::Compute(c) if c.unit == u.name))
            .count();
        assert_eq!(counted, actions, "{}", u.name);
        assert!(m
            .f
            .is_some_and(|s| s.mean > 0.0 && s.min <= s.mean && s.mean <= s.max));
    }
    // Threads hand tensors over in measurable time.
    let link = cal.link.expect("transfers took time");
    assert!(link.latency > 0.0 && link.samples > 0, "{link:?}");
    // The calibrated program predicts the step on the same scale (ms, not s or us):
    // the ranks share this machine's cores, so only the order of magnitude is tested.
    let calibrated = cal.apply(&program);
    let predicted = simulate(
        &calibrated,
        &SimOptions {
            mode: SimMode::Rendezvous,
            comm: Some(link.model()),
        },
    )
    .unwrap()
    .makespan;
    assert!(
        predicted > 0.2 * cal.step && predicted < 5.0 * cal.step,
        "predicted {predicted} ms, measured {} ms",
        cal.step
    );
}
