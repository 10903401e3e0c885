//! Layers that keep their MLP activations for the backward (`memory.recompute`,
//! worker/src/layer/kept.rs) change a step by f32 rounding only: the step-1 loss and every
//! gradient with the last layer, and with every layer, keeping them equal the full
//! recompute's, untiled and in tiles of 7 tokens (which do not divide the micro-batch's 80),
//! for the families that keep (Llama, Qwen2 with biases and a sliding window, Qwen3, and
//! DeepSeek-V3, whose dense first layer keeps while its experts recompute). A family that
//! cannot keep (Gemma 2: a norm after the MLP) runs the full recompute, bit for bit.
//! Every run here already skips the down projection's forward in its recompute; the golden
//! tests check that path against transformers.
//!
//! Tolerance, derived as in tiling.rs: the kept path computes the same values with the same
//! ops, except that the gate, up and down projections' weight gradients are summed over a
//! tile's tokens by one GEMM written by hand rather than autograd's, and the gate and up
//! projections' input gradients are added before the norm's backward rather than inside
//! autograd: rounding of a few f32 units (u = 6e-8) of the values flowing through the
//! layer, up to sqrt(n) u for sums over n <= 80 tokens. Measured against each block's
//! gradient norm: `||g_kept - g|| <= 1e-6 ||block gradient||`; the loss 1e-6 relative.

mod common;

use std::path::Path;

use common::*;

const TOL: f64 = 1e-6;

fn step1(case: &str, dir: &Path, recompute: &str, tile: &str) -> Step {
    let args = [
        "--set",
        &format!("memory.recompute={recompute}"),
        "--set",
        &format!("memory.tile_tokens={tile}"),
    ];
    let tag = format!("recompute-{recompute}-{tile}");
    golden_step1(case, dir, &tag, &args, &[]).0
}

#[test]
fn kept_mlp_activations_equal_the_full_recompute() {
    for case in [
        "llama",
        "qwen2_bias_sliding",
        "qwen3_qk_norm",
        "deepseek_v3_mla_yarn",
    ] {
        let dir = scratch(&format!("recompute-{case}"));
        let mut errors = Vec::new();
        for tile in ["off", "7"] {
            let full = step1(case, &dir, "full", tile);
            // 1: the last layer; 99: every layer that can.
            for keep in ["1", "99"] {
                let kept = step1(case, &dir, keep, tile);
                let (loss, grads) = block_relative_errors(case, &kept, &full);
                errors.push(format!(
                    "keep {keep}, tile {tile}: loss {loss:.1e}, gradients {grads:.1e}"
                ));
                assert!(loss <= TOL && grads <= TOL, "{case}: {}", errors.join("; "));
                assert!(
                    !bit_identical(&kept, &full),
                    "{case}: keeping {keep} changed nothing: was it run?"
                );
            }
        }
        eprintln!("{case}: {}", errors.join("; "));
    }
}

#[test]
fn a_family_that_cannot_keep_runs_the_full_recompute() {
    let dir = scratch("recompute-gemma2");
    let case = "gemma2_softcap";
    let full = step1(case, &dir, "full", "off");
    let all = step1(case, &dir, "99", "off");
    assert!(bit_identical(&all, &full), "{case}");
}
