//! A private copy of the llama fixture to break in one way, and the check that mt-launch
//! fails on it with the right words and leaves nothing behind (for tests/bad_input.rs).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::*;

/// A private copy of the llama fixture (model dir + data) and a config pointing at it, with
/// `training.output_dir` and `checkpoint.dir` inside the case's directory.
pub struct Fixture {
    pub dir: PathBuf,
    pub model: PathBuf,
    pub data: PathBuf,
    pub config: PathBuf,
    pub ck: PathBuf,
    pub out: PathBuf,
    pub metrics: PathBuf,
}

/// When the failure happens: before anything starts (nothing may be created), or while
/// training (metrics and complete checkpoints may exist).
#[derive(PartialEq)]
pub enum Stage {
    Start,
    Running,
}

pub fn fixture(name: &str) -> Fixture {
    let dir = scratch(&format!("bad-{name}"));
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let golden = golden_dir().join("llama");
    for e in std::fs::read_dir(golden.join("model")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
    }
    let data = dir.join("data.jsonl");
    std::fs::copy(golden.join("data.jsonl"), &data).unwrap();
    let f = Fixture {
        config: dir.join("run.yaml"),
        ck: dir.join("ck"),
        out: dir.join("out"),
        metrics: dir.join("metrics.jsonl"),
        dir,
        model,
        data,
    };
    f.write_config(&f.yaml());
    f
}

impl Fixture {
    pub fn yaml(&self) -> String {
        format!(
            "model: {{path: {}, dtype: float32}}\n\
             dataset: {{format: tokenized, path: {}, shuffle: false}}\n\
             training:\n  batch_size: 4\n  num_steps: 2\n  output_dir: {}\n\
             checkpoint:\n  dir: {}\n",
            self.model.display(),
            self.data.display(),
            self.out.display(),
            self.ck.display()
        )
    }

    pub fn write_config(&self, yaml: &str) {
        std::fs::write(&self.config, yaml).unwrap();
    }

    /// mt-launch on this fixture (CPU workers unless `extra` says `--gpus`).
    pub fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["--config".into(), path_str(&self.config).into()];
        if !extra.contains(&"--gpus") {
            args.extend(["--gpus".into(), "0".into()]);
        }
        args.extend(["--metrics-out".into(), path_str(&self.metrics).into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Runs mt-launch with `extra`; it must fail at `stage` with every needle in stderr.
    pub fn fails(&self, extra: &[&str], stage: Stage, needles: &[&str]) -> String {
        let mut cmd = mt_launch();
        cmd.args(self.args(extra));
        self.check_failure(cmd, stage, needles)
    }

    pub fn check_failure(&self, mut cmd: Command, stage: Stage, needles: &[&str]) -> String {
        let shm_before = shm_entries();
        let ck_before = entries(&self.ck);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "expected a failure:\n{err}");
        eprintln!(
            "{}",
            err.lines()
                .filter(|l| l.contains("error"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(
            !err.contains("panicked"),
            "bad input must not panic:\n{err}"
        );
        for n in needles {
            assert!(err.contains(n), "stderr lacks {n:?}:\n{err}");
        }
        assert_clean(pid, &[], &shm_before);
        let partial = partial_checkpoints(&self.ck);
        assert!(partial.is_empty(), "partial checkpoints left: {partial:?}");
        assert!(!self.out.exists(), "a failed run must not write output_dir");
        if stage == Stage::Start {
            assert!(
                !self.metrics.exists(),
                "a failed start must not leave metrics"
            );
            assert_eq!(
                entries(&self.ck),
                ck_before,
                "a failed start must not touch checkpoints"
            );
        }
        err
    }

    /// Rewrites the fixture's model.safetensors after `edit` changed its tensors.
    pub fn edit_weights(&self, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
        let path = self.model.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.dtype(),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                )
            })
            .collect();
        edit(&mut tensors);
        let views = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }

    pub fn edit_config_json(
        &self,
        edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    ) {
        let path = self.model.join("config.json");
        let mut cfg = json(&path);
        edit(cfg.as_object_mut().unwrap());
        std::fs::write(&path, cfg.to_string()).unwrap();
    }

    /// Trains `steps` steps with a checkpoint at the end; returns the checkpoint.
    pub fn checkpoint(&self, steps: u64) -> PathBuf {
        let args = self.args(&["--set", &format!("training.num_steps={steps}")]);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        run_ok(&refs);
        std::fs::remove_file(&self.metrics).unwrap();
        std::fs::remove_dir_all(&self.out).unwrap();
        self.ck.join(format!("step-{steps:08}"))
    }
}

pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub fn path(p: &Path) -> String {
    p.display().to_string()
}

/// A fixture whose model is the tiny demo (random init, its tokenizer and chat template, or
/// `template` as chat_template.jinja) and whose dataset is `records` in alpaca format, in
/// the file `data_name` (`.json` or `.jsonl`).
pub fn tiny_chat_fixture(
    name: &str,
    data_name: &str,
    records: &str,
    template: Option<&str>,
) -> Fixture {
    let f = fixture(name);
    std::fs::remove_dir_all(&f.model).unwrap();
    std::fs::create_dir_all(&f.model).unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny");
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny.join(file), f.model.join(file)).unwrap();
    }
    if let Some(template) = template {
        std::fs::write(f.model.join("chat_template.jinja"), template).unwrap();
    }
    let data = f.dir.join(data_name);
    std::fs::write(&data, records).unwrap();
    f.write_config(&format!(
        "model: {{path: {}, init: random, dtype: float32}}\n\
         dataset: {{format: alpaca, path: {}, shuffle: false, max_seq_len: 64}}\n\
         training:\n  batch_size: 2\n  num_steps: 1\n  output_dir: {}\n\
         checkpoint:\n  dir: {}\n",
        f.model.display(),
        data.display(),
        f.out.display(),
        f.ck.display()
    ));
    f
}
