//! A decoded JPEG's coefficients to RGB pixels as libjpeg(-turbo) makes them with its
//! defaults (`JDCT_ISLOW`, `do_fancy_upsampling`), so that they equal Pillow's to the byte:
//!
//! - the accurate integer inverse DCT: two 1-D passes (columns, then rows) of the
//!   Loeffler-Ligtenberg-Moschytz butterfly with 13-bit fixed-point constants, 2 extra bits
//!   kept between the passes, the result rounded down by 18 bits, offset by 128 and
//!   range-limited through libjpeg's wrapping table (`range_limit`);
//! - fancy (triangular) upsampling of a component at half the width (3/4 nearer + 1/4
//!   further sample, rounding biased alternately by 1 and 2), half the width and height
//!   (the same in both directions on column sums, biases 8 and 7), or half the height;
//!   the rows above the first and below the last are the first and last; components
//!   under three samples wide and other integral ratios are replicated;
//! - YCbCr to RGB with 16-bit fixed-point tables (R = Y + 1.402 Cr', G = Y - 0.34414 Cb' -
//!   0.71414 Cr', B = Y + 1.772 Cb', Cb' = Cb - 128), clipped to 0..=255.

use super::super::Rgb8;
use super::{Component, Decoder};

const CONST_BITS: u32 = 13;
const PASS1_BITS: u32 = 2;

/// `x` in 13-bit fixed point, as libjpeg's `FIX` rounds it.
const fn fix(x: f64) -> i64 {
    (x * (1 << CONST_BITS) as f64 + 0.5) as i64
}

/// `x` rounded and shifted down by `n` bits.
fn descale(x: i64, n: u32) -> i64 {
    (x + (1 << (n - 1))) >> n
}

/// libjpeg's post-IDCT range limit: a descaled value plus 128, clipped to 0..=255 for
/// |x| < 384, wrapping (as its table masked by 1023 does) beyond.
fn range_limit(x: i64) -> u8 {
    match x & 1023 {
        i @ 0..=127 => (i + 128) as u8,
        128..=511 => 255,
        512..=895 => 0,
        i => (i - 896) as u8,
    }
}

/// One 1-D pass of the IDCT over 8 values `a[0..8]` (`a[i]` the i-th frequency): the even
/// part's and odd part's sums, outputs still scaled by 2^13.
fn idct_1d(a: [i64; 8]) -> [i64; 8] {
    // Even part.
    let z1 = (a[2] + a[6]) * fix(0.541196100);
    let tmp2 = z1 + a[6] * -fix(1.847759065);
    let tmp3 = z1 + a[2] * fix(0.765366865);
    let tmp0 = (a[0] + a[4]) << CONST_BITS;
    let tmp1 = (a[0] - a[4]) << CONST_BITS;
    let (tmp10, tmp13) = (tmp0 + tmp3, tmp0 - tmp3);
    let (tmp11, tmp12) = (tmp1 + tmp2, tmp1 - tmp2);
    // Odd part.
    let (t0, t1, t2, t3) = (a[7], a[5], a[3], a[1]);
    let z1 = t0 + t3;
    let z2 = t1 + t2;
    let z3 = t0 + t2;
    let z4 = t1 + t3;
    let z5 = (z3 + z4) * fix(1.175875602);
    let t0 = t0 * fix(0.298631336);
    let t1 = t1 * fix(2.053119869);
    let t2 = t2 * fix(3.072711026);
    let t3 = t3 * fix(1.501321110);
    let z1 = z1 * -fix(0.899976223);
    let z2 = z2 * -fix(2.562915447);
    let z3 = z3 * -fix(1.961570560) + z5;
    let z4 = z4 * -fix(0.390180644) + z5;
    let t0 = t0 + z1 + z3;
    let t1 = t1 + z2 + z4;
    let t2 = t2 + z2 + z3;
    let t3 = t3 + z1 + z4;
    [
        tmp10 + t3,
        tmp11 + t2,
        tmp12 + t1,
        tmp13 + t0,
        tmp13 - t0,
        tmp12 - t1,
        tmp11 - t2,
        tmp10 - t3,
    ]
}

/// The 8x8 samples of one block of dequantised coefficients (natural order).
fn idct_block(coef: &[i32], quant: &[u16; 64], out: &mut [u8], stride: usize) {
    let mut ws = [0i64; 64];
    for x in 0..8 {
        let col = std::array::from_fn(|i| i64::from(coef[i * 8 + x]) * i64::from(quant[i * 8 + x]));
        for (i, v) in idct_1d(col).into_iter().enumerate() {
            ws[i * 8 + x] = descale(v, CONST_BITS - PASS1_BITS);
        }
    }
    for y in 0..8 {
        let row = std::array::from_fn(|i| ws[y * 8 + i]);
        for (i, v) in idct_1d(row).into_iter().enumerate() {
            out[y * stride + i] = range_limit(descale(v, CONST_BITS + PASS1_BITS + 3));
        }
    }
}

/// A component's samples: `bw x 8` by `bh x 8`, row-major.
fn plane(c: &Component) -> Result<Vec<u8>, String> {
    let q = c.quant.ok_or_else(|| {
        format!(
            "JPEG component {} without its quantisation table {}",
            c.id, c.tq
        )
    })?;
    let stride = c.bw * 8;
    let mut out = vec![0u8; stride * c.bh * 8];
    for by in 0..c.bh {
        for bx in 0..c.bw {
            let o = (by * c.bw + bx) * 64;
            idct_block(
                &c.coefs[o..o + 64],
                &q,
                &mut out[by * 8 * stride + bx * 8..],
                stride,
            );
        }
    }
    Ok(out)
}

