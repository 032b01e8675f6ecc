//! Bigger cases for the verifier and the simulator: hand-built GPipe and 1F1B
//! programs (with closed-form makespans and peaks), and a naive, obviously-correct
//! reference simulator compared with `simulate` on many small random programs.

use std::collections::BTreeMap;

use mpipe_core::program::{Action, ActionRef, CollKind, Cost, Dir, Op, Program, Tensor, Unit};
use mpipe_core::simulate::{simulate, CommModel, Mode, SimError, SimOptions};
use mpipe_core::verify::{verify, verify_mode, Rule};
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// Builders.

fn unit(name: String, inputs: Vec<String>, home: usize, cost: Cost, act: f64) -> Unit {
    Unit {
        role: mpipe_core::program::Role::of_name(&name),
        name,
        inputs,
        home,
        trainable: true,
        cost,
        act,
        bytes: 0.0,
        params: 0.0,
    }
}

/// `ranks` stages of `v` consecutive units each; unit `s{r}.{k}` lives on rank r.
fn stage_units(ranks: usize, v: usize, cost: Cost) -> Vec<Unit> {
    let mut units: Vec<Unit> = Vec::new();
    for r in 0..ranks {
        for k in 0..v {
            let inputs = units
                .last()
                .map(|u| vec![u.name.clone()])
                .unwrap_or_default();
            units.push(unit(format!("s{r}.{k}"), inputs, r, cost, 1.0));
        }
    }
    units
}

fn name(r: usize, k: usize) -> String {
    format!("s{r}.{k}")
}

struct Builder {
    ranks: usize,
    v: usize,
    list: Vec<Action>,
    r: usize,
    batch: u64,
}

impl Builder {
    fn first(&self) -> bool {
        self.r == 0
    }
    fn last(&self) -> bool {
        self.r + 1 == self.ranks
    }
    fn fwd(&mut self, m: usize) {
        for k in 0..self.v {
            self.list.push(Action::compute(Op::F, name(self.r, k), m));
        }
    }
    fn bwd(&mut self, m: usize) {
        for k in (0..self.v).rev() {
            self.list.push(Action::compute(Op::B, name(self.r, k), m));
            self.list.push(Action::compute(Op::W, name(self.r, k), m));
        }
    }
    fn recv_act(&mut self, m: usize, batch: Option<u64>) {
        if !self.first() {
            let u = name(self.r - 1, self.v - 1);
            let a = Action::p2p(Dir::Recv, Tensor::Act, u, m, self.r - 1, batch);
            self.list.push(a);
        }
    }
    fn send_act(&mut self, m: usize, batch: Option<u64>) {
        if !self.last() {
            let u = name(self.r, self.v - 1);
            let a = Action::p2p(Dir::Send, Tensor::Act, u, m, self.r + 1, batch);
            self.list.push(a);
        }
    }
    fn recv_grad(&mut self, m: usize, batch: Option<u64>) {
        if !self.last() {
            let u = name(self.r + 1, 0);
            let a = Action::p2p(Dir::Recv, Tensor::Grad, u, m, self.r + 1, batch);
            self.list.push(a);
        }
    }
    fn send_grad(&mut self, m: usize, batch: Option<u64>) {
        if !self.first() {
            let u = name(self.r, 0);
            let a = Action::p2p(Dir::Send, Tensor::Grad, u, m, self.r - 1, batch);
            self.list.push(a);
        }
    }
    fn next_batch(&mut self) -> Option<u64> {
        self.batch += 1;
        Some(self.batch)
    }
}

fn program(ranks: usize, m: usize, units: Vec<Unit>, lists: Vec<Vec<Action>>) -> Program {
    Program {
        format: mpipe_core::program::FORMAT.into(),
        ranks,
        microbatches: m,
        units,
        programs: lists,
        source: None,
        prefetch: Vec::new(),
    }
}

const UNIT_COST: Cost = Cost {
    f: 1.0,
    b: 1.0,
    w: 1.0,
};

