//! mlp.cu's launches: the MoE combine and its backward, the SwiGLU and the clamped SwiGLU
//! (`super::super::mlp`).

use anyhow::{Context as _, Result};
use tch::{Kind, Tensor};

use super::{
    CLAMPED_SWIGLU, COMBINE_BWD, COMBINE_FWD, SWIGLU, arg, kernels, launch_with, packed, ptr,
};

/// mlp.cu's block: 8 warps, a token or a sorted row each.
const COMBINE_WARPS: i64 = 8;

/// Whether mlp.cu's combine takes experts' outputs of `kind` and width `h` and router
/// weights of `weights`: bf16 outputs in rows of whole 16-byte packs, f32 or bf16 weights.
pub fn combine_supports(kind: Kind, h: i64, weights: Kind) -> bool {
    kind == Kind::BFloat16 && h % 8 == 0 && matches!(weights, Kind::Float | Kind::BFloat16)
}

/// See `super::moe_combine`: y (S, H) bf16 contiguous, unsort (S) int64, weights (N, K)
/// contiguous -> out (N, H).
pub fn moe_combine_fwd(y_sh: &Tensor, unsort_s: &Tensor, weights_nk: &Tensor) -> Result<Tensor> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let y_sh = &packed(y_sh);
    let (n, k) = weights_nk.size2().context("weights are (N, K)")?;
    let h = y_sh.size()[1];
    let out = Tensor::empty([n, h], (y_sh.kind(), y_sh.device()));
    let f = kernels.mlp[COMBINE_FWD + usize::from(weights_nk.kind() == Kind::BFloat16)];
    let (mut yp, mut up, mut wp, mut op) = (ptr(y_sh), ptr(unsort_s), ptr(weights_nk), ptr(&out));
    let (mut n64, mut k32, mut h32) = (n, k as i32, h as i32);
    let mut args = [
        arg(&mut yp),
        arg(&mut up),
        arg(&mut wp),
        arg(&mut op),
        arg(&mut n64),
        arg(&mut k32),
        arg(&mut h32),
    ];
    let blocks = (n + COMBINE_WARPS - 1) / COMBINE_WARPS;
    let threads = (32 * COMBINE_WARPS) as u32;
    launch_with(
        f,
        blocks,
        threads,
        &mut args,
        "cuLaunchKernel (moe_combine_fwd)",
    )?;
    Ok(out)
}

/// The backward of [`moe_combine_fwd`]: from the output's gradient dout (N, H) bf16
/// contiguous, the gradients of y (S, H) and of the weights (N, K) in their dtype; `pair_s`
/// (S) int64 is the pair of each sorted row.
pub fn moe_combine_bwd(
    dout_nh: &Tensor,
    y_sh: &Tensor,
    pair_s: &Tensor,
    weights_nk: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (dout_nh, y_sh) = (&packed(dout_nh), &packed(y_sh));
    let (_, k) = weights_nk.size2().context("weights are (N, K)")?;
    let (s, h) = y_sh.size2().context("y is (S, H)")?;
    let dy = Tensor::empty([s, h], (y_sh.kind(), y_sh.device()));
    let dw = Tensor::empty(
        weights_nk.size().as_slice(),
        (weights_nk.kind(), y_sh.device()),
    );
    let f = kernels.mlp[COMBINE_BWD + usize::from(weights_nk.kind() == Kind::BFloat16)];
    let (mut gp, mut yp, mut pp, mut wp) = (ptr(dout_nh), ptr(y_sh), ptr(pair_s), ptr(weights_nk));
    let (mut dyp, mut dwp) = (ptr(&dy), ptr(&dw));
    let (mut s64, mut k32, mut h32) = (s, k as i32, h as i32);
    let mut args = [
        arg(&mut gp),
        arg(&mut yp),
        arg(&mut pp),
        arg(&mut wp),
        arg(&mut dyp),
        arg(&mut dwp),
        arg(&mut s64),
        arg(&mut k32),
        arg(&mut h32),
    ];
    let blocks = (s + COMBINE_WARPS - 1) / COMBINE_WARPS;
    let threads = (32 * COMBINE_WARPS) as u32;
    launch_with(
        f,
        blocks,
        threads,
        &mut args,
        "cuLaunchKernel (moe_combine_bwd)",
    )?;
    Ok((dy, dw))
}

