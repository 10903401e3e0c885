//! Numerics against PyTorch: every case scripts/make_golden.py wrote (a tiny HF model
//! trained 3 steps by transformers + torch.optim.AdamW) must be reproduced by mt-launch
//! with 1 and 2 CPU workers: per-step losses and gradient norms to 1e-4 relative, every
//! step-1 gradient (1e-3 on Gated DeltaNet's decay path: [`grad_tol`]) and the step-1
//! logits of every real (non-padding) position to 1e-4 (‖ours − torch‖ / ‖torch‖) in
//! float32, and the loss of a separate eval set after the
//! last step to 1e-4; per-step losses within 2e-2 relative when
//! computing in bfloat16. Cases whose loss depends on how the batch is split (the MoE router
//! aux loss is per micro-batch) carry their N-worker reference in `expected_wN.json` and
//! `grads0_wN.safetensors`. Every case runs once more the way GPUs run it: the MLPs' fused
//! ops (`MT_SWIGLU=fused`, `MT_MOE_COMBINE=fused`: their tch mirrors, their backwards from
//! the kernels' tape, each layer's halves backpropagated one after the other) and the
//! experts as grouped GEMMs (`MT_MOE_EXPERTS=grouped`), 1 worker, f32, same tolerances.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const F32_TOL: f64 = 1e-4;
const BF16_TOL: f64 = 2e-2;

/// The f32 bound for step-1 gradient `t`. Gated DeltaNet's decay path (A_log, dt_bias and
/// the projections feeding a) sums terms over every pair of positions that cancel ~1e3-fold
/// (worker/src/model/gated_delta/tests.rs), so there the f32 rounding of two correct
/// computations in different orders shows as up to several 1e-4: ours against the
/// chunked torch fallback transformers runs, both on one libtorch, whose CPU kernels sum in
/// an order that depends on the CPU (on an AMD EPYC: A_log 6.6e-4 for the Qwen3.5 wrapper
/// case, where the machine of the previous CI stayed under 1e-4). 1e-3 bounds the rounding;
/// a wrong term is O(1e-2). Every other tensor keeps 1e-4.
fn grad_tol(t: &str) -> f64 {
    let decay_path = ["A_log", "dt_bias", "in_proj_a.", "in_proj_ba."]
        .iter()
        .any(|n| t.contains(n));
    if decay_path { 1e-3 } else { F32_TOL }
}

/// The GPU's defaults, forced on CPU workers: the fused SwiGLU, the MoE glue's fused gather
/// and combine, the grouped expert GEMMs, the rotary embedding from the tape, torch's fused
/// RMSNorm, the head's fused cross-entropy, attention with sinks through flash's contract.
const GPU_WAY: [(&str, &str); 7] = [
    ("MT_SWIGLU", "fused"),
    ("MT_MOE_COMBINE", "fused"),
    ("MT_MOE_EXPERTS", "grouped"),
    ("MT_ROPE", "fused"),
    ("MT_RMS_NORM", "fused"),
    ("MT_CROSS_ENTROPY", "fused"),
    ("MT_ATTENTION_SINKS", "fused"),
];

