//! Periodic transfer placement: where a rank's compute order is periodic (its steady
//! state repeats a group of tasks with every micro-batch advanced by one constant), the
//! transfers in that stretch are placed as they are in one period of it, in every
//! period.
//!
//! The lowering places each transfer by timing (the plan's ideal timeline, or a
//! simulated one). Where ranks run at different rates in that timeline (a rank with
//! the encoder is slower than its neighbour), the meeting points slide one task
//! along a rank's list every few micro-batches, and the program repeats only every
//! tens of micro-batches, or never: its code, re-rolled into loops
//! (`mpipe_core::rolled`), grows with the micro-batch count. Under rendezvous the
//! steady state runs at the pace of the slowest rank anyway, so one period's
//! placement, repeated, is often as fast; [`periodic`] builds that program and the
//! caller (`search::place`) keeps it only where it verifies and simulates no slower
//! and no higher in memory.
//!
//! # How
//!
//! Per rank, the compute tasks as the sequence `x[k] = (op, unit, mb[k] - mb[k-1])`:
//! a stretch where `x` has period `P` is one where task `k + P` is task `k` with its
//! micro-batch advanced by one constant `D`, and conversely. A stretch is found
//! through evenly spaced tasks of the rank ([`SearchPolicy::periodic_probes`]; a
//! schedule's forward and backward phases are two stretches): the prefix function
//! of `x` from there (linear time, read only as far as the answer) gives the
//! smallest period that holds [`SearchPolicy::periodic_min_periods`] times
//! forward, and the stretch is extended forward and backward with the same period. The transfers posted between the tasks of
//! one full period (the [`Reference`]) form the template; in every full period of
//! the stretch, each transfer the template names (micro-batch advanced by `D` per
//! period) that is posted within the stretch's full periods is moved there, batched
//! as in the template. The others (the warm-up's, the cool-down's, those the
//! template does not name) stay where they were (first in their gap). A stretch is
//! rewritten only where its placement breaks the template in enough of its periods
//! ([`SearchPolicy::periodic_min_break_share`]; checked in place, nothing is built
//! for a regular rank), and a rank only where its code, rolled as code generation
//! rolls it ([`crate::ir::rolled::rank_code_size`]), is no larger. The result is
//! checked by the caller: a move can break a dependency at the stretch's ends, or the
//! order two ranks meet in.

use crate::ir::policy::SearchPolicy;
use crate::ir::program::{Action, ActionRef, Batch, Dir, Op, P2pFields, Program, Tensor};
use crate::ir::rolled::{canonical, rank_code_size, RollOptions};
use crate::judge::simulate::{simulate, Mode, RecentNames, SimOptions, SimReport};
use crate::judge::verify::verify_mode;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

/// `best` with its transfers placed periodically in every rank's steady state
/// ([`periodic`]), the template taken from the period half way through the
/// micro-batches, else the stretch's first, else its last period, else period `c`
/// for each `c` of [`SearchPolicy::periodic_settle_periods`], the periods before it
/// left as they are ([`Reference::After`]) (each rank rewritten
/// only where its rolled code is no larger, see [`periodic`]): the first whose
/// program is more regular ([`more_regular`]: fewer distinct gap contents),
/// verifies, runs no slower (makespan equal or less) and peaks no higher on any
/// rank; else `best`. Its code then rolls to
/// loops of a size independent of the micro-batch count where the plan's compute
/// order is periodic. At most `3 + periodic_settle_periods.len()` verifications
/// and simulations, and one more simulation (of `best` again, for its timeline,
/// not held while ranks are rewritten) where a rank's rewriting changed its list
/// and no candidate wins; none where no rank changes (a regular program costs
/// only one linear scan per stretch, [`Shape::breaks`]; a rank whose rewriting
/// gives its list back costs that rewriting).
/// Rendezvous only. Applied once to a derivation's final program
/// (`search::finish`), not inside the searches, so that it changes no search's
/// course.
pub(crate) fn periodic_if_no_slower(
    best: (Program, SimReport),
    opts: &SimOptions,
    policy: &SearchPolicy,
) -> (Program, SimReport) {
    // Under eager semantics a sender never waits, so the steady state is not paced
    // by the slowest rank and one period's placement is no model of the others.
    if opts.mode != Mode::Rendezvous || policy.periodic_probes < 2 {
        return best;
    }
    // Each rank read once for the strays and all the templates, where no stray
    // moves (the common case); read again after a candidate was checked (a
    // joined program's, or a template's that lost: its shapes are not held while
    // it is verified and simulated).
    let (best, read) = strays_joined_if_no_slower(best, opts, policy);
    let Some(first) = read.or_else(|| shapes_of(&best.0, Vec::new())) else {
        return best;
    };
    let mut shapes = Some(first);
    // The stretches found so far, per rank, while the shapes are not held.
    let mut known = Vec::new();
    let (mut program, mut kept) = best;
    // While a rank is rewritten and a candidate checked and simulated, the kept
    // program's timeline is not held (at 8 x 65536 it is 16 bytes an action beside
    // the rewriting's tables or the candidate's simulation): its makespan and peaks
    // decide, and it is simulated again only if it was dropped and no candidate
    // wins (deterministic: the same report). It is dropped once a rank's
    // rewriting first changes its list ([`periodic`]'s `release`): a program
    // where nothing is rewritten, or every rewriting gives the list back
    // (`transpose(vision, zbv)` at 64 x 1024), keeps it.
    let mut dropped = false;
    // Each rank's rolled code size as the program has it, measured once: every
    // template starts from this very program (a candidate that loses is swapped
    // back), so each weighs its rewritings against the same sizes.
    let mut sizes = vec![None; program.programs.len()];
    let settled = policy
        .periodic_settle_periods
        .iter()
        .map(|&c| Reference::After(c));
    for reference in [Reference::Middle, Reference::First, Reference::Last]
        .into_iter()
        .chain(settled)
    {
        let current = match shapes.take() {
            Some(s) => s,
            None => match shapes_of(&program, std::mem::take(&mut known)) {
                Some(s) => s,
                None => break,
            },
        };
        let mut release = || {
            if !dropped {
                dropped = !std::mem::take(&mut kept.timeline).ranks.is_empty();
            }
        };
        let Some(mut rewritten) = periodic(
            &program,
            &current,
            reference,
            policy,
            (&mut sizes, &mut release),
        ) else {
            // Nothing moves with this template: no rank has a periodic stretch, or
            // its transfers are placed as the template places them already, break
            // it in too few periods, or moving them would make a rank's code
            // larger. Another template may differ (a regular rank costs one linear
            // scan per template).
            shapes = Some(current);
            continue;
        };
        // Checked before simulating: one that merely moves a regular program's
        // transfers elsewhere is no gain.
        if !more_regular(&program, &rewritten) {
            shapes = Some(current);
            continue;
        }
        // The rewritten ranks are swapped in place (and back if the candidate
        // loses): the ranks it keeps are not copied.
        swap_ranks(&mut program, &mut rewritten);
        // The shapes are not needed to judge the candidate: not held while it is
        // verified and simulated (the stretches found are kept, and the shapes
        // read again if it loses).
        known = current
            .into_iter()
            .map(|s| s.stretches.into_inner())
            .collect();
        let accepted = verify_mode(&program, opts.mode)
            .is_empty()
            .then(|| simulate(&program, opts).ok())
            .flatten()
            .filter(|new| {
                let no_slower = new.makespan <= kept.makespan;
                let no_higher = new
                    .peak_memory
                    .iter()
                    .zip(&kept.peak_memory)
                    .all(|(a, b)| a <= b);
                no_slower && no_higher
            });
        if let Some(report) = accepted {
            return (program, report);
        }
        swap_ranks(&mut program, &mut rewritten);
    }
    drop(shapes);
    if dropped {
        if let Ok(report) = simulate(&program, opts) {
            kept.timeline = report.timeline;
        }
    }
    (program, kept)
}

