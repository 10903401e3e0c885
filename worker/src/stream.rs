//! Moving blocks between the shared host regions and the compute device.
//!
//! The engine asks for blocks in a fixed order and hands back gradients as they appear;
//! this module decides how bytes move:
//!
//! - **CPU**: blocks are zero-copy views of the shared store; gradients are copied into the
//!   slab slot at once.
//! - **CUDA** ([`gpu`]): the store and this worker's slab are host-registered once (pinned,
//!   DMA). Layers stream through a ring of device buffers: when the engine takes layer k,
//!   the copy of layer k+1 is enqueued on a non-blocking copy stream, after an event that
//!   marks the end of the compute that last read its buffer; torch's stream waits on the
//!   copy's event before computing. The embedding and head are loaded the same way, only
//!   around the compute that reads them. Gradients leave on a second non-blocking stream
//!   into the slab slot, and the launcher is told only once that copy has completed.
//!
//! Each layer crosses host-to-device twice per micro-batch (forward, then recompute).
//! The per-layer inputs the backward needs are stashed here too: kept where they are
//! computed, or (CUDA, `memory.offload_activations`) in pinned host memory. A
//! multimodal model's frozen vision tower is copied to the device once ([`vision`]).

mod gpu;
mod resident;
mod stash;
pub mod vision;

pub use resident::{Resident, check_update as check_resident_update};

use std::collections::VecDeque;
use std::ops::Range;

use anyhow::{Result, bail};
use mt::config::DType;
use mt::layout::{Block, Layout};
use mt::protocol::{Device as MtDevice, Init};
use mt::shm::Region;
use tch::{Device, Kind, Tensor};

use crate::model::BlockWeights;
use gpu::CudaStreamer;

pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::Float32 => Kind::Float,
        DType::Bfloat16 => Kind::BFloat16,
    }
}

pub fn device_of(d: MtDevice) -> Device {
    match d {
        MtDevice::Cpu => Device::Cpu,
        MtDevice::Cuda(i) => Device::Cuda(i),
    }
}

/// Checks that the device exists.
pub fn check_device(d: MtDevice) -> Result<()> {
    if let MtDevice::Cuda(i) = d {
        let n = tch::Cuda::device_count();
        if i as i64 >= n {
            bail!("cuda:{i} requested but only {n} CUDA device(s) are visible");
        }
    }
    Ok(())
}

/// A flat host view of `len` elements of `region` starting at element `offset`.
///
/// # Safety
/// The elements must stay mapped for the tensor's life, and the protocol must give this
/// process the access it uses the tensor for (see `mt::protocol`).
unsafe fn region_view(region: &Region, offset: usize, len: usize, kind: Kind) -> Tensor {
    let elem = kind.elt_size_in_bytes();
    assert!(
        (offset + len) * elem <= region.payload_len(),
        "view past the end of `{}`",
        region.name()
    );
    // SAFETY: bounds checked above; lifetime and access rules are the caller's.
    unsafe {
        let ptr = region.payload_ptr().add(offset * elem);
        Tensor::from_blob(ptr, &[len as i64], &[], kind, Device::Cpu)
    }
}

/// Called with a block index before that block of the store is read; returns once the
/// launcher has written this step's weights there (see `mt::protocol`).
pub type Gate<'a> = &'a mut dyn FnMut(usize) -> Result<()>;

/// Gradients of one part of a block (`Layout::grad_parts`) in a slab slot: once they
/// have landed, announce them to the launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub micro: usize,
    pub block: usize,
    pub part: usize,
    pub slot: usize,
}

/// Per-step transfer statistics.
#[derive(Debug, Default, Clone, Copy)]
pub struct TransferStats {
    /// Seconds torch's stream stalled waiting for a layer copy.
    pub h2d_wait_s: f64,
    /// Seconds of device-to-host gradient copies.
    pub d2h_s: f64,
    pub peak_device_bytes: u64,
    /// Device bytes in use before the streamer allocated anything: the CUDA context, the
    /// cuBLAS handle and workspace, torch's first segment (what the memory plan leaves out).
    pub context_device_bytes: u64,
}

/// The shared regions this worker uses, with their geometry.
pub struct Regions {
    pub store: Region,
    pub slab: Region,
    pub dtype: DType,
    pub slot_len: usize,
    pub slots: usize,
}

impl Regions {
    /// Adopts the store and this worker's slab from the fds named in `Init`. Called once,
    /// at start-up: the launcher cleared close-on-exec on exactly these fds for this
    /// process, and nothing else in the worker uses them.
    pub fn inherit(init: &Init) -> Result<Regions> {
        // SAFETY: see above; each fd is taken over once, by its region.
        let store = unsafe { Region::from_inherited_fd(&init.store) }?;
        // SAFETY: as for the store.
        let slab = unsafe { Region::from_inherited_fd(&init.slab) }?;
        Ok(Regions {
            store,
            slab,
            dtype: init.dtype,
            slot_len: init.layout.grad_slot_len(),
            slots: init.num_slots,
        })
    }

