//! How the renderers see a program's units (the classification the floor's
//! documentation describes), and number formatting both renderers share.

use std::collections::BTreeMap;

use crate::ir::program::{Action, Program, Role, Unit};
use crate::judge::timeline::{Slot, Timeline};

/// How the renderers see one unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UnitLook {
    /// An encoder: no inputs, not named `llm.*`.
    pub encoder: bool,
    /// Index of this unit among the `llm.*` units of its home rank (0 otherwise).
    pub chunk: usize,
    /// Number of `llm.*` units on its home rank (1 otherwise).
    pub chunks: usize,
}

impl UnitLook {
    /// The look of a unit the program does not declare.
    pub(crate) const UNKNOWN: UnitLook = UnitLook {
        encoder: false,
        chunk: 0,
        chunks: 1,
    };
}

/// Which units are encoders: not LLM stages, and reading only the raw micro-batch
/// or other encoders (declared before them).
pub(crate) fn encoders(units: &[Unit]) -> Vec<bool> {
    let mut out: Vec<bool> = Vec::with_capacity(units.len());
    for u in units {
        let upstream = u
            .inputs
            .iter()
            .all(|x| units.iter().zip(&out).any(|(v, &enc)| enc && v.name == *x));
        out.push(upstream && !u.role.is_stage());
    }
    out
}

/// The look of every declared unit, by name.
pub(crate) fn unit_looks(p: &Program) -> BTreeMap<&str, UnitLook> {
    // Stages grouped by home rank, ordered by their stage number.
    let mut groups: BTreeMap<usize, Vec<(Option<usize>, usize)>> = BTreeMap::new();
    for (i, u) in p.units.iter().enumerate() {
        if let Role::Stage(k) = u.role {
            groups.entry(u.home).or_default().push((Some(k), i));
        }
    }
    let mut chunk_of: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for members in groups.values_mut() {
        members.sort_by_key(|&(k, i)| (k.is_none(), k, i));
        let n = members.len();
        for (c, &(_, i)) in members.iter().enumerate() {
            chunk_of.insert(i, (c, n));
        }
    }
    let mut looks = BTreeMap::new();
    let encoder = encoders(&p.units);
    for (i, u) in p.units.iter().enumerate() {
        let (chunk, chunks) = chunk_of.get(&i).copied().unwrap_or((0, 1));
        looks.entry(u.name.as_str()).or_insert(UnitLook {
            encoder: encoder[i],
            chunk,
            chunks,
        });
    }
    looks
}

/// Every action that has a slot, with its rank, in rank order then list order.
pub(crate) fn placed<'a>(
    p: &'a Program,
    t: &'a Timeline,
) -> impl Iterator<Item = (usize, &'a Action, Slot)> + 'a {
    p.programs.iter().enumerate().flat_map(move |(r, list)| {
        let slots: &[Slot] = t.ranks.get(r).map(Vec::as_slice).unwrap_or(&[]);
        list.iter().zip(slots.iter()).map(move |(a, s)| (r, a, *s))
    })
}

/// `x` with at most `decimals` decimals, trailing zeros dropped (`1.50` -> `1.5`,
/// `2.000` -> `2`); non-finite numbers print as `0`.
pub(crate) fn fmt_num(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return "0".to_string();
    }
    let mut s = format!("{x:.decimals$}");
    if s.contains('.') {
        while s.ends_with('0') {
            s.pop();
        }
        if s.ends_with('.') {
            s.pop();
        }
    }
    if s == "-0" {
        s = "0".to_string();
    }
    s
}
