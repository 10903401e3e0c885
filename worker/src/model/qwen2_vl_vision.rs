//! Qwen2.5-VL's vision tower and patch merger: the math of transformers'
//! `Qwen2_5_VisionTransformerPretrainedModel`, whose merged output (`pooler_output`) the
//! model places at the image tokens. In two halves, the encoder ([`qwen2_5_vl_encoder`]: up to
//! the merger's input) and the merger ([`qwen2_5_vl_merger`]), so that a frozen encoder runs
//! without grad and a trained merger with it; and the encoder in steps ([`patch_embed`],
//! then each [`vision_block`] over one [`Geometry`]), so that a trained encoder's blocks
//! can be recomputed with grad one at a time. The caller decides (no grad mode is set
//! here).
//!
//! ```text
//! patches (N, P) -> patch embed (a Conv3d whose stride is its kernel: one matmul)
//!   -> reorder into windows (merge^2 patches move together)
//!   -> depth x [x + attn(norm1(x)); x + mlp(norm2(x))]   within windows, or within each
//!                                                          frame at `fullatt_block_indexes`
//!   -> merger: ln_q, merge^2 patches side by side, Linear, GELU, Linear
//!   -> back to raster order
//! ```
//!
//! Rows of `pixel_values` are the image processor's patches: image after image, frame
//! after frame, and inside a frame merge blocks in raster order, the merge^2 patches of a
//! block together. The 2-D rotary embedding rotates half of each head by the patch's row
//! and half by its column. Attention never crosses a segment (a window, or a frame under
//! full attention): the segments are padded to one length and attended in one batch, the
//! padded keys masked.
//!
//! Shapes: N patches, P values per patch (channels x frames x pixels), E tower width,
//! NH heads, D head dim, I MLP width, M = N / merge^2 merged tokens, O output width (the
//! text model's hidden size), S attention segments, L the longest segment.

use std::collections::HashMap;

use mt::config::vision::VisionSpec;
use tch::{Device, Kind, Tensor};

use super::common::{activation, rms_norm};

/// The tower's RMSNorms' epsilon (fixed in transformers' modules, not in the config).
const NORM_EPS: f64 = 1e-6;

/// The tower's tensors, by their names inside it (`blocks.0.attn.qkv.weight`), on the
/// compute device, in the compute dtype: all of them, or those a half reads (the frozen
/// encoder's from the region, a trained merger's from the store).
pub struct VisionWeights {
    pub spec: VisionSpec,
    tensors: HashMap<String, Tensor>,
}

impl VisionWeights {
    /// Each of `tensors` must be one of `spec.tensors()`, of its shape.
    pub fn new(spec: VisionSpec, tensors: HashMap<String, Tensor>) -> VisionWeights {
        let shapes: HashMap<String, Vec<usize>> = spec.tensors().into_iter().collect();
        for (name, t) in &tensors {
            let shape = shapes
                .get(name)
                .unwrap_or_else(|| panic!("`{name}` is not a vision tower tensor"));
            let want: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            assert_eq!(t.size(), want, "shape of vision tensor `{name}`");
        }
        VisionWeights { spec, tensors }
    }

    /// These tensors (the same storage) and `extra`'s: a trained tower's, from the
    /// embedding block, beside the frozen ones from the region.
    pub fn with(&self, extra: Vec<(String, Tensor)>) -> VisionWeights {
        let mut tensors: HashMap<String, Tensor> = (self.tensors.iter())
            .map(|(name, t)| (name.clone(), t.shallow_clone()))
            .collect();
        tensors.extend(extra);
        VisionWeights::new(self.spec.clone(), tensors)
    }

