//! The optimizer's state on the drives (`memory.optimizer_offload: nvme`): the fp32 master
//! (a split master's low halves; a bf16 master has none beside the store) and Adam's m and
//! v live in files under `memory.nvme_path`, one directory per drive, and every pass over
//! them streams a window of a block at a time through page-aligned host buffers
//! ([`Aligned`]) with direct I/O. Host RAM keeps the store, the gradient and
//! [`BUFFERS`] windows ([`Drives::window_bytes`]).
//!
//! Where each element lies on the drives (padded blocks, striped over them) is
//! [`crate::layout::drives`]: every window starts on a page of every field and no two
//! windows share one, so a window is read and written whole pages at a time, its stripes on
//! the drives in parallel.
//!
//! An update (the weights pass, which writes the moments too: a later moments pass would
//! read and write them again) reads windows i + 1 and i + 2 ([`READ_AHEAD`]) and writes
//! window i - 1 while it computes window i, each on threads of its own, so the drives and
//! the cores work at once. The windows ahead run on across blocks: while a block's last
//! window is computed the next blocks' first ones are read, and its writes finish during
//! the next block's, so the drives are not idle between blocks (`MT_NVME_READ_AHEAD=0`:
//! one window ahead within a block, each block's writes waited for at its end, as before,
//! to measure against). The pass as a whole runs while the workers compute the next
//! step's forward, as in RAM. The arithmetic is the RAM path's kernels on the same elements
//! ([`super::passes`]), so the bits are the same.
//!
//! Files: created in each directory (refused where it is a symbolic link) with
//! `O_CREAT | O_EXCL | O_NOFOLLOW` and mode 0600, so never over a file the run did not
//! create nor through a link, preallocated whole (a drive too small fails at start, naming
//! it), and unlinked as soon as they are open: nothing is left on the drives whatever way
//! the run ends (`kill -9` included), as the shared regions leave nothing in memory.
//! Where the filesystem refuses `O_DIRECT` (tmpfs, `MT_DIRECT_IO=0`) the files are read and
//! written through the page cache, each pass ending with `fdatasync`, and the log says so.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use half::bf16;

use crate::checkpoint::MasterRef;
use crate::config::{DType, MasterWeights};
use crate::layout::Layout;
pub use crate::layout::drives::{BUFFERS, Field as Slot, PAD, READ_AHEAD, STRIPE, WINDOW};
use crate::layout::drives::{block_starts, field_sizes, file_len, window_len};
use crate::shm::aligned::Aligned;
use crate::{Error, Result};

pub mod probe;

/// One window's values of a field.
pub(super) enum WinBuf {
    F32(Aligned<f32>),
    U16(Aligned<u16>),
    Bf16(Aligned<bf16>),
}

impl WinBuf {
    fn new(elem: Elem, n: usize) -> WinBuf {
        match elem {
            Elem::F32 => WinBuf::F32(Aligned::zeroed(n)),
            Elem::U16 => WinBuf::U16(Aligned::zeroed(n)),
            Elem::Bf16 => WinBuf::Bf16(Aligned::zeroed(n)),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            WinBuf::F32(a) => a.bytes_mut(),
            WinBuf::U16(a) => a.bytes_mut(),
            WinBuf::Bf16(a) => a.bytes_mut(),
        }
    }

    /// The CRC32C of the first `n` elements' bytes, and their byte count.
    pub(super) fn crc(&self, n: usize) -> (u32, usize) {
        let (bytes, size) = match self {
            WinBuf::F32(a) => (a.bytes(), 4),
            WinBuf::U16(a) => (a.bytes(), 2),
            WinBuf::Bf16(a) => (a.bytes(), 2),
        };
        (crc32c::crc32c(&bytes[..n * size]), n * size)
    }

    /// Elements `r` as a checkpoint reads a moment or an fp32 master.
    pub(super) fn values(&self, r: Range<usize>) -> MasterRef<'_> {
        match self {
            WinBuf::F32(a) => MasterRef::F32(&a.as_slice()[r]),
            WinBuf::Bf16(a) => MasterRef::Bf16(&a.as_slice()[r]),
            WinBuf::U16(_) => unreachable!("a split master's low halves go with the store"),
        }
    }
}

