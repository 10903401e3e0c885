//! The chunked path against the reference path on CPU, for one Gated DeltaNet layer: its
//! output and the gradients of its input and of every weight, with rows of padding, T not a
//! multiple of the chunk, several chunk lengths, Qwen3.5's split and Qwen3-Next's fused
//! projections; in f32 (same function, different rounding) and in bf16 (against f32).
//!
//! Shapes: B batch rows, T sequence length, H hidden size.

use std::path::Path;
use std::sync::Mutex;

use mt::config::hf::{HfConfig, ModelSpec};
use mt::layout::{Block, Layout};
use tch::{Device, Kind, Tensor};

use super::{Pre, chunked, reference};
use crate::model::BlockWeights;

/// Rows of the test batch: their lengths (the rest is padding, which gets no gradient).
const LENS: [i64; 3] = [150, 113, 5];
const HIDDEN: i64 = 32;

/// A one-layer Gated DeltaNet model: 2 key heads of 16, 4 value heads of 8 (each key head
/// serves two), conv width 4; `qwen3_5_text` (split projections) or `qwen3_next` (fused).
fn spec(model_type: &str) -> ModelSpec {
    let hf = HfConfig {
        model_type: Some(model_type.into()),
        vocab_size: Some(64),
        hidden_size: Some(HIDDEN as usize),
        intermediate_size: Some(48),
        num_hidden_layers: Some(1),
        num_attention_heads: Some(2),
        num_key_value_heads: Some(1),
        head_dim: Some(16),
        layer_types: Some(vec!["linear_attention".into()]),
        mlp_only_layers: Some(vec![0]),
        linear_num_key_heads: Some(2),
        linear_num_value_heads: Some(4),
        linear_key_head_dim: Some(16),
        linear_value_head_dim: Some(8),
        linear_conv_kernel_dim: Some(4),
        ..Default::default()
    };
    ModelSpec::from_hf(&hf, Path::new("config.json")).expect("a valid test config")
}

/// The layer's weights, f32: projections ~ N(0, 1/fan_in), conv taps ~ N(0, 1/4), norm
/// scales near 1, dt_bias 1 and decay rates exp(A_log) spread from 1e-3 to 16 over the value
/// heads (from a long memory to one that forgets within a token).
fn weights(block: &Block) -> Tensor {
    let flat = Tensor::zeros([block.len as i64], (Kind::Float, Device::Cpu));
    for t in &block.tensors {
        let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        let init = match t.name.as_str() {
            "linear_attn.A_log" => Tensor::linspace(
                1e-3f64.ln(),
                16f64.ln(),
                shape[0],
                (Kind::Float, Device::Cpu),
            ),
            "linear_attn.dt_bias" => Tensor::ones(shape.as_slice(), (Kind::Float, Device::Cpu)),
            "linear_attn.conv1d.weight" => {
                Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * 0.5
            }
            n if n.ends_with("norm.weight") => {
                Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * 0.1 + 1.0
            }
            _ => {
                Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu))
                    / (shape[shape.len() - 1] as f64).sqrt()
            }
        };
        flat.narrow(0, t.offset as i64, t.numel() as i64)
            .copy_(&init.reshape([-1]));
    }
    flat
}

/// The layer's output and the gradients of (output * dy).sum() with respect to the input
/// and every `linear_attn.*` weight, all as f32, by name (`y`, `x`, then the weights').
type Run = Vec<(String, Tensor)>;

/// One test's layer and batch: weights as above, x ~ N(0, 1) (B, T, H) and an upstream
/// gradient that is zero on the rows' padding.
struct Case {
    spec: ModelSpec,
    layout: Layout,
    flat: Tensor,
    x_bth: Tensor,
    dy_bth: Tensor,
}

impl Case {
    /// Drawn from `seed` under a lock: tests run in parallel and share torch's generator.
    fn new(model_type: &str, t: i64, seed: i64) -> Case {
        static RNG: Mutex<()> = Mutex::new(());
        let _draws = RNG.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(seed);
        let spec = spec(model_type);
        let layout = Layout::new(&spec);
        let flat = weights(&layout.blocks[layout.layer_block(0)]);
        let lens: Vec<i64> = LENS.iter().map(|&l| l.min(t)).collect();
        let b = lens.len() as i64;
        let x_bth = Tensor::randn([b, t, HIDDEN], (Kind::Float, Device::Cpu));
        let valid_bt = Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .lt_tensor(&Tensor::from_slice(&lens).unsqueeze(1));
        let dy_bth =
            Tensor::randn([b, t, HIDDEN], (Kind::Float, Device::Cpu)) * valid_bt.unsqueeze(-1);
        Case {
            spec,
            layout,
            flat,
            x_bth,
            dy_bth,
        }
    }

