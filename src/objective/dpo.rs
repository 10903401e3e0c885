//! The DPO objective of a micro-batch of preference pairs, from each row's summed
//! label log-probability under the policy and under the reference (the initial weights):
//! the per-pair losses and rewards TRL's `DPOTrainer` computes, and the derivative of the
//! step's loss with respect to each row's log-probability, which the worker's head
//! backpropagates through the tokens of that row.
//!
//! Rows 2i and 2i + 1 are pair i, chosen first. With p = the policy's and r = the
//! reference's summed log-probabilities, β = `dpo.beta`, ε = `dpo.label_smoothing`:
//!
//! - `sigmoid`: z = (p_c − p_r) − (r_c − r_r), loss = −log σ(βz) (1 − ε) − log σ(−βz) ε;
//! - `ipo`: z = (p_c − r_c) / n_c − (p_r − r_r) / n_r with n the row's label tokens (TRL
//!   averages IPO's log-ratios over the completion tokens), loss = (z − 1/(2β))²;
//! - rewards (both losses): β (p_c − r_c) and β (p_r − r_r); a pair is accurate when the
//!   chosen reward is the larger; the margin is their difference; TRL also logs p_c and
//!   p_r (`logps/chosen`, `logps/rejected`).
//!
//! The step's loss is the mean over its pairs (all workers, all micro-batches), so each
//! row's weight is ∂loss_i/∂p_row / pairs_in_step. Computed in f64.

use serde::{Deserialize, Serialize};

use crate::config::{DpoLoss, DpoParams};

/// Sums over the pairs of a micro-batch (or a step), for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DpoSums {
    pub pairs: u64,
    pub loss: f64,
    pub chosen_reward: f64,
    pub rejected_reward: f64,
    /// Pairs whose chosen reward is larger than the rejected one.
    pub accurate: u64,
    /// The policy's summed log-probabilities of the chosen and of the rejected responses
    /// (TRL's `logps/chosen`, `logps/rejected` are their means).
    #[serde(default)]
    pub chosen_logps: f64,
    #[serde(default)]
    pub rejected_logps: f64,
}

impl DpoSums {
    pub fn add(&mut self, o: &DpoSums) {
        self.pairs += o.pairs;
        self.loss += o.loss;
        self.chosen_reward += o.chosen_reward;
        self.rejected_reward += o.rejected_reward;
        self.accurate += o.accurate;
        self.chosen_logps += o.chosen_logps;
        self.rejected_logps += o.rejected_logps;
    }
}

/// The pairs' objective: the metrics' sums and each row's weight, ∂(step loss)/∂p_row.
#[derive(Debug, Clone, PartialEq)]
pub struct PairTerms {
    pub sums: DpoSums,
    pub weights: Vec<f64>,
}

/// `logps`, `refs`: the policy's and the reference's summed log-probability of each row;
/// `tokens`: each row's label tokens; `scale`: 1 / pairs in the step.
pub fn pair_terms(
    p: &DpoParams,
    logps: &[f64],
    refs: &[f64],
    tokens: &[u64],
    scale: f64,
) -> PairTerms {
    assert!(
        logps.len().is_multiple_of(2) && refs.len() == logps.len() && tokens.len() == logps.len(),
        "rows come in pairs, each with its reference and token count"
    );
    let mut sums = DpoSums::default();
    let mut weights = Vec::with_capacity(logps.len());
    for i in (0..logps.len()).step_by(2) {
        let (chosen, rejected) = (logps[i] - refs[i], logps[i + 1] - refs[i + 1]);
        let (loss, d_chosen, d_rejected) = match p.loss {
            DpoLoss::Sigmoid => {
                let bz = p.beta * (chosen - rejected);
                let eps = p.label_smoothing;
                let loss = -log_sigmoid(bz) * (1.0 - eps) - log_sigmoid(-bz) * eps;
                let d = p.beta * (-(1.0 - eps) * sigmoid(-bz) + eps * sigmoid(bz));
                (loss, d, -d)
            }
            DpoLoss::Ipo => {
                let n = |row: usize| tokens[row].max(1) as f64;
                let (nc, nr) = (n(i), n(i + 1));
                let gap = chosen / nc - rejected / nr - 1.0 / (2.0 * p.beta);
                let d = 2.0 * gap;
                (gap * gap, d / nc, -d / nr)
            }
        };
        let (rc, rr) = (p.beta * chosen, p.beta * rejected);
        sums.pairs += 1;
        sums.loss += loss;
        sums.chosen_reward += rc;
        sums.rejected_reward += rr;
        sums.accurate += u64::from(rc > rr);
        sums.chosen_logps += logps[i];
        sums.rejected_logps += logps[i + 1];
        weights.extend([d_chosen * scale, d_rejected * scale]);
    }
    PairTerms { sums, weights }
}

