//! The entropy-coded data of a JPEG scan (ITU T.81 Annex F and G, Huffman coding):
//! the Huffman tables in their decoding form, the bit reader (byte stuffing, restart
//! markers), and one block's coefficients as each kind of scan codes them: sequential,
//! progressive DC (first and refinement) and progressive AC (first and refinement).

use super::{Scan, ZIGZAG};

/// A Huffman table in T.81's decoding form (Annex F.2.2.3).
#[derive(Clone)]
pub(super) struct Huffman {
    /// For each code length l in 1..=16: the largest code of that length (-1: none) and
    /// the index in `values` of its first code minus that code.
    maxcode: [i32; 18],
    valptr: [i32; 17],
    values: Vec<u8>,
}

impl Huffman {
    pub(super) fn new(counts: &[u8], values: &[u8]) -> Result<Huffman, String> {
        let mut h = Huffman {
            maxcode: [-1; 18],
            valptr: [0; 17],
            values: values.to_vec(),
        };
        let (mut code, mut k) = (0i32, 0i32);
        for l in 1..=16 {
            let n = i32::from(counts[l - 1]);
            h.valptr[l] = k - code;
            if n > 0 {
                code += n;
                k += n;
                h.maxcode[l] = code - 1;
            }
            if code > (1 << l) {
                return Err("JPEG Huffman table with more codes than its lengths allow".into());
            }
            code <<= 1;
        }
        h.maxcode[17] = i32::MAX;
        Ok(h)
    }
}

/// Entropy-coded bits: 0xFF 0x00 is a stuffed 0xFF; at a marker the data ends and zeros
/// follow (libjpeg's behaviour on a truncated scan).
pub(super) struct Bits<'a> {
    data: &'a [u8],
    at: usize,
    acc: u64,
    n: u32,
}