/// A field's element type on the drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    U16,
    Bf16,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::U16 | Elem::Bf16 => 2,
        }
    }
}

/// One window of every field on the drives (`master` where it is there).
pub(super) struct Window {
    pub(super) master: Option<WinBuf>,
    pub(super) m: WinBuf,
    pub(super) v: WinBuf,
}

impl Window {
    /// The buffer of `slot`, where it is on the drives.
    pub(super) fn buf(&self, slot: Slot) -> Option<&WinBuf> {
        match slot {
            Slot::Master => self.master.as_ref(),
            Slot::M => Some(&self.m),
            Slot::V => Some(&self.v),
        }
    }

    /// The buffer of each field, by slot.
    fn bufs_mut(&mut self) -> [(Slot, Option<&mut WinBuf>); 3] {
        [
            (Slot::Master, self.master.as_mut()),
            (Slot::M, Some(&mut self.m)),
            (Slot::V, Some(&mut self.v)),
        ]
    }
}

/// How [`Drives::create`] comes by the files (`memory.keep_nvme_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Files {
    /// Created and unlinked at once: nothing is left whatever way the run ends.
    Unlinked,
    /// Created under the names of a kept state ([`KEPT`]) and left after the run.
    Kept,
    /// A kept state's files, opened: regular files, owner-only, of the length the state
    /// needs.
    Reopened,
}

/// The name of a kept state's files in each directory: `megatrain-master.state`, `-m`, `-v`.
pub const KEPT: &str = "megatrain";

/// A field's index in [`Drives`]' checksums.
fn slot_index(slot: Slot) -> usize {
    match slot {
        Slot::Master => 0,
        Slot::M => 1,
        Slot::V => 2,
    }
}

/// One field's file on one drive.
struct DriveFile {
    path: PathBuf,
    /// Opened with `O_DIRECT`; None where the filesystem refused it.
    direct: Option<File>,
    buffered: File,
}

impl DriveFile {
    /// Reads `buf` at byte `off`: direct unless `direct_off` (set here once the filesystem
    /// refuses a direct transfer).
    fn read_at(&self, direct_off: &AtomicBool, buf: &mut [u8], off: u64) -> Result<usize> {
        let direct = self.direct.as_ref();
        if let Some(direct) = direct.filter(|_| !direct_off.load(Ordering::Relaxed)) {
            match direct.read_exact_at(buf, off) {
                Ok(()) => return Ok(buf.len()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => refused(direct_off, &self.path),
                Err(e) => return Err(drive_error(&self.path, "read", e)),
            }
        }
        self.buffered
            .read_exact_at(buf, off)
            .map_err(|e| drive_error(&self.path, "read", e))?;
        Ok(buf.len())
    }

    /// Writes `buf` at byte `off`: direct unless `direct_off`, as [`DriveFile::read_at`].
    fn write_at(&self, direct_off: &AtomicBool, buf: &[u8], off: u64) -> Result<usize> {
        let direct = self.direct.as_ref();
        if let Some(direct) = direct.filter(|_| !direct_off.load(Ordering::Relaxed)) {
            match direct.write_all_at(buf, off) {
                Ok(()) => return Ok(buf.len()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => refused(direct_off, &self.path),
                Err(e) => return Err(drive_error(&self.path, "write", e)),
            }
        }
        self.buffered
            .write_all_at(buf, off)
            .map_err(|e| drive_error(&self.path, "write", e))?;
        Ok(buf.len())
    }
}

/// A direct transfer the filesystem took the open for but refused: the page cache from
/// here on (`direct_off` set, said once).
fn refused(direct_off: &AtomicBool, path: &Path) {
    if !direct_off.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            path = %path.display(),
            "the filesystem refused a direct transfer of the optimizer state: the page \
             cache from here on, each pass ending with fdatasync"
        );
    }
}

