//! Rotary position embeddings: the inverse frequencies of each RoPE variant, as
//! transformers' `ROPE_INIT_FUNCTIONS` compute them, and the cos/sin tables built from them.
//!
//! Sequence-dependent variants (dynamic NTK, LongRoPE's long factors) are a pure function of
//! the micro-batch length T here, where transformers keeps state across forward calls (its
//! dynamic RoPE only resets below the original length). Both agree whenever T stays at or
//! below `max_position_embeddings` (dynamic) or `original_max_position_embeddings` (LongRoPE).
//!
//! Rotary pairs are the halves of the rotary dims, (i, i + R/2), as Llama's `rotate_half`
//! pairs them, or adjacent dims (2i, 2i + 1) where the family interleaves them (GLM-4,
//! DeepSeek-V3, Llama 4's complex product); each pair turns by frequency i either way.
//!
//! Qwen2.5-VL's and Qwen3-VL's multimodal RoPE ([`Rope::mrope`]) turns each pair by one of
//! three positions (temporal, height, width): the pairs split into three consecutive sections
//! as transformers' `Qwen2_5_VLRotaryEmbedding` recomposes its frequencies, or interleaved as
//! `Qwen3VLTextRotaryEmbedding` does (`mt::config::hf::Mrope::pair_axes`).
//!
//! Shapes: B rows, T sequence length, D head dim, R rotary dims (R <= D; partial rotary).

use std::f64::consts::PI;

use mt::config::hf::{RopeScaling, RopeSpec};
use tch::{Device, Kind, Tensor};

use crate::kernels;

