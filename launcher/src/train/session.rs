//! The trainer driven one command at a time (`mt-launch serve`, [`crate::serve`]) instead of
//! by its step loop: a batch's forward, backward and reduce added to the gradient being
//! accumulated, an update of it on request, forward-only log-probabilities, a checkpoint
//! or an export when asked, the workers stopped and started again around a rollout
//! engine's turn on the GPUs, and the store handed to readers with its version.
//!
//! The same calls as a run's step make each of these, without the overlap of the next
//! step's forward with the update (a server does not know its next batch): an update
//! writes every block before the command returns, and the Adam moments it defers are
//! made during the next batch's reduce, or before a checkpoint, as in a run.
//!
//! A command fails in one of two ways ([`Failure`]): refused (bad input, nothing to update,
//! a directory that may not be written), leaving the state as it was and the server
//! serving; or fatal (a worker lost or a failure mid-update), ending the server as it
//! would end a run.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use mt::checkpoint::{self, lock::DirLock, ownership};
use mt::config::CheckpointContents;
use mt::data::{Example, StepPlan};
use mt::metrics::{DpoMetrics, GrpoMetrics};
use mt::objective::Objective;
use mt::optim::Moments;

use super::start::Relaunch;
use super::{StepOutcome, Trainer};
use crate::supervisor::Supervisor;

/// Why a command failed.
#[derive(Debug)]
pub enum Failure {
    /// The request could not be carried out; nothing changed.
    Refused(anyhow::Error),
    /// The server cannot go on (a worker was lost, an update failed midway).
    Fatal(anyhow::Error),
}

fn refused<T>(msg: impl std::fmt::Display) -> Result<T, Failure> {
    Err(Failure::Refused(anyhow!("{msg}")))
}

fn fatal(e: anyhow::Error) -> Failure {
    Failure::Fatal(e)
}

/// A server's state between commands.
pub(super) struct Serving {
    relaunch: Relaunch,
    objective: Objective,
    /// The workers' micro-batch, as the plan sized it: rows, and the longest row.
    micro_batch: (usize, usize),
    /// The gradient accumulated since the last update.
    pending: Option<Pending>,
    /// Updates counted so far (the schedule's step; a resumed checkpoint's to start).
    step: u64,
    /// `set_lr`: the learning rate of the updates from now on, instead of the schedule's.
    lr: Option<f64>,
    /// `sleep`: the workers are stopped.
    asleep: bool,
    version: VersionPage,
}

impl Serving {
    pub fn new(relaunch: Relaunch, objective: Objective, micro_batch: (usize, usize)) -> Serving {
        Serving {
            relaunch,
            objective,
            micro_batch,
            pending: None,
            step: 0,
            lr: None,
            asleep: false,
            version: VersionPage::default(),
        }
    }
}

/// The gradient accumulated by `train_step`s since the last update.
struct Pending {
    /// The calls' outcomes added ([`StepOutcome::absorb`]): the loss sums, the workers'
    /// times, the objective's sums, Σ g² of the gradient as it stands.
    out: StepOutcome,
    /// The calls' batches counted (tokens, padding, pairs, rewards; no micro-batches).
    counts: StepPlan,
    /// The sum of each call's mean loss.
    loss: f64,
    /// Micro-batches (over every worker) and calls in it, and their seconds.
    micro_batches: usize,
    calls: usize,
    busy_s: f64,
}

/// What a `train_step` did.
pub struct Trained {
    /// The batch's loss: its mean over `units`.
    pub loss: f64,
    /// What the loss is a mean over: label tokens, pairs or completions (completion tokens
    /// under `dapo`).
    pub units: u64,
    /// Label tokens in the batch.
    pub tokens: u64,
    pub dpo: Option<DpoMetrics>,
    pub grpo: Option<GrpoMetrics>,
}

/// What an `optimizer_step` did.
pub struct Applied {
    /// Updates counted after this one.
    pub step: u64,
    pub grad_norm: f64,
    pub lr: f64,
    /// The gradient was not finite (`training.nan_policy: skip`): no update was made.
    pub skipped: bool,
    /// `train_step` calls accumulated into it.
    pub calls: usize,
}

