//! `mt-launch plan` reports the host memory a run would hold, without starting workers.

mod common;

use common::*;

/// Through the name the project's front page has long used: the benchmark shape moved to
/// configs/bench/ and the old path still plans, saying where it is now.
#[test]
fn plan_reports_bytes_per_parameter_for_qwen_7b() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen_7b.yaml");
    let out = mt_launch()
        .args([
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "0",
            "--workers",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("host memory for 7.616e9 parameters"),
        "{text}"
    );
    assert!(text.contains("= 18.00 bytes per parameter"), "{text}");
    assert!(text.contains("2 worker(s) on CPU"), "{text}");
    assert!(
        text.contains("is now") && text.contains("bench/qwen_7b.yaml"),
        "{text}"
    );
}

/// The bytes per parameter follow `memory.grad_dtype` and `memory.master_weights`: fp32
/// master 4 (split: a 2-byte residual; bfloat16: none, the store is the master), Adam 8,
/// gradient 4 or 2, bf16 store 2, over the layout's elements (with its alignment gaps) plus
/// the store's header: 12.00 with a bf16 master and gradient.
#[test]
fn plan_bytes_follow_the_memory_options() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let spec = mt::config::hf::ModelSpec::from_model_dir(&root.join("qwen2.5-32b")).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let (elems, params) = (layout.total as f64, layout.num_params() as f64);
    let config = root.join("bench/qwen_32b.yaml");
    for (grad, master, grad_b, master_b) in [
        ("float32", "float32", 4.0, 4.0),
        ("bfloat16", "float32", 2.0, 4.0),
        ("float32", "split", 4.0, 2.0),
        ("bfloat16", "split", 2.0, 2.0),
        ("float32", "bfloat16", 4.0, 0.0),
        ("bfloat16", "bfloat16", 2.0, 0.0),
    ] {
        let grad_set = format!("memory.grad_dtype={grad}");
        let master_set = format!("memory.master_weights={master}");
        let args = [
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "0",
            "--set",
            &grad_set,
            "--set",
            &master_set,
        ];
        let out = mt_launch().args(args).output().unwrap();
        assert_ok(&out, &args);
        let text = String::from_utf8_lossy(&out.stdout);
        let state = (master_b + 8.0 + grad_b + 2.0) * elems + mt::shm::HEADER_LEN as f64;
        let want = format!("= {:.2} bytes per parameter", state / params);
        assert!(
            text.contains(&want),
            "{grad}/{master}: want `{want}` in\n{text}"
        );
        let grad_line = format!("{} gradient", if grad_b == 2.0 { "bf16" } else { "fp32" });
        assert!(text.contains(&grad_line), "{text}");
        if master == "bfloat16" {
            assert!(
                text.contains(
                    "master weights             0.00 GB (bfloat16: the store is the master)"
                ),
                "{text}"
            );
        }
        if (grad, master) == ("bfloat16", "bfloat16") {
            assert!(text.contains("= 12.00 bytes per parameter"), "{text}");
        }
    }
}

/// Background checkpoints add their staging area to the host total, on a line of its own:
/// by default two of the largest blocks at 12 bytes per element (fp32 master, m, v), else
/// `checkpoint.staging_size`; none when checkpoints are written in place.
#[test]
fn plan_shows_the_checkpoint_staging_area() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let spec = mt::config::hf::ModelSpec::from_model_dir(&root.join("qwen2.5-7b")).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let default = 2.0 * 12.0 * layout.max_block_len() as f64;
    let config = root.join("bench/qwen_7b.yaml");
    let ck = scratch("plan-staging").join("ck");
    let dir = format!("checkpoint.dir={}", ck.display());
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "0",
            "--json",
            "--set",
            &dir,
            "--set",
            "checkpoint.every_steps=100",
        ];
        args.extend(extra);
        let out = mt_launch().args(&args).output().unwrap();
        assert_ok(&out, &args);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let h = &json["host"];
        let staging = h["checkpoint_staging"].as_u64().unwrap();
        let without = h["total"].as_u64().unwrap() - staging;
        let text_args: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
        let out = mt_launch().args(&text_args).output().unwrap();
        assert_ok(&out, &text_args);
        (
            staging,
            without,
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let (staging, total, text) = plan(&[]);
    assert_eq!(staging as f64, default);
    let line = format!(
        "checkpoint staging    {:>9.2} GB (checkpoint.staging_size unset: two of the largest blocks",
        default / 1e9
    );
    assert!(text.contains(&line), "want `{line}` in\n{text}");
    let (staging, total_8gb, text) = plan(&["--set", "checkpoint.staging_size=8GB"]);
    assert_eq!((staging, total_8gb), (8_000_000_000, total));
    assert!(
        text.contains("checkpoint staging         8.00 GB (checkpoint.staging_size;"),
        "{text}"
    );
    let (staging, total_in_place, text) = plan(&["--set", "checkpoint.background=false"]);
    assert_eq!((staging, total_in_place), (0, total));
    assert!(!text.contains("checkpoint staging"), "{text}");
}

