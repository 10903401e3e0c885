//! The per-step forward and backward over streamed blocks.
//!
//! Forward: embed, then each layer with its input kept (the per-layer checkpoint), then the
//! head with a chunked cross-entropy. Backward: the head, then each layer from the last,
//! recomputed with grad on leaf views of its weights and its saved input, then the
//! embedding. Each block's gradient leaves for a slab slot (several, one per part, for a
//! block larger than a slot) as soon as it exists and the launcher is told once it has
//! landed, so the host reduce overlaps the rest of the backward.
//!
//! Evaluation (and DPO's reference pass) is a separate, forward-only pass
//! ([`Engine::forward_only`]): each layer streamed once, no input kept, the loss (or each
//! row's log-probability) summed without a gradient, no slab touched. The head's
//! objectives are in [`crate::head`].

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ipc_channel::ipc::{IpcReceiver, IpcSender};
use mt::config::hf::ModelSpec;
use mt::data::MicroBatch;
use mt::fault::Phase;
use mt::layout::Layout;
use mt::objective::{Objective, ObjectiveSums};
use mt::plan::{DeviceOpts, DevicePlan};
use mt::protocol::{ForwardOnly, FromWorker, Init, ToWorker, WorkerTimings};
use tch::{Device, Kind, Tensor};

use crate::fault::enter;
use crate::head::{DeviceBatch, Head, HeadOut};
use crate::layer;
use crate::model::{self, BlockWeights, RouterAux};
use crate::stream::{Delivered, Gate, Resident, Streamer, kind_of};

mod control;
mod images;
mod pixels;
mod prefetch;
mod tower;
mod vit_tower;
use control::Control;
pub use images::{MicroImages, Tower};
use prefetch::Prefetch;

/// How long the worker waits for the launcher (a free slab slot, an updated block) before
/// giving up.
const WAIT_TIMEOUT: Duration = Duration::from_secs(600);

pub struct Engine {
    spec: ModelSpec,
    layout: Layout,
    device: Device,
    kind: Kind,
    ce_chunk: i64,
    /// The device plan's options, which resolve each micro-batch's tile.
    plan_opts: DeviceOpts,
    /// Elements of a slab slot: blocks larger than this are sent in parts.
    slot_len: usize,
    streamer: Streamer,
    ctl: Control,
    dump_logits: Option<std::path::PathBuf>,
    /// Per layer: the buffers it reads (name inside the layer, f32 on the device).
    buffers: Vec<Vec<(String, Tensor)>>,
    /// What steps train on (`training.stage`).
    objective: Objective,
    /// `memory.resident_blocks`: the leading blocks kept and updated here.
    resident: Option<Resident>,
    /// A vision-language model's vision tower (its frozen tensors), on the device.
    tower: Option<Tower>,
    /// The next step's images, being decoded ([`prefetch`]).
    prefetch: Option<Prefetch>,
    /// Per layer: what it kept from the micro-batch's forward for its backward
    /// (`memory.recompute`), taken by the backward.
    kept: Vec<Option<layer::Kept>>,
}

/// What a worker's step gave ([`FromWorker::StepDone`]'s fields).
pub struct StepOut {
    pub loss_sum: f64,
    pub tokens: u64,
    pub timings: WorkerTimings,
    /// Under DPO the pairs' sums, under GRPO the completions'.
    pub sums: ObjectiveSums,
    /// Under GRPO on a batch's first step with `num_iterations` > 1: the completion
    /// tokens' log-probabilities, micro-batch after micro-batch.
    pub token_logps: Vec<f32>,
}

/// `init.buffers` on the device, grouped by layer.
pub fn layer_buffers(init: &Init) -> Result<Vec<Vec<(String, Tensor)>>> {
    let device = crate::stream::device_of(init.device);
    let mut by_layer: Vec<Vec<(String, Tensor)>> =
        (0..init.spec.num_layers).map(|_| Vec::new()).collect();
    for b in &init.buffers {
        let Some(layer) = by_layer.get_mut(b.layer) else {
            bail!(
                "buffer `{}` of layer {}: the model has {} layers",
                b.name,
                b.layer,
                init.spec.num_layers
            );
        };
        let t = Tensor::f_from_slice(&b.values)?.f_to_device(device)?;
        layer.push((b.name.clone(), t));
    }
    Ok(by_layer)
}

