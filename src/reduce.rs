//! CPU reduction of W workers' gradient slabs into the fp32 gradient.
//!
//! `dst[i] += src_0[i] + … + src_{W-1}[i]`, each byte read once, partitioned by range over
//! rayon threads. Summing the sources before adding to `dst` makes W workers with one
//! micro-batch each bit-identical to one worker accumulating W micro-batches when W = 2.
//!
//! Host bytes per parameter and step are what bound the host side, so the variants fold in
//! the passes a step would otherwise make over the gradient:
//! - [`assign`] for a step's first micro-batch: `dst = Σ srcs`, bit-identical to zeroing
//!   `dst` then [`accumulate`], without the zeroing pass nor the read of `dst`; on x86 `dst`
//!   is written with non-temporal stores (no read-for-ownership): 4 B/param + the slabs;
//! - `*_sum_sq` for the micro-batch that makes a block final: also returns Σ dst² for the
//!   gradient norm, so the norm needs no second read.
//!
//! The loops are plain Rust that the compiler vectorizes; they are compiled once more
//! under AVX2 and AVX-512 and picked at run time ([`Simd`]). Sources are summed a strip at
//! a time into a small buffer that stays in L1 when needed, so the order of additions
//! (`((s0 + s1) + s2) + …`, then `dst +`) and the single read of every byte are kept.

use half::bf16;
use rayon::prelude::*;

use crate::optim::adamw::Simd;
use crate::shm::Pod;

/// Elements per parallel task (256 KiB of f32 output): big enough to amortize scheduling,
/// small enough to balance. A multiple of 16, so every task has the same alignment.
const CHUNK: usize = 64 * 1024;

/// Elements per strip: the unit of prefetching and of the partial sum of the sources
/// (1 KiB of f32, stays in L1). A multiple of 16 (one cache line of f32).
const STRIP: usize = 256;

/// How far ahead of the strip being summed its lines are prefetched (2 KiB of f32).
const PREFETCH_AHEAD: usize = 512;

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

/// `dst += Σ srcs` elementwise; every source must be as long as `dst`.
pub fn accumulate<T: GradElem>(dst: &mut [f32], srcs: &[&[T]]) {
    reduce::<T, false, false>(dst, srcs);
}

/// [`accumulate`], also returning Σ dst² over the result (f64), computed in the same pass:
/// the gradient-norm contribution of a block whose gradient this makes final, without
/// reading it again. Deterministic: the same bits for every thread count and SIMD level.
pub fn accumulate_sum_sq<T: GradElem>(dst: &mut [f32], srcs: &[&[T]]) -> f64 {
    reduce::<T, false, true>(dst, srcs)
}

/// `dst = Σ srcs`: the same bits as `dst.fill(0.0)` then [`accumulate`] (the sum plus
/// `+0.0`, so a zero sum is `+0.0`), without reading `dst`.
pub fn assign<T: GradElem>(dst: &mut [f32], srcs: &[&[T]]) {
    reduce::<T, true, false>(dst, srcs);
}

/// [`assign`], also returning Σ dst² as [`accumulate_sum_sq`] does.
pub fn assign_sum_sq<T: GradElem>(dst: &mut [f32], srcs: &[&[T]]) -> f64 {
    reduce::<T, true, true>(dst, srcs)
}

fn reduce<T: GradElem, const ASSIGN: bool, const SQ: bool>(dst: &mut [f32], srcs: &[&[T]]) -> f64 {
    for s in srcs {
        assert_eq!(
            s.len(),
            dst.len(),
            "gradient source length differs from destination"
        );
    }
    let simd = Simd::get();
    if dst.len() <= CHUNK {
        return reduce_chunk::<T, ASSIGN, SQ>(simd, dst, srcs);
    }
    let per_chunk = |(c, d): (usize, &mut [f32])| {
        let base = c * CHUNK;
        let parts: Vec<&[T]> = srcs.iter().map(|s| &s[base..base + d.len()]).collect();
        reduce_chunk::<T, ASSIGN, SQ>(simd, d, &parts)
    };
    let chunks = dst.par_chunks_mut(CHUNK).enumerate();
    if !SQ {
        chunks.for_each(|c| {
            per_chunk(c);
        });
        return 0.0;
    }
    // Chunk sums added in chunk order, so the result does not depend on scheduling.
    let sums: Vec<f64> = chunks.map(per_chunk).collect();
    sums.iter().sum()
}

