//! Lossy WebP: a VP8 key frame (RFC 6386) to RGB as libwebp decodes it for Pillow
//! (`WebPDecode` with its defaults: no dithering, "fancy" chroma upsampling), so the pixels
//! equal Pillow's `convert("RGB")` to the byte:
//!
//! - the frame header (section 9): segments (quantiser and filter level per segment, the
//!   per-macroblock segment map), loop filter type, level, sharpness and deltas, the token
//!   partitions, quantiser indices, coefficient probability updates, the skip probability;
//! - per macroblock, from the first partition: segment, skip flag, luma mode (16x16, or a
//!   mode per 4x4 sub-block coded in the context of the modes above and left), chroma mode;
//!   from its token partition (macroblock row modulo their count): the coefficients, each
//!   token coded in the context of its position and its neighbours (section 13);
//! - reconstruction (`predict`): intra prediction from the unfiltered pixels around the
//!   macroblock, plus the inverse WHT and DCT of the dequantised coefficients;
//! - the loop filter (`filter`), over the whole frame once it is reconstructed;
//! - the crop to the frame's size and the conversion to RGB (`yuv`).
//!
//! Where libwebp (the decoder Pillow calls) departs from the spec's reference decoder, on
//! streams encoders do not write (segments switched on without their values: all 0 here;
//! a Y2 block whose inverse WHT is all zero: no coefficients for the inner-edge filter),
//! this follows libwebp.
//!
//! Legend: a macroblock (MB) is 16x16 luma and 8x8 + 8x8 chroma samples, in raster order,
//! `mbx`, `mby` its column and row; a block is 4x4 samples and 16 coefficients (raster
//! order once decoded): 16 luma (Y), 4 U and 4 V per macroblock, and with a 16x16 luma mode
//! a 17th (Y2) holding the luma blocks' DC coefficients.

mod bool_decoder;
mod filter;
mod predict;
mod tables;
#[cfg(test)]
mod tests;
mod yuv;

use super::super::Rgb8;
use bool_decoder::BoolDecoder;
use filter::Strength;
use tables::{AC_STEPS, BMODE_PROBS, COEFF_PROBS, COEFF_UPDATE_PROBS, DC_STEPS};

/// Whole-block luma and chroma modes (section 11.2), and B_PRED: a mode per luma sub-block.
const DC_PRED: u8 = 0;
const V_PRED: u8 = 1;
const H_PRED: u8 = 2;
const TM_PRED: u8 = 3;
const B_PRED: u8 = 4;

/// Sub-block modes (section 11.2; their values index [`BMODE_PROBS`]).
const B_DC_PRED: u8 = 0;
const B_TM_PRED: u8 = 1;
const B_VE_PRED: u8 = 2;
const B_HE_PRED: u8 = 3;
const B_LD_PRED: u8 = 4;
const B_RD_PRED: u8 = 5;
const B_VR_PRED: u8 = 6;
const B_VL_PRED: u8 = 7;
const B_HD_PRED: u8 = 8;
const B_HU_PRED: u8 = 9;

/// The coding trees (section 8.1: a node's two branches, leaves as minus their value) and
/// the fixed key-frame probabilities of the luma, chroma and segment trees.
const KF_YMODE_TREE: [i8; 8] = [-(B_PRED as i8), 2, 4, 6, 0, -1, -2, -3];
const KF_YMODE_PROBS: [u8; 4] = [145, 156, 163, 128];
const UV_MODE_TREE: [i8; 6] = [0, 2, -1, 4, -2, -3];
const KF_UV_MODE_PROBS: [u8; 3] = [142, 114, 183];
const SEGMENT_TREE: [i8; 6] = [2, 4, 0, -1, -2, -3];
#[rustfmt::skip]
const BMODE_TREE: [i8; 18] = [
    -(B_DC_PRED as i8), 2, -(B_TM_PRED as i8), 4, -(B_VE_PRED as i8), 6, 8, 12,
    -(B_HE_PRED as i8), 10, -(B_RD_PRED as i8), -(B_VR_PRED as i8), -(B_LD_PRED as i8), 14,
    -(B_VL_PRED as i8), 16, -(B_HD_PRED as i8), -(B_HU_PRED as i8),
];

