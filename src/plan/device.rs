//! The device memory one worker needs, as the maximum over the phases of a micro-batch.
//!
//! The engine (worker/src/engine.rs) never holds everything at once: the embedding and
//! head blocks are loaded only around the compute that reads them, layers stream through a
//! ring of two buffers, and a layer's activations exist only while that layer is computed.
//! So the peak is the largest of four phases, each the sum of what is alive in it:
//!
//! | phase            | alive                                                          |
//! |------------------|----------------------------------------------------------------|
//! | forward          | every layer input so far, one layer's no-grad temporaries      |
//! | head + loss      | every layer input, head block and gradient, one loss chunk     |
//! | layer backward   | the inputs left, one layer's recompute graph, gradients moving |
//! | embed backward   | embedding block and gradient, the last gradients moving        |
//!
//! plus what the whole micro-batch holds: the ring, the masks and RoPE tables. With tied
//! embeddings the embedding (and, from the head on, its gradient) stays for the whole
//! micro-batch. With `memory.offload_activations` the layer inputs live in host memory and
//! only the copies in flight (at most three) are on the device.
//!
//! Each figure counts the tensors the worker code creates or autograd saves, by shape and
//! dtype (the comments name them). Not counted: the CUDA context and cuBLAS workspaces
//! (fixed per process, measured by the worker at start), the allocator's rounding and
//! fragmentation. Gated DeltaNet layers are counted from their main tensors only, for the
//! path the worker takes (chunked on GPUs, the reference on CPU).

use crate::config::DType;
use crate::config::hf::{AttentionKind, ExpertNames, ModelSpec};
use crate::layout::Layout;

/// Gradient blocks whose device-to-host copy may be in flight at once
/// (worker/src/stream/gpu.rs MAX_D2H_IN_FLIGHT).
const GRADS_IN_FLIGHT: u64 = 2;
/// Layer inputs on the device with `offload_activations`: the one in use and at most two
/// copies in flight (two leaving in the forward; one arriving ahead in the backward).
const OFFLOADED_INPUTS: u64 = 3;
/// Rows of a chunk of the Gated DeltaNet rule (worker/src/model/gated_delta/: the reference's
/// CHUNK and the chunked path's default).
const DELTA_CHUNK: u64 = 64;
const F32: u64 = 4;

/// Options of the estimate that come from the run config.
#[derive(Debug, Clone, Copy)]
pub struct DeviceOpts {
    pub dtype: DType,
    pub ce_chunk_tokens: usize,
    /// Packed rows: a (B, 1, T, T) mask and (B, T) positions per micro-batch.
    pub packed: bool,
    /// Layer inputs are stashed in pinned host memory.
    pub offload_activations: bool,
    /// CPU workers: blocks are views of the shared store (no copies, no ring) and
    /// gradients are copied out at once (none in flight).
    pub cpu: bool,
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
    /// Held for the whole micro-batch.
    pub fixed: Parts,
    pub phases: Vec<Phase>,
}

/// What one decoder layer's compute allocates beyond its input, in bytes.
#[derive(Debug, Clone, Copy, Default)]
struct LayerActs {
    /// Tensors autograd saves in the recompute, alive until their node's backward ran.
    saved: u64,
    /// Gradient temporaries alive at the worst moment of the backward, beyond `saved`.
    backward: u64,
    /// Temporaries of the no-grad forward at its worst moment.
    forward: u64,
}

impl std::ops::Add for LayerActs {
    type Output = LayerActs;
    fn add(self, o: LayerActs) -> LayerActs {
        LayerActs {
            saved: self.saved + o.saved,
            backward: self.backward.max(o.backward),
            forward: self.forward.max(o.forward),
        }
    }
}

/// Sizes of one micro-batch: B rows, T tokens each, M = B*T tokens, `s` bytes per element
/// of the compute dtype.
struct Dims {
    b: u64,
    t: u64,
    m: u64,
    s: u64,
    /// Gated DeltaNet runs its chunked path (GPU workers) rather than the reference one.
    chunked_delta: bool,
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
        let (b, t) = (rows as u64, seq_len as u64);
        let dims = Dims {
            b,
            t,
            m: b * t,
            s,
            chunked_delta: !o.cpu,
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
            true => (OFFLOADED_INPUTS * hidden, OFFLOADED_INPUTS * hidden),
            // The forward's last layer holds every earlier input, its own and its output;
            // the backward's first layer every input, its own included.
            false => ((num_layers + 1) * hidden, num_layers * hidden),
        };
        let tied = layout.tied_embeddings;
        // The largest layer in each role (layer kinds differ in mixed stacks): its
        // recompute graph with the backward's temporaries, and its no-grad forward.
        let acts: Vec<LayerActs> = (0..spec.num_layers)
            .map(|l| layer_acts(spec, l, &dims))
            .collect();
        let graph = acts.iter().map(|a| a.saved + a.backward).max().unwrap_or(0);
        let layer_forward = acts.iter().map(|a| a.forward).max().unwrap_or(0);

