//! The public architectures shipped under `configs/`, compiled into the binary with the hub
//! ids they describe, so that `mt-launch plan` can size a run for a model that is not in
//! the local Hugging Face cache, from any directory and any machine.

use std::path::Path;

use super::hf::{HfConfig, ModelSpec};
use crate::error::{Error, Result};

/// One shipped architecture: `configs/<dir>/config.json`.
#[derive(Debug)]
pub struct Shipped {
    /// Its directory under `configs/`.
    pub dir: &'static str,
    /// Hub ids (`org/name`) whose config.json has this architecture.
    pub ids: &'static [&'static str],
    /// The config.json text.
    pub config_json: &'static str,
}

macro_rules! shipped {
    ($dir:literal, [$($id:literal),+ $(,)?]) => {
        Shipped {
            dir: $dir,
            ids: &[$($id),+],
            config_json: include_str!(concat!("../../configs/", $dir, "/config.json")),
        }
    };
}

/// Every shipped architecture with the hub ids it stands for.
pub const SHIPPED: &[Shipped] = &[
    shipped!(
        "qwen2.5-0.5b",
        ["Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"]
    ),
    shipped!(
        "qwen2.5-7b",
        ["Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"]
    ),
    shipped!("qwen2.5-vl-7b", ["Qwen/Qwen2.5-VL-7B-Instruct"]),
    shipped!(
        "qwen3-vl-8b",
        ["Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-8B-Thinking"]
    ),
    shipped!(
        "gemma3-27b",
        ["google/gemma-3-27b-it", "google/gemma-3-27b-pt"]
    ),
    shipped!("llava-next-7b", ["llava-hf/llava-v1.6-mistral-7b-hf"]),
    shipped!(
        "qwen2.5-14b",
        ["Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B-Instruct"]
    ),
    shipped!(
        "qwen2.5-32b",
        ["Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct"]
    ),
    shipped!("qwen3-8b", ["Qwen/Qwen3-8B", "Qwen/Qwen3-8B-Base"]),
    shipped!(
        "qwen3-30b-a3b",
        [
            "Qwen/Qwen3-30B-A3B",
            "Qwen/Qwen3-30B-A3B-Base",
            "Qwen/Qwen3-30B-A3B-Instruct-2507",
            "Qwen/Qwen3-30B-A3B-Thinking-2507",
        ]
    ),
    shipped!(
        "qwen3-235b-a22b",
        ["Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-235B-A22B-Base"]
    ),
    shipped!(
        "qwen3-next-80b-a3b",
        [
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "Qwen/Qwen3-Next-80B-A3B-Thinking"
        ]
    ),
    shipped!(
        "llama3-8b",
        [
            "meta-llama/Meta-Llama-3-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct"
        ]
    ),
    shipped!(
        "llama3.1-8b",
        [
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Meta-Llama-3.1-8B",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
        ]
    ),
    shipped!(
        "llama3.1-70b",
        [
            "meta-llama/Llama-3.1-70B",
            "meta-llama/Llama-3.1-70B-Instruct",
            "meta-llama/Meta-Llama-3.1-70B",
            "meta-llama/Meta-Llama-3.1-70B-Instruct",
            "meta-llama/Llama-3.3-70B-Instruct",
        ]
    ),
    shipped!(
        "mistral-7b",
        [
            "mistralai/Mistral-7B-v0.3",
            "mistralai/Mistral-7B-Instruct-v0.3"
        ]
    ),
    shipped!(
        "mixtral-8x7b",
        [
            "mistralai/Mixtral-8x7B-v0.1",
            "mistralai/Mixtral-8x7B-Instruct-v0.1"
        ]
    ),
    shipped!("gemma2-9b", ["google/gemma-2-9b", "google/gemma-2-9b-it"]),
    shipped!("phi3-mini", ["microsoft/Phi-3-mini-4k-instruct"]),
    shipped!("gpt-oss-20b", ["openai/gpt-oss-20b"]),
    shipped!("gpt-oss-120b", ["openai/gpt-oss-120b"]),
    shipped!("qwen3.5-27b", ["Qwen/Qwen3.5-27B"]),
    shipped!("qwen3.5-35b-a3b", ["Qwen/Qwen3.5-35B-A3B"]),
    shipped!(
        "olmo2-7b",
        ["allenai/OLMo-2-1124-7B", "allenai/OLMo-2-1124-7B-Instruct"]
    ),
    shipped!("glm4-9b", ["zai-org/GLM-4-9B-0414", "THUDM/GLM-4-9B-0414"]),
    shipped!(
        "glm4.5-air",
        ["zai-org/GLM-4.5-Air", "zai-org/GLM-4.5-Air-Base"]
    ),
    shipped!(
        "deepseek-v3",
        [
            "deepseek-ai/DeepSeek-V3",
            "deepseek-ai/DeepSeek-V3-Base",
            "deepseek-ai/DeepSeek-V3-0324"
        ]
    ),
    shipped!(
        "llama4-scout",
        [
            "meta-llama/Llama-4-Scout-17B-16E",
            "meta-llama/Llama-4-Scout-17B-16E-Instruct"
        ]
    ),
];

/// The shipped architecture of hub id `id` (`org/name` or `org/name@revision`; the case
/// of the id does not matter, as on the hub).
pub fn for_hub_id(id: &str) -> Option<&'static Shipped> {
    let repo = id.split('@').next().unwrap_or(id);
    SHIPPED
        .iter()
        .find(|s| s.ids.iter().any(|i| i.eq_ignore_ascii_case(repo)))
}

impl Shipped {
    /// The model spec of this architecture.
    pub fn spec(&self) -> Result<ModelSpec> {
        let path = Path::new("configs").join(self.dir).join("config.json");
        let hf: HfConfig =
            serde_json::from_str(self.config_json).map_err(|e| Error::ModelConfig {
                path: path.clone(),
                msg: format!("not a valid config.json: {e}"),
            })?;
        ModelSpec::from_hf(&hf, &path)
    }
}

/// Every shipped directory is named in the table once and every entry parses: a new
/// `configs/<dir>/` missing from the table (or a typo in one) fails here.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_architecture_is_listed_and_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut on_disk: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("config.json").is_file())
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .filter(|d| d != "tiny")
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = SHIPPED.iter().map(|s| s.dir.to_string()).collect();
        listed.sort();
        assert_eq!(listed, on_disk, "configs/*/ and SHIPPED differ");
        for s in SHIPPED {
            s.spec().unwrap_or_else(|e| panic!("{}: {e}", s.dir));
        }
        assert_eq!(
            for_hub_id("qwen/qwen2.5-7b-instruct@main").unwrap().dir,
            "qwen2.5-7b"
        );
        assert!(for_hub_id("Qwen/Qwen2.5-7B-Chat").is_none());
    }
}
