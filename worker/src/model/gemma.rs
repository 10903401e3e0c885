//! Gemma 2 and Gemma 3 text, as transformers' `modeling_gemma2.py` and `modeling_gemma3.py`
//! compute them: every norm is `(1 + w)`-scaled and computed in f32; the attention and the
//! MLP are each wrapped in a pre- and a post-norm; queries are scaled by
//! `query_pre_attn_scalar^-1/2`; sliding-window and global layers alternate. Gemma 2
//! soft-caps attention scores (the explicit attention path in `common::attend`); Gemma 3
//! instead normalizes each query and key head and gives its sliding layers their own RoPE
//! base (`LayerCtx::rope`). The scaled embedding and the soft-capped logits live in
//! `common::{embed, chunk_loss_sum}`, driven by the spec.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim, M selected tokens. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, gated_mlp, linear, merge_heads, rms_norm_plus_one, split_heads};
use super::{BlockWeights, LayerCtx};

// One decoder layer:
// `h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))`.

/// `h = x + post_attn_norm(attn(input_norm(x)))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let norm = |x: &Tensor, name: &str| rms_norm_plus_one(x, w.get(name), spec.rms_norm_eps);
    let attn_bth = attention(spec, w, &norm(x_bth, "input_layernorm.weight"), lc);
    x_bth + norm(&attn_bth, "post_attention_layernorm.weight")
}

/// `out = h + post_ff_norm(mlp(pre_ff_norm(h)))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    let norm = |x: &Tensor, name: &str| rms_norm_plus_one(x, w.get(name), spec.rms_norm_eps);
    let mlp_bth = gated_mlp(w, spec, &norm(h_bth, "pre_feedforward_layernorm.weight"));
    h_bth + norm(&mlp_bth, "post_feedforward_layernorm.weight")
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d, eps) = (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.rms_norm_eps,
    );
    let x_bth = &lc.rope.input(x_bth);
    let mut q_bntd = split_heads(&linear(x_bth, w, "self_attn.q_proj"), n, d);
    let mut k_bktd = split_heads(&linear(x_bth, w, "self_attn.k_proj"), k, d);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    if spec.qk_norm {
        q_bntd = rms_norm_plus_one(&q_bntd, w.get("self_attn.q_norm.weight"), eps);
        k_bktd = rms_norm_plus_one(&k_bktd, w.get("self_attn.k_norm.weight"), eps);
    }
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}

/// Final norm of selected hidden states (M, H) -> (M, H).
pub fn final_norm(spec: &ModelSpec, head: &BlockWeights, h_mh: &Tensor) -> Tensor {
    rms_norm_plus_one(h_mh, head.get("model.norm.weight"), spec.rms_norm_eps)
}
