//! What a run is built from, checked before any worker starts (the trainer, `plan` and
//! `--dry-run` share it): the model, its layout, the dataset and eval set, the host plan.

use anyhow::{Result, anyhow, bail};
use mt::checkpoint;
use mt::config::hf::{AttentionKind, ModelSpec};
use mt::config::{Init, RunConfig, Stage, TowerTraining};
use mt::data::Dataset;
use mt::layout::Layout;
use mt::plan::{DeviceOpts, DevicePlan, Fit, HostPlan};
use mt::protocol::Device;

use crate::cli::Placement;

/// Everything a run is built from, checked before any worker starts: the model, its
/// layout, the dataset (every record read and tokenized) and the host memory plan, which
/// must fit in the RAM available now.
pub struct Prepared {
    pub spec: ModelSpec,
    pub layout: Layout,
    pub data: Dataset,
    pub plan: mt::plan::HostPlan,
}

impl Prepared {
    pub fn new(cfg: &RunConfig, placement: &Placement) -> Result<Prepared> {
        Self::build(cfg, placement, true)
    }

    /// What `mt-launch plan` sizes: as [`Prepared::new`], except that a text dataset is
    /// not read when the model has no tokenizer here (a shipped architecture standing in
    /// for a hub id, or a directory with config.json alone): the run is then sized from
    /// `dataset.max_seq_len`, and `data` is empty.
    pub fn for_plan(cfg: &RunConfig, placement: &Placement) -> Result<Prepared> {
        let tokenizer =
            cfg.model.shipped.is_none() && cfg.model.path.join("tokenizer.json").is_file();
        let read = tokenizer || !mt::data::needs_tokenizer(&cfg.dataset, cfg.training.stage)?;
        if !read && cfg.dataset.max_seq_len.is_none() {
            return Err(mt::Error::invalid(
                "dataset.max_seq_len",
                "needed to size a text dataset without its tokenizer (the model has no tokenizer.json here): set it",
            )
            .into());
        }
        Self::build(cfg, placement, read)
    }

    /// What `mt-launch serve` is built from: as [`Prepared::new`] where the config names a
    /// dataset (its rows size the micro-batch, its length the epochs), else no data, and
    /// the workers' micro-batch sized from `dataset.max_seq_len`, which is then required.
    pub fn for_serve(cfg: &RunConfig, placement: &Placement) -> Result<Prepared> {
        let ds = &cfg.dataset;
        let named = ds.path.is_some() || ds.name.is_some();
        if !named && ds.max_seq_len.is_none() {
            return Err(mt::Error::invalid(
                "dataset.max_seq_len",
                "mt-launch serve sizes the workers' micro-batch from it when the config names no dataset: set it (the longest row a batch may hold)",
            )
            .into());
        }
        Self::build(cfg, placement, named)
    }