fn reduce_chunk<T: GradElem, const ASSIGN: bool, const SQ: bool>(
    simd: Simd,
    d: &mut [f32],
    parts: &[&[T]],
) -> f64 {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => {
            assert!(simd.supported());
            // SAFETY: the CPU has the features (checked above).
            unsafe { x86::sum_avx512::<T, ASSIGN, SQ>(d, parts) }
        }
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => {
            assert!(simd.supported());
            // SAFETY: as above.
            unsafe { x86::sum_avx2::<T, ASSIGN, SQ>(d, parts) }
        }
        _ => sum_into::<T, false, ASSIGN, SQ>(d, parts, |d, s| d.copy_from_slice(s)),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GradElem, sum_into};

    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn sum_avx512<T: GradElem, const ASSIGN: bool, const SQ: bool>(
        d: &mut [f32],
        parts: &[&[T]],
    ) -> f64 {
        // SAFETY (of the call in the closure): this function runs only with AVX-512 F.
        let sq = sum_into::<T, true, ASSIGN, SQ>(d, parts, |d, s| unsafe { stream512(d, s) });
        // Non-temporal stores are weakly ordered: fence before the caller publishes `d`.
        _mm_sfence();
        sq
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_avx2<T: GradElem, const ASSIGN: bool, const SQ: bool>(
        d: &mut [f32],
        parts: &[&[T]],
    ) -> f64 {
        // SAFETY (of the call in the closure): this function runs only with AVX2.
        let sq = sum_into::<T, true, ASSIGN, SQ>(d, parts, |d, s| unsafe { stream256(d, s) });
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
            d.len() == s.len()
                && d.len().is_multiple_of(16)
                && d.as_ptr().addr().is_multiple_of(64)
        );
        for i in (0..d.len()).step_by(16) {
            // SAFETY: i + 16 <= len; d + i is 64-byte aligned.
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
            // SAFETY: i + 8 <= len; d + i is 32-byte aligned.
            unsafe { _mm256_stream_ps(d.as_mut_ptr().add(i), _mm256_loadu_ps(s.as_ptr().add(i))) }
        }
    }
}

/// `d += Σ parts` (or with `ASSIGN`, `d = Σ parts + 0.0`), sources summed first, in rank
/// order, a strip at a time. With `PREFETCH` (the x86 paths), each strip asks for the lines
/// `PREFETCH_AHEAD` elements ahead of it, and `ASSIGN` writes the 64-byte-aligned whole
/// lines of `d` through `stream` (non-temporal); `stream(d, s)` must copy `s` into `d`.
/// With `SQ`, returns Σ d² of the result (f64) over 16 interleaved partial sums.
#[inline(always)]
fn sum_into<T: GradElem, const PREFETCH: bool, const ASSIGN: bool, const SQ: bool>(
    d: &mut [f32],
    parts: &[&[T]],
    stream: impl Fn(&mut [f32], &[f32]),
) -> f64 {
    let n = d.len();
    // Elements before `d` is 64-byte aligned: a strip of their own, written plainly, so
    // the other strips stream whole lines.
    let head = if PREFETCH && ASSIGN {
        ((64 - d.as_ptr() as usize % 64) % 64 / 4).min(n)
    } else {
        0
    };
    let mut acc = [0.0f32; STRIP];
    let mut sq = [0.0f64; 16];
    let mut lo = 0;
    while lo < n {
        let len = if lo < head { head } else { STRIP.min(n - lo) };
        if PREFETCH {
            if !ASSIGN {
                prefetch(d, lo + PREFETCH_AHEAD, len);
            }
            for p in parts {
                prefetch(p, lo + PREFETCH_AHEAD, len);
            }
        }
        let d = &mut d[lo..lo + len];
        let acc = &mut acc[..len];
        match (ASSIGN, parts) {
            (false, []) => {}
            (false, [a]) => {
                let a = &a[lo..lo + len];
                for i in 0..len {
                    d[i] += a[i].to_f32();
                }
            }
            (false, [a, b]) => {
                let (a, b) = (&a[lo..lo + len], &b[lo..lo + len]);
                for i in 0..len {
                    d[i] += a[i].to_f32() + b[i].to_f32();
                }
            }
            _ => {
                sum_parts(acc, parts, lo);
                if ASSIGN {
                    // + 0.0 as `0.0 + sum` would: exact, and turns -0.0 into +0.0.
                    acc.iter_mut().for_each(|x| *x += 0.0);
                    let lines = if PREFETCH && lo >= head {
                        len / 16 * 16
                    } else {
                        0
                    };
                    if lines > 0 {
                        stream(&mut d[..lines], &acc[..lines]);
                    }
                    d[lines..].copy_from_slice(&acc[lines..]);
                } else {
                    for i in 0..len {
                        d[i] += acc[i];
                    }
                }
            }
        }
        if SQ {
            // Streamed lines have left the cache; the copy in `acc` has not. Lane j sums the
            // elements with index ≡ j (mod 16), in index order, whatever the strips.
            sq.rotate_left(lo % 16);
            sum_sq16(&mut sq, if ASSIGN { acc } else { d });
            sq.rotate_right(lo % 16);
        }
        lo += len;
    }
    sq.iter().sum()
}

