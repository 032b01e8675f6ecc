//! Issue 37, item 11: a checkpoint holding a NaN or an infinity (a run that diverged,
//! or a forged file with its checksums recomputed) is refused, naming the unit and
//! the tensor; it trained 200 steps printing `loss NaN` and exited 0.

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use mpipe_runtime::checkpoint::{
    encode, load, load_set, save, save_set, step_dir, write_atomic, Manifest, OptimState, Problem,
    RankState, UnitState, MANIFEST,
};
use mpipe_runtime::comm::Comm;
use mpipe_runtime::host::threads::run_ranks;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mpipe-ckpt-finite-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn state(rank: usize, world: usize) -> RankState {
    RankState {
        rank,
        world,
        step: 4,
        data_position: 4,
        fingerprint: 77,
        units: vec![UnitState {
            unit: rank as u32,
            name: format!("u{rank}"),
            params: vec![0.5; 6],
            optim: Some(OptimState {
                step: 4,
                tensors: vec![("m".into(), vec![0.1; 6]), ("v".into(), vec![0.01; 6])],
            }),
        }],
    }
}

/// Replaces rank `rank`'s file of the set in `dir` by `forged`, with the manifest's
/// size and checksum recomputed (what an attacker or a bad tool would do).
fn forge(dir: &std::path::Path, rank: usize, forged: &RankState) {
    let mut m = Manifest::read(dir).unwrap();
    let bytes = encode(forged);
    let entry = &mut m.ranks[rank];
    write_atomic(&dir.join(&entry.file), &bytes).unwrap();
    entry.size = bytes.len() as u64;
    entry.checksum = u64::from_le_bytes(bytes[bytes.len() - 8..].try_into().unwrap());
    write_atomic(&dir.join(MANIFEST), m.to_text().as_bytes()).unwrap();
}

#[test]
fn a_forged_set_with_a_nan_parameter_or_optimizer_value_is_refused() {
    let dir = tmpdir("set");
    let out = run_ranks(2, Duration::from_secs(10), |mut c| {
        let r = c.rank();
        save_set(&dir, &mut c, &state(r, 2)).map(|_| ())
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    assert_eq!(load_set(&dir, 1, 2, 77).unwrap(), state(1, 2));

    type Damage = fn(&mut UnitState);
    let cases: [(&str, Damage, &str, usize); 3] = [
        (
            "nan",
            |u| u.params[3] = f32::NAN,
            "unit `u1`'s parameters",
            3,
        ),
        (
            "inf m",
            |u| u.optim.as_mut().unwrap().tensors[0].1[5] = f32::INFINITY,
            "unit `u1`'s optimizer tensor `m`",
            5,
        ),
        (
            "-inf v",
            |u| u.optim.as_mut().unwrap().tensors[1].1[0] = f32::NEG_INFINITY,
            "unit `u1`'s optimizer tensor `v`",
            0,
        ),
    ];
    for (what, damage, tensor, at) in cases {
        let mut forged = state(1, 2);
        damage(&mut forged.units[0]);
        forge(&dir, 1, &forged);
        let e = load_set(&dir, 1, 2, 77).expect_err(what);
        match &e.problem {
            Problem::NonFinite {
                tensor: t, index, ..
            } => {
                assert_eq!(t, tensor, "{what}");
                assert_eq!(*index, at, "{what}");
            }
            other => panic!("{what}: {other}"),
        }
        let text = e.to_string();
        assert!(text.contains(tensor), "{text}");
        assert!(text.contains("resume from an earlier checkpoint"), "{text}");
        assert!(text.contains("rank-1.ckpt"), "the file is named: {text}");
        // The other rank's file is fine.
        assert!(load_set(&dir, 0, 2, 77).is_ok());
    }
    let _ = fs::remove_dir_all(&dir);
}

/// A state with a non-finite value is never written: a diverged run cannot replace
/// a good checkpoint with a useless one.
#[test]
fn a_non_finite_state_is_not_saved() {
    let dir = tmpdir("save");
    let path = dir.join("r.ckpt");
    save(&path, &state(0, 1)).unwrap();
    let mut bad = state(0, 1);
    bad.units[0].params[0] = f32::NAN;
    let e = save(&path, &bad).unwrap_err();
    assert!(
        matches!(e.problem, Problem::NonFinite { index: 0, .. }),
        "{e}"
    );
    assert_eq!(load(&path).unwrap(), state(0, 1), "the good file is kept");
    let _ = fs::remove_dir_all(&dir);
    // Nor through a set: the rank that holds it fails, naming the unit.
    let dir = tmpdir("saveset");
    let out = run_ranks(2, Duration::from_secs(10), |mut c| {
        let r = c.rank();
        let mut s = state(r, 2);
        if r == 1 {
            s.units[0].params[2] = f32::INFINITY;
        }
        save_set(&dir, &mut c, &s).map(|_| ())
    });
    let e = out[1].as_ref().expect_err("rank 1's save fails");
    assert!(e.contains("unit `u1`'s parameters"), "{e}");
    assert!(!step_dir(&dir, 4).join("rank-1.ckpt").exists());
    let _ = fs::remove_dir_all(&dir);
}
