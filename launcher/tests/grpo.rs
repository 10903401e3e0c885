//! `training.stage: grpo` end to end, against TRL's GRPO loss formulas computed in torch
//! (scripts/golden_grpo.py: tiny Llama with `dapo`, epsilon_high above epsilon and two
//! iterations per batch; Qwen3 with tied embeddings, `grpo`, batch-scaled rewards and three
//! iterations; Llama with `dr_grpo` and unscaled rewards; float32, with a learning rate
//! that pushes ratios past the clip range; and the three again with a KL term (a positive
//! `grpo.beta`) against the initial model): per-step loss, gradient norm, TRL's clip ratios and
//! KL, and every step-1 gradient, with 1 and 2 CPU workers; 2 workers equal 1 worker
//! accumulating 2 bit for bit; a run checkpointed in the middle of a batch and resumed
//! equals the straight one bit for bit (with a KL term too, whose reference a resume
//! rebuilds from the initial model, and refuses to take from another); the metrics reach
//! TensorBoard; bad rollouts and settings are refused naming file, line and key.

mod common;

use std::path::Path;

use common::*;

/// Step 1's loss, gradient norm and every gradient (‖ours − torch‖ / ‖torch‖). Both sides
/// compute in float32 from the same weights; at step 1 the ratio is exactly 1 on both
/// sides, so the loss is a weighted sum of the advantages (ours in f64 from the same f32
/// rewards) and the gradients differ by the rounding of the per-token log-probabilities'
/// backward, as DPO's (≤ 1e-6 relative measured there). A wrong normalisation (1/tokens
/// for 1/completions, a missing max_completion_length) or advantage (biased std, no 1e-4)
/// is O(1e-2) or more.
const TOL: f64 = 1e-5;
/// Later steps start from weights AdamW moved (elements whose gradient is at the rounding
/// level may take either sign, so weights part by up to 2 lr in those elements), and a
/// token whose ratio sits at the clip edge within rounding could fall on the other side in
/// the two runs: as golden.rs and dpo.rs after step 1, 1e-4 of the step's scale (measured
/// ≤ 1.4e-5 for the loss, 8e-6 for the norm; a wrong clip bound or old log-probability
/// is O(1e-1)).
const LATER_TOL: [f64; 2] = [1e-4, 1e-4];
/// TRL's `kl` (mean k3 per completion token). At step 1 the policy is the reference: torch
/// gets 0 exactly (one forward for both); ours takes the reference from a forward-only pass
/// over micro-batches of other rows, whose rounding (~1e-7 per log-probability) gives k3 ≈
/// d²/2 ~ 1e-14 (measured: 0, the same bits): held to 1e-9. After it, relative to the step's KL, with the later steps'
/// 1e-4 (the KL is a smooth function of the same log-probabilities as the loss); a missing
/// or sign-flipped KL gradient moves the policy away by O(1e-2) in the KL.
const KL_TOL: [f64; 2] = [1e-9, 1e-4];

#[test]
fn grpo_matches_trl_loss_in_torch() {
    let mut failures = Vec::new();
    for case in &stage_cases("grpo", 6) {
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
    let run = run_stage_case("grpo", case, workers);
    let (name, rows, want) = (&run.name, &run.rows, &run.want);
    for (i, (ours, theirs)) in [("loss", "losses"), ("grad_norm", "grad_norms")]
        .into_iter()
        .enumerate()
    {
        let (a, b) = (column(rows, ours), f64_array(&want[theirs]));
        // The loss can be ~0 (advantages sum to 0 in a group): relative to the step's scale.
        let scale = b.iter().map(|x| x.abs()).fold(0.0, f64::max);
        let err = |x: &f64, y: &f64| (x - y).abs() / scale.max(1e-30);
        let first = err(&a[0], &b[0]);
        let later = a[1..]
            .iter()
            .zip(&b[1..])
            .map(|(x, y)| err(x, y))
            .fold(0.0, f64::max);
        eprintln!("grpo {name}: {ours} error {first:.2e} at step 1, {later:.2e} after");
        if a.len() != b.len() || first > TOL || later > LATER_TOL[i] {
            failures.push(format!(
                "{name}: {ours} {a:?} vs torch {b:?} ({first:.2e}, {later:.2e})"
            ));
        }
    }
    // Clip ratios: none at step 1 (r = 1); after it, counts of tokens past the edge, the
    // same tokens on both sides unless one sits at the edge within rounding (one token in
    // a batch of ~30 is 0.04): held to 0.05.
    for key in ["clip_ratio/low_mean", "clip_ratio/high_mean"] {
        let (a, b) = (column(rows, key), f64_array(&want[key]));
        if a[0] != 0.0 || a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 0.05) {
            failures.push(format!("{name}: {key} {a:?} vs torch {b:?}"));
        }
    }
    if let Some(kl) = want.get("kl") {
        let (a, b) = (column(rows, "kl"), f64_array(kl));
        let first = a[0].abs();
        let later = a[1..]
            .iter()
            .zip(&b[1..])
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-30))
            .fold(0.0, f64::max);
        eprintln!("grpo {name}: kl {first:.2e} at step 1 (torch 0), rel error {later:.2e} after");
        if a.len() != b.len() || b[0] != 0.0 || first > KL_TOL[0] || later > KL_TOL[1] {
            failures.push(format!("{name}: kl {a:?} vs torch {b:?}"));
        }
    } else if rows.iter().any(|r| r.get("kl").is_some()) {
        failures.push(format!("{name}: a kl without grpo.beta"));
    }
    let worst = run.check_grads(case, TOL, failures);
    eprintln!("grpo {name}: worst step-1 gradient rel error {worst:.2e}");
}

