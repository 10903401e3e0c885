//! Never lose a model (#45): the output directory holds a complete export at every instant
//! of an export, whatever kills the launcher; what the writers create never goes through a
//! planted link; a damaged or non-finite checkpoint is refused on resume, naming the file
//! or the tensor.
//!
//! The kills use the export's test hook (`MT_TEST_EXPORT_PAUSE=<instant>:<flag>`,
//! src/checkpoint/export/install.rs): the launcher pauses at the instant and writes the
//! flag, and the test kills it with SIGKILL there.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use mt::checkpoint::manifest::{self, EXPORT_MARKER, Manifest};

fn config() -> PathBuf {
    golden_dir().join("llama/run.yaml")
}

/// `--set` flags: `steps` steps, exported to `out` in shards of 20 KB, plus `extra`.
fn sets(out: &Path, steps: u64, extra: &[String]) -> Vec<String> {
    let mut v = vec![
        format!("training.output_dir={}", out.display()),
        format!("training.num_steps={steps}"),
        "checkpoint.max_shard_size=20KB".to_string(),
    ];
    v.extend(extra.iter().cloned());
    v.into_iter()
        .flat_map(|s| ["--set".to_string(), s])
        .collect()
}

fn train(dir: &Path, tag: &str, args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cpu(&config(), 1, &dir.join(format!("{tag}.jsonl")), &args).0
}

/// The files (name, size, CRC) of the export in `dir`, after checking every one of them.
fn export_files(dir: &Path) -> Vec<manifest::Entry> {
    manifest::verify(dir)
        .unwrap_or_else(|e| panic!("{} is not a complete export: {e}", dir.display()));
    Manifest::read(dir, EXPORT_MARKER).unwrap().unwrap().files
}

