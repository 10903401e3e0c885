//! The delta rule of Gated DeltaNet layers in sequence segments (worker/src/segments.rs):
//! in a tiled micro-batch (`memory.tile_tokens`) each linear-attention layer runs its rule
//! over segments of whole 64-token chunks, carrying the state from one to the next, in the
//! forward and in the backward's recompute. The step-1 loss and every gradient equal the
//! untiled step's (`memory.tile_tokens=off`, the rule over the whole sequence at once) for
//! Qwen3.5 (dense MLPs, which also tile) and Qwen3-Next (a mixture of experts after a
//! linear layer: the rule in segments, the MLP whole), with the reference rule and the
//! chunked one, the latter also with the GPU's fused conv and gated norm (their CPU
//! mirrors: `MT_GATED_DELTA_FUSED=1`) (read once per worker process, so set per run), rows of
//! 300 tokens (not a multiple of 64: the last chunk padded) in segments of one chunk and of
//! two (which do not divide the five chunks), and rows of padding after shorter samples.
//!
//! Tolerance, derived as launcher/tests/tiling.rs's: segments change the rounding, not the
//! math. Each chunk's products are the same, batched over fewer chunks; the state passes
//! the same operations in the same order; what moves is where sums are split: the pre
//! part's weight gradients receive their inputs' gradients assembled segment by segment
//! (one backward instead of one graph), and the MLP tiles of tiling.rs reorder theirs. So
//! each gradient moves by a few units of f32 rounding (2^-24) of its layout block's
//! gradient norm: `||g_seg - g|| <= 1e-6 ||block gradient||`, the loss 1e-6 relative.
//! Measured: see each test's printed worst (with --nocapture).

mod common;

use std::path::Path;

use common::*;

const TOL: f64 = 1e-6;

/// Step-1 loss and gradients of golden case `case` with `memory.tile_tokens` = `tile` and
/// the delta rule `rule`, plus `extra` flags; asserts that the worker said it ran its
/// rule in segments exactly when `segmented`.
fn step1(case: &str, dir: &Path, rule: &str, tile: &str, extra: &[&str], segmented: bool) -> Step {
    let tile_set = format!("memory.tile_tokens={tile}");
    let args = [
        &["--set", tile_set.as_str(), "--log-level", "debug"][..],
        extra,
    ]
    .concat();
    // `chunked-fused`: the chunked rule with the GPU's fused conv and gated norm (their CPU
    // mirrors, backward from the tape).
    let (path, fused) = match rule {
        "chunked-fused" => ("chunked", "1"),
        _ => (rule, "0"),
    };
    let env = [("MT_GATED_DELTA", path), ("MT_GATED_DELTA_FUSED", fused)];
    let (step, out) = golden_step1(case, dir, &format!("{rule}-tile-{tile}"), &args, &env);
    let said = String::from_utf8_lossy(&out.stderr).contains("delta rule in");
    assert_eq!(said, segmented, "{case} {rule} tile {tile}: segmented?");
    step
}

/// Tiles of `tiles` tokens (so segmented linear layers) against the untiled step, for
/// both rules: within [`TOL`].
fn check(case: &str, name: &str, extra: &[&str], tiles: &[&str]) {
    let dir = scratch(&format!("segments-{case}-{name}"));
    let mut errors = Vec::new();
    for rule in ["reference", "chunked", "chunked-fused"] {
        let off = step1(case, &dir, rule, "off", extra, false);
        for tile in tiles {
            let seg = step1(case, &dir, rule, tile, extra, true);
            let (loss, grads) = block_relative_errors(case, &seg, &off);
            errors.push(format!(
                "{rule} tile {tile}: loss {loss:.1e}, gradients {grads:.1e}"
            ));
            assert!(loss <= TOL && grads <= TOL, "{case}: {}", errors.join("; "));
        }
    }
    eprintln!("{case} {name}: {}", errors.join("; "));
}

/// Samples of lengths `lens`, 4 per micro-batch in rows of 300 tokens (their data written
/// to scratch directory `data_dir`), with tiles of `tiles` tokens: see [`check`].
fn rows(case: &str, name: &str, data_dir: &str, lens: &[usize], tiles: &[&str]) {
    let dir = scratch(&format!("{data_dir}-{case}"));
    let samples = dir.join("samples.jsonl");
    write_samples(&samples, lens);
    let data = format!("dataset.path={}", samples.display());
    let extra = [
        "--set",
        &data,
        "--set",
        "dataset.max_seq_len=300",
        "--set",
        "training.batch_size=4",
    ];
    check(case, name, &extra, tiles);
}

/// Rows of 300 tokens, 4 per micro-batch (1200 tokens): tiles of 256 give segments of one
/// chunk (256 / 4 rows = 64 tokens), tiles of 600 of two (150 -> 128 tokens: chunks 2, 2, 1
/// of the rows' five, the last padded).
fn long_rows(case: &str) {
    let lens = [300; 8];
    rows(case, "rows", "segments-data", &lens, &["256", "600"]);
}

/// Padded rows: samples of 77..=300 tokens, 4 per micro-batch, so rows of 300 tokens with
/// 0 to 223 of padding (packing is refused for these models: the state would cross
/// documents); tiles of 256 give segments of one chunk.
fn padded_rows(case: &str) {
    let lens = [300, 77, 190, 251, 140, 300, 99, 205];
    rows(case, "padded", "segments-padded-data", &lens, &["256"]);
}

#[test]
fn qwen3_5_segments_equal_whole_rule() {
    long_rows("qwen3_5_text_long_chunks");
    padded_rows("qwen3_5_text_long_chunks");
}

#[test]
fn qwen3_next_segments_equal_whole_rule() {
    long_rows("qwen3_next_hybrid_moe");
    padded_rows("qwen3_next_hybrid_moe");
}
