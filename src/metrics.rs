//! Per-step metrics: one JSON object per line per optimizer step, and the FLOPs accounting.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean token loss over the global batch.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient 2-norm before clipping.
    pub grad_norm: f64,
    /// Unmasked label tokens in the global batch.
    pub tokens: u64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    /// Slowest worker's forward and backward time.
    pub forward_s: f64,
    pub backward_s: f64,
    /// Slowest worker's wait for a free gradient slab slot.
    pub slot_wait_s: f64,
    /// Launcher time in the slab reduce and in clip + AdamW.
    pub reduce_s: f64,
    pub optimizer_s: f64,
}

/// Appends metrics as JSON lines.
pub struct MetricsWriter {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl MetricsWriter {
    pub fn create(path: &Path) -> Result<MetricsWriter> {
        let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(MetricsWriter {
            file,
            path: path.into(),
        })
    }

    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::Other(format!("metrics: {e}")))?;
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}
