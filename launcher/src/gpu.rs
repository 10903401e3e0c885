//! The launcher's one look at the GPUs: their free and total memory, from the CUDA driver
//! (cudarc, loaded at run time: the launcher links neither libtorch nor CUDA, and runs
//! where no driver is installed).
//!
//! Free memory is read with a CUDA context open on the device (`cuMemGetInfo` needs one):
//! what other processes hold is excluded, and so is roughly what a worker's own context
//! will take, which the memory plan does not count. The context is released before any
//! worker starts.
//!
//! Test hook: `MT_TEST_DEVICE_MEMORY=<bytes>` stands for every worker's device memory (free
//! and total), CPU workers included, so that a test on a machine without GPUs can see the
//! refusal of a micro-batch that does not fit.

use std::sync::Mutex;

use mt::plan::DeviceMemory;
use mt::protocol::Device;

/// The devices read and what the driver said of them.
type Reading = (Vec<usize>, Option<Vec<DeviceMemory>>);

/// Where [`memory`]'s figures come from, as the refusal says it.
pub fn source() -> &'static str {
    match mt::switches::testing::device_memory() {
        Some(_) => "MT_TEST_DEVICE_MEMORY (a test hook) gives",
        None => "the CUDA driver reports",
    }
}

/// Free and total memory of each device in `devices` (CUDA ordinals; empty: `workers` CPU
/// workers), or None where it cannot be known: CPU workers, no CUDA driver, or a driver
/// error (logged; the workers then report what they find).
pub fn memory(devices: &[usize], workers: usize) -> Option<Vec<DeviceMemory>> {
    if let Some(bytes) = mt::switches::testing::device_memory() {
        let all = |device| DeviceMemory {
            device,
            free: bytes,
            total: bytes,
        };
        return Some(match devices.is_empty() {
            true => (0..workers).map(|_| all(Device::Cpu)).collect(),
            false => devices.iter().map(|&d| all(Device::Cuda(d))).collect(),
        });
    }
    if devices.is_empty() || !driver_present() {
        return None;
    }
    // Read once per process: before the workers start, their contexts not yet counted,
    // and every later plan of this run (the workers' tile included) sees the same figures.
    static READ: Mutex<Option<Reading>> = Mutex::new(None);
    let mut read = READ.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = read.as_ref().filter(|(seen, _)| seen == devices) {
        return m.clone();
    }
    let m = read_driver(devices);
    *read = Some((devices.to_vec(), m.clone()));
    m
}

fn read_driver(devices: &[usize]) -> Option<Vec<DeviceMemory>> {
    let read = |d: usize| -> Result<DeviceMemory, cudarc::driver::DriverError> {
        let ctx = cudarc::driver::CudaContext::new(d)?;
        let (free, total) = ctx.mem_get_info()?;
        Ok(DeviceMemory {
            device: Device::Cuda(d),
            free: free as u64,
            total: total as u64,
        })
    };
    let found: Result<Vec<_>, _> = devices.iter().map(|&d| read(d)).collect();
    match found {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::warn!("cannot read GPU memory from the CUDA driver ({e}): not checked");
            None
        }
    }
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use otherwise).
#[allow(unsafe_code)]
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names, and drops it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}
