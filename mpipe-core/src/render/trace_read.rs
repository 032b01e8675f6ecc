//! Reading a trace back (issue 37 item 2): the program a trace embeds, and the
//! timeline of a program from a trace's complete events, read as a stream.
//!
//! The readers take any [`Read`] (or a string) and never hold the document: the
//! `traceEvents` list is walked element by element (serde's `SeqAccess`, each event
//! a map whose five keys that matter are kept and the rest skipped), so memory is
//! bounded by what is kept, not by the file:
//! - [`embedded_program_from_reader`]: the program itself (the events are skipped);
//! - [`timeline_from_trace_reader`]: per action of the program an index entry
//!   (a hash of its event name, 16 bytes) and at most one timing (24 bytes), plus
//!   one name buffer. Events beyond the program's actions are counted, not kept: once
//!   one name has more events than actions, the result is an error whatever follows,
//!   so no timing is kept after that.
//!
//! Refusals come as early as the stream allows: a bad event (no rank, a rank the
//! program does not have, no name, bad times) as soon as it is read; a missing or
//! extra event, and a missing program, at the end (the trace-event format puts the
//! events first and the embedded program last). The k-th event of a name on a
//! rank's track, in order of start (file order among equal starts), is the slot of
//! the k-th action of that name on the rank.

use std::collections::hash_map::DefaultHasher;
use std::fmt::Write as _;
use std::hash::Hasher;
use std::io::Read;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::ir::program::{Action, ActionRef, CollKind, Dir, Program};
use crate::judge::timeline::{Slot, Timeline};

/// Why a trace cannot be read back as a timeline of a program.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceReadError {
    #[error("the trace is not JSON: {0}")]
    Json(String),
    #[error("cannot read the trace: {0}")]
    Io(String),
    #[error(
        "the trace has no `traceEvents` list; give a trace in the JSON trace-event \
         format, as `mpipe trace` or the runtime writes"
    )]
    NoEvents,
    #[error("trace event {index}: {what}")]
    Event { index: usize, what: String },
    #[error(
        "rank {rank}: the program's action {index} `{action}` has no event in the trace; \
         give the trace of this program's run"
    )]
    Missing {
        rank: usize,
        index: usize,
        action: String,
    },
    #[error(
        "rank {rank}: {count} event(s) in the trace match no action of the program (the \
         first: `{name}`); give the trace of this program's run"
    )]
    Extra {
        rank: usize,
        count: usize,
        name: String,
    },
    #[error(
        "the trace embeds no program (no `mpipe.program`); give the program that ran \
         (`--program`)"
    )]
    NoProgram,
    #[error("the trace's embedded program (`mpipe.program`) cannot be read: {0}")]
    Program(String),
}

/// The name of an action's event: `F llm.0 mb3`, `SEND act llm.0 mb3 -> 1`,
/// `RECV act llm.0 mb3 <- 0`, `BCAST llm.0 root 0`.
pub(crate) fn event_name(a: &Action) -> String {
    let mut s = String::new();
    write_event_name(a, &mut s);
    s
}

/// [`event_name`] appended to `out`.
fn write_event_name(a: &Action, out: &mut String) {
    // Writing to a String cannot fail.
    let _ = match a.view() {
        ActionRef::Compute(c) => write!(out, "{} {} mb{}", c.op.as_str(), c.unit, c.mb),
        ActionRef::P2p(x) => {
            let (op, arrow) = match x.dir {
                Dir::Send => ("SEND", "->"),
                Dir::Recv => ("RECV", "<-"),
            };
            write!(
                out,
                "{op} {} {} mb{} {arrow} {}",
                x.tensor.as_str(),
                x.unit,
                x.mb,
                x.peer
            )
        }
        ActionRef::Coll(c) => {
            let op = match c.kind {
                CollKind::Bcast => "BCAST",
                CollKind::Reduce => "REDUCE",
            };
            write!(out, "{op} {} root {}", c.unit, c.root)
        }
    };
}

fn hash_name(name: &str) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(name.as_bytes());
    h.finish()
}

// ---------------------------------------------------------------------------------
// Public readers.

/// The program a trace embeds ([`super::trace::TraceOptions::embed_program`]).
pub fn embedded_program(text: &str) -> Result<Program, TraceReadError> {
    read_program(serde_json::Deserializer::from_str(text))
}

