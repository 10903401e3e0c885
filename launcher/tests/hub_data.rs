//! Datasets from the Hugging Face cache and from Arrow tables: Parquet shards of a hub
//! dataset repository (split and subset chosen as `datasets` does), a Parquet file and a
//! `save_to_disk` directory as `dataset.path`, each row equal, token for token and label
//! for label, to what transformers' tokenizer and chat template make of the record
//! (scripts/make_data_fixtures.py writes the cache with pyarrow); `dataset.val_size` holds
//! out the samples `mt::data::held_out` names.

use std::path::{Path, PathBuf};
use std::sync::Once;

mod common;

use common::*;
use mt::config::{DatasetSection, Stage};
use mt::data::{Dataset, Example};

/// The data fixtures, with `HF_HUB_CACHE` pointing at their hub cache. Every test calls
/// this first, so the variable is set before any test thread reads the environment.
fn fixtures() -> PathBuf {
    static CACHE: Once = Once::new();
    let dir = data_fixtures("hub");
    // SAFETY: set once, while every other test of this binary waits on the `Once`.
    CACHE.call_once(|| unsafe { std::env::set_var("HF_HUB_CACHE", dir.join("hub")) });
    dir
}

fn load(yaml: &str) -> mt::error::Result<Dataset> {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny");
    let ds: DatasetSection = serde_yaml_ng::from_str(yaml).unwrap();
    ds.validate()?;
    Dataset::load(&ds, Stage::Sft, &tiny, 512, 0)
}

fn expected(name: &str) -> Vec<(Vec<i32>, Vec<i32>)> {
    expected_rows(&fixtures(), name)
}

fn assert_rows(what: &str, rows: &[Example], want: &[(Vec<i32>, Vec<i32>)]) {
    assert_eq!(rows.len(), want.len(), "{what}: rows");
    for (i, (row, (ids, labels))) in rows.iter().zip(want).enumerate() {
        assert_eq!(&row.input_ids, ids, "{what} record {i}: input_ids");
        assert_eq!(&row.labels, labels, "{what} record {i}: labels");
    }
}

fn registry(extra: &str) -> String {
    format!(
        "dataset_dir: {}, shuffle: false{extra}",
        fixtures().display()
    )
}

#[test]
fn hub_parquet_shards_equal_transformers_rows() {
    let alpaca = expected("alpaca_demo");
    let train = load(&format!(
        "{{name: alpaca_hub, {}}}",
        registry(", system_prompt: Be exact.")
    ))
    .unwrap();
    assert_eq!(train.files.len(), 2, "two train shards: {:?}", train.files);
    assert!(train.files.iter().all(|f| f.to_string_lossy().contains(
        "datasets--mt-test--alpaca-mini/snapshots/a1b2c3d4e5f60718293a4b5c6d7e8f9012345678/data/train-"
    )));
    assert_rows("alpaca_hub", &train.rows, &alpaca[..200]);
    let test = load(&format!(
        "{{name: alpaca_hub_test, {}}}",
        registry(", system_prompt: Be exact.")
    ))
    .unwrap();
    assert_rows("alpaca_hub split test", &test.rows, &alpaca[200..]);
    let chat = load(&format!("{{name: sharegpt_hub, {}}}", registry(""))).unwrap();
    assert_rows(
        "sharegpt_hub subset chat",
        &chat.rows,
        &expected("sharegpt_demo"),
    );
}

#[test]
fn parquet_file_and_save_to_disk_directory_as_dataset_path() {
    let alpaca = expected("alpaca_demo");
    for path in ["alpaca.parquet", "saved_alpaca"] {
        let d = load(&format!(
            "{{format: alpaca, path: {}, shuffle: false, system_prompt: Be exact.}}",
            fixtures().join(path).display()
        ))
        .unwrap();
        assert_rows(path, &d.rows, &alpaca);
    }
}

#[test]
fn val_size_holds_out_the_seeded_samples() {
    let alpaca = expected("alpaca_demo");
    let yaml = |val: &str| {
        format!(
            "{{name: alpaca_hub, {}}}",
            registry(&format!(", system_prompt: Be exact., val_size: {val}"))
        )
    };
    for (val, k) in [("0.1", 20), ("7", 7)] {
        let d = load(&yaml(val)).unwrap();
        let held = mt::data::held_out(200, k, 0);
        let want_eval: Vec<_> = (0..200)
            .filter(|&i| held[i])
            .map(|i| alpaca[i].clone())
            .collect();
        let want_train: Vec<_> = (0..200)
            .filter(|&i| !held[i])
            .map(|i| alpaca[i].clone())
            .collect();
        assert_rows(&format!("val_size {val}: eval"), &d.eval, &want_eval);
        assert_rows(&format!("val_size {val}: train"), &d.rows, &want_train);
        assert!(
            d.summary()
                .contains(&format!("eval set: {k} samples held out"))
        );
    }
}

#[test]
fn eval_name_reads_its_own_registry_entry() {
    let alpaca = expected("alpaca_demo");
    let d = load(&format!(
        "{{name: alpaca_hub, eval_name: alpaca_hub_test, {}}}",
        registry(", system_prompt: Be exact.")
    ))
    .unwrap();
    assert_rows("eval_name", &d.eval, &alpaca[200..]);
    assert_eq!(d.rows.len(), 200);
}

#[test]
fn a_dataset_missing_from_the_cache_says_where_it_looked_and_how_to_download() {
    let e = load(&format!("{{name: missing_hub, {}}}", registry("")))
        .unwrap_err()
        .to_string();
    for needle in [
        "dataset.name (missing_hub)",
        "datasets--mt-test--not-downloaded",
        "hf download --repo-type dataset mt-test/not-downloaded",
        "huggingface-cli download --repo-type dataset mt-test/not-downloaded",
    ] {
        assert!(e.contains(needle), "{needle:?} not in: {e}");
    }
    let e = load(&format!(
        "{{name: alpaca_hub, eval_name: missing_hub, {}}}",
        registry("")
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("dataset.eval_name (missing_hub)"), "{e}");
}
