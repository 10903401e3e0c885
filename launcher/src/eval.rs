//! Evaluation: the loss of the whole eval set under the current weights, computed by the
//! workers forward only (`ToWorker::Eval`), between steps; and the forward-only runner it
//! shares with the reference passes of DPO and GRPO and a server's `forward` ([`forward_only`],
//! and over rows cut into micro-batches: [`token_logps`], [`row_logps`]).
//!
//! The eval set is cut once into micro-batches of `training.per_device_eval_batch_size`
//! rows (default: the training micro-batch; under `dpo` it counts pairs, two rows each),
//! each right-padded. Worker r computes micro-batches r, r + W, r + 2W, … with two in
//! flight, and the launcher adds their results in micro-batch order, so the result does
//! not depend on the number of workers: in float32 on CPU, W workers give one worker's
//! bits. What is computed follows the stage ([`Objective`]):
//!
//! - `pt`, `sft`: the summed token cross-entropy over the label tokens of the whole set
//!   over their count (not a mean of batch means);
//! - `dpo`: each row's summed label log-probability, then the pairs' DPO loss and TRL's
//!   reward metrics ([`mt::objective::dpo::pair_terms`], the training objective's own function) against
//!   the eval rows' reference log-probabilities (computed with the training rows' before
//!   the first step, [`crate::dpo`]): the mean loss over the eval pairs;
//! - `grpo`: each completion token's log-probability, then the GRPO loss of the whole set
//!   as one batch under the current policy ([`mt::objective::grpo::token_terms`] with ratio 1, as on a
//!   batch's first step), the advantages relative to the eval groups, the KL term (β > 0)
//!   against the eval rows' reference log-probabilities ([`crate::grpo::reference_logps`]).

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use mt::config::{DpoParams, GrpoLoss, GrpoParams, RunConfig};
use mt::data::{Example, MicroBatch, Rollouts, pad_batch};
use mt::metrics::{DpoMetrics, EvalGrpoMetrics, EvalMetrics};
use mt::protocol::{ForwardOnly, FromWorker, ToWorker};

use crate::supervisor::{Event, Supervisor, fatal};

/// Eval micro-batches a worker is sent ahead of its results.
const IN_FLIGHT: usize = 2;

/// What an evaluation computes, by `training.stage`.
pub enum Objective {
    /// The mean token cross-entropy (`pt`, `sft`).
    Tokens,
    /// `dpo`: the eval rows' reference log-probabilities (rows 2i, 2i + 1: pair i).
    Pairs { params: DpoParams, refs: Vec<f64> },
    /// `grpo`: the eval rows' advantages and rewards, and with β > 0 their completion
    /// tokens' reference log-probabilities.
    Rollouts {
        params: GrpoParams,
        advantages: Vec<f64>,
        rewards: Vec<f64>,
        refs: Option<Vec<Vec<f32>>>,
    },
}

impl Objective {
    /// `grpo`'s, from the eval rollouts `r`: advantages relative to their own groups, with
    /// the run's `grpo.scale_rewards`.
    pub fn rollouts(params: GrpoParams, r: Rollouts, refs: Option<Vec<Vec<f32>>>) -> Objective {
        Objective::Rollouts {
            params,
            advantages: mt::objective::grpo::advantages(
                &r.rewards,
                &r.groups,
                params.scale_rewards,
            ),
            rewards: r.rewards,
            refs,
        }
    }
}

pub struct EvalSet {
    micro: Vec<MicroBatch>,
    /// Each row's label tokens.
    row_tokens: Vec<u64>,
    /// Label tokens of the whole set.
    tokens: u64,
    /// Evaluate every this many steps (and after the last).
    every: Option<u64>,
    objective: Objective,
}

impl EvalSet {
    /// `rows_per_micro` rows per micro-batch (even under `dpo`), padded with `pad_id`.
    pub fn new(
        rows: &[Example],
        rows_per_micro: usize,
        pad_id: i32,
        every: Option<u64>,
        objective: Objective,
    ) -> EvalSet {
        assert!(rows_per_micro > 0);
        match &objective {
            Objective::Tokens => {}
            Objective::Pairs { refs, .. } => assert!(
                rows_per_micro.is_multiple_of(2) && refs.len() == rows.len(),
                "whole pairs per micro-batch, a reference per row"
            ),
            Objective::Rollouts {
                advantages, refs, ..
            } => assert!(
                advantages.len() == rows.len()
                    && refs.as_ref().is_none_or(|r| r.len() == rows.len()),
                "an advantage and a reference per row"
            ),
        }
        let micro = rows
            .chunks(rows_per_micro)
            .map(|c| pad_batch(&c.iter().collect::<Vec<_>>(), pad_id))
            .collect();
        let row_tokens: Vec<u64> = rows.iter().map(|r| r.label_tokens() as u64).collect();
        EvalSet {
            micro,
            tokens: row_tokens.iter().sum(),
            row_tokens,
            every,
            objective,
        }
    }

