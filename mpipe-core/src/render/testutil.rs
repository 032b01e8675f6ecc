//! Test fixtures for the renderers: hand-built programs, a minimal eager-mode
//! timer (so the tests do not depend on [`crate::judge::simulate`]), a greedy generator
//! of large schedules, and a tiny XML well-formedness checker.

use std::collections::BTreeMap;

use crate::ir::program::{
    Action, ActionRef, CollKind, Cost, Dir, Op, Program, Tensor, Unit, FORMAT,
};
use crate::judge::timeline::{Slot, Timeline};

pub(crate) fn unit(name: &str, inputs: &[&str], home: usize, cost: (f64, f64, f64)) -> Unit {
    Unit {
        role: crate::ir::program::Role::of_name(name),
        name: name.to_string(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        home,
        trainable: true,
        cost: Cost {
            f: cost.0,
            b: cost.1,
            w: cost.2,
        },
        act: 1.0,
        bytes: 0.0,
        params: 0.0,
    }
}

fn c(op: Op, u: &str, mb: usize) -> Action {
    Action::compute(op, u, mb)
}

fn send(t: Tensor, u: &str, mb: usize, peer: usize) -> Action {
    Action::p2p(Dir::Send, t, u, mb, peer, None)
}

fn recv(t: Tensor, u: &str, mb: usize, peer: usize) -> Action {
    Action::p2p(Dir::Recv, t, u, mb, peer, None)
}

/// 2 ranks, 2 micro-batches: an encoder `vision` and `llm.0` on rank 0, `llm.1` on
/// rank 1; F, B, W, BW and RF, four transfers, one broadcast.
pub(crate) fn small_program() -> Program {
    use Op::*;
    use Tensor::*;
    let bcast = Action::coll(crate::ir::program::CollKind::Bcast, "llm.0", 0, vec![0, 1]);
    let r0 = vec![
        bcast.clone(),
        c(F, "vision", 0),
        c(F, "llm.0", 0),
        send(Act, "llm.0", 0, 1),
        c(F, "vision", 1),
        c(F, "llm.0", 1),
        send(Act, "llm.0", 1, 1),
        recv(Grad, "llm.1", 0, 1),
        c(B, "llm.0", 0),
        c(W, "llm.0", 0),
        c(RF, "vision", 0),
        c(B, "vision", 0),
        c(W, "vision", 0),
        recv(Grad, "llm.1", 1, 1),
        c(BW, "llm.0", 1),
        c(BW, "vision", 1),
    ];
    let r1 = vec![
        bcast,
        recv(Act, "llm.0", 0, 0),
        c(F, "llm.1", 0),
        c(B, "llm.1", 0),
        send(Grad, "llm.1", 0, 0),
        recv(Act, "llm.0", 1, 0),
        c(F, "llm.1", 1),
        c(BW, "llm.1", 1),
        send(Grad, "llm.1", 1, 0),
        c(W, "llm.1", 0),
    ];
    Program {
        format: FORMAT.to_string(),
        ranks: 2,
        microbatches: 2,
        units: vec![
            unit("vision", &[], 0, (2.0, 2.0, 1.0)),
            unit("llm.0", &["vision"], 0, (1.0, 1.0, 1.0)),
            unit("llm.1", &["llm.0"], 1, (1.0, 1.0, 1.0)),
        ],
        programs: vec![r0, r1],
        source: None,
        prefetch: Vec::new(),
    }
}

/// Time a program under the eager semantics of docs/spec/program-format.md (transfers take
/// no time, collectives rendezvous). Panics on deadlock: fixtures are valid.
pub(crate) fn simulate_eager(p: &Program) -> Timeline {
    let n = p.programs.len();
    let mut idx = vec![0usize; n];
    let mut now = vec![0.0f64; n];
    let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); n];
    type P2pKey = (Tensor, String, usize, usize, usize);
    let mut sent: BTreeMap<P2pKey, f64> = BTreeMap::new();
    // (kind, unit, occurrence) -> arrival time per member.
    type CollKey = (CollKind, String, usize);
    let mut arrivals: BTreeMap<CollKey, BTreeMap<usize, f64>> = BTreeMap::new();
    let mut seen: Vec<BTreeMap<(CollKind, String), usize>> = vec![BTreeMap::new(); n];
    loop {
        let mut progress = false;
        for r in 0..n {
            while let Some(a) = p.programs[r].get(idx[r]) {
                match a.view() {
                    ActionRef::Compute(cr) => {
                        let u = p.unit_index(cr.unit).expect("known unit");
                        let d = cr.op.cost(&p.units[u].cost);
                        slots[r].push(Slot {
                            start: now[r],
                            end: now[r] + d,
                        });
                        now[r] += d;
                    }
                    ActionRef::P2p(x) if x.dir == Dir::Send => {
                        sent.insert((x.tensor, x.unit.to_string(), x.mb, r, x.peer), now[r]);
                        slots[r].push(Slot {
                            start: now[r],
                            end: now[r],
                        });
                    }
                    ActionRef::P2p(x) => {
                        let key = (x.tensor, x.unit.to_string(), x.mb, x.peer, r);
                        let Some(&t) = sent.get(&key) else { break };
                        let end = now[r].max(t);
                        slots[r].push(Slot { start: now[r], end });
                        now[r] = end;
                    }
                    ActionRef::Coll(cl) => {
                        let occ = *seen[r].get(&(cl.kind, cl.unit.to_string())).unwrap_or(&0);
                        let key = (cl.kind, cl.unit.to_string(), occ);
                        let arr = arrivals.entry(key).or_default();
                        arr.entry(r).or_insert(now[r]);
                        if !cl.group.iter().all(|m| arr.contains_key(m)) {
                            break;
                        }
                        let end = cl.group.iter().map(|m| arr[m]).fold(now[r], f64::max);
                        slots[r].push(Slot { start: now[r], end });
                        now[r] = end;
                        *seen[r].entry((cl.kind, cl.unit.to_string())).or_default() += 1;
                    }
                }
                idx[r] += 1;
                progress = true;
            }
        }
        if (0..n).all(|r| idx[r] == p.programs[r].len()) {
            return Timeline { ranks: slots };
        }
        assert!(progress, "fixture program deadlocks");
    }
}

