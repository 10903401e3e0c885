use super::*;
use serde_json::json;

fn hub() -> ClipSpec {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/llava-next-7b/config.json");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&dir).unwrap()).unwrap();
    ClipSpec::from_json(&cfg, "llava_next", &dir).unwrap()
}

#[test]
fn hub_config_reads_with_its_tower_and_projector() {
    // configs/llava-next-7b (llava-hf/llava-v1.6-mistral-7b-hf's architecture); parameters
    // counted by transformers 5.17 (LlavaNextForConditionalGeneration on the meta device):
    // 303,507,456 in `vision_tower`, 20,979,712 in `multi_modal_projector`, 4,096 in
    // `image_newline`.
    let s = hub();
    assert_eq!(
        (s.patches_per_side(), s.tile_features(), s.head_dim()),
        (24, 576, 64)
    );
    assert_eq!((s.layers_run(), s.max_tiles()), (23, 5));
    assert_eq!(s.hidden_act, Activation::QuickGelu);
    assert_eq!(s.projector_act, Activation::Gelu);
    let t = s.tensors();
    assert_eq!(t.len(), 5 + 24 * 16 + 2 + 4 + 1);
    let n = |names: &dyn Fn(&str) -> bool| -> usize {
        t.iter()
            .filter(|(name, _)| names(name))
            .map(|(_, sh)| sh.iter().product::<usize>())
            .sum()
    };
    let beside = |name: &str| name.starts_with(PROJECTOR) || name == IMAGE_NEWLINE;
    assert_eq!(n(&|name| !beside(name)), 303_507_456);
    assert_eq!(n(&|name| name.starts_with(PROJECTOR)), 20_979_712);
    assert_eq!(n(&|name| name == IMAGE_NEWLINE), 4096);
}

/// Image tokens against `LlavaNextProcessor._get_number_of_features(h, w, 336, 336) - 1`
/// with the hub's settings (patch 14, `num_additional_image_tokens` 1, `default`), computed
/// with transformers 5.17; and the pinpoint `select_best_resolution` picks. A 1 x 200 image
/// keeps no row of the tiles' grid (its base tile's 576 tokens alone).
#[test]
fn tokens_equal_the_processors_count() {
    let s = hub();
    for ((h, w), best, tokens) in [
        ((899, 1024), [672, 672], 2634),
        ((336, 336), [336, 672], 1176),
        ((100, 2000), [336, 1008], 868),
        ((2000, 100), [1008, 336], 936),
        ((480, 640), [672, 672], 2340),
        ((9, 20), [336, 672], 1654),
        ((1, 200), [336, 672], 576),
    ] {
        assert_eq!(s.best_resolution(h, w), best, "{h} x {w}");
        assert_eq!(s.image_tokens(h, w), tokens, "{h} x {w}");
    }
    assert_eq!(s.tiles(899, 1024), 5);
    // 899 x 1024 in a 48 x 48 grid: 42 rows kept (round(899 x 48 / 1024) = 42), 3 from
    // the top.
    assert_eq!(s.unpadded(899, 1024), [3, 42, 0, 48]);
}

#[test]
fn defaults_and_refusals_name_the_key() {
    let c = Path::new("m/config.json");
    // No vision_config: LlavaNextConfig's CLIP ViT-L/14-336.
    let d = ClipSpec::from_json(&json!({}), "llava_next", c).unwrap();
    assert_eq!(
        (d.depth, d.hidden_size, d.image_size, d.patch_size),
        (24, 1024, 336, 14)
    );
    assert_eq!(
        (d.feature_layer, d.image_token_id, d.out_hidden_size),
        (-2, 32000, 4096)
    );
    assert_eq!(d.pinpoints.len(), 5);
    let e = |v: Value| {
        ClipSpec::from_json(&v, "llava_next", c)
            .unwrap_err()
            .to_string()
    };
    for (bad, key) in [
        (
            json!({"vision_feature_select_strategy": "full"}),
            "vision_feature_select_strategy",
        ),
        (
            json!({"vision_feature_layer": [-2, -5]}),
            "vision_feature_layer",
        ),
        (json!({"vision_feature_layer": -26}), "vision_feature_layer"),
        (
            json!({"image_grid_pinpoints": [[336, 600]]}),
            "image_grid_pinpoints",
        ),
        (json!({"image_grid_pinpoints": []}), "image_grid_pinpoints"),
        (
            json!({"image_grid_pinpoints": [[336]]}),
            "image_grid_pinpoints",
        ),
        (
            json!({"vision_config": {"model_type": "siglip_vision_model"}}),
            "vision_config.model_type",
        ),
        (
            json!({"vision_config": {"hidden_act": "relu"}}),
            "vision_config.hidden_act",
        ),
        (
            json!({"vision_config": {"image_size": 30, "patch_size": 14}}),
            "image_size",
        ),
        (
            json!({"vision_config": {"num_hidden_layers": "x"}}),
            "vision_config.num_hidden_layers",
        ),
        (
            json!({"projector_hidden_act": "relu"}),
            "projector_hidden_act",
        ),
    ] {
        let msg = e(bad);
        assert!(
            msg.contains("m/config.json") && msg.contains(key),
            "{key}: {msg}"
        );
    }
    let nb = ClipSpec::from_json(
        &json!({"multimodal_projector_bias": false}),
        "llava_next",
        c,
    )
    .unwrap();
    assert!(
        nb.tensors()
            .iter()
            .all(|(n, _)| !n.ends_with("linear_1.bias"))
    );
}

#[test]
fn round7_truncates_but_at_an_integer() {
    assert_eq!(round7_int(7.012_987), 7);
    assert_eq!(round7_int(41.999_999_99), 42);
    assert_eq!(round7_int(41.999_9), 41);
    assert_eq!(round7_int(3.0), 3);
}

/// `forward_flops` against torch's FlopCounterMode over transformers' tower (cut after the
/// layer the projector reads) and projector (scripts/make_vlm_golden_llava_next.py, the
/// golden model's, per image size): both count whole products, so they are equal.
#[test]
fn forward_flops_equal_torch_count() {
    let Some(fx) = std::env::var_os("MT_DATA_FIXTURES") else {
        eprintln!("no data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let dir = std::path::PathBuf::from(fx).join("vlm/golden-llava_next");
    let text = std::fs::read_to_string(dir.join("model/config.json")).unwrap();
    let cfg: Value = serde_json::from_str(&text).unwrap();
    let spec = ClipSpec::from_json(&cfg, "llava_next", Path::new("c")).unwrap();
    let text = std::fs::read_to_string(dir.join("tower_flops.json")).unwrap();
    let counted: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert!(counted.len() >= 5);
    for c in counted {
        let (h, w) = (
            c["size"][0].as_u64().unwrap() as u32,
            c["size"][1].as_u64().unwrap() as u32,
        );
        assert_eq!(
            spec.tiles(h, w) as u64,
            c["tiles"].as_u64().unwrap(),
            "{h} x {w}"
        );
        assert_eq!(
            spec.forward_flops(h, w),
            c["flops"].as_f64().unwrap(),
            "{h} x {w}"
        );
    }
}
