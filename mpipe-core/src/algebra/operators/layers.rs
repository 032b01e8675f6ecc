//! `layers(SCHEDULE)`: every stage, chunk and encoder computed layer by layer, in the
//! schedule's own order.
//!
//! Each unit that holds several layers of the model (an LLM stage, an encoder, a
//! chained encoder's chunk) becomes one unit per layer, homed where it was, and each
//! of its tasks becomes that task's run over the layers: forwards (`F`, `RF`) and
//! weight gradients (`W`) first layer first, input gradients (`B`, `BW`) last layer
//! first. Nothing moves between ranks and no rank's order changes beyond that, so the
//! ideal (communication-free) step is the schedule's own, to the last digit.
//!
//! What it buys is room for transfers to meet. Under rendezvous a send waits until its
//! receiver posts the receive, and both can only do so between two tasks; with a
//! stage's four layers as four tasks there are four times as many such points, and the
//! lowering ([`crate::algebra::lower`]) finds meeting points at which neither rank waits long.
//! On the evaluation profiles this cuts the rendezvous step of `auto`'s choice by 0.7
//! to 5.8% (`auto` tries it on its finalists).
//!
//! Units are named by model layer: `llm/12` is the LLM's layer 12, `vision/5` the
//! vision encoder's layer 5, whatever the stage split; the profile's stage extras are
//! units of their own, `llm/first_stage_extra` (the embedding) before layer 0 and
//! `llm/last_stage_extra` (the LM head and loss) after the last layer. The LLM's stages, and each encoder's units, are cut all
//! or none: none when one of them is prefetched (`prefetch`: its pieces would read the
//! next step's copies of each other) or has costs that are not its layers' (a plan
//! built elsewhere), so one part's units are either all stages or all layers.

use crate::algebra::profile::{EncoderProfile, Extra, Profile};
use crate::ir::compare::close;
use crate::ir::plan::{InputShip, Plan, Task, UnitId};
use crate::ir::program::{Cost, Op, Role, Unit};

/// The per-layer units of one unit: their names, costs and sizes.
struct Pieces {
    names: Vec<String>,
    layers: Vec<Layer>,
}

/// One layer's share of a unit.
#[derive(Clone, Copy)]
struct Layer {
    cost: Cost,
    act: f64,
    params: f64,
    bytes: f64,
}

/// `plan` with every multi-layer unit cut into its layers (see the module doc).
pub fn layers(plan: Plan, profile: &Profile) -> Plan {
    let cut = pieces_of(&plan, profile);
    if cut.iter().all(Option::is_none) {
        return plan;
    }
    apply(&plan, cut).0
}

/// `plan` with one whole encoder, unit `enc`, cut into its layers (`vision/0`,
/// `vision/1`, ...), and the pieces' ids, first layer first. Everything else stays
/// as it is, prefetched or not. `None` when `enc` is not a whole encoder of the
/// profile, has a single layer, or has costs that are not its layers'.
///
/// For `prefetch`, which places a frozen encoder's forwards layer by layer: a
/// prefetched piece reads the piece before it from the same step (see
/// [`Plan::prefetch`]).
pub fn cut_encoder(plan: &Plan, profile: &Profile, enc: UnitId) -> Option<(Plan, Vec<UnitId>)> {
    let unit = plan.units.get(enc)?;
    let spec = profile.encoders.iter().find(|e| e.name == unit.name)?;
    let per_layer = encoder_layer(spec);
    let count = layer_count(unit.cost.f, spec.forward);
    if count < 2 || !matches(unit, &vec![per_layer; count]) {
        return None;
    }
    let mut cut: Vec<Option<Pieces>> = (0..plan.units.len()).map(|_| None).collect();
    cut[enc] = Some(Pieces {
        names: (0..count).map(|j| format!("{}/{j}", spec.name)).collect(),
        layers: vec![per_layer; count],
    });
    let (out, first) = apply(plan, cut);
    Some((out, (first[enc]..first[enc] + count).collect()))
}

