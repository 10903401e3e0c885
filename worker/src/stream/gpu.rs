//! The CUDA streamer: pinned regions, transient embed/head buffers, a ring of layer
//! buffers, gradients leaving on their own stream, and the per-layer inputs kept on the
//! device or offloaded to pinned host memory.
//!
//! GPU memory is bounded by what one phase of the micro-batch needs, not by the model:
//!
//! - layers stream through a ring of [`RING`] buffers sized by the largest layer;
//! - the embedding and head are loaded only around the compute that reads them and
//!   released right after (the embedding stays for the whole micro-batch only when the
//!   head is tied to it), so they never sit beside the layers' backward;
//! - at most [`MAX_D2H_IN_FLIGHT`] blocks of gradients wait on the device for their copy
//!   to the slab, besides the block being computed.
//!
//! Transient buffers come from torch's caching allocator on torch's stream. A copy into
//! one first waits for an event recorded on torch's stream after the allocation (the
//! memory's previous users ran there), and torch's stream waits for the copy before any
//! read, so the allocator's same-stream reuse rule keeps holding.

use std::collections::VecDeque;
use std::ops::Range;

use anyhow::{Context, Result, bail};
use mt::fault::Phase;
use mt::layout::{Block, Layout};
use tch::{Device, Kind, Tensor};

use super::stash::{HostStash, Stash};
use super::{Delivered, Gate, Regions, TransferStats, kind_of};
use crate::cuda::{self, Event, HostRegistration, Stream, torch_stream};
use crate::model::BlockWeights;

/// Layer buffers in the ring (double buffering).
const RING: usize = 2;

/// Blocks of gradients allowed to wait on the device for their copy to the slab.
const MAX_D2H_IN_FLIGHT: usize = 2;

/// A device buffer with the events that order its reuse.
struct DeviceBuf {
    data: Tensor,
    /// The last copy into it completed.
    ready: Event,
    /// The last compute reading it completed.
    free: Event,
}

impl DeviceBuf {
    /// `what` names the buffer in an error.
    fn new(len: usize, kind: Kind, device: Device, what: &str) -> Result<DeviceBuf> {
        let data = Tensor::f_empty([len as i64], (kind, device)).with_context(|| {
            format!(
                "allocate the device buffer of {what} ({:.2} GB)",
                (len * kind.elt_size_in_bytes()) as f64 / 1e9
            )
        })?;
        let (ready, free) = (Event::new(false)?, Event::new(false)?);
        ready.record(torch_stream())?;
        free.record(torch_stream())?;
        Ok(DeviceBuf { data, ready, free })
    }

    fn ptr(&self) -> u64 {
        self.data.data_ptr() as u64
    }

    /// A resident block's weights as a buffer already loaded.
    fn resident(data: Tensor) -> Result<DeviceBuf> {
        let (ready, free) = (Event::new(false)?, Event::new(false)?);
        ready.record(torch_stream())?;
        free.record(torch_stream())?;
        Ok(DeviceBuf { data, ready, free })
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // The memory goes back to torch's allocator, which reuses it in torch's stream
        // order: make that order include the last copy into it, even if it was never read.
        let _ = cuda::wait(torch_stream(), &self.ready);
    }
}

/// Gradients of one part of a block on their way to the slab.
struct InFlight {
    done: Delivered,
    start: Event,
    end: Event,
    /// Gradient tensors kept alive until their copy completes (torch would otherwise
    /// recycle the memory while the copy stream still reads it).
    _keep: Vec<Tensor>,
}

