//! A Gated DeltaNet layer's attention half with its delta rule in sequence segments.
//!
//! The delta rule's recompute graph is O(T) with a large constant (per chunk of 64 tokens
//! its (C, C) pair tensors in f32, per value head its copies of k and v), more than the
//! rest of the layer at long sequences. But the rule is a recurrence over chunks through a
//! small state S (per row and value head, (Dk, Dv) f32): run over a range of chunks, from
//! the state at its start, it gives that range's output and the state at its end. So in a
//! tiled micro-batch (`mt::plan::DevicePlan::new(..).tile`, worker/src/layer.rs) the
//! attention half of a linear layer runs in three parts (`model::delta_pre`,
//! `model::delta_core`, `model::delta_post`) with the core over segments of whole chunks
//! (`mt::plan::delta_segment`: the tile's share of a row, B rows at once):
//!
//! - forward, without grad: pre over the sequence; the core segment by segment, each from
//!   the state the previous one ended with; post over the sequence;
//! - backward: (1) pre recomputed with grad, its outputs then detached into leaves (its
//!   graph kept for step 5); (2) the core segment by segment without grad, keeping only
//!   each segment's starting state; (3) post (and the residual) with grad from a leaf o,
//!   the MLP half backpropagated (`layer::mlp_backward`), then post with the gradient of
//!   h, giving do and dz; (4) per segment, last first: leaves for its slices of the pre
//!   outputs and its starting state, its core recomputed with grad, backpropagated from
//!   `sum(o_i do_i) + sum(S_{i+1} dS_{i+1})` (the second where a later segment exists), its
//!   slices' gradients written into full-size buffers and dS_i kept; (5) pre backpropagated
//!   from `sum over outputs (out * grad)` into the layer input and the weights.
//!
//! Only one segment's rule graph exists at a time; what stays whole is the pre outputs,
//! their gradients, o, the states and post's graph, all O(T) with small constants.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, V value heads, Dk / Dv their
//! head dims, U chunks of C tokens, suffixed as in `model::gated_delta`.

use mt::config::hf::ModelSpec;
use tch::Tensor;

use crate::kernels;
use crate::layer;
use crate::model::{self, BlockWeights, Context, DeltaPre};

/// The chunks per segment of layer `layer`'s delta rule in a (B, T) micro-batch tiled by
/// `tile` tokens; None: the rule runs whole (not a linear layer, an untiled micro-batch,
/// or one segment would span the sequence).
pub fn segment_chunks(
    spec: &ModelSpec,
    layer: usize,
    tile: Option<usize>,
    (b, t): (i64, i64),
    device: tch::Device,
) -> Option<i64> {
    let tile = tile.filter(|&n| (n as i64) < b * t && model::delta_layer(spec, layer))?;
    let chunk = model::delta_chunk(device);
    let per_segment = mt::plan::delta_segment(tile, b as usize, chunk as usize) as i64 / chunk;
    (per_segment * chunk < t).then_some(per_segment)
}

/// (start, len) in chunks of each segment of `per_segment` chunks over `u`.
fn segments(u: i64, per_segment: i64) -> Vec<(i64, i64)> {
    (0..u)
        .step_by(per_segment as usize)
        .map(|start| (start, per_segment.min(u - start)))
        .collect()
}

/// One segment's slices of the rule's inputs (contiguous: the rule's views need it).
fn slices(rule_in: &[Tensor], (start, len): (i64, i64)) -> Vec<Tensor> {
    rule_in
        .iter()
        .map(|x| x.narrow(2, start, len).contiguous())
        .collect()
}

/// The delta rule over every chunk of `pre`, without grad, in segments of `per_segment`
/// chunks: o (B, V, U, C, Dv) and the state at each segment's start (None: zero, the
/// first).
fn core_in_segments(pre: &DeltaPre, per_segment: i64) -> (Tensor, Vec<Option<Tensor>>) {
    let _guard = tch::no_grad_guard();
    let mut o_bvucd: Option<Tensor> = None;
    let mut starts = vec![None];
    let all = segments(pre.chunks(), per_segment);
    for (i, &(start, len)) in all.iter().enumerate() {
        let more = i + 1 < all.len();
        let state_in = starts[i].as_ref();
        let (o_i, state_out) =
            model::delta_core(&slices(&pre.rule_in, (start, len)), state_in, more);
        // o over the sequence, allocated once the first segment says its dtype.
        let o = o_bvucd.get_or_insert_with(|| {
            let mut shape = o_i.size();
            shape[2] = pre.chunks();
            Tensor::empty(shape.as_slice(), (o_i.kind(), o_i.device()))
        });
        o.narrow(2, start, len).copy_(&o_i);
        if more {
            starts.push(state_out);
        }
    }
    (o_bvucd.expect("at least one segment"), starts)
}

