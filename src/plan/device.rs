//! The device memory one worker needs, as the maximum over the phases of a micro-batch.
//!
//! The engine (worker/src/engine.rs) never holds everything at once: the embedding and
//! head blocks are loaded only around the compute that reads them, layers stream through a
//! ring of two buffers, and a layer's activations exist only while that layer is computed.
//! So the peak is the largest of the phases, each the sum of what is alive in it:
//!
//! | phase            | alive                                                          |
//! |------------------|----------------------------------------------------------------|
//! | forward          | every layer input so far, one layer's no-grad temporaries      |
//! | head + loss      | every layer input, head block and gradient, one loss chunk     |
//! | layer backward   | the inputs left, one layer's recompute graph, gradients moving |
//! | MLP tiles        | as layer backward, with the attention half's graph and one     |
//! |                  | tile's MLP graph in place of the layer's                       |
//! | embed backward   | embedding block and gradient, the last gradients moving        |
//!
//! plus what the whole micro-batch holds: the ring, the masks and RoPE tables. With tied
//! embeddings the embedding (and, from the head on, its gradient) stays for the whole
//! micro-batch. With `memory.offload_activations` the layer inputs live in host memory and
//! only the ones in use or in flight (at most three) are on the device.
//!
//! Tiling (`memory.tile_tokens`, worker/src/layer.rs): a layer whose token-wise half is
//! tiled ([`tiled_layer`]) recomputes its attention half whole, then runs and
//! backpropagates its post-attention norm and MLP one tile of the flattened (B*T) tokens at
//! a time, then backpropagates the attention half. Its MLP activations, (tokens x
//! intermediate) and the largest of a dense layer, are then one tile's: the layer backward
//! phase holds the attention half's graph alone and the MLP tiles phase that graph, the
//! half's output and one tile's graph. The no-grad forward tiles the same way. The
//! automatic tile is the largest multiple of [`TILE_ALIGN`] tokens whose MLP tiles phase
//! stays within the largest of the head, layer backward and embedding phases: tiling then
//! lowers the peak to what the rest of the micro-batch needs anyway, with tiles as large
//! (as efficient) as that allows. A micro-batch whose whole MLP fits within it runs untiled.
//! A model with linear-attention layers on GPUs runs untiled where the whole micro-batch
//! fits the GPU's free memory with a margin (its delta rule then runs once in the
//! backward, not twice); otherwise its tile also sets the rule's segments.
//!
//! Each figure counts the tensors the worker code creates or autograd saves, by shape and
//! dtype (the comments name them; `acts.rs` those of one layer). Not counted: the CUDA
//! context and cuBLAS workspaces (fixed per process, measured by the worker at start), the
//! allocator's rounding and fragmentation. Gated DeltaNet layers are counted from their
//! main tensors only, for the path the worker takes (chunked on GPUs, the reference on CPU).

use crate::config::hf::{AttentionKind, ModelSpec};
use crate::config::{DType, Recompute, TileTokens};
use crate::layout::Layout;
use crate::protocol::{Device, Init};

use super::acts::{self, Dims, F32, LayerActs};

mod keep;
mod vision;
pub use keep::{KEEP_FIT, keeps_mlp, kept_bytes, kept_layers};
pub use vision::VisionDevice;

/// Gradient blocks whose device-to-host copy may be in flight at once
/// (worker/src/stream/gpu.rs MAX_D2H_IN_FLIGHT).
const GRADS_IN_FLIGHT: u64 = 2;
/// Layer inputs on the device with `offload_activations` in the forward: the one in use and
/// the copies to the host in flight (worker/src/stream/gpu.rs MAX_STASH_IN_FLIGHT).
const OFFLOADED_INPUTS_FWD: u64 = 3;
/// ... from the head on: the forward's last copies out (until the first layer's backward
/// drops them), then the input in use and the one arriving ahead.
const OFFLOADED_INPUTS_BWD: u64 = 2;
/// The automatic tile is a multiple of this many tokens, and at least this many (whole
/// GEMM tiles; a micro-batch of no more tokens runs untiled).
pub const TILE_ALIGN: usize = 1024;