/// A coefficient's band by its position in coded order (section 13.3); the 17th entry only
/// stands for the position after the last.
const BANDS: [usize; 17] = [0, 1, 2, 3, 6, 4, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 0];
/// The raster index of the k-th coefficient coded.
const ZIGZAG: [usize; 16] = [0, 1, 4, 8, 5, 2, 3, 6, 9, 12, 13, 10, 7, 11, 14, 15];
/// The probabilities of the extra bits of tokens DCT_cat3 to DCT_cat6, most significant
/// first, and the least value of each (section 13.2).
const CATEGORIES: [(&[u8], i32); 4] = [
    (&[173, 148, 140], 11),
    (&[176, 155, 140, 135], 19),
    (&[180, 157, 141, 134, 130], 35),
    (&[254, 254, 243, 230, 196, 177, 153, 140, 133, 130, 129], 67),
];

/// Token probabilities by block type, coefficient position (its band looked up), context
/// and tree node.
type Probs = [[[[u8; 11]; 3]; 17]; 4];

/// The frame's samples: luma at 16 x 16 and each chroma plane at 8 x 8 per macroblock.
struct Planes {
    y: Vec<u8>,
    u: Vec<u8>,
    v: Vec<u8>,
    mb_w: usize,
}

/// Dequantisation factors of a segment, (DC, AC) for each kind of block (section 14.1).
#[derive(Clone, Copy, Default)]
struct Quant {
    y: [i32; 2],
    y2: [i32; 2],
    uv: [i32; 2],
}

/// The frame header, as far as a key frame's macroblocks use it.
struct Header {
    width: usize,
    height: usize,
    mb_w: usize,
    mb_h: usize,
    /// The segment tree's probabilities when each macroblock codes its segment.
    segment_probs: Option<[u8; 3]>,
    quant: [Quant; 4],
    /// `None` when the frame's filter level is 0.
    filter: Option<LoopFilter>,
    probs: Box<Probs>,
    skip_prob: Option<u8>,
    /// The filter's sharpness, for the tests' account of a header ([`describe`]).
    #[cfg(test)]
    sharpness: i32,
}

/// Each segment's quantiser index and filter level: its own (`absolute`), or added to the
/// frame's.
struct Segments {
    absolute: bool,
    quant: [i32; 4],
    level: [i32; 4],
}

/// The loop filter's type and its settings by segment, for 16x16 and 4x4 luma modes.
struct LoopFilter {
    simple: bool,
    strengths: [[Strength; 2]; 4],
}

/// A macroblock's modes, from the first partition.
struct Modes {
    segment: usize,
    skip: bool,
    luma: u8,
    /// The sub-block modes when `luma` is B_PRED, raster order.
    sub: [u8; 16],
    chroma: u8,
}

/// Which blocks along a macroblock's edge ended with non-zero coefficients: the context of
/// the first token of the blocks beside them.
#[derive(Clone, Copy, Default)]
struct Nonzero {
    y: [bool; 4],
    u: [bool; 2],
    v: [bool; 2],
    y2: bool,
}

impl Nonzero {
    /// Beside a macroblock without coefficients: all zero, but the Y2 block's when the
    /// macroblock has none (`sub_blocks`: its luma mode is B_PRED), which stays as it was.
    fn skipped(&mut self, sub_blocks: bool) {
        *self = Nonzero {
            y2: sub_blocks && self.y2,
            ..Nonzero::default()
        };
    }
}

