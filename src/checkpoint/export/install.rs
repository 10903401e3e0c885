//! Putting a complete export in place of the output directory, and finishing or undoing
//! one that a killed run left half way ([`recover_export`]).
//!
//! The new export is complete in its temporary directory `T` (`<parent>/.<name>.mt-tmp-*`,
//! with this run's [`OWNER_FILE`] and the manifest [`EXPORT_MARKER`]). Where the output
//! `O` does not exist, `T` is renamed to `O` without replacing. Otherwise a journal
//! ([`JOURNAL`]: the owner and the names the old directory will have) is written into `T`,
//! `T` and `O` are exchanged (`RENAME_EXCHANGE`; where the filesystem refuses it, `O` is
//! renamed aside to a fresh name and `T` renamed in), and the old directory's entries that
//! are not part of an export are moved back into `O` ([`restore`]): the run's
//! `checkpoints/`, the user's other files; not the old export's files (its manifest lists
//! them), not another model's weights ([`is_weight_file`]), not the names the new export
//! writes. Then the old directory is deleted, and the journal and owner record last.
//!
//! [`recover_export`], called at the start of a run before anything is written, finds the
//! entries a dead writer left: with `O` missing (a fallback exchange cut between its two
//! renames), a complete journalled export is put in place; a journal in `O` names the old
//! directory to restore; an old export of ours set aside (our manifest, no owner record)
//! is restored; a temporary directory with an owner record (an export never put in place,
//! complete or not) is deleted. An entry without our owner record or manifest, or whose
//! writer is alive or ran on another host, is never touched.
//!
//! Test hook: `MT_TEST_EXPORT_PAUSE=<instant>:<flag file>` (`crate::switches::testing`) makes a
//! standalone export create the flag file and sleep when it reaches `<instant>`:
//! `mid-tensor`, `between-files`, `manifest` (before the marker), `rename` (before the
//! rename or exchange), `exchanged` (after the exchange, before the old entries return).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{INDEX, SINGLE};
use crate::checkpoint::atomic::{self, OWNER_FILE, TMP_INFIX};
use crate::checkpoint::manifest::{EXPORT_MARKER, Manifest};
use crate::checkpoint::owner::Owner;
use crate::error::{Error, Result};

/// The journal of an exchange in flight, inside the new export.
pub const JOURNAL: &str = ".mt-exchange.json";

#[derive(Debug, Serialize, Deserialize)]
struct Journal {
    owner: Owner,
    /// Names (in the parent) the old directory may have: the temporary directory's (after
    /// an exchange) or the fallback's.
    aside: Vec<String>,
}

/// Whether `name` is a weight file of a model directory (which an export replaces).
pub fn is_weight_file(name: &str) -> bool {
    name == SINGLE
        || name == INDEX
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
        || (name.starts_with("pytorch_model")
            && (name.ends_with(".bin") || name.ends_with(".json")))
}

/// `out`, or where it points if it is a link.
pub(super) fn resolve(out: &Path) -> Result<PathBuf> {
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::canonicalize(out).map_err(|e| Error::io(out, e))
        }
        _ => Ok(out.into()),
    }
}

/// The parent directory and the name of `out`.
pub(super) fn split(out: &Path) -> Result<(PathBuf, String)> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::Weights {
            path: out.into(),
            msg: "an output directory needs a UTF-8 final name".into(),
        })?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_string()))
}

/// Puts the complete export `tmp` in place of `out` (see the module docs).
pub(super) fn install(tmp: &Path, out: &Path) -> Result<()> {
    let (parent, name) = split(out)?;
    pause_at("rename");
    if !atomic::exists(out) {
        atomic::rename_noreplace(tmp, out)?;
        atomic::fsync(&parent)?;
        return finish(out);
    }
    if !atomic::is_real_dir(out) {
        return Err(Error::Weights {
            path: out.into(),
            msg: "exists and is not a directory: the export is not written over it".into(),
        });
    }
    let fallback = parent.join(atomic::temp_name(&format!(".{name}")));
    let tmp_name = tmp.file_name().expect("a temporary directory has a name");
    let journal = Journal {
        owner: Owner::this_run().clone(),
        aside: [tmp_name, fallback.file_name().expect("named")]
            .iter()
            .map(|n| n.to_string_lossy().into_owned())
            .collect(),
    };
    let json = serde_json::to_vec_pretty(&journal).expect("a journal serializes");
    atomic::write_new(&tmp.join(JOURNAL), &json)?;
    atomic::fsync(tmp)?;
    let aside = if atomic::exchange(tmp, out)? {
        tmp.to_path_buf()
    } else {
        std::fs::rename(out, &fallback).map_err(|e| Error::io(out, e))?;
        atomic::rename_noreplace(tmp, out)?;
        fallback
    };
    atomic::fsync(&parent)?;
    pause_at("exchanged");
    restore(out, &aside)?;
    finish(out)
}

