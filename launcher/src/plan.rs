//! `mt-launch plan` and `--dry-run`: what a run would hold and whether it fits, printed
//! without starting a worker.

use anyhow::Result;
use mt::config::RunConfig;
use mt::plan::{DeviceOpts, DevicePlan, Fit, NodesPlan};

use crate::cli::{self, Placement};
use crate::prepare::Prepared;

/// `mt-launch plan`: host RAM (and what is available), per-worker device memory for the
/// configured micro-batch, and the largest micro-batch that fits a GPU.
pub fn plan(p: cli::PlanArgs) -> Result<()> {
    let mut cfg = RunConfig::load_for_plan(&p.config, &p.set)?;
    for note in &cfg.notes {
        println!("note: {note}");
    }
    cfg.check_sources(false)?;
    let mut placement = cli::plan_placement(p.gpus, p.workers, cfg.model.devices.as_deref())?;
    if p.nodes == 0 {
        anyhow::bail!("--nodes must be at least 1");
    }
    placement.nodes = p.nodes;
    if p.gpus.is_none() && placement.gpus == 0 {
        println!(
            "note: no GPU here and no --gpus: this sizes {} CPU worker(s); to size a GPU machine give its GPUs and their memory: mt-launch plan --config {} --gpus 1 --gpu-memory 80",
            placement.workers,
            p.config.display()
        );
    }
    if let Some(line) = cfg.resolve_batch(placement.world()) {
        println!("{line}");
    }
    let prep = Prepared::for_plan(&cfg, &placement)?;
    let (per_epoch, noun) = prep.data.epoch_len();
    if per_epoch > 0
        && let Some(line) = cfg.resolve_steps(per_epoch, noun)
    {
        println!("{line}");
    }
    let given = p.gpu_memory.map(|gb| (gb * 1e9) as u64);
    // As the run plans, but with --gpu-memory for the GPUs' free memory where given.
    let run_opts = crate::prepare::device_opts(&cfg, &placement, &prep.data);
    let opts = DeviceOpts {
        device_free: given.or(run_opts.device_free),
        ..run_opts
    };
    let (rows, seq_len) = prep.micro_batch(&cfg, placement.world());
    let device = DevicePlan::new(&prep.spec, &prep.layout, opts, rows, seq_len);
    let resident = crate::prepare::resident_blocks(&prep, &cfg, &placement, opts.device_free);
    // The first GPU's total memory, from the same reading as the run's free memory.
    let budget = given.or_else(|| match placement.devices.is_empty() {
        true => None,
        false => crate::gpu::memory(&placement.devices, placement.workers)?
            .first()
            .map(|d| d.total),
    });
    let best =
        budget.map(|b| DevicePlan::largest_batch(&prep.spec, &prep.layout, opts, seq_len, b));
    let sharded = prep.plan.sharded(&prep.layout, p.nodes);
    let drives = match (mt::plan::DrivePlan::new(&cfg, &prep.layout), p.drive_size) {
        (Some(d), Some(gb)) => Some(d.with_drive_size((gb * 1e9) as u64)),
        (None, Some(_)) => anyhow::bail!(
            "--drive-size sizes the drives of memory.optimizer_offload: nvme; this run keeps the \
             optimizer state in RAM (add --set memory.optimizer_offload=nvme --set \
             memory.nvme_path=DIR)"
        ),
        (d, None) => d,
    };
    let drives = match (drives, p.drive_speed) {
        (None, Some(_)) => anyhow::bail!(
            "--drive-speed is the bandwidth of the drives of memory.optimizer_offload: nvme; \
             this run keeps the optimizer state in RAM"
        ),
        (d, speed) => d
            .map(|d| drive_speed(d, speed, p.drive_size.is_some()))
            .transpose()?,
    };
    let bound = drives
        .as_ref()
        .and_then(|d| DriveBound::new(&cfg, &prep, d, placement.world(), p.tflops));
    // --host-memory stands for the RAM of the machine planned for.
    let host = match p.host_memory {
        Some(gb) => Host::Given((gb * 1e9) as u64),
        None => Host::Here(mt::sysmem::available_host_bytes()),
    };
    let nodes = NodesPlan::new(&prep.plan, &sharded, p.nodes as u64);
    if p.json {
        let mut v = json(&prep, &device, budget, best);
        // Resident blocks sit beside the step for the whole run.
        v["device"]["resident_blocks"] = serde_json::json!(resident.0);
        v["device"]["resident_bytes"] = serde_json::json!(resident.1);
        v["device"]["total"] = serde_json::json!(device.total() + resident.1);
        let disk = disk(&cfg, &prep);
        v["disk"] = serde_json::json!({
            "model_bytes": disk.model,
            "optimizer_bytes": disk.optimizer,
            "checkpoint_bytes": disk.checkpoint_bytes(),
            "keep_last": disk.keep_last,
            "kept_bytes": disk.kept_bytes(),
            "every_steps": disk.every_steps,
            "every_minutes": disk.every_minutes,
            "checkpoint_dir": disk.checkpoint_dir,
            "export_dir": disk.export_dir,
            "staging_bytes": disk.staging,
        });
        if let Some(d) = &drives {
            v["drives"] = serde_json::json!({
                "dirs": d.dirs,
                "per_drive_bytes": d.per_drive,
                "total_bytes": d.total(),
                "kept_store_bytes": d.kept_store,
                "host_window_bytes": d.windows,
                "stated_drive_bytes": d.stated,
                "update_read_bytes": d.update,
                "update_write_bytes": d.update,
                "read_bytes_per_s": d.speed.as_ref().map(|s| s.per_drive.iter().map(|x| x.0).collect::<Vec<_>>()),
                "write_bytes_per_s": d.speed.as_ref().map(|s| s.per_drive.iter().map(|x| x.1).collect::<Vec<_>>()),
                "speed_source": d.speed.as_ref().map(|s| match s.source {
                    mt::plan::SpeedSource::Stated => "stated",
                    mt::plan::SpeedSource::Measured { .. } => "measured",
                }),
                "update_s": d.update_s(),
                "tokens_per_update": bound.as_ref().map(|b| b.tokens),
                "max_tokens_per_s": bound.as_ref().map(|b| b.tokens_per_s),
                "max_tflops_per_device": bound.as_ref().map(|b| b.tflops),
                "gradient_accumulation_steps": bound.as_ref().and_then(|b| b.accumulation.map(|a| a.0)),
            });
            v["host"]["drive_windows"] = serde_json::json!(prep.plan.drive_windows);
        }
        v["nodes"] = serde_json::json!({
            "nodes": nodes.nodes,
            "replicated_bytes_per_param": nodes.replicated_per_param,
            "sharded_bytes_per_param": nodes.sharded_per_param,
            "replicated_step_bytes": nodes.replicated_step_bytes,
            "sharded_step_bytes": nodes.sharded_step_bytes,
            "sharded_node0_bytes": nodes.sharded_node_bytes,
            "sharded_gather_bytes": nodes.sharded_gather_bytes,
            "sharded_staging_bytes": nodes.sharded_staging_bytes,
        });
        v["host"]["ram"] = serde_json::json!(host.bytes());
        v["host"]["fits"] = serde_json::json!(
            host.bytes()
                .map(|_| format!("{:?}", prep.plan.fit(host.bytes())))
        );
        println!("{v}");
        return drives.map_or(Ok(()), |d| Ok(d.check()?));
    }
    describe(&cfg, &placement, &prep, host);
    if let Some(d) = &drives {
        print!("{d}");
    }
    if let Some(b) = &bound {
        println!("{b}");
    }
    println!(
        "host memory modes (the same training; {}):\n{}",
        host,
        mt::plan::describe_modes(&prep.plan, host.bytes()).trim_end()
    );
    if p.nodes > 1 {
        print!("{nodes}");
    }
    println!("{device}");
    if resident.0 > 0 {
        println!(
            "resident blocks: {} of {}, {:.2} GB more per worker for the whole run",
            resident.0,
            prep.layout.blocks.len(),
            resident.1 as f64 / 1e9
        );
    }
    match (budget, best) {
        (Some(b), Some(best)) => println!(
            "largest micro-batch on a {:.1} GB GPU: {best} x {seq_len} tokens (configured: {rows}; \
             training.batch_size = workers x gradient_accumulation_steps x micro-batch)",
            b as f64 / 1e9
        ),
        _ => println!("pass --gpu-memory GB for the largest micro-batch that fits a GPU"),
    }
    // The state must fit the drives: refused as the launch refuses it.
    drives.map_or(Ok(()), |d| Ok(d.check()?))
}

