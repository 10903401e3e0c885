//! The YAML run config: MegaTrain's sections (model, dataset, training, optimizer, memory,
//! logging), each a serde struct with `deny_unknown_fields` and a doc per field.
//!
//! YAML crate: `serde_yaml` is archived, so we use its maintained fork `serde_yaml_ng`
//! (same API). `serde_path_to_error` makes every deserialization error name the full key
//! (`training.batch_size`), not just the innermost field.
//!
//! Relative paths in a config are resolved against the directory of the config file, so a
//! config runs the same from any working directory. The one path a config may leave out
//! that a run writes, `training.output_dir`, defaults to `output/<config file stem>/` under
//! the current directory (where HF Trainer and LlamaFactory put a relative `output_dir`),
//! and `checkpoint.dir` to its `checkpoints/` ([`RunConfig::load`]); `training.save_model:
//! false` opts out of both.

mod aliases;
pub mod bounds;
pub mod chat_templates;
mod checkpoint;
mod dataset;
mod grpo;
pub mod hf;
pub mod hub;
mod logging;
mod nodes;
mod overrides;
mod recompute;
mod resident;
mod schedule;
pub mod shipped;
pub mod size;
mod sources;
mod stage;
mod tile;
pub mod vision;
mod vlm;
mod word_or_number;

pub use checkpoint::{CheckpointContents, CheckpointSection};
pub use dataset::{DatasetFormat, DatasetSection, Overlong, REGISTRY, ValSize};
pub use grpo::{GrpoLoss, GrpoParams, GrpoSection, ScaleRewards, grpo_needs_rollouts};
pub use logging::{LoggingSection, ReportTo, Tracker};
pub use nodes::NodesSection;
pub use overrides::apply_override;
use overrides::{did_you_mean, edit_distance};
pub use recompute::Recompute;
pub use resident::ResidentBlocks;
pub use schedule::{LrScheduler, Ramp, SchedulerKwargs};
pub use stage::{DpoLoss, DpoParams, DpoSection, Stage};
pub use tile::TileTokens;
pub use vlm::{TowerTraining, VlmSection};

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use crate::error::{Error, Result};

/// A complete, validated run configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelSection,
    pub dataset: DatasetSection,
    #[serde(default)]
    pub training: TrainingSection,
    #[serde(default)]
    pub optimizer: OptimizerSection,
    #[serde(default)]
    pub memory: MemorySection,
    #[serde(default)]
    pub logging: LoggingSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// `training.stage: dpo`'s settings.
    #[serde(default)]
    pub dpo: DpoSection,
    /// `training.stage: grpo`'s settings.
    #[serde(default)]
    pub grpo: GrpoSection,
    /// Several nodes (`mpirun -np N mt-launch …`).
    #[serde(default)]
    pub nodes: NodesSection,
    /// A vision-language model's vision side: what of it trains.
    #[serde(default)]
    pub vlm: VlmSection,
    /// What reading the config noted for the user: keys of HF Trainer or LlamaFactory that
    /// mean nothing here, and which of two settings decided ([`aliases`]).
    #[serde(skip)]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// An HF-format model directory: config.json (+ model.safetensors, or shards with
    /// model.safetensors.index.json, for `init: pretrained`). Exactly one of `path` and
    /// `name` is given; after loading, `path` holds the directory either way.
    #[serde(default)]
    pub path: PathBuf,
    /// A Hugging Face hub id (`org/name`, or `org/name@revision`), resolved offline through
    /// the local HF cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where the initial weights come from.
    #[serde(default)]
    pub init: Init,
    /// Compute dtype, and the dtype of the shared weight store and gradient slabs.
    #[serde(default)]
    pub dtype: DType,
    /// MegaTrain's key, accepted: attention is always PyTorch's fused SDPA (`sdpa`), or
    /// the explicit form where a family soft-caps scores (what `eager` computes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_implementation: Option<AttnImplementation>,
    /// MegaTrain's key, accepted: no model code is ever loaded from the model directory,
    /// so `true` changes nothing (the family comes from config.json's `model_type`).
    #[serde(default)]
    pub trust_remote_code: bool,
    /// CUDA device indices for the workers, one worker each (default: 0..N-1 for `--gpus N`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<usize>>,
    /// Set by [`RunConfig::load_for_plan`] when `name` is not in the HF cache: the shipped
    /// architecture that stands in for it (no weights, no tokenizer).
    #[serde(skip)]
    pub shipped: Option<&'static shipped::Shipped>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnImplementation {
    Sdpa,
    Eager,
    #[serde(rename = "flash_attention_2")]
    FlashAttention2,
}