    pub(super) fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("vision weights hold no tensor `{name}`"))
    }

    /// `x W^T + b` with `{name}.weight` and `{name}.bias`.
    pub(super) fn linear(&self, x: &Tensor, name: &str) -> Tensor {
        let b = self.get(&format!("{name}.bias"));
        x.linear(self.get(&format!("{name}.weight")), Some(b))
    }

    pub(super) fn kind(&self) -> Kind {
        self.get("patch_embed.proj.weight").kind()
    }

    pub(super) fn device(&self) -> Device {
        self.get("patch_embed.proj.weight").device()
    }
}

/// The merged features of every image: `pixel_values` (N, P), the rows of the images whose
/// (t, h, w) patch grids are `grids`, in that order -> (M, O), image after image, each
/// image's tokens in raster order of its merge blocks.
pub fn qwen2_5_vl_vision(w: &VisionWeights, pixel_values: &Tensor, grids: &[[u32; 3]]) -> Tensor {
    qwen2_5_vl_merger(w, &qwen2_5_vl_encoder(w, pixel_values, grids))
}

/// A Qwen tower's encoder output over a micro-batch's images: the merger's input.
#[derive(Debug)]
pub struct Encoded {
    /// (N, E): each patch after the last block, in the tower's order (Qwen2.5-VL's window
    /// order, Qwen3-VL's and Qwen3.5's raster order of merge blocks).
    pub x_ne: Tensor,
    /// (M,): for each merged token in raster order, its row of the merger's output; None
    /// where that is the raster order already.
    pub merged_back: Option<Tensor>,
}

/// The patch embedding and every block over `pixel_values` (N, P) of images `grids`.
pub fn qwen2_5_vl_encoder(w: &VisionWeights, pixel_values: &Tensor, grids: &[[u32; 3]]) -> Encoded {
    let geo = Geometry::new(&w.spec, grids, w.device());
    let mut x_ne = patch_embed(w, pixel_values, &geo);
    for b in 0..w.spec.depth {
        x_ne = vision_block(w, b, &x_ne, &geo);
    }
    geo.encoded(x_ne)
}

/// What the tower's steps read of a micro-batch's images besides the weights, built once
/// for its forward and a trained encoder's backward: the window order, each patch's
/// rotary tables, the attention segments, the way back to raster order.
pub struct Geometry {
    /// (N,): the row of `pixel_values` at each position of the window order.
    patches: Tensor,
    /// (N, D) f32 each.
    cos_nd: Tensor,
    sin_nd: Tensor,
    windows: Segments,
    frames: Segments,
    /// (M,): for each merged token in raster order, its row of the merger's output.
    merged_back: Tensor,
    /// Patches (N) and values per patch (P) that `pixel_values` must have.
    shape: [i64; 2],
}

impl Geometry {
    pub fn new(s: &VisionSpec, grids: &[[u32; 3]], device: Device) -> Geometry {
        let order = Order::new(s, grids);
        let idx = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        let (cos_nd, sin_nd) = rotary(s, &order.positions, device);
        Geometry {
            patches: idx(&order.patches),
            cos_nd,
            sin_nd,
            windows: Segments::new(&order.window_lens, device),
            frames: Segments::new(&order.frame_lens, device),
            merged_back: idx(&order.merged_back),
            shape: [order.patches.len() as i64, s.patch_len() as i64],
        }
    }

    /// The encoder's output `x_ne` (N, E), in the window order, as the merger reads it.
    pub fn encoded(&self, x_ne: Tensor) -> Encoded {
        Encoded {
            x_ne,
            merged_back: Some(self.merged_back.shallow_clone()),
        }
    }
}

/// The patch embedding of `pixel_values` (N, P) (a Conv3d whose stride is its kernel: one
/// matmul), its rows in the window order: (N, E), block 0's input.
pub fn patch_embed(w: &VisionWeights, pixel_values: &Tensor, geo: &Geometry) -> Tensor {
    assert_eq!(pixel_values.size(), geo.shape, "pixel_values of the images");
    let e = w.spec.hidden_size as i64;
    // (E, C, Tp, p, p) flattened as a patch row is: the Conv3d over one patch each.
    let w_pe = w.get("patch_embed.proj.weight").reshape([e, -1]);
    pixel_values
        .to_device(w.device())
        .to_kind(w.kind())
        .matmul(&w_pe.tr()) // (N, E)
        .index_select(0, &geo.patches)
}

