//! `mpipe trace` at the largest size `mpipe` accepts (issue 37 item 2): derive,
//! simulate and stream the trace of `1f1b` on `profiles/encoder-heavy.toml` at
//! 8 ranks x 65536 micro-batches (2^19 rank x micro-batch pairs) into a sink, and
//! report the time and the process's peak resident memory (`VmHWM`, Linux).
//!
//! `cargo bench --bench trace` (one run: a run takes tens of seconds). Measured on
//! the 2-core test VM, 2026-12-05: 14.9 s (derive + simulate 4.7 s), 806 MB of
//! trace, 1070 MB peak resident; `mpipe trace ... -o t.json` 35 s and 1.10 GB under
//! load, the same peak as `mpipe simulate` and `mpipe derive` at that size: the
//! streamed writer adds nothing, the derivation (the program, its transfer
//! placements and the simulated timeline, two candidates at a time) is the peak.
//! Issue 37 asks for at most a few hundred MB here: not met yet.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::render::trace::{write_chrome_trace, TraceOptions};
use std::io::Write;
use std::time::Instant;

/// Peak resident memory of this process in kB, if the platform says.
fn peak_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Counts the bytes written.
struct Count(u64);

impl Write for Count {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn main() {
    // `cargo test --benches` runs bench targets once with `--bench` absent: skip.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/encoder-heavy.toml"
    ))
    .expect("profiles/encoder-heavy.toml");
    let profile = Profile::from_toml_str(&text).expect("the shipped profile parses");
    let (ranks, microbatches) = (8, mpipe_core::derive::MAX_MICROBATCHES);
    let started = Instant::now();
    let derived = derive_str(&Request::new(&profile, ranks, microbatches), "1f1b")
        .unwrap_or_else(|e| panic!("{e:?}"));
    let derive_s = started.elapsed().as_secs_f64();
    let mut out = std::io::BufWriter::new(Count(0));
    write_chrome_trace(
        &derived.program,
        &derived.report.timeline,
        &TraceOptions::default(),
        &mut out,
    )
    .expect("writing to a counter cannot fail");
    let bytes = out.into_inner().map(|c| c.0).unwrap_or(0);
    let total_s = started.elapsed().as_secs_f64();
    let peak = peak_kb().map_or("unknown".to_string(), |kb| {
        format!("{:.0} MB", kb as f64 / 1024.0)
    });
    println!(
        "trace {ranks} x {microbatches} 1f1b: derive + simulate {derive_s:.1} s, with the trace \
         {total_s:.1} s, {:.0} MB of trace, peak resident {peak}",
        bytes as f64 / 1e6
    );
}
