//! Bad configs and command lines fail before anything starts, with an error that names the
//! file, key or flag, and leave nothing behind.

mod common;

use common::*;

fn fails_with(yaml: &str, extra: &[&str], needles: &[&str]) {
    let dir = scratch(&format!("cfg-{:x}", yaml.len() * 131 + extra.len()));
    let cfg = dir.join("run.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let metrics = dir.join("metrics.jsonl");
    let mut args = vec![
        "--config",
        cfg.to_str().unwrap(),
        "--gpus",
        "0",
        "--metrics-out",
        metrics.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure for:\n{yaml}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    assert!(
        !metrics.exists(),
        "a failed start must not leave a metrics file"
    );
}

fn valid() -> String {
    let case = golden_dir().join("llama");
    format!(
        "model: {{path: {}, dtype: float32}}\ndataset: {{format: tokenized, path: {}}}\ntraining:\n  batch_size: 4\n  num_steps: 1\n",
        case.join("model").display(),
        case.join("data.jsonl").display()
    )
}

#[test]
fn malformed_yaml_is_reported_with_the_file() {
    fails_with(
        "model: {path: [unclosed\n",
        &[],
        &["malformed YAML", "run.yaml"],
    );
}

#[test]
fn unknown_key_is_named() {
    fails_with(
        &format!("{}  batch_sise: 3\n", valid()),
        &[],
        &["training.batch_sise", "unknown field"],
    );
    fails_with(
        &format!("{}colour: blue\n", valid()),
        &[],
        &["colour", "unknown field"],
    );
}

#[test]
fn wrong_type_and_bad_values_are_named() {
    fails_with(
        &valid().replace("num_steps: 1", "num_steps: lots"),
        &[],
        &["training.num_steps"],
    );
    fails_with(
        &valid().replace("num_steps: 1", "num_steps: 0"),
        &[],
        &["training.num_steps", "> 0"],
    );
    fails_with(
        &valid(),
        &["--workers", "3"],
        &["training.batch_size", "not divisible"],
    );
    fails_with(
        &valid(),
        &["--set", "optimizer.beta1=1.5"],
        &["optimizer.beta1"],
    );
}

#[test]
fn missing_model_and_dataset_are_named() {
    fails_with(
        &valid().replace("/model,", "/no-such-model,"),
        &[],
        &["no-such-model", "config.json"],
    );
    fails_with(
        &valid().replace("data.jsonl", "nope.jsonl"),
        &[],
        &["nope.jsonl"],
    );
}

#[test]
fn sanity_valid_config_trains() {
    let dir = scratch("cfg-valid");
    let cfg = dir.join("run.yaml");
    std::fs::write(&cfg, valid()).unwrap();
    run_ok(&["--config", cfg.to_str().unwrap(), "--gpus", "0"]);
}
