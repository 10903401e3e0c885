//! The user's files are never clobbered and one run owns its directories: an output or
//! checkpoint directory at, inside or around the model is refused (the model untouched,
//! byte for byte); an output directory holding another model's weights and the user's
//! files is refused naming them, and accepted with `training.overwrite_output_dir`; a
//! second run on a checkpoint directory in use is refused at once naming the holder, and
//! the lock a killed run left is taken over naming it; `--resume` of a writer's temporary
//! directory is refused and leaves it; a resume with other data or optimizer settings is
//! refused naming each, and accepted with `--resume-changed`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::fixture::{Fixture, fixture, path};
use common::*;

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().is_file() {
            let name = e.file_name().to_string_lossy().to_string();
            files.insert(name, std::fs::read(e.path()).unwrap());
        }
    }
    files
}

/// mt-launch on the fixture with `extra`: (success, stderr).
fn launch(f: &Fixture, extra: &[&str]) -> (bool, String) {
    let args = f.args(extra);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run(&refs);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!err.contains("panicked"), "no panic on bad input:\n{err}");
    (out.status.success(), err)
}

fn refused(f: &Fixture, extra: &[&str], needles: &[&str]) -> String {
    let (ok, err) = launch(f, extra);
    assert!(!ok, "expected a refusal for {extra:?}:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
    }
    err
}

#[test]
fn directories_at_inside_or_around_the_model_are_refused() {
    let f = fixture("own-model");
    let before = snapshot(&f.model);
    let model = path(&f.model);
    let link = f.dir.join("model-link");
    std::os::unix::fs::symlink(&f.model, &link).unwrap();
    for (set, needles) in [
        (
            format!("training.output_dir={model}"),
            ["training.output_dir", "is model.path"],
        ),
        (
            format!("checkpoint.dir={model}/ck"),
            ["checkpoint.dir", "lies inside model.path"],
        ),
        (
            format!("training.output_dir={}", path(&f.dir)),
            ["training.output_dir", "contains model.path"],
        ),
        (
            format!("training.output_dir={}", path(&link)),
            ["training.output_dir", "is model.path"],
        ),
    ] {
        let err = refused(&f, &["--set", &set], &needles);
        assert!(err.contains(&model), "names model.path:\n{err}");
        assert!(snapshot(&f.model) == before, "{set}: the model dir changed");
        // Before any work: no data read, nothing started.
        assert!(!f.metrics.exists() && !f.ck.exists(), "{set}: work began");
    }
    // `--dry-run` checks it too.
    refused(
        &f,
        &[
            "--set",
            &format!("training.output_dir={model}"),
            "--dry-run",
        ],
        &["is model.path"],
    );
    assert!(snapshot(&f.model) == before);
}

#[test]
fn a_foreign_output_dir_is_refused_naming_its_files_unless_overwrite() {
    let f = fixture("own-foreign");
    std::fs::create_dir_all(&f.out).unwrap();
    for (name, text) in [
        ("model-00001-of-00002.safetensors", "not ours"),
        ("model.safetensors.index.json", "{}"),
        ("notes.md", "the user's notes"),
    ] {
        std::fs::write(f.out.join(name), text).unwrap();
    }
    let err = refused(
        &f,
        &[],
        &[
            "training.output_dir",
            "holds files this project did not write",
            "model-00001-of-00002.safetensors, model.safetensors.index.json, notes.md",
            "training.overwrite_output_dir=true",
        ],
    );
    assert!(!err.contains("starting"), "refused before any work:\n{err}");
    assert!(!f.metrics.exists(), "refused before training");
    assert_eq!(
        std::fs::read_to_string(f.out.join("notes.md")).unwrap(),
        "the user's notes"
    );
    // A checkpoint directory with something that is not a checkpoint.
    std::fs::create_dir_all(f.ck.join("step-00000007")).unwrap();
    let out2 = format!("training.output_dir={}", path(&f.dir.join("out2")));
    refused(&f, &["--set", &out2], &["checkpoint.dir", "step-00000007"]);
    std::fs::remove_dir(f.ck.join("step-00000007")).unwrap();
    let (ok, err) = launch(&f, &["--set", "training.overwrite_output_dir=true"]);
    assert!(ok, "overwrite accepted:\n{err}");
    assert!(
        f.out.join("config.json").is_file(),
        "the model was exported"
    );
    assert_eq!(
        std::fs::read_to_string(f.out.join("notes.md")).unwrap(),
        "the user's notes",
        "the user's other files stay"
    );
}

