//! Every tuning constant of the search, the derivation, the lowering and the
//! generators, in one value: [`SearchPolicy`].
//!
//! A [`crate::search::derive::Request`] carries one (`Request::new` gives
//! [`SearchPolicy::DEFAULT`]); each pass copies the fields it needs into locals
//! before its loops. Each field says what it trades: mostly search time against how
//! close the answer comes to the best one the algebra holds. The defaults are the
//! values `auto` and `derive` have been tuned with; programs derived under them are
//! pinned by `tests/byte_identity.rs`. Changing a field changes which programs are
//! derived (never whether one is valid: every program is verified).
//!
//! A test (`tests/policy_constants.rs`) fails when a numeric tuning literal appears
//! in those passes outside this file.

/// The knobs of `auto`, of `refine(...)` and of the lowering, with today's values
/// in [`SearchPolicy::DEFAULT`] (also [`Default`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SearchPolicy {
    // --- `auto`: the search space -------------------------------------------------
    /// Chunks per rank `auto` goes up to with `interleaved(v = N)` beyond `v = 4`
    /// (where the chunks divide the layers evenly). More: finer tasks and a larger
    /// space (one body more per value, under every placement).
    pub max_chunks: usize,
    /// Encoders whose placements `auto` searches in full (every operator and mode,
    /// in every nesting order); the others are placed alike outside them. Each one
    /// more multiplies the space by about twenty (and by the orders of nesting).
    pub full_encoders: usize,
    /// Whether `auto` may place a frozen encoder with `prefetch` (its forwards run
    /// a step ahead). True where the program is simulated, or run by a runtime with
    /// next-step forwards; the `schedule!` macro sets it false, as the code it
    /// generates cannot run those yet. False: a smaller space without `prefetch`.
    pub prefetch: bool,

    // --- `auto`: which candidates are derived, refined and ordered ---------------
    /// How far (a factor) a candidate's ideal time may be behind the best simulated
    /// time for it still to be derived in full. 1 would be exact for unrefined
    /// programs; refinement can beat a plan's ideal time, so a little more keeps
    /// candidates that win once refined, at the cost of more full derivations.
    pub derive_within: f64,
    /// Candidates refined by simulation (the fastest as derived; the fastest in the
    /// ideal timing is refined besides). More: more refinements, each a few
    /// hundred simulations.
    pub finalists: usize,
    /// How close (a factor of the winner's step) the runner-up must be for its
    /// compute order to be searched when the winner's gains nothing. Larger: more
    /// order searches that rarely pay.
    pub runner_up_within: f64,
    /// How close (a factor of the winner's step) the finalist fastest in the ideal
    /// timing must be, once refined, for its compute order to be searched too.
    /// Larger: more order searches; they gain most where a program is far from its
    /// plan's ideal time.
    pub ideal_within: f64,
    /// Most simulations the compute-order search of a winner may spend.
    pub order_budget: usize,
    /// Actions simulated in all by that order search: its budget shrinks to this
    /// over the program's actions, so large programs take about the same time.
    pub order_actions: usize,
    /// Below this many simulations the order search is not tried: a few moves rarely
    /// pay for the full derivation that follows them.
    pub order_min: usize,
    /// The distance to the lower bound (a factor) `auto` aims for: a program farther
    /// away has its compute order searched again with [`Self::far_budget`]. Lower:
    /// more programs get the long search.
    pub goal: f64,
    /// The goal applies where micro-batches are at least this many times the ranks
    /// (fewer micro-batches leave a fill and drain no schedule can hide).
    pub goal_microbatches_per_rank: usize,
    /// Most simulations of that second, longer order search.
    pub far_budget: usize,
    /// Actions simulated in all by the longer order search (as
    /// [`Self::order_actions`]).
    pub far_actions: usize,
    /// `auto`'s work budget, in task visits: one task of a plan timed once, or one
    /// action of a program lowered or simulated once. Each piece of work (planning a
    /// candidate, deriving one in full, a refinement, an order search) is estimated
    /// from the step's size before it starts, and is not started when it would take
    /// the search past the budget: `auto` then returns the best program found so far
    /// and says what it left out ([`crate::search::auto::Search::notes`], and a note
    /// to the progress observer). The first candidate is always derived. The default
    /// holds every size the shipped profiles, the guide and the evaluation use (their
    /// answers are the unbounded search's) and bounds `auto` at the largest sizes
    /// accepted (where `fill`'s placement, which re-times the plan for each
    /// micro-batch no idle gap takes, would run for hours at one rank). Larger: more
    /// of the space searched at large sizes, for longer.
    pub work_budget: u64,
    /// Task visits planning one candidate costs per task of the step, in
    /// [`Self::work_budget`]'s estimates (evaluating its operators, which time the
    /// plan a few times each, and its ideal timing).
    pub work_per_planned_task: u64,
    /// Task visits one full derivation costs per action, in [`Self::work_budget`]'s
    /// estimates (the lowering tries every placement rule, re-places the transfers
    /// and simulates each try).
    pub work_per_derived_action: u64,
    /// Most task visits one `fill` placement of a candidate may spend re-timing the
    /// plan (once per micro-batch no idle gap takes, on every rank: at one rank every
    /// micro-batch, so its work grows with the square of the micro-batches). Past
    /// it, `auto` leaves the candidate out and says so. The default is above what
    /// every size the tests, the guide and the benchmarks use needs. `fill` written
    /// by hand is not limited.
    pub fill_work: u64,

    // --- threads -------------------------------------------------------------------
    /// Most threads the search and the order search use (never more than the cores).
    /// The answer is the same on any number; more threads, more memory.
    pub max_threads: usize,
    /// Candidates a search thread plans in a row: candidates that share inner
    /// expressions come together, so a run's shared plans are built once. Longer
    /// runs share more, shorter ones balance the threads better.
    pub plan_run: usize,
    /// Sub-expression plans each thread remembers ([`crate::search::derive`]'s plan memo).
    /// More: more reuse across candidates, about a megabyte each at 16 x 128.
    pub plan_memo: usize,
    /// Most tasks the plans of one thread's memo hold together (24 bytes each): a
    /// plan that would take it past this pushes out the oldest, and one larger
    /// than this is not kept. Bounds the memo's memory at large sizes (at 1 x 65536
    /// one candidate's plan has up to 1.8 million tasks, and 24 of them took
    /// gigabytes); below it, [`Self::plan_memo`] decides. More: more reuse at large
    /// sizes, more memory.
    pub plan_memo_tasks: usize,

    // --- the derivation: lowering and `refine` ---------------------------------------
    /// Rounds of re-placing the transfers against simulated times (each tries every
    /// placement rule once more). More: slower lowering, rarely a better one.
    pub replace_rounds: usize,
    /// Candidate meeting points the lowering weighs for each transfer. More: a
    /// slower lowering that may wait less.
    pub meet_candidates: usize,
    /// Fewest full periods a rank's periodic stretch must hold before its transfers
    /// are placed periodically (`search/periodic.rs`). Fewer: short stretches
    /// (small micro-batch counts) are made periodic too, with more moves at their
    /// ends that may fail; at least 2.
    pub periodic_min_periods: usize,
    /// Points of each rank's compute order a periodic stretch is looked for through
    /// (evenly spaced; one Z-function each, linear in the rank's tasks). More: more
    /// phases of a schedule (forward, backward, cool-down) found, more time; below 2
    /// turns the periodic placement off.
    pub periodic_probes: usize,
    /// Least share of a rank's periodic stretch's periods whose transfers must be
    /// placed otherwise than the template's before the stretch is rewritten (and
    /// the rank's code rolled twice to weigh it; at least one period): drifting
    /// meeting points break most periods (`gpipe` with a trainable encoder: a
    /// quarter to all of them), a stretch with a few local deviations (`transpose(vision,
    /// zbv)` at 64 x 1024: 13 of 830) gains nothing from it. Smaller: more stretches
    /// rewritten and weighed, more time.
    pub periodic_min_break_share: f64,
    /// The periods, counted from a periodic stretch's start, whose placement is
    /// tried as the template for themselves and every later period (the earlier
    /// ones keep theirs), after the templates from the middle, the first and the
    /// last period of the stretch (`search/periodic.rs`, `Reference::After`). A
    /// fast rank's meeting points drift from the start of the steady state, and a
    /// later period's placement imposed from the start makes the busiest rank wait
    /// while the phases settle into it; from a period a few in, the steady state
    /// keeps the pace it has there. Larger: more of the stretch written out before
    /// its loop; each one more: a verification and a simulation more for a program
    /// whose placement drifts (none for a regular one).
    pub periodic_settle_periods: &'static [usize],
    /// The critical-path placement weighs a rank's lost time by one over its idle
    /// time plus the makespan divided by this: smaller weighs busy and idle ranks
    /// more alike when choosing meeting points, larger favours the busiest ranks.
    pub meet_idle_parts: f64,
    /// Most simulations `refine` spends moving transfers.
    pub refine_budget: usize,
    /// Actions simulated in all by that refinement (its budget shrinks for large
    /// programs so they take about the same time).
    pub refine_actions: usize,
    /// Most simulations `refine` spends moving weight gradients into waits.
    pub w_budget: usize,
    /// Actions simulated in all moving weight gradients (as
    /// [`Self::refine_actions`]).
    pub w_actions: usize,
    /// Below this many simulations weight gradients are not moved: a few moves on a
    /// large program rarely change its step and cost seconds.
    pub w_min: usize,
    /// Candidate moves of weight gradients tried per round before giving up.
    pub w_moves_per_round: usize,
    /// A weight gradient is moved into a wait only if it costs at most this many
    /// times the wait: larger fills more waits but may push work later.
    pub w_fit: f64,

    // --- the compute-order search (`refine(X, order = N)`) ------------------------------
    /// How many tasks back or ahead of a wait the order search looks for a task to
    /// move. More: more candidate moves per wait, each a simulation.
    pub lookahead: usize,
    /// Waits shorter than this fraction of the makespan are not worth a move.
    pub min_wait: f64,
    /// Plans with at least this many tasks are lowered and simulated on several
    /// threads (smaller ones take less time than starting a thread).
    pub parallel_tasks: usize,
    /// Trials the order search keeps issued per lowering thread, ahead of the one it
    /// takes next: a thread that finishes one takes the next at once instead of
    /// waiting for the slowest of a batch. More keeps the threads busier when trial
    /// times vary (many are cut short); each holds a queued move, and its lowering
    /// only when it beats the best. Trials issued past a move that is kept are
    /// discarded (those already running are wasted work). The answer is the same
    /// for any value.
    pub order_window: usize,
    /// Busiest ranks encoder work may move away from, per round.
    pub migrate_sources: usize,
    /// Least busy ranks encoder work may move to, per round.
    pub migrate_targets: usize,

    // --- generators: the ramp's stage split (`zb2p(encoders = ramp)`) -----------------
    /// LLM layers a step of the ramp's split search may trade beyond those one
    /// encoder chunk is worth. More: a wider, slower search.
    pub ramp_trade_slack: u32,
    /// Most layers one move of the ramp's split search shifts between two ranks.
    pub ramp_max_shift: u32,
    /// Least gain, as a fraction of the current split's floor, a ramp split must
    /// predict to replace it (relative, so the profile's time unit does not matter);
    /// smaller chases smaller gains for longer.
    pub ramp_min_gain: f64,

    // --- generators: the zero-bubble list search (`zbv(list = search)`, `zbh1(list = search)`) ---
    /// Shares of a rank's activation budget below which a ready `F` goes before a
    /// ready `B` (a deeper warm-up); 0 keeps `B` first. Each value more multiplies the
    /// rules list-scheduled (each O(tasks x ranks)).
    pub zb_fill: &'static [f64],
    /// Shares of the budget from which a pending `W` goes before a ready `F` (it frees
    /// memory before the budget stalls the rank); infinite: never.
    pub zb_w_first: &'static [f64],
    /// How many of its own costs a ready `F` is held back (a pending `W` running
    /// instead, or the rank waiting) for a `B` of the rank about to be ready; 0: never.
    pub zb_wait_b: &'static [f64],
    /// Rules (the fastest by the scheduler's own times) whose plans are then timed
    /// ideally and checked against the memory limit, besides the fixed order. More:
    /// a closer choice, one plan timing each.
    pub zb_keep: usize,
}

