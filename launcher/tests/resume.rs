//! Checkpoints and exact resume: 3 steps + resume + 3 steps equals 6 steps straight
//! (float32, 2 workers, 1e-6), and bit for bit from a checkpoint written in the background
//! (with the default staging area and one too small to stage any block); an incomplete or
//! foreign checkpoint is refused by name;
//! keep_last prunes old checkpoints.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn train(case: &str, dir: &Path, tag: &str, extra: &[&str]) -> (std::process::Output, PathBuf) {
    let m = dir.join(format!("{tag}.jsonl"));
    let (out, _) = run_cpu(&golden_dir().join(case).join("run.yaml"), 2, &m, extra);
    (out, m)
}

fn ok(out: &std::process::Output) {
    assert_ok(out, &[]);
}

#[test]
fn resume_continues_exactly() {
    let dir = scratch("resume-exact");
    let ck = dir.join("ck");
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let (out, straight) = train(
        "llama",
        &dir,
        "straight",
        &["--set", "training.num_steps=6"],
    );
    ok(&out);
    let (out, first) = train(
        "llama",
        &dir,
        "first",
        &[
            "--set",
            "training.num_steps=3",
            "--set",
            &ck_set,
            "--set",
            "checkpoint.every_steps=3",
        ],
    );
    ok(&out);
    let (out, second) = train(
        "llama",
        &dir,
        "second",
        &[
            "--set",
            "training.num_steps=6",
            "--set",
            &ck_set,
            "--resume",
            "latest",
        ],
    );
    ok(&out);
    let straight = column(&metrics(&straight), "loss");
    let resumed: Vec<f64> = [first, second]
        .iter()
        .flat_map(|m| column(&metrics(m), "loss"))
        .collect();
    assert_eq!(
        metrics(&dir.join("second.jsonl"))[0]["step"],
        4,
        "the resumed run starts at step 4"
    );
    let e = worst_rel(&resumed, &straight);
    assert!(
        e <= 1e-6,
        "resumed {resumed:?} vs straight {straight:?} (rel {e:.2e})"
    );
}

/// The checkpoint of step 3 is written in the background while steps 4 and 5 change the
/// live state: with the default staging area (each block copied ahead of its write), and
/// with one too small for any block's copy (each block written from the live state, the
/// optimizer waiting for it). Resuming from it reproduces the straight run bit for bit.
#[test]
fn resume_from_a_background_checkpoint_continues_exactly() {
    let dir = scratch("resume-background");
    let (out, straight) = train(
        "llama",
        &dir,
        "straight",
        &["--set", "training.num_steps=6"],
    );
    ok(&out);
    let straight = column(&metrics(&straight), "loss");
    // Unset, the staging area grows into free RAM: this model's whole checkpoint fits.
    for (tag, staging, how, area) in [
        (
            "default",
            None,
            " 0 from the live state",
            "(checkpoint.staging_size unset: the whole checkpoint",
        ),
        (
            "tiny",
            Some("checkpoint.staging_size=4KiB"),
            "0 staged, 0 copied ahead",
            "(checkpoint.staging_size;",
        ),
    ] {
        let ck = dir.join(format!("ck-{tag}"));
        let ck_set = format!("checkpoint.dir={}", ck.display());
        let mut first_flags = vec![
            "--set",
            "training.num_steps=5",
            "--set",
            &ck_set,
            "--set",
            "checkpoint.every_steps=3",
        ];
        first_flags.extend(staging.iter().flat_map(|s| ["--set", s]));
        let (out, first) = train("llama", &dir, &format!("first-{tag}"), &first_flags);
        ok(&out);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("  checkpoint staging") && l.contains(area)),
            "{tag}: want a staging line with `{area}`:\n{stdout}"
        );
        assert!(
            stdout.contains("checkpoint of step 3: writing in the background"),
            "{tag}: step 3 was checkpointed in the background:\n{stdout}"
        );
        let line = stdout
            .lines()
            .find(|l| l.contains("step-00000003 written"))
            .unwrap_or_else(|| panic!("{tag}: no line for the write of step 3:\n{stdout}"));
        assert!(line.contains(how), "{tag}: {line}");
        let waits = column(&metrics(&first), "checkpoint_wait_s");
        assert!(waits.iter().all(|w| *w >= 0.0), "{waits:?}");
        let step3 = ck.join("step-00000003");
        let (out, second) = train(
            "llama",
            &dir,
            &format!("second-{tag}"),
            &[
                "--set",
                "training.num_steps=6",
                "--resume",
                path_str(&step3),
            ],
        );
        ok(&out);
        let mut resumed = column(&metrics(&first), "loss");
        resumed.truncate(3);
        resumed.extend(column(&metrics(&second), "loss"));
        assert!(
            resumed == straight,
            "{tag}: resumed {resumed:?} vs straight {straight:?}"
        );
    }
}

