//! The reduce's strip loop (`reduce::sum_into`) compiled under AVX-512 and AVX2, with the
//! whole aligned lines of an assigned f32 `dst` written by non-temporal stores.

use std::arch::x86_64::*;

use crate::reduce::{GradAcc, GradElem, sum_into};
use crate::simd::Simd;

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

/// `d.copy_from_slice(s)` with non-temporal stores.
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn stream512(d: &mut [f32], s: &[f32]) {
    assert!(
        d.len() == s.len() && d.len().is_multiple_of(16) && d.as_ptr().addr().is_multiple_of(64)
    );
    for i in (0..d.len()).step_by(16) {
        // SAFETY: AVX-512 F by this function's contract; i + 16 <= len for both slices
        // (asserted above); d + i is 64-byte aligned, as the streaming store requires.
        unsafe { _mm512_stream_ps(d.as_mut_ptr().add(i), _mm512_loadu_ps(s.as_ptr().add(i))) }
    }
}

/// `d.copy_from_slice(s)` with non-temporal stores.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn stream256(d: &mut [f32], s: &[f32]) {
    assert!(
        d.len() == s.len() && d.len().is_multiple_of(8) && d.as_ptr().addr().is_multiple_of(32)
    );
    for i in (0..d.len()).step_by(8) {
        // SAFETY: AVX2 by this function's contract; i + 8 <= len for both slices (asserted
        // above); d + i is 32-byte aligned, as the streaming store requires.
        unsafe { _mm256_stream_ps(d.as_mut_ptr().add(i), _mm256_loadu_ps(s.as_ptr().add(i))) }
    }
}

/// `d.copy_from_slice(s)`, the whole aligned lines of `d` written by non-temporal stores
/// (for a destination read next by a device or the disk, not by this CPU). Panics if the
/// CPU lacks `simd`'s features or the lengths differ.
pub(crate) fn copy_streaming(simd: Simd, d: &mut [f32], s: &[f32]) {
    assert!(d.len() == s.len() && simd != Simd::Portable && simd.supported());
    // Elements before `d`'s first 64-byte line, then whole lines, then the rest.
    let head = d.as_ptr().addr().wrapping_neg() % 64 / 4;
    let head = head.min(d.len());
    let body = (d.len() - head) / 16 * 16;
    let (d_head, rest) = d.split_at_mut(head);
    let (d_body, d_tail) = rest.split_at_mut(body);
    let (s_head, rest) = s.split_at(head);
    let (s_body, s_tail) = rest.split_at(body);
    d_head.copy_from_slice(s_head);
    match simd {
        _ if body == 0 => {}
        // SAFETY: the CPU has AVX-512 F (asserted above); `d_body` starts on a 64-byte line
        // and holds whole lines of 16 elements, as `stream512` asserts.
        Simd::Avx512 => unsafe { copy512(d_body, s_body) },
        // SAFETY: the CPU has AVX2 (asserted above); a 64-byte line start is 32-byte aligned
        // and 16 elements are two 8-element stores, as `stream256` asserts.
        _ => unsafe { copy256(d_body, s_body) },
    }
    d_tail.copy_from_slice(s_tail);
}

/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
unsafe fn copy512(d: &mut [f32], s: &[f32]) {
    // SAFETY: AVX-512 F by this function's contract; `stream512` checks the rest.
    unsafe { stream512(d, s) };
    // Non-temporal stores are weakly ordered: fence before the caller publishes `d`.
    _mm_sfence();
}

/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn copy256(d: &mut [f32], s: &[f32]) {
    // SAFETY: AVX2 by this function's contract; `stream256` checks the rest.
    unsafe { stream256(d, s) };
    _mm_sfence();
}
