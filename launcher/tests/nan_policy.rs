//! Non-finite steps: with `training.nan_policy: skip` the update is skipped and counted,
//! and the run aborts after `training.max_nan_steps` in a row; with `abort` it stops at the
//! first one. A learning rate of 1e30 makes the weights overflow after the first update.

mod common;

use common::*;

fn blow_up(name: &str, extra: &[&str]) -> (std::process::Output, Vec<serde_json::Value>) {
    let case = golden_dir().join("llama");
    let dir = scratch(name);
    let m = dir.join("metrics.jsonl");
    let mut args = vec![
        "--set",
        "training.learning_rate=1e30",
        "--set",
        "training.num_steps=12",
    ];
    args.extend_from_slice(extra);
    let (out, _) = run_cpu(&case.join("run.yaml"), 2, &m, &args);
    let rows = if m.exists() { metrics(&m) } else { Vec::new() };
    (out, rows)
}

#[test]
fn skip_skips_then_aborts_after_max_nan_steps() {
    let (out, rows) = blow_up("nan-skip", &["--set", "training.max_nan_steps=3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must abort after 3 skipped steps");
    assert!(
        err.contains("4 non-finite steps in a row exceed training.max_nan_steps (3)"),
        "{err}"
    );
    let skipped: Vec<bool> = rows
        .iter()
        .map(|r| r["skipped"].as_bool().unwrap())
        .collect();
    assert_eq!(
        skipped,
        [false, true, true, true],
        "step 1 updates, then 3 skips are recorded"
    );
    // A skipped update leaves the weights alone: the same batch gives the same loss.
    let loss = column(&rows[1..], "loss");
    assert!(loss.iter().all(|l| l.is_finite()));
}

#[test]
fn abort_stops_at_the_first_non_finite_step() {
    let (out, rows) = blow_up("nan-abort", &["--set", "training.nan_policy=abort"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("step 2:") && err.contains("training.nan_policy: abort"),
        "{err}"
    );
    assert_eq!(rows.len(), 1, "only the finite first step is reported");
}

#[test]
fn unknown_policy_is_named() {
    let (out, rows) = blow_up("nan-bad", &["--set", "training.nan_policy=ignore"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(rows.is_empty(), "a rejected config starts nothing");
    assert!(
        err.contains("training.nan_policy") && err.contains("unknown variant"),
        "{err}"
    );
}
