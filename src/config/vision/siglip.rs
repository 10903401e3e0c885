//! Gemma 3's vision tower (a SigLIP vision encoder, `vision_config`) and its multimodal
//! projector (the wrapper's `mm_tokens_per_image`): the file format, lenient with
//! transformers 5.17's defaults for absent keys (`SiglipVisionConfig`, `Gemma3Config`), and
//! the validated architecture the worker computes (worker/src/model/siglip_vision.rs).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::hf::Activation;
use crate::error::{Error, Result};

/// The keys of `vision_config` we read; absent keys take `SiglipVisionConfig`'s defaults.
#[derive(Debug, Clone, Deserialize)]
struct HfSiglipConfig {
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

/// transformers' `SiglipVisionConfig` defaults, and `Gemma3Config`'s / `Gemma3TextConfig`'s
/// for the wrapper's keys.
mod d {
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
        16
    }
    pub fn hidden_act() -> String {
        "gelu_pytorch_tanh".into()
    }
    pub fn layer_norm_eps() -> f64 {
        1e-6
    }
    pub const MM_TOKENS_PER_IMAGE: u64 = 256;
    pub const IMAGE_TOKEN_INDEX: i64 = 262_144;
    pub const BOI_TOKEN_INDEX: i64 = 255_999;
    pub const EOI_TOKEN_INDEX: i64 = 256_000;
    pub const TEXT_HIDDEN_SIZE: u64 = 2304;
}

/// Largest accepted size of any one dimension (a corrupt config must not size a region).
const MAX_DIM: usize = 1 << 20;

/// Gemma 3's SigLIP tower and projector, validated.
///
/// The tower embeds a fixed `image_size`² image as (image_size / patch_size)² patches (a
/// strided convolution plus a learned position per patch), runs `depth` pre-LayerNorm
/// encoder layers of bidirectional attention and a GELU MLP, then a final LayerNorm; the
/// projector average-pools the patch grid to `tokens_per_image` tokens, normalizes them
/// (Gemma's RMSNorm, `1 + w`) and projects them to the text model's width.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiglipSpec {
    /// The wrapper's `model_type` (`gemma3`).
    pub model_type: String,
    /// Encoder layers (`num_hidden_layers`).
    pub depth: usize,
    /// Width E of the encoder.
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub hidden_act: Activation,
    pub in_channels: usize,
    /// Side of the (square) image, in pixels.
    pub image_size: usize,
    pub patch_size: usize,
    /// The LayerNorms' and the projector's RMSNorm's epsilon.
    pub layer_norm_eps: f64,
    /// Image tokens per image (`mm_tokens_per_image`, a square).
    pub tokens_per_image: usize,
    /// The projector's output width: the text model's hidden size.
    pub out_hidden_size: usize,
    /// The id of the image tokens (`image_token_index`), of the token before them
    /// (`boi_token_index`) and after them (`eoi_token_index`).
    pub image_token_id: i64,
    pub boi_token_id: i64,
    pub eoi_token_id: i64,
}

/// The checkpoint's tower tensors start with this inside the wrapper (after `vision_tower.`,
/// or `vision_tower.vision_model.` in the hub's uploads).
pub const SIGLIP_PATCH_EMBED: &str = "embeddings.patch_embedding.weight";
/// The projector's tensors' names inside the wrapper; the layout names them so.
pub const PROJECTOR: &str = "multi_modal_projector.";

