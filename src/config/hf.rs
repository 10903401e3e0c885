//! Hugging Face `config.json`: the file format (`HfConfig`, lenient: HF configs carry many
//! keys we do not use) and the internal, validated architecture (`ModelSpec`) that the
//! layout and the worker's model code are built from.
//!
//! `ModelSpec::from_hf` resolves everything a family leaves implicit the way transformers'
//! `configuration_<family>.py` does: per-family defaults for absent keys, which layers use a
//! sliding window, which projections carry biases, the RoPE variant and its parameters (both
//! the transformers 5 `rope_parameters` form and the older `rope_theta` + `rope_scaling`
//! form), so the worker only reads plain fields. A multimodal wrapper's config resolves to
//! its text model's (`wrapper.rs`). Every value that sizes memory is bounded first
//! (`sizes.rs`).

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

mod attn;
mod defaults;
mod layers;
mod moe;
mod moe_sigmoid;
mod mrope;
mod rope;
pub mod sizes;
mod wrapper;

pub use attn::{Llama4Attn, MlaSpec};
use defaults::{Defaults, defaults};
use layers::attention_kinds;
pub use moe::{ExpertAct, ExpertNames, LinearAttnSpec, MoeSpec, Router};
pub use mrope::Mrope;
use mrope::MropeKind;
use rope::{RopeCtx, ropes};
pub use rope::{RopeScaling, RopeSpec, SUPPORTED_ROPE_TYPES};
pub use wrapper::{TOWER, TextNames};

/// Model families the worker can compute, by HF `model_type`. Llama-shaped checkpoints of
/// other projects (Yi, DeepSeek-LLM) declare `llama` and load as such. The multimodal
/// wrappers (`qwen3_5`, `qwen3_5_moe`, `gemma3`, `mistral3`, `llama4`, `qwen2_5_vl`, `qwen3_vl`,
/// `llava_next`)
/// train their text model, which must be one of these; `qwen2_5_vl` wraps `qwen2_5_vl_text`
/// (Qwen2's layer under a multimodal RoPE), `qwen3_vl` wraps `qwen3_vl_text` (Qwen3's layer
/// under an interleaved multimodal RoPE).
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "olmo2",
    "glm4",
    "glm4_moe",
    "deepseek_v3",
    "llama4_text",
    "qwen2_5_vl_text",
    "qwen3_vl_text",
];

/// The subset of an HF `config.json` we read. `Option<Option<T>>` fields tell an absent key
/// (family default applies) from an explicit `null` (feature off).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub max_position_embeddings: Option<usize>,
    /// Phi-3 keeps the pre-training length here, outside the RoPE dict.
    pub original_max_position_embeddings: Option<usize>,
    pub rope_theta: Option<f64>,
    /// transformers 5: one RoPE dict, or one per layer type (Gemma 3).
    pub rope_parameters: Option<Value>,
    /// transformers 4: the scaling dict (`type`/`rope_type`, `factor`, …).
    pub rope_scaling: Option<Value>,
    /// Gemma 3 (transformers 4): RoPE base of the sliding-window layers.
    pub rope_local_base_freq: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    /// Gemma's name for the MLP activation.
    pub hidden_activation: Option<String>,
    #[serde(default, deserialize_with = "present")]
    pub sliding_window: Option<Option<usize>>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub sliding_window_pattern: Option<usize>,
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default, deserialize_with = "present")]
    pub attn_logit_softcapping: Option<Option<f64>>,
    #[serde(default, deserialize_with = "present")]
    pub final_logit_softcapping: Option<Option<f64>>,
    pub use_bidirectional_attention: Option<bool>,
    pub attention_dropout: Option<f64>,
    pub resid_pdrop: Option<f64>,
    pub embd_pdrop: Option<f64>,
    pub initializer_range: Option<f64>,
    pub pad_token_id: Option<Value>,
    /// Qwen2-MoE's name for the q/k/v biases.
    pub qkv_bias: Option<bool>,
    // Mixture of experts (`moe.rs`).
    pub num_local_experts: Option<usize>,
    pub num_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub router_aux_loss_coef: Option<f64>,
    pub output_router_logits: Option<bool>,
    pub router_jitter_noise: Option<f64>,
    // Gated DeltaNet (Qwen3-Next, Qwen3.5).
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_conv_kernel_dim: Option<usize>,
    pub full_attention_interval: Option<usize>,
    /// A multimodal wrapper's text model config (`wrapper.rs`).
    pub text_config: Option<Value>,
    /// A multimodal wrapper's vision tower config; we read only what places image tokens
    /// (`spatial_merge_size`, `mrope.rs`).
    pub vision_config: Option<Value>,
    /// The token that stands for one merged patch of an image (Qwen2-VL, Qwen2.5-VL).
    pub image_token_id: Option<i64>,
    // GLM-4.5 and DeepSeek-V3 (`moe_sigmoid.rs`, `attn.rs`).
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub routed_scaling_factor: Option<f64>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub use_qk_norm: Option<bool>,
    /// Multi-token-prediction layers stored after the decoder layers.
    pub num_nextn_predict_layers: Option<usize>,
    #[serde(default, deserialize_with = "present")]
    pub q_lora_rank: Option<Option<usize>>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub rope_interleave: Option<bool>,
    // Llama 4 (`attn.rs`, `moe_sigmoid.rs`).
    pub intermediate_size_mlp: Option<usize>,
    pub moe_layers: Option<Vec<usize>>,
    pub interleave_moe_layer_step: Option<usize>,
    pub no_rope_layers: Option<Vec<u8>>,
    pub no_rope_layer_interval: Option<usize>,
    #[serde(default, deserialize_with = "present")]
    pub attention_chunk_size: Option<Option<usize>>,
    pub attn_temperature_tuning: Option<bool>,
    pub floor_scale: Option<f64>,
    pub attn_scale: Option<f64>,
}

