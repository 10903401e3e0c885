//! Registry entries with `hf_hub_url`: a dataset repository read offline from the Hugging
//! Face cache (`datasets--ORG--NAME/snapshots/REV/`, see [`crate::config::hub`]), like a
//! model named by `model.name`.
//!
//! Which files of the snapshot make the requested split follows `datasets`' defaults for a
//! repository of data files:
//!
//! - `folder` (LlamaFactory's key, `datasets`' `data_dir`) and then `subset` name a
//!   directory to look in (`push_to_hub` writes a subset's files under its name, and the
//!   default subset's under `data/`, which is where a dataset without `subset` is read
//!   when there is one);
//! - files named `{split}-NNNNN-of-NNNNN…` (what `push_to_hub` writes, any split name)
//!   give the splits when there are any;
//! - else a split is found by its keywords in directory or file names (`train`/`training`;
//!   `validation`/`valid`/`dev`/`val`; `test`/`testing`/`eval`/`evaluation`), each keyword
//!   standing between non-word characters (`-._ ` and digits);
//! - else every file is `train`.
//!
//! Parquet, JSON, JSONL, Arrow and plain-text (`.txt`) files are read; hidden files and
//! `README.md` are not data.

use std::path::{Path, PathBuf};

use crate::config::hub::{self, RepoType};
use crate::error::{Error, Result};

/// File extensions read as data.
const DATA_EXTENSIONS: [&str; 5] = ["parquet", "jsonl", "json", "arrow", "txt"];

/// `datasets`' keywords of its default splits.
const SPLIT_KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// A registry entry's hub dataset.
pub struct HubDataset<'a> {
    /// The config key that named the entry (`dataset.name`, `dataset.eval_name`).
    pub key: &'a str,
    /// The entry's name in dataset_info.json.
    pub entry: &'a str,
    /// `hf_hub_url`: `org/name`, optionally `@revision`.
    pub repo: &'a str,
    pub subset: Option<&'a str>,
    /// Default `train`.
    pub split: Option<&'a str>,
    pub folder: Option<&'a str>,
}

impl HubDataset<'_> {
    /// The data files of the split, in name order, from the cache named by the
    /// environment.
    pub fn files(&self) -> Result<Vec<PathBuf>> {
        self.files_in(&hub::cache_for(self.key)?)
    }

    pub fn files_in(&self, cache: &Path) -> Result<Vec<PathBuf>> {
        let key = format!("{} ({})", self.key, self.entry);
        let snapshot = hub::snapshot_in(cache, self.repo, RepoType::Dataset, &key)?;
        let mut root = snapshot.clone();
        let default_subset =
            (self.subset.is_none() && self.folder.is_none() && snapshot.join("data").is_dir())
                .then_some("data");
        for dir in [self.folder, self.subset.or(default_subset)]
            .into_iter()
            .flatten()
        {
            root = root.join(dir);
            if !root.is_dir() {
                return Err(Error::invalid(
                    key,
                    format!(
                        "no directory `{dir}` in the cached snapshot {}; it holds: {}",
                        snapshot.display(),
                        listing(&snapshot)
                    ),
                ));
            }
        }
        let mut all = Vec::new();
        walk(&root, &root, &mut all).map_err(|e| Error::io(&root, e))?;
        all.sort();
        let data: Vec<&String> = all.iter().filter(|f| is_data(f)).collect();
        if data.is_empty() {
            return Err(Error::invalid(
                key,
                format!(
                    "no Parquet, JSON, JSONL, Arrow or .txt files in {} (it holds: {}); an incomplete download?",
                    root.display(),
                    listing(&root)
                ),
            ));
        }
        let split = self.split.unwrap_or("train");
        let splits = splits(&data);
        let chosen: Vec<PathBuf> = data
            .iter()
            .filter(|f| splits.iter().any(|(s, file)| s == split && file == **f))
            .map(|f| root.join(f))
            .collect();
        if chosen.is_empty() {
            let mut names: Vec<&str> = splits.iter().map(|(s, _)| s.as_str()).collect();
            names.dedup();
            return Err(Error::invalid(
                key,
                format!(
                    "no split `{split}` in {} (splits: {})",
                    root.display(),
                    names.join(", ")
                ),
            ));
        }
        Ok(chosen)
    }
}

/// Every file under `dir` as a path relative to `root`, hidden entries left out.
fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') || name.starts_with("__") {
            continue;
        }
        if path.is_dir() {
            walk(root, &path, out)?;
        } else if let Ok(rel) = path.strip_prefix(root) {
            out.push(rel.to_string_lossy().into_owned());
        }
    }
    Ok(())
}

