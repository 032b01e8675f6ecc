//! Calibration: the costs a run really had, measured from its timeline, and the
//! profile and program those measurements imply.
//!
//! A profile estimated from FLOPs is a guess; the first short run on the real
//! machine tells the truth. [`measure`] reads a [`Timeline`] of a program as it ran
//! (the runtime's, or any tool's trace read with
//! [`crate::render::timeline_from_trace`]) and returns, per unit and compute
//! operation, the mean (and median and range) of its measured durations, and a
//! least-squares fit of the link model (`latency + bytes / bandwidth`) to the transfers' and collectives' own
//! durations. [`Calibration::apply`] puts the measured costs into the program, so
//! [`crate::judge::simulate::simulate`] predicts the run with them; [`Calibration::scale_profile`]
//! scales the profile's per-layer costs by the measured-to-profile ratio of each
//! family of units (the LLM's layers, its first and last stage's extras, each
//! encoder) and replaces its link, so a schedule can be searched again on
//! measured numbers.
//!
//! What a timeline shows, and so what is measured:
//! - a compute action's slot is its duration: `F` and `RF` measure `F`, `B` and `W`
//!   themselves; a fused `BW` measures `B + W` only, and the split keeps the
//!   program's `B : W` proportion;
//! - a point-to-point operation (a single `SEND`/`RECV` or a batch) runs from the
//!   moment its rank reached it to its completion. Under rendezvous its own time is
//!   the completion minus the latest moment any of its transfers' two ends was
//!   reached (docs/spec/program-format.md: "completes at the latest of those times" plus the
//!   transfer); under eager semantics only a lone `RECV` that waited shows its
//!   transfer, from its `SEND`'s reach to its completion. Each such operation whose
//!   members all have one size is a sample of `(bytes, time)` (a batch of several
//!   sizes completes with whichever member ends last, which the timeline does not
//!   tell, so it is left out);
//! - a collective's own time is the earliest completion over its group minus the
//!   latest arrival, with the unit's `params` as its size.
//!
//! The link fit is ordinary least squares when the samples have at least two sizes,
//! clamped so latency is at least 0 and bandwidth at most [`MAX_BANDWIDTH`]; with one
//! size, latency and bandwidth cannot be told apart: the mean time per transfer is
//! kept whole, as latency plus the prior's bandwidth term when a prior is given (the
//! latency at least 0), else as latency alone (bandwidth [`MAX_BANDWIDTH`]). Means,
//! not medians, because a step sums durations. Transfers that took no measurable time give no link.
//!
//! Invariants: pure and deterministic (ordered maps); a timeline the simulator
//! produced for a program is measured back exactly (every compute cost, and the
//! link when the samples have two sizes or one size and the prior bandwidth), so
//! the calibrated program simulates to the same makespan; a timeline that does not
//! belong to the program is a typed error, never a panic.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::algebra::profile::{Extra, Profile};
use crate::ir::compare::close;
use crate::ir::program::{ActionRef, CollKind, Cost, Dir, Op, Program, Tensor};
use crate::judge::simulate::{CommModel, Mode};
use crate::judge::timeline::{Slot, Timeline};

/// The largest bandwidth a fit reports (the profile's range for figures): a link
/// whose transfers do not grow with their size is modelled as latency only.
pub const MAX_BANDWIDTH: f64 = 1e9;

/// Durations below this, relative to the step, count as "took no time".
const NEGLIGIBLE: f64 = 1e-9;

/// Why a timeline cannot be measured against a program.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrateError {
    #[error(
        "the timeline has {timeline} ranks but the program has {program}; measure the \
         trace of this program's run"
    )]
    Ranks { timeline: usize, program: usize },
    #[error(
        "rank {rank}: the timeline has {timeline} actions but the program has {program}; \
         measure the trace of this program's run"
    )]
    Actions {
        rank: usize,
        timeline: usize,
        program: usize,
    },
    #[error(
        "rank {rank}, action {index}: its interval [{start}, {end}] is not a finite, \
         forward interval; the timeline is corrupt"
    )]
    BadSlot {
        rank: usize,
        index: usize,
        start: f64,
        end: f64,
    },
    #[error(
        "the program has no compute action to measure; calibrate with the trace of a \
         program that computes"
    )]
    Empty,
    #[error(
        "rank {rank}, action {index}: a rank or micro-batch number over {}; no program \
         mpipe derives or accepts has one: measure the trace of a program within its \
         limits",
        u32::MAX
    )]
    OutOfRange { rank: usize, index: usize },
}

