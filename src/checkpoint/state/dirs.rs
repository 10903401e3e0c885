//! The checkpoints under `checkpoint.dir`: which are complete and which can be resumed,
//! what `--resume` names, pruning to `checkpoint.keep_last`, and the temporary directories
//! of writers that died.

use std::path::{Path, PathBuf};

use super::{LEGACY_TMP_PREFIX, MARKER, OPTIMIZER, STATE, io};
use crate::checkpoint::atomic::{self, TMP_INFIX};
use crate::checkpoint::manifest::Manifest;
use crate::error::{Error, Result};

/// Removes the temporary directories under `root` that writers of this project left when
/// they died mid-write: `.mt-tmp-*` directories whose owner record (or manifest) names a
/// writer known to be gone ([`crate::checkpoint::owner::Owner::is_dead`]), and an earlier
/// version's `.tmp-*-PID` directories holding checkpoint files whose pid is gone. Nothing
/// else is touched: not a live or another host's writer's, not an entry without our
/// record, not a link.
pub fn remove_stale(root: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry.map_err(io(root))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !atomic::is_real_dir(&path) {
            continue;
        }
        if name.starts_with(TMP_INFIX) {
            let owner = atomic::read_owner(&path).or_else(|| {
                let m = Manifest::read(&path, MARKER).ok().flatten();
                m.map(|m| m.owner)
            });
            if let Some(owner) = owner.filter(|o| o.is_dead()) {
                tracing::info!("removing {}, left by {}", path.display(), owner.describe());
                atomic::remove_ours(&path)?;
            }
            continue;
        }
        let pid = name
            .strip_prefix(LEGACY_TMP_PREFIX)
            .and_then(|n| n.rsplit('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        let ours = [STATE, MARKER, OPTIMIZER]
            .iter()
            .any(|f| std::fs::symlink_metadata(path.join(f)).is_ok_and(|m| m.is_file()));
        if let Some(pid) = pid
            && ours
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            std::fs::remove_dir_all(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Complete checkpoints under `root`, oldest first.
pub fn complete(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(Error::io(root, e)),
    };
    for entry in entries {
        let path = entry.map_err(io(root))?.path();
        let step = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(step) = step
            && path.join(MARKER).is_file()
        {
            found.push((step, path));
        }
    }
    found.sort();
    Ok(found)
}

/// Whether complete checkpoint `dir` holds the optimizer state (can be resumed).
pub fn resumable(dir: &Path) -> bool {
    dir.join(OPTIMIZER).is_file()
}

/// Deletes the oldest complete checkpoints so that at most `keep` remain (at least one),
/// besides the newest one that can be resumed, which is always kept.
pub fn prune(root: &Path, keep: usize) -> Result<()> {
    let all = complete(root)?;
    let newest_full = all
        .iter()
        .rev()
        .find(|(_, p)| resumable(p))
        .map(|(s, _)| *s);
    let excess = all.len().saturating_sub(keep.max(1));
    for (step, path) in &all[..excess] {
        if Some(*step) != newest_full {
            // Renamed first (atomic), so that a process killed mid-delete leaves a
            // temporary directory that `remove_stale` clears (its owner record, or its
            // manifest, which goes last), never a `step-N` directory half deleted.
            let doomed = root.join(atomic::temp_name(""));
            atomic::rename_noreplace(path, &doomed)?;
            atomic::remove_ours(&doomed)?;
        }
    }
    Ok(())
}

/// `latest` (the newest complete checkpoint under `root` that holds the optimizer state)
/// or a checkpoint directory. A writer's temporary directory (`.tmp-…`, `.mt-tmp-…`) is
/// refused, not touched: resolve before any clean-up, which may delete it.
pub fn resolve(spec: &str, root: Option<&Path>) -> Result<PathBuf> {
    if spec == "latest" {
        let root = root.ok_or_else(|| {
            Error::invalid("checkpoint.dir", "--resume latest needs checkpoint.dir (with training.save_model: false there is no default)")
        })?;
        let all = complete(root)?;
        let found = all.iter().rev().find(|(_, p)| resumable(p));
        return found.map(|(_, p)| p.clone()).ok_or_else(|| Error::Weights {
            path: root.into(),
            msg: match all.len() {
                0 => "no complete checkpoint to resume from".into(),
                n => format!(
                    "no complete checkpoint to resume from: the {n} there are model-only (checkpoint.save_optimizer: false, or between checkpoint.full_state_every_steps)"
                ),
            },
        });
    }
    let dir = PathBuf::from(spec);
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.starts_with(LEGACY_TMP_PREFIX) || name.starts_with(".mt-tmp-") {
        let whole = match dir.join(MARKER).is_file() {
            true => format!(
                " (it holds a {MARKER} marker: if the write only missed its rename, copy it to a step-NNNNNNNN directory and resume that)"
            ),
            false => String::new(),
        };
        return Err(Error::Weights {
            path: dir,
            msg: format!(
                "an interrupted checkpoint write, not a checkpoint: --resume takes a step-NNNNNNNN directory or `latest`; it is left as it is{whole}"
            ),
        });
    }
    if !dir.is_dir() {
        return Err(Error::Weights {
            path: dir,
            msg: "no such checkpoint directory (--resume or training.resume_from_checkpoint: a step-NNNNNNNN directory or `latest`)".into(),
        });
    }
    if !dir.join(MARKER).is_file() {
        return Err(Error::Weights {
            path: dir,
            msg: format!(
                "not a complete checkpoint (no {MARKER} marker): it was interrupted while being written, or is not a checkpoint"
            ),
        });
    }
    Ok(dir)
}
