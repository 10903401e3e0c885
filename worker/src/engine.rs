//! The per-step forward and backward over streamed blocks.
//!
//! Forward: embed, then each layer with its input kept (the per-layer checkpoint), then the
//! head with a chunked cross-entropy. Backward: the head, then each layer from the last,
//! recomputed with grad on leaf views of its weights and its saved input, then the
//! embedding. Each block's gradient goes to a slab slot as soon as it exists, and the
//! launcher is told, so the host reduce overlaps the rest of the backward.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ipc_channel::TryRecvError;
use ipc_channel::ipc::{IpcReceiver, IpcSender};
use mt::config::hf::ModelSpec;
use mt::layout::{Block, Layout};
use mt::protocol::{FromWorker, Init, MicroBatch, ToWorker, WorkerTimings};
use tch::{Device, Kind, Tensor};

use crate::model::{self, BlockWeights};
use crate::stream::{BlockSource, SlabWriter, kind_of};

/// How long the backward waits for the launcher to free a slab slot before giving up.
const SLOT_TIMEOUT: Duration = Duration::from_secs(600);

pub struct Engine {
    spec: ModelSpec,
    layout: Layout,
    device: Device,
    kind: Kind,
    ce_chunk: i64,
    source: BlockSource,
    sink: GradSink,
}

/// The gradient slab and which of its slots this worker owns right now.
pub struct GradSink {
    slab: SlabWriter,
    free_slots: Vec<usize>,
}

/// The channels a step talks over.
pub struct Link<'a> {
    pub tx: &'a IpcSender<FromWorker>,
    pub rx: &'a IpcReceiver<ToWorker>,
}

/// What the launcher said while the engine waited for a slot, that is not a slot.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "launcher asked to shut down mid-step")
    }
}

impl std::error::Error for Interrupted {}

impl Engine {
    pub fn new(init: &Init, source: BlockSource, slab: SlabWriter) -> Engine {
        Engine {
            spec: init.spec.clone(),
            layout: init.layout.clone(),
            device: crate::stream::device_of(init.device),
            kind: kind_of(init.dtype),
            ce_chunk: init.ce_chunk_tokens as i64,
            source,
            sink: GradSink {
                free_slots: (0..slab.slots()).rev().collect(),
                slab,
            },
        }
    }

    /// One optimizer step's share of this worker: every micro-batch, forward and backward.
    /// Returns (summed token loss, label tokens, timings).
    pub fn step(
        &mut self,
        micro: &[MicroBatch],
        loss_scale: f64,
        link: &Link,
    ) -> Result<(f64, u64, WorkerTimings)> {
        let mut timings = WorkerTimings::default();
        let (mut loss_sum, mut tokens) = (0.0, 0);
        for (mi, mb) in micro.iter().enumerate() {
            let (l, n) = self.micro_step(mi, mb, loss_scale, link, &mut timings)?;
            loss_sum += l;
            tokens += n;
        }
        Ok((loss_sum, tokens, timings))
    }

