//! The head of a micro-batch: the final norm, the lm_head and the objective over the
//! labelled positions, chunk by chunk (never the whole batch's logits at once, DESIGN.md
//! "Loss"; nor its normed hidden states: each chunk normalizes its own rows, so beyond the
//! last hidden state and its gradient the head holds one chunk), forward only (the eval
//! loss, DPO's reference log-probabilities) or with its backward to the last hidden state,
//! each chunk's rows a leaf whose gradient is written into dy.
//!
//! Objectives: the summed token cross-entropy (SFT, pretraining), scaled by 1 / label
//! tokens of the step; and DPO ([`mt::dpo`]): a no-grad chunked pass gives each row's
//! summed label log-probability, [`mt::dpo::pair_terms`] turns the pairs (both rows of each
//! in this micro-batch) into each row's weight ∂loss/∂logp_row, and the chunked backward
//! of Σ_tokens w_row · logp_token (= −w_row · CE_token) hands the gradient on; and GRPO
//! ([`mt::grpo`]): the same no-grad pass gives each completion token's log-probability,
//! [`mt::grpo::token_terms`] each token's weight ∂loss/∂logp_token (with `grpo.beta` > 0
//! its KL term against the reference log-probabilities the micro-batch carries, which a
//! forward-only pass gave, [`Head::token_logps`]), and the chunked backward of
//! Σ_tokens w_token · logp_token hands the gradient on.
//!
//! Shapes: B rows, T positions, H hidden, M labelled positions, C a chunk of them.

use mt::config::hf::ModelSpec;
use mt::config::{DpoParams, GrpoParams};
use mt::dpo::{DpoSums, pair_terms};
use mt::grpo::{GrpoSums, token_terms};
use mt::protocol::MicroBatch;
use tch::{Device, Kind, Tensor};