/// `d` with the drives' bandwidth: `stated` (`--drive-speed`), else measured in its
/// directories unless they stand for drives elsewhere (`elsewhere`: `--drive-size`) or do
/// not hold the state (the plan refuses it at its end).
fn drive_speed(
    d: mt::plan::DrivePlan,
    stated: Option<cli::DriveSpeed>,
    elsewhere: bool,
) -> Result<mt::plan::DrivePlan> {
    use mt::plan::{DriveSpeed, SpeedSource};
    if let Some(s) = stated {
        let per_drive = vec![(s.read * 1e9, s.write * 1e9); d.dirs.len()];
        let source = SpeedSource::Stated;
        return Ok(d.with_speed(DriveSpeed { per_drive, source }));
    }
    if elsewhere || d.check().is_err() {
        return Ok(d);
    }
    let bytes = mt::host::nvme::probe::PROBE_BYTES;
    let tag = format!("mt-{}-plan", std::process::id());
    let measured = mt::host::nvme::probe::probe(&d.dirs, bytes, &tag)?;
    let speed = DriveSpeed {
        per_drive: measured.iter().map(|m| (m.read, m.write)).collect(),
        source: SpeedSource::Measured {
            bytes,
            direct: measured.iter().all(|m| m.direct),
        },
    };
    Ok(d.with_speed(speed))
}

