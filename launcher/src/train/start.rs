//! A run's start-up, phase by phase, in the order [`Trainer::new`] runs them:
//!
//! 1. [`preflight`]: everything that can refuse the run, before anything large is
//!    allocated or loaded: the worker binary and the trackers' interpreter, the output
//!    directories (checked, locked, a half-done export recovered), the checkpoint to
//!    resume, the config, data and plan against this machine's memory, the outputs.
//! 2. [`host_state`]: the host state allocated, the initial weights loaded or the resumed
//!    checkpoint restored, the checkpoint writer ready.
//! 3. [`workers`]: one worker per rank spawned, registered and warmed up.
//! 4. [`reference_passes`]: what the objective computes under the initial weights before
//!    step 1 (DPO's and GRPO's reference log-probabilities), then the eval set.
//!
//! [`Trainer::new`]: super::Trainer::new

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use mt::checkpoint::carried::Carried;
use mt::checkpoint::vision::VisionRegion;
use mt::checkpoint::{self, ExportOptions, lock::DirLock, writer::Writer};
use mt::config::hf::ModelSpec;
use mt::config::vision::TowerSpec;
use mt::config::{Init as InitKind, MasterWeights, RunConfig};
use mt::data::Dataset;
use mt::host::HostState;
use mt::layout::Layout;
use mt::objective::Objective;
use mt::plan::HostPlan;
use mt::protocol::{Device, Init, LayerBuffer, VisionInit};

use super::objective::Stage;
use super::{check_outputs, keep, nodes, resident, weights};
use crate::cli::{Placement, Resume};
use crate::dpo::Preference;
use crate::eval::ForwardCut;
use crate::eval::{self, EvalSet};
use crate::grpo::{Policy, reference_logps};
use crate::mpi::Mpi;
use crate::prepare::Prepared;
use crate::supervisor::Supervisor;

/// What the launcher was asked to do once started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Train on the config's dataset for its steps (`mt-launch --config X`).
    Run,
    /// Take batches and commands from a client (`mt-launch serve`, [`crate::serve`]).
    Serve,
}

/// What the command line asks a run to write besides the model.
pub struct Outputs {
    pub metrics_out: Option<PathBuf>,
    pub dump_grads: Option<PathBuf>,
    pub dump_logits: Option<PathBuf>,
}

/// A run checked and planned, nothing large allocated yet ([`preflight`]).
pub(super) struct Preflight {
    pub mode: Mode,
    pub cfg: RunConfig,
    pub placement: Placement,
    pub mpi: Option<&'static Mpi>,
    /// Node 0 (or the only one): writes the run's files.
    pub lead: bool,
    pub worker: crate::torch::Worker,
    pub trackers: Option<crate::trackers::Resolved>,
    /// `training.output_dir` and `checkpoint.dir`, locked for the whole run (node 0).
    pub locks: Vec<DirLock>,
    /// The checkpoint directory resumed, checked against the config.
    pub resume: Option<PathBuf>,
    /// The optimizer state kept on the drives resumed (its manifest's path, and the
    /// manifest), checked against the config (`memory.keep_nvme_state`).
    pub kept: Option<(PathBuf, mt::host::Kept)>,
    pub spec: ModelSpec,
    pub layout: Layout,
    pub data: Dataset,
    pub plan: HostPlan,
    /// Rows per micro-batch and the longest row.
    pub micro_batch: (usize, usize),
    pub objective: Objective,
    /// Leading blocks resident on every GPU, and their device bytes.
    pub resident: (usize, u64),
    pub schedule: checkpoint::state::Schedule,
    /// This node's outputs (node 0's are the run's; the others write none).
    pub outputs: Outputs,
    pub tensorboard_dir: Option<PathBuf>,
}

/// What a launch asks for ([`super::Trainer::new`]).
pub struct Args {
    pub mode: Mode,
    pub cfg: RunConfig,
    pub placement: Placement,
    pub outputs: Outputs,
    /// `--resume` (or `training.resume_from_checkpoint`).
    pub resume: Option<Resume>,
    /// `--force`: start although the device plan says the micro-batch does not fit.
    pub force: bool,
}

