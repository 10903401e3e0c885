//! Text datasets through the real tokenizer and chat template: every row of the alpaca and
//! sharegpt demo sets (from the dataset_info.json registry) equals, token for token and
//! label for label, what transformers' tokenizer and `apply_chat_template` make of it
//! (scripts/make_data_fixtures.py); bad records are counted or, with `strict`, named.

use std::path::{Path, PathBuf};

mod common;

use common::*;
use mt::config::{DatasetSection, Stage};
use mt::data::{Dataset, IGNORE_INDEX};

fn fixtures() -> PathBuf {
    data_fixtures("dataset_info.json")
}

fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny")
}

fn load(yaml: &str) -> mt::error::Result<Dataset> {
    load_with(yaml, &tiny_model())
}

/// The rows of `yaml` with `model`'s tokenizer; its vocabulary: the tiny model's 512 ids and
/// the special tokens the built-in templates' fixtures add after them.
fn load_with(yaml: &str, model: &Path) -> mt::error::Result<Dataset> {
    let ds: DatasetSection = serde_yaml_ng::from_str(yaml).unwrap();
    ds.validate()?;
    Dataset::load(&ds, Stage::Sft, model, 520, 0)
}

fn expected(name: &str) -> Vec<(Vec<i32>, Vec<i32>)> {
    expected_rows(&fixtures(), name)
}

fn check(name: &str, extra: &str) {
    check_with(name, extra, &tiny_model(), name);
}

fn check_with(name: &str, extra: &str, model: &Path, expected_name: &str) {
    let dir = fixtures();
    let yaml = format!(
        "{{name: {name}, dataset_dir: {}, shuffle: false{extra}}}",
        dir.display()
    );
    let data = load_with(&yaml, model).unwrap();
    let want = expected(expected_name);
    assert_eq!(data.skipped.count, 0, "{:?}", data.skipped);
    assert_eq!(data.rows.len(), want.len());
    for (i, (row, (ids, labels))) in data.rows.iter().zip(&want).enumerate() {
        assert_eq!(&row.input_ids, ids, "{name} record {i}: input_ids");
        assert_eq!(&row.labels, labels, "{name} record {i}: labels");
        assert!(row.label_tokens() > 0);
        assert!(labels.contains(&IGNORE_INDEX), "prompt tokens are masked");
    }
}

#[test]
fn alpaca_rows_equal_transformers_chat_template() {
    check("alpaca_demo", ", system_prompt: Be exact.");
}

#[test]
fn sharegpt_rows_equal_transformers_chat_template() {
    check("sharegpt_demo", "");
}

#[test]
fn openai_style_tags_equal_transformers_chat_template() {
    check("openai_demo", "");
}

/// A template written with the constructs HF templates use (bos_token, `tools is not none`,
/// raise_exception, namespace, slicing, filters, Python string methods, loop variables,
/// whitespace control) renders as jinja2 renders it.
#[test]
fn hf_template_constructs_render_as_jinja2_does() {
    let model = fixtures().join("model-template2");
    check_with("sharegpt_demo", "", &model, "sharegpt_demo_template2");
}

/// Every built-in template (`dataset.chat_template: NAME`) renders the fixture's
/// conversations (system + user + assistant, multi-turn, none with a system prompt,
/// untrimmed contents) as LlamaFactory's template of that name does, token for token and
/// label for label: make_data_fixtures.py checks the text against strings written from
/// LlamaFactory's definitions and takes the ids from transformers' apply_chat_template
/// with the same template text. `qwen`'s model has a template of its own (replaced), the
/// others none (a base model).
#[test]
fn builtin_templates_render_as_llamafactory_and_tokenize_as_transformers() {
    for b in mt::config::chat_templates::BUILTINS {
        let model = fixtures().join(format!("model-builtin-{}", b.name));
        let extra = format!(", chat_template: {}", b.name);
        check_with(
            "builtin_chat",
            &extra,
            &model,
            &format!("builtin_chat_{}", b.name),
        );
        let data = load_with(
            &format!(
                "{{name: builtin_chat, dataset_dir: {}{extra}}}",
                fixtures().display()
            ),
            &model,
        )
        .unwrap();
        let note = data.template_note.unwrap();
        assert!(note.contains(&format!("built-in `{}`", b.name)), "{note}");
        assert_eq!(
            note.contains("not the model's own"),
            b.name == "qwen",
            "{note}"
        );
    }
}

/// A built-in template whose special tokens the tokenizer lacks is refused by name (Llama
/// 3's header tokens on the tiny Qwen-style tokenizer), and so is a value that is neither a
/// built-in name nor a file.
#[test]
fn builtin_template_of_another_family_or_unknown_is_refused() {
    let yaml = |t: &str| {
        format!(
            "{{name: builtin_chat, dataset_dir: {}, chat_template: {t}}}",
            fixtures().display()
        )
    };
    let e = load(&yaml("llama3")).unwrap_err().to_string();
    assert!(
        e.contains("dataset.chat_template") && e.contains("`<|start_header_id|>`"),
        "{e}"
    );
    let e = load(&yaml("qwen3")).unwrap_err().to_string();
    assert!(
        e.contains("dataset.chat_template") && e.contains("qwen, chatml, llama3"),
        "{e}"
    );
}

#[test]
fn train_on_prompt_labels_every_token() {
    let yaml = format!(
        "{{name: sharegpt_demo, dataset_dir: {}, train_on_prompt: true}}",
        fixtures().display()
    );
    for row in load(&yaml).unwrap().rows {
        assert_eq!(row.labels, row.input_ids);
    }
}

#[test]
fn bad_records_are_counted_or_named_when_strict() {
    let dir = std::env::temp_dir().join(format!("mt-data-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.jsonl");
    std::fs::write(
        &file,
        concat!(
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Add 1 and 2.\"}, {\"from\": \"gpt\", \"value\": \"3\"}]}\n",
            "{\"conversations\": []}\n",
            "{\"conversations\": [{\"from\": \"human\", \"value\": 5}]}\n",
            "{\"talk\": []}\n",
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Add 1 and 2, then explain at length.\"}, {\"from\": \"gpt\", \"value\": \"3\"}]}\n",
        ),
    )
    .unwrap();
    let base = format!(
        "format: sharegpt, path: {}, max_seq_len: 40, overlong: skip",
        file.display()
    );
    let data = load(&format!("{{{base}}}")).unwrap();
    assert_eq!(
        (data.rows.len(), data.skipped.count),
        (1, 4),
        "{:?}",
        data.skipped
    );
    let s = &data.skipped.first;
    assert!(
        s[0].ends_with(":2: field `conversations`: empty conversation"),
        "{s:?}"
    );
    assert!(
        s[1].ends_with(":3: field `conversations[0].value`: expected a string, found a number"),
        "{s:?}"
    );
    assert!(
        s[2].ends_with(":4: field `conversations`: missing"),
        "{s:?}"
    );
    assert!(
        s[3].contains(":5: ") && s[3].contains("longer than dataset.max_seq_len (40)"),
        "{s:?}"
    );
    let e = load(&format!("{{{base}, strict: true}}"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.jsonl") && e.contains("line 2") && e.contains("field `conversations`"),
        "{e}"
    );
}
