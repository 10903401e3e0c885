//! Which attention pattern each decoder layer has, as each family's config class and model
//! decide it.

use super::moe;
use super::{AttentionKind, Defaults, HfConfig};
use crate::error::{Error, Result};

/// Which layers slide and the window, as each family's config class and model decide:
/// Mistral and Phi-3 slide every layer when `sliding_window` is set; Qwen2/3 the layers from
/// `max_window_layers` on when `use_sliding_window`; Gemma 2 every other layer; Gemma 3 all
/// but every `sliding_window_pattern`-th. A `layer_types` list in config.json wins (except
/// for Mistral and Phi-3, whose models ignore it).
pub(super) fn attention_kinds(
    hf: &HfConfig,
    model_type: &str,
    def: &Defaults,
    num_layers: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<(Option<usize>, Vec<AttentionKind>)> {
    let pattern = |slides: &dyn Fn(usize) -> bool| -> Vec<AttentionKind> {
        (0..num_layers)
            .map(|i| {
                if slides(i) {
                    AttentionKind::Sliding
                } else {
                    AttentionKind::Full
                }
            })
            .collect()
    };
    let window = hf.sliding_window.unwrap_or(def.sliding_window);
    let (window, kinds) = match model_type {
        // Llama 4's chunked layers come from `attn.rs`.
        "llama" | "olmo2" | "glm4" | "glm4_moe" | "deepseek_v3" | "llama4_text"
        | "qwen3_vl_text" => (None, pattern(&|_| false)),
        "qwen3_next" | "qwen3_5_text" | "qwen3_5_moe_text" => {
            (None, moe::hybrid_layer_types(hf, num_layers, err)?)
        }
        "mistral" | "phi3" | "mixtral" => (window, pattern(&|_| window.is_some())),
        // Qwen3-MoE slides every layer when `use_sliding_window`.
        "qwen3_moe" => {
            let window = window.filter(|_| hf.use_sliding_window.unwrap_or(false));
            (window, pattern(&|_| window.is_some()))
        }
        // Qwen2-MoE: every other layer (0, 2, …) below `max_window_layers`.
        "qwen2_moe" => {
            let window = window.filter(|_| hf.use_sliding_window.unwrap_or(false));
            let below = hf.max_window_layers.unwrap_or(28);
            let computed = pattern(&|i| window.is_some() && i % 2 == 0 && i < below);
            (window, layer_types(hf, num_layers, computed, err)?)
        }
        "qwen2" | "qwen3" | "qwen2_5_vl_text" => {
            let window = window.filter(|_| hf.use_sliding_window.unwrap_or(false));
            let default_from = if model_type == "qwen2_5_vl_text" {
                80
            } else {
                28
            };
            let from = hf.max_window_layers.unwrap_or(default_from);
            let computed = pattern(&|i| window.is_some() && i >= from);
            (window, layer_types(hf, num_layers, computed, err)?)
        }
        _ => {
            let every = if matches!(model_type, "gemma2" | "gpt_oss") {
                2
            } else {
                hf.sliding_window_pattern.unwrap_or(6).max(1)
            };
            let computed = pattern(&|i| !(i + 1).is_multiple_of(every));
            (window, layer_types(hf, num_layers, computed, err)?)
        }
    };
    let any_sliding = kinds.contains(&AttentionKind::Sliding);
    if any_sliding && window.is_none_or(|w| w == 0) {
        return Err(err(
            "`layer_types` has sliding_attention layers but `sliding_window` is not a positive integer".into(),
        ));
    }
    Ok((window.filter(|_| any_sliding), kinds))
}

/// `layer_types` from config.json when present (checked), else the family's pattern.
fn layer_types(
    hf: &HfConfig,
    num_layers: usize,
    computed: Vec<AttentionKind>,
    err: &dyn Fn(String) -> Error,
) -> Result<Vec<AttentionKind>> {
    let Some(given) = &hf.layer_types else {
        return Ok(computed);
    };
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
            "sliding_attention" => Ok(AttentionKind::Sliding),
            other => Err(err(format!(
                "`layer_types` entry `{other}` is not supported (full_attention, sliding_attention)"
            ))),
        })
        .collect()
}
