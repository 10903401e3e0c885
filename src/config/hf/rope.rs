//! RoPE settings of a config.json, standardized as transformers'
//! `RotaryEmbeddingConfigMixin` does: the variant (`rope_type`, or the legacy `type`), its
//! parameters with their defaults, and derived values (YaRN's and LongRoPE's attention
//! factor) resolved once, so the worker's `rope.rs` only computes frequencies.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::HfConfig;
use crate::error::{Error, Result};

/// RoPE variants (`rope_type`) we compute.
pub const SUPPORTED_ROPE_TYPES: &[&str] =
    &["default", "linear", "dynamic", "llama3", "yarn", "longrope"];

/// Rotary embedding of one layer kind, as transformers' `ROPE_INIT_FUNCTIONS` define it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Base wavelength (`rope_theta`).
    pub theta: f64,
    /// Leading dims of each head that rotate (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    Default,
    /// Frequencies divided by `factor`.
    Linear {
        factor: f64,
    },
    /// NTK: the base grows once the sequence passes `max_position_embeddings`.
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    /// Llama 3.1 piecewise frequency scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN; `attention_factor` (resolved) multiplies cos and sin.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// LongRoPE (Phi-3): per-frequency factors, long ones past the original length.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

/// What RoPE parsing needs besides the dict.
pub(super) struct RopeCtx {
    pub(super) head_dim: usize,
    pub(super) max_pos: usize,
    pub(super) top_original: Option<usize>,
    pub(super) top_partial: Option<f64>,
    pub(super) phi3: bool,
    /// The family rotates only part of each head (Phi-3, Qwen3-Next / Qwen3.5, GLM-4).
    pub(super) partial_ok: bool,
    /// `rope_theta` when config.json names none (the config class's `default_theta`).
    pub(super) default_theta: f64,
    /// The family reads `rope_type: mrope` as `default` (Qwen2.5-VL's text model; its
    /// sections are `mrope.rs`'s).
    pub(super) mrope: bool,
}

impl RopeCtx {
    /// One RoPE dict (absent: default RoPE with `theta`) as transformers standardizes it.
    pub(super) fn parse(
        &self,
        dict: Option<&Map<String, Value>>,
        theta: f64,
        which: &str,
        err: &dyn Fn(String) -> Error,
    ) -> Result<RopeSpec> {
        let empty = Map::new();
        let m = dict.unwrap_or(&empty);
        let key = |k: &str| {
            if which.is_empty() {
                format!("rope_parameters.{k}")
            } else {
                format!("rope_parameters.{which}.{k}")
            }
        };
        let num = |k: &str| -> Result<Option<f64>> {
            match m.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(format!("`{}` must be a number, got {v}", key(k)))),
            }
        };
        let need = |k: &str| -> Result<f64> {
            num(k)?.ok_or_else(|| err(format!("`{}` is required for this rope type", key(k))))
        };
        let list = |k: &str| -> Result<Vec<f64>> {
            m.get(k)
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| err(format!("`{}` must be a list of numbers", key(k))))
        };
        let mut kind = m
            .get("rope_type")
            .or_else(|| m.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if self.phi3 && matches!(kind, "su" | "yarn") {
            kind = "longrope"; // transformers' Phi-3 renames its legacy types
        }
        if self.mrope && kind == "mrope" {
            kind = "default"; // Qwen2_5_VLTextConfig's standardization
        }
        let theta = num("rope_theta")?.unwrap_or(theta);
        if !(theta.is_finite() && theta > 1.0) {
            return Err(err(format!(
                "`{}` ({theta}) must be > 1",
                key("rope_theta")
            )));
        }
        let partial = num("partial_rotary_factor")?
            .or(self.top_partial)
            .unwrap_or(1.0);
        if partial != 1.0 && !self.partial_ok {
            return Err(err(format!(
                "`partial_rotary_factor` ({partial}) is only supported for phi3, qwen3_next, qwen3_5_text, glm4 and glm4_moe"
            )));
        }
        let rotary_dim = (self.head_dim as f64 * partial) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > self.head_dim {
            return Err(err(format!(
                "rotary dim {rotary_dim} (head_dim {} x partial_rotary_factor {partial}) must be even, > 0 and <= head_dim",
                self.head_dim
            )));
        }
        // transformers gives a top-level `original_max_position_embeddings` priority.
        let original = || -> Result<usize> {
            let v = match self.top_original {
                Some(v) => v,
                None => num("original_max_position_embeddings")?
                    .map(|v| v as usize)
                    .unwrap_or(self.max_pos),
            };
            if v == 0 {
                return Err(err(format!(
                    "`{}` must be > 0",
                    key("original_max_position_embeddings")
                )));
            }
            Ok(v)
        };
        let factor_at_least_one = |f: f64| -> Result<f64> {
            if f.is_finite() && f >= 1.0 {
                Ok(f)
            } else {
                Err(err(format!("`{}` ({f}) must be >= 1", key("factor"))))
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: factor_at_least_one(need("factor")?)?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: factor_at_least_one(need("factor")?)?,
                max_position_embeddings: self.max_pos,
            },
            "llama3" => {
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                // Equal factors (Llama 4 Scout) leave no band to smooth; transformers warns.
                if high < low {
                    return Err(err(format!(
                        "`{}` ({high}) must be at least `low_freq_factor` ({low})",
                        key("high_freq_factor")
                    )));
                }
                RopeScaling::Llama3 {
                    factor: factor_at_least_one(need("factor")?)?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: original()?,
                }
            }
            "yarn" => {
                let original = original()?;
                let factor = num("factor")?.unwrap_or(self.max_pos as f64 / original as f64);
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None => match (num("mscale")?, num("mscale_all_dim")?) {
                        (Some(a), Some(b)) if a != 0.0 && b != 0.0 => {
                            mscale(factor, a) / mscale(factor, b)
                        }
                        _ => mscale(factor, 1.0),
                    },
                };
                // transformers' `get(..) or default`: 0 means the default too.
                let beta = |k: &str, d: f64| -> Result<f64> {
                    Ok(num(k)?.filter(|&b| b != 0.0).unwrap_or(d))
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: beta("beta_fast", 32.0)?,
                    beta_slow: beta("beta_slow", 1.0)?,
                    attention_factor,
                    truncate: m.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            "longrope" => {
                let original = original()?;
                let (short, long) = (list("short_factor")?, list("long_factor")?);
                for (k, l) in [("short_factor", &short), ("long_factor", &long)] {
                    if l.len() != rotary_dim / 2 {
                        return Err(err(format!(
                            "`{}` has {} entries, expected rotary dim / 2 = {}",
                            key(k),
                            l.len(),
                            rotary_dim / 2
                        )));
                    }
                }
                let factor = num("factor")?.unwrap_or(self.max_pos as f64 / original as f64);
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
                };
                RopeScaling::LongRope {
                    short_factor: short,
                    long_factor: long,
                    original_max_position_embeddings: original,
                    attention_factor,
                }
            }
            other => {
                return Err(err(format!(
                    "rope type `{other}` is not supported; supported: {}",
                    SUPPORTED_ROPE_TYPES.join(", ")
                )));
            }
        };
        Ok(RopeSpec {
            theta,
            rotary_dim,
            scaling,
        })
    }
}

