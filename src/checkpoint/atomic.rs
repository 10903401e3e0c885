//! Atomic-file primitives: every file and directory a run writes is created through here.
//!
//! - Files are created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC`, mode
//!   0644): a name that exists, a symbolic link planted under it included (dangling or
//!   not), is an error, never followed nor truncated ([`create_new`], [`write_new`]).
//! - Temporary directories get an unpredictable name (64 random bits) and are made by
//!   `mkdir`, which fails on any existing entry: an existing path is never reused
//!   ([`temp_dir`]). Each holds an owner record ([`OWNER_FILE`]) from its first instant, so
//!   clean-up recognizes what this project wrote ([`read_owner`]).
//! - A directory is put in place by `renameat2(RENAME_NOREPLACE)` where its name is free
//!   ([`rename_noreplace`]), or swapped with the one there by `renameat2(RENAME_EXCHANGE)`
//!   ([`exchange`]): at every instant the name holds the old or the new entry.
//!   Filesystems that refuse `renameat2` (`EINVAL`: some network and FUSE filesystems)
//!   get a portable fallback: a no-replace rename checks that the name is free and then
//!   renames (a racing creator in between is not detected), and an exchange renames the old
//!   entry aside and the new one in (two renames: for an instant the name is absent; the
//!   export's journal lets [`super::export::recover_export`] finish either way).
//! - Files and directories are fsynced by [`fsync`] before a marker says they are
//!   complete, and the parent after a rename.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
use rand::Rng;

use super::manifest::{CHECKPOINT_MARKER, EXPORT_MARKER};
use super::owner::Owner;
use crate::error::{Error, Result};

/// The owner record inside every temporary directory a run creates.
pub const OWNER_FILE: &str = ".mt-owner.json";
/// The infix of temporary directories: `<prefix>.mt-tmp-<16 hex digits>`.
pub const TMP_INFIX: &str = ".mt-tmp-";

/// Creates `path` exclusively for writing: fails if any entry is there (a link included).
pub fn create_new(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, e))
}

/// Creates `path` exclusively with `bytes`, fsynced; returns the bytes' CRC32C.
pub fn write_new(path: &Path, bytes: &[u8]) -> Result<u32> {
    let mut file = create_new(path)?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::io(path, e))?;
    Ok(crc32c::crc32c(bytes))
}

