//! The Python client (python/megatrain) driving a real `mt-launch serve` on CPU, with one
//! and with two workers, the store in f32 and in bf16: python/tests/serve_e2e.py trains a
//! batch until its loss falls, checks `forward_logprobs` against transformers on the
//! exported model (within a tolerance derived from transformers' own error in that dtype
//! against f64), the store's zero-copy views against the exported safetensors bit for bit,
//! and that the server and its workers are gone after `shutdown()`, after an Engine is
//! dropped without one, and after its client is killed. Here, once the script has exited:
//! none of the processes it reported is alive and no process holds a server's shared
//! memory. The client's own unit tests (python/tests/test_*.py, a stand-in server) run too.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn venv_python() -> PathBuf {
    repo().join(".venv/bin/python")
}

/// Runs serve_e2e.py with `workers` CPU workers and the store in `dtype`; returns its report.
fn drive(workers: usize, dtype: &str) -> serde_json::Value {
    let work = scratch(&format!("serve-client-{workers}-{dtype}"));
    let out = Command::new(venv_python())
        .arg(repo().join("python/tests/serve_e2e.py"))
        .args(["--launcher", path_str(&launcher())])
        .args(["--config", path_str(&repo().join("configs/tiny.yaml"))])
        .args(["--workers", &workers.to_string()])
        .args(["--dtype", dtype])
        .args(["--work", path_str(&work)])
        .current_dir(fresh_cwd())
        .output()
        .expect("run .venv/bin/python");
    let log = std::fs::read_to_string(work.join("server.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "serve_e2e.py with {workers} workers failed ({}):\n{}\n{}\nserver log:\n{log}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout.lines().last().expect("a report line");
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn check(workers: usize, dtype: &str) {
    let report = drive(workers, dtype);
    let losses = f64_array(&report["losses"]);
    assert_eq!(losses.len(), 5);
    assert!(losses[4] < losses[0], "{losses:?}");
    assert!(report["tensors"].as_u64().unwrap() > 0);
    let pids: Vec<u32> = report["pids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(
        pids.len(),
        3 * (1 + workers),
        "three servers and their workers: {pids:?}"
    );
    for &pid in &pids {
        assert!(!alive(pid), "pid {pid} outlived the client");
    }
    for &server in pids.iter().step_by(1 + workers) {
        let held = region_holders(server);
        assert!(
            held.is_empty(),
            "server {server}'s shared memory is held: {held:?}"
        );
    }
}

#[test]
fn python_client_one_worker() {
    check(1, "float32");
}

#[test]
fn python_client_two_workers() {
    check(2, "float32");
}

/// The store in bf16: the views are `torch.frombuffer` of bfloat16.
#[test]
fn python_client_two_workers_bf16() {
    check(2, "bfloat16");
}

#[test]
fn python_client_unit_tests() {
    let out = Command::new(venv_python())
        .args(["-m", "unittest", "discover", "-s"])
        .arg(repo().join("python/tests"))
        .output()
        .expect("run .venv/bin/python");
    assert!(
        out.status.success(),
        "python -m unittest failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