/// The inverse of [`cut_encoder`]: `plan` with the layers `NAME/0`, `NAME/1`, ...
/// of encoder `name` (as `fill` or `prefetch` cut it) joined into one unit `name`
/// again, and its id. Each joined task takes the place of the layer task that runs
/// first (the first layer's for `F`, `RF` and `W`, the last layer's for `B` and
/// `BW`). `None` if there are no such layers, or a task's layers are not all on one
/// rank (then they cannot be one task).
///
/// An operator on an encoder whose body cut it (`prefetch(vision, fill(vision,
/// zbv))`) places it whole from there, as it would over a body that kept it whole.
pub fn join_encoder(plan: &Plan, name: &str) -> Option<(Plan, UnitId)> {
    let first = plan.unit_id(&format!("{name}/0"))?;
    let mut count = 1;
    while plan
        .units
        .get(first + count)
        .is_some_and(|u| u.name == format!("{name}/{count}"))
    {
        count += 1;
    }
    let pieces = first..first + count;
    let last = first + count - 1;
    let new_id = |u: UnitId| {
        if u < first {
            u
        } else if u <= last {
            first
        } else {
            u - (count - 1)
        }
    };
    // Every (op, mb) of the layers on one rank.
    let mut rank_of = std::collections::BTreeMap::new();
    for (r, list) in plan.order.iter().enumerate() {
        for t in list.iter().filter(|t| pieces.contains(&t.unit)) {
            if *rank_of.entry((t.op as u8, t.mb)).or_insert(r) != r {
                return None;
            }
        }
    }
    let layers = &plan.units[first..=last];
    let sum = |f: &dyn Fn(&Unit) -> f64| layers.iter().map(f).sum::<f64>();
    let joined = Unit {
        name: name.to_string(),
        inputs: layers[0].inputs.clone(),
        home: layers[0].home,
        trainable: layers[0].trainable,
        cost: Cost {
            f: sum(&|u| u.cost.f),
            b: sum(&|u| u.cost.b),
            w: sum(&|u| u.cost.w),
        },
        act: sum(&|u| u.act),
        bytes: layers[count - 1].bytes,
        params: sum(&|u| u.params),
        role: Role::Encoder,
    };
    let last_name = &plan.units[last].name;
    let mut units: Vec<Unit> = Vec::with_capacity(plan.units.len() - count + 1);
    for (u, unit) in plan.units.iter().enumerate() {
        if u == first {
            units.push(joined.clone());
        } else if !pieces.contains(&u) {
            let mut unit = unit.clone();
            for input in &mut unit.inputs {
                if input == last_name {
                    *input = name.to_string();
                }
            }
            units.push(unit);
        }
    }
    // The layer task that runs first stands for the whole.
    let keeps = |t: &Task| match t.op {
        Op::F | Op::RF | Op::W => t.unit == first,
        Op::B | Op::BW => t.unit == last,
    };
    let order = plan
        .order
        .iter()
        .map(|list| {
            list.iter()
                .filter(|t| !pieces.contains(&t.unit) || keeps(t))
                .map(|t| Task::new(t.op, new_id(t.unit), t.mb))
                .collect()
        })
        .collect();
    let mut prefetch: Vec<(UnitId, usize)> = plan
        .prefetch
        .iter()
        .map(|&(u, mb)| (new_id(u), mb))
        .collect();
    prefetch.sort_unstable();
    prefetch.dedup();
    let remap = |ids: &[UnitId]| {
        let mut out: Vec<UnitId> = ids.iter().map(|&u| new_id(u)).collect();
        out.dedup();
        out
    };
    let out = Plan {
        ranks: plan.ranks,
        microbatches: plan.microbatches,
        stages: remap(&plan.stages),
        encoders: remap(&plan.encoders),
        order,
        input_ships: plan
            .input_ships
            .iter()
            .map(|s| InputShip {
                unit: new_id(s.unit),
                ..*s
            })
            .collect(),
        prefetch,
        memory_limit: plan.memory_limit,
        units,
    };
    Some((out, first))
}

