//! Model math. One architecture family per file, pure functions of (weights, input); the
//! weights are views into a flat block buffer, looked up by their checkpoint names, so no
//! module objects are built and loading needs no renaming table.
//!
//! | file            | transformers model_type                                   |
//! |-----------------|-----------------------------------------------------------|
//! | `llama.rs`      | llama, mistral, qwen2; mixtral, qwen2_moe (MoE MLP)       |
//! | `qwen3.rs`      | qwen3; qwen3_moe, glm4_moe (MoE MLP)                      |
//! | `gemma.rs`      | gemma2, gemma3_text                                       |
//! | `phi3.rs`       | phi3                                                      |
//! | `gpt_oss.rs`    | gpt_oss                                                   |
//! | `qwen3_next.rs` | qwen3_next, qwen3_5_text, qwen3_5_moe_text                |
//! | `olmo2.rs`      | olmo2                                                     |
//! | `glm4.rs`       | glm4                                                      |
//! | `deepseek_v3.rs`| deepseek_v3                                               |
//! | `llama4.rs`     | llama4_text                                               |
//!
//! `qwen2_vl_vision.rs` computes Qwen2.5-VL's vision tower and merger, whose features the
//! model places at the image tokens (block by block where the encoder trains);
//! `qwen3_vl_vision.rs` Qwen3-VL's, whose deepstack features the first layers' outputs also
//! take there ([`add_at_image_tokens`]), and Qwen3.5's (the same tower without deepstack
//! mergers); `siglip_vision.rs` Gemma 3's SigLIP tower and projector (the projector apart where it
//! trains);
//! `clip_vision.rs` LLaVA-NeXT's CLIP tower, projector and image newline over any-resolution
//! tiles; the two share `vit.rs`'s encoder layer. Qwen3-VL's text model (`qwen3_vl_text`) is
//! `qwen3.rs`, Qwen3.5's (`qwen3_5_text`) `qwen3_next.rs`.
//!
//! A multimodal wrapper (gemma3, qwen3_5, ...) computes as its text model's file.
//!
//! Each family's decoder layer comes in two halves around the residual stream between
//! them: the attention half (`h = x + attn(norm1(x))`, with the family's extra norms) and
//! the MLP half (`out = h + mlp(norm2(h))`), which for a dense MLP reads each token's row
//! alone; the engine runs the latter in tiles of tokens (worker/src/layer.rs).
//!
//! `common.rs` holds the pieces they share (norms, attention, embedding, loss),
//! `moe.rs` the sparse mixture-of-experts MLP, `gated_delta.rs` the Gated DeltaNet linear
//! attention and `rope.rs` the rotary embeddings.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, M selected tokens, C tokens in a
//! loss chunk, V vocabulary.

mod clip_vision;
mod common;
mod deepseek_v3;
mod experts;
mod gated_delta;
mod gemma;
mod glm4;
mod gpt_oss;
mod llama;
mod llama4;
mod moe;
mod olmo2;
mod phi3;
mod qwen2_vl_vision;
mod qwen3;
mod qwen3_next;
mod qwen3_vl_vision;
mod rope;
mod siglip_vision;
#[cfg(test)]
mod tests_qwen2_5_vl;
mod vit;

use std::collections::HashMap;

use mt::config::hf::{AttentionKind, Family, ModelSpec};
use mt::config::vision::VisionFamily;
use mt::layout::Block;
use tch::{Device, Kind, Tensor};

pub use clip_vision::{
    ClipWeights, llava_next_embed, llava_next_encoder, llava_next_head, llava_next_layer,
    llava_next_projected, llava_next_vision,
};
pub use moe::RouterAux;
pub use qwen2_vl_vision::{Encoded, VisionWeights, qwen2_5_vl_vision};
pub use qwen3_vl_vision::{qwen3_vl_deepstack, qwen3_vl_vision};
use rope::Rope;
pub use siglip_vision::{
    SiglipWeights, gemma3_embed, gemma3_encoder, gemma3_head, gemma3_layer, gemma3_projected,
    gemma3_vision,
};

/// A vision-language model's frozen tower, of its family.
pub enum TowerWeights {
    Qwen(VisionWeights),
    Siglip(SiglipWeights),
    Clip(ClipWeights),
}

