//! Multimodal wrappers trained on their text model. The hub serves the newest models as
//! image-text classes (`Qwen3_5ForConditionalGeneration`, `Gemma3ForConditionalGeneration`,
//! `Mistral3ForConditionalGeneration`, `Llama4ForConditionalGeneration`,
//! `LlavaNextForConditionalGeneration`): a config.json whose
//! `text_config` is the text model's config, and a checkpoint that keeps the text model under
//! a prefix beside a vision tower, a projector and extra heads. The text model trains exactly
//! as its text-only class would; the rest is carried (`checkpoint::carried`).
//!
//! Three name layouts exist for the text model's tensors: the current one
//! (`model.language_model.layers.N.…`, `lm_head.weight`), the legacy one the original hub
//! uploads of Gemma 3, Mistral 3, Llama 4 and LLaVA-NeXT use and transformers 5 still writes for them
//! (`language_model.model.layers.N.…`, `language_model.lm_head.weight`), and the text-only
//! class's own names beside a top-level `visual.*` (the hub's Qwen2.5-VL uploads, which
//! transformers 5.17 reads into its current names and writes back as they were; other
//! tools save Qwen2.5-VL under the current names). [`TextNames`] maps the text-only class's
//! names (the layout's) to each.
//!
//! Qwen2.5-VL's hub config.json is flat: the text model's keys sit at the top level beside
//! `vision_config` (transformers 5 reads them into `text_config`); both shapes load.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::HfConfig;
use crate::error::{Error, Result};

/// The hub's prefix of a Qwen2.5-VL vision tower (`visual.patch_embed.proj.weight`).
pub const TOWER: &str = "visual.";

/// Where a checkpoint keeps the text model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TextNames {
    /// A text-only class: `model.…`, `lm_head.weight`; in a wrapper's checkpoint, every
    /// other name (`visual.…`) is outside the text model.
    Plain,
    /// A wrapper, current names: `model.language_model.…`, `lm_head.weight`.
    Current,
    /// A wrapper, legacy names: `language_model.model.…`, `language_model.lm_head.weight`.
    Legacy,
}

impl TextNames {
    /// The checkpoint name of a text-only class's tensor (`model.norm.weight`), or of a
    /// trained vision tower's tensor under its hub name (`visual.merger.ln_q.weight`,
    /// LLaVA-NeXT's `multi_modal_projector.linear_1.weight` and `image_newline`, Gemma 3's
    /// and LLaVA-NeXT's `vision_tower.encoder.layers.0.mlp.fc1.weight`), which
    /// transformers 5's current names keep under `model.`.
    pub fn hf<'a>(self, canonical: &'a str) -> Cow<'a, str> {
        use crate::config::vision::{VIT_TOWER, beside_tower};
        if canonical.starts_with(TOWER)
            || canonical.starts_with(VIT_TOWER)
            || beside_tower(canonical)
        {
            return match self {
                TextNames::Current => Cow::Owned(format!("model.{canonical}")),
                TextNames::Plain | TextNames::Legacy => Cow::Borrowed(canonical),
            };
        }
        match self {
            TextNames::Plain => Cow::Borrowed(canonical),
            TextNames::Current => match canonical.strip_prefix("model.") {
                Some(rest) => Cow::Owned(format!("model.language_model.{rest}")),
                None => Cow::Borrowed(canonical),
            },
            TextNames::Legacy => Cow::Owned(format!("language_model.{canonical}")),
        }
    }

    /// The text-only class's name of a checkpoint tensor, or None when the tensor is not
    /// the text model's (a vision tower, a projector, an extra head).
    pub fn canonical(self, hf: &str) -> Option<Cow<'_, str>> {
        let text = |n: &str| n.starts_with("model.") || n.starts_with("lm_head.");
        match self {
            TextNames::Plain => text(hf).then_some(Cow::Borrowed(hf)),
            TextNames::Current => match hf.strip_prefix("model.language_model.") {
                Some(rest) => Some(Cow::Owned(format!("model.{rest}"))),
                None => hf.starts_with("lm_head.").then_some(Cow::Borrowed(hf)),
            },
            TextNames::Legacy => hf
                .strip_prefix("language_model.")
                .filter(|rest| text(rest))
                .map(Cow::Borrowed),
        }
    }

    /// The wrapper layout a checkpoint's tensor names use (None: none of its names says).
    /// A wrapper's checkpoint under the text-only class's names (`model.layers.N.…`,
    /// `model.embed_tokens.weight`) is [`TextNames::Plain`].
    pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<TextNames> {
        names.into_iter().find_map(|n| {
            if n.starts_with("model.language_model.") {
                Some(TextNames::Current)
            } else if n.starts_with("language_model.model.") {
                Some(TextNames::Legacy)
            } else if n.starts_with("model.layers.") || n == "model.embed_tokens.weight" {
                Some(TextNames::Plain)
            } else {
                None
            }
        })
    }
}

