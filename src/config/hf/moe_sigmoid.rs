//! The mixture-of-experts blocks with sigmoid routers, resolved as their transformers config
//! classes resolve them: GLM-4.5 (`glm4_moe`) and DeepSeek-V3 (`deepseek_v3`), whose routers
//! pick the top-k among the best expert groups by a bias-corrected score and whose first
//! `first_k_dense_replace` layers stay dense; and Llama 4 (`llama4_text`), whose chosen
//! experts' scores scale their input, on the layers `moe_layers` (or
//! `interleave_moe_layer_step`) names.

use super::HfConfig;
use super::moe::{ExpertAct, ExpertNames, MoeSpec, Router};
use crate::error::{Error, Result};

/// The MoE blocks of `glm4_moe`, `deepseek_v3` and `llama4_text`; None for other types.
pub(super) fn moe_spec(
    hf: &HfConfig,
    model_type: &str,
    num_layers: usize,
    err: &dyn Fn(String) -> Error,
) -> Result<Option<MoeSpec>> {
    let pos = |v: Option<usize>, default: usize, key: &str| match v.unwrap_or(default) {
        0 => Err(err(format!("`{key}` must be a positive integer"))),
        n => Ok(n),
    };
    let spec = match model_type {
        "glm4_moe" | "deepseek_v3" => {
            let deepseek = model_type == "deepseek_v3";
            // `n_routed_experts`, which the config classes also answer to as `num_local_experts`.
            let num_experts = pos(
                hf.n_routed_experts.or(hf.num_local_experts),
                if deepseek { 256 } else { 128 },
                "n_routed_experts",
            )?;
            let top_k = pos(hf.num_experts_per_tok, 8, "num_experts_per_tok")?;
            let expert_i = pos(
                hf.moe_intermediate_size,
                if deepseek { 2048 } else { 1408 },
                "moe_intermediate_size",
            )?;
            let n_group = pos(hf.n_group, if deepseek { 8 } else { 1 }, "n_group")?;
            let topk_group = pos(hf.topk_group, if deepseek { 4 } else { 1 }, "topk_group")?;
            if !num_experts.is_multiple_of(n_group) || num_experts / n_group < 2 {
                return Err(err(format!(
                    "`n_routed_experts` ({num_experts}) must split into `n_group` ({n_group}) groups of at least 2 experts"
                )));
            }
            if topk_group > n_group || top_k > topk_group * (num_experts / n_group) {
                return Err(err(format!(
                    "`num_experts_per_tok` ({top_k}) must fit in `topk_group` ({topk_group}) of `n_group` ({n_group}) groups of {} experts",
                    num_experts / n_group
                )));
            }
            let scaling = hf
                .routed_scaling_factor
                .unwrap_or(if deepseek { 2.5 } else { 1.0 });
            if !scaling.is_finite() {
                return Err(err(format!(
                    "`routed_scaling_factor` ({scaling}) must be a finite number"
                )));
            }
            let dense = hf
                .first_k_dense_replace
                .unwrap_or(if deepseek { 3 } else { 1 });
            let shared = hf.n_shared_experts.unwrap_or(1) * expert_i;
            MoeSpec {
                num_experts,
                top_k,
                expert_intermediate_size: expert_i,
                sparse_layers: (0..num_layers).map(|l| l >= dense).collect(),
                router: Router::SigmoidGroupTopK {
                    n_group,
                    topk_group,
                    renormalize: hf.norm_topk_prob.unwrap_or(true),
                    scaling,
                },
                names: ExpertNames::DeepSeek,
                act: ExpertAct::Gated,
                // f32 weights scale the experts' outputs, then the cast.
                weights_in_compute_dtype: false,
                shared_expert_intermediate_size: Some(shared).filter(|&s| s > 0),
                router_aux_loss: false,
                router_aux_loss_coef: 0.0,
            }
        }
        "llama4_text" => {
            let num_experts = pos(hf.num_local_experts, 16, "num_local_experts")?;
            let top_k = pos(hf.num_experts_per_tok, 1, "num_experts_per_tok")?;
            if top_k > num_experts {
                return Err(err(format!(
                    "`num_experts_per_tok` ({top_k}) must be in 1..={num_experts} (`num_local_experts`)"
                )));
            }
            let expert_i = pos(hf.intermediate_size, 8192, "intermediate_size")?;
            let sparse_layers = match &hf.moe_layers {
                Some(list) => {
                    if let Some(bad) = list.iter().find(|&&l| l >= num_layers) {
                        return Err(err(format!(
                            "`moe_layers` names layer {bad}, the model has {num_layers}"
                        )));
                    }
                    (0..num_layers).map(|l| list.contains(&l)).collect()
                }
                None => {
                    let step = pos(hf.interleave_moe_layer_step, 1, "interleave_moe_layer_step")?;
                    (0..num_layers)
                        .map(|l| (l + 1).is_multiple_of(step))
                        .collect()
                }
            };
            MoeSpec {
                num_experts,
                top_k,
                expert_intermediate_size: expert_i,
                sparse_layers,
                router: Router::TopKSigmoidInput,
                names: ExpertNames::Llama4Fused,
                act: ExpertAct::Gated,
                weights_in_compute_dtype: true,
                shared_expert_intermediate_size: Some(expert_i),
                // Llama4ForCausalLM's loss has no router term.
                router_aux_loss: false,
                router_aux_loss_coef: 0.0,
            }
        }
        _ => return Ok(None),
    };
    if hf.router_jitter_noise.is_some_and(|j| j != 0.0) {
        return Err(err(
            "`router_jitter_noise` is not 0: router jitter is not implemented; set it to 0".into(),
        ));
    }
    Ok(Some(spec))
}