impl<'a> Bits<'a> {
    pub(super) fn new(data: &'a [u8], at: usize) -> Bits<'a> {
        Bits {
            data,
            at,
            acc: 0,
            n: 0,
        }
    }

    fn fill(&mut self) {
        while self.n <= 56 {
            let mut byte = 0u8;
            if let Some(&b) = self.data.get(self.at) {
                if b != 0xff {
                    byte = b;
                    self.at += 1;
                } else if self.data.get(self.at + 1) == Some(&0) {
                    byte = 0xff;
                    self.at += 2;
                }
            }
            self.acc |= u64::from(byte) << (56 - self.n);
            self.n += 8;
        }
    }

    pub(super) fn bits(&mut self, n: u32) -> i32 {
        if n == 0 {
            return 0;
        }
        if self.n < n {
            self.fill();
        }
        let v = (self.acc >> (64 - n)) as i32;
        self.acc <<= n;
        self.n -= n;
        v
    }

    pub(super) fn bit(&mut self) -> bool {
        self.bits(1) == 1
    }

    /// `n` bits as a signed value (T.81's EXTEND).
    pub(super) fn receive(&mut self, n: u32) -> i32 {
        let v = self.bits(n);
        if n > 0 && v < 1 << (n - 1) {
            v - (1 << n) + 1
        } else {
            v
        }
    }

    pub(super) fn decode(&mut self, t: &Huffman) -> Result<u8, String> {
        let mut code = 0i32;
        for l in 1..=16 {
            code = (code << 1) | self.bits(1);
            if code <= t.maxcode[l] {
                let i = (t.valptr[l] + code) as usize;
                return t
                    .values
                    .get(i)
                    .copied()
                    .ok_or_else(|| "JPEG Huffman code past its table".to_string());
            }
        }
        Err("JPEG Huffman code not in its table (corrupt scan)".into())
    }

    /// Drops the bits left and steps over the restart marker next (RSTn).
    pub(super) fn restart(&mut self) -> Result<(), String> {
        self.acc = 0;
        self.n = 0;
        while self.data.get(self.at) == Some(&0xff) && self.data.get(self.at + 1) == Some(&0xff) {
            self.at += 1;
        }
        match self.data.get(self.at..self.at + 2) {
            Some([0xff, m]) if (0xd0..=0xd7).contains(m) => {
                self.at += 2;
                Ok(())
            }
            _ => Err("JPEG restart marker missing where the restart interval puts one".into()),
        }
    }

    /// The offset of the marker that ends the scan.
    pub(super) fn end(&self) -> usize {
        let mut at = self.at;
        while at + 1 < self.data.len() {
            if self.data[at] == 0xff && !matches!(self.data[at + 1], 0x00 | 0xd0..=0xd7) {
                return at;
            }
            at += 1;
        }
        self.data.len()
    }
}

pub(super) fn sequential(
    bits: &mut Bits,
    blk: &mut [i32],
    pred: &mut i32,
    dc: &Huffman,
    ac: &Huffman,
) -> Result<(), String> {
    let t = u32::from(bits.decode(dc)?);
    *pred += bits.receive(t);
    blk[0] = *pred;
    let mut k = 1;
    while k < 64 {
        let rs = bits.decode(ac)?;
        let (r, s) = (usize::from(rs >> 4), u32::from(rs & 15));
        if s == 0 {
            if r != 15 {
                break;
            }
            k += 16;
            continue;
        }
        k += r;
        let Some(&z) = ZIGZAG.get(k) else {
            return Err("JPEG block with a coefficient past the 64th".into());
        };
        blk[z] = bits.receive(s);
        k += 1;
    }
    Ok(())
}

pub(super) fn dc_progressive(
    bits: &mut Bits,
    blk: &mut [i32],
    pred: &mut i32,
    dc: Option<&Huffman>,
    scan: &Scan,
) -> Result<(), String> {
    match dc {
        Some(dc) => {
            let t = u32::from(bits.decode(dc)?);
            *pred += bits.receive(t);
            blk[0] = *pred * (1 << scan.al);
        }
        None => {
            if bits.bit() {
                blk[0] |= 1 << scan.al;
            }
        }
    }
    Ok(())
}

pub(super) fn ac_first(
    bits: &mut Bits,
    blk: &mut [i32],
    eobrun: &mut u32,
    ac: &Huffman,
    scan: &Scan,
) -> Result<(), String> {
    if *eobrun > 0 {
        *eobrun -= 1;
        return Ok(());
    }
    let mut k = scan.ss;
    while k <= scan.se {
        let rs = bits.decode(ac)?;
        let (r, s) = (u32::from(rs >> 4), u32::from(rs & 15));
        if s == 0 {
            if r < 15 {
                *eobrun = (1 << r) - 1 + bits.bits(r) as u32;
                break;
            }
            k += 16;
            continue;
        }
        k += r as usize;
        let Some(&z) = ZIGZAG.get(k) else {
            return Err("JPEG block with a coefficient past the 64th".into());
        };
        blk[z] = bits.receive(s) * (1 << scan.al);
        k += 1;
    }
    Ok(())
}

/// A refinement scan of AC coefficients (T.81 G.1.2.3): one more bit of each coefficient
/// already non-zero, and new coefficients of magnitude 1 << al placed among the zero ones.
pub(super) fn ac_refine(
    bits: &mut Bits,
    blk: &mut [i32],
    eobrun: &mut u32,
    ac: &Huffman,
    scan: &Scan,
) -> Result<(), String> {
    let (p1, m1) = (1i32 << scan.al, -1i32 << scan.al);
    let refine = |bits: &mut Bits, c: &mut i32| {
        if bits.bit() && *c & p1 == 0 {
            *c += if *c >= 0 { p1 } else { m1 };
        }
    };
    let mut k = scan.ss;
    if *eobrun == 0 {
        while k <= scan.se {
            let rs = bits.decode(ac)?;
            let (mut r, s) = (i32::from(rs >> 4), rs & 15);
            let mut value = 0;
            if s != 0 {
                value = if bits.bit() { p1 } else { m1 };
            } else if r != 15 {
                *eobrun = (1 << r) + bits.bits(r as u32) as u32;
                break;
            }
            while k <= scan.se {
                let c = &mut blk[ZIGZAG[k]];
                if *c != 0 {
                    refine(bits, c);
                } else {
                    r -= 1;
                    if r < 0 {
                        break;
                    }
                }
                k += 1;
            }
            if value != 0 {
                let Some(&z) = ZIGZAG.get(k) else {
                    return Err("JPEG block with a coefficient past the 64th".into());
                };
                blk[z] = value;
            }
            k += 1;
        }
    }
    if *eobrun > 0 {
        while k <= scan.se {
            let c = &mut blk[ZIGZAG[k]];
            if *c != 0 {
                refine(bits, c);
            }
            k += 1;
        }
        *eobrun -= 1;
    }
    Ok(())
}
