//! `memory.resident_blocks`: the leading blocks kept and updated by the workers give the
//! same losses, gradient norms, checkpoints and exported weights, bit for bit, as the
//! host's update of every block (float32 on CPU, whether or not clipping binds, with
//! gradient accumulation and two workers; and with a split master, bf16 weights and
//! gradients on one worker; under DPO and GRPO, whose reference passes read the loaded
//! blocks), and a run resumed from a checkpoint of a run with resident blocks ends where the
//! uninterrupted one did.

mod common;

use std::path::Path;

use common::*;

/// Trains the golden `llama` case for 5 steps (2 micro-batches per worker), checkpoints at
/// step 3 and at the end, with `resident` blocks and the `extra` settings; returns the
/// metrics rows.
fn train(
    dir: &Path,
    tag: &str,
    resident: &str,
    workers: usize,
    extra: &[String],
    resume: bool,
) -> Vec<serde_json::Value> {
    let run = dir.join(tag);
    let metrics_path = run.join("metrics.jsonl");
    std::fs::create_dir_all(&run).unwrap();
    let mut sets = vec![
        "training.num_steps=5".to_string(),
        "training.gradient_accumulation_steps=2".to_string(),
        format!("memory.resident_blocks={resident}"),
        format!("training.output_dir={}", run.join("out").display()),
        format!("checkpoint.dir={}", run.join("ck").display()),
        "checkpoint.every_steps=3".to_string(),
    ];
    sets.extend(extra.iter().cloned());
    let mut args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    if resume {
        args.extend(["--resume", "latest"]);
    }
    let config = golden_dir().join("llama").join("run.yaml");
    run_cpu_env_ok(&config, workers, &metrics_path, &args, &[]);
    metrics(&metrics_path)
}

/// Copies run `from`'s checkpoint of step `step` into run `to`'s checkpoint directory, for
/// `to` to resume from.
fn copy_checkpoint(from: &Path, step: u64, to: &Path) {
    std::fs::create_dir_all(to.join("ck")).unwrap();
    let src = from.join("ck").join(format!("step-{step:08}"));
    let status = std::process::Command::new("cp")
        .args(["-r", path_str(&src), path_str(&to.join("ck"))])
        .status()
        .unwrap();
    assert!(status.success(), "copy {}", src.display());
}

fn same_files(a: &Path, b: &Path) {
    let (x, y) = (files(a), files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&x),
        names(&y),
        "{} and {}: the same files",
        a.display(),
        b.display()
    );
    assert!(!x.is_empty(), "{} holds the written files", a.display());
    for ((name, p), (_, q)) in x.iter().zip(&y) {
        assert!(
            p == q,
            "{name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

fn same_columns(a: &[serde_json::Value], b: &[serde_json::Value], what: &str) {
    for key in ["loss", "grad_norm"] {
        let (x, y) = (column(a, key), column(b, key));
        let bits = |v: &[f64]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x), bits(&y), "{what}, {key}: {x:?} vs {y:?}");
    }
}

/// `resident` blocks against none, on `workers` workers with `extra`; both must train.
fn compare(dir: &Path, resident: &str, workers: usize, extra: &[String]) {
    let host = train(dir, "host", "off", workers, extra, false);
    let held = train(dir, "held", resident, workers, extra, false);
    assert_eq!(host.len(), 5, "five steps reported");
    same_columns(&host, &held, &format!("resident_blocks={resident}"));
    for sub in ["out", "ck"] {
        same_files(&dir.join("host").join(sub), &dir.join("held").join(sub));
    }
}

#[test]
fn every_block_resident_gives_the_hosts_bits_when_clipping_binds() {
    let dir = scratch("resident-all-clipped");
    compare(&dir, "all", 2, &["training.max_grad_norm=1e-3".into()]);
}

#[test]
fn every_block_resident_gives_the_hosts_bits_without_clipping() {
    let dir = scratch("resident-all-unclipped");
    compare(&dir, "all", 2, &["training.max_grad_norm=1e9".into()]);
}

/// Two of the golden model's five blocks resident (the embedding and layer 0), a split
/// master with bf16 weights and gradients; then a resume from the step-3 checkpoint of the
/// run with resident blocks ends on the uninterrupted run's files.
#[test]
fn some_blocks_resident_with_a_split_master_and_a_resume() {
    let dir = scratch("resident-split");
    let extra: Vec<String> = [
        "model.dtype=bfloat16",
        "memory.master_weights=split",
        "memory.grad_dtype=bfloat16",
    ]
    .map(String::from)
    .to_vec();
    compare(&dir, "2", 1, &extra);
    let resumed = dir.join("resumed");
    copy_checkpoint(&dir.join("held"), 3, &resumed);
    let rows = train(&dir, "resumed", "2", 1, &extra, true);
    assert_eq!(
        column(&rows, "loss").len(),
        2,
        "steps 4 and 5 run after the resume"
    );
    let held = metrics(&dir.join("held").join("metrics.jsonl"));
    same_columns(&held[3..], &rows, "resumed at step 3");
    same_files(&dir.join("held").join("out"), &resumed.join("out"));
}

