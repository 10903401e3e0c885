//! The names people already type: HF Trainer's `TrainingArguments` and LlamaFactory's flat
//! training YAML, mapped onto this config's sections before the config is read.
//!
//! A key is looked up as written: a top-level key (`max_steps`, `cutoff_len`, LlamaFactory's
//! flat form) or a key inside a section (`training.max_steps`, the nested form). Each rule
//! says where the value goes, possibly transformed (`bf16: true` is `model.dtype:
//! bfloat16`), or that the key means nothing here (`deepspeed`: one line says so), or that
//! its value asks for what this tool does not do (`finetuning_type: lora`: an error). Keys
//! the table does not know are left for the sections' `deny_unknown_fields`, whose error
//! then suggests the nearest name from this table as well as the section's own
//! ([`suggest`]).
//!
//! Giving one setting twice under two names (`max_steps` and `training.num_steps`) with
//! different values is an error naming both, except where HF Trainer defines the order:
//! `max_steps` over `num_train_epochs`, `warmup_steps` over `warmup_ratio` (a note says so).

use std::path::Path;

use serde_yaml_ng::{Mapping, Value};

use super::chat_templates as builtin;
use crate::error::{Error, Result};

/// The config's sections: a top-level key that is one of these is not an alias.
const SECTIONS: &[&str] = &[
    "model",
    "dataset",
    "training",
    "optimizer",
    "memory",
    "logging",
    "checkpoint",
    "dpo",
    "grpo",
    "nodes",
    "vlm",
];

