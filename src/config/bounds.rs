//! Bounds on the run-config values that size memory, checked at load time so that the
//! plans that multiply them (rows x tokens x hidden size x bytes) never wrap: each at most
//! [`MAX_VALUE`] (2^31), and a step's tokens (`training.batch_size` x
//! `dataset.max_seq_len`) at most [`MAX_STEP_TOKENS`] (2^40), with checked arithmetic.
//! Real runs sit far below (batch 1024 x 128k tokens = 2^37).

use super::RunConfig;
use crate::error::{Error, Result};

/// The largest value of a sizing key: 2^31.
pub const MAX_VALUE: usize = 1 << 31;
/// The most tokens one step may hold: 2^40.
pub const MAX_STEP_TOKENS: usize = 1 << 40;

/// Checks the sizing keys of `cfg`; errors name the key.
pub fn check(cfg: &RunConfig) -> Result<()> {
    let t = &cfg.training;
    let values = [
        ("training.batch_size", Some(t.batch_size)),
        (
            "training.gradient_accumulation_steps",
            Some(t.gradient_accumulation_steps),
        ),
        (
            "training.per_device_eval_batch_size",
            t.per_device_eval_batch_size,
        ),
        ("dataset.max_seq_len", cfg.dataset.max_seq_len),
        ("memory.num_grad_slabs", Some(cfg.memory.num_grad_slabs)),
        ("memory.ce_chunk_tokens", Some(cfg.memory.ce_chunk_tokens)),
    ];
    for (key, v) in values {
        if let Some(v) = v.filter(|&v| v > MAX_VALUE) {
            return Err(Error::invalid(
                key,
                format!("{v} is too large: at most {MAX_VALUE}"),
            ));
        }
    }
    if let Some(len) = cfg.dataset.max_seq_len {
        let tokens = t
            .batch_size
            .checked_mul(len)
            .filter(|&n| n <= MAX_STEP_TOKENS);
        if tokens.is_none() {
            return Err(Error::invalid(
                "training.batch_size",
                format!(
                    "{} rows of dataset.max_seq_len {len} tokens are more than {MAX_STEP_TOKENS} tokens a step",
                    t.batch_size
                ),
            ));
        }
    }
    Ok(())
}
