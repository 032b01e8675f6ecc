//! Issue 37 item 2: `mpipe trace` at the largest accepted size uses at most a few
//! hundred MB. What it does, in memory: derive the program (every placement rule's
//! lowering simulated, the fastest kept, then checked), simulate it again, and write
//! the trace with its flow arrows and the program embedded. Bytes are counted by
//! this binary's global allocator (deterministic), at 8 ranks x 4096 micro-batches
//! (1/16 of the largest size, so the test takes seconds; every table involved grows
//! linearly with the actions), per action of the derived program.
//!
//! The goal: at most 400 MB at 8 x 65536 ([`GOAL_BYTES_AT_LARGEST`]). Asserted, as
//! the peak here times 16 (the program at 8 x 65536 has 16 times the actions; every
//! table grows with them), for the reproducer, `1f1b` on
//! `profiles/encoder-heavy.toml`, and `transpose(vision, 1f1b)` there: about 230 and
//! 280 MB. Not reached for `zbv` on the profile with 16 LLM layers (two stages a
//! rank, 6.9 M actions: about 540 MB, 77 bytes an action where 400 MB is 58): for it
//! the figure is printed and the bounds below hold what is, phase by phase (`mpipe
//! trace` measures the same resident: `benches/trace.rs` runs all three at the
//! largest size), with where the rest is:
//!
//! - Simulating and writing the trace, the program held ([`TRACE_BYTES_PER_ACTION`]):
//!   the named program is 32 bytes an action, its timeline 16, and the simulator's
//!   working set at its peak about 14 (44 before this bound): a resolved action in
//!   8 bytes (16), 4 per transfer for its partner's operation (8 per action for
//!   operation ids and partner indices), about 13 per operation (the dependency
//!   lists and their reverse, 16 more, are gone: read from the partners). The memory
//!   counters are written rank by rank as they are found (`memory_curves`: all
//!   ranks' steps at once, about 24 bytes an action, before), and the flows' ends
//!   are gathered an eighth at a time (about 2). 62 to 63 (87 to 91 before). This
//!   phase alone is above `zbv`'s goal: the program and its timeline are 48.
//! - The derivation ([`WHOLE_BYTES_PER_ACTION`], the whole command's peak): 77 for
//!   `1f1b` and `zbv` (in `search/place.rs`: a candidate's lowering, 20 bytes a
//!   step, simulated, its resolved copy 8 and the engine's tables with the
//!   transfer ends being matched, beside the plan, its ideal timing and the
//!   prepared transfers), 85 for `transpose(vision, 1f1b)` (an alternative
//!   placement's plan and ideal-timing floor beside the derivation kept, program
//!   and report). 80, 83 and 91 before the ninth session's change: a step was 24
//!   bytes (its batch an `Option<u32>`), a timing's settle order a machine word a
//!   task, and `zbv`'s rank lists (as `zblist`'s and `zb2p`'s) grew by doubling
//!   on all ranks but the last (`vec![Vec::with_capacity(n); p]` clones an empty
//!   vector). 92 for `zbv` and 95 for `transpose` before the eighth: the periodic
//!   placement (`search/periodic.rs`) rewrote a rank beside the named program (32
//!   bytes an action), its report's timeline (16), the ranks' shapes (16 bytes a
//!   task and 8 a group) and its rewriting tables; now the timeline is not held
//!   from the first rank rewritten, the shapes not while a candidate is judged,
//!   and a rank's rewrite keeps a bit per moved transfer and 16 bytes per
//!   generated one. 89 to 102 before the bound of the seventh session: a prepared
//!   transfer 56 bytes (now 28), the verifier's resolved action 16 (now 8), a
//!   plan's dependency 40 (now 16); 98 to 122 before the one of the sixth (the
//!   simulator's working set; a placed transfer end 48 bytes, now 32; the periodic
//!   placement's tables keyed by unit name, 40 bytes a key, now 16; the verifier's
//!   transfer ends 16 bytes with their key, now 4).
//!
//! Reaching the goal for `zbv` needs both phases smaller: the trace phase (the
//! program and its timeline held while the trace is written) and the derivation's
//! search, where its peak is now: `search/place.rs` (a candidate's lowering and its
//! simulation beside the plan, a task 24 bytes, its ideal timing, 20, the prepared
//! transfers and the placements seen) and `choose_placement`
//! (`search/derive.rs`). The simulator reading a lowering's steps in place of its
//! resolved copy (8 bytes an action) was tried: 1 to 2 bytes an action lower at
//! the peak, 8.7% more instructions for a derivation (each step converted at every
//! reading), not kept.

