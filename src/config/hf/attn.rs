//! The attention variants of DeepSeek-V3 (multi-head latent attention) and Llama 4 (NoPE
//! layers, chunked local attention, query/key L2 norm, attention temperature), resolved the
//! way their transformers config classes resolve them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{AttentionKind, HfConfig};
use crate::error::{Error, Result};

/// DeepSeek-V3's multi-head latent attention (`modeling_deepseek_v3.py`): queries through an
/// optional low-rank bottleneck, keys and values from one compressed latent of
/// `kv_lora_rank` dims plus a `qk_rope_head_dim` key part shared by every head. Query and
/// key heads are `qk_nope_head_dim + qk_rope_head_dim` wide, value heads `v_head_dim`; RoPE
/// acts on the last `qk_rope_head_dim` dims (the spec's `head_dim`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` through this rank; None: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaSpec {
    /// Width of a query or key head.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// The MLA shape of `deepseek_v3` (None for other types) and its softmax scale:
/// `qk_head_dim^-1/2`, times `mscale(factor, mscale_all_dim)^2` when the RoPE is scaled and
/// names `mscale_all_dim` (DeepSeek's YaRN), as `yarn_apply_mscale` does.
pub(super) fn mla_spec(
    hf: &HfConfig,
    model_type: &str,
    num_heads: usize,
    num_kv_heads: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<(MlaSpec, f64)>> {
    if model_type != "deepseek_v3" {
        return Ok(None);
    }
    let pos = |v: Option<usize>, default: usize, key: &str| match v.unwrap_or(default) {
        0 => Err(err(format!("`{key}` must be a positive integer"))),
        n => Ok(n),
    };
    let q_lora_rank = match hf.q_lora_rank {
        None => Some(1536),
        Some(None) => None,
        Some(Some(0)) => {
            return Err(err(
                "`q_lora_rank` must be a positive integer or null".into()
            ));
        }
        Some(r) => r,
    };
    let mla = MlaSpec {
        q_lora_rank,
        kv_lora_rank: pos(hf.kv_lora_rank, 512, "kv_lora_rank")?,
        qk_nope_head_dim: pos(hf.qk_nope_head_dim, 128, "qk_nope_head_dim")?,
        qk_rope_head_dim: pos(hf.qk_rope_head_dim, 64, "qk_rope_head_dim")?,
        v_head_dim: pos(hf.v_head_dim, 128, "v_head_dim")?,
    };
    if num_kv_heads != num_heads {
        return Err(err(format!(
            "`num_key_value_heads` ({num_kv_heads}) must equal `num_attention_heads` ({num_heads}): multi-head latent attention gives every head its own key and value"
        )));
    }
    let mut scale = (mla.qk_head_dim() as f64).powf(-0.5);
    let dict = hf
        .rope_scaling
        .as_ref()
        .or(hf.rope_parameters.as_ref())
        .and_then(Value::as_object);
    if let Some(d) = dict {
        let kind = d.get("rope_type").or_else(|| d.get("type"));
        let all_dim = d.get("mscale_all_dim").and_then(Value::as_f64);
        let factor = d.get("factor").and_then(Value::as_f64);
        if let (Some(kind), Some(all_dim), Some(factor)) = (kind, all_dim, factor)
            && kind.as_str() != Some("default")
            && all_dim != 0.0
            && factor > 1.0
        {
            let m = 0.1 * all_dim * factor.ln() + 1.0;
            scale *= m * m;
        }
    }
    Ok(Some((mla, scale)))
}

/// Llama 4's attention: which layers rotate (the others are NoPE layers) and what they add.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Llama4Attn {
    /// Per layer: RoPE (true) or no positional encoding (false).
    pub rope_layers: Vec<bool>,
    /// Queries and keys of RoPE layers are L2-normalized after the rotation (`use_qk_norm`;
    /// no weight, eps `rms_norm_eps`).
    pub qk_l2_norm: bool,
    /// NoPE layers scale queries by `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`
    /// (`attn_temperature_tuning`): (`floor_scale`, `attn_scale`).
    pub temperature: Option<(f64, f64)>,
}

/// Llama 4's attention options, each layer's kind (`Chunked` or `Full`) and the chunk size.
pub(super) type Llama4Layers = (Llama4Attn, Vec<AttentionKind>, Option<usize>);

/// The Llama 4 attention of `llama4_text`; None for other types. `layer_types` wins when
/// given; otherwise the RoPE layers are chunked, as `Llama4TextConfig` derives them.
pub(super) fn llama4_attn(
    hf: &HfConfig,
    model_type: &str,
    num_layers: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<Llama4Layers>> {
    if model_type != "llama4_text" {
        return Ok(None);
    }
    let rope_layers: Vec<bool> = match &hf.no_rope_layers {
        Some(v) if !v.is_empty() => {
            if v.len() < num_layers {
                return Err(err(format!(
                    "`no_rope_layers` has {} entries for {num_layers} layers",
                    v.len()
                )));
            }
            v.iter().take(num_layers).map(|&x| x != 0).collect()
        }
        _ => {
            let every = hf.no_rope_layer_interval.unwrap_or(4);
            if every == 0 {
                return Err(err("`no_rope_layer_interval` must be >= 1".into()));
            }
            (0..num_layers)
                .map(|i| !(i + 1).is_multiple_of(every))
                .collect()
        }
    };
    let kinds: Vec<AttentionKind> = match &hf.layer_types {
        Some(given) => {
            if given.len() != num_layers {
                return Err(err(format!(
                    "`layer_types` has {} entries for {num_layers} layers",
                    given.len()
                )));
            }
            given
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(AttentionKind::Full),
                    "chunked_attention" => Ok(AttentionKind::Chunked),
                    other => Err(err(format!(
                        "`layer_types` entry `{other}` is not supported here (chunked_attention, full_attention)"
                    ))),
                })
                .collect::<Result<_>>()?
        }
        None => rope_layers
            .iter()
            .map(|&r| match r {
                true => AttentionKind::Chunked,
                false => AttentionKind::Full,
            })
            .collect(),
    };
    let chunk = hf.attention_chunk_size.unwrap_or(Some(8192));
    if kinds.contains(&AttentionKind::Chunked) && chunk.is_none_or(|c| c == 0) {
        return Err(err(
            "`attention_chunk_size` must be a positive integer: the model has chunked_attention layers"
                .into(),
        ));
    }
    let temperature = match hf.attn_temperature_tuning.unwrap_or(true) {
        true => {
            let floor = hf.floor_scale.unwrap_or(8192.0);
            if !(floor.is_finite() && floor > 0.0) {
                return Err(err(format!("`floor_scale` ({floor}) must be > 0")));
            }
            Some((floor, hf.attn_scale.unwrap_or(0.1)))
        }
        false => None,
    };
    let attn = Llama4Attn {
        rope_layers,
        qk_l2_norm: hf.use_qk_norm.unwrap_or(true),
        temperature,
    };
    let chunk = chunk.filter(|_| kinds.contains(&AttentionKind::Chunked));
    Ok(Some((attn, kinds, chunk)))
}
