//! A run's work is kept by default: without `training.output_dir` the model goes to
//! `output/<config stem>/` under the current directory and checkpoints to its
//! `checkpoints/`; SIGTERM writes a checkpoint there that `--resume latest` continues from
//! bit for bit; a worker killed with SIGKILL mid-run leaves a checkpoint of the last
//! completed step, from which the run also continues bit for bit (losses and final
//! weights); every shipped config that fine-tunes a pretrained model names its output, and
//! the benchmark shapes opt out.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;

/// The llama fixture's config (its stem, `run`, names the default output).
fn config() -> PathBuf {
    golden_dir().join("llama").join("run.yaml")
}

/// mt-launch on the llama fixture with 2 CPU workers in `cwd`, metrics to `metrics`.
fn command(cwd: &Path, metrics: &Path, steps: u64, extra: &[&str]) -> Command {
    let mut cmd = Command::new(launcher());
    cmd.current_dir(cwd)
        .args([
            "--config",
            path_str(&config()),
            "--gpus",
            "0",
            "--workers",
            "2",
        ])
        .args(["--set", &format!("training.num_steps={steps}")])
        .args(["--metrics-out", path_str(metrics)])
        .args(extra);
    cmd
}

fn output(mut cmd: Command) -> Output {
    cmd.output().expect("spawn mt-launch")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A straight run of `steps` steps in its own directory: its losses and final weights.
fn straight(dir: &Path, steps: u64) -> (Vec<f64>, Tensors) {
    let cwd = dir.join("straight");
    std::fs::create_dir_all(&cwd).unwrap();
    let m = dir.join("straight.jsonl");
    let out = output(command(&cwd, &m, steps, &[]));
    assert_ok(&out, &["straight"]);
    let weights = tensors(&cwd.join("output/run/model.safetensors"));
    (column(&metrics(&m), "loss"), weights)
}

/// Resumes with `--resume latest` in `cwd` (the same config) up to `steps`; asserts that
/// the losses before and after equal the straight run's and the final weights too, bit
/// for bit.
fn resume_matches(cwd: &Path, first: &Path, steps: u64, want: &(Vec<f64>, Tensors)) {
    let second = cwd.join("../second.jsonl");
    let out = output(command(cwd, &second, steps, &["--resume", "latest"]));
    assert_ok(&out, &["--resume", "latest"]);
    let mut losses = column(&metrics(first), "loss");
    losses.extend(column(&metrics(&second), "loss"));
    assert_eq!(
        f64_bits(&losses),
        f64_bits(&want.0),
        "interrupted + resumed {losses:?} vs straight {:?}",
        want.0
    );
    let weights = tensors(&cwd.join("output/run/model.safetensors"));
    assert_eq!(weights.len(), want.1.len(), "tensor counts");
    assert_same_bits(&weights, &want.1, "resumed vs straight: ");
}

#[test]
fn a_run_without_output_dir_writes_output_of_its_config_stem() {
    let cwd = scratch("keep-default-output").canonicalize().unwrap();
    let m = cwd.join("metrics.jsonl");
    let out = output(command(&cwd, &m, 2, &[]));
    assert_ok(&out, &["default output"]);
    let said = text(&out);
    let dir = cwd.join("output/run");
    for want in [
        format!("the model goes to {}", dir.display()),
        format!("model written to {}", dir.display()),
        format!("checkpoints go to {}", dir.join("checkpoints").display()),
    ] {
        assert!(said.contains(&want), "want `{want}` in:\n{said}");
    }
    assert!(dir.join("model.safetensors").is_file() && dir.join("config.json").is_file());
    // The end of the run is checkpointed there too.
    assert!(dir.join("checkpoints/step-00000002/COMPLETE").is_file());
}

/// Waits until `path` has at least `n` lines.
fn wait_lines(path: &Path, n: usize, within: Duration) {
    let t = std::time::Instant::now();
    while std::fs::read_to_string(path).map_or(0, |s| s.lines().count()) < n {
        assert!(
            t.elapsed() < within,
            "{} has fewer than {n} lines",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigterm_without_checkpoint_dir_checkpoints_and_resumes_exactly() {
    let dir = scratch("keep-sigterm").canonicalize().unwrap();
    // Enough steps that the signal lands mid-run (a step of this fixture takes
    // milliseconds; the signal goes as soon as step 2 is reported).
    let steps = 400;
    let want = straight(&dir, steps);
    let cwd = dir.join("stopped");
    std::fs::create_dir_all(&cwd).unwrap();
    let first = dir.join("first.jsonl");
    let mut cmd = command(&cwd, &first, steps, &[]);
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_lines(&first, 2, Duration::from_secs(60));
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(143), "{said}");
    let done = metrics(&first).len();
    assert!(
        done >= 2 && (done as u64) < steps,
        "stopped after {done} steps"
    );
    let ck = cwd.join(format!("output/run/checkpoints/step-{done:08}"));
    assert!(
        ck.join("COMPLETE").is_file(),
        "no {}:\n{said}",
        ck.display()
    );
    for want in [
        format!("checkpoint of step {done} in {}", ck.display()),
        "--resume latest".to_string(),
        "not exported on a stop".to_string(),
    ] {
        assert!(said.contains(&want), "want `{want}` in:\n{said}");
    }
    assert!(
        !cwd.join("output/run/model.safetensors").exists(),
        "a stop exports nothing"
    );
    resume_matches(&cwd, &first, steps, &want);
}

/// Also where step 3's own checkpoint is being written in the background when the worker
/// dies (`every_steps: 1`): it waits for the moments the next backward had not made, which
/// the launcher then makes itself.
#[test]
fn a_worker_killed_mid_run_leaves_a_checkpoint_to_resume_exactly() {
    killed_and_resumed("keep-sigkill", &[]);
    killed_and_resumed("keep-sigkill-every", &["--set", "checkpoint.every_steps=1"]);
}

fn killed_and_resumed(name: &str, extra: &[&str]) {
    let dir = scratch(name).canonicalize().unwrap();
    let steps = 6;
    let want = straight(&dir, steps);
    let cwd = dir.join("crashed");
    std::fs::create_dir_all(&cwd).unwrap();
    let first = dir.join("first.jsonl");
    // Rank 1 is killed as step 4 is sent to it: steps 1-3 are complete.
    let mut cmd = command(&cwd, &first, steps, extra);
    cmd.env("MT_TEST_KILL_WORKER", "1:4");
    let out = output(cmd);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    let ck = cwd.join("output/run/checkpoints/step-00000003");
    for want in [
        "worker rank 1".to_string(),
        "SIGKILL".to_string(),
        format!("checkpoint of step 3 written to {}", ck.display()),
        "--resume latest".to_string(),
    ] {
        assert!(said.contains(&want), "want `{want}` in:\n{said}");
    }
    assert!(ck.join("COMPLETE").is_file());
    assert_eq!(metrics(&first).len(), 3, "{said}");
    resume_matches(&cwd, &first, steps, &want);
}

/// Every shipped config at configs/ is a recipe: a fine-tune of a pretrained model that
/// names its output, or the tiny CPU demo; the benchmark shapes (random init, writing no
/// model) are apart in configs/bench/.
#[test]
fn shipped_configs_name_their_output_or_opt_out() {
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut seen = 0;
    for dir in [configs.clone(), configs.join("bench")] {
        let bench = dir != configs;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_none_or(|x| x != "yaml") {
                continue;
            }
            seen += 1;
            let cfg = mt::config::RunConfig::load_for_plan(&p, &[])
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            match (bench, cfg.model.init) {
                (false, mt::config::Init::Pretrained) => assert!(
                    !cfg.training.output_dir_is_default && cfg.export_dir().is_some(),
                    "{name}: a pretrained fine-tune names training.output_dir"
                ),
                (false, mt::config::Init::Random) => assert!(
                    name.starts_with("tiny"),
                    "{name}: a random-init shape belongs in configs/bench/"
                ),
                (true, init) => assert!(
                    init == mt::config::Init::Random && !cfg.training.save_model,
                    "{name}: a benchmark shape is random init and sets training.save_model: false"
                ),
            }
        }
    }
    assert!(seen >= 27, "read {seen} configs");
}

/// `mt-launch plan` states what a run's checkpoints cost on disk: the model in its dtype
/// (Qwen2.5-7B in bf16: 2 bytes per parameter) plus the optimizer state (fp32 master, m and
/// v: 12 bytes per parameter), how many are kept and how often; a benchmark shape writes
/// none.
#[test]
fn plan_states_the_disk_a_checkpoint_takes() {
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let plan = |name: &str, json: bool| {
        let mut cmd = mt_launch();
        cmd.args([
            "plan",
            "--config",
            path_str(&configs.join(name)),
            "--gpus",
            "0",
        ]);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let v: serde_json::Value = serde_json::from_str(&plan("qwen2.5_7b.yaml", true)).unwrap();
    let (d, params) = (&v["disk"], v["host"]["params"].as_u64().unwrap());
    assert_eq!(d["model_bytes"].as_u64(), Some(2 * params), "{d}");
    assert_eq!(d["optimizer_bytes"].as_u64(), Some(12 * params), "{d}");
    assert_eq!(d["checkpoint_bytes"].as_u64(), Some(14 * params), "{d}");
    assert_eq!(d["kept_bytes"].as_u64(), Some(28 * params), "{d}");
    assert_eq!(
        (d["keep_last"].as_u64(), d["every_minutes"].as_u64()),
        (Some(2), Some(30))
    );
    assert!(
        d["checkpoint_dir"]
            .as_str()
            .unwrap()
            .ends_with("output/qwen2.5_7b/checkpoints")
    );
    let said = plan("qwen2.5_7b.yaml", false);
    assert!(
        said.contains("each checkpoint") && said.contains("every 30 minutes"),
        "{said}"
    );
    let said = plan("bench/qwen_7b.yaml", false);
    assert!(
        said.contains("not written (training.save_model: false)"),
        "{said}"
    );
    assert!(said.contains("none (no checkpoint.dir)"), "{said}");
}
