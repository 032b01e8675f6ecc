//! The lower bound with a link under rendezvous (the time transfers between stages
//! hold their ranks, `bound.rs`) against the true optimum, found by exhaustive
//! search on small pipelines: every program of the stages' tasks and transfers,
//! that is every per-rank sequence of compute tasks and communication operations
//! (a lone `SEND` or `RECV`, or a batch of at most one `SEND` to and one `RECV` from
//! each peer), timed by the spec's rendezvous semantics. The search is a
//! branch-and-bound over the ranks' next actions, in time order; it includes
//! programs whose sends and receives between two ranks come in different orders
//! (which rule 3 forbids), so its optimum is at most that of the valid programs:
//! the bound must never exceed it.

use mpipe_core::bound::lower_bound;
use mpipe_core::program::{Cost, Unit};
use mpipe_core::simulate::CommModel;
use proptest::prelude::*;

fn stage(k: usize, home: usize, cost: (f64, f64, f64), bytes: f64) -> Unit {
    Unit {
        role: mpipe_core::program::Role::Stage(k),
        name: format!("llm.{k}"),
        inputs: if k == 0 {
            vec![]
        } else {
            vec![format!("llm.{}", k - 1)]
        },
        home,
        trainable: true,
        cost: Cost {
            f: cost.0,
            b: cost.1,
            w: cost.2,
        },
        act: 0.0,
        bytes,
        params: 0.0,
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    F,
    B,
    W,
}

/// A compute task (`F`, `B` or `W` of a stage and micro-batch, numbered by `id` in
/// [`model`]): where it runs and what it costs.
#[derive(Clone, Copy, Debug)]
struct Task {
    rank: usize,
    cost: f64,
}

/// A transfer: the activation of `stage` (to the next stage) or its gradient (to
/// the previous one), for one micro-batch.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    from: usize,
    to: usize,
    /// The task that produces it (on `from`).
    producer: usize,
    time: f64,
}

struct Model {
    tasks: Vec<Task>,
    transfers: Vec<Transfer>,
    ranks: usize,
    /// `deps[t]`: what task `t` needs on its own rank: tasks done there, and
    /// transfers received there.
    deps: Vec<(Vec<usize>, Vec<usize>)>,
}

fn model(units: &[Unit], m: usize, ranks: usize, link: CommModel) -> Model {
    let s = units.len();
    let mut tasks = Vec::new();
    let id = |k: usize, mb: usize, op: Op| (mb * s + k) * 3 + op as usize;
    for mb in 0..m {
        for (k, u) in units.iter().enumerate() {
            for (op, cost) in [(Op::F, u.cost.f), (Op::B, u.cost.b), (Op::W, u.cost.w)] {
                debug_assert_eq!(tasks.len(), id(k, mb, op));
                tasks.push(Task { rank: u.home, cost });
            }
        }
    }
    let mut transfers = Vec::new();
    let mut deps = vec![(Vec::new(), Vec::new()); tasks.len()];
    for mb in 0..m {
        for k in 0..s {
            let (f, b, w) = (id(k, mb, Op::F), id(k, mb, Op::B), id(k, mb, Op::W));
            deps[b].0.push(f);
            deps[w].0.push(b);
            if k == 0 {
                continue;
            }
            let (q, r) = (units[k - 1].home, units[k].home);
            let (qf, qb) = (id(k - 1, mb, Op::F), id(k - 1, mb, Op::B));
            if q == r {
                deps[f].0.push(qf);
                deps[qb].0.push(b);
            } else {
                let time = |u: &Unit| link.latency + u.bytes / link.bandwidth;
                transfers.push(Transfer {
                    from: q,
                    to: r,
                    producer: qf,
                    time: time(&units[k - 1]),
                });
                deps[f].1.push(transfers.len() - 1);
                transfers.push(Transfer {
                    from: r,
                    to: q,
                    producer: b,
                    time: time(&units[k]),
                });
                deps[qb].1.push(transfers.len() - 1);
            }
        }
    }
    Model {
        tasks,
        transfers,
        ranks,
        deps,
    }
}

/// The search's state: per rank its clock (when it is free, or when it reached the
/// operation it is blocked in) and that operation's members; per task its end; per
/// transfer when its sender and its receiver reached it, and whether it completed.
#[derive(Clone)]
struct State {
    clock: Vec<f64>,
    blocked: Vec<Option<Vec<usize>>>,
    end: Vec<Option<f64>>,
    sent: Vec<Option<f64>>,
    recv: Vec<Option<f64>>,
    arrived: Vec<bool>,
}