/// `best` with its strays joined to their siblings ([`strays`]) where that leaves
/// the program more regular ([`more_regular`]), and it verifies, runs no slower and
/// peaks no higher on any rank; else `best`. One verification and simulation where
/// a rank has strays, none where none has (one linear scan per rank). With it, the
/// program's ranks as read ([`shapes_of`]) where no rank had a stray (the program
/// is `best`'s, unchanged): the caller's templates read the same.
fn strays_joined_if_no_slower(
    best: (Program, SimReport),
    opts: &SimOptions,
    policy: &SearchPolicy,
) -> ((Program, SimReport), Option<Vec<Shape>>) {
    let Some(shapes) = shapes_of(&best.0, Vec::new()) else {
        return (best, None);
    };
    let Some(mut joined) = strays(&best.0, &shapes, policy) else {
        return (best, Some(shapes));
    };
    drop(shapes);
    let (mut program, kept) = best;
    let regular = more_regular(&program, &joined);
    swap_ranks(&mut program, &mut joined);
    let accepted = regular
        .then(|| verify_mode(&program, opts.mode).is_empty())
        .filter(|&valid| valid)
        .and_then(|_| simulate(&program, opts).ok())
        .filter(|new| {
            new.makespan <= kept.makespan
                && new
                    .peak_memory
                    .iter()
                    .zip(&kept.peak_memory)
                    .all(|(a, b)| a <= b)
        });
    match accepted {
        Some(report) => ((program, report), None),
        None => {
            swap_ranks(&mut program, &mut joined);
            ((program, kept), None)
        }
    }
}

/// The ranks of `p` (each with its new list, batches numbered canonically) with
/// their strays joined to their siblings; `None` if no rank has a stray that can.
///
/// A stray is a transfer posted within a periodic stretch's full periods (found
/// as [`periodic`] finds them, the template from the middle) that the template
/// does not name: its tensor is produced and consumed away from the steady state
/// (an encoder activation computed in an owner's warm-up for a micro-batch the
/// first stage reads late), and the lowering met it where both ranks happened to
/// be idle, one task in some period, which breaks that period for the roller.
/// Its siblings are the transfers of the same kind (direction, tensor, unit) to
/// the same peer; it is moved, on both ranks, to just before the group holding
/// the sibling with the next larger micro-batch, where that sibling is posted
/// earlier on the stray's rank (so it is met in the warm-up with the others of
/// its kind, in the same order on both ranks). The caller verifies and simulates
/// the result.
fn strays(
    p: &Program,
    shapes: &[Shape],
    policy: &SearchPolicy,
) -> Option<Vec<(usize, Vec<Action>)>> {
    let probes = policy.periodic_probes.max(1);
    let min_periods = policy.periodic_min_periods.max(2);
    // The strays found, by rank: (position in the rank's list, key).
    let mut found: Vec<(usize, usize, Key)> = Vec::new();
    for (r, list) in p.programs.iter().enumerate() {
        let shape = &shapes[r];
        let mut done: Vec<(usize, usize)> = Vec::new();
        for probe in 1..probes {
            let at = Probe {
                point: (probe, probes),
                min_periods,
                microbatches: p.microbatches,
            };
            let Some(f) = shape.find(list, &at, &done, Reference::Middle) else {
                continue;
            };
            done.push((f.start, f.end));
            // A period placed as the template ([`Shape::classes`]) holds only
            // transfers it names: only the others are read.
            let differ: Vec<usize> = {
                let classes = shape.classes_of(list, &f);
                let template = classes[f.reference];
                (0..f.periods)
                    .filter(|&q| q != f.reference)
                    .filter(|&q| template == NO_CLASS || classes[q] != template)
                    .collect()
            };
            if differ.is_empty() {
                continue;
            }
            // The template's transfers, per gap of the period, micro-batches as in
            // the reference period.
            let mut named: HashSet<(usize, Key)> = HashSet::default();
            for k in 1..=f.period {
                for g in shape.gap(list, f.gap(f.reference, k)) {
                    named.extend(g.range().filter_map(|a| key(&list[a]).map(|x| (k, x))));
                }
            }
            for q in differ {
                let by = (q as i64 - f.reference as i64) * f.d;
                for k in 1..=f.period {
                    for g in shape.gap(list, f.gap(q, k)) {
                        for a in g.range() {
                            let Some(x) = key(&list[a]) else { continue };
                            let Ok(mb) = usize::try_from(x.3 as i64 - by) else {
                                found.push((r, a, x));
                                continue;
                            };
                            if !named.contains(&(k, (x.0, x.1, x.2, mb, x.4))) {
                                found.push((r, a, x));
                            }
                        }
                    }
                }
            }
        }
    }
    if found.is_empty() {
        return None;
    }
    // Per rank and kind (direction, tensor, unit, peer) of a stray's end: the
    // micro-batches posted and where, in micro-batch order (only the ranks a
    // stray's ends are on, only the strays' kinds). Units are numbered per rank,
    // the strays' first, the others as first seen through the last names looked
    // up ([`RecentNames`]): a transfer of another unit is passed over without
    // hashing or comparing its name.
    type Kind = (Dir, Tensor, u32, usize);
    let mut wanted: Vec<Vec<(Dir, Tensor, &str, usize)>> = vec![Vec::new(); p.programs.len()];
    for &(r, _, (dir, tensor, unit, _, peer)) in &found {
        wanted[r].push((dir, tensor, unit, peer));
        if let Some(w) = wanted.get_mut(peer) {
            w.push((dir.facing(), tensor, unit, r));
        }
    }
    type Kinds<'a> = (HashMap<&'a str, u32>, HashMap<Kind, Vec<(usize, usize)>>);
    let kinds: Vec<Kinds> = p
        .programs
        .iter()
        .zip(&wanted)
        .map(|(list, wanted)| {
            let mut names: HashMap<&str, u32> = HashMap::default();
            let mut m: HashMap<Kind, Vec<(usize, usize)>> = HashMap::default();
            for &(dir, tensor, unit, peer) in wanted {
                let next = names.len() as u32;
                let u = *names.entry(unit).or_insert(next);
                m.entry((dir, tensor, u, peer)).or_default();
            }
            let strays = names.len() as u32;
            if strays > 0 {
                let mut recent = RecentNames::new();
                for (i, a) in list.iter().enumerate() {
                    let Some(P2pFields {
                        dir,
                        tensor,
                        unit,
                        mb,
                        peer,
                        ..
                    }) = a.p2p_fields()
                    else {
                        continue;
                    };
                    let unit: &str = unit;
                    let next = names.len() as u32;
                    let u = recent
                        .get(unit, |_| Some(*names.entry(unit).or_insert(next)))
                        .unwrap_or(next);
                    if u >= strays {
                        continue;
                    }
                    if let Some(v) = m.get_mut(&(dir, tensor, u, peer as usize)) {
                        v.push((mb as usize, i));
                    }
                }
                for v in m.values_mut() {
                    v.sort_unstable();
                }
            }
            (names, m)
        })
        .collect();
    let stray_set: HashSet<(usize, Key)> = found.iter().map(|&(r, _, x)| (r, x)).collect();
    // Per rank: positions removed, and the actions inserted before a position.
    let mut removed: Vec<HashSet<usize>> = vec![HashSet::default(); p.programs.len()];
    let mut inserted: Vec<HashMap<usize, Vec<Action>>> = vec![HashMap::default(); p.programs.len()];
    for &(r, i, (dir, tensor, unit, mb, peer)) in &found {
        let ends = [(r, dir, peer, i), (peer, dir.facing(), r, usize::MAX)];
        let mut moves = Vec::new();
        for (rank, d, to, at) in ends {
            if rank >= p.programs.len() {
                break;
            }
            let list = &p.programs[rank];
            let (names, m) = &kinds[rank];
            let Some(v) = names.get(unit).and_then(|&u| m.get(&(d, tensor, u, to))) else {
                break;
            };
            let k = v.partition_point(|&(m, _)| m <= mb);
            let (Some(&(own_mb, own)), Some(&(next, sib))) =
                (k.checked_sub(1).and_then(|j| v.get(j)), v.get(k))
            else {
                break;
            };
            if own_mb != mb || (at != usize::MAX && own != at) {
                break;
            }
            if stray_set.contains(&(rank, (d, tensor, unit, next, to))) {
                break;
            }
            // The start of the sibling's group.
            let mut start = sib;
            let batch = list[sib].batch();
            while batch.is_some()
                && start > 0
                && list[start - 1].batch() == batch
                && key(&list[start - 1]).is_some()
            {
                start -= 1;
            }
            moves.push((rank, own, start, next));
        }
        // Both ends, the sibling the same transfer on both, and posted earlier than
        // the stray on its rank.
        let [(r0, own0, start0, next0), (r1, own1, start1, next1)] = moves[..] else {
            continue;
        };
        if next0 != next1 || start0 >= own0 {
            continue;
        }
        for (rank, own, start) in [(r0, own0, start0), (r1, own1, start1)] {
            if !removed[rank].insert(own) {
                continue;
            }
            let mut act = p.programs[rank][own].clone();
            act.set_batch(None);
            inserted[rank].entry(start).or_default().push(act);
        }
    }
    let mut out = Vec::new();
    for (r, list) in p.programs.iter().enumerate() {
        if removed[r].is_empty() {
            continue;
        }
        let mut new = Vec::with_capacity(list.len());
        for (i, a) in list.iter().enumerate() {
            if let Some(acts) = inserted[r].remove(&i) {
                new.extend(acts);
            }
            if !removed[r].contains(&i) {
                new.push(a.clone());
            }
        }
        out.push((r, canonical(&new)));
    }
    (!out.is_empty()).then_some(out)
}

