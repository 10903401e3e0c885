//! The routed experts of a sparse MLP block: each (token, slot) pair through the expert the
//! router chose for it, and each token's K outputs weighted and summed.
//!
//! The S = N*K pairs are sorted by expert once (a stable sort: an expert's rows keep token
//! order) and their tokens gathered once, so each expert's rows are contiguous. After the
//! experts, the inverse permutation puts the outputs back in (token, slot) order and one
//! reduction over the K slots sums them, weighted.
//!
//! Each of these steps is written so that its backward is a gather or a reduction, never an
//! atomic scatter-add (which races, and ran at a fraction of copy speed on H200: with the
//! plain index_select forms the glue took as long as the grouped GEMMs themselves,
//! benches/results/moe_glue_profile_H200_2026-11-24.md):
//! - the token gather is an embedding lookup (backward: the sorted indices' segment sums);
//! - under grad, the un-permutation writes the sorted rows to their pairs (`index_copy`,
//!   backward: an index_select); without grad it is the cheaper gather, equal bit for bit.
//!
//! The backward is deterministic. (A batched (1, K) x (K, H) product for the weighted sum
//! was faster still, but rounds Mixtral's f32 router weights to bf16 first, and the bf16 vs
//! f32 check drifted further from the CPU run with it.)
//!
//! On CUDA in bf16 the un-permutation, the weighting and the sum are one fused op instead
//! (`kernels::moe_combine`, [`fused_combine`]): a warp per token gathers its K rows, and the
//! backward a warp per sorted row, with no (S, H) intermediate in token order; the token
//! gather's backward is the same kernel with unit weights (`kernels::moe_gather`), a sum
//! of each token's K rows in place of the embedding's sort and segment sums; and a SiLU
//! gate times up between the grouped GEMMs (GPT-OSS's clamped one likewise) is one
//! elementwise op (`kernels::swiglu`, `kernels::clamped_swiglu`). Their backwards run from
//! the kernels' tape, so the block's input and, where the aux loss reads them, the router
//! logits enter it through tape boundaries (worker/src/model/moe.rs), and the layer's
//! backward runs its MLP half on its own (worker/src/layer.rs).
//!
//! Two ways run the experts over the sorted rows, chosen per block by [`grouped`]:
//! - **grouped** (the default on CUDA in bf16): one grouped GEMM per projection over all
//!   experts (`torch._grouped_mm`), the weights read in place as (E, out, in) stacks of the
//!   flat block (`Block::expert_stacks`; GPT-OSS's are fused already), the expert
//!   boundaries (cumulative row counts, int32) computed and kept on the device. Nothing in
//!   the layer waits for the host.
//! - **per expert** (elsewhere): one matmul chain per expert over its rows, the row counts
//!   read back to the host: transformers' own loop, and the reference the grouped path is
//!   checked against.
//!
//! `MT_MOE_EXPERTS=grouped|loop` forces one way (the grouped path also runs on CPU in f32,
//! where launcher/tests/golden.rs checks it against transformers; scripts/check_gpu.sh
//! compares the two on CUDA). `MT_MOE_COMBINE=fused|plain` likewise forces the fused combine
//! (its tch mirror on CPU, which the golden test drives with the grouped experts) or the
//! plain ops.
//!
//! Shapes: N tokens, H hidden size, E experts, K experts per token, S = N*K routed pairs,
//! M one expert's rows, I expert intermediate size.

use mt::config::hf::{Activation, ExpertAct, ExpertNames, ModelSpec, MoeSpec, Router};
use mt::layout::{Block, ExpertStack};
use tch::{Device, Kind, Tensor};

use super::BlockWeights;
use super::common::{activation, gated_mlp_named, linear};
use crate::kernels;

