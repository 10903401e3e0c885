//! WebP to RGB: lossless (VP8L) images decoded, written from the WebP lossless bitstream
//! specification (RFC 9649), and lossy (VP8) ones (the `vp8` module); animated images are
//! refused by name. Alpha is dropped, as Pillow's `convert("RGB")` drops it: the RGB of an
//! image with alpha does not depend on its alpha (a VP8L image's alpha is one channel of its
//! pixels; a VP8 image's is an `ALPH` chunk beside it, not read). Both decoders give
//! libwebp's pixels to the byte.
//!
//! A VP8L stream: the header (size, alpha hint, version), the transforms (predictor,
//! colour, subtract-green, colour-indexing; each at most once, undone in reverse order),
//! then the ARGB image, entropy-coded: prefix codes (canonical Huffman, read LSB first) for
//! green + length + cache symbols, red, blue, alpha and distance, optionally chosen per
//! tile by an entropy image, LZ77 backward references and a colour cache.

mod transform;
mod vp8;

use super::Rgb8;
use transform::{add_argb, colour, predict, unindex};

/// The first 120 distance codes as (dx, dy) offsets to the pixel copied from.
#[rustfmt::skip]
const DISTANCE_MAP: [(i8, i8); 120] = [
    (0, 1), (1, 0), (1, 1), (-1, 1), (0, 2), (2, 0), (1, 2), (-1, 2), (2, 1), (-2, 1), (2, 2),
    (-2, 2), (0, 3), (3, 0), (1, 3), (-1, 3), (3, 1), (-3, 1), (2, 3), (-2, 3), (3, 2), (-3, 2),
    (0, 4), (4, 0), (1, 4), (-1, 4), (4, 1), (-4, 1), (3, 3), (-3, 3), (2, 4), (-2, 4), (4, 2),
    (-4, 2), (0, 5), (3, 4), (-3, 4), (4, 3), (-4, 3), (5, 0), (1, 5), (-1, 5), (5, 1), (-5, 1),
    (2, 5), (-2, 5), (5, 2), (-5, 2), (4, 4), (-4, 4), (3, 5), (-3, 5), (5, 3), (-5, 3), (0, 6),
    (6, 0), (1, 6), (-1, 6), (6, 1), (-6, 1), (2, 6), (-2, 6), (6, 2), (-6, 2), (4, 5), (-4, 5),
    (5, 4), (-5, 4), (3, 6), (-3, 6), (6, 3), (-6, 3), (0, 7), (7, 0), (1, 7), (-1, 7), (5, 5),
    (-5, 5), (7, 1), (-7, 1), (4, 6), (-4, 6), (6, 4), (-6, 4), (2, 7), (-2, 7), (7, 2),
    (-7, 2), (3, 7), (-3, 7), (7, 3), (-7, 3), (5, 6), (-5, 6), (6, 5), (-6, 5), (8, 0), (4, 7),
    (-4, 7), (7, 4), (-7, 4), (8, 1), (8, 2), (6, 6), (-6, 6), (8, 3), (5, 7), (-5, 7), (7, 5),
    (-7, 5), (8, 4), (6, 7), (-6, 7), (7, 6), (-7, 6), (8, 5), (7, 7), (-7, 7), (8, 6), (8, 7),
];

/// The order in which code length code lengths are stored.
const CODE_LENGTH_ORDER: [usize; 19] = [
    17, 18, 0, 1, 2, 3, 4, 5, 16, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
];

/// The RGB pixels of the WebP file `b` (RIFF container): its first `VP8L` or `VP8 ` chunk,
/// whose size must be the canvas's where a `VP8X` chunk gives one (as libwebp checks).
pub(super) fn decode(b: &[u8]) -> Result<Rgb8, String> {
    let mut canvas = None;
    for chunk in chunks(b) {
        let (kind, data) = chunk?;
        let image = match kind {
            b"VP8L" => vp8l(data)?,
            b"VP8 " => vp8::decode(data)?,
            b"ANMF" => return Err("animated WebP is not decoded: expected a still image".into()),
            b"VP8X" => {
                let le24 = |i: usize| {
                    let s = data.get(i..i + 3)?;
                    Some(u32::from_le_bytes([s[0], s[1], s[2], 0]) + 1)
                };
                canvas = le24(4).zip(le24(7));
                continue;
            }
            _ => continue,
        };
        if let Some((w, h)) = canvas.filter(|&c| c != (image.width, image.height)) {
            return Err(format!(
                "WebP image of {}x{} pixels on a canvas of {w}x{h} (expected the same size)",
                image.width, image.height
            ));
        }
        return Ok(image);
    }
    Err("WebP without an image chunk (VP8L or VP8)".into())
}

