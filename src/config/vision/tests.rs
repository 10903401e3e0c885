//! The tower specs read from hub configs and against transformers' counts.

use super::*;
use serde_json::json;

fn spec(vision: Value) -> Result<Option<VisionSpec>> {
    let cfg = json!({"model_type": "qwen2_5_vl", "vision_config": vision});
    VisionSpec::from_json(&cfg, Path::new("m/config.json"))
}

#[test]
fn hub_config_reads_with_defaults() {
    // Qwen2.5-VL-7B-Instruct's vision_config as the hub has it (`in_chans`, no rope key).
    let s = spec(json!({
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2
    }))
    .unwrap()
    .unwrap();
    assert_eq!(s.head_dim(), 80);
    assert_eq!(s.patch_len(), 1176);
    assert_eq!(s.merge_window(), 4);
    assert_eq!(s.rope_theta, 10000.0);
    assert!(s.full_attention(31) && !s.full_attention(30));
    let t = s.tensors();
    assert_eq!(t.len(), 1 + 32 * 12 + 5);
    assert_eq!(t[0].1, vec![1280, 3, 2, 14, 14]);
    assert_eq!(t.last().unwrap().1, vec![3584]);
}

#[test]
fn the_tower_follows_the_model_type() {
    let c = Path::new("c");
    let qwen = json!({"model_type": "qwen2_5_vl", "vision_config": {}});
    assert!(matches!(
        TowerSpec::from_json(&qwen, c),
        Ok(Some(TowerSpec::Qwen(_)))
    ));
    let gemma = json!({"model_type": "gemma3", "mm_tokens_per_image": 4,
        "vision_config": {"image_size": 56, "patch_size": 14}});
    let t = TowerSpec::from_json(&gemma, c).unwrap().unwrap();
    assert_eq!((t.model_type(), t.depth()), ("gemma3", 12));
    let text = json!({"model_type": "gemma3_text"});
    assert!(TowerSpec::from_json(&text, c).unwrap().is_none());
    let llava = json!({"model_type": "llava_next", "vision_config": {"num_hidden_layers": 3,
        "image_size": 336, "patch_size": 14}});
    let t = TowerSpec::from_json(&llava, c).unwrap().unwrap();
    assert_eq!((t.model_type(), t.depth()), ("llava_next", 3));
    assert!(beside_tower("image_newline") && beside_tower("multi_modal_projector.linear_1.bias"));
    assert!(!beside_tower("embeddings.class_embedding"));
    // A trained CLIP tower: the layers after the one `vision_feature_layer` reads (-2: layer
    // 2 of 3) and post_layernorm reach no feature and stay frozen; SigLIP's all train. Their
    // layout names are the hub's under `vision_tower.`, the projector's as they are.
    let whole = TowerTraining::Whole;
    for (name, trains) in [
        ("embeddings.class_embedding", true),
        ("encoder.layers.1.mlp.fc1.weight", true),
        ("encoder.layers.2.mlp.fc1.weight", false),
        ("post_layernorm.weight", false),
        ("image_newline", true),
    ] {
        assert_eq!(t.trains(whole, name), trains, "{name}");
    }
    assert!(!t.trains(TowerTraining::Projector, "encoder.layers.0.mlp.fc1.weight"));
    assert_eq!(
        t.layout_name("encoder.layers.0.mlp.fc1.weight", false),
        "vision_tower.encoder.layers.0.mlp.fc1.weight"
    );
    assert_eq!(
        t.layout_name("encoder.layers.0.mlp.fc1.weight", true),
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    );
    assert_eq!(t.layout_name("image_newline", true), "image_newline");
    // All but the projector's 4 and the newline, layer 2's 16 and post_layernorm's 2.
    let trained = t.trained_tensors(TowerTraining::Encoder, false);
    assert_eq!(trained.len(), t.tensors().len() - 5 - 16 - 2, "{trained:?}");
    let siglip = TowerSpec::from_json(&gemma, c).unwrap().unwrap();
    assert!(siglip.trains(whole, "post_layernorm.weight"));
    assert!(siglip.trains(whole, "encoder.layers.11.mlp.fc1.weight"));
    for t in VISION_MODEL_TYPES.iter().filter(|&&t| t != "llava_next") {
        let cfg = json!({"model_type": t});
        assert!(
            TowerSpec::from_json(&cfg, c).is_err(),
            "{t}: no vision_config"
        );
    }
}