/// The RGB pixels of the `VP8 ` chunk `data`.
pub(super) fn decode(data: &[u8]) -> Result<Rgb8, String> {
    let (h, mut first, mut parts) = header(data)?;
    let mut planes = Planes {
        y: vec![0; h.mb_w * h.mb_h * 256],
        u: vec![0; h.mb_w * h.mb_h * 64],
        v: vec![0; h.mb_w * h.mb_h * 64],
        mb_w: h.mb_w,
    };
    let mut strengths = Vec::with_capacity(h.mb_w * h.mb_h);
    let mut top_modes = vec![B_DC_PRED; 4 * h.mb_w];
    let mut top_nz = vec![Nonzero::default(); h.mb_w];
    let mut row = Vec::with_capacity(h.mb_w);
    let n_parts = parts.len();
    for mby in 0..h.mb_h {
        // The row's modes first, as libwebp reads them (the partitions are independent).
        let mut left_modes = [B_DC_PRED; 4];
        row.clear();
        for mbx in 0..h.mb_w {
            row.push(modes(
                &mut first,
                &h,
                &mut top_modes[4 * mbx..][..4],
                &mut left_modes,
            ));
        }
        if first.eof {
            return Err(format!(
                "lossy WebP (VP8) first partition cut short in macroblock row {mby} of {}",
                h.mb_h
            ));
        }
        let tokens = &mut parts[mby % n_parts];
        let mut left_nz = Nonzero::default();
        for (mbx, m) in row.iter().enumerate() {
            let mut coeffs = [[0i16; 16]; 24];
            let coded = if m.skip {
                top_nz[mbx].skipped(m.luma == B_PRED);
                left_nz.skipped(m.luma == B_PRED);
                false
            } else {
                let q = &h.quant[m.segment];
                residuals(
                    tokens,
                    &h.probs,
                    q,
                    m,
                    &mut top_nz[mbx],
                    &mut left_nz,
                    &mut coeffs,
                )
            };
            if tokens.eof {
                return Err(format!(
                    "lossy WebP (VP8) token partition cut short at macroblock ({mbx}, {mby}) of {}x{}",
                    h.mb_w, h.mb_h
                ));
            }
            predict::macroblock(&mut planes, mbx, mby, m, &coeffs);
            if let Some(f) = &h.filter {
                let mut s = f.strengths[m.segment][usize::from(m.luma == B_PRED)];
                s.inner |= coded;
                strengths.push(s);
            }
        }
    }
    if let Some(f) = &h.filter {
        filter::frame(&mut planes, &strengths, f.simple);
    }
    Ok(Rgb8 {
        width: h.width as u32,
        height: h.height as u32,
        data: yuv::rgb(&planes, h.width, h.height),
    })
}

/// The frame header (sections 9 and 19.2): the uncompressed 10 bytes, then the first
/// partition's header fields; that partition's decoder, left at the macroblock modes, and
/// the token partitions'.
fn header(data: &[u8]) -> Result<(Header, BoolDecoder<'_>, Vec<BoolDecoder<'_>>), String> {
    let (width, height, first_len) = frame_tag(data)?;
    let rest = &data[10..];
    let first = rest.get(..first_len).ok_or_else(|| {
        format!(
            "lossy WebP (VP8) first partition cut short: {first_len} bytes expected, {} left",
            rest.len()
        )
    })?;
    let mut d = BoolDecoder::new(first);
    let _colour_space = d.flag();
    let _clamping = d.flag(); // libwebp always clamps
    let (segments, segment_probs) = segment_header(&mut d);
    let simple = d.flag();
    let level = d.literal(6) as i32;
    let sharpness = d.literal(3) as i32;
    let mut deltas = None;
    if d.flag() {
        let (mut refs, mut modes) = ([0; 4], [0; 4]);
        if d.flag() {
            for r in refs.iter_mut().chain(modes.iter_mut()) {
                if d.flag() {
                    *r = d.signed(6);
                }
            }
        }
        // Key frames are intra: the intra frame's delta, and B_PRED's (mode delta 0).
        deltas = Some((refs[0], modes[0]));
    }
    let n_parts = 1usize << d.literal(2);
    let base_q = d.literal(7) as i32;
    let [y_dc, y2_dc, y2_ac, uv_dc, uv_ac] = [(); 5].map(|_| d.optional_signed(4));
    let mut quant = [Quant::default(); 4];
    let mut strengths = [[Strength::default(); 2]; 4];
    for (s, (q, st)) in quant.iter_mut().zip(&mut strengths).enumerate() {
        let (sq, slevel) = match &segments {
            Some(g) if g.absolute => (g.quant[s], g.level[s]),
            Some(g) => (base_q + g.quant[s], level + g.level[s]),
            None => (base_q, level),
        };
        let dc = |delta: i32, max: i32| i32::from(DC_STEPS[(sq + delta).clamp(0, max) as usize]);
        let ac = |delta: i32| i32::from(AC_STEPS[(sq + delta).clamp(0, 127) as usize]);
        *q = Quant {
            y: [dc(y_dc, 127), ac(0)],
            y2: [2 * dc(y2_dc, 127), (ac(y2_ac) * 155 / 100).max(8)],
            uv: [dc(uv_dc, 117), ac(uv_ac)],
        };
        *st = filter::strengths(slevel, sharpness, deltas);
    }
    let _refresh_probs = d.flag();
    let probs = token_probs(&mut d);
    let skip_prob = d.flag().then(|| d.literal(8) as u8);
    if d.eof {
        return Err("lossy WebP (VP8) first partition cut short in its frame header".into());
    }
    let parts = token_partitions(&rest[first_len..], n_parts)?;
    let h = Header {
        width,
        height,
        mb_w: width.div_ceil(16),
        mb_h: height.div_ceil(16),
        segment_probs,
        quant,
        filter: (level > 0).then_some(LoopFilter { simple, strengths }),
        probs,
        skip_prob,
        #[cfg(test)]
        sharpness,
    };
    Ok((h, d, parts))
}

