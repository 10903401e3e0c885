use super::*;

mod bf16_moments;

/// The update written out step by step in f64, as torch's docs state the algorithm.
fn reference(p: f64, g: f64, m: f64, v: f64, hp: &AdamWStep, decay: bool) -> (f64, f64, f64) {
    let g = g * hp.grad_scale as f64;
    let p = if decay {
        p * (1.0 - hp.lr * hp.weight_decay)
    } else {
        p
    };
    let m = hp.beta1 * m + (1.0 - hp.beta1) * g;
    let v = hp.beta2 * v + (1.0 - hp.beta2) * g * g;
    let mhat = m / (1.0 - hp.beta1.powi(hp.step as i32));
    let vhat = v / (1.0 - hp.beta2.powi(hp.step as i32));
    (p - hp.lr * mhat / (vhat.sqrt() + hp.eps), m, v)
}

#[test]
fn matches_the_algorithm_over_several_steps() {
    let n = CHUNK + 100;
    let mut p: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let mut s = vec![bf16::ZERO; n];
    let (mut rp, mut rm, mut rv): (Vec<f64>, Vec<f64>, Vec<f64>) = (
        p.iter().map(|&x| x as f64).collect(),
        vec![0.0; n],
        vec![0.0; n],
    );
    for step in 1..=3 {
        let g: Vec<f32> = (0..n)
            .map(|i| (((i * 31 + step * 7) % 23) as f32 - 11.0) * 0.01)
            .collect();
        let hp = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: step as u64,
            grad_scale: 0.5,
        };
        adamw_update(
            &mut p,
            &g,
            &mut m,
            &mut v,
            StoreOut::Bf16(&mut s),
            &hp,
            true,
            Moments::Write,
        );
        for i in 0..n {
            (rp[i], rm[i], rv[i]) = reference(rp[i], g[i] as f64, rm[i], rv[i], &hp, true);
        }
    }
    for i in 0..n {
        assert!(
            (p[i] as f64 - rp[i]).abs() <= 1e-6 + 1e-5 * rp[i].abs(),
            "param {i}: {} vs {}",
            p[i],
            rp[i]
        );
        assert_eq!(s[i], bf16::from_f32(p[i]));
    }
}

#[test]
fn no_decay_for_vectors() {
    let hp = AdamWStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.5,
        step: 1,
        grad_scale: 1.0,
    };
    let (mut p, mut m, mut v, mut s) = (vec![1.0f32], vec![0.0], vec![0.0], vec![0.0f32]);
    adamw_update(
        &mut p,
        &[0.0],
        &mut m,
        &mut v,
        StoreOut::F32(&mut s),
        &hp,
        false,
        Moments::Write,
    );
    assert_eq!(p[0], 1.0);
    adamw_update(
        &mut p,
        &[0.0],
        &mut m,
        &mut v,
        StoreOut::F32(&mut s),
        &hp,
        true,
        Moments::Write,
    );
    assert!((p[0] - 0.95).abs() < 1e-7);
}

/// Every path this CPU runs gives the portable path's bits, for both store dtypes, at
/// lengths and offsets that exercise the aligned body, the head and the tail.
#[test]
fn simd_paths_match_portable_bit_for_bit() {
    let levels: Vec<Simd> = [Simd::Avx2, Simd::Avx512]
        .into_iter()
        .filter(|s| s.supported())
        .collect();
    let n = 3 * CHUNK + 77;
    let val = |i: usize, salt: usize| {
        let h = (i.wrapping_mul(0x9e37_79b9) ^ salt.wrapping_mul(0x85eb_ca6b)) % 20011;
        (h as f32 - 10005.0) * 1e-4
    };
    let hp = AdamWStep {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 7,
        grad_scale: 0.8,
    };
    let k = Consts::new(&hp, true);
    for off in [0, 1, 5, 31] {
        let g: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
        let p0: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
        let m0: Vec<f32> = (0..n).map(|i| val(i, 3) * 0.1).collect();
        let v0: Vec<f32> = (0..n).map(|i| val(i, 4).abs() * 0.01).collect();
        let run = |simd: Simd| {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut sb = vec![bf16::ZERO; n];
            let mut sf = vec![0.0f32; n];
            update_with(
                simd,
                &mut p[off..],
                &g[off..],
                &mut m[off..],
                &mut v[off..],
                StoreOut::Bf16(&mut sb[off..]),
                &k,
            );
            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            update_with(
                simd,
                &mut p2[off..],
                &g[off..],
                &mut m2[off..],
                &mut v2[off..],
                StoreOut::F32(&mut sf[off..]),
                &k,
            );
            assert_eq!(p, p2);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (bits(&p), bits(&m), bits(&v), sb, bits(&sf))
        };
        let want = run(Simd::Portable);
        for &simd in &levels {
            assert!(run(simd) == want, "{simd:?} differs at offset {off}");
        }
    }
}

