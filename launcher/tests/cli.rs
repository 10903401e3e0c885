//! The command line a user meets first: `plan` sizes a run (host RAM, per-GPU memory by
//! component, the largest micro-batch), `--dry-run` checks everything and starts nothing,
//! a run that cannot fit in host RAM is refused before allocating, unknown config keys
//! name the nearest valid key, step lines are printed when stdout is not a terminal.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(name)
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every ready-made config (and benchmark shape) plans with nothing but the target machine on the command line:
/// 2 GPUs of 141 GB, though this machine has none; a hub model that is not in the HF cache
/// is sized from the architecture shipped for it, and its text dataset from
/// `dataset.max_seq_len`, without the tokenizer.
#[test]
fn plan_sizes_every_ready_made_config_for_another_machine() {
    let cache = scratch("cli-plan-empty-cache");
    let mut files: Vec<PathBuf> = [config(""), config("bench")]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 15, "{files:?}");
    for file in &files {
        let out = mt_launch()
            .args(["plan", "--config", path_str(file), "--gpus", "2"])
            .args(["--gpu-memory", "141"])
            .env("HF_HUB_CACHE", &cache)
            .output()
            .unwrap();
        let (text, err) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
        assert!(out.status.success(), "{}:\n{err}", file.display());
        for want in [
            "2 worker(s) on GPUs [0, 1]",
            "bytes per parameter",
            "host RAM available",
            "device memory per worker, micro-batch ",
            "peak phase: ",
            "largest micro-batch on a 141.0 GB GPU: ",
        ] {
            assert!(
                text.contains(want),
                "{}: no `{want}` in\n{text}",
                file.display()
            );
        }
        let yaml = std::fs::read_to_string(file).unwrap();
        if yaml.contains("  name: ") && yaml.contains("/") && yaml.contains("model:\n  name:") {
            assert!(
                text.contains(
                    "is not in the Hugging Face cache here: sized from the architecture shipped"
                ) && text.contains("dataset: not read (no tokenizer here)"),
                "{}: no fallback note in\n{text}",
                file.display()
            );
        }
    }
    // Without dataset.max_seq_len a text dataset cannot be sized without its tokenizer.
    let out = mt_launch()
        .args(["plan", "--config", path_str(&config("qwen2.5_7b.yaml"))])
        .args(["--gpus", "1", "--set", "dataset.max_seq_len=null"])
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("dataset.max_seq_len"),
        "{}",
        stderr(&out)
    );
    // A hub id with no shipped architecture keeps the cache's own error.
    let out = mt_launch()
        .args(["plan", "--config", path_str(&config("qwen2.5_7b.yaml"))])
        .args(["--set", "model.name=Qwen/Qwen2.5-3B-Instruct"])
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not in the Hugging Face cache"),
        "{}",
        stderr(&out)
    );
    // Training, unlike planning, needs the model itself.
    let out = mt_launch()
        .args([
            "--config",
            path_str(&config("qwen2.5_7b.yaml")),
            "--gpus",
            "0",
        ])
        .args(["--dry-run"])
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not in the Hugging Face cache"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn dry_run_checks_everything_and_starts_no_worker() {
    let out = run_ok(&[
        "--config",
        path_str(&config("tiny.yaml")),
        "--gpus",
        "0",
        "--dry-run",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    // configs/tiny.yaml holds out 10% of the 240 demo samples for evaluation.
    assert!(text.contains("dataset: 216 samples"), "{text}");
    assert!(text.contains("eval set: 24 samples held out"), "{text}");
    assert!(text.contains("dry run: configuration, model, dataset and host memory are valid"));
    assert!(!text.contains("step "), "{text}");
    // A broken chat template is found by the dry run.
    let dir = scratch("cli-dry-run");
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(config("tiny").join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }",
    )
    .unwrap();
    let model = format!("model.path={}", dir.display());
    let out = run(&[
        "--config",
        path_str(&config("tiny.yaml")),
        "--gpus",
        "0",
        "--dry-run",
        "--set",
        &model,
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("chat_template.jinja") && err.contains("does not parse"),
        "{err}"
    );
}

#[test]
fn launch_is_refused_when_host_ram_is_short() {
    let out = run(&[
        "--config",
        path_str(&config("qwen2.5_32b.yaml")),
        "--gpus",
        "0",
        "--set",
        "model.name=null",
        "--set",
        "model.path=qwen2.5-32b",
        "--set",
        "model.init=random",
        "--set",
        "dataset.name=tokenized_demo",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("host RAM is short") && err.contains("mt-launch plan"),
        "{err}"
    );
}

#[test]
fn unknown_keys_name_the_nearest_valid_key() {
    let out = run(&[
        "plan",
        "--config",
        path_str(&config("tiny.yaml")),
        "--gpus",
        "0",
        "--set",
        "dataset.max_seq_length=8",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("dataset.max_seq_length") && err.contains("did you mean `max_seq_len`?"),
        "{err}"
    );
}

#[test]
fn model_devices_must_agree_with_gpus() {
    let out = run(&[
        "plan",
        "--config",
        path_str(&config("tiny.yaml")),
        "--gpus",
        "0",
        "--set",
        "model.devices=[0, 1]",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("conflicts with model.devices"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn piped_stdout_gets_one_line_per_step() {
    let dir = scratch("cli-lines");
    let m = dir.join("m.jsonl");
    let (out, _) = run_cpu(
        &config("tiny.yaml"),
        1,
        &m,
        &["--set", "training.num_steps=2"],
    );
    assert_ok(&out, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("step    1/2  loss ") && text.contains("step    2/2  loss "),
        "{text}"
    );
    let rows = metrics(&m);
    assert_eq!(rows.len(), 2);
    // HF Trainer's summaries: the run's shape at the start, its figures at the end (the
    // mean loss of the steps and the last, as the metrics file has them).
    for want in [
        "***** Running training *****",
        "Total optimization steps = 2",
        "Instantaneous batch size per device = ",
        "***** Training finished *****",
        "train_runtime = ",
    ] {
        assert!(text.contains(want), "no `{want}` in {text}");
    }
    let loss = |r: &serde_json::Value| r["loss"].as_f64().unwrap();
    let mean = (loss(&rows[0]) + loss(&rows[1])) / 2.0;
    let said = format!(
        "train_loss = {mean:.4} (mean of 2 step(s); last {:.4})",
        loss(&rows[1])
    );
    assert!(text.contains(&said), "no `{said}` in {text}");
    // Each plain line carries the epoch, elapsed time and ETA.
    let line = text.lines().find(|l| l.starts_with("step    1/2")).unwrap();
    for want in ["epoch 0.", "elapsed 0:00:", "eta 0:"] {
        assert!(line.contains(want), "no `{want}` in {line}");
    }
    // Each step says what bounded it; on CPU nothing waits a tenth of the step except,
    // possibly, for the optimizer's update of the previous step.
    for r in &rows {
        let bound = r["bound"].as_str().expect("a `bound` string");
        assert!(["compute", "optimizer"].contains(&bound), "{r}");
        assert!(r["update_wait_s"].as_f64().unwrap() >= 0.0, "{r}");
    }
    assert_eq!(
        rows[0]["update_wait_s"].as_f64(),
        Some(0.0),
        "step 1 waits on no update"
    );
}
