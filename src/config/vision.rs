//! A multimodal checkpoint's vision tower, from config.json's `vision_config`: the file
//! format (`HfVisionConfig`, lenient, transformers' defaults for absent keys) and the
//! validated architecture (`VisionSpec`) the launcher lays out and the worker computes
//! (worker/src/model/qwen2_vl_vision.rs, qwen3_vl_vision.rs): Qwen2.5-VL's, Qwen3-VL's and
//! Qwen3.5's (Qwen3-VL's tower without its deepstack mergers: `Qwen3_5VisionModel`); and
//! [`TowerSpec`], the tower of any family the worker computes: Qwen's (this file), Gemma 3's
//! SigLIP encoder and projector ([`siglip`]) or LLaVA-NeXT's CLIP tower, projector and
//! any-resolution tiles ([`clip`]).
//!
//! The tower is frozen: it is carried, not trained (`layout::CarryRule`), and reaches the
//! workers in a read-only region of its own (`checkpoint::vision`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::TowerTraining;
use super::hf::Activation;
use crate::error::{Error, Result};

pub mod clip;
pub mod siglip;

use clip::ClipSpec;
use siglip::SiglipSpec;

/// The model types whose vision tower the worker computes.
pub const VISION_MODEL_TYPES: &[&str] = &[
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "llava_next",
];

/// A vision-language model's frozen tower, of the family its `model_type` names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TowerSpec {
    /// Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's towers and mergers.
    Qwen(VisionSpec),
    /// Gemma 3's SigLIP encoder and multimodal projector.
    Siglip(SiglipSpec),
    /// LLaVA-NeXT's CLIP tower, projector and `image_newline`.
    Clip(ClipSpec),
}

/// The hub's prefix of Gemma 3's SigLIP and LLaVA-NeXT's CLIP tower as transformers 5.17
/// writes it (`vision_tower.encoder.layers.0.mlp.fc1.weight`); transformers 5's current
/// names keep it under `model.`.
pub const VIT_TOWER: &str = "vision_tower.";

/// Whether the tower's tensor `name` (as [`TowerSpec::tensors`] names it) sits beside the
/// tower under the wrapper's own prefix (the projector, LLaVA-NeXT's `image_newline`)
/// rather than inside the tower.
pub fn beside_tower(name: &str) -> bool {
    name.starts_with(siglip::PROJECTOR) || name == clip::IMAGE_NEWLINE
}

