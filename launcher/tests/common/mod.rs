//! Shared helpers for the end-to-end tests: they drive the real `mt-launch` (and through it
//! real `mt-worker` processes) exactly as a user does.
#![allow(dead_code)]

mod compare;
pub mod fixture;
mod leftovers;
pub mod mpi;
pub mod peak;
mod samples;
mod stages;
#[allow(unused_imports)]
pub use compare::*;
#[allow(unused_imports)]
pub use leftovers::*;
#[allow(unused_imports)]
pub use samples::*;
#[allow(unused_imports)]
pub use stages::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn launcher() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_mt-launch"));
    let worker = bin.with_file_name("mt-worker");
    assert!(
        worker.is_file(),
        "{} is missing: build the whole workspace first (scripts/test.sh does)",
        worker.display()
    );
    bin
}

/// `mt-launch` as a test spawns it: in a fresh current directory of its own, so that a
/// run whose config names no `training.output_dir` writes its model and checkpoints to
/// `output/<config stem>/` there (the default), not into the source tree, and runs of the
/// same config in parallel tests do not share one.
pub fn mt_launch() -> Command {
    let mut cmd = Command::new(launcher());
    cmd.current_dir(fresh_cwd());
    cmd
}

/// A fresh directory for a launch to run in ([`mt_launch`]).
pub fn fresh_cwd() -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let test = std::env::current_exe()
        .ok()
        .and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "test".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch/cwd");
    if n == 0 {
        // What earlier runs of this test binary left (their default output directories).
        let mine = format!("{test}-{}-", std::process::id());
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("{test}-")) && !name.starts_with(&mine) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let cwd = root.join(format!("{test}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cwd);
    std::fs::create_dir_all(&cwd).unwrap();
    cwd
}

/// The fixtures written by scripts/make_golden.py.
pub fn golden_dir() -> PathBuf {
    let dir = std::env::var_os("MT_GOLDEN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/golden"));
    assert!(
        dir.join("llama/expected.json").is_file(),
        "no golden fixtures in {}: run `.venv/bin/python scripts/make_golden.py --out target/golden` (scripts/test.sh does)",
        dir.display()
    );
    dir
}

/// The fixtures written by scripts/make_data_fixtures.py; `marker` is a path inside them
/// that the caller needs (it names what is missing when they were not generated).
pub fn data_fixtures(marker: &str) -> PathBuf {
    let dir = std::env::var_os("MT_DATA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/data-fixtures"));
    assert!(
        dir.join(marker).exists(),
        "no data fixtures ({marker}) in {}: run `.venv/bin/python scripts/make_data_fixtures.py --out target/data-fixtures` (scripts/test.sh does)",
        dir.display()
    );
    dir
}

/// The (input_ids, labels) rows transformers' tokenizer and chat template gave for fixture
/// `name` (`expected_NAME.jsonl` in `dir`).
pub fn expected_rows(dir: &Path, name: &str) -> Vec<(Vec<i32>, Vec<i32>)> {
    std::fs::read_to_string(dir.join(format!("expected_{name}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = |k: &str| -> Vec<i32> {
                v[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap() as i32)
                    .collect()
            };
            (ids("input_ids"), ids("labels"))
        })
        .collect()
}

/// A pretrained model to fine-tune: configs/tiny (its byte-level BPE tokenizer and ChatML
/// template) trained one step on CPU and exported to `dir` (metrics beside it).
pub fn tiny_pretrained(dir: &Path) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml");
    let out = dir.to_str().unwrap();
    let metrics = dir.with_extension("metrics.jsonl");
    let (output, _) = run_cpu(
        &config,
        1,
        &metrics,
        &[
            "--set",
            "training.num_steps=1",
            "--set",
            &format!("training.output_dir={out}"),
        ],
    );
    assert_ok(&output, &["--config", "configs/tiny.yaml"]);
    assert!(
        dir.join("model.safetensors").is_file(),
        "the tiny model was exported"
    );
}

/// A fresh directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-scratch")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs mt-launch to completion.
pub fn run(args: &[&str]) -> Output {
    mt_launch().args(args).output().expect("spawn mt-launch")
}

pub fn run_ok(args: &[&str]) -> Output {
    let out = run(args);
    assert_ok(&out, args);
    out
}

/// Fails the test with mt-launch's stderr unless it succeeded.
pub fn assert_ok(out: &Output, args: &[&str]) {
    assert!(
        out.status.success(),
        "mt-launch {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs mt-launch on `config` with `workers` CPU workers and metrics written to `metrics`,
/// plus `extra` flags.
pub fn run_cpu(
    config: &Path,
    workers: usize,
    metrics: &Path,
    extra: &[&str],
) -> (Output, Vec<String>) {
    run_cpu_env(config, workers, metrics, extra, &[])
}

/// [`run_cpu`] with `env` set for mt-launch and its workers.
pub fn run_cpu_env(
    config: &Path,
    workers: usize,
    metrics: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Output, Vec<String>) {
    let mut args: Vec<String> = ["--config", path_str(config), "--gpus", "0", "--workers"]
        .into_iter()
        .map(String::from)
        .collect();
    args.push(workers.to_string());
    args.extend(["--metrics-out".to_string(), path_str(metrics).to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = mt_launch()
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .expect("spawn mt-launch");
    (out, args)
}

/// [`run_cpu`] that must succeed; its output.
pub fn run_cpu_ok(config: &Path, workers: usize, metrics: &Path, extra: &[&str]) -> Output {
    run_cpu_env_ok(config, workers, metrics, extra, &[])
}

/// [`run_cpu_env`] that must succeed; its output.
pub fn run_cpu_env_ok(
    config: &Path,
    workers: usize,
    metrics: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let (out, args) = run_cpu_env(config, workers, metrics, extra, env);
    assert_ok(&out, &args.iter().map(String::as_str).collect::<Vec<_>>());
    out
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

/// A JSON array of numbers.
pub fn f64_array(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
        .collect()
}

pub fn column(rows: &[serde_json::Value], key: &str) -> Vec<f64> {
    rows.iter()
        .map(|r| {
            r[key]
                .as_f64()
                .unwrap_or_else(|| panic!("metrics lack `{key}`"))
        })
        .collect()
}

pub fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// |a - b| <= tol * |b| elementwise; returns the worst relative error.
pub fn worst_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ: {a:?} vs {b:?}");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// Every tensor of a safetensors file as f32 (F32 or BF16 files).
pub fn tensors(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(name, v)| {
            let data = v.data();
            let vals = match v.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                safetensors::Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                    .collect(),
                d => panic!("{name}: unexpected dtype {d:?}"),
            };
            (name.to_string(), vals)
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖ for one tensor.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

/// The bytes of a file a run wrote, as two runs of the same training must agree on them:
/// who wrote it (the owner record, and the `owner` of a completion manifest: host, pid, run
/// id, start) is left out, every file listed with its size and checksum stays.
pub fn comparable(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let name = path.file_name().unwrap().to_string_lossy();
    match name.as_ref() {
        ".mt-owner.json" => Vec::new(),
        "COMPLETE" | "megatrain-export.json" if !bytes.is_empty() => {
            let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            v.as_object_mut().unwrap().remove("owner");
            serde_json::to_vec(&v).unwrap()
        }
        _ => bytes,
    }
}

/// Every file of `dir` (recursively), by relative path, with its [`comparable`] bytes.
pub fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, comparable(&p)));
            }
        }
    }
    out.sort();
    out
}
