//! The delta rule of Gated DeltaNet layers in sequence segments (worker/src/segments.rs):
//! in a tiled micro-batch (`memory.tile_tokens`) each linear-attention layer runs its rule
//! over segments of whole 64-token chunks, carrying the state from one to the next, in the
//! forward and in the backward's recompute. The step-1 loss and every gradient equal the
//! untiled step's (`memory.tile_tokens=off`, the rule over the whole sequence at once) for
//! Qwen3.5 (dense MLPs, which also tile) and Qwen3-Next (a mixture of experts after a
//! linear layer: the rule in segments, the MLP whole), with the reference rule and the
//! chunked one (`MT_GATED_DELTA`, read once per worker process, so set per run), rows of
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

use std::collections::HashMap;
use std::path::Path;

use common::*;
use mt::config::hf::ModelSpec;
use mt::layout::Layout;

const TOL: f64 = 1e-6;

/// Step-1 loss and gradients by tensor name.
type Step = (f64, HashMap<String, Vec<f32>>);

/// Step-1 loss and gradients of golden case `case` with `memory.tile_tokens` = `tile` and
/// the delta rule `rule`, plus `extra` flags; asserts that the worker said it ran its
/// rule in segments exactly when `segmented`.
fn step1(case: &str, dir: &Path, rule: &str, tile: &str, extra: &[&str], segmented: bool) -> Step {
    let (m, g) = (
        dir.join(format!("{rule}-tile-{tile}.jsonl")),
        dir.join(format!("{rule}-tile-{tile}.safetensors")),
    );
    let tile_set = format!("memory.tile_tokens={tile}");
    let mut args = vec![
        "--set",
        &tile_set,
        "--set",
        "training.num_steps=1",
        "--log-level",
        "debug",
        "--dump-grads",
        path_str(&g),
    ];
    args.extend(extra);
    let config = golden_dir().join(case).join("run.yaml");
    let (out, argv) = run_cpu_env(&config, 1, &m, &args, &[("MT_GATED_DELTA", rule)]);
    assert_ok(&out, &argv.iter().map(String::as_str).collect::<Vec<_>>());
    let said = String::from_utf8_lossy(&out.stderr).contains("delta rule in");
    assert_eq!(said, segmented, "{case} {rule} tile {tile}: segmented?");
    (column(&metrics(&m), "loss")[0], tensors(&g))
}

/// The loss's relative error and the worst gradient error, each tensor's against the
/// gradient norm of its layout block (the module doc's tolerance).
fn worst(case: &str, a: &Step, b: &Step) -> (f64, f64) {
    let spec = ModelSpec::from_model_dir(&golden_dir().join(case).join("model")).unwrap();
    let layout = Layout::new(&spec);
    assert_eq!(a.1.len(), b.1.len());
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let mut grads: f64 = 0.0;
    for block in &layout.blocks {
        let names: Vec<String> = block.tensors.iter().map(|t| block.hf_name(t)).collect();
        let block_norm = names
            .iter()
            .map(|n| norm(&b.1[n]).powi(2))
            .sum::<f64>()
            .sqrt();
        for n in &names {
            let diff: Vec<f32> = a.1[n].iter().zip(&b.1[n]).map(|(x, y)| x - y).collect();
            grads = grads.max(norm(&diff) / block_norm.max(1e-30));
        }
    }
    ((a.0 - b.0).abs() / b.0.abs(), grads)
}

/// Tiles of `tiles` tokens (so segmented linear layers) against the untiled step, for
/// both rules: within [`TOL`].
fn check(case: &str, name: &str, extra: &[&str], tiles: &[&str]) {
    let dir = scratch(&format!("segments-{case}-{name}"));
    let mut errors = Vec::new();
    for rule in ["reference", "chunked"] {
        let off = step1(case, &dir, rule, "off", extra, false);
        for tile in tiles {
            let seg = step1(case, &dir, rule, tile, extra, true);
            let (loss, grads) = worst(case, &seg, &off);
            errors.push(format!(
                "{rule} tile {tile}: loss {loss:.1e}, gradients {grads:.1e}"
            ));
            assert!(loss <= TOL && grads <= TOL, "{case}: {}", errors.join("; "));
        }
    }
    eprintln!("{case} {name}: {}", errors.join("; "));
}

/// Rows of 300 tokens, 4 per micro-batch (1200 tokens): tiles of 256 give segments of one
/// chunk (256 / 4 rows = 64 tokens), tiles of 600 of two (150 -> 128 tokens: chunks 2, 2, 1
/// of the rows' five, the last padded).
fn long_rows(case: &str) {
    let dir = scratch(&format!("segments-data-{case}"));
    let samples = dir.join("samples.jsonl");
    write_samples(&samples, &[300, 300, 300, 300, 300, 300, 300, 300]);
    let data = format!("dataset.path={}", samples.display());
    let extra = [
        "--set",
        &data,
        "--set",
        "dataset.max_seq_len=300",
        "--set",
        "training.batch_size=4",
    ];
    check(case, "rows", &extra, &["256", "600"]);
}

/// Padded rows: samples of 77..=300 tokens, 4 per micro-batch, so rows of 300 tokens with
/// 0 to 223 of padding (packing is refused for these models: the state would cross
/// documents); tiles of 256 give segments of one chunk.
fn padded_rows(case: &str) {
    let dir = scratch(&format!("segments-padded-data-{case}"));
    let samples = dir.join("samples.jsonl");
    write_samples(&samples, &[300, 77, 190, 251, 140, 300, 99, 205]);
    let data = format!("dataset.path={}", samples.display());
    let extra = [
        "--set",
        &data,
        "--set",
        "dataset.max_seq_len=300",
        "--set",
        "training.batch_size=4",
    ];
    check(case, "padded", &extra, &["256"]);
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

/// Samples of lengths `lens` (ids below the fixtures' vocabulary of 67, the first two
/// labels ignored), as tiling.rs writes them.
fn write_samples(path: &Path, lens: &[usize]) {
    let mut text = String::new();
    let mut x: u64 = 12345;
    for &n in lens {
        let ids: Vec<u64> = (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 33) % 67
            })
            .collect();
        let labels: Vec<i64> = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < 2 { -100 } else { t as i64 })
            .collect();
        text += &format!("{{\"input_ids\": {ids:?}, \"labels\": {labels:?}}}\n");
    }
    std::fs::write(path, text).unwrap();
}
