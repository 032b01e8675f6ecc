//! Woven encoders (`zb2p(encoders = spread)`): instead of running inline before the
//! first stage, the encoders feeding it join the list schedule on every rank, in
//! quotas that even out each rank's total work. The other bodies and `fill` place an
//! encoder into a finished schedule's gaps; here the stages make room for it as
//! they are scheduled. Under rendezvous its many encoder transfers between distant
//! ranks cost more than it gains.
//!
//! [`Woven`] is what the list scheduler ([`super::zb2p`]) consults: when the
//! first stage's input is ready, which encoder task a rank may take next, and what
//! each one costs and holds. Built empty (`encoders` other than `spread`), it offers
//! nothing and every input is ready at once, so the scheduler runs on its stages
//! alone.

use super::Ctx;
use crate::ir::plan::Task;
use crate::ir::program::Op;

/// Encoders woven into the schedule (`encoders = spread`). Each rank gets a quota
/// of encoder micro-batches up front by water-filling: micro-batch by micro-batch,
/// to the rank whose stage work plus encoder work so far is least (the lowest on
/// ties), so ranks with lighter stages take more of the encoder. The forwards are
/// then taken in micro-batch order by whichever rank with quota left has time:
/// first when the first stage is about to read the output, else when the rank has
/// no ready `B` or `F` (at most `p` micro-batches ahead of the first stage). A
/// trainable encoder's backward (`BW`) runs as weight-gradient work on the rank of
/// its forward (it reads the activations) once the first stage's `B` is done.
pub(super) struct Woven {
    /// Per encoder: unit id, forward and backward cost, activations, trainable.
    encs: Vec<(usize, f64, f64, f64, bool)>,
    /// Every encoder forward `(encoder index, mb)`, in micro-batch order, and the
    /// next one to take.
    forwards: Vec<(usize, usize)>,
    next: usize,
    /// Per rank: encoder micro-batches it may still take.
    quota: Vec<usize>,
    /// Per rank: forwards done whose backward is still to run.
    held: Vec<Vec<(usize, usize)>>,
    /// `f_end[e][mb]`: when encoder `e`'s forward of `mb` ends.
    f_end: Vec<Vec<Option<f64>>>,
    window: usize,
}

impl Woven {
    /// The encoders feeding the first stage woven into the schedule of `ctx`'s
    /// stages if `on` (else none), their costs in lockstep units with `lockstep`.
    pub(super) fn new(ctx: &Ctx, on: bool, lockstep: bool) -> Woven {
        let (p, m) = (ctx.ranks, ctx.microbatches);
        let s = ctx.stages.len();
        let home = |k: usize| ctx.units[ctx.stages[k]].home;
        let mine: Vec<Vec<usize>> = (0..p)
            .map(|r| (0..s).filter(|&k| home(k) == r).collect())
            .collect();
        let encs: Vec<(usize, f64, f64, f64, bool)> = if on {
            // In lockstep, an encoder task counts in units of one stage's forward.
            let unit = if lockstep {
                ctx.stages.iter().map(|&u| ctx.units[u].cost.f).sum::<f64>()
                    / ctx.stages.len() as f64
            } else {
                1.0
            };
            feeding(ctx)
                .into_iter()
                .map(|e| {
                    let u = &ctx.units[e];
                    let bw = if u.trainable {
                        u.cost.b + u.cost.w
                    } else {
                        0.0
                    };
                    (e, u.cost.f / unit, bw / unit, u.act, u.trainable)
                })
                .collect()
        } else {
            Vec::new()
        };
        // Water-filling on the real costs.
        let mut load: Vec<f64> = (0..p)
            .map(|r| {
                mine[r]
                    .iter()
                    .map(|&k| ctx.units[ctx.stages[k]].work())
                    .sum::<f64>()
                    * m as f64
            })
            .collect();
        let mut quota = vec![0usize; p];
        for &(e, ..) in &encs {
            let work = ctx.units[e].work();
            for _ in 0..m {
                let r = crate::algebra::units::least_loaded(&load);
                load[r] += work;
                quota[r] += 1;
            }
        }
        let forwards = (0..m)
            .flat_map(|mb| (0..encs.len()).map(move |i| (i, mb)))
            .collect();
        Woven {
            f_end: vec![vec![None; m]; encs.len()],
            encs,
            forwards,
            next: 0,
            quota,
            held: vec![Vec::new(); p],
            window: p,
        }
    }

