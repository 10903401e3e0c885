//! The end of a step: its checkpoint, the non-finite policy, the clip and learning rate
//! of its update, and its metrics (file, TensorBoard, W&B / MLflow, progress line).

use anyhow::{Context, Result, bail};
use mt::config::NanPolicy;
use mt::config::hf::AttentionKind;
use mt::data::StepPlan;
use mt::layout::Layout;
use mt::metrics::{
    Bound, DriveMetrics, EvalMetrics, StepFlops, StepMetrics, peak_rss_bytes, rss_bytes, step_flops,
};
use mt::optim::{clip_coefficient, lr_at};

use super::{StepOutcome, Trainer};

impl Trainer {
    /// Checkpoints after `done` steps (with `checkpoint.dir`) where one is `due`
    /// ([`Trainer::checkpoint_due`]): periodic ones (`checkpoint.every_steps`,
    /// `every_minutes`) in the background (the step loop goes on while the writer writes),
    /// the `last` one (end of the run, a stop signal, a lost worker) or any with
    /// `checkpoint.background: false` at once. A write that failed meanwhile fails the run.
    pub(super) fn checkpoint(
        &mut self,
        done: u64,
        last: bool,
        due: Option<mt::config::CheckpointContents>,
    ) -> Result<()> {
        if let Some(contents) = due {
            self.checkpointed = Some((done, contents));
        }
        if self.host.windowed() {
            // Sharded over nodes, or on the drives: read a window of a block at a time.
            return self.checkpoint_sharded(done, last, due);
        }
        let Some(writer) = self.writer.as_mut() else {
            return Ok(());
        };
        let root = writer.root().display().to_string();
        let failed =
            || format!("checkpoint under {root} failed (complete checkpoints there are kept)");
        let Some(contents) = due else {
            let written = writer.poll().with_context(failed)?;
            return self.report_written(written.into_iter().collect());
        };
        // A checkpoint holds the moments of the update just made. One written at once
        // runs their pass first; in the background the writer waits for the pass, which
        // runs during the next backward as in any step.
        let at_once = last || self.plan.staging == 0;
        if at_once {
            self.host.settle_moments();
        }
        let mut state = self
            .host
            .train_state(done, self.nan_run, self.schedule.clone());
        state.extra.extend(self.stage.checkpoint_files());
        let (waited, written) = self
            .host
            .start_checkpoint(writer, state, contents)
            .with_context(failed)?;
        self.checkpoint_wait_s += waited;
        // The writes completed before this one are reported before it is written: one
        // written at once can take minutes, and whoever reads the log (a user, or
        // scripts/bench_checkpoint.sh, which deletes each checkpoint once complete) should
        // know meanwhile that the last periodic one is on disk.
        self.report_written(written)?;
        if !at_once {
            self.progress.println(&format!(
                "checkpoint of step {done}: writing in the background"
            ));
            return Ok(());
        }
        let writer = self.writer.as_mut().expect("checked above");
        let this = writer.finish().with_context(failed)?;
        self.report_written(this.into_iter().collect())
    }

    /// Says where the checkpoints completed meanwhile were written.
    pub(super) fn report_written(
        &mut self,
        written: Vec<mt::checkpoint::writer::Written>,
    ) -> Result<()> {
        for w in written {
            self.note_written(&w.dir);
            self.progress.println(&format!(
                "checkpoint {} written: {:.2} GB in {:.3}s ({:.2} GB/s); training waited {:.3}s for it; parts: {} staged, {} copied ahead, {} from the live state",
                w.dir.display(),
                w.bytes as f64 / 1e9,
                w.write_s,
                w.bytes as f64 / 1e9 / w.write_s.max(1e-9),
                w.stall_s,
                w.blocks.staged,
                w.blocks.copied,
                w.blocks.live,
            ));
        }
        Ok(())
    }

    /// Applies `training.nan_policy` to a step whose loss or gradient norm is not finite:
    /// `abort` fails at once; `skip` lets the update be skipped, up to `max_nan_steps` in a row.
    pub(super) fn check_finite(
        &mut self,
        step: u64,
        finite: bool,
        loss_sum: f64,
        grad_norm: f64,
    ) -> Result<()> {
        if finite {
            self.nan_run = 0;
            return Ok(());
        }
        self.nan_run += 1;
        let tc = &self.cfg.training;
        let what = format!(
            "step {}: loss sum {} and gradient norm {grad_norm} are not both finite",
            step + 1,
            loss_sum
        );
        match tc.nan_policy {
            NanPolicy::Abort => bail!("{what} (training.nan_policy: abort)"),
            NanPolicy::Skip if self.nan_run > tc.max_nan_steps => bail!(
                "{what}; {} non-finite steps in a row exceed training.max_nan_steps ({})",
                self.nan_run,
                tc.max_nan_steps
            ),
            NanPolicy::Skip => {
                tracing::warn!("{what}: update skipped ({} in a row)", self.nan_run);
                Ok(())
            }
        }
    }

    /// Clip coefficient and learning rate for the update after `step` steps.
    pub(super) fn clip(&self, step: u64, grad_norm: f64) -> (f64, f32) {
        let tc = &self.cfg.training;
        (
            lr_at(tc, step),
            clip_coefficient(grad_norm, tc.max_grad_norm),
        )
    }