/// A Qwen tower's encoder (all but its merger) over `pixel_values` (N, P) of images
/// `grids`, for a projector that trains (`vlm.freeze_projector: false`): the merger's
/// input, and Qwen3-VL's deepstack mergers' inputs (N, E) each ([`qwen3_vl_deepstack`];
/// none for Qwen2.5-VL and Qwen3.5).
pub fn vision_encoder(
    w: &VisionWeights,
    pixel_values: &Tensor,
    grids: &[[u32; 3]],
) -> (Encoded, Vec<Tensor>) {
    match w.spec.family {
        VisionFamily::Qwen2_5Vl => (
            qwen2_vl_vision::qwen2_5_vl_encoder(w, pixel_values, grids),
            Vec::new(),
        ),
        VisionFamily::Qwen3Vl => qwen3_vl_vision::qwen3_vl_encoder(w, pixel_values, grids),
    }
}

/// What a Qwen tower's steps read of a micro-batch's images besides the weights (its
/// family's), built once for a trained encoder's forward and backward.
pub enum Geometry {
    Qwen2_5Vl(qwen2_vl_vision::Geometry),
    Qwen3Vl(qwen3_vl_vision::Geometry),
}

impl Geometry {
    pub fn new(s: &mt::config::vision::VisionSpec, grids: &[[u32; 3]], device: Device) -> Geometry {
        match s.family {
            VisionFamily::Qwen2_5Vl => {
                Geometry::Qwen2_5Vl(qwen2_vl_vision::Geometry::new(s, grids, device))
            }
            VisionFamily::Qwen3Vl => {
                Geometry::Qwen3Vl(qwen3_vl_vision::Geometry::new(s, grids, device))
            }
        }
    }

    /// The patch embedding of `pixel_values` (N, P) (Qwen3-VL's: with the learned
    /// positions): block 0's input (N, E).
    pub fn patch_embed(&self, w: &VisionWeights, pixel_values: &Tensor) -> Tensor {
        match self {
            Geometry::Qwen2_5Vl(g) => qwen2_vl_vision::patch_embed(w, pixel_values, g),
            Geometry::Qwen3Vl(g) => qwen3_vl_vision::patch_embed(w, pixel_values, g),
        }
    }

    /// Vision block `b` over `x_ne` (N, E).
    pub fn block(&self, w: &VisionWeights, b: usize, x_ne: &Tensor) -> Tensor {
        match self {
            Geometry::Qwen2_5Vl(g) => qwen2_vl_vision::vision_block(w, b, x_ne, g),
            Geometry::Qwen3Vl(g) => qwen3_vl_vision::vision_block(w, b, x_ne, g),
        }
    }

    /// The encoder's output `x_ne` (N, E) as the merger reads it.
    pub fn encoded(&self, x_ne: Tensor) -> Encoded {
        match self {
            Geometry::Qwen2_5Vl(g) => g.encoded(x_ne),
            Geometry::Qwen3Vl(g) => g.encoded(x_ne),
        }
    }
}

/// The merger of a Qwen tower over its encoder's output -> (M, O), one row per image token
/// in order; with grad where `w`'s tensors are leaves and grad mode is on.
pub fn vision_merger(w: &VisionWeights, enc: &Encoded) -> Tensor {
    match w.spec.family {
        VisionFamily::Qwen2_5Vl => qwen2_vl_vision::qwen2_5_vl_merger(w, enc),
        VisionFamily::Qwen3Vl => qwen3_vl_vision::qwen3_vl_merger(w, enc),
    }
}

/// Per-micro-batch tables a model precomputes once for its sequence length T: rotary
/// cos/sin per layer kind and the attention masks (T, T), or (B, 1, T, T) for packed rows,
/// where a token sees only earlier tokens of its own sample; and the router aux loss state,
/// which the forward pass fills and the backward pass reads, so one Context serves both.
pub struct Context {
    rope: Rope,
    /// Sliding-window layers' RoPE where it differs (Gemma 3).
    rope_local: Option<Rope>,
    /// True where a sliding-window layer may attend (causal, same sample, within the
    /// window); None when the window spans the whole sequence.
    sliding_mask: Option<Tensor>,
    /// The causal (same-sample) mask, built for the explicit (soft-capped, sink) attention
    /// and for packed rows; None: SDPA's own causal mask.
    causal_mask: Option<Tensor>,
    /// True where a chunked layer may attend (causal, same sample, same chunk of
    /// positions); None when one chunk spans the whole sequence.
    chunked_mask: Option<Tensor>,
    /// Llama 4's attention temperature per position, (B or 1, 1, T, 1) f32, for NoPE layers.
    temperature_b1t1: Option<Tensor>,
    /// The router load-balancing loss, where the model trains with it (set by the engine,
    /// which knows the micro-batch's padding and its share of the batch).
    pub router_aux: Option<RouterAux>,
}