/// Every rank of `p` read as a [`Shape`], with the stretches `known` found before
/// (per rank; none if empty); `None` if a rank is too long for one.
fn shapes_of(p: &Program, known: Vec<HashMap<usize, Option<Span>>>) -> Option<Vec<Shape>> {
    let mut known = known.into_iter();
    p.programs
        .iter()
        .map(|l| {
            let shape = Shape::of(l)?;
            if let Some(k) = known.next() {
                shape.stretches.replace(k);
            }
            Some(shape)
        })
        .collect()
}

/// Exchange the lists of `ranks` (rank, list) with `p`'s (twice: back as before).
fn swap_ranks(p: &mut Program, ranks: &mut [(usize, Vec<Action>)]) {
    for (r, list) in ranks {
        std::mem::swap(&mut p.programs[*r], list);
    }
}

/// The ranks of `p` (each with its new list) whose transfers in a periodic stretch
/// are placed as in its `reference` period (batches renumbered `0, 1, ...` per
/// rank), where this leaves the rank's rolled code no larger ([`rank_code_size`]);
/// `None` if no rank has such a stretch or nothing moved.
///
/// `sizes` holds, per rank, the rolled code size of `p`'s own list where it has
/// been measured ([`rank_code_size`] of that list; filled here where needed, so a
/// caller passing the same `p` again measures no list twice). `release` is called
/// once a rank's rewriting first changes its list, before its code is rolled to
/// weigh it (the caller frees what it does not need from there on; only one
/// rank's rewriting tables were built beside it, and freed).
fn periodic(
    p: &Program,
    shapes: &[Shape],
    reference: Reference,
    policy: &SearchPolicy,
    (sizes, release): (&mut [Option<usize>], &mut dyn FnMut()),
) -> Option<Vec<(usize, Vec<Action>)>> {
    let probes = policy.periodic_probes.max(1);
    let min_periods = policy.periodic_min_periods.max(2);
    let share = policy.periodic_min_break_share;
    let roll = RollOptions::default();
    // The ranks rewritten; the program is copied only if there is one.
    let mut rewritten: Vec<(usize, Vec<Action>)> = Vec::new();
    for (r, original) in p.programs.iter().enumerate() {
        let mut list: Option<Vec<Action>> = None;
        // The rank as rewritten so far, read again (`None`: as `shapes` reads it).
        let mut own: Option<Shape> = None;
        // Stretches through `probes - 1` evenly spaced tasks, each once (a schedule's
        // forward and backward phases are two stretches).
        let mut done: Vec<(usize, usize)> = Vec::new();
        let mut size = None;
        for probe in 1..probes {
            let at = Probe {
                point: (probe, probes),
                min_periods,
                microbatches: p.microbatches,
            };
            let now: &[Action] = list.as_deref().unwrap_or(original);
            let shape = own.as_ref().unwrap_or(&shapes[r]);
            let Some(found) = shape.find(now, &at, &done, reference) else {
                continue;
            };
            done.push((found.start, found.end));
            // The common case, a regular rank: every period is placed as the
            // template already, and nothing is built. A stretch whose placement
            // breaks the period in only a few of its periods has no drift to
            // remove, only a few local deviations, which the roller writes out
            // either way: it is not rewritten, nor its code rolled to weigh it.
            let needed = ((share * found.periods as f64).ceil() as usize).max(1);
            if shape.breaks(now, &found, needed) < needed {
                continue;
            }
            let Some(new) = shape.rewrite(now, &found) else {
                continue;
            };
            if new == now {
                continue;
            }
            // The first placement that changes: from here on the caller's
            // candidate is built (a rank whose rewriting moves nothing, as where
            // its periods differ only in transfers the template cannot move,
            // keeps the caller's timeline: it is not simulated again for
            // nothing).
            release();
            // A rank is rewritten only where its code, rolled as code generation
            // rolls it, is no larger: moving the transfers at a stretch's ends can
            // cost a step more than the drift it removes.
            // Until a rewriting is kept, `now` is the rank's own list.
            let old = match size {
                Some(s) => s,
                None => match sizes[r] {
                    Some(s) => s,
                    None => {
                        let s = rank_code_size(p, r, now, &roll).ok()?;
                        sizes[r] = Some(s);
                        s
                    }
                },
            };
            let Ok(smaller) = rank_code_size(p, r, &new, &roll) else {
                continue;
            };
            if smaller <= old {
                // Only transfers moved: the compute tasks keep their order.
                let known = shape.stretches.borrow().clone();
                let again = Shape::of(&new)?;
                again.stretches.replace(known);
                own = Some(again);
                list = Some(new);
                size = Some(smaller);
            } else {
                size = Some(old);
            }
        }
        if let Some(list) = list {
            rewritten.push((r, list));
        }
    }
    (!rewritten.is_empty()).then_some(rewritten)
}

