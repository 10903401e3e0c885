//! Shared-memory regions: the weight store, the gradient slabs, the frozen vision tower.
//!
//! Why memfd + memmap2 rather than the `shared_memory` crate or /dev/shm files: a memfd has
//! no name in any filesystem, so nothing can outlive the run. The kernel frees it when the
//! last process holding the fd or a mapping exits, whatever the exit (`kill -9` included).
//! The launcher creates each region with `MFD_CLOEXEC`, clears that flag for exactly the
//! fds a worker needs in the child between fork and exec ([`keep_fds_across_exec`]), and
//! the worker adopts them by number ([`Region::from_inherited_fd`]). memfd pages are
//! shmem pages like /dev/shm's, so CUDA host registration works on them the same way.
//!
//! Every region starts with a 4 KiB header (magic, format version, kind, payload size)
//! that the opening side checks; the payload is page-aligned.
//!
//! Concurrency: the regions are shared mutable memory between processes. Who may write
//! which bytes when is fixed by the protocol (`protocol.rs`): the launcher writes the store
//! only between steps; a worker writes a slab slot only while it owns it. The accessors are
//! therefore `unsafe` and their callers state which rule makes them sound.

pub mod aligned;
pub mod host;
pub mod huge;
pub mod lent;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use memmap2::MmapRaw;
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::elem::Pod;
use crate::error::{Error, Result};

pub const HEADER_LEN: usize = 4096;
const MAGIC: [u8; 8] = *b"MTSHMv01";
const VERSION: u32 = 1;

/// What a region holds; checked by the opening side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[repr(u32)]
pub enum RegionKind {
    Store = 1,
    GradSlab = 2,
    /// The launcher's gradient accumulator, read by workers holding resident blocks.
    GradAcc = 3,
    /// Resident blocks' state on its way between the launcher and a worker.
    Transfer = 4,
    /// The frozen vision tower's weights, written once before the workers start
    /// (`checkpoint::vision`), read-only after.
    Vision = 5,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Header {
    magic: [u8; 8],
    version: u32,
    kind: u32,
    payload_len: u64,
}

/// A mapped shared-memory region (header + payload).
pub struct Region {
    name: String,
    file: File,
    map: MmapRaw,
    payload_len: usize,
}

/// What a worker needs to adopt a region it inherited.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RegionHandle {
    pub name: String,
    pub fd: RawFd,
    pub kind: RegionKind,
    pub payload_len: usize,
}

