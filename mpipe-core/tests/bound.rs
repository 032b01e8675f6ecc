//! The lower bound against the true optimum, found by exhaustive search on small
//! cases: every placement of the encoder's work on the ranks and every order of every
//! rank's tasks (each timed as early as its order and inputs allow, which is the best
//! schedule with that order), for pipeline-parallel programs (LLM stages on their
//! homes). The bound must never exceed the optimum. (The search does not prefetch;
//! the bound also covers programs that do, by counting a frozen encoder as free, so
//! with a frozen encoder it may sit below the optimum found here.)

use mpipe_core::bound::lower_bound;
use mpipe_core::program::{Cost, Unit};
use proptest::prelude::*;

/// One task of the brute-force model.
#[derive(Clone, Debug)]
struct T {
    cost: f64,
    deps: Vec<usize>,
}

fn unit(name: &str, inputs: &[&str], home: usize, trainable: bool, cost: (f64, f64, f64)) -> Unit {
    Unit {
        role: mpipe_core::program::Role::of_name(name),
        name: name.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        home,
        trainable,
        cost: Cost {
            f: cost.0,
            b: cost.1,
            w: cost.2,
        },
        act: 0.0,
        bytes: 0.0,
        params: 0.0,
    }
}

/// The tasks of one step (encoder `units[0]`, then a chain of stages) and, per task,
/// the ranks it may run on.
fn tasks(units: &[Unit], m: usize, ranks: usize) -> (Vec<T>, Vec<Vec<usize>>) {
    let mut ts: Vec<T> = Vec::new();
    let mut where_: Vec<Vec<usize>> = Vec::new();
    let s = units.len() - 1;
    let enc = &units[0];
    for _ in 0..m {
        let mut push = |cost: f64, deps: Vec<usize>, ranks: Vec<usize>| {
            ts.push(T { cost, deps });
            where_.push(ranks);
            ts.len() - 1
        };
        let all: Vec<usize> = (0..ranks).collect();
        let ef = push(enc.cost.f, vec![], all.clone());
        let mut f = Vec::new();
        for k in 0..s {
            let prev = if k == 0 { ef } else { f[k - 1] };
            f.push(push(
                units[k + 1].cost.f,
                vec![prev],
                vec![units[k + 1].home],
            ));
        }
        let mut b = vec![0; s];
        for k in (0..s).rev() {
            let mut deps = vec![f[k]];
            if k + 1 < s {
                deps.push(b[k + 1]);
            }
            b[k] = push(units[k + 1].cost.b, deps, vec![units[k + 1].home]);
            push(units[k + 1].cost.w, vec![b[k]], vec![units[k + 1].home]);
        }
        if enc.trainable {
            // The encoder's backward reads its forward's activations: the same rank
            // (the placement is fixed below by pairing it with its forward).
            push(enc.cost.b + enc.cost.w, vec![b[0], ef], all);
        }
    }
    (ts, where_)
}