/// What the drives' time per update means for a step: the tokens an update trains on
/// against that time, and with `--tflops`, the gradient accumulation whose compute takes as
/// long. The update overlaps only the next step's first forward (the workers take each
/// block as it is written), so accumulation shares the drives' time over more tokens; it
/// does not hide it.
struct DriveBound {
    /// Tokens per update (padded: MegaTrain's count) and its parts.
    tokens: u64,
    batch: usize,
    seq_len: usize,
    /// The most tokens per second, and TFLOPS per device (MegaTrain's count: 6 x
    /// parameters x tokens), the drives' time allows.
    tokens_per_s: f64,
    tflops: f64,
    /// With `--tflops F`: the least gradient accumulation whose compute at F takes the
    /// drives' time or longer, the seconds of one micro-batch at F and F.
    accumulation: Option<(usize, f64, f64)>,
    /// The micro-batch rows per worker and the workers.
    rows: usize,
    world: usize,
}

impl DriveBound {
    fn new(
        cfg: &RunConfig,
        prep: &Prepared,
        d: &mt::plan::DrivePlan,
        world: usize,
        tflops: Option<f64>,
    ) -> Option<DriveBound> {
        let update_s = d.update_s()?;
        let (rows, seq_len) = prep.micro_batch(cfg, world);
        let batch = cfg.rows_per_step();
        let tokens = (batch * seq_len) as u64;
        let params = prep.layout.num_params() as f64;
        let flops = |tokens: f64| 6.0 * params * tokens;
        let accumulation = tflops.map(|f| {
            let micro_s = flops((rows * seq_len) as f64) / (f * 1e12);
            (((update_s / micro_s).ceil() as usize).max(1), micro_s, f)
        });
        Some(DriveBound {
            tokens,
            batch,
            seq_len,
            tokens_per_s: tokens as f64 / update_s,
            tflops: flops(tokens as f64) / update_s / world as f64 / 1e12,
            accumulation,
            rows,
            world,
        })
    }
}

