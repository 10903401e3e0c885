//! The sparse mixture-of-experts MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
//! GPT-OSS, GLM-4.5, DeepSeek-V3 and Llama 4, as their `*SparseMoeBlock` / `*MoE` /
//! `*Experts` / `*TopkRouter` modules compute it.
//!
//! This file holds the router and the block around the experts; `experts.rs` runs the
//! experts themselves (grouped GEMMs over all experts on GPUs, one matmul chain per expert
//! as the reference). Autograd gives the backward (the worker recomputes each layer under
//! grad), but for the fused combine of the experts' outputs (`experts::fused_combine`),
//! whose backward runs from the kernels' tape: the block's input, and the router logits
//! where the aux loss reads them too, then enter it through tape boundaries, so that the
//! tape's second pass into them does not meet a node autograd's first pass has run.
//!
//! The router load-balancing loss ([`RouterAux`]) is transformers' `load_balancing_loss_func`
//! over one micro-batch: with f_e the share of (unpadded token, slot) assignments that went
//! to expert e and P_e the mean router probability of e, both over all sparse layers,
//! `aux = E * sum_e f_e P_e`. Only P carries a gradient, so once the forward pass has
//! counted f, each layer's part of the gradient comes from its own probabilities alone.
//!
//! Shapes: B batch rows, T sequence length, H hidden size, N = B*T tokens, E experts, K
//! experts per token, S = N*K routed (token, slot) pairs, M one expert's rows, I expert
//! intermediate size.

use std::cell::RefCell;

use mt::config::hf::{ExpertNames, ModelSpec, MoeSpec, Router};
use tch::{Device, Kind, Tensor};

use super::common::{gated_mlp_named, linear};
use super::{BlockWeights, LayerCtx, experts};
use crate::kernels;

/// The router load-balancing loss of one micro-batch, added to the training loss with
/// weight `router_aux_loss_coef * (this micro-batch's label tokens / the global batch's)`:
/// with one micro-batch in the step that is exactly `loss + coef * aux_loss` as
/// transformers' `*ForCausalLM` computes it when `output_router_logits` is set.
pub struct RouterAux {
    /// (N,) 1 for real tokens, 0 for padding (the attention mask).
    mask_n: Tensor,
    num_experts: i64,
    /// Unpadded tokens of the micro-batch (counted on the host: no device read per layer).
    tokens: f64,
    /// `coef * micro-batch share`, the weight of this micro-batch's aux loss.
    weight: f64,
    /// Counted by the forward pass over every sparse layer: top-k assignments per expert
    /// (E), router probabilities per expert (E), unpadded rows (layers x tokens).
    counts_e: RefCell<Tensor>,
    probs_e: RefCell<Tensor>,
    rows: RefCell<f64>,
    /// The differentiable term of the layer just recomputed, for the engine to add.
    term: RefCell<Option<Tensor>>,
}

impl RouterAux {
    /// For a micro-batch of rows of `row_lens` real tokens padded to `seq_len`; `share` is
    /// its label tokens over the global batch's. None unless the spec enables the loss.
    pub fn new(
        spec: &ModelSpec,
        row_lens: &[usize],
        seq_len: usize,
        share: f64,
        device: Device,
    ) -> Option<RouterAux> {
        let m = spec.moe.as_ref().filter(|m| m.router_aux_loss)?;
        let t = seq_len as i64;
        let lens_b1 = Tensor::from_slice(&row_lens.iter().map(|&l| l as i64).collect::<Vec<_>>())
            .unsqueeze(1);
        let mask_n = Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .lt_tensor(&lens_b1)
            .to_kind(Kind::Float)
            .reshape([-1])
            .to_device(device);
        let e = m.num_experts as i64;
        let zeros = || RefCell::new(Tensor::zeros([e], (Kind::Float, device)));
        let tokens = row_lens.iter().map(|&l| l.min(seq_len)).sum::<usize>() as f64;
        Some(RouterAux {
            mask_n,
            num_experts: e,
            tokens,
            weight: m.router_aux_loss_coef * share,
            counts_e: zeros(),
            probs_e: zeros(),
            rows: RefCell::new(0.0),
            term: RefCell::new(None),
        })
    }

