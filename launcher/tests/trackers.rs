//! W&B and MLflow (`logging.report_to: [tensorboard, wandb, mlflow]`), read back with each
//! library's own reader and compared with the launcher's `--metrics-out` of the same run:
//!
//! - a run of the llama fixture in offline modes (W&B offline under a scratch WANDB_DIR,
//!   MLflow's file store under the scratch directory): every step's loss, learning rate and
//!   gradient norm in W&B's history (`wandb leet inspect --json`, W&B's reader of its
//!   `.wandb` transaction log) and in MLflow's metric history
//!   (`MlflowClient().get_metric_history`) are the metrics file's, to the bit: all three are
//!   written from the same f64 as shortest round-trip decimals, so no tolerance. The config,
//!   the plan's figures and the final losses are recorded (W&B config and summary, MLflow
//!   params and metrics), and both runs are finished;
//! - a side process that dies at once: warned of once, and training goes on to the end;
//! - the launcher killed (SIGKILL): the side process does not outlive it;
//! - an interpreter without the package, or none at all: an error naming it, the
//!   package and the pip command, before anything starts.
//!
//! Needs wandb and mlflow in .venv (scripts/setup.sh installs them): under CI=true their
//! absence fails the test, elsewhere it is skipped with the reason printed.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::fixture::{Fixture, Stage, fixture};
use common::*;

fn venv_python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python")
}

