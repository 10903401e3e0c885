//! The boolean entropy decoder of RFC 6386 section 7: each bool is read with a probability
//! (of a zero, out of 256) that splits the current range. The spec keeps a 2-byte window;
//! here the window is up to 7 bytes wide so that bytes are loaded a few at a time, which
//! reads the same bools.
//!
//! Past the end of its data the decoder shifts in zeros and raises `eof`, as libwebp's does
//! (at the same point: when a bool needs a byte that is not there); the frame decoder checks
//! it after each macroblock and fails, as libwebp fails such a file.

pub(super) struct BoolDecoder<'a> {
    data: &'a [u8],
    pos: usize,
    /// The unread bits: the top `bits + 8` bits of `value` are the spec's window, compared
    /// with the split at bit `bits`.
    value: u64,
    /// The spec's `range`, 128..=255 between bools.
    range: u32,
    bits: i32,
    pub(super) eof: bool,
}

impl<'a> BoolDecoder<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
        let mut d = BoolDecoder {
            data,
            pos: 0,
            value: 0,
            range: 255,
            bits: -8,
            eof: false,
        };
        d.load();
        d
    }

    /// More bytes into `value`: seven at once where there are, else one, else a zero byte
    /// (and `eof`).
    fn load(&mut self) {
        if let Some(b) = self.data.get(self.pos..self.pos + 7) {
            for &byte in b {
                self.value = (self.value << 8) | u64::from(byte);
            }
            self.pos += 7;
            self.bits += 56;
        } else {
            self.value <<= 8;
            if let Some(&byte) = self.data.get(self.pos) {
                self.value |= u64::from(byte);
                self.pos += 1;
            } else {
                self.eof = true;
            }
            self.bits += 8;
        }
    }

    /// One bool whose probability of being zero is `prob` / 256.
    #[inline]
    pub(super) fn bool(&mut self, prob: u8) -> bool {
        if self.bits < 0 {
            self.load();
        }
        let split = 1 + (((self.range - 1) * u32::from(prob)) >> 8);
        let big_split = u64::from(split) << self.bits;
        let bit = self.value >= big_split;
        if bit {
            self.range -= split;
            self.value -= big_split;
        } else {
            self.range = split;
        }
        // Renormalise: shift until the range is at least 128 again.
        let shift = self.range.leading_zeros() - 24;
        self.range <<= shift;
        self.bits -= shift as i32;
        bit
    }

    /// A flag: a bool at even odds.
    pub(super) fn flag(&mut self) -> bool {
        self.bool(128)
    }

    /// An `n`-bit unsigned literal, most significant bit first.
    pub(super) fn literal(&mut self, n: u32) -> u32 {
        (0..n).fold(0, |v, _| (v << 1) | u32::from(self.flag()))
    }

    /// An `n`-bit magnitude followed by its sign.
    pub(super) fn signed(&mut self, n: u32) -> i32 {
        let v = self.literal(n) as i32;
        if self.flag() { -v } else { v }
    }

    /// A flag, then (if set) an `n`-bit signed value; 0 when the flag is clear.
    pub(super) fn optional_signed(&mut self, n: u32) -> i32 {
        if self.flag() { self.signed(n) } else { 0 }
    }

    /// A value read with a coding tree (section 8.1): `tree[i]` and `tree[i + 1]` are the
    /// branches of node `i` (a positive index, or a leaf as minus its value), read with
    /// `probs[i / 2]`.
    pub(super) fn tree(&mut self, tree: &[i8], probs: &[u8]) -> u8 {
        let mut i = 0;
        loop {
            let next = tree[i + usize::from(self.bool(probs[i / 2]))];
            if next <= 0 {
                return (-next) as u8;
            }
            i = next as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's boolean encoder (section 7.3), to round-trip through the decoder.
    fn encode(bools: &[(bool, u8)]) -> Vec<u8> {
        let (mut out, mut range, mut bottom, mut bit_count) = (Vec::new(), 255u32, 0u32, 24i32);
        // One bit of `bottom` shifted out: a carry into the bytes written, a byte written
        // once 8 bits are out.
        let shift = |out: &mut Vec<u8>, bottom: &mut u32, bit_count: &mut i32| {
            if *bottom & (1 << 31) != 0 {
                for b in out.iter_mut().rev() {
                    if *b == 255 {
                        *b = 0;
                    } else {
                        *b += 1;
                        break;
                    }
                }
            }
            *bottom <<= 1;
            *bit_count -= 1;
            if *bit_count == 0 {
                out.push((*bottom >> 24) as u8);
                *bottom &= (1 << 24) - 1;
                *bit_count = 8;
            }
        };
        for &(value, prob) in bools {
            let split = 1 + (((range - 1) * u32::from(prob)) >> 8);
            if value {
                bottom = bottom.wrapping_add(split);
                range -= split;
            } else {
                range = split;
            }
            while range < 128 {
                range <<= 1;
                shift(&mut out, &mut bottom, &mut bit_count);
            }
        }
        for _ in 0..32 {
            shift(&mut out, &mut bottom, &mut bit_count);
        }
        out
    }

    #[test]
    fn reads_what_the_spec_encoder_wrote() {
        let mut seed = 7u32;
        let bools: Vec<(bool, u8)> = (0..5000)
            .map(|_| {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let prob = (seed >> 16) as u8 | 1;
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                ((seed >> 16) as u8 >= prob, prob)
            })
            .collect();
        let bytes = encode(&bools);
        let mut d = BoolDecoder::new(&bytes);
        for (i, &(value, prob)) in bools.iter().enumerate() {
            assert_eq!(d.bool(prob), value, "bool {i}");
        }
        assert!(!d.eof);
        // Reading on past the end raises `eof` and does not panic.
        for _ in 0..200 {
            d.bool(100);
        }
        assert!(d.eof);
    }
}