/// Whether `p` with the lists of `ranks` (rank, new list) in place of its own is
/// more regular than `p`. How irregular a program's transfer placement is: over
/// the ranks, the number of distinct gap contents ([`rank_irregularity`]), each
/// gap (the transfers posted between two compute tasks, as batches) written
/// relative to the task before it (its op and unit, micro-batches as offsets
/// from its micro-batch). A program whose transfers repeat with its compute has a
/// few per rank whatever the micro-batch count; one whose meeting points drift
/// has more, and more with more micro-batches. Only the ranks given change, so
/// only theirs are compared.
fn more_regular(p: &Program, ranks: &[(usize, Vec<Action>)]) -> bool {
    let new: usize = ranks.iter().map(|(_, l)| rank_irregularity(l)).sum();
    let old: usize = ranks
        .iter()
        .map(|&(r, _)| rank_irregularity(&p.programs[r]))
        .sum();
    new < old
}

/// The irregularity of one rank's list ([`more_regular`]).
fn rank_irregularity(list: &[Action]) -> usize {
    /// A transfer of a gap: its batch's number within the gap, what it moves and
    /// where, its micro-batch as an offset.
    type Member<'a> = (usize, Dir, Tensor, &'a str, i64, usize);
    let mut seen: HashSet<(u8, &str, Vec<Member>)> = HashSet::default();
    let (mut op, mut unit, mut mb) = (u8::MAX, "", 0i64);
    let mut gap: Vec<Member> = Vec::new();
    let mut last_batch: Option<u64> = None;
    let mut group = 0usize;
    for a in list {
        match a.view() {
            ActionRef::Compute(c) => {
                if !gap.is_empty() {
                    seen.insert((op, unit, std::mem::take(&mut gap)));
                }
                (op, unit, mb) = (c.op as u8, c.unit, c.mb as i64);
                (last_batch, group) = (None, 0);
            }
            ActionRef::P2p(t) => {
                // Members of one batch share a number; a new batch or a lone
                // transfer takes the next.
                if t.batch.is_none() || t.batch != last_batch {
                    group += 1;
                }
                last_batch = t.batch;
                gap.push((group, t.dir, t.tensor, t.unit, t.mb as i64 - mb, t.peer));
            }
            ActionRef::Coll(_) => {}
        }
    }
    if !gap.is_empty() {
        seen.insert((op, unit, gap));
    }
    seen.len()
}

/// Which full period of a stretch gives the template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reference {
    /// The one whose first task's micro-batch is nearest to half the micro-batch
    /// count: every rank takes its template at the same micro-batch, so that the
    /// ranks' templates come from one moment of the run and meet each other as they
    /// did there.
    Middle,
    /// The stretch's first full period (where the ranks' paces have drifted least
    /// from where the steady state began).
    First,
    /// The stretch's last full period.
    Last,
    /// Period `c` of the stretch, for itself and the periods after it; the periods
    /// before keep their placement. Where ranks run at different rates, a fast
    /// rank's meeting points drift from the start of the steady state on, and a
    /// template from later in the run, imposed from the start, makes the busiest
    /// rank wait while the phases settle into it (`interleaved(v = 2)` with a
    /// trainable encoder: a constant 110 ticks); from period `c` on, the template
    /// is the placement already there, so the change costs nothing, and the code
    /// written out before the loop is `c` periods whatever the micro-batch count.
    After(usize),
}

/// Where [`Shape::find`] looks for a stretch: through task `n * point.0 / point.1`, one of
/// at least `min_periods` full periods.
struct Probe {
    point: (usize, usize),
    min_periods: usize,
    microbatches: usize,
}

/// A transfer's identity on its rank.
type Key<'a> = (Dir, Tensor, &'a str, usize, usize);

fn key(a: &Action) -> Option<Key<'_>> {
    match a.view() {
        ActionRef::P2p(t) => Some((t.dir, t.tensor, t.unit, t.mb, t.peer)),
        _ => None,
    }
}

/// One rank's list read as compute tasks and the gaps between them, its indices
/// 32-bit (8 bytes a task; 8 a group and 4 a gap once the gaps are read, see
/// [`Layout`]: the templates read every rank's, held beside the program while a
/// rank is rewritten; a list longer than that has none).
struct Shape {
    /// Index in the list of each compute task.
    tasks: Vec<u32>,
    /// `x[k] = (op, unit, mb[k] - mb[k-1])` of task `k`, interned (`x[0]`'s step is 0).
    x: Vec<u32>,
    /// The gaps' groups, read from the list when first asked ([`Shape::layout`]):
    /// a regular rank's periods are compared on the list itself
    /// ([`Shape::placed_alike`]), and its gaps never read.
    layout: std::cell::OnceCell<Layout>,
    /// [`stretch`]'s answer through each task asked so far (the templates ask
    /// the same; it depends on the compute order only, which no rewrite changes).
    stretches: std::cell::RefCell<HashMap<usize, Option<Span>>>,
    /// Per stretch compared so far, each full period's class ([`Shape::classes`]):
    /// [`Shape::breaks`] under any template period reads them, so each stretch's
    /// periods are compared once, not once per template. Told of the list the
    /// shape was read from.
    classes: std::cell::RefCell<Vec<(Span, Vec<u32>)>>,
}

/// A rank's gaps as groups of its list ([`Shape::layout`]).
struct Layout {
    /// The groups (a batch, a lone transfer or a collective) as ranges of the list,
    /// in order.
    groups: Vec<Group>,
    /// Gap `g` (what is posted before task `g`; gap `n` after the last) holds
    /// `groups[gap_start[g]..gap_start[g + 1]]`.
    gap_start: Vec<u32>,
}