/// The RoPE of full-attention layers and, where it differs, of sliding ones. The dict is
/// `rope_scaling` (transformers 4) or `rope_parameters` (5); it is per layer type when it
/// has `full_attention` / `sliding_attention` keys (Gemma 3 in transformers 5). Gemma 3's
/// transformers 4 form keeps the global scaling in `rope_scaling`, the global base in
/// `rope_theta` (default 1e6) and the local one in `rope_local_base_freq` (default 1e4).
pub(super) fn ropes(
    hf: &HfConfig,
    gemma3: bool,
    any_sliding: bool,
    ctx: &RopeCtx,
    err: &dyn Fn(String) -> Error,
) -> Result<(RopeSpec, Option<RopeSpec>)> {
    let dict = hf
        .rope_scaling
        .as_ref()
        .filter(|v| !v.is_null())
        .or(hf.rope_parameters.as_ref().filter(|v| !v.is_null()));
    let dict = match dict {
        Some(Value::Object(m)) => Some(m),
        Some(other) => {
            return Err(err(format!(
                "`rope_parameters` / `rope_scaling` must be an object, got {other}"
            )));
        }
        None => None,
    };
    let nested = dict
        .is_some_and(|m| m.contains_key("full_attention") || m.contains_key("sliding_attention"));
    if !gemma3 && !nested {
        let rope = ctx.parse(dict, hf.rope_theta.unwrap_or(ctx.default_theta), "", err)?;
        return Ok((rope, None));
    }
    let part = |key: &str| -> Result<Option<&Map<String, Value>>> {
        match dict.filter(|_| nested).and_then(|m| m.get(key)) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(other) => Err(err(format!(
                "`rope_parameters.{key}` must be an object, got {other}"
            ))),
        }
    };
    let (global_theta, local_theta) = if gemma3 {
        (1_000_000.0, 10_000.0)
    } else {
        (10_000.0, 10_000.0)
    };
    let global_dict = if nested {
        part("full_attention")?
    } else {
        dict
    };
    let global = ctx.parse(
        global_dict,
        hf.rope_theta.unwrap_or(global_theta),
        "full_attention",
        err,
    )?;
    let local = ctx.parse(
        part("sliding_attention")?,
        hf.rope_local_base_freq.unwrap_or(local_theta),
        "sliding_attention",
        err,
    )?;
    Ok((global, Some(local).filter(|_| any_sliding)))
}
