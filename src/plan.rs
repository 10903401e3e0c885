//! Memory plans, so users know before launch whether a run fits: the host RAM the launcher
//! allocates (computed from the real layout: the same sizes `HostState` and the shared
//! regions use) and each worker's device memory (from the layout and the activation
//! sizes of the worker's forward and backward), with the largest micro-batch that fits.

use crate::config::hf::ModelSpec;
use crate::config::{DType, MasterWeights, RunConfig};
use crate::layout::Layout;
use crate::shm::HEADER_LEN;

/// What the host plan depends on besides the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostOpts {
    /// The store's (compute) dtype.
    pub store: DType,
    /// `memory.grad_dtype`.
    pub grad: DType,
    /// `memory.master_weights`.
    pub master: MasterWeights,
    pub workers: usize,
    /// `memory.num_grad_slabs`.
    pub slots: usize,
}

impl HostOpts {
    pub fn new(cfg: &RunConfig, workers: usize) -> HostOpts {
        HostOpts {
            store: cfg.model.dtype,
            grad: cfg.memory.grad_dtype,
            master: cfg.memory.master_weights,
            workers,
            slots: cfg.memory.num_grad_slabs,
        }
    }
}

/// Bytes of host RAM the launcher holds for training state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPlan {
    pub params: u64,
    pub opts: HostOpts,
    /// fp32 master weights, or with a split master the residual low halves (the high
    /// halves are the store).
    pub master: u64,
    /// fp32 Adam first and second moments.
    pub adam: u64,
    /// Gradient accumulator (`memory.grad_dtype`).
    pub grad: u64,
    /// Shared weight store in the compute dtype.
    pub store: u64,
    /// Every worker's gradient slab (slots x largest block).
    pub slabs: u64,
}

impl HostPlan {
    pub fn new(layout: &Layout, opts: HostOpts) -> HostPlan {
        let elems = layout.total as u64;
        let dtype = opts.store;
        let slab = (opts.slots * layout.max_block_len() * dtype.size() + HEADER_LEN) as u64;
        HostPlan {
            params: layout.num_params() as u64,
            opts,
            master: match opts.master {
                MasterWeights::Float32 => 4 * elems,
                MasterWeights::Split => 2 * elems,
            },
            adam: 8 * elems,
            grad: opts.grad.size() as u64 * elems,
            store: elems * dtype.size() as u64 + HEADER_LEN as u64,
            slabs: opts.workers as u64 * slab,
        }
    }

    /// Everything except the slabs, which are bounded by layer size, not model size.
    pub fn per_param_state(&self) -> u64 {
        self.master + self.adam + self.grad + self.store
    }

    pub fn total(&self) -> u64 {
        self.per_param_state() + self.slabs
    }

    pub fn bytes_per_param(&self) -> f64 {
        self.per_param_state() as f64 / self.params as f64
    }
}

impl std::fmt::Display for HostPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(f, "host memory for {:.3e} parameters:", self.params as f64)?;
        match self.opts.master {
            MasterWeights::Float32 => {
                writeln!(f, "  fp32 master weights   {:>9.2} GB", gb(self.master))?
            }
            MasterWeights::Split => writeln!(
                f,
                "  master low halves     {:>9.2} GB (split: high halves are the store)",
                gb(self.master)
            )?,
        }
        writeln!(f, "  fp32 Adam m, v        {:>9.2} GB", gb(self.adam))?;
        let grad = match self.opts.grad {
            DType::Float32 => "fp32",
            DType::Bfloat16 => "bf16",
        };
        writeln!(f, "  {grad} gradient         {:>9.2} GB", gb(self.grad))?;
        writeln!(f, "  shared weight store   {:>9.2} GB", gb(self.store))?;
        writeln!(f, "  = {:.2} bytes per parameter", self.bytes_per_param())?;
        writeln!(f, "  gradient slabs        {:>9.2} GB", gb(self.slabs))?;
        write!(f, "  total                 {:>9.2} GB", gb(self.total()))
    }
}