/// Summary of the measured durations of one unit's operation.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Stat {
    /// The mean: what [`Calibration::cost`] uses (a step sums durations, so the
    /// mean, not the median, predicts it).
    pub mean: f64,
    /// The median (the mean of the two middle samples when their count is even).
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: usize,
}

impl Stat {
    fn of(mut xs: Vec<f64>) -> Option<Stat> {
        if xs.is_empty() {
            return None;
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len();
        let median = if n % 2 == 1 {
            xs[n / 2]
        } else {
            (xs[n / 2 - 1] + xs[n / 2]) / 2.0
        };
        let mean = xs.iter().sum::<f64>() / n as f64;
        Some(Stat {
            mean,
            median,
            min: xs[0],
            max: xs[n - 1],
            samples: n,
        })
    }
}

/// What was measured of one unit (`None`: the run had no such action).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct UnitMeasure {
    /// `F` and `RF`.
    pub f: Option<Stat>,
    pub b: Option<Stat>,
    pub w: Option<Stat>,
    /// Fused `BW` (measures `B + W`).
    pub bw: Option<Stat>,
}

/// The link model fitted to the communication's own durations.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LinkFit {
    pub latency: f64,
    pub bandwidth: f64,
    /// Operations measured.
    pub samples: usize,
    /// Distinct sizes among them (with one, latency and bandwidth are not separable).
    pub sizes: usize,
    /// Root mean square of the fit's residuals.
    pub rms: f64,
}

impl LinkFit {
    pub fn model(&self) -> CommModel {
        CommModel {
            latency: self.latency,
            bandwidth: self.bandwidth,
        }
    }
}

/// A run's measured costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// Per unit name, in name order.
    pub units: BTreeMap<String, UnitMeasure>,
    /// `None` when no transfer or collective took measurable time.
    pub link: Option<LinkFit>,
    /// The measured step: latest end minus earliest start over all actions.
    pub step: f64,
    /// Per rank: its compute time and when it finished, from the step's start.
    pub ranks: Vec<RankMeasure>,
}

/// One rank's measured step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RankMeasure {
    /// Time spent in compute actions.
    pub compute: f64,
    /// End of its last action, from the step's first start (0 for an empty list).
    pub end: f64,
}

/// Measure `timeline`, a run of `program` under `mode`. `prior` is a link model to
/// keep the bandwidth of when the transfers have only one size (see the module doc).
pub fn measure(
    program: &Program,
    timeline: &Timeline,
    mode: Mode,
    prior: Option<CommModel>,
) -> Result<Calibration, CalibrateError> {
    check(program, timeline)?;
    let mut samples: BTreeMap<(&str, Op), Vec<f64>> = BTreeMap::new();
    let mut first = f64::INFINITY;
    let mut last = f64::NEG_INFINITY;
    for (list, slots) in program.programs.iter().zip(&timeline.ranks) {
        for (a, s) in list.iter().zip(slots) {
            first = first.min(s.start);
            last = last.max(s.end);
            if let ActionRef::Compute(c) = a.view() {
                let op = if c.op == Op::RF { Op::F } else { c.op };
                samples
                    .entry((c.unit, op))
                    .or_default()
                    .push(s.end - s.start);
            }
        }
    }
    if samples.is_empty() {
        return Err(CalibrateError::Empty);
    }
    let mut units: BTreeMap<String, UnitMeasure> = BTreeMap::new();
    for ((unit, op), xs) in samples {
        let m = units.entry(unit.to_string()).or_default();
        let stat = Stat::of(xs);
        match op {
            Op::F | Op::RF => m.f = stat,
            Op::B => m.b = stat,
            Op::W => m.w = stat,
            Op::BW => m.bw = stat,
        }
    }
    let step = (last - first).max(0.0);
    let ranks = program
        .programs
        .iter()
        .zip(&timeline.ranks)
        .map(|(list, slots)| RankMeasure {
            compute: list
                .iter()
                .zip(slots)
                .filter(|(a, _)| matches!(a.view(), ActionRef::Compute(_)))
                .map(|(_, s)| s.end - s.start)
                .sum(),
            end: slots.iter().map(|s| s.end - first).fold(0.0, f64::max),
        })
        .collect();
    let points = comm_samples(program, timeline, mode)?;
    let link = fit_link(&points, step, prior);
    Ok(Calibration {
        units,
        link,
        step,
        ranks,
    })
}