/// `plan` with the units `cut` gives pieces for cut into them, and each old unit's
/// first new id.
fn apply(plan: &Plan, cut: Vec<Option<Pieces>>) -> (Plan, Vec<UnitId>) {
    // New unit ids: each old unit's first piece, and its piece count.
    let mut first = Vec::with_capacity(plan.units.len());
    let mut count = Vec::with_capacity(plan.units.len());
    let mut units: Vec<Unit> = Vec::new();
    let names = plan.unit_names();
    let last_name = |u: UnitId, units: &[Unit], first: &[usize], count: &[usize]| {
        units[first[u] + count[u] - 1].name.clone()
    };
    for (u, unit) in plan.units.iter().enumerate() {
        // Inputs are earlier units (topological order), already renamed.
        let inputs: Vec<String> = unit
            .inputs
            .iter()
            .map(|n| match names.id(n) {
                Some(i) if i < u => last_name(i, &units, &first, &count),
                _ => n.clone(),
            })
            .collect();
        first.push(units.len());
        match &cut[u] {
            None => {
                count.push(1);
                units.push(Unit {
                    inputs,
                    ..unit.clone()
                });
            }
            Some(p) => {
                count.push(p.layers.len());
                // A stage's pieces are stage layers, an encoder's (or a chunk's) its
                // layers.
                let role = match unit.role.encoder(&unit.name) {
                    None => Role::StageLayer,
                    Some(of) => Role::EncoderLayer(of.to_string()),
                };
                for (k, (l, name)) in p.layers.iter().zip(&p.names).enumerate() {
                    let name = name.clone();
                    let inputs = if k == 0 {
                        inputs.clone()
                    } else {
                        vec![units.last().map(|x| x.name.clone()).unwrap_or_default()]
                    };
                    units.push(Unit {
                        name,
                        inputs,
                        home: unit.home,
                        trainable: unit.trainable,
                        cost: l.cost,
                        act: l.act,
                        bytes: l.bytes,
                        params: l.params,
                        role: role.clone(),
                    });
                }
            }
        }
    }
    let expand = |t: &Task, out: &mut Vec<Task>| {
        let (f, n) = (first[t.unit], count[t.unit]);
        match t.op {
            Op::F | Op::RF | Op::W => out.extend((0..n).map(|k| Task::new(t.op, f + k, t.mb))),
            Op::B | Op::BW => out.extend((0..n).rev().map(|k| Task::new(t.op, f + k, t.mb))),
        }
    };
    let order = plan
        .order
        .iter()
        .map(|list| {
            let mut out = Vec::with_capacity(list.len() * 2);
            for t in list {
                expand(t, &mut out);
            }
            out
        })
        .collect();
    let all = |u: UnitId| first[u]..first[u] + count[u];
    let out = Plan {
        ranks: plan.ranks,
        microbatches: plan.microbatches,
        stages: plan.stages.iter().flat_map(|&s| all(s)).collect(),
        encoders: plan.encoders.iter().flat_map(|&e| all(e)).collect(),
        order,
        // The raw input is read by a unit's first layer.
        input_ships: plan
            .input_ships
            .iter()
            .map(|s| InputShip {
                unit: first[s.unit],
                ..*s
            })
            .collect(),
        // A cut prefetched unit's pieces are all prefetched.
        prefetch: {
            let mut p: Vec<(UnitId, usize)> = plan
                .prefetch
                .iter()
                .flat_map(|&(u, mb)| all(u).map(move |x| (x, mb)))
                .collect();
            p.sort_unstable();
            p
        },
        memory_limit: plan.memory_limit,
        units,
    };
    (out, first)
}

