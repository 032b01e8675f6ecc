//! Model-based mutation tests of the verifier.
//!
//! Take valid derived programs (several bodies, with and without `transpose`, a
//! trainable encoder with local backward so that `BCAST` / `REDUCE` exist, central
//! backward so that `RF` and `input` transfers exist, a frozen second encoder), apply
//! ONE targeted mutation at a site proptest picks, and check that `verify` rejects the
//! result with the rule the spec says the mutation breaks:
//!
//! | mutation | rule |
//! | --- | --- |
//! | drop an `F`/`B`/`W`/`BW` | 1 coverage |
//! | drop an `RF` (`RF` is outside rule 1's counts; its `BW` loses its activations) | 2 local data |
//! | duplicate an `F`/`B`/`W`/`BW` right after itself | 1 coverage |
//! | drop a `SEND` or a `RECV` | 3 matching |
//! | duplicate a `SEND` right after itself, unbatched | 3 matching |
//! | give a `SEND`/`RECV` another peer (neither itself nor the old peer) | 3 matching |
//! | move a `RECV act/grad` right after the first compute that reads it | 2 local data |
//! | move a `SEND act/grad` right before the compute that produces it | 3 matching |
//! | swap two `RECV`s of one rank from the same peer (unbatched) | 3 matching (order) |
//! | drop a `BCAST` / `REDUCE` on a group member other than the root | 4 parameters |
//!
//! The same mutations are also applied at every site of every base program (some
//! 25 000 mutants, about a second in release). Plus a hand-built deadlock (both
//! ranks send before they receive): rule 5 under rendezvous, valid under eager, and
//! valid under rendezvous once batched.

use std::sync::OnceLock;

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, ActionRef, Cost, Dir, Op, Program, Tensor, Unit, FORMAT};
use mpipe_core::simulate::Mode;
use mpipe_core::verify::{verify, verify_mode, Rule, Violation};
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// The valid programs the mutations start from.

/// A trainable `vision` encoder (so a local-backward transpose broadcasts and reduces
/// it), a frozen `audio` encoder, an LLM with enough layers for 4 ranks x 2 chunks.
const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 4
forward = 1.5
backward = 1.5
weight = 0.75
activation = 0.1
params = 2.0
trainable = true

[[encoder]]
name = "audio"
layers = 2
forward = 0.5
backward = 0.5
activation = 0.1
trainable = false

[llm]
layers = 16
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
params = 0.25
first_stage_extra = { forward = 0.3, backward = 0.3, weight = 0.3 }
last_stage_extra = { forward = 1.5, backward = 1.5, weight = 1.5 }
"#;

const EXPRS: [&str; 16] = [
    "gpipe",
    "1f1b",
    "zbh1",
    "interleaved(v = 2)",
    "zbv",
    "dualpipev",
    "transpose(vision, 1f1b)",
    "transpose(vision, zbh1)",
    "transpose(vision, zbv)",
    "transpose(vision, interleaved(v = 2), owners = min)",
    "transpose(vision, dualpipev)",
    "transpose(vision, 1f1b, backward = central)",
    "transpose(vision, zbv, backward = central)",
    "transpose(vision, gpipe, owners = min, backward = central)",
    "transpose(audio, transpose(vision, zbh1))",
    "transpose(vision, transpose(audio, 1f1b), backward = central)",
];

/// `(ranks, micro-batches)`: both valid for every body (m % p == 0, m >= 2p).
const SIZES: [(usize, usize); 2] = [(3, 6), (4, 8)];

struct Base {
    label: String,
    program: Program,
}

fn bases() -> &'static [Base] {
    static BASES: OnceLock<Vec<Base>> = OnceLock::new();
    BASES.get_or_init(|| {
        let profile = Profile::from_toml_str(PROFILE).expect("the test profile is valid");
        let mut out = Vec::new();
        for (ranks, microbatches) in SIZES {
            for expr in EXPRS {
                let req = Request::new(&profile, ranks, microbatches);
                let label = format!("`{expr}` on {ranks} ranks, {microbatches} micro-batches");
                let d = derive_str(&req, expr)
                    .unwrap_or_else(|e| panic!("{label}: derivation fails: {e:#?}"));
                let v = verify(&d.program);
                assert!(v.is_empty(), "{label}: base program is invalid: {v:#?}");
                out.push(Base {
                    label,
                    program: d.program,
                });
            }
        }
        out
    })
}

// ---------------------------------------------------------------------------
// Mutations.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    DropCompute,
    DupCompute,
    DropP2p,
    DupSend,
    RePeer,
    RecvAfterConsumer,
    SendBeforeProducer,
    SwapRecvs,
    DropBcast,
    DropReduce,
}

