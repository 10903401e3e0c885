//! The chunked Gated DeltaNet, as flash-linear-attention's `chunk_gated_delta_rule` computes
//! it (the WY representation of the delta rule, built by the UT transform), in batched tch
//! ops. Per chunk of C tokens, with gamma the chunk-local cumulative log decay and beta the
//! write strength:
//!
//! ```text
//! A = strictly_lower(beta_i k_i.k_j exp(gamma_i - gamma_j)),   T = (I + A)^-1
//! w = T (beta exp(gamma) k),   u = T (beta v)                    (the UT transform)
//! P = lower(q_i.k_j exp(gamma_i - gamma_j))                      (attention inside the chunk)
//! ```
//!
//! and from the state S (Dk, Dv) at the chunk's start (0 for the first chunk):
//!
//! ```text
//! v' = u - w S,   o = exp(gamma) q S + P v',   S <- exp(gamma_C) S + (exp(gamma_C - gamma) k)^T v'
//! ```
//!
//! Everything but the state update is batched over all chunks at once: (B, V, U, C, C) and
//! (B, V, U, C, D) matmuls in the compute dtype (bf16 on GPU, accumulating in f32), with
//! the gates, A and its inverse in f32 as flash-linear-attention keeps them. Only the state
//! recurrence loops over the U chunks, a few (B V)-batched matmuls each, the state in f32.
//! q.k and k.k are computed once per key head and shared by its value heads; v's SiLU
//! output is read once, by the beta scaling. Autograd differentiates the batched part; the
//! recurrence's backward is written out (`recurrence.rs`, run from the kernels' tape, with
//! boundaries at the mixer's input and at [z; b; a] so that autograd's pass, which reaches
//! that projection through z, and the tape's, through b and a, meet there once);
//! `MT_GATED_DELTA_RECURRENCE=autograd` differentiates the loop with autograd instead.
//!
//! Shapes: B batch rows, T sequence length, P = U C padded to whole chunks, G key heads,
//! V value heads (r = V / G per key head; value head g r + j reads key head g), Dk / Dv
//! head dims. Suffixes name the dims: `_bgucd` per key head, `_bvucd` per value head,
//! `_bvucc` pairs of a chunk's positions.

use mt::config::hf::{LinearAttnSpec, ModelSpec};
use tch::{Kind, Tensor};

use super::{Pre, gates, recurrence, short_conv};
use crate::kernels;
use crate::model::BlockWeights;
use crate::model::common::linear;

/// flash-linear-attention's chunk length (and transformers').
pub(super) const CHUNK: i64 = 64;
/// Side of the diagonal blocks that `unit_lower_inverse` inverts directly.
const BLOCK: i64 = 16;

/// Chunk lengths `unit_lower_inverse` handles: 16 * 2^k, up to 256.
pub(super) fn chunk_ok(c: i64) -> bool {
    (BLOCK..=256).contains(&c) && c % BLOCK == 0 && (c / BLOCK).count_ones() == 1
}

