//! Launcher <-> worker messages, sent as serde enums over ipc-channel.
//!
//! Bootstrap: the launcher opens an `IpcOneShotServer<FromWorker>` per worker and passes
//! its name in `MT_BOOTSTRAP`. The worker connects, sends `Hello` carrying the sender of
//! its own command channel, and receives `Init`. Then, per optimizer step:
//!
//! ```text
//! launcher                                 worker r
//!   Step{micro-batches, loss_scale,  ──▶
//!        weights_pending}
//!   BlockReady{block} (forward order)──▶   (forward of block b waits for its BlockReady)
//!                                    ◀──   LayerGrads{micro, block, part, slot}
//!   reduce (block, part)                    (per part of each block, in backward order;
//!   SlotFree{slot}                   ──▶    once every worker delivered that part)
//!                                    ◀──   StepDone{loss_sum, tokens, timings}
//!   (grad norm known) Step{…, weights_pending: true} ──▶
//!   AdamW block 0 → BlockReady{0}, block 1 → BlockReady{1}, …  (overlaps the forward)
//! ```
//!
//! Ownership rules that make the shared regions race-free: the launcher writes store
//! block b only while a step that has not yet received `BlockReady{b}` is pending, i.e.
//! after every worker's `StepDone` of the previous step and before it sends `BlockReady{b}`
//! for the next (a `Step` with `weights_pending: false` means every block is ready); a
//! worker reads block b of a step only after `BlockReady{b}` (or with no weights pending).
//! A worker writes slab slot s only after taking it from its free list and until it sends
//! `LayerGrads` for it; the launcher reads slot s only between that `LayerGrads` and its
//! `SlotFree`.
//!
//! With resident blocks (`Init::resident`, `memory.resident_blocks`) the workers update the
//! leading blocks themselves: once the norm is known the launcher sends
//! `ResidentUpdate{hp}` ahead of the next `Step` (and of any `Eval`), and between steps it
//! moves their state with `ResidentCopy` / `ResidentCopied` through the transfer region,
//! which it writes only before sending a load and reads only after the answer to a save.
//! A worker reads a resident block's part of the launcher's gradient accumulator only
//! after the `SlotFree` of that part's slot for the step's last micro-batch, and before its
//! own next `LayerGrads` of the block: the launcher writes that part only in the reduce
//! that such a `LayerGrads` starts.
//!
//! Evaluation runs between steps, when no update is pending (every store block holds the
//! weights being evaluated), forward only: no gradient slab is touched. So do the
//! reference passes before the first step: DPO's, which asks for each row's summed label
//! log-probability instead of the loss, and GRPO's (`grpo.beta` > 0), which asks for each
//! label token's.
//!
//! ```text
//!   Eval{index, micro-batch, what}   ──▶   forward, chunked cross-entropy
//!                                    ◀──   EvalDone{index, loss_sum, logps}
//! ```
//!
//! `Init::objective` says what steps train on ([`Objective`]). Under DPO a step's
//! micro-batches hold whole preference pairs with their reference log-probabilities,
//! `loss_scale` is 1 / pairs in the step, and `StepDone` carries the pairs' loss and reward
//! sums.
//!
//! Under GRPO a micro-batch's rows are completions with their advantages, past a batch's
//! first step (`num_iterations` > 1) every completion token's old log-probability, and with
//! `grpo.beta` > 0 every completion token's reference one (from the forward-only pass
//! before the first step); `loss_scale` is 1 / completions in the step (1 / completion
//! tokens under `dapo`); `StepDone` carries the completions' sums and, on a batch's first
//! step, the log-probabilities of the worker's completion tokens, its micro-batches in
//! order (the old ones of the batch's later steps).
//!
//! A slot holds `layout.grad_slot_len()` elements (the largest decoder layer), so a block
//! larger than that (the embedding, an untied lm_head) is sent in parts: part p of block b
//! is the element range `Layout::grad_parts(b, slot_len)` yields p-th, each part in a slot
//! of its own, announced and freed on its own. A block's gradient is final once every one
//! of its parts of the step's last micro-batch is reduced. One slot per worker suffices:
//! every worker sends the same parts in the same order, so each part's reduce can run,
//! and it frees the slots the next part needs.

use ipc_channel::ipc::IpcSender;
use serde::{Deserialize, Serialize};

use crate::config::DType;
use crate::config::hf::ModelSpec;
use crate::data::MicroBatch;
use crate::layout::Layout;
use crate::layout::vision::VisionLayout;
use crate::objective::{Objective, ObjectiveSums};
use crate::shm::RegionHandle;

/// The environment variables carrying the one-shot server name and the worker's rank (for
/// its log prefix before `Init`) to a worker; the worker reads them through
/// [`crate::switches`].
pub use crate::switches::{BOOTSTRAP as ENV_BOOTSTRAP, RANK as ENV_RANK};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A layer's buffer ([`crate::checkpoint::carried`] reads them), sent to the workers in
/// [`Init`].
pub use crate::checkpoint::carried::LayerBuffer;