/// The class of a period holding a collective ([`Shape::classes`]).
const NO_CLASS: u32 = u32::MAX;

/// A range of a rank's list, `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Group {
    start: u32,
    end: u32,
}

impl Group {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }

    fn len(self) -> usize {
        (self.end - self.start) as usize
    }
}

/// A periodic stretch as [`stretch`] gives it: `(period, start, end)`.
type Span = (usize, usize, usize);

/// A periodic stretch [`Shape::find`] found: tasks `start..end` repeat with
/// `period` tasks, each repetition advancing the micro-batches by `d`.
struct Found {
    period: usize,
    start: usize,
    end: usize,
    /// Micro-batch advance per period.
    d: i64,
    /// Full periods whose gaps lie inside the stretch.
    periods: usize,
    /// The period whose placement is the template.
    reference: usize,
    /// The first period placed as the template ([`Reference::After`]; 0 for the
    /// others): the periods before it keep their placement.
    from: usize,
}

impl Found {
    /// The gap after task `k - 1` of period `q` (`k` in `1..=period`).
    fn gap(&self, q: usize, k: usize) -> usize {
        self.start + q * self.period + k
    }
}

impl Shape {
    fn of(list: &[Action]) -> Option<Shape> {
        u32::try_from(list.len()).ok()?;
        // Allocated at their sizes (every rank's shape is held beside the program).
        let n = list.iter().filter(|a| compute_of(a).is_some()).count();
        let mut shape = Shape {
            tasks: Vec::with_capacity(n),
            x: Vec::with_capacity(n),
            layout: Default::default(),
            stretches: Default::default(),
            classes: Default::default(),
        };
        // `x` interned by unit name id: a task's unit name is most often one shared
        // string per unit, and a rank's tasks name few units, so the last names
        // looked up ([`RecentNames`]) find most without hashing the name. In a
        // rank's steady state each `x` is most often followed by the one that
        // followed it last: that one is tried first, compared by op, step and the
        // unit name's address (the same address is the same name), so most tasks
        // are interned without looking anything up.
        let mut names: HashMap<&str, u32> = HashMap::default();
        let mut recent = RecentNames::new();
        let mut ids: HashMap<(u8, u32, i64), u32> = HashMap::default();
        // Per id: the op, unit name (address and length) and step it was last
        // given for, and the id that followed it last.
        let mut given: Vec<(u8, *const u8, usize, i64)> = Vec::new();
        let mut next_of: Vec<Option<u32>> = Vec::new();
        let mut before: Option<(u32, u32)> = None;
        for (j, a) in list.iter().enumerate() {
            let Some((op, unit, mb)) = compute_of(a) else {
                continue;
            };
            let d = before.map_or(0, |(m, _)| i64::from(mb) - i64::from(m));
            let here = (op as u8, unit.as_ptr(), unit.len(), d);
            let guess = before
                .and_then(|(_, id)| next_of[id as usize])
                .filter(|&g| given[g as usize] == here);
            let id = match guess {
                Some(id) => id,
                None => {
                    let name = recent.get(unit, |_| {
                        let next = names.len() as u32;
                        Some(*names.entry(unit).or_insert(next))
                    })?;
                    let next = ids.len() as u32;
                    let id = *ids.entry((op as u8, name, d)).or_insert(next);
                    if id == next {
                        given.push(here);
                        next_of.push(None);
                    }
                    given[id as usize] = here;
                    if let Some((_, b)) = before {
                        next_of[b as usize] = Some(id);
                    }
                    id
                }
            };
            before = Some((mb, id));
            shape.x.push(id);
            shape.tasks.push(j as u32);
        }
        Some(shape)
    }

    /// The gaps' groups of `list` (the list this shape was read from), read once.
    fn layout(&self, list: &[Action]) -> &Layout {
        self.layout.get_or_init(|| {
            // Allocated at their sizes: a group at most every other transfer.
            let n = self.tasks.len();
            let mut gap_start = Vec::with_capacity(n + 2);
            gap_start.push(0);
            let mut groups = Vec::with_capacity(list.len() - n);
            let mut j = 0;
            while j < list.len() {
                match list[j].view() {
                    ActionRef::Compute(_) => {
                        gap_start.push(groups.len() as u32);
                        j += 1;
                    }
                    ActionRef::Coll(_) => {
                        groups.push(Group {
                            start: j as u32,
                            end: j as u32 + 1,
                        });
                        j += 1;
                    }
                    ActionRef::P2p(t) => {
                        let mut end = j + 1;
                        if t.batch.is_some() {
                            while end < list.len()
                                && matches!(list[end].view(), ActionRef::P2p(u) if u.batch == t.batch)
                            {
                                end += 1;
                            }
                        }
                        groups.push(Group {
                            start: j as u32,
                            end: end as u32,
                        });
                        j = end;
                    }
                }
            }
            gap_start.push(groups.len() as u32);
            // Batches make fewer groups than actions.
            groups.shrink_to_fit();
            Layout { groups, gap_start }
        })
    }

    /// The groups of gap `g` of `list` (the list this shape was read from).
    fn gap(&self, list: &[Action], g: usize) -> &[Group] {
        let l = self.layout(list);
        &l.groups[l.gap_start[g] as usize..l.gap_start[g + 1] as usize]
    }

    /// The micro-batch of task `k` of `list` (the list this shape was read from).
    fn mb(&self, list: &[Action], k: usize) -> i64 {
        compute_of(&list[self.tasks[k] as usize]).map_or(0, |(_, _, mb)| i64::from(mb))
    }

    /// The periodic stretch through the [`Probe`]'s task of `list` (the list this
    /// shape was read from), with its template period; `None` if there is none or
    /// it lies in `done`.
    fn find(
        &self,
        list: &[Action],
        probe: &Probe,
        done: &[(usize, usize)],
        reference: Reference,
    ) -> Option<Found> {
        let min_periods = probe.min_periods;
        let n = self.tasks.len();
        if n < min_periods + 1 {
            return None;
        }
        let mid = n * probe.point.0 / probe.point.1;
        if mid == 0 || done.iter().any(|&(a, b)| a <= mid && mid < b) {
            return None;
        }
        let known = self.stretches.borrow().get(&mid).copied();
        let (period, start, end) = match known {
            Some(found) => found,
            None => {
                let found =
                    stretch(&self.x[1..], mid - 1, min_periods).map(|(l, a, b)| (l, a + 1, b + 1));
                self.stretches.borrow_mut().insert(mid, found);
                found
            }
        }?;
        // Tasks start .. end repeat with period `period`: task k + P is task k
        // advanced by D for k in start .. end - P.
        let first = self.mb(list, start);
        let d = self.mb(list, start + period) - first;
        if d <= 0 {
            return None;
        }
        // Period q holds gaps start + q*P + 1 ..= start + (q + 1)*P (after each of
        // its tasks), all strictly inside the stretch's tasks.
        let periods = (end - 1 - start) / period;
        if periods < min_periods {
            return None;
        }
        let target = probe.microbatches as f64 / 2.0;
        let mut from = 0;
        let reference = match reference {
            Reference::After(c) => {
                // As many periods from the template on as any stretch needs.
                if periods < c.saturating_add(min_periods) {
                    return None;
                }
                from = c;
                c
            }
            Reference::First => 0,
            Reference::Last => periods - 1,
            Reference::Middle => {
                // Period `q` starts at micro-batch `first + q * d` (the tasks
                // repeat, advanced by `d`): the distance is convex in `q` and falls
                // strictly up to the last period starting at or below the target,
                // so the first nearest is found by walking on from there.
                let far = |q: usize| ((first + q as i64 * d) as f64 - target).abs();
                let below = (probe.microbatches as i64 - 2 * first).div_euclid(2 * d);
                let mut q = usize::try_from(below).unwrap_or(0).min(periods - 1);
                while q + 1 < periods && far(q + 1) < far(q) {
                    q += 1;
                }
                q
            }
        };
        Some(Found {
            period,
            start,
            end,
            d,
            periods,
            reference,
            from,
        })
    }