    pub fn check(&self, layout: &Layout) -> Result<()> {
        let elem = self.dtype.size();
        if self.store.payload_len() < layout.total * elem {
            bail!(
                "store region holds {} bytes, the layout needs {}",
                self.store.payload_len(),
                layout.total * elem
            );
        }
        if self.slot_len < layout.grad_slot_len()
            || self.slab.payload_len() < self.slot_len * self.slots * elem
        {
            bail!(
                "slab region of {} bytes cannot hold {} slots of {}",
                self.slab.payload_len(),
                self.slots,
                self.slot_len
            );
        }
        Ok(())
    }

    /// Pointer to element `elem_off` of slot `slot`, where `len` elements are written.
    fn slot_ptr(&self, slot: usize, elem_off: usize, len: usize) -> *mut u8 {
        assert!(slot < self.slots && elem_off + len <= self.slot_len);
        // SAFETY: inside the slab payload (checked against the region size in `check`).
        unsafe {
            self.slab
                .payload_ptr()
                .add((slot * self.slot_len + elem_off) * self.dtype.size())
        }
    }
}

pub enum Streamer {
    Cpu(Box<CpuStreamer>),
    Cuda(Box<CudaStreamer>),
}

impl Streamer {
    pub fn new(
        regions: Regions,
        layout: &Layout,
        device: Device,
        offload_activations: bool,
    ) -> Result<Streamer> {
        regions.check(layout)?;
        Ok(match device {
            Device::Cuda(i) => Streamer::Cuda(Box::new(CudaStreamer::new(
                regions,
                layout,
                i,
                offload_activations,
            )?)),
            _ => Streamer::Cpu(Box::new(CpuStreamer {
                kind: kind_of(regions.dtype),
                regions,
                delivered: VecDeque::new(),
                inputs: Vec::new(),
                rss_base: rss::reset_peak(),
                resident: Vec::new(),
            })),
        })
    }

    /// Blocks `..weights.len()` are resident ([`Resident`]): these are their compute
    /// weights, handed out instead of copies of the store's.
    pub fn set_resident(&mut self, weights: Vec<Tensor>) {
        match self {
            Streamer::Cpu(c) => c.resident = weights,
            Streamer::Cuda(c) => c.set_resident(weights),
        }
    }

    /// Starts a micro-batch: the embedding, then layers 0..L-1, the head, layers L-1..0
    /// and the embedding again will be asked for.
    pub fn begin_micro(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        match self {
            Streamer::Cpu(_) => Ok(()),
            Streamer::Cuda(c) => c.begin_micro(layout, gate),
        }
    }

    /// Starts a forward-only micro-batch (evaluation): the embedding, layers 0..L-1 and
    /// the head will be asked for.
    pub fn begin_forward(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        match self {
            Streamer::Cpu(_) => Ok(()),
            Streamer::Cuda(c) => c.begin_forward(layout, gate),
        }
    }

