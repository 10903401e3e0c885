//! Moving blocks between the shared host regions and the compute device.
//!
//! The engine asks for blocks in a fixed order and hands back gradients as they appear;
//! this module decides how bytes move:
//!
//! - **CPU**: blocks are zero-copy views of the shared store; gradients are copied into the
//!   slab slot at once.
//! - **CUDA**: the store and this worker's slab are host-registered once (pinned, DMA). The
//!   embedding and head blocks get resident device buffers, filled once per step. Layers
//!   stream through a ring of R device buffers: when the engine takes layer k, the copy
//!   of layer k+R-1 is enqueued on a non-blocking copy stream, after an event that marks
//!   the end of the compute that last read its buffer; torch's stream waits on the
//!   copy's event before computing. Gradients leave on a second non-blocking stream into
//!   the slab slot, and the launcher is told only once that copy has completed.
//!
//! Each layer crosses host-to-device twice per micro-batch (forward, then recompute).

pub mod cuda;

use std::collections::VecDeque;
use std::ffi::CString;

use anyhow::{Result, bail};
use mt::config::DType;
use mt::layout::{Block, Layout};
use mt::protocol::Device as MtDevice;
use mt::shm::Region;
use tch::{Device, Kind, Tensor};

use crate::model::BlockWeights;
use cuda::{Event, HostRegistration, Stream, torch_stream};

/// Layer buffers in the ring (double buffering).
const RING: usize = 2;

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

/// tch links only libtorch_cpu; CUDA kernels live in libtorch_cuda.so, which must be
/// loaded (globally, so its kernels register) before the first CUDA call.
pub fn load_torch_cuda() -> Result<()> {
    let name = CString::new("libtorch_cuda.so").expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle is intentionally leaked so the
    // library stays loaded for the life of the process.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".into()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        bail!("cannot load libtorch_cuda.so ({msg}); set LD_LIBRARY_PATH to torch's lib folder");
    }
    if !tch::Cuda::is_available() {
        bail!(
            "libtorch_cuda.so loaded but CUDA is not available (driver missing or no GPU visible)"
        );
    }
    Ok(())
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

/// Gradients of one block that reached the slab: announce them to the launcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivered {
    pub micro: usize,
    pub block: usize,
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
    pub fn check(&self, layout: &Layout) -> Result<()> {
        let elem = self.dtype.size();
        if self.store.payload_len() < layout.total * elem {
            bail!(
                "store region holds {} bytes, the layout needs {}",
                self.store.payload_len(),
                layout.total * elem
            );
        }
        if self.slot_len < layout.max_block_len()
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

    /// Pointer to element `elem_off` of slot `slot`.
    fn slot_ptr(&self, slot: usize, elem_off: usize) -> *mut u8 {
        assert!(slot < self.slots && elem_off <= self.slot_len);
        // SAFETY: inside the slab payload (checked against the region size in `check`).
        unsafe {
            self.slab
                .payload_ptr()
                .add((slot * self.slot_len + elem_off) * self.dtype.size())
        }
    }
}

pub enum Streamer {
    Cpu(CpuStreamer),
    Cuda(Box<CudaStreamer>),
}

impl Streamer {
    pub fn new(regions: Regions, layout: &Layout, device: Device) -> Result<Streamer> {
        regions.check(layout)?;
        Ok(match device {
            Device::Cuda(i) => Streamer::Cuda(Box::new(CudaStreamer::new(regions, layout, i)?)),
            _ => Streamer::Cpu(CpuStreamer {
                kind: kind_of(regions.dtype),
                regions,
                delivered: VecDeque::new(),
            }),
        })
    }

    /// Starts a step: the embedding's resident buffer is filled from the store.
    pub fn begin_step(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        match self {
            Streamer::Cpu(_) => Ok(()),
            Streamer::Cuda(c) => c.begin_step(layout, gate),
        }
    }