impl SiglipSpec {
    /// The tower and projector of a parsed `gemma3` config.json (`path` names it in errors).
    pub fn from_json(config: &Value, model_type: &str, path: &Path) -> Result<SiglipSpec> {
        let err = |msg: String| Error::ModelConfig {
            path: path.into(),
            msg,
        };
        let raw = config
            .get("vision_config")
            .ok_or_else(|| err(format!("`vision_config` is missing (`{model_type}`)")))?;
        let hf: HfSiglipConfig = serde_path_to_error::deserialize(raw).map_err(|e| {
            err(format!(
                "`vision_config.{}`: {}",
                e.path().to_string().trim_start_matches('.'),
                e.inner()
            ))
        })?;
        let hidden_act = match hf.hidden_act.as_str() {
            "gelu_pytorch_tanh" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            other => {
                return Err(err(format!(
                    "`vision_config.hidden_act`: `{other}` is not supported (gelu_pytorch_tanh, gelu)"
                )));
            }
        };
        let uint = |v: Option<&Value>, key: &str, default: u64| -> Result<u64> {
            match v {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_u64().ok_or_else(|| {
                    err(format!(
                        "`{key}`: expected a non-negative integer, found {x}"
                    ))
                }),
            }
        };
        let int = |key: &str, default: i64| -> Result<i64> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_i64()
                    .ok_or_else(|| err(format!("`{key}`: expected an integer, found {x}"))),
            }
        };
        let text = config.get("text_config");
        let out_hidden = uint(
            text.and_then(|t| t.get("hidden_size")),
            "text_config.hidden_size",
            d::TEXT_HIDDEN_SIZE,
        )?;
        let spec = SiglipSpec {
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
            tokens_per_image: uint(
                config.get("mm_tokens_per_image"),
                "mm_tokens_per_image",
                d::MM_TOKENS_PER_IMAGE,
            )? as usize,
            out_hidden_size: out_hidden as usize,
            image_token_id: int("image_token_index", d::IMAGE_TOKEN_INDEX)?,
            boi_token_id: int("boi_token_index", d::BOI_TOKEN_INDEX)?,
            eoi_token_id: int("eoi_token_index", d::EOI_TOKEN_INDEX)?,
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
            ("mm_tokens_per_image", self.tokens_per_image),
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
        let side = self.tokens_per_side();
        if side * side != self.tokens_per_image || !self.patches_per_side().is_multiple_of(side) {
            return Err(format!(
                "`mm_tokens_per_image` {} is not a square whose side divides the {} patches per side (the projector pools squares of patches)",
                self.tokens_per_image,
                self.patches_per_side()
            ));
        }
        Ok(())
    }

    /// Head dim D.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Patches per side of the image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Image tokens per side (the projector's pooled grid), as transformers rounds it.
    pub fn tokens_per_side(&self) -> usize {
        ((self.tokens_per_image as f64).sqrt() as usize).max(1)
    }

    /// The projector's pooling window side, in patches.
    pub fn pool(&self) -> usize {
        self.patches_per_side() / self.tokens_per_side()
    }

    /// Values of one patch: channels x pixels.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.patch_size * self.patch_size
    }

    /// FLOPs of the tower's and projector's forward over one image, as torch's
    /// FlopCounterMode counts transformers' (eager attention): the patch convolution, every
    /// layer's four projections, MLP and attention (QK^T and AV, 2 FLOPs per multiply-add
    /// each), and the projection; norms, activations and the pooling not counted.
    pub fn forward_flops(&self) -> f64 {
        let (e, i) = (self.hidden_size as f64, self.intermediate_size as f64);
        let n = self.patches_per_side().pow(2) as f64;
        let layer = 2.0 * n * (4.0 * e * e + 2.0 * e * i) + 4.0 * n * n * e;
        2.0 * n * self.patch_len() as f64 * e
            + self.depth as f64 * layer
            + 2.0 * self.tokens_per_image as f64 * e * self.out_hidden_size as f64
    }

    /// Every tensor of the tower and the projector, with its shape, in transformers' module
    /// order: the tower's named inside it (`encoder.layers.0.mlp.fc1.weight`), the
    /// projector's under [`PROJECTOR`].
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (e, i, p) = (self.hidden_size, self.intermediate_size, self.patch_size);
        let n = self.patches_per_side().pow(2);
        let mut out = vec![
            (
                "embeddings.patch_embedding.weight".to_string(),
                vec![e, self.in_channels, p, p],
            ),
            ("embeddings.patch_embedding.bias".into(), vec![e]),
            ("embeddings.position_embedding.weight".into(), vec![n, e]),
        ];
        for l in 0..self.depth {
            let mut t = |name: &str, shape: Vec<usize>| {
                out.push((format!("encoder.layers.{l}.{name}"), shape))
            };
            for norm in ["layer_norm1", "layer_norm2"] {
                t(&format!("{norm}.weight"), vec![e]);
                t(&format!("{norm}.bias"), vec![e]);
            }
            for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
                t(&format!("self_attn.{proj}.weight"), vec![e, e]);
                t(&format!("self_attn.{proj}.bias"), vec![e]);
            }
            t("mlp.fc1.weight", vec![i, e]);
            t("mlp.fc1.bias", vec![i]);
            t("mlp.fc2.weight", vec![e, i]);
            t("mlp.fc2.bias", vec![e]);
        }
        out.push(("post_layernorm.weight".into(), vec![e]));
        out.push(("post_layernorm.bias".into(), vec![e]));
        out.push((
            format!("{PROJECTOR}mm_input_projection_weight"),
            vec![e, self.out_hidden_size],
        ));
        out.push((format!("{PROJECTOR}mm_soft_emb_norm.weight"), vec![e]));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hub_config_reads_with_defaults() {
        // google/gemma-3-4b-it's config.json, its vision and wrapper keys.
        let cfg = json!({"model_type": "gemma3", "mm_tokens_per_image": 256,
            "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
            "text_config": {"hidden_size": 2560, "model_type": "gemma3_text"},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": false}});
        let s = SiglipSpec::from_json(&cfg, "gemma3", Path::new("c")).unwrap();
        assert_eq!(
            (s.patches_per_side(), s.tokens_per_side(), s.pool()),
            (64, 16, 4)
        );
        assert_eq!(
            (s.head_dim(), s.patch_len(), s.out_hidden_size),
            (72, 588, 2560)
        );
        assert_eq!(s.hidden_act, Activation::GeluTanh);
        let t = s.tensors();
        assert_eq!(t.len(), 3 + 27 * 16 + 2 + 2);
        assert_eq!(t[2].1, vec![4096, 1152]);
        assert_eq!(t[t.len() - 2].1, vec![1152, 2560]);
    }

    /// `forward_flops` against torch's FlopCounterMode over transformers' tower and
    /// projector (scripts/make_vlm_golden_gemma3.py, the golden model's): both count whole
    /// products, so they are equal.
    #[test]
    fn forward_flops_equal_torch_count() {
        let Some(fx) = std::env::var_os("MT_DATA_FIXTURES") else {
            eprintln!("no data fixtures (MT_DATA_FIXTURES): skipped");
            return;
        };
        let dir = std::path::PathBuf::from(fx).join("vlm/golden-gemma3");
        let text = std::fs::read_to_string(dir.join("model/config.json")).unwrap();
        let cfg: Value = serde_json::from_str(&text).unwrap();
        let spec = SiglipSpec::from_json(&cfg, "gemma3", Path::new("c")).unwrap();
        let text = std::fs::read_to_string(dir.join("tower_flops.json")).unwrap();
        let counted: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(spec.forward_flops(), counted["flops"].as_f64().unwrap());
    }

    #[test]
    fn bad_values_are_named() {
        let e = |v: Value| {
            SiglipSpec::from_json(&v, "gemma3", Path::new("m/config.json"))
                .unwrap_err()
                .to_string()
        };
        let msg = e(json!({"vision_config": {"image_size": 30, "patch_size": 14}}));
        assert!(
            msg.contains("m/config.json") && msg.contains("image_size"),
            "{msg}"
        );
        let msg = e(json!({"mm_tokens_per_image": 5, "vision_config": {}}));
        assert!(msg.contains("mm_tokens_per_image"), "{msg}");
        let msg = e(json!({"vision_config": {"hidden_act": "relu"}}));
        assert!(msg.contains("hidden_act"), "{msg}");
        let msg = e(json!({"vision_config": {"num_hidden_layers": "x"}}));
        assert!(msg.contains("vision_config.num_hidden_layers"), "{msg}");
        assert!(e(json!({})).contains("vision_config"));
    }
}