/// The R/2 inverse frequencies for a sequence of `seq_len` positions, and the factor that
/// multiplies cos and sin (`attention_scaling`; 1 except YaRN and LongRoPE).
pub fn inv_freq(r: &RopeSpec, seq_len: usize) -> (Vec<f64>, f64) {
    let dim = r.rotary_dim as f64;
    let half = r.rotary_dim / 2;
    // base^(2i/R) for i in 0..R/2.
    let powers =
        |base: f64| -> Vec<f64> { (0..half).map(|i| base.powf((2 * i) as f64 / dim)).collect() };
    let plain = |base: f64| -> Vec<f64> { powers(base).iter().map(|p| 1.0 / p).collect() };
    match &r.scaling {
        RopeScaling::Default => (plain(r.theta), 1.0),
        RopeScaling::Linear { factor } => {
            (plain(r.theta).iter().map(|f| f / factor).collect(), 1.0)
        }
        RopeScaling::Dynamic {
            factor,
            max_position_embeddings,
        } => {
            let max = *max_position_embeddings as f64;
            let len = (seq_len as f64).max(max);
            let base = r.theta * ((factor * len / max) - (factor - 1.0)).powf(dim / (dim - 2.0));
            (plain(base), 1.0)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = *original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            let freqs = plain(r.theta)
                .into_iter()
                .map(|f| {
                    let wavelen = 2.0 * PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect();
            (freqs, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => {
            let orig = *original_max_position_embeddings as f64;
            let correction_dim =
                |rotations: f64| dim * (orig / (rotations * 2.0 * PI)).ln() / (2.0 * r.theta.ln());
            let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
            if *truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            let freqs = powers(r.theta)
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    (1.0 / (factor * p)) * (1.0 - extrapolation) + (1.0 / p) * extrapolation
                })
                .collect();
            (freqs, *attention_factor)
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            let ext = if seq_len > *original_max_position_embeddings {
                long_factor
            } else {
                short_factor
            };
            let freqs = powers(r.theta)
                .iter()
                .zip(ext)
                .map(|(p, e)| 1.0 / (e * p))
                .collect();
            (freqs, *attention_factor)
        }
    }
}

/// cos/sin tables in `kind`: (1, 1, T, R) for positions 0..T, or (B, 1, T, R) for given
/// per-row positions (packed rows, where each sample restarts at 0); (.., R/2), one entry
/// per pair, where pairs are interleaved.
pub struct Rope {
    cos_b1tr: Tensor,
    sin_b1tr: Tensor,
    rotary_dim: i64,
    interleaved: bool,
}

impl Rope {
    /// `seq_len`: the longest position + 1 (what length-dependent variants scale by).
    pub fn new(
        r: &RopeSpec,
        interleaved: bool,
        seq_len: usize,
        pos_bt: Option<&Tensor>,
        kind: Kind,
        device: Device,
    ) -> Rope {
        let (freqs, scaling) = inv_freq(r, seq_len);
        let freqs: Vec<f32> = freqs.iter().map(|&f| f as f32).collect();
        let inv_freq_r2 = Tensor::from_slice(&freqs).to_device(device);
        let pos_bt = match pos_bt {
            Some(p) => p.to_kind(Kind::Float),
            None => Tensor::arange(seq_len as i64, (Kind::Float, device)).unsqueeze(0),
        };
        // Angles in f32, as transformers forces, then cast to the compute dtype.
        let angle_btr2 = pos_bt.unsqueeze(-1) * inv_freq_r2.view([1, 1, -1]);
        let emb_b1tr = match interleaved {
            true => angle_btr2.unsqueeze(1),
            false => Tensor::cat(&[&angle_btr2, &angle_btr2], -1).unsqueeze(1),
        };
        Rope {
            cos_b1tr: (emb_b1tr.cos() * scaling).to_kind(kind),
            sin_b1tr: (emb_b1tr.sin() * scaling).to_kind(kind),
            rotary_dim: r.rotary_dim as i64,
            interleaved,
        }
    }

    /// The multimodal tables (B, 1, T, R) from 3-D positions `pos_3bt` (temporal, height,
    /// width; `mt::mrope`): rotary pair i turns by the position of axis `axes[i]`
    /// (`Mrope::pair_axes`: consecutive sections for Qwen2.5-VL, interleaved for Qwen3-VL);
    /// both halves of the rotary dims repeat that layout.
    pub fn mrope(
        r: &RopeSpec,
        axes: &[usize],
        pos_3bt: &Tensor,
        kind: Kind,
        device: Device,
    ) -> Rope {
        assert_eq!(
            axes.len(),
            r.rotary_dim / 2,
            "an axis for every rotary pair"
        );
        assert!(axes.iter().all(|&a| a < 3), "axes are 0, 1, 2");
        let (freqs, scaling) = inv_freq(r, 0);
        let freqs: Vec<f32> = freqs.iter().map(|&f| f as f32).collect();
        let inv_freq_r2 = Tensor::from_slice(&freqs).to_device(device);
        // Angles in f32 per axis (3, B, T, R/2), then each pair's axis picked.
        let angle_3btr2 = pos_3bt.to_device(device).to_kind(Kind::Float).unsqueeze(-1)
            * inv_freq_r2.view([1, 1, 1, -1]);
        let axes: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
        let mut size = angle_3btr2.size();
        size[0] = 1;
        let pick = Tensor::from_slice(&axes)
            .to_device(device)
            .view([1, 1, 1, -1])
            .expand(&size, false);
        let angle_btr2 = angle_3btr2.gather(0, &pick, false).squeeze_dim(0);
        let emb_b1tr = Tensor::cat(&[&angle_btr2, &angle_btr2], -1).unsqueeze(1);
        Rope {
            cos_b1tr: (emb_b1tr.cos() * scaling).to_kind(kind),
            sin_b1tr: (emb_b1tr.sin() * scaling).to_kind(kind),
            rotary_dim: r.rotary_dim as i64,
            interleaved: false,
        }
    }

    /// Rotates the first R dims of each head: (B, N, T, D) -> (B, N, T, D).
    pub fn apply(&self, x_bntd: &Tensor) -> Tensor {
        turn(
            x_bntd,
            &self.cos_b1tr,
            &self.sin_b1tr,
            self.rotary_dim,
            self.interleaved,
        )
    }

    /// [`Rope::apply`] as one fused op where `crate::kernels::rope_enabled` and supported
    /// (CUDA, bf16), its backward from the kernels' tape. The attention's input must come
    /// through [`Rope::input`].
    pub fn apply_taped(&self, x_bntd: &Tensor) -> Tensor {
        let (kind, device) = (x_bntd.kind(), x_bntd.device());
        let d = x_bntd.size()[3];
        if !kernels::rope_enabled(kind, device)
            || !kernels::rope_supported(kind, d, self.rotary_dim, device)
        {
            return self.apply(x_bntd);
        }
        kernels::rope(
            x_bntd,
            &self.cos_b1tr,
            &self.sin_b1tr,
            self.rotary_dim,
            self.interleaved,
            turn,
        )
    }

    /// The attention's input `x_bth` (or any tensor q or k shares with another consumer,
    /// such as a projection that also yields a gate), as its consumers should read it where
    /// [`Rope::apply_taped`] may record: a tape boundary where it requires grad. The
    /// gradients the tape hands to q and k then stop at the boundary's leaf, beside the
    /// others' (v's), and reach the graph before it (the norm) once, summed, instead of
    /// through a graph autograd's pass has already freed (which fails).
    pub fn input(&self, x_bth: &Tensor) -> Tensor {
        match x_bth.requires_grad() && kernels::rope_enabled(x_bth.kind(), x_bth.device()) {
            true => kernels::tape::boundary(x_bth),
            false => x_bth.shallow_clone(),
        }
    }
}

/// Turns the first `r` dims of each head of x (B, N, T, D) by the tables: torch's ops,
/// transformers' order (the mirror of `crate::kernels::rope`).
fn turn(x_bntd: &Tensor, cos: &Tensor, sin: &Tensor, r: i64, interleaved: bool) -> Tensor {
    let d = x_bntd.size()[3];
    if r == d {
        return rotate(x_bntd, cos, sin, interleaved);
    }
    let x_bntr = x_bntd.narrow(-1, 0, r);
    let pass = x_bntd.narrow(-1, r, d - r);
    Tensor::cat(&[&rotate(&x_bntr, cos, sin, interleaved), &pass], -1)
}

/// (B, N, T, R) -> (B, N, T, R).
fn rotate(x_bntr: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Tensor {
    if !interleaved {
        return x_bntr * cos + rotate_half(x_bntr) * sin;
    }
    // Pairs (x0, x1) = dims (2i, 2i + 1) turn to (x0 cos - x1 sin, x1 cos + x0 sin).
    let s = x_bntr.size();
    let pairs = x_bntr.reshape([s[0], s[1], s[2], s[3] / 2, 2]);
    let (x0, x1) = (pairs.select(-1, 0), pairs.select(-1, 1));
    let y0 = &x0 * cos - &x1 * sin;
    let y1 = x1 * cos + x0 * sin;
    Tensor::stack(&[y0, y1], -1).reshape(s.as_slice())
}

/// (x1, x2) -> (-x2, x1) over the halves of the last dim.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    Tensor::cat(&[&x2.neg(), &x1], -1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scaling: RopeScaling) -> RopeSpec {
        RopeSpec {
            theta: 10_000.0,
            rotary_dim: 8,
            scaling,
        }
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w.abs(), "{got:?} vs {want:?}");
        }
    }

    /// With three equal position rows the multimodal tables are the 1-D ones; with
    /// distinct rows each pair turns by its section's axis.
    #[test]
    fn mrope_sections_pick_their_axis() {
        let r = spec(RopeScaling::Default);
        let pos_1t = Tensor::from_slice(&[0i64, 1, 2, 5, 9]).view([1, 5]);
        let plain = Rope::new(&r, false, 10, Some(&pos_1t), Kind::Float, Device::Cpu);
        let same = Rope::mrope(
            &r,
            &[0, 1, 1, 2],
            &Tensor::stack(&[&pos_1t, &pos_1t, &pos_1t], 0),
            Kind::Float,
            Device::Cpu,
        );
        assert!(plain.cos_b1tr.equal(&same.cos_b1tr) && plain.sin_b1tr.equal(&same.sin_b1tr));
        // Axis positions 10, 20, 30 for every token: pair 0 by 10, pairs 1-2 by 20, 3 by 30.
        let pos_3bt = Tensor::from_slice(&[10i64, 20, 30]).view([3, 1, 1]);
        let m = Rope::mrope(&r, &[0, 1, 1, 2], &pos_3bt, Kind::Float, Device::Cpu);
        let f = [1.0, 0.1, 0.01, 0.001];
        let angles = [10.0 * f[0], 20.0 * f[1], 20.0 * f[2], 30.0 * f[3]];
        let want: Vec<f64> = angles
            .iter()
            .chain(&angles)
            .map(|a: &f64| a.cos())
            .collect();
        let got = Vec::<f64>::try_from(m.cos_b1tr.reshape([-1]).to_kind(Kind::Double)).unwrap();
        close(&got, &want);
        // Interleaved (Qwen3-VL): pairs by axes 0, 1, 2, 0.
        let m = Rope::mrope(&r, &[0, 1, 2, 0], &pos_3bt, Kind::Float, Device::Cpu);
        let angles = [10.0 * f[0], 20.0 * f[1], 30.0 * f[2], 10.0 * f[3]];
        let want: Vec<f64> = angles.iter().chain(&angles).map(|a| a.cos()).collect();
        let got = Vec::<f64>::try_from(m.cos_b1tr.reshape([-1]).to_kind(Kind::Double)).unwrap();
        close(&got, &want);
    }

    // Expected values: transformers 5.17's ROPE_INIT_FUNCTIONS with head_dim 8, theta 1e4.
    #[test]
    fn variants_match_transformers() {
        let base = [1.0, 0.1, 0.01, 0.001];
        close(&inv_freq(&spec(RopeScaling::Default), 5).0, &base);
        close(
            &inv_freq(&spec(RopeScaling::Linear { factor: 4.0 }), 5).0,
            &base.map(|f| f / 4.0),
        );
        let dynamic = spec(RopeScaling::Dynamic {
            factor: 2.0,
            max_position_embeddings: 16,
        });
        close(&inv_freq(&dynamic, 16).0, &base);
        // base' = 1e4 * (2 * 32 / 16 - 1)^(8/6)
        let grown = 10_000.0 * 3f64.powf(8.0 / 6.0);
        close(
            &inv_freq(&dynamic, 32).0,
            &[0, 2, 4, 6].map(|i| 1.0 / grown.powf(i as f64 / 8.0)),
        );
        let llama3 = spec(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        });
        // wavelengths 6.28 (kept), 62.8 (smoothed), 628 and 6283 (divided by 8).
        let smooth = (64.0 / (2.0 * PI / 0.1) - 1.0) / 3.0;
        close(
            &inv_freq(&llama3, 5).0,
            &[
                1.0,
                (1.0 - smooth) * 0.1 / 8.0 + smooth * 0.1,
                0.01 / 8.0,
                0.001 / 8.0,
            ],
        );
        let yarn = spec(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.1386,
            truncate: true,
        });
        let (f, a) = inv_freq(&yarn, 5);
        // low = floor(0.0) = 0, high = ceil(2.0) = 2: ramp 0, 0.5, 1, 1.
        close(
            &f,
            &[1.0, 0.5 * 0.1 / 4.0 + 0.5 * 0.1, 0.01 / 4.0, 0.001 / 4.0],
        );
        assert_eq!(a, 1.1386);
        let longrope = spec(RopeScaling::LongRope {
            short_factor: vec![1.0, 2.0, 3.0, 4.0],
            long_factor: vec![5.0, 6.0, 7.0, 8.0],
            original_max_position_embeddings: 16,
            attention_factor: 1.2,
        });
        close(
            &inv_freq(&longrope, 16).0,
            &[1.0, 0.05, 0.01 / 3.0, 0.00025],
        );
        close(
            &inv_freq(&longrope, 17).0,
            &[0.2, 0.1 / 6.0, 0.01 / 7.0, 0.001 / 8.0],
        );
    }
}
