//! LLaVA-NeXT's vision side (`LlavaNextForConditionalGeneration`, `model_type: llava_next`):
//! a CLIP vision tower (`vision_config`), the two-layer projector and the `image_newline`
//! embedding, and the any-resolution tiling that sets how many image tokens an image takes.
//! The file format is read leniently with transformers 5.17's defaults for absent keys
//! (`CLIPVisionConfig`, `LlavaNextConfig`); the validated architecture is what the data
//! side counts tokens with and the worker computes (worker/src/model/clip_vision.rs).
//!
//! Any resolution (transformers' `select_best_resolution`, `get_anyres_image_grid_shape`,
//! `unpad_image`, `LlavaNextProcessor._get_number_of_features`): an image of h x w pixels is
//! fitted into the pinpoint (`image_grid_pinpoints`, multiples of the tower's `image_size` S)
//! that keeps most of its pixels and wastes least, cut into S x S tiles, and the whole image
//! resized to S x S goes before them (the base tile). Each tile gives G² patch features
//! (G = S / patch; the class token dropped, `vision_feature_select_strategy: default`); the
//! base tile's are the image's first G² tokens; the other tiles' features, laid out as the
//! pinpoint's grid of (rows G) x (cols G), are cropped back to the image's aspect (the rows
//! or columns the padding filled, evenly from both sides) and each row of the crop is
//! followed by `image_newline`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::hf::Activation;
use crate::error::{Error, Result};

/// The keys of `vision_config` we read; absent keys take `CLIPVisionConfig`'s defaults.
#[derive(Debug, Clone, Deserialize)]
struct HfClipConfig {
    #[serde(default = "d::model_type")]
    model_type: String,
    #[serde(default = "d::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "d::hidden_size")]
    hidden_size: usize,
    #[serde(default = "d::intermediate_size")]
    intermediate_size: usize,
    #[serde(default = "d::num_attention_heads")]
    num_attention_heads: usize,
    #[serde(default = "d::num_channels")]
    num_channels: usize,
    #[serde(default = "d::image_size")]
    image_size: usize,
    #[serde(default = "d::patch_size")]
    patch_size: usize,
    #[serde(default = "d::hidden_act")]
    hidden_act: String,
    #[serde(default = "d::layer_norm_eps")]
    layer_norm_eps: f64,
}

/// transformers' `CLIPVisionConfig` defaults, and `LlavaNextConfig`'s for the wrapper's keys
/// (its vision config when `vision_config` is absent is CLIP ViT-L/14 at 336 pixels).
mod d {
    pub fn model_type() -> String {
        "clip_vision_model".into()
    }
    pub fn num_hidden_layers() -> usize {
        12
    }
    pub fn hidden_size() -> usize {
        768
    }
    pub fn intermediate_size() -> usize {
        3072
    }
    pub fn num_attention_heads() -> usize {
        12
    }
    pub fn num_channels() -> usize {
        3
    }
    pub fn image_size() -> usize {
        224
    }
    pub fn patch_size() -> usize {
        32
    }
    pub fn hidden_act() -> String {
        "quick_gelu".into()
    }
    pub fn layer_norm_eps() -> f64 {
        1e-5
    }
    pub const IMAGE_TOKEN_INDEX: i64 = 32_000;
    pub const FEATURE_LAYER: i64 = -2;
    pub const TEXT_HIDDEN_SIZE: u64 = 4096;
    pub const PINPOINTS: [[u32; 2]; 5] =
        [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]];
}

/// Largest accepted size of any one dimension (a corrupt config must not size a region).
const MAX_DIM: usize = 1 << 20;

/// The projector's tensors' names inside the wrapper (`multi_modal_projector.linear_1.weight`),
/// shared with Gemma 3's ([`super::siglip::PROJECTOR`]).
pub use super::siglip::PROJECTOR;
/// The newline embedding, a vector of the text model's width beside the projector.
pub const IMAGE_NEWLINE: &str = "image_newline";

