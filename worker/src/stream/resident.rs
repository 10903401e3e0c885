//! Resident blocks (`memory.resident_blocks`, `mt::protocol::ResidentInit`): the leading
//! blocks whose master weights, Adam moments and compute weights this worker keeps on its
//! device, updating them itself; the streamer hands their compute weights out instead of
//! copying them from the store.
//!
//! Per step: each block's gradient reaches the slab and the host reduce as any other's;
//! once the launcher frees the slot of a part that the step's last micro-batch made final,
//! that part of the host's accumulator is copied back here ([`Resident::gradient_final`],
//! on a copy stream of its own, CUDA); `ResidentUpdate` then runs AdamW over every block
//! with the host's arithmetic (adamw.cu on CUDA, `mt::optim::adamw::adamw_update_resident`
//! on CPU), so the copy holds the bits the host's own update would have written.

use std::ops::Range;

use anyhow::{Context, Result, bail};
use half::bf16;
use mt::config::DType;
use mt::layout::Layout;
use mt::optim::AdamWStep;
use mt::optim::adamw::{StoreOut, adamw_update_resident, element_constants};
use mt::protocol::{ResidentInit, ResidentPart};
use mt::shm::Region;
use tch::{Device, Kind, Tensor};

use super::{kind_of, region_view};
use crate::cuda::{self, Event, HostRegistration, Stream, torch_stream};

/// One block's copy, every tensor flat over the block's elements (gaps included).
struct Held {
    /// Compute dtype: what the layers read.
    w: Tensor,
    p: Tensor,
    m: Tensor,
    v: Tensor,
    /// The reduced gradient, in the accumulator's dtype.
    g: Tensor,
    /// The block's tensors as runs of one weight decay, in block-local elements.
    runs: Vec<(Range<usize>, bool)>,
    /// Where the block starts in the layout.
    offset: usize,
}

/// The CUDA side: the regions pinned and a stream for the gradients' copies.
struct Dma {
    copy: Stream,
    /// The last gradient copy enqueued has landed.
    landed: Event,
    /// The last update has read the gradients (recorded on torch's stream): the next
    /// step's copies wait for it before overwriting them.
    updated: Event,
    // Declared before the regions they pin (dropped first).
    _pinned: Vec<HostRegistration>,
}

pub struct Resident {
    held: Vec<Held>,
    split: bool,
    grad_kind: Kind,
    device: Device,
    dma: Option<Dma>,
    grad: Region,
    transfer: Region,
}

