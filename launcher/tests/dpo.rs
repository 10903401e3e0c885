//! `training.stage: dpo` end to end, against TRL's DPO loss computed in torch
//! (scripts/make_golden.py's DPO cases: tiny Llama with the sigmoid loss, Qwen3 with tied
//! embeddings and the ipo loss, Gemma 2 with soft-caps and label smoothing; float32):
//! per-step loss and gradient norm, TRL's reward and log-probability metrics and every
//! step-1 gradient, with 1
//! and 2 CPU workers; 2 workers equal 1 worker accumulating 2 bit for bit; a checkpointed
//! and resumed run equals the straight one bit for bit without redoing the reference pass;
//! bad settings are refused naming the key.

mod common;

use std::path::Path;

use common::*;

/// Step 1's loss, gradient norm and every gradient (‖ours − torch‖ / ‖torch‖). Both sides
/// compute in float32 from the same weights; the reference log-probabilities and the
/// policy's differ from torch's by rounding alone (torch sums each row's token
/// log-probabilities in one padded batch, we in chunks, in f64 from f32 terms): measured
/// ≤ 1e-6 relative on these cases. A wrong term (a missing 1/pairs, the rejected row's
/// sign, IPO without its per-token average, label smoothing left out) is O(1e-1) or more.
const TOL: f64 = 1e-5;
/// Steps 2 and 3 start from weights that AdamW's first update moved by lr · g / (|g| +
/// eps) elementwise: where a gradient element is at the rounding level, rounding alone
/// decides its sign, so the two runs' weights part by up to 2 lr in those elements and
/// the losses and norms after it by ~1e-5 (measured 1.2e-5 on the soft-capped Gemma 2);
/// golden.rs's 1e-4 applies, as for every SFT step.
const LATER_TOL: f64 = 1e-4;
/// Rewards are β × a difference of two summed log-probabilities of up to 20 tokens (each
/// |log p| ≲ 5): f32 rounding of those sums (≲ 2e-5 absolute) times β ≤ 0.5 bounds their
/// error at step 1 by 1e-5 absolute (a relative error is meaningless there, where they are
/// 0 up to rounding); after it, by the same argument as [`LATER_TOL`], 1e-4.
const REWARD_TOL: [f64; 2] = [1e-5, 1e-4];

