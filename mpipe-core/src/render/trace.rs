//! The timeline as a Chrome / Perfetto trace (the JSON trace-event format), for
//! `chrome://tracing` or <https://ui.perfetto.dev>.
//!
//! [`chrome_trace`] returns `{"traceEvents":[...],"displayTimeUnit":"ms"}` with:
//! - metadata events (`"ph":"M"`): the process name (`opts.name`, default
//!   `mpipe`) and, for every rank `r`, a thread `tid = r` named `rank r` with
//!   `thread_sort_index` `r`, so ranks are listed in order;
//! - one complete event (`"ph":"X"`) for **every** action that has a slot, in rank
//!   order then list order. Transfers and collectives that did not wait are kept,
//!   with `dur` 0, so the event count is the action count and flows have anchors.
//!   - compute: name `F llm.0 mb3`, cat `compute`, args `{op, unit, mb}` (plus
//!     `chunk` when the unit is one of several chunks on its rank, and
//!     `encoder: true` for encoders);
//!   - transfer: name `SEND act llm.0 mb3 -> 1` / `RECV act llm.0 mb3 <- 0`, cat
//!     `p2p`, args `{op, tensor, unit, mb, peer}` (plus `batch` when set);
//!   - collective: name `BCAST llm.0 root 0` / `REDUCE llm.0 root 0`, cat
//!     `collective`, args `{op, unit, root, group}`;
//! - when `opts.flows`, one flow (`"ph":"s"` on the sender, `"ph":"f"` with
//!   `"bp":"e"` on the receiver, same `id`) from each `SEND` to its matching
//!   `RECV` (same tensor, unit, micro-batch and rank pair; k-th send to k-th
//!   receive), anchored at the middle of each slot. Unmatched transfers get none.
//!
//! - when `opts.memory`, a counter track per rank (`"ph":"C"`, name `memory rank
//!   r`, args `{activations}`) with a sample at 0 and wherever the rank's
//!   activation memory changes ([`memory_curves`]; none when the program cannot
//!   be simulated), drawn by Perfetto as a step chart under the ranks.
//!
//! - when `opts.embed_program`, a top-level key `"mpipe": {"program": ...,
//!   "time_scale": ...}` with the program and `opts.time_scale` (the trace-event
//!   format keeps other top-level keys as metadata; viewers ignore it).
//!
//! [`timeline_from_trace`] reads such a trace back (any trace whose complete events
//! carry these names, one per action): the k-th event of a name on a rank's track
//! is the slot of the k-th action of that name on the rank. The readers live in
//! [`super::trace_read`] (re-exported here) and read a stream in memory bounded by
//! the program, not by the trace.
//!
//! `ts` and `dur` are in microseconds: time units times `opts.time_scale`, rounded
//! to 0.001 µs. The output is compact JSON, one event per line, byte-identical for
//! identical inputs.

use std::io::{self, Write};

use serde_json::{json, Map, Value};

use super::look::{placed, unit_looks, UnitLook};
use super::trace_read::event_name;
pub use super::trace_read::{
    embedded_program, embedded_program_from_reader, timeline_from_trace,
    timeline_from_trace_reader, TraceReadError,
};
use crate::ir::program::{narrow, ActionRef, CollKind, Dir, Program, Tensor};
use crate::judge::simulate::memory_curves;
use crate::judge::timeline::Timeline;

/// What to call the trace and how to scale its times.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceOptions {
    /// Process name (default `mpipe`).
    pub name: Option<String>,
    /// Microseconds per time unit of the timeline (default 1000: time units are ms).
    pub time_scale: f64,
    /// Emit flow arrows from each `SEND` to its `RECV` (default true).
    pub flows: bool,
    /// Emit each rank's activation memory as a counter track (default true).
    pub memory: bool,
    /// Embed the program under the top-level key `mpipe` (default false), so that
    /// the trace alone can be read back ([`embedded_program`], and `mpipe calibrate`).
    pub embed_program: bool,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            name: None,
            time_scale: 1000.0,
            flows: true,
            memory: true,
            embed_program: false,
        }
    }
}

/// The process id every event carries.
const PID: u64 = 1;