    /// How many full periods of `f` have their transfers placed otherwise than the
    /// template (other groups, other transfers, or micro-batches not advanced by `d`
    /// per period), counting up to `most`.
    ///
    /// Being placed as one another (micro-batches advanced by `d` per period) is
    /// an equivalence, so the stretch's periods fall into classes
    /// ([`Shape::classes`], found once per stretch): a period is placed as the
    /// template where it is in the template's class.
    fn breaks(&self, list: &[Action], f: &Found, most: usize) -> usize {
        let classes = self.classes_of(list, f);
        let template = classes[f.reference];
        (f.from..f.periods)
            .filter(|&q| template == NO_CLASS || classes[q] != template)
            .take(most)
            .count()
    }

    /// [`Shape::classes`] of `f`'s stretch, found once per stretch.
    fn classes_of(&self, list: &[Action], f: &Found) -> std::cell::Ref<'_, Vec<u32>> {
        let span = (f.period, f.start, f.end);
        let known = self.classes.borrow().iter().position(|(s, _)| *s == span);
        let at = known.unwrap_or_else(|| {
            let classes = self.classes(list, f);
            let mut cache = self.classes.borrow_mut();
            cache.push((span, classes));
            cache.len() - 1
        });
        std::cell::Ref::map(self.classes.borrow(), |c| &c[at].1)
    }

    /// Each full period's class of `f`'s stretch: two periods share one where
    /// their gaps hold the same groups of the same transfers, micro-batches
    /// advanced by `d` per period; [`NO_CLASS`] for a period with a collective in
    /// a gap (placed as no period, not even itself). A class is named by its
    /// first period.
    ///
    /// A period differing from the one before is written as words (per gap its
    /// group count, per group its length, per transfer its direction, tensor and
    /// unit, its peer, and its micro-batch less `q * d` for period `q`); the
    /// writing is prefix-free, so two periods are placed alike exactly where their
    /// words are equal, and the classes are the distinct words. Units are numbered
    /// as first seen, through the last names looked up ([`RecentNames`]), so a
    /// name is hashed rarely, not once per transfer. A period placed as the one
    /// before is found so on the list ([`Shape::placed_alike`]) and not written:
    /// a regular stretch's periods are read once, in step, and its gaps
    /// ([`Shape::layout`]) not at all.
    fn classes(&self, list: &[Action], f: &Found) -> Vec<u32> {
        use std::hash::{Hash, Hasher};
        let mut names: HashMap<&str, u32> = HashMap::default();
        let mut recent = RecentNames::new();
        // Period `q`'s words into `out`; `false` for one holding a collective.
        let mut write = |q: usize, out: &mut Vec<u64>| {
            out.clear();
            let by = q as i64 * f.d;
            for k in 1..=f.period {
                let gap = self.gap(list, f.gap(q, k));
                out.push(gap.len() as u64);
                for g in gap {
                    out.push(g.len() as u64);
                    for a in g.range() {
                        let Some((dir, tensor, unit, mb, peer)) = key(&list[a]) else {
                            return false;
                        };
                        let id = recent.get(unit, |_| {
                            let next = names.len() as u32;
                            Some(*names.entry(unit).or_insert(next))
                        });
                        let id = u64::from(id.unwrap_or(u32::MAX));
                        let mb = (mb as i64 - by) as u64;
                        out.extend([id, dir as u64, tensor as u64, peer as u64, mb]);
                    }
                }
            }
            true
        };
        // No period's words are held but the one's being looked up (the periods
        // of a stretch can be most of a rank's list): a period placed as the one
        // before (the last without a collective) takes its class, compared on the
        // list itself ([`Shape::placed_alike`], the common case: nothing is
        // written); another is looked up by its words' hash among the classes'
        // first periods, whose words are written again to compare (a collision of
        // hashes makes a class of its own). A class's first period is hashed only
        // once another is looked up (a regular stretch, one class, hashes none).
        let (mut here, mut other) = (Vec::new(), Vec::new());
        let mut before: Option<(usize, u32)> = None;
        let mut first: HashMap<u64, Vec<usize>> = HashMap::default();
        // The first class's first period, until another period is looked up.
        let mut unhashed: Option<usize> = None;
        let mut classes = vec![NO_CLASS; f.periods];
        let hash = |words: &[u64]| {
            let mut h = rustc_hash::FxHasher::default();
            words.hash(&mut h);
            h.finish()
        };
        for q in 0..f.periods {
            let alike = before.map(|(p, class)| (self.placed_alike(list, f, p, q), class));
            let class = match alike {
                Some((Some(true), class)) => class,
                Some((None, _)) => continue,
                None if !has_collective(list, self.period_span(f, q)) => {
                    unhashed = Some(q);
                    q as u32
                }
                _ => {
                    if !write(q, &mut here) {
                        continue;
                    }
                    if let Some(t) = unhashed.take() {
                        // It holds no collective: its words are written.
                        write(t, &mut other);
                        first.entry(hash(&other)).or_default().push(t);
                    }
                    let firsts = first.entry(hash(&here)).or_default();
                    let mut found = None;
                    for &t in firsts.iter() {
                        if write(t, &mut other) && other == here {
                            found = Some(classes[t]);
                            break;
                        }
                    }
                    found.unwrap_or_else(|| {
                        firsts.push(q);
                        q as u32
                    })
                }
            };
            classes[q] = class;
            before = Some((q, class));
        }
        classes
    }

    /// The list's range of full period `q` of `f`: from after its first task to
    /// before the next period's first (its gaps and the tasks between them).
    fn period_span(&self, f: &Found, q: usize) -> std::ops::Range<usize> {
        let t = f.start + q * f.period;
        self.tasks[t] as usize + 1..self.tasks[t + f.period] as usize
    }

    /// Whether full periods `p` and `q` of `f` are placed alike (their words in
    /// [`Shape::classes`] are equal: the same groups of the same transfers,
    /// micro-batches advanced by `d` per period), read in step on the list (the
    /// one this shape was read from) without writing either; `None` where `q`
    /// holds a collective met before any difference (`p` holds none).
    ///
    /// A period is the list from after its first task to before the next
    /// period's: its gaps and the tasks between them, which are alike in both
    /// (the stretch's tasks repeat). So two periods are placed alike exactly
    /// where they are as long, hold a transfer at the same places, the same
    /// transfers (micro-batch advanced by `(q - p) * d`) and the same groups (a
    /// transfer starts one where it has no batch or not the one before's).
    fn placed_alike(&self, list: &[Action], f: &Found, p: usize, q: usize) -> Option<bool> {
        let (a, b) = (&list[self.period_span(f, p)], &list[self.period_span(f, q)]);
        if a.len() != b.len() {
            return Some(false);
        }
        let by = (q as i64 - p as i64) * f.d;
        // The batch of the action before, if a transfer.
        let (mut batch_a, mut batch_b) = (None, None);
        for (x, y) in a.iter().zip(b) {
            match (x.p2p_fields(), y.p2p_fields()) {
                (Some(s), Some(t)) => {
                    let same = s.dir == t.dir
                        && s.tensor == t.tensor
                        && s.peer == t.peer
                        && i64::from(t.mb) - i64::from(s.mb) == by
                        && s.unit == t.unit;
                    let starts = |batch: Option<Batch>, before: Option<Batch>| {
                        batch.is_none() || batch != before
                    };
                    if !same || starts(s.batch, batch_a) != starts(t.batch, batch_b) {
                        return Some(false);
                    }
                    (batch_a, batch_b) = (s.batch, t.batch);
                }
                (None, None) => {
                    // Neither a transfer: alike only if both are compute tasks (a
                    // collective in `q`'s period is "cannot tell", `None`; one in
                    // `p`'s only, where `q`'s is a task, differs).
                    compute_of(y)?;
                    if compute_of(x).is_none() {
                        return Some(false);
                    }
                    (batch_a, batch_b) = (None, None);
                }
                _ => return Some(false),
            }
        }
        Some(true)
    }

    /// `list` (the list this shape was read from) with the transfers of `f`'s full
    /// periods placed as in its template period; `None` where the template holds a
    /// collective.
    fn rewrite(&self, list: &[Action], f: &Found) -> Option<Vec<Action>> {
        // The template: per gap of the period, its groups of transfers.
        let mut template: Vec<Vec<Vec<(usize, Key)>>> = Vec::with_capacity(f.period);
        for k in 1..=f.period {
            let mut groups = Vec::new();
            for g in self.gap(list, f.gap(f.reference, k)) {
                let mut members = Vec::new();
                for a in g.range() {
                    // A collective in the middle of the steady state: leave the rank be.
                    members.push((a, key(&list[a])?));
                }
                groups.push(members);
            }
            template.push(groups);
        }
        // Where each transfer is posted (its last position, for a key posted twice),
        // by its compact key.
        let mut ids = UnitIds::default();
        let transfers = list
            .iter()
            .filter(|a| matches!(a.view(), ActionRef::P2p(_)))
            .count();
        let mut at: HashMap<Compact, u32> =
            HashMap::with_capacity_and_hasher(transfers, Default::default());
        for (i, a) in list.iter().enumerate() {
            if let Some(k) = key(a).and_then(|k| ids.compact(k)) {
                at.insert(k, i as u32);
            }
        }
        // A transfer is posted within the stretch's full periods from the first placed
        // as the template (gaps `lo..=hi`) when it lies after task `lo - 1` and before
        // task `hi` (if any): the periods before `f.from` keep their placement.
        let (lo, hi) = (f.gap(f.from, 1), f.gap(f.periods - 1, f.period));
        let after = self.tasks[lo - 1];
        let before = self.tasks.get(hi).map_or(u32::MAX, |&t| t);
        // Moved transfers, by the position `at` gives their key (one bit each).
        const WORD: u32 = u64::BITS;
        let mut moved = vec![0u64; list.len().div_ceil(WORD as usize)];
        let is_moved = |moved: &[u64], i: u32| moved[(i / WORD) as usize] >> (i % WORD) & 1 != 0;
        // Every period's groups from the template, claiming the transfers they name,
        // in gap order (each period's gaps follow the one before's): per transfer
        // generated, its gap, the template's position it is copied from, its
        // micro-batch, and whether it starts a group.
        let shift = |mb: usize, by: i64| usize::try_from(mb as i64 + by).ok();
        let mut generated: Vec<Generated> = Vec::new();
        for q in f.from..f.periods {
            let by = (q as i64 - f.reference as i64) * f.d;
            for k in 1..=f.period {
                for members in &template[k - 1] {
                    let mut first = true;
                    for &(a, (dir, tensor, unit, mb, peer)) in members {
                        let Some(mb) = shift(mb, by) else { continue };
                        let Some(key) = ids.compact((dir, tensor, unit, mb, peer)) else {
                            continue;
                        };
                        // Only transfers posted within the stretch's full periods
                        // move: the warm-up and the cool-down keep theirs.
                        let Some(&i) = at.get(&key).filter(|&&i| after < i && i < before) else {
                            continue;
                        };
                        if is_moved(&moved, i) {
                            continue;
                        }
                        moved[(i / WORD) as usize] |= 1 << (i % WORD);
                        generated.push(Generated {
                            gap: f.gap(q, k) as u32,
                            from: a as u32,
                            mb: key.3,
                            first,
                        });
                        first = false;
                    }
                }
            }
        }
        // Assemble: per gap, the groups that stay (without their moved members), then
        // the generated ones; then the task.
        let mut out: Vec<Action> = Vec::with_capacity(list.len());
        let mut batch = 0u64;
        // Each group's members are pushed, then their batch set (a group of one
        // has none).
        let mut close = |out: &mut Vec<Action>, from: usize| {
            let id = (out.len() - from > 1).then(|| {
                batch += 1;
                batch - 1
            });
            for a in &mut out[from..] {
                a.set_batch(id);
            }
        };
        let mut generated = generated.into_iter().peekable();
        for g in 0..self.layout(list).gap_start.len() - 1 {
            for members in self.gap(list, g) {
                let from = out.len();
                for a in members.range() {
                    let stays = key(&list[a])
                        .and_then(|k| ids.compact(k))
                        .is_none_or(|k| at.get(&k).is_none_or(|&i| !is_moved(&moved, i)));
                    if stays {
                        out.push(list[a].clone());
                    }
                }
                if out.len() > from {
                    close(&mut out, from);
                }
            }
            let mut from = None;
            while let Some(x) = generated.next_if(|x| x.gap as usize == g) {
                if x.first {
                    if let Some(from) = from {
                        close(&mut out, from);
                    }
                    from = Some(out.len());
                }
                let mut act = list[x.from as usize].clone();
                set_mb(&mut act, x.mb as usize);
                out.push(act);
            }
            if let Some(from) = from {
                close(&mut out, from);
            }
            if let Some(&t) = self.tasks.get(g) {
                out.push(list[t as usize].clone());
            }
        }
        (out.len() == list.len()).then_some(out)
    }
}

