//! The device step issued from a compiled batch table (`DeviceRank::with_table`, issue
//! 34 item 1) against the interpreted path (`DeviceRank::new`, which derives the table
//! from the program), with the toy model at 4 ranks x 8 micro-batches:
//! - for 1f1b and transpose(vision, 1f1b), a table written from `batches::derive` as a
//!   compiled one is (rolled entries: `Skip`, `Batch`, a `Loop`) gives the same losses
//!   and gradients bit for bit, the same emulator counters and the same virtual-clock
//!   trace (the per-item transfer costs are charged in the table's item order) as `new`;
//! - a table compiled for another schedule, or another rank, is refused at start-up
//!   with `AscendError::Table(TableError::Stale)`, naming the first difference and
//!   saying to rebuild.
//!
//! (The emitted `BATCHES` of `schedule!` itself cannot be used here: the macro's code
//! names `::mpipe::runtime`, and a dev-dependency on the facade would link a second
//! copy of this crate. The facade's `tests/ascend_table_emitted.rs` runs the generated
//! code with its emitted tables; `tests/schedule_batches.rs` checks that those equal
//! `batches::derive`.)
//!
//! One binary of its own: the emulator's counters and clock are process-wide.
//! `cargo test --release --features ascend -p mpipe-runtime --test ascend_table`
#![cfg(feature = "ascend")]

#[path = "support/toy.rs"]
mod toy;

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::Program;
use mpipe_core::simulate::CommModel;
use mpipe_runtime::ascend::counters::{self, Counters, Trace};
use mpipe_runtime::ascend::device::DeviceRank;
use mpipe_runtime::ascend::{AscendComm, AscendError};
use mpipe_runtime::batches::{self, Entry, OwnedBatch, TableError, Transfer};
use mpipe_runtime::comm::Comm;
use mpipe_runtime::interpret;
use std::sync::{Barrier, Mutex};
use toy::{update, Toy, LEN, MBS};

const RANKS: usize = 4;

/// The device-step tests' profile, with message sizes and a link so that transfers
/// cost virtual time.
const PROFILE: &str = "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 2.0\nbackward = 2.0\n\
weight = 1.0\nactivation = 0.5\nparams = 0.5\ntrainable = true\noutput = 0.6\n\
[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.1\n\
output = 0.8\n[link]\nlatency = 0.15\nbandwidth = 2.0\n";

fn setup(expr: &str) -> (Program, Option<CommModel>) {
    let prof = Profile::from_toml_str(PROFILE).expect("profile");
    let prog = derive_str(&Request::new(&prof, RANKS, MBS), expr)
        .expect("derive")
        .program;
    (prog, prof.comm_model())
}

/// `batches` written as a compiled table is: gaps as `Skip`, and runs of batches that
/// repeat with the same gap before them and micro-batches moved by one stride rolled
/// into a `Loop` of `[Skip(gap), Batch]` (so that `unroll`'s loop path is exercised
/// too). Leaked: a compiled table is `'static`.
fn compiled(batches: &[OwnedBatch]) -> &'static [Entry] {
    fn transfers(b: &OwnedBatch, stride: i64) -> &'static [Transfer] {
        let t: Vec<Transfer> = b
            .items
            .iter()
            .map(|x| Transfer::new(x.dir, x.tensor, x.unit, x.mb as i64, stride, x.peer))
            .collect();
        Box::leak(t.into_boxed_slice())
    }
    fn leak(e: Vec<Entry>) -> &'static [Entry] {
        Box::leak(e.into_boxed_slice())
    }
    let end = |a: &OwnedBatch| a.first + a.items.len();
    // Whether `b` is `a` one loop iteration on.
    let next = |a: &OwnedBatch, b: &OwnedBatch, gap: usize, stride: i64| {
        b.first == end(a) + gap
            && a.items.len() == b.items.len()
            && a.items.iter().zip(&b.items).all(|(x, y)| {
                (x.dir, x.tensor, x.unit, x.peer) == (y.dir, y.tensor, y.unit, y.peer)
                    && y.mb as i64 - x.mb as i64 == stride
            })
    };
    let mut out = Vec::new();
    let mut at = 0;
    let mut k = 0;
    while k < batches.len() {
        let b = &batches[k];
        let gap = b.first - at;
        let mb = |o: &OwnedBatch| o.items.first().map_or(0, |x| x.mb as i64);
        let stride = batches.get(k + 1).map_or(0, |c| mb(c) - mb(b));
        let mut n = 1;
        while stride != 0
            && k + n < batches.len()
            && next(&batches[k + n - 1], &batches[k + n], gap, stride)
        {
            n += 1;
        }
        if n > 1 {
            let mut body = Vec::new();
            if gap > 0 {
                body.push(Entry::Skip(gap));
            }
            body.push(Entry::Batch(transfers(b, stride)));
            out.push(Entry::Loop {
                count: n,
                body: leak(body),
            });
        } else {
            if gap > 0 {
                out.push(Entry::Skip(gap));
            }
            out.push(Entry::Batch(transfers(b, 0)));
        }
        at = end(&batches[k + n - 1]);
        k += n;
    }
    leak(out)
}

