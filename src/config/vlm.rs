//! The `vlm` section: which parts of a vision-language model's vision side train
//! (MegaTrain's keys; LlamaFactory's `freeze_vision_tower` and
//! `freeze_multi_modal_projector` are read as these, see `aliases`). Both default to
//! frozen, as in MegaTrain and LlamaFactory: only the language model trains.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What of the vision tower trains.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VlmSection {
    /// Keep the vision encoder (the patch embedding and the tower's blocks) frozen. false
    /// is not supported yet.
    pub freeze_vision_encoder: bool,
    /// Keep the projector (the patch merger of Qwen2.5-VL or Qwen3.5, `visual.merger.*`;
    /// LLaVA-NeXT's `multi_modal_projector.*` and `image_newline`) frozen; false trains it
    /// with the language model: fp32 master and Adam moments, weight decay on its matrices,
    /// clipped in the global norm, checkpointed and exported under its hub names.
    pub freeze_projector: bool,
}

impl Default for VlmSection {
    fn default() -> Self {
        VlmSection {
            freeze_vision_encoder: true,
            freeze_projector: true,
        }
    }
}

/// Which of the vision tower's tensors a run trains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TowerTraining {
    /// None: the tower and its projector are carried (the default).
    #[default]
    Frozen,
    /// The projector (`merger.*`; beside the tower, `multi_modal_projector.*` and
    /// LLaVA-NeXT's `image_newline`): the encoder's output is computed without grad.
    Projector,
}

impl TowerTraining {
    /// Whether the tower's tensor `name` (as `TowerSpec::tensors` names it:
    /// `merger.ln_q.weight`, `multi_modal_projector.linear_1.weight`) trains.
    pub fn trains(self, name: &str) -> bool {
        match self {
            TowerTraining::Frozen => false,
            TowerTraining::Projector => {
                name.starts_with("merger.") || crate::config::vision::beside_tower(name)
            }
        }
    }
}

impl VlmSection {
    /// What the section asks to train.
    pub fn training(&self) -> TowerTraining {
        match self.freeze_projector {
            true => TowerTraining::Frozen,
            false => TowerTraining::Projector,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if !self.freeze_vision_encoder {
            return Err(Error::invalid(
                "vlm.freeze_vision_encoder",
                "false is not supported yet: the vision encoder trains frozen (vlm.freeze_projector: false trains the projector)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    fn parse(name: &str, extra: &str) -> Result<RunConfig> {
        let dir = std::env::temp_dir().join(format!("mt-vlm-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(format!("{name}.yaml"));
        let base = "model: {path: m}\ndataset: {format: tokenized, path: d.jsonl}\n";
        std::fs::write(&p, format!("{base}{extra}")).unwrap();
        RunConfig::load(&p, &[])
    }

    #[test]
    fn keys_aliases_and_refusals() {
        let c = parse("default", "").unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Frozen);
        let c = parse("megatrain", "vlm: {freeze_projector: false}\n").unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Projector);
        // LlamaFactory's flat names.
        let c = parse("llamafactory", "freeze_multi_modal_projector: false\n").unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Projector);
        let e = parse("tower", "freeze_vision_tower: false\n").unwrap_err();
        assert!(
            e.to_string().contains("vlm.freeze_vision_encoder")
                && e.to_string().contains("not supported yet"),
            "{e}"
        );
        let e = parse("unknown", "vlm: {freeze_projektor: false}\n").unwrap_err();
        assert!(
            e.to_string().contains("vlm.freeze_projektor")
                && e.to_string().contains("unknown field"),
            "{e}"
        );
        let e = parse(
            "twice",
            "vlm: {freeze_projector: true}\nfreeze_multi_modal_projector: false\n",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("freeze_multi_modal_projector"),
            "{e}"
        );
        assert!(TowerTraining::Projector.trains("merger.mlp.0.weight"));
        assert!(!TowerTraining::Projector.trains("blocks.0.attn.qkv.weight"));
        assert!(!TowerTraining::Frozen.trains("merger.mlp.0.weight"));
        assert!(TowerTraining::Projector.trains("multi_modal_projector.linear_2.bias"));
        assert!(TowerTraining::Projector.trains("image_newline"));
        assert!(!TowerTraining::Projector.trains("encoder.layers.0.mlp.fc1.weight"));
    }
}