impl Model {
    /// Complete every operation whose members' partners have all been reached.
    fn settle(&self, st: &mut State) {
        loop {
            let mut changed = false;
            for r in 0..self.ranks {
                let Some(members) = &st.blocked[r] else {
                    continue;
                };
                let all = members
                    .iter()
                    .all(|&x| st.sent[x].is_some() && st.recv[x].is_some());
                if !all {
                    continue;
                }
                let done = members
                    .iter()
                    .map(|&x| {
                        let tr = &self.transfers[x];
                        st.sent[x].unwrap().max(st.recv[x].unwrap()) + tr.time
                    })
                    .fold(st.clock[r], f64::max);
                for &x in members {
                    if self.transfers[x].to == r {
                        st.arrived[x] = true;
                    }
                }
                st.clock[r] = done;
                st.blocked[r] = None;
                changed = true;
            }
            if !changed {
                return;
            }
        }
    }

    fn ready(&self, st: &State, t: usize) -> bool {
        let (tasks, transfers) = &self.deps[t];
        st.end[t].is_none()
            && tasks.iter().all(|&d| st.end[d].is_some())
            && transfers.iter().all(|&x| st.arrived[x])
    }

    /// The operations rank `r` may post: every non-empty set of at most one
    /// unposted send to and one unposted receive from each peer (a send once its
    /// producer has run).
    fn operations(&self, st: &State, r: usize) -> Vec<Vec<usize>> {
        let mut ops: Vec<Vec<usize>> = vec![Vec::new()];
        for peer in (0..self.ranks).filter(|&p| p != r) {
            let sends: Vec<usize> = (0..self.transfers.len())
                .filter(|&x| {
                    let tr = &self.transfers[x];
                    tr.from == r
                        && tr.to == peer
                        && st.sent[x].is_none()
                        && st.end[tr.producer].is_some()
                })
                .collect();
            let recvs: Vec<usize> = (0..self.transfers.len())
                .filter(|&x| {
                    let tr = &self.transfers[x];
                    tr.to == r && tr.from == peer && st.recv[x].is_none()
                })
                .collect();
            let mut next = Vec::new();
            for op in &ops {
                for s in std::iter::once(None).chain(sends.iter().map(Some)) {
                    for v in std::iter::once(None).chain(recvs.iter().map(Some)) {
                        let mut o = op.clone();
                        o.extend(s.copied());
                        o.extend(v.copied());
                        next.push(o);
                    }
                }
            }
            ops = next;
        }
        ops.retain(|o| !o.is_empty());
        ops
    }

    fn search(&self, st: &State, best: &mut f64) {
        let mut st = st.clone();
        self.settle(&mut st);
        let left = |r: usize| -> f64 {
            (0..self.tasks.len())
                .filter(|&t| self.tasks[t].rank == r && st.end[t].is_none())
                .map(|t| self.tasks[t].cost)
                .sum()
        };
        if (0..self.ranks).any(|r| st.clock[r] + left(r) >= *best) {
            return;
        }
        let finished = st.end.iter().all(Option::is_some) && st.arrived.iter().all(|&a| a);
        if finished {
            *best = st.clock.iter().copied().fold(0.0, f64::max);
            return;
        }
        // The free rank with the earliest clock decides next (any order of the
        // decisions gives the same timing: each depends on its rank's history only).
        let Some(r) = (0..self.ranks)
            .filter(|&r| st.blocked[r].is_none() && self.has_work(&st, r))
            .min_by(|&a, &b| st.clock[a].total_cmp(&st.clock[b]))
        else {
            return; // deadlock: every rank with work left is blocked
        };
        for t in (0..self.tasks.len()).filter(|&t| self.tasks[t].rank == r) {
            if self.ready(&st, t) {
                let mut next = st.clone();
                next.clock[r] += self.tasks[t].cost;
                next.end[t] = Some(next.clock[r]);
                self.search(&next, best);
            }
        }
        for op in self.operations(&st, r) {
            let mut next = st.clone();
            for &x in &op {
                if self.transfers[x].from == r {
                    next.sent[x] = Some(st.clock[r]);
                } else {
                    next.recv[x] = Some(st.clock[r]);
                }
            }
            next.blocked[r] = Some(op);
            self.search(&next, best);
        }
    }

    fn has_work(&self, st: &State, r: usize) -> bool {
        (0..self.tasks.len()).any(|t| self.tasks[t].rank == r && st.end[t].is_none())
            || self.transfers.iter().enumerate().any(|(x, tr)| {
                (tr.from == r && st.sent[x].is_none()) || (tr.to == r && st.recv[x].is_none())
            })
    }

