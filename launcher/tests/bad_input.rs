//! Bad input of every kind fails with an error that names the file, key, flag, line or
//! tensor and says what was expected, and leaves nothing behind: no process holding the
//! run's shared memory, no /dev/shm entry, no checkpoint directory without `COMPLETE`, no
//! output directory, and (for failures before training starts) no metrics file.
//!
//! Each case runs the real `mt-launch` on a private copy of the llama fixture.

mod common;

use std::process::Command;

use common::fixture::{Stage, fixture, path};
use common::*;
use safetensors::Dtype;

// ---- the run config ----

#[test]
fn malformed_yaml() {
    let f = fixture("yaml");
    f.write_config("model: {path: [unclosed\n");
    f.fails(&[], Stage::Start, &["run.yaml", "malformed YAML"]);
}

#[test]
fn unknown_key() {
    let f = fixture("unknown-key");
    f.write_config(
        &f.yaml()
            .replace("  num_steps: 2", "  num_steps: 2\n  batch_sise: 3"),
    );
    f.fails(
        &[],
        Stage::Start,
        &["run.yaml", "training.batch_sise", "unknown field"],
    );
}

#[test]
fn unknown_section() {
    let f = fixture("unknown-section");
    f.write_config(&format!("{}colour: blue\n", f.yaml()));
    f.fails(&[], Stage::Start, &["colour", "unknown field"]);
}

#[test]
fn wrong_type() {
    let f = fixture("wrong-type");
    f.write_config(&f.yaml().replace("num_steps: 2", "num_steps: lots"));
    f.fails(&[], Stage::Start, &["training.num_steps", "invalid type"]);
}

#[test]
fn zero_steps() {
    let f = fixture("zero-steps");
    f.fails(
        &["--set", "training.num_steps=0"],
        Stage::Start,
        &["training.num_steps", "> 0"],
    );
}

#[test]
fn negative_learning_rate() {
    let f = fixture("negative-lr");
    f.fails(
        &["--set", "training.learning_rate=-0.001"],
        Stage::Start,
        &["training.learning_rate", ">= 0", "-0.001"],
    );
}

#[test]
fn beta_out_of_range() {
    let f = fixture("beta");
    f.fails(
        &["--set", "optimizer.beta1=1.5"],
        Stage::Start,
        &["optimizer.beta1", "[0, 1)", "1.5"],
    );
}

#[test]
fn zero_worker_timeout() {
    let f = fixture("timeout");
    f.fails(
        &["--set", "training.worker_timeout_s=0"],
        Stage::Start,
        &["training.worker_timeout_s", "> 0"],
    );
}

#[test]
fn malformed_override() {
    let f = fixture("set");
    f.fails(
        &["--set", "training.num_steps"],
        Stage::Start,
        &["training.num_steps", "key.path=value"],
    );
}

#[test]
fn bad_shard_size() {
    let f = fixture("shard-size");
    f.fails(
        &["--set", "checkpoint.max_shard_size=lots"],
        Stage::Start,
        &["checkpoint.max_shard_size", "`lots` is not a size"],
    );
}

#[test]
fn bad_staging_size() {
    let f = fixture("staging-size");
    for bad in ["lots", "0", "-1GB"] {
        f.fails(
            &["--set", &format!("checkpoint.staging_size={bad}")],
            Stage::Start,
            &["checkpoint.staging_size", "is not a size"],
        );
    }
    f.fails(
        &[
            "--set",
            "checkpoint.staging_size=1GB",
            "--set",
            "checkpoint.background=false",
        ],
        Stage::Start,
        &["checkpoint.staging_size", "background: false"],
    );
}

#[test]
fn model_path_and_name_both_given() {
    // In the file: both are refused (an override of one replaces the other instead).
    let f = fixture("path-and-name");
    let yaml = f.yaml();
    let with_name = yaml.replacen("model: {", "model: {name: org/model, ", 1);
    assert_ne!(yaml, with_name, "the fixture's model section moved: {yaml}");
    f.write_config(&with_name);
    f.fails(&[], Stage::Start, &["model.name", "not both"]);
}

