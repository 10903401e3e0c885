//! What a run trains on and with, beyond its schedule ([`super::schedule::Schedule`]):
//! the training data's files and settings, the learning rate and the optimizer. A
//! checkpoint records them (in `trainer_state.json`, inside its schedule) so that a
//! resume that would continue a different run is refused, each difference named.
//!
//! A data file is known by its path, size, modification time and a hash of its first and
//! last MiB (the whole file when it is at most 2 MiB): FNV-1a, 64 bits. Not a hash of the
//! whole file: the data is read by several readers (JSON text, Parquet, Arrow streams,
//! `save_to_disk` directories), each its own way, and hashing inside each would tie the
//! fingerprint to every reader, while a second full read of a large corpus would cost
//! seconds to minutes at every launch. The size and the two ends catch a file replaced,
//! regenerated, appended to or truncated; an edit inside of the same size changes the
//! modification time. The first MiB alone would miss appended records; the size alone
//! a regenerated file of equal length. A `save_to_disk` directory is known by its files.
//!
//! Under `training.stage: grpo` the data files are not recorded: a GRPO loop resumes on
//! a new rollouts file every launch by design (examples/grpo_loop_files.py).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};

use super::owner::utc;
use crate::config::{RunConfig, Stage};
use crate::error::{Error, Result};

/// Bytes hashed at each end of a data file.
const END_BYTES: u64 = 1 << 20;

/// A run's data and optimization settings, as a resume compares them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// Config keys and their values, as text (`training.learning_rate`: `1e-5`).
    pub values: BTreeMap<String, String>,
    /// The training data's files, in the order they are read (none under GRPO).
    pub data_files: Vec<DataFile>,
}

/// One data file as a resume recognizes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFile {
    pub path: PathBuf,
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: u64,
    /// FNV-1a (64 bits, hex) of the first and last MiB (the whole file up to 2 MiB).
    pub ends_hash: String,
}

impl RunSettings {
    /// The settings of `cfg`, its training data's files fingerprinted (their paths found
    /// as the data loader finds them, the files not parsed).
    pub fn of(cfg: &RunConfig) -> Result<RunSettings> {
        let (d, t, o) = (&cfg.dataset, &cfg.training, &cfg.optimizer);
        let values: BTreeMap<String, String> = [
            ("training.stage", json(&t.stage)),
            ("dataset.name", json(&d.name)),
            ("dataset.format", json(&d.format)),
            ("dataset.max_seq_len", json(&d.max_seq_len)),
            ("dataset.overlong", json(&d.overlong)),
            ("dataset.packing", json(&d.packing)),
            ("dataset.val_size", json(&d.val_size)),
            ("dataset.system_prompt", json(&d.system_prompt)),
            ("dataset.query_field", json(&d.query_field)),
            ("dataset.response_field", json(&d.response_field)),
            ("dataset.train_on_prompt", json(&d.train_on_prompt)),
            ("training.learning_rate", json(&t.learning_rate)),
            ("training.lr_scheduler", json(&t.lr_scheduler)),
            ("training.warmup_steps", json(&t.warmup_steps)),
            ("training.weight_decay", json(&t.weight_decay)),
            ("training.max_grad_norm", json(&t.max_grad_norm)),
            ("optimizer.beta1", json(&o.beta1)),
            ("optimizer.beta2", json(&o.beta2)),
            ("optimizer.eps", json(&o.eps)),
            (
                "vlm.freeze_vision_encoder",
                json(&cfg.vlm.freeze_vision_encoder),
            ),
            ("vlm.freeze_projector", json(&cfg.vlm.freeze_projector)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let data_files = match t.stage {
            Stage::Grpo => Vec::new(),
            stage => {
                let mut files = Vec::new();
                for f in crate::data::training_files(d, stage)? {
                    files.extend(DataFile::of(&f)?);
                }
                files
            }
        };
        Ok(RunSettings { values, data_files })
    }

    /// How `self` (this launch) differs from `saved` (the checkpoint's run), one line per
    /// difference: "key: now X, the checkpoint's run had Y". A key `saved` lacks (recorded
    /// by an older build) is not compared.
    pub fn differences(&self, saved: &RunSettings) -> Vec<String> {
        let mut d = Vec::new();
        for (key, now) in &self.values {
            if let Some(then) = saved.values.get(key).filter(|&then| then != now) {
                d.push(format!("{key}: now {now}, the checkpoint's run had {then}"));
            }
        }
        let (now, then) = (&self.data_files, &saved.data_files);
        for i in 0..now.len().max(then.len()) {
            let words = |f: Option<&DataFile>| f.map_or("no file".into(), DataFile::describe);
            let (a, b) = (now.get(i), then.get(i));
            if a != b {
                d.push(format!(
                    "dataset file {} of {}: now {}, the checkpoint's run had {}",
                    i + 1,
                    now.len(),
                    words(a),
                    words(b)
                ));
            }
        }
        d
    }
}

impl DataFile {
    /// `path` fingerprinted; a directory (`save_to_disk`) as each of its files, sorted.
    pub fn of(path: &Path) -> Result<Vec<DataFile>> {
        if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(path, e))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            return files.iter().map(|f| Self::one(f)).collect();
        }
        Ok(vec![Self::one(path)?])
    }