/// A transfer [`Shape::rewrite`] places from its template: 16 bytes, not a copied
/// action in a group of its own.
struct Generated {
    /// The gap it is posted in.
    gap: u32,
    /// The template's transfer it is a copy of (position in the list).
    from: u32,
    /// Its micro-batch.
    mb: u32,
    /// Whether it starts a group (else it is batched with the one before).
    first: bool,
}

/// A transfer's identity on its rank ([`Key`]) with its unit numbered: 16 bytes, not
/// 40, in the tables [`Shape::rewrite`] keeps of every transfer of a rank.
type Compact = (Dir, Tensor, u32, u32, u32);

/// A rank's units, numbered as first seen, for [`Compact`] keys.
#[derive(Default)]
struct UnitIds<'a>(HashMap<&'a str, u32>);

impl<'a> UnitIds<'a> {
    /// The compact key of `k`; `None` when a number is over 32 bits (no transfer of
    /// a list has such a key).
    fn compact(&mut self, (dir, tensor, unit, mb, peer): Key<'a>) -> Option<Compact> {
        let next = self.0.len() as u32;
        let unit = *self.0.entry(unit).or_insert(next);
        Some((
            dir,
            tensor,
            unit,
            u32::try_from(mb).ok()?,
            u32::try_from(peer).ok()?,
        ))
    }
}