fn hp7() -> AdamWStep {
    AdamWStep {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 7,
        grad_scale: 0.8,
    }
}

/// Values spread over many exponents, with some exact bf16 ties among the parameters.
fn spread(n: usize, salt: u32) -> Vec<f32> {
    let mut h = 0x9e37_79b9u32 ^ salt.wrapping_mul(0x85eb_ca6b);
    (0..n)
        .map(|i| {
            h ^= h << 13;
            h ^= h >> 17;
            h ^= h << 5;
            let x = ((h >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2f32.powi((h % 9) as i32 - 6);
            if i % 97 == 0 {
                f32::from_bits((x.to_bits() & !0xffff) | 0x8000)
            } else {
                x
            }
        })
        .collect()
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}

/// A bf16 gradient gives the bits of the same gradient widened to f32, on every path.
#[test]
fn bf16_gradient_is_the_widened_gradient() {
    let n = 2 * CHUNK + 45;
    let k = Consts::new(&hp7(), true);
    let gb: Vec<bf16> = spread(n, 1).into_iter().map(bf16::from_f32).collect();
    let gf: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
    let (p0, m0) = (spread(n, 2), spread(n, 3));
    let v0: Vec<f32> = spread(n, 4).iter().map(|x| x * x).collect();
    for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
        if !simd.supported() {
            continue;
        }
        for off in [0, 3] {
            let run = |bf: bool| {
                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                let mut s = vec![bf16::ZERO; n];
                let (p_, m_, v_) = (&mut p[off..], &mut m[off..], &mut v[off..]);
                let out = StoreOut::Bf16(&mut s[off..]);
                if bf {
                    update_with(simd, p_, &gb[off..], m_, v_, out, &k);
                } else {
                    update_with(simd, p_, &gf[off..], m_, v_, out, &k);
                }
                (bits32(&p), bits32(&m), bits32(&v), s)
            };
            assert!(run(true) == run(false), "{simd:?} at offset {off}");
        }
    }
}

/// The split update is the fp32 update of the joined master, split again: bit for bit,
/// on every path and for both gradient dtypes; the store it leaves is the fp32 path's
/// store, and the master differs from the fp32 path's only on exact ties, by one ulp.
#[test]
fn split_update_is_the_fp32_update_split() {
    let n = 2 * CHUNK + 45;
    let k = Consts::new(&hp7(), true);
    let x0 = spread(n, 5);
    let g = spread(n, 6);
    let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
    let m0 = spread(n, 7);
    let v0: Vec<f32> = spread(n, 8).iter().map(|x| x * x).collect();
    let (mut hi0, mut lo0) = (vec![bf16::ZERO; n], vec![0u16; n]);
    bits::split_slice(&x0, &mut hi0, &mut lo0);
    let joined: Vec<f32> = hi0
        .iter()
        .zip(&lo0)
        .map(|(&h, &l)| bits::join(h, l))
        .collect();
    // The fp32 reference, from the joined master.
    let reference = |bf: bool| {
        let (mut p, mut m, mut v) = (joined.clone(), m0.clone(), v0.clone());
        let mut s = vec![bf16::ZERO; n];
        let out = StoreOut::Bf16(&mut s);
        if bf {
            update_with(Simd::Portable, &mut p, &gb, &mut m, &mut v, out, &k);
        } else {
            update_with(Simd::Portable, &mut p, &g, &mut m, &mut v, out, &k);
        }
        (p, m, v, s)
    };
    for bf in [false, true] {
        let (p, m, v, s) = reference(bf);
        let mut ties = 0;
        for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
            if !simd.supported() {
                continue;
            }
            for off in [0, 5] {
                let (mut hi, mut lo) = (hi0.clone(), lo0.clone());
                let (mut m2, mut v2) = (m0.clone(), v0.clone());
                let (h, l, m_, v_) = (
                    &mut hi[off..],
                    &mut lo[off..],
                    &mut m2[off..],
                    &mut v2[off..],
                );
                if bf {
                    update_split_with(simd, h, l, &gb[off..], m_, v_, &k);
                } else {
                    update_split_with(simd, h, l, &g[off..], m_, v_, &k);
                }
                assert_eq!(bits32(&m2[off..]), bits32(&m[off..]), "{simd:?} {off}");
                assert_eq!(bits32(&v2[off..]), bits32(&v[off..]), "{simd:?} {off}");
                ties = 0;
                for i in off..n {
                    let (sh, sl) = bits::split(p[i]);
                    assert_eq!((hi[i].to_bits(), lo[i]), (sh.to_bits(), sl), "{simd:?} {i}");
                    assert_eq!(hi[i].to_bits(), s[i].to_bits(), "store {simd:?} {i}");
                    let got = bits::join(hi[i], lo[i]).to_bits();
                    if p[i].to_bits() & 0xffff == 0x8000 {
                        ties += 1;
                        assert_eq!(got.abs_diff(p[i].to_bits()), 1, "{simd:?} {i}");
                    } else {
                        assert_eq!(got, p[i].to_bits(), "{simd:?} {i}");
                    }
                }
            }
        }
        assert!(ties < n / 1000, "ties are rare: {ties}");
    }
}