/// The chunks after the RIFF header of the WebP file `b`: each one's kind and data (padded
/// to an even length); an error, last, where one is cut short.
fn chunks(b: &[u8]) -> impl Iterator<Item = Result<(&[u8], &[u8]), String>> {
    let mut at = Some(12);
    std::iter::from_fn(move || {
        let head = b.get(at?..at? + 8)?;
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let Some(data) = b.get(at? + 8..at? + 8 + len) else {
            at = None;
            return Some(Err("WebP chunk cut short".into()));
        };
        at = at.map(|a| a + 8 + len + (len & 1));
        Some(Ok((&head[..4], data)))
    })
}

/// [`vp8::describe`] of the first `VP8 ` chunk of the WebP file `b`.
#[cfg(test)]
pub(super) fn describe_lossy(b: &[u8]) -> Result<String, String> {
    for chunk in chunks(b) {
        if let (b"VP8 ", data) = chunk? {
            return vp8::describe(data);
        }
    }
    Err("WebP without a VP8 chunk".into())
}

/// Bits read least significant first.
struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Bits<'_> {
    fn read(&mut self, n: u32) -> Result<u32, String> {
        let mut v = 0u32;
        for i in 0..n {
            let byte = *self
                .data
                .get(self.pos / 8)
                .ok_or("WebP (VP8L) data cut short")?;
            v |= u32::from((byte >> (self.pos % 8)) & 1) << i;
            self.pos += 1;
        }
        Ok(v)
    }
}

/// A canonical prefix code: symbols sorted by (length, symbol), and the count per length;
/// a code of one symbol reads no bits.
struct Code {
    counts: [u16; 16],
    sorted: Vec<u16>,
    single: Option<u16>,
}

impl Code {
    fn from_lengths(lengths: &[u8]) -> Result<Code, String> {
        let mut counts = [0u16; 16];
        for &l in lengths {
            counts[l as usize] += 1;
        }
        counts[0] = 0;
        let used: Vec<u16> = (0..lengths.len() as u16)
            .filter(|&s| lengths[s as usize] > 0)
            .collect();
        if used.len() == 1 {
            return Ok(Code {
                counts,
                sorted: used.clone(),
                single: Some(used[0]),
            });
        }
        let mut sorted = used;
        sorted.sort_by_key(|&s| (lengths[s as usize], s));
        // A complete code: the lengths' Kraft sum is exactly one.
        let kraft: u64 = (1..16).map(|l| u64::from(counts[l]) << (15 - l)).sum();
        if sorted.is_empty() || kraft != 1 << 15 {
            return Err("WebP (VP8L) prefix code that is not complete".into());
        }
        Ok(Code {
            counts,
            sorted,
            single: None,
        })
    }

    fn read(&self, bits: &mut Bits) -> Result<u16, String> {
        if let Some(s) = self.single {
            return Ok(s);
        }
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= bits.read(1)? as i32;
            let count = i32::from(self.counts[len]);
            if code - first < count {
                return Ok(self.sorted[(index + code - first) as usize]);
            }
            index += count;
            first = (first + count) << 1;
            code <<= 1;
        }
        Err("WebP (VP8L) prefix code past its table".into())
    }
}