/// Phase 1: checks everything that can refuse the run, in the order that creates nothing
/// a refusal would leave behind; reads the data and plans the memory.
pub(super) fn preflight(args: Args) -> Result<Preflight> {
    let Args {
        mode,
        cfg,
        placement,
        outputs,
        resume,
        force,
    } = args;
    let mpi = crate::mpi::world();
    let lead = mpi.is_none_or(|m| m.rank == 0);
    // The worker and its libtorch, found before anything is claimed or loaded.
    let worker = crate::torch::locate()?;
    // W&B and MLflow's interpreter and packages, checked before anything else.
    let trackers = match lead {
        true => crate::trackers::resolve(&cfg.logging)?,
        false => None,
    };
    // Directories that are not the model's nor hold others' files, locked for the whole
    // run; then the checkpoint to resume, resolved and checked before the clean-up of
    // dead writers' directories (which must never be it).
    if let Some(dir) = cfg.training.output_dir.as_ref().filter(|_| lead) {
        checkpoint::check_writable(dir, "training.output_dir")?;
    }
    if let Some(dir) = cfg.checkpoint.dir.as_ref().filter(|_| lead) {
        checkpoint::check_writable(dir, "checkpoint.dir")?;
    }
    let locks = match lead {
        true => checkpoint::ownership::claim(&cfg)?,
        false => Vec::new(),
    };
    // Under the lock, an export a killed run left half put in place is finished or
    // undone first: the checkpoints may live inside the output directory.
    if let Some(dir) = cfg.training.output_dir.as_ref().filter(|_| lead) {
        checkpoint::recover_export(dir)?;
    }
    let resume = resume
        .map(|r| {
            let dir = checkpoint::state::resolve(&r.from, cfg.checkpoint.dir.as_deref())?;
            anyhow::Ok((dir, r.accept_changes))
        })
        .transpose()?;
    if let Some(dir) = cfg.checkpoint.dir.as_ref().filter(|_| lead) {
        checkpoint::state::remove_stale(dir)?;
    }
    let mut prepared = match mode {
        Mode::Run => Prepared::new(&cfg, &placement)?,
        Mode::Serve => Prepared::for_serve(&cfg, &placement)?,
    };
    nodes::shard_plan(&mut prepared, &cfg, mpi);
    prepared.check_host_ram()?;
    prepared.check_device_memory(&cfg, &placement, force)?;
    // A server's `save` writes at once: it stages nothing, and holds no staging area.
    prepared.plan = match mode {
        Mode::Run => prepared.grown_plan(&cfg, &placement, mt::sysmem::available_host_bytes()),
        Mode::Serve => prepared.plan.without_staging(),
    };
    // A metrics path that cannot be written fails the launch now, not after start-up.
    if lead {
        check_outputs(&cfg, outputs.metrics_out.as_deref())?;
    }
    let tensorboard_dir = cfg.tensorboard_dir()?.filter(|_| lead);
    let micro_batch = prepared.micro_batch(&cfg, placement.world());
    let objective = Objective::of(&cfg)?;
    nodes::check_supported(mpi, &cfg, outputs.dump_grads.is_some())?;
    let outputs = match lead {
        true => outputs,
        false => Outputs {
            metrics_out: None,
            dump_grads: None,
            dump_logits: None,
        },
    };
    // Several nodes shard the optimizer state instead: `auto` keeps none there.
    let free = crate::prepare::device_opts(&cfg, &placement, &prepared.data)
        .device_free
        .filter(|_| mpi.is_none());
    let resident = crate::prepare::resident_blocks(&prepared, &cfg, &placement, free);
    if resident.0 > 0 && mpi.is_some() {
        return Err(anyhow!(
            "memory.resident_blocks: {} needs one node: several nodes shard the optimizer state instead (set it to off or auto)",
            cfg.memory.resident_blocks
        ));
    }
    let Prepared {
        spec,
        layout,
        data,
        plan,
    } = prepared;
    match (mode, data.files.is_empty()) {
        (Mode::Serve, true) => println!("dataset: none (a server trains on its client's batches)"),
        _ => println!("{}", data.summary()),
    }
    let mut cfg = cfg;
    let (per_epoch, noun) = data.epoch_len();
    if let Some(line) = cfg.resolve_steps(per_epoch, noun) {
        println!("{line}");
    }
    // The data read (its files exist), the steps resolved, the layout known.
    let schedule = weights::schedule(&cfg)?;
    if let Some((dir, accept)) = &resume {
        weights::check_resume(dir, &cfg, &layout, &schedule, *accept)?;
    }
    let resume = resume.map(|(dir, _)| dir);
    let kept = weights::check_kept(&cfg, &layout, &schedule, resume.as_deref(), mode, mpi)?;
    tracing::info!(
        params = layout.num_params(),
        layers = layout.num_layers(),
        workers = placement.workers,
        gpus = placement.gpus,
        dtype = ?cfg.model.dtype,
        grad_dtype = ?cfg.memory.grad_dtype,
        master_weights = ?cfg.memory.master_weights,
        host_bytes_per_param = format!("{:.2}", plan.bytes_per_param()),
        rows = data.rows.len(),
        "starting"
    );
    println!("{plan}");
    match mode {
        Mode::Run if lead => keep::say_where(&cfg),
        Mode::Run => {}
        Mode::Serve => keep::say_where_served(&cfg),
    }
    Ok(Preflight {
        mode,
        cfg,
        placement,
        mpi,
        lead,
        worker,
        trackers,
        locks,
        resume,
        kept,
        spec,
        layout,
        data,
        plan,
        micro_batch,
        objective,
        resident,
        schedule,
        outputs,
        tensorboard_dir,
    })
}

