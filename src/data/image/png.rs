//! PNG to RGB, as Pillow's `Image.open(path).convert("RGB")` gives it (the PNG spec, 2nd
//! edition, for the format; Pillow 13 for the conversions):
//!
//! - every colour type and bit depth, palette images through their `PLTE`, Adam7
//!   interlacing, the five scanline filters;
//! - alpha (colour types 4 and 6) and `tRNS` are dropped, not composited, as `convert("RGB")`
//!   drops them; `gAMA`, `iCCP` and the other ancillary chunks are ignored, as Pillow's
//!   pixels ignore them;
//! - 16-bit RGB(A) and grey+alpha keep each sample's high byte (Pillow's `;16B` raw modes),
//!   16-bit grey is clipped to 255 (Pillow opens it as `I;16`, whose `RGB` conversion
//!   clips), 1/2/4-bit grey is scaled to 0..=255 (x 255, 85, 17);
//! - palette indices past the `PLTE` entries are black.

use super::Rgb8;

/// Adam7's passes: (x start, y start, x step, y step).
const ADAM7: [(usize, usize, usize, usize); 7] = [
    (0, 0, 8, 8),
    (4, 0, 8, 8),
    (0, 4, 4, 8),
    (2, 0, 4, 4),
    (0, 2, 2, 4),
    (1, 0, 2, 2),
    (0, 1, 1, 2),
];

struct Header {
    width: usize,
    height: usize,
    depth: u8,
    colour: u8,
    interlaced: bool,
}

impl Header {
    fn channels(&self) -> usize {
        match self.colour {
            0 | 3 => 1,
            4 => 2,
            2 => 3,
            _ => 4,
        }
    }

    /// Bytes of one scanline of `w` pixels, without its filter byte.
    fn stride(&self, w: usize) -> usize {
        (w * self.channels() * self.depth as usize).div_ceil(8)
    }

    /// Bytes per complete pixel, at least one (the filters' left neighbour distance).
    fn bpp(&self) -> usize {
        (self.channels() * self.depth as usize).div_ceil(8)
    }

    /// (pass, width, height) of each non-empty pass, or the whole image.
    fn passes(&self) -> Vec<(usize, usize, usize)> {
        if !self.interlaced {
            return vec![(usize::MAX, self.width, self.height)];
        }
        ADAM7
            .iter()
            .enumerate()
            .map(|(i, &(x0, y0, dx, dy))| {
                let w = (self.width + dx - 1 - x0) / dx;
                let h = (self.height + dy - 1 - y0) / dy;
                (i, w, h)
            })
            .filter(|&(_, w, h)| w > 0 && h > 0)
            .collect()
    }
}

/// The RGB pixels of the PNG file `b`; the error says what was expected.
pub(super) fn decode(b: &[u8]) -> Result<Rgb8, String> {
    let mut at = 8;
    let mut header = None;
    let mut palette: &[u8] = &[];
    let mut idat = Vec::new();
    loop {
        let Some(head) = b.get(at..at + 8) else {
            return Err("PNG ends before its IEND chunk".into());
        };
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let kind = &head[4..8];
        let Some(data) = b.get(at + 8..at + 8 + len) else {
            return Err(format!(
                "PNG chunk `{}` cut short",
                String::from_utf8_lossy(kind)
            ));
        };
        match kind {
            b"IHDR" => header = Some(ihdr(data)?),
            b"PLTE" => palette = data,
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        at += 12 + len;
    }
    let h = header.ok_or("PNG without an IHDR chunk")?;
    if h.colour == 3 && palette.is_empty() {
        return Err("palette PNG without a PLTE chunk".into());
    }
    let raw_len: usize = h
        .passes()
        .iter()
        .map(|&(_, w, ht)| ht * (1 + h.stride(w)))
        .sum();
    let raw = miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(&idat, raw_len)
        .map_err(|e| format!("PNG image data (zlib): {:?}", e.status))?;
    if raw.len() < raw_len {
        return Err(format!(
            "PNG image data of {} bytes, expected {raw_len} for {}x{} pixels",
            raw.len(),
            h.width,
            h.height
        ));
    }
    let mut out = Rgb8 {
        width: h.width as u32,
        height: h.height as u32,
        data: vec![0; h.width * h.height * 3],
    };
    let mut at = 0;
    for (pass, w, ht) in h.passes() {
        let stride = h.stride(w);
        let lines = unfilter(&raw[at..at + ht * (1 + stride)], stride, h.bpp())?;
        at += ht * (1 + stride);
        for (y, line) in lines.chunks_exact(stride).enumerate() {
            for x in 0..w {
                let (ox, oy) = match ADAM7.get(pass) {
                    Some(&(x0, y0, dx, dy)) => (x0 + x * dx, y0 + y * dy),
                    None => (x, y),
                };
                let o = (oy * h.width + ox) * 3;
                out.data[o..o + 3].copy_from_slice(&rgb(&h, line, x, palette));
            }
        }
    }
    Ok(out)
}

fn ihdr(d: &[u8]) -> Result<Header, String> {
    if d.len() < 13 {
        return Err("PNG IHDR chunk cut short".into());
    }
    let be = |i: usize| u32::from_be_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]) as usize;
    let h = Header {
        width: be(0),
        height: be(4),
        depth: d[8],
        colour: d[9],
        interlaced: d[12] == 1,
    };
    let ok = match h.colour {
        0 => matches!(h.depth, 1 | 2 | 4 | 8 | 16),
        3 => matches!(h.depth, 1 | 2 | 4 | 8),
        2 | 4 | 6 => matches!(h.depth, 8 | 16),
        _ => false,
    };
    if !ok {
        return Err(format!(
            "PNG of colour type {} and bit depth {} (not in the PNG spec)",
            h.colour, h.depth
        ));
    }
    if d[10] != 0 || d[11] != 0 || d[12] > 1 {
        return Err(format!(
            "PNG with compression {}, filter {}, interlace {} (expected 0, 0, 0 or 1)",
            d[10], d[11], d[12]
        ));
    }
    super::check_area(h.width as u64, h.height as u64)?;
    Ok(h)
}

