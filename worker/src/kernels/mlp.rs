//! The MLPs' fused ops: the SwiGLU between the gate/up and down projections ([`swiglu`],
//! dense MLPs and experts alike; GPT-OSS's [`clamped_swiglu`]), and around the expert GEMMs
//! (worker/src/model/experts.rs) the (token, slot) pairs' rows gathered in expert order
//! ([`moe_gather`]) and the experts' outputs brought back, weighted and summed per token
//! ([`moe_combine`]). The backwards are elementwise, gathers and per-row
//! reductions (no atomic scatter-add), from the tape.
//!
//! Shapes: N tokens, H hidden size, K experts per token, S = N K pairs, the pair of token t
//! and slot k being p = t K + k.

use tch::{Device, Kind, Tensor};

use super::cuda;
use super::tape::{self, vjp};

/// Whether [`moe_combine`] runs for experts' outputs of `kind` and width `h`, router
/// weights of `weights`, on `device`: on CUDA where the kernels compiled and take them
/// (bf16 outputs, H a multiple of 8, f32 or bf16 weights); on CPU always (the mirror).
pub fn moe_combine_supported(kind: Kind, h: i64, weights: Kind, device: Device) -> bool {
    match device {
        Device::Cuda(_) => cuda::combine_supports(kind, h, weights) && cuda::available(),
        _ => true,
    }
}

/// The S pairs in expert order: `pair_s[r]` is the pair of sorted row r, `unsort_s[p]` the
/// sorted row of pair p (its inverse), int64 on the activations' device.
pub struct Pairs {
    pub pair_s: Tensor,
    unsort_s: Tensor,
    k: i64,
}

impl Pairs {
    /// From the pair of each sorted row, for `k` slots per token.
    pub fn new(pair_s: &Tensor, k: i64) -> Pairs {
        let arange_s = Tensor::arange(pair_s.size()[0], (Kind::Int64, pair_s.device()));
        Pairs {
            pair_s: pair_s.shallow_clone(),
            unsort_s: pair_s.zeros_like().scatter(0, pair_s, &arange_s),
            k,
        }
    }

    fn shallow_clone(&self) -> Pairs {
        Pairs {
            pair_s: self.pair_s.shallow_clone(),
            unsort_s: self.unsort_s.shallow_clone(),
            k: self.k,
        }
    }
}

/// Each pair's token row in expert order: `x_nh` (N, H) -> (S, H), row r being token
/// `pair_s[r] / K`. The backward sums each token's K rows of the gradient in f32 and rounds
/// once (as the embedding lookup's backward does), through [`moe_combine`]'s kernel with
/// unit weights. With grad, the output is a leaf and the backward waits on the tape.
pub fn moe_gather(x_nh: &Tensor, pairs: &Pairs) -> Tensor {
    let token_s = pairs.pair_s.divide_scalar_mode(pairs.k, "floor");
    let x_sh = x_nh.detach().index_select(0, &token_s);
    if !x_nh.requires_grad() {
        return x_sh;
    }
    let (input, pairs) = (x_nh.shallow_clone(), pairs.shallow_clone());
    tape::record_one(x_sh, move |dx_sh| {
        let n = input.size()[0];
        let ones_nk = Tensor::ones([n, pairs.k], (Kind::Float, dx_sh.device()));
        let dx = combine(&dx_sh.contiguous(), &pairs.unsort_s, &ones_nk);
        vec![(input, dx)]
    })
}

/// A mixture of experts' outputs combined: `y_sh` (S, H), the experts' outputs for the
/// pairs in expert order; returns (N, H), each token's K outputs times its router weights
/// `weights_nk` (N, K), summed over the slots. Each product is rounded to y's dtype and
/// the K of a token summed in f32 and rounded once (as torch's un-permutation by a gather,
/// product with the weights, cast and sum: the mirror). The backward is a gather of the
/// output's gradient scaled by the weights, and one dot product per pair for the weights.
///
/// With grad (`y_sh` or the weights require it), the output is a leaf and the backward
/// waits on the tape.
pub fn moe_combine(y_sh: &Tensor, pairs: &Pairs, weights_nk: &Tensor) -> Tensor {
    let y = y_sh.detach().contiguous();
    let w = weights_nk.detach().contiguous();
    let out = combine(&y, &pairs.unsort_s, &w);
    if !y_sh.requires_grad() && !weights_nk.requires_grad() {
        return out;
    }
    let (y_in, w_in) = (y_sh.shallow_clone(), weights_nk.shallow_clone());
    let pairs = pairs.shallow_clone();
    tape::record_one(out, move |dout| {
        let dout = dout.contiguous();
        let (dy, dw) = match y.device() {
            Device::Cuda(_) if y.size()[0] > 0 => {
                cuda::moe_combine_bwd(&dout, &y, &pairs.pair_s, &w)
                    .unwrap_or_else(|e| panic!("fused moe_combine backward: {e:#}"))
            }
            _ => mirror_backward(&y, &pairs.unsort_s, &w, &dout),
        };
        needing_grad([(y_in, dy), (w_in, dw)])
    })
}

/// The (input, gradient) pairs whose input requires grad.
fn needing_grad<const N: usize>(pairs: [(Tensor, Tensor); N]) -> Vec<(Tensor, Tensor)> {
    pairs
        .into_iter()
        .filter(|(input, _)| input.requires_grad())
        .collect()
}

