//! Where a config's sources are: the benchmark shapes' old names, and the files and
//! directories the config points at, checked before anything reads them.

use std::path::{Path, PathBuf};

use super::RunConfig;
use crate::error::{Error, Result};

/// The benchmark shapes moved from configs/ to configs/bench/ keep their old names (the
/// project's front page has long said `--config configs/qwen_7b.yaml`): a config path that
/// does not exist, whose file name does in `bench/` beside it, is read from there.
pub(super) fn relocated(path: &Path) -> Option<PathBuf> {
    if path.symlink_metadata().is_ok() {
        return None;
    }
    let moved = path
        .parent()
        .unwrap_or(Path::new(""))
        .join("bench")
        .join(path.file_name()?);
    moved.is_file().then_some(moved)
}

impl RunConfig {
    /// The model directory (and with `data`, the dataset files) the config points at
    /// exist: a missing one is named by its key before anything is read. A plan passes
    /// `data: false`: it may size a dataset that lives on another machine.
    pub fn check_sources(&self, data: bool) -> Result<()> {
        let m = &self.model;
        if m.name.is_none() && m.shipped.is_none() {
            let dir = &m.path;
            let what = match (dir.is_dir(), dir.join("config.json").is_file()) {
                (false, _) if dir.exists() => "is not a directory",
                (false, _) => "does not exist",
                (true, false) => "holds no config.json",
                (true, true) => "",
            };
            if !what.is_empty() {
                return Err(Error::invalid(
                    "model.path",
                    format!(
                        "{} {what}: give a Hugging Face model directory (config.json, safetensors, tokenizer) or model.name (a hub id in the local cache)",
                        dir.display()
                    ),
                ));
            }
        }
        if !data {
            return Ok(());
        }
        let ds = &self.dataset;
        for (key, p) in [
            ("dataset.path", &ds.path),
            ("dataset.eval_path", &ds.eval_path),
        ] {
            if let Some(p) = p.as_ref().filter(|p| !p.exists()) {
                return Err(Error::invalid(
                    key,
                    format!(
                        "{} does not exist: give a JSON, JSONL or Parquet file, or a directory written by datasets' save_to_disk",
                        p.display()
                    ),
                ));
            }
        }
        let registry = ds.dataset_dir.join(super::REGISTRY);
        if (ds.name.is_some() || ds.eval_name.is_some()) && !registry.is_file() {
            return Err(Error::invalid(
                "dataset.dataset_dir",
                format!(
                    "{} does not exist: dataset.name and eval_name are looked up in the dataset_dir's dataset_info.json (LlamaFactory's registry); or give dataset.path",
                    registry.display()
                ),
            ));
        }
        Ok(())
    }
}
