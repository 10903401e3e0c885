//! The `logging` section: the step lines, and where else the metrics go (HF Trainer's
//! `report_to`, `logging_dir` and `run_name`).
//!
//! `report_to` takes one name or a list, as HF Trainer does: `none`, `tensorboard`,
//! `wandb`, `mlflow`, or `all`. TensorBoard event files are written by the launcher itself
//! (`crate::metrics::tensorboard`); W&B and MLflow are fed by a Python side process that
//! uses their own clients (the launcher's `trackers` module). `all` means, as in HF
//! Trainer, every integration installed: TensorBoard, and W&B and MLflow where the
//! interpreter (`logging.python`) has their package; the launcher says which it uses.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingSection {
    /// Print a log line every this many optimizer steps.
    pub log_every: u64,
    /// Where the metrics are also reported (HF Trainer's key): `none`, `tensorboard`
    /// (event files under `logging_dir`), `wandb`, `mlflow`, a list of these, or `all`.
    pub report_to: ReportTo,
    /// Directory of the TensorBoard event files (HF Trainer's key). Default:
    /// `training.output_dir/runs`, else `checkpoint.dir/runs`.
    pub logging_dir: Option<PathBuf>,
    /// The run's name in W&B and MLflow (HF Trainer's `run_name`). Default: the config
    /// file's stem.
    pub run_name: Option<String>,
    /// The Python interpreter that runs the W&B / MLflow side process. Default: the
    /// `MT_PYTHON` environment variable, else `python3` on PATH.
    pub python: Option<PathBuf>,
}

impl Default for LoggingSection {
    fn default() -> Self {
        LoggingSection {
            log_every: 1,
            report_to: ReportTo::None,
            logging_dir: None,
            run_name: None,
            python: None,
        }
    }
}

/// One integration `report_to` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tracker {
    Tensorboard,
    Wandb,
    Mlflow,
}

impl Tracker {
    pub const ALL: [Tracker; 3] = [Tracker::Tensorboard, Tracker::Wandb, Tracker::Mlflow];

    /// Its name in `report_to`.
    pub fn name(self) -> &'static str {
        match self {
            Tracker::Tensorboard => "tensorboard",
            Tracker::Wandb => "wandb",
            Tracker::Mlflow => "mlflow",
        }
    }

    /// The Python module the side process imports for it (None: written natively).
    pub fn module(self) -> Option<&'static str> {
        match self {
            Tracker::Tensorboard => None,
            Tracker::Wandb => Some("wandb"),
            Tracker::Mlflow => Some("mlflow"),
        }
    }

    /// What installs that module.
    pub fn pip(self) -> &'static str {
        match self {
            Tracker::Tensorboard => "",
            Tracker::Wandb => "pip install wandb",
            Tracker::Mlflow => "pip install mlflow-skinny, or mlflow",
        }
    }
}

/// The names `report_to` accepts, for its error.
const ACCEPTED: &str = "none, tensorboard, wandb, mlflow, all (one name or a list)";

/// `logging.report_to`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ReportTo {
    #[default]
    None,
    /// Every integration installed (resolved by the launcher).
    All,
    /// These, in the order given, without repeats.
    These(Vec<Tracker>),
}

impl ReportTo {
    /// Parses the names given: each one of [`ACCEPTED`]; `none` and `all` stand alone.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> std::result::Result<ReportTo, String> {
        let mut these = Vec::new();
        let mut alone = None;
        for name in names.iter().map(|n| n.as_ref().trim()) {
            let t = match name {
                "none" | "all" => {
                    alone = Some(name);
                    continue;
                }
                "tensorboard" => Tracker::Tensorboard,
                "wandb" => Tracker::Wandb,
                "mlflow" => Tracker::Mlflow,
                other => return Err(format!("unknown tracker `{other}`: expected {ACCEPTED}")),
            };
            if !these.contains(&t) {
                these.push(t);
            }
        }
        match (alone, these.is_empty()) {
            (Some(a), false) => Err(format!("`{a}` cannot be listed with other trackers")),
            (Some("all"), true) => Ok(ReportTo::All),
            (_, true) => Ok(ReportTo::None),
            (None, false) => Ok(ReportTo::These(these)),
        }
    }

    /// Whether `t` is named (with `all`: TensorBoard only, which is always there; the
    /// launcher resolves the others).
    pub fn names(&self, t: Tracker) -> bool {
        match self {
            ReportTo::None => false,
            ReportTo::All => t == Tracker::Tensorboard,
            ReportTo::These(v) => v.contains(&t),
        }
    }
}