/// (B, T, H) -> the delta rule's inputs in chunks of `chunk` tokens (`chunk_ok`), each
/// with its chunks along dim 2: [q; k] per key head, L2-normed (q also by Dk^-1/2), as one
/// (2C, Dk) matrix per chunk (B, G, U, 2C, Dk); v (B, V, U, C, Dv); beta and the log decay
/// g, f32 (B, V, U, C), zeros past T; and z. With `fused`, the conv, SiLU and norms run as
/// one fused op (`kernels::conv_qkv`) where it runs for this shape, device and dtype.
pub(super) fn pre(
    spec: &ModelSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
    chunk: i64,
    fused: bool,
) -> Pre {
    assert!(chunk_ok(chunk), "chunk length {chunk}");
    let la = spec
        .linear_attn
        .as_ref()
        .expect("linear layers have a spec");
    let (b, t) = (x_bth.size()[0], x_bth.size()[1]);
    let (g, nv) = (la.num_k_heads as i64, la.num_v_heads as i64);
    let (dk, dv) = (la.k_head_dim as i64, la.v_head_dim as i64);
    let (u, c) = ((t + chunk - 1) / chunk, chunk);
    let p = u * c;
    let conv = kernels::ConvQkv {
        g,
        v: nv,
        dk,
        dv,
        taps: la.conv_kernel as i64,
        chunk: c,
        chunks: u,
    };
    let fused = fused && kernels::conv_qkv_supported(&conv, x_bth.kind(), x_bth.device());
    // The fused conv's and the recurrence's backwards reach x through the tape, after
    // autograd's pass: behind boundaries at x and at [z; b; a], which autograd's pass reaches
    // through z alone.
    let taped = fused || recurrence::taped();
    let x_bth = match taped {
        true => kernels::tape::boundary(x_bth),
        false => x_bth.shallow_clone(),
    };
    let (qkv_btf, z_btvd, b_btv, a_btv) = project(la, w, &x_bth);
    let (qk_bgu2cd, v_bvucd) = match fused {
        true => kernels::conv_qkv(&conv, &qkv_btf, w.get("linear_attn.conv1d.weight")),
        false => conv_qkv(la, w, &qkv_btf, &conv),
    };

    let (beta_btv, g_btv) = gates(w, &b_btv, &a_btv);
    // (B, T, V) -> (B, V, U, C), zeros past T.
    let chunks = |x_btv: &Tensor| {
        x_btv
            .constant_pad_nd([0, 0, 0, p - t])
            .transpose(1, 2)
            .reshape([b, nv, u, c])
    };
    Pre {
        rule_in: vec![qk_bgu2cd, v_bvucd, chunks(&beta_btv), chunks(&g_btv)],
        z_btvd,
    }
}

/// What `kernels::conv_qkv` computes, in tch ops (autograd differentiates them): the
/// causal conv + SiLU, q and k L2-normed (q also by Dk^-1/2) -> [q; k] (B, G, U, 2C, Dk)
/// and v (B, V, U, C, Dv), a view of the conv's output. Past T, the conv's outputs are
/// those of zeros beyond the input's end (the kernel writes zeros); no real position reads
/// them (beta and g are 0 there, so they write nothing to the state, and their outputs are
/// dropped).
fn conv_qkv(
    la: &LinearAttnSpec,
    w: &BlockWeights,
    qkv_btf: &Tensor,
    s: &kernels::ConvQkv,
) -> (Tensor, Tensor) {
    let b = qkv_btf.size()[0];
    let (g, nv, dk, dv, u, c) = (s.g, s.v, s.dk, s.dv, s.chunks, s.chunk);
    let qkv_bfp = short_conv(la, w, qkv_btf, u * c);
    let kind = qkv_bfp.kind();
    // [q; k] and v as one split (its backward writes the conv's gradient once).
    let qkv = qkv_bfp.split_with_sizes([2 * g * dk, nv * dv], 1);
    let qk_bgu2cd = qkv[0].view([b, 2, g, dk, u, c]).permute([0, 2, 4, 1, 5, 3]);
    let norm_bgu2c1 = qk_bgu2cd.linalg_norm(2.0, [-1i64].as_slice(), true, Kind::Float);
    let [inv_q, inv_k] = halves(&(norm_bgu2c1.square() + 1e-6).rsqrt(), 3);
    let inv_bgu2c1 = Tensor::cat(&[inv_q * (dk as f64).powf(-0.5), inv_k], 3);
    // The scale first: the product takes its layout, and so comes out chunk-major.
    let qk_bgu2cd = (inv_bgu2c1.to_kind(kind) * qk_bgu2cd).contiguous();
    let qk_bgu2cd = qk_bgu2cd.view([b, g, u, 2 * c, dk]);
    let v_bvucd = qkv[1].view([b, nv, dv, u, c]).permute([0, 1, 3, 4, 2]);
    (qk_bgu2cd, v_bvucd)
}