/// CUDA: pinned regions, transient embed/head buffers, a ring of layer buffers.
pub struct CudaStreamer {
    kind: Kind,
    device: Device,
    copy: Stream,
    offload: Stream,
    embed: Option<DeviceBuf>,
    head: Option<DeviceBuf>,
    ring: Vec<DeviceBuf>,
    /// Layer indices in the order the micro-batch asks for them.
    schedule: Vec<usize>,
    next: usize,
    issued: usize,
    in_flight: VecDeque<InFlight>,
    landed: Vec<Delivered>,
    stash: Stash,
    waits: WaitTimer,
    stats: TransferStats,
    /// The resident blocks' compute weights, by block index: handed out, never copied.
    resident: Vec<Tensor>,
    /// MT_MEMORY_TRACE set: print each new high-water mark of device memory with where
    /// in the micro-batch it was seen (for checking the memory plan).
    trace_memory: bool,
    // Declared last: unregistered after every copy using it was dropped, then unmapped.
    _pinned: [HostRegistration; 2],
    regions: Regions,
}

impl CudaStreamer {
    pub fn new(
        regions: Regions,
        layout: &Layout,
        index: usize,
        offload_activations: bool,
    ) -> Result<CudaStreamer> {
        let device = Device::Cuda(index);
        let kind = kind_of(regions.dtype);
        // Touch the device through torch so its primary context is current here, and run
        // one matmul so cuBLAS has its handle and workspace: what is in use then is the
        // per-process overhead the memory plan does not count.
        let _ = Tensor::f_ones([8, 8], (kind, device))?
            .f_matmul(&Tensor::f_ones([8, 8], (kind, device))?)?;
        cuda::check_context()?;
        let (free, total) = cuda::memory_info()?;
        let context_device_bytes = total - free;
        // What the memory plan may use: an out-of-memory report compares with it.
        crate::fault::set_budget(free);
        // SAFETY: both regions stay mapped for the streamer's life (it owns them, and the
        // registrations are dropped first).
        let pinned = unsafe {
            [
                HostRegistration::new(
                    regions.store.payload_ptr(),
                    regions.store.payload_len(),
                    regions.store.name(),
                )?,
                HostRegistration::new(
                    regions.slab.payload_ptr(),
                    regions.slab.payload_len(),
                    regions.slab.name(),
                )?,
            ]
        };
        // One ring for every layer group: a slot holds whichever layer the schedule puts
        // there next, and mixed stacks (Qwen3-Next's linear and full attention) alternate
        // kinds, so per-group rings would only add buffers.
        let ring = (0..RING)
            .map(|_| DeviceBuf::new(layout.max_layer_len(), kind, device, "the layer ring"))
            .collect::<Result<_>>()?;
        let stash = match offload_activations {
            false => Stash::Device(Vec::new()),
            true => Stash::Host(HostStash::new(device)),
        };
        Ok(CudaStreamer {
            kind,
            device,
            copy: Stream::non_blocking()?,
            offload: Stream::non_blocking()?,
            embed: None,
            head: None,
            ring,
            schedule: Vec::new(),
            next: 0,
            issued: 0,
            in_flight: VecDeque::new(),
            landed: Vec::new(),
            stash,
            waits: WaitTimer::default(),
            stats: TransferStats {
                context_device_bytes,
                ..TransferStats::default()
            },
            resident: Vec::new(),
            trace_memory: mt::switches::get().memory_trace,
            _pinned: pinned,
            regions,
        })
    }

    pub fn set_resident(&mut self, weights: Vec<Tensor>) {
        self.resident = weights;
    }

    /// Enqueues the copy of `block` into `buf` on the copy stream, after `buf`'s readers.
    fn fill(copy: &Stream, regions: &Regions, buf: &DeviceBuf, block: &Block) -> Result<()> {
        cuda::wait(copy.raw(), &buf.free)?;
        let elem = regions.dtype.size();
        // SAFETY: the source lies inside the pinned store, which the launcher leaves alone
        // during a step; the destination buffer holds at least `block.len` elements and is
        // not read until `ready` fires.
        unsafe {
            let src = regions.store.payload_ptr().add(block.offset * elem);
            cuda::copy_h2d(buf.ptr(), src, block.len * elem, copy.raw())?;
        }
        buf.ready.record(copy.raw())
    }