/// The modes the workers cannot update with the host's arithmetic are refused by name.
#[test]
fn modes_updated_on_the_host_only_are_refused() {
    let dir = scratch("resident-refused");
    let config = golden_dir().join("llama").join("run.yaml");
    for (set, says) in [
        (
            "memory.master_weights=bfloat16",
            "memory.master_weights: bfloat16",
        ),
        (
            "memory.moments_dtype=bfloat16",
            "memory.moments_dtype: bfloat16",
        ),
    ] {
        let args = [
            "--set",
            "memory.resident_blocks=all",
            "--set",
            "model.dtype=bfloat16",
            "--set",
            "memory.grad_dtype=bfloat16",
            "--set",
            "memory.master_weights=split",
            "--set",
            set,
        ];
        let (out, _) = run_cpu_env(&config, 1, &dir.join("m.jsonl"), &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{set} with resident blocks must fail"
        );
        assert!(
            err.contains("memory.resident_blocks") && err.contains(says),
            "{set}: the error names the key and the mode: {err}"
        );
    }
}

/// Checkpoints of the weights alone (`checkpoint.save_optimizer: false`) bring back only
/// the resident blocks' master weights: they and the export are still the host's bits.
#[test]
fn weights_only_checkpoints_hold_the_hosts_bits() {
    let dir = scratch("resident-weights-only");
    compare(&dir, "all", 1, &["checkpoint.save_optimizer=false".into()]);
}

/// Every numeric field of every metrics row, as bits, but the timings and memory figures.
fn numbers(rows: &[serde_json::Value]) -> Vec<(String, u64)> {
    let timed = |k: &str| {
        k.ends_with("_s")
            || k.ends_with("_bytes")
            || k.starts_with("tflops")
            || k.contains("per_s")
            || k == "bound"
    };
    rows.iter()
        .flat_map(|r| r.as_object().unwrap().iter())
        .filter(|(k, v)| !timed(k) && v.is_f64())
        .map(|(k, v)| (k.clone(), v.as_f64().unwrap().to_bits()))
        .collect()
}

/// The post-training stages, whose reference passes read the initial weights, give the
/// host's bits with every block resident: DPO (its reference log-probabilities), and GRPO
/// with a KL term, trained through and resumed from a checkpoint taken after its reference
/// pass (which a resume runs on the initial model before it restores the checkpoint).
#[test]
fn post_training_stages_give_the_hosts_bits() {
    let dir = scratch("resident-post-training");
    for (case, steps) in [("dpo/llama_sigmoid", 4), ("grpo/llama_dapo_kl", 4)] {
        let config = golden_dir().join(case).join("run.yaml");
        let run = |tag: &str, resident: &str, resume: bool| {
            let d = dir.join(case.replace('/', "-")).join(tag);
            std::fs::create_dir_all(&d).unwrap();
            let m = d.join("metrics.jsonl");
            let sets = [
                format!("training.num_steps={steps}"),
                format!("memory.resident_blocks={resident}"),
                format!("training.output_dir={}", d.join("out").display()),
                format!("checkpoint.dir={}", d.join("ck").display()),
                "checkpoint.every_steps=2".to_string(),
            ];
            let mut args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
            if resume {
                args.extend(["--resume", "latest"]);
            }
            run_cpu_env_ok(&config, 1, &m, &args, &[]);
            (metrics(&m), d)
        };
        let (host, host_dir) = run("host", "off", false);
        let (held, held_dir) = run("held", "all", false);
        assert_eq!(numbers(&host), numbers(&held), "{case}: metrics");
        same_files(&host_dir.join("out"), &held_dir.join("out"));
        // Resume the run with resident blocks from its step-2 checkpoint.
        let resumed = dir.join(case.replace('/', "-")).join("resumed");
        copy_checkpoint(&held_dir, 2, &resumed);
        let (rows, _) = run("resumed", "all", true);
        assert_eq!(
            numbers(&held[2..]),
            numbers(&rows),
            "{case}: steps 3 and 4 after the resume"
        );
        same_files(&held_dir.join("out"), &resumed.join("out"));
    }
}