/// A wrapper class: its `model_type`, its text model's default `model_type`, the names
/// transformers 5.17's `save_pretrained` writes for it, where its tying flag lives, and
/// whether its hub configs may be flat.
struct WrapperClass {
    model_type: &'static str,
    text_model_type: &'static str,
    names: TextNames,
    tie: Tie,
    /// Without `text_config`, the text model's keys are the top level's (Qwen2.5-VL's hub
    /// config.json).
    flat: bool,
}

/// Which `tie_word_embeddings` ties a wrapper's embedding and head.
#[derive(Clone, Copy)]
enum Tie {
    /// The wrapper's own (this default when absent).
    Top(bool),
    /// The text config's (Llama 4, whose text model is a `Llama4ForCausalLM`).
    Text,
    /// Either: the wrapper's (default false), or a text config's `true` (Qwen2.5-VL: pre-v5
    /// saves kept the flag in `text_config`, and `Qwen2_5_VLConfig` forwards it).
    Either,
}

const WRAPPERS: &[WrapperClass] = &[
    WrapperClass {
        model_type: "qwen3_5",
        text_model_type: "qwen3_5_text",
        names: TextNames::Current,
        tie: Tie::Top(false),
        flat: false,
    },
    WrapperClass {
        model_type: "qwen3_5_moe",
        text_model_type: "qwen3_5_moe_text",
        names: TextNames::Current,
        tie: Tie::Top(false),
        flat: false,
    },
    WrapperClass {
        model_type: "gemma3",
        text_model_type: "gemma3_text",
        names: TextNames::Legacy,
        tie: Tie::Top(true),
        flat: false,
    },
    WrapperClass {
        model_type: "mistral3",
        text_model_type: "mistral",
        names: TextNames::Legacy,
        tie: Tie::Top(true),
        flat: false,
    },
    WrapperClass {
        model_type: "llama4",
        text_model_type: "llama4_text",
        names: TextNames::Legacy,
        tie: Tie::Text,
        flat: false,
    },
    // LLaVA-NeXT (llava-hf/llava-v1.6-*): transformers 5.17 writes the legacy names, as the
    // hub's uploads have them, beside `vision_tower.*`, `multi_modal_projector.*` and
    // `image_newline`.
    WrapperClass {
        model_type: "llava_next",
        text_model_type: "llama",
        names: TextNames::Legacy,
        tie: Tie::Top(false),
        flat: false,
    },
    WrapperClass {
        model_type: "qwen2_5_vl",
        text_model_type: "qwen2_5_vl_text",
        names: TextNames::Plain,
        tie: Tie::Either,
        flat: true,
    },
    WrapperClass {
        model_type: "qwen3_vl",
        text_model_type: "qwen3_vl_text",
        names: TextNames::Current,
        tie: Tie::Top(false),
        flat: false,
    },
];

/// The wrapper `model_type`s, for the list of supported types.
pub fn wrapper_types() -> impl Iterator<Item = &'static str> {
    WRAPPERS.iter().map(|w| w.model_type)
}

/// A wrapper config resolved to its text model: the text config (with the tying flag the
/// wrapper class applies) and the names its checkpoints use unless they say otherwise.
pub(super) struct Unwrapped {
    pub(super) text: HfConfig,
    pub(super) names: TextNames,
}

