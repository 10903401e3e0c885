//! A step's gradients as the workers deliver them: each part of a block reduced over the
//! workers' slabs once every worker has sent it, its slots freed at once, and across nodes
//! exchanged as soon as it is final here ([`super::nodes`]); then the workers' loss sums
//! (and their objective's sums) added in rank order; and the update of a block, which on
//! several nodes gives every node the block's updated weights.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use mt::objective::ObjectiveSums;
use mt::optim::AdamWStep;
use mt::protocol::{FromWorker, ToWorker, WorkerTimings};

use super::{Trainer, nodes};
use crate::supervisor::{Event, fatal};
use mt::host::IdleWork;

/// What the workers and the reduce reported for one step.
pub(super) struct StepOutcome {
    pub(super) loss_sum: f64,
    pub(super) slowest: WorkerTimings,
    pub(super) reduce_s: f64,
    /// Seconds in exchanges with the other nodes (the gradient's, the norm's, the loss's),
    /// and of those, the seconds spent waiting for the other nodes to reach them.
    pub(super) exchange_s: f64,
    pub(super) exchange_wait_s: f64,
    /// Seconds of the previous update's moments pass run during this step.
    pub(super) moments_s: f64,
    /// Σ g² over every parameter.
    pub(super) grad_sum_sq: f64,
    /// The update was skipped (non-finite loss or norm).
    pub(super) skipped: bool,
    /// Under DPO the pairs' sums over every worker, under GRPO the completions'; and under
    /// GRPO on a batch's first step the completion tokens' log-probabilities, rank after
    /// rank.
    pub(super) sums: ObjectiveSums,
    pub(super) token_logps: Vec<f32>,
}

impl Trainer {
    /// Applies update `hp` to block `block` (this node's pieces, where sharded) and gives
    /// every node the updated weights of the block (on one node, nothing to give).
    pub(super) fn update_block(&mut self, block: usize, hp: &AdamWStep) -> Result<()> {
        self.host.update_block(block, hp, self.moments);
        let (t, waited) = (Instant::now(), self.peers.waited());
        self.host.gather_store(block)?;
        self.update_exchange_s += t.elapsed().as_secs_f64();
        self.update_exchange_wait_s += (self.peers.waited() - waited).as_secs_f64();
        Ok(())
    }