/// Bytes of device memory one worker holds, by component, for micro-batches of `rows`
/// sequences of `seq_len` tokens. Each figure is a count of the tensors the worker keeps
/// (worker/src/stream, worker/src/engine.rs, worker/src/model) times their element size;
/// the CUDA context and allocator fragmentation are not included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePlan {
    pub rows: usize,
    pub seq_len: usize,
    /// Embedding and head blocks, resident on the device.
    pub resident: u64,
    /// The ring of two layer buffers the layers stream through.
    pub ring: u64,
    /// Gradients of the embedding and head blocks (their leaves live through the
    /// backward) and of the layer blocks waiting for their device-to-host copy (at most
    /// one per slab slot).
    pub grads: u64,
    /// Every layer's input, kept for the recompute in the backward (+ the last output).
    pub checkpoints: u64,
    /// Tensors autograd keeps while one layer is recomputed and backpropagated.
    pub layer_activations: u64,
    /// Final norm and one chunk of lm_head logits + cross-entropy and their gradients.
    pub head: u64,
    /// Attention masks and RoPE tables of the micro-batch.
    pub tables: u64,
}

/// Options of the estimate that come from the run config.
#[derive(Debug, Clone, Copy)]
pub struct DeviceOpts {
    pub dtype: DType,
    pub slots: usize,
    pub ce_chunk_tokens: usize,
    /// Packed rows: a (B, 1, T, T) mask per micro-batch.
    pub packed: bool,
}

impl DevicePlan {
    pub fn new(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        rows: usize,
        seq_len: usize,
    ) -> DevicePlan {
        let s = o.dtype.size() as u64;
        let f32b = 4u64;
        let blocks = &layout.blocks;
        let layer_len = (0..layout.num_layers())
            .map(|l| blocks[layout.layer_block(l)].len)
            .max()
            .unwrap_or(0) as u64;
        let embed = blocks[Layout::EMBED].len as u64;
        let head_len = blocks[layout.head_block()].len as u64;
        let (m, t, b) = ((rows * seq_len) as u64, seq_len as u64, rows as u64);
        let (h, i) = (spec.hidden_size as u64, spec.intermediate_size as u64);
        let (n, k, d) = (
            spec.num_heads as u64,
            spec.num_kv_heads as u64,
            spec.head_dim as u64,
        );
        let v = spec.vocab_size as u64;
        // One decoder layer under autograd (llama.rs / common.rs): two RMSNorms keep their
        // f32 input and the normed output; q, k, v projections; RoPE keeps the rotated
        // halves and its outputs (kept by attention); attention output and its merged copy
        // plus the f32 log-sum-exp; the MLP keeps gate, act(gate), up and their product;
        // the residual sum and the layer output; then dy and dx of the backward.
        let norms = 2 * (f32b + s) * m * h;
        let qkv = s * m * (n + 2 * k) * d;
        let rope = 2 * s * m * (n + k) * d;
        let attn = 2 * s * m * n * d + f32b * b * n * t;
        let mlp = 4 * s * m * i;
        let residual = 2 * s * m * h;
        let grads_xy = 2 * s * m * h;
        // Head: final norm of the labelled tokens (at most all of them) and its gradient;
        // one chunk of logits in the compute dtype, upcast to f32, log-softmax, gradient.
        let c = (o.ce_chunk_tokens as u64).min(m);
        let head = (f32b + 2 * s) * m * h + (s + 3 * f32b) * c * v;
        let mask = if o.packed || spec.attn_softcap.is_some() || spec.sliding_window.is_some() {
            b.max(1) * t * t
        } else {
            0
        };
        let rope_tables = 2 * s * b * t * spec.rope.rotary_dim as u64;
        DevicePlan {
            rows,
            seq_len,
            resident: (embed + head_len) * s,
            ring: 2 * layer_len * s,
            grads: (embed + head_len + o.slots as u64 * layer_len) * s,
            checkpoints: (layout.num_layers() as u64 + 1) * m * h * s,
            layer_activations: norms + qkv + rope + attn + mlp + residual + grads_xy,
            head,
            tables: mask + rope_tables,
        }
    }

    /// The largest micro-batch (rows of `seq_len`) whose plan fits in `budget` bytes; 0
    /// when not even one row fits.
    pub fn largest_batch(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        seq_len: usize,
        budget: u64,
    ) -> usize {
        let fits = |rows| DevicePlan::new(spec, layout, o, rows, seq_len).total() <= budget;
        let (mut lo, mut hi) = (0usize, 1usize);
        while fits(hi) {
            lo = hi;
            hi *= 2;
            if hi > 1 << 24 {
                return lo;
            }
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid) { lo = mid } else { hi = mid }
        }
        lo
    }

    pub fn total(&self) -> u64 {
        self.resident
            + self.ring
            + self.grads
            + self.checkpoints
            + self.layer_activations
            + self.head
            + self.tables
    }
}

