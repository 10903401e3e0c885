//! The rotary position embedding as one op ([`rope`]): on CUDA one pass over the heads
//! (rope.cu, in f32, rounded once) where torch's ops make five (two products, the halves'
//! negation and concatenation, the sum) and keep their operands for the backward; the
//! backward is the same kernel turning the other way (the rotation is orthogonal), from the
//! tape. The caller puts a tape boundary ([`super::tape::boundary`]) on the attention's input
//! before its projections, so that the gradients the tape hands to q and k stop there, with
//! v's (worker/src/model/rope.rs `Rope::input`).

use tch::{Device, Kind, Tensor};

use super::cuda;
use super::tape::{self, vjp};

/// The mirror's signature: x, cos, sin, the rotated dims R, interleaved pairs -> x turned.
pub type RopeOps = fn(&Tensor, &Tensor, &Tensor, i64, bool) -> Tensor;

/// Whether attention takes [`rope`] for heads of `kind` on `device`: by default on CUDA in
/// bf16; `MT_ROPE=fused` forces it (the mirror on CPU), `plain` the tch ops.
pub fn rope_enabled(kind: Kind, device: Device) -> bool {
    super::fused_by_default(mt::switches::get().fused.rope, kind, device)
}

/// Whether [`rope`] runs for heads of `d` dims, `r` rotated, of `kind` on `device`: on CUDA
/// where the kernels compiled and take them; on CPU always (the mirror).
pub fn rope_supported(kind: Kind, d: i64, r: i64, device: Device) -> bool {
    match device {
        Device::Cuda(_) => cuda::rope_supports(kind, d, r) && cuda::available(),
        _ => true,
    }
}

/// `x_bntd` (B, N, T, D) with its first `r` dims turned by `cos` and `sin` (the model's
/// tables, broadcast over heads) -> (B, N, T, D) contiguous. `ops` is the mirror (torch's
/// ops, model/rope.rs), on CPU and for the CPU backward.
pub fn rope(
    x_bntd: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    r: i64,
    interleaved: bool,
    ops: RopeOps,
) -> Tensor {
    let x = x_bntd.detach();
    let turn = |x: &Tensor, sign: f32| match x.device() {
        Device::Cuda(_) => cuda::rope(x, cos, sin, r, interleaved, sign)
            .unwrap_or_else(|e| panic!("fused rope: {e:#}")),
        _ => {
            let _guard = tch::no_grad_guard();
            ops(x, cos, sin, r, interleaved)
        }
    };
    let y = turn(&x, 1.0);
    if !x_bntd.requires_grad() {
        return y;
    }
    let (input, cos, sin) = (
        x_bntd.shallow_clone(),
        cos.shallow_clone(),
        sin.shallow_clone(),
    );
    // The kernel's backward needs no x; the mirror's recomputes from it.
    let x = (!x.device().is_cuda()).then_some(x);
    tape::record_one(y, move |dy| {
        let dx = match &x {
            None => cuda::rope(dy, &cos, &sin, r, interleaved, -1.0)
                .unwrap_or_else(|e| panic!("fused rope backward: {e:#}")),
            Some(x) => {
                let [dx] = vjp([x], |[x]| {
                    (ops(x, &cos, &sin, r, interleaved) * dy).sum(Kind::Float)
                });
                dx
            }
        };
        vec![(input, dx)]
    })
}