/// The channels a step talks over.
pub struct Link<'a> {
    pub tx: &'a IpcSender<FromWorker>,
    pub rx: &'a IpcReceiver<ToWorker>,
}

/// The launcher asked to stop while the engine waited.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "launcher asked to shut down mid-step")
    }
}

impl std::error::Error for Interrupted {}

impl Engine {
    pub fn new(init: &Init, mut streamer: Streamer, tower: Option<Tower>) -> Result<Engine> {
        let device = crate::stream::device_of(init.device);
        let resident = init
            .resident
            .as_ref()
            .map(|r| Resident::new(r, &init.layout, init.dtype, device))
            .transpose()?;
        if let Some(r) = &resident {
            streamer.set_resident(r.weights());
        }
        Ok(Engine {
            spec: init.spec.clone(),
            layout: init.layout.clone(),
            device,
            kind: kind_of(init.dtype),
            ce_chunk: init.ce_chunk_tokens as i64,
            plan_opts: DeviceOpts::of_worker(init, false),
            slot_len: init.layout.grad_slot_len(),
            ctl: Control {
                free_slots: (0..init.num_slots).rev().collect(),
                ready: vec![true; init.layout.blocks.len()],
                update_wait_s: 0.0,
                resident: resident.as_ref().map_or(0, Resident::blocks),
                sent: Default::default(),
                last_micro: 0,
                final_parts: Vec::new(),
            },
            streamer,
            dump_logits: init.dump_logits.clone(),
            buffers: layer_buffers(init)?,
            objective: init.objective,
            resident,
            tower,
            prefetch: None,
            kept: Vec::new(),
        })
    }

    /// Handles a message that arrived between steps.
    pub fn handle(&mut self, msg: ToWorker) -> Result<()> {
        match msg {
            ToWorker::ResidentUpdate { hp } => {
                self.copy_final_gradients()?;
                match self.resident.as_mut() {
                    Some(r) => r.update(&hp),
                    None => bail!("ResidentUpdate without resident blocks"),
                }
            }
            msg => {
                self.ctl.handle(msg)?;
                self.copy_final_gradients()
            }
        }
    }

    /// Between steps: elements `range` of resident block `block`'s `part`, loaded from the
    /// transfer region or saved into it.
    pub fn resident_copy(
        &mut self,
        load: bool,
        block: usize,
        range: std::ops::Range<usize>,
        part: mt::protocol::ResidentPart,
    ) -> Result<()> {
        match self.resident.as_mut() {
            Some(r) => r.copy(load, block, range, part),
            None => bail!("ResidentCopy without resident blocks"),
        }
    }

    /// Copies back the reduced gradient of the resident blocks' parts found final since
    /// the last call.
    fn copy_final_gradients(&mut self) -> Result<()> {
        let Some(r) = self.resident.as_mut() else {
            return Ok(());
        };
        for (block, part) in std::mem::take(&mut self.ctl.final_parts) {
            let range = self
                .layout
                .grad_parts(block, self.slot_len)
                .nth(part)
                .context("a final part of a resident block")?;
            r.gradient_final(block, range)?;
        }
        Ok(())
    }

