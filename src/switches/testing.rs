//! The test hooks: variables the tests set to reach states a test machine cannot (a worker
//! killed mid-step, a node late, a given amount of memory, an allocation that fails, an
//! export paused between two renames, a drive that fails a write). Read with the other switches ([`super::init`]);
//! product code asks the functions here (`testing::kill_worker_at(step)`), never the
//! environment. Nothing but tests should set them.

use std::path::{Path, PathBuf};

use super::{Env, bad, get};
use crate::error::Result;

/// `<phase>[:<layer>]`: the worker fails the first entry into that phase (and layer) as a
/// failed device allocation would (worker/src/fault.rs; phases: `mt::fault::Phase::name`).
pub const FAIL_ALLOC: &str = "MT_TEST_FAIL_ALLOC";
/// `<rank>:<step>`: the launcher SIGKILLs worker `rank` as it sends step `step` (from 1).
pub const KILL_WORKER: &str = "MT_TEST_KILL_WORKER";
/// `<rank>:<ms>`: node `rank` sends each step to its workers `ms` milliseconds late.
pub const LATE_NODE: &str = "MT_TEST_LATE_NODE";
/// `<instant>:<flag file>`: an export writes the flag file and stops at that instant.
pub const EXPORT_PAUSE: &str = "MT_TEST_EXPORT_PAUSE";
/// Bytes: the host RAM available (MemAvailable) as the planner reads it.
pub const HOST_MEMORY: &str = "MT_TEST_HOST_MEMORY";
/// Bytes: every worker's device memory, free and total, as the launcher reads it.
pub const DEVICE_MEMORY: &str = "MT_TEST_DEVICE_MEMORY";
/// `<step>`: the update of step `step` (from 1) fails its first write of the optimizer
/// state to a drive (`memory.optimizer_offload: nvme`) with EIO, as a failing drive would.
pub const DRIVE_EIO: &str = "MT_TEST_DRIVE_EIO";
/// A file read instead of /proc/vmstat (the kernel's OOM-kill count).
pub const PROC_VMSTAT: &str = "MT_PROC_VMSTAT";

/// The hooks' values (None: unset).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Testing {
    /// `MT_TEST_FAIL_ALLOC`: a phase name (checked by `mt::fault::fail_alloc_target`) and
    /// maybe a layer.
    pub fail_alloc: Option<(String, Option<usize>)>,
    /// `MT_TEST_KILL_WORKER`: (rank, step).
    pub kill_worker: Option<(usize, u64)>,
    /// `MT_TEST_LATE_NODE`: (rank, milliseconds).
    pub late_node: Option<(usize, u64)>,
    /// `MT_TEST_EXPORT_PAUSE`: (instant, flag file).
    pub export_pause: Option<(String, PathBuf)>,
    /// `MT_TEST_HOST_MEMORY`: bytes.
    pub host_memory: Option<u64>,
    /// `MT_TEST_DEVICE_MEMORY`: bytes.
    pub device_memory: Option<u64>,
    /// `MT_TEST_DRIVE_EIO`: the step whose update fails a drive write.
    pub drive_eio: Option<u64>,
    /// `MT_PROC_VMSTAT`: a file standing for /proc/vmstat.
    pub proc_vmstat: Option<PathBuf>,
}

impl Testing {
    pub(super) fn read(env: &mut Env<'_>) -> Result<Testing> {
        let pair = |env: &mut Env<'_>, var: &'static str, second: &str| {
            let Some(v) = env.text(var)? else {
                return Ok(None);
            };
            let expected = format!("<rank>:<{second}>, two whole numbers");
            match v.split_once(':').map(|(a, b)| (a.parse(), b.parse())) {
                Some((Ok(a), Ok(b))) => Ok(Some((a, b))),
                _ => Err(bad(var, &v, &expected)),
            }
        };
        let fail_alloc = match env.text(FAIL_ALLOC)? {
            None => None,
            Some(v) => Some(match v.split_once(':') {
                None => (v, None),
                Some((p, l)) => match l.parse() {
                    Ok(l) => (p.to_string(), Some(l)),
                    Err(_) => return Err(bad(FAIL_ALLOC, &v, "<phase>[:<layer>]")),
                },
            }),
        };
        let export_pause = match env.text(EXPORT_PAUSE)? {
            None => None,
            Some(v) => match v.split_once(':') {
                Some((at, flag)) if !at.is_empty() && !flag.is_empty() => {
                    Some((at.to_string(), PathBuf::from(flag)))
                }
                _ => return Err(bad(EXPORT_PAUSE, &v, "<instant>:<flag file>")),
            },
        };
        Ok(Testing {
            fail_alloc,
            kill_worker: pair(env, KILL_WORKER, "step")?,
            late_node: pair(env, LATE_NODE, "ms")?,
            export_pause,
            host_memory: env.count(HOST_MEMORY, 0..=u64::MAX, "bytes")?,
            device_memory: env.count(DEVICE_MEMORY, 0..=u64::MAX, "bytes")?,
            drive_eio: env.count(DRIVE_EIO, 1..=u64::MAX, "a step, from 1")?,
            proc_vmstat: env.path(PROC_VMSTAT)?,
        })
    }
}

fn hooks() -> &'static Testing {
    &get().testing
}

/// `MT_TEST_FAIL_ALLOC`: the phase name and layer, unchecked.
pub fn fail_alloc() -> Option<(&'static str, Option<usize>)> {
    hooks().fail_alloc.as_ref().map(|(p, l)| (p.as_str(), *l))
}

/// `MT_TEST_KILL_WORKER`: the rank to kill as the launcher sends step `step`.
pub fn kill_worker_at(step: u64) -> Option<usize> {
    hooks()
        .kill_worker
        .filter(|&(_, s)| s == step)
        .map(|(r, _)| r)
}

/// `MT_TEST_LATE_NODE`: how late node `rank` starts each step.
pub fn late_node(rank: usize) -> Option<std::time::Duration> {
    hooks()
        .late_node
        .filter(|&(r, _)| r == rank)
        .map(|(_, ms)| std::time::Duration::from_millis(ms))
}

/// `MT_TEST_EXPORT_PAUSE`: the flag file, where the hook names `instant`.
pub fn export_pause(instant: &str) -> Option<&'static Path> {
    hooks()
        .export_pause
        .as_ref()
        .filter(|(at, _)| at == instant)
        .map(|(_, flag)| flag.as_path())
}

/// `MT_TEST_HOST_MEMORY`: the available host RAM a test gives, in bytes.
pub fn host_memory() -> Option<u64> {
    hooks().host_memory
}

/// `MT_TEST_DEVICE_MEMORY`: every device's memory a test gives, in bytes.
pub fn device_memory() -> Option<u64> {
    hooks().device_memory
}

/// `MT_TEST_DRIVE_EIO`: whether the update of step `step` fails a drive write.
pub fn drive_eio_at(step: u64) -> bool {
    hooks().drive_eio == Some(step)
}

/// `MT_PROC_VMSTAT`: the file read instead of /proc/vmstat.
pub fn proc_vmstat() -> Option<&'static Path> {
    hooks().proc_vmstat.as_deref()
}
