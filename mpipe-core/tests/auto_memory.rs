//! Issue 37, "memory bounded by the output's size": `auto` kept the plan of every
//! candidate it planned until it had derived a few of them in ideal order (3.6 GB
//! resident at 1 x 65536 on encoder-heavy, where the work budget stops it after one
//! derivation). It now keeps, per candidate, the ideal time, the task count and a
//! fingerprint of the plan, and plans again the few it derives; the plan memo is
//! bounded in tasks (`SearchPolicy::plan_memo_tasks`) as well as in plans.
//!
//! The peak is counted by this binary's global allocator (`peak_alloc`): one test
//! in this binary, so nothing else allocates meanwhile.

use mpipe_core::derive::Request;
use mpipe_core::plan::Task;
use mpipe_core::profile::Profile;
use mpipe_core::search::auto::search;
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Micro-batches of the search measured, at one rank: large enough that plans
/// dominate, small enough for the whole space to be planned within the budget.
const MBS: usize = 8192;

/// The peak allowed, in plans of the largest candidate's size: the plan memos of
/// two threads (up to `SearchPolicy::plan_memo` plans each), the plans of the
/// derivations in flight, and the programs derived. Measured: 36 (192 MB), against
/// at least 85 for the plans of every candidate alone.
const PLANS: usize = 44;

fn heavy() -> Profile {
    Profile::from_toml_str(include_str!("../../profiles/encoder-heavy.toml")).unwrap()
}

#[test]
fn the_search_holds_a_few_plans_not_one_per_candidate() {
    let profile = heavy();
    let mut req = Request::new(&profile, 1, MBS);
    // Each thread has its own plan memo: as many threads as on the 2-core machine
    // the bound was measured on, on any machine.
    req.policy.max_threads = 2;
    // Enough work to plan every candidate, and little more: as at 1 x 65536 under
    // the default budget, phase 1 holds the most, and the derivations after it
    // (whose programs are the output) are few.
    req.policy.work_budget = 400_000_000;
    let task = std::mem::size_of::<Task>();
    // The largest plan at one rank: F, B and W of every micro-batch of the encoder
    // and of 8 chunks (`interleaved(v = 8)`); the smallest, of the encoder and one
    // stage (`1f1b`).
    let largest = 3 * 9 * MBS * task;
    let smallest = 3 * 2 * MBS * task;
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let s = search(&req).unwrap_or_else(|e| panic!("{e:?}"));
    let peak = ALLOC.peak_usage().saturating_sub(base);
    let planned = s.tried.iter().filter(|t| t.ideal.is_some()).count();
    let space = mpipe_core::search::candidates(&profile, 1, MBS).len();
    assert!(
        s.notes.iter().all(|n| !n.contains("not planned")) && s.tried.len() == space,
        "every candidate should be planned: {:?}",
        s.notes
    );
    // Holding every planned candidate's plan would take at least this much: the
    // bound below must be under it, or it tests nothing.
    let every_plan = planned * smallest;
    assert!(
        PLANS * largest < every_plan,
        "{planned} candidates planned: the bound tests nothing"
    );
    assert!(
        peak < PLANS * largest,
        "the search at 1 x {MBS} peaked at {} MB, over {PLANS} plans of {} MB \
         (every planned candidate's plan: at least {} MB)",
        peak >> 20,
        largest >> 20,
        every_plan >> 20
    );
}