/// What one layer reads from the context.
pub struct LayerCtx<'a> {
    pub rope: &'a Rope,
    /// True where a query (row) may attend to a key (column); None: plain causal.
    pub mask_tt: Option<&'a Tensor>,
    /// How far back a query sees where `mask_tt` is the sliding window's (`sliding_window`
    /// - 1 positions); None where it sees every earlier key.
    pub window: Option<i64>,
    /// The layer's MLP is a sparse mixture-of-experts block.
    pub sparse: bool,
    /// The router aux loss of the micro-batch, for sparse layers when it is on.
    pub aux: Option<&'a RouterAux>,
    /// Llama 4's attention temperature per position (B or 1, 1, T, 1), f32.
    pub temperature_b1t1: Option<&'a Tensor>,
}

impl Context {
    /// `pos_bt`: per-row positions of packed rows (a sample starts where its position is
    /// 0), or None for positions 0..T.
    pub fn new(
        spec: &ModelSpec,
        seq_len: usize,
        pos_bt: Option<&Tensor>,
        kind: Kind,
        device: Device,
    ) -> Context {
        let t = seq_len as i64;
        let q_t1 = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
        let k_1t = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
        // (B, 1, T, T): query and key in the same sample (sample index = starts so far).
        let same_sample_b1tt = pos_bt.map(|p| {
            let doc_bt = p.eq(0).cumsum(1, Kind::Int64);
            doc_bt
                .unsqueeze(2)
                .eq_tensor(&doc_bt.unsqueeze(1))
                .unsqueeze(1)
        });
        let causal = || match &same_sample_b1tt {
            Some(same) => k_1t.le_tensor(&q_t1).logical_and(same),
            None => k_1t.le_tensor(&q_t1),
        };
        let sliding_mask = spec
            .sliding_window
            .filter(|&w| w < seq_len)
            .map(|w| causal().logical_and(&(&q_t1 - &k_1t).lt(w as i64)));
        // Chunks of positions (a packed sample's own positions, restarting at 0).
        let chunked_mask = spec.attention_chunk.filter(|&c| c < seq_len).map(|c| {
            let c = c as i64;
            let same_chunk = match pos_bt {
                Some(p) => {
                    let chunk_bt = p.divide_scalar_mode(c, "floor");
                    chunk_bt
                        .unsqueeze(2)
                        .eq_tensor(&chunk_bt.unsqueeze(1))
                        .unsqueeze(1)
                }
                None => q_t1
                    .divide_scalar_mode(c, "floor")
                    .eq_tensor(&k_1t.divide_scalar_mode(c, "floor")),
            };
            causal().logical_and(&same_chunk)
        });
        let explicit = spec.attn_softcap.is_some() || spec.attn_sinks || pos_bt.is_some();
        // Length-dependent RoPE variants (dynamic NTK, LongRoPE) scale by the longest
        // position + 1, as transformers does: for packed rows, the longest sample.
        let rope_len = pos_bt.map_or(seq_len, |p| p.max().int64_value(&[]) as usize + 1);
        // Llama 4 rotates in f32, then casts back.
        let rope_kind = match spec.family {
            Family::Llama4 => Kind::Float,
            _ => kind,
        };
        let rope = |r| {
            Rope::new(
                r,
                spec.rope_interleaved,
                rope_len,
                pos_bt,
                rope_kind,
                device,
            )
        };
        let temperature_b1t1 =
            spec.llama4
                .as_ref()
                .and_then(|a| a.temperature)
                .map(|(floor, scale)| {
                    let pos_bt = match pos_bt {
                        Some(p) => p.to_kind(Kind::Float),
                        None => Tensor::arange(t, (Kind::Float, device)).unsqueeze(0),
                    };
                    let steps_bt = ((pos_bt + 1.0) / floor).floor();
                    (steps_bt.log1p() * scale + 1.0).unsqueeze(1).unsqueeze(-1)
                });
        Context {
            rope: rope(&spec.rope),
            rope_local: spec.rope_local.as_ref().map(rope),
            sliding_mask,
            causal_mask: explicit.then(causal),
            chunked_mask,
            temperature_b1t1,
            router_aux: None,
        }
    }