impl ModelSection {
    /// The model's architecture: `path`'s config.json, or the shipped one standing in.
    pub fn spec(&self) -> Result<hf::ModelSpec> {
        match self.shipped {
            Some(s) => s.spec(),
            None => hf::ModelSpec::from_model_dir(&self.path),
        }
    }

    /// [`Self::resolve_source`], except that a hub `name` missing from the HF cache falls
    /// back to the architecture shipped for it, if any (`shipped` set, `path` empty).
    fn resolve_source_or_shipped(&mut self) -> Result<()> {
        match (self.resolve_source(), self.name.as_deref()) {
            (Err(Error::InvalidValue { key, .. }), Some(name))
                if key == "model.name" && shipped::for_hub_id(name).is_some() =>
            {
                self.shipped = shipped::for_hub_id(name);
                Ok(())
            }
            (r, _) => r,
        }
    }

    /// Checks that exactly one of `path` and `name` is given and turns a hub `name` into the
    /// cached snapshot directory in `path`.
    fn resolve_source(&mut self) -> Result<()> {
        let has_path = !self.path.as_os_str().is_empty();
        match (&self.name, has_path) {
            (Some(_), true) => Err(Error::invalid(
                "model.name",
                "give either model.path or model.name, not both",
            )),
            (None, false) => Err(Error::invalid(
                "model.path",
                "missing: give model.path (a model directory) or model.name (a hub id)",
            )),
            (Some(name), false) => {
                self.path = hub::resolve(name)?;
                Ok(())
            }
            (None, true) => Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Init {
    /// Load the weights from `model.path`'s safetensors.
    #[default]
    Pretrained,
    /// Initialize as transformers does (normal(0, initializer_range), norms 1, biases 0),
    /// seeded by `training.seed`.
    Random,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Float32,
    #[default]
    Bfloat16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Float32 => 4,
            DType::Bfloat16 => 2,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingSection {
    /// The training stage (LlamaFactory's key and names): `sft` (supervised fine-tuning on
    /// the assistant turns of alpaca / sharegpt data), `pt` (continued pretraining on plain
    /// text, loss on every token), `dpo` (preference pairs, loss on the responses'
    /// log-probability margin over the initial model's) and `grpo` (a rollouts file's
    /// completions, weighted by their group-relative advantages).
    pub stage: Stage,
    /// Global sequences per optimizer step (all workers, all micro-batches); under `dpo`,
    /// preference pairs (two sequences each); under `grpo`, completions.
    pub batch_size: usize,
    /// Sequences per worker per micro-batch (HF Trainer's and LlamaFactory's key): the
    /// global `batch_size` is this x workers (all nodes) x `gradient_accumulation_steps`,
    /// printed at start. Give this or `batch_size`, not both.
    pub per_device_train_batch_size: Option<usize>,
    /// Passes over the training samples (HF Trainer's key, fractions allowed): `num_steps`
    /// becomes ceil(epochs x ceil(samples / batch_size)), printed at start. An explicit
    /// `num_steps` (`max_steps`) takes precedence, as in HF Trainer.
    pub num_train_epochs: Option<f64>,
    /// Micro-batches per worker per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps to run.
    pub num_steps: u64,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Learning-rate schedule after warm-up (HF Trainer's `lr_scheduler_type` and formulas):
    /// `constant`, `linear`, `cosine`, `cosine_with_min_lr`, `warmup_stable_decay`.
    pub lr_scheduler: LrScheduler,
    /// The schedule's options (HF Trainer's key, as transformers' scheduler takes them).
    pub lr_scheduler_kwargs: SchedulerKwargs,
    /// Linear warm-up steps from 0 to `learning_rate`.
    pub warmup_steps: u64,
    /// Warm-up as a fraction of `num_steps` (HF Trainer's key): `warmup_steps` becomes
    /// ceil(ratio x num_steps). An explicit `warmup_steps` takes precedence.
    pub warmup_ratio: Option<f64>,
    /// AdamW decoupled weight decay (applied to tensors with >= 2 dims only).
    pub weight_decay: f64,
    /// Clip the global gradient 2-norm to this value; 0 disables clipping.
    pub max_grad_norm: f64,
    /// Seed for random init and data shuffling.
    pub seed: u64,
    /// Where the trained model is written as an HF model directory at the end of the run
    /// (not on a stop signal, as HF Trainer). Unset: `output/<config file stem>/` under the
    /// current directory; a relative path given here is resolved against the config
    /// file's directory, as every path in a config is.
    pub output_dir: Option<PathBuf>,
    /// Write the trained model to `output_dir` (HF Trainer's `save_model()`), with
    /// checkpoints under `output_dir/checkpoints/` unless `checkpoint.dir` names another
    /// place. `false` (benchmarks): no model is written, and checkpoints only where
    /// `checkpoint.dir` is set; `output_dir`, if given, then holds logs only.
    pub save_model: bool,
    /// `output_dir` was left out and is the default (set by [`RunConfig::load`]).
    #[serde(skip)]
    pub output_dir_is_default: bool,
    /// Write into an `output_dir` or `checkpoint.dir` that holds files this project did not
    /// write (HF Trainer's and LlamaFactory's key): another model's weight files there are
    /// replaced, other files kept. Default: such a directory is refused, naming the files.
    pub overwrite_output_dir: bool,
    /// A checkpoint to resume from when `--resume` is not given (HF Trainer's key): a
    /// checkpoint directory or `latest`.
    pub resume_from_checkpoint: Option<String>,
    /// What a non-finite loss or gradient norm does: `skip` the update (counted in the
    /// metrics) or `abort` the run.
    pub nan_policy: NanPolicy,
    /// With `skip`: abort after this many non-finite steps in a row.
    pub max_nan_steps: u64,
    /// A worker the launcher waits on that sends nothing for this many seconds is
    /// treated as crashed (the first step on a GPU, which streams every layer, sends its
    /// first message only after the forward pass).
    pub worker_timeout_s: u64,
    /// Evaluate every this many optimizer steps (HF Trainer's key). A run with an eval set
    /// (`dataset.val_size`, `eval_name` or `eval_path`) also evaluates after its last step.
    pub eval_steps: Option<u64>,
    /// Rows per evaluation micro-batch, each computed by one worker (HF Trainer's key).
    /// Default: the training micro-batch, `batch_size / (workers x
    /// gradient_accumulation_steps)`.
    pub per_device_eval_batch_size: Option<usize>,
    /// LlamaFactory's name for `dpo.beta`.
    pub pref_beta: Option<f64>,
    /// LlamaFactory's name for `dpo.loss_type` (`sigmoid`, `ipo`).
    pub pref_loss: Option<DpoLoss>,
    /// LlamaFactory's name for `dpo.label_smoothing`.
    pub dpo_label_smoothing: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NanPolicy {
    #[default]
    Skip,
    Abort,
}

impl Default for TrainingSection {
    fn default() -> Self {
        TrainingSection {
            stage: Stage::Sft,
            batch_size: 8,
            per_device_train_batch_size: None,
            num_train_epochs: None,
            gradient_accumulation_steps: 1,
            num_steps: 10,
            learning_rate: 1e-5,
            lr_scheduler: LrScheduler::Constant,
            lr_scheduler_kwargs: SchedulerKwargs::default(),
            warmup_steps: 0,
            warmup_ratio: None,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            seed: 42,
            output_dir: None,
            save_model: true,
            output_dir_is_default: false,
            overwrite_output_dir: false,
            resume_from_checkpoint: None,
            nan_policy: NanPolicy::Skip,
            max_nan_steps: 5,
            worker_timeout_s: 600,
            eval_steps: None,
            per_device_eval_batch_size: None,
            pref_beta: None,
            pref_loss: None,
            dpo_label_smoothing: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerSection {
    /// The optimizer: only `adamw` (torch.optim.AdamW's semantics, on the CPU).
    #[serde(rename = "type")]
    pub kind: OptimizerKind,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        OptimizerSection {
            kind: OptimizerKind::Adamw,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    #[default]
    Adamw,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemorySection {
    /// Gradient slab slots per worker: layers whose gradients may wait for the host reduce.
    pub num_grad_slabs: usize,
    /// Tokens per chunk of the lm_head + cross-entropy (bounds the logits memory).
    pub ce_chunk_tokens: usize,
    /// Tokens per tile of each decoder layer's token-wise half (post-attention norm, MLP,
    /// residual), which then holds one tile's MLP activations instead of the whole
    /// micro-batch's: `auto` (or 0; the device plan's choice), `off`, or a number.
    #[serde(with = "tile::human")]
    pub tile_tokens: TileTokens,
    /// What the backward recomputes: `auto` (the device plan keeps the MLP activations of
    /// as many of the last layers as the GPU's free memory holds, so their backward
    /// recomputes only the attention half), `full` (every layer from its input), or a
    /// number of layers that keep them.
    #[serde(with = "recompute::human")]
    pub recompute: Recompute,
    /// Keep each layer's input between forward and backward in pinned host memory
    /// instead of on the GPU (long sequences); ignored by CPU workers.
    pub offload_activations: bool,
    /// MegaTrain's activation checkpoint interval in layers: only 1 (every layer's input
    /// is kept on the device and the layer recomputed in the backward) is implemented.
    pub checkpoint_interval: usize,
    /// Dtype of the launcher's gradient accumulator: `float32` (4 bytes per parameter) or
    /// `bfloat16` (2): worker gradients are summed in f32 and rounded once per
    /// micro-batch; the norm, clipping and AdamW see the rounded values.
    pub grad_dtype: DType,
    /// `float32`: a separate fp32 master (4 bytes per parameter). `split`: the bf16 store
    /// is the master's high half and a 16-bit residual its low half (2 bytes per parameter
    /// instead of 4). `bfloat16`: no separate master, the bf16 store is the master (0
    /// bytes), updated by AdamW with stochastic rounding seeded by `training.seed`
    /// (12 bytes per parameter with `grad_dtype: bfloat16`). `split` and `bfloat16` need
    /// `model.dtype: bfloat16`. Checkpoints hold fp32 master values either way.
    pub master_weights: MasterWeights,
    /// Dtype of Adam's first and second moments: `float32` (8 bytes per parameter) or
    /// `bfloat16` (4): each update computes them in f32 from the stored values and stores
    /// them rounded stochastically (bits from `training.seed`, the update and the element;
    /// [`crate::optim::adamw::adamw_update_bf16_moments`]). With `master_weights: split`
    /// and `grad_dtype: bfloat16`, 10 bytes per parameter. Checkpoints hold fp32 moments
    /// either way.
    pub moments_dtype: DType,
    /// Leading blocks whose master weights, moments and compute weights stay on every GPU
    /// and are updated there ([`ResidentBlocks`]): `off` (the default), `auto`, `all` or a
    /// number. Needs `master_weights: float32` or `split` and `moments_dtype: float32`.
    pub resident_blocks: ResidentBlocks,
    /// Where the optimizer's state lives: `none` (host RAM) or `nvme`: the fp32 master (a
    /// split master's low halves) and Adam's m and v in files under `memory.nvme_path`,
    /// streamed through host RAM a window of a block at a time by each update
    /// (`crate::host`'s drive store); host RAM keeps the store and the gradient. The same
    /// bits as `none`. Not with `resident_blocks` or a state sharded over nodes.
    pub optimizer_offload: OptimizerOffload,
    /// The directories (one per drive; a string or a list) the state is striped over with
    /// `optimizer_offload: nvme`. Each must exist and be a directory, not a symbolic link.
    #[serde(deserialize_with = "one_or_many")]
    pub nvme_path: Vec<std::path::PathBuf>,
    /// With `optimizer_offload: nvme`: keep the state's files after the run (the CLI's
    /// `--keep-nvme-state`), with a manifest beside them (`megatrain-nvme-state.json` in the
    /// first directory: the step, the model's layout, the modes, a checksum of each block),
    /// and resume from them when they are there: a later run of the same config continues
    /// the run without a checkpoint, and one whose state does not match is refused.
    pub keep_nvme_state: bool,
}

/// Where the optimizer's state lives (`memory.optimizer_offload`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerOffload {
    #[default]
    None,
    /// Files on the drives under `memory.nvme_path`.
    Nvme,
}

impl OptimizerOffload {
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerOffload::None => "none",
            OptimizerOffload::Nvme => "nvme",
        }
    }
}

/// A string or a list of strings, as a list of paths (`memory.nvme_path`).
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<std::path::PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(std::path::PathBuf),
        Many(Vec<std::path::PathBuf>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(v) => v,
    })
}

/// How the fp32 master weights are held (`memory.master_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MasterWeights {
    #[default]
    Float32,
    Split,
    /// The bf16 store alone, rounded stochastically ([`crate::elem::bits`]).
    Bfloat16,
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection {
            num_grad_slabs: 4,
            ce_chunk_tokens: 4096,
            tile_tokens: TileTokens::Auto,
            recompute: Recompute::Auto,
            offload_activations: false,
            checkpoint_interval: 1,
            grad_dtype: DType::Float32,
            master_weights: MasterWeights::Float32,
            moments_dtype: DType::Float32,
            resident_blocks: ResidentBlocks::Off,
            optimizer_offload: OptimizerOffload::None,
            nvme_path: Vec::new(),
            keep_nvme_state: false,
        }
    }
}

/// For an unknown key at `key` (its dotted path): the nearest of HF
/// Trainer's and LlamaFactory's names this config takes, else the section's nearest field.
fn hint(key: &str, inner: &str) -> String {
    let unknown = inner.split('`').nth(1).unwrap_or_default();
    // serde_path_to_error's path ends with the unknown key itself.
    let section = key
        .strip_suffix(unknown)
        .map(|s| s.trim_end_matches('.'))
        .filter(|s| !s.is_empty() && *s != ".");
    match inner.starts_with("unknown field") {
        true => aliases::suggest(section, unknown, edit_distance)
            .map(|s| format!(" (did you mean {s}?)"))
            .unwrap_or_else(|| did_you_mean(inner)),
        false => did_you_mean(inner),
    }
}

impl RunConfig {
    /// Reads `path`, applies `--set key.path=value` overrides, deserializes and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<RunConfig> {
        Self::load_with(path, overrides, false)
    }

    /// [`Self::load`] for sizing a run: a `model.name` missing from the local HF cache
    /// falls back to the architecture shipped under configs/ for it (`model.shipped`).
    pub fn load_for_plan(path: &Path, overrides: &[String]) -> Result<RunConfig> {
        Self::load_with(path, overrides, true)
    }

    fn load_with(path: &Path, overrides: &[String], shipped_ok: bool) -> Result<RunConfig> {
        let asked = path;
        let moved = sources::relocated(asked);
        let path = moved.as_deref().unwrap_or(asked);
        if !path.is_file() {
            return Err(Error::Config {
                path: path.into(),
                msg: "no such config file (--config; the shipped ones are under configs/, benchmark shapes under configs/bench/)".into(),
            });
        }
        let text = crate::bounded::read_text(path, crate::bounded::SMALL_JSON, "run config")?;
        let mut value: Value = serde_yaml_ng::from_str(&text).map_err(|e| Error::Config {
            path: path.into(),
            msg: format!("malformed YAML: {e}"),
        })?;
        // A config in the current directory has an empty parent: relative paths in it are
        // relative to ".", whose ancestors (checked for writability) exist.
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        // HF Trainer's and LlamaFactory's names first, so that an override of either name
        // replaces the file's value; then the overrides' own aliases, which replace too.
        let mut notes = aliases::apply(&mut value, base, false)?.notes;
        if moved.is_some() {
            let note = format!(
                "{} is now {} (benchmark shapes, random init, live in configs/bench/)",
                asked.display(),
                path.display()
            );
            notes.insert(0, note);
        }
        for ov in overrides {
            let (key, raw) = ov.split_once('=').unwrap_or((ov, ""));
            let key = aliases::canonical(key.trim());
            // A data source replaces the other way of naming it: `--set dataset.path=my.json`
            // on a config that names a registry dataset trains on the file.
            // So does a model, and an eval set: held out (val_size) or given (eval_path,
            // eval_name).
            let others: &[&str] = match key {
                "dataset.path" => &["name"],
                "dataset.name" => &["path"],
                "model.path" => &["name"],
                "model.name" => &["path"],
                "dataset.eval_path" | "dataset.eval_name" => &["val_size"],
                "dataset.val_size" => &["eval_path", "eval_name"],
                _ => &[],
            };
            let section = key.split('.').next().unwrap_or_default();
            if let Some(m) = value.get_mut(section).and_then(Value::as_mapping_mut) {
                for other in others {
                    m.remove(*other);
                }
            }
            match ov.contains('=') {
                true => apply_override(&mut value, &format!("{key}={raw}"))?,
                false => apply_override(&mut value, ov)?,
            }
        }
        notes.extend(aliases::apply(&mut value, base, true)?.notes);
        let mut cfg: RunConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.inner().to_string();
            Error::Config {
                path: path.into(),
                msg: format!("key `{key}`: {inner}{}", hint(&key, &inner)),
            }
        })?;
        cfg.notes = notes;
        match shipped_ok {
            true => cfg.model.resolve_source_or_shipped()?,
            false => cfg.model.resolve_source()?,
        }
        cfg.resolve_paths(base);
        cfg.default_dirs(path);
        // The W&B / MLflow run's name: HF's `run_name`, else the config's stem.
        if cfg.logging.run_name.is_none() {
            cfg.logging.run_name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// With `training.save_model`, an unset `training.output_dir` becomes
    /// `output/<stem of config>/` under the current directory, and an unset
    /// `checkpoint.dir` its `checkpoints/`.
    fn default_dirs(&mut self, config: &Path) {
        let t = &mut self.training;
        if !t.save_model {
            return;
        }
        if t.output_dir.is_none() {
            let stem = config.file_stem().unwrap_or(std::ffi::OsStr::new("run"));
            let out = Path::new("output").join(stem);
            // Absolute, so that messages and `--resume latest` name one place.
            t.output_dir = Some(std::env::current_dir().map_or(out.clone(), |d| d.join(&out)));
            t.output_dir_is_default = true;
        }
        if self.checkpoint.dir.is_none() {
            self.checkpoint.dir = t.output_dir.as_ref().map(|o| o.join("checkpoints"));
        }
    }

    /// Where the model is exported at the end of the run: `training.output_dir` unless
    /// `training.save_model: false`.
    pub fn export_dir(&self) -> Option<&Path> {
        let t = &self.training;
        t.output_dir.as_deref().filter(|_| t.save_model)
    }

    fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.model.path);
        for p in [&mut self.dataset.path, &mut self.dataset.eval_path] {
            if let Some(p) = p.as_mut() {
                fix(p);
            }
        }
        fix(&mut self.dataset.dataset_dir);
        // A built-in template's name stays a name (`./qwen` is a file).
        if let Some(t) = self.dataset.chat_template.as_mut()
            && chat_templates::named(t).is_none()
        {
            fix(t);
        }
        if let Some(out) = self.training.output_dir.as_mut() {
            fix(out);
        }
        if let Some(dir) = self.checkpoint.dir.as_mut() {
            fix(dir);
        }
        if let Some(dir) = self.logging.logging_dir.as_mut() {
            fix(dir);
        }
        // A bare name (`python3`) is looked up on PATH, as a shell would.
        if let Some(py) = self
            .logging
            .python
            .as_mut()
            .filter(|p| p.components().count() > 1)
        {
            fix(py);
        }
    }

    /// Checks every value that deserialization cannot; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let t = &self.training;
        let o = &self.optimizer;
        let checks: [(bool, &str, String); 12] = [
            (
                t.batch_size > 0,
                "training.batch_size",
                "must be > 0".into(),
            ),
            (
                t.gradient_accumulation_steps > 0,
                "training.gradient_accumulation_steps",
                "must be > 0".into(),
            ),
            (t.num_steps > 0, "training.num_steps", "must be > 0".into()),
            (
                t.worker_timeout_s > 0,
                "training.worker_timeout_s",
                "must be > 0".into(),
            ),
            (
                t.learning_rate.is_finite() && t.learning_rate >= 0.0,
                "training.learning_rate",
                format!("must be a finite number >= 0, got {}", t.learning_rate),
            ),
            (
                t.weight_decay.is_finite() && t.weight_decay >= 0.0,
                "training.weight_decay",
                format!("must be >= 0, got {}", t.weight_decay),
            ),
            (
                t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0,
                "training.max_grad_norm",
                format!(
                    "must be >= 0 (0 disables clipping), got {}",
                    t.max_grad_norm
                ),
            ),
            (
                (0.0..1.0).contains(&o.beta1),
                "optimizer.beta1",
                format!("must be in [0, 1), got {}", o.beta1),
            ),
            (
                (0.0..1.0).contains(&o.beta2),
                "optimizer.beta2",
                format!("must be in [0, 1), got {}", o.beta2),
            ),
            (
                o.eps > 0.0,
                "optimizer.eps",
                format!("must be > 0, got {}", o.eps),
            ),
            (
                self.memory.num_grad_slabs > 0,
                "memory.num_grad_slabs",
                "must be > 0".into(),
            ),
            (
                self.memory.ce_chunk_tokens > 0,
                "memory.ce_chunk_tokens",
                "must be > 0".into(),
            ),
        ];
        for (ok, key, msg) in checks {
            if !ok {
                return Err(Error::invalid(key, msg));
            }
        }
        bounds::check(self)?;
        self.validate_hf_keys()?;
        self.validate_stage()?;
        self.checkpoint.validate()?;
        if self.memory.checkpoint_interval != 1 {
            return Err(Error::invalid(
                "memory.checkpoint_interval",
                format!(
                    "only 1 is implemented (every layer's input is kept), got {}",
                    self.memory.checkpoint_interval
                ),
            ));
        }
        let master_in_store = match self.memory.master_weights {
            MasterWeights::Float32 => None,
            MasterWeights::Split => Some("split keeps the master's high half in the bf16 store"),
            MasterWeights::Bfloat16 => Some("bfloat16 keeps the master in the bf16 store"),
        };
        if let Some(why) = master_in_store
            && self.model.dtype != DType::Bfloat16
        {
            return Err(Error::invalid(
                "memory.master_weights",
                format!("{why}: it needs model.dtype: bfloat16"),
            ));
        }
        self.validate_resident()?;
        self.validate_offload()?;
        if let Some(d) = &self.model.devices {
            let mut seen = d.clone();
            seen.sort_unstable();
            seen.dedup();
            if d.is_empty() || seen.len() != d.len() {
                return Err(Error::invalid(
                    "model.devices",
                    format!("must list distinct CUDA device indices, got {d:?}"),
                ));
            }
        }
        self.validate_eval()?;
        self.tensorboard_dir()?;
        self.dataset.validate()
    }

