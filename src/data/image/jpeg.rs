//! JPEG to RGB, as Pillow (libjpeg-turbo, its defaults: the accurate integer IDCT and
//! fancy upsampling) decodes it, written from ITU T.81 and libjpeg's documented
//! algorithms:
//!
//! - frames: baseline and extended sequential Huffman (SOF0, SOF1) and progressive Huffman
//!   (SOF2), 8-bit samples; one component (greyscale, replicated to RGB as `convert("RGB")`
//!   does) or three (YCbCr, or RGB where an Adobe marker says so or the ids are `R`, `G`,
//!   `B`), any sampling factors whose ratios are integers; restart intervals;
//! - refused by name: arithmetic coding, lossless and hierarchical frames, 12-bit samples,
//!   CMYK/YCCK (four components).
//!
//! All scans decode into each component's quantised coefficients; the pixels are made once
//! at the end (`pixels`): dequantise, inverse DCT, upsample, colour convert.
//!
//! Legend: an MCU is a minimum coded unit; `h`/`v` a component's sampling factors,
//! `hmax`/`vmax` the frame's largest; a block is 8x8 coefficients, stored in natural
//! (row-major) order.

mod entropy;
mod pixels;

use super::Rgb8;
use entropy::{Bits, Huffman, ac_first, ac_refine, dc_progressive, sequential};

