//! Preference pairs (`training.stage: dpo`) against rows computed in Python
//! (scripts/make_data_fixtures.py): LlamaFactory's ranking records, alpaca (with system
//! prompts and history) and sharegpt (multi-turn prompts), each become two rows, prompt +
//! chosen and prompt + rejected, equal token for token and label for label to
//! transformers' `apply_chat_template` labelled on the answer alone, with the tiny ChatML
//! template and a second template; bad ranking input is an error naming the dataset, file,
//! line and key.

use std::path::{Path, PathBuf};

mod common;

use common::*;
use mt::config::{DatasetSection, Stage};
use mt::data::Dataset;

const VOCAB: usize = 514;

fn fixtures() -> PathBuf {
    data_fixtures("expected_dpo_alpaca.jsonl")
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

#[test]
fn ranking_records_become_pairs_of_rows_equal_to_transformers() {
    for (set, expected, model_name, pairs) in [
        ("dpo_alpaca", "dpo_alpaca", "tiny", 48),
        ("dpo_sharegpt", "dpo_sharegpt", "tiny", 30),
        ("dpo_sharegpt", "dpo_sharegpt_template2", "template2", 30),
    ] {
        let what = format!("{set} with {model_name}");
        let data = load(&registry(set, ""), Stage::Dpo, model_name).unwrap();
        let want = expected_rows(&fixtures(), expected);
        assert_eq!(want.len(), 2 * pairs, "{what}: expected rows");
        assert_eq!(data.skipped.count, 0, "{what}: {:?}", data.skipped);
        assert!(data.pairs, "{what}");
        assert_eq!(
            (data.samples, data.rows.len()),
            (pairs, 2 * pairs),
            "{what}"
        );
        for (i, (row, (ids, labels))) in data.rows.iter().zip(&want).enumerate() {
            assert_eq!(&row.input_ids, ids, "{what} row {i}: input_ids");
            assert_eq!(&row.labels, labels, "{what} row {i}: labels");
        }
        // The two rows of a pair share their prompt and differ in the answer.
        for p in data.rows.chunks(2) {
            let prompt =
                |r: &mt::data::Example| r.labels.iter().take_while(|&&l| l == -100).count();
            assert_eq!(prompt(&p[0]), prompt(&p[1]), "{what}");
            assert_ne!(p[0].input_ids, p[1].input_ids, "{what}");
        }
        assert!(
            data.summary()
                .contains(&format!("{pairs} preference pairs ({} rows)", 2 * pairs)),
            "{}",
            data.summary()
        );
    }
}

fn scratch_file(name: &str, text: &str) -> PathBuf {
    let dir = scratch(&format!("dpo-data-{name}"));
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn err(yaml: &str, stage: Stage) -> String {
    load(yaml, stage, "tiny").unwrap_err().to_string()
}

#[test]
fn bad_ranking_input_names_dataset_file_line_and_key() {
    // An alpaca ranking record without `rejected` (line 3 of a JSON array).
    let p = scratch_file(
        "pairs.json",
        "[\n {\"instruction\": \"Add 2 and 3.\", \"chosen\": \"5\", \"rejected\": \"6\"},\n {\"instruction\": \"Add 1 and 1.\", \"chosen\": \"2\"}\n]\n",
    );
    let e = err(
        &format!("{{path: {}, strict: true}}", p.display()),
        Stage::Dpo,
    );
    assert!(
        e.contains("pairs.json")
            && e.contains("line 3")
            && e.contains("field `rejected`")
            && e.contains("ranking record"),
        "{e}"
    );
    // Without `strict` the pair is skipped and counted.
    let d = load(&format!("{{path: {}}}", p.display()), Stage::Dpo, "tiny").unwrap();
    assert_eq!((d.samples, d.rows.len(), d.skipped.count), (1, 2, 1));
    assert!(
        d.skipped.first[0].contains(":3: field `rejected`"),
        "{:?}",
        d.skipped
    );
    // A sharegpt ranking conversation must end with the prompt; an answer is the assistant's.
    let p = scratch_file(
        "pairs.jsonl",
        concat!(
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}, {\"from\": \"gpt\", \"value\": \"Hello\"}], ",
            "\"chosen\": {\"from\": \"gpt\", \"value\": \"a\"}, \"rejected\": {\"from\": \"gpt\", \"value\": \"b\"}}\n",
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}], ",
            "\"chosen\": {\"from\": \"human\", \"value\": \"a\"}, \"rejected\": {\"from\": \"gpt\", \"value\": \"b\"}}\n",
            "{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}], \"chosen\": \"a\", ",
            "\"rejected\": {\"from\": \"gpt\", \"value\": \"b\"}}\n",
        ),
    );
    let d = load(
        &format!("{{path: {}, format: sharegpt}}", p.display()),
        Stage::Dpo,
        "tiny",
    )
    .unwrap_err()
    .to_string();
    assert!(d.contains("no usable records (3 skipped"), "{d}");
    for (line, field, why) in [
        (1, "conversations", "ends with the prompt"),
        (2, "chosen.from", "not `human`"),
        (3, "chosen", "expected one message"),
    ] {
        // Strict stops at the first bad record: each alone, on its own line number.
        let text = std::fs::read_to_string(&p).unwrap();
        let only: Vec<&str> = text
            .lines()
            .enumerate()
            .map(|(i, l)| if i + 1 == line { l } else { "" })
            .collect();
        let one = scratch_file(&format!("pair{line}.jsonl"), &only.join("\n"));
        let e = err(
            &format!(
                "{{path: {}, format: sharegpt, strict: true}}",
                one.display()
            ),
            Stage::Dpo,
        );
        assert!(
            e.contains(&format!("pair{line}.jsonl"))
                && e.contains(&format!("line {line}"))
                && e.contains(&format!("field `{field}`"))
                && e.contains(why),
            "line {line}: {e}"
        );
    }
    // Tokenized pairs need both rows.
    let p = scratch_file(
        "pairs_tok.jsonl",
        "{\"chosen_input_ids\": [1, 2, 3], \"chosen_labels\": [-100, 2, 3]}\n",
    );
    let e = err(
        &format!("{{path: {}, format: tokenized, strict: true}}", p.display()),
        Stage::Dpo,
    );
    assert!(
        e.contains("pairs_tok.jsonl") && e.contains("line 1") && e.contains("rejected_input_ids"),
        "{e}"
    );
}

#[test]
fn stages_refuse_the_other_kind_of_dataset_by_name() {
    let e = err(
        &format!(
            "{{name: alpaca_demo, dataset_dir: {}}}",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../data")
                .display()
        ),
        Stage::Dpo,
    );
    assert!(
        e.contains("dataset.name")
            && e.contains("`alpaca_demo`")
            && e.contains("not a ranking dataset")
            && e.contains("\"ranking\": true"),
        "{e}"
    );
    for stage in [Stage::Sft, Stage::Pt] {
        let e = err(&registry("dpo_alpaca", ""), stage);
        assert!(
            e.contains("`dpo_alpaca`")
                && e.contains("ranking dataset")
                && e.contains(&format!("training.stage: {}", stage.as_str())),
            "{e}"
        );
    }
}
