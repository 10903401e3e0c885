//! Installing and running outside the checkout (issue 46): the binaries copied to a fresh
//! directory find torch without the build tree; the wheel (scripts/build_wheel.sh)
//! installs into a fresh venv and trains the tiny model from outside the repository; a
//! launch with no torch to be found says how to give one; `mt-launch export` writes an HF
//! directory from a checkpoint that transformers loads, holding the checkpoint's master
//! weights in the dtype asked (compared by torch), and refuses what a training export
//! refuses.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::fixture::{entries, fixture};
use common::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn venv_python() -> PathBuf {
    let py = repo().join(".venv/bin/python");
    assert!(
        py.is_file(),
        "{} is missing: run scripts/setup.sh",
        py.display()
    );
    py
}

/// A fresh directory outside the repository (the system's temporary directory).
/// Earlier runs' directories of the same name (left by a failure) are removed first.
fn outside(name: &str) -> PathBuf {
    let tmp = std::env::temp_dir();
    let prefix = format!("mt-install-{name}-");
    for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let dir = tmp.join(format!("{prefix}{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    assert!(
        !dir.starts_with(repo()),
        "{} is inside the repository",
        dir.display()
    );
    dir
}

/// Copies `from` (a file or a directory) to `to`.
fn copy_all(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            copy_all(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(from, to).unwrap();
    }
}

/// The tiny demo (configs/tiny.yaml, its model directory and data/) copied into `dir`, as
/// the config's relative paths expect them.
fn tiny_demo(dir: &Path) {
    let root = repo();
    copy_all(
        &root.join("configs/tiny.yaml"),
        &dir.join("configs/tiny.yaml"),
    );
    copy_all(&root.join("configs/tiny"), &dir.join("configs/tiny"));
    copy_all(&root.join("data"), &dir.join("data"));
}

/// `program` run in `cwd` with nothing of this environment but `path` as PATH and `env`:
/// no LIBTORCH (cargo sets it for tests), no LD_LIBRARY_PATH, no MT_* variable.
fn clean(program: &Path, cwd: &Path, path: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(cwd)
        .env_clear()
        .env("PATH", path)
        .envs(env.iter().copied());
    cmd
}

/// Two steps of the tiny demo, one CPU worker, writing no model.
const TINY_RUN: &[&str] = &[
    "--config",
    "configs/tiny.yaml",
    "--gpus",
    "0",
    "--workers",
    "1",
    "--metrics-out",
    "metrics.jsonl",
    "--set",
    "training.num_steps=2",
    "--set",
    "training.batch_size=4",
    "--set",
    "training.save_model=false",
];

fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The run in `dir` trained its two steps to a finite loss.
fn assert_trained(dir: &Path) {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("loss").is_some())
        .collect();
    let last = steps.last().expect("a step's metrics");
    assert_eq!(last["step"], 2, "{text}");
    assert!(last["loss"].as_f64().is_some_and(f64::is_finite), "{text}");
}

/// RUNPATH (or RPATH) entries of ELF file `bin`, by readelf.
fn runpath(bin: &Path) -> Vec<String> {
    let out = Command::new("readelf").arg("-d").arg(bin).output().unwrap();
    assert_success(&out, "readelf -d");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(RUNPATH)") || l.contains("(RPATH)"))
        .filter_map(|l| Some(l.split_once('[')?.1.trim_end_matches(']').to_string()))
        .flat_map(|e| e.split(':').map(String::from).collect::<Vec<_>>())
        .collect()
}

