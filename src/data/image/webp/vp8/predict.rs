//! A macroblock's reconstruction: intra prediction (RFC 6386 section 12) plus the residue,
//! the inverse DCT of each block's dequantised coefficients (section 14.4; the Y2 block's
//! inverse WHT, section 14.3, gives the luma blocks' DC first).
//!
//! Prediction reads the pixels above and left of the macroblock before the loop filter
//! (the frame is filtered once whole). Outside the frame, the row above reads 127 and the
//! column left 129; the pixel above-left is 127 on the top row and 129 below it. The 4x4
//! sub-blocks also read the four pixels above and right of them; on the macroblock's right
//! column those are the four right of the row above the macroblock (below the top row: the
//! next macroblock's bottom row, or the last pixel above repeated on the frame's right).
//!
//! Each macroblock is built in a small work area: its pixels plus the row above (with the
//! above-left and the four above-right) and the column left.

use super::{
    B_DC_PRED, B_HD_PRED, B_HE_PRED, B_HU_PRED, B_LD_PRED, B_RD_PRED, B_TM_PRED, B_VE_PRED,
    B_VL_PRED, B_VR_PRED,
};
use super::{B_PRED, DC_PRED, H_PRED, Modes, Planes, TM_PRED, V_PRED};

/// The luma work area's stride: the left column, 16 pixels, 4 above-right; 17 rows.
const LS: usize = 21;
/// The chroma work area's stride: the left column and 8 pixels; 9 rows.
const CS: usize = 9;

/// Predicts macroblock (`mbx`, `mby`) of `p` with modes `m` and adds its residue `coeffs`
/// (16 Y, 4 U, 4 V blocks).
pub(super) fn macroblock(
    p: &mut Planes,
    mbx: usize,
    mby: usize,
    m: &Modes,
    coeffs: &[[i16; 16]; 24],
) {
    let mut w = [0u8; LS * 17];
    let stride = 16 * p.mb_w;
    edges(&mut w, LS, &p.y, stride, mbx, mby, 16);
    if mby > 0 {
        let above = (16 * mby - 1) * stride + 16 * mbx;
        if mbx + 1 < p.mb_w {
            w[17..21].copy_from_slice(&p.y[above + 16..above + 20]);
        } else {
            w[17..21].fill(p.y[above + 15]);
        }
    }
    if m.luma == B_PRED {
        // Sub-blocks 7, 11 and 15 read sub-block 3's above-right pixels.
        for r in [4, 8, 12] {
            w.copy_within(17..21, r * LS + 17);
        }
        for (i, (&mode, c)) in m.sub.iter().zip(coeffs).enumerate() {
            let at = (1 + 4 * (i / 4)) * LS + 1 + 4 * (i % 4);
            sub_block(&mut w, at, mode);
            add_residue(c, &mut w, at, LS);
        }
    } else {
        whole_block(&mut w, LS + 1, LS, 16, m.luma, mbx > 0, mby > 0);
        for (i, c) in coeffs[..16].iter().enumerate() {
            add_residue(c, &mut w, (1 + 4 * (i / 4)) * LS + 1 + 4 * (i % 4), LS);
        }
    }
    put(&w, LS, &mut p.y, stride, mbx, mby, 16);
    let stride = 8 * p.mb_w;
    for (plane, blocks) in [(&mut p.u, &coeffs[16..20]), (&mut p.v, &coeffs[20..])] {
        let mut w = [0u8; CS * 9];
        edges(&mut w, CS, plane, stride, mbx, mby, 8);
        whole_block(&mut w, CS + 1, CS, 8, m.chroma, mbx > 0, mby > 0);
        for (i, c) in blocks.iter().enumerate() {
            add_residue(c, &mut w, (1 + 4 * (i / 2)) * CS + 1 + 4 * (i % 2), CS);
        }
        put(&w, CS, plane, stride, mbx, mby, 8);
    }
}

/// The row above (with the above-left pixel) and the column left of the `n` x `n` block
/// of `plane` at macroblock (`mbx`, `mby`) into the work area `w` (`ws` its stride).
fn edges(w: &mut [u8], ws: usize, plane: &[u8], stride: usize, mbx: usize, mby: usize, n: usize) {
    let (x0, y0) = (n * mbx, n * mby);
    if mby == 0 {
        w[..ws].fill(127);
    } else {
        let above = (y0 - 1) * stride + x0;
        w[0] = if mbx == 0 { 129 } else { plane[above - 1] };
        w[1..=n].copy_from_slice(&plane[above..above + n]);
    }
    for r in 0..n {
        w[(r + 1) * ws] = if mbx == 0 {
            129
        } else {
            plane[(y0 + r) * stride + x0 - 1]
        };
    }
}

/// The work area's `n` x `n` block back into `plane`.
fn put(w: &[u8], ws: usize, plane: &mut [u8], stride: usize, mbx: usize, mby: usize, n: usize) {
    for r in 0..n {
        let at = (n * mby + r) * stride + n * mbx;
        plane[at..at + n].copy_from_slice(&w[(r + 1) * ws + 1..][..n]);
    }
}

