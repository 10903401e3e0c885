//! W workers with batch b give the same training as one worker accumulating W micro-batches
//! of b (float32, 1e-5 relative): per-step losses and the final weights. The MoE case adds
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

fn assert_same(
    a: &(Vec<f64>, std::collections::HashMap<String, Vec<f32>>),
    b: &(Vec<f64>, std::collections::HashMap<String, Vec<f32>>),
) {
    let e = worst_rel(&a.0, &b.0);
    assert!(
        e <= 1e-5,
        "losses differ: {:?} vs {:?} (rel {e:.2e})",
        a.0,
        b.0
    );
    assert_eq!(a.1.len(), b.1.len());
    for (name, wa) in &a.1 {
        let wb = &b.1[name];
        let scale = wb.iter().fold(0.0f32, |m, x| m.max(x.abs())) as f64;
        let worst = wa
            .iter()
            .zip(wb)
            .map(|(x, y)| (x - y).abs() as f64)
            .fold(0.0, f64::max);
        assert!(
            worst <= 1e-5 * scale,
            "final `{name}` differs: max |Δ| {worst:.3e} vs max |w| {scale:.3e}"
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