/// [`embedded_program`] from a stream: the events are skipped as they are read, so
/// memory is the program's (wrap nothing: the reader is buffered here).
pub fn embedded_program_from_reader<R: Read>(r: R) -> Result<Program, TraceReadError> {
    read_program(serde_json::Deserializer::from_reader(
        std::io::BufReader::with_capacity(1 << 16, r),
    ))
}

/// The timeline of `program` in `text`, a trace of its run whose complete events
/// are named as [`super::trace::chrome_trace`] names them (`tid` is the rank). Times
/// are in units of `us_per_unit` microseconds (1000: milliseconds). Events of other
/// names and other phases are ignored; every action must have its event.
pub fn timeline_from_trace(
    program: &Program,
    text: &str,
    us_per_unit: f64,
) -> Result<Timeline, TraceReadError> {
    read_timeline(
        program,
        serde_json::Deserializer::from_str(text),
        us_per_unit,
    )
}

/// [`timeline_from_trace`] from a stream, in memory bounded by the program (see the
/// module documentation), not by the trace.
pub fn timeline_from_trace_reader<R: Read>(
    program: &Program,
    r: R,
    us_per_unit: f64,
) -> Result<Timeline, TraceReadError> {
    read_timeline(
        program,
        serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(1 << 16, r)),
        us_per_unit,
    )
}

// ---------------------------------------------------------------------------------
// The document: an object whose keys `traceEvents` and `mpipe` matter.

/// Serde's error turned into the reader's: the typed error a visitor left in
/// `failed` first, a data error inside the embedded program next, else the JSON's.
fn error(e: serde_json::Error, failed: Option<TraceReadError>, in_program: bool) -> TraceReadError {
    failed.unwrap_or_else(|| {
        if e.is_io() {
            TraceReadError::Io(e.to_string())
        } else if e.is_data() && in_program {
            TraceReadError::Program(e.to_string())
        } else {
            TraceReadError::Json(e.to_string())
        }
    })
}

fn read_program<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
) -> Result<Program, TraceReadError> {
    let mut st = ProgramState::default();
    let done = (&mut de)
        .deserialize_any(ProgramTop(&mut st))
        .and_then(|()| de.end());
    match done {
        Err(e) => Err(error(e, None, st.in_program)),
        Ok(()) => st.program.ok_or(TraceReadError::NoProgram),
    }
}

fn read_timeline<'de, R: serde_json::de::Read<'de>>(
    program: &Program,
    mut de: serde_json::Deserializer<R>,
    us_per_unit: f64,
) -> Result<Timeline, TraceReadError> {
    let scale = if us_per_unit.is_finite() && us_per_unit > 0.0 {
        us_per_unit
    } else {
        1000.0
    };
    let mut c = Collector::new(program, scale)?;
    let done = (&mut de)
        .deserialize_any(EventsTop(&mut c))
        .and_then(|()| de.end());
    if let Err(e) = done {
        return Err(error(e, c.failed.take(), false));
    }
    if !c.array {
        return Err(TraceReadError::NoEvents);
    }
    c.finish()
}

/// Keys that matter, at any level.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    TraceEvents,
    Mpipe,
    Program,
    Ph,
    Tid,
    Name,
    Ts,
    Dur,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "traceEvents" => Key::TraceEvents,
                    "mpipe" => Key::Mpipe,
                    "program" => Key::Program,
                    "ph" => Key::Ph,
                    "tid" => Key::Tid,
                    "name" => Key::Name,
                    "ts" => Key::Ts,
                    "dur" => Key::Dur,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

