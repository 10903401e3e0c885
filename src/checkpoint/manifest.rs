//! The completion marker of a directory a run writes, and the checksums it holds.
//!
//! An export directory is complete when it holds [`EXPORT_MARKER`]
//! (`megatrain-export.json`), a checkpoint step directory when it holds
//! [`CHECKPOINT_MARKER`] (`COMPLETE`); both are written last and hold the same JSON:
//!
//! ```json
//! {"format": 1, "owner": {"host": "...", "pid": 1, "run_id": "...", "started": 0},
//!  "files": [{"name": "model.safetensors", "size": 1234, "crc32c": "89abcdef"}, ...]}
//! ```
//!
//! `files` lists every file of the directory (flat: no subdirectories) but the marker and
//! [`super::atomic::OWNER_FILE`], sorted by name; `crc32c` is the Castagnoli CRC of the whole
//! file as 8 lowercase hex digits. Other parts of the project read `files[].name` (which
//! entries of an output directory are the export's) and `owner` (who wrote it). An empty
//! `COMPLETE` is the marker of a checkpoint written before manifests existed: accepted,
//! with a warning that it cannot be verified.
//!
//! The CRC of a large file is computed while it is written, at disk speed: each positioned
//! write records the CRC of its piece with its offset ([`PieceCrcs`]), and at the end the
//! pieces, sorted, are combined (`crc32c_combine`) once they are checked to tile the file;
//! where they do not (a write recorded twice, a hole), the file is read back instead.
//! [`verify`] reads every listed file (files in parallel, each sequentially in large reads)
//! and names the first that is missing, of another size or another checksum.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::atomic::{self, OWNER_FILE};
use super::owner::Owner;
use crate::error::{Error, Result};

/// The completion marker of an export directory.
pub const EXPORT_MARKER: &str = "megatrain-export.json";
/// The completion marker of a checkpoint step directory.
pub const CHECKPOINT_MARKER: &str = "COMPLETE";
/// The manifest format this build writes and reads.
pub const FORMAT: u32 = 1;
/// Bytes per read while verifying.
const READ: usize = 8 << 20;

/// A directory's manifest ([`EXPORT_MARKER`] or [`CHECKPOINT_MARKER`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// Who wrote the directory.
    pub owner: Owner,
    /// Every file of the directory but the marker and the owner record, by name.
    pub files: Vec<Entry>,
}

/// One file of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The file's name within the directory.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// CRC32C of the whole file, 8 lowercase hex digits.
    pub crc32c: String,
}

impl Entry {
    pub fn new(name: &str, size: u64, crc: u32) -> Entry {
        Entry {
            name: name.into(),
            size,
            crc32c: format!("{crc:08x}"),
        }
    }
}

/// What [`verify`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// Every listed file has its size and checksum: files, bytes.
    Verified { files: usize, bytes: u64 },
    /// An empty `COMPLETE` (a checkpoint of an earlier version): nothing to check against.
    Unverified,
}

impl Manifest {
    /// This run's manifest of `files` (sorted by name here).
    pub fn new(mut files: Vec<Entry>) -> Manifest {
        files.sort_by(|a, b| a.name.cmp(&b.name));
        Manifest {
            format: FORMAT,
            owner: Owner::this_run().clone(),
            files,
        }
    }

    /// Writes the manifest as `dir/marker` (created exclusively, fsynced) and fsyncs `dir`.
    pub fn write(&self, dir: &Path, marker: &str) -> Result<()> {
        let mut json = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        json.push(b'\n');
        atomic::write_new(&dir.join(marker), &json)?;
        atomic::fsync(dir)
    }

    /// The manifest `dir/marker`: None for an empty marker (an earlier version's
    /// `COMPLETE`); an error naming the file where it is missing or malformed.
    pub fn read(dir: &Path, marker: &str) -> Result<Option<Manifest>> {
        let path = dir.join(marker);
        let mut text = Vec::new();
        atomic::open_nofollow(&path)
            .and_then(|mut f| f.read_to_end(&mut text))
            .map_err(|e| Error::io(&path, e))?;
        if text.is_empty() {
            return Ok(None);
        }
        let m: Manifest = serde_json::from_slice(&text).map_err(|e| Error::Weights {
            path: path.clone(),
            msg: format!("malformed manifest: {e}"),
        })?;
        if m.format != FORMAT {
            return Err(Error::Weights {
                path,
                msg: format!("manifest format {} is not {FORMAT}", m.format),
            });
        }
        if let Some(bad) = m.files.iter().find(|f| !plain_name(&f.name)) {
            return Err(Error::Weights {
                path,
                msg: format!("lists `{}`, not a file name within the directory", bad.name),
            });
        }
        Ok(Some(m))
    }

    /// Whether the manifest lists `name`.
    pub fn lists(&self, name: &str) -> bool {
        self.files.iter().any(|f| f.name == name)
    }
}

/// A name of an entry directly within a directory (no separator, not `.` nor `..`).
fn plain_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && name != "." && name != ".." && name != OWNER_FILE
}

