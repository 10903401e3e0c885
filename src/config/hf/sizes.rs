//! Bounds on the `config.json` values that size memory, checked before anything is built
//! from them: a dimension at most [`MAX_DIM`] (2^31), a count of layers, heads or experts
//! at most [`MAX_COUNT`] (2^16). The layout then sums the parameters with checked
//! arithmetic ([`crate::layout::Layout::checked`]). The largest published models stay far
//! below both (vocabularies of 262k = 2^18, hidden sizes of 16k = 2^14, 256 experts, 128
//! layers, 128 heads), and values past them are typos or hostile files that would wrap the
//! parameter count or abort on allocation.

use super::HfConfig;
use crate::error::Error;

/// The largest dimension (vocab_size, hidden_size, intermediate sizes, head dims): 2^31.
pub const MAX_DIM: usize = 1 << 31;
/// The largest count (layers, heads, experts, groups, positions between kinds): 2^16.
pub const MAX_COUNT: usize = 1 << 16;

/// Checks every sizing value of `hf` against its bound; `err` names config.json.
pub fn check(hf: &HfConfig, err: &dyn Fn(String) -> Error) -> Result<(), Error> {
    let flat = |v: &Option<Option<usize>>| v.flatten();
    let dims = [
        ("vocab_size", hf.vocab_size),
        ("hidden_size", hf.hidden_size),
        ("intermediate_size", hf.intermediate_size),
        ("head_dim", hf.head_dim),
        ("moe_intermediate_size", hf.moe_intermediate_size),
        (
            "shared_expert_intermediate_size",
            hf.shared_expert_intermediate_size,
        ),
        ("linear_key_head_dim", hf.linear_key_head_dim),
        ("linear_value_head_dim", hf.linear_value_head_dim),
        ("linear_conv_kernel_dim", hf.linear_conv_kernel_dim),
        ("q_lora_rank", flat(&hf.q_lora_rank)),
        ("kv_lora_rank", hf.kv_lora_rank),
        ("qk_nope_head_dim", hf.qk_nope_head_dim),
        ("qk_rope_head_dim", hf.qk_rope_head_dim),
        ("v_head_dim", hf.v_head_dim),
        ("intermediate_size_mlp", hf.intermediate_size_mlp),
        ("max_position_embeddings", hf.max_position_embeddings),
        (
            "original_max_position_embeddings",
            hf.original_max_position_embeddings,
        ),
        ("sliding_window", flat(&hf.sliding_window)),
        ("attention_chunk_size", flat(&hf.attention_chunk_size)),
    ];
    let counts = [
        ("num_hidden_layers", hf.num_hidden_layers),
        ("num_attention_heads", hf.num_attention_heads),
        ("num_key_value_heads", hf.num_key_value_heads),
        ("num_local_experts", hf.num_local_experts),
        ("num_experts", hf.num_experts),
        ("num_experts_per_tok", hf.num_experts_per_tok),
        ("n_routed_experts", hf.n_routed_experts),
        ("n_shared_experts", hf.n_shared_experts),
        ("n_group", hf.n_group),
        ("topk_group", hf.topk_group),
        ("first_k_dense_replace", hf.first_k_dense_replace),
        ("num_nextn_predict_layers", hf.num_nextn_predict_layers),
        ("linear_num_key_heads", hf.linear_num_key_heads),
        ("linear_num_value_heads", hf.linear_num_value_heads),
        ("full_attention_interval", hf.full_attention_interval),
        ("decoder_sparse_step", hf.decoder_sparse_step),
        ("max_window_layers", hf.max_window_layers),
        ("sliding_window_pattern", hf.sliding_window_pattern),
        ("interleave_moe_layer_step", hf.interleave_moe_layer_step),
        ("no_rope_layer_interval", hf.no_rope_layer_interval),
    ];
    let lists = [
        ("mlp_only_layers", hf.mlp_only_layers.as_ref()),
        ("moe_layers", hf.moe_layers.as_ref()),
    ];
    let over =
        |key: &str, v: usize, max: usize| err(format!("`{key}` {v} is too large: at most {max}"));
    for (key, v) in dims {
        if let Some(v) = v.filter(|&v| v > MAX_DIM) {
            return Err(over(key, v, MAX_DIM));
        }
    }
    for (key, v) in counts {
        if let Some(v) = v.filter(|&v| v > MAX_COUNT) {
            return Err(over(key, v, MAX_COUNT));
        }
    }
    for (key, list) in lists {
        if let Some(list) = list {
            if list.len() > MAX_COUNT {
                return Err(err(format!(
                    "`{key}` lists {} layers: at most {MAX_COUNT}",
                    list.len()
                )));
            }
            if let Some(&v) = list.iter().find(|&&v| v > MAX_COUNT) {
                return Err(over(key, v, MAX_COUNT));
            }
        }
    }
    for (key, list) in [
        ("layer_types", hf.layer_types.as_ref().map(Vec::len)),
        ("no_rope_layers", hf.no_rope_layers.as_ref().map(Vec::len)),
    ] {
        if let Some(n) = list.filter(|&n| n > MAX_COUNT) {
            return Err(err(format!(
                "`{key}` lists {n} layers: at most {MAX_COUNT}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn check_json(v: serde_json::Value) -> Result<(), Error> {
        let hf: HfConfig = serde_json::from_value(v).unwrap();
        let err = |msg| Error::ModelConfig {
            path: Path::new("/m/config.json").into(),
            msg,
        };
        check(&hf, &err)
    }

    #[test]
    fn sizing_values_past_their_bound_name_the_key() {
        let e = check_json(serde_json::json!({"vocab_size": 1u64 << 62})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "model config /m/config.json: `vocab_size` 4611686018427387904 is too large: at most 2147483648"
        );
        let e = check_json(serde_json::json!({"num_hidden_layers": 1_000_000_000})).unwrap_err();
        assert!(
            e.to_string()
                .contains("`num_hidden_layers` 1000000000 is too large: at most 65536"),
            "{e}"
        );
        let e = check_json(serde_json::json!({"moe_layers": [1, 70000]})).unwrap_err();
        assert!(e.to_string().contains("`moe_layers` 70000"), "{e}");
        // The bounds themselves pass.
        check_json(serde_json::json!({"vocab_size": MAX_DIM, "num_experts": MAX_COUNT})).unwrap();
    }
}
