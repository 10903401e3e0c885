//! The head of a micro-batch: final norm over the labelled positions, then the lm_head and
//! the objective chunk by chunk (never the whole batch's logits at once, DESIGN.md "Loss"),
//! forward only (the eval loss, DPO's reference log-probabilities) or with its backward to
//! the last hidden state.
//!
//! Objectives: the summed token cross-entropy (SFT, pretraining), scaled by 1 / label
//! tokens of the step; and DPO ([`mt::dpo`]): a no-grad chunked pass gives each row's
//! summed label log-probability, [`mt::dpo::pair_terms`] turns the pairs (both rows of each
//! in this micro-batch) into each row's weight ∂loss/∂logp_row, and the chunked backward
//! of Σ_tokens w_row · logp_token (= −w_row · CE_token) hands the gradient on; and GRPO
//! ([`mt::grpo`]): the same no-grad pass gives each completion token's log-probability,
//! [`mt::grpo::token_terms`] each token's weight ∂loss/∂logp_token, and the chunked
//! backward of Σ_tokens w_token · logp_token hands the gradient on.
//!
//! Shapes: B rows, T positions, H hidden, M labelled positions, C a chunk of them.

use mt::config::hf::ModelSpec;
use mt::config::{DpoParams, GrpoParams};
use mt::dpo::{DpoSums, pair_terms};
use mt::grpo::{GrpoSums, token_terms};
use tch::{Device, Kind, Tensor};

use crate::model::{self, BlockWeights};

/// One micro-batch on the device: ids, the targets of the labelled positions, where those
/// positions are in the flattened (B*T) batch and which row each belongs to.
pub struct DeviceBatch {
    pub ids_bt: Tensor,
    /// Packed rows' positions (B, T); None: 0..T.
    pub pos_bt: Option<Tensor>,
    pub valid_m: Tensor,
    pub targets_m: Tensor,
    /// The row of each labelled position (M,).
    pub rows_m: Tensor,
    /// Label tokens of each row.
    pub row_tokens: Vec<u64>,
}

/// The head's weights: the final norm's block and the lm_head (the embedding when tied).
pub struct Head<'a> {
    pub spec: &'a ModelSpec,
    /// Labelled positions per lm_head + loss chunk.
    pub chunk: i64,
    pub w: &'a BlockWeights,
    pub lm_head: &'a Tensor,
}