    /// One optimizer step's share of this worker: every micro-batch, forward and backward.
    /// With `weights_pending`, each store block is read only after the launcher says its
    /// update for this step is done.
    pub fn step(
        &mut self,
        micro: &[MicroBatch],
        next_images: Vec<mt::data::BatchImage>,
        loss_scale: f64,
        weights_pending: bool,
        link: &Link,
    ) -> Result<StepOut> {
        let mut tm = WorkerTimings::default();
        let (mut loss_sum, mut tokens) = (0.0, 0);
        let mut sums = self.objective.empty_sums();
        let mut token_logps = Vec::new();
        self.ctl.ready.fill(!weights_pending);
        self.ctl.update_wait_s = 0.0;
        self.ctl.last_micro = micro.len().saturating_sub(1);
        // This step's images where the previous step had them decoded; the next step's
        // decoded from now on, while this one computes.
        let t_images = Instant::now();
        let mut decoded = match self.prefetch.take() {
            Some(p) => p.take(micro)?.map(Vec::into_iter),
            None => None,
        };
        tm.images_s += t_images.elapsed().as_secs_f64();
        if let Some(px) = self.tower.as_ref().and_then(|t| t.pixels.clone()) {
            self.prefetch = Prefetch::start(px, next_images);
        }
        for (mi, mb) in micro.iter().enumerate() {
            crate::fault::micro_batch(mb.rows, mb.seq_len, !mb.position_ids.is_empty());
            enter(Phase::Upload, None);
            let batch = self.upload(mi, mb)?;
            let kept = batch.kept.iter().filter(|&&k| k).count();
            tm.kept_layers = tm.kept_layers.max(kept);
            let t_images = Instant::now();
            let mut images = self.micro_images(mb, decoded.as_mut().and_then(Iterator::next))?;
            if images.is_some() {
                tm.images_s += t_images.elapsed().as_secs_f64();
            }
            let (ctl, rx) = (&mut self.ctl, link.rx);
            self.streamer
                .begin_micro(&self.layout, &mut |b| ctl.wait_block(b, rx))?;
            let t0 = Instant::now();
            let mut ctx = self.context(mb, &batch, images.as_ref());
            // The micro-batch's share of the step's loss: its label tokens, its pairs, or
            // its completions (its completion tokens under `dapo`).
            let units = self
                .objective
                .units(mb.rows, batch.valid_m.size()[0] as u64);
            let share = units as f64 * loss_scale;
            ctx.router_aux =
                RouterAux::new(&self.spec, &mb.row_lens, mb.seq_len, share, self.device);
            let x_bth = self.forward(&batch, images.as_mut(), &ctx, link)?;
            if let Some(path) = self.dump_logits.take() {
                self.write_logits(&path, &x_bth, link)?;
            }
            tm.forward_s += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let mut input = Input {
                mb,
                batch: &batch,
                images: images.as_mut(),
            };
            let out = self.backward(mi, &mut input, &ctx, loss_scale, x_bth, link, &mut tm)?;
            loss_sum += out.loss_sum;
            if !sums.add(&out.sums) {
                bail!("micro-batch {mi}: the head gave the sums of another objective");
            }
            token_logps.extend(out.token_logps);
            tm.backward_s += t1.elapsed().as_secs_f64();
            self.streamer.end_micro()?;
            tokens += batch.valid_m.size()[0] as u64;
        }
        self.announce(link, true)?;
        let stats = self.streamer.take_stats()?;
        tm.h2d_wait_s = stats.h2d_wait_s;
        tm.update_wait_s = self.ctl.update_wait_s;
        tm.d2h_s = stats.d2h_s;
        tm.peak_device_bytes = stats.peak_device_bytes;
        tm.context_device_bytes = stats.context_device_bytes;
        Ok(StepOut {
            loss_sum,
            tokens,
            timings: tm,
            sums,
            token_logps,
        })
    }

