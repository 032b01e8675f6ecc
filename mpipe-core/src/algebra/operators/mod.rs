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
pub(crate) fn insert_all(list: &mut Vec<Task>, mut items: Vec<(usize, Task)>) {
    if items.is_empty() {
        return;
    }
    items.sort_by_key(|&(pos, _)| pos);
    let mut out = Vec::with_capacity(list.len() + items.len());
    let mut it = items.into_iter().peekable();
    for (i, t) in list.drain(..).enumerate() {
        while let Some((_, x)) = it.next_if(|&(pos, _)| pos <= i) {
            out.push(x);
        }
        out.push(t);
    }
    out.extend(it.map(|(_, x)| x));
    *list = out;
}