/// The visitor methods of every value but the ones a visitor overrides: each
/// returns `$value` (containers are read through and dropped).
macro_rules! skip_scalars {
    ($value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

macro_rules! skip_str {
    ($value:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

macro_rules! skip_map {
    ($value:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_map(map)?;
            Ok($value)
        }
    };
}

macro_rules! skip_seq {
    ($value:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_seq(seq)?;
            Ok($value)
        }
    };
}

// ---------------------------------------------------------------------------------
// The embedded program: `mpipe.program`, the rest skipped.

#[derive(Default)]
struct ProgramState {
    program: Option<Program>,
    /// Inside `mpipe.program`: a data error there is the program's.
    in_program: bool,
}

struct ProgramTop<'a>(&'a mut ProgramState);

impl<'de> Visitor<'de> for ProgramTop<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    skip_scalars!(());
    skip_str!(());
    skip_seq!(());
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Key>()? {
            if k == Key::Mpipe {
                map.next_value_seed(MpipeSeed(&mut *self.0))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct MpipeSeed<'a>(&'a mut ProgramState);

impl<'de> DeserializeSeed<'de> for MpipeSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MpipeSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the `mpipe` object")
    }
    skip_scalars!(());
    skip_str!(());
    skip_seq!(());
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Key>()? {
            if k == Key::Program {
                self.0.in_program = true;
                let p = map.next_value::<Program>()?;
                self.0.in_program = false;
                self.0.program = Some(p);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// The events: `traceEvents`, walked element by element.

struct EventsTop<'a, 'p>(&'a mut Collector<'p>);

impl<'de> Visitor<'de> for EventsTop<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    skip_scalars!(());
    skip_str!(());
    skip_seq!(());
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Key>()? {
            if k == Key::TraceEvents {
                // The last `traceEvents` counts, as in a parsed document.
                self.0.restart();
                map.next_value_seed(EventsSeed(&mut *self.0))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct EventsSeed<'a, 'p>(&'a mut Collector<'p>);

impl<'de> DeserializeSeed<'de> for EventsSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventsSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the `traceEvents` list")
    }
    skip_scalars!(());
    skip_str!(());
    skip_map!(());
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.array = true;
        let mut index = 0;
        while let Some(e) = seq.next_element_seed(EventSeed(&mut self.0.name))? {
            if let Some(e) = e {
                if let Err(err) = self.0.event(index, e) {
                    self.0.failed = Some(err);
                    return Err(de::Error::custom("the trace's events are refused"));
                }
            }
            index += 1;
        }
        Ok(())
    }
}

/// A number as the trace has it.
#[derive(Clone, Copy)]
enum Num {
    U(u64),
    I(i64),
    F(f64),
    No,
}

impl Num {
    fn as_u64(self) -> Option<u64> {
        match self {
            Num::U(u) => Some(u),
            Num::I(i) => u64::try_from(i).ok(),
            _ => None,
        }
    }
    fn as_f64(self) -> Option<f64> {
        match self {
            Num::U(u) => Some(u as f64),
            Num::I(i) => Some(i as f64),
            Num::F(f) => Some(f),
            Num::No => None,
        }
    }
}

impl<'de> de::Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Num, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Num;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Num, E> {
                Ok(Num::No)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Num, E> {
                Ok(Num::I(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Num, E> {
                Ok(Num::U(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Num, E> {
                Ok(Num::F(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Num, E> {
                Ok(Num::No)
            }
            fn visit_none<E: de::Error>(self) -> Result<Num, E> {
                Ok(Num::No)
            }
            skip_str!(Num::No);
            skip_map!(Num::No);
            skip_seq!(Num::No);
        }
        d.deserialize_any(V)
    }
}

/// Whether a value is the string `X`.
struct IsX;

impl<'de> DeserializeSeed<'de> for IsX {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for IsX {
    type Value = bool;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a phase")
    }
    skip_scalars!(false);
    skip_map!(false);
    skip_seq!(false);
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        Ok(v == "X")
    }
}

/// A string value copied into the buffer (`true`), or another value (`false`).
struct NameInto<'a>(&'a mut String);

impl<'de> DeserializeSeed<'de> for NameInto<'_> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NameInto<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a name")
    }
    skip_scalars!(false);
    skip_map!(false);
    skip_seq!(false);
    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        self.0.clear();
        self.0.push_str(v);
        Ok(true)
    }
}

/// One complete event's fields (the name is in the collector's buffer).
struct Complete {
    tid: Option<Num>,
    named: bool,
    ts: Option<Num>,
    dur: Option<Num>,
}

/// An element of `traceEvents`: `Some` for a complete event (`ph` X), `None` for
/// anything else.
struct EventSeed<'a>(&'a mut String);

impl<'de> DeserializeSeed<'de> for EventSeed<'_> {
    type Value = Option<Complete>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EventSeed<'_> {
    type Value = Option<Complete>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a trace event")
    }
    skip_scalars!(None);
    skip_str!(None);
    skip_seq!(None);
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // Repeated keys: the last counts, as in a parsed document.
        let mut x = false;
        let mut e = Complete {
            tid: None,
            named: false,
            ts: None,
            dur: None,
        };
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Ph => x = map.next_value_seed(IsX)?,
                Key::Tid => e.tid = Some(map.next_value::<Num>()?),
                Key::Ts => e.ts = Some(map.next_value::<Num>()?),
                Key::Dur => e.dur = Some(map.next_value::<Num>()?),
                Key::Name => e.named = map.next_value_seed(NameInto(&mut *self.0))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(x.then_some(e))
    }
}