/// The periodic stretch of `x` through position `mid`: `(period, start, end)` with
/// `x[k] == x[k - period]` for every `k` in `start + period..end`, for the smallest
/// period that holds `periods` (at least 2) times forward from `mid`; `None` if
/// none does.
///
/// Period `l` holds `periods` times from `mid` where `s = x[mid..]` begins with
/// `periods * l` elements of period `l`: where the smallest period of that
/// prefix ([`prefix_function`]) divides `l` (a multiple of a period is one, and
/// conversely by Fine and Wilf's theorem, two periods of a string at least their
/// sum long having their gcd as a period). So only the prefix up to the answer is
/// read, and then the stretch, once, forward and backward.
fn stretch(x: &[u32], mid: usize, periods: usize) -> Option<(usize, usize, usize)> {
    let s = &x[mid..];
    let period = prefix_function(s).enumerate().find_map(|(i, p)| {
        let len = i + 1;
        let l = len / periods;
        (len.is_multiple_of(periods) && l.is_multiple_of(len - p)).then_some(l)
    })?;
    let end = mid
        + period
        + s[period..]
            .iter()
            .zip(s)
            .take_while(|(a, b)| a == b)
            .count();
    let mut start = mid;
    while start > 0 && x[start - 1] == x[start - 1 + period] {
        start -= 1;
    }
    Some((period, start, end))
}

/// The prefix function of `s`, prefix by prefix: for each `i`, the length of the
/// longest proper prefix of `s[..=i]` that is also its suffix (`i + 1` less it is
/// the smallest period of `s[..=i]`); each value in amortized constant time.
fn prefix_function(s: &[u32]) -> impl Iterator<Item = usize> + '_ {
    let mut pi: Vec<usize> = Vec::new();
    s.iter().enumerate().map(move |(i, &c)| {
        let mut k = if i == 0 { 0 } else { pi[i - 1] };
        while k > 0 && s[k] != c {
            k = pi[k - 1];
        }
        if i > 0 && s[k] == c {
            k += 1;
        }
        pi.push(k);
        k
    })
}

/// `a`'s op, unit and micro-batch if it is a compute task (read without
/// [`Action::view`]: every action of every rank is read).
fn compute_of(a: &Action) -> Option<(Op, &str, u32)> {
    match a {
        Action::F { unit, mb } => Some((Op::F, &**unit, *mb)),
        Action::B { unit, mb } => Some((Op::B, &**unit, *mb)),
        Action::W { unit, mb } => Some((Op::W, &**unit, *mb)),
        Action::BW { unit, mb } => Some((Op::BW, &**unit, *mb)),
        Action::RF { unit, mb } => Some((Op::RF, &**unit, *mb)),
        _ => None,
    }
}

/// Whether `list[span]` holds a collective.
fn has_collective(list: &[Action], span: std::ops::Range<usize>) -> bool {
    list[span]
        .iter()
        .any(|a| matches!(a, Action::BCAST { .. } | Action::REDUCE { .. }))
}

fn set_mb(a: &mut Action, to: usize) {
    if let Action::SEND { mb, .. } | Action::RECV { mb, .. } = a {
        *mb = crate::ir::program::narrow(to);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rolled sizes [`periodic`] keeps for the caller's next template are the
    /// sizes of the program's own lists, and each template's rewriting with them
    /// is its rewriting measuring afresh: `gpipe` with a trainable encoder (4 x 32,
    /// its meeting points drift), every template in the caller's order.
    #[test]
    fn sizes_kept_across_templates_are_the_lists_sizes() {
        use crate::search::derive::{derive_str, Request};
        let text = include_str!("../../../docs/guide/examples/small-mllm.toml")
            .replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 48\n");
        let profile = crate::algebra::profile::Profile::from_toml_str(&text).unwrap();
        let mut req = Request::new(&profile, 4, 32);
        let policy = req.policy;
        req.policy.periodic_probes = 0;
        let p = derive_str(&req, "gpipe").unwrap().program;
        let shapes = shapes_of(&p, Vec::new()).unwrap();
        let mut kept = vec![None; p.programs.len()];
        let settled = policy
            .periodic_settle_periods
            .iter()
            .map(|&c| Reference::After(c));
        let mut rewritten = 0;
        for reference in [Reference::Middle, Reference::First, Reference::Last]
            .into_iter()
            .chain(settled)
        {
            let mut fresh = vec![None; p.programs.len()];
            let a = periodic(&p, &shapes, reference, &policy, (&mut kept, &mut || {}));
            let b = periodic(&p, &shapes, reference, &policy, (&mut fresh, &mut || {}));
            assert_eq!(a, b, "{reference:?}");
            rewritten += usize::from(a.is_some());
        }
        let roll = RollOptions::default();
        let mut measured = 0;
        for (r, size) in kept.iter().enumerate() {
            if let Some(size) = *size {
                assert_eq!(size, rank_code_size(&p, r, &p.programs[r], &roll).unwrap());
                measured += 1;
            }
        }
        assert!(rewritten > 0 && measured > 0, "{rewritten} {measured}");
    }

    #[test]
    fn prefix_function_and_stretch() {
        assert_eq!(
            prefix_function(&[1, 1, 2, 1, 1, 2, 1]).collect::<Vec<_>>(),
            vec![0, 1, 0, 1, 2, 3, 4]
        );
        // 9 8 | 1 2 1 2 1 2 1 2 | 7
        let x = [9, 8, 1, 2, 1, 2, 1, 2, 1, 2, 7];
        assert_eq!(stretch(&x, 2, 3), Some((2, 2, 10)));
        // From position 5 the period holds only one and a half times forward.
        assert_eq!(stretch(&x, 5, 3), None);
        assert_eq!(stretch(&[1, 2, 3, 4, 5, 6], 3, 3), None);
    }
}