/// The delta rule over the U chunks of `rule_in` (as [`pre`] makes them, or a range of
/// their chunks) from the state S (B, V, Dk, Dv) f32 at the first chunk's start (None:
/// zero) -> o (B, V, U, C, Dv) and, if `want_state`, the state after the last chunk.
pub(super) fn core(
    rule_in: &[Tensor],
    state_bvkd: Option<&Tensor>,
    want_state: bool,
) -> (Tensor, Option<Tensor>) {
    let [qk_bgu2cd, v_bvucd, beta_bvuc, g_bvuc] = rule_in else {
        panic!("the chunked rule takes [qk, v, beta, g]")
    };
    let &[b, g, u, c2, dk] = qk_bgu2cd.size().as_slice() else {
        panic!("qk is (B, G, U, 2C, Dk)")
    };
    let (c, nv, dv) = (c2 / 2, beta_bvuc.size()[1], v_bvucd.size()[4]);
    let r = nv / g;
    let kind = qk_bgu2cd.kind();
    let [q_bgucd, k_bgucd] = halves(qk_bgu2cd, -2);
    // [q; k] k^T: q.k and k.k of every chunk in one matmul, (B, G, U, 2C, C).
    let [qk_bgucc, kk_bgucc] = halves(&qk_bgu2cd.matmul(&k_bgucd.transpose(-1, -2)), -2);

    let gamma_bvuc = g_bvuc.cumsum(-1, Kind::Float);
    let gamma_last_bvu1 = gamma_bvuc.narrow(-1, c - 1, 1);
    let exp_gamma_bvuc = gamma_bvuc.exp();

    // Key-head rows scaled per value head: coef (B, V, U, C) * x (B, G, U, C, Dk).
    let per_value_head = |coef_bvuc: &Tensor, x_bgucd: &Tensor| {
        (coef_bvuc.to_kind(kind).view([b, g, r, u, c, 1]) * x_bgucd.unsqueeze(2))
            .view([b, nv, u, c, dk])
    };
    // -beta exp(gamma) k: w comes out negated, so that v' = u + (-w) S needs no scaling
    // (baddbmm's alpha would cost a multiply per chunk in the backward).
    let neg_kbeta_bvucd = per_value_head(&(-beta_bvuc * &exp_gamma_bvuc), &k_bgucd);
    let kdecay_bvucd = per_value_head(&(&gamma_last_bvu1 - &gamma_bvuc).exp(), &k_bgucd);
    let qdecay_bvucd = per_value_head(&exp_gamma_bvuc, &q_bgucd);
    let vbeta_bvucd = (beta_bvuc.to_kind(kind).unsqueeze(-1) * v_bvucd).contiguous();

    // exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal: (B, V, U, C, C), f32.
    let upper_cc = Tensor::ones([c, c], (Kind::Bool, qk_bgu2cd.device())).triu(1);
    let decay_bvucc = (gamma_bvuc.unsqueeze(-1) - gamma_bvuc.unsqueeze(-2))
        .masked_fill_(&upper_cc, f64::NEG_INFINITY)
        .exp();
    let a_bvucc = ((&decay_bvucc * beta_bvuc.unsqueeze(-1)).view([b, g, r, u, c, c])
        * kk_bgucc.unsqueeze(2))
    .view([b, nv, u, c, c]);
    let t_bvucc = inverse_with_its_gradient(&a_bvucc).to_kind(kind);
    let p_bvucc = (decay_bvucc.to_kind(kind).view([b, g, r, u, c, c]) * qk_bgucc.unsqueeze(2))
        .view([b, nv, u, c, c]);
    let neg_w_bvucd = t_bvucc.matmul(&neg_kbeta_bvucd);

    // (B V, U, ...) for the (B V)-batched matmuls of the recurrence.
    let flat = |x: &Tensor| {
        let mut s = x.size();
        s.splice(0..2, [b * nv]);
        x.view(s.as_slice())
    };
    let ins = [
        flat(&neg_w_bvucd),
        flat(&qdecay_bvucd),
        flat(&kdecay_bvucd),
        flat(&p_bvucc),
        flat(&gamma_last_bvu1.exp().unsqueeze(-1)),
    ];
    let (t_nucc, vbeta_nucd) = (flat(&t_bvucc), flat(&vbeta_bvucd));
    let state_nkd = state_bvkd.map(|s| s.view([b * nv, dk, dv]));
    let grad = ins
        .iter()
        .chain([&t_nucc, &vbeta_nucd])
        .any(Tensor::requires_grad)
        || state_nkd.as_ref().is_some_and(Tensor::requires_grad);
    let [w_, q_, k_, p_, d_] = &ins;
    let (o_nucd, state_nkd) = match grad && recurrence::taped() {
        // u = T (beta v) chunk by chunk inside: the backward keeps T and beta v (as
        // autograd would for the product), not u.
        true => recurrence::on_tape(
            [&t_nucc, &vbeta_nucd, w_, q_, k_, p_, d_],
            state_nkd.as_ref(),
            want_state,
        ),
        false => {
            let u_ = t_nucc.matmul(&vbeta_nucd);
            state_recurrence(&u_, w_, q_, k_, p_, d_, state_nkd, want_state)
        }
    };
    (
        o_nucd.view([b, nv, u, c, dv]),
        state_nkd.map(|s| s.view([b, nv, dk, dv])),
    )
}