/// The store handed to a reader ([`Trainer::weights`]).
pub struct Weights {
    /// The store's memfd and the version page's, each opened again read-only.
    pub store: File,
    pub version_page: File,
    /// Updates applied by this server.
    pub version: u64,
    /// Each trained tensor: HF name, shape, byte offset in the store's file, bytes.
    pub tensors: Vec<(String, Vec<usize>, u64, u64)>,
    /// The store's file size in bytes.
    pub size: u64,
}

impl Trainer {
    fn serving(&mut self) -> Result<&mut Serving, Failure> {
        let s = (self.serving.as_mut()).ok_or_else(|| fatal(anyhow!("not a server")))?;
        match s.asleep {
            true => refused("the workers are asleep: send `wake` first"),
            false => Ok(s),
        }
    }

    /// The step a server starts at: 0, or the checkpoint's it resumed.
    pub(crate) fn start_serving(&mut self) -> Result<()> {
        let first = self.start_step;
        let s = self.serving.as_mut().context("not a server")?;
        s.step = first;
        s.version.create()
    }

    /// What `info` reports of the server's state.
    pub(crate) fn state(&self) -> serde_json::Value {
        let s = self.serving.as_ref();
        let step = s.map_or(0, |s| s.step);
        let t = &self.cfg.training;
        serde_json::json!({
            "stage": format!("{:?}", t.stage).to_lowercase(),
            "step": step,
            "version": s.map_or(0, |s| s.version.updates),
            "lr": s.and_then(|s| s.lr).unwrap_or_else(|| mt::optim::lr_at(t, step)),
            "pending": s.and_then(|s| s.pending.as_ref()).map_or(0, |p| p.micro_batches),
            "asleep": s.is_some_and(|s| s.asleep),
            "params": self.host.layout.num_params(),
            "workers": self.sup.world(),
            "model_type": self.spec.model_type,
            "dtype": format!("{:?}", self.cfg.model.dtype).to_lowercase(),
            "max_seq_len": self.max_seq_len(),
            "rows_per_micro_batch": self.rows_per_micro(),
            "vocab_size": self.spec.vocab_size,
        })
    }

    /// The longest row a batch may hold: the workers' micro-batch was sized for it.
    pub(crate) fn max_seq_len(&self) -> usize {
        self.serving.as_ref().map_or(1, |s| s.micro_batch.1)
    }

    /// Rows per micro-batch the workers were sized for.
    pub(crate) fn rows_per_micro(&self) -> usize {
        self.serving.as_ref().map_or(1, |s| s.micro_batch.0)
    }

    pub(crate) fn objective(&self) -> Objective {
        self.serving.as_ref().map_or(Objective::Lm, |s| s.objective)
    }

    pub(crate) fn pad_id(&self) -> i32 {
        self.spec.pad_token_id as i32
    }

    /// How a client's images become the workers' (a vision-language model's processor and
    /// the id of its image tokens); None for a text model or one whose directory has no
    /// `preprocessor_config.json`, whose rows take no images.
    pub(crate) fn image_input(&self) -> Option<(mt::data::ImageProcessor, i64)> {
        use mt::config::vision::TowerSpec;
        let token_id = match self.vision.as_ref()? {
            TowerSpec::Qwen(_) => self.spec.mrope.as_ref()?.image_token_id,
            TowerSpec::Siglip(s) => s.image_token_id,
            TowerSpec::Clip(c) => c.image_token_id,
        };
        let processor = mt::data::Images::of_model(&self.cfg.model.path)
            .ok()?
            .processor()?;
        Some((processor, token_id))
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    pub(crate) fn world(&self) -> usize {
        self.sup.world()
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.cfg.training.worker_timeout_s)
    }

    /// Forward-only passes cut into the training micro-batch's rows.
    fn forward_cut(&self) -> crate::eval::ForwardCut {
        crate::eval::ForwardCut {
            rows: self.rows_per_micro(),
            pad: self.pad_id(),
            timeout: self.timeout(),
        }
    }