/// GPipe: all forwards, then all backwards.
fn gpipe(ranks: usize, m: usize, v: usize) -> Program {
    let mut lists = Vec::new();
    for r in 0..ranks {
        let mut b = Builder {
            ranks,
            v,
            list: Vec::new(),
            r,
            batch: 0,
        };
        for i in 0..m {
            b.recv_act(i, None);
            b.fwd(i);
            b.send_act(i, None);
        }
        for i in 0..m {
            b.recv_grad(i, None);
            b.bwd(i);
            b.send_grad(i, None);
        }
        lists.push(b.list);
    }
    program(ranks, m, stage_units(ranks, v, UNIT_COST), lists)
}

/// 1F1B with Megatron-style batched `send_forward_recv_backward` /
/// `send_backward_recv_forward` in the steady state.
fn onef1b(ranks: usize, m: usize, v: usize) -> Program {
    let mut lists = Vec::new();
    for r in 0..ranks {
        let mut b = Builder {
            ranks,
            v,
            list: Vec::new(),
            r,
            batch: 0,
        };
        let warm = (ranks - r - 1).min(m);
        let steady = m - warm;
        for i in 0..warm {
            b.recv_act(i, None);
            b.fwd(i);
            b.send_act(i, None);
        }
        if steady > 0 {
            b.recv_act(warm, None);
        }
        for i in 0..steady {
            let (mf, mb) = (warm + i, i);
            b.fwd(mf);
            let batch = b.next_batch();
            b.send_act(mf, batch);
            b.recv_grad(mb, batch);
            b.bwd(mb);
            if i + 1 == steady {
                b.send_grad(mb, None);
            } else {
                let batch = b.next_batch();
                b.send_grad(mb, batch);
                b.recv_act(mf + 1, batch);
            }
        }
        for i in steady..m {
            b.recv_grad(i, None);
            b.bwd(i);
            b.send_grad(i, None);
        }
        lists.push(b.list);
    }
    program(ranks, m, stage_units(ranks, v, UNIT_COST), lists)
}

// ---------------------------------------------------------------------------
// Closed forms.

#[test]
fn gpipe_is_valid_with_closed_forms() {
    for (ranks, m, v) in [(1, 1, 1), (1, 4, 2), (2, 3, 1), (4, 8, 2), (5, 3, 1)] {
        let p = gpipe(ranks, m, v);
        assert_eq!(verify(&p), vec![], "gpipe {ranks}x{m}x{v}");
        let r = simulate(&p, &SimOptions::default()).unwrap();
        let (f, b) = (v as f64, 2.0 * v as f64);
        let expect = (m + ranks - 1) as f64 * (f + b);
        assert_eq!(r.makespan, expect, "gpipe {ranks}x{m}x{v}");
        let bubble = (ranks - 1) as f64 / (m + ranks - 1) as f64;
        assert!((r.bubble - bubble).abs() < 1e-12);
        assert_eq!(r.peak_memory, vec![(m * v) as f64; ranks]);
        assert_eq!(r.compute, vec![m as f64 * (f + b); ranks]);
        // Eager gives the same here: every receiver is ready in time.
        let e = simulate(
            &p,
            &SimOptions {
                mode: Mode::Eager,
                comm: None,
            },
        )
        .unwrap();
        assert_eq!(e.makespan, expect);
    }
}

#[test]
fn onef1b_is_valid_with_closed_forms() {
    for (ranks, m, v) in [
        (1, 3, 1),
        (2, 2, 1),
        (2, 5, 2),
        (4, 4, 1),
        (4, 9, 3),
        (8, 16, 1),
    ] {
        let p = onef1b(ranks, m, v);
        assert_eq!(verify(&p), vec![], "1f1b {ranks}x{m}x{v}");
        let r = simulate(&p, &SimOptions::default()).unwrap();
        let (f, b) = (v as f64, 2.0 * v as f64);
        assert_eq!(
            r.makespan,
            (m + ranks - 1) as f64 * (f + b),
            "1f1b {ranks}x{m}x{v}"
        );
        let peaks: Vec<f64> = (0..ranks)
            .map(|k| ((ranks - k).min(m) * v) as f64)
            .collect();
        assert_eq!(r.peak_memory, peaks, "1f1b {ranks}x{m}x{v}");
        assert_eq!(
            reference(&p, Mode::Rendezvous, None).unwrap().makespan,
            r.makespan
        );
    }
}