    fn one(path: &Path) -> Result<DataFile> {
        let io = |e| Error::io(path, e);
        let mut file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let size = meta.len();
        let mut h = Fnv::default();
        let head = size.min(2 * END_BYTES);
        let mut buf = vec![0u8; head.min(END_BYTES) as usize];
        file.read_exact(&mut buf).map_err(io)?;
        h.write(&buf);
        if head > END_BYTES {
            let tail = (head - END_BYTES) as usize;
            buf.resize(tail, 0);
            file.seek(SeekFrom::Start(size - tail as u64)).map_err(io)?;
            file.read_exact(&mut buf).map_err(io)?;
            h.write(&buf);
        }
        Ok(DataFile {
            path: path.canonicalize().unwrap_or_else(|_| path.into()),
            size,
            mtime,
            ends_hash: format!("{:016x}", h.0),
        })
    }

    /// "/d/train.jsonl (1234 bytes, modified 2026-11-28 08:12:20 UTC, ends 0f…)".
    fn describe(&self) -> String {
        format!(
            "{} ({} bytes, modified {}, first/last MiB hash {})",
            self.path.display(),
            self.size,
            utc(self.mtime),
            self.ends_hash
        )
    }
}

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// A config value in words: a string as it is, `unset` for none, else its JSON.
fn json<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Null) | Err(_) => "unset".into(),
        Ok(v) => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_files_are_known_by_size_time_and_ends() {
        let dir = std::env::temp_dir().join(format!("mt-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("data.jsonl");
        // 3 MiB: the middle MiB is not hashed.
        let mut bytes = vec![7u8; 3 << 20];
        std::fs::write(&f, &bytes).unwrap();
        let a = DataFile::one(&f).unwrap();
        assert_eq!(a.size, 3 << 20);
        bytes[(3 << 20) - 1] = 8;
        std::fs::write(&f, &bytes).unwrap();
        let b = DataFile::one(&f).unwrap();
        assert_ne!(a.ends_hash, b.ends_hash, "the last MiB is hashed");
        bytes[(3 << 20) - 1] = 7;
        bytes[3 << 19] = 9;
        std::fs::write(&f, &bytes).unwrap();
        let c = DataFile::one(&f).unwrap();
        assert_eq!(a.ends_hash, c.ends_hash, "the middle is not");
        // A small file is hashed whole.
        std::fs::write(&f, b"abc").unwrap();
        let small = DataFile::one(&f).unwrap();
        std::fs::write(&f, b"abd").unwrap();
        assert_ne!(small.ends_hash, DataFile::one(&f).unwrap().ends_hash);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn differences_name_each_key_and_file() {
        let file = |size| DataFile {
            path: "/d/a.jsonl".into(),
            size,
            mtime: 0,
            ends_hash: "00".into(),
        };
        let settings = |lr: &str, files| RunSettings {
            values: [("training.learning_rate".to_string(), lr.to_string())].into(),
            data_files: files,
        };
        let now = settings("0.001", vec![file(10)]);
        let then = settings("0.0001", vec![file(12), file(3)]);
        let d = now.differences(&then);
        assert_eq!(d.len(), 3, "{d:?}");
        assert_eq!(
            d[0],
            "training.learning_rate: now 0.001, the checkpoint's run had 0.0001"
        );
        assert!(
            d[1].starts_with("dataset file 1 of 1: now /d/a.jsonl (10 bytes"),
            "{}",
            d[1]
        );
        assert!(
            d[2].contains("now no file") && d[2].contains("(3 bytes"),
            "{}",
            d[2]
        );
        assert!(now.differences(&now).is_empty());
        // A key the checkpoint's build did not record is not compared.
        let older = RunSettings {
            values: BTreeMap::new(),
            data_files: vec![file(10)],
        };
        assert!(now.differences(&older).is_empty());
    }
}