/// A large realistic-looking schedule: a `vision` encoder on rank 0 (recomputed
/// before its backward) feeding `ranks * chunks` LLM chunks, placed interleaved
/// (`llm.k` on rank `k % ranks`) or in a V, scheduled by a greedy zero-bubble-like
/// list scheduler (backward first, forward while fewer than a limit are in flight,
/// weight gradients to fill bubbles; the last chunk uses a fused BW). Returns the
/// program and its eager timeline.
pub(crate) fn big_example(
    ranks: usize,
    mbs: usize,
    chunks: usize,
    interleaved: bool,
) -> (Program, Timeline) {
    let nl = ranks * chunks;
    let home = |k: usize| {
        // A V runs down the ranks on even legs and back up on odd ones.
        if interleaved || ((k / ranks) & 1) == 0 {
            k % ranks
        } else {
            ranks - 1 - k % ranks
        }
    };
    let mut units = vec![unit("vision", &[], 0, (0.6, 0.6, 0.3))];
    let names: Vec<String> = (0..nl).map(|k| format!("llm.{k}")).collect();
    for k in 0..nl {
        let input = if k == 0 {
            "vision".to_string()
        } else {
            names[k - 1].clone()
        };
        units.push(unit(&names[k], &[&input], home(k), (1.0, 1.0, 0.8)));
    }
    // Task = (op, unit index, mb); unit 0 is vision, unit k+1 is llm.k.
    let home_of = |u: usize| if u == 0 { 0 } else { home(u - 1) };
    let last = nl; // unit index of the last chunk
    let mut todo: Vec<Vec<(Op, usize, usize)>> = vec![Vec::new(); ranks];
    for m in 0..mbs {
        for u in 0..=nl {
            let ops: &[Op] = if u == 0 {
                &[Op::F, Op::RF, Op::B, Op::W]
            } else if u == last {
                &[Op::F, Op::BW]
            } else {
                &[Op::F, Op::B, Op::W]
            };
            for &op in ops {
                todo[home_of(u)].push((op, u, m));
            }
        }
    }
    let mut done: BTreeMap<(Op, usize, usize), f64> = BTreeMap::new();
    let bwd_end = |done: &BTreeMap<(Op, usize, usize), f64>, u: usize, m: usize| {
        done.get(&(Op::B, u, m))
            .or_else(|| done.get(&(Op::BW, u, m)))
            .copied()
    };
    // Dependencies of a task: (end time, producing rank, transfer) for each input.
    type Dep = (f64, usize, Option<(Tensor, usize)>);
    let deps = |done: &BTreeMap<(Op, usize, usize), f64>, (op, u, m): (Op, usize, usize)| {
        let mut out: Vec<Dep> = Vec::new();
        let need = |x: Option<f64>, from: usize, t: Option<(Tensor, usize)>, out: &mut Vec<Dep>| {
            x.map(|e| out.push((e, from, t)))
        };
        let ok = match op {
            Op::F if u == 0 => Some(()),
            Op::F => need(
                done.get(&(Op::F, u - 1, m)).copied(),
                home_of(u - 1),
                Some((Tensor::Act, u - 1)),
                &mut out,
            ),
            Op::RF => need(
                bwd_end(done, 1, m),
                home_of(1),
                Some((Tensor::Grad, 1)),
                &mut out,
            ),
            Op::B | Op::BW => {
                let f = if u == 0 { Op::RF } else { Op::F };
                let a = need(done.get(&(f, u, m)).copied(), home_of(u), None, &mut out);
                // The encoder's RF already waited for the gradient.
                let b = if u == last || u == 0 {
                    Some(())
                } else {
                    need(
                        bwd_end(done, u + 1, m),
                        home_of(u + 1),
                        Some((Tensor::Grad, u + 1)),
                        &mut out,
                    )
                };
                a.and(b)
            }
            Op::W => need(
                done.get(&(Op::B, u, m)).copied(),
                home_of(u),
                None,
                &mut out,
            ),
        };
        ok.map(|_| out)
    };
    let mut now = vec![0.0f64; ranks];
    let mut inflight = vec![0usize; ranks];
    let mut programs: Vec<Vec<Action>> = vec![Vec::new(); ranks];
    let mut slots: Vec<Vec<Slot>> = vec![Vec::new(); ranks];
    let uname = |u: usize| {
        if u == 0 {
            "vision".to_string()
        } else {
            names[u - 1].clone()
        }
    };
    while todo.iter().any(|t| !t.is_empty()) {
        // The globally earliest startable task, by (start, rank, priority).
        // (start, rank, priority key, index in the rank's to-do list)
        type Pick = (f64, usize, (usize, usize, usize), usize);
        let mut best: Option<Pick> = None;
        for r in 0..ranks {
            let limit = (ranks - r) * chunks;
            let ready: Vec<(f64, usize)> = todo[r]
                .iter()
                .enumerate()
                .filter_map(|(i, &task)| {
                    deps(&done, task).map(|d| (d.iter().map(|x| x.0).fold(now[r], f64::max), i))
                })
                .collect();
            let Some(start) = ready.iter().map(|x| x.0).reduce(f64::min) else {
                continue;
            };
            for &(t, i) in &ready {
                if t > start {
                    continue;
                }
                let (op, u, m) = todo[r][i];
                let class = match op {
                    Op::B | Op::BW | Op::RF => 0,
                    Op::F if inflight[r] < limit => 1,
                    Op::W => 2,
                    Op::F => 3,
                };
                let key = (class, m, nl - u);
                let better = match best {
                    None => true,
                    Some((bs, br, bk, _)) => (start, r, key) < (bs, br, bk),
                };
                if better {
                    best = Some((start, r, key, i));
                }
            }
        }
        let (start, r, _, i) = best.expect("generator is never stuck");
        let task @ (op, u, m) = todo[r].remove(i);
        for (end, from, tr) in deps(&done, task).expect("ready") {
            if let Some((tensor, tu)) = tr {
                if from != r {
                    let wait_end = now[r].max(end);
                    programs[r].push(recv(tensor, &uname(tu), m, from));
                    slots[r].push(Slot {
                        start: now[r],
                        end: wait_end,
                    });
                    now[r] = wait_end;
                }
            }
        }
        debug_assert!(now[r] <= start);
        let d = op.cost(&units[u].cost);
        programs[r].push(c(op, &uname(u), m));
        slots[r].push(Slot {
            start,
            end: start + d,
        });
        now[r] = start + d;
        done.insert(task, start + d);
        match op {
            Op::F if u > 0 => inflight[r] += 1,
            Op::B | Op::BW if u > 0 => inflight[r] -= 1,
            _ => {}
        }
        // Send what other ranks will need.
        let to = match op {
            Op::F if u < last => Some((Tensor::Act, home_of(u + 1))),
            Op::B | Op::BW if u > 0 => Some((Tensor::Grad, home_of(u - 1))),
            _ => None,
        };
        if let Some((tensor, peer)) = to {
            if peer != r {
                programs[r].push(send(tensor, &uname(u), m, peer));
                slots[r].push(Slot {
                    start: now[r],
                    end: now[r],
                });
            }
        }
    }
    let p = Program {
        format: FORMAT.to_string(),
        ranks,
        microbatches: mbs,
        units,
        programs,
        source: None,
        prefetch: Vec::new(),
    };
    (p, Timeline { ranks: slots })
}

