//! The reference Gated DeltaNet, as transformers computes it without the
//! flash-linear-attention kernels: q, k, v in f32, each key head repeated for its value
//! heads, and `torch_chunk_gated_delta_rule` (from a given state, zero by default) evaluated
//! chunk by chunk: within a chunk by a unit-triangular solve, across chunks through the
//! (Dk, Dv) state. The CPU path, and what the chunked path is checked against.
//!
//! Shapes: B batch rows, T sequence length (P padded to whole chunks), H hidden size, G key
//! heads, V value heads, Dk / Dv their head dims, C chunk length, U chunks, F conv channels.

use mt::config::hf::{LinearAttnSpec, ModelSpec};
use tch::{Kind, Tensor};

use super::{Pre, gates, short_conv};
use crate::model::BlockWeights;
use crate::model::common::linear;

/// Chunk length of transformers' chunked delta rule.
pub(super) const CHUNK: i64 = 64;

/// (B, T, H) -> the delta rule's inputs, f32, in chunks of 64 tokens along dim 2, each key
/// head repeated for its value heads: q (L2-normed and scaled by Dk^-1/2) and k
/// (L2-normed) (B, V, U, C, Dk), v (B, V, U, C, Dv), beta and the log decay (B, V, U, C),
/// zeros past T; and z.
pub(super) fn pre(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> Pre {
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (b, t) = (x_bth.size()[0], x_bth.size()[1]);
    let (g, v) = (la.num_k_heads as i64, la.num_v_heads as i64);
    let (dk, dv) = (la.k_head_dim as i64, la.v_head_dim as i64);
    let (qkv_btf, z_btvd, b_btv, a_btv) = project(la, w, x_bth);
    let qkv_btf = short_conv(la, w, &qkv_btf, t).transpose(1, 2);
    let q_btgd = qkv_btf.narrow(-1, 0, g * dk).reshape([b, t, g, dk]);
    let k_btgd = qkv_btf.narrow(-1, g * dk, g * dk).reshape([b, t, g, dk]);
    let v_btvd = qkv_btf
        .narrow(-1, 2 * g * dk, v * dv)
        .reshape([b, t, v, dv]);
    let (beta_btv, decay_btv) = gates(w, &b_btv, &a_btv);
    // Each key head serves V/G consecutive value heads.
    let (q_btvd, k_btvd) = if v > g {
        (
            q_btgd.repeat_interleave_self_int(v / g, 2, None),
            k_btgd.repeat_interleave_self_int(v / g, 2, None),
        )
    } else {
        (q_btgd, k_btgd)
    };
    // As `torch_chunk_gated_delta_rule` prepares them: f32 (B, V, T, D), q and k L2-normed,
    // padded to whole chunks.
    let f32 = |x: &Tensor| x.transpose(1, 2).to_kind(Kind::Float).contiguous();
    let q = l2norm(&f32(&q_btvd)) * (dk as f64).powf(-0.5);
    let k = l2norm(&f32(&k_btvd));
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let u = (t + pad) / CHUNK;
    let chunks = |x: &Tensor, d: i64| {
        x.constant_pad_nd([0, 0, 0, pad])
            .reshape([b, v, u, CHUNK, d])
    };
    let gate = |x: &Tensor| f32(x).constant_pad_nd([0, pad]).reshape([b, v, u, CHUNK]);
    Pre {
        rule_in: vec![
            chunks(&q, dk),
            chunks(&k, dk),
            chunks(&f32(&v_btvd), dv),
            gate(&beta_btv),
            gate(&decay_btv),
        ],
        z_btvd,
    }
}

/// The gated RMSNorm per value head, then out_proj: o (B, V, U, C, Dv) f32 and z (B, T,
/// V, Dv) -> (B, T, H).
pub(super) fn post(
    spec: &ModelSpec,
    w: &BlockWeights,
    o_bvucd: &Tensor,
    z_btvd: &Tensor,
) -> Tensor {
    let &[b, v, u, c, dv] = o_bvucd.size().as_slice() else {
        panic!("o is (B, V, U, C, Dv)")
    };
    let t = z_btvd.size()[1];
    let o_btvd = o_bvucd
        .reshape([b, v, u * c, dv])
        .narrow(2, 0, t)
        .transpose(1, 2)
        .to_kind(z_btvd.kind())
        .contiguous();
    let o_btvd = gated_rms_norm(
        &o_btvd,
        z_btvd,
        w.get("linear_attn.norm.weight"),
        spec.rms_norm_eps,
    );
    linear(&o_btvd.reshape([b, t, v * dv]), w, "linear_attn.out_proj")
}

/// The input projections: conv input [q; k; v] (B, T, F), z (B, T, V, Dv), b and a (B, T, V).
/// Qwen3-Next's fused projections are grouped by key head: per head, Dk query, Dk key,
/// (V/G)*Dv value and (V/G)*Dv z columns, and (V/G) b then (V/G) a columns.
fn project(
    la: &LinearAttnSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
) -> (Tensor, Tensor, Tensor, Tensor) {
    let (b, t) = (x_bth.size()[0], x_bth.size()[1]);
    let (g, v) = (la.num_k_heads as i64, la.num_v_heads as i64);
    let (dk, dv, r) = (la.k_head_dim as i64, la.v_head_dim as i64, v / g);
    if !la.fused_qkvz {
        let qkv_btf = linear(x_bth, w, "linear_attn.in_proj_qkv");
        let z_btvd = linear(x_bth, w, "linear_attn.in_proj_z").reshape([b, t, v, dv]);
        let b_btv = linear(x_bth, w, "linear_attn.in_proj_b");
        let a_btv = linear(x_bth, w, "linear_attn.in_proj_a");
        return (qkv_btf, z_btvd, b_btv, a_btv);
    }
    let qkvz_btgf =
        linear(x_bth, w, "linear_attn.in_proj_qkvz").view([b, t, g, 2 * dk + 2 * r * dv]);
    let ba_btgf = linear(x_bth, w, "linear_attn.in_proj_ba").view([b, t, g, 2 * r]);
    let q = qkvz_btgf.narrow(-1, 0, dk).reshape([b, t, g * dk]);
    let k = qkvz_btgf.narrow(-1, dk, dk).reshape([b, t, g * dk]);
    let val = qkvz_btgf.narrow(-1, 2 * dk, r * dv).reshape([b, t, v * dv]);
    let z_btvd = qkvz_btgf
        .narrow(-1, 2 * dk + r * dv, r * dv)
        .reshape([b, t, v, dv]);
    let b_btv = ba_btgf.narrow(-1, 0, r).reshape([b, t, v]);
    let a_btv = ba_btgf.narrow(-1, r, r).reshape([b, t, v]);
    (Tensor::cat(&[q, k, val], -1), z_btvd, b_btv, a_btv)
}

/// `w * norm(o).to(dtype) * silu(z)` per value head, in f32 then cast: (B, T, V, Dv).
fn gated_rms_norm(o_btvd: &Tensor, z_btvd: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let of = o_btvd.to_kind(Kind::Float);
    let var = of.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let normed = w * (of * (var + eps).rsqrt()).to_kind(o_btvd.kind());
    (normed * z_btvd.to_kind(Kind::Float).silu()).to_kind(o_btvd.kind())
}

/// `x / sqrt(sum(x^2) + 1e-6)` over the last dim.
fn l2norm(x: &Tensor) -> Tensor {
    x * ((x * x).sum_dim_intlist(-1, true, Kind::Float) + 1e-6).rsqrt()
}

/// The gated delta rule over the U chunks of `rule_in` ([`pre`]'s q, k, v, beta, decay, or
/// a range of their chunks), as `torch_chunk_gated_delta_rule` evaluates it, from the state
/// S (B, V, Dk, Dv) f32 at the first chunk's start (None: zero) -> o (B, V, U, C, Dv) f32
/// and, if `want_state`, the state after the last chunk.
pub(super) fn core(
    rule_in: &[Tensor],
    state_bvkd: Option<&Tensor>,
    want_state: bool,
) -> (Tensor, Option<Tensor>) {
    let [q, k, v, beta_bvuc, decay_bvuc] = rule_in else {
        panic!("the reference rule takes [q, k, v, beta, decay]")
    };
    let &[b, nv, u, c, dk] = q.size().as_slice() else {
        panic!("q is (B, V, U, C, Dk)")
    };
    let dv = v.size()[4];
    let v_beta = v * beta_bvuc.unsqueeze(-1);
    let k_beta = k * beta_bvuc.unsqueeze(-1);
    let cum_bvuc = decay_bvuc.cumsum(-1, Kind::Float);

    // exp(cum_i - cum_j) for j <= i, 0 above the diagonal: (B, V, U, C, C).
    let upper_cc = Tensor::ones([c, c], (Kind::Bool, q.device())).triu(1);
    let pair = (cum_bvuc.unsqueeze(-1) - cum_bvuc.unsqueeze(-2))
        .masked_fill(&upper_cc, f64::NEG_INFINITY)
        .exp();
    let kt = k.transpose(-1, -2);
    let ut_system = k_beta.matmul(&kt) * &pair;
    let intra = q.matmul(&kt) * &pair;
    let decayed_k_beta = &k_beta * cum_bvuc.exp().unsqueeze(-1);
    let new_values = ut_system.linalg_solve_triangular(&v_beta, false, true, true);
    let k_cumdecay = ut_system.linalg_solve_triangular(&decayed_k_beta, false, true, true);

    let q = q * cum_bvuc.exp().unsqueeze(-1);
    let last = cum_bvuc.narrow(-1, c - 1, 1);
    let k = k * (&last - &cum_bvuc).exp().unsqueeze(-1);
    let chunk_decay = last.exp().unsqueeze(-1); // (B, V, U, 1, 1)
    let mut state = match state_bvkd {
        Some(s) => s.shallow_clone(),
        None => Tensor::zeros([b, nv, dk, dv], (Kind::Float, q.device())),
    };
    let mut outs = Vec::with_capacity(u as usize);
    for i in 0..u {
        let v_new = new_values.select(2, i) - k_cumdecay.select(2, i).matmul(&state);
        let inter = q.select(2, i).matmul(&state);
        outs.push(inter + intra.select(2, i).matmul(&v_new));
        if i + 1 < u || want_state {
            state =
                state * chunk_decay.select(2, i) + k.select(2, i).transpose(-1, -2).matmul(&v_new);
        }
    }
    (Tensor::stack(&outs, 2), want_state.then_some(state))
}
