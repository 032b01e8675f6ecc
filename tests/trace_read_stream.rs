//! Issue 37, item 2 (the reader): `mpipe calibrate` parsed the whole trace into
//! memory, about ten times the file (9.9 GB for an 806 MB trace before it said the
//! trace embeds no program). The readers now walk the trace as a stream: their peak
//! allocation is bounded by what they keep (the program; the per-action timings and
//! an index of the action names), a small fraction of the file, and a refusal costs
//! no more than an answer.
//!
//! The peak is counted by this binary's global allocator (`peak_alloc`), so the
//! figures are deterministic; the tests run one at a time (the counter is global).

use std::io::{BufWriter, Read, Write};
use std::sync::{Mutex, MutexGuard};

use mpipe::core::calibrate::measure;
use mpipe::core::derive::{derive_str, Request};
use mpipe::core::profile::Profile;
use mpipe::core::program::Program;
use mpipe::core::render::trace::{
    embedded_program_from_reader, timeline_from_trace_reader, write_chrome_trace, TraceOptions,
    TraceReadError,
};
use mpipe::core::simulate::{simulate, Mode, SimOptions};
use mpipe::core::timeline::Timeline;
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const PROFILE: &str = "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\n\
                       activation = 1.0\n[[encoder]]\nname = \"vision\"\nlayers = 2\n\
                       forward = 1.0\nbackward = 2.0\nweight = 1.0\nactivation = 1.0\n\
                       trainable = true\n";

/// A program of `ranks x mbs` and its simulated timeline.
fn run(ranks: usize, mbs: usize) -> (Program, Timeline) {
    let profile = Profile::from_toml_str(PROFILE).unwrap();
    let p = derive_str(&Request::new(&profile, ranks, mbs), "1f1b")
        .unwrap_or_else(|e| panic!("{e:?}"))
        .program;
    let r = simulate(
        &p,
        &SimOptions {
            mode: Mode::Rendezvous,
            comm: None,
        },
    )
    .unwrap();
    (p, r.timeline)
}

/// `f()`'s result and the bytes allocated at its peak above what was allocated before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let out = f();
    (out, ALLOC.peak_usage().saturating_sub(base))
}

fn actions(p: &Program) -> usize {
    p.programs.iter().map(Vec::len).sum()
}

/// A temporary file removed on drop.
struct Temp(std::path::PathBuf);

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write_trace(name: &str, p: &Program, t: &Timeline, embed: bool) -> (Temp, usize) {
    let path = std::env::temp_dir().join(format!(
        "mpipe-trace-read-{name}-{}.json",
        std::process::id()
    ));
    let mut w = BufWriter::new(std::fs::File::create(&path).unwrap());
    let opts = TraceOptions {
        embed_program: embed,
        ..TraceOptions::default()
    };
    write_chrome_trace(p, t, &opts, &mut w).unwrap();
    w.flush().unwrap();
    drop(w);
    let size = std::fs::metadata(&path).unwrap().len() as usize;
    (Temp(path), size)
}

#[test]
fn a_large_trace_is_read_in_a_small_fraction_of_its_size() {
    let _g = serial();
    let (p, t) = run(8, 2048);
    let n = actions(&p);
    let (file, size) = write_trace("large", &p, &t, true);
    assert!(size > 20 << 20, "a trace of tens of MB: {size} bytes");

    // The embedded program: what is kept is the program itself.
    let open = || std::fs::File::open(&file.0).unwrap();
    let (read, peak) = peak_of(|| embedded_program_from_reader(open()));
    let read = read.unwrap();
    assert_eq!(read, p);
    let kept = ALLOC.current_usage();
    drop(read);
    let program_bytes = kept.saturating_sub(ALLOC.current_usage());
    eprintln!(
        "trace {size} bytes, {n} actions: the embedded program read with a peak of {peak} \
         bytes (the program: {program_bytes})"
    );
    assert!(
        peak <= program_bytes + program_bytes / 4 + (1 << 20),
        "{peak} bytes at the peak to read a program of {program_bytes} bytes"
    );
    assert!(peak < size / 3, "{peak} bytes at the peak for {size} bytes");

    // The timeline: what is kept is one slot (16 bytes) per action; the index of the
    // names and the timings read so far are bounded by the actions too.
    let (timeline, peak) = peak_of(|| timeline_from_trace_reader(&p, open(), 1000.0));
    let timeline = timeline.unwrap();
    eprintln!(
        "the timeline read with a peak of {peak} bytes ({:.1} per action, {:.3} of the file)",
        peak as f64 / n as f64,
        peak as f64 / size as f64
    );
    assert!(peak < size / 4, "{peak} bytes at the peak for {size} bytes");
    assert!(
        peak <= 100 * n + (1 << 20),
        "{peak} bytes at the peak for {n} actions"
    );
    // And it is the run's timeline (times rounded to 0.001 us, read in ms).
    assert_eq!(timeline.ranks.len(), t.ranks.len());
    for (a, b) in timeline
        .ranks
        .iter()
        .flatten()
        .zip(t.ranks.iter().flatten())
    {
        assert!((a.start - b.start).abs() <= 1e-6 && (a.end - b.end).abs() <= 1e-6);
    }
}

