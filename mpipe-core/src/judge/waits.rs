//! Whom each rank waited for: a simulated step's idle time, per rank, by cause.
//!
//! A rank never idles inside its list except in communication: a compute action
//! starts the moment the rank reaches it. So a rank's idle time in the step is the
//! time its communication operations took (a single transfer, a batch, or a
//! collective, each from the moment the rank reached it to its completion) plus the
//! time after its last action, until the step ends. [`waits`] splits the first part
//! by cause: the time from the rank reaching an operation until the last of its
//! partners reached theirs is waiting *for that partner* (the one that arrived last;
//! ties go to the lower rank); the rest, until the operation completed, is the
//! transfer itself. Per rank, `waiting + transfer + done_early = makespan - compute`.
//!
//! Under rendezvous this names the neighbour whose different pace costs a rank its
//! time (the usual loss of a pipeline whose ranks do unequal work per cycle); under
//! eager semantics a `SEND` never waits, so only receives do.
//!
//! Matching is the simulator's ([`crate::judge::simulate`]): the k-th `SEND(t,u,m)` from
//! `a` to `b` meets the k-th `RECV(t,u,m)` from `a` on `b`; the k-th collective of
//! one identity (kind, unit, root, group) on a member meets the k-th on the others.
//! An operation whose partner is missing (a program that cannot run has no timeline
//! to read) counts as transfer.

use crate::ir::program::{ActionRef, CollKind, Dir, Program, Tensor};
use crate::judge::simulate::split_ops;
use crate::judge::timeline::Timeline;
use serde::Serialize;
use std::collections::BTreeMap;

/// One rank's idle time by cause (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Waits {
    /// Time spent blocked until a partner reached the operation, by that partner.
    pub by_peer: BTreeMap<usize, f64>,
    /// Time spent in operations once every partner was there (the transfers
    /// themselves, under a communication model).
    pub transfer: f64,
    /// Time from the end of the rank's last action to the end of the step.
    pub done_early: f64,
}

impl Waits {
    /// All the time spent waiting for partners.
    pub fn waiting(&self) -> f64 {
        self.by_peer.values().sum()
    }