    /// The rotary tables of Qwen2.5-VL's or Qwen3-VL's 3-D positions `pos_3bt` (3, B, T) (`mt::mrope`)
    /// in place of the 1-D ones; the masks stay as built (rows right-padded, or packed by
    /// their 1-D positions).
    pub fn with_positions_3d(
        mut self,
        spec: &ModelSpec,
        pos_3bt: &Tensor,
        kind: Kind,
        device: Device,
    ) -> Context {
        let m = spec
            .mrope
            .as_ref()
            .expect("3-D positions only for a model with mrope");
        self.rope = Rope::mrope(&spec.rope, &m.pair_axes(), pos_3bt, kind, device);
        self
    }

    /// The masks with Gemma 3's image blocks: each image's tokens also see each other
    /// (later ones too), as transformers' `create_masks_for_vision_model` builds them from
    /// the blocks (`block_bt` (B, T): an image's run index in its row, -1 for text): full
    /// layers `causal | same block`, sliding layers `(causal | same block) & window` (the
    /// window cuts inside a block too). Rows are right-padded and not packed (padding is
    /// never an image token, so no real query sees it); the masks become (B, 1, T, T).
    pub fn with_image_blocks(mut self, spec: &ModelSpec, block_bt: &Tensor) -> Context {
        let (t, device) = (block_bt.size()[1], block_bt.device());
        let q_t1 = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
        let k_1t = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
        let same_b1tt = block_bt
            .unsqueeze(2)
            .eq_tensor(&block_bt.unsqueeze(1))
            .logical_and(&block_bt.ge(0).unsqueeze(2))
            .unsqueeze(1);
        let full_b1tt = k_1t.le_tensor(&q_t1).logical_or(&same_b1tt);
        self.sliding_mask = spec
            .sliding_window
            .filter(|&w| (w as i64) < t)
            .map(|w| full_b1tt.logical_and(&(&q_t1 - &k_1t).lt(w as i64)));
        self.causal_mask = Some(full_b1tt);
        self
    }

    /// The RoPE and mask of layer `layer`.
    fn layer(&self, spec: &ModelSpec, layer: usize) -> LayerCtx<'_> {
        let sparse = spec.is_sparse(layer);
        let aux = self.router_aux.as_ref().filter(|_| sparse);
        let causal = self.causal_mask.as_ref();
        // Linear layers read neither RoPE nor a mask; they are causal by construction.
        let (rope, mask_tt, window) = match spec.layer_types[layer] {
            AttentionKind::Full | AttentionKind::Linear => (&self.rope, causal, None),
            AttentionKind::Sliding => (
                self.rope_local.as_ref().unwrap_or(&self.rope),
                self.sliding_mask.as_ref().or(causal),
                self.sliding_mask
                    .as_ref()
                    .and(spec.sliding_window)
                    .map(|w| w as i64 - 1),
            ),
            AttentionKind::Chunked => (&self.rope, self.chunked_mask.as_ref().or(causal), None),
        };
        LayerCtx {
            rope,
            mask_tt,
            window,
            sparse,
            aux,
            temperature_b1t1: self.temperature_b1t1.as_ref(),
        }
    }
}

// The family dispatch: the engine calls only these; `spec.family` picks the file.

/// Token embedding: ids (B, T) -> (B, T, H).
pub fn embed(spec: &ModelSpec, w: &BlockWeights, ids_bt: &Tensor) -> Tensor {
    common::embed(spec, w, ids_bt)
}

