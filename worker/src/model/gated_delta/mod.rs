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
//! `MT_GATED_DELTA=reference|chunked` overrides the choice (parity checks, benchmarks) and
//! `MT_GATED_DELTA_CHUNK` (default 64) sets the chunked path's chunk length.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, G key heads, V value heads,
//! Dk / Dv their head dims, F conv channels (2 G Dk + V Dv).

mod chunked;
mod reference;
#[cfg(test)]
mod tests;

use std::sync::OnceLock;

use mt::config::hf::{LinearAttnSpec, ModelSpec};
use tch::{Device, Kind, Tensor};

use super::BlockWeights;

/// (B, T, H) -> (B, T, H), by the implementation for the input's device.
pub fn forward(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> Tensor {
    let settings = Settings::get();
    match settings.path(x_bth.device()) {
        Rule::Reference => reference::forward(spec, w, x_bth),
        Rule::Chunked => chunked::forward(spec, w, x_bth, settings.chunk),
    }
}

/// The two implementations of the delta rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Reference,
    Chunked,
}

/// The environment's choices, read once per process.
struct Settings {
    /// `MT_GATED_DELTA`; None: by device.
    rule: Option<Rule>,
    /// `MT_GATED_DELTA_CHUNK`: the chunked path's chunk length.
    chunk: i64,
}

impl Settings {
    fn get() -> &'static Settings {
        static SETTINGS: OnceLock<Settings> = OnceLock::new();
        SETTINGS.get_or_init(|| {
            let rule = match std::env::var("MT_GATED_DELTA").as_deref() {
                Err(_) => None,
                Ok("reference") => Some(Rule::Reference),
                Ok("chunked") => Some(Rule::Chunked),
                Ok(other) => {
                    panic!("MT_GATED_DELTA must be `reference` or `chunked`, got `{other}`")
                }
            };
            let chunk = match std::env::var("MT_GATED_DELTA_CHUNK") {
                Err(_) => chunked::CHUNK,
                Ok(s) => s
                    .parse()
                    .ok()
                    .filter(|&c| chunked::chunk_ok(c))
                    .unwrap_or_else(|| {
                        panic!("MT_GATED_DELTA_CHUNK must be 16, 32, 64, 128 or 256, got `{s}`")
                    }),
            };
            Settings { rule, chunk }
        })
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
