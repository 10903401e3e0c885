//! Attention with a learned sink logit per head (GPT-OSS) through FlashAttention, as one op
//! ([`sink_attention`]).
//!
//! transformers computes it eagerly: each row of masked scores gets one more column, the
//! head's sink, and that column's probability is dropped after the softmax. Those (B, N, T,
//! T) scores, their softmax and gradients are most of a GPT-OSS layer's memory and time.
//! The same function, written with the plain attention's output o and its rows' log-sum-exp
//! L (natural log of the scaled scores' sum of exps):
//!
//! ```text
//! y = o * s,  s = exp(L) / (exp(L) + exp(sink)) = sigmoid(L - sink)
//! ```
//!
//! FlashAttention gives o and L. The backward, from dy: ds = sum_d dy * o per row;
//! do = s dy; the gradient reaching L is g = ds s (1 - s), and d sink = -sum g over
//! rows. A score's gradient is p (dp - D + g) (p = exp(score - L), dp = do . v), where the
//! plain backward's D is the row's sum_d do * o. Since D - g = s^2 ds = sum_d do * y, the
//! flash backward run with `out` = y instead of o (it reads `out` only for D) gives dq, dk
//! and dv exactly.
//!
//! On CPU the mirror computes o and L and the flash backward's contract in torch's ops, in
//! f32 (the spec the GPU path is checked against, and the path golden runs through the
//! tape with `MT_ATTENTION_SINKS=fused`).

use tch::{Device, Kind, Tensor};

use super::cuda::{self, FlashSaved};
use super::tape;

/// Whether attention with sinks takes [`sink_attention`] for heads of `d` dims of `kind` on
/// `device`: by default on CUDA in bf16; `MT_ATTENTION_SINKS=fused` forces it (the mirror on
/// CPU), `plain` transformers' eager attention in tch ops.
pub fn sink_attention_enabled(kind: Kind, d: i64, device: Device) -> bool {
    let on = super::fused_by_default(mt::switches::get().fused.attention_sinks, kind, device);
    on && match device {
        Device::Cuda(_) => cuda::flash_supports(kind, d),
        _ => true,
    }
}

