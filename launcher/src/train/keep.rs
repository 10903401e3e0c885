//! What a run keeps, and what it says about it: where the model and checkpoints go (at
//! start), when a checkpoint is due (steps, and `checkpoint.every_minutes` of training),
//! the checkpoint a stop signal writes, and the one written after a worker is lost.
//!
//! A lost worker (it died, sent `Fatal`, or stayed silent past `training.worker_timeout_s`)
//! leaves the launcher's state consistent at the last step boundary: every update is
//! applied to all blocks before the step loop reads the next step's events (a worker lost
//! during an update lets the update finish first), and the Adam moments of that update
//! that the next backward had not yet made are made from the gradients it had not yet
//! overwritten ([`HostState::settle_moments`]: [`HostState::reduce_part`] runs a block's
//! pass before overwriting its gradient). So the workers are stopped and a full checkpoint
//! of that step is written, as a stop signal's. Not where the state is not all on this
//! host: resident blocks (`memory.resident_blocks`, held by the workers) and several nodes
//! (the others would have to join the writes): there the message says why nothing was
//! written.
//!
//! [`HostState::settle_moments`]: mt::host::HostState::settle_moments
//! [`HostState::reduce_part`]: mt::host::HostState::reduce_part

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use mt::config::{CheckpointContents, RunConfig};

use super::Trainer;

/// The run stopped at a step boundary because of a signal, after its checkpoint.
#[derive(Debug)]
pub struct Stopped {
    pub signal: i32,
    /// Steps done.
    pub step: u64,
    /// What was kept, said after the stop ("checkpoint of step N in DIR; resume with …").
    pub kept: String,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = nix::sys::signal::Signal::try_from(self.signal)
            .map(|s| s.as_str())
            .unwrap_or("signal");
        write!(
            f,
            "stopped by {name} at a step boundary after step {}: {}",
            self.step, self.kept
        )
    }
}

impl std::error::Error for Stopped {}

/// Says at start where the run's model and checkpoints go, and warns where it keeps no
/// periodic checkpoint.
pub(super) fn say_where(cfg: &RunConfig) {
    let t = &cfg.training;
    match (cfg.export_dir(), t.output_dir_is_default) {
        (Some(out), true) => println!(
            "the model goes to {} (training.output_dir unset: output/<config name>/ under the current directory)",
            out.display()
        ),
        (Some(out), false) => println!("the model goes to {}", out.display()),
        (None, _) => println!(
            "training.save_model: false: the trained model is not written{}",
            match &cfg.checkpoint.dir {
                Some(_) => "",
                None => ", and no checkpoint is kept (no checkpoint.dir)",
            }
        ),
    }
    let ck = &cfg.checkpoint;
    let Some(dir) = &ck.dir else { return };
    let mut when = Vec::new();
    if ck.every_steps > 0 {
        when.push(format!("every {} steps", ck.every_steps));
    }
    if ck.every_minutes > 0 {
        when.push(format!("every {} minutes", ck.every_minutes));
    }
    when.push("at a stop signal, a lost worker and the end".into());
    println!(
        "checkpoints go to {} ({}; the newest {} kept)",
        dir.display(),
        when.join(", "),
        ck.keep_last
    );
    if ck.every_steps == 0 && ck.every_minutes == 0 && ck.full_state_every_steps == 0 {
        tracing::warn!(
            "no periodic checkpoint (checkpoint.every_steps and checkpoint.every_minutes are 0): a machine that fails mid-run loses every step since the start"
        );
    }
}

/// Says at start what a server writes: only what its client asks for.
pub(super) fn say_where_served(cfg: &RunConfig) {
    let saves = match &cfg.checkpoint.dir {
        Some(dir) => format!("`save` writes a checkpoint under {}", dir.display()),
        None => "`save` needs a checkpoint.dir".into(),
    };
    println!(
        "a server writes only what its client asks: {saves}; `export` writes an HF model directory; nothing at shutdown or a stop signal"
    );
}

/// How to resume from the checkpoints under `dir`.
fn resume_hint(dir: &std::path::Path) -> String {
    format!(
        "resume with the same config and `--resume latest` (or `--resume {}`)",
        dir.display()
    )
}

impl Trainer {
    /// The checkpoint due after `done` steps, `last` the end of the run or a stop: the same
    /// answer on every node, which all take part in a sharded checkpoint (the clock of
    /// `checkpoint.every_minutes` is any node's).
    pub(super) fn checkpoint_due(
        &mut self,
        done: u64,
        last: bool,
    ) -> Result<Option<CheckpointContents>> {
        let ck = &self.cfg.checkpoint;
        let mut since = self.since_checkpoint.elapsed();
        if let Some(m) = self
            .mpi
            .filter(|_| ck.every_minutes > 0 && ck.dir.is_some())
        {
            let timed = m.max_i64("the checkpoint clock", ck.timed_due(since) as i64)?;
            since = match timed {
                0 => Duration::ZERO,
                _ => Duration::MAX,
            };
        }
        let due = ck.due(done, last, since);
        if due.is_some() {
            self.since_checkpoint = Instant::now();
        }
        Ok(due)
    }