/// A field: its element type and its file on each drive.
struct FieldFiles {
    slot: Slot,
    elem: Elem,
    files: Vec<DriveFile>,
}

/// Bytes moved and time waited since [`Drives::take_io`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DriveIo {
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Seconds the reads, and the writes, took: each window's transfer from its start to
    /// its last byte, summed (they overlap the arithmetic and each other).
    pub read_s: f64,
    pub write_s: f64,
    /// Seconds the optimizer's passes waited for the drives (a read not yet complete, a
    /// buffer still being written).
    pub wait_s: f64,
}

/// The optimizer's state on the drives (module docs).
pub struct Drives {
    dirs: Vec<PathBuf>,
    fields: Vec<FieldFiles>,
    /// Each block's first position, then the end of the last one.
    starts: Vec<usize>,
    /// Elements per window: [`WINDOW`], or the largest block rounded up where that is
    /// shorter (a test sets shorter ones: [`Drives::with_window`]).
    window: usize,
    /// Elements per stripe: [`STRIPE`] (a test sets shorter ones).
    stripe: usize,
    /// Set once a direct transfer was refused: the rest go through the page cache.
    direct_off: AtomicBool,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    /// Nanoseconds of reads and of writes.
    read_ns: AtomicU64,
    write_ns: AtomicU64,
    /// Nanoseconds the passes waited for the drives.
    wait_ns: AtomicU64,
    /// With the files kept: the CRC32C of each window written (by block and first element
    /// within it; master, m, v), from which the manifest's checksums are made.
    crcs: Option<Mutex<WindowCrcs>>,
}

/// The CRC32C of each window written, by (block, first element within it): master, m, v.
type WindowCrcs = HashMap<(usize, usize), [Option<u32>; 3]>;

/// Refuses a directory that is a symbolic link, is not a directory or does not exist.
pub fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| Error::io(dir, e))?;
    let msg = if meta.file_type().is_symlink() {
        "memory.nvme_path: is a symbolic link; name the directory it points to"
    } else if !meta.is_dir() {
        "memory.nvme_path: is not a directory"
    } else {
        return Ok(());
    };
    Err(Error::Config {
        path: dir.into(),
        msg: msg.into(),
    })
}

impl Drives {
    /// Creates the files of `layout`'s state held as `master` and `moments` under `dirs`
    /// (one per drive), every position zero, named after the process `tag` (or [`KEPT`]);
    /// or, with [`Files::Reopened`], opens a kept state's.
    pub fn create(
        dirs: &[PathBuf],
        layout: &Layout,
        master: MasterWeights,
        moments: DType,
        tag: &str,
        how: Files,
    ) -> Result<Drives> {
        assert!(
            !dirs.is_empty(),
            "validated: memory.nvme_path names a drive"
        );
        for d in dirs {
            check_dir(d)?;
        }
        let starts = block_starts(layout);
        let n = *starts.last().expect("starts at 0");
        let want_direct = crate::switches::get().direct_io;
        let mut refused = false;
        let mut all = Vec::new();
        // A kept state's files this call created, removed if it fails.
        let mut made = Vec::new();
        let tag = match how {
            Files::Unlinked => tag,
            Files::Kept | Files::Reopened => KEPT,
        };
        for (slot, size) in field_sizes(master, moments) {
            let elem = match (slot, size) {
                (_, 4) => Elem::F32,
                (Slot::Master, _) => Elem::U16,
                _ => Elem::Bf16,
            };
            let len = file_len(n, dirs.len(), size);
            let mut files = Vec::new();
            for d in dirs {
                let path = d.join(format!("{tag}-{}.state", slot.name()));
                let opened = match how {
                    Files::Reopened => open_kept(&path, len, want_direct),
                    _ => open_new(&path, len, want_direct, how == Files::Unlinked),
                };
                let f = match opened {
                    Ok(f) => f,
                    Err(e) => {
                        for p in &made {
                            let _ = std::fs::remove_file(p);
                        }
                        return Err(e);
                    }
                };
                if how == Files::Kept {
                    made.push(path);
                }
                refused |= want_direct && f.direct.is_none();
                files.push(f);
            }
            all.push(FieldFiles { slot, elem, files });
        }
        if refused {
            tracing::warn!(
                paths = ?dirs,
                "the optimizer state's filesystem refused O_DIRECT (tmpfs?): its files are \
                 read and written through the page cache, each pass ending with fdatasync"
            );
        } else if !want_direct {
            tracing::info!("MT_DIRECT_IO=0: the optimizer state goes through the page cache");
        }
        let window = window_len(layout);
        Ok(Drives {
            dirs: dirs.to_vec(),
            fields: all,
            starts,
            window,
            stripe: STRIPE,
            direct_off: AtomicBool::new(!want_direct || refused),
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            read_ns: AtomicU64::new(0),
            write_ns: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            crcs: (how != Files::Unlinked).then(Default::default),
        })
    }

