//! Whose directories a run writes into: never the model it trains, never files this
//! project did not write (unless told), and one run per directory ([`super::lock`]).
//!
//! Checked before any work ([`claim`] at launch, [`check`] under `--dry-run`):
//! - `training.output_dir` and `checkpoint.dir` may not equal, contain or lie inside
//!   `model.path` (compared resolved: canonical, through links), nor hold a file that one
//!   of `model.path`'s links points to (the HF cache's snapshot files link into `blobs/`).
//! - An existing `training.output_dir` may hold only what this project writes there: the
//!   files its export manifest [`EXPORT_MANIFEST`] lists (`files[].name`), the manifest,
//!   `.mt-*` entries ([`OWNER_FILE`] among them), lock files beside a directory inside it
//!   (`.<name>.mt-lock`), a `checkpoints/` directory holding what `checkpoint.dir` may,
//!   and a TensorBoard `runs/` directory of event files. `checkpoint.dir` may hold
//!   `step-NNNNNNNN` directories with a `COMPLETE` marker (of any version), `.mt-*` and
//!   `.tmp-*` entries, and `runs/`. Anything else is refused, naming up to
//!   [`NAMED`] of them, unless `training.overwrite_output_dir: true`. An absent or empty
//!   directory is fine.
//! - Then the locks, output directory first (a checkpoint directory may lie inside it).
//!
//! Under several nodes only node 0 writes the run's files; the caller claims there only.

use std::path::{Component, Path, PathBuf};

use super::lock::DirLock;
use crate::config::RunConfig;
use crate::error::{Error, Result};

/// The export manifest in an output directory (written by the export).
pub const EXPORT_MANIFEST: &str = "megatrain-export.json";
/// The owner record of a directory this project wrote.
pub const OWNER_FILE: &str = ".mt-owner.json";
/// The default checkpoint directory inside an output directory.
pub const CHECKPOINTS_SUBDIR: &str = "checkpoints";
/// Foreign files a refusal names.
pub const NAMED: usize = 5;

/// `path` resolved: its nearest existing ancestor canonicalized (links followed), the
/// rest appended with `.` and `..` applied lexically. Relative paths start at the working
/// directory.
pub fn resolved(path: &Path) -> PathBuf {
    let abs = match path.is_absolute() {
        true => path.to_path_buf(),
        false => std::env::current_dir().unwrap_or_default().join(path),
    };
    let mut rest = Vec::new();
    let mut base = abs.as_path();
    let canonical = loop {
        if let Ok(c) = base.canonicalize() {
            break c;
        }
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                base = parent;
            }
            // `x/..` of an `x` still to be created (as `create_dir_all` creates it).
            (Some(parent), None) if base.ends_with("..") => {
                rest.push("..".into());
                base = parent;
            }
            _ => break base.to_path_buf(),
        }
    };
    let mut out = canonical;
    for part in rest.iter().rev() {
        for c in Path::new(part).components() {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                c => out.push(c),
            }
        }
    }
    out
}

/// Refuses `dir` (config key `key`) when it equals, contains or lies inside `model`
/// (`model.path`), or holds a file one of `model`'s links points to.
pub fn check_outside_model(dir: &Path, key: &str, model: &Path) -> Result<()> {
    let Ok(m) = model.canonicalize() else {
        // No model directory: nothing of it to overwrite (its loading names the problem).
        return Ok(());
    };
    let d = resolved(dir);
    let how = if d == m {
        Some("is")
    } else if d.starts_with(&m) {
        Some("lies inside")
    } else if m.starts_with(&d) {
        Some("contains")
    } else {
        None
    };
    let refuse = |what: String| {
        Error::invalid(
            key,
            format!(
                "{} {what}: writing there would overwrite or delete the model being trained; give {key} another directory",
                dir.display()
            ),
        )
    };
    if let Some(how) = how {
        return Err(refuse(format!(
            "(resolved: {}) {how} model.path {} (resolved: {})",
            d.display(),
            model.display(),
            m.display()
        )));
    }
    for entry in std::fs::read_dir(&m)
        .map_err(|e| Error::io(&m, e))?
        .flatten()
    {
        let link = entry.file_type().is_ok_and(|t| t.is_symlink());
        if let (true, Ok(target)) = (link, entry.path().canonicalize())
            && target.starts_with(&d)
        {
            return Err(refuse(format!(
                "holds {}, which model.path's {} links to",
                target.display(),
                entry.file_name().to_string_lossy()
            )));
        }
    }
    Ok(())
}