    fn build(cfg: &RunConfig, placement: &Placement, read_data: bool) -> Result<Prepared> {
        cfg.validate_world(placement.world())?;
        let mut spec = cfg.model.spec()?;
        // What the weight files settle (a wrapper's names, a tied head stored untied) and
        // what they carry besides the trained tensors; a shipped architecture standing in
        // for a hub model has no files (its plan leaves carried tensors out).
        let carried = match (cfg.model.init, cfg.model.shipped) {
            (Init::Pretrained, None) => checkpoint::carried::resolve(&cfg.model.path, &mut spec)?,
            _ => 0,
        };
        if cfg.dataset.packing && spec.layer_types.contains(&AttentionKind::Linear) {
            // The delta rule's recurrent state would flow from one packed document into
            // the next; transformers' torch path has no per-document reset either.
            return Err(mt::Error::invalid(
                "dataset.packing",
                format!(
                    "packing is not supported for {} models: their linear-attention layers carry state across the documents of a packed row (set dataset.packing: false)",
                    spec.model_type
                ),
            )
            .into());
        }
        // Parameters and tensors counted with checked arithmetic before anything is sized.
        let config_json = match cfg.model.shipped {
            Some(s) => std::path::Path::new("configs")
                .join(s.dir)
                .join("config.json"),
            None => cfg.model.path.join("config.json"),
        };
        let layout = run_layout(cfg, &spec, &config_json)?;
        // A vision-language model's frozen tower, in its region for the workers (a random
        // init has none).
        let vision = match cfg.model.init {
            Init::Pretrained => vision_bytes(cfg)?,
            Init::Random => 0,
        };
        let data = match read_data {
            true => Dataset::load(
                &cfg.dataset,
                cfg.training.stage,
                &cfg.model.path,
                spec.vocab_size,
                cfg.training.seed,
            )?,
            false => Dataset::default(),
        };
        crate::unix::check_stop(mt::cancel::DATA)?;
        let carried = match cfg.model.init {
            Init::Pretrained => carried,
            Init::Random => checkpoint::carried::Carried::init(&layout).bytes(),
        };
        let kl = cfg.training.stage == Stage::Grpo && cfg.grpo.beta.unwrap_or(0.0) > 0.0;
        let reference = match kl {
            true => mt::plan::grpo_reference_bytes(
                data.rows.iter().chain(&data.eval).map(|r| r.label_tokens()),
            ),
            false => 0,
        };
        let plan =
            mt::plan::HostPlan::new(&layout, mt::plan::HostOpts::new(cfg, placement.workers))
                .with_carried(carried)
                .with_vision(vision)
                .with_grpo_reference(reference)
                .with_resident_transfer(
                    cfg.memory.resident_blocks != mt::config::ResidentBlocks::Off,
                );
        let mut prepared = Prepared {
            spec,
            layout,
            data,
            plan,
        };
        if cfg.memory.offload_activations && placement.gpus > 0 {
            let (rows, seq_len) = prepared.micro_batch(cfg, placement.workers);
            let bytes = mt::plan::offloaded_inputs(
                prepared.spec.num_layers,
                prepared.spec.hidden_size,
                cfg.model.dtype,
                placement.workers,
                rows,
                seq_len,
            );
            prepared.plan = prepared.plan.with_offloaded(bytes);
        }
        Ok(prepared)
    }

    /// Refuses a run whose host memory plan exceeds the RAM available now; one that fits
    /// only without its checkpoint staging area loses it (periodic checkpoints are then
    /// written in place), with a warning.
    pub fn check_host_ram(&mut self) -> Result<()> {
        let avail = mt::sysmem::available_host_bytes();
        let gb = |b: u64| b as f64 / 1e9;
        match self.plan.fit(avail) {
            Fit::Fits => {}
            Fit::WithoutStaging => {
                tracing::warn!(
                    "checkpoint.staging_size: the staging area ({:.2} GB) does not fit beside the \
                     training state ({:.2} GB available, {:.2} GB needed): periodic checkpoints are \
                     written in place, and training waits for each",
                    gb(self.plan.staging),
                    gb(avail.unwrap_or(0)),
                    gb(self.plan.total())
                );
                self.plan = self.plan.without_staging();
            }
            Fit::Short => {
                let lean = self.plan.without_staging();
                let fitting: Vec<String> = lean
                    .modes()
                    .into_iter()
                    .filter(|m| avail.is_none_or(|a| m.total <= a))
                    .map(|m| {
                        format!(
                            "{} B/param, {:.2} GB: {}",
                            m.bytes_per_param,
                            gb(m.total),
                            m.flags
                        )
                    })
                    .collect();
                let hint = match fitting.is_empty() {
                    true => "; no memory mode fits this host: use a host with more RAM, or several nodes (docs/nodes.md)".to_string(),
                    false => format!("; these memory modes fit (same training, leaner host state: docs/configuration.md):\n  {}", fitting.join("\n  ")),
                };
                bail!(
                    "host RAM is short: this run needs {:.2} GB (see `mt-launch plan`), {:.2} GB is available (MemAvailable){hint}",
                    gb(lean.total()),
                    gb(avail.unwrap_or(0))
                )
            }
        }
        Ok(())
    }