#[test]
fn plan_sizes_slab_slots_by_the_largest_layer() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let spec = mt::config::hf::ModelSpec::from_model_dir(&root.join("configs/qwen2.5-7b")).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let layer = (0..layout.num_layers())
        .map(|l| layout.blocks[layout.layer_block(l)].len)
        .max()
        .unwrap();
    // The embedding (and lm_head) is more than twice a layer: it travels in parts.
    assert!(2 * layer < layout.blocks[mt::layout::Layout::EMBED].len);
    let (workers, slots, bf16) = (4, 5, 2);
    let out = mt_launch()
        .args([
            "plan",
            "--config",
            root.join("configs/bench/qwen_7b.yaml").to_str().unwrap(),
            "--gpus",
            "0",
            "--workers",
            &workers.to_string(),
            "--set",
            &format!("memory.num_grad_slabs={slots}"),
            "--set",
            "model.dtype=bfloat16",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let bytes = workers * (slots * layer * bf16 + mt::shm::HEADER_LEN);
    let line = format!(
        "gradient slabs        {:>9.2} GB ({workers} worker(s) x {slots} slots x {layer} elements",
        bytes as f64 / 1e9
    );
    assert!(text.contains(&line), "no `{line}` in:\n{text}");
}

#[test]
fn plan_without_config_is_an_error() {
    let out = mt_launch().args(["plan"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config"));
}

/// A GPU run can be planned on a machine without GPUs (`--gpus` and `--gpu-memory` say
/// which): the Qwen3.5 configs, with their public sizes (27B; 35B total for the MoE).
#[test]
fn plan_for_gpus_elsewhere_qwen3_5() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    for (yaml, billions) in [
        ("bench/qwen3_5_27b.yaml", 27.0),
        ("bench/qwen3_5_35b_a3b.yaml", 35.0),
    ] {
        let config = root.join(yaml);
        let args = [
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "1",
            "--gpu-memory",
            "141",
            "--json",
        ];
        let out = mt_launch().args(args).output().unwrap();
        assert_ok(&out, &args);
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let params = plan["host"]["params"].as_f64().unwrap() / 1e9;
        assert!(
            (params - billions).abs() < 1.0,
            "{yaml}: {params}B parameters"
        );
        assert!(
            plan["largest_batch"].as_u64().unwrap() > 0,
            "{yaml}: {plan}"
        );
    }
}

/// `mt-launch plan` of configs/`yaml` for one 141 GB GPU, with `extra` arguments: its
/// report.
fn plan_one_h200(yaml: &str, extra: &[&str]) -> String {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs")
        .join(yaml);
    let mut args = vec![
        "plan",
        "--config",
        config.to_str().unwrap(),
        "--gpus",
        "1",
        "--gpu-memory",
        "141",
    ];
    args.extend(extra);
    let out = mt_launch().args(&args).output().unwrap();
    assert_ok(&out, &args);
    String::from_utf8(out.stdout).unwrap()
}

/// Gemma 3 27B from its shipped architecture: the bench shape (random init: the text
/// model alone, 27.0B) and the recipe on the hub's weights, whose plan counts the frozen
/// SigLIP tower and projector (0.42B parameters: 0.85 GB in bf16) on the host and the GPU;
/// with the projector trained, the trained layout holds it and its kept input is counted;
/// with the whole tower trained, all of it, and the layers' kept inputs and recompute.
#[test]
fn plan_for_gemma3_27b_counts_its_tower() {
    let bench = plan_one_h200("bench/gemma3_27b.yaml", &[]);
    assert!(
        bench.contains("host memory for 2.701e10 parameters"),
        "{bench}"
    );
    assert!(!bench.contains("vision tower"), "{bench}");
    let recipe = plan_one_h200("gemma3_27b.yaml", &[]);
    assert!(
        recipe.contains("host memory for 2.701e10 parameters"),
        "{recipe}"
    );
    for line in [
        "vision tower               0.85 GB",
        "vision tower (frozen)                            0.85 GB",
        "vision tower forward",
    ] {
        assert!(recipe.contains(line), "no `{line}` in:\n{recipe}");
    }
    // The projector trained (`vlm.freeze_projector: false`): its 6.19M parameters (the
    // norm's 1152 and the 1152 x 5376 projection) join the trained ones and leave the frozen
    // region, and its input (the tower's output) is kept.
    let trained = plan_one_h200("gemma3_27b.yaml", &["--set", "vlm.freeze_projector=false"]);
    for line in [
        "host memory for 2.702e10 parameters",
        "of which the vision tower's 6.194e6",
        "vision tower               0.83 GB",
        "the projector's input, kept",
    ] {
        assert!(trained.contains(line), "no `{line}` in:\n{trained}");
    }
    // The whole tower trained (`vlm.freeze_vision_encoder: false` too): the SigLIP tower's
    // 416.9M parameters join as well and nothing stays frozen; each layer's input and the
    // pixels are kept, and the layers' recompute is the embedding's backward, the peak.
    let tower = plan_one_h200(
        "gemma3_27b.yaml",
        &[
            "--set",
            "vlm.freeze_vision_encoder=false",
            "--set",
            "vlm.freeze_projector=false",
        ],
    );
    for line in [
        "host memory for 2.743e10 parameters",
        "of which the vision tower's 4.231e8",
        "vision tower (frozen)                            0.00 GB",
        "the tower's pixels and block inputs, kept",
        "peak phase: embedding backward",
        "the tower's recompute graph + gradients",
    ] {
        assert!(tower.contains(line), "no `{line}` in:\n{tower}");
    }
}

/// Qwen2.5-VL-7B from its shipped architecture with its tower trained
/// (`vlm.freeze_vision_encoder: false`, `vlm.freeze_projector: false`): the plan counts the
/// tower's 676,550,144 parameters (transformers' count, src/layout/vision.rs) as trained
/// ones on the host (master, moments, gradient, store) with no frozen region left, and on
/// the device the block inputs kept per patch and the blocks' recompute in the
/// embedding's backward.
#[test]
fn plan_for_qwen2_5_vl_7b_counts_a_trained_tower() {
    let plan = |extra: &[&str]| plan_one_h200("qwen2.5_vl_7b.yaml", extra);
    let trained = [
        "--set",
        "vlm.freeze_vision_encoder=false",
        "--set",
        "vlm.freeze_projector=false",
    ];
    let json = |extra: &[&str]| -> serde_json::Value {
        serde_json::from_str(&plan(&[extra, &["--json"]].concat())).unwrap()
    };
    let (frozen, tower) = (json(&[]), json(&trained));
    let tower_params = 676_550_144;
    let n = |v: &serde_json::Value, k: &str| v["host"][k].as_u64().unwrap();
    assert_eq!(n(&tower, "params") - n(&frozen, "params"), tower_params);
    assert_eq!(n(&tower, "tower_params"), tower_params);
    assert_eq!(
        (n(&frozen, "tower_params"), n(&tower, "vision_region")),
        (0, 0)
    );
    // fp32 master, Adam m and v, fp32 gradient and the bf16 store: 18 bytes a parameter
    // (the tensors' alignment adds < 64 elements to each of its 390), less the frozen
    // region's 2; and the default checkpoint staging, two of the largest blocks' master and
    // moments (12 bytes an element), now two embedding blocks with the tower in them
    // (+16.2 GB, the price of one block: `checkpoint.staging_size` sets it).
    let state = |v: &serde_json::Value| n(v, "total") - n(v, "checkpoint_staging");
    let grown = state(&tower) - state(&frozen);
    let (low, high) = (16 * tower_params, 16 * (tower_params + 64 * 390));
    assert!(
        grown >= low && grown <= high,
        "{grown} not in {low}..={high}"
    );
    let staging = n(&tower, "checkpoint_staging") - n(&frozen, "checkpoint_staging");
    let want = 2 * 12 * tower_params;
    assert!(staging.abs_diff(want) < want / 100, "{staging} vs {want}");
    // Device, the micro-batch's tokens all image tokens (the bound): 4 patches each, every
    // patch's pixels (3 x 2 x 14 x 14 values) and the inputs of the 32 blocks and the
    // encoder's output (1280 wide), bf16.
    let d = &tower["device"];
    let m = d["rows"].as_u64().unwrap() * d["seq_len"].as_u64().unwrap();
    let kept = &d["fixed"]["the tower's pixels and block inputs, kept"];
    assert_eq!(kept.as_u64(), Some(4 * m * (1176 + 33 * 1280) * 2));
    assert_eq!(d["fixed"]["vision tower (frozen)"].as_u64(), Some(0));
    let embed_bwd = &d["phases"]["embedding backward"]["parts"];
    let recompute = "the tower's recompute graph + gradients (the merger's or one block's)";
    assert!(embed_bwd[recompute].as_u64().unwrap() > 0, "{embed_bwd}");
    let fwd = &d["phases"]["vision tower forward"]["parts"];
    assert!(
        fwd["embedding block (the trained tower in it)"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(d["total"].as_u64().unwrap() > frozen["device"]["total"].as_u64().unwrap());
    // The report (the embedding's backward, not the peak phase, is summed in one line).
    let text = plan(&trained);
    for line in [
        "of which the vision tower's 6.766e8 (trained",
        "the tower's pixels and block inputs, kept",
    ] {
        assert!(text.contains(line), "no `{line}` in:\n{text}");
    }
    assert!(!plan(&[]).contains("of which the vision tower"));
}

/// Qwen3-VL-8B from its shipped architecture with its projector trained: the merger and its
/// three deepstack mergers (width 1152, merge 2 x 2, output 4096: the merger's LayerNorm over
/// 1152, each deepstack merger's over 4608, then Linear 4608 -> 4608 and 4608 -> 4096 with
/// biases each) join the trained parameters, and the device keeps the four mergers' inputs
/// and the three deepstack features' gradients; with its encoder trained, the block inputs
/// (the taps among them) and the same gradients.
#[test]
fn plan_for_qwen3_vl_8b_counts_its_trained_projector_and_encoder() {
    let plan = |extra: &[&str]| plan_one_h200("qwen3_vl_8b.yaml", extra);
    let json = |extra: &[&str]| -> serde_json::Value {
        serde_json::from_str(&plan(&[extra, &["--json"]].concat())).unwrap()
    };
    let linears = 4608 * 4608 + 4608 + 4608 * 4096 + 4096;
    let projector = (2 * 1152 + linears) + 3 * (2 * 4608 + linears);
    let trained = json(&["--set", "vlm.freeze_projector=false"]);
    assert_eq!(trained["host"]["tower_params"].as_u64(), Some(projector));
    let text = plan(&["--set", "vlm.freeze_projector=false"]);
    for line in [
        "the projector's input, kept",
        "the deepstack features' gradients",
    ] {
        assert!(text.contains(line), "no `{line}` in:\n{text}");
    }
    let text = plan(&["--set", "vlm.freeze_vision_encoder=false"]);
    for line in [
        "the tower's pixels and block inputs, kept",
        "the deepstack features' gradients",
    ] {
        assert!(text.contains(line), "no `{line}` in:\n{text}");
    }
}

/// LLaVA-NeXT 7B from its shipped architecture: the bench shape (random init: the Mistral
/// text model alone, 7.24B) and the recipe on the hub's weights, whose plan counts the frozen
/// CLIP tower, projector and image_newline (0.32B parameters: 0.65 GB in bf16) on the host and
/// the GPU, and the tower's forward; with `vlm.freeze_projector: false` the projector and the
/// newline (21.0M) move into the trained layout and its kept input is counted; with
/// `vlm.freeze_vision_encoder: false` the layers that run, their kept inputs and recompute.
#[test]
fn plan_for_llava_next_7b_counts_its_tower() {
    let plan = plan_one_h200;
    let bench = plan("bench/llava_next_7b.yaml", &[]);
    assert!(
        bench.contains("host memory for 7.242e9 parameters"),
        "{bench}"
    );
    assert!(!bench.contains("vision tower"), "{bench}");
    let recipe = plan("llava_next_7b.yaml", &[]);
    assert!(
        recipe.contains("host memory for 7.242e9 parameters"),
        "{recipe}"
    );
    for line in [
        "vision tower               0.65 GB",
        "vision tower (frozen)                            0.65 GB",
        "vision tower forward",
    ] {
        assert!(recipe.contains(line), "no `{line}` in:\n{recipe}");
    }
    let trained = plan(
        "llava_next_7b.yaml",
        &["--set", "vlm.freeze_projector=false"],
    );
    assert!(
        trained.contains("host memory for 7.263e9 parameters"),
        "{trained}"
    );
    assert!(trained.contains("the projector's input, kept"), "{trained}");
    // The CLIP tower trained under the frozen projector: its 290.9M parameters that reach
    // the features (all but the last of its 24 layers, which `vision_feature_layer: -2`
    // does not read, and post_layernorm) join the trained ones; that layer and the
    // projector stay in the frozen region (0.07 GB); the inputs of the 23 layers that run
    // are kept.
    let tower = plan(
        "llava_next_7b.yaml",
        &["--set", "vlm.freeze_vision_encoder=false"],
    );
    for line in [
        "host memory for 7.533e9 parameters",
        "of which the vision tower's 2.909e8",
        "vision tower (frozen)                            0.07 GB",
        "the tower's pixels and block inputs, kept",
    ] {
        assert!(tower.contains(line), "no `{line}` in:\n{tower}");
    }
}

/// Qwen3.5-27B from its shipped architecture (the hub's config.json, its vision_config
/// included): the bench shape (random init: the text model alone, 26.90B) and the recipe on
/// the hub's weights, whose plan counts the frozen tower and merger (460.7M parameters as
/// transformers counts them: 0.92 GB in bf16) on the host and the GPU; with the merger
/// trained (`vlm.freeze_projector: false`), its 44.8M parameters join the trained ones and
/// leave the frozen region (0.83 GB), and its kept input is counted.
#[test]
fn plan_for_qwen3_5_27b_counts_its_tower() {
    let plan = plan_one_h200;
    let bench = plan("bench/qwen3_5_27b.yaml", &[]);
    assert!(
        bench.contains("host memory for 2.690e10 parameters"),
        "{bench}"
    );
    assert!(!bench.contains("vision tower"), "{bench}");
    let recipe = plan("qwen3_5_27b.yaml", &[]);
    for line in [
        "host memory for 2.690e10 parameters",
        "vision tower               0.92 GB",
        "vision tower (frozen)                            0.92 GB",
        "vision tower forward",
    ] {
        assert!(recipe.contains(line), "no `{line}` in:\n{recipe}");
    }
    let trained = plan("qwen3_5_27b.yaml", &["--set", "vlm.freeze_projector=false"]);
    for line in [
        "host memory for 2.694e10 parameters",
        "vision tower               0.83 GB",
        "the projector's input, kept",
    ] {
        assert!(trained.contains(line), "no `{line}` in:\n{trained}");
    }
}

/// The GPUs' free memory reaches the automatic tile of a model with linear attention:
/// Qwen3.5-27B at batch 128 runs its delta rule whole where the GPU has room for the whole
/// micro-batch (the driver's reading, here `MT_TEST_DEVICE_MEMORY`, or `--gpu-memory`), and
/// in segments where it has not.
#[test]
fn plan_keeps_the_delta_rule_whole_on_a_gpu_with_room() {
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench/qwen3_5_27b.yaml");
    let tile = |env: Option<&str>, extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "1",
            "--set",
            "training.batch_size=128",
            "--json",
        ];
        args.extend(extra);
        let mut cmd = mt_launch();
        cmd.args(&args);
        if let Some(bytes) = env {
            cmd.env("MT_TEST_DEVICE_MEMORY", bytes);
        }
        let out = cmd.output().unwrap();
        assert_ok(&out, &args);
        let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        plan["device"]["tile_tokens"].as_u64()
    };
    // The whole micro-batch plans at 183 GB (64 layers' inputs and the whole rule's graph).
    assert_eq!(tile(Some("400000000000"), &[]), None, "whole on 400 GB");
    assert!(
        tile(Some("141000000000"), &[]).is_some(),
        "segments on 141 GB"
    );
    assert_eq!(
        tile(None, &["--gpu-memory", "400"]),
        None,
        "--gpu-memory 400"
    );
    assert!(
        tile(None, &["--gpu-memory", "141"]).is_some(),
        "--gpu-memory 141"
    );
}

/// Unset, the staging area grows at launch by half the RAM left free beside the plan and
/// the workers (a CPU worker: its device plan), up to the whole checkpoint; a launch that
/// leaves nothing beside the workers keeps two of the largest blocks. MemAvailable comes
/// from `MT_TEST_HOST_MEMORY`, so the figures are exact on any machine.
#[test]
fn a_launch_grows_the_staging_area_into_free_ram() {
    let dir = scratch("plan-grow-staging");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"input_ids\": [151643, 20, 30, 40]}\n").unwrap();
    let config = dir.join("run.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{path: {}, init: random, dtype: bfloat16}}\n\
             dataset: {{format: tokenized, path: {}, max_seq_len: 64}}\n\
             training: {{batch_size: 2, num_steps: 1}}\n\
             checkpoint: {{dir: {}, every_steps: 10}}\n",
            root.join("configs/qwen2.5-0.5b").display(),
            data.display(),
            dir.join("ck").display()
        ),
    )
    .unwrap();
    let on_cpu = [
        "--config",
        path_str(&config),
        "--gpus",
        "0",
        "--workers",
        "1",
    ];
    let out = run_ok(&[&["plan"], &on_cpu[..], &["--json"]].concat());
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let host = plan["host"]["total"].as_u64().unwrap();
    let staging = plan["host"]["checkpoint_staging"].as_u64().unwrap();
    let worker = plan["device"]["total"].as_u64().unwrap();
    let spec =
        mt::config::hf::ModelSpec::from_model_dir(&root.join("configs/qwen2.5-0.5b")).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let full = mt::checkpoint::staging::full_bytes(&layout, true);
    let dry_run = [&on_cpu[..], &["--dry-run"]].concat();
    let staging_line = |avail: u64| -> String {
        let out = mt_launch()
            .args(&dry_run)
            .env("MT_TEST_HOST_MEMORY", avail.to_string())
            .output()
            .unwrap();
        assert_ok(&out, &dry_run);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("  checkpoint staging"))
            .unwrap_or_else(|| panic!("no staging line"))
            .to_string()
    };
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    // Nothing beside the workers: the default.
    let line = staging_line(host + worker);
    assert!(
        line.contains(&gb(staging)) && line.contains("two of the largest blocks"),
        "{line}"
    );
    // 2 GB beside them: 1 GB more.
    let line = staging_line(host + worker + 2_000_000_000);
    assert!(line.contains(&gb(staging + 1_000_000_000)), "{line}");
    assert!(line.contains("half the RAM left free"), "{line}");
    // Room for all of it: the whole checkpoint, no more.
    let line = staging_line(host + worker + 4 * full);
    assert!(
        line.contains(&gb(full)) && line.contains("the whole checkpoint"),
        "{line}"
    );
}

