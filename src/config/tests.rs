//! Unit tests of the run config: parsing, validation, overrides, path resolution.

use std::time::Duration;

use super::*;

fn parse(yaml: &str) -> Result<RunConfig> {
    let dir = std::env::temp_dir().join(format!("mt-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // One file per call: tests run in parallel and may parse the same text.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = dir.join(format!("{n}.yaml"));
    std::fs::write(&p, yaml).unwrap();
    RunConfig::load(&p, &[])
}

const OK: &str = "model: {path: m}\ndataset: {format: tokenized, path: d.jsonl}\n";

#[test]
fn checkpoints_are_due_full_or_model_only() {
    use CheckpointContents::{Full, ModelOnly};
    let z = Duration::ZERO;
    let mut ck = CheckpointSection {
        dir: Some("ck".into()),
        every_steps: 10,
        every_minutes: 0,
        ..CheckpointSection::default()
    };
    assert_eq!(ck.due(10, false, z), Some(Full));
    assert_eq!(ck.due(15, false, z), None);
    assert_eq!(ck.due(15, true, z), Some(Full));
    ck.full_state_every_steps = 30;
    assert_eq!(ck.due(10, false, z), Some(ModelOnly));
    assert_eq!(ck.due(30, false, z), Some(Full));
    assert_eq!(ck.due(45, false, z), None);
    assert_eq!(ck.due(45, true, z), Some(Full));
    ck.full_state_every_steps = 0;
    ck.save_optimizer = false;
    assert_eq!(ck.due(10, false, z), Some(ModelOnly));
    assert_eq!(ck.due(11, true, z), Some(ModelOnly));
    assert!(!ck.periodic_full_state());
    ck.dir = None;
    assert_eq!(ck.due(10, true, z), None);
}

/// `every_minutes` makes a checkpoint due at the first boundary once that much training
/// time has passed since the last one, whatever the step; 0 never; a full one unless the
/// optimizer state is not saved.
#[test]
fn checkpoints_are_due_after_every_minutes() {
    use CheckpointContents::{Full, ModelOnly};
    let min = |m: u64| Duration::from_secs(60 * m);
    let mut ck = CheckpointSection {
        dir: Some("ck".into()),
        ..CheckpointSection::default()
    };
    assert_eq!(ck.every_minutes, 30, "the default");
    assert_eq!(ck.due(7, false, min(29)), None);
    assert_eq!(ck.due(7, false, min(30) - Duration::from_millis(1)), None);
    assert_eq!(ck.due(7, false, min(30)), Some(Full));
    assert_eq!(ck.due(7, false, min(95)), Some(Full));
    // Step-based ones are due as before beside it.
    ck.every_steps = 5;
    assert_eq!(ck.due(10, false, min(1)), Some(Full));
    assert_eq!(ck.due(11, false, min(1)), None);
    // Model-only where the optimizer state is not saved.
    ck.save_optimizer = false;
    assert_eq!(ck.due(7, false, min(31)), Some(ModelOnly));
    // 0: off.
    ck.save_optimizer = true;
    ck.every_minutes = 0;
    assert_eq!(ck.due(7, false, min(10_000)), None);
    assert!(!ck.timed_due(min(1)) && ck.periodic());
    // No place to write: nothing, however long.
    ck.every_minutes = 30;
    ck.dir = None;
    assert_eq!(ck.due(7, false, min(60)), None);
}

/// Without `training.output_dir` the model goes to `output/<config stem>/` under the
/// current directory and checkpoints to its `checkpoints/`; an explicit one keeps its
/// resolution against the config's directory; `save_model: false` opts out of both.
#[test]
fn output_and_checkpoint_dirs_default_unless_opted_out() {
    let c = parse(OK).unwrap();
    let out = c.training.output_dir.clone().unwrap();
    let cwd = std::env::current_dir().unwrap();
    assert!(out.starts_with(cwd.join("output")), "{}", out.display());
    assert!(c.training.output_dir_is_default);
    assert_eq!(c.checkpoint.dir, Some(out.join("checkpoints")));
    assert_eq!(c.export_dir(), Some(out.as_path()));
    // The stem of the config file names it.
    let dir = std::env::temp_dir().join(format!("mt-cfg-stem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("my_run.yaml");
    std::fs::write(&p, OK).unwrap();
    let c = RunConfig::load(&p, &[]).unwrap();
    assert_eq!(c.training.output_dir, Some(cwd.join("output/my_run")));

    let c = parse(&format!("{OK}training: {{output_dir: out}}\n")).unwrap();
    let out = c.training.output_dir.clone().unwrap();
    assert!(out.starts_with(std::env::temp_dir()) && out.ends_with("out"));
    assert!(!c.training.output_dir_is_default);
    assert_eq!(c.checkpoint.dir, Some(out.join("checkpoints")));

    let c = parse(&format!("{OK}training: {{save_model: false}}\n")).unwrap();
    assert_eq!((c.training.output_dir, c.checkpoint.dir), (None, None));
    let e = parse(&format!(
        "{OK}training: {{save_model: false}}\ncheckpoint: {{every_steps: 5}}\n"
    ))
    .unwrap_err();
    assert!(e.to_string().contains("checkpoint.dir"), "{e}");
    // Logs only: no model is exported.
    let c = parse(&format!(
        "{OK}training: {{save_model: false, output_dir: o}}\n"
    ))
    .unwrap();
    assert!(c.training.output_dir.is_some() && c.export_dir().is_none());
    assert_eq!(c.checkpoint.dir, None);
}

#[test]
fn minimal_config_gets_defaults_and_resolved_paths() {
    let c = parse(OK).unwrap();
    assert_eq!(c.training.batch_size, 8);
    assert!(c.dataset.shuffle);
    assert_eq!(c.model.dtype, DType::Bfloat16);
    assert!(c.model.path.is_absolute() || c.model.path.starts_with(std::env::temp_dir()));
}

/// A benchmark shape moved into bench/ is still read through its old name, with a note;
/// a name that is in neither place is an error naming the path asked for.
#[test]
fn moved_bench_configs_keep_their_names() {
    let dir = std::env::temp_dir().join(format!("mt-cfg-moved-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("bench")).unwrap();
    std::fs::write(dir.join("bench/shape.yaml"), OK).unwrap();
    let c = RunConfig::load(&dir.join("shape.yaml"), &[]).unwrap();
    assert_eq!(c.model.path, dir.join("bench/m"));
    assert!(
        c.notes[0].contains("shape.yaml is now") && c.notes[0].contains("bench/shape.yaml"),
        "{:?}",
        c.notes
    );
    let e = RunConfig::load(&dir.join("other.yaml"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("other.yaml: no such config file"), "{e}");
    assert!(!e.contains("bench/other.yaml"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_template_is_a_builtin_name_or_a_file_beside_the_config() {
    let dir = std::env::temp_dir().join(format!("mt-cfg-{}", std::process::id()));
    let with = |t: &str| parse(&format!("{OK}template: {t}\n").replace("tokenized", "alpaca"));
    let named = |t: &str| {
        parse(&OK.replace(
            "path: d.jsonl",
            &format!("path: d.jsonl, chat_template: {t}"),
        ))
    };
    let c = with("qwen").unwrap();
    assert_eq!(c.dataset.chat_template.as_deref(), Some(Path::new("qwen")));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("mine.jinja"), "{{ messages[0].content }}").unwrap();
    let c = named("mine.jinja").unwrap();
    assert_eq!(c.dataset.chat_template, Some(dir.join("mine.jinja")));
    for bad in ["missing.jinja", "qwen25"] {
        let e = named(bad).unwrap_err().to_string();
        assert!(
            e.contains("dataset.chat_template") && e.contains(bad) && e.contains("qwen, chatml"),
            "{e}"
        );
    }
}

/// An override of one way of naming a source replaces the other: a model by path or hub
/// id, a dataset by path or registry name, an eval set held out or given.
#[test]
fn an_override_replaces_the_other_way_of_naming_a_source() {
    let dir = std::env::temp_dir().join(format!("mt-cfg-replace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("c.yaml");
    std::fs::write(
        &p,
        "model: {path: m}\ndataset: {name: alpaca_demo, val_size: 0.1}\n",
    )
    .unwrap();
    let sets = [
        "model.name=Qwen/Qwen2.5-7B".to_string(),
        "dataset.path=d.jsonl".into(),
        "dataset.eval_path=e.jsonl".into(),
    ];
    let c = RunConfig::load_for_plan(&p, &sets).unwrap();
    assert_eq!(c.model.name.as_deref(), Some("Qwen/Qwen2.5-7B"));
    assert_eq!(c.dataset.name, None);
    assert_eq!(c.dataset.path, Some(dir.join("d.jsonl")));
    assert_eq!(
        (c.dataset.val_size, c.dataset.eval_path),
        (None, Some(dir.join("e.jsonl")))
    );
    let back = ["dataset.val_size=0.2".to_string(), "model.path=m".into()];
    let c = RunConfig::load(&p, &back).unwrap();
    assert_eq!(c.model.path, dir.join("m"));
    assert!(c.dataset.val_size.is_some() && c.dataset.eval_path.is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_key_is_named_with_its_section() {
    let e = parse(&format!("{OK}training: {{batch_sise: 4}}\n")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("training.batch_sise"), "{msg}");
    assert!(msg.contains("unknown field"), "{msg}");
    assert!(msg.contains("did you mean `batch_size`?"), "{msg}");
    let e = parse(&format!("{OK}optimizer: {{type: adam}}\n")).unwrap_err();
    assert!(e.to_string().contains("did you mean `adamw`?"), "{e}");
}

#[test]
fn megatrain_keys_are_accepted() {
    let c = parse(
        "model: {path: m, attn_implementation: flash_attention_2, trust_remote_code: true, devices: [1, 0]}\n\
         dataset: {name: alpaca_demo, dataset_dir: d, system_prompt: hi, train_on_prompt: true, num_workers: 2}\n\
         optimizer: {type: adamw}\nmemory: {checkpoint_interval: 1, num_grad_slabs: 2}\n",
    )
    .unwrap();
    assert_eq!(c.model.devices, Some(vec![1, 0]));
    assert!(c.dataset.dataset_dir.ends_with("d"));
    let e = parse(&format!("{OK}memory: {{checkpoint_interval: 2}}\n")).unwrap_err();
    assert!(e.to_string().contains("memory.checkpoint_interval"), "{e}");
    let e = parse(&format!("{OK}memory: {{grad_dtype: float16}}\n")).unwrap_err();
    assert!(e.to_string().contains("memory.grad_dtype"), "{e}");
    let e = parse(&format!("{OK}memory: {{master_weights: bf16}}\n")).unwrap_err();
    assert!(e.to_string().contains("memory.master_weights"), "{e}");
    let f32_split = "model: {path: m, dtype: float32}\ndataset: {format: tokenized, path: d.jsonl}\n\
                     memory: {master_weights: split}\n";
    let e = parse(f32_split).unwrap_err();
    assert!(e.to_string().contains("memory.master_weights"), "{e}");
    let c = parse(&format!(
        "{OK}memory: {{grad_dtype: bfloat16, master_weights: split}}\n"
    ))
    .unwrap();
    assert_eq!(c.memory.grad_dtype, DType::Bfloat16);
    assert_eq!(c.memory.master_weights, MasterWeights::Split);
    let f32_bf16 = f32_split.replace("split", "bfloat16");
    let e = parse(&f32_bf16).unwrap_err().to_string();
    assert!(
        e.contains("memory.master_weights") && e.contains("model.dtype"),
        "{e}"
    );
    let c = parse(&format!(
        "{OK}memory: {{grad_dtype: bfloat16, master_weights: bfloat16}}\n"
    ))
    .unwrap();
    assert_eq!(c.memory.master_weights, MasterWeights::Bfloat16);
    assert_eq!(parse(OK).unwrap().memory.grad_dtype, DType::Float32);
    assert_eq!(parse(OK).unwrap().memory.moments_dtype, DType::Float32);
    let e = parse(&format!("{OK}memory: {{moments_dtype: float16}}\n")).unwrap_err();
    assert!(e.to_string().contains("memory.moments_dtype"), "{e}");
    let c = parse(&format!(
        "{OK}memory: {{grad_dtype: bfloat16, master_weights: split, moments_dtype: bfloat16}}\n"
    ))
    .unwrap();
    assert_eq!(c.memory.moments_dtype, DType::Bfloat16);
    // No source: a run refuses it where it reads its data, a server (`mt-launch serve`)
    // takes its batches from its client.
    let c = parse("model: {path: m}\ndataset: {format: alpaca}\n").unwrap();
    let e = c.dataset.require_source().unwrap_err();
    assert!(e.to_string().contains("dataset.path"), "{e}");
}

#[test]
fn wrong_type_is_named() {
    let e = parse(&format!("{OK}training: {{num_steps: many}}\n")).unwrap_err();
    assert!(e.to_string().contains("training.num_steps"), "{e}");
}

#[test]
fn malformed_yaml_says_so() {
    let e = parse("model: {path: [\n").unwrap_err();
    assert!(e.to_string().contains("malformed YAML"), "{e}");
}

#[test]
fn validation_names_key() {
    let e = parse(&format!("{OK}training: {{learning_rate: -1.0}}\n")).unwrap_err();
    assert!(e.to_string().contains("training.learning_rate"), "{e}");
}

#[test]
fn overrides_create_and_type_values() {
    let mut v: Value = serde_yaml_ng::from_str(OK).unwrap();
    apply_override(&mut v, "training.num_steps=3").unwrap();
    apply_override(&mut v, "optimizer.eps=1e-6").unwrap();
    let c: RunConfig = serde_yaml_ng::from_value(v).unwrap();
    assert_eq!(c.training.num_steps, 3);
    assert_eq!(c.optimizer.eps, 1e-6);
    assert!(apply_override(&mut Value::Null, "nokey").is_err());
}

#[test]
fn batch_must_divide() {
    let c = parse(OK).unwrap();
    assert!(c.validate_world(3).is_err());
    assert!(c.validate_world(4).is_ok());
}

#[test]
fn stage_defaults_to_sft_and_refuses_unknown_ones() {
    assert_eq!(parse(OK).unwrap().training.stage, Stage::Sft);
    let c = parse(&format!("{OK}training: {{stage: pt}}\n")).unwrap();
    assert_eq!(c.training.stage, Stage::Pt);
    let e = parse(&format!("{OK}training: {{stage: rm}}\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("training.stage") && e.contains("`pt`, `sft`, `dpo`"),
        "{e}"
    );
}

#[test]
fn grpo_settings_default_to_trl_and_name_bad_values() {
    let grpo = |extra: &str| parse(&format!("{OK}training: {{stage: grpo}}\n{extra}\n"));
    let p = grpo("").unwrap().grpo_params().unwrap();
    assert_eq!(
        p,
        GrpoParams {
            loss: GrpoLoss::Dapo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            num_iterations: 1,
            scale_rewards: ScaleRewards::Group,
            max_completion_length: 256,
            beta: 0.0,
        }
    );
    let p = grpo("grpo: {beta: 0.04}").unwrap().grpo_params().unwrap();
    assert_eq!(p.beta, 0.04);
    let p = grpo("grpo: {loss_type: dr_grpo, epsilon: 0.1, epsilon_high: 0.28, num_iterations: 2, scale_rewards: none}")
        .unwrap()
        .grpo_params()
        .unwrap();
    assert_eq!(
        (
            p.loss,
            p.epsilon_low,
            p.epsilon_high,
            p.num_iterations,
            p.scale_rewards
        ),
        (GrpoLoss::DrGrpo, 0.1, 0.28, 2, ScaleRewards::None)
    );
    for (yaml, key, why) in [
        ("grpo: {beta: -0.04}", "grpo.beta", "finite number >= 0"),
        ("grpo: {beta: .nan}", "grpo.beta", "finite number >= 0"),
        ("grpo: {num_iterations: 0}", "grpo.num_iterations", ">= 1"),
        ("grpo: {epsilon: -1}", "grpo.epsilon", ">= 0"),
        (
            "grpo: {loss_type: bnpo}",
            "grpo.loss_type",
            "unknown variant",
        ),
        ("dpo: {beta: 0.1}", "dpo.beta", "training.stage: dpo"),
    ] {
        let e = grpo(yaml).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains(why), "{yaml}: {e}");
    }
    // Eval rollouts: whole groups held out, or a rollouts file; not a registry name.
    let rollouts = |ds: &str| {
        parse(&format!(
            "model: {{path: m}}\ndataset: {{path: r.jsonl, {ds}}}\ntraining: {{stage: grpo, eval_steps: 2}}\n"
        ))
    };
    rollouts("val_size: 2").unwrap();
    rollouts("eval_path: e.jsonl").unwrap();
    let e = rollouts("eval_name: e").unwrap_err().to_string();
    assert!(
        e.contains("dataset.eval_name") && e.contains("dataset.eval_path"),
        "{e}"
    );
    let e = parse(&format!("{OK}grpo: {{epsilon: 0.3}}\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("grpo.epsilon") && e.contains("applies to training.stage: grpo"),
        "{e}"
    );
}

#[test]
fn tile_tokens_is_auto_off_or_a_count_and_bad_values_name_the_key() {
    assert_eq!(parse(OK).unwrap().memory.tile_tokens, TileTokens::Auto);
    for (yaml, want) in [
        ("0", TileTokens::Auto),
        ("auto", TileTokens::Auto),
        ("off", TileTokens::Off),
        ("8192", TileTokens::Tokens(8192)),
    ] {
        let c = parse(&format!("{OK}memory: {{tile_tokens: {yaml}}}\n")).unwrap();
        assert_eq!(c.memory.tile_tokens, want, "{yaml}");
    }
    for bad in ["-1", "1.5", "true", "fast", "'4k'"] {
        let e = parse(&format!("{OK}memory: {{tile_tokens: {bad}}}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory.tile_tokens") && e.contains("`auto`, `off` or a number of tokens"),
            "{bad}: {e}"
        );
    }
    // The override of the command line, and the round trip of a written config.
    let dir = std::env::temp_dir().join(format!("mt-cfg-tile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("run.yaml");
    std::fs::write(&p, OK).unwrap();
    let c = RunConfig::load(&p, &["memory.tile_tokens=off".into()]).unwrap();
    assert_eq!(c.memory.tile_tokens, TileTokens::Off);
    let e = RunConfig::load(&p, &["memory.tile_tokens=-3".into()]).unwrap_err();
    assert!(e.to_string().contains("memory.tile_tokens"), "{e}");
    let yaml = serde_yaml_ng::to_string(&c.memory).unwrap();
    assert!(yaml.contains("tile_tokens: off"), "{yaml}");
}

#[test]
fn recompute_is_auto_full_or_a_count_and_bad_values_name_the_key() {
    assert_eq!(parse(OK).unwrap().memory.recompute, Recompute::Auto);
    for (yaml, want) in [
        ("auto", Recompute::Auto),
        ("full", Recompute::Full),
        ("0", Recompute::Full),
        ("6", Recompute::Layers(6)),
    ] {
        let c = parse(&format!("{OK}memory: {{recompute: {yaml}}}\n")).unwrap();
        assert_eq!(c.memory.recompute, want, "{yaml}");
    }
    for bad in ["-1", "1.5", "true", "selective"] {
        let e = parse(&format!("{OK}memory: {{recompute: {bad}}}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory.recompute") && e.contains("`auto`, `full` or a number of layers"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn dpo_settings_default_resolve_llamafactory_names_and_name_bad_values() {
    let dpo = |extra: &str| parse(&format!("{OK}training: {{stage: dpo{extra}}}\n"));
    let c = dpo("").unwrap();
    let p = c.dpo_params().unwrap();
    assert_eq!(
        (p.beta, p.loss, p.label_smoothing),
        (0.1, DpoLoss::Sigmoid, 0.0)
    );
    assert_eq!(c.rows_per_step(), 16, "batch_size counts pairs");
    let c = parse(&format!(
        "{OK}training: {{stage: dpo}}\ndpo: {{beta: 0.5, loss_type: ipo}}\n"
    ))
    .unwrap();
    let p = c.dpo_params().unwrap();
    assert_eq!((p.beta, p.loss), (0.5, DpoLoss::Ipo));
    let p = dpo(", pref_beta: 0.2, pref_loss: sigmoid, dpo_label_smoothing: 0.1")
        .unwrap()
        .dpo_params()
        .unwrap();
    assert_eq!((p.beta, p.label_smoothing), (0.2, 0.1));
    let err = |yaml: String| parse(&yaml).unwrap_err().to_string();
    let e = err(format!(
        "{OK}training: {{stage: dpo, pref_beta: 0.2}}\ndpo: {{beta: 0.3}}\n"
    ));
    assert!(
        e.contains("dpo.beta") && e.contains("training.pref_beta"),
        "{e}"
    );
    for (yaml, key, what) in [
        ("dpo: {beta: 0}", "dpo.beta", "> 0"),
        ("dpo: {beta: .nan}", "dpo.beta", "> 0"),
        (
            "dpo: {label_smoothing: 0.5}",
            "dpo.label_smoothing",
            "[0, 0.5)",
        ),
        (
            "dpo: {label_smoothing: -0.1}",
            "dpo.label_smoothing",
            "[0, 0.5)",
        ),
        (
            "dpo: {loss_type: ipo, label_smoothing: 0.1}",
            "dpo.label_smoothing",
            "sigmoid",
        ),
        (
            "dpo: {loss_type: hinge}",
            "dpo.loss_type",
            "expected `sigmoid` or `ipo`",
        ),
        ("dpo: {bta: 1}", "dpo.bta", "did you mean `beta`"),
    ] {
        let e = err(format!("{OK}training: {{stage: dpo}}\n{yaml}\n"));
        assert!(e.contains(key) && e.contains(what), "{yaml}: {e}");
    }
    for (yaml, key) in [
        (
            "dataset: {format: tokenized, path: d.jsonl, packing: true, max_seq_len: 8}",
            "dataset.packing",
        ),
        (
            "dataset: {format: tokenized, path: d.jsonl, train_on_prompt: true}",
            "dataset.train_on_prompt",
        ),
    ] {
        let e = err(format!(
            "model: {{path: m}}\n{yaml}\ntraining: {{stage: dpo}}\n"
        ));
        assert!(
            e.contains(key) && e.contains("training.stage: dpo"),
            "{yaml}: {e}"
        );
    }
    // An eval set: held out (LlamaFactory's DPO examples) or a file.
    for ds in ["val_size: 0.1", "eval_path: e.jsonl"] {
        parse(&format!(
            "model: {{path: m}}\ndataset: {{format: tokenized, path: d.jsonl, {ds}}}\ntraining: {{stage: dpo, eval_steps: 5}}\n"
        ))
        .unwrap();
    }
    let e = err(format!("{OK}dpo: {{beta: 0.2}}\n"));
    assert!(
        e.contains("dpo.beta") && e.contains("applies to training.stage: dpo"),
        "{e}"
    );
}

/// `memory.resident_blocks`: `off` (the default, and 0), `auto`, `all` or a count; anything
/// else, and the modes the workers cannot update with the host's arithmetic, are refused
/// by the key's name.
#[test]
fn resident_blocks_parse_and_are_refused_where_unsupported() {
    use crate::config::ResidentBlocks;
    assert_eq!(
        parse(OK).unwrap().memory.resident_blocks,
        ResidentBlocks::Off
    );
    for (v, want) in [
        ("off", ResidentBlocks::Off),
        ("0", ResidentBlocks::Off),
        ("auto", ResidentBlocks::Auto),
        ("all", ResidentBlocks::All),
        ("12", ResidentBlocks::Blocks(12)),
    ] {
        let c = parse(&format!("{OK}memory: {{resident_blocks: {v}}}\n")).unwrap();
        assert_eq!(c.memory.resident_blocks, want, "{v}");
    }
    for bad in ["some", "1.5", "-2", "true"] {
        let e = parse(&format!("{OK}memory: {{resident_blocks: {bad}}}\n")).unwrap_err();
        assert!(
            e.to_string().contains("memory.resident_blocks"),
            "{bad}: {e}"
        );
    }
    assert_eq!(ResidentBlocks::Auto.count(30, || 14), 14);
    assert_eq!(ResidentBlocks::Auto.count(30, || 99), 30);
    assert_eq!(ResidentBlocks::Blocks(40).count(30, || 0), 30);
    assert_eq!(ResidentBlocks::Off.count(30, || 30), 0);
    let bf16_master = "model: {path: m, dtype: bfloat16}\ndataset: {format: tokenized, path: d.jsonl}\n\
                       memory: {resident_blocks: all, master_weights: bfloat16}\n";
    let e = parse(bf16_master).unwrap_err().to_string();
    assert!(
        e.contains("memory.resident_blocks") && e.contains("bfloat16"),
        "{e}"
    );
}

/// `memory.optimizer_offload`: `none` (the default) or `nvme` with `memory.nvme_path` (a
/// path or a list); the path without `nvme`, `nvme` without a path, a directory listed
/// twice, resident blocks beside it and `keep_nvme_state` without it (or under DPO) are
/// refused by the key's name.
#[test]
fn optimizer_offload_takes_one_path_or_a_list() {
    assert_eq!(
        parse(OK).unwrap().memory.optimizer_offload,
        OptimizerOffload::None
    );
    let c = parse(&format!(
        "{OK}memory: {{optimizer_offload: nvme, nvme_path: /mnt/a}}\n"
    ))
    .unwrap();
    assert_eq!(c.memory.optimizer_offload, OptimizerOffload::Nvme);
    assert_eq!(c.memory.nvme_path, [PathBuf::from("/mnt/a")]);
    let c = parse(&format!(
        "{OK}memory: {{optimizer_offload: nvme, nvme_path: [/mnt/a, /mnt/b]}}\n"
    ))
    .unwrap();
    assert_eq!(c.memory.nvme_path.len(), 2);
    for (memory, key) in [
        ("{nvme_path: /mnt/a}", "memory.nvme_path"),
        ("{optimizer_offload: nvme}", "memory.nvme_path"),
        (
            "{optimizer_offload: nvme, nvme_path: [/a, /a]}",
            "memory.nvme_path",
        ),
        ("{optimizer_offload: disk}", "memory.optimizer_offload"),
        (
            "{optimizer_offload: nvme, nvme_path: /a, resident_blocks: all}",
            "memory.optimizer_offload",
        ),
        ("{keep_nvme_state: true}", "memory.keep_nvme_state"),
    ] {
        let e = parse(&format!("{OK}memory: {memory}\n")).unwrap_err();
        assert!(e.to_string().contains(key), "{memory}: {e}");
    }
    let kept = "memory: {optimizer_offload: nvme, nvme_path: /a, keep_nvme_state: true}\n";
    assert!(
        parse(&format!("{OK}{kept}"))
            .unwrap()
            .memory
            .keep_nvme_state
    );
    let mut c = parse(&format!("{OK}{kept}")).unwrap();
    c.training.stage = crate::config::Stage::Dpo;
    let e = c.validate().unwrap_err();
    assert!(e.to_string().contains("memory.keep_nvme_state"), "{e}");
}
