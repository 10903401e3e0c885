//! One run per directory: an exclusive `flock` on a lock file beside `checkpoint.dir` and
//! `training.output_dir`, held for the whole run ([`DirLock`]).
//!
//! The lock file lives in the directory's parent, `<parent>/.<name>.mt-lock`, not inside
//! it: the export replaces the output directory atomically, which would carry a lock file
//! inside it away. It is derived from the directory's resolved path
//! ([`super::ownership::resolved`]), so two spellings of one directory (relative, through
//! a link) take the same lock. It is opened with `O_NOFOLLOW` (never through a link) and
//! holds the holder's [`Owner`] as JSON, so that a second run names it; a clean exit
//! empties it, so a lock file that still names a holder when its `flock` is free was left
//! by a run that died, and the next run says whose it takes over.
//!
//! `flock` locks belong to an open file description: two opens in one process conflict
//! as two processes do, and the kernel drops the lock when its holder dies, `kill -9`
//! included. On NFS, Linux maps `flock` to a POSIX lock on the server.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use super::owner::Owner;
use super::ownership::resolved;
use crate::error::{Error, Result};

/// An exclusive lock on a run's directory, released (and its lock file emptied) on drop.
pub struct DirLock {
    file: Flock<File>,
    path: PathBuf,
    /// The outermost directory [`DirLock::acquire`] created for the lock file, if any.
    created: Option<PathBuf>,
}

impl std::fmt::Debug for DirLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DirLock({})", self.path.display())
    }
}

/// What a lock file's name ends with.
pub const SUFFIX: &str = ".mt-lock";

/// Whether `name` is the name of a lock file of this module.
pub fn is_lock_file(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(SUFFIX)
}

/// `<parent>/.<name>.mt-lock` of directory `dir` (config key `key`), from its resolved path.
pub fn lock_path(dir: &Path, key: &str) -> Result<PathBuf> {
    let full = resolved(dir);
    match (full.parent(), full.file_name().and_then(|n| n.to_str())) {
        (Some(parent), Some(name)) => Ok(parent.join(format!(".{name}{SUFFIX}"))),
        _ => Err(Error::invalid(
            key,
            format!(
                "{}: a run's directory needs a parent and a UTF-8 name (its lock file lives beside it)",
                dir.display()
            ),
        )),
    }
}

impl DirLock {
    /// Takes the lock of `dir` (config key `key`) without waiting: refused, naming the
    /// holder, while another run (or another open in this process) holds it. A lock file
    /// a dead run left is taken over with one line naming it. Creates the parent
    /// directory when missing.
    pub fn acquire(dir: &Path, key: &str) -> Result<DirLock> {
        let path = lock_path(dir, key)?;
        let parent = path.parent().expect("a lock path has a parent");
        // The outermost directory this creates, removed again with the lock when nothing
        // else came to live in it (a run refused at start leaves nothing behind).
        let created = parent
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && std::fs::symlink_metadata(a).is_err())
            .last()
            .map(Path::to_path_buf);
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let file = open(&path, true)?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                return Err(Error::InUse {
                    key: key.into(),
                    path: dir.into(),
                    holder: holder_words(read_owner(&mut file)),
                });
            }
            Err((_, e)) => return Err(Error::io(&path, e.into())),
        };
        if let Some(prev) = read_owner(&mut file).filter(|p| !p.is_this_run()) {
            let how = match prev.is_dead() {
                true => "which is no longer running",
                false => "whose lock was released",
            };
            tracing::warn!(
                "{key} {}: taking over the lock {} left by {} ({how})",
                dir.display(),
                path.display(),
                prev.describe()
            );
        }
        let json = serde_json::to_vec(Owner::this_run()).expect("an owner serializes");
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(&json))
            .and_then(|()| file.sync_data())
            .map_err(|e| Error::io(&path, e))?;
        Ok(DirLock {
            file,
            path,
            created,
        })
    }

    /// Who holds the lock of `dir` now, in words (None: nobody); takes nothing and
    /// creates nothing (`--dry-run`).
    pub fn holder(dir: &Path, key: &str) -> Result<Option<String>> {
        let path = lock_path(dir, key)?;
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let file = open(&path, false)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(_free) => Ok(None),
            Err((mut file, Errno::EWOULDBLOCK)) => Ok(Some(holder_words(read_owner(&mut file)))),
            Err((_, e)) => Err(Error::io(&path, e.into())),
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DirLock {
    /// Empties the lock file while still holding it (a holder recorded there means a run
    /// that died); the lock itself goes with the descriptor.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
        let Some(created) = &self.created else {
            return;
        };
        let parent = self.path.parent().expect("a lock path has a parent");
        let alone = std::fs::read_dir(parent)
            .map(|d| d.flatten().all(|e| e.path() == self.path))
            .unwrap_or(false);
        if alone && std::fs::remove_file(&self.path).is_ok() {
            for dir in parent.ancestors() {
                if std::fs::remove_dir(dir).is_err() || dir == created.as_path() {
                    break;
                }
            }
        }
    }
}

