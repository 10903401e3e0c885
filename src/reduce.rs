//! CPU reduction of W workers' gradient slabs into the gradient accumulator (fp32, or bf16
//! with `memory.grad_dtype: bfloat16`).
//!
//! `dst[i] += src_0[i] + … + src_{W-1}[i]`, each byte read once, partitioned by range over
//! rayon threads. A bf16 `dst` is widened, the sum done in f32 and rounded once (RNE) when
//! written; the Σ dst² of the `*_sum_sq` variants is over the values as stored, so the
//! norm, the clip and AdamW all see the same gradient. Summing the sources before adding to `dst` makes W workers with one
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
//! under AVX2 and AVX-512 (in `x86.rs`, which adds the non-temporal stores) and
//! picked at run time ([`Simd`]). Sources are summed a strip at a time into a small buffer
//! that stays in L1 when needed, so the order of additions (`((s0 + s1) + s2) + …`, then
//! `dst +`) and the single read of every byte are kept.

use rayon::prelude::*;

use crate::elem::{GradAcc, GradElem};
use crate::simd::{Simd, prefetch};

/// Elements per parallel task (256 KiB of f32 output): big enough to amortize scheduling,
/// small enough to balance. A multiple of 16, so every task has the same alignment.
const CHUNK: usize = 64 * 1024;

/// Elements per strip: the unit of prefetching and of the partial sum of the sources
/// (1 KiB of f32, stays in L1). A multiple of 16 (one cache line of f32).
const STRIP: usize = 256;

/// How far ahead of the strip being summed its lines are prefetched (2 KiB of f32).
const PREFETCH_AHEAD: usize = 512;

/// `dst += Σ srcs` elementwise; every source must be as long as `dst`.
pub fn accumulate<T: GradElem, D: GradAcc>(dst: &mut [D], srcs: &[&[T]]) {
    reduce::<T, D, false, false>(dst, srcs);
}

/// [`accumulate`], also returning Σ dst² over the result (f64), computed in the same pass:
/// the gradient-norm contribution of a block whose gradient this makes final, without
/// reading it again. Deterministic: the same bits for every thread count and SIMD level.
pub fn accumulate_sum_sq<T: GradElem, D: GradAcc>(dst: &mut [D], srcs: &[&[T]]) -> f64 {
    reduce::<T, D, false, true>(dst, srcs)
}

/// `dst = Σ srcs`: the same bits as `dst.fill(0.0)` then [`accumulate`] (the sum plus
/// `+0.0`, so a zero sum is `+0.0`), without reading `dst`.
pub fn assign<T: GradElem, D: GradAcc>(dst: &mut [D], srcs: &[&[T]]) {
    reduce::<T, D, true, false>(dst, srcs);
}

/// [`assign`], also returning Σ dst² as [`accumulate_sum_sq`] does.
pub fn assign_sum_sq<T: GradElem, D: GradAcc>(dst: &mut [D], srcs: &[&[T]]) -> f64 {
    reduce::<T, D, true, true>(dst, srcs)
}

fn reduce<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    dst: &mut [D],
    srcs: &[&[T]],
) -> f64 {
    let n = dst.len();
    reduce_segments::<T, D, ASSIGN, SQ>(dst, srcs, &[n])[0]
}

/// [`assign`] / [`accumulate`] (`assign`), with Σ dst² (`sum_sq`), over consecutive
/// segments of `dst` of lengths `segs` in one parallel pass: the bits of one call per
/// segment, each segment's Σ dst² returned (zeros without `sum_sq`). Each segment is
/// chunked from its own start and its chunk sums added in chunk order, as a call of its
/// own would; the launcher passes the tensors of a gradient part this way, so that many
/// small tensors (a MoE layer's experts) do not each pay a fork-join.
pub fn reduce_segments_into<T: GradElem, D: GradAcc>(
    dst: &mut [D],
    srcs: &[&[T]],
    segs: &[usize],
    assign: bool,
    sum_sq: bool,
) -> Vec<f64> {
    match (assign, sum_sq) {
        (true, true) => reduce_segments::<T, D, true, true>(dst, srcs, segs),
        (false, true) => reduce_segments::<T, D, false, true>(dst, srcs, segs),
        (true, false) => reduce_segments::<T, D, true, false>(dst, srcs, segs),
        (false, false) => reduce_segments::<T, D, false, false>(dst, srcs, segs),
    }
}