/// Earliest-start timing of per-rank orders; `None` if the orders deadlock.
fn makespan(ts: &[T], orders: &[Vec<usize>]) -> Option<f64> {
    let n = ts.len();
    let mut end = vec![f64::NAN; n];
    let mut pos = vec![0usize; orders.len()];
    let mut clock = vec![0.0f64; orders.len()];
    let mut done = 0;
    while done < n {
        let mut progressed = false;
        for r in 0..orders.len() {
            while pos[r] < orders[r].len() {
                let t = orders[r][pos[r]];
                if ts[t].deps.iter().any(|&d| end[d].is_nan()) {
                    break;
                }
                let ready = ts[t].deps.iter().map(|&d| end[d]).fold(clock[r], f64::max);
                end[t] = ready + ts[t].cost;
                clock[r] = end[t];
                pos[r] += 1;
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            return None;
        }
    }
    Some(end.iter().copied().fold(0.0, f64::max))
}

/// Every order of `tasks` in which a task comes after its dependencies on the same
/// list (cross-rank dependencies are left to the timing).
fn orders(ts: &[T], tasks: &[usize]) -> Vec<Vec<usize>> {
    fn go(
        ts: &[T],
        left: &mut Vec<usize>,
        cur: &mut Vec<usize>,
        all: &[usize],
        out: &mut Vec<Vec<usize>>,
    ) {
        if left.is_empty() {
            out.push(cur.clone());
            return;
        }
        for i in 0..left.len() {
            let t = left[i];
            let blocked = ts[t]
                .deps
                .iter()
                .any(|d| all.contains(d) && !cur.contains(d));
            if blocked {
                continue;
            }
            left.remove(i);
            cur.push(t);
            go(ts, left, cur, all, out);
            cur.pop();
            left.insert(i, t);
        }
    }
    let mut out = Vec::new();
    go(ts, &mut tasks.to_vec(), &mut Vec::new(), tasks, &mut out);
    out
}

/// The optimum over every encoder placement and every per-rank order.
fn optimum(units: &[Unit], m: usize, ranks: usize) -> f64 {
    let (ts, where_) = tasks(units, m, ranks);
    // Encoder tasks (placeable anywhere): forward and, if any, backward per mb,
    // which share a rank.
    let movable: Vec<usize> = (0..ts.len()).filter(|&t| where_[t].len() > 1).collect();
    let per_mb = if units[0].trainable { 2 } else { 1 };
    let mut best = f64::INFINITY;
    for code in 0..ranks.pow(m as u32) {
        let mut rank_of: Vec<usize> = where_.iter().map(|w| w[0]).collect();
        for mb in 0..m {
            let r = code / ranks.pow(mb as u32) % ranks;
            for &t in &movable[mb * per_mb..(mb + 1) * per_mb] {
                rank_of[t] = r;
            }
        }
        let lists: Vec<Vec<usize>> = (0..ranks)
            .map(|r| (0..ts.len()).filter(|&t| rank_of[t] == r).collect())
            .collect();
        let per_rank: Vec<Vec<Vec<usize>>> = lists.iter().map(|l| orders(&ts, l)).collect();
        // Every combination of the ranks' orders.
        let mut idx = vec![0usize; ranks];
        'combos: loop {
            let chosen: Vec<Vec<usize>> = (0..ranks).map(|r| per_rank[r][idx[r]].clone()).collect();
            if let Some(t) = makespan(&ts, &chosen) {
                best = best.min(t);
            }
            // The next combination (an odometer over the ranks' orders).
            let mut r = 0;
            loop {
                if r == ranks {
                    break 'combos;
                }
                idx[r] += 1;
                if idx[r] < per_rank[r].len() {
                    break;
                }
                idx[r] = 0;
                r += 1;
            }
        }
    }
    best
}

fn check(units: &[Unit], m: usize, ranks: usize) -> Result<(f64, f64), TestCaseError> {
    let bound = lower_bound(units, ranks, m, None);
    let opt = optimum(units, m, ranks);
    prop_assert!(
        bound.value() <= opt * (1.0 + 1e-9),
        "bound {bound:?} above the optimum {opt} ({ranks} ranks, {m} micro-batches, units {units:?})"
    );
    Ok((bound.value(), opt))
}

fn cost() -> impl Strategy<Value = (f64, f64, f64)> {
    (1u32..6, 1u32..6, 0u32..4).prop_map(|(f, b, w)| (f as f64, b as f64, w as f64))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// 2 ranks, 2 stages, 2 micro-batches, a frozen or trainable encoder.
    #[test]
    fn looped_two_ranks(enc in cost(), s0 in cost(), s1 in cost(), trainable: bool) {
        let units = vec![
            unit("vision", &[], 0, trainable, enc),
            unit("llm.0", &["vision"], 0, true, s0),
            unit("llm.1", &["llm.0"], 1, true, s1),
        ];
        check(&units, 2, 2)?;
    }

    /// 3 ranks, 3 stages, 2 micro-batches, a frozen encoder.
    #[test]
    fn looped_three_ranks(enc in cost(), s in prop::array::uniform3(cost())) {
        let units = vec![
            unit("vision", &[], 0, false, enc),
            unit("llm.0", &["vision"], 0, true, s[0]),
            unit("llm.1", &["llm.0"], 1, true, s[1]),
            unit("llm.2", &["llm.1"], 2, true, s[2]),
        ];
        check(&units, 2, 3)?;
    }

    /// 2 ranks, 4 stages in a V (rank 0: stages 0 and 3), 1 micro-batch.
    #[test]
    fn v_shape(enc in cost(), s in prop::array::uniform4(cost()), trainable: bool) {
        let units = vec![
            unit("vision", &[], 0, trainable, enc),
            unit("llm.0", &["vision"], 0, true, s[0]),
            unit("llm.1", &["llm.0"], 1, true, s[1]),
            unit("llm.2", &["llm.1"], 1, true, s[2]),
            unit("llm.3", &["llm.2"], 0, true, s[3]),
        ];
        check(&units, 1, 2)?;
    }
}