impl Region {
    /// Creates a zero-filled region of `payload_len` bytes.
    pub fn create(name: &str, kind: RegionKind, payload_len: usize) -> Result<Region> {
        let err = |msg: String| Error::Shm {
            name: name.into(),
            msg,
        };
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC)
            .map_err(|e| err(format!("memfd_create failed: {e}")))?;
        let file = File::from(fd);
        let total = HEADER_LEN + payload_len;
        file.set_len(total as u64)
            .map_err(|e| err(format!("cannot size to {total} bytes: {e}")))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| err(format!("mmap failed: {e}")))?;
        let header = Header {
            magic: MAGIC,
            version: VERSION,
            kind: kind as u32,
            payload_len: payload_len as u64,
        };
        // SAFETY: the mapping is at least HEADER_LEN bytes and page-aligned; nobody else
        // has the fd yet.
        unsafe { std::ptr::write(map.as_mut_ptr() as *mut Header, header) };
        Ok(Region {
            name: name.into(),
            file,
            map,
            payload_len,
        })
    }

    /// Adopts a region whose fd this process inherited, checking its header.
    ///
    /// # Safety
    /// `handle.fd` must be an open fd this process owns and nothing else will close; it is
    /// taken over (closed when the region drops).
    pub unsafe fn from_inherited_fd(handle: &RegionHandle) -> Result<Region> {
        let err = |msg: String| Error::Shm {
            name: handle.name.clone(),
            msg,
        };
        // SAFETY: the caller guarantees we own the fd.
        let file = unsafe { File::from_raw_fd(handle.fd) };
        let size = file
            .metadata()
            .map_err(|e| err(format!("fd {} is not usable: {e}", handle.fd)))?
            .len() as usize;
        if size < HEADER_LEN + handle.payload_len {
            return Err(err(format!(
                "is {size} bytes, expected {}",
                HEADER_LEN + handle.payload_len
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| err(format!("mmap failed: {e}")))?;
        // SAFETY: the mapping holds at least HEADER_LEN bytes (checked above).
        let h = unsafe { std::ptr::read(map.as_ptr() as *const Header) };
        if h.magic != MAGIC || h.version != VERSION {
            return Err(err(format!(
                "bad header (magic {:?}, version {}): not a megatrain region of format {VERSION}",
                h.magic, h.version
            )));
        }
        if h.kind != handle.kind as u32 || h.payload_len as usize != handle.payload_len {
            return Err(err(format!(
                "header says kind {} with {} bytes, expected {:?} with {}",
                h.kind, h.payload_len, handle.kind, handle.payload_len
            )));
        }
        Ok(Region {
            name: handle.name.clone(),
            file,
            map,
            payload_len: handle.payload_len,
        })
    }

    pub fn handle(&self, kind: RegionKind) -> RegionHandle {
        RegionHandle {
            name: self.name.clone(),
            fd: self.file.as_raw_fd(),
            kind,
            payload_len: self.payload_len,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Start of the payload (page-aligned).
    pub fn payload_ptr(&self) -> *mut u8 {
        // SAFETY: HEADER_LEN is inside the mapping.
        unsafe { self.map.as_mut_ptr().add(HEADER_LEN) }
    }

    /// The payload viewed as `[T]`, elements `range`.
    ///
    /// # Safety
    /// No other thread or process may write these elements while the slice lives.
    pub unsafe fn slice<T: Pod>(&self, range: std::ops::Range<usize>) -> &[T] {
        self.check::<T>(&range);
        // SAFETY: bounds checked; aliasing is the caller's obligation.
        unsafe {
            std::slice::from_raw_parts(
                (self.payload_ptr() as *const T).add(range.start),
                range.len(),
            )
        }
    }

    /// The payload viewed as `&mut [T]`, elements `range`.
    ///
    /// # Safety
    /// No other thread or process may read or write these elements while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T: Pod>(&self, range: std::ops::Range<usize>) -> &mut [T] {
        self.check::<T>(&range);
        // SAFETY: bounds checked; exclusivity is the caller's obligation.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.payload_ptr() as *mut T).add(range.start),
                range.len(),
            )
        }
    }

    fn check<T>(&self, range: &std::ops::Range<usize>) {
        assert!(
            range.start <= range.end && range.end * std::mem::size_of::<T>() <= self.payload_len,
            "region `{}`: elements {range:?} of {} bytes each exceed the {}-byte payload",
            self.name,
            std::mem::size_of::<T>(),
            self.payload_len
        );
    }
}

/// The bytes of an f32 slice, little-endian (every platform we build for), for writing
/// tensors without a copy.
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    const { assert!(cfg!(target_endian = "little")) };
    // SAFETY: f32 has no padding and any byte may be read as u8; the length covers exactly
    // the slice, and the borrow keeps it alive.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// Maps a file read-only (model weights).
pub fn map_readonly(path: &std::path::Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only and private to this process; a concurrent writer of
    // the file could change the bytes we read, which we accept for input files.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// Makes `fds` survive `exec` in the child spawned by `cmd` (they are created close-on-exec
/// so that no other child inherits them).
pub fn keep_fds_across_exec(cmd: &mut Command, fds: Vec<RawFd>) {
    // SAFETY: the closure runs between fork and exec and only calls fcntl, which is
    // async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_write_reopen_check_header() {
        let r = Region::create("mt-test-region", RegionKind::Store, 1 << 16).unwrap();
        // SAFETY: single-threaded test, no other view.
        unsafe { r.slice_mut::<f32>(0..4) }.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        let dup = nix::unistd::dup(&r.file).unwrap();
        let mut h = r.handle(RegionKind::Store);
        h.fd = std::os::fd::IntoRawFd::into_raw_fd(dup);
        // SAFETY: we own the duplicated fd.
        let r2 = unsafe { Region::from_inherited_fd(&h) }.unwrap();
        // SAFETY: no writer while we read.
        assert_eq!(unsafe { r2.slice::<f32>(0..4) }, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r2.payload_ptr() as usize % 4096, 0);

        let dup = nix::unistd::dup(&r.file).unwrap();
        let mut wrong = r.handle(RegionKind::GradSlab);
        wrong.fd = std::os::fd::IntoRawFd::into_raw_fd(dup);
        // SAFETY: we own the duplicated fd.
        let e = unsafe { Region::from_inherited_fd(&wrong) }.err().unwrap();
        assert!(e.to_string().contains("expected GradSlab"), "{e}");
    }

    #[test]
    #[should_panic(expected = "exceed")]
    fn out_of_bounds_view_panics() {
        let r = Region::create("mt-test-oob", RegionKind::Store, 16).unwrap();
        // SAFETY: never reached past the bounds check.
        let _ = unsafe { r.slice::<f32>(0..5) };
    }
}