/// A whole-block mode (section 12.2) over the `n` x `n` block at `w[at]` (stride `s`). DC
/// averages the edges inside the frame only (128 when neither is).
fn whole_block(w: &mut [u8], at: usize, s: usize, n: usize, mode: u8, left: bool, above: bool) {
    let (mut corner_top, mut side) = ([0u8; 17], [0u8; 16]);
    corner_top[..=n].copy_from_slice(&w[at - s - 1..at - s + n]);
    let (corner, top) = (corner_top[0], &corner_top[1..=n]);
    for (r, l) in side[..n].iter_mut().enumerate() {
        *l = w[at + r * s - 1];
    }
    let side = &side[..n];
    let shift = n.trailing_zeros();
    let dc = || {
        let sum = |v: &[u8]| v.iter().map(|&x| u32::from(x)).sum::<u32>();
        match (above, left) {
            (true, true) => (sum(top) + sum(side) + n as u32) >> (shift + 1),
            (true, false) => (sum(top) + (n as u32 >> 1)) >> shift,
            (false, true) => (sum(side) + (n as u32 >> 1)) >> shift,
            (false, false) => 128,
        }
    };
    let dc = if mode == DC_PRED { dc() as u8 } else { 0 };
    for (r, &l) in side.iter().enumerate() {
        let row = &mut w[at + r * s..][..n];
        match mode {
            DC_PRED => row.fill(dc),
            V_PRED => row.copy_from_slice(top),
            H_PRED => row.fill(l),
            TM_PRED => {
                for (px, &a) in row.iter_mut().zip(top) {
                    *px = (i32::from(l) + i32::from(a) - i32::from(corner)).clamp(0, 255) as u8;
                }
            }
            _ => unreachable!("whole-block mode {mode}"),
        }
    }
}

/// A sub-block mode (section 12.3) over the 4x4 block at `w[at]` (stride [`LS`]).
fn sub_block(w: &mut [u8], at: usize, mode: u8) {
    // The edge, bottom-left to top-right: L[3], L[2], L[1], L[0], P, A[0] .. A[7].
    let mut e = [0u8; 13];
    for k in 0..4 {
        e[3 - k] = w[at + k * LS - 1];
    }
    e[4..].copy_from_slice(&w[at - LS - 1..at - LS + 8]);
    let e = e.map(i32::from);
    let avg3 = |a: i32, b: i32, c: i32| (a + 2 * b + c + 2) >> 2;
    // Smoothed edge pixel `i`, and the synthetic pixel between `i` and `i + 1`.
    let s3 = |i: usize| avg3(e[i - 1], e[i], e[i + 1]);
    let s2 = |i: usize| (e[i] + e[i + 1] + 1) >> 1;
    let mut b = [[0i32; 4]; 4]; // [row][column]
    match mode {
        B_DC_PRED => {
            let dc = (e[..4].iter().chain(&e[5..9]).sum::<i32>() + 4) >> 3;
            b = [[dc; 4]; 4];
        }
        B_TM_PRED => {
            for (r, row) in b.iter_mut().enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    *v = (e[3 - r] + e[5 + c] - e[4]).clamp(0, 255);
                }
            }
        }
        B_VE_PRED => b = [[s3(5), s3(6), s3(7), s3(8)]; 4],
        B_HE_PRED => {
            for (r, row) in b.iter_mut().enumerate() {
                *row = [if r < 3 {
                    s3(3 - r)
                } else {
                    avg3(e[1], e[0], e[0])
                }; 4];
            }
        }
        B_LD_PRED => {
            for (r, row) in b.iter_mut().enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    *v = if r + c < 6 {
                        s3(6 + r + c)
                    } else {
                        avg3(e[11], e[12], e[12])
                    };
                }
            }
        }
        B_RD_PRED => {
            for (r, row) in b.iter_mut().enumerate() {
                for (c, v) in row.iter_mut().enumerate() {
                    *v = s3(4 + c - r);
                }
            }
        }
        B_VR_PRED => {
            b[3][0] = s3(2);
            b[2][0] = s3(3);
            (b[3][1], b[1][0]) = (s3(4), s3(4));
            (b[2][1], b[0][0]) = (s2(4), s2(4));
            (b[3][2], b[1][1]) = (s3(5), s3(5));
            (b[2][2], b[0][1]) = (s2(5), s2(5));
            (b[3][3], b[1][2]) = (s3(6), s3(6));
            (b[2][3], b[0][2]) = (s2(6), s2(6));
            b[1][3] = s3(7);
            b[0][3] = s2(7);
        }
        B_VL_PRED => {
            b[0][0] = s2(5);
            b[1][0] = s3(6);
            (b[2][0], b[0][1]) = (s2(6), s2(6));
            (b[1][1], b[3][0]) = (s3(7), s3(7));
            (b[2][1], b[0][2]) = (s2(7), s2(7));
            (b[3][1], b[1][2]) = (s3(8), s3(8));
            (b[2][2], b[0][3]) = (s2(8), s2(8));
            (b[3][2], b[1][3]) = (s3(9), s3(9));
            b[2][3] = s3(10);
            b[3][3] = s3(11);
        }
        B_HD_PRED => {
            b[3][0] = s2(0);
            b[3][1] = s3(1);
            (b[2][0], b[3][2]) = (s2(1), s2(1));
            (b[2][1], b[3][3]) = (s3(2), s3(2));
            (b[2][2], b[1][0]) = (s2(2), s2(2));
            (b[2][3], b[1][1]) = (s3(3), s3(3));
            (b[1][2], b[0][0]) = (s2(3), s2(3));
            (b[1][3], b[0][1]) = (s3(4), s3(4));
            b[0][2] = s3(5);
            b[0][3] = s3(6);
        }
        B_HU_PRED => {
            // Up the left column L[0] = e[3] .. L[3] = e[0]; past its end, L[3].
            let (l0, l1, l2, l3) = (e[3], e[2], e[1], e[0]);
            b = [[l3; 4]; 4];
            b[0][0] = (l0 + l1 + 1) >> 1;
            b[0][1] = avg3(l0, l1, l2);
            (b[0][2], b[1][0]) = ((l1 + l2 + 1) >> 1, (l1 + l2 + 1) >> 1);
            (b[0][3], b[1][1]) = (avg3(l1, l2, l3), avg3(l1, l2, l3));
            (b[1][2], b[2][0]) = ((l2 + l3 + 1) >> 1, (l2 + l3 + 1) >> 1);
            (b[1][3], b[2][1]) = (avg3(l2, l3, l3), avg3(l2, l3, l3));
        }
        _ => unreachable!("sub-block mode {mode}"),
    }
    for (r, row) in b.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            w[at + r * LS + c] = v as u8;
        }
    }
}

