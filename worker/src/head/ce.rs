//! The language-model objective's head (pretraining, SFT): the summed token cross-entropy
//! of the labelled positions, scaled by `scale` (1 / label tokens of the step), and its
//! backward, through the fused cross-entropy where it runs.

use mt::data::MicroBatch;
use tch::{Kind, Tensor};

use super::{DeviceBatch, Head, HeadOut, sum};
use crate::model;

/// The summed token cross-entropy and its backward, scaled by `scale`, to the last hidden
/// state `x_bth` (computed without grad): (the loss sum, dy (B, T, H)).
pub(super) fn backward(
    h: &Head,
    batch: &DeviceBatch,
    _mb: &MicroBatch,
    scale: f64,
    x_bth: &Tensor,
) -> (HeadOut, Tensor) {
    let (loss_sum, dy_bth) = match h.fused(x_bth) {
        true => {
            let dev = x_bth.device();
            let (losses, dy_bth) = h.fused_backward(batch, x_bth, |(_, len)| {
                Tensor::full([len], scale, (Kind::Float, dev))
            });
            (sum(&losses), dy_bth)
        }
        false => {
            let mut losses = Vec::new();
            let dy_bth = h.backward(batch, x_bth, |_, hn_ch, targets_c| {
                let loss = model::chunk_loss_sum(h.spec, hn_ch, h.lm_head, targets_c);
                losses.push(loss.detach());
                loss * scale
            });
            (sum(&losses), dy_bth)
        }
    };
    let out = HeadOut {
        loss_sum,
        ..HeadOut::default()
    };
    (out, dy_bth)
}
