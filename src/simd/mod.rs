//! The one home of the host kernels' explicit SIMD and of its `unsafe`.
//!
//! The host kernels, the gradient reduce (`reduce.rs`) and AdamW (`optim/adamw.rs`), are
//! written once as portable loops beside their algorithm; those loops are the fallback and
//! the reference that every path matches bit for bit. On x86-64 they also run as AVX-512 and
//! AVX2 bodies picked at run time ([`Simd`]). Those bodies need `unsafe` twice over: their
//! instructions may be missing from the CPU (`#[target_feature]`), and intrinsics load and
//! store through raw pointers. This module fences both:
//! - [`Simd`] detects the CPU's level once per process (lowered by `MT_SIMD`);
//! - the entry points in `x86` are safe: each asserts that the CPU has the level's
//!   features and that the slices' lengths agree, then calls a `#[target_feature]` body;
//!   every `unsafe` block in here says why the feature is present and why its pointers
//!   and lengths are in bounds;
//! - `prefetch` is the portable reduce's cache hint.
//!
//! Layout: `x86/reduce.rs` (the reduce's strip loop compiled under AVX2 / AVX-512, with
//! non-temporal stores), `x86/adamw.rs` (the AdamW update of an fp32 master), and
//! `x86/adamw/split.rs` (the same update of a split master).

use std::sync::OnceLock;

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
            let asked = match std::env::var("MT_SIMD").as_deref() {
                Ok("portable") => Simd::Portable,
                Ok("avx2") => Simd::Avx2,
                _ => Simd::Avx512,
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
