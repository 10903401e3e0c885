//! Qwen3-VL's vision tower, patch merger and deepstack mergers: the math of transformers'
//! `Qwen3VLVisionModel`, whose merged output (`pooler_output`) the model places at the image
//! tokens and whose deepstack features (`deepstack_features`) its first decoder layers add
//! there (`Qwen3VLTextModel._deepstack_process`). Qwen3.5's tower (`Qwen3_5VisionModel`) is
//! this one with no deepstack merger (its spec lists none). Frozen, forward only
//! ([`qwen3_vl_vision`]); or in parts, the encoder ([`qwen3_vl_encoder`]: up to the merger's
//! input, and the deepstack mergers' inputs), the merger ([`qwen3_vl_merger`]) and the
//! deepstack mergers ([`qwen3_vl_deepstack`]), so that a trained projector runs with grad;
//! and the encoder in steps ([`patch_embed`], then each [`vision_block`] over one
//! [`Geometry`]), so that a trained encoder's blocks are recomputed with grad one at a time.
//! The parts leave grad mode to the caller.
//!
//! ```text
//! patches (N, P) -> patch embed (a Conv3d with bias whose stride is its kernel: one matmul)
//!   + learned position embeddings, bilinearly resampled to each image's grid
//!   -> depth x [x + attn(norm1(x)); x + mlp(norm2(x))]      full attention within each frame
//!        after block deepstack_visual_indexes[k]: deepstack merger k (merge^2 patches side
//!        by side, LayerNorm, Linear, GELU, Linear) -> one deepstack feature
//!   -> merger: LayerNorm, merge^2 patches side by side, Linear, GELU, Linear
//! ```
//!
//! Rows of `pixel_values` are the image processor's patches: image after image, frame after
//! frame, and inside a frame merge blocks in raster order, the merge^2 patches of a block
//! together; with no windows the tower keeps that order throughout, so merged row j is the
//! image's j-th token. The 2-D rotary embedding is Qwen2.5-VL's (half of each head turned by
//! the patch's row, half by its column); attention never crosses a frame (`cu_seqlens`).
//!
//! Shapes: N patches, P values per patch (channels x frames x pixels), E tower width, NH
//! heads, D head dim, I MLP width, M = N / merge^2 merged tokens, O output width (the text
//! model's hidden size), G = side^2 learned positions.

use mt::config::vision::VisionSpec;
use tch::{Device, Kind, Tensor};

use super::common::activation;
use super::qwen2_vl_vision::{Encoded, Segments, VisionWeights, iproduct4, rotary, rotate};

/// The tower's LayerNorms' epsilon (fixed in transformers' modules, not in the config).
const NORM_EPS: f64 = 1e-6;

/// The tower's output for every image: the merged features and the deepstack features.
pub struct Qwen3VlFeatures {
    /// (M, O): one row per image token, image after image, each image's tokens in raster
    /// order of its merge blocks.
    pub merged_mo: Tensor,
    /// (M, O) each, in the order the language model's layers 0, 1, ... add them.
    pub deepstack_mo: Vec<Tensor>,
}

/// The features of every image: `pixel_values` (N, P), the rows of the images whose
/// (t, h, w) patch grids are `grids`, in that order. Forward only, without gradient.
pub fn qwen3_vl_vision(
    w: &VisionWeights,
    pixel_values: &Tensor,
    grids: &[[u32; 3]],
) -> Qwen3VlFeatures {
    let _no_grad = tch::no_grad_guard();
    let (enc, taps) = qwen3_vl_encoder(w, pixel_values, grids);
    Qwen3VlFeatures {
        merged_mo: qwen3_vl_merger(w, &enc),
        deepstack_mo: qwen3_vl_deepstack(w, &taps),
    }
}

