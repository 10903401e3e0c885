//! The tensors of each family's decoder layers, named and shaped as in its checkpoints.

use super::NamedShape;
use crate::config::hf::{AttentionKind, ExpertNames, Family, MlaSpec, ModelSpec};

/// A tensor list being built: `push(name, shape)`.
type Push<'a> = dyn FnMut(&str, Vec<usize>) + 'a;

/// `{name}.weight` (out, in) and, with `bias`, `{name}.bias` (out).
fn linear(push: &mut Push, name: &str, out: usize, inp: usize, bias: bool) {
    push(&format!("{name}.weight"), vec![out, inp]);
    if bias {
        push(&format!("{name}.bias"), vec![out]);
    }
}

/// The tensors of decoder layer `layer`, in the order of the family's modeling code, named
/// as in its checkpoints (without the `model.layers.N.` prefix).
pub(super) fn layer_tensors(spec: &ModelSpec, layer: usize) -> Vec<NamedShape> {
    let (h, d) = (spec.hidden_size, spec.head_dim);
    let (q, kv) = (spec.num_heads * d, spec.num_kv_heads * d);
    let mut t: Vec<NamedShape> = Vec::new();
    let push = &mut |name: &str, shape: Vec<usize>| t.push((name.to_string(), shape));
    // OLMo 2 normalizes after attention and MLP only.
    if spec.family != Family::Olmo2 {
        push("input_layernorm.weight", vec![h]);
    }
    if spec.layer_types[layer] == AttentionKind::Linear {
        linear_attn_tensors(spec, push);
    } else if let Some(m) = &spec.mla {
        mla_tensors(spec, m, push);
    } else if spec.family == Family::Phi3 {
        linear(push, "self_attn.qkv_proj", q + 2 * kv, h, false);
        linear(push, "self_attn.o_proj", h, q, false);
    } else {
        // With an output gate, q_proj yields [query; gate] per head.
        let q_out = if spec.attn_output_gate { 2 * q } else { q };
        linear(push, "self_attn.q_proj", q_out, h, spec.qkv_bias);
        linear(push, "self_attn.k_proj", kv, h, spec.qkv_bias);
        linear(push, "self_attn.v_proj", kv, h, spec.qkv_bias);
        linear(push, "self_attn.o_proj", h, q, spec.o_bias);
        if spec.attn_sinks {
            push("self_attn.sinks", vec![spec.num_heads]);
        }
    }
    if spec.qk_norm && spec.layer_types[layer] != AttentionKind::Linear {
        // OLMo 2 normalizes all heads at once, the others each head.
        let (qn, kn) = match spec.family {
            Family::Olmo2 => (q, kv),
            _ => (d, d),
        };
        push("self_attn.q_norm.weight", vec![qn]);
        push("self_attn.k_norm.weight", vec![kn]);
    }
    if spec.family == Family::Glm4 {
        push("post_self_attn_layernorm.weight", vec![h]);
    }
    push("post_attention_layernorm.weight", vec![h]);
    match spec.family {
        Family::Gemma => {
            push("pre_feedforward_layernorm.weight", vec![h]);
            push("post_feedforward_layernorm.weight", vec![h]);
        }
        Family::Olmo2 => push("post_feedforward_layernorm.weight", vec![h]),
        Family::Glm4 => push("post_mlp_layernorm.weight", vec![h]),
        _ => {}
    }
    if spec.is_sparse(layer) {
        moe_tensors(spec, push);
    } else {
        dense_mlp_tensors(spec, push);
    }
    t
}

/// The dense MLP: fused `gate_up_proj` (Phi-3, GLM-4) or gate, up and down projections.
fn dense_mlp_tensors(spec: &ModelSpec, push: &mut Push) {
    let (h, i, mlp) = (spec.hidden_size, spec.intermediate_size, spec.mlp_name());
    if matches!(spec.family, Family::Phi3 | Family::Glm4) {
        linear(push, &format!("{mlp}.gate_up_proj"), 2 * i, h, false);
    } else {
        linear(push, &format!("{mlp}.gate_proj"), i, h, spec.mlp_bias);
        linear(push, &format!("{mlp}.up_proj"), i, h, spec.mlp_bias);
    }
    linear(push, &format!("{mlp}.down_proj"), h, i, spec.mlp_bias);
}

/// DeepSeek-V3's multi-head latent attention.
fn mla_tensors(spec: &ModelSpec, m: &MlaSpec, push: &mut Push) {
    let (h, n) = (spec.hidden_size, spec.num_heads);
    match m.q_lora_rank {
        Some(r) => {
            linear(push, "self_attn.q_a_proj", r, h, spec.qkv_bias);
            push("self_attn.q_a_layernorm.weight", vec![r]);
            linear(push, "self_attn.q_b_proj", n * m.qk_head_dim(), r, false);
        }
        None => linear(push, "self_attn.q_proj", n * m.qk_head_dim(), h, false),
    }
    let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
    linear(push, "self_attn.kv_a_proj_with_mqa", kv_a, h, spec.qkv_bias);
    push("self_attn.kv_a_layernorm.weight", vec![m.kv_lora_rank]);
    let kv_b = n * (m.qk_nope_head_dim + m.v_head_dim);
    linear(push, "self_attn.kv_b_proj", kv_b, m.kv_lora_rank, false);
    linear(push, "self_attn.o_proj", h, n * m.v_head_dim, spec.o_bias);
}