#[test]
fn checkpoint_every_steps_without_dir() {
    // Checkpoints go to training.output_dir/checkpoints/ by default: only a run that
    // writes no model has nowhere to put them.
    let f = fixture("every-no-dir");
    f.write_config(&f.yaml().replace(
        &format!("  dir: {}\n", f.ck.display()),
        "  every_steps: 1\n",
    ));
    f.fails(
        &["--set", "training.save_model=false"],
        Stage::Start,
        &["checkpoint.dir", "every_steps", "save_model"],
    );
}

#[test]
fn full_state_interval_without_any_optimizer_state() {
    let f = fixture("full-state-no-optimizer");
    f.fails(
        &[
            "--set",
            "checkpoint.save_optimizer=false",
            "--set",
            "checkpoint.full_state_every_steps=2",
        ],
        Stage::Start,
        &["checkpoint.full_state_every_steps", "save_optimizer: false"],
    );
}

// ---- placement ----

#[test]
fn batch_not_divisible_by_workers() {
    let f = fixture("batch-workers");
    f.fails(
        &["--workers", "3"],
        Stage::Start,
        &["training.batch_size", "not divisible", "workers (3)"],
    );
}

#[test]
fn batch_not_divisible_by_accumulation() {
    let f = fixture("batch-accum");
    f.fails(
        &["--set", "training.gradient_accumulation_steps=3"],
        Stage::Start,
        &[
            "training.batch_size",
            "not divisible",
            "gradient_accumulation_steps (3)",
        ],
    );
}

#[test]
fn more_gpus_than_present() {
    let f = fixture("gpus");
    f.fails(
        &["--gpus", "64"],
        Stage::Start,
        &["--gpus 64", "more GPUs than"],
    );
}

#[test]
fn zero_workers() {
    let f = fixture("workers-0");
    f.fails(
        &["--workers", "0"],
        Stage::Start,
        &["--workers", "at least 1"],
    );
}

// ---- the model directory ----

#[test]
fn missing_model_dir() {
    let f = fixture("no-model");
    std::fs::remove_dir_all(&f.model).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[&path(&f.model), "config key `model.path`", "does not exist"],
    );
}

#[test]
fn config_json_missing_field() {
    let f = fixture("cfg-field");
    f.edit_config_json(|c| {
        c.remove("hidden_size");
    });
    f.fails(
        &[],
        Stage::Start,
        &["config.json", "`hidden_size` is missing"],
    );
}

#[test]
fn config_json_malformed() {
    let f = fixture("cfg-json");
    std::fs::write(f.model.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    f.fails(
        &[],
        Stage::Start,
        &["config.json", "not a valid config.json"],
    );
}

#[test]
fn unsupported_model_type() {
    let f = fixture("cfg-type");
    f.edit_config_json(|c| {
        c.insert("model_type".into(), "mamba".into());
    });
    f.fails(
        &[],
        Stage::Start,
        &["config.json", "unsupported model_type `mamba`", "llama"],
    );
}

#[test]
fn missing_weights() {
    let f = fixture("no-weights");
    std::fs::remove_file(f.model.join("model.safetensors")).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[
            &path(&f.model),
            "no model.safetensors",
            "model.init: random",
        ],
    );
}

#[test]
fn truncated_safetensors() {
    let f = fixture("truncated");
    let p = f.model.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[&path(&p), "not a valid safetensors file"],
    );
}

