//! A worker's failure as the user reads it: one line that names the phase and layer, what
//! the device was asked for and what it had, the memory plan's figure and what to change.
//!
//! The worker (the only libtorch user) knows where it was and what libtorch said; this
//! module turns that into the line, so that the parsing of libtorch's text and the advice
//! are unit-tested here without libtorch. libtorch's messages carry a C++ backtrace
//! ("Exception raised from … (most recent call first): frame #0 …"); the line never does
//! (the worker prints it with `--log-level debug` or `RUST_BACKTRACE`).
//!
//! ```text
//! worker rank 0 failed: out of memory on cuda:0 in the backward of layer 5, micro-batch
//! 1 x 524288 tokens: asked for 3.76 GB with 1.32 GB free of 150.02 GB; the plan puts this
//! micro-batch at 162.41 GB. To fit: for 1 row, sequences of at most 393216 tokens
//! (dataset.max_seq_len), or memory.offload_activations: true
//! ```

use serde::{Deserialize, Serialize};

use crate::config::TileTokens;
use crate::protocol::Device;

/// What a worker was doing (the engine's phases of a micro-batch, and the work around them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Mapping regions, creating streams, allocating the layer ring.
    StartUp,
    /// The CUDA warm-up at the run's micro-batch shape (worker/src/warmup.rs).
    WarmUp,
    /// The micro-batch's ids, labels and positions to the device.
    Upload,
    /// A block's copy to the device (its buffer allocated, the copy enqueued).
    HostToDevice,
    Forward,
    /// Final norm, lm_head and the chunked cross-entropy with its gradient.
    Head,
    Backward,
    EmbeddingBackward,
    /// Gradients to the host slab.
    DeviceToHost,
    /// An evaluation's forward pass.
    Eval,
}

impl Phase {
    /// Every phase, by its name (as [`Phase::name`] gives it).
    pub const ALL: [Phase; 10] = [
        Phase::StartUp,
        Phase::WarmUp,
        Phase::Upload,
        Phase::HostToDevice,
        Phase::Forward,
        Phase::Head,
        Phase::Backward,
        Phase::EmbeddingBackward,
        Phase::DeviceToHost,
        Phase::Eval,
    ];

    /// The short name (`MT_TEST_FAIL_ALLOC` reads these).
    pub fn name(self) -> &'static str {
        match self {
            Phase::StartUp => "start-up",
            Phase::WarmUp => "warm-up",
            Phase::Upload => "upload",
            Phase::HostToDevice => "h2d",
            Phase::Forward => "forward",
            Phase::Head => "head",
            Phase::Backward => "backward",
            Phase::EmbeddingBackward => "embedding-backward",
            Phase::DeviceToHost => "d2h",
            Phase::Eval => "eval",
        }
    }

    pub fn from_name(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The test hook `MT_TEST_FAIL_ALLOC` (`crate::switches::testing`): the phase and layer
    /// it names; an error naming the variable where the phase is none of [`Phase::ALL`]'s.
    /// mt-launch calls it at start, so a bad value stops the launch.
    pub fn fail_alloc_target() -> crate::Result<Option<(Phase, Option<usize>)>> {
        let Some((name, layer)) = crate::switches::testing::fail_alloc() else {
            return Ok(None);
        };
        match Phase::from_name(name) {
            Some(p) => Ok(Some((p, layer))),
            None => {
                let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
                let value = match layer {
                    Some(l) => format!("{name}:{l}"),
                    None => name.to_string(),
                };
                Err(crate::switches::bad(
                    crate::switches::testing::FAIL_ALLOC,
                    &value,
                    &format!("<phase>[:<layer>], a phase of {}", names.join(", ")),
                ))
            }
        }
    }

    /// How the line names it: "in the {what}", "of layer {l}" follows where it has one.
    fn what(self) -> &'static str {
        match self {
            Phase::StartUp => "start-up",
            Phase::WarmUp => "warm-up",
            Phase::Upload => "upload of the micro-batch",
            Phase::HostToDevice => "host-to-device copy",
            Phase::Forward => "forward",
            Phase::Head => "head (final norm, lm_head, loss)",
            Phase::Backward => "backward",
            Phase::EmbeddingBackward => "embedding backward",
            Phase::DeviceToHost => "device-to-host copy of the gradients",
            Phase::Eval => "eval forward",
        }
    }

    /// Phases whose memory holds the layers' inputs, which `memory.offload_activations`
    /// moves to host memory.
    fn holds_layer_inputs(self) -> bool {
        matches!(
            self,
            Phase::WarmUp | Phase::Forward | Phase::Head | Phase::Backward | Phase::HostToDevice
        )
    }
}

