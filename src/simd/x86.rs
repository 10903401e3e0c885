//! The x86-64 streaming copy: `d.copy_from_slice(s)` with the whole aligned lines of `d`
//! written by non-temporal stores, under AVX-512 or AVX2, behind a safe entry point that
//! checks the CPU's features and the slices' lengths ([`copy_streaming`]). The store loops
//! (`stream512`, `stream256`) are also the non-temporal writes of the reduce's x86 bodies
//! (`crate::reduce`).

use std::arch::x86_64::*;

use super::Simd;

/// `d.copy_from_slice(s)` with non-temporal stores.
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn stream512(d: &mut [f32], s: &[f32]) {
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
pub(crate) unsafe fn stream256(d: &mut [f32], s: &[f32]) {
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
