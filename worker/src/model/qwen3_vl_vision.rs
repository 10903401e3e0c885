//! Qwen3-VL's vision tower, patch merger and deepstack mergers: the math of transformers'
//! `Qwen3VLVisionModel`, whose merged output (`pooler_output`) the model places at the image
//! tokens and whose deepstack features (`deepstack_features`) its first decoder layers add
//! there (`Qwen3VLTextModel._deepstack_process`). Qwen3.5's tower (`Qwen3_5VisionModel`) is
//! this one with no deepstack merger (its spec lists none). Frozen, forward only
//! ([`qwen3_vl_vision`]); or in two halves, the encoder ([`qwen3_vl_encoder`]: up to the
//! merger's input, and the deepstack features) and the merger ([`qwen3_vl_merger`]), so that
//! a trained merger (Qwen3.5's) runs with grad; the halves leave grad mode to the caller.
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
use tch::{Kind, Tensor};

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
    let (enc, deepstack_mo) = qwen3_vl_encoder(w, pixel_values, grids);
    Qwen3VlFeatures {
        merged_mo: qwen3_vl_merger(w, &enc),
        deepstack_mo,
    }
}

/// The patch embedding, the learned positions and every block over `pixel_values` (N, P)
/// of images `grids`: the merger's input (in the rows' order, which is the tokens'), and
/// the deepstack features (M, O) each, in the order the language model adds them.
pub fn qwen3_vl_encoder(
    w: &VisionWeights,
    pixel_values: &Tensor,
    grids: &[[u32; 3]],
) -> (Encoded, Vec<Tensor>) {
    let s = &w.spec;
    let (positions, frame_lens) = patch_positions(s, grids);
    let n = positions.len() as i64;
    assert_eq!(
        pixel_values.size(),
        [n, s.patch_len() as i64],
        "pixel_values of grids {grids:?}"
    );
    let (kind, device) = (w.kind(), w.device());
    let e = s.hidden_size as i64;
    // (E, C, Tp, p, p) flattened as a patch row is: the Conv3d over one patch each.
    let w_pe = w.get("patch_embed.proj.weight").reshape([e, -1]);
    let x_ne = pixel_values
        .to_device(device)
        .to_kind(kind)
        .linear(&w_pe, Some(w.get("patch_embed.proj.bias")));
    let mut x_ne = x_ne + learned_positions(w, grids, &positions);
    let (cos_nd, sin_nd) = rotary(s, &positions, device);
    let frames = Segments::new(&frame_lens, device);
    let mut deepstack_mo = Vec::new();
    let mut taps = s.deepstack_taps().into_iter().peekable();
    for b in 0..s.depth {
        x_ne = block(w, b, &x_ne, &cos_nd, &sin_nd, &frames);
        if let Some((_, k)) = taps.next_if(|&(at, _)| at == b) {
            deepstack_mo.push(merger(
                w,
                &format!("deepstack_merger_list.{k}"),
                &x_ne,
                true,
            ));
        }
    }
    let enc = Encoded {
        x_ne,
        merged_back: None,
    };
    (enc, deepstack_mo)
}

/// The merger over the encoder's output: LayerNorm per patch, merge^2 patches side by side,
/// Linear, GELU, Linear -> (M, O), one row per image token in order.
pub fn qwen3_vl_merger(w: &VisionWeights, enc: &Encoded) -> Tensor {
    merger(w, "merger", &enc.x_ne, false)
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

/// The learned position embeddings at each patch (N, E): the (side, side) table resampled
/// to the patch's frame grid (h, w) as `F.interpolate(mode="bilinear", align_corners=True)`
/// does, written as transformers' `get_vision_interpolation_indices_and_weights` computes
/// it: four taps per patch, their weights in f32, the weighted sum in f32, then cast.
fn learned_positions(w: &VisionWeights, grids: &[[u32; 3]], positions: &[[i64; 2]]) -> Tensor {
    let side = w.spec.position_grid_side();
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
    let table_ge = w.get("pos_embed.weight");
    let (kind, device) = (table_ge.kind(), table_ge.device());
    let n = positions.len() as i64;
    let taps_n4e = table_ge
        .index_select(0, &Tensor::from_slice(&idx).to_device(device))
        .view([n, 4, -1])
        .to_kind(Kind::Float);
    let wts_n41 = Tensor::from_slice(&wts).to_device(device).view([n, 4, 1]);
    (taps_n4e * wts_n41)
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