    /// `train_step`: the forward, backward and reduce of `plan` (each worker running
    /// `accum` micro-batches), added to the gradient being accumulated; its loss a mean
    /// over `units` (else the objective's units of `plan`).
    pub(crate) fn train_batch(
        &mut self,
        plan: &StepPlan,
        accum: usize,
        units: Option<u64>,
    ) -> Result<Trained, Failure> {
        let t = std::time::Instant::now();
        let s = self.serving()?;
        let (step, fresh) = (s.step, s.pending.is_none());
        let units = units.unwrap_or_else(|| self.stage.loss_units(plan));
        self.send_micro_batches(step, plan, units, false, Vec::new())
            .map_err(fatal)?;
        let out = self.collect_gradients(accum, fresh).map_err(fatal)?;
        let (dpo, grpo) = self.stage.metrics(&out.sums, plan);
        let loss = out.loss_sum / units.max(1) as f64;
        let micro_batches = plan.per_rank.iter().map(Vec::len).sum::<usize>();
        let s = self.serving()?;
        let p = s.pending.get_or_insert_with(|| Pending {
            out: StepOutcome::new(),
            counts: StepPlan {
                per_rank: Vec::new(),
                tokens: 0,
                padded_tokens: 0,
                real_tokens: 0,
                causal_pairs: 0,
                pairs: 0,
                rewards: Vec::new(),
            },
            loss: 0.0,
            micro_batches: 0,
            calls: 0,
            busy_s: 0.0,
        });
        p.out.absorb(out);
        let c = &mut p.counts;
        c.tokens += plan.tokens;
        c.padded_tokens += plan.padded_tokens;
        c.real_tokens += plan.real_tokens;
        c.causal_pairs += plan.causal_pairs;
        c.pairs += plan.pairs;
        c.rewards.extend_from_slice(&plan.rewards);
        p.loss += loss;
        p.micro_batches += micro_batches;
        p.calls += 1;
        p.busy_s += t.elapsed().as_secs_f64();
        Ok(Trained {
            loss,
            units,
            tokens: plan.tokens,
            dpo,
            grpo,
        })
    }

    /// `forward`: each row's label tokens' log-probabilities under the weights in the
    /// store, no gradient, and with `entropy` each one's entropy of the predicted
    /// distribution (else empty lists).
    pub(crate) fn forward_logprobs(
        &mut self,
        rows: &[Example],
        entropy: bool,
    ) -> Result<crate::eval::TokenValues, Failure> {
        self.serving()?;
        let cut = self.forward_cut();
        crate::eval::token_logps(rows, &mut self.sup, cut, entropy).map_err(fatal)
    }

    /// `forward` with `sum`: each row's summed label-token log-probability, as a DPO run's
    /// reference pass computes it (the same micro-batches: rows in order, the configured
    /// rows each), so that pairs sent with them train as that run does.
    pub(crate) fn forward_sums(&mut self, rows: &[Example]) -> Result<Vec<f64>, Failure> {
        self.serving()?;
        let cut = self.forward_cut();
        crate::eval::row_logps(rows, &mut self.sup, cut).map_err(fatal)
    }

    /// `optimizer_step`: one AdamW update of the accumulated gradient, clipped to
    /// `training.max_grad_norm`, at `lr` or the learning rate set (else the schedule's).
    pub(crate) fn apply_update(&mut self, lr: Option<f64>) -> Result<Applied, Failure> {
        let s = self.serving()?;
        let Some(p) = s.pending.take() else {
            return refused("optimizer_step: no gradient to apply: send a train_step first");
        };
        let (step, set) = (s.step, lr.or(s.lr));
        let started = std::time::Instant::now();
        let grad_norm = p.out.grad_sum_sq.sqrt();
        let finite = grad_norm.is_finite() && p.loss.is_finite();
        self.check_finite(step, finite, p.loss, grad_norm)
            .map_err(Failure::Refused)?;
        let (scheduled, coef) = self.clip(step, grad_norm);
        let lr = set.unwrap_or(scheduled);
        let (opt, wd) = (&self.cfg.optimizer, self.cfg.training.weight_decay);
        let hp = finite.then(|| self.host.next_update(opt, lr, wd, coef));
        if let Some(hp) = hp {
            self.update_resident(&hp).map_err(fatal)?;
            let s = self.serving()?;
            s.version.begin().map_err(fatal)?;
            for block in 0..self.host.layout.blocks.len() {
                self.update_block(block, &hp).map_err(fatal)?;
            }
            if self.moments == Moments::Keep {
                self.host.defer_moments(hp);
            }
            self.serving()?.version.end().map_err(fatal)?;
        }
        // The step's metrics (the metrics file, TensorBoard, W&B / MLflow), its time the
        // calls' and the update's (not the client's between them).
        let update_s = started.elapsed().as_secs_f64();
        let optimizer_s = update_s + p.out.moments_s;
        let step_s = p.busy_s + update_s;
        let mut out = p.out;
        out.skipped = !finite;
        (self.report(
            step,
            &p.counts,
            &out,
            grad_norm,
            lr,
            optimizer_s,
            step_s,
            None,
            Some(p.loss),
        ))
        .map_err(fatal)?;
        let s = self.serving()?;
        s.step += 1;
        let applied = Applied {
            step: s.step,
            grad_norm,
            lr,
            skipped: !finite,
            calls: p.calls,
        };
        self.progress.println(&format!(
            "step {}: loss {:.4} grad_norm {grad_norm:.4} lr {lr:.3e}{} ({} train_step call(s))",
            applied.step,
            p.loss,
            if finite { "" } else { ", skipped" },
            p.calls
        ));
        Ok(applied)
    }

