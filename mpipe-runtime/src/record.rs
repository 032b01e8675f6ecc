//! A backend that only records: every call becomes a [`Call`], so tests can compare
//! what generated code did with the derived program, action for action.

use crate::{P2p, Step, UnitId};

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Forward(UnitId, usize),
    BackwardInput(UnitId, usize),
    BackwardWeight(UnitId, usize),
    Backward(UnitId, usize),
    Recompute(UnitId, usize),
    P2p(Vec<P2p>),
    Broadcast {
        unit: UnitId,
        root: usize,
        group: Vec<usize>,
    },
    Reduce {
        unit: UnitId,
        root: usize,
        group: Vec<usize>,
    },
}

/// Records every call; never fails (except for a rank that does not exist).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recorder {
    pub calls: Vec<Call>,
}

/// The only error a [`Recorder`] returns.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank} does not exist: the schedule has {ranks} ranks (0..{ranks})")]
pub struct NoSuchRank {
    pub rank: usize,
    pub ranks: usize,
}

impl Step for Recorder {
    type Error = NoSuchRank;

    fn forward(&mut self, unit: UnitId, mb: usize) -> Result<(), NoSuchRank> {
        self.calls.push(Call::Forward(unit, mb));
        Ok(())
    }
    fn backward_input(&mut self, unit: UnitId, mb: usize) -> Result<(), NoSuchRank> {
        self.calls.push(Call::BackwardInput(unit, mb));
        Ok(())
    }
    fn backward_weight(&mut self, unit: UnitId, mb: usize) -> Result<(), NoSuchRank> {
        self.calls.push(Call::BackwardWeight(unit, mb));
        Ok(())
    }
    fn backward(&mut self, unit: UnitId, mb: usize) -> Result<(), NoSuchRank> {
        self.calls.push(Call::Backward(unit, mb));
        Ok(())
    }
    fn recompute(&mut self, unit: UnitId, mb: usize) -> Result<(), NoSuchRank> {
        self.calls.push(Call::Recompute(unit, mb));
        Ok(())
    }
    fn p2p(&mut self, batch: &[P2p]) -> Result<(), NoSuchRank> {
        self.calls.push(Call::P2p(batch.to_vec()));
        Ok(())
    }
    fn broadcast(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), NoSuchRank> {
        self.calls.push(Call::Broadcast {
            unit,
            root,
            group: group.to_vec(),
        });
        Ok(())
    }
    fn reduce(&mut self, unit: UnitId, root: usize, group: &[usize]) -> Result<(), NoSuchRank> {
        self.calls.push(Call::Reduce {
            unit,
            root,
            group: group.to_vec(),
        });
        Ok(())
    }
    fn no_such_rank(&mut self, rank: usize, ranks: usize) -> NoSuchRank {
        NoSuchRank { rank, ranks }
    }
}
