//! `auto` against the peer schedules: never slower than any of them, deterministic.
//!
//! The distribution of `auto`'s ratio to the lower bound over random profiles (for
//! the guide's results) is a task, not a test: `cargo run --release -p mpipe-core
//! --example ratio_report -- 400`.

#[path = "search_cases/mod.rs"]
mod search_cases;
use search_cases::{auto_and_peers, peers, random_profile};

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::evaluation::intended_size;
use mpipe_core::profile::Profile;
use mpipe_core::search::search;
use proptest::prelude::*;

/// The search space, as canonical texts.
fn candidates(profile: &Profile, ranks: usize, microbatches: usize) -> Vec<String> {
    mpipe_core::search::candidates(profile, ranks, microbatches)
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn check_not_slower(profile: &Profile, p: usize, m: usize) -> Result<f64, TestCaseError> {
    let (best, chosen, bound, peers) = auto_and_peers(profile, p, m);
    for (e, t) in &peers {
        prop_assert!(
            best <= t * (1.0 + 1e-9),
            "auto chose `{chosen}` at {best}, but `{e}` takes {t} ({p} ranks, {m} micro-batches)"
        );
    }
    prop_assert!(
        best >= bound * (1.0 - 1e-9),
        "below the lower bound: {best} < {bound}"
    );
    Ok(best / bound)
}

#[test]
fn auto_is_never_slower_than_a_peer_on_the_shipped_profiles() {
    let profiles = [
        (
            "encoder-heavy",
            include_str!("../../profiles/encoder-heavy.toml"),
            vec![(4, 4), (4, 8), (4, 16), (8, 16)],
        ),
        (
            "qwen2vl-7b",
            include_str!("../../profiles/qwen2vl-7b.toml"),
            vec![(4, 8), (8, 32)],
        ),
    ];
    for (name, text, sizes) in profiles {
        let profile = Profile::from_toml_str(text).unwrap();
        for (p, m) in sizes {
            check_not_slower(&profile, p, m).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
}

/// A case the property test below found: the peer `transpose(vision, zbh1)`, derived
/// by name, takes the authors' placement (`place = prefix`), whose program is faster
/// than the default placement's; `auto` derived only the default one and chose
/// `refine(transpose(vision, zbh1), order = 3000)`, behind the peer. `auto` now
/// derives each candidate as a derivation by name does.
#[test]
fn auto_is_never_behind_a_peer_that_chooses_another_placement_by_name() {
    let text = r#"
[[encoder]]
name = "vision"
layers = 3
forward = 0.25622761708889963
backward = 0.3989061961561774
weight = 0.6871802294765044
activation = 0.1
trainable = true

[llm]
layers = 16
forward = 1.0802058642321937
backward = 0.7493948003775988
weight = 1.1905039996841453
activation = 1.0
"#;
    let profile = Profile::from_toml_str(text).unwrap();
    check_not_slower(&profile, 8, 32).unwrap();
}

#[test]
fn the_search_is_deterministic_and_its_space_holds_every_peer() {
    let profile = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let req = Request::new(&profile, 8, 16);
    let a = search(&req).unwrap();
    let b = search(&req).unwrap();
    assert_eq!(a.best.expr, b.best.expr);
    assert_eq!(a.best.program, b.best.program);
    let space = candidates(&profile, 8, 16);
    for peer in peers(&profile) {
        assert!(space.contains(&peer), "{peer} is not in the search space");
    }
    // The pruning is sound: whatever was skipped could not have been faster.
    let best = a.best.report.makespan;
    for t in &a.tried {
        if t.makespan.is_none() {
            if let Some(ideal) = t.ideal {
                assert!(
                    ideal >= best * (1.0 - 1e-9) || t.expr == a.best.expr,
                    "{} skipped at {ideal} < {best}",
                    t.expr
                );
            }
        }
    }
}

/// Four encoders: a heavy trainable one, a lighter trainable one, a light frozen
/// one and a light trainable one.
const FOUR_ENCODERS: &str = r#"
[[encoder]]
name = "vision"
layers = 36
forward = 1.5
backward = 1.5
weight = 0.75
activation = 0.1
params = 2.0
trainable = true

[[encoder]]
name = "audio"
layers = 12
forward = 1.0
backward = 1.0
weight = 0.5
activation = 0.1
params = 1.0
trainable = true

[[encoder]]
name = "depth"
layers = 6
forward = 0.5
backward = 0.5
activation = 0.0
params = 0.5
trainable = false

[[encoder]]
name = "pose"
layers = 4
forward = 0.5
backward = 0.5
weight = 0.25
activation = 0.05
params = 0.3
trainable = true

[llm]
layers = 8
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
params = 0.25
"#;

#[test]
fn beyond_the_two_heaviest_encoders_the_others_are_placed_alike_and_every_peer_is_searched() {
    let four = Profile::from_toml_str(FOUR_ENCODERS).unwrap();
    let (p, m) = (4, 8);
    let space = candidates(&four, p, m);
    for peer in peers(&four) {
        assert!(space.contains(&peer), "{peer} is not in the search space");
    }
    // `depth` and `pose`, the lightest, are both inline, or both transposed or both
    // filled (no options), outside the other encoders' operators: `pose` outermost.
    let mut alike = std::collections::BTreeSet::new();
    for e in &space {
        let inner = ["balance(", "split_w("]
            .iter()
            .fold(e.as_str(), |x, w| x.strip_prefix(w).unwrap_or(x));
        let inner = inner.strip_prefix("split_w(").unwrap_or(inner);
        let op = ["transpose", "fill"]
            .into_iter()
            .find(|op| inner.starts_with(&format!("{op}(pose, ")));
        match op {
            None => assert!(!e.contains("(pose, ") && !e.contains("(depth, "), "{e}"),
            Some(op) => {
                let rest = &inner[format!("{op}(pose, ").len()..];
                assert!(rest.starts_with(&format!("{op}(depth, ")), "{e}");
                // `ENCODER, BODY` and nothing more: one comma at the call's level.
                for at in [0, format!("{op}(pose, ").len()] {
                    let (mut level, mut commas) = (0, 0);
                    for c in inner[at..].chars() {
                        match c {
                            '(' => level += 1,
                            ')' if level == 1 => break,
                            ')' => level -= 1,
                            ',' if level == 1 => commas += 1,
                            _ => {}
                        }
                    }
                    assert_eq!(commas, 1, "{e}");
                }
            }
        }
        alike.insert(op);
    }
    assert_eq!(alike.len(), 3, "inline, transpose and fill all occur");
    // The space of the two heaviest alone, three times, and the peers that nest
    // differently.
    let (head, llm) = FOUR_ENCODERS.split_once("[llm]").unwrap();
    let two = head
        .split("[[encoder]]")
        .take(3)
        .collect::<Vec<_>>()
        .join("[[encoder]]");
    let two = Profile::from_toml_str(&format!("{two}[llm]{llm}")).unwrap();
    assert_eq!(two.encoders.len(), 2);
    let smaller = candidates(&two, p, m).len();
    assert!(
        space.len() <= 3 * smaller + peers(&four).len(),
        "{} candidates for four encoders, {smaller} for the two heaviest",
        space.len()
    );
    assert!(space.len() > smaller);
    // And `auto` takes no longer than a peer.
    check_not_slower(&four, p, m).unwrap();
}

/// One reported stage: id, name, total, steps done, ended.
type Seen = (u64, String, u64, u64, bool);

/// Records the stages a search reports.
#[derive(Default)]
struct Stages(std::sync::Mutex<Vec<Seen>>);

impl mpipe_core::progress::Progress for Stages {
    fn begin(&self, id: u64, what: &str, total: u64) {
        self.0
            .lock()
            .unwrap()
            .push((id, what.to_string(), total, 0, false));
    }
    fn advance(&self, id: u64, n: u64) {
        let mut all = self.0.lock().unwrap();
        let s = all
            .iter_mut()
            .find(|s| s.0 == id)
            .expect("advance of an open stage");
        assert!(!s.4, "advance after end");
        s.3 += n;
    }
    fn end(&self, id: u64) {
        let mut all = self.0.lock().unwrap();
        let s = all
            .iter_mut()
            .find(|s| s.0 == id)
            .expect("end of an open stage");
        assert!(!s.4, "a stage ends once");
        s.4 = true;
    }
}

#[test]
fn the_search_reports_its_progress_and_the_report_changes_nothing() {
    let profile = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let req = Request::new(&profile, 8, 16);
    let quiet = search(&req).unwrap();
    let stages = std::sync::Arc::new(Stages::default());
    let watched = mpipe_core::progress::with_progress(stages.clone(), || search(&req).unwrap());
    assert_eq!(quiet.best.expr, watched.best.expr);
    assert_eq!(quiet.best.program, watched.best.program);
    let got = stages.0.lock().unwrap().clone();
    let names: Vec<&str> = got.iter().map(|s| s.1.as_str()).collect();
    assert_eq!(
        names,
        [
            "auto: planning the candidates",
            "auto: deriving the fastest-looking",
            "auto: refining the finalists",
            "auto: ordering the winner's compute",
            "ordering the compute (simulations)",
            // Here the finalist fastest in the ideal timing is another expression
            // within 2% of the winner once refined: its order is searched too.
            "auto: ordering the ideal finalist's compute",
            "ordering the compute (simulations)",
            // Micro-batches are twice the ranks and the step is still 9% above the
            // bound: the order is searched further, here in two rounds.
            "auto: ordering its compute further (more than 5% above the bound)",
            "ordering the compute (simulations)",
            "ordering the compute (simulations)"
        ]
    );
    // Every stage ended; planning visits every candidate (on every worker thread);
    // deriving stops early, never beyond its total.
    assert!(got.iter().all(|s| s.4), "{got:?}");
    let space = candidates(&profile, 8, 16).len() as u64;
    assert_eq!((got[0].2, got[0].3), (space, space));
    assert!(got[1].3 >= 1 && got[1].3 <= got[1].2, "{got:?}");
    assert_eq!(got[2].3, got[2].2);
    assert_eq!((got[3].2, got[3].3), (1, 1));
    assert_eq!((got[5].2, got[5].3), (1, 1));
    // The order search inside it counts simulations, never beyond its budget.
    for inner in [&got[4], &got[6]] {
        assert!(
            inner.2 >= 100 && inner.3 >= 1 && inner.3 <= inner.2,
            "{got:?}"
        );
    }
}

#[test]
fn steps_too_large_to_derive_are_refused_at_once() {
    let profile = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let e = derive_str(&Request::new(&profile, 4, 10_000_000), "auto").unwrap_err();
    assert!(
        e[0].message
            .contains("microbatches = 10000000 is over the 65536"),
        "{}",
        e[0].message
    );
    let e = derive_str(&Request::new(&profile, 16, 65_536), "1f1b").unwrap_err();
    assert!(
        e[0].message.contains("ranks x microbatches = 16 x 65536"),
        "{}",
        e[0].message
    );
    // Both argument errors at once, where both apply.
    let e = derive_str(&Request::new(&profile, 0, 100_000), "1f1b").unwrap_err();
    assert_eq!(e.len(), 2, "{e:?}");
}

#[test]
fn auto_inside_an_operator_is_an_error() {
    let profile =
        Profile::from_toml_str(include_str!("../../profiles/encoder-heavy.toml")).unwrap();
    let req = Request::new(&profile, 4, 4);
    let e = derive_str(&req, "transpose(vision, auto)").unwrap_err();
    assert!(
        e[0].message.contains("write `auto` alone"),
        "{}",
        e[0].message
    );
    let e = derive_str(&req, "auto(v = 2)").unwrap_err();
    assert!(
        e[0].message.contains("takes no arguments"),
        "{}",
        e[0].message
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn auto_is_never_slower_than_a_peer((text, p, m) in random_profile()) {
        let profile = Profile::from_toml_str(&text).unwrap();
        check_not_slower(&profile, p, m)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// The search hands candidates out a few at a time (one per core), and a
    /// candidate's alternatives are derived under the stop rule's limit at its batch's
    /// start: still the answer, what was tried and the work counted are those of one
    /// candidate at a time. Half the cases with the stop rule at its tightest (a
    /// candidate derived only where its ideal time is at most the best simulated so
    /// far), where the best found inside a batch often stops the search there.
    #[test]
    fn auto_answers_alike_on_one_thread_and_on_every_core(
        (text, p, m) in random_profile(),
        tight in any::<bool>(),
    ) {
        let profile = Profile::from_toml_str(&text).unwrap();
        let mut req = Request::new(&profile, p, m);
        if tight {
            req.policy.derive_within = 1.0;
        }
        let mut alone = req;
        alone.policy.max_threads = 1;
        let (all, one) = (search(&req).unwrap(), search(&alone).unwrap());
        prop_assert_eq!(&all.best.expr, &one.best.expr);
        prop_assert_eq!(&all.best.program, &one.best.program);
        prop_assert_eq!(all.work, one.work);
        let tried = |s: &mpipe_core::search::Search| {
            s.tried.iter().map(|t| (t.expr.clone(), t.makespan)).collect::<Vec<_>>()
        };
        prop_assert_eq!(tried(&all), tried(&one));
    }
}

/// The goals `auto` serves, for one derived request: the chosen program verifies,
/// it is never slower than any peer schedule (the best named schedule the search
/// holds), and where micro-batches are at least twice the ranks it is within the
/// policy's goal of the lower bound (issue 6's 5%). Returns its ratio to the bound.
fn meets_the_goals(req: &Request, d: &mpipe_core::derive::Derived) -> f64 {
    let violations = mpipe_core::verify::verify(&d.program);
    assert!(violations.is_empty(), "`{}`: {violations:?}", d.expr);
    for e in peers(req.profile) {
        if let Ok(peer) = derive_str(req, &e) {
            assert!(
                d.report.makespan <= peer.report.makespan * (1.0 + 1e-9),
                "auto chose `{}` at {}, but `{e}` takes {}",
                d.expr,
                d.report.makespan,
                peer.report.makespan
            );
        }
    }
    let ratio = d.report.makespan / d.bound.value();
    let policy = &req.policy;
    if req.microbatches >= policy.goal_microbatches_per_rank * req.ranks {
        assert!(
            ratio <= policy.goal,
            "`{}`: {ratio:.4} of the bound, the goal is {}",
            d.expr,
            policy.goal
        );
    }
    ratio
}

/// The evaluation profiles at their intended sizes, where micro-batches >= 2 x ranks:
/// `auto` meets its goals ([`meets_the_goals`]: within 5% of the lower bound, never
/// slower than a peer, a valid program). On (c) under rendezvous the bound comes
/// from the split `balance(zb2p(v = 2, encoders = ramp))` chooses, and `auto`
/// reaches 5% only with that split, its frozen encoder prefetched and its order
/// searched.
#[test]
fn auto_keeps_its_distance_to_the_bound_where_microbatches_are_twice_the_ranks() {
    let cases = [
        include_str!("../../profiles/eval-b-qwen2vl72b-frozen.toml"),
        include_str!("../../profiles/eval-b-qwen2vl72b.toml"),
        include_str!("../../profiles/eval-c-omni.toml"),
    ];
    for text in cases {
        let profile = Profile::from_toml_str(text).unwrap();
        let (p, m) = intended_size(text).expect("an evaluate line");
        assert!(m >= 2 * p);
        let req = Request::new(&profile, p, m);
        let d = derive_str(&req, "auto").unwrap();
        meets_the_goals(&req, &d);
    }
}

/// `profiles/qwen2vl-7b.toml` at its intended 8 x 32, where the trainable ViT weighs
/// about one stage: `auto` cuts the encoder into a chain of layer chunks woven into
/// the schedule, with the stage split and chunk sizes chosen together
/// (`zb2p(encoders = ramp)`), and meets its goals under both semantics (within 5%
/// of the bound; under rendezvous that takes the longer order search `auto` runs
/// where a program is more than 5% above the bound).
#[test]
fn auto_chains_a_stage_sized_encoder() {
    let text = include_str!("../../profiles/qwen2vl-7b.toml");
    let profile = Profile::from_toml_str(text).unwrap();
    for mode in [
        mpipe_core::simulate::Mode::Eager,
        mpipe_core::simulate::Mode::Rendezvous,
    ] {
        let req = Request {
            mode,
            ..Request::new(&profile, 8, 32)
        };
        let d = derive_str(&req, "auto").unwrap();
        assert!(d.expr.contains("encoders = ramp"), "{mode:?}: {}", d.expr);
        meets_the_goals(&req, &d);
    }
}

/// The ramp (which chooses the stage split itself) is searched from both splits
/// (`balance` makes it start from the balanced one) and with the frozen encoder
/// prefetched; inside `schedule!`, which cannot prefetch, without.
#[test]
fn the_ramp_is_searched_balanced_and_with_frozen_encoders_prefetched() {
    let omni = Profile::from_toml_str(include_str!("../../profiles/eval-c-omni.toml")).unwrap();
    let expected = [
        "zb2p(v = 2, encoders = ramp)",
        "balance(zb2p(v = 2, encoders = ramp))",
        "prefetch(vision, zb2p(v = 2, encoders = ramp))",
        "balance(prefetch(vision, zb2p(encoders = ramp, costs = unit)))",
    ];
    let space = candidates(&omni, 8, 16);
    for e in expected {
        assert!(space.iter().any(|x| x == e), "{e} is not searched");
    }
    let in_macro: Vec<String> = mpipe_core::search::candidates_for(
        &omni,
        8,
        16,
        &mpipe_core::policy::SearchPolicy {
            prefetch: false,
            ..Default::default()
        },
    )
    .iter()
    .map(ToString::to_string)
    .collect();
    assert!(in_macro
        .iter()
        .any(|x| x == "balance(zb2p(v = 2, encoders = ramp))"));
    assert!(!in_macro.iter().any(|x| x.contains("prefetch(")));
    // The trainable ViT of qwen2vl-7b is never prefetched.
    let one = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    let space = candidates(&one, 8, 32);
    assert!(space.iter().any(|x| x == "balance(zb2p(encoders = ramp))"));
    assert!(!space.iter().any(|x| x.contains("prefetch(")));
}

/// `zb2p(encoders = chains)` (every encoder chained along the ranks) is in the space
/// of a profile with two encoders or more, alone and balanced, and not in that of a
/// one-encoder profile, where it cannot be derived.
#[test]
fn chaining_every_encoder_is_searched_where_there_are_two() {
    let omni = Profile::from_toml_str(include_str!("../../profiles/eval-c-omni.toml")).unwrap();
    let space = candidates(&omni, 8, 16);
    for e in [
        "zb2p(encoders = chains)",
        "zb2p(encoders = chains, costs = unit)",
        "balance(zb2p(encoders = chains))",
        "balance(zb2p(encoders = chains, costs = unit))",
    ] {
        assert!(space.iter().any(|x| x == e), "{e} is not searched");
    }
    let one = Profile::from_toml_str(include_str!("../../profiles/qwen2vl-7b.toml")).unwrap();
    assert!(!candidates(&one, 8, 16)
        .iter()
        .any(|x| x.contains("encoders = chains")));
}
