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

/// norm.cu's `GatedShape`: z's batch and time strides, then T, V and P.
#[repr(C)]
struct GatedShape {
    zs_b: i64,
    zs_t: i64,
    t: i32,
    v: i32,
    p: i32,
}

/// Whether norm.cu's gated norm takes value heads of `dv` in `kind`: bf16, Dv 32 to 256
/// (one pack of 8 a thread, a row within a warp).
pub fn gated_norm_supports(kind: Kind, dv: i64) -> bool {
    kind == Kind::BFloat16 && [32, 64, 128, 256].contains(&dv)
}

/// o (B, V, P, Dv) and z (B, T, V, Dv), T <= P, in the layouts norm.cu reads: o
/// contiguous, z with Dv's stride 1, V's Dv and its rows 16-byte aligned (else copied).
fn gated_inputs(o: &Tensor, z: &Tensor) -> Result<(Tensor, Tensor, GatedShape)> {
    let (&[b, v, p, dv], &[zb, t, zv, zd]) = (o.size().as_slice(), z.size().as_slice()) else {
        bail!(
            "o is {:?}, z {:?}: not (B, V, P, Dv) and (B, T, V, Dv)",
            o.size(),
            z.size()
        )
    };
    if (zb, zv, zd) != (b, v, dv) || t > p {
        bail!("o is {:?}, z {:?}", o.size(), z.size());
    }
    let o = packed(o);
    let st = z.stride();
    let aligned = st[3] == 1 && st[2] == dv && st[0] % 8 == 0 && st[1] % 8 == 0;
    let z = match aligned && ptr(z).is_multiple_of(16) {
        true => z.shallow_clone(),
        false => z.contiguous(),
    };
    let st = z.stride();
    let shape = GatedShape {
        zs_b: st[0],
        zs_t: st[1],
        t: t as i32,
        v: v as i32,
        p: p as i32,
    };
    Ok((o, z, shape))
}

/// y (B, T, V Dv) bf16 = norm(o) w silu(z) per value head (see norm.cu), from o (B, V, P,
/// Dv), z (B, T, V, Dv), w (Dv) f32; and, if `want_rstd`, the rows' rstd (B T V) f32.
pub fn gated_norm_fwd(
    o: &Tensor,
    z: &Tensor,
    w: &Tensor,
    eps: f64,
    want_rstd: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (o, z, mut shape) = gated_inputs(o, z)?;
    let &[b, v, _, dv] = o.size().as_slice() else {
        unreachable!("checked")
    };
    if !gated_norm_supports(o.kind(), dv) {
        bail!("value heads of {dv} {:?}", o.kind());
    }
    let t = shape.t as i64;
    let rows = b * t * v;
    let y = Tensor::empty([b, t, v * dv], (o.kind(), o.device()));
    let rstd = want_rstd.then(|| Tensor::empty([rows], (Kind::Float, o.device())));
    if rows == 0 {
        return Ok((y, rstd));
    }
    let w = w.contiguous();
    let tpr = dv / 8;
    let groups = THREADS / tpr;
    let (mut op, mut zp, mut wp, mut yp) = (ptr(&o), ptr(&z), ptr(&w), ptr(&y));
    let mut rp = rstd.as_ref().map_or(0, ptr);
    let (mut rows_, mut tpr32, mut eps32) = (rows, tpr as i32, eps as f32);
    let mut args = [
        arg(&mut op),
        arg(&mut zp),
        arg(&mut wp),
        arg(&mut yp),
        arg(&mut rp),
        arg(&mut shape),
        arg(&mut rows_),
        arg(&mut tpr32),
        arg(&mut eps32),
    ];
    let blocks = ((rows + groups - 1) / groups).min(1 << 20);
    let what = "cuLaunchKernel (gated_norm_fwd)";
    launch_with(kernels.norm[2], blocks, THREADS as u32, &mut args, what)?;
    Ok((y, rstd))
}

/// The backward of [`gated_norm_fwd`] from dy (B, T, V Dv): (do (B, V, P, Dv), zero past
/// T; dz (B, T, V, Dv); dw (Dv) f32).
pub fn gated_norm_bwd(
    o: &Tensor,
    z: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let (o, z, mut shape) = gated_inputs(o, z)?;
    let &[b, v, p, dv] = o.size().as_slice() else {
        unreachable!("checked")
    };
    let t = shape.t as i64;
    if dy.size() != [b, t, v * dv] {
        bail!("dy is {:?}, not ({b}, {t}, {})", dy.size(), v * dv);
    }
    let (dy, w) = (packed(dy), w.contiguous());
    let rows = b * t * v;
    let d_o = match p > t {
        true => o.zeros_like(),
        false => o.empty_like(),
    };
    let dz = Tensor::empty([b, t, v, dv], (o.kind(), o.device()));
    let tpr = dv / 8;
    let groups = THREADS / tpr;
    let blocks = ((rows + groups - 1) / groups).clamp(1, BWD_BLOCKS);
    let part = Tensor::empty([blocks * groups, dv], (Kind::Float, o.device()));
    let (mut op, mut zp, mut wp, mut rp) = (ptr(&o), ptr(&z), ptr(&w), ptr(rstd));
    let (mut dyp, mut dop, mut dzp, mut pp) = (ptr(&dy), ptr(&d_o), ptr(&dz), ptr(&part));
    let (mut rows_, mut tpr32) = (rows, tpr as i32);
    let mut args = [
        arg(&mut op),
        arg(&mut zp),
        arg(&mut wp),
        arg(&mut rp),
        arg(&mut dyp),
        arg(&mut dop),
        arg(&mut dzp),
        arg(&mut pp),
        arg(&mut shape),
        arg(&mut rows_),
        arg(&mut tpr32),
    ];
    let what = "cuLaunchKernel (gated_norm_bwd)";
    launch_with(kernels.norm[3], blocks, THREADS as u32, &mut args, what)?;
    let dw = part.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    Ok((d_o, dz, dw))
}