    /// What each of `workers` CPU workers may use for its micro-batch: an equal share of
    /// the host RAM available now less the host plan (as [`Prepared::check_host_ram`]
    /// left it); None where the available RAM is unknown.
    fn cpu_memory(&self, workers: usize) -> Option<Vec<mt::plan::DeviceMemory>> {
        let avail = mt::sysmem::available_host_bytes()?;
        let share = avail.saturating_sub(self.plan.total()) / workers.max(1) as u64;
        let m = mt::plan::DeviceMemory {
            device: Device::Cpu,
            free: share,
            total: avail,
        };
        Some(vec![m; workers])
    }

    /// The shape of one worker's micro-batch: rows = training.batch_size / (workers x
    /// gradient_accumulation_steps) (at least 1; twice that under `dpo`, whose batch counts
    /// pairs), tokens per row = dataset.max_seq_len, or the longest row when that is unset
    /// (1 without data).
    pub fn micro_batch(&self, cfg: &RunConfig, workers: usize) -> (usize, usize) {
        let t = &cfg.training;
        let rows = cfg.rows_per_step() / (workers * t.gradient_accumulation_steps);
        let longest = self.data.rows.iter().map(|r| r.input_ids.len()).max();
        (
            rows.max(1),
            cfg.dataset.max_seq_len.or(longest).unwrap_or(1),
        )
    }

    /// Each worker's device plan for its configured micro-batch.
    pub fn device_plan(&self, cfg: &RunConfig, placement: &Placement) -> DevicePlan {
        let (rows, seq_len) = self.micro_batch(cfg, placement.world());
        DevicePlan::new(
            &self.spec,
            &self.layout,
            device_opts(cfg, placement, &self.data),
            rows,
            seq_len,
        )
    }

    /// The plan with a default checkpoint staging area grown into the RAM `avail` leaves
    /// beside it and the workers (`HostPlan::grow_staging`). A CPU worker holds its
    /// micro-batch's activations in host RAM (its device plan); a GPU worker holds
    /// libtorch, its CUDA context and small pinned buffers, for which
    /// [`GPU_WORKER_HOST_RESERVE`] is an allowance.
    pub fn grown_plan(
        &self,
        cfg: &RunConfig,
        placement: &Placement,
        avail: Option<u64>,
    ) -> HostPlan {
        let per_worker = match placement.gpus {
            0 => self.device_plan(cfg, placement).total(),
            _ => GPU_WORKER_HOST_RESERVE,
        };
        let reserve = placement.workers as u64 * per_worker;
        self.plan
            .grow_staging(avail.map(|a| a.saturating_sub(reserve)))
    }

    /// Refuses a run whose micro-batch does not fit the memory a GPU it uses has free, by
    /// the device plan (`mt::plan::check_device_fit`); with `force`, warns and goes on.
    /// CPU workers hold their micro-batch's activations in host RAM: each gets an equal
    /// share of the RAM available beside the host plan ([`Prepared::cpu_memory`]).
    /// Skipped where that memory cannot be known (no CUDA driver, no MemAvailable).
    pub fn check_device_memory(
        &self,
        cfg: &RunConfig,
        placement: &Placement,
        force: bool,
    ) -> Result<()> {
        let read = crate::gpu::memory(&placement.devices, placement.workers);
        let cpu = || (placement.gpus == 0).then(|| self.cpu_memory(placement.workers))?;
        let (memory, source) = match (read, cpu()) {
            (Some(m), _) => (m, crate::gpu::source()),
            (None, Some(m)) => (m, CPU_SOURCE),
            (None, None) => return Ok(()),
        };
        let shape = self.micro_batch(cfg, placement.world());
        let opts = device_opts(cfg, placement, &self.data);
        match mt::plan::check_device_fit(&self.spec, &self.layout, opts, shape, &memory, source) {
            Ok(()) => Ok(()),
            Err(short) if force => {
                tracing::warn!("--force: {short}");
                Ok(())
            }
            Err(short) => Err(anyhow!("{short} Pass --force to launch anyway.")),
        }
    }
}

