//! The low-precision host modes end to end on the tiny demo (configs/tiny.yaml, short rows
//! so that bf16 on CPU stays quick): 12 bytes per parameter (`memory.master_weights:
//! bfloat16`, with a bf16 store and gradient) and 10 (`master_weights: split`,
//! `moments_dtype: bfloat16`). Their stochastic rounding takes its bits from
//! (training.seed, update, element), so a run is reproducible bit for bit, does not depend
//! on how the batch is split over workers, and a resumed run continues exactly; checkpoints
//! hold the bf16 values widened exactly.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::*;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny.yaml")
}

/// The 12 B/param mode on the tiny demo for `steps` steps: rows of at most 32 tokens, 4 per
/// step, the held-out rows evaluated once at the end.
fn mode(steps: u64) -> Vec<String> {
    [
        "model.dtype=bfloat16",
        "memory.grad_dtype=bfloat16",
        "memory.master_weights=bfloat16",
        "dataset.max_seq_len=32",
        "training.batch_size=4",
        "training.eval_steps=1000",
        &format!("training.num_steps={steps}"),
    ]
    .iter()
    .flat_map(|kv| ["--set".to_string(), kv.to_string()])
    .collect()
}

/// A run's losses (their bits) and the master and moments of its final checkpoint.
struct Run {
    loss: Vec<u64>,
    master: Vec<f32>,
    moments: [Vec<f32>; 2],
    stdout: String,
}

