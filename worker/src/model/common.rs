//! Building blocks the family files share: projections, the two RMSNorm conventions,
//! activations, attention (fused SDPA, or explicit where scores are soft-capped), the
//! embedding and the chunked loss. Each follows transformers' numerics, dtype casts included.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim, V vocabulary, C tokens in a loss chunk.

use mt::config::hf::{Activation, ModelSpec};
use tch::{Kind, Tensor};

use super::{BlockWeights, LayerCtx};
use crate::kernels;

/// `x W^T (+ b)` with the weight (and bias, when the block has one) named `{name}.weight`.
pub fn linear(x: &Tensor, w: &BlockWeights, name: &str) -> Tensor {
    let bias = w.opt(&format!("{name}.bias"));
    x.linear(w.get(&format!("{name}.weight")), bias)
}

/// Llama RMSNorm: the statistic in f32, cast back, then scaled: `w * norm(x).to(dtype)`.
/// Where [`norms_fused`] (CUDA, bf16), torch's fused RMSNorm instead: one pass
/// in f32, the weight applied before the one rounding (a bf16 rounding fewer than
/// transformers' five ops, which make five passes over x and keep f32 copies of it).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    if w.kind() == x.kind() && norms_fused(x) {
        return x.rms_norm([x.size()[x.dim() - 1]], Some(w), eps);
    }
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    w * (xf * (var + eps).rsqrt()).to_kind(x.kind())
}

/// RMSNorm with the weight applied in f32 before the cast (GPT-OSS, OLMo 2):
/// `(w * norm(x)).to(dtype)`.
/// Torch's fused RMSNorm computes exactly this order where [`norms_fused`].
pub fn rms_norm_f32_scale(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    if w.kind() == x.kind() && norms_fused(x) {
        return x.rms_norm([x.size()[x.dim() - 1]], Some(w), eps);
    }
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    (w * (xf * (var + eps).rsqrt())).to_kind(x.kind())
}

/// Whether the RMSNorms here take torch's fused kernel (`aten::rms_norm`) for `x`: by
/// default on CUDA in bf16 (the first two with a weight of x's dtype); `MT_RMS_NORM=fused`
/// forces it (on CPU too), `plain` transformers' ops.
fn norms_fused(x: &Tensor) -> bool {
    kernels::fused_by_default(mt::switches::get().fused.rms_norm, x.kind(), x.device())
}

/// Gemma RMSNorm: everything in f32, scaled by `1 + w`, then cast: `(norm(x) * (1 + w)).to(dtype)`
/// (Gemma, Qwen3-Next and Qwen3.5). Where the RMSNorms are fused ([`norms_fused`]), one op
/// ([`kernels::rms_norm_plus_one`]: on CUDA a kernel over bf16 x, the same order, one
/// rounding) for x it takes (a leaf or no grad, rows it handles), else [`plus_one_ops`].
pub fn rms_norm_plus_one(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    match norms_fused(x) && kernels::norm_supported(x) {
        true => kernels::rms_norm_plus_one(x, w, eps, plus_one_ops),
        false => plus_one_ops(x, w, eps),
    }
}

/// [`rms_norm_plus_one`] in torch's ops (and the fused op's mirror). Where the RMSNorms are
/// fused, torch's fused kernel in f32 on an f32 copy of x with the f32 weight `1 + w`, then
/// the one rounding: the same order. (Given a bf16 x and an f32 weight, torch 2.11 takes its
/// composite path instead, five f32 ops that all keep their inputs.) A torch that refuses
/// falls back to these ops (said once).
fn plus_one_ops(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    static REFUSED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let w1 = || w.to_kind(Kind::Float) + 1.0;
    if REFUSED.get().is_none() && norms_fused(x) {
        let xf = x.to_kind(Kind::Float);
        match xf.f_rms_norm([x.size()[x.dim() - 1]], Some(w1()), eps) {
            Ok(y) => return y.to_kind(x.kind()),
            Err(e) => {
                let e = REFUSED.get_or_init(|| e.to_string());
                tracing::warn!("torch's fused RMSNorm refused f32 ({e}): ops instead");
            }
        }
    }
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    (xf * (var + eps).rsqrt() * w1()).to_kind(x.kind())
}

pub fn activation(x: &Tensor, act: Activation) -> Tensor {
    match act {
        Activation::Silu => x.silu(),
        Activation::GeluTanh => x.gelu("tanh"),
        Activation::Gelu => x.gelu("none"),
        Activation::QuickGelu => x * (x * 1.702).sigmoid(),
    }
}

/// `down(act(gate(x)) * up(x))`: (B, T, H) -> (B, T, H).
pub fn gated_mlp(w: &BlockWeights, spec: &ModelSpec, x_bth: &Tensor) -> Tensor {
    dense_mlp_named(w, spec, x_bth, "mlp")
}

