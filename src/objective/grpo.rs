//! The GRPO objective (TRL's `GRPOTrainer._compute_loss`, `importance_sampling_level:
//! token`) of a micro-batch of completions, from each completion token's log-probability
//! under the policy: the per-token losses, the clipping counts and KL TRL logs, and the
//! derivative of the step's loss with respect to each token's log-probability, which the
//! worker's head backpropagates through that token.
//!
//! With A the completion's advantage ([`advantages`]), logp and old the token's
//! log-probability under the policy and under the policy that generated the batch (on a
//! batch's first step, logp itself, detached: r = 1), r = exp(logp − old):
//!
//! - per-token loss ℓ = −min(r A, clip(r, 1 − ε_low, 1 + ε_high) A) + β k3, where (with a
//!   KL term, β > 0) ref is the token's log-probability under the reference model (the
//!   run's initial one), d = ref − logp and k3 = e^d − d − 1 (TRL's per-token KL estimator);
//! - `grpo`: the step's loss is the mean over its completions of Σ_t ℓ / n (n the
//!   completion's tokens); `dapo`: Σ ℓ / (completion tokens of the step); `dr_grpo`:
//!   Σ ℓ / (completions of the step × `max_completion_length`). So each token's loss has a
//!   weight: `scale` (1 / completions, or 1 / tokens under `dapo`, from the launcher) times
//!   1 / n, 1 or 1 / `max_completion_length`.
//! - ∂ℓ/∂logp = −A r where the unclipped term is the smaller (or they tie: torch's
//!   `minimum` splits a tie's gradient, and both halves are −A r), else 0; plus
//!   β ∂k3/∂logp = β (1 − e^d).
//!
//! Computed in f64 from the worker's f32 log-probabilities.

use serde::{Deserialize, Serialize};

use crate::config::{GrpoLoss, GrpoParams, ScaleRewards};

/// Sums over the completions of a micro-batch (or a step), for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GrpoSums {
    pub completions: u64,
    pub tokens: u64,
    /// Their share of the step's loss, in units of `scale` (÷ completions, or ÷ completion
    /// tokens under `dapo`, of the step gives the step's loss).
    pub loss: f64,
    /// Tokens whose ratio is below 1 − ε_low with A < 0 (TRL's `clip_ratio/low`).
    pub clipped_low: u64,
    /// Tokens whose ratio is above 1 + ε_high with A > 0 (TRL's `clip_ratio/high`).
    pub clipped_high: u64,
    /// Σ k3 over the tokens (β > 0; TRL's `kl` is its mean per token).
    #[serde(default)]
    pub kl: f64,
}

impl GrpoSums {
    pub fn add(&mut self, o: &GrpoSums) {
        self.completions += o.completions;
        self.tokens += o.tokens;
        self.loss += o.loss;
        self.clipped_low += o.clipped_low;
        self.clipped_high += o.clipped_high;
        self.kl += o.kl;
    }
}

/// The completions' objective: the metrics' sums and each token's weight, ∂(step loss)/∂logp.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenTerms {
    pub sums: GrpoSums,
    pub weights: Vec<f64>,
}

/// `logps`: every completion token's log-probability, row after row (`row_tokens[i]` of
/// row i); `old`: theirs under the generating policy (None: the batch's first step, r = 1);
/// `refs`: theirs under the reference model (None: β = 0); `advantages`: each row's;
/// `scale`: 1 / completions in the step, or 1 / completion tokens under `dapo`.
pub fn token_terms(
    p: &GrpoParams,
    logps: &[f64],
    old: Option<&[f64]>,
    refs: Option<&[f64]>,
    advantages: &[f64],
    row_tokens: &[u64],
    scale: f64,
) -> TokenTerms {
    assert!(
        advantages.len() == row_tokens.len()
            && row_tokens.iter().sum::<u64>() as usize == logps.len()
            && old.is_none_or(|o| o.len() == logps.len())
            && refs.is_none_or(|o| o.len() == logps.len())
            && (refs.is_some() == (p.beta > 0.0)),
        "one advantage per row, one log-probability (and old and reference one) per completion token"
    );
    let (lo, hi) = (1.0 - p.epsilon_low, 1.0 + p.epsilon_high);
    let mut sums = GrpoSums::default();
    let mut weights = Vec::with_capacity(logps.len());
    let mut t = 0;
    for (&a, &n) in advantages.iter().zip(row_tokens) {
        let unit = match p.loss {
            GrpoLoss::Grpo => 1.0 / n.max(1) as f64,
            GrpoLoss::Dapo => 1.0,
            GrpoLoss::DrGrpo => 1.0 / p.max_completion_length as f64,
        };
        let norm = unit * scale;
        for _ in 0..n {
            let r = old.map_or(1.0, |o| (logps[t] - o[t]).exp());
            let (unclipped, clipped) = (r * a, r.clamp(lo, hi) * a);
            sums.loss -= unclipped.min(clipped) * unit;
            let mut w = match unclipped <= clipped {
                true => -a * r * norm,
                false => 0.0,
            };
            if let Some(refs) = refs {
                let d = refs[t] - logps[t];
                let k3 = d.exp() - d - 1.0;
                sums.loss += p.beta * k3 * unit;
                sums.kl += k3;
                w += p.beta * (1.0 - d.exp()) * norm;
            }
            weights.push(w);
            sums.clipped_low += u64::from(r < lo && a < 0.0);
            sums.clipped_high += u64::from(r > hi && a > 0.0);
            t += 1;
        }
    }
    sums.completions = row_tokens.len() as u64;
    sums.tokens = logps.len() as u64;
    TokenTerms { sums, weights }
}