#[test]
fn incomplete_and_foreign_checkpoints_are_refused() {
    let dir = scratch("resume-refused");
    let ck = dir.join("ck");
    let (out, _) = train(
        "llama_tied_bias",
        &dir,
        "tied",
        &[
            "--set",
            "training.num_steps=1",
            "--set",
            &format!("checkpoint.dir={}", ck.display()),
            "--set",
            "checkpoint.every_steps=1",
        ],
    );
    ok(&out);
    let saved = ck.join("step-00000001");
    assert!(saved.join("COMPLETE").is_file());

    // Another model's checkpoint.
    let (out, _) = train(
        "llama",
        &dir,
        "foreign",
        &["--resume", saved.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("saved for another model"),
        "{err}"
    );

    // The same checkpoint without its marker (as if the writer died).
    let partial = dir.join("partial");
    std::fs::create_dir_all(&partial).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        std::fs::copy(saved.join(f), partial.join(f)).unwrap();
    }
    let (out, _) = train(
        "llama_tied_bias",
        &dir,
        "partial",
        &["--resume", partial.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no COMPLETE marker"),
        "{err}"
    );
}

#[test]
fn keep_last_prunes_old_checkpoints() {
    let dir = scratch("resume-prune");
    let ck = dir.join("ck");
    let (out, _) = train(
        "llama",
        &dir,
        "prune",
        &[
            "--set",
            "training.num_steps=4",
            "--set",
            &format!("checkpoint.dir={}", ck.display()),
            "--set",
            "checkpoint.every_steps=1",
            "--set",
            "checkpoint.keep_last=2",
        ],
    );
    ok(&out);
    let mut left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    left.sort();
    assert_eq!(left, ["step-00000003", "step-00000004"]);
}

/// `checkpoint.full_state_every_steps` makes the other periodic checkpoints model-only:
/// HF model directories without `optimizer.safetensors`. `--resume latest` skips them for
/// the newest one that holds the optimizer state and still reproduces the straight run;
/// resuming a model-only one by name is refused, naming it; a model-only checkpoint loads
/// as pretrained weights.
#[test]
fn model_only_checkpoints_between_full_states() {
    let dir = scratch("resume-model-only");
    let ck = dir.join("ck");
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let (out, straight) = train(
        "llama",
        &dir,
        "straight",
        &["--set", "training.num_steps=5"],
    );
    ok(&out);
    let (out, _) = train(
        "llama",
        &dir,
        "first",
        &[
            "--set",
            "training.num_steps=5",
            "--set",
            &ck_set,
            "--set",
            "checkpoint.every_steps=1",
            "--set",
            "checkpoint.full_state_every_steps=2",
            "--set",
            "checkpoint.keep_last=10",
        ],
    );
    ok(&out);
    let step = |s: u64| ck.join(format!("step-{s:08}"));
    let full: Vec<bool> = (1..=5)
        .map(|s| {
            assert!(step(s).join("COMPLETE").is_file(), "step {s} checkpointed");
            step(s).join("optimizer.safetensors").is_file()
        })
        .collect();
    // Full state every 2 steps and at the end of the run.
    assert_eq!(full, [false, true, false, true, true]);
    assert!(step(1).join("model.safetensors").is_file());
    // With steps 4 and 5 gone, the newest checkpoint (3) is model-only: latest is 2.
    for s in [4, 5] {
        std::fs::remove_dir_all(step(s)).unwrap();
    }
    let (out, second) = train(
        "llama",
        &dir,
        "second",
        &[
            "--set",
            "training.num_steps=5",
            "--set",
            &ck_set,
            "--resume",
            "latest",
        ],
    );
    ok(&out);
    let rows = metrics(&second);
    assert_eq!(
        rows[0]["step"], 3,
        "resumed after step 2, the newest full state"
    );
    let straight = column(&metrics(&straight), "loss");
    let resumed = column(&rows, "loss");
    let e = worst_rel(&resumed, &straight[2..]);
    assert!(
        e <= 1e-6,
        "resumed {resumed:?} vs straight {straight:?} (rel {e:.2e})"
    );
    // The resumed run pruned to keep_last (2): step 3 (model-only) and step 5 remain.
    let left: Vec<u64> = mt::checkpoint::state::complete(&ck)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(left, [3, 5]);
    // A model-only checkpoint named explicitly is refused, saying why.
    let step3 = path_str(&step(3)).to_string();
    let (out, _) = train(
        "llama",
        &dir,
        "refused",
        &["--set", "training.num_steps=5", "--resume", &step3],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("model-only checkpoint")
            && err.contains("step-00000003"),
        "{err}"
    );
    // It loads as pretrained weights.
    let (out, _) = train(
        "llama",
        &dir,
        "from-model-only",
        &[
            "--set",
            "training.num_steps=1",
            "--set",
            &format!("model.path={step3}"),
        ],
    );
    ok(&out);
}

/// `checkpoint.save_optimizer: false`: every checkpoint, the last included, is model-only,
/// and `--resume latest` says there is nothing to resume from.
#[test]
fn save_optimizer_false_writes_model_only_checkpoints() {
    let dir = scratch("resume-no-optimizer");
    let ck = dir.join("ck");
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let flags = [
        "--set",
        "training.num_steps=2",
        "--set",
        &ck_set,
        "--set",
        "checkpoint.every_steps=1",
        "--set",
        "checkpoint.save_optimizer=false",
    ];
    let (out, _) = train("llama", &dir, "first", &flags);
    ok(&out);
    let all = mt::checkpoint::state::complete(&ck).unwrap();
    assert_eq!(all.len(), 2);
    assert!(
        all.iter()
            .all(|(_, p)| !p.join("optimizer.safetensors").exists())
    );
    let (out, _) = train(
        "llama",
        &dir,
        "second",
        &[
            "--set",
            "training.num_steps=3",
            "--set",
            &ck_set,
            "--resume",
            "latest",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("model-only"), "{err}");
}