    /// `layer` on the case in `kind` (weights, input and upstream gradient cast to it).
    fn run(&self, kind: Kind, layer: &dyn Fn(&ModelSpec, &BlockWeights, &Tensor) -> Tensor) -> Run {
        let block = &self.layout.blocks[self.layout.layer_block(0)];
        let w = BlockWeights::leaves(&self.flat.to_kind(kind), block);
        let x = self.x_bth.to_kind(kind).detach().set_requires_grad(true);
        // Through a product with ones, whose saved tensor goes with the first backward:
        // as in the model, where the mixer's input comes out of a norm, a second backward
        // into x's graph (the fused conv's, from the tape) must not pass it again.
        let y = layer(&self.spec, &w, &(&x * x.ones_like()));
        (&y * self.dy_bth.to_kind(kind)).sum(Kind::Float).backward();
        // The fused conv's backward (a no-op for the paths without it).
        crate::kernels::tape::backward();
        let mut out = vec![
            ("y".to_string(), y.detach().to_kind(Kind::Float)),
            ("x".to_string(), x.grad().to_kind(Kind::Float)),
        ];
        for t in block
            .tensors
            .iter()
            .filter(|t| t.name.starts_with("linear_attn."))
        {
            out.push((t.name.clone(), w.get(&t.name).grad().to_kind(Kind::Float)));
        }
        out
    }
}

/// The chunked path, with its conv, SiLU and norms and its gated norm as the fused ops
/// (`fused`; on CPU the ops' mirrors, their backward run from the tape) or in tch ops.
fn chunked_with(chunk: i64, fused: bool) -> impl Fn(&ModelSpec, &BlockWeights, &Tensor) -> Tensor {
    move |s, w, x| {
        let pre = chunked::pre(s, w, x, chunk, fused);
        let (o_bvucd, _) = chunked::core(&pre.rule_in, None, false);
        chunked::post(s, w, &o_bvucd, &pre.z_btvd, fused)
    }
}

fn reference_forward(s: &ModelSpec, w: &BlockWeights, x: &Tensor) -> Tensor {
    let pre = reference::pre(s, w, x);
    let (o_bvucd, _) = reference::core(&pre.rule_in, None, false);
    reference::post(s, w, &o_bvucd, &pre.z_btvd)
}

/// Norm-wise relative difference of every tensor of `got` from `want`, by name.
fn rel_diffs(got: &Run, want: &Run) -> Vec<(String, f64)> {
    got.iter()
        .zip(want)
        .map(|((name, g), (_, w))| {
            let diff = (g - w).norm().double_value(&[]);
            (name.clone(), diff / w.norm().double_value(&[]).max(1e-30))
        })
        .collect()
}

fn assert_within(diffs: &[(String, f64)], bound: &dyn Fn(&str) -> f64, what: &str) {
    for (name, d) in diffs {
        let bound = bound(name);
        assert!(
            d.is_finite() && *d <= bound,
            "{what}: {name} differs by {d:.2e} (bound {bound:.0e}); all: {diffs:?}"
        );
    }
}

/// f32: the two paths evaluate the same function and differ only in rounding (unit
/// roundoff 6e-8). The longest chains (64-term dot products, the 64x64 unit-triangular
/// inverse, the state carried across chunks) amplify it ~1e1..1e2: over 36 draws of these
/// inputs the output and the gradients of x and of the value-path weights differed by at
/// most 3e-6, so 1e-5 bounds them. The decay path's gradients (A_log, dt_bias, in_proj_a)
/// are sums over every position and pair of positions of terms spanning many orders of
/// magnitude (exp(gamma_i - gamma_j) for decays up to 20 per token), which cancel ~1e3-fold:
/// measured up to 5.5e-5, bounded by 2e-4. A wrong term moves any of them by 1e-2 or more.
fn f32_bound(name: &str) -> f64 {
    match name {
        "linear_attn.A_log" | "linear_attn.dt_bias" | "linear_attn.in_proj_a.weight" => 2e-4,
        _ => 1e-5,
    }
}