fn train(dir: &Path, tag: &str, workers: usize, steps: u64, extra: &[&str]) -> Run {
    let m = dir.join(format!("{tag}.jsonl"));
    let ck = dir.join(format!("ck-{tag}"));
    let ck_set = format!("checkpoint.dir={}", ck.display());
    let mut args = mode(steps);
    args.extend(["--set".into(), ck_set]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (out, all) = run_cpu(&tiny(), workers, &m, &args);
    assert_ok(&out, &all.iter().map(String::as_str).collect::<Vec<_>>());
    let last = ck.join(format!("step-{steps:08}/optimizer.safetensors"));
    let opt: HashMap<String, Vec<f32>> = tensors(&last);
    Run {
        loss: column(&metrics(&m), "loss")
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        master: opt["master"].clone(),
        moments: [opt["exp_avg"].clone(), opt["exp_avg_sq"].clone()],
        stdout: String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr),
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}

/// Two runs give the same bits; the checkpointed master is the store widened (every value
/// a bf16: low half zero); the first loss is the fp32-master run's (both start from the
/// same init rounded to bf16). That the rounding is stochastic and seeded is checked by
/// `optim::adamw`'s unit tests.
#[test]
fn bf16_master_runs_are_reproducible() {
    let dir = scratch("bf16master-repro");
    let a = train(&dir, "a", 2, 3, &[]);
    let b = train(&dir, "b", 2, 3, &[]);
    assert_eq!(a.loss, b.loss);
    assert!(bits(&a.master) == bits(&b.master), "final masters differ");
    assert!(
        a.stdout
            .contains("0.00 GB (bfloat16: the store is the master)")
    );
    let wide = a
        .master
        .iter()
        .filter(|x| x.to_bits() & 0xffff != 0)
        .count();
    assert_eq!(wide, 0, "master values that are not bf16");
    let f32_master = train(
        &dir,
        "f32",
        2,
        3,
        &["--set", "memory.master_weights=float32"],
    );
    assert_eq!(a.loss[0], f32_master.loss[0], "the same initial weights");
}

/// W workers equal one worker accumulating W micro-batches bit for bit, the stochastic
/// rounding included (its bits follow the element, not the thread or task). Checked with
/// an fp32 gradient accumulator: a bf16 one rounds the sum of W slabs once but one
/// worker's running sum at every micro-batch (host_memory.rs), which no master mode
/// changes.
#[test]
fn bf16_master_two_workers_equal_one_accumulating_two() {
    let dir = scratch("bf16master-equiv");
    let f32_grad = ["--set", "memory.grad_dtype=float32"];
    let w2 = train(&dir, "w2", 2, 3, &f32_grad);
    let accum = [
        &f32_grad[..],
        &["--set", "training.gradient_accumulation_steps=2"],
    ]
    .concat();
    let w1 = train(&dir, "w1", 1, 3, &accum);
    assert_eq!(w1.loss, w2.loss);
    assert!(bits(&w1.master) == bits(&w2.master), "final masters differ");
}

/// 3 steps, a checkpoint (in the background, while training changes the store), 2 more
/// and a final checkpoint (from the live store); resuming from either reproduces the
/// straight run bit for bit, losses and final master. A checkpoint of an fp32-master run
/// resumes too, its master rounded to nearest even, and the log says so.
#[test]
fn bf16_master_resumes_exactly() {
    let dir = scratch("bf16master-resume");
    let straight = train(&dir, "straight", 2, 6, &[]);
    let first = train(&dir, "first", 2, 5, &["--set", "checkpoint.every_steps=3"]);
    assert_eq!(first.loss, straight.loss[..5]);
    for step in [3, 5] {
        let from = dir.join(format!("ck-first/step-{step:08}"));
        let resumed = train(
            &dir,
            &format!("from{step}"),
            2,
            6,
            &["--resume", path_str(&from)],
        );
        assert_eq!(resumed.loss, straight.loss[step..], "from step {step}");
        assert!(
            bits(&resumed.master) == bits(&straight.master),
            "from step {step}"
        );
        assert!(!resumed.stdout.contains("rounded them to nearest even"));
    }
    let f32_flags = ["--set", "memory.master_weights=float32"];
    train(&dir, "f32", 2, 3, &f32_flags);
    let from = dir.join("ck-f32/step-00000003");
    let resumed = train(&dir, "f32to16", 2, 4, &["--resume", path_str(&from)]);
    assert!(
        resumed.stdout.contains("rounded them to nearest even"),
        "{}",
        resumed.stdout
    );
}

/// The 10 B/param mode's settings (after `mode`'s: later `--set`s win).
const BF16_MOMENTS: [&str; 4] = [
    "--set",
    "memory.master_weights=split",
    "--set",
    "memory.moments_dtype=bfloat16",
];

/// bf16 moments: two runs give the same bits, every checkpointed moment is a bf16 value,
/// the plan says so, and the first loss is the fp32-moment run's (the moments play no part
/// before the first update). W workers equal one accumulating W micro-batches bit for bit
/// (an fp32 accumulator, as above). Resuming from a background checkpoint (step 3) or the
/// final one (5) reproduces the straight run, losses, master and moments; a checkpoint with
/// fp32 moments resumes too, rounded, and the log says so.
#[test]
fn bf16_moments_runs_are_reproducible_and_resume_exactly() {
    let dir = scratch("bf16moments");
    let straight = train(&dir, "straight", 2, 6, &BF16_MOMENTS);
    let again = train(&dir, "again", 2, 6, &BF16_MOMENTS);
    assert_eq!(straight.loss, again.loss);
    assert!(bits(&straight.master) == bits(&again.master));
    assert!(
        straight.stdout.contains("bf16 Adam m, v"),
        "{}",
        straight.stdout
    );
    for x in &straight.moments {
        assert!(x.iter().any(|&x| x != 0.0), "moments were written");
        let wide = x.iter().filter(|x| x.to_bits() & 0xffff != 0).count();
        assert_eq!(wide, 0, "moments that are not bf16 values");
    }
    let f32_moments = train(&dir, "f32", 2, 3, &BF16_MOMENTS[..2]);
    assert_eq!(straight.loss[0], f32_moments.loss[0]);

    let f32_grad = ["--set", "memory.grad_dtype=float32"];
    let w2 = train(&dir, "w2", 2, 3, &[&BF16_MOMENTS[..], &f32_grad].concat());
    let accum = ["--set", "training.gradient_accumulation_steps=2"];
    let w1 = train(
        &dir,
        "w1",
        1,
        3,
        &[&BF16_MOMENTS[..], &f32_grad, &accum].concat(),
    );
    assert_eq!(w1.loss, w2.loss);
    assert!(bits(&w1.master) == bits(&w2.master), "final masters differ");
    assert!(
        bits(&w1.moments[1]) == bits(&w2.moments[1]),
        "final v differs"
    );

    let every = ["--set", "checkpoint.every_steps=3"];
    let first = train(&dir, "first", 2, 5, &[&BF16_MOMENTS[..], &every].concat());
    assert_eq!(first.loss, straight.loss[..5]);
    for step in [3, 5] {
        let from = dir.join(format!("ck-first/step-{step:08}"));
        let resume = ["--resume", path_str(&from)];
        let resumed = train(
            &dir,
            &format!("from{step}"),
            2,
            6,
            &[&BF16_MOMENTS[..], &resume].concat(),
        );
        assert_eq!(resumed.loss, straight.loss[step..], "from step {step}");
        assert!(
            bits(&resumed.master) == bits(&straight.master),
            "from step {step}"
        );
        for (a, b) in resumed.moments.iter().zip(&straight.moments) {
            assert!(bits(a) == bits(b), "moments from step {step}");
        }
        assert!(!resumed.stdout.contains("Adam moments are not all bf16"));
    }
    let from = dir.join("ck-f32/step-00000003");
    let resume = ["--resume", path_str(&from)];
    let resumed = train(
        &dir,
        "f32to16",
        2,
        4,
        &[&BF16_MOMENTS[..], &resume].concat(),
    );
    assert!(
        resumed.stdout.contains("Adam moments are not all bf16"),
        "{}",
        resumed.stdout
    );
}
