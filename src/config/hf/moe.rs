//! The mixture-of-experts and linear-attention parts of a `config.json`, resolved the way
//! each family's transformers config and modeling code resolve them: which layers are
//! sparse, how the router turns logits into top-k weights, where the experts' weights live
//! in the checkpoint, and the shape of the Gated DeltaNet layers of Qwen3-Next / Qwen3.5.

use serde::{Deserialize, Serialize};

use super::{AttentionKind, HfConfig};
use crate::error::{Error, Result};

/// How the router turns its logits (one per expert) into the top-k experts and weights.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Router {
    /// Softmax over all experts (in f32), top-k, then (when `renormalize`) divide by the
    /// sum of the k kept probabilities (Mixtral always; Qwen when `norm_topk_prob`).
    SoftmaxTopK { renormalize: bool },
    /// Top-k of the raw logits (the router has a bias), softmax over the k (GPT-OSS).
    TopKSoftmax,
    /// In f32: sigmoid scores; the top-k chosen by score plus a per-expert correction bias
    /// (`mlp.gate.e_score_correction_bias`, a buffer, not trained) among the `topk_group`
    /// best of `n_group` expert groups (a group scores its two best); weights are the chosen
    /// scores, renormalized (`norm_topk_prob`), times `scaling` (`routed_scaling_factor`)
    /// (GLM-4.5, DeepSeek-V3).
    SigmoidGroupTopK {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        scaling: f64,
    },
    /// Top-k of the logits; each chosen expert's sigmoid score scales its input, not its
    /// output (Llama 4).
    TopKSigmoidInput,
}

/// Where a family keeps its experts in the checkpoint (names inside `model.layers.N.`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertNames {
    /// `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1/w3/w2.weight`
    /// (gate, up, down).
    Mixtral,
    /// `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (Qwen2/3-MoE,
    /// Qwen3-Next).
    Qwen,
    /// `mlp.router.{weight,bias}`, fused `mlp.experts.gate_up_proj` (E, H, 2I), gate and up
    /// interleaved along the last dim, its `_bias` (E, 2I), `down_proj` (E, I, H) and
    /// `down_proj_bias` (E, H) (GPT-OSS).
    GptOssFused,
    /// `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight` and an ungated
    /// `mlp.shared_experts.{gate,up,down}_proj.weight` (GLM-4.5, DeepSeek-V3).
    DeepSeek,
    /// `feed_forward.router.weight`, fused `feed_forward.experts.gate_up_proj` (E, H, 2I),
    /// gate then up along the last dim, `feed_forward.experts.down_proj` (E, I, H) and an
    /// ungated `feed_forward.shared_expert.{gate,up,down}_proj.weight` (Llama 4).
    Llama4Fused,
}

/// The expert activation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ExpertAct {
    /// `down(act(gate) * up)` with the model's `hidden_act`.
    Gated,
    /// GPT-OSS: gate clamped above at `limit`, up clamped to ±`limit`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`; biases on both projections.
    ClampedSwiglu { alpha: f64, limit: f64 },
}

/// The sparse MLP blocks of a mixture-of-experts model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub expert_intermediate_size: usize,
    /// One entry per layer: a sparse block (true) or the dense MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
    pub router: Router,
    pub names: ExpertNames,
    pub act: ExpertAct,
    /// The router's top-k weights are in the compute dtype when they scale the experts'
    /// outputs (Qwen casts them back, GPT-OSS computes its softmax there); Mixtral keeps f32.
    pub weights_in_compute_dtype: bool,
    /// Intermediate size of the always-on shared expert (gated by
    /// `sigmoid(shared_expert_gate(x))` in Qwen2-MoE and Qwen3-Next, ungated in GLM-4.5,
    /// DeepSeek-V3 and Llama 4).
    pub shared_expert_intermediate_size: Option<usize>,
    /// The router load-balancing loss joins the training loss (`output_router_logits`),
    /// weighted by `router_aux_loss_coef`.
    pub router_aux_loss: bool,
    pub router_aux_loss_coef: f64,
}