/// Deserializes a present key (value or null) as `Some(..)`; with `#[serde(default)]` an
/// absent key stays `None`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// Which model file of the worker computes a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// Llama, Mistral, Qwen2: they differ only in biases and sliding windows.
    Llama,
    /// Qwen3: RMSNorm on each query and key head.
    Qwen3,
    /// Gemma 2 and Gemma 3 text: (1 + w) norms around attention and MLP, scaled embedding.
    Gemma,
    /// Phi-3: fused qkv_proj and gate_up_proj.
    Phi3,
    /// GPT-OSS: attention sinks, biases everywhere, clamped-SwiGLU experts.
    GptOss,
    /// Qwen3-Next and Qwen3.5: Gated DeltaNet layers between gated full-attention layers,
    /// (1 + w) norms.
    Qwen3Next,
    /// OLMo 2: norms after attention and MLP (not before), q/k norms over all heads.
    Olmo2,
    /// GLM-4: four norms per layer, fused gate_up_proj, interleaved partial RoPE.
    Glm4,
    /// DeepSeek-V3: multi-head latent attention; MoE with group-limited sigmoid routing.
    DeepseekV3,
    /// Llama 4 text: NoPE and chunked RoPE layers, MoE with a shared expert.
    Llama4,
}

impl Family {
    /// Norm weights act as `1 + w` (Gemma, Qwen3-Next); random init sets them to 0.
    pub fn norm_adds_one(self) -> bool {
        matches!(self, Family::Gemma | Family::Qwen3Next)
    }
}

/// The MLP activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh`: GELU with the tanh approximation.
    GeluTanh,
    /// `gelu`: exact GELU.
    Gelu,
    /// `quick_gelu`: `x * sigmoid(1.702 x)` (CLIP's towers; no text model uses it).
    QuickGelu,
}

/// Attention pattern of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionKind {
    /// Causal over the whole sequence.
    Full,
    /// Causal over the last `sliding_window` positions (itself included).
    Sliding,
    /// Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5).
    Linear,
    /// Causal within chunks of `attention_chunk` positions (Llama 4's local attention).
    Chunked,
}

