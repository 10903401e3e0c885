//! The preference and reinforcement stages' golden cases (scripts/golden_dpo.py and
//! scripts/golden_grpo.py, under `<golden>/dpo` and `<golden>/grpo`): listing them, running
//! one and comparing its step-1 gradients with torch's; and reading TensorBoard back.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

/// The golden cases of `training.stage: <stage>` (each a folder with `expected.json`),
/// sorted; there must be `count` of them.
pub fn stage_cases(stage: &str, count: usize) -> Vec<PathBuf> {
    let dir = golden_dir().join(stage);
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/make_golden.py)", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    cases.sort();
    let what = stage.to_uppercase();
    assert_eq!(cases.len(), count, "the {what} golden cases");
    cases
}

/// One run of a stage's golden case, as its check reads it.
pub struct StageRun {
    /// `<case> <workers>w`, to name the run in messages.
    pub name: String,
    /// The run's metrics, one row a step.
    pub rows: Vec<serde_json::Value>,
    /// The case's `expected.json`, computed by torch.
    pub want: serde_json::Value,
    /// The step-1 gradients (`--dump-grads`).
    pub grads: Tensors,
}

/// Runs golden case `case` of `stage` (a folder from [`stage_cases`]) with `workers` CPU
/// workers; it must succeed.
pub fn run_stage_case(stage: &str, case: &Path, workers: usize) -> StageRun {
    let name = format!("{} {workers}w", case.file_name().unwrap().to_string_lossy());
    let dir = scratch(&format!("{stage}-golden-{}", name.replace(' ', "-")));
    let (m, g) = (dir.join("m.jsonl"), dir.join("grads.safetensors"));
    run_cpu_ok(
        &case.join("run.yaml"),
        workers,
        &m,
        &["--dump-grads", path_str(&g)],
    );
    StageRun {
        want: json(&case.join("expected.json")),
        rows: metrics(&m),
        grads: tensors(&g),
        name,
    }
}

impl StageRun {
    /// Compares every step-1 gradient with torch's (`grads0.safetensors` of `case`),
    /// ‖ours − torch‖ / ‖torch‖ within `tol`, pushing each mismatch (and a missing or extra
    /// tensor) onto `failures`; returns the worst error.
    pub fn check_grads(&self, case: &Path, tol: f64, failures: &mut Vec<String>) -> f64 {
        let (name, ours) = (&self.name, &self.grads);
        let torch = tensors(&case.join("grads0.safetensors"));
        if ours.len() != torch.len() {
            failures.push(format!(
                "{name}: {} gradient tensors, torch has {}",
                ours.len(),
                torch.len()
            ));
        }
        let mut worst = 0.0f64;
        for (t, want) in &torch {
            match ours.get(t) {
                None => failures.push(format!("{name}: no gradient for `{t}`")),
                Some(got) => {
                    let e = rel_l2(got, want);
                    worst = worst.max(e);
                    if e > tol {
                        failures.push(format!("{name}: gradient `{t}` rel error {e:.2e}"));
                    }
                }
            }
        }
        worst
    }
}

/// The standard output of the repository's `scripts/<script>` run with `arg` by .venv's
/// Python; fails the test with the script's stderr if it fails.
pub fn venv_script(script: &str, arg: &Path) -> Vec<u8> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("scripts").join(script))
        .arg(arg)
        .output()
        .expect("run .venv/bin/python (scripts/setup.sh makes it)");
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// What TensorBoard's EventAccumulator reads from `dir` (scripts/read_tensorboard.py):
/// tag -> [(step, value)].
pub fn read_tensorboard(dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    let out = venv_script("read_tensorboard.py", dir);
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    v.as_object().unwrap().clone()
}

/// The series of `tag` in TensorBoard's `scalars`; fails the test naming a missing tag.
pub fn tensorboard_series<'a>(
    scalars: &'a serde_json::Map<String, serde_json::Value>,
    tag: &str,
) -> &'a Vec<serde_json::Value> {
    scalars
        .get(tag)
        .and_then(serde_json::Value::as_array)
        .unwrap_or_else(|| panic!("no `{tag}`"))
}
