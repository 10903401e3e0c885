//! The head of a micro-batch: the final norm, the lm_head and the objective over the
//! labelled positions, chunk by chunk (never the whole batch's logits at once, DESIGN.md
//! "Loss"; nor its normed hidden states: each chunk normalizes its own rows, so beyond the
//! last hidden state and its gradient the head holds one chunk), forward only (the eval
//! loss, DPO's reference log-probabilities) or with its backward to the last hidden state,
//! each chunk's rows a leaf whose gradient is written into dy.
//!
//! Objectives ([`Objective`]), one file each behind one signature, chosen in
//! [`Head::backward_objective`] only: the summed token cross-entropy ([`ce`]; SFT,
//! pretraining), scaled by 1 / label tokens of the step; DPO's ([`dpo`]), through each
//! row's summed label log-probability; GRPO's ([`grpo`]), through each completion token's.
//! Both of the latter turn the no-grad log-probabilities into weights ∂loss/∂logp and
//! backpropagate Σ w · logp ([`Head::logp_backward`]).
//!
//! Shapes: B rows, T positions, H hidden, M labelled positions, C a chunk of them.

use mt::config::hf::ModelSpec;
use mt::data::MicroBatch;
use mt::objective::{Objective, ObjectiveSums};
use tch::{Device, Kind, Tensor};

use crate::kernels;
use crate::model::{self, BlockWeights};

mod ce;
mod dpo;
mod grpo;

/// What the head of one micro-batch's step gave: its summed loss (in `loss_scale` units
/// of the step's loss), its objective's sums for the metrics, and under GRPO on a batch's
/// first step with `num_iterations` > 1 every completion token's log-probability (the
/// launcher keeps them as the batch's old ones).
#[derive(Default)]
pub struct HeadOut {
    pub loss_sum: f64,
    pub sums: ObjectiveSums,
    pub token_logps: Vec<f32>,
}

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
    /// Per layer: whether it keeps its MLP activations for the backward (the device
    /// plan's `keep`, `mt::plan::kept_layers`).
    pub kept: Vec<bool>,
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

    /// `objective`'s loss of micro-batch `mb` (`batch` on the device, `x_bth` its last hidden
    /// state, computed without grad) as a share of the step's (`scale`: 1 / the step's
    /// [`Objective::units`]), and its backward to `x_bth`: (what it gave, dy (B, T, H)).
    pub fn backward_objective(
        &self,
        objective: &Objective,
        batch: &DeviceBatch,
        mb: &MicroBatch,
        scale: f64,
        x_bth: &Tensor,
    ) -> (HeadOut, Tensor) {
        match objective {
            Objective::Lm => ce::backward(self, batch, mb, scale, x_bth),
            Objective::Dpo(p) => dpo::backward(self, p, batch, mb, scale, x_bth),
            Objective::Grpo(p) => grpo::backward(self, p, batch, mb, scale, x_bth),
        }
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

    /// [`Head::token_logps`] and each label token's entropy of the predicted distribution,
    /// from the same f32 logits per chunk (the log-probabilities are the same values).
    pub fn token_logps_entropy(&self, batch: &DeviceBatch, x_bth: &Tensor) -> (Vec<f32>, Vec<f32>) {
        let _guard = tch::no_grad_guard();
        let parts = self.map_chunks(batch, x_bth, |_, hn_ch, targets_c| {
            let logits = model::logits(self.spec, hn_ch, self.lm_head);
            let logps = logits
                .cross_entropy_loss(targets_c, None::<Tensor>, tch::Reduction::None, -100, 0.0)
                .neg();
            let lp = logits.log_softmax(-1, Kind::Float);
            let entropy = (lp.exp() * &lp)
                .sum_dim_intlist(-1, false, Kind::Float)
                .neg();
            (logps.to_kind(Kind::Float), entropy)
        });
        let cat = |ts: Vec<Tensor>| match ts.is_empty() {
            true => Vec::new(),
            false => Vec::<f32>::try_from(Tensor::cat(&ts, 0).to_device(Device::Cpu))
                .expect("a 1-d f32 tensor"),
        };
        let (logps, entropy): (Vec<Tensor>, Vec<Tensor>) = parts.into_iter().unzip();
        (cat(logps), cat(entropy))
    }
}

/// The sum of per-chunk losses, in f64.
fn sum(losses: &[Tensor]) -> f64 {
    match losses.is_empty() {
        true => 0.0,
        false => Tensor::stack(losses, 0).sum(Kind::Double).double_value(&[]),
    }
}
