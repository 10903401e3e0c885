//! Hugging Face `config.json`: the file format (`HfConfig`, lenient: HF configs carry many
//! keys we do not use) and the internal, validated architecture (`ModelSpec`) that the
//! layout and the worker's model code are built from.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Model families the worker can compute, by HF `model_type`.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama"];

/// The subset of an HF `config.json` we read.
#[derive(Debug, Clone, Deserialize)]
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
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    pub rope_scaling: Option<RopeParameters>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub initializer_range: Option<f64>,
    pub pad_token_id: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: Option<f64>,
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
}

/// The architecture, validated; everything the layout and the model math need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub initializer_range: f64,
    pub pad_token_id: i64,
}

impl ModelSpec {
    /// Reads and validates `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<ModelSpec> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|e| Error::ModelConfig {
            path: path.clone(),
            msg: format!("not a valid config.json: {e}"),
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
        if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(err(format!(
                "unsupported model_type `{model_type}`; supported: {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            )));
        }
        let hidden_size = need(hf.hidden_size, "hidden_size")?;
        let num_heads = need(hf.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(err(format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(err(format!(
                    "hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads}) and head_dim is not given"
                )));
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(err(format!("head_dim ({head_dim}) must be even and > 0")));
        }
        let rope = hf.rope_parameters.as_ref().or(hf.rope_scaling.as_ref());
        if let Some(kind) = rope.and_then(|r| r.rope_type.as_deref())
            && kind != "default"
        {
            return Err(err(format!(
                "rope type `{kind}` is not supported yet (only `default`)"
            )));
        }
        let rope_theta = hf
            .rope_theta
            .or(rope.and_then(|r| r.rope_theta))
            .unwrap_or(10_000.0);
        if let Some(act) = hf.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(err(format!(
                "hidden_act `{act}` is not supported for {model_type} (expected silu)"
            )));
        }
        let pad_token_id = match &hf.pad_token_id {
            Some(serde_json::Value::Number(n)) => n.as_i64().unwrap_or(0),
            _ => 0,
        };
        Ok(ModelSpec {
            model_type,
            vocab_size: need(hf.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: need(hf.intermediate_size, "intermediate_size")?,
            num_layers: need(hf.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            attention_bias: hf.attention_bias.unwrap_or(false),
            mlp_bias: hf.mlp_bias.unwrap_or(false),
            initializer_range: hf.initializer_range.unwrap_or(0.02),
            pad_token_id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> Result<ModelSpec> {
        let hf: HfConfig = serde_json::from_str(json).unwrap();
        ModelSpec::from_hf(&hf, Path::new("config.json"))
    }

    const TINY: &str = r#"{"model_type":"llama","vocab_size":67,"hidden_size":48,
        "intermediate_size":88,"num_hidden_layers":2,"num_attention_heads":6,
        "num_key_value_heads":2,"rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}}"#;

    #[test]
    fn reads_transformers5_rope_parameters() {
        let s = spec(TINY).unwrap();
        assert_eq!(s.head_dim, 8);
        assert_eq!(s.rope_theta, 500000.0);
        assert!(!s.tie_word_embeddings);
    }

    #[test]
    fn unsupported_type_lists_supported() {
        let e = spec(r#"{"model_type":"bert"}"#).unwrap_err().to_string();
        assert!(
            e.contains("unsupported model_type `bert`") && e.contains("llama"),
            "{e}"
        );
    }

    #[test]
    fn missing_field_is_named() {
        let e = spec(r#"{"model_type":"llama","vocab_size":5}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }
}
