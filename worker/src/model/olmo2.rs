//! OLMo 2, as transformers' `modeling_olmo2.py` computes it: no norm before attention or
//! MLP; each sublayer's output is normalized before the residual add
//! (`post_attention_layernorm`, `post_feedforward_layernorm`), and queries and keys are
//! normalized over all heads at once (`q_norm` of size N*D, `k_norm` of K*D) before they
//! split into heads. Every RMSNorm applies its weight in f32, then casts.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, gated_mlp, linear, merge_heads, rms_norm_f32_scale, split_heads};
use super::{BlockWeights, LayerCtx};

// One decoder layer: `h = x + norm1(attn(x)); out = h + norm2(mlp(h))`.

/// `h = x + norm1(attn(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_bth = attention(spec, w, x_bth, lc);
    let norm_w = w.get("post_attention_layernorm.weight");
    x_bth + rms_norm_f32_scale(&attn_bth, norm_w, spec.rms_norm_eps)
}

/// `out = h + norm2(mlp(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    let mlp_bth = gated_mlp(w, spec, h_bth);
    let norm_w = w.get("post_feedforward_layernorm.weight");
    h_bth + rms_norm_f32_scale(&mlp_bth, norm_w, spec.rms_norm_eps)
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d, eps) = (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.rms_norm_eps,
    );
    let norm = |x: &Tensor, name: &str| rms_norm_f32_scale(x, w.get(name), eps);
    let x_bth = &lc.rope.input(x_bth);
    let q_btf = norm(
        &linear(x_bth, w, "self_attn.q_proj"),
        "self_attn.q_norm.weight",
    );
    let k_btf = norm(
        &linear(x_bth, w, "self_attn.k_proj"),
        "self_attn.k_norm.weight",
    );
    let q_bntd = split_heads(&q_btf, n, d);
    let k_bktd = split_heads(&k_btf, k, d);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}
