//! What a checkpoint records of the run's settings, to tell whether a resume continues the
//! same run ([`Schedule`], in `trainer_state.json`; the data and optimizer settings in
//! [`RunSettings`]).

use serde::{Deserialize, Serialize};

use super::settings::RunSettings;

/// The settings that, with `step`, fix the data position and the schedule position: step
/// k reads global batch k of the order `seed` and `shuffle` give, and a decaying learning
/// rate depends on `num_steps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub seed: u64,
    pub batch_size: usize,
    pub shuffle: bool,
    /// `training.num_steps` when the learning rate decays over it (None: constant).
    pub decay_steps: Option<u64>,
    /// With `grpo.beta` > 0, the reference model the run's KL term is against (its initial
    /// model, rebuilt at every launch): a resume must name the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpo_reference: Option<String>,
    /// The data and optimizer settings (absent in checkpoints of earlier builds, which
    /// then cannot be checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<RunSettings>,
}

impl Schedule {
    /// How `self` (the resumed run's settings) differs from `saved`, one line per config
    /// key: "key: now X, the checkpoint's run had Y" (the GRPO reference aside: a resume
    /// against another one is refused on its own).
    /// Where both runs decay the rate over a different number of steps: the warning to give.
    pub fn rescheduled(&self, saved: &Schedule) -> Option<String> {
        match (self.decay_steps, saved.decay_steps) {
            (Some(ours), Some(theirs)) if ours != theirs => Some(format!(
                "the learning rate now decays over {ours} steps, the checkpoint's run over {theirs}: the rate from here follows the new schedule"
            )),
            _ => None,
        }
    }

    pub fn differences(&self, saved: &Schedule) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |key: &str, ours: String, theirs: String| {
            if ours != theirs {
                d.push(format!(
                    "{key}: now {ours}, the checkpoint's run had {theirs}"
                ));
            }
        };
        cmp(
            "training.seed",
            self.seed.to_string(),
            saved.seed.to_string(),
        );
        cmp(
            "training.batch_size",
            self.batch_size.to_string(),
            saved.batch_size.to_string(),
        );
        cmp(
            "dataset.shuffle",
            self.shuffle.to_string(),
            saved.shuffle.to_string(),
        );
        let steps = |s: Option<u64>| {
            s.map_or("a constant rate".into(), |n| {
                format!("a rate decaying over {n} steps")
            })
        };
        // A decaying schedule stretched or shortened (training.num_steps raised to train
        // longer) is the run continued on purpose: [`Schedule::rescheduled`] warns of it.
        if self.rescheduled(saved).is_none() {
            cmp(
                "training.lr_scheduler / num_steps",
                steps(self.decay_steps),
                steps(saved.decay_steps),
            );
        }
        if let (Some(ours), Some(theirs)) = (&self.settings, &saved.settings) {
            d.extend(ours.differences(theirs));
        }
        d
    }
}