/// The patch embedding, the learned positions and every block over `pixel_values` (N, P)
/// of images `grids`: the merger's input (in the rows' order, which is the tokens'), and
/// the deepstack mergers' inputs (N, E) each (the outputs of the blocks they read), in the
/// order the language model adds their features ([`qwen3_vl_deepstack`]).
pub fn qwen3_vl_encoder(
    w: &VisionWeights,
    pixel_values: &Tensor,
    grids: &[[u32; 3]],
) -> (Encoded, Vec<Tensor>) {
    let geo = Geometry::new(&w.spec, grids, w.device());
    let mut x_ne = patch_embed(w, pixel_values, &geo);
    let mut taps_ne = Vec::new();
    let tapped: Vec<usize> = w.spec.deepstack_taps().iter().map(|&(b, _)| b).collect();
    for b in 0..w.spec.depth {
        x_ne = vision_block(w, b, &x_ne, &geo);
        if tapped.contains(&b) {
            taps_ne.push(x_ne.shallow_clone());
        }
    }
    (geo.encoded(x_ne), taps_ne)
}

/// The deepstack features (M, O) each, from their mergers' inputs `taps_ne` (N, E) each (as
/// [`qwen3_vl_encoder`] orders them): with grad where `w`'s tensors or the inputs are leaves
/// and grad mode is on.
pub fn qwen3_vl_deepstack(w: &VisionWeights, taps_ne: &[Tensor]) -> Vec<Tensor> {
    let taps = w.spec.deepstack_taps();
    assert_eq!(taps.len(), taps_ne.len(), "one input per deepstack merger");
    (taps.iter().zip(taps_ne))
        .map(|(&(_, k), x_ne)| merger(w, &format!("deepstack_merger_list.{k}"), x_ne, true))
        .collect()
}

/// The merger over the encoder's output: LayerNorm per patch, merge^2 patches side by side,
/// Linear, GELU, Linear -> (M, O), one row per image token in order.
pub fn qwen3_vl_merger(w: &VisionWeights, enc: &Encoded) -> Tensor {
    merger(w, "merger", &enc.x_ne, false)
}

/// What the tower's steps read of a micro-batch's images besides the weights, built once
/// for its forward and a trained encoder's backward: each patch's four taps into the
/// learned position table and their weights, its rotary tables, the frames.
pub struct Geometry {
    /// (N 4,): the taps' rows of `pos_embed.weight`.
    pos_taps: Tensor,
    /// (N, 4, 1) f32: the taps' weights.
    pos_wts: Tensor,
    /// (N, D) f32 each.
    cos_nd: Tensor,
    sin_nd: Tensor,
    frames: Segments,
    /// Patches (N) and values per patch (P) that `pixel_values` must have.
    shape: [i64; 2],
}

impl Geometry {
    pub fn new(s: &VisionSpec, grids: &[[u32; 3]], device: Device) -> Geometry {
        let (positions, frame_lens) = patch_positions(s, grids);
        let (idx, wts) = position_taps(s, grids, &positions);
        let n = positions.len() as i64;
        let (cos_nd, sin_nd) = rotary(s, &positions, device);
        Geometry {
            pos_taps: Tensor::from_slice(&idx).to_device(device),
            pos_wts: Tensor::from_slice(&wts).to_device(device).view([n, 4, 1]),
            cos_nd,
            sin_nd,
            frames: Segments::new(&frame_lens, device),
            shape: [n, s.patch_len() as i64],
        }
    }

    /// The encoder's output `x_ne` (N, E), in the rows' order, as the merger reads it.
    pub fn encoded(&self, x_ne: Tensor) -> Encoded {
        Encoded {
            x_ne,
            merged_back: None,
        }
    }
}

