//! W workers with batch b give the same training as one worker accumulating W micro-batches
//! of b, bit for bit in float32: per-step losses and the final weights. The MoE case adds
//! the router load-balancing loss, which is per micro-batch.

mod common;

use common::*;

fn train(
    tag: &str,
    fixture: &str,
    workers: usize,
    accum: usize,
) -> (Vec<f64>, std::collections::HashMap<String, Vec<f32>>) {
    let case = golden_dir().join(fixture);
    let dir = scratch(&format!("equiv-{tag}"));
    let (m, out) = (dir.join("metrics.jsonl"), dir.join("model"));
    run_cpu_ok(
        &case.join("run.yaml"),
        workers,
        &m,
        &[
            "--set",
            &format!("training.gradient_accumulation_steps={accum}"),
            "--set",
            "training.num_steps=4",
            "--set",
            &format!("training.output_dir={}", out.display()),
        ],
    );
    (
        column(&metrics(&m), "loss"),
        tensors(&out.join("model.safetensors")),
    )
}

/// Bit for bit: a CPU worker computes single-threaded (so a micro-batch's gradient does not
/// depend on how many workers share the cores), the host sums the W slabs in the order one
/// worker's accumulation adds them (`((g0 + g1) + g2) + g3`), and the launcher adds the
/// workers' loss sums in rank order, as one worker adds its micro-batches'.
fn assert_same(
    a: &(Vec<f64>, std::collections::HashMap<String, Vec<f32>>),
    b: &(Vec<f64>, std::collections::HashMap<String, Vec<f32>>),
) {
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&a.0),
        bits(&b.0),
        "losses differ: {:?} vs {:?}",
        a.0,
        b.0
    );
    assert_eq!(a.1.len(), b.1.len());
    for (name, wa) in &a.1 {
        let wb = &b.1[name];
        let differ = wa
            .iter()
            .zip(wb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let worst = wa
            .iter()
            .zip(wb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert_eq!(
            differ,
            0,
            "final `{name}`: {differ} of {} elements differ (max |Δ| {worst:.3e})",
            wa.len()
        );
    }
}

#[test]
fn two_workers_equal_one_worker_accumulating_two() {
    assert_same(&train("w2", "llama", 2, 1), &train("w1ga2", "llama", 1, 2));
}

#[test]
fn moe_with_router_aux_loss_two_workers_equal_one_accumulating_two() {
    let fixture = "mixtral_router_aux_loss";
    assert_same(
        &train("moe-w2", fixture, 2, 1),
        &train("moe-w1ga2", fixture, 1, 2),
    );
}

#[test]
fn four_workers_equal_one_worker_accumulating_four() {
    assert_same(&train("w4", "llama", 4, 1), &train("w1ga4", "llama", 1, 4));
}
