//! What a run trains on, in one place: the language-model loss (pretraining, SFT), DPO's
//! loss of preference pairs ([`dpo`]) or GRPO's of scored completions ([`grpo`]).
//!
//! [`Objective`] is `training.stage` resolved with its settings: the launcher reads it from
//! the config once and sends it to every worker in `Init`; both sides branch on it and on
//! nothing else. [`ObjectiveSums`] is what a step's micro-batches add up for the metrics
//! under it (the workers' `StepDone`, the launcher's step total).

pub mod dpo;
pub mod grpo;

use serde::{Deserialize, Serialize};

use crate::config::{DpoParams, GrpoLoss, GrpoParams, RunConfig, Stage};
use crate::error::Result;

pub use dpo::DpoSums;
pub use grpo::GrpoSums;

/// The loss a run's steps train on (`training.stage` with its settings).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Objective {
    /// `pt`, `sft`: the summed token cross-entropy, a mean over the step's label tokens.
    #[default]
    Lm,
    /// `dpo`: the pairs' DPO loss ([`dpo::pair_terms`]), a mean over the step's pairs.
    Dpo(DpoParams),
    /// `grpo`: the completions' GRPO loss ([`grpo::token_terms`]), a mean over the step's
    /// completions (its completion tokens under `dapo`).
    Grpo(GrpoParams),
}

impl Objective {
    /// `training.stage` of `cfg` with its settings, validated (`dpo.*`, `grpo.*`).
    pub fn of(cfg: &RunConfig) -> Result<Objective> {
        Ok(match cfg.training.stage {
            Stage::Dpo => Objective::Dpo(cfg.dpo_params()?),
            Stage::Grpo => Objective::Grpo(cfg.grpo_params()?),
            Stage::Pt | Stage::Sft => Objective::Lm,
        })
    }

    pub fn dpo(&self) -> Option<&DpoParams> {
        match self {
            Objective::Dpo(p) => Some(p),
            _ => None,
        }
    }

    pub fn grpo(&self) -> Option<&GrpoParams> {
        match self {
            Objective::Grpo(p) => Some(p),
            _ => None,
        }
    }

    /// What a micro-batch of `rows` rows and `label_tokens` label tokens counts for in the
    /// step's mean: its label tokens, its pairs (two rows each), or its completions (its
    /// completion tokens under `dapo`). `loss_scale` is 1 / the step's total of these.
    pub fn units(&self, rows: usize, label_tokens: u64) -> u64 {
        match self {
            Objective::Dpo(_) => (rows / 2) as u64,
            Objective::Grpo(p) if p.loss != GrpoLoss::Dapo => rows as u64,
            Objective::Lm | Objective::Grpo(_) => label_tokens,
        }
    }

    /// The sums of no micro-batch under this objective, which a step's add to.
    pub fn empty_sums(&self) -> ObjectiveSums {
        match self {
            Objective::Lm => ObjectiveSums::Lm,
            Objective::Dpo(_) => ObjectiveSums::Dpo(DpoSums::default()),
            Objective::Grpo(_) => ObjectiveSums::Grpo(GrpoSums::default()),
        }
    }
}

/// What micro-batches add up for the metrics beyond the loss: nothing under the LM loss,
/// the pairs' sums under DPO, the completions' under GRPO.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ObjectiveSums {
    #[default]
    Lm,
    Dpo(DpoSums),
    Grpo(GrpoSums),
}

impl ObjectiveSums {
    /// Adds `o` to these (sums of nothing, `Lm`, take `o` as they are): false, and nothing
    /// added, when `o` are another objective's.
    #[must_use]
    pub fn add(&mut self, o: &ObjectiveSums) -> bool {
        match (&mut *self, o) {
            (ObjectiveSums::Lm, o) => *self = *o,
            (ObjectiveSums::Dpo(a), ObjectiveSums::Dpo(b)) => a.add(b),
            (ObjectiveSums::Grpo(a), ObjectiveSums::Grpo(b)) => a.add(b),
            _ => return false,
        }
        true
    }

    pub fn dpo(&self) -> Option<&DpoSums> {
        match self {
            ObjectiveSums::Dpo(s) => Some(s),
            _ => None,
        }
    }

    pub fn grpo(&self) -> Option<&GrpoSums> {
        match self {
            ObjectiveSums::Grpo(s) => Some(s),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_add_within_one_objective() {
        let one = DpoSums {
            pairs: 1,
            loss: 0.5,
            ..DpoSums::default()
        };
        let dpo = Objective::Dpo(DpoParams {
            beta: 0.1,
            loss: crate::config::DpoLoss::Sigmoid,
            label_smoothing: 0.0,
        });
        let mut sums = dpo.empty_sums();
        assert!(sums.add(&ObjectiveSums::Dpo(one)) && sums.add(&ObjectiveSums::Dpo(one)));
        assert_eq!(sums.dpo().map(|s| (s.pairs, s.loss)), Some((2, 1.0)));
        // Sums of nothing take the first ones added; another objective's are refused.
        let mut total = ObjectiveSums::Lm;
        assert!(total.add(&sums) && total == sums);
        assert!(!total.add(&ObjectiveSums::Grpo(GrpoSums::default())));
        assert_eq!(total, sums);
        assert_eq!(dpo.units(6, 40), 3);
        assert_eq!(Objective::Lm.units(6, 40), 40);
    }
}
