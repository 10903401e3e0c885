//! The launcher's resident peak against its host plan (tests/host_peak.rs on one node,
//! tests/nodes_memory.rs per node): the Qwen2.5-0.5B architecture trained from a config of
//! two-token rows, and the `host memory: launcher peak` lines each launcher prints at exit.

use std::path::{Path, PathBuf};

/// A run config in `dir` for configs/qwen2.5-0.5b (random init, bf16) over `rows` rows of
/// two tokens (one label each, so a bf16 step on CPU stays short), `batch` rows a step. It
/// writes no model (`save_model: false`): each case says where its checkpoints go, if
/// anywhere (a checkpoint of this model is 7 GB).
pub fn qwen_0_5b_config(dir: &Path, rows: usize, batch: usize) -> PathBuf {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen2.5-0.5b");
    let data = dir.join("data.jsonl");
    let lines: String = (0..rows)
        .map(|i| format!("{{\"input_ids\": [151643, {}]}}\n", 20 + i))
        .collect();
    std::fs::write(&data, lines).unwrap();
    let config = dir.join("run.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{path: {}, init: random, dtype: bfloat16}}\n\
             dataset: {{format: tokenized, path: {}, shuffle: false}}\n\
             training: {{batch_size: {batch}, num_steps: 1, learning_rate: 1.0e-5, save_model: false}}\n",
            model.display(),
            data.display()
        ),
    )
    .unwrap();
    config
}

/// Every (plan total, launcher peak) the run printed, in bytes: one per launcher.
pub fn plans_and_peaks(stdout: &str) -> Vec<(f64, f64)> {
    let gb = |line: &str, key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len()..];
        rest.split_whitespace()
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
            * 1e9
    };
    stdout
        .lines()
        .filter(|l| l.starts_with("host memory: launcher peak"))
        .map(|l| (gb(l, "plan "), gb(l, "launcher peak ")))
        .collect()
}

/// Fails unless `peak` is within 3% of `plan` (the bound host_peak.rs explains).
pub fn assert_peak_is_plan(name: &str, plan: f64, peak: f64, stdout: &str) {
    let ratio = peak / plan;
    println!(
        "{name}: launcher peak {:.3} GB, plan {:.3} GB ({ratio:.4}x)",
        peak / 1e9,
        plan / 1e9
    );
    assert!(
        (0.97..=1.03).contains(&ratio),
        "{name}: launcher peak {:.3} GB is {ratio:.4}x the plan's {:.3} GB\n{stdout}",
        peak / 1e9,
        plan / 1e9
    );
}