#[test]
fn dpo_matches_trl_loss_in_torch() {
    let mut failures = Vec::new();
    for case in &stage_cases("dpo", 3) {
        for workers in [1, 2] {
            check(case, workers, &mut failures);
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn check(case: &Path, workers: usize, failures: &mut Vec<String>) {
    let run = run_stage_case("dpo", case, workers);
    let (name, rows, want) = (&run.name, &run.rows, &run.want);
    // TRL's logps/chosen and logps/rejected: means of summed f32 log-probabilities, held
    // to the loss's relative tolerances.
    for (ours, theirs) in [
        ("loss", "losses"),
        ("grad_norm", "grad_norms"),
        ("logps/chosen", "logps/chosen"),
        ("logps/rejected", "logps/rejected"),
    ] {
        let (a, b) = (column(rows, ours), f64_array(&want[theirs]));
        let (first, later) = (worst_rel(&a[..1], &b[..1]), worst_rel(&a[1..], &b[1..]));
        eprintln!("dpo {name}: {ours} rel error {first:.2e} at step 1, {later:.2e} after");
        if first > TOL || later > LATER_TOL {
            failures.push(format!(
                "{name}: {ours} {a:?} vs torch {b:?} (rel {first:.2e}, {later:.2e})"
            ));
        }
    }
    for key in ["rewards/chosen", "rewards/rejected", "rewards/margins"] {
        let (a, b) = (column(rows, key), f64_array(&want[key]));
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            if (x - y).abs() > REWARD_TOL[step.min(1)] {
                failures.push(format!(
                    "{name}: {key} {a:?} vs torch {b:?} at step {}",
                    step + 1
                ));
            }
        }
    }
    // At step 1 every pair sits at the reference (chosen and rejected rewards 0 up to
    // rounding), so whether it counts as accurate is rounding; after that, exactly.
    let (a, b) = (
        column(rows, "rewards/accuracies"),
        f64_array(&want["rewards/accuracies"]),
    );
    if a[1..] != b[1..] {
        failures.push(format!("{name}: rewards/accuracies {a:?} vs torch {b:?}"));
    }
    let worst = run.check_grads(case, TOL, failures);
    eprintln!("dpo {name}: worst step-1 gradient rel error {worst:.2e}");
}

type Run = (Vec<Vec<u64>>, Tensors);

/// The per-step loss and reward bits and the final weights of the Llama DPO case.
fn train(tag: &str, workers: usize, accum: usize, extra: &[&str]) -> Run {
    let case = golden_dir().join("dpo/llama_sigmoid");
    let dir = scratch(&format!("dpo-equiv-{tag}"));
    let (m, out) = (dir.join("metrics.jsonl"), dir.join("model"));
    let mut args = vec![
        "--set".to_string(),
        format!("training.gradient_accumulation_steps={accum}"),
        "--set".into(),
        "training.num_steps=4".into(),
        "--set".into(),
        format!("training.output_dir={}", out.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cpu_ok(&case.join("run.yaml"), workers, &m, &args);
    (bits(&m), tensors(&out.join("model.safetensors")))
}

/// Per step: the bits of the loss and of each reward metric.
fn bits(m: &Path) -> Vec<Vec<u64>> {
    metrics(m)
        .iter()
        .map(|r| {
            [
                "loss",
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "rewards/margins",
            ]
            .iter()
            .map(|k| r[k].as_f64().unwrap().to_bits())
            .collect()
        })
        .collect()
}

fn assert_same(a: &Run, b: &Run) {
    assert_eq!(a.0, b.0, "per-step loss and reward bits differ");
    assert_eq!(a.1.len(), b.1.len());
    assert_same_bits(&a.1, &b.1, "");
}

/// Bit for bit, as launcher/tests/equivalence.rs for SFT: single-threaded CPU workers,
/// slabs summed in accumulation order, the workers' sums added in rank order; and the
/// reference pass cut into the same micro-batches whatever the worker count.
#[test]
fn two_workers_equal_one_worker_accumulating_two() {
    assert_same(&train("w2", 2, 1, &[]), &train("w1ga2", 1, 2, &[]));
}

/// The rewards reach TensorBoard (TRL's tags under `train/`) as the metrics file has them,
/// read back by TensorBoard's own EventAccumulator (scripts/read_tensorboard.py); the step
/// lines show them too.
#[test]
fn rewards_reach_tensorboard_and_the_step_lines() {
    let case = golden_dir().join("dpo/llama_sigmoid/run.yaml");
    let dir = scratch("dpo-tensorboard");
    let (tb, m) = (dir.join("tb"), dir.join("metrics.jsonl"));
    let out = run_cpu_ok(
        &case,
        1,
        &m,
        &[
            "--set",
            "logging.report_to=tensorboard",
            "--set",
            &format!("logging.logging_dir={}", tb.display()),
        ],
    );
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(log.contains("rewards: accuracy"), "{log}");
    let scalars = read_tensorboard(&tb);
    let rows = metrics(&m);
    for key in [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
    ] {
        let tag = format!("train/{key}");
        let series = tensorboard_series(&scalars, &tag);
        assert_eq!(series.len(), rows.len(), "{tag}");
        for (p, r) in series.iter().zip(&rows) {
            assert_eq!(p[0], r["step"], "{tag}");
            let want = r[key].as_f64().unwrap() as f32;
            assert_eq!(
                p[1].as_f64().unwrap() as f32,
                want,
                "{tag} at step {}",
                p[0]
            );
        }
    }
}

#[test]
fn resume_continues_exactly_with_the_saved_reference() {
    let case = golden_dir().join("dpo/llama_sigmoid/run.yaml");
    let dir = scratch("dpo-resume");
    let ck = format!("checkpoint.dir={}", dir.join("ck").display());
    let run = |tag: &str, extra: &[&str]| {
        let m = dir.join(format!("{tag}.jsonl"));
        let out = run_cpu_ok(&case, 2, &m, extra);
        (bits(&m), String::from_utf8_lossy(&out.stdout).to_string())
    };
    let (straight, _) = run("straight", &["--set", "training.num_steps=6"]);
    let (first, log) = run(
        "first",
        &[
            "--set",
            "training.num_steps=3",
            "--set",
            &ck,
            "--set",
            "checkpoint.every_steps=2",
        ],
    );
    assert!(log.contains("DPO reference pass: 12 pairs"), "{log}");
    let saved = dir.join("ck/step-00000003/dpo_reference.safetensors");
    assert!(saved.is_file(), "{} is written", saved.display());
    // From the background checkpoint of step 2, too (before the resumed run below prunes it).
    let (from2, _) = run(
        "from2",
        &[
            "--set",
            "training.num_steps=6",
            "--resume",
            path_str(&dir.join("ck/step-00000002")),
        ],
    );
    assert_eq!(from2, straight[2..], "resumed from step 2");
    let (second, log) = run(
        "second",
        &[
            "--set",
            "training.num_steps=6",
            "--set",
            &ck,
            "--resume",
            "latest",
        ],
    );
    assert!(
        log.contains("DPO reference log-probabilities of 12 pairs: read from")
            && !log.contains("DPO reference pass"),
        "{log}"
    );
    let resumed: Vec<Vec<u64>> = first.into_iter().chain(second).collect();
    assert_eq!(
        resumed, straight,
        "resumed loss and reward bits differ from the straight run's"
    );

    // Other data: refused as a changed dataset (the checkpoint's fingerprint of its files);
    // accepted as such with --resume-changed, the saved reference is still refused by name.
    let data = dir.join("other.jsonl");
    let text = std::fs::read_to_string(golden_dir().join("dpo/llama_sigmoid/pairs.jsonl")).unwrap();
    std::fs::write(&data, text.replacen("[", "[1, ", 2)).unwrap();
    let m = dir.join("other-metrics.jsonl");
    let (out, _) = run_cpu(
        &case,
        1,
        &m,
        &[
            "--set",
            "training.num_steps=6",
            "--set",
            &format!("dataset.path={}", data.display()),
            "--resume",
            path_str(&dir.join("ck/step-00000003")),
            "--resume-changed",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("dpo_reference.safetensors")
            && err.contains("computed for other data"),
        "{err}"
    );
}

#[test]
fn bad_dpo_settings_are_refused_naming_the_key() {
    let case = golden_dir().join("dpo/llama_sigmoid/run.yaml");
    let dir = scratch("dpo-bad");
    for (set, key, words) in [
        (
            vec!["dataset.packing=true", "dataset.max_seq_len=32"],
            "dataset.packing",
            "packing is off for training.stage: dpo",
        ),
        (
            vec!["dpo.beta=-1"],
            "dpo.beta",
            "must be a finite number > 0",
        ),
        (
            vec!["dpo.loss_type=hinge"],
            "dpo.loss_type",
            "unknown variant",
        ),
        (
            vec!["training.pref_loss=ipo"],
            "dpo.loss_type",
            "given twice",
        ),
        (
            vec!["dpo.label_smoothing=0.7"],
            "dpo.label_smoothing",
            "[0, 0.5)",
        ),
        // Too few pairs to hold any out: named before the model loads (the 12 pairs'
        // 0.95 rounds up to 12, as datasets' train_test_split sizes it).
        (
            vec!["dataset.val_size=0.95"],
            "dataset.val_size",
            "holds out 12 of the 12 preference pairs: none would be left to train on",
        ),
        (
            vec!["training.batch_size=3"],
            "training.batch_size",
            "not divisible",
        ),
    ] {
        let mut args = vec![
            "--config".to_string(),
            path_str(&case).into(),
            "--gpus".into(),
            "0".into(),
            "--workers".into(),
            "2".into(),
            "--dry-run".into(),
        ];
        for s in &set {
            args.extend(["--set".into(), s.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(key) && err.contains(words),
            "{set:?}: {err}"
        );
    }
    assert!(std::fs::read_dir(&dir).unwrap().next().is_none());
}
