//! Exported model directories (`training.output_dir` and the HF part of every checkpoint)
//! load in transformers and give the same logits as our model: scripts/check_export.py
//! loads each with AutoModelForCausalLM in float32 and compares with `--dump-logits` of a
//! run from that directory, to 1e-4 over every real position. Covers Llama (sharded into
//! many files, tokenizer files carried over), Qwen3 exported in bfloat16, Gemma 2, GPT-OSS
//! trained from MXFP4 experts and exported in bfloat16 (no `quantization_config`), and every
//! multimodal wrapper (loaded with AutoModelForImageTextToText): their exports keep the
//! input's config.json, tensor names and layout, and every tensor not trained byte for byte.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const TOL: f64 = 1e-4;

fn python() -> Option<PathBuf> {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    py.is_file().then_some(py)
}

/// Trains `case` for its 3 steps with `dtype` and `extra` flags, exporting to `out` and
/// checkpointing under `ck`.
fn train_and_export(case: &str, dir: &Path, dtype: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    let (out, ck) = (dir.join("out"), dir.join("ck"));
    let sets = [
        format!("training.output_dir={}", out.display()),
        format!("checkpoint.dir={}", ck.display()),
        format!("model.dtype={dtype}"),
    ];
    let mut args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    args.extend_from_slice(extra);
    let config = golden_dir().join(case).join("run.yaml");
    run_cpu_ok(&config, 1, &dir.join("train.jsonl"), &args);
    (out, ck.join("step-00000003"))
}

/// Our logits of the first batch of `case`'s data with the weights of `model` (float32).
fn our_logits(case: &str, model: &Path, dir: &Path, tag: &str) -> PathBuf {
    let logits = dir.join(format!("logits-{tag}.safetensors"));
    let set = format!("model.path={}", model.display());
    run_cpu_ok(
        &golden_dir().join(case).join("run.yaml"),
        1,
        &dir.join(format!("{tag}.jsonl")),
        &[
            "--set",
            &set,
            "--set",
            "model.dtype=float32",
            "--set",
            "training.num_steps=1",
            "--dump-logits",
            path_str(&logits),
        ],
    );
    logits
}

fn weight_dtypes(dir: &Path) -> Vec<safetensors::Dtype> {
    let mut dtypes = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors")
            && !p.ends_with("optimizer.safetensors")
        {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            dtypes.extend(st.iter().map(|(_, v)| v.dtype()));
        }
    }
    dtypes.dedup();
    dtypes
}

