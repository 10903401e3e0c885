//! DeepSeek-V3 (and Kimi-K2-shaped models), as transformers' `modeling_deepseek_v3.py`
//! computes it: Llama's layer with multi-head latent attention and, after the first
//! `first_k_dense_replace` dense layers, a mixture of experts with group-limited sigmoid
//! routing and shared experts (`moe.rs`).
//!
//! Multi-head latent attention: queries come through a low-rank bottleneck
//! (`q_a_proj`, `q_a_layernorm`, `q_b_proj`; or one `q_proj`), keys and values from one
//! compressed latent (`kv_a_proj_with_mqa` yields the latent and a rotary key part shared
//! by every head; `kv_a_layernorm`, then `kv_b_proj` expands the latent into each head's
//! non-rotary key and its value). Query and key heads are Dn + Dr wide (no-RoPE part, then
//! the RoPE part), value heads Dv. The bottleneck norms use eps 1e-6 whatever
//! `rms_norm_eps` says, as the modeling code builds them.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N heads, Dn / Dr / Dv the
//! non-rotary, rotary and value head dims, L the key/value latent rank, Q the query rank.

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::common::{attend, linear, merge_heads, rms_norm};
use super::{BlockWeights, LayerCtx};

/// eps of `q_a_layernorm` and `kv_a_layernorm` (DeepseekV3RMSNorm's default).
const LATENT_NORM_EPS: f64 = 1e-6;

// One decoder layer: `h = x + mla(norm1(x)); out = h + mlp(norm2(h))`, the MLP half being
// Llama's (`llama::mlp_half`; dense or the mixture of experts).

/// `h = x + mla(norm1(x))`: (B, T, H) -> (B, T, H).
pub fn attention_half(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let attn_in_bth = rms_norm(x_bth, w.get("input_layernorm.weight"), spec.rms_norm_eps);
    x_bth + attention(spec, w, &attn_in_bth, lc)
}

fn attention(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let m = spec.mla.as_ref().expect("deepseek_v3 has an MLA spec");
    let (b, t) = (x_bth.size()[0], x_bth.size()[1]);
    let n = spec.num_heads as i64;
    let (dn, dr, dv) = (
        m.qk_nope_head_dim as i64,
        m.qk_rope_head_dim as i64,
        m.v_head_dim as i64,
    );
    let norm = |x: &Tensor, name: &str| rms_norm(x, w.get(name), LATENT_NORM_EPS);
    let q_btf = match m.q_lora_rank {
        Some(_) => {
            let q_btq = norm(
                &linear(x_bth, w, "self_attn.q_a_proj"),
                "self_attn.q_a_layernorm.weight",
            );
            linear(&q_btq, w, "self_attn.q_b_proj")
        }
        None => linear(x_bth, w, "self_attn.q_proj"),
    };
    let q_bntd = q_btf.view([b, t, n, dn + dr]).transpose(1, 2);
    let (q_pass_bntn, q_rot_bntr) = (q_bntd.narrow(-1, 0, dn), q_bntd.narrow(-1, dn, dr));
    let kv_a_btf = linear(x_bth, w, "self_attn.kv_a_proj_with_mqa");
    let l = m.kv_lora_rank as i64;
    let latent_btl = norm(
        &kv_a_btf.narrow(-1, 0, l),
        "self_attn.kv_a_layernorm.weight",
    );
    let k_rot_b1tr = kv_a_btf.narrow(-1, l, dr).view([b, 1, t, dr]);
    let (q_rot_bntr, k_rot_b1tr) = (lc.rope.apply(&q_rot_bntr), lc.rope.apply(&k_rot_b1tr));
    let q_bntd = Tensor::cat(&[q_pass_bntn, q_rot_bntr], -1);
    let kv_bntf = linear(&latent_btl, w, "self_attn.kv_b_proj")
        .view([b, t, n, dn + dv])
        .transpose(1, 2);
    let (k_pass_bntn, v_bntv) = (kv_bntf.narrow(-1, 0, dn), kv_bntf.narrow(-1, dn, dv));
    let k_bntd = Tensor::cat(&[k_pass_bntn, k_rot_b1tr.expand([b, n, t, dr], false)], -1);
    let o_bntv = attend(spec, &q_bntd, &k_bntd, &v_bntv, lc);
    linear(&merge_heads(&o_bntv), w, "self_attn.o_proj")
}