/// Removes the bookkeeping of an installed export (journal, owner record).
fn finish(out: &Path) -> Result<()> {
    for name in [JOURNAL, OWNER_FILE] {
        let p = out.join(name);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&p, e)),
            _ => {}
        }
    }
    atomic::fsync(out)
}

/// Moves back into `out` (a complete export) the entries of the old directory `aside`
/// that are not part of an export, then deletes `aside`; an entry whose name `out`
/// already holds keeps `aside` in place (named in a warning), so nothing of the user's is
/// ever deleted, except a lock file, which the live run there has taken anew.
fn restore(out: &Path, aside: &Path) -> Result<()> {
    let new = Manifest::read(out, EXPORT_MARKER)?;
    let old = Manifest::read(aside, EXPORT_MARKER).ok().flatten();
    let listed = |m: &Option<Manifest>, n: &str| m.as_ref().is_some_and(|m| m.lists(n));
    let mut kept: Vec<OsString> = Vec::new();
    let entries = std::fs::read_dir(aside).map_err(|e| Error::io(aside, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(aside, e))?;
        let os = entry.file_name();
        let name = os.to_string_lossy();
        let export_part = [EXPORT_MARKER, OWNER_FILE, JOURNAL].contains(&name.as_ref())
            || listed(&old, &name)
            || listed(&new, &name)
            || is_weight_file(&name);
        if export_part {
            continue;
        }
        let dst = out.join(&os);
        if atomic::exists(&dst) {
            // The lock file of a directory inside (the run's `checkpoints/`) is taken anew
            // by the run that recovers: the old one holds only a dead holder's record.
            if !crate::checkpoint::lock::is_lock_file(&name) {
                kept.push(os);
            }
            continue;
        }
        atomic::rename_noreplace(&entry.path(), &dst)?;
    }
    atomic::fsync(out)?;
    if kept.is_empty() {
        atomic::remove_ours(aside)
    } else {
        tracing::warn!(
            "{} keeps {kept:?}, which {} holds too: left for you to sort out",
            aside.display(),
            out.display()
        );
        Ok(())
    }
}

/// Finishes or undoes what a dead writer left of an export to `out` (see the module
/// docs). Call before anything is written there.
pub fn recover_export(out: &Path) -> Result<()> {
    let out = resolve(out)?;
    let (parent, name) = split(&out)?;
    let prefix = format!(".{name}{TMP_INFIX}");
    let entries = match std::fs::read_dir(&parent) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(|e| Error::io(&parent, e))?,
    };
    // Ours, from dead writers: (path, has an owner record, complete and journalled).
    let mut ours = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| Error::io(&parent, e))?.path();
        let ok = path.file_name().and_then(|n| n.to_str());
        if !ok.is_some_and(|n| n.starts_with(&prefix)) || !atomic::is_real_dir(&path) {
            continue;
        }
        let record = atomic::read_owner(&path);
        let manifest = Manifest::read(&path, EXPORT_MARKER).ok().flatten();
        let Some(owner) = record
            .clone()
            .or(manifest.as_ref().map(|m| m.owner.clone()))
        else {
            continue;
        };
        if !owner.is_dead() {
            tracing::info!(
                "{} belongs to {}, not known to be gone: left",
                path.display(),
                owner.describe()
            );
            continue;
        }
        let journalled = manifest.is_some() && atomic::exists(&path.join(JOURNAL));
        ours.push((path, record.is_some(), journalled));
    }
    if !atomic::exists(&out)
        && let Some((path, ..)) = ours.iter().find(|(_, _, j)| *j)
    {
        tracing::warn!("putting the complete export {} in place", path.display());
        atomic::rename_noreplace(path, &out)?;
        atomic::fsync(&parent)?;
    }
    let journal = std::fs::read(out.join(JOURNAL))
        .ok()
        .and_then(|j| serde_json::from_slice::<Journal>(&j).ok())
        .filter(|j| j.owner.is_dead());
    if let Some(j) = journal.filter(|_| atomic::is_real_dir(&out)) {
        for aside in j.aside.iter().map(|a| parent.join(a)) {
            if atomic::is_real_dir(&aside) && aside.file_name() != out.file_name() {
                tracing::warn!(
                    "moving entries of {} back into {}",
                    aside.display(),
                    out.display()
                );
                restore(&out, &aside)?;
            }
        }
        finish(&out)?;
    }
    for (path, record, _) in ours {
        if !atomic::is_real_dir(&path) {
            continue;
        }
        if record {
            tracing::warn!("removing the unfinished export {}", path.display());
            atomic::remove_ours(&path)?;
        } else if atomic::is_real_dir(&out) {
            tracing::warn!("restoring from the replaced export {}", path.display());
            restore(&out, &path)?;
        }
    }
    Ok(())
}

/// The test hook (module docs): pauses here when `MT_TEST_EXPORT_PAUSE` names `instant`.
pub(super) fn pause_at(instant: &str) {
    if let Some(flag) = crate::switches::testing::export_pause(instant) {
        tracing::warn!("MT_TEST_EXPORT_PAUSE: export paused at {instant}");
        let _ = std::fs::write(flag, instant);
        loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    }
}