/// The gated RMSNorm per value head, then out_proj: o (B, V, U, C, Dv) and z (B, T, V,
/// Dv) -> (B, T, H). With `fused`, the norm, its gate and the move to out_proj's layout run
/// as one op (`kernels::gated_norm`) where it runs for this shape, device and dtype.
pub(super) fn post(
    spec: &ModelSpec,
    w: &BlockWeights,
    o_bvucd: &Tensor,
    z_btvd: &Tensor,
    fused: bool,
) -> Tensor {
    let &[b, nv, u, c, dv] = o_bvucd.size().as_slice() else {
        panic!("o is (B, V, U, C, Dv)")
    };
    let o_bvpd = o_bvucd.view([b, nv, u * c, dv]);
    let norm_w = w.get("linear_attn.norm.weight");
    let eps = spec.rms_norm_eps;
    let gated_btf = match fused && kernels::gated_norm_supported(&o_bvpd, z_btvd) {
        true => kernels::gated_norm(&o_bvpd, z_btvd, norm_w, eps, gated_norm_ops),
        false => gated_norm_ops(&o_bvpd, z_btvd, norm_w, eps),
    };
    linear(&gated_btf, w, "linear_attn.out_proj")
}

/// The gated norm in tch ops (and `kernels::gated_norm`'s mirror): o (B, V, P, Dv) over
/// the padded chunks, z (B, T, V, Dv), w (Dv) -> (B, T, V Dv). silu(z) comes first in the
/// product, which so takes its (B, T, V, Dv) layout, out_proj's input.
fn gated_norm_ops(o_bvpd: &Tensor, z_btvd: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let &[b, t, nv, dv] = z_btvd.size().as_slice() else {
        panic!("z is (B, T, V, Dv)")
    };
    let normed_bvtd = o_bvpd.narrow(2, 0, t).rms_norm([dv], Some(w), eps);
    (z_btvd.silu() * normed_bvtd.transpose(1, 2)).reshape([b, t, nv * dv])
}

