//! Checkpoints of a sharded state across nodes (`mpirun -np N mt-launch …`, CPU workers):
//! node 0 gathers each block of the master and moments in windows of at most 2^24 elements
//! and writes each window at its offsets before gathering the next, so that it never holds a
//! whole block (src/host/shard.rs). The files must be the bytes one node writes.
//!
//! Needs mpirun, as `nodes.rs` does (skipped with a message where it is absent, outside CI).

mod common;

use std::path::{Path, PathBuf};

use common::mpi::*;
use common::*;

/// A gather window smaller than the fixture's blocks and dividing none of them: windows
/// straddle the three nodes' pieces (0..384, 384..768, 768..1000 of a 1000-element block)
/// and the tensors within a block, and some windows hold no part of a rank.
const SMALL: &str = "1000";

/// Runs the llama fixture on three nodes to `steps` (a checkpoint every 2 steps, the model
/// exported at the end), from `resume` if given, with `env` for the launchers; returns its
/// scratch directory (`ck/`, `model/`).
fn run_to(
    mpi: &Path,
    tag: &str,
    steps: u64,
    resume: Option<&Path>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> PathBuf {
    run_on(mpi, 3, tag, steps, resume, extra, env).0
}

/// [`run_to`] on `ranks` nodes of one worker each (one rank: one node of two workers, no
/// mpirun); also returns the run's stdout.
fn run_on(
    mpi: &Path,
    ranks: usize,
    tag: &str,
    steps: u64,
    resume: Option<&Path>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (PathBuf, String) {
    let dir = scratch(&format!("nodes-ck-{tag}"));
    let config = golden_dir().join("llama/run.yaml");
    let (ck_set, out_set, steps_set) = (
        format!("checkpoint.dir={}", dir.join("ck").display()),
        format!("training.output_dir={}", dir.join("model").display()),
        format!("training.num_steps={steps}"),
    );
    let mut args = vec![
        "--config",
        path_str(&config),
        "--set",
        &ck_set,
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        &out_set,
        "--set",
        &steps_set,
        "--set",
        "training.batch_size=6",
    ];
    if let Some(from) = resume {
        args.extend(["--resume", path_str(from)]);
    }
    args.extend(extra);
    let workers = if ranks == 1 { 2 } else { 1 };
    let out = launch(mpi, ranks, workers, &args, env);
    assert_mpi_ok(&out, tag);
    (dir, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every file of directory `b` has the bytes of the same file in `a`, and both hold the
/// same files.
fn assert_same_files(a: &Path, b: &Path) {
    let names = |d: &Path| {
        let mut n: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    let (na, nb) = (names(a), names(b));
    assert_eq!(
        na,
        nb,
        "{} and {} hold other files",
        a.display(),
        b.display()
    );
    for f in &na {
        let (x, y) = (comparable(&a.join(f)), comparable(&b.join(f)));
        assert!(
            x == y,
            "{} differs from {}",
            b.join(f).display(),
            a.display()
        );
    }
}

/// The complete checkpoints under `root`, by step.
fn checkpoints(root: &Path) -> Vec<(u64, PathBuf)> {
    mt::checkpoint::state::complete(root).unwrap()
}

/// With `MT_GATHER_WINDOW=1000` three nodes write the checkpoints of steps 2 and 4 and the
/// export with every file's bytes equal to the default window's (one window per block
/// here), with an fp32 master and moments and with a split master (whose high halves are
/// read from the store at the window's global offsets) and bf16 moments; the windowed
/// checkpoint of step 2, resumed on three nodes gathering in windows again, ends with the
/// bytes of the run that went straight through (model and step-4 checkpoint).
#[test]
fn checkpoints_gathered_in_small_windows_are_the_same_bytes_and_resume_exactly() {
    let Some((mpi, _one)) = mpirun() else {
        return;
    };
    let split = [
        "--set",
        "model.dtype=bfloat16",
        "--set",
        "memory.grad_dtype=bfloat16",
        "--set",
        "memory.master_weights=split",
        "--set",
        "memory.moments_dtype=bfloat16",
    ];
    let small = [("MT_GATHER_WINDOW", SMALL)];
    for (tag, extra) in [("f32", &[][..]), ("split", &split[..])] {
        let default = run_to(&mpi, &format!("{tag}-default"), 4, None, extra, &[]);
        let windowed = run_to(&mpi, &format!("{tag}-small"), 4, None, extra, &small);
        let model = tensors(&default.join("model/model.safetensors"));
        assert!(
            model.values().any(|t| t.len() > 3 * 1000),
            "{tag}: the fixture has a block of several windows"
        );
        let (a, b) = (
            checkpoints(&default.join("ck")),
            checkpoints(&windowed.join("ck")),
        );
        let steps: Vec<u64> = a.iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, [2, 4], "{tag}");
        assert_eq!(
            steps,
            b.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            "{tag}"
        );
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            assert_same_files(x, y);
        }
        assert_same_files(&default.join("model"), &windowed.join("model"));
        if tag == "f32" {
            let step2 = &b[0].1;
            let resumed = run_to(&mpi, "f32-resumed", 4, Some(step2), extra, &small);
            assert_same_files(&default.join("model"), &resumed.join("model"));
            let r = checkpoints(&resumed.join("ck"));
            let last = r.last().expect("the resumed run checkpoints step 4");
            assert_eq!(last.0, 4);
            assert_same_files(&a[1].1, &last.1);
        }
    }
}

/// A periodic checkpoint of a sharded state is gathered into node 0's staging area at the
/// step boundary and written by its writer thread while training goes on; node 0's plan
/// holds the staging area and the gather buffers, node 1's neither. Its files have the bytes of the same checkpoint
/// written before training goes on (`checkpoint.background: false`), with the default
/// staging area and with one of 4 pages of 1024 elements and windows of 1000
/// (`MT_GATHER_WINDOW`), where every window waits for the writer to free the last one's;
/// the last checkpoint and the export are the same bytes too. The background checkpoint of
/// step 2 resumed on two nodes and on one node of two workers ends with the bytes of the
/// run that went straight through.
#[test]
fn background_checkpoints_of_a_sharded_state_are_the_synchronous_bytes_and_resume_exactly() {
    let Some((mpi, _one)) = mpirun() else {
        return;
    };
    let (sync, _) = run_on(
        &mpi,
        2,
        "sync",
        4,
        None,
        &["--set", "checkpoint.background=false"],
        &[],
    );
    let tiny = ["--set", "checkpoint.staging_size=16KiB"];
    let small = [("MT_GATHER_WINDOW", SMALL)];
    let runs = [("bg", &[][..], &[][..]), ("bg-tiny", &tiny[..], &small[..])];
    let mut straight = None;
    for (tag, extra, env) in runs {
        let (dir, out) = run_on(&mpi, 2, tag, 4, None, extra, env);
        assert!(
            out.contains("checkpoint of step 2: gathered in")
                && out.contains("writing in the background"),
            "{tag}: step 2 is written in the background:\n{out}"
        );
        assert_eq!(
            out.matches("host memory for").count(),
            2,
            "{tag}: a plan per node:\n{out}"
        );
        for part in ["checkpoint staging", "checkpoint gather"] {
            assert_eq!(
                out.matches(part).count(),
                1,
                "{tag}: node 0 alone plans `{part}`:\n{out}"
            );
        }
        let (a, b) = (checkpoints(&sync.join("ck")), checkpoints(&dir.join("ck")));
        assert_eq!(a.len(), 2, "{tag}");
        assert_eq!(
            b.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [2, 4],
            "{tag}"
        );
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            assert_same_files(x, y);
        }
        assert_same_files(&sync.join("model"), &dir.join("model"));
        straight.get_or_insert((dir, b[0].1.clone()));
    }
    let (dir, step2) = straight.unwrap();
    for ranks in [2, 1] {
        let tag = format!("bg-resumed-on-{ranks}");
        let (resumed, _) = run_on(&mpi, ranks, &tag, 4, Some(&step2), &[], &[]);
        assert_same_files(&dir.join("model"), &resumed.join("model"));
    }
}

/// A gather window outside 1..=2^24 is refused, naming the variable and the range, before
/// a node holds a buffer of it.
#[test]
fn a_bad_gather_window_is_named() {
    let Some((mpi, _one)) = mpirun() else {
        return;
    };
    let dir = scratch("nodes-ck-bad-window");
    let config = golden_dir().join("llama/run.yaml");
    let ck_set = format!("checkpoint.dir={}", dir.join("ck").display());
    let args = [
        "--config",
        path_str(&config),
        "--set",
        &ck_set,
        "--set",
        "training.num_steps=1",
        "--set",
        "checkpoint.every_steps=1",
    ];
    let out = mpi_command(&mpi, 2, 1, &args)
        .env("MT_GATHER_WINDOW", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("MT_GATHER_WINDOW=0") && err.contains("from 1 to 16777216"),
        "{err}"
    );
}

/// A two-node run checkpointed after step 2 and resumed to step 4 ends with the same bits
/// as the run that went straight through; so does the same checkpoint resumed on one node
/// of two workers, or on two nodes with the state replicated (the checkpoint holds the
/// whole state, gathered and written by node 0, so any number of nodes, sharded or not,
/// resumes it, each node reading its pieces; two one-worker nodes and one two-worker node
/// add the same two slabs in the same order).
#[test]
fn two_node_checkpoint_resumes_exactly() {
    let Some((mpi, _one)) = mpirun() else {
        return;
    };
    let run_to = |tag: &str, ranks: usize, steps: u64, resume: Option<&Path>, extra: &[&str]| {
        let (dir, _) = run_on(
            &mpi,
            ranks,
            &format!("resume-{tag}"),
            steps,
            resume,
            extra,
            &[],
        );
        (
            tensors(&dir.join("model/model.safetensors")),
            dir.join("ck"),
        )
    };
    let (straight, _) = run_to("straight", 2, 4, None, &[]);
    let (_, ck) = run_to("first", 2, 2, None, &[]);
    let (newest, step2) = mt::checkpoint::state::complete(&ck).unwrap().pop().unwrap();
    assert_eq!(newest, 2);
    let (resumed, _) = run_to("resumed", 2, 4, Some(&step2), &[]);
    let (on_one, _) = run_to("resumed-on-one", 1, 4, Some(&step2), &[]);
    let replicated = ["--set", "nodes.shard_state=false"];
    let (whole, _) = run_to("resumed-replicated", 2, 4, Some(&step2), &replicated);
    for (other, how) in [
        (&resumed, "on two nodes"),
        (&on_one, "on one node"),
        (&whole, "on two nodes, replicated"),
    ] {
        assert_same_bits(&straight, other, &format!("resumed {how}: "));
    }
}