/// The entries of output directory `dir` this project did not write (sorted; empty when
/// `dir` is absent).
pub fn foreign_in_output_dir(dir: &Path) -> Result<Vec<String>> {
    let ours = manifest_files(dir)?;
    let mut foreign = Vec::new();
    for (name, path) in entries(dir)? {
        let ok = ours.contains(&name)
            || name == EXPORT_MANIFEST
            || name.starts_with(".mt-")
            || is_lock_file(&name)
            || (name == "runs" && is_event_dir(&path));
        if ok {
            continue;
        }
        if name == CHECKPOINTS_SUBDIR && path.is_dir() {
            let inner = foreign_in_checkpoint_dir(&path)?;
            foreign.extend(inner.into_iter().map(|n| format!("{name}/{n}")));
            continue;
        }
        foreign.push(name);
    }
    Ok(foreign)
}

/// The entries of checkpoint directory `dir` this project did not write (sorted; empty
/// when `dir` is absent).
pub fn foreign_in_checkpoint_dir(dir: &Path) -> Result<Vec<String>> {
    let mut foreign = Vec::new();
    for (name, path) in entries(dir)? {
        let step = name
            .strip_prefix("step-")
            .is_some_and(|n| n.len() == 8 && n.bytes().all(|b| b.is_ascii_digit()));
        let ok = (step && path.join(super::state::MARKER).is_file())
            || name.starts_with(".mt-")
            || name.starts_with(".tmp-")
            || is_lock_file(&name)
            || (name == "runs" && is_event_dir(&path));
        if !ok {
            foreign.push(name);
        }
    }
    Ok(foreign)
}

/// Refuses `dir` (config key `key`) when it holds `foreign` entries, unless `overwrite`.
fn refuse_foreign(dir: &Path, key: &str, foreign: &[String], overwrite: bool) -> Result<()> {
    if foreign.is_empty() || overwrite {
        return Ok(());
    }
    let mut named = foreign[..foreign.len().min(NAMED)].join(", ");
    if foreign.len() > NAMED {
        named.push_str(&format!(" (and {} more)", foreign.len() - NAMED));
    }
    let what = match key {
        "checkpoint.dir" => {
            "a checkpoint directory holds only the step-NNNNNNNN checkpoints runs of this project write, which it prunes"
        }
        _ => "the export would replace this directory",
    };
    Err(Error::invalid(
        key,
        format!(
            "{} holds files this project did not write: {named}; {what}. Give an empty or new directory, or set training.overwrite_output_dir: true (--set training.overwrite_output_dir=true) to write there anyway (another model's weight files are replaced, other files kept)",
            dir.display()
        ),
    ))
}

/// The ownership checks, then the locks (output directory first): what a launch holds
/// for its whole run. Node 0 of several calls it alone.
pub fn claim(cfg: &RunConfig) -> Result<Vec<DirLock>> {
    let dirs = run_dirs(cfg);
    for (key, dir) in &dirs {
        check_outside_model(dir, key, &cfg.model.path)?;
    }
    let mut locks = Vec::new();
    for (key, dir) in &dirs {
        locks.push(DirLock::acquire(dir, key)?);
    }
    check_contents(cfg, &dirs)?;
    Ok(locks)
}

/// `--dry-run`: the ownership checks, and a line for each directory another run holds.
pub fn check(cfg: &RunConfig) -> Result<Vec<String>> {
    let dirs = run_dirs(cfg);
    for (key, dir) in &dirs {
        check_outside_model(dir, key, &cfg.model.path)?;
    }
    check_contents(cfg, &dirs)?;
    let mut held = Vec::new();
    for (key, dir) in &dirs {
        if let Some(holder) = DirLock::holder(dir, key)? {
            held.push(format!(
                "{key} {} is in use by {holder}: a launch now would be refused",
                dir.display()
            ));
        }
    }
    Ok(held)
}

/// (key, directory) of the run's output and checkpoint directories, in lock order.
fn run_dirs(cfg: &RunConfig) -> Vec<(&'static str, PathBuf)> {
    let out = cfg.training.output_dir.clone();
    let ck = cfg.checkpoint.dir.clone();
    [("training.output_dir", out), ("checkpoint.dir", ck)]
        .into_iter()
        .filter_map(|(k, d)| d.map(|d| (k, d)))
        .collect()
}

fn check_contents(cfg: &RunConfig, dirs: &[(&'static str, PathBuf)]) -> Result<()> {
    let overwrite = cfg.training.overwrite_output_dir;
    for (key, dir) in dirs {
        let foreign = match *key {
            "checkpoint.dir" => foreign_in_checkpoint_dir(dir)?,
            _ => foreign_in_output_dir(dir)?,
        };
        refuse_foreign(dir, key, &foreign, overwrite)?;
    }
    Ok(())
}

/// `dir`'s entries (name, path), sorted; none when it does not exist.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let read = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            return Err(Error::Weights {
                path: dir.into(),
                msg: "is a file, not a directory".into(),
            });
        }
        Err(e) => return Err(Error::io(dir, e)),
    };
    let mut out = Vec::new();
    for entry in read {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        out.push((name, entry.path()));
    }
    out.sort();
    Ok(out)
}