fn sigmoid(x: f64) -> f64 {
    match x >= 0.0 {
        true => 1.0 / (1.0 + (-x).exp()),
        false => x.exp() / (1.0 + x.exp()),
    }
}

/// log σ(x), without overflow either way.
fn log_sigmoid(x: f64) -> f64 {
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(loss: DpoLoss, beta: f64, eps: f64) -> DpoParams {
        DpoParams {
            beta,
            loss,
            label_smoothing: eps,
        }
    }

    /// The step loss of one pair at policy log-probabilities `pc`, `pr`.
    fn loss(p: &DpoParams, pc: f64, pr: f64) -> f64 {
        pair_terms(p, &[pc, pr], &[-7.0, -5.5], &[3, 8], 1.0)
            .sums
            .loss
    }

    #[test]
    fn weights_are_the_loss_derivatives() {
        for p in [
            params(DpoLoss::Sigmoid, 0.1, 0.0),
            params(DpoLoss::Sigmoid, 2.0, 0.2),
            params(DpoLoss::Ipo, 0.3, 0.0),
        ] {
            let (pc, pr) = (-6.2, -6.9);
            let t = pair_terms(&p, &[pc, pr], &[-7.0, -5.5], &[3, 8], 0.25);
            let h = 1e-6;
            let dc = (loss(&p, pc + h, pr) - loss(&p, pc - h, pr)) / (2.0 * h);
            let dr = (loss(&p, pc, pr + h) - loss(&p, pc, pr - h)) / (2.0 * h);
            // Central differences of smooth functions at h = 1e-6: error ~1e-10.
            assert!(
                (t.weights[0] - 0.25 * dc).abs() < 1e-8,
                "{p:?}: {t:?} vs {dc}"
            );
            assert!(
                (t.weights[1] - 0.25 * dr).abs() < 1e-8,
                "{p:?}: {t:?} vs {dr}"
            );
        }
    }

    #[test]
    fn losses_and_rewards_follow_trl() {
        let p = params(DpoLoss::Sigmoid, 0.5, 0.0);
        // At the reference, log 2; rewards 0, not accurate.
        let t = pair_terms(
            &p,
            &[-3.0, -4.0, -1.0, -9.0],
            &[-3.0, -4.0, -2.0, -8.0],
            &[1; 4],
            1.0,
        );
        let l1 = std::f64::consts::LN_2;
        // Pair 2: z = 1 - (-1) = 2, βz = 1: -log σ(1) = ln(1 + e^-1).
        let l2 = (1.0 + (-1.0f64).exp()).ln();
        assert!((t.sums.loss - (l1 + l2)).abs() < 1e-15, "{t:?}");
        assert_eq!((t.sums.pairs, t.sums.accurate), (2, 1));
        assert_eq!((t.sums.chosen_reward, t.sums.rejected_reward), (0.5, -0.5));
        let ipo = params(DpoLoss::Ipo, 0.25, 0.0);
        let t = pair_terms(&ipo, &[-3.0, -4.0], &[-5.0, -4.0], &[4, 2], 1.0);
        // z = 2/4 - 0/2 = 0.5; (0.5 - 2)^2.
        assert_eq!(t.sums.loss, 2.25);
        let extreme = pair_terms(&p, &[0.0, -4000.0], &[0.0, 0.0], &[1, 1], 1.0);
        assert!(extreme.sums.loss.is_finite() && extreme.weights[0].abs() < 1e-300);
    }
}