/// Host RAM kept free for each GPU worker when the staging area grows: libtorch's
/// libraries and CPU allocator, the CUDA context's host side, pinned upload buffers. A
/// worker's own pages measured 1.06 GB at their peak (0.67 GB anonymous + 0.39 GB file;
/// Qwen2.5-7B shape with 4 layers, batch 16 and 64, one H200, 2026-11-23; its shared
/// memory is the store and slabs the host plan counts); 4 GB leaves a margin for other
/// shapes and libraries.
pub const GPU_WORKER_HOST_RESERVE: u64 = 4_000_000_000;

/// Where a CPU worker's memory figure comes from, for [`Prepared::check_device_memory`].
const CPU_SOURCE: &str =
    "host RAM left beside the host plan (MemAvailable, shared by the CPU workers) has";

/// The frozen vision tower of the run's model (a shipped architecture's where the run
/// names one); None for a text-only model.
fn vision_spec(cfg: &RunConfig) -> Result<Option<mt::config::vision::TowerSpec>> {
    use mt::config::vision::TowerSpec;
    Ok(match cfg.model.shipped {
        Some(s) => {
            let path = std::path::Path::new("configs")
                .join(s.dir)
                .join("config.json");
            TowerSpec::from_text(s.config_json, &path)?
        }
        None => TowerSpec::from_model_dir(&cfg.model.path)?,
    })
}

/// The layout a run of `cfg` trains: `spec`'s, counted with checked arithmetic, with the
/// vision tower's tensors that `vlm` trains in the embedding block. A `vlm` key that asks
/// to train a tower the model lacks, or one whose training is not written here, is an
/// error naming the key: the run would train something else than asked (`true`, the
/// default, is accepted on any model: nothing differs).
pub fn run_layout(
    cfg: &RunConfig,
    spec: &ModelSpec,
    config_json: &std::path::Path,
) -> Result<Layout> {
    let layout = Layout::checked(spec, config_json)?;
    let training = cfg.vlm.training();
    if training == TowerTraining::Frozen {
        return Ok(layout);
    }
    let key = training.key();
    let what = match training.encoder() {
        true => "vision encoder",
        false => "projector",
    };
    let Some(vision) = vision_spec(cfg)? else {
        return Err(mt::Error::invalid(
            key,
            format!(
                "false asks to train a vision tower's {what}, and `{}` has none this tool computes (a text-only model, or a tower not yet supported; vision-language models: {})",
                spec.wrapper.as_deref().unwrap_or(&spec.model_type),
                mt::config::vision::VISION_MODEL_TYPES.join(", ")
            ),
        )
        .into());
    };
    // Every tower this tool computes trains: the Qwen towers (Qwen3-VL's deepstack mergers
    // with its projector), Gemma 3's SigLIP and LLaVA-NeXT's CLIP (the layers after the one
    // `vision_feature_layer` reads stay frozen, as transformers leaves them).
    Ok(Layout::with_tower(spec, &vision, training))
}

/// The bytes of the frozen vision tower's region (its tensors in the store's dtype); 0 for
/// a text-only model.
fn vision_bytes(cfg: &RunConfig) -> Result<u64> {
    Ok(match vision_spec(cfg)? {
        Some(spec) => {
            let layout =
                mt::layout::vision::VisionLayout::new(&spec, "visual.", cfg.vlm.training());
            (layout.total * cfg.model.dtype.size()) as u64
        }
        None => 0,
    })
}