    /// Allocates a transient buffer for block `index` and enqueues its copy.
    fn load(&self, layout: &Layout, index: usize, gate: Gate) -> Result<DeviceBuf> {
        if let Some(w) = self.resident.get(index) {
            return DeviceBuf::resident(w.shallow_clone());
        }
        gate(index)?;
        let block = &layout.blocks[index];
        crate::fault::within(Phase::HostToDevice, None, || {
            let what = match index {
                Layout::EMBED => "the embedding",
                _ => "the head",
            };
            let buf = DeviceBuf::new(block.len, self.kind, self.device, what)?;
            Self::fill(&self.copy, &self.regions, &buf, block)?;
            Ok(buf)
        })
    }

    pub fn begin_micro(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        let n = layout.num_layers();
        self.begin((0..n).chain((0..n).rev()).collect(), layout, gate)
    }

    /// A forward-only micro-batch: layers 0..L-1 once.
    pub fn begin_forward(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        self.begin((0..layout.num_layers()).collect(), layout, gate)
    }

    /// Starts a micro-batch that asks for layers in `schedule` order: the embedding's copy
    /// and the ring's first layers are enqueued.
    fn begin(&mut self, schedule: Vec<usize>, layout: &Layout, gate: Gate) -> Result<()> {
        self.schedule = schedule;
        self.next = 0;
        self.issued = 0;
        self.prefetch(layout, Layout::EMBED, gate)?;
        self.issue_up_to(layout, RING - 1, gate)
    }

    /// Enqueues copies for schedule entries up to `last` (each waits for its buffer).
    fn issue_up_to(&mut self, layout: &Layout, last: usize, gate: Gate) -> Result<()> {
        while self.issued < self.schedule.len() && self.issued <= last {
            let k = self.issued;
            let index = layout.layer_block(self.schedule[k]);
            if index < self.resident.len() {
                self.issued += 1;
                continue;
            }
            gate(index)?;
            Self::fill(
                &self.copy,
                &self.regions,
                &self.ring[k % RING],
                &layout.blocks[index],
            )?;
            self.issued += 1;
        }
        Ok(())
    }

    /// Makes torch's stream wait for a copy, timing the stall.
    fn wait_for(&mut self, ready: &Event) -> Result<()> {
        self.waits.wait(ready)?;
        self.sample_memory(|| "a stashed layer input arrived".into());
        Ok(())
    }

    /// Records the device memory in use; `at` says where (for the trace).
    fn sample_memory(&mut self, at: impl FnOnce() -> String) {
        if let Ok(used) = cuda::device_bytes_used() {
            if used > self.stats.peak_device_bytes && self.trace_memory {
                eprintln!(
                    "memory: {:.3} GB in use (+{:.3}) at {}",
                    used as f64 / 1e9,
                    (used
                        - self
                            .stats
                            .peak_device_bytes
                            .max(self.stats.context_device_bytes)) as f64
                        / 1e9,
                    at()
                );
            }
            self.stats.peak_device_bytes = self.stats.peak_device_bytes.max(used);
        }
    }

    /// Enqueues the copy of the embedding (`Layout::EMBED`) or the head block into its
    /// transient buffer, unless that buffer is already loaded.
    fn prefetch(&mut self, layout: &Layout, index: usize, gate: Gate) -> Result<()> {
        let loaded = match index {
            Layout::EMBED => self.embed.is_some(),
            _ => self.head.is_some(),
        };
        if !loaded {
            let buf = Some(self.load(layout, index, gate)?);
            match index {
                Layout::EMBED => self.embed = buf,
                _ => self.head = buf,
            }
        }
        Ok(())
    }

    /// The embedding or head block on the device, once its copy has landed.
    fn transient(&mut self, layout: &Layout, index: usize, gate: Gate) -> Result<Tensor> {
        self.prefetch(layout, index, gate)?;
        let buf = match index {
            Layout::EMBED => self.embed.as_ref(),
            _ => self.head.as_ref(),
        }
        .expect("prefetched above");
        self.waits.wait(&buf.ready)?;
        let data = buf.data.shallow_clone();
        self.sample_memory(|| match index {
            Layout::EMBED => "before the embedding's compute".into(),
            _ => "before the head's compute".into(),
        });
        Ok(data)
    }

