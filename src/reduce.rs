//! CPU reduction of W workers' gradient slabs into the fp32 gradient.
//!
//! `dst[i] += src_0[i] + … + src_{W-1}[i]`, each byte read once, partitioned by range over
//! rayon threads. Summing the sources before adding to `dst` makes W workers with one
//! micro-batch each bit-identical to one worker accumulating W micro-batches when W = 2.

use half::bf16;
use rayon::prelude::*;

use crate::shm::Pod;

/// Elements per parallel task (256 KiB of f32 output): big enough to amortize scheduling,
/// small enough to balance.
const CHUNK: usize = 64 * 1024;

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
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// `dst += Σ srcs` elementwise; every source must be as long as `dst`.
pub fn accumulate<T: GradElem>(dst: &mut [f32], srcs: &[&[T]]) {
    for s in srcs {
        assert_eq!(
            s.len(),
            dst.len(),
            "gradient source length differs from destination"
        );
    }
    dst.par_chunks_mut(CHUNK).enumerate().for_each(|(c, d)| {
        let base = c * CHUNK;
        let parts: Vec<&[T]> = srcs.iter().map(|s| &s[base..base + d.len()]).collect();
        accumulate_chunk(d, &parts);
    });
}

#[inline]
fn accumulate_chunk<T: GradElem>(d: &mut [f32], parts: &[&[T]]) {
    match parts {
        [] => {}
        [a] => d.iter_mut().zip(*a).for_each(|(d, a)| *d += a.to_f32()),
        [a, b] => d
            .iter_mut()
            .zip(a.iter().zip(*b))
            .for_each(|(d, (a, b))| *d += a.to_f32() + b.to_f32()),
        [first, rest @ ..] => {
            for (i, d) in d.iter_mut().enumerate() {
                let mut s = first[i].to_f32();
                for p in rest {
                    s += p[i].to_f32();
                }
                *d += s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_serial_sum_for_any_world_size() {
        let n = 3 * CHUNK + 17;
        for w in 1..=4 {
            let srcs: Vec<Vec<f32>> = (0..w)
                .map(|r| {
                    (0..n)
                        .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.01)
                        .collect()
                })
                .collect();
            let refs: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
            let mut dst: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let expect: Vec<f32> = (0..n)
                .map(|i| i as f32 + srcs.iter().map(|s| s[i]).fold(0.0, |a, b| a + b))
                .collect();
            accumulate(&mut dst, &refs);
            assert_eq!(dst, expect, "world {w}");
        }
    }

    #[test]
    fn bf16_sources_widen_exactly() {
        let a = vec![bf16::from_f32(1.5); 10];
        let b = vec![bf16::from_f32(-0.25); 10];
        let mut dst = vec![1.0f32; 10];
        accumulate(&mut dst, &[&a[..], &b[..]]);
        assert!(dst.iter().all(|&x| x == 2.25));
    }
}