    /// The run's eval set of `rows`, over `world` workers: micro-batches of
    /// `training.per_device_eval_batch_size` samples (pairs under `dpo`, as
    /// `training.batch_size` counts them), by default the training micro-batch's rows.
    pub fn for_run(
        cfg: &RunConfig,
        world: usize,
        rows: &[Example],
        pad_id: i32,
        objective: Objective,
    ) -> EvalSet {
        let per_micro = rows_per_micro(cfg, world);
        EvalSet::new(rows, per_micro, pad_id, cfg.training.eval_steps, objective)
    }

    /// Whether to evaluate once `done` of `total` steps are done.
    pub fn due(&self, done: u64, total: u64) -> bool {
        done == total || self.every.is_some_and(|e| done.is_multiple_of(e))
    }

    /// Runs the eval set through the workers; every store block must hold final weights.
    pub fn evaluate(&self, sup: &mut Supervisor, timeout: Duration) -> Result<EvalMetrics> {
        let t = Instant::now();
        let make = |i: usize| self.micro[i].clone();
        let n = self.micro.len();
        let what = match self.objective {
            Objective::Tokens => ForwardOnly::Loss,
            Objective::Pairs { .. } => ForwardOnly::RowLogProbs,
            Objective::Rollouts { .. } => ForwardOnly::TokenLogProbs,
        };
        let out = forward_only(sup, n, &make, what, timeout)?;
        let mut m = EvalMetrics {
            eval_loss: 0.0,
            eval_tokens: self.tokens,
            eval_time_s: 0.0,
            dpo: None,
            grpo: None,
        };
        match &self.objective {
            Objective::Tokens => {
                let loss_sum: f64 = out.into_iter().map(|(loss, _)| loss).sum();
                m.eval_loss = loss_sum / self.tokens.max(1) as f64;
            }
            Objective::Pairs { params, refs } => {
                let logps: Vec<f64> = out.into_iter().flat_map(|(_, l)| l).collect();
                ensure!(
                    logps.len() == refs.len(),
                    "the eval pass gave {} log-probabilities for {} rows",
                    logps.len(),
                    refs.len()
                );
                let sums =
                    mt::objective::dpo::pair_terms(params, &logps, refs, &self.row_tokens, 1.0)
                        .sums;
                m.eval_loss = sums.loss / sums.pairs.max(1) as f64;
                m.dpo = Some(DpoMetrics::of(&sums).into());
            }
            Objective::Rollouts {
                params,
                advantages,
                rewards,
                refs,
            } => {
                let logps: Vec<f64> = out.into_iter().flat_map(|(_, l)| l).collect();
                ensure!(
                    logps.len() as u64 == self.tokens,
                    "the eval pass gave {} log-probabilities for {} completion tokens",
                    logps.len(),
                    self.tokens
                );
                let refs: Option<Vec<f64>> = refs
                    .as_ref()
                    .map(|r| r.iter().flatten().map(|&x| f64::from(x)).collect());
                let sums = mt::objective::grpo::token_terms(
                    params,
                    &logps,
                    None,
                    refs.as_deref(),
                    advantages,
                    &self.row_tokens,
                    1.0,
                )
                .sums;
                let units = match params.loss {
                    GrpoLoss::Dapo => sums.tokens,
                    _ => sums.completions,
                };
                m.eval_loss = sums.loss / units.max(1) as f64;
                m.grpo = Some(EvalGrpoMetrics {
                    eval_reward: rewards.iter().sum::<f64>() / rewards.len().max(1) as f64,
                    eval_kl: refs.map(|_| sums.kl / sums.tokens.max(1) as f64),
                });
            }
        }
        m.eval_time_s = t.elapsed().as_secs_f64();
        Ok(m)
    }
}

