//! AVX-512 and AVX2 bodies of the AdamW update.
//!
//! Each performs the portable loop's IEEE operations in the same order (mul, add, sub,
//! sqrt, div; no FMA), so results are bit-identical across paths. The bf16 store is written
//! with round-to-nearest-even done on the integer bits (as `half::bf16::from_f32`, NaN kept
//! quiet) and non-temporal stores of whole aligned lines; the unaligned head and the tail
//! go through the portable loop. A bf16 gradient is widened by shifting its bits. The split
//! master's bodies are in `split.rs`.

use std::arch::x86_64::*;

use half::bf16;

use super::{Consts, update_portable};
use crate::elem::GradElem;
use crate::simd::Simd;

mod split;
pub(crate) use split::update_split;

/// The AdamW update of an fp32 master with a bf16 store, at level `simd`.
/// Panics if the CPU lacks the level or the lengths differ.
pub(crate) fn update_bf16<G: GradElem>(
    simd: Simd,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [bf16],
    k: &Consts,
) {
    assert!(simd.supported());
    let n = p.len();
    assert!(g.len() == n && m.len() == n && v.len() == n && s.len() == n);
    match simd {
        // SAFETY: the CPU has AVX-512 F, BW and VL (`supported` asserted above); every
        // slice has `p.len()` elements (asserted above).
        Simd::Avx512 => unsafe { bf16_avx512(p, g, m, v, s, k) },
        // SAFETY: the CPU has AVX2 (asserted above); every slice has `p.len()` elements.
        Simd::Avx2 => unsafe { bf16_avx2(p, g, m, v, s, k) },
        Simd::Portable => update_portable(p, g, m, v, s, k, bf16::from_f32),
    }
}

/// The AdamW update of an fp32 master with an f32 store, at level `simd`.
/// Panics if the CPU lacks the level or the lengths differ.
pub(crate) fn update_f32<G: GradElem>(
    simd: Simd,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [f32],
    k: &Consts,
) {
    assert!(simd.supported());
    let n = p.len();
    assert!(g.len() == n && m.len() == n && v.len() == n && s.len() == n);
    match simd {
        // SAFETY: the CPU has AVX-512 F, BW and VL (`supported` asserted above); every
        // slice has `p.len()` elements (asserted above).
        Simd::Avx512 => unsafe { f32_avx512(p, g, m, v, s, k) },
        // SAFETY: the CPU has AVX2 (asserted above); every slice has `p.len()` elements.
        Simd::Avx2 => unsafe { f32_avx2(p, g, m, v, s, k) },
        Simd::Portable => update_portable(p, g, m, v, s, k, |x| x),
    }
}

/// How far ahead (elements) the four fp32 streams are prefetched into L1: 2 KiB each.
/// Measured on a 2-core Emerald Rapids VM: +18% over the hardware prefetchers alone.
const PREFETCH_AHEAD: usize = 512;

/// Asks for the cache lines of elements `i..i + 32` (possibly past the end) of `q`.
#[inline(always)]
fn prefetch32<T>(q: *const T, i: usize) {
    let a = q.wrapping_add(i) as *const i8;
    for off in (0..32 * size_of::<T>()).step_by(64) {
        // SAFETY: SSE is part of x86-64, so the instruction is present; a prefetch never
        // faults, whatever the address, and the pointer is never dereferenced.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(off)) };
    }
}

/// [`prefetch32`] of the four streams of the fp32-master update.
#[inline(always)]
fn prefetch4<G>(p: *mut f32, g: *const G, m: *mut f32, v: *mut f32, i: usize) {
    prefetch32(p, i);
    prefetch32(g, i);
    prefetch32(m, i);
    prefetch32(v, i);
}

/// Whether `G` is bf16 (a gradient element is f32 or bf16).
const fn is_bf16<G>() -> bool {
    size_of::<G>() == 2
}

/// Elements before `s` reaches an `align`-byte boundary (all of them if it never does).
fn head_len(s: &[bf16], align: usize) -> usize {
    let mis = s.as_ptr() as usize % align;
    (((align - mis) % align) / 2).min(s.len())
}

// ---------------------------------------------------------------------------------- AVX-512

#[derive(Clone, Copy)]
struct K512 {
    grad_scale: __m512,
    decay_mul: __m512,
    one_minus_b1: __m512,
    b2: __m512,
    one_minus_b2: __m512,
    step_size: __m512,
    inv_bc2_sqrt: __m512,
    eps: __m512,
    write_moments: bool,
}