impl TowerSpec {
    /// The tower of `dir/config.json`, or None when its model type has none we compute.
    pub fn from_model_dir(dir: &Path) -> Result<Option<TowerSpec>> {
        let path = dir.join("config.json");
        let text = crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "model config")?;
        TowerSpec::from_text(&text, &path)
    }

    /// The tower of config.json's text (`path` names it in errors).
    pub fn from_text(text: &str, path: &Path) -> Result<Option<TowerSpec>> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::ModelConfig {
            path: path.into(),
            msg: format!("not a valid config.json: {e}"),
        })?;
        TowerSpec::from_json(&v, path)
    }

    /// The tower of a parsed config.json (`path` names it in errors).
    pub fn from_json(config: &Value, path: &Path) -> Result<Option<TowerSpec>> {
        match config.get("model_type").and_then(Value::as_str) {
            Some("gemma3") => {
                SiglipSpec::from_json(config, "gemma3", path).map(|s| Some(TowerSpec::Siglip(s)))
            }
            Some("llava_next") => {
                ClipSpec::from_json(config, "llava_next", path).map(|s| Some(TowerSpec::Clip(s)))
            }
            _ => Ok(VisionSpec::from_json(config, path)?.map(TowerSpec::Qwen)),
        }
    }

    /// The wrapper's `model_type`.
    pub fn model_type(&self) -> &str {
        match self {
            TowerSpec::Qwen(s) => &s.model_type,
            TowerSpec::Siglip(s) => &s.model_type,
            TowerSpec::Clip(s) => &s.model_type,
        }
    }

    /// Blocks (encoder layers) of the tower.
    pub fn depth(&self) -> usize {
        match self {
            TowerSpec::Qwen(s) => s.depth,
            TowerSpec::Siglip(s) => s.depth,
            TowerSpec::Clip(s) => s.depth,
        }
    }

    /// Every tensor of the tower (and its projector), named inside the tower, with its
    /// shape, in transformers' module order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            TowerSpec::Qwen(s) => s.tensors(),
            TowerSpec::Siglip(s) => s.tensors(),
            TowerSpec::Clip(s) => s.tensors(),
        }
    }

    /// Whether `training` trains the tower's tensor `name` (as [`Self::tensors`] names it):
    /// as [`TowerTraining::trains`] says, but for LLaVA-NeXT's tensors that do not reach the
    /// features (the CLIP layers after the one `vision_feature_layer` reads, and
    /// `post_layernorm`, the class token's), which get no gradient (transformers leaves them
    /// None, and torch's AdamW skips them): those stay frozen.
    pub fn trains(&self, training: TowerTraining, name: &str) -> bool {
        training.trains(name)
            && match self {
                TowerSpec::Clip(s) => s.reaches_features(name),
                TowerSpec::Qwen(_) | TowerSpec::Siglip(_) => true,
            }
    }

    /// The name the layout gives the tower's tensor `name` in the embedding block where it
    /// trains (the hub's, as [`crate::config::hf::TextNames::hf`] maps them): Qwen's under
    /// `visual.` (`visual.merger.mlp.0.weight`), SigLIP's and CLIP's under
    /// [`VIT_TOWER`] (`vision_tower.encoder.layers.0.mlp.fc1.weight`), those beside the
    /// tower as they are (`multi_modal_projector.linear_1.weight`, `image_newline`). Where
    /// `nested` (the checkpoint's SigLIP or CLIP tower is under `vision_tower.vision_model.`,
    /// [`crate::config::hf::ModelSpec::tower_nested`]), under that.
    pub fn layout_name(&self, name: &str, nested: bool) -> String {
        match self {
            TowerSpec::Qwen(_) => format!("{}{name}", super::hf::TOWER),
            _ if beside_tower(name) => name.to_string(),
            TowerSpec::Siglip(_) | TowerSpec::Clip(_) if nested => {
                format!("{VIT_TOWER}vision_model.{name}")
            }
            TowerSpec::Siglip(_) | TowerSpec::Clip(_) => format!("{VIT_TOWER}{name}"),
        }
    }

    /// The tensors `training` trains ([`Self::trains`]), under the names the layout gives
    /// them in the embedding block ([`Self::layout_name`]).
    pub fn trained_tensors(
        &self,
        training: TowerTraining,
        nested: bool,
    ) -> Vec<(String, Vec<usize>)> {
        (self.tensors().into_iter())
            .filter(|(name, _)| self.trains(training, name))
            .map(|(name, shape)| (self.layout_name(&name, nested), shape))
            .collect()
    }

    /// FLOPs of the tower's forward over one image of `grid` (t, h, w) patches, as torch's
    /// FlopCounterMode counts transformers' (Gemma 3's images all have one grid; LLaVA-NeXT's
    /// `grid` is (1, height, width) in pixels, which set its tiles).
    pub fn forward_flops(&self, grid: [u32; 3]) -> f64 {
        match self {
            TowerSpec::Qwen(s) => s.forward_flops(grid),
            TowerSpec::Siglip(s) => s.forward_flops(),
            TowerSpec::Clip(s) => s.forward_flops(grid[1], grid[2]),
        }
    }

    /// FLOPs of the projector's matmuls over one image of `grid` (part of
    /// [`Self::forward_flops`]; a trained projector's backward is twice this).
    pub fn projector_flops(&self, grid: [u32; 3]) -> f64 {
        match self {
            TowerSpec::Qwen(s) => s.merger_flops(grid),
            TowerSpec::Siglip(s) => {
                2.0 * (s.tokens_per_image * s.hidden_size * s.out_hidden_size) as f64
            }
            TowerSpec::Clip(s) => s.projector_flops(grid[1], grid[2]),
        }
    }

    /// The suffix of the checkpoint name of the tower's patch embedding: what precedes it
    /// is the tower's prefix.
    pub fn patch_embed(&self) -> &'static str {
        match self {
            TowerSpec::Qwen(_) => "patch_embed.proj.weight",
            TowerSpec::Siglip(_) | TowerSpec::Clip(_) => siglip::SIGLIP_PATCH_EMBED,
        }
    }
}

