//! Fused AdamW over flat fp32 slices, numerically as `torch.optim.AdamW` (single-tensor
//! path): decoupled weight decay, `m.lerp_(g, 1-β1)`, `v = β2 v + (1-β2) g²`, bias
//! correction, `p -= lr/bc1 · m / (sqrt(v)/sqrt(bc2) + eps)`.
//!
//! One pass reads param, grad, m, v and writes param, m, v and the compute-dtype copy into
//! the shared store (bf16 by round-to-nearest-even). Gradient clipping is folded in as
//! `grad_scale`. Parallel over chunks with rayon; the inner loop is branch-free so the
//! compiler vectorizes it.

use half::bf16;
use rayon::prelude::*;

const CHUNK: usize = 32 * 1024;

/// The scalars of one AdamW update.
#[derive(Debug, Clone, Copy)]
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

/// Where the updated weights are also written, in the store's dtype.
pub enum StoreOut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl StoreOut<'_> {
    fn len(&self) -> usize {
        match self {
            StoreOut::F32(s) => s.len(),
            StoreOut::Bf16(s) => s.len(),
        }
    }
}

/// Updates one tensor. `decay` says whether weight decay applies (tensors with >= 2 dims).
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    store: StoreOut<'_>,
    hp: &AdamWStep,
    decay: bool,
) {
    let n = param.len();
    assert!(grad.len() == n && m.len() == n && v.len() == n && store.len() == n);
    let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
    let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
    let k = Consts {
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
    };
    let parts = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK));
    match store {
        StoreOut::F32(s) => parts
            .zip(s.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), s)| update_chunk(p, g, m, v, s, &k, |x| x)),
        StoreOut::Bf16(s) => parts
            .zip(s.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), s)| update_chunk(p, g, m, v, s, &k, bf16::from_f32)),
    }
}

struct Consts {
    decay_mul: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    step_size: f32,
    inv_bc2_sqrt: f32,
    eps: f32,
    grad_scale: f32,
}

#[inline(always)]
fn update_chunk<S>(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &mut [S],
    k: &Consts,
    to_store: impl Fn(f32) -> S,
) {
    let n = p.len();
    let (g, m, v, s) = (&g[..n], &mut m[..n], &mut v[..n], &mut s[..n]);
    for i in 0..n {
        let gi = g[i] * k.grad_scale;
        let pi = p[i] * k.decay_mul;
        // torch's lerp with weight < 0.5: m + w (g - m).
        let mi = m[i] + k.one_minus_b1 * (gi - m[i]);
        let vi = v[i] * k.b2 + k.one_minus_b2 * gi * gi;
        let denom = vi.sqrt() * k.inv_bc2_sqrt + k.eps;
        let pi = pi - k.step_size * (mi / denom);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        s[i] = to_store(pi);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update written out step by step in f64, as torch's docs state the algorithm.
    fn reference(p: f64, g: f64, m: f64, v: f64, hp: &AdamWStep, decay: bool) -> (f64, f64, f64) {
        let g = g * hp.grad_scale as f64;
        let p = if decay {
            p * (1.0 - hp.lr * hp.weight_decay)
        } else {
            p
        };
        let m = hp.beta1 * m + (1.0 - hp.beta1) * g;
        let v = hp.beta2 * v + (1.0 - hp.beta2) * g * g;
        let mhat = m / (1.0 - hp.beta1.powi(hp.step as i32));
        let vhat = v / (1.0 - hp.beta2.powi(hp.step as i32));
        (p - hp.lr * mhat / (vhat.sqrt() + hp.eps), m, v)
    }

    #[test]
    fn matches_the_algorithm_over_several_steps() {
        let n = CHUNK + 100;
        let mut p: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
        let mut m = vec![0.0f32; n];
        let mut v = vec![0.0f32; n];
        let mut s = vec![bf16::ZERO; n];
        let (mut rp, mut rm, mut rv): (Vec<f64>, Vec<f64>, Vec<f64>) = (
            p.iter().map(|&x| x as f64).collect(),
            vec![0.0; n],
            vec![0.0; n],
        );
        for step in 1..=3 {
            let g: Vec<f32> = (0..n)
                .map(|i| (((i * 31 + step * 7) % 23) as f32 - 11.0) * 0.01)
                .collect();
            let hp = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
                step: step as u64,
                grad_scale: 0.5,
            };
            adamw_update(
                &mut p,
                &g,
                &mut m,
                &mut v,
                StoreOut::Bf16(&mut s),
                &hp,
                true,
            );
            for i in 0..n {
                (rp[i], rm[i], rv[i]) = reference(rp[i], g[i] as f64, rm[i], rv[i], &hp, true);
            }
        }
        for i in 0..n {
            assert!(
                (p[i] as f64 - rp[i]).abs() <= 1e-6 + 1e-5 * rp[i].abs(),
                "param {i}: {} vs {}",
                p[i],
                rp[i]
            );
            assert_eq!(s[i], bf16::from_f32(p[i]));
        }
    }

    #[test]
    fn no_decay_for_vectors() {
        let hp = AdamWStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.5,
            step: 1,
            grad_scale: 1.0,
        };
        let (mut p, mut m, mut v, mut s) = (vec![1.0f32], vec![0.0], vec![0.0], vec![0.0f32]);
        adamw_update(
            &mut p,
            &[0.0],
            &mut m,
            &mut v,
            StoreOut::F32(&mut s),
            &hp,
            false,
        );
        assert_eq!(p[0], 1.0);
        adamw_update(
            &mut p,
            &[0.0],
            &mut m,
            &mut v,
            StoreOut::F32(&mut s),
            &hp,
            true,
        );
        assert!((p[0] - 0.95).abs() < 1e-7);
    }
}
