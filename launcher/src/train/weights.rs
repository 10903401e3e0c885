//! Where a run's weights come from: its initial model (`model.path`'s weights, or random
//! init from `training.seed`) or the checkpoint it resumes; what checkpoints record to
//! tell whether a resume continues the same run ([`schedule`]: the schedule, the data's
//! files and settings, the learning rate and optimizer), and the check of a resume against
//! it before anything is loaded ([`check_resume`]: differences refused, each named, unless
//! `--resume-changed`).
//!
//! Under `training.stage: grpo` with `grpo.beta` > 0 the initial model is also the
//! reference of the KL term (TRL's reference: the initial policy). A loop resumes once per
//! batch of rollouts (examples/grpo_loop_files.py), so the reference is never the weights a launch
//! resumes: such a launch first loads the initial model, as a fresh run does, lets the
//! workers compute the reference log-probabilities under it ([`crate::grpo::reference_logps`])
//! and only then restores the checkpoint into the same buffers (no second copy of the
//! model). The initial model is a function of the config, so the reference is the same at
//! every launch; checkpoints record which it was, and a resume naming another is refused.

use std::path::Path;

use anyhow::{Context, Result, bail};
use mt::checkpoint;
use mt::config::hf::ModelSpec;
use mt::config::{Init as InitKind, RunConfig, Stage};

use mt::host::HostState;

/// Fills the master weights and the store with the run's initial model.
pub(super) fn load_initial(host: &mut HostState, cfg: &RunConfig, spec: &ModelSpec) -> Result<()> {
    match cfg.model.init {
        InitKind::Pretrained => {
            // An export of this project carries its manifest: checked before it is read.
            let dir = &cfg.model.path;
            if cfg.checkpoint.verify && dir.join(checkpoint::manifest::EXPORT_MARKER).is_file() {
                verified(dir)?;
            }
            host.init_master(|layout, master| checkpoint::load_pretrained(dir, layout, master))?;
        }
        InitKind::Random => host.init_master(|layout, master| {
            checkpoint::init_random(layout, spec, cfg.training.seed, master);
            Ok(())
        })?,
    }
    // The loading's transfers to the drives are not the first step's.
    host.take_drive_io();
    Ok(())
}

/// Checks, before anything is loaded, that checkpoint `dir` continues this launch's run:
/// it was saved for `layout`, steps are left to run, the GRPO reference is the same, and
/// every setting it recorded
/// ([`checkpoint::state::Schedule`]) is this launch's. Differences are refused, each
/// named, unless `accept` (`--resume-changed`), which warns of each; a checkpoint of an
/// earlier build, which recorded none, is resumed with a warning that it cannot be checked.
pub(crate) fn check_resume(
    dir: &Path,
    cfg: &RunConfig,
    layout: &mt::layout::Layout,
    ours: &checkpoint::state::Schedule,
    accept: bool,
) -> Result<()> {
    let state = checkpoint::state::read_state(dir)?;
    if let Err(e) = checkpoint::state::check_layout(dir, &state, layout) {
        // A setting that shapes the layout (vlm.freeze_projector) is named where recorded.
        let named = (state.schedule.as_ref()).map_or_else(Vec::new, |s| ours.differences(s));
        match named.is_empty() {
            true => return Err(e.into()),
            false => bail!("{e}; this launch differs in: {}", named.join("; ")),
        }
    }
    let steps = cfg.training.num_steps;
    if state.step >= steps {
        bail!(
            "{}: the checkpoint is at step {}, training.num_steps is {steps}: nothing left to run",
            dir.display(),
            state.step
        );
    }
    let Some(saved) = state.schedule.as_ref() else {
        tracing::warn!(
            "{}: the checkpoint records no run settings (an earlier build wrote it): cannot check that this resume continues the same run",
            dir.display()
        );
        return Ok(());
    };
    if let (Some(a), Some(b)) = (&ours.grpo_reference, &saved.grpo_reference)
        && a != b
    {
        bail!(
            "{}: the run's grpo.beta KL term is against {b}, this launch's initial model is {a}: the reference is the run's initial model, keep model.path and model.init (and training.seed at random init) as the run started",
            dir.display()
        );
    }
    if saved.settings.is_none() {
        tracing::warn!(
            "{}: the checkpoint records no data or optimizer settings (an earlier build wrote it): cannot check them against this launch's",
            dir.display()
        );
    }
    if let Some(warning) = ours.rescheduled(saved) {
        tracing::warn!("{}: {warning}", dir.display());
    }
    let differences = ours.differences(saved);
    if differences.is_empty() {
        return Ok(());
    }
    if accept {
        for d in &differences {
            tracing::warn!("resuming with a changed setting (--resume-changed): {d}");
        }
        return Ok(());
    }
    bail!(
        "{}: this launch would not continue the checkpoint's run:\n  {}\nrestore those settings, or pass --resume-changed to continue with them changed",
        dir.display(),
        differences.join("\n  ")
    )
}

