//! What one decoder layer's compute allocates beyond its input, by shape and dtype (the
//! comments name the tensors), in its two halves: the token-mixing half (attention or Gated
//! DeltaNet, with the norm before it) over the whole micro-batch, and the token-wise half
//! (the norm before the MLP and the MLP, dense or mixture of experts) over any number of
//! tokens, the whole micro-batch or one tile of it. The device plan (`device.rs`) adds them
//! up per phase.

use crate::config::hf::{Activation, AttentionKind, ExpertNames, Family, ModelSpec};

/// Rows of a chunk of the Gated DeltaNet rule (worker/src/model/gated_delta/: the reference's
/// CHUNK and the chunked path's default).
pub(super) const DELTA_CHUNK: u64 = 64;
pub(super) const F32: u64 = 4;

/// What one half layer's compute allocates beyond its input, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LayerActs {
    /// Tensors autograd saves in the recompute, alive until their node's backward ran.
    pub saved: u64,
    /// Gradient temporaries alive at the worst moment of the backward, beyond `saved`.
    pub backward: u64,
    /// Temporaries of the no-grad forward at its worst moment.
    pub forward: u64,
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

impl LayerActs {
    /// The recompute graph with the backward's temporaries.
    pub fn graph(self) -> u64 {
        self.saved + self.backward
    }
}

/// Sizes of one micro-batch: B rows, T tokens each, M = B*T tokens, `s` bytes per element
/// of the compute dtype.
pub(super) struct Dims {
    pub b: u64,
    pub t: u64,
    pub m: u64,
    pub s: u64,
    /// GPU workers: Gated DeltaNet runs its chunked path rather than the reference one, and
    /// attention torch's fused SDPA kernels rather than CPU's.
    pub gpu: bool,
    /// The compute dtype is bfloat16.
    pub bf16: bool,
    /// Rows pack several samples (per-row masks).
    pub packed: bool,
}

/// The RMSNorms of one half of layer `l` over `m` tokens: each saves its f32 input and its
/// normed output; Gemma's sandwich norms double them. The `1 + w` norm over the half's
/// input runs as one kernel on GPU workers ([`plus_one_fused`]) and keeps its output and
/// the rows' rstd only; a sandwich's second norm (over a product, not a leaf) does not.
fn norms(spec: &ModelSpec, m: u64, d: &Dims) -> LayerActs {
    let h = spec.hidden_size as u64;
    let per_half = if spec.family.norm_adds_one() && spec.linear_attn.is_none() {
        2
    } else {
        1
    };
    let torch = LayerActs {
        saved: m * h * (F32 + d.s),
        backward: m * h * F32,
        forward: 2 * m * h * F32,
    };
    let first = match plus_one_fused(spec, d) {
        true => LayerActs {
            saved: m * (h * d.s + F32),
            backward: m * h * d.s,
            forward: m * h * d.s,
        },
        false => torch,
    };
    (1..per_half).fold(first, |acts, _| acts + torch)
}

/// Whether GPU workers run the `1 + w` RMSNorm over a half layer's input as one kernel
/// (worker/src/kernels/norm.rs: bf16, H a multiple of 8 up to 8192). The worker's
/// `MT_RMS_NORM=plain` (a comparison hook) runs torch's ops instead.
fn plus_one_fused(spec: &ModelSpec, d: &Dims) -> bool {
    let h = spec.hidden_size;
    d.gpu && d.bf16 && spec.family.norm_adds_one() && h.is_multiple_of(8) && h <= 8192
}

/// Layer `l`'s token-mixing half over the whole micro-batch: its norm(s) and the attention
/// or Gated DeltaNet.
pub(super) fn attention_half(spec: &ModelSpec, l: usize, d: &Dims) -> LayerActs {
    let mixer = match spec.layer_types[l] {
        AttentionKind::Linear => delta_acts(spec, d),
        AttentionKind::Full | AttentionKind::Sliding | AttentionKind::Chunked => {
            attention_acts(spec, d)
        }
    };
    norms(spec, d.m, d) + mixer
}

