//! The `vlm` section: which parts of a vision-language model's vision side train
//! (MegaTrain's keys; LlamaFactory's `freeze_vision_tower` and
//! `freeze_multi_modal_projector` are read as these, see `aliases`). Both default to
//! frozen, as in MegaTrain and LlamaFactory: only the language model trains. The two keys
//! are independent, as LlamaFactory's are: the encoder may train under a frozen projector
//! (the gradient then passes through the projector to the encoder) and the other way round.

use serde::{Deserialize, Serialize};

/// What of the vision tower trains.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VlmSection {
    /// Keep the vision encoder (the patch embedding and the tower's blocks) frozen; false
    /// trains it with the language model (Qwen2.5-VL, Qwen3-VL, Qwen3.5; Gemma 3's SigLIP and
    /// LLaVA-NeXT's CLIP tower, the CLIP layers `vision_feature_layer` does not read left
    /// frozen): its tensors join the embedding
    /// block (fp32 master and Adam moments, weight decay on its matrices, clipped in the
    /// global norm, checkpointed and exported under their hub names), each block's input
    /// kept from the forward and the block recomputed with grad in the embedding's
    /// backward.
    pub freeze_vision_encoder: bool,
    /// Keep the projector (the patch merger of the Qwen towers, `visual.merger.*`, with
    /// Qwen3-VL's `visual.deepstack_merger_list.*`; LLaVA-NeXT's `multi_modal_projector.*`
    /// and `image_newline`) frozen; false trains it
    /// with the language model, as the encoder above.
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
    /// The projector (`merger.*` and Qwen3-VL's `deepstack_merger_list.*`; beside the
    /// tower, `multi_modal_projector.*` and LLaVA-NeXT's `image_newline`): the encoder's
    /// output is computed without grad.
    Projector,
    /// The encoder (the patch embedding and the blocks), under a frozen projector.
    Encoder,
    /// Every tensor of the tower: the encoder and the projector.
    Whole,
}

impl TowerTraining {
    /// What `vlm.freeze_vision_encoder` and `vlm.freeze_projector` ask for.
    pub fn of(freeze_encoder: bool, freeze_projector: bool) -> TowerTraining {
        match (freeze_encoder, freeze_projector) {
            (true, true) => TowerTraining::Frozen,
            (true, false) => TowerTraining::Projector,
            (false, true) => TowerTraining::Encoder,
            (false, false) => TowerTraining::Whole,
        }
    }

    /// Whether the tower's tensor `name` (as `TowerSpec::tensors` names it:
    /// `merger.ln_q.weight`, `multi_modal_projector.linear_1.weight`) trains.
    pub fn trains(self, name: &str) -> bool {
        let merger = name.starts_with("merger.")
            || name.starts_with("deepstack_merger_list.")
            || crate::config::vision::beside_tower(name);
        match self {
            TowerTraining::Frozen => false,
            TowerTraining::Projector => merger,
            TowerTraining::Encoder => !merger,
            TowerTraining::Whole => true,
        }
    }

    /// Whether the encoder trains: its blocks are then recomputed with grad in the
    /// embedding's backward.
    pub fn encoder(self) -> bool {
        matches!(self, TowerTraining::Encoder | TowerTraining::Whole)
    }

    /// Whether the projector trains.
    pub fn projector(self) -> bool {
        matches!(self, TowerTraining::Projector | TowerTraining::Whole)
    }

    /// The config key that asks for the training of a tower (the encoder's where it
    /// trains): what an error about a model that cannot do it names.
    pub fn key(self) -> &'static str {
        match self.encoder() {
            true => "vlm.freeze_vision_encoder",
            false => "vlm.freeze_projector",
        }
    }

    /// What trains, in words, for the launch's `vision tower:` line.
    pub fn describe(self) -> &'static str {
        match self {
            TowerTraining::Frozen => "",
            TowerTraining::Projector => "the projector trained",
            TowerTraining::Encoder => "the encoder trained",
            TowerTraining::Whole => "the encoder and the projector trained",
        }
    }
}

impl VlmSection {
    /// What the section asks to train. Every combination of the two keys is valid here;
    /// whether the model's tower can train is the layout's question (`mt-launch`'s
    /// `run_layout`), which names the key.
    pub fn training(&self) -> TowerTraining {
        TowerTraining::of(self.freeze_vision_encoder, self.freeze_projector)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::error::Result;

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
        // The encoder: MegaTrain's key and LlamaFactory's, alone or with the projector.
        let c = parse("encoder", "vlm: {freeze_vision_encoder: false}\n").unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Encoder);
        let c = parse("tower", "freeze_vision_tower: false\n").unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Encoder);
        let both = "freeze_vision_tower: false\nfreeze_multi_modal_projector: false\n";
        let c = parse("whole", both).unwrap();
        assert_eq!(c.vlm.training(), TowerTraining::Whole);
        // The same setting under both names with the same value is accepted, with
        // different values refused naming both.
        let same = "vlm: {freeze_vision_encoder: false}\nfreeze_vision_tower: false\n";
        assert_eq!(
            parse("same", same).unwrap().vlm.training(),
            TowerTraining::Encoder
        );
        let e = parse(
            "tower-twice",
            "vlm: {freeze_vision_encoder: true}\nfreeze_vision_tower: false\n",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("freeze_vision_tower")
                && e.to_string().contains("vlm.freeze_vision_encoder"),
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
        assert!(TowerTraining::Projector.trains("deepstack_merger_list.0.linear_fc1.weight"));
        assert!(!TowerTraining::Encoder.trains("deepstack_merger_list.1.norm.bias"));
        assert!(!TowerTraining::Projector.trains("encoder.layers.0.mlp.fc1.weight"));
        assert!(TowerTraining::Encoder.trains("blocks.0.attn.qkv.weight"));
        assert!(TowerTraining::Encoder.trains("patch_embed.proj.weight"));
        assert!(!TowerTraining::Encoder.trains("merger.mlp.0.weight"));
        assert!(TowerTraining::Whole.trains("merger.mlp.0.weight"));
        assert!(TowerTraining::Whole.trains("patch_embed.proj.weight"));
        assert_eq!(TowerTraining::Whole.key(), "vlm.freeze_vision_encoder");
        assert_eq!(TowerTraining::Projector.key(), "vlm.freeze_projector");
    }
}
