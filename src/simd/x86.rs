//! The x86-64 bodies of the host kernels, behind safe entry points: each checks that the CPU
//! has the level's features and that the slices agree in length before it enters a
//! `#[target_feature]` function.

mod adamw;
mod reduce;

pub(crate) use adamw::{update_bf16, update_f32, update_split};
pub(crate) use reduce::{copy_streaming, sum_avx2, sum_avx512};