/// The input projections as two matmuls: the conv input [q; k; v] (B, T, F), and [z; b; a]
/// returned as z (B, T, V, Dv), b and a (B, T, V). Qwen3-Next's fused weights are grouped by
/// key head (per head: Dk query, Dk key, (V/G) Dv value and (V/G) Dv z rows; (V/G) b then
/// (V/G) a rows); their rows are put in Qwen3.5's order first, a copy of the weights rather
/// than of the activations.
fn project(
    la: &LinearAttnSpec,
    w: &BlockWeights,
    x_bth: &Tensor,
) -> (Tensor, Tensor, Tensor, Tensor) {
    let (b, t, h) = (x_bth.size()[0], x_bth.size()[1], x_bth.size()[2]);
    let (g, v) = (la.num_k_heads as i64, la.num_v_heads as i64);
    let (dk, dv, r) = (la.k_head_dim as i64, la.v_head_dim as i64, v / g);
    let (w_qkv, w_zba) = if la.fused_qkvz {
        let qkvz = w
            .get("linear_attn.in_proj_qkvz.weight")
            .view([g, 2 * dk + 2 * r * dv, h])
            .split_with_sizes([dk, dk, r * dv, r * dv], 1);
        let ba = w
            .get("linear_attn.in_proj_ba.weight")
            .view([g, 2 * r, h])
            .split_with_sizes([r, r], 1);
        // Every key head's rows of one part, heads one after another.
        let rows = |x: &Tensor| x.reshape([-1, h]);
        (
            Tensor::cat(&[rows(&qkvz[0]), rows(&qkvz[1]), rows(&qkvz[2])], 0),
            Tensor::cat(&[rows(&qkvz[3]), rows(&ba[0]), rows(&ba[1])], 0),
        )
    } else {
        (
            w.get("linear_attn.in_proj_qkv.weight").shallow_clone(),
            Tensor::cat(
                &[
                    w.get("linear_attn.in_proj_z.weight"),
                    w.get("linear_attn.in_proj_b.weight"),
                    w.get("linear_attn.in_proj_a.weight"),
                ],
                0,
            ),
        )
    };
    let qkv_btf = x_bth.linear(&w_qkv, None::<Tensor>);
    let zba_btf = x_bth.linear(&w_zba, None::<Tensor>);
    let zba_btf = match recurrence::taped() {
        true => kernels::tape::boundary(&zba_btf),
        false => zba_btf,
    };
    let mut zba = zba_btf.split_with_sizes([v * dv, v, v], -1);
    let (a_btv, b_btv) = (zba.pop().expect("a"), zba.pop().expect("b"));
    let z_btvd = zba.pop().expect("z").view([b, t, v, dv]);
    (qkv_btf, z_btvd, b_btv, a_btv)
}

/// The two halves of `x` along `dim`, as views (one autograd node: its backward is a cat).
fn halves(x: &Tensor, dim: i64) -> [Tensor; 2] {
    let n = x.size()[dim.rem_euclid(x.dim() as i64) as usize];
    let mut parts = x.split(n / 2, dim);
    let second = parts.pop().expect("two halves");
    [parts.pop().expect("two halves"), second]
}