fn check(program: &Program, timeline: &Timeline) -> Result<(), CalibrateError> {
    if timeline.ranks.len() != program.programs.len() {
        return Err(CalibrateError::Ranks {
            timeline: timeline.ranks.len(),
            program: program.programs.len(),
        });
    }
    for (rank, (list, slots)) in program.programs.iter().zip(&timeline.ranks).enumerate() {
        if list.len() != slots.len() {
            return Err(CalibrateError::Actions {
                rank,
                timeline: slots.len(),
                program: list.len(),
            });
        }
        for (index, s) in slots.iter().enumerate() {
            if !(s.start.is_finite() && s.end.is_finite() && s.end >= s.start) {
                return Err(CalibrateError::BadSlot {
                    rank,
                    index,
                    start: s.start,
                    end: s.end,
                });
            }
        }
    }
    Ok(())
}

/// One end of a point-to-point transfer, in 24 bytes: the transfer (the
/// `occurrence`-th of its tensor, unit, micro-batch, sender and receiver: the k-th
/// `SEND` of such a transfer pairs with its k-th `RECV`) and which end. Units are
/// numbered ([`Units`]). Each end arises on one rank (a `SEND`'s sender, a `RECV`'s
/// receiver), once, so ends are unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct End {
    unit: u32,
    mb: u32,
    from: u32,
    to: u32,
    occurrence: u32,
    tensor: Tensor,
    dir: Dir,
}

impl End {
    fn partner(self) -> End {
        End {
            dir: self.dir.facing(),
            ..self
        }
    }
}

/// The program's unit names, numbered (a name not among the program's units gets a
/// number of its own and size 0), with each unit's `bytes` and `params`.
struct Units<'p> {
    ids: HashMap<&'p str, u32>,
    /// `(bytes, params)` by number.
    sizes: Vec<(f64, f64)>,
}

