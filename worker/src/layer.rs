//! One decoder layer as the engine runs it: whole, or with its MLP half in tiles.
//!
//! The MLP half of a dense layer (post-attention norm, MLP, residual: `model::mlp_half`)
//! computes each token's row from that token's row alone, so it can run over the
//! flattened (B*T) tokens a tile at a time; its (tokens x intermediate) activations, the
//! largest of the layer, are then one tile's instead of the micro-batch's (the tiled MLP of
//! Arctic Long Sequence Training). The tile comes from `memory.tile_tokens` through the
//! device plan (`mt::plan::DevicePlan::new(..).tile`), which counts exactly this schedule:
//!
//! - forward, without grad: the attention half whole, then each tile's MLP half written
//!   over that tile's rows of the half's output;
//! - backward: the attention half recomputed with grad; then per tile, that tile's rows of
//!   its output as a leaf, the MLP half over them with grad, backpropagated at once with
//!   the same rows of dy (the weight gradients accumulate in the block's leaves) and the
//!   leaf's gradient written over those rows of dy, which then holds the gradient of the
//!   attention half's output; then the attention half backpropagated with it.
//!
//! Each tile's graph is freed by its backward before the next tile's is built. A layer the
//! plan keeps whole (`mt::plan::tiled_layer`: a mixture of experts), or a micro-batch no
//! larger than a tile, runs as before: `model::decoder_layer`, one backward; but a layer
//! whose MLP half records fused ops (`model::mlp_on_tape`: the experts' fused glue, a dense
//! MLP's fused SwiGLU) backpropagates its halves one after the other as above, with the MLP
//! half whole.
//!
//! Either way, the fused ops each half ran outside autograd (`crate::kernels`) are
//! backpropagated from the tape once autograd's pass has reached their outputs: the MLP
//! half's by [`mlp_backward`], before the attention half's.
//!
//! In a tiled micro-batch a Gated DeltaNet layer also runs its delta rule in segments of
//! the sequence, carrying its state from one to the next (`segments.rs`; its MLP half as
//! above, in tiles or, for a mixture of experts, whole).
//!
//! Shapes: B batch rows, T sequence length, H hidden size, M = B*T tokens.

use mt::config::hf::ModelSpec;
use tch::Tensor;

use crate::kernels;
use crate::model::{self, BlockWeights, Context, RouterAux};
use crate::segments;

mod kept;
pub use kept::{Kept, backward_kept, forward_keeping};

/// The tile layer `layer` runs its MLP half in for `m` tokens; None: whole.
fn tile_of(spec: &ModelSpec, layer: usize, tile: Option<usize>, m: i64) -> Option<i64> {
    let t = tile? as i64;
    (t < m && mt::plan::tiled_layer(spec, layer)).then_some(t)
}

/// (start, len) of each tile of `t` tokens over `m`.
fn tiles(m: i64, t: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..m)
        .step_by(t as usize)
        .map(move |start| (start, t.min(m - start)))
}

/// Layer `layer` without grad: (B, T, H) -> (B, T, H).
pub fn forward(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    ctx: &Context,
    tile: Option<usize>,
) -> Tensor {
    let (b, t, h) = x_bth.size3().expect("a layer input is (B, T, H)");
    let segment = segments::segment_chunks(spec, layer, tile, (b, t), x_bth.device());
    let tile = tile_of(spec, layer, tile, b * t);
    let h_bth = match (segment, tile) {
        (None, None) => return model::decoder_layer(spec, layer, w, x_bth, ctx),
        (Some(chunks), _) => segments::attention_half(spec, layer, w, x_bth, chunks),
        (None, Some(_)) => model::attention_half(spec, layer, w, x_bth, ctx),
    };
    let Some(tile) = tile else {
        return model::mlp_half(spec, layer, w, &h_bth, ctx);
    };
    let h_1mh = h_bth.view([1, b * t, h]);
    for (start, len) in tiles(b * t, tile) {
        let mut rows_1th = h_1mh.narrow(1, start, len);
        let out_1th = model::mlp_half(spec, layer, w, &rows_1th, ctx);
        rows_1th.copy_(&out_1th);
    }
    h_bth
}

