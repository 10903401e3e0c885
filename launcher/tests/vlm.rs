//! Vision-language training end to end (#49): a tiny Qwen2.5-VL, a tiny Qwen3-VL and a tiny
//! Qwen3.5 built with the hub classes, each trained one step by mt-launch on LlamaFactory-format
//! multimodal
//! records (PNG, JPEG and lossless WebP images, one and two per row, multi-turn, a text-only
//! row), read, tokenized, decoded and resized by it, the frozen vision tower run in the
//! workers, against the same step in transformers + torch (scripts/make_vlm_golden.py, in
//! the data fixtures). Qwen3-VL adds the interleaved mrope, the tower's learned positions and
//! the deepstack features added after the first two of its three layers; Qwen3.5 the hybrid
//! text model (Gated DeltaNet layers, which take no positions, and gated attention layers
//! whose partial RoPE turns under the interleaved mrope) behind Qwen3-VL's tower without
//! deepstack mergers.
//!
//! The same with the projector trained (Qwen2.5-VL's and Qwen3.5's merger, Qwen3-VL's merger
//! and deepstack mergers, Gemma 3's projector, LLaVA-NeXT's projector and newline) and with
//! the tower trained (every family's): their gradients too, and the step's weights against
//! torch's AdamW.
//! And a tiny Gemma 3 (scripts/make_vlm_golden_gemma3.py): its SigLIP tower and projector,
//! the image blocks' bidirectional attention; and a tiny LLaVA-NeXT
//! (scripts/make_vlm_golden_llava_next.py): its CLIP tower over any-resolution tiles, the
//! projector, the unpadding and the newline embedding after each row.
//!
//! Tolerance: 1e-4 relative, f32 on both sides; what differs is summation order (the
//! tower's patch embedding as a matmul, its windows or frames padded into one SDPA call, the
//! language model's chunked loss), about sqrt(K) x 2^-24 for sums of K <= ~1e3 terms, two
//! orders below the bound, while a misplaced image feature or a wrong 3-D position moves
//! the loss and every gradient by O(1e-2) or more. Gated DeltaNet's decay path is held to
//! 1e-3 ([`grad_tol`]); a SigLIP or CLIP key projection's bias, whose gradient is 0 but for
//! rounding, against its weight's ([`key_bias_weight`]).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::*;

const TOL: f64 = 1e-4;

/// The bound of gradient `name`: [`TOL`], but 1e-3 on Gated DeltaNet's decay path (A_log,
/// dt_bias and the projection feeding a), whose terms cancel ~1e3-fold, so that two correct
/// f32 orders of summation (ours, and transformers' chunked torch fallback, whose CPU
/// kernels sum in a CPU-dependent order) differ there by up to several 1e-4
/// (launcher/tests/golden.rs's `grad_tol`, measured on the text cases); a wrong term is
/// O(1e-2).
fn grad_tol(name: &str) -> f64 {
    let decay_path = ["A_log", "dt_bias", "in_proj_a.", "in_proj_ba."]
        .iter()
        .any(|n| name.contains(n));
    if decay_path { 1e-3 } else { TOL }
}

/// Where `name` is the key projection's bias of a SigLIP or CLIP tower's attention
/// (`vision_tower.encoder.layers.0.self_attn.k_proj.bias`): the name of that projection's
/// weight. The bias adds q . b to every logit of a query's row, which the softmax
/// cancels, so its exact gradient is 0 and both sides hold f32 rounding (1e-10 against
/// 1e-4..1e-2 for the weight's on the fixtures): a relative comparison is meaningless.
/// Bound: its norm within 1e-4 of the weight's gradient's, whose terms are the same
/// products weighted by the layer's normed input (O(1)) instead of 1: a cancelled f32 sum
/// of K terms leaves ~sqrt(K) 2^-24 of them (~1e-6 for K ~ 1e3); a bias the softmax did not
/// cancel (added after it, say) would be of the weight's order.
fn key_bias_weight(name: &str) -> Option<String> {
    (name.starts_with("vision_tower.") || name.starts_with("model.vision_tower."))
        .then(|| name.strip_suffix("self_attn.k_proj.bias"))
        .flatten()
        .map(|p| format!("{p}self_attn.k_proj.weight"))
}

#[test]
fn qwen2_5_vl_with_images_matches_transformers() {
    golden_matches("golden");
}

#[test]
fn qwen3_vl_with_images_matches_transformers() {
    golden_matches("golden-qwen3vl");
}

/// Qwen3.5 (`Qwen3_5ForConditionalGeneration`): the tower without deepstack, the features
/// at the image tokens, the 3-D positions through the gated attention layers' partial RoPE
/// (8 pairs under the sections [3, 3, 2]), the Gated DeltaNet layers between them.
#[test]
fn qwen3_5_with_images_matches_transformers() {
    golden_matches("golden-qwen3_5");
}

/// Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`): the same tower, mrope and hybrid
/// layers, each MLP a mixture of 4 experts (2 routed a token) and a gated shared expert; the
/// experts' gradients under the per-expert names transformers saves.
#[test]
fn qwen3_5_moe_with_images_matches_transformers() {
    golden_matches("golden-qwen3_5_moe");
}