impl<'p> Units<'p> {
    fn new(program: &'p Program) -> Units<'p> {
        let mut units = Units {
            ids: HashMap::with_capacity(program.units.len()),
            sizes: Vec::with_capacity(program.units.len()),
        };
        for u in &program.units {
            // The first of two units of one name, as `Program::unit_index`.
            if !units.ids.contains_key(u.name.as_str()) {
                let id = units.sizes.len() as u32;
                units.ids.insert(&u.name, id);
                units.sizes.push((u.bytes, u.params));
            }
        }
        units
    }

    fn id(&mut self, name: &'p str) -> u32 {
        let next = self.sizes.len() as u32;
        let id = *self.ids.entry(name).or_insert(next);
        if id == next {
            self.sizes.push((0.0, 0.0));
        }
        id
    }
}

/// Walks rank `rank`'s point-to-point operations (a lone `SEND`/`RECV`, or the run
/// of consecutive ones of one batch), calling `op` with each one's slot (its first
/// action's) and members `(end, bytes, reached)` (`reached`: its own action's
/// start), in program order; and `coll` with each collective and its slot.
fn walk_ops<'p>(
    rank: usize,
    list: &'p [crate::ir::program::Action],
    slots: &[Slot],
    units: &mut Units<'p>,
    mut op: impl FnMut(Slot, &[(End, f64, f64)]),
    mut coll: impl FnMut(crate::ir::program::CollRef<'p>, Slot),
) -> Result<(), CalibrateError> {
    // (tensor, unit, mb, from, to, dir) -> transfers of it seen so far on this rank.
    let mut seen: HashMap<(Tensor, u32, u32, u32, u32, Dir), u32> = HashMap::new();
    let mut open: Option<(Option<u64>, Slot)> = None;
    let mut members: Vec<(End, f64, f64)> = Vec::new();
    let number = |x: usize, index: usize| {
        u32::try_from(x).map_err(|_| CalibrateError::OutOfRange { rank, index })
    };
    let me = number(rank, 0)?;
    for (index, (a, s)) in list.iter().zip(slots).enumerate() {
        match a.view() {
            ActionRef::P2p(x) => {
                let peer = number(x.peer, index)?;
                let (from, to) = x.dir.ends(me, peer);
                let unit = units.id(x.unit);
                let mb = number(x.mb, index)?;
                let n = seen
                    .entry((x.tensor, unit, mb, from, to, x.dir))
                    .or_insert(0);
                let end = End {
                    unit,
                    mb,
                    from,
                    to,
                    occurrence: *n,
                    tensor: x.tensor,
                    dir: x.dir,
                };
                *n += 1;
                let bytes = units.sizes[unit as usize].0;
                match &open {
                    Some((b, _)) if x.batch.is_some() && *b == x.batch => {}
                    _ => {
                        if let Some((_, slot)) = open.take() {
                            op(slot, &members);
                            members.clear();
                        }
                        open = Some((x.batch, *s));
                    }
                }
                members.push((end, bytes, s.start));
            }
            other => {
                if let Some((_, slot)) = open.take() {
                    op(slot, &members);
                    members.clear();
                }
                if let ActionRef::Coll(c) = other {
                    coll(c, *s);
                }
            }
        }
    }
    if let Some((_, slot)) = open.take() {
        op(slot, &members);
    }
    Ok(())
}

/// `(time, bytes)` samples of the communication's own durations, in program order
/// (rank by rank), then the collectives'.
///
/// Two passes over the program, so that no operation is kept: the first notes when
/// each transfer end was reached (24 bytes of key and its time, in one sorted
/// vector), the second walks the operations again and measures each against its
/// partners' ends. (Before, every operation and end was kept in ordered maps: about
/// 360 MB at 8 x 65536.)
fn comm_samples(
    program: &Program,
    timeline: &Timeline,
    mode: Mode,
) -> Result<Vec<(f64, f64)>, CalibrateError> {
    let mut units = Units::new(program);
    let rank_lists = || program.programs.iter().zip(&timeline.ranks).enumerate();
    // Each transfer end's reach time (sorted by end below), and the operations.
    let ends = program
        .programs
        .iter()
        .flatten()
        .filter(|a| matches!(a.view(), ActionRef::P2p(_)))
        .count();
    let mut reach: Vec<(End, f64)> = Vec::with_capacity(ends);
    let mut ops = 0usize;
    // Collectives: identity and occurrence -> (latest reach, earliest end, members seen).
    type CollKey<'p> = (CollKind, &'p str, usize, Vec<usize>, usize);
    let mut colls: BTreeMap<CollKey, (f64, f64, usize)> = BTreeMap::new();
    for (rank, (list, slots)) in rank_lists() {
        let mut coll_seen: BTreeMap<(CollKind, &str, usize, Vec<usize>), usize> = BTreeMap::new();
        walk_ops(
            rank,
            list,
            slots,
            &mut units,
            |_, members| {
                ops += 1;
                reach.extend(members.iter().map(|&(end, _, reached)| (end, reached)));
            },
            |c, s| {
                let mut group = c.group.to_vec();
                group.sort_unstable();
                group.dedup();
                let id = (c.kind, c.unit, c.root, group);
                let n = coll_seen.entry(id.clone()).or_insert(0);
                let key = (id.0, id.1, id.2, id.3, *n);
                *n += 1;
                let e = colls
                    .entry(key)
                    .or_insert((f64::NEG_INFINITY, f64::INFINITY, 0));
                e.0 = e.0.max(s.start);
                e.1 = e.1.min(s.end);
                e.2 += 1;
            },
        )?;
    }
    // Ends are unique (see `End`): the order is total.
    reach.sort_unstable_by_key(|&(end, _)| end);
    let partner = |end: End| {
        let key = end.partner();
        reach
            .binary_search_by(|(e, _)| e.cmp(&key))
            .ok()
            .map(|i| reach[i].1)
    };
    let mut points = Vec::with_capacity(ops + colls.len());
    for (rank, (list, slots)) in rank_lists() {
        walk_ops(
            rank,
            list,
            slots,
            &mut units,
            |slot, members| {
                let bytes = members.iter().map(|m| m.1).fold(0.0, f64::max);
                if members.iter().any(|m| m.1 != bytes) {
                    // Members of different sizes: which one finished last is not known.
                    return;
                }
                match mode {
                    Mode::Rendezvous => {
                        let mut meet = slot.start;
                        for &(end, ..) in members {
                            match partner(end) {
                                Some(t) => meet = meet.max(t),
                                None => meet = f64::INFINITY,
                            }
                        }
                        if meet.is_finite() && slot.end >= meet {
                            points.push((slot.end - meet, bytes));
                        }
                    }
                    Mode::Eager => {
                        if let [(end, ..)] = members {
                            if end.dir == Dir::Recv && slot.end > slot.start {
                                if let Some(sent) = partner(*end) {
                                    if slot.end >= sent {
                                        points.push((slot.end - sent, bytes));
                                    }
                                }
                            }
                        }
                    }
                }
            },
            |_, _| {},
        )?;
    }
    let params_of = |u: &str| {
        program
            .unit_index(u)
            .map_or(0.0, |i| program.units[i].params)
    };
    for ((_, unit, _, group, _), (latest, earliest, n)) in &colls {
        if *n == group.len() && earliest >= latest {
            points.push((earliest - latest, params_of(unit)));
        }
    }
    Ok(points)
}