/// The share of a GPU's free memory an untiled micro-batch of a model with linear-attention
/// layers may plan to use. The plan of a whole delta rule undercounts long rows: Qwen3.5-27B
/// (8 layers) at 1 x 32768 tokens measured 40.2 GiB against 30.9 planned (+30%; at 128 x
/// 1024, 99.1 against 97.0 since the plan counts the fused conv's tensors, 100.5 before;
/// benches/results/qwen3.5-27b-8L_fused_H200-16c_2026-11-24.md), so the plan must leave
/// that much room.
const WHOLE_FIT: f64 = 0.75;

/// The phases' names.
const FORWARD: &str = "forward";
const HEAD: &str = "head + loss";
const LAYER_BACKWARD: &str = "layer backward";
const MLP_TILES: &str = "layer backward, MLP tiles";
const EMBED_BACKWARD: &str = "embedding backward";
const VISION_FORWARD: &str = "vision tower forward";

/// Options of the estimate that come from the run config.
#[derive(Debug, Clone, Copy)]
pub struct DeviceOpts {
    pub dtype: DType,
    pub ce_chunk_tokens: usize,
    /// `memory.tile_tokens`.
    pub tile_tokens: TileTokens,
    /// `memory.recompute`, as the launcher resolved it (`auto` keeps nothing beside
    /// resident blocks).
    pub recompute: Recompute,
    /// Packed rows: a (B, 1, T, T) mask and (B, T) positions per micro-batch.
    pub packed: bool,
    /// Layer inputs are stashed in pinned host memory.
    pub offload_activations: bool,
    /// CPU workers: blocks are views of the shared store (no copies, no ring) and
    /// gradients are copied out at once (none in flight).
    pub cpu: bool,
    /// The least free memory of the run's GPUs, as the launcher read it before starting
    /// the workers (`mt-launch plan`: its budget); None where unknown. The automatic tile
    /// keeps a Gated DeltaNet rule whole where it fits in this.
    pub device_free: Option<u64>,
    /// A vision-language model's frozen tower, which the workers run; None for text only.
    pub vision: Option<VisionDevice>,
}

impl DeviceOpts {
    /// The options of a worker's micro-batches (`packed`: with position ids), as the
    /// launcher planned them and sent them in `init`.
    pub fn of_worker(init: &Init, packed: bool) -> Self {
        DeviceOpts {
            dtype: init.dtype,
            ce_chunk_tokens: init.ce_chunk_tokens,
            tile_tokens: init.tile_tokens,
            recompute: init.recompute,
            packed,
            offload_activations: init.offload_activations,
            cpu: init.device == Device::Cpu,
            device_free: init.device_free,
            vision: init.vision.as_ref().map(|v| VisionDevice {
                row_tokens: v.row_image_tokens,
                ..VisionDevice::of(&v.layout.spec, v.layout.num_params(), v.layout.training)
            }),
        }
    }
}

/// Named byte counts.
pub type Parts = Vec<(&'static str, u64)>;

/// One phase of the micro-batch: what is alive at its peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    pub name: &'static str,
    pub parts: Parts,
}

impl Phase {
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|p| p.1).sum()
    }
}