/// Layer `layer` recomputed with grad from its input `x_bth` and backpropagated from
/// `dy_bth`, the gradient of its output: the weight gradients accumulate in `w`'s leaves;
/// returns the input's gradient (B, T, H). A tiled layer reuses dy's memory; a linear
/// layer in a tiled micro-batch runs its delta rule in segments (`segments.rs`).
pub fn backward(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: Tensor,
    dy_bth: Tensor,
    ctx: &Context,
    tile: Option<usize>,
) -> Tensor {
    let (b, t, _) = x_bth.size3().expect("a layer input is (B, T, H)");
    let x_bth = x_bth.set_requires_grad(true);
    let segment = segments::segment_chunks(spec, layer, tile, (b, t), x_bth.device());
    let tile = tile_of(spec, layer, tile, b * t);
    if let Some(chunks) = segment {
        return segments::backward(spec, layer, w, &x_bth, dy_bth, ctx, chunks, tile);
    }
    let split = tile.is_some()
        || model::mlp_on_tape(spec, layer, x_bth.kind(), x_bth.device())
        || model::mlp_ends_in_down(spec, layer);
    if !split {
        let y_bth = model::decoder_layer(spec, layer, w, &x_bth, ctx);
        backpropagate(y_bth, dy_bth, ctx);
        kernels::tape::backward();
        return x_bth.grad();
    }
    let h_bth = model::attention_half(spec, layer, w, &x_bth, ctx);
    let dh_bth = mlp_backward(spec, layer, w, &h_bth.detach(), dy_bth, ctx, tile);
    backpropagate(h_bth, dh_bth, ctx);
    kernels::tape::backward();
    x_bth.grad()
}

/// Layer `layer`'s MLP half recomputed with grad from `h_bth` (the attention half's output,
/// detached) and backpropagated from `dy_bth`, in tiles of `tile` tokens (None: whole),
/// with the fused ops it records (those recorded before, the attention half's, stay on the
/// tape): the weight gradients accumulate in `w`'s leaves; returns h's gradient, in dy's
/// memory when tiled.
pub fn mlp_backward(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    h_bth: &Tensor,
    dy_bth: Tensor,
    ctx: &Context,
    tile: Option<i64>,
) -> Tensor {
    let mark = kernels::tape::depth();
    let Some(tile) = tile else {
        let h_leaf_bth = h_bth.detach().set_requires_grad(true);
        if model::mlp_ends_in_down(spec, layer) {
            let mut dy_bth = dy_bth.contiguous();
            down_backward(spec, layer, w, &h_leaf_bth, &dy_bth, mark);
            let _ = dy_bth.g_add_(&h_leaf_bth.grad());
            return dy_bth;
        }
        let out_bth = model::mlp_half(spec, layer, w, &h_leaf_bth, ctx);
        backpropagate(out_bth, dy_bth, ctx);
        kernels::tape::backward_to(mark);
        return h_leaf_bth.grad();
    };
    let (b, t, h) = h_bth.size3().expect("a half layer's output is (B, T, H)");
    let dy_bth = dy_bth.contiguous();
    let h_1mh = h_bth.view([1, b * t, h]);
    let dy_1mh = dy_bth.view([1, b * t, h]);
    let skip_down = model::mlp_ends_in_down(spec, layer);
    for (start, len) in tiles(b * t, tile) {
        let h_leaf_1th = h_1mh.narrow(1, start, len).detach().set_requires_grad(true);
        let mut dy_1th = dy_1mh.narrow(1, start, len);
        if skip_down {
            down_backward(spec, layer, w, &h_leaf_1th, &dy_1th, mark);
            // dh = dy (the residual) + the MLP's share, over the tile's rows of dy.
            let _ = dy_1th.g_add_(&h_leaf_1th.grad());
            continue;
        }
        let out_1th = model::mlp_half(spec, layer, w, &h_leaf_1th, ctx);
        kernels::tape::backward_with_grads(vec![(out_1th, dy_1th.shallow_clone())]);
        kernels::tape::backward_to(mark);
        // The tile's graph is gone: its rows of dy are free for dh.
        dy_1th.copy_(&h_leaf_1th.grad());
    }
    dy_bth
}

/// The MLP half `h + down_proj(a)` ([`model::mlp_ends_in_down`]) backpropagated from `dy`
/// without its down projection's forward, whose output the backward never reads: `a`
/// recomputed with grad from the leaf `h_leaf`, the projection's gradients by hand
/// ([`kept::linear_grads`]) handed to a's graph and the weights' leaves, and the ops
/// recorded since `mark` run from the tape. Leaves the MLP's share of dh in `h_leaf`'s
/// gradient; the residual's, dy itself, is the caller's to add. This saves a third of the
/// MLP's recomputed matrix work (H x I of 3 H x I per token).
fn down_backward(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    h_leaf: &Tensor,
    dy: &Tensor,
    mark: usize,
) {
    let a = model::mlp_down_input(spec, layer, w, h_leaf);
    let (da, mut pairs) = kept::linear_grads(&a, w, "mlp.down_proj", dy);
    pairs.push((a, da));
    kernels::tape::backward_with_grads(pairs);
    kernels::tape::backward_to(mark);
}

/// Backpropagates `y` (consumed: its memory is not needed by its backward) from its
/// gradient `dy`, with the router load-balancing loss's term of the layer just recomputed
/// where it has one, in one pass.
fn backpropagate(y: Tensor, dy: Tensor, ctx: &Context) {
    let mut pairs = vec![(y, dy)];
    if let Some(aux) = ctx.router_aux.as_ref().and_then(RouterAux::take_term) {
        let one = aux.ones_like();
        pairs.push((aux, one));
    }
    kernels::tape::backward_with_grads(pairs);
}
