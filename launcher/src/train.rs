//! The step driver. A step reads like the algorithm: fetch the batch, run the workers'
//! forward and backward while reducing their gradients as layers arrive, clip, update.
//! After the steps `training.eval_steps` names (and the last), the eval set's loss under
//! the updated weights ([`crate::eval`]); the next step starts after it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use mt::checkpoint::{self, ExportOptions, writer::Writer};
use mt::config::hf::ModelSpec;
use mt::config::{CheckpointContents, RunConfig};
use mt::data::{Dataset, Sampler};
use mt::host::HostState;
use mt::metrics::tensorboard::EventWriter;
use mt::metrics::{MetricsWriter, peak_rss_bytes};
use mt::optim::Moments;

use crate::eval::EvalSet;
use crate::progress::{Progress, RunFacts, start_summary};
use crate::supervisor::Supervisor;

mod gradients;
mod keep;
mod nodes;
mod objective;
mod resident;
mod session;
mod start;
mod step;
mod step_end;
mod weights;
pub use keep::{Stopped, check_outputs};
pub(crate) use nodes::shard_plan;
pub use session::Failure;
pub use start::{Args, Mode, Outputs};
pub(crate) use weights::{check_resume, schedule};

use gradients::StepOutcome;
use objective::Stage;
use step::Flow;

pub struct Trainer {
    cfg: RunConfig,
    spec: ModelSpec,
    /// A vision-language model's tower, whose forward the step's FLOPs count.
    vision: Option<mt::config::vision::TowerSpec>,
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
    /// `mt-launch serve`: the state between a client's commands ([`session`]).
    serving: Option<session::Serving>,
}

impl Trainer {
    /// Starts a run in four phases ([`start`]): preflight (every check, nothing large
    /// allocated), the host state (allocated, weights loaded or restored), the workers, and
    /// the reference passes of the objective.
    pub fn new(args: Args) -> Result<Trainer> {
        let mut clock = start::Clock::new();
        let mut pre = start::preflight(args)?;
        let mut trackers = pre.start_trackers(clock.start)?;
        let mut host = start::host_state(&pre, &mut clock)?;
        let (mut sup, relaunch) = start::workers(&pre, &host, trackers.as_mut(), &mut clock)?;
        let metrics = (pre.outputs.metrics_out.as_deref())
            .map(MetricsWriter::create)
            .transpose()?;
        let tensorboard = (pre.tensorboard_dir.as_deref())
            .map(EventWriter::create)
            .transpose()?;
        if let Some(tb) = &tensorboard {
            println!("TensorBoard events: {}", tb.path().display());
        }
        let refs = start::reference_passes(&mut pre, &mut host, &mut sup)?;
        let (start_step, nan_run) = refs.restored.unwrap_or((host.start_step, host.nan_run));
        let start::Preflight {
            mode,
            cfg,
            placement,
            mpi,
            lead,
            locks,
            spec,
            data,
            plan,
            schedule,
            outputs,
            objective,
            micro_batch,
            ..
        } = pre;
        // A sample is a row, or under DPO a pair of rows. (A server's batches come from
        // its client: its sampler, over the config's dataset or none, is never read.)
        let (examples, t) = (data.epoch_len(), &cfg.training);
        let sampler = Sampler::new(examples.0.max(1), t.batch_size, cfg.dataset.shuffle, t.seed);
        let per_epoch = (examples.0.div_ceil(t.batch_size).max(1)) as u64;
        if lead && mode == Mode::Run {
            let facts = RunFacts {
                examples,
                global_batch: t.batch_size,
                world: placement.world(),
                accumulation: t.gradient_accumulation_steps,
                steps: t.num_steps,
                first: start_step,
                params: host.host.layout.num_params() as u64,
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
            vision: host.vision.as_ref().map(|v| v.layout.spec.clone()),
            data,
            sampler,
            host: host.host,
            sup,
            writer: host.writer,
            export: host.export,
            metrics,
            tensorboard,
            eval: refs.eval,
            stage: refs.stage,
            dump_grads: outputs.dump_grads,
            nan_run,
            start_step,
            plan,
            startup_s: Some(clock.startup_s()),
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
            serving: relaunch.map(|r| session::Serving::new(r, objective, micro_batch)),
        })
    }

    /// Runs every step, then stops the workers and writes the model if asked.
    ///
    /// A step reads as the algorithm does: the workers' forward and backward with their
    /// gradients reduced as they arrive ([`Trainer::collect_gradients`]), the norm and the
    /// update's scalars ([`Trainer::finish_step`]), the update block by block
    /// ([`Trainer::release_blocks`]), then the step's evaluation, metrics, checkpoint and
    /// stop ([`Trainer::end_of_step`]).
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
        let (first, steps) = (self.start_step, self.cfg.training.num_steps);
        self.since_checkpoint = Instant::now();
        let mut batch = self.fetch_batch(first);
        if let Err(e) = self.send_step(first, &batch, false) {
            return Err(self.rescue(e, first));
        }
        let mut since_report = Instant::now();
        let mut stopped = None;
        for step in first..steps {
            let accum = self.cfg.training.gradient_accumulation_steps;
            let mut out = match self.collect_gradients(accum, true) {
                Ok(out) => out,
                Err(e) => return Err(self.rescue(e, step)),
            };
            let update = self.finish_step(step, &batch, &mut out)?;
            let released = self.release_blocks(step, &update)?;
            match self.end_of_step(step, &batch, out, update, released, &mut since_report)? {
                Flow::Next(next) => batch = next.unwrap_or(batch),
                Flow::Stop(s) => {
                    stopped = Some(s);
                    break;
                }
            }
        }
        self.finish(stopped)
    }

    /// After the last step (or a stop): the workers stopped, the checkpoint in flight
    /// completed, the model exported and the run summed up.
    fn finish(self, stopped: Option<Stopped>) -> Result<()> {
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
            nan_run,
            schedule,
            ..
        } = self;
        sup.shutdown();
        if let Some(stopped) = stopped {
            keep::keep_drives_state(&mut host, &cfg, stopped.step, nan_run, schedule)?;
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
        let done = cfg.training.num_steps;
        keep::keep_drives_state(&mut host, &cfg, done, nan_run, schedule)?;
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
}