/// Whether .venv's Python has wandb and mlflow; under CI it must.
fn trackers_installed() -> bool {
    let ok = Command::new(venv_python())
        .args(["-c", "import wandb, mlflow"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = format!(
            "{} cannot import wandb and mlflow (scripts/setup.sh installs them)",
            venv_python().display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        eprintln!("skipped: {why}");
    }
    ok
}

/// The environment of an offline run whose trackers write under `dir`.
fn offline_env(cmd: &mut Command, dir: &Path) {
    cmd.env("WANDB_MODE", "offline")
        .env("WANDB_DIR", dir)
        .env("WANDB_SILENT", "true")
        .env(
            "MLFLOW_TRACKING_URI",
            format!("file:{}", dir.join("mlruns").display()),
        )
        // MLflow 3 asks for this to use its file store (maintained, no longer the default).
        .env("MLFLOW_ALLOW_FILE_STORE", "true")
        .env_remove("WANDB_PROJECT")
        .env_remove("MLFLOW_EXPERIMENT_NAME")
        .env_remove("MLFLOW_EXPERIMENT_ID");
}

/// The records of the run's `.wandb` log, as W&B's own reader prints them.
fn wandb_records(wandb_dir: &Path, summary: bool) -> Vec<serde_json::Value> {
    let runs: Vec<PathBuf> = std::fs::read_dir(wandb_dir.join("wandb"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("offline-run-")
        })
        .collect();
    assert_eq!(runs.len(), 1, "one offline run: {runs:?}");
    let mut cmd = Command::new(venv_python().with_file_name("wandb"));
    cmd.args(["leet", "inspect", "--json"]);
    if summary {
        cmd.arg("--summary");
    }
    let out = cmd.arg(&runs[0]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    match summary {
        true => vec![serde_json::from_str(&text).unwrap()],
        false => text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    }
}

/// The one MLflow run under `uri`: name, status, params, final metrics, and the history of
/// each step tag, read by MlflowClient.
const READ_MLFLOW: &str = r#"
import json, sys
from mlflow.tracking import MlflowClient
c = MlflowClient(sys.argv[1])
exp = c.get_experiment_by_name("megatrain")
runs = c.search_runs([exp.experiment_id])
assert len(runs) == 1, runs
r = runs[0]
hist = {k: [[m.step, m.value] for m in c.get_metric_history(r.info.run_id, k)]
        for k in ("train/loss", "train/learning_rate", "train/grad_norm", "eval/loss")}
print(json.dumps({"name": r.info.run_name, "status": r.info.status, "params": r.data.params,
                  "metrics": r.data.metrics, "history": hist}))
"#;

fn mlflow_run(dir: &Path) -> serde_json::Value {
    let uri = format!("file:{}", dir.join("mlruns").display());
    let out = Command::new(venv_python())
        .args(["-c", READ_MLFLOW, &uri])
        .env("MLFLOW_ALLOW_FILE_STORE", "true")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A fixture `name` and an mt-launch command in offline tracker mode writing under its
/// `trackers/` directory, with `--set logging.python=` the venv's interpreter (None, the
/// test skipped, where wandb or mlflow is missing outside CI).
fn offline_launch(name: &str) -> Option<(Fixture, PathBuf, Command, String)> {
    if !trackers_installed() {
        return None;
    }
    let f = fixture(name);
    let dir = f.dir.join("trackers");
    let mut cmd = mt_launch();
    offline_env(&mut cmd, &dir);
    let set_py = format!("logging.python={}", path_str(&venv_python()));
    Some((f, dir, cmd, set_py))
}

#[test]
fn wandb_and_mlflow_record_what_metrics_out_has() {
    let Some((f, dir, mut cmd, set_py)) = offline_launch("trackers") else {
        return;
    };
    let args = f.args(&[
        "--set",
        "logging.report_to=[tensorboard, wandb, mlflow]",
        "--set",
        &set_py,
        "--set",
        "logging.run_name=tiny-trackers",
        "--set",
        "training.num_steps=3",
        "--set",
        "dataset.val_size=4",
        "--set",
        "training.eval_steps=2",
    ]);
    let out = cmd.args(&args).output().unwrap();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_ok(&out, &argv);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("report_to wandb: "), "{stdout}");
    assert!(stdout.contains("report_to mlflow: file:"), "{stdout}");

    let rows = metrics(&f.metrics);
    assert_eq!(rows.len(), 3);
    let col = |k: &str| column(&rows, k);
    let evals: Vec<(u64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r["step"].as_u64()?, r.get("eval_loss")?.as_f64()?)))
        .collect();
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        [2, 3],
        "evaluated at step 2 and the last"
    );

    // W&B: the history records of its transaction log, then its summary of the run.
    let records = wandb_records(&dir, false);
    let history: Vec<&serde_json::Value> = records
        .iter()
        .filter(|r| r["type"] == "history")
        .map(|r| &r["history"])
        .collect();
    let steps: Vec<u64> = history
        .iter()
        .map(|h| h["step"]["num"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3]);
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/learning_rate", "lr"),
        ("train/grad_norm", "grad_norm"),
    ] {
        let logged: Vec<f64> = history
            .iter()
            .map(|h| h["item"][tag].as_f64().unwrap())
            .collect();
        assert_eq!(bits(&logged), bits(&col(key)), "W&B {tag}: {logged:?}");
    }
    let wandb_evals: Vec<(u64, f64)> = history
        .iter()
        .filter_map(|h| Some((h["step"]["num"].as_u64()?, h["item"]["eval/loss"].as_f64()?)))
        .collect();
    assert_eq!(wandb_evals, evals, "W&B eval/loss");
    let run = &wandb_records(&dir, true)[0];
    assert_eq!(run["state"], "finished", "{run}");
    assert_eq!(run["name"], "tiny-trackers");
    assert_eq!(run["project"], "megatrain");
    let (config, summary) = (&run["config"], &run["summary"]);
    assert_eq!(config["training"]["num_steps"], 3, "{config}");
    assert_eq!(config["logging"]["run_name"], "tiny-trackers");
    assert_eq!(config["plan"]["world_size"], 1);
    assert!(config["plan"]["params"].as_u64().unwrap() > 0, "{config}");
    assert!(config["plan"]["host_ram_total_bytes"].as_u64().unwrap() > 0);
    let last = *col("loss").last().unwrap();
    assert_eq!(
        summary["final_train_loss"].as_f64(),
        Some(last),
        "{summary}"
    );
    assert_eq!(summary["final_eval_loss"].as_f64(), Some(evals[1].1));
    assert_eq!(summary["global_step"], 3);
    assert!(summary["train_runtime"].as_f64().unwrap() > 0.0);
    assert!(summary["train_tokens_per_second"].as_f64().unwrap() > 0.0);

    // MLflow: its client over the same run.
    let m = mlflow_run(&dir);
    assert_eq!(m["name"], "tiny-trackers", "{m}");
    assert_eq!(m["status"], "FINISHED");
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/learning_rate", "lr"),
        ("train/grad_norm", "grad_norm"),
    ] {
        let h = m["history"][tag].as_array().unwrap();
        let steps: Vec<u64> = h.iter().map(|p| p[0].as_u64().unwrap()).collect();
        let logged: Vec<f64> = h.iter().map(|p| p[1].as_f64().unwrap()).collect();
        assert_eq!(steps, [1, 2, 3], "MLflow {tag}");
        assert_eq!(bits(&logged), bits(&col(key)), "MLflow {tag}: {logged:?}");
    }
    let mlflow_evals: Vec<(u64, f64)> = m["history"]["eval/loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    assert_eq!(mlflow_evals, evals, "MLflow eval/loss");
    let params = &m["params"];
    assert_eq!(params["training.num_steps"], "3", "{params}");
    assert_eq!(params["logging.run_name"], "tiny-trackers");
    assert_eq!(params["plan.world_size"], "1");
    assert_eq!(m["metrics"]["final_train_loss"].as_f64(), Some(last));
    assert_eq!(m["metrics"]["final_eval_loss"].as_f64(), Some(evals[1].1));

    // TensorBoard still writes its events beside them.
    let runs = f.out.join("runs");
    let events = std::fs::read_dir(&runs).map(|d| d.count()).unwrap_or(0);
    assert_eq!(events, 1, "one event file in {}", runs.display());
}

