//! A short measure of the drives' bandwidth (`mt-launch plan`): in each directory of
//! `memory.nvme_path`, all at once as the run stripes over them, a file written then read
//! whole, [`JOBS`] transfers of [`CHUNK`] bytes in flight, direct as the state's files are.
//! The file follows the state files' rules ([`super::open_new`]): a directory that is a
//! symbolic link is refused, the file is created owner-only with `O_CREAT | O_EXCL |
//! O_NOFOLLOW`, preallocated (a drive without room fails naming it) and unlinked at once,
//! so nothing is left whatever happens.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::{DriveFile, check_dir, drive_error, open_new};
use crate::Result;
use crate::shm::aligned::Aligned;

/// Bytes written then read in each directory by default: 256 MiB.
pub const PROBE_BYTES: u64 = 256 << 20;
/// Bytes per transfer: 4 MiB, a stripe of an fp32 field.
pub const CHUNK: usize = super::STRIPE * 4;
/// Transfers in flight per directory: a window's stripes of one field (fp32, one drive).
pub const JOBS: usize = super::WINDOW / super::STRIPE;

/// What one directory's drive did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// Bytes per second written (the last write flushed) and read back.
    pub write: f64,
    pub read: f64,
    /// Whether the transfers went direct (false: the filesystem refused `O_DIRECT`, or
    /// `MT_DIRECT_IO=0`; the reads then come from the drive only where the kernel dropped
    /// the written pages as asked).
    pub direct: bool,
}

/// Writes then reads `bytes` (rounded up to [`CHUNK`]s) in a file of each of `dirs`, the
/// directories at once, the file named after `tag`; each directory's speeds, in order.
pub fn probe(dirs: &[PathBuf], bytes: u64, tag: &str) -> Result<Vec<Measured>> {
    for d in dirs {
        check_dir(d)?;
    }
    let want_direct = crate::switches::get().direct_io;
    let chunks = (bytes as usize).div_ceil(CHUNK).max(1);
    std::thread::scope(|s| {
        let jobs: Vec<_> = dirs
            .iter()
            .map(|d| s.spawn(move || probe_one(d, chunks, tag, want_direct)))
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("a drive probe panicked"))
            .collect()
    })
}

/// [`probe`] of one directory: `chunks` [`CHUNK`]s.
fn probe_one(dir: &Path, chunks: usize, tag: &str, want_direct: bool) -> Result<Measured> {
    let path = dir.join(format!("{tag}-probe.state"));
    let file = open_new(&path, (chunks * CHUNK) as u64, want_direct, true)?;
    let direct_off = AtomicBool::new(file.direct.is_none());
    let t = Instant::now();
    pass(&file, &direct_off, chunks, true)?;
    // Whatever the drive still holds in its cache counts: the run's writes wait for it too.
    file.buffered
        .sync_data()
        .map_err(|e| drive_error(&path, "flush", e))?;
    let write = t.elapsed().as_secs_f64();
    let direct = !direct_off.load(std::sync::atomic::Ordering::Relaxed);
    if !direct {
        // Through the page cache: the written pages dropped, so that the reads reach the
        // drive (where the filesystem keeps them anywhere else, tmpfs, it is its speed).
        use std::os::fd::AsFd;
        let _ = nix::fcntl::posix_fadvise(
            file.buffered.as_fd(),
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        );
    }
    let t = Instant::now();
    pass(&file, &direct_off, chunks, false)?;
    let read = t.elapsed().as_secs_f64();
    let total = (chunks * CHUNK) as f64;
    Ok(Measured {
        write: total / write.max(1e-9),
        read: total / read.max(1e-9),
        direct,
    })
}

/// Writes (or reads) `chunks` [`CHUNK`]s of `file`, [`JOBS`] at once: job j takes chunks
/// j, j + JOBS, …, each with a page-aligned buffer of its own.
fn pass(file: &DriveFile, direct_off: &AtomicBool, chunks: usize, write: bool) -> Result<()> {
    std::thread::scope(|s| {
        let jobs: Vec<_> = (0..JOBS.min(chunks))
            .map(|j| {
                s.spawn(move || {
                    let mut buf = Aligned::<u8>::zeroed(CHUNK);
                    // Not zeros: a drive that compresses would write nothing of them.
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ j as u64;
                    for b in buf.as_mut_slice().chunks_mut(8) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
                    }
                    for k in (j..chunks).step_by(JOBS) {
                        let off = (k * CHUNK) as u64;
                        match write {
                            true => file.write_at(direct_off, buf.as_slice(), off)?,
                            false => file.read_at(direct_off, buf.as_mut_slice(), off)?,
                        };
                    }
                    Ok(())
                })
            })
            .collect();
        jobs.into_iter()
            .try_for_each(|j| j.join().expect("a drive probe panicked"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe measures both ways on two directories at once, leaves nothing in them, and
    /// refuses a directory that is a symbolic link (as the run does) and one that does not
    /// exist, naming it.
    #[test]
    fn probes_leave_nothing_and_refuse_links() {
        let root = std::env::temp_dir().join(format!("mt-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dirs = [root.join("a"), root.join("b")];
        dirs.iter()
            .for_each(|d| std::fs::create_dir_all(d).unwrap());
        let got = probe(&dirs, 3 * CHUNK as u64, "t").unwrap();
        assert_eq!(got.len(), 2);
        for m in &got {
            assert!(m.read > 0.0 && m.write > 0.0, "{m:?}");
        }
        for d in &dirs {
            assert_eq!(std::fs::read_dir(d).unwrap().count(), 0, "{}", d.display());
        }
        let link = root.join("link");
        std::os::unix::fs::symlink(&dirs[0], &link).unwrap();
        let err = probe(std::slice::from_ref(&link), CHUNK as u64, "t")
            .unwrap_err()
            .to_string();
        let named = err.contains(&link.display().to_string());
        assert!(named && err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_dir(&dirs[0]).unwrap().count(), 0);
        let missing = root.join("missing");
        let err = probe(&[missing], CHUNK as u64, "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
