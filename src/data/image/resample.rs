//! Pillow's `Image.resize(size, Image.BICUBIC)` and `Image.BILINEAR` of an 8-bit RGB image,
//! to the byte (what transformers' PIL image processors call; written from Pillow's
//! documented algorithm, `libImaging/Resample.c`'s convolution):
//!
//! - a separable convolution, the horizontal pass first into an 8-bit image of the rows the
//!   vertical pass reads, then the vertical pass; a pass whose size does not change is
//!   skipped (and a resize to the same size is a copy);
//! - the bicubic kernel with a = -0.5 and support 2 (bilinear: the triangle 1 - |x|, support
//!   1), stretched by the scale when the image shrinks (antialiasing: support x scale input
//!   pixels);
//! - output pixel i is centred at input coordinate (i + 0.5) x scale; its taps are the input
//!   pixels within the support (clipped to the image), their weights normalised to sum 1,
//!   then rounded to fixed point with 22 fractional bits (away from zero);
//! - each output sample is Σ weight x sample plus a half, shifted down by 22 bits and
//!   clipped to 0..=255.

use super::Rgb8;

/// Fractional bits of the fixed-point weights (Pillow's `PRECISION_BITS`, 32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

fn bilinear(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 { 1.0 - x } else { 0.0 }
}

/// A resampling filter: its kernel and the kernel's support (half width) in input pixels.
#[derive(Clone, Copy)]
struct Filter {
    kernel: fn(f64) -> f64,
    support: f64,
}

const BICUBIC: Filter = Filter {
    kernel: bicubic,
    support: 2.0,
};
const BILINEAR: Filter = Filter {
    kernel: bilinear,
    support: 1.0,
};

/// The taps of each of `out_size` outputs resampling `in_size` inputs with `filter`:
/// (first input, fixed-point weights).
fn taps(in_size: usize, out_size: usize, filter: Filter) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support * filter_scale;
    let inv = 1.0 / filter_scale;
    (0..out_size)
        .map(|i| {
            let centre = (i as f64 + 0.5) * scale;
            // Truncation toward zero, then clipping, as the C casts do.
            let lo = ((centre - support + 0.5) as i64).max(0) as usize;
            let hi = ((centre + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (lo..hi)
                .map(|x| (filter.kernel)((x as f64 - centre + 0.5) * inv))
                .collect();
            let sum: f64 = w.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let fixed = w
                .iter()
                .map(|&k| {
                    let k = if sum != 0.0 { k / sum } else { k };
                    if k < 0.0 {
                        (-0.5 + k * one) as i32
                    } else {
                        (0.5 + k * one) as i32
                    }
                })
                .collect();
            (lo, fixed)
        })
        .collect()
}

fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `img` resized to `width` x `height` with Pillow's bicubic filter.
pub fn bicubic_resize(img: &Rgb8, width: u32, height: u32) -> Rgb8 {
    resize(img, width, height, BICUBIC)
}

/// `img` resized to `width` x `height` with Pillow's bilinear filter.
pub fn bilinear_resize(img: &Rgb8, width: u32, height: u32) -> Rgb8 {
    resize(img, width, height, BILINEAR)
}

fn resize(img: &Rgb8, width: u32, height: u32, filter: Filter) -> Rgb8 {
    assert!(width > 0 && height > 0, "a resize to a non-empty image");
    let (iw, ih) = (img.width as usize, img.height as usize);
    let (ow, oh) = (width as usize, height as usize);
    let half = 1i64 << (PRECISION_BITS - 1);
    let vert = taps(ih, oh, filter);
    // Horizontal pass over the input rows the vertical taps read.
    let (rows_from, mut cur) = if ow != iw {
        let first = vert.first().map_or(0, |t| t.0);
        let last = vert.last().map_or(0, |t| t.0 + t.1.len());
        let hz = taps(iw, ow, filter);
        let mut out = vec![0u8; (last - first) * ow * 3];
        for (y, row) in out.chunks_exact_mut(ow * 3).enumerate() {
            let src = &img.data[(first + y) * iw * 3..(first + y + 1) * iw * 3];
            for (x, (lo, k)) in hz.iter().enumerate() {
                for c in 0..3 {
                    let acc = k.iter().enumerate().fold(half, |acc, (j, &w)| {
                        acc + i64::from(src[(lo + j) * 3 + c]) * i64::from(w)
                    });
                    row[x * 3 + c] = clip8(acc);
                }
            }
        }
        (first, out)
    } else {
        (0, img.data.clone())
    };
    if oh != ih {
        let stride = ow * 3;
        let mut out = vec![0u8; oh * stride];
        for (y, (lo, k)) in vert.iter().enumerate() {
            let top = lo - rows_from;
            for i in 0..stride {
                let acc = k.iter().enumerate().fold(half, |acc, (j, &w)| {
                    acc + i64::from(cur[(top + j) * stride + i]) * i64::from(w)
                });
                out[y * stride + i] = clip8(acc);
            }
        }
        cur = out;
    }
    Rgb8 {
        width,
        height,
        data: cur,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(10, 3), (3, 10), (100, 99), (7, 7)] {
            for (_, k) in taps(i, o, BICUBIC).into_iter().chain(taps(i, o, BILINEAR)) {
                let s: i64 = k.iter().map(|&w| i64::from(w)).sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= k.len() as i64,
                    "{i}->{o}: {s}"
                );
            }
        }
    }

    #[test]
    fn flat_images_stay_flat_and_same_size_is_a_copy() {
        let img = Rgb8 {
            width: 5,
            height: 3,
            data: [9u8, 128, 250].repeat(15),
        };
        assert_eq!(bicubic_resize(&img, 5, 3), img);
        let big = bicubic_resize(&img, 13, 8);
        assert_eq!(big.data, [9u8, 128, 250].repeat(13 * 8));
        let small = bicubic_resize(&img, 2, 1);
        assert_eq!(small.data, [9u8, 128, 250].repeat(2));
        assert_eq!(bilinear_resize(&img, 7, 2).data, [9u8, 128, 250].repeat(14));
    }
}