    /// The least makespan over every program.
    fn optimum(&self) -> f64 {
        let st = State {
            clock: vec![0.0; self.ranks],
            blocked: vec![None; self.ranks],
            end: vec![None; self.tasks.len()],
            sent: vec![None; self.transfers.len()],
            recv: vec![None; self.transfers.len()],
            arrived: vec![false; self.transfers.len()],
        };
        // Everything one after the other is a schedule: a finite start.
        let serial: f64 = self.tasks.iter().map(|t| t.cost).sum::<f64>()
            + self.transfers.iter().map(|x| x.time).sum::<f64>();
        let mut best = serial * 2.0 + 1.0;
        self.search(&st, &mut best);
        best
    }
}

fn check(units: &[Unit], m: usize, ranks: usize, link: CommModel) -> Result<(), TestCaseError> {
    let bound = lower_bound(units, ranks, m, Some(link));
    let free = lower_bound(units, ranks, m, None);
    let opt = model(units, m, ranks, link).optimum();
    prop_assert!(
        bound.value() <= opt * (1.0 + 1e-9),
        "bound {bound:?} above the optimum {opt} ({ranks} ranks, {m} micro-batches, {link:?}, units {units:?})"
    );
    prop_assert!(
        bound.ramp >= free.ramp && bound.transfers > 0.0,
        "{bound:?} {free:?}"
    );
    Ok(())
}

fn cost() -> impl Strategy<Value = (f64, f64, f64)> {
    (1u32..5, 1u32..5, 0u32..3).prop_map(|(f, b, w)| (f as f64, b as f64, w as f64))
}

fn link() -> impl Strategy<Value = CommModel> {
    (0u32..3, 1u32..4).prop_map(|(latency, bandwidth)| CommModel {
        latency: latency as f64,
        bandwidth: bandwidth as f64,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// 2 ranks, 2 stages, 2 micro-batches.
    #[test]
    fn two_ranks(s0 in cost(), s1 in cost(), bytes in (1u32..4, 1u32..4), link in link()) {
        let units = vec![
            stage(0, 0, s0, bytes.0 as f64),
            stage(1, 1, s1, bytes.1 as f64),
        ];
        check(&units, 2, 2, link)?;
    }

    /// 3 ranks, 3 stages, 1 micro-batch: the middle rank has two peers.
    #[test]
    fn three_ranks(s in prop::array::uniform3(cost()), bytes in 1u32..4, link in link()) {
        let units: Vec<Unit> = (0..3).map(|k| stage(k, k, s[k], bytes as f64)).collect();
        check(&units, 1, 3, link)?;
    }

    /// 2 ranks, 4 stages in a V (rank 0: stages 0 and 3), 1 micro-batch: each rank
    /// sends an activation and a gradient to the other.
    #[test]
    fn v_shape(s in prop::array::uniform4(cost()), link in link()) {
        let homes = [0, 1, 1, 0];
        let units: Vec<Unit> = (0..4).map(|k| stage(k, homes[k], s[k], 1.0)).collect();
        check(&units, 1, 2, link)?;
    }
}

/// Where the transfers decide: two ranks whose stages are short next to their
/// transfers, so the step is mostly the ranks held in transfers. The bound counts
/// them, the optimum needs them, and the bound without a link is far below.
#[test]
fn transfers_that_dominate_are_counted() {
    let link = CommModel {
        latency: 2.0,
        bandwidth: 1.0,
    };
    let units = vec![
        stage(0, 0, (1.0, 1.0, 0.0), 1.0),
        stage(1, 1, (1.0, 1.0, 0.0), 1.0),
    ];
    let with = lower_bound(&units, 2, 2, Some(link));
    let without = lower_bound(&units, 2, 2, None);
    let opt = model(&units, 2, 2, link).optimum();
    // Each rank sends two tensors of time 3 to the other, one per operation: each
    // is held 6, on top of its 4 of compute and the pipeline's ramp.
    assert_eq!(with.transfers, 6.0, "{with:?}");
    assert_eq!(with.ramp, without.ramp + 6.0, "{with:?} {without:?}");
    assert!(with.value() > without.value(), "{with:?} {without:?}");
    assert!(with.value() <= opt, "{with:?} {opt}");
    // The hand-timed best: rank 0 F(0) [0, 1], sends it [1, 4]; F(1) [4, 5], then
    // sends it batched with receiving the first gradient [6, 9]; B(0) [9, 10];
    // receives the second gradient [10, 14]; B(1) [14, 15].
    assert_eq!(opt, 15.0);
}