    /// `memory.resident_blocks` is updated on the GPUs with the host's own arithmetic: an
    /// fp32 or split master and fp32 moments.
    /// HF Trainer's keys that are turned into this config's at launch.
    fn validate_hf_keys(&self) -> Result<()> {
        let t = &self.training;
        if t.per_device_train_batch_size == Some(0) {
            return Err(Error::invalid(
                "training.per_device_train_batch_size",
                "must be > 0",
            ));
        }
        if let Some(e) = t.num_train_epochs.filter(|e| !(e.is_finite() && *e > 0.0)) {
            return Err(Error::invalid(
                "training.num_train_epochs",
                format!("must be a number > 0, got {e}"),
            ));
        }
        if let Some(r) = t.warmup_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
            return Err(Error::invalid(
                "training.warmup_ratio",
                format!("must be within [0, 1], got {r}"),
            ));
        }
        if self.dataset.max_samples == Some(0) {
            return Err(Error::invalid("dataset.max_samples", "must be > 0"));
        }
        self.validate_schedule()
    }

    /// `training.per_device_train_batch_size` turned into the global `batch_size` for
    /// `world` workers (all nodes), with the line that says so; None when the config
    /// gives the global batch.
    pub fn resolve_batch(&mut self, world: usize) -> Option<String> {
        let t = &mut self.training;
        let per = t.per_device_train_batch_size?;
        t.batch_size = per * world * t.gradient_accumulation_steps;
        Some(format!(
            "batch: {per} per device x {world} worker(s) x {} accumulation step(s) = {} sequences per optimizer step",
            t.gradient_accumulation_steps, t.batch_size
        ))
    }

    /// `training.num_train_epochs` and `training.warmup_ratio` turned into `num_steps` and
    /// `warmup_steps` for `samples` training samples (pairs under DPO), as HF Trainer counts
    /// them, with the line that says so; None when neither is given.
    pub fn resolve_steps(&mut self, samples: usize, noun: &str) -> Option<String> {
        let t = &mut self.training;
        let mut said = Vec::new();
        if let Some(epochs) = t.num_train_epochs {
            let per_epoch = samples.div_ceil(t.batch_size).max(1) as u64;
            t.num_steps = ((epochs * per_epoch as f64).ceil() as u64).max(1);
            said.push(format!(
                "{epochs} epoch(s) of {samples} {noun} at {} per step: {} steps ({per_epoch} per epoch)",
                t.batch_size, t.num_steps
            ));
        }
        if let Some(ratio) = t.warmup_ratio {
            t.warmup_steps = (ratio * t.num_steps as f64).ceil() as u64;
            said.push(format!(
                "warm-up {} steps (warmup_ratio {ratio} of {})",
                t.warmup_steps, t.num_steps
            ));
        }
        (!said.is_empty()).then(|| said.join("; "))
    }

    fn validate_resident(&self) -> Result<()> {
        let m = &self.memory;
        if m.resident_blocks == ResidentBlocks::Off {
            return Ok(());
        }
        let why = if m.master_weights == MasterWeights::Bfloat16 {
            Some(
                "memory.master_weights: bfloat16 (stochastic rounding) is updated on the host only; use float32 or split",
            )
        } else if m.moments_dtype != DType::Float32 {
            Some("memory.moments_dtype: bfloat16 is updated on the host only; use float32")
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::invalid("memory.resident_blocks", why)),
            None => Ok(()),
        }
    }

    /// `memory.optimizer_offload: nvme` names its drives, and `memory.nvme_path` comes with
    /// it; the workers do not reach the drives, so no block is resident.
    fn validate_offload(&self) -> Result<()> {
        let m = &self.memory;
        match m.optimizer_offload {
            OptimizerOffload::None if !m.nvme_path.is_empty() => Err(Error::invalid(
                "memory.nvme_path",
                "is read only with memory.optimizer_offload: nvme (the default is none)",
            )),
            OptimizerOffload::None if m.keep_nvme_state => Err(Error::invalid(
                "memory.keep_nvme_state",
                "keeps the files of memory.optimizer_offload: nvme, which is not set (the \
                 default is none)",
            )),
            OptimizerOffload::None => Ok(()),
            OptimizerOffload::Nvme
                if m.keep_nvme_state && matches!(self.training.stage, Stage::Dpo | Stage::Grpo) =>
            {
                Err(Error::invalid(
                    "memory.keep_nvme_state",
                    format!(
                        "not with training.stage: {} yet: its reference log-probabilities are \
                         kept by checkpoints, not beside the drives' state (resume from a \
                         checkpoint instead)",
                        self.training.stage.as_str()
                    ),
                ))
            }
            OptimizerOffload::Nvme if m.nvme_path.is_empty() => Err(Error::invalid(
                "memory.nvme_path",
                "memory.optimizer_offload: nvme needs one directory per drive (a path or a list)",
            )),
            OptimizerOffload::Nvme if m.resident_blocks != ResidentBlocks::Off => {
                Err(Error::invalid(
                    "memory.optimizer_offload",
                    "nvme keeps the optimizer's state on the host's drives, which the GPUs \
                     holding resident blocks do not reach: set memory.resident_blocks: off",
                ))
            }
            OptimizerOffload::Nvme => {
                let mut seen = m.nvme_path.clone();
                seen.sort();
                seen.dedup();
                match seen.len() == m.nvme_path.len() {
                    true => Ok(()),
                    false => Err(Error::invalid(
                        "memory.nvme_path",
                        format!("lists a directory twice: {:?}", m.nvme_path),
                    )),
                }
            }
        }
    }

    /// The evaluation keys: `training.eval_steps` and `per_device_eval_batch_size` need an
    /// eval set, and are positive.
    fn validate_eval(&self) -> Result<()> {
        let t = &self.training;
        if t.eval_steps == Some(0) {
            return Err(Error::invalid(
                "training.eval_steps",
                "must be > 0 (leave it out to evaluate only after the last step)",
            ));
        }
        if t.per_device_eval_batch_size == Some(0) {
            return Err(Error::invalid(
                "training.per_device_eval_batch_size",
                "must be > 0",
            ));
        }
        let keys = [
            ("training.eval_steps", t.eval_steps.is_some()),
            (
                "training.per_device_eval_batch_size",
                t.per_device_eval_batch_size.is_some(),
            ),
        ];
        match keys.iter().find(|(_, set)| *set) {
            Some((key, _)) if !self.dataset.has_eval_set() => Err(Error::invalid(
                *key,
                "needs an eval set: dataset.val_size, dataset.eval_name or dataset.eval_path",
            )),
            _ => Ok(()),
        }
    }

    /// Where TensorBoard event files go (None unless `logging.report_to` names `tensorboard`).
    pub fn tensorboard_dir(&self) -> Result<Option<PathBuf>> {
        self.logging.tensorboard_dir(
            self.training.output_dir.as_deref(),
            self.checkpoint.dir.as_deref(),
        )
    }

    /// Checks that the global batch splits evenly over `workers` x accumulation steps.
    pub fn validate_world(&self, workers: usize) -> Result<()> {
        let t = &self.training;
        let per = workers * t.gradient_accumulation_steps;
        if workers == 0 || !t.batch_size.is_multiple_of(per) {
            return Err(Error::invalid(
                "training.batch_size",
                format!(
                    "{} is not divisible by workers ({workers}) x gradient_accumulation_steps ({})",
                    t.batch_size, t.gradient_accumulation_steps
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
