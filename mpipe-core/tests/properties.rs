//! Property tests of the whole derivation over random profiles.
//!
//! Every case draws a model profile (0-2 encoders, each trainable or frozen, random
//! per-layer costs in 0.05..5 with zero weight-gradient costs now and then, random
//! activations, optional first/last stage extras, sometimes a link), a rank count in
//! 1..=16, a micro-batch count in 1..=64, a body schedule and an operator stack
//! (`transpose` with every `owners` / `backward` choice, nested for two encoders;
//! `fill` alone, over `transpose` and under it, nested for two encoders), and
//! checks that the derivation either succeeds or fails only because the body needs
//! other micro-batch counts; and, on success, that the program
//!
//! - passes `verify` (checked here independently of the derivation's own check);
//! - terminates in the simulator under rendezvous and under eager semantics, and the
//!   rendezvous figures are the ones the derivation reported;
//! - has exactly the units `encoders + llm.0 .. llm.{p * chunks - 1}`, whose costs add
//!   up to the profile's;
//! - covers every `(unit, micro-batch)` as rule 1 says (counted here, independently);
//! - never beats the lower bound of its semantics (under rendezvous with a link it
//!   also counts the transfers, so it is never below eager's), and eager is never
//!   slower than rendezvous;
//! - splits each rank's idle time into warm-up, steady and cool-down parts that add
//!   up to the step less the rank's compute;
//! - is derived deterministically (the same JSON twice).
//!
//! The LLM always has at least `ranks x chunks` layers (sometimes exactly that many),
//! and no memory limit is set, so no other error kind is legitimate.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mpipe_core::derive::{bound_for, derive_str, Derived, ErrorKind, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{ActionRef, Op, Program, Unit};
use mpipe_core::simulate::{simulate, Mode};
use mpipe_core::verify::verify;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

// ---------------------------------------------------------------------------
// The random inputs.

/// The body schedules: expression text and chunks per rank.
const BODIES: [(&str, usize); 8] = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved(v = 2)", 2),
    ("interleaved(v = 3)", 3),
    ("interleaved(v = 4)", 4),
    ("zbh1", 1),
    ("zbv", 2),
    ("dualpipev", 2),
];

const ENCODER_NAMES: [&str; 2] = ["vision", "audio"];

/// A value in hundredths (keeps the printed profiles short and exact enough).
fn centi(x: u32) -> f64 {
    f64::from(x) / 100.0
}

/// A per-layer cost in 0.05..=5; a third of the time a round value (0.5, 1 or 2), so
/// that equal times and ties in the schedules' timing come up often.
fn cost() -> impl Strategy<Value = u32> {
    prop_oneof![1 => prop::sample::select(vec![50u32, 100, 200]), 2 => 5u32..=500]
}

/// A weight-gradient cost: sometimes zero.
fn weight_cost() -> impl Strategy<Value = u32> {
    prop_oneof![1 => Just(0u32), 4 => cost()]
}

#[derive(Clone, Debug)]
struct EncSpec {
    layers: u32,
    forward: u32,
    backward: u32,
    /// `None`: the key is omitted (a trainable encoder then gets `weight = 0`).
    weight: Option<u32>,
    activation: u32,
    params: u32,
    output: u32,
    trainable: bool,
}

fn encoder_spec() -> impl Strategy<Value = EncSpec> {
    (
        1u32..=8,
        cost(),
        cost(),
        prop_oneof![1 => Just(None), 4 => weight_cost().prop_map(Some)],
        0u32..=200,
        0u32..=300,
        0u32..=100,
        any::<bool>(),
    )
        .prop_map(
            |(layers, forward, backward, weight, activation, params, output, trainable)| EncSpec {
                layers,
                forward,
                backward,
                weight,
                activation,
                params,
                output,
                trainable,
            },
        )
}

#[derive(Clone, Debug)]
struct ExtraSpec {
    forward: u32,
    backward: u32,
    weight: u32,
    activation: u32,
}