/// Causal attention of q (B, N, T, D) over k and v (B, K, T, D) (K dividing N; any strides,
/// D's best 1), each query seeing keys at most `window` positions back (None: all), with
/// the scores scaled by `scale` and each head's softmax joined by its sink logit `sinks`
/// (N) -> (B, N, T, D), laid out as (B, T, N, D) (merging the heads is then free).
///
/// With grad, the output is a leaf and the backward (into q's, k's and v's graphs and the
/// sinks) waits on the tape.
pub fn sink_attention(
    q_bntd: &Tensor,
    k_bktd: &Tensor,
    v_bktd: &Tensor,
    sinks: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> Tensor {
    let _guard = tch::no_grad_guard();
    let kind = q_bntd.kind();
    let heads = |x: &Tensor| {
        let x = x.detach().transpose(1, 2);
        if x.stride()[3] == 1 {
            x
        } else {
            x.contiguous()
        }
    };
    let (q, k, v) = (heads(q_bntd), heads(k_bktd), heads(v_bktd));
    let (o, saved) = match q.device() {
        Device::Cuda(_) => {
            let (o, saved) = cuda::flash_fwd(&q, &k, &v, scale, window)
                .unwrap_or_else(|e| panic!("sink attention: {e:#}"));
            (o, Saved::Flash(saved))
        }
        _ => {
            let (o, lse) = mirror_fwd(&q, &k, &v, scale, window);
            (o, Saved::Mirror(lse))
        }
    };
    // s = sigmoid(L - sink) per (B, T, N) row.
    let sink_1n1 = sinks.detach().to_kind(Kind::Float).view([1, -1, 1]);
    let s_btn1 = (saved.lse() - sink_1n1)
        .sigmoid()
        .transpose(1, 2)
        .unsqueeze(-1);
    let y_btnd = (o.to_kind(Kind::Float) * &s_btn1).to_kind(kind);
    let y_bntd = y_btnd.transpose(1, 2);
    let inputs = [q_bntd, k_bktd, v_bktd, sinks];
    if !inputs.iter().any(|x| x.requires_grad()) {
        return y_bntd;
    }
    let inputs = inputs.map(Tensor::shallow_clone);
    tape::record_one(y_bntd, move |dy_bntd| {
        // The f32 copies go before flash's backward allocates.
        let (ds_btn1, do_btnd) = {
            let dy = dy_bntd.transpose(1, 2).to_kind(Kind::Float);
            let ds = (&dy * o.to_kind(Kind::Float)).sum_dim_intlist(-1, true, Kind::Float);
            (ds, (dy * &s_btn1).to_kind(kind).contiguous())
        };
        let g_btn1: Tensor = ds_btn1 * &s_btn1 * (1.0 - &s_btn1);
        let dsink = -g_btn1.sum_dim_intlist([0i64, 1, 3].as_slice(), false, Kind::Float);
        let (dq, dk, dv) = match &saved {
            Saved::Flash(f) => cuda::flash_bwd(&do_btnd, &q, &k, &v, &y_btnd, f, scale, window)
                .unwrap_or_else(|e| panic!("sink attention backward: {e:#}")),
            Saved::Mirror(lse) => mirror_bwd(&do_btnd, &q, &k, &v, &y_btnd, lse, scale, window),
        };
        let [qi, ki, vi, si] = inputs;
        let dsink = dsink.to_kind(si.kind());
        [
            (qi, dq.transpose(1, 2)),
            (ki, dk.transpose(1, 2)),
            (vi, dv.transpose(1, 2)),
            (si, dsink),
        ]
        .into_iter()
        .filter(|(x, _)| x.requires_grad())
        .collect()
    })
}

/// The forward's rows' log-sum-exp and, on CUDA, what flash's backward takes back.
enum Saved {
    Flash(FlashSaved),
    /// (B, N, T) f32.
    Mirror(Tensor),
}

impl Saved {
    fn lse(&self) -> &Tensor {
        match self {
            Saved::Flash(f) => &f.lse,
            Saved::Mirror(lse) => lse,
        }
    }
}

/// True where query i may see key j: j <= i, and i - j <= window where there is one: (T, T).
fn allowed_tt(t: i64, window: Option<i64>, device: Device) -> Tensor {
    let i_t1 = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
    let j_1t = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    let causal = j_1t.le_tensor(&i_t1);
    match window {
        Some(w) => causal.logical_and(&(i_t1 - j_1t).le(w)),
        None => causal,
    }
}

/// (B, T, heads, D) in any dtype -> (B, N, T, D) f32, each of the K key/value heads
/// repeated for its N/K query heads.
fn bn_f32(x_btkd: &Tensor, n: i64) -> Tensor {
    let x = x_btkd.to_kind(Kind::Float).transpose(1, 2);
    let s = x.size();
    let rep = n / s[1];
    x.unsqueeze(2)
        .expand([s[0], s[1], rep, s[2], s[3]], false)
        .reshape([s[0], n, s[2], s[3]])
}

/// The scaled, masked scores (B, N, T, T) f32.
fn scores(q_bntd: &Tensor, k_bntd: &Tensor, scale: f64, window: Option<i64>) -> Tensor {
    let t = q_bntd.size()[2];
    (q_bntd.matmul(&k_bntd.transpose(2, 3)) * scale).masked_fill(
        &allowed_tt(t, window, q_bntd.device()).logical_not(),
        f64::NEG_INFINITY,
    )
}

/// Flash's forward in tch ops, f32 inside: (o (B, T, N, D) in q's dtype, L (B, N, T) f32).
fn mirror_fwd(
    q_btnd: &Tensor,
    k_btkd: &Tensor,
    v_btkd: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> (Tensor, Tensor) {
    let n = q_btnd.size()[2];
    let q = bn_f32(q_btnd, n);
    let s = scores(&q, &bn_f32(k_btkd, n), scale, window);
    let lse_bnt = s.logsumexp([-1i64].as_slice(), false);
    let p = (s - lse_bnt.unsqueeze(-1)).exp();
    let o = p.matmul(&bn_f32(v_btkd, n)).transpose(1, 2);
    (o.to_kind(q_btnd.kind()), lse_bnt)
}

/// Flash's backward contract in tch ops, f32 inside: from do and `out` (B, T, N, D) and
/// the forward's L, each score's gradient p (dp - D) with D = sum_d do * out per row;
/// (dq (B, T, N, D), dk and dv (B, T, K, D)) in q's dtype.
#[allow(clippy::too_many_arguments)]
fn mirror_bwd(
    do_btnd: &Tensor,
    q_btnd: &Tensor,
    k_btkd: &Tensor,
    v_btkd: &Tensor,
    out_btnd: &Tensor,
    lse_bnt: &Tensor,
    scale: f64,
    window: Option<i64>,
) -> (Tensor, Tensor, Tensor) {
    let (n, kv) = (q_btnd.size()[2], k_btkd.size()[2]);
    let (q, k, v) = (bn_f32(q_btnd, n), bn_f32(k_btkd, n), bn_f32(v_btkd, n));
    let d_o = bn_f32(do_btnd, n);
    let p = (scores(&q, &k, scale, window) - lse_bnt.unsqueeze(-1)).exp();
    let dv = p.transpose(2, 3).matmul(&d_o);
    let dp = d_o.matmul(&v.transpose(2, 3));
    let rows = (&d_o * bn_f32(out_btnd, n)).sum_dim_intlist(-1, true, Kind::Float);
    let ds = p * (dp - rows) * scale;
    let dq = ds.matmul(&k);
    let dk = ds.transpose(2, 3).matmul(&q);
    // Each key/value head's gradient sums over its query heads: (B, N, T, D) -> (B, T, K, D).
    let fold = |x: Tensor| {
        let s = x.size();
        x.view([s[0], kv, n / kv, s[2], s[3]])
            .sum_dim_intlist(2, false, Kind::Float)
            .transpose(1, 2)
            .to_kind(q_btnd.kind())
    };
    (
        dq.transpose(1, 2).to_kind(q_btnd.kind()),
        fold(dk),
        fold(dv),
    )
}
