//! Fused ops that tch's op set cannot express at speed, one module per device path:
//!
//! | module    | computes                                                              |
//! |-----------|-----------------------------------------------------------------------|
//! | `cuda.rs` | on CUDA: kernels compiled at run time by NVRTC (`*.cu` beside it): the Gated DeltaNet's conv ([`conv_qkv`]), the MLPs' SwiGLU and MoE glue ([`swiglu`], [`moe_combine`]), the rotary embedding ([`rope`]), the head's cross-entropy ([`cross_entropy`]), the `1 + w` RMSNorm ([`rms_norm_plus_one`]) and Gated DeltaNet's gated norm ([`gated_norm`]), resident blocks' AdamW; and torch's FlashAttention called from C++ (`flash.cpp`) for attention with sinks ([`sink_attention`]) |
//! | this file, `mlp.rs`, `rope.rs`, `ce.rs`, `sinks.rs`, `norm.rs` | the ops' contracts, and on CPU a mirror of each in tch ops (the spec the kernels are tested against, and the path the CPU tests drive through the tape); `mlp.rs` the MLPs' (SwiGLU, the MoE gather and combine), `rope.rs` attention's rotary embedding, `ce.rs` the head's loss, `sinks.rs` GPT-OSS's attention, `norm.rs` the `1 + w` RMSNorm and the gated norm |
//! | `tape.rs` | the ops' backward passes, run by hand after autograd's               |
//!
//! An op computes outside autograd. With grad, its outputs are leaves, and its backward is
//! recorded on the tape; whoever backpropagates through its consumers then calls
//! [`tape::backward`] (worker/src/layer.rs and worker/src/segments.rs do, after a layer's
//! attention half).

mod ce;
mod cuda;
mod mlp;
mod norm;
mod rope;
mod sinks;
pub mod tape;

pub use ce::{cross_entropy, cross_entropy_enabled};
pub use cuda::adamw_resident;
pub use mlp::{
    Pairs, clamped_swiglu, moe_combine, moe_combine_supported, moe_gather, swiglu, swiglu_enabled,
    swiglu_supported,
};
pub use norm::{gated_norm, gated_norm_supported, norm_supported, rms_norm_plus_one};
pub use rope::{rope, rope_enabled, rope_supported};
pub use sinks::{sink_attention, sink_attention_enabled};

use tch::{Device, Kind, Tensor};

/// A `fused|plain` switch (`mt::switches::Fused`: Some(true) fused, Some(false) plain),
/// defaulting (None) to the fused op on CUDA in bf16 (the GPU's compute dtype) and to tch
/// ops elsewhere.
pub fn fused_by_default(forced: Option<bool>, kind: Kind, device: Device) -> bool {
    forced.unwrap_or(device.is_cuda() && kind == Kind::BFloat16)
}

/// The shapes of [`conv_qkv`]: G key heads of Dk, V value heads of Dv, the conv's taps,
/// and the chunked delta rule's chunks (U chunks of C tokens, U C >= T).
#[derive(Debug, Clone, Copy)]
pub struct ConvQkv {
    pub g: i64,
    pub v: i64,
    pub dk: i64,
    pub dv: i64,
    pub taps: i64,
    pub chunk: i64,
    pub chunks: i64,
}

/// Whether [`conv_qkv`] runs for these shapes and dtype on `device`: on CUDA where the
/// kernels compiled and take the shape; on CPU always (the mirror).
pub fn conv_qkv_supported(s: &ConvQkv, kind: Kind, device: Device) -> bool {
    match device {
        Device::Cuda(_) => cuda::supports(s, kind) && cuda::available(),
        _ => true,
    }
}