impl Serialize for ReportTo {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ReportTo::None => s.serialize_str("none"),
            ReportTo::All => s.serialize_str("all"),
            ReportTo::These(v) => s.collect_seq(v.iter().map(|t| t.name())),
        }
    }
}

impl<'de> Deserialize<'de> for ReportTo {
    /// A name, names separated by commas, or a list of names.
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<ReportTo, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = ReportTo;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "one of {ACCEPTED}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<ReportTo, E> {
                let names: Vec<&str> = v.split(',').collect();
                ReportTo::parse(&names).map_err(E::custom)
            }
            fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<ReportTo, E> {
                Ok(ReportTo::None)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<ReportTo, A::Error> {
                let mut names = Vec::new();
                while let Some(n) = seq.next_element::<String>()? {
                    names.push(n);
                }
                ReportTo::parse(&names).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_any(Names)
    }
}

impl LoggingSection {
    /// The TensorBoard directory: `logging_dir`, else `runs/` under the output or
    /// checkpoint directory. None unless `report_to` names `tensorboard` (or is `all`).
    pub fn tensorboard_dir(
        &self,
        output_dir: Option<&Path>,
        checkpoint_dir: Option<&Path>,
    ) -> Result<Option<PathBuf>> {
        if !self.report_to.names(Tracker::Tensorboard) {
            return Ok(None);
        }
        let default = output_dir.or(checkpoint_dir).map(|d| d.join("runs"));
        match self.logging_dir.clone().or(default) {
            Some(dir) => Ok(Some(dir)),
            None => Err(Error::invalid(
                "logging.logging_dir",
                "report_to: tensorboard needs a directory for its event files: set logging.logging_dir \
                 (or training.output_dir or checkpoint.dir, whose runs/ it defaults to)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(yaml: &str) -> std::result::Result<ReportTo, String> {
        serde_yaml_ng::from_str::<ReportTo>(yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn report_to_takes_a_name_a_list_or_commas() {
        use Tracker::*;
        assert_eq!(read("none"), Ok(ReportTo::None));
        assert_eq!(read("[]"), Ok(ReportTo::None));
        assert_eq!(read("[none]"), Ok(ReportTo::None));
        assert_eq!(read("all"), Ok(ReportTo::All));
        assert_eq!(read("tensorboard"), Ok(ReportTo::These(vec![Tensorboard])));
        assert_eq!(
            read("[tensorboard, wandb, mlflow, wandb]"),
            Ok(ReportTo::These(vec![Tensorboard, Wandb, Mlflow]))
        );
        assert_eq!(
            read("mlflow,wandb"),
            Ok(ReportTo::These(vec![Mlflow, Wandb]))
        );
        let back = serde_yaml_ng::to_string(&ReportTo::These(vec![Wandb, Mlflow])).unwrap();
        assert_eq!(read(&back), Ok(ReportTo::These(vec![Wandb, Mlflow])));
        assert!(ReportTo::All.names(Tensorboard) && !ReportTo::All.names(Wandb));
    }

    #[test]
    fn unknown_or_mixed_names_are_refused_with_the_accepted_ones() {
        let e = read("[tensorboard, comet_ml]").unwrap_err();
        assert!(e.contains("unknown tracker `comet_ml`"), "{e}");
        assert!(e.contains("none, tensorboard, wandb, mlflow, all"), "{e}");
        let e = read("[none, wandb]").unwrap_err();
        assert!(
            e.contains("`none` cannot be listed with other trackers"),
            "{e}"
        );
    }
}
