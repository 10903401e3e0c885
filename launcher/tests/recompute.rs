//! Layers that keep their MLP activations for the backward (`memory.recompute`,
//! worker/src/layer/kept.rs) change a step by f32 rounding only: the step-1 loss and every
//! gradient with the last layer, and with every layer, keeping them equal the full
//! recompute's, untiled and in tiles of 7 tokens (which do not divide the micro-batch's 80),
//! for the families that keep (Llama, Qwen2 with biases and a sliding window, Qwen3,
//! DeepSeek-V3, whose dense first layer keeps while its experts recompute, and Qwen3.5,
//! whose full-attention layer keeps while its Gated DeltaNet layers recompute, in segments
//! of the rule in the tiled runs). A family that
//! cannot keep (Gemma 2: a norm after the MLP) runs the full recompute, bit for bit. Each
//! run's metrics say how many layers kept (`kept_layers`); on CPU the kept path's hand
//! GEMMs may well give autograd's bits.
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
use mt::config::hf::ModelSpec;

const TOL: f64 = 1e-6;

/// Step-1 loss and gradients of golden case `case` with `memory.recompute` = `recompute`
/// and `memory.tile_tokens` = `tile`, and the layers the step kept (its `kept_layers`).
fn step1(case: &str, dir: &Path, recompute: &str, tile: &str) -> (Step, usize) {
    let args = [
        "--set",
        &format!("memory.recompute={recompute}"),
        "--set",
        &format!("memory.tile_tokens={tile}"),
    ];
    let tag = format!("recompute-{recompute}-{tile}");
    let step = golden_step1(case, dir, &tag, &args, &[]).0;
    let kept = metrics(&dir.join(format!("{tag}.jsonl")))[0]
        .get("kept_layers")
        .map_or(0, |v| v.as_u64().unwrap() as usize);
    (step, kept)
}

/// The layers of golden case `case` whose MLP half can keep (the plan's `keeps_mlp`).
fn keepable(case: &str) -> usize {
    let spec = ModelSpec::from_model_dir(&golden_dir().join(case).join("model")).unwrap();
    (0..spec.num_layers)
        .filter(|&l| mt::plan::keeps_mlp(&spec, l))
        .count()
}

#[test]
fn kept_mlp_activations_equal_the_full_recompute() {
    for case in [
        "llama",
        "qwen2_bias_sliding",
        "qwen3_qk_norm",
        "deepseek_v3_mla_yarn",
        "qwen3_5_text_long_chunks",
    ] {
        let dir = scratch(&format!("recompute-{case}"));
        let can = keepable(case);
        assert!(can >= 1, "{case}: no layer can keep");
        let mut errors = Vec::new();
        for tile in ["off", "7"] {
            let (full, none) = step1(case, &dir, "full", tile);
            assert_eq!(none, 0, "{case}: `full` kept layers");
            // 1: the last layer; 99: every layer that can.
            for (keep, want) in [("1", 1), ("99", can)] {
                let (kept, n) = step1(case, &dir, keep, tile);
                assert_eq!(n, want, "{case}: memory.recompute={keep} kept {n} layers");
                let (loss, grads) = block_relative_errors(case, &kept, &full);
                errors.push(format!(
                    "keep {keep}, tile {tile}: loss {loss:.1e}, gradients {grads:.1e}{}",
                    if bit_identical(&kept, &full) {
                        " (bit for bit)"
                    } else {
                        ""
                    }
                ));
                assert!(loss <= TOL && grads <= TOL, "{case}: {}", errors.join("; "));
            }
        }
        eprintln!("{case}: {}", errors.join("; "));
    }
}

/// A family that cannot keep (Gemma 2: a norm after the MLP) keeps nothing however many
/// layers are asked for, and runs the full recompute, bit for bit.
#[test]
fn a_family_that_cannot_keep_runs_the_full_recompute() {
    let dir = scratch("recompute-gemma2");
    let case = "gemma2_softcap";
    assert_eq!(keepable(case), 0);
    let (full, _) = step1(case, &dir, "full", "off");
    let (all, kept) = step1(case, &dir, "99", "off");
    assert_eq!(kept, 0, "{case}");
    assert!(bit_identical(&all, &full), "{case}");
}
