//! No run leaves shared memory or processes behind: after a normal exit, after `kill -9` of
//! a worker (the launcher stops the others and exits non-zero naming the rank and signal
//! within 10 s), after a worker hangs (stopped with SIGSTOP: the launcher names it as
//! timed out after `training.worker_timeout_s`), and after `kill -9` of the launcher
//! (every worker exits within 5 s). See `common/leftovers.rs` for what "behind" means.

mod common;

use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;

/// Starts mt-launch on the llama fixture with 2 workers (and `steps` steps), its stderr
/// in `<scratch>/stderr.log` and metrics in `<scratch>/metrics.jsonl`.
fn spawn_run(name: &str, steps: u64, extra: &[&str]) -> (Child, std::path::PathBuf) {
    spawn_run_env(name, steps, extra, &[])
}

/// [`spawn_run`] with extra environment variables.
fn spawn_run_env(
    name: &str,
    steps: u64,
    extra: &[&str],
    env: &[(&str, &std::path::Path)],
) -> (Child, std::path::PathBuf) {
    let case = golden_dir().join("llama");
    let dir = scratch(name);
    let config = case.join("run.yaml");
    let metrics = dir.join("metrics.jsonl");
    let child = mt_launch()
        .args([
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "0",
            "--workers",
            "2",
        ])
        .args(["--set", &format!("training.num_steps={steps}")])
        .args(["--metrics-out", metrics.to_str().unwrap()])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    (child, dir)
}

/// Starts a long run with 2 workers and waits until it has finished a step.
fn start_long_run(name: &str, extra: &[&str]) -> (Child, std::path::PathBuf, Vec<u32>) {
    start_long_run_env(name, extra, &[])
}

fn start_long_run_env(
    name: &str,
    extra: &[&str],
    env: &[(&str, &std::path::Path)],
) -> (Child, std::path::PathBuf, Vec<u32>) {
    let (child, dir) = spawn_run_env(name, 1_000_000, extra, env);
    let metrics = dir.join("metrics.jsonl");
    wait_for(Duration::from_secs(60), || {
        std::fs::read_to_string(&metrics)
            .map(|s| s.lines().count() >= 1)
            .unwrap_or(false)
    })
    .expect("the run finished no step within 60 s");
    let workers = children(child.id());
    assert_eq!(
        workers.len(),
        2,
        "expected 2 worker processes, found {workers:?}"
    );
    (child, dir, workers)
}

#[test]
fn normal_run_leaves_nothing() {
    let before = shm_entries();
    let (child, _dir) = spawn_run("clean-normal", 3, &[]);
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_clean(pid, &[], &before);
}

#[test]
fn killing_a_worker_stops_the_run_and_frees_everything() {
    let before = shm_entries();
    let ck = scratch("clean-kill-worker-ck");
    let flags = checkpointing(&ck);
    let (mut child, dir, workers) =
        start_long_run("clean-kill-worker", &flags.each_ref().map(String::as_str));
    let pid = child.id();
    assert!(
        !region_holders(pid).is_empty(),
        "the probe must see the live regions"
    );
    signal("KILL", workers[1]);
    let exited = wait_for(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    assert!(
        exited.is_some(),
        "launcher still running 10 s after a worker was killed"
    );
    let status = child.wait().unwrap();
    assert!(!status.success(), "launcher must exit non-zero");
    let err = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    assert!(
        err.contains("rank") && err.contains("SIGKILL"),
        "stderr must name the rank and signal:\n{err}"
    );
    let rank = if err.contains("worker rank 1") { 1 } else { 0 };
    assert_eq!(rank, 1, "the killed worker was rank 1:\n{err}");
    assert!(
        !err.contains("out of memory"),
        "a plain SIGKILL is not an OOM kill:\n{err}"
    );
    assert_clean(pid, &workers, &before);
    // The write in flight was completed, not abandoned.
    assert_eq!(partial_checkpoints(&ck), Vec::<String>::new());
    assert!(!mt::checkpoint::state::complete(&ck).unwrap().is_empty());
}

/// A worker SIGKILLed while the kernel's OOM-kill count moves (a stand-in /proc/vmstat,
/// `MT_PROC_VMSTAT`, bumped just before the kill) is reported as the host running out of
/// memory, with the plan's figure; a plain SIGKILL (the test above) is not.
#[test]
fn a_worker_killed_for_memory_is_reported_as_such() {
    let before = shm_entries();
    let vmstat = scratch("clean-oom-vmstat").join("vmstat");
    std::fs::write(&vmstat, "nr_free_pages 1\noom_kill 7\n").unwrap();
    let (mut child, dir, workers) =
        start_long_run_env("clean-oom", &[], &[("MT_PROC_VMSTAT", &vmstat)]);
    let pid = child.id();
    std::fs::write(&vmstat, "nr_free_pages 1\noom_kill 8\n").unwrap();
    signal("KILL", workers[0]);
    wait_for(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    })
    .expect("launcher still running 10 s after a worker was killed");
    assert!(!child.wait().unwrap().success());
    let err = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    assert!(
        err.contains("worker rank 0")
            && err.contains("SIGKILL")
            && err.contains("ran out of memory")
            && err.contains("from 7 to 8")
            && err.contains("plan holds"),
        "stderr must say the worker was killed for memory, with the plan:\n{err}"
    );
    assert_clean(pid, &workers, &before);
}

