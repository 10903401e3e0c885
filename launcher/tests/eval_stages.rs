//! Evaluation under `training.stage: dpo` and `grpo`: the eval loss and TRL's metrics of
//! held-out pairs and rollouts, forward only between steps.
//!
//! - Against torch: the eval set is the golden case's next batch, so the evaluation after
//!   step s is what scripts/make_golden.py computed (TRL's formulas in torch) as step s + 1's
//!   loss, rewards and KL, under the same weights; and it equals the training objective of
//!   step s + 1 in the same run (same pairs or rollouts, same weights, no update between).
//! - 2 workers evaluate exactly as 1 worker accumulating 2 (bit for bit, f32 on CPU).
//! - A LlamaFactory-style DPO YAML with `val_size`, `per_device_eval_batch_size` and
//!   `eval_steps` runs, holding out whole pairs; its eval metrics reach the step lines and
//!   TensorBoard (`eval/rewards/*`, HF Trainer's rewrite of `eval_` keys).

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// The evaluation after step 1 against torch's step 2: weights after one AdamW update,
/// where rounding alone decides the sign of elements whose gradient is at the rounding
/// level (tests/dpo.rs's and grpo.rs's LATER_TOL, golden.rs's 1e-4), relative to the
/// step's scale; the rewards (β × summed log-probability differences) absolute, as
/// dpo.rs's REWARD_TOL after step 1.
const TORCH_TOL: f64 = 1e-4;
/// The evaluation against the training objective of the next step in the same run: the
/// same f32 weights and rows, the same micro-batches; the row (or token) log-probabilities
/// come from the forward-only head instead of the training head, which sum the same f32
/// token terms (measured: the same bits). The objective is then the same f64 function of
/// them ([`mt::objective::dpo::pair_terms`], [`mt::objective::grpo::token_terms`]), its sum taken over the whole
/// set at once instead of per micro-batch and worker: f64 reassociation of a handful of
/// O(1) terms, ≤ 1e-15 relative; held to 1e-12.
const SAME_RUN_TOL: f64 = 1e-12;

/// `lines` of `src` (0-based, end exclusive) written to `dir/name`.
fn lines_of(src: &Path, lines: std::ops::Range<usize>, dir: &Path, name: &str) -> PathBuf {
    let text = std::fs::read_to_string(src).unwrap();
    let picked: Vec<&str> = text.lines().skip(lines.start).take(lines.len()).collect();
    assert_eq!(picked.len(), lines.len(), "{}", src.display());
    let path = dir.join(name);
    std::fs::write(&path, picked.join("\n") + "\n").unwrap();
    path
}

/// A golden case run with `eval` as its eval set, evaluated every `every` steps.
fn run_case(
    case: &Path,
    eval: &Path,
    tag: &str,
    workers: usize,
    accum: usize,
    steps: u64,
    every: u64,
) -> Vec<serde_json::Value> {
    let m = scratch(&format!("eval-stages-{tag}")).join("metrics.jsonl");
    run_cpu_ok(
        &case.join("run.yaml"),
        workers,
        &m,
        &[
            "--set",
            &format!("dataset.eval_path={}", eval.display()),
            "--set",
            &format!("training.eval_steps={every}"),
            "--set",
            &format!("training.num_steps={steps}"),
            "--set",
            &format!("training.gradient_accumulation_steps={accum}"),
        ],
    );
    metrics(&m)
}

fn num(row: &serde_json::Value, key: &str) -> f64 {
    row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no `{key}` in {row}"))
}

fn rel(a: f64, b: f64, scale: f64) -> f64 {
    (a - b).abs() / scale.abs().max(1e-30)
}

/// The eval keys' bits of every evaluated step.
fn eval_bits(rows: &[serde_json::Value], keys: &[&str]) -> Vec<Vec<u64>> {
    rows.iter()
        .filter(|r| r.get("eval_loss").is_some())
        .map(|r| keys.iter().map(|k| num(r, k).to_bits()).collect())
        .collect()
}

