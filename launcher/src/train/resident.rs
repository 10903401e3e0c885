//! Resident blocks (`memory.resident_blocks`) between the launcher and its workers: their
//! state loaded into every worker before the first step, each update sent to the workers
//! as soon as its scalars are known, and their state saved back from rank 0 before a
//! checkpoint or the export reads the host's copy.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use mt::optim::AdamWStep;
use mt::protocol::{FromWorker, ResidentPart, ToWorker};

use super::Trainer;
use crate::supervisor::{Event, Supervisor, fatal};
use mt::host::HostState;

const PARTS: [ResidentPart; 3] = [ResidentPart::Master, ResidentPart::M, ResidentPart::V];

/// Every worker loads the resident blocks' state from the host's copy: before anything
/// reads them (a reference pass included), and again where the host's state was replaced
/// since (a resume after GRPO's reference pass).
pub(super) fn push_resident(
    host: &mut HostState,
    sup: &mut Supervisor,
    timeout: Duration,
) -> Result<()> {
    let n = host.resident_blocks();
    if n == 0 {
        return Ok(());
    }
    let t = Instant::now();
    let world = sup.world();
    for block in 0..n {
        for range in host.resident_pieces(block) {
            for part in PARTS {
                host.stage_resident(block, range.clone(), part);
                let msg = || ToWorker::ResidentCopy {
                    load: true,
                    block,
                    range: range.clone(),
                    part,
                };
                sup.broadcast(msg)?;
                await_copies(sup, world, timeout)?;
            }
        }
    }
    tracing::info!(
        blocks = n,
        seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
        "resident blocks loaded into the workers"
    );
    Ok(())
}

/// Waits for `n` workers' `ResidentCopied`.
fn await_copies(sup: &mut Supervisor, n: usize, timeout: Duration) -> Result<()> {
    let mut left = n;
    while left > 0 {
        match sup.next_event(timeout, &|_| true)? {
            Event::Msg(_, FromWorker::ResidentCopied) => left -= 1,
            Event::Msg(rank, FromWorker::Fatal { msg }) => return Err(fatal(rank, &msg)),
            Event::Msg(rank, other) => {
                bail!("worker rank {rank} sent {other:?} while copying resident blocks")
            }
            Event::Closed(rank) => return Err(sup.death(rank)),
        }
    }
    Ok(())
}

impl Trainer {
    /// Brings the host's copy of the resident blocks' master weights, and with `moments`
    /// their Adam moments, up to date from rank 0 (every worker holds the same bits). Runs
    /// between steps, after the last `ResidentUpdate`.
    pub(super) fn pull_resident(&mut self, moments: bool) -> Result<()> {
        let n = self.host.resident_blocks();
        if n == 0 {
            return Ok(());
        }
        let t = Instant::now();
        let parts = if moments { &PARTS[..] } else { &PARTS[..1] };
        for block in 0..n {
            for range in self.host.resident_pieces(block) {
                for &part in parts {
                    let msg = ToWorker::ResidentCopy {
                        load: false,
                        block,
                        range: range.clone(),
                        part,
                    };
                    self.sup.send(0, msg)?;
                    let timeout = Duration::from_secs(self.cfg.training.worker_timeout_s);
                    await_copies(&mut self.sup, 1, timeout)?;
                    self.host.take_resident(block, range.clone(), part);
                }
            }
        }
        tracing::info!(
            blocks = n,
            moments,
            seconds = format!("{:.2}", t.elapsed().as_secs_f64()),
            "resident blocks saved to the host"
        );
        Ok(())
    }

    /// Sends the workers the update of their resident blocks.
    pub(super) fn update_resident(&mut self, hp: &AdamWStep) -> Result<()> {
        if self.host.resident_blocks() == 0 {
            return Ok(());
        }
        self.sup.broadcast(|| ToWorker::ResidentUpdate { hp: *hp })
    }
}