fn f32_case(model_type: &str, t: i64, chunks: &[i64]) {
    let case = Case::new(model_type, t, 0);
    let want = case.run(Kind::Float, &reference_forward);
    for &chunk in chunks {
        for fused in [false, true] {
            let got = case.run(Kind::Float, &chunked_with(chunk, fused));
            let what = format!("{model_type} T={t} chunk {chunk} fused {fused}");
            assert_within(&rel_diffs(&got, &want), &f32_bound, &what);
        }
    }
}

#[test]
fn chunked_equals_reference_qwen3_5_split_projections() {
    // T = 150: three chunks of 64, the last partly padding; 5, 10 chunks of 32, 16.
    f32_case("qwen3_5_text", 150, &[64, 32, 16]);
}

#[test]
fn chunked_equals_reference_qwen3_next_fused_projections() {
    f32_case("qwen3_next", 150, &[64, 16, 128]);
}

#[test]
fn chunked_equals_reference_within_one_chunk() {
    f32_case("qwen3_5_text", 10, &[64]);
    f32_case("qwen3_next", 64, &[64]);
}

/// bf16 against the f32 reference. What bf16 costs here is set by the layer's conditioning
/// at these inputs more than by the unit roundoff (2^-9): through the L2 norms of q and k
/// and the fast-forgetting heads, the input-side gradients of the reference path itself
/// come out ~15% off in bf16 (its rule runs in f32; the projections, conv and norms do
/// not). So the chunked path, which also rounds its matmuls to bf16, is held to the
/// reference path's own bf16 error: at most twice it (one more bit), or 2e-2 where that is
/// tiny (a few roundings of 2^-9). A wrong term moves results by O(1) and still fails.
fn within_reference_error(got: &Run, reference: &Run, want: &Run, what: &str) {
    let (got, reference) = (rel_diffs(got, want), rel_diffs(reference, want));
    for ((name, g), (_, r)) in got.iter().zip(&reference) {
        let bound = (2.0 * r).max(2e-2);
        assert!(
            g.is_finite() && *g <= bound,
            "{what}: {name} is {g:.2e} off (bound {bound:.2e}, the reference in bf16 {r:.2e})"
        );
    }
}

#[test]
fn chunked_in_bf16_is_as_close_to_f32_as_the_reference() {
    for model_type in ["qwen3_5_text", "qwen3_next"] {
        let case = Case::new(model_type, 100, 1);
        let want = case.run(Kind::Float, &reference_forward);
        let reference16 = case.run(Kind::BFloat16, &reference_forward);
        for fused in [false, true] {
            let chunked16 = case.run(Kind::BFloat16, &chunked_with(chunked::CHUNK, fused));
            let what = format!("{model_type} fused {fused}");
            within_reference_error(&chunked16, &reference16, &want, &what);
        }
    }
}

/// The inverse by blocks against the triangular solve, for matrices like A (|A_ij| <= 1).
#[test]
fn unit_lower_inverse_inverts() {
    for n in [16, 32, 64, 128] {
        // Entries of either sign up to 1/2, as A's (|beta k_i.k_j decay| <= 1) but denser.
        let a = Tensor::linspace(-0.5, 0.5, 3 * n * n, (Kind::Double, Device::Cpu))
            .view([3, n, n])
            .sin()
            * 0.5;
        let l = a.tril(-1) + Tensor::eye(n, (Kind::Double, Device::Cpu));
        let want = l.linalg_solve_triangular(
            &Tensor::eye(n, (Kind::Double, Device::Cpu)),
            false,
            true,
            true,
        );
        let got = chunked::unit_lower_inverse(&a);
        let d = (got - &want).norm().double_value(&[]) / want.norm().double_value(&[]);
        assert!(d < 1e-12, "n {n}: {d:e}");
    }
}

