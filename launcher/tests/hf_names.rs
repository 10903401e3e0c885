//! The names HF Trainer and LlamaFactory users type: LlamaFactory's full fine-tuning
//! example (`examples/train_full/llama3_full_sft.yaml`, flat keys) runs unchanged with
//! `mt-launch --config`, only its model and data being local: per-device batch, epochs and
//! warm-up ratio become steps as HF Trainer counts them, `template: llama3` renders the data
//! with the built-in Llama 3 template, and the keys that mean nothing here are named once.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

/// LlamaFactory's example as it ships (model_name_or_path pointing at a local directory,
/// the datasets registered in `data/dataset_info.json` beside it).
const LLAMA3_FULL_SFT: &str = "\
### model
model_name_or_path: model
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: full
deepspeed: examples/deepspeed/ds_z3_config.json  # choices: [ds_z0_config.json, ds_z2_config.json, ds_z3_config.json]

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/full/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 2
learning_rate: 1.0e-5
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
";

/// `n` alpaca records.
fn records(n: usize, what: &str) -> String {
    let recs: Vec<serde_json::Value> = (0..n)
        .map(|i| serde_json::json!({"instruction": format!("{what} {i}?"), "input": "", "output": format!("{i}")}))
        .collect();
    serde_json::to_string(&recs).unwrap()
}

/// The tiny model's tokenizer with Llama 3's chat tokens in place of its ChatML ones (same
/// ids), as the example's model has them: `template: llama3` renders with them. The export's
/// manifest goes (it lists the files as written): a model directory as the hub serves one.
fn llama3_tokens(model: &Path) {
    std::fs::remove_file(model.join(mt::checkpoint::manifest::EXPORT_MARKER)).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        let path = model.join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("<|endoftext|>", "<|end_header_id|>")
            .replace("<|im_start|>", "<|start_header_id|>")
            .replace("<|im_end|>", "<|eot_id|>");
        std::fs::write(&path, text).unwrap();
    }
}

#[test]
fn llamafactory_full_sft_yaml_runs_unchanged() {
    let dir = scratch("hf-names-llamafactory");
    tiny_pretrained(&dir.join("model"));
    llama3_tokens(&dir.join("model"));
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("identity.json"), records(4, "who are you")).unwrap();
    std::fs::write(data.join("alpaca_en_demo.json"), records(16, "count to")).unwrap();
    std::fs::write(
        data.join("dataset_info.json"),
        r#"{"identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}"#,
    )
    .unwrap();
    let config = dir.join("llama3_full_sft.yaml");
    std::fs::write(&config, LLAMA3_FULL_SFT).unwrap();
    let metrics = dir.join("metrics.jsonl");
    let out = Command::new(launcher())
        .args(["--config", path_str(&config), "--gpus", "0"])
        .args(["--metrics-out", path_str(&metrics)])
        .output()
        .unwrap();
    assert_ok(&out, &["--config", "llama3_full_sft.yaml"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // One worker, accumulation 2: a global batch of 2; 20 samples: 10 steps an epoch, 30
    // in 3 epochs; warm-up ceil(0.1 x 30) = 3 steps.
    for said in [
        "batch: 1 per device x 1 worker(s) x 2 accumulation step(s) = 2 sequences per optimizer step",
        "3 epoch(s) of 20 samples at 2 per step: 30 steps (10 per epoch)",
        "warm-up 3 steps (warmup_ratio 0.1 of 30)",
        "note: `deepspeed` is ignored",
        "chat template: the built-in `llama3` (dataset.chat_template) renders the conversations, not the model's own",
    ] {
        assert!(stdout.contains(said), "stdout lacks {said:?}:\n{stdout}");
    }
    let steps = common::metrics(&metrics);
    assert_eq!(steps.len(), 30, "3 epochs of 10 steps");
    let lr: Vec<f64> = steps.iter().map(|m| m["lr"].as_f64().unwrap()).collect();
    // transformers' cosine schedule with 3 warm-up steps: 0, 1/3, 2/3 of the peak, then
    // the peak (1e-5) at the first step after warm-up.
    assert_eq!(lr[0], 0.0);
    assert!(
        (lr[1] - 1e-5 / 3.0).abs() < 1e-18 && (lr[3] - 1e-5).abs() < 1e-18,
        "{lr:?}"
    );
    let model = dir.join("saves/llama3-8b/full/sft");
    assert!(
        model.join("model.safetensors").is_file(),
        "exported to output_dir"
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["dtype"], "bfloat16",
        "bf16: true trains and exports in bf16"
    );
}

#[test]
fn hf_names_in_the_nested_form_and_as_overrides() {
    let dir = scratch("hf-names-nested");
    tiny_pretrained(&dir.join("model"));
    let config = dir.join("run.yaml");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data");
    std::fs::write(
        &config,
        format!(
            "model: {{path: model, dtype: float32}}\n\
             dataset: {{name: alpaca_demo, dataset_dir: {}, cutoff_len: 64, max_samples: 12}}\n\
             training: {{per_device_train_batch_size: 2, max_steps: 4, lr_scheduler_type: linear, save_total_limit: 1}}\n",
            path_str(&data)
        ),
    )
    .unwrap();
    let metrics = dir.join("metrics.jsonl");
    // `--set max_steps=2` overrides the file's `training.max_steps: 4`, under either name.
    let (out, _) = run_cpu(&config, 2, &metrics, &["--set", "max_steps=2"]);
    assert_ok(&out, &["--set", "max_steps=2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("= 4 sequences per optimizer step"),
        "2 per device x 2 workers:\n{stdout}"
    );
    assert!(
        stdout.contains("12 samples"),
        "max_samples took the first 12:\n{stdout}"
    );
    assert_eq!(common::metrics(&metrics).len(), 2);
}

#[test]
fn unknown_names_get_the_nearest_known_name_and_unsupported_ones_say_why() {
    let dir = scratch("hf-names-errors");
    let config = dir.join("run.yaml");
    let fails = |yaml: &str| {
        std::fs::write(&config, yaml).unwrap();
        let out = run(&["--config", path_str(&config), "--gpus", "0", "--dry-run"]);
        assert!(!out.status.success(), "{yaml} was accepted");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let base = "model: {path: m}\ndataset: {path: d.json}\n";
    let e = fails(&format!("{base}training: {{save_step: 5}}\n"));
    assert!(e.contains("checkpoint.every_steps"), "{e}");
    let e = fails(&format!("{base}cutof_len: 5\n"));
    assert!(e.contains("dataset.max_seq_len"), "{e}");
    let e = fails(&format!("{base}finetuning_type: lora\n"));
    assert!(e.contains("finetuning_type") && e.contains("full"), "{e}");
}
