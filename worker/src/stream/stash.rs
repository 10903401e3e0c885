//! The per-layer inputs of a micro-batch, kept for its backward: on the device, or
//! (`memory.offload_activations`) in pinned host memory, copied out on the offload stream
//! as the forward makes them and back on the copy stream one layer ahead of the backward.
//!
//! The inputs fetched back land in two device buffers taken at the backward's first input
//! and reused, layer by layer, until its last, instead of a fresh hidden state from torch's
//! caching allocator per layer. Measured on an H200 (benches/results/
//! long_context_landing_buffers_H200_2026-11-26.md): the same device peak as fresh
//! allocations at 128k x 28 layers and 512k x 4 layers (what the allocator holds above the
//! plan is elsewhere), and no allocation per layer.

use std::collections::VecDeque;

use anyhow::{Context, Result, bail};
use tch::{Device, Tensor};

use crate::cuda::{self, Event, Stream, torch_stream};

/// Stashed layer inputs allowed to wait on the device for their copy to the host.
pub(super) const MAX_STASH_IN_FLIGHT: usize = 2;

/// Where the per-layer inputs of a micro-batch wait for the backward.
pub(super) enum Stash {
    /// On the device (the default).
    Device(Vec<Tensor>),
    /// In pinned host buffers, one per layer, reused across micro-batches and steps.
    Host(HostStash),
}

pub(super) struct HostStash {
    device: Device,
    /// Pinned host buffers by layer, grown to the largest input seen.
    host: Vec<Tensor>,
    /// Shapes of the inputs stashed this micro-batch, by layer.
    shapes: Vec<Vec<i64>>,
    /// Device inputs whose copy to the host is in flight, with its completion event.
    leaving: VecDeque<(Event, Tensor)>,
    /// Inputs copied back for the backward (layer, arrival event, tensor), in the order
    /// it takes them.
    arriving: VecDeque<(usize, Event, Tensor)>,
    /// The backward's two landing buffers (flat), layer `l`'s input in `fetched[l % 2]`;
    /// empty outside a backward.
    fetched: Vec<Tensor>,
}

impl HostStash {
    pub(super) fn new(device: Device) -> HostStash {
        HostStash {
            device,
            host: Vec::new(),
            shapes: Vec::new(),
            leaving: VecDeque::new(),
            arriving: VecDeque::new(),
            fetched: Vec::new(),
        }
    }
    /// Enqueues the copy of `x` to layer `l`'s pinned buffer on `offload`.
    pub(super) fn push(&mut self, l: usize, x: Tensor, offload: &Stream) -> Result<()> {
        if l == 0 {
            self.shapes.clear();
            self.arriving.clear();
        }
        let numel = x.numel();
        if self.host.len() <= l {
            self.host.push(Tensor::empty([0], (x.kind(), Device::Cpu)));
        }
        if self.host[l].numel() < numel || self.host[l].kind() != x.kind() {
            let bytes = numel * x.kind().elt_size_in_bytes();
            self.host[l] = Tensor::f_empty([numel as i64], (x.kind(), Device::Cpu))
                // `_pin_memory`: `pin_memory` with a device argument warns (deprecated) on
                // every call, and tch always passes one.
                .and_then(|t| t.f_internal_pin_memory(self.device))
                .with_context(|| {
                    format!(
                        "allocate {:.2} GB of pinned host memory for layer {l}'s input \
                         (memory.offload_activations)",
                        bytes as f64 / 1e9
                    )
                })?;
        }
        while self.leaving.len() >= MAX_STASH_IN_FLIGHT {
            let (done, _x) = self.leaving.pop_front().expect("non-empty");
            done.synchronize()?;
        }
        let x = x.f_contiguous()?;
        let produced = Event::new(false)?;
        produced.record(torch_stream())?;
        cuda::wait(offload.raw(), &produced)?;
        let bytes = numel * x.kind().elt_size_in_bytes();
        // SAFETY: the host buffer is pinned and holds `numel` elements; no copy back from it
        // is pending (the previous micro-batch's backward consumed it before this forward
        // ran on torch's stream, which `produced` follows); `x` stays alive in `leaving`
        // until the copy completes.
        unsafe {
            cuda::copy_d2h(
                self.host[l].data_ptr().cast(),
                x.data_ptr() as u64,
                bytes,
                offload.raw(),
            )?
        };
        let done = Event::new(false)?;
        done.record(offload.raw())?;
        self.shapes.push(x.size());
        self.leaving.push_back((done, x));
        Ok(())
    }

    /// Enqueues the copy back of layer `l`'s input into its landing buffer.
    fn fetch(&mut self, l: usize, copy: &Stream) -> Result<()> {
        let shape = &self.shapes[l];
        let kind = self.host[l].kind();
        let numel: i64 = shape.iter().product();
        let slot = l % 2;
        while self.fetched.len() <= slot {
            self.fetched.push(Tensor::empty([0], (kind, self.device)));
        }
        if self.fetched[slot].numel() < numel as usize || self.fetched[slot].kind() != kind {
            self.fetched[slot] =
                Tensor::f_empty([numel], (kind, self.device)).with_context(|| {
                    format!(
                        "allocate {:.2} GB on the device for layer {l}'s offloaded input",
                        (numel as usize * kind.elt_size_in_bytes()) as f64 / 1e9
                    )
                })?;
        }
        let x = self.fetched[slot]
            .f_narrow(0, 0, numel)?
            .f_view(shape.as_slice())?;
        // The buffer's last reader, layer l + 2's backward, is enqueued on torch's stream
        // before this event (the engine asks for layer l + 1's input after it).
        let free = Event::new(false)?;
        free.record(torch_stream())?;
        cuda::wait(copy.raw(), &free)?;
        let bytes = numel as usize * kind.elt_size_in_bytes();
        // SAFETY: `x` views `bytes` bytes of a live device buffer, read only after `ready`
        // and not read by compute enqueued after `free`; the pinned source holds its input
        // (`pop` waited for every copy out before the first fetch), stays alive in
        // `self.host` and is not rewritten before the next forward, which follows this
        // backward on torch's stream.
        unsafe {
            cuda::copy_h2d(
                x.data_ptr() as u64,
                self.host[l].data_ptr().cast::<u8>(),
                bytes,
                copy.raw(),
            )?
        };
        let ready = Event::new(false)?;
        ready.record(copy.raw())?;
        self.arriving.push_back((l, ready, x));
        Ok(())
    }

    /// Layer `l`'s input back on the device, with the event that marks its arrival;
    /// the next one down is prefetched.
    pub(super) fn pop(&mut self, l: usize, copy: &Stream) -> Result<(Event, Tensor)> {
        if self.arriving.is_empty() {
            // The backward's first input: the forward's last copies out landed during the
            // head's work, so their device tensors (up to MAX_STASH_IN_FLIGHT inputs) go now
            // rather than after the whole backward, which they would outlive idle.
            for (done, x) in self.leaving.drain(..) {
                done.synchronize()?;
                drop(x);
            }
            if l + 1 != self.shapes.len() {
                bail!(
                    "input of layer {l} asked for first, {} were stashed",
                    self.shapes.len()
                );
            }
            self.fetch(l, copy)?;
        }
        if l > 0 {
            self.fetch(l - 1, copy)?;
        }
        let (got, ready, x) = self.arriving.pop_front().expect("fetched");
        if got != l {
            bail!("input of layer {l} asked for, layer {got} is next");
        }
        if l == 0 {
            // The backward's last input: the buffers go back to torch's allocator (`x`
            // keeps its own until layer 0's backward is done with it).
            self.fetched.clear();
        }
        Ok((ready, x))
    }
}
