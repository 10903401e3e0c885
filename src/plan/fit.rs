//! Whether a worker's micro-batch fits its device, decided before anything is loaded.
//!
//! The launcher compares the device plan's total ([`DevicePlan::total`]) with the memory
//! each GPU it uses has free, as the CUDA driver reports it with a context open: what other
//! processes hold is excluded, and the worker's own CUDA context (which the plan leaves
//! out) is roughly the context the query itself opened. Free memory rather than total,
//! because a GPU shared with another job only has what that job leaves. A run that does
//! not fit is refused with the figures and the largest micro-batch (for one row, the
//! longest sequence) that fits; `--force` launches it anyway.
//!
//! The plan runs up to ~10-14% under the measured peak (allocator slack; at long rows the
//! most, benches/results/long_context_plan_offload_2026-11-26.md),
//! so a run the plan barely fits may still run out of memory: the check refuses what
//! certainly cannot run and leaves the rest to the worker's out-of-memory report
//! ([`crate::fault`]).

use crate::config::DType;
use crate::config::hf::ModelSpec;
use crate::layout::Layout;
use crate::protocol::Device;

use super::{DeviceOpts, DevicePlan};

/// Longest sequence the searches consider (tokens).
const MAX_SEQ: usize = 1 << 24;

/// Free and total memory of one device a run uses, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub device: Device,
    pub free: u64,
    pub total: u64,
}

/// The largest micro-batch whose plan fits a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Largest {
    /// Rows of the configured sequence length (0: not even one).
    pub rows: usize,
    /// For one row: the longest sequence that fits (given where it is what to change:
    /// the configured micro-batch has one row, or not even one fits).
    pub seq_len: Option<usize>,
}

impl Largest {
    pub fn new(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        (rows, seq_len): (usize, usize),
        budget: u64,
    ) -> Largest {
        let best = DevicePlan::largest_batch(spec, layout, o, seq_len, budget);
        let seq_len = (rows <= 1 || best == 0).then(|| {
            let fits = |t| DevicePlan::new(spec, layout, o, 1, t).total() <= budget;
            largest(fits, MAX_SEQ)
        });
        Largest {
            rows: best,
            seq_len,
        }
    }
}

/// The largest `n` in 0..=`cap` with `fits(n)`, for a `fits` that holds up to some `n` and
/// not beyond (0 when `fits(1)` does not hold).
pub(super) fn largest(fits: impl Fn(usize) -> bool, cap: usize) -> usize {
    let (mut lo, mut hi) = (0, 1);
    while hi <= cap && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    let mut hi = hi.min(cap + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    lo
}

/// A micro-batch that does not fit a device: the refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Short {
    pub memory: DeviceMemory,
    /// Where `memory` comes from ("the driver reports", or the test hook).
    pub source: &'static str,
    pub rows: usize,
    pub seq_len: usize,
    pub need: u64,
    pub largest: Largest,
    /// The plan's total with `memory.offload_activations: true`, where it is off.
    pub with_offload: Option<u64>,
}

/// Checks the plan of micro-batches of `rows` x `seq_len` against each device's free
/// memory; the first device it does not fit is refused.
pub fn check(
    spec: &ModelSpec,
    layout: &Layout,
    o: DeviceOpts,
    (rows, seq_len): (usize, usize),
    devices: &[DeviceMemory],
    source: &'static str,
) -> Result<(), Box<Short>> {
    let need = DevicePlan::new(spec, layout, o, rows, seq_len).total();
    let Some(memory) = devices.iter().find(|d| need > d.free).copied() else {
        return Ok(());
    };
    let with_offload = (!o.offload_activations && !o.cpu).then(|| {
        let on = DeviceOpts {
            offload_activations: true,
            ..o
        };
        DevicePlan::new(spec, layout, on, rows, seq_len).total()
    });
    Err(Box::new(Short {
        memory,
        source,
        rows,
        seq_len,
        need,
        largest: Largest::new(spec, layout, o, (rows, seq_len), memory.free),
        with_offload,
    }))
}

impl std::fmt::Display for Short {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = super::human_bytes;
        let m = &self.memory;
        write!(
            f,
            "the micro-batch of {} x {} tokens does not fit {}: the plan needs {} per worker \
             (`mt-launch plan`), {} {} free of {}.",
            self.rows,
            self.seq_len,
            m.device,
            gb(self.need),
            self.source,
            gb(m.free),
            gb(m.total)
        )?;
        let l = self.largest;
        if l.rows > 0 {
            write!(
                f,
                " The largest that fits is {} x {} (training.batch_size = workers x \
                 gradient_accumulation_steps x rows).",
                l.rows, self.seq_len
            )?;
        }
        match l.seq_len {
            Some(0) => write!(f, " Not even one row of 1 token fits.")?,
            Some(t) => write!(
                f,
                " With 1 row, sequences of up to {t} tokens fit (dataset.max_seq_len)."
            )?,
            None => {}
        }
        if let Some(b) = self.with_offload {
            let verdict = if b <= m.free {
                "fits"
            } else {
                "does not fit either"
            };
            write!(
                f,
                " With memory.offload_activations: true the plan is {} ({verdict}).",
                gb(b)
            )?;
        }
        Ok(())
    }
}