    /// The same drives streamed in windows of `window` elements, striped in stripes of
    /// `stripe` (multiples of [`PAD`], the stripe no longer than [`STRIPE`], for which the
    /// files were sized): tests make a block span several windows and drives.
    pub fn with_geometry(mut self, window: usize, stripe: usize) -> Drives {
        for n in [window, stripe] {
            assert!(n > 0 && n.is_multiple_of(PAD), "{n} elements");
        }
        assert!(stripe <= STRIPE);
        (self.window, self.stripe) = (window, stripe);
        self
    }

    pub(super) fn new_window(&self) -> Window {
        let buf = |slot| {
            let f = self.fields.iter().find(|f| f.slot == slot)?;
            Some(WinBuf::new(f.elem, self.window))
        };
        Window {
            master: buf(Slot::Master),
            m: buf(Slot::M).expect("the moments are on the drives"),
            v: buf(Slot::V).expect("the moments are on the drives"),
        }
    }

    /// The directories, one per drive.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Elements per stripe.
    pub fn stripe(&self) -> usize {
        self.stripe
    }

    /// The files of `slot` (one per drive, in order) and each one's bytes.
    pub fn files(&self, slot: Slot) -> Option<(Vec<PathBuf>, u64)> {
        let f = self.fields.iter().find(|f| f.slot == slot)?;
        let len = f.files[0].buffered.metadata().map_or(0, |m| m.len());
        Some((f.files.iter().map(|f| f.path.clone()).collect(), len))
    }

    /// With the files kept: the CRC32C of `slot`'s elements of window `start..` of block
    /// `block` as last written, where one was.
    pub(super) fn written_crc(&self, block: usize, start: usize, slot: Slot) -> Option<u32> {
        let crcs = self.crcs.as_ref()?.lock().expect("a transfer panicked");
        crcs.get(&(block, start))?[slot_index(slot)]
    }

    /// Elements per window.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Host bytes of the windows' buffers.
    pub fn window_bytes(&self) -> usize {
        let per: usize = self.fields.iter().map(|f| f.elem.size()).sum();
        BUFFERS * self.window * per
    }

    /// Whether the transfers go direct.
    pub fn direct(&self) -> bool {
        !self.direct_off.load(Ordering::Relaxed)
    }

    /// Whether `slot` is on the drives.
    pub fn holds(&self, slot: Slot) -> bool {
        self.fields.iter().any(|f| f.slot == slot)
    }

    /// The windows of block `block`: ranges of its elements, from 0.
    pub fn windows(&self, layout: &Layout, block: usize) -> Vec<Range<usize>> {
        let len = layout.blocks[block].len;
        (0..len)
            .step_by(self.window)
            .map(|s| s..(s + self.window).min(len))
            .collect()
    }

    /// Reads elements `r` of block `block` (a window: [`Drives::windows`]) of the fields in
    /// `slots` into `win`.
    pub(super) fn read(
        &self,
        block: usize,
        r: Range<usize>,
        win: &mut Window,
        slots: &[Slot],
    ) -> Result<()> {
        self.transfer(block, r, win, slots, false)
    }