/// The marker `dir` holds: [`EXPORT_MARKER`], else [`CHECKPOINT_MARKER`].
pub fn marker_of(dir: &Path) -> Option<&'static str> {
    [EXPORT_MARKER, CHECKPOINT_MARKER]
        .into_iter()
        .find(|m| std::fs::symlink_metadata(dir.join(m)).is_ok_and(|m| m.is_file()))
}

/// Checks every file `dir`'s manifest lists: present, of its size and its CRC32C. The
/// error names the first bad file and what is wrong with it.
pub fn verify(dir: &Path) -> Result<Checked> {
    let marker = marker_of(dir).ok_or_else(|| Error::Weights {
        path: dir.into(),
        msg: format!(
            "no {EXPORT_MARKER} or {CHECKPOINT_MARKER} manifest: not a complete directory of this project"
        ),
    })?;
    let Some(m) = Manifest::read(dir, marker)? else {
        tracing::warn!(
            dir = %dir.display(),
            "{CHECKPOINT_MARKER} is empty (written by an earlier version): the checkpoint is not verified"
        );
        return Ok(Checked::Unverified);
    };
    m.files.par_iter().try_for_each(|f| check_file(dir, f))?;
    Ok(Checked::Verified {
        files: m.files.len(),
        bytes: m.files.iter().map(|f| f.size).sum(),
    })
}

/// Checks one listed file.
fn check_file(dir: &Path, f: &Entry) -> Result<()> {
    let path = dir.join(&f.name);
    let bad = |msg: String| Error::Weights {
        path: path.clone(),
        msg,
    };
    let file = match atomic::open_nofollow(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad("missing: the manifest lists it".into()));
        }
        r => r.map_err(|e| Error::io(&path, e))?,
    };
    let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
    if len != f.size {
        let what = if len < f.size { "truncated" } else { "size" };
        return Err(bad(format!(
            "{what}: {len} bytes, the manifest says {}",
            f.size
        )));
    }
    let (_, crc) = read_crc(file, &path)?;
    let got = format!("{crc:08x}");
    if got != f.crc32c {
        return Err(bad(format!(
            "checksum mismatch: crc32c {got}, the manifest says {} (the file was changed or corrupted after it was written)",
            f.crc32c
        )));
    }
    Ok(())
}

/// Bytes and CRC32C of an open file, read sequentially from its start.
fn read_crc(mut file: std::fs::File, path: &Path) -> Result<(u64, u32)> {
    let (mut crc, mut n) = (0u32, 0u64);
    let mut buf = vec![0u8; READ];
    loop {
        let got = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if got == 0 {
            return Ok((n, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..got]);
        n += got as u64;
    }
}

/// Bytes and CRC32C of file `path`, read whole.
pub fn file_crc(path: &Path) -> Result<(u64, u32)> {
    let file = atomic::open_nofollow(path).map_err(|e| Error::io(path, e))?;
    read_crc(file, path)
}

/// The CRCs of the pieces of a file written at positions, from any thread.
#[derive(Default)]
pub struct PieceCrcs {
    /// (offset, length, CRC32C) of each piece written.
    pieces: Mutex<Vec<(u64, u64, u32)>>,
}

impl PieceCrcs {
    /// Records that `bytes` were written at `at`.
    pub fn record(&self, at: u64, bytes: &[u8]) {
        let crc = crc32c::crc32c(bytes);
        self.pieces
            .lock()
            .expect("a writer panicked")
            .push((at, bytes.len() as u64, crc));
    }

    /// The CRC32C of file `path` of `len` bytes: the pieces combined where they tile it
    /// exactly, else (logged) the file read back.
    pub fn finish(self, path: &Path, len: u64) -> Result<u32> {
        let mut pieces = self.pieces.into_inner().expect("a writer panicked");
        pieces.sort_unstable();
        let mut at = 0u64;
        let mut crc = 0u32;
        for &(off, n, c) in &pieces {
            if off != at {
                tracing::debug!(
                    file = %path.display(),
                    "written pieces do not tile the file (a gap or an overlap at byte {at}): reading it back for its checksum"
                );
                return Ok(file_crc(path)?.1);
            }
            crc = crc32c::crc32c_combine(crc, c, n as usize);
            at += n;
        }
        if at != len {
            tracing::debug!(file = %path.display(), "written pieces end at byte {at} of {len}: reading it back for its checksum");
            return Ok(file_crc(path)?.1);
        }
        Ok(crc)
    }
}

/// The manifest entry of file `path` (a small file written in one piece).
pub fn entry_of(path: &Path, size: u64, crc: u32) -> Entry {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    Entry::new(&name.unwrap_or_default(), size, crc)
}

/// `dir/name` for each file of `m`.
pub fn paths(dir: &Path, m: &Manifest) -> Vec<PathBuf> {
    m.files.iter().map(|f| dir.join(&f.name)).collect()
}

#[cfg(test)]
mod tests;