impl Preflight {
    /// Whether the initial model is also GRPO's reference (`grpo.beta` > 0), which a
    /// resume restores over only after the reference pass ([`weights`]).
    pub fn grpo_reference(&self) -> bool {
        self.objective.grpo().is_some_and(|p| p.beta > 0.0)
    }

    /// The W&B / MLflow runs' side process, started while the host state is allocated and
    /// the weights load.
    pub fn start_trackers(&mut self, t_start: Instant) -> Result<Option<crate::trackers::Side>> {
        let Some(resolved) = self.trackers.take() else {
            return Ok(None);
        };
        let (plan, layout, p) = (&self.plan, &self.layout, &self.placement);
        let figures = crate::trackers::PlanFigures {
            host_ram_total_bytes: plan.total(),
            host_bytes_per_param: plan.bytes_per_param(),
            host_ram_available_bytes: mt::sysmem::available_host_bytes(),
            params: layout.num_params() as u64,
            world_size: p.world(),
            workers: p.workers,
            gpus: p.gpus,
            nodes: p.nodes,
        };
        crate::trackers::Side::start(resolved, &self.cfg, &figures, t_start).map(Some)
    }
}

/// The host side of a run once phase 2 is done.
pub(super) struct Host {
    pub host: HostState,
    /// The model's buffers (rotary tables and the like) as read, for the workers.
    pub buffers: Vec<LayerBuffer>,
    /// A multimodal model's frozen vision tower, in its region for the workers.
    pub vision: Option<Arc<VisionRegion>>,
    pub export: ExportOptions,
    /// Periodic checkpoints (with `checkpoint.dir`, node 0).
    pub writer: Option<Writer>,
    /// The first step and the non-finite steps in a row before it (0, or the resumed
    /// checkpoint's).
    pub start_step: u64,
    pub nan_run: u64,
    /// Where the weights came from, for the start-up line.
    pub weights: &'static str,
}

