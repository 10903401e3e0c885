//! Bad input of every kind fails with an error that names the file, key, flag, line or
//! tensor and says what was expected, and leaves nothing behind: no process holding the
//! run's shared memory, no /dev/shm entry, no checkpoint directory without `COMPLETE`, no
//! output directory, and (for failures before training starts) no metrics file.
//!
//! Each case runs the real `mt-launch` on a private copy of the llama fixture.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// A private copy of the llama fixture (model dir + data) and a config pointing at it, with
/// `training.output_dir` and `checkpoint.dir` inside the case's directory.
struct Fixture {
    dir: PathBuf,
    model: PathBuf,
    data: PathBuf,
    config: PathBuf,
    ck: PathBuf,
    out: PathBuf,
    metrics: PathBuf,
}

/// When the failure happens: before anything starts (nothing may be created), or while
/// training (metrics and complete checkpoints may exist).
#[derive(PartialEq)]
enum Stage {
    Start,
    Running,
}

fn fixture(name: &str) -> Fixture {
    let dir = scratch(&format!("bad-{name}"));
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let golden = golden_dir().join("llama");
    for e in std::fs::read_dir(golden.join("model")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let data = dir.join("data.jsonl");
    std::fs::copy(golden.join("data.jsonl"), &data).unwrap();
    let f = Fixture {
        config: dir.join("run.yaml"),
        ck: dir.join("ck"),
        out: dir.join("out"),
        metrics: dir.join("metrics.jsonl"),
        dir,
        model,
        data,
    };
    f.write_config(&f.yaml());
    f
}

impl Fixture {
    fn yaml(&self) -> String {
        format!(
            "model: {{path: {}, dtype: float32}}\n\
             dataset: {{format: tokenized, path: {}, shuffle: false}}\n\
             training:\n  batch_size: 4\n  num_steps: 2\n  output_dir: {}\n\
             checkpoint:\n  dir: {}\n",
            self.model.display(),
            self.data.display(),
            self.out.display(),
            self.ck.display()
        )
    }

    fn write_config(&self, yaml: &str) {
        std::fs::write(&self.config, yaml).unwrap();
    }

    /// mt-launch on this fixture (CPU workers unless `extra` says `--gpus`).
    fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["--config".into(), path_str(&self.config).into()];
        if !extra.contains(&"--gpus") {
            args.extend(["--gpus".into(), "0".into()]);
        }
        args.extend(["--metrics-out".into(), path_str(&self.metrics).into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Runs mt-launch with `extra`; it must fail at `stage` with every needle in stderr.
    fn fails(&self, extra: &[&str], stage: Stage, needles: &[&str]) -> String {
        let mut cmd = Command::new(launcher());
        cmd.args(self.args(extra));
        self.check_failure(cmd, stage, needles)
    }

    fn check_failure(&self, mut cmd: Command, stage: Stage, needles: &[&str]) -> String {
        let shm_before = shm_entries();
        let ck_before = entries(&self.ck);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "expected a failure:\n{err}");
        eprintln!(
            "{}",
            err.lines()
                .filter(|l| l.contains("error"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(
            !err.contains("panicked"),
            "bad input must not panic:\n{err}"
        );
        for n in needles {
            assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
        }
        assert_clean(pid, &[], &shm_before);
        let partial = partial_checkpoints(&self.ck);
        assert!(partial.is_empty(), "partial checkpoints left: {partial:?}");
        assert!(!self.out.exists(), "a failed run must not write output_dir");
        if stage == Stage::Start {
            assert!(
                !self.metrics.exists(),
                "a failed start must not leave metrics"
            );
            assert_eq!(
                entries(&self.ck),
                ck_before,
                "a failed start must not touch checkpoints"
            );
        }
        err
    }

    /// Rewrites the fixture's model.safetensors after `edit` changed its tensors.
    fn edit_weights(&self, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
        let path = self.model.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.dtype(),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                )
            })
            .collect();
        edit(&mut tensors);
        let views = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }

    fn edit_config_json(&self, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
        let path = self.model.join("config.json");
        let mut cfg = json(&path);
        edit(cfg.as_object_mut().unwrap());
        std::fs::write(&path, cfg.to_string()).unwrap();
    }

    /// Trains `steps` steps with a checkpoint at the end; returns the checkpoint.
    fn checkpoint(&self, steps: u64) -> PathBuf {
        let args = self.args(&["--set", &format!("training.num_steps={steps}")]);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run_ok(&refs);
        std::fs::remove_file(&self.metrics).unwrap();
        std::fs::remove_dir_all(&self.out).unwrap();
        self.ck.join(format!("step-{steps:08}"))
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

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
fn model_path_and_name_both_given() {
    let f = fixture("path-and-name");
    f.fails(
        &["--set", "model.name=org/model"],
        Stage::Start,
        &["model.name", "not both"],
    );
}

#[test]
fn checkpoint_every_steps_without_dir() {
    let f = fixture("every-no-dir");
    f.write_config(&f.yaml().replace(
        &format!("  dir: {}\n", f.ck.display()),
        "  every_steps: 1\n",
    ));
    f.fails(&[], Stage::Start, &["checkpoint.dir", "every_steps"]);
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
        &[&path(&f.model.join("config.json")), "No such file"],
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
    f.fails(&[], Stage::Start, &[&path(&f.data), "No such file"]);
}

#[test]
fn empty_dataset() {
    let f = fixture("empty-data");
    std::fs::write(&f.data, "\n").unwrap();
    f.fails(&[], Stage::Start, &[&path(&f.data), "no records"]);
}

#[test]
fn malformed_dataset_record() {
    let f = fixture("bad-record");
    let text = std::fs::read_to_string(&f.data).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"input_ids\": [1, 2,";
    std::fs::write(&f.data, lines.join("\n")).unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[&path(&f.data), "line 3", "not a tokenized record"],
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
        &[],
        Stage::Start,
        &[&path(&f.data), "line 2", "`input_ids`", "67"],
    );
}

#[test]
fn labels_of_another_length() {
    let f = fixture("bad-labels");
    std::fs::write(&f.data, "{\"input_ids\": [1, 2, 3], \"labels\": [1, 2]}\n").unwrap();
    f.fails(
        &[],
        Stage::Start,
        &[&path(&f.data), "line 1", "`labels` has 2 entries"],
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
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &["checkpoint.dir", "--resume latest"],
    );
}

#[test]
fn resume_from_corrupt_optimizer_state() {
    let f = fixture("resume-corrupt");
    let ck = f.checkpoint(1);
    let opt = ck.join("optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() - 100]).unwrap();
    f.fails(
        &["--resume", "latest"],
        Stage::Start,
        &[&path(&opt), "not a valid safetensors file"],
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