/// Entries of `parent` whose name starts with `.out.mt-tmp-`.
fn temp_entries(parent: &Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".out.mt-tmp-"))
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Runs the launcher with the pause hook at `instant`, waits for it there and kills it.
fn kill_at(dir: &Path, instant: &str, args: &[String]) {
    let flag = dir.join(format!("paused-{instant}"));
    let metrics = dir.join(format!("{instant}.jsonl"));
    let mut child = Command::new(launcher())
        .args([
            "--config",
            path_str(&config()),
            "--gpus",
            "0",
            "--workers",
            "1",
        ])
        .args(["--metrics-out", path_str(&metrics)])
        .args(args)
        .env(
            "MT_TEST_EXPORT_PAUSE",
            format!("{instant}:{}", flag.display()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn mt-launch");
    let t = Instant::now();
    while !flag.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the run ended ({status}) before pausing at {instant}:\n{err}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "no pause at {instant}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A launcher killed at each instant of an export over an earlier one leaves under the
/// output's name the earlier export (before the exchange) or the new one (after it),
/// complete and loadable by transformers with the expected weights; the run's other
/// entries in the output directory (a user's file, the checkpoints) come back at the next
/// start, and nothing of the killed writer is left.
#[test]
fn a_killed_export_leaves_the_previous_or_the_new_model() {
    let dir = scratch("atomic-export-kill");
    let out = dir.join("out");
    let ck = format!("checkpoint.dir={}", out.join("checkpoints").display());
    // The expected models: A (1 step) and B (2 steps), each exported alone.
    let (want_a, want_b) = (dir.join("want-a"), dir.join("want-b"));
    assert_ok(&train(&dir, "a", &sets(&want_a, 1, &[])), &[]);
    assert_ok(&train(&dir, "b", &sets(&want_b, 2, &[])), &[]);
    let (files_a, files_b) = (export_files(&want_a), export_files(&want_b));
    assert!(
        files_a
            .iter()
            .filter(|f| f.name.starts_with("model-"))
            .count()
            > 2
    );
    assert_ne!(files_a, files_b, "the two models differ");

    // The output holds A, a file of the user's and the run's checkpoints.
    assert_ok(
        &train(&dir, "first", &sets(&out, 1, std::slice::from_ref(&ck))),
        &[],
    );
    assert_eq!(export_files(&out), files_a);
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    assert!(out.join("checkpoints/step-00000001/COMPLETE").is_file());
    // A file this project did not write: the runs are told to write there anyway (else
    // the output directory is refused: ownership.rs), and keep it.
    let ck_over = [ck.clone(), "training.overwrite_output_dir=true".to_string()];

    let mut snapshots = Vec::new();
    let instants = [
        ("mid-tensor", &files_a, &want_a),
        ("between-files", &files_a, &want_a),
        ("manifest", &files_a, &want_a),
        ("rename", &files_a, &want_a),
        ("exchanged", &files_b, &want_b),
    ];
    for (instant, files, want) in instants {
        kill_at(&dir, instant, &sets(&out, 2, &ck_over));
        assert_eq!(&export_files(&out), files, "killed at {instant}");
        let snap = dir.join(format!("snap-{instant}"));
        copy_dir(&out, &snap);
        snapshots.push(format!("{}={}", snap.display(), want.display()));
        if instant != "exchanged" {
            assert_eq!(
                std::fs::read_to_string(out.join("notes.txt")).unwrap(),
                "mine"
            );
        }
    }
    // Killed after the exchange: the old directory, with the user's file, waits beside.
    assert!(!out.join("notes.txt").exists());
    assert_eq!(temp_entries(&dir).len(), 1, "{:?}", temp_entries(&dir));

    // The next run puts the user's file and the checkpoints back first, then exports A.
    assert_ok(&train(&dir, "last", &sets(&out, 1, &ck_over)), &[]);
    assert_eq!(export_files(&out), files_a);
    assert_eq!(
        std::fs::read_to_string(out.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(out.join("checkpoints/step-00000001/COMPLETE").is_file());
    assert!(temp_entries(&dir).is_empty(), "{:?}", temp_entries(&dir));
    for hidden in [".mt-owner.json", ".mt-exchange.json"] {
        assert!(!out.join(hidden).exists(), "{hidden} left in the export");
    }

    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !py.is_file() {
        eprintln!("SKIPPED the transformers load: no .venv/bin/python (scripts/setup.sh)");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/compare_exports.py");
    let res = Command::new(py)
        .arg(script)
        .args(&snapshots)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// Links planted under the names the writers use, and as a temporary directory's name,
/// are never followed: their targets keep their bytes, and the export and checkpoints are
/// complete.
#[test]
fn planted_links_are_never_followed() {
    let dir = scratch("atomic-export-links");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let victims = dir.join("victims");
    std::fs::create_dir_all(&victims).unwrap();
    std::fs::write(victims.join("file"), "precious").unwrap();
    // A directory that looks like a dead writer's temporary directory.
    let fake = victims.join("dir");
    std::fs::create_dir_all(&fake).unwrap();
    let dead = serde_json::json!({"host": mt::checkpoint::owner::host_name(), "pid": 1 << 23,
        "run_id": "0000000000000000", "started": 0});
    std::fs::write(fake.join(".mt-owner.json"), dead.to_string()).unwrap();
    std::fs::write(fake.join("data"), "precious").unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::create_dir_all(&ck).unwrap();
    let link = |target: &Path, at: PathBuf| std::os::unix::fs::symlink(target, at).unwrap();
    // The names of an earlier version's writers, and this one's final names.
    for name in [
        "config.json",
        "model.safetensors",
        ".config.json.tmp",
        "tokenizer.json",
    ] {
        link(&victims.join("file"), out.join(name));
    }
    link(&fake, dir.join(".out.mt-tmp-00000000000000ff"));
    link(&fake, ck.join(".mt-tmp-00000000000000ff"));
    link(&fake, ck.join(format!(".tmp-step-00000002-{}", 1 << 23)));
    link(&victims.join("file"), ck.join("step-00000002"));
    // The planted names are not this project's files: the run is told to write there
    // anyway (else both directories are refused: ownership.rs).
    let extra = [
        format!("checkpoint.dir={}", ck.display()),
        "checkpoint.every_steps=1".to_string(),
        "training.overwrite_output_dir=true".to_string(),
    ];
    // A link where a checkpoint goes is not replaced either: that write fails, naming it.
    let refused = train(&dir, "refused", &sets(&out, 2, &extra));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && err.contains("step-00000002")
            && err.contains("not a checkpoint this project wrote"),
        "{err}"
    );
    assert!(
        std::fs::symlink_metadata(ck.join("step-00000002"))
            .unwrap()
            .is_symlink()
    );
    std::fs::remove_file(ck.join("step-00000002")).unwrap();
    assert_ok(&train(&dir, "run", &sets(&out, 2, &extra)), &[]);
    assert_eq!(
        std::fs::read_to_string(victims.join("file")).unwrap(),
        "precious"
    );
    assert_eq!(
        std::fs::read_to_string(fake.join("data")).unwrap(),
        "precious"
    );
    assert!(fake.join(".mt-owner.json").is_file());
    export_files(&out);
    for step in ["step-00000001", "step-00000002"] {
        let s = ck.join(step);
        assert!(std::fs::symlink_metadata(&s).unwrap().is_dir(), "{step}");
        manifest::verify(&s).unwrap();
    }
}

/// A resumed checkpoint is checked first: a flipped byte, a truncated file or a missing
/// shard is named; NaN planted in the master with the manifest remade is named with its
/// tensor; `checkpoint.verify: false` skips the checksums, not the finiteness check.
#[test]
fn damaged_checkpoints_are_refused_on_resume() {
    let dir = scratch("atomic-resume-damaged");
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let ck_set = format!("checkpoint.dir={}", ck.display());
    assert_ok(
        &train(&dir, "first", &sets(&out, 1, std::slice::from_ref(&ck_set))),
        &[],
    );
    let saved = ck.join("step-00000001");
    manifest::verify(&saved).unwrap();
    let resume = |tag: &str, extra: &[String]| {
        let mut args = sets(&out, 2, std::slice::from_ref(&ck_set));
        args.extend(extra.iter().cloned());
        args.extend(["--resume".to_string(), path_str(&saved).to_string()]);
        let o = train(&dir, tag, &args);
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let opt = saved.join("optimizer.safetensors");
    let good = std::fs::read(&opt).unwrap();
    let mut flipped = good.clone();
    let at = good.len() - 5;
    flipped[at] ^= 0x01;
    std::fs::write(&opt, &flipped).unwrap();
    let (ok, err) = resume("flipped", &[]);
    assert!(
        !ok && err.contains("optimizer.safetensors") && err.contains("checksum"),
        "{err}"
    );
    std::fs::write(&opt, &good[..good.len() - 100]).unwrap();
    let (ok, err) = resume("truncated", &[]);
    assert!(
        !ok && err.contains("optimizer.safetensors") && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&opt, &good).unwrap();
    let shard = saved.join("model-00002-of-00004.safetensors");
    let shard = if shard.exists() {
        shard
    } else {
        mt::checkpoint::weight_files(&saved).unwrap()[1].clone()
    };
    let shard_bytes = std::fs::read(&shard).unwrap();
    std::fs::remove_file(&shard).unwrap();
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    let (ok, err) = resume("missing", &[]);
    // Named by the manifest check, or by the index's check where the plan reads it first.
    let named = err.contains("missing") || err.contains("does not exist");
    assert!(!ok && err.contains(&name) && named, "{err}");
    std::fs::write(&shard, &shard_bytes).unwrap();

    // NaN in the master's last element (the final norm, or the head), manifest remade.
    let mut nan = good.clone();
    let n = nan.len();
    nan[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&opt, &nan).unwrap();
    let mut m = Manifest::read(&saved, "COMPLETE").unwrap().unwrap();
    for f in m
        .files
        .iter_mut()
        .filter(|f| f.name == "optimizer.safetensors")
    {
        let (_, crc) = manifest::file_crc(&opt).unwrap();
        f.crc32c = format!("{crc:08x}");
    }
    std::fs::write(saved.join("COMPLETE"), serde_json::to_vec(&m).unwrap()).unwrap();
    manifest::verify(&saved).unwrap();
    for (tag, extra) in [
        ("nan", vec![]),
        (
            "nan-unverified",
            vec!["checkpoint.verify=false".to_string()],
        ),
    ] {
        let extra: Vec<String> = extra
            .into_iter()
            .flat_map(|s| ["--set".to_string(), s])
            .collect();
        let (ok, err) = resume(tag, &extra);
        assert!(
            !ok && err.contains("master of ")
                && err.contains("optimizer.safetensors")
                && err.contains("NaN"),
            "{err}"
        );
    }
    // Unverified, a flipped low bit of a master weight (finite still) is not noticed.
    std::fs::write(&opt, &flipped).unwrap();
    let (ok, err) = resume(
        "unverified",
        &["--set".into(), "checkpoint.verify=false".into()],
    );
    assert!(ok, "{err}");
}
