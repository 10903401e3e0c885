//! The reduce's strip loop (`super::sum_into`) compiled under AVX-512 and AVX2, with the
//! whole aligned lines of an assigned f32 `dst` written by non-temporal stores
//! (`crate::simd::x86`'s `stream512` / `stream256`).

use std::arch::x86_64::_mm_sfence;

use super::sum_into;
use crate::elem::{GradAcc, GradElem};
use crate::simd::Simd;
use crate::simd::x86::{stream256, stream512};

/// `reduce::sum_into` with prefetching and non-temporal stores, under AVX-512.
/// Panics if the CPU lacks AVX-512.
pub(crate) fn sum_avx512<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    d: &mut [D],
    parts: &[&[T]],
) -> f64 {
    assert!(Simd::Avx512.supported());
    // SAFETY: the CPU has AVX-512 F and BW (checked above); `sum_into` indexes the slices
    // itself, so the body has no bounds to keep.
    unsafe { sum512::<T, D, ASSIGN, SQ>(d, parts) }
}

/// [`sum_avx512`] under AVX2. Panics if the CPU lacks AVX2.
pub(crate) fn sum_avx2<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    d: &mut [D],
    parts: &[&[T]],
) -> f64 {
    assert!(Simd::Avx2.supported());
    // SAFETY: the CPU has AVX2 (checked above); no bounds, as for `sum_avx512`.
    unsafe { sum256::<T, D, ASSIGN, SQ>(d, parts) }
}

/// # Safety
/// The CPU has AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn sum512<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    d: &mut [D],
    parts: &[&[T]],
) -> f64 {
    // SAFETY (of the call in the closure): the closure runs inside this function, which
    // runs only with AVX-512 F (its contract); `stream512` checks lengths and alignment.
    let sq = sum_into::<T, D, true, ASSIGN, SQ>(d, parts, |d, s| unsafe { stream512(d, s) });
    // Non-temporal stores are weakly ordered: fence before the caller publishes `d`.
    _mm_sfence();
    sq
}

/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn sum256<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    d: &mut [D],
    parts: &[&[T]],
) -> f64 {
    // SAFETY (of the call in the closure): the closure runs inside this function, which
    // runs only with AVX2 (its contract); `stream256` checks lengths and alignment.
    let sq = sum_into::<T, D, true, ASSIGN, SQ>(d, parts, |d, s| unsafe { stream256(d, s) });
    _mm_sfence();
    sq
}
