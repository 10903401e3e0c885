//! The master weights as the trainer holds them (`memory.master_weights`): a plain fp32
//! slice, split into the bf16 store and a u16 residual ([`crate::elem::bits`]), or the bf16
//! store alone. Checkpoints and exports read and write fp32 values through these views, so
//! their on-disk format is the same either way: a bf16 master is widened exactly, and fp32
//! values written into one are rounded to nearest even (exact for values a bf16 master
//! saved; [`MasterMut::Bf16`] counts the others).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use half::bf16;
use rayon::prelude::*;

use crate::elem::bits;

/// Elements per rayon task of a copy.
const CHUNK: usize = 64 * 1024;

pub use super::pieces::PIECE;

thread_local! {
    /// Each thread's fp32 piece for a split or bf16 master, taken while in use (see
    /// [`super::pieces::with_bytes`]).
    static SPLIT: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Read access to master weights, in layout order.
#[derive(Clone, Copy)]
pub enum MasterRef<'a> {
    F32(&'a [f32]),
    Split {
        hi: &'a [bf16],
        lo: &'a [u16],
    },
    /// A bf16 master (`memory.master_weights: bfloat16`): the store itself.
    Bf16(&'a [bf16]),
}

impl<'a> MasterRef<'a> {
    pub fn len(&self) -> usize {
        match self {
            MasterRef::F32(x) => x.len(),
            MasterRef::Split { hi, .. } | MasterRef::Bf16(hi) => hi.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `r`.
    pub fn slice(&self, r: Range<usize>) -> MasterRef<'a> {
        match *self {
            MasterRef::F32(x) => MasterRef::F32(&x[r]),
            MasterRef::Split { hi, lo } => MasterRef::Split {
                hi: &hi[r.clone()],
                lo: &lo[r],
            },
            MasterRef::Bf16(x) => MasterRef::Bf16(&x[r]),
        }
    }

    /// The fp32 values: borrowed when held as such, joined or widened otherwise.
    pub fn values(&self) -> Cow<'a, [f32]> {
        match *self {
            MasterRef::F32(x) => Cow::Borrowed(x),
            MasterRef::Split { .. } | MasterRef::Bf16(_) => {
                let mut out = vec![0.0; self.len()];
                self.read_into(&mut out);
                Cow::Owned(out)
            }
        }
    }

    /// Writes the fp32 values into `out` (in parallel), with non-temporal stores where the
    /// CPU has them: `out` is a checkpoint's staging page or a window on its way to the
    /// disk, read next by the writer's direct I/O (or once more, from memory, by its
    /// bounce buffer and export), so its lines need not be read into the cache before they
    /// are overwritten (a third of a staging copy's memory traffic).
    pub fn read_into(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.len());
        match *self {
            MasterRef::F32(x) => out
                .par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(d, s)| crate::simd::copy_streaming(d, s)),
            MasterRef::Split { hi, lo } => fill_streaming(out, |i| bits::join(hi[i], lo[i])),
            MasterRef::Bf16(x) => fill_streaming(out, |i| x[i].to_f32()),
        }
    }
}

/// `out[i] = value(i)` for every element, in parallel, through a small buffer written out with
/// [`crate::simd::copy_streaming`].
fn fill_streaming(out: &mut [f32], value: impl Fn(usize) -> f32 + Sync) {
    const LINE_RUN: usize = 1024;
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let mut buf = [0.0f32; LINE_RUN];
        for (r, out) in out.chunks_mut(LINE_RUN).enumerate() {
            let first = c * CHUNK + r * LINE_RUN;
            let buf = &mut buf[..out.len()];
            for (j, b) in buf.iter_mut().enumerate() {
                *b = value(first + j);
            }
            crate::simd::copy_streaming(out, buf);
        }
    });
}

/// Write access to master weights, in layout order.
pub enum MasterMut<'a> {
    F32(&'a mut [f32]),
    Split {
        hi: &'a mut [bf16],
        lo: &'a mut [u16],
    },
    /// A bf16 master: values written are rounded to nearest even, and those that were not
    /// bf16 already are counted in `rounded`.
    Bf16 {
        p: &'a mut [bf16],
        rounded: &'a AtomicU64,
    },
    /// `len` elements handed on as they are made, a piece at a time: `put(first, values)`
    /// for elements `first..first + values.len()`, from any thread, each element once. A
    /// sharded run starts so: every element goes into the store, the node's own into its
    /// master, and no whole copy is held.
    Sink {
        len: usize,
        put: &'a (dyn Fn(usize, &[f32]) + Sync),
    },
}