/// The bf16-master update is the fp32 update of the widened store followed by a
/// stochastic rounding with the element's own bits: bit for bit the same at every chunk
/// boundary (the element index, not the task, picks the bits), and the moments equal the
/// fp32 path's exactly.
#[test]
fn bf16_master_is_the_f32_update_rounded_stochastically() {
    let n = 2 * CHUNK + 37;
    let first = 1_000_003u64;
    let hp = AdamWStep {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 7,
        grad_scale: 0.75,
    };
    let mut p: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(((i % 29) as f32 - 14.0) * 0.013))
        .collect();
    let g: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(((i * 7 % 31) as f32 - 15.0) * 0.002))
        .collect();
    let (mut m, mut v) = (vec![0.01f32; n], vec![0.002f32; n]);
    let mut p32: Vec<f32> = p.iter().map(|x| x.to_f32()).collect();
    let (mut m32, mut v32) = (m.clone(), v.clone());
    let mut store = vec![bf16::ZERO; n];
    adamw_update(
        &mut p32,
        &g,
        &mut m32,
        &mut v32,
        StoreOut::Bf16(&mut store),
        &hp,
        true,
        Moments::Write,
    );
    adamw_update_bf16_master(
        &mut p,
        &g,
        &mut m,
        &mut v,
        &hp,
        true,
        42,
        first,
        Moments::Write,
    );
    assert!(m == m32 && v == v32, "moments differ from the fp32 path");
    for i in 0..n {
        let r = bits::rounding_bits(42, hp.step, first + i as u64);
        let want = bits::stochastic_round_bf16(p32[i], r);
        assert_eq!(p[i].to_bits(), want.to_bits(), "element {i}");
    }
}

/// A two-pass update (the weights with `Moments::Keep`, then [`adamw_moments`]) leaves the
/// bits of the one-pass update, for every way the master is held, both gradient dtypes,
/// every SIMD level, with and without clipping and decay, at lengths that cross chunk and
/// piece boundaries; and the first pass leaves m and v untouched.
#[test]
fn two_passes_equal_one() {
    let n = 2 * CHUNK + 45;
    let g32 = spread(n, 11);
    let g16: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
    let x0 = spread(n, 12);
    let m0 = spread(n, 13);
    let v0: Vec<f32> = spread(n, 14).iter().map(|x| x * x).collect();
    let (mut hi0, mut lo0) = (vec![bf16::ZERO; n], vec![0u16; n]);
    bits::split_slice(&x0, &mut hi0, &mut lo0);
    let b0: Vec<bf16> = x0.iter().map(|&x| bf16::from_f32(x)).collect();
    for (grad_scale, decay) in [(1.0, true), (0.37, true), (0.37, false)] {
        let hp = AdamWStep {
            grad_scale,
            ..hp7()
        };
        for simd in [Simd::Portable, Simd::Avx2, Simd::Avx512] {
            if !simd.supported() {
                continue;
            }
            // Each case: run the update with `moments` on fresh copies, return every output.
            let run = |case: usize, bf: bool, moments: Moments| {
                let (mut m, mut v) = (m0.clone(), v0.clone());
                let (mut p, mut s) = (x0.clone(), vec![bf16::ZERO; n]);
                let (mut hi, mut lo, mut b) = (hi0.clone(), lo0.clone(), b0.clone());
                macro_rules! go {
                    ($g:expr) => {
                        match case {
                            0 => update_with(
                                simd,
                                &mut p,
                                $g,
                                &mut m,
                                &mut v,
                                StoreOut::Bf16(&mut s),
                                &Consts::new(&hp, decay).with(moments),
                            ),
                            1 => update_split_with(
                                simd,
                                &mut hi,
                                &mut lo,
                                $g,
                                &mut m,
                                &mut v,
                                &Consts::new(&hp, decay).with(moments),
                            ),
                            _ => adamw_update_bf16_master(
                                &mut b, $g, &mut m, &mut v, &hp, decay, 9, 77, moments,
                            ),
                        }
                    };
                }
                if bf {
                    go!(&g16);
                } else {
                    go!(&g32);
                }
                if moments == Moments::Keep {
                    assert!(
                        bits32(&m) == bits32(&m0) && bits32(&v) == bits32(&v0),
                        "the weights pass changed the moments ({case} {simd:?})"
                    );
                    if bf {
                        adamw_moments(&g16, &mut m, &mut v, &hp);
                    } else {
                        adamw_moments(&g32, &mut m, &mut v, &hp);
                    }
                }
                let b: Vec<u16> = b.iter().map(|x| x.to_bits()).collect();
                let (hi, s): (Vec<u16>, Vec<u16>) = (
                    hi.iter().map(|x| x.to_bits()).collect(),
                    s.iter().map(|x| x.to_bits()).collect(),
                );
                (bits32(&p), s, hi, lo, b, bits32(&m), bits32(&v))
            };
            for case in 0..3 {
                for bf in [false, true] {
                    assert!(
                        run(case, bf, Moments::Keep) == run(case, bf, Moments::Write),
                        "master {case}, bf16 grad {bf}, {simd:?}, scale {grad_scale}, decay {decay}"
                    );
                }
            }
        }
    }
}

