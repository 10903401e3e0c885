//! norm.cu's launches: the `1 + w` RMSNorm of bf16 rows (`super::super::norm`).

use anyhow::{Result, bail};
use tch::{Kind, Tensor};

use super::{arg, kernels, launch_with, packed, ptr};

/// norm.cu's threads per block and packs (8 channels) a thread holds per row.
const THREADS: i64 = 256;
const MAXV: i64 = 4;
/// Blocks of the backward's grid-stride loop: its weight-gradient partials are one row per
/// group of threads, so as many as fill the GPU and no more.
const BWD_BLOCKS: i64 = 1024;

/// Threads per row for rows of `h` channels: the fewest of 32, 64, 128, 256 that hold a
/// row in MAXV packs each.
fn threads_per_row(h: i64) -> i64 {
    let packs = h / 8;
    [32, 64, 128, 256]
        .into_iter()
        .find(|&t| packs <= MAXV * t)
        .unwrap_or(THREADS)
}

/// Whether norm.cu takes rows of `h` channels in `kind`: bf16, h a multiple of 8 up to
/// 8 MAXV THREADS (8192).
pub fn norm_plus_one_supports(kind: Kind, h: i64) -> bool {
    kind == Kind::BFloat16 && h > 0 && h % 8 == 0 && h <= 8 * MAXV * THREADS
}

/// x (.., H) bf16, w1 = 1 + w (H) f32 -> y (.., H) bf16 and, if `want_rstd`, the rows'
/// rstd (rows) f32.
pub fn norm_plus_one_fwd(
    x: &Tensor,
    w1: &Tensor,
    eps: f64,
    want_rstd: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let h = x.size().last().copied().unwrap_or(0);
    if !norm_plus_one_supports(x.kind(), h) {
        bail!("rows of {h} {:?}", x.kind());
    }
    let (x, w1) = (packed(x), w1.contiguous());
    let rows = x.numel() as i64 / h;
    let y = x.empty_like();
    let rstd = want_rstd.then(|| Tensor::empty([rows], (Kind::Float, x.device())));
    if rows == 0 {
        return Ok((y, rstd));
    }
    let tpr = threads_per_row(h);
    let groups = THREADS / tpr;
    let (mut xp, mut wp, mut yp) = (ptr(&x), ptr(&w1), ptr(&y));
    let mut rp = rstd.as_ref().map_or(0, ptr);
    let (mut rows_, mut packs, mut tpr32, mut eps32) =
        (rows, (h / 8) as i32, tpr as i32, eps as f32);
    let mut args = [
        arg(&mut xp),
        arg(&mut wp),
        arg(&mut yp),
        arg(&mut rp),
        arg(&mut rows_),
        arg(&mut packs),
        arg(&mut tpr32),
        arg(&mut eps32),
    ];
    let blocks = ((rows + groups - 1) / groups).min(1 << 20);
    let what = "cuLaunchKernel (norm_plus_one_fwd)";
    launch_with(kernels.norm[0], blocks, THREADS as u32, &mut args, what)?;
    Ok((y, rstd))
}

/// The backward of [`norm_plus_one_fwd`] from dy (as x): (dx bf16, dw (H) f32).
pub fn norm_plus_one_bwd(
    x: &Tensor,
    dy: &Tensor,
    w1: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let h = x.size().last().copied().unwrap_or(0);
    if dy.size() != x.size() {
        bail!("dy is {:?}, x {:?}", dy.size(), x.size());
    }
    let (x, dy, w1) = (packed(x), packed(dy), w1.contiguous());
    let rows = x.numel() as i64 / h;
    let dx = x.empty_like();
    let tpr = threads_per_row(h);
    let groups = THREADS / tpr;
    let blocks = ((rows + groups - 1) / groups).clamp(1, BWD_BLOCKS);
    let part = Tensor::empty([blocks * groups, h], (Kind::Float, x.device()));
    let (mut xp, mut dyp, mut wp, mut rp) = (ptr(&x), ptr(&dy), ptr(&w1), ptr(rstd));
    let (mut dxp, mut pp) = (ptr(&dx), ptr(&part));
    let (mut rows_, mut packs, mut tpr32) = (rows, (h / 8) as i32, tpr as i32);
    let mut args = [
        arg(&mut xp),
        arg(&mut dyp),
        arg(&mut wp),
        arg(&mut rp),
        arg(&mut dxp),
        arg(&mut pp),
        arg(&mut rows_),
        arg(&mut packs),
        arg(&mut tpr32),
    ];
    let what = "cuLaunchKernel (norm_plus_one_bwd)";
    launch_with(kernels.norm[1], blocks, THREADS as u32, &mut args, what)?;
    Ok((
        dx,
        part.sum_dim_intlist([0i64].as_slice(), false, Kind::Float),
    ))
}
