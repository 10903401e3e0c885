//! `training.stage` and the settings of the stages beyond SFT: the `dpo` section (and
//! LlamaFactory's `training.pref_*` names for the same values) here, the `grpo` section in
//! grpo.rs; the checks of which keys and data each stage takes.

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
        if let (Some(key), false) = (self.grpo.first_set_key(), t.stage == Stage::Grpo) {
            return Err(Error::invalid(
                key,
                format!(
                    "applies to training.stage: grpo, this run is training.stage: {}",
                    t.stage.as_str()
                ),
            ));
        }
        match t.stage {
            Stage::Grpo => self.validate_grpo(&dpo_keys),
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