    pub fn embed(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        self.transient(layout, Layout::EMBED, gate)
    }

    pub fn head(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        self.transient(layout, layout.head_block(), gate)
    }

    /// The embedding buffer goes back to torch's allocator (the engine dropped its views).
    pub fn release_embed(&mut self) {
        self.embed = None;
    }

    pub fn release_head(&mut self) {
        self.head = None;
    }

    pub fn layer(&mut self, layout: &Layout, l: usize, gate: Gate) -> Result<Tensor> {
        let k = self.next;
        if self.schedule.get(k) != Some(&l) {
            bail!(
                "layer {l} requested out of order (expected {:?})",
                self.schedule.get(k)
            );
        }
        if k > 0 {
            // Everything that reads the previous layer's buffer is enqueued by now.
            self.ring[(k - 1) % RING].free.record(torch_stream())?;
        }
        self.issue_up_to(layout, k + RING - 1, gate)?;
        let n = layout.num_layers();
        if k + 1 == n {
            // The last forward layer: the head comes next.
            self.prefetch(layout, layout.head_block(), gate)?;
        }
        if k + 1 == 2 * n {
            // The last backward layer: the embedding comes next.
            self.prefetch(layout, Layout::EMBED, gate)?;
        }
        self.next += 1;
        if let Some(w) = self.resident.get(layout.layer_block(l)) {
            return Ok(w.shallow_clone());
        }
        let len = layout.blocks[layout.layer_block(l)].len as i64;
        self.waits.wait(&self.ring[k % RING].ready)?;
        self.sample_memory(|| match k < n {
            true => format!("before forward layer {l}"),
            false => format!("before backward layer {l}"),
        });
        Ok(self.ring[k % RING].data.narrow(0, 0, len))
    }

    pub fn end_micro(&mut self) -> Result<()> {
        if self.next > 0 {
            self.ring[(self.next - 1) % RING]
                .free
                .record(torch_stream())?;
        }
        self.embed = None;
        self.head = None;
        Ok(())
    }

    /// Enqueues the copy of the gradients inside `part` (an element range of `block`)
    /// into slot `to.slot`, after the compute that produced them.
    pub fn offload(
        &mut self,
        to: Delivered,
        part: Range<usize>,
        block: &Block,
        w: &BlockWeights,
    ) -> Result<()> {
        // The parts of one block share its gradient tensors: only other blocks count.
        while self.other_blocks_in_flight(&to) >= MAX_D2H_IN_FLIGHT {
            self.land_oldest()?;
        }
        let (start, end) = (Event::new(true)?, Event::new(true)?);
        let produced = Event::new(false)?;
        produced.record(torch_stream())?;
        cuda::wait(self.offload.raw(), &produced)?;
        start.record(self.offload.raw())?;
        let elem = self.regions.dtype.size();
        let mut keep = Vec::with_capacity(block.tensors.len());
        for (t, within) in block.part_tensors(part.clone()) {
            let bytes = within.len() * elem;
            let dst =
                self.regions
                    .slot_ptr(to.slot, t.offset + within.start - part.start, within.len());
            let Some(g) = w.grad(&t.name) else {
                // SAFETY: the slot is owned by this worker until announced; `slot_ptr`
                // checked that the range lies inside it.
                unsafe { std::ptr::write_bytes(dst, 0, bytes) };
                continue;
            };
            if g.kind() != self.kind || g.numel() != t.numel() {
                bail!(
                    "gradient of `{}` is {:?} x {}, the slab holds {:?} x {}",
                    t.name,
                    g.kind(),
                    g.numel(),
                    self.kind,
                    t.numel()
                );
            }
            let g = g.f_contiguous()?;
            let src = g.data_ptr() as u64 + (within.start * elem) as u64;
            // SAFETY: the slot range is owned by this worker, pinned and inside the slot
            // (`slot_ptr`); the source lies inside `g` (`within` is a range of its
            // `t.numel()` elements), which stays alive in `keep` until the copy's event
            // completes.
            unsafe { cuda::copy_d2h(dst, src, bytes, self.offload.raw())? };
            keep.push(g);
        }
        end.record(self.offload.raw())?;
        self.in_flight.push_back(InFlight {
            done: to,
            start,
            end,
            _keep: keep,
        });
        Ok(())
    }