fn extra_spec() -> impl Strategy<Value = Option<ExtraSpec>> {
    prop::option::of((cost(), cost(), weight_cost(), 0u32..=200).prop_map(
        |(forward, backward, weight, activation)| ExtraSpec {
            forward,
            backward,
            weight,
            activation,
        },
    ))
}

#[derive(Clone, Debug)]
struct ProfSpec {
    encoders: Vec<EncSpec>,
    /// Layers beyond `ranks x chunks` (0: exactly one layer per stage).
    extra_layers: u32,
    forward: u32,
    backward: u32,
    weight: u32,
    activation: u32,
    params: u32,
    output: u32,
    first: Option<ExtraSpec>,
    last: Option<ExtraSpec>,
    /// `(latency, bandwidth)` in hundredths.
    link: Option<(u32, u32)>,
}

fn prof_spec(encoders: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = ProfSpec> {
    (
        prop::collection::vec(encoder_spec(), encoders),
        prop_oneof![1 => Just(0u32), 2 => 1u32..=40],
        (
            cost(),
            cost(),
            weight_cost(),
            0u32..=200,
            0u32..=100,
            0u32..=100,
        ),
        extra_spec(),
        extra_spec(),
        prop::option::weighted(0.25, (0u32..=50, 10u32..=1000)),
    )
        .prop_map(
            |(
                encoders,
                extra_layers,
                (forward, backward, weight, activation, params, output),
                first,
                last,
                link,
            )| ProfSpec {
                encoders,
                extra_layers,
                forward,
                backward,
                weight,
                activation,
                params,
                output,
                first,
                last,
                link,
            },
        )
}

impl ProfSpec {
    fn toml(&self, llm_layers: usize) -> String {
        let mut s = String::new();
        for (e, name) in self.encoders.iter().zip(ENCODER_NAMES) {
            let _ = writeln!(s, "[[encoder]]\nname = \"{name}\"\nlayers = {}", e.layers);
            let _ = writeln!(s, "forward = {:?}", centi(e.forward));
            let _ = writeln!(s, "backward = {:?}", centi(e.backward));
            match (e.weight, e.trainable) {
                (Some(w), _) => {
                    let _ = writeln!(s, "weight = {:?}", centi(w));
                }
                (None, true) => s.push_str("weight = 0.0\n"),
                (None, false) => {}
            }
            let _ = writeln!(s, "activation = {:?}", centi(e.activation));
            let _ = writeln!(s, "params = {:?}", centi(e.params));
            let _ = writeln!(s, "output = {:?}", centi(e.output));
            let _ = writeln!(s, "trainable = {}\n", e.trainable);
        }
        let _ = writeln!(s, "[llm]\nlayers = {llm_layers}");
        let _ = writeln!(s, "forward = {:?}", centi(self.forward));
        let _ = writeln!(s, "backward = {:?}", centi(self.backward));
        let _ = writeln!(s, "weight = {:?}", centi(self.weight));
        let _ = writeln!(s, "activation = {:?}", centi(self.activation));
        let _ = writeln!(s, "params = {:?}", centi(self.params));
        let _ = writeln!(s, "output = {:?}", centi(self.output));
        for (key, x) in [
            ("first_stage_extra", &self.first),
            ("last_stage_extra", &self.last),
        ] {
            if let Some(x) = x {
                let _ = writeln!(
                    s,
                    "{key} = {{ forward = {:?}, backward = {:?}, weight = {:?}, activation = {:?} }}",
                    centi(x.forward),
                    centi(x.backward),
                    centi(x.weight),
                    centi(x.activation)
                );
            }
        }
        if let Some((latency, bandwidth)) = self.link {
            let _ = writeln!(
                s,
                "\n[link]\nlatency = {:?}\nbandwidth = {:?}",
                centi(latency),
                centi(bandwidth)
            );
        }
        s
    }
}

/// `transpose` options: `owners` and `backward`, each 0 = omitted (the default),
/// 1 = the default written out, 2 = the other choice.
#[derive(Clone, Copy, Debug)]
struct TOpts {
    owners: u8,
    backward: u8,
}

fn topts() -> impl Strategy<Value = TOpts> {
    (0u8..3, 0u8..3).prop_map(|(owners, backward)| TOpts { owners, backward })
}

impl TOpts {
    fn all() -> Vec<TOpts> {
        let mut v = Vec::new();
        for owners in 0..4 {
            for backward in 0..3 {
                v.push(TOpts { owners, backward });
            }
        }
        v
    }

    fn args(self) -> String {
        let mut s = String::new();
        match self.owners {
            1 => s.push_str(", owners = round_robin"),
            2 => s.push_str(", owners = min"),
            3 => s.push_str(", owners = spare"),
            _ => {}
        }
        match self.backward {
            1 => s.push_str(", backward = local"),
            2 => s.push_str(", backward = central"),
            _ => {}
        }
        s
    }
}

/// The operator stack around the body.
#[derive(Clone, Copy, Debug)]
enum Wrap {
    None,
    /// `transpose(ENCODERS[enc], BODY, ..)`.
    Single {
        enc: usize,
        opts: TOpts,
    },
    /// `transpose(outer, transpose(other, BODY, ..), ..)`.
    Nested {
        outer: usize,
        outer_opts: TOpts,
        inner_opts: TOpts,
    },
    /// `fill(ENCODERS[enc], INNER)` where INNER is the body (`inner` 0), or with two
    /// encoders `transpose(other, BODY, ..)` (1), `fill(other, BODY)` (2), or
    /// `transpose(enc, BODY, ..)` (3, the same encoder: `fill` replaces it); or
    /// `transpose(enc, fill(other, BODY), ..)` (4).
    Fill {
        enc: usize,
        inner: u8,
        opts: TOpts,
    },
}

impl Wrap {
    fn expr(self, body: &str) -> String {
        match self {
            Wrap::None => body.to_string(),
            Wrap::Single { enc, opts } => {
                format!("transpose({}, {body}{})", ENCODER_NAMES[enc], opts.args())
            }
            Wrap::Nested {
                outer,
                outer_opts,
                inner_opts,
            } => format!(
                "transpose({}, transpose({}, {body}{}){})",
                ENCODER_NAMES[outer],
                ENCODER_NAMES[1 - outer],
                inner_opts.args(),
                outer_opts.args()
            ),
            Wrap::Fill { enc, inner, opts } => {
                let (me, other) = (ENCODER_NAMES[enc], ENCODER_NAMES[1 - enc]);
                let a = opts.args();
                match inner {
                    1 => format!("fill({me}, transpose({other}, {body}{a}))"),
                    2 => format!("fill({me}, fill({other}, {body}))"),
                    3 => format!("fill({me}, transpose({me}, {body}{a}))"),
                    4 => format!("transpose({me}, fill({other}, {body}){a})"),
                    _ => format!("fill({me}, {body})"),
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Case {
    profile: ProfSpec,
    ranks: usize,
    mbs: usize,
    body: usize,
    wrap: Wrap,
}

impl Case {
    fn chunks(&self) -> usize {
        BODIES[self.body].1
    }

    fn llm_layers(&self) -> usize {
        self.ranks * self.chunks() + self.profile.extra_layers as usize
    }

    fn expr(&self) -> String {
        self.wrap.expr(BODIES[self.body].0)
    }

    fn toml(&self) -> String {
        self.profile.toml(self.llm_layers())
    }

    fn describe(&self) -> String {
        format!(
            "expression `{}`, ranks = {}, microbatches = {}, profile:\n{}",
            self.expr(),
            self.ranks,
            self.mbs,
            self.toml()
        )
    }

    /// Whether the body accepts this many micro-batches (as the generators document).
    fn microbatches_ok(&self) -> bool {
        match BODIES[self.body].0 {
            b if b.starts_with("interleaved") => self.mbs.is_multiple_of(self.ranks),
            "dualpipev" => self.mbs >= 2 * self.ranks,
            _ => true,
        }
    }
}

/// Micro-batches: uniform in 1..=max, or a small multiple of the ranks (so that
/// interleaved and dualpipev are exercised), capped at `max`.
fn microbatches(ranks: usize, max: usize, mode: bool, raw: usize, k: usize) -> usize {
    if mode {
        (ranks * k).min(max / ranks * ranks).max(1)
    } else {
        1 + raw % max
    }
}

/// Which operator stacks a strategy draws.
#[derive(Clone, Copy)]
enum Wraps {
    None,
    Single,
    Nested,
    Fill,
}

fn case(
    encoders: std::ops::RangeInclusive<usize>,
    wraps: Wraps,
    max_ranks: usize,
    max_mbs: usize,
) -> impl Strategy<Value = Case> {
    (
        prof_spec(encoders),
        1..=max_ranks,
        (any::<bool>(), 0..max_mbs, 1usize..=4),
        0..BODIES.len(),
        (any::<bool>(), topts(), topts(), 0u8..5),
    )
        .prop_map(
            move |(profile, ranks, (mode, raw, k), body, (first, o1, o2, inner))| {
                let n = profile.encoders.len();
                let wrap = match (wraps, n) {
                    (Wraps::None, _) | (_, 0) => Wrap::None,
                    (Wraps::Single, _) | (Wraps::Nested, 1) => Wrap::Single {
                        enc: usize::from(first) % n,
                        opts: o1,
                    },
                    (Wraps::Nested, _) => Wrap::Nested {
                        outer: usize::from(first),
                        outer_opts: o1,
                        inner_opts: o2,
                    },
                    (Wraps::Fill, 1) => Wrap::Fill {
                        enc: 0,
                        inner: if inner == 3 { 3 } else { 0 },
                        opts: o1,
                    },
                    (Wraps::Fill, _) => Wrap::Fill {
                        enc: usize::from(first),
                        inner,
                        opts: o1,
                    },
                };
                Case {
                    mbs: microbatches(ranks, max_mbs, mode, raw, k),
                    profile,
                    ranks,
                    body,
                    wrap,
                }
            },
        )
}

// ---------------------------------------------------------------------------
// The checks.

/// Relative slack for comparing sums of floats.
fn slack(x: f64) -> f64 {
    1e-9 * (1.0 + x.abs())
}

fn fail(case: &Case, what: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("{what}\n-- case: {}", case.describe()))
}

/// Needs backward: trainable or fed (transitively) by a trainable unit.
fn needs_backward(units: &[Unit]) -> Vec<bool> {
    let mut need: Vec<bool> = units.iter().map(|u| u.trainable).collect();
    loop {
        let mut changed = false;
        for i in 0..units.len() {
            if !need[i]
                && units[i].inputs.iter().any(|n| {
                    units
                        .iter()
                        .position(|u| &u.name == n)
                        .is_some_and(|p| need[p])
                })
            {
                need[i] = true;
                changed = true;
            }
        }
        if !changed {
            return need;
        }
    }
}

/// Rule 1, counted from scratch: every problem found, in words.
fn coverage_problems(p: &Program) -> Vec<String> {
    // (unit, mb) -> op -> ranks it runs on
    let mut seen: BTreeMap<(&str, usize), BTreeMap<Op, Vec<usize>>> = BTreeMap::new();
    for (r, list) in p.programs.iter().enumerate() {
        for a in list {
            if let ActionRef::Compute(c) = a.view() {
                seen.entry((c.unit, c.mb))
                    .or_default()
                    .entry(c.op)
                    .or_default()
                    .push(r);
            }
        }
    }
    let need = needs_backward(&p.units);
    let mut out = Vec::new();
    let names: Vec<&str> = p.units.iter().map(|u| u.name.as_str()).collect();
    for key in seen.keys() {
        if !names.contains(&key.0) || key.1 >= p.microbatches {
            out.push(format!("compute on unknown ({}, {})", key.0, key.1));
        }
    }
    let empty = BTreeMap::new();
    for (u, unit) in p.units.iter().enumerate() {
        for mb in 0..p.microbatches {
            let ops = seen.get(&(unit.name.as_str(), mb)).unwrap_or(&empty);
            let n = |op: Op| ops.get(&op).map_or(0, Vec::len);
            let at = format!("({}, {mb})", unit.name);
            if n(Op::F) != 1 {
                out.push(format!("{at}: {} F", n(Op::F)));
            }
            let (b, bw, w) = (n(Op::B), n(Op::BW), n(Op::W));
            if need[u] {
                if !((b == 1 && bw == 0) || (b == 0 && bw == 1)) {
                    out.push(format!("{at}: needs backward, has {b} B and {bw} BW"));
                }
                if unit.trainable && b == 1 {
                    if w != 1 {
                        out.push(format!("{at}: trainable with B, has {w} W"));
                    } else if ops[&Op::W] != ops[&Op::B] {
                        out.push(format!(
                            "{at}: W on rank {:?}, B on rank {:?}",
                            ops[&Op::W],
                            ops[&Op::B]
                        ));
                    }
                } else if w != 0 {
                    out.push(format!("{at}: {w} W without a B of a trainable unit"));
                }
            } else if b + bw + w != 0 {
                out.push(format!(
                    "{at}: no backward needed, has {b} B, {bw} BW, {w} W"
                ));
            }
        }
    }
    out
}

fn derive_case(case: &Case, profile: &Profile) -> Result<Derived, Vec<(ErrorKind, String)>> {
    let req = Request::new(profile, case.ranks, case.mbs);
    derive_str(&req, &case.expr())
        .map_err(|es| es.into_iter().map(|e| (e.kind, e.message)).collect())
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let toml = case.toml();
    let profile = Profile::from_toml_str(&toml).map_err(|e| {
        fail(
            case,
            format!("test bug: the generated profile is rejected: {e}"),
        )
    })?;
    let req = Request::new(&profile, case.ranks, case.mbs);
    let d = match derive_case(case, &profile) {
        Err(errors) => {
            if errors.iter().any(|(k, _)| *k != ErrorKind::Microbatches) {
                return Err(fail(
                    case,
                    format!("derivation failed with a kind other than Microbatches: {errors:#?}"),
                ));
            }
            if case.microbatches_ok() {
                return Err(fail(
                    case,
                    format!("the body accepts these micro-batches, yet: {errors:#?}"),
                ));
            }
            return Ok(());
        }
        Ok(d) => d,
    };
    if !case.microbatches_ok() {
        return Err(fail(
            case,
            "derived, although the body documents that it needs other micro-batch counts",
        ));
    }
    let p = &d.program;

    // Independent verification.
    let violations = verify(p);
    if !violations.is_empty() {
        let list: Vec<String> = violations.iter().map(ToString::to_string).collect();
        return Err(fail(
            case,
            format!("verify rejects the derived program:\n{}", list.join("\n")),
        ));
    }

    // Shape and unit names.
    if p.ranks != case.ranks || p.programs.len() != case.ranks || p.microbatches != case.mbs {
        return Err(fail(
            case,
            format!(
                "program shape: ranks {} with {} lists, microbatches {}",
                p.ranks,
                p.programs.len(),
                p.microbatches
            ),
        ));
    }
    let stages = case.ranks * case.chunks();
    // Each encoder is one unit, or its layers (`vision/0`, ...) when `fill` or
    // `prefetch` placed it layer by layer.
    let mut expected: Vec<String> = Vec::new();
    let mut encoder_units: Vec<std::ops::Range<usize>> = Vec::new();
    for (name, e) in ENCODER_NAMES.iter().zip(&profile.encoders) {
        let at = expected.len();
        let cut = p
            .units
            .get(at)
            .is_some_and(|u| u.name == format!("{name}/0"));
        if cut {
            expected.extend((0..e.layers).map(|j| format!("{name}/{j}")));
        } else {
            expected.push(name.to_string());
        }
        encoder_units.push(at..expected.len());
    }
    let encoder_count = expected.len();
    expected.extend((0..stages).map(|k| format!("llm.{k}")));
    let names: Vec<String> = p.units.iter().map(|u| u.name.clone()).collect();
    if names != expected {
        return Err(fail(
            case,
            format!("unit names {names:?}, expected {expected:?}"),
        ));
    }
    // The units' costs add up to the profile's.
    let llm = &profile.llm;
    let layers = f64::from(llm.layers);
    let extra = |f: fn(&mpipe_core::profile::Extra) -> f64| {
        llm.first_stage_extra.as_ref().map_or(0.0, f) + llm.last_stage_extra.as_ref().map_or(0.0, f)
    };
    let llm_units = &p.units[encoder_count..];
    let sum = |f: fn(&Unit) -> f64| llm_units.iter().map(f).sum::<f64>();
    for (what, got, want) in [
        (
            "F",
            sum(|u| u.cost.f),
            layers * llm.forward + extra(|x| x.forward),
        ),
        (
            "B",
            sum(|u| u.cost.b),
            layers * llm.backward + extra(|x| x.backward),
        ),
        (
            "W",
            sum(|u| u.cost.w),
            layers * llm.weight + extra(|x| x.weight),
        ),
    ] {
        if (got - want).abs() > 1e-6 * (1.0 + want) {
            return Err(fail(
                case,
                format!("LLM stages' {what} costs sum to {got}, the profile's to {want}"),
            ));
        }
    }
    for (range, e) in encoder_units.iter().zip(&profile.encoders) {
        let l = f64::from(e.layers);
        let units = &p.units[range.clone()];
        let (f, b): (f64, f64) = (
            units.iter().map(|u| u.cost.f).sum(),
            units.iter().map(|u| u.cost.b).sum(),
        );
        if units.iter().any(|u| u.trainable != e.trainable)
            || (f - l * e.forward).abs() > 1e-9 * (1.0 + f)
            || (b - l * e.backward).abs() > 1e-9 * (1.0 + b)
        {
            return Err(fail(
                case,
                format!("encoder units {units:?} do not match {e:?}"),
            ));
        }
    }

    // Rule 1, counted here.
    let problems = coverage_problems(p);
    if !problems.is_empty() {
        return Err(fail(
            case,
            format!("coverage counts are wrong:\n{}", problems.join("\n")),
        ));
    }

    // Simulation under both semantics.
    let rendezvous = simulate(p, &req.sim_options(Mode::Rendezvous))
        .map_err(|e| fail(case, format!("rendezvous simulation fails: {e}")))?;
    let eager = simulate(p, &req.sim_options(Mode::Eager))
        .map_err(|e| fail(case, format!("eager simulation fails: {e}")))?;
    if rendezvous.makespan != d.report.makespan {
        return Err(fail(
            case,
            format!(
                "derivation reported makespan {}, rendezvous simulation gives {}",
                d.report.makespan, rendezvous.makespan
            ),
        ));
    }
    let bound = d.bound.value();
    if rendezvous.makespan < bound - slack(bound) {
        return Err(fail(
            case,
            format!(
                "makespan {} is below the lower bound {bound} ({:?})",
                rendezvous.makespan, d.bound
            ),
        ));
    }
    // Under eager semantics transfers hold no rank, and the bound does not count
    // them: the eager step is read against its own bound.
    let eager_bound = bound_for(&profile, p, &req.sim_options(Mode::Eager));
    if eager_bound.value() > bound + slack(bound) {
        return Err(fail(
            case,
            format!(
                "the eager bound {eager_bound:?} is above the rendezvous one {:?}",
                d.bound
            ),
        ));
    }
    if eager.makespan < eager_bound.value() - slack(eager_bound.value()) {
        return Err(fail(
            case,
            format!(
                "eager makespan {} is below the lower bound {eager_bound:?}",
                eager.makespan
            ),
        ));
    }
    if eager.makespan > rendezvous.makespan + slack(rendezvous.makespan) {
        return Err(fail(
            case,
            format!(
                "eager makespan {} exceeds rendezvous makespan {}",
                eager.makespan, rendezvous.makespan
            ),
        ));
    }
    // Each rank's idle time, split into warm-up, steady and cool-down, adds up to
    // the step less its compute, with no part negative.
    for (r, idle) in rendezvous
        .timeline
        .idle(p, rendezvous.makespan)
        .iter()
        .enumerate()
    {
        let expect = rendezvous.makespan - rendezvous.compute[r];
        let parts = [idle.warm_up, idle.steady, idle.cool_down];
        if parts.iter().any(|&x| x < 0.0) || (idle.total() - expect).abs() > slack(expect) * 10.0 {
            return Err(fail(
                case,
                format!("rank {r}: idle {idle:?} does not add up to {expect}"),
            ));
        }
    }
    // The same idle time by cause: waiting for partners (never oneself), in
    // transfers, and done early, again adding up with no part negative.
    let waits = mpipe_core::waits::waits(p, &rendezvous.timeline, rendezvous.makespan);
    for (r, w) in waits.iter().enumerate() {
        let expect = rendezvous.makespan - rendezvous.compute[r];
        let total = w.waiting() + w.transfer + w.done_early;
        let negative =
            w.by_peer.values().any(|&x| x < 0.0) || w.transfer < 0.0 || w.done_early < 0.0;
        if negative || w.by_peer.contains_key(&r) || (total - expect).abs() > slack(expect) * 10.0 {
            return Err(fail(
                case,
                format!("rank {r}: waits {w:?} do not add up to {expect}"),
            ));
        }
    }

    // Determinism.
    let again = derive_case(case, &profile)
        .map_err(|e| fail(case, format!("second derivation fails: {e:#?}")))?;
    if again.program.to_json() != p.to_json() {
        return Err(fail(case, "deriving twice gives different programs"));
    }
    if again.report.makespan != d.report.makespan || again.bound != d.bound {
        return Err(fail(case, "deriving twice gives different figures"));
    }
    Ok(())
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        // Failures are reported with the whole case; keep the tests directory to the
        // two files this suite owns.
        failure_persistence: None,
        ..ProptestConfig::with_cases(cases)
    }
}

// ---------------------------------------------------------------------------
// The properties.

proptest! {
    #![proptest_config(config(128))]

    /// Every body on its own, encoders inline (0-2 of them).
    #[test]
    fn bodies_derive_valid_programs(case in case(0..=2, Wraps::None, 16, 64)) {
        check(&case)?;
    }

    /// `transpose` of one encoder (of one or two) around every body, every option.
    #[test]
    fn transpose_derives_valid_programs(case in case(1..=2, Wraps::Single, 16, 64)) {
        check(&case)?;
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// `transpose(a, transpose(b, BODY))` for two encoders, every option on both.
    #[test]
    fn nested_transpose_derives_valid_programs(case in case(2..=2, Wraps::Nested, 16, 64)) {
        check(&case)?;
    }

    /// `fill` around every body, alone and composed with `transpose` and `fill`.
    #[test]
    fn fill_derives_valid_programs(case in case(1..=2, Wraps::Fill, 16, 64)) {
        check(&case)?;
    }
}

proptest! {
    #![proptest_config(config(12))]

    /// Small sizes, exhaustively over the expressions: every body x every operator
    /// stack (none; `transpose` of each encoder with all 9 option spellings; both
    /// nestings with the 4 distinct option pairs on each level; `fill` of each
    /// encoder alone, over and under `transpose`, and nested).
    #[test]
    fn every_expression_on_small_pipelines(
        base in case(2..=2, Wraps::None, 6, 24),
    ) {
        let mut wraps = vec![Wrap::None];
        for enc in 0..2 {
            for opts in TOpts::all() {
                wraps.push(Wrap::Single { enc, opts });
            }
        }
        let distinct: Vec<TOpts> = TOpts::all()
            .into_iter()
            .filter(|o| o.owners != 1 && o.backward != 1)
            .collect();
        for outer in 0..2 {
            for &outer_opts in &distinct {
                for &inner_opts in &distinct {
                    wraps.push(Wrap::Nested { outer, outer_opts, inner_opts });
                }
            }
        }
        for enc in 0..2 {
            for inner in 0..5 {
                wraps.push(Wrap::Fill { enc, inner, opts: TOpts { owners: 2, backward: 2 } });
            }
        }
        for body in 0..BODIES.len() {
            for &wrap in &wraps {
                let case = Case { body, wrap, ..base.clone() };
                check(&case)?;
            }
        }
    }
}
