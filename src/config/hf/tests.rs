//! Unit tests of `ModelSpec::from_hf`, one per family's distinctive options.

use super::*;

fn spec(json: &str) -> Result<ModelSpec> {
    let hf: HfConfig = serde_json::from_str(json).unwrap();
    ModelSpec::from_hf(&hf, Path::new("config.json"))
}

/// A tiny config of `model_type` with `extra` keys merged in.
fn tiny(model_type: &str, extra: &str) -> Result<ModelSpec> {
    let sep = if extra.is_empty() { "" } else { "," };
    spec(&format!(
        r#"{{"model_type":"{model_type}","vocab_size":67,"hidden_size":48,
        "intermediate_size":88,"num_hidden_layers":4,"num_attention_heads":6,
        "num_key_value_heads":2{sep}{extra}}}"#
    ))
}

use AttentionKind::{Full, Sliding};

#[test]
fn reads_transformers5_rope_parameters() {
    let s = tiny(
        "llama",
        r#""rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}"#,
    )
    .unwrap();
    assert_eq!(s.head_dim, 8);
    assert_eq!(s.family, Family::Llama);
    assert_eq!(s.rope.theta, 500000.0);
    assert_eq!(s.rope.scaling, RopeScaling::Default);
    assert!(!s.tie_word_embeddings && !s.qkv_bias && !s.o_bias);
    assert_eq!(s.layer_types, vec![Full; 4]);
    assert_eq!(s.embed_padding_idx, None);
    assert_eq!(s.attn_scale, 8f64.powf(-0.5));
    assert_eq!(
        (s.attn_softcap, s.final_softcap, s.embed_scale),
        (None, None, None)
    );
}

