//! Bad input for the evaluation, logging and dataset-container keys (as tests/bad_input.rs
//! does for the rest): each fails before anything starts with an error naming the key or
//! file, and leaves nothing behind.

mod common;

use common::fixture::{Stage, fixture, path};

#[test]
fn unknown_report_to() {
    let f = fixture("report-to");
    f.fails(
        &["--set", "logging.report_to=[tensorboard, comet_ml]"],
        Stage::Start,
        &[
            "logging.report_to",
            "unknown tracker `comet_ml`",
            "expected none, tensorboard, wandb, mlflow, all",
        ],
    );
}

#[test]
fn val_size_out_of_range() {
    let f = fixture("val-size");
    for (v, needle) in [
        ("0", "must be a fraction in (0, 1) or a whole number"),
        ("1.5", "must be a fraction in (0, 1) or a whole number"),
        ("-0.1", "must be a fraction in (0, 1) or a whole number"),
        ("12", "holds out 12 of the 12 samples"),
    ] {
        f.fails(
            &["--set", &format!("dataset.val_size={v}")],
            Stage::Start,
            &["dataset.val_size", needle],
        );
    }
}

#[test]
fn val_size_with_a_separate_eval_set() {
    // Both in the file are refused; an override of one replaces the other.
    let f = fixture("val-and-eval");
    let yaml = f.yaml();
    let both = yaml.replacen(
        "shuffle: false}",
        &format!(
            "shuffle: false, val_size: 0.5, eval_path: {}}}",
            path(&f.data)
        ),
        1,
    );
    assert_ne!(yaml, both, "the fixture's dataset section moved: {yaml}");
    f.write_config(&both);
    f.fails(&[], Stage::Start, &["dataset.val_size", "not both"]);
}

#[test]
fn eval_steps_without_an_eval_set() {
    let f = fixture("eval-steps");
    f.fails(
        &["--set", "training.eval_steps=1"],
        Stage::Start,
        &["training.eval_steps", "needs an eval set"],
    );
}

#[test]
fn empty_eval_set() {
    let f = fixture("empty-eval");
    let eval = f.dir.join("eval.jsonl");
    std::fs::write(&eval, "\n").unwrap();
    f.fails(
        &["--set", &format!("dataset.eval_path={}", path(&eval))],
        Stage::Start,
        &[&path(&eval), "no usable records"],
    );
}

#[test]
fn corrupt_parquet_file() {
    let f = fixture("corrupt-parquet");
    let bad = f.dir.join("data.parquet");
    // A Parquet file cut short: its footer (and magic) are gone.
    std::fs::write(&bad, b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00").unwrap();
    for key in ["dataset.path", "dataset.eval_path"] {
        f.fails(
            &["--set", &format!("{key}={}", path(&bad))],
            Stage::Start,
            &[&path(&bad), "not a readable Parquet file"],
        );
    }
}

#[test]
fn save_to_disk_directory_of_several_splits() {
    let f = fixture("dataset-dict");
    let dict = f.dir.join("saved");
    std::fs::create_dir_all(dict.join("train")).unwrap();
    std::fs::write(
        dict.join("dataset_dict.json"),
        r#"{"splits": ["train", "test"]}"#,
    )
    .unwrap();
    f.fails(
        &["--set", &format!("dataset.path={}", path(&dict))],
        Stage::Start,
        &[&path(&dict), "DatasetDict", "splits: train, test"],
    );
}
