//! Evaluation, TensorBoard and the picture of a run.
//!
//! - The eval loss after every step equals PyTorch's on the same rows under the same
//!   weights (scripts/make_golden.py trains the llama case with torch.optim.AdamW and
//!   evaluates its `eval.jsonl` after each step), to the golden tolerance.
//! - 2 workers evaluate exactly as 1 worker accumulating 2 does (bit for bit, f32 on CPU).
//! - A run on a hub-cache dataset with `dataset.val_size` and `report_to: tensorboard`:
//!   the eval loss of the held-out samples equals transformers' (per-row losses from
//!   scripts/make_data_fixtures.py), TensorBoard's own reader reads back every scalar the
//!   metrics hold, and the picture is written beside the metrics (and by `report`).

mod common;

use std::path::Path;

use common::*;

/// As tests/golden.rs: float32 against PyTorch through a few layers and steps.
const F32_TOL: f64 = 1e-4;

fn label_tokens(jsonl: &Path) -> u64 {
    std::fs::read_to_string(jsonl)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let labels = v.get("labels").unwrap_or(&v["input_ids"]);
            let labels = labels.as_array().unwrap();
            labels[1..]
                .iter()
                .filter(|x| x.as_i64() != Some(-100))
                .count() as u64
        })
        .sum()
}

/// The llama golden case with its eval set evaluated after every step.
fn llama_with_eval(tag: &str, workers: usize, accum: usize) -> Vec<serde_json::Value> {
    let case = golden_dir().join("llama");
    let m = scratch(&format!("eval-{tag}")).join("metrics.jsonl");
    run_cpu_ok(
        &case.join("run.yaml"),
        workers,
        &m,
        &[
            "--set",
            &format!("dataset.eval_path={}", case.join("eval.jsonl").display()),
            "--set",
            "training.eval_steps=1",
            "--set",
            &format!("training.gradient_accumulation_steps={accum}"),
        ],
    );
    metrics(&m)
}

#[test]
fn eval_loss_after_every_step_matches_pytorch() {
    let case = golden_dir().join("llama");
    let want = f64_array(&json(&case.join("expected.json"))["eval_losses"]);
    let rows = llama_with_eval("torch", 1, 1);
    let ours = column(&rows, "eval_loss");
    let e = worst_rel(&ours, &want);
    assert!(
        e <= F32_TOL,
        "eval losses {ours:?} vs torch {want:?} (rel {e:.2e})"
    );
    let tokens = label_tokens(&case.join("eval.jsonl"));
    assert!(
        column(&rows, "eval_tokens")
            .iter()
            .all(|&t| t == tokens as f64)
    );
    // Training is untouched by the evaluations between its steps.
    let losses = f64_array(&json(&case.join("expected.json"))["losses"]);
    assert!(worst_rel(&column(&rows, "loss"), &losses) <= F32_TOL);
}

#[test]
fn two_workers_evaluate_as_one_worker_accumulating_two() {
    let bits = |rows: &[serde_json::Value], key| {
        column(rows, key)
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>()
    };
    let (two, one) = (llama_with_eval("w2", 2, 1), llama_with_eval("w1ga2", 1, 2));
    assert_eq!(bits(&two, "eval_loss"), bits(&one, "eval_loss"));
    assert_eq!(bits(&two, "loss"), bits(&one, "loss"));
}

