//! bf16 at the bit level: round-to-nearest-even from f32, and the split fp32 master
//! (`memory.master_weights: split`), whose high half is the bf16 store and whose low half a
//! u16 residual.
//!
//! Split: for master bits `b`, the store holds `s = rne(b)` (what it holds anyway) and the
//! residual `r = b & 0xffff`. RNE rounded the truncated high half `b >> 16` up iff
//! `r > 0x8000`, or `r == 0x8000` and `b >> 16` is odd. So `b >> 16 = s - 1` when
//! `r > 0x8000` and `s` when `r < 0x8000`; a tie `r == 0x8000` cannot be told apart, so
//! [`split`] never stores one: it moves a tie one fp32 ulp toward its rounded value (to
//! `r = 0x8001` when it rounds up, `0x7fff` when it rounds down). The store is then exactly
//! the float32 path's, and the master differs from it by one fp32 ulp, only on exact ties
//! (one value in 65536 of uniformly distributed low halves).
//!
//! All of this works on the bit pattern: RNE rounds the magnitude and the sign bit never
//! changes for finite values, a carry out of the mantissa moves into the exponent (up to
//! infinity), and `s - 1` undoes it. Zero and infinity have `r == 0`. A NaN is stored as
//! `half` stores it (high half with the quiet bit set) and joined without the `s - 1`
//! correction, so it comes back as a NaN (quiet, with the same low payload).

use half::bf16;
use rayon::prelude::*;

/// Elements per rayon task of the whole-slice conversions.
const CHUNK: usize = 64 * 1024;

/// f32 to bf16, round to nearest even, NaN kept NaN with the quiet bit set: the bits of
/// `half::bf16::from_f32`, branch-free so that loops over it vectorize.
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    bf16::from_bits(round_bits(x.to_bits()))
}

#[inline(always)]
fn round_bits(b: u32) -> u16 {
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if nan { (b >> 16) | 0x40 } else { rounded }) as u16
}

/// f32 to bf16 rounded stochastically with the 16 random bits `r`: up (in magnitude) with
/// probability (low half of `x`) / 65536, so that the rounding is unbiased, E[result] = x
/// (`memory.master_weights: bfloat16`). Adding `r` to the bit pattern carries into the
/// high half exactly then; a carry out of the mantissa moves into the exponent, as in
/// [`round_bf16`]. NaN and infinity round as [`round_bf16`] does.
#[inline(always)]
pub fn stochastic_round_bf16(x: f32, r: u16) -> bf16 {
    let b = x.to_bits();
    let finite = (b & 0x7f80_0000) != 0x7f80_0000;
    match finite {
        true => bf16::from_bits((b.wrapping_add(u32::from(r)) >> 16) as u16),
        false => round_bf16(x),
    }
}

/// 16 random bits for element `index` of the update numbered `step` of a run seeded with
/// `seed`: a pure function (splitmix64's finalizer over the three), so a stochastic
/// rounding is the same whatever the thread count, chunking or machine.
#[inline(always)]
pub fn rounding_bits(seed: u64, step: u64, index: u64) -> u16 {
    (mix(seed, step, index) >> 48) as u16
}

/// Two independent sets of 16 rounding bits for element `index` of update `step`, from one
/// hash: for Adam's m and v (`memory.moments_dtype: bfloat16`). `seed` is salted, so that
/// they are not a bf16 master's bits of the same run.
#[inline(always)]
pub fn rounding_bits_pair(seed: u64, step: u64, index: u64) -> (u16, u16) {
    let z = mix(seed ^ MOMENTS_SALT, step, index);
    ((z >> 48) as u16, (z >> 32) as u16)
}

/// Separates the moments' rounding bits from the master's ("moments" in ASCII).
const MOMENTS_SALT: u64 = 0x006d_6f6d_656e_7473;

