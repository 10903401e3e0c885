//! Layers that keep their MLP half's activations from the forward (`memory.recompute`,
//! `mt::plan::keeps_mlp`): the forward keeps the attention half's output h and the gate
//! and up projections' outputs; the backward then runs the MLP half's backward from them
//! without a matrix product of its forward (the down projection's and the gate and up
//! projections' gradients by hand, [`linear_grads`]; the norm and `act(gate) * up` through
//! autograd or the tape), and recomputes and backpropagates the attention half alone.
//! The kept tensors are what the full recompute would compute again from the same input
//! with the same ops, so results equal it to f32 rounding (the weight gradients' sums
//! are grouped differently).

use mt::config::hf::ModelSpec;
use tch::Tensor;

use super::{backpropagate, tiles};
use crate::kernels;
use crate::model::{self, BlockWeights, Context};

/// What a layer keeps for its backward: the attention half's output (B, T, H) and the
/// gate and up projections' outputs (B, T, I) each.
pub struct Kept {
    h_bth: Tensor,
    gate_bti: Tensor,
    up_bti: Tensor,
}

/// Layer `layer` without grad, keeping its MLP activations: (B, T, H) -> its output and
/// what it keeps. The down projection runs in tiles of `tile` tokens (None: whole), so its
/// input is one tile's.
pub fn forward_keeping(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    ctx: &Context,
    tile: Option<usize>,
) -> (Tensor, Kept) {
    let h_bth = model::attention_half(spec, layer, w, x_bth, ctx);
    let (gate_bti, up_bti) = model::mlp_gate_up(spec, w, &h_bth);
    let (b, t, h) = h_bth.size3().expect("a half layer's output is (B, T, H)");
    let m = b * t;
    let tile = tile.map_or(m, |t| (t as i64).min(m));
    let flat = |x: &Tensor| x.view([1, m, -1]);
    let (h_1mh, gate_1mi, up_1mi) = (flat(&h_bth), flat(&gate_bti), flat(&up_bti));
    let y_1mh = h_1mh.empty_like();
    for (start, len) in tiles(m, tile) {
        let rows = |x: &Tensor| x.narrow(1, start, len);
        let a_1ti = model::mlp_glu(spec, &rows(&gate_1mi), &rows(&up_1mi));
        let down =
            rows(&h_1mh) + a_1ti.linear(w.get("mlp.down_proj.weight"), w.opt("mlp.down_proj.bias"));
        rows(&y_1mh).copy_(&down);
    }
    let kept = Kept {
        h_bth,
        gate_bti,
        up_bti,
    };
    (y_1mh.view([b, t, h]), kept)
}

/// Layer `layer`, which kept `kept` in its forward, backpropagated from `dy_bth`: the MLP
/// half from what it kept, in tiles of `tile` tokens (None: whole), then the attention half
/// recomputed with grad from the input `x_bth` and backpropagated. The weight gradients
/// accumulate in `w`'s leaves; returns the input's gradient (B, T, H).
#[allow(clippy::too_many_arguments)]
pub fn backward_kept(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: Tensor,
    kept: Kept,
    dy_bth: Tensor,
    ctx: &Context,
    tile: Option<usize>,
) -> Tensor {
    let mark = kernels::tape::depth();
    let dh_bth = mlp_backward_kept(spec, w, kept, dy_bth, tile, mark);
    let x_bth = x_bth.set_requires_grad(true);
    let h_bth = model::attention_half(spec, layer, w, &x_bth, ctx);
    backpropagate(h_bth, dh_bth, ctx);
    kernels::tape::backward();
    x_bth.grad()
}

/// The MLP half's backward from what it kept, a tile of rows at a time: per tile the norm
/// recomputed with grad from a leaf of h's rows, `act(gate) * up` from leaves of the kept
/// rows, the three projections' gradients by hand; dy's rows become dh's (the residual's
/// dy plus the MLP's share), which it returns.
fn mlp_backward_kept(
    spec: &ModelSpec,
    w: &BlockWeights,
    kept: Kept,
    dy_bth: Tensor,
    tile: Option<usize>,
    mark: usize,
) -> Tensor {
    let (b, t, _) = dy_bth
        .size3()
        .expect("a layer's output gradient is (B, T, H)");
    let m = b * t;
    let tile = tile.map_or(m, |t| (t as i64).min(m));
    let dy_bth = dy_bth.contiguous();
    let flat = |x: &Tensor| x.view([1, m, -1]);
    let (h_1mh, gate_1mi, up_1mi) = (flat(&kept.h_bth), flat(&kept.gate_bti), flat(&kept.up_bti));
    let dy_1mh = flat(&dy_bth);
    for (start, len) in tiles(m, tile) {
        let rows = |x: &Tensor| x.narrow(1, start, len);
        let leaf = |x: &Tensor| rows(x).detach().set_requires_grad(true);
        let (h_leaf, gate_leaf, up_leaf) = (leaf(&h_1mh), leaf(&gate_1mi), leaf(&up_1mi));
        let mut dy_1th = rows(&dy_1mh);
        let a_1ti = model::mlp_glu(spec, &gate_leaf, &up_leaf);
        let (da, mut pairs) = linear_grads(&a_1ti, w, "mlp.down_proj", &dy_1th);
        pairs.push((a_1ti, da));
        kernels::tape::backward_with_grads(pairs);
        kernels::tape::backward_to(mark);
        let n_1th = model::mlp_norm(spec, w, &h_leaf);
        let (dn_gate, mut pairs) = linear_grads(&n_1th, w, "mlp.gate_proj", &gate_leaf.grad());
        let (dn_up, up_pairs) = linear_grads(&n_1th, w, "mlp.up_proj", &up_leaf.grad());
        pairs.extend(up_pairs);
        pairs.push((n_1th, dn_gate + dn_up));
        kernels::tape::backward_with_grads(pairs);
        kernels::tape::backward_to(mark);
        let _ = dy_1th.g_add_(&h_leaf.grad());
    }
    drop(kept);
    dy_bth
}

/// The gradients of `y = x W^T + b` (the linear `name` of `w`) from `dy`, by hand: x's,
/// `dy W` (returned), and (leaf, gradient) pairs for the weight, `dy^T x` over every
/// token, and the bias, `sum(dy)`, where there is one. `x` is the forward's input (its
/// graph, if any, is not touched).
pub(super) fn linear_grads(
    x: &Tensor,
    w: &BlockWeights,
    name: &str,
    dy: &Tensor,
) -> (Tensor, Vec<(Tensor, Tensor)>) {
    let weight = w.get(&format!("{name}.weight"));
    let (i, o) = (x.size()[x.dim() - 1], dy.size()[dy.dim() - 1]);
    let dy_mo = dy.reshape([-1, o]);
    let dw = dy_mo.tr().mm(&x.detach().reshape([-1, i]));
    let mut pairs = vec![(weight.shallow_clone(), dw)];
    if let Some(bias) = w.opt(&format!("{name}.bias")) {
        pairs.push((
            bias.shallow_clone(),
            dy_mo.sum_dim_intlist(0, false, dy.kind()),
        ));
    }
    (dy.matmul(weight), pairs)
}