/// The uncompressed start of a key frame (section 9.1): the frame tag, the start code, the
/// sizes. The width, height and first partition's length.
fn frame_tag(data: &[u8]) -> Result<(usize, usize, usize), String> {
    let &[t0, t1, t2, s0, s1, s2, w0, w1, h0, h1, ..] = data else {
        return Err(format!(
            "lossy WebP (VP8) frame header cut short: {} bytes (expected 10)",
            data.len()
        ));
    };
    let tag = u32::from_le_bytes([t0, t1, t2, 0]);
    if tag & 1 != 0 {
        return Err("lossy WebP (VP8) whose frame is not a key frame".into());
    }
    if (tag >> 1) & 7 > 3 {
        return Err(format!(
            "lossy WebP (VP8) of version {} (expected 0-3)",
            (tag >> 1) & 7
        ));
    }
    if (tag >> 4) & 1 == 0 {
        return Err("lossy WebP (VP8) whose frame is marked not shown".into());
    }
    if [s0, s1, s2] != [0x9d, 0x01, 0x2a] {
        return Err("lossy WebP (VP8) without its start code 9d 01 2a".into());
    }
    // The top two bits are an upscaling hint, ignored (as libwebp ignores them).
    let width = usize::from(u16::from_le_bytes([w0, w1]) & 0x3fff);
    let height = usize::from(u16::from_le_bytes([h0, h1]) & 0x3fff);
    super::super::check_area(width as u64, height as u64)?;
    Ok((width, height, (tag >> 5) as usize))
}

/// The segment header (section 9.3): when segments are on, their values (all 0 when not
/// sent: libwebp's reset), and the segment tree's probabilities when macroblocks code their
/// segment.
fn segment_header(d: &mut BoolDecoder) -> (Option<Segments>, Option<[u8; 3]>) {
    if !d.flag() {
        return (None, None);
    }
    let update_map = d.flag();
    let mut s = Segments {
        absolute: true,
        quant: [0; 4],
        level: [0; 4],
    };
    if d.flag() {
        s.absolute = d.flag();
        s.quant = [(); 4].map(|_| d.optional_signed(7));
        s.level = [(); 4].map(|_| d.optional_signed(6));
    }
    let probs =
        update_map.then(|| [(); 3].map(|_| if d.flag() { d.literal(8) as u8 } else { 255 }));
    (Some(s), probs)
}

