//! The `dataset` section: where the training data comes from and how it becomes token rows.
//!
//! A dataset is either a file (`path`, with `format`) or one or more names registered in
//! `dataset_dir/dataset_info.json` (LlamaFactory's registry: `file_name`, `formatting`,
//! `columns`, `tags`). Text formats (`alpaca`, `sharegpt`) are rendered with the model's chat
//! template and tokenized with its `tokenizer.json`; `tokenized` rows are used as they are.
//! A registry entry may instead name a hub dataset (`hf_hub_url`), read offline from the
//! Hugging Face cache; a `path` may be a JSON / JSONL / Parquet file or a directory that
//! `datasets.save_to_disk` wrote.
//!
//! The eval set is either held out of the training samples (`val_size`, LlamaFactory's
//! key) or read from its own source (`eval_name`, `eval_path`), and becomes rows the same way.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::chat_templates as builtin;
use crate::error::{Error, Result};

/// The registry's file name in `dataset.dataset_dir` (LlamaFactory's `dataset_info.json`).
pub const REGISTRY: &str = "dataset_info.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSection {
    /// Record format of `path` and `eval_path`. With `name`, the registry's `formatting`
    /// decides.
    #[serde(default)]
    pub format: Option<DatasetFormat>,
    /// A dataset file (JSON array, JSONL or Parquet) or a directory written by
    /// `datasets.save_to_disk`. Exactly one of `path` and `name` is given.
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
    /// The chat template that renders conversations, instead of the model's own: a built-in
    /// name (`qwen`, `chatml`, `llama3`, `mistral`, `gemma`, `alpaca`, `default`, rendering
    /// as LlamaFactory's templates of those names) or a Jinja file (relative to the config
    /// file). LlamaFactory's `template` sets it. None: the model's own template.
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
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
    /// Samples held out of the training set for evaluation (LlamaFactory's key): a fraction
    /// in (0, 1) (rounded up, as `datasets`' `train_test_split` does) or a whole number of
    /// samples, chosen at random with `training.seed`.
    #[serde(default)]
    pub val_size: Option<f64>,
    /// At most this many records of each dataset file or registry entry, the first ones
    /// (LlamaFactory's key).
    #[serde(default)]
    pub max_samples: Option<usize>,
    /// Eval dataset name(s) in `dataset_dir/dataset_info.json`, comma-separated.
    #[serde(default)]
    pub eval_name: Option<String>,
    /// An eval dataset file or `save_to_disk` directory, read like `path` (same `format`).
    #[serde(default)]
    pub eval_path: Option<PathBuf>,
}

/// How many samples `dataset.val_size` holds out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValSize {
    /// This part of the samples, rounded up.
    Fraction(f64),
    Count(usize),
}

impl ValSize {
    /// Samples held out of `n`.
    pub fn of(self, n: usize) -> usize {
        match self {
            ValSize::Fraction(f) => (f * n as f64).ceil() as usize,
            ValSize::Count(c) => c,
        }
    }
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
    /// `val_size` checked: a fraction in (0, 1) or a whole number >= 1.
    pub fn val_size(&self) -> Result<Option<ValSize>> {
        let Some(v) = self.val_size else {
            return Ok(None);
        };
        if v > 0.0 && v < 1.0 {
            return Ok(Some(ValSize::Fraction(v)));
        }
        if v >= 1.0 && v.fract() == 0.0 && v <= u32::MAX as f64 {
            return Ok(Some(ValSize::Count(v as usize)));
        }
        Err(Error::invalid(
            "dataset.val_size",
            format!("must be a fraction in (0, 1) or a whole number of samples >= 1, got {v}"),
        ))
    }

    /// An eval set is configured.
    pub fn has_eval_set(&self) -> bool {
        self.val_size.is_some() || self.eval_name.is_some() || self.eval_path.is_some()
    }

    /// A run's training data is named: `dataset.path` or `dataset.name` (checked where the
    /// data is read: a server, `mt-launch serve`, may have none).
    pub fn require_source(&self) -> Result<()> {
        match (&self.path, &self.name) {
            (None, None) => Err(Error::invalid(
                "dataset.path",
                "missing: give dataset.path (a file) or dataset.name (in dataset_dir/dataset_info.json)",
            )),
            _ => Ok(()),
        }
    }

    /// Checks that the source is given at most once and the values make sense; names the
    /// key.
    pub fn validate(&self) -> Result<()> {
        match (&self.path, &self.name) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "dataset.name",
                    "give either dataset.path or dataset.name, not both",
                ));
            }
            (None, Some(_)) if self.format.is_some() && self.eval_path.is_none() => {
                return Err(Error::invalid(
                    "dataset.format",
                    "comes from the registry's `formatting` with dataset.name; give it only with dataset.path or dataset.eval_path",
                ));
            }
            _ => {}
        }
        self.val_size()?;
        if self.val_size.is_some() && (self.eval_name.is_some() || self.eval_path.is_some()) {
            return Err(Error::invalid(
                "dataset.val_size",
                "give either dataset.val_size (held out of the training set) or dataset.eval_name / dataset.eval_path, not both",
            ));
        }
        if self.eval_name.is_some() && self.eval_path.is_some() {
            return Err(Error::invalid(
                "dataset.eval_name",
                "give either dataset.eval_name or dataset.eval_path, not both",
            ));
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
        if let Some(t) = &self.chat_template
            && builtin::named(t).is_none()
            && !t.is_file()
        {
            return Err(Error::invalid(
                "dataset.chat_template",
                format!(
                    "`{}` is neither a built-in template ({}) nor a Jinja file",
                    t.display(),
                    builtin::names()
                ),
            ));
        }
        let columns = self.query_field.is_some() || self.response_field.is_some();
        let alpaca_file = (self.path.is_some() || self.eval_path.is_some())
            && self.format.unwrap_or(DatasetFormat::Alpaca) == DatasetFormat::Alpaca;
        if columns && !alpaca_file {
            return Err(Error::invalid(
                "dataset.query_field",
                "applies to alpaca-format files given by dataset.path or dataset.eval_path",
            ));
        }
        Ok(())
    }
}