/// Rows per eval micro-batch over `world` workers: `training.per_device_eval_batch_size`
/// samples (pairs under `dpo`, as `training.batch_size` counts them), by default the
/// training micro-batch's rows. The reference passes cut the eval rows the same way, so
/// that before any update the eval rows' log-probabilities are their references' bits.
pub fn rows_per_micro(cfg: &RunConfig, world: usize) -> usize {
    let t = &cfg.training;
    let per_sample = cfg.rows_per_step() / t.batch_size.max(1);
    let per_micro = t.per_device_eval_batch_size.map_or(
        cfg.rows_per_step() / (world * t.gradient_accumulation_steps),
        |n| n * per_sample,
    );
    per_micro.max(per_sample)
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
        let set = |every| EvalSet::new(&[], 1, 0, every, Objective::Tokens);
        let due = |s: &EvalSet| (1..=7).filter(|&d| s.due(d, 7)).collect::<Vec<_>>();
        assert_eq!(due(&set(Some(3))), [3, 6, 7]);
        assert_eq!(due(&set(None)), [7]);
    }
}

/// How a forward-only pass over rows is cut: `rows` rows per micro-batch in order,
/// padded with `pad`, each answered within `timeout`.
#[derive(Debug, Clone, Copy)]
pub struct ForwardCut {
    pub rows: usize,
    pub pad: i32,
    pub timeout: Duration,
}

/// Per row: its label tokens' log-probabilities and (where asked) entropies.
pub type TokenValues = Vec<(Vec<f32>, Vec<f32>)>;

/// Every row's label tokens' log-probabilities under the weights in the store, computed by
/// the workers forward only (the f32 values the training head computes), and with
/// `entropy` each one's entropy of the predicted distribution (else none).
pub fn token_logps(
    rows: &[Example],
    sup: &mut Supervisor,
    cut: ForwardCut,
    entropy: bool,
) -> Result<TokenValues> {
    let (what, per_token) = match entropy {
        true => (ForwardOnly::TokenLogProbsEntropy, 2),
        false => (ForwardOnly::TokenLogProbs, 1),
    };
    let (rows_per_micro, pad_id, timeout) = (cut.rows, cut.pad, cut.timeout);
    assert!(rows_per_micro > 0);
    let chunk = |i: usize| &rows[i * rows_per_micro..((i + 1) * rows_per_micro).min(rows.len())];
    let n = rows.len().div_ceil(rows_per_micro);
    let make = |i: usize| pad_batch(&chunk(i).iter().collect::<Vec<_>>(), pad_id);
    let out = forward_only(sup, n, &make, what, timeout)?;
    let mut refs = Vec::with_capacity(rows.len());
    for (i, (_, values)) in out.iter().enumerate() {
        let want: usize = chunk(i).iter().map(|r| r.label_tokens()).sum();
        let (logps, entropy) = values.split_at(want.min(values.len()));
        ensure!(
            values.len() == want * per_token,
            "the forward-only pass gave {} values for the {want} label tokens of micro-batch {i} ({per_token} each)",
            values.len()
        );
        let mut at = 0;
        for r in chunk(i) {
            let k = r.label_tokens();
            // The worker's f32 values, widened exactly for the trip: narrowing is exact.
            let narrow = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
            let e = entropy.get(at..at + k).map_or_else(Vec::new, narrow);
            refs.push((narrow(&logps[at..at + k]), e));
            at += k;
        }
    }
    Ok(refs)
}

/// Each row's summed label-token log-probability under the weights in the store (DPO's
/// reference), computed by the workers forward only, `cut.rows` rows per micro-batch in
/// order.
pub fn row_logps(rows: &[Example], sup: &mut Supervisor, cut: ForwardCut) -> Result<Vec<f64>> {
    assert!(cut.rows > 0);
    let n = rows.len().div_ceil(cut.rows);
    let make = |i: usize| {
        let chunk = &rows[i * cut.rows..((i + 1) * cut.rows).min(rows.len())];
        pad_batch(&chunk.iter().collect::<Vec<_>>(), cut.pad)
    };
    let out = forward_only(sup, n, &make, ForwardOnly::RowLogProbs, cut.timeout)?;
    let logps: Vec<f64> = out.into_iter().flat_map(|(_, l)| l).collect();
    ensure!(
        logps.len() == rows.len(),
        "the forward-only pass gave {} log-probabilities for {} rows",
        logps.len(),
        rows.len()
    );
    Ok(logps)
}