#[test]
fn qwen3_vl_hub_config_reads() {
    // configs/qwen3-vl-8b (Qwen/Qwen3-VL-8B-Instruct); the tower's parameters counted
    // by transformers 5.17 (the model on the meta device, the parameters under
    // `model.visual`).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen3-vl-8b");
    let s = VisionSpec::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(s.family, VisionFamily::Qwen3Vl);
    assert_eq!(
        (s.head_dim(), s.patch_len(), s.position_grid_side()),
        (72, 1536, 48)
    );
    assert_eq!(s.hidden_act, Activation::GeluTanh);
    assert_eq!(s.deepstack_taps(), [(8, 0), (16, 1), (24, 2)]);
    let n: usize = s
        .tensors()
        .iter()
        .map(|(_, sh)| sh.iter().product::<usize>())
        .sum();
    assert_eq!(n, 576_388_336);
    // Defaults (Qwen3VLVisionConfig's) where the keys are absent; Qwen2.5-VL's window
    // keys are not read.
    let cfg = json!({"model_type": "qwen3_vl", "vision_config": {"window_size": 1}});
    let d = VisionSpec::from_json(&cfg, Path::new("c"))
        .unwrap()
        .unwrap();
    assert_eq!(
        (d.depth, d.hidden_size, d.patch_size, d.window_size),
        (27, 1152, 16, 0)
    );
    assert_eq!(d.deepstack_visual_indexes, [8, 16, 24]);
    for (bad, key) in [
        (
            json!({"deepstack_visual_indexes": [1, 1]}),
            "deepstack_visual_indexes",
        ),
        (
            json!({"depth": 2, "deepstack_visual_indexes": [2]}),
            "deepstack_visual_indexes",
        ),
        (
            json!({"num_position_embeddings": 0}),
            "num_position_embeddings",
        ),
    ] {
        let cfg = json!({"model_type": "qwen3_vl", "vision_config": bad});
        let e = VisionSpec::from_json(&cfg, Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{e}");
    }
}

/// configs/qwen3.5-27b (Qwen/Qwen3.5-27B's config.json): Qwen3-VL's tower without the
/// deepstack mergers; its parameters as transformers 5.17 counts them (the model on the meta
/// device, the parameters under `model.visual`: 460,730,096).
#[test]
fn qwen3_5_hub_config_reads_without_deepstack() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen3.5-27b");
    let s = VisionSpec::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(
        (s.model_type.as_str(), s.family),
        ("qwen3_5", VisionFamily::Qwen3Vl)
    );
    assert_eq!(
        (
            s.head_dim(),
            s.patch_len(),
            s.position_grid_side(),
            s.out_hidden_size
        ),
        (72, 1536, 48, 5120)
    );
    assert!(s.deepstack_taps().is_empty());
    let n: usize = s
        .tensors()
        .iter()
        .map(|(_, sh)| sh.iter().product::<usize>())
        .sum();
    assert_eq!(n, 460_730_096);
    assert!(
        !s.tensors().iter().any(|(n, _)| n.starts_with("deepstack")),
        "no deepstack merger"
    );
    // Qwen3_5VisionConfig's defaults where keys are absent; a deepstack list is not read
    // (Qwen3_5VisionModel builds no deepstack merger whatever the config says).
    let cfg = json!({"model_type": "qwen3_5", "vision_config": {"deepstack_visual_indexes": [1]}});
    let d = VisionSpec::from_json(&cfg, Path::new("c"))
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            d.depth,
            d.hidden_size,
            d.patch_size,
            d.num_position_embeddings
        ),
        (27, 1152, 16, 2304)
    );
    assert!(d.deepstack_visual_indexes.is_empty());
}

#[test]
fn other_model_types_have_no_tower() {
    let cfg = json!({"model_type": "qwen2", "vision_config": {}});
    assert!(
        VisionSpec::from_json(&cfg, Path::new("c"))
            .unwrap()
            .is_none()
    );
}

#[test]
fn bad_values_are_named() {
    let e = spec(json!({"hidden_size": 100, "num_heads": 16}))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("m/config.json") && e.contains("num_heads"),
        "{e}"
    );
    let e = spec(json!({"window_size": 20})).unwrap_err().to_string();
    assert!(e.contains("window_size"), "{e}");
    let e = spec(json!({"depth": "x"})).unwrap_err().to_string();
    assert!(e.contains("vision_config.depth"), "{e}");
    let e = spec(json!({"hidden_act": "relu"})).unwrap_err().to_string();
    assert!(e.contains("hidden_act"), "{e}");
    let cfg = json!({"model_type": "qwen2_5_vl"});
    let e = VisionSpec::from_json(&cfg, Path::new("c"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("vision_config"), "{e}");
}

/// `forward_flops` against torch's FlopCounterMode over transformers' tower
/// (scripts/make_vlm_golden.py: the golden model's tower on the records' grids and on
/// partial windows and two frames). Both count whole products, so they are equal.
#[test]
fn forward_flops_equal_torch_count() {
    let Some(fx) = std::env::var_os("MT_DATA_FIXTURES") else {
        eprintln!("no data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    // Qwen2.5-VL's tower, then Qwen3-VL's (with its two deepstack mergers), then Qwen3.5's.
    for case in ["vlm/golden", "vlm/golden-qwen3vl", "vlm/golden-qwen3_5"] {
        flops_equal(&std::path::PathBuf::from(&fx).join(case));
    }
}

fn flops_equal(dir: &Path) {
    let spec = VisionSpec::from_model_dir(&dir.join("model"))
        .unwrap()
        .unwrap();
    let text = std::fs::read_to_string(dir.join("tower_flops.json")).unwrap();
    let counted: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert!(counted.len() >= 4);
    for c in counted {
        let g: Vec<u32> = serde_json::from_value(c["grid"].clone()).unwrap();
        let want = c["flops"].as_f64().unwrap();
        let got = spec.forward_flops([g[0], g[1], g[2]]);
        assert_eq!(got, want, "{}: grid {g:?}", dir.display());
    }
}
