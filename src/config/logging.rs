//! The `logging` section: the step lines, and where else the metrics go (HF Trainer's
//! `report_to` and `logging_dir`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingSection {
    /// Print a log line every this many optimizer steps.
    pub log_every: u64,
    /// Where the metrics are also reported (HF Trainer's key): `none`, or `tensorboard`
    /// (event files under `logging_dir`).
    pub report_to: ReportTo,
    /// Directory of the TensorBoard event files (HF Trainer's key). Default:
    /// `training.output_dir/runs`, else `checkpoint.dir/runs`.
    pub logging_dir: Option<PathBuf>,
}

impl Default for LoggingSection {
    fn default() -> Self {
        LoggingSection {
            log_every: 1,
            report_to: ReportTo::None,
            logging_dir: None,
        }
    }
}

/// `logging.report_to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ReportTo {
    #[default]
    None,
    Tensorboard,
}

impl LoggingSection {
    /// The TensorBoard directory: `logging_dir`, else `runs/` under the output or
    /// checkpoint directory. None without `report_to: tensorboard`.
    pub fn tensorboard_dir(
        &self,
        output_dir: Option<&Path>,
        checkpoint_dir: Option<&Path>,
    ) -> Result<Option<PathBuf>> {
        if self.report_to != ReportTo::Tensorboard {
            return Ok(None);
        }
        let default = output_dir.or(checkpoint_dir).map(|d| d.join("runs"));
        match self.logging_dir.clone().or(default) {
            Some(dir) => Ok(Some(dir)),
            None => Err(Error::invalid(
                "logging.logging_dir",
                "report_to: tensorboard needs a directory for its event files: set logging.logging_dir \
                 (or training.output_dir or checkpoint.dir, whose runs/ it defaults to)",
            )),
        }
    }
}
