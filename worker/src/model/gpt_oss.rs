//! GPT-OSS, as transformers' `modeling_gpt_oss.py` computes it: Llama-shaped layers with
//! biases on every attention projection, a learned per-head "sink" logit that joins each
//! attention softmax (its probability is dropped, so rows may sum to less than 1),
//! sliding-window and full layers alternating, RMSNorm scaling in f32 before the cast, and
//! a mixture-of-experts MLP with a biased router and clamped-SwiGLU experts (`moe.rs`).
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{linear, merge_heads, repeat_kv, rms_norm_f32_scale as rms_norm, split_heads};
use super::{BlockWeights, LayerCtx, moe};
use crate::kernels;

// One decoder layer: `h = x + attn(norm1(x)); out = h + moe(norm2(h))`.

/// `h = x + attn(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, w, &attn_in_bth, lc)
}

/// `out = h + moe(norm2(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let mlp_in_bth = rms_norm(
        h_bth,
        w.get("post_attention_layernorm.weight"),
        spec.rms_norm_eps,
    );
    h_bth + moe::sparse_mlp(spec, w, &mlp_in_bth, lc)
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let x_bth = &lc.rope.input(x_bth);
    let q_bntd = split_heads(&linear(x_bth, w, "self_attn.q_proj"), n, d);
    let k_bktd = split_heads(&linear(x_bth, w, "self_attn.k_proj"), k, d);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let mask_tt = lc
        .mask_tt
        .expect("Context builds a mask for the sink attention");
    // Packed rows' masks are per row ((B, 1, T, T)): those keep the eager path.
    let o_bntd = match mask_tt.dim() == 2
        && kernels::sink_attention_enabled(q_bntd.kind(), d as i64, q_bntd.device())
    {
        true => kernels::sink_attention(
            &q_bntd,
            &k_bktd,
            &v_bktd,
            w.get("self_attn.sinks"),
            spec.attn_scale,
            lc.window,
        ),
        false => sink_attention(spec, w, &q_bntd, &k_bktd, &v_bktd, mask_tt),
    };
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}

/// transformers' eager attention with sinks (`kernels::sink_attention` computes the same
/// through FlashAttention): the masked scores of each row get one more
/// column, the head's sink logit; the row max is subtracted, the softmax taken in the
/// scores' dtype and the sink column dropped: (B, N, T, D) -> (B, N, T, D).
fn sink_attention(
    spec: &ModelSpec,
    w: &BlockWeights,
    q_bntd: &Tensor,
    k_bktd: &Tensor,
    v_bktd: &Tensor,
    mask_tt: &Tensor,
) -> Tensor {
    let rep = (spec.num_heads / spec.num_kv_heads) as i64;
    let k_bntd = repeat_kv(k_bktd, rep);
    let v_bntd = repeat_kv(v_bktd, rep);
    let scores_bntt = q_bntd.matmul(&k_bntd.transpose(2, 3)) * spec.attn_scale;
    let scores_bntt = scores_bntt.masked_fill(&mask_tt.logical_not(), f64::NEG_INFINITY);
    let s = scores_bntt.size();
    let sinks_bnt1 = w
        .get("self_attn.sinks")
        .reshape([1, -1, 1, 1])
        .expand([s[0], s[1], s[2], 1], false);
    let all_bntu = Tensor::cat(&[&scores_bntt, &sinks_bnt1.to_kind(scores_bntt.kind())], -1);
    let all_bntu = &all_bntu - all_bntu.amax(-1, true);
    let p_bntu = all_bntu.softmax(-1, all_bntu.kind());
    let p_bntt = p_bntu.narrow(-1, 0, s[3]).to_kind(v_bntd.kind());
    p_bntt.matmul(&v_bntd)
}
