//! rope.cu's launch: the rotary embedding of (B, N, T, D) heads (`super::super::rope`).

use anyhow::{Result, bail};
use tch::{Kind, Tensor};

use super::{arg, kernels, launch_grid, ptr};

/// rope.cu's `Strides`: a (B, N, T, D) tensor's first three.
#[repr(C)]
struct Strides {
    b: i64,
    n: i64,
    t: i64,
}

/// Whether rope.cu takes heads of `d` dims (`r` of them rotated) in `kind`: bf16, D and R
/// even, R <= D <= 512 (a block's x dim holds D/2 threads).
pub fn rope_supports(kind: Kind, d: i64, r: i64) -> bool {
    kind == Kind::BFloat16 && d % 2 == 0 && r % 2 == 0 && 0 < r && r <= d && d <= 512
}

/// x (B, N, T, D), any strides with D's 1, turned by cos and sin ((B or 1, 1, T, R) or
/// interleaved (.., R/2), R's stride 1), `sign` -1 the other way -> y (B, N, T, D): laid out
/// as (B, T, N, D) where x is (the heads of a projection's output, as attention reads them:
/// the backward's gradient then goes back into the projection without a copy), contiguous
/// otherwise.
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
    if b > 65535 || n > 65535 {
        bail!("rope: {b} rows of {n} heads: over the grid's limits");
    }
    let (cos, sin) = (cos.contiguous(), sin.contiguous());
    let x = if x.stride()[3] == 1 {
        x.shallow_clone()
    } else {
        x.contiguous()
    };
    let opts = (x.kind(), x.device());
    let y = match x.stride().as_slice() == [t * n * d, d, n * d, 1] {
        true => Tensor::empty([b, t, n, d], opts).transpose(1, 2),
        false => Tensor::empty([b, n, t, d], opts),
    };
    if b * n * t == 0 {
        return Ok(y);
    }
    let strides = |s: &[i64]| Strides {
        b: s[0],
        n: s[1],
        t: s[2],
    };
    let (mut xs, mut ys) = (strides(&x.stride()), strides(&y.stride()));
    let cs = cos.stride();
    let mut cb = if cos.size()[0] == 1 { 0 } else { cs[0] };
    let mut ct = cs[2];
    let (mut xp, mut cp, mut sp, mut yp) = (ptr(&x), ptr(&cos), ptr(&sin), ptr(&y));
    let (mut t32, mut r32, mut il, mut sign) = (t as i32, r as i32, i32::from(interleaved), sign);
    let mut args = [
        arg(&mut xp),
        arg(&mut xs),
        arg(&mut cp),
        arg(&mut sp),
        arg(&mut cb),
        arg(&mut ct),
        arg(&mut yp),
        arg(&mut ys),
        arg(&mut t32),
        arg(&mut r32),
        arg(&mut il),
        arg(&mut sign),
    ];
    let per_row = (d / 2) as u32;
    let rows = (256 / per_row).max(1);
    let grid = ((t as u32).div_ceil(rows), n as u32, b as u32);
    launch_grid(
        kernels.rope,
        grid,
        (per_row, rows),
        &mut args,
        "cuLaunchKernel (rope)",
    )?;
    Ok(y)
}
