//! Packing is exact: samples packed into rows (positions restarting per sample, attention
//! kept inside each sample) give the same step-1 loss and every gradient as the same
//! samples unpacked, one per row, for every attention variant the families use (plain
//! causal, sliding window, soft-capped scores, q/k norms, partial rotary with LongRoPE,
//! per-layer-type RoPE, attention sinks) and for routed experts. The unpacked path is itself checked against transformers by
//! golden.rs.

mod common;

use std::path::Path;

use common::*;

/// Step-1 loss and gradients of golden case `case` on the samples in `dir`, packed into
/// rows of 30 tokens (3 rows) or one per row (8 rows).
fn step1(case: &str, dir: &Path, packed: bool) -> Step {
    let tag = if packed { "packed" } else { "unpacked" };
    let data = format!("dataset.path={}", dir.join("samples.jsonl").display());
    let batch = format!("training.batch_size={}", if packed { 3 } else { 8 });
    let packing = format!("dataset.packing={packed}");
    let args = [
        "--set",
        &data,
        "--set",
        "dataset.max_seq_len=30",
        "--set",
        &packing,
        "--set",
        &batch,
    ];
    golden_step1(case, dir, tag, &args, &[]).0
}

#[test]
fn packed_rows_equal_unpacked_samples() {
    for case in [
        "llama",
        "mistral_sliding",
        "qwen2_bias_sliding",
        "qwen3_qk_norm",
        "gemma2_softcap",
        "gemma3_text_local_rope",
        "phi3_fused_longrope",
        "gpt_oss_sinks_clamp",
        "mixtral_moe",
        "mixtral_router_aux_loss",
        "qwen3_moe_norm_topk",
    ] {
        let dir = scratch(&format!("packing-{case}"));
        write_samples(&dir.join("samples.jsonl"), &SHORT_SAMPLES);
        let (loss_u, grads_u) = step1(case, &dir, false);
        let (loss_p, grads_p) = step1(case, &dir, true);
        assert!(
            (loss_p - loss_u).abs() <= 1e-6 * loss_u.abs(),
            "{case}: packed loss {loss_p} vs unpacked {loss_u}"
        );
        assert_eq!(grads_p.len(), grads_u.len());
        for (name, g) in &grads_u {
            let e = rel_l2(&grads_p[name], g);
            assert!(
                e < 1e-5,
                "{case}: gradient {name} differs by {e:e} (relative L2)"
            );
        }
    }
}

#[test]
fn packing_without_max_seq_len_is_refused() {
    let out = run(&[
        "--config",
        path_str(&golden_dir().join("llama/run.yaml")),
        "--gpus",
        "0",
        "--set",
        "dataset.packing=true",
        "--dry-run",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dataset.packing") && err.contains("max_seq_len"),
        "{err}"
    );
}

/// The data position survives a resume with shuffled, packed text data: 3 steps + resume +
/// 3 steps equal 6 steps straight (crossing an epoch, so the reshuffle is covered too).
#[test]
fn resume_is_exact_with_packed_shuffled_text() {
    let dir = scratch("packing-resume");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml");
    let ck = format!("checkpoint.dir={}", dir.join("ck").display());
    let common = [
        "--set",
        "dataset.packing=true",
        "--set",
        "dataset.max_seq_len=256",
        "--set",
        "training.batch_size=16",
    ];
    let with = |extra: &[&'static str], more: &[&str]| -> Vec<String> {
        common
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .chain(more.iter().map(|s| s.to_string()))
            .collect()
    };
    let runs = [
        ("straight", with(&["--set", "training.num_steps=6"], &[])),
        (
            "first",
            with(
                &[
                    "--set",
                    "training.num_steps=3",
                    "--set",
                    "checkpoint.every_steps=3",
                ],
                &["--set", &ck],
            ),
        ),
        (
            "second",
            with(
                &["--set", "training.num_steps=6", "--resume", "latest"],
                &["--set", &ck],
            ),
        ),
    ];
    let mut losses = Vec::new();
    for (tag, args) in &runs {
        let m = dir.join(format!("{tag}.jsonl"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_cpu_ok(&config, 2, &m, &args);
        losses.push(column(&metrics(&m), "loss"));
    }
    let out = run_ok(&[
        "plan",
        "--config",
        path_str(&config),
        "--gpus",
        "0",
        "--set",
        "dataset.packing=true",
        "--set",
        "dataset.max_seq_len=256",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: usize = text
        .split("packed into ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("plan reports packed rows: {text}"));
    assert!(
        rows < 6 * 16,
        "6 steps of 16 rows cross an epoch ({rows} rows)"
    );
    let resumed: Vec<f64> = losses[1].iter().chain(&losses[2]).copied().collect();
    let e = worst_rel(&resumed, &losses[0]);
    assert!(
        e <= 1e-6,
        "resumed {resumed:?} vs straight {:?} (rel {e:.2e})",
        losses[0]
    );
}