/// For a wrapper `model_type`, its text model's config; None for any other type.
pub(super) fn unwrap(
    hf: &HfConfig,
    model_type: &str,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<Unwrapped>> {
    let Some(class) = WRAPPERS.iter().find(|w| w.model_type == model_type) else {
        return Ok(None);
    };
    let mut text: HfConfig = match &hf.text_config {
        Some(v @ Value::Object(_)) => serde_json::from_value(v.clone())
            .map_err(|e| err(format!("`text_config` is not a valid model config: {e}")))?,
        Some(other) => {
            return Err(err(format!("`text_config` must be an object, got {other}")));
        }
        // A flat config: the top level is the text model's (its `model_type` the class's).
        None if class.flat => HfConfig {
            model_type: None,
            ..hf.clone()
        },
        None => {
            return Err(err(format!(
                "`{model_type}` wraps a text model: `text_config` is missing"
            )));
        }
    };
    let text_type = text
        .model_type
        .get_or_insert_with(|| class.text_model_type.to_string());
    if WRAPPERS.iter().any(|w| w.model_type == text_type) || text.text_config.is_some() {
        return Err(err(format!(
            "`text_config.model_type` is `{text_type}`: a wrapper inside a wrapper is not supported"
        )));
    }
    match class.tie {
        Tie::Top(default) => {
            text.tie_word_embeddings = Some(hf.tie_word_embeddings.unwrap_or(default));
        }
        Tie::Text => {}
        Tie::Either => {
            let inner = text.tie_word_embeddings.unwrap_or(false);
            text.tie_word_embeddings = Some(hf.tie_word_embeddings.unwrap_or(false) || inner);
        }
    }
    Ok(Some(Unwrapped {
        text,
        names: class.names,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_for_every_layout() {
        let cases = [
            (TextNames::Plain, "model.norm.weight", "lm_head.weight"),
            (
                TextNames::Current,
                "model.language_model.norm.weight",
                "lm_head.weight",
            ),
            (
                TextNames::Legacy,
                "language_model.model.norm.weight",
                "language_model.lm_head.weight",
            ),
        ];
        for (names, norm, head) in cases {
            assert_eq!(names.hf("model.norm.weight"), norm);
            assert_eq!(names.hf("lm_head.weight"), head);
            assert_eq!(names.canonical(norm).as_deref(), Some("model.norm.weight"));
            assert_eq!(names.canonical(head).as_deref(), Some("lm_head.weight"));
        }
        for outside in [
            "model.visual.blocks.0.attn.qkv.weight",
            "vision_tower.encoder.layers.0.mlp.fc1.weight",
            "multi_modal_projector.linear_1.weight",
            "mtp.fc.weight",
        ] {
            assert_eq!(TextNames::Current.canonical(outside), None, "{outside}");
            assert_eq!(TextNames::Legacy.canonical(outside), None, "{outside}");
        }
        assert_eq!(TextNames::Plain.canonical("mtp.fc.weight"), None);
        assert_eq!(
            TextNames::detect(["vision_tower.x", "language_model.model.norm.weight"]),
            Some(TextNames::Legacy)
        );
        assert_eq!(
            TextNames::detect(["lm_head.weight", "model.language_model.norm.weight"]),
            Some(TextNames::Current)
        );
        assert_eq!(TextNames::detect(["lm_head.weight"]), None);
        // Qwen2.5-VL's hub uploads: the text-only class's names beside `visual.*`.
        assert_eq!(
            TextNames::detect([
                "visual.blocks.0.attn.qkv.weight",
                "model.layers.0.mlp.up_proj.weight"
            ]),
            Some(TextNames::Plain)
        );
        assert_eq!(
            TextNames::Plain.canonical("visual.merger.mlp.0.weight"),
            None
        );
        // A trained LLaVA-NeXT projector and a trained SigLIP or CLIP tower: the hub's names,
        // or under `model.`.
        for name in [
            "multi_modal_projector.linear_1.weight",
            "image_newline",
            "vision_tower.encoder.layers.0.mlp.fc1.weight",
        ] {
            assert_eq!(TextNames::Legacy.hf(name), name);
            assert_eq!(TextNames::Current.hf(name), format!("model.{name}"));
            assert_eq!(TextNames::Legacy.canonical(name), None);
        }
    }
}