/// The patch embedding of `pixel_values` (N, P) (a Conv3d with bias whose stride is its
/// kernel: one matmul) plus the learned positions: (N, E), block 0's input.
pub fn patch_embed(w: &VisionWeights, pixel_values: &Tensor, geo: &Geometry) -> Tensor {
    assert_eq!(pixel_values.size(), geo.shape, "pixel_values of the images");
    let e = w.spec.hidden_size as i64;
    // (E, C, Tp, p, p) flattened as a patch row is: the Conv3d over one patch each.
    let w_pe = w.get("patch_embed.proj.weight").reshape([e, -1]);
    let x_ne = pixel_values
        .to_device(w.device())
        .to_kind(w.kind())
        .linear(&w_pe, Some(w.get("patch_embed.proj.bias")));
    x_ne + learned_positions(w, geo)
}

/// Vision block `b` over `x_ne` (N, E): full attention within each frame.
pub fn vision_block(w: &VisionWeights, b: usize, x_ne: &Tensor, geo: &Geometry) -> Tensor {
    block(w, b, x_ne, &geo.cos_nd, &geo.sin_nd, &geo.frames)
}

/// Each patch's (row, column) in its frame, in the rows' order, and the patches per frame.
fn patch_positions(s: &VisionSpec, grids: &[[u32; 3]]) -> (Vec<[i64; 2]>, Vec<i64>) {
    let m = s.spatial_merge_size;
    let (mut positions, mut frame_lens) = (Vec::new(), Vec::new());
    for &[t, h, w] in grids {
        let (t, h, w) = (t as usize, h as usize, w as usize);
        assert!(
            t > 0 && h > 0 && w > 0 && h.is_multiple_of(m) && w.is_multiple_of(m),
            "image grid {:?} is not made of {m} x {m} merge blocks",
            [t, h, w]
        );
        for _ in 0..t {
            frame_lens.push((h * w) as i64);
            for (bh, bw, i, j) in iproduct4(h / m, w / m, m, m) {
                positions.push([(bh * m + i) as i64, (bw * m + j) as i64]);
            }
        }
    }
    (positions, frame_lens)
}

/// Each patch's four taps into the (side, side) learned position table and their weights,
/// (N 4) each: the table resampled to the patch's frame grid (h, w) as
/// `F.interpolate(mode="bilinear", align_corners=True)` does, written as transformers'
/// `get_vision_interpolation_indices_and_weights` computes it (the weights in f32).
fn position_taps(
    s: &VisionSpec,
    grids: &[[u32; 3]],
    positions: &[[i64; 2]],
) -> (Vec<i64>, Vec<f32>) {
    let side = s.position_grid_side();
    let (mut idx, mut wts) = (Vec::new(), Vec::new());
    let mut at = 0;
    for &[t, h, gw] in grids {
        let frame = (h * gw) as usize;
        for _ in 0..t {
            for &[row, col] in &positions[at..at + frame] {
                let (rt, rw) = axis_taps(row as usize, h as usize, side);
                let (ct, cw) = axis_taps(col as usize, gw as usize, side);
                for a in 0..2 {
                    for b in 0..2 {
                        idx.push(rt[a] * side as i64 + ct[b]);
                        wts.push(rw[a] * cw[b]);
                    }
                }
            }
            at += frame;
        }
    }
    (idx, wts)
}

/// The learned position embeddings at each patch (N, E): the four taps' rows of
/// `pos_embed.weight`, their weighted sum in f32, then cast (a gather: its gradient
/// lands in the taps' rows).
fn learned_positions(w: &VisionWeights, geo: &Geometry) -> Tensor {
    let table_ge = w.get("pos_embed.weight");
    let kind = table_ge.kind();
    let n = geo.shape[0];
    let taps_n4e = table_ge
        .index_select(0, &geo.pos_taps)
        .view([n, 4, -1])
        .to_kind(Kind::Float);
    (taps_n4e * &geo.pos_wts)
        .sum_dim_intlist(1, false, Kind::Float)
        .to_kind(kind)
}