/// Phase 2: allocates the host state and fills it: the initial weights, or the resumed
/// checkpoint (after the reference pass instead, under a GRPO reference).
pub(super) fn host_state(pre: &Preflight, clock: &mut Clock) -> Result<Host> {
    let (cfg, layout, resume) = (&pre.cfg, &pre.layout, &pre.resume);
    // Tensors carried as read: from the checkpoint resumed (which holds them as the model
    // directory did), else the model directory's; buffers at random init.
    let (carried, carried_from) = match (resume, cfg.model.init) {
        (Some(dir), _) => (Carried::read(dir, layout)?, dir.clone()),
        (None, InitKind::Pretrained) => (
            Carried::read(&cfg.model.path, layout)?,
            cfg.model.path.clone(),
        ),
        (None, InitKind::Random) => (Carried::init(layout), cfg.model.path.clone()),
    };
    let buffers = carried.buffers(layout, &carried_from)?;
    // A random init carries no tower (`Carried::init`): the workers get none.
    let random = resume.is_none() && cfg.model.init == InitKind::Random;
    let vision = match random {
        true => None,
        false => vision_region(cfg, &carried, &carried_from)?,
    };
    let export = ExportOptions {
        dtype: cfg.model.dtype,
        source: cfg.model.path.clone(),
        max_shard_bytes: cfg.checkpoint.max_shard_size.0,
        carried: std::sync::Arc::new(carried),
        chat_template: (cfg.dataset.chat_template.as_deref())
            .map(mt::config::chat_templates::chosen_text)
            .transpose()?,
    };
    // Periodic checkpoints are written in the background through the staging area the
    // plan holds (none: in place).
    let ck = &cfg.checkpoint;
    let writer = ck.dir.clone().filter(|_| pre.lead).map(|root| {
        Writer::new(
            root,
            ck.keep_last,
            layout.clone(),
            export.clone(),
            pre.plan.staging,
        )
    });
    clock.prepared = Instant::now();
    let shards = nodes::shards(cfg, pre.mpi, layout);
    crate::unix::check_stop("start-up")?;
    let (resident, resident_bytes) = pre.resident;
    let workers = pre.placement.workers;
    if cfg.memory.optimizer_offload == mt::config::OptimizerOffload::Nvme && shards.is_some() {
        anyhow::bail!(
            "memory.optimizer_offload: nvme is not supported with the state sharded over nodes \
             (nodes.shard_state: true under mpirun) yet: pass --set nodes.shard_state=false, \
             or memory.optimizer_offload=none"
        );
    }
    if let Some(d) = mt::plan::DrivePlan::new(cfg, layout) {
        d.check()?;
    }
    let mut host = HostState::new(cfg, layout.clone(), workers, shards, resident)?;
    crate::unix::check_stop("host memory allocation")?;
    if let Some(d) = host.drives() {
        let m = &cfg.memory;
        let each = mt::layout::drives::drive_bytes(
            layout,
            m.master_weights,
            m.moments_dtype,
            d.dirs().len(),
        );
        println!(
            "optimizer state on {} drive(s) ({}): {:.2} GB each, {}; {:.2} GB of host buffers",
            d.dirs().len(),
            d.dirs()
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            each as f64 / 1e9,
            match d.direct() {
                true => "direct I/O",
                false => "through the page cache (O_DIRECT refused), fdatasync per pass",
            },
            d.window_bytes() as f64 / 1e9
        );
    }
    if resident > 0 {
        println!(
            "resident blocks: {resident} of {} ({:.2} GB on each worker's device): updated there, not streamed",
            host.layout.blocks.len(),
            resident_bytes as f64 / 1e9
        );
    }
    clock.allocated = Instant::now();
    let reference = pre.grpo_reference();
    let weights = match (resume, cfg.model.init) {
        _ if pre.kept.is_some() => "resumed from the state kept on the drives",
        (Some(_), _) if reference => "the initial model first, as the GRPO reference",
        (Some(_), _) => "resumed",
        (None, InitKind::Pretrained) => "loaded",
        (None, InitKind::Random) => "random init",
    };
    let (mut start_step, mut nan_run) = (0, 0);
    if let Some((path, kept)) = &pre.kept {
        (start_step, nan_run) = weights::resume_kept(&mut host, path, kept)?;
    } else if resume.is_none() || reference {
        weights::load_initial(&mut host, cfg, &pre.spec)?;
    }
    if let Some(dir) = resume.as_ref().filter(|_| !reference) {
        (start_step, nan_run) = weights::restore(&mut host, dir, cfg)?;
    }
    crate::unix::check_stop("weights loading")?;
    clock.weights = Instant::now();
    Ok(Host {
        host,
        buffers,
        vision,
        export,
        writer,
        start_step,
        nan_run,
        weights,
    })
}

/// The vision tower of `cfg`'s model, when it has one the workers compute, copied from
/// the carried tensors (read from `from`) into its region in the store's dtype.
fn vision_region(
    cfg: &RunConfig,
    carried: &Carried,
    from: &Path,
) -> Result<Option<Arc<VisionRegion>>> {
    let Some(spec) = TowerSpec::from_model_dir(&cfg.model.path)? else {
        return Ok(None);
    };
    let name = format!("mt-{}-vision", std::process::id());
    let training = cfg.vlm.training();
    let region = VisionRegion::build(&name, &spec, training, carried, cfg.model.dtype, from)?;
    let trained = match training.describe() {
        "" => String::new(),
        what => format!(", {what}"),
    };
    println!(
        "vision tower: {} blocks, {:.1} M parameters frozen ({:.2} GB shared with the workers){trained}",
        spec.depth(),
        region.layout.num_params() as f64 / 1e6,
        region.bytes() as f64 / 1e9
    );
    Ok(Some(Arc::new(region)))
}

/// How a server starts its workers again after `sleep` ([`workers`]).
pub(super) struct Relaunch {
    pub worker: crate::torch::Worker,
    pub inits: Vec<Init>,
    pub plan_bytes: u64,
    /// Keeps the vision region (whose fd `inits` name) open for the next start.
    _vision: Option<Arc<VisionRegion>>,
}

