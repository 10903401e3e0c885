//! The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next and
//! GPT-OSS, as their `*SparseMoeBlock` / `*Experts` / `*TopKRouter` modules compute it.
//!
//! Expert compute is batched per expert, never per token: the (token, slot) pairs are sorted
//! by expert once, the tokens gathered once, each expert runs one matmul chain over its
//! contiguous rows, and one `index_add` scatters the weighted outputs back. Autograd gives
//! the backward (the worker recomputes each layer under grad).
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N = B*T tokens, E experts, K
//! experts per token, S = N*K routed (token, slot) pairs, M one expert's rows, I expert
//! intermediate size.

use mt::config::hf::{ExpertAct, ExpertNames, ModelSpec, MoeSpec, Router};
use tch::{Kind, Tensor};

use super::BlockWeights;
use super::common::{activation, gated_mlp_named, linear};

/// (B, T, H) -> (B, T, H).
pub fn sparse_mlp(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor) -> Tensor {
    let m = spec.moe.as_ref().expect("sparse layers have a MoE spec");
    let size = x_bth.size();
    let x_nh = x_bth.reshape([-1, size[2]]);
    let (weights_nk, experts_nk) = route(m, w, &x_nh);
    let mut out_nh = experts(spec, m, w, &x_nh, &weights_nk, &experts_nk);
    if m.shared_expert_intermediate_size.is_some() {
        let shared_nh = gated_mlp_named(w, spec, &x_nh, "mlp.shared_expert");
        let gate_n1 = linear(&x_nh, w, "mlp.shared_expert_gate").sigmoid();
        out_nh = out_nh + gate_n1 * shared_nh;
    }
    out_nh.reshape(size.as_slice())
}

/// The router: top-k weights (N, K) and expert indices (N, K) of every token.
fn route(m: &MoeSpec, w: &BlockWeights, x_nh: &Tensor) -> (Tensor, Tensor) {
    let router = match m.names {
        ExpertNames::Mixtral => "block_sparse_moe.gate",
        ExpertNames::Qwen => "mlp.gate",
        ExpertNames::GptOssFused => "mlp.router",
    };
    let logits_ne = linear(x_nh, w, router);
    let k = m.top_k as i64;
    match m.router {
        Router::SoftmaxTopK { renormalize } => {
            let probs_ne = logits_ne.softmax(-1, Kind::Float);
            let (top_nk, idx_nk) = probs_ne.topk(k, -1, true, true);
            let top_nk = if renormalize {
                &top_nk / top_nk.sum_dim_intlist(-1, true, Kind::Float)
            } else {
                top_nk
            };
            let top_nk = if m.weights_in_compute_dtype {
                top_nk.to_kind(x_nh.kind())
            } else {
                top_nk
            };
            (top_nk, idx_nk)
        }
        Router::TopKSoftmax => {
            let (top_nk, idx_nk) = logits_ne.topk(k, -1, true, true);
            (top_nk.softmax(1, top_nk.kind()), idx_nk)
        }
    }
}

/// Sum over each token's K experts of `weight * expert(x)`: (N, H) -> (N, H).
fn experts(
    spec: &ModelSpec,
    m: &MoeSpec,
    w: &BlockWeights,
    x_nh: &Tensor,
    weights_nk: &Tensor,
    experts_nk: &Tensor,
) -> Tensor {
    let k = m.top_k as i64;
    // Sort the S = N*K (token, slot) pairs by expert; each expert's rows are then contiguous.
    let experts_s = experts_nk.reshape([-1]);
    let order_s = experts_s.argsort_stable(true, 0, false);
    let counts: Vec<i64> = Vec::try_from(experts_s.bincount(None::<Tensor>, m.num_experts as i64))
        .expect("bincount is an int64 vector");
    let token_s = order_s.divide_scalar_mode(k, "floor");
    let weight_s = weights_nk.reshape([-1]).index_select(0, &order_s);
    let x_sh = x_nh.index_select(0, &token_s);
    let mut outs = Vec::with_capacity(m.num_experts);
    let mut start = 0;
    for (e, &rows) in counts.iter().enumerate() {
        if rows == 0 {
            continue;
        }
        let x_mh = x_sh.narrow(0, start, rows);
        outs.push(expert(spec, m, w, e, &x_mh));
        start += rows;
    }
    let y_sh = Tensor::cat(&outs, 0);
    // Weighted in the router weights' dtype (f32 for Mixtral), then cast, as transformers.
    let y_sh = (y_sh * weight_s.unsqueeze(-1)).to_kind(x_nh.kind());
    x_nh.zeros_like().index_add(0, &token_s, &y_sh)
}

/// Expert `e` on its rows: (M, H) -> (M, H).
fn expert(spec: &ModelSpec, m: &MoeSpec, w: &BlockWeights, e: usize, x_mh: &Tensor) -> Tensor {
    match m.names {
        ExpertNames::GptOssFused => {
            let ExpertAct::ClampedSwiglu { alpha, limit } = m.act else {
                panic!("GPT-OSS experts use the clamped SwiGLU")
            };
            let ei = e as i64;
            let gate_up_m2i = x_mh.matmul(&w.get("mlp.experts.gate_up_proj").get(ei))
                + w.get("mlp.experts.gate_up_proj_bias").get(ei);
            // Gate and up interleave along the last dim: even columns gate, odd up.
            let i2 = gate_up_m2i.size()[1];
            let gate_mi = gate_up_m2i.slice(1, 0, i2, 2).clamp_max(limit);
            let up_mi = gate_up_m2i.slice(1, 1, i2, 2).clamp(-limit, limit);
            let glu_mi = &gate_mi * (&gate_mi * alpha).sigmoid();
            let h_mi = (up_mi + 1.0) * glu_mi;
            h_mi.matmul(&w.get("mlp.experts.down_proj").get(ei))
                + w.get("mlp.experts.down_proj_bias").get(ei)
        }
        ExpertNames::Mixtral => {
            let p = format!("block_sparse_moe.experts.{e}");
            let gate_mi = activation(&linear(x_mh, w, &format!("{p}.w1")), spec.hidden_act);
            let up_mi = linear(x_mh, w, &format!("{p}.w3"));
            linear(&(gate_mi * up_mi), w, &format!("{p}.w2"))
        }
        ExpertNames::Qwen => gated_mlp_named(w, spec, x_mh, &format!("mlp.experts.{e}")),
    }
}