impl Resident {
    /// Adopts the accumulator and transfer regions whose fds this worker inherited (once, at
    /// start-up), and allocates the blocks' copies (zeros until loaded).
    pub fn new(
        init: &ResidentInit,
        layout: &Layout,
        dtype: DType,
        device: Device,
    ) -> Result<Resident> {
        // SAFETY: the launcher cleared close-on-exec on exactly these fds for this process
        // (mt::shm::keep_fds_across_exec), and nothing else here uses them.
        let grad = unsafe { Region::from_inherited_fd(&init.grad) }?;
        // SAFETY: as above.
        let transfer = unsafe { Region::from_inherited_fd(&init.transfer) }?;
        let grad_kind = kind_of(init.grad_dtype);
        if init.blocks > layout.blocks.len()
            || grad.payload_len() < layout.total * init.grad_dtype.size()
            || transfer.payload_len() < layout.grad_slot_len() * 4
        {
            bail!(
                "resident blocks: {} of {} blocks, accumulator of {} bytes, transfer of {} bytes do not match the layout",
                init.blocks,
                layout.blocks.len(),
                grad.payload_len(),
                transfer.payload_len()
            );
        }
        let kind = kind_of(dtype);
        let mut held = Vec::with_capacity(init.blocks);
        for b in &layout.blocks[..init.blocks] {
            let n = b.len as i64;
            let alloc = |k: Kind| {
                Tensor::f_zeros([n], (k, device)).with_context(|| {
                    format!(
                        "allocate resident block `{}` ({} elements) on {device:?}: lower memory.resident_blocks",
                        b.prefix, b.len
                    )
                })
            };
            held.push(Held {
                w: alloc(kind)?,
                p: alloc(Kind::Float)?,
                m: alloc(Kind::Float)?,
                v: alloc(Kind::Float)?,
                g: alloc(grad_kind)?,
                runs: b
                    .runs()
                    .into_iter()
                    .map(|(r, d)| (r.start - b.offset..r.end - b.offset, d))
                    .collect(),
                offset: b.offset,
            });
        }
        let dma = match device {
            Device::Cuda(_) => {
                let end = held.last().map_or(0, |h| h.offset + h.g.numel());
                let bytes = (end * init.grad_dtype.size()).next_multiple_of(4096);
                // SAFETY: both regions stay mapped while `self` lives (the registrations
                // are dropped first); the accumulator's pages past its payload up to the
                // page boundary are mapped too.
                let pinned = unsafe {
                    vec![
                        HostRegistration::new(
                            grad.payload_ptr(),
                            bytes.min(grad.payload_len().next_multiple_of(4096)),
                            grad.name(),
                        )?,
                        HostRegistration::new(
                            transfer.payload_ptr(),
                            transfer.payload_len(),
                            transfer.name(),
                        )?,
                    ]
                };
                let (landed, updated) = (Event::new(false)?, Event::new(false)?);
                let copy = Stream::non_blocking()?;
                landed.record(copy.raw())?;
                updated.record(torch_stream())?;
                Some(Dma {
                    copy,
                    landed,
                    updated,
                    _pinned: pinned,
                })
            }
            _ => None,
        };
        Ok(Resident {
            held,
            split: init.split,
            grad_kind,
            device,
            dma,
            grad,
            transfer,
        })
    }

    /// Blocks `..n` are held here.
    pub fn blocks(&self) -> usize {
        self.held.len()
    }

    /// The compute weights of every held block, by block index (views of the copies the
    /// update writes in place).
    pub fn weights(&self) -> Vec<Tensor> {
        self.held.iter().map(|h| h.w.shallow_clone()).collect()
    }

    /// Elements `range` of block `block`'s `part`, between the device and the transfer
    /// region: loaded from it (`load`; a master also gives the compute weights), or saved
    /// into it. Completes before returning.
    pub fn copy(
        &mut self,
        load: bool,
        block: usize,
        range: Range<usize>,
        part: ResidentPart,
    ) -> Result<()> {
        let Some(h) = self.held.get(block) else {
            bail!(
                "ResidentCopy of block {block}: {} blocks are resident",
                self.held.len()
            );
        };
        if range.end > h.p.numel() || range.len() * 4 > self.transfer.payload_len() {
            bail!("ResidentCopy of block {block}: elements {range:?} out of bounds");
        }
        let dst = match part {
            ResidentPart::Master => &h.p,
            ResidentPart::M => &h.m,
            ResidentPart::V => &h.v,
        };
        let mut on_device = dst.narrow(0, range.start as i64, range.len() as i64);
        let bytes = range.len() * 4;
        match &self.dma {
            // The transfer region is pinned: one DMA on torch's stream, waited for.
            Some(_) => {
                let (dev, host) = (on_device.data_ptr() as u64, self.transfer.payload_ptr());
                // SAFETY: `bytes` lie inside the pinned transfer region (checked above) and
                // inside `on_device`; the launcher leaves the region alone between sending
                // the `ResidentCopy` and receiving its answer, sent after the copy completed.
                unsafe {
                    match load {
                        true => cuda::copy_h2d(dev, host, bytes, torch_stream())?,
                        false => cuda::copy_d2h(host, dev, bytes, torch_stream())?,
                    }
                }
            }
            None => {
                // SAFETY: as above, the view lives only here.
                let mut host = unsafe { region_view(&self.transfer, 0, range.len(), Kind::Float) };
                match load {
                    true => on_device.f_copy_(&host)?,
                    false => host.f_copy_(&on_device)?,
                };
            }
        }
        if load && part == ResidentPart::Master {
            let mut w = h.w.narrow(0, range.start as i64, range.len() as i64);
            w.f_copy_(&on_device.f_to_kind(w.kind())?)?;
        }
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        Ok(())
    }