    /// Reduces gradient parts as every worker delivers them, until all workers report
    /// the step done.
    pub(super) fn collect_gradients(&mut self) -> Result<StepOutcome> {
        let world = self.sup.world();
        let accum = self.cfg.training.gradient_accumulation_steps;
        let layout = &self.host.layout;
        // The element ranges each block's gradient travels in, by block.
        let parts: Vec<Vec<std::ops::Range<usize>>> = (0..layout.blocks.len())
            .map(|b| layout.grad_parts(b, self.host.slabs.slot_len()).collect())
            .collect();
        let expected_parts = accum * parts.iter().map(Vec::len).sum::<usize>();
        let mut pending: HashMap<(usize, usize, usize), Vec<Option<usize>>> = HashMap::new();
        // Across nodes, each block's gradient once final here ([`nodes`]).
        let mut exchange = self.nodes().map(|_| nodes::Exchange::new(&parts));
        let (mut reduced, mut done) = (0, 0);
        let mut out = StepOutcome {
            loss_sum: 0.0,
            slowest: WorkerTimings::default(),
            reduce_s: 0.0,
            exchange_s: 0.0,
            exchange_wait_s: 0.0,
            moments_s: 0.0,
            grad_sum_sq: 0.0,
            skipped: false,
            sums: ObjectiveSums::Lm,
            token_logps: Vec::new(),
        };
        let timeout = Duration::from_secs(self.cfg.training.worker_timeout_s);
        let waited_before = self.peers.waited();
        // Each rank's loss sum (and objective's sums), added in rank order at the end: the
        // reported loss does not depend on which worker finished first.
        type Done = (f64, ObjectiveSums, Vec<f32>);
        let mut step_done: Vec<Option<Done>> = vec![None; world];
        while done < world || reduced < expected_parts {
            // The last update's moments pass, then copies for the checkpoint in flight, fill
            // the time the launcher would wait.
            let event = match self.sup.try_event() {
                Some(event) => event,
                None => {
                    let t = Instant::now();
                    match self.host.idle_work() {
                        Some(IdleWork::Moments) => {
                            out.moments_s += t.elapsed().as_secs_f64();
                            continue;
                        }
                        Some(IdleWork::Staged) => continue,
                        None => self.sup.next_event(timeout, &|r| step_done[r].is_none())?,
                    }
                }
            };
            match event {
                Event::Msg(
                    rank,
                    FromWorker::LayerGrads {
                        micro,
                        block,
                        part,
                        slot,
                    },
                ) => {
                    let Some(range) = parts.get(block).and_then(|p| p.get(part)) else {
                        bail!(
                            "worker rank {rank} sent part {part} of block {block}; the layout has {} blocks, in {:?} parts",
                            parts.len(),
                            parts.iter().map(Vec::len).collect::<Vec<_>>()
                        );
                    };
                    let slots = pending
                        .entry((micro, block, part))
                        .or_insert_with(|| vec![None; world]);
                    if slots[rank].replace(slot).is_some() {
                        bail!(
                            "worker rank {rank} sent part {part} of block {block} of micro-batch {micro} twice"
                        );
                    }
                    if slots.iter().all(Option::is_some) {
                        let slots: Vec<usize> = pending
                            .remove(&(micro, block, part))
                            .into_iter()
                            .flatten()
                            .flatten()
                            .collect();
                        let t = Instant::now();
                        self.host.settle_moments_down_to(block);
                        out.moments_s += t.elapsed().as_secs_f64();
                        let t = Instant::now();
                        // The last micro-batch makes the part final: its share of the
                        // norm comes from the same pass, while the GPUs still work.
                        let (first, last) = (micro == 0, micro + 1 == accum);
                        let sum_sq =
                            self.host
                                .reduce_part(block, range.clone(), &slots, first, last);
                        for (r, &s) in slots.iter().enumerate() {
                            self.sup.send(r, ToWorker::SlotFree { slot: s })?;
                        }
                        let mut exchanged = Duration::ZERO;
                        match &mut exchange {
                            Some(x) => {
                                // The norm is over the sum across nodes.
                                if last {
                                    x.part_final(block);
                                }
                                let t = Instant::now();
                                x.run_due(&mut self.host, self.peers)?;
                                exchanged = t.elapsed();
                            }
                            None => out.grad_sum_sq += sum_sq,
                        }
                        out.exchange_s += exchanged.as_secs_f64();
                        out.reduce_s += (t.elapsed() - exchanged).as_secs_f64();
                        reduced += 1;
                    }
                }
                Event::Msg(
                    rank,
                    FromWorker::StepDone {
                        loss_sum,
                        timings,
                        sums,
                        token_logps,
                        ..
                    },
                ) => {
                    step_done[rank] = Some((loss_sum, sums, token_logps));
                    let s = &mut out.slowest;
                    s.forward_s = s.forward_s.max(timings.forward_s);
                    s.backward_s = s.backward_s.max(timings.backward_s);
                    s.slot_wait_s = s.slot_wait_s.max(timings.slot_wait_s);
                    s.update_wait_s = s.update_wait_s.max(timings.update_wait_s);
                    s.h2d_wait_s = s.h2d_wait_s.max(timings.h2d_wait_s);
                    s.d2h_s = s.d2h_s.max(timings.d2h_s);
                    s.peak_device_bytes = s.peak_device_bytes.max(timings.peak_device_bytes);
                    s.context_device_bytes =
                        s.context_device_bytes.max(timings.context_device_bytes);
                    done += 1;
                }
                Event::Msg(rank, FromWorker::Fatal { msg }) => return Err(fatal(rank, &msg)),
                Event::Msg(rank, other) => bail!("worker rank {rank} sent {other:?} mid-step"),
                Event::Closed(rank) => return Err(self.sup.death(rank)),
            }
        }
        let t = Instant::now();
        self.host.settle_moments();
        out.moments_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        if let Some(x) = exchange {
            out.grad_sum_sq = x.sum_sq(self.peers)?;
        }
        let losses: Vec<f64> = step_done.iter().flatten().map(|d| d.0).collect();
        out.loss_sum = self.global_loss(&losses)?;
        out.exchange_s += t.elapsed().as_secs_f64();
        out.exchange_wait_s = (self.peers.waited() - waited_before).as_secs_f64();
        for (rank, (_, sums, token_logps)) in step_done.into_iter().flatten().enumerate() {
            if !out.sums.add(&sums) {
                bail!("worker rank {rank} sent the sums of another objective than the run's");
            }
            out.token_logps.extend(token_logps);
        }
        Ok(out)
    }
}
