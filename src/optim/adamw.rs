//! Fused AdamW over flat fp32 slices, numerically as `torch.optim.AdamW` (single-tensor
//! path): decoupled weight decay, `m.lerp_(g, 1-β1)`, `v = β2 v + (1-β2) g²`, bias
//! correction, `p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)`.
//!
//! One pass reads param, grad, m, v and writes param, m, v and the compute-dtype copy into
//! the shared store (bf16 by round-to-nearest-even). Gradient clipping is folded in as
//! `grad_scale`. Parallel over chunks with rayon. The gradient is fp32 or bf16
//! (`memory.grad_dtype`), widened exactly when read. [`adamw_update_split`] is the same
//! update on a split master (`memory.master_weights: split`, see [`crate::elem::bits`]): it reads
//! the bf16 store and the u16 residual, and writes both back, in the same single pass.
//! [`adamw_update_bf16_master`] updates a bf16 master in place with stochastic rounding
//! (`memory.master_weights: bfloat16`, 22 bytes moved per parameter with a bf16 gradient).
//!
//! An update can also run in two passes ([`Moments`]): the weights and the store first
//! (`Moments::Keep`: m and v are read, not written), the moments later ([`adamw_moments`]).
//! Together they give the bits of one pass. The first is what the next step's forward
//! waits for; it moves 18 bytes per parameter where the whole update moves 26 (split
//! master, bf16 gradient), and the second (18 more) runs while the GPUs compute. The
//! `Keep` pass is the one-pass kernel with the stores of m and v left out.
//!
//! The update is memory-bound, so the kernels aim at moving bytes, not at saving flops.
//! Bytes per parameter moved (reads + writes, the store's write included): fp32 master and
//! grad 30; bf16 grad 28; split master with bf16 grad 26 (store 2 + residual 2 + grad 2 +
//! m, v 8 read; store, residual, m, v 12 written); split with fp32 grad 28.
//! - explicit AVX-512 and AVX2 bodies (in `x86.rs` and `x86/split.rs`, with all of their
//!   `unsafe`, fenced as [`crate::simd`] describes)
//!   chosen at run time ([`Simd`]), with the portable loop below as the fallback and the
//!   reference: every path performs the same IEEE operations in the same order (no FMA
//!   contraction), so all give the same bits;
//! - the four fp32 streams are prefetched into L1 2 KiB ahead (a core alone cannot keep
//!   enough misses in flight with the hardware prefetchers only: +18% on 2 cores);
//! - the bf16 store is written with non-temporal full-cache-line stores: it is read next by
//!   the GPUs' DMA, not by this CPU, so it skips the read-for-ownership (2 B/param) and
//!   does not evict the fp32 streams from cache.
//!
//! Measured (benches/results/host_*): 1.08x torch's fused CPU step on 2 cores with the bf16
//! store written on top; where DRAM, not the core, is the limit, expect the byte ratio
//! (28/30 against torch's step alone, 36/30 against step + bf16 copy).

use half::bf16;
use rayon::prelude::*;

use crate::elem::GradElem;
use crate::elem::bits;
use crate::simd::Simd;

/// Elements per rayon task (~2 MB of traffic). A multiple of 32, so every task starts at
/// the same alignment as the whole slice.
const CHUNK: usize = 64 * 1024;

/// The scalars of one AdamW update.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based count of updates, this one included.
    pub step: u64,
    /// Multiplier applied to the gradient first (the clip coefficient).
    pub grad_scale: f32,
}

/// Whether an update writes the Adam moments back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moments {
    /// The whole update: weights, store, m and v.
    Write,
    /// Weights and store only: m and v are read, not changed. [`adamw_moments`] with the
    /// same step completes the update; the two give the bits of one `Write` update.
    Keep,
}

/// Where the updated weights are also written, in the store's dtype.
pub enum StoreOut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl<'a> StoreOut<'a> {
    fn len(&self) -> usize {
        match self {
            StoreOut::F32(s) => s.len(),
            StoreOut::Bf16(s) => s.len(),
        }
    }

