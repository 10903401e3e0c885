//! The host-RAM options (`memory.grad_dtype: bfloat16`, `memory.master_weights: split`)
//! train as the fp32 defaults do, within what their rounding allows, and a split master
//! checkpoints and resumes exactly.

mod common;

use std::collections::HashMap;

use common::*;

/// Losses, and the fp32 master of the final checkpoint (`optimizer.safetensors`).
fn train(tag: &str, workers: usize, extra: &[&str]) -> (Vec<f64>, Vec<f32>) {
    let dir = scratch(&format!("hostmem-{tag}"));
    let m = dir.join("metrics.jsonl");
    let ck = dir.join("ck");
    let mut args = vec![
        "--set".to_string(),
        "training.num_steps=4".into(),
        "--set".into(),
        format!("checkpoint.dir={}", ck.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_cpu_ok(&golden_dir().join("llama/run.yaml"), workers, &m, &args);
    let opt: HashMap<String, Vec<f32>> = tensors(&ck.join("step-00000004/optimizer.safetensors"));
    (column(&metrics(&m), "loss"), opt["master"].clone())
}

/// The first forward sees the same weights, so its loss is the same; after that a bf16
/// gradient differs from the fp32 one by at most one rounding, 2^-9 relative per element,
/// which moves each Adam update by about as much relative to its size (lr 3e-3 here), so
/// the loss may differ by far less than 2^-9 over 4 steps: 1e-3 is asserted (measured:
/// 2.2e-6).
#[test]
fn bf16_gradient_tracks_fp32() {
    let (f32_loss, _) = train("g32", 2, &[]);
    let (bf_loss, _) = train("g16", 2, &["--set", "memory.grad_dtype=bfloat16"]);
    assert_eq!(
        bf_loss[0], f32_loss[0],
        "the first forward sees the same weights"
    );
    let e = worst_rel(&bf_loss, &f32_loss);
    assert!(e <= 1e-3, "{bf_loss:?} vs {f32_loss:?} (rel {e:.2e})");
}

/// With fp32 gradients, 2 workers x b track 1 worker x 2 micro-batches of b to 1e-5
/// (equivalence.rs: the workers' batch shapes differ). With a bf16 accumulator the sums
/// also round differently: 2 workers round `g0 + g1` once, one worker rounds `g0`, then
/// `bf16(g0) + g1`. That is one extra rounding (2^-9 relative) per element, bounded as in
/// `bf16_gradient_tracks_fp32`: losses within 1e-3 (measured: 2.4e-5). Adam's m/√v
/// magnifies rounding differences on elements whose gradient is near zero, so the final
/// weights are held to 1e-2 relative L2 (measured: 1.1e-3).
#[test]
fn bf16_gradient_two_workers_track_one_accumulating_two() {
    let bf = ["--set", "memory.grad_dtype=bfloat16"];
    let (w2, m2) = train("g16w2", 2, &bf);
    let accum = [
        &bf[..],
        &["--set", "training.gradient_accumulation_steps=2"],
    ]
    .concat();
    let (w1, m1) = train("g16w1ga2", 1, &accum);
    let e = worst_rel(&w1, &w2);
    assert!(e <= 1e-3, "{w1:?} vs {w2:?} (rel {e:.2e})");
    let d = rel_l2(&m1, &m2);
    assert!(d <= 1e-2, "final master rel L2 {d:.2e}");
}

/// A split master gives the fp32 master's training: the store the workers read is the
/// same bits, so are the losses; the master differs by one ulp only where a value was an
/// exact bf16 tie (then later updates carry that ulp; measured: 8 of 69,632 elements
/// differ after 4 steps, by 1 ulp).
#[test]
fn split_master_trains_as_fp32_master() {
    let bf16 = ["--set", "model.dtype=bfloat16"];
    let (a_loss, a_master) = train("m32", 2, &bf16);
    let split = [&bf16[..], &["--set", "memory.master_weights=split"]].concat();
    let (b_loss, b_master) = train("msplit", 2, &split);
    assert_eq!(b_loss, a_loss);
    let ulps: Vec<u32> = a_master
        .iter()
        .zip(&b_master)
        .map(|(a, b)| a.to_bits().abs_diff(b.to_bits()))
        .collect();
    let differ = ulps.iter().filter(|&&u| u > 0).count();
    assert!(differ <= a_master.len() / 1000, "{differ} elements differ");
    assert!(
        ulps.iter().all(|&u| u <= 2),
        "worst {:?} ulps",
        ulps.iter().max()
    );
}

/// 3 steps, checkpoint (in the background, while training changes the split master), 2 more
/// steps and a final checkpoint (streamed from the live split master); resuming from
/// either reproduces the straight run's losses bit for bit, also with a bf16 gradient.
#[test]
fn split_master_resumes_exactly() {
    let dir = scratch("hostmem-resume");
    let ck = dir.join("ck");
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let run = |tag: &str, steps: u64, extra: &[&str]| {
        let m = dir.join(format!("{tag}.jsonl"));
        let mut args = vec![
            "--set",
            "model.dtype=bfloat16",
            "--set",
            "memory.master_weights=split",
            "--set",
            "memory.grad_dtype=bfloat16",
        ];
        let n = format!("training.num_steps={steps}");
        args.extend(["--set", n.as_str()]);
        args.extend_from_slice(extra);
        run_cpu_ok(&golden_dir().join("llama/run.yaml"), 2, &m, &args);
        column(&metrics(&m), "loss")
    };
    let straight = run("straight", 6, &[]);
    let first = run(
        "first",
        5,
        &["--set", &ck_set, "--set", "checkpoint.every_steps=3"],
    );
    assert_eq!(first, straight[..5]);
    for (step, tag) in [(3, "from3"), (5, "from5")] {
        let from = ck.join(format!("step-{step:08}"));
        let resumed = run(tag, 6, &["--resume", path_str(&from)]);
        assert_eq!(resumed, straight[step..], "resumed from step {step}");
    }
}
