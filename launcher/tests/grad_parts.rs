//! Gradient slab slots hold one decoder layer; the embedding and lm_head gradients, larger
//! than that, travel in parts. On the golden cases whose vocabulary makes them ~3.6 layers
//! large (untied, and tied: the embedding gradient then collects the lm_head's over the
//! whole backward), 2 workers with a single slot each (every part waits for the previous
//! one's reduce) give bit-identical gradients and losses to many slots, and the gradients
//! and losses match PyTorch's; so does one worker accumulating two micro-batches.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use mt::config::hf::ModelSpec;
use mt::layout::Layout;

const TOL: f64 = 1e-4;

/// Step-1 gradients and per-step losses of `case` with `slots` slab slots per worker.
fn train(
    case: &Path,
    dir: &Path,
    workers: usize,
    slots: usize,
    extra: &[&str],
) -> (HashMap<String, Vec<f32>>, Vec<f64>) {
    let tag = format!("w{workers}-s{slots}");
    let (g, m) = (
        dir.join(format!("grads-{tag}.safetensors")),
        dir.join(format!("metrics-{tag}.jsonl")),
    );
    let slots = format!("memory.num_grad_slabs={slots}");
    let mut args = vec!["--dump-grads", path_str(&g), "--set", &slots];
    args.extend(extra);
    run_cpu_ok(&case.join("run.yaml"), workers, &m, &args);
    (tensors(&g), column(&metrics(&m), "loss"))
}

fn assert_identical(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>) {
    assert_eq!(a.len(), b.len());
    for (name, ga) in a {
        let gb = &b[name];
        let same =
            ga.len() == gb.len() && ga.iter().zip(gb).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "gradient `{name}` differs");
    }
}

fn assert_torch(case: &Path, what: &str, (grads, losses): &(HashMap<String, Vec<f32>>, Vec<f64>)) {
    let expected = json(&case.join("expected.json"));
    let e = worst_rel(losses, &f64_array(&expected["losses"]));
    assert!(e <= TOL, "{what}: losses {losses:?} vs torch (rel {e:.2e})");
    let torch = tensors(&case.join("grads0.safetensors"));
    assert_eq!(grads.len(), torch.len(), "{what}");
    for (name, g) in grads {
        let e = rel_l2(g, &torch[name]);
        assert!(e <= TOL, "{what}: gradient `{name}` rel error {e:.2e}");
    }
}

fn check(name: &str, tied: bool) {
    let case = golden_dir().join(name);
    let layout = Layout::new(&ModelSpec::from_model_dir(&case.join("model")).unwrap());
    assert_eq!(layout.tied_embeddings, tied);
    let slot = layout.grad_slot_len();
    let parts = |b| layout.grad_parts(b, slot).len();
    assert!(
        parts(Layout::EMBED) >= 3,
        "the embedding fits in a few slots"
    );
    assert_eq!(parts(layout.head_block()) >= 3, !tied, "lm_head in parts");
    let dir = scratch(&format!("grad-parts-{name}"));
    let one = train(&case, &dir, 2, 1, &[]);
    let many = train(&case, &dir, 2, 16, &[]);
    assert_identical(&one.0, &many.0);
    assert_eq!(one.1, many.1, "losses");
    assert_torch(&case, "2 workers, 1 slot", &one);
    let accum = ["--set", "training.gradient_accumulation_steps=2"];
    assert_torch(
        &case,
        "1 worker x 2 micro-batches, 1 slot",
        &train(&case, &dir, 1, 1, &accum),
    );
}

#[test]
fn embedding_and_lm_head_in_parts_through_one_slot_match_many_slots_and_torch() {
    check("llama_wide_vocab", false);
}

#[test]
fn tied_embedding_in_parts_through_one_slot_matches_many_slots_and_torch() {
    check("llama_wide_vocab_tied", true);
}