    /// Elements `..k` and `k..`.
    fn split_at(self, k: usize) -> (StoreOut<'a>, StoreOut<'a>) {
        match self {
            StoreOut::F32(s) => {
                let (a, b) = s.split_at_mut(k);
                (StoreOut::F32(a), StoreOut::F32(b))
            }
            StoreOut::Bf16(s) => {
                let (a, b) = s.split_at_mut(k);
                (StoreOut::Bf16(a), StoreOut::Bf16(b))
            }
        }
    }
}

/// Updates one tensor. `decay` says whether weight decay applies (tensors with >= 2 dims).
#[allow(clippy::too_many_arguments)]
pub fn adamw_update<G: GradElem>(
    param: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    store: StoreOut<'_>,
    hp: &AdamWStep,
    decay: bool,
    moments: Moments,
) {
    let k = &Consts::new(hp, decay).with(moments);
    update_with(Simd::get(), param, grad, m, v, store, k);
}

/// Updates one tensor of a split master: `hi` is its bf16 store, `lo` the residual
/// ([`bits::split`]). The same bits as joining, [`adamw_update`] and splitting again.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update_split<G: GradElem>(
    hi: &mut [bf16],
    lo: &mut [u16],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamWStep,
    decay: bool,
    moments: Moments,
) {
    let k = &Consts::new(hp, decay).with(moments);
    update_split_with(Simd::get(), hi, lo, grad, m, v, k);
}

/// The second pass of a two-pass update ([`Moments::Keep`]): m and v of one tensor, as
/// the one-pass update leaves them.
pub fn adamw_moments<G: GradElem>(grad: &[G], m: &mut [f32], v: &mut [f32], hp: &AdamWStep) {
    let n = grad.len();
    assert!(m.len() == n && v.len() == n);
    let k = &Consts::new(hp, false);
    if n <= CHUNK {
        return moments_portable(grad, m, v, k);
    }
    grad.par_chunks(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|((g, m), v)| moments_portable(g, m, v, k));
}

/// The f32 constants every element of an update uses, as the host's kernels derive them
/// from `hp` (a device kernel takes these, so that it performs the same operations on the
/// same values): `[decay_mul, 1 - beta1, beta2, 1 - beta2, step_size, 1 / sqrt(bc2), eps,
/// grad_scale]`, in [`adam1`]'s order of use.
pub fn element_constants(hp: &AdamWStep, decay: bool) -> [f32; 8] {
    let k = Consts::new(hp, decay);
    [
        k.decay_mul,
        k.one_minus_b1,
        k.b2,
        k.one_minus_b2,
        k.step_size,
        k.inv_bc2_sqrt,
        k.eps,
        k.grad_scale,
    ]
}

/// The update of one tensor of a block kept on a device (`memory.resident_blocks`), in the
/// worker's own copy: an f32 master `p` (a split master joined: [`bits::join`]), and its
/// compute copy `w` written as the store would hold it. With `split`, `p` is left as
/// joining its [`bits::split`] gives back (ties nudged) and `w` is the split's high half, so
/// that the copy stays what the host's split master holds. The bits of [`adamw_update`]
/// (and [`adamw_update_split`]) on the same values; CPU workers run it, GPU workers a
/// kernel that performs the same operations.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update_resident<G: GradElem>(
    p: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    w: StoreOut<'_>,
    hp: &AdamWStep,
    decay: bool,
    split: bool,
) {
    if !split {
        return adamw_update(p, grad, m, v, w, hp, decay, Moments::Write);
    }
    let StoreOut::Bf16(w) = w else {
        panic!("a split master has a bf16 compute copy")
    };
    let n = p.len();
    assert!(grad.len() == n && m.len() == n && v.len() == n && w.len() == n);
    let k = &Consts::new(hp, decay);
    for i in 0..n {
        let pi = adam1(p[i], grad[i].to_f32(), &mut m[i], &mut v[i], k);
        let (hi, lo) = bits::split(pi);
        (p[i], w[i]) = (bits::join(hi, lo), hi);
    }
}

