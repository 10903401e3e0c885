use super::*;

/// A tower on 14 x 14 tiles of 7-pixel patches, llava-v1.6's pinpoints at that size.
fn spec() -> ClipSpec {
    let cfg = serde_json::json!({"model_type": "llava_next", "image_token_index": 9,
        "image_grid_pinpoints": [[14, 28], [28, 14], [28, 28], [42, 14], [14, 42]],
        "text_config": {"hidden_size": 8},
        "vision_config": {"image_size": 14, "patch_size": 7, "num_hidden_layers": 2,
            "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8}});
    ClipSpec::from_json(&cfg, "llava_next", Path::new("c")).unwrap()
}

fn settings() -> serde_json::Value {
    serde_json::json!({"size": {"shortest_edge": 14}, "crop_size": {"height": 14, "width": 14},
        "image_grid_pinpoints": [[14, 28], [28, 14], [28, 28], [42, 14], [14, 42]], "resample": 3})
}

#[test]
fn spans_move_with_each_images_count() {
    let t = "<image>";
    let text = format!("ab{t}cd{t}e");
    // "cd" and the second image; "ab"; "e".
    let spans = [
        2 + t.len()..text.len() - 1,
        0..2,
        text.len() - 1..text.len(),
    ];
    let (out, moved) = expand(&text, &spans, t, &[2, 3]);
    assert_eq!(out, format!("ab{}cd{}e", t.repeat(2), t.repeat(3)));
    assert_eq!(&out[moved[0].clone()], format!("cd{}", t.repeat(3)));
    assert_eq!(&out[moved[1].clone()], "ab");
    assert_eq!(&out[moved[2].clone()], "e");
}

#[test]
fn config_keys_and_refusals() {
    let s = spec();
    let g = LlavaNextImages::from_config(&settings(), &s).unwrap();
    assert_eq!((g.image_token.as_str(), g.do_rescale), ("<image>", true));
    let with = |key: &str, v: serde_json::Value| {
        let mut c = settings();
        c[key] = v;
        c
    };
    for (bad, key) in [
        (with("resample", 2.into()), "resample"),
        (
            with("size", serde_json::json!({"shortest_edge": 28})),
            "size",
        ),
        (
            with("crop_size", serde_json::json!({"height": 14, "width": 28})),
            "crop_size",
        ),
        (
            with("image_grid_pinpoints", serde_json::json!([[14, 28]])),
            "image_grid_pinpoints",
        ),
        (with("image_std", serde_json::json!([1, 0, 1])), "image_std"),
    ] {
        let e = LlavaNextImages::from_config(&bad, &s).unwrap_err();
        assert!(e.contains(key), "{key}: {e}");
    }
    // `size` as height and width: the same tile.
    let hw = with("size", serde_json::json!({"height": 14, "width": 14}));
    assert!(LlavaNextImages::from_config(&hw, &s).is_ok());
    // processor_config.json: its counts must be the model's features.
    let ok = serde_json::json!({"patch_size": 7, "num_additional_image_tokens": 1,
        "vision_feature_select_strategy": "default", "image_token": "<img>"});
    assert_eq!(processor_token(&ok, &s).unwrap(), "<img>");
    for (bad, key) in [
        (serde_json::json!({"patch_size": 14}), "patch_size"),
        (
            serde_json::json!({"num_additional_image_tokens": 0}),
            "num_additional_image_tokens",
        ),
        (
            serde_json::json!({"vision_feature_select_strategy": "full"}),
            "vision_feature_select_strategy",
        ),
    ] {
        let e = processor_token(&bad, &s).unwrap_err();
        assert!(e.contains(key), "{key}: {e}");
    }
}

#[test]
fn tiles_are_the_base_image_then_the_padded_pinpoint_row_by_row() {
    // A 14 x 28 (h x w) image: the 14 x 28 pinpoint, no resize, no padding; without rescale
    // and normalisation each value is its sample, R holding y, G holding x.
    let (w, h) = (28u32, 14u32);
    let data = (0..h)
        .flat_map(|y| (0..w).flat_map(move |x| [y as u8, x as u8, 7]))
        .collect();
    let img = Rgb8 {
        width: w,
        height: h,
        data,
    };
    let mut g = LlavaNextImages::from_config(&settings(), &spec()).unwrap();
    (g.do_rescale, g.do_normalize) = (false, false);
    let v = g.pixel_values(&img);
    let tile = 3 * 14 * 14;
    assert_eq!(v.len(), 3 * tile, "the base tile and two");
    // Tile 1 is columns 0..14, tile 2 columns 14..28 (G plane, row 5, column 3).
    let at = |t: usize, c: usize, y: usize, x: usize| v[t * tile + c * 196 + y * 14 + x];
    assert_eq!((at(1, 0, 5, 3), at(1, 1, 5, 3)), (5.0, 3.0));
    assert_eq!((at(2, 0, 5, 3), at(2, 1, 5, 3)), (5.0, 17.0));
    assert_eq!(at(2, 2, 0, 0), 7.0);
    // A 10 x 28 image goes into the same pinpoint, 10 rows high, 2 black rows above.
    let small = Rgb8 {
        width: 28,
        height: 10,
        data: [200u8, 100, 50].repeat(280),
    };
    let v = g.pixel_values(&small);
    assert_eq!(v.len(), 3 * tile);
    let at = |t: usize, c: usize, y: usize, x: usize| v[t * tile + c * 196 + y * 14 + x];
    assert_eq!(
        (at(1, 0, 1, 0), at(1, 0, 2, 0), at(2, 2, 11, 13)),
        (0.0, 200.0, 50.0)
    );
    assert_eq!(at(2, 0, 12, 5), 0.0);
    assert_eq!(patch_output_size(10, 28, 14, 28), (10, 28));
    // 45 x 77 into 28 x 28: the width limits (28), the height ceil(45 x 28 / 77) = 17.
    assert_eq!(patch_output_size(45, 77, 28, 28), (17, 28));
}
