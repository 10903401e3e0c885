//! The `dataset` section: where the training data comes from and how it becomes token rows.
//!
//! A dataset is either a file (`path`, with `format`) or one or more names registered in
//! `dataset_dir/dataset_info.json` (LlamaFactory's registry: `file_name`, `formatting`,
//! `columns`, `tags`). Text formats (`alpaca`, `sharegpt`) are rendered with the model's chat
//! template and tokenized with its `tokenizer.json`; `tokenized` rows are used as they are.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSection {
    /// On-disk format of `path`. With `name`, the registry's `formatting` decides.
    #[serde(default)]
    pub format: Option<DatasetFormat>,
    /// A dataset file (JSON array or JSONL). Exactly one of `path` and `name` is given.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Dataset name(s) in `dataset_dir/dataset_info.json`, comma-separated to concatenate.
    #[serde(default)]
    pub name: Option<String>,
    /// Directory holding `dataset_info.json` and the files it names.
    #[serde(default = "default_dataset_dir")]
    pub dataset_dir: PathBuf,
    /// Shuffle rows each epoch (seeded by `training.seed`); false keeps file order and
    /// step k takes the next `batch_size` rows, wrapping around.
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// Longest row in tokens (None: no limit); see `overlong`.
    #[serde(default)]
    pub max_seq_len: Option<usize>,
    /// What a sample longer than `max_seq_len` gets: `truncate` (cut at the end; a sample
    /// left without a trained token is skipped) or `skip`.
    #[serde(default)]
    pub overlong: Overlong,
    /// System prompt for samples that carry none (text formats).
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Alpaca column of the user's prompt, for `path` datasets (default `instruction`).
    #[serde(default)]
    pub query_field: Option<String>,
    /// Alpaca column of the answer, for `path` datasets (default `output`).
    #[serde(default)]
    pub response_field: Option<String>,
    /// Train on every token (prompt included), not only on the assistant turns.
    #[serde(default)]
    pub train_on_prompt: bool,
    /// Pack samples into rows of `max_seq_len` tokens; positions restart and attention
    /// stays inside each sample.
    #[serde(default)]
    pub packing: bool,
    /// Bad records are errors naming file, line and field (default: skipped and counted).
    #[serde(default)]
    pub strict: bool,
    /// Threads that tokenize (0: every core).
    #[serde(default)]
    pub num_workers: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    /// JSONL, one object per line: `input_ids` and optional `labels` (-100 = ignored).
    Tokenized,
    /// Records with instruction / input / output (+ system, history) columns.
    Alpaca,
    /// Records with a list of messages (`from`/`value` or `role`/`content`).
    Sharegpt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    #[default]
    Truncate,
    Skip,
}

fn default_dataset_dir() -> PathBuf {
    PathBuf::from("data")
}

fn default_true() -> bool {
    true
}

impl DatasetSection {
    /// Checks that the source is given once and the values make sense; names the key.
    pub fn validate(&self) -> Result<()> {
        match (&self.path, &self.name) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "dataset.name",
                    "give either dataset.path or dataset.name, not both",
                ));
            }
            (None, None) => {
                return Err(Error::invalid(
                    "dataset.path",
                    "missing: give dataset.path (a file) or dataset.name (in dataset_dir/dataset_info.json)",
                ));
            }
            (None, Some(_)) if self.format.is_some() => {
                return Err(Error::invalid(
                    "dataset.format",
                    "comes from the registry's `formatting` with dataset.name; give it only with dataset.path",
                ));
            }
            _ => {}
        }
        if self.max_seq_len == Some(0) {
            return Err(Error::invalid("dataset.max_seq_len", "must be > 0"));
        }
        if self.packing && self.max_seq_len.is_none() {
            return Err(Error::invalid(
                "dataset.packing",
                "needs dataset.max_seq_len (the packed row length)",
            ));
        }
        let columns = self.query_field.is_some() || self.response_field.is_some();
        let alpaca_file = self.name.is_none()
            && self.format.unwrap_or(DatasetFormat::Alpaca) == DatasetFormat::Alpaca;
        if columns && !alpaca_file {
            return Err(Error::invalid(
                "dataset.query_field",
                "applies to alpaca-format files given by dataset.path",
            ));
        }
        Ok(())
    }
}
