//! Tiling the MLP half of each dense layer (`memory.tile_tokens`, worker/src/layer.rs)
//! changes a step by f32 rounding only: the step-1 loss and every gradient with tiles of
//! 1 token, of sizes that do not divide the micro-batch's B*T tokens, and (packed rows)
//! across sample boundaries equal the untiled run's, for every family (their MLP halves
//! differ: Gemma's and GLM-4's sandwich norms, OLMo 2's post-norms, Phi-3's fused gate-up,
//! Llama 4's feed_forward; DeepSeek-V3 and Llama 4 mix dense layers, which tile, with
//! mixtures of experts, which stay whole; Qwen3.5's dense MLP follows linear attention).
//! A tile of the whole micro-batch, and a model of experts only (GPT-OSS), run untiled: bit
//! for bit the same.
//!
//! Tolerance, derived: tiling changes the rounding, not the math. Per token, the MLP
//! half's GEMMs run over fewer rows (one row: a matrix-vector product), which may order
//! their inner sums differently, so dh, the gradient the MLP half hands the attention half,
//! moves by a few units of f32 rounding (u = 2^-24 = 6e-8) of the values flowing through
//! the layer; and each weight gradient sums its n <= 90 tokens per tile then across tiles
//! instead of in one GEMM, which moves it by about sqrt(n) u ~ 6e-7 of the magnitude of its
//! terms (rounding errors of random sign; (n - 1) u at worst). Both are relative to the
//! magnitudes of the layer's gradients, not to each tensor's own: a gradient that nearly
//! cancels (a key bias, whose softmax gradient sums to about zero over the keys; Qwen3.5's
//! A_log) keeps its terms' rounding however small its sum. So each tensor's error is
//! measured against the gradient norm of its whole layout block (one decoder layer, the
//! embedding, the head): `||g_tiled - g|| <= 1e-6 ||block gradient||`. Measured: at most
//! 7e-7 (Gemma 2, tiles of 1 token), 1e-8 to 3e-7 otherwise. The loss sums no reordered
//! terms (measured bit-identical or 1e-7 relative): 1e-6 relative.

mod common;

use std::path::Path;

use common::*;

const TOL: f64 = 1e-6;

/// Step-1 loss and gradients of golden case `case` with `memory.tile_tokens` = `tile`,
/// plus `extra` flags.
fn step1(case: &str, dir: &Path, tile: &str, extra: &[&str]) -> Step {
    let tile_set = format!("memory.tile_tokens={tile}");
    let args = [&["--set", tile_set.as_str()][..], extra].concat();
    golden_step1(case, dir, &format!("tile-{tile}"), &args, &[]).0
}

/// Tiles of `tiles` tokens against the untiled step: within [`TOL`], and not bit for bit
/// the same (the tiled path ran). The first micro-batch has 4 x 20 = 80 tokens (packed: 3
/// x 30), which neither 7 nor 32 divides.
fn check(case: &str, extra: &[&str], tiles: &[&str]) {
    let dir = scratch(&format!("tiling-{case}-{}", extra.len()));
    let off = step1(case, &dir, "off", extra);
    let mut errors = Vec::new();
    for tile in tiles {
        let tiled = step1(case, &dir, tile, extra);
        let (loss, grads) = block_relative_errors(case, &tiled, &off);
        errors.push(format!(
            "tile {tile}: loss {loss:.1e}, gradients {grads:.1e}"
        ));
        assert!(loss <= TOL && grads <= TOL, "{case}: {}", errors.join("; "));
        assert!(
            !bit_identical(&tiled, &off),
            "{case}: tile {tile} changed nothing: was it run?"
        );
    }
    eprintln!("{case}: {}", errors.join("; "));
}

const TILES: [&str; 3] = ["1", "7", "32"];

#[test]
fn llama_qwen2_mistral_tiles_equal_untiled() {
    for case in ["llama", "qwen2_bias_sliding", "mistral_sliding"] {
        check(case, &[], &TILES);
    }
}

#[test]
fn qwen3_gemma_tiles_equal_untiled() {
    for case in ["qwen3_qk_norm", "gemma2_softcap", "gemma3_text_local_rope"] {
        check(case, &[], &TILES);
    }
}

#[test]
fn olmo2_phi3_glm4_tiles_equal_untiled() {
    for case in [
        "olmo2_post_norm",
        "phi3_fused_longrope",
        "glm4_sandwich_partial_rope",
    ] {
        check(case, &[], &TILES);
    }
}

/// Mixed stacks: the dense layers tile, the experts' stay whole; Qwen3.5's rows are 70
/// tokens (280 in all), and its linear-attention layers keep a state across each row.
#[test]
fn deepseek_v3_llama4_qwen3_5_tile_their_dense_layers() {
    for case in [
        "deepseek_v3_mla_yarn",
        "llama4_text_chunked_nope",
        "qwen3_5_text_long_chunks",
    ] {
        check(case, &[], &["7", "32"]);
    }
}

/// GPT-OSS has no dense layer, and a tile of the whole micro-batch is no tile (nor is
/// `auto` on 80 tokens): the step is the untiled one, bit for bit.
#[test]
fn experts_only_and_whole_batch_tiles_are_untiled() {
    let dir = scratch("tiling-whole");
    for (case, tiles) in [
        ("gpt_oss_sinks_clamp", &["7"][..]),
        ("llama", &["80", "auto"]),
    ] {
        let off = step1(case, &dir, "off", &[]);
        for tile in tiles {
            let tiled = step1(case, &dir, tile, &[]);
            assert!(bit_identical(&tiled, &off), "{case}: tile {tile}");
        }
    }
}

/// Packed rows (positions restarting per sample, attention kept inside each sample, as
/// packing.rs checks): 8 samples of 5..=15 tokens in 3 rows of 30; tiles of 7 and 32 cut
/// across samples and rows.
#[test]
fn packed_rows_tiles_equal_untiled() {
    for case in ["llama", "qwen3_qk_norm", "gemma3_text_local_rope"] {
        let dir = scratch(&format!("tiling-packed-{case}"));
        let samples = dir.join("samples.jsonl");
        write_samples(&samples, &SHORT_SAMPLES);
        let data = format!("dataset.path={}", samples.display());
        let extra = [
            "--set",
            &data,
            "--set",
            "dataset.max_seq_len=30",
            "--set",
            "dataset.packing=true",
            "--set",
            "training.batch_size=3",
        ];
        check(case, &extra, &["1", "7", "32"]);
    }
}
