//! `mt-launch plan` reports the host memory a run would hold, without starting workers.

mod common;

use common::*;

#[test]
fn plan_reports_bytes_per_parameter_for_qwen_7b() {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen_7b.yaml");
    let out = std::process::Command::new(launcher())
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
    let out = std::process::Command::new(launcher())
        .args([
            "plan",
            "--config",
            root.join("configs/qwen_7b.yaml").to_str().unwrap(),
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
    let out = std::process::Command::new(launcher())
        .args(["plan"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config"));
}