/// The scanlines of `data` (each a filter type byte, then `stride` bytes) unfiltered,
/// concatenated.
fn unfilter(data: &[u8], stride: usize, bpp: usize) -> Result<Vec<u8>, String> {
    let rows = data.len() / (stride + 1);
    let mut out = vec![0u8; rows * stride];
    for y in 0..rows {
        let filter = data[y * (stride + 1)];
        let src = &data[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        let (done, rest) = out.split_at_mut(y * stride);
        let prev = if y > 0 {
            &done[(y - 1) * stride..]
        } else {
            &[][..]
        };
        let cur = &mut rest[..stride];
        let up = |i: usize| prev.get(i).copied().unwrap_or(0);
        for i in 0..stride {
            let a = if i >= bpp { cur[i - bpp] } else { 0 };
            let b = up(i);
            let c = if i >= bpp { up(i - bpp) } else { 0 };
            let pred = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((a as u16 + b as u16) / 2) as u8,
                4 => paeth(a, b, c),
                f => {
                    return Err(format!(
                        "PNG scanline {y} of filter type {f} (expected 0-4)"
                    ));
                }
            };
            cur[i] = src[i].wrapping_add(pred);
        }
    }
    Ok(out)
}

fn paeth(a: u8, b: u8, c: u8) -> u8 {
    let p = a as i16 + b as i16 - c as i16;
    let (pa, pb, pc) = (
        (p - a as i16).abs(),
        (p - b as i16).abs(),
        (p - c as i16).abs(),
    );
    if pa <= pb && pa <= pc {
        a
    } else if pb <= pc {
        b
    } else {
        c
    }
}

/// Pixel `x` of an unfiltered scanline as Pillow's `convert("RGB")` gives it.
fn rgb(h: &Header, line: &[u8], x: usize, palette: &[u8]) -> [u8; 3] {
    let ch = h.channels();
    // Sample `c` of pixel `x`: sub-byte samples scaled up, 16-bit ones as the high byte
    // (or clipped, for 16-bit grey).
    let sample = |c: usize| -> u8 {
        match h.depth {
            8 => line[x * ch + c],
            16 => line[(x * ch + c) * 2],
            d => {
                let bit = x * d as usize;
                let v = (line[bit / 8] >> (8 - d as usize - bit % 8)) & ((1 << d) - 1);
                if h.colour == 3 {
                    v
                } else {
                    v * (255 / ((1u8 << d) - 1))
                }
            }
        }
    };
    match h.colour {
        0 if h.depth == 16 => {
            let v = u16::from_be_bytes([line[x * 2], line[x * 2 + 1]]);
            [v.min(255) as u8; 3]
        }
        0 | 4 => [sample(0); 3],
        3 => {
            let i = sample(0) as usize * 3;
            match palette.get(i..i + 3) {
                Some(p) => [p[0], p[1], p[2]],
                None => [0; 3],
            }
        }
        _ => [sample(0), sample(1), sample(2)],
    }
}
