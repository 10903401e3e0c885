//! The host's CPU level and the SIMD helpers the host kernels share: a leaf, below the
//! kernels that use it.
//!
//! The host kernels, the gradient reduce (`reduce.rs`) and AdamW (`optim/adamw.rs`), are
//! written once as portable loops beside their algorithm; those loops are the fallback and
//! the reference that every path matches bit for bit. On x86-64 they also run as AVX-512 and
//! AVX2 bodies picked at run time ([`Simd`]), which live beside their portable loops
//! (`reduce/x86.rs`; `optim/adamw/x86.rs` and `x86/split.rs`). Those bodies need `unsafe`
//! twice over: their instructions may be missing from the CPU (`#[target_feature]`), and
//! intrinsics load and store through raw pointers. Each such `x86` module is fenced the same
//! way: its entry points are safe, each asserts that the CPU has the level's features and
//! that the slices' lengths agree, then calls a `#[target_feature]` body; every `unsafe`
//! block says why the feature is present and why its pointers and lengths are in bounds.
//!
//! Here:
//! - [`Simd`] detects the CPU's level once per process (lowered by `MT_SIMD`);
//! - [`copy_streaming`] and its non-temporal store loops (`x86.rs`), which the reduce's
//!   x86 bodies also write with;
//! - `prefetch` is the portable reduce's cache hint.

use std::sync::OnceLock;

use crate::switches::SimdCeiling;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// The vector instruction set the host kernels (AdamW, gradient reduce) use: the widest the
/// CPU has, lowered by `MT_SIMD=portable|avx2|avx512` (to compare paths in benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    Portable,
    /// x86-64 AVX2.
    Avx2,
    /// x86-64 AVX-512 F + BW + VL.
    Avx512,
}

impl Simd {
    /// The level in use, detected once per process.
    pub fn get() -> Simd {
        static LEVEL: OnceLock<Simd> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let best = [Simd::Avx512, Simd::Avx2]
                .into_iter()
                .find(|s| s.supported())
                .unwrap_or(Simd::Portable);
            let asked = match crate::switches::get().simd {
                Some(SimdCeiling::Portable) => Simd::Portable,
                Some(SimdCeiling::Avx2) => Simd::Avx2,
                Some(SimdCeiling::Avx512) | None => Simd::Avx512,
            };
            best.min(asked)
        })
    }

    /// Whether this CPU runs the level's instructions.
    pub fn supported(self) -> bool {
        match self {
            Simd::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512",
        }
    }
}

/// `d.copy_from_slice(s)` with non-temporal stores where the CPU has them (x86-64 AVX2 or
/// AVX-512): for a destination read next by the disk or a device, whose lines need not be
/// read into the cache first. The same values either way.
pub fn copy_streaming(d: &mut [f32], s: &[f32]) {
    match Simd::get() {
        #[cfg(target_arch = "x86_64")]
        simd @ (Simd::Avx512 | Simd::Avx2) => x86::copy_streaming(simd, d, s),
        _ => d.copy_from_slice(s),
    }
}

/// Hints that `s[at..at + len]` (possibly past its end) will be read soon.
#[inline(always)]
pub(crate) fn prefetch<T>(s: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let p = s.as_ptr().wrapping_add(at) as *const i8;
        for off in (0..len * size_of::<T>()).step_by(64) {
            // SAFETY: SSE is part of x86-64, so the instruction is present; a prefetch never
            // faults, whatever the address, and the pointer is never dereferenced.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (s, at, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every level the CPU has writes the source's bits at every alignment of the destination
    /// and every length around the 16-element lines (head, whole lines, tail).
    #[test]
    fn streaming_copy_equals_copy_at_every_alignment() {
        let src: Vec<f32> = (0..5000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761) | 1))
            .collect();
        let levels = [Simd::Portable, Simd::Avx2, Simd::Avx512];
        for level in levels.into_iter().filter(|l| l.supported()) {
            for offset in 0..17 {
                for len in [0, 1, 7, 15, 16, 17, 31, 33, 64, 100, 1000, 4099] {
                    let mut dst = vec![0.0f32; offset + len + 3];
                    let (s, d) = (&src[..len], &mut dst[offset..offset + len]);
                    match level {
                        #[cfg(target_arch = "x86_64")]
                        Simd::Avx2 | Simd::Avx512 => x86::copy_streaming(level, d, s),
                        _ => copy_streaming(d, s),
                    }
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(d),
                        bits(s),
                        "{level:?}, offset {offset}, {len} elements"
                    );
                    assert!(dst[..offset].iter().all(|&v| v == 0.0), "wrote before");
                    assert!(dst[offset + len..].iter().all(|&v| v == 0.0), "wrote after");
                }
            }
        }
    }
}