/// Least squares of `time = latency + bytes / bandwidth` (see the module doc).
fn fit_link(points: &[(f64, f64)], step: f64, prior: Option<CommModel>) -> Option<LinkFit> {
    let tiny = NEGLIGIBLE * step.max(f64::MIN_POSITIVE);
    if points.is_empty() || points.iter().all(|p| p.0 <= tiny) {
        return None;
    }
    let n = points.len() as f64;
    let mut sizes: Vec<f64> = points.iter().map(|p| p.1).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup_by(|a, b| close(*a, *b));
    let (latency, per_byte) = if sizes.len() >= 2 {
        let mx = points.iter().map(|p| p.1).sum::<f64>() / n;
        let my = points.iter().map(|p| p.0).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.1 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.1 - mx) * (p.0 - my)).sum();
        let slope = (sxy / sxx).max(0.0);
        let icpt = my - slope * mx;
        if icpt >= 0.0 {
            (icpt, slope)
        } else {
            // Through the origin: no latency.
            let sxx0: f64 = points.iter().map(|p| p.1 * p.1).sum();
            let sxy0: f64 = points.iter().map(|p| p.1 * p.0).sum();
            (0.0, (sxy0 / sxx0).max(0.0))
        }
    } else {
        let each = points.iter().map(|p| p.0).sum::<f64>() / n;
        let size = sizes[0];
        match prior {
            Some(c) if c.bandwidth > 0.0 => {
                ((each - size / c.bandwidth).max(0.0), 1.0 / c.bandwidth)
            }
            _ => (each, 0.0),
        }
    };
    let bandwidth = if per_byte > 1.0 / MAX_BANDWIDTH {
        1.0 / per_byte
    } else {
        MAX_BANDWIDTH
    };
    // Twelve significant digits: a fit is not more exact than that, and a profile
    // written from it should read `0.5`, not `0.49999999999999994`.
    let (latency, bandwidth) = (significant(latency), significant(bandwidth));
    let model = CommModel { latency, bandwidth };
    let rms = (points
        .iter()
        .map(|p| (p.0 - model.transfer_time(p.1)).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    Some(LinkFit {
        latency,
        bandwidth,
        samples: points.len(),
        sizes: sizes.len(),
        rms,
    })
}

/// `x` rounded to twelve significant digits.
fn significant(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(11 - x.abs().log10().floor() as i32);
    if scale.is_finite() && (x * scale).is_finite() {
        (x * scale).round() / scale
    } else {
        x
    }
}

/// A family of units that one group of profile figures prices.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Family {
    /// The LLM's layers (stages `llm.k`, layer units `llm/N`, the whole `llm`).
    Llm,
    /// `llm/first_stage_extra` (the embedding, as its own unit).
    FirstExtra,
    /// `llm/last_stage_extra` (the LM head and loss, as its own unit).
    LastExtra,
    /// An encoder, its chunks (`ENC.k`) and its layers (`ENC/N`).
    Encoder(String),
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Family::Llm => f.write_str("llm layers"),
            Family::FirstExtra => f.write_str("llm first_stage_extra"),
            Family::LastExtra => f.write_str("llm last_stage_extra"),
            Family::Encoder(e) => write!(f, "encoder {e}"),
        }
    }
}

/// The family of a unit name, `None` for a name no profile figure prices.
pub fn family(unit: &str) -> Option<Family> {
    match unit {
        "llm/first_stage_extra" => return Some(Family::FirstExtra),
        "llm/last_stage_extra" => return Some(Family::LastExtra),
        _ => {}
    }
    let base = unit.split(['/', '.']).next().unwrap_or(unit);
    if base.is_empty() {
        None
    } else if base == "llm" {
        Some(Family::Llm)
    } else {
        Some(Family::Encoder(base.to_string()))
    }
}

/// Measured-to-program ratios of one family's `F`, `B` and `W` (`None`: not measured).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Scale {
    pub f: Option<f64>,
    pub b: Option<f64>,
    pub w: Option<f64>,
}

