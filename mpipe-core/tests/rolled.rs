//! Re-rolling (`mpipe_core::rolled`): round trips, code size, hand-made patterns.
//!
//! - `unroll(roll(p))` is `p` in canonical form ([`canonical`]) for random (not
//!   necessarily valid) action lists under random options, and exactly `p` for
//!   derived programs of every body and `transpose` variant and for random small
//!   derivations (the lowering writes canonical batches); the unrolled program
//!   verifies and simulates to the derivation's figures.
//! - The code size (steps written out: plain steps plus loop bodies) of the regular
//!   schedules is *exactly* the same over 64 and over 4096 micro-batches (8 ranks).
//! - A non-affine pattern stays flat; an affine one becomes one loop.
//!
//! Run with `cargo test --release -p mpipe-core --test rolled` (the code-size tests
//! derive 4096 micro-batches).

use mpipe_core::derive::{derive_str, Derived, ErrorKind, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, CollKind, Cost, Dir, Op, Program, Tensor, Unit, FORMAT};
use mpipe_core::rolled::{
    canonical, roll, roll_with, unroll, Affine, Block, Op as Step, RollError, RollOptions, Rolled,
    MAX_DEPTH,
};
use mpipe_core::simulate::{simulate, Mode};
use mpipe_core::verify::verify;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------
// Helpers.

/// profiles/encoder-heavy.toml (meant for 4 ranks: 8 LLM layers).
fn encoder_heavy() -> Profile {
    Profile::from_toml_str(include_str!("../../profiles/encoder-heavy.toml")).unwrap()
}

/// encoder-heavy with 32 LLM layers, so that 8 ranks x 2 chunks have a layer each;
/// `trainable = false` freezes the encoder.
fn encoder_heavy_32(trainable: bool) -> Profile {
    let text = include_str!("../../profiles/encoder-heavy.toml")
        .replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 32\n")
        .replace("trainable = true", &format!("trainable = {trainable}"));
    assert!(text.contains("layers = 32"), "profile text changed");
    Profile::from_toml_str(&text).unwrap()
}

fn derive(profile: &Profile, ranks: usize, microbatches: usize, expr: &str) -> Derived {
    let req = Request::new(profile, ranks, microbatches);
    derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr} ({ranks} x {microbatches}): {e:?}"))
}

/// Every loop, at every level, respects the options; loops nest at most `MAX_DEPTH`
/// deep, and every micro-batch number depends only on the loops around it.
fn check_shape(r: &Rolled, opts: &RollOptions) -> Result<(), TestCaseError> {
    fn walk(b: &Block, depth: usize, opts: &RollOptions) -> Result<(), TestCaseError> {
        match b {
            Block::Loop { count, body } => {
                prop_assert!(depth < MAX_DEPTH, "nested too deep: {b:?}");
                prop_assert!(*count >= opts.min_iterations.max(2), "{b:?}");
                prop_assert!(!body.is_empty() && body.len() <= opts.max_period);
                // Each of the body's items saves a step at least per iteration
                // (counted before the body's own loops were rolled).
                let steps: usize = body.iter().map(Block::steps).sum();
                prop_assert!(steps * (count - 1) >= opts.min_saving);
                for x in body {
                    walk(x, depth + 1, opts)?;
                }
            }
            Block::Op(op) => {
                let mbs: Vec<Affine> = match op {
                    Step::Compute { mb, .. } => vec![*mb],
                    Step::Batch(ps) => ps.iter().map(|p| p.mb).collect(),
                    Step::Coll { .. } => vec![],
                };
                for a in mbs {
                    prop_assert!(a.depth() <= depth, "{a:?} inside {depth} loops");
                }
            }
        }
        Ok(())
    }
    for blocks in &r.ranks {
        for b in blocks {
            walk(b, 0, opts)?;
        }
    }
    Ok(())
}

/// `unroll(roll_with(p, opts))` is `p` in canonical form, rank by rank.
fn check_round_trip(p: &Program, opts: &RollOptions) -> Result<Rolled, TestCaseError> {
    let r = roll_with(p, opts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    check_shape(&r, opts)?;
    let back = unroll(&r);
    prop_assert_eq!(back.len(), p.programs.len());
    for (rank, (got, list)) in back.iter().zip(&p.programs).enumerate() {
        let want = canonical(list);
        prop_assert_eq!(canonical(&want), want.clone(), "canonical is idempotent");
        if *got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b);
            return Err(TestCaseError::fail(format!(
                "rank {rank}: unroll(roll(p)) differs from canonical(p) at action {at:?} \
                 (lengths {} vs {})\n{r}",
                got.len(),
                want.len()
            )));
        }
    }
    Ok(r)
}

