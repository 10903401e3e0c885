//! AdamW with Adam's m and v held in bf16 (`memory.moments_dtype: bfloat16`): 4 bytes per
//! parameter instead of 8, and 4 fewer bytes read by the weights pass that the next forward
//! waits for.
//!
//! An update widens the stored m and v (exactly), computes the new moments and the weights
//! in f32 with the fp32-moment kernels themselves, on the widened values, and stores the new
//! moments rounded stochastically ([`bits::stochastic_round_bf16`], unbiased) with bits that
//! are a function of (`seed`, update, element) ([`bits::rounding_bits_pair`]): so runs and
//! resumes are bit-reproducible whatever the thread count. Round to nearest would stall v:
//! with β2 = 0.999 an update moves v by about 0.1% of itself, under half a bf16 ulp (0.2%).
//!
//! The weights are computed from the unrounded new moments, as with fp32 ones: only what is
//! kept for the next update is rounded. So the two passes ([`Moments::Keep`], then
//! [`adamw_moments_bf16`]) give the bits of one, as with fp32 moments.
//!
//! The widened values live in two stack buffers of [`SUB`] elements per task, so the f32
//! kernels (SIMD included) run unchanged and the moments cost no DRAM traffic beyond their
//! bf16 reads and writes.

use half::bf16;
use rayon::prelude::*;

use super::{
    AdamWStep, CHUNK, Consts, Moments, StoreOut, moments1, update_bf16_master_chunk,
    update_split_with, update_with,
};
use crate::elem::GradElem;
use crate::elem::bits;
use crate::simd::Simd;

/// Elements widened at a time (two 4 KiB buffers, in L1).
const SUB: usize = 1024;

/// A range of the weights an update changes, as `memory.master_weights` holds them.
pub enum WeightsMut<'a> {
    /// An fp32 master and the store it is copied into.
    F32 {
        p: &'a mut [f32],
        store: StoreOut<'a>,
    },
    /// A split master: the bf16 store and the residual ([`bits::split`]).
    Split {
        hi: &'a mut [bf16],
        lo: &'a mut [u16],
    },
    /// A bf16 master (the store), rounded stochastically with bits from `seed`.
    Bf16 { p: &'a mut [bf16], seed: u64 },
}

impl<'a> WeightsMut<'a> {
    fn len(&self) -> usize {
        match self {
            WeightsMut::F32 { p, .. } => p.len(),
            WeightsMut::Split { hi, .. } => hi.len(),
            WeightsMut::Bf16 { p, .. } => p.len(),
        }
    }

    /// Elements `..k` and `k..`.
    fn split_at(self, k: usize) -> (WeightsMut<'a>, WeightsMut<'a>) {
        match self {
            WeightsMut::F32 { p, store } => {
                let (p0, p1) = p.split_at_mut(k);
                let (s0, s1) = store.split_at(k);
                (
                    WeightsMut::F32 { p: p0, store: s0 },
                    WeightsMut::F32 { p: p1, store: s1 },
                )
            }
            WeightsMut::Split { hi, lo } => {
                let (h0, h1) = hi.split_at_mut(k);
                let (l0, l1) = lo.split_at_mut(k);
                (
                    WeightsMut::Split { hi: h0, lo: l0 },
                    WeightsMut::Split { hi: h1, lo: l1 },
                )
            }
            WeightsMut::Bf16 { p, seed } => {
                let (p0, p1) = p.split_at_mut(k);
                (
                    WeightsMut::Bf16 { p: p0, seed },
                    WeightsMut::Bf16 { p: p1, seed },
                )
            }
        }
    }
}

