//! The loop filter (RFC 6386 section 15), run over the reconstructed frame macroblock by
//! macroblock in raster order: in each, the left macroblock edge, the inner vertical edges
//! (4, 8, 12 pixels in), the top macroblock edge, the inner horizontal edges. Edges on the
//! frame's left and top are not filtered; inner edges only where the macroblock has
//! sub-block modes or non-zero coefficients.
//!
//! The simple filter changes the two luma pixels beside an edge; the normal one up to three
//! on macroblock edges and two on inner ones, in luma and chroma, less across edges of
//! high variance. Both skip a segment across an edge whose difference is above the edge
//! limit (and, normal, whose neighbours differ by more than the interior limit).

use super::Planes;

/// A macroblock's filter settings (section 15.4): `limit` (2 x level + interior; 0: not
/// filtered) bounds inner edges, `limit + 4` macroblock edges; `interior` bounds the steps
/// beside the edge, `hev` the high edge variance threshold.
#[derive(Clone, Copy, Default)]
pub(super) struct Strength {
    limit: i32,
    interior: i32,
    hev: i32,
    pub(super) inner: bool,
}

/// The settings for a segment's filter `level`, for 16x16 and 4x4 luma modes (4x4 ones
/// always filter inner edges). `deltas` are the frame's adjustments for intra macroblocks
/// and for B_PRED ones.
pub(super) fn strengths(level: i32, sharpness: i32, deltas: Option<(i32, i32)>) -> [Strength; 2] {
    [false, true].map(|sub_blocks| {
        let level = match deltas {
            Some((intra, b_pred)) => level + intra + if sub_blocks { b_pred } else { 0 },
            None => level,
        }
        .clamp(0, 63);
        if level == 0 {
            return Strength {
                inner: sub_blocks,
                ..Strength::default()
            };
        }
        let mut interior = level;
        if sharpness > 0 {
            interior >>= if sharpness > 4 { 2 } else { 1 };
            interior = interior.min(9 - sharpness);
        }
        let interior = interior.max(1);
        Strength {
            limit: 2 * level + interior,
            interior,
            hev: if level >= 40 {
                2
            } else {
                i32::from(level >= 15)
            },
            inner: sub_blocks,
        }
    })
}

/// Filters the frame `p` whose macroblocks' settings are `s` (raster order).
pub(super) fn frame(p: &mut Planes, s: &[Strength], simple: bool) {
    let (ys, cs) = (16 * p.mb_w, 8 * p.mb_w);
    for (i, f) in s.iter().enumerate() {
        if f.limit == 0 {
            continue;
        }
        let (mbx, mby) = (i % p.mb_w, i / p.mb_w);
        let (luma, chroma) = (16 * (mby * ys + mbx), 8 * (mby * cs + mbx));
        // Vertical edges, then horizontal ones: the macroblock's own edge (0), then the
        // inner ones (chroma has one, 4 samples in, filtered with luma's first).
        for vertical in [true, false] {
            for off in [0, 4, 8, 12] {
                let outer = if vertical { mbx > 0 } else { mby > 0 };
                if (off == 0 && !outer) || (off > 0 && !f.inner) {
                    continue;
                }
                let limit = if off == 0 { f.limit + 4 } else { f.limit };
                if simple {
                    let seg = |b: &mut [u8], at, across| simple_segment(b, at, across, limit);
                    edge(&mut p.y, ys, luma, off, vertical, 16, seg);
                    continue;
                }
                let t = (limit, f.interior, f.hev, off == 0);
                let seg = |b: &mut [u8], at, across| normal_segment(b, at, across, t);
                edge(&mut p.y, ys, luma, off, vertical, 16, seg);
                if off <= 4 {
                    edge(&mut p.u, cs, chroma, off, vertical, 8, seg);
                    edge(&mut p.v, cs, chroma, off, vertical, 8, seg);
                }
            }
        }
    }
}

/// Runs `segment` (on the buffer, the index of the first pixel after the edge, the step
/// across it) along the edge `off` samples into the `n` x `n` block at `buf[origin]`
/// (rows `stride` apart): a vertical edge `off` columns in, or a horizontal one `off` rows
/// down.
fn edge(
    buf: &mut [u8],
    stride: usize,
    origin: usize,
    off: usize,
    vertical: bool,
    n: usize,
    segment: impl Fn(&mut [u8], usize, usize),
) {
    let (at, across, along) = if vertical {
        (origin + off, 1, stride)
    } else {
        (origin + off * stride, stride, 1)
    };
    for k in 0..n {
        segment(buf, at + k * along, across);
    }
}

