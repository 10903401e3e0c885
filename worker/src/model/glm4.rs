//! GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414), as transformers' `modeling_glm4.py` computes it:
//! Llama's attention (q/k/v biases, RoPE on the first half of each head with adjacent dims
//! paired, `LayerCtx::rope`) and a fused `gate_up_proj` MLP, each sublayer wrapped in a
//! norm before and one after (`post_self_attn_layernorm`, `post_mlp_layernorm`).
//!
//! Shapes: B batch rows, T sequence length, H hidden size. Suffixes name a tensor's shape.

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{fused_gated_mlp, rms_norm};
use super::{BlockWeights, LayerCtx, llama};

// One decoder layer:
// `h = x + post_attn_norm(attn(input_norm(x))); out = h + post_mlp_norm(mlp(post_attention_norm(h)))`.

/// `h = x + post_attn_norm(attn(input_norm(x)))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let norm = |x: &Tensor, name: &str| rms_norm(x, w.get(name), spec.rms_norm_eps);
    let attn_bth = llama::attention(spec, w, &norm(x_bth, "input_layernorm.weight"), lc);
    x_bth + norm(&attn_bth, "post_self_attn_layernorm.weight")
}

/// `out = h + post_mlp_norm(mlp(post_attention_norm(h)))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    let norm = |x: &Tensor, name: &str| rms_norm(x, w.get(name), spec.rms_norm_eps);
    let mlp_in_bth = norm(h_bth, "post_attention_layernorm.weight");
    let mlp_bth = fused_gated_mlp(w, spec, &mlp_in_bth, "mlp");
    h_bth + norm(&mlp_bth, "post_mlp_layernorm.weight")
}