/// splitmix64's finalizer over the three.
#[inline(always)]
fn mix(seed: u64, step: u64, index: u64) -> u64 {
    let mut z =
        seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The store's bf16 (`round_bf16(x)`) and the residual low half of `x`, ties nudged (see
/// the module docs).
#[inline(always)]
pub fn split(x: f32) -> (bf16, u16) {
    let b = x.to_bits();
    let tie = (b & 0xffff) == 0x8000;
    let up = (b >> 16) & 1 == 1;
    let b = match (tie, up) {
        (false, _) => b,
        (true, true) => b.wrapping_add(1),
        (true, false) => b.wrapping_sub(1),
    };
    (bf16::from_bits(round_bits(b)), b as u16)
}

/// The master value whose [`split`] is `(hi, lo)`.
#[inline(always)]
pub fn join(hi: bf16, lo: u16) -> f32 {
    let s = u32::from(hi.to_bits());
    let nan = (s & 0x7fff) > 0x7f80;
    let down = u32::from(lo > 0x8000 && !nan);
    f32::from_bits((s.wrapping_sub(down) << 16) | u32::from(lo))
}

/// [`split`] of every element, in parallel.
pub fn split_slice(x: &[f32], hi: &mut [bf16], lo: &mut [u16]) {
    assert!(hi.len() == x.len() && lo.len() == x.len());
    x.par_chunks(CHUNK)
        .zip(hi.par_chunks_mut(CHUNK))
        .zip(lo.par_chunks_mut(CHUNK))
        .for_each(|((x, hi), lo)| {
            for i in 0..x.len() {
                (hi[i], lo[i]) = split(x[i]);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> Vec<u32> {
        let mut v = vec![
            0x0000_0000,
            0x8000_0000,
            0x3f80_0000,
            0x7f80_0000, // inf
            0xff80_0000, // -inf
            0x7fc0_0000, // NaN
            0xffc0_0000,
            0x7f80_0001, // signalling NaN
            0x7f80_8000, // signalling NaN whose low half looks like a tie
            0x7fbf_ffff,
            0x7f7f_ffff, // f32::MAX: rounds to inf
            0xff7f_ffff,
            0x0080_0000, // MIN_POSITIVE
            0x0000_0001, // smallest denormal
            0x0000_8000, // tie at zero
            0x8000_8000,
            0x3f80_8000, // tie, even below: stays
            0x3f81_8000, // tie, odd below: rounds up
            0xbf81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x3fff_ffff, // carry into the exponent
            0xbfff_ffff,
        ];
        let mut h = 0x1234_5678u32;
        v.extend((0..200_000).map(|_| {
            h ^= h << 13;
            h ^= h >> 17;
            h ^= h << 5;
            h
        }));
        v
    }

    #[test]
    fn rounding_is_half_s() {
        for b in specials() {
            let x = f32::from_bits(b);
            assert_eq!(
                round_bf16(x).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{b:#x}"
            );
        }
    }

    /// Split then join is the identity, except that a tie moves one ulp toward its rounded
    /// value and a NaN comes back quiet; the high half is always the store's rounding.
    #[test]
    fn split_then_join_is_the_identity_but_for_ties() {
        for b in specials() {
            let x = f32::from_bits(b);
            let (hi, lo) = split(x);
            assert_eq!(hi.to_bits(), bf16::from_f32(x).to_bits(), "{b:#x}");
            let y = join(hi, lo);
            if x.is_nan() {
                assert!(y.is_nan(), "{b:#x}");
                assert_eq!(y.to_bits() & 0xffff, lo as u32);
            } else if b & 0xffff == 0x8000 {
                let toward = bf16::from_f32(x).to_f32();
                assert_eq!(y.to_bits().abs_diff(b), 1, "{b:#x}");
                assert!((y - toward).abs() < (x - toward).abs(), "{b:#x}");
                assert_eq!(bf16::from_f32(y), bf16::from_f32(x));
            } else {
                assert_eq!(y.to_bits(), b, "{b:#x}");
            }
        }
    }

    #[test]
    fn slices_match_the_scalars() {
        let x: Vec<f32> = specials().into_iter().map(f32::from_bits).collect();
        let n = x.len();
        let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
        split_slice(&x, &mut hi, &mut lo);
        for i in 0..n {
            let (h, l) = split(x[i]);
            assert_eq!((hi[i].to_bits(), lo[i]), (h.to_bits(), l));
        }
    }

    /// Stochastic rounding is unbiased: over the 65536 values of `r` it rounds up exactly
    /// (low half) times, so the mean of the results is `x` to f64 precision; values
    /// already in bf16 never move; the rounding bits look uniform.
    #[test]
    fn stochastic_rounding_is_unbiased_and_exact_on_bf16_values() {
        for x in [1.000_123_4f32, -3.0417, 1e-30, -7.5e20, 0.333_333_3] {
            let mean: f64 = (0..=u16::MAX)
                .map(|r| f64::from(stochastic_round_bf16(x, r).to_f32()))
                .sum::<f64>()
                / 65536.0;
            assert!(
                (mean - f64::from(x)).abs() <= f64::from(x).abs() * 1e-12,
                "{x}: mean {mean}"
            );
        }
        for x in [1.0f32, -2.5, 0.0, f32::INFINITY] {
            assert!((0..1000).all(|r| stochastic_round_bf16(x, r).to_f32() == x));
        }
        assert!(stochastic_round_bf16(f32::NAN, 7).is_nan());
        // Uniform bits: each of 16 buckets holds 1/16 of 2^16 draws within 5%.
        let mut buckets = [0u32; 16];
        for i in 0..65536 {
            buckets[(rounding_bits(42, 3, i) >> 12) as usize] += 1;
        }
        assert!(
            buckets.iter().all(|&c| (3891..=4301).contains(&c)),
            "{buckets:?}"
        );
        assert_ne!(rounding_bits(42, 3, 5), rounding_bits(42, 4, 5));
    }
}