    /// `set_lr`: the learning rate of the updates from now on (`None`: the schedule's).
    pub(crate) fn set_lr(&mut self, lr: Option<f64>) -> Result<f64, Failure> {
        let t = &self.cfg.training;
        let s = (self.serving.as_mut()).ok_or_else(|| fatal(anyhow!("not a server")))?;
        s.lr = lr;
        Ok(lr.unwrap_or_else(|| mt::optim::lr_at(t, s.step)))
    }

    /// `save`: a full checkpoint of the updates applied so far, under `checkpoint.dir`
    /// (a gradient being accumulated is not in it).
    pub(crate) fn save(&mut self) -> Result<PathBuf, Failure> {
        let step = self.serving()?.step;
        if self.writer.is_none() {
            return refused(
                "save: no checkpoint.dir: set it in the config or with --set checkpoint.dir=DIR",
            );
        }
        if let Some((at, dir)) = self.last_written.as_ref().filter(|(at, _)| *at == step) {
            tracing::debug!(
                step = at,
                "save: the checkpoint of this step is written already"
            );
            return Ok(dir.clone());
        }
        self.pull_resident(true).map_err(fatal)?;
        self.checkpoint(step, true, Some(CheckpointContents::Full))
            .map_err(Failure::Refused)?;
        match &self.last_written {
            Some((at, dir)) if *at == step => Ok(dir.clone()),
            _ => Err(fatal(anyhow!(
                "save: the checkpoint of step {step} was not written"
            ))),
        }
    }

    /// `export`: an HF model directory of the weights as they stand, at `dir`, under the
    /// rules of a run's export (never over the model read, nor over files this project did
    /// not write; locked while written, written aside and put in place at once).
    pub(crate) fn export_to(&mut self, dir: &Path) -> Result<PathBuf, Failure> {
        self.serving()?;
        const KEY: &str = "export: dir";
        let out = std::path::absolute(dir)
            .map_err(|e| Failure::Refused(anyhow!("{KEY} {}: {e}", dir.display())))?;
        let check = || -> Result<Option<DirLock>> {
            checkpoint::check_writable(&out, KEY)?;
            ownership::check_outside_model(&out, KEY, &self.cfg.model.path)?;
            // The run's output directory is locked by this process already.
            let ours = (self.cfg.training.output_dir.as_deref())
                .is_some_and(|o| ownership::resolved(o) == ownership::resolved(&out));
            let lock = match ours {
                true => None,
                false => Some(DirLock::acquire(&out, KEY)?),
            };
            crate::export::refuse_foreign(&out, false, KEY)?;
            checkpoint::recover_export(&out)?;
            Ok(lock)
        };
        let _lock = check().map_err(Failure::Refused)?;
        self.pull_resident(false).map_err(fatal)?;
        super::nodes::write_model(&out, &mut self.host, &self.export, true)
            .map_err(Failure::Refused)?;
        Ok(out)
    }