/// A dense layer's [`gated_mlp_named`], SiLU(gate) * up as one fused op where
/// [`kernels::swiglu_enabled`] (CUDA, bf16): its backward runs from the kernels' tape, into
/// x's graph, which nothing else in the MLP half reads (worker/src/layer.rs backpropagates
/// that half on its own first: `super::mlp_on_tape`).
pub fn dense_mlp_named(w: &BlockWeights, spec: &ModelSpec, x: &Tensor, prefix: &str) -> Tensor {
    let a = dense_mlp_act(w, spec, x, prefix);
    linear(&a, w, &format!("{prefix}.down_proj"))
}

/// [`dense_mlp_named`] up to its down projection: `act(gate(x)) * up(x)`, the projection's
/// input: (.., H) -> (.., I).
pub fn dense_mlp_act(w: &BlockWeights, spec: &ModelSpec, x: &Tensor, prefix: &str) -> Tensor {
    let gate = linear(x, w, &format!("{prefix}.gate_proj"));
    let up = linear(x, w, &format!("{prefix}.up_proj"));
    glu(spec, &gate, &up)
}

/// `act(gate) * up` of a dense MLP, SiLU's as one fused op where [`kernels::swiglu_enabled`]
/// (its backward then runs from the kernels' tape): (.., I) twice -> (.., I).
pub fn glu(spec: &ModelSpec, gate: &Tensor, up: &Tensor) -> Tensor {
    let x = gate;
    let i = gate.size()[gate.dim() - 1];
    let fused = spec.hidden_act == Activation::Silu
        && kernels::swiglu_enabled(x.kind(), x.device())
        && kernels::swiglu_supported(x.kind(), i, x.device());
    match fused {
        true => kernels::swiglu(gate, up),
        false => activation(gate, spec.hidden_act) * up,
    }
}

/// [`gated_mlp`] with the projections under `{prefix}.gate_proj` etc., in tch ops (a
/// shared expert's, or one expert's on the per-expert path): (.., H) -> (.., H).
pub fn gated_mlp_named(w: &BlockWeights, spec: &ModelSpec, x: &Tensor, prefix: &str) -> Tensor {
    let gate = activation(
        &linear(x, w, &format!("{prefix}.gate_proj")),
        spec.hidden_act,
    );
    let up = linear(x, w, &format!("{prefix}.up_proj"));
    linear(&(gate * up), w, &format!("{prefix}.down_proj"))
}

/// `down(up * act(gate))` with `[gate; up] = gate_up(x)` fused in `{prefix}.gate_up_proj`
/// (Phi-3, GLM-4): (.., H) -> (.., H).
pub fn fused_gated_mlp(w: &BlockWeights, spec: &ModelSpec, x: &Tensor, prefix: &str) -> Tensor {
    let a = fused_gated_act(w, spec, x, prefix);
    linear(&a, w, &format!("{prefix}.down_proj"))
}

/// [`fused_gated_mlp`] up to its down projection: `up * act(gate)`, the projection's input:
/// (.., H) -> (.., I).
pub fn fused_gated_act(w: &BlockWeights, spec: &ModelSpec, x: &Tensor, prefix: &str) -> Tensor {
    let gate_up = linear(x, w, &format!("{prefix}.gate_up_proj"));
    let i = spec.intermediate_size as i64;
    let gate = gate_up.narrow(-1, 0, i);
    let up = gate_up.narrow(-1, i, i);
    up * activation(&gate, spec.hidden_act)
}

/// The layer's MLP: the sparse mixture-of-experts block where the layer has one, else the
/// dense gated MLP: (B, T, H) -> (B, T, H).
pub fn mlp(w: &BlockWeights, spec: &ModelSpec, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    if lc.sparse {
        super::moe::sparse_mlp(spec, w, x_bth, lc)
    } else {
        gated_mlp(w, spec, x_bth)
    }
}

/// (B, T, N*D) -> (B, N, T, D) for `heads` heads.
pub fn split_heads(x_btf: &Tensor, heads: usize, d: usize) -> Tensor {
    let (b, t) = (x_btf.size()[0], x_btf.size()[1]);
    x_btf.view([b, t, heads as i64, d as i64]).transpose(1, 2)
}

/// (B, N, T, D) -> (B, T, N*D).
pub fn merge_heads(x_bntd: &Tensor) -> Tensor {
    let s = x_bntd.size();
    x_bntd.transpose(1, 2).reshape([s[0], s[2], s[1] * s[3]])
}