/// One step of `vlm/{case}`'s run with 1 and 2 workers against transformers': loss, grad
/// norm and every gradient.
fn golden_matches(case: &str) {
    let dir = data_fixtures(&format!("vlm/{case}/expected.json")).join(format!("vlm/{case}"));
    let failures = golden_step(&dir, &format!("vlm-{case}"), |_, _, _| Vec::new());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Gemma 3 (scripts/make_vlm_golden_gemma3.py): the SigLIP tower and projector in the
/// workers, the features placed after the embedding's scale, and each image's tokens
/// attending to each other both ways in the full and the sliding layers (the window, 12,
/// shorter than an image's 16 tokens). Measured: 1.3e-6. Without the image blocks (a causal
/// mask) the gradients are 13-29% off; with the window applied before the blocks instead of
/// after, 2.2e-3.
#[test]
fn gemma3_with_images_matches_transformers() {
    let dir = data_fixtures("vlm/golden-gemma3/expected.json").join("vlm/golden-gemma3");
    let failures = golden_step(&dir, "vlm-gemma3", |_, _, _| Vec::new());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// LLaVA-NeXT (scripts/make_vlm_golden_llava_next.py): five images of five sizes, each cut
/// into the tiles of the pinpoint it fits best (two to four, plus the whole image), through
/// the CLIP tower and projector in the workers, each image's tiles unpadded to its aspect
/// with `image_newline` after each row, placed at its 114 to 162 image tokens.
#[test]
fn llava_next_with_images_matches_transformers() {
    let dir = data_fixtures("vlm/golden-llava_next/expected.json").join("vlm/golden-llava_next");
    let failures = golden_step(&dir, "vlm-llava_next", |_, _, _| Vec::new());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `vlm.freeze_projector: false` (given as LlamaFactory's `freeze_multi_modal_projector`):
/// the merger's gradients as well, and after the step (weight decay on its matrices, the
/// gradients clipped to half their norm) every trained tensor the export wrote equals
/// torch's AdamW step. Tolerance of the step: at step 1 the update is lr x c g / (c |g| +
/// eps) (c the clip coefficient, <= 1) less lr x wd x w, whose derivative in g is at most
/// lr / eps; so a tensor's weights may differ by lr / eps x (its largest gradient
/// difference, measured here, + c's relative difference, ~1e-6, x its largest gradient),
/// plus a few f32 roundings of the weight.
#[test]
fn qwen2_5_vl_with_the_projector_trained_matches_transformers() {
    trained_step_matches("golden/projector", "vlm-projector");
}

/// `vlm: {freeze_vision_encoder: false, freeze_projector: false}` (MegaTrain's keys): the
/// whole tower trains, its patch embedding and both blocks (block 0 attends within
/// windows, block 1 within each image) recomputed with grad in the embedding's backward;
/// every gradient (the tower's 30 tensors and the language model's) and the AdamW step as
/// above. Measured: 2.1e-6 (the worst of the loss, the norm and every gradient), the step
/// within 0.18 of its bound. Shown failing: with the blocks' backward skipped (the patch
/// embedding's and the blocks' leaves keep no gradient) each of their gradients is off by
/// 1.0 and the step by 5.7 x its bound; with block 1 recomputed from block 0's kept input
/// instead of its own, block 1's gradients are 27-51% off and block 0's 4-7%.
#[test]
fn qwen2_5_vl_with_the_tower_trained_matches_transformers() {
    trained_step_matches("golden/tower", "vlm-tower");
}

/// LlamaFactory's `freeze_vision_tower: false` alone: the encoder trains under the frozen
/// merger (from the region), whose recompute passes the gradient on to the blocks.
#[test]
fn qwen2_5_vl_with_the_encoder_trained_matches_transformers() {
    trained_step_matches("golden/encoder", "vlm-encoder");
}

/// The same for Qwen3.5's merger (`model.visual.merger.*`: a LayerNorm with its bias, two
/// Linear layers).
#[test]
fn qwen3_5_with_the_projector_trained_matches_transformers() {
    trained_step_matches("golden-qwen3_5/projector", "vlm-qwen3_5-projector");
}

/// The whole tower of Qwen3-VL trained: its patch embedding (with bias) and learned
/// positions (their bilinear resampling a gather: the gradient lands in the taps' rows),
/// its three blocks (LayerNorm with bias, GELU MLP, attention within each frame), the
/// merger and the deepstack mergers; the tapped blocks' outputs take the deepstack
/// mergers' input gradients beside the next block's.
#[test]
fn qwen3_vl_with_the_tower_trained_matches_transformers() {
    trained_step_matches("golden-qwen3vl/tower", "vlm-qwen3vl-tower");
}

/// Qwen3-VL's encoder (`freeze_vision_tower: false`) under the frozen merger and deepstack
/// mergers: the gradient passes through them into the blocks.
#[test]
fn qwen3_vl_with_the_encoder_trained_matches_transformers() {
    trained_step_matches("golden-qwen3vl/encoder", "vlm-qwen3vl-encoder");
}

/// Qwen3.5's tower (Qwen3-VL's without deepstack) trained whole, and its encoder alone.
#[test]
fn qwen3_5_with_the_tower_trained_matches_transformers() {
    trained_step_matches("golden-qwen3_5/tower", "vlm-qwen3_5-tower");
}

#[test]
fn qwen3_5_with_the_encoder_trained_matches_transformers() {
    trained_step_matches("golden-qwen3_5/encoder", "vlm-qwen3_5-encoder");
}

/// The same for Qwen3-VL: the merger and both deepstack mergers (`deepstack_merger_list.*`)
/// trained over the frozen encoder's kept outputs, the deepstack mergers' gradient gathered
/// from the first two decoder layers' output gradients at the image tokens, where their
/// features are added.
#[test]
fn qwen3_vl_with_the_projector_trained_matches_transformers() {
    trained_step_matches("golden-qwen3vl/projector", "vlm-qwen3vl-projector");
}

/// The same for LLaVA-NeXT (scripts/make_vlm_golden_llava_next.py's projector case): its
/// projector (`multi_modal_projector.*`) and `image_newline` trained, recomputed with grad in
/// the embedding's backward over the frozen tower's kept features: their gradients, the
/// language model's, and every trained tensor after the AdamW step.
#[test]
fn llava_next_with_the_projector_trained_matches_transformers() {
    trained_step_matches("golden-llava_next/projector", "vlm-llava_next-projector");
}

/// The same for Gemma 3 (scripts/make_vlm_golden_gemma3.py's projector case): its projector
/// (`multi_modal_projector.*`: the 2 x 2 average pool, Gemma's RMSNorm with `1 + w`, the
/// projection matrix) trained, recomputed with grad in the embedding's backward over the
/// frozen SigLIP tower's kept output.
#[test]
fn gemma3_with_the_projector_trained_matches_transformers() {
    trained_step_matches("golden-gemma3/projector", "vlm-gemma3-projector");
}

/// Gemma 3's whole tower trained (`vlm: {freeze_vision_encoder: false, freeze_projector:
/// false}`): the SigLIP patch embedding and positions, both encoder layers (recomputed with
/// grad from their kept inputs in the embedding's backward), `post_layernorm` and the
/// projector; every gradient and the AdamW step as above.
#[test]
fn gemma3_with_the_tower_trained_matches_transformers() {
    trained_step_matches("golden-gemma3/tower", "vlm-gemma3-tower");
}

/// LlamaFactory's `freeze_vision_tower: false` alone on Gemma 3: the SigLIP tower trains
/// under the frozen projector (from the region), whose recompute passes the gradient on.
#[test]
fn gemma3_with_the_encoder_trained_matches_transformers() {
    trained_step_matches("golden-gemma3/encoder", "vlm-gemma3-encoder");
}

/// LLaVA-NeXT's whole tower trained: the CLIP embeddings (class, patch, positions),
/// `pre_layrnorm` and the 2 of its 3 layers that run (`vision_feature_layer: -2`), with the
/// projector and the newline. The last layer and `post_layernorm` do not reach the features:
/// transformers leaves their gradients None and torch's AdamW skips them, so they stay
/// frozen here too (carried, not in the trained layout).
#[test]
fn llava_next_with_the_tower_trained_matches_transformers() {
    trained_step_matches("golden-llava_next/tower", "vlm-llava_next-tower");
}

/// LlamaFactory's `freeze_vision_tower: false` alone on LLaVA-NeXT: the CLIP tower under
/// the frozen projector and newline.
#[test]
fn llava_next_with_the_encoder_trained_matches_transformers() {
    trained_step_matches("golden-llava_next/encoder", "vlm-llava_next-encoder");
}

/// One step of `vlm/{case}` (a trained-tower case of the make_vlm_golden scripts: its
/// step1.safetensors holds every trained tensor after torch's AdamW step) with 1 and 2
/// workers: [`golden_step`]'s checks (loss, grad norm and every trained tensor's gradient
/// against transformers'), and the export's trained tensors against torch's step.
fn trained_step_matches(case: &str, tag: &str) {
    let dir = data_fixtures(&format!("vlm/{case}/expected.json")).join(format!("vlm/{case}"));
    let step1 = tensors(&dir.join("step1.safetensors"));
    let torch_grads = tensors(&dir.join("grads0.safetensors"));
    let (lr, eps) = (1e-3, 1e-3);
    let max_abs = |v: &[f32]| v.iter().fold(0.0f64, |m, x| m.max(f64::from(x.abs())));
    let failures = golden_step(&dir, tag, |workers, out, grads| {
        let ours = tensors(&out.join("model.safetensors"));
        let (mut worst, mut bad) = (0.0f64, Vec::new());
        for (name, want) in &step1 {
            let (g, tg) = (&grads[name], &torch_grads[name]);
            let dg = g
                .iter()
                .zip(tg)
                .map(|(a, b)| f64::from((a - b).abs()))
                .fold(0.0, f64::max);
            let tol = lr / eps * (dg + 1e-6 * max_abs(tg))
                + 4.0 * f64::from(f32::EPSILON) * max_abs(want);
            let got = &ours[name];
            let e = got
                .iter()
                .zip(want)
                .map(|(a, b)| f64::from((a - b).abs()))
                .fold(0.0, f64::max);
            worst = worst.max(e / tol);
            if e > tol {
                bad.push(format!(
                    "{workers}w after the step: {name} off by {e:.2e} (bound {tol:.2e})"
                ));
            }
        }
        eprintln!("{tag}, {workers} workers: after the step, worst diff / bound {worst:.2}");
        bad
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The whole tower trained, checkpointed and resumed: 2 steps, a checkpoint, 2 more from
/// it give the losses and gradient norms of 4 straight steps bit for bit (the tower's
/// master weights and moments are the embedding block's, saved and restored with it). A
/// resume with the encoder frozen is refused, naming the recorded setting.
#[test]
fn qwen2_5_vl_with_the_tower_trained_resumes_exactly() {
    tower_trained_resumes_exactly("golden", "vlm-tower-resume");
}

/// The same for Qwen3-VL: the deepstack mergers and the learned positions among the saved
/// tower tensors.
#[test]
fn qwen3_vl_with_the_tower_trained_resumes_exactly() {
    tower_trained_resumes_exactly("golden-qwen3vl", "vlm-qwen3vl-tower-resume");
}

/// [`qwen2_5_vl_with_the_tower_trained_resumes_exactly`]'s run of `vlm/{case}/tower`.
fn tower_trained_resumes_exactly(case: &str, tag: &str) {
    let dir =
        data_fixtures(&format!("vlm/{case}/tower/expected.json")).join(format!("vlm/{case}/tower"));
    let s = scratch(tag);
    let ck = format!("checkpoint.dir={}", s.join("ck").display());
    let run = |tag: &str, extra: &[&str]| {
        let m = s.join(format!("{tag}.jsonl"));
        let mut args = vec!["--set", "training.save_model=false"];
        args.extend(extra);
        let (out, _) = run_cpu(&dir.join("run.yaml"), 1, &m, &args);
        (out, m)
    };
    let (out, straight) = run("straight", &["--set", "training.num_steps=4"]);
    assert_ok(&out, &[]);
    let first = [
        "--set",
        "training.num_steps=2",
        "--set",
        &ck,
        "--set",
        "checkpoint.every_steps=2",
    ];
    let (out, first) = run("first", &first);
    assert_ok(&out, &[]);
    let resume = [
        "--set",
        "training.num_steps=4",
        "--set",
        &ck,
        "--resume",
        "latest",
    ];
    let frozen = [&resume[..], &["--set", "vlm.freeze_vision_encoder=true"]].concat();
    let (out, _) = run("frozen", &frozen);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("vlm.freeze_vision_encoder"),
        "{err}"
    );
    let (out, second) = run("second", &resume);
    assert_ok(&out, &[]);
    assert_eq!(
        metrics(&second)[0]["step"],
        3,
        "the resumed run starts at step 3"
    );
    for key in ["loss", "grad_norm"] {
        let resumed: Vec<f64> = [&first, &second]
            .iter()
            .flat_map(|m| column(&metrics(m), key))
            .collect();
        assert_eq!(resumed, column(&metrics(&straight), key), "{key}");
    }
}

/// Runs `dir/run.yaml` for one step with 1 and 2 workers, its export in a scratch
/// directory handed to `after` (with the worker count and the gradients), and compares the loss, the
/// gradient norm and every gradient with transformers' (`dir`'s expected.json and
/// grads0.safetensors); returns what differs beyond [`TOL`] and what `after` found.
fn golden_step(
    dir: &Path,
    tag: &str,
    after: impl Fn(usize, &Path, &HashMap<String, Vec<f32>>) -> Vec<String>,
) -> Vec<String> {
    let expected = json(&dir.join("expected.json"));
    let torch_grads = tensors(&dir.join("grads0.safetensors"));
    let mut failures = Vec::new();
    for workers in [1, 2] {
        let s = scratch(&format!("{tag}-{workers}"));
        let (m, g) = (s.join("metrics.jsonl"), s.join("grads.safetensors"));
        let out_dir = s.join("out");
        let set = format!("training.output_dir={}", out_dir.display());
        let out = run_cpu_ok(
            &dir.join("run.yaml"),
            workers,
            &m,
            &["--dump-grads", path_str(&g), "--set", &set],
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
        // The trained tensors: the language model's, and the merger's where it trains;
        // the frozen tower has no gradient.
        let mut names: Vec<_> = ours.keys().cloned().collect();
        names.sort();
        let mut theirs: Vec<_> = torch_grads.keys().cloned().collect();
        theirs.sort();
        assert_eq!(names, theirs, "the trained tensors");
        for (name, t) in &torch_grads {
            if let Some(weight) = key_bias_weight(name) {
                // Zero but for rounding on both sides: held against the key weight's.
                let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
                let (e, scale) = (norm(&ours[name]), norm(&torch_grads[&weight]));
                if e > 1e-4 * scale {
                    failures.push(format!(
                        "{workers}w grad {name}: norm {e:.2e}, not ~0 (bound 1e-4 x {scale:.2e}, {weight}'s)"
                    ));
                }
                continue;
            }
            let e = rel_l2(&ours[name], t);
            worst = worst.max(e);
            if e > grad_tol(name) {
                failures.push(format!("{workers}w grad {name}: rel {e:.2e}"));
            }
        }
        eprintln!("{tag}, {workers} workers: worst relative error {worst:.1e}");
        failures.extend(after(workers, &out_dir, &ours));
    }
    failures
}

/// The export of a Qwen2.5-VL run: the trained language model in the wrapper's names, the
/// frozen tower and projector bit for bit (with `vlm.freeze_projector: false`, the tower
/// bit for bit and the projector trained; with `vlm.freeze_vision_encoder: false`, the
/// patch embedding and blocks trained, written back under the tower's names, and the
/// projector bit for bit), the image processor's settings beside the tokenizer;
/// transformers loads it with `AutoModelForImageTextToText` and answers about an image with
/// `generate`.
#[test]
fn qwen2_5_vl_export_loads_in_transformers_and_answers_about_an_image() {
    export_answers(
        "golden",
        "visual.",
        "Qwen2VLProcessor",
        &["frozen", "projector", "encoder"],
    );
}

/// The same for Qwen3-VL (its class's names: `model.language_model.*`, `model.visual.*`),
/// with its tower frozen, its projector (the merger and the deepstack mergers) trained, and
/// its encoder trained.
#[test]
fn qwen3_vl_export_loads_in_transformers_and_answers_about_an_image() {
    export_answers(
        "golden-qwen3vl",
        "model.visual.",
        "Qwen3VLProcessor",
        &["frozen", "projector", "encoder"],
    );
}

/// The same for Qwen3.5 (`Qwen3_5ForConditionalGeneration`, AutoProcessor's Qwen3VLProcessor),
/// with its tower frozen, its projector trained, and its encoder trained.
#[test]
fn qwen3_5_export_loads_in_transformers_and_answers_about_an_image() {
    export_answers(
        "golden-qwen3_5",
        "model.visual.",
        "Qwen3VLProcessor",
        &["frozen", "projector", "encoder"],
    );
}

/// `dir/run.yaml` trained two steps and exported once per mode in `modes` (`frozen`,
/// `projector`: the projector trained as well, `encoder`: the tower's encoder), into
/// `scratch`: each export directory followed by its mode, as the export checks read them.
fn export_modes(dir: &Path, scratch: &Path, modes: &[&str]) -> Vec<String> {
    let mut outs = Vec::new();
    for mode in modes {
        let (encoder, projector) = match *mode {
            "frozen" => (true, true),
            "projector" => (true, false),
            "encoder" => (false, true),
            other => panic!("no export mode `{other}`"),
        };
        let out = two_steps_exported(
            dir,
            scratch,
            &format!("out-{mode}"),
            &[
                &format!("vlm.freeze_vision_encoder={encoder}"),
                &format!("vlm.freeze_projector={projector}"),
            ],
        );
        outs.extend([out.display().to_string(), mode.to_string()]);
    }
    outs
}

/// `dir/run.yaml` trained two steps on one CPU worker with `sets` (`key=value`), its model
/// written to `scratch/name` with the processor's settings beside it: that directory.
fn two_steps_exported(dir: &Path, scratch: &Path, name: &str, sets: &[&str]) -> PathBuf {
    let out = scratch.join(name);
    let output_dir = format!("training.output_dir={}", out.display());
    let mut args = vec!["--set", &output_dir, "--set", "training.num_steps=2"];
    for set in sets {
        args.extend(["--set", set]);
    }
    run_cpu_ok(
        &dir.join("run.yaml"),
        1,
        &scratch.join("metrics.jsonl"),
        &args,
    );
    assert!(out.join("preprocessor_config.json").is_file());
    out
}

/// Trains `vlm/{case}` two steps, exports, and checks the export in transformers: the tower
/// (names under `tower`) bit for bit but for what trains, every other tensor trained,
/// `generate` through the processor class `processor`; once per mode in `modes` (`frozen`,
/// `projector`: the merger trained as well, `encoder`: the patch embedding and the blocks).
fn export_answers(case: &str, tower: &str, processor: &str, modes: &[&str]) {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !py.is_file() {
        eprintln!("SKIPPED: no .venv/bin/python (run scripts/setup.sh)");
        return;
    }
    let dir = data_fixtures(&format!("vlm/{case}/expected.json")).join(format!("vlm/{case}"));
    let s = scratch(&format!("vlm-export-{case}"));
    let outs = export_modes(&dir, &s, modes);
    let check = r#"
import sys, torch, safetensors.torch as st
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_processing_utils import BaseVideoProcessor
src, image, prefix, processor = sys.argv[1:5]
runs = list(zip(sys.argv[5::2], sys.argv[6::2]))
Processor = {"Qwen2VLProcessor": Qwen2VLProcessor, "Qwen3VLProcessor": Qwen3VLProcessor}[processor]
Processor.check_argument_for_proper_class = lambda self, name, arg: type(arg)
for out, mode in runs:
    a, b = st.load_file(src + "/model.safetensors"), st.load_file(out + "/model.safetensors")
    assert sorted(a) == sorted(b), "the export's tensor names differ from the input's"
    merger = lambda k: k.startswith((prefix + "merger.", prefix + "deepstack_merger_list."))
    trains = {"frozen": lambda k: False, "projector": merger, "encoder": lambda k: not merger(k)}[mode]
    tower = [k for k in a if k.startswith(prefix) and not trains(k)]
    assert tower and all(torch.equal(a[k], b[k]) for k in tower), "the frozen tower changed"
    trained = [k for k in a if k not in tower]
    assert mode == "frozen" or any(k.startswith(prefix) for k in trained)
    assert all(not torch.equal(a[k], b[k]) for k in trained), "a trained tensor did not train"
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    proc = Processor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(out), tokenizer=tok,
                     video_processor=BaseVideoProcessor(), chat_template=tok.chat_template)
    msgs = [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>What is this?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    gen = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == enc["input_ids"].shape[1] + 4, gen.shape
    print(f"export ({mode}): {len(tower)} tower tensors bit-exact, {len(trained)} trained; generate gave", gen[0, -4:].tolist())
"#;
    let image = dir.join("../images/a.png");
    let r = std::process::Command::new(&py)
        .args(["-c", check])
        .arg(dir.join("model"))
        .arg(&image)
        .args([tower, processor])
        .args(&outs)
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&r.stdout));
}

/// The export of a Gemma 3 run (two steps: the second's images prefetched): the language
/// model in the wrapper's legacy names (`language_model.model.*`), the SigLIP tower bit for
/// bit, the projector too, or trained with `vlm.freeze_projector: false`; the processor's
/// settings beside the tokenizer. transformers loads it with `AutoModelForImageTextToText`
/// and `AutoProcessor`, and answers about an image with `generate`.
#[test]
fn gemma3_export_loads_in_transformers_and_answers_about_an_image() {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !py.is_file() {
        eprintln!("SKIPPED: no .venv/bin/python (run scripts/setup.sh)");
        return;
    }
    let dir = data_fixtures("vlm/golden-gemma3/expected.json").join("vlm/golden-gemma3");
    let s = scratch("vlm-gemma3-export");
    let outs = export_modes(&dir, &s, &["frozen", "projector", "encoder"]);
    let check = r#"
import sys, torch, safetensors.torch as st
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
src, image = sys.argv[1:3]
for out, mode in zip(sys.argv[3::2], sys.argv[4::2]):
    a, b = st.load_file(src + "/model.safetensors"), st.load_file(out + "/model.safetensors")
    assert sorted(a) == sorted(b), "the export's tensor names differ from the input's"
    projector = [k for k in a if k.startswith("multi_modal_projector.")]
    encoder = [k for k in a if k.startswith("vision_tower.")]
    trains = {"frozen": [], "projector": projector, "encoder": encoder}[mode]
    frozen = [k for k in projector + encoder if k not in trains]
    assert frozen and all(torch.equal(a[k], b[k]) for k in frozen), "the frozen tower changed"
    trained = [k for k in a if k not in frozen]
    assert all(k.startswith("language_model.model.") or k in trains for k in trained), trained
    assert set(trains) <= set(trained)
    assert all(not torch.equal(a[k], b[k]) for k in trained), "a trained tensor did not train"
    tower = frozen
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration", type(model)
    proc = AutoProcessor.from_pretrained(out)
    msgs = [{"role": "user", "content": proc.boi_token + "What is this?"}]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    assert int(enc["token_type_ids"].sum()) == model.config.mm_tokens_per_image
    gen = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # no early EOS
    assert gen.shape[1] == enc["input_ids"].shape[1] + 4, gen.shape
    print(f"export ({mode}): {len(tower)} tower tensors bit-exact, {len(trained)} trained; generate gave", gen[0, -4:].tolist())
"#;
    let r = std::process::Command::new(&py)
        .args(["-c", check])
        .arg(dir.join("model"))
        .arg(dir.join("../images/a.png"))
        .args(&outs)
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&r.stdout));
}

/// The export of a LLaVA-NeXT run (two steps: the second's images prefetched): the language
/// model in the wrapper's legacy names (`language_model.model.*`), the CLIP tower bit for
/// bit, the projector and `image_newline` too, or trained with `vlm.freeze_projector: false`;
/// the processor's settings beside the tokenizer. transformers loads it with
/// `AutoModelForImageTextToText` and `AutoProcessor` (whose image processor is
/// `LlavaNextImageProcessorPil` without torchvision), and answers about an image with
/// `generate`.
#[test]
fn llava_next_export_loads_in_transformers_and_answers_about_an_image() {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !py.is_file() {
        eprintln!("SKIPPED: no .venv/bin/python (run scripts/setup.sh)");
        return;
    }
    let dir = data_fixtures("vlm/golden-llava_next/expected.json").join("vlm/golden-llava_next");
    let s = scratch("vlm-llava_next-export");
    let outs = export_modes(&dir, &s, &["frozen", "projector", "encoder"]);
    let check = r#"
import sys, torch, safetensors.torch as st
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
src, image = sys.argv[1:3]
for out, mode in zip(sys.argv[3::2], sys.argv[4::2]):
    a, b = st.load_file(src + "/model.safetensors"), st.load_file(out + "/model.safetensors")
    assert sorted(a) == sorted(b), "the export's tensor names differ from the input's"
    projector = [k for k in a if k.startswith(("multi_modal_projector.", "image_newline"))]
    assert len(projector) == 5, projector
    # The CLIP layer after the one vision_feature_layer (-2) reads, and post_layernorm, stay.
    encoder = [k for k in a if k.startswith("vision_tower.") and "layers.2." not in k and "post_layernorm" not in k]
    trains = {"frozen": [], "projector": projector, "encoder": encoder}[mode]
    tower = [k for k in a if k.startswith("vision_tower.") or k in projector]
    frozen = [k for k in tower if k not in trains]
    assert frozen and all(torch.equal(a[k], b[k]) for k in frozen), "the frozen tower changed"
    trained = [k for k in a if k not in frozen]
    assert all(k.startswith("language_model.") or k in trains for k in trained), trained
    assert set(trains) <= set(trained)
    assert all(not torch.equal(a[k], b[k]) for k in trained), "a trained tensor did not train"
    tower = frozen
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlavaNextForConditionalGeneration", type(model)
    proc = AutoProcessor.from_pretrained(out)
    assert type(proc.image_processor).__name__ == "LlavaNextImageProcessorPil", type(proc.image_processor)
    msgs = [{"role": "user", "content": "<image>What is this?"}]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = proc(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) > 36
    gen = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # no early EOS
    assert gen.shape[1] == enc["input_ids"].shape[1] + 4, gen.shape
    print(f"export ({mode}): {len(tower)} tower tensors bit-exact, {len(trained)} trained; generate gave", gen[0, -4:].tolist())
"#;
    let r = std::process::Command::new(&py)
        .args(["-c", check])
        .arg(dir.join("model"))
        .arg(dir.join("../images/a.png"))
        .args(&outs)
        .output()
        .unwrap();
    assert!(
        r.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&r.stdout));
}

/// Gemma 3's tower trained from a checkpoint that keeps it under the hub's original
/// `vision_tower.vision_model.` (transformers 5.17 writes `vision_tower.`): the trained
/// tensors' layout names follow the checkpoint's, so the step equals the same step from the
/// golden's names bit for bit (loss and gradient norm), and the export writes the input's
/// names back. Shown failing before the names followed: the load stopped at the first
/// trained tensor, `vision_tower.embeddings.patch_embedding.bias` missing.
#[test]
fn gemma3_tower_trains_under_the_hubs_nested_names() {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !py.is_file() {
        eprintln!("SKIPPED: no .venv/bin/python (run scripts/setup.sh)");
        return;
    }
    let dir = data_fixtures("vlm/golden-gemma3/encoder/expected.json").join("vlm/golden-gemma3");
    let s = scratch("vlm-gemma3-nested");
    let nested = s.join("model");
    std::fs::create_dir_all(&nested).unwrap();
    for f in std::fs::read_dir(dir.join("model")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, nested.join(f.file_name().unwrap())).unwrap();
    }
    let rename = r#"
import sys, safetensors.torch as st
p = sys.argv[1] + "/model.safetensors"
a = st.load_file(p)
st.save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in a.items()}, p,
             metadata={"format": "pt"})