/// Which tower a wrapper has (the worker's model file that computes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VisionFamily {
    /// Qwen2.5-VL: RMSNorm blocks with a gated MLP, window attention but at
    /// `fullatt_block_indexes`, one merger (worker/src/model/qwen2_vl_vision.rs).
    Qwen2_5Vl,
    /// Qwen3-VL: LayerNorm blocks with a plain MLP, full attention per image, learned
    /// position embeddings resampled to each grid, a merger and the deepstack mergers
    /// (worker/src/model/qwen3_vl_vision.rs). Qwen3.5's tower is this one with no deepstack
    /// merger (`deepstack_visual_indexes` empty).
    Qwen3Vl,
}

/// The keys of `vision_config` we read; absent keys take the family's defaults
/// (`Qwen2_5_VLVisionConfig`, `Qwen3VLVisionConfig`, transformers 5.17; `Qwen3_5VisionConfig`
/// has Qwen3-VL's but for the deepstack mergers, which its tower does not build).
#[derive(Debug, Clone, Default, Deserialize)]
struct HfVisionConfig {
    depth: Option<usize>,
    hidden_size: Option<usize>,
    hidden_act: Option<String>,
    intermediate_size: Option<usize>,
    num_heads: Option<usize>,
    /// The hub's configs spell it `in_chans`; transformers reads `in_channels` (both 3).
    #[serde(alias = "in_chans")]
    in_channels: Option<usize>,
    patch_size: Option<usize>,
    spatial_merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    window_size: Option<usize>,
    out_hidden_size: Option<usize>,
    fullatt_block_indexes: Option<Vec<usize>>,
    num_position_embeddings: Option<usize>,
    deepstack_visual_indexes: Option<Vec<usize>>,
    rope_parameters: Option<Value>,
    rope_theta: Option<f64>,
}

impl HfVisionConfig {
    /// The family's config class defaults for every absent key; `deepstack` false (Qwen3.5)
    /// leaves no deepstack merger whatever the config lists (`Qwen3_5VisionModel` reads no
    /// such key; the hub's configs list none).
    fn with_defaults(self, family: VisionFamily, deepstack: bool) -> HfVisionConfig {
        let d = match family {
            VisionFamily::Qwen2_5Vl => HfVisionConfig {
                depth: Some(32),
                hidden_size: Some(3584),
                hidden_act: Some("silu".into()),
                intermediate_size: Some(3420),
                num_heads: Some(16),
                in_channels: Some(3),
                patch_size: Some(14),
                spatial_merge_size: Some(2),
                temporal_patch_size: Some(2),
                window_size: Some(112),
                out_hidden_size: Some(3584),
                fullatt_block_indexes: Some(vec![7, 15, 23, 31]),
                num_position_embeddings: Some(0),
                deepstack_visual_indexes: Some(vec![]),
                ..Default::default()
            },
            VisionFamily::Qwen3Vl => HfVisionConfig {
                depth: Some(27),
                hidden_size: Some(1152),
                hidden_act: Some("gelu_pytorch_tanh".into()),
                intermediate_size: Some(4304),
                num_heads: Some(16),
                in_channels: Some(3),
                patch_size: Some(16),
                spatial_merge_size: Some(2),
                temporal_patch_size: Some(2),
                // No windows: every block attends over the whole frame.
                window_size: Some(0),
                out_hidden_size: Some(3584),
                fullatt_block_indexes: Some(vec![]),
                num_position_embeddings: Some(2304),
                deepstack_visual_indexes: Some(vec![8, 16, 24]),
                ..Default::default()
            },
        };
        HfVisionConfig {
            depth: self.depth.or(d.depth),
            hidden_size: self.hidden_size.or(d.hidden_size),
            hidden_act: self.hidden_act.or(d.hidden_act),
            intermediate_size: self.intermediate_size.or(d.intermediate_size),
            num_heads: self.num_heads.or(d.num_heads),
            in_channels: self.in_channels.or(d.in_channels),
            patch_size: self.patch_size.or(d.patch_size),
            spatial_merge_size: self.spatial_merge_size.or(d.spatial_merge_size),
            temporal_patch_size: self.temporal_patch_size.or(d.temporal_patch_size),
            window_size: match family {
                VisionFamily::Qwen2_5Vl => self.window_size.or(d.window_size),
                VisionFamily::Qwen3Vl => d.window_size,
            },
            out_hidden_size: self.out_hidden_size.or(d.out_hidden_size),
            fullatt_block_indexes: match family {
                VisionFamily::Qwen2_5Vl => self.fullatt_block_indexes.or(d.fullatt_block_indexes),
                VisionFamily::Qwen3Vl => d.fullatt_block_indexes,
            },
            num_position_embeddings: match family {
                VisionFamily::Qwen2_5Vl => d.num_position_embeddings,
                VisionFamily::Qwen3Vl => self.num_position_embeddings.or(d.num_position_embeddings),
            },
            deepstack_visual_indexes: match family {
                VisionFamily::Qwen3Vl if deepstack => {
                    self.deepstack_visual_indexes.or(d.deepstack_visual_indexes)
                }
                VisionFamily::Qwen3Vl | VisionFamily::Qwen2_5Vl => Some(vec![]),
            },
            rope_parameters: self.rope_parameters,
            rope_theta: self.rope_theta,
        }
    }
}

