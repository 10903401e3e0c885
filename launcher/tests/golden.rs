//! Numerics against PyTorch: every case scripts/make_golden.py wrote (a tiny HF model
//! trained 3 steps by transformers + torch.optim.AdamW) must be reproduced by mt-launch
//! with 1 and 2 CPU workers: per-step losses and gradient norms to 1e-4 relative, every
//! step-1 gradient and the step-1 logits of every real (non-padding) position to 1e-4
//! (‖ours − torch‖ / ‖torch‖) in float32; per-step losses within 2e-2 relative when
//! computing in bfloat16. Cases whose loss depends on how the batch is split (the MoE router
//! aux loss is per micro-batch) carry their N-worker reference in `expected_wN.json` and
//! `grads0_wN.safetensors`. Mixture-of-experts cases run once more with their experts as
//! grouped GEMMs (`MT_MOE_EXPERTS=grouped`, the path GPUs take), 1 worker, f32, same
//! tolerances.

mod common;

use common::*;

const F32_TOL: f64 = 1e-4;
const BF16_TOL: f64 = 2e-2;

#[test]
fn every_golden_case_matches_pytorch() {
    let golden = golden_dir();
    let mut cases: Vec<_> = std::fs::read_dir(&golden)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    cases.sort();
    assert!(!cases.is_empty());
    let mut failures = Vec::new();
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
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
        let config = case.join("run.yaml");
        let dir = scratch(&format!("golden-{name}"));
        let reference = |stem: &str, ext: &str, workers: usize| {
            let split = case.join(format!("{stem}_w{workers}.{ext}"));
            match split.is_file() {
                true => split,
                false => case.join(format!("{stem}.{ext}")),
            }
        };
        // (workers, environment): 1 and 2 workers, and the MoE cases once more with their
        // experts as grouped GEMMs (torch's CPU grouped GEMM; the GPU default).
        let mut runs: Vec<(usize, &[(&str, &str)])> = vec![(1, &[]), (2, &[])];
        if mt::config::hf::ModelSpec::from_model_dir(&case.join("model"))
            .unwrap()
            .moe
            .is_some()
        {
            runs.push((1, &[("MT_MOE_EXPERTS", "grouped")]));
        }
        for (workers, env) in runs {
            let tag = match env.is_empty() {
                true => format!("{workers}w"),
                false => format!("{workers}w grouped experts"),
            };
            let expected = json(&reference("expected", "json", workers));
            let losses = f64_array(&expected["losses"]);
            let norms = f64_array(&expected["grad_norms"]);
            let torch_grads = tensors(&reference("grads0", "safetensors", workers));
            let stem = tag.replace(' ', "-");
            let m = dir.join(format!("f32-{stem}.jsonl"));
            let g = dir.join(format!("grads-{stem}.safetensors"));
            let lg = dir.join(format!("logits-{stem}.safetensors"));
            run_cpu_env_ok(
                &config,
                workers,
                &m,
                &["--dump-grads", path_str(&g), "--dump-logits", path_str(&lg)],
                env,
            );
            // Rank r holds the r-th contiguous slice of the batch, padded to its own longest row.
            let ours: Vec<(Vec<usize>, Vec<f32>)> = match workers {
                1 => vec![logits(&lg)],
                _ => (0..2)
                    .map(|r| {
                        logits(&std::path::PathBuf::from(format!(
                            "{}.rank{r}",
                            lg.display()
                        )))
                    })
                    .collect(),
            };
            let e = logits_rel_err(&ours, &torch_logits, &row_lens);
            eprintln!("golden {name} {tag}: step-1 logits rel error {e:.2e}");
            if e > F32_TOL {
                failures.push(format!("{name} f32 {tag}: step-1 logits rel error {e:.2e}"));
            }
            let rows = metrics(&m);
            let (ours, our_norms) = (column(&rows, "loss"), column(&rows, "grad_norm"));
            let e = worst_rel(&ours, &losses);
            if e > F32_TOL {
                failures.push(format!(
                    "{name} f32 {tag}: losses {ours:?} vs torch {losses:?} (rel {e:.2e})"
                ));
            }
            let e = worst_rel(&our_norms, &norms);
            if e > F32_TOL {
                failures.push(format!(
                    "{name} f32 {tag}: grad norms {our_norms:?} vs torch {norms:?} (rel {e:.2e})"
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
                    None => failures.push(format!("{name} {tag}: no gradient for `{t}`")),
                    Some(ours) => {
                        let e = rel_l2(ours, &torch_grads[t]);
                        if e > F32_TOL {
                            failures.push(format!(
                                "{name} f32 {tag}: gradient `{t}` rel error {e:.2e}"
                            ));
                        }
                    }
                }
            }
        }
        let m = dir.join("bf16.jsonl");
        run_cpu_ok(&config, 2, &m, &["--set", "model.dtype=bfloat16"]);
        let ours = column(&metrics(&m), "loss");
        let losses = f64_array(&json(&reference("expected", "json", 2))["losses"]);
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

/// The `logits` tensor of a safetensors file: (shape, values).
fn logits(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
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
