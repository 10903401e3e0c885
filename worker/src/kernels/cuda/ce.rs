//! ce.cu's launch: a chunk's token cross-entropy and its gradient (`super::super::ce`).

use anyhow::{Result, bail};
use tch::{Kind, Tensor};

use super::{arg, kernels, launch_with, packed, ptr};

/// ce.cu's threads per block (its CE_THREADS).
const CE_THREADS: u32 = 512;

/// Whether ce.cu takes logits of `kind`: bf16.
pub fn cross_entropy_supports(kind: Kind) -> bool {
    kind == Kind::BFloat16
}

/// logits (C, V) bf16, targets (C,) int64 (-100 ignored), weights (C,) f32 -> (each row's
/// loss (C,) f32, the gradient of their weighted sum (C, V) bf16).
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    weights: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let &[c, v] = logits.size().as_slice() else {
        bail!("cross_entropy: logits are {:?}, not (C, V)", logits.size())
    };
    // Rows 16-byte aligned for the kernel's packed loads where V allows them.
    let logits = packed(logits);
    let targets = targets.to_kind(Kind::Int64).contiguous();
    let weights = weights.to_kind(Kind::Float).contiguous();
    let loss = Tensor::empty([c], (Kind::Float, logits.device()));
    let dlogits = logits.empty_like();
    if c == 0 {
        return Ok((loss, dlogits));
    }
    let (mut lp, mut tp, mut wp) = (ptr(&logits), ptr(&targets), ptr(&weights));
    let (mut v64, mut op, mut dp) = (v, ptr(&loss), ptr(&dlogits));
    let mut args = [
        arg(&mut lp),
        arg(&mut tp),
        arg(&mut wp),
        arg(&mut v64),
        arg(&mut op),
        arg(&mut dp),
    ];
    launch_with(
        kernels.cross_entropy,
        c,
        CE_THREADS,
        &mut args,
        "cuLaunchKernel (cross_entropy)",
    )?;
    Ok((loss, dlogits))
}