/// The token probabilities (section 13.4): the defaults, each updated where a bool (with
/// its update probability) says so; spread from bands to coefficient positions.
fn token_probs(d: &mut BoolDecoder) -> Box<Probs> {
    let mut probs = Box::new([[[[0u8; 11]; 3]; 17]; 4]);
    let mut by_band = COEFF_PROBS;
    for (t, bands) in by_band.iter_mut().enumerate() {
        for (b, ctxs) in bands.iter_mut().enumerate() {
            for (c, ps) in ctxs.iter_mut().enumerate() {
                for (i, p) in ps.iter_mut().enumerate() {
                    if d.bool(COEFF_UPDATE_PROBS[t][b][c][i]) {
                        *p = d.literal(8) as u8;
                    }
                }
            }
        }
        for (n, &band) in BANDS.iter().enumerate() {
            probs[t][n] = bands[band];
        }
    }
    probs
}

/// The `n` token partitions in `rest` (section 9.5): the sizes of all but the last, 3 bytes
/// each, then their data. As libwebp, a size past the data is cut to it, but the last
/// partition must not be empty.
fn token_partitions(rest: &[u8], n: usize) -> Result<Vec<BoolDecoder<'_>>, String> {
    let sizes = rest.get(..3 * (n - 1)).ok_or_else(|| {
        format!("lossy WebP (VP8) cut short before the sizes of its {n} token partitions")
    })?;
    let mut rest = &rest[sizes.len()..];
    let mut parts = Vec::with_capacity(n);
    for s in sizes.chunks(3) {
        let len = (u32::from_le_bytes([s[0], s[1], s[2], 0]) as usize).min(rest.len());
        parts.push(BoolDecoder::new(&rest[..len]));
        rest = &rest[len..];
    }
    if rest.is_empty() {
        return Err(format!(
            "lossy WebP (VP8) cut short before its token partition {n} of {n}"
        ));
    }
    parts.push(BoolDecoder::new(rest));
    Ok(parts)
}

/// A macroblock's modes (section 11); `above` and `left` are the sub-block modes beside it
/// (a whole-block mode counting as its sub-block twin), updated for the next ones.
fn modes(d: &mut BoolDecoder, h: &Header, above: &mut [u8], left: &mut [u8; 4]) -> Modes {
    let segment = h
        .segment_probs
        .map_or(0, |p| usize::from(d.tree(&SEGMENT_TREE, &p)));
    let skip = h.skip_prob.is_some_and(|p| d.bool(p));
    let luma = d.tree(&KF_YMODE_TREE, &KF_YMODE_PROBS);
    let mut sub = [B_DC_PRED; 16];
    if luma == B_PRED {
        for (i, s) in sub.iter_mut().enumerate() {
            let (x, y) = (i % 4, i / 4);
            let probs = &BMODE_PROBS[usize::from(above[x])][usize::from(left[y])];
            *s = d.tree(&BMODE_TREE, probs);
            above[x] = *s;
            left[y] = *s;
        }
    } else {
        let twin = [B_DC_PRED, B_VE_PRED, B_HE_PRED, B_TM_PRED][usize::from(luma)];
        above.fill(twin);
        left.fill(twin);
    }
    let chroma = d.tree(&UV_MODE_TREE, &KF_UV_MODE_PROBS);
    Modes {
        segment,
        skip,
        luma,
        sub,
        chroma,
    }
}

