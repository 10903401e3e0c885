//! What a libtorch failure in this worker becomes: one located line for the launcher
//! (`mt::fault`), no panic message and no C++ backtrace unless asked for.
//!
//! The model files compute with tch's panicking operations (`+`, `matmul`, `linear`): each
//! is tch's `f_*` call unwrapped, so a libtorch error there (a CUDA out-of-memory above all)
//! panics with that error's text, `Torch("…")`. Threading `f_*` and `?` through 2,700 lines
//! of math would bury it (model files hold math only); instead the whole worker runs under
//! [`catch`], which turns that panic into the same error an `f_*` call returns
//! ([`TorchPanic`]). The glue around the math (device buffers, the micro-batch upload,
//! pinned host memory) calls `f_*` and propagates with context.
//!
//! Where the worker is comes from breadcrumbs the engine leaves ([`enter`], [`micro_batch`]):
//! phase, layer and micro-batch shape. With them, libtorch's text, the memory plan of the
//! micro-batch and the device's memory, [`report`] writes the line `FromWorker::Fatal`
//! carries; the launcher prints it once.
//!
//! Test hook: `MT_TEST_FAIL_ALLOC=<phase>[:<layer>]` (phase names: `mt::fault::Phase::name`)
//! makes the worker ask libtorch for an impossible allocation (1 PiB) the first time it
//! enters that phase (of that layer), through the same panicking call the math makes: the
//! real libtorch error travels the real path. Nothing else reads it.

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;

use mt::config::hf::ModelSpec;
use mt::fault::{Fault, Phase, PlanFigures, Settings, parse_out_of_memory, torch_message};
use mt::layout::Layout;
use mt::plan::{DeviceOpts, DevicePlan, Largest};
use mt::protocol::{Device, Init};
use tch::{Kind, Tensor};

/// Where the worker is.
#[derive(Debug, Clone, Copy)]
struct Here {
    phase: Phase,
    layer: Option<usize>,
    /// (rows, tokens per row, packed rows).
    micro_batch: Option<(usize, usize, bool)>,
}

thread_local! {
    static HERE: Cell<Here> = const {
        Cell::new(Here { phase: Phase::StartUp, layer: None, micro_batch: None })
    };
    /// Where the last panic happened (file:line), for a panic that is not libtorch's.
    static PANIC_AT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// What the line needs besides the breadcrumbs; set once the worker has its `Init`.
struct Run {
    device: Device,
    spec: ModelSpec,
    layout: Layout,
    opts: DeviceOpts,
    ce_chunk_tokens: usize,
    /// Device memory free when the worker started (CUDA: with its context, before it
    /// allocated anything; CPU: MemAvailable).
    budget: OnceLock<u64>,
}

static RUN: OnceLock<Run> = OnceLock::new();

/// Records the run's settings (once, after `Init`).
pub fn set_run(init: &Init) {
    let _ = RUN.set(Run {
        device: init.device,
        spec: init.spec.clone(),
        layout: init.layout.clone(),
        opts: DeviceOpts::of_worker(init, false),
        ce_chunk_tokens: init.ce_chunk_tokens,
        budget: OnceLock::new(),
    });
}

/// Records the device memory free for the plan (once, before the worker allocates).
pub fn set_budget(bytes: u64) {
    if let Some(run) = RUN.get() {
        let _ = run.budget.set(bytes);
    }
}

/// The worker enters `phase` (of `layer`). Where the test hook names this place, an
/// impossible allocation fails here.
pub fn enter(phase: Phase, layer: Option<usize>) {
    HERE.with(|h| {
        h.set(Here {
            phase,
            layer,
            ..h.get()
        })
    });
    crate::profile::phase(phase, layer);
    inject(phase, layer);
}

/// Runs `f` as phase `phase` (of `layer`) inside the current one: where it fails, the
/// failure is located there; where it succeeds, the worker is back where it was.
pub fn within<T>(
    phase: Phase,
    layer: Option<usize>,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let outer = HERE.with(Cell::get);
    enter(phase, layer);
    let out = f()?;
    HERE.with(|h| h.set(outer));
    Ok(out)
}

/// The micro-batch being computed: `rows` x `seq_len` tokens, `packed` rows or not.
pub fn micro_batch(rows: usize, seq_len: usize, packed: bool) {
    HERE.with(|h| {
        h.set(Here {
            micro_batch: Some((rows, seq_len, packed)),
            ..h.get()
        })
    });
}

/// `MT_TEST_FAIL_ALLOC`: fails the first entry into the phase (and layer) it names.
fn inject(phase: Phase, layer: Option<usize>) {
    static TARGET: OnceLock<Option<(Phase, Option<usize>)>> = OnceLock::new();
    static FIRED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    // Checked at start (main.rs calls `Phase::fail_alloc_target` after `mt::switches::init`).
    let target = TARGET.get_or_init(|| Phase::fail_alloc_target().ok().flatten());
    let hit = matches!(target, Some((p, l)) if *p == phase && (l.is_none() || *l == layer));
    if hit && !FIRED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        let device = RUN.get().map_or(tch::Device::Cpu, |r| match r.device {
            Device::Cpu => tch::Device::Cpu,
            Device::Cuda(i) => tch::Device::Cuda(i),
        });
        // 2^48 f32 = 1 PiB: more than any device or address space holds.
        let _ = Tensor::empty([1i64 << 48], (Kind::Float, device));
    }
}

/// A panic that carried a libtorch error: tch's unwrap of its own `Result`.
#[derive(Debug)]
pub struct TorchPanic(pub String);

impl std::fmt::Display for TorchPanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "libtorch: {}", torch_message(&self.0))
    }
}

