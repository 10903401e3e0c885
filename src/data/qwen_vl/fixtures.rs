//! The multimodal records of scripts/make_vlm_fixtures.py (under `$MT_DATA_FIXTURES/vlm`),
//! read, their images expanded and rendered with the fixture tokenizer, against
//! transformers' Qwen2VLProcessor and Qwen3VLProcessor (Qwen3-VL's and Qwen3.5's) token for
//! token; and the records' errors.

use std::path::{Path, PathBuf};

use super::QwenVlImages;
use crate::data::ChatTokenizer;
use crate::data::records::{Schema, split_records};
use crate::data::registry;

fn fixtures() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MT_DATA_FIXTURES")?).join("vlm");
    dir.join("expected_qwen2vl.jsonl").exists().then_some(dir)
}

fn schema(dir: &Path) -> Schema {
    let r = registry::lookup(dir, "mllm_demo", "dataset.name").unwrap();
    Schema {
        format: r.format,
        columns: r.columns,
        tags: r.tags,
        default_system: None,
        media_dir: dir.to_path_buf(),
    }
}

#[test]
fn qwen2_vl_rows_equal_the_processors() {
    let Some(dir) = fixtures() else {
        eprintln!("no vlm data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    rows_equal_the_processors(&dir, "qwen2vl");
}

/// Qwen3-VL's processor: the same expansion, its settings (`size`, 16-pixel patches).
#[test]
fn qwen3_vl_rows_equal_the_processors() {
    let Some(dir) = fixtures() else {
        eprintln!("no vlm data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    assert!(
        dir.join("expected_qwen3vl.jsonl").is_file(),
        "stale vlm fixtures: rerun scripts/make_vlm_fixtures.py"
    );
    rows_equal_the_processors(&dir, "qwen3vl");
}

/// Qwen3.5's: AutoProcessor gives it Qwen3VLProcessor too (the fixture script checks
/// transformers' mappings), its settings those of the pixel fixtures' Qwen3-VL case, whose
/// `pixel_values` [`pixel_values_equal_the_processors`] holds ours to, but for the pixel
/// bounds (which only choose the size an image is resized to: the grids, checked here).
#[test]
fn qwen3_5_rows_equal_the_processors() {
    let Some(dir) = fixtures() else {
        eprintln!("no vlm data fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    assert!(
        dir.join("expected_qwen3_5.jsonl").is_file(),
        "stale vlm fixtures: rerun scripts/make_vlm_fixtures.py"
    );
    rows_equal_the_processors(&dir, "qwen3_5");
    let pixels = crate::data::image::pixel_fixtures_dir().expect("pixel fixtures beside");
    let ours = QwenVlImages::load(&dir.join("model-qwen3_5")).unwrap();
    let checked = QwenVlImages::load(&pixels.join("qwen3vl")).unwrap();
    let bounds = QwenVlImages {
        min_pixels: checked.min_pixels,
        max_pixels: checked.max_pixels,
        ..ours
    };
    assert_eq!(bounds, checked, "the pixel fixtures' settings");
}

/// The records through `model-{which}` equal `expected_{which}.jsonl`, the processor's.
fn rows_equal_the_processors(dir: &Path, which: &str) {
    let model = dir.join(format!("model-{which}"));
    let chat = ChatTokenizer::load(&model, None, true).unwrap();
    let images = QwenVlImages::load(&model).unwrap();
    let schema = schema(dir);
    let text = std::fs::read_to_string(dir.join("mllm.json")).unwrap();
    let recs = split_records(Path::new("mllm.json"), &text).unwrap();
    let expected: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.join(format!("expected_{which}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(recs.len(), expected.len());
    for (rec, want) in recs.iter().zip(&expected) {
        let mut conv = schema.conversation(rec).unwrap();
        let sizes: Vec<[u32; 2]> = conv
            .images
            .iter()
            .map(|im| [im.size.width, im.size.height])
            .collect();
        assert_eq!(
            serde_json::to_value(&sizes).unwrap(),
            want["sizes"],
            "line {}",
            rec.line
        );
        let grids: Vec<[u32; 3]> = conv
            .images
            .iter()
            .map(|im| {
                let g = images.grid(im.size.height, im.size.width).unwrap();
                [g.t, g.h, g.w]
            })
            .collect();
        assert_eq!(serde_json::to_value(&grids).unwrap(), want["grids"]);
        images.expand_conversation(&mut conv).unwrap();
        let ex = chat.example(&conv, false).unwrap();
        assert_eq!(
            serde_json::to_value(&ex.input_ids).unwrap(),
            want["input_ids"],
            "line {}",
            rec.line
        );
        assert_eq!(serde_json::to_value(&ex.labels).unwrap(), want["labels"]);
    }
}

#[test]
fn bad_image_records_name_line_and_key() {
    let Some(dir) = fixtures() else {
        return;
    };
    let schema = schema(&dir);
    let bad = |json: &str| {
        let rec = crate::data::records::RawRecord { line: 4, json };
        let e = schema.conversation(&rec).unwrap_err();
        (e.line, e.field, e.reason)
    };
    let msgs = r#""messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "yo"}]"#;
    let (line, field, reason) = bad(&format!(r#"{{{msgs}, "images": ["images/nope.png"]}}"#));
    assert_eq!((line, field.as_str()), (4, "images[0]"));
    assert!(reason.contains("not found"), "{reason}");
    let (_, field, reason) = bad(&format!(r#"{{{msgs}, "images": ["mllm.json"]}}"#));
    assert_eq!(field, "images[0]");
    assert!(reason.contains("not a PNG, JPEG or WebP"), "{reason}");
    let (_, field, reason) = bad(&format!(
        r#"{{{msgs}, "images": ["images/a.png", "images/b.jpg"]}}"#
    ));
    assert_eq!(field, "images");
    assert!(reason.contains("2 images, but 1 `<image>`"), "{reason}");
    let (_, field, reason) = bad(&format!(r#"{{{msgs}, "images": []}}"#));
    assert_eq!(field, "images");
    assert!(reason.contains("0 images, but 1"), "{reason}");
    // A well-formed record with images: refused, fatally, by the text-only model.
    let json = format!(r#"{{{msgs}, "images": ["images/a.png"]}}"#);
    let rec = crate::data::records::RawRecord {
        line: 9,
        json: &json,
    };
    let conv = schema.conversation(&rec).unwrap();
    use crate::data::read::{Images, no_images, why_no_images};
    let why = why_no_images(&Images::TextOnly).unwrap();
    let e = no_images(&conv, &rec, &schema, &why).unwrap_err();
    assert_eq!((e.line, e.field.as_str(), e.fatal), (9, "images", true));
    assert!(e.reason.contains("text-only"), "{}", e.reason);
    // A vision-language model without its processor settings: refused, naming the file.
    let missing = std::path::PathBuf::from("/m/preprocessor_config.json");
    let why = why_no_images(&Images::NoProcessor(missing)).unwrap();
    let e = no_images(&conv, &rec, &schema, &why).unwrap_err();
    assert!(
        e.reason.contains("/m/preprocessor_config.json"),
        "{}",
        e.reason
    );
    // A Qwen2-VL model takes them.
    assert!(why_no_images(&Images::Qwen(QwenVlImages::default())).is_none());
}

/// The largest difference allowed between our `pixel_values` and the processor's.
///
/// Derivation: the resize is Pillow's 8-bit bicubic convolution, which we follow step for
/// step (f64 weights from the same kernel, normalised, rounded to 22-bit fixed point,
/// integer sums, clipped); the only place the two can part is a weight whose f64
/// evaluation differs in its last bit (a compiler contracting the kernel's polynomial into
/// fused multiply-adds) landing on the other side of a fixed-point rounding, which moves
/// an output sample by at most one level. One level is 1/255 after the rescale, and
/// 1 / (255 x std) after normalising: 1 / (255 x 0.26130258) = 0.01501 on the smallest
/// std (G). The rescale and normalisation are the same f64/f32 IEEE operations in the
/// same order, exact. So: one level on the smallest std, plus f32 rounding of the
/// normalised value (|x| < 2.2, eps 2.4e-7). Qwen3-VL's std (0.5) makes a level 0.0078,
/// within the same bound.
const PIXEL_BOUND: f32 = (1.0 / (255.0 * 0.261_302_58_f64) + 1e-6) as f32;

#[test]
fn pixel_values_equal_the_processors() {
    use safetensors::SafeTensors;
    let Some(dir) = crate::data::image::pixel_fixtures_dir() else {
        eprintln!("no pixel fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let names = manifest["processed"].as_array().unwrap();
    assert!(names.len() >= 4);
    // Qwen2-VL's settings, then Qwen3-VL's (16-pixel patches, mean and std 0.5, `size`).
    for (settings, std_g, patch) in [
        (dir.clone(), 0.261_302_58_f64 as f32, 14),
        (dir.join("qwen3vl"), 0.5, 16),
    ] {
        let images = QwenVlImages::load(&settings).unwrap();
        assert_eq!((images.image_std[1], images.patch_size), (std_g, patch));
        let bytes = std::fs::read(settings.join("processor.safetensors")).unwrap();
        let want = SafeTensors::deserialize(&bytes).unwrap();
        let mut worst = 0f32;
        let mut differing = 0usize;
        for name in names {
            let name = name.as_str().unwrap();
            let img = crate::data::image::decode(&dir.join("images").join(name)).unwrap();
            let (grid, got) = images.pixel_values(&img);
            let g = want.tensor(&format!("{name}.grid")).unwrap();
            let g: Vec<i64> = g
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(g, [grid.t, grid.h, grid.w].map(i64::from), "{name}: grid");
            let pv = want.tensor(&format!("{name}.pixel_values")).unwrap();
            let rows = (grid.t * grid.h * grid.w) as usize;
            let row = 3 * 2 * patch as usize * patch as usize;
            assert_eq!(pv.shape(), [rows, row], "{name}: pixel_values");
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
        }
        eprintln!(
            "pixel_values ({}): largest difference {worst:e} ({differing} values differ), bound {PIXEL_BOUND:e}",
            settings.display()
        );
        assert!(worst <= PIXEL_BOUND, "largest difference {worst}");
    }
}

/// The multimodal records through to a micro-batch: each row's images, with their grids,
/// in the order of their tokens, and as many `<|image_pad|>` tokens in the row as the
/// grids make; packing keeps them in order.
#[test]
fn batches_carry_their_images() {
    let Some(dir) = fixtures() else {
        return;
    };
    let model = dir.join("model-qwen2vl");
    let chat = ChatTokenizer::load(&model, None, true).unwrap();
    let images = QwenVlImages::load(&model).unwrap();
    let [pad_id] = chat.encode(super::IMAGE_PAD).unwrap().0[..] else {
        unreachable!()
    };
    let schema = schema(&dir);
    let text = std::fs::read_to_string(dir.join("mllm.json")).unwrap();
    let recs = split_records(Path::new("mllm.json"), &text).unwrap();
    let rows: Vec<crate::data::Example> = recs
        .iter()
        .map(|rec| {
            let conv = schema.conversation(rec).unwrap();
            images.example(&chat, &conv, false).unwrap()
        })
        .collect();
    let mb = crate::data::pad_batch(&rows.iter().collect::<Vec<_>>(), 0);
    let got: Vec<(usize, String, [u32; 3])> = mb
        .images
        .iter()
        .map(|im| {
            let name = im.path.file_name().unwrap().to_string_lossy().into_owned();
            (im.row, name, im.grid)
        })
        .collect();
    let expected: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.join("expected_qwen2vl.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let names = [
        (0, "a.png"),
        (1, "b.jpg"),
        (1, "c.webp"),
        (2, "d.png"),
        (2, "e.jpg"),
    ];
    assert_eq!(got.len(), names.len());
    for ((row, name, grid), (want_row, want_name)) in got.iter().zip(names) {
        assert_eq!((*row, name.as_str()), (want_row, want_name));
        let i = got[..]
            .iter()
            .filter(|g| g.0 == *row && g.1 < *name)
            .count();
        assert_eq!(
            serde_json::to_value(grid).unwrap(),
            expected[*row]["grids"][i],
            "{name}"
        );
    }
    for r in 0..mb.rows {
        let ids = &mb.input_ids[r * mb.seq_len..(r + 1) * mb.seq_len];
        let pads = ids.iter().filter(|&&t| t as u32 == pad_id).count();
        let want: u32 = mb
            .images
            .iter()
            .filter(|im| im.row == r)
            .map(|im| im.grid.iter().product::<u32>() / 4)
            .sum();
        assert_eq!(pads, want as usize, "row {r}");
    }
    let json = serde_json::to_string(&mb).unwrap();
    assert_eq!(
        serde_json::from_str::<crate::data::MicroBatch>(&json).unwrap(),
        mb
    );
    // Packed into one row: the images follow, in order.
    let packed = crate::data::pack(rows.clone(), usize::MAX);
    assert_eq!(packed.len(), 1);
    let order: Vec<_> = packed[0].images.iter().map(|im| im.path.clone()).collect();
    let want: Vec<_> = rows
        .iter()
        .flat_map(|r| &r.images)
        .map(|im| im.path.clone())
        .collect();
    assert_eq!(order, want);
}
