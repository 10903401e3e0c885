//! The step driver. A step reads like the algorithm: fetch the batch, run the workers'
//! forward and backward while reducing their gradients as layers arrive, clip, update.
//! After the steps `training.eval_steps` names (and the last), the eval set's loss under
//! the updated weights ([`crate::eval`]); the next step starts after it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use mt::checkpoint::carried::Carried;
use mt::checkpoint::{self, ExportOptions, writer::Writer};
use mt::config::hf::ModelSpec;
use mt::config::{CheckpointContents, Init as InitKind, RunConfig};
use mt::data::{Dataset, Sampler, StepPlan};
use mt::metrics::tensorboard::EventWriter;
use mt::metrics::{EvalMetrics, MetricsWriter, peak_rss_bytes};
use mt::objective::Objective;
use mt::optim::Moments;
use mt::protocol::{Device, Init, ToWorker};

use crate::cli::{Placement, Resume};
use crate::dpo::Preference;
use crate::eval::{self, EvalSet};
use crate::grpo::{Policy, reference_logps};
use crate::prepare::Prepared;
use crate::progress::{Progress, RunFacts, start_summary};
use crate::supervisor::Supervisor;
use mt::host::HostState;

mod gradients;
mod keep;
mod nodes;
mod objective;
mod resident;
mod step_end;
mod weights;
pub use keep::{Stopped, check_outputs};
pub(crate) use nodes::shard_plan;
pub(crate) use weights::{check_resume, schedule};

use gradients::StepOutcome;
use objective::{Cut, Stage};

pub struct Trainer {
    cfg: RunConfig,
    spec: ModelSpec,
    data: Dataset,
    sampler: Sampler,
    host: HostState,
    sup: Supervisor,
    /// Checkpoints (with `checkpoint.dir`); dropped after `sup`, so that a failing run
    /// stops its workers first and then lets a write in flight complete.
    writer: Option<Writer>,
    /// How `training.output_dir` and checkpoints export the model.
    export: ExportOptions,
    metrics: Option<MetricsWriter>,
    /// `logging.report_to: tensorboard`.
    tensorboard: Option<EventWriter>,
    /// The eval set, when the config gives one.
    eval: Option<EvalSet>,
    /// `training.stage` and the launcher's state of it: DPO's reference log-probabilities,
    /// GRPO's advantages and old log-probabilities ([`objective`]).
    stage: Stage,
    dump_grads: Option<PathBuf>,
    /// Non-finite steps in a row.
    nan_run: u64,
    /// The first step to run (0, or the resumed checkpoint's step).
    start_step: u64,
    progress: Progress,
    /// The host plan, whose total the launcher's resident peak is reported against.
    plan: mt::plan::HostPlan,
    /// Seconds from launch to the workers' readiness, reported with the first step.
    startup_s: Option<f64>,
    /// Seconds the step loop waited for a checkpoint write in flight before starting the
    /// next one, reported with the next step.
    checkpoint_wait_s: f64,
    /// How an update writes the Adam moments: `Keep` (the default) writes the weights
    /// first and the moments during the next step ([`Trainer::run`]); `Write` in the same
    /// pass (`MT_DEFER_MOMENTS=0`). Both give the same bits.
    moments: Moments,
    /// The other nodes ([`nodes`]): the MPI job under mpirun, else [`mt::host::Solo`]; the
    /// step makes the same calls either way.
    peers: &'static dyn mt::host::Peers,
    /// The MPI job, under mpirun: for what only a multi-node run does (the gradient
    /// exchange as blocks become final, the exchange's timings, the shared checkpoint clock).
    mpi: Option<&'static crate::mpi::Mpi>,
    /// Seconds the current update spent gathering the store from the other nodes
    /// (reported in `exchange_s`, left out of `optimizer_s`).
    update_exchange_s: f64,
    /// Of which, the seconds spent waiting for the other nodes to reach those exchanges.
    update_exchange_wait_s: f64,
    /// When the last checkpoint was due (or training started), for
    /// `checkpoint.every_minutes` ([`keep`]).
    since_checkpoint: Instant,
    /// The step and contents of the last checkpoint started.
    checkpointed: Option<(u64, CheckpointContents)>,
    /// The step and directory of the newest checkpoint written.
    last_written: Option<(u64, PathBuf)>,
    /// What checkpoints record of the run's settings, for a resume to compare.
    schedule: checkpoint::state::Schedule,
    /// The locks of `training.output_dir` and `checkpoint.dir` (node 0), held until the
    /// export and the last checkpoint are written: declared after `writer`, dropped after it.
    _locks: Vec<checkpoint::lock::DirLock>,
    /// `logging.report_to: wandb, mlflow`: their side process (node 0), dropped last, so
    /// that a failed run's workers are stopped before it waits for the runs to finish.
    trackers: Option<crate::trackers::Side>,
}