// ---------------------------------------------------------------------------------
// What is kept: per rank, an index of the program's event names and the timings.

/// One rank's actions grouped by event name, and its events so far.
struct Rank {
    /// `(hash of the name, group)`, sorted.
    keys: Vec<(u64, u32)>,
    /// Per action, its group.
    group_of: Vec<u32>,
    /// Per group: its first action (for the name), its size, its events so far.
    first: Vec<u32>,
    size: Vec<u32>,
    count: Vec<u32>,
    /// Events of no action's name: how many, and the least name.
    unmatched: usize,
    least: Option<String>,
    /// `(group, start, end)` in file order (dropped once the trace is doomed).
    events: Vec<(u32, f64, f64)>,
}

struct Collector<'p> {
    program: &'p Program,
    scale: f64,
    ranks: Vec<Rank>,
    /// A `traceEvents` list was read.
    array: bool,
    /// Some name has more events than actions: the result is an error, timings are
    /// no longer kept.
    doomed: bool,
    /// The event being read's name.
    name: String,
    /// Scratch for action names.
    scratch: String,
    /// The typed error that stopped the stream.
    failed: Option<TraceReadError>,
}

impl<'p> Collector<'p> {
    fn new(program: &'p Program, scale: f64) -> Result<Self, TraceReadError> {
        let mut ranks = Vec::with_capacity(program.programs.len());
        for list in &program.programs {
            if u32::try_from(list.len()).is_err() {
                return Err(TraceReadError::Program(format!(
                    "a rank has {} actions, more than {} a trace can be matched against",
                    list.len(),
                    u32::MAX
                )));
            }
            let mut by_hash: Vec<(u64, u32)> = list
                .iter()
                .enumerate()
                .map(|(i, a)| (hash_name(&event_name(a)), i as u32))
                .collect();
            by_hash.sort_unstable();
            let mut r = Rank {
                keys: Vec::new(),
                group_of: vec![0; list.len()],
                first: Vec::new(),
                size: Vec::new(),
                count: Vec::new(),
                unmatched: 0,
                least: None,
                events: Vec::new(),
            };
            let mut run: Vec<(u32, String)> = Vec::new();
            for (j, &(h, i)) in by_hash.iter().enumerate() {
                if j == 0 || by_hash[j - 1].0 != h {
                    run.clear();
                }
                let name = event_name(&list[i as usize]);
                let g = match run.iter().find(|(_, n)| *n == name) {
                    Some(&(g, _)) => g,
                    None => {
                        let g = r.first.len() as u32;
                        r.first.push(i);
                        r.size.push(0);
                        r.keys.push((h, g));
                        run.push((g, name));
                        g
                    }
                };
                r.group_of[i as usize] = g;
                r.size[g as usize] += 1;
            }
            r.count = vec![0; r.first.len()];
            r.keys.shrink_to_fit();
            ranks.push(r);
        }
        Ok(Collector {
            program,
            scale,
            ranks,
            array: false,
            doomed: false,
            name: String::new(),
            scratch: String::new(),
            failed: None,
        })
    }

    /// Forget the events read so far (a later `traceEvents` replaces them).
    fn restart(&mut self) {
        self.array = false;
        self.doomed = false;
        for r in &mut self.ranks {
            r.count.iter_mut().for_each(|c| *c = 0);
            r.unmatched = 0;
            r.least = None;
            r.events.clear();
        }
    }