fn read_code(bits: &mut Bits, alphabet: usize) -> Result<Code, String> {
    let mut lengths = vec![0u8; alphabet];
    if bits.read(1)? == 1 {
        // A simple code: one or two symbols.
        let two = bits.read(1)? == 1;
        let first_bits = if bits.read(1)? == 1 { 8 } else { 1 };
        let s0 = bits.read(first_bits)? as usize;
        let mut symbols = vec![s0];
        if two {
            symbols.push(bits.read(8)? as usize);
        }
        for &s in &symbols {
            *lengths
                .get_mut(s)
                .ok_or("WebP (VP8L) symbol outside its alphabet")? = symbols.len() as u8 - 1;
        }
        if !two {
            return Ok(Code {
                counts: [0; 16],
                sorted: vec![s0 as u16],
                single: Some(s0 as u16),
            });
        }
        return Code::from_lengths(&lengths);
    }
    let n = 4 + bits.read(4)? as usize;
    let mut cl_lengths = [0u8; 19];
    for &i in &CODE_LENGTH_ORDER[..n] {
        cl_lengths[i] = bits.read(3)? as u8;
    }
    let cl = Code::from_lengths(&cl_lengths)?;
    let mut max_symbol = if bits.read(1)? == 1 {
        let nbits = 2 + 2 * bits.read(3)?;
        2 + bits.read(nbits)? as usize
    } else {
        alphabet
    };
    let (mut symbol, mut prev) = (0, 8u8);
    while symbol < alphabet {
        if max_symbol == 0 {
            break;
        }
        max_symbol -= 1;
        let c = cl.read(bits)?;
        if c < 16 {
            lengths[symbol] = c as u8;
            symbol += 1;
            if c != 0 {
                prev = c as u8;
            }
            continue;
        }
        let (extra, base, value) = match c {
            16 => (2, 3, prev),
            17 => (3, 3, 0),
            _ => (7, 11, 0),
        };
        let repeat = base + bits.read(extra)? as usize;
        if symbol + repeat > alphabet {
            return Err("WebP (VP8L) code lengths past the alphabet".into());
        }
        lengths[symbol..symbol + repeat].fill(value);
        symbol += repeat;
    }
    Code::from_lengths(&lengths)
}

/// An LZ77 length or distance from its prefix symbol and extra bits.
fn prefix_value(bits: &mut Bits, prefix: u32) -> Result<usize, String> {
    if prefix < 4 {
        return Ok(prefix as usize + 1);
    }
    let extra = (prefix - 2) >> 1;
    let offset = (2 + (prefix & 1)) << extra;
    Ok((offset + bits.read(extra)?) as usize + 1)
}

/// An entropy-coded ARGB image of `w` x `h` pixels; the main image (`top`) may pick its
/// prefix codes per tile from an entropy image.
fn image(bits: &mut Bits, w: usize, h: usize, top: bool) -> Result<Vec<u32>, String> {
    let cache_bits = if bits.read(1)? == 1 {
        let b = bits.read(4)?;
        if !(1..=11).contains(&b) {
            return Err(format!(
                "WebP (VP8L) colour cache of {b} bits (expected 1-11)"
            ));
        }
        b
    } else {
        0
    };
    let cache_size = if cache_bits > 0 {
        1usize << cache_bits
    } else {
        0
    };
    let (tile_bits, tiles) = if top && bits.read(1)? == 1 {
        let tb = bits.read(3)? + 2;
        let (tw, th) = (w.div_ceil(1 << tb), h.div_ceil(1 << tb));
        (tb, Some((tw, image(bits, tw, th, false)?)))
    } else {
        (0, None)
    };
    let groups = tiles.as_ref().map_or(1, |(_, t)| {
        t.iter()
            .map(|&p| ((p >> 8) & 0xffff) as usize)
            .max()
            .unwrap_or(0)
            + 1
    });
    let mut codes = Vec::with_capacity(groups);
    for _ in 0..groups {
        codes.push([
            read_code(bits, 256 + 24 + cache_size)?,
            read_code(bits, 256)?,
            read_code(bits, 256)?,
            read_code(bits, 256)?,
            read_code(bits, 40)?,
        ]);
    }
    let mut out = vec![0u32; w * h];
    let mut cache = vec![0u32; cache_size];
    let to_cache = |cache: &mut Vec<u32>, argb: u32| {
        if cache_bits > 0 {
            cache[(0x1e35_a7bd_u32.wrapping_mul(argb) >> (32 - cache_bits)) as usize] = argb;
        }
    };
    let mut pos = 0;
    while pos < w * h {
        let group = match &tiles {
            Some((tw, t)) => {
                let (x, y) = (pos % w, pos / w);
                ((t[(y >> tile_bits) * tw + (x >> tile_bits)] >> 8) & 0xffff) as usize
            }
            None => 0,
        };
        let c = &codes[group];
        let s = c[0].read(bits)? as usize;
        if s < 256 {
            let r = c[1].read(bits)? as u32;
            let b = c[2].read(bits)? as u32;
            let a = c[3].read(bits)? as u32;
            let argb = (a << 24) | (r << 16) | ((s as u32) << 8) | b;
            out[pos] = argb;
            to_cache(&mut cache, argb);
            pos += 1;
        } else if s < 256 + 24 {
            let len = prefix_value(bits, (s - 256) as u32)?;
            let dist_symbol = u32::from(c[4].read(bits)?);
            let code = prefix_value(bits, dist_symbol)?;
            let dist = if code > 120 {
                code - 120
            } else {
                let (dx, dy) = DISTANCE_MAP[code - 1];
                (isize::from(dx) + isize::from(dy) * w as isize).max(1) as usize
            };
            if dist > pos || pos + len > w * h {
                return Err("WebP (VP8L) backward reference outside the image".into());
            }
            for _ in 0..len {
                out[pos] = out[pos - dist];
                to_cache(&mut cache, out[pos]);
                pos += 1;
            }
        } else {
            let argb = *cache
                .get(s - 280)
                .ok_or("WebP (VP8L) colour cache index past the cache")?;
            out[pos] = argb;
            pos += 1;
        }
    }
    Ok(out)
}