/// Whether routed outputs of width `h` and dtype `kind` on `device` are combined by
/// the fused op (`kernels::moe_combine`): by default where its kernels take them (CUDA,
/// bf16); `MT_MOE_COMBINE` forces it (`fused`: the mirror on CPU) or the plain ops
/// (`plain`).
pub fn fused_combine(h: i64, kind: Kind, device: Device) -> bool {
    let forced = mt::switches::get().fused.moe_combine;
    // Router weights are f32, or in the compute dtype: the kernels take both.
    let supported = kernels::moe_combine_supported(kind, h, Kind::Float, device)
        && kernels::moe_combine_supported(kind, h, kind, device);
    forced.unwrap_or(device.is_cuda()) && supported
}

/// Whether `block`'s experts run as grouped GEMMs over weights of `kind` on `device`
/// (`stacks` are the block's `Block::expert_stacks`). False for a block without experts.
pub fn grouped(block: &Block, stacks: &[ExpertStack], kind: Kind, device: Device) -> bool {
    // The (rows, cols) of each expert weight: stacked per-expert tensors or fused ones.
    let mut dims: Vec<&[usize]> = stacks.iter().map(|s| s.shape.as_slice()).collect();
    for name in [
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
        "feed_forward.experts.gate_up_proj",
        "feed_forward.experts.down_proj",
    ] {
        dims.extend(block.tensor(name).map(|t| &t.shape[1..]));
    }
    if dims.is_empty() {
        return false;
    }
    // The grouped GEMM reads rows (of weights and of activations alike) at 16-byte
    // strides; expert copies start at 64-element offsets in the block.
    let elem = kind.elt_size_in_bytes();
    let aligned = dims
        .iter()
        .flat_map(|d| d.iter())
        .all(|&n| (n * elem).is_multiple_of(16));
    match forced() {
        Some(false) => false,
        Some(true) => {
            assert!(
                aligned,
                "MT_MOE_EXPERTS=grouped: the expert weights {dims:?} of {kind:?} are not all \
                 multiples of 16 bytes wide, as the grouped GEMM needs"
            );
            true
        }
        None => device.is_cuda() && kind == Kind::BFloat16 && aligned,
    }
}

/// `MT_MOE_EXPERTS`: Some(true) grouped, Some(false) per expert, None by device.
fn forced() -> Option<bool> {
    mt::switches::get().moe_experts
}

/// Sum over each token's K experts of `weight * expert(x)`: (N, H) -> (N, H), for router
/// weights (N, K) and expert indices (N, K); Llama 4's experts take `weight * x` instead.
pub fn routed(
    spec: &ModelSpec,
    m: &MoeSpec,
    w: &BlockWeights,
    x_nh: &Tensor,
    weights_nk: &Tensor,
    experts_nk: &Tensor,
) -> Tensor {
    let (n, k) = experts_nk.size2().expect("router indices are (N, K)");
    let device = x_nh.device();
    // Pair p = token * K + slot; pair_s lists the pairs in expert order.
    let (expert_s, pair_s) = experts_nk.reshape([-1]).sort_stable(true, 0, false);
    let fused = fused_combine(x_nh.size()[1], x_nh.kind(), device);
    let pairs = fused.then(|| kernels::Pairs::new(&pair_s, k));
    let x_sh = match &pairs {
        Some(pairs) => kernels::moe_gather(x_nh, pairs),
        None => {
            let token_s = pair_s.divide_scalar_mode(k, "floor");
            Tensor::embedding(x_nh, &token_s, -1, false, false)
        }
    };
    // Llama 4's router scores scale what enters each expert; the others' what leaves it.
    let scales_input = m.router == Router::TopKSigmoidInput;
    let x_sh = match scales_input {
        true => {
            x_sh * weights_nk
                .reshape([-1])
                .index_select(0, &pair_s)
                .unsqueeze(-1)
        }
        false => x_sh,
    };
    let y_sh = match w.grouped_experts() {
        true => grouped_experts(spec, m, w, &x_sh, &expert_s, fused),
        false => per_expert(spec, m, w, &x_sh, &expert_s),
    };
    if let Some(pairs) = &pairs {
        // Llama 4's outputs are summed unweighted: the combine with unit weights.
        let weights_nk = match scales_input {
            true => weights_nk.ones_like(),
            false => weights_nk.shallow_clone(),
        };
        return kernels::moe_combine(&y_sh, pairs, &weights_nk);
    }
    // Row r of y_sh is pair pair_s[r]: the inverse permutation restores (token, slot) order.
    let y_nkh = match y_sh.requires_grad() {
        // In place: `index_copy` would first clone the empty rows, one more (S, H) buffer.
        true => y_sh.empty_like().index_copy_(0, &pair_s, &y_sh),
        false => {
            let arange_s = Tensor::arange(n * k, (Kind::Int64, device));
            let unsort_s = pair_s.zeros_like().scatter(0, &pair_s, &arange_s);
            y_sh.index_select(0, &unsort_s)
        }
    }
    .view([n, k, -1]);
    // Weighted in the router weights' dtype (f32 for Mixtral), then cast, as transformers.
    let weighted_nkh = match scales_input {
        true => y_nkh.to_kind(x_nh.kind()),
        false => (y_nkh * weights_nk.unsqueeze(-1)).to_kind(x_nh.kind()),
    };
    weighted_nkh.sum_dim_intlist(1, false, x_nh.kind())
}