/// The Gated DeltaNet ("linear attention") layers of Qwen3-Next and Qwen3.5.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnSpec {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    /// Width of the depthwise causal convolution over q, k and v.
    pub conv_kernel: usize,
    /// Qwen3-Next fuses q, k, v, z into `in_proj_qkvz` and b, a into `in_proj_ba`, grouped by
    /// key head; Qwen3.5 keeps `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    pub fused_qkvz: bool,
}

impl LinearAttnSpec {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.k_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.v_head_dim
    }

    /// Channels of the causal convolution: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The MoE blocks of `model_type`, or None for a dense family.
pub(super) fn moe_spec(
    hf: &HfConfig,
    model_type: &str,
    num_layers: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<MoeSpec>> {
    let (names, act, router_default_renorm, shared, weights_in_compute_dtype) = match model_type {
        "mixtral" => (ExpertNames::Mixtral, ExpertAct::Gated, true, false, false),
        "qwen2_moe" => (ExpertNames::Qwen, ExpertAct::Gated, false, true, true),
        "qwen3_moe" => (ExpertNames::Qwen, ExpertAct::Gated, false, false, true),
        "qwen3_next" | "qwen3_5_moe_text" => {
            (ExpertNames::Qwen, ExpertAct::Gated, true, true, true)
        }
        "gpt_oss" => (
            ExpertNames::GptOssFused,
            ExpertAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
            false,
            false,
            true,
        ),
        _ => return Ok(None),
    };
    let mixtral_like = matches!(model_type, "mixtral" | "gpt_oss");
    // transformers writes either name, whichever its config class maps to the other.
    let num_experts = hf.num_experts.or(hf.num_local_experts);
    let experts_key = if mixtral_like {
        "num_local_experts"
    } else {
        "num_experts"
    };
    let num_experts = num_experts.unwrap_or(match model_type {
        "mixtral" => 8,
        "qwen2_moe" => 60,
        "qwen3_moe" | "gpt_oss" => 128,
        "qwen3_5_moe_text" => 256,
        _ => 512,
    });
    let top_k = hf.num_experts_per_tok.unwrap_or(match model_type {
        "mixtral" => 2,
        "qwen2_moe" | "gpt_oss" => 4,
        "qwen3_moe" | "qwen3_5_moe_text" => 8,
        _ => 10,
    });
    if top_k == 0 || top_k > num_experts {
        return Err(err(format!(
            "`num_experts_per_tok` ({top_k}) must be in 1..={num_experts} (`{experts_key}`)"
        )));
    }
    let expert_intermediate_size = if mixtral_like {
        hf.intermediate_size
    } else {
        hf.moe_intermediate_size.or(Some(match model_type {
            "qwen2_moe" => 1408,
            "qwen3_moe" => 768,
            _ => 512,
        }))
    }
    .filter(|&n| n > 0)
    .ok_or_else(|| {
        let key = if mixtral_like {
            "intermediate_size"
        } else {
            "moe_intermediate_size"
        };
        err(format!("`{key}` is missing or not a positive integer"))
    })?;
    // Qwen families: layers in `mlp_only_layers` and those off the `decoder_sparse_step`
    // grid keep a dense MLP; Mixtral, GPT-OSS and Qwen3.5-MoE are sparse everywhere (their
    // models read neither key).
    let all_sparse = mixtral_like || model_type == "qwen3_5_moe_text";
    let step = hf.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err(err("`decoder_sparse_step` must be >= 1".into()));
    }
    let dense_only = hf.mlp_only_layers.clone().unwrap_or_default();
    let sparse_layers = (0..num_layers)
        .map(|l| all_sparse || (!dense_only.contains(&l) && (l + 1).is_multiple_of(step)))
        .collect();
    let router = if model_type == "gpt_oss" {
        Router::TopKSoftmax
    } else {
        Router::SoftmaxTopK {
            // Mixtral's and Qwen3.5-MoE's routers renormalize whatever the config says.
            renormalize: hf.norm_topk_prob.unwrap_or(router_default_renorm)
                || matches!(model_type, "mixtral" | "qwen3_5_moe_text"),
        }
    };
    let shared_expert_intermediate_size = if shared {
        Some(
            hf.shared_expert_intermediate_size
                .unwrap_or(match model_type {
                    "qwen2_moe" => 5632,
                    _ => 512,
                }),
        )
        .filter(|&n| n > 0)
    } else {
        None
    };
    if hf.router_jitter_noise.is_some_and(|j| j != 0.0) {
        return Err(err(
            "`router_jitter_noise` is not 0: router jitter is not implemented; set it to 0".into(),
        ));
    }
    let router_aux_loss_coef = hf.router_aux_loss_coef.unwrap_or(0.001);
    if !router_aux_loss_coef.is_finite() {
        return Err(err(format!(
            "`router_aux_loss_coef` ({router_aux_loss_coef}) must be a finite number"
        )));
    }
    Ok(Some(MoeSpec {
        num_experts,
        top_k,
        expert_intermediate_size,
        sparse_layers,
        router,
        names,
        act,
        weights_in_compute_dtype,
        shared_expert_intermediate_size,
        router_aux_loss: hf.output_router_logits.unwrap_or(false),
        router_aux_loss_coef,
    }))
}