/// The axial RoPE's base when the config names none (`rope_parameters.rope_theta`).
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// Largest accepted size of any one dimension (a corrupt config must not size a region).
const MAX_DIM: usize = 1 << 20;

/// A vision tower and its patch merger(s), validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionSpec {
    /// The wrapper's `model_type` (`qwen2_5_vl`, `qwen3_vl`, `qwen3_5`).
    pub model_type: String,
    pub family: VisionFamily,
    /// Vision blocks.
    pub depth: usize,
    /// Width E of the blocks.
    pub hidden_size: usize,
    pub num_heads: usize,
    /// The blocks' MLP width.
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub in_channels: usize,
    /// Side of a square patch, in pixels.
    pub patch_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Patches merged per side into one token by the merger.
    pub spatial_merge_size: usize,
    /// Side of an attention window, in pixels (Qwen2.5-VL; 0 for Qwen3-VL, no windows).
    pub window_size: usize,
    /// The merger's output width: the text model's hidden size.
    pub out_hidden_size: usize,
    /// Blocks attending over the whole image rather than its windows (Qwen2.5-VL).
    pub fullatt_block_indexes: Vec<usize>,
    pub rope_theta: f64,
    /// Learned position embeddings, a square grid of this many resampled to each image's
    /// grid (Qwen3-VL; 0 for Qwen2.5-VL).
    pub num_position_embeddings: usize,
    /// Blocks whose output the deepstack mergers take, merger k after block
    /// `deepstack_visual_indexes[k]` (Qwen3-VL; empty for Qwen2.5-VL and Qwen3.5).
    pub deepstack_visual_indexes: Vec<usize>,
}