/// Bytes of device memory one worker holds for micro-batches of `rows` sequences of
/// `seq_len` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePlan {
    pub rows: usize,
    pub seq_len: usize,
    /// Tokens per tile of the tiled layers' token-wise half; None: every layer whole.
    pub tile: Option<usize>,
    /// The `memory.tile_tokens` it comes from.
    pub tile_setting: TileTokens,
    /// How many of the last layers keep their MLP activations for the backward
    /// ([`kept_layers`]); the rest are recomputed from their input.
    pub keep: usize,
    /// The `memory.recompute` it comes from.
    pub recompute: Recompute,
    /// The model has linear-attention layers, whose delta rule runs in segments when the
    /// micro-batch is tiled ([`segmented_layer`], [`delta_segment`]).
    pub segmented: bool,
    /// Held for the whole micro-batch.
    pub fixed: Parts,
    pub phases: Vec<Phase>,
    /// Each layer's part of the layer backward ("one layer's recompute graph + gradients"),
    /// and of the MLP tiles phase for the layers that tile: what the kept activations
    /// still held by a layer's backward sit beside ([`DevicePlan::keeping`]).
    pub(crate) graphs: Vec<u64>,
    pub(crate) tile_graphs: Vec<Option<u64>>,
}

/// What one layer holds in each phase, in bytes.
struct Roles {
    /// The layer backward: its recompute graph with the backward's temporaries (a tiled
    /// layer's: the attention half's).
    graph: u64,
    /// The no-grad forward's temporaries.
    forward: u64,
    /// A tiled layer in its MLP tiles phase: the attention half's saved tensors, and one
    /// tile's graph with its temporaries and the tile's output gradient.
    tiles: Option<(u64, u64)>,
}

/// Whether layer `layer`'s token-wise half runs in tiles when the micro-batch is tiled: a
/// dense MLP's tokens are independent; a mixture of experts stays whole (its router's
/// load-balancing loss sums over the micro-batch).
pub fn tiled_layer(spec: &ModelSpec, layer: usize) -> bool {
    !spec.is_sparse(layer)
}

/// Whether layer `layer` runs its delta rule in sequence segments when the micro-batch is
/// tiled (worker/src/segments.rs): a Gated DeltaNet layer, whose state carries the rule
/// from one segment to the next (its MLP half tiles or not by [`tiled_layer`]).
pub fn segmented_layer(spec: &ModelSpec, layer: usize) -> bool {
    spec.layer_types[layer] == AttentionKind::Linear
}

/// Tokens per row of one segment of a Gated DeltaNet layer's delta rule, for a micro-batch
/// of `rows` rows in tiles of `tile` tokens and the rule's chunks of `chunk` tokens: the
/// tile's share of a row in whole chunks, at least one (the B rows run together, so a
/// segment's graph spans B x segment tokens, about one tile's).
pub fn delta_segment(tile: usize, rows: usize, chunk: usize) -> usize {
    (tile / rows.max(1) / chunk).max(1) * chunk
}

impl DevicePlan {
    /// The plan of micro-batches of `rows` x `seq_len` tokens, with the tile
    /// `o.tile_tokens` resolves to for them.
    pub fn new(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        rows: usize,
        seq_len: usize,
    ) -> DevicePlan {
        let m = rows * seq_len;
        let tiles = (0..spec.num_layers).any(|l| tiled_layer(spec, l) || segmented_layer(spec, l));
        let tile = match o.tile_tokens {
            _ if !tiles => None,
            TileTokens::Off => None,
            TileTokens::Tokens(n) => Some(n),
            TileTokens::Auto => Self::auto_tile(spec, layout, o, rows, seq_len),
        };
        Self::tiled(spec, layout, o, (rows, seq_len), tile.filter(|&t| t < m)).resolve_keep(spec, o)
    }