#[test]
fn exports_load_in_transformers_with_our_logits() {
    let Some(py) = python() else {
        eprintln!(
            "SKIPPED: no .venv/bin/python (run scripts/setup.sh); exports not checked against transformers"
        );
        return;
    };
    let mut cases: Vec<(PathBuf, PathBuf, PathBuf)> = Vec::new();

    // Llama: a source dir with tokenizer files, weights sharded at 20 KB.
    let dir = scratch("export-llama");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let golden_model = golden_dir().join("llama/model");
    for e in std::fs::read_dir(&golden_model).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, src.join(p.file_name().unwrap())).unwrap();
    }
    let tokenizer_files = [
        ("tokenizer_config.json", r#"{"model_max_length": 128}"#),
        ("special_tokens_map.json", r#"{"bos_token": "<s>"}"#),
        ("chat_template.jinja", "{{ messages }}"),
    ];
    for (name, text) in tokenizer_files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let set_src = format!("model.path={}", src.display());
    let (out, ck) = train_and_export(
        "llama",
        &dir,
        "float32",
        &["--set", &set_src, "--set", "checkpoint.max_shard_size=20KB"],
    );
    for export in [&out, &ck] {
        let shards = mt::checkpoint::weight_files(export).unwrap();
        assert!(
            shards.len() > 2 && export.join("model.safetensors.index.json").is_file(),
            "{} is not sharded: {shards:?}",
            export.display()
        );
        for name in [
            "generation_config.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ] {
            assert_eq!(
                std::fs::read(export.join(name)).ok(),
                std::fs::read(src.join(name)).ok(),
                "{name} copied into {}",
                export.display()
            );
        }
    }
    for (tag, export) in [("out", &out), ("ck", &ck)] {
        cases.push((
            export.clone(),
            golden_dir().join("llama/data.jsonl"),
            our_logits("llama", export, &dir, tag),
        ));
    }

    // Qwen3 trained and exported in bfloat16.
    let dir = scratch("export-qwen3");
    let (out, _) = train_and_export("qwen3_qk_norm", &dir, "bfloat16", &[]);
    assert_eq!(weight_dtypes(&out), [safetensors::Dtype::BF16]);
    let cfg = json(&out.join("config.json"));
    assert_eq!(
        cfg["dtype"], "bfloat16",
        "config.json says what the weights are"
    );
    cases.push((
        out.clone(),
        golden_dir().join("qwen3_qk_norm/data.jsonl"),
        our_logits("qwen3_qk_norm", &out, &dir, "out"),
    ));

    // Gemma 2 (soft-caps, (1 + w) norms), float32.
    let dir = scratch("export-gemma2");
    let (out, _) = train_and_export("gemma2_softcap", &dir, "float32", &[]);
    assert_eq!(weight_dtypes(&out), [safetensors::Dtype::F32]);
    cases.push((
        out.clone(),
        golden_dir().join("gemma2_softcap/data.jsonl"),
        our_logits("gemma2_softcap", &out, &dir, "out"),
    ));

    // Multimodal wrappers: the text model trained, the rest carried.
    for (case, dtype) in [
        ("qwen3_5_wrapper", "float32"),
        ("qwen3_5_moe_wrapper", "float32"),
        ("gemma3_wrapper", "bfloat16"),
        ("mistral3_wrapper", "float32"),
        ("mistral3_current_names_untied", "float32"),
        ("llama4_wrapper", "float32"),
    ] {
        let dir = scratch(&format!("export-{case}"));
        let src = golden_dir().join(case).join("model");
        let (out, ck) = train_and_export(
            case,
            &dir,
            dtype,
            &["--set", "checkpoint.max_shard_size=30KB"],
        );
        for export in [&out, &ck] {
            assert_same_hub_layout(&src, export);
        }
        cases.push((
            out.clone(),
            golden_dir().join(case).join("data.jsonl"),
            our_logits(case, &out, &dir, "out"),
        ));
    }
    // GPT-OSS trained from its MXFP4 checkpoint and exported in bfloat16: the experts
    // dequantized, the quantization_config gone.
    let dir = scratch("export-gpt-oss-mxfp4");
    let (out, _) = train_and_export("gpt_oss_mxfp4", &dir, "bfloat16", &[]);
    assert_eq!(weight_dtypes(&out), [safetensors::Dtype::BF16]);
    let source = json(&golden_dir().join("gpt_oss_mxfp4/model/config.json"));
    assert!(source.get("quantization_config").is_some());
    let cfg = json(&out.join("config.json"));
    assert!(cfg.get("quantization_config").is_none(), "{cfg}");
    cases.push((
        out.clone(),
        golden_dir().join("gpt_oss_mxfp4/data.jsonl"),
        our_logits("gpt_oss_mxfp4", &out, &dir, "out"),
    ));

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_export.py");
    let mut cmd = Command::new(py);
    cmd.arg(script).args(["--tol", &TOL.to_string()]);
    for (model, data, logits) in &cases {
        cmd.arg("--case").args([model, data, logits]);
    }
    let out = cmd.output().expect("run check_export.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "check_export.py failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let checked = stdout
        .lines()
        .filter(|l| l.contains("\"ok\": true"))
        .count();
    assert_eq!(checked, cases.len(), "every case reported");
}

/// Every tensor of `dir`'s weight files: name -> (dtype, shape, bytes).
fn all_tensors(dir: &Path) -> HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    let mut all = HashMap::new();
    for file in mt::checkpoint::weight_files(dir).unwrap() {
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, v) in st.iter() {
            all.insert(
                name.to_string(),
                (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
            );
        }
    }
    all
}

/// An export of the wrapper checkpoint `src` has its config.json (bar the dtype), its
/// tensor names and shapes, and every carried tensor byte for byte.
fn assert_same_hub_layout(src: &Path, export: &Path) {
    let strip = |p: &Path| {
        let mut cfg = json(&p.join("config.json"));
        let obj = cfg.as_object_mut().unwrap();
        obj.remove("dtype");
        obj.remove("torch_dtype");
        cfg
    };
    assert_eq!(
        strip(src),
        strip(export),
        "{}: config.json",
        export.display()
    );
    let mut spec = mt::config::hf::ModelSpec::from_model_dir(src).unwrap();
    mt::checkpoint::carried::resolve(src, &mut spec).unwrap();
    let layout = mt::layout::Layout::new(&spec);
    let (before, after) = (all_tensors(src), all_tensors(export));
    let mut names: Vec<&String> = before.keys().collect();
    names.sort();
    let mut exported: Vec<&String> = after.keys().collect();
    exported.sort();
    assert_eq!(names, exported, "{}: tensor names", export.display());
    let mut carried = 0;
    for name in names {
        let ((d0, s0, b0), (d1, s1, b1)) = (&before[name], &after[name]);
        assert_eq!(s0, s1, "{name}: shape");
        if layout.carry.carries(name) {
            assert!(d0 == d1 && b0 == b1, "{name}: not carried byte for byte");
            carried += 1;
        }
    }
    assert!(carried > 0, "{}: nothing carried", src.display());
}
