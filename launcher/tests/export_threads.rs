//! The export of a split master (`memory.master_weights: split`) whose blocks are written
//! in several streams each, with more such blocks than rayon has threads, completes: the
//! streams join the master's halves on rayon's pool, which blocks must not hold while they
//! wait for their streams (it hung so at Qwen2.5-7B's shape, 30 blocks on 16 threads).

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn a_split_master_exports_with_more_blocks_than_threads() {
    let dir = scratch("export-threads");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    // 4 layers of 6.3M parameters: each layer block is written in several streams
    // (1M-element parts), and 4 blocks are more than the 2 rayon threads set below.
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let rows: String = (0..2)
        .map(|r| {
            let ids: Vec<u32> = (0..16).map(|i| (i * 7 + r * 3) % 256).collect();
            format!("{}\n", serde_json::json!({ "input_ids": ids }))
        })
        .collect();
    std::fs::write(dir.join("data.jsonl"), rows).unwrap();
    let out = dir.join("out");
    let run = format!(
        "model: {{path: {}, init: random, dtype: bfloat16}}\n\
         dataset: {{format: tokenized, path: {}, shuffle: false}}\n\
         training: {{batch_size: 2, num_steps: 1, learning_rate: 1.0e-3, output_dir: {}}}\n\
         memory: {{master_weights: split, grad_dtype: bfloat16}}\n",
        model.display(),
        dir.join("data.jsonl").display(),
        out.display()
    );
    let config_path = dir.join("run.yaml");
    std::fs::write(&config_path, run).unwrap();
    let mut child = mt_launch()
        .args([
            "--config",
            path_str(&config_path),
            "--gpus",
            "0",
            "--workers",
            "1",
        ])
        .env("RAYON_NUM_THREADS", "2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn mt-launch");
    // A deadlock must fail the test, not hang it: a 1-step run and its export take seconds.
    let deadline = Instant::now() + Duration::from_secs(240);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run and its export did not end within 240 s (deadlocked)");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "the run failed: {status}");
    let weights = out.join("model.safetensors");
    assert!(weights.is_file(), "{} was written", weights.display());
}