/// `acc = ((p0 + p1) + p2) + …` over `parts[..][lo..lo + acc.len()]` (zero for no parts).
#[inline(always)]
fn sum_parts<T: GradElem>(acc: &mut [f32], parts: &[&[T]], lo: usize) {
    let len = acc.len();
    match parts {
        [] => acc.fill(0.0),
        [a] => {
            let a = &a[lo..lo + len];
            for i in 0..len {
                acc[i] = a[i].to_f32();
            }
        }
        [a, b, rest @ ..] => {
            let (a, b) = (&a[lo..lo + len], &b[lo..lo + len]);
            for i in 0..len {
                acc[i] = a[i].to_f32() + b[i].to_f32();
            }
            for p in rest {
                let p = &p[lo..lo + len];
                for i in 0..len {
                    acc[i] += p[i].to_f32();
                }
            }
        }
    }
}

/// Adds x[k]² to lane k mod 16, in order of k: vectorizable, and the same operations
/// whatever the vector width.
#[inline(always)]
fn sum_sq16(sq: &mut [f64; 16], x: &[f32]) {
    let (body, tail) = x.as_chunks::<16>();
    // Two halves of 8 lanes: what the vectorizer maps onto two zmm accumulators.
    let (mut lo, mut hi): ([f64; 8], [f64; 8]) = (
        std::array::from_fn(|j| sq[j]),
        std::array::from_fn(|j| sq[8 + j]),
    );
    for c in body {
        lo = std::array::from_fn(|j| lo[j] + f64::from(c[j]) * f64::from(c[j]));
        hi = std::array::from_fn(|j| hi[j] + f64::from(c[8 + j]) * f64::from(c[8 + j]));
    }
    *sq = std::array::from_fn(|j| if j < 8 { lo[j] } else { hi[j - 8] });
    for (j, &v) in tail.iter().enumerate() {
        sq[j] += f64::from(v) * f64::from(v);
    }
}

