//! The command line. These names are a contract other tools drive `mt-launch` through:
//! extend them, never rename them.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "mt-launch",
    version,
    about = "Train LLMs larger than GPU memory from host RAM, one worker process per GPU",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the host RAM and per-GPU memory a run would hold (from the real layout and
    /// activation sizes) and the largest micro-batch that fits, and exit.
    Plan(PlanArgs),
    /// Draw the picture of a run from its metrics file (`--metrics-out`): an SVG with the
    /// training and eval loss, learning rate and tokens/s over the steps.
    Report(ReportArgs),
    /// Write an HF model directory (config, weights, tokenizer files) from a checkpoint,
    /// without training: the fp32 master weights of a resumable checkpoint, or the weights
    /// of a model-only one, in the dtype asked. Written aside and put in place atomically;
    /// never over the checkpoint, nor over files this project did not write unless
    /// --overwrite-output-dir.
    Export(ExportArgs),
    /// Start the trainer and keep it: take batches and commands (train_step,
    /// optimizer_step, forward, save, export, sleep/wake, weights, shutdown) over a local
    /// socket from a client (the Python package in python/, `import megatrain`) instead of
    /// stepping through the config's dataset. The same config, options and checks as a
    /// run; docs/serve.md.
    Serve(ServeArgs),
    /// Measure the MPI collectives a multi-node step makes (run under mpirun).
    #[command(hide = true)]
    BenchMpi(BenchMpiArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The Unix domain socket to listen on (created owner-only; an existing file there is
    /// never replaced). Default: mt-serve-<pid>.sock in $XDG_RUNTIME_DIR, else the
    /// temporary directory.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Args)]
pub struct BenchMpiArgs {
    /// The largest buffer, in MiB (sizes 1, 4, 16, … up to it).
    #[arg(long, default_value_t = 256)]
    pub max_mib: usize,

    /// Timed repetitions per size.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint: `checkpoint.dir/step-NNNNNNNN`, or a `checkpoint.dir` (its newest
    /// complete checkpoint).
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,

    /// The HF model directory to write (created, or replaced when it holds an export).
    #[arg(value_name = "OUT")]
    pub out: PathBuf,

    /// Dtype of the written weights (default: the checkpoint's, its config.json `dtype`).
    #[arg(long, value_parser = ["bfloat16", "float32"])]
    pub dtype: Option<String>,

    /// Write into OUT although it holds files this project did not write (another
    /// model's weight files are replaced, other files kept), as
    /// `training.overwrite_output_dir`.
    #[arg(long)]
    pub overwrite_output_dir: bool,

    /// Weights above this size are sharded, as `checkpoint.max_shard_size` (e.g. 5GB).
    #[arg(long, value_name = "SIZE", default_value = "5GB")]
    pub max_shard_size: mt::config::size::ByteSize,

    /// Skip checking the checkpoint's files against its manifest (`checkpoint.verify`).
    #[arg(long)]
    pub no_verify: bool,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A metrics JSONL file written by `--metrics-out`.
    #[arg(value_name = "METRICS.jsonl")]
    pub metrics: PathBuf,

    /// Where to write the SVG (default: beside the metrics file, `<name>.svg`).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// YAML run config.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,

    /// GPUs (one worker each); 0 = CPU workers.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,

    /// Worker processes with `--gpus 0`.
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,

    /// Override a config value (repeatable).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub set: Vec<String>,

    /// Device memory per GPU in GB for the largest-batch figure (default: the total the
    /// CUDA driver reports for the first GPU used).
    #[arg(long, value_name = "GB")]
    pub gpu_memory: Option<f64>,

    /// Host RAM in GB to plan against (default: what is available on this machine), for
    /// sizing another machine.
    #[arg(long, value_name = "GB")]
    pub host_memory: Option<f64>,

    /// With `memory.optimizer_offload: nvme`: room in GB on each drive of
    /// `memory.nvme_path`, instead of the free space read there (the directories then need
    /// not exist here), for sizing another machine.
    #[arg(long, value_name = "GB")]
    pub drive_size: Option<f64>,

    /// With `memory.optimizer_offload: nvme`: each drive's bandwidth in GB/s, READ or
    /// READ,WRITE, for the update's drive time, instead of measuring it (plan writes then
    /// reads 256 MiB in each directory of `memory.nvme_path` at once, direct, the file
    /// removed at once; nothing is measured with --drive-size).
    #[arg(long, value_name = "GB/s", allow_negative_numbers = true, value_parser = drive_speed)]
    pub drive_speed: Option<DriveSpeed>,

    /// The GPUs' compute in TFLOPS per device, MegaTrain's count (the TFLOPS/dev of a step
    /// line of this model not bound by the drives), for the gradient accumulation that
    /// keeps the drives' time within the compute's.
    #[arg(long, value_name = "TFLOPS", allow_negative_numbers = true, value_parser = positive)]
    pub tflops: Option<f64>,

    /// Nodes (launchers under `mpirun -np N`): adds each node's host bytes per parameter
    /// and the network traffic of a step.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nodes: usize,

    /// Print the plan as one JSON object (bytes) instead of the report.
    #[arg(long)]
    pub json: bool,
}

/// Training (the default command).
#[derive(Debug, Args)]
pub struct RunArgs {
    /// YAML run config (sections: model, dataset, training, optimizer, memory, logging).
    #[arg(long, value_name = "FILE", required = true)]
    pub config: Option<PathBuf>,

    /// One worker per GPU 0..N-1; 0 runs workers on CPU. Default: every GPU the NVIDIA
    /// driver lists, or 0 when there is none.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,

    /// Worker processes when running on CPU (`--gpus 0`). Default 1.
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,

    /// Override a config value, e.g. `--set training.num_steps=3` (repeatable).
    #[arg(long = "set", value_name = "KEY.PATH=VALUE")]
    pub set: Vec<String>,

    /// Write one JSON object per optimizer step to this file, and at the end the run's
    /// picture beside it (`<name>.svg`).
    #[arg(long, value_name = "FILE")]
    pub metrics_out: Option<PathBuf>,

    /// Write the global fp32 gradient of the first step (before clipping) to this
    /// safetensors file, with HF tensor names (for parity checks against PyTorch).
    #[arg(long, value_name = "FILE")]
    pub dump_grads: Option<PathBuf>,

    /// Write the logits of the first step's first micro-batch (all positions, f32) to this
    /// safetensors file (tensor `logits`, shape rows x seq x vocab); with several workers
    /// rank r writes FILE.rank<r> (for parity checks against PyTorch).
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,

    /// Resume from a checkpoint directory, or `latest` (the newest complete one under
    /// checkpoint.dir): weights, Adam state, step and data position.
    #[arg(long, value_name = "DIR|latest")]
    pub resume: Option<String>,

    /// With `memory.optimizer_offload: nvme`: keep the optimizer state's files on the
    /// drives after the run, with a manifest beside them, and resume from them when they are
    /// there, without a checkpoint (`--set memory.keep_nvme_state=true`; docs/nvme.md).
    #[arg(long)]
    pub keep_nvme_state: bool,

    /// With `--resume`: continue even where this launch's data or optimizer settings
    /// differ from the checkpoint's run (dataset files, max_seq_len, learning rate, …),
    /// one warning line per difference. Without it such a resume is refused, listing them.
    #[arg(long)]
    pub resume_changed: bool,

    /// Check everything (config, model, tokenizer and template, every dataset record,
    /// host memory) and exit without starting workers.
    #[arg(long)]
    pub dry_run: bool,

    /// Launch even when the device memory plan (`mt-launch plan`) says the micro-batch does
    /// not fit the memory a GPU has free (the check runs before anything is loaded).
    #[arg(long)]
    pub force: bool,

    /// Log level: error, warn, info, debug, trace (debug and trace also show libtorch's
    /// full error messages, C++ backtraces included).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: String,
}

/// `--resume` and `--resume-changed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// A checkpoint directory or `latest`.
    pub from: String,
    /// Accept settings that differ from the checkpoint's run, warning of each.
    pub accept_changes: bool,
}

/// Where the workers run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub gpus: usize,
    pub workers: usize,
    /// CUDA device of each rank (empty on CPU).
    pub devices: Vec<usize>,
    /// Launchers (nodes) under mpirun, each with `workers` workers; 1 without MPI.
    pub nodes: usize,
}

impl Placement {
    /// Workers over every node: the global batch is split over this many ranks.
    pub fn world(&self) -> usize {
        self.workers * self.nodes
    }
}

/// Where the workers run, from `--gpus` / `--workers` and the config's `model.devices`,
/// checked against the GPUs this machine has.
pub fn placement(
    gpus: Option<usize>,
    workers: Option<usize>,
    devices: Option<&[usize]>,
) -> Result<Placement> {
    placement_on(gpus, workers, devices, visible_gpus())
}

/// [`placement`] for sizing a run on another machine: `--gpus N` (or `model.devices`)
/// describes the target, whatever this machine has; without either, this machine's GPUs.
pub fn plan_placement(
    gpus: Option<usize>,
    workers: Option<usize>,
    devices: Option<&[usize]>,
) -> Result<Placement> {
    let target = gpus.max(devices.and_then(|d| d.iter().max().map(|&m| m + 1)));
    placement_on(gpus, workers, devices, target.unwrap_or_else(visible_gpus))
}

/// [`placement`] on a machine with `present` GPUs.
fn placement_on(
    gpus: Option<usize>,
    workers: Option<usize>,
    devices: Option<&[usize]>,
    present: usize,
) -> Result<Placement> {
    if let Some(d) = devices {
        if let Some(g) = gpus.filter(|&g| g != d.len()) {
            bail!(
                "--gpus {g} conflicts with model.devices {d:?} ({} devices): give one of them",
                d.len()
            );
        }
        if let Some(&bad) = d.iter().find(|&&i| i >= present) {
            bail!(
                "model.devices names cuda:{bad}, but this machine's NVIDIA driver lists {present} GPU(s)"
            );
        }
    }
    let gpus = gpus.unwrap_or_else(|| devices.map_or(present, <[usize]>::len));
    if gpus > 0 {
        if present < gpus {
            bail!(
                "--gpus {gpus} asks for more GPUs than the {present} this machine's NVIDIA driver lists"
            );
        }
        if let Some(w) = workers.filter(|&w| w != gpus) {
            bail!(
                "--workers {w} conflicts with --gpus {gpus}: with GPUs there is one worker per GPU"
            );
        }
        return Ok(Placement {
            gpus,
            workers: gpus,
            devices: devices.map_or_else(|| (0..gpus).collect(), <[usize]>::to_vec),
            nodes: 1,
        });
    }
    let workers = workers.unwrap_or(1);
    if workers == 0 {
        bail!("--workers must be at least 1");
    }
    Ok(Placement {
        gpus: 0,
        workers,
        devices: Vec::new(),
        nodes: 1,
    })
}

/// GPUs the NVIDIA driver lists (no CUDA needed in the launcher).
fn visible_gpus() -> usize {
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// `plan --drive-speed`: a drive's read and write bandwidth, GB/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriveSpeed {
    pub read: f64,
    pub write: f64,
}

/// `READ` or `READ,WRITE`, each a number of GB/s above 0.
fn drive_speed(s: &str) -> std::result::Result<DriveSpeed, String> {
    let (r, w) = s.split_once(',').unwrap_or((s, s));
    Ok(DriveSpeed {
        read: positive(r.trim())?,
        write: positive(w.trim())?,
    })
}

/// A finite number above 0.
fn positive(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("expected a number above 0, got '{s}'")),
    }
}
