//! Dataset files and their records: JSON arrays and JSONL text (a record is found by its
//! line), plain text (`.txt`: each non-blank line a document, the record `{"text": line}`
//! as `datasets`' text loader names its column), Parquet files and the directories
//! `datasets.save_to_disk` writes (a record is a table row, counted from 1; see
//! [`super::table`]). Each file is checked by its metadata before it is read: a regular
//! file no larger than half the RAM available ([`bounded::data_bound`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::records::{self, BadRecord, RawRecord};
use super::table;
use crate::bounded;
use crate::error::{Error, Result};

/// What a dataset file is called when it is refused ([`bounded`]).
pub const DATA_FILE: &str = "dataset file";

/// A dataset file's records, read whole.
pub struct FileRecords {
    pub path: PathBuf,
    contents: Contents,
}

enum Contents {
    /// JSON or JSONL text.
    Text(String),
    /// Plain-text documents as `{"text": ...}` records, with their lines.
    Lines(Vec<(usize, String)>),
    /// Table rows as JSON objects.
    Rows(Vec<String>),
}

/// `state.json` of a `save_to_disk` directory: the Arrow files holding its rows, in order.
#[derive(Deserialize)]
struct SavedState {
    #[serde(rename = "_data_files")]
    data_files: Vec<SavedFile>,
}

#[derive(Deserialize)]
struct SavedFile {
    filename: String,
}

impl FileRecords {
    /// Reads `path`: a `.parquet` file, a `.arrow` stream, a `save_to_disk` directory, a
    /// `.txt` file, or JSON / JSONL text.
    pub fn read(path: &Path) -> Result<FileRecords> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let contents = if path.is_dir() {
            Contents::Rows(saved_rows(path)?)
        } else if ext == "parquet" {
            Contents::Rows(table::parquet_rows(path)?)
        } else if ext == "arrow" {
            Contents::Rows(table::arrow_rows(path)?)
        } else if is_plain_text(path) {
            let text = bounded::read_text(path, bounded::data_bound(), DATA_FILE)?;
            Contents::Lines(
                text.lines()
                    .enumerate()
                    .filter(|(_, l)| !l.trim().is_empty())
                    .map(|(i, l)| (i + 1, serde_json::json!({ "text": l }).to_string()))
                    .collect(),
            )
        } else {
            Contents::Text(bounded::read_text(path, bounded::data_bound(), DATA_FILE)?)
        };
        Ok(FileRecords {
            path: path.into(),
            contents,
        })
    }

    /// The records, each with its line (text) or row (tables) number.
    pub fn records(&self) -> Result<Vec<RawRecord<'_>>> {
        match &self.contents {
            Contents::Text(text) => records::split_records(&self.path, text),
            Contents::Lines(lines) => Ok(lines
                .iter()
                .map(|(line, json)| RawRecord { line: *line, json })
                .collect()),
            Contents::Rows(rows) => Ok(rows
                .iter()
                .enumerate()
                .map(|(i, json)| RawRecord { line: i + 1, json })
                .collect()),
        }
    }

    /// The error a bad record makes with `dataset.strict`.
    pub fn error(&self, bad: BadRecord) -> Error {
        match self.contents {
            Contents::Text(_) | Contents::Lines(_) => bad.into_error(&self.path),
            Contents::Rows(_) => Error::DatasetRow {
                path: self.path.clone(),
                row: bad.line,
                msg: format!("field `{}`: {}", bad.field, bad.reason),
            },
        }
    }

    /// Where a bad record is, for the report of skipped records: `file:line` or
    /// `file row N`.
    pub fn locate(&self, bad: &BadRecord) -> String {
        match self.contents {
            Contents::Text(_) | Contents::Lines(_) => {
                format!("{}:{}", self.path.display(), bad.line)
            }
            Contents::Rows(_) => format!("{} row {}", self.path.display(), bad.line),
        }
    }
}

/// A `.txt` file: plain-text documents, one per line.
pub fn is_plain_text(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()) == Some("txt")
}

/// The rows of a directory written by `datasets.save_to_disk`: the Arrow streams that its
/// `state.json` lists, in order.
fn saved_rows(dir: &Path) -> Result<Vec<String>> {
    let bad = |msg: String| Error::DatasetFile {
        path: dir.into(),
        msg,
    };
    let dict = dir.join("dataset_dict.json");
    if dict.is_file() {
        let splits = bounded::read_text(&dict, bounded::SMALL_JSON, DATA_FILE)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| {
                let names = v["splits"].as_array()?.iter();
                Some(
                    names
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect::<Vec<String>>(),
                )
            })
            .unwrap_or_default();
        return Err(bad(format!(
            "is a DatasetDict saved with save_to_disk (splits: {}): point at one split's directory, e.g. {}",
            splits.join(", "),
            dir.join(splits.first().map_or("train", String::as_str))
                .display()
        )));
    }
    let state = dir.join("state.json");
    let text = match bounded::read_text(&state, bounded::SMALL_JSON, DATA_FILE) {
        Err(Error::Io { cause, .. }) => Err(bad(format!(
            "a dataset directory is one written by datasets' save_to_disk, with a state.json ({cause})"
        ))),
        other => other,
    }?;
    let st: SavedState = serde_json::from_str(&text).map_err(|e| Error::DatasetFile {
        path: state.clone(),
        msg: format!("not a save_to_disk state (a `_data_files` list of Arrow files): {e}"),
    })?;
    let mut rows = Vec::new();
    for f in &st.data_files {
        rows.extend(table::arrow_rows(&dir.join(&f.filename))?);
    }
    Ok(rows)
}