    /// The partners, the longest waited for first (ties: lower rank first).
    pub fn largest_first(&self) -> Vec<(usize, f64)> {
        let mut v: Vec<(usize, f64)> = self.by_peer.iter().map(|(&p, &t)| (p, t)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

/// Per rank, how long the other ranks waited for it in total: the rank the others
/// wait for sets their pace, whatever its own compute. `ranks` long; partners out
/// of range are left out.
pub fn waited_for(waits: &[Waits], ranks: usize) -> Vec<f64> {
    let mut total = vec![0.0; ranks];
    for w in waits {
        for (&peer, &t) in &w.by_peer {
            if let Some(x) = total.get_mut(peer) {
                *x += t;
            }
        }
    }
    total
}

/// A point-to-point meeting: (tensor, unit, mb, sender, receiver, occurrence).
type P2pKey<'a> = (Tensor, &'a str, usize, usize, usize, usize);
/// A collective meeting: (kind, unit, root, group, occurrence).
type CollKey<'a> = (CollKind, &'a str, usize, &'a [usize], usize);

/// Per rank, whom it waited for in the step `timeline` records for `program` (the
/// same shape, as [`crate::judge::simulate::simulate`] returns them; actions a timeline of
/// another shape lacks are left out, never a panic), whose makespan is `makespan`.
pub fn waits(program: &Program, timeline: &Timeline, makespan: f64) -> Vec<Waits> {
    // Where every send, receive and collective member was reached.
    let mut sends: BTreeMap<P2pKey, f64> = BTreeMap::new();
    let mut recvs: BTreeMap<P2pKey, f64> = BTreeMap::new();
    let mut colls: BTreeMap<CollKey, Vec<(usize, f64)>> = BTreeMap::new();
    // Keys of each rank's actions, parallel to its list.
    let mut keys: Vec<Vec<Option<Meeting>>> = Vec::with_capacity(program.ranks);
    for (rank, (list, slots)) in program.programs.iter().zip(&timeline.ranks).enumerate() {
        let mut seen_p2p: BTreeMap<(Dir, Tensor, &str, usize, usize, usize), usize> =
            BTreeMap::new();
        let mut seen_coll: BTreeMap<(CollKind, &str, usize, &[usize]), usize> = BTreeMap::new();
        let mut mine = Vec::with_capacity(list.len());
        for (action, slot) in list.iter().zip(slots) {
            mine.push(match action.view() {
                ActionRef::Compute(_) => None,
                ActionRef::P2p(t) => {
                    let (from, to) = t.dir.ends(rank, t.peer);
                    let n = seen_p2p
                        .entry((t.dir, t.tensor, t.unit, t.mb, from, to))
                        .or_default();
                    let key = (t.tensor, t.unit, t.mb, from, to, *n);
                    *n += 1;
                    let (own, other) = match t.dir {
                        Dir::Send => (&mut sends, to),
                        Dir::Recv => (&mut recvs, from),
                    };
                    own.insert(key, slot.start);
                    Some(Meeting::P2p {
                        dir: t.dir,
                        key,
                        peer: other,
                    })
                }
                ActionRef::Coll(c) => {
                    let n = seen_coll
                        .entry((c.kind, c.unit, c.root, c.group))
                        .or_default();
                    let key = (c.kind, c.unit, c.root, c.group, *n);
                    *n += 1;
                    colls.entry(key).or_default().push((rank, slot.start));
                    Some(Meeting::Coll(key))
                }
            });
        }
        keys.push(mine);
    }

    let mut out = Vec::with_capacity(program.ranks);
    for (rank, (list, slots)) in program.programs.iter().zip(&timeline.ranks).enumerate() {
        let mut w = Waits::default();
        let mine = &keys[rank];
        split_ops(list, |lo, hi| {
            // Skip compute actions (and, in a timeline of another shape, what it lacks).
            let (Some(Some(_)), Some(&slot), Some(members)) =
                (mine.get(lo), slots.get(lo), mine.get(lo..hi))
            else {
                return;
            };
            let span = (slot.end - slot.start).max(0.0);
            // The partner that reached the meeting last, over the operation's members.
            let mut last: Option<(usize, f64)> = None;
            let mut consider = |peer: usize, reach: f64| {
                if peer == rank {
                    return;
                }
                let later = match last {
                    None => true,
                    Some((p, t)) => reach > t || (reach == t && peer < p),
                };
                if later {
                    last = Some((peer, reach));
                }
            };
            for m in members.iter().flatten() {
                match m {
                    Meeting::P2p { dir, key, peer } => {
                        let other = match dir {
                            Dir::Send => recvs.get(key),
                            Dir::Recv => sends.get(key),
                        };
                        if let Some(&reach) = other {
                            consider(*peer, reach);
                        }
                    }
                    Meeting::Coll(key) => {
                        if let Some(members) = colls.get(key) {
                            for &(peer, reach) in members {
                                consider(peer, reach);
                            }
                        }
                    }
                }
            }
            let waited = match last {
                Some((peer, reach)) if reach > slot.start && span > 0.0 => {
                    let t = (reach - slot.start).min(span);
                    *w.by_peer.entry(peer).or_default() += t;
                    t
                }
                _ => 0.0,
            };
            w.transfer += span - waited;
        });
        let end = slots.last().map_or(0.0, |s| s.end);
        w.done_early = (makespan - end).max(0.0);
        out.push(w);
    }
    out
}

/// A rank's communication action, as the meeting it takes part in.
enum Meeting<'a> {
    P2p {
        dir: Dir,
        key: P2pKey<'a>,
        peer: usize,
    },
    Coll(CollKey<'a>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::simulate::tests::{prog, unit};
    use crate::judge::simulate::{simulate, CommModel, Mode, SimOptions};

    fn run(p: &Program, mode: Mode, latency: Option<f64>) -> Vec<Waits> {
        let opts = SimOptions {
            mode,
            comm: latency.map(|latency| CommModel {
                latency,
                bandwidth: 1.0,
            }),
        };
        let r = simulate(p, &opts).unwrap();
        let w = waits(p, &r.timeline, r.makespan);
        // The parts add up to each rank's idle time.
        for (rank, w) in w.iter().enumerate() {
            let idle = r.makespan - r.compute[rank];
            assert!(
                (w.waiting() + w.transfer + w.done_early - idle).abs()
                    <= crate::ir::compare::RELATIVE_TOLERANCE * r.makespan,
                "rank {rank}: {w:?} against idle {idle}"
            );
        }
        w
    }

    /// Rank 0 computes for 2 before it sends; rank 1, which receives first thing,
    /// waits those 2 for rank 0, then computes 1 while rank 0 is done.
    fn handoff() -> Program {
        prog(
            1,
            vec![
                unit("a", &[], 0, 2.0, 1.0, 1.0, 1.0),
                unit("b", &["a"], 1, 1.0, 1.0, 1.0, 1.0),
            ],
            &["F a 0; SEND act a 0 1", "RECV act a 0 0; F b 0"],
        )
    }

    #[test]
    fn a_receiver_waits_for_the_sender_it_meets() {
        let w = run(&handoff(), Mode::Rendezvous, None);
        assert_eq!(w[1].by_peer, BTreeMap::from([(0, 2.0)]));
        assert_eq!((w[1].transfer, w[1].done_early), (0.0, 0.0));
        // Rank 0 found rank 1 there already; it then sits out rank 1's last compute.
        assert!(w[0].by_peer.is_empty());
        assert_eq!((w[0].transfer, w[0].done_early), (0.0, 1.0));
    }

    #[test]
    fn transfer_time_is_not_waiting() {
        let w = run(&handoff(), Mode::Rendezvous, Some(0.5));
        assert_eq!(w[1].by_peer, BTreeMap::from([(0, 2.0)]));
        assert_eq!(w[1].transfer, 0.5);
        assert_eq!((w[0].transfer, w[0].done_early), (0.5, 1.0));
    }

    #[test]
    fn an_eager_send_never_waits() {
        // Rank 1 computes first, so under rendezvous rank 0 waits for it at the send;
        // under eager semantics rank 0 sends and moves on.
        let p = prog(
            1,
            vec![
                unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
                unit("b", &["a"], 1, 1.0, 1.0, 1.0, 1.0),
                unit("c", &[], 1, 3.0, 1.0, 1.0, 1.0),
            ],
            &[
                "F a 0; SEND act a 0 1; B a 0",
                "F c 0; RECV act a 0 0; F b 0; B b 0; B c 0",
            ],
        );
        let rdv = run(&p, Mode::Rendezvous, None);
        assert_eq!(rdv[0].by_peer, BTreeMap::from([(1, 2.0)]));
        let eager = run(&p, Mode::Eager, None);
        assert!(eager[0].by_peer.is_empty(), "{:?}", eager[0]);
        assert!(eager[1].by_peer.is_empty(), "{:?}", eager[1]);
    }

    #[test]
    fn a_collective_waits_for_its_last_member() {
        // Ranks 1 and 2 reach the broadcast at 1 and 3; rank 0 at 0 waits 3 for
        // rank 2 (the last), rank 1 waits 2 for rank 2.
        let p = prog(
            1,
            vec![
                unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
                unit("x", &[], 1, 1.0, 1.0, 1.0, 1.0),
                unit("y", &[], 2, 3.0, 1.0, 1.0, 1.0),
            ],
            &[
                "BCAST a 0 0,1,2",
                "F x 0; BCAST a 0 0,1,2",
                "F y 0; BCAST a 0 0,1,2",
            ],
        );
        let w = run(&p, Mode::Rendezvous, None);
        assert_eq!(w[0].by_peer, BTreeMap::from([(2, 3.0)]));
        assert_eq!(w[1].by_peer, BTreeMap::from([(2, 2.0)]));
        assert!(w[2].by_peer.is_empty());
        assert_eq!(w[0].largest_first(), vec![(2, 3.0)]);
    }

    #[test]
    fn a_timeline_of_another_shape_is_read_without_panicking() {
        let p = handoff();
        let r = simulate(&p, &SimOptions::default()).unwrap();
        let mut short = r.timeline.clone();
        short.ranks[1].truncate(1);
        short.ranks.pop();
        let w = waits(&p, &short, r.makespan);
        assert_eq!(w.len(), 1);
        assert!(waits(&p, &Timeline::default(), 0.0).is_empty());
    }

    #[test]
    fn a_batch_waits_for_its_last_partner() {
        // Rank 1 sends to 2 and receives from 0 in one batch, reached at 1; rank 0
        // arrives at 1 and rank 2 at 4: rank 1 waits 3, all of it for rank 2.
        let p = prog(
            1,
            vec![
                unit("a", &[], 0, 1.0, 1.0, 1.0, 1.0),
                unit("b", &["a"], 1, 1.0, 1.0, 1.0, 1.0),
                unit("z", &[], 1, 1.0, 1.0, 1.0, 1.0),
                unit("y", &[], 2, 4.0, 1.0, 1.0, 1.0),
                unit("c", &["z"], 2, 1.0, 1.0, 1.0, 1.0),
            ],
            &[
                "F a 0; SEND act a 0 1",
                "F z 0; SEND act z 0 2 7; RECV act a 0 0 7; F b 0",
                "F y 0; RECV act z 0 1; F c 0",
            ],
        );
        let w = run(&p, Mode::Rendezvous, None);
        assert_eq!(w[1].by_peer, BTreeMap::from([(2, 3.0)]));
    }
}
