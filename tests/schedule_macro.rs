//! `schedule!` end to end: the generated code, run against a recording backend,
//! performs exactly the program mpipe-core derives, action for action, for every
//! body generator and operator.

use mpipe::core::program::{ActionRef, Dir as CoreDir, Program, Tensor as CoreTensor};
use mpipe::runtime::record::{Call, Recorder};
use mpipe::runtime::{Dir, P2p, Tensor};

mpipe::schedule! {
    /// 1F1B on the encoder-heavy profile.
    pub mod one_f_one_b {
        model = "profiles/encoder-heavy.toml";
        ranks = 4;
        microbatches = 8;
        schedule = 1f1b;
    }
}

mpipe::schedule! { mod gpipe_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = gpipe; } }
mpipe::schedule! { mod interleaved_s { model = "profiles/encoder-heavy.toml"; ranks = 2; microbatches = 4; schedule = interleaved(v = 2); } }
mpipe::schedule! { mod zbh1_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = zbh1; } }
mpipe::schedule! { mod zbv_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = zbv; } }
mpipe::schedule! { mod dualpipev_s { model = "profiles/encoder-heavy.toml"; ranks = 2; microbatches = 4; schedule = dualpipev; } }
mpipe::schedule! { mod transpose_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b); } }
mpipe::schedule! { mod transpose_central { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, 1f1b, backward = central, owners = min); } }
mpipe::schedule! { mod transpose_zbv { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, zbv); } }
mpipe::schedule! { mod from_file { program = "tests/profiles/tiny-program.json"; } }
mpipe::schedule! { mod zb2p_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = zb2p(v = 2); } }
mpipe::schedule! { mod refine_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = refine(transpose(vision, zb2p, owners = spare)); } }
mpipe::schedule! { mod inter_eager { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, interleaved(v = 2)); mode = eager; } }
mpipe::schedule! { mod inter_rdv { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = transpose(vision, interleaved(v = 2)); mode = rendezvous; } }
mpipe::schedule! { mod from_file_eager { program = "tests/profiles/tiny-program.json"; mode = eager; } }
mpipe::schedule! { mod layers_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = refine(layers(transpose(vision, zbh1))); } }
// Nested loops: zb2p's list scheduler with unit costs repeats a period that holds
// repetitions, so every rank's code is a loop holding loops
// (`nested_loops_run_the_derived_program` checks that it is).
mpipe::schedule! { mod nested_s { model = "docs/guide/examples/small-mllm.toml"; ranks = 4; microbatches = 48; schedule = zb2p(encoders = chain, costs = unit); } }
mpipe::schedule! { mod auto_s { model = "profiles/encoder-heavy.toml"; ranks = 4; microbatches = 8; schedule = auto; } }

/// The calls the derived program implies for `rank`: one per compute or collective
/// action, one per batch of point-to-point actions.
fn expected(p: &Program, rank: usize) -> Vec<Call> {
    let unit = |name: &str| p.unit_index(name).expect("known unit") as u32;
    let mut out: Vec<Call> = Vec::new();
    let mut batch: Option<u64> = None;
    for a in &p.programs[rank] {
        match a.view() {
            ActionRef::Compute(c) => {
                batch = None;
                let (u, mb) = (unit(c.unit), c.mb);
                out.push(match c.op {
                    mpipe::core::program::Op::F => Call::Forward(u, mb),
                    mpipe::core::program::Op::B => Call::BackwardInput(u, mb),
                    mpipe::core::program::Op::W => Call::BackwardWeight(u, mb),
                    mpipe::core::program::Op::BW => Call::Backward(u, mb),
                    mpipe::core::program::Op::RF => Call::Recompute(u, mb),
                });
            }
            ActionRef::P2p(x) => {
                let item = P2p {
                    dir: if x.dir == CoreDir::Send {
                        Dir::Send
                    } else {
                        Dir::Recv
                    },
                    tensor: match x.tensor {
                        CoreTensor::Act => Tensor::Act,
                        CoreTensor::Grad => Tensor::Grad,
                        CoreTensor::Input => Tensor::Input,
                    },
                    unit: unit(x.unit),
                    mb: x.mb,
                    peer: x.peer,
                };
                match (x.batch, batch, out.last_mut()) {
                    (Some(b), Some(prev), Some(Call::P2p(items))) if b == prev => items.push(item),
                    _ => out.push(Call::P2p(vec![item])),
                }
                batch = x.batch;
            }
            ActionRef::Coll(c) => {
                batch = None;
                let (u, root, group) = (unit(c.unit), c.root, c.group.to_vec());
                out.push(match c.kind {
                    mpipe::core::program::CollKind::Bcast => Call::Broadcast {
                        unit: u,
                        root,
                        group,
                    },
                    mpipe::core::program::CollKind::Reduce => Call::Reduce {
                        unit: u,
                        root,
                        group,
                    },
                });
            }
        }
    }
    out
}

