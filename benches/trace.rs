//! `mpipe trace` and `mpipe calibrate` at the largest size `mpipe` accepts (issue 37
//! item 2): derive, simulate and stream the trace of `1f1b` on
//! `profiles/encoder-heavy.toml` at 8 ranks x 65536 micro-batches (2^19 rank x
//! micro-batch pairs), with the program embedded, into a temporary file; then, in a
//! fresh process (so the derivation's peak does not hide the reader's), read it back
//! as `mpipe calibrate` does (the embedded program in one streamed pass, the timeline
//! in a second) and measure it. Then the same trace of the other main bodies, `zbv`
//! (on the profile with 16 LLM layers: two stages a rank) and `transpose(vision,
//! 1f1b)`, each in a process of its own. Reports the time
//! and the peak resident memory (`VmHWM`, Linux) of each process, and the reader's
//! peak over the program it holds.
//!
//! `cargo bench --bench trace` (one run of each: a run takes about a minute). The
//! figures measured are in CHANGELOG.md (issue 37 item 2; the third session of
//! 2026-12-05 for the derivation's peak: 1066 MB resident for `1f1b` before, 525 MB
//! after; the fourth session's for placement candidates judged by unit index; the
//! fifth session's for 32-byte actions and the flows gathered a share at a time).

use mpipe_core::calibrate::measure;
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::render::trace::{
    embedded_program_from_reader, timeline_from_trace_reader, write_chrome_trace, TraceOptions,
};
use mpipe_core::simulate::Mode;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// A resident-memory line of this process in MB (`VmHWM`: the peak; `VmRSS`: now).
fn status_mb(key: &str) -> String {
    let kb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(key))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        });
    kb.map_or("unknown".to_string(), |kb| {
        format!("{:.0} MB", kb as f64 / 1024.0)
    })
}

fn write(expr: &str, path: &Path) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/encoder-heavy.toml"
    ))
    .expect("profiles/encoder-heavy.toml");
    // `zbv` needs two stages per rank: the profile's 8 LLM layers made 16 for it.
    let text = if expr == "zbv" {
        text.replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 16\n")
    } else {
        text
    };
    let profile = Profile::from_toml_str(&text).expect("the shipped profile parses");
    let (ranks, microbatches) = (8, mpipe_core::derive::MAX_MICROBATCHES);
    let started = Instant::now();
    let derived = derive_str(&Request::new(&profile, ranks, microbatches), expr)
        .unwrap_or_else(|e| panic!("{e:?}"));
    let derive_s = started.elapsed().as_secs_f64();
    let derive_peak = status_mb("VmHWM:");
    let file = std::fs::File::create(path).expect("a temporary file");
    let mut out = std::io::BufWriter::new(file);
    let opts = TraceOptions {
        embed_program: true,
        ..TraceOptions::default()
    };
    write_chrome_trace(&derived.program, &derived.report.timeline, &opts, &mut out)
        .and_then(|()| out.flush())
        .expect("writing the trace");
    let total_s = started.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
    let actions: usize = derived.program.programs.iter().map(Vec::len).sum();
    println!(
        "write: trace {ranks} x {microbatches} {expr} ({actions} actions): derive + simulate \
         {derive_s:.1} s (peak resident {derive_peak}), with the trace {total_s:.1} s, {:.0} MB \
         of trace, peak resident {}",
        bytes as f64 / 1e6,
        status_mb("VmHWM:")
    );
}

fn read(path: &Path) {
    let open = || std::fs::File::open(path).expect("the trace just written");
    let started = Instant::now();
    let program = embedded_program_from_reader(open()).unwrap_or_else(|e| panic!("{e}"));
    let program_s = started.elapsed().as_secs_f64();
    let with_program = status_mb("VmRSS:");
    let timeline =
        timeline_from_trace_reader(&program, open(), 1000.0).unwrap_or_else(|e| panic!("{e}"));
    let read_s = started.elapsed().as_secs_f64();
    let read_peak = status_mb("VmHWM:");
    let cal =
        measure(&program, &timeline, Mode::Rendezvous, None).unwrap_or_else(|e| panic!("{e}"));
    let total_s = started.elapsed().as_secs_f64();
    println!(
        "read: the embedded program {program_s:.1} s (resident with it {with_program}), the \
         timeline {:.1} s more (peak resident {read_peak}); measured ({} units) {total_s:.1} s \
         in all, peak resident {}",
        read_s - program_s,
        cal.units.len(),
        status_mb("VmHWM:")
    );
}

/// This benchmark again, with `args`; panics when it fails.
fn again(args: &[&std::ffi::OsStr]) {
    let status = std::process::Command::new(std::env::current_exe().expect("this benchmark"))
        .args(args)
        .status();
    assert!(status.is_ok_and(|s| s.success()), "{args:?} failed");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // The reading half, in its own process.
    if let Some(i) = args.iter().position(|a| a == "--read-trace") {
        read(Path::new(&args[i + 1]));
        return;
    }
    // The writing half of one body, in its own process.
    if let Some(i) = args.iter().position(|a| a == "--write-trace") {
        write(&args[i + 1], Path::new(&args[i + 2]));
        return;
    }
    // `cargo test --benches` runs bench targets once with `--bench` absent: skip.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let path = std::env::temp_dir().join(format!("mpipe-bench-trace-{}.json", std::process::id()));
    for expr in ["1f1b", "zbv", "transpose(vision, 1f1b)"] {
        again(&["--write-trace".as_ref(), expr.as_ref(), path.as_os_str()]);
        if expr == "1f1b" {
            again(&["--read-trace".as_ref(), path.as_os_str()]);
        }
    }
    let _ = std::fs::remove_file(&path);
}