const DPO_EVAL_KEYS: [&str; 7] = [
    "eval_loss",
    "eval_rewards/chosen",
    "eval_rewards/rejected",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "eval_logps/chosen",
    "eval_logps/rejected",
];

#[test]
fn dpo_eval_is_the_dpo_objective_of_held_out_pairs() {
    // 12 pairs, batch 4, no shuffle: step 2 trains on pairs 4..8, the eval set.
    let case = golden_dir().join("dpo/llama_sigmoid");
    let dir = scratch("eval-stages-dpo-data");
    let eval = lines_of(&case.join("pairs.jsonl"), 4..8, &dir, "eval.jsonl");
    let one = run_case(&case, &eval, "dpo-w1ga2", 1, 2, 2, 1);
    let want = json(&case.join("expected.json"));
    assert_eq!(one.len(), 2);
    let (after1, step2) = (&one[0], &one[1]);
    let losses = f64_array(&want["losses"]);
    let e = rel(num(after1, "eval_loss"), losses[1], losses[1]);
    eprintln!("dpo eval loss after step 1 vs torch's step-2 loss: rel {e:.2e}");
    assert!(e <= TORCH_TOL, "{after1} vs torch {losses:?}");
    for key in ["rewards/chosen", "rewards/rejected", "rewards/margins"] {
        let (ours, theirs) = (
            num(after1, &format!("eval_{key}")),
            f64_array(&want[key])[1],
        );
        assert!(
            (ours - theirs).abs() <= TORCH_TOL,
            "eval_{key} {ours} vs torch {theirs}"
        );
    }
    // Summed f32 log-probabilities of up to 20 tokens: relative, as the loss.
    for key in ["logps/chosen", "logps/rejected"] {
        let (ours, theirs) = (
            num(after1, &format!("eval_{key}")),
            f64_array(&want[key])[1],
        );
        let e = rel(ours, theirs, theirs);
        assert!(
            e <= TORCH_TOL,
            "eval_{key} {ours} vs torch {theirs} (rel {e:.2e})"
        );
    }
    // Away from the reference, whether a pair is accurate is not rounding: exact.
    let acc = f64_array(&want["rewards/accuracies"])[1];
    assert_eq!(num(after1, "eval_rewards/accuracies"), acc);
    // The same pairs under the same weights: step 2's training objective.
    for key in DPO_EVAL_KEYS {
        let train = match key {
            "eval_loss" => "loss",
            k => k.strip_prefix("eval_").unwrap(),
        };
        let (a, b) = (num(after1, key), num(step2, train));
        let e = rel(a, b, b);
        eprintln!("dpo {key} after step 1 vs step 2's {train}: {a} vs {b}, rel {e:.2e}");
        assert!(e <= SAME_RUN_TOL, "{key} {a} vs step 2's {train} {b}");
    }
    // The pairs' log-probabilities are summed label log-probabilities: negative.
    assert!(num(after1, "eval_logps/chosen") < 0.0 && num(step2, "logps/rejected") < 0.0);
    // W workers evaluate as one worker accumulating W.
    let two = run_case(&case, &eval, "dpo-w2", 2, 1, 2, 1);
    assert_eq!(
        eval_bits(&one, &DPO_EVAL_KEYS),
        eval_bits(&two, &DPO_EVAL_KEYS)
    );
}

