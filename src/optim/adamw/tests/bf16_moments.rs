//! Adam moments held in bf16 (`memory.moments_dtype: bfloat16`): the weights and the
//! rounded moments against the fp32-moment update, the two-pass form, and what stochastic
//! rounding keeps moving.

use super::*;

/// bf16 moments: the weights are bit for bit those of the fp32-moment update from the
/// widened moments (for every master mode and both gradient dtypes, across chunk and
/// widening boundaries), and the stored moments are that update's m and v rounded
/// stochastically with the element's own bits.
#[test]
fn bf16_moments_are_the_fp32_update_with_the_moments_rounded_stochastically() {
    let n = 2 * CHUNK + 1500;
    let (first, seed, hp) = (123_457u64, 5u64, hp7());
    let g32 = spread(n, 22);
    let g16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
    let mb: Vec<bf16> = spread(n, 23).iter().map(|&x| bf16::from_f32(x)).collect();
    let vb: Vec<bf16> = spread(n, 24)
        .iter()
        .map(|&x| bf16::from_f32(x * x))
        .collect();
    let widen = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let (x0, hi0, lo0, b0) = weights_cases(n);
    for bf in [false, true] {
        for case in 0..3 {
            // The fp32-moment update of the same weights from the widened moments.
            let (mut m32, mut v32) = (widen(&mb), widen(&vb));
            let (mut p, mut s) = (x0.clone(), vec![bf16::ZERO; n]);
            let (mut hi, mut lo, mut b) = (hi0.clone(), lo0.clone(), b0.clone());
            macro_rules! reference {
                ($g:expr) => {
                    match case {
                        0 => adamw_update(
                            &mut p,
                            $g,
                            &mut m32,
                            &mut v32,
                            StoreOut::Bf16(&mut s),
                            &hp,
                            true,
                            Moments::Write,
                        ),
                        1 => adamw_update_split(
                            &mut hi,
                            &mut lo,
                            $g,
                            &mut m32,
                            &mut v32,
                            &hp,
                            true,
                            Moments::Write,
                        ),
                        _ => adamw_update_bf16_master(
                            &mut b,
                            $g,
                            &mut m32,
                            &mut v32,
                            &hp,
                            true,
                            9,
                            first,
                            Moments::Write,
                        ),
                    }
                };
            }
            if bf {
                reference!(&g16)
            } else {
                reference!(&g32)
            }
            let want = (bits32(&p), s.clone(), hi.clone(), lo.clone(), b.clone());
            // The same update with bf16 moments.
            let (mut m, mut v) = (mb.clone(), vb.clone());
            let (mut p, mut s) = (x0.clone(), vec![bf16::ZERO; n]);
            let (mut hi, mut lo, mut b) = (hi0.clone(), lo0.clone(), b0.clone());
            let w = match case {
                0 => WeightsMut::F32 {
                    p: &mut p,
                    store: StoreOut::Bf16(&mut s),
                },
                1 => WeightsMut::Split {
                    hi: &mut hi,
                    lo: &mut lo,
                },
                _ => WeightsMut::Bf16 { p: &mut b, seed: 9 },
            };
            let (m_, v_) = (&mut m, &mut v);
            if bf {
                adamw_update_bf16_moments(w, &g16, m_, v_, &hp, true, seed, first, Moments::Write);
            } else {
                adamw_update_bf16_moments(w, &g32, m_, v_, &hp, true, seed, first, Moments::Write);
            }
            assert!(
                (bits32(&p), s, hi, lo, b) == want,
                "weights differ: master {case}, bf16 grad {bf}"
            );
            for i in 0..n {
                let (rm, rv) = bits::rounding_bits_pair(seed, hp.step, first + i as u64);
                let (wm, wv) = (
                    bits::stochastic_round_bf16(m32[i], rm),
                    bits::stochastic_round_bf16(v32[i], rv),
                );
                assert_eq!(
                    (m[i], v[i]),
                    (wm, wv),
                    "element {i}, master {case}, bf {bf}"
                );
            }
        }
    }
}

/// With bf16 moments too, the weights pass (`Moments::Keep`, moments untouched) and then
/// [`adamw_moments_bf16`] leave the bits of one pass.
#[test]
fn bf16_moments_two_passes_equal_one() {
    let n = CHUNK + 3000;
    let hp = AdamWStep {
        grad_scale: 0.37,
        ..hp7()
    };
    let g: Vec<bf16> = spread(n, 31).iter().map(|&x| bf16::from_f32(x)).collect();
    let m0: Vec<bf16> = spread(n, 32).iter().map(|&x| bf16::from_f32(x)).collect();
    let v0: Vec<bf16> = spread(n, 33)
        .iter()
        .map(|&x| bf16::from_f32(x * x))
        .collect();
    let (_, hi0, lo0, _) = weights_cases(n);
    let run = |moments: Moments| {
        let (mut hi, mut lo, mut m, mut v) = (hi0.clone(), lo0.clone(), m0.clone(), v0.clone());
        let w = WeightsMut::Split {
            hi: &mut hi,
            lo: &mut lo,
        };
        adamw_update_bf16_moments(w, &g, &mut m, &mut v, &hp, true, 3, 10, moments);
        if moments == Moments::Keep {
            assert!(m == m0 && v == v0, "the weights pass changed the moments");
            adamw_moments_bf16(&g, &mut m, &mut v, &hp, 3, 10);
        }
        (hi, lo, m, v)
    };
    assert!(run(Moments::Keep) == run(Moments::Write));
}

/// Stochastic rounding keeps v moving where round-to-nearest would stall it. A constant
/// gradient g with β2 = 0.999 over 1000 steps: v_t = (1 - β2^t) g², each step adding about
/// 0.1% of v, under half a bf16 ulp (2^-9 to 2^-8 of v). Over 65536 elements the mean of v
/// follows the fp32 sequence: each element's rounding error is a sum of independent
/// zero-mean errors of at most one ulp (<= 2^-7 of v), discounted by β2 per step, so its
/// standard deviation is at most 2^-7 / 2 / sqrt(1 - β2²) ≈ 8.7% of v (a uniform error on
/// one ulp has sd ulp/sqrt(12); /2 bounds it), and the mean's is 8.7% / 256 ≈ 0.034%:
/// 0.2% is about 6 standard deviations. Round-to-nearest stalls at 0.0625, where a step's
/// 1.9e-4 falls under half an ulp (2.4e-4): 0.4 of the target 0.158 (checked, so the test
/// tells the two apart).
#[test]
fn stochastic_rounding_keeps_v_moving() {
    let n = 1 << 16;
    let hp = |step| AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step,
        grad_scale: 1.0,
    };
    let g = vec![0.5f32; n];
    let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let (mut m_rne, mut v_rne) = (0.0f32, 0.0f32);
    let mut v32 = 0.0f64;
    for step in 1..=1000u64 {
        adamw_moments_bf16(&g, &mut m, &mut v, &hp(step), 1, 0);
        let k = Consts::new(&hp(step), false);
        let (mi, vi) = moments1(0.5, m_rne, v_rne, &k);
        (m_rne, v_rne) = (bits::round_bf16(mi).to_f32(), bits::round_bf16(vi).to_f32());
        v32 = 0.999 * v32 + 0.001 * 0.25;
    }
    let mean = v.iter().map(|x| x.to_f32() as f64).sum::<f64>() / n as f64;
    assert!(
        (mean / v32 - 1.0).abs() < 2e-3,
        "mean v {mean} against {v32}"
    );
    assert!(
        (v_rne as f64) < 0.5 * v32,
        "round to nearest did not stall: {v_rne} {v32}"
    );
}
