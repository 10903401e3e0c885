//! The step across nodes (`mpirun -np N mt-launch …`): node n runs the n-th contiguous
//! slice of the global batch's ranks on its own workers; each block's gradient, once final
//! on the node (its workers' slabs reduced as on one node), is summed over the nodes as the
//! backward goes on; the loss sums of every worker are gathered and added in global rank
//! order. Every node then holds the same gradient bits and runs the same update, so the
//! replicas of the host state stay identical (the update is deterministic).
//!
//! N nodes of W workers train as one node of N x W workers does, up to the order of the
//! gradient additions (`(s0 + s1) + (s2 + s3)` instead of `((s0 + s1) + s2) + s3`).

use anyhow::{Result, bail};
use mt::config::Stage;
use mt::data::StepPlan;

use super::Trainer;
use crate::mpi::Mpi;

/// Which blocks are final on this node, and the next one to exchange. Blocks are exchanged
/// in one fixed order on every node (collectives must match): from the last block down,
/// the order in which the backward finishes them.
pub(super) struct Exchange {
    /// Parts of each block's last micro-batch not yet reduced on this node.
    parts_left: Vec<usize>,
    /// The next block to exchange (counting down); `None` once all are.
    next: Option<usize>,
}

impl Exchange {
    pub(super) fn new(parts: &[Vec<std::ops::Range<usize>>]) -> Exchange {
        Exchange {
            parts_left: parts.iter().map(Vec::len).collect(),
            next: parts.len().checked_sub(1),
        }
    }

    /// Records that one part of `block`'s last micro-batch is reduced.
    pub(super) fn part_final(&mut self, block: usize) {
        self.parts_left[block] -= 1;
    }

    /// The next block to exchange, if it is final on this node.
    pub(super) fn due(&mut self) -> Option<usize> {
        let b = self.next?;
        if self.parts_left[b] > 0 {
            return None;
        }
        self.next = b.checked_sub(1);
        Some(b)
    }
}

impl Trainer {
    /// This launcher's MPI job, when there are several nodes.
    pub(super) fn nodes(&self) -> Option<&'static Mpi> {
        self.mpi
    }

    /// Whether this launcher writes the run's files (metrics, checkpoints, the model):
    /// node 0, or the only one.
    pub(super) fn lead(&self) -> bool {
        self.mpi.is_none_or(|m| m.rank == 0)
    }

    /// Workers over every node.
    pub(super) fn global_world(&self) -> usize {
        self.sup.world() * self.mpi.map_or(1, |m| m.size)
    }

    /// This node's ranks of the global `plan`: the n-th contiguous slice of them.
    pub(super) fn node_slice(&self, mut plan: StepPlan) -> StepPlan {
        if let Some(m) = self.mpi {
            let w = self.sup.world();
            plan.per_rank = plan.per_rank.drain(m.rank * w..(m.rank + 1) * w).collect();
        }
        plan
    }

    /// The sum of every worker's loss over all nodes, added in global rank order (as one
    /// node adds its workers'): the same bits as one node of all the workers.
    pub(super) fn global_loss(&self, local: &[f64]) -> Result<f64> {
        let all = match self.mpi {
            Some(m) => m.allgather_f64("the loss gather", local)?,
            None => local.to_vec(),
        };
        Ok(all.iter().fold(0.0, |a, b| a + b))
    }

    /// Sums block `block`'s gradient over the nodes; its Σ g².
    pub(super) fn exchange(&mut self, block: usize) -> Result<f64> {
        let m = self.mpi.expect("exchanges happen across nodes");
        self.host.exchange_block(block, m)
    }

    /// The stop signal any node received (all stop at the same step boundary).
    pub(super) fn stop_requested(&self) -> Result<Option<nix::sys::signal::Signal>> {
        let mine = crate::unix::stop_requested();
        let Some(m) = self.mpi else {
            return Ok(mine);
        };
        let any = m.max_i64("the stop check", mine.map_or(0, |s| s as i64))?;
        Ok(nix::sys::signal::Signal::try_from(any as i32).ok())
    }
}

/// Refuses what several nodes do not support yet.
pub(super) fn check_supported(mpi: Option<&Mpi>, stage: Stage) -> Result<()> {
    if mpi.is_some() && matches!(stage, Stage::Dpo | Stage::Grpo) {
        bail!(
            "training.stage: {} is not supported on several nodes yet (run it on one node)",
            stage.as_str()
        );
    }
    Ok(())
}
