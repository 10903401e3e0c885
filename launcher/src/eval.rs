//! Evaluation: the loss of the whole eval set under the current weights, computed by the
//! workers forward only (`ToWorker::Eval`), between steps; and the forward-only runner it
//! shares with DPO's reference pass ([`forward_only`]).
//!
//! The eval set is cut once into micro-batches of `training.per_device_eval_batch_size`
//! rows (default: the training micro-batch), each right-padded. Worker r computes
//! micro-batches r, r + W, r + 2W, … with two in flight, and the launcher adds their loss
//! sums in micro-batch order, so the result does not depend on the number of workers: in
//! float32 on CPU, W workers give one worker's bits. The loss is the summed token
//! cross-entropy over the label tokens of the whole set (not a mean of batch means).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use mt::data::{Example, pad_batch};
use mt::metrics::EvalMetrics;
use mt::protocol::{ForwardOnly, FromWorker, MicroBatch, ToWorker};

use crate::supervisor::{Event, Supervisor, fatal};

/// Eval micro-batches a worker is sent ahead of its results.
const IN_FLIGHT: usize = 2;

pub struct EvalSet {
    micro: Vec<MicroBatch>,
    /// Label tokens of the whole set.
    tokens: u64,
    /// Evaluate every this many steps (and after the last).
    every: Option<u64>,
}

impl EvalSet {
    /// `rows_per_micro` rows per micro-batch, padded with `pad_id`.
    pub fn new(
        rows: &[Example],
        rows_per_micro: usize,
        pad_id: i32,
        every: Option<u64>,
    ) -> EvalSet {
        assert!(rows_per_micro > 0);
        let micro = rows
            .chunks(rows_per_micro)
            .map(|c| pad_batch(&c.iter().collect::<Vec<_>>(), pad_id))
            .collect();
        let tokens = rows.iter().map(|r| r.label_tokens() as u64).sum();
        EvalSet {
            micro,
            tokens,
            every,
        }
    }

    /// Whether to evaluate once `done` of `total` steps are done.
    pub fn due(&self, done: u64, total: u64) -> bool {
        done == total || self.every.is_some_and(|e| done.is_multiple_of(e))
    }

    /// Runs the eval set through the workers; every store block must hold final weights.
    pub fn evaluate(&self, sup: &mut Supervisor, timeout: Duration) -> Result<EvalMetrics> {
        let t = Instant::now();
        let make = |i: usize| self.micro[i].clone();
        let sums = forward_only(sup, self.micro.len(), &make, ForwardOnly::Loss, timeout)?;
        let loss_sum: f64 = sums.into_iter().map(|(loss, _)| loss).sum();
        Ok(EvalMetrics {
            eval_loss: loss_sum / self.tokens.max(1) as f64,
            eval_tokens: self.tokens,
            eval_time_s: t.elapsed().as_secs_f64(),
        })
    }
}

/// Runs `n` forward-only micro-batches (`make(i)` is the i-th) through the workers under
/// the weights in the store: worker r computes i = r, r + W, …, with [`IN_FLIGHT`] sent
/// ahead. Returns each micro-batch's (loss sum, row or token log-probabilities) in order,
/// whichever worker computed it.
pub fn forward_only(
    sup: &mut Supervisor,
    n: usize,
    make: &dyn Fn(usize) -> MicroBatch,
    what: ForwardOnly,
    timeout: Duration,
) -> Result<Vec<(f64, Vec<f64>)>> {
    let world = sup.world();
    let mut results: Vec<Option<(f64, Vec<f64>)>> = vec![None; n];
    // Worker r computes micro-batches r, r + W, …; next[r] is the next one to send.
    let mut next: Vec<usize> = (0..world).collect();
    let mut out = vec![0usize; world];
    let send = |sup: &mut Supervisor, next: &mut Vec<usize>, out: &mut Vec<usize>, r: usize| {
        if next[r] < n {
            let index = next[r];
            next[r] += world;
            out[r] += 1;
            let micro = make(index);
            sup.send(r, ToWorker::Eval { index, micro, what })?;
        }
        anyhow::Ok(())
    };
    for r in 0..world {
        for _ in 0..IN_FLIGHT {
            send(sup, &mut next, &mut out, r)?;
        }
    }
    let mut left = n;
    while left > 0 {
        match sup.next_event(timeout, &|r| out[r] > 0)? {
            Event::Msg(
                rank,
                FromWorker::EvalDone {
                    index,
                    loss_sum,
                    logps,
                },
            ) => {
                let known = index < n && index % world == rank;
                if !known || results[index].replace((loss_sum, logps)).is_some() {
                    bail!(
                        "worker rank {rank} sent the result of forward-only micro-batch {index} unasked"
                    );
                }
                out[rank] -= 1;
                left -= 1;
                send(sup, &mut next, &mut out, rank)?;
            }
            Event::Msg(rank, FromWorker::Fatal { msg }) => return Err(fatal(rank, &msg)),
            Event::Msg(rank, other) => bail!("worker rank {rank} sent {other:?} mid-eval"),
            Event::Closed(rank) => return Err(sup.death(rank)),
        }
    }
    Ok(results.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_every_n_steps_and_at_the_end() {
        let set = |every| EvalSet::new(&[], 1, 0, every);
        let due = |s: &EvalSet| (1..=7).filter(|&d| s.due(d, 7)).collect::<Vec<_>>();
        assert_eq!(due(&set(Some(3))), [3, 6, 7]);
        assert_eq!(due(&set(None)), [7]);
    }
}