/// Device bytes of one resident block of `len` elements (`memory.resident_blocks`): its
/// f32 master, m and v, its compute-dtype weights and its reduced gradient.
pub fn resident_block_bytes(len: usize, dtype: DType, grad_dtype: DType) -> u64 {
    (len * (12 + dtype.size() + grad_dtype.size())) as u64
}

/// How many leading blocks of `layout` fit `budget` device bytes as resident blocks.
pub fn resident_fit(layout: &Layout, dtype: DType, grad_dtype: DType, budget: u64) -> usize {
    let mut used = 0;
    layout
        .blocks
        .iter()
        .take_while(|b| {
            used += resident_block_bytes(b.len, dtype, grad_dtype);
            used <= budget
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::hf::HfConfig;
    use crate::config::{Recompute, TileTokens};

    fn qwen_7b() -> (ModelSpec, Layout) {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2.5-7b/config.json");
        let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let spec = ModelSpec::from_hf(&hf, &path).unwrap();
        let layout = Layout::new(&spec);
        (spec, layout)
    }

    const OPTS: DeviceOpts = DeviceOpts {
        dtype: DType::Bfloat16,
        ce_chunk_tokens: 8192,
        tile_tokens: TileTokens::Off,
        recompute: Recompute::Full,
        packed: false,
        offload_activations: false,
        cpu: false,
        device_free: None,
        vision: None,
    };

    fn gpu(free: u64) -> DeviceMemory {
        DeviceMemory {
            device: Device::Cuda(1),
            free,
            total: free + 2_000_000_000,
        }
    }

    #[test]
    fn a_plan_within_free_memory_passes_and_one_byte_less_is_refused() {
        let (spec, layout) = qwen_7b();
        let need = DevicePlan::new(&spec, &layout, OPTS, 8, 4096).total();
        let shape = (8, 4096);
        let free = [gpu(need + 1_000_000_000), gpu(need)];
        assert_eq!(
            check(&spec, &layout, OPTS, shape, &free, "the driver reports"),
            Ok(())
        );
        // The second GPU is the one short.
        let short = [gpu(need), gpu(need - 1)];
        let s = check(&spec, &layout, OPTS, shape, &short, "the driver reports").unwrap_err();
        assert_eq!((s.memory.free, s.need), (need - 1, need));
        assert!(s.largest.rows < 8);
        assert_eq!(s.largest.seq_len, None);
        let text = s.to_string();
        assert!(
            text.contains("does not fit cuda:1")
                && text.contains(&format!(
                    "The largest that fits is {} x 4096",
                    s.largest.rows
                ))
                && !text.contains('\n'),
            "{text}"
        );
    }

    #[test]
    fn the_largest_micro_batch_is_the_edge_of_free_memory() {
        let (spec, layout) = qwen_7b();
        let free = 40_000_000_000;
        let s = check(&spec, &layout, OPTS, (64, 4096), &[gpu(free)], "x").unwrap_err();
        let n = s.largest.rows;
        assert!(n > 0);
        assert!(DevicePlan::new(&spec, &layout, OPTS, n, 4096).total() <= free);
        assert!(DevicePlan::new(&spec, &layout, OPTS, n + 1, 4096).total() > free);
        // Offloading the layer inputs is offered with its own figure.
        let off = s.with_offload.unwrap();
        let on = DeviceOpts {
            offload_activations: true,
            ..OPTS
        };
        assert_eq!(off, DevicePlan::new(&spec, &layout, on, 64, 4096).total());
    }

    #[test]
    fn one_row_gets_the_longest_sequence_that_fits() {
        let (spec, layout) = qwen_7b();
        let free = 60_000_000_000;
        let s = check(&spec, &layout, OPTS, (1, 1 << 20), &[gpu(free)], "x").unwrap_err();
        assert_eq!(s.largest.rows, 0);
        let t = s.largest.seq_len.unwrap();
        assert!(t > 0 && t < 1 << 20);
        assert!(DevicePlan::new(&spec, &layout, OPTS, 1, t).total() <= free);
        assert!(DevicePlan::new(&spec, &layout, OPTS, 1, t + 1).total() > free);
        assert!(
            s.to_string()
                .contains(&format!("With 1 row, sequences of up to {t} tokens fit"))
        );
    }

    #[test]
    fn largest_search_finds_the_edge_and_respects_the_cap() {
        for edge in [0, 1, 2, 3, 1000, 1023, 1024, 1025] {
            assert_eq!(largest(|n| n <= edge, 1 << 20), edge);
        }
        assert_eq!(largest(|_| true, 100), 100);
    }

    /// Resident blocks are taken from the first while their bytes (16 per element with a
    /// bf16 copy and gradient) fit the budget.
    #[test]
    fn resident_blocks_are_the_leading_ones_that_fit() {
        let (_, layout) = qwen_7b();
        let per = |b: &crate::layout::Block| {
            resident_block_bytes(b.len, DType::Bfloat16, DType::Bfloat16)
        };
        assert_eq!(per(&layout.blocks[0]), 16 * layout.blocks[0].len as u64);
        let first_two = per(&layout.blocks[0]) + per(&layout.blocks[1]);
        let fit = |budget| resident_fit(&layout, DType::Bfloat16, DType::Bfloat16, budget);
        assert_eq!(fit(first_two), 2);
        assert_eq!(fit(first_two - 1), 1);
        assert_eq!(fit(0), 0);
        assert_eq!(fit(u64::MAX), layout.blocks.len());
    }
}