/// Render timeline `t` of program `p` as a Chrome trace (see the module
/// documentation for the events it contains). [`write_chrome_trace`] writes the same
/// bytes to a stream.
pub fn chrome_trace(p: &Program, t: &Timeline, opts: &TraceOptions) -> String {
    let mut out = Vec::new();
    write_chrome_trace(p, t, opts, &mut out).expect("writing to memory does not fail");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// Writes events one by one, separated as [`chrome_trace`]'s list.
struct Events<'w, W: Write> {
    w: &'w mut W,
    first: bool,
}

impl<W: Write> Events<'_, W> {
    fn emit(&mut self, e: Value) -> io::Result<()> {
        if !self.first {
            self.w.write_all(b",\n")?;
        }
        self.first = false;
        serde_json::to_writer(&mut *self.w, &e).map_err(io::Error::from)
    }
}

/// [`chrome_trace`] written to `w` event by event: memory is bounded by the program
/// and the pairing of transfers, not by the trace's size (wrap a file in a
/// `BufWriter`).
pub fn write_chrome_trace<W: Write>(
    p: &Program,
    t: &Timeline,
    opts: &TraceOptions,
    w: &mut W,
) -> io::Result<()> {
    let scale = if opts.time_scale.is_finite() && opts.time_scale > 0.0 {
        opts.time_scale
    } else {
        1000.0
    };
    let us = |x: f64| -> Value {
        let v = (x * scale * 1000.0).round() / 1000.0;
        if v.is_finite() {
            json!(v)
        } else {
            json!(0.0)
        }
    };
    let looks = unit_looks(p);
    let look_of = |u: &str| looks.get(u).copied().unwrap_or(UnitLook::UNKNOWN);
    let nrows = p.ranks.max(p.programs.len());

    w.write_all(b"{\"traceEvents\":[\n")?;
    let mut events = Events { w, first: true };
    let name = opts.name.as_deref().unwrap_or("mpipe");
    events.emit(
        json!({"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
                       "args": {"name": name}}),
    )?;
    for r in 0..nrows {
        events.emit(
            json!({"ph": "M", "pid": PID, "tid": r, "name": "thread_name",
                           "args": {"name": format!("rank {r}")}}),
        )?;
        events.emit(
            json!({"ph": "M", "pid": PID, "tid": r, "name": "thread_sort_index",
                           "args": {"sort_index": r}}),
        )?;
    }

    // For the flows: the transfers' unit names, numbered, and how many transfer
    // ends each (unit, tensor) has, so that the ends are then gathered a share at a
    // time ([`write_flows`]).
    let mut names = NameIds::default();
    let mut ends: Vec<usize> = Vec::new();

    for (r, a, s) in placed(p, t) {
        let (name, cat, args) = match a.view() {
            ActionRef::Compute(c) => {
                let look = look_of(c.unit);
                let mut args = Map::new();
                args.insert("op".into(), json!(c.op.as_str()));
                args.insert("unit".into(), json!(c.unit));
                args.insert("mb".into(), json!(c.mb));
                if look.chunks > 1 {
                    args.insert("chunk".into(), json!(look.chunk));
                }
                if look.encoder {
                    args.insert("encoder".into(), json!(true));
                }
                (event_name(a), "compute", args)
            }
            ActionRef::P2p(x) => {
                let op = match x.dir {
                    Dir::Send => "SEND",
                    Dir::Recv => "RECV",
                };
                let mut args = Map::new();
                args.insert("op".into(), json!(op));
                args.insert("tensor".into(), json!(x.tensor.as_str()));
                args.insert("unit".into(), json!(x.unit));
                args.insert("mb".into(), json!(x.mb));
                args.insert("peer".into(), json!(x.peer));
                if let Some(b) = x.batch {
                    args.insert("batch".into(), json!(b));
                }
                if opts.flows {
                    let g = group(names.id(x.unit), x.tensor);
                    if ends.len() <= g {
                        ends.resize(g + 1, 0);
                    }
                    ends[g] += 1;
                }
                (event_name(a), "p2p", args)
            }
            ActionRef::Coll(c) => {
                let op = match c.kind {
                    CollKind::Bcast => "BCAST",
                    CollKind::Reduce => "REDUCE",
                };
                let mut args = Map::new();
                args.insert("op".into(), json!(op));
                args.insert("unit".into(), json!(c.unit));
                args.insert("root".into(), json!(c.root));
                args.insert("group".into(), json!(c.group));
                (event_name(a), "collective", args)
            }
        };
        events.emit(json!({
            "ph": "X", "pid": PID, "tid": r, "name": name, "cat": cat,
            "ts": us(s.start), "dur": us((s.end - s.start).max(0.0)), "args": Value::Object(args),
        }))?;
    }

    if opts.flows {
        write_flows(p, t, &mut names, &ends, &mut events, &us)?;
    }

    // Memory: one counter track per rank, a sample wherever its level changes.
    if opts.memory {
        // One rank's steps at a time.
        if let Ok(curves) = memory_curves(p, t) {
            for (r, steps) in curves.enumerate() {
                let name = format!("memory rank {r}");
                let mut sample = |ts: f64, level: f64| {
                    // Rounded like the times, so a level that returns to zero reads 0.
                    let level = (level * 1e9).round() / 1e9;
                    events.emit(json!({"ph": "C", "pid": PID, "name": name,
                                       "ts": us(ts), "args": {"activations": level}}))
                };
                sample(0.0, 0.0)?;
                for (ts, level) in steps {
                    sample(ts, level)?;
                }
            }
        }
    }

    let w = events.w;
    w.write_all(b"\n],\"displayTimeUnit\":\"ms\"")?;
    if opts.embed_program {
        w.write_all(b",\"mpipe\":{\"program\":")?;
        write_program_sorted(p, w)?;
        w.write_all(b",\"time_scale\":")?;
        serde_json::to_writer(&mut *w, &scale).map_err(io::Error::from)?;
        w.write_all(b"}")?;
    }
    w.write_all(b"}\n")
}