use crate::kernels;
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
    /// Tokens per tile of the layers' MLP half (worker/src/layer.rs); None: whole.
    pub tile: Option<usize>,
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
    /// (start, length) of each chunk of the labelled positions.
    fn chunks(&self, batch: &DeviceBatch) -> impl Iterator<Item = (i64, i64)> + '_ {
        let n = batch.valid_m.size()[0];
        (0..n)
            .step_by(self.chunk as usize)
            .map(move |start| (start, self.chunk.min(n - start)))
    }

    /// `x_bth` (B, T, H) as (B*T, H).
    fn flat(&self, x_bth: &Tensor) -> Tensor {
        x_bth.view([-1, self.spec.hidden_size as i64])
    }

    /// `f((start, len), hn_ch, targets_c)` for each chunk of the labelled positions of
    /// `x_bth` (B, T, H), in order: the chunk's rows after the final norm (C, H) and their
    /// targets (C,); the results in chunk order. Forward only: the caller decides on grad.
    fn map_chunks<T>(
        &self,
        batch: &DeviceBatch,
        x_bth: &Tensor,
        mut f: impl FnMut((i64, i64), &Tensor, &Tensor) -> T,
    ) -> Vec<T> {
        let x_mh = self.flat(x_bth);
        self.chunks(batch)
            .map(|(start, len)| {
                // The selected rows are a temporary, freed once normed: beside the chunk's
                // logits, only its normed rows are held.
                let rows_c = batch.valid_m.narrow(0, start, len);
                let hn_ch = model::final_norm(self.spec, self.w, &x_mh.index_select(0, &rows_c));
                f((start, len), &hn_ch, &batch.targets_m.narrow(0, start, len))
            })
            .collect()
    }

    /// The summed token cross-entropy, without grad.
    pub fn loss_sum(&self, batch: &DeviceBatch, x_bth: &Tensor) -> f64 {
        let losses = self.map_chunks(batch, x_bth, |_, hn_ch, targets_c| {
            model::chunk_loss_sum(self.spec, hn_ch, self.lm_head, targets_c)
        });
        sum(&losses)
    }

    /// Each row's summed log-probability of its label tokens, without grad, in f64 (each
    /// row's tokens added in order).
    pub fn row_logps(&self, batch: &DeviceBatch, x_bth: &Tensor) -> Vec<f64> {
        let _guard = tch::no_grad_guard();
        let rows = batch.row_tokens.len() as i64;
        let mut sums_b = Tensor::zeros([rows], (Kind::Double, x_bth.device()));
        self.map_chunks(batch, x_bth, |(start, len), hn_ch, targets_c| {
            let ce_c = model::chunk_token_losses(self.spec, hn_ch, self.lm_head, targets_c);
            let _ = sums_b.index_add_(
                0,
                &batch.rows_m.narrow(0, start, len),
                &ce_c.neg().to_kind(Kind::Double),
            );
        });
        Vec::<f64>::try_from(sums_b.to_device(Device::Cpu)).expect("a 1-d f64 tensor")
    }

    /// Backpropagates `objective(chunk, its normed rows, their targets)` for each chunk,
    /// as [`Self::map_chunks`] gives them but the chunk's rows of `x_bth` (computed without
    /// grad) a leaf: returns dy (B, T, H), zero at the unlabelled positions.
    fn backward(
        &self,
        batch: &DeviceBatch,
        x_bth: &Tensor,
        mut objective: impl FnMut((i64, i64), &Tensor, &Tensor) -> Tensor,
    ) -> Tensor {
        self.backward_by(batch, x_bth, |chunk, hn_ch, targets_c| {
            objective(chunk, hn_ch, targets_c).backward()
        })
    }

    /// [`Self::backward`] with `backprop(chunk, its normed rows, their targets)` running
    /// each chunk's backward itself.
    fn backward_by(
        &self,
        batch: &DeviceBatch,
        x_bth: &Tensor,
        mut backprop: impl FnMut((i64, i64), &Tensor, &Tensor),
    ) -> Tensor {
        let x_mh = self.flat(x_bth);
        let mut dy_mh = x_mh.zeros_like();
        for (start, len) in self.chunks(batch) {
            let rows_c = batch.valid_m.narrow(0, start, len);
            let x_ch = x_mh.index_select(0, &rows_c).set_requires_grad(true);
            let mark = kernels::tape::depth();
            let hn_ch = model::final_norm(self.spec, self.w, &x_ch);
            backprop((start, len), &hn_ch, &batch.targets_m.narrow(0, start, len));
            // The final norm, where it is a fused op.
            kernels::tape::backward_to(mark);
            // A labelled position is in one chunk only.
            let _ = dy_mh.index_copy_(0, &rows_c, &x_ch.grad());
        }
        dy_mh.view_as(x_bth)
    }

    /// The backward of `sum_tokens w_token CE_token` to `x_bth` (computed without grad),
    /// `weights(chunk)` giving each chunk's w (C,) f32, through the fused cross-entropy
    /// ([`kernels::cross_entropy`]): its gradient handed to the chunk's logits, so neither
    /// an f32 copy of them nor autograd's log-softmax: (each chunk's summed CE, dy).
    fn fused_backward(
        &self,
        batch: &DeviceBatch,
        x_bth: &Tensor,
        mut weights: impl FnMut((i64, i64)) -> Tensor,
    ) -> (Vec<Tensor>, Tensor) {
        let mut losses = Vec::new();
        let dy_bth = self.backward_by(batch, x_bth, |chunk, hn_ch, targets_c| {
            let logits_cv = model::compute_logits(self.spec, hn_ch, self.lm_head);
            let (loss_c, dlogits_cv) =
                kernels::cross_entropy(&logits_cv, targets_c, &weights(chunk));
            kernels::tape::backward_with_grads(vec![(logits_cv, dlogits_cv)]);
            losses.push(loss_c.sum(Kind::Float));
        });
        (losses, dy_bth)
    }

    /// Whether the backward takes [`Self::fused_backward`].
    fn fused(&self, x_bth: &Tensor) -> bool {
        kernels::cross_entropy_enabled(x_bth.kind(), x_bth.device())
    }

    /// The summed token cross-entropy and its backward, scaled by `scale`, to the last
    /// hidden state `x_bth` (computed without grad): (loss sum, dy (B, T, H)).
    pub fn ce_backward(&self, batch: &DeviceBatch, scale: f64, x_bth: &Tensor) -> (f64, Tensor) {
        if self.fused(x_bth) {
            let dev = x_bth.device();
            let (losses, dy_bth) = self.fused_backward(batch, x_bth, |(_, len)| {
                Tensor::full([len], scale, (Kind::Float, dev))
            });
            return (sum(&losses), dy_bth);
        }
        let mut losses = Vec::new();
        let dy_bth = self.backward(batch, x_bth, |_, hn_ch, targets_c| {
            let loss = model::chunk_loss_sum(self.spec, hn_ch, self.lm_head, targets_c);
            losses.push(loss.detach());
            loss * scale
        });
        (sum(&losses), dy_bth)
    }

    /// The backward of Σ_tokens w_token · logp_token to `x_bth`, given `coef_m` = −w per
    /// labelled position (M,) (logp_token = −CE_token): dy (B, T, H).
    fn logp_backward(&self, batch: &DeviceBatch, x_bth: &Tensor, coef_m: &Tensor) -> Tensor {
        if self.fused(x_bth) {
            let w = |(start, len)| coef_m.narrow(0, start, len);
            return self.fused_backward(batch, x_bth, w).1;
        }
        self.backward(batch, x_bth, |(start, len), hn_ch, targets_c| {
            let ce_c = model::chunk_token_losses(self.spec, hn_ch, self.lm_head, targets_c);
            (ce_c * coef_m.narrow(0, start, len)).sum(Kind::Float)
        })
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
        x_bth: &Tensor,
    ) -> (DpoSums, Tensor) {
        let logps = self.row_logps(batch, x_bth);
        let terms = pair_terms(params, &logps, refs, &batch.row_tokens, scale);
        // The objective Σ_tokens w_row · logp_token, with logp_token = −CE_token.
        let coef: Vec<f32> = terms.weights.iter().map(|&w| -w as f32).collect();
        let coef_m = Tensor::from_slice(&coef)
            .to_device(x_bth.device())
            .index_select(0, &batch.rows_m);
        let dy_bth = self.logp_backward(batch, x_bth, &coef_m);
        (terms.sums, dy_bth)
    }

    /// The GRPO loss of the micro-batch `mb`'s completions (its advantages per row; the
    /// old log-probability of every completion token, none on a batch's first step; with
    /// β > 0 the reference one) as a share of the step's (`scale`: 1 / completions in the
    /// step, or 1 / completion tokens under `dapo`), and its backward to `x_bth`: (the
    /// completions' sums, every completion token's log-probability, dy).
    pub fn grpo_backward(
        &self,
        batch: &DeviceBatch,
        params: &GrpoParams,
        mb: &MicroBatch,
        scale: f64,
        x_bth: &Tensor,
    ) -> (GrpoSums, Vec<f32>, Tensor) {
        let logps = self.token_logps(batch, x_bth);
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let old = (!mb.old_logps.is_empty()).then(|| wide(&mb.old_logps));
        let refs = (params.beta > 0.0).then(|| wide(&mb.ref_token_logps));
        let terms = token_terms(
            params,
            &wide(&logps),
            old.as_deref(),
            refs.as_deref(),
            &mb.advantages,
            &batch.row_tokens,
            scale,
        );
        // The objective Σ_tokens w_token · logp_token, with logp_token = −CE_token.
        let coef: Vec<f32> = terms.weights.iter().map(|&w| -w as f32).collect();
        let coef_m = Tensor::from_slice(&coef).to_device(x_bth.device());
        let dy_bth = self.logp_backward(batch, x_bth, &coef_m);
        (terms.sums, logps, dy_bth)
    }

    /// Every labelled position's log-probability of its label, without grad, in f32, row
    /// after row (M,): the policy's in a GRPO step, the reference's in its forward-only pass.
    pub fn token_logps(&self, batch: &DeviceBatch, x_bth: &Tensor) -> Vec<f32> {
        let _guard = tch::no_grad_guard();
        let parts = self.map_chunks(batch, x_bth, |_, hn_ch, targets_c| {
            model::chunk_token_losses(self.spec, hn_ch, self.lm_head, targets_c)
                .neg()
                .to_kind(Kind::Float)
        });
        match parts.is_empty() {
            true => Vec::new(),
            false => Vec::<f32>::try_from(Tensor::cat(&parts, 0).to_device(Device::Cpu))
                .expect("a 1-d f32 tensor"),
        }
    }
}

/// The sum of per-chunk losses, in f64.
fn sum(losses: &[Tensor]) -> f64 {
    match losses.is_empty() {
        true => 0.0,
        false => Tensor::stack(losses, 0).sum(Kind::Double).double_value(&[]),
    }
}
