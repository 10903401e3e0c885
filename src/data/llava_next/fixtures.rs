//! The multimodal records of scripts/make_vlm_fixtures.py rendered for a LLaVA-NeXT model
//! (scripts/make_vlm_llava_next_fixtures.py: the fixture tokenizer with `<image>` and a tiny
//! CLIP tower on 42-pixel tiles) against transformers' `LlavaNextProcessor`, token for token;
//! and the pixels against `LlavaNextImageProcessorPil`'s.

use std::path::PathBuf;

use super::LlavaNextImages;
use crate::data::ChatTokenizer;
use crate::data::records::{Schema, split_records};
use crate::data::registry;

fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MT_DATA_FIXTURES")?).join("vlm");
    dir.join("expected_llava_next.jsonl")
        .exists()
        .then_some(dir)
}

#[test]
fn llava_next_rows_equal_the_processors() {
    let Some(dir) = fixtures() else {
        eprintln!("no vlm data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let model = dir.join("model-llava_next");
    let chat = ChatTokenizer::load(&model, None, true).unwrap();
    let images = LlavaNextImages::of_model(&model)
        .unwrap()
        .expect("a llava_next model");
    let r = registry::lookup(&dir, "mllm_demo", "dataset.name").unwrap();
    let schema = Schema {
        format: r.format,
        columns: r.columns,
        tags: r.tags,
        default_system: None,
        media_dir: dir.clone(),
    };
    let text = std::fs::read_to_string(dir.join("mllm.json")).unwrap();
    let recs = split_records(std::path::Path::new("mllm.json"), &text).unwrap();
    let expected: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.join("expected_llava_next.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(recs.len(), expected.len());
    let mut with_images = 0;
    for (rec, want) in recs.iter().zip(&expected) {
        let conv = schema.conversation(rec).unwrap();
        let ex = match conv.images.is_empty() {
            true => chat.example(&conv, false).unwrap(),
            false => images.example(&chat, &conv, false).unwrap(),
        };
        with_images += usize::from(!conv.images.is_empty());
        let line = rec.line;
        assert_eq!(
            serde_json::to_value(&ex.input_ids).unwrap(),
            want["input_ids"],
            "line {line}"
        );
        assert_eq!(
            serde_json::to_value(&ex.labels).unwrap(),
            want["labels"],
            "line {line}"
        );
        // Each image's (height, width) and token count, as the processor has them.
        let sizes: Vec<[u32; 2]> = ex
            .images
            .iter()
            .map(|im| [im.grid[1], im.grid[2]])
            .collect();
        assert_eq!(
            serde_json::to_value(&sizes).unwrap(),
            want["image_sizes"],
            "line {line}"
        );
        let counts: Vec<usize> = sizes
            .iter()
            .map(|&[h, w]| images.spec.image_tokens(h, w))
            .collect();
        assert_eq!(
            serde_json::to_value(&counts).unwrap(),
            want["image_tokens"],
            "line {line}"
        );
    }
    assert_eq!(with_images, 3);
}

/// The largest difference allowed between our pixels and the processor's: as for Qwen's
/// (src/data/qwen_vl/fixtures.rs, the derivation), the resizes are Pillow's 8-bit bicubic
/// convolution followed step for step, where only a weight whose f64 evaluation differs in
/// its last bit can move an output sample by one level: 1 / (255 x std) after normalising,
/// 0.01501 on CLIP's smallest std (G), plus f32 rounding of the normalised value (|x| < 2.2).
/// The padding (0) and the tiles' cuts are exact.
const PIXEL_BOUND: f32 = (1.0 / (255.0 * 0.261_302_58_f64) + 1e-6) as f32;

#[test]
fn llava_next_pixel_values_equal_the_processors() {
    use safetensors::SafeTensors;
    let Some(dir) = crate::data::image::pixel_fixtures_dir() else {
        eprintln!("no pixel fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let ln = dir.join("llava_next");
    let images = LlavaNextImages::of_model(&ln)
        .unwrap()
        .expect("a llava_next config");
    assert_eq!(images.spec.image_size, 112);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let bytes = std::fs::read(ln.join("processor.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let (mut worst, mut differing, mut total) = (0f32, 0usize, 0usize);
    for name in manifest["processed"].as_array().unwrap() {
        let name = name.as_str().unwrap();
        let img = crate::data::image::decode(&dir.join("images").join(name)).unwrap();
        let size = want.tensor(&format!("{name}.image_size")).unwrap();
        let size: Vec<i64> = size
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(
            size,
            [i64::from(img.height), i64::from(img.width)],
            "{name}"
        );
        let got = images.pixel_values(&img);
        let pv = want.tensor(&format!("{name}.pixel_values")).unwrap();
        let tiles = images.spec.tiles(img.height, img.width);
        assert_eq!(pv.shape(), [tiles, 3, 112, 112], "{name}");
        let pv: Vec<f32> = pv
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got.len(), pv.len(), "{name}");
        for (a, b) in got.iter().zip(&pv) {
            let d = (a - b).abs();
            worst = worst.max(d);
            differing += usize::from(d > 0.0);
        }
        total += pv.len();
    }
    eprintln!(
        "llava_next pixel_values: largest difference {worst:e} ({differing} of {total} values differ), bound {PIXEL_BOUND:e}"
    );
    assert!(worst <= PIXEL_BOUND, "largest difference {worst}");
}