    fn micro_step(
        &mut self,
        mi: usize,
        mb: &MicroBatch,
        scale: f64,
        link: &Link,
        timings: &mut WorkerTimings,
    ) -> Result<(f64, u64)> {
        let (b, t) = (mb.rows as i64, mb.seq_len as i64);
        if mb.input_ids.len() != (b * t) as usize || mb.labels.len() != (b * t) as usize {
            bail!(
                "micro-batch {mi}: {} ids / {} labels for {b}x{t}",
                mb.input_ids.len(),
                mb.labels.len()
            );
        }
        let ids_bt = Tensor::from_slice(&mb.input_ids)
            .view([b, t])
            .to_kind(Kind::Int64)
            .to_device(self.device);
        // Targets are the labels shifted left by one; the last position predicts nothing.
        let labels_bt = Tensor::from_slice(&mb.labels)
            .view([b, t])
            .to_kind(Kind::Int64);
        let targets_bt = Tensor::cat(
            &[
                labels_bt.narrow(1, 1, t - 1),
                Tensor::full([b, 1], -100, (Kind::Int64, Device::Cpu)),
            ],
            1,
        );
        let targets = targets_bt.reshape([-1]);
        let valid = targets
            .ne(-100)
            .nonzero()
            .reshape([-1])
            .to_device(self.device);
        let targets = targets.to_device(self.device).index_select(0, &valid);
        let ctx = model::Context::new(&self.spec, mb.seq_len, self.kind, self.device);
        let layout = &self.layout;
        let (embed_block, head_block) = (
            &layout.blocks[Layout::EMBED],
            &layout.blocks[layout.head_block()],
        );

        // Forward, keeping each layer's input.
        let t0 = Instant::now();
        let mut inputs = Vec::with_capacity(layout.num_layers());
        let mut x_bth = tch::no_grad(|| {
            let w = self.source.fetch(embed_block);
            model::embed(&self.spec, &BlockWeights::views(&w, embed_block), &ids_bt)
        });
        for l in 0..layout.num_layers() {
            let block = &layout.blocks[layout.layer_block(l)];
            let w = self.source.fetch(block);
            let y = tch::no_grad(|| {
                model::decoder_layer(&self.spec, l, &BlockWeights::views(&w, block), &x_bth, &ctx)
            });
            inputs.push(std::mem::replace(&mut x_bth, y));
        }
        timings.forward_s += t0.elapsed().as_secs_f64();

        // Head: final norm, chunked lm_head + cross-entropy, backward to the last hidden state.
        let t1 = Instant::now();
        let embed_flat = self.source.fetch(embed_block);
        let embed_w = BlockWeights::leaves(&embed_flat, embed_block);
        let head_flat = self.source.fetch(head_block);
        let head_w = BlockWeights::leaves(&head_flat, head_block);
        let lm_head = if layout.tied_embeddings {
            embed_w.get("model.embed_tokens.weight")
        } else {
            head_w.get("lm_head.weight")
        };
        let h = self.spec.hidden_size as i64;
        let x_leaf = x_bth.detach().set_requires_grad(true);
        let n_valid = valid.size()[0];
        let mut loss_sum = 0.0;
        if n_valid > 0 {
            let hn_mh = model::final_norm(
                &self.spec,
                &head_w,
                &x_leaf.view([-1, h]).index_select(0, &valid),
            );
            let hn_leaf = hn_mh.detach().set_requires_grad(true);
            let mut start = 0;
            while start < n_valid {
                let len = self.ce_chunk.min(n_valid - start);
                let loss = model::chunk_loss_sum(
                    &self.spec,
                    &hn_leaf.narrow(0, start, len),
                    lm_head,
                    &targets.narrow(0, start, len),
                );
                loss_sum += loss.double_value(&[]);
                (loss * scale).backward();
                start += len;
            }
            (hn_mh * hn_leaf.grad()).sum(Kind::Float).backward();
        }
        self.sink
            .send(mi, layout.head_block(), head_block, &head_w, link, timings)?;
        let mut dy_bth = if n_valid > 0 {
            x_leaf.grad()
        } else {
            x_leaf.zeros_like()
        };

        // Layers, last to first: recompute with grad, backpropagate dy.
        for l in (0..layout.num_layers()).rev() {
            let block = &layout.blocks[layout.layer_block(l)];
            let flat = self.source.fetch(block);
            let w = BlockWeights::leaves(&flat, block);
            let x_in = inputs
                .pop()
                .expect("one saved input per layer")
                .set_requires_grad(true);
            let y_bth = model::decoder_layer(&self.spec, l, &w, &x_in, &ctx);
            (y_bth * &dy_bth).sum(Kind::Float).backward();
            dy_bth = x_in.grad();
            self.sink
                .send(mi, layout.layer_block(l), block, &w, link, timings)?;
        }

        // Embedding (with tied embeddings its leaf already holds the lm_head gradient).
        let e_bth = model::embed(&self.spec, &embed_w, &ids_bt);
        (e_bth * &dy_bth).sum(Kind::Float).backward();
        self.sink
            .send(mi, Layout::EMBED, embed_block, &embed_w, link, timings)?;
        timings.backward_s += t1.elapsed().as_secs_f64();
        Ok((loss_sum, n_valid as u64))
    }

    pub fn free_slot(&mut self, slot: usize) {
        self.sink.free_slot(slot);
    }
}

impl GradSink {
    /// Copies a block's gradients into a free slab slot and tells the launcher.
    fn send(
        &mut self,
        mi: usize,
        index: usize,
        block: &Block,
        w: &BlockWeights,
        link: &Link,
        tm: &mut WorkerTimings,
    ) -> Result<()> {
        let t0 = Instant::now();
        let slot = self.take_slot(link.rx)?;
        tm.slot_wait_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let out = self.slab.slot(slot, block.len)?;
        w.write_grads(block, &out);
        tm.d2h_s += t1.elapsed().as_secs_f64();
        link.tx
            .send(FromWorker::LayerGrads {
                micro: mi,
                block: index,
                slot,
            })
            .context("launcher channel closed")?;
        Ok(())
    }

    fn take_slot(&mut self, rx: &IpcReceiver<ToWorker>) -> Result<usize> {
        let deadline = Instant::now() + SLOT_TIMEOUT;
        while self.free_slots.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.try_recv_timeout(left) {
                Ok(ToWorker::SlotFree { slot }) => self.free_slot(slot),
                Ok(ToWorker::Shutdown) => return Err(Interrupted.into()),
                Ok(other) => bail!("unexpected message mid-step: {other:?}"),
                Err(TryRecvError::Empty) => {
                    bail!("no gradient slab slot was freed within {SLOT_TIMEOUT:?}")
                }
                Err(TryRecvError::IpcError(e)) => bail!("launcher channel closed: {e:?}"),
            }
        }
        Ok(self.free_slots.pop().expect("non-empty"))
    }

    fn free_slot(&mut self, slot: usize) {
        debug_assert!(!self.free_slots.contains(&slot));
        self.free_slots.push(slot);
    }
}
