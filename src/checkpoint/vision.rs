//! The frozen vision tower for the workers: its carried tensors ([`super::carried`]) copied
//! once, in the store's dtype, into a read-only shared region laid out by
//! [`VisionLayout`] (the tensors a run trains, `vlm.freeze_projector: false`'s merger,
//! `vlm.freeze_vision_encoder: false`'s patch embedding and blocks, are the layout's
//! instead; the region is empty where both train). The launcher builds it before the workers start and keeps it for the
//! run (a server starting its workers again maps it again); each worker maps it, copies
//! the tower to its device once and unmaps it. The tower is not trained: it has no master,
//! no moments and no gradient, and the export writes the carried bytes, not these.

use std::path::Path;

use super::carried::Carried;
use super::pieces;
use crate::config::vision::TowerSpec;
use crate::config::vision::siglip::PROJECTOR;
use crate::config::{DType, TowerTraining};
use crate::error::{Error, Result};
use crate::layout::vision::VisionLayout;
use crate::shm::host::Store;
use crate::shm::{RegionHandle, RegionKind};

/// The tower's region, filled.
pub struct VisionRegion {
    store: Store,
    pub layout: VisionLayout,
    pub dtype: DType,
}

impl VisionRegion {
    /// Lays out `spec`'s frozen tower (all but what `training` trains) under the prefix
    /// `carried` holds it at and copies its tensors into a new region named `name`,
    /// converted to `dtype`. `source` (the model
    /// or checkpoint directory the tensors were read from) names errors: a tensor
    /// missing, of another shape or not a float.
    pub fn build(
        name: &str,
        spec: &TowerSpec,
        training: TowerTraining,
        carried: &Carried,
        dtype: DType,
        source: &Path,
    ) -> Result<VisionRegion> {
        // The prefix, from the first tensor the region holds (the patch embedding, or with
        // the encoder trained the merger's norm); none where the whole tower trains.
        let first = spec
            .tensors()
            .into_iter()
            .find(|(n, _)| !spec.trains(training, n));
        let prefix = match first {
            None => "",
            Some((probe, _)) => carried
                .tensors
                .iter()
                .find_map(|t| t.name.strip_suffix(probe.as_str()))
                .ok_or_else(|| Error::Tensor {
                    path: source.into(),
                    tensor: format!("*{probe}"),
                    expected: format!("the vision tower of `{}`", spec.model_type()),
                    got: format!("no tensor named `*{probe}`"),
                })?,
        };
        let mut layout = VisionLayout::new(spec, prefix, training);
        // Gemma 3's and LLaVA-NeXT's projector (and LLaVA-NeXT's image_newline) sit beside
        // the tower, under the wrapper's own prefix.
        if let Some(p) =
            (carried.tensors.iter()).find_map(|t| Some(&t.name[..t.name.find(PROJECTOR)?]))
        {
            layout.projector_prefix = p.to_string();
        }
        let mut store = Store::create_as(name, RegionKind::Vision, layout.total, dtype)?;
        let by_name: std::collections::HashMap<&str, _> = carried
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let mut values = Vec::new();
        for t in &layout.tensors {
            let hf = layout.hf_name(t);
            let bad = |got: String| Error::Tensor {
                path: source.into(),
                tensor: hf.clone(),
                expected: format!("a float tensor of shape {:?}", t.shape),
                got,
            };
            let c = by_name
                .get(hf.as_str())
                .ok_or_else(|| bad("no such tensor".into()))?;
            if c.shape != t.shape {
                return Err(bad(format!("shape {:?}", c.shape)));
            }
            if pieces::float_width(c.dtype).is_none() {
                return Err(bad(format!("dtype {:?}", c.dtype)));
            }
            values.clear();
            values.resize(t.numel(), 0.0f32);
            pieces::convert(c.dtype, &c.bytes, &mut values);
            store.write_range(t.offset, &values);
        }
        Ok(VisionRegion {
            store,
            layout,
            dtype,
        })
    }