"#;
    let r = std::process::Command::new(&py)
        .args(["-c", rename])
        .arg(&nested)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let mut losses = Vec::new();
    for (tag, model) in [("plain", dir.join("model")), ("nested", nested.clone())] {
        let m = s.join(format!("{tag}.jsonl"));
        let out = s.join(format!("out-{tag}"));
        let (path, output) = (
            format!("model.path={}", model.display()),
            format!("training.output_dir={}", out.display()),
        );
        let set = [
            "--set",
            &path,
            "--set",
            &output,
            "--set",
            "vlm.freeze_vision_encoder=false",
        ];
        run_cpu_ok(&dir.join("run.yaml"), 1, &m, &set);
        let rows = metrics(&m);
        losses.push((column(&rows, "loss"), column(&rows, "grad_norm")));
        let mut names: Vec<String> = tensors(&out.join("model.safetensors"))
            .into_keys()
            .collect();
        let mut input: Vec<String> = tensors(&model.join("model.safetensors"))
            .into_keys()
            .collect();
        names.sort();
        input.sort();
        assert_eq!(names, input, "{tag}: the export's names are the input's");
    }
    assert_eq!(losses[0], losses[1], "plain names (left) against nested");
}

/// LLaVA-NeXT's records with bad images, each refused naming the file, the record's line and
/// the key: more `<image>` tags than images, fewer, a missing file, a file that is not an
/// image; with every record bad the load stops, listing them.
#[test]
fn llava_next_bad_image_records_are_named() {
    let dir = data_fixtures("vlm/golden-llava_next/expected.json").join("vlm/golden-llava_next");
    let s = scratch("vlm-llava_next-bad");
    let data = s.join("data");
    std::fs::create_dir_all(data.join("images")).unwrap();
    std::fs::copy(dir.join("../images/a.png"), data.join("images/a.png")).unwrap();
    std::fs::write(data.join("images/not.png"), b"text").unwrap();
    let turn = |user: &str| {
        format!(
            r#"[{{"role": "user", "content": "{user}"}}, {{"role": "assistant", "content": "ok"}}]"#
        )
    };
    let records = [
        (turn("<image><image>two?"), r#"["images/a.png"]"#),
        (turn("none?"), r#"["images/a.png"]"#),
        (turn("<image>gone?"), r#"["images/gone.png"]"#),
        (turn("<image>text?"), r#"["images/not.png"]"#),
    ];
    let body: Vec<String> = (records.iter())
        .map(|(m, i)| format!(r#"{{"messages": {m}, "images": {i}}}"#))
        .collect();
    std::fs::write(
        data.join("bad.json"),
        format!("[\n{}\n]\n", body.join(",\n")),
    )
    .unwrap();
    std::fs::write(
        data.join("dataset_info.json"),
        r#"{"bad": {"file_name": "bad.json", "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                     "assistant_tag": "assistant"}}}"#,
    )
    .unwrap();
    let yaml = s.join("run.yaml");
    std::fs::write(
        &yaml,
        format!(
            "model: {{path: {}, init: pretrained, dtype: float32}}\n\
             dataset: {{name: bad, dataset_dir: {}, max_seq_len: 1024}}\n\
             training: {{batch_size: 1, num_steps: 1}}\n",
            dir.join("model").display(),
            data.display()
        ),
    )
    .unwrap();
    let (out, _) = run_cpu(&yaml, 1, &s.join("metrics.jsonl"), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "trained: {err}");
    for want in [
        "bad.json",
        "4 skipped",
        "bad.json:2: field `images`: 1 images, but 2 `<image>`",
        "bad.json:3: field `images`: 1 images, but 0 `<image>`",
        "bad.json:4: field `images[0]`: image `images/gone.png` not found",
        "bad.json:5: field `images[0]`: `images/not.png`: not a PNG, JPEG or WebP",
    ] {
        assert!(err.contains(want), "no `{want}` in: {err}");
    }
}

/// The next step's images decoded while a step computes (worker/src/engine/prefetch.rs)
/// give the bits of decoding them when the step starts (`MT_IMAGE_PREFETCH=0`): three
/// steps of the four fixture records (one and two images per row, a text-only row), two
/// workers with two micro-batches of one row each. A prefetch that handed one micro-batch
/// another's pixels would move the loss of the step that reads them.
#[test]
fn prefetched_images_give_the_same_bits() {
    let dir = data_fixtures("vlm/golden/expected.json").join("vlm/golden");
    let steps = [
        "--set",
        "training.num_steps=3",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.gradient_accumulation_steps=2",
    ];
    let mut runs = Vec::new();
    for prefetch in ["1", "0"] {
        let m = scratch(&format!("vlm-prefetch-{prefetch}")).join("metrics.jsonl");
        let env = [("MT_IMAGE_PREFETCH", prefetch)];
        run_cpu_env_ok(&dir.join("run.yaml"), 2, &m, &steps, &env);
        let rows = metrics(&m);
        assert_eq!(rows.len(), 3, "{rows:?}");
        assert!(
            rows.iter().take(2).all(|r| r["images_s"].is_f64()),
            "{rows:?}"
        );
        runs.push((column(&rows, "loss"), column(&rows, "grad_norm")));
    }
    assert_eq!(
        runs[0], runs[1],
        "prefetched (left) against decoded at the step"
    );
}

/// `mt-launch plan` bounds a micro-batch's images by its rows: B rows hold at most B times
/// the image tokens of the row of the data with the most (its images' counts summed, as
/// the processor expanded them: the fixture's AutoProcessor rows count them here), not
/// every token of the micro-batch, the bound where the rows are not read.
#[test]
fn plan_bounds_the_images_by_the_rows() {
    let dir = data_fixtures("vlm/golden/expected.json").join("vlm");
    let image_token = json(&dir.join("golden/model/config.json"))["image_token_id"]
        .as_i64()
        .unwrap();
    let most = std::fs::read_to_string(dir.join("expected_qwen2vl.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = row["input_ids"].as_array().unwrap();
            ids.iter()
                .filter(|i| i.as_i64() == Some(image_token))
                .count() as u64
        })
        .max()
        .unwrap();
    let config = dir.join("golden/run.yaml");
    let args = [
        "plan",
        "--config",
        path_str(&config),
        "--gpus",
        "1",
        "--gpu-memory",
        "141",
        "--json",
    ];
    let out = mt_launch().args(args).output().unwrap();
    assert_ok(&out, &args);
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &plan["device"];
    let (rows, seq) = (d["rows"].as_u64().unwrap(), d["seq_len"].as_u64().unwrap());
    assert!(
        rows * most < rows * seq,
        "a row of images alone: nothing to bound"
    );
    // f32 features of the language model's width, one set (no deepstack).
    let hidden = json(&dir.join("golden/model/config.json"))["text_config"]["hidden_size"]
        .as_u64()
        .unwrap();
    assert_eq!(
        d["fixed"]["image features"].as_u64(),
        Some(rows * most * hidden * 4),
        "{d}"
    );
}