/// Calibrate's `measure`, after the reader: it kept every point-to-point operation
/// and transfer end in ordered maps keyed by tuples of names and numbers (about 360
/// MB above the reader at 8 x 65536); it now keeps one 24-byte key and a time per
/// transfer end, in one sorted vector, and a sample per operation, walking the
/// program twice. Its peak is bounded by a few tens of bytes per action, and its
/// answer is the simulator's costs back (a simulated timeline measures exactly).
#[test]
fn measuring_a_large_timeline_keeps_a_few_bytes_per_action() {
    let _g = serial();
    let (p, t) = run(8, 2048);
    let n = actions(&p);
    let (cal, peak) = peak_of(|| measure(&p, &t, Mode::Rendezvous, None));
    let cal = cal.unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "{n} actions measured with a peak of {peak} bytes ({:.1} per action)",
        peak as f64 / n as f64
    );
    assert!(
        peak <= 48 * n + (1 << 20),
        "{peak} bytes at the peak to measure {n} actions"
    );
    // Measured back exactly: the program's own costs, and the step.
    for u in &p.units {
        let mean = cal.units[&u.name].f.map(|s| s.mean).unwrap_or(f64::NAN);
        assert!(
            (mean - u.cost.f).abs() <= 1e-9 * u.cost.f.max(1.0),
            "{}: {mean} for {}",
            u.name,
            u.cost.f
        );
    }
    assert!(cal.step > 0.0);
}

/// A trace whose events are all there twice cannot match: the reader keeps no timing
/// once one name has more events than actions, and says how many are extra.
#[test]
fn a_trace_with_too_many_events_is_refused_in_memory_bounded_by_the_program() {
    let _g = serial();
    let (p, t) = run(8, 1024);
    let n = actions(&p);
    let (file, _) = write_trace("twice", &p, &t, false);
    let text = std::fs::read_to_string(&file.0).unwrap();
    let body = &text[text.find("[\n").unwrap() + 2..text.rfind("\n]").unwrap()];
    let mut twice = String::with_capacity(2 * text.len());
    twice.push_str("{\"traceEvents\":[\n");
    for i in 0..4 {
        if i > 0 {
            twice.push_str(",\n");
        }
        twice.push_str(body);
    }
    twice.push_str("\n]}");
    drop(text);
    let (out, peak) = peak_of(|| timeline_from_trace_reader(&p, twice.as_bytes(), 1000.0));
    match out {
        Err(TraceReadError::Extra { rank: 0, count, .. }) => {
            assert_eq!(count, 3 * p.programs[0].len())
        }
        other => panic!("{other:?}"),
    }
    eprintln!(
        "{} bytes of trace, 4 events per action: refused with a peak of {peak} bytes",
        twice.len()
    );
    assert!(
        peak <= 100 * n + (1 << 20),
        "{peak} bytes at the peak for {n} actions"
    );
    assert!(peak < twice.len() / 16, "{peak} bytes for {}", twice.len());
}

/// No program embedded: the refusal reads the file through in constant memory.
#[test]
fn a_large_trace_without_a_program_is_refused_in_constant_memory() {
    let _g = serial();
    let (p, t) = run(8, 1024);
    let (file, size) = write_trace("bare", &p, &t, false);
    let (out, peak) = peak_of(|| {
        let mut f = std::fs::File::open(&file.0).unwrap();
        let out = embedded_program_from_reader(&mut f);
        // The whole file was read to say so.
        let mut rest = Vec::new();
        f.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        out
    });
    assert_eq!(out, Err(TraceReadError::NoProgram));
    eprintln!("{size} bytes without a program: refused with a peak of {peak} bytes");
    assert!(peak < 1 << 20, "{peak} bytes at the peak for {size} bytes");
}
