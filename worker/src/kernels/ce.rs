//! The head's token cross-entropy with its gradient in one op ([`cross_entropy`]): on CUDA
//! one kernel (ce.cu) reads a chunk's bf16 logits twice and writes their gradient once,
//! where torch upcasts them to an f32 copy, takes the log-softmax, its backward and casts
//! the gradient back. The gradient is of a weighted sum of the rows' losses with weights
//! known before the pass (the SFT scale, DPO's and GRPO's per-token coefficients), so no
//! tape: the caller hands it to the logits' graph (worker/src/head/).

use tch::{Device, Kind, Tensor};

use super::cuda;

/// Whether the head takes [`cross_entropy`] for logits of `kind` on `device`: by default on
/// CUDA in bf16; `MT_CROSS_ENTROPY=fused` forces it (the mirror on CPU), `plain` torch's
/// ops through autograd.
pub fn cross_entropy_enabled(kind: Kind, device: Device) -> bool {
    let on = super::fused_by_default(mt::switches::get().fused.cross_entropy, kind, device);
    on && match device {
        Device::Cuda(_) => cuda::cross_entropy_supports(kind) && cuda::available(),
        _ => true,
    }
}

/// Each row's cross-entropy of `logits_cv` (C, V, the compute dtype) against `targets_c`
/// (-100 ignored: loss and gradient 0), in f32 as transformers upcasts the logits, and the
/// gradient of `sum_r weights_c[r] loss_r` with respect to the logits, in their dtype:
/// (loss (C,) f32, dlogits (C, V)). Without grad.
pub fn cross_entropy(
    logits_cv: &Tensor,
    targets_c: &Tensor,
    weights_c: &Tensor,
) -> (Tensor, Tensor) {
    let _guard = tch::no_grad_guard();
    let logits = logits_cv.detach();
    if let Device::Cuda(_) = logits.device() {
        return cuda::cross_entropy(&logits, targets_c, weights_c)
            .unwrap_or_else(|e| panic!("fused cross-entropy: {e:#}"));
    }
    // The mirror: torch's ops, the gradient written out (softmax minus the target's one-hot).
    let x = logits.to_kind(Kind::Float);
    let loss = x.cross_entropy_loss(targets_c, None::<Tensor>, tch::Reduction::None, -100, 0.0);
    let kept = targets_c.ne(-100);
    let onehot = targets_c
        .clamp_min(0)
        .one_hot(x.size()[1])
        .to_kind(Kind::Float)
        * kept.unsqueeze(1);
    let w = weights_c.to_kind(Kind::Float) * kept;
    let d = (x.softmax(-1, Kind::Float) - onehot) * w.unsqueeze(1);
    (loss, d.to_kind(logits.kind()))
}
