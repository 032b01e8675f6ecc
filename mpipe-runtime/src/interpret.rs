//! Running a rank's actions from a [`Program`] value instead of generated code: the
//! same calls, in the same order, that `mpipe::schedule!` emits for the rank (one per
//! action; consecutive point-to-point actions of one batch id as one [`Step::p2p`]).
//!
//! For programs known only at run time (a program file, a test's derived program);
//! generated code is the fast path. An action whose unit is not in the program's
//! unit list is passed as unit id `UnitId::MAX`, which every backend reports as
//! missing.

use crate::{Dir, P2p, Step, Tensor, UnitId};
use mpipe_core::program::{self, ActionRef, CollKind, Op, Program};

fn unit_id(p: &Program, name: &str) -> UnitId {
    p.unit_index(name).map_or(UnitId::MAX, |i| i as UnitId)
}

fn p2p(p: &Program, x: &program::P2pRef<'_>) -> P2p {
    P2p {
        dir: match x.dir {
            program::Dir::Send => Dir::Send,
            program::Dir::Recv => Dir::Recv,
        },
        tensor: match x.tensor {
            program::Tensor::Act => Tensor::Act,
            program::Tensor::Grad => Tensor::Grad,
            program::Tensor::Input => Tensor::Input,
        },
        unit: unit_id(p, x.unit),
        mb: x.mb,
        peer: x.peer,
    }
}

/// Runs `rank`'s actions of `program` on `step`, stopping at the first error.
pub fn run<S: Step>(program: &Program, rank: usize, step: &mut S) -> Result<(), S::Error> {
    let Some(list) = program.programs.get(rank) else {
        return Err(step.no_such_rank(rank, program.programs.len()));
    };
    let mut i = 0;
    while i < list.len() {
        match list[i].view() {
            ActionRef::Compute(c) => {
                let u = unit_id(program, c.unit);
                match c.op {
                    Op::F => step.forward(u, c.mb)?,
                    Op::B => step.backward_input(u, c.mb)?,
                    Op::W => step.backward_weight(u, c.mb)?,
                    Op::BW => step.backward(u, c.mb)?,
                    Op::RF => step.recompute(u, c.mb)?,
                }
                i += 1;
            }
            ActionRef::P2p(x) => {
                let mut batch = vec![p2p(program, &x)];
                let mut j = i + 1;
                if x.batch.is_some() {
                    while let Some(ActionRef::P2p(y)) = list.get(j).map(|a| a.view()) {
                        if y.batch != x.batch {
                            break;
                        }
                        batch.push(p2p(program, &y));
                        j += 1;
                    }
                }
                step.p2p(&batch)?;
                i = j;
            }
            ActionRef::Coll(c) => {
                let u = unit_id(program, c.unit);
                match c.kind {
                    CollKind::Bcast => step.broadcast(u, c.root, c.group)?,
                    CollKind::Reduce => step.reduce(u, c.root, c.group)?,
                }
                i += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::record::{Call, Recorder};
    use mpipe_core::derive::{derive_str, Request};
    use mpipe_core::profile::Profile;
    use mpipe_core::program::{ActionRef, Op};

    /// Interpreting a program makes exactly the calls its actions list, in order, a
    /// batch per batch id.
    #[test]
    fn interpreting_makes_the_programs_calls() {
        let prof = Profile::from_toml_str(
            "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n\
             params = 0.1\n",
        )
        .expect("profile");
        for expr in ["1f1b", "zbv", "interleaved(v = 2)"] {
            let prog = derive_str(&Request::new(&prof, 4, 8), expr)
                .expect("derive")
                .program;
            for rank in 0..4 {
                let mut rec = Recorder::default();
                run(&prog, rank, &mut rec).expect("runs");
                let list = &prog.programs[rank];
                let mut i = 0;
                for call in &rec.calls {
                    let name = |u: u32| prog.units[u as usize].name.as_str();
                    match (call, list[i].view()) {
                        (Call::P2p(batch), ActionRef::P2p(first)) => {
                            for (k, x) in batch.iter().enumerate() {
                                let ActionRef::P2p(a) = list[i + k].view() else {
                                    panic!(
                                        "{expr}, rank {rank}: action {} is not a transfer",
                                        i + k
                                    );
                                };
                                assert_eq!(
                                    (a.unit, a.mb, a.peer, a.batch),
                                    (name(x.unit), x.mb, x.peer, first.batch)
                                );
                            }
                            i += batch.len();
                        }
                        (Call::Forward(u, mb), ActionRef::Compute(c)) => {
                            assert_eq!((c.op, c.unit, c.mb), (Op::F, name(*u), *mb));
                            i += 1;
                        }
                        (Call::BackwardInput(u, mb), ActionRef::Compute(c)) => {
                            assert_eq!((c.op, c.unit, c.mb), (Op::B, name(*u), *mb));
                            i += 1;
                        }
                        (Call::BackwardWeight(u, mb), ActionRef::Compute(c)) => {
                            assert_eq!((c.op, c.unit, c.mb), (Op::W, name(*u), *mb));
                            i += 1;
                        }
                        (Call::Backward(u, mb), ActionRef::Compute(c)) => {
                            assert_eq!((c.op, c.unit, c.mb), (Op::BW, name(*u), *mb));
                            i += 1;
                        }
                        (Call::Broadcast { .. } | Call::Reduce { .. }, ActionRef::Coll(_)) => {
                            i += 1
                        }
                        (call, a) => panic!("{expr}, rank {rank}: call {call:?} for action {a:?}"),
                    }
                }
                assert_eq!(i, list.len(), "{expr}, rank {rank}: every action called");
            }
        }
        let mut rec = Recorder::default();
        let prog = derive_str(&Request::new(&prof, 4, 8), "1f1b")
            .expect("derive")
            .program;
        assert!(run(&prog, 9, &mut rec).is_err());
    }
}
