//! Where the frozen vision tower's tensors lie in its read-only shared region
//! (`checkpoint::vision` fills it, the worker maps it): one contiguous run of elements in
//! the store's dtype, each tensor at an aligned offset. The tower is not part of the
//! trained [`super::Layout`]: no master, no moments, no gradient slabs.

use serde::{Deserialize, Serialize};

use super::{TENSOR_ALIGN, TensorSpec};
use crate::config::vision::TowerSpec;
use crate::config::vision::siglip::PROJECTOR;

/// The tower's tensors in its region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionLayout {
    pub spec: TowerSpec,
    /// The checkpoint's prefix of the tower (`visual.` in the hub's names, `model.visual.`
    /// in transformers 5's; Gemma 3's `vision_tower.vision_model.` or `vision_tower.`); a
    /// tensor's checkpoint name is `prefix + name`.
    pub prefix: String,
    /// What precedes a projector tensor's name (`multi_modal_projector.…`, Gemma 3's) in the
    /// checkpoint: empty, or `model.` under transformers 5's current names.
    #[serde(default)]
    pub projector_prefix: String,
    /// Names inside the tower (`blocks.0.attn.qkv.weight`), shapes, element offsets.
    pub tensors: Vec<TensorSpec>,
    /// Elements of the region (the last tensor's end).
    pub total: usize,
}

impl VisionLayout {
    /// Lays out every tensor of `spec`'s tower, in transformers' order, each at a
    /// multiple of `TENSOR_ALIGN` elements.
    pub fn new(spec: &TowerSpec, prefix: &str) -> VisionLayout {
        let mut at = 0;
        let tensors = spec
            .tensors()
            .into_iter()
            .map(|(name, shape)| {
                let t = TensorSpec {
                    name,
                    shape,
                    offset: at,
                };
                at = (t.offset + t.numel()).next_multiple_of(TENSOR_ALIGN);
                t
            })
            .collect::<Vec<_>>();
        let total = tensors.last().map_or(0, |t| t.offset + t.numel());
        VisionLayout {
            spec: spec.clone(),
            prefix: prefix.into(),
            projector_prefix: String::new(),
            tensors,
            total,
        }
    }

    /// The checkpoint's name of tensor `t`.
    pub fn hf_name(&self, t: &TensorSpec) -> String {
        match t.name.starts_with(PROJECTOR) {
            true => format!("{}{}", self.projector_prefix, t.name),
            false => format!("{}{}", self.prefix, t.name),
        }
    }

    /// Parameters of the tower.
    pub fn num_params(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_aligned_and_disjoint() {
        let cfg = serde_json::json!({"model_type": "qwen2_5_vl", "vision_config": {
            "depth": 2, "hidden_size": 40, "num_heads": 2, "intermediate_size": 30,
            "out_hidden_size": 24, "window_size": 56, "fullatt_block_indexes": [1]}});
        let spec = TowerSpec::from_json(&cfg, std::path::Path::new("c"))
            .unwrap()
            .unwrap();
        let l = VisionLayout::new(&spec, "visual.");
        assert_eq!(l.tensors.len(), 1 + 2 * 12 + 5);
        let mut end = 0;
        for t in &l.tensors {
            assert_eq!(t.offset % TENSOR_ALIGN, 0, "{}", t.name);
            assert!(t.offset >= end, "{} overlaps", t.name);
            end = t.offset + t.numel();
        }
        assert_eq!(l.total, end);
        assert_eq!(l.hf_name(&l.tensors[0]), "visual.patch_embed.proj.weight");
        let merged = 40 * 4;
        let expect = 40 * 3 * 2 * 14 * 14
            + 2 * (2 * 40 + 3 * 40 * 40 + 3 * 40 + 40 * 40 + 40 + 3 * 40 * 30 + 2 * 30 + 40)
            + 40
            + merged * merged
            + merged
            + 24 * merged
            + 24;
        assert_eq!(l.num_params(), expect);
    }

    #[test]
    fn the_shipped_7b_tower_has_transformers_parameter_count() {
        // Counted by transformers 5.17: Qwen2_5_VLForConditionalGeneration from
        // configs/qwen2.5-vl-7b/config.json on the meta device, the parameters under `visual`.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2.5-vl-7b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            VisionLayout::new(&spec, "visual.").num_params(),
            676_550_144
        );
        // Gemma3ForConditionalGeneration from configs/gemma3-27b/config.json, the parameters
        // under `vision_tower` and `multi_modal_projector`.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/gemma3-27b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            VisionLayout::new(&spec, "vision_tower.vision_model.").num_params(),
            423_060_336
        );
    }
}