/// Opens `path` for reading without following a link at its last component.
pub fn open_nofollow(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Fsyncs file or directory `path` (not through a link).
pub fn fsync(path: &Path) -> Result<()> {
    open_nofollow(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(path, e))
}

/// A new directory `<parent>/<prefix>.mt-tmp-<random>` (mode 0755) holding this run's
/// [`OWNER_FILE`]; `parent` is created if needed.
pub fn temp_dir(parent: &Path, prefix: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let mut tries = 0;
    let dir = loop {
        let dir = parent.join(temp_name(prefix));
        match std::fs::DirBuilder::new().mode(0o755).create(&dir) {
            Ok(()) => break dir,
            // 64 random bits collide only with a planted name: draw again.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 8 => tries += 1,
            Err(e) => return Err(Error::io(&dir, e)),
        }
    };
    let owner = serde_json::to_vec_pretty(Owner::this_run()).expect("an owner serializes");
    write_new(&dir.join(OWNER_FILE), &owner)?;
    Ok(dir)
}

/// `<prefix>.mt-tmp-<16 random hex digits>` (a name only: nothing is created).
pub fn temp_name(prefix: &str) -> String {
    format!("{prefix}{TMP_INFIX}{:016x}", rand::rng().random::<u64>())
}

/// The owner recorded in directory `dir` ([`OWNER_FILE`]), if it holds a readable one.
pub fn read_owner(dir: &Path) -> Option<Owner> {
    let file = open_nofollow(&dir.join(OWNER_FILE)).ok()?;
    serde_json::from_reader(std::io::BufReader::new(file)).ok()
}

/// Whether `path` is a directory itself (not a link to one).
pub fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// Whether an entry (of any kind, a dangling link included) is at `path`.
pub fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Renames `from` to `to`, failing if `to` exists (see the module docs for filesystems
/// without `renameat2`).
pub fn rename_noreplace(from: &Path, to: &Path) -> Result<()> {
    match renameat2(AT_FDCWD, from, AT_FDCWD, to, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(()),
        Err(Errno::EINVAL | Errno::ENOSYS) => {
            if exists(to) {
                return Err(Error::io(to, std::io::ErrorKind::AlreadyExists.into()));
            }
            std::fs::rename(from, to).map_err(|e| Error::io(to, e))
        }
        Err(e) => Err(Error::io(to, e.into())),
    }
}

/// Swaps `a` and `b` atomically (`RENAME_EXCHANGE`). Returns false where the filesystem
/// refuses the exchange (nothing was changed): the caller then renames aside and in.
pub fn exchange(a: &Path, b: &Path) -> Result<bool> {
    match renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => Ok(true),
        Err(Errno::EINVAL | Errno::ENOSYS) => Ok(false),
        Err(e) => Err(Error::io(b, e.into())),
    }
}

/// Deletes directory `dir` that this project wrote (a temporary directory, a pruned or
/// replaced checkpoint): every other entry first, then its manifest, the owner record
/// last, so that a process killed meanwhile leaves a directory still recognizably ours.
/// Links inside are removed, never followed.
pub fn remove_ours(dir: &Path) -> Result<()> {
    if std::fs::symlink_metadata(dir).is_ok_and(|m| !m.is_dir()) {
        // A link (or file) planted where ours was expected: only the entry goes.
        return std::fs::remove_file(dir).map_err(|e| Error::io(dir, e));
    }
    let last = [CHECKPOINT_MARKER, EXPORT_MARKER, OWNER_FILE];
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if last.iter().any(|n| entry.file_name() == *n) {
            continue;
        }
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| Error::io(&path, e))?;
        if kind.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .map_err(|e| Error::io(&path, e))?;
    }
    for name in last {
        let p = dir.join(name);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&p, e)),
            _ => {}
        }
    }
    std::fs::remove_dir(dir).map_err(|e| Error::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn planted_links_are_never_followed() {
        let dir = scratch("links");
        let target = dir.join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let dangling = dir.join("dangling");
        std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
        for p in [&link, &dangling, &target] {
            let e = write_new(p, b"new").unwrap_err().to_string();
            assert!(e.contains(&p.display().to_string()), "{e}");
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert!(
            !dir.join("nowhere").exists(),
            "a dangling link was followed"
        );
        let crc = write_new(&dir.join("fresh"), b"123456789").unwrap();
        // CRC32C check value (RFC 3720 B.4).
        assert_eq!(crc, 0xe306_9283);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temp_dirs_are_fresh_and_owned_and_renames_never_replace() {
        let dir = scratch("tmp");
        let a = temp_dir(&dir, ".out").unwrap();
        let b = temp_dir(&dir, ".out").unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with(".out.mt-tmp-") && name.len() == 12 + 16,
            "{name}"
        );
        assert_eq!(read_owner(&a).as_ref(), Some(Owner::this_run()));
        std::fs::write(a.join("x"), b"a").unwrap();
        std::fs::write(b.join("x"), b"b").unwrap();
        let e = rename_noreplace(&a, &b).unwrap_err().to_string();
        assert!(e.contains(&b.display().to_string()), "{e}");
        assert!(exchange(&a, &b).unwrap(), "tmpfs and ext4 exchange");
        assert_eq!(std::fs::read(a.join("x")).unwrap(), b"b");
        assert_eq!(std::fs::read(b.join("x")).unwrap(), b"a");
        let c = dir.join("c");
        rename_noreplace(&a, &c).unwrap();
        assert!(!exists(&a) && c.join("x").is_file());
        std::fs::create_dir_all(c.join("sub")).unwrap();
        std::os::unix::fs::symlink(&dir, c.join("sub/up")).unwrap();
        remove_ours(&c).unwrap();
        assert!(
            !exists(&c) && b.join("x").is_file(),
            "the link inside was not followed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