    /// `sleep`: the workers stopped, every GPU buffer of theirs released (resident blocks
    /// brought back to the host first).
    pub(crate) fn sleep(&mut self) -> Result<(), Failure> {
        self.serving()?;
        self.pull_resident(true).map_err(fatal)?;
        self.sup.stop();
        if let Some(s) = self.serving.as_mut() {
            s.asleep = true;
        }
        Ok(())
    }

    /// `wake`: the workers started again on the host state.
    pub(crate) fn wake(&mut self) -> Result<(), Failure> {
        let s = (self.serving.as_mut()).ok_or_else(|| fatal(anyhow!("not a server")))?;
        if !s.asleep {
            return Ok(());
        }
        let r = &s.relaunch;
        let sup = Supervisor::start(&r.worker, r.inits.clone(), r.plan_bytes).map_err(fatal)?;
        s.asleep = false;
        self.sup = sup;
        let timeout = self.timeout();
        super::resident::push_resident(&mut self.host, &mut self.sup, timeout).map_err(fatal)
    }

    /// `weights`: the store and its version page, each opened again read-only, and where
    /// each trained tensor lies in the store's file.
    pub(crate) fn weights(&mut self) -> Result<Weights, Failure> {
        let s = self.serving()?;
        let (version, page) = (s.version.updates, s.version.reopen().map_err(fatal)?);
        let handle = self.host.store.handle();
        let store = reopen_readonly(handle.fd).map_err(fatal)?;
        let size = store.metadata().map_err(|e| fatal(e.into()))?.len();
        let elem = self.cfg.model.dtype.size() as u64;
        let header = mt::shm::HEADER_LEN as u64;
        let layout = &self.host.layout;
        let tensors = (layout.tensors())
            .map(|(b, t)| {
                let r = mt::layout::Layout::global_range(b, t);
                let offset = header + r.start as u64 * elem;
                (b.hf_name(t), t.shape.clone(), offset, r.len() as u64 * elem)
            })
            .collect();
        Ok(Weights {
            store,
            version_page: page,
            version,
            tensors,
            size,
        })
    }

    /// After `shutdown`: the workers stopped, a checkpoint in flight completed.
    pub(crate) fn stop_serving(self) -> Result<()> {
        let Trainer {
            sup,
            writer,
            trackers,
            ..
        } = self;
        sup.shutdown();
        if let Some(mut w) = writer {
            let root = w.root().display().to_string();
            w.finish()
                .with_context(|| format!("checkpoint under {root} failed"))?;
        }
        if let Some(t) = trackers {
            t.finish("finished", mt::metrics::peak_rss_bytes());
        }
        Ok(())
    }
}

/// A read-only file of the memfd this process holds as `fd`: a reader given it can map it
/// only read-only.
fn reopen_readonly(fd: i32) -> Result<File> {
    let path = format!("/proc/self/fd/{fd}");
    File::open(&path).with_context(|| format!("opening {path} read-only"))
}

/// The version page readers check (docs/serve.md): one little-endian u64 in a memfd of its
/// own, twice the updates applied, plus one while an update writes the store.
#[derive(Default)]
struct VersionPage {
    file: Option<File>,
    updates: u64,
}

impl VersionPage {
    fn create(&mut self) -> Result<()> {
        use nix::sys::memfd::{MFdFlags, memfd_create};
        let fd = memfd_create("mt-serve-version", MFdFlags::MFD_CLOEXEC)
            .context("memfd_create for the version page")?;
        let file = File::from(fd);
        file.set_len(4096)?;
        self.file = Some(file);
        self.write(0)
    }

    fn write(&self, value: u64) -> Result<()> {
        let file = self.file.as_ref().context("no version page")?;
        file.write_all_at(&value.to_le_bytes(), 0)
            .context("writing the version page")
    }

    /// An update starts writing the store.
    fn begin(&mut self) -> Result<()> {
        self.write(2 * self.updates + 1)
    }

    /// The update is written.
    fn end(&mut self) -> Result<()> {
        self.updates += 1;
        self.write(2 * self.updates)
    }

    fn reopen(&self) -> Result<File> {
        use std::os::fd::AsRawFd;
        let file = self.file.as_ref().context("no version page")?;
        reopen_readonly(file.as_raw_fd())
    }
}