#[test]
fn hub_dataset_with_val_size_and_tensorboard() {
    let fx = data_fixtures("row_losses_alpaca_demo.json");
    let dir = scratch("eval-hub-tensorboard");
    let (tb, m) = (dir.join("tb"), dir.join("metrics.jsonl"));
    let config = dir.join("run.yaml");
    // Learning rate 0: the weights stay transformers' own, so the eval loss is known.
    std::fs::write(
        &config,
        format!(
            "model: {{path: {}, dtype: float32}}\n\
             dataset: {{name: alpaca_hub, dataset_dir: {}, system_prompt: Be exact., val_size: 0.1}}\n\
             training: {{batch_size: 8, num_steps: 4, learning_rate: 0.0, eval_steps: 2, seed: 3}}\n\
             logging: {{report_to: tensorboard, logging_dir: {}}}\n",
            fx.join("model-tiny").display(),
            fx.display(),
            tb.display()
        ),
    )
    .unwrap();
    let out = mt_launch()
        .env("HF_HUB_CACHE", fx.join("hub"))
        .args([
            "--config",
            path_str(&config),
            "--gpus",
            "0",
            "--workers",
            "2",
        ])
        .args(["--metrics-out", path_str(&m)])
        .output()
        .unwrap();
    assert_ok(&out, &["(hub + val_size + tensorboard run)"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("eval set: 20 samples held out"), "{stdout}");
    assert!(
        stdout.contains("eval_loss"),
        "progress lines show the eval:\n{stdout}"
    );

    // The eval loss of the held-out samples: transformers' per-row losses, summed.
    let rows = metrics(&m);
    let losses = json(&fx.join("row_losses_alpaca_demo.json"));
    let held = mt::data::held_out(200, 20, 3);
    let (mut sum, mut tokens) = (0.0, 0u64);
    for i in (0..200).filter(|&i| held[i]) {
        sum += losses[i]["loss_sum"].as_f64().unwrap();
        tokens += losses[i]["tokens"].as_u64().unwrap();
    }
    let evals: Vec<(u64, f64, u64)> = rows
        .iter()
        .filter(|r| r.get("eval_loss").is_some())
        .map(|r| {
            let (s, l, t) = (&r["step"], &r["eval_loss"], &r["eval_tokens"]);
            (
                s.as_u64().unwrap(),
                l.as_f64().unwrap(),
                t.as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        evals.iter().map(|e| (e.0, e.2)).collect::<Vec<_>>(),
        [(2, tokens), (4, tokens)]
    );
    let want = sum / tokens as f64;
    let e = worst_rel(&[evals[0].1], &[want]);
    assert!(
        e <= F32_TOL,
        "eval loss {} vs transformers {want} (rel {e:.2e})",
        evals[0].1
    );
    assert_eq!(evals[0].1.to_bits(), evals[1].1.to_bits(), "same weights");

    // TensorBoard reads back what the metrics say, step for step (f32 values).
    let scalars = read_tensorboard(&tb);
    let series = |tag: &str| -> Vec<(u64, f32)> {
        let s = scalars
            .get(tag)
            .unwrap_or_else(|| panic!("no `{tag}` in {:?}", scalars.keys()));
        s.as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect()
    };
    let from_metrics = |key: &str, scale: f64| -> Vec<(u64, f32)> {
        rows.iter()
            .filter_map(|r| Some((r["step"].as_u64()?, (r.get(key)?.as_f64()? * scale) as f32)))
            .collect()
    };
    for (tag, key, scale) in [
        ("train/loss", "loss", 1.0),
        ("train/learning_rate", "lr", 1.0),
        ("train/grad_norm", "grad_norm", 1.0),
        ("train/tokens_per_s", "tokens_per_s", 1.0),
        ("perf/tflops_megatrain", "tflops_megatrain", 1.0),
        ("perf/tflops_model", "tflops_model", 1.0),
        ("time/step_s", "step_time_s", 1.0),
        ("time/forward_s", "forward_s", 1.0),
        ("time/backward_s", "backward_s", 1.0),
        ("time/reduce_s", "reduce_s", 1.0),
        ("time/optimizer_s", "optimizer_s", 1.0),
        ("memory/peak_gpu_gb", "peak_gpu_bytes", 1e-9),
        (
            "memory/launcher_peak_rss_gb",
            "launcher_peak_rss_bytes",
            1e-9,
        ),
        ("eval/loss", "eval_loss", 1.0),
    ] {
        let (ours, want) = (series(tag), from_metrics(key, scale));
        assert_eq!(ours.len(), want.len(), "{tag}");
        for ((s, v), (ws, wv)) in ours.iter().zip(&want) {
            assert_eq!(s, ws, "{tag}: steps");
            let tol = wv.abs() * 1e-6;
            assert!((v - wv).abs() <= tol, "{tag} at step {s}: {v} vs {wv}");
        }
    }

    // The picture beside the metrics, and the same from `report`.
    let svg = std::fs::read_to_string(m.with_extension("svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
    let again = dir.join("again.svg");
    run_ok(&["report", path_str(&m), "--out", path_str(&again)]);
    assert_eq!(std::fs::read_to_string(&again).unwrap(), svg);
}