#[test]
fn grpo_eval_is_the_on_policy_loss_of_held_out_rollouts() {
    // 24 rollouts in groups of 3, batch 6 (groups 2i, 2i + 1), two iterations per batch,
    // no shuffle: step 3 is batch 1's first step (ratio 1) on rollouts 6..12, the eval set,
    // with a KL term (β 0.5) against the initial model.
    let case = golden_dir().join("grpo/llama_dapo_kl");
    let dir = scratch("eval-stages-grpo-data");
    let eval = lines_of(&case.join("rollouts.jsonl"), 6..12, &dir, "eval.jsonl");
    let one = run_case(&case, &eval, "grpo-w1ga2", 1, 2, 3, 2);
    let want = json(&case.join("expected.json"));
    assert_eq!(one.len(), 3);
    let (after2, step3) = (&one[1], &one[2]);
    let losses = f64_array(&want["losses"]);
    // The loss can be ~0 (advantages sum to 0 in a group): relative to the run's scale.
    let scale = losses.iter().map(|x| x.abs()).fold(0.0, f64::max);
    let e = rel(num(after2, "eval_loss"), losses[2], scale);
    eprintln!("grpo eval loss after step 2 vs torch's step-3 loss: {e:.2e} of the scale");
    assert!(e <= TORCH_TOL, "{after2} vs torch {losses:?}");
    let kl = f64_array(&want["kl"])[2];
    let e = rel(num(after2, "eval_kl"), kl, kl);
    assert!(
        e <= TORCH_TOL,
        "eval_kl {after2} vs torch {kl} (rel {e:.2e})"
    );
    // The same rollouts under the same weights: step 3's training objective.
    for (key, train) in [("eval_loss", "loss"), ("eval_kl", "kl")] {
        let (a, b) = (num(after2, key), num(step3, train));
        let e = rel(a, b, scale.max(b.abs()));
        eprintln!("grpo {key} after step 2 vs step 3's {train}: {a} vs {b}, {e:.2e}");
        assert!(e <= SAME_RUN_TOL, "{key} {a} vs step 3's {train} {b}");
    }
    // The eval rollouts' mean reward, from the file.
    let rewards: Vec<f64> = std::fs::read_to_string(&eval)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["reward"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    assert_eq!(num(after2, "eval_reward"), mean);
    assert!(one[0].get("eval_loss").is_none(), "evaluated every 2 steps");
    let keys = ["eval_loss", "eval_kl", "eval_reward"];
    let two = run_case(&case, &eval, "grpo-w2", 2, 1, 3, 2);
    assert_eq!(eval_bits(&one, &keys), eval_bits(&two, &keys));
    // `dataset.val_size` holds out whole groups (2 of the 8 groups of 3), before any work.
    let out = run(&[
        "--config",
        path_str(&case.join("run.yaml")),
        "--gpus",
        "0",
        "--dry-run",
        "--set",
        "dataset.val_size=2",
    ]);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && log.contains("18 completions in 6 groups")
            && log.contains("eval set: 6 completions held out of the training groups"),
        "{log}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&[
        "--config",
        path_str(&case.join("run.yaml")),
        "--gpus",
        "0",
        "--dry-run",
        "--set",
        "dataset.val_size=8",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("dataset.val_size")
            && err.contains("holds out 8 of the 8 groups of completions"),
        "{err}"
    );
}