/// The zig-zag order: `ZIGZAG[k]` is the natural index of the k-th coefficient coded.
const ZIGZAG: [usize; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

/// A component of the frame and its coefficients.
struct Component {
    id: u8,
    h: usize,
    v: usize,
    /// Quantisation table selector (`Tq`), and the table latched at its first scan.
    tq: usize,
    quant: Option<[u16; 64]>,
    /// Blocks across and down, padded to whole MCUs of the interleaved frame.
    bw: usize,
    bh: usize,
    /// Samples across and down this component codes: ceil(width x h / hmax).
    width: usize,
    height: usize,
    /// `bw` x `bh` blocks of 64 coefficients, natural order.
    coefs: Vec<i32>,
}

/// A scan's header: its components (index into the frame, DC and AC table), the spectral
/// selection and successive approximation.
struct Scan {
    comps: Vec<(usize, usize, usize)>,
    ss: usize,
    se: usize,
    ah: u32,
    al: u32,
}

struct Decoder {
    width: usize,
    height: usize,
    progressive: bool,
    comps: Vec<Component>,
    hmax: usize,
    vmax: usize,
    mcux: usize,
    mcuy: usize,
    quant: [Option<[u16; 64]>; 4],
    dc: [Option<Huffman>; 4],
    ac: [Option<Huffman>; 4],
    restart: usize,
    adobe: Option<u8>,
    jfif: bool,
}

/// The RGB pixels of the JPEG file `b`; the error says what was expected.
pub(super) fn decode(b: &[u8]) -> Result<Rgb8, String> {
    let mut d = Decoder {
        width: 0,
        height: 0,
        progressive: false,
        comps: Vec::new(),
        hmax: 1,
        vmax: 1,
        mcux: 0,
        mcuy: 0,
        quant: [None; 4],
        dc: [None, None, None, None],
        ac: [None, None, None, None],
        restart: 0,
        adobe: None,
        jfif: false,
    };
    let mut at = 2;
    loop {
        // Fill bytes (0xFF) may precede a marker.
        while b.get(at) == Some(&0xff) && b.get(at + 1) == Some(&0xff) {
            at += 1;
        }
        let Some(&[0xff, marker]) = b.get(at..at + 2) else {
            return Err(match d.comps.is_empty() {
                true => "JPEG ends before its frame header".into(),
                false => "JPEG ends before its end-of-image marker".into(),
            });
        };
        at += 2;
        if marker == 0xd9 {
            break;
        }
        if matches!(marker, 0x01 | 0xd0..=0xd7) {
            continue;
        }
        let Some(len) = b
            .get(at..at + 2)
            .map(|l| u16::from_be_bytes([l[0], l[1]]) as usize)
        else {
            return Err("JPEG segment cut short".into());
        };
        let Some(seg) = b.get(at + 2..at + len).filter(|_| len >= 2) else {
            return Err(format!("JPEG segment {marker:#04x} cut short"));
        };
        at += len;
        match marker {
            0xc0..=0xc2 => d.frame(seg, marker == 0xc2)?,
            0xc3 | 0xc5..=0xc7 | 0xcb | 0xcd..=0xcf => {
                return Err(format!(
                    "lossless or hierarchical JPEG (SOF{}) is not decoded: expected baseline or progressive",
                    marker - 0xc0
                ));
            }
            0xc9 | 0xca => {
                return Err("arithmetic-coded JPEG is not decoded: expected Huffman coding".into());
            }
            0xc4 => d.huffman_tables(seg)?,
            0xdb => d.quant_tables(seg)?,
            0xdd if seg.len() >= 2 => d.restart = u16::from_be_bytes([seg[0], seg[1]]) as usize,
            0xe0 if seg.starts_with(b"JFIF\0") => d.jfif = true,
            0xee if seg.starts_with(b"Adobe") && seg.len() >= 12 => d.adobe = Some(seg[11]),
            0xda => {
                let scan = d.scan_header(seg)?;
                at = d.scan(b, at, &scan)?;
            }
            _ => {}
        }
    }
    if d.comps.is_empty() {
        return Err("JPEG without a frame header".into());
    }
    pixels::rgb(&d)
}

impl Decoder {
    fn frame(&mut self, s: &[u8], progressive: bool) -> Result<(), String> {
        if !self.comps.is_empty() {
            return Err("JPEG with two frame headers".into());
        }
        if s.len() < 6 {
            return Err("JPEG frame header cut short".into());
        }
        if s[0] != 8 {
            return Err(format!(
                "JPEG of {}-bit samples is not decoded: expected 8",
                s[0]
            ));
        }
        self.height = u16::from_be_bytes([s[1], s[2]]) as usize;
        self.width = u16::from_be_bytes([s[3], s[4]]) as usize;
        self.progressive = progressive;
        let n = s[5] as usize;
        if self.height == 0 {
            return Err("JPEG whose height is set by a DNL marker is not decoded".into());
        }
        super::check_area(self.width as u64, self.height as u64)?;
        match n {
            1 | 3 => {}
            4 => {
                return Err(
                    "CMYK/YCCK JPEG (4 components) is not decoded: expected greyscale or YCbCr/RGB"
                        .into(),
                );
            }
            n => return Err(format!("JPEG of {n} components: expected 1 or 3")),
        }
        if s.len() < 6 + 3 * n {
            return Err("JPEG frame header cut short".into());
        }
        for c in s[6..6 + 3 * n].chunks_exact(3) {
            let (h, v) = ((c[1] >> 4) as usize, (c[1] & 15) as usize);
            if !(1..=4).contains(&h) || !(1..=4).contains(&v) || c[2] > 3 {
                return Err(format!(
                    "JPEG component {} with sampling {h}x{v}, table {} (expected 1-4, 0-3)",
                    c[0], c[2]
                ));
            }
            self.comps.push(Component {
                id: c[0],
                h,
                v,
                tq: c[2] as usize,
                quant: None,
                bw: 0,
                bh: 0,
                width: 0,
                height: 0,
                coefs: Vec::new(),
            });
        }
        self.hmax = self.comps.iter().map(|c| c.h).max().unwrap_or(1);
        self.vmax = self.comps.iter().map(|c| c.v).max().unwrap_or(1);
        self.mcux = self.width.div_ceil(8 * self.hmax);
        self.mcuy = self.height.div_ceil(8 * self.vmax);
        for c in &mut self.comps {
            if !self.hmax.is_multiple_of(c.h) || !self.vmax.is_multiple_of(c.v) {
                return Err(format!(
                    "JPEG sampling {}x{} of component {} does not divide {}x{}",
                    c.h, c.v, c.id, self.hmax, self.vmax
                ));
            }
            c.bw = self.mcux * c.h;
            c.bh = self.mcuy * c.v;
            c.width = (self.width * c.h).div_ceil(self.hmax);
            c.height = (self.height * c.v).div_ceil(self.vmax);
            c.coefs = vec![0; c.bw * c.bh * 64];
        }
        Ok(())
    }

    fn huffman_tables(&mut self, mut s: &[u8]) -> Result<(), String> {
        while !s.is_empty() {
            let (class, id) = (s[0] >> 4, (s[0] & 15) as usize);
            let counts = s.get(1..17).ok_or("JPEG Huffman table cut short")?;
            let n: usize = counts.iter().map(|&c| c as usize).sum();
            let values = s.get(17..17 + n).ok_or("JPEG Huffman table cut short")?;
            if class > 1 || id > 3 {
                return Err(format!("JPEG Huffman table of class {class}, id {id}"));
            }
            let t = Some(Huffman::new(counts, values)?);
            if class == 0 {
                self.dc[id] = t;
            } else {
                self.ac[id] = t;
            }
            s = &s[17 + n..];
        }
        Ok(())
    }

    fn quant_tables(&mut self, mut s: &[u8]) -> Result<(), String> {
        while !s.is_empty() {
            let (wide, id) = (s[0] >> 4 == 1, (s[0] & 15) as usize);
            let n = if wide { 128 } else { 64 };
            let body = s
                .get(1..1 + n)
                .filter(|_| id < 4)
                .ok_or("JPEG quantisation table cut short or of id above 3")?;
            let mut q = [0u16; 64];
            for (k, &z) in ZIGZAG.iter().enumerate() {
                q[z] = match wide {
                    true => u16::from_be_bytes([body[2 * k], body[2 * k + 1]]),
                    false => u16::from(body[k]),
                };
            }
            self.quant[id] = Some(q);
            s = &s[1 + n..];
        }
        Ok(())
    }

    fn scan_header(&mut self, s: &[u8]) -> Result<Scan, String> {
        let n = *s.first().ok_or("JPEG scan header cut short")? as usize;
        let tail = s
            .get(1 + 2 * n..4 + 2 * n)
            .ok_or("JPEG scan header cut short")?;
        let mut comps = Vec::with_capacity(n);
        for c in s[1..1 + 2 * n].chunks_exact(2) {
            let i = self
                .comps
                .iter()
                .position(|f| f.id == c[0])
                .ok_or_else(|| format!("JPEG scan of component {} not in the frame", c[0]))?;
            let comp = &mut self.comps[i];
            if comp.quant.is_none() {
                comp.quant = self.quant[comp.tq];
            }
            comps.push((i, (c[1] >> 4) as usize & 3, (c[1] & 15) as usize & 3));
        }
        let scan = Scan {
            comps,
            ss: tail[0] as usize,
            se: tail[1] as usize,
            ah: u32::from(tail[2] >> 4),
            al: u32::from(tail[2] & 15),
        };
        let ok = if self.progressive {
            scan.ss <= scan.se
                && scan.se < 64
                && (scan.ss == 0) == (scan.se == 0)
                && (scan.ss == 0 || n == 1)
                && scan.al < 14
        } else {
            scan.ss == 0 && scan.se == 63
        };
        if n == 0 || n > 4 || !ok {
            return Err(format!(
                "JPEG scan of {n} components, spectral {}..={}, approximation {}/{}: not valid for its frame",
                scan.ss, scan.se, scan.ah, scan.al
            ));
        }
        Ok(scan)
    }

    /// Decodes the scan whose entropy-coded data starts at `at`; the offset after it.
    fn scan(&mut self, b: &[u8], at: usize, scan: &Scan) -> Result<usize, String> {
        let table = |ts: &[Option<Huffman>; 4], i: usize, what: &str| {
            ts[i]
                .clone()
                .ok_or_else(|| format!("JPEG scan uses {what} Huffman table {i}, not defined"))
        };
        let needs_dc = scan.ss == 0 && scan.ah == 0;
        let needs_ac = scan.se > 0;
        let mut tables = Vec::new();
        for &(ci, td, ta) in &scan.comps {
            let dc = if needs_dc {
                Some(table(&self.dc, td, "DC")?)
            } else {
                None
            };
            let ac = if needs_ac {
                Some(table(&self.ac, ta, "AC")?)
            } else {
                None
            };
            tables.push((ci, dc, ac));
        }
        // The blocks of each MCU: (component, block x, block y) over the MCU grid, or each
        // block of the one component's coded area for a non-interleaved scan.
        let (units_x, units_y) = if scan.comps.len() == 1 {
            let c = &self.comps[scan.comps[0].0];
            (c.width.div_ceil(8), c.height.div_ceil(8))
        } else {
            (self.mcux, self.mcuy)
        };
        let mut bits = Bits::new(b, at);
        let mut preds = vec![0i32; scan.comps.len()];
        let mut eobrun = 0u32;
        let total = units_x * units_y;
        for unit in 0..total {
            if self.restart > 0 && unit > 0 && unit % self.restart == 0 {
                bits.restart()?;
                preds.iter_mut().for_each(|p| *p = 0);
                eobrun = 0;
            }
            let (ux, uy) = (unit % units_x, unit / units_x);
            for (si, (ci, dc, ac)) in tables.iter().enumerate() {
                let c = &mut self.comps[*ci];
                let (nh, nv) = if scan.comps.len() == 1 {
                    (1, 1)
                } else {
                    (c.h, c.v)
                };
                for by in 0..nv {
                    for bx in 0..nh {
                        let (x, y) = (ux * nh + bx, uy * nv + by);
                        let o = (y * c.bw + x) * 64;
                        let blk = &mut c.coefs[o..o + 64];
                        if !self.progressive {
                            let (Some(dc), Some(ac)) = (dc, ac) else {
                                unreachable!("sequential scans code both")
                            };
                            sequential(&mut bits, blk, &mut preds[si], dc, ac)?;
                        } else if scan.ss == 0 {
                            dc_progressive(&mut bits, blk, &mut preds[si], dc.as_ref(), scan)?;
                        } else if let Some(ac) = ac {
                            if scan.ah == 0 {
                                ac_first(&mut bits, blk, &mut eobrun, ac, scan)?;
                            } else {
                                ac_refine(&mut bits, blk, &mut eobrun, ac, scan)?;
                            }
                        }
                    }
                }
            }
        }
        Ok(bits.end())
    }
}