/// Component `c`'s plane upsampled to the image's `width` x `height`.
fn upsample(d: &Decoder, c: &Component, p: &[u8]) -> Vec<u8> {
    let (fx, fy) = (d.hmax / c.h, d.vmax / c.v);
    let stride = c.bw * 8;
    let (w, h) = (c.width, c.height);
    // Row `y` of the component, with the rows outside it replicated from its edges.
    let row = |y: isize| {
        let y = y.clamp(0, h as isize - 1) as usize;
        &p[y * stride..y * stride + w]
    };
    let mut out = vec![0u8; d.width * d.height];
    let fancy_h = fx == 2 && w > 2;
    match (fx, fy) {
        (1, 1) => {
            for y in 0..d.height {
                out[y * d.width..(y + 1) * d.width].copy_from_slice(&row(y as isize)[..d.width]);
            }
        }
        (2, 1) if fancy_h => {
            let mut line = vec![0u8; 2 * w];
            for y in 0..d.height {
                let r = row(y as isize);
                for i in 0..w {
                    let near = 3 * u32::from(r[i]);
                    let left = u32::from(r[i.saturating_sub(1)]);
                    let right = u32::from(r[(i + 1).min(w - 1)]);
                    line[2 * i] = ((near + left + 1) >> 2) as u8;
                    line[2 * i + 1] = ((near + right + 2) >> 2) as u8;
                }
                out[y * d.width..(y + 1) * d.width].copy_from_slice(&line[..d.width]);
            }
        }
        (2, 2) if fancy_h => {
            let mut sums = vec![0u32; w];
            let mut line = vec![0u8; 2 * w];
            for y in 0..d.height {
                let (near, far) = (
                    row((y / 2) as isize),
                    row((y / 2) as isize + if y % 2 == 0 { -1 } else { 1 }),
                );
                for i in 0..w {
                    sums[i] = 3 * u32::from(near[i]) + u32::from(far[i]);
                }
                for i in 0..w {
                    let left = sums[i.saturating_sub(1)];
                    let right = sums[(i + 1).min(w - 1)];
                    line[2 * i] = ((3 * sums[i] + left + 8) >> 4) as u8;
                    line[2 * i + 1] = ((3 * sums[i] + right + 7) >> 4) as u8;
                }
                out[y * d.width..(y + 1) * d.width].copy_from_slice(&line[..d.width]);
            }
        }
        (1, 2) => {
            for y in 0..d.height {
                let (up, bias) = if y % 2 == 0 { (-1, 1) } else { (1, 2) };
                let (near, far) = (row((y / 2) as isize), row((y / 2) as isize + up));
                for x in 0..d.width {
                    let s = 3 * u32::from(near[x]) + u32::from(far[x]);
                    out[y * d.width + x] = ((s + bias) >> 2) as u8;
                }
            }
        }
        _ => {
            for y in 0..d.height {
                let r = row((y / fy) as isize);
                for x in 0..d.width {
                    out[y * d.width + x] = r[x / fx];
                }
            }
        }
    }
    out
}

/// The decoded image in RGB.
pub(super) fn rgb(d: &Decoder) -> Result<Rgb8, String> {
    let planes = d
        .comps
        .iter()
        .map(|c| Ok(upsample(d, c, &plane(c)?)))
        .collect::<Result<Vec<_>, String>>()?;
    let n = d.width * d.height;
    let mut data = vec![0u8; n * 3];
    if let [grey] = &planes[..] {
        for (px, &v) in data.chunks_exact_mut(3).zip(grey) {
            px.fill(v);
        }
    } else if is_rgb(d) {
        for (i, px) in data.chunks_exact_mut(3).enumerate() {
            px.copy_from_slice(&[planes[0][i], planes[1][i], planes[2][i]]);
        }
    } else {
        const SCALE: u32 = 16;
        let one_half = 1i64 << (SCALE - 1);
        let f = |x: f64| (x * f64::from(1u32 << SCALE) + 0.5) as i64;
        let clip = |v: i64| v.clamp(0, 255) as u8;
        for (i, px) in data.chunks_exact_mut(3).enumerate() {
            let y = i64::from(planes[0][i]);
            let cb = i64::from(planes[1][i]) - 128;
            let cr = i64::from(planes[2][i]) - 128;
            let r = (f(1.40200) * cr + one_half) >> SCALE;
            let b = (f(1.77200) * cb + one_half) >> SCALE;
            let g = (-f(0.34414) * cb + one_half - f(0.71414) * cr) >> SCALE;
            px.copy_from_slice(&[clip(y + r), clip(y + g), clip(y + b)]);
        }
    }
    Ok(Rgb8 {
        width: d.width as u32,
        height: d.height as u32,
        data,
    })
}

/// Three components coded as RGB, not YCbCr (libjpeg's rule): an Adobe marker with
/// transform 0 and no JFIF marker, or, with neither marker, component ids `R`, `G`, `B`.
fn is_rgb(d: &Decoder) -> bool {
    if d.jfif {
        return false;
    }
    match d.adobe {
        Some(t) => t == 0,
        None => d.comps.iter().map(|c| c.id).eq([b'R', b'G', b'B']),
    }
}
