//! Hugging Face hub ids (`org/name`, optionally `org/name@revision`) resolved offline to a
//! snapshot directory in the local HF cache, laid out as `huggingface_hub` writes it:
//!
//! ```text
//! <cache>/models--<org>--<name>/refs/<revision>        the commit a branch or tag points to
//! <cache>/models--<org>--<name>/snapshots/<commit>/   config.json, *.safetensors, …
//! <cache>/datasets--<org>--<name>/snapshots/<commit>/ data/train-00000-of-00001.parquet, …
//! ```
//!
//! The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub` (huggingface_hub's order). Nothing is downloaded: a repo
//! that is not in the cache is an error that says how to fetch it, so runs behave the same
//! with and without network (and `HF_HUB_OFFLINE` is trivially honoured).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The hub cache directory from the environment.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
}

fn cache_dir_from(var: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    if let Some(dir) = var("HF_HUB_CACHE") {
        return Some(dir);
    }
    if let Some(home) = var("HF_HOME") {
        return Some(home.join("hub"));
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return Some(xdg.join("huggingface").join("hub"));
    }
    var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub"))
}

/// What a hub repository holds: it decides the cache folder and the download command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoType {
    Model,
    Dataset,
}

impl RepoType {
    fn folder(self) -> &'static str {
        match self {
            RepoType::Model => "models",
            RepoType::Dataset => "datasets",
        }
    }

    /// How to fetch `repo` into the cache, and the local alternative.
    fn fetch_hint(self, repo: &str) -> String {
        let flag = match self {
            RepoType::Model => "",
            RepoType::Dataset => "--repo-type dataset ",
        };
        let local = match self {
            RepoType::Model => "point model.path at a local model directory".to_string(),
            RepoType::Dataset => "give its dataset_info.json entry a local `file_name`".to_string(),
        };
        format!(
            "download it first (`hf download {flag}{repo}`, or `huggingface-cli download {flag}{repo}`), or {local}"
        )
    }
}

/// Resolves `id` through the cache named by the environment.
pub fn resolve(id: &str) -> Result<PathBuf> {
    resolve_in(&cache_for("model.name")?, id)
}

/// The cache named by the environment; `key` is the config key that needs it.
pub fn cache_for(key: &str) -> Result<PathBuf> {
    cache_dir().ok_or_else(|| {
        Error::invalid(
            key,
            "cannot locate the Hugging Face cache: none of HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, HOME is set",
        )
    })
}

/// Resolves the model `id` (`org/name` or `org/name@revision`; revision a branch, tag or
/// commit, default `main`) to its snapshot directory under `cache`.
pub fn resolve_in(cache: &Path, id: &str) -> Result<PathBuf> {
    let dir = snapshot_in(cache, id, RepoType::Model, "model.name")?;
    if !dir.join("config.json").is_file() {
        let repo = id.split('@').next().unwrap_or(id);
        return Err(Error::invalid(
            "model.name",
            format!(
                "snapshot {} of `{repo}` has no config.json (incomplete download?); {}",
                dir.display(),
                RepoType::Model.fetch_hint(repo)
            ),
        ));
    }
    Ok(dir)
}

/// The snapshot directory of repository `id` (`org/name[@revision]`) of type `kind` under
/// `cache`; errors name `key` and say how to download what is missing.
pub fn snapshot_in(cache: &Path, id: &str, kind: RepoType, key: &str) -> Result<PathBuf> {
    let (repo, revision) = id.split_once('@').unwrap_or((id, "main"));
    let parts: Vec<&str> = repo.split('/').collect();
    let valid = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    let valid_revision = revision.split('/').all(valid); // branches may hold `/`: refs/pr/1
    if parts.len() != 2 || !parts.iter().all(|p| valid(p)) || !valid_revision {
        return Err(Error::invalid(
            key,
            format!("`{id}` is not a hub id of the form org/name or org/name@revision"),
        ));
    }
    let repo_dir = cache.join(format!("{}--{}--{}", kind.folder(), parts[0], parts[1]));
    let fetch_hint = kind.fetch_hint(repo);
    if !repo_dir.is_dir() {
        return Err(Error::invalid(
            key,
            format!(
                "`{repo}` is not in the Hugging Face cache (looked for {}); {fetch_hint}",
                repo_dir.display()
            ),
        ));
    }
    let snapshots = repo_dir.join("snapshots");
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.to_string()
    } else {
        let ref_file = repo_dir.join("refs").join(revision);
        match std::fs::read_to_string(&ref_file) {
            Ok(c) => c.trim().to_string(),
            Err(_) => {
                return Err(Error::invalid(
                    key,
                    format!(
                        "`{repo}` is cached in {} but revision `{revision}` is not (no {}); cached snapshots: {}; {fetch_hint}",
                        repo_dir.display(),
                        ref_file.display(),
                        list_snapshots(&snapshots)
                    ),
                ));
            }
        }
    };
    let dir = snapshots.join(&commit);
    if !dir.is_dir() {
        return Err(Error::invalid(
            key,
            format!(
                "`{repo}`: snapshot {} is missing (incomplete download?); {fetch_hint}",
                dir.display()
            ),
        ));
    }
    Ok(dir)
}