/// A stand-in interpreter: the package check finds every module; as the side process it
/// closes its input, says its runs started, and exits.
const DYING: &str = "#!/bin/sh\n\
case \"$2\" in *find_spec*) echo; exit 0;; esac\n\
exec 0<&-\n\
echo '{\"ready\": {\"wandb\": \"nowhere\"}}'\n";

#[test]
fn a_side_process_that_dies_is_warned_of_once_and_training_goes_on() {
    let f = fixture("trackers-dying");
    let fake = f.dir.join("dying-python");
    std::fs::write(&fake, DYING).unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let set_py = format!("logging.python={}", path_str(&fake));
    let args = f.args(&[
        "--set",
        "logging.report_to=wandb",
        "--set",
        &set_py,
        "--set",
        "training.num_steps=3",
    ]);
    let out = mt_launch().args(&args).output().unwrap();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_ok(&out, &argv);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warned = stderr
        .matches("the side process stopped taking metrics")
        .count();
    assert_eq!(warned, 1, "warned once:\n{stderr}");
    assert_eq!(metrics(&f.metrics).len(), 3, "every step ran");
}

#[test]
fn the_side_process_dies_with_the_launcher() {
    if !trackers_installed() {
        return;
    }
    let f = fixture("trackers-kill");
    let dir = f.dir.join("trackers");
    let py = venv_python();
    let set_py = format!("logging.python={}", path_str(&py));
    // Steps long enough to kill the launcher in the middle of the run.
    let args = f.args(&[
        "--set",
        "logging.report_to=wandb",
        "--set",
        &set_py,
        "--set",
        "training.num_steps=1000",
    ]);
    let mut cmd = mt_launch();
    offline_env(&mut cmd, &dir);
    let mut child = cmd
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let stdout = child.stdout.take().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.contains("report_to wandb: "))),
        "the run started"
    );
    // The side process and what it started (W&B's service), before any worker.
    let mut side = children(pid);
    assert!(!side.is_empty(), "the side process runs");
    side.extend(side.clone().into_iter().flat_map(children));
    signal("KILL", pid);
    child.wait().unwrap();
    let gone = wait_for(Duration::from_secs(30), || side.iter().all(|&p| !alive(p)));
    let left: Vec<u32> = side.into_iter().filter(|&p| alive(p)).collect();
    assert!(gone.is_some(), "{left:?} outlived the launcher");
}

#[test]
fn a_missing_package_or_interpreter_is_named_before_anything_starts() {
    let f = fixture("trackers-missing");
    // An interpreter without wandb: Python without its site-packages.
    let bare = f.dir.join("bare-python");
    let py = match venv_python().is_file() {
        true => venv_python(),
        false => PathBuf::from("python3"),
    };
    std::fs::write(
        &bare,
        format!("#!/bin/sh\nexec {} -S \"$@\"\n", py.display()),
    )
    .unwrap();
    std::fs::set_permissions(&bare, std::fs::Permissions::from_mode(0o755)).unwrap();
    let set_bare = format!("logging.python={}", path_str(&bare));
    f.fails(
        &["--set", "logging.report_to=[tensorboard, wandb]", "--set", &set_bare],
        Stage::Start,
        &[
            &format!(
                "logging.report_to: wandb needs the wandb package in {} (logging.python): pip install wandb",
                bare.display()
            ),
            "MT_PYTHON",
        ],
    );
    // No interpreter there at all.
    let none = f.dir.join("no-such-python");
    f.fails(
        &[
            "--set",
            "logging.report_to=mlflow",
            "--set",
            &format!("logging.python={}", path_str(&none)),
        ],
        Stage::Start,
        &[
            &format!(
                "logging.report_to: mlflow needs Python with the mlflow package: {} (logging.python) could not be run",
                none.display()
            ),
        ],
    );
}

#[test]
fn a_run_that_cannot_start_fails_the_launch_before_the_workers() {
    let Some((f, _dir, mut cmd, set_py)) = offline_launch("trackers-refused") else {
        return;
    };
    // MLflow 3 refuses its file store unless asked: its own message, in the launcher's.
    cmd.env_remove("MLFLOW_ALLOW_FILE_STORE");
    cmd.args(f.args(&["--set", "logging.report_to=mlflow", "--set", &set_py]));
    f.check_failure(
        cmd,
        Stage::Start,
        &[
            "logging.report_to: mlflow could not start a run (MlflowException",
            "MLFLOW_ALLOW_FILE_STORE",
        ],
    );
}