/// The state's dtype for a compute dtype: f32 (f64 where the computation is, in tests).
pub(super) fn state_kind(kind: Kind) -> Kind {
    match kind {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

/// The recurrence across chunks. Per chunk, from the state S (Dk, Dv) at its start
/// (`state_nkd` for the first, None: 0): v' = u - w S, o = q S + P v', and, for the next
/// chunk, S <- d S + k^T v'. u, -w, q, k (N, U, C, D) and p (N, U, C, C) in the compute
/// dtype, d (N, U, 1, 1) f32, for N = B V independent heads -> o (N, U, C, Dv), and the
/// state after the last chunk if `want_state`. The state stays f32; its products run in
/// the compute dtype.
#[allow(clippy::too_many_arguments)]
pub(super) fn state_recurrence(
    u_nucd: &Tensor,
    neg_w_nucd: &Tensor,
    q_nucd: &Tensor,
    k_nucd: &Tensor,
    p_nucc: &Tensor,
    d_nu11: &Tensor,
    state_nkd: Option<Tensor>,
    want_state: bool,
) -> (Tensor, Option<Tensor>) {
    let kind = u_nucd.kind();
    let (us, neg_ws, qs) = (u_nucd.unbind(1), neg_w_nucd.unbind(1), q_nucd.unbind(1));
    let (ks, ps, ds) = (k_nucd.unbind(1), p_nucc.unbind(1), d_nu11.unbind(1));
    let mut state = state_nkd; // (N, Dk, Dv) f32
    let mut outs = Vec::with_capacity(us.len());
    for n in 0..us.len() {
        let (v_new, o) = match &state {
            None => (us[n].shallow_clone(), ps[n].matmul(&us[n])),
            Some(s) => {
                let s = s.to_kind(kind);
                let v_new = us[n].baddbmm(&neg_ws[n], &s, 1, 1);
                let o = qs[n].matmul(&s).baddbmm(&ps[n], &v_new, 1, 1);
                (v_new, o)
            }
        };
        if n + 1 < us.len() || want_state {
            let kv = ks[n].transpose(-1, -2).matmul(&v_new);
            state = Some(match state {
                None => kv.to_kind(state_kind(kind)),
                Some(s) => kv.addcmul(&s, &ds[n]),
            });
        }
        outs.push(o);
    }
    (Tensor::stack(&outs, 1), state.filter(|_| want_state))
}

/// [`unit_lower_inverse`] with its gradient written out: T = (I + A)^-1 is computed without
/// grad, and returned as `T - T (A - A') T` for A' a detached copy of A's strictly lower part:
/// the same value (the bracket is zero), and the gradient of the product,
/// `dA = -T^T dT T^T` (strictly lower part), is exactly that of the inverse. Two (C, C)
/// matmuls each way replace autograd through the blocked inverse (its products of 16 x 16
/// blocks, stacks and pads, and the pieces it keeps for the backward).
pub(super) fn inverse_with_its_gradient(a: &Tensor) -> Tensor {
    let t = tch::no_grad(|| unit_lower_inverse(a));
    if !a.requires_grad() {
        return t;
    }
    let strict = a.tril(-1);
    let zero = &strict - strict.detach();
    &t - t.matmul(&zero).matmul(&t)
}

/// (I + A)^-1 for A strictly lower triangular (what is on and above the diagonal is
/// ignored) over the last two dims (C, C), C = 16 2^k, in A's dtype; the rest are batch
/// dims. Divide and conquer, both halves in one batched call:
/// `[[I + A11, 0], [A21, I + A22]]^-1 = [[T11, 0], [-T22 A21 T11, T22]]`; down to 16x16
/// blocks, inverted by the product form `(I + M)^-1 = (I - M)(I + M^2)(I + M^4)(I + M^8)`
/// (M^16 = 0). Quadrants come from `unbind`, so the backward assembles A's gradient with
/// stacks rather than zero-filled copies.
pub(super) fn unit_lower_inverse(a: &Tensor) -> Tensor {
    let mut shape = a.size();
    let n = *shape.last().expect("a matrix");
    if n <= BLOCK {
        let m = a.tril(-1);
        let mut t = Tensor::eye(n, (a.kind(), a.device())) - &m;
        let mut power = m.matmul(&m);
        let mut p = 2;
        while p < n {
            t = &t + t.matmul(&power);
            p *= 2;
            if p < n {
                power = power.matmul(&power);
            }
        }
        return t;
    }
    let h = n / 2;
    shape.truncate(shape.len() - 2);
    shape.extend([2, h, 2, h]);
    let rows = a.view(shape.as_slice()).unbind(-4); // each (.., h, 2, h)
    let (top, bottom) = (rows[0].unbind(-2), rows[1].unbind(-2));
    let (a11, a21, a22) = (&top[0], &bottom[0], &bottom[1]);
    let diag = unit_lower_inverse(&Tensor::stack(&[a11, a22], -3)).unbind(-3);
    let (t11, t22) = (&diag[0], &diag[1]);
    let t21 = -t22.matmul(&a21.matmul(t11));
    Tensor::cat(
        &[t11.constant_pad_nd([0, h]), Tensor::cat(&[&t21, t22], -1)],
        -2,
    )
}