/// Gated DeltaNet (`linear_attn.*`), Qwen3-Next's fused or Qwen3.5's split projections.
fn linear_attn_tensors(spec: &ModelSpec, push: &mut Push) {
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (h, nv) = (spec.hidden_size, la.num_v_heads);
    let (kd, vd) = (la.key_dim(), la.value_dim());
    if la.fused_qkvz {
        push("linear_attn.in_proj_qkvz.weight", vec![2 * kd + 2 * vd, h]);
        push("linear_attn.in_proj_ba.weight", vec![2 * nv, h]);
    } else {
        push("linear_attn.in_proj_qkv.weight", vec![2 * kd + vd, h]);
        push("linear_attn.in_proj_z.weight", vec![vd, h]);
        push("linear_attn.in_proj_b.weight", vec![nv, h]);
        push("linear_attn.in_proj_a.weight", vec![nv, h]);
    }
    push(
        "linear_attn.conv1d.weight",
        vec![la.conv_dim(), 1, la.conv_kernel],
    );
    push("linear_attn.dt_bias", vec![nv]);
    push("linear_attn.A_log", vec![nv]);
    push("linear_attn.norm.weight", vec![la.v_head_dim]);
    push("linear_attn.out_proj.weight", vec![h, vd]);
}

/// A sparse MLP block: router, experts (one tensor set per expert, or GPT-OSS's fused 3-D
/// tensors), and the shared expert where the family has one.
fn moe_tensors(spec: &ModelSpec, push: &mut Push) {
    let m = spec.moe.as_ref().expect("sparse layers have a spec");
    let (h, e, i) = (spec.hidden_size, m.num_experts, m.expert_intermediate_size);
    match m.names {
        ExpertNames::Mixtral => {
            push("block_sparse_moe.gate.weight", vec![e, h]);
            for x in 0..e {
                let p = format!("block_sparse_moe.experts.{x}");
                push(&format!("{p}.w1.weight"), vec![i, h]);
                push(&format!("{p}.w2.weight"), vec![h, i]);
                push(&format!("{p}.w3.weight"), vec![i, h]);
            }
        }
        ExpertNames::Qwen => {
            push("mlp.gate.weight", vec![e, h]);
            for x in 0..e {
                let p = format!("mlp.experts.{x}");
                push(&format!("{p}.gate_proj.weight"), vec![i, h]);
                push(&format!("{p}.up_proj.weight"), vec![i, h]);
                push(&format!("{p}.down_proj.weight"), vec![h, i]);
            }
            if let Some(s) = m.shared_expert_intermediate_size {
                push("mlp.shared_expert.gate_proj.weight", vec![s, h]);
                push("mlp.shared_expert.up_proj.weight", vec![s, h]);
                push("mlp.shared_expert.down_proj.weight", vec![h, s]);
                push("mlp.shared_expert_gate.weight", vec![1, h]);
            }
        }
        ExpertNames::DeepSeek => {
            push("mlp.gate.weight", vec![e, h]);
            for x in 0..e {
                let p = format!("mlp.experts.{x}");
                push(&format!("{p}.gate_proj.weight"), vec![i, h]);
                push(&format!("{p}.up_proj.weight"), vec![i, h]);
                push(&format!("{p}.down_proj.weight"), vec![h, i]);
            }
            if let Some(s) = m.shared_expert_intermediate_size {
                push("mlp.shared_experts.gate_proj.weight", vec![s, h]);
                push("mlp.shared_experts.up_proj.weight", vec![s, h]);
                push("mlp.shared_experts.down_proj.weight", vec![h, s]);
            }
        }
        ExpertNames::Llama4Fused => {
            push("feed_forward.router.weight", vec![e, h]);
            push("feed_forward.experts.gate_up_proj", vec![e, h, 2 * i]);
            push("feed_forward.experts.down_proj", vec![e, i, h]);
            let s = m.shared_expert_intermediate_size.unwrap_or(i);
            push("feed_forward.shared_expert.gate_proj.weight", vec![s, h]);
            push("feed_forward.shared_expert.up_proj.weight", vec![s, h]);
            push("feed_forward.shared_expert.down_proj.weight", vec![h, s]);
        }
        ExpertNames::GptOssFused => {
            push("mlp.router.weight", vec![e, h]);
            push("mlp.router.bias", vec![e]);
            push("mlp.experts.gate_up_proj", vec![e, h, 2 * i]);
            push("mlp.experts.gate_up_proj_bias", vec![e, 2 * i]);
            push("mlp.experts.down_proj", vec![e, i, h]);
            push("mlp.experts.down_proj_bias", vec![e, h]);
        }
    }
}

/// (E - K) experts' parameters per sparse layer (see `Layout::unrouted_params`).
pub(super) fn unrouted_params(spec: &ModelSpec) -> usize {
    let Some(m) = &spec.moe else {
        return 0;
    };
    let (h, i) = (spec.hidden_size, m.expert_intermediate_size);
    let per_expert = match m.names {
        ExpertNames::Mixtral
        | ExpertNames::Qwen
        | ExpertNames::DeepSeek
        | ExpertNames::Llama4Fused => 3 * h * i,
        ExpertNames::GptOssFused => 3 * h * i + 2 * i + h,
    };
    let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
    sparse * (m.num_experts - m.top_k) * per_expert
}
