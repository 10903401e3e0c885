//! DPO's head ([`mt::objective::dpo`]): a no-grad chunked pass gives each row's summed
//! label log-probability, [`pair_terms`] turns the pairs (both rows of each in this
//! micro-batch) into each row's weight ∂loss/∂logp_row, and the chunked backward of
//! Σ_tokens w_row · logp_token (= −w_row · CE_token) hands the gradient on.

use mt::config::DpoParams;
use mt::data::MicroBatch;
use mt::objective::ObjectiveSums;
use mt::objective::dpo::pair_terms;
use tch::Tensor;

use super::{DeviceBatch, Head, HeadOut};

/// The DPO loss of the micro-batch's pairs (rows 2i, 2i + 1, chosen first; `mb.ref_logps`
/// their reference log-probabilities) as a share of the step's mean over pairs (`scale` =
/// 1 / pairs in the step), and its backward to `x_bth`: (the pairs' sums, dy).
pub(super) fn backward(
    h: &Head,
    params: &DpoParams,
    batch: &DeviceBatch,
    mb: &MicroBatch,
    scale: f64,
    x_bth: &Tensor,
) -> (HeadOut, Tensor) {
    let logps = h.row_logps(batch, x_bth);
    let terms = pair_terms(params, &logps, &mb.ref_logps, &batch.row_tokens, scale);
    // The objective Σ_tokens w_row · logp_token, with logp_token = −CE_token.
    let coef: Vec<f32> = terms.weights.iter().map(|&w| -w as f32).collect();
    let coef_m = Tensor::from_slice(&coef)
        .to_device(x_bth.device())
        .index_select(0, &batch.rows_m);
    let dy_bth = h.logp_backward(batch, x_bth, &coef_m);
    let out = HeadOut {
        loss_sum: terms.sums.loss,
        sums: ObjectiveSums::Dpo(terms.sums),
        ..HeadOut::default()
    };
    (out, dy_bth)
}
