//! The update made during the backward on the guess that clipping will not bind
//! (`MT_SPECULATE=1` or `auto`, with an fp32 master) against the update made after it (the
//! default, `MT_SPECULATE=0`): the
//! same losses, gradient norms, checkpoints and exported weights, bit for bit, in float32
//! on CPU, whether the guess holds (clipping never binds) or fails on every step (the store
//! pass made again with the true coefficient), with gradient accumulation, across a
//! periodic checkpoint (its step updates after the backward) and a non-finite step whose
//! update is skipped (the speculative store undone).

mod common;

use std::path::Path;

use common::*;

/// Trains the golden `llama` case for 6 steps (2 workers, 2 micro-batches each) with
/// `max_grad_norm`, speculating or not; checkpoints at step 3 and at the end; returns the
/// metrics rows. `extra` adds settings.
fn train(
    dir: &Path,
    tag: &str,
    max_grad_norm: &str,
    speculate: &str,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let run = dir.join(tag);
    let metrics_path = run.join("metrics.jsonl");
    std::fs::create_dir_all(&run).unwrap();
    let sets = [
        "training.num_steps=6".to_string(),
        "training.gradient_accumulation_steps=2".to_string(),
        format!("training.max_grad_norm={max_grad_norm}"),
        format!("training.output_dir={}", run.join("out").display()),
        format!("checkpoint.dir={}", run.join("ck").display()),
        "checkpoint.every_steps=3".to_string(),
    ];
    let mut args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    args.extend(extra.iter().flat_map(|s| ["--set", s]));
    let env: &[(&str, &str)] = &[("MT_SPECULATE", speculate)];
    let config = golden_dir().join("llama").join("run.yaml");
    run_cpu_env_ok(&config, 2, &metrics_path, &args, env);
    metrics(&metrics_path)
}

/// The `speculated` field of each row: None where the update was made after the backward.
fn speculated(rows: &[serde_json::Value]) -> Vec<Option<bool>> {
    rows.iter().map(|r| r["speculated"].as_bool()).collect()
}

/// Runs with `MT_SPECULATE=0` and `mode` and compares them; `held` is what the second
/// run's steps must say of their guess.
fn compare(
    dir: &Path,
    mode: &str,
    max_grad_norm: &str,
    extra: &[&str],
    held: &[Option<bool>],
    keys: &[&str],
) {
    let tag = |s: bool| format!("norm-{max_grad_norm}-{}", if s { mode } else { "0" });
    let after = train(dir, &tag(false), max_grad_norm, "0", extra);
    let spec = train(dir, &tag(true), max_grad_norm, mode, extra);
    assert!(
        speculated(&after).iter().all(Option::is_none),
        "MT_SPECULATE=0 makes no update during the backward"
    );
    // Steps 3 (a checkpoint follows) and 6 (the last) update after the backward.
    assert_eq!(speculated(&spec), held, "what each step's guess did");
    for &key in keys {
        let (a, b) = (column(&after, key), column(&spec, key));
        let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{key}: after {a:?}, speculative {b:?}");
    }
    for sub in ["out", "ck"] {
        let (a, b) = (
            dir_files(&dir.join(tag(false)).join(sub)),
            dir_files(&dir.join(tag(true)).join(sub)),
        );
        let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b), "{sub}: the same files");
        assert!(!a.is_empty(), "{sub} holds the written files");
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(x == y, "{sub}/{name} differs with speculation");
        }
    }
}

#[test]
fn speculation_that_holds_gives_the_same_bits() {
    let s = Some(true);
    let held = [s, s, None, s, s, None];
    compare(
        &scratch("speculative-held"),
        "1",
        "1e9",
        &[],
        &held,
        &["loss", "grad_norm"],
    );
}

#[test]
fn speculation_that_fails_gives_the_same_bits() {
    let f = Some(false);
    let held = [f, f, None, f, f, None];
    compare(
        &scratch("speculative-failed"),
        "1",
        "1e-3",
        &[],
        &held,
        &["loss", "grad_norm"],
    );
}

/// A learning rate of 1e30 makes the weights overflow after the first update: every later
/// step's norm is not finite and its update skipped, after its store pass wrote non-finite
/// weights into the store, which must then hold the master again (the loss of the next
/// step reads them).
#[test]
fn a_skipped_update_undoes_its_store_pass() {
    let extra = ["training.learning_rate=1e30", "training.max_nan_steps=6"];
    let f = Some(false);
    let held = [Some(true), f, None, f, f, None];
    compare(
        &scratch("speculative-skipped"),
        "1",
        "1e9",
        &extra,
        &held,
        &["loss"],
    );
}

/// With `auto` a step speculates only after a step whose update was not clipped:
/// not at the first step, not while clipping binds.
#[test]
fn auto_speculates_after_an_unclipped_step() {
    let s = Some(true);
    let held = [None, s, None, s, s, None];
    compare(
        &scratch("speculative-auto"),
        "auto",
        "1e9",
        &[],
        &held,
        &["loss"],
    );
    compare(
        &scratch("speculative-auto"),
        "auto",
        "1e-3",
        &[],
        &[None; 6],
        &["loss"],
    );
}
