//! rope.cu's launch: the rotary embedding of (B, N, T, D) heads (`super::super::rope`).

use anyhow::{Result, bail};
use tch::{Kind, Tensor};

use super::{arg, kernels, launch_block, ptr};

/// Whether rope.cu takes heads of `d` dims (`r` of them rotated) in `kind`: bf16, D and R
/// even, R <= D <= 512 (a block's x dim holds D/2 threads).
pub fn rope_supports(kind: Kind, d: i64, r: i64) -> bool {
    kind == Kind::BFloat16 && d % 2 == 0 && r % 2 == 0 && 0 < r && r <= d && d <= 512
}

/// x (B, N, T, D), any strides with D's 1, turned by cos and sin ((B or 1, 1, T, R) or
/// interleaved (.., R/2), R's stride 1), `sign` -1 the other way -> y (B, N, T, D)
/// contiguous.
pub fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    r: i64,
    interleaved: bool,
    sign: f32,
) -> Result<Tensor> {
    let kernels = kernels().map_err(|e| anyhow::anyhow!("{e}"))?;
    let &[b, n, t, d] = x.size().as_slice() else {
        bail!("rope: x is {:?}, not (B, N, T, D)", x.size())
    };
    let (cos, sin) = (cos.contiguous(), sin.contiguous());
    let x = if x.stride()[3] == 1 { x.shallow_clone() } else { x.contiguous() };
    let (xs, cs) = (x.stride(), cos.stride());
    let cb = if cos.size()[0] == 1 { 0 } else { cs[0] };
    let y = Tensor::empty([b, n, t, d], (x.kind(), x.device()));
    let rows = b * n * t;
    if rows == 0 {
        return Ok(y);
    }
    let (mut xp, mut cp, mut sp, mut yp) = (ptr(&x), ptr(&cos), ptr(&sin), ptr(&y));
    let (mut sb, mut sn, mut st, mut cb, mut ct) = (xs[0], xs[1], xs[2], cb, cs[2]);
    let (mut n32, mut t32, mut d32, mut r32) = (n as i32, t as i32, d as i32, r as i32);
    let (mut il, mut sign, mut rows_) = (i32::from(interleaved), sign, rows);
    let mut args = [
        arg(&mut xp),
        arg(&mut sb),
        arg(&mut sn),
        arg(&mut st),
        arg(&mut cp),
        arg(&mut sp),
        arg(&mut cb),
        arg(&mut ct),
        arg(&mut yp),
        arg(&mut n32),
        arg(&mut t32),
        arg(&mut d32),
        arg(&mut r32),
        arg(&mut il),
        arg(&mut sign),
        arg(&mut rows_),
    ];
    let per_row = (d / 2) as u32;
    let rows_per_block = (256 / per_row).max(1);
    let blocks = (rows + rows_per_block as i64 - 1) / rows_per_block as i64;
    launch_block(
        kernels.rope,
        blocks.min(1 << 20),
        (per_row, rows_per_block),
        &mut args,
        "cuLaunchKernel (rope)",
    )?;
    Ok(y)
}