/// Whether to filter across the edge before `buf[at]`: 2 |p0 - q0| + |p1 - q1| / 2 within
/// the edge limit.
fn under_limit(p1: i32, p0: i32, q0: i32, q1: i32, limit: i32) -> bool {
    4 * (p0 - q0).abs() + (p1 - q1).abs() <= 2 * limit + 1
}

/// Clamps to a signed byte.
fn s8(v: i32) -> i32 {
    v.clamp(-128, 127)
}

/// Moves p0 and q0 towards each other by about 3/8 of their difference (with the outer
/// pair's difference added when `outer`), as in section 15.2's `common_adjust`; the step
/// applied to q0.
fn common_adjust(buf: &mut [u8], at: usize, across: usize, outer: bool) -> i32 {
    let px = |i: usize| i32::from(buf[i]);
    let (p1, p0, q0, q1) = (
        px(at - 2 * across),
        px(at - across),
        px(at),
        px(at + across),
    );
    let a = s8(if outer { s8(p1 - q1) } else { 0 } + 3 * (q0 - p0));
    let f1 = s8(a + 4) >> 3;
    let f2 = s8(a + 3) >> 3;
    buf[at] = (q0 - f1).clamp(0, 255) as u8;
    buf[at - across] = (p0 + f2).clamp(0, 255) as u8;
    f1
}

/// The simple filter on one segment across an edge (section 15.2).
fn simple_segment(buf: &mut [u8], at: usize, across: usize, limit: i32) {
    let px = |i: usize| i32::from(buf[i]);
    let (p1, p0, q0, q1) = (
        px(at - 2 * across),
        px(at - across),
        px(at),
        px(at + across),
    );
    if under_limit(p1, p0, q0, q1, limit) {
        common_adjust(buf, at, across, true);
    }
}

/// The normal filter on one segment across an edge (section 15.3): `t` is the edge limit,
/// interior limit, high edge variance threshold and whether it is a macroblock edge.
fn normal_segment(buf: &mut [u8], at: usize, across: usize, t: (i32, i32, i32, bool)) {
    let (limit, interior, hev_threshold, mb_edge) = t;
    // The 8 pixels across the edge, p3 first: p3..p0 before it, q0..q3 after.
    let idx = |k: usize| at - 4 * across + k * across;
    let px = |k: usize| i32::from(buf[idx(k)]);
    let (p3, p2, p1, p0) = (px(0), px(1), px(2), px(3));
    let (q0, q1, q2, q3) = (px(4), px(5), px(6), px(7));
    if !under_limit(p1, p0, q0, q1, limit)
        || [p3 - p2, p2 - p1, p1 - p0, q1 - q0, q2 - q1, q3 - q2]
            .iter()
            .any(|d| d.abs() > interior)
    {
        return;
    }
    let hev = (p1 - p0).abs() > hev_threshold || (q1 - q0).abs() > hev_threshold;
    let clip = |v: i32| v.clamp(0, 255) as u8;
    if hev {
        common_adjust(buf, at, across, true);
    } else if mb_edge {
        // Three pixels each side, by 27/128, 18/128 and 9/128 of the difference.
        let w = s8(s8(p1 - q1) + 3 * (q0 - p0));
        let a = s8((27 * w + 63) >> 7);
        buf[idx(3)] = clip(p0 + a);
        buf[idx(4)] = clip(q0 - a);
        let a = s8((18 * w + 63) >> 7);
        buf[idx(2)] = clip(p1 + a);
        buf[idx(5)] = clip(q1 - a);
        let a = s8((9 * w + 63) >> 7);
        buf[idx(1)] = clip(p2 + a);
        buf[idx(6)] = clip(q2 - a);
    } else {
        let f1 = common_adjust(buf, at, across, false);
        let a = (f1 + 1) >> 1;
        buf[idx(2)] = clip(p1 + a);
        buf[idx(5)] = clip(q1 - a);
    }
}