/// The Gated DeltaNet's token mixing before the delta rule, fused: over the F = 2 G Dk +
/// V Dv conv channels of `qkv_btf` (B, T, F) ([q; k; v], as the input projection makes
/// them), the depthwise causal conv with taps `w` (F, 1, taps) and SiLU; then q and k
/// L2-normed per head (eps 1e-6 under the root), q also scaled by Dk^-1/2. Returns, zero
/// past T, [q; k] per key head and chunk (B, G, U, 2C, Dk) (a chunk's C q rows, then its
/// C k rows) and v (B, V, U, C, Dv): the chunked rule's inputs. Computed in f32 and
/// rounded once to `qkv_btf`'s dtype.
///
/// With grad (`qkv_btf` requires it), the outputs are leaves and the backward (into
/// `qkv_btf`'s graph and `w`) waits on the tape.
pub fn conv_qkv(s: &ConvQkv, qkv_btf: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
    let x = qkv_btf.detach().contiguous();
    let w_plain = w.detach();
    let (qk, v) = match x.device() {
        Device::Cuda(_) => cuda::conv_qkv_fwd(s, &x, &w_plain)
            .unwrap_or_else(|e| panic!("fused conv_qkv forward: {e:#}")),
        _ => {
            let _guard = tch::no_grad_guard();
            mirror(s, &x, &w_plain)
        }
    };
    if !qkv_btf.requires_grad() {
        return (qk, v);
    }
    let (qk, v) = (qk.set_requires_grad(true), v.set_requires_grad(true));
    let (s, input, weight) = (*s, qkv_btf.shallow_clone(), w.shallow_clone());
    tape::record(
        &[qk.shallow_clone(), v.shallow_clone()],
        Box::new(move |grads| {
            let [dqk, dv] = grads else {
                panic!("conv_qkv has two outputs")
            };
            let (dqk, dv) = (
                defined_or_zeros(dqk, &s, true, &x),
                defined_or_zeros(dv, &s, false, &x),
            );
            let (dx, dw) = match x.device() {
                Device::Cuda(_) => cuda::conv_qkv_bwd(&s, &x, &w_plain, &dqk, &dv)
                    .unwrap_or_else(|e| panic!("fused conv_qkv backward: {e:#}")),
                _ => mirror_backward(&s, &x, &w_plain, &dqk, &dv),
            };
            let mut pairs = vec![(input, dx)];
            if weight.requires_grad() {
                pairs.push((weight, dw));
            }
            pairs
        }),
    );
    (qk, v)
}

/// An output's gradient as the backward reads it: contiguous, zeros where none flowed.
fn defined_or_zeros(grad: &Tensor, s: &ConvQkv, qk: bool, x: &Tensor) -> Tensor {
    if grad.defined() {
        return grad.contiguous();
    }
    let b = x.size()[0];
    let shape = match qk {
        true => [b, s.g, s.chunks, 2 * s.chunk, s.dk],
        false => [b, s.v, s.chunks, s.chunk, s.dv],
    };
    Tensor::zeros(shape, (x.kind(), x.device()))
}

/// [`conv_qkv`] in tch ops, f32 inside (as the kernels compute), on any device.
fn mirror(s: &ConvQkv, qkv_btf: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
    let (b, t, f) = qkv_btf.size3().expect("qkv is (B, T, F)");
    let (u, c) = (s.chunks, s.chunk);
    let kind = qkv_btf.kind();
    let act_bft = qkv_btf
        .to_kind(Kind::Float)
        .transpose(1, 2)
        .conv1d(
            &w.to_kind(Kind::Float),
            None::<Tensor>,
            [1],
            [s.taps - 1],
            [1],
            f,
        )
        .narrow(2, 0, t)
        .silu()
        .constant_pad_nd([0, u * c - t]);
    let parts = act_bft.split_with_sizes([2 * s.g * s.dk, s.v * s.dv], 1);
    let qk_bgu2cd = parts[0]
        .view([b, 2, s.g, s.dk, u, c])
        .permute([0, 2, 4, 1, 5, 3]);
    let inv = (qk_bgu2cd
        .square()
        .sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)
        + 1e-6)
        .rsqrt();
    let scale = Tensor::from_slice(&[(s.dk as f64).powf(-0.5), 1.0])
        .to_kind(Kind::Float)
        .to_device(qkv_btf.device())
        .view([1, 1, 1, 2, 1, 1]);
    let qk = (qk_bgu2cd * inv * scale)
        .to_kind(kind)
        .reshape([b, s.g, u, 2 * c, s.dk]);
    let v = parts[1]
        .view([b, s.v, s.dv, u, c])
        .permute([0, 1, 3, 4, 2])
        .to_kind(kind)
        .contiguous();
    (qk, v)
}

/// The mirror's backward by autograd over a recompute: (dqkv, dw) in the inputs' dtypes.
fn mirror_backward(
    s: &ConvQkv,
    qkv_btf: &Tensor,
    w: &Tensor,
    dqk: &Tensor,
    dv: &Tensor,
) -> (Tensor, Tensor) {
    let [dx, dw] = tape::vjp([qkv_btf, w], |[x, w]| {
        let (qk, v) = mirror(s, x, w);
        (qk * dqk).sum(Kind::Float) + (v * dv).sum(Kind::Float)
    });
    (dx, dw)
}
