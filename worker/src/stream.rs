//! Moving blocks between the shared host regions and the compute device.
//!
//! `BlockSource` hands the engine a block's flat weight buffer on the compute device, and
//! `SlabWriter` a flat view of a gradient slab slot. On CPU both are zero-copy views of the
//! shared memory. On CUDA the skeleton copies a block synchronously into a fresh device
//! buffer; the double-buffered, stream-ordered, host-registered path replaces exactly these
//! two seams (GPU engine issue).

use std::ffi::CString;

use anyhow::{Result, bail};
use mt::config::DType;
use mt::layout::{Block, Layout};
use mt::protocol::Device as MtDevice;
use mt::shm::Region;
use tch::{Device, Kind, Tensor};

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

/// A flat view of `len` elements of `region` starting at element `offset`.
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

/// Hands out blocks of the shared weight store on the compute device.
pub struct BlockSource {
    store: Region,
    kind: Kind,
    device: Device,
}

impl BlockSource {
    pub fn new(
        store: Region,
        dtype: DType,
        device: Device,
        layout: &Layout,
    ) -> Result<BlockSource> {
        let kind = kind_of(dtype);
        let need = layout.total * kind.elt_size_in_bytes();
        if store.payload_len() < need {
            bail!(
                "store region holds {} bytes, the layout needs {need}",
                store.payload_len()
            );
        }
        Ok(BlockSource {
            store,
            kind,
            device,
        })
    }

    /// The flat weights of `block` on the compute device.
    pub fn fetch(&self, block: &Block) -> Tensor {
        // SAFETY: the store stays mapped while `self` lives, and the launcher does not
        // write it during a step (protocol); the view is only read.
        let host = unsafe { region_view(&self.store, block.offset, block.len, self.kind) };
        match self.device {
            Device::Cpu => host,
            dev => host.to_device(dev),
        }
    }
}

/// This worker's gradient slab: `slots` slots of `slot_len` elements each.
pub struct SlabWriter {
    slab: Region,
    kind: Kind,
    slot_len: usize,
    slots: usize,
}

impl SlabWriter {
    pub fn new(slab: Region, dtype: DType, slot_len: usize, slots: usize) -> Result<SlabWriter> {
        let kind = kind_of(dtype);
        let need = slot_len * slots * kind.elt_size_in_bytes();
        if slab.payload_len() < need {
            bail!(
                "slab region holds {} bytes, {slots} slots need {need}",
                slab.payload_len()
            );
        }
        Ok(SlabWriter {
            slab,
            kind,
            slot_len,
            slots,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// A host view of slot `slot`, `len` elements long.
    pub fn slot(&self, slot: usize, len: usize) -> Result<Tensor> {
        if slot >= self.slots || len > self.slot_len {
            bail!(
                "slot {slot} of {} ({len} elements of {}) is out of range",
                self.slots,
                self.slot_len
            );
        }
        // SAFETY: the slab stays mapped while `self` lives; the caller owns the slot (taken
        // from the free list, not yet handed to the launcher), so nobody else touches it.
        Ok(unsafe { region_view(&self.slab, slot * self.slot_len, len, self.kind) })
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
