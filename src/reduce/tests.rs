use half::bf16;

use crate::elem::bits::round_bf16;

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
                reduce_chunk::<T, f32, false, false>(simd, &mut dst[off..], &parts);
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
        reduce_chunk::<bf16, f32, false, true>(simd, &mut d, &[&a[..CHUNK], &b[..CHUNK]]).to_bits()
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
                let sq = reduce_chunk::<T, f32, true, true>(simd, &mut got[off..], &parts);
                assert_eq!(bits(&got[off..]), bits(&want[off..]), "{w} {simd:?} {off}");
                let mut zero = vec![0.0f32; n - off];
                let sq0 = reduce_chunk::<T, f32, false, true>(Simd::Portable, &mut zero, &parts);
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

/// A bf16 accumulator holds the f32 computation rounded once (the sources summed in
/// rank order, then added to the widened accumulator), on every path and alignment,
/// for the first micro-batch and the next; Σ d² is over the stored values, and every
/// path gives the portable path's bits.
fn check_bf16_acc<T: GradElem>(make: impl Fn(f32) -> T) {
    let n = 2 * CHUNK + 1000;
    let x = |i: usize, r: usize| match (i + r) % 7 {
        0 => -0.0,
        _ => ((i * 7 + r * 13) % 101) as f32 * 0.0137 - 0.5,
    };
    let levels = [Simd::Portable, Simd::Avx2, Simd::Avx512];
    for w in 0..=4 {
        let srcs: Vec<Vec<T>> = (0..w)
            .map(|r| (0..n).map(|i| make(x(i, r))).collect())
            .collect();
        let refs: Vec<&[T]> = srcs.iter().map(|s| s.as_slice()).collect();
        let d0: Vec<bf16> = (0..n).map(|i| round_bf16(x(i, 9) * 3.0 + 0.0)).collect();
        let sum = |i: usize| match srcs.split_first() {
            None => 0.0,
            Some((a, rest)) => rest.iter().fold(a[i].to_f32(), |s, p| s + p[i].to_f32()),
        };
        let want_acc: Vec<u16> = (0..n)
            .map(|i| round_bf16(d0[i].to_f32() + sum(i)).to_bits())
            .collect();
        let want_set: Vec<u16> = (0..n).map(|i| round_bf16(0.0 + sum(i)).to_bits()).collect();
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let sq_of = |v: &[bf16]| -> f64 { v.iter().map(|x| f64::from(x.to_f32()).powi(2)).sum() };
        let mut acc = d0.clone();
        let sq = accumulate_sum_sq(&mut acc, &refs);
        assert_eq!(bits(&acc), want_acc, "world {w}");
        assert!((sq - sq_of(&acc)).abs() <= 1e-12 * sq_of(&acc), "world {w}");
        // Within one bf16 rounding of the f32 accumulator's result.
        let mut f = d0.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        accumulate(&mut f, &refs);
        for (a, b) in acc.iter().zip(&f) {
            assert!((a.to_f32() - b).abs() <= b.abs() / 256.0, "{a} vs {b}");
        }
        let mut set = vec![bf16::NAN; n];
        assign(&mut set, &refs);
        assert_eq!(bits(&set), want_set, "world {w}");
        for simd in levels.into_iter().filter(|s| s.supported()) {
            for off in [0, 1, 3, 15] {
                let parts: Vec<&[T]> = refs.iter().map(|s| &s[off..]).collect();
                let mut got = d0.clone();
                let sq_a = reduce_chunk::<T, bf16, false, true>(simd, &mut got[off..], &parts);
                assert_eq!(bits(&got[off..]), want_acc[off..], "{w} {simd:?} {off}");
                let mut base = d0.clone();
                let sq_p =
                    reduce_chunk::<T, bf16, false, true>(Simd::Portable, &mut base[off..], &parts);
                assert_eq!(sq_a.to_bits(), sq_p.to_bits(), "{w} {simd:?} {off}");
                let mut got = vec![bf16::NAN; n];
                let sq_s = reduce_chunk::<T, bf16, true, true>(simd, &mut got[off..], &parts);
                assert_eq!(bits(&got[off..]), want_set[off..], "{w} {simd:?} {off}");
                let mut zero = vec![bf16::ZERO; n - off];
                let sq0 = reduce_chunk::<T, bf16, false, true>(Simd::Portable, &mut zero, &parts);
                assert_eq!(sq_s.to_bits(), sq0.to_bits(), "{w} {simd:?} {off}");
            }
        }
    }
}

#[test]
fn bf16_accumulator_rounds_once_per_micro_batch() {
    check_bf16_acc(|x| x);
    check_bf16_acc(bf16::from_f32);
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

/// Segments reduced in one pass give each segment's call of its own: the same dst bits
/// and the same Σ dst², for both accumulator dtypes, assign and accumulate, segments that
/// end off the chunk grid, one of them empty.
#[test]
fn segments_in_one_pass_equal_one_call_each() {
    let segs = [CHUNK + 5, 3, 0, 2 * CHUNK - 1, 700];
    let n: usize = segs.iter().sum();
    let val = |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2003) as f32 * 1e-3 - 1.0;
    let srcs: Vec<Vec<bf16>> = (0..3)
        .map(|r| (0..n).map(|i| bf16::from_f32(val(i, r))).collect())
        .collect();
    let refs: Vec<&[bf16]> = srcs.iter().map(|s| s.as_slice()).collect();
    fn check<D: GradAcc + PartialEq + std::fmt::Debug>(
        dst0: Vec<D>,
        refs: &[&[bf16]],
        segs: &[usize],
    ) {
        for assign in [true, false] {
            let mut one = dst0.clone();
            let got = reduce_segments_into(&mut one, refs, segs, assign, true);
            let (mut each, mut want, mut at) = (dst0.clone(), Vec::new(), 0);
            for &len in segs {
                let d = &mut each[at..at + len];
                let s: Vec<&[bf16]> = refs.iter().map(|r| &r[at..at + len]).collect();
                want.push(match assign {
                    true => assign_sum_sq(d, &s),
                    false => accumulate_sum_sq(d, &s),
                });
                at += len;
            }
            assert!(one == each, "dst differs (assign {assign})");
            let bits = |x: &[f64]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "sums differ (assign {assign})");
            let plain = reduce_segments_into(&mut dst0.clone(), refs, segs, assign, false);
            assert!(plain.iter().all(|&x| x == 0.0));
        }
    }
    check(
        (0..n).map(|i| val(i, 9)).collect::<Vec<f32>>(),
        &refs,
        &segs,
    );
    check(
        (0..n)
            .map(|i| bf16::from_f32(val(i, 9)))
            .collect::<Vec<bf16>>(),
        &refs,
        &segs,
    );
}
