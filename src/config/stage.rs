//! `training.stage` and the settings of the stages beyond SFT: the `dpo` section (and
//! LlamaFactory's `training.pref_*` names for the same values) and the `grpo` section
//! (TRL's `GRPOConfig` names and defaults).

use serde::{Deserialize, Serialize};

use super::RunConfig;
use crate::error::{Error, Result};

/// `training.stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Continued pretraining: documents + EOS, loss on every token.
    Pt,
    /// Supervised fine-tuning: loss on the assistant turns.
    #[default]
    Sft,
    /// Direct preference optimization on chosen / rejected pairs.
    Dpo,
    /// Group relative policy optimization on a rollouts file (the training side).
    Grpo,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Pt => "pt",
            Stage::Sft => "sft",
            Stage::Dpo => "dpo",
            Stage::Grpo => "grpo",
        }
    }
}

/// The `dpo` section (TRL's `DPOConfig` names). Unset values take LlamaFactory's
/// `training.pref_beta`, `pref_loss` and `dpo_label_smoothing` when those are given, else
/// the defaults; giving a value both ways is an error.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoSection {
    /// The KL coefficient β: the implicit reward of a response is β (log π − log π_ref).
    /// Default 0.1.
    pub beta: Option<f64>,
    /// `sigmoid` (the DPO loss, default) or `ipo` (on per-token average log-ratios).
    pub loss_type: Option<DpoLoss>,
    /// cDPO's label smoothing ε in [0, 0.5): the pair's preference is taken as right with
    /// probability 1 − ε (`sigmoid` only). Default 0.
    pub label_smoothing: Option<f64>,
}

/// `dpo.loss_type` (TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DpoLoss {
    /// −log σ(β z) (1 − ε) − log σ(−β z) ε, z the log-ratio margin over the reference.
    #[default]
    Sigmoid,
    /// (z − 1/(2β))², z over per-token average log-ratios.
    Ipo,
}

/// The resolved DPO settings a run trains with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DpoParams {
    pub beta: f64,
    pub loss: DpoLoss,
    pub label_smoothing: f64,
}

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

const NO_EVAL: &str = "an eval set is not implemented for training.stage: dpo (leave out dataset.val_size, eval_name and eval_path)";
const NO_EVAL_GRPO: &str = "an eval set is not implemented for training.stage: grpo (leave out dataset.val_size, eval_name and eval_path)";

impl RunConfig {
    /// The DPO settings from the `dpo` section and LlamaFactory's `training.pref_*` keys,
    /// checked; errors name the key.
    pub fn dpo_params(&self) -> Result<DpoParams> {
        let (d, t) = (&self.dpo, &self.training);
        fn one<T: Copy>(
            ours: Option<T>,
            theirs: Option<T>,
            key: &str,
            alias: &str,
        ) -> Result<Option<T>> {
            match (ours, theirs) {
                (Some(_), Some(_)) => Err(Error::invalid(
                    key,
                    format!("given twice: as {key} and as {alias} (LlamaFactory's name); keep one"),
                )),
                (a, b) => Ok(a.or(b)),
            }
        }
        let beta = one(d.beta, t.pref_beta, "dpo.beta", "training.pref_beta")?.unwrap_or(0.1);
        let loss = one(
            d.loss_type,
            t.pref_loss,
            "dpo.loss_type",
            "training.pref_loss",
        )?
        .unwrap_or_default();
        let ls = one(
            d.label_smoothing,
            t.dpo_label_smoothing,
            "dpo.label_smoothing",
            "training.dpo_label_smoothing",
        )?
        .unwrap_or(0.0);
        if !(beta.is_finite() && beta > 0.0) {
            return Err(Error::invalid(
                "dpo.beta",
                format!("must be a finite number > 0, got {beta}"),
            ));
        }
        if !(0.0..0.5).contains(&ls) {
            return Err(Error::invalid(
                "dpo.label_smoothing",
                format!(
                    "must be in [0, 0.5) (the probability that a pair's preference is wrong), got {ls}"
                ),
            ));
        }
        if ls > 0.0 && loss == DpoLoss::Ipo {
            return Err(Error::invalid(
                "dpo.label_smoothing",
                "applies to loss_type: sigmoid; the ipo loss has no label smoothing",
            ));
        }
        Ok(DpoParams {
            beta,
            loss,
            label_smoothing: ls,
        })
    }

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