#[test]
fn every_golden_case_matches_pytorch() {
    let mut failures = Vec::new();
    for case in &cases() {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        for workers in [1, 2] {
            check_f32(case, workers, &[], &grad_tol, &mut failures);
        }
        // Once more the way GPUs run it: the MLPs' fused ops (their CPU mirrors, backward
        // from the kernels' tape, each layer's MLP half backpropagated on its own) and the
        // experts as grouped GEMMs (torch's CPU grouped GEMM).
        check_f32(case, 1, &GPU_WAY, &grad_tol, &mut failures);
        let dir = scratch(&format!("golden-{name}"));
        let m = dir.join("bf16.jsonl");
        run_cpu_ok(
            &case.join("run.yaml"),
            2,
            &m,
            &["--set", "model.dtype=bfloat16"],
        );
        let ours = column(&metrics(&m), "loss");
        let losses = f64_array(&json(&reference(case, "expected", "json", 2))["losses"]);
        let e = worst_rel(&ours, &losses);
        if e > BF16_TOL {
            failures.push(format!(
                "{name} bf16: losses {ours:?} vs torch f32 {losses:?} (rel {e:.2e})"
            ));
        }
        eprintln!("golden {name}: checked");
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The chunked Gated DeltaNet (the GPU's path, `MT_GATED_DELTA=chunked`) on CPU against the
/// same PyTorch runs, for the cases with linear-attention layers: the same bounds
/// ([`grad_tol`]).
#[test]
fn chunked_gated_delta_matches_pytorch() {
    let mut failures = Vec::new();
    let hybrid = cases().into_iter().filter(|case| {
        std::fs::read_to_string(case.join("model/config.json"))
            .unwrap()
            .contains("linear_attention")
    });
    let tol = grad_tol;
    let mut checked = 0;
    for case in hybrid {
        check_f32(
            &case,
            1,
            &[("MT_GATED_DELTA", "chunked")],
            &tol,
            &mut failures,
        );
        checked += 1;
    }
    assert!(
        checked >= 3,
        "the golden cases with Gated DeltaNet layers ({checked})"
    );
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every case scripts/make_golden.py wrote, sorted.
fn cases() -> Vec<PathBuf> {
    let mut cases: Vec<_> = std::fs::read_dir(golden_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    cases.sort();
    assert!(!cases.is_empty());
    cases
}

/// The reference file `stem.ext` of `case` for `workers` workers: the N-worker one where the
/// case has it.
fn reference(case: &Path, stem: &str, ext: &str, workers: usize) -> PathBuf {
    let split = case.join(format!("{stem}_w{workers}.{ext}"));
    match split.is_file() {
        true => split,
        false => case.join(format!("{stem}.{ext}")),
    }
}

/// One f32 run of `case` with `workers` CPU workers (and `env` set for them) against
/// PyTorch: step-1 logits, losses and gradient norms to 1e-4, every step-1 gradient to
/// `grad_tol(name)`. Mismatches are added to `failures`.
fn check_f32(
    case: &Path,
    workers: usize,
    env: &[(&str, &str)],
    grad_tol: &dyn Fn(&str) -> f64,
    failures: &mut Vec<String>,
) {
    let name = case.file_name().unwrap().to_string_lossy().to_string();
    let tag = env.iter().map(|(_, v)| format!(" {v}")).collect::<String>();
    let torch_logits = logits(&case.join("logits0.safetensors"));
    let row_lens: Vec<usize> = std::fs::read_to_string(case.join("data.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["input_ids"]
                .as_array()
                .unwrap()
                .len()
        })
        .collect();
    let dir = scratch(&format!("golden-{name}{}-{workers}", tag.replace(' ', "-")));
    let expected = json(&reference(case, "expected", "json", workers));
    let losses = f64_array(&expected["losses"]);
    let norms = f64_array(&expected["grad_norms"]);
    let evals = f64_array(&expected["eval_losses"]);
    let torch_grads = tensors(&reference(case, "grads0", "safetensors", workers));
    let m = dir.join("f32.jsonl");
    let g = dir.join("grads.safetensors");
    let lg = dir.join("logits.safetensors");
    let eval_path = format!("dataset.eval_path={}", case.join("eval.jsonl").display());
    run_cpu_env_ok(
        &case.join("run.yaml"),
        workers,
        &m,
        &[
            "--dump-grads",
            path_str(&g),
            "--dump-logits",
            path_str(&lg),
            "--set",
            &eval_path,
        ],
        env,
    );
    let name = format!("{name}{tag} f32 {workers}w");
    // Rank r holds the r-th contiguous slice of the batch, padded to its own longest row.
    let ours: Vec<(Vec<usize>, Vec<f32>)> = match workers {
        1 => vec![logits(&lg)],
        _ => (0..workers)
            .map(|r| logits(&PathBuf::from(format!("{}.rank{r}", lg.display()))))
            .collect(),
    };
    let e = logits_rel_err(&ours, &torch_logits, &row_lens);
    eprintln!("golden {name}: step-1 logits rel error {e:.2e}");
    if e > F32_TOL {
        failures.push(format!("{name}: step-1 logits rel error {e:.2e}"));
    }
    let rows = metrics(&m);
    let (ours, our_norms) = (column(&rows, "loss"), column(&rows, "grad_norm"));
    let e = worst_rel(&ours, &losses);
    if e > F32_TOL {
        failures.push(format!(
            "{name}: losses {ours:?} vs torch {losses:?} (rel {e:.2e})"
        ));
    }
    let last = rows.last().expect("metrics of every step");
    let (eval, want) = (last["eval_loss"].as_f64(), evals.last().copied());
    match (eval, want) {
        (Some(e), Some(w)) if worst_rel(&[e], &[w]) <= F32_TOL => {}
        _ => failures.push(format!(
            "{name}: eval loss after the last step {eval:?} vs torch {want:?}"
        )),
    }
    let e = worst_rel(&our_norms, &norms);
    if e > F32_TOL {
        failures.push(format!(
            "{name}: grad norms {our_norms:?} vs torch {norms:?} (rel {e:.2e})"
        ));
    }
    let grads = tensors(&g);
    let mut names: Vec<_> = torch_grads.keys().collect();
    names.sort();
    if grads.len() != torch_grads.len() {
        failures.push(format!(
            "{name}: {} gradient tensors, torch has {}",
            grads.len(),
            torch_grads.len()
        ));
    }
    for t in names {
        match grads.get(t) {
            None => failures.push(format!("{name}: no gradient for `{t}`")),
            Some(ours) => {
                let e = rel_l2(ours, &torch_grads[t]);
                if e > grad_tol(t) {
                    failures.push(format!("{name}: gradient `{t}` rel error {e:.2e}"));
                }
            }
        }
    }
}

/// The `logits` tensor of a safetensors file: (shape, values).
fn logits(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let shape = st.tensor("logits").unwrap().shape().to_vec();
    (shape, tensors(path).remove("logits").unwrap())
}

/// ‖ours − torch‖ / ‖torch‖ over the real positions of each row; `ours` holds the ranks'
/// (rows, T_r, V) tensors in rank order, `torch` one (B, T, V) tensor for the batch.
fn logits_rel_err(
    ours: &[(Vec<usize>, Vec<f32>)],
    torch: &(Vec<usize>, Vec<f32>),
    row_lens: &[usize],
) -> f64 {
    let (t_all, v) = (torch.0[1], torch.0[2]);
    let (mut diff, mut norm, mut row) = (0.0f64, 0.0f64, 0);
    for (shape, vals) in ours {
        assert_eq!(shape[2], v, "vocab differs");
        for r in 0..shape[0] {
            for t in 0..row_lens[row] {
                let a = &vals[(r * shape[1] + t) * v..][..v];
                let b = &torch.1[(row * t_all + t) * v..][..v];
                diff += a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| ((x - y) as f64).powi(2))
                    .sum::<f64>();
                norm += b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>();
            }
            row += 1;
        }
    }
    assert_eq!(row, torch.0[0], "every row of the first batch compared");
    (diff / norm).sqrt()
}
