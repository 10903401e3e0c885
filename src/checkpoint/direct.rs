//! Checkpoint writes past the page cache (`O_DIRECT`), as `dd oflag=direct` writes.
//!
//! A buffered write copies every byte into the page cache, and the kernel's flusher
//! threads write it out later. Beside training, that is a copy through memory the
//! optimizer's passes are bound by, and threads that queue behind the launcher's busy
//! cores; a periodic checkpoint wrote at 52-71% of the disk's `dd oflag=direct` rate while
//! training ran, and at 92-143% alone (benches/results/checkpoint_*_2026-11-24*.md). A
//! direct write hands the disk the bytes from an aligned buffer and returns when they are
//! written.
//!
//! `O_DIRECT` wants the file offset, the length and the memory address aligned to the
//! device's logical block ([`ALIGN`]). A checkpoint's pieces land at any offset, so each
//! write is split: its whole aligned blocks go direct, through an aligned buffer of this
//! module's where the source is not aligned, and the partial blocks at its two ends go
//! through the page cache. Two writes never share a block that either writes direct (a
//! block written direct lies wholly inside one write, and writes do not overlap), so the
//! two paths never hold two versions of one block. Filesystems without `O_DIRECT` (tmpfs)
//! are written buffered throughout, as is every write while `MT_DIRECT_IO=0` is set.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Alignment of a direct write's file offset, length and memory: 4 KiB, the largest
/// logical block size of common devices.
const ALIGN: usize = 4096;
/// Bytes per direct write through the aligned buffer.
const BOUNCE: usize = 8 << 20;
/// Writes with fewer aligned bytes than this go buffered whole (not worth a syscall more).
const MIN_DIRECT: usize = 64 << 10;

/// The direct half of a file written at positions ([`super::pieces::Positioned`]).
pub struct Direct {
    /// The file opened with `O_DIRECT`; None where it cannot be (or `MT_DIRECT_IO=0`).
    file: Option<File>,
    /// Set when a direct write failed as unsupported: the rest go buffered.
    off: AtomicBool,
    /// Aligned buffers for sources that are not, one per writing thread at a time.
    bounce: Mutex<Vec<Vec<u8>>>,
    /// Bytes written direct.
    direct: AtomicU64,
}

impl Direct {
    /// The direct half of `path` (already created).
    pub fn open(path: &Path) -> Direct {
        let wanted = crate::switches::get().direct_io;
        let file = wanted
            .then(|| {
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW)
                    .open(path)
                    .ok()
            })
            .flatten();
        Direct {
            file,
            off: AtomicBool::new(false),
            bounce: Mutex::new(Vec::new()),
            direct: AtomicU64::new(0),
        }
    }

    /// Bytes written direct so far.
    pub fn direct_bytes(&self) -> u64 {
        self.direct.load(Ordering::Relaxed)
    }

    /// Writes `bytes` at byte `at` of the file: the whole aligned blocks direct, the rest
    /// through `buffered` (the same file, opened plainly).
    pub fn write_at(&self, buffered: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
        let (start, end) = (at as usize, at as usize + bytes.len());
        let (lo, hi) = (start.next_multiple_of(ALIGN), end / ALIGN * ALIGN);
        let on = !self.off.load(Ordering::Relaxed);
        let Some(direct) = self.file.as_ref().filter(|_| on) else {
            return buffered.write_all_at(bytes, at);
        };
        if hi < lo + MIN_DIRECT {
            return buffered.write_all_at(bytes, at);
        }
        buffered.write_all_at(&bytes[..lo - start], at)?;
        buffered.write_all_at(&bytes[hi - start..], hi as u64)?;
        let middle = &bytes[lo - start..hi - start];
        match self.write_aligned(direct, middle, lo as u64) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // The filesystem took the open but not the write: buffered from here on.
                self.off.store(true, Ordering::Relaxed);
                buffered.write_all_at(middle, lo as u64)
            }
            r => r,
        }
    }

    /// `bytes` (whole blocks) at `at` (aligned), straight from `bytes` where its address
    /// is aligned, else through an aligned buffer a [`BOUNCE`] at a time.
    fn write_aligned(&self, direct: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
        if (bytes.as_ptr() as usize).is_multiple_of(ALIGN) {
            direct.write_all_at(bytes, at)?;
        } else {
            let mut own = self.bounce.lock().expect("a writer panicked").pop();
            let buf = own.get_or_insert_with(|| vec![0u8; BOUNCE + ALIGN]);
            let skip = buf.as_ptr().align_offset(ALIGN);
            let aligned = &mut buf[skip..skip + BOUNCE];
            let result = bytes.chunks(BOUNCE).enumerate().try_for_each(|(i, piece)| {
                aligned[..piece.len()].copy_from_slice(piece);
                direct.write_all_at(&aligned[..piece.len()], at + (i * BOUNCE) as u64)
            });
            self.bounce.lock().expect("a writer panicked").extend(own);
            result?;
        }
        self.direct.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes at any offset, of any length, from sources at any address give the bytes
    /// a plain write gives: heads and tails of partial blocks, whole aligned stretches,
    /// sources off the alignment (through the buffer, over several of its lengths) and on
    /// it, in an order that is not the file's. Where the filesystem takes `O_DIRECT`
    /// writes, most of the bytes went direct.
    #[test]
    fn split_writes_give_the_plain_bytes() {
        let dir = std::env::temp_dir().join(format!("mt-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let len = 3 * BOUNCE + 5 * ALIGN + 123;
        let want: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        let file = File::create(&path).unwrap();
        file.set_len(len as u64).unwrap();
        let direct = Direct::open(&path);
        // Cuts: a few bytes, less than MIN_DIRECT, one block and a bit, several bounce
        // lengths, and the rest; written last first.
        let cuts = [
            0,
            5,
            40_000,
            40_000 + ALIGN + 17,
            2 * BOUNCE + 3 * ALIGN,
            len,
        ];
        // Copies of `want` whose byte i sits at an address i mod ALIGN (so the aligned
        // middles are read in place), and one byte past that (through the buffer).
        let mut room = vec![0u8; 2 * len + 3 * ALIGN];
        let on = room.as_ptr().align_offset(ALIGN);
        let off = on + len.next_multiple_of(ALIGN) + 1;
        room[on..on + len].copy_from_slice(&want);
        room[off..off + len].copy_from_slice(&want);
        for (k, w) in cuts.windows(2).enumerate().rev() {
            let at = [on, off][k % 2];
            let src = &room[at + w[0]..at + w[1]];
            direct.write_at(&file, src, w[0] as u64).unwrap();
        }
        drop(file);
        let got = std::fs::read(&path).unwrap();
        assert!(got == want, "bytes differ");
        // Where the filesystem took O_DIRECT for the open and the writes (some take the
        // open only: the writes then went buffered, as `off` records).
        if direct.file.is_some() && !direct.off.load(Ordering::Relaxed) {
            assert!(
                direct.direct_bytes() as usize > len / 2,
                "{} of {len} bytes went direct",
                direct.direct_bytes()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
