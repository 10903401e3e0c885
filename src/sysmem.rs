//! What the kernel says of the host's memory: the RAM available now (`MemAvailable`) and
//! the count of OOM kills since boot. A leaf, read by the memory plans (`crate::plan`), the
//! bounded reads (`crate::bounded::data_bound`) and the launcher and workers; each answer
//! may be replaced by a test hook (`crate::switches::testing`).

/// The kernel's count of OOM kills since boot (`oom_kill` in /proc/vmstat; None where it
/// cannot be read). `MT_PROC_VMSTAT` names another file to read, for tests.
pub fn oom_kills() -> Option<u64> {
    let path = crate::switches::testing::proc_vmstat().unwrap_or("/proc/vmstat".as_ref());
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with("oom_kill "))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Bytes free for an unprivileged user on the filesystem of `dir` (None where it cannot be
/// read).
pub fn free_disk_bytes(dir: &std::path::Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// MemAvailable from /proc/meminfo, in bytes (None where it cannot be read).
pub fn available_host_bytes() -> Option<u64> {
    // Test hook (`MT_TEST_HOST_MEMORY`): the RAM a test says is available, so host-memory
    // decisions can be tested on any machine.
    if let Some(b) = crate::switches::testing::host_memory() {
        return Some(b);
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
