//! The `1 + w` RMSNorm (Gemma, Qwen3-Next, Qwen3.5) as one op ([`rms_norm_plus_one`]): on
//! CUDA one pass over the bf16 rows each way (norm.cu, in f32, rounded once), where torch
//! 2.11 takes its fused kernel only on an f32 copy of x, a cast each way, and keeps that
//! copy for the backward. The backward, from the tape, reads x and the rows' rstd.
//!
//! The op's input must be a leaf where it requires grad (the layer's input, or the MLP
//! half's as worker/src/layer.rs backpropagates it): the tape hands x its gradient after
//! autograd's pass has reached x through the residual, and a second pass into a graph
//! above x would find it freed. The caller checks ([`norm_supported`]) and takes tch ops
//! otherwise.

use tch::{Device, Kind, Tensor};

use super::cuda;
use super::tape::{self, vjp};

/// The mirror's signature: x, w, eps -> `(norm(x) (1 + w)).to(x's dtype)`.
pub type NormOps = fn(&Tensor, &Tensor, f64) -> Tensor;

/// Whether [`rms_norm_plus_one`] runs for `x`: on CUDA where the kernels compiled and take
/// its rows (bf16, contiguous, see `cuda::norm_plus_one_supports`); on CPU always (the
/// mirror); and, where x requires grad, only for a leaf.
pub fn norm_supported(x: &Tensor) -> bool {
    let rows_ok = match x.device() {
        Device::Cuda(_) => {
            let h = x.size().last().copied().unwrap_or(0);
            x.is_contiguous() && cuda::norm_plus_one_supports(x.kind(), h) && cuda::available()
        }
        _ => true,
    };
    rows_ok && (!x.requires_grad() || x.is_leaf())
}

/// `(norm(x) (1 + w)).to(x's dtype)` over x's last dim, with the norm in f32 and eps as
/// transformers' Gemma / Qwen3-Next RMSNorm; `ops` is the mirror (torch's ops), on CPU and
/// for the CPU backward. With grad, the output is a leaf whose backward is on the tape.
pub fn rms_norm_plus_one(x: &Tensor, w: &Tensor, eps: f64, ops: NormOps) -> Tensor {
    let h = x.size().last().copied().unwrap_or(0);
    // Requires grad where grad mode is on and w does: then w's gradient comes from here.
    let w1 = w.to_kind(Kind::Float) + 1.0;
    let grad = x.requires_grad() || w1.requires_grad();
    let (xd, wd) = (x.detach(), w.detach());
    let (y, rstd) = match x.device() {
        Device::Cuda(_) => {
            let w1 = w1.detach();
            cuda::norm_plus_one_fwd(&xd, &w1, eps, grad)
                .unwrap_or_else(|e| panic!("fused (1 + w) RMSNorm over {h} channels: {e:#}"))
        }
        _ => (tch::no_grad(|| ops(&xd, &wd, eps)), None),
    };
    if !grad {
        return y;
    }
    let (x_in, w_in) = (x.shallow_clone(), w.shallow_clone());
    tape::record_one(y, move |dy| {
        let (dx, dw) = match rstd {
            Some(rstd) => cuda::norm_plus_one_bwd(&xd, dy, &w1.detach(), &rstd)
                .unwrap_or_else(|e| panic!("fused (1 + w) RMSNorm backward: {e:#}")),
            None => {
                let [dx, dw] = vjp([&xd, &wd], |[x, w]| (ops(x, w, eps) * dy).sum(Kind::Float));
                (dx, dw)
            }
        };
        tape::input_grads([x_in, w_in], [dx, dw])
    })
}

/// The gated norm's mirror: o (B, V, P, Dv), z (B, T, V, Dv), w (Dv), eps -> (B, T, V Dv).
pub type GatedOps = fn(&Tensor, &Tensor, &Tensor, f64) -> Tensor;

/// Whether [`gated_norm`] runs for o (B, V, P, Dv) and z: on CUDA where the kernels
/// compiled and take the head dim (`cuda::gated_norm_supports`); on CPU always (the
/// mirror).
pub fn gated_norm_supported(o_bvpd: &Tensor, z_btvd: &Tensor) -> bool {
    match o_bvpd.device() {
        Device::Cuda(_) => {
            let dv = o_bvpd.size().last().copied().unwrap_or(0);
            z_btvd.kind() == o_bvpd.kind()
                && cuda::gated_norm_supports(o_bvpd.kind(), dv)
                && cuda::available()
        }
        _ => true,
    }
}

/// The Gated DeltaNet's gated RMSNorm per value head and the move to out_proj's layout:
/// o (B, V, P, Dv) (the rule's output over its padded chunks, P >= T), z (B, T, V, Dv), w
/// (Dv) -> `norm(o[.., :T]) w silu(z)` as (B, T, V Dv); on CUDA one kernel each way
/// (norm.cu, f32 inside, rounded once); `ops` is the mirror, on CPU and for the CPU
/// backward. With grad, the output is a leaf whose backward is on the tape; o's and z's
/// graphs must be reachable only through it (o's consumer is this op; z is behind the
/// mixer's [z; b; a] boundary, `gated_delta::recurrence::taped`).
pub fn gated_norm(o_bvpd: &Tensor, z_btvd: &Tensor, w: &Tensor, eps: f64, ops: GatedOps) -> Tensor {
    let wf = w.to_kind(Kind::Float);
    let grad = o_bvpd.requires_grad() || z_btvd.requires_grad() || wf.requires_grad();
    let (od, zd, wd) = (o_bvpd.detach(), z_btvd.detach(), w.detach());
    let (y, rstd) = match o_bvpd.device() {
        Device::Cuda(_) => cuda::gated_norm_fwd(&od, &zd, &wf.detach(), eps, grad)
            .unwrap_or_else(|e| panic!("fused gated RMSNorm: {e:#}")),
        _ => (tch::no_grad(|| ops(&od, &zd, &wd, eps)), None),
    };
    if !grad {
        return y;
    }
    let inputs = [o_bvpd, z_btvd, w].map(Tensor::shallow_clone);
    tape::record_one(y, move |dy| {
        let grads = match rstd {
            Some(rstd) => {
                let (d_o, dz, dw) = cuda::gated_norm_bwd(&od, &zd, &wf.detach(), &rstd, dy)
                    .unwrap_or_else(|e| panic!("fused gated RMSNorm backward: {e:#}"));
                [d_o, dz, dw]
            }
            None => vjp([&od, &zd, &wd], |[o, z, w]| {
                (ops(o, z, w, eps) * dy).sum(Kind::Float)
            }),
        };
        tape::input_grads(inputs, grads)
    })
}
