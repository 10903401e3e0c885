//! Where the frozen vision tower's tensors lie in its read-only shared region
//! (`checkpoint::vision` fills it, the worker maps it): one contiguous run of elements in
//! the store's dtype, each tensor at an aligned offset. The frozen tensors are not part of
//! the trained [`super::Layout`]: no master, no moments, no gradient slabs. Those a run
//! trains (`vlm.freeze_projector: false`: the merger; `vlm.freeze_vision_encoder: false`:
//! the patch embedding and the blocks) are in the layout's embedding block instead
//! ([`super::Layout::with_tower`]) and not in the region, which holds nothing where the
//! whole tower trains.

use serde::{Deserialize, Serialize};

use super::{TENSOR_ALIGN, TensorSpec};
use crate::config::TowerTraining;
use crate::config::vision::{TowerSpec, beside_tower};

/// The tower's tensors in its region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionLayout {
    pub spec: TowerSpec,
    /// The checkpoint's prefix of the tower (`visual.` in the hub's names, `model.visual.`
    /// in transformers 5's; Gemma 3's and LLaVA-NeXT's `vision_tower.vision_model.` or
    /// `vision_tower.`); a tensor's checkpoint name is `prefix + name`.
    pub prefix: String,
    /// What precedes a projector tensor's name (`multi_modal_projector.…`, Gemma 3's and
    /// LLaVA-NeXT's, and LLaVA-NeXT's `image_newline`) in the checkpoint: empty, or `model.`
    /// under transformers 5's current names.
    #[serde(default)]
    pub projector_prefix: String,
    /// What of the tower trains: those tensors are the layout's, not the region's.
    pub training: TowerTraining,
    /// The frozen tensors: names inside the tower (`blocks.0.attn.qkv.weight`), shapes,
    /// element offsets.
    pub tensors: Vec<TensorSpec>,
    /// Elements of the region (the last tensor's end).
    pub total: usize,
}