/// The attention half of linear layer `layer` without grad, its delta rule in segments of
/// `per_segment` chunks: (B, T, H) -> (B, T, H).
pub fn attention_half(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    per_segment: i64,
) -> Tensor {
    let pre = model::delta_pre(spec, layer, w, x_bth);
    let (o_bvucd, _) = core_in_segments(&pre, per_segment);
    model::delta_post(spec, layer, w, x_bth, &o_bvucd, &pre.z_btvd)
}

/// Linear layer `layer` recomputed with grad from its input `x_bth` (a leaf that requires
/// grad) and backpropagated from `dy_bth`, its delta rule in segments of `per_segment`
/// chunks and its MLP half in tiles of `mlp_tile` tokens (None: whole): the weight
/// gradients accumulate in `w`'s leaves; returns the input's gradient (B, T, H).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    dy_bth: Tensor,
    ctx: &Context,
    per_segment: i64,
    mlp_tile: Option<i64>,
) -> Tensor {
    // (1), (2): pre with grad; its outputs as plain tensors for the rule without grad.
    let pre = model::delta_pre(spec, layer, w, x_bth);
    let rule_in: Vec<Tensor> = pre.rule_in.iter().map(Tensor::detach).collect();
    let detached = DeltaPre {
        rule_in,
        z_btvd: pre.z_btvd.detach(),
    };
    let (o_bvucd, starts) = core_in_segments(&detached, per_segment);

    // (3): post and the residual from leaves o and z; the MLP half; post backpropagated.
    let o_leaf = o_bvucd.set_requires_grad(true);
    let z_leaf = detached.z_btvd.set_requires_grad(true);
    let mark = kernels::tape::depth();
    let h_bth = model::delta_post(spec, layer, w, x_bth, &o_leaf, &z_leaf);
    let dh_bth = layer::mlp_backward(spec, layer, w, &h_bth.detach(), dy_bth, ctx, mlp_tile);
    kernels::tape::backward_with_grads(vec![(h_bth, dh_bth)]);
    // Post's fused gated norm, where it runs, hands o and z their gradients from the tape.
    kernels::tape::backward_to(mark);
    let do_bvucd = o_leaf.grad();
    let dz_btvd = z_leaf.grad();

    // (4): the segments, last first, each from its starting state and the gradient of
    // the state it hands on.
    let all = segments(detached.chunks(), per_segment);
    tracing::debug!(
        "layer {layer}: delta rule in {} segments of up to {per_segment} chunks",
        all.len()
    );
    let grads: Vec<Tensor> = detached.rule_in.iter().map(Tensor::zeros_like).collect();
    let mut d_state: Option<Tensor> = None;
    for (i, &(start, len)) in all.iter().enumerate().rev() {
        let leaves: Vec<Tensor> = slices(&detached.rule_in, (start, len))
            .into_iter()
            .map(|x| x.set_requires_grad(true))
            .collect();
        let state_in = starts[i]
            .as_ref()
            .map(|s| s.detach().set_requires_grad(true));
        let mark = kernels::tape::depth();
        let (o_i, state_out) = model::delta_core(&leaves, state_in.as_ref(), d_state.is_some());
        let mut pairs = vec![(o_i, do_bvucd.narrow(2, start, len))];
        if let (Some(s), Some(ds)) = (state_out, &d_state) {
            pairs.push((s, ds.shallow_clone()));
        }
        kernels::tape::backward_with_grads(pairs);
        // The segment's recurrence, where it runs from the tape.
        kernels::tape::backward_to(mark);
        for (g, leaf) in grads.iter().zip(&leaves) {
            let g_i = leaf.grad();
            if g_i.defined() {
                g.narrow(2, start, len).copy_(&g_i);
            }
        }
        d_state = state_in.map(|s| s.grad());
    }

    // (5): pre from its outputs' gradients, into the layer input and the weights.
    let mut pairs = vec![(pre.z_btvd, dz_btvd)];
    pairs.extend(pre.rule_in.into_iter().zip(grads));
    pairs.retain(|(out, _)| out.requires_grad());
    kernels::tape::backward_with_grads(pairs);
    kernels::tape::backward();
    x_bth.grad()
}
