//! Learning-rate schedules with transformers' semantics and formulas
//! (`transformers.optimization`): the multiplier for the update that follows `done`
//! completed optimizer steps (so the first update with warm-up uses lr 0). Checked against
//! transformers' own schedulers in launcher/tests/schedules.rs.

use std::f64::consts::PI;

use crate::config::{LrScheduler, Ramp, TrainingSection};

/// Learning rate of the update after `done` optimizer steps.
pub fn lr_at(t: &TrainingSection, done: u64) -> f64 {
    let k = &t.lr_scheduler_kwargs;
    let cycles = k.num_cycles.unwrap_or(0.5);
    if t.lr_scheduler == LrScheduler::WarmupStableDecay {
        return t.learning_rate * wsd(t, done, cycles);
    }
    let (s, w, total) = (done as f64, t.warmup_steps as f64, t.num_steps as f64);
    if done < t.warmup_steps {
        return t.learning_rate * s / w.max(1.0);
    }
    let progress = (s - w) / (total - w).max(1.0);
    let mult = match t.lr_scheduler {
        LrScheduler::Constant => 1.0,
        LrScheduler::Linear => ((total - s) / (total - w).max(1.0)).max(0.0),
        LrScheduler::Cosine => cosine(progress, cycles, 0.0),
        LrScheduler::CosineWithMinLr => {
            let floor = match (k.min_lr_rate, k.min_lr) {
                (Some(rate), _) => rate,
                (None, Some(lr)) => lr / t.learning_rate,
                (None, None) => 0.0,
            };
            cosine(progress, cycles, floor)
        }
        LrScheduler::WarmupStableDecay => unreachable!("returned above"),
    };
    t.learning_rate * mult
}

/// Half a cosine wave per `cycles` = 0.5 over `progress` in [0, 1], from 1 down to `floor`
/// (the operations in transformers' order: pi * cycles * 2 * progress).
fn cosine(progress: f64, cycles: f64, floor: f64) -> f64 {
    let f = 0.5 * (1.0 + (PI * cycles * 2.0 * progress).cos());
    (f * (1.0 - floor) + floor).max(0.0)
}

/// Warm-up, stable, decay (transformers' `get_wsd_schedule`): the stable stretch is what
/// warm-up and decay leave of `num_steps` unless `num_stable_steps` is given; past the
/// decay the rate stays at `min_lr_ratio`.
fn wsd(t: &TrainingSection, done: u64, cycles: f64) -> f64 {
    let k = &t.lr_scheduler_kwargs;
    let floor = k.min_lr_ratio.unwrap_or(0.0);
    let (s, warm) = (done as i64, t.warmup_steps as i64);
    let decay = k.num_decay_steps.unwrap_or(0) as i64;
    let stable = k
        .num_stable_steps
        .map_or(t.num_steps as i64 - warm - decay, |n| n as i64);
    let ramp = |f: f64| (f * (1.0 - floor) + floor).max(0.0);
    if s < warm {
        let p = s as f64 / warm.max(1) as f64;
        return ramp(match k.warmup_type.unwrap_or(Ramp::Linear) {
            Ramp::Linear => p,
            Ramp::Cosine => 0.5 * (1.0 - (PI * p).cos()),
            Ramp::OneMinusSqrt => 1.0 - (1.0 - p).sqrt(),
        });
    }
    if s < warm + stable {
        return 1.0;
    }
    if s < warm + stable + decay {
        let p = (s - warm - stable) as f64 / decay.max(1) as f64;
        return ramp(match k.decay_type.unwrap_or(Ramp::Cosine) {
            Ramp::Linear => 1.0 - p,
            Ramp::Cosine => 0.5 * (1.0 + (PI * cycles * 2.0 * p).cos()),
            Ramp::OneMinusSqrt => 1.0 - p.sqrt(),
        });
    }
    floor
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

    /// The shapes' landmarks (transformers' values are compared step by step in
    /// launcher/tests/schedules.rs).
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
        let mut m = cfg(LrScheduler::CosineWithMinLr, 0);
        m.lr_scheduler_kwargs.min_lr_rate = Some(0.1);
        assert!((lr_at(&m, 10) - 0.1).abs() < 1e-12);
        let mut w = cfg(LrScheduler::WarmupStableDecay, 2);
        w.lr_scheduler_kwargs.num_decay_steps = Some(4);
        // Warm-up 0..2, stable 2..6, decay 6..10, then the floor (0).
        assert_eq!([lr_at(&w, 1), lr_at(&w, 2), lr_at(&w, 5)], [0.5, 1.0, 1.0]);
        assert!(lr_at(&w, 7) < 1.0 && lr_at(&w, 7) > 0.0);
        assert_eq!(lr_at(&w, 12), 0.0);
    }
}