    /// The step's metrics to the metrics file, TensorBoard, W&B / MLflow and the step line
    /// (a server's step line is its own: [`super::session`]). `loss`: the step's loss
    /// where its caller knows it (a server's, over several calls), else the mean over
    /// the step's units.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn report(
        &mut self,
        step: u64,
        plan: &StepPlan,
        out: &StepOutcome,
        grad_norm: f64,
        lr: f64,
        optimizer_s: f64,
        step_time_s: f64,
        eval: Option<EvalMetrics>,
        loss: Option<f64>,
    ) -> Result<()> {
        // What the step's loss is a mean over (its label tokens, pairs or completions).
        let units = self.stage.loss_units(plan);
        let loss = loss.unwrap_or(out.loss_sum / units.max(1) as f64);
        let layout = &self.host.layout;
        let embed = &layout.blocks[Layout::EMBED];
        let embed_table = embed.tensors[0].numel() as u64;
        // A trained tower's tensors (after the table) multiply image patches only:
        // counted with the tower below, not per token.
        let tower_params: u64 = embed.tensors[1..].iter().map(|t| t.numel() as u64).sum();
        let params = layout.num_params() as u64 - tower_params;
        // A token multiplies by its routed experts only; Gated DeltaNet layers have no
        // quadratic attention (their delta rule is not counted: StepMetrics::tflops_model).
        let matmul_params = if layout.tied_embeddings {
            params
        } else {
            params - embed_table
        } - layout.unrouted_params as u64;
        let attention_layers = self.spec.layer_types.iter();
        let attention_layers = attention_layers.filter(|k| **k != AttentionKind::Linear);
        let flops = step_flops(
            params,
            matmul_params,
            attention_layers.count() as u64,
            (self.spec.num_heads * self.spec.head_dim) as u64,
            plan.padded_tokens,
            plan.real_tokens,
            plan.causal_pairs,
        );
        // A vision-language step also runs the tower forward over its images, and the
        // backward of what trains: twice a trained part's forward (its input's and its
        // weights' gradients), once a frozen projector's under a trained encoder (its
        // input's alone).
        let training = self.cfg.vlm.training();
        let tower = self.vision.as_ref().map_or(0.0, |spec| {
            let images = plan.per_rank.iter().flatten().flat_map(|m| &m.images);
            images
                .map(|im| {
                    let (all, merger) =
                        (spec.forward_flops(im.grid), spec.projector_flops(im.grid));
                    let backward = match (training.encoder(), training.projector()) {
                        (false, false) => 0.0,
                        (false, true) => 2.0 * merger,
                        (true, false) => 2.0 * (all - merger) + merger,
                        (true, true) => 2.0 * all,
                    };
                    all + backward
                })
                .sum()
        });
        let flops = StepFlops {
            model: flops.model + tower,
            ..flops
        };
        let world = self.global_world() as f64;
        let per_device_tflops = |f: f64| f / step_time_s / world / 1e12;
        // Under mpirun: the step's exchanges with the other nodes, and the wait in them.
        let exchange = self.mpi.map(|_| {
            (
                out.exchange_s + std::mem::take(&mut self.update_exchange_s),
                out.exchange_wait_s + std::mem::take(&mut self.update_exchange_wait_s),
            )
        });
        let bound = Bound::of(
            step_time_s,
            out.slowest.update_wait_s,
            out.slowest.h2d_wait_s,
            out.slowest.slot_wait_s,
        );
        let (dpo, grpo) = self.stage.metrics(&out.sums, plan);
        let m = StepMetrics {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens: plan.tokens,
            step_time_s,
            tokens_per_s: plan.tokens as f64 / step_time_s,
            forward_s: out.slowest.forward_s,
            backward_s: out.slowest.backward_s,
            slot_wait_s: out.slowest.slot_wait_s,
            reduce_s: out.reduce_s,
            optimizer_s,
            exchange_s: exchange.map(|e| e.0),
            exchange_wait_s: exchange.map(|e| e.1),
            h2d_wait_s: out.slowest.h2d_wait_s,
            d2h_s: out.slowest.d2h_s,
            update_wait_s: out.slowest.update_wait_s,
            images_s: (out.slowest.images_s > 0.0).then_some(out.slowest.images_s),
            kept_layers: (out.slowest.kept_layers > 0).then_some(out.slowest.kept_layers),
            checkpoint_wait_s: self.host.take_checkpoint_wait()
                + std::mem::take(&mut self.checkpoint_wait_s),
            drives: self.host.take_drive_io().map(|io| DriveMetrics {
                drive_read_bytes: io.read_bytes,
                drive_write_bytes: io.write_bytes,
                drive_read_gb_s: io.read_bytes as f64 / 1e9 / io.read_s.max(1e-9),
                drive_write_gb_s: io.write_bytes as f64 / 1e9 / io.write_s.max(1e-9),
                drive_wait_s: io.wait_s,
            }),
            bound: match exchange {
                Some((x, wait)) => bound.with_exchange(x - wait, out.reduce_s + optimizer_s),
                None => bound,
            },
            peak_gpu_bytes: out.slowest.peak_device_bytes,
            gpu_context_bytes: out.slowest.context_device_bytes,
            launcher_rss_bytes: rss_bytes(),
            launcher_peak_rss_bytes: peak_rss_bytes(),
            startup_s: self.startup_s.take(),
            tflops_megatrain: per_device_tflops(flops.megatrain),
            tflops_model: per_device_tflops(flops.model),
            skipped: out.skipped,
            eval,
            dpo,
            grpo,
        };
        if !m.loss.is_finite() {
            tracing::warn!(step = m.step, "non-finite loss");
        }
        if let Some(w) = self.metrics.as_mut() {
            w.write(&m)?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.step(&m)?;
        }
        if let Some(side) = self.trackers.as_mut() {
            side.step(&m);
        }
        if self.serving.is_none() {
            self.progress.step(&m, self.cfg.training.num_steps);
        }
        Ok(())
    }
}
