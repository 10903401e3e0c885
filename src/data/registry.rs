//! `dataset_info.json`: LlamaFactory's dataset registry. Each entry names a local file
//! (`file_name`, relative to the registry's directory) or a hub dataset (`hf_hub_url`,
//! with `subset`, `split` and `folder`, read from the HF cache: [`super::hub`]), its
//! `formatting` (`alpaca`, the default, or `sharegpt`), the `columns` holding each part of
//! a record (`prompt` alone for `training.stage: pt`; `tools` for tool-calling data) and,
//! for sharegpt, the `tags` naming roles inside messages. `ranking` entries hold preference
//! pairs (`chosen` and `rejected` columns) for `training.stage: dpo`; other stages refuse
//! them by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::{DatasetFormat, REGISTRY};
use crate::error::{Error, Result};

/// One registry entry; the hub and ranking fields LlamaFactory also knows are recognized
/// so that they can be refused by name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    file_name: Option<String>,
    #[serde(default)]
    formatting: Option<DatasetFormat>,
    #[serde(default)]
    columns: BTreeMap<String, String>,
    #[serde(default)]
    tags: Tags,
    hf_hub_url: Option<String>,
    ms_hub_url: Option<String>,
    om_hub_url: Option<String>,
    script_url: Option<String>,
    cloud_file_name: Option<String>,
    #[serde(default)]
    ranking: bool,
    subset: Option<String>,
    split: Option<String>,
    folder: Option<String>,
    num_samples: Option<usize>,
}

/// Which record fields hold what (LlamaFactory's `columns`).
#[derive(Debug, Clone, PartialEq)]
pub struct Columns {
    /// Alpaca: the instruction.
    pub prompt: String,
    /// Alpaca: extra input appended to the instruction after a newline.
    pub query: Option<String>,
    /// Alpaca: the answer.
    pub response: String,
    /// Alpaca: earlier [prompt, response] pairs.
    pub history: Option<String>,
    /// Sharegpt: the list of messages.
    pub messages: String,
    /// A per-record system prompt.
    pub system: Option<String>,
    /// The tool definitions a record's conversation may call (a JSON list, or a string
    /// holding one).
    pub tools: Option<String>,
    /// Ranking data: the preferred answer (alpaca: a string; sharegpt: one message).
    pub chosen: String,
    /// Ranking data: the dispreferred answer.
    pub rejected: String,
    /// Multimodal data: a record's image paths (a list, or one path).
    pub images: Option<String>,
}

impl Columns {
    pub fn defaults(format: DatasetFormat) -> Columns {
        let alpaca = format == DatasetFormat::Alpaca;
        Columns {
            prompt: "instruction".into(),
            query: Some("input".into()),
            response: "output".into(),
            history: alpaca.then(|| "history".into()),
            messages: "conversations".into(),
            system: Some("system".into()),
            tools: None,
            chosen: "chosen".into(),
            rejected: "rejected".into(),
            images: None,
        }
    }

    /// Applies an entry's `columns` map; unknown column roles are errors.
    fn with(mut self, map: &BTreeMap<String, String>, name: &str, path: &Path) -> Result<Columns> {
        for (k, v) in map {
            match k.as_str() {
                "prompt" => self.prompt = v.clone(),
                "query" => self.query = Some(v.clone()),
                "response" => self.response = v.clone(),
                "history" => self.history = Some(v.clone()),
                "messages" => self.messages = v.clone(),
                "system" => self.system = Some(v.clone()),
                "tools" => self.tools = Some(v.clone()),
                "chosen" => self.chosen = v.clone(),
                "rejected" => self.rejected = v.clone(),
                "images" => self.images = Some(v.clone()),
                // Video and audio columns: not read yet. KTO's tag has no stage here;
                // stages refuse such entries by what they lack.
                "videos" | "audios" | "kto_tag" => {}
                other => {
                    return Err(Error::Config {
                        path: path.into(),
                        msg: format!(
                            "dataset `{name}`: unknown column role `{other}` (expected prompt, query, response, history, messages, system, tools, chosen, rejected, images)"
                        ),
                    });
                }
            }
        }
        Ok(self)
    }
}

/// Sharegpt role and content keys inside each message (LlamaFactory's `tags`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tags {
    pub role_tag: String,
    pub content_tag: String,
    pub user_tag: String,
    pub assistant_tag: String,
    pub observation_tag: String,
    pub function_tag: String,
    pub system_tag: String,
}

impl Default for Tags {
    fn default() -> Tags {
        Tags {
            role_tag: "from".into(),
            content_tag: "value".into(),
            user_tag: "human".into(),
            assistant_tag: "gpt".into(),
            observation_tag: "observation".into(),
            function_tag: "function_call".into(),
            system_tag: "system".into(),
        }
    }
}

