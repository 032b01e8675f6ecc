//! The plan a program computes: each rank's compute tasks in order, its raw-input
//! transfers and prefetched forwards, its transfers and collectives dropped. What
//! [`crate::search::relower`] derives again, and what the compute-order search
//! ([`crate::search::reorder`]) reads back from a candidate program.

use crate::algebra::analysis::PlanError;
use crate::ir::plan::{InputShip, Plan, Task};
use crate::ir::program::{ActionRef, Dir, Program, Tensor};
use crate::judge::simulate::{check_shape, SimError};
use std::collections::BTreeMap;

/// Why a program's communication cannot be derived again.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RelowerError {
    #[error(
        "rank {rank}, action {index}: unit `{unit}` is not in the program's units; \
         add it to `units` or fix the action"
    )]
    UnknownUnit {
        rank: usize,
        index: usize,
        unit: String,
    },
    #[error(
        "rank {rank}, action {index}: micro-batch {mb} does not exist (the program has \
         {microbatches}); fix `mb` or raise `microbatches`"
    )]
    Microbatch {
        rank: usize,
        index: usize,
        mb: usize,
        microbatches: usize,
    },
    #[error(
        "the program lists {lists} ranks' actions but declares `ranks` = {ranks}; make them agree"
    )]
    Ranks { lists: usize, ranks: usize },
    /// The document's units, sizes or prefetch entries cannot describe a program
    /// ([`crate::judge::simulate::check_shape`]).
    #[error("{0}")]
    Shape(SimError),
    #[error(
        "the compute order cannot run whatever the transfers: {0} (reorder that rank's \
         compute actions so each comes after what it reads)"
    )]
    Order(PlanError),
    #[error(
        "the compute actions break the validity rules, which re-deriving the transfers \
         cannot fix: {0}"
    )]
    Invalid(String),
    #[error(
        "with its transfers derived again, the program holds {peak} of memory on some \
         rank, above the limit {limit}; raise the limit or reorder the compute actions"
    )]
    Memory { peak: f64, limit: f64 },
    #[error("the re-derived program does not run (a bug in mpipe, please report it): {0}")]
    Internal(String),
}

/// The plan of `program`: its units, each rank's compute tasks in order, its raw-input
/// transfers and its prefetched forwards; transfers and collectives are dropped.
pub fn plan_of_program(program: &Program) -> Result<Plan, RelowerError> {
    if program.programs.len() != program.ranks {
        return Err(RelowerError::Ranks {
            lists: program.programs.len(),
            ranks: program.ranks,
        });
    }
    check_shape(program).map_err(RelowerError::Shape)?;
    let ids: BTreeMap<&str, usize> = program
        .units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name.as_str(), i))
        .collect();
    let unit_id = |rank: usize, index: usize, name: &str| {
        ids.get(name)
            .copied()
            .ok_or_else(|| RelowerError::UnknownUnit {
                rank,
                index,
                unit: name.to_string(),
            })
    };
    let check_mb = |rank: usize, index: usize, mb: usize| {
        if mb < program.microbatches {
            Ok(mb)
        } else {
            Err(RelowerError::Microbatch {
                rank,
                index,
                mb,
                microbatches: program.microbatches,
            })
        }
    };
    let mut order = vec![Vec::new(); program.ranks];
    let mut input_ships = Vec::new();
    for (rank, list) in program.programs.iter().enumerate() {
        for (index, action) in list.iter().enumerate() {
            match action.view() {
                ActionRef::Compute(c) => order[rank].push(Task::new(
                    c.op,
                    unit_id(rank, index, c.unit)?,
                    check_mb(rank, index, c.mb)?,
                )),
                ActionRef::P2p(x) if x.tensor == Tensor::Input && x.dir == Dir::Send => {
                    if x.peer >= program.ranks {
                        return Err(RelowerError::Invalid(format!(
                            "rank {rank}, action {index}: it sends to rank {}, which does not \
                             exist (the program has {} ranks)",
                            x.peer, program.ranks
                        )));
                    }
                    input_ships.push(InputShip {
                        unit: unit_id(rank, index, x.unit)?,
                        mb: check_mb(rank, index, x.mb)?,
                        from: rank,
                        to: x.peer,
                    });
                }
                _ => {}
            }
        }
    }
    input_ships.sort();
    let mut prefetch = Vec::with_capacity(program.prefetch.len());
    for p in &program.prefetch {
        let u = ids
            .get(&*p.unit)
            .copied()
            .ok_or_else(|| RelowerError::UnknownUnit {
                rank: 0,
                index: 0,
                unit: p.unit.to_string(),
            })?;
        prefetch.push((u, p.mb));
    }
    prefetch.sort();
    Ok(Plan {
        ranks: program.ranks,
        microbatches: program.microbatches,
        units: program.units.clone(),
        // The lowering needs neither: they describe how generators built a plan.
        stages: Vec::new(),
        encoders: Vec::new(),
        order,
        input_ships,
        prefetch,
        memory_limit: None,
    })
}

/// The plan read back from the program `expr` derives on the profile `profile`
/// (TOML) at `ranks` x `mbs`: a derived plan for tests.
#[cfg(test)]
pub(crate) fn derived_plan(profile: &str, (ranks, mbs): (usize, usize), expr: &str) -> Plan {
    let profile = crate::algebra::profile::Profile::from_toml_str(profile).unwrap();
    let req = crate::search::derive::Request::new(&profile, ranks, mbs);
    let derived = crate::search::derive::derive_str(&req, expr).unwrap();
    plan_of_program(&derived.program).unwrap()
}