/// Hints that `s[at..at + len]` (possibly past its end) will be read soon.
#[inline(always)]
fn prefetch<T>(s: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = s.as_ptr().wrapping_add(at) as *const i8;
        for off in (0..len * size_of::<T>()).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (s, at, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_all_paths<T: GradElem>(make: impl Fn(f32) -> T) {
        let n = 3 * CHUNK + 17;
        let levels = [Simd::Portable, Simd::Avx2, Simd::Avx512];
        for w in 1..=5 {
            let srcs: Vec<Vec<T>> = (0..w)
                .map(|r| {
                    (0..n)
                        .map(|i| make(((i * 7 + r * 13) % 101) as f32 * 0.01 - 0.3))
                        .collect()
                })
                .collect();
            let dst0: Vec<f32> = (0..n).map(|i| i as f32 * 0.37).collect();
            let expect: Vec<f32> = (0..n)
                .map(|i| {
                    let s = srcs[1..]
                        .iter()
                        .fold(srcs[0][i].to_f32(), |a, s| a + s[i].to_f32());
                    dst0[i] + s
                })
                .collect();
            let refs: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
            let mut dst = dst0.clone();
            accumulate(&mut dst, &refs);
            assert_eq!(dst, expect, "world {w}");
            for simd in levels.into_iter().filter(|s| s.supported()) {
                for off in [0, 3] {
                    let mut dst = dst0.clone();
                    let parts: Vec<&[T]> = refs.iter().map(|s| &s[off..]).collect();
                    reduce_chunk::<T, false, false>(simd, &mut dst[off..], &parts);
                    assert_eq!(
                        dst[off..],
                        expect[off..],
                        "world {w}, {simd:?}, offset {off}"
                    );
                }
            }
        }
    }

    #[test]
    fn sum_of_squares_is_the_result_s_and_path_independent() {
        let n = 2 * CHUNK + 1001;
        let a: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32((i % 37) as f32 * 0.1))
            .collect();
        let b: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32((i % 11) as f32 - 5.0))
            .collect();
        let dst0: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.01).collect();
        let mut dst = dst0.clone();
        let sq = accumulate_sum_sq(&mut dst, &[&a[..], &b[..]]);
        let mut plain = dst0.clone();
        accumulate(&mut plain, &[&a[..], &b[..]]);
        assert_eq!(dst, plain);
        let want: f64 = dst.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((sq - want).abs() <= 1e-12 * want, "{sq} vs {want}");
        let chunk = |simd: Simd| {
            let mut d = dst0[..CHUNK].to_vec();
            reduce_chunk::<bf16, false, true>(simd, &mut d, &[&a[..CHUNK], &b[..CHUNK]]).to_bits()
        };
        for simd in [Simd::Avx2, Simd::Avx512]
            .into_iter()
            .filter(|s| s.supported())
        {
            assert_eq!(chunk(simd), chunk(Simd::Portable), "{simd:?}");
        }
    }

    /// `assign` gives the bits of zeroing then accumulating, on every path, whatever the
    /// alignment of `dst`, including the sign of zero sums.
    fn check_assign<T: GradElem>(make: impl Fn(f32) -> T) {
        let n = 2 * CHUNK + 1000;
        let x = |i: usize, r: usize| match (i + r) % 5 {
            0 => -0.0,
            _ => ((i * 7 + r * 13) % 101) as f32 * 0.01 - 0.5,
        };
        for w in 0..=5 {
            let srcs: Vec<Vec<T>> = (0..w)
                .map(|r| (0..n).map(|i| make(x(i, r))).collect())
                .collect();
            let refs: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
            let mut want = vec![0.0f32; n];
            accumulate(&mut want, &refs);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut got = vec![f32::NAN; n];
            let sq = assign_sum_sq(&mut got, &refs);
            assert_eq!(bits(&got), bits(&want), "world {w}");
            let mut again = want.clone();
            again.fill(0.0);
            assert_eq!(sq.to_bits(), accumulate_sum_sq(&mut again, &refs).to_bits());
            for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
                if !simd.supported() {
                    continue;
                }
                for off in [0, 1, 3, 15] {
                    let mut got = vec![f32::NAN; n];
                    let parts: Vec<&[T]> = refs.iter().map(|s| &s[off..]).collect();
                    let sq = reduce_chunk::<T, true, true>(simd, &mut got[off..], &parts);
                    assert_eq!(bits(&got[off..]), bits(&want[off..]), "{w} {simd:?} {off}");
                    let mut zero = vec![0.0f32; n - off];
                    let sq0 = reduce_chunk::<T, false, true>(Simd::Portable, &mut zero, &parts);
                    assert_eq!(sq.to_bits(), sq0.to_bits(), "{w} {simd:?} {off}");
                }
            }
        }
    }

    #[test]
    fn assign_is_zero_then_accumulate() {
        check_assign(|x| x);
        check_assign(bf16::from_f32);
    }

    #[test]
    fn matches_serial_sum_for_any_world_size() {
        check_all_paths(|x| x);
        check_all_paths(bf16::from_f32);
    }

    #[test]
    fn bf16_sources_widen_exactly() {
        let a = [bf16::from_f32(1.5); 10];
        let b = [bf16::from_f32(-0.25); 10];
        let mut dst = vec![1.0f32; 10];
        accumulate(&mut dst, &[&a[..], &b[..]]);
        assert!(dst.iter().all(|&x| x == 2.25));
        let inf = [
            bf16::INFINITY,
            bf16::NEG_INFINITY,
            bf16::NAN,
            bf16::MIN_POSITIVE,
        ];
        for x in inf {
            assert_eq!(
                GradElem::to_f32(x).to_bits(),
                bf16::to_f32(x).to_bits(),
                "{x:?}"
            );
        }
    }
}
