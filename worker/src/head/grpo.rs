//! GRPO's head ([`mt::objective::grpo`]): a no-grad chunked pass gives each completion
//! token's log-probability, [`token_terms`] each token's weight ∂loss/∂logp_token (with
//! `grpo.beta` > 0 its KL term against the reference log-probabilities the micro-batch
//! carries, which a forward-only pass gave, [`Head::token_logps`]), and the chunked
//! backward of Σ_tokens w_token · logp_token hands the gradient on.

use mt::config::GrpoParams;
use mt::data::MicroBatch;
use mt::objective::ObjectiveSums;
use mt::objective::grpo::token_terms;
use tch::Tensor;

use super::{DeviceBatch, Head, HeadOut};

/// The GRPO loss of the micro-batch `mb`'s completions (its advantages per row; the old
/// log-probability of every completion token, none on a batch's first step; with β > 0
/// the reference one) as a share of the step's (`scale`: 1 / completions in the step, or
/// 1 / completion tokens under `dapo`), and its backward to `x_bth`: (the completions'
/// sums and, on a batch's first step with `num_iterations` > 1, every completion token's
/// log-probability; dy).
pub(super) fn backward(
    h: &Head,
    params: &GrpoParams,
    batch: &DeviceBatch,
    mb: &MicroBatch,
    scale: f64,
    x_bth: &Tensor,
) -> (HeadOut, Tensor) {
    let logps = h.token_logps(batch, x_bth);
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
    let dy_bth = h.logp_backward(batch, x_bth, &coef_m);
    // The launcher keeps them as the batch's old log-probabilities.
    let keep = params.num_iterations > 1 && mb.old_logps.is_empty();
    let out = HeadOut {
        loss_sum: terms.sums.loss,
        sums: ObjectiveSums::Grpo(terms.sums),
        token_logps: if keep { logps } else { Vec::new() },
    };
    (out, dy_bth)
}