impl MasterMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            MasterMut::F32(x) => x.len(),
            MasterMut::Split { hi, .. } | MasterMut::Bf16 { p: hi, .. } => hi.len(),
            MasterMut::Sink { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes elements `r`, a piece of at most [`PIECE`] elements at a time (pieces start
    /// at `r.start`), in parallel: `f(first, out)` puts the fp32 values of elements
    /// `first..first + out.len()` into `out`. An fp32 master is written in place; a split or
    /// bf16 one, or a sink, through a buffer of one piece per task, so no fp32 copy of the
    /// range exists.
    pub fn try_fill<E: Send>(
        &mut self,
        r: Range<usize>,
        f: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        let at = |i: usize| r.start + i * PIECE;
        match self {
            MasterMut::F32(x) => x[r.clone()]
                .par_chunks_mut(PIECE)
                .enumerate()
                .try_for_each(|(i, out)| f(at(i), out)),
            MasterMut::Split { hi, lo } => hi[r.clone()]
                .par_chunks_mut(PIECE)
                .zip(lo[r.clone()].par_chunks_mut(PIECE))
                .enumerate()
                .try_for_each(|(i, (h, l))| {
                    let mut buf = SPLIT.take();
                    buf.resize(h.len(), 0.0);
                    let r = f(at(i), &mut buf);
                    for ((h, l), x) in h.iter_mut().zip(l.iter_mut()).zip(buf.iter()) {
                        (*h, *l) = bits::split(*x);
                    }
                    SPLIT.set(buf);
                    r
                }),
            MasterMut::Bf16 { p, rounded } => p[r.clone()]
                .par_chunks_mut(PIECE)
                .enumerate()
                .try_for_each(|(i, p)| {
                    let mut buf = SPLIT.take();
                    buf.resize(p.len(), 0.0);
                    let r = f(at(i), &mut buf);
                    let mut inexact = 0;
                    for (p, &x) in p.iter_mut().zip(buf.iter()) {
                        *p = bits::round_bf16(x);
                        inexact += u64::from(p.to_f32().to_bits() != x.to_bits() && !x.is_nan());
                    }
                    rounded.fetch_add(inexact, Ordering::Relaxed);
                    SPLIT.set(buf);
                    r
                }),
            MasterMut::Sink { len, put } => {
                assert!(r.end <= *len, "elements {r:?} of {len}");
                r.clone()
                    .into_par_iter()
                    .step_by(PIECE)
                    .try_for_each(|first| {
                        let mut buf = SPLIT.take();
                        buf.resize((r.end - first).min(PIECE), 0.0);
                        let done = f(first, &mut buf);
                        if done.is_ok() {
                            put(first, &buf);
                        }
                        SPLIT.set(buf);
                        done
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of holding the master reads out its own values, element for element, over
    /// several parallel chunks and a last run of lines that is not whole.
    #[test]
    fn read_into_gives_every_element_its_value() {
        let n = 3 * CHUNK + 1500;
        let x: Vec<f32> = (0..n as u32)
            .map(|i| f32::from_bits(0x3f80_0000 ^ i.wrapping_mul(2_654_435_761) >> 9))
            .collect();
        let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
        bits::split_slice(&x, &mut hi, &mut lo);
        let widened: Vec<f32> = hi.iter().map(|h| h.to_f32()).collect();
        // A split master holds ties one ulp off (`bits::split`): its values are the joins.
        let joined: Vec<f32> = hi
            .iter()
            .zip(&lo)
            .map(|(&h, &l)| bits::join(h, l))
            .collect();
        let cases = [
            ("f32", MasterRef::F32(&x), x.clone()),
            ("split", MasterRef::Split { hi: &hi, lo: &lo }, joined),
            ("bf16", MasterRef::Bf16(&hi), widened),
        ];
        for (name, master, want) in cases {
            // Offsets into the destination: aligned and not, for the non-temporal body.
            for at in [0, 3] {
                let mut out = vec![0.0f32; n + at];
                master.read_into(&mut out[at..]);
                for (i, (o, w)) in out[at..].iter().zip(&want).enumerate() {
                    assert_eq!(o.to_bits(), w.to_bits(), "{name}, offset {at}, element {i}");
                }
            }
        }
    }
}