fn list_snapshots(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    fn fake_cache(tag: &str) -> PathBuf {
        let cache = std::env::temp_dir().join(format!("mt-hub-{tag}-{}", std::process::id()));
        let repo = cache.join("models--Org--Tiny-1.5B");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots").join(COMMIT)).unwrap();
        std::fs::write(repo.join("refs").join("main"), format!("{COMMIT}\n")).unwrap();
        std::fs::write(
            repo.join("snapshots").join(COMMIT).join("config.json"),
            "{}",
        )
        .unwrap();
        cache
    }

    #[test]
    fn resolves_main_and_commit_revisions() {
        let cache = fake_cache("ok");
        let want = cache
            .join("models--Org--Tiny-1.5B")
            .join("snapshots")
            .join(COMMIT);
        assert_eq!(resolve_in(&cache, "Org/Tiny-1.5B").unwrap(), want);
        assert_eq!(
            resolve_in(&cache, &format!("Org/Tiny-1.5B@{COMMIT}")).unwrap(),
            want
        );
    }

    #[test]
    fn absent_models_and_revisions_say_what_to_do() {
        let cache = fake_cache("absent");
        let e = resolve_in(&cache, "Org/Other").unwrap_err().to_string();
        assert!(
            e.contains("model.name")
                && e.contains("`Org/Other` is not in")
                && e.contains("download"),
            "{e}"
        );
        let e = resolve_in(&cache, "Org/Tiny-1.5B@v2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("revision `v2`") && e.contains(COMMIT), "{e}");
        for bad in [
            "tiny",
            "a/b/c",
            "../x",
            "Org/..",
            "Org/Tiny@",
            "Org/Tiny@x/../y",
        ] {
            let e = resolve_in(&cache, bad).unwrap_err().to_string();
            assert!(e.contains("not a hub id"), "{bad}: {e}");
        }
    }

    #[test]
    fn cache_dir_follows_huggingface_hub_order() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| PathBuf::from(v))
            }
        };
        let all = &[
            ("HF_HUB_CACHE", "/c"),
            ("HF_HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/home/u"),
        ];
        assert_eq!(cache_dir_from(env(all)), Some("/c".into()));
        assert_eq!(cache_dir_from(env(&all[1..])), Some("/h/hub".into()));
        assert_eq!(
            cache_dir_from(env(&all[2..])),
            Some("/x/huggingface/hub".into())
        );
        assert_eq!(
            cache_dir_from(env(&all[3..])),
            Some("/home/u/.cache/huggingface/hub".into())
        );
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    #[test]
    fn run_config_takes_exactly_one_of_path_and_name() {
        let dir = std::env::temp_dir().join(format!("mt-hub-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let load = |model: &str| {
            let p = dir.join("run.yaml");
            std::fs::write(
                &p,
                format!("model: {model}\ndataset: {{format: tokenized, path: d.jsonl}}\n"),
            )
            .unwrap();
            crate::config::RunConfig::load(&p, &[]).map_err(|e| e.to_string())
        };
        let e = load("{path: m, name: Org/Tiny}").unwrap_err();
        assert!(e.contains("model.name") && e.contains("not both"), "{e}");
        let e = load("{dtype: float32}").unwrap_err();
        assert!(e.contains("model.path") && e.contains("model.name"), "{e}");
        let e = load("{name: not-a-hub-id}").unwrap_err();
        assert!(
            e.contains("model.name") && e.contains("not a hub id"),
            "{e}"
        );
        assert!(load("{path: m}").unwrap().model.path.ends_with("m"));
    }
}