/// Image features (M, H), one row per image token in row-major order (the vision tower's
/// output for the micro-batch's images, in the order their tokens appear), in place of the
/// embeddings `e_bth` (B, T, H) of the tokens whose id `ids_bt` (B, T) is `image_token_id`,
/// as transformers' `masked_scatter` places them. The embedding's gradient at those rows is
/// then 0; the gradient there flows into the features (a trained projector's leaves) where
/// they have a graph. None: `e_bth` unchanged.
pub fn place_image_features(
    ids_bt: &Tensor,
    e_bth: Tensor,
    features_mh: Option<&Tensor>,
    image_token_id: i64,
) -> Result<Tensor, PlaceError> {
    let Some(f_mh) = features_mh else {
        return Ok(e_bth);
    };
    let mask_bt = ids_bt.eq(image_token_id);
    let tokens = mask_bt.sum(Kind::Int64).int64_value(&[]);
    let (m, h) = (f_mh.size()[0], f_mh.size()[f_mh.dim() - 1]);
    let width = e_bth.size()[2];
    if f_mh.dim() != 2 || m != tokens || h != width {
        return Err(PlaceError {
            tokens,
            width,
            features: f_mh.size(),
        });
    }
    let f_mh = f_mh.to_kind(e_bth.kind()).to_device(e_bth.device());
    Ok(e_bth.masked_scatter(&mask_bt.unsqueeze(-1), &f_mh))
}

/// `x_bth` (B, T, H) with `f_mh` (M, H) added at the rows `rows_m` (M,) of its flattened
/// (B T, H) view, the image tokens' in order: Qwen3-VL's deepstack, as transformers'
/// `_deepstack_process` adds a feature after each of the first decoder layers. The sum is
/// elementwise, so equal to theirs bit for bit; its gradient with respect to `x_bth` is the
/// identity, and with respect to `f_mh` the rows `rows_m` of it (which the engine's
/// backward gathers where the tower trains: [`crate::engine::MicroImages`]).
pub fn add_at_image_tokens(x_bth: &Tensor, rows_m: &Tensor, f_mh: &Tensor) -> Tensor {
    let (b, t, h) = x_bth.size3().expect("(B, T, H) hidden states");
    x_bth
        .reshape([b * t, h])
        .index_add(0, rows_m, &f_mh.to_kind(x_bth.kind()))
        .view([b, t, h])
}

/// Image features that do not fit the micro-batch's image tokens.
#[derive(Debug)]
pub struct PlaceError {
    pub tokens: i64,
    pub width: i64,
    pub features: Vec<i64>,
}

impl std::fmt::Display for PlaceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "image features of shape {:?} for {} image tokens of width {}",
            self.features, self.tokens, self.width
        )
    }
}

impl std::error::Error for PlaceError {}

/// Decoder layer `layer` (0-based): (B, T, H) -> (B, T, H), its attention half then its
/// MLP half.
pub fn decoder_layer(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    ctx: &Context,
) -> Tensor {
    let h_bth = attention_half(spec, layer, w, x_bth, ctx);
    mlp_half(spec, layer, w, &h_bth, ctx)
}

/// The token-mixing half of decoder layer `layer`, up to the residual stream between the
/// halves: `h = x + attn(norm1(x))` (with the family's extra norms; linear attention in a
/// Gated DeltaNet layer): (B, T, H) -> (B, T, H).
pub fn attention_half(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    ctx: &Context,
) -> Tensor {
    let lc = ctx.layer(spec, layer);
    match spec.family {
        Family::Llama => llama::attention_half(spec, w, x_bth, &lc),
        Family::Glm4 => glm4::attention_half(spec, w, x_bth, &lc),
        Family::Qwen3 => qwen3::attention_half(spec, w, x_bth, &lc),
        Family::Gemma => gemma::attention_half(spec, w, x_bth, &lc),
        Family::Phi3 => phi3::attention_half(spec, w, x_bth, &lc),
        Family::GptOss => gpt_oss::attention_half(spec, w, x_bth, &lc),
        Family::Qwen3Next => {
            let linear = spec.layer_types[layer] == AttentionKind::Linear;
            qwen3_next::attention_half(spec, w, x_bth, &lc, linear)
        }
        Family::Olmo2 => olmo2::attention_half(spec, w, x_bth, &lc),
        Family::DeepseekV3 => deepseek_v3::attention_half(spec, w, x_bth, &lc),
        Family::Llama4 => llama4::attention_half(spec, layer, w, x_bth, &lc),
    }
}

pub use gated_delta::{Pre as DeltaPre, chunk_tokens as delta_chunk, core as delta_core};

