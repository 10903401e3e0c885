//! The `checkpoint` section: where and how often checkpoints are written, what they hold,
//! and how a background checkpoint stages the blocks training is about to change.
//!
//! A run that writes its model keeps checkpoints by default: `dir` unset is
//! `<training.output_dir>/checkpoints/` ([`super::RunConfig::load`]), and one is written
//! every `every_minutes` of training, at a stop signal, after a worker is lost and at the
//! end. Only `training.save_model: false` without `dir` keeps none.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::size;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Where checkpoints go (`step-NNNNNNNN/` each), and where `--resume latest` looks.
    /// Unset: `<training.output_dir>/checkpoints/` (the export of the model keeps that
    /// subdirectory), or none with `training.save_model: false`.
    pub dir: Option<PathBuf>,
    /// Write a checkpoint every this many optimizer steps (0: never).
    pub every_steps: u64,
    /// Write a checkpoint at the first step boundary after this many minutes of training
    /// since the last checkpoint (or the start); 0: never. Like `every_steps`'s, it holds
    /// the optimizer state (with `save_optimizer`) and is written in the background.
    pub every_minutes: u64,
    /// Complete checkpoints kept; older ones are deleted (the newest is always kept).
    pub keep_last: usize,
    /// Write periodic checkpoints on a background thread while training goes on: each
    /// block's weights and moments are written from the live state until the optimizer is
    /// about to change them, then from a copy in the staging area (`staging_size`). `false`
    /// writes in place while training waits.
    pub background: bool,
    /// Host RAM for the blocks a background checkpoint has not written yet when the
    /// optimizer changes them (bytes, or `8GB`, `512MiB`); training waits for the writer
    /// only when it is full. Unset: two of the largest blocks (fp32 master, m and v: 12
    /// bytes per parameter of a block). Larger hides a slower disk.
    pub staging_size: Option<size::ByteSize>,
    /// Weight files larger than this are split into shards with
    /// `model.safetensors.index.json` (bytes, or `5GB`, `500MB`, `64KiB`).
    pub max_shard_size: size::ByteSize,
    /// Write the optimizer state (fp32 master, Adam moments: 12 bytes per parameter) into
    /// checkpoints so that they resume exactly. `false` writes model-only checkpoints (the
    /// HF model directory alone, HF Trainer's `save_only_model`), which cannot be resumed.
    pub save_optimizer: bool,
    /// With `save_optimizer`, the optimizer state goes into every this many steps'
    /// checkpoint only; the other checkpoints of `every_steps` are model-only (0: every
    /// checkpoint holds it). The end of a run and a stop signal always write it.
    pub full_state_every_steps: u64,
    /// Check, before reading it, every file of the checkpoint a run resumes (and of a
    /// `model.init: pretrained` directory this project exported: one holding
    /// `megatrain-export.json`) against the sizes and CRC32C checksums its manifest lists;
    /// a damaged file is named and the run refused. Reads the whole directory once, at disk
    /// speed; `false` skips it, for a trusted checkpoint of many terabytes. Values that are
    /// not finite are refused either way.
    pub verify: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            dir: None,
            every_steps: 0,
            every_minutes: 30,
            keep_last: 2,
            background: true,
            staging_size: None,
            max_shard_size: size::ByteSize(5_000_000_000),
            save_optimizer: true,
            full_state_every_steps: 0,
            verify: true,
        }
    }
}

/// What a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointContents {
    /// The HF model directory and the optimizer state: a resume point.
    Full,
    /// The HF model directory alone.
    ModelOnly,
}

impl CheckpointSection {
    /// What the checkpoint after `step` steps holds, if one is due; `last` is the end of
    /// the run or a stop signal, always checkpointed; `since_last` is the training time
    /// since the last checkpoint (or the start), against `every_minutes`.
    pub fn due(&self, step: u64, last: bool, since_last: Duration) -> Option<CheckpointContents> {
        let at = |every: u64| every > 0 && step.is_multiple_of(every);
        let timed = self.timed_due(since_last);
        let full = self.save_optimizer
            && (last
                || timed
                || match self.full_state_every_steps {
                    0 => at(self.every_steps),
                    n => at(n),
                });
        match (self.dir.is_some(), full) {
            (false, _) => None,
            (true, true) => Some(CheckpointContents::Full),
            (true, false) if last || timed || at(self.every_steps) => {
                Some(CheckpointContents::ModelOnly)
            }
            (true, false) => None,
        }
    }

    /// Whether `every_minutes` have passed in `since_last`.
    pub fn timed_due(&self, since_last: Duration) -> bool {
        self.every_minutes > 0
            && since_last >= Duration::from_secs(self.every_minutes.saturating_mul(60))
    }

    /// Whether any checkpoint before the last holds the optimizer state.
    pub fn periodic_full_state(&self) -> bool {
        self.save_optimizer && self.periodic()
    }

    /// Whether checkpoints are written before the last one.
    pub fn periodic(&self) -> bool {
        self.every_steps > 0 || self.full_state_every_steps > 0 || self.every_minutes > 0
    }

    /// The section's own checks: a directory for step-based checkpoints, and no setting
    /// that another one turns off. `every_minutes` without a directory (on by default, with
    /// `training.save_model: false`) writes nothing.
    pub(super) fn validate(&self) -> Result<()> {
        if (self.every_steps > 0 || self.full_state_every_steps > 0) && self.dir.is_none() {
            return Err(Error::invalid(
                "checkpoint.dir",
                "is required when checkpoint.every_steps or checkpoint.full_state_every_steps > 0 and training.save_model is false (otherwise checkpoints go to training.output_dir/checkpoints/)",
            ));
        }
        if !self.save_optimizer && self.full_state_every_steps > 0 {
            return Err(Error::invalid(
                "checkpoint.full_state_every_steps",
                "conflicts with checkpoint.save_optimizer: false (no checkpoint holds the optimizer state)",
            ));
        }
        if self.staging_size.is_some() && !self.background {
            return Err(Error::invalid(
                "checkpoint.staging_size",
                "conflicts with checkpoint.background: false (checkpoints are written in place, nothing is staged)",
            ));
        }
        Ok(())
    }
}
