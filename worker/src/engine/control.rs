//! What the launcher has told a worker between its own actions (`super::Engine`'s view of
//! the protocol mid-step): free slab slots, blocks whose update has landed, and which parts
//! of resident blocks have their reduced gradient final.

use std::time::Instant;

use anyhow::{Result, bail};
use ipc_channel::TryRecvError;
use ipc_channel::ipc::IpcReceiver;
use mt::protocol::ToWorker;

use super::{Interrupted, WAIT_TIMEOUT};

/// What the launcher has told this worker between its own actions: which slab slots are
/// free and which store blocks hold this step's weights.
pub(super) struct Control {
    pub(super) free_slots: Vec<usize>,
    pub(super) ready: Vec<bool>,
    /// Seconds spent in [`Control::wait_block`] waiting for an update, this step.
    pub(super) update_wait_s: f64,
    /// Blocks `..resident` are resident: what each announced slot holds (slot -> micro,
    /// block, part), so that freeing it tells which part of a resident block's reduced
    /// gradient is final (that of the step's last micro-batch, `last_micro`).
    pub(super) resident: usize,
    pub(super) sent: std::collections::HashMap<usize, (usize, usize, usize)>,
    pub(super) last_micro: usize,
    /// (block, part) of resident blocks whose reduced gradient is final, not yet copied.
    pub(super) final_parts: Vec<(usize, usize)>,
}

impl Control {
    pub(super) fn handle(&mut self, msg: ToWorker) -> Result<()> {
        match msg {
            ToWorker::SlotFree { slot } => {
                debug_assert!(!self.free_slots.contains(&slot));
                self.free_slots.push(slot);
                if let Some((micro, block, part)) = self.sent.remove(&slot)
                    && block < self.resident
                    && micro == self.last_micro
                {
                    self.final_parts.push((block, part));
                }
            }
            ToWorker::BlockReady { block } => match self.ready.get_mut(block) {
                Some(r) => *r = true,
                None => bail!(
                    "BlockReady for block {block}, the layout has {}",
                    self.ready.len()
                ),
            },
            ToWorker::Shutdown => return Err(Interrupted.into()),
            other => bail!("unexpected message mid-step: {other:?}"),
        }
        Ok(())
    }

    /// Waits for (and handles) the launcher's next message.
    pub(super) fn receive(
        &mut self,
        rx: &IpcReceiver<ToWorker>,
        deadline: Instant,
        waiting_for: &str,
    ) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.try_recv_timeout(left) {
            Ok(msg) => self.handle(msg),
            Err(TryRecvError::Empty) => bail!("waited {WAIT_TIMEOUT:?} for {waiting_for}"),
            Err(TryRecvError::IpcError(e)) => bail!("launcher channel closed: {e:?}"),
        }
    }

    /// Returns once store block `block` holds this step's weights.
    pub(super) fn wait_block(&mut self, block: usize, rx: &IpcReceiver<ToWorker>) -> Result<()> {
        if self.ready[block] {
            return Ok(());
        }
        let start = Instant::now();
        let deadline = start + WAIT_TIMEOUT;
        while !self.ready[block] {
            self.receive(rx, deadline, &format!("the update of block {block}"))?;
        }
        self.update_wait_s += start.elapsed().as_secs_f64();
        Ok(())
    }
}
