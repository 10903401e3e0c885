//! Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), as transformers'
//! `*GatedDeltaNet` computes it: projections to q, k, v, the output gate z and the per-head b
//! (write strength) and a (decay rate); a depthwise causal convolution with SiLU over q, k,
//! v; L2-normed q and k; the gated delta rule (state S (Dk, Dv) per value head decays by
//! exp(g_t), then `S += k_t beta_t (v_t - S^T k_t)^T`, `o_t = S^T q_t / sqrt(Dk)`); a gated
//! RMSNorm `w * norm(o) * silu(z)` per value head; out_proj.
//!
//! The delta rule has two implementations of the same math, chosen by device:
//!
//! | file          | computes the rule                                             | used on |
//! |---------------|---------------------------------------------------------------|---------|
//! | `reference.rs`| as transformers' `torch_chunk_gated_delta_rule`: f32, chunk by chunk | CPU     |
//! | `chunked.rs`  | as flash-linear-attention's chunked kernels: WY / UT transform batched over all chunks, bf16 matmuls, one short loop for the state | CUDA    |
//!
//! `MT_GATED_DELTA=reference|chunked` overrides the choice (parity checks, benchmarks),
//! `MT_GATED_DELTA_CHUNK` (default 64) sets the chunked path's chunk length, and
//! `MT_GATED_DELTA_FUSED=0` keeps the chunked path's causal conv, SiLU and q/k norms, and
//! its gated norm, in tch ops on CUDA instead of the fused kernels (`crate::kernels::conv_qkv`
//! and `crate::kernels::gated_norm`, whose backwards run from the tape:
//! `crate::kernels::tape`), and `MT_GATED_DELTA_FUSED=1` runs them everywhere (on CPU
//! their mirrors: tests); `MT_GATED_DELTA_RECURRENCE=autograd` runs the
//! chunked path's state recurrence through autograd instead of its written-out backward
//! (`recurrence.rs`).
//!
//! Either comes in three parts, [`pre`] (token-local but for the causal conv), [`core`]
//! (the delta rule over a range of chunks, from the state at its start to the state at its
//! end) and [`post`] (gated norm, out_proj); [`forward`] composes them over the whole
//! sequence, and worker/src/segments.rs runs the core in segments of chunks, so that the
//! rule's recompute graph (its (C, C) pair tensors, its per-value-head copies) is one
//! segment's at a time.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, G key heads, V value heads,
//! Dk / Dv their head dims, F conv channels (2 G Dk + V Dv).

mod chunked;
mod recurrence;
mod reference;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use mt::config::hf::{LinearAttnSpec, ModelSpec};
use mt::switches::DeltaRule;
use tch::{Device, Kind, Tensor};

use super::BlockWeights;

