//! What the step driver does differently per objective ([`mt::objective::Objective`]), in
//! one place: which rows a step trains on and what they carry, what its loss is a mean
//! over, what it keeps from the workers' answers, what checkpoints hold of it, and its
//! metrics beyond the loss. The loss itself is the workers' (worker/src/head/).

use std::sync::Arc;

use anyhow::Result;
use mt::data::{Dataset, StepPlan, plan_pairs, plan_rollouts, plan_step};
use mt::metrics::{DpoMetrics, GrpoMetrics};
use mt::objective::ObjectiveSums;

use crate::dpo::Preference;
use crate::grpo::Policy;

/// A run's objective with the launcher's state of it.
pub(crate) enum Stage {
    /// `pt`, `sft`: the token cross-entropy, nothing kept.
    Lm,
    /// `dpo`: the reference log-probabilities.
    Dpo(Preference),
    /// `grpo`: the advantages, the old and the reference log-probabilities.
    Grpo(Policy),
}

/// Where a step's rows come from and how they are cut (`StepPlan`'s arguments).
pub(crate) struct Cut<'a> {
    pub data: &'a Dataset,
    pub world: usize,
    pub accum: usize,
    pub pad: i32,
}

impl Stage {
    /// The index of the sampler's global batch step `step` trains on (under GRPO, each
    /// batch serves `num_iterations` steps).
    pub fn batch(&self, step: u64) -> u64 {
        match self {
            Stage::Grpo(g) => g.batch(step),
            Stage::Lm | Stage::Dpo(_) => step,
        }
    }

    /// Step `step`'s micro-batches of the global batch `rows` (samples: rows, or pairs
    /// under DPO), with what each objective's rows carry.
    pub fn plan(&self, cut: &Cut, rows: &[usize], step: u64) -> StepPlan {
        let Cut {
            data,
            world,
            accum,
            pad,
        } = *cut;
        match self {
            Stage::Lm => plan_step(data, rows, world, accum, pad),
            Stage::Dpo(p) => plan_pairs(data, rows, world, accum, pad, &p.refs),
            Stage::Grpo(g) => plan_rollouts(data, rows, world, accum, pad, g.terms(step)),
        }
    }

    /// What the step's loss is a mean over: its label tokens, pairs or completions (its
    /// completion tokens under `dapo`); `loss_scale` is 1 / this.
    pub fn loss_units(&self, plan: &StepPlan) -> u64 {
        match self {
            Stage::Grpo(g) => g.loss_units(plan),
            Stage::Lm | Stage::Dpo(_) => plan.loss_units(),
        }
    }

    /// Keeps what the workers sent of step `step` beyond its gradient: under GRPO, on a
    /// batch's first step, its completion tokens' log-probabilities (rank after rank).
    pub fn keep(&mut self, step: u64, plan: &StepPlan, token_logps: Vec<f32>) -> Result<()> {
        match self {
            Stage::Grpo(g) => g.keep(step, plan, token_logps),
            Stage::Lm | Stage::Dpo(_) => Ok(()),
        }
    }

    /// The files a checkpoint holds beside the model and the optimizer state: DPO's
    /// reference log-probabilities, GRPO's old ones of a batch in progress.
    pub fn checkpoint_files(&self) -> Vec<(String, Arc<Vec<u8>>)> {
        match self {
            Stage::Lm => Vec::new(),
            // A server's batches bring their references: none is kept.
            Stage::Dpo(p) if p.refs.is_empty() => Vec::new(),
            Stage::Dpo(p) => {
                let mut files = vec![(mt::checkpoint::reference::FILE.to_string(), p.file.clone())];
                if let Some((_, eval)) = &p.eval {
                    let file = mt::checkpoint::reference::EVAL_FILE.to_string();
                    files.push((file, eval.clone()));
                }
                files
            }
            Stage::Grpo(g) => g.file().into_iter().collect(),
        }
    }

    /// The step's metrics of `sums` (the workers' sums over the step `plan`): DPO's or
    /// GRPO's, in `StepMetrics`' fields of each.
    pub fn metrics(
        &self,
        sums: &ObjectiveSums,
        plan: &StepPlan,
    ) -> (Option<DpoMetrics>, Option<GrpoMetrics>) {
        match (self, sums) {
            (Stage::Dpo(_), ObjectiveSums::Dpo(s)) => (Some(DpoMetrics::of(s)), None),
            (Stage::Grpo(g), ObjectiveSums::Grpo(s)) => {
                let kl = g.params.beta > 0.0;
                (None, Some(GrpoMetrics::of(s, &plan.rewards, kl)))
            }
            _ => (None, None),
        }
    }
}