/// Updates one tensor of a bf16 master (`memory.master_weights: bfloat16`): `p` is its bf16
/// store, read, updated in f32 as [`adamw_update`] does, and rounded stochastically
/// ([`bits::stochastic_round_bf16`]) with [`bits::rounding_bits`]`(seed, hp.step, first + i)`
/// for element `i`, `first` being the tensor's first element in the layout. A pure
/// function of its inputs: thread count and chunking do not change a bit.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update_bf16_master<G: GradElem>(
    p: &mut [bf16],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamWStep,
    decay: bool,
    seed: u64,
    first: u64,
    moments: Moments,
) {
    let n = p.len();
    assert!(grad.len() == n && m.len() == n && v.len() == n);
    let k = Consts::new(hp, decay).with(moments);
    p.par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(i, (((p, g), m), v))| {
            let first = first + (i * CHUNK) as u64;
            update_bf16_master_chunk(p, g, m, v, &k, seed, hp.step, first)
        });
}

/// [`adamw_update_bf16_master`] on one range whose element 0 is layout element `first`.
#[allow(clippy::too_many_arguments)]
fn update_bf16_master_chunk<G: GradElem>(
    p: &mut [bf16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
    seed: u64,
    step: u64,
    first: u64,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for j in 0..n {
        let pj = adam1(p[j].to_f32(), g[j].to_f32(), &mut m[j], &mut v[j], k);
        let r = bits::rounding_bits(seed, step, first + j as u64);
        p[j] = bits::stochastic_round_bf16(pj, r);
    }
}

fn update_split_with<G: GradElem>(
    simd: Simd,
    hi: &mut [bf16],
    lo: &mut [u16],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    let n = hi.len();
    assert!(lo.len() == n && grad.len() == n && m.len() == n && v.len() == n);
    if n <= CHUNK {
        return update_chunk_split(simd, hi, lo, grad, m, v, k);
    }
    hi.par_chunks_mut(CHUNK)
        .zip(lo.par_chunks_mut(CHUNK))
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|((((hi, lo), g), m), v)| update_chunk_split(simd, hi, lo, g, m, v, k));
}

fn update_chunk_split<G: GradElem>(
    simd: Simd,
    hi: &mut [bf16],
    lo: &mut [u16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 | Simd::Avx2 => x86::update_split(simd, hi, lo, g, m, v, k),
        _ => update_split_portable(hi, lo, g, m, v, k),
    }
}

fn update_with<G: GradElem>(
    simd: Simd,
    param: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    store: StoreOut<'_>,
    k: &Consts,
) {
    let n = param.len();
    assert!(grad.len() == n && m.len() == n && v.len() == n && store.len() == n);
    if n <= CHUNK {
        // One task: stay on the caller's thread (small tensors: norms, biases).
        return match store {
            StoreOut::F32(s) => update_chunk_f32(simd, param, grad, m, v, s, k),
            StoreOut::Bf16(s) => update_chunk_bf16(simd, param, grad, m, v, s, k),
        };
    }
    let parts = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK));
    match store {
        StoreOut::F32(s) => parts
            .zip(s.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), s)| update_chunk_f32(simd, p, g, m, v, s, k)),
        StoreOut::Bf16(s) => parts
            .zip(s.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), s)| update_chunk_bf16(simd, p, g, m, v, s, k)),
    }
}

fn update_chunk_f32<G: GradElem>(
    simd: Simd,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [f32],
    k: &Consts,
) {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 | Simd::Avx2 => x86::update_f32(simd, p, g, m, v, s, k),
        _ => update_portable(p, g, m, v, s, k, |x| x),
    }
}

fn update_chunk_bf16<G: GradElem>(
    simd: Simd,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [bf16],
    k: &Consts,
) {
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 | Simd::Avx2 => x86::update_bf16(simd, p, g, m, v, s, k),
        _ => update_portable(p, g, m, v, s, k, bf16::from_f32),
    }
}