#[test]
fn missing_tensor() {
    let f = fixture("missing-tensor");
    f.edit_weights(|t| t.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.weight"));
    f.fails(
        &[],
        Stage::Start,
        &["model.layers.1.mlp.up_proj.weight", "missing"],
    );
}

#[test]
fn wrong_shape() {
    let f = fixture("shape");
    f.edit_weights(|t| {
        let w = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        w.2 = vec![w.2[0] / 2, 2];
    });
    f.fails(
        &[],
        Stage::Start,
        &["model.norm.weight", "expected shape [48]", "[24, 2]"],
    );
}

#[test]
fn wrong_dtype() {
    let f = fixture("dtype");
    f.edit_weights(|t| {
        let w = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        w.1 = Dtype::I32;
    });
    f.fails(
        &[],
        Stage::Start,
        &["model.norm.weight", "F32, BF16, F16 or F64", "I32"],
    );
}

#[test]
fn unknown_tensor() {
    let f = fixture("extra-tensor");
    f.edit_weights(|t| {
        t.push((
            "model.layers.9.extra.weight".into(),
            Dtype::F32,
            vec![2],
            vec![0; 8],
        ))
    });
    f.fails(
        &[],
        Stage::Start,
        &[
            "model.layers.9.extra.weight",
            "no such tensor in this architecture",
        ],
    );
}

#[test]
fn index_lists_a_missing_shard() {
    let f = fixture("index");
    std::fs::remove_file(f.model.join("model.safetensors")).unwrap();
    let index = r#"{"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#;
    std::fs::write(f.model.join("model.safetensors.index.json"), index).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "does not exist",
        ],
    );
}

// ---- the dataset ----

#[test]
fn missing_dataset() {
    let f = fixture("no-data");
    std::fs::remove_file(&f.data).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[
            &path(&f.data),
            "config key `dataset.path`",
            "does not exist",
        ],
    );
}

#[test]
fn empty_dataset() {
    let f = fixture("empty-data");
    std::fs::write(&f.data, "\n").unwrap();
    f.fails(&[], Stage::Start, &[&path(&f.data), "no usable records"]);
}

#[test]
fn malformed_dataset_record() {
    let f = fixture("bad-record");
    let text = std::fs::read_to_string(&f.data).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"input_ids\": [1, 2,";
    std::fs::write(&f.data, lines.join("\n")).unwrap();
    f.fails(
        &["--set", "dataset.strict=true"],
        Stage::Start,
        &[&path(&f.data), "3"],
    );
}

#[test]
fn token_id_out_of_vocabulary() {
    let f = fixture("bad-id");
    let text = std::fs::read_to_string(&f.data).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    lines[1] = r#"{"input_ids": [1, 2, 67]}"#.into();
    std::fs::write(&f.data, lines.join("\n")).unwrap();
    f.fails(
        &["--set", "dataset.strict=true"],
        Stage::Start,
        &[&path(&f.data), "2", "input_ids", "67"],
    );
}

#[test]
fn labels_of_another_length() {
    let f = fixture("bad-labels");
    std::fs::write(&f.data, "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}\n").unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[&path(&f.data), ":1: field `labels`", "has 2 entries"],
    );
}

// ---- output and checkpoint directories ----

#[test]
fn unwritable_checkpoint_dir() {
    let f = fixture("ck-unwritable");
    let file = f.dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let set = format!("checkpoint.dir={}", file.join("ck").display());
    f.fails(
        &["--set", &set],
        Stage::Start,
        &["checkpoint.dir", &path(&file), "is not a directory"],
    );
}

#[test]
fn unwritable_output_dir() {
    let f = fixture("out-unwritable");
    let file = f.dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let set = format!("training.output_dir={}", file.join("out").display());
    f.fails(
        &["--set", &set],
        Stage::Start,
        &["training.output_dir", &path(&file), "is not a directory"],
    );
}

