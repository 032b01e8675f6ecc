//! Checkpoints of the example model's pipelined training (ranks as threads): a run
//! stopped after a checkpoint (between steps, in the middle of a step, or in the
//! middle of a later save) and resumed ends with parameters bitwise equal to an
//! uninterrupted run's, for a transposed encoder (broadcast to every rank), a
//! chunked schedule and a frozen encoder; damaged, missing and mismatched
//! checkpoints are refused with the file and the problem, on every rank, promptly.

use mpipe::core::program::Program;
use mpipe::runtime::checkpoint::{self, Manifest};
use mpipe::runtime::exec::{ExecError, Executor};
use mpipe::runtime::host::threads::ThreadComm;
use mpipe::runtime::host::Mode;
use mpipe_mllm::pipeline::{train, train_with, Checkpointing, RankOutcome, RunRank, Train};
use mpipe_mllm::{AdamConfig, Config, Mllm};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mpipe::schedule! { mod t1f1b { model = "examples/mllm.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
mpipe::schedule! { mod tzbv { model = "examples/mllm.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
mpipe::schedule! { mod frozen_1f1b { model = "examples/mllm-frozen.toml"; ranks = 4; microbatches = 8; schedule = 1f1b; } }

/// A schedule under test: its name, program, generated code, stages per rank and
/// whether the encoder is frozen.
struct Case {
    name: &'static str,
    program: Program,
    run: Box<dyn RunRank>,
    chunks: usize,
    frozen: bool,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: t1f1b::EXPR,
            program: Program::from_json(t1f1b::PROGRAM_JSON).unwrap(),
            run: Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| t1f1b::run(r, e)),
            chunks: 1,
            frozen: false,
        },
        Case {
            name: tzbv::EXPR,
            program: Program::from_json(tzbv::PROGRAM_JSON).unwrap(),
            run: Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| tzbv::run(r, e)),
            chunks: 2,
            frozen: false,
        },
        Case {
            name: "1f1b (frozen encoder)",
            program: Program::from_json(frozen_1f1b::PROGRAM_JSON).unwrap(),
            run: Box::new(|r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| {
                frozen_1f1b::run(r, e)
            }),
            chunks: 1,
            frozen: true,
        },
    ]
}

fn training(c: &Case, steps: u64) -> Train {
    Train {
        cfg: Config {
            layers: 8,
            vision_layers: 2,
            stages: 4 * c.chunks,
            trainable_encoder: !c.frozen,
            ..Config::default()
        },
        adam: AdamConfig {
            lr: 3e-3,
            ..AdamConfig::default()
        },
        data_seed: 5,
        steps,
        update: true,
        timeout: Duration::from_secs(10),
        mode: Mode::Rendezvous,
    }
}

/// A fresh directory under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mpipe-test-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every trained unit's parameters, as bits, in unit order.
fn param_bits(outcomes: Vec<Result<RankOutcome, String>>) -> Vec<(usize, Vec<u32>)> {
    let mut all: Vec<(usize, Vec<u32>)> = outcomes
        .into_iter()
        .map(|o| o.expect("the rank finished"))
        .flat_map(|o| o.params)
        .map(|(u, p)| (u, p.iter().map(|x| x.to_bits()).collect()))
        .collect();
    all.sort_by_key(|p| p.0);
    all
}

fn every(dir: &Path, n: u64) -> Checkpointing {
    Checkpointing {
        checkpoint: Some((dir.to_path_buf(), n)),
        resume: None,
    }
}

fn resume(dir: &Path, save_every: Option<u64>) -> Checkpointing {
    Checkpointing {
        checkpoint: save_every.map(|n| (dir.to_path_buf(), n)),
        resume: Some(dir.to_path_buf()),
    }
}

fn assert_bitwise(case: &str, what: &str, got: &[(usize, Vec<u32>)], want: &[(usize, Vec<u32>)]) {
    assert_eq!(
        got.iter().map(|p| p.0).collect::<Vec<_>>(),
        want.iter().map(|p| p.0).collect::<Vec<_>>(),
        "{case}, {what}: the same units"
    );
    for ((u, a), (_, b)) in got.iter().zip(want) {
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert!(
            a.len() == b.len() && differ == 0,
            "{case}, {what}: unit {u} differs in {differ} of {} parameters",
            b.len()
        );
    }
}

const N: u64 = 9;
const K: u64 = 3;