/// The flows' groups: a transfer's unit (a [`NameIds`] id) and tensor.
fn group(unit: u32, tensor: Tensor) -> usize {
    let t = match tensor {
        Tensor::Act => 0,
        Tensor::Grad => 1,
        Tensor::Input => 2,
    };
    unit as usize * 3 + t
}

/// The flow events, one pair per matched transfer, in channel order: (tensor, unit
/// name, mb, from, to), and within a channel the k-th `SEND` with the k-th `RECV`
/// in list order. `ends[g]` counts the transfer ends of [`group`] `g` (the units
/// numbered in `names`, first seen in `p`'s order). The groups are taken in that
/// order a share at a time (about an eighth of all ends, or one group if it is
/// larger), each share's ends gathered in one pass over `p` and sorted: a channel
/// lies within one group, so the events come out as from one sort of all ends, in
/// a tenth of the memory (a pass more over the program per share).
fn write_flows<'a, W: Write>(
    p: &'a Program,
    t: &Timeline,
    names: &mut NameIds<'a>,
    ends: &[usize],
    events: &mut Events<'_, W>,
    us: &dyn Fn(f64) -> Value,
) -> io::Result<()> {
    let rank = names.ranks_by_name();
    // The groups in channel order: tensor first, then the unit's name.
    let mut order: Vec<usize> = (0..ends.len()).filter(|&g| ends[g] > 0).collect();
    order.sort_by_key(|&g| (g % 3, rank[g / 3]));
    let total: usize = ends.iter().sum();
    let share = (total / 8).max(1 << 12);
    // Which share each group is in (`usize::MAX`: none, it has no ends).
    let mut share_of = vec![usize::MAX; ends.len()];
    let (mut shares, mut held) = (0, 0);
    for &g in &order {
        if held > 0 && held + ends[g] > share {
            shares += 1;
            held = 0;
        }
        share_of[g] = shares;
        held += ends[g];
    }
    let key = |e: &FlowEnd| (e.tensor, rank[e.unit as usize], e.mb, e.from, e.to);
    // The middle of an end's slot (on the sender's track, or the receiver's).
    let mid = |rank: u32, at: u32| {
        let s = t.ranks[rank as usize][at as usize];
        (s.start + s.end) / 2.0
    };
    let mut id = 0u64;
    let (mut sends, mut recvs): (Vec<FlowEnd>, Vec<FlowEnd>) = (Vec::new(), Vec::new());
    let passes = if order.is_empty() { 0 } else { shares + 1 };
    for this in 0..passes {
        sends.clear();
        recvs.clear();
        for (r, list) in p.programs.iter().enumerate() {
            let slots = t.ranks.get(r).map_or(0, Vec::len);
            for (i, a) in list.iter().take(slots).enumerate() {
                let ActionRef::P2p(x) = a.view() else {
                    continue;
                };
                let unit = names.id(x.unit);
                if share_of.get(group(unit, x.tensor)) != Some(&this) {
                    continue;
                }
                let (list, from, to) = match x.dir {
                    Dir::Send => (&mut sends, r, x.peer),
                    Dir::Recv => (&mut recvs, x.peer, r),
                };
                list.push(FlowEnd {
                    tensor: x.tensor,
                    unit,
                    mb: narrow(x.mb),
                    from: narrow(from),
                    to: narrow(to),
                    at: narrow(i),
                });
            }
        }
        // The ends of one channel are on one rank (the sender's, or the
        // receiver's), so list order is their index there: an unstable sort with
        // it last needs no second buffer.
        sends.sort_unstable_by_key(|e| (key(e), e.at));
        recvs.sort_unstable_by_key(|e| (key(e), e.at));
        let mut j = 0;
        for group in sends.chunk_by(|a, b| key(a) == key(b)) {
            let k = key(&group[0]);
            while j < recvs.len() && key(&recvs[j]) < k {
                j += 1;
            }
            let matching = recvs[j..].iter().take_while(|e| key(e) == k);
            for (s, r) in group.iter().zip(matching) {
                let name = format!("{} {} mb{}", s.tensor.as_str(), names.name(s.unit), s.mb);
                events.emit(json!({"ph": "s", "pid": PID, "tid": s.from, "id": id,
                                   "name": name, "cat": "p2p", "ts": us(mid(s.from, s.at))}))?;
                events.emit(
                    json!({"ph": "f", "bp": "e", "pid": PID, "tid": r.to, "id": id,
                                   "name": name, "cat": "p2p", "ts": us(mid(r.to, r.at))}),
                )?;
                id += 1;
            }
        }
    }
    Ok(())
}

