//! The `grpo` section (TRL's `GRPOConfig` names and defaults) and what `training.stage:
//! grpo` checks of the rest of the config.

use serde::{Deserialize, Serialize};

use super::RunConfig;
use crate::error::{Error, Result};

/// The `grpo` section: TRL's `GRPOConfig` names, with its defaults (TRL 0.2x: `loss_type:
/// dapo`, `epsilon: 0.2`, `epsilon_high` = `epsilon`, `num_iterations: 1`, `beta: 0`,
/// `scale_rewards: group`, `max_completion_length: 256`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpoSection {
    /// How the per-token losses are averaged: `grpo` (over each completion's tokens, then
    /// over completions), `dapo` (over every completion token of the step, the default) or
    /// `dr_grpo` (a sum over tokens / (completions x `max_completion_length`)).
    pub loss_type: Option<GrpoLoss>,
    /// The ratio π/π_old is clipped below at 1 − epsilon. Default 0.2.
    pub epsilon: Option<f64>,
    /// The ratio is clipped above at 1 + epsilon_high (DAPO's clip-higher). Default:
    /// `epsilon`.
    pub epsilon_high: Option<f64>,
    /// Optimizer steps on each batch of rollouts (μ); the log-probabilities of the batch's
    /// first step are the old policy's of the later ones. Default 1.
    pub num_iterations: Option<u64>,
    /// The KL coefficient against the reference model, the run's initial model (TRL's k3
    /// estimator per completion token, added to the per-token loss). Default 0. With a
    /// beta above 0 the reference is the model the config starts from (`model.path`, or
    /// random init from `training.seed`), rebuilt at every launch, resumes included: a
    /// loop that resumes must keep `model.path` on its initial model.
    pub beta: Option<f64>,
    /// How advantages are scaled: `group` (by each group's reward standard deviation,
    /// default), `batch` (by the whole rollouts file's) or `none`.
    pub scale_rewards: Option<ScaleRewards>,
    /// `dr_grpo`'s constant: the longest completion the generator was allowed. Default 256.
    pub max_completion_length: Option<usize>,
}

/// `grpo.loss_type` (TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GrpoLoss {
    Grpo,
    #[default]
    Dapo,
    DrGrpo,
}

/// `grpo.scale_rewards` (TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    #[default]
    Group,
    Batch,
    None,
}

/// The resolved GRPO settings a run trains with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrpoParams {
    pub loss: GrpoLoss,
    pub epsilon_low: f64,
    pub epsilon_high: f64,
    pub num_iterations: u64,
    pub scale_rewards: ScaleRewards,
    pub max_completion_length: usize,
    /// The KL coefficient (0: no reference model).
    #[serde(default)]
    pub beta: f64,
}

impl GrpoSection {
    /// The first key of the section the config sets (each applies to `grpo` runs only).
    pub(super) fn first_set_key(&self) -> Option<&'static str> {
        [
            ("grpo.loss_type", self.loss_type.is_some()),
            ("grpo.epsilon", self.epsilon.is_some()),
            ("grpo.epsilon_high", self.epsilon_high.is_some()),
            ("grpo.num_iterations", self.num_iterations.is_some()),
            ("grpo.beta", self.beta.is_some()),
            ("grpo.scale_rewards", self.scale_rewards.is_some()),
            (
                "grpo.max_completion_length",
                self.max_completion_length.is_some(),
            ),
        ]
        .into_iter()
        .find(|(_, set)| *set)
        .map(|(key, _)| key)
    }
}

impl RunConfig {
    /// The GRPO settings from the `grpo` section, checked; errors name the key.
    pub fn grpo_params(&self) -> Result<GrpoParams> {
        let g = &self.grpo;
        let epsilon_low = g.epsilon.unwrap_or(0.2);
        let epsilon_high = g.epsilon_high.unwrap_or(epsilon_low);
        for (key, v) in [
            ("grpo.epsilon", epsilon_low),
            ("grpo.epsilon_high", epsilon_high),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::invalid(
                    key,
                    format!("must be a finite number >= 0, got {v}"),
                ));
            }
        }
        let num_iterations = g.num_iterations.unwrap_or(1);
        if num_iterations == 0 {
            return Err(Error::invalid("grpo.num_iterations", "must be >= 1, got 0"));
        }
        let beta = g.beta.unwrap_or(0.0);
        if !(beta.is_finite() && beta >= 0.0) {
            return Err(Error::invalid(
                "grpo.beta",
                format!(
                    "must be a finite number >= 0 (the KL coefficient; 0 trains without a reference model), got {beta}"
                ),
            ));
        }
        let max_completion_length = g.max_completion_length.unwrap_or(256);
        if max_completion_length == 0 {
            return Err(Error::invalid(
                "grpo.max_completion_length",
                "must be >= 1, got 0",
            ));
        }
        Ok(GrpoParams {
            loss: g.loss_type.unwrap_or_default(),
            epsilon_low,
            epsilon_high,
            num_iterations,
            scale_rewards: g.scale_rewards.unwrap_or_default(),
            max_completion_length,
            beta,
        })
    }

    /// `training.stage: grpo`'s checks: its settings, no `dpo` key (`dpo_keys`: each with
    /// whether the config sets it), and a rollouts file as the only data.
    pub(super) fn validate_grpo(&self, dpo_keys: &[(&str, bool)]) -> Result<()> {
        let ds = &self.dataset;
        self.grpo_params()?;
        if let Some((key, _)) = dpo_keys.iter().find(|(_, set)| *set) {
            return Err(Error::invalid(
                *key,
                "applies to training.stage: dpo, this run is training.stage: grpo",
            ));
        }
        let refused = [
            (
                "dataset.packing",
                ds.packing,
                "packing is off for training.stage: grpo (each row is one prompt + completion); set dataset.packing: false",
            ),
            (
                "dataset.train_on_prompt",
                ds.train_on_prompt,
                "does not apply to training.stage: grpo (the loss is on the completions)",
            ),
            (
                "dataset.name",
                ds.name.is_some(),
                "training.stage: grpo reads a rollouts file (JSONL) given by dataset.path",
            ),
            (
                "dataset.eval_name",
                ds.eval_name.is_some(),
                "training.stage: grpo reads its eval rollouts from a file: give dataset.eval_path (or hold groups out with dataset.val_size)",
            ),
        ];
        // A run's rollouts file is required where its data is read (a server, `mt-launch
        // serve`, takes its rollouts from its client: [`grpo_needs_rollouts`]).
        match refused.iter().find(|(_, set, _)| *set) {
            Some((key, _, msg)) => Err(Error::invalid(*key, *msg)),
            None => Ok(()),
        }
    }
}

/// A GRPO run read without a `dataset.path`.
pub fn grpo_needs_rollouts() -> Error {
    Error::invalid(
        "dataset.path",
        "training.stage: grpo needs a rollouts file (JSONL: prompt, completion, reward, group per line)",
    )
}