impl Calibration {
    /// `unit`'s measured costs: the means, the program's where an op was not
    /// measured, and a fused `BW` split in the program's `B : W` proportion.
    pub fn cost(&self, name: &str, old: &Cost) -> Cost {
        let Some(m) = self.units.get(name) else {
            return *old;
        };
        let f = m.f.map_or(old.f, |s| s.mean);
        let (b, w) = match (m.b, m.w, m.bw) {
            (Some(b), Some(w), _) => (b.mean, w.mean),
            (Some(b), None, Some(bw)) => (b.mean, (bw.mean - b.mean).max(0.0)),
            (None, Some(w), Some(bw)) => ((bw.mean - w.mean).max(0.0), w.mean),
            (None, None, Some(bw)) => {
                let sum = old.b + old.w;
                let share = if sum > 0.0 { old.b / sum } else { 0.5 };
                (bw.mean * share, bw.mean * (1.0 - share))
            }
            (b, w, None) => (b.map_or(old.b, |s| s.mean), w.map_or(old.w, |s| s.mean)),
        };
        Cost { f, b, w }
    }

    /// `program` with every measured unit's costs replaced ([`Calibration::cost`]).
    pub fn apply(&self, program: &Program) -> Program {
        let mut out = program.clone();
        for u in &mut out.units {
            u.cost = self.cost(&u.name, &u.cost);
        }
        out
    }

    /// Per family, the measured costs of its measured units over the program's
    /// costs of the same units, op by op.
    pub fn scales(&self, program: &Program) -> BTreeMap<Family, Scale> {
        let mut sums: BTreeMap<Family, [(f64, f64); 3]> = BTreeMap::new();
        for u in &program.units {
            let (Some(m), Some(fam)) = (self.units.get(&u.name), family(&u.name)) else {
                continue;
            };
            let new = self.cost(&u.name, &u.cost);
            let s = sums.entry(fam).or_default();
            let measured_b = m.b.is_some() || m.bw.is_some();
            let measured_w = m.w.is_some() || m.bw.is_some();
            for (k, (yes, new, old)) in [
                (m.f.is_some(), new.f, u.cost.f),
                (measured_b, new.b, u.cost.b),
                (measured_w, new.w, u.cost.w),
            ]
            .into_iter()
            .enumerate()
            {
                if yes {
                    s[k].0 += new;
                    s[k].1 += old;
                }
            }
        }
        sums.into_iter()
            .map(|(fam, s)| {
                let r = |(new, old): (f64, f64)| (old > 0.0).then(|| new / old);
                (
                    fam,
                    Scale {
                        f: r(s[0]),
                        b: r(s[1]),
                        w: r(s[2]),
                    },
                )
            })
            .collect()
    }

    /// `profile` with its costs scaled by [`Calibration::scales`] of `program` (a
    /// program derived from it) and its link replaced by the fit. The extras scale
    /// by their own family when it was measured as its own unit, else by the LLM's.
    /// Scaled figures are rounded to twelve significant digits.
    pub fn scale_profile(&self, program: &Program, profile: &Profile) -> Profile {
        let scales = self.scales(program);
        let mut out = profile.clone();
        let llm = scales.get(&Family::Llm).copied().unwrap_or_default();
        let by = |x: &mut f64, s: Option<f64>| {
            if let Some(s) = s {
                *x = significant(*x * s);
            }
        };
        by(&mut out.llm.forward, llm.f);
        by(&mut out.llm.backward, llm.b);
        by(&mut out.llm.weight, llm.w);
        let extra = |e: &mut Option<Extra>, fam: Family| {
            if let Some(e) = e {
                let s = scales.get(&fam).copied().unwrap_or(llm);
                by(&mut e.forward, s.f);
                by(&mut e.backward, s.b);
                by(&mut e.weight, s.w);
            }
        };
        extra(&mut out.llm.first_stage_extra, Family::FirstExtra);
        extra(&mut out.llm.last_stage_extra, Family::LastExtra);
        for e in &mut out.encoders {
            if let Some(s) = scales.get(&Family::Encoder(e.name.clone())) {
                by(&mut e.forward, s.f);
                by(&mut e.backward, s.b);
                if let Some(w) = &mut e.weight {
                    by(w, s.w);
                }
            }
        }
        if let Some(l) = &self.link {
            out.link = Some(crate::algebra::profile::LinkProfile {
                latency: l.latency,
                bandwidth: l.bandwidth,
            });
        }
        out
    }
}
