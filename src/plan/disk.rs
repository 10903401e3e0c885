//! What a run writes to disk ([`DiskPlan`]): the model at the end, and each checkpoint (an
//! HF model directory and, holding the optimizer state, the fp32 master and Adam's m and v:
//! 12 bytes per parameter whatever `memory.*` holds them in), how often and how many are
//! kept; beside the host RAM the background writer stages them in.

use std::path::PathBuf;

use crate::config::RunConfig;

/// Disk bytes of a run's model and checkpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskPlan {
    /// The HF model directory: every parameter in `model.dtype`, and the carried tensors.
    pub model: u64,
    /// The optimizer state of a full checkpoint (0 with `checkpoint.save_optimizer: false`).
    pub optimizer: u64,
    /// Where the model goes (None: `training.save_model: false`).
    pub export_dir: Option<PathBuf>,
    /// Where checkpoints go (None: none are written).
    pub checkpoint_dir: Option<PathBuf>,
    pub keep_last: usize,
    pub every_steps: u64,
    pub every_minutes: u64,
    /// Host RAM of the background writer's staging area (counted in the host plan).
    pub staging: u64,
}

impl DiskPlan {
    /// The plan of `cfg`'s run of `params` parameters carrying `carried` bytes of tensors
    /// as read, its checkpoints staged in `staging` bytes of RAM.
    pub fn new(cfg: &RunConfig, params: u64, carried: u64, staging: u64) -> DiskPlan {
        let ck = &cfg.checkpoint;
        DiskPlan {
            model: params * cfg.model.dtype.size() as u64 + carried,
            optimizer: if ck.save_optimizer { 12 * params } else { 0 },
            export_dir: cfg.export_dir().map(PathBuf::from),
            checkpoint_dir: ck.dir.clone(),
            keep_last: ck.keep_last,
            every_steps: ck.every_steps,
            every_minutes: ck.every_minutes,
            staging,
        }
    }

    /// Bytes of one checkpoint.
    pub fn checkpoint_bytes(&self) -> u64 {
        self.model + self.optimizer
    }

    /// Bytes the kept checkpoints take at most (the newest is always kept).
    pub fn kept_bytes(&self) -> u64 {
        self.checkpoint_bytes() * self.keep_last.max(1) as u64
    }
}

impl std::fmt::Display for DiskPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(f, "disk:")?;
        match &self.export_dir {
            Some(d) => writeln!(
                f,
                "  model                 {:>9.2} GB at the end, in {}",
                gb(self.model),
                d.display()
            )?,
            None => writeln!(
                f,
                "  model                 not written (training.save_model: false)"
            )?,
        }
        let Some(dir) = &self.checkpoint_dir else {
            return write!(f, "  checkpoints           none (no checkpoint.dir)");
        };
        let mut when = Vec::new();
        if self.every_steps > 0 {
            when.push(format!("every {} steps", self.every_steps));
        }
        if self.every_minutes > 0 {
            when.push(format!("every {} minutes", self.every_minutes));
        }
        when.push("at a stop, a lost worker and the end".into());
        writeln!(
            f,
            "  each checkpoint       {:>9.2} GB (model {:.2} GB + optimizer state {:.2} GB), {}",
            gb(self.checkpoint_bytes()),
            gb(self.model),
            gb(self.optimizer),
            when.join(", ")
        )?;
        writeln!(
            f,
            "  checkpoints kept      {:>9.2} GB at most (the newest {}), in {}",
            gb(self.kept_bytes()),
            self.keep_last.max(1),
            dir.display()
        )?;
        write!(
            f,
            "  staged in host RAM    {:>9.2} GB (counted above{})",
            gb(self.staging),
            match self.staging {
                0 => ": written in place, training waits",
                _ => "",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1e9 parameters in bf16: a 2 GB model, 12 GB of optimizer state (fp32 master, m, v),
    /// 14 GB a checkpoint, 28 GB for the default two kept.
    #[test]
    fn checkpoint_bytes_are_model_and_optimizer() {
        let yaml = "model: {path: m}\ndataset: {format: tokenized, path: d.jsonl}\n";
        let p = std::env::temp_dir().join(format!("mt-disk-{}.yaml", std::process::id()));
        std::fs::write(&p, yaml).unwrap();
        let mut cfg = RunConfig::load(&p, &[]).unwrap();
        let d = DiskPlan::new(&cfg, 1_000_000_000, 5, 7);
        assert_eq!((d.model, d.optimizer), (2_000_000_005, 12_000_000_000));
        assert_eq!(d.checkpoint_bytes(), 14_000_000_005);
        assert_eq!(d.kept_bytes(), 2 * 14_000_000_005);
        assert!(d.to_string().contains("every 30 minutes"), "{d}");
        cfg.checkpoint.save_optimizer = false;
        cfg.model.dtype = crate::config::DType::Float32;
        let d = DiskPlan::new(&cfg, 10, 0, 0);
        assert_eq!((d.model, d.optimizer), (40, 0));
        cfg.checkpoint.dir = None;
        let d = DiskPlan::new(&cfg, 10, 0, 0);
        assert!(d.to_string().contains("none (no checkpoint.dir)"), "{d}");
    }
}
