use super::*;
use crate::config::hf::TextNames;

fn spec(model_type: &str, extra: &str) -> ModelSpec {
    let mut json: serde_json::Value = serde_json::from_str(&format!(
        r#"{{"model_type":"{model_type}","vocab_size":67,"hidden_size":48,
        "intermediate_size":88,"num_hidden_layers":3,"num_attention_heads":6,
        "num_key_value_heads":2}}"#
    ))
    .unwrap();
    let extra: serde_json::Value =
        serde_json::from_str(&format!("{{{}}}", extra.trim_start_matches(','))).unwrap();
    for (k, v) in extra.as_object().unwrap() {
        json[k] = v.clone();
    }
    let hf: crate::config::hf::HfConfig = serde_json::from_value(json).unwrap();
    ModelSpec::from_hf(&hf, std::path::Path::new("config.json")).unwrap()
}

pub(crate) fn tiny_spec(tied: bool) -> ModelSpec {
    spec(
        "llama",
        &format!(r#","tie_word_embeddings":{tied},"attention_bias":true"#),
    )
}

fn layer_names(s: &ModelSpec) -> Vec<String> {
    let l = Layout::new(s);
    l.blocks[l.layer_block(0)]
        .tensors
        .iter()
        .map(|t| format!("{}{:?}", t.name, t.shape))
        .collect()
}

#[test]
fn blocks_are_aligned_disjoint_and_hold_every_tensor() {
    let l = Layout::new(&tiny_spec(false));
    assert_eq!(l.blocks.len(), 3 + 2);
    let mut end = 0;
    for b in &l.blocks {
        assert_eq!(b.offset, end);
        assert_eq!(b.offset % BLOCK_ALIGN, 0);
        let mut prev = 0;
        for t in &b.tensors {
            assert!(t.offset >= prev && t.offset % TENSOR_ALIGN == 0);
            prev = t.offset + t.numel();
        }
        assert!(prev <= b.len);
        end = b.offset + b.len;
    }
    assert_eq!(end, l.total);
    // 67*48 embed + 48 norm + 67*48 lm_head + 3 layers.
    let layer = 48 + (48 * 48 + 48) + 2 * (16 * 48 + 16) + (48 * 48 + 48) + 48 + 3 * 88 * 48;
    assert_eq!(l.num_params(), 2 * 67 * 48 + 48 + 3 * layer);
    let b = &l.blocks[l.layer_block(2)];
    assert_eq!(
        b.hf_name(b.tensor("mlp.up_proj.weight").unwrap()),
        "model.layers.2.mlp.up_proj.weight"
    );
}

#[test]
fn gradient_parts_cover_each_block_in_slot_sized_pieces() {
    // An embedding and lm_head about 3.6 layers large: 4 parts each.
    let mut s = tiny_spec(false);
    s.vocab_size = 1531;
    let l = Layout::new(&s);
    let slot = l.grad_slot_len();
    assert_eq!(slot, l.max_layer_len());
    assert!(slot < l.max_block_len());
    for (i, b) in l.blocks.iter().enumerate() {
        let parts: Vec<_> = l.grad_parts(i, slot).collect();
        assert_eq!(parts.len(), b.len.div_ceil(slot), "block {i}");
        let mut end = 0;
        for (p, r) in parts.iter().enumerate() {
            assert_eq!(r.start, end);
            assert!(r.len() == slot || (p + 1 == parts.len() && r.len() <= slot));
            end = r.end;
        }
        assert_eq!(end, b.len);
        // Every element of every tensor lies in exactly one part, in order, at a slot
        // offset inside the part.
        let mut seen = vec![0; b.tensors.len()];
        for r in &parts {
            for (t, within) in b.part_tensors(r.clone()) {
                let ti = b.tensors.iter().position(|x| x.name == t.name).unwrap();
                assert_eq!(within.start, seen[ti], "{} in block {i}", t.name);
                seen[ti] = within.end;
                let at = t.offset + within.start - r.start;
                assert!(at + within.len() <= r.len());
            }
        }
        let numels: Vec<usize> = b.tensors.iter().map(TensorSpec::numel).collect();
        assert_eq!(seen, numels, "block {i}");
    }
    assert_eq!(l.grad_parts(Layout::EMBED, slot).len(), 4);
    assert_eq!(l.grad_parts(l.head_block(), slot).len(), 4);
    assert_eq!(l.grad_parts(l.layer_block(1), slot).len(), 1);
    // A slot as large as the largest block: one part per block, as before.
    let whole = l.max_block_len();
    assert!((0..l.blocks.len()).all(|i| l.grad_parts(i, whole).len() == 1));
}

#[test]
fn tied_head_has_no_lm_head() {
    let l = Layout::new(&tiny_spec(true));
    let head = &l.blocks[l.head_block()];
    assert!(head.tensor("lm_head.weight").is_none());
    assert!(l.tied_embeddings);
}

#[test]
fn family_layers_hold_their_checkpoint_tensors() {
    let names = layer_names(&spec("qwen2", ""));
    assert!(names.contains(&"self_attn.k_proj.bias[16]".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("self_attn.o_proj.bias")));

    let names = layer_names(&spec("qwen3", r#","head_dim":10"#));
    assert!(names.contains(&"self_attn.q_proj.weight[60, 48]".to_string()));
    assert!(names.contains(&"self_attn.o_proj.weight[48, 60]".to_string()));
    assert!(names.contains(&"self_attn.q_norm.weight[10]".to_string()));
    assert!(names.contains(&"self_attn.k_norm.weight[10]".to_string()));

    let gemma2 = spec("gemma2", r#","head_dim":10"#);
    let names = layer_names(&gemma2);
    for n in [
        "pre_feedforward_layernorm.weight[48]",
        "post_feedforward_layernorm.weight[48]",
        "mlp.gate_proj.weight[88, 48]",
    ] {
        assert!(names.contains(&n.to_string()), "{names:?}");
    }
    assert!(!names.iter().any(|n| n.contains("q_norm")));
    assert!(
        Layout::new(&gemma2).tied_embeddings,
        "gemma ties by default"
    );
    let names = layer_names(&spec("gemma3_text", r#","head_dim":10"#));
    assert!(names.contains(&"self_attn.k_norm.weight[10]".to_string()));
    assert_eq!(names.len(), 13);

    let names = layer_names(&spec("phi3", ""));
    assert_eq!(
        names,
        [
            "input_layernorm.weight[48]",
            "self_attn.qkv_proj.weight[80, 48]",
            "self_attn.o_proj.weight[48, 48]",
            "post_attention_layernorm.weight[48]",
            "mlp.gate_up_proj.weight[176, 48]",
            "mlp.down_proj.weight[48, 88]",
        ]
    );

    let names = layer_names(&spec("llama", r#","mlp_bias":true"#));
    assert!(names.contains(&"mlp.down_proj.bias[48]".to_string()));
    assert!(names.contains(&"mlp.gate_proj.bias[88]".to_string()));
}

#[test]
fn moe_layers_hold_router_and_per_expert_tensors() {
    let mixtral = spec(
        "mixtral",
        r#","num_local_experts":3,"num_experts_per_tok":2"#,
    );
    let names = layer_names(&mixtral);
    assert!(names.contains(&"block_sparse_moe.gate.weight[3, 48]".to_string()));
    assert!(names.contains(&"block_sparse_moe.experts.2.w2.weight[48, 88]".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("mlp.")));
    // A token passes through 2 of the 3 experts: one expert's tensors per layer unused.
    let l = Layout::new(&mixtral);
    let one_expert: usize = l
        .tensors()
        .filter(|(_, t)| t.name.starts_with("block_sparse_moe.experts.0."))
        .map(|(_, t)| t.numel())
        .sum();
    assert_eq!(l.unrouted_params, one_expert);
    // Each expert tensor's copies form a stack at one stride, in the block's order.
    let b = &l.blocks[l.layer_block(1)];
    let stacks = b.expert_stacks();
    let names: Vec<&str> = stacks.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "block_sparse_moe.experts.w1.weight",
            "block_sparse_moe.experts.w2.weight",
            "block_sparse_moe.experts.w3.weight"
        ]
    );
    for s in &stacks {
        assert_eq!(s.experts, 3);
        assert!(s.stride >= 3 * 88 * 48 && s.stride % TENSOR_ALIGN == 0);
        for e in 0..3 {
            let t = b.tensor(&s.member(e)).unwrap();
            assert_eq!((t.offset, &t.shape), (s.offset + e * s.stride, &s.shape));
        }
    }
    let qwen = spec(
        "qwen2_moe",
        r#","num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":20,"shared_expert_intermediate_size":24"#,
    );
    let l = Layout::new(&qwen);
    let stacks = l.blocks[l.layer_block(0)].expert_stacks();
    assert_eq!(stacks.len(), 3, "the shared expert is no stack");
    assert_eq!(stacks[2].name, "mlp.experts.down_proj.weight");
    assert_eq!(stacks[2].shape, [48, 20]);
    assert!(l.blocks[Layout::EMBED].expert_stacks().is_empty());

    let gpt = spec(
        "gpt_oss",
        r#","num_local_experts":4,"num_experts_per_tok":2,"head_dim":8"#,
    );
    let names = layer_names(&gpt);
    for n in [
        "self_attn.sinks[6]",
        "self_attn.o_proj.bias[48]",
        "mlp.router.bias[4]",
        "mlp.experts.gate_up_proj[4, 48, 176]",
        "mlp.experts.down_proj[4, 88, 48]",
        "mlp.experts.down_proj_bias[4, 48]",
    ] {
        assert!(names.contains(&n.to_string()), "{n} in {names:?}");
    }
    // 2 of 4 experts unused: half of the fused expert tensors, over 3 layers.
    let l = Layout::new(&gpt);
    let experts: usize = l
        .tensors()
        .filter(|(_, t)| t.name.starts_with("mlp.experts."))
        .map(|(_, t)| t.numel())
        .sum();
    assert_eq!(l.unrouted_params, experts / 2);
    assert_eq!(Layout::new(&gpt).layer_groups.len(), 1);
    assert!(
        l.blocks[l.layer_block(0)].expert_stacks().is_empty(),
        "fused, no stacks"
    );
}

#[test]
fn mixed_layers_group_by_structure_with_their_own_lengths() {
    // Layers 0 and 2 linear (0 sparse, 2 dense), 1 full attention, sparse.
    let s = spec(
        "qwen3_next",
        r#","head_dim":8,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":20,
        "shared_expert_intermediate_size":24,"mlp_only_layers":[2],"linear_num_key_heads":2,
        "linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":6,
        "layer_types":["linear_attention","full_attention","linear_attention"]"#,
    );
    let l = Layout::new(&s);
    let groups: Vec<(&str, &[usize])> = l
        .layer_groups
        .iter()
        .map(|g| (g.name.as_str(), g.layers.as_slice()))
        .collect();
    assert_eq!(
        groups,
        [
            ("linear_attention+moe", &[0][..]),
            ("attention+moe", &[1][..]),
            ("linear_attention+mlp", &[2][..]),
        ]
    );
    for (gi, g) in l.layer_groups.iter().enumerate() {
        for &layer in &g.layers {
            assert_eq!(l.blocks[l.layer_block(layer)].len, g.block_len);
            assert_eq!(l.layer_group(layer), gi);
        }
    }
    assert_ne!(l.layer_groups[0].block_len, l.layer_groups[2].block_len);
    assert_eq!(
        l.max_layer_len(),
        l.layer_groups.iter().map(|g| g.block_len).max().unwrap()
    );
    let names = |layer| -> Vec<String> {
        l.blocks[l.layer_block(layer)]
            .tensors
            .iter()
            .map(|t| format!("{}{:?}", t.name, t.shape))
            .collect()
    };
    let linear = names(0);
    for n in [
        "linear_attn.in_proj_qkvz.weight[80, 48]",
        "linear_attn.in_proj_ba.weight[8, 48]",
        "linear_attn.conv1d.weight[56, 1, 4]",
        "linear_attn.norm.weight[6]",
        "mlp.shared_expert_gate.weight[1, 48]",
        "mlp.experts.3.down_proj.weight[48, 20]",
    ] {
        assert!(linear.contains(&n.to_string()), "{n} in {linear:?}");
    }
    assert!(!linear.iter().any(|n| n.starts_with("self_attn.")));
    let full = names(1);
    assert!(full.contains(&"self_attn.q_proj.weight[96, 48]".to_string()));
    assert!(full.contains(&"self_attn.q_norm.weight[8]".to_string()));
    assert!(names(2).contains(&"mlp.down_proj.weight[48, 88]".to_string()));
}

#[test]
fn public_configs_have_their_transformers_parameter_counts() {
    // Counted by transformers 5.17: AutoModelForCausalLM.from_config on the meta device.
    let configs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    for (dir, params) in [
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("qwen3-next-80b-a3b", 79_674_391_296),
        ("gpt-oss-20b", 20_914_757_184),
        ("gpt-oss-120b", 116_829_156_672),
        ("llama3.1-70b", 70_553_706_496),
        ("qwen3-235b-a22b", 235_093_634_560),
        ("olmo2-7b", 7_298_617_344),
        ("glm4-9b", 9_400_279_040),
        ("glm4.5-air", 106_852_245_504),
        ("deepseek-v3", 671_026_404_352),
        // Llama4ForCausalLM on the text config: the vision tower is carried.
        ("llama4-scout", 107_769_861_120),
        // Qwen2_5_VLForConditionalGeneration less its `visual` (the frozen tower, in its
        // own region): the language model.
        ("qwen2.5-vl-7b", 7_615_616_512),
        // Qwen3VLForConditionalGeneration (8,767,123,696) less its `visual` (576,388,336).
        ("qwen3-vl-8b", 8_190_735_360),
        // Gemma3ForConditionalGeneration less its SigLIP tower and projector (tied head).
        ("gemma3-27b", 27_009_346_304),
        // LlavaNextForConditionalGeneration (7,566,747,648) less its CLIP tower, projector
        // and image_newline (324,491,264): the Mistral-7B language model, untied.
        ("llava-next-7b", 7_242_256_384),
    ] {
        let spec = ModelSpec::from_model_dir(&configs.join(dir)).unwrap();
        assert_eq!(Layout::new(&spec).num_params(), params, "{dir}");
    }
}

#[test]
fn new_family_layers_hold_their_checkpoint_tensors() {
    let names = layer_names(&spec("olmo2", ""));
    assert_eq!(
        names,
        [
            "self_attn.q_proj.weight[48, 48]",
            "self_attn.k_proj.weight[16, 48]",
            "self_attn.v_proj.weight[16, 48]",
            "self_attn.o_proj.weight[48, 48]",
            "self_attn.q_norm.weight[48]",
            "self_attn.k_norm.weight[16]",
            "post_attention_layernorm.weight[48]",
            "post_feedforward_layernorm.weight[48]",
            "mlp.gate_proj.weight[88, 48]",
            "mlp.up_proj.weight[88, 48]",
            "mlp.down_proj.weight[48, 88]",
        ]
    );
    let names = layer_names(&spec("glm4", r#","head_dim":8"#));
    for n in [
        "self_attn.q_proj.bias[48]",
        "post_self_attn_layernorm.weight[48]",
        "post_mlp_layernorm.weight[48]",
        "mlp.gate_up_proj.weight[176, 48]",
    ] {
        assert!(names.contains(&n.to_string()), "{n} in {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("self_attn.o_proj.bias")));

    let ds = spec(
        "deepseek_v3",
        r#","num_key_value_heads":6,"kv_lora_rank":16,"q_lora_rank":24,"qk_rope_head_dim":4,
        "qk_nope_head_dim":6,"v_head_dim":5,"n_routed_experts":4,"num_experts_per_tok":2,
        "n_group":2,"topk_group":1,"moe_intermediate_size":20,"first_k_dense_replace":1"#,
    );
    let l = Layout::new(&ds);
    let names = |l: &Layout, layer| -> Vec<String> {
        l.blocks[l.layer_block(layer)]
            .tensors
            .iter()
            .map(|t| format!("{}{:?}", t.name, t.shape))
            .collect()
    };
    for n in [
        "self_attn.q_a_proj.weight[24, 48]",
        "self_attn.q_a_layernorm.weight[24]",
        "self_attn.q_b_proj.weight[60, 24]",
        "self_attn.kv_a_proj_with_mqa.weight[20, 48]",
        "self_attn.kv_a_layernorm.weight[16]",
        "self_attn.kv_b_proj.weight[66, 16]",
        "self_attn.o_proj.weight[48, 30]",
        "mlp.gate_proj.weight[88, 48]",
    ] {
        assert!(
            names(&l, 0).contains(&n.to_string()),
            "{n} in {:?}",
            names(&l, 0)
        );
    }
    for n in [
        "mlp.gate.weight[4, 48]",
        "mlp.experts.3.down_proj.weight[48, 20]",
        "mlp.shared_experts.up_proj.weight[20, 48]",
    ] {
        assert!(
            names(&l, 1).contains(&n.to_string()),
            "{n} in {:?}",
            names(&l, 1)
        );
    }
    // The router's correction bias is a buffer: carried, not in the layout.
    assert!(
        !names(&l, 1)
            .iter()
            .any(|n| n.contains("e_score_correction_bias"))
    );
    assert!(
        l.carry
            .carries("model.layers.1.mlp.gate.e_score_correction_bias")
    );
    assert!(
        !l.carry
            .carries("model.layers.0.mlp.gate.e_score_correction_bias")
    );
    // The MTP layer after the decoder layers is carried; a layer beyond it is not.
    assert!(l.carry.carries("model.layers.3.eh_proj.weight"));
    assert!(!l.carry.carries("model.layers.4.eh_proj.weight"));
    assert!(!l.carry.carries("model.layers.1.mlp.gate.weight"));

    let l = Layout::new(&spec(
        "llama4_text",
        r#","head_dim":8,"intermediate_size_mlp":40,"num_local_experts":4,
        "interleave_moe_layer_step":2"#,
    ));
    assert!(names(&l, 0).contains(&"feed_forward.gate_proj.weight[40, 48]".to_string()));
    for n in [
        "feed_forward.router.weight[4, 48]",
        "feed_forward.experts.gate_up_proj[4, 48, 176]",
        "feed_forward.experts.down_proj[4, 88, 48]",
        "feed_forward.shared_expert.down_proj.weight[48, 88]",
    ] {
        assert!(
            names(&l, 1).contains(&n.to_string()),
            "{n} in {:?}",
            names(&l, 1)
        );
    }
}

#[test]
fn wrapped_text_models_keep_their_checkpoint_names() {
    let mut s = spec(
        "gemma3_text",
        r#","head_dim":8,"tie_word_embeddings":false"#,
    );
    for (names, layer, head) in [
        (
            TextNames::Legacy,
            "language_model.model.layers.2.mlp.up_proj.weight",
            "language_model.lm_head.weight",
        ),
        (
            TextNames::Current,
            "model.language_model.layers.2.mlp.up_proj.weight",
            "lm_head.weight",
        ),
    ] {
        s.names = names;
        let l = Layout::new(&s);
        let b = &l.blocks[l.layer_block(2)];
        assert_eq!(b.hf_name(b.tensor("mlp.up_proj.weight").unwrap()), layer);
        let h = &l.blocks[l.head_block()];
        assert_eq!(h.hf_name(h.tensor("lm_head.weight").unwrap()), head);
        assert_eq!(l.hf("lm_head.weight"), head);
        // Everything outside the text model is carried; its own tensors are not.
        assert!(
            l.carry
                .carries("vision_tower.encoder.layers.0.mlp.fc1.weight")
        );
        assert!(l.carry.carries("model.visual.blocks.0.attn.qkv.weight"));
        assert!(l.carry.carries("mtp.fc.weight"));
        assert!(!l.carry.carries(layer));
    }
    s.names = TextNames::Plain;
    let l = Layout::new(&s);
    assert!(l.carry.carries("mtp.layers.0.input_layernorm.weight"));
    assert!(!l.carry.carries("model.layers.9.extra.weight"));
}

/// A block's runs hold each tensor once, with its decay, in order; two runs in a row are
/// split by a gap or a change of decay; a MoE layer's expert tensors (adjacent, all
/// matrices) form one run.
#[test]
fn runs_join_adjacent_tensors_of_one_decay() {
    let mixtral = spec(
        "mixtral",
        r#","num_local_experts":3,"num_experts_per_tok":2"#,
    );
    let l = Layout::new(&mixtral);
    for b in &l.blocks {
        let runs = b.runs();
        for w in runs.windows(2) {
            let ((a, da), (c, dc)) = (&w[0], &w[1]);
            assert!(
                a.end < c.start || (a.end == c.start && da != dc),
                "{runs:?}"
            );
        }
        for t in &b.tensors {
            let r = Layout::global_range(b, t);
            let holding: Vec<_> = runs
                .iter()
                .filter(|(run, _)| run.start < r.end && r.start < run.end)
                .collect();
            assert_eq!(holding.len(), 1, "{} in {runs:?}", t.name);
            let (run, decay) = holding[0];
            assert!(run.start <= r.start && r.end <= run.end && *decay == t.decays());
        }
        let covered: usize = runs.iter().map(|(r, _)| r.len()).sum();
        assert_eq!(covered, b.tensors.iter().map(|t| t.numel()).sum::<usize>());
    }
    let b = &l.blocks[l.layer_block(1)];
    let at = |name: &str| Layout::global_range(b, b.tensor(name).unwrap()).start;
    let first = at("block_sparse_moe.experts.0.w1.weight");
    let last = at("block_sparse_moe.experts.2.w3.weight");
    let runs = b.runs();
    let run = runs.iter().find(|(r, _)| r.contains(&first)).unwrap();
    assert!(run.0.contains(&last), "{runs:?}");
}