/// An allocation that failed, as libtorch reported it (bytes; None where it said nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutOfMemory {
    pub requested: Option<u64>,
    pub free: Option<u64>,
    pub total: Option<u64>,
}

/// libtorch's message without its C++ backtrace, on one line.
pub fn torch_message(raw: &str) -> String {
    let text = raw
        .split("Exception raised from")
        .next()
        .unwrap_or(raw)
        .split("\nframe #")
        .next()
        .unwrap_or(raw);
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The figures of an out-of-memory error in libtorch's text: the CUDA caching allocator's
/// "CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 139.81 GiB
/// of which 1.23 GiB is free. …" or the CPU allocator's "DefaultCPUAllocator: can't allocate
/// memory: you tried to allocate 1125899906842624 bytes". None: not an out-of-memory error.
pub fn parse_out_of_memory(text: &str) -> Option<OutOfMemory> {
    if let Some(rest) = after(text, "CUDA out of memory.") {
        return Some(OutOfMemory {
            requested: after(rest, "Tried to allocate ").and_then(size),
            total: after(rest, "has a total capacity of ").and_then(size),
            free: after(rest, " of which ").and_then(size),
        });
    }
    let cpu = ["can't allocate memory", "not enough memory"]
        .iter()
        .any(|m| text.contains(m));
    cpu.then(|| OutOfMemory {
        requested: after(text, "tried to allocate ").and_then(size),
        ..OutOfMemory::default()
    })
}

/// The text after the first `pat` in `text`.
fn after<'a>(text: &'a str, pat: &str) -> Option<&'a str> {
    text.find(pat).map(|i| &text[i + pat.len()..])
}

/// "3.50 GiB", "512.00 MiB", "1125899906842624 bytes" at the start of `s`, in bytes.
fn size(s: &str) -> Option<u64> {
    let mut words = s.split_whitespace();
    let n: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?.trim_end_matches(['.', ',', ';']);
    let scale = match unit {
        "bytes" | "B" => 1u64,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        _ => return None,
    };
    Some((n * scale as f64).round() as u64)
}

/// The memory plan's view of the micro-batch that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanFigures {
    /// `mt-launch plan`'s device total for this micro-batch.
    pub need: u64,
    /// What the worker had for it (free device memory at its start), when known.
    pub budget: Option<u64>,
    /// The largest micro-batch (rows of this length) whose plan fits the budget.
    pub largest_rows: Option<usize>,
    /// For 1 row: the longest sequence whose plan fits the budget.
    pub largest_seq: Option<usize>,
}

/// The memory settings the advice names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub offload_activations: bool,
    pub ce_chunk_tokens: usize,
    pub tile_tokens: TileTokens,
    /// The tile the failing micro-batch ran its layers' MLP half in (None: whole).
    pub tile: Option<usize>,
    /// The layers that kept their MLP activations for the backward (`memory.recompute`).
    pub kept_layers: usize,
}

/// A worker's libtorch (or allocation) failure, located.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    pub phase: Phase,
    pub layer: Option<usize>,
    /// (rows, tokens per row) of the micro-batch being computed.
    pub micro_batch: Option<(usize, usize)>,
    pub device: Device,
    /// libtorch's message without its backtrace ([`torch_message`]).
    pub message: String,
    pub oom: Option<OutOfMemory>,
    pub plan: Option<PlanFigures>,
    pub settings: Settings,
}

