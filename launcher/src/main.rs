//! `mt-launch`: parse, build the trainer, run, map errors to an exit code.

mod cli;
mod host;
mod supervisor;
mod train;

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mt-launch: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: cli::Cli) -> Result<()> {
    let cfg = mt::config::RunConfig::load(&cli.config, &cli.set)?;
    let placement = cli.placement()?;
    train::Trainer::new(
        cfg,
        placement,
        cli.metrics_out,
        cli.dump_grads,
        cli.dump_logits,
    )?
    .run()
}