    /// How many encoder tasks the schedule holds.
    pub(super) fn tasks(&self) -> usize {
        let m = self.f_end.first().map_or(0, Vec::len);
        self.encs.iter().map(|e| if e.4 { 2 * m } else { m }).sum()
    }

    /// When every spread encoder's output of `mb` is ready (`None`: not yet).
    pub(super) fn outputs(&self, mb: usize) -> Option<f64> {
        self.f_end
            .iter()
            .map(|ends| ends[mb])
            .try_fold(0.0f64, |a, x| x.map(|x| a.max(x)))
    }

    /// The next encoder forward rank `r` may take, and whether the first stage is
    /// about to read it (it has run `consumed` forwards): if the rank has quota
    /// left, the forward is within the window and its activations fit. The first
    /// stage's rank (`reader`) may always take one it is about to read, so the
    /// schedule never stalls on an encoder.
    pub(super) fn next_forward(
        &self,
        r: usize,
        reader: bool,
        consumed: usize,
        reserved: f64,
        room: f64,
    ) -> Option<(Task, bool)> {
        let &(i, mb) = self.forwards.get(self.next)?;
        let (e, .., act, trainable) = self.encs[i];
        let fits = !trainable || reserved == 0.0 || reserved + act <= room;
        let urgent = mb <= consumed;
        let may = self.quota[r] > 0 && mb < consumed + self.window && fits;
        (may || (reader && urgent)).then_some((Task::new(Op::F, e, mb), urgent))
    }

    /// Rank `r`'s encoder backward whose gradient is ready first: (ready, task).
    pub(super) fn next_backward(&self, r: usize, first_b: &[Option<f64>]) -> Option<(f64, Task)> {
        self.held[r]
            .iter()
            .filter_map(|&(i, mb)| first_b[mb].map(|t| (t, i, mb)))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)))
            .map(|(t, i, mb)| (t, Task::new(Op::BW, self.encs[i].0, mb)))
    }

    fn index(&self, unit: usize) -> Option<usize> {
        self.encs.iter().position(|e| e.0 == unit)
    }

    /// Activations one micro-batch of encoder `unit` holds (0 if frozen).
    pub(super) fn act(&self, unit: usize) -> f64 {
        self.index(unit)
            .map_or(0.0, |i| if self.encs[i].4 { self.encs[i].3 } else { 0.0 })
    }

    /// Records `task`, on rank `r` from `at`, if it is an encoder's: its end.
    pub(super) fn run(&mut self, r: usize, task: Task, at: f64) -> Option<f64> {
        let i = self.index(task.unit)?;
        let (_, f, bw, _, trainable) = self.encs[i];
        match task.op {
            Op::F => {
                self.next += 1;
                self.quota[r] = self.quota[r].saturating_sub(1);
                self.f_end[i][task.mb] = Some(at + f);
                if trainable {
                    self.held[r].push((i, task.mb));
                }
                Some(at + f)
            }
            _ => {
                self.held[r].retain(|&x| x != (i, task.mb));
                Some(at + bw)
            }
        }
    }
}

/// The encoders whose output the first stage reads (those `encoders = spread`
/// weaves into the schedule; others stay inline).
pub(crate) fn feeding(ctx: &Ctx) -> Vec<usize> {
    let first = &ctx.units[ctx.stages[0]];
    (0..ctx.units.len())
        .filter(|u| !ctx.stages.contains(u) && first.inputs.contains(&ctx.units[*u].name))
        .collect()
}