    /// One forward-only micro-batch under the weights in the store: embed, every layer,
    /// the head, without grad or kept inputs; its summed token cross-entropy
    /// ([`ForwardOnly::Loss`]) or each row's summed label log-probability
    /// ([`ForwardOnly::RowLogProbs`]) or label token's ([`ForwardOnly::TokenLogProbs`]; then
    /// the loss is 0). The launcher sends one only when
    /// no update is pending, so every block is ready.
    pub fn forward_only(&mut self, mb: &MicroBatch, what: ForwardOnly) -> Result<(f64, Vec<f64>)> {
        let _guard = tch::no_grad_guard();
        crate::fault::micro_batch(mb.rows, mb.seq_len, !mb.position_ids.is_empty());
        enter(Phase::Upload, None);
        let batch = self.upload(0, mb)?;
        let mut images = self.micro_images(mb, None)?;
        enter(Phase::Eval, None);
        let ctx = self.context(mb, &batch, images.as_ref());
        let layout = &self.layout;
        let ready: Gate = &mut |_| Ok(());
        self.streamer.begin_forward(layout, ready)?;
        let embed = self.streamer.embed(layout, ready)?;
        let embed_w = BlockWeights::views(&embed, &layout.blocks[Layout::EMBED]);
        if let Some(i) = images.as_mut() {
            i.encode(&embed_w, false);
        }
        let mut x_bth = embed_tokens(&self.spec, &embed_w, &batch.ids_bt, images.as_ref())?;
        // A tied head reads the embedding: keep it until then.
        let tied = layout.tied_embeddings.then_some(embed_w);
        if tied.is_none() {
            drop(embed);
            self.streamer.release_embed();
        }
        for l in 0..layout.num_layers() {
            enter(Phase::Eval, Some(l));
            let flat = self.streamer.layer(layout, l, ready)?;
            let w = BlockWeights::views(&flat, &layout.blocks[layout.layer_block(l)])
                .with(&self.buffers[l]);
            x_bth = layer::forward(&self.spec, l, &w, &x_bth, &ctx, batch.tile);
            if let Some(i) = &images {
                x_bth = i.after_layer(l, x_bth);
            }
        }
        enter(Phase::Eval, None);
        let head = self.streamer.head(layout, ready)?;
        let head_w = BlockWeights::views(&head, &layout.blocks[layout.head_block()]);
        let lm_head = match &tied {
            Some(embed_w) => embed_w.get("model.embed_tokens.weight"),
            None => head_w.get("lm_head.weight"),
        };
        let h = self.head(&head_w, lm_head);
        let out = match what {
            ForwardOnly::Loss => (h.loss_sum(&batch, &x_bth), Vec::new()),
            ForwardOnly::RowLogProbs => (0.0, h.row_logps(&batch, &x_bth)),
            ForwardOnly::TokenLogProbs => {
                let logps = h.token_logps(&batch, &x_bth);
                (0.0, logps.into_iter().map(f64::from).collect())
            }
            ForwardOnly::TokenLogProbsEntropy => {
                let (logps, entropy) = h.token_logps_entropy(&batch, &x_bth);
                (
                    0.0,
                    logps.into_iter().chain(entropy).map(f64::from).collect(),
                )
            }
        };
        drop((head_w, head, tied));
        self.streamer.end_micro()?;
        // The eval's transfers and memory are not the next step's.
        self.streamer.take_stats()?;
        Ok(out)
    }

    /// The micro-batch's rotary tables and masks: from its 1-D positions (packed) or 0..T,
    /// changed where it has images ([`MicroImages::context`]: Qwen's 3-D positions,
    /// Gemma 3's bidirectional image blocks).
    fn context(
        &self,
        mb: &MicroBatch,
        batch: &DeviceBatch,
        images: Option<&MicroImages>,
    ) -> model::Context {
        let ctx = model::Context::new(
            &self.spec,
            mb.seq_len,
            batch.pos_bt.as_ref(),
            self.kind,
            self.device,
        );
        match images {
            Some(i) => i.context(ctx, &self.spec, self.kind, self.device),
            None => ctx,
        }
    }

    /// The micro-batch's images as the language model reads them ([`Tower::micro_images`]:
    /// the frozen tower's output over its images' pixels, `decoded` already where the
    /// prefetch has them, and what the attention reads of them); None for text only (a
    /// text-only row's 3-D positions are its 1-D ones, and it has no image block, so text
    /// trains exactly without them).
    fn micro_images(
        &self,
        mb: &MicroBatch,
        decoded: Option<Vec<Vec<f32>>>,
    ) -> Result<Option<MicroImages>> {
        if mb.images.is_empty() {
            return Ok(None);
        }
        let Some(tower) = &self.tower else {
            bail!(
                "the micro-batch has {} images but this model has no vision tower here (a random init carries none)",
                mb.images.len()
            );
        };
        tower
            .micro_images(&self.spec, mb, decoded, self.kind, self.device)
            .map(Some)
    }