impl SearchPolicy {
    /// Today's values: the ones `auto` and `derive` are tuned and tested with.
    pub const DEFAULT: SearchPolicy = SearchPolicy {
        max_chunks: 8,
        prefetch: true,
        full_encoders: 2,
        derive_within: 1.01,
        finalists: 5,
        runner_up_within: 1.01,
        ideal_within: 1.02,
        order_budget: 3000,
        order_actions: 12_000_000,
        order_min: 100,
        goal: 1.05,
        goal_microbatches_per_rank: 2,
        far_budget: 12_000,
        far_actions: 100_000_000,
        work_budget: 1_000_000_000,
        work_per_planned_task: 20,
        work_per_derived_action: 50,
        fill_work: 20_000_000,
        max_threads: 8,
        plan_run: 16,
        plan_memo: 24,
        plan_memo_tasks: 2_000_000,
        replace_rounds: 2,
        meet_candidates: 4,
        periodic_min_periods: 3,
        periodic_probes: 8,
        periodic_min_break_share: 0.125,
        periodic_settle_periods: &[4, 8],
        meet_idle_parts: 100.0,
        refine_budget: 300,
        refine_actions: 1_500_000,
        w_budget: 2000,
        w_actions: 3_000_000,
        w_min: 200,
        w_moves_per_round: 800,
        w_fit: 2.0,
        lookahead: 20,
        min_wait: 1e-6,
        parallel_tasks: 1500,
        order_window: 2,
        migrate_sources: 3,
        migrate_targets: 3,
        ramp_trade_slack: 2,
        ramp_max_shift: 3,
        ramp_min_gain: 1e-6,
        zb_fill: &[0.0, 0.75],
        zb_w_first: &[f64::INFINITY, 0.9],
        zb_wait_b: &[0.0, 0.5, 1.0],
        zb_keep: 4,
    };
}

impl Default for SearchPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}