/// Group-relative advantages (TRL's `_generate_and_score_completions`): each reward minus
/// its group's mean, divided by (std + 1e-4) where std is the unbiased standard deviation
/// of the group's rewards (`group`) or of every reward (`batch`); `none` leaves the
/// difference. `groups[i]` is row i's group, numbered 0..; every group has two or more rows
/// (the reader checks).
pub fn advantages(rewards: &[f64], groups: &[usize], scale: ScaleRewards) -> Vec<f64> {
    assert_eq!(rewards.len(), groups.len());
    let n_groups = groups.iter().max().map_or(0, |g| g + 1);
    let mut sum = vec![0.0; n_groups];
    let mut count = vec![0usize; n_groups];
    for (&r, &g) in rewards.iter().zip(groups) {
        sum[g] += r;
        count[g] += 1;
    }
    let mean: Vec<f64> = sum.iter().zip(&count).map(|(s, &c)| s / c as f64).collect();
    let unbiased_std = |values: &mut dyn Iterator<Item = (f64, f64)>| {
        let (mut ss, mut n) = (0.0, 0usize);
        for (x, m) in values {
            ss += (x - m) * (x - m);
            n += 1;
        }
        (ss / (n as f64 - 1.0)).sqrt()
    };
    let group_std: Vec<f64> = (0..n_groups)
        .map(|g| {
            unbiased_std(
                &mut rewards
                    .iter()
                    .zip(groups)
                    .filter(|(_, gi)| **gi == g)
                    .map(|(&r, _)| (r, mean[g])),
            )
        })
        .collect();
    let all_mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    let batch_std = unbiased_std(&mut rewards.iter().map(|&r| (r, all_mean)));
    rewards
        .iter()
        .zip(groups)
        .map(|(&r, &g)| {
            let d = r - mean[g];
            match scale {
                ScaleRewards::Group => d / (group_std[g] + 1e-4),
                ScaleRewards::Batch => d / (batch_std + 1e-4),
                ScaleRewards::None => d,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(loss: GrpoLoss) -> GrpoParams {
        GrpoParams {
            loss,
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            num_iterations: 2,
            scale_rewards: ScaleRewards::Group,
            max_completion_length: 8,
            beta: 0.0,
        }
    }

    /// Reference log-probabilities (β > 0): below and above the policy's.
    const REFS: [f64; 5] = [-0.7, -2.5, -0.5, -2.0, -1.9];

    fn refs(p: &GrpoParams) -> Option<&'static [f64]> {
        (p.beta > 0.0).then_some(&REFS[..])
    }

    /// The step loss at log-probabilities `logps`.
    fn loss(p: &GrpoParams, logps: &[f64]) -> f64 {
        let old = [-1.0, -2.0, -0.5, -3.0, -1.5];
        0.5 * token_terms(p, logps, Some(&old), refs(p), &[0.7, -1.1], &[2, 3], 0.5)
            .sums
            .loss
    }

    #[test]
    fn weights_are_the_loss_derivatives() {
        // Ratios 1.1 (inside), 1.5 (clipped high, A > 0), 0.9, 0.5 (clipped low, A < 0), 1.4.
        let old: [f64; 5] = [-1.0, -2.0, -0.5, -3.0, -1.5];
        let r = [1.1f64, 1.5, 0.9, 0.5, 1.4];
        let logps: Vec<f64> = old.iter().zip(r).map(|(o, r)| o + r.ln()).collect();
        for (loss_type, beta) in [GrpoLoss::Grpo, GrpoLoss::Dapo, GrpoLoss::DrGrpo]
            .into_iter()
            .flat_map(|l| [(l, 0.0), (l, 0.3)])
        {
            let p = GrpoParams {
                beta,
                ..params(loss_type)
            };
            let t = token_terms(&p, &logps, Some(&old), refs(&p), &[0.7, -1.1], &[2, 3], 0.5);
            for i in 0..5 {
                let h = 1e-6;
                let (mut up, mut down) = (logps.clone(), logps.clone());
                up[i] += h;
                down[i] -= h;
                let d = (loss(&p, &up) - loss(&p, &down)) / (2.0 * h);
                // Central differences of a function linear in e^logp near each point: ~1e-10.
                assert!(
                    (t.weights[i] - d).abs() < 1e-8,
                    "{loss_type:?} {i}: {t:?} vs {d}"
                );
            }
            assert_eq!((t.sums.clipped_low, t.sums.clipped_high), (1, 1));
            match beta > 0.0 {
                // Clipped tokens keep the KL term's derivative β (1 − e^d).
                true => assert!(t.weights[1] != 0.0 && t.weights[3] != 0.0, "{t:?}"),
                false => assert!(t.weights[1] == 0.0 && t.weights[3] == 0.0, "{t:?}"),
            }
        }
    }

    #[test]
    fn kl_is_trl_k3_added_per_token() {
        let p = GrpoParams {
            beta: 0.3,
            ..params(GrpoLoss::Dapo)
        };
        let logps = [-1.0, -2.0, -0.5, -3.0, -1.5];
        let with = token_terms(&p, &logps, None, Some(&REFS), &[0.7, -1.1], &[2, 3], 0.2);
        let without = token_terms(
            &params(GrpoLoss::Dapo),
            &logps,
            None,
            None,
            &[0.7, -1.1],
            &[2, 3],
            0.2,
        );
        // k3 of d = ref − logp: e^0.3 − 1.3, e^−0.5 − 0.5, 0, e^1 − 2, e^−0.4 − 0.6.
        let k3: f64 = [0.3f64, -0.5, 0.0, 1.0, -0.4]
            .iter()
            .map(|d| d.exp() - d - 1.0)
            .sum();
        assert!((with.sums.kl - k3).abs() < 1e-15, "{with:?}");
        assert!((with.sums.loss - without.sums.loss - 0.3 * k3).abs() < 1e-15);
        // The token whose reference equals its log-probability adds nothing.
        assert_eq!(with.weights[2], without.weights[2]);
    }

    #[test]
    fn on_policy_loss_is_minus_the_normalised_advantage() {
        let a = [0.5, -1.5];
        let t = token_terms(
            &params(GrpoLoss::Grpo),
            &[-1.0; 5],
            None,
            None,
            &a,
            &[2, 3],
            0.5,
        );
        // Σ over rows of (Σ_t −A) / n = −A each: −(0.5 − 1.5), a mean of 0.5 over 2 rows.
        assert!((t.sums.loss - 1.0).abs() < 1e-15, "{t:?}");
        let want = [-0.125, -0.125, 0.25, 0.25, 0.25];
        assert!(
            t.weights
                .iter()
                .zip(want)
                .all(|(w, x)| (w - x).abs() < 1e-15),
            "{t:?}"
        );
        let t = token_terms(
            &params(GrpoLoss::DrGrpo),
            &[-1.0; 5],
            None,
            None,
            &a,
            &[2, 3],
            0.5,
        );
        assert!((t.sums.loss - -(2.0 * 0.5 - 3.0 * 1.5) / 8.0).abs() < 1e-15);
    }

    #[test]
    fn advantages_follow_trl() {
        let (r, g) = ([1.0, 0.0, 0.0, 2.0, 2.0], [0, 0, 0, 1, 1]);
        let a = advantages(&r, &g, ScaleRewards::Group);
        // Group 0: mean 1/3, unbiased std sqrt(1/3); group 1: std 0, advantages 0.
        let s = (1.0f64 / 3.0).sqrt() + 1e-4;
        assert!((a[0] - (2.0 / 3.0) / s).abs() < 1e-12 && (a[1] + (1.0 / 3.0) / s).abs() < 1e-12);
        assert_eq!((a[3], a[4]), (0.0, 0.0));
        let a = advantages(&r, &g, ScaleRewards::None);
        assert!((a[0] - 2.0 / 3.0).abs() < 1e-15);
        let a = advantages(&r, &g, ScaleRewards::Batch);
        // Batch mean 1, unbiased variance (0 + 1 + 1 + 1 + 1) / 4 = 1.
        assert!((a[0] - (2.0 / 3.0) / 1.0001).abs() < 1e-12, "{a:?}");
    }
}