/// Layer `l`'s token-wise half over `tokens` tokens: its norm(s) and the MLP (dense, or
/// the mixture of experts, which runs over the whole micro-batch only).
pub(super) fn mlp_half(spec: &ModelSpec, l: usize, tokens: u64, d: &Dims) -> LayerActs {
    let i = spec.intermediate_size as u64;
    let mlp = if spec.is_sparse(l) {
        moe_acts(spec, tokens, d)
    } else if fused_dense_glu(spec, d) {
        fused_glu_mlp(tokens, i, d.s)
    } else {
        dense_mlp(tokens, i, d.s)
    };
    norms(spec, tokens, d) + mlp
}

/// Whether GPU workers run a dense MLP's SiLU(gate) * up as one fused op
/// (worker/src/model/common.rs `dense_mlp_named`: bf16, SiLU, I a multiple of 8, the
/// families with separate gate and up projections). The worker's `MT_SWIGLU` (a comparison
/// hook) can choose otherwise.
fn fused_dense_glu(spec: &ModelSpec, d: &Dims) -> bool {
    d.gpu
        && d.bf16
        && spec.hidden_act == Activation::Silu
        && spec.intermediate_size.is_multiple_of(8)
        && !matches!(spec.family, Family::Phi3 | Family::Glm4)
}

/// [`dense_mlp`] with SiLU(gate) * up fused: gate(x), up(x) and their product kept (the
/// fused op keeps its inputs, the down projection its input); the forward holds the
/// product alone.
fn fused_glu_mlp(m: u64, i: u64, s: u64) -> LayerActs {
    LayerActs {
        saved: 3 * m * i * s,
        backward: 2 * m * i * s,
        forward: m * i * s,
    }
}