/// Updates one tensor whose moments are bf16: its weights `w`, and with `Moments::Write`
/// its m and v, rounded stochastically with bits from `seed`. `first` is the tensor's first
/// element in the layout (the rounding bits are per element). With `Moments::Keep`,
/// [`adamw_moments_bf16`] with the same arguments completes it.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update_bf16_moments<G: GradElem>(
    w: WeightsMut<'_>,
    grad: &[G],
    m: &mut [bf16],
    v: &mut [bf16],
    hp: &AdamWStep,
    decay: bool,
    seed: u64,
    first: u64,
    moments: Moments,
) {
    let n = w.len();
    assert!(grad.len() == n && m.len() == n && v.len() == n);
    let k = &Consts::new(hp, decay).with(Moments::Keep);
    let simd = Simd::get();
    let task = |at: usize, w: WeightsMut<'_>, g: &[G], m: &mut [bf16], v: &mut [bf16]| {
        let first = first + at as u64;
        weights_chunk(simd, w, g, m, v, k, hp.step, first);
        if moments == Moments::Write {
            moments_chunk(g, m, v, k, seed, hp.step, first);
        }
    };
    if n <= CHUNK {
        return task(0, w, grad, m, v);
    }
    let mut tasks = Vec::with_capacity(n.div_ceil(CHUNK));
    let (mut w, mut g, mut m, mut v) = (w, grad, m, v);
    let mut at = 0;
    while w.len() > 0 {
        let c = CHUNK.min(w.len());
        let (w0, w1) = w.split_at(c);
        let (g0, g1) = g.split_at(c);
        let (m0, m1) = m.split_at_mut(c);
        let (v0, v1) = v.split_at_mut(c);
        tasks.push((at, w0, g0, m0, v0));
        (w, g, m, v) = (w1, g1, m1, v1);
        at += c;
    }
    tasks
        .into_par_iter()
        .for_each(|(at, w, g, m, v)| task(at, w, g, m, v));
}

/// The second pass of a two-pass update with bf16 moments: m and v of one tensor, as
/// [`adamw_update_bf16_moments`] with `Moments::Write` leaves them.
pub fn adamw_moments_bf16<G: GradElem>(
    grad: &[G],
    m: &mut [bf16],
    v: &mut [bf16],
    hp: &AdamWStep,
    seed: u64,
    first: u64,
) {
    let n = grad.len();
    assert!(m.len() == n && v.len() == n);
    let k = &Consts::new(hp, false);
    grad.par_chunks(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(i, ((g, m), v))| {
            moments_chunk(g, m, v, k, seed, hp.step, first + (i * CHUNK) as u64)
        });
}

/// The weights of one range (m and v read, widened [`SUB`] elements at a time).
#[allow(clippy::too_many_arguments)]
fn weights_chunk<G: GradElem>(
    simd: Simd,
    w: WeightsMut<'_>,
    g: &[G],
    m: &[bf16],
    v: &[bf16],
    k: &Consts,
    step: u64,
    first: u64,
) {
    let (mut m32, mut v32) = ([0.0f32; SUB], [0.0f32; SUB]);
    let mut w = w;
    let mut at = 0;
    while w.len() > 0 {
        let c = SUB.min(w.len());
        let (wc, rest) = w.split_at(c);
        w = rest;
        let (mc, vc) = (&mut m32[..c], &mut v32[..c]);
        for i in 0..c {
            mc[i] = m[at + i].to_f32();
            vc[i] = v[at + i].to_f32();
        }
        let gc = &g[at..at + c];
        match wc {
            WeightsMut::F32 { p, store } => update_with(simd, p, gc, mc, vc, store, k),
            WeightsMut::Split { hi, lo } => update_split_with(simd, hi, lo, gc, mc, vc, k),
            WeightsMut::Bf16 { p, seed } => {
                update_bf16_master_chunk(p, gc, mc, vc, k, seed, step, first + at as u64)
            }
        }
        at += c;
    }
}

/// The new m and v of one range whose element 0 is layout element `first`, rounded
/// stochastically.
fn moments_chunk<G: GradElem>(
    g: &[G],
    m: &mut [bf16],
    v: &mut [bf16],
    k: &Consts,
    seed: u64,
    step: u64,
    first: u64,
) {
    let n = g.len();
    let (m, v) = (&mut m[..n], &mut v[..n]);
    for i in 0..n {
        let (mi, vi) = moments1(g[i].to_f32(), m[i].to_f32(), v[i].to_f32(), k);
        let (rm, rv) = bits::rounding_bits_pair(seed, step, first + i as u64);
        m[i] = bits::stochastic_round_bf16(mi, rm);
        v[i] = bits::stochastic_round_bf16(vi, rv);
    }
}