    /// Starts a micro-batch: layers will be asked for 0..L-1, then L-1..0.
    pub fn begin_micro(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        match self {
            Streamer::Cpu(_) => Ok(()),
            Streamer::Cuda(c) => c.begin_micro(layout, gate),
        }
    }

    /// The embedding block (index `Layout::EMBED`), flat, on the device.
    pub fn embed(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => c.view(layout, Layout::EMBED, gate),
            Streamer::Cuda(c) => c.resident(0),
        }
    }

    /// The head block, flat, on the device.
    pub fn head(&mut self, layout: &Layout, gate: Gate) -> Result<Tensor> {
        match self {
            Streamer::Cpu(c) => c.view(layout, layout.head_block(), gate),
            Streamer::Cuda(c) => {
                c.fill_head(layout, gate)?;
                c.resident(1)
            }
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
            Streamer::Cpu(_) => Ok(()),
            Streamer::Cuda(c) => c.end_micro(),
        }
    }

    /// Sends block `index`'s gradients (the leaves of `w`) to slab slot `slot`.
    pub fn offload(
        &mut self,
        micro: usize,
        index: usize,
        block: &Block,
        w: &BlockWeights,
        slot: usize,
    ) -> Result<()> {
        match self {
            Streamer::Cpu(c) => c.offload(micro, index, block, w, slot),
            Streamer::Cuda(c) => c.offload(micro, index, block, w, slot),
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
            Streamer::Cuda(c) => c.wait_oldest(),
        }
    }

    /// Statistics of the step so far; resets them.
    pub fn take_stats(&mut self) -> Result<TransferStats> {
        match self {
            Streamer::Cpu(_) => Ok(TransferStats::default()),
            Streamer::Cuda(c) => c.take_stats(),
        }
    }
}

/// CPU: zero-copy views of the store; gradients copied into the slab immediately.
pub struct CpuStreamer {
    regions: Regions,
    kind: Kind,
    delivered: VecDeque<Delivered>,
}

impl CpuStreamer {
    fn view(&self, layout: &Layout, index: usize, gate: Gate) -> Result<Tensor> {
        gate(index)?;
        let block = &layout.blocks[index];
        // SAFETY: the store stays mapped while `self` lives, and the gate returned, so the
        // launcher is done writing this block for the step (protocol); the view is only read.
        Ok(unsafe { region_view(&self.regions.store, block.offset, block.len, self.kind) })
    }

    fn offload(
        &mut self,
        micro: usize,
        index: usize,
        block: &Block,
        w: &BlockWeights,
        slot: usize,
    ) -> Result<()> {
        let r = &self.regions;
        // SAFETY: the slab stays mapped while `self` lives; this worker owns `slot` (taken
        // from its free list and not yet announced), so nobody else touches it.
        let out = unsafe { region_view(&r.slab, slot * r.slot_len, block.len, self.kind) };
        w.write_grads(block, &out);
        self.delivered.push_back(Delivered {
            micro,
            block: index,
            slot,
        });
        Ok(())
    }
}

/// A device buffer with the events that order its reuse.
struct DeviceBuf {
    data: Tensor,
    /// The last copy into it completed.
    ready: Event,
    /// The last compute reading it completed.
    free: Event,
}

impl DeviceBuf {
    fn new(len: usize, kind: Kind, device: Device) -> Result<DeviceBuf> {
        let data = Tensor::zeros([len as i64], (kind, device));
        let (ready, free) = (Event::new(false)?, Event::new(false)?);
        ready.record(torch_stream())?;
        free.record(torch_stream())?;
        Ok(DeviceBuf { data, ready, free })
    }

    fn ptr(&self) -> u64 {
        self.data.data_ptr() as u64
    }
}

struct InFlight {
    done: Delivered,
    start: Event,
    end: Event,
    /// Gradient tensors kept alive until their copy completes (torch would otherwise
    /// recycle the memory while the copy stream still reads it).
    _keep: Vec<Tensor>,
}