/// Everything a worker needs to run; sent once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Init {
    pub rank: usize,
    pub world: usize,
    pub device: Device,
    /// Intra-op threads for CPU compute.
    pub threads: usize,
    pub spec: ModelSpec,
    pub layout: Layout,
    pub dtype: DType,
    pub store: RegionHandle,
    pub slab: RegionHandle,
    /// Slots in this worker's gradient slab; each holds `layout.grad_slot_len()` elements
    /// (one decoder layer, or one part of a larger block).
    pub num_slots: usize,
    pub ce_chunk_tokens: usize,
    /// `memory.tile_tokens`: the worker resolves it per micro-batch shape through the
    /// device plan (`DevicePlan::new(..).tile`).
    pub tile_tokens: crate::config::TileTokens,
    /// `memory.recompute`, as the launcher resolved it (the device plan's
    /// `DeviceOpts::recompute`): the worker keeps the MLP activations of the layers its
    /// plan says per micro-batch shape.
    pub recompute: crate::config::Recompute,
    /// The device plan's `device_free` (`mt::plan::DeviceOpts`), as the launcher
    /// planned with it.
    pub device_free: Option<u64>,
    /// Stash layer inputs in pinned host memory (CUDA only).
    pub offload_activations: bool,
    /// Write the logits of the first micro-batch of the first step here (parity checks).
    pub dump_logits: Option<std::path::PathBuf>,
    /// CUDA: warm up at this micro-batch shape (rows, tokens per row) before `Ready`.
    pub warm_up: Option<(usize, usize)>,
    /// The layers' buffers (not trained; the store does not hold them).
    pub buffers: Vec<LayerBuffer>,
    /// What steps train on: the LM loss, DPO's of their pairs or GRPO's of their
    /// completions ([`crate::objective`]).
    pub objective: Objective,
    /// `memory.resident_blocks`: the leading blocks this worker keeps and updates itself.
    #[serde(default)]
    pub resident: Option<ResidentInit>,
    /// A multimodal model's frozen vision tower, which the worker copies to its device once.
    #[serde(default)]
    pub vision: Option<VisionInit>,
}

/// The frozen vision tower's weights (`mt::checkpoint::vision`): a read-only region
/// holding `layout`'s tensors in the store's dtype (`Init::dtype`), written before the
/// worker starts and never after.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VisionInit {
    pub layout: VisionLayout,
    pub region: RegionHandle,
    /// How an image file becomes the tower's pixels (`preprocessor_config.json`); None
    /// where the model directory has none (no batch then carries images).
    #[serde(default)]
    pub pixels: Option<crate::data::ImageProcessor>,
    /// The most image tokens a row of the run's data holds, which bounds the images of a
    /// micro-batch in the device plan (`VisionDevice::row_tokens`); None: unknown.
    #[serde(default)]
    pub row_image_tokens: Option<u64>,
}

/// The leading blocks a worker keeps on its device, master weights, moments and compute
/// weights, and updates there (`memory.resident_blocks`; see [`ToWorker::ResidentUpdate`]).
///
/// Their gradients still reach the slab and the host reduce, and take their part in the
/// norm; the reduced gradient is read back from the host's accumulator, shared for that:
/// once the launcher frees the slot of a block's final part (the step's last micro-batch),
/// that part of the accumulator holds its final value and the launcher does not write it
/// again before this worker's next `LayerGrads` for it, so the worker copies it then.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResidentInit {
    /// Blocks `0..blocks`.
    pub blocks: usize,
    /// The launcher's gradient accumulator (every layout element, in `grad_dtype`).
    pub grad: RegionHandle,
    pub grad_dtype: DType,
    /// Where a [`ToWorker::ResidentCopy`] moves its f32 values: `layout.grad_slot_len()`
    /// of them at most.
    pub transfer: RegionHandle,
    /// `memory.master_weights: split`: the copy follows the split master's values
    /// ([`crate::optim::adamw::adamw_update_resident`]).
    pub split: bool,
}

