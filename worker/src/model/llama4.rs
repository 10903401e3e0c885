//! Llama 4 text (Scout, Maverick), as transformers' `modeling_llama4.py` computes it:
//! Llama's layer where most layers rotate queries and keys (adjacent dims paired, in f32),
//! attend within chunks of `attention_chunk_size` positions and L2-normalize queries and
//! keys after the rotation (`use_qk_norm`), while every few a NoPE layer attends over the
//! whole sequence without positions, its queries scaled by a temperature that grows with
//! the position (`attn_temperature_tuning`). The MLP (`feed_forward`) is dense or a mixture
//! of experts with a shared expert whose chosen experts' sigmoid scores scale their input
//! (`moe.rs`).
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::{Kind, Tensor};

use super::common::{attend, dense_mlp_named, linear, merge_heads, rms_norm, split_heads};
use super::{BlockWeights, LayerCtx, moe};

// One decoder layer: `h = x + attn(norm1(x)); out = h + feed_forward(norm2(h))`.

/// `h = x + attn(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    lc: &LayerCtx,
) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, layer, w, &attn_in_bth, lc)
}

/// `out = h + feed_forward(norm2(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let ff_in_bth = rms_norm(
        h_bth,
        w.get("post_attention_layernorm.weight"),
        spec.rms_norm_eps,
    );
    let ff_bth = match lc.sparse {
        true => moe::sparse_mlp(spec, w, &ff_in_bth, lc),
        false => dense_mlp_named(w, spec, &ff_in_bth, "feed_forward"),
    };
    h_bth + ff_bth
}

fn attention(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    lc: &LayerCtx,
) -> Tensor {
    let a = spec
        .llama4
        .as_ref()
        .expect("llama4_text has its attention spec");
    let (n, k, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let mut q_bntd = split_heads(&linear(x_bth, w, "self_attn.q_proj"), n, d);
    let mut k_bktd = split_heads(&linear(x_bth, w, "self_attn.k_proj"), k, d);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d);
    let kind = q_bntd.kind();
    if a.rope_layers[layer] {
        let rotate = |x: &Tensor| lc.rope.apply(&x.to_kind(Kind::Float)).to_kind(kind);
        (q_bntd, k_bktd) = (rotate(&q_bntd), rotate(&k_bktd));
        if a.qk_l2_norm {
            let l2 = |x: &Tensor| {
                let xf = x.to_kind(Kind::Float);
                let ms = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
                (xf * (ms + spec.rms_norm_eps).rsqrt()).to_kind(kind)
            };
            (q_bntd, k_bktd) = (l2(&q_bntd), l2(&k_bktd));
        }
    } else if let Some(temp_b1t1) = lc.temperature_b1t1 {
        q_bntd = (q_bntd * temp_b1t1).to_kind(kind);
    }
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    linear(&merge_heads(&o_bntd), w, "self_attn.o_proj")
}