    /// Writes elements `r` of block `block` of the fields in `slots` from `win`.
    pub(super) fn write(
        &self,
        block: usize,
        r: Range<usize>,
        win: &mut Window,
        slots: &[Slot],
    ) -> Result<()> {
        self.transfer(block, r, win, slots, true)
    }

    /// [`Drives::read`] or [`Drives::write`]: every stripe of every field on a thread of
    /// its own.
    fn transfer(
        &self,
        block: usize,
        r: Range<usize>,
        win: &mut Window,
        slots: &[Slot],
        write: bool,
    ) -> Result<()> {
        assert!(r.start.is_multiple_of(PAD) && r.len() <= self.window);
        let t = Instant::now();
        // Whole pages: the block's positions are padded to PAD.
        let first = self.starts[block] + r.start;
        let n = r.len().next_multiple_of(PAD);
        let moved = std::thread::scope(|s| {
            let mut jobs = Vec::new();
            let mut bufs = win.bufs_mut();
            for f in self.fields.iter().filter(|f| slots.contains(&f.slot)) {
                let es = f.elem.size();
                let (_, buf) = bufs.iter_mut().find(|(s, _)| *s == f.slot).expect("a slot");
                let mut bytes = buf
                    .take()
                    .expect("a field on the drives has a buffer")
                    .bytes_mut();
                let mut at = first;
                while at < first + n {
                    let (drive, off, len) = self.place(at, first + n - at);
                    let (piece, rest) = std::mem::take(&mut bytes).split_at_mut(len * es);
                    bytes = rest;
                    let (file, off) = (&f.files[drive], (off * es) as u64);
                    jobs.push(s.spawn(move || match write {
                        true => self.write_at(file, piece, off),
                        false => self.read_at(file, piece, off),
                    }));
                    at += len;
                }
            }
            let mut moved = 0u64;
            let mut first_err = None;
            for j in jobs {
                match j.join().expect("a drive transfer panicked") {
                    Ok(b) => moved += b as u64,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok(moved),
            }
        })?;
        if let Some(crcs) = self.crcs.as_ref().filter(|_| write) {
            let mut at = [None; 3];
            for &slot in slots {
                let buf = win.buf(slot).expect("a field on the drives has a buffer");
                at[slot_index(slot)] = Some(buf.crc(r.len()).0);
            }
            let mut crcs = crcs.lock().expect("a transfer panicked");
            let had = crcs.entry((block, r.start)).or_default();
            for (h, c) in had.iter_mut().zip(at) {
                *h = c.or(*h);
            }
        }
        let (bytes, ns) = match write {
            true => (&self.write_bytes, &self.write_ns),
            false => (&self.read_bytes, &self.read_ns),
        };
        bytes.fetch_add(moved, Ordering::Relaxed);
        ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Where position `pos` is: its drive, its element in that drive's file, and how many of
    /// the `n` positions from it follow it there (to the stripe's end).
    fn place(&self, pos: usize, n: usize) -> (usize, usize, usize) {
        let (d, s) = (self.dirs.len(), self.stripe);
        let (k, within) = (pos / s, pos % s);
        (k % d, (k / d) * s + within, (s - within).min(n))
    }

    /// Reads `buf` at byte `off` of `file`: direct while the filesystem takes it.
    fn read_at(&self, file: &DriveFile, buf: &mut [u8], off: u64) -> Result<usize> {
        file.read_at(&self.direct_off, buf, off)
    }

    /// Writes `buf` at byte `off` of `file`: direct while the filesystem takes it.
    fn write_at(&self, file: &DriveFile, buf: &[u8], off: u64) -> Result<usize> {
        file.write_at(&self.direct_off, buf, off)
    }

    /// A direct transfer the filesystem took the open for but refused: the page cache from
    /// here on.
    #[cfg(test)]
    fn refused(&self, path: &Path) {
        refused(&self.direct_off, path)
    }

    /// Writes `bytes` (elements of `slot` from position `pos` on) through the page cache,
    /// at any position: the fresh master's pieces ([`super::offload`]).
    pub(super) fn put(&self, slot: Slot, mut pos: usize, mut bytes: &[u8]) -> Result<()> {
        let f = self
            .fields
            .iter()
            .find(|f| f.slot == slot)
            .expect("on the drives");
        let es = f.elem.size();
        while !bytes.is_empty() {
            let (drive, off, len) = self.place(pos, bytes.len() / es);
            let (file, off) = (&f.files[drive], (off * es) as u64);
            let (piece, rest) = bytes.split_at(len * es);
            file.buffered
                .write_all_at(piece, off)
                .map_err(|e| drive_error(&file.path, "write", e))?;
            self.write_bytes
                .fetch_add(piece.len() as u64, Ordering::Relaxed);
            (pos, bytes) = (pos + len, rest);
        }
        Ok(())
    }

    /// The positions of layout elements `r` on the drives: (first position, elements
    /// within `r`) for each block `r` meets.
    pub(super) fn positions(&self, layout: &Layout, r: Range<usize>) -> Vec<(usize, Range<usize>)> {
        let blocks = &layout.blocks;
        let first = blocks.partition_point(|b| b.offset + b.len <= r.start);
        blocks[first..]
            .iter()
            .enumerate()
            .take_while(|(_, b)| b.offset < r.end)
            .filter_map(|(i, b)| {
                let (lo, hi) = (b.offset.max(r.start), (b.offset + b.len).min(r.end));
                (lo < hi).then(|| {
                    let pos = self.starts[first + i] + (lo - b.offset);
                    (pos, lo - r.start..hi - r.start)
                })
            })
            .collect()
    }

    /// Flushes every file through the page cache to its drive (the fresh master's pieces
    /// went that way; a direct read after them reads what they wrote either way).
    pub(super) fn sync_all(&self) -> Result<()> {
        for f in self.fields.iter().flat_map(|f| &f.files) {
            f.buffered
                .sync_data()
                .map_err(|e| drive_error(&f.path, "flush", e))?;
        }
        Ok(())
    }

    /// Where the transfers go through the page cache: flushes every file to the drive, so
    /// that an error the writes left for later surfaces now, naming its file.
    pub(super) fn sync(&self) -> Result<()> {
        if self.direct() {
            return Ok(());
        }
        for f in self.fields.iter().flat_map(|f| &f.files) {
            f.buffered
                .sync_data()
                .map_err(|e| drive_error(&f.path, "flush", e))?;
        }
        Ok(())
    }

    /// Adds `s` seconds the passes waited for the drives.
    pub(super) fn waited(&self, s: f64) {
        self.wait_ns.fetch_add((s * 1e9) as u64, Ordering::Relaxed);
    }

    /// The bytes moved and the time waited since the last call.
    pub fn take_io(&self) -> DriveIo {
        DriveIo {
            read_bytes: self.read_bytes.swap(0, Ordering::Relaxed),
            write_bytes: self.write_bytes.swap(0, Ordering::Relaxed),
            read_s: self.read_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9,
            write_s: self.write_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9,
            wait_s: self.wait_ns.swap(0, Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

impl Drives {
    /// The error of a write the first drive failed with EIO (`MT_TEST_DRIVE_EIO`), as
    /// [`Drives::write`] reports a real one.
    pub(super) fn injected_eio(&self) -> Error {
        let path = &self.fields[0].files[0].path;
        drive_error(path, "write", std::io::Error::from_raw_os_error(libc::EIO))
    }
}

/// An I/O error of the optimizer state's file `path`, which names the file (and so the
/// drive).
fn drive_error(path: &Path, what: &str, e: std::io::Error) -> Error {
    let cause = std::io::Error::new(
        e.kind(),
        format!("{what} of the optimizer state (memory.nvme_path) failed: {e}"),
    );
    Error::io(path, cause)
}

/// Creates `path` (never an existing file nor through a link, owner-only), preallocates
/// `len` bytes, opens it a second time direct (where `direct` and the filesystem allow) and,
/// with `unlink`, unlinks it (a kept state's file is removed only where this fails).
fn open_new(path: &Path, len: u64, direct: bool, unlink: bool) -> Result<DriveFile> {
    let buffered = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists if !unlink => Error::Config {
                path: path.into(),
                msg: "memory.keep_nvme_state: a file of a kept state without its manifest \
                      (megatrain-nvme-state.json in the first directory of memory.nvme_path): \
                      a run that kept its state and did not end at a step, or another's \
                      file; refused, never written over: remove the state's files to start \
                      afresh"
                    .into(),
            },
            _ => drive_error(path, "create", e),
        })?;
    let opened = preallocate(&buffered, len, path).map(|()| {
        direct
            .then(|| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(path)
                    .ok()
            })
            .flatten()
    });
    // Unlinked whatever happened: the open handles keep the data while the run lives. A
    // kept state's file only where it could not be made whole.
    let removed = match unlink || opened.is_err() {
        true => std::fs::remove_file(path).map_err(|e| drive_error(path, "unlink", e)),
        false => Ok(()),
    };
    let direct = opened?;
    removed?;
    Ok(DriveFile {
        path: path.into(),
        direct,
        buffered,
    })
}

/// Opens a kept state's file `path` (not through a link): a regular file, owner-only, of
/// `len` bytes; a second time direct where `direct` and the filesystem allow.
fn open_kept(path: &Path, len: u64, direct: bool) -> Result<DriveFile> {
    use std::os::unix::fs::MetadataExt;
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
    };
    let buffered = open(0).map_err(|e| drive_error(path, "open of the kept file", e))?;
    let meta = buffered
        .metadata()
        .map_err(|e| drive_error(path, "stat of the kept file", e))?;
    let wrong = if !meta.is_file() {
        Some("is not a regular file".to_string())
    } else if meta.mode() & 0o077 != 0 {
        Some(format!(
            "is not owner-only (mode {:o}): a kept state's files are mode 0600",
            meta.mode() & 0o777
        ))
    } else if meta.len() != len {
        Some(format!(
            "is {} bytes, the kept state's file is {len}: torn or truncated",
            meta.len()
        ))
    } else {
        None
    };
    if let Some(msg) = wrong {
        return Err(Error::Config {
            path: path.into(),
            msg: format!("memory.keep_nvme_state: {msg}; refused"),
        });
    }
    let direct = direct.then(|| open(libc::O_DIRECT).ok()).flatten();
    Ok(DriveFile {
        path: path.into(),
        direct,
        buffered,
    })
}

/// Reserves `len` bytes of `file` on its drive (zeros), so that a drive too small fails
/// here rather than mid-run.
fn preallocate(file: &File, len: u64, path: &Path) -> Result<()> {
    use std::os::fd::AsFd;
    match nix::fcntl::posix_fallocate(file.as_fd(), 0, len as libc::off_t) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate: a sparse file of the length.
        Err(nix::errno::Errno::EOPNOTSUPP) | Err(nix::errno::Errno::EINVAL) => file
            .set_len(len)
            .map_err(|e| drive_error(path, "extend", e)),
        Err(e) => {
            let free = crate::sysmem::free_disk_bytes(path.parent().unwrap_or(Path::new(".")));
            let e = std::io::Error::from_raw_os_error(e as i32);
            let msg = format!(
                "{len} bytes for the optimizer state, {} free",
                free.map_or("unknown".into(), |f| f.to_string())
            );
            Err(drive_error(path, &msg, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use crate::config::hf::{HfConfig, ModelSpec};

    use super::*;

    fn layout() -> Layout {
        let hf: HfConfig = serde_json::from_str(
            r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#,
        )
        .unwrap();
        Layout::new(&ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap())
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-nvme-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn create(dirs: &[PathBuf], tag: &str) -> Result<Drives> {
        let (m, d) = (MasterWeights::Float32, DType::Float32);
        Drives::create(dirs, &layout(), m, d, tag, Files::Unlinked)
    }

    /// Every field's file is created owner-only, preallocated, and unlinked at once: the
    /// directory holds nothing while the run lives, and the handles read back what was
    /// written (over two drives, in stripes of one page-run).
    #[test]
    fn files_are_owner_only_and_unlinked_at_once() {
        let root = scratch("files");
        let dirs = [root.join("a"), root.join("b")];
        dirs.iter().for_each(|d| std::fs::create_dir(d).unwrap());
        let d = create(&dirs, "t").unwrap().with_geometry(PAD, PAD);
        for d in &dirs {
            assert_eq!(std::fs::read_dir(d).unwrap().count(), 0, "{}", d.display());
        }
        for f in &d.fields {
            for file in &f.files {
                let meta = file.buffered.metadata().unwrap();
                assert_eq!(meta.permissions().mode() & 0o777, 0o600);
                assert_eq!(meta.nlink(), 0, "unlinked");
                assert!(meta.len() >= (STRIPE * f.elem.size()) as u64);
            }
        }
        let l = layout();
        let b = (0..l.blocks.len())
            .max_by_key(|&b| l.blocks[b].len)
            .unwrap();
        let mut win = d.new_window();
        let windows = d.windows(&l, b);
        assert!(windows.len() > 1, "the block spans windows");
        let all = [Slot::Master, Slot::M, Slot::V];
        for (k, w) in windows.iter().enumerate() {
            let WinBuf::F32(x) = &mut win.m else {
                unreachable!()
            };
            x.as_mut_slice().fill(k as f32 + 1.0);
            d.write(b, w.clone(), &mut win, &all).unwrap();
        }
        for (k, w) in windows.iter().enumerate().rev() {
            d.read(b, w.clone(), &mut win, &all).unwrap();
            let WinBuf::F32(x) = &win.m else {
                unreachable!()
            };
            assert!(x.as_slice()[..w.len()].iter().all(|&v| v == k as f32 + 1.0));
        }
        let io = { d }.take_io();
        assert!(io.read_bytes > 0 && io.write_bytes == io.read_bytes);
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A file of the name the run would create is never written over (nor removed), and a
    /// directory that is a symbolic link is refused: both named in the error.
    #[test]
    fn foreign_files_and_linked_directories_are_refused() {
        let root = scratch("refused");
        let theirs = root.join("t-m.state");
        std::fs::write(&theirs, b"theirs").unwrap();
        let err = create(std::slice::from_ref(&root), "t")
            .err()
            .expect("refused");
        assert!(err.to_string().contains("t-m.state"), "{err}");
        assert_eq!(std::fs::read(&theirs).unwrap(), b"theirs");
        // The master's file, created before, is gone.
        assert!(!root.join("t-master.state").exists());
        let link = root.join("link");
        std::os::unix::fs::symlink(&root, &link).unwrap();
        let err = create(&[link], "u").err().expect("refused");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A filesystem that refuses `O_DIRECT` (tmpfs before Linux 6.6: /dev/shm here) is
    /// read and written through the page cache, as is every transfer once one direct
    /// transfer was refused, with the same results.
    #[test]
    fn the_page_cache_path_reads_what_it_wrote() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let dir = shm.join(format!("mt-nvme-tmpfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = create(std::slice::from_ref(&dir), "t").unwrap();
        let n = layout().blocks[0].len;
        for refused in [false, true] {
            if refused {
                d.refused(&dir);
                assert!(!d.direct());
            }
            let want: Vec<f32> = (0..n).map(|i| i as f32 + f32::from(refused)).collect();
            let mut win = d.new_window();
            let WinBuf::F32(x) = &mut win.v else {
                unreachable!()
            };
            x.as_mut_slice()[..n].copy_from_slice(&want);
            d.write(0, 0..n, &mut win, &[Slot::V]).unwrap();
            d.sync().unwrap();
            let mut back = d.new_window();
            d.read(0, 0..n, &mut back, &[Slot::V]).unwrap();
            let WinBuf::F32(y) = &back.v else {
                unreachable!()
            };
            assert_eq!(y.as_slice()[..n], want[..]);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
