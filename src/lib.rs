//! megatrain-rs core: everything that needs neither libtorch nor a GPU.
//!
//! The launcher (`mt-launch`) and the workers (`mt-worker`) share these types: the run and
//! model configs, THE parameter layout, shared-memory regions, the message protocol, and the
//! host-side numerics (slab reduce, clipping, AdamW, schedules), data and checkpoints.
//! `unsafe` lives in fenced places only: `shm` (shared memory), the host kernels'
//! intrinsics (`simd`, and the `x86` modules beside the portable loops in `reduce` and
//! `optim::adamw`, fenced as `simd` describes) and the `Pod` marker of `elem`; the compiler
//! holds the rest of the crate to that.

#![deny(unsafe_code)]

pub mod bounded;
pub mod cancel;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod elem;
pub mod error;
pub mod fault;
pub mod host;
pub mod layout;
pub mod metrics;
pub mod mrope;
pub mod objective;
pub mod optim;
pub mod plan;
pub mod protocol;
pub mod reduce;
pub mod runpath;
#[allow(unsafe_code)]
pub mod shm;
#[allow(unsafe_code)]
pub mod simd;
pub mod switches;
pub mod sysmem;

pub use error::{Error, Result};