/// A registered dataset, resolved to its files.
#[derive(Debug, Clone)]
pub struct Registered {
    pub files: Vec<PathBuf>,
    pub format: DatasetFormat,
    pub columns: Columns,
    pub tags: Tags,
    pub num_samples: Option<usize>,
    /// `ranking: true`: chosen / rejected preference pairs.
    pub ranking: bool,
}

/// Looks `name` up in `dir/dataset_info.json`; `key` is the config key that gave it.
pub fn lookup(dir: &Path, name: &str, key: &str) -> Result<Registered> {
    let path = dir.join(REGISTRY);
    let text = crate::bounded::read_text(&path, crate::bounded::SMALL_JSON, "dataset registry")?;
    let cfg_err = |msg: String| Error::Config {
        path: path.clone(),
        msg,
    };
    let mut all: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| cfg_err(format!("not a JSON object: {e}")))?;
    let Some(raw) = all.remove(name) else {
        let known: Vec<_> = all.keys().map(String::as_str).collect();
        return Err(cfg_err(format!(
            "no dataset `{name}` ({key}); registered: {}",
            known.join(", ")
        )));
    };
    let e: Entry = serde_path_to_error::deserialize(raw).map_err(|e| {
        cfg_err(format!(
            "dataset `{name}`, key `{}`: {}",
            e.path(),
            e.inner()
        ))
    })?;
    let files = match (&e.hf_hub_url, &e.file_name) {
        (Some(repo), _) => super::hub::HubDataset {
            key,
            entry: name,
            repo,
            subset: e.subset.as_deref(),
            split: e.split.as_deref(),
            folder: e.folder.as_deref(),
        }
        .files()?,
        (None, Some(file_name)) => {
            let hub_only = [
                ("subset", e.subset.is_some()),
                ("split", e.split.is_some()),
                ("folder", e.folder.is_some()),
            ];
            if let Some((k, _)) = hub_only.iter().find(|(_, set)| *set) {
                return Err(cfg_err(format!(
                    "dataset `{name}`: `{k}` applies to hub datasets (`hf_hub_url`), not to `file_name`"
                )));
            }
            vec![dir.join(file_name)]
        }
        (None, None) => {
            let remote = [
                ("ms_hub_url", &e.ms_hub_url),
                ("om_hub_url", &e.om_hub_url),
                ("script_url", &e.script_url),
                ("cloud_file_name", &e.cloud_file_name),
            ];
            let given = remote.iter().find(|(_, v)| v.is_some()).map(|(k, _)| *k);
            return Err(cfg_err(format!(
                "dataset `{name}` has neither `file_name` nor `hf_hub_url`{}: only local files and the Hugging Face cache are read (runs are offline)",
                given
                    .map(|k| format!(" (it gives `{k}`)"))
                    .unwrap_or_default()
            )));
        }
    };
    let format = e.formatting.unwrap_or(DatasetFormat::Alpaca);
    if format == DatasetFormat::Tokenized && !e.columns.is_empty() {
        return Err(cfg_err(format!(
            "dataset `{name}`: `columns` do not apply to tokenized files"
        )));
    }
    Ok(Registered {
        files,
        format,
        columns: Columns::defaults(format).with(&e.columns, name, &path)?,
        tags: e.tags,
        num_samples: e.num_samples,
        ranking: e.ranking,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(json: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("mt-reg-{}-{}", std::process::id(), json.len()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(REGISTRY), json).unwrap();
        dir
    }

    #[test]
    fn entries_resolve_with_llamafactory_defaults() {
        let dir = registry(
            r#"{"a": {"file_name": "a.json"},
                "s": {"file_name": "s.jsonl", "formatting": "sharegpt",
                      "columns": {"messages": "messages"},
                      "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
                "hub": {"ms_hub_url": "org/x"}}"#,
        );
        let a = lookup(&dir, "a", "dataset.name").unwrap();
        assert_eq!(
            (a.format, a.columns.response.as_str()),
            (DatasetFormat::Alpaca, "output")
        );
        assert_eq!(a.files, [dir.join("a.json")]);
        let s = lookup(&dir, "s", "dataset.name").unwrap();
        assert_eq!(
            (s.columns.messages.as_str(), s.tags.role_tag.as_str()),
            ("messages", "role")
        );
        assert_eq!(s.tags.observation_tag, "observation");
        let e = lookup(&dir, "hub", "dataset.name").unwrap_err().to_string();
        assert!(
            e.contains("ms_hub_url") && e.contains("file_name") && e.contains("hf_hub_url"),
            "{e}"
        );
        let e = lookup(&dir, "nope", "dataset.name")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no dataset `nope`") && e.contains("registered: a, hub, s"),
            "{e}"
        );
    }
}