/// What a known key does.
#[derive(Clone, Copy)]
enum Rule {
    /// The value goes to this dotted path.
    To(&'static str),
    /// The value, transformed, goes to this dotted path; `Ok(None)` drops it (a value
    /// that means "unset", as HF's `max_steps: -1`), `Err` refuses it with the message.
    Map(
        &'static str,
        fn(&Value) -> std::result::Result<Option<Value>, String>,
    ),
    /// Accepted and ignored, for this reason (printed once).
    Ignored(&'static str),
    /// Ignored when the value is what this tool does anyway; else the message is the error.
    Check(fn(&Value) -> std::result::Result<(), String>),
}

use Rule::*;

/// Every known key, flat (LlamaFactory, HF Trainer) or nested (`section.key`).
const TABLE: &[(&str, Rule)] = &[
    // model
    ("trust_remote_code", To("model.trust_remote_code")),
    ("flash_attn", Map("model.attn_implementation", flash_attn)),
    ("bf16", Map("model.dtype", bf16)),
    ("training.bf16", Map("model.dtype", bf16)),
    ("fp16", Check(fp16)),
    ("training.fp16", Check(fp16)),
    // method
    ("stage", To("training.stage")),
    ("do_train", Check(do_train)),
    (
        "do_eval",
        Ignored(
            "an eval set (dataset.val_size, eval_dataset) is evaluated every eval_steps and after the last step",
        ),
    ),
    ("do_predict", Check(do_predict)),
    ("finetuning_type", Check(finetuning_type)),
    (
        "deepspeed",
        Ignored("megatrain-rs keeps the optimizer state in host RAM and streams the layers itself"),
    ),
    (
        "ddp_timeout",
        Ignored("workers are supervised by training.worker_timeout_s"),
    ),
    (
        "gradient_checkpointing",
        Ignored("every layer is recomputed in the backward already"),
    ),
    ("optim", Check(optim)),
    ("training.optim", Check(optim)),
    // dataset
    ("dataset", To("dataset.name")),
    ("eval_dataset", To("dataset.eval_name")),
    ("dataset_dir", To("dataset.dataset_dir")),
    // A built-in name; another name is noted (see `apply`).
    ("template", Map("dataset.chat_template", template)),
    ("dataset.template", Map("dataset.chat_template", template)),
    // TRL's SFTConfig name.
    ("chat_template_path", To("dataset.chat_template")),
    ("cutoff_len", To("dataset.max_seq_len")),
    ("dataset.cutoff_len", To("dataset.max_seq_len")),
    ("max_samples", To("dataset.max_samples")),
    ("val_size", To("dataset.val_size")),
    ("packing", To("dataset.packing")),
    ("train_on_prompt", To("dataset.train_on_prompt")),
    ("default_system", To("dataset.system_prompt")),
    (
        "overwrite_cache",
        Ignored("the data is prepared at every launch, nothing is cached"),
    ),
    ("preprocessing_num_workers", To("dataset.num_workers")),
    (
        "dataloader_num_workers",
        Ignored("batches are cut in the launcher"),
    ),
    // output
    ("output_dir", To("training.output_dir")),
    ("overwrite_output_dir", To("training.overwrite_output_dir")),
    ("logging_steps", To("logging.log_every")),
    ("training.logging_steps", To("logging.log_every")),
    ("logging_dir", To("logging.logging_dir")),
    ("report_to", To("logging.report_to")),
    ("training.report_to", To("logging.report_to")),
    ("run_name", To("logging.run_name")),
    ("training.run_name", To("logging.run_name")),
    (
        "plot_loss",
        Ignored("--metrics-out FILE draws the run's curves beside the metrics"),
    ),
    ("save_steps", To("checkpoint.every_steps")),
    ("training.save_steps", To("checkpoint.every_steps")),
    ("save_total_limit", To("checkpoint.keep_last")),
    ("training.save_total_limit", To("checkpoint.keep_last")),
    ("save_only_model", Map("checkpoint.save_optimizer", negate)),
    (
        "training.save_only_model",
        Map("checkpoint.save_optimizer", negate),
    ),
    (
        "save_strategy",
        Map("checkpoint.every_steps", save_strategy),
    ),
    (
        "save_safetensors",
        Ignored("checkpoints and exports are safetensors"),
    ),
    // train
    (
        "per_device_train_batch_size",
        To("training.per_device_train_batch_size"),
    ),
    (
        "per_device_eval_batch_size",
        To("training.per_device_eval_batch_size"),
    ),
    (
        "gradient_accumulation_steps",
        To("training.gradient_accumulation_steps"),
    ),
    ("learning_rate", To("training.learning_rate")),
    ("num_train_epochs", To("training.num_train_epochs")),
    ("max_steps", Map("training.num_steps", max_steps)),
    ("training.max_steps", Map("training.num_steps", max_steps)),
    ("lr_scheduler_type", Map("training.lr_scheduler", scheduler)),
    (
        "training.lr_scheduler_type",
        Map("training.lr_scheduler", scheduler),
    ),
    (
        "lr_scheduler_kwargs",
        Map("training.lr_scheduler_kwargs", scheduler_kwargs),
    ),
    ("warmup_ratio", To("training.warmup_ratio")),
    ("warmup_steps", To("training.warmup_steps")),
    ("weight_decay", To("training.weight_decay")),
    ("max_grad_norm", To("training.max_grad_norm")),
    ("seed", To("training.seed")),
    ("adam_beta1", To("optimizer.beta1")),
    ("adam_beta2", To("optimizer.beta2")),
    ("adam_epsilon", To("optimizer.eps")),
    ("optimizer.adam_beta1", To("optimizer.beta1")),
    ("optimizer.adam_beta2", To("optimizer.beta2")),
    ("optimizer.adam_epsilon", To("optimizer.eps")),
    ("training.adam_beta1", To("optimizer.beta1")),
    ("training.adam_beta2", To("optimizer.beta2")),
    ("training.adam_epsilon", To("optimizer.eps")),
    (
        "resume_from_checkpoint",
        Map("training.resume_from_checkpoint", not_null),
    ),
    (
        "training.resume_from_checkpoint",
        Map("training.resume_from_checkpoint", not_null),
    ),
    // eval
    ("eval_strategy", Check(eval_strategy)),
    ("evaluation_strategy", Check(eval_strategy)),
    ("eval_steps", To("training.eval_steps")),
    // vision-language (LlamaFactory's names)
    ("freeze_vision_tower", To("vlm.freeze_vision_encoder")),
    ("freeze_multi_modal_projector", To("vlm.freeze_projector")),
    // DPO (LlamaFactory's names)
    ("pref_beta", To("training.pref_beta")),
    ("pref_loss", To("training.pref_loss")),
    ("dpo_label_smoothing", To("training.dpo_label_smoothing")),
];

/// A known key's rule.
fn rule(key: &str) -> Option<Rule> {
    TABLE.iter().find(|(k, _)| *k == key).map(|&(_, r)| r)
}

fn flash_attn(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v.as_str() {
        Some("auto") => Ok(None),
        Some("fa2") => Ok(Some("flash_attention_2".into())),
        Some("sdpa") => Ok(Some("sdpa".into())),
        Some("disabled") => Ok(Some("eager".into())),
        _ => Err("expected one of auto, fa2, sdpa, disabled".into()),
    }
}

fn bool_of(v: &Value) -> std::result::Result<bool, String> {
    v.as_bool().ok_or_else(|| "expected true or false".into())
}

fn bf16(v: &Value) -> std::result::Result<Option<Value>, String> {
    Ok(Some(
        if bool_of(v)? { "bfloat16" } else { "float32" }.into(),
    ))
}

fn fp16(v: &Value) -> std::result::Result<(), String> {
    match bool_of(v)? {
        false => Ok(()),
        true => Err("fp16 training is not supported: use bf16: true (bf16 compute, fp32 master weights and Adam state)".into()),
    }
}

fn do_train(v: &Value) -> std::result::Result<(), String> {
    match bool_of(v)? {
        true => Ok(()),
        false => Err("do_train: false leaves nothing to do: mt-launch trains".into()),
    }
}

fn do_predict(v: &Value) -> std::result::Result<(), String> {
    match bool_of(v)? {
        false => Ok(()),
        true => Err(
            "do_predict is not supported: load the exported model with transformers to generate"
                .into(),
        ),
    }
}

fn finetuning_type(v: &Value) -> std::result::Result<(), String> {
    match v.as_str() {
        Some("full") => Ok(()),
        Some(other) => Err(format!(
            "finetuning_type: {other} is not supported: megatrain-rs trains every parameter in full precision (finetuning_type: full)"
        )),
        None => Err("expected a string such as full".into()),
    }
}

fn optim(v: &Value) -> std::result::Result<(), String> {
    match v.as_str() {
        Some("adamw_torch" | "adamw_torch_fused" | "adamw_hf" | "adamw") => Ok(()),
        Some(other) => Err(format!(
            "optim: {other} is not supported: the optimizer is AdamW with torch.optim.AdamW's semantics (optim: adamw_torch)"
        )),
        None => Err("expected a string such as adamw_torch".into()),
    }
}

fn template(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v.as_str() {
        Some(_) => Ok(Some(v.clone())),
        None => Err(format!(
            "expected a template name, one of {}",
            builtin::names()
        )),
    }
}

fn negate(v: &Value) -> std::result::Result<Option<Value>, String> {
    Ok(Some((!bool_of(v)?).into()))
}

fn save_strategy(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v.as_str() {
        Some("steps") => Ok(None),
        // `no` sets every_minutes too, in `apply`.
        Some("no") => Ok(Some(0.into())),
        Some(other) => Err(format!(
            "save_strategy: {other} is not supported: give save_steps (or save_strategy: no)"
        )),
        None => Err("expected one of steps, no".into()),
    }
}

fn max_steps(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v.as_i64() {
        // HF Trainer's default: the number of epochs decides.
        Some(-1) => Ok(None),
        Some(n) if n > 0 => Ok(Some(n.into())),
        _ => Err("expected a positive whole number (or -1: num_train_epochs decides)".into()),
    }
}

fn scheduler(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v.as_str() {
        // This tool's `constant` warms up over `warmup_steps` first.
        Some("constant_with_warmup") => Ok(Some("constant".into())),
        Some(other) => Ok(Some(other.into())),
        None => Err("expected a scheduler name such as cosine".into()),
    }
}

/// HF Trainer's command line gives `lr_scheduler_kwargs` as a JSON string; a YAML file
/// (LlamaFactory's) as a mapping.
fn scheduler_kwargs(v: &Value) -> std::result::Result<Option<Value>, String> {
    match v {
        Value::String(s) => serde_yaml_ng::from_str(s)
            .map(Some)
            .map_err(|e| format!("expected a mapping such as {{\"min_lr_rate\": 0.1}}: {e}")),
        Value::Null => Ok(None),
        other => Ok(Some(other.clone())),
    }
}

fn not_null(v: &Value) -> std::result::Result<Option<Value>, String> {
    Ok((!v.is_null()).then(|| v.clone()))
}

fn eval_strategy(v: &Value) -> std::result::Result<(), String> {
    match v.as_str() {
        Some("steps" | "no") => Ok(()),
        Some(other) => Err(format!(
            "{other} is not supported: evaluation runs every eval_steps steps and after the last one"
        )),
        None => Err("expected one of steps, no".into()),
    }
}

/// What [`apply`] made of a config: the notes to print once (ignored keys, precedence).
#[derive(Debug, Default)]
pub struct Applied {
    pub notes: Vec<String>,
}

/// Rewrites every known alias in `root` (a parsed config) into its section's key. `base`
/// is the config file's directory: `model_name_or_path` is a local directory relative to
/// it when one exists there, else a hub id. An alias whose key is already set is an error
/// unless the values agree, or unless `overriding` (the aliases of `--set` overrides,
/// which replace what the file gave).
pub fn apply(root: &mut Value, base: &Path, overriding: bool) -> Result<Applied> {
    let mut applied = Applied::default();
    let Some(map) = root.as_mapping_mut() else {
        return Ok(applied);
    };
    // (alias as written, value) in file order: top-level aliases, then nested ones.
    let mut found: Vec<(String, Value)> = Vec::new();
    let top: Vec<Value> = map.keys().cloned().collect();
    for key in top {
        let Some(k) = key.as_str().map(str::to_owned) else {
            continue;
        };
        // LlamaFactory's flat `dataset: a,b` shares its name with the section.
        let section_map = map.get(&key).is_some_and(Value::is_mapping);
        if SECTIONS.contains(&k.as_str()) && (section_map || rule(&k).is_none()) {
            let Some(section) = map.get_mut(&key).and_then(Value::as_mapping_mut) else {
                continue;
            };
            let inner: Vec<Value> = section.keys().cloned().collect();
            for sub in inner {
                let path = format!("{k}.{}", sub.as_str().unwrap_or_default());
                if rule(&path).is_some() {
                    let v = section.remove(&sub).expect("listed key");
                    found.push((path, v));
                }
            }
        } else if rule(&k).is_some() || k == "model_name_or_path" {
            let v = map.remove(&key).expect("listed key");
            found.push((k, v));
        }
    }
    let mut moved: Vec<(String, String, Value)> = Vec::new();
    for (alias, v) in found {
        let alias = alias.as_str();
        if alias == "model_name_or_path" {
            let s = v
                .as_str()
                .ok_or_else(|| Error::invalid(alias, "expected a model directory or a hub id"))?;
            let local = Path::new(s).is_absolute() || base.join(s).is_dir();
            let to = if local { "model.path" } else { "model.name" };
            moved.push((alias.into(), to.into(), v));
            continue;
        }
        // LlamaFactory's template names beyond the built-in ones leave the model's own
        // template in charge, as before they were read.
        if let Some(name) = v.as_str().filter(|n| {
            matches!(alias, "template" | "dataset.template") && builtin::find(n).is_none()
        }) {
            applied.notes.push(format!(
                "`{alias}: {name}` is not a built-in template ({}): the model's own chat template renders the conversations",
                builtin::names()
            ));
            continue;
        }
        if alias.ends_with("save_strategy") && v.as_str() == Some("no") {
            // No checkpoint by step nor by time.
            moved.push((alias.into(), "checkpoint.every_steps".into(), 0.into()));
            moved.push((alias.into(), "checkpoint.every_minutes".into(), 0.into()));
            continue;
        }
        match rule(alias).expect("found keys have a rule") {
            To(to) => moved.push((alias.into(), to.into(), v)),
            Map(to, f) => {
                if let Some(v) = f(&v).map_err(|e| Error::invalid(alias, e))? {
                    moved.push((alias.into(), to.into(), v));
                }
            }
            Ignored(why) => applied.notes.push(format!("`{alias}` is ignored: {why}")),
            Check(f) => f(&v).map_err(|e| Error::invalid(alias, e))?,
        }
    }
    for (alias, to, v) in moved {
        set(root, &alias, &to, v, overriding)?;
    }
    precedence(
        root,
        &mut applied,
        "training.num_steps",
        "training.num_train_epochs",
        "max_steps decides the number of steps (HF Trainer's rule)",
    );
    precedence(
        root,
        &mut applied,
        "training.warmup_steps",
        "training.warmup_ratio",
        "warmup_steps decides the warm-up (HF Trainer's rule)",
    );
    if get(root, "training.batch_size").is_some()
        && get(root, "training.per_device_train_batch_size").is_some()
    {
        return Err(Error::invalid(
            "training.per_device_train_batch_size",
            "conflicts with training.batch_size (the global batch): give one of them",
        ));
    }
    Ok(applied)
}

/// Where both `wins` and `loses` are set, drops `loses` with a note.
fn precedence(root: &mut Value, applied: &mut Applied, wins: &str, loses: &str, why: &str) {
    if get(root, wins).is_some() && get(root, loses).is_some() {
        let (section, key) = loses.split_once('.').expect("a dotted path");
        if let Some(m) = root.get_mut(section).and_then(Value::as_mapping_mut) {
            m.remove(key);
        }
        applied.notes.push(format!("`{loses}` is ignored: {why}"));
    }
}

/// The value at dotted `path`, if set.
fn get<'a>(root: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(root, |node, part| node.get(part))
}

/// Sets dotted path `to` (from `alias`), refusing a different value already there.
fn set(root: &mut Value, alias: &str, to: &str, v: Value, overriding: bool) -> Result<()> {
    if let Some(there) = get(root, to).filter(|_| !overriding) {
        if *there == v {
            return Ok(());
        }
        return Err(Error::invalid(
            alias,
            format!(
                "sets {to}, which the config also gives ({}): give one of them",
                serde_yaml_ng::to_string(there).unwrap_or_default().trim()
            ),
        ));
    }
    let mut node = root;
    for part in to.split('.') {
        if node.is_null() {
            *node = Value::Mapping(Mapping::new());
        }
        let map = node
            .as_mapping_mut()
            .ok_or_else(|| Error::invalid(to, "its section is not a mapping"))?;
        node = map.entry(part.into()).or_insert(Value::Null);
    }
    *node = v;
    Ok(())
}

/// The key an override `key` (`--set key=value`) stands for: `max_steps` and
/// `training.max_steps` are `training.num_steps`, and so on; keys without a plain
/// renaming (transformed values, ignored keys) are returned as given and handled by
/// [`apply`] after the override.
pub fn canonical(key: &str) -> &str {
    match rule(key) {
        Some(To(to)) => to,
        _ => key,
    }
}

/// For an unknown `key` of `section` (None: top level), the known names nearest to it:
/// aliases by edit distance, with the key they stand for.
pub fn suggest(
    section: Option<&str>,
    key: &str,
    distance: fn(&str, &str) -> usize,
) -> Option<String> {
    let full = match section {
        Some(s) => format!("{s}.{key}"),
        None => key.to_string(),
    };
    TABLE
        .iter()
        .filter(|(alias, _)| matches!(rule(alias), Some(To(_) | Map(..))))
        .map(|(alias, r)| (distance(&full, alias), *alias, *r))
        .filter(|(d, alias, _)| *d <= alias.len().max(full.len()) / 4 + 1)
        .min_by_key(|(d, _, _)| *d)
        .map(|(_, alias, r)| match r {
            To(to) | Map(to, _) => format!("`{alias}` (that is `{to}`)"),
            _ => format!("`{alias}`"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Value {
        serde_yaml_ng::from_str(s).unwrap()
    }

    #[test]
    fn flat_and_nested_names_land_in_their_sections() {
        let mut v = yaml(
            "model_name_or_path: org/model\nstage: sft\ncutoff_len: 512\nmax_steps: 7\n\
             lr_scheduler_type: constant_with_warmup\nbf16: true\nsave_only_model: true\n\
             adam_beta2: 0.98\nreport_to: [tensorboard]\nrun_name: sft-1\n\
             training: {save_total_limit: 3}\ndataset: {path: x.json}\n",
        );
        let applied = apply(&mut v, Path::new("/nonexistent"), false).unwrap();
        assert!(applied.notes.is_empty(), "{:?}", applied.notes);
        let mut flat = yaml("dataset: identity,alpaca_en_demo\n");
        apply(&mut flat, Path::new("."), false).unwrap();
        assert_eq!(
            get(&flat, "dataset.name"),
            Some(&"identity,alpaca_en_demo".into())
        );
        let at = |p: &str| get(&v, p).cloned();
        assert_eq!(at("model.name"), Some("org/model".into()));
        assert_eq!(at("training.stage"), Some("sft".into()));
        assert_eq!(at("dataset.max_seq_len"), Some(512.into()));
        assert_eq!(at("dataset.path"), Some("x.json".into()));
        assert_eq!(at("training.num_steps"), Some(7.into()));
        assert_eq!(at("training.lr_scheduler"), Some("constant".into()));
        assert_eq!(at("model.dtype"), Some("bfloat16".into()));
        assert_eq!(at("checkpoint.save_optimizer"), Some(false.into()));
        assert_eq!(at("checkpoint.keep_last"), Some(3.into()));
        assert_eq!(at("optimizer.beta2"), Some(0.98.into()));
        assert_eq!(at("logging.report_to"), Some(yaml("[tensorboard]")));
        assert_eq!(at("logging.run_name"), Some("sft-1".into()));
        assert!(
            at("training.save_total_limit").is_none(),
            "moved, not copied"
        );
    }

    #[test]
    fn a_local_directory_is_a_path_and_ignored_keys_are_noted() {
        let dir = std::env::temp_dir().join(format!("mt-aliases-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("weights")).unwrap();
        let mut v =
            yaml("model_name_or_path: weights\ndeepspeed: ds.json\nfinetuning_type: full\n");
        let applied = apply(&mut v, &dir, false).unwrap();
        assert_eq!(get(&v, "model.path"), Some(&"weights".into()));
        assert_eq!(applied.notes.len(), 1, "{:?}", applied.notes);
        assert!(applied.notes[0].contains("deepspeed"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn llamafactory_template_names_a_builtin_or_leaves_the_models_own() {
        let mut v = yaml("template: qwen\n");
        let applied = apply(&mut v, Path::new("."), false).unwrap();
        assert_eq!(get(&v, "dataset.chat_template"), Some(&"qwen".into()));
        assert!(applied.notes.is_empty(), "{:?}", applied.notes);
        let mut v = yaml("dataset: {template: default, path: x.json}\n");
        apply(&mut v, Path::new("."), false).unwrap();
        assert_eq!(get(&v, "dataset.chat_template"), Some(&"default".into()));
        // A LlamaFactory name that is not built in: the model's own template, noted.
        let mut v = yaml("template: qwen3_nothink\n");
        let applied = apply(&mut v, Path::new("."), false).unwrap();
        assert!(get(&v, "dataset.chat_template").is_none());
        assert!(
            applied.notes.len() == 1 && applied.notes[0].contains("qwen3_nothink"),
            "{:?}",
            applied.notes
        );
        let e = apply(
            &mut yaml("template: qwen\ndataset: {chat_template: llama3}\n"),
            Path::new("."),
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("dataset.chat_template"), "{e}");
    }

    #[test]
    fn unsupported_values_and_conflicts_are_refused_by_name() {
        let err = |s: &str| {
            apply(&mut yaml(s), Path::new("."), false)
                .unwrap_err()
                .to_string()
        };
        assert!(err("finetuning_type: lora\n").contains("finetuning_type"));
        assert!(err("fp16: true\n").contains("bf16"));
        let both = err("max_steps: 5\ntraining: {num_steps: 6}\n");
        assert!(
            both.contains("max_steps") && both.contains("training.num_steps"),
            "{both}"
        );
        let batch = err("per_device_train_batch_size: 2\ntraining: {batch_size: 8}\n");
        assert!(batch.contains("per_device_train_batch_size"), "{batch}");
        // The same value twice is fine.
        apply(
            &mut yaml("max_steps: 5\ntraining: {num_steps: 5}\n"),
            Path::new("."),
            false,
        )
        .unwrap();
    }

    #[test]
    fn hf_precedence_max_steps_over_epochs_and_warmup_steps_over_ratio() {
        let mut v =
            yaml("max_steps: 5\nnum_train_epochs: 3.0\nwarmup_ratio: 0.1\nwarmup_steps: 2\n");
        let applied = apply(&mut v, Path::new("."), false).unwrap();
        assert!(get(&v, "training.num_train_epochs").is_none());
        assert!(get(&v, "training.warmup_ratio").is_none());
        assert_eq!(applied.notes.len(), 2, "{:?}", applied.notes);
        // Without max_steps, epochs stay for the launch to turn into steps.
        let mut v = yaml("num_train_epochs: 2.0\n");
        apply(&mut v, Path::new("."), false).unwrap();
        assert_eq!(get(&v, "training.num_train_epochs"), Some(&2.0.into()));
        assert_eq!(max_steps(&(-1).into()), Ok(None));
    }

    #[test]
    fn overrides_and_suggestions_use_the_table() {
        assert_eq!(
            canonical("max_steps"),
            "max_steps",
            "a transformed value: apply decides"
        );
        assert_eq!(canonical("cutoff_len"), "dataset.max_seq_len");
        assert_eq!(canonical("training.save_steps"), "checkpoint.every_steps");
        assert_eq!(canonical("training.num_steps"), "training.num_steps");
        let lev = super::super::overrides::edit_distance;
        let s = suggest(Some("training"), "save_step", lev).unwrap();
        assert!(s.contains("checkpoint.every_steps"), "{s}");
        let s = suggest(None, "cutof_len", lev).unwrap();
        assert!(s.contains("dataset.max_seq_len"), "{s}");
        assert_eq!(suggest(Some("training"), "zzzzzzzz", lev), None);
    }
}