/// One place a mutation applies: rank, action index, and a kind-specific extra
/// (the other index of a move or swap, or a selector for the new peer).
#[derive(Clone, Copy, Debug)]
struct Site {
    rank: usize,
    index: usize,
    other: usize,
}

/// A mutated program, what was done, and what the verifier must find.
struct Mutant {
    program: Program,
    what: String,
    rule: Rule,
    /// Ranks one of which the expected violation must name (`None`: any or none).
    ranks: Option<Vec<usize>>,
}

fn unit<'a>(p: &'a Program, name: &str) -> &'a Unit {
    p.units
        .iter()
        .find(|u| u.name == name)
        .expect("a derived program's actions name its units")
}

fn peer_of(a: &Action) -> Option<usize> {
    match a.view() {
        ActionRef::P2p(t) => Some(t.peer),
        _ => None,
    }
}

fn without_batch(a: &Action) -> Action {
    match a.view() {
        ActionRef::P2p(t) => Action::p2p(t.dir, t.tensor, t.unit, t.mb, t.peer, None),
        _ => a.clone(),
    }
}

/// Where the first reader of what `RECV` `i` of rank `r` brings sits, if no other
/// source of the same data precedes that reader on the rank (then moving the `RECV`
/// just after it must break rule 2).
fn sole_consumer(p: &Program, r: usize, i: usize) -> Option<usize> {
    let list = &p.programs[r];
    let ActionRef::P2p(t) = list[i].view() else {
        return None;
    };
    // What reads the tensor, and what else on this rank could provide it.
    let reads = |a: &Action| -> bool {
        let ActionRef::Compute(c) = a.view() else {
            return false;
        };
        if c.mb != t.mb {
            return false;
        }
        match t.tensor {
            Tensor::Act => {
                matches!(c.op, Op::F | Op::RF) && unit(p, c.unit).inputs.iter().any(|n| n == t.unit)
            }
            Tensor::Grad => {
                matches!(c.op, Op::B | Op::BW) && unit(p, t.unit).inputs.iter().any(|n| n == c.unit)
            }
            Tensor::Input => false,
        }
    };
    let provides = |a: &Action| -> bool {
        match a.view() {
            ActionRef::Compute(c) => {
                c.unit == t.unit
                    && c.mb == t.mb
                    && match t.tensor {
                        Tensor::Act => matches!(c.op, Op::F | Op::RF),
                        Tensor::Grad => matches!(c.op, Op::B | Op::BW),
                        Tensor::Input => true,
                    }
            }
            ActionRef::P2p(o) => {
                o.dir == Dir::Recv && o.tensor == t.tensor && o.unit == t.unit && o.mb == t.mb
            }
            ActionRef::Coll(_) => false,
        }
    };
    let j = (i + 1..list.len()).find(|&j| reads(&list[j]))?;
    let other_source = (0..j).any(|k| k != i && provides(&list[k]));
    (!other_source).then_some(j)
}

/// Index of the first action before `i` on rank `r` that produces what `SEND` `i`
/// sends (`F`/`RF` for `act`, `B`/`BW` for `grad`).
fn first_producer(p: &Program, r: usize, i: usize) -> Option<usize> {
    let list = &p.programs[r];
    let ActionRef::P2p(t) = list[i].view() else {
        return None;
    };
    let ops: &[Op] = match t.tensor {
        Tensor::Act => &[Op::F, Op::RF],
        Tensor::Grad => &[Op::B, Op::BW],
        Tensor::Input => return None,
    };
    (0..i).find(|&k| {
        matches!(list[k].view(), ActionRef::Compute(c)
            if ops.contains(&c.op) && c.unit == t.unit && c.mb == t.mb)
    })
}