/// One end of a transfer, for the flow arrows: its channel (tensor, unit as a
/// [`NameIds`] id, micro-batch, sending and receiving rank) and its index in its
/// rank's list (the sender's for a `SEND`, the receiver's for a `RECV`), where the
/// timeline has its slot. 24 bytes: numbers are 32-bit in actions already.
struct FlowEnd {
    tensor: Tensor,
    unit: u32,
    mb: u32,
    from: u32,
    to: u32,
    at: u32,
}

/// The distinct unit names of the transfers, numbered in first-seen order.
#[derive(Default)]
struct NameIds<'a> {
    ids: std::collections::HashMap<&'a str, u32>,
    names: Vec<&'a str>,
    /// The last name looked up, by address and length, and its id: the actions of a
    /// program share their unit's name, so a run on one unit costs one look-up.
    last: Option<(*const u8, usize, u32)>,
}

impl<'a> NameIds<'a> {
    fn id(&mut self, name: &'a str) -> u32 {
        let here = (name.as_ptr(), name.len());
        if let Some((ptr, len, id)) = self.last {
            if (ptr, len) == here {
                return id;
            }
        }
        let next = self.names.len() as u32;
        let id = *self.ids.entry(name).or_insert(next);
        if id == next {
            self.names.push(name);
        }
        self.last = Some((here.0, here.1, id));
        id
    }

    fn name(&self, id: u32) -> &'a str {
        self.names[id as usize]
    }

    /// Each id's place among the names in string order.
    fn ranks_by_name(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.names.len() as u32).collect();
        order.sort_by_key(|&i| self.names[i as usize]);
        let mut rank = vec![0; order.len()];
        for (k, &i) in order.iter().enumerate() {
            rank[i as usize] = k as u32;
        }
        rank
    }
}