    /// What a worker adopts the region by.
    pub fn handle(&self) -> RegionHandle {
        self.store.handle()
    }

    /// Bytes of the region's payload.
    pub fn bytes(&self) -> usize {
        self.store.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::carried::CarriedTensor;
    use half::bf16;
    use safetensors::Dtype;

    fn spec() -> TowerSpec {
        let cfg = serde_json::json!({"model_type": "qwen2_5_vl", "vision_config": {
            "depth": 1, "hidden_size": 8, "num_heads": 2, "intermediate_size": 6,
            "out_hidden_size": 4, "patch_size": 2, "window_size": 8}});
        TowerSpec::from_json(&cfg, Path::new("c")).unwrap().unwrap()
    }

    /// Every tensor of the tower under `prefix`, bf16, element i of tensor k = k + i / 1024.
    fn carried(prefix: &str) -> Carried {
        let tensors = spec()
            .tensors()
            .into_iter()
            .enumerate()
            .map(|(k, (name, shape))| {
                let n: usize = shape.iter().product();
                let bytes = (0..n)
                    .flat_map(|i| bf16::from_f32(k as f32 + i as f32 / 1024.0).to_le_bytes())
                    .collect();
                CarriedTensor {
                    name: format!("{prefix}{name}"),
                    dtype: Dtype::BF16,
                    shape,
                    bytes,
                }
            })
            .collect();
        Carried { tensors }
    }

    #[test]
    fn region_holds_each_tensor_at_its_offset() {
        // (The f32 region is read back by the worker's test of the tower: mt-worker's
        // `model::qwen2_vl_vision` tests.)
        for prefix in ["visual.", "model.visual."] {
            let dtype = DType::Bfloat16;
            let c = carried(prefix);
            let r = VisionRegion::build(
                "mt-test-vision",
                &spec(),
                TowerTraining::Frozen,
                &c,
                dtype,
                Path::new("m"),
            )
            .unwrap();
            assert_eq!(r.layout.prefix, prefix);
            assert_eq!(r.bytes(), r.layout.total * dtype.size());
            for (k, t) in r.layout.tensors.iter().enumerate() {
                let mut want = vec![0.0f32; t.numel()];
                pieces::convert(Dtype::BF16, &c.tensors[k].bytes, &mut want);
                let got: Vec<f32> = r.store.bf16().unwrap()[t.range()]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                assert_eq!(got, want, "{}", t.name);
                assert_eq!(got[0], k as f32, "{}", t.name);
            }
        }
    }

    #[test]
    fn a_trained_projector_is_left_out_of_the_region() {
        // The carried tensors lack the merger (the layout holds it).
        let mut c = carried("visual.");
        c.tensors.retain(|t| !t.name.starts_with("visual.merger."));
        let p = TowerTraining::Projector;
        let r = VisionRegion::build(
            "mt-test-vision",
            &spec(),
            p,
            &c,
            DType::Float32,
            Path::new("m"),
        )
        .unwrap();
        assert_eq!(r.layout.tensors.len(), c.tensors.len());
        assert_eq!(r.layout.training, p);
        // Frozen, the merger is the region's and must be there.
        let e = VisionRegion::build(
            "mt-test-vision",
            &spec(),
            TowerTraining::Frozen,
            &c,
            DType::Float32,
            Path::new("m"),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("visual.merger.ln_q.weight"), "{e}");
    }

    /// A trained encoder: the region holds the merger alone, under the prefix found from
    /// it (the patch embedding is not carried); the whole tower trained, nothing.
    #[test]
    fn a_trained_encoder_is_left_out_of_the_region() {
        let full = carried("model.visual.");
        let mut c = carried("model.visual.");
        c.tensors
            .retain(|t| t.name.starts_with("model.visual.merger."));
        let build = |t: TowerTraining, c: &Carried| {
            VisionRegion::build(
                "mt-test-vision",
                &spec(),
                t,
                c,
                DType::Bfloat16,
                Path::new("m"),
            )
        };
        let r = build(TowerTraining::Encoder, &c).unwrap();
        assert_eq!(r.layout.prefix, "model.visual.");
        let names: Vec<String> = r
            .layout
            .tensors
            .iter()
            .map(|t| r.layout.hf_name(t))
            .collect();
        let want: Vec<&str> = c.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, want);
        // ln_q (E = 8), then 4E -> 4E -> 4 with biases.
        assert_eq!(r.layout.num_params(), 8 + 32 * 32 + 32 + 4 * 32 + 4);
        let r = build(TowerTraining::Whole, &Carried::default()).unwrap();
        assert!(r.layout.tensors.is_empty() && r.bytes() == 0);
        // The merger frozen is the region's: without it the error names it.
        let e = build(TowerTraining::Encoder, &Carried::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("*merger.ln_q.weight"), "{e}");
        assert!(build(TowerTraining::Encoder, &full).is_ok());
    }