#[test]
fn unsupported_type_lists_supported() {
    let e = spec(r#"{"model_type":"bert"}"#).unwrap_err().to_string();
    assert!(
        e.contains("unsupported model_type `bert`")
            && e.contains("llama")
            && e.contains("gemma3_text")
            && e.contains("phi3"),
        "{e}"
    );
}

#[test]
fn missing_field_is_named() {
    let e = spec(r#"{"model_type":"llama","vocab_size":5}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden_size"), "{e}");
}

#[test]
fn llama_rope_scalings_old_and_new_forms() {
    // transformers 4: rope_theta beside rope_scaling with `type`.
    let s = tiny(
        "llama",
        r#""rope_theta":20000.0,"rope_scaling":{"type":"linear","factor":2.0}"#,
    )
    .unwrap();
    assert_eq!(s.rope.theta, 20000.0);
    assert_eq!(s.rope.scaling, RopeScaling::Linear { factor: 2.0 });

    let s = tiny(
        "llama",
        r#""max_position_embeddings":64,"rope_parameters":{"rope_type":"dynamic","factor":3.0}"#,
    )
    .unwrap();
    assert_eq!(
        s.rope.scaling,
        RopeScaling::Dynamic {
            factor: 3.0,
            max_position_embeddings: 64
        }
    );

    let s = tiny(
        "llama",
        r#""rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_theta":500000.0}"#,
    )
    .unwrap();
    assert!(matches!(
        s.rope.scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 8192,
            ..
        }
    ));

    // YaRN: the attention factor is derived from `factor` when absent.
    let s = tiny(
        "llama",
        r#""max_position_embeddings":4096,"rope_parameters":{"rope_type":"yarn","factor":4.0,
        "original_max_position_embeddings":1024}"#,
    )
    .unwrap();
    let RopeScaling::Yarn {
        attention_factor,
        beta_fast,
        beta_slow,
        truncate,
        ..
    } = s.rope.scaling
    else {
        panic!("{:?}", s.rope)
    };
    assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, true));

    let e = tiny(
        "llama",
        r#""rope_scaling":{"rope_type":"llama3","factor":8.0}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("low_freq_factor"), "{e}");
    let e = tiny("llama", r#""rope_scaling":{"rope_type":"ntk-by-parts"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ntk-by-parts") && e.contains("yarn"), "{e}");
}

#[test]
fn mistral_slides_every_layer_unless_null() {
    let s = tiny("mistral", r#""sliding_window":5"#).unwrap();
    assert_eq!(s.sliding_window, Some(5));
    assert_eq!(s.layer_types, vec![Sliding; 4]);
    // Absent: MistralConfig's default window.
    assert_eq!(tiny("mistral", "").unwrap().sliding_window, Some(4096));
    let s = tiny("mistral", r#""sliding_window":null"#).unwrap();
    assert_eq!((s.sliding_window, s.layer_types[0]), (None, Full));
    assert!(
        !tiny("mistral", r#""attention_bias":true"#)
            .unwrap()
            .qkv_bias
    );
}

#[test]
fn qwen2_has_qkv_bias_and_upper_sliding_layers() {
    let s = tiny("qwen2", r#""sliding_window":7"#).unwrap();
    assert!(s.qkv_bias && !s.o_bias && !s.mlp_bias);
    assert_eq!((s.sliding_window, s.layer_types[3]), (None, Full));
    let s = tiny(
        "qwen2",
        r#""use_sliding_window":true,"sliding_window":7,"max_window_layers":2"#,
    )
    .unwrap();
    assert_eq!(s.layer_types, vec![Full, Full, Sliding, Sliding]);
    assert_eq!(s.sliding_window, Some(7));
    // transformers 5 writes layer_types; they win.
    let s = tiny(
        "qwen2",
        r#""use_sliding_window":true,"sliding_window":7,"layer_types":
        ["sliding_attention","full_attention","full_attention","full_attention"]"#,
    )
    .unwrap();
    assert_eq!(s.layer_types, vec![Sliding, Full, Full, Full]);
    let e = tiny("qwen2", r#""layer_types":["full_attention"]"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer_types") && e.contains("4 layers"), "{e}");
}

#[test]
fn qwen3_has_qk_norm_and_explicit_head_dim() {
    let s = tiny("qwen3", r#""head_dim":10,"attention_bias":true"#).unwrap();
    assert_eq!(s.family, Family::Qwen3);
    assert!(s.qk_norm && s.qkv_bias && s.o_bias);
    assert_eq!(s.head_dim, 10);
    assert_eq!(s.attn_scale, 10f64.powf(-0.5));
}

#[test]
fn gemma2_defaults_softcaps_alternation_and_scales() {
    let s = tiny(
        "gemma2",
        r#""head_dim":10,"query_pre_attn_scalar":12,"sliding_window":5,"pad_token_id":0"#,
    )
    .unwrap();
    assert_eq!(s.family, Family::Gemma);
    assert_eq!(s.hidden_act, Activation::GeluTanh);
    assert!(s.tie_word_embeddings && !s.qk_norm);
    assert_eq!(s.layer_types, vec![Sliding, Full, Sliding, Full]);
    assert_eq!(s.attn_softcap, Some(50.0));
    assert_eq!(s.final_softcap, Some(30.0));
    assert_eq!(s.attn_scale, 12f64.powf(-0.5));
    assert_eq!(s.embed_scale, Some(48f64.sqrt()));
    assert_eq!(s.embed_padding_idx, Some(0));
    assert_eq!(s.rope_local, None);
    let s = tiny(
        "gemma2",
        r#""attn_logit_softcapping":null,"final_logit_softcapping":null"#,
    )
    .unwrap();
    assert_eq!((s.attn_softcap, s.final_softcap), (None, None));
}

#[test]
fn gemma3_local_rope_both_forms() {
    // transformers 4: rope_theta / rope_local_base_freq / rope_scaling for global.
    let s = tiny(
        "gemma3_text",
        r#""sliding_window_pattern":2,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
        "rope_scaling":{"rope_type":"linear","factor":8.0},"attn_logit_softcapping":50.0"#,
    )
    .unwrap();
    assert!(s.qk_norm && s.attn_softcap.is_none() && s.final_softcap.is_none());
    assert_eq!(s.layer_types, vec![Sliding, Full, Sliding, Full]);
    assert_eq!(s.rope.theta, 1e6);
    assert_eq!(s.rope.scaling, RopeScaling::Linear { factor: 8.0 });
    let local = s.rope_local.unwrap();
    assert_eq!((local.theta, local.scaling), (1e4, RopeScaling::Default));

    // transformers 5: one dict per layer type.
    let s = tiny(
        "gemma3_text",
        r#""layer_types":["sliding_attention","sliding_attention","sliding_attention","full_attention"],
        "rope_parameters":{"full_attention":{"rope_type":"default","rope_theta":50000.0},
        "sliding_attention":{"rope_type":"default","rope_theta":700.0}}"#,
    )
    .unwrap();
    assert_eq!(s.rope.theta, 50000.0);
    assert_eq!(s.rope_local.unwrap().theta, 700.0);
    assert_eq!(s.layer_types[3], Full);
    // Defaults: 1e6 global, 1e4 local, one global layer in six.
    let s = tiny("gemma3_text", "").unwrap();
    assert_eq!(s.rope.theta, 1e6);
    assert_eq!(s.layer_types, vec![Sliding; 4]);
    let e = tiny("gemma3_text", r#""use_bidirectional_attention":true"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("use_bidirectional_attention"), "{e}");
}

#[test]
fn phi3_longrope_partial_rotary_and_window() {
    let factors = "[1.0,1.5,2.0]";
    let s = tiny(
        "phi3",
        &format!(
            r#""max_position_embeddings":64,"original_max_position_embeddings":16,
            "sliding_window":5,"partial_rotary_factor":0.75,
            "rope_scaling":{{"type":"su","short_factor":{factors},"long_factor":{factors}}}"#
        ),
    )
    .unwrap();
    assert_eq!(s.family, Family::Phi3);
    assert_eq!((s.head_dim, s.rope.rotary_dim), (8, 6));
    assert_eq!(s.rms_norm_eps, 1e-5);
    assert_eq!(s.layer_types, vec![Sliding; 4]);
    let RopeScaling::LongRope {
        attention_factor,
        original_max_position_embeddings,
        ..
    } = s.rope.scaling
    else {
        panic!("{:?}", s.rope)
    };
    assert_eq!(original_max_position_embeddings, 16);
    assert!((attention_factor - (1.0 + 4f64.ln() / 16f64.ln()).sqrt()).abs() < 1e-12);
    let e = tiny(
        "phi3",
        r#""rope_scaling":{"type":"longrope","short_factor":[1],"long_factor":[1]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("short_factor") && e.contains("expected"), "{e}");
    let e = tiny("llama", r#""partial_rotary_factor":0.5"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("only supported for phi3"), "{e}");
}

#[test]
fn dropout_and_bad_pad_are_rejected() {
    let e = tiny("phi3", r#""resid_pdrop":0.1"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("resid_pdrop"), "{e}");
    let e = tiny("phi3", r#""pad_token_id":32000"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pad_token_id"), "{e}");
    assert_eq!(
        tiny("llama", r#""pad_token_id":-1"#)
            .unwrap()
            .embed_padding_idx,
        Some(66)
    );
}

#[test]
fn mixtral_routes_over_local_experts_and_renormalizes() {
    let s = tiny(
        "mixtral",
        r#""num_local_experts":5,"num_experts_per_tok":2,"sliding_window":7,"norm_topk_prob":false"#,
    )
    .unwrap();
    let m = s.moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.expert_intermediate_size),
        (5, 2, 88)
    );
    assert_eq!(m.names, ExpertNames::Mixtral);
    // Mixtral renormalizes whatever norm_topk_prob says, and keeps f32 weights.
    assert_eq!(m.router, Router::SoftmaxTopK { renormalize: true });
    assert!(!m.weights_in_compute_dtype && !m.router_aux_loss);
    assert_eq!(m.sparse_layers, vec![true; 4]);
    assert_eq!((s.sliding_window, s.layer_types[0]), (Some(7), Sliding));
    assert_eq!(
        (s.family, s.qkv_bias, s.rms_norm_eps),
        (Family::Llama, false, 1e-5)
    );
    let e = tiny("mixtral", r#""num_experts_per_tok":9"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("num_experts_per_tok") && e.contains("1..=8"),
        "{e}"
    );
    let e = tiny("mixtral", r#""router_jitter_noise":0.1"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("router_jitter_noise"), "{e}");
}

#[test]
fn qwen_moe_sparse_steps_dense_layers_shared_expert_and_aux() {
    let s = tiny(
        "qwen2_moe",
        r#""num_experts":6,"moe_intermediate_size":20,"shared_expert_intermediate_size":24,
        "mlp_only_layers":[1],"output_router_logits":true,"router_aux_loss_coef":0.5"#,
    )
    .unwrap();
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.sparse_layers, vec![true, false, true, true]);
    assert_eq!(m.shared_expert_intermediate_size, Some(24));
    assert_eq!(m.router, Router::SoftmaxTopK { renormalize: false });
    assert!(m.router_aux_loss && m.router_aux_loss_coef == 0.5);
    assert!(s.qkv_bias && !s.o_bias && s.is_sparse(0) && !s.is_sparse(1));

    // transformers writes Qwen3-MoE's expert count as num_local_experts.
    let s = tiny(
        "qwen3_moe",
        r#""num_local_experts":6,"num_experts_per_tok":2,"moe_intermediate_size":20,"decoder_sparse_step":2,
        "norm_topk_prob":true,"head_dim":10"#,
    )
    .unwrap();
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.num_experts, 6);
    assert_eq!(m.sparse_layers, vec![false, true, false, true]);
    assert_eq!(m.router, Router::SoftmaxTopK { renormalize: true });
    assert_eq!(
        (m.shared_expert_intermediate_size, s.family),
        (None, Family::Qwen3)
    );
    assert!(s.qk_norm);
    let e = tiny("qwen3_moe", r#""moe_intermediate_size":0"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("moe_intermediate_size"), "{e}");
}

#[test]
fn gpt_oss_sinks_biases_alternation_and_clamped_experts() {
    let s = tiny(
        "gpt_oss",
        r#""num_local_experts":4,"num_experts_per_tok":2,"head_dim":8,"sliding_window":5"#,
    )
    .unwrap();
    assert_eq!(s.family, Family::GptOss);
    assert!(s.attn_sinks && s.qkv_bias && s.o_bias);
    // No RoPE keys: GptOssConfig's YaRN default.
    assert_eq!(s.rope.theta, 150_000.0);
    assert!(
        matches!(s.rope.scaling, RopeScaling::Yarn { factor, original_max_position_embeddings: 4096, truncate: false, .. } if factor == 32.0),
        "{:?}",
        s.rope
    );
    assert_eq!(s.layer_types, vec![Sliding, Full, Sliding, Full]);
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.router, Router::TopKSoftmax);
    assert_eq!(m.names, ExpertNames::GptOssFused);
    assert_eq!(
        m.act,
        ExpertAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0
        }
    );
}

#[test]
fn qwen3_next_and_qwen3_5_hybrid_layers() {
    let s = tiny(
        "qwen3_next",
        r#""head_dim":8,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":20,"linear_num_key_heads":2,
        "linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":6"#,
    )
    .unwrap();
    assert_eq!(s.family, Family::Qwen3Next);
    // Absent layer_types: one full-attention layer in four; partial rotary 0.25 by default.
    let linear = AttentionKind::Linear;
    assert_eq!(s.layer_types, vec![linear, linear, linear, Full]);
    assert_eq!(s.rope.rotary_dim, 2);
    assert!(s.attn_output_gate && s.qk_norm && s.family.norm_adds_one());
    let la = s.linear_attn.as_ref().unwrap();
    assert!(la.fused_qkvz);
    assert_eq!((la.key_dim(), la.value_dim(), la.conv_dim()), (16, 24, 56));
    assert_eq!(
        s.moe.as_ref().unwrap().shared_expert_intermediate_size,
        Some(512)
    );
    assert_eq!(s.constant_init("input_layernorm.weight"), Some(0.0));
    assert_eq!(s.constant_init("linear_attn.norm.weight"), Some(1.0));
    assert_eq!(s.constant_init("linear_attn.dt_bias"), Some(1.0));
    assert_eq!(s.constant_init("linear_attn.A_log"), Some(0.0));
    assert_eq!(s.constant_init("linear_attn.in_proj_ba.weight"), None);

    let s = tiny(
        "qwen3_5_text",
        r#""head_dim":8,"layer_types":["linear_attention","full_attention","linear_attention",
        "full_attention"],"rope_parameters":{"rope_type":"default","rope_theta":10000.0,
        "partial_rotary_factor":0.5,"mrope_section":[1,1,0],"mrope_interleaved":true}"#,
    )
    .unwrap();
    assert!(s.moe.is_none() && !s.linear_attn.as_ref().unwrap().fused_qkvz);
    assert_eq!((s.layer_types[1], s.rope.rotary_dim), (Full, 4));
    let s = tiny(
        "qwen3_5_moe_text",
        r#""num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":false,"mlp_only_layers":[1]"#,
    )
    .unwrap();
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.router, Router::SoftmaxTopK { renormalize: true });
    assert_eq!(m.sparse_layers, vec![true; 4]);
    assert_eq!(m.shared_expert_intermediate_size, Some(512));
    // Qwen3_5MoeTextConfig has no dense MLP, so no `intermediate_size` (Qwen3.5-35B-A3B).
    let s = spec(
        r#"{"model_type":"qwen3_5_moe_text","vocab_size":67,"hidden_size":48,
        "num_hidden_layers":4,"num_attention_heads":6,"num_key_value_heads":2}"#,
    )
    .unwrap();
    assert_eq!(s.intermediate_size, 0);
    let e = tiny(
        "qwen3_next",
        r#""linear_num_key_heads":3,"linear_num_value_heads":4"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("linear_num_value_heads"), "{e}");
    let e = tiny(
        "qwen3_next",
        r#""layer_types":["linear_attention","x","full_attention","full_attention"]"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`x`"), "{e}");
}