/// The architecture, validated; everything the layout and the model math need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub model_type: String,
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP's width; 0 where no layer has one (Qwen3.5-MoE).
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub hidden_act: Activation,
    pub tie_word_embeddings: bool,
    /// q_proj, k_proj and v_proj carry biases.
    pub qkv_bias: bool,
    /// o_proj carries a bias.
    pub o_bias: bool,
    /// gate_proj, up_proj and down_proj carry biases.
    pub mlp_bias: bool,
    /// Per-head RMSNorm of queries and keys (`self_attn.q_norm`, `self_attn.k_norm`).
    pub qk_norm: bool,
    /// One entry per layer.
    pub layer_types: Vec<AttentionKind>,
    /// Window of the `Sliding` layers (set whenever one exists).
    pub sliding_window: Option<usize>,
    /// RoPE of the full-attention layers (and of all layers unless `rope_local` is set).
    pub rope: RopeSpec,
    /// RoPE of the sliding-window layers where it differs (Gemma 3's local base).
    pub rope_local: Option<RopeSpec>,
    /// Multiplies q·k before the softmax.
    pub attn_scale: f64,
    /// `cap * tanh(scores / cap)` on attention scores (Gemma 2).
    pub attn_softcap: Option<f64>,
    /// `cap * tanh(logits / cap)` on the output logits (Gemma).
    pub final_softcap: Option<f64>,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f64>,
    pub max_position_embeddings: usize,
    pub initializer_range: f64,
    /// Token id the launcher pads batches with.
    pub pad_token_id: i64,
    /// Row of the embedding that gets no gradient (`nn.Embedding(padding_idx=pad_token_id)`).
    pub embed_padding_idx: Option<i64>,
    /// Sparse MLP blocks (mixture of experts).
    pub moe: Option<MoeSpec>,
    /// Shape of the `Linear` layers.
    pub linear_attn: Option<LinearAttnSpec>,
    /// q_proj also yields a per-channel gate: `o_proj(attn * sigmoid(gate))` (Qwen3-Next).
    pub attn_output_gate: bool,
    /// A learned per-head sink logit joins each softmax (`self_attn.sinks`, GPT-OSS).
    pub attn_sinks: bool,
    /// Window of the `Chunked` layers (set whenever one exists).
    pub attention_chunk: Option<usize>,
    /// RoPE rotates adjacent pairs (2i, 2i+1) instead of the halves (i, i + R/2) (GLM-4,
    /// DeepSeek-V3 with `rope_interleave`, Llama 4).
    pub rope_interleaved: bool,
    /// DeepSeek-V3's multi-head latent attention.
    pub mla: Option<MlaSpec>,
    /// Llama 4's NoPE layers, query/key L2 norm and attention temperature.
    pub llama4: Option<Llama4Attn>,
    /// The multimodal class config.json describes, when the text model is wrapped in one
    /// (its `model_type`: `gemma3`, `qwen3_5`, ...).
    pub wrapper: Option<String>,
    /// Where the checkpoint keeps the text model's tensors.
    pub names: TextNames,
    /// The checkpoint keeps Gemma 3's SigLIP or LLaVA-NeXT's CLIP tower under
    /// `vision_tower.vision_model.` (the hub's original uploads) rather than `vision_tower.`
    /// (transformers 5.17's): a trained tower's layout names follow
    /// ([`crate::config::vision::TowerSpec::layout_name`]). Settled from the weight files
    /// (`checkpoint::carried::resolve`); false without them.
    #[serde(default)]
    pub tower_nested: bool,
    /// Multi-token-prediction layers the checkpoint numbers after the decoder layers
    /// (`num_nextn_predict_layers` of GLM-4.5 and DeepSeek-V3): carried, not trained.
    pub mtp_layers: usize,
    /// Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's multimodal RoPE: 3-D positions (temporal,
    /// height, width), each rotating its own section of the frequencies; None for a 1-D
    /// RoPE.
    pub mrope: Option<Mrope>,
}

impl ModelSpec {
    /// Whether layer `layer`'s MLP is a sparse mixture-of-experts block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers[layer])
    }

    /// Name of the MLP module in a decoder layer (`feed_forward` in Llama 4).
    pub fn mlp_name(&self) -> &'static str {
        match self.family {
            Family::Llama4 => "feed_forward",
            _ => "mlp",
        }
    }

    /// The tensors a layer reads that are not trained (buffers): name inside the layer
    /// and shape. Their values come from the checkpoint (zeros at random init, as
    /// transformers initializes them) and stay as read.
    pub fn layer_buffers(&self, layer: usize) -> Vec<(&'static str, Vec<usize>)> {
        match &self.moe {
            Some(m)
                if m.sparse_layers[layer]
                    && matches!(m.router, Router::SigmoidGroupTopK { .. }) =>
            {
                vec![("mlp.gate.e_score_correction_bias", vec![m.num_experts])]
            }
            _ => vec![],
        }
    }

    /// The value random init gives every element of a tensor named `name` (inside its
    /// block), or None for a normal draw: norms 1 (0 where they act as `1 + w`), biases
    /// 0, and the Gated DeltaNet's `dt_bias` 1 and `A_log` 0 (decay rate 1).
    pub fn constant_init(&self, name: &str) -> Option<f32> {
        let plain_norm = name.ends_with("linear_attn.norm.weight");
        if name.ends_with("norm.weight") {
            Some(if self.family.norm_adds_one() && !plain_norm {
                0.0
            } else {
                1.0
            })
        } else if name.ends_with(".bias") || name.ends_with("_bias") && !name.ends_with("dt_bias") {
            Some(0.0)
        } else if name.ends_with("dt_bias") {
            Some(1.0)
        } else if name.ends_with("A_log") {
            Some(0.0)
        } else {
            None
        }
    }
}