#[target_feature(enable = "avx512f")]
fn k512(k: &Consts) -> K512 {
    K512 {
        grad_scale: _mm512_set1_ps(k.grad_scale),
        decay_mul: _mm512_set1_ps(k.decay_mul),
        one_minus_b1: _mm512_set1_ps(k.one_minus_b1),
        b2: _mm512_set1_ps(k.b2),
        one_minus_b2: _mm512_set1_ps(k.one_minus_b2),
        step_size: _mm512_set1_ps(k.step_size),
        inv_bc2_sqrt: _mm512_set1_ps(k.inv_bc2_sqrt),
        eps: _mm512_set1_ps(k.eps),
        write_moments: k.write_moments,
    }
}

/// 16 gradient elements at `i`, widened to f32.
///
/// # Safety
/// The CPU has AVX-512 F; `i + 16` is within the slice.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_g16<G: GradElem>(g: *const G, i: usize) -> __m512 {
    // SAFETY: AVX-512 F by this function's contract; `g + i .. g + i + 16` is within the
    // slice by the same contract; the loads are unaligned ones.
    unsafe {
        if is_bf16::<G>() {
            let h = _mm256_loadu_si256(g.add(i) as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_loadu_ps(g.add(i) as *const f32)
        }
    }
}

/// Updates 16 elements at `i` of an fp32 master; returns the new parameters.
///
/// # Safety
/// The CPU has AVX-512 F; `i + 16` is within every slice.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn step16<G: GradElem>(
    c: &K512,
    p: *mut f32,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    i: usize,
) -> __m512 {
    // SAFETY: AVX-512 F by this function's contract; `i + 16` is within every slice by the
    // same contract (what `adam16` requires too); unaligned loads and stores.
    unsafe {
        let pn = adam16(c, _mm512_loadu_ps(p.add(i)), g, m, v, i);
        _mm512_storeu_ps(p.add(i), pn);
        pn
    }
}

/// The update of parameters `p` (elements `i..i + 16`): loads the gradient, updates `m`
/// and `v` in place (with `write_moments`), returns the new parameters.
///
/// # Safety
/// The CPU has AVX-512 F; `i + 16` is within every slice.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn adam16<G: GradElem>(
    c: &K512,
    p: __m512,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    i: usize,
) -> __m512 {
    // SAFETY: AVX-512 F by this function's contract; `i + 16` is within every slice by the
    // same contract (what `load_g16` requires too); unaligned loads and stores.
    unsafe {
        let gi = _mm512_mul_ps(load_g16(g, i), c.grad_scale);
        let pi = _mm512_mul_ps(p, c.decay_mul);
        let m0 = _mm512_loadu_ps(m.add(i));
        let mi = _mm512_add_ps(m0, _mm512_mul_ps(c.one_minus_b1, _mm512_sub_ps(gi, m0)));
        let vi = _mm512_add_ps(
            _mm512_mul_ps(_mm512_loadu_ps(v.add(i)), c.b2),
            _mm512_mul_ps(_mm512_mul_ps(c.one_minus_b2, gi), gi),
        );
        let denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), c.inv_bc2_sqrt), c.eps);
        let pn = _mm512_sub_ps(pi, _mm512_mul_ps(c.step_size, _mm512_div_ps(mi, denom)));
        if c.write_moments {
            _mm512_storeu_ps(m.add(i), mi);
            _mm512_storeu_ps(v.add(i), vi);
        }
        pn
    }
}

/// 16 f32 to bf16, round to nearest even; NaN stays NaN (quiet bit set).
#[target_feature(enable = "avx512f")]
fn bf16x16(x: __m512) -> __m256i {
    let b = _mm512_castps_si512(x);
    let hi = _mm512_srli_epi32::<16>(b);
    let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
    let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
}

/// # Safety
/// The CPU has AVX-512 F, BW, VL; all slices have `p.len()` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bf16_avx512<G: GradElem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [bf16],
    k: &Consts,
) {
    let n = p.len();
    let head = head_len(s, 64);
    update_portable(&mut p[..head], g, &mut m[..head], v, s, k, bf16::from_f32);
    let c = k512(k);
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let sp = s.as_mut_ptr();
    let mut i = head;
    while i + 32 <= n {
        prefetch4(pp, gp, mp, vp, i + PREFETCH_AHEAD);
        // SAFETY: AVX-512 F by this function's contract; i + 32 <= n and every slice has n
        // elements (contract), so `step16` at i and i + 16 is in bounds; s + i is 64-byte
        // aligned (head), so the 64-byte non-temporal store covers exactly one cache line.
        unsafe {
            let a = bf16x16(step16(&c, pp, gp, mp, vp, i));
            let b = bf16x16(step16(&c, pp, gp, mp, vp, i + 16));
            let line = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
            _mm512_stream_si512(sp.add(i) as *mut __m512i, line);
        }
        i += 32;
    }
    // Non-temporal stores are weakly ordered: fence before anyone is told the store is done.
    _mm_sfence();
    update_portable(
        &mut p[i..],
        &g[i..],
        &mut m[i..],
        &mut v[i..],
        &mut s[i..],
        k,
        bf16::from_f32,
    );
}