/// Every site of `kind` in `p`.
fn sites(kind: Kind, p: &Program) -> Vec<Site> {
    let mut out = Vec::new();
    for (r, list) in p.programs.iter().enumerate() {
        for (i, a) in list.iter().enumerate() {
            let site = |other| Site {
                rank: r,
                index: i,
                other,
            };
            let v = a.view();
            match kind {
                Kind::DropCompute => {
                    if matches!(v, ActionRef::Compute(_)) {
                        out.push(site(0));
                    }
                }
                Kind::DupCompute => {
                    // RF may repeat (rule 1 counts everything but RF).
                    if matches!(v, ActionRef::Compute(c) if c.op != Op::RF) {
                        out.push(site(0));
                    }
                }
                Kind::DropP2p => {
                    if matches!(v, ActionRef::P2p(_)) {
                        out.push(site(0));
                    }
                }
                Kind::DupSend => {
                    if matches!(v, ActionRef::P2p(t) if t.dir == Dir::Send) {
                        out.push(site(0));
                    }
                }
                Kind::RePeer => {
                    if matches!(v, ActionRef::P2p(_)) && p.ranks >= 3 {
                        // One site per possible new peer.
                        for q in 0..p.ranks - 2 {
                            out.push(site(q));
                        }
                    }
                }
                Kind::RecvAfterConsumer => {
                    if matches!(v, ActionRef::P2p(t) if t.dir == Dir::Recv && t.tensor != Tensor::Input)
                    {
                        if let Some(j) = sole_consumer(p, r, i) {
                            out.push(site(j));
                        }
                    }
                }
                Kind::SendBeforeProducer => {
                    if matches!(v, ActionRef::P2p(t) if t.dir == Dir::Send) {
                        if let Some(j) = first_producer(p, r, i) {
                            out.push(site(j));
                        }
                    }
                }
                Kind::SwapRecvs => {
                    if let ActionRef::P2p(t) = v {
                        if t.dir == Dir::Recv {
                            // The next RECV from the same peer.
                            let next = (i + 1..list.len()).find(|&j| {
                                matches!(list[j].view(), ActionRef::P2p(o)
                                    if o.dir == Dir::Recv && o.peer == t.peer)
                            });
                            if let Some(j) = next {
                                out.push(site(j));
                            }
                        }
                    }
                }
                Kind::DropBcast | Kind::DropReduce => {
                    let want = if kind == Kind::DropBcast {
                        mpipe_core::program::CollKind::Bcast
                    } else {
                        mpipe_core::program::CollKind::Reduce
                    };
                    if matches!(v, ActionRef::Coll(c) if c.kind == want && c.root != r) {
                        out.push(site(0));
                    }
                }
            }
        }
    }
    out
}

/// Apply the mutation `kind` at `s` to a copy of `p`.
fn mutate(kind: Kind, p: &Program, s: Site) -> Mutant {
    let mut q = p.clone();
    let (r, i) = (s.rank, s.index);
    let a = p.programs[r][i].clone();
    let list = &mut q.programs[r];
    let peer = peer_of(&a);
    let both = |peer: Option<usize>| Some(vec![r, peer.expect("a transfer has a peer")]);
    let (what, rule, ranks) = match kind {
        Kind::DropCompute => {
            list.remove(i);
            let rule = if matches!(a, Action::RF { .. }) {
                Rule::LocalData
            } else {
                Rule::Coverage
            };
            (format!("drop `{a}`"), rule, None)
        }
        Kind::DupCompute => {
            list.insert(i + 1, a.clone());
            (format!("duplicate `{a}`"), Rule::Coverage, None)
        }
        Kind::DropP2p => {
            list.remove(i);
            (format!("drop `{a}`"), Rule::Matching, both(peer))
        }
        Kind::DupSend => {
            let copy = without_batch(&a);
            list.insert(i + 1, copy.clone());
            (
                format!("insert a copy `{copy}` after `{a}`"),
                Rule::Matching,
                both(peer),
            )
        }
        Kind::RePeer => {
            let old = peer.expect("a transfer has a peer");
            let new = (0..p.ranks)
                .filter(|&x| x != r && x != old)
                .nth(s.other)
                .expect("the site selects an existing other rank");
            let ActionRef::P2p(t) = a.view() else {
                unreachable!()
            };
            let b = Action::p2p(t.dir, t.tensor, t.unit, t.mb, new, t.batch);
            list[i] = b.clone();
            (
                format!("re-peer `{a}` as `{b}`"),
                Rule::Matching,
                Some(vec![r, old, new]),
            )
        }
        Kind::RecvAfterConsumer => {
            let consumer = list[s.other].clone();
            list.remove(i);
            // The consumer moved down by one: insert right after it.
            list.insert(s.other, without_batch(&a));
            (
                format!("move `{a}` (unbatched) to just after its reader `{consumer}`"),
                Rule::LocalData,
                Some(vec![r]),
            )
        }
        Kind::SendBeforeProducer => {
            let producer = list[s.other].clone();
            list.remove(i);
            list.insert(s.other, without_batch(&a));
            (
                format!("move `{a}` (unbatched) to just before its producer `{producer}`"),
                Rule::Matching,
                Some(vec![r]),
            )
        }
        Kind::SwapRecvs => {
            let b = list[s.other].clone();
            list[i] = without_batch(&b);
            list[s.other] = without_batch(&a);
            (
                format!(
                    "swap `{a}` (action {i}) with `{b}` (action {}), both unbatched",
                    s.other
                ),
                Rule::Matching,
                both(peer),
            )
        }
        Kind::DropBcast | Kind::DropReduce => {
            list.remove(i);
            (format!("drop `{a}` on rank {r}"), Rule::Parameters, None)
        }
    };
    Mutant {
        program: q,
        what: format!("rank {r}, action {i}: {what}"),
        rule,
        ranks,
    }
}

