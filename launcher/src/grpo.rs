//! `training.stage: grpo` in the launcher: the rollouts' advantages, which batch each step
//! trains on, and the old log-probabilities of a batch trained on `grpo.num_iterations`
//! times. The loss itself is the workers' ([`mt::objective::grpo`], worker/src/head/).
//!
//! Step s trains on batch s / num_iterations (the sampler's global batch of that index).
//! On a batch's first step the ratio is 1 and, when num_iterations > 1, the workers send
//! back every completion token's log-probability: the old ones of the batch's later steps
//! (TRL records them once per generated batch, before its first update). They stay in host
//! RAM (4 bytes per completion token of one batch), in the batch's row order (so they do not
//! depend on the worker count), and go into every checkpoint
//! ([`mt::checkpoint::old_logps`]); a resume in the middle of a batch reads them from there.
//!
//! With `grpo.beta` > 0, the KL term's reference log-probabilities: the reference is the
//! run's initial model (TRL's initial policy), and no second copy of the model is kept.
//! Before the first step, with the initial model in the store (also on a resume, see
//! train/weights.rs), one forward-only pass over the rollouts (the eval path, cut into
//! micro-batches of the training micro-batch's rows in file order, worker r taking r, r +
//! W, …) gives every completion token's log-probability under it ([`reference_logps`]).
//! They stay in host RAM (4 bytes per completion token of the file) and travel with each
//! micro-batch. The eval rollouts' ([`crate::eval`]) come from the same pass over them,
//! right after. A launch's rollouts are fixed and its initial model is a function of the
//! config, so the pass gives the same values at every launch: nothing goes into
//! checkpoints but the name of the reference.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, ensure};
use mt::checkpoint::old_logps::{self, OldLogps};
use mt::checkpoint::reference::fingerprint;
use mt::config::{GrpoLoss, GrpoParams};
use mt::data::{Dataset, Example, RolloutTerms, StepPlan};

use crate::eval::{ForwardCut, token_logps};
use crate::supervisor::Supervisor;

/// A GRPO run's advantages and old log-probabilities (its settings go to the workers in
/// `Init`).
pub struct Policy {
    pub params: GrpoParams,
    /// Each row's group-relative advantage.
    pub advantages: Vec<f64>,
    /// The old log-probabilities of the batch being trained on.
    old: Option<OldLogps>,
    /// With `grpo.beta` > 0: every row's completion tokens' reference log-probabilities.
    refs: Option<Vec<Vec<f32>>>,
    data: String,
}

impl Policy {
    /// A server's (`mt-launch serve`): each batch brings its rows' advantages and, where
    /// given, old and reference log-probabilities; nothing is kept between batches.
    pub fn served(params: GrpoParams) -> Policy {
        Policy {
            params,
            advantages: Vec::new(),
            old: None,
            refs: None,
            data: String::new(),
        }
    }

    /// The advantages of `data`'s rollouts; when the run resumes at `start_step` in the
    /// middle of a batch, that batch's old log-probabilities from the checkpoint `resume`;
    /// `refs`: the reference log-probabilities ([`reference_logps`]) when `params.beta` > 0.
    pub fn new(
        params: GrpoParams,
        data: &Dataset,
        resume: Option<&Path>,
        start_step: u64,
        refs: Option<Vec<Vec<f32>>>,
    ) -> Result<Policy> {
        assert_eq!(
            refs.is_some(),
            params.beta > 0.0,
            "a KL term has its reference"
        );
        let r = data
            .rollouts
            .as_ref()
            .expect("a grpo dataset holds rollouts");
        let advantages =
            mt::objective::grpo::advantages(&r.rewards, &r.groups, params.scale_rewards);
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
            refs,
            data: fp,
        })
    }

    /// What step `step`'s rows carry: advantages, old and reference log-probabilities.
    pub fn terms(&self, step: u64) -> RolloutTerms<'_> {
        RolloutTerms {
            advantages: &self.advantages,
            old: self.old_for(step),
            refs: self.refs.as_deref(),
        }
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

/// Every row's completion tokens' log-probabilities under the weights in the store (the
/// initial model: the reference of `grpo.beta` > 0), computed by the workers forward only
/// in file order.
pub fn reference_logps(
    rows: &[Example],
    sup: &mut Supervisor,
    cut: ForwardCut,
) -> Result<Vec<Vec<f32>>> {
    let t = Instant::now();
    let refs = token_logps(rows, sup, cut, false)?;
    let secs = t.elapsed().as_secs_f64();
    let tokens: usize = rows.iter().map(|r| r.input_ids.len()).sum();
    println!(
        "GRPO reference pass (grpo.beta > 0, the initial model): {} completions ({tokens} tokens) forward only in {secs:.2}s ({:.0} tokens/s)",
        rows.len(),
        tokens as f64 / secs.max(1e-9)
    );
    tracing::info!(
        completions = rows.len(),
        reference_pass_s = format!("{secs:.3}"),
        "GRPO reference pass"
    );
    Ok(refs.into_iter().map(|(logps, _)| logps).collect())
}