        let mut fixed: Parts = vec![("layer ring (2 x largest layer)", copy(2 * layer_max))];
        fixed.push(("masks, RoPE tables, batch", tables(spec, o, &dims)));

        let tied_fwd = if tied { copy(embed) } else { 0 };
        let tied_bwd = if tied { copy(embed) + embed } else { 0 };
        let mut forward: Parts = vec![
            ("layer inputs kept for the backward", inputs_fwd),
            ("one layer's forward temporaries", layer_forward),
        ];
        if tied {
            forward.push(("tied embedding", tied_fwd));
        }

        // Head: the last hidden state (and its gradient), the final norm of the labelled
        // tokens (at most all M: their rows, the f32 input, the normed output and its
        // gradient), the
        // head block and its gradient, one loss chunk.
        let c = (o.ce_chunk_tokens as u64).min(m).max(1);
        // The head's gradient exists from the first chunk's lm_head backward on: beside
        // the peak of every later chunk, after the peak of a lone one.
        let loss_chunk = match m > c {
            true => chunk_bytes(spec, c, v, s) + head,
            false => chunk_bytes(spec, c, v, s).max(head + c * v * (F32 + s)),
        };
        let mut head_phase: Parts = vec![
            ("layer inputs kept for the backward", inputs_bwd),
            ("last hidden state and its gradient", 2 * hidden),
            ("final norm of the labelled tokens", m * h * (F32 + 3 * s)),
            ("head block", copy(head)),
            ("one loss chunk + the head's gradient", loss_chunk),
        ];
        if tied {
            head_phase.push(("tied embedding and its gradient", tied_bwd));
        }

        // Layer backward: the first layer backpropagated holds the most inputs, and the
        // head's gradient may still be in flight beside the one of the layer before.
        let mut layer_phase: Parts = vec![
            ("layer inputs kept for the backward", inputs_bwd),
            ("dy and dx of the layer", 2 * hidden),
            ("one layer's recompute graph + gradients", graph),
            ("the layer's weight gradients", layer_max),
            (
                "gradients in flight to the host",
                copy(head.max(layer_max) + (GRADS_IN_FLIGHT - 1) * layer_max),
            ),
        ];
        if tied {
            layer_phase.push(("tied embedding and its gradient", tied_bwd));
        }

        // Embedding backward: dy, the looked-up rows, the block and its gradient.
        let embed_phase: Parts = vec![
            ("dy and the looked-up embeddings", 2 * hidden),
            ("embedding block and its gradient", copy(embed) + embed),
            (
                "gradients in flight to the host",
                copy(GRADS_IN_FLIGHT * layer_max),
            ),
        ];