/// `down(act(gate(x)) * up(x))` over `m` tokens of intermediate size `i`: autograd keeps
/// gate(x), act, up and their product; the backward holds two more (M, I) gradients; the
/// forward peaks with act, up and the product alive.
pub(super) fn dense_mlp(m: u64, i: u64, s: u64) -> LayerActs {
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
    // Sinks through FlashAttention (worker/src/kernels/sinks.rs, GPU workers in bf16 on
    // unpacked rows): flash's output o and the op's y (o_proj's input, in heads' order, so
    // no merged copy) stand for SDPA's output and the merged heads; the rows' sigmoid
    // weights are more, and the backward holds do beside the kernel's buffers.
    let flash_sinks = spec.attn_sinks && d.gpu && d.bf16 && !d.packed && hd % 8 == 0 && hd <= 256;
    let eager = spec.attn_softcap.is_some() || (spec.attn_sinks && !flash_sinks);
    if flash_sinks {
        saved += b * n * t * F32;
        backward += q * s;
    }
    if d.gpu && !eager {
        // The fused kernel's backward (cuDNN's, torch's default on Hopper, GQA included)
        // and the gradients around it: measured with torch 2.11 on an H200 at 128k-512k
        // tokens, the backward of the attention half peaks 9.0 query-sized tensors above its
        // recompute graph, of which dx is 1 (counted by the phase) and dq, dk, dv are
        // counted above: the kernel's own buffers, its contiguous copy of the output
        // gradient and o_proj's output gradient are the other 6.7, counted as 7
        // (benches/results/long_context_H200_2026-11-23.md).
        backward += 7 * q * s;
    }
    if eager {
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
/// With the fused gather and combine (GPU workers in bf16: [`fused_combine`]) the outputs
/// are kept in expert order instead, with one more int64 permutation; the forward holds the
/// combined (M, H) output, the backward the outputs' and the gathered rows' (S, H)
/// gradients, and no f32 product; the SwiGLU between the expert GEMMs is one op that keeps
/// its inputs alone.
/// Measured on CPU workers against this plan (tiny models, 16 x 1024 tokens, both ways):
/// Qwen3-MoE within 0.5%, Mixtral-like widths grouped +4%, GPT-OSS +5%.
fn moe_acts(spec: &ModelSpec, m: u64, d: &Dims) -> LayerActs {
    let s = d.s;
    let moe = spec.moe.as_ref().expect("sparse layers have a MoE spec");
    let h = spec.hidden_size as u64;
    let e = moe.num_experts as u64;
    let slots = m * moe.top_k as u64;
    let ie = moe.expert_intermediate_size as u64;
    let fused = fused_combine(spec, d);
    // The fused SwiGLU (GPU workers, with the fused combine) keeps its inputs alone.
    let fused_glu = fused && ie.is_multiple_of(8);
    let experts = match moe.names {
        // The fused gate_up and its clamped SwiGLU's output; the one-hot experts the
        // biases are added through.
        ExpertNames::GptOssFused if fused_glu => LayerActs {
            saved: 3 * slots * ie * s + slots * e * s,
            backward: 3 * slots * ie * s,
            forward: slots * ie * s,
        },
        // Fused gate_up, the clamped halves, sigmoid, the GLU and its product; the
        // one-hot experts the biases are added through.
        ExpertNames::GptOssFused => LayerActs {
            saved: 7 * slots * ie * s + slots * e * s,
            backward: 2 * slots * ie * s,
            forward: 3 * slots * ie * s,
        },
        ExpertNames::Mixtral | ExpertNames::Qwen | ExpertNames::DeepSeek
            if fused_glu && spec.hidden_act == Activation::Silu =>
        {
            fused_glu_mlp(slots, ie, s)
        }
        ExpertNames::Mixtral
        | ExpertNames::Qwen
        | ExpertNames::DeepSeek
        | ExpertNames::Llama4Fused => dense_mlp(slots, ie, s),
    };
    let routing = match fused {
        true => LayerActs {
            saved: m * e * (F32 + s) + 2 * slots * h * s + 3 * 8 * slots,
            backward: 2 * slots * h * s,
            forward: m * h * s,
        },
        false => LayerActs {
            saved: m * e * (F32 + s) + 2 * slots * h * s + 2 * 8 * slots,
            backward: slots * h * (F32 + s),
            forward: slots * h * (F32 + 3 * s),
        },
    };
    let shared = moe
        .shared_expert_intermediate_size
        .map(|i| dense_mlp(m, i as u64, s))
        .unwrap_or_default();
    experts + routing + shared
}

/// Whether GPU workers combine the experts' outputs with the fused kernels
/// (worker/src/model/experts.rs `fused_combine`: bf16, H a multiple of 8). The worker's
/// `MT_MOE_COMBINE` (a comparison hook) can choose otherwise.
fn fused_combine(spec: &ModelSpec, d: &Dims) -> bool {
    d.gpu && d.bf16 && spec.hidden_size.is_multiple_of(8)
}

/// Elements per token a GPU worker's Gated DeltaNet keeps of its causal conv for the
/// backward: the conv's output and its SiLU in tch ops; neither with the fused kernel
/// (worker/src/kernels/cuda.rs `supports`: bf16, 4 taps, q, k and v heads alike of 32, 64,
/// 128 or 256), whose outputs, v and the normed [q; k], are all it leaves (the normed
/// [q; k] is counted with the rule's inputs). The worker's `MT_GATED_DELTA_FUSED=0` (a
/// comparison hook) runs the tch ops.
fn conv_kept(spec: &ModelSpec, d: &Dims) -> u64 {
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (g, nv) = (la.num_k_heads as u64, la.num_v_heads as u64);
    let (dk, dv) = (la.k_head_dim as u64, la.v_head_dim as u64);
    let fused =
        d.gpu && d.bf16 && la.conv_kernel == 4 && dk == dv && [32, 64, 128, 256].contains(&dk);
    match fused {
        true => nv * dv,
        false => 2 * (2 * g * dk + nv * dv),
    }
}

/// Elements per token a GPU worker's gated norm keeps for the backward, in the compute
/// dtype and in f32: its four (B, T, V, Dv) tensors in torch's ops; as one kernel
/// (worker/src/kernels/norm.rs: bf16, Dv of 32 to 256) the rows' rstd only. The worker's
/// `MT_GATED_DELTA_FUSED=0` (a comparison hook) runs torch's ops.
fn gated_norm_kept(d: &Dims, nv: u64, dv: u64) -> (u64, u64) {
    match d.bf16 && [32, 64, 128, 256].contains(&dv) {
        true => (0, nv),
        false => (4 * nv * dv, 0),
    }
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
    if d.gpu {
        // Per token: the projections, the conv's output and its SiLU (the fused conv keeps
        // neither: its outputs, v and the normed [q; k], are counted below); the normed
        // [q; k] and its q.k / k.k; per value head the scaled k (three), beta v, w, v' and
        // the gated norm's four (B, T, V, Dv) tensors (its rstd where fused, below); the
        // pairs' decay (f32 and a copy),
        // the inverse T and T (A - A') (f32: the inverse runs without grad, its gradient
        // through those two products), T and P in the compute dtype; the state at each
        // chunk start (f32: the recurrence's written-out backward keeps no copy in the
        // compute dtype; the worker's `MT_GATED_DELTA_RECURRENCE=autograd`, a comparison
        // hook, would). The forward peaks with the projections, conv, the value-head
        // tensors and three f32 pair tensors alive.
        let (vd, kd, pairs) = (nv * dv, nv * dk, nv * DELTA_CHUNK);
        let states = nv * dk * dv / DELTA_CHUNK;
        let conv_kept = conv_kept(spec, d);
        let (gated, gated_f32) = gated_norm_kept(d, nv, dv);
        let in_dtype =
            conv_kept + 2 * g * dk + 2 * g * DELTA_CHUNK + 5 * kd + 2 * vd + gated + 3 * pairs;
        return LayerActs {
            saved: proj + m * in_dtype * s + m * (4 * pairs + states + gated_f32) * F32,
            backward: 2 * m * conv * s + 4 * m * pairs * F32,
            forward: proj + m * (conv_kept.max(conv) + 5 * vd) * s + 3 * m * pairs * F32,
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

/// A Gated DeltaNet layer's attention half with its delta rule in segments of `seg` tokens
/// per row (worker/src/segments.rs), over the whole micro-batch. Whole-sequence: the norm,
/// the pre part's graph (projections, conv, q/k norms, gates) with its outputs, o, the
/// post part's graph (gated norm) and the state at each segment's start; through the
/// backward also the pre outputs' gradients, o's and z's. Per segment (B x `seg` tokens):
/// the rule's graph with its backward's temporaries. The post graph is counted beside the
/// segments although its backward frees it before them (a little over).
pub(super) fn delta_half_segmented(spec: &ModelSpec, d: &Dims, seg: u64) -> LayerActs {
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (nv, dk, dv) = (
        la.num_v_heads as u64,
        la.k_head_dim as u64,
        la.v_head_dim as u64,
    );
    let whole = delta_parts(spec, d, d.m);
    let one = delta_parts(spec, d, d.b * seg);
    let states = d.t.div_ceil(seg) * d.b * nv * dk * dv * F32;
    let z = d.m * nv * dv * d.s;
    LayerActs {
        saved: whole.pre_saved + whole.o + whole.post_saved + states,
        backward: whole.pre_out + whole.o + z + (one.core_graph).max(whole.pre_backward),
        forward: whole.pre_saved + whole.o + one.core_forward,
    } + norms(spec, d.m, d)
}

/// Gated DeltaNet over `m` tokens in its three parts (worker/src/model/gated_delta/), from
/// the same terms as [`delta_acts`].
struct DeltaParts {
    /// pre's saved tensors, its outputs included.
    pre_saved: u64,
    /// pre's outputs (the size of their gradients).
    pre_out: u64,
    /// pre's backward temporaries.
    pre_backward: u64,
    /// The rule's graph with its backward's temporaries.
    core_graph: u64,
    /// The rule's no-grad temporaries.
    core_forward: u64,
    /// The rule's output o.
    o: u64,
    /// post's saved tensors.
    post_saved: u64,
}

fn delta_parts(spec: &ModelSpec, d: &Dims, m: u64) -> DeltaParts {
    let s = d.s;
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (g, nv) = (la.num_k_heads as u64, la.num_v_heads as u64);
    let (dk, dv) = (la.k_head_dim as u64, la.v_head_dim as u64);
    let conv = 2 * g * dk + nv * dv;
    let proj = m * (conv + nv * dv + 2 * nv) * s;
    let gates = 2 * m * nv * F32;
    if d.gpu {
        // As `delta_acts`: pre holds the projections, the conv's output and its SiLU, the
        // normed [q; k]; the rule q.k and k.k, the scaled k (five value-head tensors with
        // w), beta v and v', the pair tensors and the states at chunk starts; post the gated
        // norm's four (B, T, V, Dv) tensors.
        let (vd, kd, pairs) = (nv * dv, nv * dk, nv * DELTA_CHUNK);
        let states = nv * dk * dv / DELTA_CHUNK;
        let core_in_dtype = 2 * g * DELTA_CHUNK + 5 * kd + 2 * vd + 3 * pairs + states;
        let conv_kept = conv_kept(spec, d);
        return DeltaParts {
            pre_saved: proj + m * (conv_kept + 2 * g * dk) * s + gates,
            pre_out: m * (2 * g * dk + vd) * s + gates,
            pre_backward: 2 * m * conv * s,
            core_graph: m * core_in_dtype * s + m * (8 * pairs + states) * F32,
            core_forward: m * 5 * vd * s + 3 * m * pairs * F32,
            o: m * vd * s,
            post_saved: 4 * m * vd * s,
        };
    }
    // The reference path: f32 q, k, v per value head out of pre; the rule's copies of them
    // (beta-scaled, solved, decayed) and the chunk-pair matrices; the gated norm.
    let conv_out = 2 * m * conv * s;
    let per_head = m * nv * (2 * dk + dv) * F32;
    let pairs = 3 * m * nv * DELTA_CHUNK * F32;
    DeltaParts {
        pre_saved: proj + conv_out + 2 * per_head + gates,
        pre_out: per_head + gates,
        pre_backward: 2 * per_head,
        core_graph: 6 * per_head + pairs,
        core_forward: 3 * per_head + pairs,
        o: m * nv * dv * F32,
        post_saved: 3 * m * nv * dv * F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::hf::HfConfig;

    fn spec(dir: &str) -> ModelSpec {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs")
            .join(dir)
            .join("config.json");
        let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        ModelSpec::from_hf(&hf, &path).unwrap()
    }

    fn dims(gpu: bool, bf16: bool) -> Dims {
        let (b, t) = (8, 1024);
        Dims {
            b,
            t,
            m: b * t,
            s: if bf16 { 2 } else { 4 },
            gpu,
            bf16,
            packed: false,
        }
    }

    /// The `1 + w` norm over a half's input runs as one kernel on GPU workers in bf16
    /// (worker/src/kernels/norm.rs) and keeps its bf16 output and the rows' rstd, not an
    /// f32 copy of its input: Qwen3.5 (one norm a half) keeps M H 4 - M 4 bytes fewer than
    /// with torch's ops, and so does Gemma 2 (whose sandwich's second norm, over a product,
    /// keeps its copy either way); an f32 run, and a family with the plain norm, keep theirs.
    #[test]
    fn the_fused_plus_one_norm_keeps_no_f32_copy() {
        let torch_ops = |spec: &ModelSpec, d: &Dims| {
            let h = spec.hidden_size as u64;
            d.m * h * (F32 + d.s)
        };
        for dir in ["qwen3.5-27b", "gemma2-9b"] {
            let s = spec(dir);
            let (gpu, cpu) = (dims(true, true), dims(false, true));
            let h = s.hidden_size as u64;
            let fewer = norms(&s, gpu.m, &cpu).saved - norms(&s, gpu.m, &gpu).saved;
            assert_eq!(fewer, gpu.m * h * F32 - gpu.m * F32, "{dir}");
            let f32_gpu = dims(true, false);
            let per_half = norms(&s, f32_gpu.m, &f32_gpu).saved / torch_ops(&s, &f32_gpu);
            assert_eq!(
                per_half,
                if dir == "gemma2-9b" { 2 } else { 1 },
                "{dir} in f32"
            );
        }
        let llama = spec("llama3-8b");
        let d = dims(true, true);
        assert_eq!(norms(&llama, d.m, &d).saved, torch_ops(&llama, &d));
    }

    /// The gated norm of a Gated DeltaNet layer as one kernel keeps the rows' rstd (f32,
    /// one per value head and token) instead of its four (B, T, V, Dv) tensors; value heads
    /// the kernel does not take, and f32 runs, keep the four.
    #[test]
    fn the_fused_gated_norm_keeps_its_rstd_only() {
        let (bf16, f32_) = (dims(true, true), dims(true, false));
        assert_eq!(gated_norm_kept(&bf16, 48, 128), (0, 48));
        assert_eq!(gated_norm_kept(&bf16, 48, 96), (4 * 48 * 96, 0));
        assert_eq!(gated_norm_kept(&f32_, 48, 128), (4 * 48 * 128, 0));
    }
}
