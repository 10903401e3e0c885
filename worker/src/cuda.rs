//! The CUDA driver-API pieces tch lacks: non-blocking streams, events, host registration
//! and asynchronous copies (cudarc, dynamically loaded). They act on the primary context
//! that torch makes current on this thread, and order against torch's stream, which is
//! the legacy default stream (the null `CUstream`). Also loads libtorch_cuda.so
//! ([`load_torch_cuda`]). Used by stream/ (copies, events, registration) and kernels/
//! (torch's stream) alike.

use std::ffi::CString;

use anyhow::{Result, bail};
use cudarc::driver::sys::{self, CUdeviceptr, CUevent, CUresult, CUstream};

/// Largest single `cuMemHostRegister` call (the r580 driver fails at >= 512 GiB).
const REGISTER_CHUNK: usize = 64 << 30;

fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        bail!("{what} failed: {r:?}")
    }
}

/// torch's stream (the legacy default stream).
pub fn torch_stream() -> CUstream {
    std::ptr::null_mut()
}

/// Checks that torch left a CUDA context current on this thread.
pub fn check_context() -> Result<()> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: writes one pointer into `ctx`.
    check(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        bail!("no CUDA context is current: torch must touch the device first");
    }
    Ok(())
}

/// (free, total) bytes of device memory as the driver reports them (all allocations on
/// this device, the context included, count as used).
pub fn memory_info() -> Result<(u64, u64)> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: writes two integers.
    check(
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free as u64, total as u64))
}

/// Bytes of device memory in use (all allocations on this device, the context included).
pub fn device_bytes_used() -> Result<u64> {
    let (free, total) = memory_info()?;
    Ok(total - free)
}

/// A stream that does not synchronize implicitly with the legacy default stream.
pub struct Stream(CUstream);

impl Stream {
    pub fn non_blocking() -> Result<Stream> {
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one stream handle.
        check(
            unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            "cuStreamCreate",
        )?;
        Ok(Stream(s))
    }

    pub fn raw(&self) -> CUstream {
        self.0
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuStreamCreate and is destroyed once.
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// Makes `stream` wait (on the device) until `event`'s last recorded work completes.
pub fn wait(stream: CUstream, event: &Event) -> Result<()> {
    // SAFETY: both handles are live.
    check(
        unsafe { sys::cuStreamWaitEvent(stream, event.0, 0) },
        "cuStreamWaitEvent",
    )
}

pub struct Event(CUevent);

impl Event {
    /// `timing`: whether elapsed times can be measured between such events.
    pub fn new(timing: bool) -> Result<Event> {
        let flags = if timing {
            0
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        check(
            unsafe { sys::cuEventCreate(&mut e, flags) },
            "cuEventCreate",
        )?;
        Ok(Event(e))
    }

    pub fn record(&self, stream: CUstream) -> Result<()> {
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuEventRecord(self.0, stream) },
            "cuEventRecord",
        )
    }

    /// Whether the recorded work has completed (never blocks).
    pub fn done(&self) -> Result<bool> {
        // SAFETY: the handle is live.
        match unsafe { sys::cuEventQuery(self.0) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => bail!("cuEventQuery failed: {r:?}"),
        }
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the handle is live.
        check(
            unsafe { sys::cuEventSynchronize(self.0) },
            "cuEventSynchronize",
        )
    }

    /// Milliseconds between two completed timing events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        // SAFETY: writes one float; both handles are live.
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.0, end.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the handle came from cuEventCreate and is destroyed once.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// Page-locks a host range for DMA (in chunks); unregistered on drop.
pub struct HostRegistration {
    chunks: Vec<*mut u8>,
}

impl HostRegistration {
    /// # Safety
    /// `ptr..ptr+len` must stay mapped for the registration's life.
    pub unsafe fn new(ptr: *mut u8, len: usize, what: &str) -> Result<HostRegistration> {
        let mut reg = HostRegistration { chunks: Vec::new() };
        let mut off = 0;
        while off < len {
            let n = REGISTER_CHUNK.min(len - off);
            // SAFETY: the range is mapped (caller) and inside `ptr..ptr+len`.
            let p = unsafe { ptr.add(off) };
            let r =
                unsafe { sys::cuMemHostRegister_v2(p.cast(), n, sys::CU_MEMHOSTREGISTER_PORTABLE) };
            check(
                r,
                &format!("cuMemHostRegister of {what} ({n} bytes at offset {off})"),
            )?;
            reg.chunks.push(p);
            off += n;
        }
        Ok(reg)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        for &p in &self.chunks {
            // SAFETY: each pointer was registered by `new`.
            unsafe { sys::cuMemHostUnregister(p.cast()) };
        }
    }
}

/// Enqueues a host-to-device copy on `stream`.
///
/// # Safety
/// Both ranges must be valid for `bytes` until the copy completes; `src` should be
/// registered for the copy to be asynchronous.
pub unsafe fn copy_h2d(
    dst: CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees both ranges.
    check(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream) },
        "cuMemcpyHtoDAsync",
    )
}

/// Enqueues a device-to-host copy on `stream`.
///
/// # Safety
/// As for [`copy_h2d`].
pub unsafe fn copy_d2h(
    dst: *mut u8,
    src: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees both ranges.
    check(
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream) },
        "cuMemcpyDtoHAsync",
    )
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
