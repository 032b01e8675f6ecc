//! The lowering by unit index ([`lower_prepared_indexed`]) and its simulation
//! ([`simulate_lowered`]), which the order search judges its trials with, are the
//! named lowering and [`simulate`] exactly: for derived plans of the shipped
//! profiles, and for random reorderings of them (moves within a rank, and tasks
//! moved to other ranks, which brings broadcasts and reductions, or plans the
//! lowering or the simulator refuses), under every placement rule,
//!
//! - naming the indexed lowering gives the named lowering's program, action for
//!   action (so the search keeps the program it judged);
//! - simulating it gives the named program's report (makespan, every interval of
//!   the timeline, so every rank's finishing time, peak memory, compute), or the
//!   same error, under rendezvous and eager semantics, with and without a link;
//! - its finishing times alone ([`finish_times_lowered`], what ranks a trial) are
//!   the report's: the end of each rank's last interval, the makespan their
//!   largest; or the same error;
//! - the report found from a run's kept times ([`finish_times_taken_or_run`],
//!   [`Kept::report`]: what the placement search keeps of its winner's run, not
//!   run again) is [`simulate_lowered`]'s, interval for interval; and a lowering
//!   the simulator takes apart ([`finish_times_taken_or_run`], [`simulate_taken`])
//!   comes back step for step, the same report or the same error.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::lower::{lower_prepared, lower_prepared_indexed, prepare, Placement};
use mpipe_core::plan::Plan;
use mpipe_core::profile::Profile;
use mpipe_core::relower::plan_of_program;
use mpipe_core::simulate::{
    finish_times_lowered, finish_times_taken_or_run, simulate, simulate_lowered, simulate_taken,
    CommModel, Kept, Mode, SimOptions,
};

const RULES: [Placement; 5] = [
    Placement::Ready,
    Placement::Meet,
    Placement::Critical,
    Placement::Late,
    Placement::Join,
];

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// `plan` with `moves` random changes: a task moved a few places within its rank
/// (most of the time), or to about the same point of another rank.
fn shuffled(plan: &Plan, rng: &mut Rng, moves: usize) -> Plan {
    let mut next = plan.clone();
    for _ in 0..moves {
        let q = rng.below(next.ranks);
        if next.order[q].is_empty() {
            continue;
        }
        let from = rng.below(next.order[q].len());
        let task = next.order[q].remove(from);
        if rng.below(4) == 0 {
            // Anywhere else, at about the same point of the step.
            let r = rng.below(next.ranks);
            let at = from * next.order[r].len() / (next.order[q].len() + 1);
            let to = (at + rng.below(5))
                .saturating_sub(2)
                .min(next.order[r].len());
            next.order[r].insert(to, task);
        } else {
            // A few places earlier or later on its own rank.
            let to = (from + rng.below(9))
                .saturating_sub(4)
                .min(next.order[q].len());
            next.order[q].insert(to, task);
        }
    }
    next
}

fn options() -> Vec<SimOptions> {
    let link = Some(CommModel {
        latency: 0.01,
        bandwidth: 0.2,
    });
    [Mode::Rendezvous, Mode::Eager]
        .into_iter()
        .flat_map(|mode| {
            [None, link]
                .into_iter()
                .map(move |comm| SimOptions { mode, comm })
        })
        .collect()
}