    /// The stage's own checks: what is implemented, and what `dpo` and `grpo` train with.
    pub(super) fn validate_stage(&self) -> Result<()> {
        let (t, ds) = (&self.training, &self.dataset);
        let dpo_keys = [
            ("dpo.beta", self.dpo.beta.is_some()),
            ("dpo.loss_type", self.dpo.loss_type.is_some()),
            ("dpo.label_smoothing", self.dpo.label_smoothing.is_some()),
            ("training.pref_beta", t.pref_beta.is_some()),
            ("training.pref_loss", t.pref_loss.is_some()),
            (
                "training.dpo_label_smoothing",
                t.dpo_label_smoothing.is_some(),
            ),
        ];
        let grpo_key = [
            ("grpo.loss_type", self.grpo.loss_type.is_some()),
            ("grpo.epsilon", self.grpo.epsilon.is_some()),
            ("grpo.epsilon_high", self.grpo.epsilon_high.is_some()),
            ("grpo.num_iterations", self.grpo.num_iterations.is_some()),
            ("grpo.beta", self.grpo.beta.is_some()),
            ("grpo.scale_rewards", self.grpo.scale_rewards.is_some()),
            (
                "grpo.max_completion_length",
                self.grpo.max_completion_length.is_some(),
            ),
        ]
        .into_iter()
        .find(|(_, set)| *set);
        if let (Some((key, _)), false) = (grpo_key, t.stage == Stage::Grpo) {
            return Err(Error::invalid(
                key,
                format!(
                    "applies to training.stage: grpo, this run is training.stage: {}",
                    t.stage.as_str()
                ),
            ));
        }
        match t.stage {
            Stage::Grpo => {
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
                    ("dataset.val_size", ds.val_size.is_some(), NO_EVAL_GRPO),
                    ("dataset.eval_name", ds.eval_name.is_some(), NO_EVAL_GRPO),
                    ("dataset.eval_path", ds.eval_path.is_some(), NO_EVAL_GRPO),
                ];
                match refused.iter().find(|(_, set, _)| *set) {
                    Some((key, _, msg)) => Err(Error::invalid(*key, *msg)),
                    None if ds.path.is_none() => Err(Error::invalid(
                        "dataset.path",
                        "training.stage: grpo needs a rollouts file (JSONL: prompt, completion, reward, group per line)",
                    )),
                    None => Ok(()),
                }
            }
            Stage::Dpo => {
                self.dpo_params()?;
                let refused = [
                    (
                        "dataset.packing",
                        ds.packing,
                        "packing is off for training.stage: dpo (each row is one prompt + response, a pair's two rows side by side); set dataset.packing: false",
                    ),
                    (
                        "dataset.train_on_prompt",
                        ds.train_on_prompt,
                        "does not apply to training.stage: dpo (the log-probabilities compared are the responses')",
                    ),
                    ("dataset.val_size", ds.val_size.is_some(), NO_EVAL),
                    ("dataset.eval_name", ds.eval_name.is_some(), NO_EVAL),
                    ("dataset.eval_path", ds.eval_path.is_some(), NO_EVAL),
                ];
                match refused.iter().find(|(_, set, _)| *set) {
                    Some((key, _, msg)) => Err(Error::invalid(*key, *msg)),
                    None => Ok(()),
                }
            }
            stage => match dpo_keys.iter().find(|(_, set)| *set) {
                Some((key, _)) => Err(Error::invalid(
                    *key,
                    format!(
                        "applies to training.stage: dpo, this run is training.stage: {}",
                        stage.as_str()
                    ),
                )),
                None => Ok(()),
            },
        }
    }

    /// Rows of the global batch: `training.batch_size` counts preference pairs under
    /// `dpo` (as LlamaFactory's does), two rows each.
    pub fn rows_per_step(&self) -> usize {
        match self.training.stage {
            Stage::Dpo => 2 * self.training.batch_size,
            _ => self.training.batch_size,
        }
    }
}