/// Every expert as grouped GEMMs over the sorted rows: (S, H) -> (S, H).
fn grouped_experts(
    spec: &ModelSpec,
    m: &MoeSpec,
    w: &BlockWeights,
    x_sh: &Tensor,
    expert_s: &Tensor,
    fused: bool,
) -> Tensor {
    let experts_e = Tensor::arange(m.num_experts as i64, (Kind::Int64, x_sh.device()));
    // Where each expert's rows end: the rows of experts <= e (int32, on the device).
    let offs_e = experts_e.searchsorted(expert_s, true, true, "right", None::<Tensor>);
    // x W per expert, for stacked W (E, in, out).
    let mm = |x: &Tensor, w_eio: &Tensor| {
        x.internal_grouped_mm(w_eio, Some(&offs_e), None::<&Tensor>, None::<Kind>)
    };
    // x W^T per expert, for the stack of one per-expert nn.Linear weight (E, out, in).
    let linear = |x: &Tensor, stack: &str| mm(x, &w.get(stack).transpose(1, 2));
    // act(gate) * up: one fused op with the fused combine, for SiLU.
    let glu = |gate_si: Tensor, up_si: Tensor| {
        let i = gate_si.size()[1];
        let kernel = fused
            && spec.hidden_act == Activation::Silu
            && kernels::swiglu_supported(gate_si.kind(), i, gate_si.device());
        match kernel {
            true => kernels::swiglu(&gate_si, &up_si),
            false => activation(&gate_si, spec.hidden_act) * up_si,
        }
    };
    match m.names {
        ExpertNames::GptOssFused => {
            let ExpertAct::ClampedSwiglu { alpha, limit } = m.act else {
                panic!("GPT-OSS experts use the clamped SwiGLU")
            };
            // Each row's expert bias, as the product of the rows' one-hot experts (S, E)
            // with the biases: exact, and its backward is a GEMM, where a gather's would
            // scatter-add S rows into E.
            let onehot_se = expert_s
                .unsqueeze(1)
                .eq_tensor(&experts_e.unsqueeze(0))
                .to_kind(x_sh.kind());
            let bias = |name: &str| onehot_se.matmul(w.get(name));
            let gate_up_s2i =
                mm(x_sh, w.get("mlp.experts.gate_up_proj")) + bias("mlp.experts.gate_up_proj_bias");
            let i = gate_up_s2i.size()[1] / 2;
            let h_si = match fused && kernels::swiglu_supported(x_sh.kind(), i, x_sh.device()) {
                true => kernels::clamped_swiglu(&gate_up_s2i, alpha, limit, clamped_swiglu),
                false => clamped_swiglu(&gate_up_s2i, alpha, limit),
            };
            mm(&h_si, w.get("mlp.experts.down_proj")) + bias("mlp.experts.down_proj_bias")
        }
        ExpertNames::Mixtral => {
            let p = "block_sparse_moe.experts";
            let gate_si = linear(x_sh, &format!("{p}.w1.weight"));
            let up_si = linear(x_sh, &format!("{p}.w3.weight"));
            linear(&glu(gate_si, up_si), &format!("{p}.w2.weight"))
        }
        ExpertNames::Llama4Fused => {
            // Gate and up side by side along the last dim: the first half gates.
            let gate_up_s2i = mm(x_sh, w.get("feed_forward.experts.gate_up_proj"));
            let i = gate_up_s2i.size()[1] / 2;
            let gate_si = activation(&gate_up_s2i.narrow(1, 0, i), spec.hidden_act);
            let h_si = gate_up_s2i.narrow(1, i, i) * gate_si;
            mm(&h_si, w.get("feed_forward.experts.down_proj"))
        }
        ExpertNames::Qwen | ExpertNames::DeepSeek => {
            let p = "mlp.experts";
            let gate_si = linear(x_sh, &format!("{p}.gate_proj.weight"));
            let up_si = linear(x_sh, &format!("{p}.up_proj.weight"));
            linear(&glu(gate_si, up_si), &format!("{p}.down_proj.weight"))
        }
    }
}