    /// The automatic tile (module doc): None where the whole micro-batch's MLP already
    /// stays within the other phases, or it has at most [`TILE_ALIGN`] tokens.
    fn auto_tile(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        rows: usize,
        seq_len: usize,
    ) -> Option<usize> {
        let m = rows * seq_len;
        if m <= TILE_ALIGN {
            return None;
        }
        let fits = |tile: usize| {
            let p = Self::tiled(spec, layout, o, (rows, seq_len), Some(tile));
            let bound = [HEAD, LAYER_BACKWARD, EMBED_BACKWARD]
                .map(|name| p.phase(name).map_or(0, Phase::total))
                .into_iter()
                .max();
            p.phase(MLP_TILES).map(Phase::total) <= bound
        };
        // At `m`: the whole micro-batch as one tile, against the same bound.
        let mlp_tile = match fits(m) {
            true => None,
            false => {
                let k = super::fit::largest(|k| fits(k * TILE_ALIGN), m / TILE_ALIGN);
                Some(k.max(1) * TILE_ALIGN)
            }
        };
        // CPU workers keep the rule whole: their memory is host RAM, where segments would
        // cost time for no launch they make possible (and the plan of the reference rule's
        // segments is 13% high on the hybrid of launcher/tests/plan_measured.rs).
        if o.cpu || !(0..spec.num_layers).any(|l| segmented_layer(spec, l)) {
            return mlp_tile;
        }
        // Linear layers on GPUs: the tile also sets their delta rule's segments, which
        // bound the layer backward but cost time (the rule runs once more in the backward;
        // Qwen3.5-27B, 8 layers, batch 128 on one H200: 10.31 s a step in segments, 9.83 s
        // whole). So none where the whole micro-batch fits the GPU with a margin for the
        // plan's error ([`WHOLE_FIT`]). Otherwise, the largest
        // tile whose peak stays within a tenth of the smallest tile's: segments as long (as
        // efficient) as that allows, none where the whole rule already keeps the peak there
        // (short sequences).
        let whole = Self::tiled(spec, layout, o, (rows, seq_len), None).total();
        if o.device_free
            .is_some_and(|free| whole as f64 <= WHOLE_FIT * free as f64)
        {
            return None;
        }
        let total = |tile: usize| Self::tiled(spec, layout, o, (rows, seq_len), Some(tile)).total();
        let floor = total(TILE_ALIGN);
        let near = |tile: usize| total(tile) <= floor + floor / 10;
        let cap = mlp_tile.unwrap_or(m);
        if near(cap) {
            return mlp_tile;
        }
        let k = super::fit::largest(|k| near(k * TILE_ALIGN), cap / TILE_ALIGN);
        Some(k.max(1) * TILE_ALIGN)
    }