/// The Gated DeltaNet shape of Qwen3-Next / Qwen3.5, or None for other families.
pub(super) fn linear_attn_spec(
    hf: &HfConfig,
    model_type: &str,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<LinearAttnSpec>> {
    if !matches!(
        model_type,
        "qwen3_next" | "qwen3_5_text" | "qwen3_5_moe_text"
    ) {
        return Ok(None);
    }
    let pos = |v: Option<usize>, default: usize, key: &str| match v.unwrap_or(default) {
        0 => Err(err(format!("`{key}` must be a positive integer"))),
        n => Ok(n),
    };
    let s = LinearAttnSpec {
        num_k_heads: pos(hf.linear_num_key_heads, 16, "linear_num_key_heads")?,
        num_v_heads: pos(hf.linear_num_value_heads, 32, "linear_num_value_heads")?,
        k_head_dim: pos(hf.linear_key_head_dim, 128, "linear_key_head_dim")?,
        v_head_dim: pos(hf.linear_value_head_dim, 128, "linear_value_head_dim")?,
        conv_kernel: pos(hf.linear_conv_kernel_dim, 4, "linear_conv_kernel_dim")?,
        fused_qkvz: model_type == "qwen3_next",
    };
    if !s.num_v_heads.is_multiple_of(s.num_k_heads) {
        return Err(err(format!(
            "`linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
            s.num_v_heads, s.num_k_heads
        )));
    }
    Ok(Some(s))
}

/// Qwen3-Next / Qwen3.5 layer kinds: `layer_types` when given (`linear_attention`,
/// `full_attention`), else one full-attention layer every `full_attention_interval` (4).
pub(super) fn hybrid_layer_types(
    hf: &HfConfig,
    num_layers: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<Vec<AttentionKind>> {
    let Some(given) = &hf.layer_types else {
        let every = hf.full_attention_interval.unwrap_or(4).max(1);
        return Ok((0..num_layers)
            .map(|i| {
                if (i + 1).is_multiple_of(every) {
                    AttentionKind::Full
                } else {
                    AttentionKind::Linear
                }
            })
            .collect());
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
            "full_attention" | "attention" => Ok(AttentionKind::Full),
            "linear_attention" => Ok(AttentionKind::Linear),
            other => Err(err(format!(
                "`layer_types` entry `{other}` is not supported here (linear_attention, full_attention)"
            ))),
        })
        .collect()
}
