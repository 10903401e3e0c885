//! The checkpoints under `checkpoint.dir`: which are complete and which can be resumed,
//! what `--resume` names, pruning to `checkpoint.keep_last`, and the temporary directories
//! of writers that died.

use std::path::{Path, PathBuf};

use super::{MARKER, OPTIMIZER, TMP_PREFIX, io};
use crate::error::{Error, Result};

/// Removes temporary directories under `root` left by writers that died mid-write (their
/// process is gone); a live writer's are kept.
pub fn remove_stale(root: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry.map_err(io(root))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let pid = name
            .strip_prefix(TMP_PREFIX)
            .and_then(|n| n.rsplit('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
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
            // temporary directory that `remove_stale` clears, never a `step-N` directory
            // half deleted.
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("step");
            let doomed = root.join(format!("{TMP_PREFIX}pruned-{name}-{}", std::process::id()));
            std::fs::rename(path, &doomed).map_err(io(path))?;
            std::fs::remove_dir_all(&doomed).map_err(io(&doomed))?;
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
            Error::invalid("checkpoint.dir", "--resume latest needs checkpoint.dir")
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
    if name.starts_with(TMP_PREFIX) || name.starts_with(".mt-tmp-") {
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
            msg: "no such checkpoint directory".into(),
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
