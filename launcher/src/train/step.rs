//! One step, phase by phase, as [`Trainer::run`] calls them after the workers' forward
//! and backward ([`Trainer::collect_gradients`]): [`Trainer::finish_step`] (the norm, the
//! non-finite policy, the update's scalars and what follows the step),
//! [`Trainer::release_blocks`] (the update block by block, each released to the next
//! step's forward as written) and [`Trainer::end_of_step`] (evaluation, metrics,
//! checkpoint, stop). Also the batch a step trains on and how it reaches the workers.

use std::time::{Duration, Instant};

use anyhow::Result;
use mt::config::CheckpointContents;
use mt::data::StepPlan;
use mt::metrics::EvalMetrics;
use mt::optim::{AdamWStep, Moments};
use mt::protocol::ToWorker;
use nix::sys::signal::Signal;

use super::objective::Cut;
use super::{StepOutcome, Stopped, Trainer};

/// What a step's gradient norm decided ([`Trainer::finish_step`]).
pub(super) struct Update {
    pub grad_norm: f64,
    pub lr: f64,
    /// The update's scalars; none where the step is skipped (its loss or norm is not
    /// finite, `training.nan_policy: skip`).
    pub hp: Option<AdamWStep>,
    /// A stop signal some node received: the run ends after this step.
    pub stop: Option<Signal>,
    /// Another step follows this one.
    pub more: bool,
    /// The eval set is due under this step's updated weights: the next step waits for it.
    pub evaluate: bool,
    /// The checkpoint due after this step.
    pub due: Option<CheckpointContents>,
    /// When the optimizer's part of the step began (reported as `optimizer_s`).
    pub started: Instant,
}

/// The update applied ([`Trainer::release_blocks`]).
pub(super) struct Released {
    /// The next step's batch, where it was sent during the update.
    pub next: Option<StepPlan>,
    /// A worker lost from the update on: the run ends once the step is reported.
    pub lost: Option<anyhow::Error>,
}

/// What the step loop does after a step.
pub(super) enum Flow {
    /// Go on, with the next step's batch where it was already fetched.
    Next(Option<StepPlan>),
    /// A stop signal ended the run after this step.
    Stop(Stopped),
}

impl Trainer {
    /// After the reduce: keeps what the objective needs of the step, then from the
    /// gradient norm the update's scalars (or a skip), and whether a stop, another step,
    /// an evaluation or a checkpoint follows.
    pub(super) fn finish_step(
        &mut self,
        step: u64,
        batch: &StepPlan,
        out: &mut StepOutcome,
    ) -> Result<Update> {
        self.stage
            .keep(step, batch, std::mem::take(&mut out.token_logps))?;
        if let Some(path) = self.dump_grads.take() {
            self.host.dump_grads(&path)?;
        }
        let started = Instant::now();
        let grad_norm = out.grad_sum_sq.sqrt();
        let finite = grad_norm.is_finite() && out.loss_sum.is_finite();
        self.check_finite(step, finite, out.loss_sum, grad_norm)?;
        out.skipped = !finite;
        let (lr, coef) = self.clip(step, grad_norm);
        let (opt, wd) = (&self.cfg.optimizer, self.cfg.training.weight_decay);
        let hp = finite.then(|| self.host.next_update(opt, lr, wd, coef));
        let stop = self.stop_requested()?;
        let steps = self.cfg.training.num_steps;
        let more = step + 1 < steps && stop.is_none();
        let evaluate = stop.is_none() && self.eval.as_ref().is_some_and(|e| e.due(step + 1, steps));
        let due = self.checkpoint_due(step + 1, !more)?;
        Ok(Update {
            grad_norm,
            lr,
            hp,
            stop,
            more,
            evaluate,
            due,
            started,
        })
    }

    /// Applies the update block by block, releasing each to the workers as written: the
    /// next step (sent first, unless an evaluation must read the updated weights) runs its
    /// forward meanwhile. Resident blocks are updated by the workers before anything reads
    /// them, and the host's copy brought up to date where a checkpoint or the export is
    /// about to read it.
    pub(super) fn release_blocks(&mut self, step: u64, update: &Update) -> Result<Released> {
        if let Some(hp) = &update.hp {
            self.update_resident(hp)?;
        }
        let checkpoint = update.due.filter(|_| self.writer.is_some());
        let export = !update.more && self.cfg.export_dir().is_some();
        if checkpoint.is_some() || export {
            self.pull_resident(checkpoint == Some(CheckpointContents::Full))?;
        }
        // A worker lost from here on lets the update finish, then ends the run.
        let mut lost = None;
        let mut next = None;
        if update.more && !update.evaluate {
            let batch = self.fetch_batch(step + 1);
            lost = self.send_step(step + 1, &batch, true).err();
            next = Some(batch);
        }
        for block in 0..self.host.layout.blocks.len() {
            if let Some(hp) = &update.hp {
                self.update_block(block, hp)?;
            }
            if next.is_some() && lost.is_none() {
                lost = self.sup.broadcast(|| ToWorker::BlockReady { block }).err();
            }
        }
        if let (Some(hp), Moments::Keep) = (update.hp, self.moments) {
            self.host.defer_moments(hp);
        }
        Ok(Released { next, lost })
    }

