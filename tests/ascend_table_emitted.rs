//! The device step driven by the code `schedule!` generates, with the batch table it
//! emits (`BATCHES[rank]`, issue 34 item 1) handed to `DeviceRank::with_table`: for
//! 1f1b and transpose(vision, 1f1b) at 4 ranks x 8 micro-batches, with the runtime's
//! toy device model, every rank's losses and gradients equal bit for bit those of the
//! interpreted path (`DeviceRank::new`, the table derived from the program, the step
//! driven by `interpret::run`), and the emulator's counters are equal. A table emitted
//! for another schedule is refused at start-up.
//!
//! `cargo test --release --features ascend --test ascend_table_emitted`
#![cfg(feature = "ascend")]

#[path = "../mpipe-runtime/tests/support/toy.rs"]
mod toy;

use mpipe::core::program::Program;
use mpipe::runtime::ascend::counters::{self, Counters};
use mpipe::runtime::ascend::device::{DeviceRank, DeviceStep};
use mpipe::runtime::ascend::{AscendComm, AscendError};
use mpipe::runtime::batches::{Entry, TableError};
use mpipe::runtime::comm::Comm;
use mpipe::runtime::interpret;
use std::sync::Mutex;
use toy::{update, Toy, LEN};

mpipe::schedule! { mod s_1f1b { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = 1f1b; } }
mpipe::schedule! { mod s_t1f1b { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }

type Run = fn(usize, &mut DeviceStep<'_, Toy>) -> Result<(), mpipe::runtime::exec::ExecError>;

struct Case {
    name: &'static str,
    json: &'static str,
    table: &'static [&'static [Entry]],
    run: Run,
}

fn cases() -> [Case; 2] {
    [
        Case {
            name: "1f1b",
            json: s_1f1b::PROGRAM_JSON,
            table: &s_1f1b::BATCHES,
            run: |r, s| s_1f1b::run(r, s),
        },
        Case {
            name: "transpose(vision, 1f1b)",
            json: s_t1f1b::PROGRAM_JSON,
            table: &s_t1f1b::BATCHES,
            run: |r, s| s_t1f1b::run(r, s),
        },
    ]
}

static DEVICES: Mutex<()> = Mutex::new(());

/// Per rank: the second step's losses, gradients and counters. With `generated`, the
/// rank is made with the emitted table and the steps driven by the generated code.
fn run(prog: &Program, case: &Case, generated: bool) -> Vec<(Vec<f32>, Vec<Vec<f32>>, Counters)> {
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let comms = AscendComm::world_in_process(prog.ranks).expect("world");
    let barrier = std::sync::Barrier::new(prog.ranks);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let barrier = &barrier;
                s.spawn(move || -> Result<_, String> {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    let dev = if generated {
                        DeviceRank::with_table(comm, prog, &lens, case.table[r])
                    } else {
                        DeviceRank::new(comm, prog, &lens)
                    };
                    let mut dev = dev.map_err(|e| e.to_string())?;
                    let mut model = Toy::new(prog, dev.kernels()).map_err(|e| e.to_string())?;
                    let mut out = None;
                    for step_no in 0..2 {
                        if step_no == 1 {
                            dev.kernels().synchronize().map_err(|e| e.to_string())?;
                            barrier.wait();
                            counters::reset(dev.comm().device());
                            barrier.wait();
                        }
                        let mut step = dev.step(prog, &mut model);
                        if generated {
                            (case.run)(r, &mut step).map_err(|e| e.to_string())?;
                        } else {
                            interpret::run(prog, r, &mut step).map_err(|e| e.to_string())?;
                        }
                        let report = step.finish().map_err(|e| e.to_string())?;
                        if step_no == 1 {
                            let device = dev.comm().device();
                            let c = counters::snapshot(device).expect("emulator counters");
                            out = Some((report.losses, model.read_grads(), c));
                        }
                        update(&mut dev, &model).map_err(|e| e.to_string())?;
                    }
                    dev.kernels().synchronize().map_err(|e| e.to_string())?;
                    Ok((r, out.expect("two steps")))
                })
            })
            .collect();
        let mut per_rank: Vec<_> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .expect("rank thread")
                    .unwrap_or_else(|e| panic!("{}: {e}", case.name))
            })
            .collect();
        per_rank.sort_by_key(|x| x.0);
        per_rank.into_iter().map(|x| x.1).collect()
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_generated_code_with_its_emitted_table_runs_the_interpreted_step() {
    for case in cases() {
        let prog = Program::from_json(case.json).expect("PROGRAM_JSON parses");
        let generated = run(&prog, &case, true);
        let interpreted = run(&prog, &case, false);
        assert!(
            interpreted.iter().any(|x| !x.0.is_empty()),
            "{}: some rank computes the losses",
            case.name
        );
        assert!(
            interpreted.iter().any(|x| x.2.batch_items > 0),
            "{}: the step transfers something",
            case.name
        );
        for (r, (g, i)) in generated.iter().zip(&interpreted).enumerate() {
            assert_eq!(bits(&g.0), bits(&i.0), "{}, rank {r}: losses", case.name);
            for (u, (a, b)) in g.1.iter().zip(&i.1).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(b),
                    "{}, rank {r}: gradient of unit {u}",
                    case.name
                );
            }
            assert_eq!(g.2, i.2, "{}, rank {r}: counters", case.name);
            assert_eq!(g.2.hazards, 0, "{}, rank {r}: hazards", case.name);
        }
    }
}

#[test]
fn an_emitted_table_of_another_schedule_is_refused() {
    let [one, transposed] = cases();
    let prog = Program::from_json(transposed.json).expect("PROGRAM_JSON parses");
    let _devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let comms = AscendComm::world_in_process(prog.ranks).expect("world");
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (prog, table) = (&prog, one.table);
                s.spawn(move || {
                    let r = comm.rank();
                    let lens = vec![LEN; prog.units.len()];
                    (
                        r,
                        DeviceRank::with_table(comm, prog, &lens, table[r]).map(|_| ()),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    for (r, res) in results {
        match res {
            Err(AscendError::Table(TableError::Stale { rank, what })) => {
                assert_eq!(rank, r);
                assert!(what.contains("batch"), "names the first difference: {what}");
            }
            other => {
                panic!("rank {r}: 1f1b's emitted table for transpose(vision, 1f1b): {other:?}")
            }
        }
    }
}
