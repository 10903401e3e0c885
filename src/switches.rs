//! The switchboard: every `MT_*` environment variable the product reads (mt-launch,
//! mt-worker and this library), read and validated once at process start.
//!
//! `mt-launch` calls [`init`] before any other work, so a bad value stops the launch with a
//! one-line error naming the variable and what it takes (`MT_GATED_DELTA_CHUNK=abc:
//! expected 16, 32, 64, 128 or 256 (tokens per chunk)`); each `mt-worker` inherits the
//! environment and calls [`init`] at its start too. Everything else reads [`get`]: no code
//! outside this module reads an `MT_*` variable. An empty value counts as unset.
//!
//! [`Switches`] holds the settings, [`testing::Testing`] the test hooks (`MT_TEST_*` and
//! the like: tests set them, nothing else should). [`NAMES`] lists every variable; the table
//! in docs/switches.md lists the same (a unit test checks it).

pub mod testing;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Every variable [`Switches::from_lookup`] reads, in the order of docs/switches.md.
pub const NAMES: &[&str] = &[
    BOOTSTRAP,
    RANK,
    "MT_WORKER_BIN",
    "MT_LIBTORCH",
    "MT_PYTHON",
    "MT_NVRTC",
    "MT_MPI_SHIM",
    "MT_SIMD",
    "MT_CHECKPOINT_STREAMS",
    "MT_DIRECT_IO",
    "MT_DEFER_MOMENTS",
    "MT_IMAGE_PREFETCH",
    "MT_NVME_READ_AHEAD",
    "MT_GATHER_WINDOW",
    "MT_MPI_MAX_COUNT",
    "MT_TORCH_PROFILE",
    "MT_TORCH_PROFILE_STEP",
    "MT_MEMORY_TRACE",
    "MT_GATED_DELTA",
    "MT_GATED_DELTA_CHUNK",
    "MT_GATED_DELTA_FUSED",
    "MT_GATED_DELTA_RECURRENCE",
    "MT_MOE_EXPERTS",
    "MT_MOE_COMBINE",
    "MT_RMS_NORM",
    "MT_SWIGLU",
    "MT_ROPE",
    "MT_CROSS_ENTROPY",
    "MT_ATTENTION_SINKS",
    testing::FAIL_ALLOC,
    testing::KILL_WORKER,
    testing::LATE_NODE,
    testing::EXPORT_PAUSE,
    testing::HOST_MEMORY,
    testing::DEVICE_MEMORY,
    testing::DRIVE_EIO,
    testing::PROC_VMSTAT,
];

/// The name of the launcher's ipc-channel server, which mt-launch gives each worker.
pub const BOOTSTRAP: &str = "MT_BOOTSTRAP";
/// A worker's rank, which mt-launch gives each worker.
pub const RANK: &str = "MT_RANK";

/// Elements node 0 gathers at a time (`crate::layout::shards::GATHER_WINDOW`), at most.
pub const GATHER_WINDOW: usize = 1 << 24;
/// Elements per MPI call (launcher/src/mpi.rs), at most: counts are C ints.
pub const MPI_MAX_COUNT: usize = 1 << 30;

/// The widest vector instructions the host kernels may use (`MT_SIMD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimdCeiling {
    Portable,
    Avx2,
    Avx512,
}

/// The Gated DeltaNet's delta rule (`MT_GATED_DELTA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRule {
    Reference,
    Chunked,
}

/// The fused ops' `fused|plain` switches: Some(true) forces the fused op (on CPU its
/// mirror), Some(false) torch's ops, None: the op's default (fused on CUDA in bf16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fused {
    /// `MT_RMS_NORM`.
    pub rms_norm: Option<bool>,
    /// `MT_SWIGLU`.
    pub swiglu: Option<bool>,
    /// `MT_ROPE`.
    pub rope: Option<bool>,
    /// `MT_CROSS_ENTROPY`.
    pub cross_entropy: Option<bool>,
    /// `MT_ATTENTION_SINKS`.
    pub attention_sinks: Option<bool>,
    /// `MT_MOE_COMBINE`.
    pub moe_combine: Option<bool>,
}