enum Transform {
    Predictor(u32, Vec<u32>),
    Colour(u32, Vec<u32>),
    SubtractGreen,
    Index(u32, Vec<u32>),
}

fn vp8l(data: &[u8]) -> Result<Rgb8, String> {
    if data.first() != Some(&0x2f) {
        return Err("WebP (VP8L) without its signature byte".into());
    }
    let mut bits = Bits { data, pos: 8 };
    let width = bits.read(14)? as usize + 1;
    let height = bits.read(14)? as usize + 1;
    let _alpha_hint = bits.read(1)?;
    if bits.read(3)? != 0 {
        return Err("WebP (VP8L) of a version other than 0".into());
    }
    super::check_area(width as u64, height as u64)?;
    // The transforms, in the order read; colour indexing narrows the coded width.
    let mut transforms = Vec::new();
    let mut xsize = width;
    while bits.read(1)? == 1 {
        let kind = bits.read(2)?;
        let t = match kind {
            0 | 1 => {
                let tb = bits.read(3)? + 2;
                let sub = image(
                    &mut bits,
                    xsize.div_ceil(1 << tb),
                    height.div_ceil(1 << tb),
                    false,
                )?;
                if kind == 0 {
                    Transform::Predictor(tb, sub)
                } else {
                    Transform::Colour(tb, sub)
                }
            }
            2 => Transform::SubtractGreen,
            _ => {
                let n = bits.read(8)? as usize + 1;
                let mut table = image(&mut bits, n, 1, false)?;
                for i in 1..n {
                    table[i] = add_argb(table[i], table[i - 1]);
                }
                let wb = match n {
                    0..=2 => 3,
                    3..=4 => 2,
                    5..=16 => 1,
                    _ => 0,
                };
                xsize = xsize.div_ceil(1 << wb);
                Transform::Index(wb, table)
            }
        };
        if transforms.len() >= 4 {
            return Err("WebP (VP8L) with more than four transforms".into());
        }
        transforms.push(t);
    }
    let mut px = image(&mut bits, xsize, height, true)?;
    for t in transforms.iter().rev() {
        match t {
            Transform::Predictor(tb, sub) => predict(&mut px, xsize, height, *tb, sub),
            Transform::Colour(tb, sub) => colour(&mut px, xsize, *tb, sub),
            Transform::SubtractGreen => {
                for p in &mut px {
                    let g = (*p >> 8) & 0xff;
                    *p = add_argb(*p, (g << 16) | g);
                }
            }
            Transform::Index(wb, table) => {
                px = unindex(&px, xsize, width, height, *wb, table);
                xsize = width;
            }
        }
    }
    let mut out = Vec::with_capacity(width * height * 3);
    for p in px {
        out.extend([(p >> 16) as u8, (p >> 8) as u8, p as u8]);
    }
    Ok(Rgb8 {
        width: width as u32,
        height: height as u32,
        data: out,
    })
}