use mpipe::core::derive::{derive_str, Request, MAX_MICROBATCHES};
use mpipe::core::profile::Profile;
use mpipe::core::render::trace::{write_chrome_trace, TraceOptions};
use mpipe::core::simulate::{simulate, Mode};
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// The most bytes held at the peak per action while the program is simulated and
/// the trace written, the program included: the program (32), its timeline (16)
/// and the simulator's working set (about 14).
const TRACE_BYTES_PER_ACTION: usize = 64;

/// The most bytes held at the peak per action by the whole command (the derivation's
/// peak is the larger): above every body's figure (77 to 85), below the figures
/// before the seventh session's bound (89 to 102) but for `1f1b`'s 89.
const WHOLE_BYTES_PER_ACTION: usize = 96;

/// What the whole command should hold at the largest size, 8 x 65536 (the issue's
/// "a few hundred MB"): asserted for the bodies of [`GOAL_HELD`], printed for all.
const GOAL_BYTES_AT_LARGEST: usize = 400_000_000;

/// The bodies that hold [`GOAL_BYTES_AT_LARGEST`]: the reproducer and its
/// `transpose`. Not `zbv` on 16 LLM layers (see the module's text).
const GOAL_HELD: [&str; 2] = ["1f1b", "transpose(vision, 1f1b)"];

/// The micro-batches measured here: the peak at the largest size is this peak
/// times `MAX_MICROBATCHES / MEASURED` (16).
const MEASURED: usize = 4096;

#[test]
fn tracing_a_large_step_holds_a_bounded_number_of_bytes_per_action() {
    // One body at a time: the allocator's peak is process-wide, and this is the only
    // test of the binary. `zbv` needs two stages per rank: the profile's 8 LLM layers
    // made 16 for it.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/encoder-heavy.toml");
    let text = std::fs::read_to_string(path).unwrap();
    let deeper = text.replace("[llm]\nlayers = 8\n", "[llm]\nlayers = 16\n");
    assert_ne!(deeper, text, "the profile's [llm] layers = 8 line moved");
    let mut failures = Vec::new();
    for (text, expr) in [
        (&text, "1f1b"),
        (&text, "transpose(vision, 1f1b)"),
        (&deeper, "zbv"),
    ] {
        let profile = Profile::from_toml_str(text).unwrap();
        ALLOC.reset_peak_usage();
        let base = ALLOC.current_usage();
        // As `mpipe trace` does: the derivation's own report is dropped, the program
        // simulated again, and the trace streamed.
        let req = Request::new(&profile, 8, MEASURED);
        let opts = req.sim_options(Mode::Rendezvous);
        let program = derive_str(&req, expr)
            .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
            .program;
        let derive_peak = ALLOC.peak_usage().saturating_sub(base);
        ALLOC.reset_peak_usage();
        let report = simulate(&program, &opts).unwrap();
        let trace = TraceOptions {
            embed_program: true,
            ..TraceOptions::default()
        };
        write_chrome_trace(&program, &report.timeline, &trace, &mut std::io::sink()).unwrap();
        let trace_peak = ALLOC.peak_usage().saturating_sub(base);
        let actions: usize = program.programs.iter().map(Vec::len).sum::<usize>().max(1);
        let (derive_per, trace_per) = (derive_peak / actions, trace_peak / actions);
        let whole_per = derive_per.max(trace_per);
        let largest = derive_peak.max(trace_peak) * (MAX_MICROBATCHES / MEASURED);
        eprintln!(
            "{expr}: {actions} actions; bytes an action at the peak: {derive_per} deriving, \
             {trace_per} simulating and writing the trace; at 8 x {MAX_MICROBATCHES} about \
             {} MB (the goal: {} MB)",
            largest / 1_000_000,
            GOAL_BYTES_AT_LARGEST / 1_000_000
        );
        if GOAL_HELD.contains(&expr) && largest > GOAL_BYTES_AT_LARGEST {
            failures.push(format!(
                "{expr}: {} bytes at the peak at 8 x {MEASURED}, so about {largest} at 8 x \
                 {MAX_MICROBATCHES} (at most {GOAL_BYTES_AT_LARGEST})",
                derive_peak.max(trace_peak)
            ));
        }
        if trace_per > TRACE_BYTES_PER_ACTION {
            failures.push(format!(
                "{expr} at 8 x {MEASURED}: {trace_peak} bytes at the peak simulating and writing \
                 the trace for {actions} actions, {trace_per} an action (at most \
                 {TRACE_BYTES_PER_ACTION})"
            ));
        }
        if whole_per > WHOLE_BYTES_PER_ACTION {
            failures.push(format!(
                "{expr} at 8 x {MEASURED}: {derive_peak} bytes at the derivation's peak for \
                 {actions} actions, {whole_per} an action (at most {WHOLE_BYTES_PER_ACTION})"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