    /// The step's evaluation (when due) and metrics; a worker lost meanwhile ends the run
    /// here, after a checkpoint of this step. Then the next step sent (where the update
    /// could not overlap it), the checkpoint due written or started, and a stop honoured.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn end_of_step(
        &mut self,
        step: u64,
        batch: &StepPlan,
        out: StepOutcome,
        update: Update,
        released: Released,
        since_report: &mut Instant,
    ) -> Result<Flow> {
        let optimizer_s =
            update.started.elapsed().as_secs_f64() + out.moments_s - self.update_exchange_s;
        let now = Instant::now();
        let step_time_s = now.duration_since(*since_report).as_secs_f64();
        *since_report = now;
        let Released { next, mut lost } = released;
        let eval = match update.evaluate.then(|| self.evaluate()).transpose() {
            Ok(eval) => eval,
            Err(e) => {
                lost = Some(e);
                None
            }
        };
        let (grad_norm, lr) = (update.grad_norm, update.lr);
        self.report(
            step,
            batch,
            &out,
            grad_norm,
            lr,
            optimizer_s,
            step_time_s,
            eval,
            None,
        )?;
        if let Some(e) = lost {
            return Err(self.rescue(e, step + 1));
        }
        let next = match next {
            None if update.more => {
                let next = self.fetch_batch(step + 1);
                if let Err(e) = self.send_step(step + 1, &next, false) {
                    return Err(self.rescue(e, step + 1));
                }
                *since_report = Instant::now();
                Some(next)
            }
            next => next,
        };
        self.checkpoint(step + 1, !update.more, update.due)?;
        if let Some(signal) = update.stop {
            let kept = self.kept_at_stop(step + 1);
            return Ok(Flow::Stop(Stopped {
                signal: signal as i32,
                step: step + 1,
                kept,
            }));
        }
        Ok(Flow::Next(next))
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

    /// Sends every worker its micro-batches of step `step`, its loss a mean over the
    /// objective's units of `plan`.
    pub(super) fn send_step(
        &mut self,
        step: u64,
        plan: &StepPlan,
        weights_pending: bool,
    ) -> Result<()> {
        let units = self.stage.loss_units(plan);
        let next = self.next_images(step);
        self.send_micro_batches(step, plan, units, weights_pending, next)
    }

    /// Per rank, the images its step `step + 1` will read, for the workers to decode while
    /// step `step` computes (worker/src/engine/prefetch.rs): a vision-language model under
    /// the LM objective, whose batches are the sampler's alone (a pure function of the
    /// step); none otherwise.
    fn next_images(&mut self, step: u64) -> Vec<Vec<mt::data::BatchImage>> {
        let lm = matches!(self.stage, super::objective::Stage::Lm);
        let on = mt::switches::get().image_prefetch;
        if !on || self.vision.is_none() || !lm || step + 1 >= self.cfg.training.num_steps {
            return Vec::new();
        }
        let next = self.fetch_batch(step + 1);
        (next.per_rank.iter())
            .map(|micro| micro.iter().flat_map(|m| m.images.clone()).collect())
            .collect()
    }

    /// [`Trainer::send_step`] with the loss a mean over `units` (a server's batch split
    /// over several calls names its whole batch's).
    pub(super) fn send_micro_batches(
        &mut self,
        step: u64,
        plan: &StepPlan,
        units: u64,
        weights_pending: bool,
        mut next_images: Vec<Vec<mt::data::BatchImage>>,
    ) -> Result<()> {
        late_node_hook(self.mpi);
        let loss_scale = 1.0 / units.max(1) as f64;
        next_images.resize(plan.per_rank.len(), Vec::new());
        for ((rank, micro), next_images) in plan.per_rank.iter().enumerate().zip(next_images) {
            let micro = micro.clone();
            self.sup.send(
                rank,
                ToWorker::Step {
                    step,
                    micro,
                    loss_scale,
                    weights_pending,
                    next_images,
                },
            )?;
        }
        self.sup.kill_hook(step + 1);
        Ok(())
    }

    /// This node's micro-batches of step `step`: the sampler's global batch, cut as the
    /// objective cuts it.
    pub(super) fn fetch_batch(&mut self, step: u64) -> StepPlan {
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