/// Which state of a resident block a [`ToWorker::ResidentCopy`] moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResidentPart {
    /// The f32 master weights (a split master joined).
    Master,
    /// Adam's first moment.
    M,
    /// Adam's second moment.
    V,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ToWorker {
    Init(Box<Init>),
    Step {
        step: u64,
        micro: Vec<MicroBatch>,
        /// 1 / (unmasked label tokens of the whole global batch); under DPO, 1 / (pairs of
        /// the whole global batch).
        loss_scale: f64,
        /// The store is still being updated: block b may be read only after
        /// `BlockReady{block: b}`.
        weights_pending: bool,
        /// The images this worker's next step will read, in its micro-batches' order, for
        /// it to decode while this step computes (empty: none, or not known yet).
        #[serde(default)]
        next_images: Vec<crate::data::BatchImage>,
    },
    /// Store block `block` holds this step's weights.
    BlockReady {
        block: usize,
    },
    SlotFree {
        slot: usize,
    },
    /// Apply the step's update to the resident blocks (`Init::resident`), from the reduced
    /// gradient copied back as their slots were freed. Sent between steps, before the next
    /// `Step` or `Eval` that reads the updated weights.
    ResidentUpdate {
        hp: crate::optim::AdamWStep,
    },
    /// Between steps: `load`, copy elements `range` of resident block `block`'s `part`
    /// from the transfer region (where the launcher wrote them, f32) to the device; else
    /// copy them from the device to the transfer region. Answered by `ResidentCopied`.
    ResidentCopy {
        load: bool,
        block: usize,
        range: std::ops::Range<usize>,
        part: ResidentPart,
    },
    /// Forward-only micro-batch `index` (of the eval set's, or of the reference pass's, in
    /// order) under the weights in the store: its summed token loss, or each row's summed
    /// label log-probability.
    Eval {
        index: usize,
        micro: MicroBatch,
        what: ForwardOnly,
    },
    Shutdown,
}

/// What a forward-only pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardOnly {
    /// The summed token cross-entropy (the eval loss).
    Loss,
    /// Each row's summed log-probability of its label tokens (DPO's reference).
    RowLogProbs,
    /// Each label token's log-probability, row after row (GRPO's reference, `grpo.beta` >
    /// 0): the f32 values the training head computes, widened exactly.
    TokenLogProbs,
    /// As `TokenLogProbs`, then each label token's entropy of the predicted distribution
    /// (-Σ p log p over the vocabulary, in f32), in the same order: twice as many values.
    TokenLogProbsEntropy,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkerTimings {
    pub forward_s: f64,
    pub backward_s: f64,
    /// Time compute waited for weights to arrive (host-to-device).
    pub h2d_wait_s: f64,
    /// Time spent copying gradients into the slab (device-to-host).
    pub d2h_s: f64,
    /// Time the backward waited for the launcher to free a slab slot (the host reduce
    /// lagging); waiting for the worker's own in-flight gradient copies, which land only
    /// when the device has computed their layers, is not counted.
    pub slot_wait_s: f64,
    /// Time the worker waited for the launcher's update of a block it was about to read
    /// (the previous step's AdamW running behind this step's forward).
    #[serde(default)]
    pub update_wait_s: f64,
    /// Time spent on the micro-batches' images before their forward: reading, decoding and
    /// resizing the files (on the CPU), the pixels' upload and the vision tower's launch.
    #[serde(default)]
    pub images_s: f64,
    /// The most decoder layers any micro-batch kept its MLP activations for (the device
    /// plan's `keep`, `memory.recompute`).
    #[serde(default)]
    pub kept_layers: usize,
    /// GPU: the most device memory in use (cuMemGetInfo, so torch's reserve included).
    /// CPU: the step's peak resident memory above the step's start (VmHWM).
    pub peak_device_bytes: u64,
    /// Device bytes in use before the worker allocated anything (CUDA context, cuBLAS).
    #[serde(default)]
    pub context_device_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    Hello {
        rank: usize,
        pid: u32,
        commands: IpcSender<ToWorker>,
    },
    Ready {
        device: String,
        /// Seconds spent mapping and host-registering the shared regions.
        register_s: f64,
        /// Seconds of the CUDA warm-up (0 without one).
        warm_up_s: f64,
    },
    LayerGrads {
        micro: usize,
        block: usize,
        /// Which of `Layout::grad_parts(block, slot_len)` the slot holds.
        part: usize,
        slot: usize,
    },
    StepDone {
        /// Summed token losses; under DPO, summed pair losses (both plus the router aux
        /// loss / loss_scale).
        loss_sum: f64,
        tokens: u64,
        timings: WorkerTimings,
        /// Under DPO the pairs' sums, under GRPO the completions', for the metrics.
        #[serde(default)]
        sums: ObjectiveSums,
        /// Under GRPO, on a batch's first step with `num_iterations` > 1: every completion
        /// token's log-probability, micro-batch after micro-batch, row after row.
        #[serde(default)]
        token_logps: Vec<f32>,
    },
    /// Forward-only micro-batch `index`: its summed token cross-entropy
    /// ([`ForwardOnly::Loss`]), its rows' log-probabilities ([`ForwardOnly::RowLogProbs`])
    /// or its label tokens' ([`ForwardOnly::TokenLogProbs`]).
    EvalDone {
        index: usize,
        loss_sum: f64,
        #[serde(default)]
        logps: Vec<f64>,
    },
    /// The `ResidentCopy` asked for is done.
    ResidentCopied,
    Fatal {
        msg: String,
    },
}
