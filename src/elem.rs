//! Element types of host memory and their numerics, a leaf below the shared regions
//! (`crate::shm`), the gradient reduce (`crate::reduce`) and the optimizer
//! (`crate::optim`), which all stand on it:
//! - [`Pod`]: the types a shared region may be viewed as (its one `unsafe`: a promise about
//!   bit patterns);
//! - [`GradElem`], [`GradAcc`]: the types gradients arrive in (the workers' slabs) and
//!   accumulate in (`memory.grad_dtype`), with their exact widening and their rounding;
//! - [`bits`]: bf16 at the bit level: round-to-nearest-even, stochastic rounding, the split
//!   master's halves.

use half::bf16;

pub mod bits;

/// Plain-old-data element types a region may be viewed as.
///
/// # Safety
/// Every bit pattern must be a valid value.
#[allow(unsafe_code)]
pub unsafe trait Pod: Copy + Send + Sync + 'static {}
// SAFETY: all bit patterns are valid for these types.
#[allow(unsafe_code)]
unsafe impl Pod for f32 {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Pod for bf16 {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Pod for u8 {}
// SAFETY: as above (a split master's low halves).
#[allow(unsafe_code)]
unsafe impl Pod for u16 {}

/// An element type gradients may arrive in.
pub trait GradElem: Pod {
    fn to_f32(self) -> f32;
}

impl GradElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl GradElem for bf16 {
    /// Exact widening by shifting the bits (a signalling NaN stays signalling here, where
    /// `half` would quiet it; the sum is NaN either way).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// An element type the gradient accumulator may hold.
pub trait GradAcc: GradElem {
    /// Whether `dst` may be written with the non-temporal f32 copy (x86).
    const STREAM: bool;
    /// The nearest value (round to nearest even).
    fn round(x: f32) -> Self;
    /// The slice as f32, for the types with `STREAM`.
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
}

impl GradAcc for f32 {
    const STREAM: bool = true;
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    fn as_f32_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
}

impl GradAcc for bf16 {
    const STREAM: bool = false;
    #[inline(always)]
    fn round(x: f32) -> bf16 {
        bits::round_bf16(x)
    }
    fn as_f32_mut(_: &mut [bf16]) -> Option<&mut [f32]> {
        None
    }
}
