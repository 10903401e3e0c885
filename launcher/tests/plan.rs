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
fn plan_without_config_is_an_error() {
    let out = std::process::Command::new(launcher())
        .args(["plan"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--config"));
}