/// Vision block `b` over `x_ne` (N, E), in the window order: within windows, or within
/// each frame at `fullatt_block_indexes`.
pub fn vision_block(w: &VisionWeights, b: usize, x_ne: &Tensor, geo: &Geometry) -> Tensor {
    let seg = match w.spec.full_attention(b) {
        true => &geo.frames,
        false => &geo.windows,
    };
    block(w, b, x_ne, &geo.cos_nd, &geo.sin_nd, seg)
}

/// The merger over the encoder's output: `ln_q`, merge^2 patches side by side, Linear,
/// GELU, Linear, back to raster order -> (M, O).
pub fn qwen2_5_vl_merger(w: &VisionWeights, enc: &Encoded) -> Tensor {
    let s = &w.spec;
    let merged = (s.merge_unit() * s.hidden_size) as i64;
    let m_mx = rms_norm(&enc.x_ne, w.get("merger.ln_q.weight"), NORM_EPS).reshape([-1, merged]);
    let h_mx = w.linear(&m_mx, "merger.mlp.0").gelu("none");
    let out_mo = w.linear(&h_mx, "merger.mlp.2");
    match &enc.merged_back {
        Some(back) => out_mo.index_select(0, back),
        None => out_mo,
    }
}

/// Vision block `b`: `h = x + attn(norm1(x))`, `out = h + mlp(norm2(h))`: (N, E) -> (N, E).
fn block(
    w: &VisionWeights,
    b: usize,
    x_ne: &Tensor,
    cos_nd: &Tensor,
    sin_nd: &Tensor,
    seg: &Segments,
) -> Tensor {
    let p = format!("blocks.{b}");
    let norm = |x: &Tensor, name: &str| rms_norm(x, w.get(&format!("{p}.{name}.weight")), NORM_EPS);
    let h_ne = x_ne + attention(w, &p, &norm(x_ne, "norm1"), cos_nd, sin_nd, seg);
    &h_ne + mlp(w, &p, &norm(&h_ne, "norm2"))
}

/// The gated MLP, biases included: `down(act(gate(x)) * up(x))`: (N, E) -> (N, E).
fn mlp(w: &VisionWeights, p: &str, x_ne: &Tensor) -> Tensor {
    let gate_ni = w.linear(x_ne, &format!("{p}.mlp.gate_proj"));
    let up_ni = w.linear(x_ne, &format!("{p}.mlp.up_proj"));
    let h_ni = activation(&gate_ni, w.spec.hidden_act) * up_ni;
    w.linear(&h_ni, &format!("{p}.mlp.down_proj"))
}

/// Bidirectional attention within segments, q and k rotated: (N, E) -> (N, E).
fn attention(
    w: &VisionWeights,
    p: &str,
    x_ne: &Tensor,
    cos_nd: &Tensor,
    sin_nd: &Tensor,
    seg: &Segments,
) -> Tensor {
    let s = &w.spec;
    let (n, nh, d) = (x_ne.size()[0], s.num_heads as i64, s.head_dim() as i64);
    let qkv_3nhd = w
        .linear(x_ne, &format!("{p}.attn.qkv"))
        .reshape([n, 3, nh, d])
        .permute([1, 0, 2, 3]);
    let q_nhd = rotate(&qkv_3nhd.get(0), cos_nd, sin_nd);
    let k_nhd = rotate(&qkv_3nhd.get(1), cos_nd, sin_nd);
    let o_nhd = seg.attend(&q_nhd, &k_nhd, &qkv_3nhd.get(2));
    w.linear(&o_nhd.reshape([n, nh * d]), &format!("{p}.attn.proj"))
}