    #[test]
    fn gemma3_tower_and_projector_take_their_own_prefixes() {
        let cfg = serde_json::json!({"model_type": "gemma3", "mm_tokens_per_image": 1,
            "text_config": {"hidden_size": 4}, "vision_config": {"hidden_size": 4,
            "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2,
            "image_size": 4, "patch_size": 2}});
        let spec = TowerSpec::from_json(&cfg, Path::new("c")).unwrap().unwrap();
        // The hub's names, and transformers 5's current ones.
        for (tower, projector) in [
            ("vision_tower.vision_model.", ""),
            ("model.vision_tower.", "model."),
        ] {
            let tensors = spec
                .tensors()
                .into_iter()
                .map(|(name, shape)| {
                    let n: usize = shape.iter().product();
                    let name = match name.starts_with(PROJECTOR) {
                        true => format!("{projector}{name}"),
                        false => format!("{tower}{name}"),
                    };
                    CarriedTensor {
                        name,
                        dtype: Dtype::BF16,
                        shape,
                        bytes: vec![0; 2 * n],
                    }
                })
                .collect();
            let c = Carried { tensors };
            let r = VisionRegion::build(
                "mt-test-vision",
                &spec,
                TowerTraining::Frozen,
                &c,
                DType::Float32,
                Path::new("m"),
            )
            .unwrap();
            assert_eq!(
                (r.layout.prefix.as_str(), r.layout.projector_prefix.as_str()),
                (tower, projector)
            );
            let last = r.layout.tensors.last().unwrap();
            assert_eq!(
                r.layout.hf_name(last),
                format!("{projector}multi_modal_projector.mm_soft_emb_norm.weight")
            );
        }
    }

    #[test]
    fn missing_or_misshapen_tensors_are_named() {
        let mut c = carried("visual.");
        c.tensors
            .retain(|t| t.name != "visual.blocks.0.attn.qkv.bias");
        let e = VisionRegion::build(
            "mt-test-vision",
            &spec(),
            TowerTraining::Frozen,
            &c,
            DType::Float32,
            Path::new("m"),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("`visual.blocks.0.attn.qkv.bias`") && e.contains("no such"),
            "{e}"
        );

        let mut c = carried("visual.");
        c.tensors[3].shape = vec![1, 2];
        let e = VisionRegion::build(
            "mt-test-vision",
            &spec(),
            TowerTraining::Frozen,
            &c,
            DType::Float32,
            Path::new("m"),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains(&c.tensors[3].name) && e.contains("[1, 2]"),
            "{e}"
        );

        let e = VisionRegion::build(
            "mt-test-vision",
            &spec(),
            TowerTraining::Frozen,
            &Carried::default(),
            DType::Float32,
            Path::new("m"),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("m: tensor") && e.contains("patch_embed"), "{e}");
    }
}