    /// One sparse layer's router logits (N, E). Without grad (the forward pass) they are
    /// counted; with grad (the recompute) the layer's term is kept for [`Self::take_term`].
    fn observe(&self, logits_ne: &Tensor, top_k: i64) {
        let probs_ne = logits_ne.softmax(-1, logits_ne.kind()).to_kind(Kind::Float);
        let masked_e =
            (&probs_ne * self.mask_n.unsqueeze(1)).sum_dim_intlist(0, false, Kind::Float);
        if logits_ne.requires_grad() {
            // d aux / d P_e sums: E * f_e / rows, with f_e = counts_e / rows.
            let rows = *self.rows.borrow();
            let coeff_e = &*self.counts_e.borrow() * (self.num_experts as f64 / (rows * rows));
            let term = (masked_e * coeff_e).sum(Kind::Float) * self.weight;
            *self.term.borrow_mut() = Some(term);
            return;
        }
        let (_, chosen_nk) = probs_ne.topk(top_k, -1, true, true);
        let slot_mask_s = self.mask_n.repeat_interleave_self_int(top_k, 0, None);
        let mut counts = self.counts_e.borrow_mut();
        *counts = counts.scatter_add(0, &chosen_nk.reshape([-1]), &slot_mask_s);
        let mut probs = self.probs_e.borrow_mut();
        *probs = &*probs + masked_e;
        *self.rows.borrow_mut() += self.tokens;
    }

    /// The weighted aux loss of the micro-batch, once the forward pass has counted it.
    pub fn loss(&self) -> f64 {
        let rows = *self.rows.borrow();
        if rows == 0.0 {
            return 0.0;
        }
        let f_e = &*self.counts_e.borrow() / rows;
        let p_e = &*self.probs_e.borrow() / rows;
        (f_e * p_e).sum(Kind::Double).double_value(&[]) * self.num_experts as f64 * self.weight
    }

    /// The term of the layer just recomputed under grad (None for dense layers), to be
    /// added to the objective that layer backpropagates.
    pub fn take_term(&self) -> Option<Tensor> {
        self.term.borrow_mut().take()
    }
}

/// (B, T, H) -> (B, T, H).
pub fn sparse_mlp(spec: &ModelSpec, w: &BlockWeights, x_bth: &Tensor, lc: &LayerCtx) -> Tensor {
    let m = spec.moe.as_ref().expect("sparse layers have a MoE spec");
    let size = x_bth.size();
    let x_nh = x_bth.reshape([-1, size[2]]);
    let fused = experts::fused_combine(size[2], x_bth.kind(), x_bth.device());
    let x_nh = match fused {
        true => kernels::tape::boundary(&x_nh),
        false => x_nh,
    };
    let (weights_nk, experts_nk) = route(m, w, &x_nh, lc.aux, fused);
    let routed_nh = experts::routed(spec, m, w, &x_nh, &weights_nk, &experts_nk);
    let out_nh = match (m.shared_expert_intermediate_size, m.names) {
        (None, _) => routed_nh,
        (Some(_), ExpertNames::DeepSeek) => {
            routed_nh + gated_mlp_named(w, spec, &x_nh, "mlp.shared_experts")
        }
        (Some(_), ExpertNames::Llama4Fused) => {
            routed_nh + gated_mlp_named(w, spec, &x_nh, "feed_forward.shared_expert")
        }
        (Some(_), _) => {
            let shared_nh = gated_mlp_named(w, spec, &x_nh, "mlp.shared_expert");
            let gate_n1 = linear(&x_nh, w, "mlp.shared_expert_gate").sigmoid();
            routed_nh + gate_n1 * shared_nh
        }
    };
    out_nh.reshape(size.as_slice())
}

