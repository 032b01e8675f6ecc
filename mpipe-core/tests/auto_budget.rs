//! Issue 37, item 4: `auto` has a work budget (`SearchPolicy::work_budget`, in task
//! visits estimated before each piece of work starts) and says when it stopped
//! early, with the best program found so far. At one rank, where `fill` has no idle
//! time to fill and its placement re-timed the plan for every micro-batch (1 x 1024
//! took 156 s, 1 x 4096 did not finish in 200 s), `fill` is not a candidate, and a
//! `fill` placement is cut at `SearchPolicy::fill_work` elsewhere.

use mpipe_core::derive::Request;
use mpipe_core::profile::Profile;
use mpipe_core::search::auto::search;

/// The search space, as canonical texts.
fn candidates(profile: &Profile, ranks: usize, microbatches: usize) -> Vec<String> {
    mpipe_core::search::candidates(profile, ranks, microbatches)
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn heavy() -> Profile {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../profiles/encoder-heavy.toml"
    ))
    .unwrap();
    Profile::from_toml_str(&text).unwrap()
}

/// A budget that runs out: the search stops, says so, spends at most the budget
/// besides the one derivation it always makes, and still returns a program that
/// runs (the best so far).
#[test]
fn a_small_budget_stops_the_search_and_says_so() {
    let profile = heavy();
    let mut req = Request::new(&profile, 4, 8);
    let full = search(&req).unwrap();
    assert!(full.notes.is_empty(), "{:?}", full.notes);
    assert!(full.work <= req.policy.work_budget);

    // Enough to plan a few candidates and derive one.
    let tasks = (3 * 8 * (profile.encoders.len() + 4)) as u64;
    req.policy.work_budget = tasks * req.policy.work_per_planned_task * 5;
    let cut = search(&req).unwrap();
    assert!(!cut.notes.is_empty());
    assert!(
        cut.notes.iter().any(|n| n.contains("work budget")),
        "{:?}",
        cut.notes
    );
    assert!(cut.tried.len() < full.tried.len());
    // The forced first derivation of a plan of at most a few times `tasks` tasks.
    let first = tasks * 4 * req.policy.work_per_derived_action;
    assert!(
        cut.work <= req.policy.work_budget + first,
        "{} > {} + {first}",
        cut.work,
        req.policy.work_budget
    );
    assert!(cut.best.report.makespan.is_finite());
    assert!(cut.best.report.makespan >= full.best.report.makespan);
}

/// At one rank `fill` is no candidate (no idle time to fill, and a placement that
/// grows with the square of the micro-batches); the search at 1 x 1024 stays within
/// the default budget without leaving anything out.
#[test]
fn one_rank_searches_without_fill_within_the_budget() {
    let profile = heavy();
    for c in candidates(&profile, 1, 1024) {
        assert!(!c.contains("fill("), "{c}");
    }
    assert!(candidates(&profile, 2, 4)
        .iter()
        .any(|c| c.contains("fill(")));
    let req = Request::new(&profile, 1, 1024);
    let s = search(&req).unwrap();
    assert!(s.notes.is_empty(), "{:?}", s.notes);
    assert!(s.work <= req.policy.work_budget, "{}", s.work);
    // One rank: every schedule does the same work with no idle time.
    assert_eq!(s.best.report.makespan, s.best.bound.value());
}