/// RoPE in f32 (`apply_rotary_pos_emb_vision`), cast back: (N, NH, D) -> (N, NH, D).
pub(super) fn rotate(x_nhd: &Tensor, cos_nd: &Tensor, sin_nd: &Tensor) -> Tensor {
    let xf = x_nhd.to_kind(Kind::Float);
    let half = xf.size()[2] / 2;
    let rot = Tensor::cat(
        &[&xf.narrow(2, half, half).neg(), &xf.narrow(2, 0, half)],
        2,
    );
    (xf * cos_nd.unsqueeze(1) + rot * sin_nd.unsqueeze(1)).to_kind(x_nhd.kind())
}

/// cos and sin (N, D) f32 of each patch's (row, column): D / 4 frequencies of the row,
/// D / 4 of the column, the two halves of the head alike.
pub(super) fn rotary(s: &VisionSpec, positions: &[[i64; 2]], device: Device) -> (Tensor, Tensor) {
    let half = (s.head_dim() / 2) as i64;
    // 1 / theta^(2i / (D / 2)), in f32 as transformers computes it.
    let exps_f = Tensor::arange_start_step(0, half, 2, (Kind::Float, device)) / half as f64;
    let inv_freq_f = Tensor::pow_scalar(s.rope_theta, &exps_f).reciprocal();
    let flat: Vec<i64> = positions.iter().flatten().copied().collect();
    let pos_n2 = Tensor::from_slice(&flat)
        .to_device(device)
        .reshape([-1, 2])
        .to_kind(Kind::Float);
    // (N, 2, D / 4) -> (N, D / 2): the row's frequencies, then the column's.
    let freqs = (pos_n2.unsqueeze(-1) * inv_freq_f).reshape([positions.len() as i64, half]);
    let emb_nd = Tensor::cat(&[&freqs, &freqs], -1);
    (emb_nd.cos(), emb_nd.sin())
}

/// Where each patch goes: the window order of transformers' `get_vision_window_index`,
/// each patch's (row, column), and the attention segments in that order.
struct Order {
    /// For each position of the window order, the patch (row of pixel_values) there.
    patches: Vec<i64>,
    /// (row, column) of the patch at each position of the window order.
    positions: Vec<[i64; 2]>,
    /// Patches per window, in order (empty windows dropped).
    window_lens: Vec<i64>,
    /// Patches per frame (full attention's segments).
    frame_lens: Vec<i64>,
    /// For each merged token in raster order, its row in the window order (argsort of the
    /// window index).
    merged_back: Vec<i64>,
}

impl Order {
    fn new(s: &VisionSpec, grids: &[[u32; 3]]) -> Order {
        let (m, unit, win) = (s.spatial_merge_size, s.merge_unit(), s.merge_window());
        let mut window_index = Vec::new(); // merged token (global raster index) per slot
        let mut window_lens = Vec::new();
        let mut frame_lens = Vec::new();
        let mut positions_raster = Vec::new();
        let mut base = 0;
        for &[t, h, w] in grids {
            let (t, h, w) = (t as usize, h as usize, w as usize);
            assert!(
                t > 0 && h > 0 && w > 0 && h.is_multiple_of(m) && w.is_multiple_of(m),
                "image grid {:?} is not made of {m} x {m} merge blocks",
                [t, h, w]
            );
            let (lh, lw) = (h / m, w / m);
            for _ in 0..t {
                frame_lens.push((h * w) as i64);
                // Patch rows of a frame: merge blocks in raster order, each block's
                // patches in raster order inside it.
                for (bh, bw, i, j) in iproduct4(lh, lw, m, m) {
                    positions_raster.push([(bh * m + i) as i64, (bw * m + j) as i64]);
                }
            }
            // Windows of win x win merge blocks over each frame, raster order; partial
            // windows at the bottom and right edges.
            for f in 0..t {
                for wh in 0..lh.div_ceil(win) {
                    for ww in 0..lw.div_ceil(win) {
                        let before = window_index.len();
                        for bh in wh * win..((wh + 1) * win).min(lh) {
                            for bw in ww * win..((ww + 1) * win).min(lw) {
                                window_index.push((base + (f * lh + bh) * lw + bw) as i64);
                            }
                        }
                        window_lens.push(((window_index.len() - before) * unit) as i64);
                    }
                }
            }
            base += t * lh * lw;
        }
        let unit_i = unit as i64;
        let patches: Vec<i64> = window_index
            .iter()
            .flat_map(|&b| (0..unit_i).map(move |k| b * unit_i + k))
            .collect();
        let positions = patches
            .iter()
            .map(|&p| positions_raster[p as usize])
            .collect();
        let mut merged_back = vec![0; window_index.len()];
        for (slot, &b) in window_index.iter().enumerate() {
            merged_back[b as usize] = slot as i64;
        }
        Order {
            patches,
            positions,
            window_lens,
            frame_lens,
            merged_back,
        }
    }
}