/// Restores the checkpoint `dir` (weights, Adam state, step), checked by
/// [`check_resume`]: (its step, its count of non-finite steps in a row). Every node first
/// checks the files it is about to read against their manifest (`checkpoint.verify`).
pub(super) fn restore(host: &mut HostState, dir: &Path, cfg: &RunConfig) -> Result<(u64, u64)> {
    if cfg.checkpoint.verify {
        verified(dir)?;
    }
    let state = host.restore(dir)?;
    host.take_drive_io();
    println!("resumed from {} at step {}", dir.display(), state.step);
    Ok((state.step, state.nan_run))
}

/// The optimizer state kept on the drives (`memory.keep_nvme_state`) this launch resumes,
/// where there is one: checked, before anything is loaded, to be this run's (the model, the
/// modes, the drives; the settings as a checkpoint's are, [`check_resume`], differences
/// refused) and alone (not with `--resume`, a server or several nodes).
pub(super) fn check_kept(
    cfg: &RunConfig,
    layout: &mt::layout::Layout,
    ours: &checkpoint::state::Schedule,
    resume: Option<&Path>,
    mode: super::Mode,
    mpi: Option<&'static crate::mpi::Mpi>,
) -> Result<Option<(std::path::PathBuf, mt::host::Kept)>> {
    if !cfg.memory.keep_nvme_state {
        return Ok(None);
    }
    if mode == super::Mode::Serve || mpi.is_some() {
        bail!(
            "memory.keep_nvme_state: a run of one node (mt-launch --config X) keeps its state; not mt-launch serve nor under mpirun yet"
        );
    }
    let Some((path, kept)) = mt::host::Kept::read(cfg)? else {
        return Ok(None);
    };
    if let Some(dir) = resume {
        bail!(
            "{}: a kept optimizer state (step {}) is there, and --resume names the checkpoint {}: resume from one of them (remove the kept state's files, which its manifest lists, to resume from the checkpoint)",
            path.display(),
            kept.state.step,
            dir.display()
        );
    }
    kept.check(&path, cfg, layout)?;
    let differences = match &kept.state.schedule {
        Some(saved) => ours.differences(saved),
        None => vec!["the run's settings: none recorded".into()],
    };
    if !differences.is_empty() {
        bail!(
            "{}: this launch would not continue the kept state's run:\n  {}\nrestore those settings, or remove the kept state's files to start afresh",
            path.display(),
            differences.join("\n  ")
        );
    }
    Ok(Some((path, kept)))
}

/// Resumes from the optimizer state kept on the drives (its manifest `kept` at `path`,
/// checked by [`check_kept`]): every block read and compared with the manifest's checksum.
/// (its step, its count of non-finite steps in a row).
pub(super) fn resume_kept(
    host: &mut HostState,
    path: &Path,
    kept: &mt::host::Kept,
) -> Result<(u64, u64)> {
    let t = std::time::Instant::now();
    let state = host.resume_kept(path, kept)?;
    let io = host.take_drive_io();
    println!(
        "resumed from the optimizer state kept on the drives ({}) at step {}: {:.2} GB read and checked in {:.1}s",
        path.display(),
        state.step,
        io.map_or(0, |io| io.read_bytes) as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok((state.step, state.nan_run))
}

/// The settings a checkpoint records to tell whether a resume continues the same run:
/// the schedule's, and the data and optimizer settings (the data files fingerprinted).
pub(crate) fn schedule(cfg: &RunConfig) -> Result<checkpoint::state::Schedule> {
    Ok(checkpoint::state::Schedule {
        seed: cfg.training.seed,
        batch_size: cfg.training.batch_size,
        shuffle: cfg.dataset.shuffle,
        decay_steps: (cfg.training.lr_scheduler != mt::config::LrScheduler::Constant)
            .then_some(cfg.training.num_steps),
        grpo_reference: grpo_reference(cfg),
        settings: Some(checkpoint::settings::RunSettings::of(cfg)?),
    })
}

/// With `grpo.beta` > 0, the initial model the KL term is against, in words.
fn grpo_reference(cfg: &RunConfig) -> Option<String> {
    let beta = cfg.grpo.beta.unwrap_or(0.0);
    if cfg.training.stage != Stage::Grpo || beta <= 0.0 {
        return None;
    }
    let path = std::fs::canonicalize(&cfg.model.path).unwrap_or(cfg.model.path.clone());
    Some(match cfg.model.init {
        InitKind::Pretrained => format!("the weights of {}", path.display()),
        InitKind::Random => format!(
            "the random init of {} with training.seed {}",
            path.display(),
            cfg.training.seed
        ),
    })
}

/// Checks every file of `dir` against its manifest ([`checkpoint::verify`]), timed.
fn verified(dir: &Path) -> Result<()> {
    let t = std::time::Instant::now();
    let checked = checkpoint::verify(dir)
        .with_context(|| format!("{} is damaged (checkpoint.verify)", dir.display()))?;
    if let checkpoint::manifest::Checked::Verified { files, bytes } = checked {
        let s = t.elapsed().as_secs_f64();
        tracing::info!(
            "verified {} ({files} files, {:.2} GB in {s:.2}s, {:.2} GB/s)",
            dir.display(),
            bytes as f64 / 1e9,
            bytes as f64 / 1e9 / s.max(1e-9)
        );
    }
    Ok(())
}