/// Linear-attention layer `layer`'s attention half up to its delta rule (the norm, the
/// projections, the causal conv, the q/k norms and gates): (B, T, H) -> the rule's inputs
/// and z. With [`delta_core`] and [`delta_post`], [`attention_half`] in three parts
/// (worker/src/segments.rs).
pub fn delta_pre(spec: &ModelSpec, layer: usize, w: &BlockWeights, x_bth: &Tensor) -> DeltaPre {
    assert!(delta_layer(spec, layer), "layer {layer} has no delta rule");
    qwen3_next::linear_pre(spec, w, x_bth)
}

/// Linear-attention layer `layer`'s attention half from its delta rule's output o (B, V,
/// U, C, Dv) and z: `h = x + post(o, z)` (B, T, H).
pub fn delta_post(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    x_bth: &Tensor,
    o_bvucd: &Tensor,
    z_btvd: &Tensor,
) -> Tensor {
    assert!(delta_layer(spec, layer), "layer {layer} has no delta rule");
    qwen3_next::linear_post(spec, w, x_bth, o_bvucd, z_btvd)
}

/// Whether layer `layer` mixes tokens with Gated DeltaNet (a state carried across chunks).
pub fn delta_layer(spec: &ModelSpec, layer: usize) -> bool {
    spec.family == Family::Qwen3Next && spec.layer_types[layer] == AttentionKind::Linear
}

/// Whether layer `layer`'s MLP half is `h + mlp.down_proj(a)`, the projection's output read
/// by nothing but the residual add (the dense MLPs of Llama, Mistral, Qwen2, Qwen3,
/// DeepSeek-V3, Phi-3, Qwen3-Next and Qwen3.5; not where a norm follows the MLP, as in
/// Gemma, OLMo 2 and GLM-4,
/// nor a mixture of experts): its backward needs the projection's input `a`
/// ([`mlp_down_input`]), never its output, so the recompute skips the projection
/// (worker/src/layer.rs).
pub fn mlp_ends_in_down(spec: &ModelSpec, layer: usize) -> bool {
    let dense = !(spec.moe.is_some() && spec.is_sparse(layer));
    dense
        && matches!(
            spec.family,
            Family::Llama | Family::Qwen3 | Family::DeepseekV3 | Family::Phi3 | Family::Qwen3Next
        )
}

/// The input of `mlp.down_proj` in layer `layer`'s MLP half, from the half's input `h_bth`
/// (B, T, H) -> (B, T, I): the half is `h + down_proj(a)` ([`mlp_ends_in_down`]).
pub fn mlp_down_input(spec: &ModelSpec, layer: usize, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    assert!(
        mlp_ends_in_down(spec, layer),
        "layer {layer}'s MLP half has more after its down projection"
    );
    let mlp_in_bth = mlp_norm(spec, w, h_bth);
    match spec.family {
        Family::Phi3 => common::fused_gated_act(w, spec, &mlp_in_bth, "mlp"),
        _ => common::dense_mlp_act(w, spec, &mlp_in_bth, "mlp"),
    }
}