    fn head<'a>(&'a self, w: &'a BlockWeights, lm_head: &'a Tensor) -> Head<'a> {
        Head {
            spec: &self.spec,
            chunk: self.ce_chunk,
            w,
            lm_head,
        }
    }

    fn upload(&self, mi: usize, mb: &MicroBatch) -> Result<DeviceBatch> {
        let (b, t) = (mb.rows as i64, mb.seq_len as i64);
        let n = (b * t) as usize;
        let pos_ok = mb.position_ids.is_empty() || mb.position_ids.len() == n;
        if mb.input_ids.len() != n || mb.labels.len() != n || t == 0 || !pos_ok {
            bail!(
                "micro-batch {mi}: {} ids / {} labels / {} positions for {b}x{t}",
                mb.input_ids.len(),
                mb.labels.len(),
                mb.position_ids.len()
            );
        }
        let dev = self.device;
        let grid = |v: &[i32]| -> Result<Tensor, tch::TchError> {
            Tensor::f_from_slice(v)?
                .f_view([b, t])?
                .f_to_kind(Kind::Int64)
        };
        let pos_bt = match mb.position_ids.is_empty() {
            true => None,
            false => Some(grid(&mb.position_ids)?.f_to_device(dev)?),
        };
        let ids_bt = grid(&mb.input_ids)?.f_to_device(dev)?;
        // Targets are the labels shifted left by one; the last position predicts nothing.
        let labels_bt = grid(&mb.labels)?;
        let pad = Tensor::f_full([b, 1], -100, (Kind::Int64, Device::Cpu))?;
        let targets =
            Tensor::f_cat(&[labels_bt.f_narrow(1, 1, t - 1)?, pad], 1)?.f_reshape([-1])?;
        let valid_m = targets.f_ne(-100)?.f_nonzero()?.f_reshape([-1])?;
        let targets_m = targets.f_index_select(0, &valid_m)?.f_to_device(dev)?;
        let rows_m = valid_m.f_divide_scalar_mode(t, "floor")?.f_to_device(dev)?;
        // A row's label tokens: its labels after the shift that are not ignored.
        let row_tokens = mb
            .labels
            .chunks(t as usize)
            .map(|row| row[1..].iter().filter(|&&l| l != -100).count() as u64)
            .collect();
        let o = DeviceOpts {
            packed: pos_bt.is_some(),
            ..self.plan_opts
        };
        let plan = DevicePlan::new(&self.spec, &self.layout, o, mb.rows, mb.seq_len);
        let (tile, kept) = (plan.tile, mt::plan::kept_layers(&self.spec, plan.keep));
        Ok(DeviceBatch {
            ids_bt,
            pos_bt,
            valid_m: valid_m.f_to_device(dev)?,
            targets_m,
            rows_m,
            row_tokens,
            tile,
            kept,
        })
    }

    /// Embedding and every layer without grad, each layer's input stashed for the
    /// backward (a trained vision encoder's block inputs too, in `images`); returns the
    /// last layer's output.
    fn forward(
        &mut self,
        batch: &DeviceBatch,
        images: Option<&mut MicroImages>,
        ctx: &model::Context,
        link: &Link,
    ) -> Result<Tensor> {
        let layout = &self.layout;
        let _guard = tch::no_grad_guard();
        let (ctl, rx) = (&mut self.ctl, link.rx);
        let gate = &mut |b| ctl.wait_block(b, rx);
        enter(Phase::Forward, None);
        self.kept.clear();
        self.kept.resize_with(layout.num_layers(), || None);
        let embed = self.streamer.embed(layout, gate)?;
        let embed_w = BlockWeights::views(&embed, &layout.blocks[Layout::EMBED]);
        let images = images.map(|i| {
            i.encode(&embed_w, true);
            &*i
        });
        let mut x_bth = embed_tokens(&self.spec, &embed_w, &batch.ids_bt, images)?;
        drop((embed_w, embed));
        if !layout.tied_embeddings {
            // Not needed again before the end of the backward.
            self.streamer.release_embed();
        }
        for l in 0..layout.num_layers() {
            enter(Phase::Forward, Some(l));
            let flat = self.streamer.layer(layout, l, gate)?;
            let w = BlockWeights::views(&flat, &layout.blocks[layout.layer_block(l)])
                .with(&self.buffers[l]);
            let mut y_bth = match batch.kept[l] {
                true => {
                    let (y_bth, kept) =
                        layer::forward_keeping(&self.spec, l, &w, &x_bth, ctx, batch.tile);
                    self.kept[l] = Some(kept);
                    y_bth
                }
                false => layer::forward(&self.spec, l, &w, &x_bth, ctx, batch.tile),
            };
            // Qwen3-VL's deepstack: the next layer's input (and stash) is the sum.
            if let Some(i) = images {
                y_bth = i.after_layer(l, y_bth);
            }
            self.streamer
                .stash_input(l, std::mem::replace(&mut x_bth, y_bth))?;
        }
        Ok(x_bth)
    }

    /// Writes the logits of every position of `x_bth` (B, T, H) as f32 `logits` (B, T, V).
    fn write_logits(&mut self, path: &std::path::Path, x_bth: &Tensor, link: &Link) -> Result<()> {
        let layout = &self.layout;
        let (ctl, rx) = (&mut self.ctl, link.rx);
        let gate = &mut |b| ctl.wait_block(b, rx);
        let embed = self.streamer.embed(layout, gate)?;
        let head = self.streamer.head(layout, gate)?;
        let _guard = tch::no_grad_guard();
        let embed_w = BlockWeights::views(&embed, &layout.blocks[Layout::EMBED]);
        let head_w = BlockWeights::views(&head, &layout.blocks[layout.head_block()]);
        let lm_head = match layout.tied_embeddings {
            true => embed_w.get("model.embed_tokens.weight"),
            false => head_w.get("lm_head.weight"),
        };
        let (b, t, h) = x_bth.size3()?;
        let hn_mh = model::final_norm(&self.spec, &head_w, &x_bth.reshape([b * t, h]));
        let logits = model::logits(&self.spec, &hn_mh, lm_head)
            .reshape([b, t, -1])
            .to_device(Device::Cpu);
        drop((embed_w, embed));
        if !layout.tied_embeddings {
            self.streamer.release_embed();
        }
        Tensor::write_safetensors(&[("logits", &logits)], path)
            .with_context(|| format!("write logits to {}", path.display()))
    }

    /// Head loss and gradients, then every layer recomputed and backpropagated, then the
    /// embedding; returns the summed loss (plus the router aux loss, in the same units:
    /// divided by `scale`).
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &mut self,
        mi: usize,
        input: &mut Input,
        ctx: &model::Context,
        scale: f64,
        x_bth: Tensor,
        link: &Link,
        tm: &mut WorkerTimings,
    ) -> Result<HeadOut> {
        let (mb, batch) = (input.mb, input.batch);
        let layout = self.layout.clone();
        let (embed_block, head_block) = (
            &layout.blocks[Layout::EMBED],
            &layout.blocks[layout.head_block()],
        );
        let (ctl, rx) = (&mut self.ctl, link.rx);
        let gate = &mut |b| ctl.wait_block(b, rx);
        enter(Phase::Head, None);
        let head_w = BlockWeights::leaves(&self.streamer.head(&layout, gate)?, head_block);
        // A tied head reads the embedding, whose leaf then collects both gradients.
        let tied_embed_w = match layout.tied_embeddings {
            true => Some(BlockWeights::leaves(
                &self.streamer.embed(&layout, gate)?,
                embed_block,
            )),
            false => None,
        };

        // Head: final norm, chunked lm_head + cross-entropy, backward to the last hidden state.
        let lm_head = match &tied_embed_w {
            Some(embed_w) => embed_w.get("model.embed_tokens.weight"),
            None => head_w.get("lm_head.weight"),
        };
        // The last hidden state lives only through the head: the gradient it hands on (dy)
        // is all the layers need.
        let h = self.head(&head_w, lm_head);
        let (mut out, mut dy_bth) = h.backward_objective(&self.objective, batch, mb, scale, &x_bth);
        drop(x_bth);
        self.send(mi, layout.head_block(), &head_w, link, tm)?;
        drop(head_w);
        self.streamer.release_head();

        // Layers, last to first: recompute with grad, backpropagate dy.
        for l in (0..layout.num_layers()).rev() {
            enter(Phase::Backward, Some(l));
            let (ctl, rx) = (&mut self.ctl, link.rx);
            let flat = self
                .streamer
                .layer(&layout, l, &mut |b| ctl.wait_block(b, rx))?;
            let w = BlockWeights::leaves(&flat, &layout.blocks[layout.layer_block(l)])
                .with(&self.buffers[l]);
            let x_bth = self.streamer.stashed_input(l)?;
            if let Some(i) = input.images.as_deref_mut() {
                i.gather_deepstack(l, &dy_bth);
            }
            dy_bth = match self.kept[l].take() {
                Some(kept) => {
                    layer::backward_kept(&self.spec, l, &w, x_bth, kept, dy_bth, ctx, batch.tile)
                }
                None => layer::backward(&self.spec, l, &w, x_bth, dy_bth, ctx, batch.tile),
            };
            self.send(mi, layout.layer_block(l), &w, link, tm)?;
        }

        // Embedding (with tied embeddings its leaf already holds the lm_head gradient).
        enter(Phase::EmbeddingBackward, None);
        let embed_w = match tied_embed_w {
            Some(w) => w,
            None => {
                let (ctl, rx) = (&mut self.ctl, link.rx);
                let flat = self
                    .streamer
                    .embed(&layout, &mut |b| ctl.wait_block(b, rx))?;
                BlockWeights::leaves(&flat, embed_block)
            }
        };
        // The image tokens' rows hold the tower's features: no gradient reaches the
        // embedding there; a trained projector's leaves (in this block) take it, and a
        // trained encoder's, block by block, after. Qwen3-VL's deepstack mergers, where the
        // tower trains, are recomputed and backpropagated in the same pass.
        let e_bth = embed_tokens(&self.spec, &embed_w, &batch.ids_bt, input.images.as_deref())?;
        let mut outputs = vec![(e_bth, dy_bth)];
        if let Some(i) = input.images.as_deref_mut() {
            outputs.extend(i.deepstack_outputs(&embed_w)?);
        }
        crate::kernels::tape::backward_with_grads(outputs);
        if let Some(i) = input.images.as_deref_mut() {
            i.encoder_backward(&embed_w)?;
        }
        self.send(mi, Layout::EMBED, &embed_w, link, tm)?;
        let aux = ctx.router_aux.as_ref().map_or(0.0, RouterAux::loss);
        out.loss_sum += aux / scale;
        Ok(out)
    }

    /// Hands a block's gradients to free slab slots, one per part (`Layout::grad_parts`:
    /// the embedding and lm_head are larger than a slot); announces whatever has landed.
    fn send(
        &mut self,
        mi: usize,
        index: usize,
        w: &BlockWeights,
        link: &Link,
        tm: &mut WorkerTimings,
    ) -> Result<()> {
        for (part, range) in self.layout.grad_parts(index, self.slot_len).enumerate() {
            let slot = self.take_slot(link, tm)?;
            let to = Delivered {
                micro: mi,
                block: index,
                part,
                slot,
            };
            self.streamer
                .offload(to, range, &self.layout.blocks[index], w)?;
            self.announce(link, false)?;
            self.copy_final_gradients()?;
        }
        Ok(())
    }

    /// Tells the launcher about every offload that has landed (all of them with `wait`).
    fn announce(&mut self, link: &Link, wait: bool) -> Result<()> {
        for d in self.streamer.delivered(wait)? {
            if d.block < self.ctl.resident {
                self.ctl.sent.insert(d.slot, (d.micro, d.block, d.part));
            }
            link.tx
                .send(FromWorker::LayerGrads {
                    micro: d.micro,
                    block: d.block,
                    part: d.part,
                    slot: d.slot,
                })
                .context("launcher channel closed")?;
        }
        Ok(())
    }

    fn take_slot(&mut self, link: &Link, tm: &mut WorkerTimings) -> Result<usize> {
        let deadline = Instant::now() + WAIT_TIMEOUT;
        while self.ctl.free_slots.is_empty() {
            // Slots come back only after the launcher reduced them, which needs our
            // announcements: land and announce our own copies before blocking on it.
            // Waiting for our copies is waiting for the device's backward (the host
            // queues ahead of it), not for the reduce: only the launcher's part counts
            // as the slot wait.
            if self.streamer.wait_oldest()? {
                self.announce(link, false)?;
                continue;
            }
            let t0 = Instant::now();
            self.ctl
                .receive(link.rx, deadline, "a free gradient slab slot")?;
            tm.slot_wait_s += t0.elapsed().as_secs_f64();
        }
        Ok(self.ctl.free_slots.pop().expect("non-empty"))
    }
}

/// One micro-batch as the backward reads it: the data, its device copy, its images (a
/// trained encoder's kept block inputs, which its backward releases).
struct Input<'a> {
    mb: &'a MicroBatch,
    batch: &'a DeviceBatch,
    images: Option<&'a mut MicroImages>,
}

/// The embedding of `ids_bt` (B, T) -> (B, T, H), with the images' features at their
/// tokens ([`model::place_image_features`]) where the micro-batch has images (a trained
/// projector's computed from `w`, the embedding block).
fn embed_tokens(
    spec: &ModelSpec,
    w: &BlockWeights,
    ids_bt: &Tensor,
    images: Option<&MicroImages>,
) -> Result<Tensor> {
    let e_bth = model::embed(spec, w, ids_bt);
    let Some(images) = images else {
        return Ok(e_bth);
    };
    let f_mh = images.features_mh(w);
    model::place_image_features(ids_bt, e_bth, Some(&f_mh), images.image_token_id)
        .context("place the images' features at their tokens")
}