type Run = fn(usize, &mut Recorder) -> Result<(), mpipe::runtime::record::NoSuchRank>;

fn check(name: &str, json: &str, ranks: usize, run: Run) {
    let program = Program::from_json(json).expect("PROGRAM_JSON parses");
    assert_eq!(program.ranks, ranks);
    for r in 0..ranks {
        let mut rec = Recorder::default();
        run(r, &mut rec).expect("recording never fails");
        assert_eq!(
            rec.calls,
            expected(&program, r),
            "{name}: rank {r} differs from the derived program"
        );
        assert!(!rec.calls.is_empty() || program.programs[r].is_empty());
    }
    let mut rec = Recorder::default();
    assert!(
        run(ranks, &mut rec).is_err(),
        "{name}: a rank past the end is an error, not a panic"
    );
}

macro_rules! check_all {
    ($($m:ident),*) => {
        $( check(stringify!($m), $m::PROGRAM_JSON, $m::RANKS, $m::run::<Recorder>); )*
    };
}

#[test]
fn generated_code_runs_the_derived_program() {
    check_all!(
        one_f_one_b,
        gpipe_s,
        interleaved_s,
        zbh1_s,
        zbv_s,
        dualpipev_s,
        transpose_s,
        transpose_central,
        transpose_zbv,
        from_file,
        zb2p_s,
        refine_s,
        layers_s,
        auto_s,
        inter_eager,
        from_file_eager,
        nested_s
    );
}

/// The nested case has loops inside loops (so the comparison above covers them).
#[test]
fn nested_loops_run_the_derived_program() {
    let program = Program::from_json(nested_s::PROGRAM_JSON).expect("PROGRAM_JSON parses");
    let rolled = mpipe::core::rolled::roll(&program).expect("rolls");
    let deepest = rolled
        .ranks
        .iter()
        .flatten()
        .map(mpipe::core::rolled::Block::depth)
        .max();
    assert!(deepest >= Some(2), "no nested loop:\n{rolled}");
    check(
        "nested_s",
        nested_s::PROGRAM_JSON,
        nested_s::RANKS,
        nested_s::run::<Recorder>,
    );
}

/// `mode = eager` derives for, and times under, eager transfers; the default and
/// `mode = rendezvous` are the same thing.
#[test]
fn mode_chooses_the_semantics_a_schedule_is_derived_for() {
    use mpipe::core::derive::{derive_str, Request};
    use mpipe::core::simulate::{simulate, Mode, SimOptions};
    assert_eq!(inter_eager::MODE, Mode::Eager);
    assert_eq!(inter_rdv::MODE, Mode::Rendezvous);
    assert_eq!(one_f_one_b::MODE, Mode::Rendezvous);
    let profile = heavy();
    let expr = "transpose(vision, interleaved(v = 2))";
    for (mode, json, makespan) in [
        (
            Mode::Eager,
            inter_eager::PROGRAM_JSON,
            inter_eager::MAKESPAN,
        ),
        (
            Mode::Rendezvous,
            inter_rdv::PROGRAM_JSON,
            inter_rdv::MAKESPAN,
        ),
    ] {
        let req = Request {
            mode,
            ..Request::new(&profile, 4, 8)
        };
        let d = derive_str(&req, expr).unwrap();
        assert_eq!(Program::from_json(json).unwrap(), d.program, "{mode:?}");
        assert_eq!(makespan, d.report.makespan, "{mode:?}");
    }
    // Sends that never wait can only help: the eager derivation is never slower.
    const { assert!(inter_eager::MAKESPAN <= inter_rdv::MAKESPAN) };
    // A program file is timed under the mode given too.
    let p = Program::from_json(from_file_eager::PROGRAM_JSON).unwrap();
    let eager = SimOptions {
        mode: Mode::Eager,
        ..SimOptions::default()
    };
    assert_eq!(from_file_eager::MODE, Mode::Eager);
    assert_eq!(
        from_file_eager::MAKESPAN,
        simulate(&p, &eager).unwrap().makespan
    );
}