/// The round trip for a derived program, and the canonical form is the same program:
/// it verifies, and simulates to the same figures.
fn check_derived(d: &Derived, req: &Request) -> Result<Rolled, TestCaseError> {
    let r = check_round_trip(&d.program, &RollOptions::default())?;
    // The lowering writes batches in canonical form: the round trip is exact.
    prop_assert!(unroll(&r) == d.program.programs, "not exact");
    let back = Program {
        programs: unroll(&r),
        ..d.program.clone()
    };
    let violations = verify(&back);
    prop_assert!(violations.is_empty(), "{:?}", violations.first());
    let sim = simulate(&back, &req.sim_options(Mode::Rendezvous))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
    prop_assert!(
        close(sim.makespan, d.report.makespan),
        "makespan {} vs {}",
        sim.makespan,
        d.report.makespan
    );
    for (a, b) in sim.peak_memory.iter().zip(&d.report.peak_memory) {
        prop_assert!(close(*a, *b), "peak memory {a} vs {b}");
    }
    Ok(r)
}

fn code_sizes(r: &Rolled) -> Vec<usize> {
    (0..r.ranks.len()).map(|k| r.code_size(k)).collect()
}

// ---------------------------------------------------------------------------
// Derived programs.

const BODIES: [&str; 6] = [
    "gpipe",
    "1f1b",
    "interleaved(v = 2)",
    "zbh1",
    "zbv",
    "dualpipev",
];

/// Every body, bare and under every `transpose` variant.
fn all_exprs() -> Vec<String> {
    let mut v = Vec::new();
    for body in BODIES {
        v.push(body.to_string());
        for opts in [
            "",
            ", owners = min",
            ", backward = central",
            ", owners = min, backward = central",
        ] {
            v.push(format!("transpose(vision, {body}{opts})"));
        }
    }
    v
}

#[test]
fn derived_programs_round_trip() {
    let heavy = encoder_heavy();
    let heavy32 = encoder_heavy_32(true);
    let cases: [(&Profile, usize, usize); 5] = [
        (&heavy, 4, 4),
        (&heavy, 4, 8),
        (&heavy, 4, 12),
        (&heavy, 2, 6),
        (&heavy32, 8, 32),
    ];
    let mut checked = 0;
    for (profile, p, m) in cases {
        for expr in all_exprs() {
            let req = Request::new(profile, p, m);
            let d = match derive_str(&req, &expr) {
                Ok(d) => d,
                Err(es) if es.iter().all(|e| e.kind == ErrorKind::Microbatches) => continue,
                Err(es) => panic!("{expr} ({p} x {m}): {es:?}"),
            };
            check_derived(&d, &req).unwrap_or_else(|e| panic!("{expr} ({p} x {m}): {e}"));
            checked += 1;
        }
    }
    // 5 cases x 30 expressions; only the V schedules over 2 ranks and 6 micro-batches
    // may be refused.
    assert!(checked >= 140, "{checked} programs checked");
}

/// The generators `BODIES` leaves out (`interleaved` with more chunks, every `zb2p`
/// form of `auto`'s search space) and `fill` over the bodies: the round trip is exact
/// and the unrolled program runs to the derivation's figures (4 ranks, small-mllm
/// with 48 LLM layers: 2, 3 or 4 chunks per rank). The code sizes of the same
/// schedules are in `mpipe-codegen/tests/code_size.rs`.
#[test]
fn more_generators_and_fill_round_trip() {
    let text = include_str!("../../docs/guide/examples/small-mllm.toml")
        .replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 48\n");
    assert!(text.contains("layers = 48"), "profile text changed");
    let profile = Profile::from_toml_str(&text).unwrap();
    let mut exprs: Vec<String> = [
        "interleaved(v = 3)",
        "interleaved(v = 4)",
        "zb2p",
        "zb2p(costs = unit)",
        "zb2p(v = 2)",
        "zb2p(layout = v)",
        "zb2p(encoders = spread)",
        "zb2p(encoders = spread, costs = unit)",
        "zb2p(encoders = spread, layout = v)",
        "zb2p(encoders = chain)",
        "zb2p(encoders = chain, costs = unit)",
        "zb2p(encoders = ramp)",
        "zb2p(encoders = ramp, costs = unit)",
        "zb2p(v = 2, encoders = ramp)",
    ]
    .map(String::from)
    .to_vec();
    for body in BODIES
        .iter()
        .chain(&["interleaved(v = 3)", "zb2p", "zb2p(v = 2)"])
    {
        exprs.push(format!("fill(vision, {body})"));
        exprs.push(format!("transpose(vision, {body})"));
    }
    for m in [8, 40, 128] {
        for expr in &exprs {
            let req = Request::new(&profile, 4, m);
            let d = derive(&profile, 4, m, expr);
            check_derived(&d, &req).unwrap_or_else(|e| panic!("{expr} (4 x {m}): {e}"));
        }
    }
}

