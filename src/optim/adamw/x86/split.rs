//! AVX-512 and AVX2 bodies of the AdamW update of a split master: joined and split on the
//! integer bits as `bits::join` and `bits::split` do, the update itself shared with the
//! fp32-master bodies (`adam16`, `adam8`), and written with plain stores (the store's lines
//! were just read, so they are in cache). The tail goes through the portable loop.

use std::arch::x86_64::*;

use half::bf16;

use super::{
    Consts, GradElem, PREFETCH_AHEAD, Simd, adam8, adam16, bf16x8_lanes, bf16x16, k256, k512,
    pack16, prefetch32,
};
use crate::optim::adamw::update_split_portable;

/// The AdamW update of a split master at level `simd`.
/// Panics if the CPU lacks the level or the lengths differ.
pub(crate) fn update_split<G: GradElem>(
    simd: Simd,
    hi: &mut [bf16],
    lo: &mut [u16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    assert!(simd.supported());
    let n = hi.len();
    assert!(lo.len() == n && g.len() == n && m.len() == n && v.len() == n);
    match simd {
        // SAFETY: the CPU has AVX-512 F, BW and VL (`supported` asserted above); every
        // slice has `hi.len()` elements (asserted above).
        Simd::Avx512 => unsafe { split_avx512(hi, lo, g, m, v, k) },
        // SAFETY: the CPU has AVX2 (asserted above); every slice has `hi.len()` elements.
        Simd::Avx2 => unsafe { split_avx2(hi, lo, g, m, v, k) },
        Simd::Portable => update_split_portable(hi, lo, g, m, v, k),
    }
}

// ---------------------------------------------------------------------------------- AVX-512

/// `bits::join` of 16 elements.
#[target_feature(enable = "avx512f")]
fn join16(hi: __m256i, lo: __m256i) -> __m512 {
    let s = _mm512_cvtepu16_epi32(hi);
    let r = _mm512_cvtepu16_epi32(lo);
    let nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(s, _mm512_set1_epi32(0x7fff)),
        _mm512_set1_epi32(0x7f80),
    );
    let down = _mm512_cmpgt_epu32_mask(r, _mm512_set1_epi32(0x8000)) & !nan;
    let b = _mm512_or_si512(_mm512_slli_epi32::<16>(s), r);
    _mm512_castsi512_ps(_mm512_mask_sub_epi32(
        b,
        down,
        b,
        _mm512_set1_epi32(0x1_0000),
    ))
}

/// `bits::split` of 16 elements: (store bf16, residual).
#[target_feature(enable = "avx512f,avx512bw")]
fn split16(x: __m512) -> (__m256i, __m256i) {
    let b = _mm512_castps_si512(x);
    let low = _mm512_and_si512(b, _mm512_set1_epi32(0xffff));
    let tie = _mm512_cmpeq_epi32_mask(low, _mm512_set1_epi32(0x8000));
    let odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x1_0000));
    let one = _mm512_set1_epi32(1);
    let b = _mm512_mask_add_epi32(b, tie & odd, b, one);
    let b = _mm512_mask_sub_epi32(b, tie & !odd, b, one);
    (bf16x16(_mm512_castsi512_ps(b)), _mm512_cvtepi32_epi16(b))
}

/// # Safety
/// The CPU has AVX-512 F, BW, VL; all slices have `hi.len()` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn split_avx512<G: GradElem>(
    hi: &mut [bf16],
    lo: &mut [u16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    let n = hi.len();
    let c = k512(k);
    let (hp, lp) = (hi.as_mut_ptr(), lo.as_mut_ptr());
    let (gp, mp, vp) = (g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let mut i = 0;
    while i + 32 <= n {
        prefetch32(hp, i + PREFETCH_AHEAD);
        prefetch32(lp, i + PREFETCH_AHEAD);
        prefetch32(gp, i + PREFETCH_AHEAD);
        prefetch32(mp, i + PREFETCH_AHEAD);
        prefetch32(vp, i + PREFETCH_AHEAD);
        for h in [i, i + 16] {
            // SAFETY: AVX-512 F, BW, VL by this function's contract; h + 16 <= n and every
            // slice has n elements (contract), so the 16-element loads, stores and the
            // `adam16` step are in bounds; unaligned loads and stores.
            unsafe {
                let (hv, lv) = (hp.add(h) as *mut __m256i, lp.add(h) as *mut __m256i);
                let p = join16(_mm256_loadu_si256(hv), _mm256_loadu_si256(lv));
                let (s, r) = split16(adam16(&c, p, gp, mp, vp, h));
                _mm256_storeu_si256(hv, s);
                _mm256_storeu_si256(lv, r);
            }
        }
        i += 32;
    }
    update_split_portable(
        &mut hi[i..],
        &mut lo[i..],
        &g[i..],
        &mut m[i..],
        &mut v[i..],
        k,
    );
}

// ------------------------------------------------------------------------------------- AVX2

/// `bits::join` of 8 elements (one u16 per 32-bit lane in, f32 out). Every lane holds a
/// value below 2^16, so the signed compares are exact.
#[target_feature(enable = "avx2")]
fn join8(s: __m256i, r: __m256i) -> __m256 {
    let nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(s, _mm256_set1_epi32(0x7fff)),
        _mm256_set1_epi32(0x7f80),
    );
    let down = _mm256_andnot_si256(nan, _mm256_cmpgt_epi32(r, _mm256_set1_epi32(0x8000)));
    let b = _mm256_or_si256(_mm256_slli_epi32::<16>(s), r);
    let b = _mm256_sub_epi32(b, _mm256_and_si256(down, _mm256_set1_epi32(0x1_0000)));
    _mm256_castsi256_ps(b)
}

