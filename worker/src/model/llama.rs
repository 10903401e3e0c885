//! The Llama family as transformers' `modeling_llama.py` computes it, which also covers the
//! Llama-shaped `modeling_mistral.py` and `modeling_qwen2.py`: those differ only in which
//! projections carry biases (the layout holds exactly the checkpoint's tensors, and
//! `linear` uses a bias when the block has one) and in which layers see a sliding window
//! (the layer's mask in `LayerCtx`). Mixtral and Qwen2-MoE are the same layer with a sparse
//! mixture-of-experts MLP (`moe.rs`) in place of the dense one.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, linear, merge_heads, mlp, rms_norm, split_heads};
use super::{BlockWeights, LayerCtx};

// One decoder layer: `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`.

/// `h = x + attn(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, w, &attn_in_bth, lc)
}

/// `out = h + mlp(norm2(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let mlp_in_bth = rms_norm(
        h_bth,
        w.get("post_attention_layernorm.weight"),
        spec.rms_norm_eps,
    );
    h_bth + mlp(w, spec, &mlp_in_bth, lc)
}

/// Causal self-attention with RoPE: (B, T, H) -> (B, T, H).
pub(super) fn attention(
    spec: &ModelSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
    lc: &LayerCtx,
) -> Tensor {
    let (n, k, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let x_bth = &lc.rope.input(x_bth);
    let q_bntd = split_heads(&linear(x_bth, w, "self_attn.q_proj"), n, d);
    let k_bktd = split_heads(&linear(x_bth, w, "self_attn.k_proj"), k, d);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}