    /// Elements `range` of block `block`'s reduced gradient are final in the host's
    /// accumulator: copies them here (CUDA: enqueued on the copy stream).
    pub fn gradient_final(&mut self, block: usize, range: Range<usize>) -> Result<()> {
        let h = &self.held[block];
        let elem = self.grad_kind.elt_size_in_bytes();
        match &self.dma {
            Some(dma) => {
                // SAFETY: the source lies inside the pinned accumulator, which the launcher
                // does not write again before this worker's next `LayerGrads` of the block
                // (protocol); the destination lies inside `h.g`, which lives as long as
                // `self`, and is read only after `landed`.
                cuda::wait(dma.copy.raw(), &dma.updated)?;
                unsafe {
                    let src = self.grad.payload_ptr().add((h.offset + range.start) * elem);
                    let dst = h.g.data_ptr() as u64 + (range.start * elem) as u64;
                    cuda::copy_h2d(dst, src, range.len() * elem, dma.copy.raw())?;
                }
                dma.landed.record(dma.copy.raw())
            }
            None => {
                // SAFETY: as above; the copy completes here.
                let src = unsafe {
                    region_view(
                        &self.grad,
                        h.offset + range.start,
                        range.len(),
                        self.grad_kind,
                    )
                };
                h.g.narrow(0, range.start as i64, range.len() as i64)
                    .f_copy_(&src)?;
                Ok(())
            }
        }
    }

    /// AdamW over every held block from its reduced gradient, enqueued on torch's stream
    /// after the gradients' copies (CUDA) or run here (CPU).
    pub fn update(&mut self, hp: &AdamWStep) -> Result<()> {
        if let Some(dma) = &self.dma {
            cuda::wait(torch_stream(), &dma.landed)?;
        }
        for h in &self.held {
            for (r, decay) in &h.runs {
                let part = |t: &Tensor| t.narrow(0, r.start as i64, r.len() as i64);
                let (p, g, m, v, w) = (part(&h.p), part(&h.g), part(&h.m), part(&h.v), part(&h.w));
                match self.device {
                    Device::Cuda(_) => crate::kernels::adamw_resident(
                        &p,
                        &g,
                        &m,
                        &v,
                        &w,
                        element_constants(hp, *decay),
                        self.split,
                    )?,
                    _ => update_on_cpu(&p, &g, &m, &v, &w, hp, *decay, self.split),
                }
            }
        }
        match &self.dma {
            Some(dma) => dma.updated.record(torch_stream()),
            None => Ok(()),
        }
    }
}

/// `adamw_update_resident` over CPU tensors (contiguous views).
#[allow(clippy::too_many_arguments)]
fn update_on_cpu(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    w: &Tensor,
    hp: &AdamWStep,
    decay: bool,
    split: bool,
) {
    let n = p.numel();
    // SAFETY: the five tensors are contiguous CPU views of `n` elements of distinct
    // buffers, of the kinds matched below; nothing else touches them meanwhile (the worker
    // computes on one thread, between steps here).
    unsafe {
        let f32s = |t: &Tensor| std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n);
        let (p, m, v) = (f32s(p), f32s(m), f32s(v));
        let out = match w.kind() {
            Kind::BFloat16 => {
                StoreOut::Bf16(std::slice::from_raw_parts_mut(w.data_ptr() as *mut bf16, n))
            }
            _ => StoreOut::F32(f32s(w)),
        };
        match g.kind() {
            Kind::BFloat16 => {
                let g = std::slice::from_raw_parts(g.data_ptr() as *const bf16, n);
                adamw_update_resident(p, g, m, v, out, hp, decay, split)
            }
            _ => {
                let g = std::slice::from_raw_parts(g.data_ptr() as *const f32, n);
                adamw_update_resident(p, g, m, v, out, hp, decay, split)
            }
        }
    }
}