/// `bits::split` of 8 elements: (store bf16, residual), one per 32-bit lane.
#[target_feature(enable = "avx2")]
fn split8(x: __m256) -> (__m256i, __m256i) {
    let b = _mm256_castps_si256(x);
    let low = _mm256_and_si256(b, _mm256_set1_epi32(0xffff));
    let tie = _mm256_cmpeq_epi32(low, _mm256_set1_epi32(0x8000));
    let bit = _mm256_set1_epi32(0x1_0000);
    let odd = _mm256_cmpeq_epi32(_mm256_and_si256(b, bit), bit);
    // +1 for an odd tie, -1 (all ones) for an even one, 0 elsewhere.
    let step = _mm256_blendv_epi8(_mm256_set1_epi32(-1), _mm256_set1_epi32(1), odd);
    let b = _mm256_add_epi32(b, _mm256_and_si256(tie, step));
    (
        bf16x8_lanes(_mm256_castsi256_ps(b)),
        _mm256_and_si256(b, _mm256_set1_epi32(0xffff)),
    )
}

/// # Safety
/// The CPU has AVX2; all slices have `hi.len()` elements.
#[target_feature(enable = "avx2")]
unsafe fn split_avx2<G: GradElem>(
    hi: &mut [bf16],
    lo: &mut [u16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    let n = hi.len();
    let c = k256(k);
    let (hp, lp) = (hi.as_mut_ptr(), lo.as_mut_ptr());
    let (gp, mp, vp) = (g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let mut i = 0;
    while i + 32 <= n {
        prefetch32(hp, i + PREFETCH_AHEAD);
        prefetch32(lp, i + PREFETCH_AHEAD);
        prefetch32(gp, i + PREFETCH_AHEAD);
        prefetch32(mp, i + PREFETCH_AHEAD);
        prefetch32(vp, i + PREFETCH_AHEAD);
        for h in [i, i + 16] {
            // SAFETY: AVX2 by this function's contract; h + 16 <= n and every slice has n
            // elements (contract), so the 16-element loads and stores and the two `adam8`
            // steps (h, h + 8) are in bounds; unaligned loads and stores.
            unsafe {
                let (hv, lv) = (hp.add(h) as *mut __m256i, lp.add(h) as *mut __m256i);
                let (s, r) = (_mm256_loadu_si256(hv), _mm256_loadu_si256(lv));
                let half = |x: __m256i, upper: bool| {
                    _mm256_cvtepu16_epi32(if upper {
                        _mm256_extracti128_si256::<1>(x)
                    } else {
                        _mm256_castsi256_si128(x)
                    })
                };
                let pa = join8(half(s, false), half(r, false));
                let pb = join8(half(s, true), half(r, true));
                let (sa, ra) = split8(adam8(&c, pa, gp, mp, vp, h));
                let (sb, rb) = split8(adam8(&c, pb, gp, mp, vp, h + 8));
                _mm256_storeu_si256(hv, pack16(sa, sb));
                _mm256_storeu_si256(lv, pack16(ra, rb));
            }
        }
        i += 32;
    }
    update_split_portable(
        &mut hi[i..],
        &mut lo[i..],
        &g[i..],
        &mut m[i..],
        &mut v[i..],
        k,
    );
}