/// The file names output directory `dir`'s export manifest lists (none without one).
fn manifest_files(dir: &Path) -> Result<Vec<String>> {
    let path = dir.join(EXPORT_MANIFEST);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Weights {
        path: path.clone(),
        msg: format!("malformed export manifest: {e}"),
    })?;
    let files = v["files"].as_array().ok_or_else(|| Error::Weights {
        path: path.clone(),
        msg: "export manifest without a `files` list".into(),
    })?;
    Ok(files
        .iter()
        .filter_map(|f| f["name"].as_str().map(String::from))
        .collect())
}

/// `.<name>.mt-lock`: the lock file of a directory beside it.
fn is_lock_file(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".mt-lock")
}

/// A directory of TensorBoard event files only (`logging.report_to: tensorboard`).
fn is_event_dir(dir: &Path) -> bool {
    entries(dir).is_ok_and(|e| {
        e.iter()
            .all(|(n, p)| n.starts_with("events.out.tfevents.") && p.is_file())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-own-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.canonicalize().unwrap()
    }

    #[test]
    fn directories_in_or_around_the_model_are_refused() {
        let root = scratch("model");
        let model = root.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let key = "training.output_dir";
        for (dir, how) in [
            (model.clone(), "is model.path"),
            (model.join("out"), "lies inside model.path"),
            (root.clone(), "contains model.path"),
            (root.join("x/../model/new/deeper"), "lies inside model.path"),
        ] {
            let e = check_outside_model(&dir, key, &model)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains(how), "{}: {e}", dir.display());
        }
        // Through a link that resolves into it.
        let link = root.join("link");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let e = check_outside_model(&link.join("sub"), key, &model)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lies inside model.path"), "{e}");
        // A model whose files link into another directory (the HF cache's blobs/).
        let blobs = root.join("blobs");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(blobs.join("abc"), b"w").unwrap();
        std::os::unix::fs::symlink(blobs.join("abc"), model.join("model.safetensors")).unwrap();
        let e = check_outside_model(&blobs, key, &model)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("links to") && e.contains("model.safetensors"),
            "{e}"
        );
        check_outside_model(&root.join("out"), key, &model).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn only_this_projects_files_are_ours() {
        let root = scratch("foreign");
        let out = root.join("out");
        assert!(foreign_in_output_dir(&out).unwrap().is_empty(), "absent");
        std::fs::create_dir_all(out.join("checkpoints/step-00000002")).unwrap();
        std::fs::write(out.join("checkpoints/step-00000002/COMPLETE"), b"").unwrap();
        std::fs::create_dir_all(out.join("checkpoints/step-00000003")).unwrap();
        std::fs::create_dir_all(out.join("runs")).unwrap();
        std::fs::write(out.join("runs/events.out.tfevents.1.h.2.0"), b"").unwrap();
        for f in [
            "model.safetensors",
            "config.json",
            ".mt-owner.json",
            ".checkpoints.mt-lock",
        ] {
            std::fs::write(out.join(f), b"").unwrap();
        }
        std::fs::write(out.join("notes.txt"), b"mine").unwrap();
        let manifest =
            r#"{"format":1,"owner":{},"files":[{"name":"model.safetensors","size":0,"crc32c":0}]}"#;
        std::fs::write(out.join(EXPORT_MANIFEST), manifest).unwrap();
        let foreign = foreign_in_output_dir(&out).unwrap();
        assert_eq!(
            foreign,
            ["checkpoints/step-00000003", "config.json", "notes.txt"]
        );
        let e = refuse_foreign(&out, "training.output_dir", &foreign, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json, notes.txt") && e.contains("training.overwrite_output_dir"),
            "{e}"
        );
        refuse_foreign(&out, "training.output_dir", &foreign, true).unwrap();
        // More than NAMED are counted.
        let many: Vec<String> = (0..8).map(|i| format!("f{i}")).collect();
        let e = refuse_foreign(&out, "checkpoint.dir", &many, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("f4 (and 3 more)") && !e.contains("f5"), "{e}");
        // A file where a directory is expected.
        let e = foreign_in_checkpoint_dir(&out.join("notes.txt")).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn resolved_follows_links_and_dots() {
        let root = scratch("resolve");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::os::unix::fs::symlink(root.join("a"), root.join("l")).unwrap();
        assert_eq!(resolved(&root.join("l/new/../x")), root.join("a/x"));
        assert_eq!(resolved(&root.join("l")), root.join("a"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
