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

/// Every ready-made config, sized from its shipped architecture without weights.
#[test]
fn plan_sizes_every_ready_made_config() {
    for (file, arch) in [
        ("qwen2.5_7b.yaml", "qwen2.5-7b"),
        ("qwen2.5_14b.yaml", "qwen2.5-14b"),
        ("qwen2.5_32b.yaml", "qwen2.5-32b"),
        ("qwen3_8b.yaml", "qwen3-8b"),
        ("llama3.1_8b.yaml", "llama3.1-8b"),
        ("mistral_7b.yaml", "mistral-7b"),
        ("gemma2_9b.yaml", "gemma2-9b"),
        ("phi3_mini.yaml", "phi3-mini"),
    ] {
        let path = format!("model.path={arch}");
        let out = run_ok(&[
            "plan",
            "--config",
            path_str(&config(file)),
            "--gpus",
            "0",
            "--set",
            "model.name=null",
            "--set",
            &path,
            "--set",
            "dataset.name=tokenized_demo",
            "--gpu-memory",
            "80",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        for want in [
            "bytes per parameter",
            "host RAM available",
            "device memory per worker, micro-batch 16 x 1024 tokens",
            "peak phase: ",
            "layer inputs kept for the backward",
            "largest micro-batch on a 80.0 GB GPU: ",
        ] {
            assert!(text.contains(want), "{file}: no `{want}` in\n{text}");
        }
    }
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
    assert_eq!(metrics(&m).len(), 2);
}