impl Fault {
    /// The advice for an out-of-memory failure: the settings that lower this phase's memory.
    fn advice(&self) -> Vec<String> {
        let mut out = Vec::new();
        let rows = self.micro_batch.map(|m| m.0);
        match (self.phase, self.plan) {
            (Phase::Eval, _) => out.push(
                "a smaller training.per_device_eval_batch_size (rows per eval micro-batch)".into(),
            ),
            (_, Some(p)) => match (p.largest_rows, rows) {
                (Some(n), Some(rows)) if n > 0 && n < rows => out.push(format!(
                    "a micro-batch of at most {n} rows (training.batch_size = workers x \
                     gradient_accumulation_steps x rows)"
                )),
                (Some(0), _) | (_, Some(1)) => {
                    if let Some(s) = p.largest_seq.filter(|&s| s > 0) {
                        out.push(format!(
                            "for 1 row, sequences of at most {s} tokens (dataset.max_seq_len)"
                        ));
                    }
                }
                _ => out.push("a smaller micro-batch (training.batch_size)".into()),
            },
            (_, None) => out.push("a smaller micro-batch (training.batch_size)".into()),
        }
        if self.phase.holds_layer_inputs()
            && !self.settings.offload_activations
            && self.device != Device::Cpu
        {
            out.push("memory.offload_activations: true".into());
        }
        let in_layer = matches!(
            self.phase,
            Phase::WarmUp | Phase::Forward | Phase::Backward | Phase::Eval
        ) && self.layer.is_some();
        match (self.settings.tile, self.settings.tile_tokens) {
            (Some(t), _) if in_layer => out.push(format!("a smaller memory.tile_tokens (now {t})")),
            (None, TileTokens::Off) if in_layer => out.push("memory.tile_tokens: auto".into()),
            _ => {}
        }
        if self.settings.kept_layers > 0 && self.phase != Phase::Eval {
            out.push(format!(
                "memory.recompute: full, or fewer layers (now {} keep their MLP activations)",
                self.settings.kept_layers
            ));
        }
        if self.phase == Phase::Head {
            out.push(format!(
                "a smaller memory.ce_chunk_tokens (now {})",
                self.settings.ce_chunk_tokens
            ));
        }
        out
    }
}