impl std::error::Error for TorchPanic {}

/// Runs `f`; a panic becomes an error: [`TorchPanic`] where it carried libtorch's error,
/// else the panic's message and place.
pub fn catch<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            match torch_text_of_panic(&msg) {
                Some(text) => Err(TorchPanic(text).into()),
                None => {
                    let at = PANIC_AT.with(|p| p.borrow_mut().take());
                    let at = at.map_or(String::new(), |a| format!(" at {a}"));
                    Err(anyhow::anyhow!("panic{at}: {msg}"))
                }
            }
        }
    }
}

/// libtorch's text inside tch's unwrap panic (`… Err value: Torch("…")`), unescaped.
fn torch_text_of_panic(msg: &str) -> Option<String> {
    let start = msg.find("Torch(\"")? + "Torch(\"".len();
    let body = msg[start..].strip_suffix("\")").unwrap_or(&msg[start..]);
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    Some(out)
}

/// Whether the user asked for details: `RUST_BACKTRACE`, or debug logging (the launcher
/// passes `--log-level debug` on as `RUST_LOG`).
pub fn verbose() -> bool {
    std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0")
        || tracing::enabled!(tracing::Level::DEBUG)
}

/// Keeps panics quiet: [`catch`] reports them. With [`verbose`], the default hook prints
/// the panic and its backtrace too.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()));
        PANIC_AT.with(|p| *p.borrow_mut() = at);
        if verbose() {
            default(info);
        }
    }));
}

/// libtorch's full text in `e` (a [`TorchPanic`] or an `f_*` call's `TchError`), if any.
fn torch_text(e: &anyhow::Error) -> Option<String> {
    e.chain().find_map(|c| {
        if let Some(p) = c.downcast_ref::<TorchPanic>() {
            return Some(p.0.clone());
        }
        match c.downcast_ref::<tch::TchError>()? {
            tch::TchError::Torch(text) => Some(text.clone()),
            other => Some(other.to_string()),
        }
    })
}

/// The line `FromWorker::Fatal` carries for `e`: a located [`Fault`] for libtorch's errors,
/// the error's own chain otherwise. With [`verbose`], libtorch's full text (its C++
/// backtrace included) goes to stderr first.
pub fn report(e: &anyhow::Error) -> String {
    let (Some(text), Some(run)) = (torch_text(e), RUN.get()) else {
        return format!("{e:#}");
    };
    if verbose() {
        eprintln!("libtorch's full message:\n{text}");
    }
    let here = HERE.with(Cell::get);
    let mut oom = parse_out_of_memory(&text);
    if let Some(o) = &mut oom
        && o.free.is_none()
    {
        let (free, total) = device_memory(run.device);
        (o.free, o.total) = (free, o.total.or(total));
    }
    let device_plan = here.micro_batch.map(|(rows, seq, packed)| {
        let o = DeviceOpts { packed, ..run.opts };
        (o, DevicePlan::new(&run.spec, &run.layout, o, rows, seq))
    });
    let plan = match (oom, here.micro_batch, &device_plan) {
        (Some(_), Some((rows, seq, _)), Some((o, p))) => {
            let (o, need) = (*o, p.total());
            let budget = run.budget.get().copied();
            let largest = budget.map(|b| Largest::new(&run.spec, &run.layout, o, (rows, seq), b));
            Some(PlanFigures {
                need,
                budget,
                largest_rows: largest.map(|l| l.rows),
                largest_seq: largest.and_then(|l| l.seq_len),
            })
        }
        _ => None,
    };
    Fault {
        phase: here.phase,
        layer: here.layer,
        micro_batch: here.micro_batch.map(|(r, s, _)| (r, s)),
        device: run.device,
        message: torch_message(&text),
        oom,
        plan,
        settings: Settings {
            offload_activations: run.opts.offload_activations,
            ce_chunk_tokens: run.ce_chunk_tokens,
            tile_tokens: run.opts.tile_tokens,
            tile: device_plan.as_ref().and_then(|(_, p)| p.tile),
            kept_layers: device_plan.map_or(0, |(_, p)| p.keep),
        },
    }
    .to_string()
}

/// (free, total) memory of `device` now, where it can be read.
fn device_memory(device: Device) -> (Option<u64>, Option<u64>) {
    match device {
        Device::Cpu => (mt::sysmem::available_host_bytes(), None),
        Device::Cuda(_) => match crate::cuda::memory_info() {
            Ok((free, total)) => (Some(free), Some(total)),
            Err(_) => (None, None),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tch_panic_carries_libtorch_text() {
        // A panicking tch call fails as its f_* twin does, and `catch` finds the same text.
        let want = match Tensor::f_empty([1i64 << 48], (Kind::Float, tch::Device::Cpu)) {
            Err(tch::TchError::Torch(t)) => t,
            other => panic!("expected a libtorch error, got {other:?}"),
        };
        let e = catch(|| {
            let _ = Tensor::empty([1i64 << 48], (Kind::Float, tch::Device::Cpu));
            Ok(())
        })
        .unwrap_err();
        let got = torch_text(&e).unwrap();
        assert_eq!(torch_message(&got), torch_message(&want));
        assert_eq!(
            parse_out_of_memory(&got).and_then(|o| o.requested),
            Some(1 << 50)
        );
    }

    // (The tests leave the process's panic hook alone: a quiet hook would hide the
    // harness's own failure messages.)
    #[test]
    fn other_panics_keep_their_message() {
        let e = catch::<()>(|| panic!("an invariant broke")).unwrap_err();
        assert!(e.to_string().contains("an invariant broke"), "{e}");
        assert!(torch_text(&e).is_none());
    }
}
