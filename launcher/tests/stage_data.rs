//! Data of the training stages beyond plain SFT, against rows computed in Python
//! (scripts/make_data_fixtures.py):
//! - `training.stage: pt`: documents from .txt, JSONL, Parquet and a hub subset equal
//!   LlamaFactory's pretraining rule applied with transformers' tokenizer (with and without
//!   a tokenizer that adds a BOS; unpacked and packed into blocks), token for token;
//! - tool-calling sharegpt records (`function_call`, `observation`, `tools`) equal what
//!   transformers' `apply_chat_template(messages, tools=...)` renders with the Qwen2.5,
//!   Llama 3.1 and Mistral v0.3 templates, labels on the calls and answers only;
//! - the bad inputs these add are errors naming the dataset, file, line and key.

use std::path::{Path, PathBuf};
use std::sync::Once;

mod common;

use common::*;
use mt::config::{DatasetSection, Stage};
use mt::data::{Dataset, Example, IGNORE_INDEX};

/// Token ids of the fixtures' models: the tiny vocabulary and up to two added special
/// tokens (`<|end_of_text|>`; Llama's and Mistral's bos and eos).
const VOCAB: usize = 514;

/// The data fixtures, with `HF_HUB_CACHE` pointing at their hub cache. Every test calls
/// this first, so the variable is set before any test thread reads the environment.
fn fixtures() -> PathBuf {
    static CACHE: Once = Once::new();
    let dir = data_fixtures("expected_pt_tiny_docs.jsonl");
    // SAFETY: set once, while every other test of this binary waits on the `Once`.
    CACHE.call_once(|| unsafe { std::env::set_var("HF_HUB_CACHE", dir.join("hub")) });
    dir
}

fn model(name: &str) -> PathBuf {
    match name {
        "tiny" => Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny"),
        other => fixtures().join(format!("model-{other}")),
    }
}

fn load(yaml: &str, stage: Stage, model_name: &str) -> mt::error::Result<Dataset> {
    let ds: DatasetSection = serde_yaml_ng::from_str(yaml).unwrap();
    ds.validate()?;
    Dataset::load(&ds, stage, &model(model_name), VOCAB, 0)
}

fn registry(name: &str, extra: &str) -> String {
    format!(
        "{{name: {name}, dataset_dir: {}, shuffle: false{extra}}}",
        fixtures().display()
    )
}

fn assert_rows(what: &str, data: &Dataset, expected: &str) {
    let want = expected_rows(&fixtures(), expected);
    assert_eq!(data.skipped.count, 0, "{what}: {:?}", data.skipped);
    assert_eq!(data.rows.len(), want.len(), "{what}: rows");
    for (i, (row, (ids, labels))) in data.rows.iter().zip(&want).enumerate() {
        assert_eq!(&row.input_ids, ids, "{what} row {i}: input_ids");
        assert_eq!(&row.labels, labels, "{what} row {i}: labels");
    }
}

#[test]
fn pt_documents_equal_llamafactory_rule_in_every_container() {
    let parquet = fixtures().join("pt_demo.parquet");
    let sources = [
        registry("pt_txt", ""),
        registry("pt_jsonl", ""),
        registry("pt_hub", ""),
        format!("{{path: {}, shuffle: false}}", parquet.display()),
    ];
    for model_name in ["tiny", "bos"] {
        for src in &sources {
            let body = &src[1..src.len() - 1];
            let docs = load(
                &format!("{{{body}, max_seq_len: 64}}"),
                Stage::Pt,
                model_name,
            )
            .unwrap();
            let what = format!("{model_name} {body} unpacked");
            assert_rows(&what, &docs, &format!("pt_{model_name}_docs"));
            assert_eq!(docs.samples, 48);
            let blocks = load(
                &format!("{{{body}, max_seq_len: 64, packing: true}}"),
                Stage::Pt,
                model_name,
            )
            .unwrap();
            assert_rows(
                &format!("{model_name} {body} packed"),
                &blocks,
                &format!("pt_{model_name}_packed"),
            );
            assert!(blocks.rows.iter().all(|r| r.position_ids.is_empty()));
            assert!(
                blocks
                    .summary()
                    .contains("concatenated into 37 blocks of 64 tokens"),
                "{}",
                blocks.summary()
            );
        }
    }
}