/// GPU check of adamw.cu against the host's update (`mt-worker --check-resident-update`,
/// scripts/check_gpu.sh part `resident`): on about a million elements of random bits
/// (magnitudes over the whole f32 range, zeros of both signs, the gradient also in bf16),
/// for each gradient dtype, compute dtype, weight decay and split master, every bit of
/// p, m, v and w must equal `adamw_update_resident`'s. Prints one line per case; returns
/// whether all agree.
pub fn check_update(device: Device) -> Result<bool> {
    let n = (1 << 20) + 37;
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // A value of random sign, mantissa and exponent in 2^-40 .. 2^8 (and a few zeros).
    let mut value = |scale: i32| -> f32 {
        let r = next();
        if r % 97 == 0 {
            return if r & 1 == 0 { 0.0 } else { -0.0 };
        }
        let mant = 1.0 + (r >> 40) as f32 / (1u64 << 24) as f32;
        let exp = ((r >> 8) % 48) as i32 - 40 + scale;
        let sign = if r & 2 == 0 { 1.0 } else { -1.0 };
        sign * mant * 2f32.powi(exp)
    };
    let p: Vec<f32> = (0..n).map(|_| value(0)).collect();
    let g: Vec<f32> = (0..n).map(|_| value(0)).collect();
    let m: Vec<f32> = (0..n).map(|_| value(-4)).collect();
    let v: Vec<f32> = (0..n).map(|_| value(-10).abs()).collect();
    let hp = AdamWStep {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 7,
        grad_scale: 0.37,
    };
    let mut ok = true;
    for (g_kind, w_kind, split, decay) in [
        (Kind::Float, Kind::BFloat16, false, true),
        (Kind::BFloat16, Kind::BFloat16, false, false),
        (Kind::BFloat16, Kind::BFloat16, true, true),
        (Kind::Float, Kind::BFloat16, true, false),
        (Kind::Float, Kind::Float, false, true),
        (Kind::BFloat16, Kind::Float, false, false),
    ] {
        let cpu = |x: &[f32], k: Kind| Tensor::from_slice(x).to_kind(k);
        // A split master holds what joining its split gives (bits::join of bits::split).
        let p0: Vec<f32> = match split {
            true => p
                .iter()
                .map(|&x| {
                    let (hi, lo) = mt::elem::bits::split(x);
                    mt::elem::bits::join(hi, lo)
                })
                .collect(),
            false => p.clone(),
        };
        let host = [
            cpu(&p0, Kind::Float),
            cpu(&g, g_kind),
            cpu(&m, Kind::Float),
            cpu(&v, Kind::Float),
            cpu(&p0, w_kind),
        ];
        let dev: Vec<Tensor> = host.iter().map(|t| t.to_device(device)).collect();
        update_on_cpu(
            &host[0], &host[1], &host[2], &host[3], &host[4], &hp, decay, split,
        );
        crate::kernels::adamw_resident(
            &dev[0],
            &dev[1],
            &dev[2],
            &dev[3],
            &dev[4],
            element_constants(&hp, decay),
            split,
        )?;
        let mut line = format!("g {g_kind:?}, w {w_kind:?}, split {split}, decay {decay}:");
        for (i, name) in [(0, "p"), (2, "m"), (3, "v"), (4, "w")] {
            let (a, b) = (&host[i], dev[i].to_device(Device::Cpu));
            let bits = |t: &Tensor| match t.kind() {
                Kind::BFloat16 => t.view_dtype(Kind::Int16).to_kind(Kind::Int64),
                _ => t.view_dtype(Kind::Int).to_kind(Kind::Int64),
            };
            let differ = bits(a)
                .ne_tensor(&bits(&b))
                .sum(Kind::Int64)
                .int64_value(&[]);
            ok &= differ == 0;
            line += &format!(" {name} {differ} of {n} differ;");
        }
        println!("{line}");
    }
    Ok(ok)
}
