//! GRPO's old log-probabilities in a checkpoint: `grpo_old_logps.safetensors` beside
//! `trainer_state.json`, written when `grpo.num_iterations` > 1. The `old_logps` tensor
//! (f32, one value per completion token of the batch being trained on, row after row)
//! holds the log-probabilities of that batch's first step; its metadata name the batch
//! (its index: steps batch × num_iterations ..) and fingerprint the token rows of the
//! dataset ([`super::reference::fingerprint`]). A resume in the middle of a batch reads
//! them back, so it continues as the run would have.

use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::sidecar::Sidecar;
use crate::error::Result;

pub const FILE: &str = "grpo_old_logps.safetensors";
const TENSOR: &str = "old_logps";

/// The old log-probabilities of batch `batch`'s completion tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct OldLogps {
    pub batch: u64,
    pub logps: Vec<f32>,
    /// The dataset's fingerprint.
    pub data: String,
}

impl OldLogps {
    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let bytes: Vec<u8> = self.logps.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = TensorView::new(Dtype::F32, vec![self.logps.len()], &bytes)
            .expect("the shape holds every value");
        let meta = [
            ("batch".to_string(), self.batch.to_string()),
            ("data".to_string(), self.data.clone()),
        ]
        .into();
        safetensors::serialize([(TENSOR, view)], Some(meta)).expect("one f32 tensor serializes")
    }

    /// The old log-probabilities of checkpoint `dir`, which must be for batch `batch` of
    /// the rows of fingerprint `data`.
    pub fn read(dir: &Path, batch: u64, data: &str) -> Result<OldLogps> {
        let file = Sidecar::read(dir.join(FILE), || {
            format!(
                "missing: this checkpoint is in the middle of GRPO batch {batch} (grpo.num_iterations > 1) but holds no old log-probabilities for it (it was not written by a training.stage: grpo run with these settings)"
            )
        })?;
        let (saved_batch, saved_data) = (file.meta("batch"), file.meta("data"));
        if saved_batch != batch.to_string() || saved_data != data {
            return Err(file.bad(format!(
                "for batch {saved_batch} of rows {saved_data}; this run resumes in batch {batch} of rows {data}: resume with the rollouts file and grpo.num_iterations of the run that wrote it"
            )));
        }
        let t = file.tensor(TENSOR)?;
        if t.dtype() != Dtype::F32 || t.shape().len() != 1 {
            return Err(file.bad(format!(
                "`{TENSOR}` is {:?} {:?}, expected f32 [tokens]",
                t.dtype(),
                t.shape()
            )));
        }
        let logps = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        Ok(OldLogps {
            batch,
            logps,
            data: data.into(),
        })
    }
}