impl std::fmt::Display for DriveBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "at {} tokens per update (training.batch_size {} x {}) that allows about {:.0} \
             tokens/s, {:.1} TFLOPS/dev (MegaTrain's count): the update overlaps only the next \
             step's first forward, so gradient accumulation spreads its time over more tokens \
             but does not hide it",
            self.tokens, self.batch, self.seq_len, self.tokens_per_s, self.tflops
        )?;
        match self.accumulation {
            Some((a, micro_s, tf)) => write!(
                f,
                "\nat {tf} TFLOPS/dev (--tflops, not measured) a micro-batch of {} x {} computes \
                 in {micro_s:.1} s: gradient_accumulation_steps >= {a} (training.batch_size {}) \
                 computes for as long as the drives take (they then take half the step or less)",
                self.rows,
                self.seq_len,
                self.world * a * self.rows
            ),
            None => write!(f, " (--tflops: the accumulation that matches it)"),
        }
    }
}

/// The plan as JSON: host bytes by component, the device plan's phases, the largest batch.
fn json(
    prep: &Prepared,
    device: &DevicePlan,
    budget: Option<u64>,
    best: Option<usize>,
) -> serde_json::Value {
    let h = &prep.plan;
    let parts = |p: &[(&str, u64)]| {
        p.iter()
            .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
            .collect::<serde_json::Map<_, _>>()
    };
    let phases: serde_json::Map<_, _> = device
        .phases
        .iter()
        .map(|p| {
            let v = serde_json::json!({"total": p.total(), "parts": parts(&p.parts)});
            (p.name.to_string(), v)
        })
        .collect();
    serde_json::json!({
        "host": {
            "params": h.params,
            "bytes_per_param": h.bytes_per_param(),
            "slabs": h.slabs,
            "checkpoint_staging": h.staging,
            "carried": h.carried,
            "vision_region": h.vision,
            "tower_params": h.tower_params,
            "offloaded_inputs": h.offloaded,
            "exchange_buffers": h.exchange,
            "grpo_reference": h.grpo_reference,
            "total": h.total(),
        },
        "device": {
            "rows": device.rows,
            "seq_len": device.seq_len,
            "tile_tokens": device.tile,
            "fixed": parts(&device.fixed),
            "phases": phases,
            "peak_phase": device.peak_phase().name,
            "total": device.total(),
        },
        "gpu_memory": budget,
        "largest_batch": best,
    })
}

/// `--dry-run`: every check a launch makes (the directories it would write and the
/// checkpoint to resume from included), then a summary; no worker starts, no lock is taken.
pub fn dry_run(
    cfg: &RunConfig,
    placement: &Placement,
    resume: Option<&cli::Resume>,
    force: bool,
    metrics_out: Option<&std::path::Path>,
) -> Result<()> {
    // As a launch checks them, first; a directory another run holds is said, not refused
    // (a dry run takes no lock).
    let held = match crate::mpi::world().is_none_or(|m| m.rank == 0) {
        true => mt::checkpoint::ownership::check(cfg)?,
        false => Vec::new(),
    };
    // W&B and MLflow's interpreter and packages (no run is started), and the outputs.
    if crate::mpi::world().is_none_or(|m| m.rank == 0) {
        crate::trackers::resolve(&cfg.logging)?;
        crate::train::check_outputs(cfg, metrics_out)?;
    }
    let resume = resume
        .map(|r| {
            let dir = mt::checkpoint::state::resolve(&r.from, cfg.checkpoint.dir.as_deref())?;
            anyhow::Ok((dir, r.accept_changes))
        })
        .transpose()?;
    let mut prep = Prepared::new(cfg, placement)?;
    // Under mpirun, this node's share, as the run would hold it.
    crate::train::shard_plan(&mut prep, cfg, crate::mpi::world());
    prep.check_host_ram()?;
    if let Some(d) = mt::plan::DrivePlan::new(cfg, &prep.layout) {
        d.check()?;
    }
    prep.check_device_memory(cfg, placement, force)?;
    prep.plan = prep.grown_plan(cfg, placement, mt::sysmem::available_host_bytes());
    let mut resolved = cfg.clone();
    let (per_epoch, noun) = prep.data.epoch_len();
    if let Some(line) = resolved.resolve_steps(per_epoch, noun) {
        println!("{line}");
    }
    if let Some((dir, accept)) = resume {
        let schedule = crate::train::schedule(&resolved)?;
        crate::train::check_resume(&dir, &resolved, &prep.layout, &schedule, accept)?;
        println!("would resume from {}", dir.display());
    }
    describe(
        cfg,
        placement,
        &prep,
        Host::Here(mt::sysmem::available_host_bytes()),
    );
    for line in &held {
        println!("{line}");
    }
    println!("dry run: configuration, model, dataset and host memory are valid");
    Ok(())
}