/// The same 1F1B without batching deadlocks under rendezvous (the classic crossing
/// of `SEND act` and `SEND grad`), and is fine under eager.
#[test]
fn unbatched_onef1b_deadlocks_under_rendezvous_only() {
    let mut p = onef1b(2, 4, 1);
    for list in &mut p.programs {
        for a in list {
            a.set_batch(None);
        }
    }
    let vs = verify(&p);
    assert!(
        !vs.is_empty() && vs.iter().all(|v| v.rule == Rule::Termination),
        "{vs:?}"
    );
    assert_eq!(vs.len(), 2);
    assert!(matches!(
        simulate(&p, &SimOptions::default()),
        Err(SimError::Deadlock { .. })
    ));
    assert_eq!(verify_mode(&p, Mode::Eager), vec![]);
    assert!(reference(&p, Mode::Rendezvous, None).is_none());
}

/// A sizeable program: every action resolves, and the report is deterministic.
#[test]
fn medium_program_is_deterministic() {
    let p = onef1b(8, 64, 2);
    assert_eq!(verify(&p), vec![]);
    let a = simulate(&p, &SimOptions::default()).unwrap();
    let b = simulate(&p, &SimOptions::default()).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.makespan, (64 + 7) as f64 * 6.0);
}

// ---------------------------------------------------------------------------
// The naive reference simulator: step by step, straight from the spec's words.

struct RefReport {
    makespan: f64,
    peaks: Vec<f64>,
    slots: Vec<Vec<(f64, f64)>>,
}

fn batch_of(a: &Action) -> Option<u64> {
    a.batch()
}

/// The `[lo, hi)` operation (batch or single action) holding action `i`.
fn op_range(list: &[Action], i: usize) -> (usize, usize) {
    let Some(b) = batch_of(&list[i]) else {
        return (i, i + 1);
    };
    let mut lo = i;
    while lo > 0 && batch_of(&list[lo - 1]) == Some(b) {
        lo -= 1;
    }
    let mut hi = i + 1;
    while hi < list.len() && batch_of(&list[hi]) == Some(b) {
        hi += 1;
    }
    (lo, hi)
}

fn unit_of<'a>(p: &'a Program, name: &str) -> &'a Unit {
    p.units.iter().find(|u| u.name == name).unwrap()
}

/// The k-th same transfer on this rank pairs with the k-th opposite one on the peer.
fn p2p_partner(p: &Program, r: usize, i: usize) -> Option<(usize, usize)> {
    let ActionRef::P2p(me) = p.programs[r][i].view() else {
        return None;
    };
    let same = |a: &Action, dir: Dir, peer: usize| {
        matches!(a.view(), ActionRef::P2p(x) if x.dir == dir && x.tensor == me.tensor
            && x.unit == me.unit && x.mb == me.mb && x.peer == peer)
    };
    let k = p.programs[r][..i]
        .iter()
        .filter(|a| same(a, me.dir, me.peer))
        .count();
    let other = if me.dir == Dir::Send {
        Dir::Recv
    } else {
        Dir::Send
    };
    p.programs[me.peer]
        .iter()
        .enumerate()
        .filter(|(_, a)| same(a, other, r))
        .nth(k)
        .map(|(j, _)| (me.peer, j))
}

type Ident = (CollKind, String, usize, Vec<usize>);

fn ident(a: &Action) -> Option<Ident> {
    let ActionRef::Coll(c) = a.view() else {
        return None;
    };
    let mut g = c.group.to_vec();
    g.sort();
    g.dedup();
    Some((c.kind, c.unit.to_string(), c.root, g))
}