/// (B, T, H) -> (B, T, H), by the implementation for the input's device: [`pre`], [`core`]
/// over every chunk from a zero state, [`post`].
pub fn forward(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> Tensor {
    let pre = pre(spec, w, x_bth);
    let (o_bvucd, _) = core(&pre.rule_in, None, false);
    post(spec, w, &o_bvucd, &pre.z_btvd)
}

/// What the mixer computes before the delta rule, token by token (but for the causal
/// conv): the rule's inputs and the output gate.
pub struct Pre {
    /// The delta rule's inputs in its implementation's layout and dtype, each (B, heads,
    /// U, ...) with the U chunks along dim 2, so that a range of chunks is a `narrow` of
    /// each (`reference::pre`, `chunked::pre` name them).
    pub rule_in: Vec<Tensor>,
    /// The output gate z (B, T, V, Dv).
    pub z_btvd: Tensor,
}

impl Pre {
    /// The number of chunks U.
    pub fn chunks(&self) -> i64 {
        self.rule_in[0].size()[2]
    }
}

/// Tokens per chunk of the delta rule on `device`.
pub fn chunk_tokens(device: Device) -> i64 {
    let settings = Settings::get();
    match settings.path(device) {
        Rule::Reference => reference::CHUNK,
        Rule::Chunked => settings.chunk,
    }
}

/// The input projections, the causal conv + SiLU, q/k L2 norms, beta and the log decay:
/// (B, T, H) -> the delta rule's inputs and z.
pub fn pre(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> Pre {
    let settings = Settings::get();
    match settings.path(x_bth.device()) {
        Rule::Reference => reference::pre(spec, w, x_bth),
        Rule::Chunked => {
            let fused = settings.fused(x_bth.device());
            chunked::pre(spec, w, x_bth, settings.chunk, fused)
        }
    }
}

/// The delta rule over the chunks of `rule_in` ([`Pre::rule_in`], or the same `narrow` of
/// each: a range of chunks), from the state S (B, V, Dk, Dv) f32 at their start (None:
/// zero) -> o (B, V, U, C, Dv) and, if `want_state`, the state S after their last chunk,
/// from which the next range of chunks goes on.
pub fn core(
    rule_in: &[Tensor],
    state_bvkd: Option<&Tensor>,
    want_state: bool,
) -> (Tensor, Option<Tensor>) {
    match Settings::get().path(rule_in[0].device()) {
        Rule::Reference => reference::core(rule_in, state_bvkd, want_state),
        Rule::Chunked => chunked::core(rule_in, state_bvkd, want_state),
    }
}

/// The gated RMSNorm per value head and out_proj: o (B, V, U, C, Dv) over every chunk and
/// z (B, T, V, Dv) -> (B, T, H).
pub fn post(spec: &ModelSpec, w: &BlockWeights, o_bvucd: &Tensor, z_btvd: &Tensor) -> Tensor {
    match Settings::get().path(o_bvucd.device()) {
        Rule::Reference => reference::post(spec, w, o_bvucd, z_btvd),
        Rule::Chunked => {
            // The fused gated norm hands z its gradient from the tape: z must be behind the
            // [z; b; a] boundary, which the taped recurrence sets.
            let settings = Settings::get();
            let fused = settings.fused(o_bvucd.device()) && recurrence::taped();
            chunked::post(spec, w, o_bvucd, z_btvd, fused)
        }
    }
}

/// The two implementations of the delta rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Reference,
    Chunked,
}

/// The environment's choices (`mt::switches`), once per process.
struct Settings {
    /// `MT_GATED_DELTA`; None: by device.
    rule: Option<Rule>,
    /// `MT_GATED_DELTA_CHUNK`: the chunked path's chunk length.
    chunk: i64,
    /// `MT_GATED_DELTA_FUSED`: whether the chunked path fuses its conv and its gated norm;
    /// None (unset): on CUDA, `1` everywhere (on CPU the ops' mirrors), `0` nowhere.
    fused: Option<bool>,
}

impl Settings {
    fn get() -> &'static Settings {
        static SETTINGS: OnceLock<Settings> = OnceLock::new();
        SETTINGS.get_or_init(|| {
            // Checked at start (`mt::switches`): the chunk is one `chunked::chunk_ok` takes.
            let sw = mt::switches::get();
            Settings {
                rule: sw.gated_delta.map(|r| match r {
                    DeltaRule::Reference => Rule::Reference,
                    DeltaRule::Chunked => Rule::Chunked,
                }),
                chunk: sw.gated_delta_chunk.unwrap_or(chunked::CHUNK),
                fused: sw.gated_delta_fused,
            }
        })
    }

    /// Whether the chunked path fuses its conv and gated norm on `device`.
    fn fused(&self, device: Device) -> bool {
        self.fused.unwrap_or(device.is_cuda())
    }

    fn path(&self, device: Device) -> Rule {
        self.rule.unwrap_or(match device {
            Device::Cuda(_) => Rule::Chunked,
            _ => Rule::Reference,
        })
    }
}

/// The depthwise causal convolution over the F channels of [q; k; v], then SiLU:
/// (B, T, F) -> (B, F, len); output position i sees inputs i-K+1..=i, and positions past T
/// (len > T) see zeros beyond the end.
fn short_conv(la: &LinearAttnSpec, w: &BlockWeights, qkv_btf: &Tensor, len: i64) -> Tensor {
    let (t, kernel) = (qkv_btf.size()[1], la.conv_kernel as i64);
    // Symmetric padding: K-1 before the first input, enough after the last one for `len`.
    let pad = (kernel - 1).max(len - t);
    qkv_btf
        .transpose(1, 2)
        .conv1d(
            w.get("linear_attn.conv1d.weight"),
            None::<Tensor>,
            [1],
            [pad],
            [1],
            la.conv_dim() as i64,
        )
        .narrow(2, pad - kernel + 1, len)
        .silu()
}

/// Per value head, f32 (B, T, V): the write strength beta = sigmoid(b) (in the compute
/// dtype, then f32, as transformers) and the log decay g = -exp(A_log) softplus(a + dt_bias).
fn gates(w: &BlockWeights, b_btv: &Tensor, a_btv: &Tensor) -> (Tensor, Tensor) {
    let beta_btv = b_btv.sigmoid().to_kind(Kind::Float);
    let g_btv = -w.get("linear_attn.A_log").to_kind(Kind::Float).exp()
        * (a_btv.to_kind(Kind::Float) + w.get("linear_attn.dt_bias")).softplus();
    (beta_btv, g_btv)
}
