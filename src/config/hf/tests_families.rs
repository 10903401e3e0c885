//! Unit tests of `ModelSpec::from_hf` for OLMo 2, GLM-4, GLM-4.5, DeepSeek-V3, Llama 4 and
//! the multimodal wrappers.

use super::*;

fn spec(json: &str) -> Result<ModelSpec> {
    let hf: HfConfig = serde_json::from_str(json).unwrap();
    ModelSpec::from_hf(&hf, Path::new("config.json"))
}

/// `base` with the keys of `extra` (a JSON object's inside) set over it.
fn merged(base: &str, extra: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&format!("{{{base}}}")).unwrap();
    let over: serde_json::Value = serde_json::from_str(&format!("{{{extra}}}")).unwrap();
    for (k, x) in over.as_object().unwrap() {
        v[k] = x.clone();
    }
    v.to_string()
}

const TEXT: &str = r#""vocab_size":67,"hidden_size":48,"intermediate_size":88,
    "num_hidden_layers":4,"num_attention_heads":6,"num_key_value_heads":2"#;

/// A tiny config of `model_type` with `extra` keys merged in.
fn tiny(model_type: &str, extra: &str) -> Result<ModelSpec> {
    spec(&merged(
        &format!(r#""model_type":"{model_type}",{TEXT}"#),
        extra,
    ))
}

#[test]
fn olmo2_and_glm4_dense_families() {
    let s = tiny("olmo2", r#""pad_token_id":1"#).unwrap();
    assert_eq!(s.family, Family::Olmo2);
    assert!(s.qk_norm && !s.qkv_bias && !s.rope_interleaved);
    assert_eq!(s.rms_norm_eps, 1e-5);
    assert_eq!(s.embed_padding_idx, Some(1));

    let s = tiny("glm4", r#""head_dim":12"#).unwrap();
    assert_eq!(s.family, Family::Glm4);
    // GLM-4's defaults: q/k/v biases, no o bias, RoPE interleaved on half of each head.
    assert!(s.qkv_bias && !s.o_bias && s.rope_interleaved && !s.qk_norm);
    assert_eq!(s.rope.rotary_dim, 6);
    assert_eq!(s.rms_norm_eps, 1.5625e-7);
    let s = tiny("glm4", r#""head_dim":12,"partial_rotary_factor":1.0"#).unwrap();
    assert_eq!(s.rope.rotary_dim, 12);
}

#[test]
fn glm4_moe_routes_by_groups_after_dense_layers() {
    let s = tiny(
        "glm4_moe",
        r#""head_dim":8,"n_routed_experts":8,"num_experts_per_tok":3,"n_group":4,
        "topk_group":2,"moe_intermediate_size":20,"n_shared_experts":2,
        "first_k_dense_replace":2,"routed_scaling_factor":1.8,"use_qk_norm":true"#,
    )
    .unwrap();
    // GLM-4.5's layer is Qwen3's; its RoPE the halves of half of each head.
    assert_eq!(s.family, Family::Qwen3);
    assert!(s.qk_norm && !s.rope_interleaved && !s.qkv_bias);
    assert_eq!(s.rope.rotary_dim, 4);
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.sparse_layers, [false, false, true, true]);
    assert_eq!(
        m.router,
        Router::SigmoidGroupTopK {
            n_group: 4,
            topk_group: 2,
            renormalize: true,
            scaling: 1.8
        }
    );
    assert_eq!(
        (m.names, m.shared_expert_intermediate_size),
        (ExpertNames::DeepSeek, Some(40))
    );
    assert!(!m.router_aux_loss);
    assert_eq!(s.mtp_layers, 1, "num_nextn_predict_layers defaults to 1");
    assert_eq!(
        s.layer_buffers(2),
        [("mlp.gate.e_score_correction_bias", vec![8])]
    );
    assert!(s.layer_buffers(1).is_empty(), "dense layers have no router");
    assert!(!tiny("glm4_moe", r#""head_dim":8"#).unwrap().qk_norm);

    for (extra, needle) in [
        (r#""n_routed_experts":6,"n_group":4"#, "n_group"),
        (
            r#""n_routed_experts":8,"n_group":4,"topk_group":1,"num_experts_per_tok":3"#,
            "topk_group",
        ),
    ] {
        let e = tiny("glm4_moe", extra).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn deepseek_v3_latent_attention_and_yarn_softmax_scale() {
    let base = r#""num_key_value_heads":6,"kv_lora_rank":16,
        "qk_rope_head_dim":4,"qk_nope_head_dim":6,"v_head_dim":5,"n_routed_experts":8,
        "num_experts_per_tok":2,"n_group":4,"topk_group":2,"moe_intermediate_size":20"#;
    let s = tiny("deepseek_v3", &format!(r#"{base},"q_lora_rank":24"#)).unwrap();
    assert_eq!(s.family, Family::DeepseekV3);
    let m = s.mla.as_ref().unwrap();
    assert_eq!((m.q_lora_rank, m.qk_head_dim()), (Some(24), 10));
    // The config sets head_dim to the rotary part; RoPE turns all of it, pairs interleaved.
    assert_eq!((s.head_dim, s.rope.rotary_dim), (4, 4));
    assert!(s.rope_interleaved);
    assert_eq!(s.attn_scale, 10f64.powf(-0.5));
    assert_eq!(
        s.moe.as_ref().unwrap().sparse_layers,
        [false, false, false, true],
        "first_k_dense_replace defaults to 3"
    );
    // DeepSeek's YaRN scales the softmax by mscale(factor, mscale_all_dim)^2 (x 1.874 at 40).
    let s = tiny(
        "deepseek_v3",
        &format!(
            r#"{base},"q_lora_rank":null,"rope_interleave":false,"rope_scaling":{{"type":"yarn",
            "factor":40,"mscale":1.0,"mscale_all_dim":1.0,"original_max_position_embeddings":4096,
            "beta_fast":32,"beta_slow":1}},"max_position_embeddings":163840"#
        ),
    )
    .unwrap();
    let mscale = 0.1 * 40f64.ln() + 1.0;
    assert!((s.attn_scale - 10f64.powf(-0.5) * mscale * mscale).abs() < 1e-12);
    assert_eq!(s.mla.as_ref().unwrap().q_lora_rank, None);
    assert!(!s.rope_interleaved);

    let e = tiny("deepseek_v3", r#""num_key_value_heads":2"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
}

#[test]
fn llama4_nope_chunked_layers_and_experts() {
    let s = tiny(
        "llama4_text",
        r#""head_dim":8,"intermediate_size_mlp":40,"num_local_experts":4,
        "num_experts_per_tok":2,"interleave_moe_layer_step":2,"attention_chunk_size":5"#,
    )
    .unwrap();
    assert_eq!(s.family, Family::Llama4);
    use AttentionKind::{Chunked, Full};
    // A NoPE layer every 4 (no_rope_layer_interval); RoPE layers attend in chunks.
    assert_eq!(s.layer_types, [Chunked, Chunked, Chunked, Full]);
    let a = s.llama4.as_ref().unwrap();
    assert_eq!(a.rope_layers, [true, true, true, false]);
    assert!(a.qk_l2_norm);
    assert_eq!(a.temperature, Some((8192.0, 0.1)));
    assert_eq!((s.attention_chunk, s.rope.theta), (Some(5), 500_000.0));
    assert_eq!(
        s.intermediate_size, 40,
        "dense layers use intermediate_size_mlp"
    );
    let m = s.moe.as_ref().unwrap();
    assert_eq!(m.sparse_layers, [false, true, false, true]);
    assert_eq!(
        (
            m.expert_intermediate_size,
            m.shared_expert_intermediate_size
        ),
        (88, Some(88))
    );
    assert_eq!(
        (m.router, m.names),
        (Router::TopKSigmoidInput, ExpertNames::Llama4Fused)
    );
    assert_eq!(s.mlp_name(), "feed_forward");

    let s = tiny(
        "llama4_text",
        r#""head_dim":8,"no_rope_layers":[0,1,1,1],"moe_layers":[0],
        "attn_temperature_tuning":false,"use_qk_norm":false"#,
    )
    .unwrap();
    assert_eq!(s.layer_types, [Full, Chunked, Chunked, Chunked]);
    assert_eq!(
        s.moe.as_ref().unwrap().sparse_layers,
        [true, false, false, false]
    );
    let a = s.llama4.as_ref().unwrap();
    assert!(a.temperature.is_none() && !a.qk_l2_norm);
    let e = tiny("llama4_text", r#""head_dim":8,"attention_chunk_size":null"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention_chunk_size"), "{e}");
}

#[test]
fn wrappers_resolve_to_their_text_model() {
    let wrap = |outer: &str, text: &str, top: &str| {
        spec(&format!(
            r#"{{"model_type":"{outer}","text_config":{{{text}{TEXT}}},"vision_config":{{}}{top}}}"#
        ))
    };
    // Gemma 3: the text type from the class, tied by the wrapper's default, legacy names.
    let s = wrap(
        "gemma3",
        r#""head_dim":8,"final_logit_softcapping":3.0,"#,
        "",
    )
    .unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.wrapper.as_deref()),
        ("gemma3_text", Some("gemma3"))
    );
    assert!(s.tie_word_embeddings && s.qk_norm);
    assert_eq!(s.names, TextNames::Legacy);
    assert_eq!(
        s.final_softcap, None,
        "the wrapper's head does not soft-cap"
    );
    // The wrapper's own flag wins over the text config's (Mistral 3, Qwen3.5).
    let s = wrap(
        "mistral3",
        r#""model_type":"mistral","tie_word_embeddings":true,"#,
        r#","tie_word_embeddings":false"#,
    )
    .unwrap();
    assert_eq!(s.model_type, "mistral");
    assert!(!s.tie_word_embeddings);
    assert!(wrap("mistral3", "", "").unwrap().tie_word_embeddings);
    let s = wrap("qwen3_5", r#""head_dim":8,"tie_word_embeddings":true,"#, "").unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.names),
        ("qwen3_5_text", TextNames::Current)
    );
    assert!(!s.tie_word_embeddings, "Qwen3_5Config unties by default");
    assert_eq!(
        wrap("qwen3_5_moe", r#""head_dim":8,"#, "")
            .unwrap()
            .model_type,
        "qwen3_5_moe_text"
    );
    // Llama 4's text model is a CausalLM of its own: its config ties.
    let s = wrap(
        "llama4",
        r#""head_dim":8,"tie_word_embeddings":true,"#,
        r#","tie_word_embeddings":false"#,
    )
    .unwrap();
    assert_eq!(s.model_type, "llama4_text");
    assert!(s.tie_word_embeddings);
    // LLaVA-NeXT: a llama by default (LlavaNextConfig's), untied, legacy names; the hub's
    // llava-v1.6-mistral wraps a mistral.
    let s = wrap("llava_next", "", "").unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.names, s.wrapper.as_deref()),
        ("llama", TextNames::Legacy, Some("llava_next"))
    );
    assert!(!s.tie_word_embeddings);
    let s = wrap("llava_next", r#""model_type":"mistral","#, "").unwrap();
    assert_eq!(s.model_type, "mistral");

    let e = spec(r#"{"model_type":"gemma3"}"#).unwrap_err().to_string();
    assert!(e.contains("text_config"), "{e}");
    let e = spec(r#"{"model_type":"gemma3","text_config":{"vocab_size":67}}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("text_config") && e.contains("hidden_size"),
        "{e}"
    );
    let e = wrap("mistral3", r#""model_type":"pixtral","#, "")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported model_type `pixtral`"), "{e}");
    let e = spec(r#"{"model_type":"bert"}"#).unwrap_err().to_string();
    assert!(
        e.contains("multimodal wrappers") && e.contains("llama4"),
        "{e}"
    );
}

/// Qwen/Qwen2.5-VL-7B-Instruct's config.json as the hub serves it: flat (the text keys at
/// the top beside `vision_config`), `rope_scaling` of type `mrope`.
const QWEN2_5_VL_7B_HUB: &str = r#"{
  "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
  "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
  "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
  "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
  "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28,
  "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": true,
  "use_sliding_window": false,
  "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
    "intermediate_size": 3420, "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584,
    "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    "temporal_patch_size": 2},
  "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
  "vocab_size": 152064
}"#;

#[test]
fn qwen2_5_vl_flat_hub_config_and_text_config_both_load() {
    let s = spec(QWEN2_5_VL_7B_HUB).unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.wrapper.as_deref(), s.family),
        ("qwen2_5_vl_text", Some("qwen2_5_vl"), Family::Llama)
    );
    assert_eq!((s.hidden_size, s.num_layers, s.head_dim), (3584, 28, 128));
    assert!(s.qkv_bias && !s.o_bias && !s.mlp_bias && !s.tie_word_embeddings);
    assert_eq!(s.layer_types, vec![AttentionKind::Full; 28]);
    assert_eq!(s.rope.theta, 1e6);
    assert_eq!(s.rope.scaling, RopeScaling::Default);
    assert_eq!(
        s.mrope,
        Some(Mrope {
            section: [16, 24, 24],
            interleaved: false,
            pairs: 64,
            image_token_id: 151_655,
            spatial_merge_size: 2
        })
    );
    assert_eq!(
        s.names,
        TextNames::Plain,
        "the class's default until read: the hub's names, which transformers 5.17 writes"
    );

    // transformers 5's save: `text_config` (its rope in `rope_parameters`), the wrapper's
    // keys at the top; defaults where absent (theta 1e6, eps 1e-5, section [16, 24, 24]).
    let nested = |text: &str, top: &str| {
        spec(&format!(
            r#"{{"model_type":"qwen2_5_vl","text_config":{{{text}{TEXT}}},
            "vision_config":{{"spatial_merge_size":3}}{top}}}"#
        ))
    };
    let s = nested(
        r#""rope_parameters":{"rope_type":"default","mrope_section":[2,1,1],"rope_theta":5e5},"#,
        r#","image_token_id":60"#,
    )
    .unwrap();
    assert_eq!(s.model_type, "qwen2_5_vl_text");
    assert_eq!(s.rope.theta, 5e5);
    let m = s.mrope.unwrap();
    assert_eq!(
        (m.section, m.image_token_id, m.spatial_merge_size),
        ([2, 1, 1], 60, 3)
    );
    let s = nested(r#""head_dim":16,"#, "");
    let e = s.unwrap_err().to_string();
    assert!(
        e.contains("mrope_section") && e.contains("head_dim / 2 = 4"),
        "head_dim is ignored (48 / 6 = 8) and [16, 24, 24] does not fit: {e}"
    );
    let ok = r#""rope_scaling":{"type":"mrope","mrope_section":[2,1,1]},"#;
    let s = nested(ok, "").unwrap();
    assert_eq!((s.rope.theta, s.rms_norm_eps), (1e6, 1e-5));
    // Qwen2_5_VLConfig ties when either level says so (pre-v5 saves kept the flag inside).
    let tie = |text: &str, top: &str| {
        nested(&format!("{ok}{text}"), top)
            .unwrap()
            .tie_word_embeddings
    };
    assert!(!tie("", ""));
    assert!(tie(r#""tie_word_embeddings":true,"#, ""));
    assert!(tie(
        r#""tie_word_embeddings":true,"#,
        r#","tie_word_embeddings":false"#
    ));
    assert!(tie("", r#","tie_word_embeddings":true"#));
    // Sliding layers from `max_window_layers` (default 80) when `use_sliding_window`.
    let s = nested(
        &format!(r#"{ok}"use_sliding_window":true,"sliding_window":5,"max_window_layers":2,"#),
        "",
    )
    .unwrap();
    use AttentionKind::{Full, Sliding};
    assert_eq!(s.layer_types, [Full, Full, Sliding, Sliding]);

    for (bad, key) in [
        (r#"{"type":"mrope","mrope_section":[2,2]}"#, "mrope_section"),
        (r#"{"type":"mrope","mrope_section":[2,1,2]}"#, "sum to"),
        (r#"{"type":"mrope","mrope_section":"x"}"#, "mrope_section"),
    ] {
        let e = nested(&format!(r#""rope_scaling":{bad},"#), "")
            .unwrap_err()
            .to_string();
        assert!(e.contains(key) && e.contains("text_config"), "{e}");
    }
    let e = spec(&format!(
        r#"{{"model_type":"qwen2_5_vl","text_config":{{{ok}{TEXT}}},
        "vision_config":{{"spatial_merge_size":0}}}}"#
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("vision_config.spatial_merge_size"), "{e}");
    // mrope outside Qwen2.5-VL is refused, not read as a plain RoPE.
    let e = tiny(
        "qwen2",
        r#""rope_scaling":{"type":"mrope","mrope_section":[2,1,1]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("mrope"), "{e}");
}

/// Qwen/Qwen3-VL-8B-Instruct's config.json (configs/qwen3-vl-8b): `text_config` with a legacy
/// `rope_scaling` naming the interleaved sections, the tower's keys in `vision_config`.
#[test]
fn qwen3_vl_hub_config_loads_its_text_model() {
    let hub = include_str!("../../../configs/qwen3-vl-8b/config.json");
    let s = spec(hub).unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.wrapper.as_deref(), s.family),
        ("qwen3_vl_text", Some("qwen3_vl"), Family::Qwen3)
    );
    assert_eq!(
        (s.hidden_size, s.num_layers, s.head_dim, s.num_kv_heads),
        (4096, 36, 128, 8)
    );
    assert!(s.qk_norm && !s.qkv_bias && !s.o_bias && !s.tie_word_embeddings);
    assert_eq!(s.layer_types, vec![AttentionKind::Full; 36]);
    assert_eq!(
        (s.rope.theta, s.rope.scaling.clone()),
        (5e6, RopeScaling::Default)
    );
    assert_eq!(s.names, TextNames::Current);
    assert_eq!(
        s.mrope,
        Some(Mrope {
            section: [24, 20, 20],
            interleaved: true,
            pairs: 64,
            image_token_id: 151_655,
            spatial_merge_size: 2
        })
    );
    // transformers 5's save (`rope_parameters`), defaults where absent: theta 5e5, the
    // section [24, 20, 20], untied unless the wrapper ties (the text config's flag is not
    // read by Qwen3VLForConditionalGeneration).
    let t = r#""vocab_size":32,"hidden_size":64,"intermediate_size":8,"num_hidden_layers":1,
        "num_attention_heads":1"#;
    let s = spec(&format!(
        r#"{{"model_type":"qwen3_vl","text_config":{{{t},"tie_word_embeddings":true}}}}"#
    ))
    .unwrap();
    let m = s.mrope.clone().unwrap();
    assert_eq!((s.head_dim, s.rope.theta), (128, 5e5));
    assert_eq!((m.section, m.interleaved), ([24, 20, 20], true));
    assert!(!s.tie_word_embeddings);
    let s = spec(&format!(
        r#"{{"model_type":"qwen3_vl","tie_word_embeddings":true,"text_config":{{{t},"head_dim":16,
        "rope_parameters":{{"rope_type":"default","rope_theta":1e4,"mrope_section":[2,3,3]}}}}}}"#
    ))
    .unwrap();
    assert!(s.tie_word_embeddings);
    assert_eq!(s.mrope.unwrap().pair_axes(), [0, 1, 2, 0, 1, 2, 0, 1]);
    let e = spec(&format!(
        r#"{{"model_type":"qwen3_vl","text_config":{{{t},"head_dim":16}}}}"#
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("mrope_section") && e.contains("text_config"),
        "{e}"
    );
}

/// Qwen/Qwen3.5-27B's config.json (configs/qwen3.5-27b): the text model's interleaved mrope over
/// the 32 pairs of its partial RoPE (64 of head_dim 256), the wrapper's image token. A
/// text-only `qwen3_5_text` reads the same, `Qwen3_5Config`'s image token by default; its
/// sections need not sum to the pairs (`Qwen3_5TextConfig` does not check them, and the
/// default [11, 11, 10] meets a 2-pair RoPE in the tiny text cases).
#[test]
fn qwen3_5_hub_config_has_the_interleaved_mrope() {
    let hub = include_str!("../../../configs/qwen3.5-27b/config.json");
    let s = spec(hub).unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.wrapper.as_deref(), s.family),
        ("qwen3_5_text", Some("qwen3_5"), Family::Qwen3Next)
    );
    assert_eq!(
        (s.head_dim, s.rope.rotary_dim, s.rope.theta),
        (256, 64, 1e7)
    );
    assert_eq!(
        s.mrope,
        Some(Mrope {
            section: [11, 11, 10],
            interleaved: true,
            pairs: 32,
            image_token_id: 248_056,
            spatial_merge_size: 2
        })
    );
    let t = r#""model_type":"qwen3_5_text","vocab_size":32,"hidden_size":64,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":2,"head_dim":8,"layer_types":["full_attention"],
        "linear_num_key_heads":1,"linear_num_value_heads":1"#;
    let s = spec(&format!("{{{t}}}")).unwrap();
    let m = s.mrope.clone().unwrap();
    assert_eq!(
        (m.section, m.pairs, m.image_token_id),
        ([11, 11, 10], 1, 248_056)
    );
    assert_eq!(m.pair_axes(), [0]);
    let s = spec(&format!(
        r#"{{"model_type":"qwen3_5","image_token_id":7,"text_config":{{{t},
        "rope_parameters":{{"rope_type":"default","rope_theta":1e4,"partial_rotary_factor":1.0,
        "mrope_section":[1,1,1]}}}}}}"#
    ))
    .unwrap();
    let m = s.mrope.unwrap();
    assert_eq!((m.pairs, m.image_token_id), (4, 7));
    assert_eq!(m.pair_axes(), [0, 1, 2, 0]);
}
