//! `training.stage: grpo` in the launcher: the rollouts' advantages, which batch each step
//! trains on, and the old log-probabilities of a batch trained on `grpo.num_iterations`
//! times. The loss itself is the workers' ([`mt::grpo`], worker/src/head.rs).
//!
//! Step s trains on batch s / num_iterations (the sampler's global batch of that index).
//! On a batch's first step the ratio is 1 and, when num_iterations > 1, the workers send
//! back every completion token's log-probability: the old ones of the batch's later steps
//! (TRL records them once per generated batch, before its first update). They stay in host
//! RAM (4 bytes per completion token of one batch), in the batch's row order (so they do not
//! depend on the worker count), and go into every checkpoint
//! ([`mt::checkpoint::old_logps`]); a resume in the middle of a batch reads them from there.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, ensure};
use mt::checkpoint::old_logps::{self, OldLogps};
use mt::checkpoint::reference::fingerprint;
use mt::config::{GrpoLoss, GrpoParams};
use mt::data::{Dataset, StepPlan};

/// A GRPO run's advantages and old log-probabilities (its settings go to the workers in
/// `Init`).
pub struct Policy {
    pub params: GrpoParams,
    /// Each row's group-relative advantage.
    pub advantages: Vec<f64>,
    /// The old log-probabilities of the batch being trained on.
    old: Option<OldLogps>,
    data: String,
}

impl Policy {
    /// The advantages of `data`'s rollouts; when the run resumes at `start_step` in the
    /// middle of a batch, that batch's old log-probabilities from the checkpoint `resume`.
    pub fn new(
        params: GrpoParams,
        data: &Dataset,
        resume: Option<&Path>,
        start_step: u64,
    ) -> Result<Policy> {
        let r = data
            .rollouts
            .as_ref()
            .expect("a grpo dataset holds rollouts");
        let advantages = mt::grpo::advantages(&r.rewards, &r.groups, params.scale_rewards);
        let fp = fingerprint(&data.rows);
        let n = params.num_iterations;
        let old = match resume {
            Some(dir) if !start_step.is_multiple_of(n) => {
                Some(OldLogps::read(dir, start_step / n, &fp)?)
            }
            _ => None,
        };
        Ok(Policy {
            params,
            advantages,
            old,
            data: fp,
        })
    }

    /// The index of the batch step `step` trains on.
    pub fn batch(&self, step: u64) -> u64 {
        step / self.params.num_iterations
    }

    /// The old log-probabilities step `step` trains with: none on a batch's first step.
    pub fn old_for(&self, step: u64) -> Option<&[f32]> {
        if step.is_multiple_of(self.params.num_iterations) {
            return None;
        }
        let old = self
            .old
            .as_ref()
            .filter(|o| o.batch == self.batch(step))
            .expect("a batch's later steps follow its first, which kept its log-probabilities");
        Some(&old.logps)
    }

    /// Keeps the log-probabilities the workers sent for step `step` (rank after rank) when
    /// it is a batch's first and the batch has later steps.
    pub fn keep(&mut self, step: u64, plan: &StepPlan, logps: Vec<f32>) -> Result<()> {
        if self.params.num_iterations == 1 || !step.is_multiple_of(self.params.num_iterations) {
            return Ok(());
        }
        ensure!(
            logps.len() as u64 == plan.tokens,
            "the workers sent {} log-probabilities for the {} completion tokens of step {}",
            logps.len(),
            plan.tokens,
            step + 1
        );
        self.old = Some(OldLogps {
            batch: self.batch(step),
            logps,
            data: self.data.clone(),
        });
        Ok(())
    }

    /// What the step's loss is a mean over: its completions, or under `dapo` its
    /// completion tokens.
    pub fn loss_units(&self, plan: &StepPlan) -> u64 {
        match self.params.loss {
            GrpoLoss::Dapo => plan.tokens,
            _ => plan.per_rank.iter().flatten().map(|m| m.rows as u64).sum(),
        }
    }

    /// The checkpoint file of the old log-probabilities, when a batch has later steps.
    pub fn file(&self) -> Option<(String, Arc<Vec<u8>>)> {
        let old = self
            .old
            .as_ref()
            .filter(|_| self.params.num_iterations > 1)?;
        Some((old_logps::FILE.to_string(), Arc::new(old.to_bytes())))
    }
}
