//! `mt-launch`: parse, build the trainer, run, map errors to an exit code.

#![deny(unsafe_code)]

mod bench_mpi;
mod cli;
mod dpo;
mod eval;
mod export;
mod gpu;
mod grpo;

// MPI through a dlopen'd shim: FFI.
#[allow(unsafe_code)]
mod mpi;
mod plan;
mod prepare;
mod progress;
mod serve;
mod supervisor;
mod torch;
mod trackers;
mod train;
// Signals and process groups (with mpi.rs, the launcher's only unsafe code).
#[allow(unsafe_code)]
mod unix;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.run.log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(progress::LogWriter)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let result = run(cli);
    let nodes = mpi::job();
    // Under mpirun, who says it: `mt-launch (rank R of N on HOST)`.
    let me = mpi::world().map_or("mt-launch".into(), |m| format!("mt-launch ({})", m.who()));
    match result {
        Ok(()) => {
            nodes.inspect(|m| m.finalize());
            ExitCode::SUCCESS
        }
        Err(e) if unix::interrupted(&e).is_some() => {
            let stopped = unix::interrupted(&e).expect("checked");
            say(&format!("{me}: {stopped}"));
            nodes.inspect(|m| m.finalize());
            ExitCode::from(128 + stopped.signal as u8)
        }
        Err(e) if e.is::<train::Stopped>() => {
            let stopped = e.downcast_ref::<train::Stopped>().expect("checked");
            say(&format!("{me}: {stopped}"));
            nodes.inspect(|m| m.finalize());
            ExitCode::from(128 + stopped.signal as u8)
        }
        Err(e) => {
            say(&format!("{me}: error: {e:#}"));
            // Its workers are stopped (the trainer is dropped): end every rank now, as
            // the others would wait for this one in their next collective.
            if let Some(m) = nodes {
                m.abort(1);
            }
            ExitCode::FAILURE
        }
    }
}

/// Writes `line` to stderr in one write: ranks under mpirun share one output, and a line
/// written in pieces can be cut by another rank's (or this rank's stdout).
fn say(line: &str) {
    progress::err(line);
}

fn run(cli: cli::Cli) -> Result<()> {
    // Every `MT_*` variable (docs/switches.md), checked before any work: a bad value is a
    // one-line error naming it. The workers inherit them.
    mt::switches::init()?;
    mt::fault::Phase::fail_alloc_target()?;
    let cli = match cli.command {
        Some(cli::Command::Plan(p)) => {
            unix::default_sigpipe()?;
            return plan::plan(p);
        }
        Some(cli::Command::Report(r)) => return report(&r.metrics, r.out.as_deref()),
        Some(cli::Command::Export(e)) => return export::export(&e),
        Some(cli::Command::BenchMpi(b)) => return bench_mpi::bench(b),
        Some(cli::Command::Serve(s)) => return serve(s),
        None => cli.run,
    };
    let Some(Launch {
        cfg,
        placement,
        resume,
    }) = launch(&cli)?
    else {
        return Ok(());
    };
    let metrics = cli.metrics_out.clone();
    let result = train::Trainer::new(train::Args {
        mode: train::Mode::Run,
        cfg,
        placement,
        outputs: train::Outputs {
            metrics_out: cli.metrics_out,
            dump_grads: cli.dump_grads,
            dump_logits: cli.dump_logits,
        },
        resume,
        force: cli.force,
    })?
    .run();
    // The picture of the run, whichever way it ended, as far as it went.
    // Node 0 writes the metrics (and so the picture) under mpirun.
    let lead = mpi::world().is_none_or(|m| m.rank == 0);
    if let Some(m) = metrics.filter(|m| lead && m.is_file()) {
        match mt::metrics::plot::write_beside(&m) {
            Ok(svg) => println!("picture of the run: {}", svg.display()),
            Err(e) => tracing::warn!("no picture of the run: {e}"),
        }
    }
    result
}