        DevicePlan {
            rows,
            seq_len,
            fixed,
            phases: vec![
                Phase {
                    name: "forward",
                    parts: forward,
                },
                Phase {
                    name: "head + loss",
                    parts: head_phase,
                },
                Phase {
                    name: "layer backward",
                    parts: layer_phase,
                },
                Phase {
                    name: "embedding backward",
                    parts: embed_phase,
                },
            ],
        }
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
/// outgoing one (the compute-dtype logits and their f32 copy are gone by then); a
/// soft-capped head also keeps tanh's output and its gradient in the compute dtype.
fn chunk_bytes(spec: &ModelSpec, c: u64, v: u64, s: u64) -> u64 {
    let softcap = if spec.final_softcap.is_some() {
        2 * s
    } else {
        0
    };
    c * v * (3 * F32 + softcap)
}

/// RoPE cos/sin per variant ((T, R), or (B, T, R) for packed rows), the boolean masks
/// ((T, T), or (B, 1, T, T) packed) and the batch's int64 ids, targets, selected positions
/// and positions.
fn tables(spec: &ModelSpec, o: DeviceOpts, d: &Dims) -> u64 {
    let rows = if o.packed { d.b } else { 1 };
    let ropes = 1 + spec.rope_local.is_some() as u64;
    let rope = ropes * 2 * rows * d.t * spec.rope.rotary_dim as u64 * d.s;
    let explicit = o.packed || spec.attn_softcap.is_some() || spec.attn_sinks;
    let sliding = spec.sliding_window.is_some_and(|w| (w as u64) < d.t);
    let chunked = spec.attention_chunk.is_some_and(|c| (c as u64) < d.t);
    let masks = (explicit as u64 + sliding as u64 + chunked as u64) * rows * d.t * d.t;
    rope + masks + 4 * 8 * d.m
}

/// Layer `l`'s activations: norms, the token mixer (attention or Gated DeltaNet) and the
/// MLP (dense or mixture of experts).
fn layer_acts(spec: &ModelSpec, l: usize, d: &Dims) -> LayerActs {
    let (m, s) = (d.m, d.s);
    let h = spec.hidden_size as u64;
    // Each RMSNorm saves its f32 input and its normed output; Gemma and GPT-OSS-style
    // sandwich norms double them.
    let norms_per_layer = if spec.family.norm_adds_one() && spec.linear_attn.is_none() {
        4
    } else {
        2
    };
    let norms = LayerActs {
        saved: norms_per_layer * m * h * (F32 + s),
        backward: m * h * F32,
        forward: 2 * m * h * F32,
    };
    let mixer = match spec.layer_types[l] {
        AttentionKind::Linear => delta_acts(spec, d),
        AttentionKind::Full | AttentionKind::Sliding | AttentionKind::Chunked => {
            attention_acts(spec, d)
        }
    };
    let mlp = if spec.is_sparse(l) {
        moe_acts(spec, d)
    } else {
        dense_mlp(m, spec.intermediate_size as u64, s)
    };
    norms + mixer + mlp
}

/// `down(act(gate(x)) * up(x))` over `m` tokens of intermediate size `i`: autograd keeps
/// gate(x), act, up and their product; the backward holds two more (M, I) gradients; the
/// forward peaks with act, up and the product alive.
fn dense_mlp(m: u64, i: u64, s: u64) -> LayerActs {
    LayerActs {
        saved: 4 * m * i * s,
        backward: 2 * m * i * s,
        forward: 3 * m * i * s,
    }
}

/// Attention: the rotated q and k and v, SDPA's output and log-sum-exp, the merged heads
/// (o_proj's input); q/k norms, the output gate and materialized scores where the family
/// has them.
fn attention_acts(spec: &ModelSpec, d: &Dims) -> LayerActs {
    let (b, t, m, s) = (d.b, d.t, d.m, d.s);
    let (n, k, hd) = (
        spec.num_heads as u64,
        spec.num_kv_heads as u64,
        spec.head_dim as u64,
    );
    // Multi-head latent attention: wider query/key heads, and the latents on the way.
    let (qk_d, latent) = match &spec.mla {
        Some(a) => {
            let latent = a.kv_lora_rank + a.qk_rope_head_dim + a.q_lora_rank.unwrap_or(0);
            (a.qk_head_dim() as u64, m * latent as u64 * (F32 + 2 * s))
        }
        None => (hd, 0),
    };
    let (q, kv) = (m * n * qk_d, m * k * qk_d);
    let mut saved = (3 * q + 2 * kv) * s + b * n * t * F32 + latent;
    let mut forward = 2 * (q + 2 * kv) * s + latent;
    if spec.qk_norm {
        saved += (q + kv) * (F32 + s);
    }
    if spec.attn_output_gate {
        // The gate's sigmoid and the gated product.
        saved += 2 * q * s;
        forward += q * s;
    }
    let mut backward = (q + 2 * kv) * s;
    if spec.attn_softcap.is_some() || spec.attn_sinks {
        // Eager attention: (B, N, T, T) scores; tanh / softmax outputs are saved (the
        // softmax in f32), and the backward holds two more score-sized gradients.
        let scores = b * n * t * t;
        saved += scores * (2 * s + F32);
        backward += scores * (F32 + s);
        forward += scores * (2 * s + F32);
    }
    LayerActs {
        saved,
        backward,
        forward,
    }
}

/// Mixture of experts over S = M * top_k routed (token, slot) pairs, as
/// worker/src/model/experts.rs computes it on GPUs: grouped GEMMs over the pairs sorted by
/// expert. Autograd keeps the router's f32 probabilities (and the aux loss's), the permuted
/// tokens (S, H), the stacked expert activations (every expert's MLP over its rows: S rows
/// of width I in all), the outputs back in (token, slot) order for the weighting, two int64
/// permutations and, for GPT-OSS's biases, the rows' one-hot experts (S, E). The backward
/// holds the weighting's and the un-permutation's (S, H) gradients, or the experts' (S, I)
/// ones; the forward peaks at the weighting. The per-expert loop (CPU workers) holds the
/// same tensors; its backward frees each expert's as it goes, so it needs a little less.
/// Measured on CPU workers against this plan (tiny models, 16 x 1024 tokens, both ways):
/// Qwen3-MoE within 0.5%, Mixtral-like widths grouped +4%, GPT-OSS +5%.
fn moe_acts(spec: &ModelSpec, d: &Dims) -> LayerActs {
    let (m, s) = (d.m, d.s);
    let moe = spec.moe.as_ref().expect("sparse layers have a MoE spec");
    let h = spec.hidden_size as u64;
    let e = moe.num_experts as u64;
    let slots = m * moe.top_k as u64;
    let ie = moe.expert_intermediate_size as u64;
    let experts = match moe.names {
        // Fused gate_up, the clamped halves, sigmoid, the GLU and its product; the
        // one-hot experts the biases are added through.
        ExpertNames::GptOssFused => LayerActs {
            saved: 7 * slots * ie * s + slots * e * s,
            backward: 2 * slots * ie * s,
            forward: 3 * slots * ie * s,
        },
        ExpertNames::Mixtral
        | ExpertNames::Qwen
        | ExpertNames::DeepSeek
        | ExpertNames::Llama4Fused => dense_mlp(slots, ie, s),
    };
    let routing = LayerActs {
        saved: m * e * (F32 + s) + 2 * slots * h * s + 2 * 8 * slots,
        backward: slots * h * (F32 + s),
        forward: slots * h * (F32 + 3 * s),
    };
    let shared = moe
        .shared_expert_intermediate_size
        .map(|i| dense_mlp(m, i as u64, s))
        .unwrap_or_default();
    experts + routing + shared
}

/// Gated DeltaNet (worker/src/model/gated_delta/), counted from its main tensors only.
fn delta_acts(spec: &ModelSpec, d: &Dims) -> LayerActs {
    let (m, s) = (d.m, d.s);
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (g, nv) = (la.num_k_heads as u64, la.num_v_heads as u64);
    let (dk, dv) = (la.k_head_dim as u64, la.v_head_dim as u64);
    let conv = 2 * g * dk + nv * dv;
    let proj = m * (conv + nv * dv + 2 * nv) * s;
    if d.chunked_delta {
        // Per token: the projections, the conv's output and its SiLU; the normed [q; k]
        // and its q.k / k.k; per value head the scaled k (three), beta v, w, v' and the
        // gated norm's four (B, T, V, Dv) tensors; the pairs' decay (f32 and a copy),
        // A and the blocked inverse's pieces (f32, ~4 pair tensors), T and P; the state at
        // each chunk start (f32 and a copy). The forward peaks with the projections, conv,
        // the value-head tensors and three f32 pair tensors alive.
        let (vd, kd, pairs) = (nv * dv, nv * dk, nv * DELTA_CHUNK);
        let states = nv * dk * dv / DELTA_CHUNK;
        let in_dtype = 2 * conv + 2 * g * dk + 2 * g * DELTA_CHUNK + 5 * kd + 6 * vd + 3 * pairs;
        return LayerActs {
            saved: proj + m * (in_dtype + states) * s + m * (6 * pairs + states) * F32,
            backward: 2 * m * conv * s + 4 * m * pairs * F32,
            forward: proj + m * (2 * conv + 5 * vd) * s + 3 * m * pairs * F32,
        };
    }
    // The reference path: f32 copies of q, k, v per value head (normalized, beta-scaled,
    // chunked, solved), the chunk-pair matrices and the gated norm.
    let conv_out = 2 * m * conv * s;
    let per_head = m * nv * (2 * dk + dv) * F32;
    let pairs = 3 * m * nv * DELTA_CHUNK * F32;
    let norm = 3 * m * nv * dv * F32;
    LayerActs {
        saved: proj + conv_out + 6 * per_head + pairs + norm,
        backward: 2 * per_head,
        forward: proj + conv_out + 3 * per_head + pairs,
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
mod tests {
    use super::*;
    use crate::config::hf::HfConfig;

    fn model(dir: &str) -> (ModelSpec, Layout) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs")
            .join(dir)
            .join("config.json");
        let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let spec = ModelSpec::from_hf(&hf, &path).unwrap();
        let layout = Layout::new(&spec);
        (spec, layout)
    }

    const OPTS: DeviceOpts = DeviceOpts {
        dtype: DType::Bfloat16,
        ce_chunk_tokens: 8192,
        packed: false,
        offload_activations: false,
        cpu: false,
    };

    fn part(p: &Phase, name: &str) -> u64 {
        p.parts.iter().find(|x| x.0 == name).unwrap().1
    }

    #[test]
    fn phases_follow_the_layout() {
        let (spec, layout) = model("qwen2.5-7b");
        let p = DevicePlan::new(&spec, &layout, OPTS, 64, 1024);
        let layer = layout.max_layer_len() as u64 * 2;
        assert_eq!(p.fixed[0].1, 2 * layer);
        let hidden = 64 * 1024 * 3584 * 2;
        assert_eq!(
            part(&p.phases[2], "layer inputs kept for the backward"),
            28 * hidden
        );
        assert_eq!(
            part(&p.phases[0], "layer inputs kept for the backward"),
            29 * hidden
        );
        let embed = layout.blocks[Layout::EMBED].len as u64 * 2;
        assert_eq!(
            part(&p.phases[3], "embedding block and its gradient"),
            2 * embed
        );
        // At a large batch the layer backward dominates; at batch 1 the head and its loss
        // chunk do (Qwen2.5's 152k vocabulary).
        assert_eq!(p.peak_phase().name, "layer backward");
        let p1 = DevicePlan::new(&spec, &layout, OPTS, 1, 1024);
        assert_eq!(p1.peak_phase().name, "head + loss");
        assert!(p.to_string().contains("peak phase: layer backward"));
    }

    #[test]
    fn activations_grow_with_the_batch_and_offload_removes_the_inputs() {
        let (spec, layout) = model("qwen2.5-7b");
        let p8 = DevicePlan::new(&spec, &layout, OPTS, 8, 1024);
        let p16 = DevicePlan::new(&spec, &layout, OPTS, 16, 1024);
        let graph = |p: &DevicePlan| part(&p.phases[2], "one layer's recompute graph + gradients");
        assert_eq!(graph(&p16), 2 * graph(&p8));
        let off = DeviceOpts {
            offload_activations: true,
            ..OPTS
        };
        let q = DevicePlan::new(&spec, &layout, off, 16, 1024);
        let saved = part(&p16.phases[2], "layer inputs kept for the backward")
            - part(&q.phases[2], "layer inputs kept for the backward");
        assert_eq!(saved, (28 - 3) * 16 * 1024 * 3584 * 2);
        assert!(q.total() < p16.total());
    }

    #[test]
    fn tied_embeddings_stay_for_the_micro_batch() {
        let (spec, layout) = model("qwen2.5-7b");
        let mut tied = spec.clone();
        tied.tie_word_embeddings = true;
        let tied_layout = Layout::new(&tied);
        let p = DevicePlan::new(&tied, &tied_layout, OPTS, 4, 1024);
        let embed = tied_layout.blocks[Layout::EMBED].len as u64 * 2;
        assert_eq!(part(&p.phases[0], "tied embedding"), embed);
        assert_eq!(
            part(&p.phases[2], "tied embedding and its gradient"),
            2 * embed
        );
        let untied = DevicePlan::new(&spec, &layout, OPTS, 4, 1024);
        assert!(untied.phases[2].parts.iter().all(|x| !x.0.contains("tied")));
    }

    #[test]
    fn moe_layers_count_routed_slots() {
        let (spec, layout) = model("qwen3-30b-a3b");
        let moe = spec.moe.as_ref().unwrap();
        let p = DevicePlan::new(&spec, &layout, OPTS, 4, 1024);
        // The experts' MLP runs over top_k slots per token, so it outweighs a dense MLP
        // of one expert's width over the tokens.
        let graph = part(&p.phases[2], "one layer's recompute graph + gradients");
        let m = 4 * 1024u64;
        assert!(graph > 4 * m * moe.top_k as u64 * moe.expert_intermediate_size as u64 * 2);
    }

    #[test]
    fn largest_batch_is_the_edge_of_the_budget() {
        let (spec, layout) = model("qwen2.5-7b");
        let budget = 80_000_000_000;
        let b = DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, budget);
        assert!(b > 0);
        assert!(DevicePlan::new(&spec, &layout, OPTS, b, 1024).total() <= budget);
        assert!(DevicePlan::new(&spec, &layout, OPTS, b + 1, 1024).total() > budget);
        assert_eq!(DevicePlan::largest_batch(&spec, &layout, OPTS, 1024, 1), 0);
    }
}