/// LLaVA-NeXT's CLIP tower, projector and any-resolution settings, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipSpec {
    /// The wrapper's `model_type` (`llava_next`).
    pub model_type: String,
    /// Encoder layers (`num_hidden_layers`); the projector reads the output of
    /// [`Self::layers_run`] of them.
    pub depth: usize,
    /// Width E of the encoder.
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub hidden_act: Activation,
    pub in_channels: usize,
    /// Side S of a tile, in pixels (`image_size`).
    pub image_size: usize,
    pub patch_size: usize,
    pub layer_norm_eps: f64,
    /// `vision_feature_layer`: the index into the tower's hidden states (the embeddings
    /// after `pre_layrnorm`, then each layer's output) the projector reads; negative from
    /// the end.
    pub feature_layer: i64,
    /// `projector_hidden_act`.
    pub projector_act: Activation,
    /// `multimodal_projector_bias`.
    pub projector_bias: bool,
    /// The projector's output width: the text model's hidden size H.
    pub out_hidden_size: usize,
    /// The id of the image tokens (`image_token_index`).
    pub image_token_id: i64,
    /// `image_grid_pinpoints`: the (height, width) an image may be tiled at, multiples of S.
    pub pinpoints: Vec<[u32; 2]>,
}

impl ClipSpec {
    /// The tower and projector of a parsed `llava_next` config.json (`path` names it in
    /// errors).
    pub fn from_json(config: &Value, model_type: &str, path: &Path) -> Result<ClipSpec> {
        let err = |msg: String| Error::ModelConfig {
            path: path.into(),
            msg,
        };
        // LlavaNextConfig's vision config when there is none: CLIP ViT-L/14 at 336 pixels.
        let default_vision = serde_json::json!({"intermediate_size": 4096, "hidden_size": 1024,
            "patch_size": 14, "image_size": 336, "num_hidden_layers": 24,
            "num_attention_heads": 16});
        let raw = match config.get("vision_config") {
            None | Some(Value::Null) => &default_vision,
            Some(v) => v,
        };
        let hf: HfClipConfig = serde_path_to_error::deserialize(raw).map_err(|e| {
            err(format!(
                "`vision_config.{}`: {}",
                e.path().to_string().trim_start_matches('.'),
                e.inner()
            ))
        })?;
        if hf.model_type != "clip_vision_model" {
            return Err(err(format!(
                "`vision_config.model_type`: `{}` is not supported (LLaVA-NeXT's tower here is CLIP's, `clip_vision_model`)",
                hf.model_type
            )));
        }
        let act = |key: &str, name: &str| match name {
            "quick_gelu" => Ok(Activation::QuickGelu),
            "gelu" => Ok(Activation::Gelu),
            "gelu_pytorch_tanh" => Ok(Activation::GeluTanh),
            other => Err(err(format!(
                "`{key}`: `{other}` is not supported (quick_gelu, gelu, gelu_pytorch_tanh)"
            ))),
        };
        let hidden_act = act("vision_config.hidden_act", &hf.hidden_act)?;
        let str_key = |key: &str, default: &str| -> Result<String> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default.into()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(x) => Err(err(format!("`{key}`: expected a string, found {x}"))),
            }
        };
        let projector_act = act(
            "projector_hidden_act",
            &str_key("projector_hidden_act", "gelu")?,
        )?;
        let strategy = str_key("vision_feature_select_strategy", "default")?;
        if strategy != "default" {
            return Err(err(format!(
                "`vision_feature_select_strategy`: `{strategy}` is not supported (`default`: the class token dropped, as the tiles' grid needs)"
            )));
        }
        let feature_layer = match config.get("vision_feature_layer") {
            None | Some(Value::Null) => d::FEATURE_LAYER,
            Some(x) => x.as_i64().ok_or_else(|| {
                err(format!(
                    "`vision_feature_layer`: {x} is not supported (one layer's index; several layers' features concatenated are not yet)"
                ))
            })?,
        };
        let projector_bias = match config.get("multimodal_projector_bias") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(err(format!(
                    "`multimodal_projector_bias`: expected true or false, found {x}"
                )));
            }
        };
        let image_token_id = match config.get("image_token_index") {
            None | Some(Value::Null) => d::IMAGE_TOKEN_INDEX,
            Some(x) => x.as_i64().ok_or_else(|| {
                err(format!(
                    "`image_token_index`: expected an integer, found {x}"
                ))
            })?,
        };
        let out_hidden = match config.get("text_config").and_then(|t| t.get("hidden_size")) {
            None | Some(Value::Null) => d::TEXT_HIDDEN_SIZE,
            Some(x) => x.as_u64().ok_or_else(|| {
                err(format!(
                    "`text_config.hidden_size`: expected a non-negative integer, found {x}"
                ))
            })?,
        };
        let pinpoints = match config.get("image_grid_pinpoints") {
            None | Some(Value::Null) => d::PINPOINTS.to_vec(),
            Some(v) => pinpoints(v).map_err(|m| err(format!("`image_grid_pinpoints`: {m}")))?,
        };
        let spec = ClipSpec {
            model_type: model_type.into(),
            depth: hf.num_hidden_layers,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_heads: hf.num_attention_heads,
            hidden_act,
            in_channels: hf.num_channels,
            image_size: hf.image_size,
            patch_size: hf.patch_size,
            layer_norm_eps: hf.layer_norm_eps,
            feature_layer,
            projector_act,
            projector_bias,
            out_hidden_size: out_hidden as usize,
            image_token_id,
            pinpoints,
        };
        spec.validate().map_err(err)?;
        Ok(spec)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vision_config.num_hidden_layers", self.depth),
            ("vision_config.hidden_size", self.hidden_size),
            ("vision_config.intermediate_size", self.intermediate_size),
            ("vision_config.num_attention_heads", self.num_heads),
            ("vision_config.num_channels", self.in_channels),
            ("vision_config.image_size", self.image_size),
            ("vision_config.patch_size", self.patch_size),
            ("text_config.hidden_size", self.out_hidden_size),
        ];
        for (key, v) in sizes {
            if v == 0 || v > MAX_DIM {
                return Err(format!("`{key}` is {v}, expected 1..={MAX_DIM}"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(format!(
                "`vision_config.hidden_size` {} is not a multiple of `num_attention_heads` {}",
                self.hidden_size, self.num_heads
            ));
        }
        if !self.image_size.is_multiple_of(self.patch_size) {
            return Err(format!(
                "`vision_config.image_size` {} is not a multiple of `patch_size` {}",
                self.image_size, self.patch_size
            ));
        }
        let hidden_states = self.depth as i64 + 1;
        if !(-hidden_states..hidden_states).contains(&self.feature_layer) {
            return Err(format!(
                "`vision_feature_layer` {} is outside the tower's {hidden_states} hidden states",
                self.feature_layer
            ));
        }
        let s = self.image_size as u32;
        if self.pinpoints.is_empty() {
            return Err("`image_grid_pinpoints` is empty".into());
        }
        for p in &self.pinpoints {
            if p.iter()
                .any(|&x| x == 0 || !x.is_multiple_of(s) || x > 64 * s)
            {
                return Err(format!(
                    "`image_grid_pinpoints` holds {p:?}: each side must be a multiple of `vision_config.image_size` {s} (at most 64 tiles), as the tiles are cut"
                ));
            }
        }
        Ok(())
    }

    /// Head dim D.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Patches per side G of a tile.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Patch features of one tile (G²; the class token dropped).
    pub fn tile_features(&self) -> usize {
        self.patches_per_side().pow(2)
    }

    /// Values of one patch: channels x pixels.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.patch_size * self.patch_size
    }

    /// Encoder layers that run: those up to the hidden state `vision_feature_layer` reads
    /// (0: the embeddings after `pre_layrnorm` alone).
    pub fn layers_run(&self) -> usize {
        match self.feature_layer {
            l if l < 0 => (self.depth as i64 + 1 + l) as usize,
            l => l as usize,
        }
    }

    /// Whether the tower's tensor `name` reaches the features: all but the layers after
    /// the one `vision_feature_layer` reads and `post_layernorm` (applied to the class
    /// token alone).
    pub fn reaches_features(&self, name: &str) -> bool {
        if name.starts_with("post_layernorm.") {
            return false;
        }
        let layer = (name.strip_prefix("encoder.layers."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        layer.is_none_or(|l| l < self.layers_run())
    }

    /// The pinpoint an image of `height` x `width` pixels is tiled at, (height, width), as
    /// transformers' `select_best_resolution`: the most of the image's pixels kept once it is
    /// scaled to fit, then the least area wasted; the first such in the list.
    pub fn best_resolution(&self, height: u32, width: u32) -> [u32; 2] {
        let (oh, ow) = (f64::from(height), f64::from(width));
        let original = u64::from(height) * u64::from(width);
        let mut best = self.pinpoints[0];
        let (mut most, mut least_wasted) = (0u64, u64::MAX);
        for &[h, w] in &self.pinpoints {
            let scale = (f64::from(w) / ow).min(f64::from(h) / oh);
            // Python's int() of a positive float: truncation.
            let (dw, dh) = ((ow * scale) as u64, (oh * scale) as u64);
            let effective = (dw * dh).min(original);
            let wasted = u64::from(w) * u64::from(h) - effective;
            if effective > most || (effective == most && wasted < least_wasted) {
                (most, least_wasted, best) = (effective, wasted, [h, w]);
            }
        }
        best
    }

    /// Tiles (rows, columns) of an image of `height` x `width` pixels, the base tile aside.
    pub fn tile_grid(&self, height: u32, width: u32) -> (usize, usize) {
        let [h, w] = self.best_resolution(height, width);
        let s = self.image_size as u32;
        ((h / s) as usize, (w / s) as usize)
    }

    /// Tiles through the tower for one image of `height` x `width` pixels: the base tile
    /// and the pinpoint's.
    pub fn tiles(&self, height: u32, width: u32) -> usize {
        let (r, c) = self.tile_grid(height, width);
        1 + r * c
    }

    /// Where the image's features lie in its tiles' feature grid ((rows x G) x (cols x G)):
    /// (first row, rows, first column, columns) once cropped to the image's aspect, as
    /// transformers' `unpad_image` (and the processor's `_get_unpadded_features`) crop it.
    pub fn unpadded(&self, height: u32, width: u32) -> [usize; 4] {
        let (r, c) = self.tile_grid(height, width);
        let g = self.patches_per_side();
        let (cur_h, cur_w) = (r * g, c * g);
        let (oh, ow) = (f64::from(height), f64::from(width));
        let original_aspect = ow / oh;
        let current_aspect = cur_w as f64 / cur_h as f64;
        if original_aspect > current_aspect {
            let new_h = round7_int(oh * (cur_w as f64 / ow));
            let pad = cur_h.saturating_sub(new_h) / 2;
            [pad, cur_h - 2 * pad, 0, cur_w]
        } else {
            let new_w = round7_int(ow * (cur_h as f64 / oh));
            let pad = cur_w.saturating_sub(new_w) / 2;
            [0, cur_h, pad, cur_w - 2 * pad]
        }
    }

    /// Image tokens of an image of `height` x `width` pixels: the base tile's features,
    /// then the cropped grid's, each row with its newline.
    pub fn image_tokens(&self, height: u32, width: u32) -> usize {
        let [_, rows, _, cols] = self.unpadded(height, width);
        self.tile_features() + rows * (cols + 1)
    }

    /// The most tiles any image takes: the largest pinpoint's, and the base tile.
    pub fn max_tiles(&self) -> usize {
        let s = self.image_size as u32;
        let most = self.pinpoints.iter().map(|[h, w]| (h / s) * (w / s)).max();
        1 + most.unwrap_or(0) as usize
    }

    /// FLOPs of the tower's and projector's forward over one image of `height` x `width`
    /// pixels, as torch's FlopCounterMode counts transformers' over the layers that run
    /// ([`Self::layers_run`]; eager attention): per tile the patch convolution, every layer's
    /// four projections, MLP and attention over the G² + 1 tokens (QK^T and AV, 2 FLOPs per
    /// multiply-add each), and the projector's two Linears over its G² features; norms,
    /// activations and the unpadding not counted.
    pub fn forward_flops(&self, height: u32, width: u32) -> f64 {
        let (e, i) = (self.hidden_size as f64, self.intermediate_size as f64);
        let n = self.tile_features() as f64;
        let t = n + 1.0;
        let layer = 2.0 * t * (4.0 * e * e + 2.0 * e * i) + 4.0 * t * t * e;
        let tile = 2.0 * n * self.patch_len() as f64 * e + self.layers_run() as f64 * layer;
        self.tiles(height, width) as f64 * tile + self.projector_flops(height, width)
    }

    /// FLOPs of the projector's two Linears over one image's tiles (part of
    /// [`Self::forward_flops`]).
    pub fn projector_flops(&self, height: u32, width: u32) -> f64 {
        let (e, h) = (self.hidden_size as f64, self.out_hidden_size as f64);
        let rows = (self.tiles(height, width) * self.tile_features()) as f64;
        2.0 * rows * (e * h + h * h)
    }

    /// Every tensor of the tower, the projector and the newline, with its shape, in
    /// transformers' module order: the tower's named inside it
    /// (`encoder.layers.0.self_attn.k_proj.weight`), the projector's under [`PROJECTOR`],
    /// then [`IMAGE_NEWLINE`].
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, i, p, h) = (
            self.hidden_size,
            self.intermediate_size,
            self.patch_size,
            self.out_hidden_size,
        );
        let mut out = vec![
            ("embeddings.class_embedding".to_string(), vec![e]),
            (
                "embeddings.patch_embedding.weight".into(),
                vec![e, self.in_channels, p, p],
            ),
            (
                "embeddings.position_embedding.weight".into(),
                vec![self.tile_features() + 1, e],
            ),
            ("pre_layrnorm.weight".into(), vec![e]),
            ("pre_layrnorm.bias".into(), vec![e]),
        ];
        for l in 0..self.depth {
            let mut t = |name: &str, shape: Vec<usize>| {
                out.push((format!("encoder.layers.{l}.{name}"), shape))
            };
            for proj in ["k_proj", "v_proj", "q_proj", "out_proj"] {
                t(&format!("self_attn.{proj}.weight"), vec![e, e]);
                t(&format!("self_attn.{proj}.bias"), vec![e]);
            }
            t("layer_norm1.weight", vec![e]);
            t("layer_norm1.bias", vec![e]);
            t("mlp.fc1.weight", vec![i, e]);
            t("mlp.fc1.bias", vec![i]);
            t("mlp.fc2.weight", vec![e, i]);
            t("mlp.fc2.bias", vec![e]);
            t("layer_norm2.weight", vec![e]);
            t("layer_norm2.bias", vec![e]);
        }
        out.push(("post_layernorm.weight".into(), vec![e]));
        out.push(("post_layernorm.bias".into(), vec![e]));
        for (name, shape) in [("linear_1", vec![h, e]), ("linear_2", vec![h, h])] {
            out.push((format!("{PROJECTOR}{name}.weight"), shape));
            if self.projector_bias {
                out.push((format!("{PROJECTOR}{name}.bias"), vec![h]));
            }
        }
        out.push((IMAGE_NEWLINE.into(), vec![h]));
        out
    }
}