/// The settings the environment gives this process (docs/switches.md).
#[derive(Debug, Clone, PartialEq)]
pub struct Switches {
    /// `MT_BOOTSTRAP` (workers): the launcher's ipc-channel server.
    pub bootstrap: Option<String>,
    /// `MT_RANK` (workers): this worker's rank.
    pub rank: Option<usize>,
    /// `MT_WORKER_BIN`: the worker binary (default: `mt-worker` beside mt-launch).
    pub worker_bin: Option<PathBuf>,
    /// `MT_LIBTORCH`: torch's `lib/` folder, or a folder holding `lib/`.
    pub libtorch: Option<PathBuf>,
    /// `MT_PYTHON`: the Python interpreter (default `python3` on PATH).
    pub python: Option<PathBuf>,
    /// `MT_NVRTC`: the folder of NVRTC's libraries (default: torch's).
    pub nvrtc: Option<PathBuf>,
    /// `MT_MPI_SHIM`: the MPI shim library (default: beside mt-launch, or the build's).
    pub mpi_shim: Option<PathBuf>,
    /// `MT_SIMD`: lowers the host kernels' instruction set; None: the widest the CPU has.
    pub simd: Option<SimdCeiling>,
    /// `MT_CHECKPOINT_STREAMS`: threads writing a checkpoint window; None: the default.
    pub checkpoint_streams: Option<usize>,
    /// `MT_DIRECT_IO` (default on): checkpoint writes with O_DIRECT where they can.
    pub direct_io: bool,
    /// `MT_DEFER_MOMENTS` (default on): the checkpoint writes moments kept from the step.
    pub defer_moments: bool,
    /// `MT_IMAGE_PREFETCH` (default on): workers decode the next step's images while the
    /// step computes.
    pub image_prefetch: bool,
    /// `MT_NVME_READ_AHEAD` (default on): with the optimizer state on the drives, the update
    /// reads the next blocks' first windows while a block's last one is computed.
    pub nvme_read_ahead: bool,
    /// `MT_GATHER_WINDOW`: elements node 0 gathers at a time; None: [`GATHER_WINDOW`].
    pub gather_window: Option<usize>,
    /// `MT_MPI_MAX_COUNT`: elements per MPI call; None: [`MPI_MAX_COUNT`].
    pub mpi_max_count: Option<usize>,
    /// `MT_TORCH_PROFILE`: the folder torch profiler traces go to; None: no profile.
    pub torch_profile: Option<PathBuf>,
    /// `MT_TORCH_PROFILE_STEP` (default 3): the step profiled.
    pub torch_profile_step: usize,
    /// `MT_MEMORY_TRACE` set (any value): print device memory high-water marks.
    pub memory_trace: bool,
    /// `MT_GATED_DELTA`: the delta rule; None: by device.
    pub gated_delta: Option<DeltaRule>,
    /// `MT_GATED_DELTA_CHUNK`: the chunked rule's chunk length; None: its default.
    pub gated_delta_chunk: Option<i64>,
    /// `MT_GATED_DELTA_FUSED`: whether the chunked rule fuses its conv and gated norm;
    /// None: on CUDA.
    pub gated_delta_fused: Option<bool>,
    /// `MT_GATED_DELTA_RECURRENCE=autograd`: the recurrence through autograd, not the tape.
    pub gated_delta_autograd: bool,
    /// `MT_MOE_EXPERTS`: Some(true) grouped GEMMs, Some(false) a loop; None: by device.
    pub moe_experts: Option<bool>,
    /// The fused ops' switches.
    pub fused: Fused,
    /// The test hooks.
    pub testing: testing::Testing,
}

static SWITCHES: OnceLock<Switches> = OnceLock::new();

/// Reads and validates the environment, once: call it first thing in a binary's `main`, so
/// that a bad value stops it with the variable named before any work.
pub fn init() -> Result<&'static Switches> {
    if let Some(s) = SWITCHES.get() {
        return Ok(s);
    }
    let s = Switches::from_env()?;
    Ok(SWITCHES.get_or_init(|| s))
}

/// The process's switches. Binaries call [`init`] first; elsewhere (unit tests) the first
/// call reads the environment, and a bad value there is a bug of the test, so it panics.
pub fn get() -> &'static Switches {
    SWITCHES.get_or_init(|| Switches::from_env().unwrap_or_else(|e| panic!("{e}")))
}

/// A variable's value where it is set and not empty; an error where it is not Unicode.
pub(crate) struct Env<'a> {
    lookup: &'a mut dyn FnMut(&str) -> Option<OsString>,
}