#[test]
fn a_second_run_on_a_directory_in_use_is_refused_and_a_dead_runs_lock_taken_over() {
    let f = fixture("own-lock");
    let lock = f.dir.join(".ck.mt-lock");
    let first_metrics = f.dir.join("first.jsonl");
    let mut args = f.args(&["--set", "training.num_steps=1000000"]);
    let at = args.iter().position(|a| a == "--metrics-out").unwrap();
    args[at + 1] = path(&first_metrics);
    let mut first = Command::new(launcher())
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = first.id();
    let held = wait_for(Duration::from_secs(60), || {
        std::fs::read_to_string(&lock).is_ok_and(|t| t.contains(&format!("\"pid\":{pid}")))
    });
    assert!(
        held.is_some(),
        "the first run recorded no lock in {}",
        lock.display()
    );
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let host = host.trim();
    // Its own output directory, so that the checkpoint directory is what conflicts.
    let out2 = format!("training.output_dir={}", path(&f.dir.join("out2")));
    let t = Instant::now();
    let err = refused(
        &f,
        &["--set", &out2],
        &[&format!(
            "checkpoint.dir {} is in use by pid {pid} on {host}",
            path(&f.ck)
        )],
    );
    let refused_s = t.elapsed().as_secs_f64();
    eprintln!("second run refused in {refused_s:.2}s: {}", err.trim());
    // Config and directories only: a second or two on a loaded machine, far below the
    // first run's start-up (it reads the data and starts workers first).
    assert!(refused_s < 10.0, "refused after {refused_s:.1}s");
    assert!(!f.dir.join("out2").exists());
    // The output directory is locked too, and a dry run says so without failing.
    refused(&f, &[], &["training.output_dir", "is in use by"]);
    let args = f.args(&["--dry-run"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run_ok(&refs);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("is in use by") && said.contains(&format!("pid {pid}")),
        "{said}"
    );

    // Killed: its lock files stay, naming it; the next run takes them over, saying whose.
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(
        std::fs::read_to_string(&lock)
            .unwrap()
            .contains(&format!("\"pid\":{pid}"))
    );
    let (ok, err) = launch(&f, &["--set", "training.num_steps=1"]);
    assert!(ok, "{err}");
    let took: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("taking over the lock"))
        .collect();
    assert_eq!(took.len(), 2, "output and checkpoint directories:\n{err}");
    assert!(
        took.iter()
            .all(|l| l.contains(&format!("pid {pid} on {host}"))),
        "{took:?}"
    );
    assert_eq!(
        std::fs::read(&lock).unwrap(),
        b"",
        "a clean exit empties it"
    );
}

#[test]
fn resume_of_an_interrupted_write_is_refused_and_the_directory_left() {
    let f = fixture("own-tmp");
    // pid 1 << 23 cannot exist: start-up's clean-up would remove these if it ran first.
    for name in [
        ".tmp-step-00000002-8388608",
        ".mt-tmp-step-00000002-8388608",
    ] {
        let tmp = f.ck.join(name);
        std::fs::create_dir_all(&tmp).unwrap();
        std::fs::write(tmp.join("trainer_state.json"), "{}").unwrap();
        refused(
            &f,
            &["--resume", &path(&tmp)],
            &[name, "an interrupted checkpoint write, not a checkpoint"],
        );
        assert!(
            tmp.join("trainer_state.json").is_file(),
            "{name} was touched"
        );
    }
    // `--resume-changed` needs `--resume`.
    refused(&f, &["--resume-changed"], &["--resume"]);
}

#[test]
fn resume_with_other_settings_is_refused_naming_each_unless_resume_changed() {
    let f = fixture("own-settings");
    let step2 = f.checkpoint(2);
    let other = f.dir.join("other.jsonl");
    let data = std::fs::read_to_string(&f.data).unwrap();
    let first = data.lines().next().unwrap();
    std::fs::write(&other, format!("{data}{first}\n")).unwrap();
    let resume = path(&step2);
    let changed = [
        "--set",
        "training.num_steps=3",
        "--set",
        "training.learning_rate=0.5",
        "--set",
        "dataset.max_seq_len=100000",
        "--set",
        &format!("dataset.path={}", path(&other)),
        "--resume",
        &resume,
    ];
    let err = refused(
        &f,
        &changed,
        &[
            "would not continue the checkpoint's run",
            "training.learning_rate: now 0.5, the checkpoint's run had 0.00001",
            "dataset.max_seq_len: now 100000, the checkpoint's run had unset",
            "dataset file 1 of 1: now ",
            "other.jsonl",
            "--resume-changed",
        ],
    );
    assert!(!err.contains("starting"), "refused before any work:\n{err}");
    let (ok, err) = launch(&f, &[&changed[..], &["--resume-changed"]].concat());
    assert!(ok, "{err}");
    let warned = err
        .lines()
        .filter(|l| l.contains("--resume-changed"))
        .count();
    assert_eq!(warned, 3, "one warning per difference:\n{err}");
    std::fs::remove_dir_all(&f.out).unwrap();
    // A checkpoint of an earlier build records no settings: resumed, with a warning.
    let state = step2.join("trainer_state.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    v["schedule"].as_object_mut().unwrap().remove("settings");
    std::fs::write(&state, v.to_string()).unwrap();
    // An earlier build's marker is empty (no manifest to verify against).
    std::fs::write(step2.join("COMPLETE"), "").unwrap();
    let (ok, err) = launch(&f, &["--set", "training.num_steps=3", "--resume", &resume]);
    assert!(ok, "{err}");
    assert!(err.contains("cannot check them"), "{err}");
}