/// `mt-launch serve`: a run's start-up, then commands from a client ([`serve`]).
fn serve(args: cli::ServeArgs) -> Result<()> {
    let run = &args.run;
    if mpi::job().is_some() {
        anyhow::bail!("mt-launch serve runs on one node: start it without mpirun");
    }
    if run.dry_run {
        anyhow::bail!(
            "--dry-run: give it to a run (mt-launch --config X --dry-run); serve checks the same at start"
        );
    }
    let Some(Launch {
        cfg,
        placement,
        resume,
    }) = launch(run)?
    else {
        return Ok(());
    };
    if run.dump_grads.is_some() || run.dump_logits.is_some() {
        anyhow::bail!("--dump-grads and --dump-logits apply to a run, not to serve");
    }
    let outputs = train::Outputs {
        metrics_out: run.metrics_out.clone(),
        dump_grads: None,
        dump_logits: None,
    };
    let trainer = train::Trainer::new(train::Args {
        mode: train::Mode::Serve,
        cfg,
        placement,
        outputs,
        resume,
        force: run.force,
    })?;
    let result = serve::serve(trainer, args.socket.as_deref());
    // The picture of the optimizer steps served, as a run draws its own.
    if let Some(m) = run.metrics_out.as_ref().filter(|m| m.is_file()) {
        match mt::metrics::plot::write_beside(m) {
            Ok(svg) => println!("picture of the run: {}", svg.display()),
            Err(e) => tracing::warn!("no picture of the run: {e}"),
        }
    }
    result
}

/// What a run and a server start from: the config loaded and checked, the placement of
/// the workers, the checkpoint to resume. `None`: `--dry-run` did its checks.
struct Launch {
    cfg: mt::config::RunConfig,
    placement: cli::Placement,
    resume: Option<cli::Resume>,
}

fn launch(cli: &cli::RunArgs) -> Result<Option<Launch>> {
    let config = cli.config.as_ref().expect("clap requires --config");
    unix::install_stop_handlers()?;
    let mut set = cli.set.clone();
    if cli.keep_nvme_state {
        set.push("memory.keep_nvme_state=true".into());
    }
    let mut cfg = mt::config::RunConfig::load(config, &set)?;
    unix::check_stop("config loading")?;
    for note in &cfg.notes {
        println!("note: {note}");
    }
    cfg.check_sources(true)?;
    let mut placement = cli::placement(cli.gpus, cli.workers, cfg.model.devices.as_deref())?;
    if let Some(m) = mpi::init()? {
        placement.nodes = m.size;
        if m.size > 1 {
            // One write, so that ranks sharing mpirun's output do not interleave it.
            say(&format!(
                "mt-launch: {} (pid {})",
                m.who(),
                std::process::id()
            ));
        }
    }
    if let Some(line) = cfg.resolve_batch(placement.world()) {
        println!("{line}");
    }
    let resume = cli
        .resume
        .clone()
        .or_else(|| cfg.training.resume_from_checkpoint.clone())
        .map(|from| cli::Resume {
            from,
            accept_changes: cli.resume_changed,
        });
    if cli.resume_changed && resume.is_none() {
        anyhow::bail!(
            "--resume-changed applies to a resume: give --resume (or training.resume_from_checkpoint)"
        );
    }
    if cli.dry_run {
        plan::dry_run(
            &cfg,
            &placement,
            resume.as_ref(),
            cli.force,
            cli.metrics_out.as_deref(),
        )?;
        return Ok(None);
    }
    Ok(Some(Launch {
        cfg,
        placement,
        resume,
    }))
}

/// `mt-launch report METRICS.jsonl [--out FILE]`.
fn report(metrics: &std::path::Path, out: Option<&std::path::Path>) -> Result<()> {
    let out = match out {
        Some(out) => {
            mt::metrics::plot::write(metrics, out)?;
            out.to_path_buf()
        }
        None => mt::metrics::plot::write_beside(metrics)?,
    };
    println!("{}", out.display());
    Ok(())
}