/// A checkpoint write that fails mid-run (files limited to 512 KiB: the weights fit, the
/// optimizer state does not) aborts the run with the failing file named; the previous
/// complete checkpoint stays and nothing partial is left.
#[test]
fn write_error_while_checkpointing() {
    let f = fixture("write-error");
    let first = f.checkpoint(1);
    let model_bytes = std::fs::metadata(first.join("model.safetensors"))
        .unwrap()
        .len();
    let opt_bytes = std::fs::metadata(first.join("optimizer.safetensors"))
        .unwrap()
        .len();
    let limit_kib = 512;
    assert!(model_bytes < limit_kib * 1024 && opt_bytes > limit_kib * 1024);
    let mut cmd = Command::new("bash");
    cmd.args([
        "-c",
        &format!("trap '' XFSZ; ulimit -f {limit_kib}; exec \"$@\""),
        "bash",
    ]);
    cmd.arg(launcher()).args(f.args(&[
        "--set",
        "training.num_steps=3",
        "--set",
        "checkpoint.every_steps=1",
        "--resume",
        "latest",
    ]));
    f.check_failure(
        cmd,
        Stage::Running,
        &["optimizer.safetensors", "write failed", "File too large"],
    );
    let complete: Vec<u64> = mt::checkpoint::state::complete(&f.ck)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(complete, [1], "the previous checkpoint is kept");
    run_ok(
        &f.args(&["--resume", path_str(&first)])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
}

/// A periodic checkpoint that completed before the end-of-run one is reported as written
/// before that one is written, so a failure of the last write (here at its end: a file in
/// the way of the directory it replaces) still leaves the run's log saying where the
/// complete one is.
#[test]
fn a_failed_last_write_still_reports_the_periodic_checkpoint() {
    let f = fixture("last-write-fails");
    std::fs::create_dir_all(&f.ck).unwrap();
    std::fs::write(f.ck.join("step-00000003"), "in the way").unwrap();
    // A file this project did not write: accepted only when told to write there anyway.
    let out = mt_launch()
        .args(f.args(&[
            "--set",
            "training.num_steps=3",
            "--set",
            "checkpoint.every_steps=2",
            "--set",
            "training.overwrite_output_dir=true",
        ]))
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "the last write fails: {stderr}");
    assert!(
        stderr.contains("step-00000003") || stderr.contains("checkpoint under"),
        "the error names the checkpoint: {stderr}"
    );
    let periodic = format!(
        "checkpoint {} written",
        f.ck.join("step-00000002").display()
    );
    assert!(
        stdout.contains(&periodic),
        "the log reports the periodic checkpoint: {stdout}"
    );
    let complete: Vec<u64> = mt::checkpoint::state::complete(&f.ck)
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert!(
        complete.contains(&2),
        "the periodic checkpoint is kept: {complete:?}"
    );
}

// ---- resume ----

#[test]
fn resume_from_another_model() {
    let f = fixture("resume-foreign");
    let other = fixture("resume-foreign-other");
    other.edit_config_json(|c| {
        c.insert("intermediate_size".into(), 96.into());
    });
    other.write_config(
        &other
            .yaml()
            .replace("dtype: float32}", "dtype: float32, init: random}"),
    );
    let foreign = other.checkpoint(1);
    f.fails(
        &["--resume", path_str(&foreign)],
        Stage::Start,
        &[&path(&foreign), "saved for another model"],
    );
}

#[test]
fn resume_from_checkpoint_without_marker() {
    let f = fixture("resume-marker");
    let ck = f.checkpoint(1);
    std::fs::remove_file(ck.join("COMPLETE")).unwrap();
    let partial = f.dir.join("partial");
    std::fs::rename(&ck, &partial).unwrap();
    f.fails(
        &["--resume", path_str(&partial)],
        Stage::Start,
        &[&path(&partial), "no COMPLETE marker"],
    );
}

#[test]
fn resume_from_a_missing_dir() {
    let f = fixture("resume-missing");
    let nowhere = f.dir.join("nowhere");
    f.fails(
        &["--resume", path_str(&nowhere)],
        Stage::Start,
        &[&path(&nowhere), "no such checkpoint directory"],
    );
}

