//! Vision-language training end to end (#49): a tiny Qwen2.5-VL built with the hub classes,
//! trained one step by mt-launch on LlamaFactory-format multimodal records (PNG, JPEG and
//! lossless WebP images, one and two per row, multi-turn, a text-only row), read, tokenized,
//! decoded and resized by it, the frozen vision tower run in the workers, against the same
//! step in transformers + torch (scripts/make_vlm_golden.py, in the data fixtures).
//!
//! Tolerance: 1e-4 relative, f32 on both sides; what differs is summation order (the
//! tower's patch embedding as a matmul, its windows padded into one SDPA call, the
//! language model's chunked loss), about sqrt(K) x 2^-24 for sums of K <= ~1e3 terms, two
//! orders below the bound, while a misplaced image feature or a wrong 3-D position moves
//! the loss and every gradient by O(1e-2) or more.

mod common;

use common::*;

const TOL: f64 = 1e-4;

#[test]
fn qwen2_5_vl_with_images_matches_transformers() {
    let dir = data_fixtures("vlm/golden/expected.json").join("vlm/golden");
    let expected = json(&dir.join("expected.json"));
    let torch_grads = tensors(&dir.join("grads0.safetensors"));
    let mut failures = Vec::new();
    for workers in [1, 2] {
        let s = scratch(&format!("vlm-golden-{workers}"));
        let (m, g) = (s.join("metrics.jsonl"), s.join("grads.safetensors"));
        let out = run_cpu_ok(
            &dir.join("run.yaml"),
            workers,
            &m,
            &["--dump-grads", path_str(&g)],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("vision tower:"), "{stdout}");
        let rows = metrics(&m);
        let mut worst = 0.0f64;
        for (key, want) in [("loss", "loss"), ("grad_norm", "grad_norm")] {
            let (ours, torch) = (column(&rows, key)[0], expected[want].as_f64().unwrap());
            let e = worst_rel(&[ours], &[torch]);
            worst = worst.max(e);
            if e > TOL {
                failures.push(format!(
                    "{workers}w {key}: {ours} vs torch {torch} (rel {e:.2e})"
                ));
            }
        }
        let ours = tensors(&g);
        // Every trained tensor is the language model's; the frozen tower has no gradient.
        let mut names: Vec<_> = ours.keys().cloned().collect();
        names.sort();
        let mut theirs: Vec<_> = torch_grads.keys().cloned().collect();
        theirs.sort();
        assert_eq!(names, theirs, "the trained tensors");
        for (name, t) in &torch_grads {
            let e = rel_l2(&ours[name], t);
            worst = worst.max(e);
            if e > TOL {
                failures.push(format!("{workers}w grad {name}: rel {e:.2e}"));
            }
        }
        eprintln!("vlm golden, {workers} workers: worst relative error {worst:.1e}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