/// Phase 3: spawns one worker per rank on the host state, once the trackers' runs have
/// started (a failure to start them fails the launch before the workers spawn). A server
/// keeps what it takes to start them again.
pub(super) fn workers(
    pre: &Preflight,
    host: &Host,
    trackers: Option<&mut crate::trackers::Side>,
    clock: &mut Clock,
) -> Result<(Supervisor, Option<Relaunch>)> {
    let (cfg, placement) = (&pre.cfg, &pre.placement);
    // CUDA workers warm up at the configured micro-batch shape.
    let warm_up = (placement.gpus > 0).then_some(pre.micro_batch);
    let opts = crate::prepare::device_opts(cfg, placement, &pre.data);
    let state = &host.host;
    let split = cfg.memory.master_weights == MasterWeights::Split;
    let dump_logits = pre.outputs.dump_logits.as_ref();
    // How the workers read image files, for a model with a vision tower.
    let pixels = match &host.vision {
        Some(_) => mt::data::Images::of_model(&cfg.model.path)?.processor(),
        None => None,
    };
    let inits = (0..placement.workers)
        .map(|rank| {
            let device = match placement.devices.get(rank) {
                Some(&d) => Device::Cuda(d),
                None => Device::Cpu,
            };
            Init {
                rank,
                world: placement.workers,
                device,
                threads: worker_threads(device),
                spec: pre.spec.clone(),
                layout: state.layout.clone(),
                dtype: cfg.model.dtype,
                store: state.store.handle(),
                slab: state.slabs.handle(rank),
                num_slots: cfg.memory.num_grad_slabs,
                ce_chunk_tokens: cfg.memory.ce_chunk_tokens,
                tile_tokens: cfg.memory.tile_tokens,
                recompute: opts.recompute,
                device_free: opts.device_free,
                offload_activations: cfg.memory.offload_activations,
                dump_logits: dump_logits.map(|p| match placement.workers {
                    1 => p.clone(),
                    _ => PathBuf::from(format!("{}.rank{rank}", p.display())),
                }),
                warm_up,
                buffers: host.buffers.clone(),
                objective: pre.objective,
                resident: state.resident_init(split),
                vision: host.vision.as_ref().map(|v| VisionInit {
                    layout: v.layout.clone(),
                    region: v.handle(),
                    pixels: pixels.clone(),
                    row_image_tokens: opts.vision.and_then(|v| v.row_tokens),
                }),
            }
        })
        .collect::<Vec<Init>>();
    let relaunch = (pre.mode == Mode::Serve).then(|| Relaunch {
        worker: pre.worker.clone(),
        inits: inits.clone(),
        plan_bytes: pre.plan.total(),
        _vision: host.vision.clone(),
    });
    let waits_for_trackers = trackers.is_some();
    if let Some(side) = trackers {
        side.wait_ready()?;
    }
    clock.ready = Instant::now();
    let sup = Supervisor::start(&pre.worker, inits, pre.plan.total())?;
    clock.workers = Instant::now();
    println!("{}", clock.line(host.weights, &sup, waits_for_trackers));
    Ok((sup, relaunch))
}

/// What the objective computed before step 1 ([`reference_passes`]).
pub(super) struct References {
    pub stage: Stage,
    pub eval: Option<EvalSet>,
    /// The first step and the non-finite steps in a row before it, where the resumed
    /// checkpoint was restored after the GRPO reference pass.
    pub restored: Option<(u64, u64)>,
}

