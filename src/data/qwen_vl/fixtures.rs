//! The multimodal records of scripts/make_vlm_fixtures.py (under `$MT_DATA_FIXTURES/vlm`),
//! read, their images expanded and rendered with the fixture tokenizer, against
//! transformers' Qwen2VLProcessor token for token; and the records' errors.

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
    let model = dir.join("model-qwen2vl");
    let chat = ChatTokenizer::load(&model, None, true).unwrap();
    let images = QwenVlImages::load(&model).unwrap();
    let schema = schema(&dir);
    let text = std::fs::read_to_string(dir.join("mllm.json")).unwrap();
    let recs = split_records(Path::new("mllm.json"), &text).unwrap();
    let expected: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.join("expected_qwen2vl.jsonl"))
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
    let e = crate::data::text_only(&conv, &rec, &schema).unwrap_err();
    assert_eq!((e.line, e.field.as_str(), e.fatal), (9, "images", true));
    assert!(e.reason.contains("text-only"), "{}", e.reason);
}
