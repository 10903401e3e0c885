//! Per-family defaults: what each `model_type` leaves implicit when config.json omits a
//! key, as its transformers configuration class sets it.

use super::Family;

/// What a family leaves implicit when a key is absent from config.json (the defaults of its
/// transformers config class).
pub(super) struct Defaults {
    pub(super) family: Family,
    pub(super) rms_norm_eps: f64,
    pub(super) act: &'static str,
    pub(super) tie: bool,
    pub(super) max_pos: usize,
    pub(super) sliding_window: Option<usize>,
    pub(super) head_dim: Option<usize>,
}

pub(super) fn defaults(model_type: &str) -> Option<Defaults> {
    let d = |family, rms_norm_eps, act, tie, max_pos, sliding_window, head_dim| Defaults {
        family,
        rms_norm_eps,
        act,
        tie,
        max_pos,
        sliding_window,
        head_dim,
    };
    let (gelu, win) = ("gelu_pytorch_tanh", Some(4096));
    Some(match model_type {
        "llama" => d(Family::Llama, 1e-6, "silu", false, 2048, None, None),
        "mistral" => d(Family::Llama, 1e-6, "silu", false, 131_072, win, None),
        "qwen2" => d(Family::Llama, 1e-6, "silu", false, 32_768, win, None),
        "qwen2_5_vl_text" => d(Family::Llama, 1e-5, "silu", false, 32_768, win, None),
        "qwen3" => d(Family::Qwen3, 1e-6, "silu", false, 32_768, win, Some(128)),
        "qwen3_vl_text" => d(Family::Qwen3, 1e-6, "silu", false, 128_000, None, Some(128)),
        "gemma2" => d(Family::Gemma, 1e-6, gelu, true, 8192, win, Some(256)),
        "gemma3_text" => d(Family::Gemma, 1e-6, gelu, true, 131_072, win, Some(256)),
        "phi3" => d(Family::Phi3, 1e-5, "silu", false, 4096, None, None),
        "mixtral" => d(Family::Llama, 1e-5, "silu", false, 4096 * 32, None, None),
        "qwen2_moe" => d(Family::Llama, 1e-6, "silu", false, 32_768, win, None),
        "qwen3_moe" => d(Family::Qwen3, 1e-6, "silu", false, 32_768, win, None),
        "gpt_oss" => d(
            Family::GptOss,
            1e-5,
            "silu",
            false,
            131_072,
            Some(128),
            Some(64),
        ),
        "qwen3_next" => d(
            Family::Qwen3Next,
            1e-6,
            "silu",
            false,
            32_768,
            None,
            Some(256),
        ),
        "qwen3_5_text" | "qwen3_5_moe_text" => d(
            Family::Qwen3Next,
            1e-6,
            "silu",
            false,
            32_768,
            None,
            Some(256),
        ),
        "olmo2" => d(Family::Olmo2, 1e-5, "silu", false, 2048, None, None),
        "glm4" => d(
            Family::Glm4,
            1.5625e-7,
            "silu",
            false,
            131_072,
            None,
            Some(128),
        ),
        // GLM-4.5's layer is Qwen3's: optional per-head q/k norms, then a MoE MLP.
        "glm4_moe" => d(Family::Qwen3, 1e-5, "silu", false, 131_072, None, None),
        "deepseek_v3" => d(Family::DeepseekV3, 1e-6, "silu", false, 4096, None, None),
        "llama4_text" => d(
            Family::Llama4,
            1e-5,
            "silu",
            false,
            131_072,
            None,
            Some(128),
        ),
        _ => return None,
    })
}