/// Every file or directory the config points at that is missing is named by its key (and
/// the path), before anything is read; the config file itself by --config.
#[test]
fn missing_sources_name_their_keys() {
    let f = fixture("missing-sources");
    let nowhere = f.dir.join("nowhere");
    let at = |name: &str| nowhere.join(name).display().to_string();
    // (A missing model.path and dataset.path: missing_model_dir, missing_dataset.)
    let file = at("eval.jsonl");
    let flag = format!("dataset.eval_path={file}");
    let key = "config key `dataset.eval_path`";
    f.fails(
        &["--set", &flag],
        Stage::Start,
        &[key, &file, "does not exist"],
    );
    // An empty model directory: no config.json.
    std::fs::create_dir_all(&nowhere).unwrap();
    let flag = format!("model.path={}", nowhere.display());
    f.fails(
        &["--set", &flag],
        Stage::Start,
        &["model.path", "holds no config.json"],
    );
    // A registry name looked up in a directory without dataset_info.json.
    let flags = [
        "--set".to_string(),
        "dataset.name=alpaca_demo".into(),
        "--set".into(),
        "dataset.format=null".into(),
        "--set".into(),
        format!("dataset.dataset_dir={}", nowhere.display()),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    f.fails(
        &flags,
        Stage::Start,
        &["dataset.dataset_dir", "dataset_info.json"],
    );
    let out = mt_launch()
        .args(["--config", &at("run.yaml"), "--gpus", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no such config file (--config"), "{err}");
    // --dry-run checks the outputs as a launch does.
    let out = mt_launch()
        .args(["--config", path_str(&f.config), "--gpus", "0", "--dry-run"])
        .args(["--metrics-out", "/proc/nowhere/m.jsonl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--metrics-out"), "{err}");
}

#[test]
fn resume_latest_without_checkpoints() {
    let f = fixture("resume-none");
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &[&path(&f.ck), "no complete checkpoint"],
    );
}

#[test]
fn resume_latest_without_checkpoint_dir() {
    let f = fixture("resume-no-dir");
    f.write_config(
        &f.yaml()
            .replace(&format!("checkpoint:\n  dir: {}\n", f.ck.display()), ""),
    );
    // Without checkpoint.dir, `latest` looks in the default one, training.output_dir's
    // checkpoints/, and says there is none there.
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &[
            &path(&f.out.join("checkpoints")),
            "no complete checkpoint to resume from",
        ],
    );
}

#[test]
fn resume_from_corrupt_optimizer_state() {
    let f = fixture("resume-corrupt");
    let ck = f.checkpoint(1);
    let opt = ck.join("optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() - 100]).unwrap();
    // Its manifest (checkpoint.verify) tells it first.
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &[&path(&opt), "truncated"],
    );
}

#[test]
fn resume_with_nothing_left_to_run() {
    let f = fixture("resume-done");
    f.checkpoint(2);
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &[
            "at step 2",
            "training.num_steps is 2",
            "nothing left to run",
        ],
    );
}

#[test]
fn sanity_the_fixture_trains() {
    let f = fixture("sanity");
    let args = f.args(&[]);
    run_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        f.ck.join("step-00000002/COMPLETE").is_file() && f.out.join("model.safetensors").is_file()
    );
}

// ---- the environment (docs/switches.md) ----

/// A bad `MT_*` value stops the launch at start in one line that names it and what it
/// takes; before the switchboard, this one panicked in the worker's model code mid-step.
#[test]
fn bad_environment_variable() {
    let f = fixture("bad-switch");
    let mut cmd = mt_launch();
    cmd.args(f.args(&[])).env("MT_GATED_DELTA_CHUNK", "abc");
    let err = f.check_failure(
        cmd,
        Stage::Start,
        &["MT_GATED_DELTA_CHUNK=abc: expected `16`, `32`, `64`, `128` or `256`"],
    );
    assert_eq!(err.matches("MT_GATED_DELTA_CHUNK").count(), 1, "{err}");
    // A test hook is checked the same way, by the launcher, before any worker starts.
    let mut cmd = mt_launch();
    cmd.args(f.args(&[])).env("MT_TEST_FAIL_ALLOC", "sideways");
    f.check_failure(
        cmd,
        Stage::Start,
        &["MT_TEST_FAIL_ALLOC=sideways: expected <phase>[:<layer>], a phase of start-up"],
    );
}

/// mt-worker checks its inherited environment at start too: one line, no panic.
#[test]
fn bad_environment_variable_in_a_worker() {
    let worker = launcher().with_file_name("mt-worker");
    let out = Command::new(worker)
        .env("MT_ROPE", "sometimes")
        .output()
        .expect("spawn mt-worker");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert_eq!(
        err.trim(),
        "mt-worker[?]: error: MT_ROPE=sometimes: expected `fused` or `plain`"
    );
}