fn is_data(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    !matches!(
        name,
        "README.md" | "dataset_info.json" | "dataset_infos.json"
    ) && DATA_EXTENSIONS
        .iter()
        .any(|ext| name.ends_with(&format!(".{ext}")))
}

/// (split, file) for every data file, by the first rule that names any split: sharded
/// file names, then keywords, then everything is `train`. Splits come in `datasets`'
/// order (train, validation, test, then the others by name).
fn splits(files: &[&String]) -> Vec<(String, String)> {
    let sharded: Vec<(String, String)> = files
        .iter()
        .filter_map(|f| Some((sharded_split(f)?, f.to_string())))
        .collect();
    let mut found = if !sharded.is_empty() {
        sharded
    } else {
        let by_keyword: Vec<(String, String)> = files
            .iter()
            .filter_map(|f| Some((keyword_split(f)?.to_string(), f.to_string())))
            .collect();
        match by_keyword.is_empty() {
            false => by_keyword,
            true => files
                .iter()
                .map(|f| ("train".to_string(), f.to_string()))
                .collect(),
        }
    };
    let rank = |s: &str| {
        SPLIT_KEYWORDS
            .iter()
            .position(|(n, _)| *n == s)
            .unwrap_or(3)
    };
    found.sort_by(|a, b| (rank(&a.0), &a.0, &a.1).cmp(&(rank(&b.0), &b.0, &b.1)));
    found
}

/// `train` of `data/train-00000-of-00002-abc.parquet` (`{split}-NNNNN-of-NNNNN…`).
fn sharded_split(rel: &str) -> Option<String> {
    let name = rel.rsplit('/').next()?;
    let at = name.find("-of-")?;
    let (head, tail) = (&name[..at], &name[at + 4..]);
    let (split, index) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    let valid = !split.is_empty()
        && split
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    (digits(index) && tail.len() >= 5 && digits(&tail[..5]) && valid).then(|| split.to_string())
}

/// The default split whose keyword stands as a word in a directory of `rel` (first), or
/// in its file name.
fn keyword_split(rel: &str) -> Option<&'static str> {
    let parts: Vec<&str> = rel.split('/').collect();
    let (dirs, name) = parts.split_at(parts.len() - 1);
    let stem = name[0].split('.').next().unwrap_or("");
    let hit = |segment: &str| {
        SPLIT_KEYWORDS
            .iter()
            .find(|(_, words)| words.iter().any(|w| has_word(segment, w)))
            .map(|(s, _)| *s)
    };
    dirs.iter().find_map(|d| hit(d)).or_else(|| hit(stem))
}

/// `word` occurs in `s` between non-word characters (`-._ ` and digits) or its ends.
fn has_word(s: &str, word: &str) -> bool {
    let sep = |c: Option<char>| c.is_none_or(|c| "-._ ".contains(c) || c.is_ascii_digit());
    s.match_indices(word)
        .any(|(at, _)| sep(s[..at].chars().next_back()) && sep(s[at + word.len()..].chars().next()))
}

fn listing(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    match names.is_empty() {
        true => "nothing".into(),
        false => names.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_of(files: &[&str], split: &str) -> Vec<String> {
        let owned: Vec<String> = files.iter().map(|s| s.to_string()).collect();
        let refs: Vec<&String> = owned.iter().collect();
        splits(&refs)
            .into_iter()
            .filter(|(s, _)| s == split)
            .map(|(_, f)| f)
            .collect()
    }

    #[test]
    fn splits_follow_datasets_defaults() {
        let pushed = [
            "data/train-00000-of-00002-ab12.parquet",
            "data/train-00001-of-00002-cd34.parquet",
            "data/test_sft-00000-of-00001.parquet",
        ];
        assert_eq!(split_of(&pushed, "train"), pushed[..2]);
        assert_eq!(split_of(&pushed, "test_sft"), [pushed[2]]);
        let keywords = [
            "train.jsonl",
            "dev.jsonl",
            "data/my_eval.json",
            "notes1.json",
        ];
        assert_eq!(split_of(&keywords, "train"), ["train.jsonl"]);
        assert_eq!(split_of(&keywords, "validation"), ["dev.jsonl"]);
        assert_eq!(split_of(&keywords, "test"), ["data/my_eval.json"]);
        let dirs = ["validation/a.parquet", "training/b.parquet", "trainer.json"];
        assert_eq!(split_of(&dirs, "validation"), ["validation/a.parquet"]);
        assert_eq!(split_of(&dirs, "train"), ["training/b.parquet"]);
        let plain = ["alpaca.json", "more.parquet"];
        assert_eq!(split_of(&plain, "train"), plain);
        assert!(has_word("my-train_2", "train") && !has_word("retrain", "train"));
    }
}
