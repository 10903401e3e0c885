//! `mt-worker`: one per GPU (or N on CPU), started and supervised by `mt-launch`.
//!
//! Bootstraps over ipc-channel (the server name is in `MT_BOOTSTRAP`), adopts the shared
//! regions it inherited, then runs steps (and evaluations between them) until told to
//! stop. It dies with the launcher
//! (`PR_SET_PDEATHSIG`) and exits when the launcher's channel closes.

#![deny(unsafe_code)]

// The CUDA driver-API wrapper (cudarc) and libtorch_cuda's loading.
#[allow(unsafe_code)]
mod cuda;
// The C++ shims' error strings.
#[allow(unsafe_code)]
mod cxx;
mod engine;
mod fault;
mod head;
// Kernel handles, launches and NVRTC's loading (worker/src/kernels/cuda.rs).
#[allow(unsafe_code)]
mod kernels;
mod layer;
mod model;
// torch's profiler through worker/src/profile.cpp.
#[allow(unsafe_code)]
mod profile;
mod segments;
mod warmup;
// Shared memory adoption, host registration.
#[allow(unsafe_code)]
mod stream;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use ipc_channel::ipc::{self, IpcSender};
use mt::plan::DeviceOpts;
use mt::protocol::{Device, FromWorker, ToWorker};
use mt::switches::BOOTSTRAP;

use engine::{Engine, Interrupted, Link};

fn main() -> ExitCode {
    // Every `MT_*` variable, checked before anything else (mt-launch checked them too).
    let switches = mt::switches::init();
    let rank = match &switches {
        Ok(s) => s.rank.map_or("?".into(), |r| r.to_string()),
        Err(_) => "?".into(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    fault::install_panic_hook();
    let checked = switches.and_then(|_| mt::fault::Phase::fail_alloc_target());
    match checked
        .map_err(anyhow::Error::from)
        .and_then(|_| fault::catch(run))
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Interrupted>() => ExitCode::SUCCESS,
        // The launcher has the error and prints it: once.
        Err(e) if e.is::<Reported>() => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("mt-worker[{rank}]: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    if std::env::args().nth(1).as_deref() == Some("--check-resident-update") {
        cuda::load_torch_cuda()?;
        let ok = stream::check_resident_update(tch::Device::Cuda(0))?;
        println!("{}", if ok { "PASS" } else { "FAIL" });
        return if ok {
            Ok(())
        } else {
            bail!("adamw.cu differs from the host's update")
        };
    }
    // Die with the launcher, and do not start if it is already gone.
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .context("prctl(PR_SET_PDEATHSIG)")?;
    if nix::unistd::getppid().as_raw() == 1 {
        bail!("launcher exited before this worker started");
    }
    let sw = mt::switches::get();
    let server = sw
        .bootstrap
        .clone()
        .with_context(|| format!("{BOOTSTRAP} is not set: mt-worker is started by mt-launch"))?;
    let tx: IpcSender<FromWorker> =
        IpcSender::connect(server).context("connect to the launcher")?;
    let (cmd_tx, rx) = ipc::channel::<ToWorker>().context("create command channel")?;
    let rank: usize = sw.rank.unwrap_or(0);
    tx.send(FromWorker::Hello {
        rank,
        pid: std::process::id(),
        commands: cmd_tx,
    })?;
    let init = match rx.recv().context("waiting for Init")? {
        ToWorker::Init(init) => init,
        other => bail!("expected Init, got {other:?}"),
    };

    fault::set_run(&init);
    let result = fault::catch(|| {
        if let Device::Cuda(_) = init.device {
            cuda::load_torch_cuda()?;
        }
        stream::check_device(init.device)?;
        tch::set_num_threads(init.threads.max(1) as i32);
        let t = std::time::Instant::now();
        let regions = stream::Regions::inherit(&init)?;
        let device = stream::device_of(init.device);
        let streamer =
            stream::Streamer::new(regions, &init.layout, device, init.offload_activations)?;
        // The vision tower's frozen tensors, on the device from now on, for the images'
        // features.
        let tower = (init.vision.as_ref())
            .map(|v| {
                Ok::<_, anyhow::Error>(engine::Tower {
                    weights: stream::vision::load(v, init.dtype, device)?,
                    training: v.layout.training,
                    pixels: v.pixels.clone(),
                })
            })
            .transpose()?;
        let register_s = t.elapsed().as_secs_f64();
        if init.device == Device::Cpu {
            fault::set_budget(mt::sysmem::available_host_bytes().unwrap_or(0));
        }
        let warm_up_s = match init.warm_up {
            Some(shape) => warmup::warm_up(
                &init.spec,
                &init.layout,
                &engine::layer_buffers(&init)?,
                (stream::kind_of(init.dtype), device),
                init.ce_chunk_tokens,
                shape,
                mt::plan::DevicePlan::new(
                    &init.spec,
                    &init.layout,
                    DeviceOpts::of_worker(&init, false),
                    shape.0,
                    shape.1,
                )
                .tile,
            )?,
            None => 0.0,
        };
        let mut engine = Engine::new(&init, streamer, tower)?;
        tx.send(FromWorker::Ready {
            device: init.device.to_string(),
            register_s,
            warm_up_s,
        })?;
        let mut profiler = profile::Profiler::from_env(rank, init.device)?;
        serve(&mut engine, &mut profiler, &tx, &rx)
    });
    match result {
        Err(e) if !e.is::<Interrupted>() => {
            let msg = fault::report(&e);
            match tx.send(FromWorker::Fatal { msg }) {
                Ok(()) => Err(Reported.into()),
                Err(_) => Err(e),
            }
        }
        other => other,
    }
}

/// The error reached the launcher as `Fatal`; the worker prints nothing more.
#[derive(Debug)]
struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reported to the launcher")
    }
}

impl std::error::Error for Reported {}

/// Runs steps until `Shutdown` or until the launcher's channel closes.
fn serve(
    engine: &mut Engine,
    profiler: &mut profile::Profiler,
    tx: &IpcSender<FromWorker>,
    rx: &ipc::IpcReceiver<ToWorker>,
) -> Result<()> {
    loop {
        let msg = match rx.recv() {
            Ok(m) => m,
            Err(_) => return Ok(()), // launcher gone: nothing left to do
        };
        match msg {
            ToWorker::Step {
                micro,
                loss_scale,
                weights_pending,
                next_images,
                ..
            } => {
                let link = Link { tx, rx };
                profiler.step_begins()?;
                let out = engine.step(&micro, next_images, loss_scale, weights_pending, &link)?;
                profiler.step_ends()?;
                tx.send(FromWorker::StepDone {
                    loss_sum: out.loss_sum,
                    tokens: out.tokens,
                    timings: out.timings,
                    sums: out.sums,
                    token_logps: out.token_logps,
                })?;
            }
            ToWorker::Eval { index, micro, what } => {
                let (loss_sum, logps) = engine.forward_only(&micro, what)?;
                tx.send(FromWorker::EvalDone {
                    index,
                    loss_sum,
                    logps,
                })?;
            }
            ToWorker::ResidentCopy {
                load,
                block,
                range,
                part,
            } => {
                engine.resident_copy(load, block, range, part)?;
                tx.send(FromWorker::ResidentCopied)?;
            }
            ToWorker::Shutdown => return Ok(()),
            ToWorker::Init(_) => bail!("Init received twice"),
            other => engine.handle(other)?,
        }
    }
}