impl Trainer {
    pub fn new(
        cfg: RunConfig,
        placement: Placement,
        metrics_out: Option<PathBuf>,
        dump_grads: Option<PathBuf>,
        dump_logits: Option<PathBuf>,
        resume: Option<Resume>,
        force: bool,
    ) -> Result<Trainer> {
        let t_start = Instant::now();
        let mpi = crate::mpi::world();
        // Node 0 writes the run's files; the others hold the same state.
        let lead = mpi.is_none_or(|m| m.rank == 0);
        // The worker and its libtorch, found before anything is claimed or loaded.
        let worker = crate::torch::locate()?;
        // W&B and MLflow's interpreter and packages, checked before anything else.
        let trackers = match lead {
            true => crate::trackers::resolve(&cfg.logging)?,
            false => None,
        };
        // Before any work: directories that are not the model's nor hold others' files,
        // locked for the whole run; then the checkpoint to resume, resolved and checked
        // before the clean-up of dead writers' directories (which must never be it).
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
        let mut prepared = Prepared::new(&cfg, &placement)?;
        nodes::shard_plan(&mut prepared, &cfg, mpi);
        prepared.check_host_ram()?;
        // Before anything large is allocated or loaded.
        prepared.check_device_memory(&cfg, &placement, force)?;
        prepared.plan = prepared.grown_plan(&cfg, &placement, mt::sysmem::available_host_bytes());
        // Before any long work, and creating nothing yet: a metrics path that cannot be
        // written fails the launch now, not after start-up.
        if lead {
            check_outputs(&cfg, metrics_out.as_deref())?;
        }
        let tensorboard_dir = cfg.tensorboard_dir()?.filter(|_| lead);
        let micro_batch = prepared.micro_batch(&cfg, placement.world());
        let objective = Objective::of(&cfg)?;
        nodes::check_supported(mpi, &cfg, dump_grads.is_some())?;
        let (metrics_out, dump_grads, dump_logits) = match lead {
            true => (metrics_out, dump_grads, dump_logits),
            false => (None, None, None),
        };
        // Several nodes shard the optimizer state instead: `auto` keeps none there.
        let free = crate::prepare::device_opts(&cfg, &placement)
            .device_free
            .filter(|_| mpi.is_none());
        let (resident, resident_bytes) =
            crate::prepare::resident_blocks(&prepared, &cfg, &placement, free);
        let Prepared {
            spec,
            layout,
            mut data,
            plan,
        } = prepared;
        println!("{}", data.summary());
        let mut cfg = cfg;
        let (per_epoch, noun) = data.epoch_len();
        if let Some(line) = cfg.resolve_steps(per_epoch, noun) {
            println!("{line}");
        }
        // The data read (its files exist), the steps resolved, the layout known; nothing
        // allocated yet.
        let schedule = weights::schedule(&cfg)?;
        if let Some((dir, accept)) = &resume {
            weights::check_resume(dir, &cfg, &layout, &schedule, *accept)?;
        }
        let resume = resume.map(|(dir, _)| dir);
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
        if lead {
            keep::say_where(&cfg);
        }
        // Its runs start while the host state is allocated and the weights load.
        let figures = crate::trackers::PlanFigures {
            host_ram_total_bytes: plan.total(),
            host_bytes_per_param: plan.bytes_per_param(),
            host_ram_available_bytes: mt::sysmem::available_host_bytes(),
            params: layout.num_params() as u64,
            world_size: placement.world(),
            workers: placement.workers,
            gpus: placement.gpus,
            nodes: placement.nodes,
        };
        let mut trackers = trackers
            .map(|r| crate::trackers::Side::start(r, &cfg, &figures, t_start))
            .transpose()?;
        // Tensors carried as read: from the checkpoint resumed (which holds them as the
        // model directory did), else the model directory's; buffers at random init.
        let (carried, carried_from) = match (&resume, cfg.model.init) {
            (Some(dir), _) => (Carried::read(dir, &layout)?, dir.clone()),
            (None, InitKind::Pretrained) => (
                Carried::read(&cfg.model.path, &layout)?,
                cfg.model.path.clone(),
            ),
            (None, InitKind::Random) => (Carried::init(&layout), cfg.model.path.clone()),
        };
        let buffers = carried.buffers(&layout, &carried_from)?;
        let export = ExportOptions {
            dtype: cfg.model.dtype,
            source: cfg.model.path.clone(),
            max_shard_bytes: cfg.checkpoint.max_shard_size.0,
            carried: std::sync::Arc::new(carried),
            chat_template: cfg
                .dataset
                .chat_template
                .as_deref()
                .map(mt::config::chat_templates::chosen_text)
                .transpose()?,
        };
        // Periodic checkpoints are written in the background through the staging area the
        // plan holds (none: in place).
        let ck = &cfg.checkpoint;
        let writer = ck.dir.clone().filter(|_| lead).map(|root| {
            Writer::new(
                root,
                ck.keep_last,
                layout.clone(),
                export.clone(),
                plan.staging,
            )
        });
        let t_prepared = Instant::now();
        let shards = nodes::shards(&cfg, mpi, &layout);
        if resident > 0 && mpi.is_some() {
            return Err(anyhow!(
                "memory.resident_blocks: {} needs one node: several nodes shard the optimizer state instead (set it to off or auto)",
                cfg.memory.resident_blocks
            ));
        }
        crate::unix::check_stop("start-up")?;
        let mut host = HostState::new(&cfg, layout, placement.workers, shards, resident)?;
        crate::unix::check_stop("host memory allocation")?;
        if resident > 0 {
            println!(
                "resident blocks: {resident} of {} ({:.2} GB on each worker's device): updated there, not streamed",
                host.layout.blocks.len(),
                resident_bytes as f64 / 1e9
            );
        }
        let t_allocated = Instant::now();
        // A GRPO reference (`grpo.beta` > 0) is the initial model: a resume restores the
        // checkpoint after the reference pass ([`weights`]).
        let reference = objective.grpo().is_some_and(|p| p.beta > 0.0);
        let weights = match (&resume, cfg.model.init) {
            (Some(_), _) if reference => "the initial model first, as the GRPO reference",
            (Some(_), _) => "resumed",
            (None, InitKind::Pretrained) => "loaded",
            (None, InitKind::Random) => "random init",
        };
        if resume.is_none() || reference {
            weights::load_initial(&mut host, &cfg, &spec)?;
        }
        let (mut start_step, mut nan_run) = (0, 0);
        if let Some(dir) = resume.as_ref().filter(|_| !reference) {
            (start_step, nan_run) = weights::restore(&mut host, dir, &cfg)?;
        }
        crate::unix::check_stop("weights loading")?;
        let t_weights = Instant::now();
        // CUDA workers warm up at the configured micro-batch shape.
        let warm_up = (placement.gpus > 0).then_some(micro_batch);
        let opts = crate::prepare::device_opts(&cfg, &placement);
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
                    spec: spec.clone(),
                    layout: host.layout.clone(),
                    dtype: cfg.model.dtype,
                    store: host.store.handle(),
                    slab: host.slabs.handle(rank),
                    num_slots: cfg.memory.num_grad_slabs,
                    ce_chunk_tokens: cfg.memory.ce_chunk_tokens,
                    tile_tokens: cfg.memory.tile_tokens,
                    device_free: opts.device_free,
                    offload_activations: cfg.memory.offload_activations,
                    dump_logits: dump_logits.as_ref().map(|p| match placement.workers {
                        1 => p.clone(),
                        _ => PathBuf::from(format!("{}.rank{rank}", p.display())),
                    }),
                    warm_up,
                    buffers: buffers.clone(),
                    objective,
                    resident: host.resident_init(
                        cfg.memory.master_weights == mt::config::MasterWeights::Split,
                    ),
                }
            })
            .collect();
        // The W&B / MLflow runs started meanwhile; a failure to start them fails the launch
        // before the workers spawn.
        if let Some(side) = trackers.as_mut() {
            side.wait_ready()?;
        }
        let t_ready = Instant::now();
        let mut sup = Supervisor::start(&worker, inits, plan.total())?;
        let t_workers = Instant::now();
        let s = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
        let startup_s = s(t_start, t_workers);
        let waited = match trackers.is_some() {
            true => format!(", report_to runs {:.1}s", s(t_weights, t_ready)),
            false => String::new(),
        };
        println!(
            "start-up {startup_s:.1}s: config and data {:.1}s, host state {:.1}s, weights {:.1}s ({weights}), workers {:.1}s (host registration {:.1}s, warm-up {:.1}s){waited}",
            s(t_start, t_prepared),
            s(t_prepared, t_allocated),
            s(t_allocated, t_weights),
            s(t_ready, t_workers),
            sup.register_s,
            sup.warm_up_s,
        );
        let metrics = metrics_out
            .as_deref()
            .map(MetricsWriter::create)
            .transpose()?;
        let tensorboard = tensorboard_dir
            .as_deref()
            .map(EventWriter::create)
            .transpose()?;
        if let Some(tb) = &tensorboard {
            println!("TensorBoard events: {}", tb.path().display());
        }
        // Before step 1, under the initial weights (or from the checkpoint resumed).
        let timeout = Duration::from_secs(cfg.training.worker_timeout_s);
        if let Some(m) = mpi {
            m.set_timeout(timeout);
        }
        resident::push_resident(&mut host, &mut sup, timeout)?;
        let eval_micro = crate::eval::rows_per_micro(&cfg, placement.world());
        let dpo = objective
            .dpo()
            .map(|_| {
                let rows = (micro_batch.0, eval_micro);
                let pad = spec.pad_token_id as i32;
                Preference::new(&data, &mut sup, rows, pad, timeout, resume.as_deref())
            })
            .transpose()?;
        let mut eval_refs = None;
        let refs = match reference {
            true => {
                let pad = spec.pad_token_id as i32;
                let refs = reference_logps(&data.rows, &mut sup, micro_batch.0, pad, timeout)?;
                if !data.eval.is_empty() {
                    let r = reference_logps(&data.eval, &mut sup, eval_micro, pad, timeout)?;
                    eval_refs = Some(r);
                }
                if let Some(dir) = &resume {
                    (start_step, nan_run) = weights::restore(&mut host, dir, &cfg)?;
                    resident::push_resident(&mut host, &mut sup, timeout)?;
                }
                Some(refs)
            }
            false => None,
        };
        let eval = match data.eval.is_empty() {
            true => None,
            false => {
                let eval_objective = match objective {
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
                let pad = spec.pad_token_id as i32;
                let world = placement.world();
                Some(EvalSet::for_run(&cfg, world, &rows, pad, eval_objective))
            }
        };
        let stage = match objective {
            Objective::Lm => Stage::Lm,
            Objective::Dpo(_) => Stage::Dpo(dpo.context("the DPO reference log-probabilities")?),
            Objective::Grpo(p) => {
                Stage::Grpo(Policy::new(p, &data, resume.as_deref(), start_step, refs)?)
            }
        };
        // A sample is a row, or under DPO a pair of rows.
        let sampler = Sampler::new(
            data.epoch_len().0,
            cfg.training.batch_size,
            cfg.dataset.shuffle,
            cfg.training.seed,
        );
        let t = &cfg.training;
        let per_epoch = (data.epoch_len().0.div_ceil(t.batch_size).max(1)) as u64;
        if lead {
            let facts = RunFacts {
                examples: data.epoch_len(),
                global_batch: t.batch_size,
                world: placement.world(),
                accumulation: t.gradient_accumulation_steps,
                steps: t.num_steps,
                first: start_step,
                params: host.layout.num_params() as u64,
                model: cfg.export_dir(),
            };
            println!("{}", start_summary(&facts, per_epoch));
        }
        let on_gpu = placement.gpus > 0;
        let progress = Progress::new(
            start_step,
            t.num_steps,
            cfg.logging.log_every,
            per_epoch,
            on_gpu,
        );
        Ok(Trainer {
            progress,
            cfg,
            spec,
            data,
            sampler,
            host,
            sup,
            writer,
            export,
            metrics,
            tensorboard,
            eval,
            stage,
            dump_grads,
            nan_run,
            start_step,
            plan,
            startup_s: Some(startup_s),
            checkpoint_wait_s: 0.0,
            moments: match mt::switches::get().defer_moments {
                false => Moments::Write,
                true => Moments::Keep,
            },
            peers: match mpi {
                Some(m) => m,
                None => &mt::host::SOLO,
            },
            mpi,
            update_exchange_s: 0.0,
            update_exchange_wait_s: 0.0,
            since_checkpoint: Instant::now(),
            checkpointed: None,
            last_written: None,
            schedule,
            _locks: locks,
            trackers,
        })
    }

    /// Runs every step, then stops the workers and writes the model if asked.
    ///
    /// As soon as a step's gradient norm is known, the next step is sent and the update
    /// runs block by block in the order its forward reads them, each block released to
    /// the workers as soon as it is written: the optimizer overlaps the next forward.
    /// Only the weights are written then; the Adam moments (half the update's memory
    /// traffic) follow while the workers compute the next step, before the reduce
    /// overwrites the gradient of each block (see [`HostState::defer_moments`]).
    ///
    /// A worker lost between step boundaries ends the run after a checkpoint of the last
    /// step whose update is applied ([`keep`]): one lost while an update runs lets it
    /// finish first.
    pub fn run(mut self) -> Result<()> {
        let steps = self.cfg.training.num_steps;
        let first = self.start_step;
        self.since_checkpoint = Instant::now();
        let mut plan = self.fetch_batch(first);
        if let Err(e) = self.send_step(first, &plan, false) {
            return Err(self.rescue(e, first));
        }
        let mut last_report = Instant::now();
        let mut stopped = None;
        for step in first..steps {
            let mut out = match self.collect_gradients() {
                Ok(out) => out,
                Err(e) => return Err(self.rescue(e, step)),
            };
            self.stage
                .keep(step, &plan, std::mem::take(&mut out.token_logps))?;
            if let Some(path) = self.dump_grads.take() {
                self.host.dump_grads(&path)?;
            }
            let t = Instant::now();
            let grad_norm = out.grad_sum_sq.sqrt();
            let finite = grad_norm.is_finite() && out.loss_sum.is_finite();
            self.check_finite(step, finite, &out, grad_norm)?;
            let (lr, coef) = self.clip(step, grad_norm);
            let hp = finite.then(|| {
                self.host.next_update(
                    &self.cfg.optimizer,
                    lr,
                    self.cfg.training.weight_decay,
                    coef,
                )
            });
            let stop = self.stop_requested()?;
            let more = step + 1 < steps && stop.is_none();
            // An evaluation reads this step's updated weights: the next step waits for it.
            let evaluate =
                stop.is_none() && self.eval.as_ref().is_some_and(|e| e.due(step + 1, steps));
            // Resident blocks: the workers update their copies before anything reads them,
            // and the host's copy is brought up to date where a checkpoint or the export
            // is about to read it.
            if let Some(hp) = &hp {
                self.update_resident(hp)?;
            }
            let due = self.checkpoint_due(step + 1, !more)?;
            let checkpoint = due.filter(|_| self.writer.is_some());
            let export = !more && self.cfg.export_dir().is_some();
            if checkpoint.is_some() || export {
                self.pull_resident(checkpoint == Some(CheckpointContents::Full))?;
            }
            // A worker lost from here on lets the update finish, then ends the run.
            let mut lost = None;
            let next = if more && !evaluate {
                let next = self.fetch_batch(step + 1);
                lost = self.send_step(step + 1, &next, true).err();
                Some(next)
            } else {
                None
            };
            for block in 0..self.host.layout.blocks.len() {
                if let Some(hp) = &hp {
                    self.update_block(block, hp)?;
                }
                if next.is_some() && lost.is_none() {
                    lost = self.sup.broadcast(|| ToWorker::BlockReady { block }).err();
                }
            }
            if let (Some(hp), Moments::Keep) = (hp, self.moments) {
                self.host.defer_moments(hp);
            }
            let optimizer_s = t.elapsed().as_secs_f64() + out.moments_s - self.update_exchange_s;
            let now = Instant::now();
            let step_time_s = now.duration_since(last_report).as_secs_f64();
            last_report = now;
            out.skipped = !finite;
            let eval = match evaluate.then(|| self.evaluate()).transpose() {
                Ok(eval) => eval,
                Err(e) => {
                    lost = Some(e);
                    None
                }
            };
            self.report(
                step,
                &plan,
                &out,
                grad_norm,
                lr,
                optimizer_s,
                step_time_s,
                eval,
            )?;
            if let Some(e) = lost {
                return Err(self.rescue(e, step + 1));
            }
            let next = match next {
                None if more => {
                    let next = self.fetch_batch(step + 1);
                    if let Err(e) = self.send_step(step + 1, &next, false) {
                        return Err(self.rescue(e, step + 1));
                    }
                    last_report = Instant::now();
                    Some(next)
                }
                next => next,
            };
            self.checkpoint(step + 1, !more, due)?;
            if let Some(signal) = stop {
                let kept = self.kept_at_stop(step + 1);
                stopped = Some(Stopped {
                    signal: signal as i32,
                    step: step + 1,
                    kept,
                });
                break;
            }
            plan = next.unwrap_or(plan);
        }
        self.progress.finish();
        let lead = self.lead();
        let Trainer {
            cfg,
            mut host,
            sup,
            export,
            plan,
            writer,
            progress,
            trackers,
            ..
        } = self;
        sup.shutdown();
        if let Some(stopped) = stopped {
            if let Some(t) = trackers {
                t.finish("killed", peak_rss_bytes());
            }
            return Err(stopped.into());
        }
        // Checkpoints may live inside the output directory, which the export swaps: no
        // write may be in flight there meanwhile.
        if let Some(mut w) = writer {
            let root = w.root().display().to_string();
            w.finish()
                .with_context(|| format!("checkpoint under {root} failed"))?;
        }
        // `writer` and then `locks`, left in `self`, are dropped as this returns.
        nodes::export(&cfg, &mut host, &export, lead)?;
        if lead {
            println!(
                "{}",
                progress.end_summary(cfg.training.batch_size, cfg.export_dir())
            );
        }
        println!(
            "host memory: launcher peak {:.3} GB resident (VmHWM), plan {:.3} GB",
            peak_rss_bytes() as f64 / 1e9,
            plan.total() as f64 / 1e9
        );
        if let Some(t) = trackers {
            t.finish("finished", peak_rss_bytes());
        }
        Ok(())
    }

    /// The eval set's loss under the weights in the store (no update pending).
    fn evaluate(&mut self) -> Result<EvalMetrics> {
        let timeout = Duration::from_secs(self.cfg.training.worker_timeout_s);
        let set = self
            .eval
            .as_ref()
            .expect("evaluations are due only with an eval set");
        let m = set.evaluate(&mut self.sup, timeout)?;
        tracing::info!(
            eval_loss = m.eval_loss,
            eval_tokens = m.eval_tokens,
            eval_time_s = format!("{:.3}", m.eval_time_s),
            "evaluated"
        );
        Ok(m)
    }

    /// Sends every worker its micro-batches of step `step`.
    fn send_step(&mut self, step: u64, plan: &StepPlan, weights_pending: bool) -> Result<()> {
        late_node_hook(self.mpi);
        let loss_scale = 1.0 / self.stage.loss_units(plan).max(1) as f64;
        for (rank, micro) in plan.per_rank.iter().enumerate() {
            let micro = micro.clone();
            self.sup.send(
                rank,
                ToWorker::Step {
                    step,
                    micro,
                    loss_scale,
                    weights_pending,
                },
            )?;
        }
        self.sup.kill_hook(step + 1);
        Ok(())
    }

    fn fetch_batch(&mut self, step: u64) -> StepPlan {
        let rows = self.sampler.global_batch(self.stage.batch(step));
        let cut = Cut {
            data: &self.data,
            world: self.global_world(),
            accum: self.cfg.training.gradient_accumulation_steps,
            pad: self.spec.pad_token_id as i32,
        };
        let plan = self.stage.plan(&cut, &rows, step);
        self.node_slice(plan)
    }
}

/// Test hook: `MT_TEST_LATE_NODE=<rank>:<ms>` makes node `rank` send each step to its
/// workers `ms` late, so that the other nodes wait for it at every exchange (tests/nodes.rs
/// checks that `exchange_wait_s` says so). Nothing else reads it.
fn late_node_hook(mpi: Option<&crate::mpi::Mpi>) {
    let Some(m) = mpi else { return };
    if let Some(late) = mt::switches::testing::late_node(m.rank) {
        tracing::debug!(
            rank = m.rank,
            ?late,
            "MT_TEST_LATE_NODE: this node starts the step late"
        );
        std::thread::sleep(late);
    }
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
