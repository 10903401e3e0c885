//! Qwen3-Next and Qwen3.5 (text), as transformers' `modeling_qwen3_next.py` and
//! `modeling_qwen3_5.py` compute them: most layers mix tokens with Gated DeltaNet linear
//! attention (`gated_delta.rs`), every few a full-attention layer whose q_proj also yields a
//! sigmoid output gate, with per-head (1 + w) q/k norms and RoPE on the leading part of each
//! head only (partial rotary, `Rope::apply`). Every norm around the layer is (1 + w); the
//! MLP is sparse (Qwen3-Next: routed experts plus a gated shared expert, `moe.rs`) or dense.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N attention heads, K key/value
//! heads, D head dim. Suffixes name a tensor's shape (`x_bth`).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, linear, merge_heads, mlp, rms_norm_plus_one, split_heads};
use super::{BlockWeights, LayerCtx, gated_delta};

// One decoder layer: `h = x + mixer(norm1(x)); out = h + mlp(norm2(h))`, the mixer being
// Gated DeltaNet (`linear`) or gated full attention.

/// `h = x + mixer(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(
    spec: &ModelSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
    lc: &LayerCtx,
    linear_layer: bool,
) -> Tensor {
    let norm_w = w.get("input_layernorm.weight");
    let mix_in_bth = rms_norm_plus_one(x_bth, norm_w, spec.rms_norm_eps);
    let mixed_bth = if linear_layer {
        gated_delta::forward(spec, w, &mix_in_bth)
    } else {
        attention(spec, w, &mix_in_bth, lc)
    };
    x_bth + mixed_bth
}

/// A linear layer's attention half up to the delta rule: norm1, then the Gated DeltaNet's
/// `pre` (B, T, H) -> its rule's inputs and z.
pub fn linear_pre(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> gated_delta::Pre {
    let norm_w = w.get("input_layernorm.weight");
    let mix_in_bth = rms_norm_plus_one(x_bth, norm_w, spec.rms_norm_eps);
    gated_delta::pre(spec, w, &mix_in_bth)
}

/// A linear layer's attention half from the delta rule's output o (B, V, U, C, Dv) and z
/// (B, T, V, Dv): `h = x + post(o, z)`, (B, T, H).
pub fn linear_post(
    spec: &ModelSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
    o_bvucd: &Tensor,
    z_btvd: &Tensor,
) -> Tensor {
    x_bth + gated_delta::post(spec, w, o_bvucd, z_btvd)
}

/// `out = h + mlp(norm2(h))`: (B, T, H) -> (B, T, H).
pub fn mlp_half(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let norm_w = w.get("post_attention_layernorm.weight");
    h_bth
        + mlp(
            w,
            spec,
            &rms_norm_plus_one(h_bth, norm_w, spec.rms_norm_eps),
            lc,
        )
}

/// Full attention with an output gate: q_proj yields, per head, D query dims then D gate
/// dims; `o_proj(attn * sigmoid(gate))`.
fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let (n, k, d, eps) = (
        spec.num_heads as i64,
        spec.num_kv_heads,
        spec.head_dim as i64,
        spec.rms_norm_eps,
    );
    let x_bth = &lc.rope.input(x_bth);
    // Both q and the gate come from q_proj's output: a boundary there too, so that q's
    // gradient from the tape meets the gate's at it.
    let qg_btf = lc.rope.input(&linear(x_bth, w, "self_attn.q_proj"));
    let (b, t) = (qg_btf.size()[0], qg_btf.size()[1]);
    let qg_btn2d = qg_btf.view([b, t, n, 2 * d]);
    let q_btnd = qg_btn2d.narrow(-1, 0, d);
    let gate_btf = qg_btn2d.narrow(-1, d, d).reshape([b, t, n * d]);
    // The per-head norms run before the transpose (on the projections' (B, T, heads, D)).
    let q_bntd = rms_norm_plus_one(&q_btnd, w.get("self_attn.q_norm.weight"), eps).transpose(1, 2);
    let k_btkd = linear(x_bth, w, "self_attn.k_proj").view([b, t, k as i64, d]);
    let k_bktd = rms_norm_plus_one(&k_btkd, w.get("self_attn.k_norm.weight"), eps).transpose(1, 2);
    let v_bktd = split_heads(&linear(x_bth, w, "self_attn.v_proj"), k, d as usize);
    let (q_bntd, k_bktd) = (lc.rope.apply_taped(&q_bntd), lc.rope.apply_taped(&k_bktd));
    let o_bntd = attend(spec, &q_bntd, &k_bktd, &v_bktd, lc);
    let o_btf = merge_heads(&o_bntd) * gate_btf.sigmoid();
    linear(&o_btf, w, "self_attn.o_proj")
}