#[test]
fn a_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one() {
    for c in cases() {
        let dir = scratch(&format!("resume-{}", c.chunks + 2 * usize::from(c.frozen)));
        let (a, b) = (dir.join("a"), dir.join("b"));
        // Uninterrupted, without and with checkpoints (saving changes nothing).
        let plain = param_bits(train(&c.program, c.run.as_ref(), &training(&c, N), None));
        let trained = 4 * c.chunks + usize::from(!c.frozen);
        assert_eq!(plain.len(), trained, "{}: every trained unit", c.name);
        let saved = param_bits(train_with(
            &c.program,
            c.run.as_ref(),
            &training(&c, N),
            &every(&a, K),
            None,
        ));
        assert_bitwise(c.name, "saving checkpoints", &saved, &plain);
        assert_eq!(Manifest::read(&a).unwrap().step, N);

        // Stopped after step K + 2: the checkpoint of step K is the last one.
        let stopped = train_with(
            &c.program,
            c.run.as_ref(),
            &training(&c, K + 2),
            &every(&b, K),
            None,
        );
        assert!(stopped.iter().all(Result::is_ok));
        assert_eq!(Manifest::read(&b).unwrap().step, K);
        // Resumed from it up to N, saving on.
        let outcomes = train_with(
            &c.program,
            c.run.as_ref(),
            &training(&c, N),
            &resume(&b, Some(K)),
            None,
        );
        for o in outcomes.iter().flatten() {
            assert_eq!(o.first_step, K, "{}: resumed at the checkpoint", c.name);
            assert_eq!(o.peaks.len() as u64, N - K);
        }
        assert_bitwise(c.name, "stopped and resumed", &param_bits(outcomes), &plain);
        // The resumed run's own last checkpoint is the end state too.
        let again = train_with(
            &c.program,
            c.run.as_ref(),
            &training(&c, N),
            &resume(&b, None),
            None,
        );
        assert_bitwise(c.name, "resumed at the end", &param_bits(again), &plain);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_rank_dying_in_a_step_or_mid_save_leaves_a_resumable_set() {
    let c = cases().swap_remove(0);
    let dir = scratch("die");
    let plain = param_bits(train(&c.program, c.run.as_ref(), &training(&c, N), None));

    // Rank 2 panics as it starts step K + 1 (the fifth call of its code; the
    // others are inside that step), after the checkpoint of step K: every rank
    // stops.
    let calls = AtomicU64::new(0);
    let dying = |r: usize, e: &mut Executor<'_, ThreadComm, Mllm>| -> Result<(), ExecError> {
        if r == 2 && calls.fetch_add(1, Ordering::SeqCst) == K + 1 {
            panic!("rank 2 killed in step {}", K + 1);
        }
        t1f1b::run(r, e)
    };
    let began = Instant::now();
    let died = train_with(&c.program, &dying, &training(&c, N), &every(&dir, K), None);
    assert!(began.elapsed() < Duration::from_secs(10));
    for (r, o) in died.iter().enumerate() {
        let e = o.as_ref().expect_err("every rank stops");
        assert!(e.contains("rank 2"), "rank {r}: {e}");
    }
    assert_eq!(Manifest::read(&dir).unwrap().step, K);

    // A later save cut short: rank 0 wrote its file of step 2K, nobody else did,
    // and no manifest names it. The set of step K is still the complete one.
    let half = checkpoint::load(&checkpoint::step_dir(&dir, K).join(checkpoint::rank_file_name(0)))
        .unwrap();
    let late = checkpoint::step_dir(&dir, 2 * K);
    std::fs::create_dir_all(&late).unwrap();
    checkpoint::save(
        &late.join(checkpoint::rank_file_name(0)),
        &checkpoint::RankState {
            step: 2 * K,
            ..half
        },
    )
    .unwrap();

    let outcomes = train_with(
        &c.program,
        c.run.as_ref(),
        &training(&c, N),
        &resume(&dir, Some(K)),
        None,
    );
    assert!(outcomes.iter().flatten().all(|o| o.first_step == K));
    assert_bitwise(c.name, "died and resumed", &param_bits(outcomes), &plain);
    assert_eq!(Manifest::read(&dir).unwrap().step, N);
    assert!(
        !late.exists(),
        "older sets are removed once a newer one is complete"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Resumes from `dir` and returns every rank's error (all must fail, within 10 s).
fn resume_errors(c: &Case, t: &Train, dir: &Path) -> Vec<String> {
    let began = Instant::now();
    let out = train_with(&c.program, c.run.as_ref(), t, &resume(dir, None), None);
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the ranks took {:?} to stop",
        began.elapsed()
    );
    out.into_iter()
        .map(|o| o.expect_err("a bad checkpoint is refused"))
        .collect()
}

#[test]
fn damaged_missing_and_mismatched_checkpoints_are_refused() {
    let c = cases().swap_remove(0);
    let dir = scratch("bad");
    let t = training(&c, 6);
    let ok = train_with(
        &c.program,
        c.run.as_ref(),
        &training(&c, 3),
        &every(&dir, 3),
        None,
    );
    assert!(ok.iter().all(Result::is_ok));
    let file = |r: usize| checkpoint::step_dir(&dir, 3).join(checkpoint::rank_file_name(r));
    let pristine: Vec<Vec<u8>> = (0..4).map(|r| std::fs::read(file(r)).unwrap()).collect();
    let manifest = std::fs::read(dir.join(checkpoint::MANIFEST)).unwrap();
    let restore = || {
        for (r, b) in pristine.iter().enumerate() {
            std::fs::write(file(r), b).unwrap();
        }
        std::fs::write(dir.join(checkpoint::MANIFEST), &manifest).unwrap();
    };

    // (damage, the rank whose file it is, what its error says)
    type Damage<'a> = Box<dyn Fn() + 'a>;
    let damages: Vec<(&str, Damage, usize, &str)> = vec![
        (
            "a flipped bit",
            Box::new(|| {
                let mut b = pristine[1].clone();
                let mid = b.len() / 2;
                b[mid] ^= 0x10;
                std::fs::write(file(1), b).unwrap();
            }),
            1,
            "corrupt: the checksum",
        ),
        (
            "a truncated file",
            Box::new(|| std::fs::write(file(2), &pristine[2][..pristine[2].len() - 100]).unwrap()),
            2,
            "truncated",
        ),
        (
            "a file of something else",
            Box::new(|| std::fs::write(file(3), b"{\"not\": \"a checkpoint\"}").unwrap()),
            3,
            "not an mpipe checkpoint file",
        ),
        (
            "a missing file",
            Box::new(|| std::fs::remove_file(file(0)).unwrap()),
            0,
            "does not exist, though the manifest of step 3 lists it",
        ),
        (
            "a valid file the manifest does not vouch for",
            Box::new(|| std::fs::copy(file(2), file(1)).map(|_| ()).unwrap()),
            1,
            "not the file the manifest of step 3 vouches for",
        ),
    ];
    for (what, damage, bad_rank, says) in &damages {
        restore();
        damage();
        let errs = resume_errors(&c, &t, &dir);
        let path = file(*bad_rank).display().to_string();
        for (r, e) in errs.iter().enumerate() {
            if r == *bad_rank {
                assert!(e.contains(&path), "{what}: rank {r} names the file: {e}");
                assert!(e.contains(says), "{what}: rank {r}: {e}");
            } else {
                assert!(
                    e.contains(&format!("rank {bad_rank}")),
                    "{what}: rank {r} names rank {bad_rank}: {e}"
                );
            }
        }
    }

    // No manifest: no complete set, whatever files there are.
    restore();
    std::fs::remove_file(dir.join(checkpoint::MANIFEST)).unwrap();
    for e in resume_errors(&c, &t, &dir) {
        assert!(e.contains("no complete checkpoint set"), "{e}");
        assert!(e.contains("manifest"), "{e}");
    }
    let e = resume_errors(&c, &t, &dir.join("nowhere")).remove(0);
    assert!(e.contains("does not exist"), "{e}");

    // Another run's checkpoint: a different learning rate, a different program.
    restore();
    let other_lr = Train {
        adam: AdamConfig { lr: 1e-3, ..t.adam },
        ..t.clone()
    };
    for e in resume_errors(&c, &other_lr, &dir) {
        assert!(e.contains("different run (fingerprint"), "{e}");
    }
    let zbv = cases().swap_remove(1);
    for e in resume_errors(&zbv, &training(&zbv, 6), &dir) {
        assert!(e.contains("different run"), "{e}");
    }

    // And the pristine set still resumes.
    restore();
    let out = train_with(&c.program, c.run.as_ref(), &t, &resume(&dir, None), None);
    assert!(
        out.iter().all(Result::is_ok),
        "{:?}",
        out.iter().find(|o| o.is_err())
    );
    let _ = std::fs::remove_dir_all(&dir);
}