/// Causal attention of rotated queries over keys and values (K heads shared by N/K query
/// heads each), with the layer's mask: (B, N, T, D) -> (B, N, T, D).
pub fn attend(
    spec: &ModelSpec,
    q_bntd: &Tensor,
    k_bktd: &Tensor,
    v_bktd: &Tensor,
    lc: &LayerCtx,
) -> Tensor {
    let gqa = spec.num_kv_heads != spec.num_heads;
    match (spec.attn_softcap, lc.mask_tt) {
        (None, None) => Tensor::scaled_dot_product_attention(
            q_bntd,
            k_bktd,
            v_bktd,
            None::<Tensor>,
            0.0,
            true,
            spec.attn_scale,
            gqa,
        ),
        (None, Some(mask_tt)) => Tensor::scaled_dot_product_attention(
            q_bntd,
            k_bktd,
            v_bktd,
            Some(mask_tt),
            0.0,
            false,
            spec.attn_scale,
            gqa,
        ),
        (Some(cap), mask) => {
            let mask_tt = mask.expect("Context builds a mask for soft-capped attention");
            softcapped_attention(spec, q_bntd, k_bktd, v_bktd, mask_tt, cap)
        }
    }
}

/// transformers' eager attention with `cap * tanh(scores / cap)` before the mask; the
/// softmax in f32, its result cast back to the compute dtype.
fn softcapped_attention(
    spec: &ModelSpec,
    q_bntd: &Tensor,
    k_bktd: &Tensor,
    v_bktd: &Tensor,
    mask_tt: &Tensor,
    cap: f64,
) -> Tensor {
    let rep = (spec.num_heads / spec.num_kv_heads) as i64;
    let k_bntd = repeat_kv(k_bktd, rep);
    let v_bntd = repeat_kv(v_bktd, rep);
    let scores_bntt = q_bntd.matmul(&k_bntd.transpose(2, 3)) * spec.attn_scale;
    let scores_bntt = (scores_bntt / cap).tanh() * cap;
    let scores_bntt = scores_bntt.masked_fill(&mask_tt.logical_not(), f64::NEG_INFINITY);
    let p_bntt = scores_bntt.softmax(-1, Kind::Float).to_kind(q_bntd.kind());
    p_bntt.matmul(&v_bntd)
}

/// (B, K, T, D) -> (B, K*rep, T, D), each key/value head repeated for its query heads.
pub fn repeat_kv(x_bktd: &Tensor, rep: i64) -> Tensor {
    if rep == 1 {
        return x_bktd.shallow_clone();
    }
    let s = x_bktd.size();
    x_bktd
        .unsqueeze(2)
        .expand([s[0], s[1], rep, s[2], s[3]], false)
        .reshape([s[0], s[1] * rep, s[2], s[3]])
}

/// Token embedding: ids (B, T) -> (B, T, H); the padding row gets no gradient and Gemma's
/// scale is applied in the weight's dtype (sqrt(H) as f32, then cast, as transformers does).
pub fn embed(spec: &ModelSpec, w: &BlockWeights, ids_bt: &Tensor) -> Tensor {
    let table_vh = w.get("model.embed_tokens.weight");
    let pad = spec.embed_padding_idx.unwrap_or(-1);
    let e_bth = Tensor::embedding(table_vh, ids_bt, pad, false, false);
    match spec.embed_scale {
        None => e_bth,
        Some(s) => {
            let scale =
                Tensor::scalar_tensor(s, (Kind::Float, table_vh.device())).to_kind(table_vh.kind());
            e_bth * scale
        }
    }
}

/// Summed token cross-entropy of one chunk: logits = h W^T in the compute dtype (soft-capped
/// there when the family caps them), the loss in f32 (as transformers upcasts logits), -100
/// ignored.
pub fn chunk_loss_sum(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
) -> Tensor {
    chunk_cross_entropy(spec, h_ch, lm_head_vh, targets_c, tch::Reduction::Sum)
}

/// Each token's cross-entropy (C,) f32 of one chunk of normed hidden states (C, H) against
/// its targets: minus the log-probability of the target.
pub fn chunk_token_losses(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
) -> Tensor {
    chunk_cross_entropy(spec, h_ch, lm_head_vh, targets_c, tch::Reduction::None)
}

/// The cross-entropy of one chunk's logits against its targets (-100 ignored), reduced.
fn chunk_cross_entropy(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
    reduction: tch::Reduction,
) -> Tensor {
    logits(spec, h_ch, lm_head_vh).cross_entropy_loss(
        targets_c,
        None::<Tensor>,
        reduction,
        -100,
        0.0,
    )
}

/// Logits of normed hidden states (M, H) -> (M, V) in f32: the lm_head in the compute
/// dtype, soft-capped where the family caps them, then upcast as transformers does.
pub fn logits(spec: &ModelSpec, h_mh: &Tensor, lm_head_vh: &Tensor) -> Tensor {
    compute_logits(spec, h_mh, lm_head_vh).to_kind(Kind::Float)
}

/// [`logits`] before the upcast, in the compute dtype.
pub fn compute_logits(spec: &ModelSpec, h_mh: &Tensor, lm_head_vh: &Tensor) -> Tensor {
    let logits_mv = h_mh.linear(lm_head_vh, None::<Tensor>);
    match spec.final_softcap {
        Some(cap) => (logits_mv / cap).tanh() * cap,
        None => logits_mv,
    }
}