/// Phase 4: the resident blocks sent to the workers; under DPO and GRPO (`grpo.beta` > 0)
/// the reference log-probabilities under the initial weights, of the training rows and of
/// the eval set's, and after them the resumed checkpoint restored; the eval set. A server's
/// batches bring their own references: it has no pass to run.
pub(super) fn reference_passes(
    pre: &mut Preflight,
    host: &mut Host,
    sup: &mut Supervisor,
) -> Result<References> {
    let cfg = &pre.cfg;
    let timeout = Duration::from_secs(cfg.training.worker_timeout_s);
    if let Some(m) = pre.mpi {
        m.set_timeout(timeout);
    }
    resident::push_resident(&mut host.host, sup, timeout)?;
    if pre.mode == Mode::Serve {
        let stage = match pre.objective {
            Objective::Lm => Stage::Lm,
            Objective::Dpo(_) => Stage::Dpo(Preference::served()),
            Objective::Grpo(p) => Stage::Grpo(Policy::served(p)),
        };
        return Ok(References {
            stage,
            eval: None,
            restored: None,
        });
    }
    let world = pre.placement.world();
    let eval_micro = eval::rows_per_micro(cfg, world);
    let micro = pre.micro_batch.0;
    let pad = pre.spec.pad_token_id as i32;
    let resume = pre.resume.as_deref();
    let reference = pre.grpo_reference();
    let data = &mut pre.data;
    let dpo = (pre.objective.dpo())
        .map(|_| Preference::new(data, sup, (micro, eval_micro), pad, timeout, resume))
        .transpose()?;
    let (mut refs, mut eval_refs, mut restored) = (None, None, None);
    if reference {
        let cut = |rows| ForwardCut { rows, pad, timeout };
        refs = Some(reference_logps(&data.rows, sup, cut(micro))?);
        if !data.eval.is_empty() {
            eval_refs = Some(reference_logps(&data.eval, sup, cut(eval_micro))?);
        }
        if let Some(dir) = resume {
            restored = Some(weights::restore(&mut host.host, dir, cfg)?);
            resident::push_resident(&mut host.host, sup, timeout)?;
        }
    }
    let eval = match data.eval.is_empty() {
        true => None,
        false => {
            let objective = match pre.objective {
                Objective::Lm => eval::Objective::Tokens,
                Objective::Dpo(params) => eval::Objective::Pairs {
                    params,
                    refs: (dpo.as_ref().and_then(|p| p.eval.as_ref()))
                        .map(|e| e.0.clone())
                        .unwrap_or_default(),
                },
                Objective::Grpo(params) => {
                    let r = data.eval_rollouts.take().unwrap_or_default();
                    eval::Objective::rollouts(params, r, eval_refs)
                }
            };
            let rows = std::mem::take(&mut data.eval);
            Some(EvalSet::for_run(cfg, world, &rows, pad, objective))
        }
    };
    let start_step = restored.map_or(host.start_step, |r| r.0);
    let stage = match pre.objective {
        Objective::Lm => Stage::Lm,
        Objective::Dpo(_) => Stage::Dpo(dpo.context("the DPO reference log-probabilities")?),
        Objective::Grpo(p) => Stage::Grpo(Policy::new(p, data, resume, start_step, refs)?),
    };
    Ok(References {
        stage,
        eval,
        restored,
    })
}

/// When each phase of the start-up ended, for the start-up line.
pub(super) struct Clock {
    pub start: Instant,
    pub prepared: Instant,
    pub allocated: Instant,
    pub weights: Instant,
    /// The trackers' runs started (the workers spawn after).
    pub ready: Instant,
    pub workers: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        let now = Instant::now();
        Clock {
            start: now,
            prepared: now,
            allocated: now,
            weights: now,
            ready: now,
            workers: now,
        }
    }

    /// Seconds from launch to the workers' readiness.
    pub fn startup_s(&self) -> f64 {
        secs(self.start, self.workers)
    }

    /// `start-up 12.3s: config and data …, host state …, weights … (how), workers …`.
    fn line(&self, weights: &str, sup: &Supervisor, trackers: bool) -> String {
        let waited = match trackers {
            true => format!(", report_to runs {:.1}s", secs(self.weights, self.ready)),
            false => String::new(),
        };
        format!(
            "start-up {:.1}s: config and data {:.1}s, host state {:.1}s, weights {:.1}s ({weights}), workers {:.1}s (host registration {:.1}s, warm-up {:.1}s){waited}",
            self.startup_s(),
            secs(self.start, self.prepared),
            secs(self.prepared, self.allocated),
            secs(self.allocated, self.weights),
            secs(self.ready, self.workers),
            sup.register_s,
            sup.warm_up_s,
        )
    }
}

fn secs(a: Instant, b: Instant) -> f64 {
    b.duration_since(a).as_secs_f64()
}

/// Intra-op threads of a worker on `device`.
///
/// A CPU worker computes single-threaded. MKL's GEMM blocks (and so rounds) a product by
/// the thread count it runs with: on an AMD EPYC, `linear` of a 10 x 48 input by a 48 x 48
/// weight gives other bits on 2 threads than on 1. A thread count derived from the worker
/// count would make one worker accumulating W micro-batches differ from W workers, and a
/// run differ from one machine to the next; with one thread each, a micro-batch's
/// gradient is the same bits whatever the number of workers or cores. On CPU, cores are
/// used through `--workers`, which gives the same training by design. A GPU worker's
/// CPU-side tensors are its micro-batch's ids and labels, tiny: one thread too, so that
/// no OpenMP pool of its spins on the cores the launcher's reduce and AdamW need.
fn worker_threads(_device: Device) -> usize {
    1
}