/// A small XML well-formedness check: tags balance, attribute values are quoted,
/// and every `&` starts one of the five predefined entities or a character
/// reference. Returns the number of elements.
pub(crate) fn check_xml(s: &str) -> Result<usize, String> {
    fn check_amp(text: &str) -> Result<(), String> {
        let mut rest = text;
        while let Some(i) = rest.find('&') {
            rest = &rest[i + 1..];
            let end = rest.find(';').ok_or("unterminated entity")?;
            let name = &rest[..end];
            let ok = matches!(name, "amp" | "lt" | "gt" | "quot" | "apos")
                || (name.starts_with('#') && name.len() > 1);
            if !ok {
                return Err(format!("bad entity &{name};"));
            }
        }
        Ok(())
    }
    let mut stack: Vec<String> = Vec::new();
    let mut elements = 0;
    let mut rest = s.trim_start();
    if let Some(r) = rest.strip_prefix("<?xml") {
        rest = &r[r.find("?>").ok_or("unterminated declaration")? + 2..];
    }
    let mut root_done = false;
    while !rest.is_empty() {
        let lt = rest.find('<').unwrap_or(rest.len());
        let text = &rest[..lt];
        if text.contains('>') {
            return Err(format!("stray '>' in text {text:?}"));
        }
        check_amp(text)?;
        if (stack.is_empty()) && !text.trim().is_empty() {
            return Err("text outside the root element".into());
        }
        rest = &rest[lt..];
        if rest.is_empty() {
            break;
        }
        if let Some(r) = rest.strip_prefix("<!--") {
            rest = &r[r.find("-->").ok_or("unterminated comment")? + 3..];
            continue;
        }
        // Find the end of the tag, skipping quoted attribute values.
        let bytes = rest.as_bytes();
        let mut i = 1;
        let mut quote: Option<u8> = None;
        while i < bytes.len() {
            match (quote, bytes[i]) {
                (None, b'>') => break,
                (None, q @ (b'"' | b'\'')) => quote = Some(q),
                (Some(q), b) if b == q => quote = None,
                (Some(_), b'<') => return Err("'<' in attribute value".into()),
                (None, b'<') => return Err("'<' inside tag".into()),
                _ => {}
            }
            i += 1;
        }
        if i >= bytes.len() {
            return Err("unterminated tag".into());
        }
        let tag = &rest[1..i];
        rest = &rest[i + 1..];
        check_amp(tag)?;
        if let Some(name) = tag.strip_prefix('/') {
            let open = stack.pop().ok_or(format!("unmatched </{name}>"))?;
            if open != name.trim() {
                return Err(format!("<{open}> closed by </{name}>"));
            }
            if stack.is_empty() {
                root_done = true;
            }
            continue;
        }
        if root_done {
            return Err("second root element".into());
        }
        let self_closing = tag.ends_with('/');
        let body = tag.trim_end_matches('/');
        let name = body
            .split_whitespace()
            .next()
            .ok_or("empty tag")?
            .to_string();
        // Attributes: name="value" pairs.
        let mut attrs = body[name.len()..].trim();
        let mut names: Vec<&str> = Vec::new();
        while !attrs.is_empty() {
            let eq = attrs
                .find('=')
                .ok_or(format!("attribute without value in <{name}>"))?;
            let an = attrs[..eq].trim();
            if an.is_empty() || an.contains(char::is_whitespace) || names.contains(&an) {
                return Err(format!("bad or repeated attribute {an:?} in <{name}>"));
            }
            names.push(an);
            let v = attrs[eq + 1..].trim_start();
            let q = v.chars().next().ok_or("missing value")?;
            if q != '"' && q != '\'' {
                return Err(format!("unquoted attribute {an} in <{name}>"));
            }
            let close = v[1..].find(q).ok_or("unterminated value")?;
            attrs = v[close + 2..].trim_start();
        }
        elements += 1;
        if !self_closing {
            stack.push(name);
        } else if stack.is_empty() {
            root_done = true;
        }
    }
    if let Some(open) = stack.pop() {
        return Err(format!("<{open}> never closed"));
    }
    if !root_done {
        return Err("no root element".into());
    }
    Ok(elements)
}

#[test]
fn render_fixtures_time_as_expected() {
    let p = small_program();
    let t = simulate_eager(&p);
    assert_eq!(t.makespan(), 18.0);
    assert_eq!(
        t.ranks[1][1],
        Slot {
            start: 0.0,
            end: 3.0
        }
    );
    let (p, t) = big_example(4, 8, 2, true);
    // The generator's own timeline is the eager timeline of the program it wrote.
    assert_eq!(simulate_eager(&p), t);
    assert!(check_xml("<a x=\"1 &amp; 2\"><b/>t&lt;</a>").is_ok());
    assert!(check_xml("<a><b></a>").is_err());
    assert!(check_xml("<a>x & y</a>").is_err());
    assert!(check_xml("<a t=\"<\"/>").is_err());
}