    /// The plan with the token-wise halves of the tiled layers in tiles of `tile` tokens
    /// (None: whole; at most the micro-batch, which [`Self::auto_tile`] passes to weigh the
    /// whole MLP as one tile).
    fn tiled(
        spec: &ModelSpec,
        layout: &Layout,
        o: DeviceOpts,
        (rows, seq_len): (usize, usize),
        tile: Option<usize>,
    ) -> DevicePlan {
        let s = o.dtype.size() as u64;
        let (b, t) = (rows as u64, seq_len as u64);
        let dims = Dims {
            b,
            t,
            m: b * t,
            s,
            gpu: !o.cpu,
            bf16: o.dtype == DType::Bfloat16,
            packed: o.packed,
        };
        let m = dims.m;
        let h = spec.hidden_size as u64;
        let v = spec.vocab_size as u64;
        let num_layers = layout.num_layers() as u64;
        let block_bytes = |i: usize| layout.blocks[i].len as u64 * s;
        let (embed, head) = (block_bytes(Layout::EMBED), block_bytes(layout.head_block()));
        let layer_max = layout.max_layer_len() as u64 * s;
        // Device copies of blocks and gradients on their way out: none on a CPU worker.
        let copy = |bytes: u64| if o.cpu { 0 } else { bytes };
        // One hidden state (B, T, H).
        let hidden = m * h * s;
        let (inputs_fwd, inputs_bwd) = match o.offload_activations {
            // A model of fewer layers than copies that may be in flight holds no more.
            true => (
                OFFLOADED_INPUTS_FWD.min(num_layers + 1) * hidden,
                OFFLOADED_INPUTS_BWD.min(num_layers) * hidden,
            ),
            // The forward's last layer holds every earlier input, its own and its output;
            // the backward's first layer every input, its own included.
            false => ((num_layers + 1) * hidden, num_layers * hidden),
        };
        let tied = layout.tied_embeddings;
        // Per layer (layer kinds differ in mixed stacks): what it holds in each phase.
        let tile = tile.map(|t| (t as u64).min(m));
        let roles: Vec<Roles> = (0..spec.num_layers)
            .map(|l| {
                // A linear layer in a tiled micro-batch runs its delta rule in segments.
                let segment = tile
                    .filter(|_| segmented_layer(spec, l))
                    .map(|t| delta_segment(t as usize, rows, acts::DELTA_CHUNK as usize) as u64)
                    .filter(|&seg| seg < dims.t);
                let attn = match segment {
                    Some(seg) => acts::delta_half_segmented(spec, &dims, seg),
                    None => acts::attention_half(spec, l, &dims),
                };
                match tile.filter(|_| tiled_layer(spec, l)) {
                    Some(t) => {
                        let mlp = acts::mlp_half(spec, l, t, &dims);
                        Roles {
                            graph: attn.graph(),
                            forward: attn.forward.max(mlp.forward + t * h * s),
                            tiles: Some((attn.saved, mlp.graph() + t * h * s)),
                        }
                    }
                    None => {
                        let whole: LayerActs = attn + acts::mlp_half(spec, l, m, &dims);
                        Roles {
                            graph: whole.graph(),
                            forward: whole.forward,
                            tiles: None,
                        }
                    }
                }
            })
            .collect();
        let graph = roles.iter().map(|r| r.graph).max().unwrap_or(0);
        let layer_forward = roles.iter().map(|r| r.forward).max().unwrap_or(0);
        let tile_parts = roles
            .iter()
            .filter_map(|r| r.tiles)
            .max_by_key(|(attn, mlp)| attn + mlp);

        let mut fixed: Parts = vec![("layer ring (2 x largest layer)", copy(2 * layer_max))];
        fixed.push(("masks, RoPE tables, batch", tables(spec, o, &dims)));
        if let Some(vis) = o.vision {
            fixed.extend(vis.fixed(vis.image_tokens(b, m), s));
        }

        let tied_fwd = if tied { copy(embed) } else { 0 };
        let tied_bwd = if tied { copy(embed) + embed } else { 0 };
        let mut forward: Parts = vec![
            ("layer inputs kept for the backward", inputs_fwd),
            ("one layer's forward temporaries", layer_forward),
        ];
        if tied {
            forward.push(("tied embedding", tied_fwd));
        }

        // Head (worker/src/head/): the last hidden state and its gradient, and one chunk
        // of labelled tokens through the final norm (their rows, the f32 input, the normed
        // output and its gradient), lm_head and the loss, with the head block and its
        // gradient.
        let c = (o.ce_chunk_tokens as u64).min(m).max(1);
        // GPU workers in bf16 take the fused cross-entropy (worker/src/kernels/ce.rs).
        let fused_ce = dims.gpu && dims.bf16;
        let chunk = chunk_bytes(spec, c, v, s, fused_ce);
        // The head's gradient exists from the first chunk's lm_head backward on: beside
        // the peak of every later chunk, after the peak of a lone one (with the fused
        // cross-entropy, beside its logits and their gradient still).
        let loss_chunk = match m > c || fused_ce {
            true => chunk + head,
            false => chunk.max(head + c * v * (F32 + s)),
        };
        let mut head_phase: Parts = vec![
            ("layer inputs kept for the backward", inputs_bwd),
            ("last hidden state and its gradient", 2 * hidden),
            ("final norm of one loss chunk", c * h * (F32 + 3 * s)),
            ("head block", copy(head)),
            ("one loss chunk + the head's gradient", loss_chunk),
        ];
        if tied {
            head_phase.push(("tied embedding and its gradient", tied_bwd));
        }

        // Layer backward: the first layer backpropagated holds the most inputs, and the
        // head's gradient may still be in flight beside the one of the layer before.
        let weight_grads = [
            ("the layer's weight gradients", layer_max),
            (
                "gradients in flight to the host",
                copy(head.max(layer_max) + (GRADS_IN_FLIGHT - 1) * layer_max),
            ),
        ];
        let mut layer_phase: Parts = vec![
            ("layer inputs kept for the backward", inputs_bwd),
            ("dy and dx of the layer", 2 * hidden),
            ("one layer's recompute graph + gradients", graph),
        ];
        layer_phase.extend(weight_grads);
        if tied {
            layer_phase.push(("tied embedding and its gradient", tied_bwd));
        }

        // Embedding backward: dy, the looked-up rows, the block and its gradient.
        let mut embed_phase: Parts = vec![
            ("dy and the looked-up embeddings", 2 * hidden),
            ("embedding block and its gradient", copy(embed) + embed),
            (
                "gradients in flight to the host",
                copy(GRADS_IN_FLIGHT * layer_max),
            ),
        ];
        if let Some(vis) = o.vision {
            embed_phase.extend(vis.embedding_backward(vis.image_tokens(b, m), s));
        }

        let mut phases = vec![
            Phase {
                name: FORWARD,
                parts: forward,
            },
            Phase {
                name: HEAD,
                parts: head_phase,
            },
            Phase {
                name: LAYER_BACKWARD,
                parts: layer_phase,
            },
            Phase {
                name: EMBED_BACKWARD,
                parts: embed_phase,
            },
        ];
        if let Some(vis) = o.vision {
            phases.push(Phase {
                name: VISION_FORWARD,
                parts: vis.forward(vis.image_tokens(b, m), s, copy(embed)),
            });
        }
        // MLP tiles: the tile's gradient lands in dy's rows (dy becomes the attention
        // half's output gradient in place), beside that output.
        if let Some((attn_saved, tile_graph)) = tile_parts {
            let mut parts: Parts = vec![
                ("layer inputs kept for the backward", inputs_bwd),
                ("dy and the attention half's output", 2 * hidden),
                ("the attention half's recompute graph", attn_saved),
                ("one MLP tile's graph + gradients", tile_graph),
            ];
            parts.extend(weight_grads);
            if tied {
                parts.push(("tied embedding and its gradient", tied_bwd));
            }
            phases.push(Phase {
                name: MLP_TILES,
                parts,
            });
        }

        DevicePlan {
            rows,
            seq_len,
            tile: tile.map(|t| t as usize),
            tile_setting: o.tile_tokens,
            keep: 0,
            recompute: o.recompute,
            segmented: (0..spec.num_layers).any(|l| segmented_layer(spec, l)),
            fixed,
            phases,
            graphs: roles.iter().map(|r| r.graph).collect(),
            tile_graphs: roles.iter().map(|r| r.tiles.map(|(a, g)| a + g)).collect(),
        }
    }