/// A run checkpointed and resumed evaluates as the straight run, bit for bit: the eval
/// pairs' reference log-probabilities (of the initial weights, gone by then) come from the
/// checkpoint's `dpo_eval_reference.safetensors`.
#[test]
fn dpo_eval_resumes_with_the_saved_eval_reference() {
    let case = golden_dir().join("dpo/llama_sigmoid");
    let dir = scratch("eval-stages-dpo-resume");
    let eval = lines_of(&case.join("pairs.jsonl"), 0..4, &dir, "eval.jsonl");
    let ck = format!("checkpoint.dir={}", dir.join("ck").display());
    let run = |tag: &str, extra: &[&str]| {
        let m = dir.join(format!("{tag}.jsonl"));
        let mut args = vec![
            "--set".to_string(),
            format!("dataset.eval_path={}", eval.display()),
            "--set".into(),
            "training.eval_steps=1".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_cpu_ok(&case.join("run.yaml"), 1, &m, &args);
        (
            eval_bits(&metrics(&m), &DPO_EVAL_KEYS),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let (straight, _) = run("straight", &[]);
    let (first, _) = run("first", &["--set", "training.num_steps=2", "--set", &ck]);
    let saved = dir.join("ck/step-00000002/dpo_eval_reference.safetensors");
    assert!(saved.is_file(), "{} is written", saved.display());
    let (second, log) = run("second", &["--set", &ck, "--resume", "latest"]);
    assert!(
        log.contains("DPO reference log-probabilities of 4 eval pairs: read from")
            && !log.contains("DPO reference pass"),
        "{log}"
    );
    let resumed: Vec<Vec<u64>> = first.into_iter().chain(second).collect();
    assert_eq!(
        resumed, straight,
        "resumed eval bits differ from the straight run's"
    );
}

/// LlamaFactory's DPO example (examples/train_full/…_dpo.yaml's keys) with its eval
/// section switched on, on the tiny pretrained model and the demo pairs.
#[test]
fn llamafactory_dpo_yaml_with_val_size_evaluates() {
    let dir = scratch("eval-stages-lf-dpo");
    let model = dir.join("model");
    tiny_pretrained(&model);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
    let tb = dir.join("tb");
    let yaml = format!(
        "\
### model
model_name_or_path: {model}
trust_remote_code: true

### method
stage: dpo
do_train: true
finetuning_type: full
pref_beta: 0.1
pref_loss: sigmoid  # choices: [sigmoid (dpo), orpo, simpo]

### dataset
dataset: dpo_demo
dataset_dir: {data}
template: qwen
cutoff_len: 128
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 2

### output
output_dir: {out}
logging_steps: 1
plot_loss: false
overwrite_output_dir: true
report_to: tensorboard
logging_dir: {tb}

### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
learning_rate: 5.0e-6
max_steps: 2
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: false

### eval
val_size: 0.1
per_device_eval_batch_size: 1
eval_strategy: steps
eval_steps: 1
",
        model = model.display(),
        data = data.display(),
        out = dir.join("out").display(),
        tb = tb.display(),
    );
    let config = dir.join("dpo.yaml");
    std::fs::write(&config, yaml).unwrap();
    let m = dir.join("metrics.jsonl");
    let out = run_cpu_ok(&config, 1, &m, &[]);
    let log = String::from_utf8_lossy(&out.stdout);
    // 48 demo pairs: 0.1 rounds up to 5 held out, whole pairs (10 rows).
    assert!(
        log.contains("eval set: 5 preference pairs held out of the training pairs"),
        "{log}"
    );
    assert!(
        log.contains("DPO reference pass: 5 eval pairs (10 rows"),
        "{log}"
    );
    assert!(log.contains("eval rewards: accuracy"), "{log}");
    let rows = metrics(&m);
    assert_eq!(rows.len(), 2);
    let scalars = read_tensorboard(&tb);
    for key in DPO_EVAL_KEYS {
        let tag = key.replacen("eval_", "eval/", 1);
        let series = tensorboard_series(&scalars, &tag);
        assert_eq!(series.len(), 2, "{tag}");
        for (p, r) in series.iter().zip(&rows) {
            assert!(num(r, key).is_finite(), "{key} in {r}");
            assert_eq!(p[1].as_f64().unwrap() as f32, num(r, key) as f32, "{tag}");
        }
    }
    // Warm-up makes step 1's learning rate 0: the weights are still the initial ones, and
    // the eval pairs' log-probabilities are their references' bits (the reference pass cut
    // them into the evaluation's micro-batches), so every reward is 0 and the loss log 2.
    let first = &rows[0];
    assert_eq!(num(first, "lr"), 0.0, "{first}");
    for key in ["eval_rewards/chosen", "eval_rewards/rejected"] {
        assert_eq!(num(first, key), 0.0, "{key} in {first}");
    }
    assert_eq!(num(first, "eval_loss"), std::f64::consts::LN_2, "{first}");
    assert_ne!(
        num(&rows[1], "eval_rewards/margins"),
        0.0,
        "step 2 updated the weights"
    );
}