/// How each unit of `plan` is cut (`None`: kept whole).
fn pieces_of(plan: &Plan, profile: &Profile) -> Vec<Option<Pieces>> {
    let mut out: Vec<Option<Pieces>> = (0..plan.units.len()).map(|_| None).collect();
    let prefetched = |u: UnitId| plan.prefetch.iter().any(|&(x, _)| x == u);
    // LLM stages, in pipeline order: the first carries the embedding, the last the head.
    let llm = &profile.llm;
    let per_layer = Layer {
        cost: Cost {
            f: llm.forward,
            b: llm.backward,
            w: llm.weight,
        },
        act: llm.activation,
        params: llm.params,
        bytes: llm.output,
    };
    let n = plan.stages.len();
    let mut next_layer = 0usize;
    let mut llm_parts = Vec::with_capacity(n);
    for (k, &s) in plan.stages.iter().enumerate() {
        let unit = &plan.units[s];
        let head = (k == 0).then_some(llm.first_stage_extra.as_ref()).flatten();
        let tail = (k + 1 == n)
            .then_some(llm.last_stage_extra.as_ref())
            .flatten();
        let extra_f = head.map_or(0.0, |x| x.forward) + tail.map_or(0.0, |x| x.forward);
        let count = layer_count(unit.cost.f - extra_f, llm.forward);
        let mut names: Vec<String> = Vec::with_capacity(count + 2);
        let mut layers = Vec::with_capacity(count + 2);
        if let Some(x) = head {
            names.push("llm/first_stage_extra".into());
            layers.push(extra(x, llm.output));
        }
        for j in 0..count {
            names.push(format!("llm/{}", next_layer + j));
            layers.push(per_layer);
        }
        if let Some(x) = tail {
            names.push("llm/last_stage_extra".into());
            layers.push(extra(x, llm.output));
        }
        next_layer += count;
        llm_parts.push((s, Pieces { names, layers }));
    }
    settle(&mut out, llm_parts, plan, &prefetched);
    // Encoders, whole (`vision`) or chained chunks (`vision.0`, `vision.1`, .. in data
    // order).
    for spec in &profile.encoders {
        let per_layer = encoder_layer(spec);
        // The encoder whole, or its chunks, which the units list in data order.
        let parts: Vec<UnitId> = (0..plan.units.len())
            .filter(|&u| {
                let x = &plan.units[u];
                match &x.role {
                    Role::Encoder => x.name == spec.name,
                    Role::EncoderChunk(of) => *of == spec.name,
                    _ => false,
                }
            })
            .collect();
        let mut next_layer = 0usize;
        let mut enc_parts = Vec::with_capacity(parts.len());
        for u in parts {
            let count = layer_count(plan.units[u].cost.f, spec.forward);
            let names = (0..count)
                .map(|j| format!("{}/{}", spec.name, next_layer + j))
                .collect();
            next_layer += count;
            enc_parts.push((
                u,
                Pieces {
                    names,
                    layers: vec![per_layer; count],
                },
            ));
        }
        settle(&mut out, enc_parts, plan, &prefetched);
    }
    out
}

/// Cut the units of one model part (the LLM's stages, or one encoder's units) into
/// `parts`, all or none: all when every unit adds up to its layers and none is
/// prefetched, so that one part's units are either all `part.K` or all `part/N`.
fn settle(
    out: &mut [Option<Pieces>],
    parts: Vec<(UnitId, Pieces)>,
    plan: &Plan,
    prefetched: &dyn Fn(UnitId) -> bool,
) {
    let whole = |(u, p): &(UnitId, Pieces)| {
        p.layers.is_empty() || prefetched(*u) || !matches(&plan.units[*u], &p.layers)
    };
    if parts.iter().any(whole) {
        return;
    }
    for (u, p) in parts {
        out[u] = Some(p);
    }
}

/// One layer of encoder `spec` (its parameters split evenly over its layers).
fn encoder_layer(spec: &EncoderProfile) -> Layer {
    Layer {
        cost: Cost {
            f: spec.forward,
            b: spec.backward,
            w: spec.weight.unwrap_or(0.0),
        },
        act: spec.activation,
        params: spec.params / f64::from(spec.layers.max(1)),
        bytes: spec.output,
    }
}

/// How many layers of forward time `per` make up `forward` (0 when `per` is 0).
fn layer_count(forward: f64, per: f64) -> usize {
    if per > 0.0 && forward.is_finite() && forward > 0.0 {
        (forward / per).round() as usize
    } else {
        0
    }
}

/// A stage extra as a unit of its own (it passes on the LLM's hidden state).
fn extra(x: &Extra, bytes: f64) -> Layer {
    Layer {
        cost: Cost {
            f: x.forward,
            b: x.backward,
            w: x.weight,
        },
        act: x.activation,
        params: x.params,
        bytes,
    }
}

/// Whether `layers` add up to `unit` (costs, activations, parameters), to rounding.
fn matches(unit: &Unit, layers: &[Layer]) -> bool {
    let sum = |f: &dyn Fn(&Layer) -> f64| layers.iter().map(f).sum::<f64>();
    close(sum(&|l| l.cost.f), unit.cost.f)
        && close(sum(&|l| l.cost.b), unit.cost.b)
        && close(sum(&|l| l.cost.w), unit.cost.w)
        && close(sum(&|l| l.act), unit.act)
        && close(sum(&|l| l.params), unit.params)
}