    /// The phase named `name`, where the plan has it.
    pub fn phase(&self, name: &str) -> Option<&Phase> {
        self.phases.iter().find(|p| p.name == name)
    }

    /// The phase with the most memory.
    pub fn peak_phase(&self) -> &Phase {
        self.phases
            .iter()
            .max_by_key(|p| p.total())
            .expect("four phases")
    }

    pub fn total(&self) -> u64 {
        self.fixed.iter().map(|p| p.1).sum::<u64>() + self.peak_phase().total()
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
        super::fit::largest(fits, 1 << 24)
    }
}

/// One chunk of C tokens through lm_head and the cross-entropy. Its peak is in the
/// backward of log-softmax: the saved f32 output, the incoming f32 gradient and the
/// outgoing one (the compute-dtype logits and their f32 copy are gone by then). The fused
/// cross-entropy (`fused`) holds only the logits and the gradient it writes for them, both
/// in the compute dtype. A soft-capped head also keeps tanh's output and its gradient in
/// the compute dtype.
fn chunk_bytes(spec: &ModelSpec, c: u64, v: u64, s: u64, fused: bool) -> u64 {
    let softcap = if spec.final_softcap.is_some() {
        2 * s
    } else {
        0
    };
    let loss = if fused { 2 * s } else { 3 * F32 };
    c * v * (loss + softcap)
}