/// The router: top-k weights (N, K) and expert indices (N, K) of every token.
fn route(
    m: &MoeSpec,
    w: &BlockWeights,
    x_nh: &Tensor,
    aux: Option<&RouterAux>,
    fused: bool,
) -> (Tensor, Tensor) {
    let router = match m.names {
        ExpertNames::Mixtral => "block_sparse_moe.gate",
        ExpertNames::Qwen | ExpertNames::DeepSeek => "mlp.gate",
        ExpertNames::GptOssFused => "mlp.router",
        ExpertNames::Llama4Fused => "feed_forward.router",
    };
    if let Router::SigmoidGroupTopK {
        n_group,
        topk_group,
        renormalize,
        scaling,
    } = m.router
    {
        let group = GroupLimit {
            n_group: n_group as i64,
            topk_group: topk_group as i64,
            renormalize,
            scaling,
        };
        return group.route(m, w, x_nh, router);
    }
    let logits_ne = linear(x_nh, w, router);
    // With the fused combine, the aux loss's gradient reaches the logits in autograd's
    // pass, the router weights' in the tape's.
    let logits_ne = match (aux, fused) {
        (Some(_), true) => kernels::tape::boundary(&logits_ne),
        _ => logits_ne,
    };
    if let Some(aux) = aux {
        aux.observe(&logits_ne, m.top_k as i64);
    }
    weights(m, x_nh, &logits_ne)
}

/// The top-k router weights (N, K) and expert indices (N, K) from the logits (N, E).
fn weights(m: &MoeSpec, x_nh: &Tensor, logits_ne: &Tensor) -> (Tensor, Tensor) {
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
        // In the compute dtype: these scale the experts' inputs (`experts`).
        Router::TopKSigmoidInput => {
            let (top_nk, idx_nk) = logits_ne.topk(k, -1, true, true);
            let scores_nk = top_nk.to_kind(Kind::Float).sigmoid();
            (scores_nk.to_kind(x_nh.kind()), idx_nk)
        }
        Router::SigmoidGroupTopK { .. } => unreachable!("routed above"),
    }
}

/// GLM-4.5's and DeepSeek-V3's router (`Router::SigmoidGroupTopK`).
struct GroupLimit {
    n_group: i64,
    topk_group: i64,
    renormalize: bool,
    scaling: f64,
}

impl GroupLimit {
    /// In f32: sigmoid scores; experts chosen by score + the correction bias among the
    /// best groups; weights (N, K) f32 are the chosen scores, renormalized and scaled.
    fn route(
        &self,
        m: &MoeSpec,
        w: &BlockWeights,
        x_nh: &Tensor,
        router: &str,
    ) -> (Tensor, Tensor) {
        let f32 = Kind::Float;
        let weight_eh = w.get(&format!("{router}.weight")).to_kind(f32);
        let scores_ne = x_nh
            .to_kind(f32)
            .linear(&weight_eh, None::<Tensor>)
            .sigmoid();
        let bias_e = w.get(&format!("{router}.e_score_correction_bias"));
        let choice_ne = &scores_ne + bias_e.to_kind(f32);
        let (n, e) = (choice_ne.size()[0], m.num_experts as i64);
        let per_group = e / self.n_group;
        // A group scores the sum of its two best experts; the best `topk_group` stay.
        let group_ng = choice_ne
            .view([n, self.n_group, per_group])
            .topk(2, -1, true, true)
            .0
            .sum_dim_intlist(-1, false, f32);
        let (_, groups_nk) = group_ng.topk(self.topk_group, -1, true, false);
        let keep_ng = group_ng.zeros_like().scatter_value(1, &groups_nk, 1.0);
        let keep_ne = keep_ng
            .unsqueeze(-1)
            .expand([n, self.n_group, per_group], false)
            .reshape([n, e]);
        let choice_ne = choice_ne.masked_fill(&keep_ne.eq(0.0), f64::NEG_INFINITY);
        let (_, idx_nk) = choice_ne.topk(m.top_k as i64, -1, true, false);
        let mut weights_nk = scores_ne.gather(1, &idx_nk, false);
        if self.renormalize {
            weights_nk = &weights_nk / (weights_nk.sum_dim_intlist(-1, true, f32) + 1e-20);
        }
        (weights_nk * self.scaling, idx_nk)
    }
}
