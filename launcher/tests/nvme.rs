//! `memory.optimizer_offload: nvme` end to end on the tiny demo (configs/tiny.yaml, short
//! rows): the master and moments in files on a "drive" (a directory of the scratch area)
//! give the RAM run's bits: every loss and gradient norm, the checkpoints (one written in
//! the background, the last at once) and the exported model; a run resumed from the
//! background checkpoint continues exactly; nothing is left on the drive. In the fp32
//! master and moments mode and in the 10 B/param one (split master, bf16 moments).
//!
//! With `--keep-nvme-state` the files stay, with their manifest, and a later run resumes
//! from them without a checkpoint, bit for bit; a kept state that is not the run's (another
//! mode or model, a torn file, files rewritten after the manifest, files without one) is
//! refused, naming the file and what differs.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml")
}

/// A run's metrics lines, the tensors of its checkpoints' optimizer files (steps 2 and 4)
/// and its exported model's bytes.
struct Run {
    rows: Vec<serde_json::Value>,
    checkpoints: Vec<Vec<(String, Vec<u32>)>>,
    model: Vec<u8>,
    stdout: String,
}

/// `steps` steps of the tiny demo in `mode`, checkpointed every 2, the model exported;
/// `extra` flags after the others.
fn train(dir: &Path, tag: &str, steps: u64, mode: &[&str], extra: &[&str]) -> Run {
    let (o, all) = launch(dir, tag, steps, mode, extra, &[]);
    assert_ok(&o, &all.iter().map(String::as_str).collect::<Vec<_>>());
    let (m, ck, out) = outputs(dir, tag);
    let checkpoints = [2, 4]
        .iter()
        .filter(|&&s| s <= steps && ck.join(format!("step-{s:08}")).exists())
        .map(|s| {
            let t = tensors(&ck.join(format!("step-{s:08}/optimizer.safetensors")));
            let mut t: Vec<(String, Vec<u32>)> = t
                .into_iter()
                .map(|(k, v)| (k, v.iter().map(|x| x.to_bits()).collect()))
                .collect();
            t.sort();
            t
        })
        .collect();
    Run {
        rows: metrics(&m),
        checkpoints,
        model: std::fs::read(out.join("model.safetensors")).unwrap_or_default(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned()
            + &String::from_utf8_lossy(&o.stderr),
    }
}

/// A run's metrics file, checkpoint directory and output directory.
fn outputs(dir: &Path, tag: &str) -> (PathBuf, PathBuf, PathBuf) {
    (
        dir.join(format!("{tag}.jsonl")),
        dir.join(format!("ck-{tag}")),
        dir.join(format!("out-{tag}")),
    )
}

/// [`train`]'s launch with `env` set, whatever its outcome: its output and arguments.
fn launch(
    dir: &Path,
    tag: &str,
    steps: u64,
    mode: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Output, Vec<String>) {
    let (m, ck, out) = outputs(dir, tag);
    let mut args: Vec<String> = [
        "dataset.max_seq_len=32",
        "training.batch_size=4",
        "training.eval_steps=1000",
        "checkpoint.every_steps=2",
        &format!("training.num_steps={steps}"),
        &format!("checkpoint.dir={}", ck.display()),
        &format!("training.output_dir={}", out.display()),
    ]
    .iter()
    .chain(mode)
    .flat_map(|kv| ["--set".to_string(), kv.to_string()])
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cpu_env(&tiny(), 2, &m, &args, env)
}

/// The bytes `mt-launch plan --json` says one update of `mode` moves each way, measured on
/// `drive`.
fn planned_update_bytes(dir: &Path, drive: &Path, mode: &[&str]) -> u64 {
    let on = [
        "memory.optimizer_offload=nvme".to_string(),
        format!("memory.nvme_path={}", drive.display()),
        format!("training.output_dir={}", dir.join("out-plan").display()),
        "dataset.max_seq_len=32".into(),
        "training.batch_size=4".into(),
    ];
    let config = tiny();
    let mut args = vec!["plan", "--config", path_str(&config), "--gpus", "0"];
    args.extend(["--workers", "2", "--json", "--drive-speed", "1"]);
    for kv in mode.iter().copied().chain(on.iter().map(String::as_str)) {
        args.extend(["--set", kv]);
    }
    let out = mt_launch().args(&args).output().unwrap();
    assert_ok(&out, &args);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["drives"]["update_write_bytes"]
        .as_u64()
        .expect("update bytes")
}

fn bits(rows: &[serde_json::Value], key: &str) -> Vec<u64> {
    column(rows, key).iter().map(|x| x.to_bits()).collect()
}

/// The RAM run and the drive run of `mode`, and a drive run resumed from step 2.
fn equal_on_the_drive(name: &str, mode: &[&str]) {
    let dir = scratch(name);
    let drive = dir.join("nvme0");
    std::fs::create_dir(&drive).unwrap();
    let ram = train(&dir, "ram", 4, mode, &[]);
    let on = [
        "--set",
        "memory.optimizer_offload=nvme",
        "--set",
        &format!("memory.nvme_path={}", drive.display()),
    ];
    let nvme = train(&dir, "nvme", 4, mode, &on);
    assert!(
        nvme.stdout.contains("optimizer state on 1 drive(s)"),
        "{}",
        nvme.stdout
    );
    for key in ["loss", "grad_norm"] {
        assert_eq!(bits(&ram.rows, key), bits(&nvme.rows, key), "{key}");
    }
    assert_eq!(ram.checkpoints.len(), 2);
    assert!(
        ram.checkpoints == nvme.checkpoints,
        "the checkpoints differ"
    );
    assert!(
        !ram.model.is_empty() && ram.model == nvme.model,
        "the exports differ"
    );
    // Every update writes back what `mt-launch plan` counts; it reads as much, and a
    // checkpoint of the step reads the state once more.
    let update = planned_update_bytes(&dir, &drive, mode);
    for row in &nvme.rows {
        let read = row["drive_read_bytes"].as_u64().expect("drive_read_bytes");
        let written = row["drive_write_bytes"]
            .as_u64()
            .expect("drive_write_bytes");
        assert!(read >= update && row["drive_wait_s"].is_number(), "{row}");
        assert_eq!(written, update, "{row}");
    }
    // The end's summary: the rates achieved and the share of the steps waiting for them.
    let summary = nvme.stdout.lines().find(|l| l.starts_with("  drives = "));
    let summary = summary.unwrap_or_else(|| panic!("no drives summary: {}", nvme.stdout));
    assert!(
        summary.contains("GB/s read") && summary.contains("% of the steps' time"),
        "{summary}"
    );
    assert!(ram.rows[0].get("drive_read_bytes").is_none());
    let left = std::fs::read_dir(&drive).unwrap().count();
    assert_eq!(left, 0, "files left on the drive");

    let from = dir.join("ck-nvme/step-00000002");
    let resume = [&on[..], &["--resume", path_str(&from)]].concat();
    let resumed = train(&dir, "resumed", 4, mode, &resume);
    assert_eq!(bits(&resumed.rows, "loss"), bits(&ram.rows, "loss")[2..]);
    assert!(
        resumed.checkpoints.last() == ram.checkpoints.last(),
        "the resumed run's last checkpoint differs"
    );
    assert!(
        resumed.model == ram.model,
        "the resumed run's export differs"
    );
}

#[test]
fn fp32_state_on_the_drive_gives_the_ram_bits() {
    equal_on_the_drive("nvme-fp32", &[]);
}

#[test]
fn split_master_bf16_moments_on_the_drive_give_the_ram_bits() {
    equal_on_the_drive(
        "nvme-split",
        &[
            "model.dtype=bfloat16",
            "memory.master_weights=split",
            "memory.moments_dtype=bfloat16",
        ],
    );
}

/// A drive that fails a write mid-run (`MT_TEST_DRIVE_EIO`: step 3's update) stops the run
/// with an error naming the drive's directory, and leaves the last complete checkpoint
/// (step 2) intact: a run resumed from it gives the uninterrupted run's losses bit for bit
/// and its final checkpoint. Nothing is left on the drive.
#[test]
fn a_drive_failing_mid_run_stops_it_naming_the_drive_and_keeps_the_last_checkpoint() {
    let dir = scratch("nvme-eio");
    let drive = dir.join("nvme0");
    std::fs::create_dir(&drive).unwrap();
    let on = [
        "--set",
        "memory.optimizer_offload=nvme",
        "--set",
        &format!("memory.nvme_path={}", drive.display()),
    ];
    let whole = train(&dir, "whole", 4, &[], &on);

    let (o, _) = launch(&dir, "failed", 4, &[], &on, &[("MT_TEST_DRIVE_EIO", "3")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run went on: {err}");
    assert!(
        err.contains(&drive.display().to_string())
            && err.contains("write of the optimizer state (memory.nvme_path) failed"),
        "{err}"
    );
    let (m, ck, _) = outputs(&dir, "failed");
    let rows = metrics(&m);
    assert_eq!(rows.len(), 2, "steps logged before the failing update");
    assert_eq!(bits(&rows, "loss"), bits(&whole.rows, "loss")[..2]);
    let mut kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-00000002"], "checkpoints after the failure");
    assert_eq!(
        std::fs::read_dir(&drive).unwrap().count(),
        0,
        "files left on the drive"
    );

    let from = ck.join("step-00000002");
    let resume = [&on[..], &["--resume", path_str(&from)]].concat();
    let resumed = train(&dir, "resumed", 4, &[], &resume);
    assert_eq!(bits(&resumed.rows, "loss"), bits(&whole.rows, "loss")[2..]);
    assert!(
        resumed.checkpoints.last() == whole.checkpoints.last(),
        "the resumed run's last checkpoint differs"
    );
}

/// The kept state's runs take a constant rate: a run of 2 steps then one of 4 follow the
/// schedule of one run of 4 (a decaying one would decay over each run's `num_steps`).
const CONSTANT: &str = "training.lr_scheduler=constant";

/// The flags of a run keeping its state on `drive`.
fn kept_on(drive: &Path) -> Vec<String> {
    vec![
        "--set".into(),
        "memory.optimizer_offload=nvme".into(),
        "--set".into(),
        format!("memory.nvme_path={}", drive.display()),
        "--keep-nvme-state".into(),
    ]
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

/// A run of 2 steps keeping its state, then a run of 4 with the flag again, give the
/// uninterrupted run's losses, norms, last checkpoint and export bit for bit; the files are
/// owner-only, the manifest follows the run.
fn kept_state_resumes(name: &str, mode: &[&str], store: bool) {
    let dir = scratch(name);
    let drive = dir.join("nvme0");
    std::fs::create_dir(&drive).unwrap();
    let mode: Vec<&str> = mode.iter().copied().chain([CONSTANT]).collect();
    let whole = train(&dir, "whole", 4, &mode, &[]);
    let on = kept_on(&drive);
    let on: Vec<&str> = on.iter().map(String::as_str).collect();
    let first = train(&dir, "first", 2, &mode, &on);
    assert!(
        first
            .stdout
            .contains("optimizer state kept on the drives at step 2"),
        "{}",
        first.stdout
    );
    let mut want = vec![
        "megatrain-m.state",
        "megatrain-master.state",
        "megatrain-nvme-state.json",
        "megatrain-v.state",
    ];
    if store {
        want.push("megatrain-store.state");
    }
    want.sort();
    assert_eq!(names(&drive), want, "the kept state's files");
    for n in names(&drive) {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(drive.join(&n))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{n}");
    }
    let second = train(&dir, "second", 4, &mode, &on);
    assert!(
        second
            .stdout
            .contains("resumed from the optimizer state kept on the drives"),
        "{}",
        second.stdout
    );
    for key in ["loss", "grad_norm"] {
        assert_eq!(bits(&first.rows, key), bits(&whole.rows, key)[..2], "{key}");
        assert_eq!(
            bits(&second.rows, key),
            bits(&whole.rows, key)[2..],
            "{key}"
        );
    }
    assert!(
        second.checkpoints.last() == whole.checkpoints.last(),
        "the resumed run's last checkpoint differs"
    );
    assert!(
        !whole.model.is_empty() && second.model == whole.model,
        "the resumed run's export differs"
    );
    let manifest = std::fs::read_to_string(drive.join("megatrain-nvme-state.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    assert_eq!(manifest["state"]["step"], 4, "{manifest}");
}

#[test]
fn a_kept_fp32_state_resumes_bit_for_bit() {
    kept_state_resumes("nvme-keep-fp32", &[], false);
}

#[test]
fn a_kept_split_master_bf16_moment_state_resumes_bit_for_bit() {
    kept_state_resumes(
        "nvme-keep-split",
        &[
            "model.dtype=bfloat16",
            "memory.master_weights=split",
            "memory.moments_dtype=bfloat16",
        ],
        true,
    );
}

/// A kept state that is not the run's is refused before training, the error naming the
/// file and what differs, and the state left as it was: another master mode, another
/// model (the manifest's layout), a torn file, files rewritten after the manifest (the
/// manifest of step 2 over the files of step 4: a run killed mid-update), files without a
/// manifest, a file replaced by a symbolic link.
#[test]
fn a_kept_state_that_is_not_the_runs_is_refused() {
    let dir = scratch("nvme-keep-refused");
    let drive = dir.join("nvme0");
    let saved = dir.join("saved");
    std::fs::create_dir(&drive).unwrap();
    std::fs::create_dir(&saved).unwrap();
    let on = kept_on(&drive);
    let on: Vec<&str> = on.iter().map(String::as_str).collect();
    train(&dir, "first", 2, &[CONSTANT], &on);
    let manifest = drive.join("megatrain-nvme-state.json");
    let at_2 = std::fs::read(&manifest).unwrap();
    let save = || {
        for n in names(&drive) {
            std::fs::copy(drive.join(&n), saved.join(&n)).unwrap();
        }
    };
    let put_back = || {
        for n in names(&drive) {
            std::fs::remove_file(drive.join(&n)).unwrap();
        }
        for n in names(&saved) {
            std::fs::copy(saved.join(&n), drive.join(&n)).unwrap();
        }
    };
    save();
    // A refused launch: its error names `what` and each of `words`; the files unchanged.
    let refused = |tag: &str, mode: &[&str], what: &Path, words: &[&str]| {
        let (o, _) = launch(&dir, tag, 4, mode, &on, &[]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "{tag}: the run went on: {err}");
        assert!(err.contains(&what.display().to_string()), "{tag}: {err}");
        for w in words {
            assert!(err.contains(w), "{tag}: no `{w}` in: {err}");
        }
        let m = dir.join(format!("{tag}.jsonl"));
        assert!(!m.exists() || metrics(&m).is_empty(), "{tag}: trained");
    };
    let split = [
        CONSTANT,
        "model.dtype=bfloat16",
        "memory.master_weights=split",
    ];
    refused(
        "split",
        &split,
        &manifest,
        &["memory.master_weights", "model.dtype"],
    );
    assert_eq!(
        std::fs::read(&manifest).unwrap(),
        at_2,
        "the manifest changed"
    );

    let text = String::from_utf8(at_2.clone()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let layout = v["state"]["layout"].as_str().unwrap().to_string();
    std::fs::write(&manifest, text.replace(&layout, "0123456789abcdef")).unwrap();
    refused("model", &[CONSTANT], &manifest, &["the model's layout"]);
    put_back();

    let v_file = drive.join("megatrain-v.state");
    let len = std::fs::metadata(&v_file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&v_file)
        .unwrap()
        .set_len(len - 8192)
        .unwrap();
    refused("torn", &[CONSTANT], &v_file, &["torn or truncated"]);
    put_back();

    train(&dir, "on", 4, &[CONSTANT], &on);
    std::fs::write(&manifest, &at_2).unwrap();
    refused(
        "rewritten",
        &[CONSTANT],
        &manifest,
        &["CRC32C", "the manifest of step 2"],
    );
    put_back();

    std::fs::remove_file(&manifest).unwrap();
    refused(
        "no-manifest",
        &[CONSTANT],
        &drive,
        &["without its manifest"],
    );
    let mut left = names(&saved);
    left.retain(|n| !n.ends_with(".json"));
    assert_eq!(names(&drive), left, "files made or removed");
    put_back();

    let m_file = drive.join("megatrain-m.state");
    std::fs::rename(&m_file, dir.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(dir.join("elsewhere"), &m_file).unwrap();
    refused("link", &[CONSTANT], &m_file, &["kept file"]);
    std::fs::remove_file(&m_file).unwrap();
    put_back();

    // The state put back resumes.
    let resumed = train(&dir, "resumed", 4, &[CONSTANT], &on);
    assert_eq!(resumed.rows.len(), 2, "steps 3 and 4");
}

/// A run keeping its state that a stop signal ends keeps it at the step it stopped at
/// (cosine schedule, the config unchanged); the same command again continues from there
/// with the uninterrupted run's losses and norms, bit for bit.
#[test]
fn a_stopped_run_keeps_its_state_and_the_same_command_continues_it() {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = scratch("nvme-keep-stop");
    let drive = dir.join("nvme0");
    std::fs::create_dir(&drive).unwrap();
    // Enough steps that the signal lands mid-run: it goes once step 2 is reported.
    let steps = 60;
    let command = |tag: &str, keep: bool| {
        let mut args: Vec<String> = [
            "dataset.max_seq_len=32",
            "training.batch_size=4",
            "training.eval_steps=1000",
            &format!("training.num_steps={steps}"),
            &format!(
                "training.output_dir={}",
                dir.join(format!("out-{tag}")).display()
            ),
        ]
        .iter()
        .flat_map(|kv| ["--set".to_string(), kv.to_string()])
        .collect();
        args.extend(
            [
                "--config",
                path_str(&tiny()),
                "--gpus",
                "0",
                "--workers",
                "2",
            ]
            .map(String::from),
        );
        let m = dir.join(format!("{tag}.jsonl"));
        args.extend(["--metrics-out".to_string(), path_str(&m).to_string()]);
        match keep {
            true => args.extend(kept_on(&drive)),
            false => args.extend(kept_on(&drive)[..4].iter().cloned()),
        }
        let mut cmd = mt_launch();
        cmd.args(&args);
        (cmd, m)
    };
    let (mut cmd, m) = command("whole", false);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let whole = metrics(&m);
    assert_eq!(whole.len(), steps);

    let (mut cmd, first) = command("first", true);
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::fs::read_to_string(&first).map_or(0, |s| s.lines().count()) < 2 {
        assert!(t.elapsed() < Duration::from_secs(120), "no step 2");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{said}");
    let done = metrics(&first).len();
    assert!(done >= 2 && done < steps, "stopped after {done} steps");
    let kept = format!("optimizer state kept on the drives at step {done}");
    assert!(said.contains(&kept), "want `{kept}` in:\n{said}");

    let (mut cmd, second) = command("second", true);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for key in ["loss", "grad_norm"] {
        assert_eq!(
            bits(&metrics(&first), key),
            bits(&whole, key)[..done],
            "{key}"
        );
        assert_eq!(
            bits(&metrics(&second), key),
            bits(&whole, key)[done..],
            "{key}"
        );
    }
}