/// RoPE cos/sin per variant ((T, R), or (B, T, R) for packed rows), the boolean masks
/// ((T, T), or (B, 1, T, T) packed) and the batch's int64 ids, targets, selected positions
/// and positions.
fn tables(spec: &ModelSpec, o: DeviceOpts, d: &Dims) -> u64 {
    // Gemma 3's image blocks make the masks per row (`Context::with_image_blocks`).
    let blocks = o.vision.is_some_and(|v| v.image_blocks);
    let rows = if o.packed { d.b } else { 1 };
    let ropes = 1 + spec.rope_local.is_some() as u64;
    let rope = ropes * 2 * rows * d.t * spec.rope.rotary_dim as u64 * d.s;
    let rows = if blocks { d.b } else { rows };
    let explicit = o.packed || blocks || spec.attn_softcap.is_some() || spec.attn_sinks;
    let sliding = spec.sliding_window.is_some_and(|w| (w as u64) < d.t);
    let chunked = spec.attention_chunk.is_some_and(|c| (c as u64) < d.t);
    let masks = (explicit as u64 + sliding as u64 + chunked as u64) * rows * d.t * d.t;
    rope + masks + 4 * 8 * d.m
}

impl std::fmt::Display for DevicePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "device memory per worker, micro-batch {} x {} tokens:",
            self.rows, self.seq_len
        )?;
        let m = self.rows * self.seq_len;
        match self.tile {
            Some(t) => {
                writeln!(
                    f,
                    "  MLP half of each dense layer in tiles of {t} tokens, {} per layer \
                     (memory.tile_tokens: {})",
                    m.div_ceil(t),
                    self.tile_setting
                )?;
                let seg = delta_segment(t, self.rows, acts::DELTA_CHUNK as usize);
                if self.segmented && seg < self.seq_len {
                    writeln!(
                        f,
                        "  delta rule of each linear-attention layer in segments of {seg} \
                         tokens per row, {} per row",
                        self.seq_len.div_ceil(seg)
                    )?;
                }
            }
            None => writeln!(
                f,
                "  MLP half of each layer whole (memory.tile_tokens: {})",
                self.tile_setting
            )?,
        }
        match self.keep {
            0 => writeln!(
                f,
                "  every layer recomputed from its input in the backward (memory.recompute: {})",
                self.recompute
            )?,
            n => writeln!(
                f,
                "  the last {n} layers keep their MLP activations, the backward recomputes \
                 their attention half only (memory.recompute: {})",
                self.recompute
            )?,
        }
        for (name, bytes) in &self.fixed {
            writeln!(f, "  {name:<44} {:>8.2} GB", gb(*bytes))?;
        }
        let peak = self.peak_phase();
        writeln!(
            f,
            "  peak phase: {:<32} {:>8.2} GB",
            peak.name,
            gb(peak.total())
        )?;
        for (name, bytes) in &peak.parts {
            writeln!(f, "    {name:<42} {:>8.2} GB", gb(*bytes))?;
        }
        let others: Vec<String> = self
            .phases
            .iter()
            .filter(|p| p.name != peak.name)
            .map(|p| format!("{} {:.2} GB", p.name, gb(p.total())))
            .collect();
        writeln!(f, "  other phases: {}", others.join(", "))?;
        write!(
            f,
            "  total                                        {:>8.2} GB (+ CUDA context, allocator slack)",
            gb(self.total())
        )
    }
}

#[cfg(test)]
mod tests;
