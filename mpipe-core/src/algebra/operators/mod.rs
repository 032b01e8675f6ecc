//! Operators: functions from plan to plan. Composition is function composition, so
//! `transpose(vision, split_w(zbv))` needs no special case.

pub mod chain;
pub mod fill;
mod fill_layers;
pub mod host;
pub mod layers;
pub mod prefetch;
pub mod split_w;
pub mod transpose;

use crate::ir::plan::Task;

/// Insert `(position, task)` pairs into `list`; each position refers to the list as
/// it was (several tasks at one position keep their given order).
pub(crate) fn insert_all(list: &mut Vec<Task>, items: Vec<(usize, Task)>) {
    if items.is_empty() {
        return;
    }
    *list = inserted(list, items);
}

/// `list` with `(position, task)` pairs inserted as [`insert_all`] inserts them, as
/// a new list of just its length: the runs between positions copied whole.
pub(crate) fn inserted(list: &[Task], mut items: Vec<(usize, Task)>) -> Vec<Task> {
    items.sort_by_key(|&(pos, _)| pos);
    let mut out = Vec::with_capacity(list.len() + items.len());
    let mut from = 0;
    for (pos, t) in items {
        // Sorted: never before the run copied so far.
        let to = pos.clamp(from, list.len());
        out.extend_from_slice(&list[from..to]);
        out.push(t);
        from = to;
    }
    out.extend_from_slice(&list[from..]);
    out
}