/// One matmul chain per expert over its rows of the sorted x: (S, H) -> (S, H).
fn per_expert(
    spec: &ModelSpec,
    m: &MoeSpec,
    w: &BlockWeights,
    x_sh: &Tensor,
    expert_s: &Tensor,
) -> Tensor {
    // Rows per expert, on the host (one small device-to-host copy per layer).
    let counts_e = expert_s
        .bincount(None::<Tensor>, m.num_experts as i64)
        .to_device(Device::Cpu);
    let counts: Vec<i64> = Vec::try_from(&counts_e).expect("bincount is an int64 vector");
    let mut outs = Vec::with_capacity(m.num_experts);
    let mut start = 0;
    for (e, &rows) in counts.iter().enumerate() {
        if rows > 0 {
            outs.push(expert(spec, m, w, e, &x_sh.narrow(0, start, rows)));
            start += rows;
        }
    }
    Tensor::cat(&outs, 0)
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
            let h_mi = clamped_swiglu(&gate_up_m2i, alpha, limit);
            h_mi.matmul(&w.get("mlp.experts.down_proj").get(ei))
                + w.get("mlp.experts.down_proj_bias").get(ei)
        }
        ExpertNames::Mixtral => {
            let p = format!("block_sparse_moe.experts.{e}");
            let gate_mi = activation(&linear(x_mh, w, &format!("{p}.w1")), spec.hidden_act);
            let up_mi = linear(x_mh, w, &format!("{p}.w3"));
            linear(&(gate_mi * up_mi), w, &format!("{p}.w2"))
        }
        ExpertNames::Qwen | ExpertNames::DeepSeek => {
            gated_mlp_named(w, spec, x_mh, &format!("mlp.experts.{e}"))
        }
        ExpertNames::Llama4Fused => {
            let ei = e as i64;
            let gate_up_m2i = x_mh.matmul(&w.get("feed_forward.experts.gate_up_proj").get(ei));
            let i = gate_up_m2i.size()[1] / 2;
            let gate_mi = activation(&gate_up_m2i.narrow(1, 0, i), spec.hidden_act);
            let h_mi = gate_up_m2i.narrow(1, i, i) * gate_mi;
            h_mi.matmul(&w.get("feed_forward.experts.down_proj").get(ei))
        }
    }
}

/// GPT-OSS's activation of the fused gate/up output (.., 2I) -> (.., I): gate and up
/// interleave along the last dim (even columns gate, odd up); the gate is clamped above
/// at `limit`, up to ±`limit`, and `(up + 1) * gate * sigmoid(alpha * gate)`.
fn clamped_swiglu(gate_up: &Tensor, alpha: f64, limit: f64) -> Tensor {
    let i2 = gate_up.size()[gate_up.dim() - 1];
    let gate = gate_up.slice(-1, 0, i2, 2).clamp_max(limit);
    let up = gate_up.slice(-1, 1, i2, 2).clamp(-limit, limit);
    let glu = &gate * (&gate * alpha).sigmoid();
    (up + 1.0) * glu
}