/// The combine's forward on plain tensors: the kernel on CUDA, the mirror elsewhere.
fn combine(y_sh: &Tensor, unsort_s: &Tensor, weights_nk: &Tensor) -> Tensor {
    match y_sh.device() {
        Device::Cuda(_) if y_sh.size()[0] > 0 => cuda::moe_combine_fwd(y_sh, unsort_s, weights_nk)
            .unwrap_or_else(|e| panic!("fused moe_combine forward: {e:#}")),
        _ => {
            let _guard = tch::no_grad_guard();
            mirror(y_sh, unsort_s, weights_nk)
        }
    }
}

/// [`moe_combine`] in tch ops, given the sorted row of each pair: the un-permutation, the
/// product with the weights in their dtype (f32 for Mixtral's), the cast and the sum.
fn mirror(y_sh: &Tensor, unsort_s: &Tensor, weights_nk: &Tensor) -> Tensor {
    let (n, k) = weights_nk.size2().expect("router weights are (N, K)");
    let kind = y_sh.kind();
    let y_nkh = y_sh.index_select(0, unsort_s).view([n, k, -1]);
    (y_nkh * weights_nk.unsqueeze(-1))
        .to_kind(kind)
        .sum_dim_intlist(1, false, kind)
}

/// The mirror's backward by autograd over a recompute: (dy, dweights) in the inputs' dtypes.
fn mirror_backward(
    y_sh: &Tensor,
    unsort_s: &Tensor,
    weights_nk: &Tensor,
    dout_nh: &Tensor,
) -> (Tensor, Tensor) {
    let [dy, dw] = vjp([y_sh, weights_nk], |[y, w]| {
        (mirror(y, unsort_s, w) * dout_nh).sum(Kind::Float)
    });
    (dy, dw)
}

/// Whether dense MLPs take [`swiglu`] for activations of `kind` on `device`: by default on
/// CUDA in bf16; `MT_SWIGLU=fused` forces it (the mirror on CPU), `plain` the tch ops. (The
/// experts' SwiGLU goes with their fused combine, `MT_MOE_COMBINE`.)
pub fn swiglu_enabled(kind: Kind, device: Device) -> bool {
    super::fused_by_default(mt::switches::get().fused.swiglu, kind, device)
}

/// Whether [`swiglu`] runs for (.., I) tensors of `kind` on `device`: on CUDA where the
/// kernels compiled and take them (bf16, I a multiple of 8); on CPU always (the mirror).
pub fn swiglu_supported(kind: Kind, i: i64, device: Device) -> bool {
    match device {
        Device::Cuda(_) => cuda::swiglu_supports(kind, i) && cuda::available(),
        _ => true,
    }
}

/// `silu(gate) * up` for `gate` and `up` of one shape (.., I): on CUDA in f32 from the
/// inputs and rounded once (torch's ops, the mirror, round silu's output first); the
/// backward from the tape (the kernels keep gate and up, autograd also silu's output).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    let (g, u) = (gate.detach().contiguous(), up.detach().contiguous());
    let h = match g.device() {
        Device::Cuda(_) if g.numel() > 0 => {
            cuda::swiglu_fwd(&g, &u).unwrap_or_else(|e| panic!("fused swiglu forward: {e:#}"))
        }
        _ => {
            let _guard = tch::no_grad_guard();
            g.silu() * &u
        }
    };
    if !gate.requires_grad() && !up.requires_grad() {
        return h;
    }
    let (g_in, u_in) = (gate.shallow_clone(), up.shallow_clone());
    tape::record_one(h, move |dh| {
        let (dg, du) = match g.device() {
            Device::Cuda(_) if g.numel() > 0 => cuda::swiglu_bwd(&g, &u, &dh.contiguous())
                .unwrap_or_else(|e| panic!("fused swiglu backward: {e:#}")),
            _ => {
                let [dg, du] = vjp([&g, &u], |[g, u]| (g.silu() * u * dh).sum(Kind::Float));
                (dg, du)
            }
        };
        needing_grad([(g_in, dg), (u_in, du)])
    })
}

/// GPT-OSS's clamped SwiGLU of `gate_up` (.., 2I), gate and up interleaved along the last
/// dim (even columns gate, odd up): `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)`
/// for `g = min(gate, limit)`, (.., I). On CUDA ([`swiglu_supported`] for I) in f32 and
/// rounded once; the mirror is torch's ops (worker/src/model/experts.rs `clamped_swiglu`,
/// passed in as `ops`). The backward from the tape; the kernels keep gate_up alone.
pub fn clamped_swiglu(
    gate_up: &Tensor,
    alpha: f64,
    limit: f64,
    ops: fn(&Tensor, f64, f64) -> Tensor,
) -> Tensor {
    let gu = gate_up.detach().contiguous();
    let (a32, l32) = (alpha as f32, limit as f32);
    let h = match gu.device() {
        Device::Cuda(_) if gu.numel() > 0 => cuda::clamped_swiglu_fwd(&gu, a32, l32)
            .unwrap_or_else(|e| panic!("fused clamped swiglu forward: {e:#}")),
        _ => {
            let _guard = tch::no_grad_guard();
            ops(&gu, alpha, limit)
        }
    };
    if !gate_up.requires_grad() {
        return h;
    }
    let input = gate_up.shallow_clone();
    tape::record_one(h, move |dh| {
        let dgu = match gu.device() {
            Device::Cuda(_) if gu.numel() > 0 => {
                cuda::clamped_swiglu_bwd(&gu, &dh.contiguous(), a32, l32)
                    .unwrap_or_else(|e| panic!("fused clamped swiglu backward: {e:#}"))
            }
            _ => {
                let [dgu] = vjp([&gu], |[gu]| (ops(gu, alpha, limit) * dh).sum(Kind::Float));
                dgu
            }
        };
        vec![(input, dgu)]
    })
}