/// The inverse WHT of the Y2 block (section 14.3): the DC of the 16 luma blocks, raster
/// order, truncated to 16 bits as libwebp stores them.
pub(super) fn inverse_wht(c: &[i16; 16]) -> [i16; 16] {
    let c = c.map(i32::from);
    let mut t = [0i32; 16];
    for i in 0..4 {
        let (a1, b1) = (c[i] + c[12 + i], c[4 + i] + c[8 + i]);
        let (c1, d1) = (c[4 + i] - c[8 + i], c[i] - c[12 + i]);
        t[i] = a1 + b1;
        t[4 + i] = c1 + d1;
        t[8 + i] = a1 - b1;
        t[12 + i] = d1 - c1;
    }
    let mut out = [0i16; 16];
    for i in 0..4 {
        let r = &t[4 * i..4 * i + 4];
        let (a1, b1) = (r[0] + r[3], r[1] + r[2]);
        let (c1, d1) = (r[1] - r[2], r[0] - r[3]);
        let o = &mut out[4 * i..4 * i + 4];
        o[0] = ((a1 + b1 + 3) >> 3) as i16;
        o[1] = ((c1 + d1 + 3) >> 3) as i16;
        o[2] = ((a1 - b1 + 3) >> 3) as i16;
        o[3] = ((d1 - c1 + 3) >> 3) as i16;
    }
    out
}

/// Adds the inverse DCT of a block's coefficients `c` (section 14.4: columns, then rows
/// rounded by 3 bits) to the 4x4 pixels at `w[at]` (stride `s`), clamping to 0..=255.
fn add_residue(c: &[i16; 16], w: &mut [u8], at: usize, s: usize) {
    if c[1..].iter().all(|&v| v == 0) {
        if c[0] != 0 {
            // Only the DC: every output is the same (the full transform's value).
            let dc = (i32::from(c[0]) + 4) >> 3;
            for r in 0..4 {
                for px in &mut w[at + r * s..][..4] {
                    *px = (i32::from(*px) + dc).clamp(0, 255) as u8;
                }
            }
        }
        return;
    }
    // x cos(pi/8) sqrt(2) and x sin(pi/8) sqrt(2), in 16-bit fixed point (wrapping as
    // libwebp's 32-bit ints would on out-of-range input; no encoder writes such values).
    let mul1 = |x: i32| x.wrapping_add(x.wrapping_mul(20091) >> 16);
    let mul2 = |x: i32| x.wrapping_mul(35468) >> 16;
    let c = c.map(i32::from);
    let mut t = [0i32; 16]; // t[4 * column + row]
    for i in 0..4 {
        let (a, b) = (c[i] + c[8 + i], c[i] - c[8 + i]);
        let cc = mul2(c[4 + i]) - mul1(c[12 + i]);
        let d = mul1(c[4 + i]) + mul2(c[12 + i]);
        t[4 * i..4 * i + 4].copy_from_slice(&[a + d, b + cc, b - cc, a - d]);
    }
    for r in 0..4 {
        let dc = t[r] + 4;
        let (a, b) = (dc + t[8 + r], dc - t[8 + r]);
        let cc = mul2(t[4 + r]) - mul1(t[12 + r]);
        let d = mul1(t[4 + r]) + mul2(t[12 + r]);
        let row = &mut w[at + r * s..][..4];
        for (px, v) in row.iter_mut().zip([a + d, b + cc, b - cc, a - d]) {
            *px = (i32::from(*px) + (v >> 3)).clamp(0, 255) as u8;
        }
    }
}