/// The per-update scalars, rounded to f32 once.
pub(crate) struct Consts {
    pub(crate) decay_mul: f32,
    pub(crate) one_minus_b1: f32,
    pub(crate) b2: f32,
    pub(crate) one_minus_b2: f32,
    pub(crate) step_size: f32,
    pub(crate) inv_bc2_sqrt: f32,
    pub(crate) eps: f32,
    pub(crate) grad_scale: f32,
    /// Whether m and v are written back (`Moments::Write`); read only otherwise.
    pub(crate) write_moments: bool,
}

impl Consts {
    fn with(self, moments: Moments) -> Consts {
        let write_moments = moments == Moments::Write;
        Consts {
            write_moments,
            ..self
        }
    }

    fn new(hp: &AdamWStep, decay: bool) -> Consts {
        let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
        let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
        Consts {
            decay_mul: if decay {
                (1.0 - hp.lr * hp.weight_decay) as f32
            } else {
                1.0
            },
            one_minus_b1: (1.0 - hp.beta1) as f32,
            b2: hp.beta2 as f32,
            one_minus_b2: (1.0 - hp.beta2) as f32,
            step_size: (hp.lr / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            eps: hp.eps as f32,
            grad_scale: hp.grad_scale,
            write_moments: true,
        }
    }
}

/// The update of one element: returns the new parameter, updates `m` and `v` (with
/// `write_moments`). The SIMD
/// bodies perform exactly these operations in this order.
#[inline(always)]
fn adam1(p: f32, g: f32, m: &mut f32, v: &mut f32, k: &Consts) -> f32 {
    let pi = p * k.decay_mul;
    let (mi, vi) = moments1(g, *m, *v, k);
    let denom = vi.sqrt() * k.inv_bc2_sqrt + k.eps;
    if k.write_moments {
        *m = mi;
        *v = vi;
    }
    pi - k.step_size * (mi / denom)
}

/// The new m and v of one element (what [`adam1`] and the SIMD bodies compute).
#[inline(always)]
fn moments1(g: f32, m: f32, v: f32, k: &Consts) -> (f32, f32) {
    let gi = g * k.grad_scale;
    // torch's lerp with weight < 0.5: m + w (g - m).
    let mi = m + k.one_minus_b1 * (gi - m);
    let vi = v * k.b2 + k.one_minus_b2 * gi * gi;
    (mi, vi)
}

/// The moments pass over one chunk; a plain loop the compiler vectorizes (no FMA
/// contraction in Rust, so the same bits at any vector width).
fn moments_portable<G: GradElem>(g: &[G], m: &mut [f32], v: &mut [f32], k: &Consts) {
    for ((g, m), v) in g.iter().zip(m.iter_mut()).zip(v.iter_mut()) {
        (*m, *v) = moments1(g.to_f32(), *m, *v, k);
    }
}

/// The reference loop.
#[inline(always)]
pub(crate) fn update_portable<G: GradElem, S>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [S],
    k: &Consts,
    to_store: impl Fn(f32) -> S,
) {
    let n = p.len();
    let (g, m, v, s) = (&g[..n], &mut m[..n], &mut v[..n], &mut s[..n]);
    for i in 0..n {
        let pi = adam1(p[i], g[i].to_f32(), &mut m[i], &mut v[i], k);
        p[i] = pi;
        s[i] = to_store(pi);
    }
}

/// The reference loop of the split master.
#[inline(always)]
pub(crate) fn update_split_portable<G: GradElem>(
    hi: &mut [bf16],
    lo: &mut [u16],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Consts,
) {
    let n = hi.len();
    let (lo, g, m, v) = (&mut lo[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let pi = bits::join(hi[i], lo[i]);
        let pi = adam1(pi, g[i].to_f32(), &mut m[i], &mut v[i], k);
        (hi[i], lo[i]) = bits::split(pi);
    }
}

mod bf16_moments;
pub use bf16_moments::{WeightsMut, adamw_moments_bf16, adamw_update_bf16_moments};

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

#[cfg(test)]
mod tests;
