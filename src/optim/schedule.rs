//! Learning-rate schedules with transformers' semantics: the multiplier for the update that
//! follows `done` completed optimizer steps (so the first update with warm-up uses lr 0).

use crate::config::{LrScheduler, TrainingSection};

/// Learning rate of the update after `done` optimizer steps.
pub fn lr_at(t: &TrainingSection, done: u64) -> f64 {
    let (s, w, total) = (done as f64, t.warmup_steps as f64, t.num_steps as f64);
    if done < t.warmup_steps {
        return t.learning_rate * s / w.max(1.0);
    }
    let progress = || (s - w) / (total - w).max(1.0);
    let mult = match t.lr_scheduler {
        LrScheduler::Constant => 1.0,
        LrScheduler::Linear => ((total - s) / (total - w).max(1.0)).max(0.0),
        LrScheduler::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress()).cos())).max(0.0),
    };
    t.learning_rate * mult
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kind: LrScheduler, warmup: u64) -> TrainingSection {
        TrainingSection {
            learning_rate: 1.0,
            lr_scheduler: kind,
            warmup_steps: warmup,
            num_steps: 10,
            ..Default::default()
        }
    }

    #[test]
    fn warmup_then_shapes() {
        let c = cfg(LrScheduler::Constant, 2);
        assert_eq!(
            [lr_at(&c, 0), lr_at(&c, 1), lr_at(&c, 2), lr_at(&c, 9)],
            [0.0, 0.5, 1.0, 1.0]
        );
        let l = cfg(LrScheduler::Linear, 0);
        assert_eq!([lr_at(&l, 0), lr_at(&l, 5)], [1.0, 0.5]);
        let k = cfg(LrScheduler::Cosine, 0);
        assert!((lr_at(&k, 5) - 0.5).abs() < 1e-12);
        assert!(lr_at(&k, 10).abs() < 1e-12);
    }
}