/// On a fixed case the sharper bounds are tight where the old ones were not: an
/// unbalanced pipeline, where the heavy rank decides.
#[test]
fn the_rank_bound_is_tight_on_an_unbalanced_pipeline() {
    let units = vec![
        unit("vision", &[], 0, true, (1.0, 1.0, 0.0)),
        unit("llm.0", &["vision"], 0, true, (1.0, 1.0, 1.0)),
        unit("llm.1", &["llm.0"], 1, true, (3.0, 3.0, 3.0)),
    ];
    let b = lower_bound(&units, 2, 2, None);
    let opt = optimum(&units, 2, 2);
    assert!(b.rank > b.work && b.rank > b.chain, "{b:?}");
    assert!(b.value() <= opt);
    // Rank 1 starts after vision + llm.0's forward (2) and does 2 x 9 of work; its
    // last task is a W (no tail): 20, and the optimum reaches it.
    assert_eq!(b.rank, 20.0);
    assert_eq!(opt, 20.0);
}

/// A V whose last stage (with the LM head) is heavy: the rank holding the first and
/// the last stage cannot start the last stage before one micro-batch has passed
/// through every stage, whatever else it does, so the one-machine window bound (the
/// work released after that point) is sharper than the rank's total work, and a
/// schedule reaches it. (The exhaustive search is too slow for a V with two
/// micro-batches; the schedule is written out instead.)
#[test]
fn the_window_bound_sees_the_v_shapes_late_last_stage() {
    // Forward-only stages (frozen, no backward) behind a free encoder.
    let units = vec![
        unit("vision", &[], 0, false, (0.0, 0.0, 0.0)),
        unit("llm.0", &["vision"], 0, false, (1.0, 0.0, 0.0)),
        unit("llm.1", &["llm.0"], 1, false, (1.0, 0.0, 0.0)),
        unit("llm.2", &["llm.1"], 1, false, (1.0, 0.0, 0.0)),
        unit("llm.3", &["llm.2"], 0, false, (4.0, 0.0, 0.0)),
    ];
    let b = lower_bound(&units, 2, 2, None);
    // Rank 0's total work is 2 x (1 + 4) = 10 from time 0; but llm.3's forward
    // cannot start before 3, and rank 0 still has both of its forwards then.
    assert_eq!(b.rank, 11.0, "{b:?}");
    assert!(b.work < 11.0 && b.chain < 11.0 && b.ramp < 11.0, "{b:?}");
    // A schedule of 11: `tasks` numbers each micro-batch's tasks as the encoder's
    // forward, the stages' forwards, then each stage's B and W from the last stage
    // down (all of cost 0 here).
    let (ts, _) = tasks(&units, 2, 2);
    let per_mb = ts.len() / 2;
    let f = |mb: usize, k: usize| mb * per_mb + 1 + k;
    let b_ = |mb: usize, k: usize| mb * per_mb + 5 + 2 * (3 - k);
    let tail = |mb: usize, k: usize| [b_(mb, k), b_(mb, k) + 1];
    let mut rank0 = vec![0, f(0, 0), per_mb, f(1, 0), f(0, 3)];
    rank0.extend(tail(0, 3));
    rank0.push(f(1, 3));
    rank0.extend(tail(1, 3));
    rank0.extend(tail(0, 0));
    rank0.extend(tail(1, 0));
    let mut rank1 = vec![f(0, 1), f(0, 2), f(1, 1), f(1, 2)];
    for mb in 0..2 {
        rank1.extend(tail(mb, 2));
        rank1.extend(tail(mb, 1));
    }
    assert_eq!(rank0.len() + rank1.len(), ts.len());
    assert_eq!(makespan(&ts, &[rank0, rank1]), Some(11.0));
}