    /// What a stop after `done` steps kept, for its message: the checkpoint the step loop
    /// just wrote for it.
    pub(super) fn kept_at_stop(&self, done: u64) -> String {
        let no_export = "the model is not exported on a stop (as HF Trainer)";
        match (&self.last_written, self.cfg.checkpoint.save_optimizer) {
            (Some((step, dir)), true) if *step == done => format!(
                "checkpoint of step {done} in {}; {}; {no_export}",
                dir.display(),
                resume_hint(dir)
            ),
            (Some((step, dir)), false) if *step == done => format!(
                "model-only checkpoint of step {done} in {} (checkpoint.save_optimizer: false: it cannot be resumed); {no_export}",
                dir.display()
            ),
            _ => format!(
                "no checkpoint written (training.save_model: false and no checkpoint.dir); {no_export}"
            ),
        }
    }

    /// After a worker was lost with `done` steps applied: stops the workers and writes a
    /// checkpoint of step `done` where the state allows (module docs); says what was kept,
    /// or why nothing was, and returns `err`.
    pub(super) fn rescue(&mut self, err: anyhow::Error, done: u64) -> anyhow::Error {
        self.progress.finish();
        let kept = match self.rescue_checkpoint(done) {
            Ok(kept) => kept,
            Err(e) => format!("the checkpoint of step {done} failed too ({e:#})"),
        };
        // Said on its own line, before the cause: the cause stays the error's one line
        // (`worker rank R failed: ...`), as every failure of a run reads.
        self.progress
            .println(&format!("worker lost after step {done}: {kept}"));
        err
    }

    fn rescue_checkpoint(&mut self, done: u64) -> Result<String> {
        let why_not = if self.mpi.is_some() {
            Some("several nodes: the others would have to take part in its writes".to_string())
        } else if self.host.resident_blocks() > 0 {
            Some(format!(
                "memory.resident_blocks: the state of blocks ..{} is held by the workers",
                self.host.resident_blocks()
            ))
        } else if self.writer.is_none() {
            Some("training.save_model: false and no checkpoint.dir".into())
        } else if done == self.start_step {
            Some("no step completed since the start".into())
        } else {
            None
        };
        if let Some(why) = why_not {
            return Ok(format!("no checkpoint written ({why})"));
        }
        // The host state is the launcher's own: stop the workers first (a hung one holds
        // its GPU), then write.
        self.sup.stop();
        // The last update's moments the next backward had not made yet (a checkpoint of the
        // step in flight waits for them too).
        self.host.settle_moments();
        let mut contents = self.cfg.checkpoint.due(done, true, Duration::ZERO);
        match self.checkpointed.filter(|&(s, _)| s == done) {
            // The step's checkpoint is being (or was) written: let it complete.
            Some((_, started)) => {
                contents = Some(started);
                let writer = self.writer.as_mut().expect("checked above");
                let root = writer.root().display().to_string();
                let written = writer.finish().map_err(|e| {
                    anyhow::Error::from(e).context(format!("checkpoint under {root} failed"))
                })?;
                self.report_written(written.into_iter().collect())?;
            }
            None => self.checkpoint(done, true, contents)?,
        }
        let Some((step, dir)) = self.last_written.clone().filter(|(s, _)| *s == done) else {
            return Ok(format!("the checkpoint of step {done} was not written"));
        };
        debug_assert_eq!(step, done);
        Ok(match contents {
            Some(CheckpointContents::Full) => format!(
                "checkpoint of step {done} written to {}; {}",
                dir.display(),
                resume_hint(&dir)
            ),
            _ => format!(
                "model-only checkpoint of step {done} written to {} (checkpoint.save_optimizer: false: it cannot be resumed)",
                dir.display()
            ),
        })
    }

    /// Records the newest checkpoint written (for the stop and crash messages).
    pub(super) fn note_written(&mut self, dir: &std::path::Path) {
        let step = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(step) = step {
            self.last_written = Some((step, PathBuf::from(dir)));
        }
    }
}

/// The outputs a run writes besides its model and checkpoints (which the ownership check
/// covers) can be written: `--metrics-out`'s directory and `logging.logging_dir`, checked
/// before any long work and creating nothing (a launch and `--dry-run` alike).
pub fn check_outputs(cfg: &RunConfig, metrics_out: Option<&std::path::Path>) -> Result<()> {
    if let Some(m) = metrics_out {
        let dir = m.parent().filter(|d| !d.as_os_str().is_empty());
        mt::checkpoint::check_writable(dir.unwrap_or(std::path::Path::new(".")), "--metrics-out")?;
    }
    if let Some(dir) = cfg.tensorboard_dir()? {
        mt::checkpoint::check_writable(&dir, "logging.logging_dir")?;
    }
    Ok(())
}

/// With `memory.keep_nvme_state`, the optimizer state on the drives, that of step `done`
/// (the run's last, or the one a stop ended at), kept with its manifest
/// ([`mt::host::HostState::keep_state`]).
pub(super) fn keep_drives_state(
    host: &mut mt::host::HostState,
    cfg: &RunConfig,
    done: u64,
    nan_run: u64,
    schedule: mt::checkpoint::state::Schedule,
) -> Result<()> {
    if !cfg.memory.keep_nvme_state {
        return Ok(());
    }
    let path = host.keep_state(host.train_state(done, nan_run, schedule), cfg)?;
    println!(
        "optimizer state kept on the drives at step {done} ({}): a run of the same config with --keep-nvme-state resumes from it",
        path.display()
    );
    Ok(())
}