/// `plan --nodes N`: each node's bytes per parameter, replicated and with
/// the state sharded (store 2 + gradient + (master + moments)/N), and a step's traffic: (N-1)/N
/// of the gradient twice (replicated) or of the gradient and the bf16 store (sharded).
#[test]
fn plan_for_several_nodes_reports_bytes_per_node_and_the_network() {
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench/qwen_7b.yaml");
    let plan = |nodes: &str, extra: &[&str]| -> serde_json::Value {
        let args = [
            &[
                "plan",
                "--config",
                config.to_str().unwrap(),
                "--gpus",
                "0",
                "--workers",
                "2",
                "--nodes",
                nodes,
                "--json",
                "--set",
                "training.batch_size=16",
            ][..],
            extra,
        ]
        .concat();
        let out = run_ok(&args);
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // The store's header and the layout's alignment gaps: well under 1e-3 B/param.
    let near = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-3;
    let p = plan("4", &[]);
    let n = &p["nodes"];
    assert!(near(&n["replicated_bytes_per_param"], 18.0), "{n}");
    assert!(
        near(&n["sharded_bytes_per_param"], 2.0 + 4.0 + 12.0 / 4.0),
        "{n}"
    );
    let params = p["host"]["params"].as_f64().unwrap();
    let per_param = |k: &str| n[k].as_f64().unwrap() / params;
    // 3/4 of 4 + 4 bytes, and of 4 + 2 bytes, per parameter (layout gaps aside).
    assert!(
        (per_param("replicated_step_bytes") - 6.0).abs() < 1e-2,
        "{n}"
    );
    assert!((per_param("sharded_step_bytes") - 4.5).abs() < 1e-2, "{n}");
    // Node 0 gathers a checkpoint a window at a time: 2^24 elements of the fp32 master and
    // moments, 12 bytes each (not the largest block, the 152064 x 3584 embedding), counted
    // in its total.
    let gather = n["sharded_gather_bytes"].as_f64().unwrap();
    assert_eq!(gather, 12.0 * (1u64 << 24) as f64, "{n}");
    assert!(n["sharded_node0_bytes"].as_f64().unwrap() > gather, "{n}");
    // With periodic background checkpoints, node 0 stages them a window at a time: its
    // default staging area is two windows, not the one-node default of two whole blocks
    // (the embedding's 545M elements x 12 B, twice: 13 GB).
    let ck = scratch("plan-nodes-staging").join("ck");
    let ck_dir = format!("checkpoint.dir={}", ck.display());
    let periodic = ["--set", &ck_dir, "--set", "checkpoint.every_steps=10"];
    let one = plan("1", &periodic);
    let one_staging = one["host"]["checkpoint_staging"].as_f64().unwrap();
    assert!(one_staging > 13e9, "{}", one["host"]);
    let staged = plan("4", &periodic);
    let n0 = staged["nodes"]["sharded_node0_bytes"].as_f64().unwrap();
    let windows = 2.0 * gather;
    let staging = staged["nodes"]["sharded_staging_bytes"].as_f64().unwrap();
    assert_eq!(staging, windows, "{}", staged["nodes"]);
    assert_eq!(n0 - n["sharded_node0_bytes"].as_f64().unwrap(), windows);
    let low = [
        "--set",
        "memory.grad_dtype=bfloat16",
        "--set",
        "memory.master_weights=split",
    ];
    let n = &plan("2", &low)["nodes"];
    assert!(near(&n["replicated_bytes_per_param"], 14.0), "{n}");
    assert!(
        near(&n["sharded_bytes_per_param"], 2.0 + 2.0 + 10.0 / 2.0),
        "{n}"
    );
    let text = run_ok(&[
        "plan",
        "--config",
        config.to_str().unwrap(),
        "--gpus",
        "0",
        "--workers",
        "2",
        "--nodes",
        "2",
    ]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("on 2 nodes, each node holds:"), "{text}");
    assert!(
        text.contains("with the state sharded") && !text.contains("not in this build"),
        "{text}"
    );
    assert!(
        text.contains("to gather a checkpoint a window at a time"),
        "{text}"
    );
    assert!(
        text.contains("at 25 GB/s") && text.contains("at 50 GB/s"),
        "{text}"
    );
}

/// With `memory.offload_activations` the GPU workers' pinned stash of layer inputs is host
/// memory too: one buffer per layer of micro-batch tokens x hidden in bf16, each rounded up
/// to a power of two as torch's pinned allocator does. Qwen2.5-7B, 2 GPUs, 2 rows of 65536
/// tokens each: 2 x 28 x 2^30 bytes (65536 x 2 x 3584 x 2 = 0.94e9, rounded to 2^30).
#[test]
fn plan_counts_offloaded_layer_inputs_as_host_memory() {
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench/qwen_7b.yaml");
    let plan = |offload: bool| {
        let out = mt_launch()
            .args(["plan", "--config", config.to_str().unwrap()])
            .args(["--gpus", "2", "--gpu-memory", "141", "--json"])
            .args([
                "--set",
                "training.batch_size=4",
                "--set",
                "dataset.max_seq_len=65536",
            ])
            .args(["--set", &format!("memory.offload_activations={offload}")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["host"]["total"].as_u64().unwrap()
    };
    assert_eq!(plan(true) - plan(false), 2 * 28 * (1u64 << 30));
}

/// `plan` without `--gpus` on a machine without GPUs says what it sized (CPU workers) and
/// how to size a GPU machine, with a command that works as written.
#[test]
fn plan_without_gpus_says_what_it_sized() {
    if std::path::Path::new("/proc/driver/nvidia/gpus").exists() {
        eprintln!("skipped: this machine has NVIDIA GPUs, so plan sizes them");
        return;
    }
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen2.5_7b.yaml");
    let out = mt_launch()
        .args(["plan", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let note = text
        .lines()
        .find(|l| l.starts_with("note: no GPU here"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(note.contains("1 CPU worker(s)"), "{note}");
    // The suggested command runs as written.
    let cmd = note.split(": mt-launch ").nth(1).expect("a command");
    let args: Vec<&str> = cmd.split_whitespace().collect();
    let again = mt_launch().args(&args).output().unwrap();
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(
        again.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(!said.contains("note: no GPU here"), "{said}");
    assert!(said.contains("1 worker(s) on GPUs"), "{said}");
}

/// A machine that is not this one, from the shipped architectures alone (no weights, no
/// tokenizer): `--host-memory` stands for its RAM and `--drive-size` for the room on each of
/// its drives, which need not exist here. With the state on four drives in the leanest mode
/// (split master, bf16 moments: 6 bytes a parameter on the drives, 4 in RAM: the bf16
/// store and gradient) the parameters are transformers' counts, the drives' bytes are split
/// evenly, and the fit follows the RAM given; a drive too small for its share is refused
/// naming the directory, and `--drive-size` without drives is an error.
#[test]
fn plan_sizes_a_machine_elsewhere_from_its_ram_and_drives() {
    let dir = scratch("plan-elsewhere");
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
    let config = dir.join("run.yaml");
    std::fs::write(
        &config,
        format!(
            "model: {{name: openai/gpt-oss-120b, dtype: bfloat16}}\n\
             dataset: {{name: alpaca_demo, dataset_dir: {}, max_seq_len: 1024}}\n\
             training: {{output_dir: {}, batch_size: 8}}\n\
             memory: {{grad_dtype: bfloat16, master_weights: split, moments_dtype: bfloat16,\n  \
             optimizer_offload: nvme, nvme_path: [/nonexistent/nvme0, /nonexistent/nvme1, \
             /nonexistent/nvme2, /nonexistent/nvme3]}}\n",
            data.display(),
            dir.join("out").display()
        ),
    )
    .unwrap();
    let plan = |model: &str, ram: &str, drive: &str, json: bool| {
        let mut args = vec![
            "plan",
            "--config",
            path_str(&config),
            "--gpus",
            "1",
            "--gpu-memory",
            "141",
            "--host-memory",
            ram,
            "--drive-size",
            drive,
            "--set",
        ];
        let name = format!("model.name={model}");
        args.push(&name);
        if json {
            args.push("--json");
        }
        mt_launch().args(&args).output().unwrap()
    };
    // transformers 5.17's counts (src/layout/tests.rs).
    for (model, params) in [
        ("meta-llama/Llama-3.3-70B-Instruct", 70_553_706_496u64),
        ("openai/gpt-oss-120b", 116_829_156_672),
        ("Qwen/Qwen3-235B-A22B", 235_093_634_560),
    ] {
        let out = plan(model, "512", "3840", true);
        assert_ok(&out, &[model]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["host"]["params"].as_u64(), Some(params), "{model}");
        let bpp = v["host"]["bytes_per_param"].as_f64().unwrap();
        assert!((bpp - 4.0).abs() < 1e-3, "{model}: {bpp} B/param in RAM");
        let total = v["host"]["total"].as_u64().unwrap();
        let fits = match total <= 512_000_000_000 {
            true => "Fits",
            false => "Short",
        };
        assert_eq!(v["host"]["ram"].as_u64(), Some(512_000_000_000));
        assert_eq!(v["host"]["fits"], fits, "{model}: {total} bytes");
        let (per, all) = (
            v["drives"]["per_drive_bytes"].as_u64().unwrap(),
            v["drives"]["total_bytes"].as_u64().unwrap(),
        );
        assert_eq!(per * 4, all);
        let on_drives = all as f64 / params as f64;
        assert!(
            (on_drives - 6.0).abs() < 0.01,
            "{model}: {on_drives} B/param"
        );
        assert_eq!(
            v["drives"]["stated_drive_bytes"].as_u64(),
            Some(3_840_000_000_000)
        );
    }
    // Qwen3-235B-A22B's 1410.6 GB over four drives: 352.6 GB each.
    let out = plan("Qwen/Qwen3-235B-A22B", "1024", "300", false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("/nonexistent/nvme0") && err.contains("300.00 GB stated (--drive-size)"),
        "{err}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("host RAM given (--host-memory): 1024.00 GB: fits")
            && text.contains("/nonexistent/nvme3 (300.00 GB stated)"),
        "{text}"
    );
    let out = mt_launch()
        .args([
            "plan",
            "--config",
            path_str(&config),
            "--gpus",
            "1",
            "--drive-size",
            "100",
            "--set",
            "memory.optimizer_offload=none",
            "--set",
            "memory.nvme_path=[]",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--drive-size sizes the drives"),
        "{err}"
    );
}

/// The drives' speed with the state on them (`memory.optimizer_offload: nvme`, the tiny
/// model, a scratch directory as the drive): `plan` measures the directory (a speed printed,
/// nothing left there), or takes `--drive-speed READ,WRITE`, and the update's drive time is
/// then the update's bytes read at READ plus written at WRITE, exactly; a speed of 0, below
/// 0 or not a number is refused naming the flag, as is `--drive-speed` without drives; a
/// drive directory that is a symbolic link is refused, as the run refuses it.
#[test]
fn plan_measures_the_drives_or_takes_their_stated_speed() {
    let dir = scratch("plan-drive-speed");
    let drive = dir.join("nvme0");
    std::fs::create_dir(&drive).unwrap();
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml");
    let plan = |drive: &std::path::Path, extra: &[&str]| {
        let path = format!("memory.nvme_path={}", drive.display());
        let mut args = vec!["plan", "--config", path_str(&tiny), "--gpus", "0", "--set"];
        args.extend(["memory.optimizer_offload=nvme", "--set", &path]);
        args.extend(extra);
        mt_launch().args(&args).output().unwrap()
    };
    let out = plan(&drive, &[]);
    assert_ok(&out, &["plan"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(&drive.display().to_string()) && l.contains("GB/s read"))
        .unwrap_or_else(|| panic!("no measured speed: {text}"));
    assert!(line.contains("GB/s write"), "{line}");
    assert!(
        text.contains("at the speeds measured here (256 MiB written then read"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(&drive).unwrap().count(), 0, "probe left");

    let out = plan(&drive, &["--drive-speed", "2,0.5", "--json"]);
    assert_ok(&out, &["--drive-speed"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &v["drives"];
    let bytes = d["update_read_bytes"].as_u64().unwrap();
    assert_eq!(d["update_write_bytes"].as_u64(), Some(bytes));
    // configs/tiny.yaml, fp32 master and moments: 12 bytes each way per position.
    assert_eq!(bytes % 12, 0, "{bytes}");
    let want = bytes as f64 / 2e9 + bytes as f64 / 0.5e9;
    let got = d["update_s"].as_f64().unwrap();
    assert!((got - want).abs() <= 1e-12 * want, "{got} s, want {want}");
    assert_eq!(d["speed_source"], "stated");

    for bad in ["0", "-1", "fast", "1,0", "inf"] {
        let out = plan(&drive, &["--drive-speed", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--drive-speed") && err.contains(bad),
            "{bad}: {err}"
        );
    }
    let out = plan(&drive, &["--tflops", "0"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--tflops"));
    let out = mt_launch()
        .args(["plan", "--config", path_str(&tiny), "--gpus", "0"])
        .args(["--drive-speed", "7"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--drive-speed is the bandwidth"),
        "{err}"
    );

    let link = dir.join("link");
    std::os::unix::fs::symlink(&drive, &link).unwrap();
    let out = plan(&link, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(&link.display().to_string())
            && err.contains("symbolic link"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&drive).unwrap().count(), 0);
}

/// The Qwen2.5-VL-7B and Qwen3-VL-8B bench shapes (random init, the text model alone): their
/// parameters are the language model's as transformers counts them on the hub
/// architecture (the classes built on the meta device, `visual.*` left out: 7,615,616,512
/// and 8,190,735,360), with no tower planned.
#[test]
fn plan_for_the_qwen_vl_bench_shapes_is_their_text_model() {
    for (yaml, params) in [
        ("bench/qwen2_5_vl_7b.yaml", 7_615_616_512u64),
        ("bench/qwen3_vl_8b.yaml", 8_190_735_360),
    ] {
        let plan: serde_json::Value =
            serde_json::from_str(&plan_one_h200(yaml, &["--json"])).unwrap();
        assert_eq!(plan["host"]["params"].as_u64(), Some(params), "{yaml}");
        assert_eq!(plan["host"]["tower_params"].as_u64(), Some(0), "{yaml}");
    }
}