impl Env<'_> {
    pub(crate) fn text(&mut self, var: &'static str) -> Result<Option<String>> {
        match (self.lookup)(var) {
            None => Ok(None),
            Some(v) if v.is_empty() => Ok(None),
            Some(v) => v
                .into_string()
                .map(Some)
                .map_err(|v| bad(var, &v.to_string_lossy(), "a value in UTF-8")),
        }
    }

    pub(crate) fn path(&mut self, var: &'static str) -> Result<Option<PathBuf>> {
        Ok(match (self.lookup)(var) {
            Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
            _ => None,
        })
    }

    /// One of `choices` (the value as written, and what it means).
    pub(crate) fn choice<T: Copy>(
        &mut self,
        var: &'static str,
        choices: &[(&str, T)],
    ) -> Result<Option<T>> {
        let Some(v) = self.text(var)? else {
            return Ok(None);
        };
        match choices.iter().find(|(name, _)| *name == v) {
            Some(&(_, t)) => Ok(Some(t)),
            None => {
                let names: Vec<String> = choices.iter().map(|(n, _)| format!("`{n}`")).collect();
                Err(bad(var, &v, &one_of(&names)))
            }
        }
    }

    /// A whole number in `range`; `what` says what it counts.
    pub(crate) fn count(
        &mut self,
        var: &'static str,
        range: std::ops::RangeInclusive<u64>,
        what: &str,
    ) -> Result<Option<u64>> {
        let Some(v) = self.text(var)? else {
            return Ok(None);
        };
        match v.parse::<u64>() {
            Ok(n) if range.contains(&n) => Ok(Some(n)),
            _ => {
                let to = match *range.end() {
                    u64::MAX => String::new(),
                    end => format!(" to {end}"),
                };
                let expected = format!("a count of {what} from {}{to}", range.start());
                Err(bad(var, &v, &expected))
            }
        }
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(names: &[String]) -> String {
    match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The one-line fault of a bad value.
pub(crate) fn bad(var: &'static str, value: &str, expected: &str) -> Error {
    Error::Switch {
        var,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

impl Switches {
    /// From the process environment.
    pub fn from_env() -> Result<Switches> {
        Switches::from_lookup(&mut |var| std::env::var_os(var))
    }

    /// From `lookup` (the variable's value, None where unset): the first bad value is the
    /// error.
    pub fn from_lookup(lookup: &mut dyn FnMut(&str) -> Option<OsString>) -> Result<Switches> {
        let mut env = Env { lookup };
        let fused_or_plain = [("fused", true), ("plain", false)];
        let on_off = [("1", true), ("0", false)];
        let max = u64::MAX;
        let chunk = env.choice(
            "MT_GATED_DELTA_CHUNK",
            &[
                ("16", 16),
                ("32", 32),
                ("64", 64),
                ("128", 128),
                ("256", 256),
            ],
        )?;
        Ok(Switches {
            bootstrap: env.text(BOOTSTRAP)?,
            rank: env.count(RANK, 0..=max, "ranks")?.map(|n| n as usize),
            worker_bin: env.path("MT_WORKER_BIN")?,
            libtorch: env.path("MT_LIBTORCH")?,
            python: env.path("MT_PYTHON")?,
            nvrtc: env.path("MT_NVRTC")?,
            mpi_shim: env.path("MT_MPI_SHIM")?,
            simd: env.choice(
                "MT_SIMD",
                &[
                    ("portable", SimdCeiling::Portable),
                    ("avx2", SimdCeiling::Avx2),
                    ("avx512", SimdCeiling::Avx512),
                ],
            )?,
            checkpoint_streams: env
                .count("MT_CHECKPOINT_STREAMS", 1..=1024, "threads")?
                .map(|n| n as usize),
            direct_io: env.choice("MT_DIRECT_IO", &on_off)?.unwrap_or(true),
            defer_moments: env.choice("MT_DEFER_MOMENTS", &on_off)?.unwrap_or(true),
            image_prefetch: env.choice("MT_IMAGE_PREFETCH", &on_off)?.unwrap_or(true),
            nvme_read_ahead: env.choice("MT_NVME_READ_AHEAD", &on_off)?.unwrap_or(true),
            gather_window: env
                .count("MT_GATHER_WINDOW", 1..=GATHER_WINDOW as u64, "elements")?
                .map(|n| n as usize),
            mpi_max_count: env
                .count("MT_MPI_MAX_COUNT", 1..=MPI_MAX_COUNT as u64, "elements")?
                .map(|n| n as usize),
            torch_profile: env.path("MT_TORCH_PROFILE")?,
            // The value quoted, as the worker said it before (launcher/tests/profile.rs).
            torch_profile_step: match env.text("MT_TORCH_PROFILE_STEP")? {
                None => 3,
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => {
                        let value = format!("{v:?}");
                        let var = "MT_TORCH_PROFILE_STEP";
                        return Err(bad(var, &value, "a step number from 1"));
                    }
                },
            },
            memory_trace: (env.lookup)("MT_MEMORY_TRACE").is_some(),
            gated_delta: env.choice(
                "MT_GATED_DELTA",
                &[
                    ("reference", DeltaRule::Reference),
                    ("chunked", DeltaRule::Chunked),
                ],
            )?,
            gated_delta_chunk: chunk,
            gated_delta_fused: env.choice("MT_GATED_DELTA_FUSED", &on_off)?,
            gated_delta_autograd: env
                .choice(
                    "MT_GATED_DELTA_RECURRENCE",
                    &[("tape", false), ("autograd", true)],
                )?
                .unwrap_or(false),
            moe_experts: env.choice("MT_MOE_EXPERTS", &[("grouped", true), ("loop", false)])?,
            fused: Fused {
                moe_combine: env.choice("MT_MOE_COMBINE", &fused_or_plain)?,
                rms_norm: env.choice("MT_RMS_NORM", &fused_or_plain)?,
                swiglu: env.choice("MT_SWIGLU", &fused_or_plain)?,
                rope: env.choice("MT_ROPE", &fused_or_plain)?,
                cross_entropy: env.choice("MT_CROSS_ENTROPY", &fused_or_plain)?,
                attention_sinks: env.choice("MT_ATTENTION_SINKS", &fused_or_plain)?,
            },
            testing: testing::Testing::read(&mut env)?,
        })
    }
}

#[cfg(test)]
mod tests;