impl VisionLayout {
    /// Lays out every frozen tensor of `spec`'s tower (all but those `training` trains),
    /// in transformers' order, each at a multiple of `TENSOR_ALIGN` elements.
    pub fn new(spec: &TowerSpec, prefix: &str, training: TowerTraining) -> VisionLayout {
        let mut at = 0;
        let tensors = spec
            .tensors()
            .into_iter()
            .filter(|(name, _)| !spec.trains(training, name))
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
            training,
            tensors,
            total,
        }
    }

    /// The checkpoint's name of tensor `t`.
    pub fn hf_name(&self, t: &TensorSpec) -> String {
        match beside_tower(&t.name) {
            true => format!("{}{}", self.projector_prefix, t.name),
            false => format!("{}{}", self.prefix, t.name),
        }
    }

    /// Parameters of the frozen tower.
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
        let l = VisionLayout::new(&spec, "visual.", TowerTraining::Frozen);
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

    /// A trained projector: its tensors in the embedding block after the token embedding
    /// under the hub's names (transformers 5's `model.visual.` where the checkpoint uses
    /// the current names), not carried, not in the region's layout.
    #[test]
    fn a_trained_projector_is_in_the_embedding_block() {
        use crate::config::hf::{ModelSpec, TextNames};
        use crate::layout::Layout;
        let cfg = serde_json::json!({"model_type": "qwen2_5_vl", "vocab_size": 32,
            "hidden_size": 128, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 1, "image_token_id": 9, "vision_config": {
            "depth": 2, "hidden_size": 40, "num_heads": 2, "intermediate_size": 30,
            "out_hidden_size": 128, "window_size": 56, "fullatt_block_indexes": [1]}});
        let path = std::path::Path::new("c");
        let vision = crate::config::vision::VisionSpec::from_json(&cfg, path)
            .unwrap()
            .unwrap();
        let hf: crate::config::hf::HfConfig = serde_json::from_value(cfg).unwrap();
        let mut spec = ModelSpec::from_hf(&hf, path).unwrap();
        let text = Layout::new(&spec);
        let tower = TowerSpec::Qwen(vision.clone());
        let l = Layout::with_tower(&spec, &tower, TowerTraining::Projector);
        let embed = &l.blocks[Layout::EMBED];
        let names: Vec<&str> = embed.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.embed_tokens.weight",
                "visual.merger.ln_q.weight",
                "visual.merger.mlp.0.weight",
                "visual.merger.mlp.0.bias",
                "visual.merger.mlp.2.weight",
                "visual.merger.mlp.2.bias"
            ]
        );
        let region = VisionLayout::new(&tower, "visual.", TowerTraining::Projector);
        let all = VisionLayout::new(&tower, "visual.", TowerTraining::Frozen);
        assert!(
            region
                .tensors
                .iter()
                .all(|t| !t.name.starts_with("merger."))
        );
        assert_eq!(
            l.num_params() - text.num_params(),
            all.num_params() - region.num_params()
        );
        assert!(embed.tensors[2].decays() && !embed.tensors[3].decays());
        assert_eq!(l.blocks.len(), text.blocks.len());
        for (names, merger) in [
            (TextNames::Plain, "visual.merger.mlp.0.weight"),
            (TextNames::Current, "model.visual.merger.mlp.0.weight"),
        ] {
            spec.names = names;
            let l = Layout::with_tower(&spec, &tower, TowerTraining::Projector);
            let embed = &l.blocks[Layout::EMBED];
            assert_eq!(embed.hf_name(&embed.tensors[2]), merger);
            assert!(!l.carry.carries(merger), "{merger}");
            let patch = format!(
                "{}patch_embed.proj.weight",
                merger.trim_end_matches("merger.mlp.0.weight")
            );
            assert!(l.carry.carries(&patch), "{patch}");
            assert!(Layout::new(&spec).carry.carries(merger), "{merger}");
            // A trained encoder: the patch embedding and the blocks join the block, in the
            // tower's order, the merger too where it trains; what does not train stays
            // carried, and the region holds it alone.
            for (t, merger_trains) in [
                (TowerTraining::Encoder, false),
                (TowerTraining::Whole, true),
            ] {
                let l = Layout::with_tower(&spec, &tower, t);
                let embed = &l.blocks[Layout::EMBED];
                let names: Vec<String> = embed.tensors.iter().map(|x| embed.hf_name(x)).collect();
                assert_eq!(names[1], patch);
                assert_eq!(
                    names.len(),
                    1 + 1 + 2 * 12 + if merger_trains { 5 } else { 0 }
                );
                assert!(names.iter().all(|n| !l.carry.carries(n)), "{names:?}");
                assert_eq!(l.carry.carries(merger), !merger_trains, "{merger}");
                let region = VisionLayout::new(&tower, "visual.", t);
                assert_eq!(region.tensors.len(), if merger_trains { 0 } else { 5 });
                assert_eq!(
                    l.num_params() - text.num_params() + region.num_params(),
                    all.num_params()
                );
            }
        }
    }

    #[test]
    fn the_shipped_7b_tower_has_transformers_parameter_count() {
        // Counted by transformers 5.17: Qwen2_5_VLForConditionalGeneration from
        // configs/qwen2.5-vl-7b/config.json on the meta device, the parameters under `visual`.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2.5-vl-7b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            VisionLayout::new(&spec, "visual.", TowerTraining::Frozen).num_params(),
            676_550_144
        );
        // Qwen3VLForConditionalGeneration from configs/qwen3-vl-8b, likewise.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen3-vl-8b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        assert_eq!(
            VisionLayout::new(&spec, "model.visual.", TowerTraining::Frozen).num_params(),
            576_388_336
        );
        // Gemma3ForConditionalGeneration from configs/gemma3-27b/config.json, the parameters
        // under `vision_tower` and `multi_modal_projector`.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/gemma3-27b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        let l = VisionLayout::new(&spec, "vision_tower.vision_model.", TowerTraining::Frozen);
        assert_eq!(l.num_params(), 423_060_336);
        // LlavaNextForConditionalGeneration from configs/llava-next-7b, the parameters under
        // `vision_tower`, `multi_modal_projector` and `image_newline`; the newline is named
        // beside the projector.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/llava-next-7b");
        let spec = TowerSpec::from_model_dir(&dir).unwrap().unwrap();
        let mut l = VisionLayout::new(&spec, "vision_tower.vision_model.", TowerTraining::Frozen);
        assert_eq!(l.num_params(), 324_491_264);
        l.projector_prefix = "model.".into();
        let names: Vec<String> = l.tensors.iter().map(|t| l.hf_name(t)).collect();
        assert_eq!(
            names[0],
            "vision_tower.vision_model.embeddings.class_embedding"
        );
        assert_eq!(names[names.len() - 1], "model.image_newline");
        assert_eq!(
            names[names.len() - 2],
            "model.multi_modal_projector.linear_2.bias"
        );
    }
}