#[test]
fn pt_eval_documents_are_cut_into_blocks_too() {
    let d = load(
        &registry("pt_txt", ", max_seq_len: 32, packing: true, val_size: 8"),
        Stage::Pt,
        "tiny",
    )
    .unwrap();
    assert!(!d.eval.is_empty());
    assert!(
        d.rows
            .iter()
            .chain(&d.eval)
            .all(|r| r.input_ids.len() == 32)
    );
    assert!(d.rows.iter().all(|r: &Example| r.labels == r.input_ids));
}

#[test]
fn tool_calls_equal_transformers_templates() {
    for (set, model_name) in [
        ("tools_multi", "qwen25"),
        ("tools_single", "qwen25"),
        ("tools_single", "llama31"),
        ("tools_multi", "mistral"),
    ] {
        let data = load(&registry(set, ""), Stage::Sft, model_name).unwrap();
        assert_rows(
            &format!("{set} {model_name}"),
            &data,
            &format!("{set}_{model_name}"),
        );
        assert!(data.rows.iter().all(|r| r.labels.contains(&IGNORE_INDEX)));
    }
}

#[test]
fn several_calls_in_one_turn_are_refused_where_the_template_refuses_them() {
    let data = load(&registry("tools_multi", ""), Stage::Sft, "llama31").unwrap();
    assert_eq!(data.skipped.count, 3, "{:?}", data.skipped);
    assert!(
        data.skipped.first[0].contains("This model only supports single tool-calls at once!"),
        "{:?}",
        data.skipped
    );
}

#[test]
fn a_template_without_tools_given_tools_is_an_error_naming_both() {
    let e = load(&registry("tools_single", ""), Stage::Sft, "tiny")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dataset `tools_single`")
            && e.contains("configs/tiny/tokenizer_config.json")
            && e.contains("no tool support"),
        "{e}"
    );
}

fn scratch_file(name: &str, text: &str) -> PathBuf {
    let dir = scratch(&format!("stage-data-{name}"));
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn bad_pt_and_tool_records_name_file_line_and_key() {
    let p = scratch_file(
        "corpus.jsonl",
        "{\"text\": \"A document.\"}\n{\"body\": \"no text column\"}\n",
    );
    let yaml = format!("{{path: {}, strict: true}}", p.display());
    let e = load(&yaml, Stage::Pt, "tiny").unwrap_err().to_string();
    assert!(
        e.contains("corpus.jsonl") && e.contains("line 2") && e.contains("field `text`"),
        "{e}"
    );
    assert!(e.contains("training.stage: pt"), "{e}");
    let p = scratch_file(
        "calls.jsonl",
        concat!(
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Tip?\"}, ",
            "{\"from\": \"function_call\", \"value\": \"{\\\"name\\\": \\\"tip\\\", \"}, ",
            "{\"from\": \"observation\", \"value\": \"1\"}, {\"from\": \"gpt\", \"value\": \"1\"}]}\n"
        ),
    );
    let yaml = format!("{{path: {}, format: sharegpt, strict: true}}", p.display());
    let e = load(&yaml, Stage::Sft, "qwen25").unwrap_err().to_string();
    assert!(
        e.contains("calls.jsonl")
            && e.contains("line 1")
            && e.contains("field `conversations[1].value`")
            && e.contains("function_call"),
        "{e}"
    );
}

#[test]
fn datasets_a_stage_cannot_train_on_are_refused_by_name() {
    for stage in [Stage::Sft, Stage::Pt] {
        let e = load(&registry("ranking_demo", ""), stage, "tiny")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dataset.name")
                && e.contains("`ranking_demo`")
                && e.contains("ranking")
                && e.contains(&format!("training.stage: {}", stage.as_str())),
            "{e}"
        );
    }
    let e = load(&registry("pt_txt", ""), Stage::Sft, "tiny")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pt_demo.txt") && e.contains("training.stage: pt"),
        "{e}"
    );
    let e = load(&registry("sharegpt_demo", ""), Stage::Pt, "tiny")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`sharegpt_demo`") && e.contains("plain text"),
        "{e}"
    );
}
