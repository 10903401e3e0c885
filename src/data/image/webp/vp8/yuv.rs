//! The decoded frame, cropped to its size, to RGB as libwebp converts it by default (its
//! "fancy" upsampling and fixed-point YUV to RGB; libwebp's SIMD versions of both are
//! bit-exact with its plain C ones, which these follow):
//!
//! - chroma upsampling: each chroma sample is the centre of a 2x2 luma block; a pixel's
//!   U and V weigh the four nearest chroma samples 9/16, 3/16, 3/16, 1/16 (nearest first),
//!   rounded as libwebp does: (the four + twice the two beside the nearest + 8) >> 3,
//!   then averaged, rounding down, with the nearest. The first row and column, the last
//!   row of an even height and the last column of an even width have no second neighbour
//!   across the border: there (3 x near + far + 2) >> 2 along the other direction, the
//!   missing row or column taken as the near one.
//! - BT.601 "studio swing" YUV to RGB in 14-bit fixed point: R = 1.164 (Y - 16) + 1.596
//!   (V - 128), G = 1.164 (Y - 16) - 0.391 (U - 128) - 0.813 (V - 128), B = 1.164 (Y - 16) +
//!   2.018 (U - 128), each product taken as (sample x coefficient) >> 8, the sum rounded
//!   down by 6 bits and clipped to 0..=255.

use super::Planes;

/// The RGB pixels (interleaved, row-major) of the top-left `width` x `height` of `p`.
pub(super) fn rgb(p: &Planes, width: usize, height: usize) -> Vec<u8> {
    let (ys, cs) = (16 * p.mb_w, 8 * p.mb_w);
    let chroma_rows = height.div_ceil(2);
    let mut out = vec![0u8; width * height * 3];
    let (mut u, mut v) = (vec![0u8; width], vec![0u8; width]);
    for (r, row) in out.chunks_exact_mut(width * 3).enumerate() {
        // The chroma row nearest this luma row, and the one on its other side (odd rows:
        // below, even rows: above), or the nearest again at the top and bottom.
        let near = r / 2;
        let far = if r % 2 == 1 {
            (near + 1).min(chroma_rows - 1)
        } else {
            near.saturating_sub(1)
        };
        upsample((&p.u[near * cs..], &p.u[far * cs..]), &mut u);
        upsample((&p.v[near * cs..], &p.v[far * cs..]), &mut v);
        let y = &p.y[r * ys..][..width];
        for (px, ((&y, &u), &v)) in row.chunks_exact_mut(3).zip(y.iter().zip(&u).zip(&v)) {
            px.copy_from_slice(&yuv_to_rgb(i32::from(y), i32::from(u), i32::from(v)));
        }
    }
    out
}

/// A row's chroma (one plane), `out.len()` samples, from its (near, far) chroma rows `c`.
fn upsample(c: (&[u8], &[u8]), out: &mut [u8]) {
    let w = out.len();
    let edge = |x: usize| ((3 * u32::from(c.0[x]) + u32::from(c.1[x]) + 2) >> 2) as u8;
    out[0] = edge(0);
    // Between chroma columns x - 1 and x: luma columns 2x - 1 and 2x.
    for x in 1..=(w - 1) / 2 {
        (out[2 * x - 1], out[2 * x]) = pair(c, x);
    }
    if w.is_multiple_of(2) {
        out[w - 1] = edge(w / 2 - 1);
    }
}

/// The chroma of luma columns 2x - 1 and 2x from chroma columns x - 1 and x of the near
/// and far rows `c`.
fn pair(c: (&[u8], &[u8]), x: usize) -> (u8, u8) {
    let [near_l, near_r, far_l, far_r] = [c.0[x - 1], c.0[x], c.1[x - 1], c.1[x]].map(u32::from);
    let sum = near_l + near_r + far_l + far_r + 8;
    // (the 9-weighted sample + 3 x the two beside it + the opposite one) / 8 rounded,
    // for the left and the right column's nearest sample.
    let left = (sum + 2 * (near_r + far_l)) >> 3;
    let right = (sum + 2 * (near_l + far_r)) >> 3;
    (((left + near_l) >> 1) as u8, ((right + near_r) >> 1) as u8)
}

/// libwebp's `VP8YuvToRgb`.
fn yuv_to_rgb(y: i32, u: i32, v: i32) -> [u8; 3] {
    let mul = |s: i32, c: i32| (s * c) >> 8;
    let clip = |x: i32| {
        if x & !0x3fff == 0 {
            (x >> 6) as u8
        } else if x < 0 {
            0
        } else {
            255
        }
    };
    let luma = mul(y, 19077);
    [
        clip(luma + mul(v, 26149) - 14234),
        clip(luma - mul(u, 6419) - mul(v, 13320) + 8708),
        clip(luma + mul(u, 33050) - 17685),
    ]
}
