//! Phi-3, as transformers' `modeling_phi3.py` computes it: Llama with the q/k/v projections
//! fused into one `qkv_proj` (rows: N*D queries, then K*D keys, then K*D values) and gate
//! and up fused into `gate_up_proj` (rows: I gate, then I up), RoPE on the first R dims of
//! each head only (partial rotary, `Rope::apply`), and an optional sliding window on every
//! layer.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, I intermediate size, N attention
//! heads, K key/value heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, fused_gated_mlp, linear, merge_heads, rms_norm, split_heads};
use super::{BlockWeights, LayerCtx};

// One decoder layer: `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`.

/// `h = x + attn(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, w, &attn_in_bth, lc)
}

/// `out = h + mlp(norm2(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    let mlp_in_bth = rms_norm(
        h_bth,
        w.get("post_attention_layernorm.weight"),
        spec.rms_norm_eps,
    );
    h_bth + fused_gated_mlp(w, spec, &mlp_in_bth, "mlp")
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    // q, k (rotated on the tape) and v share the fused projection's output: the tape
    // boundary goes there.
    let qkv_btf = lc.rope.input(&linear(x_bth, w, "self_attn.qkv_proj"));
    let (q_len, kv_len) = ((n * d) as i64, (k * d) as i64);
    let q_bntd = split_heads(&qkv_btf.narrow(-1, 0, q_len), n, d);
    let k_bktd = split_heads(&qkv_btf.narrow(-1, q_len, kv_len), k, d);
    let v_bktd = split_heads(&qkv_btf.narrow(-1, q_len + kv_len, kv_len), k, d);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}