/// Flags for a checkpoint under `ck` after every step.
fn checkpointing(ck: &std::path::Path) -> [String; 4] {
    [
        "--set".into(),
        format!("checkpoint.dir={}", ck.display()),
        "--set".into(),
        "checkpoint.every_steps=1".into(),
    ]
}

#[test]
fn killing_the_launcher_ends_every_worker() {
    let before = shm_entries();
    let ck = scratch("clean-kill-launcher-ck");
    let flags = checkpointing(&ck);
    let (mut child, dir, workers) =
        start_long_run("clean-kill-launcher", &flags.each_ref().map(String::as_str));
    let pid = child.id();
    // Let it write a few checkpoints, so that the kill likely lands mid-write.
    wait_for(Duration::from_secs(30), || {
        mt::checkpoint::state::complete(&ck).unwrap().len() >= 2
    })
    .expect("two checkpoints within 30 s");
    signal("KILL", pid);
    child.wait().unwrap();
    let gone = wait_for(Duration::from_secs(5), || {
        workers.iter().all(|&p| !alive(p))
    });
    assert!(
        gone.is_some(),
        "workers {workers:?} outlived the launcher by 5 s"
    );
    assert_clean(pid, &workers, &before);
    // The newest complete checkpoint resumes, and the resumed run removes what the killed
    // writer left half written.
    let (last, _) = mt::checkpoint::state::complete(&ck).unwrap().pop().unwrap();
    let steps = format!("training.num_steps={}", last + 1);
    let [a, b, c, d] = flags.each_ref().map(String::as_str);
    run_cpu_ok(
        &golden_dir().join("llama/run.yaml"),
        2,
        &dir.join("resumed.jsonl"),
        &[a, b, c, d, "--set", &steps, "--resume", "latest"],
    );
    assert_eq!(partial_checkpoints(&ck), Vec::<String>::new());
}

/// SIGINT / SIGTERM stop the run at a step boundary with a checkpoint of the last finished
/// step, exit 130 / 143, and leave nothing behind.
fn stop_with(sig: &str, code: i32) {
    let before = shm_entries();
    let name = format!("clean-{sig}");
    let ck = scratch(&format!("{name}-ck"));
    let ck_set = format!("checkpoint.dir={}", ck.display());
    // Checkpoints every step: a background write is likely in flight at the signal.
    let (mut child, dir, workers) = start_long_run(
        &name,
        &["--set", &ck_set, "--set", "checkpoint.every_steps=1"],
    );
    let pid = child.id();
    signal(sig, pid);
    let exited = wait_for(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    assert!(exited.is_some(), "launcher still running 10 s after {sig}");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(code), "exit status after {sig}");
    let steps = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    let saved = ck.join(format!("step-{steps:08}"));
    assert!(
        saved.join("COMPLETE").is_file(),
        "no complete checkpoint of step {steps} in {}",
        ck.display()
    );
    assert_eq!(partial_checkpoints(&ck), Vec::<String>::new());
    assert_clean(pid, &workers, &before);
}

#[test]
fn sigint_stops_at_a_step_boundary_with_a_checkpoint() {
    stop_with("INT", 130);
}

#[test]
fn sigterm_stops_at_a_step_boundary_with_a_checkpoint() {
    stop_with("TERM", 143);
}

#[test]
fn a_hung_worker_is_timed_out_like_a_crash() {
    let before = shm_entries();
    let (mut child, dir, workers) =
        start_long_run("clean-hang", &["--set", "training.worker_timeout_s=2"]);
    let pid = child.id();
    // A stopped process is alive and silent: from the launcher's side, a hang.
    signal("STOP", workers[1]);
    let exited = wait_for(Duration::from_secs(15), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    assert!(
        exited.is_some(),
        "launcher still running 15 s after a worker hung"
    );
    assert!(
        !child.wait().unwrap().success(),
        "launcher must exit non-zero"
    );
    let err = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    assert!(
        err.contains("worker rank 1") && err.contains("timed out after 2 s"),
        "stderr must name the hung rank and the timeout:\n{err}"
    );
    assert_clean(pid, &workers, &before);
}