    /// Blocks other than `to`'s whose gradient copies are in flight.
    fn other_blocks_in_flight(&self, to: &Delivered) -> usize {
        let mut blocks: Vec<(usize, usize)> = self
            .in_flight
            .iter()
            .map(|f| (f.done.micro, f.done.block))
            .filter(|&b| b != (to.micro, to.block))
            .collect();
        // A block's parts are queued one after another.
        blocks.dedup();
        blocks.len()
    }

    /// Waits for the oldest gradient copy and moves it to `landed`; false if none is out.
    pub fn land_oldest(&mut self) -> Result<bool> {
        let Some(f) = self.in_flight.pop_front() else {
            return Ok(false);
        };
        f.end.synchronize()?;
        self.stats.d2h_s += Event::elapsed_ms(&f.start, &f.end)? as f64 / 1e3;
        self.landed.push(f.done);
        Ok(true)
    }

    pub fn delivered(&mut self, wait: bool) -> Result<Vec<Delivered>> {
        while let Some(f) = self.in_flight.front() {
            if !wait && !f.end.done()? {
                break;
            }
            self.land_oldest()?;
        }
        Ok(std::mem::take(&mut self.landed))
    }

    /// Keeps layer `l`'s input (its forward is enqueued) for the backward.
    pub fn stash_input(&mut self, l: usize, x: Tensor) -> Result<()> {
        match &mut self.stash {
            Stash::Device(v) => {
                debug_assert_eq!(v.len(), l);
                v.push(x);
                Ok(())
            }
            Stash::Host(h) => {
                crate::fault::within(Phase::DeviceToHost, Some(l), || h.push(l, x, &self.offload))
            }
        }
    }

    /// Layer `l`'s input, for its backward (layers come last to first).
    pub fn stashed_input(&mut self, l: usize) -> Result<Tensor> {
        match &mut self.stash {
            Stash::Device(v) => {
                if v.len() != l + 1 {
                    bail!("input of layer {l} asked for with {} stashed", v.len());
                }
                Ok(v.pop().expect("checked"))
            }
            Stash::Host(h) => {
                let (ready, x) =
                    crate::fault::within(Phase::HostToDevice, Some(l), || h.pop(l, &self.copy))?;
                self.wait_for(&ready)?;
                Ok(x)
            }
        }
    }

    pub fn take_stats(&mut self) -> Result<TransferStats> {
        self.sample_memory(|| "the end of the step".into());
        self.stats.h2d_wait_s += self.waits.take_seconds()?;
        let context_device_bytes = self.stats.context_device_bytes;
        Ok(std::mem::replace(
            &mut self.stats,
            TransferStats {
                context_device_bytes,
                ..TransferStats::default()
            },
        ))
    }
}

/// Times torch's waits on copies with event pairs, read back once per step.
#[derive(Default)]
struct WaitTimer {
    /// (before, after) around each wait; reused across steps.
    events: Vec<(Event, Event)>,
    used: usize,
}

impl WaitTimer {
    /// Makes torch's stream wait for `ready`, between two timing events.
    fn wait(&mut self, ready: &Event) -> Result<()> {
        if self.used == self.events.len() {
            self.events.push((Event::new(true)?, Event::new(true)?));
        }
        let (before, after) = &self.events[self.used];
        before.record(torch_stream())?;
        cuda::wait(torch_stream(), ready)?;
        after.record(torch_stream())?;
        self.used += 1;
        Ok(())
    }

    /// Seconds torch's stream stalled since the last call.
    fn take_seconds(&mut self) -> Result<f64> {
        let mut s = 0.0;
        for (before, after) in &self.events[..self.used] {
            after.synchronize()?;
            s += Event::elapsed_ms(before, after)? as f64 / 1e3;
        }
        self.used = 0;
        Ok(s)
    }
}
