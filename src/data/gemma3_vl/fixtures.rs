//! The multimodal records of scripts/make_vlm_fixtures.py rendered for a Gemma 3 model
//! (scripts/make_vlm_gemma3_fixtures.py: the fixture tokenizer with Gemma 3's image tokens
//! and chat template) against transformers' `Gemma3Processor`, token for token; and the
//! pixels against `Gemma3ImageProcessorPil`'s.

use std::path::PathBuf;

use super::Gemma3Images;
use crate::data::ChatTokenizer;
use crate::data::records::{Schema, split_records};
use crate::data::registry;

fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MT_DATA_FIXTURES")?).join("vlm");
    dir.join("expected_gemma3.jsonl").exists().then_some(dir)
}

#[test]
fn gemma3_rows_equal_the_processors() {
    let Some(dir) = fixtures() else {
        eprintln!("no vlm data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let model = dir.join("model-gemma3");
    let chat = ChatTokenizer::load(&model, None, true).unwrap();
    let images = Gemma3Images::of_model(&model)
        .unwrap()
        .expect("a gemma3 model");
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
        std::fs::read_to_string(dir.join("expected_gemma3.jsonl"))
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
        assert_eq!(ex.images.len(), conv.images.len());
        assert!(ex.images.iter().all(|im| im.grid == [1, 8, 8]));
    }
    assert_eq!(with_images, 3);
}

/// The largest difference allowed between our pixels and the processor's: as for Qwen's
/// (src/data/qwen_vl/fixtures.rs), the resize is Pillow's fixed-point convolution followed
/// step for step (here the bilinear kernel, support 1), where only a weight whose f64
/// evaluation differs in its last bit can move an 8-bit output by one level; one level is
/// 1 / (255 x std) = 1 / 127.5 after normalising with std 0.5, plus f32 rounding of a value
/// below 1 in magnitude (eps 1.2e-7).
const PIXEL_BOUND: f32 = (1.0 / (255.0 * 0.5) + 1e-6) as f32;

#[test]
fn gemma3_pixel_values_equal_the_processors() {
    use safetensors::SafeTensors;
    let Some(dir) = crate::data::image::pixel_fixtures_dir() else {
        eprintln!("no pixel fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let g3 = dir.join("gemma3");
    let images = Gemma3Images::of_model(&g3)
        .unwrap()
        .expect("a gemma3 config");
    assert_eq!((images.height, images.width), (224, 224));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let bytes = std::fs::read(g3.join("processor.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let (mut worst, mut differing, mut total) = (0f32, 0usize, 0usize);
    for name in manifest["processed"].as_array().unwrap() {
        let name = name.as_str().unwrap();
        let img = crate::data::image::decode(&dir.join("images").join(name)).unwrap();
        let got = images.pixel_values(&img);
        let pv = want.tensor(&format!("{name}.pixel_values")).unwrap();
        assert_eq!(pv.shape(), [3, 224, 224], "{name}");
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
        "gemma3 pixel_values: largest difference {worst:e} ({differing} of {total} values differ), bound {PIXEL_BOUND:e}"
    );
    assert!(worst <= PIXEL_BOUND, "largest difference {worst}");
}