/// The encoder-heavy profile the modules above are derived from.
fn heavy() -> mpipe::core::profile::Profile {
    mpipe::core::profile::Profile::from_toml_str(include_str!("../profiles/encoder-heavy.toml"))
        .unwrap()
}

/// `schedule = auto` searches at compile time; `EXPR` names the choice, and it is at
/// least as fast as every schedule written out above (checked at compile time).
#[test]
fn auto_chooses_at_compile_time() {
    assert_ne!(auto_s::EXPR, "auto");
    mpipe::core::expr::parse_str(auto_s::EXPR).expect("a parsable expression");
    const {
        assert!(auto_s::MAKESPAN <= one_f_one_b::MAKESPAN);
        assert!(auto_s::MAKESPAN <= zbh1_s::MAKESPAN);
        assert!(auto_s::MAKESPAN <= transpose_s::MAKESPAN);
        assert!(auto_s::MAKESPAN <= transpose_zbv::MAKESPAN);
    };
    let profile = heavy();
    let req = mpipe::core::derive::Request::new(&profile, 4, 8);
    let d = mpipe::core::derive::derive_str(&req, auto_s::EXPR).unwrap();
    assert_eq!(Program::from_json(auto_s::PROGRAM_JSON).unwrap(), d.program);
    // The search inside the macro plans and derives on worker threads too, among
    // the schedules it can emit (no `prefetch`): a candidate lost there would show
    // as another choice.
    let in_macro = mpipe::core::derive::Request {
        policy: mpipe::core::policy::SearchPolicy {
            prefetch: false,
            ..Default::default()
        },
        ..req
    };
    let here = mpipe::core::search::search(&in_macro).unwrap();
    assert_eq!(auto_s::EXPR, here.best.expr);
}

/// The compile-time derivation equals a run-time one (the macro adds nothing).
#[test]
fn compile_time_program_equals_run_time_derivation() {
    let profile = heavy();
    let req = mpipe::core::derive::Request::new(&profile, 4, 8);
    for (json, expr) in [
        (one_f_one_b::PROGRAM_JSON, "1f1b"),
        (zbv_s::PROGRAM_JSON, "zbv"),
        (transpose_s::PROGRAM_JSON, "transpose(vision, 1f1b)"),
    ] {
        let d = mpipe::core::derive::derive_str(&req, expr).unwrap();
        assert_eq!(Program::from_json(json).unwrap(), d.program, "{expr}");
    }
    assert_eq!(one_f_one_b::EXPR, "1f1b");
    assert_eq!(transpose_s::UNITS[0], "vision");
    assert_eq!(transpose_s::units::VISION, 0);
    assert_eq!(transpose_s::units::LLM_0, 1);
    // Cut layer by layer, units are named by model layer.
    assert!(layers_s::UNITS.contains(&"llm/0"));
    assert!(layers_s::UNITS.contains(&"vision/0"));
    let _ = layers_s::units::LLM_0;
    let d = mpipe::core::derive::derive_str(&req, "transpose(vision, 1f1b)").unwrap();
    assert_eq!(transpose_s::MAKESPAN, d.report.makespan);
    assert_eq!(transpose_s::PEAK_MEMORY.to_vec(), d.report.peak_memory);
    // Checked at compile time: the predicted speedup of transpose is over 2x here.
    const { assert!(transpose_s::MAKESPAN * 2.0 < one_f_one_b::MAKESPAN) };
}