/// For each other group member: the same collective's same occurrence there.
fn coll_partners(p: &Program, r: usize, i: usize) -> Vec<Option<(usize, usize)>> {
    let me = ident(&p.programs[r][i]).unwrap();
    let k = p.programs[r][..i]
        .iter()
        .filter(|a| ident(a).as_ref() == Some(&me))
        .count();
    me.3.iter()
        .filter(|&&g| g != r)
        .map(|&g| {
            p.programs[g]
                .iter()
                .enumerate()
                .filter(|(_, a)| ident(a).as_ref() == Some(&me))
                .nth(k)
                .map(|(j, _)| (g, j))
        })
        .collect()
}

fn reference(p: &Program, mode: Mode, comm: Option<CommModel>) -> Option<RefReport> {
    let n = p.programs.len();
    let mut pc = vec![0usize; n];
    let mut now = vec![0.0f64; n];
    let mut reach: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    let mut slots: Vec<Vec<(f64, f64)>> = p
        .programs
        .iter()
        .map(|l| vec![(0.0, 0.0); l.len()])
        .collect();
    let reach_of = |reach: &BTreeMap<(usize, usize), f64>, (q, j): (usize, usize)| {
        let lo = op_range(&p.programs[q], j).0;
        reach.get(&(q, lo)).copied()
    };
    loop {
        let mut progress = false;
        for r in 0..n {
            let list = &p.programs[r];
            while pc[r] < list.len() {
                let i = pc[r];
                if let ActionRef::Compute(c) = list[i].view() {
                    let d = c.op.cost(&unit_of(p, c.unit).cost);
                    slots[r][i] = (now[r], now[r] + d);
                    now[r] += d;
                    pc[r] += 1;
                    progress = true;
                    continue;
                }
                let (lo, hi) = op_range(list, i);
                if let std::collections::btree_map::Entry::Vacant(e) = reach.entry((r, lo)) {
                    e.insert(now[r]);
                    progress = true;
                }
                let rx = reach[&(r, lo)];
                // Every partner that matters must be reached.
                let mut done = Some(rx);
                for (j, a) in list.iter().enumerate().take(hi).skip(lo) {
                    match a.view() {
                        ActionRef::P2p(x) => {
                            let tr = comm.map_or(0.0, |c| {
                                c.latency + unit_of(p, x.unit).bytes / c.bandwidth
                            });
                            let needed = mode == Mode::Rendezvous || x.dir == Dir::Recv;
                            if !needed {
                                continue;
                            }
                            let rp = p2p_partner(p, r, j).and_then(|q| reach_of(&reach, q));
                            done = match (done, rp) {
                                (Some(d), Some(rp)) => Some(if mode == Mode::Rendezvous {
                                    d.max(rx.max(rp) + tr)
                                } else {
                                    d.max(rx.max(rp + tr))
                                }),
                                _ => None,
                            };
                        }
                        ActionRef::Coll(c) => {
                            let mut t = Some(rx);
                            for q in coll_partners(p, r, j) {
                                t = match (t, q.and_then(|q| reach_of(&reach, q))) {
                                    (Some(a), Some(b)) => Some(a.max(b)),
                                    _ => None,
                                };
                            }
                            let cost = comm.map_or(0.0, |m| {
                                m.latency + unit_of(p, c.unit).params / m.bandwidth
                            });
                            done = t.map(|t| t + cost);
                        }
                        ActionRef::Compute(_) => unreachable!(),
                    }
                }
                let Some(done) = done else { break };
                for s in &mut slots[r][lo..hi] {
                    *s = (rx, done);
                }
                now[r] = done;
                pc[r] = hi;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    if (0..n).any(|r| pc[r] < p.programs[r].len()) {
        return None;
    }
    // Memory: intervals [start of holding forward, end of consumer).
    let mut peaks = Vec::new();
    for (r, list) in p.programs.iter().enumerate() {
        let mut keys: Vec<(String, usize)> = Vec::new();
        for a in list {
            if let ActionRef::Compute(c) = a.view() {
                let k = (c.unit.to_string(), c.mb);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        let mut intervals = Vec::new();
        for (u, m) in keys {
            let find = |ops: &[Op], before: usize| {
                (0..before).rev().find(|&i| {
                    matches!(list[i].view(), ActionRef::Compute(c)
                        if c.unit == u && c.mb == m && ops.contains(&c.op))
                })
            };
            let consumer =
                find(&[Op::W], list.len()).or_else(|| find(&[Op::B, Op::BW], list.len()));
            let Some(c) = consumer else { continue };
            let Some(h) = find(&[Op::F, Op::RF], c) else {
                continue;
            };
            intervals.push((slots[r][h].0, slots[r][c].1, unit_of(p, &u).act));
        }
        let mut peak = 0.0f64;
        for &(t, _, _) in &intervals {
            let held: f64 = intervals
                .iter()
                .filter(|&&(s, e, _)| s <= t && t < e)
                .map(|x| x.2)
                .sum();
            peak = peak.max(held);
        }
        peaks.push(peak);
    }
    let makespan = now.iter().copied().fold(0.0, f64::max);
    Some(RefReport {
        makespan,
        peaks,
        slots,
    })
}

// ---------------------------------------------------------------------------
// Random small programs.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// A GPipe-like program over a random chain of units placed on random ranks,
/// built in a global order that cannot deadlock, then perturbed (adjacent swaps,
/// random batches, collectives, duplicated transfers), so that some deadlock.
fn random_program(seed: u64) -> (Program, Mode, Option<CommModel>) {
    let mut g = Rng(seed | 1);
    let ranks = 1 + g.below(3) as usize;
    let m = 1 + g.below(3) as usize;
    let s_count = 1 + g.below(4) as usize;
    let place: Vec<usize> = (0..s_count)
        .map(|_| g.below(ranks as u64) as usize)
        .collect();
    let mut units = Vec::new();
    for (s, &home) in place.iter().enumerate() {
        let inputs = if s == 0 {
            vec![]
        } else {
            vec![format!("u{}", s - 1)]
        };
        let cost = Cost {
            f: g.below(4) as f64,
            b: g.below(4) as f64,
            w: g.below(3) as f64,
        };
        let mut u = unit(format!("u{s}"), inputs, home, cost, g.below(4) as f64);
        u.trainable = g.chance(70);
        u.bytes = g.below(5) as f64;
        u.params = g.below(5) as f64;
        units.push(u);
    }
    let mut lists: Vec<Vec<Action>> = vec![Vec::new(); ranks];
    let name = |s: usize| format!("u{s}");
    let transfer =
        |lists: &mut Vec<Vec<Action>>, t: Tensor, s: usize, mb: usize, a: usize, b: usize| {
            lists[a].push(Action::p2p(Dir::Send, t, name(s), mb, b, None));
            lists[b].push(Action::p2p(Dir::Recv, t, name(s), mb, a, None));
        };
    for mb in 0..m {
        for s in 0..s_count {
            let op = if g.chance(15) { Op::RF } else { Op::F };
            lists[place[s]].push(Action::compute(op, name(s), mb));
            if s + 1 < s_count && place[s + 1] != place[s] {
                transfer(&mut lists, Tensor::Act, s, mb, place[s], place[s + 1]);
                if g.chance(10) {
                    transfer(&mut lists, Tensor::Act, s, mb, place[s], place[s + 1]);
                }
            }
        }
    }
    for mb in 0..m {
        for s in (0..s_count).rev() {
            let fused = g.chance(50);
            lists[place[s]].push(Action::compute(
                if fused { Op::BW } else { Op::B },
                name(s),
                mb,
            ));
            if s > 0 && place[s - 1] != place[s] {
                transfer(&mut lists, Tensor::Grad, s, mb, place[s], place[s - 1]);
            }
            if !fused {
                lists[place[s]].push(Action::compute(Op::W, name(s), mb));
            }
        }
    }
    if g.chance(40) {
        let group: Vec<usize> = (0..ranks).collect();
        for list in &mut lists {
            if g.chance(90) {
                let at = g.below(list.len() as u64 + 1) as usize;
                let a = Action::coll(CollKind::Bcast, name(0), 0, group.clone());
                list.insert(at, a);
            }
        }
    }
    let swaps = if g.chance(50) { 0 } else { g.below(4) };
    for _ in 0..swaps {
        let r = g.below(ranks as u64) as usize;
        if lists[r].len() >= 2 {
            let i = g.below(lists[r].len() as u64 - 1) as usize;
            lists[r].swap(i, i + 1);
        }
    }
    let mut next_batch = 0;
    for list in &mut lists {
        for i in 1..list.len() {
            let both = matches!(list[i - 1], Action::SEND { .. } | Action::RECV { .. })
                && matches!(list[i], Action::SEND { .. } | Action::RECV { .. });
            if both && g.chance(40) {
                let b = batch_of(&list[i - 1]).unwrap_or_else(|| {
                    next_batch += 1;
                    next_batch
                });
                for a in [i - 1, i] {
                    list[a].set_batch(Some(b));
                }
            }
        }
    }
    let mode = if g.chance(50) {
        Mode::Rendezvous
    } else {
        Mode::Eager
    };
    let comm = if g.chance(50) {
        None
    } else {
        Some(CommModel {
            latency: g.below(3) as f64,
            bandwidth: [1.0, 2.0, 4.0][g.below(3) as usize],
        })
    };
    (program(ranks, m, units, lists), mode, comm)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// `simulate` agrees with the naive reference on deadlock, makespan, per-rank
    /// peaks and the whole timeline; under free communication, rule 5 of the
    /// verifier agrees too.
    #[test]
    fn simulate_matches_reference(seed in any::<u64>()) {
        let (p, mode, comm) = random_program(seed);
        let fast = simulate(&p, &SimOptions { mode, comm });
        let slow = reference(&p, mode, comm);
        match (&fast, &slow) {
            (Ok(f), Some(s)) => {
                prop_assert_eq!(f.makespan, s.makespan);
                prop_assert_eq!(&f.peak_memory, &s.peaks);
                let slots: Vec<Vec<(f64, f64)>> = f.timeline.ranks.iter()
                    .map(|l| l.iter().map(|x| (x.start, x.end)).collect()).collect();
                prop_assert_eq!(&slots, &s.slots);
            }
            (Err(SimError::Deadlock { blocked }), None) => {
                prop_assert!(!blocked.is_empty());
            }
            _ => prop_assert!(false, "simulate {:?} vs reference deadlock {}\n{}",
                fast.as_ref().map(|r| r.makespan), slow.is_none(), p.to_json()),
        }
        if comm.is_none() {
            let deadlock = verify_mode(&p, mode).iter().any(|v| v.rule == Rule::Termination);
            prop_assert_eq!(deadlock, slow.is_none());
        }
    }
}

/// The unperturbed random programs are valid except for the deliberately odd parts.
#[test]
fn random_generator_produces_both_outcomes() {
    let (mut ok, mut dead) = (0, 0);
    for seed in 0..500u64 {
        let (p, mode, _) = random_program(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        match simulate(&p, &SimOptions { mode, comm: None }) {
            Ok(_) => ok += 1,
            Err(SimError::Deadlock { .. }) => dead += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(ok > 100 && dead > 20, "ok {ok}, deadlocked {dead}");
}

/// A program of about a million actions (64 ranks x 1024 micro-batches) verifies and
/// simulates to the closed form exactly. (How fast: `cargo bench -p mpipe-core
/// --bench derive`.)
#[test]
fn a_million_action_program_verifies_and_simulates_to_the_closed_form() {
    let m = 1024;
    let p = onef1b(64, m, 4);
    assert_eq!(verify(&p), vec![]);
    let r = simulate(&p, &SimOptions::default()).unwrap();
    assert_eq!(r.makespan, (m + 63) as f64 * 12.0);
}
