//! What a run leaves behind: processes, shared memory, partial checkpoints.
//!
//! Shared memory is memfd-backed and named `mt-<launcher pid>-…`; it exists while any
//! process holds its fd or mapping, so "no shared-memory object remains" means no process
//! on the machine has such an fd or mapping, and /dev/shm gained no entry.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Processes that hold an fd or a mapping of one of this launcher's regions.
pub fn region_holders(launcher_pid: u32) -> Vec<String> {
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

pub fn shm_entries() -> Vec<String> {
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
pub fn alive(pid: u32) -> bool {
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

pub fn children(pid: u32) -> Vec<u32> {
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

pub fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Sends `signal` (`KILL`, `STOP`, `INT`, …) to `pid`.
pub fn signal(signal: &str, pid: u32) {
    let rc = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(rc.success(), "kill -{signal} {pid}");
}

pub fn assert_clean(launcher_pid: u32, workers: &[u32], shm_before: &[String]) {
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

/// Checkpoint directories under `root` that are not complete (no `COMPLETE` marker, or a
/// temporary directory).
pub fn partial_checkpoints(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| !e.path().join("COMPLETE").is_file())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect()
}