/// The host RAM a plan is measured against.
#[derive(Debug, Clone, Copy)]
enum Host {
    /// What this machine has available (None: unknown).
    Here(Option<u64>),
    /// `plan --host-memory`: the machine planned for.
    Given(u64),
}

impl Host {
    fn bytes(self) -> Option<u64> {
        match self {
            Host::Here(a) => a,
            Host::Given(b) => Some(b),
        }
    }
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Here(Some(a)) => write!(f, "{:.2} GB available here", *a as f64 / 1e9),
            Host::Here(None) => write!(f, "RAM available here unknown"),
            Host::Given(b) => write!(f, "{:.2} GB given by --host-memory", *b as f64 / 1e9),
        }
    }
}

fn describe(cfg: &RunConfig, placement: &Placement, prep: &Prepared, host: Host) {
    println!(
        "{} worker(s) on {}, {:?} store",
        placement.workers,
        match placement.gpus {
            0 => "CPU".to_string(),
            _ => format!("GPUs {:?}", placement.devices),
        },
        cfg.model.dtype
    );
    if let (Some(s), Some(name)) = (cfg.model.shipped, &cfg.model.name) {
        println!(
            "model: `{name}` is not in the Hugging Face cache here: sized from the architecture shipped for it (configs/{}/config.json)",
            s.dir
        );
    }
    match prep.data.files.is_empty() {
        true => println!(
            "dataset: not read (no tokenizer here): sized from dataset.max_seq_len = {}",
            cfg.dataset.max_seq_len.unwrap_or(0)
        ),
        false => println!("{}", prep.data.summary()),
    }
    println!("{}", prep.plan);
    println!("{}", disk(cfg, prep));
    let gb = |b: u64| b as f64 / 1e9;
    let avail = host.bytes();
    let said = match host {
        Host::Given(_) => "host RAM given (--host-memory)",
        Host::Here(_) => "host RAM available",
    };
    match (avail, prep.plan.fit(avail)) {
        (None, _) => println!("host RAM available: unknown (no /proc/meminfo)"),
        (Some(a), Fit::Fits) => {
            println!("{said}: {:.2} GB: fits", gb(a));
            let grown = prep.grown_plan(cfg, placement, avail);
            if grown.staging > prep.plan.staging {
                println!(
                    "a launch here grows the checkpoint staging area to {:.2} GB (half the RAM \
                     left free beside the workers, up to the whole checkpoint: {:.2} GB)",
                    gb(grown.staging),
                    gb(grown.staging_full)
                );
            }
        }
        (Some(a), Fit::WithoutStaging) => println!(
            "{said}: {:.2} GB: fits without the checkpoint staging area (periodic \
             checkpoints would be written in place, training waiting for each)",
            gb(a)
        ),
        (Some(a), Fit::Short) => println!(
            "{said}: {:.2} GB: SHORT by {:.2} GB, a launch would be refused",
            gb(a),
            gb(prep.plan.without_staging().total() - a)
        ),
    }
}

/// What the run writes to disk: the model, each checkpoint, how many are kept.
fn disk(cfg: &RunConfig, prep: &Prepared) -> mt::plan::DiskPlan {
    let params = prep.layout.num_params() as u64;
    mt::plan::DiskPlan::new(cfg, params, prep.plan.carried, prep.plan.staging)
}
