//! The inverse transforms of a VP8L image (RFC 9649 section 4), applied in place on ARGB
//! pixels (one `u32` each, alpha in the top byte): the predictor transform's 14 modes, the
//! colour transform, and colour indexing (palette lookup of packed indices).

/// Per-channel sum modulo 256.
pub(super) fn add_argb(a: u32, b: u32) -> u32 {
    let ag = (a & 0xff00_ff00).wrapping_add(b & 0xff00_ff00) & 0xff00_ff00;
    let rb = (a & 0x00ff_00ff).wrapping_add(b & 0x00ff_00ff) & 0x00ff_00ff;
    ag | rb
}

/// Per-channel mean, rounded down.
fn average2(a: u32, b: u32) -> u32 {
    (((a ^ b) & 0xfefe_fefe) >> 1) + (a & b)
}

fn channels(p: u32) -> [i32; 4] {
    [
        (p >> 24) as i32,
        ((p >> 16) & 0xff) as i32,
        ((p >> 8) & 0xff) as i32,
        (p & 0xff) as i32,
    ]
}

fn pack(c: [i32; 4]) -> u32 {
    c.iter()
        .fold(0u32, |acc, &v| (acc << 8) | v.clamp(0, 255) as u32)
}

fn select(l: u32, t: u32, tl: u32) -> u32 {
    let (l4, t4, tl4) = (channels(l), channels(t), channels(tl));
    let pl: i32 = (0..4).map(|i| (t4[i] - tl4[i]).abs()).sum();
    let pt: i32 = (0..4).map(|i| (l4[i] - tl4[i]).abs()).sum();
    if pl < pt { l } else { t }
}

fn clamp_add_subtract_full(a: u32, b: u32, c: u32) -> u32 {
    let (a, b, c) = (channels(a), channels(b), channels(c));
    pack(std::array::from_fn(|i| a[i] + b[i] - c[i]))
}

fn clamp_add_subtract_half(a: u32, b: u32) -> u32 {
    let (a, b) = (channels(a), channels(b));
    pack(std::array::from_fn(|i| a[i] + (a[i] - b[i]) / 2))
}

/// Undoes the predictor transform in place: each pixel plus its prediction from the
/// pixels decoded before it (left, top, top-left, top-right), by its tile's mode.
pub(super) fn predict(px: &mut [u32], w: usize, h: usize, tb: u32, modes: &[u32]) {
    let tw = w.div_ceil(1 << tb);
    for y in 0..h {
        for x in 0..w {
            let i = y * w + x;
            let pred = if y == 0 && x == 0 {
                0xff00_0000
            } else if y == 0 {
                px[i - 1]
            } else if x == 0 {
                px[i - w]
            } else {
                let mode = (modes[(y >> tb) * tw + (x >> tb)] >> 8) & 0xf;
                let (l, t, tl) = (px[i - 1], px[i - w], px[i - w - 1]);
                // The rightmost column's top-right is the row's first pixel (memory order).
                let tr = px[i - w + 1];
                match mode {
                    0 => 0xff00_0000,
                    1 => l,
                    2 => t,
                    3 => tr,
                    4 => tl,
                    5 => average2(average2(l, tr), t),
                    6 => average2(l, tl),
                    7 => average2(l, t),
                    8 => average2(tl, t),
                    9 => average2(t, tr),
                    10 => average2(average2(l, tl), average2(t, tr)),
                    11 => select(l, t, tl),
                    12 => clamp_add_subtract_full(l, t, tl),
                    13 => clamp_add_subtract_half(average2(l, t), tl),
                    _ => 0xff00_0000,
                }
            };
            px[i] = add_argb(px[i], pred);
        }
    }
}

/// Undoes the colour transform in place (red from green, then blue from green and red).
pub(super) fn colour(px: &mut [u32], w: usize, tb: u32, elems: &[u32]) {
    let tw = w.div_ceil(1 << tb);
    let delta =
        |t: u32, c: u32| ((i32::from(t as u8 as i8) * i32::from(c as u8 as i8)) >> 5) as u32;
    for (i, p) in px.iter_mut().enumerate() {
        let (x, y) = (i % w, i / w);
        let e = elems[(y >> tb) * tw + (x >> tb)];
        let (g2r, g2b, r2b) = (e & 0xff, (e >> 8) & 0xff, (e >> 16) & 0xff);
        let green = (*p >> 8) & 0xff;
        let red = (((*p >> 16) & 0xff).wrapping_add(delta(g2r, green))) & 0xff;
        let blue = ((*p & 0xff)
            .wrapping_add(delta(g2b, green))
            .wrapping_add(delta(r2b, red)))
            & 0xff;
        *p = (*p & 0xff00_ff00) | (red << 16) | blue;
    }
}

/// Undoes colour indexing: each coded pixel's green holds 1 << `wb` palette indices.
pub(super) fn unindex(
    px: &[u32],
    xsize: usize,
    w: usize,
    h: usize,
    wb: u32,
    table: &[u32],
) -> Vec<u32> {
    let per = 1usize << wb;
    let bits = 8 >> wb;
    let mask = (1u32 << bits) - 1;
    let mut out = vec![0u32; w * h];
    for y in 0..h {
        for x in 0..w {
            let g = (px[y * xsize + x / per] >> 8) & 0xff;
            let idx = (g >> ((x % per) * bits)) & mask;
            out[y * w + x] = table.get(idx as usize).copied().unwrap_or(0);
        }
    }
    out
}