/// Each way the master is held, as the bf16-moment kernel takes it, over copies of the
/// same values: (fp32 master + bf16 store, split, bf16 master).
fn weights_cases(n: usize) -> (Vec<f32>, Vec<bf16>, Vec<u16>, Vec<bf16>) {
    let x = spread(n, 21);
    let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
    bits::split_slice(&x, &mut hi, &mut lo);
    let b = x.iter().map(|&x| bf16::from_f32(x)).collect();
    (x, hi, lo, b)
}

/// An update over a range in one call leaves the bits of calls over its pieces (the
/// launcher updates runs of adjacent tensors in one call): for every way the master and
/// the moments are held, both passes, with pieces that start off the chunk grid.
#[test]
fn one_call_over_a_range_equals_calls_over_its_pieces() {
    let n = 2 * CHUNK + 901;
    let cuts = [0, CHUNK / 3 + 7, CHUNK / 3 + 8, 2 * CHUNK - 5, n];
    let (base, seed, hp) = (4_099u64, 3u64, hp7());
    let g = spread(n, 31);
    let (x0, hi0, lo0, b0) = weights_cases(n);
    let m0 = spread(n, 32);
    let v0: Vec<f32> = spread(n, 33).iter().map(|x| x * x).collect();
    let (mb0, vb0): (Vec<bf16>, Vec<bf16>) = (
        m0.iter().map(|&x| bf16::from_f32(x)).collect(),
        v0.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    type Bits = (Vec<u32>, Vec<bf16>, Vec<bf16>, Vec<u16>, Vec<bf16>);
    // Case `case` over elements `r` of fresh copies, piece by piece; every output's bits.
    let run = |case: usize, pieces: &[std::ops::Range<usize>]| -> (Bits, Vec<u32>, Vec<bf16>) {
        let (mut p, mut s) = (x0.clone(), vec![bf16::ZERO; n]);
        let (mut hi, mut lo, mut b) = (hi0.clone(), lo0.clone(), b0.clone());
        let (mut m, mut v, mut mb, mut vb) = (m0.clone(), v0.clone(), mb0.clone(), vb0.clone());
        for r in pieces {
            let (g, first) = (&g[r.clone()], base + r.start as u64);
            let (m, v) = (&mut m[r.clone()], &mut v[r.clone()]);
            let (mb, vb) = (&mut mb[r.clone()], &mut vb[r.clone()]);
            match case {
                0 => adamw_update(
                    &mut p[r.clone()],
                    g,
                    m,
                    v,
                    StoreOut::Bf16(&mut s[r.clone()]),
                    &hp,
                    true,
                    Moments::Write,
                ),
                1 => {
                    let (hi, lo) = (&mut hi[r.clone()], &mut lo[r.clone()]);
                    adamw_update_split(hi, lo, g, m, v, &hp, true, Moments::Keep);
                    adamw_moments(g, m, v, &hp);
                }
                2 => adamw_update_bf16_master(
                    &mut b[r.clone()],
                    g,
                    m,
                    v,
                    &hp,
                    true,
                    seed,
                    first,
                    Moments::Write,
                ),
                _ => {
                    let w = WeightsMut::Split {
                        hi: &mut hi[r.clone()],
                        lo: &mut lo[r.clone()],
                    };
                    adamw_update_bf16_moments(w, g, mb, vb, &hp, false, seed, first, Moments::Keep);
                    adamw_moments_bf16(g, mb, vb, &hp, seed, first);
                }
            }
        }
        let mut mv = bits32(&m);
        mv.extend(bits32(&v));
        mb.extend(vb);
        ((bits32(&p), s, hi, lo, b), mv, mb)
    };
    let pieces: Vec<_> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
    for case in 0..4 {
        assert!(
            run(case, std::slice::from_ref(&(0..n))) == run(case, &pieces),
            "case {case}: one call and its pieces differ"
        );
    }
}