/// # Safety
/// The CPU has AVX-512 F, BW, VL; all slices have `p.len()` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn f32_avx512<G: GradElem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [f32],
    k: &Consts,
) {
    let n = p.len();
    let c = k512(k);
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let sp = s.as_mut_ptr();
    let mut i = 0;
    while i + 32 <= n {
        prefetch4(pp, gp, mp, vp, i + PREFETCH_AHEAD);
        // SAFETY: AVX-512 F by this function's contract; i + 32 <= n and every slice has n
        // elements (contract), so both 16-element steps and stores are in bounds.
        unsafe {
            _mm512_storeu_ps(sp.add(i), step16(&c, pp, gp, mp, vp, i));
            _mm512_storeu_ps(sp.add(i + 16), step16(&c, pp, gp, mp, vp, i + 16));
        }
        i += 32;
    }
    let (p, m, v, s) = (&mut p[i..], &mut m[i..], &mut v[i..], &mut s[i..]);
    update_portable(p, &g[i..], m, v, s, k, |x| x);
}

// ------------------------------------------------------------------------------------- AVX2

#[derive(Clone, Copy)]
struct K256 {
    grad_scale: __m256,
    decay_mul: __m256,
    one_minus_b1: __m256,
    b2: __m256,
    one_minus_b2: __m256,
    step_size: __m256,
    inv_bc2_sqrt: __m256,
    eps: __m256,
    write_moments: bool,
}

#[target_feature(enable = "avx2")]
fn k256(k: &Consts) -> K256 {
    K256 {
        grad_scale: _mm256_set1_ps(k.grad_scale),
        decay_mul: _mm256_set1_ps(k.decay_mul),
        one_minus_b1: _mm256_set1_ps(k.one_minus_b1),
        b2: _mm256_set1_ps(k.b2),
        one_minus_b2: _mm256_set1_ps(k.one_minus_b2),
        step_size: _mm256_set1_ps(k.step_size),
        inv_bc2_sqrt: _mm256_set1_ps(k.inv_bc2_sqrt),
        eps: _mm256_set1_ps(k.eps),
        write_moments: k.write_moments,
    }
}

/// 8 gradient elements at `i`, widened to f32.
///
/// # Safety
/// The CPU has AVX2; `i + 8` is within the slice.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_g8<G: GradElem>(g: *const G, i: usize) -> __m256 {
    // SAFETY: AVX2 by this function's contract; `g + i .. g + i + 8` is within the slice by
    // the same contract; the loads are unaligned ones.
    unsafe {
        if is_bf16::<G>() {
            let h = _mm_loadu_si128(g.add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        } else {
            _mm256_loadu_ps(g.add(i) as *const f32)
        }
    }
}

/// Updates 8 elements at `i` of an fp32 master; returns the new parameters.
///
/// # Safety
/// The CPU has AVX2; `i + 8` is within every slice.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn step8<G: GradElem>(
    c: &K256,
    p: *mut f32,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    i: usize,
) -> __m256 {
    // SAFETY: AVX2 by this function's contract; `i + 8` is within every slice by the same
    // contract (what `adam8` requires too); unaligned loads and stores.
    unsafe {
        let pn = adam8(c, _mm256_loadu_ps(p.add(i)), g, m, v, i);
        _mm256_storeu_ps(p.add(i), pn);
        pn
    }
}

/// The update of parameters `p` (elements `i..i + 8`): loads the gradient, updates `m`
/// and `v` in place (with `write_moments`), returns the new parameters.
///
/// # Safety
/// The CPU has AVX2; `i + 8` is within every slice.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn adam8<G: GradElem>(
    c: &K256,
    p: __m256,
    g: *const G,
    m: *mut f32,
    v: *mut f32,
    i: usize,
) -> __m256 {
    // SAFETY: AVX2 by this function's contract; `i + 8` is within every slice by the same
    // contract (what `load_g8` requires too); unaligned loads and stores.
    unsafe {
        let gi = _mm256_mul_ps(load_g8(g, i), c.grad_scale);
        let pi = _mm256_mul_ps(p, c.decay_mul);
        let m0 = _mm256_loadu_ps(m.add(i));
        let mi = _mm256_add_ps(m0, _mm256_mul_ps(c.one_minus_b1, _mm256_sub_ps(gi, m0)));
        let vi = _mm256_add_ps(
            _mm256_mul_ps(_mm256_loadu_ps(v.add(i)), c.b2),
            _mm256_mul_ps(_mm256_mul_ps(c.one_minus_b2, gi), gi),
        );
        let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), c.inv_bc2_sqrt), c.eps);
        let pn = _mm256_sub_ps(pi, _mm256_mul_ps(c.step_size, _mm256_div_ps(mi, denom)));
        if c.write_moments {
            _mm256_storeu_ps(m.add(i), mi);
            _mm256_storeu_ps(v.add(i), vi);
        }
        pn
    }
}

