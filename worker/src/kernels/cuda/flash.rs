//! torch's FlashAttention-2 (worker/src/kernels/flash.cpp): the forward with the rows'
//! log-sum-exp, and the backward from a caller's `out` (`super::super::sinks`).

use std::ffi::{c_char, c_void};

use anyhow::{Context as _, Result, bail};
use tch::{Kind, Tensor};

use crate::cxx::checked;

unsafe extern "C" {
    fn mt_flash_fwd(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        scale: f64,
        window_left: i64,
        out: *mut *mut c_void,
        lse: *mut *mut c_void,
        seed: *mut *mut c_void,
        offset: *mut *mut c_void,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    fn mt_flash_bwd(
        dout: *const c_void,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        out: *const c_void,
        lse: *const c_void,
        seed: *const c_void,
        offset: *const c_void,
        scale: f64,
        window_left: i64,
        dq: *mut *mut c_void,
        dk: *mut *mut c_void,
        dv: *mut *mut c_void,
    ) -> *mut c_char;
}

/// Whether FlashAttention-2 takes heads of `d` dims in `kind` (torch's build: bf16 or f16,
/// D a multiple of 8 up to 256, Ampere or newer, which every GPU this tool runs on is).
pub fn flash_supports(kind: Kind, d: i64) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half) && d % 8 == 0 && 0 < d && d <= 256
}

/// What the forward leaves for the backward besides q, k and v.
pub struct FlashSaved {
    /// (B, N, T) f32.
    pub lse: Tensor,
    seed: Tensor,
    offset: Tensor,
}

/// A window's left reach for the C side: -1 for none.
fn left(window: Option<i64>) -> i64 {
    window.unwrap_or(-1)
}

/// A tensor the C side allocated with `new at::Tensor`, now owned by tch.
fn owned(p: *mut c_void) -> Tensor {
    // SAFETY: a fresh at::Tensor pointer, handed over once; tch's Drop deletes it.
    unsafe { Tensor::from_ptr(p.cast()) }
}

/// Causal attention of q (B, T, N, D) over k, v (B, T, K, D) (last dims contiguous),
/// keys at most `window` positions back: out (B, T, N, D) and what the backward needs.
pub fn flash_fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> Result<(Tensor, FlashSaved)> {
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        if x.dim() != 4 || x.stride()[3] != 1 {
            bail!(
                "flash attention: {name} {:?} strides {:?}, not (B, T, heads, D) with D contiguous",
                x.size(),
                x.stride()
            );
        }
    }
    let mut p = [std::ptr::null_mut::<c_void>(); 4];
    let [out, lse, seed, offset] = &mut p;
    // SAFETY: q, k, v are live tch tensors (at::Tensor pointers); the C side writes four
    // fresh tensors or returns an error and writes none.
    let err = unsafe {
        mt_flash_fwd(
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            scale,
            left(window),
            out,
            lse,
            seed,
            offset,
        )
    };
    checked(err).context("flash attention forward")?;
    let [out, lse, seed, offset] = p.map(owned);
    Ok((out, FlashSaved { lse, seed, offset }))
}

/// The backward of [`flash_fwd`] from `dout` (B, T, N, D), with `out` as the tensor whose
/// rows' dot products with `dout` the kernel subtracts: (dq, dk, dv).
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd(
    dout: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    saved: &FlashSaved,
    scale: f64,
    window: Option<i64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let mut p = [std::ptr::null_mut::<c_void>(); 3];
    let [dq, dk, dv] = &mut p;
    // SAFETY: as in flash_fwd: live tensors in, three fresh ones out or none.
    let err = unsafe {
        mt_flash_bwd(
            dout.as_ptr().cast(),
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            out.as_ptr().cast(),
            saved.lse.as_ptr().cast(),
            saved.seed.as_ptr().cast(),
            saved.offset.as_ptr().cast(),
            scale,
            left(window),
            dq,
            dk,
            dv,
        )
    };
    checked(err).context("flash attention backward")?;
    let [dq, dk, dv] = p.map(owned);
    Ok((dq, dk, dv))
}