/// The inverse whose gradient is written out has the blocked inverse's value, and A's
/// gradient (diagonal and upper part included, which both ignore) is autograd's through the
/// blocked inverse, for any output gradient: f64, A like the rule's (|A_ij| <= 1/2), with
/// junk on and above the diagonal.
#[test]
fn the_inverses_written_gradient_is_autograds() {
    for n in [16, 64, 128] {
        let opts = (Kind::Double, Device::Cpu);
        let a0 = Tensor::linspace(-0.5, 0.5, 3 * n * n, opts)
            .view([3, n, n])
            .sin()
            * 0.5;
        let g = Tensor::linspace(1.0, -2.0, 3 * n * n, opts)
            .view([3, n, n])
            .cos();
        let run = |f: fn(&Tensor) -> Tensor| {
            let a = a0.detach().set_requires_grad(true);
            let t = f(&a);
            (&t * &g).sum(Kind::Double).backward();
            (t.detach(), a.grad())
        };
        let (want_t, want_da) = run(chunked::unit_lower_inverse);
        let (got_t, got_da) = run(chunked::inverse_with_its_gradient);
        let rel = |x: &Tensor, y: &Tensor| {
            (x - y).norm().double_value(&[]) / y.norm().double_value(&[]).max(1e-300)
        };
        assert!(rel(&got_t, &want_t) == 0.0, "n {n}: the values differ");
        // Two f64 products against autograd's sums over the blocks, in another order:
        // 1.5e-16 to 2.4e-16 relative on the build box (AMD EPYC, n 16 to 128). 1e-12
        // leaves four orders for other CPUs' BLAS; a wrong sign or term is O(1).
        let d = rel(&got_da, &want_da);
        assert!(d < 1e-12, "n {n}: dA off by {d:e}");
        let above = got_da.triu(0).abs().max().double_value(&[]);
        assert!(
            above == 0.0,
            "n {n}: dA on or above the diagonal: {above:e}"
        );
    }
}

/// The delta rule from a state: over chunks [0, U) at once, and over segments of them
/// (sizes that do not divide U, one chunk, the rest) each from the state the previous one
/// ended with, give the same output and final state, for both rules.
#[test]
fn core_in_segments_chains_its_state() {
    for model_type in ["qwen3_5_text", "qwen3_next"] {
        // T = 150: chunks of 64 (3, the last padded) for the reference; of 16 (10) chunked.
        let case = Case::new(model_type, 150, 2);
        let block = &case.layout.blocks[case.layout.layer_block(0)];
        let w = BlockWeights::views(&case.flat, block);
        let _guard = tch::no_grad_guard();
        let rules: [(&str, Pre, CoreFn); 2] = [
            (
                "reference",
                reference::pre(&case.spec, &w, &case.x_bth),
                reference::core,
            ),
            (
                "chunked",
                chunked::pre(&case.spec, &w, &case.x_bth, 16, false),
                chunked::core,
            ),
        ];
        for (rule, pre, core) in rules {
            let (o_all, s_all) = core(&pre.rule_in, None, true);
            let s_all = s_all.expect("asked for");
            for split in [vec![1, 2], vec![2, 1], vec![3, 3, 4], vec![1, 4, 5]] {
                if split.iter().sum::<i64>() != pre.chunks() {
                    continue;
                }
                let (mut start, mut state, mut outs) = (0, None::<Tensor>, Vec::new());
                for len in &split {
                    let part: Vec<Tensor> = pre
                        .rule_in
                        .iter()
                        .map(|x| x.narrow(2, start, *len))
                        .collect();
                    let (o, s) = core(&part, state.as_ref(), true);
                    outs.push(o);
                    state = s;
                    start += len;
                }
                let o_seg = Tensor::cat(&outs, 2);
                let state = state.expect("asked for");
                // The same operations on the same values, regrouped: a segment's batched
                // products cover fewer chunks, which may round differently (f32, u = 6e-8,
                // amplified ~1e2 through the state as in `f32_bound`): 1e-5 relative.
                // Chaining without the state (a zero state per segment) is off by O(1).
                let what = format!("{model_type} {rule} segments {split:?}");
                let rel = |a: &Tensor, b: &Tensor| {
                    (a - b).norm().double_value(&[]) / b.norm().double_value(&[])
                };
                let (d_o, d_s) = (rel(&o_seg, &o_all), rel(&state, &s_all));
                eprintln!("{what}: o {d_o:.1e}, state {d_s:.1e}");
                assert!(
                    d_o <= 1e-5 && d_s <= 1e-5,
                    "{what}: o {d_o:.1e}, state {d_s:.1e}"
                );
            }
        }
    }
}

/// One rule's core, as both have it.
type CoreFn = fn(&[Tensor], Option<&Tensor>, bool) -> (Tensor, Option<Tensor>);