use crate::plan::human_bytes as gb;

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.oom {
            Some(_) => "out of memory",
            None => "libtorch error",
        };
        write!(f, "{what} on {} in the {}", self.device, self.phase.what())?;
        if let Some(l) = self.layer {
            write!(f, " of layer {l}")?;
        }
        if let Some((rows, seq)) = self.micro_batch {
            write!(f, ", micro-batch {rows} x {seq} tokens")?;
        }
        let Some(oom) = self.oom else {
            return write!(f, ": {}", self.message);
        };
        let asked = oom.requested.map_or("an allocation".into(), gb);
        write!(f, ": asked for {asked}")?;
        match (oom.free, oom.total) {
            (Some(free), Some(total)) => write!(f, " with {} free of {}", gb(free), gb(total))?,
            (Some(free), None) => write!(f, " with {} free", gb(free))?,
            _ => {}
        }
        if let Some(p) = self.plan {
            write!(f, "; the plan puts this micro-batch at {}", gb(p.need))?;
            if let Some(b) = p.budget.filter(|&b| b >= p.need) {
                // The plan fits, yet the allocation failed: what the plan leaves out.
                write!(
                    f,
                    " of the {} this worker had (it does not count allocator slack or other \
                     processes on the device)",
                    gb(b)
                )?;
            }
        }
        write!(f, ". To fit: {}", self.advice().join(", or "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch 2.11's CUDA caching allocator message (c10/cuda/CUDACachingAllocator.cpp),
    /// as the issue's 512k run printed it, with the start of its backtrace.
    const CUDA_OOM: &str = "CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total \
        capacity of 139.81 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this \
        process has 137.60 GiB memory in use. Of the allocated memory 130.02 GiB is allocated \
        by PyTorch, and 6.91 GiB is reserved by PyTorch but unallocated.\nException raised \
        from malloc at /pytorch/c10/cuda/CUDACachingAllocator.cpp:1451 (most recent call \
        first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d";

    /// torch 2.11's CPU allocator, as `torch.empty(2**48)` raises it.
    const CPU_OOM: &str = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: \
        can't allocate memory: you tried to allocate 1125899906842624 bytes. Error code 12 \
        (Cannot allocate memory)";

    const GIB: f64 = (1u64 << 30) as f64;

    #[test]
    fn cuda_figures_are_read_from_the_allocator_text() {
        let oom = parse_out_of_memory(CUDA_OOM).unwrap();
        assert_eq!(oom.requested, Some((3.5 * GIB) as u64));
        assert_eq!(oom.total, Some((139.81 * GIB).round() as u64));
        assert_eq!(oom.free, Some((1.23 * GIB).round() as u64));
    }

    #[test]
    fn cpu_request_is_read_and_other_errors_are_not_oom() {
        let oom = parse_out_of_memory(CPU_OOM).unwrap();
        assert_eq!(oom.requested, Some(1 << 50));
        assert_eq!((oom.free, oom.total), (None, None));
        assert_eq!(
            parse_out_of_memory("shape '[2, 3]' is invalid for input of size 5"),
            None
        );
    }

    #[test]
    fn the_message_drops_the_backtrace_and_fits_one_line() {
        let m = torch_message(CUDA_OOM);
        assert!(m.starts_with("CUDA out of memory. Tried to allocate 3.50 GiB."));
        assert!(!m.contains("frame #") && !m.contains("Exception raised") && !m.contains('\n'));
    }

    fn fault(phase: Phase, rows: usize, plan: PlanFigures, offload: bool) -> Fault {
        Fault {
            phase,
            layer: Some(5),
            micro_batch: Some((rows, 4096)),
            device: Device::Cuda(0),
            message: torch_message(CUDA_OOM),
            oom: parse_out_of_memory(CUDA_OOM),
            plan: Some(plan),
            settings: Settings {
                offload_activations: offload,
                ce_chunk_tokens: 8192,
                tile_tokens: TileTokens::Auto,
                tile: None,
                kept_layers: 0,
            },
        }
    }

    const PLAN: PlanFigures = PlanFigures {
        need: 160_000_000_000,
        budget: Some(140_000_000_000),
        largest_rows: Some(3),
        largest_seq: None,
    };

    #[test]
    fn an_oom_line_names_the_place_the_figures_and_the_fix() {
        let line = fault(Phase::Backward, 8, PLAN, false).to_string();
        assert_eq!(
            line,
            "out of memory on cuda:0 in the backward of layer 5, micro-batch 8 x 4096 tokens: \
             asked for 3.76 GB with 1.32 GB free of 150.12 GB; the plan puts this micro-batch at \
             160.00 GB. To fit: a micro-batch of at most 3 rows (training.batch_size = workers x \
             gradient_accumulation_steps x rows), or memory.offload_activations: true"
        );
        assert!(!line.contains('\n'));
    }

    #[test]
    fn advice_follows_the_phase_and_the_settings() {
        let one_row = PlanFigures {
            largest_rows: Some(0),
            largest_seq: Some(2048),
            ..PLAN
        };
        let head = fault(Phase::Head, 1, one_row, true).to_string();
        assert!(
            head.contains("for 1 row, sequences of at most 2048 tokens (dataset.max_seq_len)")
                && head.contains("memory.ce_chunk_tokens (now 8192)")
                && !head.contains("offload_activations"),
            "{head}"
        );
        let eval = fault(Phase::Eval, 8, PLAN, false).to_string();
        assert!(eval.contains("per_device_eval_batch_size") && !eval.contains("at most 3 rows"));
        // The plan fits, the allocation failed anyway: say what the plan does not count.
        let fits = PlanFigures {
            need: 100_000_000_000,
            ..PLAN
        };
        let frag = fault(Phase::Forward, 8, fits, true).to_string();
        assert!(frag.contains("allocator slack"), "{frag}");
    }

    #[test]
    fn a_layer_fault_names_the_tile() {
        let tiled = Fault {
            settings: Settings {
                tile: Some(38912),
                ..fault(Phase::Backward, 1, PLAN, true).settings
            },
            ..fault(Phase::Backward, 1, PLAN, true)
        };
        let line = tiled.to_string();
        assert!(
            line.contains("a smaller memory.tile_tokens (now 38912)"),
            "{line}"
        );
        let off = Fault {
            settings: Settings {
                tile_tokens: TileTokens::Off,
                tile: None,
                ..tiled.settings
            },
            ..tiled.clone()
        };
        assert!(
            off.to_string()
                .ends_with("To fit: memory.tile_tokens: auto"),
            "{off}"
        );
        // Layers that keep their MLP activations are named with the setting that frees it.
        let kept = Fault {
            settings: Settings {
                kept_layers: 6,
                ..tiled.settings
            },
            ..tiled.clone()
        };
        assert!(
            kept.to_string().contains(
                "memory.recompute: full, or fewer layers (now 6 keep their MLP activations)"
            ),
            "{kept}"
        );
        assert!(!tiled.to_string().contains("memory.recompute"), "{tiled}");
        // The head's memory is not the layers'.
        let head = Fault {
            phase: Phase::Head,
            layer: None,
            ..tiled
        };
        assert!(!head.to_string().contains("tile_tokens"), "{head}");
    }

    #[test]
    fn other_libtorch_errors_carry_their_message() {
        let f = Fault {
            oom: None,
            message: "mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)".into(),
            plan: None,
            ..fault(Phase::Forward, 2, PLAN, false)
        };
        assert_eq!(
            f.to_string(),
            "libtorch error on cuda:0 in the forward of layer 5, micro-batch 2 x 4096 tokens: \
             mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"
        );
    }

    #[test]
    fn phases_round_trip_their_names() {
        for p in Phase::ALL {
            assert_eq!(Phase::from_name(p.name()), Some(p));
        }
        assert_eq!(Phase::from_name("backwards"), None);
    }
}