impl VisionSpec {
    /// The tower of `dir/config.json`, or None when its model type has none we compute.
    pub fn from_model_dir(dir: &Path) -> Result<Option<VisionSpec>> {
        let path = dir.join("config.json");
        let text = crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "model config")?;
        VisionSpec::from_text(&text, &path)
    }

    /// The tower of config.json's text (`path` names it in errors).
    pub fn from_text(text: &str, path: &Path) -> Result<Option<VisionSpec>> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::ModelConfig {
            path: path.into(),
            msg: format!("not a valid config.json: {e}"),
        })?;
        VisionSpec::from_json(&v, path)
    }

    /// The tower of a parsed config.json (`path` names it in errors).
    pub fn from_json(config: &Value, path: &Path) -> Result<Option<VisionSpec>> {
        let err = |msg: String| Error::ModelConfig {
            path: path.into(),
            msg,
        };
        let Some(model_type) = config.get("model_type").and_then(Value::as_str) else {
            return Ok(None);
        };
        let (family, deepstack) = match model_type {
            "qwen2_5_vl" => (VisionFamily::Qwen2_5Vl, false),
            "qwen3_vl" => (VisionFamily::Qwen3Vl, true),
            "qwen3_5" | "qwen3_5_moe" => (VisionFamily::Qwen3Vl, false),
            _ => return Ok(None),
        };
        let raw = config
            .get("vision_config")
            .ok_or_else(|| err(format!("`vision_config` is missing (`{model_type}`)")))?;
        let hf: HfVisionConfig = serde_path_to_error::deserialize(raw).map_err(|e| {
            err(format!(
                "`vision_config.{}`: {}",
                e.path().to_string().trim_start_matches('.'),
                e.inner()
            ))
        })?;
        let hf = hf.with_defaults(family, deepstack);
        let act = hf.hidden_act.as_deref().unwrap_or_default();
        let hidden_act = match act {
            "silu" | "swish" => Activation::Silu,
            "gelu" => Activation::Gelu,
            "gelu_pytorch_tanh" => Activation::GeluTanh,
            other => {
                return Err(err(format!(
                    "`vision_config.hidden_act`: `{other}` is not supported (silu, gelu, gelu_pytorch_tanh)"
                )));
            }
        };
        let rope = hf.rope_parameters.as_ref();
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(hf.rope_theta)
            .unwrap_or(DEFAULT_ROPE_THETA);
        if let Some(t) = rope
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
            && t != "axial"
            && t != "default"
        {
            return Err(err(format!(
                "`vision_config.rope_parameters.rope_type`: `{t}` (the tower's RoPE is axial)"
            )));
        }
        // Every key has a default (`with_defaults`).
        let spec = VisionSpec {
            model_type: model_type.into(),
            family,
            depth: hf.depth.unwrap_or_default(),
            hidden_size: hf.hidden_size.unwrap_or_default(),
            num_heads: hf.num_heads.unwrap_or_default(),
            intermediate_size: hf.intermediate_size.unwrap_or_default(),
            hidden_act,
            in_channels: hf.in_channels.unwrap_or_default(),
            patch_size: hf.patch_size.unwrap_or_default(),
            temporal_patch_size: hf.temporal_patch_size.unwrap_or_default(),
            spatial_merge_size: hf.spatial_merge_size.unwrap_or_default(),
            window_size: hf.window_size.unwrap_or_default(),
            out_hidden_size: hf.out_hidden_size.unwrap_or_default(),
            fullatt_block_indexes: hf.fullatt_block_indexes.unwrap_or_default(),
            rope_theta,
            num_position_embeddings: hf.num_position_embeddings.unwrap_or_default(),
            deepstack_visual_indexes: hf.deepstack_visual_indexes.unwrap_or_default(),
        };
        spec.validate()
            .map_err(|m| err(format!("`vision_config`: {m}")))?;
        Ok(Some(spec))
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let mut sizes = vec![
            ("depth", self.depth),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("in_channels", self.in_channels),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("spatial_merge_size", self.spatial_merge_size),
            ("out_hidden_size", self.out_hidden_size),
        ];
        let qwen2_5 = self.family == VisionFamily::Qwen2_5Vl;
        match qwen2_5 {
            true => sizes.push(("window_size", self.window_size)),
            false => sizes.push(("num_position_embeddings", self.num_position_embeddings)),
        }
        for (key, v) in sizes {
            if v == 0 || v > MAX_DIM {
                return Err(format!("`{key}` is {v}, expected 1..={MAX_DIM}"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(format!(
                "`hidden_size` {} is not a multiple of `num_heads` {}",
                self.hidden_size, self.num_heads
            ));
        }
        // The axial RoPE rotates D / 2 pairs: D / 4 frequencies for rows, as many for columns.
        if !self.head_dim().is_multiple_of(4) {
            return Err(format!(
                "the head dim {} is not a multiple of 4 (axial RoPE)",
                self.head_dim()
            ));
        }
        if qwen2_5 && self.merge_window() == 0 {
            return Err(format!(
                "`window_size` {} is smaller than a merged patch ({} pixels)",
                self.window_size,
                self.spatial_merge_size * self.patch_size
            ));
        }
        let mut seen = Vec::new();
        for &b in &self.deepstack_visual_indexes {
            if b >= self.depth || seen.contains(&b) {
                return Err(format!(
                    "`deepstack_visual_indexes` {:?}: each must be a distinct block below `depth` {}",
                    self.deepstack_visual_indexes, self.depth
                ));
            }
            seen.push(b);
        }
        Ok(())
    }

    /// Head dim D.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values of one patch: channels x frames x pixels.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches merged into one output token (merge^2).
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }

    /// Side of an attention window in merged patches (`vit_merger_window_size`).
    pub fn merge_window(&self) -> usize {
        self.window_size / self.spatial_merge_size / self.patch_size
    }

    /// Whether block `i` attends over the whole image (else within windows).
    pub fn full_attention(&self, block: usize) -> bool {
        self.fullatt_block_indexes.contains(&block)
    }

    /// Side of the learned position embeddings' square grid (Qwen3-VL's
    /// `num_grid_per_side`: the integer square root of `num_position_embeddings`).
    pub fn position_grid_side(&self) -> usize {
        self.num_position_embeddings.isqrt()
    }

    /// The deepstack features the tower yields, in the order the language model's first
    /// layers add them: (block, merger) for each block in `deepstack_visual_indexes`, by
    /// block (transformers appends them as the blocks run).
    pub fn deepstack_taps(&self) -> Vec<(usize, usize)> {
        (0..self.depth)
            .filter_map(|b| {
                let k = self.deepstack_visual_indexes.iter().position(|&i| i == b)?;
                Some((b, k))
            })
            .collect()
    }

    /// FLOPs of the tower's forward over one image of `grid` (t, h, w) patches, as torch's
    /// FlopCounterMode counts transformers' forward: the patch embedding, every block's
    /// projections and MLP, its attention (QK^T and AV, 2 FLOPs per multiply-add each) within
    /// each window or over each frame, and the merger (Qwen3-VL: and each deepstack merger);
    /// norms, activations and Qwen3-VL's position resampling (a weighted gather) not counted.
    pub fn forward_flops(&self, grid: [u32; 3]) -> f64 {
        let [t, h, w] = grid.map(|x| x as f64);
        let (e, i) = (self.hidden_size as f64, self.intermediate_size as f64);
        let n = t * h * w;
        let unit = self.merge_unit() as f64;
        // Qwen2.5-VL's MLP is gated (three matmuls), Qwen3-VL's plain (two).
        let mlp = match self.family {
            VisionFamily::Qwen2_5Vl => 3.0,
            VisionFamily::Qwen3Vl => 2.0,
        };
        let mergers = 1.0 + self.deepstack_taps().len() as f64;
        let linear = 2.0 * n * (self.patch_len() as f64 * e)
            + self.depth as f64 * 2.0 * n * (4.0 * e * e + mlp * e * i)
            + mergers * self.merger_flops(grid);
        let frame = (h * w).powi(2);
        if self.family == VisionFamily::Qwen3Vl {
            // Every block attends over each frame.
            return linear + 4.0 * e * t * self.depth as f64 * frame;
        }
        // Σ s^2 over the attention spans of one frame: the frame, or each window of at most
        // merge_window^2 merged patches (the grid cut from its top-left corner).
        let (m, win) = (self.spatial_merge_size, self.merge_window());
        let (gh, gw) = (grid[1] as usize / m, grid[2] as usize / m);
        let windows: f64 = (0..gh.div_ceil(win))
            .flat_map(|r| (0..gw.div_ceil(win)).map(move |c| (r, c)))
            .map(|(r, c)| {
                let units = (win.min(gh - r * win) * win.min(gw - c * win)) as f64;
                (units * unit).powi(2)
            })
            .sum();
        let full = self
            .fullatt_block_indexes
            .iter()
            .filter(|&&b| b < self.depth);
        let full = full.count() as f64;
        let attention = 4.0 * e * t * (full * frame + (self.depth as f64 - full) * windows);
        linear + attention
    }

    /// FLOPs of the merger's two Linear layers over one image of `grid` (t, h, w) patches
    /// (part of [`Self::forward_flops`]; its backward is twice this).
    pub fn merger_flops(&self, grid: [u32; 3]) -> f64 {
        let n = grid.map(|x| x as f64).iter().product::<f64>();
        let (e, unit) = (self.hidden_size as f64, self.merge_unit() as f64);
        2.0 * (n / unit) * (unit * e * unit * e + unit * e * self.out_hidden_size as f64)
    }

    /// Every tensor of the tower, named inside it (`blocks.0.attn.qkv.weight`, as the
    /// checkpoint names it after the tower's prefix), with its shape, in the order of
    /// transformers' module tree.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self.family {
            VisionFamily::Qwen2_5Vl => self.tensors_qwen2_5_vl(),
            VisionFamily::Qwen3Vl => self.tensors_qwen3_vl(),
        }
    }

    fn tensors_qwen2_5_vl(&self) -> Vec<(String, Vec<usize>)> {
        let (e, i) = (self.hidden_size, self.intermediate_size);
        let (p, tp) = (self.patch_size, self.temporal_patch_size);
        let merged = e * self.merge_unit();
        let mut out = vec![(
            "patch_embed.proj.weight".to_string(),
            vec![e, self.in_channels, tp, p, p],
        )];
        for b in 0..self.depth {
            let mut t =
                |name: &str, shape: Vec<usize>| out.push((format!("blocks.{b}.{name}"), shape));
            t("norm1.weight", vec![e]);
            t("norm2.weight", vec![e]);
            t("attn.qkv.weight", vec![3 * e, e]);
            t("attn.qkv.bias", vec![3 * e]);
            t("attn.proj.weight", vec![e, e]);
            t("attn.proj.bias", vec![e]);
            t("mlp.gate_proj.weight", vec![i, e]);
            t("mlp.gate_proj.bias", vec![i]);
            t("mlp.up_proj.weight", vec![i, e]);
            t("mlp.up_proj.bias", vec![i]);
            t("mlp.down_proj.weight", vec![e, i]);
            t("mlp.down_proj.bias", vec![e]);
        }
        out.push(("merger.ln_q.weight".into(), vec![e]));
        out.push(("merger.mlp.0.weight".into(), vec![merged, merged]));
        out.push(("merger.mlp.0.bias".into(), vec![merged]));
        out.push((
            "merger.mlp.2.weight".into(),
            vec![self.out_hidden_size, merged],
        ));
        out.push(("merger.mlp.2.bias".into(), vec![self.out_hidden_size]));
        out
    }

    fn tensors_qwen3_vl(&self) -> Vec<(String, Vec<usize>)> {
        let (e, i, o) = (
            self.hidden_size,
            self.intermediate_size,
            self.out_hidden_size,
        );
        let (p, tp) = (self.patch_size, self.temporal_patch_size);
        let merged = e * self.merge_unit();
        let mut out = Vec::new();
        let mut t = |name: String, shape: Vec<usize>| out.push((name, shape));
        t(
            "patch_embed.proj.weight".into(),
            vec![e, self.in_channels, tp, p, p],
        );
        t("patch_embed.proj.bias".into(), vec![e]);
        t(
            "pos_embed.weight".into(),
            vec![self.num_position_embeddings, e],
        );
        for b in 0..self.depth {
            for (name, shape) in [
                ("norm1.weight", vec![e]),
                ("norm1.bias", vec![e]),
                ("norm2.weight", vec![e]),
                ("norm2.bias", vec![e]),
                ("attn.qkv.weight", vec![3 * e, e]),
                ("attn.qkv.bias", vec![3 * e]),
                ("attn.proj.weight", vec![e, e]),
                ("attn.proj.bias", vec![e]),
                ("mlp.linear_fc1.weight", vec![i, e]),
                ("mlp.linear_fc1.bias", vec![i]),
                ("mlp.linear_fc2.weight", vec![e, i]),
                ("mlp.linear_fc2.bias", vec![e]),
            ] {
                t(format!("blocks.{b}.{name}"), shape);
            }
        }
        // The merger normalises each patch (width E), the deepstack mergers the merged
        // group (width merge^2 x E).
        let mergers = std::iter::once(("merger".to_string(), e)).chain(
            (0..self.deepstack_visual_indexes.len())
                .map(|k| (format!("deepstack_merger_list.{k}"), merged)),
        );
        for (m, norm) in mergers {
            t(format!("{m}.norm.weight"), vec![norm]);
            t(format!("{m}.norm.bias"), vec![norm]);
            t(format!("{m}.linear_fc1.weight"), vec![merged, merged]);
            t(format!("{m}.linear_fc1.bias"), vec![merged]);
            t(format!("{m}.linear_fc2.weight"), vec![o, merged]);
            t(format!("{m}.linear_fc2.bias"), vec![o]);
        }
        out
    }
}

#[cfg(test)]
mod tests;