/// The two taps into a `side`-long table of target index `index` on an axis `size` long,
/// and their weights: source position index x (side - 1) / (size - 1) (corners aligned),
/// the taps its floor and the next (clamped to the table), the weights 1 - distance.
fn axis_taps(index: usize, size: usize, side: usize) -> ([i64; 2], [f32; 2]) {
    let src = (index as f32 * (side - 1) as f32) / size.saturating_sub(1).max(1) as f32;
    let floor = src.floor();
    let frac = src - floor;
    let last = side as i64 - 1;
    let taps = [floor as i64, floor as i64 + 1].map(|t| t.clamp(0, last));
    let weights = [0.0f32, 1.0].map(|off| (1.0 - (frac - off).abs()).max(0.0));
    (taps, weights)
}

/// LayerNorm of `x` over its last dim with `{name}.weight` and `{name}.bias`.
fn layer_norm(w: &VisionWeights, name: &str, x: &Tensor) -> Tensor {
    let width = *x.size().last().expect("a tensor with a last dim");
    x.layer_norm(
        [width],
        Some(w.get(&format!("{name}.weight"))),
        Some(w.get(&format!("{name}.bias"))),
        NORM_EPS,
        false,
    )
}

/// Vision block `b`: `h = x + attn(norm1(x))`, `out = h + mlp(norm2(h))`: (N, E) -> (N, E).
fn block(
    w: &VisionWeights,
    b: usize,
    x_ne: &Tensor,
    cos_nd: &Tensor,
    sin_nd: &Tensor,
    frames: &Segments,
) -> Tensor {
    let p = format!("blocks.{b}");
    let norm1 = layer_norm(w, &format!("{p}.norm1"), x_ne);
    let h_ne = x_ne + attention(w, &p, &norm1, cos_nd, sin_nd, frames);
    let norm2 = layer_norm(w, &format!("{p}.norm2"), &h_ne);
    let a_ni = activation(
        &w.linear(&norm2, &format!("{p}.mlp.linear_fc1")),
        w.spec.hidden_act,
    );
    &h_ne + w.linear(&a_ni, &format!("{p}.mlp.linear_fc2"))
}

/// Bidirectional attention within each frame, q and k rotated: (N, E) -> (N, E).
fn attention(
    w: &VisionWeights,
    p: &str,
    x_ne: &Tensor,
    cos_nd: &Tensor,
    sin_nd: &Tensor,
    frames: &Segments,
) -> Tensor {
    let s = &w.spec;
    let (n, nh, d) = (x_ne.size()[0], s.num_heads as i64, s.head_dim() as i64);
    let qkv_3nhd = w
        .linear(x_ne, &format!("{p}.attn.qkv"))
        .reshape([n, 3, nh, d])
        .permute([1, 0, 2, 3]);
    let q_nhd = rotate(&qkv_3nhd.get(0), cos_nd, sin_nd);
    let k_nhd = rotate(&qkv_3nhd.get(1), cos_nd, sin_nd);
    let o_nhd = frames.attend(&q_nhd, &k_nhd, &qkv_3nhd.get(2));
    w.linear(&o_nhd.reshape([n, nh * d]), &format!("{p}.attn.proj"))
}

/// A patch merger (`Qwen3VLVisionPatchMerger`): (N, E) -> (M, O). The merger normalises
/// each patch, then sets each merge block's patches side by side; a deepstack merger
/// (`postshuffle`) sets them side by side first and normalises the group.
fn merger(w: &VisionWeights, name: &str, x_ne: &Tensor, postshuffle: bool) -> Tensor {
    let merged = (w.spec.merge_unit() * w.spec.hidden_size) as i64;
    let norm = format!("{name}.norm");
    let x_mx = match postshuffle {
        true => layer_norm(w, &norm, &x_ne.reshape([-1, merged])),
        false => layer_norm(w, &norm, x_ne).reshape([-1, merged]),
    };
    let h_mx = w.linear(&x_mx, &format!("{name}.linear_fc1")).gelu("none");
    w.linear(&h_mx, &format!("{name}.linear_fc2"))
}

#[cfg(test)]
mod tests;