type Run = (Vec<Vec<u64>>, Tensors);

/// Per step: the bits of the loss, the gradient norm, the clip ratios and the KL (when the
/// run has one).
fn bits(m: &Path) -> Vec<Vec<u64>> {
    metrics(m)
        .iter()
        .map(|r| {
            [
                "loss",
                "grad_norm",
                "clip_ratio/low_mean",
                "clip_ratio/high_mean",
                "kl",
            ]
            .iter()
            .filter_map(|k| r.get(*k).map(|v| v.as_f64().unwrap().to_bits()))
            .collect()
        })
        .collect()
}

/// A Qwen3 case (three iterations per batch): bits per step and final weights.
fn train(case: &str, tag: &str, workers: usize, accum: usize) -> Run {
    let case = golden_dir().join("grpo").join(case);
    let dir = scratch(&format!("grpo-equiv-{tag}"));
    let (m, out) = (dir.join("metrics.jsonl"), dir.join("model"));
    let args = [
        "--set".to_string(),
        format!("training.gradient_accumulation_steps={accum}"),
        "--set".into(),
        format!("training.output_dir={}", out.display()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cpu_ok(&case.join("run.yaml"), workers, &m, &args);
    (bits(&m), tensors(&out.join("model.safetensors")))
}

/// Bit for bit, as for SFT and DPO: single-threaded CPU workers, slabs summed in
/// accumulation order, the old log-probabilities kept in the batch's row order whatever
/// the worker count, and the reference pass cut into micro-batches of the same rows.
#[test]
fn two_workers_equal_one_worker_accumulating_two() {
    for case in ["qwen3_tied_grpo", "qwen3_tied_grpo_kl"] {
        let (a, b) = (train(case, "w2", 2, 1), train(case, "w1ga2", 1, 2));
        assert_eq!(
            a.0, b.0,
            "{case}: per-step loss, norm, clip and kl bits differ"
        );
        assert_eq!(
            a.0[0].len(),
            4 + usize::from(case.ends_with("_kl")),
            "{case}"
        );
        assert_eq!(a.1.len(), b.1.len());
        assert_same_bits(&a.1, &b.1, &format!("{case}: "));
    }
}

/// Checkpoints after steps 2 and 4 of the Qwen3 cases (three iterations per batch: step 2
/// is inside batch 0, whose old log-probabilities the checkpoint must carry). With a KL
/// term, the resumed launch takes its reference from the initial model again, not from the
/// weights it resumes (those would give other bits from step 3 on); a resume whose
/// initial model differs from the run's is refused.
#[test]
fn resume_in_the_middle_of_a_batch_continues_exactly() {
    for name in ["qwen3_tied_grpo", "qwen3_tied_grpo_kl"] {
        resume_continues_exactly(name);
    }
}

fn resume_continues_exactly(name: &str) {
    let case = golden_dir().join("grpo").join(name).join("run.yaml");
    let dir = scratch(&format!("grpo-resume-{name}"));
    let ck = format!("checkpoint.dir={}", dir.join("ck").display());
    let run = |tag: &str, extra: &[&str]| {
        let m = dir.join(format!("{tag}.jsonl"));
        run_cpu_ok(&case, 2, &m, extra);
        bits(&m)
    };
    let straight = run("straight", &["--set", "training.num_steps=5"]);
    let first = run("first", &["--set", "training.num_steps=2", "--set", &ck]);
    let saved = dir.join("ck/step-00000002/grpo_old_logps.safetensors");
    assert!(saved.is_file(), "{} is written", saved.display());
    let second = run(
        "second",
        &[
            "--set",
            "training.num_steps=5",
            "--set",
            &ck,
            "--resume",
            "latest",
        ],
    );
    let resumed: Vec<Vec<u64>> = first.into_iter().chain(second).collect();
    assert_eq!(
        resumed, straight,
        "{name}: resumed bits differ from the straight run's"
    );
    if name.ends_with("_kl") {
        let m = dir.join("other-reference.jsonl");
        let extra = [
            "--set",
            "training.num_steps=6",
            "--set",
            &ck,
            "--set",
            "model.init=random",
            "--resume",
            "latest",
        ];
        let (out, _) = run_cpu(&case, 1, &m, &extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && ["grpo.beta", "the random init of", "model.path"]
                    .iter()
                    .all(|w| err.contains(w)),
            "{err}"
        );
    }
}

/// A bad rollouts file, or a setting GRPO does not train with: refused before any worker
/// starts, naming the file, line and key.
#[test]
fn bad_rollouts_and_settings_are_refused_naming_file_line_and_key() {
    let case = golden_dir().join("grpo/llama_dapo/run.yaml");
    let dir = scratch("grpo-bad");
    let good =
        std::fs::read_to_string(golden_dir().join("grpo/llama_dapo/rollouts.jsonl")).unwrap();
    let lines: Vec<&str> = good.lines().collect();
    let no_reward = lines[4].replace("\"reward\"", "\"score\"");
    let lonely = lines[2].replace("\"group\": \"g0\"", "\"group\": \"alone\"");
    for (tag, text, words) in [
        (
            "no-reward",
            [&lines[..4], &[no_reward.as_str()], &lines[5..]]
                .concat()
                .join("\n"),
            vec!["no-reward.jsonl", "line 5", "`reward`: missing"],
        ),
        (
            "group-of-one",
            [&lines[..2], &[lonely.as_str()], &lines[3..]]
                .concat()
                .join("\n"),
            vec![
                "group-of-one.jsonl",
                "line 3",
                "`group`",
                "group alone has one completion",
            ],
        ),
    ] {
        let path = dir.join(format!("{tag}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let m = dir.join(format!("{tag}-metrics.jsonl"));
        let set = format!("dataset.path={}", path.display());
        let (out, _) = run_cpu(&case, 1, &m, &["--set", &set]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && words.iter().all(|w| err.contains(w)),
            "{tag}: {words:?} in {err}"
        );
    }
    for (set, words) in [
        ("grpo.beta=-0.04", vec!["grpo.beta", "finite number >= 0"]),
        (
            "grpo.loss_type=bnpo",
            vec!["grpo.loss_type", "unknown variant"],
        ),
        (
            "dataset.packing=true",
            vec!["dataset.packing", "packing is off for training.stage: grpo"],
        ),
    ] {
        let m = dir.join("settings.jsonl");
        let mut args = vec!["--set", set];
        if set.starts_with("dataset.packing") {
            args.extend(["--set", "dataset.max_seq_len=32"]);
        }
        let (out, _) = run_cpu(&case, 1, &m, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && words.iter().all(|w| err.contains(w)),
            "{set}: {words:?} in {err}"
        );
    }
}

/// The reward, clip ratios and KL reach TensorBoard (TRL's tags under `train/`) as the
/// metrics file has them, read back by TensorBoard's own EventAccumulator
/// (scripts/read_tensorboard.py); the step lines show the reward and the KL.
#[test]
fn reward_reaches_tensorboard_and_the_step_lines() {
    let case = golden_dir().join("grpo/qwen3_tied_grpo_kl/run.yaml");
    let dir = scratch("grpo-tensorboard");
    let (tb, m) = (dir.join("tb"), dir.join("metrics.jsonl"));
    let dir_set = format!("logging.logging_dir={}", tb.display());
    let extra = ["--set", "logging.report_to=tensorboard", "--set", &dir_set];
    let out = run_cpu_ok(&case, 1, &m, &extra);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        log.contains("  reward ") && log.contains("clipped") && log.contains("  kl "),
        "{log}"
    );
    let scalars = read_tensorboard(&tb);
    let rows = metrics(&m);
    for key in [
        "reward",
        "reward_std",
        "completions/mean_length",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "kl",
    ] {
        let tag = format!("train/{key}");
        let series = tensorboard_series(&scalars, &tag);
        assert_eq!(series.len(), rows.len(), "{tag}");
        for (p, r) in series.iter().zip(&rows) {
            let want = r[key].as_f64().unwrap() as f32;
            assert_eq!(p[1].as_f64().unwrap() as f32, want, "{tag} at {}", p[0]);
        }
    }
}

/// A launch's host plan (`--dry-run` prints the plan the launch holds itself to; `mt-launch
/// plan` reads a rollouts file only with a tokenizer beside the model) counts the reference
/// log-probabilities of `grpo.beta` > 0 (an f32 per completion token, a vector per row:
/// counted here from the rollouts file itself) and nothing for a reference model, which is
/// the initial one in the same buffers.
#[test]
fn plan_counts_the_reference_log_probabilities() {
    let plan = |case: &str| {
        let config = golden_dir().join("grpo").join(case).join("run.yaml");
        let args = ["--config", path_str(&config), "--gpus", "0", "--dry-run"];
        String::from_utf8_lossy(&run_ok(&args).stdout).into_owned()
    };
    let rollouts =
        std::fs::read_to_string(golden_dir().join("grpo/llama_dapo_kl/rollouts.jsonl")).unwrap();
    let want: u64 = rollouts
        .lines()
        .map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            4 * r["completion_ids"].as_array().unwrap().len() as u64 + 24
        })
        .sum();
    let line = format!("GRPO reference        {:.2} kB", want as f64 / 1e3);
    let (with, without) = (plan("llama_dapo_kl"), plan("llama_dapo"));
    assert!(with.contains(&line), "{line} in {with}");
    assert!(!without.contains("GRPO reference"), "{without}");
    let per_param = |s: &str| {
        s.lines()
            .find(|l| l.contains("bytes per parameter"))
            .map(String::from)
    };
    assert_eq!(per_param(&with), per_param(&without));
}