fn show(v: &[Violation]) -> String {
    if v.is_empty() {
        return "(no violations)".into();
    }
    v.iter()
        .map(|v| format!("  {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Mutate base `b` (among those with sites of `kind`) at site `s` (modulo their
/// number) and check the verifier's verdict.
fn check(kind: Kind, b: usize, s: usize) -> Result<(), TestCaseError> {
    let eligible: Vec<(&Base, Vec<Site>)> = bases()
        .iter()
        .map(|base| (base, sites(kind, &base.program)))
        .filter(|(_, s)| !s.is_empty())
        .collect();
    prop_assert!(
        !eligible.is_empty(),
        "no base program has a site for {kind:?}"
    );
    let (base, sites) = &eligible[b % eligible.len()];
    let site = sites[s % sites.len()];
    let m = mutate(kind, &base.program, site);
    let v = verify(&m.program);
    let hit = v.iter().any(|x| {
        x.rule == m.rule
            && m.ranks
                .as_ref()
                .is_none_or(|rs| x.rank.is_some_and(|r| rs.contains(&r)))
    });
    prop_assert!(
        hit,
        "{kind:?} on {}:\n  mutation: {}\n  expected {}{} among the violations:\n{}",
        base.label,
        m.what,
        m.rule,
        m.ranks
            .as_ref()
            .map(|rs| format!(" on one of ranks {rs:?}"))
            .unwrap_or_default(),
        show(&v)
    );
    Ok(())
}

fn config() -> ProptestConfig {
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(96)
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn drop_compute_breaks_coverage(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DropCompute, b, s)?;
    }

    #[test]
    fn duplicate_compute_breaks_coverage(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DupCompute, b, s)?;
    }

    #[test]
    fn drop_transfer_breaks_matching(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DropP2p, b, s)?;
    }

    #[test]
    fn duplicate_send_breaks_matching(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DupSend, b, s)?;
    }

    #[test]
    fn repeer_breaks_matching(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::RePeer, b, s)?;
    }

    #[test]
    fn recv_after_reader_breaks_local_data(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::RecvAfterConsumer, b, s)?;
    }

    #[test]
    fn send_before_producer_breaks_matching(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::SendBeforeProducer, b, s)?;
    }

    #[test]
    fn swapped_recvs_break_matching_order(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::SwapRecvs, b, s)?;
    }

    #[test]
    fn drop_bcast_breaks_parameters(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DropBcast, b, s)?;
    }

    #[test]
    fn drop_reduce_breaks_parameters(b in any::<usize>(), s in any::<usize>()) {
        check(Kind::DropReduce, b, s)?;
    }
}

// ---------------------------------------------------------------------------
// Fixed checks.

const KINDS: [Kind; 10] = [
    Kind::DropCompute,
    Kind::DupCompute,
    Kind::DropP2p,
    Kind::DupSend,
    Kind::RePeer,
    Kind::RecvAfterConsumer,
    Kind::SendBeforeProducer,
    Kind::SwapRecvs,
    Kind::DropBcast,
    Kind::DropReduce,
];