impl std::fmt::Display for DevicePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "device memory per worker, micro-batch {} x {} tokens:",
            self.rows, self.seq_len
        )?;
        writeln!(f, "  embed + head blocks   {:>9.2} GB", gb(self.resident))?;
        writeln!(f, "  layer ring (2)        {:>9.2} GB", gb(self.ring))?;
        writeln!(f, "  gradients in flight   {:>9.2} GB", gb(self.grads))?;
        writeln!(
            f,
            "  layer checkpoints     {:>9.2} GB",
            gb(self.checkpoints)
        )?;
        writeln!(
            f,
            "  one layer's backward  {:>9.2} GB",
            gb(self.layer_activations)
        )?;
        writeln!(f, "  head + loss chunk     {:>9.2} GB", gb(self.head))?;
        writeln!(f, "  masks + RoPE tables   {:>9.2} GB", gb(self.tables))?;
        write!(
            f,
            "  total                 {:>9.2} GB (+ CUDA context and allocator slack)",
            gb(self.total())
        )
    }
}

/// MemAvailable from /proc/meminfo, in bytes (None where it cannot be read).
pub fn available_host_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::hf::{HfConfig, ModelSpec};

    #[test]
    fn qwen_7b_needs_18_bytes_per_parameter_in_bf16() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2.5-7b/config.json");
        let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let spec = ModelSpec::from_hf(&hf, &path).unwrap();
        let layout = Layout::new(&spec);
        let opts = HostOpts {
            store: DType::Bfloat16,
            grad: DType::Float32,
            master: MasterWeights::Float32,
            workers: 2,
            slots: 4,
        };
        let plan = HostPlan::new(&layout, opts);
        assert_eq!(
            plan.params, 7_615_616_512,
            "Qwen2.5-7B's published parameter count"
        );
        // Alignment gaps add a little over 18 B/param; the bound is 18 + slabs.
        assert!(plan.bytes_per_param() < 18.01, "{}", plan.bytes_per_param());
        assert_eq!(
            plan.slabs,
            2 * (4 * layout.max_block_len() as u64 * 2 + HEADER_LEN as u64)
        );
        assert!(plan.to_string().contains("bytes per parameter"));
        // A bf16 gradient saves 2 bytes per parameter, a split master 2 more.
        let lean = HostPlan::new(
            &layout,
            HostOpts {
                grad: DType::Bfloat16,
                master: MasterWeights::Split,
                ..opts
            },
        );
        let n = layout.total as u64;
        assert_eq!(plan.per_param_state() - lean.per_param_state(), 4 * n);
        assert!(lean.bytes_per_param() < 14.01, "{}", lean.bytes_per_param());
        assert!(lean.to_string().contains("bf16 gradient"), "{lean}");
    }

    fn qwen() -> (ModelSpec, Layout) {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/qwen2.5-7b/config.json");
        let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let spec = ModelSpec::from_hf(&hf, &path).unwrap();
        let layout = Layout::new(&spec);
        (spec, layout)
    }

    const OPTS: DeviceOpts = DeviceOpts {
        dtype: DType::Bfloat16,
        slots: 4,
        ce_chunk_tokens: 8192,
        packed: false,
    };

    #[test]
    fn device_plan_components_follow_the_layout() {
        let (spec, layout) = qwen();
        let p = DevicePlan::new(&spec, &layout, OPTS, 8, 1024);
        let embed = layout.blocks[Layout::EMBED].len as u64;
        assert_eq!(
            p.resident,
            2 * (embed + layout.blocks[layout.head_block()].len as u64)
        );
        assert_eq!(
            p.ring,
            2 * 2 * layout.blocks[layout.layer_block(0)].len as u64
        );
        assert_eq!(p.checkpoints, 29 * 8 * 1024 * 3584 * 2);
        // Activations grow linearly in the batch; the fixed part does not.
        let p2 = DevicePlan::new(&spec, &layout, OPTS, 16, 1024);
        assert_eq!(
            p2.resident + p2.ring + p2.grads,
            p.resident + p.ring + p.grads
        );
        assert_eq!(p2.layer_activations, 2 * p.layer_activations);
        assert!(p.to_string().contains("layer checkpoints"));
    }

    #[test]
    fn largest_batch_is_the_edge_of_the_budget() {
        let (spec, layout) = qwen();
        let budget = 80_000_000_000;
        let b = DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, budget);
        assert!(b > 0);
        assert!(DevicePlan::new(&spec, &layout, OPTS, b, 1024).total() <= budget);
        assert!(DevicePlan::new(&spec, &layout, OPTS, b + 1, 1024).total() > budget);
        assert_eq!(DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, 1), 0);
    }
}
