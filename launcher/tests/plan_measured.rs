//! The per-worker memory plan (`mt-launch plan`, src/plan/device.rs) against what a worker
//! really allocates, on CPU workers of small models: the tiny dense Llama, a Qwen3-MoE and
//! a Qwen3-Next hybrid derived from it.
//!
//! A CPU worker reports the rise of its resident memory within a step (VmHWM after the
//! peak was reset at the step's start). glibc's dynamic mmap threshold would keep freed
//! tensors resident and hide later ones, so the run pins the threshold at 64 KiB
//! (`MALLOC_MMAP_THRESHOLD_`): every tensor of consequence is then its own mapping, mapped
//! while alive and unmapped when freed, and the resident peak is the live peak. Step 1 is
//! skipped (it first touches the shared store).

mod common;

use std::path::Path;

use common::*;

/// `rows` rows of 1024 random ids below the tiny vocabulary (512).
fn write_data(path: &Path, rows: usize) {
    let mut rng = Lcg(7);
    let mut text = String::new();
    for _ in 0..rows {
        let ids: Vec<u64> = (0..1024).map(|_| rng.below(512)).collect();
        text += &format!("{{\"input_ids\": {ids:?}}}\n");
    }
    std::fs::write(path, text).unwrap();
}

/// The tiny model's config.json with `extra` keys merged in, and its tokenizer files.
fn variant(dir: &Path, extra: serde_json::Value) -> std::path::PathBuf {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny");
    let mut cfg = json(&tiny.join("config.json"));
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny.join(f), model.join(f)).unwrap();
    }
    model
}

/// (plan total, largest measured step peak after step 1), in bytes; `env` is set for the
/// run.
fn plan_and_peak(
    name: &str,
    extra: serde_json::Value,
    rows: usize,
    env: &[(&str, &str)],
) -> (f64, f64) {
    plan_and_peak_with(name, extra, rows, env, &[])
}

/// [`plan_and_peak`] with `sets` (`--set` values) for both the plan and the run.
fn plan_and_peak_with(
    name: &str,
    extra: serde_json::Value,
    rows: usize,
    env: &[(&str, &str)],
    sets: &[&str],
) -> (f64, f64) {
    let dir = scratch(&format!("plan-measured-{name}"));
    let model = variant(&dir, extra);
    let data = dir.join("data.jsonl");
    write_data(&data, rows);
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml");
    let sets_run = [
        format!("model.path={}", model.display()),
        "dataset.name=null".into(),
        "dataset.format=tokenized".into(),
        format!("dataset.path={}", data.display()),
        "dataset.max_seq_len=1024".into(),
        "dataset.shuffle=false".into(),
        format!("training.batch_size={rows}"),
        // Step 1 first touches the shared store; step 2 is the steady state.
        "training.num_steps=2".into(),
    ];
    let sets = sets.iter().map(|s| s.to_string()).chain(sets_run);
    let mut args: Vec<String> = vec![
        "--config".into(),
        path_str(&config).into(),
        "--gpus".into(),
        "0".into(),
        "--workers".into(),
        "1".into(),
    ];
    for s in sets {
        args.extend(["--set".into(), s]);
    }
    let mut plan_args: Vec<&str> = vec!["plan", "--json"];
    plan_args.extend(args.iter().map(String::as_str));
    let out = run_ok(&plan_args);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let total = plan["device"]["total"].as_f64().unwrap();

    let metrics = dir.join("metrics.jsonl");
    let mut run_args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_args.extend(["--metrics-out", path_str(&metrics)]);
    let out = mt_launch()
        .args(&run_args)
        .env("MALLOC_MMAP_THRESHOLD_", "65536")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert_ok(&out, &run_args);
    let peaks = column(&common::metrics(&metrics), "peak_gpu_bytes");
    assert_eq!(peaks.len(), 2);
    let peak = peaks[1];
    eprintln!(
        "{name}: plan {:.1} MB, measured {:.1} MB ({:+.1}%), peak phase {}",
        total / 1e6,
        peak / 1e6,
        100.0 * (total / peak - 1.0),
        plan["device"]["peak_phase"]
    );
    (total, peak)
}

fn assert_close(name: &str, (plan, peak): (f64, f64), tolerance: f64) {
    assert!(peak > 0.0, "{name}: the worker reported no peak");
    let err = plan / peak - 1.0;
    assert!(
        err.abs() <= tolerance,
        "{name}: plan {plan:.0} B vs measured {peak:.0} B: {:+.1}% (tolerance {:.0}%)",
        100.0 * err,
        100.0 * tolerance
    );
}

/// Dense attention and MLP: every tensor is counted by shape, so the plan is tight. The
/// 16 x 1024 tokens run with the MLP half in the automatic tiles (1024 tokens), the peak
/// in the attention half's backward. Within 3% below; above, 3% plus one (M, H) f32
/// tensor: the plan counts the layer input's gradient as a tensor of its own, but the
/// attention half is backpropagated from its output's gradient as given (in dy's memory,
/// worker/src/layer.rs), which autograd may hand on to the input's gradient without a copy
/// (measured +7.4% = 0.2% + that tensor's 8.4 MB of 103 MB; with the product objective
/// before 1405f1b, -0.4%).
#[test]
fn dense_plan_matches_the_measured_peak() {
    let (plan, peak) = plan_and_peak("dense", serde_json::json!({}), 16, &[]);
    let hidden = (16 * 1024 * 128 * 4) as f64;
    assert!(
        plan >= peak * 0.97 && plan <= peak * 1.03 + hidden,
        "dense: plan {plan:.0} B vs measured {peak:.0} B: {:+.1}% (within -3% and +3% + {hidden} B)",
        100.0 * (plan / peak - 1.0)
    );
}

/// Tiles of 4096 tokens, whose MLP phase is the peak: within 10% (measured +7%: in f32 an
/// RMSNorm's f32 input is its input, not the copy the plan counts for bf16; in bf16,
/// where it is a copy, -1%).
#[test]
fn dense_tiled_plan_is_within_ten_percent() {
    let p = plan_and_peak_with(
        "dense-tiled",
        serde_json::json!({}),
        16,
        &[],
        &["memory.tile_tokens=4096"],
    );
    assert_close("dense tiled", p, 0.10);
}

/// Routed experts and Gated DeltaNet are counted from their main tensors only (the
/// router's and the delta rule's small ones are left out): within 10%. The MoE model runs
/// its experts both ways, one at a time (a CPU worker's default) and as grouped GEMMs (the
/// GPU default, forced here with `MT_MOE_EXPERTS`), against the one plan (measured -2.8%,
/// -3.2% and, for the hybrid, -3.7%).
#[test]
fn moe_and_hybrid_plans_are_within_ten_percent() {
    let moe = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
        "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
        "output_router_logits": true, "router_aux_loss_coef": 0.01
    });
    assert_close("moe", plan_and_peak("moe", moe.clone(), 16, &[]), 0.10);
    let grouped = [("MT_MOE_EXPERTS", "grouped")];
    let p = plan_and_peak("moe-grouped", moe, 16, &grouped);
    assert_close("moe grouped", p, 0.10);
    let hybrid = serde_json::json!({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 96, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": true, "shared_expert_intermediate_size": 128,
        "output_router_logits": true, "router_aux_loss_coef": 0.01, "partial_rotary_factor": 0.25
    });
    assert_close("hybrid", plan_and_peak("hybrid", hybrid, 16, &[]), 0.10);
}
