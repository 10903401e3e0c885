//! No run leaves shared memory or processes behind: after a normal exit, after `kill -9` of
//! a worker (the launcher stops the others and exits non-zero naming the rank and signal
//! within 10 s), and after `kill -9` of the launcher (every worker exits within 5 s).
//!
//! Shared memory is memfd-backed and named `mt-<launcher pid>-…`; it exists while any
//! process holds its fd or mapping, so "no shared-memory object remains" means no process
//! on the machine has such an fd or mapping, and /dev/shm gained no entry.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Processes that hold an fd or a mapping of one of this launcher's regions.
fn region_holders(launcher_pid: u32) -> Vec<String> {
    let tag = format!("memfd:mt-{launcher_pid}-");
    let mut found = Vec::new();
    for proc_dir in std::fs::read_dir("/proc").unwrap().flatten() {
        let pid = proc_dir.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(fds) = std::fs::read_dir(proc_dir.path().join("fd")) {
            for fd in fds.flatten() {
                if let Ok(target) = std::fs::read_link(fd.path())
                    && target.to_string_lossy().contains(&tag)
                {
                    found.push(format!("pid {pid} fd -> {}", target.display()));
                }
            }
        }
        if let Ok(maps) = std::fs::read_to_string(proc_dir.path().join("maps"))
            && maps.contains(&tag)
        {
            found.push(format!("pid {pid} maps a region"));
        }
    }
    found
}

fn shm_entries() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Alive = exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// Starts mt-launch on the llama fixture with 2 workers (and `steps` steps), its stderr
/// in `<scratch>/stderr.log` and metrics in `<scratch>/metrics.jsonl`.
fn spawn_run(name: &str, steps: u64, extra: &[&str]) -> (Child, std::path::PathBuf) {
    let case = golden_dir().join("llama");
    let dir = scratch(name);
    let config = case.join("run.yaml");
    let metrics = dir.join("metrics.jsonl");
    let child = Command::new(launcher())
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
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    (child, dir)
}

/// Starts a long run with 2 workers and waits until it has finished a step.
fn start_long_run(name: &str) -> (Child, std::path::PathBuf, Vec<u32>) {
    start_long_run_with(name, &[])
}

fn start_long_run_with(name: &str, extra: &[&str]) -> (Child, std::path::PathBuf, Vec<u32>) {
    let (child, dir) = spawn_run(name, 1_000_000, extra);
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

fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn kill9(pid: u32) {
    let rc = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(rc.success());
}

fn assert_clean(launcher_pid: u32, workers: &[u32], shm_before: &[String]) {
    // The kernel releases a dead process's fds and mappings as it exits; give it a moment.
    let gone = wait_for(Duration::from_secs(5), || {
        workers.iter().all(|&p| !alive(p)) && region_holders(launcher_pid).is_empty()
    });
    assert!(
        gone.is_some(),
        "left behind: workers alive {:?}, region holders {:?}",
        workers.iter().filter(|&&p| alive(p)).collect::<Vec<_>>(),
        region_holders(launcher_pid)
    );
    let new: Vec<_> = shm_entries()
        .into_iter()
        .filter(|e| !shm_before.contains(e) && e.starts_with("mt"))
        .collect();
    assert!(new.is_empty(), "new /dev/shm entries: {new:?}");
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
    let (mut child, dir, workers) = start_long_run("clean-kill-worker");
    let pid = child.id();
    assert!(
        !region_holders(pid).is_empty(),
        "the probe must see the live regions"
    );
    kill9(workers[1]);
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
    assert_clean(pid, &workers, &before);
}

#[test]
fn killing_the_launcher_ends_every_worker() {
    let before = shm_entries();
    let (mut child, _dir, workers) = start_long_run("clean-kill-launcher");
    let pid = child.id();
    kill9(pid);
    child.wait().unwrap();
    let gone = wait_for(Duration::from_secs(5), || {
        workers.iter().all(|&p| !alive(p))
    });
    assert!(
        gone.is_some(),
        "workers {workers:?} outlived the launcher by 5 s"
    );
    assert_clean(pid, &workers, &before);
}

/// SIGINT / SIGTERM stop the run at a step boundary with a checkpoint of the last finished
/// step, exit 130 / 143, and leave nothing behind.
fn stop_with(signal: &str, code: i32) {
    let before = shm_entries();
    let name = format!("clean-{signal}");
    let ck = scratch(&format!("{name}-ck"));
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let (mut child, dir, workers) = start_long_run_with(&name, &["--set", &ck_set]);
    let pid = child.id();
    let rc = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(rc.success());
    let exited = wait_for(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    assert!(
        exited.is_some(),
        "launcher still running 10 s after {signal}"
    );
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(code), "exit status after {signal}");
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
