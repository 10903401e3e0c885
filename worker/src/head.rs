//! The head of a micro-batch: final norm, lm_head and the cross-entropy over its labelled
//! tokens, a chunk of `memory.ce_chunk_tokens` of them at a time. Each chunk normalizes
//! only its own rows, so neither the logits nor the normed hidden states ever exist for
//! more than one chunk: the head's memory beyond the last hidden state (and, training, its
//! gradient) is one chunk's.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, M = B*T tokens, C tokens in a
//! chunk.

use mt::config::hf::ModelSpec;
use tch::{Kind, Tensor};

use crate::model::{self, BlockWeights};

/// The labelled tokens of a micro-batch and how they are chunked.
pub struct Labels<'a> {
    /// Positions of the labelled tokens in the flattened (B*T) batch.
    pub valid_m: &'a Tensor,
    /// Their targets.
    pub targets_m: &'a Tensor,
    /// Tokens per chunk.
    pub chunk: i64,
}

impl Labels<'_> {
    /// (start, len) of each chunk of the labelled tokens.
    fn chunks(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        let n = self.valid_m.size()[0];
        (0..n)
            .step_by(self.chunk as usize)
            .map(move |start| (start, self.chunk.min(n - start)))
    }
}

/// The summed token loss of `x_bth` (B, T, H), without grad.
pub fn loss(
    spec: &ModelSpec,
    labels: &Labels,
    head_w: &BlockWeights,
    lm_head: &Tensor,
    x_bth: &Tensor,
) -> f64 {
    let x_mh = x_bth.view([-1, spec.hidden_size as i64]);
    let losses: Vec<Tensor> = labels
        .chunks()
        .map(|(start, len)| {
            let rows_c = labels.valid_m.narrow(0, start, len);
            let hn_ch = model::final_norm(spec, head_w, &x_mh.index_select(0, &rows_c));
            let targets_c = labels.targets_m.narrow(0, start, len);
            model::chunk_loss_sum(spec, &hn_ch, lm_head, &targets_c)
        })
        .collect();
    sum(&losses)
}

/// The loss of `x_bth` (B, T, H; computed without grad) backpropagated with weight
/// `scale` into the head's leaves (and lm_head's): returns (summed token loss, dy (B, T,
/// H)), zero at the unlabelled tokens.
pub fn backward(
    spec: &ModelSpec,
    labels: &Labels,
    head_w: &BlockWeights,
    lm_head: &Tensor,
    scale: f64,
    x_bth: &Tensor,
) -> (f64, Tensor) {
    let x_mh = x_bth.view([-1, spec.hidden_size as i64]);
    let mut dy_mh = x_mh.zeros_like();
    let mut losses = Vec::new();
    for (start, len) in labels.chunks() {
        let rows_c = labels.valid_m.narrow(0, start, len);
        let x_ch = x_mh.index_select(0, &rows_c).set_requires_grad(true);
        let hn_ch = model::final_norm(spec, head_w, &x_ch);
        let targets_c = labels.targets_m.narrow(0, start, len);
        let loss = model::chunk_loss_sum(spec, &hn_ch, lm_head, &targets_c);
        (&loss * scale).backward();
        // Each labelled position is in one chunk only.
        let _ = dy_mh.index_copy_(0, &rows_c, &x_ch.grad());
        losses.push(loss.detach());
    }
    (sum(&losses), dy_mh.view_as(x_bth))
}

fn sum(losses: &[Tensor]) -> f64 {
    match losses.is_empty() {
        true => 0.0,
        false => Tensor::stack(losses, 0).sum(Kind::Double).double_value(&[]),
    }
}