/// A macroblock's coefficients, dequantised, into `coeffs` (16 Y, 4 U, 4 V blocks; with a
/// 16x16 luma mode the Y blocks' DC from the inverse WHT of the Y2 block). Whether any
/// block has a non-zero coefficient (libwebp's count: the Y2 block itself does not count,
/// the DC it gives does), which turns on the inner-edge loop filter.
fn residuals(
    d: &mut BoolDecoder,
    probs: &Probs,
    q: &Quant,
    m: &Modes,
    above: &mut Nonzero,
    left: &mut Nonzero,
    coeffs: &mut [[i16; 16]; 24],
) -> bool {
    // Block types: 0 Y after Y2, 1 Y2, 2 chroma, 3 Y with its DC.
    let (first, y_type) = if m.luma == B_PRED {
        (0, 3)
    } else {
        let mut y2 = [0i16; 16];
        let ctx = usize::from(above.y2) + usize::from(left.y2);
        let n = coefficients(d, &probs[1], ctx, q.y2, 0, &mut y2);
        above.y2 = n > 0;
        left.y2 = n > 0;
        for (block, dc) in coeffs.iter_mut().zip(predict::inverse_wht(&y2)) {
            block[0] = dc;
        }
        (1, 0)
    };
    let mut coded = false;
    for (i, block) in coeffs[..16].iter_mut().enumerate() {
        let (x, y) = (i % 4, i / 4);
        let ctx = usize::from(above.y[x]) + usize::from(left.y[y]);
        let n = coefficients(d, &probs[y_type], ctx, q.y, first, block);
        above.y[x] = n > first;
        left.y[y] = n > first;
        coded |= n > 1 || block[0] != 0;
    }
    for (plane, blocks) in coeffs[16..].chunks_mut(4).enumerate() {
        let (a, l) = if plane == 0 {
            (&mut above.u, &mut left.u)
        } else {
            (&mut above.v, &mut left.v)
        };
        for (i, block) in blocks.iter_mut().enumerate() {
            let (x, y) = (i % 2, i / 2);
            let ctx = usize::from(a[x]) + usize::from(l[y]);
            let n = coefficients(d, &probs[2], ctx, q.uv, 0, block);
            a[x] = n > 0;
            l[y] = n > 0;
            coded |= n > 1 || block[0] != 0;
        }
    }
    coded
}

/// One block's tokens from coded position `n` on (section 13.2), each value times its
/// factor (`dq[0]` at position 0, `dq[1]` after) stored at its raster index, truncated to
/// 16 bits as libwebp stores it. The position after the last non-zero token.
fn coefficients(
    d: &mut BoolDecoder,
    probs: &[[[u8; 11]; 3]; 17],
    ctx: usize,
    dq: [i32; 2],
    mut n: usize,
    out: &mut [i16; 16],
) -> usize {
    let mut p = &probs[n][ctx];
    while n < 16 {
        if !d.bool(p[0]) {
            return n; // end of block
        }
        // Zeros: no end of block can follow one, so its branch is skipped.
        while !d.bool(p[1]) {
            n += 1;
            if n == 16 {
                return 16;
            }
            p = &probs[n][0];
        }
        let (v, next_ctx) = if !d.bool(p[2]) {
            (1, 1)
        } else {
            (large_value(d, p), 2)
        };
        let v = if d.flag() { -v } else { v };
        out[ZIGZAG[n]] = (v * dq[usize::from(n > 0)]) as i16;
        n += 1;
        p = &probs[n][next_ctx];
    }
    16
}

/// A token's value of 2 or more: DCT_2 to DCT_4, or a category's least value plus its
/// extra bits.
fn large_value(d: &mut BoolDecoder, p: &[u8; 11]) -> i32 {
    if !d.bool(p[3]) {
        if !d.bool(p[4]) {
            2
        } else {
            3 + i32::from(d.bool(p[5]))
        }
    } else if !d.bool(p[6]) {
        if !d.bool(p[7]) {
            5 + i32::from(d.bool(159)) // DCT_cat1
        } else {
            let hi = i32::from(d.bool(165)); // DCT_cat2
            7 + 2 * hi + i32::from(d.bool(145))
        }
    } else {
        let hi = usize::from(d.bool(p[8]));
        let lo = usize::from(d.bool(p[9 + hi]));
        let (extra, least) = CATEGORIES[2 * hi + lo];
        least
            + extra
                .iter()
                .fold(0, |v, &prob| 2 * v + i32::from(d.bool(prob)))
    }
}

/// The frame header of the `VP8 ` chunk `data` in words: the loop filter (type, or none;
/// its sharpness), the token partitions, whether macroblocks code their segment.
#[cfg(test)]
pub(super) fn describe(data: &[u8]) -> Result<String, String> {
    let (h, _, parts) = header(data)?;
    let filter = match h.filter {
        None => "no",
        Some(LoopFilter { simple: true, .. }) => "simple",
        Some(_) => "normal",
    };
    let map = if h.segment_probs.is_some() { "a" } else { "no" };
    Ok(format!(
        "{filter} filter, sharpness {}, {} token partitions, {map} segment map",
        h.sharpness,
        parts.len()
    ))
}