/// Both lowerings of `plan` under every rule, and both simulations of them, agree;
/// returns how many lowerings ran, how many had collectives and how many of their
/// simulations succeeded.
fn check(plan: &Plan, what: &str) -> (usize, usize, usize) {
    let Ok(prepared) = prepare(plan) else {
        return (0, 0, 0);
    };
    let (mut lowered, mut colls, mut ran) = (0, 0, 0);
    for rule in RULES {
        let named = lower_prepared(plan, &prepared, Some(what), rule);
        let indexed = lower_prepared_indexed(plan, &prepared, rule);
        let (named, indexed) = match (named, indexed) {
            (Ok(n), Ok(i)) => (n, i),
            (Err(a), Err(b)) => {
                assert_eq!(a, b, "{what} {rule:?}: the lowerings fail differently");
                continue;
            }
            (n, i) => panic!(
                "{what} {rule:?}: one lowering fails: {:?} / {:?}",
                n.err(),
                i.err()
            ),
        };
        lowered += 1;
        colls += usize::from(!indexed.colls.is_empty());
        assert!(
            indexed.program(&plan.units, Some(what)) == named,
            "{what} {rule:?}: the indexed lowering names to another program"
        );
        for opts in options() {
            let a = simulate(&named, &opts);
            let b = simulate_lowered(&plan.units, &indexed, &opts);
            assert_eq!(a, b, "{what} {rule:?} {opts:?}");
            let finish = finish_times_lowered(&plan.units, &indexed, &opts);
            match (&a, finish) {
                (Ok(report), Ok(finish)) => {
                    let ends: Vec<f64> = report
                        .timeline
                        .ranks
                        .iter()
                        .map(|l| l.last().map_or(0.0, |s| s.end))
                        .collect();
                    assert_eq!(ends, finish, "{what} {rule:?} {opts:?}");
                    let latest = finish.iter().copied().fold(0.0, f64::max);
                    assert_eq!(latest, report.makespan, "{what} {rule:?} {opts:?}");
                }
                (Err(a), Err(b)) => assert_eq!(*a, b, "{what} {rule:?} {opts:?}"),
                (a, b) => panic!(
                    "{what} {rule:?} {opts:?}: {:?} / {:?}",
                    a.is_ok(),
                    b.is_ok()
                ),
            }
            let taken = simulate_taken(&plan.units, indexed.clone(), &opts);
            match (&a, taken) {
                (Ok(report), Ok((back, again))) => {
                    assert!(
                        back == indexed,
                        "{what} {rule:?} {opts:?}: taken, given back"
                    );
                    assert_eq!(&again, report, "{what} {rule:?} {opts:?}: taken");
                }
                (Err(a), Err(b)) => assert_eq!(*a, b, "{what} {rule:?} {opts:?}: taken"),
                (a, b) => panic!(
                    "{what} {rule:?} {opts:?}: taken: {:?} / {:?}",
                    a.is_ok(),
                    b.is_ok()
                ),
            }
            if let Ok(report) = &a {
                let (finish, run) = finish_times_taken_or_run(
                    &plan.units,
                    indexed.clone(),
                    &opts,
                    f64::INFINITY,
                    |_| true,
                )
                .unwrap_or_else(|e| panic!("{what} {rule:?} {opts:?}: {e}"))
                .unwrap_or_else(|| panic!("{what} {rule:?} {opts:?}: cut short"));
                let run: Kept<'_> =
                    run.unwrap_or_else(|| panic!("{what} {rule:?} {opts:?}: not kept"));
                assert_eq!(finish.iter().copied().fold(0.0, f64::max), report.makespan);
                let (back, again) = run
                    .report()
                    .unwrap_or_else(|e| panic!("{what} {rule:?} {opts:?}: {e}"));
                assert!(
                    back == indexed,
                    "{what} {rule:?} {opts:?}: kept, given back"
                );
                assert_eq!(&again, report, "{what} {rule:?} {opts:?}: from its run");
            }
            ran += usize::from(a.is_ok());
        }
    }
    (lowered, colls, ran)
}

#[test]
fn the_indexed_lowering_and_its_simulation_are_the_named_ones() {
    let cases: [(&str, &str, usize, usize); 7] = [
        (
            "qwen2vl-7b.toml",
            "layers(zb2p(encoders = ramp, costs = unit))",
            4,
            8,
        ),
        ("qwen2vl-7b.toml", "transpose(vision, zbv)", 4, 8),
        ("eval-c-omni.toml", "fill(vision, 1f1b)", 4, 8),
        (
            "eval-b-qwen2vl72b-frozen.toml",
            "prefetch(vision, 1f1b)",
            4,
            8,
        ),
        ("encoder-heavy.toml", "transpose(vision, 1f1b)", 3, 6),
        ("qwen2vl-7b.toml", "interleaved(v = 2)", 4, 8),
        ("qwen2vl-7b.toml", "zbh1", 2, 4),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut lowered, mut colls, mut ran, mut prefetched) = (0, 0, 0, 0);
    for (file, expr, ranks, microbatches) in cases {
        let text = std::fs::read_to_string(format!("../profiles/{file}")).unwrap();
        let profile = Profile::from_toml_str(&text).unwrap();
        let req = Request::new(&profile, ranks, microbatches);
        let derived = derive_str(&req, expr).unwrap_or_else(|e| panic!("{file} {expr}: {e:?}"));
        let plan = plan_of_program(&derived.program).unwrap();
        prefetched += usize::from(!plan.prefetch.is_empty());
        let what = format!("{file} {expr} {ranks}x{microbatches}");
        let (l, c, r) = check(&plan, &what);
        assert!(l > 0 && r > 0, "{what}: the derived plan does not run");
        (lowered, colls, ran) = (lowered + l, colls + c, ran + r);
        for k in 0..12 {
            let next = shuffled(&plan, &mut rng, 1 + k % 4);
            let (l, c, r) = check(&next, &format!("{what}, shuffle {k}"));
            (lowered, colls, ran) = (lowered + l, colls + c, ran + r);
        }
    }
    // The cases exercise what they are meant to: prefetched forwards, collectives,
    // and many shuffled plans that still lower and run.
    assert!(prefetched > 0);
    assert!(
        lowered > 100 && colls > 10 && ran > 300,
        "{lowered} lowerings ({colls} with collectives), {ran} runs"
    );
}
