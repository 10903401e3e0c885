//! Comparing what two runs produced: bits of losses and weights, and step-1 gradients in
//! units of their layout block's gradient norm.

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use mt::config::hf::ModelSpec;
use mt::layout::Layout;

use super::*;

/// Tensors by name, as [`tensors`] reads them.
pub type Tensors = HashMap<String, Vec<f32>>;

/// Step-1 loss and gradients by tensor name.
pub type Step = (f64, Tensors);

/// The bit patterns of `v`, for exact comparisons that print the values on failure.
pub fn f64_bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// How many elements of `a` and `b` differ in their bits.
pub fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// Every tensor of `a` equals `b`'s of the same name bit for bit (a tensor `b` lacks
/// panics); `what` starts the failure message. Tensor counts are the caller's to check.
pub fn assert_same_bits(a: &Tensors, b: &Tensors, what: &str) {
    for (name, ta) in a {
        let differ = differing_bits(ta, &b[name]);
        assert_eq!(differ, 0, "{what}final `{name}`: {differ} elements differ");
    }
}

/// Runs golden case `case` for one step on one CPU worker with `args` and `env`, its
/// metrics and gradients written to `<dir>/<tag>.jsonl` and `<dir>/<tag>.safetensors`;
/// it must succeed. Returns the step's loss and gradients, and mt-launch's output.
pub fn golden_step1(
    case: &str,
    dir: &Path,
    tag: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Step, Output) {
    let (m, g) = (
        dir.join(format!("{tag}.jsonl")),
        dir.join(format!("{tag}.safetensors")),
    );
    let mut argv = vec![
        "--set",
        "training.num_steps=1",
        "--dump-grads",
        path_str(&g),
    ];
    argv.extend(args);
    let config = golden_dir().join(case).join("run.yaml");
    let out = run_cpu_env_ok(&config, 1, &m, &argv, env);
    ((column(&metrics(&m), "loss")[0], tensors(&g)), out)
}

/// The loss's relative error of `a` against `b`, and the worst gradient error, each
/// tensor's ‖a − b‖ against the gradient norm of its layout block in `b` (one decoder
/// layer, the embedding, the head) of golden case `case`: a gradient that nearly cancels
/// keeps the rounding of its terms however small its sum, so its own norm is no scale.
pub fn block_relative_errors(case: &str, a: &Step, b: &Step) -> (f64, f64) {
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

/// The loss and every gradient of `a` and `b` are the same bits.
pub fn bit_identical(a: &Step, b: &Step) -> bool {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    a.0.to_bits() == b.0.to_bits()
        && a.1.len() == b.1.len()
        && a.1.iter().all(|(n, g)| bits(g) == bits(&b.1[n]))
}
