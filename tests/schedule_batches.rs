//! `schedule!`'s per-rank batch tables (`BATCHES`, issue 34 item 1): for every
//! schedule, each rank's compiled table is exactly the batches the generated code
//! posts (recorded call by call) and the batches the runtime derives from the program
//! (`mpipe::runtime::batches::derive`); the counts filled from the model at start-up
//! are the sizes of the buffers the runtime's arena plans for those transfers; and a
//! table from another derivation is refused.

use mpipe::core::program::Program;
use mpipe::runtime::arena::{self, Kind};
use mpipe::runtime::batches::{self, Count, DType, Entry, TableError};
use mpipe::runtime::record::{Call, NoSuchRank, Recorder};
use mpipe::runtime::{Dir, Tensor};

mpipe::schedule! { mod s_1f1b { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = 1f1b; } }
mpipe::schedule! { mod s_gpipe { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = gpipe; } }
mpipe::schedule! { mod s_zbh1 { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = zbh1; } }
mpipe::schedule! { mod s_inter { model = "profiles/encoder-heavy.toml"; ranks = 2; microbatches = 4; schedule = interleaved(v = 2); } }
mpipe::schedule! { mod s_transpose { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
mpipe::schedule! { mod s_transpose_zbv { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
// Loops inside loops on every rank (see tests/schedule_macro.rs).
mpipe::schedule! { mod s_nested { model = "docs/guide/examples/small-mllm.toml"; ranks = 4; microbatches = 48; schedule = zb2p(encoders = chain, costs = unit); } }
mpipe::schedule! { mod s_file { program = "tests/profiles/tiny-program.json"; } }

type Run = fn(usize, &mut Recorder) -> Result<(), NoSuchRank>;

struct Case {
    name: &'static str,
    json: &'static str,
    table: &'static [&'static [Entry]],
    run: Run,
}

fn cases() -> Vec<Case> {
    macro_rules! case {
        ($m:ident) => {
            Case {
                name: stringify!($m),
                json: $m::PROGRAM_JSON,
                table: &$m::BATCHES,
                run: $m::run,
            }
        };
    }
    vec![
        case!(s_1f1b),
        case!(s_gpipe),
        case!(s_zbh1),
        case!(s_inter),
        case!(s_transpose),
        case!(s_transpose_zbv),
        case!(s_nested),
        case!(s_file),
    ]
}

#[test]
fn tables_are_what_the_code_posts_and_the_runtime_derives() {
    for c in cases() {
        let program = Program::from_json(c.json).expect("PROGRAM_JSON parses");
        assert_eq!(c.table.len(), program.ranks, "{}", c.name);
        let mut items = 0;
        for (r, &table) in c.table.iter().enumerate() {
            let what = format!("{}, rank {r}", c.name);
            let derived = batches::derive(&program, r).expect("derive");
            let unrolled = batches::unroll(table).expect("unroll");
            assert_eq!(unrolled, derived, "{what}");
            let table = batches::check(table, &program, r).expect("the compiled table checks");

            // The generated code posts exactly these batches, in this order.
            let mut rec = Recorder::default();
            (c.run)(r, &mut rec).expect("recording never fails");
            let posted: Vec<_> = rec
                .calls
                .iter()
                .filter_map(|call| match call {
                    Call::P2p(b) => Some(b.clone()),
                    _ => None,
                })
                .collect();
            assert_eq!(posted.len(), table.len(), "{what}");
            for (p, t) in posted.iter().zip(&table) {
                let as_items: Vec<_> = p
                    .iter()
                    .map(|x| (x.dir, x.tensor, x.unit, x.mb, x.peer))
                    .collect();
                let compiled: Vec<_> = t
                    .items
                    .iter()
                    .map(|x| (x.dir, x.tensor, x.unit, x.mb, x.peer))
                    .collect();
                assert_eq!(as_items, compiled, "{what}: batch at action {}", t.first);
                for x in &t.items {
                    assert_eq!(x.dtype, DType::F32);
                    let want = match x.tensor {
                        Tensor::Act => Count::Output(x.unit),
                        Tensor::Grad => Count::InputGrads(x.unit),
                        Tensor::Input => Count::Zero,
                    };
                    assert_eq!(x.count, want, "{what}");
                }
                items += t.items.len();
            }
        }
        assert!(items > 0, "{}: no transfers at all", c.name);
    }
}

/// `s_nested`'s tables hold loops inside loops, as its code does (so the comparison
/// above covers them).
#[test]
fn nested_tables_hold_loops_inside_loops() {
    fn depth(entries: &[Entry]) -> usize {
        entries
            .iter()
            .map(|e| match e {
                Entry::Loop { body, .. } => 1 + depth(body),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }
    let deepest = s_nested::BATCHES.iter().map(|t| depth(t)).max();
    assert!(deepest >= Some(2), "{:?}", s_nested::BATCHES);
}

/// Counts filled at start-up from the model's output lengths equal the lengths of
/// the arena buffers the runtime receives those transfers into.
#[test]
fn start_up_counts_are_the_arena_buffers_sizes() {
    for c in cases() {
        let program = Program::from_json(c.json).expect("PROGRAM_JSON parses");
        // Distinct lengths per unit, so a count taken from the wrong unit shows.
        let out_len: Vec<usize> = (0..program.units.len()).map(|u| 100 + 37 * u).collect();
        for (r, &table) in c.table.iter().enumerate() {
            let what = format!("{}, rank {r}", c.name);
            let table = batches::check(table, &program, r).expect("check");
            let sizes = batches::sizes(&table, &program, &out_len).expect("sizes");
            let plan = arena::plan(&program, r, &out_len).expect("plan");
            for (b, n) in table.iter().zip(&sizes) {
                assert_eq!(b.items.len(), n.len(), "{what}");
                for (k, (x, &n)) in b.items.iter().zip(n).enumerate() {
                    let kind = match x.tensor {
                        Tensor::Act => Kind::Act,
                        Tensor::Grad => Kind::Grad,
                        Tensor::Input => {
                            assert_eq!(n, 0, "{what}: an input carries nothing");
                            continue;
                        }
                    };
                    if x.dir == Dir::Recv && x.peer != r {
                        let buf = plan
                            .defined_at(b.first + k, kind, x.unit, x.mb)
                            .unwrap_or_else(|| panic!("{what}: no buffer receives {x:?}"));
                        assert_eq!(plan.buffers[buf].len, n, "{what}: {x:?}");
                    }
                    if x.tensor == Tensor::Act {
                        assert_eq!(n, out_len[x.unit as usize], "{what}: {x:?}");
                    }
                }
            }
        }
        assert!(matches!(
            batches::sizes(
                &batches::unroll(c.table[0]).unwrap(),
                &program,
                &out_len[1..]
            ),
            Err(TableError::Lengths { .. })
        ));
    }
}

/// A table compiled for another schedule, or a rank's table used for another rank, is
/// refused with the first difference named.
#[test]
fn a_table_from_another_derivation_is_refused() {
    let one = Program::from_json(s_1f1b::PROGRAM_JSON).unwrap();
    let err = batches::check(s_gpipe::BATCHES[1], &one, 1).unwrap_err();
    assert!(matches!(err, TableError::Stale { rank: 1, .. }), "{err}");
    assert!(err.to_string().contains("different derivations"), "{err}");
    let err = batches::check(s_1f1b::BATCHES[2], &one, 1).unwrap_err();
    assert!(matches!(err, TableError::Stale { .. }), "{err}");
    assert_eq!(
        batches::check(s_1f1b::BATCHES[0], &one, 9),
        Err(TableError::NoSuchRank { rank: 9, ranks: 4 })
    );
}