/// Whether mlp.cu's SwiGLU takes (.., I) tensors of `kind`: bf16, I a multiple of 8.
pub fn swiglu_supports(kind: Kind, i: i64) -> bool {
    kind == Kind::BFloat16 && i % 8 == 0
}

/// Blocks for a grid-stride loop over `packs` 8-element packs: enough to fill any GPU.
fn stride_blocks(packs: i64) -> i64 {
    ((packs + 255) / 256).clamp(1, 16 * 1024)
}

/// See `super::swiglu`: gate and up (.., I) bf16 contiguous -> silu(gate) up.
pub fn swiglu_fwd(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (gate, up) = (&packed(gate), &packed(up));
    let h = gate.empty_like();
    let mut packs = gate.numel() as i64 / 8;
    let (mut gp, mut up_, mut hp) = (ptr(gate), ptr(up), ptr(&h));
    let mut args = [arg(&mut gp), arg(&mut up_), arg(&mut hp), arg(&mut packs)];
    let blocks = stride_blocks(packs);
    launch_with(
        kernels.mlp[SWIGLU],
        blocks,
        256,
        &mut args,
        "cuLaunchKernel (swiglu_fwd)",
    )?;
    Ok(h)
}

/// The backward of [`swiglu_fwd`]: from dh (contiguous, as gate), (dgate, dup).
pub fn swiglu_bwd(gate: &Tensor, up: &Tensor, dh: &Tensor) -> Result<(Tensor, Tensor)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (gate, up, dh) = (&packed(gate), &packed(up), &packed(dh));
    let (dg, du) = (gate.empty_like(), up.empty_like());
    let mut packs = gate.numel() as i64 / 8;
    let (mut gp, mut up_, mut dp) = (ptr(gate), ptr(up), ptr(dh));
    let (mut dgp, mut dup) = (ptr(&dg), ptr(&du));
    let mut args = [
        arg(&mut gp),
        arg(&mut up_),
        arg(&mut dp),
        arg(&mut dgp),
        arg(&mut dup),
        arg(&mut packs),
    ];
    let blocks = stride_blocks(packs);
    launch_with(
        kernels.mlp[SWIGLU + 1],
        blocks,
        256,
        &mut args,
        "cuLaunchKernel (swiglu_bwd)",
    )?;
    Ok((dg, du))
}

/// See `super::clamped_swiglu`: gate_up (.., 2I) bf16 contiguous, gate and up interleaved ->
/// (.., I).
pub fn clamped_swiglu_fwd(gate_up: &Tensor, alpha: f32, limit: f32) -> Result<Tensor> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let gate_up = &packed(gate_up);
    let mut shape = gate_up.size();
    *shape.last_mut().context("gate_up has a last dim")? /= 2;
    let h = Tensor::empty(shape.as_slice(), (gate_up.kind(), gate_up.device()));
    let mut packs = h.numel() as i64 / 8;
    let (mut gp, mut hp, mut a, mut l) = (ptr(gate_up), ptr(&h), alpha, limit);
    let mut args = [
        arg(&mut gp),
        arg(&mut hp),
        arg(&mut packs),
        arg(&mut a),
        arg(&mut l),
    ];
    let blocks = stride_blocks(packs);
    let what = "cuLaunchKernel (clamped_swiglu_fwd)";
    launch_with(kernels.mlp[CLAMPED_SWIGLU], blocks, 256, &mut args, what)?;
    Ok(h)
}

/// The backward of [`clamped_swiglu_fwd`]: from dh (.., I) contiguous, d gate_up (.., 2I).
pub fn clamped_swiglu_bwd(gate_up: &Tensor, dh: &Tensor, alpha: f32, limit: f32) -> Result<Tensor> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (gate_up, dh) = (&packed(gate_up), &packed(dh));
    let dgu = gate_up.empty_like();
    let mut packs = dh.numel() as i64 / 8;
    let (mut gp, mut dp, mut op) = (ptr(gate_up), ptr(dh), ptr(&dgu));
    let (mut a, mut l) = (alpha, limit);
    let mut args = [
        arg(&mut gp),
        arg(&mut dp),
        arg(&mut op),
        arg(&mut packs),
        arg(&mut a),
        arg(&mut l),
    ];
    let blocks = stride_blocks(packs);
    let what = "cuLaunchKernel (clamped_swiglu_bwd)";
    launch_with(
        kernels.mlp[CLAMPED_SWIGLU + 1],
        blocks,
        256,
        &mut args,
        what,
    )?;
    Ok(dgu)
}
