//! The update in two passes (weights before the next forward, Adam moments during the next
//! step: the default) against the update in one pass (`MT_DEFER_MOMENTS=0`): the same
//! losses, gradient norms, checkpoints and exported weights, bit for bit, in float32 on
//! CPU, whether or not clipping binds, with gradient accumulation, and across a periodic
//! checkpoint (which needs the moments of the update just made).

mod common;

use std::path::Path;

use common::*;

/// Trains the golden `llama` case for 5 steps (2 workers, 2 micro-batches each) with
/// `max_grad_norm`, one-pass or not; checkpoints at step 3 and at the end; returns the
/// metrics rows and the run's directory.
fn train(dir: &Path, tag: &str, max_grad_norm: &str, one_pass: bool) -> Vec<serde_json::Value> {
    let run = dir.join(tag);
    let metrics_path = run.join("metrics.jsonl");
    std::fs::create_dir_all(&run).unwrap();
    let sets = [
        "training.num_steps=5".to_string(),
        "training.gradient_accumulation_steps=2".to_string(),
        format!("training.max_grad_norm={max_grad_norm}"),
        format!("training.output_dir={}", run.join("out").display()),
        format!("checkpoint.dir={}", run.join("ck").display()),
        "checkpoint.every_steps=3".to_string(),
    ];
    let extra: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    let env: &[(&str, &str)] = if one_pass {
        &[("MT_DEFER_MOMENTS", "0")]
    } else {
        &[]
    };
    let config = golden_dir().join("llama").join("run.yaml");
    run_cpu_env_ok(&config, 2, &metrics_path, &extra, env);
    metrics(&metrics_path)
}

fn compare(dir: &Path, max_grad_norm: &str, expect_clipped: bool) {
    let tag = |one: bool| format!("norm-{max_grad_norm}-{}", if one { "one" } else { "two" });
    let one = train(dir, &tag(true), max_grad_norm, true);
    let two = train(dir, &tag(false), max_grad_norm, false);
    let norms = column(&one, "grad_norm");
    let limit: f64 = max_grad_norm.parse().unwrap();
    assert_eq!(
        norms.iter().all(|&n| n > limit),
        expect_clipped,
        "clipping binds on every step or on none: norms {norms:?}, max_grad_norm {limit}"
    );
    for key in ["loss", "grad_norm"] {
        let (a, b) = (column(&one, key), column(&two, key));
        let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&a),
            bits(&b),
            "{key}: one pass {a:?}, two passes {b:?}"
        );
    }
    for sub in ["out", "ck"] {
        let (a, b) = (
            files(&dir.join(tag(true)).join(sub)),
            files(&dir.join(tag(false)).join(sub)),
        );
        let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b), "{sub}: the same files");
        assert!(!a.is_empty(), "{sub} holds the written files");
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(x == y, "{sub}/{name} differs between one pass and two");
        }
    }
}

#[test]
fn two_passes_equal_one_when_clipping_binds() {
    compare(&scratch("deferred-moments-clipped"), "1e-3", true);
}

#[test]
fn two_passes_equal_one_without_clipping() {
    compare(&scratch("deferred-moments-unclipped"), "1e9", false);
}
