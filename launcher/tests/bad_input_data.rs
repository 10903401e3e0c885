//! Bad input of chat datasets (the tiny demo model's tokenizer and chat template, alpaca
//! records) and of packing, as tests/bad_input.rs does for the rest: each fails before
//! anything starts with an error naming the file, key or model type.

mod common;

use common::fixture::{Stage, fixture};
use common::*;

/// A fixture whose model is the tiny demo (random init, its tokenizer and chat template)
/// and whose dataset is `records` in alpaca format.
fn chat_fixture(name: &str, records: &str) -> common::fixture::Fixture {
    common::fixture::tiny_chat_fixture(name, "alpaca.json", records, None)
}

const ALPACA: &str = r#"[{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
 {"instruction": "Say hi.", "input": "", "output": "hi"}]"#;

#[test]
fn missing_tokenizer() {
    let f = chat_fixture("no-tokenizer", ALPACA);
    std::fs::remove_file(f.model.join("tokenizer.json")).unwrap();
    f.fails(&[], Stage::Start, &["tokenizer.json"]);
}

#[test]
fn strict_alpaca_record_missing_its_output() {
    let f = chat_fixture(
        "alpaca-field",
        r#"[{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
 {"instruction": "Say hi.", "input": ""}]"#,
    );
    f.fails(
        &["--set", "dataset.strict=true"],
        Stage::Start,
        &["alpaca.json", "output"],
    );
}

#[test]
fn unknown_dataset_name() {
    let f = chat_fixture("dataset-name", ALPACA);
    let yaml = std::fs::read_to_string(&f.config).unwrap();
    let dir = f.dir.display().to_string();
    std::fs::write(
        f.dir.join("dataset_info.json"),
        r#"{"alpaca_local": {"file_name": "alpaca.json", "formatting": "alpaca"}}"#,
    )
    .unwrap();
    let yaml = yaml.replace(
        &format!(
            "format: alpaca, path: {}",
            f.dir.join("alpaca.json").display()
        ),
        &format!("name: alpaca_locla, dataset_dir: {dir}"),
    );
    f.write_config(&yaml);
    f.fails(&[], Stage::Start, &["alpaca_locla", "dataset_info.json"]);
}

#[test]
fn sanity_the_chat_fixture_trains() {
    let f = chat_fixture("chat-ok", ALPACA);
    let out = common::mt_launch().args(f.args(&[])).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A base model (the tiny demo without its chat template) cannot render chat data: the
/// error names the keys that give a template and the built-in names; LlamaFactory's
/// `template: qwen` makes it train, the run says which template rendered the data, and the
/// exported model carries it.
#[test]
fn a_model_without_chat_template_trains_with_a_builtin_one() {
    let f = chat_fixture("no-template", ALPACA);
    std::fs::write(
        f.model.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[
            "dataset.chat_template",
            "`template`",
            "qwen, chatml, llama3, mistral, gemma, alpaca, default",
        ],
    );
    let out = common::mt_launch()
        .args(f.args(&["--set", "template=qwen"]))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("chat template: the built-in `qwen` (dataset.chat_template)"),
        "{stdout}"
    );
    // The exported model renders as it was trained.
    let qwen = mt::config::chat_templates::find("qwen").unwrap().source;
    assert_eq!(
        std::fs::read_to_string(f.out.join("chat_template.jinja")).unwrap(),
        qwen
    );
}

#[test]
fn packing_a_linear_attention_model() {
    let f = fixture("pack-linear");
    let hybrid = golden_dir().join("qwen3_next_hybrid_moe/model");
    for e in std::fs::read_dir(&hybrid).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, f.model.join(p.file_name().unwrap())).unwrap();
    }
    f.write_config(&f.yaml().replace(
        "shuffle: false}",
        "shuffle: false, packing: true, max_seq_len: 16}",
    ));
    f.fails(
        &[],
        Stage::Start,
        &["dataset.packing", "qwen3_next", "linear-attention"],
    );
}
