//! The library's one error type. Messages are lowercase fragments that read well after
//! "failed to …"; every variant names the file, key, tensor or rank it is about.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cause is part of the message and deliberately not a `source()`: anyhow's `{:#}`
    /// would print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },

    #[error("config key `{key}`: {msg}")]
    InvalidValue { key: String, msg: String },

    #[error("model config {path}: {msg}")]
    ModelConfig { path: PathBuf, msg: String },

    #[error("{path}: tensor `{tensor}`: expected {expected}, found {got}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        expected: String,
        got: String,
    },

    #[error("{path}: {msg}")]
    Weights { path: PathBuf, msg: String },

    #[error("dataset {path}, line {line}: {msg}")]
    Dataset {
        path: PathBuf,
        line: usize,
        msg: String,
    },

    /// A record of a table file (Parquet, Arrow): rows are counted from 1.
    #[error("dataset {path}, row {row}: {msg}")]
    DatasetRow {
        path: PathBuf,
        row: usize,
        msg: String,
    },

    /// A dataset file or directory as a whole.
    #[error("dataset {path}: {msg}")]
    DatasetFile { path: PathBuf, msg: String },

    /// An image file that cannot be decoded ([`crate::data::image::decode`]).
    #[error("image {path}: {msg}")]
    Image { path: PathBuf, msg: String },

    #[error("shared memory region `{name}`: {msg}")]
    Shm { name: String, msg: String },

    /// A file refused before it is read ([`crate::bounded`]): not a regular file, or larger
    /// than the bound the message states. `what` says what the file is for
    /// (`dataset file`, `model config`).
    #[error("{what} {path}: {msg}")]
    Refused {
        what: &'static str,
        path: PathBuf,
        msg: String,
    },

    /// Start-up stopped because a stop was requested ([`crate::cancel`]: the launcher's
    /// SIGINT / SIGTERM); `during` names the phase (`data preparation`).
    #[error("interrupted during {during}")]
    Interrupted { during: &'static str },

    /// Another run holds the lock of a run's directory ([`crate::checkpoint::lock`]).
    #[error(
        "{key} {path} is in use by {holder}: one run per directory (wait for it to end, or give another {key})"
    )]
    InUse {
        key: String,
        path: PathBuf,
        holder: String,
    },

    /// An environment variable's value ([`crate::switches`]): `MT_SIMD=avx3: expected
    /// `portable`, `avx2` or `avx512``.
    #[error("{var}={value}: expected {expected}")]
    Switch {
        var: &'static str,
        value: String,
        expected: String,
    },

    /// A micro-batch row whose image tokens and images do not agree (`crate::mrope`):
    /// rows are counted from 0.
    #[error("micro-batch row {row}: {msg}")]
    MultimodalRow { row: usize, msg: String },

    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause,
        }
    }

    pub fn invalid(key: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::InvalidValue {
            key: key.into(),
            msg: msg.into(),
        }
    }
}