// ---------------------------------------------------------------------------
// Random small derivations.

fn derivation_case() -> impl Strategy<Value = (String, String, usize, usize)> {
    let body = prop::sample::select(BODIES.to_vec());
    let wrap = prop_oneof![
        Just(""),
        Just("transpose"),
        Just("transpose min"),
        Just("transpose central"),
    ];
    (
        body,
        wrap,
        1usize..=6,
        1usize..=20,
        (
            1u32..=6,
            prop::sample::select(vec![0.5f64, 1.0, 1.5, 2.0, 3.7]),
            prop::sample::select(vec![0.5f64, 1.0, 1.25, 2.0]),
            any::<bool>(),
        ),
        (
            0usize..=6,
            prop::sample::select(vec![0.5f64, 1.0, 2.0]),
            prop::sample::select(vec![0.0f64, 0.5, 1.0]),
        ),
    )
        .prop_map(
            |(body, wrap, ranks, mbs, (el, ef, eb, trainable), (extra, lf, lw))| {
                let expr = match wrap {
                    "" => body.to_string(),
                    "transpose" => format!("transpose(vision, {body})"),
                    "transpose min" => format!("transpose(vision, {body}, owners = min)"),
                    _ => format!("transpose(vision, {body}, backward = central)"),
                };
                let layers = ranks * 2 + extra;
                let profile = format!(
                    "[[encoder]]\nname = \"vision\"\nlayers = {el}\nforward = {ef:?}\n\
                     backward = {eb:?}\nweight = 0.5\nactivation = 0.1\nparams = 1.0\n\
                     trainable = {trainable}\n\n[llm]\nlayers = {layers}\nforward = {lf:?}\n\
                     backward = 1.0\nweight = {lw:?}\nactivation = 1.0\nparams = 0.25\n"
                );
                (expr, profile, ranks, mbs)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_derivations_round_trip((expr, text, ranks, mbs) in derivation_case()) {
        let profile = Profile::from_toml_str(&text).unwrap();
        let req = Request::new(&profile, ranks, mbs);
        match derive_str(&req, &expr) {
            Ok(d) => {
                check_derived(&d, &req)?;
            }
            // Some bodies need other micro-batch counts (interleaved: a multiple of the
            // ranks; the V schedules: at least twice the ranks, ...).
            Err(es) => prop_assert!(
                es.iter().all(|e| e.kind == ErrorKind::Microbatches),
                "{expr}: {es:?}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// Random action lists: loop finding and batch grouping on anything.

const UNITS: [&str; 3] = ["a", "b", "c"];

fn units() -> Vec<Unit> {
    UNITS
        .iter()
        .map(|n| Unit {
            role: mpipe_core::program::Role::of_name(n),
            name: n.to_string(),
            inputs: vec![],
            home: 0,
            trainable: true,
            cost: Cost {
                f: 1.0,
                b: 1.0,
                w: 1.0,
            },
            act: 1.0,
            bytes: 0.0,
            params: 0.0,
        })
        .collect()
}

fn program(lists: Vec<Vec<Action>>) -> Program {
    Program {
        format: FORMAT.to_string(),
        ranks: lists.len(),
        microbatches: 1000,
        units: units(),
        programs: lists,
        source: None,
        prefetch: Vec::new(),
    }
}

/// One action of a template: kind 0-4 compute op, 5 SEND, 6 RECV, 7 BCAST, 8 REDUCE;
/// unit; peer; batch id (p2p only); micro-batch base and stride.
type Template = (u8, usize, usize, Option<u64>, i64, i64);

fn template() -> impl Strategy<Value = Template> {
    (
        0u8..9,
        0usize..3,
        0usize..3,
        prop_oneof![Just(None), (0u64..3).prop_map(Some)],
        20i64..40,
        -2i64..=3,
    )
}

fn action((kind, unit, peer, batch, base, stride): Template, t: i64, noise: i64) -> Action {
    let mb = usize::try_from(base + stride * t + noise).unwrap();
    let unit = UNITS[unit];
    let ops = [Op::F, Op::B, Op::W, Op::BW, Op::RF];
    match kind {
        0..=4 => Action::compute(ops[kind as usize], unit, mb),
        5 | 6 => {
            let dir = if kind == 5 { Dir::Send } else { Dir::Recv };
            let tensor = [Tensor::Act, Tensor::Grad, Tensor::Input][peer];
            Action::p2p(dir, tensor, unit, mb, peer, batch)
        }
        7 => Action::coll(CollKind::Bcast, unit, peer, vec![0, peer]),
        _ => Action::coll(CollKind::Reduce, unit, peer, vec![peer, 2]),
    }
}

/// A list made of segments: a template of 1-4 actions repeated 1-6 times with affine
/// micro-batches, sometimes with noise on one repetition.
fn action_list() -> impl Strategy<Value = Vec<Action>> {
    prop::collection::vec(
        (
            prop::collection::vec(template(), 1..=4),
            1i64..=6,
            prop::option::weighted(0.3, (0i64..6, 1i64..4)),
        ),
        0..=12,
    )
    .prop_map(|segments| {
        let mut list = Vec::new();
        for (tpl, reps, noise) in segments {
            for t in 0..reps {
                for (k, x) in tpl.iter().enumerate() {
                    let n = match noise {
                        Some((at, by)) if at == t && k == 0 => by,
                        _ => 0,
                    };
                    list.push(action(*x, t, n));
                }
            }
        }
        list
    })
}

fn options() -> impl Strategy<Value = RollOptions> {
    prop_oneof![
        Just(RollOptions::default()),
        (1usize..=12, 0usize..=4, 0usize..=3).prop_map(
            |(max_period, min_iterations, min_saving)| {
                RollOptions {
                    max_period,
                    min_iterations,
                    min_saving,
                }
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_lists_round_trip(lists in prop::collection::vec(action_list(), 1..=3), opts in options()) {
        let p = program(lists);
        let r = check_round_trip(&p, &opts)?;
        // Batch ids are free: renumbering them never changes the rolled form.
        let shifted = Program {
            programs: p
                .programs
                .iter()
                .map(|l| {
                    l.iter()
                        .cloned()
                        .map(|mut a| {
                            let batch = a.batch().map(|b| b * 7 + 100);
                            a.set_batch(batch);
                            a
                        })
                        .collect()
                })
                .collect(),
            ..p.clone()
        };
        prop_assert_eq!(roll_with(&shifted, &opts).unwrap(), r);
    }
}

/// A nested repetition: a template action whose micro-batch is affine in the counters
/// of the repetitions around it (`strides[level]`, outermost first), or a repetition
/// of a sequence of patterns.
#[derive(Clone, Debug)]
enum Pattern {
    Leaf(Template, [i64; 6]),
    Repeat(usize, Vec<Pattern>),
}

/// Patterns nested up to 6 levels (deeper than `MAX_DEPTH`).
fn pattern() -> impl Strategy<Value = Pattern> {
    let leaf =
        (template(), prop::array::uniform6(-2i64..=3)).prop_map(|(t, s)| Pattern::Leaf(t, s));
    leaf.prop_recursive(6, 48, 4, |inner| {
        (1usize..=4, prop::collection::vec(inner, 1..=4))
            .prop_map(|(n, parts)| Pattern::Repeat(n, parts))
    })
}

/// `p` written out inside repetitions whose counters are `counters` (outermost
/// first): each action's template with its micro-batch (clamped at 0).
fn write_out(p: &Pattern, counters: &mut Vec<i64>, out: &mut Vec<(Template, i64)>) {
    match p {
        Pattern::Leaf(t, strides) => {
            let mb = t.4
                + counters
                    .iter()
                    .zip(strides)
                    .map(|(c, s)| c * s)
                    .sum::<i64>();
            out.push((*t, mb.max(0)));
        }
        Pattern::Repeat(n, parts) => {
            for k in 0..*n {
                counters.push(k as i64);
                for q in parts {
                    write_out(q, counters, out);
                }
                counters.pop();
            }
        }
    }
}

/// A list of nested repetitions (at most 4000 actions), sometimes with one action's
/// micro-batch moved off its pattern.
fn nested_list() -> impl Strategy<Value = Vec<Action>> {
    (
        prop::collection::vec(pattern(), 0..=4),
        prop::option::weighted(0.3, (any::<prop::sample::Index>(), 1i64..4)),
    )
        .prop_map(|(patterns, noise)| {
            let mut tpl = Vec::new();
            for p in &patterns {
                write_out(p, &mut Vec::new(), &mut tpl);
            }
            tpl.truncate(4000);
            let noisy =
                noise.and_then(|(at, by)| (!tpl.is_empty()).then(|| (at.index(tpl.len()), by)));
            tpl.iter()
                .enumerate()
                .map(|(k, &(t, mb))| {
                    let n = noisy.filter(|&(at, _)| at == k).map_or(0, |(_, by)| by);
                    action((t.0, t.1, t.2, t.3, mb, 0), 0, n)
                })
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Nested repetitions roll into nested loops (at most `MAX_DEPTH` deep, every loop
    /// within the options) that unroll to the list itself, in canonical form.
    #[test]
    fn random_nested_lists_round_trip(lists in prop::collection::vec(nested_list(), 1..=2), opts in options()) {
        let p = program(lists);
        let r = check_round_trip(&p, &opts)?;
        // The rolled form executes every step once.
        for (rank, list) in p.programs.iter().enumerate() {
            let steps: usize = r.ranks[rank].iter().map(Block::steps).sum();
            prop_assert!(steps <= list.len());
        }
    }
}

/// Action `op` of unit `a` on micro-batch `mb`.
fn act(op: Op, mb: usize) -> Action {
    Action::compute(op, "a", mb)
}

/// A period with inner repetitions, as a list scheduler's steady state has (4
/// forward-backward pairs, then their 4 weight gradients; the period advances 4
/// micro-batches): one loop over the periods holding a loop per repetition, of the
/// same size for 10 and for 1000 periods, and written with a counter per level.
#[test]
fn a_period_with_inner_repetitions_becomes_a_loop_of_loops() {
    let list = |periods: usize| -> Vec<Action> {
        (0..periods)
            .flat_map(|s| {
                (0..4)
                    .flat_map(move |t| [act(Op::F, 4 * s + t + 4), act(Op::B, 4 * s + t)])
                    .chain((0..4).map(move |t| act(Op::W, 4 * s + t)))
            })
            .collect()
    };
    for periods in [10, 1000] {
        let l = list(periods);
        let r = roll(&program(vec![l.clone()])).unwrap();
        assert_eq!(unroll(&r)[0], l);
        let [Block::Loop { count, body }] = &r.ranks[0][..] else {
            panic!("one loop expected:\n{r}")
        };
        assert_eq!(*count, periods);
        assert!(
            matches!(
                &body[..],
                [Block::Loop { count: 4, body: fb }, Block::Loop { count: 4, body: w }]
                    if fb.len() == 2 && w.len() == 1
            ),
            "{r}"
        );
        assert_eq!(r.code_size(0), 3, "{r}");
    }
    let text = roll(&program(vec![list(10)])).unwrap().to_string();
    for want in [
        "for i in 0..10 {",
        "    for j in 0..4 {",
        "F(a, 4 + 4*i + j)",
        "B(a, 0 + 4*i + j)",
        "W(a, 0 + 4*i + j)",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
}

/// A sequence of loops that repeats with a period longer than `max_period` steps:
/// the first pass rolls each run of forwards, the next pass the runs and the sends
/// between them.
#[test]
fn a_sequence_of_loops_becomes_a_loop_of_loops() {
    let list: Vec<Action> = (0..10)
        .flat_map(|s| (0..5).map(move |t| f(10 * s + t)).chain([send(s)]))
        .collect();
    let opts = RollOptions {
        max_period: 3,
        ..RollOptions::default()
    };
    let r = roll_with(&program(vec![list.clone()]), &opts).unwrap();
    assert_eq!(unroll(&r)[0], list);
    assert!(
        matches!(
            &r.ranks[0][..],
            [Block::Loop { count: 10, body }]
                if matches!(&body[..], [Block::Loop { count: 5, .. }, Block::Op(_)])
        ),
        "{r}"
    );
    assert!(r.to_string().contains("F(a, 0 + 10*i + j)"), "{r}");
    assert!(r.to_string().contains("SEND act(a, 0 + i)->1"), "{r}");
}

/// Repetitions nested deeper than `MAX_DEPTH`: loops go `MAX_DEPTH` deep, the
/// outer repetitions stay written out, and the round trip is exact.
#[test]
fn nesting_stops_at_max_depth() {
    // Level 0: F; level `n`: three repetitions of level `n - 1` (the micro-batch
    // advancing by 3^(n-1)), then a `W` marking the level.
    fn level(n: u32, at: usize, out: &mut Vec<Action>) {
        if n == 0 {
            out.push(f(at));
            return;
        }
        for k in 0..3 {
            level(n - 1, at + k * 3usize.pow(n - 1), out);
        }
        out.push(act(Op::W, n as usize));
    }
    let mut list = Vec::new();
    level(MAX_DEPTH as u32 + 2, 0, &mut list);
    let r = roll(&program(vec![list.clone()])).unwrap();
    assert_eq!(unroll(&r)[0], list);
    let depth = r.ranks[0].iter().map(Block::depth).max().unwrap();
    assert_eq!(depth, MAX_DEPTH, "{r}");
    assert!(
        r.code_size(0) < list.len() / 20,
        "{} of {}:\n{r}",
        r.code_size(0),
        list.len()
    );
}

// ---------------------------------------------------------------------------
// Code size does not grow with the micro-batch count.

/// `(expr, trainable encoder)`: the schedules whose code size is asserted to be
/// exactly equal over 64 and over 4096 micro-batches (8 ranks, encoder-heavy with 32
/// LLM layers). `gpipe` runs with a frozen encoder: with the trainable one, rank 0's
/// backward (`BW(llm.0)` + `BW(vision)`) is slower than rank 1's, the lowering places
/// rank 1's sends where rank 0 meets them, and that placement repeats only every 89
/// micro-batches (about 220 steps: 52 steps at 64 micro-batches, 297 at 4096).
const CONSTANT_SIZE: [(&str, bool); 7] = [
    ("1f1b", true),
    ("gpipe", false),
    ("zbh1", true),
    ("interleaved(v = 2)", true),
    ("transpose(vision, 1f1b, owners = min)", true),
    ("zbv", true),
    ("dualpipev", true),
];

fn sizes_at(expr: &str, trainable: bool, m: usize) -> (Vec<usize>, usize) {
    let profile = encoder_heavy_32(trainable);
    let d = derive(&profile, 8, m, expr);
    let r = roll(&d.program).unwrap();
    assert_eq!(
        unroll(&r),
        d.program
            .programs
            .iter()
            .map(|l| canonical(l))
            .collect::<Vec<_>>(),
        "{expr} x {m}"
    );
    let actions = d.program.programs.iter().map(Vec::len).max().unwrap();
    (code_sizes(&r), actions)
}

#[test]
fn regular_schedules_roll_to_a_size_independent_of_microbatches() {
    for (expr, trainable) in CONSTANT_SIZE {
        let (small, small_actions) = sizes_at(expr, trainable, 64);
        let (large, large_actions) = sizes_at(expr, trainable, 4096);
        assert!(large_actions >= 4096, "{expr}: {large_actions} actions");
        assert_eq!(
            small, large,
            "{expr}: code size per rank over 64 micro-batches ({small_actions} actions on \
             the largest rank) vs 4096 ({large_actions})"
        );
    }
}

/// `transpose(vision, 1f1b)` with round-robin owners rolls to a constant size too: its
/// placement (the best of the prefix, idle and late placements by the plan's ideal
/// timing, every owner's forwards at its front) repeats every micro-batch. (Its peak
/// activation memory still grows with the micro-batch count, 60.8 at 64 and 1875.2
/// at 4096 on rank 0: the owners run their forwards ahead of the first stage.)
#[test]
fn transpose_round_robin_rolls_to_a_constant_size() {
    let (small, _) = sizes_at("transpose(vision, 1f1b)", true, 64);
    let (large, _) = sizes_at("transpose(vision, 1f1b)", true, 4096);
    assert_eq!(small, large);
}

/// See [`CONSTANT_SIZE`]: `gpipe` with the trainable encoder-heavy encoder does not
/// roll to exactly the same code at every size. Rank 0's backward (`BW(llm.0)` +
/// `BW(vision)`) is slower than rank 1's, so the meeting points the lowering chooses
/// (where neither rank waits) slide one compute task along rank 0's list every few
/// micro-batches, and the program repeats only every 89 micro-batches (largest rank:
/// 44 steps at 64 micro-batches, 260 at 4096). The periodic transfer placement
/// (`search/periodic.rs`) places one period's transfers in every period where that
/// is no slower: the code at 4096 micro-batches is then no larger than at 64 (15
/// steps on the largest rank at 4096; at 64 the drifting placement is kept).
#[test]
fn gpipe_trainable_encoder_code_does_not_grow() {
    let max = |m| sizes_at("gpipe", true, m).0.into_iter().max().unwrap();
    let (small, large) = (max(64), max(4096));
    assert!(
        large as f64 <= 1.1 * small as f64,
        "largest rank: {small} steps at 64 micro-batches, {large} at 4096"
    );
}

// ---------------------------------------------------------------------------
// Hand-made programs.

fn f(mb: usize) -> Action {
    Action::compute(Op::F, "a", mb)
}

fn send(mb: usize) -> Action {
    Action::p2p(Dir::Send, Tensor::Act, "a", mb, 1, None)
}

fn steps(r: &Rolled, rank: usize) -> usize {
    r.ranks[rank].iter().map(Block::steps).sum()
}

/// Squares: every delta differs from the last, so no three iterations are affine.
#[test]
fn non_affine_pattern_stays_flat() {
    let list: Vec<Action> = (0..16).flat_map(|k| [f(k * k), send(k * k)]).collect();
    let p = program(vec![list.clone()]);
    let r = roll(&p).unwrap();
    assert!(r.ranks[0].iter().all(|b| matches!(b, Block::Op(_))), "{r}");
    assert_eq!(r.code_size(0), 32);
    assert_eq!(unroll(&r)[0], list);

    // Lucas numbers, one shape: no two consecutive deltas are equal, flat too.
    let mut fib = vec![1usize, 3];
    while fib.len() < 20 {
        fib.push(fib[fib.len() - 1] + fib[fib.len() - 2]);
    }
    let p = program(vec![fib.iter().map(|&m| f(m)).collect()]);
    let r = roll(&p).unwrap();
    assert_eq!(r.code_size(0), 20, "{r}");
}

/// Two points are always affine: with `min_iterations = 2` the squares pair up.
#[test]
fn two_iterations_fit_anything() {
    let list: Vec<Action> = (0..16).flat_map(|k| [f(k * k), send(k * k)]).collect();
    let opts = RollOptions {
        min_iterations: 2,
        ..RollOptions::default()
    };
    let r = roll_with(&program(vec![list.clone()]), &opts).unwrap();
    assert!(r.code_size(0) < 32, "{r}");
    assert_eq!(unroll(&r)[0], list);
}

#[test]
fn affine_patterns_become_loops() {
    // F(3t + 1), SEND(3t + 1), F(100 - t): one loop, three strides.
    let list: Vec<Action> = (0..50)
        .flat_map(|t| [f(3 * t + 1), send(3 * t + 1), f(100 - t)])
        .collect();
    let r = roll(&program(vec![list.clone()])).unwrap();
    let [Block::Loop { count, body }] = &r.ranks[0][..] else {
        panic!("one loop expected:\n{r}")
    };
    assert_eq!(*count, 50);
    assert_eq!(
        body[..],
        [
            Step::Compute {
                op: Op::F,
                unit: 0,
                mb: Affine::new(1, 3)
            },
            Step::Batch(vec![mpipe_core::rolled::P2p {
                dir: Dir::Send,
                tensor: Tensor::Act,
                unit: 0,
                mb: Affine::new(1, 3),
                peer: 1
            }]),
            Step::Compute {
                op: Op::F,
                unit: 0,
                mb: Affine::new(100, -1)
            },
        ]
        .map(Block::Op)
    );
    assert_eq!(unroll(&r)[0], list);
    assert!(r.to_string().contains("for i in 0..50 {"), "{r}");
    assert!(r.to_string().contains("F(a, 100 - i)"), "{r}");

    // An affine run, then squares, then a constant stretch: loop, flat, loop.
    let mut list: Vec<Action> = (0..10).map(f).collect();
    list.extend([7, 3, 12, 1, 30].map(f));
    list.extend((0..6).map(|_| f(5)));
    let r = roll(&program(vec![list.clone()])).unwrap();
    assert_eq!(r.ranks[0].len(), 1 + 5 + 1, "{r}");
    assert!(matches!(r.ranks[0][0], Block::Loop { count: 10, .. }));
    assert!(matches!(r.ranks[0][6], Block::Loop { count: 6, .. }));
    assert_eq!(steps(&r, 0), list.len());
    assert_eq!(unroll(&r)[0], list);
}

/// The longest cover wins, ties go to the shorter period.
#[test]
fn longest_cover_then_shortest_period() {
    // F(0) F(0) | F(0) F(1) | F(0) F(2) | F(0) F(3): period 1 covers the first three
    // steps, period 2 all eight.
    let list: Vec<Action> = (0..4).flat_map(|t| [f(0), f(t)]).collect();
    let r = roll(&program(vec![list.clone()])).unwrap();
    assert_eq!(unroll(&r)[0], list);
    assert!(
        matches!(&r.ranks[0][..], [Block::Loop { count: 4, body }] if body.len() == 2),
        "{r}"
    );

    // F(0..12): periods 1, 2, 3... all cover 12 steps; period 1 is kept.
    let r = roll(&program(vec![(0..12).map(f).collect()])).unwrap();
    assert!(
        matches!(&r.ranks[0][..], [Block::Loop { count: 12, body }] if body.len() == 1),
        "{r}"
    );
}

#[test]
fn batches_group_by_consecutive_equal_ids_and_renumber() {
    let s = |mb, peer, b| Action::p2p(Dir::Send, Tensor::Act, "a", mb, peer, b);
    let rv = |mb, peer, b| Action::p2p(Dir::Recv, Tensor::Grad, "b", mb, peer, b);
    let list = vec![
        rv(0, 2, Some(7)),
        s(0, 1, Some(7)),
        f(0),
        s(1, 1, Some(3)), // a batch of one: no id
        rv(1, 2, None),
        rv(2, 0, Some(9)),
        s(2, 2, Some(9)),
        s(2, 1, Some(9)),
        s(3, 1, Some(4)), // a new id: a new batch
        rv(3, 2, Some(4)),
        f(1),
        rv(4, 2, Some(4)), // the same id again, but not consecutive: a new batch
        s(4, 1, Some(4)),
    ];
    let want = vec![
        s(0, 1, Some(0)),
        rv(0, 2, Some(0)),
        f(0),
        s(1, 1, None),
        rv(1, 2, None),
        s(2, 1, Some(1)),
        s(2, 2, Some(1)),
        rv(2, 0, Some(1)),
        s(3, 1, Some(2)),
        rv(3, 2, Some(2)),
        f(1),
        s(4, 1, Some(3)),
        rv(4, 2, Some(3)),
    ];
    assert_eq!(canonical(&list), want);
    let r = roll(&program(vec![list])).unwrap();
    assert_eq!(unroll(&r)[0], want);
    let batch_sizes: Vec<usize> = r.ranks[0]
        .iter()
        .filter_map(|b| match b {
            Block::Op(Step::Batch(ps)) => Some(ps.len()),
            _ => None,
        })
        .collect();
    assert_eq!(batch_sizes, [2, 1, 1, 3, 2, 2]);
}

#[test]
fn collectives_and_units_by_index() {
    let list = vec![
        Action::coll(CollKind::Bcast, "c", 0, vec![0, 1]),
        Action::compute(Op::W, "c", 3),
        Action::coll(CollKind::Reduce, "c", 0, vec![0, 1]),
    ];
    let r = roll(&program(vec![list.clone(), vec![]])).unwrap();
    assert_eq!(r.units, ["a", "b", "c"]);
    assert_eq!(
        r.ranks[0][0],
        Block::Op(Step::Coll {
            kind: CollKind::Bcast,
            unit: 2,
            root: 0,
            group: vec![0, 1]
        })
    );
    assert_eq!(
        r.ranks[0][1],
        Block::Op(Step::Compute {
            op: Op::W,
            unit: 2,
            mb: Affine::constant(3)
        })
    );
    assert!(r.ranks[1].is_empty());
    assert_eq!(unroll(&r), [list, vec![]]);
}

#[test]
fn unknown_unit_is_an_error() {
    let p = program(vec![vec![], vec![f(0), Action::compute(Op::B, "zz", 0)]]);
    let e = roll(&p).unwrap_err();
    assert_eq!(
        e,
        RollError::UnknownUnit {
            rank: 1,
            index: 1,
            name: "zz".into()
        }
    );
    assert!(e
        .to_string()
        .contains("rank 1, action 1: unknown unit `zz`"));
}