/// 8 f32 to bf16 (round to nearest even, NaN quiet), one per 32-bit lane.
#[target_feature(enable = "avx2")]
fn bf16x8_lanes(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let hi = _mm256_srli_epi32::<16>(b);
    let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
    // Both sides are non-negative as i32, so the signed compare is exact.
    let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
    let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
    let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    _mm256_blendv_epi8(rounded, quiet, nan)
}

/// 16 u16 lanes of `a` then `b` (each 8 values below 2^16 in 32-bit lanes), in order.
#[target_feature(enable = "avx2")]
fn pack16(a: __m256i, b: __m256i) -> __m256i {
    // Unsigned saturation is exact; the permute undoes packus's per-128-bit interleave.
    _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b))
}

/// # Safety
/// The CPU has AVX2; all slices have `p.len()` elements.
#[target_feature(enable = "avx2")]
unsafe fn bf16_avx2<G: GradElem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [bf16],
    k: &Consts,
) {
    let n = p.len();
    let head = head_len(s, 32);
    update_portable(&mut p[..head], g, &mut m[..head], v, s, k, bf16::from_f32);
    let c = k256(k);
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let sp = s.as_mut_ptr();
    let mut i = head;
    while i + 32 <= n {
        prefetch4(pp, gp, mp, vp, i + PREFETCH_AHEAD);
        for h in [i, i + 16] {
            // SAFETY: AVX2 by this function's contract; h + 16 <= n and every slice has n
            // elements (contract), so `step8` at h and h + 8 is in bounds; s + h is
            // 32-byte aligned (head), as the 32-byte non-temporal store requires.
            unsafe {
                let a = bf16x8_lanes(step8(&c, pp, gp, mp, vp, h));
                let b = bf16x8_lanes(step8(&c, pp, gp, mp, vp, h + 8));
                _mm256_stream_si256(sp.add(h) as *mut __m256i, pack16(a, b));
            }
        }
        i += 32;
    }
    _mm_sfence();
    update_portable(
        &mut p[i..],
        &g[i..],
        &mut m[i..],
        &mut v[i..],
        &mut s[i..],
        k,
        bf16::from_f32,
    );
}

/// # Safety
/// The CPU has AVX2; all slices have `p.len()` elements.
#[target_feature(enable = "avx2")]
unsafe fn f32_avx2<G: GradElem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [f32],
    k: &Consts,
) {
    let n = p.len();
    let c = k256(k);
    let (pp, gp, mp, vp) = (p.as_mut_ptr(), g.as_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let sp = s.as_mut_ptr();
    let mut i = 0;
    while i + 32 <= n {
        prefetch4(pp, gp, mp, vp, i + PREFETCH_AHEAD);
        for h in [i, i + 8, i + 16, i + 24] {
            // SAFETY: AVX2 by this function's contract; h + 8 <= n and every slice has n
            // elements (contract), so the step and the store are in bounds.
            unsafe { _mm256_storeu_ps(sp.add(h), step8(&c, pp, gp, mp, vp, h)) };
        }
        i += 32;
    }
    let (p, m, v, s) = (&mut p[i..], &mut m[i..], &mut v[i..], &mut s[i..]);
    update_portable(p, &g[i..], m, v, s, k, |x| x);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_on_special_values() {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),           // smallest denormal
            f32::from_bits(0x3f80_8000), // tie, even below: stays
            f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x0000_8000),
        ];
        xs.extend((0..4096u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        for chunk in xs.chunks(16) {
            let mut x = [0.0f32; 16];
            x[..chunk.len()].copy_from_slice(chunk);
            let expect: Vec<u16> = x.iter().map(|&f| bf16::from_f32(f).to_bits()).collect();
            if Simd::Avx512.supported() {
                let mut got = [0u16; 16];
                // SAFETY: AVX-512 checked just above; 16 floats in, 32 bytes out.
                unsafe {
                    let r = bf16x16(_mm512_loadu_ps(x.as_ptr()));
                    _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, r);
                }
                assert_eq!(&got[..], &expect[..], "avx512 on {x:?}");
            }
            if Simd::Avx2.supported() {
                let mut got = [0u32; 16];
                // SAFETY: AVX2 checked just above; 8 floats in, 8 lanes out, twice.
                unsafe {
                    for h in 0..2 {
                        let r = bf16x8_lanes(_mm256_loadu_ps(x.as_ptr().add(8 * h)));
                        _mm256_storeu_si256(got.as_mut_ptr().add(8 * h) as *mut __m256i, r);
                    }
                }
                let got: Vec<u16> = got.iter().map(|&w| w as u16).collect();
                assert_eq!(got, expect, "avx2 on {x:?}");
            }
        }
    }
}