    /// Take complete event `index` (its name in `self.name`).
    fn event(&mut self, index: usize, e: Complete) -> Result<(), TraceReadError> {
        let bad = |what: &str| TraceReadError::Event {
            index,
            what: what.to_string(),
        };
        let ranks = self.ranks.len();
        let tid = e
            .tid
            .and_then(Num::as_u64)
            .ok_or_else(|| bad("a complete event (`ph` X) needs an integer `tid` (its rank)"))?;
        let rank = usize::try_from(tid)
            .ok()
            .filter(|&r| r < ranks)
            .ok_or_else(|| {
                bad(&format!(
                    "`tid` {tid} is not a rank of the program ({ranks} ranks)"
                ))
            })?;
        if !e.named {
            return Err(bad("a complete event needs a `name`"));
        }
        let (Some(ts), Some(dur)) = (e.ts.and_then(Num::as_f64), e.dur.and_then(Num::as_f64))
        else {
            return Err(bad("a complete event needs numbers `ts` and `dur`"));
        };
        if !(ts.is_finite() && dur.is_finite() && dur >= 0.0) {
            return Err(bad("`ts` and `dur` must be finite and `dur` at least 0"));
        }
        let list = &self.program.programs[rank];
        let r = &mut self.ranks[rank];
        let h = hash_name(&self.name);
        let from = r.keys.partition_point(|k| k.0 < h);
        let mut found = None;
        for &(kh, g) in &r.keys[from..] {
            if kh != h {
                break;
            }
            self.scratch.clear();
            write_event_name(&list[r.first[g as usize] as usize], &mut self.scratch);
            if self.scratch == self.name {
                found = Some(g as usize);
                break;
            }
        }
        let doomed = match found {
            Some(g) => {
                r.count[g] = r.count[g].saturating_add(1);
                r.count[g] > r.size[g]
            }
            None => {
                r.unmatched += 1;
                if r.least.as_ref().is_none_or(|l| self.name < *l) {
                    r.least = Some(self.name.clone());
                }
                true
            }
        };
        if doomed && !self.doomed {
            self.doomed = true;
            for r in &mut self.ranks {
                r.events = Vec::new();
            }
        }
        if let (false, Some(g)) = (self.doomed, found) {
            let r = &mut self.ranks[rank];
            if r.events.capacity() == 0 {
                r.events.reserve_exact(list.len());
            }
            r.events
                .push((g as u32, ts / self.scale, (ts + dur) / self.scale));
        }
        Ok(())
    }

    /// The timeline, or the first missing action or extra event, rank by rank.
    fn finish(self) -> Result<Timeline, TraceReadError> {
        let mut out = Vec::with_capacity(self.ranks.len());
        for (rank, (list, mut r)) in self.program.programs.iter().zip(self.ranks).enumerate() {
            // Each group's events in order of start (stable: file order among equals).
            r.events
                .sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
            let mut offset = Vec::with_capacity(r.count.len());
            let mut at = 0usize;
            for &c in &r.count {
                offset.push(at);
                at += c as usize;
            }
            let mut used = vec![0u32; r.count.len()];
            let mut slots = Vec::with_capacity(if self.doomed { 0 } else { list.len() });
            for (index, a) in list.iter().enumerate() {
                let g = r.group_of[index] as usize;
                if used[g] >= r.count[g] {
                    return Err(TraceReadError::Missing {
                        rank,
                        index,
                        action: a.to_string(),
                    });
                }
                if !self.doomed {
                    let (_, start, end) = r.events[offset[g] + used[g] as usize];
                    slots.push(Slot { start, end });
                }
                used[g] += 1;
            }
            let total = r.count.iter().map(|&c| c as usize).sum::<usize>() + r.unmatched;
            if total > list.len() {
                let mut name = r.least.take();
                for (g, (&c, &s)) in r.count.iter().zip(&r.size).enumerate() {
                    if c > s {
                        let n = event_name(&list[r.first[g] as usize]);
                        if name.as_ref().is_none_or(|m| n < *m) {
                            name = Some(n);
                        }
                    }
                }
                return Err(TraceReadError::Extra {
                    rank,
                    count: total - list.len(),
                    name: name.unwrap_or_default(),
                });
            }
            out.push(slots);
        }
        Ok(Timeline { ranks: out })
    }
}