/// CUDA: pinned regions, resident embed/head buffers, a ring of layer buffers.
pub struct CudaStreamer {
    regions: Regions,
    kind: Kind,
    copy: Stream,
    offload: Stream,
    /// [embed, head]
    residents: [DeviceBuf; 2],
    /// Whether the head's copy for this step was enqueued.
    head_filled: bool,
    ring: Vec<DeviceBuf>,
    /// Layer indices in the order the micro-batch asks for them.
    schedule: Vec<usize>,
    next: usize,
    issued: usize,
    in_flight: VecDeque<InFlight>,
    /// (before, after) timing events around each wait on a layer copy.
    waits: Vec<(Event, Event)>,
    waits_used: usize,
    stats: TransferStats,
    // Declared last: unregistered after every copy using it was dropped.
    _pinned: [HostRegistration; 2],
}

impl CudaStreamer {
    fn new(regions: Regions, layout: &Layout, index: usize) -> Result<CudaStreamer> {
        let device = Device::Cuda(index);
        let kind = kind_of(regions.dtype);
        // Touch the device through torch so its primary context is current here.
        let _ = Tensor::zeros([1], (kind, device));
        cuda::check_context()?;
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
        let blocks = &layout.blocks;
        let layer_len = (0..layout.num_layers())
            .map(|l| blocks[layout.layer_block(l)].len)
            .max()
            .unwrap_or(0);
        let residents = [
            DeviceBuf::new(blocks[Layout::EMBED].len, kind, device)?,
            DeviceBuf::new(blocks[layout.head_block()].len, kind, device)?,
        ];
        let ring = (0..RING)
            .map(|_| DeviceBuf::new(layer_len, kind, device))
            .collect::<Result<_>>()?;
        Ok(CudaStreamer {
            regions,
            kind,
            copy: Stream::non_blocking()?,
            offload: Stream::non_blocking()?,
            residents,
            head_filled: false,
            ring,
            schedule: Vec::new(),
            next: 0,
            issued: 0,
            in_flight: VecDeque::new(),
            waits: Vec::new(),
            waits_used: 0,
            stats: TransferStats::default(),
            _pinned: pinned,
        })
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

    fn begin_step(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        gate(Layout::EMBED)?;
        Self::fill(
            &self.copy,
            &self.regions,
            &self.residents[0],
            &layout.blocks[Layout::EMBED],
        )?;
        self.head_filled = false;
        Ok(())
    }

    /// Enqueues the head's copy once per step (needed after the last layer's forward).
    fn fill_head(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        if !self.head_filled {
            let index = layout.head_block();
            gate(index)?;
            Self::fill(
                &self.copy,
                &self.regions,
                &self.residents[1],
                &layout.blocks[index],
            )?;
            self.head_filled = true;
        }
        Ok(())
    }

    fn begin_micro(&mut self, layout: &Layout, gate: Gate) -> Result<()> {
        let n = layout.num_layers();
        self.schedule = (0..n).chain((0..n).rev()).collect();
        self.next = 0;
        self.issued = 0;
        self.issue_up_to(layout, RING - 1, gate)
    }

    /// Enqueues copies for schedule entries up to `last` (each waits for its buffer).
    fn issue_up_to(&mut self, layout: &Layout, last: usize, gate: Gate) -> Result<()> {
        while self.issued < self.schedule.len() && self.issued <= last {
            let k = self.issued;
            let index = layout.layer_block(self.schedule[k]);
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

    /// Makes torch's stream wait for `buf`'s copy, timing the stall.
    fn wait_ready(&mut self, which: Option<usize>) -> Result<Tensor> {
        if self.waits_used == self.waits.len() {
            self.waits.push((Event::new(true)?, Event::new(true)?));
        }
        let buf = match which {
            Some(r) => &self.residents[r],
            None => &self.ring[(self.next - 1) % RING],
        };
        let (before, after) = &self.waits[self.waits_used];
        before.record(torch_stream())?;
        cuda::wait(torch_stream(), &buf.ready)?;
        after.record(torch_stream())?;
        self.waits_used += 1;
        if let Ok(used) = cuda::device_bytes_used() {
            self.stats.peak_device_bytes = self.stats.peak_device_bytes.max(used);
        }
        Ok(buf.data.shallow_clone())
    }

    fn resident(&mut self, which: usize) -> Result<Tensor> {
        self.wait_ready(Some(which))
    }

    fn layer(&mut self, layout: &Layout, l: usize, gate: Gate) -> Result<Tensor> {
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
        if k + 1 == layout.num_layers() {
            // The last forward layer: the head comes next.
            self.fill_head(layout, gate)?;
        }
        self.next += 1;
        let len = layout.blocks[layout.layer_block(l)].len as i64;
        Ok(self.wait_ready(None)?.narrow(0, 0, len))
    }

    fn end_micro(&mut self) -> Result<()> {
        if self.next > 0 {
            self.ring[(self.next - 1) % RING]
                .free
                .record(torch_stream())?;
        }
        for r in &self.residents {
            r.free.record(torch_stream())?;
        }
        Ok(())
    }

    fn offload(
        &mut self,
        micro: usize,
        index: usize,
        block: &Block,
        w: &BlockWeights,
        slot: usize,
    ) -> Result<()> {
        let (start, end) = (Event::new(true)?, Event::new(true)?);
        let produced = Event::new(false)?;
        produced.record(torch_stream())?;
        cuda::wait(self.offload.raw(), &produced)?;
        start.record(self.offload.raw())?;
        let elem = self.regions.dtype.size();
        let mut keep = Vec::with_capacity(block.tensors.len());
        for t in &block.tensors {
            let dst = self.regions.slot_ptr(slot, t.offset);
            let g = w.get(&t.name).grad();
            if !g.defined() {
                // SAFETY: the slot is owned by this worker until announced; the range lies
                // inside it.
                unsafe { std::ptr::write_bytes(dst, 0, t.numel() * elem) };
                continue;
            }
            if g.kind() != self.kind {
                bail!(
                    "gradient of `{}` is {:?}, the slab holds {:?}",
                    t.name,
                    g.kind(),
                    self.kind
                );
            }
            let g = g.contiguous();
            // SAFETY: the slot range is owned by this worker and pinned; `g` stays alive in
            // `keep` until the copy's event completes.
            unsafe {
                cuda::copy_d2h(
                    dst,
                    g.data_ptr() as u64,
                    t.numel() * elem,
                    self.offload.raw(),
                )?
            };
            keep.push(g);
        }
        end.record(self.offload.raw())?;
        self.in_flight.push_back(InFlight {
            done: Delivered {
                micro,
                block: index,
                slot,
            },
            start,
            end,
            _keep: keep,
        });
        Ok(())
    }

    fn delivered(&mut self, wait: bool) -> Result<Vec<Delivered>> {
        let mut out = Vec::new();
        while let Some(f) = self.in_flight.front() {
            if wait {
                f.end.synchronize()?;
            } else if !f.end.done()? {
                break;
            }
            let f = self.in_flight.pop_front().expect("front exists");
            self.stats.d2h_s += Event::elapsed_ms(&f.start, &f.end)? as f64 / 1e3;
            out.push(f.done);
        }
        Ok(out)
    }

    fn wait_oldest(&mut self) -> Result<bool> {
        match self.in_flight.front() {
            Some(f) => {
                f.end.synchronize()?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn take_stats(&mut self) -> Result<TransferStats> {
        for (before, after) in &self.waits[..self.waits_used] {
            after.synchronize()?;
            self.stats.h2d_wait_s += Event::elapsed_ms(before, after)? as f64 / 1e3;
        }
        self.waits_used = 0;
        Ok(std::mem::take(&mut self.stats))
    }
}
