//! The optimizer side of a step: global gradient norm and clipping (torch's
//! `clip_grad_norm_`), learning-rate schedules (transformers' `get_scheduler`), and a fused
//! AdamW (`torch.optim.AdamW`) over flat fp32 slices.

pub mod adamw;
pub mod schedule;

pub use adamw::{
    AdamWStep, Moments, StoreOut, WeightsMut, adamw_moments, adamw_moments_bf16, adamw_update,
    adamw_update_bf16_master, adamw_update_bf16_moments, adamw_update_split,
};
pub use schedule::lr_at;

/// Clip coefficient as torch's `clip_grad_norm_` computes it: gradients are multiplied by
/// `min(1, max_norm / (total_norm + 1e-6))`. `max_norm == 0` disables clipping.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (total_norm + 1e-6)).min(1.0) as f32
}
