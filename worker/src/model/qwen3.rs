//! Qwen3, as transformers' `modeling_qwen3.py` computes it: Llama with an RMSNorm over each
//! query and key head (`self_attn.q_norm`, `self_attn.k_norm`, weights of size D) before
//! the rotary embedding, and optional sliding-window layers. GLM-4.5
//! (`modeling_glm4_moe.py`) is the same layer with the head norms optional
//! (`use_qk_norm`), RoPE on half of each head, and its MoE MLP (`moe.rs`) after
//! `first_k_dense_replace` dense layers.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, linear, merge_heads, rms_norm, split_heads};
use super::{BlockWeights, LayerCtx};

// One decoder layer: `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`, the MLP half
// being Llama's (`llama::mlp_half`).

/// `h = x + attn(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, w, &attn_in_bth, lc)
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d, eps) = (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.rms_norm_eps,
    );
    let x_bth = &lc.rope.input(x_bth);
    // The per-head norm acts on the last dim: it runs before the transpose, on the
    // projection's contiguous output.
    let heads = |proj: &str, norm: &str, heads: usize| {
        let y_btf = linear(x_bth, w, proj);
        match spec.qk_norm {
            true => {
                let y_btnd = y_btf.view([y_btf.size()[0], y_btf.size()[1], heads as i64, d as i64]);
                rms_norm(&y_btnd, w.get(norm), eps).transpose(1, 2)
            }
            false => split_heads(&y_btf, heads, d),
        }
    };
    let q_bntd = heads("self_attn.q_proj", "self_attn.q_norm.weight", n);
    let k_bktd = heads("self_attn.k_proj", "self_attn.k_norm.weight", k);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}