#[test]
fn copied_binaries_find_torch_without_the_build_tree() {
    let dir = outside("copied");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let built = launcher();
    for name in ["mt-launch", "mt-worker"] {
        std::fs::copy(built.with_file_name(name), bin.join(name)).unwrap();
        for entry in runpath(&bin.join(name)) {
            assert!(
                entry.starts_with("$ORIGIN/"),
                "{name} has RUNPATH entry {entry}: not relative to the binary"
            );
        }
    }
    // The copy alone does not find libtorch: nothing of the build tree is reachable.
    let ldd = clean(Path::new("ldd"), &dir, "/usr/bin:/bin", &[])
        .arg(bin.join("mt-worker"))
        .output()
        .unwrap();
    let ldd = String::from_utf8_lossy(&ldd.stdout);
    assert!(ldd.contains("libtorch_cpu.so => not found"), "{ldd}");

    // Found the documented way: the torch of the `python3` on PATH.
    let run = dir.join("run");
    tiny_demo(&run);
    let path = format!("{}:/usr/bin:/bin", repo().join(".venv/bin").display());
    let out = clean(&bin.join("mt-launch"), &run, &path, &[])
        .args(TINY_RUN)
        .output()
        .unwrap();
    assert_success(&out, "the copied mt-launch");
    assert_trained(&run);

    // And through MT_LIBTORCH, with no Python at all.
    let lib = torch_dir().join("lib");
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    let out = clean(
        &bin.join("mt-launch"),
        &run,
        "/usr/bin:/bin",
        &[
            ("MT_LIBTORCH", path_str(&lib)),
            ("MT_PYTHON", "/nonexistent/python3"),
        ],
    )
    .args(TINY_RUN)
    .output()
    .unwrap();
    assert_success(&out, "the copied mt-launch with MT_LIBTORCH");
    assert_trained(&run);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The folder of the .venv's torch.
fn torch_dir() -> PathBuf {
    let out = Command::new(venv_python())
        .args([
            "-c",
            "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])",
        ])
        .output()
        .unwrap();
    assert_success(&out, "finding the .venv's torch");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

#[test]
fn without_a_torch_the_launch_says_how_to_give_one() {
    let dir = outside("no-torch");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let built = launcher();
    for name in ["mt-launch", "mt-worker"] {
        std::fs::copy(built.with_file_name(name), bin.join(name)).unwrap();
    }
    let run = dir.join("run");
    tiny_demo(&run);
    let out = clean(
        &bin.join("mt-launch"),
        &run,
        "/usr/bin:/bin",
        &[("MT_PYTHON", "/nonexistent/python3")],
    )
    .args(TINY_RUN)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for needle in [
        "cannot find libtorch",
        "MT_LIBTORCH",
        "/nonexistent/python3",
        "pip install torch==2.11.0",
    ] {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
    assert!(
        !run.join("metrics.jsonl").exists(),
        "nothing is written before torch is found"
    );
    // A wrong MT_LIBTORCH is named.
    let out = clean(
        &bin.join("mt-launch"),
        &run,
        "/usr/bin:/bin",
        &[("MT_LIBTORCH", "/nonexistent")],
    )
    .args(TINY_RUN)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("MT_LIBTORCH=/nonexistent"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_wheel_installs_and_trains_outside_the_repository() {
    let dir = outside("wheel");
    let built = launcher();
    let py = venv_python();
    let out = Command::new("bash")
        .arg(repo().join("scripts/build_wheel.sh"))
        .arg(dir.join("dist"))
        .env("BIN", built.parent().unwrap())
        .env("PYTHON", &py)
        .output()
        .unwrap();
    assert_success(&out, "scripts/build_wheel.sh");
    let wheel = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .lines()
            .last()
            .unwrap(),
    );
    let tag = format!("-py3-none-linux_{}.whl", std::env::consts::ARCH);
    assert!(path_str(&wheel).ends_with(&tag), "{}", wheel.display());

    // A fresh venv that sees the .venv's torch through a .pth file (no second download of
    // torch), the wheel installed into it without its dependencies.
    let venv = dir.join("venv");
    let out = Command::new(&py)
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .output()
        .unwrap();
    assert_success(&out, "python -m venv");
    let vpy = venv.join("bin/python");
    let out = Command::new(&vpy)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .unwrap();
    let purelib = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let site = torch_dir().parent().unwrap().to_path_buf();
    std::fs::write(
        purelib.join("mt_torch.pth"),
        format!("{}\n", site.display()),
    )
    .unwrap();
    let out = Command::new(&py)
        .args(["-m", "pip", "--python"])
        .arg(&vpy)
        .args(["install", "--quiet", "--no-deps", "--no-index"])
        .arg(&wheel)
        .output()
        .unwrap();
    assert_success(&out, "pip install the wheel");
    let out = Command::new(&vpy)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.requires('megatrain-rs'))",
        ])
        .output()
        .unwrap();
    let requires = String::from_utf8_lossy(&out.stdout);
    assert!(requires.contains("torch==2.11.0"), "{requires}");

    let run = dir.join("run");
    tiny_demo(&run);
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    let out = clean(&venv.join("bin/mt-launch"), &run, &path, &[])
        .args(TINY_RUN)
        .output()
        .unwrap();
    assert_success(&out, "mt-launch from the wheel");
    assert_trained(&run);
    let out = clean(&venv.join("bin/mt-launch"), &run, &path, &[])
        .arg("export")
        .arg("--help")
        .output()
        .unwrap();
    assert_success(&out, "mt-launch export --help from the wheel");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The checkpoint's fp32 master weights by HF name, from its optimizer.safetensors and the
/// layout the launcher reads the model with, written to `to` for the Python check.
fn master_by_name(ck: &Path, to: &Path) {
    let mut spec = mt::config::hf::ModelSpec::from_model_dir(ck).unwrap();
    mt::checkpoint::carried::resolve(ck, &mut spec).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let bytes = std::fs::read(ck.join("optimizer.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let master = st.tensor("master").unwrap();
    assert_eq!(master.dtype(), Dtype::F32);
    let data = master.data();
    let tensors: Vec<(String, Vec<usize>, &[u8])> = layout
        .tensors()
        .map(|(b, t)| {
            let r = mt::layout::Layout::global_range(b, t);
            (b.hf_name(t), t.shape.clone(), &data[4 * r.start..4 * r.end])
        })
        .collect();
    let views = tensors.iter().map(|(n, s, d)| {
        (
            n.clone(),
            TensorView::new(Dtype::F32, s.clone(), d).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, to).unwrap();
}

/// Loads each exported directory with transformers (dtype "auto": the one config.json
/// names) and checks: every parameter is the checkpoint's master, converted by torch to
/// the dtype asked (fp32 equal; bf16 torch's round to nearest even, equal); the loaded
/// dtype is the one asked; logits on a few tokens are finite and of that dtype.
const CHECK: &str = r#"
import sys, torch, safetensors.torch as st, transformers
master = st.load_file(sys.argv[1])
for d, name in zip(sys.argv[2::2], sys.argv[3::2]):
    dt = getattr(torch, name)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype="auto")
    sd = m.state_dict()
    assert set(master) <= set(sd), sorted(set(master) - set(sd))
    for k, v in master.items():
        assert sd[k].dtype == dt, (d, k, sd[k].dtype)
        assert torch.equal(sd[k], v.to(dt)), (d, k, (sd[k].float() - v).abs().max())
    with torch.no_grad():
        logits = m(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.dtype == dt, (d, logits.dtype)
    assert torch.isfinite(logits).all(), d
    print(d, name, len(master), "tensors equal")
"#;

#[test]
fn export_writes_a_checkpoint_as_an_hf_directory_in_either_dtype() {
    let f = fixture("install-export");
    let ck = f.checkpoint(2);
    let expected = f.dir.join("master.safetensors");
    master_by_name(&ck, &expected);
    let mut check = Command::new(venv_python());
    check.args(["-c", CHECK]).arg(&expected);
    for dtype in ["float32", "bfloat16"] {
        let out = f.dir.join(format!("hf-{dtype}"));
        run_ok(&["export", path_str(&ck), path_str(&out), "--dtype", dtype]);
        check.arg(&out).arg(dtype);
    }
    let res = check.output().unwrap();
    assert_success(&res, "the transformers check of the exports");

    // Again over its own export: replaced, no flag needed.
    let own = f.dir.join("hf-float32");
    run_ok(&["export", path_str(&ck), path_str(&own)]);
    // The default dtype is the checkpoint's (the fixture trains in float32).
    let cfg = json(&own.join("config.json"));
    assert_eq!(cfg["dtype"], "float32");

    // Never into the checkpoint.
    let inside = ck.join("hf");
    let out = run(&["export", path_str(&ck), path_str(&inside)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("lies inside"),
        "{err}"
    );
    assert!(!inside.exists());
    // Never over files this project did not write, unless told.
    let mine = f.dir.join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let out = run(&["export", path_str(&ck), path_str(&mine)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for needle in ["notes.txt", "--overwrite-output-dir", "OUT"] {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
    run_ok(&[
        "export",
        path_str(&ck),
        path_str(&mine),
        "--overwrite-output-dir",
    ]);
    assert_eq!(
        std::fs::read_to_string(mine.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(mine.join("model.safetensors").is_file());
    // Into the run's output directory that holds the checkpoint (a training export's
    // place): written, the checkpoints kept.
    let run_out = f.dir.join("run-out");
    let inner = run_out.join("checkpoints/step-00000002");
    copy_all(&ck, &inner);
    run_ok(&["export", path_str(&inner), path_str(&run_out)]);
    assert!(run_out.join("model.safetensors").is_file());
    assert_eq!(
        entries(&inner),
        entries(&ck),
        "the checkpoint is kept whole"
    );
    // A missing checkpoint is named.
    let gone = f.dir.join("no-such-step");
    let out = run(&["export", path_str(&gone), path_str(&f.dir.join("x"))]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no-such-step"),
        "{err}"
    );
}