/// `memory.recompute` as the workers plan with it: `auto` keeps nothing where blocks are
/// resident (`memory.resident_blocks`), which take the memory the step leaves free.
pub fn recompute(cfg: &RunConfig) -> mt::config::Recompute {
    use mt::config::{Recompute, ResidentBlocks};
    match (cfg.memory.recompute, cfg.memory.resident_blocks) {
        (Recompute::Auto, r) if r != ResidentBlocks::Off => Recompute::Full,
        (r, _) => r,
    }
}

/// The device plan's options for `cfg` on `placement`, its images bounded by the rows of
/// `data`.
pub fn device_opts(cfg: &RunConfig, placement: &Placement, data: &mt::data::Dataset) -> DeviceOpts {
    DeviceOpts {
        dtype: cfg.model.dtype,
        ce_chunk_tokens: cfg.memory.ce_chunk_tokens,
        tile_tokens: cfg.memory.tile_tokens,
        recompute: recompute(cfg),
        packed: cfg.dataset.packing,
        offload_activations: cfg.memory.offload_activations,
        cpu: placement.gpus == 0,
        device_free: crate::gpu::memory(&placement.devices, placement.workers).and_then(|m| {
            m.iter()
                .filter(|d| d.device != Device::Cpu)
                .map(|d| d.free)
                .min()
        }),
        // A config.json that does not parse was refused when the run was prepared.
        vision: match cfg.model.init {
            Init::Pretrained => vision_spec(cfg).ok().flatten().map(|spec| {
                let training = cfg.vlm.training();
                let params =
                    mt::layout::vision::VisionLayout::new(&spec, "visual.", training).num_params();
                mt::plan::VisionDevice {
                    row_tokens: row_image_tokens(cfg, data),
                    ..mt::plan::VisionDevice::of(&spec, params, training)
                }
            }),
            Init::Random => None,
        },
    }
}

/// The most image tokens a row of `data` (training and eval) holds; None where no row was
/// read (`mt-launch plan` without the tokenizer, a server) or the model reads no images.
fn row_image_tokens(cfg: &RunConfig, data: &mt::data::Dataset) -> Option<u64> {
    let images = mt::data::Images::of_model(&cfg.model.path)
        .ok()?
        .processor()?;
    images.most_per_row(data.rows.iter().chain(&data.eval))
}

/// Leading blocks kept and updated on every GPU (`memory.resident_blocks`) and the device
/// bytes they take, `auto` resolved against `device_free` (the run's reading of the GPUs'
/// free memory) less the step's device plan with a seventh on top (the largest error
/// measured against it, 2026-11-23, was 11%) and 2 GB for torch's allocator. CPU workers
/// resolve `auto` to none.
pub fn resident_blocks(
    prepared: &Prepared,
    cfg: &RunConfig,
    placement: &Placement,
    device_free: Option<u64>,
) -> (usize, u64) {
    let layout = &prepared.layout;
    let fit = || {
        let Some(free) = device_free.filter(|_| placement.gpus > 0) else {
            return 0;
        };
        let opts = DeviceOpts {
            device_free: Some(free),
            ..device_opts(cfg, placement, &prepared.data)
        };
        let shape = prepared.micro_batch(cfg, placement.world());
        let step = DevicePlan::new(&prepared.spec, layout, opts, shape.0, shape.1).total();
        let budget = free.saturating_sub(step + step / 7 + 2_000_000_000);
        mt::plan::resident_fit(layout, cfg.model.dtype, cfg.memory.grad_dtype, budget)
    };
    let n = cfg.memory.resident_blocks.count(layout.blocks.len(), fit);
    let bytes = layout.blocks[..n]
        .iter()
        .map(|b| mt::plan::resident_block_bytes(b.len, cfg.model.dtype, cfg.memory.grad_dtype))
        .sum();
    (n, bytes)
}