fn reduce_segments<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    dst: &mut [D],
    srcs: &[&[T]],
    segs: &[usize],
) -> Vec<f64> {
    for s in srcs {
        assert_eq!(
            s.len(),
            dst.len(),
            "gradient source length differs from destination"
        );
    }
    assert_eq!(segs.iter().sum::<usize>(), dst.len(), "segments cover dst");
    let simd = Simd::get();
    // Every chunk of every segment: (segment, first element, its part of dst).
    let mut chunks: Vec<(usize, usize, &mut [D])> = Vec::new();
    let (mut rest, mut at) = (dst, 0);
    for (i, &len) in segs.iter().enumerate() {
        let (seg, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rest = tail;
        for (c, d) in seg.chunks_mut(CHUNK).enumerate() {
            chunks.push((i, at + c * CHUNK, d));
        }
        at += len;
    }
    let per_chunk = |(i, start, d): (usize, usize, &mut [D])| {
        let parts: Vec<&[T]> = srcs.iter().map(|s| &s[start..start + d.len()]).collect();
        (i, reduce_chunk::<T, D, ASSIGN, SQ>(simd, d, &parts))
    };
    let sums: Vec<(usize, f64)> = match chunks.len() {
        1 => chunks.into_iter().map(per_chunk).collect(),
        _ => chunks.into_par_iter().map(per_chunk).collect(),
    };
    // Chunk sums added in chunk order, so the result does not depend on scheduling; a
    // segment of one chunk is that chunk's sum.
    let mut out = vec![0.0; segs.len()];
    let mut i = 0;
    while i < sums.len() {
        let seg = sums[i].0;
        let end = i + sums[i..].iter().take_while(|(s, _)| *s == seg).count();
        out[seg] = match end - i {
            1 => sums[i].1,
            _ => sums[i..end].iter().map(|(_, x)| x).sum(),
        };
        i = end;
    }
    out
}

fn reduce_chunk<T: GradElem, D: GradAcc, const ASSIGN: bool, const SQ: bool>(
    simd: Simd,
    d: &mut [D],
    parts: &[&[T]],
) -> f64 {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => x86::sum_avx512::<T, D, ASSIGN, SQ>(d, parts),
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => x86::sum_avx2::<T, D, ASSIGN, SQ>(d, parts),
        _ => sum_into::<T, D, false, ASSIGN, SQ>(d, parts, |d, s| d.copy_from_slice(s)),
    }
}

/// `d += Σ parts` (or with `ASSIGN`, `d = Σ parts + 0.0`), sources summed first, in rank
/// order, a strip at a time, in f32, rounded once into `D`. With `PREFETCH` (the x86
/// paths), each strip asks for the lines `PREFETCH_AHEAD` elements ahead of it, and
/// `ASSIGN` writes the 64-byte-aligned whole lines of an f32 `d` through `stream`
/// (non-temporal); `stream(d, s)` must copy `s` into `d`. With `SQ`, returns Σ d² of the
/// result as stored (f64) over 16 interleaved partial sums.
#[inline(always)]
pub(crate) fn sum_into<
    T: GradElem,
    D: GradAcc,
    const PREFETCH: bool,
    const ASSIGN: bool,
    const SQ: bool,
>(
    d: &mut [D],
    parts: &[&[T]],
    stream: impl Fn(&mut [f32], &[f32]),
) -> f64 {
    let n = d.len();
    let streamed = PREFETCH && ASSIGN && D::STREAM;
    // Elements before `d` is 64-byte aligned: a strip of their own, written plainly, so
    // the other strips stream whole lines.
    let head = if streamed {
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
                    d[i] = D::round(d[i].to_f32() + a[i].to_f32());
                }
            }
            (false, [a, b]) => {
                let (a, b) = (&a[lo..lo + len], &b[lo..lo + len]);
                for i in 0..len {
                    d[i] = D::round(d[i].to_f32() + (a[i].to_f32() + b[i].to_f32()));
                }
            }
            _ => {
                sum_parts(acc, parts, lo);
                if ASSIGN {
                    // + 0.0 as `0.0 + sum` would: exact, and turns -0.0 into +0.0.
                    acc.iter_mut().for_each(|x| *x += 0.0);
                    let lines = if streamed && lo >= head {
                        len / 16 * 16
                    } else {
                        0
                    };
                    if lines > 0 {
                        let f = D::as_f32_mut(&mut d[..lines]).expect("streamed only into f32");
                        stream(f, &acc[..lines]);
                    }
                    for i in lines..len {
                        d[i] = D::round(acc[i]);
                    }
                } else {
                    for i in 0..len {
                        d[i] = D::round(d[i].to_f32() + acc[i]);
                    }
                }
            }
        }
        if SQ {
            // Streamed lines have left the cache; the copy in `acc` (exact for f32) has
            // not. Lane j sums the elements with index ≡ j (mod 16), in index order,
            // whatever the strips.
            sq.rotate_left(lo % 16);
            if ASSIGN && D::STREAM {
                sum_sq16(&mut sq, acc);
            } else {
                sum_sq16(&mut sq, d);
            }
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
fn sum_sq16<X: GradElem>(sq: &mut [f64; 16], x: &[X]) {
    let sq64 = |v: X| f64::from(v.to_f32()) * f64::from(v.to_f32());
    let (body, tail) = x.as_chunks::<16>();
    // Two halves of 8 lanes: what the vectorizer maps onto two zmm accumulators.
    let (mut lo, mut hi): ([f64; 8], [f64; 8]) = (
        std::array::from_fn(|j| sq[j]),
        std::array::from_fn(|j| sq[8 + j]),
    );
    for c in body {
        lo = std::array::from_fn(|j| lo[j] + sq64(c[j]));
        hi = std::array::from_fn(|j| hi[j] + sq64(c[8 + j]));
    }
    *sq = std::array::from_fn(|j| if j < 8 { lo[j] } else { hi[j - 8] });
    for (j, &v) in tail.iter().enumerate() {
        sq[j] += sq64(v);
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

#[cfg(test)]
mod tests;