impl Head<'_> {
    /// The final norm of the labelled positions of `x_bth` (B, T, H): (M, H).
    fn normed(&self, batch: &DeviceBatch, x_bth: &Tensor) -> Tensor {
        let h = self.spec.hidden_size as i64;
        let x_mh = x_bth.view([-1, h]).index_select(0, &batch.valid_m);
        model::final_norm(self.spec, self.w, &x_mh)
    }

    /// (start, length) of each chunk of `n` labelled positions.
    fn chunks(&self, n: i64) -> impl Iterator<Item = (i64, i64)> + '_ {
        (0..n)
            .step_by(self.chunk as usize)
            .map(move |start| (start, self.chunk.min(n - start)))
    }

    /// The summed token cross-entropy, without grad.
    pub fn loss_sum(&self, batch: &DeviceBatch, x_bth: &Tensor) -> f64 {
        let n_valid = batch.valid_m.size()[0];
        if n_valid == 0 {
            return 0.0;
        }
        let hn_mh = self.normed(batch, x_bth);
        let losses: Vec<Tensor> = self
            .chunks(n_valid)
            .map(|(start, len)| {
                model::chunk_loss_sum(
                    self.spec,
                    &hn_mh.narrow(0, start, len),
                    self.lm_head,
                    &batch.targets_m.narrow(0, start, len),
                )
            })
            .collect();
        Tensor::stack(&losses, 0)
            .sum(Kind::Double)
            .double_value(&[])
    }

    /// Each row's summed log-probability of its label tokens, without grad.
    pub fn row_logps(&self, batch: &DeviceBatch, x_bth: &Tensor) -> Vec<f64> {
        let hn_mh = self.normed(batch, x_bth);
        self.row_sums(batch, &hn_mh)
    }

    /// Per-row sums of the label log-probabilities of the normed positions `hn_mh` (M, H),
    /// without grad, in f64 (each row's tokens added in order).
    fn row_sums(&self, batch: &DeviceBatch, hn_mh: &Tensor) -> Vec<f64> {
        let _guard = tch::no_grad_guard();
        let rows = batch.row_tokens.len() as i64;
        let mut sums_b = Tensor::zeros([rows], (Kind::Double, hn_mh.device()));
        for (start, len) in self.chunks(hn_mh.size()[0]) {
            let ce_c = model::chunk_token_losses(
                self.spec,
                &hn_mh.narrow(0, start, len),
                self.lm_head,
                &batch.targets_m.narrow(0, start, len),
            );
            let _ = sums_b.index_add_(
                0,
                &batch.rows_m.narrow(0, start, len),
                &ce_c.neg().to_kind(Kind::Double),
            );
        }
        Vec::<f64>::try_from(sums_b.to_device(Device::Cpu)).expect("a 1-d f64 tensor")
    }

    /// The summed token cross-entropy and its backward, scaled by `scale`, to the last
    /// hidden state `x_bth` (computed without grad, so a leaf): (loss sum, dy (B, T, H)).
    pub fn ce_backward(&self, batch: &DeviceBatch, scale: f64, x_bth: Tensor) -> (f64, Tensor) {
        let n_valid = batch.valid_m.size()[0];
        if n_valid == 0 {
            return (0.0, x_bth.zeros_like());
        }
        let x_leaf = x_bth.set_requires_grad(true);
        let hn_mh = self.normed(batch, &x_leaf);
        let hn_leaf = hn_mh.detach().set_requires_grad(true);
        let mut losses = Vec::new();
        for (start, len) in self.chunks(n_valid) {
            let loss = model::chunk_loss_sum(
                self.spec,
                &hn_leaf.narrow(0, start, len),
                self.lm_head,
                &batch.targets_m.narrow(0, start, len),
            );
            (&loss * scale).backward();
            losses.push(loss.detach());
        }
        (hn_mh * hn_leaf.grad()).sum(Kind::Float).backward();
        let loss_sum = Tensor::stack(&losses, 0)
            .sum(Kind::Double)
            .double_value(&[]);
        (loss_sum, x_leaf.grad())
    }

    /// The DPO loss of the micro-batch's pairs (rows 2i, 2i + 1, chosen first; `refs` their
    /// reference log-probabilities) as a share of the step's mean over pairs (`scale` =
    /// 1 / pairs in the step), and its backward to `x_bth`: (the pairs' sums, dy).
    pub fn dpo_backward(
        &self,
        batch: &DeviceBatch,
        params: &DpoParams,
        refs: &[f64],
        scale: f64,
        x_bth: Tensor,
    ) -> (DpoSums, Tensor) {
        let x_leaf = x_bth.set_requires_grad(true);
        let hn_mh = self.normed(batch, &x_leaf);
        let hn_leaf = hn_mh.detach().set_requires_grad(true);
        let logps = self.row_sums(batch, &hn_leaf);
        let terms = pair_terms(params, &logps, refs, &batch.row_tokens, scale);
        let coef_m = Tensor::from_slice(&terms.weights)
            .to_device(x_leaf.device())
            .index_select(0, &batch.rows_m);
        self.weighted_backward(batch, &hn_leaf, &coef_m);
        (hn_mh * hn_leaf.grad()).sum(Kind::Float).backward();
        (terms.sums, x_leaf.grad())
    }

    /// The GRPO loss of the micro-batch's completions (`advantages` per row, `old` the
    /// old log-probability of every completion token, empty on a batch's first step) as a
    /// share of the step's (`scale`: 1 / completions in the step, or 1 / completion tokens
    /// under `dapo`), and its backward to `x_bth`: (the completions' sums, every completion
    /// token's log-probability, dy).
    pub fn grpo_backward(
        &self,
        batch: &DeviceBatch,
        params: &GrpoParams,
        advantages: &[f64],
        old: &[f32],
        scale: f64,
        x_bth: Tensor,
    ) -> (GrpoSums, Vec<f32>, Tensor) {
        let x_leaf = x_bth.set_requires_grad(true);
        let hn_mh = self.normed(batch, &x_leaf);
        let hn_leaf = hn_mh.detach().set_requires_grad(true);
        let logps = self.token_logps(batch, &hn_leaf);
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let old_wide = (!old.is_empty()).then(|| wide(old));
        let terms = token_terms(
            params,
            &wide(&logps),
            old_wide.as_deref(),
            advantages,
            &batch.row_tokens,
            scale,
        );
        let coef_m = Tensor::from_slice(&terms.weights).to_device(x_leaf.device());
        self.weighted_backward(batch, &hn_leaf, &coef_m);
        (hn_mh * hn_leaf.grad()).sum(Kind::Float).backward();
        (terms.sums, logps, x_leaf.grad())
    }

    /// Every labelled position's log-probability of its label, without grad (M,).
    fn token_logps(&self, batch: &DeviceBatch, hn_mh: &Tensor) -> Vec<f32> {
        let _guard = tch::no_grad_guard();
        let parts: Vec<Tensor> = self
            .chunks(hn_mh.size()[0])
            .map(|(start, len)| {
                model::chunk_token_losses(
                    self.spec,
                    &hn_mh.narrow(0, start, len),
                    self.lm_head,
                    &batch.targets_m.narrow(0, start, len),
                )
                .neg()
                .to_kind(Kind::Float)
            })
            .collect();
        if parts.is_empty() {
            return Vec::new();
        }
        let all_m = Tensor::cat(&parts, 0).to_device(Device::Cpu);
        Vec::<f32>::try_from(all_m).expect("a 1-d f32 tensor")
    }

    /// Backpropagates Σ_m w_m · logp_m (logp_m = −CE_m; `w_m` (M,) f64, the weight of each
    /// labelled position) chunk by chunk to the normed positions `hn_leaf`.
    fn weighted_backward(&self, batch: &DeviceBatch, hn_leaf: &Tensor, w_m: &Tensor) {
        let coef_m = w_m.neg().to_kind(Kind::Float);
        for (start, len) in self.chunks(hn_leaf.size()[0]) {
            let ce_c = model::chunk_token_losses(
                self.spec,
                &hn_leaf.narrow(0, start, len),
                self.lm_head,
                &batch.targets_m.narrow(0, start, len),
            );
            (ce_c * coef_m.narrow(0, start, len))
                .sum(Kind::Float)
                .backward();
        }
    }
}