/// (a, b, c, d) over 0..na x 0..nb x 0..nc x 0..nd, the last fastest.
pub(super) fn iproduct4(
    na: usize,
    nb: usize,
    nc: usize,
    nd: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..na).flat_map(move |a| {
        (0..nb).flat_map(move |b| (0..nc).flat_map(move |c| (0..nd).map(move |d| (a, b, c, d))))
    })
}

/// Consecutive segments of the rows, padded to the longest (L) to be attended in one
/// batch of S.
pub(super) struct Segments {
    s: i64,
    l: i64,
    /// (S L,): the row at each padded position; N (a zero row appended) where padding.
    gather: Tensor,
    /// (S L,) positions that hold a row, in row order.
    valid: Tensor,
    /// (S, 1, 1, L) true at real keys; None when every segment is L long.
    key_mask: Option<Tensor>,
}

impl Segments {
    pub(super) fn new(lens: &[i64], device: Device) -> Segments {
        let (s, l) = (lens.len() as i64, lens.iter().copied().max().unwrap_or(0));
        let n: i64 = lens.iter().sum();
        let (mut gather, mut valid, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        let mut row = 0;
        for (i, &len) in lens.iter().enumerate() {
            for k in 0..l {
                let real = k < len;
                gather.push(if real { row + k } else { n });
                keys.push(real);
                if real {
                    valid.push(i as i64 * l + k);
                }
            }
            row += len;
        }
        let ragged = lens.iter().any(|&len| len != l);
        Segments {
            s,
            l,
            gather: Tensor::from_slice(&gather).to_device(device),
            valid: Tensor::from_slice(&valid).to_device(device),
            key_mask: ragged.then(|| {
                Tensor::from_slice(&keys)
                    .to_device(device)
                    .reshape([s, 1, 1, l])
            }),
        }
    }

    /// Each row's query attends to the keys of its segment: (N, NH, D) x3 -> (N, NH, D).
    pub(super) fn attend(&self, q_nhd: &Tensor, k_nhd: &Tensor, v_nhd: &Tensor) -> Tensor {
        let (nh, d) = (q_nhd.size()[1], q_nhd.size()[2]);
        let pad = |x: &Tensor| {
            Tensor::cat(&[x, &Tensor::zeros([1, nh, d], (x.kind(), x.device()))], 0)
                .index_select(0, &self.gather)
                .reshape([self.s, self.l, nh, d])
                .transpose(1, 2) // (S, NH, L, D)
        };
        let o_shld = Tensor::scaled_dot_product_attention(
            &pad(q_nhd),
            &pad(k_nhd),
            &pad(v_nhd),
            self.key_mask.as_ref(),
            0.0,
            false,
            None,
            false,
        );
        o_shld
            .transpose(1, 2)
            .reshape([self.s * self.l, nh, d])
            .index_select(0, &self.valid)
    }
}

#[cfg(test)]
mod tests;