/// The norm before the MLP of a layer that [`mt::plan::keeps_mlp`]: (B, T, H) -> (B, T, H).
pub fn mlp_norm(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> Tensor {
    let norm_w = w.get("post_attention_layernorm.weight");
    match spec.family {
        // Qwen3-Next and Qwen3.5 scale by `1 + w`.
        Family::Qwen3Next => common::rms_norm_plus_one(h_bth, norm_w, spec.rms_norm_eps),
        _ => common::rms_norm(h_bth, norm_w, spec.rms_norm_eps),
    }
}

/// The gate and up projections of a layer that [`mt::plan::keeps_mlp`], from the MLP
/// half's input `h_bth`: (B, T, H) -> two (B, T, I).
pub fn mlp_gate_up(spec: &ModelSpec, w: &BlockWeights, h_bth: &Tensor) -> (Tensor, Tensor) {
    let n_bth = mlp_norm(spec, w, h_bth);
    (
        common::linear(&n_bth, w, "mlp.gate_proj"),
        common::linear(&n_bth, w, "mlp.up_proj"),
    )
}

/// `act(gate) * up`, the down projection's input, as the dense MLP computes it.
pub fn mlp_glu(spec: &ModelSpec, gate: &Tensor, up: &Tensor) -> Tensor {
    common::glu(spec, gate, up)
}

/// Whether layer `layer`'s MLP half over activations of `kind` on `device` may record ops
/// on the kernels' tape (a mixture of experts with the fused combine,
/// `experts::fused_combine`; a dense SiLU MLP with the fused SwiGLU,
/// `common::dense_mlp_named`): its backward must then run on its own, from a leaf, before
/// the attention half's (worker/src/layer.rs).
pub fn mlp_on_tape(spec: &ModelSpec, layer: usize, kind: Kind, device: Device) -> bool {
    match spec.moe.is_some() && spec.is_sparse(layer) {
        true => experts::fused_combine(spec.hidden_size as i64, kind, device),
        false => {
            spec.hidden_act == mt::config::hf::Activation::Silu
                && crate::kernels::swiglu_enabled(kind, device)
        }
    }
}

/// The token-wise half of decoder layer `layer`: `out = h + mlp(norm2(h))` (with the
/// family's extra norms): (B, T, H) -> (B, T, H). A dense layer computes each token's row
/// from that token's row of `h` alone, so it may run on any subset of the tokens, as
/// (1, tile, H) (`mt::plan::tiled_layer`); a mixture of experts needs the whole micro-batch
/// (its router's load-balancing loss).
pub fn mlp_half(
    spec: &ModelSpec,
    layer: usize,
    w: &BlockWeights,
    h_bth: &Tensor,
    ctx: &Context,
) -> Tensor {
    let lc = ctx.layer(spec, layer);
    match spec.family {
        // Qwen3's and DeepSeek-V3's differ from Llama's in the attention only.
        Family::Llama | Family::Qwen3 | Family::DeepseekV3 => llama::mlp_half(spec, w, h_bth, &lc),
        Family::Qwen3Next => qwen3_next::mlp_half(spec, w, h_bth, &lc),
        Family::Gemma => gemma::mlp_half(spec, w, h_bth),
        Family::Phi3 => phi3::mlp_half(spec, w, h_bth),
        Family::GptOss => gpt_oss::mlp_half(spec, w, h_bth, &lc),
        Family::Olmo2 => olmo2::mlp_half(spec, w, h_bth),
        Family::Glm4 => glm4::mlp_half(spec, w, h_bth),
        Family::Llama4 => llama4::mlp_half(spec, w, h_bth, &lc),
    }
}

/// Final norm of selected hidden states (M, H) -> (M, H).
pub fn final_norm(spec: &ModelSpec, head: &BlockWeights, h_mh: &Tensor) -> Tensor {
    match spec.family {
        Family::Gemma | Family::Qwen3Next => gemma::final_norm(spec, head, h_mh),
        Family::GptOss | Family::Olmo2 => {
            common::rms_norm_f32_scale(h_mh, head.get("model.norm.weight"), spec.rms_norm_eps)
        }
        Family::Llama
        | Family::Qwen3
        | Family::Phi3
        | Family::Glm4
        | Family::DeepseekV3
        | Family::Llama4 => {
            common::rms_norm(h_mh, head.get("model.norm.weight"), spec.rms_norm_eps)
        }
    }
}

/// Summed token cross-entropy of one chunk of normed hidden states (C, H) against targets.
pub fn chunk_loss_sum(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
) -> Tensor {
    common::chunk_loss_sum(spec, h_ch, lm_head_vh, targets_c)
}

/// Each token's cross-entropy (C,) of one chunk of normed hidden states (C, H).
pub fn chunk_token_losses(
    spec: &ModelSpec,
    h_ch: &Tensor,
    lm_head_vh: &Tensor,
    targets_c: &Tensor,
) -> Tensor {
    common::chunk_token_losses(spec, h_ch, lm_head_vh, targets_c)
}

/// Logits of normed hidden states (M, H) -> (M, V) in the compute dtype (what
/// [`logits`] upcasts).
pub fn compute_logits(spec: &ModelSpec, h_mh: &Tensor, lm_head_vh: &Tensor) -> Tensor {
    common::compute_logits(spec, h_mh, lm_head_vh)
}

/// Logits of normed hidden states (M, H) -> (M, V), f32.
pub fn logits(spec: &ModelSpec, h_mh: &Tensor, lm_head_vh: &Tensor) -> Tensor {
    common::logits(spec, h_mh, lm_head_vh)
}

/// The tensors of one layout block, as views into its flat buffer. Where the block's
/// experts run grouped ([`experts::grouped`]), each per-expert tensor is one
/// (E, rows, cols) stack over all experts instead (`Block::expert_stacks`), read with
/// [`BlockWeights::get`] under the stack's name; the per-expert names then exist only for
/// their gradients ([`BlockWeights::grad`]).
pub struct BlockWeights {
    tensors: HashMap<String, Tensor>,
    /// A per-expert tensor name -> (its stack's name, expert index).
    in_stack: HashMap<String, (String, i64)>,
    /// The block's experts run as grouped GEMMs.
    grouped: bool,
}

impl BlockWeights {
    /// Plain views (forward without grad).
    pub fn views(flat: &Tensor, block: &Block) -> BlockWeights {
        Self::build(flat, block, false)
    }

    /// Each view detached into its own leaf that requires grad (recompute + backward).
    pub fn leaves(flat: &Tensor, block: &Block) -> BlockWeights {
        Self::build(flat, block, true)
    }

    fn build(flat: &Tensor, block: &Block, grad: bool) -> BlockWeights {
        let leaf = |v: Tensor| match grad {
            true => v.detach().set_requires_grad(true),
            false => v,
        };
        let mut tensors = HashMap::new();
        let mut in_stack = HashMap::new();
        let stacks = block.expert_stacks();
        let grouped = experts::grouped(block, &stacks, flat.kind(), flat.device());
        if grouped {
            for s in stacks {
                let shape: Vec<i64> = s.shape.iter().map(|&d| d as i64).collect();
                let (rows, cols) = (shape[0], shape[1]);
                let span = (s.experts - 1) * s.stride + s.shape.iter().product::<usize>();
                // (E, rows, cols) over the copies, in place: expert e's starts e * stride on.
                let v = flat.narrow(0, s.offset as i64, span as i64).as_strided(
                    [s.experts as i64, rows, cols],
                    [s.stride as i64, cols, 1],
                    None,
                );
                for e in 0..s.experts {
                    in_stack.insert(s.member(e), (s.name.clone(), e as i64));
                }
                tensors.insert(s.name, leaf(v));
            }
        }
        for t in &block.tensors {
            if in_stack.contains_key(&t.name) {
                continue;
            }
            let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
            let v = flat
                .narrow(0, t.offset as i64, t.numel() as i64)
                .view(shape.as_slice());
            tensors.insert(t.name.clone(), leaf(v));
        }
        BlockWeights {
            tensors,
            in_stack,
            grouped,
        }
    }

    /// Whether the block's experts run as grouped GEMMs over stacked weights.
    pub fn grouped_experts(&self) -> bool {
        self.grouped
    }

    /// The block's tensors plus `extra` (a layer's buffers, which the block does not hold).
    pub fn with(mut self, extra: &[(String, Tensor)]) -> BlockWeights {
        for (name, t) in extra {
            self.tensors.insert(name.clone(), t.shallow_clone());
        }
        self
    }

    /// The tensor named `name`; the layout guarantees it exists for this family.
    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("layout block has no tensor `{name}`"))
    }

    pub fn opt(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The gradient of tensor `name` (a view into its stack's for a stacked expert
    /// tensor); None if it received none.
    pub fn grad(&self, name: &str) -> Option<Tensor> {
        let g = match self.in_stack.get(name) {
            Some((stack, e)) => {
                let g = self.get(stack).grad();
                g.defined().then(|| g.select(0, *e))
            }
            None => Some(self.get(name).grad()),
        };
        g.filter(Tensor::defined)
    }

    /// Copies the gradients inside `part` (a range of the block's elements,
    /// `Layout::grad_parts`) into `out`, the flat slab slot holding that part: each leaf's
    /// share at its offset in the part; a leaf that received no gradient is written as zeros.
    pub fn write_grads(&self, block: &Block, part: std::ops::Range<usize>, out: &Tensor) {
        for (t, within) in block.part_tensors(part.clone()) {
            let (at, n) = (t.offset + within.start - part.start, within.len() as i64);
            let mut dst = out.narrow(0, at as i64, n);
            match self.grad(&t.name) {
                Some(g) => {
                    dst.copy_(&g.reshape([-1]).narrow(0, within.start as i64, n));
                }
                None => {
                    let _ = dst.zero_();
                }
            }
        }
    }
}