/// `p` as JSON with every object's keys in order (as a `serde_json::Value` writes
/// it, the embedded program's bytes since it was first written), action by action:
/// only one action is held as a value at a time, not the whole program.
fn write_program_sorted<W: Write>(p: &Program, w: &mut W) -> io::Result<()> {
    // Everything but the action lists, as a value (small: the units).
    let head = Program {
        format: p.format.clone(),
        ranks: p.ranks,
        microbatches: p.microbatches,
        units: p.units.clone(),
        programs: Vec::new(),
        source: p.source.clone(),
        prefetch: p.prefetch.clone(),
    };
    let Value::Object(head) = serde_json::to_value(&head).map_err(io::Error::from)? else {
        return Err(io::Error::other("a program serializes as an object"));
    };
    w.write_all(b"{")?;
    for (i, (key, value)) in head.iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        serde_json::to_writer(&mut *w, key).map_err(io::Error::from)?;
        w.write_all(b":")?;
        if key == "programs" {
            w.write_all(b"[")?;
            for (r, list) in p.programs.iter().enumerate() {
                if r > 0 {
                    w.write_all(b",")?;
                }
                w.write_all(b"[")?;
                for (k, a) in list.iter().enumerate() {
                    if k > 0 {
                        w.write_all(b",")?;
                    }
                    let v = serde_json::to_value(a).map_err(io::Error::from)?;
                    serde_json::to_writer(&mut *w, &v).map_err(io::Error::from)?;
                }
                w.write_all(b"]")?;
            }
            w.write_all(b"]")?;
        } else {
            serde_json::to_writer(&mut *w, value).map_err(io::Error::from)?;
        }
    }
    w.write_all(b"}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::testutil::{big_example, simulate_eager, small_program};

    fn events(s: &str) -> Vec<Value> {
        let v: Value = serde_json::from_str(s).expect("valid JSON");
        assert_eq!(v["displayTimeUnit"], "ms");
        v["traceEvents"].as_array().unwrap().clone()
    }

    fn of_ph<'a>(ev: &'a [Value], ph: &str) -> Vec<&'a Value> {
        ev.iter().filter(|e| e["ph"] == ph).collect()
    }

    #[test]
    fn render_trace_small_program() {
        let p = small_program();
        let t = simulate_eager(&p);
        let s = chrome_trace(&p, &t, &TraceOptions::default());
        let ev = events(&s);
        // 1 process name + 2 * (thread name + sort index); 26 actions; 4 flows;
        // memory samples.
        assert_eq!(of_ph(&ev, "M").len(), 5);
        let x = of_ph(&ev, "X");
        assert_eq!(x.len(), 26);
        assert_eq!(of_ph(&ev, "s").len(), 4);
        assert_eq!(of_ph(&ev, "f").len(), 4);
        let c = of_ph(&ev, "C");
        assert_eq!(ev.len(), 5 + 26 + 8 + c.len());
        assert!(ev
            .iter()
            .any(|e| e["name"] == "process_name" && e["args"]["name"] == "mpipe"));
        assert!(ev
            .iter()
            .any(|e| e["name"] == "thread_name" && e["tid"] == 1 && e["args"]["name"] == "rank 1"));
        // tids are ranks, in order, and each rank's events follow its list.
        let on = |r: u64| x.iter().filter(|e| e["tid"] == r).count();
        assert_eq!((on(0), on(1)), (16, 10));
        // Times: F(vision,0) at 0..2 ms, rank 1's first RECV waited 0..3 ms.
        let find = |name: &str| *x.iter().find(|e| e["name"] == name).unwrap();
        let fv = find("F vision mb0");
        assert_eq!(
            (fv["ts"].as_f64(), fv["dur"].as_f64()),
            (Some(0.0), Some(2000.0))
        );
        assert_eq!(fv["cat"], "compute");
        assert_eq!(fv["args"]["encoder"], true);
        assert_eq!(fv["args"]["op"], "F");
        let rv = find("RECV act llm.0 mb0 <- 0");
        assert_eq!(
            (rv["ts"].as_f64(), rv["dur"].as_f64()),
            (Some(0.0), Some(3000.0))
        );
        assert_eq!(rv["tid"], 1);
        assert_eq!(rv["cat"], "p2p");
        assert_eq!(rv["args"]["peer"], 0);
        let sd = find("SEND act llm.0 mb0 -> 1");
        assert_eq!(
            (sd["ts"].as_f64(), sd["dur"].as_f64()),
            (Some(3000.0), Some(0.0))
        );
        let bw = find("BW vision mb1");
        assert_eq!(
            (bw["ts"].as_f64(), bw["dur"].as_f64()),
            (Some(15000.0), Some(3000.0))
        );
        let bc = x
            .iter()
            .find(|e| e["name"] == "BCAST llm.0 root 0")
            .unwrap();
        assert_eq!(bc["cat"], "collective");
        assert_eq!(bc["args"]["group"], json!([0, 1]));
        // Flows go from the sender's track to the receiver's.
        for f in of_ph(&ev, "s") {
            let id = &f["id"];
            let fin = ev
                .iter()
                .find(|e| e["ph"] == "f" && &e["id"] == id)
                .unwrap();
            assert_ne!(f["tid"], fin["tid"]);
        }
        assert_eq!(s, chrome_trace(&p, &t, &TraceOptions::default()));
    }

    #[test]
    fn render_trace_memory_counters_peak_where_the_simulator_says() {
        let p = small_program();
        // (It runs with asynchronous sends only.)
        let eager = crate::judge::simulate::SimOptions {
            mode: crate::judge::simulate::Mode::Eager,
            comm: None,
        };
        let report = crate::judge::simulate::simulate(&p, &eager).unwrap();
        let ev = events(&chrome_trace(
            &p,
            &report.timeline,
            &TraceOptions::default(),
        ));
        let c = of_ph(&ev, "C");
        // Each rank's track starts at 0, ends at 0 (every activation is released by
        // the end of the step) and peaks at the simulator's peak memory.
        for (r, &peak) in report.peak_memory.iter().enumerate() {
            let name = format!("memory rank {r}");
            let samples: Vec<(f64, f64)> = c
                .iter()
                .filter(|e| e["name"] == name.as_str())
                .map(|e| {
                    let level = e["args"]["activations"].as_f64().unwrap();
                    (e["ts"].as_f64().unwrap(), level)
                })
                .collect();
            assert!(samples.len() >= 3, "{name}: {samples:?}");
            assert_eq!(samples[0], (0.0, 0.0));
            assert_eq!(samples.last().unwrap().1, 0.0, "{name}: {samples:?}");
            assert!(samples.windows(2).all(|w| w[0].0 <= w[1].0), "{samples:?}");
            let top = samples.iter().map(|s| s.1).fold(0.0, f64::max);
            assert!(
                peak > 0.0 && crate::ir::compare::close(top, peak),
                "{name}: {top} vs {peak}"
            );
        }
        // A timeline of another program has no counters (and no panic).
        let other = crate::render::testutil::big_example(2, 4, 1, false).1;
        let ev = events(&chrome_trace(&p, &other, &TraceOptions::default()));
        assert!(of_ph(&ev, "C").is_empty());
    }

    #[test]
    fn render_trace_options() {
        let p = small_program();
        let t = simulate_eager(&p);
        let opts = TraceOptions {
            name: Some("run \"7\"".into()),
            time_scale: 1.0,
            flows: false,
            memory: false,
            embed_program: false,
        };
        let ev = events(&chrome_trace(&p, &t, &opts));
        assert!(of_ph(&ev, "C").is_empty());
        assert!(ev
            .iter()
            .any(|e| e["name"] == "process_name" && e["args"]["name"] == "run \"7\""));
        assert!(of_ph(&ev, "s").is_empty());
        let fv = ev.iter().find(|e| e["name"] == "BW vision mb1").unwrap();
        assert_eq!(
            (fv["ts"].as_f64(), fv["dur"].as_f64()),
            (Some(15.0), Some(3.0))
        );
    }

    #[test]
    fn render_trace_big_schedule() {
        let (p, t) = big_example(8, 32, 2, true);
        let actions: usize = p.programs.iter().map(Vec::len).sum();
        let sends = p
            .programs
            .iter()
            .flatten()
            .filter(|a| matches!(a.view(), ActionRef::P2p(x) if x.dir == Dir::Send))
            .count();
        let ev = events(&chrome_trace(&p, &t, &TraceOptions::default()));
        assert_eq!(of_ph(&ev, "X").len(), actions);
        assert_eq!(of_ph(&ev, "s").len(), sends);
        let chunked = of_ph(&ev, "X")
            .into_iter()
            .find(|e| e["name"] == "F llm.8 mb0")
            .unwrap();
        assert_eq!(chunked["args"]["chunk"], 1);
    }
}
