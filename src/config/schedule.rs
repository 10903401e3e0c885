//! `training.lr_scheduler` and `training.lr_scheduler_kwargs`: transformers' schedules by
//! their names and options (the formulas are in [`crate::optim::lr_at`]).

use serde::{Deserialize, Serialize};

use super::RunConfig;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    #[default]
    Constant,
    Linear,
    Cosine,
    /// Cosine down to a floor: `min_lr` or `min_lr_rate` (of `learning_rate`).
    CosineWithMinLr,
    /// Warm-up, a constant stretch, then a decay over `num_decay_steps` to
    /// `min_lr_ratio` (transformers' WSD schedule).
    WarmupStableDecay,
}

impl LrScheduler {
    /// The `lr_scheduler_kwargs` keys this schedule reads.
    fn kwargs(self) -> &'static [&'static str] {
        match self {
            LrScheduler::Constant | LrScheduler::Linear => &[],
            LrScheduler::Cosine => &["num_cycles"],
            LrScheduler::CosineWithMinLr => &["num_cycles", "min_lr", "min_lr_rate"],
            LrScheduler::WarmupStableDecay => &[
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ],
        }
    }
}

/// `training.lr_scheduler_kwargs`: what transformers' schedulers take besides the steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerKwargs {
    /// Cosine waves over the decay (default 0.5: half a wave, from the peak to the floor).
    pub num_cycles: Option<f64>,
    /// `cosine_with_min_lr`'s floor as a learning rate...
    pub min_lr: Option<f64>,
    /// ... or as a fraction of `learning_rate` (one of the two).
    pub min_lr_rate: Option<f64>,
    /// `warmup_stable_decay`: steps of the decay (required).
    pub num_decay_steps: Option<u64>,
    /// Steps at the peak (default: what warm-up and decay leave of `num_steps`).
    pub num_stable_steps: Option<u64>,
    /// Shape of the warm-up (default linear) ...
    pub warmup_type: Option<Ramp>,
    /// ... and of the decay (default cosine).
    pub decay_type: Option<Ramp>,
    /// Where warm-up starts and decay ends, as a fraction of `learning_rate` (default 0).
    pub min_lr_ratio: Option<f64>,
}

impl SchedulerKwargs {
    fn given(&self) -> Vec<&'static str> {
        let set = [
            ("num_cycles", self.num_cycles.is_some()),
            ("min_lr", self.min_lr.is_some()),
            ("min_lr_rate", self.min_lr_rate.is_some()),
            ("num_decay_steps", self.num_decay_steps.is_some()),
            ("num_stable_steps", self.num_stable_steps.is_some()),
            ("warmup_type", self.warmup_type.is_some()),
            ("decay_type", self.decay_type.is_some()),
            ("min_lr_ratio", self.min_lr_ratio.is_some()),
        ];
        set.iter().filter(|(_, on)| *on).map(|(k, _)| *k).collect()
    }
}

/// The shape of a WSD warm-up or decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ramp {
    #[serde(rename = "linear")]
    Linear,
    #[serde(rename = "cosine")]
    Cosine,
    #[serde(rename = "1-sqrt")]
    OneMinusSqrt,
}

impl RunConfig {
    /// `training.lr_scheduler_kwargs` holds what the schedule reads, as transformers
    /// requires it (`cosine_with_min_lr`: one of min_lr and min_lr_rate; WSD: the decay's
    /// length).
    pub(super) fn validate_schedule(&self) -> Result<()> {
        let t = &self.training;
        let (kind, k) = (t.lr_scheduler, &t.lr_scheduler_kwargs);
        let name = serde_yaml_ng::to_string(&kind).unwrap_or_default();
        let name = name.trim();
        if let Some(extra) = k.given().into_iter().find(|g| !kind.kwargs().contains(g)) {
            let reads = match kind.kwargs() {
                [] => "none".to_string(),
                r => r.join(", "),
            };
            return Err(Error::invalid(
                format!("training.lr_scheduler_kwargs.{extra}"),
                format!("lr_scheduler {name} does not read it (it reads: {reads})"),
            ));
        }
        let kw = |key: &str| format!("training.lr_scheduler_kwargs.{key}");
        if kind == LrScheduler::CosineWithMinLr && k.min_lr.is_some() == k.min_lr_rate.is_some() {
            return Err(Error::invalid(
                kw("min_lr_rate"),
                "cosine_with_min_lr needs its floor: give min_lr (a learning rate) or min_lr_rate \
                 (a fraction of learning_rate), one of them",
            ));
        }
        if kind == LrScheduler::WarmupStableDecay && k.num_decay_steps.is_none() {
            return Err(Error::invalid(
                kw("num_decay_steps"),
                "warmup_stable_decay needs the decay's length in steps",
            ));
        }
        for (key, v) in [
            ("min_lr_rate", k.min_lr_rate),
            ("min_lr_ratio", k.min_lr_ratio),
        ] {
            if let Some(v) = v.filter(|v| !(0.0..=1.0).contains(v)) {
                return Err(Error::invalid(
                    kw(key),
                    format!("must be within [0, 1], got {v}"),
                ));
            }
        }
        for (key, v) in [("min_lr", k.min_lr), ("num_cycles", k.num_cycles)] {
            if let Some(v) = v.filter(|v| !v.is_finite() || *v < 0.0) {
                return Err(Error::invalid(
                    kw(key),
                    format!("must be finite and >= 0, got {v}"),
                ));
            }
        }
        Ok(())
    }
}