/// `image_grid_pinpoints`: a list of (height, width) pairs of positive integers.
pub fn pinpoints(v: &Value) -> std::result::Result<Vec<[u32; 2]>, String> {
    let bad = || format!("expected a list of [height, width] pairs, found {v}");
    let list = v.as_array().ok_or_else(bad)?;
    list.iter()
        .map(|pair| {
            let pair = pair.as_array().filter(|p| p.len() == 2).ok_or_else(bad)?;
            let side = |x: &Value| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(bad)
            };
            Ok([side(&pair[0])?, side(&pair[1])?])
        })
        .collect()
}

/// Python's `int(round(x, 7))` for x >= 0 as the unpadding computes it: x rounded to 7
/// decimals, then truncated. The rounding only matters where x lies within 5e-8 below an
/// integer; x here is a side times a ratio of sides below 2^20 pixels, whose fractional part
/// is a multiple of 1 / side (> 1e-6) up to f64 rounding (~1e-13), so no x falls near the
/// 5e-8 boundary and "an integer within 5e-8, else the floor" is the same function.
fn round7_int(x: f64) -> usize {
    let r = x.round();
    match (x - r).abs() < 5e-8 {
        true => r as usize,
        false => x.floor() as usize,
    }
}

#[cfg(test)]
mod tests;