/// Opens lock file `path` for reading and writing (creating it when `create`), never
/// through a symbolic link.
fn open(path: &Path, create: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Error::Weights {
                path: path.into(),
                msg: "is a symbolic link: a lock file is never opened through a link (remove it)"
                    .into(),
            },
            _ => Error::io(path, e),
        })
}

/// The owner a lock file records, if it holds one.
fn read_owner(file: &mut File) -> Option<Owner> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.take(64 * 1024).read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

fn holder_words(owner: Option<Owner>) -> String {
    owner.map_or_else(
        || "another run (its lock file names no holder yet)".into(),
        |o| o.describe(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-lock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_second_open_conflicts_until_the_first_is_dropped() {
        let root = scratch("twice");
        let dir = root.join("ck");
        let first = DirLock::acquire(&dir, "checkpoint.dir").unwrap();
        assert_eq!(
            first.path(),
            root.canonicalize().unwrap().join(".ck.mt-lock")
        );
        let recorded: Owner =
            serde_json::from_str(&std::fs::read_to_string(first.path()).unwrap()).unwrap();
        assert!(recorded.is_this_run());
        // Another spelling of the same directory takes the same lock.
        let again = root.join("x/../ck");
        let e = DirLock::acquire(&again, "checkpoint.dir")
            .unwrap_err()
            .to_string();
        let me = Owner::this_run();
        assert!(
            e.starts_with(&format!(
                "checkpoint.dir {} is in use by pid {}",
                again.display(),
                me.pid
            )) && e.contains(&me.host),
            "{e}"
        );
        let held = DirLock::holder(&dir, "checkpoint.dir").unwrap();
        assert_eq!(held, Some(me.describe()));
        drop(first);
        assert_eq!(DirLock::holder(&dir, "checkpoint.dir").unwrap(), None);
        assert_eq!(
            std::fs::read(root.join(".ck.mt-lock")).unwrap(),
            b"",
            "emptied on release"
        );
        let second = DirLock::acquire(&dir, "checkpoint.dir").unwrap();
        drop(second);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_dead_runs_lock_file_is_taken_over_and_links_are_refused() {
        let root = scratch("stale");
        let dir = root.join("out");
        let dead = Owner {
            pid: 1 << 23,
            ..Owner::this_run().clone()
        };
        let lock = root.join(".out.mt-lock");
        std::fs::write(&lock, serde_json::to_vec(&dead).unwrap()).unwrap();
        assert_eq!(DirLock::holder(&dir, "training.output_dir").unwrap(), None);
        let taken = DirLock::acquire(&dir, "training.output_dir").unwrap();
        let now: Owner = serde_json::from_str(&std::fs::read_to_string(&lock).unwrap()).unwrap();
        assert!(now.is_this_run(), "the new holder is recorded");
        drop(taken);
        // A lock file that is a link is never followed.
        std::fs::remove_file(&lock).unwrap();
        let target = root.join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, &lock).unwrap();
        let e = DirLock::acquire(&dir, "training.output_dir")
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