impl ModelSpec {
    /// Reads and validates `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<ModelSpec> {
        let path = dir.join("config.json");
        let text = crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "model config")?;
        // The path to a value of the wrong type or out of range (`vocab_size`: a number
        // past 2^64) is named.
        let de = &mut serde_json::Deserializer::from_str(&text);
        let hf: HfConfig =
            serde_path_to_error::deserialize(de).map_err(|e| Error::ModelConfig {
                path: path.clone(),
                msg: match e.path().to_string().as_str() {
                    "." => format!("not a valid config.json: {}", e.inner()),
                    key => format!("not a valid config.json: `{key}`: {}", e.inner()),
                },
            })?;
        ModelSpec::from_hf(&hf, &path)
    }

    pub fn from_hf(hf: &HfConfig, path: &Path) -> Result<ModelSpec> {
        let err = |msg: String| Error::ModelConfig {
            path: path.into(),
            msg,
        };
        let need = |v: Option<usize>, key: &str| {
            v.filter(|&n| n > 0)
                .ok_or_else(|| err(format!("`{key}` is missing or not a positive integer")))
        };
        let model_type = hf
            .model_type
            .clone()
            .ok_or_else(|| err("`model_type` is missing".into()))?;
        if let Some(w) = wrapper::unwrap(hf, &model_type, &err)? {
            let mut spec = ModelSpec::from_hf(&w.text, path).map_err(|e| match e {
                Error::ModelConfig { path, msg } => Error::ModelConfig {
                    path,
                    msg: format!("`text_config` of `{model_type}`: {msg}"),
                },
                other => other,
            })?;
            // Gemma3ForConditionalGeneration's head does not soft-cap the logits its text
            // model would (real Gemma 3 configs set no cap, so both agree there).
            if model_type == "gemma3" {
                spec.final_softcap = None;
            }
            // Where images sit in the ids is the wrapper's to say.
            if let Some(m) = spec.mrope.as_mut() {
                m.place_images(hf, &err)?;
            }
            spec.wrapper = Some(model_type);
            spec.names = w.names;
            return Ok(spec);
        }
        let Some(def) = defaults(&model_type) else {
            let wrappers: Vec<&str> = wrapper::wrapper_types().collect();
            return Err(err(format!(
                "unsupported model_type `{model_type}`; supported: {}; multimodal wrappers of these: {}",
                SUPPORTED_MODEL_TYPES.join(", "),
                wrappers.join(", ")
            )));
        };
        sizes::check(hf, &err)?;
        let family = def.family;
        let gemma3 = model_type == "gemma3_text";

        let hidden_size = need(hf.hidden_size, "hidden_size")?;
        let num_heads = need(hf.num_attention_heads, "num_attention_heads")?;
        let num_layers = need(hf.num_hidden_layers, "num_hidden_layers")?;
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(err(format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let mla = attn::mla_spec(hf, &model_type, num_heads, num_kv_heads, &err)?;
        let qwen2_5_vl = model_type == "qwen2_5_vl_text";
        let qwen3_vl = model_type == "qwen3_vl_text";
        // DeepSeek-V3's config sets head_dim to the rotary part of a head; Qwen2.5-VL's
        // attention ignores `head_dim` (hidden_size / heads).
        let head_dim = match mla
            .as_ref()
            .map(|(m, _)| m.qk_rope_head_dim)
            .or(hf.head_dim.filter(|_| !qwen2_5_vl))
            .or(def.head_dim)
        {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => {
                return Err(err(format!(
                    "hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads}) and head_dim is not given"
                )));
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(err(format!("head_dim ({head_dim}) must be even and > 0")));
        }

        let act_name = if family == Family::Gemma {
            hf.hidden_activation.as_deref()
        } else {
            hf.hidden_act.as_deref()
        }
        .unwrap_or(def.act);
        let hidden_act = match act_name {
            "silu" | "swish" => Activation::Silu,
            "gelu_pytorch_tanh" => Activation::GeluTanh,
            "gelu" => Activation::Gelu,
            other => {
                return Err(err(format!(
                    "activation `{other}` is not supported (supported: silu, gelu_pytorch_tanh, gelu)"
                )));
            }
        };

        for (key, p) in [
            ("attention_dropout", hf.attention_dropout),
            ("resid_pdrop", hf.resid_pdrop),
            ("embd_pdrop", hf.embd_pdrop),
        ] {
            if let Some(p) = p.filter(|&p| p != 0.0) {
                return Err(err(format!(
                    "`{key}` is {p}: dropout is not implemented; set it to 0"
                )));
            }
        }
        if hf.use_bidirectional_attention == Some(true) {
            return Err(err(
                "`use_bidirectional_attention: true` is not supported (causal LM training only)"
                    .into(),
            ));
        }

        // Biases, as each family's modeling code hard-wires or reads them.
        let attention_bias = hf.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match model_type.as_str() {
            "qwen2" | "qwen2_5_vl_text" => (true, false),
            "qwen2_moe" => (hf.qkv_bias.unwrap_or(true), false),
            "mistral" | "phi3" | "mixtral" => (false, false),
            "glm4" => (hf.attention_bias.unwrap_or(true), false),
            "glm4_moe" => (attention_bias, false),
            "gpt_oss" => (
                hf.attention_bias.unwrap_or(true),
                hf.attention_bias.unwrap_or(true),
            ),
            // DeepSeek-V3's "q/k/v" biases are q_a_proj's and kv_a_proj_with_mqa's.
            _ => (attention_bias, attention_bias),
        };
        let mlp_bias = model_type == "llama" && hf.mlp_bias.unwrap_or(false);

        let (sliding_window, mut layer_types) =
            attention_kinds(hf, &model_type, &def, num_layers, &err)?;
        let (llama4, attention_chunk) = match attn::llama4_attn(hf, &model_type, num_layers, &err)?
        {
            Some((attn, kinds, chunk)) => {
                layer_types = kinds;
                (Some(attn), chunk)
            }
            None => (None, None),
        };
        let glm = matches!(model_type.as_str(), "glm4" | "glm4_moe");
        let any_sliding = layer_types.contains(&AttentionKind::Sliding);
        let max_position_embeddings = hf.max_position_embeddings.unwrap_or(def.max_pos);
        let ctx = RopeCtx {
            head_dim,
            max_pos: max_position_embeddings,
            top_original: hf.original_max_position_embeddings,
            top_partial: hf
                .partial_rotary_factor
                .or((family == Family::Qwen3Next).then_some(0.25))
                .or(glm.then_some(0.5)),
            phi3: family == Family::Phi3,
            partial_ok: matches!(family, Family::Phi3 | Family::Qwen3Next) || glm,
            default_theta: match family {
                Family::Llama4 => 500_000.0,
                _ if qwen2_5_vl => 1_000_000.0,
                _ if qwen3_vl => 500_000.0,
                _ => 10_000.0,
            },
            mrope: qwen2_5_vl || qwen3_vl,
        };
        let (rope, rope_local) = if family == Family::GptOss && hf.rope_scaling.is_none() {
            // GptOssConfig's default when config.json names no RoPE: YaRN x32 from 4096.
            let mut hf = hf.clone();
            hf.rope_parameters = hf.rope_parameters.take().or_else(|| {
                Some(
                    serde_json::json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096}),
                )
            });
            hf.rope_theta = hf.rope_theta.or(Some(150_000.0));
            ropes(&hf, gemma3, any_sliding, &ctx, &err)?
        } else {
            ropes(hf, gemma3, any_sliding, &ctx, &err)?
        };

        let gemma = family == Family::Gemma;
        let attn_scale = if gemma {
            hf.query_pre_attn_scalar.unwrap_or(256.0).powf(-0.5)
        } else if let Some((_, scale)) = &mla {
            *scale
        } else {
            (head_dim as f64).powf(-0.5)
        };
        let softcap = |v: Option<Option<f64>>, default: Option<f64>| {
            v.unwrap_or(default).filter(|&c| c > 0.0)
        };
        // Gemma 3's attention in transformers ignores `attn_logit_softcapping`.
        let attn_softcap =
            softcap(hf.attn_logit_softcapping, Some(50.0)).filter(|_| model_type == "gemma2");
        let final_softcap = if gemma {
            softcap(hf.final_logit_softcapping, (!gemma3).then_some(30.0))
        } else {
            None
        };

        // Gemma 3's hub configs leave it to `Gemma3TextConfig`'s default.
        let vocab_default = gemma3.then_some(262_208);
        let vocab_size = need(hf.vocab_size.or(vocab_default), "vocab_size")?;
        let pad = match &hf.pad_token_id {
            Some(Value::Number(n)) => n.as_i64(),
            _ => None,
        };
        let embed_padding_idx = match pad {
            Some(p) if (-(vocab_size as i64)..vocab_size as i64).contains(&p) => {
                Some(p.rem_euclid(vocab_size as i64))
            }
            Some(p) => {
                return Err(err(format!(
                    "pad_token_id ({p}) is outside the vocabulary (vocab_size {vocab_size})"
                )));
            }
            None => None,
        };
        let moe = match moe_sigmoid::moe_spec(hf, &model_type, num_layers, &err)? {
            Some(m) => Some(m),
            None => moe::moe_spec(hf, &model_type, num_layers, &err)?,
        };
        let qk_norm = match model_type.as_str() {
            "glm4_moe" => hf.use_qk_norm.unwrap_or(false),
            "olmo2" => true,
            _ => matches!(family, Family::Qwen3 | Family::Qwen3Next) || gemma3,
        };
        let rope_interleaved = match family {
            Family::Glm4 | Family::Llama4 => true,
            Family::DeepseekV3 => hf.rope_interleave.unwrap_or(true),
            _ => false,
        };
        let mtp_layers = match model_type.as_str() {
            "glm4_moe" | "deepseek_v3" => hf.num_nextn_predict_layers.unwrap_or(1),
            _ => 0,
        };
        let linear_attn = moe::linear_attn_spec(hf, &model_type, &err)?;
        // Qwen3.5's text models (dense and MoE) always compute the interleaved mrope (text
        // alone gives three equal positions, the plain RoPE).
        let mrope_kind = match model_type.as_str() {
            "qwen2_5_vl_text" => Some(MropeKind::Qwen2_5Vl),
            "qwen3_vl_text" => Some(MropeKind::Qwen3Vl),
            "qwen3_5_text" | "qwen3_5_moe_text" => Some(MropeKind::Qwen3_5),
            _ => None,
        };
        let mrope = match mrope_kind {
            Some(kind) => Some(Mrope::of_text(hf, rope.rotary_dim, kind, &err)?),
            None if mrope::names_mrope(hf) => {
                return Err(err(format!(
                    "rope type `mrope` is only supported for qwen2_5_vl and qwen3_vl (`{model_type}` given)"
                )));
            }
            None => None,
        };
        let intermediate_size = match model_type.as_str() {
            // Llama 4's dense layers; `intermediate_size` is an expert's.
            _ if family == Family::Llama4 => hf.intermediate_size_mlp.unwrap_or(16_384),
            // Qwen3.5-MoE is sparse in every layer and its config has no dense size.
            "qwen3_5_moe_text" => hf.intermediate_size.unwrap_or(0),
            _ => need(hf.intermediate_size, "intermediate_size")?,
        };
        Ok(ModelSpec {
            model_type,
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(def.rms_norm_eps),
            hidden_act,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(def.tie),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm,
            layer_types,
            sliding_window,
            rope,
            rope_local,
            attn_scale,
            attn_softcap,
            final_softcap,
            embed_scale: gemma.then(|| (hidden_size as f64).sqrt()),
            max_position_embeddings,
            initializer_range: hf.initializer_range.unwrap_or(0.02),
            pad_token_id: embed_padding_idx.unwrap_or(0),
            embed_padding_idx,
            moe,
            linear_attn,
            attn_output_gate: family == Family::Qwen3Next,
            attn_sinks: family == Family::GptOss,
            attention_chunk,
            rope_interleaved,
            mla: mla.map(|(m, _)| m),
            llama4,
            wrapper: None,
            names: TextNames::Plain,
            tower_nested: false,
            mtp_layers,
            mrope,
        })
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_families;