    /// The embedding block (index `Layout::EMBED`), flat, on the device.
    pub fn embed(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => c.view(layout, Layout::EMBED, gate),
            Streamer::Cuda(c) => c.embed(layout, gate),
        }
    }

    /// Lets the embedding's device memory go until the backward needs it again; the
    /// caller has dropped every view of it.
    pub fn release_embed(&mut self) {
        if let Streamer::Cuda(c) = self {
            c.release_embed()
        }
    }

    /// The head block, flat, on the device.
    pub fn head(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => c.view(layout, layout.head_block(), gate),
            Streamer::Cuda(c) => c.head(layout, gate),
        }
    }

    /// Lets the head's device memory go; the caller has dropped every view of it.
    pub fn release_head(&mut self) {
        if let Streamer::Cuda(c) = self {
            c.release_head()
        }
    }

    /// Layer `l`, flat, on the device; must follow the micro-batch's order.
    pub fn layer(&mut self, layout: &Layout, l: usize, gate: Gate) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => c.view(layout, layout.layer_block(l), gate),
            Streamer::Cuda(c) => c.layer(layout, l, gate),
        }
    }

    pub fn end_micro(&mut self) -> Result<()> {
        match self {
            Streamer::Cpu(c) => {
                c.inputs.clear();
                Ok(())
            }
            Streamer::Cuda(c) => c.end_micro(),
        }
    }

    /// Keeps layer `l`'s input for its backward (layers come first to last).
    pub fn stash_input(&mut self, l: usize, x: Tensor) -> Result<()> {
        match self {
            Streamer::Cpu(c) => {
                debug_assert_eq!(c.inputs.len(), l);
                c.inputs.push(x);
                Ok(())
            }
            Streamer::Cuda(c) => c.stash_input(l, x),
        }
    }

    /// Layer `l`'s stashed input (layers come last to first).
    pub fn stashed_input(&mut self, l: usize) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => match c.inputs.pop() {
                Some(x) if c.inputs.len() == l => Ok(x),
                _ => bail!("input of layer {l} asked for out of order"),
            },
            Streamer::Cuda(c) => c.stashed_input(l),
        }
    }

    /// Sends the gradients (the leaves of `w`) inside `part`, the element range of
    /// `block` that part `to.part` covers, to slab slot `to.slot`.
    pub fn offload(
        &mut self,
        to: Delivered,
        part: Range<usize>,
        block: &Block,
        w: &BlockWeights,
    ) -> Result<()> {
        match self {
            Streamer::Cpu(c) => c.offload(to, part, block, w),
            Streamer::Cuda(c) => c.offload(to, part, block, w),
        }
    }

    /// Offloads that have completed, oldest first; with `wait`, waits for all of them.
    pub fn delivered(&mut self, wait: bool) -> Result<Vec<Delivered>> {
        match self {
            Streamer::Cpu(c) => Ok(c.delivered.drain(..).collect()),
            Streamer::Cuda(c) => c.delivered(wait),
        }
    }

    /// Waits for the oldest offload still in flight; false if none is.
    pub fn wait_oldest(&mut self) -> Result<bool> {
        match self {
            Streamer::Cpu(_) => Ok(false),
            Streamer::Cuda(c) => c.land_oldest(),
        }
    }

    /// Statistics of the step so far; resets them.
    pub fn take_stats(&mut self) -> Result<TransferStats> {
        match self {
            Streamer::Cpu(c) => Ok(c.take_stats()),
            Streamer::Cuda(c) => c.take_stats(),
        }
    }
}

/// CPU: zero-copy views of the store; gradients copied into the slab immediately.
pub struct CpuStreamer {
    regions: Regions,
    kind: Kind,
    delivered: VecDeque<Delivered>,
    inputs: Vec<Tensor>,
    /// Resident bytes when the step began (the peak was reset then); None where /proc
    /// does not allow it.
    rss_base: Option<u64>,
    /// The resident blocks' compute weights, by block index.
    resident: Vec<Tensor>,
}

impl CpuStreamer {
    /// The step's peak resident memory above its start (what the memory plan estimates
    /// for a CPU worker: torch's tensors, the store being shared and already resident),
    /// then a fresh peak for the next step.
    fn take_stats(&mut self) -> TransferStats {
        let peak = match (self.rss_base, rss::peak()) {
            (Some(base), Some(hwm)) => hwm.saturating_sub(base),
            _ => 0,
        };
        self.rss_base = rss::reset_peak();
        TransferStats {
            peak_device_bytes: peak,
            ..TransferStats::default()
        }
    }

    fn view(&self, layout: &Layout, index: usize, gate: Gate) -> Result<Tensor> {
        if let Some(w) = self.resident.get(index) {
            return Ok(w.shallow_clone());
        }
        gate(index)?;
        let block = &layout.blocks[index];
        // SAFETY: the store stays mapped while `self` lives, and the gate returned, so the
        // launcher is done writing this block for the step (protocol); the view is only read.
        Ok(unsafe { region_view(&self.regions.store, block.offset, block.len, self.kind) })
    }

    fn offload(
        &mut self,
        to: Delivered,
        part: Range<usize>,
        block: &Block,
        w: &BlockWeights,
    ) -> Result<()> {
        let r = &self.regions;
        assert!(to.slot < r.slots && part.len() <= r.slot_len);
        // SAFETY: the slab stays mapped while `self` lives; this worker owns `to.slot`
        // (taken from its free list and not yet announced), so nobody else touches it.
        let out = unsafe { region_view(&r.slab, to.slot * r.slot_len, part.len(), self.kind) };
        w.write_grads(block, part, &out);
        self.delivered.push_back(to);
        Ok(())
    }
}

/// The process's resident memory from /proc (Linux).
mod rss {
    /// A `Vm*` line of /proc/self/status, in bytes.
    fn status(key: &str) -> Option<u64> {
        let text = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }

    /// Peak resident bytes since the last reset (VmHWM).
    pub fn peak() -> Option<u64> {
        status("VmHWM:")
    }

    /// Resets the peak to the current resident size (writing 5 to clear_refs) and returns
    /// that size.
    pub fn reset_peak() -> Option<u64> {
        std::fs::write("/proc/self/clear_refs", "5").ok()?;
        status("VmRSS:")
    }
}