/// The base programs really hold what the mutations need: `BCAST` / `REDUCE` (local
/// backward), `RF` and `input` transfers (central backward), split `B`/`W` and fused
/// `BW`, batched transfers; and every mutation kind has sites.
#[test]
fn base_programs_hold_every_construct() {
    let mut ops = std::collections::BTreeSet::new();
    let (mut bcast, mut reduce, mut input, mut batched) = (0, 0, 0, 0);
    for base in bases() {
        let expr = base.label.as_str();
        let p = &base.program;
        let local = expr.contains("transpose(vision") && !expr.contains("central");
        let central = expr.contains("central");
        let mut here = (0, 0, 0, 0);
        for a in p.programs.iter().flatten() {
            match a.view() {
                ActionRef::Compute(c) => {
                    ops.insert(c.op);
                    if c.op == Op::RF {
                        here.2 += 1;
                    }
                }
                ActionRef::P2p(t) => {
                    if t.tensor == Tensor::Input {
                        here.3 += 1;
                    }
                    if t.batch.is_some() {
                        batched += 1;
                    }
                }
                ActionRef::Coll(c) => match c.kind {
                    mpipe_core::program::CollKind::Bcast => here.0 += 1,
                    mpipe_core::program::CollKind::Reduce => here.1 += 1,
                },
            }
        }
        if local {
            assert!(
                here.0 > 0 && here.1 > 0,
                "{}: local backward of a trainable encoder, but {} BCAST and {} REDUCE",
                base.label,
                here.0,
                here.1
            );
        }
        if central {
            assert!(
                here.2 > 0 && here.3 > 0,
                "{}: central backward, but {} RF and {} input transfers",
                base.label,
                here.2,
                here.3
            );
        }
        if !expr.contains("transpose") {
            assert_eq!(
                here,
                (0, 0, 0, 0),
                "{}: inline encoders need no collectives, RF or input transfers",
                base.label
            );
        }
        bcast += here.0;
        reduce += here.1;
        input += here.3;
    }
    for op in [Op::F, Op::B, Op::W, Op::BW, Op::RF] {
        assert!(ops.contains(&op), "no base program has {op:?}");
    }
    assert!(bcast > 0 && reduce > 0 && input > 0 && batched > 0);
    for kind in KINDS {
        let n: usize = bases().iter().map(|b| sites(kind, &b.program).len()).sum();
        assert!(n > 0, "no site for {kind:?}");
    }
}

/// Every mutation at every site of every base program (some 25 000 mutants), not
/// only the sites proptest happens to draw.
#[test]
fn every_site_of_every_base() {
    let mut failures = Vec::new();
    let mut total = 0;
    for base in bases() {
        for kind in KINDS {
            for site in sites(kind, &base.program) {
                total += 1;
                let m = mutate(kind, &base.program, site);
                let v = verify(&m.program);
                let hit = v.iter().any(|x| {
                    x.rule == m.rule
                        && m.ranks
                            .as_ref()
                            .is_none_or(|rs| x.rank.is_some_and(|r| rs.contains(&r)))
                });
                if !hit {
                    failures.push(format!(
                        "{kind:?} on {}: {}: expected {}, got:\n{}",
                        base.label,
                        m.what,
                        m.rule,
                        show(&v)
                    ));
                }
            }
        }
    }
    assert!(total > 10_000, "only {total} mutations tried");
    assert!(
        failures.is_empty(),
        "{} of {total} mutations escaped:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------
// Deadlock.

fn frozen(name: &str, home: usize) -> Unit {
    Unit {
        role: mpipe_core::program::Role::of_name(name),
        name: name.into(),
        inputs: vec![],
        home,
        trainable: false,
        cost: Cost {
            f: 1.0,
            b: 1.0,
            w: 0.0,
        },
        act: 1.0,
        bytes: 0.0,
        params: 0.0,
    }
}

/// Two ranks, each computes its unit, sends it to the other, then receives the
/// other's: a crossing pair of transfers, unbatched unless `batch`.
fn crossing(batch: bool) -> Program {
    let b = |n: u64| batch.then_some(n);
    let list = |me: usize, mine: &str, theirs: &str| {
        vec![
            Action::compute(Op::F, mine, 0),
            Action::p2p(Dir::Send, Tensor::Act, mine, 0, 1 - me, b(7)),
            Action::p2p(Dir::Recv, Tensor::Act, theirs, 0, 1 - me, b(7)),
        ]
    };
    Program {
        format: FORMAT.into(),
        ranks: 2,
        microbatches: 1,
        units: vec![frozen("x", 0), frozen("y", 1)],
        programs: vec![list(0, "x", "y"), list(1, "y", "x")],
        source: None,
        prefetch: Vec::new(),
    }
}

#[test]
fn crossing_sends_deadlock_under_rendezvous_only() {
    let p = crossing(false);
    let v = verify(&p);
    assert!(
        !v.is_empty() && v.iter().all(|x| x.rule == Rule::Termination),
        "send-before-receive on both ranks, unbatched: expected only rule 5 violations, got:\n{}",
        show(&v)
    );
    assert!(
        v.iter().any(|x| x.rank == Some(0)) && v.iter().any(|x| x.rank == Some(1)),
        "both ranks are stuck, the violations should name both:\n{}",
        show(&v)
    );
    let eager = verify_mode(&p, Mode::Eager);
    assert!(
        eager.is_empty(),
        "under eager semantics the sends complete at once, so no deadlock; got:\n{}",
        show(&eager)
    );
    let batched = verify(&crossing(true));
    assert!(
        batched.is_empty(),
        "posted together in one batch, the crossing pair completes; got:\n{}",
        show(&batched)
    );
}
