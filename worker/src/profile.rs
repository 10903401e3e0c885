//! torch's profiler around one training step of this worker: where the real engine's GPU
//! time goes, kernel by kernel, rather than a Python mirror of one block.
//!
//! `MT_TORCH_PROFILE=DIR` writes `DIR/worker<rank>_step<N>.json`, a Chrome trace of step `N`
//! (`MT_TORCH_PROFILE_STEP`, default 3: past the warm-up steps) with the aten ops and their
//! input shapes, the CUDA kernels and copies (CUPTI, through Kineto), and one range per phase
//! of the engine (`forward 3`, `backward 3`, `head`, ...; [`phase`]).
//! `scripts/trace_summary.py` turns it into tables. The profiled step runs slower than the
//! others (the profiler records every op); nothing else changes. Unset, this module costs
//! one relaxed atomic load per phase.
//!
//! The calls into the profiler are worker/src/profile.cpp (tch does not bind them), compiled
//! by worker/build.rs.

use std::cell::Cell;
use std::ffi::{CString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use mt::fault::Phase;

use crate::cxx::checked;
use mt::protocol::Device;

unsafe extern "C" {
    fn mt_profile_start(cuda: c_int) -> *mut c_char;
    fn mt_profile_stop(path: *const c_char) -> *mut c_char;
    fn mt_profile_range_begin(name: *const c_char) -> *mut c_void;
    fn mt_profile_range_end(handle: *mut c_void);
}

/// Whether a step is being profiled (phases open ranges only then).
static ACTIVE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The phase range open on this thread.
    static OPEN: Cell<*mut c_void> = const { Cell::new(std::ptr::null_mut()) };
}

/// The profiler's settings for this worker, from the environment.
pub struct Profiler {
    dir: Option<PathBuf>,
    step: usize,
    rank: usize,
    device: Device,
    /// Training steps begun so far.
    seen: usize,
}

impl Profiler {
    pub fn from_env(rank: usize, device: Device) -> Result<Profiler> {
        let sw = mt::switches::get();
        let (dir, step) = (sw.torch_profile.clone(), sw.torch_profile_step);
        if let Some(d) = &dir {
            std::fs::create_dir_all(d)
                .with_context(|| format!("MT_TORCH_PROFILE={}: cannot create it", d.display()))?;
        }
        Ok(Profiler {
            dir,
            step,
            rank,
            device,
            seen: 0,
        })
    }

    /// A training step begins: the chosen one starts the profiler.
    pub fn step_begins(&mut self) -> Result<()> {
        self.seen += 1;
        if self.dir.is_none() || self.seen != self.step {
            return Ok(());
        }
        // SAFETY: no arguments beyond an int; returns an owned C string or null.
        checked(unsafe { mt_profile_start(c_int::from(self.cuda().is_some())) })
            .context("starting torch's profiler")?;
        ACTIVE.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The step ends: the chosen one, once the device is done with it, writes its trace.
    pub fn step_ends(&mut self) -> Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        if self.seen != self.step {
            return Ok(());
        }
        close_range();
        ACTIVE.store(false, Ordering::Relaxed);
        if let Some(i) = self.cuda() {
            tch::Cuda::synchronize(i);
        }
        let path = dir.join(format!("worker{}_step{}.json", self.rank, self.step));
        let c = CString::new(path.to_string_lossy().into_owned())?;
        // SAFETY: `c` is a NUL-terminated path for the call's length.
        checked(unsafe { mt_profile_stop(c.as_ptr()) })
            .with_context(|| format!("writing the trace {}", path.display()))?;
        eprintln!(
            "torch profile of step {} written: {}",
            self.step,
            path.display()
        );
        Ok(())
    }

    fn cuda(&self) -> Option<i64> {
        match self.device {
            Device::Cuda(i) => Some(i as i64),
            Device::Cpu => None,
        }
    }
}

/// The engine enters `phase` (of `layer`): while a step is profiled, the previous phase's
/// range ends and this one's begins.
pub fn phase(phase: Phase, layer: Option<usize>) {
    if !ACTIVE.load(Ordering::Relaxed) {
        return;
    }
    close_range();
    let name = match layer {
        Some(l) => format!("{} {l}", phase.name()),
        None => phase.name().to_string(),
    };
    let c = CString::new(name).expect("phase names hold no NUL");
    // SAFETY: `c` outlives the call; the C++ side copies the name.
    let h = unsafe { mt_profile_range_begin(c.as_ptr()) };
    OPEN.with(|o| o.set(h));
}

fn close_range() {
    let h = OPEN.with(|o| o.replace(std::ptr::null_mut()));
    if !h.is_null() {
        // SAFETY: `h` came from mt_profile_range_begin and is ended once.
        unsafe { mt_profile_range_end(h) };
    }
}