/// Per rank, the compiled form of what `batches::derive` makes of `prog`.
fn tables(prog: &Program) -> Vec<&'static [Entry]> {
    (0..prog.ranks)
        .map(|r| compiled(&batches::derive(prog, r).expect("derive")))
        .collect()
}

/// What one run of two steps found (the second step measured).
#[derive(Debug)]
struct Outcome {
    /// Per rank, the second step's losses and every unit's gradient.
    losses: Vec<Vec<f32>>,
    grads: Vec<Vec<Vec<f32>>>,
    /// Per rank, the emulator's counters of the second step.
    counters: Vec<Counters>,
    trace: Trace,
    /// Per rank, its device id (the trace names devices).
    devices: Vec<i32>,
}

static DEVICES: Mutex<()> = Mutex::new(());

/// Two steps of `prog` with the toy model, every rank's `DeviceRank` made by `new` or
/// (with `tables`) by `with_table`; the second step on the virtual clock with `link`.
fn run(prog: &Program, link: Option<CommModel>, tables: Option<&[&'static [Entry]]>) -> Outcome {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let comms = AscendComm::world_in_process(RANKS).expect("world");
    let idle = Barrier::new(RANKS);
    let done = Barrier::new(RANKS);
    let trace = Mutex::new(None);
    let mut results = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (idle, done, trace) = (&idle, &done, &trace);
                s.spawn(move || -> Result<_, String> {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let dev = match tables {
                        None => DeviceRank::new(comm, prog, &lens),
                        Some(t) => DeviceRank::with_table(comm, prog, &lens, t[r]),
                    };
                    let mut dev = dev.map_err(|e| e.to_string())?;
                    assert_eq!(
                        dev.batches(),
                        batches::derive(prog, r).expect("derive").as_slice(),
                        "rank {r}: the batches the step issues"
                    );
                    dev.set_comm_model(link);
                    let mut model = Toy::new(prog, dev.kernels()).map_err(|e| e.to_string())?;
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    step.finish().map_err(|e| e.to_string())?;
                    update(&mut dev, &model).map_err(|e| e.to_string())?;
                    dev.kernels().synchronize().map_err(|e| e.to_string())?;
                    let device = dev.comm().device();
                    idle.wait();
                    counters::reset(device);
                    if r == 0 {
                        counters::clock_start();
                    }
                    idle.wait();
                    let mut step = dev.step(prog, &mut model);
                    interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                    let report = step.finish().map_err(|e| e.to_string())?;
                    let c = counters::snapshot(device).expect("emulator counters");
                    done.wait();
                    if r == 0 {
                        *trace.lock().unwrap_or_else(|e| e.into_inner()) = counters::clock_trace();
                        counters::clock_stop();
                    }
                    done.wait();
                    Ok((r, report.losses, model.read_grads(), c, device))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .expect("rank thread")
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .collect::<Vec<_>>()
    });
    results.sort_by_key(|x| x.0);
    let trace = trace
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .expect("the emulator keeps a trace");
    Outcome {
        losses: results.iter().map(|x| x.1.clone()).collect(),
        grads: results.iter().map(|x| x.2.clone()).collect(),
        counters: results.iter().map(|x| x.3).collect(),
        devices: results.iter().map(|x| x.4).collect(),
        trace,
    }
}

/// The trace without stream handles (which differ between runs): per device, each
/// stream's spans and end, in a canonical order.
/// A stream of the trace: its rank, its spans (label, start and end bits), its end.
type Stream = (usize, Vec<(String, u64, u64)>, u64);

fn spans(trace: &Trace, devices: &[i32]) -> Vec<Stream> {
    let mut out: Vec<_> = trace
        .streams
        .iter()
        .map(|s| {
            let rank = devices
                .iter()
                .position(|&d| d == s.device)
                .expect("a rank's device");
            let spans = s
                .spans
                .iter()
                .map(|x| (x.label.clone(), x.start.to_bits(), x.end.to_bits()))
                .collect();
            (rank, spans, s.end.to_bits())
        })
        .collect();
    out.sort();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_compiled_table_runs_the_step_the_program_runs() {
    for expr in ["1f1b", "transpose(vision, 1f1b)"] {
        let (prog, link) = setup(expr);
        let tables = tables(&prog);
        for (r, t) in tables.iter().enumerate() {
            assert_eq!(
                batches::unroll(t),
                batches::derive(&prog, r),
                "{expr}, rank {r}: the rolled table reads back"
            );
        }
        assert!(
            tables
                .iter()
                .any(|t| t.iter().any(|e| matches!(e, Entry::Loop { .. }))),
            "{expr}: some batches are rolled into loops"
        );
        let interpreted = run(&prog, link, None);
        let compiled = run(&prog, link, Some(&tables));
        assert!(
            interpreted.losses.iter().any(|l| l.len() == MBS),
            "{expr}: some rank computes the losses"
        );
        assert!(
            interpreted.counters.iter().any(|c| c.batch_items > 0),
            "{expr}: the step sends something"
        );
        for r in 0..RANKS {
            assert_eq!(
                bits(&compiled.losses[r]),
                bits(&interpreted.losses[r]),
                "{expr}, rank {r}: losses"
            );
            for (u, (a, b)) in compiled.grads[r]
                .iter()
                .zip(&interpreted.grads[r])
                .enumerate()
            {
                assert_eq!(bits(a), bits(b), "{expr}, rank {r}: gradient of unit {u}");
            }
            assert_eq!(
                compiled.counters[r], interpreted.counters[r],
                "{expr}, rank {r}: counters"
            );
            assert_eq!(compiled.counters[r].hazards, 0, "{expr}, rank {r}: hazards");
        }
        let a = spans(&compiled.trace, &compiled.devices);
        let b = spans(&interpreted.trace, &interpreted.devices);
        assert!(
            b.iter()
                .any(|s| s.1.iter().any(|x| x.0.starts_with("batch"))),
            "{expr}: batches are charged on the clock"
        );
        assert_eq!(a, b, "{expr}: the virtual-clock trace");
    }
}

/// `with_table` on every rank of a fresh world, returning each rank's result.
fn set_up(prog: &Program, tables: &[&'static [Entry]]) -> Vec<Result<(), AscendError>> {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let comms = AscendComm::world_in_process(RANKS).expect("world");
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    DeviceRank::with_table(comm, prog, &lens, tables[r]).map(|_| ())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

#[test]
fn a_table_of_another_schedule_or_rank_is_refused() {
    let (prog, _) = setup("transpose(vision, 1f1b)");
    let (other, _) = setup("1f1b");
    let theirs = tables(&other);
    for (r, res) in set_up(&prog, &theirs).into_iter().enumerate() {
        match res {
            Err(AscendError::Table(TableError::Stale { rank, what })) => {
                assert_eq!(rank, r);
                assert!(what.contains("batch"), "names the first difference: {what}");
                let msg = AscendError::Table(TableError::Stale {
                    rank,
                    what: what.clone(),
                })
                .to_string();
                assert!(msg.contains("rebuild"), "says what to do: {msg}");
            }
            other => panic!("rank {r}: 1f1b's table for transpose(vision, 1f1b): {other:?}"),
        }
    }
    // The right schedule's tables, but each rank given its neighbour's.
    let ours = tables(&prog);
    let shifted: Vec<_> = (0..RANKS).map(|r| ours[(r + 1) % RANKS]).collect();
    for (r, res) in set_up(&prog, &shifted).into_iter().enumerate() {
        assert!(
            matches!(res, Err(AscendError::Table(TableError::Stale { rank, .. })) if rank == r),
            "rank {r} given rank {}'s table: {res:?}",
            (r + 1) % RANKS
        );
    }
    // The right tables set up.
    for (r, res) in set_up(&prog, &ours).into_iter().enumerate() {
        assert_eq!(res, Ok(()), "rank {r}");
    }
}
